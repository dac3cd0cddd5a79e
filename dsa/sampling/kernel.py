"""Triton kernel for sampled next-token choice (semantics: :mod:`dsa.sampling.reference`).

One program per row. The reference sorts the whole vocabulary to find the top-p nucleus; the kernel never sorts.
Gumbel-max picks ``argmax(z + g)`` over the nucleus, and the nucleus is a prefix of the row in descending order of
``z``. So the kernel takes the argmax over the whole row as a candidate and asks whether it is in the nucleus (the
mass of the tokens ahead of it, under ``softmax(z)``, below ``top_p``). If it is, it is the answer: it beats every
token, the nucleus' included. If not, no token at or behind it is in the nucleus either, and the next candidate is
the argmax over the tokens ahead of it. Each candidate costs one pass over the row; the first pass also gives the
softmax's maximum and sum. With ``top_p = 1`` one pass is all.

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
def _block(xr, start, ar, V, inv_t):
    """One block of the row: (offsets, in range, ``z`` with -inf out of range, the block's largest ``z``)."""
    offs = start + ar
    msk = offs < V
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
def _sample_kernel(x_ptr, stride_row, seeds_ptr, out_ptr, V, inv_t, top_p,
                   CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    row = tl.program_id(0)
    xr = x_ptr + row.to(tl.int64) * stride_row
    seed = tl.load(seeds_ptr + row)
    s_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    s_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    ar = tl.arange(0, BLOCK)
    NEG: tl.constexpr = float("-inf")

    # pass 1: the softmax's max and sum, and the argmax of z + g over the row
    m = tl.full([], NEG, tl.float32)
    s = tl.full([], 0.0, tl.float32)
    best = tl.full([], NEG, tl.float32)
    best_i = tl.full([], 0, tl.int32)
    for start in range(0, V, BLOCK):
        offs, msk, z, bmax = _block(xr, start, ar, V, inv_t)
        if CUT:
            m_new = tl.maximum(m, bmax)
            m_ref = tl.where(m_new == NEG, 0.0, m_new)
            s = s * tl.exp(m - m_ref) + tl.sum(tl.exp(z - m_ref), 0)
            m = m_new
        best, best_i = _fold_noisy_argmax(z, msk, offs, bmax, best, best_i, s_hi, s_lo, V, U_BITS, G_MAX)

    if CUT:
        # candidate passes: accept the candidate when the mass ahead of it is below top_p, else move to the
        # argmax among the tokens ahead of it
        cand = best_i
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
        best_i = cand
    tl.store(out_ptr + row, best_i.to(tl.int64))


def sample_launch(logits, seeds, out, inv_t: float, top_p: float, block: int = 2048, num_warps: int = 8):
    """Launch :func:`_sample_kernel`: ``logits [B, V]`` (rows contiguous), ``seeds [B]`` int64, ``out [B]`` int64."""
    B, V = logits.shape
    block = min(block, triton.next_power_of_2(V))
    _sample_kernel[(B,)](logits, logits.stride(0), seeds, out, V, inv_t, top_p, CUT=top_p < 1.0, BLOCK=block,
                         U_BITS=U_BITS, G_MAX=G_MAX, num_warps=num_warps)
    return out
