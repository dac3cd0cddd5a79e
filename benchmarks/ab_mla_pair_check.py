"""The pair schedule (kernel_sm90 ``config pair=True`` / ``"pv"``) against the default call and the PyTorch baseline at
four decode shapes (s_q 1, topk 2048 of 32K per request; CUDA-graph medians of 3 rounds), each call checked once into a
NaN-poisoned output against the reference. H200: ``python3 benchmarks/ab_mla_pair_check.py``."""
import sys, os
sys.path.insert(0, os.getcwd())
import torch
from triton.testing import do_bench, do_bench_cudagraph
from dsa.bench import mla_baseline, mla_baseline_chunk, mla_counts, mla_inputs
from dsa.mla import sparse_mla, sparse_mla_ref
from dsa.mla.kernel import SM90_ROWS_SMALL_HEADS, sparse_mla_triton
S = 192 ** -0.5
rows = []
for fmt, h, b in (("fp8_ds_mla", 32, 64), ("fp8_ds_mla", 32, 128), ("bf16", 32, 64), ("fp8_ds_mla", 16, 64)):
    q, kv, idx = mla_inputs(b, h, 2048, b, 32768, fmt)
    flat = kv.reshape(-1, kv.shape[-1]); out = torch.empty(b, h, 512, dtype=torch.bfloat16, device="cuda")
    want = sparse_mla_ref(q, kv, idx, S)
    calls = {"default": lambda: sparse_mla(q, kv, idx, S, out=out)}
    for p in (True, "pv"):
        calls[f"pair {p}"] = (lambda p=p: sparse_mla_triton(q, flat, idx, S, out=out,
                                config=dict(SM90_ROWS_SMALL_HEADS, block_h=16 if h == 16 else 32, pair=p)))
    t, e = {}, {}
    for n, fn in calls.items():
        out.fill_(float("nan")); o, ml, lse = fn(); torch.cuda.synchronize()
        e[n] = ((out.float() - want[0].float()).abs().max().item(), ((lse - want[2]).abs() / want[2].abs().clamp(min=1)).max().item())
    for r in range(3):
        for n, fn in calls.items():
            t.setdefault(n, []).append(do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3)
    base = do_bench(lambda: mla_baseline(q, kv, idx, S, mla_baseline_chunk(2048, h)), warmup=2, rep=50, return_mode="median") * 1e3
    med = {n: sorted(v)[1] for n, v in t.items()}
    rows.append((f"{'fp8' if fmt != 'bf16' else 'bf16'} h{h} b{b}", med, e, base, mla_counts(b, h, 2048, fmt)))
    print(rows[-1], flush=True)
print(f"{'case':<14}{'default':>9}{'pair':>9}{'pair pv':>9}{'PyTorch':>9}{'GB/s dflt':>10}  err out/lse: default | pair | pair pv")
for name, m, e, base, (fl, nb) in rows:
    print(f"{name:<14}{m['default']:9.1f}{m['pair True']:9.1f}{m['pair pv']:9.1f}{base:9.1f}{nb / m['default'] / 1e3:10.0f}  "
          + " | ".join(f"{e[n][0]:.2g}/{e[n][1]:.2g}" for n in ("default", "pair True", "pair pv")))
