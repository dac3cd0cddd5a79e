"""Indexer K cache (dsa.indexer_cache): quantiser, quant-and-cache writer and gather.

Triton vs reference byte for byte (whole caches and whole poisoned outputs compared), and the
reference against independent formulations: the float64 quantiser of tests/quant_utils.py and a
token-by-token gather loop. All operations are exact (roundings and copies), so every comparison
is bitwise.
"""
from __future__ import annotations

import pytest
import torch

from dsa.constants import FP8_MAX, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES
from dsa.indexer_cache import kernel as idx_kernel
from dsa.indexer_cache import (
    gather_indexer_k,
    gather_indexer_k_ref,
    indexer_k_quant,
    indexer_k_quant_and_cache,
    indexer_k_quant_and_cache_ref,
)
from dsa.layouts import indexer_cache_views
from quant_utils import _bits, across_magnitudes, independent_quant, launch_config, paged_slot_mapping, random_bytes
from utils import DEVICE, gen, poison_, ragged_lengths, random_block_table

BACKENDS = ["triton", "reference"]
SCALE_FMTS = ["ue8m0", None]
D = INDEXER_HEAD_DIM


def _cache(num_blocks, block_size, form, g):
    raw = random_bytes((num_blocks, block_size * INDEXER_ROW_BYTES), g)
    _, scales = indexer_cache_views(raw)
    scales[:, ::3] = float("nan")  # NaN poison among the random scales
    shape = {
        "2d": (num_blocks, block_size * INDEXER_ROW_BYTES),
        "3d": (num_blocks, block_size, INDEXER_ROW_BYTES),
        "4d": (num_blocks, block_size, 1, INDEXER_ROW_BYTES),
    }[form]
    return raw.reshape(shape)


# ----------------------------------------------------------------------------------------------
# quantiser
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_indexer_k_quant_matches_independent(backend, scale_fmt):
    g = gen(20)
    k = across_magnitudes(64, D, D, g)
    q, s = indexer_k_quant(k.to(DEVICE), scale_fmt, backend=backend)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (64, D) and s.dtype == torch.float32 and s.shape == (64,)
    codes, scales = independent_quant(k, D, ue8m0=scale_fmt == "ue8m0")
    assert torch.equal(q.cpu().view(torch.uint8), codes)
    assert torch.equal(s.cpu(), scales.squeeze(-1))
    if scale_fmt is None:  # the plain scale is amax / 448 itself (or the clamp)
        amax = k.float().abs().amax(-1)
        assert bool((s.cpu()[amax >= 1e-4] == (amax / FP8_MAX)[amax >= 1e-4]).all())


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_indexer_k_quant_leading_dims(scale_fmt):
    """Per (token, head) quantisation of a [T, H, 128] query, as the indexer's Q uses."""
    g = gen(21)
    x = across_magnitudes(6 * 4, D, D, g).view(6, 4, D)
    q1, s1 = indexer_k_quant(x.to(DEVICE), scale_fmt, backend="triton")
    q2, s2 = indexer_k_quant(x.to(DEVICE), scale_fmt, backend="reference")
    assert q1.shape == (6, 4, D) and s1.shape == (6, 4)
    assert torch.equal(_bits(q1), _bits(q2)) and torch.equal(s1, s2)


# ----------------------------------------------------------------------------------------------
# quant-and-cache writer
# ----------------------------------------------------------------------------------------------
WRITE_CASES = [
    # (block_size, cache form, scale_fmt, slot dtype)
    (1, "2d", "ue8m0", torch.int64),
    (16, "3d", None, torch.int32),
    (64, "4d", "ue8m0", torch.int64),
    (64, "2d", None, torch.int64),
    (256, "3d", "ue8m0", torch.int64),
]


@pytest.mark.parametrize("block_size,form,scale_fmt,slot_dtype", WRITE_CASES)
def test_quant_and_cache_matches_reference(block_size, form, scale_fmt, slot_dtype):
    g = gen(30 + block_size)
    q_lens = ragged_lengths(4, (1, 9), (15, 30), 1, g)
    ctx_lens = [int(torch.randint(0, 70, (1,), generator=g)) for _ in q_lens]
    sm, num_slots = paged_slot_mapping(q_lens, ctx_lens, block_size, g, pad=3, oob=2)
    t = sm.numel() + 3  # rows past slot_mapping's length are ignored
    k = across_magnitudes(t, 2 * D, D, g)[:, D:]  # row stride 256
    cache0 = _cache(num_slots // block_size, block_size, form, g)

    want = cache0.clone()
    indexer_k_quant_and_cache_ref(k, want, sm.to(slot_dtype), scale_fmt)
    # independent check of the reference: decode each valid token's slot through the layout views
    values, scales = indexer_cache_views(want)
    codes, sc = independent_quant(k, D, ue8m0=scale_fmt == "ue8m0")
    for i in range(sm.numel()):
        s = int(sm[i])
        if 0 <= s < num_slots:
            assert torch.equal(values[s // block_size, s % block_size].view(torch.uint8), codes[i])
            assert scales[s // block_size, s % block_size] == sc[i, 0]

    got = cache0.clone().to(DEVICE)
    indexer_k_quant_and_cache(k.to(DEVICE), got, sm.to(slot_dtype).to(DEVICE), scale_fmt, backend="triton")
    got = got.cpu()
    assert torch.equal(got, want)  # whole cache, byte for byte: skipped / unused slots untouched
    written = torch.zeros(num_slots, dtype=torch.bool)
    written[sm[(sm >= 0) & (sm < num_slots)]] = True
    v0, s0 = indexer_cache_views(cache0)
    v1, s1 = indexer_cache_views(got)
    keep = ~written.view(-1, block_size)
    assert torch.equal(v1.view(torch.uint8)[keep], v0.view(torch.uint8)[keep])
    assert torch.equal(s1.view(torch.int32)[keep], s0.view(torch.int32)[keep])


def test_quant_and_cache_all_skipped():
    g = gen(8)
    k = torch.randn(4, D, generator=g).to(torch.bfloat16).to(DEVICE)
    cache = _cache(2, 16, "2d", g).to(DEVICE)
    before = cache.clone()
    indexer_k_quant_and_cache(k, cache, torch.tensor([-1, 32, -7, 2**40], device=DEVICE))
    indexer_k_quant_and_cache(k, cache, torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert torch.equal(cache, before)


# ----------------------------------------------------------------------------------------------
# gather
# ----------------------------------------------------------------------------------------------
def _gather_brute(cache, block_table, lens, n):
    """Token-by-token gather: row j of request r at position p; bad blocks read as zeros."""
    values, scales = indexer_cache_views(cache)
    nb, bs = scales.shape
    k = poison_(torch.empty(n, D, dtype=torch.float8_e4m3fn)).view(torch.uint8)  # as the outputs below
    s = poison_(torch.empty(n, dtype=torch.float32))
    j = 0
    for r, L in enumerate(lens):
        for p in range(L):
            if j < n:
                b = int(block_table[r, p // bs]) if p // bs < block_table.shape[1] else -1
                ok = 0 <= b < nb
                k[j] = values[b, p % bs].view(torch.uint8) if ok else 0
                s[j] = scales[b, p % bs] if ok else 0.0
            j += 1
    return k, s


GATHER_CASES = [
    # (block_size, form, index dtype, num_tokens mode)
    (1, "2d", torch.int32, "exact"),
    (16, "3d", torch.int64, "more"),
    (64, "4d", torch.int32, "fewer"),
    (256, "2d", torch.int32, "more"),
    (16, "2d", torch.int32, "sync"),
]


@pytest.mark.parametrize("block_size,form,idx_dtype,mode", GATHER_CASES)
def test_gather_matches_reference(block_size, form, idx_dtype, mode):
    g = gen(40 + block_size)
    lens = ragged_lengths(6, (0, 9), (40, 90), 2, g)
    lens[1] = 0  # an empty request
    bt, nb = random_block_table(lens, block_size, g)
    # invalid entries inside used ranges: -1 and past the cache -> zeros
    if bt.shape[1] > 1:
        bt[0, 0], bt[-1, -1] = -1, nb + 5
    cache = _cache(nb, block_size, form, g)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    total = int(cu[-1])
    n = {"exact": total, "more": total + 7, "fewer": total - 11, "sync": total}[mode]

    want_k, want_s = _gather_brute(cache, bt, lens, n)
    ref_k, ref_s = gather_indexer_k_ref(
        cache, bt, cu, n, (poison_(torch.empty(n, D, dtype=torch.float8_e4m3fn)), poison_(torch.empty(n))))
    assert torch.equal(_bits(ref_k), want_k) and torch.equal(_bits(ref_s), _bits(want_s))

    dev = dict(cache=cache.to(DEVICE), block_table=bt.to(idx_dtype).to(DEVICE), cu_seq_lens=cu.to(idx_dtype).to(DEVICE))
    if mode == "sync":
        k, s = gather_indexer_k(**dev, backend="triton")
    else:
        out = (poison_(torch.empty(n, D, dtype=torch.float8_e4m3fn, device=DEVICE)),
               poison_(torch.empty(n, device=DEVICE)))
        k, s = gather_indexer_k(**dev, out=out, backend="triton")
        assert k.data_ptr() == out[0].data_ptr() and s.data_ptr() == out[1].data_ptr()
    assert k.shape == (n, D) and s.shape == (n,)
    # whole outputs: every covered row written, uncovered tail rows (mode "more") keep the poison
    assert torch.equal(_bits(k.cpu()), want_k) and torch.equal(_bits(s.cpu()), _bits(want_s))


@pytest.mark.parametrize("n_req", [1, 2, 37])
def test_gather_request_counts(n_req):
    """One request (no search step), two, and 37 (8 search steps), mostly tiny and empty ones."""
    g = gen(70 + n_req)
    lens = [int(v) for v in torch.randint(0, 4, (n_req,), generator=g)]
    lens[-1] += 5
    bt, nb = random_block_table(lens, 4, g)
    cache = _cache(nb, 4, "2d", g).to(DEVICE)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    n = sum(lens)
    want_k, want_s = _gather_brute(cache.cpu(), bt, lens, n)
    out = (poison_(torch.empty(n, D, dtype=torch.float8_e4m3fn, device=DEVICE)), poison_(torch.empty(n, device=DEVICE)))
    k, s = gather_indexer_k(cache, bt.to(DEVICE), cu, out=out, backend="triton")
    assert torch.equal(_bits(k.cpu()), want_k) and torch.equal(_bits(s.cpu()), _bits(want_s))


def test_gather_num_tokens_without_out():
    g = gen(50)
    lens = [5, 20, 3]
    bt, nb = random_block_table(lens, 16, g)
    cache = _cache(nb, 16, "2d", g).to(DEVICE)
    cu = torch.tensor([0, 5, 25, 28], dtype=torch.int32, device=DEVICE)
    k, s = gather_indexer_k(cache, bt.to(DEVICE), cu, num_tokens=20, backend="triton")
    k2, s2 = gather_indexer_k(cache, bt.to(DEVICE), cu, num_tokens=20, backend="reference")
    assert k.shape == (20, D)
    assert torch.equal(_bits(k), _bits(k2)) and torch.equal(_bits(s), _bits(s2))


@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_write_then_gather_round_trip(scale_fmt):
    """Write requests' keys through their block tables, gather them back: == indexer_k_quant(k)."""
    g = gen(60)
    bs = 16
    lens = [3, 17, 40]
    bt, nb = random_block_table(lens, bs, g)
    cache = _cache(nb, bs, "3d", g).to(DEVICE)
    total = sum(lens)
    k = across_magnitudes(total, D, D, g).to(DEVICE)
    sm = torch.cat([bt[r, torch.arange(L) // bs].long() * bs + torch.arange(L) % bs for r, L in enumerate(lens)])
    indexer_k_quant_and_cache(k, cache, sm.to(DEVICE), scale_fmt, backend="triton")
    cu = torch.tensor([0, 3, 20, 60], dtype=torch.int32, device=DEVICE)
    kq, ks = gather_indexer_k(cache, bt.to(DEVICE), cu, num_tokens=total, backend="triton")
    q, s = indexer_k_quant(k, scale_fmt, backend="reference")
    assert torch.equal(_bits(kq), _bits(q)) and torch.equal(ks, s)


@pytest.mark.parametrize("key", ["quant", "gather"])
def test_launch_configs(key):
    """The smallest and largest tiles of the benchmark's sweep give the same bytes (ragged tails)."""
    g = gen(12)
    lens = [5, 0, 37, 9]
    bt, nb = random_block_table(lens, 16, g)
    cache0 = _cache(nb, 16, "2d", g).to(DEVICE)
    k = across_magnitudes(sum(lens), D, D, g).to(DEVICE)
    sm = torch.randperm(nb * 16, generator=g)[: sum(lens)].to(DEVICE)
    sm[3] = -1
    cu = torch.tensor([0, 5, 5, 42, 51], dtype=torch.int32, device=DEVICE)
    want = cache0.clone()
    indexer_k_quant_and_cache_ref(k, want, sm, None)
    want_k, want_s = gather_indexer_k(want, bt.to(DEVICE), cu, num_tokens=51, backend="reference")
    for cfg in (idx_kernel.CONFIG_SWEEP[key][0], idx_kernel.CONFIG_SWEEP[key][-1]):
        with launch_config(idx_kernel.CONFIG, key, cfg):
            if key == "quant":
                got = cache0.clone()
                indexer_k_quant_and_cache(k, got, sm, None, backend="triton")
                assert torch.equal(got, want), cfg
            else:
                gk, gs = gather_indexer_k(want, bt.to(DEVICE), cu, num_tokens=51, backend="triton")
                assert torch.equal(_bits(gk), _bits(want_k)) and torch.equal(_bits(gs), _bits(want_s)), cfg


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def _qc_args(**over):
    a = dict(
        k=torch.zeros(4, D, dtype=torch.bfloat16),
        cache=torch.zeros(2, 16 * INDEXER_ROW_BYTES, dtype=torch.uint8),
        slot_mapping=torch.zeros(4, dtype=torch.int64),
        scale_fmt="ue8m0",
    )
    a.update(over)
    return a


QC_BAD = [
    (dict(k=torch.zeros(4, D)), TypeError, "k"),
    (dict(k=torch.zeros(4, 64, dtype=torch.bfloat16)), ValueError, "k"),
    (dict(cache=torch.zeros(2, 16 * INDEXER_ROW_BYTES, dtype=torch.int8)), TypeError, "cache"),
    (dict(cache=torch.zeros(2, 16 * INDEXER_ROW_BYTES + 1, dtype=torch.uint8)), ValueError, "cache"),
    (dict(cache=torch.zeros(2, 16, 2, INDEXER_ROW_BYTES, dtype=torch.uint8)), ValueError, "cache"),
    (dict(cache=torch.zeros(2, 12 * INDEXER_ROW_BYTES, dtype=torch.uint8)), ValueError, "block_size"),
    (dict(cache=torch.zeros(2, 512, INDEXER_ROW_BYTES, dtype=torch.uint8)), ValueError, "block_size"),
    (dict(cache=torch.zeros(4 * 16 * INDEXER_ROW_BYTES, dtype=torch.uint8)[::2].view(2, -1)), ValueError, "cache"),
    # rows of a wider buffer: reshaping them to blocks would copy, and the writes would land in the copy
    (dict(cache=torch.zeros(2, 16, INDEXER_ROW_BYTES + 4, dtype=torch.uint8)[:, :, :INDEXER_ROW_BYTES]), ValueError,
     "cache: expected a contiguous"),
    (dict(cache=torch.zeros(2, 16, 1, INDEXER_ROW_BYTES + 4, dtype=torch.uint8)[..., :INDEXER_ROW_BYTES]), ValueError,
     "cache: expected a contiguous"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.int16)), TypeError, "slot_mapping"),
    (dict(slot_mapping=torch.zeros(5, dtype=torch.int64)), ValueError, "slot_mapping"),
    (dict(scale_fmt="e8m0"), ValueError, "scale_fmt"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.int64, device="meta")), ValueError, "slot_mapping"),
]


@pytest.mark.parametrize("over,exc,name", QC_BAD)
def test_quant_and_cache_validation(over, exc, name):
    with pytest.raises(exc, match=name):
        indexer_k_quant_and_cache(**_qc_args(**over), backend="triton")


def _g_args(**over):
    a = dict(
        cache=torch.zeros(2, 16 * INDEXER_ROW_BYTES, dtype=torch.uint8),
        block_table=torch.zeros(3, 2, dtype=torch.int32),
        cu_seq_lens=torch.zeros(4, dtype=torch.int32),
    )
    a.update(over)
    return a


G_BAD = [
    (dict(block_table=torch.zeros(3, 2)), TypeError, "block_table"),
    (dict(block_table=torch.zeros(3, dtype=torch.int32)), ValueError, "block_table"),
    (dict(cu_seq_lens=torch.zeros(3, dtype=torch.int32)), ValueError, "cu_seq_lens"),
    (dict(cu_seq_lens=torch.zeros(4)), TypeError, "cu_seq_lens"),
    (dict(cache=torch.zeros(2, 16, INDEXER_ROW_BYTES, dtype=torch.float32)), TypeError, "cache"),
    (dict(cache=torch.zeros(2, 16, INDEXER_ROW_BYTES + 4, dtype=torch.uint8)[:, :, :INDEXER_ROW_BYTES]), ValueError,
     "cache: expected a contiguous"),
    (dict(num_tokens=-1), ValueError, "num_tokens"),
    (dict(num_tokens=2.0), ValueError, "num_tokens"),
    (dict(out=torch.zeros(4, D)), TypeError, "out"),
    (dict(out=(torch.zeros(4, D, dtype=torch.uint8), torch.zeros(4))), TypeError, r"out\[0\]"),
    (dict(out=(torch.zeros(4, D, dtype=torch.float8_e4m3fn), torch.zeros(5))), ValueError, r"out\[1\]"),
    (dict(out=(torch.zeros(4, D, dtype=torch.float8_e4m3fn), torch.zeros(4)), num_tokens=3), ValueError, r"out\[0\]"),
    (dict(cu_seq_lens=torch.zeros(4, dtype=torch.int32, device="meta")), ValueError, "cu_seq_lens"),
]


@pytest.mark.parametrize("over,exc,name", G_BAD)
def test_gather_validation(over, exc, name):
    with pytest.raises(exc, match=name):
        gather_indexer_k(**_g_args(**over), backend="triton")


def test_quant_validation():
    with pytest.raises(ValueError, match="k"):
        indexer_k_quant(torch.zeros(4, 129, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="k"):
        indexer_k_quant(torch.zeros(4, D, dtype=torch.float16))
    with pytest.raises(ValueError, match="scale_fmt"):
        indexer_k_quant(torch.zeros(4, D, dtype=torch.bfloat16), "fp32")


# ----------------------------------------------------------------------------------------------
# GPU: larger shapes
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [1, 64, 256])
@pytest.mark.parametrize("scale_fmt", SCALE_FMTS)
def test_gpu_large(block_size, scale_fmt):
    g = gen(77)
    q_lens = ragged_lengths(48, (1, 40), (1000, 4000), 4, g)
    ctx_lens = [int(torch.randint(0, 3000, (1,), generator=g)) for _ in q_lens]
    sm, num_slots = paged_slot_mapping(q_lens, ctx_lens, block_size, g, pad=40, oob=5)
    k = across_magnitudes(sm.numel(), D, D, g).cuda()
    cache0 = _cache(num_slots // block_size, block_size, "2d", g).cuda()
    want = cache0.clone()
    indexer_k_quant_and_cache_ref(k, want, sm.cuda(), scale_fmt)
    for cfg in idx_kernel.CONFIG_SWEEP["quant"]:  # every launch configuration the benchmark may pick
        got = cache0.clone()
        with launch_config(idx_kernel.CONFIG, "quant", cfg):
            indexer_k_quant_and_cache(k, got, sm.cuda(), scale_fmt, backend="triton")
        assert torch.equal(got, want), cfg

    lens = ragged_lengths(64, (1, 300), (3000, 9000), 4, g)
    bt, nb = random_block_table(lens, block_size, g)
    cache = _cache(nb, block_size, "2d", g).cuda()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32).cuda()
    n = int(cu[-1])
    k2, s2 = gather_indexer_k(cache, bt.cuda(), cu, num_tokens=n, backend="reference")
    for cfg in idx_kernel.CONFIG_SWEEP["gather"]:
        out = (poison_(torch.empty(n, D, dtype=torch.float8_e4m3fn, device="cuda")), poison_(torch.empty(n, device="cuda")))
        with launch_config(idx_kernel.CONFIG, "gather", cfg):
            k1, s1 = gather_indexer_k(cache, bt.cuda(), cu, out=out, backend="triton")
        assert torch.equal(_bits(k1), _bits(k2)) and torch.equal(_bits(s1), _bits(s2)), cfg
