"""How fast can a kernel only READ the paged indexer cache, key by key, through the block table?

    python benchmarks/gather_ceiling.py

The decode logits goal counts 132 bytes per key. With block size 1 every key is its own
132-byte block at a 4-byte-aligned address anywhere in the cache, so the DRAM sectors it
touches (32 B each) hold more than the key's bytes. This script measures, on the decode
benchmark's inputs (B=64, contexts 32K-128K, shuffled block table), a kernel that walks the
keys exactly as ``fp8_paged_mqa_logits`` does (same grid, tiles, masks and loads, Triton's
pipeliner) but only sums each key's bytes times its scale and writes 4 bytes per key: no dot,
no heads. Its GB/s is the ceiling of the access pattern for a kernel built this way; the copy
rate of a contiguous tensor of the same size (bytes read + written, the convention of the
4.3 TB/s ceiling) is printed beside it.
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa.bench import indexer_decode_inputs  # noqa: E402
from dsa.constants import H200_COPY_BYTES_PER_S, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES  # noqa: E402
from dsa.layouts import indexer_cache_blocks  # noqa: E402


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


def main():
    dev = "cuda"
    rows = []
    for bs, shuffled in ((64, True), (1, True), (1, False)):
        g = torch.Generator(device=dev).manual_seed(1)
        _, cache, _, ctx, bt, max_len = indexer_decode_inputs(64, 32768, 131072, bs, 1, g, dev)
        if not shuffled:  # each request's keys in consecutive blocks
            nblk = (ctx.long() + bs - 1) // bs
            starts = torch.cumsum(nblk, 0) - nblk
            bt = (starts[:, None] + torch.arange(bt.shape[1], device=dev)[None, :]).clamp_max(cache.shape[0] - 1).int()
        blocks = indexer_cache_blocks(cache)
        out = torch.empty(ctx.shape[0], max_len, dtype=torch.float32, device=dev)
        nbytes = float(ctx.sum()) * INDEXER_ROW_BYTES
        for block_n, span in ((64, 1024), (128, 2048)):
            ms = triton.testing.do_bench(lambda: touch(blocks, ctx, bt, max_len, out, block_n, span), warmup=50, rep=200,
                                         return_mode="median")
            rows.append((f"block {bs}, {'shuffled' if shuffled else 'in order'}", f"tile {block_n}, span {span}", ms,
                         nbytes / ms / 1e6))
        flat = torch.empty(int(nbytes), dtype=torch.uint8, device=dev)
        dst = torch.empty_like(flat)
        ms = triton.testing.do_bench(lambda: dst.copy_(flat), warmup=50, rep=200, return_mode="median")
        rows.append((f"copy of {nbytes / 1e6:.0f} MB", "torch copy_ (bytes read + written)", ms, 2 * nbytes / ms / 1e6))
    print(f"{'pattern':<26} {'kernel':<40} {'ms':>8} {'GB/s':>7} {'% of copy':>9}")
    for name, kern, ms, gbs in rows:
        print(f"{name:<26} {kern:<40} {ms:8.4f} {gbs:7.0f} {100 * gbs * 1e9 / H200_COPY_BYTES_PER_S:8.1f}%")


if __name__ == "__main__":
    main()
