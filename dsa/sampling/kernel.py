"""Triton kernels for sampled next-token choice (semantics: :mod:`dsa.sampling.reference`).

The reference sorts the whole vocabulary to find the top-p nucleus; the kernels never sort. Gumbel-max picks
``argmax(z + g)`` over the nucleus, and the nucleus is a prefix of the row in descending order of ``z``. So the
kernels take the argmax over the whole row as a candidate and ask whether it is in the nucleus (the mass of the
tokens ahead of it, under ``softmax(z)``, below ``top_p``). If it is, it is the answer: it beats every token, the
nucleus' included. If not, no token at or behind it is in the nucleus either, and the next candidate is the argmax
over the tokens ahead of it. A candidate falls outside the nucleus with probability about ``1 - top_p`` (the mass
outside it); each next one is a draw among the tokens ahead, so on a flat row the candidates' ranks about halve at
each step (tests/test_sampling.py counts up to 11 on 400 near-equal tokens at top_p 1e-6). The next one is rejected
only when it falls in the part of the tokens ahead that lies outside the nucleus, itself at most about ``1 - top_p``
of their mass: with :data:`ROUNDS` ``n`` a row needs the one-program walk after its ``n + 1``-th rejection, at most
about one row in ``1 / (1 - top_p)**(n + 1)`` (400 at top_p 0.95 and ``n`` 1).

* Pass 1 (``_sample_partials_kernel``, one program per chunk of :data:`CHUNK` tokens of a row): the chunk's
  ``max(z)``, ``sum(exp(z - max))`` (online, rescaled per block; top-p only) and argmax of ``z + g``. Blocks whose
  largest ``z`` plus the largest Gumbel value (:data:`G_MAX`) cannot beat the best so far skip the hash and the
  logarithms. Every argmax of ``z + g`` (here and in the candidates' passes) is screened (:data:`NOISE`): each
  token's ``z + g`` is bounded from above with the SFU's ``log2`` (two instructions), and only the tokens whose
  bound reaches the best exact value so far, in descending order of the bound (usually one per block), get the
  reference's two logarithms. The result is the exact argmax, the first index among equal values, as without it.
* The first candidate (``_sample_check_kernel``, top-p only, one program per chunk): the chunks' partials combined
  in a fixed order into ``m``, ``s`` and the candidate; the chunk's mass ahead of it (``z`` larger, or equal and a
  smaller index) and its argmax of ``z + g`` ahead of it.
* Later candidates (``_sample_round_kernel``, top-p only, :data:`ROUNDS` launches of one program per chunk): each
  round combines the previous candidate's chunk results; it is accepted when ``a / s < top_p`` (``a`` the chunks'
  masses ahead, summed in order) or nothing is ahead; else the next candidate is the argmax ahead of it, and the
  round's programs compute its mass ahead and argmax ahead over their chunks. A row that has its token costs its
  programs of the later rounds only the loads of its pass-1 partials and state (measured: about 17 µs a round at
  B 256, where the chunked passes themselves are rare).
* ``_sample_finish_kernel``, one program per row: the same combination for the last chunked candidate; a row still
  going after the rounds (rare: see below) walks its later candidates over the whole row on this one program
  (``_walk``: a pass for each one's mass ahead, and one for the argmax ahead of it only if it is rejected too).

The chunks are a fixed size, so a row's sums, and so its token, never depend on the batch around it. The tokens are
the reference's except where the candidate's mass ahead lies within the rounding of the two sums (the kernels'
chunked sums against the reference's cumulative sum in sorted order) of ``top_p``, or where two tokens' ``z + g``
are within the last bit (the logarithms of the two libraries).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..backend import compiled_nvidia, interpreter_on
from .reference import U_BITS

#: a bound on the Gumbel noise: ``g = -log(-log(u))`` with ``u <= 1 - 2**-24`` is at most 16.64
G_MAX = 17.0
#: the screen's margin on ``g`` (:func:`_gumbel_bound_of_bits`); its bound lies within 2.4e-6 of ``g + G_TOL`` for
#: every ``u`` with the SFU's ``log2`` (H100), 1.4e-6 with ``tl.log2`` (tests/test_sampling.py checks a quarter of it)
G_TOL = tl.constexpr(2.0 ** -12)


@triton.jit
def _mix32(x):
    """The reference's 32-bit hash rounds (``reference._mix32``) on uint32 (the products wrap mod 2**32)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x5BD1E995
    return x ^ (x >> 16)


@triton.jit
def _noise_bits(offs, s_hi, s_lo, U_BITS: tl.constexpr):
    """The top ``U_BITS`` bits of the reference's hash of (seed, index): ``u = (k + 0.5) / 2**U_BITS``."""
    return _mix32(_mix32(offs.to(tl.uint32) ^ s_hi) ^ s_lo) >> (32 - U_BITS)


@triton.jit
def _gumbel_of_bits(k, U_BITS: tl.constexpr):
    """``g = -log(-log(u))`` as the reference computes it (fp32, two logarithms)."""
    u = (k.to(tl.float32) + 0.5) * (1.0 / (1 << U_BITS))
    return -tl.log(-tl.log(u))


@triton.jit
def _gumbel(offs, s_hi, s_lo, U_BITS: tl.constexpr):
    return _gumbel_of_bits(_noise_bits(offs, s_hi, s_lo, U_BITS), U_BITS)


@triton.jit
def _log2_fast(x, NOISE: tl.constexpr):
    """``log2(x)`` for positive normal ``x``: the SFU's approximation (``lg2.approx.ftz``, one instruction) on
    NVIDIA GPUs (``NOISE`` 2), else ``tl.log2``."""
    if NOISE == 2:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    else:
        return tl.log2(x)


@triton.jit
def _gumbel_bound_of_bits(k, U_BITS: tl.constexpr, NOISE: tl.constexpr):
    """An upper bound of :func:`_gumbel_of_bits` within ``2 * G_TOL`` of it (``tests/test_sampling.py`` checks every
    ``k``), in base-2 logarithms: ``e = -log2(u)`` (``E = -log(u) = e * ln 2``) from the SFU's ``log2(u)``, or where
    ``w = 1 - u < 2**-6`` (exact there) from ``(w + w**2 / 2 + w**3 / 3) / ln 2`` (the SFU's absolute error would be
    large against ``E ~ w``); then ``g = -log(E) = -ln 2 * log2(e) - log(ln 2)`` from the SFU's ``log2(e)``, plus
    ``G_TOL``. ``u = k * 2**-U_BITS + 2**-(U_BITS + 1)`` is the reference's ``(k + 0.5) / 2**U_BITS``, exactly."""
    LN2: tl.constexpr = 0.6931471805599453
    u = k.to(tl.float32) * (1.0 / (1 << U_BITS)) + (0.5 / (1 << U_BITS))
    w = 1.0 - u
    e_series = w * (1.0 / LN2 + w * (0.5 / LN2 + w * (1.0 / (3.0 * LN2))))
    e = tl.where(w < 0.015625, e_series, -_log2_fast(u, NOISE))
    return _log2_fast(e, NOISE) * -LN2 + (G_TOL + 0.36651292058166435)


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
def _screened_argmax(xr, up, offs, best, best_i, inv_t, s_hi, s_lo, V, U_BITS: tl.constexpr):
    """(best, best_i) updated with the first argmax of ``z + g`` over a block, given upper bounds ``up`` of each
    token's ``z + g`` (-inf: not a candidate): the exact value of one token at a time, in descending order of
    ``up``, while a bound still reaches the best value (so a tie with it is taken by index too). A best value of
    +inf ends it: the tokens left with a bound of +inf come after it (taken in index order), so none can win, and a
    row of many +inf logits costs one turn, not one per token."""
    NEG: tl.constexpr = float("-inf")
    top = tl.max(up, 0)
    while (top >= best) & (top > NEG) & (best < float("inf")):
        i = tl.min(tl.where(up == top, offs, V), 0)
        y = tl.load(xr + i).to(tl.float32) * inv_t + _gumbel(i, s_hi, s_lo, U_BITS)
        better = (y > best) | ((y == best) & (i < best_i))
        best = tl.where(better, y, best)
        best_i = tl.where(better, i, best_i)
        up = tl.where(offs == i, NEG, up)
        top = tl.max(up, 0)
    return best, best_i


@triton.jit
def _fold_noisy_argmax(xr, z, keep, offs, bmax, best, best_i, inv_t, s_hi, s_lo, V, U_BITS: tl.constexpr,
                       G_MAX: tl.constexpr, NOISE: tl.constexpr):
    """(best, best_i) updated with the block's argmax of ``z + g`` over ``keep`` (the first index among equal
    values); the hash and the logarithms are skipped when even ``bmax + G_MAX`` cannot beat ``best``. ``NOISE`` 0:
    the reference's noise of every token. Else a screen (:func:`_screened_argmax`) on cheap upper bounds of every
    token's ``z + g`` (:func:`_gumbel_bound_of_bits`): the same result, with the reference's two logarithms taken
    for a token or two per block instead of every token."""
    NEG: tl.constexpr = float("-inf")
    if bmax + G_MAX >= best:
        if NOISE == 0:
            y = tl.where(keep, z + _gumbel(offs, s_hi, s_lo, U_BITS), NEG)
            bv, bi = _argmax_first(y, offs, V)
            if bv > best:
                best = bv
                best_i = bi
        else:
            # z scaled away from 0 by 2**-20 covers its rounding against the exact value's (the same product, maybe
            # fused with the sum) and the sums' (a token with z = -inf stays -inf, never the answer)
            g_up = _gumbel_bound_of_bits(_noise_bits(offs, s_hi, s_lo, U_BITS), U_BITS, NOISE)
            up = tl.where(keep, z * tl.where(z >= 0, 1.0 + 2.0 ** -20, 1.0 - 2.0 ** -20) + g_up, NEG)
            best, best_i = _screened_argmax(xr, up, offs, best, best_i, inv_t, s_hi, s_lo, V, U_BITS)
    return best, best_i


@triton.jit
def _row(x_ptr, stride_row, seeds_ptr, row):
    """The row's logits pointer and its seed's two 32-bit halves."""
    seed = tl.load(seeds_ptr + row)
    return (x_ptr + row.to(tl.int64) * stride_row, ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32),
            (seed & 0xFFFFFFFF).to(tl.uint32))


@triton.jit
def _scan(xr, lo, hi, V, inv_t, s_hi, s_lo, CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
          G_MAX: tl.constexpr, NOISE: tl.constexpr):
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
        best, best_i = _fold_noisy_argmax(xr, z, msk, offs, bmax, best, best_i, inv_t, s_hi, s_lo, V, U_BITS,
                                          G_MAX, NOISE)
    return m, s, best, best_i


@triton.jit
def _ahead(z, offs, cz, cand):
    """Which tokens are ahead of the candidate (index ``cand``, scaled logit ``cz``) in the nucleus' order."""
    return (z > cz) | ((z == cz) & (offs < cand))


@triton.jit
def _mass_ahead(xr, lo, hi, inv_t, m, cz, cand, BLOCK: tl.constexpr):
    """``sum(exp(z - m))`` over the tokens of ``[lo, hi)`` ahead of the candidate (per lane, then one sum)."""
    ar = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(lo, hi, BLOCK):
        offs = start + ar
        msk = offs < hi
        z = tl.load(xr + offs, mask=msk, other=float("-inf")).to(tl.float32) * inv_t
        acc += tl.where(msk & _ahead(z, offs, cz, cand), tl.exp(z - m), 0.0)
    return tl.sum(acc, 0)


@triton.jit
def _argmax_ahead(xr, lo, hi, V, inv_t, cz, cand, s_hi, s_lo, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
                  G_MAX: tl.constexpr, NOISE: tl.constexpr):
    """The argmax of ``z + g`` over the tokens of ``[lo, hi)`` ahead of the candidate: (value, index), -inf if none."""
    ar = tl.arange(0, BLOCK)
    nb = tl.full([], float("-inf"), tl.float32)
    ni = cand
    for start in range(lo, hi, BLOCK):
        offs, msk, z, bmax = _block(xr, start, ar, hi, inv_t)
        if bmax >= cz:
            nb, ni = _fold_noisy_argmax(xr, z, msk & _ahead(z, offs, cz, cand), offs, bmax, nb, ni, inv_t, s_hi, s_lo,
                                        V, U_BITS, G_MAX, NOISE)
    return nb, ni


@triton.jit
def _walk(xr, V, inv_t, top_p, m, s, cand, a, nb, ni, s_hi, s_lo, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
          G_MAX: tl.constexpr, NOISE: tl.constexpr):
    """The candidate passes after the first (one program): ``a`` is the mass ahead of ``cand`` (over ``s``, the
    softmax's sum at max ``m``), ``(nb, ni)`` the argmax of ``z + g`` ahead of it. While the candidate is rejected
    (``a / s >= top_p``) and a token is ahead, move to that token: one pass for its mass ahead, and one for the
    argmax ahead of it only when it is rejected too."""
    go = (m > float("-inf")) & (a / s >= top_p) & (nb > float("-inf"))
    while go:
        cand = ni
        cz = tl.load(xr + cand).to(tl.float32) * inv_t
        a = _mass_ahead(xr, 0, V, inv_t, m, cz, cand, BLOCK)
        go = a / s >= top_p
        nb = tl.full([], float("-inf"), tl.float32)
        if go:
            nb, ni = _argmax_ahead(xr, 0, V, V, inv_t, cz, cand, s_hi, s_lo, BLOCK, U_BITS, G_MAX, NOISE)
        go = go & (nb > float("-inf"))
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
def _sample_partials_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, V, inv_t, S,
                            CHUNK: tl.constexpr, CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
                            G_MAX: tl.constexpr, NOISE: tl.constexpr):
    """Pass 1, program (row, c) over ``[c * CHUNK, (c + 1) * CHUNK)``: ``part_f [B, 3, S]`` (max, sum, best value)
    and ``part_i [B, S]`` (best index)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
    lo = c * CHUNK
    m, s, best, best_i = _scan(xr, lo, tl.minimum(lo + CHUNK, V), V, inv_t, s_hi, s_lo, CUT, BLOCK, U_BITS, G_MAX,
                               NOISE)
    pf = part_f + row.to(tl.int64) * 3 * S + c
    tl.store(pf, m)
    tl.store(pf + S, s)
    tl.store(pf + 2 * S, best)
    tl.store(part_i + row.to(tl.int64) * S + c, best_i)


@triton.jit
def _check_chunk(x_ptr, stride_row, seeds_ptr, chk_f, chk_i, row, c, m, cand, V, inv_t, S, CHUNK: tl.constexpr,
                 BLOCK: tl.constexpr, U_BITS: tl.constexpr, G_MAX: tl.constexpr, NOISE: tl.constexpr):
    """Candidate ``cand``'s pass over chunk ``c`` of the row (``m``: the row's max ``z``): the mass ahead of it and
    the argmax of ``z + g`` ahead of it, into ``chk_f [B, 2, S]`` (mass, best value) and ``chk_i [B, S]``."""
    xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
    cz = tl.load(xr + cand).to(tl.float32) * inv_t
    lo = c * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    a = _mass_ahead(xr, lo, hi, inv_t, m, cz, cand, BLOCK)
    nb, ni = _argmax_ahead(xr, lo, hi, V, inv_t, cz, cand, s_hi, s_lo, BLOCK, U_BITS, G_MAX, NOISE)
    cf = chk_f + row.to(tl.int64) * 2 * S + c
    tl.store(cf, a)
    tl.store(cf + S, nb)
    tl.store(chk_i + row.to(tl.int64) * S + c, ni)


@triton.jit
def _sample_check_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, chk_f, chk_i, V, inv_t, S,
                         S_P2: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
                         G_MAX: tl.constexpr, NOISE: tl.constexpr):
    """The first candidate's pass (top-p), program (row, c) over its chunk (:func:`_check_chunk`)."""
    row = tl.program_id(0)
    m, s, cand = _combine(part_f, part_i, row, S, V, S_P2, True)
    _check_chunk(x_ptr, stride_row, seeds_ptr, chk_f, chk_i, row, tl.program_id(1), m, cand, V, inv_t, S, CHUNK,
                 BLOCK, U_BITS, G_MAX, NOISE)


@triton.jit
def _combine_check(chk_f, chk_i, row, S, V, S_P2: tl.constexpr):
    """A candidate's chunked pass combined: (its mass ahead, summed in chunk order; the first argmax of ``z + g``
    ahead of it: value, index)."""
    k = tl.arange(0, S_P2)
    ok = k < S
    cf = chk_f + row.to(tl.int64) * 2 * S + k
    a = tl.sum(tl.load(cf, mask=ok, other=0.0), 0)
    nbs = tl.load(cf + S, mask=ok, other=float("-inf"))
    nb = tl.max(nbs, 0)
    ni = tl.min(tl.where(nbs == nb, tl.load(chk_i + row.to(tl.int64) * S + k, mask=ok, other=V), V), 0)
    return a, nb, ni


@triton.jit
def _sample_round_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, prev_f, prev_i, prev_st, chk_f, chk_i, st,
                         V, inv_t, top_p, S, FIRST: tl.constexpr, S_P2: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr, U_BITS: tl.constexpr, G_MAX: tl.constexpr, NOISE: tl.constexpr):
    """A later candidate's pass in chunks (top-p), program (row, c). The row's previous candidate (pass 1's when
    ``FIRST``, else ``prev_st [B]``) and its chunked pass (``prev_f``, ``prev_i``) decide, as :func:`_walk` does,
    whether it is accepted; program 0 writes the row's state ``st [B]`` int32: the candidate now checked, or
    ``-1 - token`` once the row has its token (then every later round only loads and copies it). A row still going
    moves to the argmax ahead of the rejected candidate, and each program writes that candidate's mass ahead and
    argmax ahead over its chunk into ``chk_f``, ``chk_i`` (the layout of :func:`_sample_check_kernel`'s)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    m, s, cand = _combine(part_f, part_i, row, S, V, S_P2, True)
    if FIRST:
        go = m > float("-inf")
        cand = tl.where(go, cand, -1 - cand)
    else:
        cand = tl.load(prev_st + row)
        go = cand >= 0
    if go:
        a, nb, ni = _combine_check(prev_f, prev_i, row, S, V, S_P2)
        go = (a / s >= top_p) & (nb > float("-inf"))
        cand = tl.where(go, ni, -1 - cand)
    if c == 0:
        tl.store(st + row, cand)
    if go:
        _check_chunk(x_ptr, stride_row, seeds_ptr, chk_f, chk_i, row, c, m, cand, V, inv_t, S, CHUNK, BLOCK, U_BITS,
                     G_MAX, NOISE)


@triton.jit
def _sample_finish_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, chk_f, chk_i, st, out_ptr, V, inv_t, top_p,
                          S, S_P2: tl.constexpr, CUT: tl.constexpr, ROUNDS: tl.constexpr, BLOCK: tl.constexpr,
                          U_BITS: tl.constexpr, G_MAX: tl.constexpr, NOISE: tl.constexpr):
    """One program per row: the pass-1 partials combined; with top-p, the last chunked candidate (pass 1's, or
    after ``ROUNDS`` rounds of :func:`_sample_round_kernel` the one in the row's state ``st``, or its token) and its
    chunks' results combined, then any later candidates' passes on this one program (:func:`_walk`)."""
    row = tl.program_id(0)
    m, s, cand = _combine(part_f, part_i, row, S, V, S_P2, CUT)
    if CUT:
        go = True
        if ROUNDS > 0:
            cand = tl.load(st + row)
            go = cand >= 0
            cand = tl.where(go, cand, -1 - cand)
        if go:
            xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
            a, nb, ni = _combine_check(chk_f, chk_i, row, S, V, S_P2)
            cand = _walk(xr, V, inv_t, top_p, m, s, cand, a, nb, ni, s_hi, s_lo, BLOCK, U_BITS, G_MAX, NOISE)
    tl.store(out_ptr + row, cand.to(tl.int64))


#: pass 1's and the first candidate's chunk of the vocabulary, one program each (a fixed number, so that a row's
#: sums, and so its token, never depend on the batch around it), and the blocks and warps of the kernels (H100
#: sweep, BENCHMARKS.md sixty-first session)
CHUNK = 4096
CHUNK_WARPS = 8
ROW_BLOCK, ROW_WARPS = 4096, 16
#: later candidates' passes in chunks (top-p), each round its own launch, before a row's one program walks on. H100,
#: [B, 129280] fp32 rows, CUDA graphs (BENCHMARKS.md, sixty-sixth session, before the screen), µs for 0 / 1 / 2
#: rounds: B 1 12.4 / 14.2 / 15.7 (a launch each), B 16 46.3 / 34.4 / 37.0, B 64 at top-p 0.8 193.8 / 108.9 / 104.1,
#: B 256 at 0.95 299.0 / 307.4 / 325.4 (a round's 8,192 programs load their row's partials even when it has its
#: token), at 0.8 405.9 / 352.8 / 360.1. With the screen (sixty-eighth session), 0 / 1 rounds: B 1 10.0 / 12.0,
#: B 16 41.9 / 28.9, B 64 at 0.8 156.4 / 90.7, B 256 at 0.95 230.7 / 237.3, at 0.8 316.7 / 280.2
ROUNDS = 1
#: the argmax of ``z + g`` (:func:`_fold_noisy_argmax`): 0 the reference's noise of every token, 1 a screen with
#: ``tl.log2`` bounds, 2 a screen with the SFU's ``lg2.approx`` (NVIDIA); None: 2 on NVIDIA GPUs, 1 under the
#: interpreter, 0 elsewhere (AMD GPUs: a bound there would take ``tl.log2``, whose cost and error were not measured)
NOISE = None


def noise_mode(device: torch.device) -> int:
    """The :data:`NOISE` form the kernels take on ``device``."""
    if NOISE is not None:
        return NOISE
    if compiled_nvidia(device):
        return 2
    return 1 if interpreter_on() else 0


def sample_launch(logits, seeds, out, inv_t: float, top_p: float):
    """Launch the kernels: ``logits [B, V]`` (rows contiguous), ``seeds [B]`` int64, ``out [B]`` int64: pass 1 in
    chunks; with top-p the first candidate's pass in chunks and :data:`ROUNDS` rounds of later candidates in chunks;
    then one program per row."""
    B, V = logits.shape
    S = triton.cdiv(V, CHUNK)
    cut = top_p < 1.0
    rounds = ROUNDS if cut else 0
    dev = logits.device
    # one workspace (32-bit words): pass 1's [B, 3, S] floats and [B, S] indices, two candidates' passes' [B, 2, S]
    # and [B, S] each (the rounds take turns), two rows' states [B]
    n_chk = (1 if rounds == 0 else 2) if cut else 0
    ws = torch.empty(B * S * (4 + 3 * n_chk) + (2 * B if rounds else 0), dtype=torch.int32, device=dev)
    part_f, part_i = ws[:3 * B * S].view(torch.float32), ws[3 * B * S:4 * B * S]
    o = [(4 + 3 * j) * B * S for j in range(n_chk + 1)]
    chk = [(ws[o[j]:o[j] + 2 * B * S].view(torch.float32), ws[o[j] + 2 * B * S:o[j + 1]]) for j in range(n_chk)]
    chk = chk or [(part_f, part_i)]
    st = [ws[o[-1] + j * B:o[-1] + (j + 1) * B] for j in range(2)] if rounds else [part_i, part_i]
    cb = min(CHUNK, triton.next_power_of_2(V))
    s_p2 = triton.next_power_of_2(S)
    common = dict(U_BITS=U_BITS, G_MAX=G_MAX, NOISE=noise_mode(dev))
    x = (logits, logits.stride(0), seeds)
    _sample_partials_kernel[(B, S)](*x, part_f, part_i, V, inv_t, S, CHUNK=CHUNK, CUT=cut, BLOCK=cb,
                                    num_warps=CHUNK_WARPS, **common)
    if cut:
        _sample_check_kernel[(B, S)](*x, part_f, part_i, *chk[0], V, inv_t, S, S_P2=s_p2, CHUNK=CHUNK, BLOCK=cb,
                                     num_warps=CHUNK_WARPS, **common)
    for r in range(1, rounds + 1):  # round r reads the candidate pass r - 1 wrote, and writes pass r (turns)
        _sample_round_kernel[(B, S)](*x, part_f, part_i, *chk[(r - 1) % 2], st[(r - 1) % 2], *chk[r % 2], st[r % 2],
                                     V, inv_t, top_p, S, FIRST=r == 1, S_P2=s_p2, CHUNK=CHUNK, BLOCK=cb,
                                     num_warps=CHUNK_WARPS, **common)
    _sample_finish_kernel[(B,)](*x, part_f, part_i, *chk[rounds % 2], st[rounds % 2], out, V, inv_t, top_p, S,
                                S_P2=s_p2, CUT=cut, ROUNDS=rounds, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)),
                                num_warps=ROW_WARPS, **common)
    return out
