"""Lightning-indexer logits: dsa.mqa_logits (SPEC.md "Indexer").

Tolerances. Every product of two e4m3 values is exact in fp32 and both the kernels
and the reference accumulate in fp32, so kernel and reference differ only by the
order of fp32 sums. DeepGEMM's criterion ``1 - 2*sum(xy)/sum(x^2+y^2)`` is about the
squared relative error, ~5e-15 for reordered fp32 sums: we require < 1e-12 under the
interpreter. On a GPU, Hopper's fp8 tensor cores accumulate each k-step with fewer
mantissa bits than fp32: measured ~1e-8 in that criterion on an H200 (4096 x 131072
prefill: 8.5e-9; paged decode: 1.0e-8 to 1.2e-8), so GPU tests allow 1e-6 (DeepGEMM's
own tests allow 1e-3).
"""
from __future__ import annotations

import math

import pytest
import torch
from utils import DEVICE, ON_GPU, gen, poison_, random_block_table, record_launches, skip_unless_hopper

from dsa.backend import on_hopper
from dsa.bench import INDEXER_DECODE_SWEEP, INDEXER_PREFILL_SWEEP
from dsa.layouts import indexer_cache_views
from dsa.mqa_logits import (
    fp8_mqa_logits,
    fp8_mqa_logits_ref,
    fp8_paged_mqa_logits,
    fp8_paged_mqa_logits_ref,
    split_prefill_chunks,
)
from dsa.mqa_logits import kernel as K

FP8 = torch.float8_e4m3fn
D = 128
TOL = 1e-6 if ON_GPU else 1e-12


# ----------------------------------------------------------------------------- helpers
def rand_fp8(shape, g, scale=4.0):
    return (torch.randn(shape, generator=g) * scale).to(FP8)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    denom = (x * x + y * y).sum()
    if denom == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)


def assert_logits_match(out: torch.Tensor, ref: torch.Tensor, tol: float = TOL, valid: torch.Tensor | None = None):
    """-inf exactly where the reference has -inf, never NaN, DeepGEMM's criterion on finite entries.
    With ``valid`` (clean_logits=False), only those entries are compared."""
    out, ref = out.cpu(), ref.cpu()
    assert out.shape == ref.shape
    if valid is None:
        assert not torch.isnan(out).any(), "NaN in logits"
        assert torch.equal(out == float("-inf"), ref == float("-inf")), "-inf positions differ"
        fin = torch.isfinite(ref)
    else:
        valid = valid.cpu()
        assert not torch.isnan(out[valid]).any(), "NaN in a valid logit"
        fin = valid
    assert torch.isfinite(out[fin]).all()
    assert fin.any()
    d = calc_diff(out[fin], ref[fin])
    assert d < tol, f"calc_diff {d:.3e} >= {tol:.0e}"


def prefill_inputs(M, N, H, g, empty_rows=(), device=DEVICE):
    q = rand_fp8((M, H, D), g)
    k = rand_fp8((N, D), g)
    k_scale = torch.rand(N, generator=g) * 0.5 + 0.01
    w = torch.randn(M, H, generator=g)
    ks = torch.randint(-3, max(1, N // 2), (M,), generator=g)
    ke = ks + torch.randint(1, N + 4, (M,), generator=g)
    for i in empty_rows:
        ks[i], ke[i] = N // 3, N // 3 - 1
    to = lambda t: t.to(device)  # noqa: E731
    return to(q), (to(k), to(k_scale)), to(w), to(ks.int()), to(ke.int())


def inside_mask(ks, ke, N):
    cols = torch.arange(N, device=ks.device)
    return (cols >= ks[:, None].long()) & (cols < ke[:, None].long())


def build_paged(lens, block_size, g, device=DEVICE, extra_blocks=3):
    """Random fp8 keys + scales per request written through indexer_cache_views into a cache whose
    unused slots hold NaN. Returns (cache [nb, bs*132] uint8, block_table, keys, scales)."""
    bt, nb = random_block_table(lens, block_size, g, extra_blocks=extra_blocks)
    cache = torch.empty(nb, block_size * 132, dtype=torch.uint8)
    values, scales = indexer_cache_views(cache)
    values.view(torch.uint8).fill_(0x7F)  # NaN in e4m3fn
    scales.fill_(float("nan"))
    keys, kscales = [], []
    for r, L in enumerate(lens):
        k = rand_fp8((L, D), g)
        s = torch.rand(L, generator=g) * 0.5 + 0.01
        pos = torch.arange(L)
        blk = bt[r, pos // block_size].long()
        values[blk, pos % block_size] = k
        scales[blk, pos % block_size] = s
        keys.append(k)
        kscales.append(s)
    return cache.to(device), bt.to(device), keys, kscales


def row_limits(context_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """[B, next_n] key limit of each decode row (SPEC)."""
    if context_lens.dim() == 2:
        return context_lens.long()
    return context_lens.long()[:, None] - next_n + torch.arange(next_n, device=context_lens.device) + 1


# ----------------------------------------------------------------------------- reference vs brute force
def test_reference_prefill_bruteforce():
    g = gen(1)
    M, N, H = 3, 7, 4
    q, (k, s), w, ks, ke = prefill_inputs(M, N, H, g, device="cpu")
    ks[0], ke[0] = 2, 5
    out = fp8_mqa_logits_ref(q, (k, s), w, ks, ke)
    for i in range(M):
        for j in range(N):
            if not (ks[i] <= j < ke[i]):
                assert out[i, j] == float("-inf")
                continue
            acc = 0.0
            for h in range(H):
                dot = sum(float(q[i, h, d].float()) * float(k[j, d].float()) for d in range(D))
                acc += float(w[i, h]) * max(dot, 0.0)
            acc *= float(s[j])
            assert math.isclose(float(out[i, j]), acc, rel_tol=1e-5, abs_tol=1e-3), (i, j)
    raw = fp8_mqa_logits_ref(q, (k, s), w, ks, ke, clean_logits=False)
    assert torch.isfinite(raw).all()
    assert torch.equal(raw[torch.isfinite(out)], out[torch.isfinite(out)])


@pytest.mark.parametrize("two_d", [False, True])
def test_reference_paged_bruteforce(two_d):
    g = gen(2)
    lens, next_n, H, bs = [5, 9], 2, 4, 4
    cache, bt, keys, scales = build_paged(lens, bs, g, device="cpu")
    B = len(lens)
    q = rand_fp8((B, next_n, H, D), g)
    w = torch.randn(B * next_n, H, generator=g)
    ctx = torch.tensor(lens, dtype=torch.int32)
    if two_d:
        ctx = torch.tensor([[3, 5], [9, 7]], dtype=torch.int32)
    max_len = 10
    out = fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len)
    qd, wd = q.double(), w.double()
    for b in range(B):
        for j in range(next_n):
            lim = int(ctx[b, j]) if two_d else lens[b] - next_n + j + 1
            for s in range(max_len):
                v = out[b * next_n + j, s]
                if s >= lim:
                    assert v == float("-inf")
                    continue
                dots = (qd[b, j] @ keys[b][s].double()).clamp_min(0)  # [H]
                exp = float((dots * wd[b * next_n + j]).sum() * scales[b][s].double())
                assert math.isclose(float(v), exp, rel_tol=1e-5, abs_tol=1e-3), (b, j, s)


# ----------------------------------------------------------------------------- prefill kernel
PREFILL_CASES = [
    # M, N, H, config override (None: the interpreter's default small tiles)
    (10, 150, 64, None),
    (7, 97, 64, dict(BLOCK_N=16, SPAN=48)),
    (5, 64, 32, None),
    (3, 40, 128, dict(BLOCK_N=16, SPAN=16)),
    (9, 70, 16, None),
]


@pytest.mark.parametrize("M,N,H,cfg", PREFILL_CASES)
@pytest.mark.parametrize("clean", [True, False])
def test_prefill_kernel_vs_reference(M, N, H, cfg, clean):
    g = gen(100 + M + N + H)
    q, kv, w, ks, ke = prefill_inputs(M, N, H, g, empty_rows=(1,))
    out = poison_(torch.empty(M, N, device=DEVICE))
    K.fp8_mqa_logits_triton(q, kv[0], kv[1], w, ks, ke, clean, out, config=cfg)
    ref = fp8_mqa_logits_ref(q, kv, w, ks, ke)
    assert_logits_match(out, ref, valid=None if clean else inside_mask(ks, ke, N))


def test_prefill_public_wrapper_strided_and_out():
    g = gen(7)
    M, N, H = 6, 80, 64
    q, (k, s), w, ks, ke = prefill_inputs(M, N, H, g)
    big_q = rand_fp8((M, H + 8, D), g).to(DEVICE)
    big_q[:, 3:3 + H] = q
    qv = big_q[:, 3:3 + H]  # non-contiguous rows
    big_w = torch.randn(M, H + 5, generator=g).to(DEVICE)
    big_w[:, :H] = w
    k_scale_2d = s[:, None]
    out_buf = poison_(torch.empty(M, N + 16, device=DEVICE))
    out = out_buf[:, 8:8 + N]
    res = fp8_mqa_logits(qv, (k, k_scale_2d), big_w[:, :H], ks, ke, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert_logits_match(out, fp8_mqa_logits_ref(q, (k, s), w, ks, ke))
    assert torch.isnan(out_buf[:, :8]).all() and torch.isnan(out_buf[:, 8 + N:]).all()  # nothing outside out
    ref = fp8_mqa_logits(q, (k, s), w, ks, ke, backend="reference")
    assert torch.equal(ref, fp8_mqa_logits_ref(q, (k, s), w, ks, ke))


def test_prefill_causal_chunk_and_determinism():
    """A prefill chunk at the end of a request (ks = 0, ke = N - M + i + 1), rerun bitwise."""
    g = gen(8)
    M, N, H = 12, 130, 64
    q, kv, w, _, _ = prefill_inputs(M, N, H, g)
    ks = torch.zeros(M, dtype=torch.int32, device=DEVICE)
    ke = (N - M + torch.arange(M) + 1).int().to(DEVICE)
    a = fp8_mqa_logits(q, kv, w, ks, ke)
    b = fp8_mqa_logits(q, kv, w, ks, ke)
    assert torch.equal(a, b)
    assert_logits_match(a, fp8_mqa_logits_ref(q, kv, w, ks, ke))


def test_prefill_empty_shapes():
    g = gen(9)
    q, kv, w, ks, ke = prefill_inputs(4, 8, 64, g)
    assert fp8_mqa_logits(q[:0], kv, w[:0], ks[:0], ke[:0]).shape == (0, 8)
    k0 = (kv[0][:0], kv[1][:0])
    assert fp8_mqa_logits(q, k0, w, ks, ke).shape == (4, 0)


# ----------------------------------------------------------------------------- paged kernel
def _paged_case(lens, bs, next_n, two_d, H, g, max_len=None):
    cache, bt, keys, scales = build_paged(lens, bs, g)
    B = len(lens)
    q = rand_fp8((B, next_n, H, D), g).to(DEVICE)
    w = torch.randn(B * next_n, H, generator=g).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32)
    if two_d:  # each row its own limit <= L_b, not monotone in j
        ctx = torch.stack([torch.randint(0, L + 1, (next_n,), generator=g) for L in lens]).int()
        ctx[:, -1] = torch.tensor(lens)
    ctx = ctx.to(DEVICE)
    max_len = max(lens) if max_len is None else max_len
    return q, cache, w, ctx, bt, max_len, keys, scales


PAGED_CASES = [
    # lens, block size, next_n, 2-D context_lens, H
    ([37, 5, 70], 16, 1, False, 64),
    ([37, 5, 70], 16, 2, True, 64),
    ([19, 33], 1, 2, False, 64),
    ([19, 1, 33], 1, 3, True, 64),
    ([100, 67], 64, 4, False, 64),
    ([130, 3], 64, 1, True, 64),
    ([300, 45], 256, 2, False, 64),
    ([21, 2, 40], 4, 4, True, 64),
    ([50, 29], 8, 2, False, 32),
    ([35], 2, 1, False, 128),
]


@pytest.mark.parametrize("lens,bs,next_n,two_d,H", PAGED_CASES)
def test_paged_kernel_vs_reference_and_nonpaged(lens, bs, next_n, two_d, H):
    g = gen(1000 + bs * 7 + next_n + len(lens))
    q, cache, w, ctx, bt, max_len, keys, scales = _paged_case(lens, bs, next_n, two_d, H, g)
    out = poison_(torch.empty(len(lens) * next_n, max_len, device=DEVICE))
    res = fp8_paged_mqa_logits(q, cache, w, ctx, bt, max_len, out=out)
    assert res.data_ptr() == out.data_ptr()
    ref = fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len)
    assert_logits_match(out, ref)
    # equal to the prefill op on the same keys, row by row
    lim = row_limits(ctx, next_n).clamp(0, max_len)
    for b, L in enumerate(lens):
        rows = slice(b * next_n, (b + 1) * next_n)
        k = keys[b].to(DEVICE)
        s = scales[b].to(DEVICE)
        ks = torch.zeros(next_n, dtype=torch.int32, device=DEVICE)
        flat = fp8_mqa_logits(q[b], (k, s), w[rows], ks, lim[b].int())
        part = out[rows, :L]
        assert torch.equal(part == float("-inf"), flat == float("-inf"))
        fin = torch.isfinite(flat)
        if fin.any():
            assert calc_diff(part[fin], flat[fin]) < TOL
        assert (out[rows, L:] == float("-inf")).all()


def test_paged_views_max_len_and_unclean():
    g = gen(11)
    lens, bs, next_n, H = [45, 12], 16, 2, 64
    q, cache, w, ctx, bt, _, _, _ = _paged_case(lens, bs, next_n, False, H, g)
    # every accepted view of the cache gives the same bits
    a = fp8_paged_mqa_logits(q, cache, w, ctx, bt, 60)
    b = fp8_paged_mqa_logits(q, cache.view(cache.shape[0], bs, 132), w, ctx, bt, 60)
    c = fp8_paged_mqa_logits(q, cache.view(cache.shape[0], bs, 1, 132), w, ctx, bt, 60)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.equal(a, fp8_paged_mqa_logits(q, cache, w, ctx, bt, 60))  # deterministic
    assert_logits_match(a, fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, 60))
    # max_context_len below the contexts truncates
    t = fp8_paged_mqa_logits(q, cache, w, ctx, bt, 20)
    assert torch.equal(t, a[:, :20])
    # clean_logits=False: valid entries equal, never NaN (unused slots hold NaN)
    out = poison_(torch.empty(len(lens) * next_n, 60, device=DEVICE))
    fp8_paged_mqa_logits(q, cache, w, ctx, bt, 60, clean_logits=False, out=out)
    valid = torch.arange(60, device=DEVICE)[None, :] < row_limits(ctx, next_n).reshape(-1, 1)
    assert torch.equal(out[valid], a[valid])
    # ... and nothing it writes is NaN, not even outside the rows' ranges (the NaN slots are never read)
    out.fill_(7.0)
    fp8_paged_mqa_logits(q, cache, w, ctx, bt, 60, clean_logits=False, out=out)
    assert not torch.isnan(out).any()
    # reference backend through the public wrapper
    assert torch.equal(fp8_paged_mqa_logits(q, cache, w, ctx, bt, 60, backend="reference"),
                       fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, 60))


@pytest.mark.parametrize("cfg", [dict(BLOCK_N=16, SPAN=16, PREFETCH=3), dict(BLOCK_N=32, SPAN=96, PREFETCH=0),
                                 dict(BLOCK_N=16, SPAN=48, PREFETCH=0), dict(BLOCK_N=16, SPAN=48, PREFETCH=2),
                                 dict(BLOCK_N=32, SPAN=32, PREFETCH=2, MAXNREG=128),
                                 dict(BLOCK_N=16, SPAN=48, PREFETCH=3), dict(BLOCK_N=32, SPAN=64, PREFETCH=3)])
def test_paged_kernel_configs(cfg):
    """Other tilings (tile inside one block, tiles spanning blocks, spans of several tiles), the loop
    without hand prefetching, the one with everything prefetched by hand, and the span's block table
    loaded up front (tiles inside one block; with BLOCK_N 32 over 16-key blocks it falls back)."""
    g = gen(12)
    lens, bs, next_n, H = [81, 30, 1], 16, 2, 64
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case(lens, bs, next_n, True, H, g, max_len=90)
    out = poison_(torch.empty(len(lens) * next_n, max_len, device=DEVICE))
    K.fp8_paged_mqa_logits_triton(q, cache, w, ctx, bt, max_len, True, out, config=cfg)
    assert_logits_match(out, fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len))


@pytest.mark.parametrize("span", [48, 80, 128])
def test_paged_table_ahead_spans_across_blocks(span):
    """PREFETCH 3 with spans that start and end inside blocks (span not a multiple of the block size)."""
    g = gen(15)
    lens, bs, next_n = [300, 129, 64, 5], 64, 2
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case(lens, bs, next_n, True, 64, g, max_len=310)
    out = poison_(torch.empty(len(lens) * next_n, max_len, device=DEVICE))
    K.fp8_paged_mqa_logits_triton(q, cache, w, ctx, bt, max_len, True, out,
                                  config=dict(gluon=False, BLOCK_N=16, SPAN=span, PREFETCH=3))
    assert_logits_match(out, fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len))


def test_paged_config_rejects_unknown_prefetch():
    g = gen(14)
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case([20], 16, 1, True, 64, g, max_len=20)
    out = torch.empty(1, max_len, device=DEVICE)
    with pytest.raises(ValueError, match="PREFETCH"):
        K.fp8_paged_mqa_logits_triton(q, cache, w, ctx, bt, max_len, True, out, config=dict(PREFETCH=1))


def test_paged_short_contexts():
    """L_b < next_n (rows with no key at all) and L_b == 0."""
    g = gen(13)
    lens, bs, next_n, H = [2, 0, 5], 4, 4, 64
    q, cache, w, ctx, bt, _, _, _ = _paged_case([max(L, 1) for L in lens], bs, next_n, False, H, g)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = fp8_paged_mqa_logits(q, cache, w, ctx, bt, 6)
    ref = fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, 6)
    assert_logits_match(out, ref)
    assert (out[4:8] == float("-inf")).all() and (out[0:2] == float("-inf")).all()


# ----------------------------------------------------------------------------- validation
def _good_prefill():
    g = gen(20)
    return prefill_inputs(4, 16, 64, g)


def _good_paged():
    g = gen(21)
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case([9, 5], 4, 2, False, 64, g)
    return q, cache, w, ctx, bt, max_len


def _bad_prefill_cases():
    q, kv, w, ks, ke = _good_prefill()
    k, s = kv
    return [
        (dict(q=q.float()), TypeError, "q"),
        (dict(q=q[:, :, :64]), ValueError, "q"),
        (dict(q=torch.empty(4, 48, D, dtype=FP8, device=DEVICE), w=w[:, :48].contiguous()), ValueError, "q"),
        (dict(q=rand_fp8((4, 64, 2 * D), gen(0)).to(DEVICE)[:, :, ::2]), ValueError, "q"),
        (dict(kv=k), TypeError, "kv"),
        (dict(kv=(k.to(torch.bfloat16), s)), TypeError, "kv[0]"),
        (dict(kv=(k, s.double())), TypeError, "kv[1]"),
        (dict(kv=(k, s[:-1])), ValueError, "kv[1]"),
        (dict(w=w.to(torch.bfloat16)), TypeError, "weights"),
        (dict(w=w[:, :32]), ValueError, "weights"),
        (dict(ks=ks.long()), TypeError, "cu_seqlen_ks"),
        (dict(ke=ke[:3]), ValueError, "cu_seqlen_ke"),
        (dict(clean=1), TypeError, "clean_logits"),
        (dict(out=torch.empty(4, 15, device=DEVICE)), ValueError, "out"),
        (dict(out=torch.empty(4, 16, dtype=torch.float16, device=DEVICE)), TypeError, "out"),
        (dict(backend="cuda"), ValueError, "backend"),
    ]


@pytest.mark.parametrize("idx", range(16))
def test_prefill_validation(idx):
    q, (k, s), w, ks, ke = _good_prefill()
    cases = _bad_prefill_cases()
    assert len(cases) == 16  # (every case parametrised)
    bad, exc, name = cases[idx]
    args = dict(q=q, kv=(k, s), w=w, ks=ks, ke=ke, clean=True, out=None, backend=None)
    args.update(bad)
    with pytest.raises(exc, match=name.replace("[", r"\[").replace("]", r"\]")):
        fp8_mqa_logits(args["q"], args["kv"], args["w"], args["ks"], args["ke"], args["clean"],
                       out=args["out"], backend=args["backend"])


def _bad_paged_cases():
    q, cache, w, ctx, bt, max_len = _good_paged()
    nb = cache.shape[0]
    return [
        (dict(q=q.float()), TypeError, "q"),
        (dict(q=q[:, :, :, :64]), ValueError, "q"),
        (dict(q=q[:, :1].expand(2, 8, 64, D), w=torch.zeros(16, 64, device=DEVICE)), ValueError, "next_n"),
        (dict(cache=cache.view(torch.int8)), TypeError, "cache"),
        (dict(cache=cache[:, :100]), ValueError, "cache"),
        # rows of a wider buffer: the blocks' view would be a copy of the whole cache
        (dict(cache=torch.zeros(nb, cache.shape[1] // 132, 136, dtype=torch.uint8, device=DEVICE)[:, :, :132]),
         ValueError, "cache: expected a contiguous"),
        (dict(cache=torch.zeros(nb, 3 * 132, dtype=torch.uint8, device=DEVICE)), ValueError, "block size"),
        (dict(w=w[:2]), ValueError, "weights"),
        (dict(ctx=ctx.long()), TypeError, "context_lens"),
        (dict(ctx=ctx[:, None].expand(2, 3).contiguous()), ValueError, "context_lens"),
        (dict(bt=bt.long()), TypeError, "block_table"),
        (dict(bt=bt[:1]), ValueError, "block_table"),
        (dict(max_len=-1), ValueError, "max_context_len"),
        (dict(max_len=3.0), ValueError, "max_context_len"),
        (dict(out=torch.empty(4, max_len + 1, device=DEVICE)), ValueError, "out"),
    ]


@pytest.mark.parametrize("idx", range(15))
def test_paged_validation(idx):
    q, cache, w, ctx, bt, max_len = _good_paged()
    cases = _bad_paged_cases()
    assert len(cases) == 15  # (every case parametrised)
    bad, exc, name = cases[idx]
    args = dict(q=q, cache=cache, w=w, ctx=ctx, bt=bt, max_len=max_len, out=None)
    args.update(bad)
    with pytest.raises(exc, match=name):
        fp8_paged_mqa_logits(args["q"], args["cache"], args["w"], args["ctx"], args["bt"], args["max_len"],
                             out=args["out"])


def test_device_mismatch():
    if not ON_GPU:
        pytest.skip("needs two devices")
    q, kv, w, ks, ke = _good_prefill()
    with pytest.raises(ValueError, match="weights"):
        fp8_mqa_logits(q, kv, w.cpu(), ks, ke)


# ----------------------------------------------------------------------------- chunk helper
def test_split_prefill_chunks_budget_and_cover():
    g = gen(30)
    for trial in range(20):
        M = int(torch.randint(1, 60, (1,), generator=g))
        N = int(torch.randint(1, 500, (1,), generator=g))
        ks = torch.randint(-5, N, (M,), generator=g)
        ke = ks + torch.randint(-3, N, (M,), generator=g)
        budget = int(torch.randint(4 * N + 4, 40 * N, (1,), generator=g))
        chunks = split_prefill_chunks(ks.int(), ke.int(), N, budget)
        pos = 0
        for start, end, k0, k1 in chunks:
            assert start == pos and end > start
            pos = end
            assert (end - start) * (k1 - k0) * 4 <= budget
            assert 0 <= k0 <= k1 <= N
            for i in range(start, end):
                a, b = max(0, min(int(ks[i]), N)), max(0, min(int(ke[i]), N))
                if a < b:
                    assert k0 <= a and b <= k1
        assert pos == M
    with pytest.raises(ValueError, match="max_logits_bytes"):
        split_prefill_chunks([0], [100], 100, 399)
    assert split_prefill_chunks([], [], 10) == []


def test_split_prefill_chunks_logits():
    g = gen(31)
    M, N, H = 11, 120, 64
    q, (k, s), w, _, _ = prefill_inputs(M, N, H, g)
    ks = torch.tensor([0, 0, 0, 40, 40, 40, 40, 90, 90, 90, 90], dtype=torch.int32, device=DEVICE)
    ke = ks + torch.tensor([5, 10, 30, 20, 30, 45, 50, 10, 20, 25, 30], dtype=torch.int32, device=DEVICE)
    full = fp8_mqa_logits(q, (k, s), w, ks, ke)
    chunks = split_prefill_chunks(ks, ke, N, max_logits_bytes=4 * 3 * 50)
    assert len(chunks) > 2
    for start, end, k0, k1 in chunks:
        part = fp8_mqa_logits(q[start:end], (k[k0:k1], s[k0:k1]), w[start:end], ks[start:end] - k0, ke[start:end] - k0)
        assert part.shape == (end - start, k1 - k0)
        ref = full[start:end, k0:k1]
        assert torch.equal(part == float("-inf"), ref == float("-inf"))
        fin = torch.isfinite(ref)
        assert calc_diff(part[fin], ref[fin]) < TOL
        outside = torch.cat([full[start:end, :k0], full[start:end, k1:]], dim=1)
        assert (outside == float("-inf")).all()


# ----------------------------------------------------------------------------- GPU: larger shapes
@pytest.mark.gpu
@pytest.mark.parametrize("M,N", [(777, 20000), (256, 70001)])
def test_gpu_prefill_large(M, N):
    g = gen(40 + M)
    q, kv, w, _, _ = prefill_inputs(M, N, 64, g)
    ks = torch.randint(0, N // 2, (M,), generator=g).int().to(DEVICE)
    ke = (ks + torch.randint(0, N // 2, (M,), generator=g).int().to(DEVICE)).clamp_max(N)
    out = poison_(torch.empty(M, N, device=DEVICE))
    fp8_mqa_logits(q, kv, w, ks, ke, out=out)
    assert_logits_match(out, fp8_mqa_logits_ref(q, kv, w, ks, ke))
    again = fp8_mqa_logits(q, kv, w, ks, ke)
    assert torch.equal(again, out)


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [1, 16, 64, 256])
@pytest.mark.parametrize("next_n,two_d", [(1, False), (2, False), (2, True), (3, True), (4, False)])
def test_gpu_paged_large(bs, next_n, two_d):
    g = gen(50 + bs + next_n)
    lens = [int(x) for x in torch.randint(1, 9000, (12,), generator=g)]
    lens[0] = 17000
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case(lens, bs, next_n, two_d, 64, g)
    out = poison_(torch.empty(len(lens) * next_n, max_len, device=DEVICE))
    fp8_paged_mqa_logits(q, cache, w, ctx, bt, max_len, out=out)
    assert_logits_match(out, fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len))
    assert torch.equal(out, fp8_paged_mqa_logits(q, cache, w, ctx, bt, max_len))


# every launch configuration the benchmark's sweep may pick (one list, in dsa.bench), plus one more shape of tile
GPU_PREFILL_CONFIGS = INDEXER_PREFILL_SWEEP + [dict(BLOCK_Q=2, BLOCK_N=128, SPAN=8192, num_warps=8, num_stages=2)]
GPU_PAGED_CONFIGS = INDEXER_DECODE_SWEEP


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_PREFILL_CONFIGS)
def test_gpu_prefill_configs(cfg):
    g = gen(60)
    M, N = 301, 9000
    q, kv, w, ks, ke = prefill_inputs(M, N, 64, g, empty_rows=(5,))
    out = poison_(torch.empty(M, N, device=DEVICE))
    K.fp8_mqa_logits_triton(q, kv[0], kv[1], w, ks, ke, True, out, config=cfg)
    assert_logits_match(out, fp8_mqa_logits_ref(q, kv, w, ks, ke))


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_PAGED_CONFIGS)
@pytest.mark.parametrize("bs,next_n", [(64, 2), (1, 1), (16, 4)])
def test_gpu_paged_configs(cfg, bs, next_n):
    g = gen(70 + bs + next_n)
    lens = [int(x) for x in torch.randint(1, 5000, (6,), generator=g)]
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case(lens, bs, next_n, True, 64, g, max_len=5100)
    out = poison_(torch.empty(len(lens) * next_n, max_len, device=DEVICE))
    K.fp8_paged_mqa_logits_triton(q, cache, w, ctx, bt, max_len, True, out, config=cfg)
    assert_logits_match(out, fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len))


@pytest.mark.parametrize("bs,block_n,span", [(1, 16, 32), (16, 16, 48), (64, 32, 64)])
def test_gather_ceiling_walk(bs, block_n, span):
    """benchmarks/gather_ceiling.py's read-only walk (the access-pattern ceiling it reports must come
    from a kernel that reads exactly the keys the logits kernel reads): per key, the sum of its 128
    bytes times its scale, against PyTorch; NaN in unused slots never read, nothing past a request's
    context written."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    from gather_ceiling import touch

    g = gen(16)
    lens = [70, 5, 33]
    cache, bt, keys, scales = build_paged(lens, bs, g)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    max_len = 80
    out = poison_(torch.empty(len(lens), max_len, device=DEVICE))
    touch(cache, ctx, bt, max_len, out, block_n, span)
    for b, L in enumerate(lens):
        want = keys[b].view(torch.uint8).to(torch.int32).sum(1).float() * scales[b]
        torch.testing.assert_close(out[b, :L].cpu(), want, rtol=1e-6, atol=0)
        assert out[b, L:].isnan().all()  # still the poison: nothing written past the context


# ----------------------------------------------------------------------------- GPU: the Hopper (Gluon) decode kernel
def _paged_sm90_or_skip():
    from dsa.mqa_logits import kernel_sm90

    skip_unless_hopper()
    return kernel_sm90


@pytest.mark.gpu
@pytest.mark.parametrize("lens,bs,next_n,two_d,H,gcfg", [
    ([5000, 1, 63, 64, 65, 2100], 64, 1, False, 64, None),
    ([5000, 1, 63, 64, 65, 2100], 64, 2, False, 64, None),
    ([4000, 3, 129, 1025], 64, 2, True, 64, dict(SPAN=2048, STAGES=3)),
    ([3000, 70, 1], 32, 2, True, 64, None),  # two TMA copies per tile
    ([3000, 70, 5], 32, 4, False, 64, dict(SPAN=64, STAGES=2)),  # one tile per program
    ([2500, 300, 2], 128, 3, True, 64, None),  # tiles inside a block, not at its start
    ([2500, 257], 256, 4, True, 64, dict(SPAN=192, STAGES=5)),  # spans not a multiple of the block
    ([1500, 77], 64, 2, False, 128, None),
    ([1500, 77, 900], 64, 1, True, 32, None),
    ([1500, 77, 900], 64, 4, False, 16, None),
    # below 32 keys per block: cp.async copies, 4-byte (block 1), 8-byte (block 2) or 16-byte pieces
    ([3000, 70, 1, 129], 1, 1, False, 64, dict(SPAN=1024, STAGES=3)),  # not the default dispatch's choice
    ([3000, 70, 1, 129], 1, 2, True, 64, None),
    ([2000, 333], 2, 3, False, 64, dict(SPAN=128, STAGES=2)),
    ([2000, 333, 64], 4, 4, True, 32, None),
    ([2500, 17, 640], 16, 2, False, 64, None),
    ([2500, 17], 8, 1, True, 128, dict(SPAN=4096, STAGES=6)),
    ([3000, 70, 1, 129], 1, 2, True, 64, dict(SPAN=2048, STAGES=3)),
    ([2000, 65, 64], 1, 3, True, 32, dict(SPAN=64, STAGES=3)),  # one tile per program
    ([1000, 5], 1, 4, False, 64, None),  # two warpgroups: a warp's keys (key % 8) in the compact layout
    ([1000, 5, 77], 16, 4, False, 64, dict(SPAN=1024, STAGES=2)),  # two warpgroups, 4 keys per copy
])
def test_gpu_paged_sm90(lens, bs, next_n, two_d, H, gcfg, monkeypatch):
    """The Hopper kernel against the reference and against the Triton kernel: block sizes 1-256, next_n 1-4,
    1-D and 2-D context lengths, every head count, contexts not multiples of a tile, NaN in every unused cache
    slot, out poisoned; bitwise deterministic; and the launch really took it."""
    mod = _paged_sm90_or_skip()
    calls = record_launches(monkeypatch, mod)
    g = gen(80 + bs + next_n + H)
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case(lens, bs, next_n, two_d, H, g, max_len=max(lens) + 70)
    cfg = None if gcfg is None else dict(gluon=gcfg)
    outs = []
    for _ in range(2):
        out = poison_(torch.empty(len(lens) * next_n, max_len, device=DEVICE))
        K.fp8_paged_mqa_logits_triton(q, cache, w, ctx, bt, max_len, True, out, config=cfg)
        outs.append(out)
    assert len(calls) == 2
    assert_logits_match(outs[0], fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len))
    assert torch.equal(outs[0], outs[1])
    portable = K.fp8_paged_mqa_logits_triton(q, cache, w, ctx, bt, max_len, True, torch.empty_like(outs[0]),
                                             config=dict(gluon=False))
    assert len(calls) == 2
    assert_logits_match(outs[0], portable)
    # clean_logits=False: the valid entries are the same, nothing written is NaN (NaN slots are copied, never used)
    out = torch.full_like(outs[0], 7.0)
    K.fp8_paged_mqa_logits_triton(q, cache, w, ctx, bt, max_len, False, out, config=cfg)
    valid = torch.arange(max_len, device=DEVICE)[None, :] < row_limits(ctx, next_n).reshape(-1, 1)
    assert torch.equal(out[valid], outs[0][valid])
    assert not torch.isnan(out).any()


@pytest.mark.gpu
@pytest.mark.parametrize("bs", [64, 16, 1])
def test_gpu_paged_sm90_invalid_table_entries_and_fallbacks(bs, monkeypatch):
    """Block-table entries outside [0, num_blocks) where a row needs a block: nothing is read for them, their
    logits are 0 as in the Triton kernel, the rest is unchanged. Calls the kernel does not serve (a cache not
    starting on a 16-byte boundary, rows of a wider allocation) run the Triton kernel."""
    mod = _paged_sm90_or_skip()
    calls = record_launches(monkeypatch, mod)
    g = gen(91 + bs)
    lens, next_n = [700, 300], 2
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case(lens, bs, next_n, False, 64, g)
    ref = fp8_paged_mqa_logits(q, cache, w, ctx, bt, max_len)
    bad = bt.clone()
    bad[0, 3], bad[1, 1] = -1, cache.shape[0] + 5
    got = fp8_paged_mqa_logits(q, cache, w, ctx, bad, max_len)
    portable = K.fp8_paged_mqa_logits_triton(q, cache, w, ctx, bad, max_len, True, torch.empty_like(got),
                                             config=dict(gluon=False))
    assert len(calls) == 2
    hit = torch.zeros_like(got, dtype=torch.bool)
    hit[0:2, 3 * bs:4 * bs] = True
    hit[2:4, bs:2 * bs] = True
    hit &= got != float("-inf")
    assert hit.any() and (got[hit] == 0).all() and (portable[hit] == 0).all()
    assert_logits_match(got, portable)
    assert torch.equal(got[~hit], ref[~hit])
    # not served: a cache not starting on a 16-byte boundary; rows of a wider allocation
    buf = torch.zeros(cache.numel() + 4, dtype=torch.uint8, device=DEVICE)
    shifted = buf[4:].view(cache.shape)
    shifted.copy_(cache)
    assert not mod.supported(q, shifted)
    assert_logits_match(fp8_paged_mqa_logits(q, shifted, w, ctx, bt, max_len), ref)
    wide = torch.zeros(cache.shape[0], cache.shape[1] + 16, dtype=torch.uint8, device=DEVICE)
    wide[:, :cache.shape[1]] = cache
    assert not mod.supported(q, wide[:, :cache.shape[1]])
    assert len(calls) == 2
    # block size 1 with next_n 1: the default dispatch takes this kernel too
    q1, cache1, w1, ctx1, bt1, len1, _, _ = _paged_case([300, 40], 1, 1, False, 64, g)
    assert mod.supported(q1, cache1)
    assert_logits_match(fp8_paged_mqa_logits(q1, cache1, w1, ctx1, bt1, len1),
                        fp8_paged_mqa_logits_ref(q1, cache1, w1, ctx1, bt1, len1))
    assert len(calls) == 3


def test_paged_hopper_compact_key_layout():
    """The Hopper kernel's cp.async layouts at block sizes below 32: the compact key layout (one key per lane) must
    give each warp exactly the keys that the copy layout gives it, so that spreading the key offsets to the copy
    layout stays inside the warp. A warp's copy covers one key (block 1: key % warps) or 4 adjacent keys
    ((key // 4) % warps). Checked from the layout's bases, for one and two warpgroups."""
    from dsa.mqa_logits import kernel_sm90

    for bs in (1, 2, 4, 8, 16):
        for wgs in (1, 2):
            vec, cp_l, lay = kernel_sm90._cp_layouts(bs, wgs)
            nw, per_copy = 4 * wgs, 1 if bs == 1 else 4
            assert vec == min(16, 4 * bs) and cp_l.threads_per_warp == [per_copy, 32 // per_copy]
            assert lay.shape == [64] and not lay.reg_bases and len(lay.lane_bases) == 5
            assert len(lay.warp_bases) == nw.bit_length() - 1
            held = {}
            for warp in range(nw):
                for lane in range(32):
                    key = 0
                    for b, (base, ) in enumerate(lay.lane_bases):
                        key ^= base if lane >> b & 1 else 0
                    for b, (base, ) in enumerate(lay.warp_bases):
                        key ^= base if warp >> b & 1 else 0
                    held.setdefault(key, set()).add(warp)
            assert sorted(held) == list(range(64))
            assert all(ws == {(k // per_copy) % nw} for k, ws in held.items()), (bs, wgs)


def test_paged_hopper_kernel_choice_rules():
    """Which decode kernel a call gets (the rules the H200 measurements chose, BENCHMARKS.md): the Hopper kernel
    wherever it is supported, with a launch of whole tiles and at least two stages; never off an sm_90 GPU or under
    the interpreter."""
    from dsa.mqa_logits import kernel_sm90

    for bs in (1, 2, 4, 16, 32, 64, 256):
        for nn in (1, 2, 4):
            cfg = kernel_sm90.default_config(bs, nn)
            assert cfg["SPAN"] % 64 == 0 and cfg["STAGES"] >= 2
    if not on_hopper(torch.device(DEVICE)):
        q = torch.zeros(1, 1, 64, D, dtype=FP8, device=DEVICE)
        cache = torch.zeros(3, 64 * 132, dtype=torch.uint8, device=DEVICE)
        assert not kernel_sm90.supported(q, cache)
