"""GPU time of each top-k kernel (torch.profiler medians), inline-PTX stores against ``tl.store``.

    python benchmarks/profile_topk.py        # needs a CUDA GPU

Inputs are N(0, 1) logits, several of them used in turn so that they do not stay in L2.
"""
from __future__ import annotations

import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.topk import TopKConfig, top_k_indices  # noqa: E402

K, CALLS = 2048, 20


def main():
    for M, N in ((64, 131072), (4096, 131072)):
        xs = [torch.randn(M, N, device="cuda") for _ in range(max(1, (256 << 20) // (M * N * 4)))]
        lens = torch.full((M,), N, dtype=torch.int32, device="cuda")
        for ptx in (True, False):
            cfg = TopKConfig(ptx=ptx)
            for x in xs:  # compile and warm up
                top_k_indices(x, K, seq_lens=lens, config=cfg)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for i in range(CALLS):
                    top_k_indices(xs[i % len(xs)], K, seq_lens=lens, config=cfg)
                torch.cuda.synchronize()
            times = {}
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    times.setdefault(e.name, []).append(e.device_time_total)
            for name, ts in times.items():
                ts.sort()
                print(f"{M}x{N} ptx={ptx}: {name[:40]:<40} n={len(ts)} median {ts[len(ts) // 2]:8.1f} us")


if __name__ == "__main__":
    main()
