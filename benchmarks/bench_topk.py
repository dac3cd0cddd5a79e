"""Benchmark dsa.top_k_indices (exact Triton threshold selection) against torch.topk.

    python benchmarks/bench_topk.py            # goal shapes: 4096 x 131072 (prefill), 64 x 131072 (decode), k = 2048
    python benchmarks/bench_topk.py --quick    # smaller shapes
    python benchmarks/bench_topk.py --sweep    # also time several launch configurations per case
    TRITON_INTERPRET=1 python benchmarks/bench_topk.py --cpu-smoke   # tiny shapes, checks the script itself

GB/s counts the fp32 logits bytes that must be read (M * N * 4) over the time, compared with
the device-to-device copy ceiling of dsa.constants. The baseline is torch.topk(logits, k) on
the same tensor (full rows), timed in the same run. Every case first checks that the
kernel's selected values equal torch.topk's (as multisets, row by row). Times:
triton.testing.do_bench medians; the decode case rotates over 4 input sets (one set fits in L2).

Measured on an H200 (2026-11-29, torch 2.11 cu130, triton 3.6.0, SM clock 1980 MHz; --sweep
of the configurations of that day, fp32 N(0,1) logits, full rows, k = 2048):

    prefill 4096 x 131072: 2.032 ms = 1057 GB/s (24.6% of the copy ceiling); torch.topk 6.196 ms: 3.05x
        (block 2048 / 8 warps / 2 programs per SM / cap 8192 = today's default; block 4096 with
        16 warps, 1 per SM: 2.696 ms; block 8192, 16 warps: 2.460; block 4096, 8 warps, 1 per SM:
        2.969; same with 2 per SM and maxnreg 128: 2.247; 16 warps, 2 per SM, maxnreg 64: 2.483;
        rows of 32: 2.696; 128 sample runs: 2.773)
    decode 64 x 131072: 54.5 us = 615 GB/s (14.3%); torch.topk 190.0 us: 3.48x
        (4 slices per row = today's default; 8 slices: 126.7 us with a 16-warp merge, 73.0 us with
        an 8-warp merge; 16 slices: 111.7; 8 slices of 4096-value blocks / 16 warps: 88.7; of
        1024-value blocks / 4 warps: 78.2; fused path, one program per row: 89.8)

Reading: with one block of loads in flight per program, 2 programs x 8 KB per SM at ~2 us of
loaded-memory latency give ~8 GB/s per SM, i.e. the ~1.06 TB/s measured: the streaming pass is
latency-bound, not bandwidth- or issue-bound. ``prefetch`` (2-4 blocks in flight) targets
that and is the first thing to measure next (the sweep lists hold it; not yet run on a GPU).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton

from dsa.constants import H200_COPY_BYTES_PER_S
from dsa.topk import TopKConfig, top_k_indices

SMOKE = "--cpu-smoke" in sys.argv
DEV = "cpu" if SMOKE else "cuda"

# The first entry of each list is the default (the best of the 2026-11-29 sweep below); the
# others are the next candidates to measure (deeper prefetch: the streaming phase was found
# latency-bound, see the numbers in the module docstring).
PREFILL_SWEEP = [
    TopKConfig(),  # fused: block 2048, 8 warps, 2 programs per SM, cap 8192, prefetch 1
    TopKConfig(prefetch=2),
    TopKConfig(prefetch=4),
    TopKConfig(block=1024, prefetch=4),
    TopKConfig(block=4096, maxnreg=128, prefetch=2),
    TopKConfig(programs_per_sm=3, maxnreg=80, prefetch=2),
]
DECODE_SWEEP = [
    TopKConfig(),  # split path: 4 slices per row (64 rows), split_block 2048, 8 + 16 warps
    TopKConfig(prefetch=2),
    TopKConfig(prefetch=4),
    TopKConfig(splits=8, merge_warps=8, prefetch=2),
    TopKConfig(splits=2, prefetch=4),
    TopKConfig(merge_warps=8),
]


def bench(fn, rep=200):
    if SMOKE:
        import time

        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median")


def check(x, k, out):
    want = torch.sort(torch.topk(x, k, dim=1).values, dim=1).values
    got = torch.sort(torch.gather(x, 1, out.long()), dim=1).values
    assert (out >= 0).all(), "unexpected -1 in full rows"
    assert torch.equal(got, want), "selected values differ from torch.topk"


def run_case(name, M, N, k, decode, sweep, rotate):
    g = torch.Generator(device=DEV).manual_seed(0)
    xs = [torch.randn(M, N, device=DEV, generator=g) for _ in range(rotate)]
    starts = torch.zeros(M, dtype=torch.int32, device=DEV)
    ends = torch.full((M,), N, dtype=torch.int32, device=DEV)
    seq = torch.full((M,), N, dtype=torch.int32, device=DEV)
    out = torch.empty(M, k, dtype=torch.int32, device=DEV)
    it = [0]

    def nxt():
        it[0] = (it[0] + 1) % rotate
        return xs[it[0]]

    def call(cfg):
        x = nxt()
        if decode:
            return top_k_indices(x, k, seq_lens=seq, out=out, config=cfg)
        return top_k_indices(x, k, starts, ends, out=out, config=cfg)

    rows = []
    for cfg in (PREFILL_SWEEP if not decode else DECODE_SWEEP) if sweep else [None]:
        call(cfg)
        check(xs[it[0]], k, out)
        ms = bench(lambda cfg=cfg: call(cfg), rep=100 if sweep else 300)
        rows.append((ms, cfg))
        if sweep:
            print(f"  {name} cfg {cfg}: {ms * 1e3:.1f} us", flush=True)
    ms, cfg = min(rows, key=lambda r: r[0])
    base = bench(lambda: torch.topk(nxt(), k, dim=1), rep=100 if sweep else 300)
    gbs = M * N * 4 / (ms * 1e-3) / 1e9
    return {"name": name, "shape": f"{M}x{N} k={k}", "ms": ms, "gbs": gbs,
            "pct": 100 * gbs * 1e9 / H200_COPY_BYTES_PER_S, "base": base, "speedup": base / ms, "cfg": cfg}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    if SMOKE:
        cases = [("prefill", 8, 4096, 64, False, 1), ("decode", 4, 8192, 64, True, 2)]
    elif args.quick:
        cases = [("prefill", 1024, 32768, 2048, False, 1), ("decode", 64, 32768, 2048, True, 4)]
    else:
        cases = [("prefill", 4096, 131072, 2048, False, 1), ("decode", 64, 131072, 2048, True, 4)]
    if not SMOKE:
        print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    res = [run_case(n, M, N, k, d, args.sweep, r) for n, M, N, k, d, r in cases]
    print(f"{'case':8} {'shape':20} {'ms':>9} {'GB/s':>7} {'%copy':>6} {'torch ms':>9} {'speed-up':>8}  config")
    for r in res:
        print(f"{r['name']:8} {r['shape']:20} {r['ms']:9.4f} {r['gbs']:7.0f} {r['pct']:5.1f}% {r['base']:9.4f} "
              f"{r['speedup']:7.2f}x  {r['cfg'] or 'default'}")


if __name__ == "__main__":
    main()
