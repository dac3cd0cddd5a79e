"""Cache-format kernels on the GPU: MLA cache writer (bf16 / fp8_ds_mla), fp8_ds_mla reader,
indexer K quant-and-cache, indexer K gather.

Memory-bound ops: reported as GB/s of the bytes that must move (read + write) against the
measured H200 copy ceiling (dsa.constants), next to a PyTorch baseline measured in the same run.
Large shapes move several times the 60 MB L2 (no input rotation needed).

* ``gpu us``: CUDA-graph replay (``do_bench_cudagraph``): kernel time without Python overhead.
* ``eager us``: ``do_bench`` median (L2 flushed before each call), eager launch.
* ``cpu us``: host time of one eager call (wrapper + validation + launch), back to back.

``--sweep`` first times each kernel's launch configurations and uses the fastest.

    python benchmarks/bench_cache_formats.py [--sweep]
"""
from __future__ import annotations

import sys
import time

import torch
import triton

import dsa.indexer_cache.kernel as ik
import dsa.mla_cache.kernel as mk
from dsa.constants import D_QK, FP8_DS_MLA_ROW_BYTES, H200_COPY_BYTES_PER_S, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES
from dsa.indexer_cache import gather_indexer_k, indexer_k_quant_and_cache
from dsa.indexer_cache.reference import indexer_k_quant
from dsa.mla_cache import concat_and_cache_mla, dequantize_fp8_ds_mla
from dsa.mla_cache.reference import dequantize_fp8_ds_mla as deq_ref
from dsa.mla_cache.reference import quantize_fp8_ds_mla as quant_ref

DEV = "cuda"


def gpu_time(fn) -> float:
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e-3


def eager_time(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") * 1e-3


def cpu_time(fn, n=200) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / n


def sweep(name, table, key, grid, fn):
    best = None
    for cfg in grid:
        table[key] = cfg
        t = gpu_time(fn)
        print(f"  sweep {name:32s} {cfg}: {t * 1e6:8.1f} us", flush=True)
        if best is None or t < best[0]:
            best = (t, cfg)
    table[key] = best[1]
    print(f"  -> {name}: {best[1]}", flush=True)


def workloads():
    """name -> (shape text, bytes moved, triton fn, torch fn, (config table, key, sweep grid) or None)."""
    torch.manual_seed(0)
    w = {}
    bs = 64
    for t in (128, 65536):
        num_slots = (2 * t // bs + 1) * bs
        c_kv = torch.randn(t, 512, device=DEV).to(torch.bfloat16)
        k_pe = torch.randn(t, 64, device=DEV).to(torch.bfloat16)
        slots = torch.randperm(num_slots, device=DEV)[:t]
        cache_bf16 = torch.zeros(num_slots // bs, bs, D_QK, dtype=torch.bfloat16, device=DEV)
        cache_fp8 = torch.zeros(num_slots // bs, bs, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8, device=DEV)
        flat_bf16, flat_fp8 = cache_bf16.view(-1, D_QK), cache_fp8.view(-1, FP8_DS_MLA_ROW_BYTES)
        big = t > 1000

        def torch_bf16(c_kv=c_kv, k_pe=k_pe, flat_bf16=flat_bf16, slots=slots):
            flat_bf16[slots] = torch.cat([c_kv, k_pe], dim=-1)

        def torch_fp8(c_kv=c_kv, k_pe=k_pe, flat_fp8=flat_fp8, slots=slots):
            flat_fp8[slots] = quant_ref(c_kv, k_pe)

        w[f"mla write bf16 T={t}"] = (
            f"T={t} bs={bs}", t * (2 * 1152 + 8),
            lambda c_kv=c_kv, k_pe=k_pe, c=cache_bf16, s=slots: concat_and_cache_mla(c_kv, k_pe, c, s, "bf16"),
            torch_bf16, (mk.CONFIG, "write_bf16", mk.CONFIG_SWEEP["write_bf16"]) if big else None)
        w[f"mla write fp8 T={t}"] = (
            f"T={t} bs={bs}", t * (1152 + 656 + 8),
            lambda c_kv=c_kv, k_pe=k_pe, c=cache_fp8, s=slots: concat_and_cache_mla(c_kv, k_pe, c, s, "fp8_ds_mla"),
            torch_fp8, (mk.CONFIG, "write_fp8", mk.CONFIG_SWEEP["write_fp8"]) if big else None)
        if big:
            packed = flat_fp8[slots]
            out = torch.empty(t, D_QK, dtype=torch.bfloat16, device=DEV)
            w[f"mla read fp8 R={t}"] = (
                f"R={t}", t * (656 + 1152),
                lambda p=packed, o=out: dequantize_fp8_ds_mla(p, out=o), lambda p=packed: deq_ref(p),
                (mk.CONFIG, "read", mk.CONFIG_SWEEP["read"]))

        k = torch.randn(t, INDEXER_HEAD_DIM, device=DEV).to(torch.bfloat16)
        icache = torch.zeros(num_slots // bs, bs * INDEXER_ROW_BYTES, dtype=torch.uint8, device=DEV)

        def torch_icache(k=k, icache=icache, slots=slots):
            q, s = indexer_k_quant(k, "ue8m0")
            b, o = slots // bs, slots % bs
            icache[:, : bs * 128].view(-1, bs, 128)[b, o] = q.view(torch.uint8)
            icache[:, bs * 128:].view(torch.float32)[b, o] = s

        for fmt in ("ue8m0", None):
            w[f"indexer quant+cache {fmt} T={t}"] = (
                f"T={t} bs={bs}", t * (256 + 132 + 8),
                lambda k=k, c=icache, s=slots, f=fmt: indexer_k_quant_and_cache(k, c, s, f),
                torch_icache, (ik.CONFIG, "quant", ik.CONFIG_SWEEP["quant"]) if big and fmt == "ue8m0" else None)

    for n_req, L in ((64, 8192), (4, 131072)):
        nblk = L // bs
        bt = torch.randperm(n_req * nblk, device=DEV, dtype=torch.int32).view(n_req, nblk)
        icache = torch.randint(0, 255, (n_req * nblk, bs * INDEXER_ROW_BYTES), dtype=torch.uint8, device=DEV)
        cu = torch.arange(0, n_req + 1, device=DEV, dtype=torch.int32) * L
        n = n_req * L
        out = (torch.empty(n, INDEXER_HEAD_DIM, dtype=torch.float8_e4m3fn, device=DEV), torch.empty(n, device=DEV))
        vals = icache[:, : bs * 128].view(-1, bs, 128)
        scl = icache[:, bs * 128:].view(torch.float32)

        def torch_gather(vals=vals, scl=scl, bt=bt, n=n):  # equal-length requests: one index gather
            return vals[bt.long()].view(n, 128), scl[bt.long()].view(n)

        w[f"gather_indexer_k B={n_req}"] = (
            f"B={n_req} L={L} bs={bs}", n * 2 * INDEXER_ROW_BYTES,
            lambda c=icache, bt=bt, cu=cu, o=out: gather_indexer_k(c, bt, cu, out=o), torch_gather,
            (ik.CONFIG, "gather", ik.CONFIG_SWEEP["gather"]) if n_req == 64 else None)
    return w


def main():
    do_sweep = "--sweep" in sys.argv
    w = workloads()
    if do_sweep:
        for name, (_, _, fn, _, sw) in w.items():
            if sw is not None:
                sweep(name, *sw, fn)
        print("best configs:", mk.CONFIG, ik.CONFIG, flush=True)
    rows = []
    for name, (shape, nbytes, fn, tfn, _) in w.items():
        g, e, c = gpu_time(fn), eager_time(fn), cpu_time(fn)
        te = eager_time(tfn)
        rows.append((name, nbytes / g / 1e9, 100 * nbytes / g / H200_COPY_BYTES_PER_S, g * 1e6, e * 1e6, c * 1e6, te * 1e6))
        print(f"  measured {name}", flush=True)
    print(f"\nGPU {torch.cuda.get_device_name()}  (copy ceiling {H200_COPY_BYTES_PER_S / 1e12:.1f} TB/s)")
    print(f"{'op':34s} {'GB/s':>7s} {'%ceil':>6s} {'gpu us':>8s} {'eager us':>9s} {'cpu us':>7s} {'torch us':>9s} {'x torch':>8s}")
    for name, gbs, pct, g, e, c, te in rows:
        print(f"{name:34s} {gbs:7.0f} {pct:6.1f} {g:8.1f} {e:9.1f} {c:7.1f} {te:9.1f} {te / e:8.2f}")


if __name__ == "__main__":
    main()
