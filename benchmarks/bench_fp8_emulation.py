"""What the software e4m3fn path costs: the portable fp8 kernels with Triton's e4m3fn type ("native") and with the
software conversions that GPUs without it take (NVIDIA Ampere; ``DSA_FP8_EMULATION=1`` forces them anywhere), on
the same inputs in one run, beside the PyTorch reference.

On an H200 this measures the conversions' cost on Hopper, not an A100's times: an A100 has about a third of the
H200's bandwidth and no fp8 tensor cores (its products run in f16 either way). The Hopper-only Gluon kernels are
left out (``gluon=False``): they have no software path.

    python benchmarks/bench_fp8_emulation.py

Prints one line per case and a table last: time (``triton.testing.do_bench`` median), rate, and the emulated /
native ratio; every emulated output is compared with the native one (max abs difference, or bitwise for bytes).
"""
from __future__ import annotations

import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dsa  # noqa: E402
from dsa import backend  # noqa: E402
from dsa.bench import indexer_decode_inputs, indexer_prefill_inputs, mla_counts, mla_inputs  # noqa: E402
from dsa.constants import H200_COPY_BYTES_PER_S, INDEXER_ROW_BYTES  # noqa: E402
from dsa.mla.kernel import sparse_mla_triton  # noqa: E402
from dsa.mqa_logits.kernel import fp8_paged_mqa_logits_triton  # noqa: E402

DEV = "cuda"


def ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


def both(fn):
    """(native ms, emulated ms, native out, emulated out) of ``fn(backend)``."""
    out = {}
    t = {}
    for path in ("native", "emulated"):
        if path == "emulated":
            os.environ[backend.FP8_EMULATION_ENV] = "1"
        else:
            os.environ.pop(backend.FP8_EMULATION_ENV, None)
        out[path] = fn("triton")
        t[path] = ms(lambda: fn("triton"))
    os.environ.pop(backend.FP8_EMULATION_ENV, None)
    t["reference"] = ms(lambda: fn("reference"))
    return t, out


def diff(a, b) -> str:
    a = a[0] if isinstance(a, tuple) else a
    b = b[0] if isinstance(b, tuple) else b
    if a.dtype in (torch.uint8, torch.float8_e4m3fn):
        return "bitwise equal" if torch.equal(a.view(torch.uint8), b.view(torch.uint8)) else "BYTES DIFFER"
    fin = torch.isfinite(a) & torch.isfinite(b)
    same_inf = bool((torch.isfinite(a) == torch.isfinite(b)).all())
    return f"max |d| {(a[fin].float() - b[fin].float()).abs().max().item():.2e}" + ("" if same_inf else " (inf differ)")


def main() -> int:
    g = torch.Generator(device=DEV).manual_seed(0)
    rows = []

    # prefill indexer logits (fp8 products): 2048 queries x 32768 keys, 64 heads
    M, N = 2048, 32768
    q, kv, w, ks, ke = indexer_prefill_inputs(M, N, g, DEV)
    t, o = both(lambda b: dsa.fp8_mqa_logits(q, kv, w, ks, ke, backend=b))
    flops = 2 * M * N * 64 * 128
    rows.append(("fp8_mqa_logits", f"M {M}, N {N}", t, flops / 1e12, "TFLOP/s", diff(o["native"], o["emulated"])))

    # decode indexer logits, portable kernel: batch 64, 32K-64K keys, block 64, next_n 1
    for bs in (64, 1):
        qd, cache, wd, ctx, bt, max_len = indexer_decode_inputs(64, 32768, 65536, bs, 1, g, DEV)
        def paged(b, qd=qd, cache=cache, wd=wd, ctx=ctx, bt=bt, max_len=max_len):
            if b == "reference":
                return dsa.fp8_paged_mqa_logits(qd, cache, wd, ctx, bt, max_len, backend=b)
            out = torch.empty(qd.shape[0] * qd.shape[1], max_len, device=DEV)
            return fp8_paged_mqa_logits_triton(qd, cache, wd, ctx, bt, max_len, True, out, config={"gluon": False})
        t, o = both(paged)
        nbytes = int(ctx.sum()) * INDEXER_ROW_BYTES
        rows.append(("fp8_paged_mqa_logits", f"B 64, 32-64K, block {bs}", t, nbytes / 1e9, "GB/s",
                     diff(o["native"], o["emulated"])))

    # sparse MLA over the fp8_ds_mla cache, portable kernel: decode batch 64, 64 heads; prefill-like T 1024, 16 heads
    for T, h in ((64, 64), (1024, 16)):
        qm, kvm, idx = mla_inputs(T, h, 2048, min(T, 64), 32768, "fp8_ds_mla", dev=DEV)[:3]
        def mla(b, qm=qm, kvm=kvm, idx=idx):
            if b == "reference":
                return dsa.sparse_mla(qm, kvm, idx, 0.1, backend=b)
            return sparse_mla_triton(qm, kvm.reshape(-1, kvm.shape[-1]), idx, 0.1, config={"gluon": False, "bulk": False})
        t, o = both(mla)
        rows.append(("sparse_mla fp8_ds_mla", f"T {T}, h_q {h}", t, mla_counts(T, h, 2048, "fp8_ds_mla")[0] / 1e12,
                     "TFLOP/s", diff(o["native"], o["emulated"])))

    # the writers (quantisation): indexer K and the fp8_ds_mla rows, 65536 tokens
    n = 65536
    k = torch.randn(n, 128, device=DEV, generator=g).to(torch.bfloat16)
    icache = torch.zeros(n // 64, 64 * INDEXER_ROW_BYTES, dtype=torch.uint8, device=DEV)
    slots = torch.arange(n, device=DEV)

    def quant_k(b):
        c = icache.clone()
        dsa.indexer_k_quant_and_cache(k, c, slots, backend=b)
        return c
    t, o = both(quant_k)
    rows.append(("indexer_k_quant_and_cache", f"T {n}", t, n * (256 + INDEXER_ROW_BYTES) / 1e9, "GB/s",
                 diff(o["native"], o["emulated"])))
    ckv = torch.randn(n, 512, device=DEV, generator=g).to(torch.bfloat16)
    kpe = torch.randn(n, 64, device=DEV, generator=g).to(torch.bfloat16)
    mcache = torch.zeros(n // 64, 64, 656, dtype=torch.uint8, device=DEV)

    def write_mla(b):
        c = mcache.clone()
        dsa.concat_and_cache_mla(ckv, kpe, c, slots, kv_format="fp8_ds_mla", backend=b)
        return c
    t, o = both(write_mla)
    rows.append(("concat_and_cache_mla fp8", f"T {n}", t, n * (1152 + 656) / 1e9, "GB/s", diff(o["native"], o["emulated"])))

    print(f"\nH200, portable Triton kernels; do_bench medians (ms); rates over the native time (the writers' clone "
          f"of the cache is inside each time); copy ceiling {H200_COPY_BYTES_PER_S / 1e12:.1f} TB/s")
    print("| op | shape | native ms | emulated ms | emulated / native | reference ms | native rate | emulated rate | "
          "emulated vs native |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, shape, t, work, unit, d in rows:
        print(f"| {name} | {shape} | {t['native']:.4f} | {t['emulated']:.4f} | {t['emulated'] / t['native']:.2f}x | "
              f"{t['reference']:.4f} | {work / t['native'] * 1e3:.1f} {unit} | {work / t['emulated'] * 1e3:.1f} {unit} | "
              f"{d} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
