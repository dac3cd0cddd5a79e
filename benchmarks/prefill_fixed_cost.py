"""The fixed cost per work item of sparse-MLA prefill: the kernel alone (index lists not grouped; h_q 128 with one
program per item, ``persist=False``) at topk 64-2048 for h_q 128, 32 and 16 (bf16 cache, 4096 tokens, 128K slots),
and a straight-line fit of the time per program wave against the tiles per item. H200 (BENCHMARKS.md, seventeenth
session, call 1).

    python benchmarks/prefill_fixed_cost.py
"""
from __future__ import annotations

import os
import sys

import numpy as np
import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import mla_inputs  # noqa: E402
from dsa.mla.kernel import sparse_mla_triton  # noqa: E402

HEADS = (128, 32, 16)
TOPKS = (64, 256, 1024, 2048)


def main():
    T, sm = 4096, 192 ** -0.5
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for h in HEADS:
        q, kv, idx_full = mla_inputs(T, h, max(TOPKS), 1, 131072, "bf16", dev="cuda")
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")
        cfg = dict(persist=False) if h > 64 else None  # (a config would turn off the small-head defaults)
        for topk in TOPKS:
            idx = idx_full[:, :topk].contiguous()

            def fn():
                return sparse_mla_triton(q, flat, idx, sm, 512, None, None, out, order=False, config=cfg)
            fn()
            torch.cuda.synchronize()
            ms = do_bench(fn, warmup=50, rep=300)
            rows.append((h, topk, ms))
            print(f"h{h} topk {topk}: {ms * 1e3:.1f} us  {2 * T * h * topk * 1088 / ms / 1e9:.1f} TFLOP/s", flush=True)
        q = kv = flat = idx_full = out = None
        torch.cuda.empty_cache()
    print("\n| h_q | topk | µs | TFLOP/s | µs per program wave |")
    waves = lambda h: T * max(1, h // 64) / sms  # noqa: E731
    for h, topk, ms in rows:
        print(f"| {h} | {topk} | {ms * 1e3:.1f} | {2 * T * h * topk * 1088 / ms / 1e9:.1f} | {ms * 1e3 / waves(h):.2f} |")
    for h in HEADS:
        x = np.array([t // 64 for hh, t, _ in rows if hh == h], float)
        y = np.array([ms * 1e3 / waves(h) for hh, _, ms in rows if hh == h])
        b, a = np.polyfit(x, y, 1)
        print(f"h{h}: per wave {a:.2f} us + {b:.3f} us per tile; at 32 tiles the fixed part is {a / (a + 32 * b) * 100:.1f}%")


if __name__ == "__main__":
    main()
