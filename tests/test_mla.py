"""Sparse MLA attention (dsa.mla, the public dsa.sparse_mla): the reference against a float64 brute force, the Triton
kernel against the reference on fresh random inputs, and the argument checks.

Tolerances (kernel vs reference, both fp32 accumulation over the same bf16 operands):

* ``lse`` / ``max_logits``: the logits are the same fp32 dot products summed in another order
  (MMA tiles vs einsum) and the kernel works in base 2 (``exp2``/``log2`` with ``log2(e)`` folded
  into the scale; on the GPU ``exp2``/``log2`` are the hardware approximations): FlashMLA's
  criterion, ``rtol 2/65536`` (plus ``atol 2e-5``). Observed: ~1e-7 relative on the CPU,
  up to 7e-6 relative on the H200.
* ``out``: the kernel rounds the softmax weights to bf16 before the P·V product (relative error
  <= 2^-9 each, as FlashMLA does) and both round the result to bf16 (half an ulp, 2^-9 relative):
  ``|err| <= ~2^-8 · max|v|``; we allow ``2^-7 · max|v|`` absolute (max|v| of the gathered rows).
* reference vs float64 brute force: only the final bf16 rounding of ``out`` (2^-8 relative to
  max|v|, with margin) and fp32 logits (``lse`` 1e-5 relative).
"""
from __future__ import annotations

import functools
import math
import os
import re
import subprocess
import sys

LOG2E = 1.4426950408889634

import pytest
import torch
import triton

import dsa.mla.reference as ref_mod
from dsa.backend import on_hopper
from dsa.constants import D_QK, D_V, FP8_DS_MLA_ROW_BYTES, INT32_MAX, KV_LORA_RANK
from dsa.layouts import fp8_ds_mla_views
from dsa.mla_cache.reference import dequantize_fp8_ds_mla, quantize_fp8_ds_mla
from dsa.mla import sparse_mla, sparse_mla_ref
from dsa.mla.kernel import (SM90_TWO_GROUPS_MAX_T, TARGET_CONFIGS, block_h_for, choose_num_splits,
                             sparse_mla_triton)
from utils import (DEVICE, compiled_in_subprocess, gen, poison_, record_launches, skip_unless_gluon_triton,
                   skip_unless_hopper)

OUT_ATOL_REL = 2.0**-7
LSE_ATOL, LSE_RTOL = 2e-5, 2.0 / 65536


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def make_indices(T, topk, S, g, *, frac_invalid=0.2, empty_rows=(), dup=True):
    """Random slots with -1 and >= S entries scattered through each row, duplicates, empty rows."""
    idx = torch.randint(0, S, (T, topk), generator=g, dtype=torch.int64)
    bad = torch.rand(T, topk, generator=g) < frac_invalid
    bad_vals = torch.tensor([-1, -7, S, S + 13, INT32_MAX], dtype=torch.int64)
    idx[bad] = bad_vals[torch.randint(0, len(bad_vals), (int(bad.sum()),), generator=g)]
    if dup and topk >= 4:
        idx[:, topk // 2] = idx[:, 1]  # the same slot twice in every row (counts twice)
        idx[:, -1] = idx[:, 0]
    for t in empty_rows:
        idx[t] = torch.where(torch.rand(topk, generator=g) < 0.5, -1, S + 5)
    return idx.to(torch.int32)


def make_cache(S, kv_format, g, used, *, block_size=None, scale=1.0):
    """A cache of S slots with random rows where ``used`` and NaN everywhere else.

    fp8_ds_mla rows are packed by the reference packer (dsa.mla_cache.reference). Returns the
    cache in its paged shape when ``block_size`` is given ([nb, bs, 576] / [nb, bs, 1, 656]).
    """
    c_kv = torch.randn(S, KV_LORA_RANK, generator=g) * scale
    c_kv *= torch.exp(torch.randn(S, 1, generator=g) * 0.5)  # rows of different magnitudes
    k_pe = torch.randn(S, D_QK - KV_LORA_RANK, generator=g) * scale
    return pack_cache(c_kv, k_pe, kv_format, used, block_size=block_size)


def pack_cache(c_kv, k_pe, kv_format, used, *, block_size=None):
    """Rows ``c_kv [S, 512]`` and ``k_pe [S, 64]`` (float) as a cache in ``kv_format`` with NaN in every slot not
    ``used`` (see :func:`make_cache`)."""
    S = c_kv.shape[0]
    if kv_format == "bf16":
        kv = torch.cat([c_kv, k_pe], dim=-1).to(torch.bfloat16)
        kv[~used] = float("nan")
    else:
        kv = quantize_fp8_ds_mla(c_kv.to(torch.bfloat16), k_pe.to(torch.bfloat16))
        values, scales, rope = fp8_ds_mla_views(kv)
        values.view(torch.uint8)[~used] = 0x7F  # NaN in e4m3fn
        scales[~used] = float("nan")
        rope[~used] = float("nan")
    if block_size is not None:
        nb = S // block_size
        kv = kv.view(nb, block_size, -1) if kv_format == "bf16" else kv.view(nb, block_size, 1, -1)
    return kv


def make_case(T, h_q, topk, S, kv_format, seed, *, block_size=None, empty_rows=(), frac_invalid=0.2,
              with_len=False, with_sink=False, device=DEVICE):
    g = gen(seed)
    idx = make_indices(T, topk, S, g, frac_invalid=frac_invalid, empty_rows=empty_rows)
    used = torch.zeros(S, dtype=torch.bool)
    ok = (idx >= 0) & (idx < S)
    used[idx[ok].long()] = True
    kv = make_cache(S, kv_format, g, used, block_size=block_size)
    q = torch.randn(T, h_q, D_QK, generator=g).to(torch.bfloat16)
    topk_length = torch.randint(0, topk + 1, (T,), generator=g, dtype=torch.int32) if with_len else None
    sink = (torch.randn(h_q, generator=g) * 2).float() if with_sink else None
    sm_scale = 192**-0.5
    to = lambda x: None if x is None else x.to(device)  # noqa: E731
    return to(q), to(kv), to(idx), sm_scale, to(sink), to(topk_length)


def max_abs_v(kv, idx, S):
    ok = (idx >= 0) & (idx < S)
    if not ok.any():
        return 1.0
    rows = ref_mod.gather_rows_bf16(kv, idx[ok].long()).float()
    return float(rows[:, :D_V].abs().max())


def assert_matches(got, want, vmax, msg=""):
    out, ml, lse = got
    r_out, r_ml, r_lse = want
    assert out.dtype == torch.bfloat16 and ml.dtype == torch.float32 and lse.dtype == torch.float32
    assert not torch.isnan(out).any(), f"NaN in out {msg}"
    assert not torch.isnan(lse).any() and not torch.isnan(ml).any(), f"NaN in lse/max_logits {msg}"
    torch.testing.assert_close(out.float(), r_out.float(), atol=OUT_ATOL_REL * vmax, rtol=0, msg=lambda m: f"{msg} out: {m}")
    torch.testing.assert_close(lse, r_lse, atol=LSE_ATOL, rtol=LSE_RTOL, msg=lambda m: f"{msg} lse: {m}")
    torch.testing.assert_close(ml, r_ml, atol=LSE_ATOL, rtol=LSE_RTOL, msg=lambda m: f"{msg} max_logits: {m}")


# ----------------------------------------------------------------------------------------------
# the reference against an independent float64 brute force
# ----------------------------------------------------------------------------------------------
def brute_force(q, kv, idx, sm_scale, sink=None, topk_length=None):
    """Per (t, h) loop in float64 over the valid entries; rows decoded independently of the reference."""
    kv = kv.reshape(-1, D_QK if kv.dtype == torch.bfloat16 else FP8_DS_MLA_ROW_BYTES)
    S = kv.shape[0]
    T, H, _ = q.shape
    out = torch.zeros(T, H, D_V, dtype=torch.float64)
    lse = torch.full((T, H), math.inf, dtype=torch.float64)
    ml = torch.full((T, H), -math.inf, dtype=torch.float64)
    for t in range(T):
        n = idx.shape[1] if topk_length is None else int(topk_length[t])
        slots = [int(s) for s in idx[t, :n] if 0 <= int(s) < S]
        if not slots:
            continue
        if kv.dtype == torch.bfloat16:
            rows = kv[slots].double()
        else:  # fp8 * group scale in fp32, rounded to bf16 (SPEC), decoded here from the views
            vals, scales, rope = fp8_ds_mla_views(kv[slots])
            v = torch.stack([vals[:, 128 * gi:128 * (gi + 1)].float() * scales[:, gi:gi + 1] for gi in range(4)], 1)
            rows = torch.cat([v.reshape(len(slots), -1).to(torch.bfloat16).double(), rope.double()], -1)
        for h in range(H):
            logits = [sm_scale * float(q[t, h].double() @ rows[j]) for j in range(len(slots))]
            m = max(logits)
            s = sum(math.exp(x - m) for x in logits)
            l = m + math.log(s)
            denom = l if sink is None else max(l, float(sink[h])) + math.log1p(math.exp(-abs(l - float(sink[h]))))
            w = torch.tensor([math.exp(x - denom) for x in logits], dtype=torch.float64)
            out[t, h] = w @ rows[:, :D_V]
            lse[t, h], ml[t, h] = l, m
    return out, ml, lse


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("extras", ["plain", "len_sink"])
def test_reference_vs_brute_force(kv_format, extras):
    T, H, topk, S = 4, 8, 21, 40
    q, kv, idx, sm, sink, tl_ = make_case(T, H, topk, S, kv_format, seed=11, empty_rows=(2,), device="cpu",
                                          with_len=extras == "len_sink", with_sink=extras == "len_sink")
    out, ml, lse = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    b_out, b_ml, b_lse = brute_force(q, kv, idx, sm, sink, tl_)
    vmax = max_abs_v(kv, idx, S)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), b_out, atol=2.0**-8 * vmax, rtol=0)
    torch.testing.assert_close(lse.double(), b_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ml.double(), b_ml, atol=1e-5, rtol=1e-5)
    # row 2 has no valid entry: FlashMLA's convention
    assert (out[2] == 0).all() and (lse[2] == math.inf).all() and (ml[2] == -math.inf).all()


def test_reference_chunking_and_paged_views(monkeypatch):
    """Token chunks and paged cache shapes do not change the result."""
    q, kv, idx, sm, sink, tl_ = make_case(9, 16, 33, 64, "fp8_ds_mla", seed=5, block_size=16, device="cpu",
                                          with_len=True, with_sink=True)
    whole = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    flat = sparse_mla_ref(q, kv.reshape(-1, FP8_DS_MLA_ROW_BYTES), idx, sm, attn_sink=sink, topk_length=tl_)
    monkeypatch.setattr(ref_mod, "_CHUNK_BYTES", 1)  # one token per chunk
    chunked = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    for a, b, c in zip(whole, flat, chunked):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_reference_sink_limits():
    """A very negative sink changes nothing; a huge one drives out to 0; lse never includes the sink."""
    q, kv, idx, sm, _, _ = make_case(3, 8, 16, 50, "bf16", seed=2, device="cpu")
    base = sparse_mla_ref(q, kv, idx, sm)
    lo = sparse_mla_ref(q, kv, idx, sm, attn_sink=torch.full((8,), -1e4))
    hi = sparse_mla_ref(q, kv, idx, sm, attn_sink=torch.full((8,), 1e4))
    assert torch.equal(base[0], lo[0]) and torch.equal(base[2], lo[2]) and torch.equal(base[2], hi[2])
    assert (hi[0] == 0).all()


# ----------------------------------------------------------------------------------------------
# kernel vs reference
# ----------------------------------------------------------------------------------------------
def run_both(q, kv, idx, sm, sink, tl_, *, num_splits=None, poison=True):
    T, H, _ = q.shape
    out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=q.device)) if poison else None
    flat = ref_mod.flat_kv(kv)
    got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, out, num_splits=num_splits)
    if poison:
        assert got[0] is out
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    return got, want, max_abs_v(kv, idx, flat.shape[0])


@pytest.mark.parametrize("T", [4, 20])
def test_merge_forms(T):
    """The split merge after the split kernel, end to end (3 splits, empty rows, topk_length, sink)."""
    q, kv, idx, sm, sink, tl_ = make_case(T, 16, 200, 300, "fp8_ds_mla", seed=40 + T, empty_rows=(1,),
                                          with_len=True, with_sink=True)
    got, want, vmax = run_both(q, kv, idx, sm, sink, tl_, num_splits=3)
    assert_matches(got, want, vmax, f"T={T}")
    assert (got[0][1] == 0).all() and (got[2][1] == math.inf).all()


@pytest.mark.parametrize("T,h_q,ns,form", [(4, 16, 3, (2, True)), (3, 24, 16, (2, True)), (80, 16, 13, (4, False)),
                                           (9, 128, 2, (4, True))])
def test_combine_kernel(T, h_q, ns, form):
    """The merge kernel on random partials against the merge written in PyTorch, in the launch shapes
    :func:`dsa.mla.kernel.combine_config` picks: 2-head programs loading every split in one pass, 4-head programs
    loading 8 splits per pass (16 splits padded), head masks (24 heads); splits with no valid entry, rows with
    none, a sink; every output element written (poisoned before)."""
    from dsa.mla.kernel import _sparse_mla_combine_kernel, combine_config

    g = torch.Generator(device="cpu").manual_seed(T * 100 + ns)
    o_part = torch.randn(ns, T, h_q, D_V, generator=g).to(DEVICE)
    lse_part = (torch.randn(ns, T, h_q, generator=g) * 4).to(DEVICE)
    lse_part[torch.rand(ns, T, h_q, generator=g).to(DEVICE) < 0.3] = -math.inf
    lse_part[:, 1, 2] = -math.inf  # a row with no valid entry
    ml_part = torch.where(lse_part == -math.inf, -math.inf, lse_part - torch.rand(ns, T, h_q, generator=g).to(DEVICE))
    sink = torch.randn(h_q, generator=g).to(DEVICE)
    out = poison_(torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=DEVICE))
    ml, lse = poison_(torch.empty(T, h_q, device=DEVICE)), poison_(torch.empty(T, h_q, device=DEVICE))
    cfg = combine_config(T, h_q, ns)
    assert (cfg["BLOCK_H"], cfg["SB"] == cfg["NS_PAD"]) == form, cfg  # (heads per program, one pass)
    _sparse_mla_combine_kernel[(T, triton.cdiv(h_q, cfg["BLOCK_H"]), 1)](
        o_part, lse_part, ml_part, sink, out, out.stride(0), out.stride(1), ml, lse, lse, T, h_q, ns, D=D_V,
        HAS_SINK=True, **cfg)
    m = lse_part.max(0).values
    empty = m == -math.inf
    m_use = torch.where(empty, 0.0, m)
    w = torch.exp2(lse_part - m_use)
    sumw = w.sum(0)
    denom = sumw + torch.where(empty, 0.0, torch.exp2(sink * math.log2(math.e) - m_use))
    inv = torch.where(empty, 0.0, 1.0 / torch.where(empty, 1.0, denom))
    want = ((w[..., None] * o_part).sum(0) * inv[..., None]).to(torch.bfloat16)
    torch.testing.assert_close(out.float(), want.float(), rtol=2 ** -7, atol=1e-5)
    lse_want = (m_use + torch.log2(torch.where(empty, 1.0, sumw))) * math.log(2)
    torch.testing.assert_close(lse, torch.where(empty, math.inf, lse_want))
    torch.testing.assert_close(ml, torch.where(empty, -math.inf, ml_part.max(0).values * math.log(2)))
    assert (out[1, 2] == 0).all()


@pytest.mark.parametrize("h_q", [8, 16, 24, 32, 64, 72, 128])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_kernel_heads(h_q, kv_format):
    """Every head count (multiples of 8, non-powers of two, two head groups), odd topk."""
    T = 2 if h_q >= 64 else 3
    q, kv, idx, sm, sink, tl_ = make_case(T, h_q, 37, 90, kv_format, seed=h_q, empty_rows=(1,))
    got, want, vmax = run_both(q, kv, idx, sm, sink, tl_)
    assert_matches(got, want, vmax, f"h_q={h_q} {kv_format}")
    assert (got[0][1] == 0).all() and (got[2][1] == math.inf).all() and (got[1][1] == -math.inf).all()


@pytest.mark.parametrize("h_q,kv_format", [(72, "bf16"), (96, "fp8_ds_mla")])
def test_sliced_heads(h_q, kv_format):
    """More than 64 heads run as two slices (``slice_heads``: 64 k heads, then the rest as a small group) compute
    the same function: invalid entries, an empty row, topk_length, a sink (each slice its own part), NaN in unused
    slots, a poisoned ``out`` padded on both sides; max_logits and lse for every head."""
    T, topk, S = 3, 70, 150
    q, kv, idx, sm, sink, tl_ = make_case(T, h_q, topk, S, kv_format, seed=h_q + 1, empty_rows=(1,), with_len=True,
                                          with_sink=True)
    tl_[0] = topk
    big = poison_(torch.empty(T, h_q, D_V + 64, dtype=torch.bfloat16, device=q.device))
    out = big[:, :, 32:32 + D_V]
    got = sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, sink, tl_, out, config=dict(slice_heads=True))
    assert got[0] is out and got[1].shape == (T, h_q) and got[2].shape == (T, h_q)
    assert torch.isnan(big[:, :, :32].float()).all() and torch.isnan(big[:, :, 32 + D_V:].float()).all()
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, S),
                   f"h_q={h_q} {kv_format}")
    assert (got[0][1] == 0).all() and (got[2][1] == math.inf).all() and (got[1][1] == -math.inf).all()


def test_slice_rule():
    """Which calls run their heads as two slices by default (on sm_90): more than 64 heads whose last 64-head
    group would hold at most 32 real ones, from ``SLICE_MIN_T`` tokens (fewer over the fp8 cache)."""
    from dsa.mla.kernel import SLICE_MIN_T, slice_pays

    for fp8 in (False, True):
        T = SLICE_MIN_T[fp8]
        assert [h for h in range(8, 129, 8) if slice_pays(T, h, fp8)] == [72, 80, 88, 96]
        assert not slice_pays(T - 1, 96, fp8) and slice_pays(4096, 72, fp8)
    assert SLICE_MIN_T[True] < SLICE_MIN_T[False]


def paged_case(T, h_q, topk, S, pages, seed, *, block_size=None, with_len=True):
    """A case whose valid entries fall in the given pages of :data:`dsa.mla.compact.PAGE_ROWS` slots only (as a
    prefill's read its requests' pages of an engine's pool): -1 / >= S entries scattered, duplicates, row 1 empty,
    NaN in every slot not read (the other pages, and the slots of these pages that no entry names)."""
    from dsa.mla.compact import PAGE_ROWS

    g = gen(seed)
    pages = torch.tensor(pages, dtype=torch.int64)
    idx = pages[torch.randint(0, len(pages), (T, topk), generator=g)] * PAGE_ROWS
    idx = (idx + torch.randint(0, PAGE_ROWS, (T, topk), generator=g)).clamp(max=S - 1)
    bad = torch.rand(T, topk, generator=g) < 0.2
    bad_vals = torch.tensor([-1, -7, S, S + 13, INT32_MAX], dtype=torch.int64)
    idx[bad] = bad_vals[torch.randint(0, len(bad_vals), (int(bad.sum()),), generator=g)]
    idx[:, topk // 2] = idx[:, 1]
    if T > 1:
        idx[1] = -1
    idx = idx.to(torch.int32)
    used = torch.zeros(S, dtype=torch.bool)
    used[idx[(idx >= 0) & (idx < S)].long()] = True
    kv = make_cache(S, "fp8_ds_mla", g, used, block_size=block_size)
    q = torch.randn(T, h_q, D_QK, generator=g).to(torch.bfloat16)
    topk_length = torch.randint(0, topk + 1, (T,), generator=g, dtype=torch.int32) if with_len else None
    sink = (torch.randn(h_q, generator=g) * 2).float()
    return [None if x is None else x.to(DEVICE) for x in (q, kv, idx, topk_length, sink)]


@pytest.mark.parametrize("with_len", [False, True])
def test_compact(with_len, monkeypatch):
    """:func:`dsa.mla.compact.compact`: the bf16 copy of the pages a call reads (among them the cache's last page, cut
    short) and the lists remapped onto it, bitwise the reference's (the copy's NaN rows included), with the flag that
    says whether it is taken: where the pages fit the bound on its rows, the copy's first rows hold them and the rest
    stay unwritten; where they do not (or there is no valid entry at all), the copy stays unwritten. Every valid
    entry names its own slot's dequantised row in the copy, every other entry -1. Every tensor the call allocates
    starts poisoned (7.0 / -12345: not NaN, which the copy holds legitimately), so each element compared was written,
    and each left alone was not."""
    from dsa.mla.compact import PAGE_ROWS, compact, compact_ref

    empty = torch.empty
    def poisoned(*a, **k):
        t = empty(*a, **k)
        return t.fill_(7.0 if t.dtype.is_floating_point else 0xA5 if t.dtype == torch.uint8 else -12345)

    monkeypatch.setattr(torch, "empty", poisoned)
    S = 40 * PAGE_ROWS + 17
    pages = [3, 4, 17, 38, 40]
    q, kv, idx, tl_, _ = paged_case(6, 16, 300, S, pages, seed=11, with_len=with_len)
    kv = ref_mod.flat_kv(kv)
    want_copy, want_new = compact_ref(kv, idx, tl_)
    rows = len(pages) * PAGE_ROWS
    valid = ref_mod.valid_mask(idx.long(), S, tl_)
    for max_rows, size, taken in ((rows, rows, 1), (rows + 2 * PAGE_ROWS + 5, rows + 2 * PAGE_ROWS, 1),
                                  (rows - 1, rows - PAGE_ROWS, 0), (10 ** 9, 41 * PAGE_ROWS, 1), (0, 0, 0)):
        copy, new, flag = compact(kv, idx, tl_, max_rows)
        assert copy.shape == (size, D_QK) and new.shape == idx.shape and new.dtype == torch.int32, max_rows
        assert flag.dtype == torch.int32 and flag.tolist() == [taken], max_rows
        assert torch.equal(new, want_new)
        if taken:
            assert torch.equal(copy[:rows].view(torch.int16), want_copy.view(torch.int16))
            assert (new[~valid] == -1).all() and (new[valid] >= 0).all()
            assert torch.equal(copy[new[valid].long()].view(torch.int16),
                               dequantize_fp8_ds_mla(kv[idx[valid].long()]).view(torch.int16))
            assert (copy[rows - PAGE_ROWS + 17:rows] == 0).all()  # (past the cache's end)
        assert (copy[rows if taken else 0:] == 7.0).all(), max_rows  # (unwritten)
    none = torch.where(idx >= 0, idx + S, idx)
    copy, new, flag = compact(kv, none, tl_, rows)
    assert copy.shape == (rows, D_QK) and (new == -1).all() and flag.tolist() == [0] and (copy == 7.0).all()


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("h_q,T,splits,order", [(64, 3, None, False), (64, 5, 1, True), (64, 4, 3, False),
                                                (32, 5, 1, True), (32, 4, 3, False), (128, 5, 1, True)])
def test_skip_flag(kv_format, h_q, T, splits, order):
    """``sparse_mla_triton``'s ``skip = (flag, value)``: where the device flag holds ``value`` no kernel of the call
    writes anything (the results stay as poisoned), else the call is bitwise the plain one, with grouped lists, one
    split or several (the merge kernel) and, on Hopper, each kernel form chosen there (16/32-head groups, 64-head
    groups, the persistent ping-pong of 128 heads over bf16)."""
    q, kv, idx, sm, sink, tl_ = make_case(T, h_q, 200, 300, kv_format, seed=T + h_q, empty_rows=(1,), with_len=True,
                                          with_sink=True)
    flat = ref_mod.flat_kv(kv)
    plain = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, num_splits=splits, order=order)
    for flag, value in ((1, 1), (0, 0), (0, 1), (1, 0)):
        res = tuple(poison_(x) for x in (torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=DEVICE),
                                         torch.empty(T, h_q, device=DEVICE), torch.empty(T, h_q, device=DEVICE)))
        before = [x.clone() for x in res]
        got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, num_splits=splits, order=order,
                                skip=(torch.tensor([flag], dtype=torch.int32, device=DEVICE), value), results=res)
        assert all(a is b for a, b in zip(got, res))
        for a, b, name in zip(got, before if flag == value else plain, ("out", "max_logits", "lse")):
            assert torch.equal(a.view(torch.int16) if a.dtype == torch.bfloat16 else a.view(torch.int32),
                               b.view(torch.int16) if b.dtype == torch.bfloat16 else b.view(torch.int32)), \
                (flag, value, name)


@pytest.mark.parametrize("way,h_q", [("whole", 32), ("whole", 48), ("whole", 96), ("pages", 32), ("pages", 64)])
def test_dequant_first(way, h_q, monkeypatch):
    """A call over the fp8_ds_mla cache that runs on a bf16 copy (:func:`dsa.mla.kernel.dequant_first_pays`, forced
    here) through the public ``sparse_mla`` on a paged cache: of the whole cache (one dequantising pass, NaN rows in
    its unused slots included), bitwise the bf16 call on the reference dequantiser's copy; or of the pages the call
    reads (:mod:`dsa.mla.compact`, the copy sized by the rule's bound), bitwise the bf16 call on the reference's
    compacted copy and lists. Both against the reference: invalid entries, an empty row, topk_length, a sink, a
    poisoned ``out``. Then the pages' way again with the copy's values doubled after the read, so that the call over
    the copy and the one over the cache differ: its results are the copy's. 96 heads: the call over the copy in two
    slices, 64 heads and 32 (:func:`dsa.mla.kernel.slice_pays`, from 1 token here)."""
    import dsa.mla.kernel as K
    import dsa.mla_cache.kernel as C
    from dsa.mla.compact import PAGE_ROWS, compact_ref

    T, topk = 4, 100
    if way == "whole":
        S = 192
        q, kv, idx, sm, sink, tl_ = make_case(T, h_q, topk, S, "fp8_ds_mla", seed=h_q + 5, block_size=64,
                                              empty_rows=(1,), with_len=True, with_sink=True)
    else:
        S, sm = 9 * PAGE_ROWS + 5, 192 ** -0.5
        q, kv, idx, tl_, sink = paged_case(T, h_q, topk, S, [1, 6, 9], seed=h_q + 6, block_size=7)  # (581 = 83 x 7)
    monkeypatch.setattr(K, "_dequant_first", lambda q, kv, indices: way if kv.shape == (S, FP8_DS_MLA_ROW_BYTES)
                        else None)
    monkeypatch.setattr(K, "dequant_first_pays", lambda *a: True)
    monkeypatch.setattr(K, "dequant_first_max_rows", lambda *a: 5 * PAGE_ROWS + 3)
    monkeypatch.setattr(K, "SLICE_MIN_T", {True: 1, False: 1})
    slices = []
    sliced = K._sliced_heads
    monkeypatch.setattr(K, "_sliced_heads", lambda *a: slices.append(a[1].dtype) or sliced(*a))
    reads, scale = [], [1]
    read = C.fp8_ds_mla_read

    def counted_read(rows, out, **kw):
        reads.append(out.shape[0])
        read(rows, out, **kw)
        out.mul_(scale[0])

    monkeypatch.setattr(C, "fp8_ds_mla_read", counted_read)
    out = poison_(torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=q.device))
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, out=out, backend="triton")
    if way == "whole":
        copy, lists = dequantize_fp8_ds_mla(ref_mod.flat_kv(kv)), idx  # (the reference dequantiser, NaN rows and all)
    else:
        copy, lists = compact_ref(ref_mod.flat_kv(kv), idx, tl_)
        assert copy.shape[0] == 3 * PAGE_ROWS
    assert got[0] is out and reads == [S if way == "whole" else 5 * PAGE_ROWS]
    hopper = K.kernel_sm90 is not None and K.kernel_sm90.supported(q, copy, 64)  # (slices serve the Hopper kernels)
    assert slices == ([torch.bfloat16] if h_q == 96 and hopper else [])  # (the copy's call; the cache's never)
    same = sparse_mla_triton(q, copy, lists, sm, D_V, sink, tl_)
    for a, b, name in zip(got, same, ("out", "max_logits", "lse")):
        assert torch.equal(a, b), name
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, S),
                   f"h_q={h_q}")
    assert (got[0][1] == 0).all() and (got[2][1] == math.inf).all()
    if way == "pages":
        scale[0] = 2
        got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, backend="triton")
        same = sparse_mla_triton(q, copy * 2, lists, sm, D_V, sink, tl_)
        for a, b, name in zip(got, same, ("out", "max_logits", "lse")):
            assert torch.equal(a, b), name


def test_dequant_first_pages_declined(monkeypatch):
    """Where the pages a call reads make too big a copy for the rule's bound (known on the device only), the call runs
    on the fp8 kernels as if no copy had been tried: bitwise the same results, with the copy's values (unread)
    doubled to tell the ways apart."""
    import dsa.mla.kernel as K
    import dsa.mla_cache.kernel as C
    from dsa.mla.compact import PAGE_ROWS

    S = 9 * PAGE_ROWS + 5
    q, kv, idx, tl_, sink = paged_case(3, 64, 100, S, [0, 9], seed=3)
    plain = sparse_mla(q, kv, idx, 0.1, attn_sink=sink, topk_length=tl_, backend="triton")
    read = C.fp8_ds_mla_read
    monkeypatch.setattr(C, "fp8_ds_mla_read", lambda rows, out, **kw: (read(rows, out, **kw), out.mul_(2)))
    monkeypatch.setattr(K, "_dequant_first", lambda q, kv, indices: "pages")
    monkeypatch.setattr(K, "dequant_first_max_rows", lambda *a: 2 * PAGE_ROWS - 1)
    got = sparse_mla(q, kv, idx, 0.1, attn_sink=sink, topk_length=tl_, backend="triton")
    for a, b, name in zip(got, plain, ("out", "max_logits", "lse")):
        assert torch.equal(a, b), name


def test_dequant_first_rule():
    """Which calls over the fp8_ds_mla cache run on a bf16 copy of ``rows`` of its rows (on sm_90): more than 16 heads,
    at least ``ORDER_MIN_T`` tokens, at least ``DEQUANT_FIRST_MIN_RATIO`` gathered rows per copied row (more at 32 heads
    or fewer, fewer past 64), a copy of at most ``DEQUANT_FIRST_MAX_BYTES``, as measured; the bound on the rows is the
    rule's."""
    from dsa.mla.kernel import DEQUANT_FIRST_MAX_BYTES, ORDER_MIN_T, dequant_first_max_rows, dequant_first_pays

    measured = (4096, 2048, 131072)  # T, topk, rows (BENCHMARKS.md, fifty-third and fifty-fourth sessions)
    assert [h for h in range(8, 129, 8) if dequant_first_pays(measured[0], h, *measured[1:])] == list(range(24, 129, 8))
    assert dequant_first_pays(4096, 32, 2048, 131072) and not dequant_first_pays(4096, 32, 2048, 131073)
    assert not dequant_first_pays(4096, 32, 2048, 262144)  # (measured: no gain left at 32 rows per copied row)
    assert dequant_first_pays(4096, 64, 2048, 393216) and dequant_first_pays(4096, 128, 2048, 400000)
    # (more than 64 heads: at least 8 rows per copied row; 33-64: 16; measured in the fifty-sixth session)
    assert dequant_first_pays(1024, 128, 2048, 262144) and not dequant_first_pays(1024, 128, 2048, 262145)
    assert dequant_first_pays(1024, 72, 2048, 262144) and not dequant_first_pays(1024, 64, 2048, 131073)
    assert dequant_first_pays(1024, 64, 2048, 16384) and dequant_first_pays(4096, 32, 2048, 16384)  # (small copies)
    assert not dequant_first_pays(4096, 128, 2048, DEQUANT_FIRST_MAX_BYTES // (D_QK * 2) + 1)  # too big a copy
    assert not dequant_first_pays(ORDER_MIN_T - 1, 128, 2048, 1024)  # decode batches
    assert not dequant_first_pays(4096, 128, 2048, 0)
    for T, h_q, topk in ((4096, 128, 2048), (4096, 32, 2048), (1024, 64, 2048), (600, 64, 100), (4096, 16, 2048),
                         (ORDER_MIN_T - 1, 128, 2048)):
        m = dequant_first_max_rows(T, h_q, topk)
        assert m == 0 or (dequant_first_pays(T, h_q, topk, m) and not dequant_first_pays(T, h_q, topk, m + 1))
        assert (m == 0) == (not dequant_first_pays(T, h_q, topk, 1))
    assert dequant_first_max_rows(4096, 128, 2048) == DEQUANT_FIRST_MAX_BYTES // (D_QK * 2)


def test_dequant_first_ways(monkeypatch):
    """Which copy a call over the fp8_ds_mla cache takes where the Hopper kernels serve it: the whole cache where
    :func:`dequant_first_pays` accepts its size; else the pages the call reads, tried with at least
    ``DEQUANT_FIRST_PAGES_MIN_WORK`` tokens x heads (more than 16 heads), not where the heads are sliced, and while a
    CUDA graph is being captured too (nothing is read back to the host); else none."""
    import dsa.mla.kernel as K
    from dsa.mla.kernel import ORDER_MIN_T

    class Hopper:
        supported = staticmethod(lambda q, kv, block_h: True)

    monkeypatch.setattr(K, "kernel_sm90", Hopper)

    def way(T, h_q, S, topk=2048):
        return K._dequant_first(torch.empty(T, h_q, 0), torch.empty(S, 0), torch.empty(T, topk))

    pool = 1 << 21  # (2M rows: a copy of 2.3 GB)
    assert way(4096, 32, 131072) == "whole" and way(4096, 128, 400000) == "whole" and way(1024, 64, 16384) == "whole"
    assert way(1024, 128, 262144) == "whole" and way(1024, 64, 262144) is None  # (8 / 16 rows per copied row)
    assert way(4096, 128, pool) == way(2048, 64, pool) == way(1024, 128, pool) == way(2048, 64, 400000) == "pages"
    assert way(2048, 112, pool) == way(4096, 40, pool) == "pages"
    assert way(2048, 72, pool) is None and way(4096, 96, pool) is None  # (sliced heads: 64 + the rest)
    assert way(4096, 16, pool) is None and way(4096, 16, 131072) is None  # (16 heads: never)
    assert way(8192, 32, pool) == way(4096, 32, 262144) == way(6144, 24, 262144) == "pages"
    assert way(2047, 64, pool) is None and way(1023, 128, pool) is None  # (too little work for the pages' cost)
    assert way(4095, 32, pool) is None
    assert way(ORDER_MIN_T - 1, 128, pool) is None


@pytest.mark.parametrize("topk", [1, 64, 100, 130])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_kernel_topk_tails(topk, kv_format):
    q, kv, idx, sm, sink, tl_ = make_case(3, 16, topk, 200, kv_format, seed=topk, frac_invalid=0.3)
    got, want, vmax = run_both(q, kv, idx, sm, sink, tl_)
    assert_matches(got, want, vmax, f"topk={topk} {kv_format}")


class _Launched(Exception):
    """Raised by :func:`test_target_configs_dispatch`'s stand-in kernel with the launch's keyword arguments."""


@pytest.mark.parametrize("target", sorted(TARGET_CONFIGS, key=str))
def test_target_configs_dispatch(target, monkeypatch):
    """On each GPU of :data:`dsa.mla.kernel.TARGET_CONFIGS` the public call launches that GPU's configurations:
    every case (format, head group, few tokens) changed as its entry says, and no other. (The kernel is not run
    here; :func:`test_target_configs_compute_the_same` runs the configurations.)"""
    import dsa.mla.kernel as mk

    class Kernel:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                raise _Launched(kwargs)

            return launch

    monkeypatch.setattr(mk.backend, "gpu_target", lambda device: target)
    monkeypatch.setattr(mk, "_sparse_mla_fwd_kernel", Kernel())
    monkeypatch.setattr(mk, "kernel_sm90", None)  # (on the H200) as on those GPUs: no Hopper kernels
    monkeypatch.setattr(mk, "kernel_bulk", None)
    changes = mk.TARGET_CONFIGS[target]
    assert changes and set(changes) <= set(mk.TARGET_CASES)
    taken = set()
    for kv_format in ("bf16", "fp8_ds_mla"):
        is_fp8 = kv_format != "bf16"
        for h_q in (8, 16, 24, 32, 64, 128):
            for T in (1, 12):
                q, kv, idx, sm, _, _ = make_case(T, h_q, 70, 100, kv_format, seed=h_q + T)
                with pytest.raises(_Launched) as launched:
                    sparse_mla(q, kv, idx, sm, backend="triton")
                k = launched.value.args[0]
                bh = block_h_for(h_q)
                case = (is_fp8, bh, is_fp8 and bh == 16 and T <= 8)
                want = dict(mk.default_config(h_q, is_fp8, T), **changes.get(case, {}))
                assert (k["BLOCK_H"], k["BLOCK_N"], k["num_warps"], k["num_stages"], k["PREFETCH"]) == (
                    want["block_h"], want["block_n"], want["num_warps"], want["num_stages"],
                    want["prefetch"] and is_fp8), (target, case)
                taken.add(case)
    assert set(changes) <= taken


def test_h200_configs_unchanged_by_targets():
    """The H200 (and any GPU without an entry, or no GPU) keeps the measured configurations: sm_90 has no entry."""
    import dsa.mla.kernel as mk

    assert ("cuda", 90) not in mk.TARGET_CONFIGS
    for is_fp8, bh, small_t in mk.TARGET_CASES:
        T = 1 if small_t else 64
        assert mk.default_config(bh, is_fp8, T, ("cuda", 90)) == mk.default_config(bh, is_fp8, T)


def _target_config_variants():
    """The distinct launch configurations of :data:`dsa.mla.kernel.TARGET_CONFIGS` as the CPU interpreter runs
    them (warps and stages do not change its arithmetic): ``(fp8 cache, h_q, config)``."""
    from dsa.mla.kernel import default_config

    out = {}
    for changes in TARGET_CONFIGS.values():
        for (is_fp8, bh, small_t), change in changes.items():
            cfg = dict(default_config(bh, is_fp8, 1 if small_t else 64), **change)
            out[(is_fp8, bh, cfg["block_h"], cfg["block_n"], cfg["prefetch"])] = (is_fp8, 2 * bh, cfg)
    return [out[k] for k in sorted(out)]


@pytest.mark.parametrize("is_fp8,h_q,config", _target_config_variants())
def test_target_configs_compute_the_same(is_fp8, h_q, config):
    """Each configuration :data:`dsa.mla.kernel.TARGET_CONFIGS` gives a GPU against the reference, with two head
    groups of the case's size per token: one token (split) and three, invalid and out-of-range indices, an empty
    row, ragged ``topk_length``, a sink, NaN in unused cache slots, poisoned outputs."""
    kv_format = "fp8_ds_mla" if is_fp8 else "bf16"
    for T in (1, 3):
        q, kv, idx, sm, sink, tl_ = make_case(T, h_q, 150, 260, kv_format, seed=h_q + T, with_len=True,
                                              with_sink=True, empty_rows=(2,) if T == 3 else ())
        want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
        out = poison_(torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=q.device))
        got = sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, sink, tl_, out, config=dict(config, gluon=False))
        assert_matches(got, want, max_abs_v(kv, idx, 260), f"T={T} {config}")


@pytest.mark.parametrize("num_splits", [1, 2, 3, 5, 11, 64])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_kernel_split_k(num_splits, kv_format):
    """The split-K path (partials + combine) with topk_length, sink and empty rows, forced on and off; 11 asks
    for more splits than there are tiles (fp8: 10 splits of 32 rows; bf16 clamps to its 5 tiles); 64 (of 1300
    entries: one tile per split, 21 bf16 / 41 fp8 splits) for more than the merge loads in one round trip (16),
    so it loops over groups of 8."""
    topk = 1300 if num_splits > 16 else 300
    q, kv, idx, sm, sink, tl_ = make_case(4, 16, topk, 400, kv_format, seed=10 + num_splits, empty_rows=(3,),
                                          with_len=True, with_sink=True)
    tl_[0] = topk
    tl_[1] = 65  # the second tile holds one entry: later splits are empty
    got, want, vmax = run_both(q, kv, idx, sm, sink, tl_, num_splits=num_splits)
    assert_matches(got, want, vmax, f"splits={num_splits} {kv_format}")
    assert (got[0][3] == 0).all() and (got[2][3] == math.inf).all()


@pytest.mark.parametrize("config", [dict(block_n=32, num_stages=3), dict(block_h=16, num_warps=4), dict(block_n=16),
                                    dict(block_h=16, num_warps=8), dict(num_stages=1),
                                    dict(prefetch=False), dict(block_h=16, block_n=16, prefetch=True),
                                    dict(block_n=64, prefetch=True)])
def test_kernel_configs(config):
    """Other launch configurations (as the benchmark sweeps them) compute the same function."""
    q, kv, idx, sm, sink, tl_ = make_case(2, 32, 77, 150, "fp8_ds_mla", seed=4, with_len=True, with_sink=True)
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    out = poison_(torch.empty(2, 32, D_V, dtype=torch.bfloat16, device=q.device))
    got = sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, sink, tl_, out, config=config)
    assert got[0] is out
    assert_matches(got, want, max_abs_v(kv, idx, 150), str(config))


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("h_q", [64, 24])
def test_fitting_configs_compute_the_same(kv_format, h_q):
    """Every configuration the shared-memory fallback may take (:func:`dsa.mla.kernel.fitting_configs`: fewer
    stages, smaller row tiles, fewer heads per program) against the reference: invalid and out-of-range indices,
    an empty row, ragged ``topk_length``, a sink, NaN in unused cache slots, poisoned outputs."""
    from dsa.mla.kernel import default_config, fitting_configs

    T, topk, S = 3, 150, 260
    q, kv, idx, sm, sink, tl_ = make_case(T, h_q, topk, S, kv_format, seed=h_q, empty_rows=(1,), with_len=True,
                                          with_sink=True)
    tl_[0] = topk
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    cands = fitting_configs(default_config(h_q, kv_format != "bf16", T))
    assert len(cands) >= 4
    for c in cands:
        out = poison_(torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=q.device))
        got = sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, sink, tl_, out, config=dict(c, gluon=False))
        assert got[0] is out
        assert_matches(got, want, max_abs_v(kv, idx, S), str(c))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_rising_logits(num_splits):
    """Logits that keep rising along the index list (about 4 log2 units per 16 entries), so the online
    softmax rescales at every tile; whole and split, against the reference (out, lse, max_logits)."""
    g = gen(21)
    T, H, topk, S = 1, 16, 256, 300
    sm = 192**-0.5
    q0 = torch.randn(D_QK, generator=g)
    q = (q0[None, None, :] + 0.1 * torch.randn(T, H, D_QK, generator=g)).to(torch.bfloat16)
    a = 0.25 * torch.arange(topk, dtype=torch.float32) / (sm * LOG2E)  # target logit of entry j, log2 units 0.25 j
    kv = torch.randn(S, D_QK, generator=g) * 0.5
    kv[:topk] += a[:, None] * q0[None, :] / q0.square().sum()
    kv[topk:] = float("nan")  # never indexed
    idx = torch.arange(topk, dtype=torch.int32)[None, :].clone()
    idx[0, 40] = -1
    idx[0, 200] = S + 5
    q, kv, idx = q.to(DEVICE), kv.to(torch.bfloat16).to(DEVICE), idx.to(DEVICE)
    out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=DEVICE))
    got = sparse_mla_triton(q, kv, idx, sm, D_V, None, None, out, num_splits=num_splits,
                            config=dict(block_h=16, block_n=16))
    want = sparse_mla_ref(q, kv, idx, sm)
    logits = (q.float() @ kv[:topk].float().T) * sm * LOG2E  # [T, H, topk]
    assert float(logits[0, :, 200:].max() - logits[0, :, :16].max()) > 40  # the max keeps moving
    assert_matches(got, want, max_abs_v(kv, idx, S), f"splits={num_splits}")


@pytest.mark.parametrize("block_size", [1, 16, 64, 256])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
def test_public_paged(block_size, kv_format):
    """Public wrapper on paged caches, topk_length and sink, out= poisoned, auto work split."""
    S = 512
    q, kv, idx, sm, sink, tl_ = make_case(2, 32, 70, S, kv_format, seed=block_size, block_size=block_size,
                                          with_len=True, with_sink=True, empty_rows=(0,) if block_size == 16 else ())
    out = poison_(torch.empty(2, 32, D_V, dtype=torch.bfloat16, device=q.device))
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, out=out, backend="triton")
    assert got[0] is out
    want = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, backend="reference")
    assert_matches(got, want, max_abs_v(kv, idx, S), f"bs={block_size} {kv_format}")


def test_kernel_strided_q_and_out():
    """q and out with padded strides (last dim contiguous) are read and written in place."""
    q, kv, idx, sm, sink, tl_ = make_case(3, 16, 50, 100, "bf16", seed=3)
    q_big = torch.randn(3, 20, 640, device=q.device).to(torch.bfloat16)
    q_big[:, 2:18, :D_QK] = q
    q_view = q_big[:, 2:18, :D_QK]
    out_big = poison_(torch.empty(3, 16, 600, dtype=torch.bfloat16, device=q.device))
    out_view = out_big[:, :, 50:50 + D_V]
    got = sparse_mla(q_view, kv, idx, sm, out=out_view, backend="triton")
    assert got[0] is out_view
    want = sparse_mla_ref(q, kv, idx, sm)
    assert_matches(got, want, max_abs_v(kv, idx, 100))
    assert torch.isnan(out_big[:, :, :50].float()).all() and torch.isnan(out_big[:, :, 50 + D_V:].float()).all()


def test_kernel_all_invalid_and_lonely():
    """Whole rows of invalid entries, rows with a single valid entry, topk_length 0."""
    T, H, topk, S = 4, 16, 40, 60
    q, kv, idx, sm, _, _ = make_case(T, H, topk, S, "fp8_ds_mla", seed=8, empty_rows=(0, 2))
    idx[1] = -1
    idx[1, 17] = 5  # lonely
    tl_ = torch.tensor([topk, topk, topk, 0], dtype=torch.int32, device=q.device)
    kv_flat = ref_mod.flat_kv(kv)
    vals, scales, rope = fp8_ds_mla_views(kv_flat)
    # slot 5 used now: seeded, and e4m3 values below 32 (bytes < 0x60), so that the logit's fp32 rounding (which
    # scales with sum |q k|) stays well inside the lse tolerance; bytes up to 0x7E (448) made it exceed 2e-5 on the
    # H200 for some unseeded draws
    g = gen(81)
    vals.view(torch.uint8)[5] = torch.randint(0, 0x60, (512,), generator=g, dtype=torch.uint8).to(q.device)
    scales[5] = 0.25
    rope[5] = torch.randn(64, generator=g).to(torch.bfloat16).to(q.device)
    for ns in (1, 2):
        got, want, vmax = run_both(q, kv, idx, sm, None, tl_, num_splits=ns)
        assert_matches(got, want, vmax, f"lonely ns={ns}")
        for t in (0, 2, 3):
            assert (got[0][t] == 0).all() and (got[2][t] == math.inf).all() and (got[1][t] == -math.inf).all()
        # one valid entry: weight exactly 1, out = v rounded; lse = max_logits
        torch.testing.assert_close(got[2][1], got[1][1], atol=1e-5, rtol=1e-6)
        v5 = dequantize_fp8_ds_mla(kv_flat[5:6])[0, :D_V].float()
        torch.testing.assert_close(got[0][1].float(), v5.expand(H, -1), atol=0, rtol=2.0**-8)


def test_cluster_size():
    """Which split-K calls the Hopper kernel merges inside (a cluster per (token, head group)): 16/32-head groups,
    2-16 splits rounded up to a power of two (8 at most below 132 SMs), clusters of 2 or at most half the SMs in
    CTAs; forced: whenever the size allows; else the merge kernel."""
    from dsa.mla.kernel import cluster_size

    assert cluster_size(16, 1, 16, 132) == 16 and cluster_size(3, 4, 32, 132) == 4 and cluster_size(5, 2, 16, 132) == 8
    assert cluster_size(16, 4, 16, 132) == 16 and cluster_size(16, 5, 16, 132) == 0  # 64 / 80 CTAs
    assert cluster_size(2, 66, 16, 132) == 2 and cluster_size(4, 32, 32, 132) == 0 and cluster_size(8, 16, 16, 132) == 0
    assert cluster_size(1, 1, 16, 132) == 0 and cluster_size(17, 1, 16, 132) == 0 and cluster_size(64, 1, 16, 132) == 0
    assert cluster_size(16, 1, 64, 132) == 0 and cluster_size(16, 1, 64, 132, force=True) == 16
    assert cluster_size(16, 100, 16, 132, force=True) == 16 and cluster_size(16, 1, 16, 78, force=True) == 0
    assert cluster_size(8, 4, 16, 78) == 8
    # with the GPU's count of clusters that run at once (the H200's 66 / 30 / 15 / 7 clusters of 2 / 4 / 8 / 16)
    fits = {2: 66, 4: 30, 8: 15, 16: 7}.get
    assert cluster_size(16, 7, 16, 132, max_clusters=fits) == 16
    assert cluster_size(16, 8, 16, 132, max_clusters=fits) == 0
    assert cluster_size(4, 30, 16, 132, max_clusters=fits) == 4 and cluster_size(4, 31, 32, 132, max_clusters=fits) == 0
    assert cluster_size(5, 15, 32, 132, max_clusters=fits) == 8 and cluster_size(8, 16, 16, 132, max_clusters=fits) == 0
    assert cluster_size(8, 2, 64, 132, max_clusters=fits) == 0 and cluster_size(2, 66, 16, 132, max_clusters=fits) == 2
    unknown = lambda n: None  # noqa: E731  (the driver could not say: at most half the SMs in CTAs)
    assert cluster_size(4, 16, 16, 132, max_clusters=unknown) == 4
    assert cluster_size(4, 17, 16, 132, max_clusters=unknown) == 0


def test_no_clusters_option():
    """conftest's ``--no-clusters`` (the sanitizer run's racecheck and synccheck jobs) takes the in-kernel cluster merge
    away in every test: there :func:`test_cluster_size` fails, its first cluster gone."""
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "--tb=short", "-p", "no:cacheprovider", "--no-clusters",
                        f"{__file__}::test_cluster_size"], capture_output=True, text=True,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert r.returncode == 1 and " failed" in r.stdout and " passed" not in r.stdout, r.stdout
    assert "assert cluster_size(16, 1, 16, 132) == 16" in r.stdout, r.stdout  # (its first assertion)


def test_choose_num_splits():
    """Arguments: T, head groups, topk, SMs, BLOCK_N."""
    assert choose_num_splits(4096, 2, 2048, 132, 64) == 1  # prefill fills the GPU
    assert choose_num_splits(256, 2, 2048, 132, 64) == 1  # decode batch 128 x s_q 2
    assert choose_num_splits(2, 2, 2048, 132, 64) > 1  # few tokens: split the index list
    assert choose_num_splits(1, 1, 64, 132, 64) == 1  # a single tile cannot be split
    # small head counts (one head group per token): about 2 (4 with 16-row tiles) programs per SM
    assert choose_num_splits(64, 1, 2048, 132, 64) == 4
    assert choose_num_splits(64, 1, 2048, 132, 16) == 8
    assert choose_num_splits(128, 1, 2048, 132, 32) == 2
    assert choose_num_splits(1, 1, 2048, 132, 64) == 16  # capped: chunks of at least two tiles


# ----------------------------------------------------------------------------------------------
# argument checks (before any launch)
# ----------------------------------------------------------------------------------------------
def _good(device="cpu"):
    q = torch.randn(2, 16, D_QK).to(torch.bfloat16)
    kv = torch.randn(32, D_QK).to(torch.bfloat16)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    return dict(q=q, kv=kv, indices=idx, sm_scale=0.1)


@pytest.mark.parametrize(
    "change, exc, words",
    [
        (dict(q=torch.randn(2, 12, D_QK).to(torch.bfloat16)), ValueError, ["q", "h_q=12"]),
        (dict(q=torch.randn(2, 136, D_QK).to(torch.bfloat16)), ValueError, ["q", "h_q=136"]),
        (dict(q=torch.randn(2, 16, 512).to(torch.bfloat16)), ValueError, ["q", "576", "512"]),
        (dict(q=torch.randn(2, 16, D_QK)), TypeError, ["q", "bfloat16", "float32"]),
        (dict(q=torch.randn(2, D_QK).to(torch.bfloat16)), ValueError, ["q", "3 dims"]),
        (dict(kv=torch.randn(32, D_QK)), TypeError, ["kv", "float32"]),
        (dict(kv=torch.randn(32, 512).to(torch.bfloat16)), ValueError, ["kv", "576"]),
        (dict(kv=torch.zeros(32, 576, dtype=torch.uint8)), ValueError, ["kv", "656"]),
        (dict(kv=torch.zeros(4, 8, 2, 656, dtype=torch.uint8)), ValueError, ["kv", "656"]),
        (dict(kv=torch.randn(64, D_QK).to(torch.bfloat16)[::2]), ValueError, ["kv", "contiguous"]),
        (dict(indices=torch.zeros(2, 8, dtype=torch.int64)), TypeError, ["indices", "int32", "int64"]),
        (dict(indices=torch.zeros(3, 8, dtype=torch.int32)), ValueError, ["indices", "[3, 8]"]),
        (dict(indices=torch.zeros(2, 0, dtype=torch.int32)), ValueError, ["indices", "topk"]),
        (dict(sm_scale=torch.tensor(0.1)), TypeError, ["sm_scale"]),
        (dict(sm_scale=float("nan")), ValueError, ["sm_scale", "nan"]),
        (dict(sm_scale=float("inf")), ValueError, ["sm_scale", "inf"]),
        (dict(sm_scale=0.0), ValueError, ["sm_scale", "> 0"]),
        (dict(d_v=448), ValueError, ["d_v", "512", "448"]),
        (dict(attn_sink=torch.zeros(8)), ValueError, ["attn_sink", "[16]"]),
        (dict(attn_sink=torch.zeros(16, dtype=torch.float64)), TypeError, ["attn_sink", "float32"]),
        (dict(topk_length=torch.zeros(2, dtype=torch.int64)), TypeError, ["topk_length", "int32"]),
        (dict(topk_length=torch.zeros(5, dtype=torch.int32)), ValueError, ["topk_length", "[2]"]),
        (dict(out=torch.zeros(2, 16, D_V)), TypeError, ["out", "bfloat16"]),
        (dict(out=torch.zeros(2, 16, 256, dtype=torch.bfloat16)), ValueError, ["out", "512"]),
        (dict(backend="cuda-magic"), ValueError, ["backend"]),
    ],
)
def test_validation(change, exc, words):
    args = _good()
    args.update(change)
    with pytest.raises(exc) as info:
        sparse_mla(**args)
    for w in words:
        assert w in str(info.value), (w, str(info.value))


def test_validation_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device")
    args = _good()
    args["indices"] = args["indices"].cuda()
    with pytest.raises(ValueError, match="indices"):
        sparse_mla(**args)


# ----------------------------------------------------------------------------------------------
# GPU: larger shapes
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("shape", [(64, 128, 2048, 1 << 17), (4, 16, 2048, 1 << 16), (3, 64, 1000, 5056), (33, 8, 513, 8960),
                                   (40, 32, 2048, 1 << 16)])
def test_gpu_large(kv_format, shape):
    T, H, topk, S = shape
    q, kv, idx, sm, sink, tl_ = make_case(T, H, topk, S, kv_format, seed=T + H, block_size=64, with_len=True,
                                          with_sink=True, empty_rows=(1,))
    tl_[0] = topk
    out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=q.device))
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, out=out)
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(got, want, max_abs_v(kv, idx, S), f"{shape} {kv_format}")
    for ns in (1, 4):
        got = sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, sink, tl_, None, num_splits=ns)
        assert_matches(got, want, max_abs_v(kv, idx, S), f"{shape} {kv_format} ns={ns}")


@pytest.mark.gpu
@pytest.mark.parametrize("n_pages", [100, 600])
def test_gpu_dequant_first_pages_graph(n_pages):
    """The pages' way at a prefill shape, as the rule dispatches it (no patching): 1024 tokens x 128 heads over a cache
    too large to copy whole, reading 100 pages (taken: bitwise the bf16 call on the reference's copy) or 600 (over the
    bound of 32768 rows: bitwise the fp8 kernels); then captured in a CUDA graph (nothing is read back to the host)
    and replayed on new queries, bitwise the eager call on them."""
    import dsa.mla.kernel as K
    from dsa.mla.compact import PAGE_ROWS, compact_ref

    skip_unless_hopper()  # (the rule serves the Hopper kernels)
    T, h_q, topk, S = 1024, 128, 256, 40000
    pages = torch.randperm(S // PAGE_ROWS, generator=gen(n_pages))[:n_pages].tolist()
    q, kv, idx, tl_, sink = paged_case(T, h_q, topk, S, pages, seed=n_pages, block_size=64)
    flat = ref_mod.flat_kv(kv)
    assert K.dequant_first_max_rows(T, h_q, topk) == 32768 and K._dequant_first(q, flat, idx) == "pages"
    sm = 192 ** -0.5
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    if n_pages * PAGE_ROWS <= 32768:
        copy, lists = compact_ref(flat, idx, tl_)
        same = sparse_mla_triton(q, copy, lists, sm, D_V, sink, tl_)
    else:
        keep = K._dequant_first
        K._dequant_first = lambda *a: None
        try:
            same = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_)
        finally:
            K._dequant_first = keep
    for a, b, name in zip(got, same, ("out", "max_logits", "lse")):
        assert torch.equal(a, b), name
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, S))
    q_in = q.clone()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        sparse_mla(q_in, kv, idx, sm, attn_sink=sink, topk_length=tl_)  # (warm-up on the capture stream)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = sparse_mla(q_in, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    q2 = (torch.randn(q.shape, generator=gen(n_pages + 1)) * 2).to(torch.bfloat16).to(q.device)
    q_in.copy_(q2)
    graph.replay()
    want = sparse_mla(q2, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    for a, b, name in zip(res, want, ("out", "max_logits", "lse")):
        assert torch.equal(a, b), name


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16"])  # (the bf16 rows are what Triton pipelines into shared memory)
def test_gpu_launch_fitting_after_a_real_out_of_resources(kv_format):
    """On the GPU: a portable configuration that needs more shared memory than the device has is refused by
    Triton before it launches (OutOfResources, no CUDA error left behind), and :func:`dsa._host.launch_fitting`
    takes the next one, whose result is right."""
    from triton.runtime.errors import OutOfResources

    from dsa._host import launch_fitting
    from dsa.mla.kernel import default_config, fitting_configs

    T, H, topk, S = 6, 64, 700, 5000
    q, kv, idx, sm, sink, tl_ = make_case(T, H, topk, S, kv_format, seed=3, with_len=True, with_sink=True)
    cfg = dict(default_config(H, kv_format != "bf16"), gluon=False)
    too_big = dict(cfg, num_stages=6)  # five tiles of 64 gathered rows in flight: far past 227 KiB
    tried = []

    def launch(c):
        tried.append(c)
        return sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, sink, tl_, None, config=c)

    got = launch_fitting(("test", object()), [too_big, *fitting_configs(cfg)], launch)  # a key of its own
    assert tried[0] is too_big and len(tried) == 2
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(got, want, max_abs_v(kv, idx, S), kv_format)
    with pytest.raises(OutOfResources):
        launch(too_big)
    torch.cuda.synchronize()  # nothing was launched: no error pending


def test_fitting_configs_shrink_to_16():
    from dsa.mla.kernel import default_config, fitting_configs

    cands = fitting_configs(default_config(128, False))
    assert cands[0] == default_config(128, False)
    assert [c["num_stages"] for c in cands[:3]] == [3, 2, 1]
    last = cands[-1]
    assert (last["num_stages"], last["block_n"], last["block_h"]) == (1, 16, 16)
    assert all(c["num_warps"] >= 2 for c in cands)


def _sm90_or_skip():
    from dsa.mla import kernel_sm90

    skip_unless_hopper()
    return kernel_sm90


#: cases of the 64-head Gluon kernel's tests (both schedules)
SM90_CASES = [
    dict(T=3, H=64, topk=37, S=90, empty_rows=(1,)),  # less than one tile (ping-pong: one pair, its second tile empty)
    dict(T=2, H=72, topk=130, S=300, with_len=True, with_sink=True),  # 2 head groups (the 2nd masked), 3 tiles
    dict(T=1, H=64, topk=1, S=50),
    dict(T=4, H=128, topk=300, S=400, with_len=True, with_sink=True, empty_rows=(3,), splits=3),
    dict(T=5, H=128, topk=2048, S=1 << 16, with_len=True, with_sink=True, block_size=64),
    dict(T=5, H=128, topk=2048, S=1 << 16, with_len=True, with_sink=True, block_size=64, splits=5),
    dict(T=40, H=64, topk=1000, S=5056, frac_invalid=0.5, splits=2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_CASES)
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("producer", [None, dict(early=2)])
def test_gpu_sm90_kernel(case, kv_format, producer, monkeypatch):
    """The Gluon kernel (Hopper, 64-head groups, both formats, the schedule in which both math warpgroups share each
    tile (``pingpong=False``; the default for fp8_ds_mla); the producer's default and, for fp8_ds_mla, two groups
    loaded early) against the reference: tails, head masks, splits, topk_length and sink, invalid entries
    anywhere, NaN in unused slots, poisoned out; bitwise deterministic; and the launch really took it."""
    calls = _check_sm90_case(case, kv_format, dict(producer=producer, pingpong=False), "producer", monkeypatch)
    assert calls == [producer, producer]


def _check_sm90_case(case, kv_format, config, key, monkeypatch):
    """Run one Gluon-kernel case twice into poisoned outputs with ``config``; check it against the reference and
    the Triton kernel and that reruns are bitwise equal; return the recorded ``launch`` keyword ``key`` per call."""
    kernel_sm90 = _sm90_or_skip()
    case = dict(case)
    splits = case.pop("splits", None)
    T, H, topk, S = case.pop("T"), case.pop("H"), case.pop("topk"), case.pop("S")
    q, kv, idx, sm, sink, tl_ = make_case(T, H, topk, S, kv_format, seed=T * H + topk, **case)
    if tl_ is not None:
        tl_[0] = topk
        if T > 2:
            tl_[2] = 0
    calls = record_launches(monkeypatch, kernel_sm90, key)
    flat = ref_mod.flat_kv(kv)
    outs = []
    for _ in range(2):
        out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=q.device))
        got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, out, num_splits=splits, config=config)
        assert got[0] is out
        outs.append(got)
    recorded = list(calls)
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(outs[0], want, max_abs_v(kv, idx, S), str((T, H, topk, S, splits, kv_format)))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a, b)
    portable = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, None, num_splits=splits, config=dict(gluon=False))
    assert len(calls) == 2  # the Triton kernel took that call
    assert_matches(outs[0], portable, max_abs_v(kv, idx, S), "vs the Triton kernel")
    return recorded


@pytest.mark.gpu
@pytest.mark.parametrize("case", SM90_CASES + [
    dict(T=70, H=128, topk=2048, S=1 << 15, frac_invalid=0.1),  # many programs per SM wave
])
def test_gpu_sm90_pingpong(case, monkeypatch):
    """The ping-pong schedule of the Gluon kernel (64-head groups, bf16 cache: two math warpgroups owning
    alternate tiles, one running max passed between them, buffers freed per half) against the reference and the
    Triton kernel: odd tile counts, tails, splits, topk_length, sink, invalid entries, empty rows, NaN in unused
    slots, poisoned out; bitwise deterministic; and the launch really asked for it."""
    assert _check_sm90_case(case, "bf16", dict(pingpong=True), "pingpong", monkeypatch) == [True, True]


def _record_grids(monkeypatch) -> list:
    """Wrap the Hopper kernel so that every launch appends ``(grid, PERSIST)``; returns that list."""
    kernel_sm90 = _sm90_or_skip()
    real, launched = kernel_sm90._sparse_mla_sm90_kernel, []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **k: (launched.append((tuple(grid), k["PERSIST"])), real[grid](*a, **k))[1]

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(kernel_sm90, "_sparse_mla_sm90_kernel", Spy())
    return launched


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # 600 items over the SMs' programs (not a multiple of them), ragged lengths, empty items (length 0: no q copy)
    # and rows with no valid entry
    dict(T=300, H=128, topk=2048, S=1 << 16, with_len=True, with_sink=True, empty_rows=(5, 150), block_size=64),
    dict(T=150, H=72, topk=700, S=5000, with_len=True, frac_invalid=0.5),  # 2 head groups (the 2nd masked), 11 tiles
    dict(T=3, H=64, topk=37, S=90, empty_rows=(1,)),  # fewer items than SMs; one pair, its second tile empty
])
def test_gpu_sm90_pingpong_persistent(case, monkeypatch):
    """Persistent ping-pong programs (``PERSIST``: one per SM walking the (token, 64-head group) items, q copied by
    the producer while the previous item finishes) against the reference and the Triton kernel (tails, head masks,
    topk_length with empty items, sink, invalid entries, NaN in unused slots, poisoned out, bitwise reruns), bitwise
    equal to one program per item, and the launch really ran min(items, SMs) persistent programs."""
    launched = _record_grids(monkeypatch)
    case = dict(case, splits=1)  # (few items would otherwise be split, and split launches are not persistent)
    base = dict(pingpong=True)
    assert _check_sm90_case(case, "bf16", dict(base, persist=True), "persist", monkeypatch) == [True, True]
    items = case["T"] * -(-case["H"] // 64)
    programs = min(items, torch.cuda.get_device_properties(DEVICE).multi_processor_count)
    assert launched == [((programs, 1), True)] * 2, launched
    # the same call, one program per item
    extra = {k: v for k, v in case.items() if k not in ("T", "H", "topk", "S", "splits")}
    q, kv, idx, sm, sink, tl_ = make_case(case["T"], case["H"], case["topk"], case["S"], "bf16",
                                          seed=case["T"] * case["H"] + case["topk"], **extra)
    if tl_ is not None:
        tl_[0] = case["topk"]
        if case["T"] > 2:
            tl_[2] = 0
    flat = ref_mod.flat_kv(kv)
    got = [sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, None, num_splits=1, config=dict(base, persist=p))
           for p in (True, False)]
    assert launched[-2:] == [((programs, 1), True), ((items, 1), False)], launched
    for a, b in zip(*got):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_sm90_persistent_default(monkeypatch):
    """Which launches take persistent programs by default: unsplit ping-pong launches with two or more 64-head groups
    per token (h_q > 64), not h_q 64, not split ones."""
    launched = _record_grids(monkeypatch)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for H, splits, want in [(128, 1, ((sms, 1), True)), (96, 1, ((sms, 1), True)), (64, 1, ((200, 1), False)),
                            (128, 2, ((400, 2), False))]:
        q, kv, idx, sm, _, _ = make_case(200, H, 256, 1000, "bf16", seed=H + splits)
        got = sparse_mla_triton(q, kv, idx, sm, D_V, num_splits=splits)
        assert launched[-1] == want, (H, splits, launched[-1])
        assert_matches(got, sparse_mla_ref(q, kv, idx, sm), max_abs_v(kv, idx, 1000), f"h_q {H} splits {splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("width,persist", [(584, True), (580, False)])
def test_gpu_sm90_persistent_strided_q(width, persist, monkeypatch):
    """q viewed out of a wider tensor: rows on 16-byte boundaries whose strides are not multiples of 16 elements
    (584: the persistent programs copy q in 16-byte pieces without the compiler's divisibility hint) and rows that
    are not (580: one program per item, which loads q without ``cp.async``). Against the reference, poisoned out."""
    launched = _record_grids(monkeypatch)
    T, H, topk, S = 150, 128, 300, 2000
    q0, kv, idx, sm, sink, tl_ = make_case(T, H, topk, S, "bf16", seed=width, with_len=True, with_sink=True)
    q_big = poison_(torch.empty(T, H + 1, width, dtype=torch.bfloat16, device=DEVICE))
    q = q_big[:, 1:, :D_QK]
    q.copy_(q0)
    out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=DEVICE))
    got = sparse_mla_triton(q, kv, idx, sm, D_V, sink, tl_, out, num_splits=1)
    sms = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    assert launched[-1] == (((sms, 1), True) if persist else ((2 * T, 1), False)), launched[-1]
    assert_matches(got, sparse_mla_ref(q0, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, S))


@pytest.mark.gpu
def test_gpu_sm90_pingpong_refuses_fp8():
    """Asking for the ping-pong schedule where it does not serve (the fp8_ds_mla cache) is an error, not a
    silent fallback."""
    _sm90_or_skip()
    q, kv, idx, sm, _, _ = make_case(2, 64, 64, 100, "fp8_ds_mla", seed=1)
    with pytest.raises(ValueError, match="pingpong"):
        sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, None, None, None, config=dict(pingpong=True))


@pytest.mark.gpu
@pytest.mark.parametrize("pingpong", [False, True])
def test_gpu_sm90_rising_and_strided(pingpong):
    """Gluon kernel (default and ping-pong schedule): logits rising along the list (a rescale at every tile, so
    the second tile of each pair raises the max the first one used), and q / out with padded strides."""
    _sm90_or_skip()
    g = gen(23)
    T, H, topk, S = 2, 64, 512, 600
    sm = 192**-0.5
    q0 = torch.randn(D_QK, generator=g)
    q = (q0[None, None, :] + 0.1 * torch.randn(T, H, D_QK, generator=g)).to(torch.bfloat16)
    a = 0.25 * torch.arange(topk, dtype=torch.float32) / (sm * LOG2E)
    kv = torch.randn(S, D_QK, generator=g) * 0.5
    kv[:topk] += a[:, None] * q0[None, :] / q0.square().sum()
    kv[topk:] = float("nan")
    idx = torch.arange(topk, dtype=torch.int32)[None, :].repeat(T, 1)
    idx[:, 40] = -1
    idx[1, 300] = S + 5
    q_big = torch.randn(T, H + 4, 640).to(torch.bfloat16)
    q_big[:, 2:2 + H, :D_QK] = q
    q_big, kv, idx = q_big.to(DEVICE), kv.to(torch.bfloat16).to(DEVICE), idx.to(DEVICE)
    q_view = q_big[:, 2:2 + H, :D_QK]
    out_big = poison_(torch.empty(T, H, 600, dtype=torch.bfloat16, device=DEVICE))
    out_view = out_big[:, :, 50:50 + D_V]
    for ns in (1, 2):
        got = sparse_mla_triton(q_view, kv, idx, sm, D_V, None, None, out_view, num_splits=ns,
                                config=dict(pingpong=pingpong))
        want = sparse_mla_ref(q_view, kv, idx, sm)
        assert_matches(got, want, max_abs_v(kv, idx, S), f"splits={ns}")
    assert torch.isnan(out_big[:, :, :50].float()).all() and torch.isnan(out_big[:, :, 50 + D_V:].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,kv_format", [(64, 16, "fp8_ds_mla"), (3, 32, "fp8_ds_mla"), (200, 16, "fp8_ds_mla"),
                                           (64, 16, "bf16"), (65, 16, "bf16"), (100, 32, "bf16"), (5, 64, "bf16"),
                                           (1, 24, "bf16"), (5, 32, "fp8_ds_mla"),
                                           (3, 128, "bf16"), (3, 128, "fp8_ds_mla")])
def test_gpu_sm90_small_heads_default_dispatch(T, H, kv_format, monkeypatch):
    """Without a config, every head group on sm_90 takes the Gluon kernel (16/32 heads: the rows as the M
    dimension, 32 heads of at most 4 tokens as two 16-head groups; 64-head groups over the bf16 cache: the
    ping-pong schedule; 16-head fp8 decode where ``kernel_bulk.serves``: that kernel), equal to the reference."""
    from dsa.mla import kernel_bulk

    kernel_sm90 = _sm90_or_skip()
    q, kv, idx, sm, sink, tl_ = make_case(T, H, 256, 2048, kv_format, seed=T + H, with_len=True, with_sink=True)
    calls = record_launches(monkeypatch, kernel_sm90, "block_h")
    schedules = []  # the kernel's PINGPONG argument per launch
    kern = kernel_sm90._sparse_mla_sm90_kernel
    spy = lambda self, grid: lambda *a, **k: (schedules.append(k["PINGPONG"]), kern[grid](*a, **k))[1]  # noqa: E731
    monkeypatch.setattr(kernel_sm90, "_sparse_mla_sm90_kernel", type("Spy", (), {"__getitem__": spy})())
    got = sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, sink, tl_, None)
    bh = block_h_for(H)
    if H == 16 and kv_format == "fp8_ds_mla" and kernel_bulk.serves(T, 256):  # (tests/test_mla_bulk.py)
        assert calls == [] and schedules == []
    else:
        assert calls == [16 if bh == 32 and T <= SM90_TWO_GROUPS_MAX_T else bh]
        assert schedules == [H >= 64 and kv_format == "bf16"]
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,kv_format,want", [(512, 72, "bf16", [64, 16]), (256, 96, "fp8_ds_mla", [64, 32]),
                                                (512, 112, "bf16", [64]), (511, 96, "bf16", [64]),
                                                (255, 80, "fp8_ds_mla", [64]), (512, 128, "fp8_ds_mla", [64])])
def test_gpu_sm90_sliced_heads_default(T, H, kv_format, want, monkeypatch):
    """On sm_90 the default runs 72-96 heads from ``SLICE_MIN_T`` tokens as two calls (64 heads, then the rest as a
    small group, which the launches' head-group sizes show), other head counts and fewer tokens as one; against the
    reference, with a sink, topk_length and a poisoned ``out``."""
    kernel_sm90 = _sm90_or_skip()
    q, kv, idx, sm, sink, tl_ = make_case(T, H, 200, 4096, kv_format, seed=T + H, with_len=True, with_sink=True)
    calls = record_launches(monkeypatch, kernel_sm90, "block_h")
    out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=q.device))
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, out=out)
    assert calls == want and got[0] is out
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, 4096),
                   str((T, H, kv_format)))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,topk,splits", [(3, 16, 300, None), (40, 16, 2048, 2), (5, 32, 1000, 3), (2, 32, 2048, None),
                                             (7, 24, 129, 1), (4, 8, 640, None), (33, 40, 200, 1)])
@pytest.mark.parametrize("kv_format,producer", [("bf16", None), ("fp8_ds_mla", None), ("fp8_ds_mla", dict(early=2)),
                                               ("fp8_ds_mla", dict(warps=4)), ("fp8_ds_mla", dict(alt=1)),
                                               ("fp8_ds_mla", dict(alt=0)), ("bf16", dict(warps=8, alt=1))])
def test_gpu_sm90_rows_kernel(T, H, topk, splits, kv_format, producer, monkeypatch):
    """The small-head Gluon kernel (rows as the M dimension, 16/32-head groups; h_q 40 = a 32-head group and a
    masked one; fp8 and bf16 with two producer warpgroups taking alternate tiles whenever there are any (``alt`` 1:
    programs with 1, 2, 3, ... tiles, so one warpgroup may have none) or sharing every tile (``alt`` 0), also with
    two groups loaded early, and with one warpgroup) against the reference and the small-head Triton
    programs: tails, invalid entries, empty rows, topk_length, sink, splits, NaN in unused slots, poisoned out;
    bitwise deterministic; the launch took it."""
    from dsa.mla.kernel import SM90_ROWS_SMALL_HEADS

    kernel_sm90 = _sm90_or_skip()
    q, kv, idx, sm, sink, tl_ = make_case(T, H, topk, 4096, kv_format, seed=T * H + topk + 1, with_len=True,
                                          with_sink=True, empty_rows=(1,) if T > 2 else ())
    calls = record_launches(monkeypatch, kernel_sm90, "block_h")
    flat = ref_mod.flat_kv(kv)
    outs = []
    for _ in range(2):
        out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=q.device))
        got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, out, num_splits=splits,
                                config=dict(SM90_ROWS_SMALL_HEADS, block_h=16 if H <= 16 else 32, producer=producer))
        assert got[0] is out
        outs.append(got)
    assert calls == [16 if H <= 16 else 32] * 2
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(outs[0], want, max_abs_v(kv, idx, 4096), str((T, H, topk, splits, kv_format)))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    portable = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, None, num_splits=splits, config=dict(gluon=False))
    assert len(calls) == 2
    assert_matches(outs[0], portable, max_abs_v(kv, idx, 4096), "vs the small-head Triton programs")


@pytest.mark.gpu
@pytest.mark.parametrize("H", [16, 32])
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("slope", [0.25, 0.05, -0.25])
@pytest.mark.parametrize("lazy", [(), (16, 32)])
def test_gpu_sm90_rows_moving_max(H, kv_format, slope, lazy, monkeypatch):
    """The small-head Gluon kernel on logits that rise or fall along the index list, ``slope`` log2 units per entry:
    0.25 is 16 per 64-row tile, past ``LAZY_TAU`` (8) at every tile, so P is redone against the new max; 0.05 is 1-5
    per tile, under it, so P runs above 1 against the earlier tiles' max for a few tiles before a redo; -0.25 has
    the max in the first tile.
    Row 1 takes the list backwards, row 2 has invalid entries scattered through it. With P against the earlier
    tiles' max (``LAZY_MAX``) for these head groups and without it, whole and split, into poisoned outputs, NaN in
    unused slots, against the reference."""
    from dsa.mla.kernel import SM90_ROWS_SMALL_HEADS

    kernel_sm90 = _sm90_or_skip()
    monkeypatch.setattr(kernel_sm90, "LAZY_MAX", lazy)
    g = gen(31)
    T, topk, S = 3, 1024, 1100
    sm = 192**-0.5
    q0 = torch.randn(D_QK, generator=g)
    q = (q0[None, None, :] + 0.1 * torch.randn(T, H, D_QK, generator=g)).to(torch.bfloat16)
    a = slope * torch.arange(topk, dtype=torch.float32) / (sm * LOG2E)  # target logit of entry j
    rows = torch.randn(S, D_QK, generator=g) * 0.5
    rows[:topk] += a[:, None] * q0[None, :] / q0.square().sum()
    used = torch.zeros(S, dtype=torch.bool)
    used[:topk] = True
    kv = pack_cache(rows[:, :KV_LORA_RANK], rows[:, KV_LORA_RANK:], kv_format, used)
    idx = torch.arange(topk, dtype=torch.int32)[None, :].repeat(T, 1)
    idx[1] = idx[1].flip(0)
    bad = torch.rand(topk, generator=g) < 0.2
    idx[2, bad] = torch.tensor([-1, S, INT32_MAX], dtype=torch.int32)[torch.randint(0, 3, (int(bad.sum()),),
                                                                                    generator=g)]
    q, kv, idx = q.to(DEVICE), kv.to(DEVICE), idx.to(DEVICE)
    logits = (q[0].float() @ ref_mod.gather_rows_bf16(kv, idx[0].long()).float().T) * sm * LOG2E  # [H, topk]
    steps = logits.view(H, topk // 64, 64).amax(-1).diff(dim=1)  # how each head's tile max moves, log2 units
    lo, hi = {0.25: (8, 30), 0.05: (0, 8), -0.25: (-30, -8)}[slope]
    assert lo < steps.min() and steps.max() < hi, (steps.min(), steps.max())
    calls = record_launches(monkeypatch, kernel_sm90, "block_h")
    want = sparse_mla_ref(q, kv, idx, sm)
    for ns in (None, 2):
        out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=DEVICE))
        got = sparse_mla_triton(q, kv, idx, sm, D_V, None, None, out, num_splits=ns,
                                config=dict(SM90_ROWS_SMALL_HEADS, block_h=H))
        assert got[0] is out
        assert_matches(got, want, max_abs_v(kv, idx, S), f"splits={ns}")
    assert calls == [H, H]


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,topk,splits,kv_format,pingpong", [
    (1, 16, 2048, 16, "fp8_ds_mla", None),  # batch-1 decode: one cluster of 16 CTAs
    (1, 16, 2048, 16, "bf16", None),
    (3, 32, 1000, 3, "fp8_ds_mla", None),  # 3 splits in clusters of 4 (the 4th split empty), 2 head rounds
    (4, 24, 640, 5, "bf16", None),  # a masked 32-head group; 5 splits in clusters of 8
    (9, 16, 2048, 2, "bf16", None),  # clusters of 2: 256 columns per CTA
    (2, 128, 2048, 16, "fp8_ds_mla", False),  # 64-head groups, shared-tile schedule
    (2, 72, 700, 4, "bf16", True),  # ping-pong schedule, a masked second group
    (3, 64, 130, 2, "bf16", False),
])
def test_gpu_sm90_cluster_merge(T, H, topk, splits, kv_format, pingpong, monkeypatch):
    """The split merge inside the Gluon kernel (the splits of a (token, head group) as one cluster of CTAs,
    each merging a slice of the output columns after the cluster barrier) against the reference and the merge
    kernel: every schedule, cluster sizes 2-16, padding splits, topk_length (later splits empty), sink, empty
    rows, NaN in unused slots, poisoned out and stats; bitwise deterministic; the launch asked for the cluster."""
    from dsa.mla.kernel import SM90_ROWS_SMALL_HEADS

    kernel_sm90 = _sm90_or_skip()
    q, kv, idx, sm, sink, tl_ = make_case(T, H, topk, 4096, kv_format, seed=T * H + topk + 7, with_len=True,
                                          with_sink=True, empty_rows=(1,) if T > 2 else ())
    tl_[0] = topk
    if T > 1:
        tl_[T - 1] = 70  # only the first split of the last token has entries
    bh = block_h_for(H)
    base = dict(SM90_ROWS_SMALL_HEADS, block_h=bh) if bh < 64 else dict(pingpong=pingpong)
    calls = record_launches(monkeypatch, kernel_sm90, "cluster")
    flat = ref_mod.flat_kv(kv)
    runs = []
    for cluster in (True, True, False):
        out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=q.device))
        got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, out, num_splits=splits,
                                config=dict(base, cluster=cluster))
        assert got[0] is out
        runs.append(got)
    assert calls == [triton.next_power_of_2(splits)] * 2 + [0]
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(runs[0], want, max_abs_v(kv, idx, 4096), str((T, H, topk, splits, kv_format)))
    assert all(torch.equal(a, b) for a, b in zip(runs[0], runs[1]))
    # the same partials merged by the merge kernel: equal up to the order of the sums
    assert_matches(runs[0], runs[2], max_abs_v(kv, idx, 4096), "vs the merge kernel")


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,kv_format", [(6, 16, "fp8_ds_mla"), (12, 16, "bf16"), (20, 16, "fp8_ds_mla"),
                                           (30, 32, "bf16"), (31, 16, "bf16")])
def test_gpu_sm90_cluster_count(T, H, kv_format, monkeypatch):
    """The driver's count of clusters that run at once (one CTA per SM) is positive and at most the SMs over the
    cluster size; the default launch merges inside the kernel exactly when its clusters fit in that count, and is
    equal to the reference either way."""
    from dsa.mla.kernel import _num_sms, choose_num_splits

    kernel_sm90 = _sm90_or_skip()
    dev = torch.device("cuda")
    sms = _num_sms(dev)
    counts = {n: kernel_sm90.max_active_clusters(n, torch.cuda.current_device()) for n in (2, 4, 8, 16)}
    assert all(c is not None and 0 < c <= sms // n for n, c in counts.items()), counts
    q, kv, idx, sm, sink, tl_ = make_case(T, H, 2048, 8192, kv_format, seed=T + H, with_len=True, with_sink=True)
    calls = record_launches(monkeypatch, kernel_sm90, "cluster")
    got = sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V, sink, tl_, None)
    n = triton.next_power_of_2(choose_num_splits(T, 1, 2048, sms, 64, 1))
    assert calls == [n if n == 2 or T <= counts[n] else 0], (calls, n, counts)
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, 8192))


@pytest.mark.gpu
def test_gpu_sm90_misaligned_cache_falls_back(monkeypatch):
    """A cache whose first row is not on a 16-byte boundary is served by the Triton kernel, correctly."""
    kernel_sm90 = _sm90_or_skip()
    q, kv, idx, sm, sink, tl_ = make_case(3, 64, 100, 200, "bf16", seed=77, with_len=True, with_sink=True)
    store = torch.empty(200 * D_QK + 1, dtype=torch.bfloat16, device=q.device)
    kv_odd = store[1:].view(200, D_QK)
    kv_odd.copy_(kv)
    assert kv_odd.data_ptr() % 16 == 2 and not kernel_sm90.supported(q, kv_odd, 64)
    monkeypatch.setattr(kernel_sm90, "launch", lambda *a, **k: pytest.fail("the Gluon kernel was launched"))
    got = sparse_mla_triton(q, kv_odd, idx, sm, D_V, sink, tl_, None)
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(got, want, max_abs_v(kv, idx, 200))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_ds_mla", 132, 8448])
def test_mla_gather_ceiling_walk(fmt):
    """benchmarks/gather_ceiling.py's row walk (the bound it reports must come from reading exactly the rows
    sparse_mla reads; also its ``sizes`` mode, rows of 132 and 8448 bytes): per index entry the wrapping sum of the
    row's 32-bit words, 0 for -1 and out-of-range entries (NaN-filled rows never read), every output written."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from gather_ceiling import rows_sum

    g = torch.Generator().manual_seed(7)
    S, T, topk = 300, 3, 100  # topk not a multiple of the tile
    if fmt == "bf16":
        kv = torch.randn(S, 576, generator=g).to(torch.bfloat16)
    elif fmt == "fp8_ds_mla":
        kv = torch.randint(0, 256, (S, 656), generator=g, dtype=torch.uint8)
    else:  # rows of ``fmt`` bytes
        kv = torch.randint(0, 256, (S, fmt), generator=g, dtype=torch.uint8)
    kv[S - 20:] = 0xFF if fmt != "bf16" else float("nan")  # unused slots, never referenced
    idx = torch.randint(0, S - 20, (T, topk), generator=g, dtype=torch.int32)
    idx[0, 5] = -1
    idx[1, 7] = S + 3
    idx[2, 90:] = -1
    kv, idx = kv.to(DEVICE), idx.to(DEVICE)
    out = torch.full((T, topk), -12345, dtype=torch.int32, device=DEVICE)
    rows_sum(kv.view(torch.int32), idx, out, block_n=32, splits=2, num_stages=2)
    words = kv.view(torch.int32).cpu().long()
    ok = (idx >= 0) & (idx < S)
    want = words[torch.where(ok, idx, 0).long().cpu()].sum(-1)
    want = ((want + 2**31) % 2**32 - 2**31) * ok.cpu()
    assert torch.equal(out.cpu().long(), want)


def test_sm90_kernel_never_serves_off_hopper():
    """Off an sm_90 GPU or under the interpreter the Gluon sparse-MLA kernel never serves a call."""
    from dsa.mla import kernel_sm90

    if not on_hopper(torch.device(DEVICE)):
        q = torch.zeros(2, 16, D_QK, dtype=torch.bfloat16, device=DEVICE)
        kv = torch.zeros(8, D_QK, dtype=torch.bfloat16, device=DEVICE)
        assert not any(kernel_sm90.supported(q, kv, bh) for bh in (16, 32, 64))


#: a script's part that defines ``build(consts, num_warps)``: the Hopper kernel compiled for sm_90a with the
#: constexprs ``consts`` (the launcher's pointer types; fp8 pointers where ``IS_FP8``), on any machine (Triton's own
#: ptxas, in a process without the CPU interpreter, which cannot compile Gluon)
_SM90_BUILD = r"""
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from dsa.mla import kernel_sm90


def build(consts, num_warps):
    fn = kernel_sm90._sparse_mla_sm90_kernel
    fp8 = consts["IS_FP8"]
    ptrs = dict(q_ptr="*bf16", nope_ptr="*fp8e4nv" if fp8 else "*bf16", scale_ptr="*fp32", rope_ptr="*bf16",
                idx_ptr="*i32", len_ptr="*i32", sink_ptr="*fp32", out_ptr="*fp32", ml_ptr="*fp32", lse_ptr="*fp32",
                fout_ptr="*bf16", fml_ptr="*fp32", flse_ptr="*fp32", skip_ptr="*i32")
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n == "sm_scale_log2" else "i32")
           for n in fn.arg_names}
    assert all(sig[p.name] == "constexpr" for p in fn.params if p.is_constexpr), "a constexpr is missing here"
    attrs = {(fn.arg_names.index(n), ): [["tt.divisibility", 16]] for n in ptrs}
    src = GluonASTSource(fn, sig, {(fn.arg_names.index(n), ): v for n, v in consts.items()}, attrs)
    return kernel_sm90._compile_with_cluster(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=num_warps))
"""

_COMPILE_SM90 = _SM90_BUILD + r"""
import re
import sys

fmt, _, bh = sys.argv[1].partition("/")  # "fp8" or "bf16", optionally "/32" for a 32-head group (else 16)
fp8, bh = fmt == "fp8", int(bh or 16)  # fp8: the small-head fp8 producer (kernel_sm90.PRODUCER_ROWS_FP8)
prod = kernel_sm90.producer_config(fp8, bh, False)  # what launch() uses for that head group
for cluster in map(int, sys.argv[2:]):
    consts = dict(IS_FP8=fp8, HAS_LEN=False, HAS_SINK=False, SPLIT=True, BH=bh, PINGPONG=False,
                  PRODUCER_WARPS=prod["warps"], PRODUCER_REGS=prod["regs"], EARLY=prod["early"], MATH_REGS=0,
                  CLUSTER=cluster, ALT=fp8, LAZY=bh in kernel_sm90.LAZY_MAX, PERSIST=False,  # fp8: alternate tiles
                  SKIP=-1)
    k = build(consts, 4)
    ptx = k.asm["ptx"]
    regs = sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+);", ptx)), key=int)
    print(cluster, k.packed_metadata[1], int("barrier.cluster.wait" in ptx), re.search(r"\.reqntid (\d+)", ptx)[1],
          ",".join(regs), k.metadata.shared)
"""


def test_sm90_cluster_variant_launch_metadata():
    """A ``CLUSTER`` variant of the Hopper kernel carries its cluster size in the launch metadata the launcher
    reads (it then runs ``grid[0] * CLUSTER`` CTAs as clusters; without that the cluster barrier would hang the
    kernel) and has the barrier; ``CLUSTER`` 0 has neither. Compiled for sm_90 on any machine (Triton's own
    ptxas, in a process without the CPU interpreter, which cannot compile Gluon)."""
    r = _compile_sm90("bf16", "0", "4")
    assert [line.split()[:3] for line in r] == [["0", "1", "0"], ["4", "4", "1"]], r


def _compile_sm90(*args):
    skip_unless_gluon_triton()
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE_SM90, *args], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout.strip().splitlines()


def test_sm90_small_head_fp8_producer_fits():
    """The small-head fp8 variant's two producer warpgroups (:data:`~dsa.mla.kernel_sm90.PRODUCER_ROWS_FP8`, on
    alternate tiles) compile for sm_90 with the math warpgroup: 12 warps per CTA, and the registers the partitions
    ask for (``setmaxnreg``) fit in the 64K register file (128 math threads + 256 producer threads)."""
    from dsa.mla import kernel_sm90

    assert kernel_sm90.PRODUCER_ROWS_FP8["warps"] == 8
    for bh in (16, 32):  # (32: the math warpgroup with P against the earlier tiles' max, LAZY_MAX)
        (line, ) = _compile_sm90(f"fp8/{bh}", "0")
        cluster, size, barrier, threads, regs, _ = line.split()
        assert (cluster, size, barrier, threads) == ("0", "1", "0", "384"), (bh, line)
        regs = [int(r) for r in regs.split(",")]
        assert regs[0] == kernel_sm90.PRODUCER_ROWS_FP8["regs"] and 128 * regs[-1] + 256 * regs[0] <= 65536, line


_COMPILE_VARIANTS = _SM90_BUILD + r"""
# name: (fp8, head group, ping-pong, persistent, num_warps); lengths and sink on, one split, no cluster
VARIANTS = {"64 bf16": (False, 64, False, False, 8), "64 fp8": (True, 64, False, False, 8),
            "pingpong": (False, 64, True, False, 4), "pingpong persistent": (False, 64, True, True, 4),
            "16 fp8": (True, 16, False, False, 4), "32 fp8": (True, 32, False, False, 4),
            "32 bf16": (False, 32, False, False, 4), "16 bf16 waves": (False, 16, False, False, 4)}
for name, (fp8, bh, pp, persist, nw) in VARIANTS.items():
    # what launch() uses for that head group (a launch of several waves: bf16 16-head groups on alternate tiles)
    prod = kernel_sm90.producer_config(fp8, bh, pp, waves=True)
    consts = dict(IS_FP8=fp8, HAS_LEN=True, HAS_SINK=True, SPLIT=False, BH=bh, PINGPONG=pp,
                  PRODUCER_WARPS=prod["warps"], PRODUCER_REGS=prod["regs"], EARLY=prod["early"],
                  MATH_REGS=prod["math_regs"], CLUSTER=0, ALT=kernel_sm90.alternate_tiles(prod, bh, 2048),
                  LAZY=bh in kernel_sm90.LAZY_MAX, PERSIST=persist, SKIP=-1)
    out[name] = G.sass_lines(build(consts, nw))
"""


@functools.lru_cache(maxsize=1)
def _sm90_sass() -> dict:
    """The sm_90a SASS (:func:`bulk_gather.sass_lines`) of the Hopper kernel's variants in ``_COMPILE_VARIANTS``,
    compiled once per process."""
    return compiled_in_subprocess(_COMPILE_VARIANTS, ())


def _source_lines(fn, *keys) -> set:
    """The file lines of ``fn``'s source (a Gluon function) that hold any of ``keys``."""
    import inspect

    lines, first = inspect.getsourcelines(fn.fn)
    return {first + n for n, text in enumerate(lines) if any(k in text for k in keys)}


def _op(instr: str) -> str:
    """A SASS instruction's opcode (without its predicate)."""
    words = instr.split()
    return words[1] if words[0].startswith("@") else words[0]


def _cfg(rows) -> tuple:
    """``(successors, predecessors)`` of each SASS row (:func:`bulk_gather.sass_lines`) by index: the next row unless
    the row is an unpredicated branch, exit or return, and a branch's target."""
    at = {r[0]: i for i, r in enumerate(rows)}
    succ = []
    for i, (_, _, _, instr) in enumerate(rows):
        op, cond = _op(instr), instr.startswith("@") and not instr.startswith("@PT ")
        nxt = [i + 1] if i + 1 < len(rows) else []
        if op.startswith("BRA"):
            succ.append([at[int(instr.split()[-1], 16)]] + (nxt if cond else []))
        elif op.startswith("BRX"):  # an indirect branch (the dispatch to the partitions): every target of its table
            table = re.search(r"BRANCH_TARGETS ([0-9a-fx,]+)", instr)
            assert table, instr
            succ.append([at[int(x, 16)] for x in table[1].split(",")] + (nxt if cond else []))
        elif op.startswith(("EXIT", "RET")):
            succ.append(nxt if cond else [])
        else:
            # (a CALL, e.g. to a division's slow path, returns to the next row; other indirect jumps: none here)
            assert not op.startswith(("JMX", "JMP")), instr
            succ.append(nxt)
    pred = [[] for _ in rows]
    for i, out in enumerate(succ):
        for j in out:
            pred[j].append(i)
    return succ, pred


def _first_on_paths(edges, starts, stop) -> set:
    """Walking ``edges`` (:func:`_cfg`'s successors or predecessors) from the rows ``starts`` along every path: the
    rows where ``stop(row)`` first holds, and ``"end"`` if some path ends before."""
    seen, hits, todo = set(), set(), list(starts)
    while todo:
        i = todo.pop()
        if i in seen:
            continue
        seen.add(i)
        if stop(i):
            hits.add(i)
        elif not edges[i]:
            hits.add("end")
        else:
            todo.extend(edges[i])
    return hits


def _pp_handoffs(rows, loads: dict, stores: dict) -> dict:
    """The hand-offs of each shared slot in compiled SASS (``rows``: :func:`bulk_gather.sass_lines`); ``loads`` /
    ``stores``: slot name -> the source lines that read / write it. Along every path of the control flow, per slot:
    ``acquired``, the mbarriers (their shared-memory offsets) whose wait is the last mbarrier operation before a
    read, and ``published``, those whose arrival is the first mbarrier operation after a write, with a barrier of
    the writing warpgroup (``BAR.SYNC``) before it; ``None`` where a path reaches a read without a wait, or leaves a
    write to anything but a barrier and then an arrival."""
    def mbar(i):
        return rows[i][3].split("[", 1)[1].split("]", 1)[0].split("+")[-1]  # (the offset; each partition's own base)

    def op(i):
        return _op(rows[i][3])

    succ, pred = _cfg(rows)
    is_sync = [op(i).startswith(("SYNCS.ARRIVE", "SYNCS.PHASECHK")) for i in range(len(rows))]
    got = {}
    for slot in loads:
        acq, pub, n_ld, n_st = [], [], 0, 0
        for i, (_, f, line, _) in enumerate(rows):
            if f == "kernel_sm90.py" and line in loads[slot] and op(i).startswith("LDS"):
                n_ld += 1
                for h in _first_on_paths(pred, pred[i], is_sync.__getitem__):
                    acq.append(mbar(h) if h != "end" and "PHASECHK" in op(h) else None)
            if f == "kernel_sm90.py" and line in stores[slot] and op(i).startswith("STS"):
                n_st += 1
                for b in _first_on_paths(succ, succ[i], lambda j: is_sync[j] or op(j).startswith("BAR.SYNC")):
                    if b == "end" or is_sync[b]:
                        pub.append(None)
                        continue
                    for h in _first_on_paths(succ, succ[b], is_sync.__getitem__):
                        pub.append(mbar(h) if h != "end" and "ARRIVE" in op(h) else None)
        got[slot] = dict(acquired=acq, published=pub, reads=n_ld, writes=n_st)
    return got


def test_sm90_pingpong_handoffs_compile_in_order():
    """The compiled hand-offs of the 64-head ping-pong (:func:`~dsa.mla.kernel_sm90._math_pp`), which the CPU
    cannot run and whose racecheck reports are not explained yet (BENCHMARKS.md, forty-second and forty-third
    sessions): in the sm_90a SASS of the one-item and the persistent program, along every path of the control
    flow, every read of the shared running max (``m_smem``) and row sums (``l_smem``) comes after a wait on an
    mbarrier, every write is followed by the warpgroup's barrier and then an arrival, and the mbarriers waited on
    before the reads are exactly those arrived on after the writes: so each read is ordered after a write of the
    other warpgroup by the mbarrier it waits on, as the source means, whatever the compiler scheduled."""
    from dsa.mla import kernel_sm90

    at = {key: _source_lines(kernel_sm90._math_pp, key)
          for key in ("m_smem.load", "m_smem.store", "l_smem.slice(0, BH).load", "l_smem.slice(BH, BH).load",
                      "l_smem.slice(0, BH).store", "l_smem.slice(BH, BH).store")}
    loads = {"m": at["m_smem.load"], "l": at["l_smem.slice(0, BH).load"] | at["l_smem.slice(BH, BH).load"]}
    stores = {"m": at["m_smem.store"], "l": at["l_smem.slice(0, BH).store"] | at["l_smem.slice(BH, BH).store"]}
    assert len(loads["m"]) == 2 and len(stores["m"]) == 1 and len(loads["l"]) == 2 and len(stores["l"]) == 2, at
    for name in ("pingpong", "pingpong persistent"):
        got = _pp_handoffs(_sm90_sass()[name], loads, stores)
        for slot, g in got.items():
            assert g["reads"] >= 2 and g["writes"] >= 2, (name, slot, g)  # (both warpgroups read and write each)
            assert None not in g["acquired"] and None not in g["published"], (name, slot, g)
            assert set(g["acquired"]) == set(g["published"]) and len(set(g["published"])) == 2, (name, slot, g)
        # the two slots go through different mbarriers
        assert not set(got["m"]["published"]) & set(got["l"]["published"]), (name, got)


def _unfenced_tile_stores(rows, lines) -> tuple:
    """``(stores, unfenced)``: how many shared-memory stores (``STS``, ``STSM``) the source ``lines`` compiled to in
    ``rows`` (:func:`bulk_gather.sass_lines`), and the offsets of those from which some path of the control flow
    reaches a tensor-core product or an mbarrier arrival (the first instructions after which wgmma, the async
    proxy, may read what they wrote) before a proxy fence (``FENCE.VIEW.ASYNC.S``)."""
    succ, _ = _cfg(rows)
    stores, unfenced = 0, []
    for i, (off, f, line, instr) in enumerate(rows):
        if f != "kernel_sm90.py" or line not in lines or not _op(instr).startswith(("STS", "STSM")):
            continue
        stores += 1
        hits = _first_on_paths(succ, succ[i], lambda j: _op(rows[j][3]).startswith(
            ("FENCE.VIEW.ASYNC.S", "HGMMA", "SYNCS.ARRIVE")))
        if any(h != "end" and not _op(rows[h][3]).startswith("FENCE") for h in hits):
            unfenced.append(hex(off))
    return stores, unfenced


def test_sm90_tile_stores_fenced_before_wgmma():
    """Every tile the Hopper kernel writes with ordinary shared-memory stores and then hands to wgmma (q, the
    dequantised fp8 rows, P) is made visible to the async proxy first: in the sm_90a SASS of the 64-head (bf16,
    fp8), ping-pong (one item, persistent) and 16/32-head variants, every path of the control flow from such a
    store meets a proxy fence before any wgmma or mbarrier arrival. Without it wgmma may read stale shared memory,
    which no test on the CPU and no racecheck run (it does not follow the async proxy) would show."""
    from dsa.mla import kernel_sm90

    # every shared store of the kernel's source but the running max and row sums (read back with plain loads)
    lines = set()
    for fn in (kernel_sm90._sparse_mla_sm90_kernel, kernel_sm90._load_q, kernel_sm90._producer, kernel_sm90._math_64,
               kernel_sm90._math_rows, kernel_sm90._math_pp):
        lines |= _source_lines(fn, ".store(")
    lines -= _source_lines(kernel_sm90._math_rows, "m_smem.store") | _source_lines(kernel_sm90._math_pp, "m_smem.store",
                                                                                   "l_smem.slice")
    for name, rows in _sm90_sass().items():
        stores, unfenced = _unfenced_tile_stores(rows, lines)
        assert stores >= 4, (name, stores)
        assert not unfenced, (name, unfenced)


def test_sm90_small_head_variants_do_not_spill():
    """The 16/32-head variants of the Hopper kernel (one math warpgroup holding the whole O^T accumulator, 128 of its
    registers at 32 heads) keep everything in registers: no local-memory store or load in their sm_90a SASS. A spill
    there is not a few cold bytes: in the seventy-first session's lazy-softmax variant it reloaded the wgmma
    descriptors after every ``full`` wait and made the 32-head rows 5-10% slower (BENCHMARKS.md)."""
    for name in ("16 fp8", "32 fp8", "32 bf16", "16 bf16 waves"):
        local = [r[3] for r in _sm90_sass()[name] if _op(r[3]).startswith(("STL", "LDL"))]
        assert not local, (name, local)


def test_sm90_lazy_growth_is_one_load_past_the_barrier():
    """The 32-head lazy softmax's verdict (:func:`~dsa.mla.kernel_sm90._math_rows`, ``LAZY``) in both formats'
    sm_90a SASS: from the P store's barrier to the branch to the redo, one shared load (the growth word) and no
    shuffle; from there the path without growth reaches the first P.V product with no float arithmetic (the row
    sums wait behind the issue); before the barrier each thread's tag is one predicated shared store."""
    from dsa.mla import kernel_sm90

    (cond, ) = _source_lines(kernel_sm90._math_rows, "if _grow_get(")
    (put, ) = _source_lines(kernel_sm90._grow_put, "[x, tag]")  # (the line the compiler names for the asm)
    for name in ("32 bf16", "32 fp8"):
        rows = _sm90_sass()[name]
        bars = [i for i, r in enumerate(rows) if r[1] == "kernel_sm90.py" and r[2] == cond - 1
                and _op(r[3]).startswith("BAR.SYNC")]
        assert len(bars) == 1, (name, bars)
        j = next(k for k in range(bars[0] + 1, len(rows)) if _op(rows[k][3]).startswith("BRA"))
        ops = [_op(r[3]) for r in rows[bars[0] + 1:j]]
        assert sum(o.startswith("LDS") for o in ops) == 1 and not any(o.startswith("SHFL") for o in ops), (name, ops)
        at = {r[0]: i for i, r in enumerate(rows)}
        paths = []  # each way out of the branch: the opcodes up to the first HGMMA
        for t in (at[int(rows[j][3].split()[-1], 16)], j + 1):
            k = next(k for k in range(t, len(rows)) if _op(rows[k][3]).startswith("HGMMA"))
            paths.append([_op(r[3]) for r in rows[t:k]])
        fast = min(paths, key=len)  # (the redo recomputes P, the sums and the accumulator)
        assert not any(o.startswith(("FADD", "FFMA", "FMUL", "MUFU")) for o in fast), (name, fast)
        stores = [r[3] for r in rows if r[1] == "kernel_sm90.py" and r[2] == put and _op(r[3]).startswith("STS")]
        assert len(stores) == 1 and stores[0].startswith("@"), (name, stores)


@pytest.mark.gpu
@pytest.mark.parametrize("H,kv_format,T", [(16, "fp8_ds_mla", 4), (32, "bf16", 40), (128, "fp8_ds_mla", 2)])
def test_gpu_sm90_variants_prefer_l1(H, kv_format, T, monkeypatch):
    """Every compiled variant of the Hopper kernel (small-head rows, cluster and 64-head ones) has asked the
    driver for the smallest shared-memory carveout (preference 0), and its results are unchanged by it."""
    import ctypes

    kernel_sm90 = _sm90_or_skip()
    real, kernels = kernel_sm90._sparse_mla_sm90_kernel, []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **k: kernels.append(real[grid](*a, **k)) or kernels[-1]

        def __getattr__(self, name):
            return getattr(real, name)

    monkeypatch.setattr(kernel_sm90, "_sparse_mla_sm90_kernel", Spy())
    q, kv, idx, sm, _, _ = make_case(T, H, 2048, 4096, kv_format, seed=H + T)
    got = sparse_mla_triton(q, ref_mod.flat_kv(kv), idx, sm, D_V)
    assert kernels
    for k in kernels:
        v = ctypes.c_int(-2)
        assert kernel_sm90._libcuda().cuFuncGetAttribute(ctypes.byref(v), kernel_sm90._CARVEOUT_ATTR,
                                                          ctypes.c_void_p(k.function)) == 0
        assert v.value == 0, (k.name, v.value)
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm), max_abs_v(kv, idx, 4096))


@pytest.mark.gpu
def test_gpu_sm90_bf16_16_heads_alternate_tiles_past_one_wave(monkeypatch):
    """A default call over the bf16 cache with more (token, 16-head group) programs than SMs runs the kernel with two
    producer warpgroups on alternate tiles, one with fewer programs runs it with one, and both match the reference:
    invalid entries, ragged topk_length, sink, an empty row, NaN in unused slots, poisoned out."""
    from dsa import _replay

    kernel_sm90 = _sm90_or_skip()
    real, seen = kernel_sm90._sparse_mla_sm90_kernel, []

    class Spy:
        def __getitem__(self, grid):
            return lambda *a, **k: (seen.append((k["PRODUCER_WARPS"], k["ALT"])), real[grid](*a, **k))[1]

    monkeypatch.setattr(kernel_sm90, "_sparse_mla_sm90_kernel", Spy())
    monkeypatch.setitem(_replay._state, "enabled", False)
    n_sms = torch.cuda.get_device_properties(0).multi_processor_count
    for T, H, topk, want in ((n_sms + 8, 16, 640, (8, True)), (n_sms + 8, 8, 200, (8, True)),
                             (n_sms // 2, 16, 640, (4, False))):
        q, kv, idx, sm, sink, tl_ = make_case(T, H, topk, 8192, "bf16", seed=T + H, with_len=True, with_sink=True,
                                              empty_rows=(3,))
        seen.clear()
        out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device=q.device))
        got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, out=out)
        assert seen == [want] and got[0] is out, (T, H, seen)
        assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, 8192),
                       str((T, H, topk)))


def test_sm90_producer_config():
    """Which producer settings each schedule launches with, and benchmark overrides on top of them."""
    from dsa.mla import kernel_sm90 as K

    assert K.producer_config(True, 16, False) == dict(K.PRODUCER_ROWS_FP8, math_regs=0)
    assert K.producer_config(True, 32, False)["warps"] == 8
    assert K.producer_config(True, 64, False) == dict(K.PRODUCER[True], warps=4, math_regs=0, alt=0)
    assert K.producer_config(False, 16, False) == dict(K.PRODUCER[False], warps=4, math_regs=0, alt=0)
    assert K.producer_config(False, 64, True) == dict(K.PRODUCER_PP, warps=4, early=0, alt=0)
    assert K.producer_config(True, 16, False, dict(early=2, regs=96)) == dict(warps=8, regs=96, early=2, math_regs=0,
                                                                              alt=K.PRODUCER_ROWS_FP8["alt"])
    assert K.producer_config(False, 64, False, dict(warps=4)) == dict(K.PRODUCER[False], warps=4, math_regs=0, alt=0)
    # a launch of several waves: bf16 16-head groups take two warpgroups (alternate tiles), nothing else changes
    assert K.producer_config(False, 16, False, waves=True) == dict(K.PRODUCER[False], math_regs=0,
                                                                   **K.PRODUCER_ROWS_BF16_WAVES)
    for args in ((False, 32, False), (False, 64, False), (False, 64, True), (True, 16, False), (True, 64, False)):
        assert K.producer_config(*args, waves=True) == K.producer_config(*args), args


def test_sm90_alternate_tiles():
    """When the two producer warpgroups of a 16/32-head group take alternate tiles: fp8 from ``alt`` tiles per
    program on (decode at batch 32 and more, prefill); bf16 only 16-head groups in launches of several waves; never
    with one warpgroup or for 64-head groups."""
    from dsa.mla import kernel_sm90 as K

    fp8 = K.producer_config(True, 16, False)
    n = fp8["alt"]
    assert n > 2
    assert K.alternate_tiles(fp8, 16, n * K.BLOCK_N) and K.alternate_tiles(fp8, 32, 2048)
    assert not K.alternate_tiles(fp8, 16, (n - 1) * K.BLOCK_N)  # e.g. batch-1 decode: 2 tiles per split
    assert not K.alternate_tiles(K.producer_config(True, 16, False, dict(warps=4)), 16, 2048)
    assert not K.alternate_tiles(K.producer_config(True, 16, False, dict(alt=0)), 16, 2048)
    assert K.alternate_tiles(K.producer_config(True, 16, False, dict(alt=1)), 16, 64)
    assert not K.alternate_tiles(K.producer_config(True, 64, False), 64, 2048)
    assert not K.alternate_tiles(K.producer_config(False, 16, False), 16, 2048)
    bf16_waves = K.producer_config(False, 16, False, waves=True)
    assert K.alternate_tiles(bf16_waves, 16, 64) and K.alternate_tiles(bf16_waves, 16, 2048)
    assert not K.alternate_tiles(K.producer_config(False, 32, False, waves=True), 32, 2048)


def test_sm90_launch_alternates_bf16_tiles_over_several_waves(monkeypatch):
    """``launch`` gives 16-head groups over the bf16 cache two producer warpgroups on alternate tiles exactly when it
    launches more CTAs than SMs (programs x splits x cluster size), and never 32-head groups. The kernel is replaced
    by a spy that records what it would have been compiled with (CPU tensors: nothing runs)."""
    import types

    from dsa.mla import kernel_sm90 as K

    seen = []

    class Spy:
        def __getitem__(self, grid):
            def run(*a, **k):
                seen.append((k["PRODUCER_WARPS"], k["ALT"]))
                return types.SimpleNamespace(packed_metadata=(0, max(k["CLUSTER"], 1)))
            return run

    monkeypatch.setattr(K, "_sparse_mla_sm90_kernel", Spy())
    kv = torch.zeros(64, 576, dtype=torch.bfloat16)
    f32 = torch.zeros(4, 32, 512)
    for grid, cluster, bh, num_sms, want in [((133, 1), 0, 16, 132, True), ((132, 1), 0, 16, 132, False),
                                              ((67, 2), 0, 16, 132, True), ((66, 2), 0, 16, 132, False),
                                              ((34, 1), 4, 16, 132, True), ((33, 1), 4, 16, 132, False),
                                              ((133, 1), 0, 16, 0, False), ((4096, 1), 0, 32, 132, False)]:
        q = torch.zeros(4, bh, 576, dtype=torch.bfloat16)
        K.launch(grid, q, kv[:, :512], kv, 0, kv[:, 512:], torch.zeros(4, 2048, dtype=torch.int32), f32, f32, f32,
                 0, 0, 0, f32, f32, 4, bh, 64, 2048, 2048, 1.0, False, False, cluster > 0 or grid[1] > 1, block_h=bh,
                 cluster=cluster, final=(f32, 0, 0, f32, f32) if cluster else None, num_sms=num_sms)
        assert seen[-1] == ((8, True) if want else (4, False)), (grid, cluster, bh, num_sms, seen[-1])


def test_sm90_prefer_l1_only_warns_when_refused(monkeypatch):
    """The carveout is a hint: a driver that refuses it gets a warning, not an error."""
    from dsa.mla import kernel_sm90

    class Kernel:
        function = 1234

        def _init_handles(self):
            self.loaded = True

    class Driver:
        def cuFuncSetAttribute(self, fn, attr, value):
            self.args = (fn.value, attr, value)
            return 1  # CUDA_ERROR_INVALID_VALUE

    drv, k = Driver(), Kernel()
    monkeypatch.setattr(kernel_sm90, "_libcuda", lambda: drv)
    with pytest.warns(RuntimeWarning, match="carveout"):
        kernel_sm90._prefer_l1(k)
    assert k.loaded and drv.args == (1234, kernel_sm90._CARVEOUT_ATTR, 0)

    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(kernel_sm90, "_libcuda", missing)
    with pytest.warns(RuntimeWarning, match="OSError"):
        kernel_sm90._prefer_l1(Kernel())


def test_sm90_compile_hook_survives_binding(monkeypatch):
    """Triton sets a kernel's ``compile`` when it first binds it to a device: the Hopper kernel's class puts its
    cluster-aware compile step back right after."""
    from triton.experimental.gluon._runtime import GluonJITFunction

    from dsa.mla import kernel_sm90

    def bind(self):
        self.compile = "triton's"
        return "binder"

    monkeypatch.setattr(GluonJITFunction, "create_binder", bind)
    fn = kernel_sm90._sparse_mla_sm90_kernel
    monkeypatch.setattr(fn, "compile", None, raising=False)
    assert fn.create_binder() == "binder" and fn.compile is kernel_sm90._compile_with_cluster
