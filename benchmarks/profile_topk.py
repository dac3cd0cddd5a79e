"""Per-kernel GPU times of the top-k launches (torch.profiler), default config and plain stores."""
import sys, os
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import torch
from torch.profiler import profile, ProfilerActivity
from dsa.topk import TopKConfig, top_k_indices

for M, N in ((64, 131072), (4096, 131072)):
    xs = [torch.randn(M, N, device="cuda") for _ in range(max(1, (256 << 20) // (M * N * 4)))]
    lens = torch.full((M,), N, dtype=torch.int32, device="cuda")
    for ptx in (True, False):
        cfg = TopKConfig(ptx=ptx)
        for x in xs:
            top_k_indices(x, 2048, seq_lens=lens, config=cfg)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(20):
                top_k_indices(xs[i % len(xs)], 2048, seq_lens=lens, config=cfg)
            torch.cuda.synchronize()
        tot = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                tot.setdefault(e.name, []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
        for name, ts in tot.items():
            ts = sorted(ts)
            print(f"profile {M}x{N} ptx={ptx}: {name[:40]:<40} n={len(ts)} median {ts[len(ts)//2]:8.1f} us")
