"""Triton kernels for the lightning indexer's K cache.

``_indexer_k_quant_kernel``: one program per ``BLOCK_T`` tokens; quantises each 128-value row
(``dsa.fp8.tl_quant_fp8_rows``, shared with the MLA cache writer) and stores the fp8 bytes and the fp32
scale at slot ``slot_mapping[t]`` of the block-major cache (slots ``< 0`` / ``>= n_slots``
masked out), or at row ``t`` of plain outputs when there is no slot mapping (block_size 1).

``_gather_indexer_k_kernel``: one program per tile of ``BLOCK_N`` output rows; each row finds
its request by a binary search over ``cu_seq_lens`` (no host sync, no per-request grid),
reads its block id from ``block_table`` and copies the 128 fp8 bytes and the scale.

All cache offsets are int64. Block sizes 1..256 (any block size, in fact).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from ..backend import fp8_mode
from ..constants import FP8_AMAX_EPS, FP8_MAX, INDEXER_HEAD_DIM
from ..fp8 import tl_quant_fp8_rows

# Launch configuration (tokens / rows per program, warps); a module-level dict so that the
# benchmark can sweep it (benchmarks/bench_cache_formats.py --sweep). The fastest of CONFIG_SWEEP
# on an H200 (2026-11-29, CUDA-graph timing): quant T=65536 6.6 us; gather 64 x 8192 tokens
# 38.6 us (32 rows per program: 60.1 us).
CONFIG = {"quant": {"BLOCK_T": 32, "num_warps": 4}, "gather": {"BLOCK_N": 128, "num_warps": 4}}
# candidates the benchmark times and the GPU tests check
CONFIG_SWEEP = {
    "quant": [{"BLOCK_T": b, "num_warps": w} for b in (16, 32, 64) for w in (4, 8)],
    "gather": [{"BLOCK_N": b, "num_warps": w} for b in (32, 128, 256) for w in (4, 8)],
}


@triton.jit(do_not_specialize=["n_tokens", "n_slots"])
def _indexer_k_quant_kernel(
    k_ptr, slot_ptr, val_ptr, scale_ptr,
    n_tokens, n_slots, block_size,
    stride_k, stride_vb, stride_vo, stride_sb,
    HAS_SLOTS: tl.constexpr, UE8M0: tl.constexpr, BLOCK_T: tl.constexpr, D: tl.constexpr,
    FP8_MAX_: tl.constexpr, AMAX_EPS: tl.constexpr, FP8_MODE: tl.constexpr,
):
    pid = tl.program_id(0)
    t = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T).to(tl.int64)
    in_t = t < n_tokens
    if HAS_SLOTS:
        slot = tl.load(slot_ptr + t, mask=in_t, other=-1).to(tl.int64)
    else:
        slot = t
    ok = in_t & (slot >= 0) & (slot < n_slots)
    slot = tl.where(ok, slot, 0)
    blk = slot // block_size
    off = slot - blk * block_size
    d = tl.arange(0, D)
    x = tl.load(k_ptr + t[:, None] * stride_k + d[None, :], mask=ok[:, None], other=0.0)
    q, scale = tl_quant_fp8_rows(x.to(tl.float32), UE8M0, FP8_MAX_, AMAX_EPS, FP8_MODE)
    tl.store(val_ptr + (blk * stride_vb + off * stride_vo)[:, None] + d[None, :], q, mask=ok[:, None])
    tl.store(scale_ptr + blk * stride_sb + off, scale, mask=ok)


# sizes and the metadata pointers (read one entry at a time: their alignment buys nothing) are not specialised,
# so the prefill block table may be a view at any row of the step's table and still take the same compiled kernel
@triton.jit(do_not_specialize=["n_out", "n_req", "num_blocks", "bt_width", "stride_bt"],
            do_not_specialize_on_alignment=["bt_ptr", "cu_ptr"])
def _gather_indexer_k_kernel(
    val_ptr, scale_ptr, bt_ptr, cu_ptr, out_k_ptr, out_s_ptr,
    n_out, n_req, num_blocks, block_size, bt_width,
    stride_vb, stride_vo, stride_sb, stride_bt, stride_ok,
    N_SEARCH: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):
    pid = tl.program_id(0)
    j = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N).to(tl.int64)
    total = tl.load(cu_ptr + n_req).to(tl.int64)
    # request of row j: the largest r in [0, n_req) with cu[r] <= j. A step shrinks [lo, hi) of
    # size s to at most ceil(s / 2), so N_SEARCH >= ceil(log2(n_req)) steps reach size 1; further
    # steps change nothing.
    lo = tl.zeros([BLOCK_N], dtype=tl.int64)
    hi = tl.zeros([BLOCK_N], dtype=tl.int64) + n_req
    for _ in tl.static_range(N_SEARCH):
        mid = (lo + hi) // 2
        right = tl.load(cu_ptr + mid).to(tl.int64) <= j
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    start = tl.load(cu_ptr + lo).to(tl.int64)
    p = j - start  # position inside the request
    row_ok = (j < n_out) & (j < total) & (p >= 0)
    col = p // block_size
    blk = tl.load(bt_ptr + lo * stride_bt + col, mask=row_ok & (col < bt_width), other=-1).to(tl.int64)
    src_ok = row_ok & (blk >= 0) & (blk < num_blocks)
    off = p - col * block_size
    d = tl.arange(0, D)
    v = tl.load(val_ptr + (blk * stride_vb + off * stride_vo)[:, None] + d[None, :], mask=src_ok[:, None], other=0)
    s = tl.load(scale_ptr + blk * stride_sb + off, mask=src_ok, other=0.0)
    tl.store(out_k_ptr + j[:, None] * stride_ok + d[None, :], v, mask=row_ok[:, None])
    tl.store(out_s_ptr + j, s, mask=row_ok)


def _cache_views(cache_blocks: torch.Tensor):
    """(values [nb, bs, 128] uint8 view, scales [nb, bs] f32 view) of the canonical cache."""
    from ..layouts import indexer_cache_views

    values, scales = indexer_cache_views(cache_blocks)
    return values.view(torch.uint8), scales


def indexer_k_quant_and_cache_launch(k, cache_blocks, slot_mapping, ue8m0: bool) -> None:
    """``k [T, 128]`` bf16 (row stride free), ``cache_blocks [nb, bs*132]`` uint8, ``slot_mapping [n]``."""
    n = slot_mapping.shape[0]
    values, scales = _cache_views(cache_blocks)
    nb, bs = scales.shape
    if n == 0 or nb == 0:
        return
    cfg = CONFIG["quant"]
    _indexer_k_quant_kernel[(cdiv(n, cfg["BLOCK_T"]),)](
        k, slot_mapping, values, scales,
        n, nb * bs, bs,
        k.stride(0), values.stride(0), values.stride(1), scales.stride(0),
        HAS_SLOTS=True, UE8M0=ue8m0, BLOCK_T=cfg["BLOCK_T"], D=INDEXER_HEAD_DIM,
        FP8_MAX_=FP8_MAX, AMAX_EPS=FP8_AMAX_EPS, FP8_MODE=fp8_mode(k.device), num_warps=cfg["num_warps"],
    )


def indexer_k_quant_launch(k, out_k, out_s, ue8m0: bool) -> None:
    """``k [T, 128]`` bf16 -> ``out_k [T, 128]`` uint8 view, ``out_s [T]`` f32 (contiguous)."""
    n = k.shape[0]
    if n == 0:
        return
    cfg = CONFIG["quant"]
    _indexer_k_quant_kernel[(cdiv(n, cfg["BLOCK_T"]),)](
        k, k, out_k, out_s,
        n, n, 1,
        k.stride(0), out_k.stride(0), 0, out_s.stride(0),
        HAS_SLOTS=False, UE8M0=ue8m0, BLOCK_T=cfg["BLOCK_T"], D=INDEXER_HEAD_DIM,
        FP8_MAX_=FP8_MAX, AMAX_EPS=FP8_AMAX_EPS, FP8_MODE=fp8_mode(k.device), num_warps=cfg["num_warps"],
    )


def _search_steps(n_req: int) -> int:
    """ceil(log2(n_req)) rounded up to a multiple of 4: few distinct compiled variants.
    (A constexpr: Triton 3.6's interpreter cannot loop over a runtime scalar argument.)"""
    return -(-(n_req - 1).bit_length() // 4) * 4


def gather_indexer_k_launch(cache_blocks, block_table, cu_seq_lens, out_k, out_s) -> None:
    """Gather into ``out_k [N, 128]`` uint8 view (row stride free) and ``out_s [N]`` f32 (contiguous)."""
    n_out = out_k.shape[0]
    n_req = cu_seq_lens.shape[0] - 1
    if n_out == 0 or n_req <= 0:
        return
    values, scales = _cache_views(cache_blocks)
    nb, bs = scales.shape
    cfg = CONFIG["gather"]
    _gather_indexer_k_kernel[(cdiv(n_out, cfg["BLOCK_N"]),)](
        values, scales, block_table, cu_seq_lens, out_k, out_s,
        n_out, n_req, nb, bs, block_table.shape[1],
        values.stride(0), values.stride(1), scales.stride(0), block_table.stride(0), out_k.stride(0),
        N_SEARCH=_search_steps(n_req), BLOCK_N=cfg["BLOCK_N"], D=INDEXER_HEAD_DIM, num_warps=cfg["num_warps"],
    )
