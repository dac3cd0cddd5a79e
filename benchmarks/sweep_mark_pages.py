"""Launch shapes of :func:`dsa.mla.compact.mark_pages` (the first pass of the pages' copy): tokens per program, entries
per step and warps, over the index lists of an engine-sized pool (``dsa.bench.mla_inputs``), with the other passes of
:func:`dsa.mla.compact.compact` timed beside them (the prefix sum, the listing, the remap, the dequantisation). Every
shape's flags must equal the default's. do_bench medians, µs. GPU.

    python benchmarks/sweep_mark_pages.py [--shapes 4096:16384 4096:131072 1024:131072] [--pool 2097152]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from triton.testing import do_bench  # noqa: E402

import dsa.mla.compact as C  # noqa: E402
from dsa._host import cdiv  # noqa: E402
from dsa.bench import MLA_POOL_ROWS, mla_inputs  # noqa: E402

TOPK = 2048
SHAPES = [(t, b, w) for t in (1, 2, 4, 8, 16) for b in (256, 512, 1024, 2048) for w in (4, 8)]


def mark(idx, S, tokens, block, warps):
    T, topk = idx.shape
    flags = torch.zeros(cdiv(S, C.PAGE_ROWS) * C.FLAG_STRIDE, dtype=torch.int32, device=idx.device)
    C._mark_pages_kernel[(cdiv(T, tokens),)](idx, idx, flags, T, topk, idx.stride(0), S, HAS_LEN=False,
                                             SHIFT=C._shift(), STRIDE=C.FLAG_STRIDE, TOKENS=tokens, BLOCK=block,
                                             num_warps=warps)
    return flags[::C.FLAG_STRIDE]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["4096:16384", "4096:131072", "1024:131072"],
                    metavar="TOKENS:CONTEXT")
    ap.add_argument("--pool", type=int, default=MLA_POOL_ROWS)
    a = ap.parse_args()
    for shape in a.shapes:
        T, ctx = map(int, shape.split(":"))
        _, kv, idx = mla_inputs(T, 16, TOPK, 1, ctx, "fp8_ds_mla", pool_rows=a.pool)
        pool = kv.reshape(-1, kv.shape[-1])
        S = pool.shape[0]
        want = C.mark_pages(idx, None, S)
        res = []
        for tokens, block, warps in SHAPES:
            got = mark(idx, S, tokens, block, warps)
            assert torch.equal(got, want), (tokens, block, warps)
            res.append((1e3 * do_bench(lambda: mark(idx, S, tokens, block, warps), rep=100), tokens, block, warps))
        flags = want.contiguous()
        ends = torch.cumsum(flags, 0, dtype=torch.int32).contiguous()
        n_pages = len(flags)
        listed = torch.empty(n_pages, dtype=torch.int32, device=idx.device)
        taken = torch.zeros(1, dtype=torch.int32, device=idx.device)
        max_pages = min(T * TOPK // 16 // C.PAGE_ROWS, n_pages)
        copy = torch.empty(max_pages * C.PAGE_ROWS, 576, dtype=torch.bfloat16, device=idx.device)
        from dsa.mla_cache.kernel import fp8_ds_mla_read
        parts = {
            "default mark": lambda: C.mark_pages(idx, None, S),
            "zeros (flags)": lambda: torch.zeros(cdiv(S, C.PAGE_ROWS) * C.FLAG_STRIDE, dtype=torch.int32,
                                                 device=idx.device),
            "cumsum": lambda: torch.cumsum(want, 0, dtype=torch.int32),
            "list": lambda: C._list_pages_kernel[(cdiv(n_pages, C._BLOCK),)](want, ends, listed, taken, n_pages,
                                                                            max_pages, STRIDE=C.FLAG_STRIDE,
                                                                            BLOCK=C._BLOCK),
            "remap": lambda: C.remap_indices(idx, None, ends, S),
            "read (dequantise)": lambda: fp8_ds_mla_read(pool, copy, pages=listed, page_rows=C.PAGE_ROWS,
                                                         count=ends[-1:]),
            "compact (all)": lambda: C.compact(pool, idx, None, max_pages * C.PAGE_ROWS),
        }
        print(f"\n{torch.cuda.get_device_name()}; {T} tokens x topk {TOPK} over {ctx} rows at random pages of a "
              f"{S}-row pool; {int(ends[-1])} pages marked; do_bench medians, µs")
        for name, fn in parts.items():
            print(f"  {name:>18}: {1e3 * do_bench(fn, rep=100):8.1f}")
        res.sort()
        print("  mark_pages by (tokens per program, entries per step, warps), fastest first:")
        print("   " + "  ".join(f"{t:.1f} ({tk},{b},{w})" for t, tk, b, w in res[:12]))
        print("   slowest: " + "  ".join(f"{t:.1f} ({tk},{b},{w})" for t, tk, b, w in res[-4:]))
        default = (C._MARK_TOKENS, C._MARK_BLOCK, C._MARK_WARPS)
        print(f"   default {default}: " + " ".join(f"{t:.1f}" for t, *shape in res if tuple(shape) == default))


if __name__ == "__main__":
    main()
