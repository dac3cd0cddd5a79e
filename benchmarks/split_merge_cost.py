"""What the split merge costs small-head decode at batch 1-32 (split-K over 64-132 CTAs), and when the merge inside
the kernel (the splits of a token as one cluster of CTAs) runs in one wave: CUDA-graph medians of the launch with the
merge kernel after the split kernel, of the same launch with the merge kernel left out (wrong results: timing only),
of the in-kernel merge (``cluster=True``), and of the default launch (and which merge it took). H200 (BENCHMARKS.md,
twenty-third session): at most 30 clusters of 4 CTAs (one per SM) run at once, so 4 splits at batch 31-32 take a
second wave in clusters; :func:`dsa.mla.kernel.cluster_size` asks the driver for that count.

    python benchmarks/split_merge_cost.py                     # 4 splits, batch 16-32
    python benchmarks/split_merge_cost.py --default-splits    # the default split count, batch 1-30
    python benchmarks/split_merge_cost.py --default-splits --fp8_ds_mla --h16 --batches 22,23,24
    python benchmarks/split_merge_cost.py --default-splits --h16 --batches 5,12,20,30 --baseline  # + PyTorch
"""
from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench, do_bench_cudagraph

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import dsa.mla.kernel as K  # noqa: E402
from dsa.bench import mla_baseline, mla_baseline_chunk, mla_inputs  # noqa: E402


#: batch sizes from the command line (``--batches 22,23,24``), else each mode's own
BATCHES = tuple(int(b) for b in sys.argv[sys.argv.index("--batches") + 1].split(",")) if "--batches" in sys.argv else ()


class _NoMerge:
    def __getitem__(self, grid):
        return lambda *a, **k: None


def main():
    sm = 576 ** -0.5
    default = "--default-splits" in sys.argv
    baseline = "--baseline" in sys.argv
    fmts = [a for a in ("bf16", "fp8_ds_mla") if f"--{a}" in sys.argv] or ["bf16", "fp8_ds_mla"]
    heads = [h for h in (16, 32) if f"--h{h}" in sys.argv] or [16, 32]
    counts = {n: K.kernel_sm90.max_active_clusters(n, torch.cuda.current_device()) for n in (2, 4, 8, 16)}
    print("clusters of n CTAs (one per SM) that run at once:", ", ".join(f"{n}: {c}" for n, c in counts.items()))
    print("| cache | h_q | batch | splits | merge kernel µs | no merge (timing only) µs | in-kernel merge µs "
          "| default µs (its merge) |" + (" PyTorch µs |" if baseline else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|" if baseline else ""))
    for fmt in fmts:
        for h in heads:
            for B in BATCHES or ((1, 2, 4, 5, 6, 8, 12, 16, 20, 24, 28, 30) if default else (16, 28, 30, 31, 32)):
                if h == 32 and B <= K.SM90_TWO_GROUPS_MAX_T:
                    continue  # (two 16-head groups there)
                q, kv, idx = mla_inputs(B, h, 2048, B, 32768, fmt, dev="cuda")
                flat = kv.reshape(-1, kv.shape[-1])
                out = torch.empty(B, h, 512, dtype=torch.bfloat16, device="cuda")
                ns = K.choose_num_splits(B, 1, 2048, K._num_sms(q.device), 64, 1) if default else 4

                def run(cluster):
                    if cluster is None:  # the default launch, as sparse_mla makes it
                        return K.sparse_mla_triton(q, flat, idx, sm, 512, None, None, out, num_splits=ns)
                    cfg = K.default_config(h, fmt != "bf16", B)
                    cfg.update(K.SM90_ROWS_SMALL_HEADS)
                    cfg["cluster"] = cluster
                    return K.sparse_mla_triton(q, flat, idx, sm, 512, None, None, out, num_splits=ns, config=cfg)

                t = {}
                ref = run(False)[0].clone()
                t["merge"] = do_bench_cudagraph(lambda: run(False), rep=200, return_mode="median") * 1e3
                got = run(True)[0]
                assert torch.equal(got, ref) or (got.float() - ref.float()).abs().max() < 1e-2
                t["cluster"] = do_bench_cudagraph(lambda: run(True), rep=200, return_mode="median") * 1e3
                t["default"] = do_bench_cudagraph(lambda: run(None), rep=200, return_mode="median") * 1e3
                seen = []
                launch = K.kernel_sm90.launch
                K.kernel_sm90.launch = lambda *a, **k: (seen.append(k.get("cluster", 0)), launch(*a, **k))[1]
                try:
                    run(None)
                finally:
                    K.kernel_sm90.launch = launch
                merge = f"in-kernel, {seen[0]}" if seen and seen[0] else "merge kernel"
                keep = K._sparse_mla_combine_kernel
                K._sparse_mla_combine_kernel = _NoMerge()
                try:
                    t["none"] = do_bench_cudagraph(lambda: run(False), rep=200, return_mode="median") * 1e3
                finally:
                    K._sparse_mla_combine_kernel = keep
                base = ""
                if baseline:  # PyTorch gather + bmm (eager do_bench), checked against the default launch
                    chunk = mla_baseline_chunk(2048, h)
                    err = (mla_baseline(q, kv, idx, sm, chunk).float() - run(None)[0].float()).abs().max().item()
                    ms = do_bench(lambda: mla_baseline(q, kv, idx, sm, chunk), rep=100, warmup=10)
                    base = f" {ms * 1e3:.1f} (max diff {err:.2g}) |"
                print(f"| {fmt} | {h} | {B} | {ns} | {t['merge']:.1f} | {t['none']:.1f} | {t['cluster']:.1f} | "
                      f"{t['default']:.1f} ({merge}) |{base}", flush=True)
                del q, kv, idx, flat, out
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
