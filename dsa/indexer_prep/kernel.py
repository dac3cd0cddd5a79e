"""Triton kernels for the lightning indexer's query/key preparation.

Both kernels work on tiles of rows of 128 values (a (token, head) of q, a token
of k) and follow the reference's order exactly (see ``reference.py``):
RoPE in fp32 on the first 64 dims -> optional Hadamard -> (q) per-row fp8
quantisation with the scale folded into the head weights, (k) bf16.

* RoPE: each row is loaded twice, once as is and once permuted to its rotation
  partner (``d ^ 1`` interleaved, ``d ± 32`` rotate-half; the second load reads
  the same cache lines), so no in-register shuffles are needed. Launched with
  ``enable_fp_fusion=False`` so ``a*cos - b*sin`` is rounded like the reference
  (no FMA contraction): the rope is bit-exact.
* Hadamard: ``tl.dot(bf16(rows), H)`` with the 128x128 Sylvester ±1 matrix
  built in registers from ``parity(i & j)``. It is built once per program: with
  Hadamard the programs are persistent (a grid of a few per SM looping over work
  items), so the construction is amortised over many tiles; without it the grid
  is one program per item.
* Quantisation: ``amax`` per row, ``scale = max(amax, 1e-4) / 448`` with an IEEE
  division (``div_rn``; Triton's default fp32 ``/`` is approximate on NVIDIA),
  rounded up to a power of two on the bits for ue8m0 (then ``1/scale`` is formed
  on the bits and ``y * (1/scale)`` equals ``y / scale`` exactly; otherwise
  ``div_rn``), saturating cast to e4m3fn.

q kernel: one work item = (token, group of BLOCK_H heads). k kernel: one work
item = BLOCK_T tokens. In place on k is safe: a row is read completely before
it is written, and rows never cross programs.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._host import cdiv
from ..backend import fp8_mode, interpreter_on, num_sms
from ..constants import FP8_AMAX_EPS, FP8_MAX, INDEXER_ROPE_DIM
from ..fp8 import tl_quant_fp8_rows
from .reference import HADAMARD_SCALE, HEAD_SCALE, SOFTMAX_SCALE


@triton.jit
def _rope_columns(D: tl.constexpr, ROPE_DIM: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Per column d: its rotation partner, its cos/sin index, whether it takes -b*sin, whether it rotates."""
    d = tl.arange(0, D)
    HALF: tl.constexpr = ROPE_DIM // 2
    is_rope = d < ROPE_DIM
    if INTERLEAVED:
        partner = d ^ 1
        pair = d // 2
        neg = (d % 2) == 0
    else:
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        pair = d % HALF
        neg = d < HALF
    partner = tl.where(is_rope, partner, d)
    pair = tl.where(is_rope, pair, 0)
    return d, partner, pair, neg, is_rope


@triton.jit
def _rope(x, xp, c, s, neg, is_rope):
    """a' = a*cos - b*sin, b' = b*cos + a*sin (x the value, xp its partner); identity past the rope dims."""
    xc = x * c
    ps = xp * s
    # not xc + where(neg, -ps, ps): Triton's unary minus is 0 - v, which loses the sign of zero
    r = tl.where(neg, xc - ps, xc + ps)
    return tl.where(is_rope, r, x)


@triton.jit
def _sylvester(D: tl.constexpr):
    """The D x D Sylvester Hadamard matrix (±1, bf16): H[i, j] = (-1)^popcount(i & j), D <= 256."""
    i = tl.arange(0, D)[:, None]
    j = tl.arange(0, D)[None, :]
    p = i & j
    p = p ^ (p >> 4)
    p = p ^ (p >> 2)
    p = p ^ (p >> 1)
    return (1.0 - 2.0 * (p & 1).to(tl.float32)).to(tl.bfloat16)  # via fp32: the interpreter's int->bf16 cast is wrong


@triton.jit(do_not_specialize=["n_items"])
def _prep_q_kernel(
    q_ptr, cos_ptr, sin_ptr, w_ptr,
    qo_ptr, wo_ptr, so_ptr,
    n_items,
    s_qt, s_qh, s_ct, s_st, s_wt, s_wh,
    s_ot, s_oh, s_wot, s_sot,
    softmax_scale, head_scale, hadamard_scale,
    H: tl.constexpr, D: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
    INTERLEAVED: tl.constexpr, HADAMARD: tl.constexpr, UE8M0: tl.constexpr, WRITE_SCALE: tl.constexpr,
    FP8_MAX_C: tl.constexpr, AMAX_EPS: tl.constexpr, FP8_MODE: tl.constexpr,
):
    d, partner, pair, neg, is_rope = _rope_columns(D, ROPE_DIM, INTERLEAVED)
    if HADAMARD:
        hm = _sylvester(D)
    GROUPS: tl.constexpr = H // BLOCK_H
    hh = tl.arange(0, BLOCK_H)
    item = tl.program_id(0)
    nprog = tl.num_programs(0)
    while item < n_items:
        t = (item // GROUPS).to(tl.int64)
        h = (item % GROUPS) * BLOCK_H + hh  # [BLOCK_H]
        row = q_ptr + t * s_qt + h[:, None].to(tl.int64) * s_qh
        x = tl.load(row + d[None, :]).to(tl.float32)
        xp = tl.load(row + partner[None, :]).to(tl.float32)
        c = tl.load(cos_ptr + t * s_ct + pair, mask=is_rope, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t * s_st + pair, mask=is_rope, other=0.0).to(tl.float32)
        y = _rope(x, xp, c[None, :], s[None, :], neg[None, :], is_rope[None, :])
        if HADAMARD:
            y = tl.dot(y.to(tl.bfloat16), hm, out_dtype=tl.float32) * hadamard_scale
        q8, scale = tl_quant_fp8_rows(y, UE8M0, FP8_MAX_C, AMAX_EPS, FP8_MODE)  # one scale per head row
        tl.store(qo_ptr + t * s_ot + h[:, None].to(tl.int64) * s_oh + d[None, :], q8)  # the bytes (uint8 view)
        w = tl.load(w_ptr + t * s_wt + h * s_wh).to(tl.float32)
        wo = w * scale * softmax_scale * head_scale
        tl.store(wo_ptr + t * s_wot + h, wo)
        if WRITE_SCALE:
            tl.store(so_ptr + t * s_sot + h, scale)
        item += nprog


@triton.jit(do_not_specialize=["T", "n_items"])
def _prep_k_kernel(
    k_ptr, cos_ptr, sin_ptr, ko_ptr,
    T, n_items,
    s_kt, s_ct, s_st, s_ot,
    hadamard_scale,
    D: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_T: tl.constexpr,
    INTERLEAVED: tl.constexpr, HADAMARD: tl.constexpr,
):
    d, partner, pair, neg, is_rope = _rope_columns(D, ROPE_DIM, INTERLEAVED)
    if HADAMARD:
        hm = _sylvester(D)
    tt = tl.arange(0, BLOCK_T)
    item = tl.program_id(0)
    nprog = tl.num_programs(0)
    while item < n_items:
        t = item.to(tl.int64) * BLOCK_T + tt  # [BLOCK_T]
        tm = (t < T)[:, None]
        row = k_ptr + t[:, None] * s_kt
        x = tl.load(row + d[None, :], mask=tm, other=0.0).to(tl.float32)
        xp = tl.load(row + partner[None, :], mask=tm, other=0.0).to(tl.float32)
        rm = tm & is_rope[None, :]
        c = tl.load(cos_ptr + t[:, None] * s_ct + pair[None, :], mask=rm, other=1.0).to(tl.float32)
        s = tl.load(sin_ptr + t[:, None] * s_st + pair[None, :], mask=rm, other=0.0).to(tl.float32)
        y = _rope(x, xp, c, s, neg[None, :], is_rope[None, :])
        if HADAMARD:
            y = tl.dot(y.to(tl.bfloat16), hm, out_dtype=tl.float32) * hadamard_scale
        tl.store(ko_ptr + t[:, None] * s_ot + d[None, :], y.to(tl.bfloat16), mask=tm)
        item += nprog


def _num_programs(n_items: int, device: torch.device, per_sm: int) -> int:
    """Grid size: ``per_sm`` programs per SM looping over the items (0: one program per item);
    a handful under the interpreter."""
    if interpreter_on() or device.type != "cuda":
        return max(1, min(n_items, 4))
    if per_sm <= 0:
        return max(1, n_items)
    return max(1, min(n_items, num_sms(device) * per_sm))


def prepare_indexer_q_triton(q, cos, sin, weights, q_out, w_out, scale_out, *, interleaved, hadamard, scale_fmt,
                             block_h: int | None = None, num_warps: int | None = None,
                             per_sm: int | None = None) -> None:
    """Launch the q kernel. Defaults from an H200 sweep (T=8192, 2026-11-29): without Hadamard 32 heads
    per item, 2 warps, one program per item (65 us, 74% of the copy ceiling); with Hadamard a whole
    token (64 heads) per item, 4 warps, 8 persistent programs per SM, the in-register H matrix built
    once per program (112 us)."""
    T, H, D = q.shape
    if T == 0:
        return
    if interpreter_on():
        BLOCK_H = block_h or H
    else:
        BLOCK_H = block_h or min(H, 64 if hadamard else 32)
    if num_warps is None:
        num_warps = 4 if hadamard else 2
    if per_sm is None:
        per_sm = 8 if hadamard else 0
    n_items = T * (H // BLOCK_H)
    grid = (_num_programs(n_items, q.device, per_sm),)
    _prep_q_kernel[grid](
        q, cos, sin, weights,
        q_out.view(torch.uint8), w_out, scale_out if scale_out is not None else w_out,
        n_items,
        q.stride(0), q.stride(1), cos.stride(0), sin.stride(0), weights.stride(0), weights.stride(1),
        q_out.stride(0), q_out.stride(1), w_out.stride(0), scale_out.stride(0) if scale_out is not None else 0,
        SOFTMAX_SCALE, HEAD_SCALE, HADAMARD_SCALE,
        H=H, D=D, ROPE_DIM=INDEXER_ROPE_DIM, BLOCK_H=BLOCK_H,
        INTERLEAVED=bool(interleaved), HADAMARD=bool(hadamard), UE8M0=scale_fmt == "ue8m0",
        WRITE_SCALE=scale_out is not None, FP8_MAX_C=FP8_MAX, AMAX_EPS=FP8_AMAX_EPS, FP8_MODE=fp8_mode(q.device),
        num_warps=num_warps, enable_fp_fusion=False,
    )


def prepare_indexer_k_triton(k, cos, sin, k_out, *, interleaved, hadamard, block_t: int | None = None,
                             num_warps: int | None = None, per_sm: int | None = None) -> None:
    """Launch the k kernel. Defaults from an H200 sweep (T=262144, 2026-11-29): 16 tokens per item;
    without Hadamard 2 warps, one program per item; with Hadamard 4 warps, 8 persistent programs per SM."""
    T, D = k.shape
    if T == 0:
        return
    BLOCK_T = block_t or (64 if interpreter_on() else 16)
    if num_warps is None:
        num_warps = 4 if hadamard else 2
    if per_sm is None:
        per_sm = 8 if hadamard else 0
    n_items = cdiv(T, BLOCK_T)
    grid = (_num_programs(n_items, k.device, per_sm),)
    _prep_k_kernel[grid](
        k, cos, sin, k_out,
        T, n_items,
        k.stride(0), cos.stride(0), sin.stride(0), k_out.stride(0),
        HADAMARD_SCALE,
        D=D, ROPE_DIM=INDEXER_ROPE_DIM, BLOCK_T=BLOCK_T,
        INTERLEAVED=bool(interleaved), HADAMARD=bool(hadamard),
        num_warps=num_warps, enable_fp_fusion=False,
    )

