"""How fast can a kernel only READ the caches the way the decode indexer and sparse MLA read them?

    python benchmarks/gather_ceiling.py            # both
    python benchmarks/gather_ceiling.py indexer    # or: mla, or: sizes, or: programs

The decode logits goal counts 132 bytes per key. With block size 1 every key is its own
132-byte block at a 4-byte-aligned address anywhere in the cache, so the DRAM sectors it
touches (32 B each) hold more than the key's bytes. This script measures, on the decode
benchmark's inputs (B=64, contexts 32K-128K, shuffled block table), a kernel that walks the
keys exactly as ``fp8_paged_mqa_logits`` does (same grid, tiles, masks and loads, Triton's
pipeliner) but only sums each key's bytes times its scale and writes 4 bytes per key: no dot,
no heads. Its GB/s is the ceiling of the access pattern for a kernel built this way; the decode kernel itself
(``fp8_paged_mqa_logits``, next_n 1) on the same inputs, and the copy rate of a contiguous tensor of the same size
(bytes read + written, the convention of the 4.3 TB/s ceiling) are printed beside it.

Sparse MLA (``mla``): one program per query token walks its index list in tiles of 64 gathered
rows, as ``sparse_mla`` does, and only sums each row's 32-bit words (bf16 rows: 1152 bytes;
fp8_ds_mla rows: 656 bytes), writing 4 bytes per row. Shapes: the prefill goal's (4096 tokens x
2048 random rows of a 128K-row bf16 cache: 9.7 GB gathered, 151 MB distinct) and the fp8 decode
goals' (64 and 256 tokens x 2048 rows of their own request's 32K rows). Its GB/s bounds any
kernel that must gather those rows: the time a sparse MLA kernel cannot go below on these inputs. (Since 5c56174 the
row stride is a compile-time constant, so fp8 rows are read in 16-byte pieces; before, the 656-byte stride was a
runtime argument, not a multiple of 16, and every word was its own 4-byte load, sm_90 compile: the 2.0 TB/s it
measured for fp8 rows is a bound on that walk only.)

Concurrency (``programs``): the fp8 decode walk above (64 tokens x 2048 rows of 656 bytes) with 1-32 programs per
token, 4-16 warps per program and 32-128 rows per tile: how many programs per SM, and how many rows in flight, the
gather needs before it reaches its rate (BENCHMARKS.md, twenty-third session: 3.1-3.3 TB/s only from 4 programs per SM
on; 2.7 TB/s with 2).

Row sizes (``sizes``): what reading rows of one size at random places costs, the question behind both
small-record goals: the indexer's block-1 keys (132 bytes) and the fp8_ds_mla rows of small-head decode (656
bytes). Rows of 128-8448 bytes lie back to back in a 1.4 GB buffer (the decode caches' size); 131,072 or 524,288
of them (batch 64 or 256 x 2048), and 4,194,304 of the rows up to 1152 bytes (the block-1 decode benchmark reads
5.1M keys), are read at uniformly random row ids, and, as the baseline, in order. Each program reads one tile
of 32-128 rows, or walks 8 tiles of 64-128 rows with Triton's 3-stage pipelining (16-byte loads wherever the row
size allows) and stores 4 bytes per row; the fastest of these is printed. The last column is the marginal
rate between consecutive counts (extra bytes / extra time): the rate with the fixed cost of a launch taken out.

Every time here is a CUDA-graph median (``do_bench_cudagraph``), as the decode benchmarks are timed. (Until
this was so, the walks were timed with ``do_bench``: its L2 flush before each call leaves up to 50 MB of dirty lines
that the timed walk writes back, 8-9 us on the H200, and without the flush the host's launch of the Triton kernel is
in the time; on walks over 131,072 rows that was 10-24 us of 7-27 us. BENCHMARKS.md, nineteenth session.)
"""
from __future__ import annotations

import itertools
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa.bench import indexer_decode_inputs  # noqa: E402
from dsa.constants import H200_COPY_BYTES_PER_S, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES  # noqa: E402
from dsa.layouts import indexer_cache_blocks  # noqa: E402
from dsa.mqa_logits import fp8_paged_mqa_logits  # noqa: E402


def _ms(fn) -> float:
    """CUDA-graph median of ``fn`` in ms (no host launch time inside)."""
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


@triton.jit
def _touch_kernel(kv_ptr, kv_scale_ptr, ctx_ptr, bt_ptr, out_ptr, num_blocks, max_blocks, stride_btb, stride_o,
                  D: tl.constexpr, BS: tl.constexpr, ROW: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr):
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    L = tl.load(ctx_ptr + b)
    s_lo = pid_s * SPAN
    c_hi = tl.maximum(tl.minimum(L, s_lo + SPAN), s_lo)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    for s0 in range(s_lo, c_hi, BLOCK_N):
        s = s0 + offs_n
        blk = s // BS
        phys = tl.load(bt_row + blk, mask=(s < c_hi) & (blk < max_blocks), other=-1)
        ok = (phys >= 0) & (phys < num_blocks)
        base = phys.to(tl.int64) * (BS * ROW)
        k = tl.load(kv_ptr + (base + (s % BS) * D)[:, None] + offs_d[None, :], mask=ok[:, None], other=0)
        sc = tl.load(kv_scale_ptr + base // 4 + (BS * D // 4) + (s % BS), mask=ok, other=0.0)
        v = tl.sum(k.to(tl.int32), axis=1).to(tl.float32) * sc
        tl.store(out_ptr + b.to(tl.int64) * stride_o + s, v, mask=s < c_hi)


def touch(blocks, ctx, bt, max_len, out, block_n=64, span=1024):
    bs = blocks.shape[1] // INDEXER_ROW_BYTES
    grid = (triton.cdiv(max_len, span), ctx.shape[0])
    _touch_kernel[grid](blocks, blocks.view(torch.float32), ctx, bt, out, blocks.shape[0], bt.shape[1], bt.stride(0),
                        out.stride(0), D=INDEXER_HEAD_DIM, BS=bs, ROW=INDEXER_ROW_BYTES, BLOCK_N=block_n, SPAN=span,
                        num_warps=4, num_stages=3)


@triton.jit
def _rows_sum_kernel(kv_ptr, idx_ptr, out_ptr, S, topk, chunk, stride_it, stride_o, W: tl.constexpr,
                     W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, BLOCK_N: tl.constexpr):
    """Per gathered row (rows of ``W`` 32-bit words, back to back): the wrapping sum of its words, read as W1 + W2
    + W3 words (powers of two, 0: none; 16-byte loads wherever ``W`` allows, since it is a compile-time stride);
    program (c, t) walks entries [c * chunk, (c + 1) * chunk) of list t; entries < 0 or >= S read nothing (the
    chunks on grid axis 0, which allows 2**31 - 1 programs, not 65535)."""
    t = tl.program_id(1).to(tl.int64)
    c0 = tl.program_id(0) * chunk
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(c0, tl.minimum(c0 + chunk, topk), BLOCK_N):
        n = n0 + offs_n
        idx = tl.load(idx_ptr + t * stride_it + n, mask=n < topk, other=-1)
        ok = (idx >= 0) & (idx < S)
        row = kv_ptr + (tl.where(ok, idx, 0).to(tl.int64) * W)[:, None]
        m = ok[:, None]
        v = tl.sum(tl.load(row + tl.arange(0, W1)[None, :], mask=m, other=0), axis=1)
        if W2 > 0:
            v += tl.sum(tl.load(row + W1 + tl.arange(0, W2)[None, :], mask=m, other=0), axis=1)
        if W3 > 0:
            v += tl.sum(tl.load(row + W1 + W2 + tl.arange(0, W3)[None, :], mask=m, other=0), axis=1)
        tl.store(out_ptr + t * stride_o + n, v, mask=n < topk)


def rows_sum(words, idx, out, block_n=64, splits=1, num_stages=3, num_warps=4):
    """``words`` [S, W] int32 rows (contiguous); ``idx`` [T, topk] int32 row ids (invalid: < 0 or >= S); ``out``
    [T, topk] int32: each row's wrapping word sum (0 for invalid entries). ``splits`` programs per list, each
    walking one chunk of it (as sparse_mla's split-K)."""
    S, w = words.shape
    assert words.stride(0) == w
    parts = [1 << b for b in range(w.bit_length() - 1, -1, -1) if w >> b & 1] + [0, 0]
    assert sum(parts[:3]) == w, f"rows of {w} words: more than three power-of-two parts"
    topk = idx.shape[1]
    chunk = triton.cdiv(triton.cdiv(topk, splits), block_n) * block_n
    _rows_sum_kernel[(triton.cdiv(topk, chunk), idx.shape[0])](
        words, idx, out, S, topk, chunk, idx.stride(0), out.stride(0), W=w, W1=parts[0], W2=parts[1], W3=parts[2],
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)


def main_mla():
    from dsa.bench import mla_inputs

    dev = "cuda"
    rows = []
    cases = {"prefill bf16": (4096, 2048, 1, 131072, "bf16", (1,)),
             "decode fp8, 64 tokens": (64, 2048, 64, 32768, "fp8_ds_mla", (8, 16, 32)),
             "decode bf16, 64 tokens": (64, 2048, 64, 32768, "bf16", (8, 16, 32)),
             "decode fp8, 256 tokens": (256, 2048, 128, 32768, "fp8_ds_mla", (2, 4, 8))}
    for name, (T, topk, nreq, s_kv, fmt, split_list) in cases.items():
        _, kv, idx = mla_inputs(T, 16, topk, nreq, s_kv, fmt, dev=dev)
        flat = kv.reshape(-1, kv.shape[-1])
        words = flat.view(torch.int32)
        out = torch.empty(T, topk, dtype=torch.int32, device=dev)
        nbytes = float(T * topk * flat.shape[1] * flat.element_size())
        best = None
        for (bn, st), sp in itertools.product(((64, 3), (64, 1), (32, 2), (16, 3)), split_list):
            ms = _ms(lambda: rows_sum(words, idx, out, bn, sp, st))
            if best is None or ms < best[2]:
                best = (name, f"tile {bn}, {st} stages, {sp} splits", ms, nbytes / ms / 1e6)
        rows.append(best)
    print(f"{'sparse MLA gather (best)':<26} {'kernel':<40} {'ms':>8} {'GB/s':>7} {'% of copy':>9}")
    for name, kern, ms, gbs in rows:
        print(f"{name:<26} {kern:<40} {ms:8.4f} {gbs:7.0f} {100 * gbs * 1e9 / H200_COPY_BYTES_PER_S:8.1f}%")


def main_programs():
    """The fp8 decode walk (64 tokens x 2048 rows of 656 bytes) against the programs per token (splits), warps per
    program, rows per tile and pipeline stages: how much concurrency the gather needs to reach its rate."""
    from dsa.bench import mla_inputs

    dev = "cuda"
    T = 64
    _, kv, idx = mla_inputs(T, 16, 2048, T, 32768, "fp8_ds_mla", dev=dev)
    words = kv.reshape(-1, kv.shape[-1]).view(torch.int32)
    out = torch.empty(T, 2048, dtype=torch.int32, device=dev)
    nbytes = float(T * 2048 * 656)
    print(f"{'splits':>6} {'programs':>8} {'warps':>5} {'tile':>4} {'stages':>6} {'us':>7} {'GB/s':>6}")
    for sp, w, bn, st in itertools.product((1, 2, 4, 8, 16, 32), (4, 8, 16), (32, 64, 128), (1, 3)):
        if bn * 656 // (32 * w) > 700:  # (over ~170 words per thread: spills)
            continue
        ms = _ms(lambda: rows_sum(words, idx, out, bn, sp, st, w))
        print(f"{sp:6d} {sp * T:8d} {w:5d} {bn:4d} {st:6d} {ms * 1e3:7.1f} {nbytes / ms / 1e6:6.0f}", flush=True)


def main_sizes(buffer_bytes=1_400_000_000, counts=(131072, 524288, 4194304), big_max_row=1152):
    dev = "cuda"
    buf = torch.randint(-2**31, 2**31 - 1, (buffer_bytes // 4, ), dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{'row bytes':>9} {'rows read':>10} {'order':<8} {'µs':>9} {'GB/s':>7} {'% of copy':>9} "
          f"{'marginal GB/s':>13}")
    for row_bytes in (128, 132, 256, 512, 656, 1152, 8448):
        n_rows = buffer_bytes // row_bytes
        rows = buf[:n_rows * row_bytes // 4].view(n_rows, row_bytes // 4)
        last = {}
        for count in counts:
            if count > counts[1] and row_bytes > big_max_row:
                continue
            out = torch.empty(1, count, dtype=torch.int32, device=dev)
            for order, idx in (("random", torch.randint(0, n_rows, (count, ), generator=g, device=dev)),
                               ("in order", torch.arange(count, device=dev) % n_rows)):
                idx = idx.to(torch.int32)[None, :]
                best = min(_ms(lambda: rows_sum(rows, idx, out, bn, triton.cdiv(count, bn * per), st))
                           for bn, per, st in ((32, 1, 1), (64, 1, 1), (128, 1, 1), (64, 8, 3), (128, 8, 3)))
                gbs = count * row_bytes / best / 1e6
                marg = ""
                if order in last:
                    c0, t0 = last[order]
                    marg = f"{(count - c0) * row_bytes / (best - t0) / 1e6:13.0f}"
                last[order] = (count, best)
                print(f"{row_bytes:9d} {count:10d} {order:<8} {best * 1e3:9.1f} {gbs:7.0f} "
                      f"{100 * gbs * 1e9 / H200_COPY_BYTES_PER_S:8.1f}% {marg}", flush=True)


def main():
    dev = "cuda"
    rows = []
    for bs, shuffled in ((64, True), (1, True), (1, False)):
        g = torch.Generator(device=dev).manual_seed(1)
        q, cache, w, ctx, bt, max_len = indexer_decode_inputs(64, 32768, 131072, bs, 1, g, dev, in_order=not shuffled)
        blocks = indexer_cache_blocks(cache)
        out = torch.empty(ctx.shape[0], max_len, dtype=torch.float32, device=dev)
        nbytes = float(ctx.sum()) * INDEXER_ROW_BYTES
        for block_n, span in ((64, 1024), (128, 2048)):
            ms = _ms(lambda: touch(blocks, ctx, bt, max_len, out, block_n, span))
            rows.append((f"block {bs}, {'shuffled' if shuffled else 'in order'}", f"tile {block_n}, span {span}", ms,
                         nbytes / ms / 1e6))
        logits = torch.empty(ctx.shape[0], max_len, dtype=torch.float32, device=dev)
        ms = _ms(lambda: fp8_paged_mqa_logits(q, cache, w, ctx, bt, max_len, out=logits))
        rows.append((f"block {bs}, {'shuffled' if shuffled else 'in order'}", "fp8_paged_mqa_logits (the kernel)", ms,
                     nbytes / ms / 1e6))
        flat = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(flat)
        ms = _ms(lambda: dst.copy_(flat))
        rows.append((f"copy of {nbytes / 1e6:.0f} MB", "torch copy_ (bytes read + written)", ms, 2 * nbytes / ms / 1e6))
    print(f"{'pattern':<26} {'kernel':<40} {'ms':>8} {'GB/s':>7} {'% of copy':>9}")
    for name, kern, ms, gbs in rows:
        print(f"{name:<26} {kern:<40} {ms:8.4f} {gbs:7.0f} {100 * gbs * 1e9 / H200_COPY_BYTES_PER_S:8.1f}%")


if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "both"
    if which in ("both", "indexer"):
        main()
    if which in ("both", "mla"):
        main_mla()
    if which == "sizes":
        main_sizes()
    if which == "programs":
        main_programs()
