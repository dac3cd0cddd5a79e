"""Where small-head sparse-MLA decode spends its time besides streaming rows: the default launch (CUDA-graph replay)
at topk 256-2048 with the split count of topk 2048 kept, so each program walks 4-32 tiles, plus every list empty
(``topk_length`` 0: the programs only start, load q and write their output), a straight-line fit of the time
against the tiles per program, and each kernel's own time (torch.profiler, eager calls).

    python benchmarks/decode_fixed_cost.py            # fp8 h_q 16, batch 32 / 64 / 128
    python benchmarks/decode_fixed_cost.py --all      # also bf16 h_q 16 and fp8 h_q 32
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import mla_inputs  # noqa: E402
from dsa.mla.kernel import _num_sms, choose_num_splits, default_config, SM90_ROWS_SMALL_HEADS  # noqa: E402
from dsa.mla.kernel import sparse_mla_triton  # noqa: E402

TOPKS = (256, 512, 1024, 2048)


def kernel_times(fn, n=20):
    """Mean device µs per call of each kernel ``fn`` launches (eager calls under torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.count >= n:
            name = e.key.split("(")[0][:40]
            out[name] = getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0.0)) / e.count
    return out


def case(fmt, h, B, sm=576 ** -0.5):
    q, kv, idx_full = mla_inputs(B, h, 2048, B, 32768, fmt, dev="cuda")
    flat = kv.reshape(-1, kv.shape[-1])
    out = torch.empty(B, h, 512, dtype=torch.bfloat16, device="cuda")
    cfg = default_config(h, fmt != "bf16", B)
    cfg.update(SM90_ROWS_SMALL_HEADS)
    ns = choose_num_splits(B, 1, 2048, _num_sms(q.device), 64, cfg["per_sm"])
    rows = []
    for topk in (0,) + TOPKS:
        idx = idx_full[:, :max(topk, 128)].contiguous()
        tl_ = torch.zeros(B, dtype=torch.int32, device="cuda") if topk == 0 else None
        n_split = min(ns, max(1, idx.shape[1] // 64))

        def fn():
            return sparse_mla_triton(q, flat, idx, sm, 512, None, tl_, out, num_splits=n_split)
        fn()
        torch.cuda.synchronize()
        us = do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3
        kt = kernel_times(fn)
        tiles = -(-topk // 64) // n_split if topk else 0
        rows.append((topk, n_split, tiles, us, kt))
        ks = ", ".join(f"{k} {v:.1f}" for k, v in kt.items())
        print(f"{fmt} h{h} B{B} topk {topk} splits {n_split} tiles/program {tiles}: {us:.1f} us graph; {ks}",
              flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    shapes = [("fp8_ds_mla", 16, B) for B in (32, 64, 128)]
    if args.all:
        shapes += [("bf16", 16, 64), ("fp8_ds_mla", 32, 64)]
    table = []
    for fmt, h, B in shapes:
        rows = case(fmt, h, B)
        fit = [(t, us) for topk, ns, t, us, _ in rows if topk and ns == rows[-1][1]]
        b, a = np.polyfit([t for t, _ in fit], [u for _, u in fit], 1) if len(fit) > 1 else (float("nan"), float("nan"))
        table.append((fmt, h, B, rows, a, b))
        torch.cuda.empty_cache()
    print("\n| cache | h_q | batch | splits | empty lists µs | " + " | ".join(f"topk {k} µs" for k in TOPKS)
          + " | fit: fixed + per tile | fixed part at topk 2048 |")
    print("|" + "---|" * (7 + len(TOPKS)))
    for fmt, h, B, rows, a, b in table:
        full = rows[-1][3]
        print(f"| {fmt} | {h} | {B} | {rows[-1][1]} | {rows[0][3]:.1f} | "
              + " | ".join(f"{r[3]:.1f}" for r in rows[1:]) + f" | {a:.1f} + {b:.2f} µs | {100 * a / full:.0f}% |")


if __name__ == "__main__":
    main()
