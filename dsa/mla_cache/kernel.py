"""Triton kernels writing and reading the MLA cache (bf16 and fp8_ds_mla rows).

``_mla_cache_write_kernel``: one program per ``BLOCK_T`` tokens; a constexpr switch picks the
format. Token ``t`` goes to row ``slot_mapping[t]`` (int64 offsets); slots ``< 0`` or
``>= n_slots`` are masked out. The fp8 path computes the amax of each 128-group, the
power-of-two scale by exact bit arithmetic and quantises with the exact product by 2^-k (the
same bits as the reference's IEEE division) and a round-to-nearest-even, saturating cast, so
the bytes equal ``reference.py``'s.

``_fp8_ds_mla_read_kernel``: dequantises fp8_ds_mla rows to bf16 ``[c_kv | k_pe]``.

The cache row is addressed through the typed views of ``dsa.layouts.fp8_ds_mla_views``
(values, scales, rope: three pointers into the same storage, each with its row stride).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from ..constants import (
    FP8_AMAX_EPS,
    FP8_DS_MLA_GROUP,
    FP8_DS_MLA_NUM_GROUPS,
    FP8_MAX,
    KV_LORA_RANK,
    ROPE_DIM,
)
from ..backend import fp8_mode, num_sms
from ..fp8 import tl_fp8_to_f32, tl_quant_fp8_rows
from ..layouts import fp8_ds_mla_views

# Launch configuration (tokens / rows per program, warps); a module-level dict so that the
# benchmark can sweep it (benchmarks/bench_cache_formats.py --sweep). The fastest of CONFIG_SWEEP
# on an H200 (2026-11-29, T = 65536, CUDA-graph timing): write bf16 43.5 us, write fp8 47.7 us,
# read 34.5 us; slowest: 4 tokens per program with 8 warps (61.1 / 79.2 / 51.8 us).
CONFIG = {
    "write_bf16": {"BLOCK_T": 8, "num_warps": 4},
    "write_fp8": {"BLOCK_T": 16, "num_warps": 4},
    "read": {"BLOCK_R": 8, "num_warps": 4},
}
#: programs per SM of a read with the count on the device (each takes every num_programs-th block of rows: 16 of
#: 4 warps fill an SM)
READ_PROGRAMS_PER_SM = 16
# candidates the benchmark times and the GPU tests check
CONFIG_SWEEP = {
    "write_bf16": [{"BLOCK_T": b, "num_warps": w} for b in (4, 8, 16, 32) for w in (4, 8)],
    "write_fp8": [{"BLOCK_T": b, "num_warps": w} for b in (4, 8, 16, 32) for w in (4, 8)],
    "read": [{"BLOCK_R": b, "num_warps": w} for b in (4, 8, 16, 32) for w in (4, 8)],
}


@triton.jit(do_not_specialize=["n_tokens", "n_slots"])
def _mla_cache_write_kernel(
    ckv_ptr, kpe_ptr, slot_ptr,
    val_ptr, scale_ptr, rope_ptr,
    n_tokens, n_slots,
    stride_ckv, stride_kpe, stride_val, stride_scale, stride_rope,
    FP8: tl.constexpr, HAS_SLOTS: tl.constexpr, BLOCK_T: tl.constexpr,
    GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, ROPE: tl.constexpr,
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
    ok2 = ok[:, None]
    d = tl.arange(0, GROUP)
    for g in tl.static_range(NUM_GROUPS):
        cols = g * GROUP + d
        x = tl.load(ckv_ptr + t[:, None] * stride_ckv + cols[None, :], mask=ok2, other=0.0)
        dst = val_ptr + slot[:, None] * stride_val + cols[None, :]
        if FP8:
            q, scale = tl_quant_fp8_rows(x.to(tl.float32), True, FP8_MAX_, AMAX_EPS, FP8_MODE)
            tl.store(dst, q, mask=ok2)
            tl.store(scale_ptr + slot * stride_scale + g, scale, mask=ok)
        else:
            tl.store(dst, x, mask=ok2)
    r = tl.arange(0, ROPE)
    pe = tl.load(kpe_ptr + t[:, None] * stride_kpe + r[None, :], mask=ok2, other=0.0)
    tl.store(rope_ptr + slot[:, None] * stride_rope + r[None, :], pe, mask=ok2)


@triton.jit
def _read_rows(val_ptr, scale_ptr, rope_ptr, out_ptr, page_ptr, blk, n_rows, n_src, stride_val, stride_scale,
               stride_rope, stride_out, BLOCK_R: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr,
               ROPE: tl.constexpr, FP8_MODE: tl.constexpr, PAGED: tl.constexpr, PAGE_SHIFT: tl.constexpr):
    i = (blk * BLOCK_R + tl.arange(0, BLOCK_R)).to(tl.int64)  # (row numbers fit int32; their offsets, int64)
    ok = i < n_rows
    if PAGED:  # output row i <- source row pages[i // PAGE] * PAGE + i % PAGE (0 past the source's end)
        page = tl.load(page_ptr + (i >> PAGE_SHIFT), mask=ok, other=0).to(tl.int64)
        src = (page << PAGE_SHIFT) + (i & ((1 << PAGE_SHIFT) - 1))
        ld = ok & (src < n_src)
    else:
        src = i
        ld = ok
    ok2 = ok[:, None]
    ld2 = ld[:, None]
    d = tl.arange(0, GROUP)
    for g in tl.static_range(NUM_GROUPS):
        cols = g * GROUP + d
        b = tl.load(val_ptr + src[:, None] * stride_val + cols[None, :], mask=ld2, other=0)
        s = tl.load(scale_ptr + src * stride_scale + g, mask=ld, other=0.0)
        v = tl_fp8_to_f32(b, FP8_MODE) * s[:, None]
        tl.store(out_ptr + i[:, None] * stride_out + cols[None, :], v.to(tl.bfloat16), mask=ok2)
    r = tl.arange(0, ROPE)
    pe = tl.load(rope_ptr + src[:, None] * stride_rope + r[None, :], mask=ld2, other=0.0)
    tl.store(out_ptr + i[:, None] * stride_out + NUM_GROUPS * GROUP + r[None, :], pe, mask=ok2)


@triton.jit
def _fp8_ds_mla_read_kernel(
    val_ptr, scale_ptr, rope_ptr, out_ptr, page_ptr, count_ptr,
    n_rows, n_src, stride_val, stride_scale, stride_rope, stride_out,
    BLOCK_R: tl.constexpr, GROUP: tl.constexpr, NUM_GROUPS: tl.constexpr, ROPE: tl.constexpr, FP8_MODE: tl.constexpr,
    PAGED: tl.constexpr, PAGE_SHIFT: tl.constexpr, COUNTED: tl.constexpr,
):
    if COUNTED:  # the pages' count on the device: its pages if they fit the ``n_rows`` of ``out`` (else none), each
        pages = tl.load(count_ptr)  # program taking every num_programs-th block of rows
        rows = tl.where(pages <= (n_rows >> PAGE_SHIFT), pages << PAGE_SHIFT, 0)
        for blk in range(tl.program_id(0), tl.cdiv(rows, BLOCK_R), tl.num_programs(0)):
            _read_rows(val_ptr, scale_ptr, rope_ptr, out_ptr, page_ptr, blk, rows, n_src, stride_val, stride_scale,
                       stride_rope, stride_out, BLOCK_R, GROUP, NUM_GROUPS, ROPE, FP8_MODE, PAGED, PAGE_SHIFT)
    else:
        _read_rows(val_ptr, scale_ptr, rope_ptr, out_ptr, page_ptr, tl.program_id(0), n_rows, n_src, stride_val,
                   stride_scale, stride_rope, stride_out, BLOCK_R, GROUP, NUM_GROUPS, ROPE, FP8_MODE, PAGED,
                   PAGE_SHIFT)


def mla_cache_write(c_kv, k_pe, rows, slot_mapping, fp8: bool) -> None:
    """Launch the writer. ``rows``: flat contiguous cache ``[S, 576]`` bf16 or ``[S, 656]`` uint8;
    ``slot_mapping``: ``[n]`` int32/int64 (``n <= T``), or None for slot = token index."""
    n = c_kv.shape[0] if slot_mapping is None else slot_mapping.shape[0]
    if n == 0 or rows.shape[0] == 0:
        return
    if fp8:
        values, scales, rope = fp8_ds_mla_views(rows)
        values = values.view(torch.uint8)
    else:
        values, scales, rope = rows[:, :KV_LORA_RANK], rows, rows[:, KV_LORA_RANK:]
    cfg = CONFIG["write_fp8" if fp8 else "write_bf16"]
    grid = (cdiv(n, cfg["BLOCK_T"]),)
    _mla_cache_write_kernel[grid](
        c_kv, k_pe, slot_mapping if slot_mapping is not None else c_kv,
        values, scales, rope,
        n, rows.shape[0],
        c_kv.stride(0), k_pe.stride(0), values.stride(0), scales.stride(0), rope.stride(0),
        FP8=fp8, HAS_SLOTS=slot_mapping is not None, BLOCK_T=cfg["BLOCK_T"],
        GROUP=FP8_DS_MLA_GROUP, NUM_GROUPS=FP8_DS_MLA_NUM_GROUPS, ROPE=ROPE_DIM,
        FP8_MAX_=FP8_MAX, AMAX_EPS=FP8_AMAX_EPS, FP8_MODE=fp8_mode(c_kv.device),
        num_warps=cfg["num_warps"],
    )


def fp8_ds_mla_read(rows: torch.Tensor, out: torch.Tensor, pages: torch.Tensor | None = None,
                    page_rows: int = 64, count: torch.Tensor | None = None) -> None:
    """Dequantise ``rows [R, 656]`` uint8 (row stride free) into ``out [R, 576]`` bf16; with ``pages [P]`` int32
    (page numbers of ``page_rows`` rows, a power of two), only those pages, in that order: ``out [P * page_rows,
    576]`` row ``i`` from row ``pages[i // page_rows] * page_rows + i % page_rows`` (0 where that is past ``R``).
    ``count`` (with ``pages``; ``[1]`` int32 on the device, read by the kernel: no synchronisation): only the first
    ``count`` pages, and none where they exceed ``out``'s rows (``out [n * page_rows, 576]``, ``pages`` at least
    ``min(count, n)`` long); the rest of ``out`` is left as it was."""
    n = rows.shape[0] if pages is None else out.shape[0]
    if n == 0:
        return
    shift = page_rows.bit_length() - 1
    assert 1 << shift == page_rows, "page_rows is not a power of two"
    assert pages is None or count is not None or n == pages.numel() * page_rows, "pages and out disagree"
    assert count is None or (pages is not None and n % page_rows == 0 and count.dtype == torch.int32), "count"
    values, scales, rope = fp8_ds_mla_views(rows)
    cfg = CONFIG["read"]
    grid = cdiv(n, cfg["BLOCK_R"])
    if count is not None:  # (a grid the size of the largest copy would be mostly idle programs)
        sms = num_sms(rows.device)
        grid = min(grid, READ_PROGRAMS_PER_SM * sms if sms else 4)
    _fp8_ds_mla_read_kernel[(grid,)](
        values.view(torch.uint8), scales, rope, out, out if pages is None else pages, out if count is None else count,
        n, rows.shape[0], values.stride(0), scales.stride(0), rope.stride(0), out.stride(0),
        BLOCK_R=cfg["BLOCK_R"], GROUP=FP8_DS_MLA_GROUP, NUM_GROUPS=FP8_DS_MLA_NUM_GROUPS, ROPE=ROPE_DIM,
        FP8_MODE=fp8_mode(rows.device), PAGED=pages is not None, PAGE_SHIFT=shift, COUNTED=count is not None,
        num_warps=cfg["num_warps"],
    )
