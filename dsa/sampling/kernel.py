"""Triton kernels for sampled next-token choice (semantics: :mod:`dsa.sampling.reference`).

The reference sorts the whole vocabulary to find the top-p nucleus; the kernels never sort. Gumbel-max picks
``argmax(z + g)`` over the nucleus, and the nucleus is a prefix of the row in descending order of ``z``. So the
kernels take the argmax over the whole row as a candidate and ask whether it is in the nucleus (the mass of the
tokens ahead of it, under ``softmax(z)``, below ``top_p``). If it is, it is the answer: it beats every token, the
nucleus' included. If not, no token at or behind it is in the nucleus either, and the next candidate is the argmax
over the tokens ahead of it. A candidate falls outside the nucleus with probability about ``1 - top_p`` (the mass
outside it); each next one is a draw among the tokens ahead, so on a flat row the candidates' ranks about halve at
each step (tests/test_sampling.py counts up to 11 on 400 near-equal tokens at top_p 1e-6).

* Pass 1 (``_partials_kernel``, one program per chunk of :data:`CHUNK` tokens of a row): the chunk's ``max(z)``,
  ``sum(exp(z - max))`` (online, rescaled per block; top-p only) and argmax of ``z + g``. Blocks whose largest
  ``z`` plus the largest Gumbel value (:data:`G_MAX`) cannot beat the best so far skip the hash and the logarithms.
* The first candidate (``_check_kernel``, top-p only, one program per chunk): the chunks' partials combined in a
  fixed order into ``m``, ``s`` and the candidate; the chunk's mass ahead of it (``z`` larger, or equal and a
  smaller index) and its argmax of ``z + g`` ahead of it; and the list of the chunk's tokens ahead of it.
* ``_finish_kernel``, one program per row: the same combination; accept when ``a / s < top_p`` (``a`` the chunks'
  masses ahead, summed in order) or nothing is ahead; else walk the later candidates (``_walk``: a pass for each
  one's mass ahead, and one for the argmax ahead of it only if it is rejected too). Every later candidate's tokens
  ahead are among the first's, so these passes read only the listed tokens: as many as the first candidate's rank,
  not the vocabulary.

The chunks are a fixed size, so a row's sums, and so its token, never depend on the batch around it. The tokens are
the reference's except where the candidate's mass ahead lies within the rounding of the two sums (the kernels'
chunked sums against the reference's cumulative sum in sorted order) of ``top_p``, or where two tokens' ``z + g``
are within the last bit (the logarithms of the two libraries).
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
def _ahead(z, offs, cz, cand):
    """Which tokens are ahead of the candidate (index ``cand``, scaled logit ``cz``) in the nucleus' order."""
    return (z > cz) | ((z == cz) & (offs < cand))


@triton.jit
def _listed(xr, lst_row, cnt_v, ends, p, total, inv_t, CHUNK: tl.constexpr):
    """Tokens ``p`` of the row's list (those ahead of the first candidate, chunk after chunk; ``cnt_v`` the chunks'
    counts, ``ends`` their running sums): (listed, their indices, their ``z``)."""
    ok = p < total
    before = ends[None, :] <= p[:, None]  # the chunks wholly before each position
    c = tl.sum(before.to(tl.int32), 1)
    local = p - tl.sum(tl.where(before, cnt_v[None, :], 0), 1)
    idx = tl.load(lst_row + c.to(tl.int64) * CHUNK + local, mask=ok, other=0)
    return ok, idx, tl.load(xr + idx, mask=ok, other=float("-inf")).to(tl.float32) * inv_t


@triton.jit
def _walk(xr, lst_row, cnt_v, V, inv_t, top_p, m, s, cand, a, nb, ni, s_hi, s_lo, CHUNK: tl.constexpr,
          WALK_BLOCK: tl.constexpr, U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    """The candidates after the first (one program), over the tokens ahead of the first only (``lst_row``, chunk by
    chunk, ``cnt_v`` tokens each; every later candidate's tokens ahead are among them). ``a`` is the mass ahead of
    ``cand`` (over ``s``, the softmax's sum at max ``m``), ``(nb, ni)`` the argmax of ``z + g`` ahead of it. While
    the candidate is rejected (``a / s >= top_p``) and a token is ahead, move to that token: a pass for its mass
    ahead, and one for the argmax ahead of it only when it is rejected too."""
    NEG: tl.constexpr = float("-inf")
    ar = tl.arange(0, WALK_BLOCK)
    ends = tl.cumsum(cnt_v, 0)
    total = tl.sum(cnt_v, 0)
    go = (m > NEG) & (a / s >= top_p) & (nb > NEG)
    while go:
        cand = ni
        cz = tl.load(xr + cand).to(tl.float32) * inv_t
        acc = tl.zeros([WALK_BLOCK], tl.float32)
        for p0 in range(0, total, WALK_BLOCK):
            ok, idx, z = _listed(xr, lst_row, cnt_v, ends, p0 + ar, total, inv_t, CHUNK)
            acc += tl.where(ok & _ahead(z, idx, cz, cand), tl.exp(z - m), 0.0)
        go = tl.sum(acc, 0) / s >= top_p
        nb = tl.full([], NEG, tl.float32)
        if go:
            for p0 in range(0, total, WALK_BLOCK):
                ok, idx, z = _listed(xr, lst_row, cnt_v, ends, p0 + ar, total, inv_t, CHUNK)
                nb, ni = _fold_noisy_argmax(z, ok & _ahead(z, idx, cz, cand), idx, tl.max(z, 0), nb, ni, s_hi, s_lo,
                                            V, U_BITS, G_MAX)
        go = go & (nb > NEG)
    return cand


@triton.jit
def _combine(part_f, part_i, row, S, V, S_P2: tl.constexpr, CUT: tl.constexpr):
    """The chunks' pass-1 partials of a row combined in a fixed order: (max ``z``, the softmax's sum at that max,
    the first argmax of ``z + g``)."""
    NEG: tl.constexpr = float("-inf")
    k = tl.arange(0, S_P2)
    ok = k < S
    pf = part_f + row.to(tl.int64) * 3 * S + k
    bv = tl.load(pf + 2 * S, mask=ok, other=NEG)
    bi = tl.load(part_i + row.to(tl.int64) * S + k, mask=ok, other=V)
    cand = tl.min(tl.where(bv == tl.max(bv, 0), bi, V), 0)
    m = tl.full([], NEG, tl.float32)
    s = tl.full([], 0.0, tl.float32)
    if CUT:
        mc = tl.load(pf, mask=ok, other=NEG)
        m = tl.max(mc, 0)
        m_ref = tl.where(m == NEG, 0.0, m)
        s = tl.sum(tl.load(pf + S, mask=ok, other=0.0) * tl.exp(mc - m_ref), 0)
    return m, s, cand


@triton.jit
def _partials_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, V, inv_t, S,
                     CHUNK: tl.constexpr, CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
                     G_MAX: tl.constexpr):
    """Pass 1, program (row, c) over ``[c * CHUNK, (c + 1) * CHUNK)``: ``part_f [B, 3, S]`` (max, sum, best value)
    and ``part_i [B, S]`` (best index)."""
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
def _check_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, chk_f, chk_i, lst, cnt, V, inv_t, S,
                  S_P2: tl.constexpr, CHUNK: tl.constexpr, U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    """The first candidate's pass (top-p), program (row, c) over its chunk: the mass ahead of the candidate and the
    argmax of ``z + g`` ahead of it, into ``chk_f [B, 2, S]`` (mass, best value) and ``chk_i [B, S]``; the indices
    of the tokens ahead of it, in order, into ``lst [B, S, CHUNK]`` and their count into ``cnt [B, S]``."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
    m, s, cand = _combine(part_f, part_i, row, S, V, S_P2, True)
    cz = tl.load(xr + cand).to(tl.float32) * inv_t
    lo = c * CHUNK
    offs, msk, z, bmax = _block(xr, lo, tl.arange(0, CHUNK), tl.minimum(lo + CHUNK, V), inv_t)
    ahead = msk & _ahead(z, offs, cz, cand)
    nb, ni = _fold_noisy_argmax(z, ahead, offs, bmax, tl.full([], float("-inf"), tl.float32), cand, s_hi, s_lo, V,
                                U_BITS, G_MAX)
    cf = chk_f + row.to(tl.int64) * 2 * S + c
    tl.store(cf, tl.sum(tl.where(ahead, tl.exp(z - m), 0.0), 0))
    tl.store(cf + S, nb)
    tl.store(chk_i + row.to(tl.int64) * S + c, ni)
    n = ahead.to(tl.int32)
    rc = row.to(tl.int64) * S + c
    tl.store(lst + rc * CHUNK + tl.cumsum(n, 0) - 1, offs, mask=ahead)
    tl.store(cnt + rc, tl.sum(n, 0))


@triton.jit
def _finish_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, chk_f, chk_i, lst, cnt, out_ptr, V, inv_t, top_p, S,
                   S_P2: tl.constexpr, CUT: tl.constexpr, CHUNK: tl.constexpr, WALK_BLOCK: tl.constexpr,
                   U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    """One program per row: the pass-1 partials combined; with top-p, the first candidate's chunk results combined
    (the mass ahead summed in chunk order, the first argmax ahead), then the later candidates over the listed
    tokens."""
    row = tl.program_id(0)
    m, s, cand = _combine(part_f, part_i, row, S, V, S_P2, CUT)
    if CUT:
        xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
        k = tl.arange(0, S_P2)
        ok = k < S
        cf = chk_f + row.to(tl.int64) * 2 * S + k
        a = tl.sum(tl.load(cf, mask=ok, other=0.0), 0)
        nbs = tl.load(cf + S, mask=ok, other=float("-inf"))
        nb = tl.max(nbs, 0)
        ni = tl.min(tl.where(nbs == nb, tl.load(chk_i + row.to(tl.int64) * S + k, mask=ok, other=V), V), 0)
        rs = row.to(tl.int64) * S
        cnt_v = tl.load(cnt + rs + k, mask=ok, other=0)
        cand = _walk(xr, lst + rs * CHUNK, cnt_v, V, inv_t, top_p, m, s, cand, a, nb, ni, s_hi, s_lo, CHUNK,
                     WALK_BLOCK, U_BITS, G_MAX)
    tl.store(out_ptr + row, cand.to(tl.int64))


#: the chunk of the vocabulary that pass 1 and the first candidate's pass give one program each (one block of that
#: many lanes; fewer for a smaller vocabulary). Fixed, so that a row's sums, and so its token, never depend on the
#: batch around it. Chunk, warps: H100 sweep (BENCHMARKS.md, sixty-first session).
CHUNK = 4096
CHUNK_WARPS = 8
#: the later candidates' passes over the listed tokens: lanes per step, warps
WALK_BLOCK, WALK_WARPS = 1024, 8


def sample_launch(logits, seeds, out, inv_t: float, top_p: float):
    """Launch the kernels: ``logits [B, V]`` (rows contiguous), ``seeds [B]`` int64, ``out [B]`` int64: pass 1 in
    chunks; with top-p, the first candidate's pass in chunks (listing the tokens ahead of it); then one program per
    row."""
    B, V = logits.shape
    ch = min(CHUNK, triton.next_power_of_2(V))
    S = triton.cdiv(V, ch)
    cut = top_p < 1.0
    dev = logits.device
    part_f = torch.empty(B, 3, S, dtype=torch.float32, device=dev)
    part_i = torch.empty(B, S, dtype=torch.int32, device=dev)
    if cut:
        chk_f = torch.empty(B, 2, S, dtype=torch.float32, device=dev)
        chk_i = torch.empty(B, S, dtype=torch.int32, device=dev)
        lst = torch.empty(B, S, ch, dtype=torch.int32, device=dev)
        cnt = torch.empty(B, S, dtype=torch.int32, device=dev)
    else:
        chk_f, chk_i, lst, cnt = part_f, part_i, part_i, part_i  # (not read)
    common = dict(S_P2=triton.next_power_of_2(S), CHUNK=ch, U_BITS=U_BITS, G_MAX=G_MAX)
    _partials_kernel[(B, S)](logits, logits.stride(0), seeds, part_f, part_i, V, inv_t, S, CUT=cut, BLOCK=ch,
                             num_warps=CHUNK_WARPS, CHUNK=ch, U_BITS=U_BITS, G_MAX=G_MAX)
    if cut:
        _check_kernel[(B, S)](logits, logits.stride(0), seeds, part_f, part_i, chk_f, chk_i, lst, cnt, V, inv_t, S,
                              num_warps=CHUNK_WARPS, **common)
    _finish_kernel[(B,)](logits, logits.stride(0), seeds, part_f, part_i, chk_f, chk_i, lst, cnt, out, V, inv_t, top_p,
                         S, CUT=cut, WALK_BLOCK=WALK_BLOCK, num_warps=WALK_WARPS, **common)
    return out
