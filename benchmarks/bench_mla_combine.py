"""The sparse-MLA split merge (``_sparse_mla_combine_kernel``) alone, on random fp32 partials: every launch shape
of a small grid (heads per program x columns per program x splits per memory trip x warps) at the split counts
decode uses, against the shape :func:`dsa.mla.kernel.combine_config` picks. CUDA-graph medians (the merge runs
right after the split kernel inside a graph in practice), GB/s over the partials read and the output written,
% of the H200's 4.3 TB/s copy rate (the partials mostly come from L2, so this can pass 100%).

    python benchmarks/bench_mla_combine.py
"""
from __future__ import annotations

import itertools
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.mla.kernel import _sparse_mla_combine_kernel, combine_config  # noqa: E402

D = 512
SHAPES = [(32, 16, 4), (32, 32, 4), (16, 16, 8), (2, 128, 16), (64, 16, 2), (64, 128, 2), (8, 16, 16)]  # T, h_q, splits


def main():
    from triton.testing import do_bench_cudagraph

    dev = "cuda"
    print(f"{'T x h_q, splits':>18} {'MB':>6} | {'chosen us':>9} {'GB/s':>7} {'%copy':>6} | best of the grid")
    for T, h, ns in SHAPES:
        o_part = torch.randn(ns, T, h, D, device=dev)
        lse_part = torch.randn(ns, T, h, device=dev)
        ml_part = torch.randn(ns, T, h, device=dev)
        out = torch.empty(T, h, D, device=dev, dtype=torch.bfloat16)
        ml, lse = torch.empty(T, h, device=dev), torch.empty(T, h, device=dev)
        mb = (o_part.numel() * 4 + out.numel() * 2) / 1e6

        def timed(cfg):
            grid = (T, triton.cdiv(h, cfg["BLOCK_H"]), triton.cdiv(D, cfg["DC"]))
            fn = lambda: _sparse_mla_combine_kernel[grid](  # noqa: E731
                o_part, lse_part, ml_part, lse, out, out.stride(0), out.stride(1), ml, lse, lse, T, h, ns, D=D,
                HAS_SINK=False, **cfg)
            fn()
            return do_bench_cudagraph(fn, rep=10, return_mode="median") * 1e3

        chosen = timed(combine_config(T, h, ns))
        ns_pad = triton.next_power_of_2(ns)
        grid = []
        for cb, dc, one_pass, w in itertools.product((2, 4, 8, 16), (64, 128, 512), (False, True), (2, 4)):
            sb = ns_pad if one_pass else 1
            if cb * dc * sb <= 65536:
                cfg = dict(BLOCK_H=cb, NS_PAD=ns_pad, SB=sb, DC=dc, num_warps=w)
                grid.append((timed(cfg), cfg))
        grid.sort(key=lambda r: r[0])
        us, best = grid[0]
        gbs = mb * 1e3 / chosen
        print(f"{f'{T} x {h}, {ns}':>18} {mb:6.1f} | {chosen:9.2f} {gbs:7.0f} {gbs / 43:5.0f}% | {us:.2f} us {best}",
              flush=True)


if __name__ == "__main__":
    main()
