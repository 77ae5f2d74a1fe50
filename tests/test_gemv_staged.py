"""The staged GEMV (engine/kernels/gemv_staged.py): its setting on any machine; on the GPU, its products
against F.linear and the register GEMV, and a PDL chain of it replayed in a CUDA graph in stream order.
Gluon kernels do not run under the Triton interpreter, so the kernel cases are GPU-only."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from engine.kernels import gemv_staged  # noqa: E402
from engine.kernels.gemv import gemv  # noqa: E402
from engine.kernels.norm_act import rms_norm, silu_and_mul  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
# (N, K) of the Qwen3-0.6B projections (qkv, o, gate_up, down), one N that leaves the last slice partial, and
# a K of four parts of 1,024
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (1000, 512), (2048, 4096)]


@pytest.fixture
def setting(monkeypatch):
    def set_to(value: str | None):
        if value is None:
            monkeypatch.delenv("REDLINE_GEMV_STAGED", raising=False)
        else:
            monkeypatch.setenv("REDLINE_GEMV_STAGED", value)
        gemv_staged.staged_setting.cache_clear()
    yield set_to
    gemv_staged.staged_setting.cache_clear()


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("value", ["yes", "2", "6144x", "6144x1024x2", "6144xabc"])
def test_bad_staged_setting_is_a_clear_error(setting, value):
    setting(value)
    with pytest.raises(ValueError, match="REDLINE_GEMV_STAGED"):
        gemv_staged.staged_setting()


def test_staged_setting_reads_off_on_and_shapes(setting):
    setting(None)
    assert gemv_staged.staged_setting() is False
    setting("1")
    assert gemv_staged.staged_setting() is True
    setting("6144x1024,1024x3072")
    assert gemv_staged.staged_setting() == frozenset({(6144, 1024), (1024, 3072)})


def test_staged_gemv_is_never_taken_for_cpu_tensors(setting):
    setting("1")
    assert not gemv_staged.takes(torch.zeros(1, 1024, dtype=torch.bfloat16), torch.zeros(6144, 1024, dtype=torch.bfloat16))


@pytest.mark.parametrize("N,K,rows", [(6144, 1024, 32), (1024, 3072, 8), (1024, 2048, 8), (4096, 256, 32),
                                      (3, 1024, 4)])
def test_slices_fit_the_shared_memory_budget(N, K, rows):
    assert gemv_staged.slice_rows(N, K) == rows
    assert rows * K <= gemv_staged.MAX_SLICE or rows == gemv_staged.NUM_WARPS
    assert -(-N // rows) >= gemv_staged.MIN_PROGRAMS or rows == gemv_staged.NUM_WARPS


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("N,K", SHAPES, ids=str)
def test_staged_gemv_matches_f_linear_and_the_register_gemv(N, K):
    gen = torch.Generator(device="cuda").manual_seed(N + K)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.bfloat16)
    w, b = randn(N, K) / K ** 0.5, randn(N)
    x, gate_up, residual = randn(1, K), randn(1, 2 * K), randn(1, K)
    norm_weight = torch.rand(K, device="cuda", generator=gen).to(torch.bfloat16) + 0.5
    cases = {
        "plain": (gemv_staged.gemv_staged(x, w), gemv(x, w), F.linear(x.float(), w.float())),
        "bias": (gemv_staged.gemv_staged(x, w, b), gemv(x, w, b), F.linear(x.float(), w.float(), b.float())),
        "gated": (gemv_staged.gemv_staged(gate_up, w, gated=True), gemv(gate_up, w, gated=True),
                  F.linear(silu_and_mul(gate_up).float(), w.float())),
        "norm": (gemv_staged.gemv_staged(x, w, norm=(None, norm_weight, 1e-6)),
                 gemv(x, w, norm=(None, norm_weight, 1e-6)), F.linear(rms_norm(x, norm_weight, 1e-6).float(), w.float())),
    }
    out, new_residual = gemv_staged.gemv_staged(x, w, norm=(residual, norm_weight, 1e-6))
    want, want_residual = rms_norm(x, norm_weight, 1e-6, residual=residual)
    assert torch.equal(new_residual, want_residual), "the new residual differs from the RMSNorm kernel's"
    cases["norm-residual"] = (out, gemv(x, w, norm=(residual, norm_weight, 1e-6))[0], F.linear(want.float(), w.float()))
    for name, (staged, registers, ref) in cases.items():
        assert staged.shape == (1, N) and staged.dtype == torch.bfloat16, name
        assert relative_error(staged, ref) < 1e-2, f"{name}: {relative_error(staged, ref):.3g} from F.linear"
        assert relative_error(staged, registers) < 1e-2, f"{name}: {relative_error(staged, registers):.3g} from gemv"


@pytest.mark.gpu
@needs_cuda
def test_staged_gemv_chain_replays_in_a_cuda_graph_in_stream_order(setting):
    """Each GEMV reads what the kernel before it wrote, and starts early under PDL: a missing wait would read
    stale rows. A graph of staged GEMVs and norms, replayed on new inputs, equals the chain launched eagerly
    without PDL."""
    setting("1")
    gen = torch.Generator(device="cuda").manual_seed(0)
    weights = [(torch.randn(4096, 1024, device="cuda", generator=gen, dtype=torch.bfloat16) / 32,
                torch.randn(1024, 4096, device="cuda", generator=gen, dtype=torch.bfloat16) / 64,
                torch.rand(1024, device="cuda", generator=gen, dtype=torch.bfloat16) + 0.5) for _ in range(6)]
    assert gemv_staged.takes(torch.zeros(1, 1024, device="cuda", dtype=torch.bfloat16), weights[0][0])
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)

    def chain(h):
        for up, down, norm in weights:
            h = rms_norm(gemv(gemv(h, up), down), norm, 1e-6)
        return h

    chain(x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chain(x)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("REDLINE_PDL", "0")
            ref = chain(x.clone())
        assert torch.equal(out, ref)
