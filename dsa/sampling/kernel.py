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
  logarithms.
* The candidates' passes (``_sample_check_kernel``, top-p only, one program per chunk, one launch each: the first
  candidate's mass ahead, then :data:`ROUNDS` pairs of launches). The row's program that finishes a pass last (a
  counter per row and pass) combines the chunks' results and writes the row's state; in a launch the state does not
  ask for, a row's programs cost one load each.
  * Mass ahead: the chunk's ``sum(exp(z - m))`` over the tokens ahead of the candidate (``z`` larger, or equal and
    a smaller index; ``m`` and ``s`` from pass 1's partials combined in a fixed order). The candidate is accepted
    when ``a / s < top_p`` (``a`` the chunks' masses summed in order); else it is rejected.
  * Argmax ahead, only for a rejected candidate: the chunk's argmax of ``z + g`` ahead of it, which is the next
    candidate (or none is ahead, and the rejected candidate is the token). Rejection is rare (about ``1 - top_p`` of
    the rows), so most rows hash their logits once, in pass 1.
* ``_sample_finish_kernel``, one program per row: the token from the row's state; a row still going after the
  chunked passes (rare: see above) walks its later candidates over the whole row on this one program (``_walk``: a
  pass for each one's mass ahead, and one for the argmax ahead of it only if it is rejected too).

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
                  G_MAX: tl.constexpr):
    """The argmax of ``z + g`` over the tokens of ``[lo, hi)`` ahead of the candidate: (value, index), -inf if none."""
    ar = tl.arange(0, BLOCK)
    nb = tl.full([], float("-inf"), tl.float32)
    ni = cand
    for start in range(lo, hi, BLOCK):
        offs, msk, z, bmax = _block(xr, start, ar, hi, inv_t)
        if bmax >= cz:
            nb, ni = _fold_noisy_argmax(z, msk & _ahead(z, offs, cz, cand), offs, bmax, nb, ni, s_hi, s_lo, V,
                                        U_BITS, G_MAX)
    return nb, ni


@triton.jit
def _walk(xr, V, inv_t, top_p, m, s, cand, s_hi, s_lo, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
          G_MAX: tl.constexpr):
    """The later candidates on one program, from ``cand`` (the argmax of ``z + g`` ahead of the last rejected one;
    ``s`` the softmax's sum at max ``m``): a pass for its mass ahead; while it is rejected (``a / s >= top_p``), a
    pass for the argmax ahead of it, which is the next candidate (while a token is ahead)."""
    go = True
    while go:
        cz = tl.load(xr + cand).to(tl.float32) * inv_t
        a = _mass_ahead(xr, 0, V, inv_t, m, cz, cand, BLOCK)
        go = a / s >= top_p
        if go:
            nb, ni = _argmax_ahead(xr, 0, V, V, inv_t, cz, cand, s_hi, s_lo, BLOCK, U_BITS, G_MAX)
            go = nb > float("-inf")
            cand = tl.where(go, ni, cand)
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
def _sample_partials_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, cnt, V, inv_t, S,
                            CHUNK: tl.constexpr, CUT: tl.constexpr, NCNT: tl.constexpr, BLOCK: tl.constexpr,
                            U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    """Pass 1, program (row, c) over ``[c * CHUNK, (c + 1) * CHUNK)``: ``part_f [B, 3, S]`` (max, sum, best value)
    and ``part_i [B, S]`` (best index); with top-p, program 0 zeroes the row's counters of the candidates' chunked
    passes (``cnt [B, NCNT]``)."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    if CUT:
        if c == 0:
            tl.store(cnt + row.to(tl.int64) * NCNT + tl.arange(0, NCNT), 0)
    xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
    lo = c * CHUNK
    m, s, best, best_i = _scan(xr, lo, tl.minimum(lo + CHUNK, V), V, inv_t, s_hi, s_lo, CUT, BLOCK, U_BITS, G_MAX)
    pf = part_f + row.to(tl.int64) * 3 * S + c
    tl.store(pf, m)
    tl.store(pf + S, s)
    tl.store(pf + 2 * S, best)
    tl.store(part_i + row.to(tl.int64) * S + c, best_i)


@triton.jit
def _last_of_row(cnt, row, r, S, NCNT: tl.constexpr):
    """Whether this program is the row's last to finish chunked pass ``r`` (its counter in ``cnt [B, NCNT]``;
    release: the program's stores before the count; acquire: the last one sees every program's stores)."""
    return tl.atomic_add(cnt + row.to(tl.int64) * NCNT + r, 1, sem="acq_rel", scope="gpu") == S - 1


@triton.jit
def _mass_chunk(x_ptr, stride_row, seeds_ptr, chk_f, cnt, st, row, c, r, m, s, cand, V, inv_t, top_p, S,
                S_P2: tl.constexpr, NCNT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Candidate ``cand``'s mass ahead over chunk ``c`` of the row (``m``, ``s``: the row's max ``z`` and softmax
    sum) into ``chk_f [B, 2, S]`` (row 0). The row's program that finishes last (pass ``r``) sums the chunks in
    order and writes the row's state ``st [B]``: ``-1 - cand`` when the candidate is accepted (``a / s < top_p``),
    else ``V + cand`` (rejected: the argmax ahead of it is the next candidate)."""
    xr, _, _ = _row(x_ptr, stride_row, seeds_ptr, row)
    cz = tl.load(xr + cand).to(tl.float32) * inv_t
    lo = c * CHUNK
    a = _mass_ahead(xr, lo, tl.minimum(lo + CHUNK, V), inv_t, m, cz, cand, BLOCK)
    rf = chk_f + row.to(tl.int64) * 2 * S
    tl.store(rf + c, a)
    if _last_of_row(cnt, row, r, S, NCNT):
        k = tl.arange(0, S_P2)
        a_all = tl.sum(tl.load(rf + k, mask=k < S, other=0.0, cache_modifier=".cg"), 0)
        rejected = (m > float("-inf")) & (a_all / s >= top_p)
        tl.store(st + row, tl.where(rejected, V + cand, -1 - cand))


@triton.jit
def _ahead_chunk(x_ptr, stride_row, seeds_ptr, chk_f, chk_i, cnt, st, row, c, r, cand, V, inv_t, S,
                 S_P2: tl.constexpr, NCNT: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    """The argmax of ``z + g`` ahead of the rejected candidate ``cand`` over chunk ``c`` of the row into
    ``chk_f [B, 2, S]`` (row 1, the value) and ``chk_i [B, S]``. The row's program that finishes last (pass ``r``)
    takes the first argmax over the chunks and writes the row's state: that token, the next candidate, or
    ``-1 - cand`` when no token is ahead (the candidate is then the token)."""
    xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
    cz = tl.load(xr + cand).to(tl.float32) * inv_t
    lo = c * CHUNK
    nb, ni = _argmax_ahead(xr, lo, tl.minimum(lo + CHUNK, V), V, inv_t, cz, cand, s_hi, s_lo, BLOCK, U_BITS, G_MAX)
    rf = chk_f + row.to(tl.int64) * 2 * S + S
    tl.store(rf + c, nb)
    tl.store(chk_i + row.to(tl.int64) * S + c, ni)
    if _last_of_row(cnt, row, r, S, NCNT):
        k = tl.arange(0, S_P2)
        ok = k < S
        nbs = tl.load(rf + k, mask=ok, other=float("-inf"), cache_modifier=".cg")
        nb_all = tl.max(nbs, 0)
        nis = tl.load(chk_i + row.to(tl.int64) * S + k, mask=ok, other=V, cache_modifier=".cg")
        ni_all = tl.min(tl.where(nbs == nb_all, nis, V), 0)
        tl.store(st + row, tl.where(nb_all > float("-inf"), ni_all, -1 - cand))


@triton.jit
def _sample_check_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, chk_f, chk_i, cnt, st, V, inv_t, top_p, S,
                         R: tl.constexpr, S_P2: tl.constexpr, NCNT: tl.constexpr, CHUNK: tl.constexpr,
                         BLOCK: tl.constexpr, U_BITS: tl.constexpr, G_MAX: tl.constexpr):
    """Chunked pass ``R`` (top-p), program (row, c). Even ``R``: a candidate's mass ahead (:func:`_mass_chunk`),
    pass 1's argmax of ``z + g`` at ``R`` 0, else the row's state when it holds a candidate (``0 <= st < V``). Odd
    ``R``: the argmax ahead of the row's rejected candidate (``st >= V``, :func:`_ahead_chunk`). A row whose state
    asks for the other pass, or holds its token, costs the program one load."""
    row = tl.program_id(0)
    c = tl.program_id(1)
    if R == 0:
        m, s, cand = _combine(part_f, part_i, row, S, V, S_P2, True)
        _mass_chunk(x_ptr, stride_row, seeds_ptr, chk_f, cnt, st, row, c, R, m, s, cand, V, inv_t, top_p, S, S_P2,
                    NCNT, CHUNK, BLOCK)
    elif R % 2 == 0:
        cand = tl.load(st + row)
        if (cand >= 0) & (cand < V):
            m, s, _ = _combine(part_f, part_i, row, S, V, S_P2, True)
            _mass_chunk(x_ptr, stride_row, seeds_ptr, chk_f, cnt, st, row, c, R, m, s, cand, V, inv_t, top_p, S,
                        S_P2, NCNT, CHUNK, BLOCK)
    else:
        cand = tl.load(st + row)
        if cand >= V:
            _ahead_chunk(x_ptr, stride_row, seeds_ptr, chk_f, chk_i, cnt, st, row, c, R, cand - V, V, inv_t, S,
                         S_P2, NCNT, CHUNK, BLOCK, U_BITS, G_MAX)


@triton.jit
def _sample_finish_kernel(x_ptr, stride_row, seeds_ptr, part_f, part_i, st, out_ptr, V, inv_t, top_p, S,
                          S_P2: tl.constexpr, CUT: tl.constexpr, BLOCK: tl.constexpr, U_BITS: tl.constexpr,
                          G_MAX: tl.constexpr):
    """One program per row: without top-p the pass-1 partials combined; with it the row's state after the chunked
    passes: its token, a candidate from which this one program walks on (:func:`_walk`), or a rejected candidate,
    whose argmax ahead this program takes first (its mass ahead is not summed again in another order, so the
    chunked pass's decision stands)."""
    row = tl.program_id(0)
    if CUT:
        cand = tl.load(st + row)
        if cand >= 0:
            m, s, _ = _combine(part_f, part_i, row, S, V, S_P2, True)
            xr, s_hi, s_lo = _row(x_ptr, stride_row, seeds_ptr, row)
            go = cand < V
            if cand >= V:
                cand = cand - V
                cz = tl.load(xr + cand).to(tl.float32) * inv_t
                nb, ni = _argmax_ahead(xr, 0, V, V, inv_t, cz, cand, s_hi, s_lo, BLOCK, U_BITS, G_MAX)
                go = nb > float("-inf")
                cand = tl.where(go, ni, cand)
            if go:
                cand = _walk(xr, V, inv_t, top_p, m, s, cand, s_hi, s_lo, BLOCK, U_BITS, G_MAX)
        else:
            cand = -1 - cand
    else:
        _, _, cand = _combine(part_f, part_i, row, S, V, S_P2, False)
    tl.store(out_ptr + row, cand.to(tl.int64))


#: pass 1's and the first candidate's chunk of the vocabulary, one program each (a fixed number, so that a row's
#: sums, and so its token, never depend on the batch around it), and the blocks and warps of the kernels (H100
#: sweep, BENCHMARKS.md sixty-first session)
CHUNK = 4096
CHUNK_WARPS = 8
ROW_BLOCK, ROW_WARPS = 4096, 16
#: later candidates in chunks (top-p): each round one launch for the argmax ahead of a rejected candidate and one
#: for the next candidate's mass ahead, before a row's one program walks on
ROUNDS = 1


def sample_launch(logits, seeds, out, inv_t: float, top_p: float):
    """Launch the kernels: ``logits [B, V]`` (rows contiguous), ``seeds [B]`` int64, ``out [B]`` int64: pass 1 in
    chunks; with top-p the first candidate's mass ahead in chunks and :data:`ROUNDS` rounds of a rejected candidate's
    argmax ahead and the next candidate's mass ahead in chunks; then one program per row."""
    B, V = logits.shape
    S = triton.cdiv(V, CHUNK)
    cut = top_p < 1.0
    dev = logits.device
    ncnt = triton.next_power_of_2(2 * ROUNDS + 1)
    # one workspace (32-bit words): pass 1's [B, 3, S] floats and [B, S] indices; with top-p a candidate's pass'
    # [B, 2, S] and [B, S] (each pass in turn), the passes' counters [B, ncnt] and the rows' states [B]
    ws = torch.empty(B * S * (7 if cut else 4) + (B * (ncnt + 1) if cut else 0), dtype=torch.int32, device=dev)
    part_f, part_i = ws[:3 * B * S].view(torch.float32), ws[3 * B * S:4 * B * S]
    chk_f, chk_i = ws[4 * B * S:6 * B * S].view(torch.float32), ws[6 * B * S:7 * B * S]
    cnt, st = ws[7 * B * S:7 * B * S + B * ncnt], ws[7 * B * S + B * ncnt:]
    if not cut:
        cnt = st = part_i
    cb = min(CHUNK, triton.next_power_of_2(V))
    s_p2 = triton.next_power_of_2(S)
    common = dict(U_BITS=U_BITS, G_MAX=G_MAX)
    x = (logits, logits.stride(0), seeds)
    _sample_partials_kernel[(B, S)](*x, part_f, part_i, cnt, V, inv_t, S, CHUNK=CHUNK, CUT=cut, NCNT=ncnt,
                                    BLOCK=cb, num_warps=CHUNK_WARPS, **common)
    for r in range(2 * ROUNDS + 1 if cut else 0):  # the first candidate's mass ahead, then (argmax ahead, mass) pairs
        _sample_check_kernel[(B, S)](*x, part_f, part_i, chk_f, chk_i, cnt, st, V, inv_t, top_p, S, R=r, S_P2=s_p2,
                                     NCNT=ncnt, CHUNK=CHUNK, BLOCK=cb, num_warps=CHUNK_WARPS, **common)
    _sample_finish_kernel[(B,)](*x, part_f, part_i, st, out, V, inv_t, top_p, S, S_P2=s_p2, CUT=cut,
                                BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)), num_warps=ROW_WARPS, **common)
    return out
