"""Does L2 locality pay for bf16 sparse-MLA prefill? (random indices over a 128K-row cache, s_q 4096, topk 2048)

    python benchmarks/locality_probe.py [h_q ...]

Each token's index list is reordered by key range (a stable partition into R ranges of the cache, i.e. sorted
by the top bits) and cut into R equal splits; the split kernel's grid runs split-major, so while split r runs,
every running program reads rows near the r-th range, which fits in L2. Prints ms for: the default call, the
index lists sorted (one split), sorted + R splits (merge kernel), unsorted + R splits, and the pure "window"
gather (topk/R entries all inside the first S/R rows: the best the locality could give per split).
"""
from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa import bench as B  # noqa: E402
from dsa.mla import sparse_mla  # noqa: E402
from dsa.mla import kernel as MK  # noqa: E402


def main():
    heads = [int(a) for a in sys.argv[1:]] or [16, 32, 128]
    T, topk, S = 4096, 2048, 131072
    sm = 192 ** -0.5
    rows = []
    for h in heads:
        q, kv, idx = B.mla_inputs(T, h, topk, 1, S, "bf16", block_size=64)
        flat = kv.reshape(-1, kv.shape[-1])
        flops, _ = B.mla_counts(T, h, topk, "bf16")
        out = torch.empty(T, h, 512, dtype=torch.bfloat16, device="cuda")
        small = h < 64
        cfg = dict(MK.SM90_ROWS_SMALL_HEADS, cluster=False) if small else dict(cluster=False)
        srt = torch.sort(idx, dim=1).values.contiguous()
        ref = sparse_mla(q, kv, idx, sm)[0].float()

        def case(name, fn, scale=1.0, check=True):
            out.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = (out.float() - ref).abs().max().item() if check else float("nan")
            ms = B.bench_ms(fn, "cuda", rep=100) * scale
            rows.append((h, name, ms, flops / ms / 1e9, err))
            print(f"h{h:<4} {name:<28} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s  err {err:.3g}", flush=True)

        case("default", lambda: sparse_mla(q, kv, idx, sm, out=out))
        case("sorted ns1", lambda: sparse_mla(q, kv, srt, sm, out=out))
        splits = (2, 4, 8) if small else (2, 4)
        for ns in splits:
            case(f"sorted ns{ns}", lambda ns=ns: MK.sparse_mla_triton(q, flat, srt, sm, out=out, num_splits=ns,
                                                                     config=cfg))
        case("unsorted ns4", lambda: MK.sparse_mla_triton(q, flat, idx, sm, out=out, num_splits=4, config=cfg))
        for R in (4, 8):
            win = (idx[:, : topk // R] % (S // R)).contiguous()
            case(f"window 1/{R} x{R}", lambda win=win: sparse_mla(q, kv, win, sm, out=out), scale=R, check=False)
        # the split kernel alone and the merge alone (profiler), sorted, 4 splits
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                MK.sparse_mla_triton(q, flat, srt, sm, out=out, num_splits=4, config=cfg)
            torch.cuda.synchronize()
        for e in prof.key_averages():
            if e.device_type.name == "CUDA" and e.count >= 10:
                print(f"h{h:<4}   sorted ns4 kernel {e.key[:50]:<50} {e.device_time / 1e3:8.3f} ms avg x{e.count}")
        q = kv = idx = srt = flat = out = ref = None
        torch.cuda.empty_cache()
    print("\n## locality probe (bf16 prefill, T 4096, topk 2048 of 128K)")
    print(f"{'h_q':>4} {'case':<28} {'ms':>8} {'TFLOP/s':>8} {'max err':>8}")
    for h, name, ms, tf, err in rows:
        print(f"{h:>4} {name:<28} {ms:8.3f} {tf:8.1f} {err:8.3g}")


if __name__ == "__main__":
    main()
