"""Benchmark the lightning indexer's logits kernels against a PyTorch baseline.

    python benchmarks/bench_mqa_logits.py            # goal shapes (H200: 4096 x 131072 prefill; B=64, 32K-128K decode)
    python benchmarks/bench_mqa_logits.py --quick    # smaller shapes
    python benchmarks/bench_mqa_logits.py --sweep    # also time several launch configurations per case

Prefill: ``fp8_mqa_logits`` for the last M query rows of one request of N keys (ks = 0,
ke = N - M + i + 1); FLOPs counted as 2*M*N*H*D (DeepGEMM's convention) and compared with
the fp8 matmul ceiling of dsa.constants. Decode: ``fp8_paged_mqa_logits`` over B requests
with random contexts, a shuffled block table, block sizes 64 and 1, next_n 1 and 2;
GB/s counts the cache bytes that must be read (132 per key of each request) and is compared
with the device-to-device copy ceiling. The baseline is the reference's formulation on the
GPU in PyTorch: bf16 matmul of dequantised fp8 values, relu, weighted head sum (a bf16
bmm), chunked so its temporaries fit. Times: triton.testing.do_bench medians.

Measured on an H200 (2026-11-29, torch 2.11 cu130, triton 3.6.0; --sweep, best config each):
prefill 4096 x 131072 x 64 heads 9.25 ms = 951 TFLOP/s (75% of the 1270 fp8-matmul ceiling),
baseline 85.5 ms; decode B=64, contexts 32K-128K (661 MB of cache): block 64 next_n 1
0.223 ms = 2962 GB/s, next_n 2 0.355 ms = 1859 GB/s; block 1 next_n 1 0.353 ms = 1873 GB/s,
next_n 2 0.554 ms = 1192 GB/s (baselines 5.8-10.9 ms).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import triton  # noqa: E402

from dsa.constants import H200_COPY_BYTES_PER_S, H200_FP8_FLOPS, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES  # noqa: E402
from dsa.layouts import indexer_cache_blocks, indexer_cache_views  # noqa: E402
from dsa.mqa_logits import fp8_mqa_logits_ref, fp8_paged_mqa_logits_ref  # noqa: E402
from dsa.mqa_logits import kernel as K  # noqa: E402

SMOKE = "--cpu-smoke" in sys.argv  # tiny shapes under TRITON_INTERPRET=1, to check the script itself
DEV = "cpu" if SMOKE else "cuda"
D = INDEXER_HEAD_DIM
H = 64
FP8 = torch.float8_e4m3fn

PREFILL_SWEEP = [
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=8192, num_warps=4, num_stages=3),
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=8192, num_warps=4, num_stages=4),
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=4096, num_warps=4, num_stages=3),
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=16384, num_warps=4, num_stages=3),
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=8192, num_warps=4, num_stages=2),
]
DECODE_SWEEP = [
    dict(BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=3, PREFETCH=True),
    dict(BLOCK_N=64, SPAN=2048, num_warps=4, num_stages=3, PREFETCH=True),
    dict(BLOCK_N=64, SPAN=2048, num_warps=4, num_stages=4, PREFETCH=True),
    dict(BLOCK_N=128, SPAN=2048, num_warps=4, num_stages=3, PREFETCH=True),
    dict(BLOCK_N=128, SPAN=2048, num_warps=8, num_stages=3, PREFETCH=True),
    dict(BLOCK_N=64, SPAN=2048, num_warps=8, num_stages=3, PREFETCH=True),
    dict(BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=3, PREFETCH=False),  # the first version's best
]


def calc_diff(x, y):
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def bench(fn, rep=200):
    if SMOKE:
        import time

        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    return triton.testing.do_bench(fn, warmup=50, rep=rep, return_mode="median")


# ----------------------------------------------------------------------------- prefill
def prefill_inputs(M, N, g):
    q = (torch.randn(M, H, D, device=DEV, generator=g) * 4).to(FP8)
    k = (torch.randn(N, D, device=DEV, generator=g) * 4).to(FP8)
    s = torch.rand(N, device=DEV, generator=g) * 0.5 + 0.01
    w = torch.randn(M, H, device=DEV, generator=g)
    ks = torch.zeros(M, dtype=torch.int32, device=DEV)
    ke = (N - M + torch.arange(M, device=DEV) + 1).int()
    return q, (k, s), w, ks, ke


def prefill_baseline(q, kv, w, ks, ke, rows=64):
    k, s = kv
    M, N = q.shape[0], k.shape[0]
    kT = k.to(torch.bfloat16).t()
    out = torch.empty(M, N, dtype=torch.float32, device=q.device)
    cols = torch.arange(N, device=q.device)
    for r0 in range(0, M, rows):
        r1 = min(M, r0 + rows)
        sc = torch.matmul(q[r0:r1].to(torch.bfloat16).reshape(-1, D), kT).relu_()  # [m*H, N] bf16
        lg = torch.bmm(w[r0:r1, None, :].to(torch.bfloat16), sc.view(r1 - r0, H, N))[:, 0].float() * s
        inside = (cols >= ks[r0:r1, None]) & (cols < ke[r0:r1, None])
        out[r0:r1] = lg.masked_fill_(~inside, float("-inf"))
    return out


def run_prefill(M, N, sweep, rows):
    g = torch.Generator(device=DEV).manual_seed(0)
    q, kv, w, ks, ke = prefill_inputs(M, N, g)
    flops = 2.0 * M * N * H * D
    out = torch.empty(M, N, dtype=torch.float32, device=DEV)
    best = (None, None)
    for cfg in (PREFILL_SWEEP if sweep else [None]):
        fn = lambda: K.fp8_mqa_logits_triton(q, kv[0], kv[1], w, ks, ke, True, out, config=cfg)  # noqa: E731
        ms = bench(fn, rep=100 if sweep else 300)
        if sweep:
            print(f"  prefill {M}x{N} cfg {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        if best[0] is None or ms < best[0]:
            best = (ms, cfg)
    ms, cfg = best
    # accuracy on a few rows (fp32 reference on the GPU)
    K.fp8_mqa_logits_triton(q, kv[0], kv[1], w, ks, ke, True, out, config=cfg)
    sub = slice(max(0, M - 16), M)
    ref = fp8_mqa_logits_ref(q[sub], kv, w[sub], ks[sub], ke[sub])
    o = out[sub]
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(o)) and not torch.isnan(o).any()
    diff = calc_diff(o[fin], ref[fin])
    base = bench(lambda: prefill_baseline(q, kv, w, ks, ke), rep=100)
    rows.append(dict(case="prefill", shape=f"M={M} N={N} H={H}", cfg=cfg, ms=ms, rate=flops / ms / 1e9,
                     unit="TFLOP/s", pct=100 * flops / ms * 1e3 / H200_FP8_FLOPS, base=base, diff=diff))


# ----------------------------------------------------------------------------- decode
def decode_inputs(B, lo, hi, bs, next_n, g):
    lens = torch.randint(lo, hi + 1, (B,), device=DEV, generator=g)
    lens[0] = hi
    nblk = (lens + bs - 1) // bs
    max_blocks = int(nblk.max())
    num_blocks = int(nblk.sum()) + 1
    perm = torch.randperm(num_blocks, device=DEV, generator=g).int()
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device=DEV)
    starts = torch.cumsum(nblk, 0) - nblk
    for b in range(B):
        n = int(nblk[b])
        bt[b, :n] = perm[int(starts[b]):int(starts[b]) + n]
    cache = torch.empty(num_blocks, bs * INDEXER_ROW_BYTES, dtype=torch.uint8, device=DEV)
    vals, scales = indexer_cache_views(cache)
    vals.copy_((torch.randn(vals.shape, device=DEV, generator=g) * 4).to(FP8))
    scales.copy_(torch.rand(scales.shape, device=DEV, generator=g) * 0.5 + 0.01)
    q = (torch.randn(B, next_n, H, D, device=DEV, generator=g) * 4).to(FP8)
    w = torch.randn(B * next_n, H, device=DEV, generator=g)
    return q, cache, w, lens.int(), bt, hi


def decode_baseline(q, cache, w, ctx, bt, max_len, chunk=8):
    vals, scales = indexer_cache_views(cache)
    B, next_n = q.shape[:2]
    bs = vals.shape[1]
    out = torch.empty(B * next_n, max_len, dtype=torch.float32, device=q.device)
    pos = torch.arange(max_len, device=q.device)
    lim = ctx[:, None].long() - next_n + torch.arange(next_n, device=q.device) + 1  # [B, next_n]
    nb = (max_len + bs - 1) // bs
    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        blk = bt[b0:b1, :nb].long()
        k = vals[blk].reshape(b1 - b0, -1, D)[:, :max_len].to(torch.bfloat16)  # [c, L, D]
        s = scales[blk].reshape(b1 - b0, -1)[:, :max_len]
        sc = torch.bmm(q[b0:b1].reshape(b1 - b0, next_n * H, D).to(torch.bfloat16), k.transpose(1, 2)).relu_()
        lg = torch.bmm(w[b0 * next_n:b1 * next_n].to(torch.bfloat16).view(-1, 1, H), sc.view(-1, H, max_len))
        lg = lg[:, 0].float().view(b1 - b0, next_n, max_len) * s[:, None, :]
        lg = lg.masked_fill_(pos >= lim[b0:b1, :, None], float("-inf"))
        out[b0 * next_n:b1 * next_n] = lg.reshape(-1, max_len)
    return out


def run_decode(B, lo, hi, bs, next_n, sweep, rows):
    g = torch.Generator(device=DEV).manual_seed(1)
    q, cache, w, ctx, bt, max_len = decode_inputs(B, lo, hi, bs, next_n, g)
    nbytes = float(ctx.sum()) * INDEXER_ROW_BYTES
    out = torch.empty(B * next_n, max_len, dtype=torch.float32, device=DEV)
    blocks = indexer_cache_blocks(cache)
    best = (None, None)
    for cfg in (DECODE_SWEEP if sweep else [None]):
        fn = lambda: K.fp8_paged_mqa_logits_triton(q, blocks, w, ctx, bt, max_len, True, out, config=cfg)  # noqa: E731
        ms = bench(fn, rep=60 if sweep else 200)
        if sweep:
            print(f"  decode bs={bs} next_n={next_n} cfg {cfg}: {ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s", flush=True)
        if best[0] is None or ms < best[0]:
            best = (ms, cfg)
    ms, cfg = best
    K.fp8_paged_mqa_logits_triton(q, blocks, w, ctx, bt, max_len, True, out, config=cfg)
    base_out = decode_baseline(q, cache, w, ctx, bt, max_len)
    # accuracy vs the public op's reference on two requests
    ref = fp8_paged_mqa_logits_ref(q[:2], cache, w[:2 * next_n], ctx[:2], bt[:2], max_len)
    o = out[:2 * next_n]
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(o)) and not torch.isnan(o).any()
    diff = calc_diff(o[fin], ref[fin])
    assert torch.equal(torch.isfinite(base_out), torch.isfinite(out))
    base = bench(lambda: decode_baseline(q, cache, w, ctx, bt, max_len), rep=100)
    rows.append(dict(case=f"decode bs={bs} nn={next_n}", shape=f"B={B} ctx {lo}-{hi} ({nbytes / 1e6:.0f} MB)",
                     cfg=cfg, ms=ms, rate=nbytes / ms / 1e6, unit="GB/s",
                     pct=100 * nbytes / ms * 1e3 / H200_COPY_BYTES_PER_S, base=base, diff=diff))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--only", choices=["prefill", "decode"], default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU interpreter (checks the script)")
    args = ap.parse_args()
    if not SMOKE:
        assert torch.cuda.is_available(), "needs a GPU (or --cpu-smoke with TRITON_INTERPRET=1)"
        print(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    rows = []
    if args.only in (None, "prefill"):
        M, N = (8, 200) if SMOKE else (1024, 32768) if args.quick else (4096, 131072)
        run_prefill(M, N, args.sweep, rows)
    if args.only in (None, "decode"):
        B, lo, hi = (3, 40, 90) if SMOKE else (16, 4096, 16384) if args.quick else (64, 32768, 131072)
        for bs in (64, 1):
            for next_n in (1, 2):
                run_decode(B, lo, hi, bs, next_n, args.sweep, rows)
                torch.cuda.empty_cache()
    print()
    print(f"{'case':<20} {'shape':<36} {'ms':>8} {'rate':>14} {'% ceil':>7} {'base ms':>9} {'speedup':>8} {'diff':>9}")
    for r in rows:
        print(f"{r['case']:<20} {r['shape']:<36} {r['ms']:8.3f} {r['rate']:8.0f} {r['unit']:<5} {r['pct']:6.1f}% "
              f"{r['base']:9.3f} {r['base'] / r['ms']:7.1f}x {r['diff']:9.1e}")
    for r in rows:
        if r["cfg"] is not None:
            print(f"best cfg {r['case']}: {r['cfg']}")
    print("ceilings: fp8 matmul %.0f TFLOP/s, copy %.0f GB/s (dsa.constants)" % (H200_FP8_FLOPS / 1e12,
                                                                                 H200_COPY_BYTES_PER_S / 1e9))


if __name__ == "__main__":
    main()
