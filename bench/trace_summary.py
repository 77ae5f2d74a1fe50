"""Reads a Chrome trace written by `bench/bench_profile.py --trace`: GPU time by stream and kernel kind, copies with
their bandwidth, the device timeline of one stretch of the main stream, and (--gaps) its longest idle stretches.
    python3 bench/trace_summary.py out/trace_tp1_steps500-500.json [--timeline 40] [--skip 400] [--gaps 10]
"""
from __future__ import annotations

import argparse
import json
from collections import defaultdict

from bench_profile import kind_of

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def gpu_events(path: str) -> list[dict]:
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return sorted((e for e in events if e.get("cat") in GPU_CATEGORIES and "dur" in e), key=lambda e: e["ts"])


def label(event: dict) -> str:
    return kind_of(event["name"]) if event["cat"] == "kernel" else event["name"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("trace")
    parser.add_argument("--timeline", type=int, default=40, help="events of the main stream to list in order")
    parser.add_argument("--skip", type=int, default=0, help="main-stream events to skip before the listing")
    parser.add_argument("--gaps", type=int, default=0,
                        help="list this many of the main stream's longest idle stretches, with the host's "
                             "annotated phases (bench_profile.annotate_host) that overlap each")
    args = parser.parse_args()
    events = gpu_events(args.trace)
    if not events:
        raise SystemExit(f"{args.trace}: no GPU events (a trace taken on CPU?)")
    by_stream = defaultdict(list)
    for e in events:
        by_stream[e["args"].get("stream")].append(e)
    main_stream = max(by_stream, key=lambda s: len(by_stream[s]))
    span = (events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]) / 1e3
    print(f"{len(events)} GPU events over {span:.2f} ms; main stream {main_stream}")
    for stream, evs in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        busy = sum(e["dur"] for e in evs) / 1e3
        kinds = defaultdict(lambda: [0, 0.0])
        for e in evs:
            kinds[label(e)][0] += 1
            kinds[label(e)][1] += e["dur"]
        print(f"stream {stream}: {len(evs)} events, busy {busy:.2f} ms")
        for kind, (n, us) in sorted(kinds.items(), key=lambda kv: -kv[1][1]):
            print(f"    {kind:40s} {n:6d} x {us / n:9.1f} us = {us / 1e3:8.2f} ms")
    copies = [e for e in events if e["cat"] == "gpu_memcpy"]
    for e in copies[:6]:
        a = e["args"]
        print(f"copy {e['name']!r} stream {a.get('stream')} {a.get('bytes', 0) / 1e6:.1f} MB in {e['dur']:.0f} us"
              f" ({a.get('memory bandwidth (GB/s)', 0):.0f} GB/s)")
    mains = by_stream[main_stream]
    gaps = sum(max(0.0, b["ts"] - (a["ts"] + a["dur"])) for a, b in zip(mains, mains[1:]))
    print(f"main stream idle between its events: {gaps / 1e3:.2f} ms")
    if args.gaps:
        print_gaps(args.trace, mains, args.gaps)
    t0 = mains[min(args.skip, len(mains) - 1)]["ts"]
    print("timeline (start us from the first listed event, duration us, stream, name):")
    listed = [e for e in events if e["ts"] >= t0][:args.timeline]
    for e in listed:
        print(f"  {e['ts'] - t0:9.1f} {e['dur']:8.1f}  s{e['args'].get('stream')}  {e['name'][:100]}")


def print_gaps(path: str, mains: list[dict], count: int) -> None:
    """The longest idle stretches between the main stream's events, each with the device events around it
    and the host's annotated phases running during it (their overlap in ms)."""
    with open(path) as f:
        host = [e for e in json.load(f)["traceEvents"]
                if e.get("cat") == "user_annotation" and "dur" in e and e["name"].startswith("host: ")]
    gaps = sorted(((b["ts"] - (a["ts"] + a["dur"]), a, b) for a, b in zip(mains, mains[1:])),
                  key=lambda g: -g[0])[:count]
    t0 = mains[0]["ts"]
    print("longest idle stretches of the main stream (ms from its first event):")
    for idle, before, after in gaps:
        start, end = before["ts"] + before["dur"], after["ts"]
        overlap = defaultdict(float)
        for e in host:
            overlap[e["name"]] += max(0.0, min(end, e["ts"] + e["dur"]) - max(start, e["ts"]))
        during = ", ".join(f"{name[6:]} {us / 1e3:.2f}" for name, us in sorted(overlap.items(), key=lambda kv: -kv[1])
                           if us > 0) or "no annotated phase"
        print(f"  at {(start - t0) / 1e3:8.2f}: {idle / 1e3:6.2f} ms idle after {label(before)} "
              f"before {label(after)}; host: {during}")
    total = defaultdict(float)
    for e in host:
        total[e["name"]] += e["dur"]
    print("host phases in the trace: " + ", ".join(f"{name[6:]} {us / 1e3:.2f} ms" for name, us in
                                                     sorted(total.items(), key=lambda kv: -kv[1])))


if __name__ == "__main__":
    main()
