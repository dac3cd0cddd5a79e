"""``dsa bench``: the kernel benchmarks (indexer logits, top-k, sparse MLA) as one command.

    dsa bench                      # goal shapes on the GPU (H200-sized: minutes)
    dsa bench --quick              # smaller shapes
    dsa bench --kernels topk,mla --sweep --plot bench.png --json
    TRITON_INTERPRET=1 dsa bench --smoke    # tiny shapes on the CPU interpreter (checks the code)

One table per kernel: time (``triton.testing.do_bench`` medians on a GPU), TFLOP/s or GB/s,
the percentage of the device ceiling (``dsa.constants``: the H200's measured fp8/bf16 matmul
and copy rates) and the PyTorch baseline (its time and the speed-up); ``--plot FILE.png``
draws the speed-ups and the ceiling percentages (needs matplotlib: ``pip install 'dsa[plot]'``).
The scripts in ``benchmarks/`` are thin wrappers around the suites here (their flags kept).

Counting conventions: indexer prefill FLOPs ``2·M·N·H·D`` (DeepGEMM's), decode bytes = the
132 cache bytes of every key read; top-k bytes = the fp32 logits read; sparse MLA FLOPs
``2·h·topk·(576+512)`` per token and bytes = q + the gathered rows + indices + out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from .constants import (D_QK, D_V, FP8_DS_MLA_ROW_BYTES, H200_BF16_FLOPS, H200_COPY_BYTES_PER_S, H200_FP8_FLOPS,
                        INDEXER_HEAD_DIM, INDEXER_ROW_BYTES)

FP8 = torch.float8_e4m3fn
KERNELS = ("indexer", "topk", "mla")


# ================================================================================ shared
def bench_ms(fn, device, rep: int = 200, warmup: int = 25) -> float:
    """Median milliseconds of ``fn()``: ``triton.testing.do_bench`` on a GPU, one timed call
    after one warm-up call on the CPU (the interpreter: only checks that the code runs)."""
    if torch.device(device).type != "cuda":
        fn()
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def decode_ms(fn, device, label: str, log=print, rep: int = 200, warmup: int = 25) -> float:
    """Median milliseconds of a decode call: the smaller of :func:`bench_ms` (eager) and, on a GPU, a CUDA-graph
    replay (``do_bench_cudagraph``), both logged. Decode runs in a CUDA graph in an engine, so its time is the GPU
    time alone. The eager time can also hold host time (one eager MLA call costs 0.1-0.2 ms of Python and two
    launches: fp8 h_q 16 at T 256 0.17-0.20 ms eager against 0.138 ms replayed, BENCHMARKS.md twelfth session) and
    the write-back of the L2 lines that ``do_bench``'s cache flush left dirty (nineteenth session). A failed capture
    is logged and the eager time kept."""
    ms = bench_ms(fn, device, rep=rep, warmup=warmup)
    if torch.device(device).type != "cuda":
        return ms
    try:
        from triton.testing import do_bench_cudagraph

        ms_graph = do_bench_cudagraph(fn, rep=100, return_mode="median")
    except Exception as e:  # e.g. a call that cannot be captured
        log(f"# {label}: CUDA graph capture FAILED {type(e).__name__}: {str(e)[:200]}")
        return ms
    log(f"# {label}: {ms * 1e3:.1f} us eager, {ms_graph * 1e3:.1f} us CUDA graph")
    return min(ms, ms_graph)


def interleaved_us(fns: dict, rounds: int, graph: bool, return_mode: str = "mean") -> dict:
    """A/B timings (GPU): ``rounds`` rounds, each timing every ``fns[name]()`` once in turn, so that the clock and
    the board's power state drift alike for all; microseconds per round, by name. ``graph``: CUDA-graph replay
    (``do_bench_cudagraph``, decode), else ``do_bench`` (many-token calls); ``return_mode`` theirs (the mean of
    each round's repetitions unless asked: the what-if and order scripts' numbers in BENCHMARKS.md are means)."""
    from triton.testing import do_bench, do_bench_cudagraph

    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name].append(1e3 * (do_bench_cudagraph(fn, rep=100, return_mode=return_mode) if graph
                                      else do_bench(fn, rep=200, return_mode=return_mode)))
    return times


def calc_diff(x, y) -> float:
    """DeepGEMM's ``1 - 2·Σxy / Σ(x² + y²)`` (0 when equal)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def ceilings() -> dict:
    return {"fp8_flops": H200_FP8_FLOPS, "bf16_flops": H200_BF16_FLOPS, "copy_bytes_per_s": H200_COPY_BYTES_PER_S}


def row(kernel, case, shape, ms, rate, unit, pct, base_ms=float("nan"), diff=None, cfg=None) -> dict:
    return dict(kernel=kernel, case=case, shape=shape, ms=ms, rate=rate, unit=unit, pct_ceiling=pct, base_ms=base_ms,
                speedup=base_ms / ms if ms > 0 and base_ms == base_ms else float("nan"), diff=diff,
                cfg=None if cfg is None else str(cfg))


def format_table(rows: list, title: str = "") -> str:
    out = [title] if title else []
    out.append(f"{'case':<22} {'shape':<36} {'ms':>9} {'rate':>14} {'% ceil':>7} {'torch ms':>9} {'speed-up':>8}"
               f" {'diff':>9}")
    for r in rows:
        d = f"{r['diff']:9.1e}" if isinstance(r.get("diff"), float) else f"{'-':>9}"
        out.append(f"{r['case']:<22} {r['shape']:<36} {r['ms']:9.4f} {r['rate']:8.1f} {r['unit']:<5} "
                   f"{r['pct_ceiling']:6.1f}% {r['base_ms']:9.3f} {r['speedup']:7.2f}x {d}")
    return "\n".join(out)


def plot(rows: list, path: str) -> None:
    """Two panels: % of the device ceiling and speed-up over PyTorch, one bar per case."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise RuntimeError("--plot needs matplotlib: pip install 'dsa[plot]' (or pip install matplotlib)") from e
    labels = [f"{r['kernel']}: {r['case']}" for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(13, 0.45 * len(rows) + 1.8))
    y = range(len(rows))
    ax[0].barh(y, [r["pct_ceiling"] for r in rows], color="tab:blue")
    ax[0].set_yticks(list(y), labels)
    ax[0].set_xlabel("% of the device ceiling (TFLOP/s or GB/s)")
    ax[0].invert_yaxis()
    ax[1].barh(y, [r["speedup"] if r["speedup"] == r["speedup"] else 0 for r in rows], color="tab:green")
    ax[1].set_yticks(list(y), [""] * len(rows))
    ax[1].axvline(1.0, color="k", lw=0.8)
    ax[1].set_xlabel("speed-up over the PyTorch baseline")
    ax[1].invert_yaxis()
    fig.suptitle("dsa kernels")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ================================================================================ indexer logits
INDEXER_H = 64
INDEXER_PREFILL_SWEEP = [
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=8192, num_warps=4, num_stages=3),
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=8192, num_warps=4, num_stages=4),
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=4096, num_warps=4, num_stages=3),
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=16384, num_warps=4, num_stages=3),
    dict(BLOCK_Q=4, BLOCK_N=64, SPAN=8192, num_warps=4, num_stages=2),
]
INDEXER_DECODE_SWEEP = [
    # the Hopper (Gluon) kernel where it serves the call (block sizes that are multiples of 32), else the Triton defaults
    dict(gluon=dict(SPAN=1024, STAGES=4)),
    dict(gluon=dict(SPAN=2048, STAGES=4)),
    dict(gluon=dict(SPAN=4096, STAGES=4)),
    dict(gluon=dict(SPAN=2048, STAGES=3)),
    dict(gluon=dict(SPAN=2048, STAGES=6)),
    # the portable Triton kernel
    dict(gluon=False, BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=3, PREFETCH=0),
    dict(gluon=False, BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=3, PREFETCH=0, MAXNREG=128),
    dict(gluon=False, BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=3, PREFETCH=3),
    dict(gluon=False, BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=4, PREFETCH=3),
    dict(gluon=False, BLOCK_N=64, SPAN=2048, num_warps=4, num_stages=4, PREFETCH=3),
    dict(gluon=False, BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=3, PREFETCH=3, MAXNREG=128),
    dict(gluon=False, BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=4, PREFETCH=3, MAXNREG=128),
    dict(gluon=False, BLOCK_N=64, SPAN=2048, num_warps=4, num_stages=5, PREFETCH=3, MAXNREG=128),
    dict(gluon=False, BLOCK_N=64, SPAN=2048, num_warps=4, num_stages=1, PREFETCH=2),
    dict(gluon=False, BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=1, PREFETCH=2),
    dict(gluon=False, BLOCK_N=64, SPAN=2048, num_warps=4, num_stages=1, PREFETCH=2, MAXNREG=168),
]


def indexer_prefill_inputs(M, N, g, dev):
    H, D = INDEXER_H, INDEXER_HEAD_DIM
    q = (torch.randn(M, H, D, device=dev, generator=g) * 4).to(FP8)
    k = (torch.randn(N, D, device=dev, generator=g) * 4).to(FP8)
    s = torch.rand(N, device=dev, generator=g) * 0.5 + 0.01
    w = torch.randn(M, H, device=dev, generator=g)
    ks = torch.zeros(M, dtype=torch.int32, device=dev)
    ke = (N - M + torch.arange(M, device=dev) + 1).int()
    return q, (k, s), w, ks, ke


def indexer_prefill_baseline(q, kv, w, ks, ke, rows=64):
    """The reference's formulation in PyTorch: bf16 matmul of dequantised values, relu, weighted head sum."""
    H, D = INDEXER_H, INDEXER_HEAD_DIM
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


def run_indexer_prefill(M, N, sweep=False, dev="cuda", baseline=True, log=print) -> dict:
    from .mqa_logits import fp8_mqa_logits_ref
    from .mqa_logits import kernel as K

    g = torch.Generator(device=dev).manual_seed(0)
    q, kv, w, ks, ke = indexer_prefill_inputs(M, N, g, dev)
    flops = 2.0 * M * N * INDEXER_H * INDEXER_HEAD_DIM
    out = torch.empty(M, N, dtype=torch.float32, device=dev)
    best = (None, None)
    for cfg in (INDEXER_PREFILL_SWEEP if sweep else [None]):
        ms = bench_ms(lambda cfg=cfg: K.fp8_mqa_logits_triton(q, kv[0], kv[1], w, ks, ke, True, out, config=cfg), dev,
                      rep=100 if sweep else 300, warmup=50)
        if sweep:
            log(f"  prefill {M}x{N} cfg {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
        if best[0] is None or ms < best[0]:
            best = (ms, cfg)
    ms, cfg = best
    K.fp8_mqa_logits_triton(q, kv[0], kv[1], w, ks, ke, True, out, config=cfg)
    sub = slice(max(0, M - 16), M)
    ref = fp8_mqa_logits_ref(q[sub], kv, w[sub], ks[sub], ke[sub])
    o = out[sub]
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(o)) and not torch.isnan(o).any(), "indexer prefill: wrong -inf pattern"
    diff = calc_diff(o[fin], ref[fin])
    base = bench_ms(lambda: indexer_prefill_baseline(q, kv, w, ks, ke), dev, rep=100, warmup=50) if baseline \
        else float("nan")
    return row("indexer", "prefill", f"M={M} N={N} H={INDEXER_H}", ms, flops / ms / 1e9, "TFLOP/s",
               100 * flops / ms * 1e3 / H200_FP8_FLOPS, base, diff, cfg)


def indexer_decode_inputs(B, lo, hi, bs, next_n, g, dev, in_order=False):
    """Decode indexer inputs: ``B`` requests of ``lo``-``hi`` keys (the first ``hi``), their blocks at shuffled
    places in the cache (``in_order``: each request's blocks in consecutive slots, the same values otherwise)."""
    from .layouts import indexer_cache_views

    H, D = INDEXER_H, INDEXER_HEAD_DIM
    lens = torch.randint(lo, hi + 1, (B,), device=dev, generator=g)
    lens[0] = hi
    nblk = (lens + bs - 1) // bs
    max_blocks = int(nblk.max())
    num_blocks = int(nblk.sum()) + 1
    perm = torch.randperm(num_blocks, device=dev, generator=g).int()
    if in_order:
        perm = torch.arange(num_blocks, dtype=torch.int32, device=dev)
    bt = torch.zeros(B, max_blocks, dtype=torch.int32, device=dev)
    starts = torch.cumsum(nblk, 0) - nblk
    for b in range(B):
        n = int(nblk[b])
        bt[b, :n] = perm[int(starts[b]):int(starts[b]) + n]
    cache = torch.empty(num_blocks, bs * INDEXER_ROW_BYTES, dtype=torch.uint8, device=dev)
    vals, scales = indexer_cache_views(cache)
    vals.copy_((torch.randn(vals.shape, device=dev, generator=g) * 4).to(FP8))
    scales.copy_(torch.rand(scales.shape, device=dev, generator=g) * 0.5 + 0.01)
    q = (torch.randn(B, next_n, H, D, device=dev, generator=g) * 4).to(FP8)
    w = torch.randn(B * next_n, H, device=dev, generator=g)
    return q, cache, w, lens.int(), bt, hi


def indexer_decode_baseline(q, cache, w, ctx, bt, max_len, chunk=8):
    from .layouts import indexer_cache_views

    H, D = INDEXER_H, INDEXER_HEAD_DIM
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


def run_indexer_decode(B, lo, hi, bs, next_n, sweep=False, dev="cuda", baseline=True, log=print) -> dict:
    from .layouts import indexer_cache_blocks
    from .mqa_logits import fp8_paged_mqa_logits_ref
    from .mqa_logits import kernel as K

    g = torch.Generator(device=dev).manual_seed(1)
    q, cache, w, ctx, bt, max_len = indexer_decode_inputs(B, lo, hi, bs, next_n, g, dev)
    nbytes = float(ctx.sum()) * INDEXER_ROW_BYTES
    out = torch.empty(B * next_n, max_len, dtype=torch.float32, device=dev)
    blocks = indexer_cache_blocks(cache)
    best = (None, None)
    for cfg in (INDEXER_DECODE_SWEEP if sweep else [None]):
        def fn(cfg=cfg):
            return K.fp8_paged_mqa_logits_triton(q, blocks, w, ctx, bt, max_len, True, out, config=cfg)

        try:
            ms = decode_ms(fn, dev, f"indexer decode bs={bs} next_n={next_n} {cfg or 'default'}", log,
                           rep=60 if sweep else 200, warmup=50)
        except Exception as e:  # a sweep entry that does not compile for this shape is reported, not fatal
            if not sweep:
                raise
            log(f"  decode bs={bs} next_n={next_n} cfg {cfg}: FAILED {type(e).__name__}: {str(e)[:160]}")
            continue
        if sweep:
            log(f"  decode bs={bs} next_n={next_n} cfg {cfg}: {ms:.3f} ms {nbytes / ms / 1e6:.0f} GB/s")
        if best[0] is None or ms < best[0]:
            best = (ms, cfg)
    ms, cfg = best
    K.fp8_paged_mqa_logits_triton(q, blocks, w, ctx, bt, max_len, True, out, config=cfg)
    ref = fp8_paged_mqa_logits_ref(q[:2], cache, w[:2 * next_n], ctx[:2], bt[:2], max_len)
    o = out[:2 * next_n]
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(o)) and not torch.isnan(o).any(), "indexer decode: wrong -inf pattern"
    diff = calc_diff(o[fin], ref[fin])
    base = float("nan")
    if baseline:
        base_out = indexer_decode_baseline(q, cache, w, ctx, bt, max_len)
        assert torch.equal(torch.isfinite(base_out), torch.isfinite(out))
        base = bench_ms(lambda: indexer_decode_baseline(q, cache, w, ctx, bt, max_len), dev, rep=100, warmup=50)
    return row("indexer", f"decode bs={bs} nn={next_n}", f"B={B} ctx {lo}-{hi} ({nbytes / 1e6:.0f} MB)", ms,
               nbytes / ms / 1e6, "GB/s", 100 * nbytes / ms * 1e3 / H200_COPY_BYTES_PER_S, base, diff, cfg)


def indexer_suite(size="full", sweep=False, dev="cuda", baseline=True, only=None, log=print,
                  block_sizes=(64, 1)) -> list:
    rows = []
    if only in (None, "prefill"):
        M, N = {"smoke": (8, 200), "quick": (1024, 32768), "full": (4096, 131072)}[size]
        rows.append(run_indexer_prefill(M, N, sweep, dev, baseline, log))
    if only in (None, "decode"):
        B, lo, hi = {"smoke": (3, 40, 90), "quick": (16, 4096, 16384), "full": (64, 32768, 131072)}[size]
        for bs in block_sizes:
            for next_n in (1, 2):
                rows.append(run_indexer_decode(B, lo, hi, bs, next_n, sweep, dev, baseline, log))
                if torch.device(dev).type == "cuda":
                    torch.cuda.empty_cache()
    return rows


# ================================================================================ top-k
def topk_sweeps():
    from .topk import TopKConfig

    prefill = [TopKConfig(), TopKConfig(ptx=False), TopKConfig(maxnreg=80),
               TopKConfig(block=2048, num_warps=8, programs_per_sm=8, maxnreg=None), TopKConfig(prefetch=2)]
    decode = [TopKConfig(), TopKConfig(ptx=False), TopKConfig(merge_warps=16), TopKConfig(splits=8),
              TopKConfig(splits=2)]
    return prefill, decode


def topk_check(x, k, out):
    want = torch.sort(torch.topk(x, k, dim=1).values, dim=1).values
    got = torch.sort(torch.gather(x, 1, out.long()), dim=1).values
    assert (out >= 0).all(), "top-k: unexpected -1 in full rows"
    assert torch.equal(got, want), "top-k: selected values differ from torch.topk"


def run_topk_case(name, M, N, k, decode, sweep=False, rotate=1, dev="cuda", baseline=True, log=print,
                  slots_bs=0) -> dict:
    """One top-k case; ``slots_bs`` > 0 (decode only): the form that writes global cache slots through a shuffled
    block table of that block size, checked against top-k + :func:`dsa.metadata.convert_req_index_to_global_index`
    (whose time is logged beside it); its PyTorch baseline is ``torch.topk`` and the block-table gather."""
    from .metadata import convert_req_index_to_global_index
    from .topk import top_k_indices

    g = torch.Generator(device=dev).manual_seed(0)
    xs = [torch.randn(M, N, device=dev, generator=g) for _ in range(rotate)]
    starts = torch.zeros(M, dtype=torch.int32, device=dev)
    ends = torch.full((M,), N, dtype=torch.int32, device=dev)
    seq = torch.full((M,), N, dtype=torch.int32, device=dev)
    out = torch.empty(M, k, dtype=torch.int32, device=dev)
    bt = None
    if slots_bs:
        nb = N // slots_bs
        bt = torch.randperm(M * nb, device=dev, generator=g).to(torch.int32).view(M, nb)
        req = torch.arange(M, dtype=torch.int32, device=dev)
        pos = torch.empty_like(out)
    it = [0]

    def nxt():
        it[0] = (it[0] + 1) % rotate
        return xs[it[0]]

    def call(cfg):
        x = nxt()
        if decode:
            return top_k_indices(x, k, seq_lens=seq, out=out, config=cfg, backend="triton", block_table=bt,
                                 block_size=slots_bs or None)
        return top_k_indices(x, k, starts, ends, out=out, config=cfg, backend="triton")

    def two_launches():
        top_k_indices(nxt(), k, seq_lens=seq, out=pos, backend="triton")
        return convert_req_index_to_global_index(req, bt, pos, slots_bs, backend="triton")

    res = []
    pre, dec = topk_sweeps()
    for cfg in ((dec if decode else pre) if sweep else [None]):
        call(cfg)
        if slots_bs:
            x_used = it[0]
            it[0] = (x_used - 1) % rotate  # the same input again
            assert torch.equal(out, two_launches()), "top-k slots: differ from top-k + the index conversion"
            it[0] = x_used
            pos_ = (out // slots_bs).long()
            inv = torch.empty(M * (N // slots_bs), dtype=torch.long, device=dev)
            inv[bt.view(-1).long()] = torch.arange(N // slots_bs, device=dev).repeat(M)
            topk_check(xs[it[0]], k, (inv[pos_] * slots_bs + out % slots_bs).to(torch.int32))
        else:
            topk_check(xs[it[0]], k, out)
        if not decode:
            ms = bench_ms(lambda cfg=cfg: call(cfg), dev, rep=100 if sweep else 300)
        else:
            ms = decode_ms(lambda cfg=cfg: call(cfg), dev, f"topk {name} {cfg or 'default'}", log,
                           rep=100 if sweep else 300)
            if slots_bs and cfg is None and torch.device(dev).type == "cuda":
                from triton.testing import do_bench_cudagraph

                ms_two = do_bench_cudagraph(two_launches, rep=100, return_mode="median")
                log(f"# topk {name}: top-k + index conversion (two launches) {ms_two * 1e3:.1f} us CUDA graph")
        res.append((ms, cfg))
        if sweep:
            log(f"  {name} cfg {cfg}: {ms * 1e3:.1f} us")
    ms, cfg = min(res, key=lambda r: r[0])
    if slots_bs:
        def torch_slots():
            p = torch.topk(nxt(), k, dim=1).indices
            return torch.gather(bt, 1, p // slots_bs) * slots_bs + p % slots_bs

        base_fn = torch_slots
    else:
        base_fn = lambda: torch.topk(nxt(), k, dim=1)  # noqa: E731
    base = bench_ms(base_fn, dev, rep=100 if sweep else 300) if baseline else float("nan")
    gbs = M * N * 4 / (ms * 1e-3) / 1e9
    return row("topk", name, f"{M}x{N} k={k}", ms, gbs, "GB/s", 100 * gbs * 1e9 / H200_COPY_BYTES_PER_S, base, None,
               cfg)


def topk_suite(size="full", sweep=False, dev="cuda", baseline=True, log=print) -> list:
    cases = {"smoke": [("prefill", 8, 4096, 64, False, 1, 0), ("decode", 4, 8192, 64, True, 2, 0),
                       ("decode_slots", 4, 8192, 64, True, 2, 16)],
             "quick": [("prefill", 1024, 32768, 2048, False, 1, 0), ("decode", 64, 32768, 2048, True, 4, 0)],
             "full": [("prefill", 4096, 131072, 2048, False, 1, 0), ("decode", 64, 131072, 2048, True, 4, 0),
                      ("decode_slots", 64, 131072, 2048, True, 4, 64)]}[size]
    return [run_topk_case(n, M, N, k, d, sweep, r, dev, baseline, log, bs) for n, M, N, k, d, r, bs in cases]


# ================================================================================ sparse MLA
MLA_SHAPES = {
    # name: (T, h_q, topk, num_req, s_kv, kv_format)
    "prefill_bf16_h128": (4096, 128, 2048, 1, 131072, "bf16"),
    "prefill_bf16_h64": (4096, 64, 2048, 1, 131072, "bf16"),
    "decode_fp8_h128": (256, 128, 2048, 128, 32768, "fp8_ds_mla"),
    "decode_fp8_h64": (256, 64, 2048, 128, 32768, "fp8_ds_mla"),
    "decode_fp8_h32": (256, 32, 2048, 128, 32768, "fp8_ds_mla"),
    "decode_fp8_h16": (256, 16, 2048, 128, 32768, "fp8_ds_mla"),
    "decode_bf16_h128": (256, 128, 2048, 128, 32768, "bf16"),
    "decode_fp8_h128_b1": (2, 128, 2048, 1, 65536, "fp8_ds_mla"),
    # the small-head goals: prefill at TP4/TP8 head counts, decode latency at batch 1 and batch 64 (s_q 1)
    "prefill_bf16_h32": (4096, 32, 2048, 1, 131072, "bf16"),
    "prefill_bf16_h16": (4096, 16, 2048, 1, 131072, "bf16"),
    "decode_fp8_h16_b1": (1, 16, 2048, 1, 32768, "fp8_ds_mla"),
    "decode_fp8_h16_b64": (64, 16, 2048, 64, 32768, "fp8_ds_mla"),
    # prefill over the fp8_ds_mla cache (no goal of its own; 32+ heads run on a bf16 copy: dequant_first_pays)
    "prefill_fp8_h128": (4096, 128, 2048, 1, 131072, "fp8_ds_mla"),
    "prefill_fp8_h32": (4096, 32, 2048, 1, 131072, "fp8_ds_mla"),
    # the same context in an engine's pool of MLA_POOL_ROWS rows (a bf16 copy of the pages read)
    "prefill_fp8_h128_pool": (4096, 128, 2048, 1, 131072, "fp8_ds_mla"),
    "prefill_fp8_h64_pool": (4096, 64, 2048, 1, 131072, "fp8_ds_mla"),
    "prefill_fp8_h32_pool": (4096, 32, 2048, 1, 131072, "fp8_ds_mla"),
}
#: the pool of the ``*_pool`` shapes (:func:`mla_inputs`' ``pool_rows``): 2M rows, 1.3 GB of fp8_ds_mla
MLA_POOL_ROWS = 1 << 21
MLA_QUICK = {
    "prefill_bf16_h128": (1024, 128, 2048, 1, 131072, "bf16"),
    "decode_fp8_h128": (64, 128, 2048, 32, 32768, "fp8_ds_mla"),
    "decode_fp8_h16": (64, 16, 2048, 32, 32768, "fp8_ds_mla"),
}
MLA_SMOKE = {
    "prefill_bf16_h16": (4, 16, 64, 1, 256, "bf16"),
    "decode_fp8_h16": (2, 16, 64, 2, 128, "fp8_ds_mla"),
}
# alternative launch configs timed with --sweep: (config overrides, num_splits or None)
MLA_SWEEP = {
    "prefill_bf16_h128": [(dict(gluon=False), None)],
    "prefill_bf16_h64": [(dict(gluon=False), None)],
    "decode_bf16_h128": [(dict(gluon=False), None)],
    "decode_fp8_h128": [(dict(gluon=False), None)],
    "decode_fp8_h64": [(dict(gluon=False), None)],
    "decode_fp8_h128_b1": [(dict(gluon=False), None), (dict(gluon=False), 4), ({}, 4), ({}, 32)],
    "decode_fp8_h32": [(dict(block_n=32, num_warps=4, num_stages=3), None), (dict(block_n=32, num_stages=3), None),
                       ({}, 2)],
    "decode_fp8_h16": [(dict(block_n=32), None), (dict(num_warps=8), None), ({}, 2), ({}, 4)],
}


def mla_inputs(T, h_q, topk, num_req, s_kv, kv_format, block_size=64, seed=0, dev="cuda", pool_rows=None):
    """Requests of s_kv cached tokens each; every query token attends to topk random slots of its
    own request (all valid). T tokens are spread evenly over the requests. ``pool_rows`` (a multiple of
    ``block_size``, at least ``num_req * s_kv``): the cache is an engine's pool of that many rows instead, the
    requests' blocks at random places in it and NaN in every other row (fp8: bytes 0xFF)."""
    from .mla_cache.reference import quantize_fp8_ds_mla

    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    S = num_req * s_kv
    if kv_format == "bf16":
        kv = torch.randn(S, D_QK, device=dev, generator=g).to(torch.bfloat16)
    else:
        kv = torch.empty(S, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8, device=dev)
        for s0 in range(0, S, 1 << 20):
            s1 = min(S, s0 + (1 << 20))
            c = torch.randn(s1 - s0, D_QK, device=dev, generator=g).to(torch.bfloat16)
            kv[s0:s1] = quantize_fp8_ds_mla(c[:, :512], c[:, 512:])
    req = torch.arange(T, device=dev) * num_req // T
    idx = (torch.randint(0, s_kv, (T, topk), device=dev, generator=g) + req[:, None] * s_kv).to(torch.int32)
    q = torch.randn(T, h_q, D_QK, device=dev, generator=g).to(torch.bfloat16)
    if pool_rows is not None:
        if pool_rows % block_size or pool_rows < S:
            raise ValueError(f"pool_rows: expected a multiple of {block_size} of at least {S}, got {pool_rows}")
        at = torch.randperm(pool_rows // block_size, device=dev, generator=g)[: S // block_size]
        pool = torch.empty(pool_rows, kv.shape[1], dtype=kv.dtype, device=dev)
        pool.view(torch.uint8).fill_(0xFF)  # (NaN in bf16 and in e4m3fn, scales and rope alike)
        pool.view(-1, block_size, kv.shape[1])[at] = kv.view(-1, block_size, kv.shape[1])
        idx = (at[idx.long() // block_size] * block_size + idx.long() % block_size).to(torch.int32)
        kv, S = pool, pool_rows
    nb = S // block_size
    kv = kv.view(nb, block_size, D_QK) if kv_format == "bf16" else kv.view(nb, block_size, 1, FP8_DS_MLA_ROW_BYTES)
    return q, kv, idx


def mla_baseline_chunk(topk, h_q):
    """Tokens per chunk of :func:`mla_baseline`: about 1 GiB of gathered rows and logits at a time."""
    return max(1, (1 << 30) // (topk * D_QK * 2 + h_q * topk * 6))


def mla_baseline(q, kv, idx, sm_scale, chunk):
    """Plain PyTorch: gather the rows of a chunk of tokens, dequantise, two bmm's, fp32 softmax."""
    from .mla_cache.reference import dequantize_fp8_ds_mla

    T, h_q, _ = q.shape
    flat = kv.reshape(-1, kv.shape[-1])
    out = torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        rows = flat[idx[t0:t1].long()]
        if rows.dtype == torch.uint8:
            rows = dequantize_fp8_ds_mla(rows)
        s = torch.bmm(q[t0:t1], rows.transpose(1, 2)).float() * sm_scale
        p = torch.softmax(s, dim=-1).to(torch.bfloat16)
        out[t0:t1] = torch.bmm(p, rows[..., :D_V])
    return out


def mla_run_checked(fn, out, want=None):
    """Run a sparse-MLA call ``fn()`` (returning ``(out, max_logits, lse)`` with ``out`` its output tensor) once into
    a NaN-poisoned ``out``. Returns copies of its three results and, against the reference's ``want``, ``(max |out
    - ref|, max relative lse error, max |max_logits - ref|)`` (None without ``want``): the A/B benchmarks' check."""
    out.fill_(float("nan"))
    _, ml, lse = fn()
    torch.cuda.synchronize()
    res = (out.clone(), ml.clone(), lse.clone())
    if want is None:
        return res, None
    return res, ((out.float() - want[0].float()).abs().max().item(),
                 ((lse - want[2]).abs() / want[2].abs().clamp(min=1)).max().item(), (ml - want[1]).abs().max().item())


def mla_counts(T, h_q, topk, kv_format):
    flops = 2.0 * T * h_q * topk * (D_QK + D_V)
    rowb = D_QK * 2 if kv_format == "bf16" else FP8_DS_MLA_ROW_BYTES
    nbytes = T * h_q * D_QK * 2 + T * topk * (rowb + 4) + T * h_q * D_V * 2
    return flops, nbytes


def mla_suite(size="full", sweep=False, dev="cuda", baseline=True, shapes=None, compile_only=False, deadline=0.0,
              log=print, sweep_rows=None) -> list:
    """One row per shape: the public path's time (the best swept variant in ``cfg`` when sweeping);
    prefill shapes are rated in TFLOP/s, decode shapes in whichever of TFLOP/s and GB/s is the larger
    share of its ceiling (both kept in the row)."""
    from .mla import sparse_mla
    from .mla.kernel import sparse_mla_triton

    t_start = time.time()
    table = {"smoke": MLA_SMOKE, "quick": MLA_QUICK, "full": MLA_SHAPES}[size]
    if shapes:
        table = {k: v for k, v in table.items() if k in shapes}
    cuda = torch.device(dev).type == "cuda"
    rows = []
    for name, (T, h_q, topk, num_req, s_kv, fmt) in table.items():
        if deadline and time.time() - t_start > deadline:
            log(f"# deadline: skipped {name}")
            continue
        bsz = 64 if num_req * s_kv % 64 == 0 else 1
        q, kv, idx = mla_inputs(T, h_q, topk, num_req, s_kv, fmt, block_size=bsz, dev=dev,
                                pool_rows=MLA_POOL_ROWS if name.endswith("_pool") else None)
        sm = 192 ** -0.5
        flops, nbytes = mla_counts(T, h_q, topk, fmt)
        out = torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=dev)
        flat = kv.reshape(-1, kv.shape[-1])
        variants = [({}, None)] + (MLA_SWEEP.get(name, []) if sweep else [])
        best = default = None
        out_default = None
        for cfg, ns in variants:
            if not cfg and ns is None:
                def fn(q=q, kv=kv, idx=idx, out=out):
                    return sparse_mla(q, kv, idx, sm, out=out, backend="triton")
            else:
                def fn(q=q, flat=flat, idx=idx, out=out, cfg=cfg, ns=ns):
                    return sparse_mla_triton(q, flat, idx, sm, D_V, None, None, out, num_splits=ns, config=cfg)
            try:
                out.fill_(float("nan"))
                fn()
                if cuda:
                    torch.cuda.synchronize()
            except Exception as e:  # out of resources etc.: report and go on
                log(f"# {name} {cfg} ns={ns}: FAILED {type(e).__name__}: {str(e)[:200]}")
                continue
            if compile_only:
                continue
            if out_default is None:
                out_default = out.clone()
            else:  # every variant computes the same function (up to fp32 summation order)
                diff = (out.float() - out_default.float()).abs().max().item()
                if not diff <= 0.0625:
                    log(f"# {name} {cfg} ns={ns}: WRONG, max diff to the default {diff}")
                    continue
            if name.startswith("prefill"):
                ms = bench_ms(fn, dev, rep=200)
            else:
                ms = decode_ms(fn, dev, f"{name} {cfg} ns={ns}", log)
            r = (name, f"{cfg or 'default'} ns={ns or 'auto'}", ms, flops / ms / 1e9, nbytes / ms / 1e6)
            if sweep_rows is not None:
                sweep_rows.append(r)
            if not cfg and ns is None:
                default = r
            if best is None or ms < best[2]:
                best = r
        if compile_only or default is None:
            continue
        base_ms, err = float("nan"), None
        if baseline:
            chunk = mla_baseline_chunk(topk, h_q)
            ref_out = mla_baseline(q, kv, idx, sm, chunk)
            err = (ref_out.float() - out_default.float()).abs().max().item()
            log(f"# {name}: max |kernel - baseline| = {err:.3g}")
            base_ms = bench_ms(lambda: mla_baseline(q, kv, idx, sm, chunk), dev, rep=100, warmup=10)
        ms = default[2]
        tf, gbs = flops / ms / 1e9, nbytes / ms / 1e6
        pct_f, pct_b = 100 * tf * 1e12 / H200_BF16_FLOPS, 100 * gbs * 1e9 / H200_COPY_BYTES_PER_S
        # prefill goals are TFLOP/s at every head count (the small-head rows would otherwise print GB/s)
        by_flops = name.startswith("prefill") or pct_f >= pct_b
        rate, unit, pct = (tf, "TFLOP/s", pct_f) if by_flops else (gbs, "GB/s", pct_b)
        rr = row("mla", name, f"T={T} h={h_q} topk={topk} {fmt}", ms, rate, unit, pct, base_ms, err,
                 f"best: {best[1]} {best[2]:.3f} ms" if sweep else None)
        rr.update(tflops=tf, gbs=gbs, pct_flops=pct_f, pct_bw=pct_b)
        rows.append(rr)
        q = kv = idx = out = flat = None
        if cuda:
            torch.cuda.empty_cache()
    return rows


# ================================================================================ the command
def add_subcommand(sub) -> None:
    b = sub.add_parser("bench", help="kernel benchmarks (indexer, top-k, sparse MLA): tables, ceilings, "
                                     "baselines, plot")
    b.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated subset of {','.join(KERNELS)}")
    b.add_argument("--quick", action="store_true", help="smaller shapes")
    b.add_argument("--smoke", action="store_true", help="tiny shapes (the only ones the CPU interpreter can run)")
    b.add_argument("--sweep", action="store_true", help="also time alternative launch configurations")
    b.add_argument("--no-baseline", action="store_true", help="skip the PyTorch baselines")
    b.add_argument("--plot", default=None, metavar="FILE.png", help="write a plot (needs matplotlib)")
    b.add_argument("--json", action="store_true", help="print the rows as JSON")
    b.set_defaults(fn=cmd_bench)


def cmd_bench(args) -> int:
    from .backend import interpreter_on

    kernels = [k.strip() for k in args.kernels.split(",") if k.strip()]
    bad = [k for k in kernels if k not in KERNELS]
    if bad or not kernels:
        print(f"dsa bench: --kernels: expected names from {','.join(KERNELS)}, got {args.kernels!r}", file=sys.stderr)
        return 2
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("dsa bench: --plot needs matplotlib, which is not installed: pip install 'dsa[plot]' "
                  "(or run without --plot)", file=sys.stderr)
            return 2
    if torch.cuda.is_available():
        dev, size = "cuda", "smoke" if args.smoke else "quick" if args.quick else "full"
    elif interpreter_on():
        dev, size = "cpu", "smoke"
        if not args.smoke:
            print("dsa bench: no GPU: running the --smoke shapes under Triton's CPU interpreter "
                  "(times are meaningless)", file=sys.stderr)
    else:
        print("dsa bench: needs a CUDA GPU (or TRITON_INTERPRET=1 with --smoke to check the code on the CPU)",
              file=sys.stderr)
        return 2
    log = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    if dev == "cuda":
        import triton

        log(f"# {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  ceilings "
            f"(dsa.constants): fp8 {H200_FP8_FLOPS / 1e12:.0f} / bf16 {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s, "
            f"copy {H200_COPY_BYTES_PER_S / 1e12:.1f} TB/s")
    base = not args.no_baseline
    suites = {"indexer": lambda: indexer_suite(size, args.sweep, dev, base, log=log),
              "topk": lambda: topk_suite(size, args.sweep, dev, base, log=log),
              "mla": lambda: mla_suite(size, args.sweep, dev, base, log=log)}
    titles = {"indexer": "## indexer logits (fp8_mqa_logits / fp8_paged_mqa_logits); baseline: PyTorch bf16 matmuls",
              "topk": "## top-k (top_k_indices); baseline: torch.topk",
              "mla": "## sparse MLA (sparse_mla); baseline: PyTorch gather + bmm + softmax"}
    rows = []
    for k in kernels:
        r = suites[k]()
        rows += r
        if not args.json:
            print(format_table(r, titles[k]) + "\n", flush=True)
    if args.json:
        rows = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in rows]
        print(json.dumps({"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
                          "size": size, "ceilings": ceilings(), "rows": rows}, indent=1))
    if args.plot:
        plot([{k: (float("nan") if v is None and k in ("speedup", "base_ms") else v) for k, v in r.items()}
              for r in rows], args.plot)
        log(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="dsa bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_subcommand(sub)
    args = ap.parse_args(["bench", *(argv if argv is not None else sys.argv[1:])])
    return cmd_bench(args)
