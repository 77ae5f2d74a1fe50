"""tma_linear (engine/kernels/tma_gemm.py) against F.linear, and the rows the layers route to it.

The kernel is Gluon code for Hopper's copy engine and warpgroup MMAs: it has no interpreter path, so its
cases are marked `gpu` (and skip on a GPU that is no Hopper). The configs and the layers' routing on CPU run
everywhere.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")
from engine.kernels import tma_gemm  # noqa: E402
from engine.kernels.tma_gemm import TmaConfig, default_config, takes, tma_linear  # noqa: E402
from engine.layers import fusion  # noqa: E402

SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (200, 96)]  # 0.6B projections, and ragged


def hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and tma_gemm.gl is not None


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@pytest.mark.parametrize("M", [1, 17, 64, 65, 256])
@pytest.mark.parametrize("N, K", SHAPES)
def test_default_config_splits_k_evenly_and_fits_shared_memory(M, N, K):
    config = default_config(M, N, K)
    k_tiles = -(-K // config.block_k)
    assert k_tiles % config.split == 0 and k_tiles // config.split >= 1
    assert 2 <= config.stages <= max(2, k_tiles // config.split)
    assert config.block_m in (64, 128) and config.num_warps == config.block_m // 16
    shared = config.stages * (config.block_m + config.block_n) * config.block_k * 2
    assert shared + config.block_m * config.block_n * 2 <= 227 << 10


def test_layers_keep_cpu_rows_off_the_kernel(monkeypatch):
    monkeypatch.setattr(tma_gemm, "MIN_ROWS", 1)
    x, w = torch.randn(8, 64), torch.randn(32, 64)
    assert not takes(x, w)
    assert torch.equal(fusion.linear(x, w), F.linear(x, w))


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU and Triton with Gluon")
@pytest.mark.parametrize("M", [1, 5, 33, 64, 100, 256])
@pytest.mark.parametrize("N, K", SHAPES)
def test_tma_linear_matches_f_linear_and_writes_every_element(M, N, K):
    gen = torch.Generator(device="cuda").manual_seed(M * 7 + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5
    ref = F.linear(x.float(), w.float())
    k_tiles = -(-K // 64)
    configs = {default_config(M, N, K)} | {TmaConfig(64 if M <= 64 else 128, bn, 64, 2, split)
                                             for bn in (16, 64) for split in (1, 2, 4) if k_tiles % split == 0}
    for config in configs:
        for attempt in range(2):  # a split's tickets are back at zero after each launch
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            tma_linear(x, w, out, config)
            torch.cuda.synchronize()
            assert not torch.isnan(out).any(), (config, attempt)
            assert relative_error(out, ref) < 1e-2, (config, attempt)


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU and Triton with Gluon")
def test_tma_linear_replays_in_a_cuda_graph_with_new_inputs():
    x = torch.randn(40, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16) / 2048 ** 0.5
    assert takes(x, w) and default_config(40, 1024, 2048).split > 1
    fusion.linear(x, w)  # compiled, workspace sized, before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fusion.linear(x, w)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        assert relative_error(out, F.linear(x.float(), w.float())) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not hopper(), reason="needs a Hopper GPU and Triton with Gluon")
@pytest.mark.parametrize("M", [1, 24, 64, 100, 256])
@pytest.mark.parametrize("N, K", [(6144, 1024), (200, 96)])
def test_gated_tma_linear_gives_silu_and_mul_of_the_product(M, N, K):
    from engine.kernels.norm_act import act_and_mul
    gen = torch.Generator(device="cuda").manual_seed(M + N)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16, generator=gen) / K ** 0.5
    ref = act_and_mul(F.linear(x, w))
    for block_n in (16, 32, 64, 128):
        out = torch.full((M, N // 2), float("nan"), device="cuda", dtype=torch.bfloat16)
        tma_linear(x, w, out, TmaConfig(64 if M <= 64 else 128, block_n, 64, 2), gated=True)
        torch.cuda.synchronize()
        assert not torch.isnan(out).any(), block_n
        assert relative_error(out, ref) < 1e-2, block_n
    assert torch.equal(tma_linear(x, w, gated=True), tma_linear(x, w, gated=True))


def test_gated_tma_linear_refuses_an_odd_weight():
    if not hopper():
        pytest.skip("the shape check follows the Hopper-only import")
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="even"):
        tma_linear(x, torch.randn(33, 64, device="cuda", dtype=torch.bfloat16), gated=True)


@pytest.mark.skipif(tma_gemm.gl is None, reason="needs Triton with Gluon's Hopper module")
def test_tma_linear_refuses_an_output_of_another_shape():
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"out must be \[4, 32\]"):
        tma_linear(x, w, out=torch.empty(4, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"out must be \[4, 16\]"):  # gated: half the weight's rows
        tma_linear(x, w, out=torch.empty(4, 32, dtype=torch.bfloat16), gated=True)
