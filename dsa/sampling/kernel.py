"""Triton kernel for sampled next-token choice (semantics: :mod:`dsa.sampling.reference`).

One program per row. The reference sorts the whole vocabulary to find the top-p nucleus; the kernel never sorts.
Gumbel-max picks ``argmax(z + g)`` over the nucleus, and the nucleus is a prefix of the row in descending order of
``z``. So the kernel takes the argmax over the whole row as a candidate and asks whether it is in the nucleus (the
mass of the tokens ahead of it, under ``softmax(z)``, below ``top_p``). If it is, it is the answer: it beats every
token, the nucleus' included. If not, no token at or behind it is in the nucleus either, and the next candidate is
the argmax over the tokens ahead of it. Each candidate costs one pass over the row; the first pass also gives the
softmax's maximum and sum. With ``top_p = 1`` one pass is all. A candidate falls outside the nucleus with
probability about ``1 - top_p`` (the mass outside it); each next one is a draw among the tokens ahead, so on a flat
row the candidates' ranks about halve at each step (tests/test_sampling.py counts up to 11 on 400 near-equal tokens
at top_p 1e-6).

* Pass 1: ``m = max(z)``, ``s = sum(exp(z - m))`` (online, rescaled per block), and the argmax of ``z + g``.
  Blocks whose largest ``z`` plus the largest Gumbel value (:data:`G_MAX`) cannot beat the best so far skip the
  hash and the logarithms: the result is the same.
* Candidate passes (``top_p < 1``): the mass ``a`` of the tokens ahead of the candidate (``z`` larger, or equal and
  a smaller index) and the argmax of ``z + g`` among them. Accept when ``a / s < top_p`` or nothing is ahead.

The tokens are the reference's except where the candidate's mass ahead lies within the rounding of the two sums
(the kernel's blockwise sum against the reference's cumulative sum in sorted order) of ``top_p``, or where two
tokens' ``z + g`` are within the last bit (the logarithms of the two libraries).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import U_BITS

#: a bound on the Gumbel noise: ``g = -log(-log(u))`` with ``u <= 1 - 2**-24`` is at most 16.64
G_MAX = 17.0


@triton.jit
def _mix32(x):
    """The reference's 32-bit hash rounds (``reference._mix32``) on uint32 (the products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _gumbel(offs, s_hi, s_lo, U_BITS: tl.constexpr):
    h = _mix32(_mix32(offs.to(tl.uint32) ^ s_hi) ^ s_lo)
    u = ((h >> (32 - U_BITS)).to(tl.float32) + 0.5) * (1.0 / (1 << U_BITS))
    return -tl.log(-tl.log(u))


@triton.jit
def _argmax_first(y, offs, V):
    """(max of ``y``, the smallest offset holding it)."""
    bv = tl.max(y, 0)
    return bv, tl.min(tl.where(y == bv, offs, V), 0)


@triton.jit
def _block(xr, start, ar, hi, inv_t):
    """One block of the row: (offsets, below ``hi``, ``z`` with -inf from ``hi`` on, the block's largest ``z``)."""
    offs = start + ar
    msk = offs < hi
    z = tl.load(xr + offs, mask=msk, other=float("-inf")).to(tl.float32) * inv_t
    return offs, msk, z, tl.max(z, 0)


@triton.jit
def _fold_noisy_argmax(z, keep, offs, bmax, best, best_i, s_hi, s_lo, V, U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    """(best, best_i) updated with the block's argmax of ``z + g`` over ``keep``; the hash and the logarithms are
    skipped when even ``bmax + G_MAX`` cannot beat ``best`` (the result is the same)."""
    if bmax + G_MAX >= best:
        y = tl.where(keep, z + _gumbel(offs, s_hi, s_lo, U_BITS), float("-inf"))
        bv, bi = _argmax_first(y, offs, V)
        if bv > best:
            best = bv
            best_i = bi
    return best, best_i


@triton.jit
def _row(x_ptr, stride_row, seeds_ptr, row):
    """The row's logits pointer and its seed's two 32-bit halves."""
    seed = tl.load(seeds_ptr + row)
    return (x_ptr + row.to(tl.int64) * stride_row, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32),
            (seed & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _scan(xr, lo, hi, V, inv_t, s_hi, s_lo, CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
          G_MAX: tl.constexpr):
    """Pass 1 over ``[lo, hi)``: (max ``z``, sum of ``exp(z - max)`` (online, rescaled per block; 0 unless CUT),
    the argmax of ``z + g`` and its value)."""
    NEG: tl.constexpr = float("-inf")
    ar = tl.arange(0, BLOCK)
    m = tl.full([], NEG, tl.float32)
    s = tl.full([], 0.0, tl.float32)
    best = tl.full([], NEG, tl.float32)
    best_i = lo
    for start in range(lo, hi, BLOCK):
        offs, msk, z, bmax = _block(xr, start, ar, hi, inv_t)
        if CUT:
            m_new = tl.maximum(m, bmax)
            m_ref = tl.where(m_new == NEG, 0.0, m_new)
            s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
            m = m_new
        best, best_i = _fold_noisy_argmax(z, msk, offs, bmax, best, best_i, s_hi, s_lo, V, U_BITS, G_MAX)
    return m, s, best, best_i


@triton.jit
def _walk(xr, V, inv_t, top_p, m, s, cand, s_hi, s_lo, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
          G_MAX: tl.constexpr):
    """The candidate passes: accept ``cand`` when the mass ahead of it (over ``s``, the softmax's sum at max ``m``)
    is below ``top_p`` or nothing is ahead, else move to the argmax of ``z + g`` among the tokens ahead of it."""
    NEG: tl.constexpr = float("-inf")
    ar = tl.arange(0, BLOCK)
    cz = tl.load(xr + cand).to(tl.float32) * inv_t
    go = m > NEG
    while go:
        a = tl.full([], 0.0, tl.float32)
        nb = tl.full([], NEG, tl.float32)
        ni = cand
        for start in range(0, V, BLOCK):
            offs, msk, z, bmax = _block(xr, start, ar, V, inv_t)
            if bmax >= cz:
                ahead = msk & ((z > cz) | ((z == cz) & (offs < cand)))
                a += tl.sum(tl.where(ahead, tl.exp(z - m), 0.0), 0)
                nb, ni = _fold_noisy_argmax(z, ahead, offs, bmax, nb, ni, s_hi, s_lo, V, U_BITS, G_MAX)
        go = (a / s >= top_p) & (nb > NEG)
        cand = tl.where(go, ni, cand)
        cz = tl.load(xr + cand).to(tl.float32) * inv_t
    return cand


@triton.jit
def _sample_kernel(x_ptr, stride_row, seeds_ptr, out_ptr, V, inv_t, top_p,
                   CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    """One program per row: pass 1 over the whole row, then the candidate passes."""
    row = tl.program_id(0)
    xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
    m, s, best, cand = _scan(xr, 0, V, V, inv_t, s_hi, s_lo, CUT, BLOCK, U_BITS, G_MAX)
    if CUT:
        cand = _walk(xr, V, inv_t, top_p, m, s, cand, s_hi, s_lo, BLOCK, U_BITS, G_MAX)
    tl.store(out_ptr + row, cand.to(tl.int64))


@triton.jit
def _partials_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, V, inv_t, S,
                     CHUNK: tl.constexpr, CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
                     G_MAX: tl.constexpr):
    """Pass 1 split: program (row, c) scans ``[c * CHUNK, (c + 1) * CHUNK)`` into ``part_f [B, 3, S]`` (max, sum,
    best value) and ``part_i [B, S]`` (best index)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
    lo = c * CHUNK
    m, s, best, best_i = _scan(xr, lo, tl.minimum(lo + CHUNK, V), V, inv_t, s_hi, s_lo, CUT, BLOCK, U_BITS, G_MAX)
    pf = part_f + row.to(tl.int64) * 3 * S + c
    tl.store(pf, m)
    tl.store(pf + S, s)
    tl.store(pf + 2 * S, best)
    tl.store(part_i + row.to(tl.int64) * S + c, best_i)


@triton.jit
def _finish_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, out_ptr, V, inv_t, top_p, S,
                   S_P2: tl.constexpr, CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
                   G_MAX: tl.constexpr):
    """One program per row: the chunks' partials combined in a fixed order (max, rescaled sum, first argmax),
    then the candidate passes."""
    NEG: tl.constexpr = float("-inf")
    row = tl.program_id(0)
    xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
    k = tl.arange(0, S_P2)
    ok = k < S
    pf = part_f + row.to(tl.int64) * 3 * S + k
    bv = tl.load(pf + 2 * S, mask=ok, other=NEG)
    bi = tl.load(part_i + row.to(tl.int64) * S + k, mask=ok, other=V)
    best = tl.max(bv, 0)
    cand = tl.min(tl.where(bv == best, bi, V), 0)
    if CUT:
        mc = tl.load(pf, mask=ok, other=NEG)
        m = tl.max(mc, 0)
        m_ref = tl.where(m == NEG, 0.0, m)
        s = tl.sum(tl.load(pf + S, mask=ok, other=0.0) * tl.exp(mc - m_ref), 0)
        cand = _walk(xr, V, inv_t, top_p, m, s, cand, s_hi, s_lo, BLOCK, U_BITS, G_MAX)
    tl.store(out_ptr + row, cand.to(tl.int64))


#: the split pass 1's chunk of the vocabulary (a fixed number, so that a row's sums, and so its token, never depend
#: on the batch around it)
CHUNK = 8192


def split_pass(B: int, V: int) -> bool:
    """Whether pass 1 runs in chunks of :data:`CHUNK` (:func:`sample_launch`)."""
    return False


def sample_launch(logits, seeds, out, inv_t: float, top_p: float, block: int = 2048, num_warps: int = 8,
                  split: bool | None = None):
    """Launch the kernels: ``logits [B, V]`` (rows contiguous), ``seeds [B]`` int64, ``out [B]`` int64. ``split``
    (default :func:`split_pass`): pass 1 in chunks of :data:`CHUNK` (one program each), then one program per row."""
    B, V = logits.shape
    split = split_pass(B, V) if split is None else split
    block = min(block, triton.next_power_of_2(V))
    cut = top_p < 1.0
    if not split:
        _sample_kernel[(B,)](logits, logits.stride(0), seeds, out, V, inv_t, top_p, CUT=cut, BLOCK=block,
                             U_BITS=U_BITS, G_MAX=G_MAX, num_warps=num_warps)
        return out
    S = triton.cdiv(V, CHUNK)
    part_f = torch.empty(B, 3, S, dtype=torch.float32, device=logits.device)
    part_i = torch.empty(B, S, dtype=torch.int32, device=logits.device)
    _partials_kernel[(B, S)](logits, logits.stride(0), seeds, part_f, part_i, V, inv_t, S, CHUNK=CHUNK, CUT=cut,
                             BLOCK=min(block, CHUNK), U_BITS=U_BITS, G_MAX=G_MAX, num_warps=num_warps)
    _finish_kernel[(B,)](logits, logits.stride(0), seeds, part_f, part_i, out, V, inv_t, top_p, S,
                         S_P2=triton.next_power_of_2(S), CUT=cut, BLOCK=block, U_BITS=U_BITS, G_MAX=G_MAX,
                         num_warps=num_warps)
    return out
