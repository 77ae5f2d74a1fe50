"""Would a small decode batch's step be shorter if each layer's later weights were queued into L2 while its
attention runs? At batch 1 the fused decode kernel spends ~11 us of a 25 us layer on a chain of
latencies while HBM idles, and the o, gate_up and down projections after it then stream 23 MB of weights.

In the captured decode graphs (only there), after each layer's qkv projection a kernel on a side stream
issues `prefetch.global.L2::evict_last` for every 128-byte line of the chosen weights (one instruction a
thread a line, nothing waits for the lines), and the side stream joins the graph's stream after the last
layer, so nothing in the layer chain waits for it. Then the decode graph is timed as
scripts/decode_graph_time.py times it.

    PYTHONPATH=. python3 scripts/l2_prefetch_check.py --prefetch mlp [decode_graph_time.py's options]
--prefetch: off (the engine as it is), attn_out_mlp (o, gate_up, down of the layer), all (those and the
next layer's qkv). One variant a process, so each captures its own graphs.
"""
from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

LINE = 128        # bytes a prefetch instruction covers
LINES = 1024      # lines a program issues


@triton.jit
def _prefetch_l2_kernel(ptr, num_lines, LINE: tl.constexpr, LINES: tl.constexpr):
    line = tl.program_id(0) * LINES + tl.arange(0, LINES)
    addr = ptr.to(tl.pointer_type(tl.int8)) + tl.minimum(line, num_lines - 1).to(tl.int64) * LINE
    tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;", "=r,l", [addr],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(t: torch.Tensor) -> None:
    num_lines = triton.cdiv(t.numel() * t.element_size(), LINE)
    _prefetch_l2_kernel[(triton.cdiv(num_lines, LINES),)](t, num_lines, LINE=LINE, LINES=LINES, num_warps=4)


def install(variant: str) -> None:
    """Wrap the decoder layer and model forwards so captured graphs carry the side-stream prefetches."""
    from engine.models import llama

    side = {}
    layer_forward, model_forward = llama.DecoderLayer.forward, llama.DecoderModel.forward

    def weights_after_attention(layer, next_layer):
        found = [layer.self_attn.o_proj.weight, layer.mlp.gate_up_proj.weight, layer.mlp.down_proj.weight]
        if variant == "all" and next_layer is not None:
            found.append(next_layer.self_attn.qkv_proj.weight)
        return found

    def forward(self, positions, x, residual):
        qkv, residual = self.input_layernorm.linear(x, residual, self.self_attn.qkv_proj)
        if torch.cuda.is_current_stream_capturing():
            stream = side.setdefault("stream", torch.cuda.Stream())
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for w in weights_after_attention(self, getattr(self, "_next_layer", None)):
                    prefetch_l2(w)
            side["used"] = True
        x = self.self_attn(positions, qkv)
        gate_up, residual = self.post_attention_layernorm.linear(x, residual, self.mlp.gate_up_proj)
        return self.mlp(gate_up), residual

    def model(self, input_ids, positions):
        layers = list(self.layers)
        for layer, nxt in zip(layers, layers[1:] + [None]):
            object.__setattr__(layer, "_next_layer", nxt)
        out = model_forward(self, input_ids, positions)
        if side.pop("used", False):  # join before the LM head and before the capture ends
            torch.cuda.current_stream().wait_stream(side["stream"])
        return out

    llama.DecoderLayer.forward = forward
    llama.DecoderModel.forward = model


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--prefetch", choices=["off", "attn_out_mlp", "all"], default="attn_out_mlp")
    args, rest = parser.parse_known_args()
    if args.prefetch != "off":
        install(args.prefetch)
    print(f"prefetch: {args.prefetch}", flush=True)
    sys.argv = [sys.argv[0]] + rest
    import decode_graph_time  # run as a script, this folder is on sys.path
    decode_graph_time.main()


if __name__ == "__main__":
    main()
