"""Many-token sparse MLA over an engine-sized fp8_ds_mla pool, where the tokens read only their context's pages:
on the fp8 kernels, and on a bf16 copy of just those pages (:mod:`dsa.mla.compact`: the pages marked, the lists
remapped, the pages dequantised, their count kept on the device, where a flag picks the launches over the copy or
over the cache), in interleaved rounds. The pool's other pages hold NaN. Also timed: the copy alone (``compact``),
its first pass alone (``mark_pages``), the bf16 call on a copy made beforehand, the call as dispatched
(``sparse_mla`` takes the pages' way where :func:`dsa.mla.kernel._dequant_first` says so, and the copy where the
pages fit :func:`dsa.mla.kernel.dequant_first_max_rows`), which must be bitwise equal to the way it chose, the pages'
way forced (heads for which the rule does not try it), and the host time of the dispatched call. GPU.

    python benchmarks/ab_mla_prefill_pool.py [--rounds 3] [--heads 32 64 128] [--contexts 32768 131072]
        [--pool 2097152] [--tokens 4096] [--min-ratio 32:16 ...]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dsa.mla.kernel as mla_kernel  # noqa: E402
from dsa import _replay, sparse_mla  # noqa: E402
from dsa.bench import MLA_POOL_ROWS, interleaved_us, mla_counts, mla_inputs  # noqa: E402
from dsa.mla.compact import PAGE_ROWS, compact, mark_pages  # noqa: E402

from ab_mla_prefill_dequant import compare, forced_way  # noqa: E402  (benchmarks/ is the script's folder)

TOPK = 2048


def host_us(fn, n=20):
    """Median host time of ``fn()`` in µs, the GPU kept busy (no synchronisation between the calls): what a
    synchronisation before the call exposes."""
    fn()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return sorted(ts)[n // 2]


def main():
    _replay.set_enabled(False)  # (each call decides afresh: this script switches the dispatch between calls)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, nargs="+", default=[32, 64, 128])
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 65536, 131072, 262144])
    ap.add_argument("--pool", type=int, default=MLA_POOL_ROWS)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--min-ratio", nargs="+", default=[], metavar="BLOCK_H:RATIO",
                    help="override dsa.mla.kernel.DEQUANT_FIRST_MIN_RATIO (e.g. 32:16 to time a 32-head copy of "
                         "more pages than the rule allows)")
    a = ap.parse_args()
    for kv_ in a.min_ratio:
        block_h, ratio = map(int, kv_.split(":"))
        mla_kernel.DEQUANT_FIRST_MIN_RATIO[block_h] = ratio
    T, sm = a.tokens, 192 ** -0.5
    rows = []
    for ctx in a.contexts:
        for h in a.heads:
            q, kv, idx = mla_inputs(T, h, TOPK, 1, ctx, "fp8_ds_mla", pool_rows=a.pool)
            pool = kv.reshape(-1, kv.shape[-1])
            out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")
            bound = mla_kernel.dequant_first_max_rows(T, h, TOPK)
            copy, lists, taken = compact(pool, idx, None, bound)
            tried = mla_kernel._dequant_first(q, pool, idx) == "pages"
            chosen = tried and taken.item() == 1
            fns = {"fp8 cache": lambda: forced_way(None, lambda: sparse_mla(q, pool, idx, sm, out=out,
                                                                            backend="triton")),
                   "copy alone": lambda: compact(pool, idx, None, bound),
                   "marking alone": lambda: mark_pages(idx, None, pool.shape[0]),
                   "dispatched": lambda: sparse_mla(q, pool, idx, sm, out=out, backend="triton")}
            if taken.item():  # (else the copy is unwritten)
                fns["bf16 on copy"] = lambda: sparse_mla(q, copy, lists, sm, out=out, backend="triton")
            if not tried:
                fns["pages forced"] = lambda: forced_way("pages", lambda: sparse_mla(q, pool, idx, sm, out=out,
                                                                                     backend="triton"))
            same, diff, nan = compare(fns, out, "bf16 on copy" if chosen else "fp8 cache", "fp8 cache",
                                      "bf16 on copy" if taken.item() else "fp8 cache")
            times = interleaved_us(fns, a.rounds, graph=False, return_mode="median")
            times["host, dispatched"] = [host_us(fns["dispatched"])]
            rows.append((ctx, h, diff, nan, times, chosen, same))
            print(ctx, h, diff, nan, chosen, same, {n: [round(t, 1) for t in v] for n, v in times.items()}, flush=True)
            q = kv = pool = idx = out = copy = lists = None
            torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}; {T} tokens, topk {TOPK} of a context of C rows in pages of "
          f"{PAGE_ROWS} spread over a pool of {a.pool} rows; do_bench medians of {a.rounds} interleaved rounds, µs")
    print(f"{'C':>7} {'h_q':>4}  {'fp8 cache':>17}  {'copy + bf16':>9}  {'copy':>6}  {'bf16 on copy':>18}"
          f"  {'dispatched':>10}  {'forced':>7}  {'mark':>5}  {'host':>5}  max |diff| out/ml/lse")
    for ctx, h, diff, nan, t, chosen, same in rows:
        med = {n: sorted(v)[len(v) // 2] for n, v in t.items()}
        flops = mla_counts(T, h, TOPK, "fp8_ds_mla")[0]
        a_, c, b = med["fp8 cache"], med["copy alone"], med.get("bf16 on copy", float("nan"))
        print(f"{ctx:>7} {h:>4}  {a_:8.1f} {flops / a_ / 1e6:5.1f} TF  {c + b:9.1f}  {c:6.1f}  {b:8.1f} "
              f"{flops / b / 1e6:5.1f} TF  {med['dispatched']:10.1f}  {med.get('pages forced', float('nan')):7.1f}"
              f"  {med['marking alone']:5.1f}  {med['host, dispatched']:5.0f}  {'/'.join(f'{d:.2g}' for d in diff)}"
              f"  {'copy' if chosen else 'fp8'}{' (bitwise)' if same else ' NOT EQUAL!'}{'  NaN!' if nan else ''}")


if __name__ == "__main__":
    main()
