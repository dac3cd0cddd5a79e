"""Triton kernels of the lightning indexer's logits and their launch code.

Both kernels compute, for a tile of BLOCK_N keys and a group of query rows that
share those keys, ONE fp8 ``tl.dot`` with fp32 accumulation::

    scores[n, r*H + h] = k[n] . q[r, h]          key tile [BLOCK_N, D] (A) x q^T [D, R*H] (B)

followed, in registers, by ``relu``, the per-(row, head) weight, the sum over the
H heads of each row (a reshape ``[BLOCK_N, R, H]`` and a reduction over the last
axis) and the key's scale. The key tile is read once for all R query rows (the
N dimension of the dot is R*H: 256 for R = 4 rows of 64 heads).

* ``_mqa_logits_kernel`` (prefill): R = BLOCK_Q consecutive query rows; a program
  walks a span of key tiles, computes only the tiles that meet the rows'
  ``[min ks, max ke)`` and writes ``-inf`` tiles elsewhere (``CLEAN``).
* ``_paged_mqa_logits_kernel`` (decode): R = next_n (padded to a power of two),
  the rows of one request; keys are gathered straight from the paged indexer
  cache through the block table (one table entry per key, so any block size
  from 1 to 256 works with any BLOCK_N; when BLOCK_N divides the block size,
  ``TIB``, one entry per tile, which leaves one base address per tile and cut
  the loop by about 15% of its instructions), in one launch. Triton pipelines the key
  tiles (cp.async, the block-table entries one stage earlier; ``PREFETCH`` 0). With
  ``PREFETCH`` 3 (tiles inside one block) the span's table entries are loaded
  before the loop, so no load feeds a key address and the pipeliner keeps
  num_stages - 1 key tiles in flight; the scales, which feed no dot and which
  Triton would load synchronously, are loaded by hand one tile ahead. With
  ``PREFETCH`` 2 keys, scales and table entries are all loaded by hand, one tile
  ahead, in registers (block size 1, whose keys are only 4-byte aligned).

The dot's B operand (the q rows, [R, D]) is loaded once per program and stays in
shared memory; the wgmma is m64nRk32 (R = 256 for prefill, next_n_pad*64 for decode).

On Hopper, the decode op runs :mod:`dsa.mqa_logits.kernel_sm90` (Gluon: TMA or cp.async copies
of the paged cache, one product per tile over all next_n rows) wherever it is supported; this kernel
serves everything else.

All cache and output offsets are int64. Every key load is masked by the row's
context, so unused cache slots (which may hold NaN) are never read.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # Gluon (Hopper) decode kernel: needs triton.experimental.gluon
    from . import kernel_sm90
except ImportError:  # pragma: no cover - a Triton without Gluon
    kernel_sm90 = None

from .._host import cdiv, next_power_of_2
from ..backend import fp8_mode, gpu_target, interpreter_on, nvidia_options
from ..constants import INDEXER_ROW_BYTES
from ..fp8 import tl_fp8_operand


INDEXER_ROW_BYTES_C = tl.constexpr(INDEXER_ROW_BYTES)


# --------------------------------------------------------------------------------------
# Prefill: fp8_mqa_logits
# --------------------------------------------------------------------------------------
@triton.jit
def _mqa_logits_kernel(
    q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr,
    M, N,
    stride_qm, stride_qh, stride_km, stride_ks, stride_wm, stride_om,
    H: tl.constexpr, D: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, SPAN: tl.constexpr,
    CLEAN: tl.constexpr, FP8_MODE: tl.constexpr,
):
    pid_q = tl.program_id(0)
    pid_n = tl.program_id(1)
    R: tl.constexpr = BLOCK_Q * H

    rows = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    row_ok = rows < M
    ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    ks = tl.maximum(ks, 0)
    ke = tl.minimum(ke, N)
    ks = tl.where(row_ok & (ks < ke), ks, N)  # empty rows do not widen the span
    kmin = tl.min(ks, axis=0)
    kmax = tl.max(ke, axis=0)

    n_lo = pid_n * SPAN
    n_hi = tl.minimum(N, n_lo + SPAN)
    c_lo = tl.maximum(n_lo, (kmin // BLOCK_N) * BLOCK_N)
    c_hi = tl.minimum(n_hi, kmax)
    has = c_lo < c_hi
    c_lo = tl.where(has, c_lo, n_lo)
    c_hi = tl.where(has, c_hi, n_lo)
    c_end = tl.where(has, tl.cdiv(c_hi, BLOCK_N) * BLOCK_N, n_lo)

    rows64 = rows.to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)

    if CLEAN:
        ninf = tl.full((BLOCK_N, BLOCK_Q), float("-inf"), tl.float32)
        for n0 in range(n_lo, c_lo, BLOCK_N):
            n = n0 + offs_n
            tl.store(out_ptr + rows64[None, :] * stride_om + n[:, None], ninf,
                     mask=(n < c_lo)[:, None] & row_ok[None, :])
        for n0 in range(c_end, n_hi, BLOCK_N):
            n = n0 + offs_n
            tl.store(out_ptr + rows64[None, :] * stride_om + n[:, None], ninf,
                     mask=(n < n_hi)[:, None] & row_ok[None, :])

    # the R = BLOCK_Q*H (row, head) pairs of this program, loaded once
    offs_r = tl.arange(0, R)
    q_row = pid_q * BLOCK_Q + offs_r // H
    q_head = offs_r % H
    q_ok = q_row < M
    q_off = q_row.to(tl.int64) * stride_qm + q_head * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0)  # [R, D]
    w = tl.load(w_ptr + q_row.to(tl.int64) * stride_wm + q_head, mask=q_ok, other=0.0)  # [R]
    qT = tl.trans(tl_fp8_operand(q, FP8_MODE))  # [D, R]

    for n0 in range(c_lo, c_hi, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < c_hi
        k = tl.load(k_ptr + n.to(tl.int64)[:, None] * stride_km + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        k_scale = tl.load(k_scale_ptr + n.to(tl.int64) * stride_ks, mask=n_ok, other=0.0)
        s = tl.dot(tl_fp8_operand(k, FP8_MODE), qT)  # [BLOCK_N, R] fp32
        s = tl.maximum(s, 0.0) * w[None, :]
        logits = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_Q, H)), axis=2) * k_scale[:, None]  # [BLOCK_N, BLOCK_Q]
        if CLEAN:
            inside = (n[:, None] >= ks[None, :]) & (n[:, None] < ke[None, :])
            logits = tl.where(inside, logits, float("-inf"))
        tl.store(out_ptr + rows64[None, :] * stride_om + n[:, None], logits,
                 mask=(n < n_hi)[:, None] & row_ok[None, :])


# Launch configurations: BLOCK_R (= BLOCK_Q * H, the N dim of the dot; BLOCK_Q may be given
# instead), BLOCK_N keys per tile, SPAN keys per program (a multiple of BLOCK_N), num_warps,
# num_stages. "default" was the fastest of benchmarks/bench_mqa_logits.py --sweep on an H200
# (2026-11-29): 9.25 ms for 4096 queries x 131072 keys x 64 heads (951 TFLOP/s); 2 CTAs of
# 254 registers per SM. The interpreter uses small tiles so the CPU tests cover many of them.
PREFILL_CONFIGS = {
    "default": dict(BLOCK_R=256, BLOCK_N=64, SPAN=8192, num_warps=4, num_stages=3),
    "interpret": dict(BLOCK_R=128, BLOCK_N=32, SPAN=64, num_warps=4, num_stages=1),
}
#: what changes in "default" on other GPUs (:func:`dsa.backend.gpu_target`), chosen by compiling, not timing: on
#: sm_100 (B200) the 4-warp programs spill 128-144 bytes per thread, 8-warp ones nothing (tests/test_targets.py)
PREFILL_TARGET_CONFIGS = {("cuda", 100): dict(num_warps=8)}


def _prefill_config(H: int, override: dict | None, target: tuple | None = None):
    cfg = dict(PREFILL_CONFIGS["interpret" if interpreter_on() else "default"])
    cfg.update(PREFILL_TARGET_CONFIGS.get(target, {}))
    if override:
        cfg.update(override)
    if H <= 16 and not (override and "BLOCK_R" in override):
        cfg["BLOCK_R"] = min(cfg["BLOCK_R"], 128)  # 16 rows of 16 heads spill registers (ptxas, sm_90)
    block_q = cfg.pop("BLOCK_Q", None) or max(1, cfg["BLOCK_R"] // H)
    cfg.pop("BLOCK_R", None)
    cfg["BLOCK_Q"] = block_q
    cfg["SPAN"] = max(cfg["BLOCK_N"], cfg["SPAN"] // cfg["BLOCK_N"] * cfg["BLOCK_N"])
    return cfg


def fp8_mqa_logits_triton(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, out, config=None):
    """Launch the prefill kernel; arguments already validated. ``out`` is [M, N] f32."""
    M, H, D = q.shape
    N = k.shape[0]
    if M == 0 or N == 0:
        return out
    cfg = _prefill_config(H, config, gpu_target(q.device))
    num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    grid = (cdiv(M, cfg["BLOCK_Q"]), cdiv(N, cfg["SPAN"]))
    mode = fp8_mode(q.device)
    if mode:  # no e4m3fn type in Triton here: the bytes, converted in the kernel
        q, k = q.view(torch.uint8), k.view(torch.uint8)
    _mqa_logits_kernel[grid](
        q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, out,
        M, N,
        q.stride(0), q.stride(1), k.stride(0), k_scale.stride(0), weights.stride(0), out.stride(0),
        H=H, D=D, CLEAN=bool(clean_logits), FP8_MODE=mode, num_warps=num_warps, num_stages=num_stages, **cfg,
    )
    return out


# --------------------------------------------------------------------------------------
# Decode: fp8_paged_mqa_logits
# --------------------------------------------------------------------------------------
@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr, kv_ptr, kv_scale_ptr, w_ptr, ctx_ptr, bt_ptr, out_ptr,
    num_blocks, max_blocks, max_context_len,
    stride_qb, stride_qn, stride_qh, stride_wm, stride_cb, stride_btb, stride_om,
    NEXT_N: tl.constexpr, NEXT_N_PAD: tl.constexpr, CTX_2D: tl.constexpr,
    H: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    BLOCK_N: tl.constexpr, SPAN: tl.constexpr, CLEAN: tl.constexpr, PREFETCH: tl.constexpr,
    NT: tl.constexpr, FP8_MODE: tl.constexpr,
):
    pid_s = tl.program_id(0)
    b = tl.program_id(1)
    R: tl.constexpr = NEXT_N_PAD * H
    TIB: tl.constexpr = BS % BLOCK_N == 0  # every tile inside one block (SPAN is a multiple of BLOCK_N)
    ROW: tl.constexpr = INDEXER_ROW_BYTES_C  # bytes per token
    BLOCK_BYTES: tl.constexpr = BS * ROW

    # the key limit of each of the request's next_n rows
    j = tl.arange(0, NEXT_N_PAD)
    j_ok = j < NEXT_N
    if CTX_2D:
        lim = tl.load(ctx_ptr + b * stride_cb + j, mask=j_ok, other=0)
    else:
        L = tl.load(ctx_ptr + b * stride_cb)
        lim = L - NEXT_N + j + 1
    lim = tl.where(j_ok, lim, 0)
    lim = tl.minimum(tl.maximum(lim, 0), max_context_len)
    lmax = tl.max(lim, axis=0)

    s_lo = pid_s * SPAN
    s_hi = tl.minimum(max_context_len, s_lo + SPAN)
    c_hi = tl.maximum(tl.minimum(s_hi, lmax), s_lo)
    c_end = tl.cdiv(c_hi, BLOCK_N) * BLOCK_N

    rows64 = (b * NEXT_N + j).to(tl.int64)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)

    if CLEAN:
        ninf = tl.full((BLOCK_N, NEXT_N_PAD), float("-inf"), tl.float32)
        for s0 in range(c_end, s_hi, BLOCK_N):
            s = s0 + offs_n
            tl.store(out_ptr + rows64[None, :] * stride_om + s[:, None], ninf,
                     mask=(s < s_hi)[:, None] & j_ok[None, :])

    offs_r = tl.arange(0, R)
    q_j = offs_r // H
    q_h = offs_r % H
    q_ok = q_j < NEXT_N
    q_off = b.to(tl.int64) * stride_qb + q_j * stride_qn + q_h * stride_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0)  # [R, D]
    w = tl.load(w_ptr + (b * NEXT_N + q_j).to(tl.int64) * stride_wm + q_h, mask=q_ok, other=0.0)
    qT = tl.trans(tl_fp8_operand(q, FP8_MODE))

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    if PREFETCH == 2:
        # Everything by hand: the keys and scales of tile t+1 (in registers) and the block-table
        # entries of tile t+2 are loaded while tile t is multiplied and reduced.
        p_a = _load_phys(bt_row, s_lo, offs_n, c_hi, max_blocks, BS, TIB)
        p_b = _load_phys(bt_row, s_lo + BLOCK_N, offs_n, c_hi, max_blocks, BS, TIB)
        k_a = _load_k(kv_ptr, p_a, s_lo, offs_n, c_hi, num_blocks, BS, D, BLOCK_BYTES, TIB)
        sc_a = _load_scale(kv_scale_ptr, p_a, s_lo, offs_n, c_hi, num_blocks, BS, D, BLOCK_BYTES, TIB)
        for s0 in range(s_lo, c_hi, BLOCK_N):
            k = k_a
            k_scale = sc_a
            k_a = _load_k(kv_ptr, p_b, s0 + BLOCK_N, offs_n, c_hi, num_blocks, BS, D, BLOCK_BYTES, TIB)
            sc_a = _load_scale(kv_scale_ptr, p_b, s0 + BLOCK_N, offs_n, c_hi, num_blocks, BS, D, BLOCK_BYTES, TIB)
            p_b = _load_phys(bt_row, s0 + 2 * BLOCK_N, offs_n, c_hi, max_blocks, BS, TIB)
            _tile_out(k, qT, w, k_scale, s0 + offs_n, lim, rows64, j_ok, s_hi, out_ptr, stride_om, BLOCK_N,
                      NEXT_N_PAD, H, CLEAN, FP8_MODE)
    elif PREFETCH == 3:
        # Tiles inside one block only (TIB): the block-table entries of the whole span are loaded once,
        # before the loop, so no load feeds a key address (each tile picks its entry from registers) and
        # Triton's pipeliner keeps num_stages - 1 key tiles in flight; the scales (no dot) by hand, one
        # tile ahead.
        blk_lo = s_lo // BS  # the span may start inside a block (then NT covers one more entry)
        offs_t = tl.arange(0, NT)
        blk_t = blk_lo + offs_t
        tab = tl.load(bt_row + blk_t, mask=(blk_t * BS < c_hi) & (blk_t < max_blocks), other=-1)
        zero_n = tl.zeros_like(offs_n)
        sc_a = _load_scale(kv_scale_ptr, _pick(tab, offs_t, 0) + zero_n, s_lo, offs_n, c_hi, num_blocks, BS, D,
                           BLOCK_BYTES, TIB)
        for s0 in range(s_lo, c_hi, BLOCK_N):
            k = _load_k(kv_ptr, _pick(tab, offs_t, s0 // BS - blk_lo) + zero_n, s0, offs_n, c_hi, num_blocks, BS, D,
                        BLOCK_BYTES, TIB)
            sc_b = _load_scale(kv_scale_ptr, _pick(tab, offs_t, (s0 + BLOCK_N) // BS - blk_lo) + zero_n,
                               s0 + BLOCK_N, offs_n, c_hi, num_blocks, BS, D, BLOCK_BYTES, TIB)
            _tile_out(k, qT, w, sc_a, s0 + offs_n, lim, rows64, j_ok, s_hi, out_ptr, stride_om, BLOCK_N,
                      NEXT_N_PAD, H, CLEAN, FP8_MODE)
            sc_a = sc_b
    else:
        for s0 in range(s_lo, c_hi, BLOCK_N):
            phys = _load_phys(bt_row, s0, offs_n, c_hi, max_blocks, BS, TIB)
            k = _load_k(kv_ptr, phys, s0, offs_n, c_hi, num_blocks, BS, D, BLOCK_BYTES, TIB)
            k_scale = _load_scale(kv_scale_ptr, phys, s0, offs_n, c_hi, num_blocks, BS, D, BLOCK_BYTES, TIB)
            _tile_out(k, qT, w, k_scale, s0 + offs_n, lim, rows64, j_ok, s_hi, out_ptr, stride_om, BLOCK_N,
                      NEXT_N_PAD, H, CLEAN, FP8_MODE)


@triton.jit
def _pick(tab, offs_t, t):
    """Entry ``t`` of the register tensor ``tab`` (0 when ``t`` is outside it)."""
    return tl.sum(tl.where(offs_t == t, tab, 0), axis=0)


@triton.jit
def _tile_out(k, qT, w, k_scale, s, lim, rows64, j_ok, s_hi, out_ptr, stride_om, BLOCK_N: tl.constexpr,
              NEXT_N_PAD: tl.constexpr, H: tl.constexpr, CLEAN: tl.constexpr, FP8_MODE: tl.constexpr):
    """Logits of one key tile ``k`` [BLOCK_N, D] (fp8, or its bytes: ``FP8_MODE``) against ``qT`` [D, NEXT_N_PAD*H]:
    the product, relu, head weights, the sum over each row's heads, the key scales; -inf past each row's limit
    (``CLEAN``); stored for keys < ``s_hi``."""
    sc = tl.maximum(tl.dot(tl_fp8_operand(k, FP8_MODE), qT), 0.0) * w[None, :]
    logits = tl.sum(tl.reshape(sc, (BLOCK_N, NEXT_N_PAD, H)), axis=2) * k_scale[:, None]
    if CLEAN:
        logits = tl.where(s[:, None] < lim[None, :], logits, float("-inf"))
    tl.store(out_ptr + rows64[None, :] * stride_om + s[:, None], logits, mask=(s < s_hi)[:, None] & j_ok[None, :])


@triton.jit
def _load_phys(bt_row, s0, offs_n, c_hi, max_blocks, BS: tl.constexpr, TIB: tl.constexpr):
    """Physical block of the keys ``s0 + offs_n`` (-1 for keys ``>= c_hi``: never read). With ``TIB``
    (the tile lies inside one block: BLOCK_N divides the block size) one table entry is loaded for the
    whole tile and broadcast, so the compiler sees one base address per tile."""
    if TIB:
        blk0 = s0 // BS
        phys = tl.load(bt_row + blk0, mask=(s0 < c_hi) & (blk0 < max_blocks), other=-1) + tl.zeros_like(offs_n)
    else:
        s = s0 + offs_n
        blk = s // BS
        phys = tl.load(bt_row + blk, mask=(s < c_hi) & (blk < max_blocks), other=-1)
    return phys


@triton.jit
def _key_ok(phys, s, c_hi, num_blocks, TIB: tl.constexpr):
    """Keys to read: block inside the cache and, with ``TIB``, position before ``c_hi`` (without it,
    :func:`_load_phys` already gave -1 to those)."""
    ok = (phys >= 0) & (phys < num_blocks)
    if TIB:
        ok = ok & (s < c_hi)
    return ok


@triton.jit
def _load_k(kv_ptr, phys, s0, offs_n, c_hi, num_blocks, BS: tl.constexpr, D: tl.constexpr,
            BLOCK_BYTES: tl.constexpr, TIB: tl.constexpr):
    """fp8 values [BLOCK_N, D] of the keys ``s0 + offs_n`` (0 where the key is past ``c_hi`` or its block
    outside ``[0, num_blocks)``: nothing outside the cache or the context is read)."""
    s = s0 + offs_n
    ok = _key_ok(phys, s, c_hi, num_blocks, TIB)
    offs_d = tl.arange(0, D)
    ptr = kv_ptr + (phys.to(tl.int64) * BLOCK_BYTES + (s % BS) * D)[:, None] + offs_d[None, :]
    return tl.load(ptr, mask=ok[:, None], other=0.0)


@triton.jit
def _load_scale(kv_scale_ptr, phys, s0, offs_n, c_hi, num_blocks, BS: tl.constexpr, D: tl.constexpr,
                BLOCK_BYTES: tl.constexpr, TIB: tl.constexpr):
    """fp32 scales [BLOCK_N] of the keys ``s0 + offs_n`` (0 where the key is not read)."""
    s = s0 + offs_n
    ok = _key_ok(phys, s, c_hi, num_blocks, TIB)
    return tl.load(kv_scale_ptr + phys.to(tl.int64) * (BLOCK_BYTES // 4) + (BS * D // 4) + (s % BS), mask=ok, other=0.0)


# Decode configurations (same keys as above, plus PREFETCH: 0 = Triton's pipeliner for everything
# it can (the scales, feeding no dot, stay synchronous); 2 = keys, scales and table entries all by
# hand, one tile ahead, in registers; 3 = (tiles inside one block, else 0) the span's table entries
# loaded before the loop, keys through the pipeliner num_stages - 1 deep, scales by hand (1, the
# scales by hand with indirect key addresses, was dropped after 3 replaced it); and MAXNREG, a per-thread register cap (None: the compiler's choice), applied only
# where the dot's accumulator takes at most half of it). Chosen by `bench_mqa_logits.py --sweep`
# on an H200 (2026-12-01, B=64, contexts 32K-128K; BENCHMARKS.md has the rows):
#   block size a multiple of 64: PREFETCH 3, span 1024: next_n 1 0.202 ms (3271 GB/s), next_n 2
#   0.313 ms (2112 GB/s); register caps and deeper pipelines were within run-to-run noise;
#   block size 16 (the same configuration falls back to PREFETCH 0): 0.245 / 0.363 ms;
#   block size 1: everything by hand (its 132-byte keys are only 4-byte aligned, so the pipeliner's
#   copies are 4-byte cp.async): next_n 1 0.315 ms, next_n 2 (MAXNREG 168) 0.43-0.52 ms. A shuffled block table
#   makes those reads random, and random 132-byte keys (each spans two 128-byte lines and three of DRAM's 64-byte
#   units: Nsight counts 963 MB read for 661 MB of keys) read at most about 2.6 TB/s on the H200, against 4.0 TB/s
#   for 128-byte rows (`benchmarks/gather_ceiling.py sizes`, nineteenth session).
PAGED_CONFIGS = {
    "default": dict(BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=3, PREFETCH=3, MAXNREG=None),
    "bs1": dict(BLOCK_N=64, SPAN=1024, num_warps=4, num_stages=1, PREFETCH=2, MAXNREG=None),
    "bs1_next_n2+": dict(BLOCK_N=64, SPAN=2048, num_warps=4, num_stages=1, PREFETCH=2, MAXNREG=168),
}
PAGED_INTERPRET_TILES = dict(BLOCK_N=16, SPAN=32, num_stages=1)  # the CPU interpreter: same paths, small tiles
MAXNREG_TARGET = ("cuda", 90)  # MAXNREG applies on this target only (:func:`dsa.backend.gpu_target`)


def _paged_config(block_size: int, next_n: int, override: dict | None):
    if block_size == 1:
        key = "bs1" if next_n == 1 else "bs1_next_n2+"
    else:
        key = "default"
    cfg = dict(PAGED_CONFIGS[key])
    if interpreter_on():
        cfg.update(PAGED_INTERPRET_TILES)
    if override:
        cfg.update(override)
    cfg["SPAN"] = max(cfg["BLOCK_N"], cfg["SPAN"] // cfg["BLOCK_N"] * cfg["BLOCK_N"])
    return cfg


def fp8_paged_mqa_logits_triton(q, cache_blocks, weights, context_lens, block_table, max_context_len,
                                clean_logits, out, config=None):
    """Launch the decode kernel; arguments already validated.

    ``cache_blocks`` is the canonical ``[num_blocks, block_size*132]`` uint8 view;
    ``out`` is ``[B*next_n, max_context_len]`` f32. On Hopper, calls that
    :func:`dsa.mqa_logits.kernel_sm90.supported` accepts run that kernel. ``config`` (tests and
    benchmarks): keys of :data:`PAGED_CONFIGS` (``BLOCK_N``, ``PREFETCH``, ...) or ``gluon=False`` keep
    this Triton kernel; ``gluon=dict(SPAN=..., STAGES=...)`` takes the Hopper kernel wherever it is
    supported, with that launch; with no config it is taken wherever it is supported.
    """
    B, next_n, H, D = q.shape
    if B == 0 or max_context_len == 0:
        return out
    config = dict(config or {})
    gluon = config.pop("gluon", None)
    if gluon is None and config:
        gluon = False  # Triton launch keys given: they are for this kernel
    if gluon is not False and kernel_sm90 is not None and kernel_sm90.supported(q, cache_blocks):
        return kernel_sm90.launch(q, cache_blocks, weights, context_lens, block_table, max_context_len, clean_logits,
                                  out, config=gluon if isinstance(gluon, dict) else None)
    num_blocks, row = cache_blocks.shape
    bs = row // INDEXER_ROW_BYTES
    cfg = _paged_config(bs, next_n, config)
    num_warps, num_stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    maxnreg = cfg.pop("MAXNREG", None)
    acc_regs = cfg["BLOCK_N"] * next_power_of_2(next_n) * H // (32 * num_warps)  # the dot's fp32 result
    # a cap that would squeeze the accumulator (next_n 4) is not applied; nor is one on GPUs other than the one it
    # was measured on, the H200 (NVIDIA only): on sm_80-120 the 168-register cap spills 72-192 bytes per thread
    if maxnreg is not None and acc_regs <= maxnreg // 2 and gpu_target(q.device) == MAXNREG_TARGET:
        cfg.update(nvidia_options(q.device, maxnreg=maxnreg))
    cfg["PREFETCH"] = int(cfg.get("PREFETCH", 0))
    if cfg["PREFETCH"] not in (0, 2, 3):
        raise ValueError(f"paged logits config: PREFETCH must be 0, 2 or 3, got {cfg['PREFETCH']}")
    if cfg["PREFETCH"] == 3 and bs % cfg["BLOCK_N"]:
        cfg["PREFETCH"] = 0  # the span's table up front needs tiles inside one block
    # table entries one span meets (PREFETCH 3): one more when spans do not start on block boundaries
    cfg["NT"] = next_power_of_2(cdiv(cfg["SPAN"], bs) + (1 if cfg["SPAN"] % bs else 0))
    mode = fp8_mode(q.device)
    kv = cache_blocks if mode else cache_blocks.view(torch.float8_e4m3fn)  # without e4m3fn in Triton: the bytes
    q = q.view(torch.uint8) if mode else q
    kv_scale = cache_blocks.view(torch.float32)  # byte offset o -> element o // 4
    grid = (cdiv(max_context_len, cfg["SPAN"]), B)
    _paged_mqa_logits_kernel[grid](
        q, kv, kv_scale, weights, context_lens, block_table, out,
        num_blocks, block_table.shape[1], max_context_len,
        q.stride(0), q.stride(1), q.stride(2), weights.stride(0), context_lens.stride(0), block_table.stride(0),
        out.stride(0),
        NEXT_N=next_n, NEXT_N_PAD=next_power_of_2(next_n), CTX_2D=context_lens.dim() == 2,
        H=H, D=D, BS=bs, CLEAN=bool(clean_logits), FP8_MODE=mode, num_warps=num_warps, num_stages=num_stages, **cfg,
    )
    return out

