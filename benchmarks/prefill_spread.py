"""Where a small-head sparse-MLA prefill call spends its time, and how much the same kernel's time moves within one
process (H200; BENCHMARKS.md, sixteenth session, call 5).

    python benchmarks/prefill_spread.py

For the bf16 prefill rows of ``dsa bench`` (h_q 32, 16, 128), in ms: ``do_bench`` of the public call (the index
lists grouped by slot range inside it), of the attention kernel alone on lists grouped beforehand, of the grouping
alone; 30 calls back to back timed by CUDA events (public call, kernel alone); and one call after a 256 MB L2
flush under the torch profiler, per kernel (median of 5).
"""
from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import MLA_SHAPES, mla_inputs  # noqa: E402
from dsa.mla import sparse_mla  # noqa: E402
from dsa.mla.kernel import sparse_mla_triton  # noqa: E402
from dsa.mla.order import order_indices  # noqa: E402


def back_to_back(fn, n=30):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        fn()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n


def per_kernel(fn, reps=5):
    """Median device time (µs) of each kernel of ``fn`` after an L2 flush, over ``reps`` calls."""
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    times = {}
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and "elementwise" not in ev.name:  # (the flush)
            times.setdefault(ev.name[:40], []).append(ev.device_time_total)
    return {k: sorted(v)[len(v) // 2] for k, v in times.items()}


def main():
    sm = 192 ** -0.5
    for name in ("prefill_bf16_h32", "prefill_bf16_h16", "prefill_bf16_h128"):
        T, h, topk, nreq, s_kv, fmt = MLA_SHAPES[name]
        q, kv, idx = mla_inputs(T, h, topk, nreq, s_kv, fmt, dev="cuda")
        flat = kv.reshape(-1, kv.shape[-1])
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")
        grouped = order_indices(idx, flat.shape[0])

        def public():
            return sparse_mla(q, kv, idx, sm, out=out, backend="triton")

        def kernel():
            return sparse_mla_triton(q, flat, grouped, sm, 512, None, None, out, order=False)

        public()
        kernel()
        torch.cuda.synchronize()
        row = {"do_bench public": do_bench(public, warmup=20, rep=300, return_mode="median"),
               "do_bench kernel": do_bench(kernel, warmup=20, rep=300, return_mode="median"),
               "do_bench grouping": do_bench(lambda: order_indices(idx, flat.shape[0]), warmup=20, rep=100,
                                             return_mode="median"),
               "back to back public": back_to_back(public), "back to back kernel": back_to_back(kernel)}
        print(name, "ms:", ", ".join(f"{k} {v:.4f}" for k, v in row.items()), flush=True)
        for k, v in per_kernel(public).items():
            print(f"    profiled after an L2 flush: {k} {v:.1f} us")
        q = kv = idx = out = flat = grouped = None
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
