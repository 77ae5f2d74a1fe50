"""GPU check of the attention kernels: correctness on many shapes, CUDA-graph capture, then timings.

    python scripts/kernel_check.py [--backend triton|flash] [--skip-sweep] [--out DIR]
    python scripts/kernel_check.py --decode-spread-only   # the two decode schedules on unequal lengths

Prints a short table last; writes <out>/kernel_check_<backend>.json with every figure. Imports only
engine.kernels, engine.attention (for the flash backend), engine.bench (the cards' copy bandwidth) and
tests/kernel_cases.py.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

from kernel_cases import (GPU_SHAPES, check_balanced_decode, check_decode_padding, check_shape,  # noqa: E402
                          make_case, reference_attention, relative_error)

from engine.bench import MEASURED_BANDWIDTH  # noqa: E402

BANDWIDTH = MEASURED_BANDWIDTH["H100"]  # bytes/s, device copy; main() sets the running card's
MATMUL = 697e12       # bf16 FLOP/s, 8192^3 matmul on the same card
ROWS: list[tuple] = []  # (what, config, ms, floor ms, note)


def bench_ms(fn) -> float:
    from triton.testing import do_bench
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def meta_of(case, is_decode: bool) -> SimpleNamespace:
    return SimpleNamespace(slot_mapping=None, cu_seqlens_q=case.cu_seqlens_q, seqlens_k=case.seqlens_k,
                           block_tables=case.block_tables, max_seqlen_q=case.max_seqlen_q,
                           max_seqlen_k=case.max_seqlen_k, is_decode=is_decode)


def kv_bytes(case) -> int:
    hkv, d = case.k_cache.shape[2:]
    return int(case.seqlens_k.sum().item()) * hkv * d * case.k_cache.element_size() * 2


def attention_flops(case) -> float:
    """2 matmuls x 2 flops over the causal (q, k) pairs actually visible."""
    h, d = case.q.shape[1:]
    cu, pairs = case.cu_seqlens_q.tolist(), 0
    for b, k in enumerate(case.seqlens_k.tolist()):
        q = cu[b + 1] - cu[b]
        pairs += q * k - q * (q - 1) // 2
    return 4.0 * pairs * h * d


# ---- correctness ----------------------------------------------------------------------------------

def check_correctness(log: dict) -> bool:
    ok = True
    for shape in GPU_SHAPES:
        res = check_shape(shape, "cuda")
        log["correctness"][shape.name] = res
        ok &= report(shape.name, res)
    res = check_decode_padding("cuda")
    log["correctness"]["padding"] = res
    ok &= report("padding", res)
    return ok & check_decode_schedules(log)


def check_decode_schedules(log: dict) -> bool:
    res = check_balanced_decode("cuda")
    log["correctness"]["balanced_decode"] = res
    return report("balanced decode schedule", res)


def report(name: str, res: dict) -> bool:
    bad = {k: v for k, v in res.items() if not v[1] or (v[0] != 0 if "store" in k else v[0] >= 1e-2)}
    worst = max((v[0] for k, v in res.items() if "store" not in k), default=0.0)
    print(f"  {name:28s} {'ok ' if not bad else 'BAD'} worst rel err {worst:.2e} {bad or ''}", flush=True)
    return not bad


def check_backend(backend, log: dict) -> bool:
    """A backend (flash) through the contract against the fp32 reference on a few shapes."""
    ok = True
    for page in (256, 128, 16):
        for name, q_lens, k_lens in (("mixed", [1, 300, 1, 17, 1000], [900, 300, 40, 2100, 1500]),
                                     ("decode", [1] * 64, [int(x) for x in torch.randint(1, 3000, (64,))])):
            case = make_case(q_lens, k_lens, 16, 8, 128, page, torch.bfloat16, "cuda", seed=page)
            try:
                out = backend.forward(case.q, case.k_cache, case.v_cache, meta_of(case, name == "decode"), case.scale)
                err = relative_error(out, reference_attention(case))
                res = {f"{name}_page{page}": (err, not out.isnan().any().item())}
            except Exception as e:  # report and carry on: one unsupported page size is not the whole answer
                res = {f"{name}_page{page}": (float("inf"), False)}
                log.setdefault("errors", []).append(f"{name} page {page}: {e!r}")
                print(f"  {name} page {page}: {e!r}")
            log["correctness"].update(res)
            ok &= report(f"{backend.name} {name} page {page}", res)
    return ok


def check_graphs(log: dict) -> bool:
    """Capture paged_decode in a CUDA graph, change the inputs in place, replay, compare with eager."""
    from engine.kernels import paged_decode
    ok = True
    for batch, ctx, splits in ((256, 1024, None), (4, 3000, None), (32, 2000, 4)):
        case = make_case([1] * batch, [ctx] * batch, 16, 8, 128, 256, torch.bfloat16, "cuda", seed=batch)
        out = torch.empty_like(case.q)
        max_k = case.block_tables.shape[1] * 256
        for _ in range(2):  # compile before capture
            paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k, case.block_tables, max_k,
                         case.scale, out=out, num_splits=splits)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k, case.block_tables, max_k,
                         case.scale, out=out, num_splits=splits)
        case.seqlens_k.copy_(torch.randint(1, ctx + 1, (batch,), device="cuda", dtype=torch.int32))
        case.q.copy_(torch.randn_like(case.q))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, reference_attention(case))
        res = {f"graph_b{batch}": (err, not out.isnan().any().item())}
        log["correctness"].update(res)
        ok &= report(f"cuda graph decode b={batch}", res)
    return ok


# ---- timing ---------------------------------------------------------------------------------------

def fmt(config) -> str:
    """Short label of a timing variant: split count and/or tile config."""
    if config is None:
        return ""
    if isinstance(config, str):
        return config
    if isinstance(config, tuple):
        splits, cfg = config
        return " ".join(x for x in (f"splits={splits}" if splits else "", fmt(cfg)) if x)
    fields = {"block_m": "bm", "block_n": "bn", "num_warps": "w", "num_stages": "s"}
    return " ".join(f"{short}{getattr(config, name)}" for name, short in fields.items() if hasattr(config, name))


def time_decode(attend, tag: str, batch: int, ctx: int, page: int, configs, log: dict) -> None:
    case = make_case([1] * batch, [ctx] * batch, 16, 8, 128, page, torch.bfloat16, "cuda", seed=1)
    floor = kv_bytes(case) / BANDWIDTH * 1e3
    for config in configs:
        try:
            ms = bench_ms(lambda: attend(case, True, config))
        except Exception as e:
            print(f"  decode {tag} {config}: {e!r}")
            continue
        row = (f"decode b={batch} ctx={ctx} page={page}", (tag + " " + fmt(config)).strip(), ms, floor,
               f"{kv_bytes(case) / ms / 1e9:.2f} TB/s")
        ROWS.append(row)
        log["timing"].append(dict(zip(("what", "config", "ms", "floor_ms", "note"), row)))


def graph_ms(fn) -> float:
    """Median time of one replay of `fn` captured in a CUDA graph, as the engine runs decode."""
    for _ in range(2):  # compile before capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return bench_ms(graph.replay)


def time_decode_spread(sweep: bool, log: dict, batches=(1, 8, 16, 32, 64, 128, 256)) -> None:
    """Decode over bench-like unequal lengths (uniform in 100..2048 in one batch), both schedules, each
    replayed in a CUDA graph captured with max_seqlen_k 4096 (the engine captures at max_model_len).
    The balanced schedule's plan is made once outside the graph (the engine makes it once a step for all
    layers); its own time is a row of its own."""
    from engine.kernels import DecodeConfig, paged_decode
    from engine.kernels.paged_decode import plan_decode
    variants = [("grid", None), ("balanced", None)]
    variants += [("balanced", DecodeConfig(programs_per_sm=p, items_per_program=i))
                 for p, i in ((4, 4), (4, 16), (8, 16))]
    if sweep:
        variants += [("grid", DecodeConfig(grid_programs_per_sm=p)) for p in (8, 16)]
    for model, heads, kv_heads in (("qwen3-0.6b", 16, 8), ("qwen3-8b tp1", 32, 8), ("qwen3-8b tp2", 16, 4)):
        for batch in batches:
            lengths = torch.randint(100, 2049, (batch,), generator=torch.Generator().manual_seed(batch)).tolist()
            case = make_case([1] * batch, lengths, heads, kv_heads, 128, 256, torch.bfloat16, "cuda", seed=batch)
            ref = reference_attention(case)
            floor = kv_bytes(case) / BANDWIDTH * 1e3
            what = f"decode {model} b={batch} ctx 100-2048"
            for schedule, config in variants:
                out = torch.empty_like(case.q)
                plan = plan_decode(case.seqlens_k, kv_heads, 4096, config=config) if schedule == "balanced" else None
                run = lambda: paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k,  # noqa: E731
                                           case.block_tables, 4096, case.scale, out=out, config=config,
                                           schedule=schedule, plan=plan)
                ms = graph_ms(run)
                err = relative_error(out, ref)
                label = schedule if config is None else \
                    f"{schedule} {config.grid_programs_per_sm} programs/SM" if schedule == "grid" else \
                    f"{schedule} {config.programs_per_sm}/SM {config.items_per_program} items/program"
                row = (what, label, ms, floor,
                       f"{kv_bytes(case) / ms / 1e9:.2f} TB/s" + ("" if err < 1e-2 else f" WRONG (rel err {err:.2e})"))
                ROWS.append(row)
                log["timing"].append(dict(zip(("what", "config", "ms", "floor_ms", "note"), row)))
            ms = graph_ms(lambda: plan_decode(case.seqlens_k, kv_heads, 4096))
            row = (what, "balanced: the plan kernel alone (once a step)", ms, 0.0, "")
            ROWS.append(row)
            log["timing"].append(dict(zip(("what", "config", "ms", "floor_ms", "note"), row)))


def time_prefill(attend, tag: str, name: str, q_lens, k_lens, page: int, configs, log: dict) -> None:
    case = make_case(q_lens, k_lens, 16, 8, 128, page, torch.bfloat16, "cuda", seed=2)
    flops = attention_flops(case)
    floor = max(flops / MATMUL, kv_bytes(case) / BANDWIDTH) * 1e3
    for config in configs:
        try:
            ms = bench_ms(lambda: attend(case, False, config))
        except Exception as e:
            print(f"  prefill {tag} {config}: {e!r}")
            continue
        row = (f"{name} page={page}", (tag + " " + fmt(config)).strip(), ms, floor,
               f"{flops / ms / 1e9:.0f} TFLOP/s")
        ROWS.append(row)
        log["timing"].append(dict(zip(("what", "config", "ms", "floor_ms", "note"), row)))


def triton_attend(case, is_decode: bool, config):
    from engine.kernels import paged_decode, paged_prefill
    if is_decode:
        if config in ("balanced", "grid"):  # a schedule with its automatic sizes
            return paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k, case.block_tables,
                                case.max_seqlen_k, case.scale, schedule=config)
        splits, cfg = config if config else (None, None)
        return paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k, case.block_tables,
                            case.max_seqlen_k, case.scale, num_splits=splits, config=cfg)
    if config == "unrouted":  # every row through the prefill kernel (the first version)
        return paged_prefill(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seqlens_k,
                             case.block_tables, case.max_seqlen_q, case.scale)
    out = paged_prefill(case.q, case.k_cache, case.v_cache, case.cu_seqlens_q, case.seqlens_k,
                        case.block_tables, case.max_seqlen_q, case.scale, config=config, skip_decodes=True)
    return paged_decode(case.q, case.k_cache, case.v_cache, case.seqlens_k, case.block_tables,
                        case.max_seqlen_k, case.scale, out=out, cu_seqlens_q=case.cu_seqlens_q)


def sdpa_prefill(batch: int, length: int, log: dict) -> None:
    """Yardstick: torch's fused causal attention on contiguous (unpaged) K/V of the same prompts."""
    import torch.nn.functional as F
    q = torch.randn(batch, 16, length, 128, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(batch, 8, length, 128, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    ms = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    flops = 4.0 * batch * 16 * 128 * length * (length + 1) / 2
    row = (f"fresh prefill {batch}x{length} (contiguous)", "torch sdpa", ms, flops / MATMUL * 1e3,
           f"{flops / ms / 1e9:.0f} TFLOP/s")
    ROWS.append(row)
    log["timing"].append(dict(zip(("what", "config", "ms", "floor_ms", "note"), row)))


def time_store(log: dict) -> None:
    from engine.kernels import store_kvcache
    n, hkv, d = 16384, 8, 128
    key = torch.randn(n, hkv, d, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    k_cache = torch.empty(n // 256 + 8, 256, hkv, d, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.empty_like(k_cache)
    slots = torch.randperm(k_cache.shape[0] * 256, device="cuda")[:n]
    ms = bench_ms(lambda: store_kvcache(key, value, k_cache, v_cache, slots))
    nbytes = 4 * key.numel() * 2
    row = (f"store_kvcache {n} tokens", "", ms, nbytes / BANDWIDTH * 1e3, f"{nbytes / ms / 1e9:.2f} TB/s")
    ROWS.append(row)
    log["timing"].append(dict(zip(("what", "config", "ms", "floor_ms", "note"), row)))


def mixed_lengths(seed: int = 3):
    """One 2048-token chunk over a 2048 cached prefix beside 255 decodes of ~1k context (a bench step)."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randint(200, 2000, (255,), generator=gen).tolist()
    return [2048] + [1] * 255, [4096] + k


def run_timing(backend: str, sweep: bool, log: dict) -> None:
    from engine.kernels import DecodeConfig, PrefillConfig
    if backend == "triton":
        attend = triton_attend
        dec_cfgs = ["balanced", "grid"]
        pre_cfgs = [None]
        if sweep:
            dec_cfgs += [(1, DecodeConfig(bn, w, s)) for bn, w, s in
                         ((32, 4, 2), (64, 4, 2), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (64, 2, 3))]
            pre_cfgs += [PrefillConfig(bm, bn, w, s) for bm, bn, w, s in
                         ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 128, 4, 2), (256, 64, 8, 2), (64, 128, 8, 2))]
    else:
        from engine.attention import get_backend
        impl = get_backend(backend, torch.device("cuda"))
        attend = lambda case, is_decode, _cfg: impl.forward(case.q, case.k_cache, case.v_cache,  # noqa: E731
                                                            meta_of(case, is_decode), case.scale)
        dec_cfgs = pre_cfgs = [None]
    if backend == "triton":
        time_decode_spread(sweep, log)
    for page in (256, 16):
        time_decode(attend, backend, 256, 1024, page, dec_cfgs if page == 256 else dec_cfgs[:2], log)
    for batch, ctx in ((64, 2048), (8, 4096), (1, 8192)):
        time_decode(attend, backend, batch, ctx, 256, dec_cfgs[:2], log)
    if backend == "triton" and sweep:
        for splits in (1, 2, 4, 8, 16):
            time_decode(attend, backend, 8, 4096, 256, [(splits, None)], log)
    time_prefill(attend, backend, "fresh prefill 8x1024", [1024] * 8, [1024] * 8, 256, pre_cfgs, log)
    time_prefill(attend, backend, "chunk 4x2048 over 2048 cached", [2048] * 4, [4096] * 4, 256, pre_cfgs, log)
    q_lens, k_lens = mixed_lengths()
    mixed_cfgs = [None, "unrouted"] if backend == "triton" else [None]
    time_prefill(attend, backend, "mixed 2048-chunk + 255 decodes", q_lens, k_lens, 256, mixed_cfgs, log)
    time_prefill(attend, backend, "fresh prefill 8x1024", [1024] * 8, [1024] * 8, 16, [None], log)
    if backend == "triton":
        sdpa_prefill(8, 1024, log)
        time_store(log)


def print_table() -> None:
    print(f"\n{'what':44s} {'config':56s} {'ms':>9s} {'floor':>8s} {'x floor':>7s}  rate")
    for what, config, ms, floor, note in ROWS:
        print(f"{what:44s} {config[:56]:56s} {ms:9.4f} {floor:8.4f} {ms / floor if floor else float('nan'):7.2f}  {note}")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="triton", choices=["triton", "flash"])
    parser.add_argument("--skip-sweep", action="store_true")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--decode-spread-only", action="store_true",
                        help="only the decode schedule checks and the unequal-length decode timings (triton)")
    parser.add_argument("--bandwidth", type=float, default=None,
                        help="bytes/s for the byte floors (default: the measured copy rate of the H100 or H200)")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    assert torch.cuda.is_available(), "kernel_check needs a CUDA GPU"
    import triton
    global BANDWIDTH
    gpu = torch.cuda.get_device_name()
    BANDWIDTH = args.bandwidth or next((bw for name, bw in MEASURED_BANDWIDTH.items() if name in gpu), BANDWIDTH)
    log = {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__, "bandwidth": BANDWIDTH,
           "backend": args.backend, "correctness": {}, "timing": []}
    print(f"{gpu}  torch {torch.__version__}  triton {triton.__version__}  backend {args.backend}  "
          f"floors at {BANDWIDTH / 1e12:.2f} TB/s", flush=True)
    t0 = time.time()
    ok = True
    try:
        if args.decode_spread_only:
            ok = check_decode_schedules(log) and check_graphs(log)
        elif args.backend == "triton":
            ok = check_correctness(log) and check_graphs(log)
        else:
            from engine.attention import get_backend
            from engine.attention.flash_backend import flash_import_errors
            for error in flash_import_errors():  # say why, rather than only "needs flash_attn"
                print(f"  import failed: {error}")
                log.setdefault("errors", []).append(error)
            ok = check_backend(get_backend(args.backend, torch.device("cuda")), log)
        print(f"correctness {'PASSED' if ok else 'FAILED'} ({time.time() - t0:.0f} s)", flush=True)
        if args.decode_spread_only and not args.skip_timing:
            time_decode_spread(not args.skip_sweep, log)
        elif not args.skip_timing:
            run_timing(args.backend, not args.skip_sweep, log)
    except Exception:
        log["traceback"] = traceback.format_exc()
        print(log["traceback"])
        ok = False
    finally:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        name = f"kernel_check_{args.backend}{'_decode_spread' if args.decode_spread_only else ''}.json"
        (Path(args.out) / name).write_text(json.dumps(log, indent=1, default=str))
        print_table()
        print(f"correctness {'PASSED' if ok else 'FAILED'}; total {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
