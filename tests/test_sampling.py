"""Next-token choice (``dsa.sampling``): greedy is argmax; sampled tokens follow softmax(logits / T) over the
top-p nucleus (frequencies of many seeded draws of the reference against the exact probabilities, within 5 standard
deviations); the Triton kernel picks the reference's tokens (random rows of every dtype and shape, masked
vocabulary, ties, candidates outside the nucleus); each row depends only on its own logits and seed (not on the
batch around it); the hash's uniforms are uniform and never 1, and the row seeds distinct. Engine and ``generate``
agreement under sampling is in tests/test_engine.py."""
from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl
from utils import DEVICE, ON_GPU

import dsa.sampling.kernel as K

from dsa.sampling import (gumbel, nucleus, nucleus_ref, row_seed, sample_tokens, sample_tokens_ref, scaled_logits,
                          uniforms)
from dsa.sampling.reference import U_BITS, _mix32, inv_temperature, uniform_of_hash

N = 40_000  # draws per distribution: 5 sigma of a frequency p is 5 sqrt(p (1 - p) / N) <= 0.0125
CASES = [(1.0, 1.0), (0.6, 1.0), (1.7, 1.0), (1.0, 0.8), (0.5, 0.5), (2.0, 0.95)]


def _nucleus_probs(z: torch.Tensor, T: float, top_p: float) -> torch.Tensor:
    """The exact distribution: softmax(z / T) in float64, cut to the nucleus (the tokens whose preceding mass in
    descending order is below top_p), renormalised."""
    p = torch.softmax(z.double() / T, 0)
    q = p * nucleus_ref(z.double()[None] / T, top_p)[0]
    return q / q.sum()


def _seeds(n: int, run: int = 0, device="cpu") -> torch.Tensor:
    return torch.tensor([row_seed(run, i, 7) for i in range(n)], dtype=torch.int64, device=device)


@pytest.mark.parametrize("T,top_p", CASES)
def test_frequencies_follow_the_nucleus_distribution(T, top_p):
    g = torch.Generator().manual_seed(int(T * 10 + top_p * 100))
    z = torch.randn(12, generator=g) * 1.5
    want = _nucleus_probs(z, T, top_p)
    tok = sample_tokens(z.expand(N, -1), _seeds(N), T, top_p, backend="reference")
    freq = torch.bincount(tok, minlength=12).double() / N
    sigma = torch.sqrt(want * (1 - want) / N)
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (freq, want)
    assert torch.all(freq[want == 0] == 0)  # never a token outside the nucleus
    if top_p < 1.0:
        assert (want == 0).any()  # (the cases do cut the tail)


@pytest.mark.parametrize("T,top_p", CASES)
def test_kernel_draws_the_reference_tokens_of_the_frequency_cases(T, top_p):
    """The kernel on the frequency test's rows (the same logits in every row, a stride-0 view) picks the reference's
    token in each of 300 (CPU interpreter) or all 40,000 (GPU) draws, so its frequencies are those measured above."""
    g = torch.Generator().manual_seed(int(T * 10 + top_p * 100))
    z = (torch.randn(12, generator=g) * 1.5).to(DEVICE)
    n = N if ON_GPU else 300
    seeds = _seeds(n, device=DEVICE)
    got = sample_tokens(z.expand(n, -1), seeds, T, top_p, backend="triton")
    assert torch.equal(got, sample_tokens_ref(z.expand(n, -1), seeds, T, top_p))


@pytest.mark.parametrize("B,V", [(1, 7), (5, 1000), (3, 129280)])
def test_nucleus_equals_the_row_by_row_sorted_rule(B, V):
    """The nucleus from one 1-D sort of (row, logit bits) keys equals the rule written out row by row: a stable
    descending sort, the tokens whose preceding mass is below top_p (the first always), with ties (equal logits,
    +0.0 against -0.0), masked tokens (-inf) and probabilities that underflow to 0 in the rows."""
    g = torch.Generator().manual_seed(B * V)
    z = torch.randn(B, V, generator=g) * 4
    z[:, 3] = z[:, 5]  # a tie
    z[:, 1], z[:, 2] = 0.0, -0.0  # equal logits too (scaled_logits makes -0.0 +0.0)
    z[:, -(V // 3):] = -200.0  # probabilities that underflow to 0
    if V > 10:
        z[:, 8] = float("-inf")
    z = scaled_logits(z, 1.0)
    for top_p in (1e-3, 0.3, 0.9, 0.999, 1.0):
        assert torch.equal(nucleus(z, top_p), nucleus_ref(z, top_p)), top_p


def test_greedy_is_argmax_first_of_ties():
    z = torch.randn(5, 300, generator=torch.Generator().manual_seed(1))
    z[2, 10] = z[2, 200] = z[2].max() + 1  # a tie: the first index wins
    for T in (0.0, -1.0):
        got = sample_tokens(z, None, T)
        assert torch.equal(got, torch.argmax(z, -1)) and int(got[2]) == 10
    assert torch.equal(sample_tokens(z.bfloat16(), None, 0.0), torch.argmax(z.bfloat16(), -1))


def test_rows_depend_only_on_their_own_logits_and_seed():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(9, 1000, generator=g) * 3
    seeds = torch.tensor([row_seed(3, r, k) for r, k in zip(range(9), range(5, 14))])
    full = sample_tokens(z, seeds, 0.9, 0.9)
    perm = torch.randperm(9, generator=g)
    assert torch.equal(sample_tokens(z[perm], seeds[perm], 0.9, 0.9), full[perm])
    for i in range(9):
        assert torch.equal(sample_tokens(z[i:i + 1], seeds[i:i + 1], 0.9, 0.9), full[i:i + 1])
    # another seed moves some draws; the same one repeats them
    other = torch.tensor([row_seed(4, r, k) for r, k in zip(range(9), range(5, 14))])
    assert not torch.equal(sample_tokens(z, other, 0.9, 0.9), full)
    assert torch.equal(sample_tokens(z, seeds, 0.9, 0.9), full)


def test_peaked_logits_and_low_temperature_give_the_argmax():
    z = torch.randn(64, 500, generator=torch.Generator().manual_seed(5))
    z[torch.arange(64), torch.arange(64) * 7] += 60.0  # one token carries all the mass
    assert torch.equal(sample_tokens(z, _seeds(64), 1.0, 1.0), torch.arange(64) * 7)
    assert torch.equal(sample_tokens(z, _seeds(64), 1.0, 1e-6), torch.arange(64) * 7)


def test_uniforms_and_row_seeds():
    s = _seeds(2000, run=11)
    u = uniforms(s, 257).double()
    assert u.min() > 0 and u.max() < 1
    # mean and variance of 514,000 uniforms; every vocabulary column and every row uniform too
    assert abs(u.mean() - 0.5) < 5 * math.sqrt(1 / 12 / u.numel())
    assert abs(u.var() - 1 / 12) < 1e-3
    assert (u.mean(0) - 0.5).abs().max() < 5 * math.sqrt(1 / 12 / 2000)
    assert (u.mean(1) - 0.5).abs().max() < 5 * math.sqrt(1 / 12 / 257)
    # neighbouring rows and columns are uncorrelated
    c = u - 0.5
    assert abs(float((c[1:] * c[:-1]).mean())) < 5 / 12 / math.sqrt(c[1:].numel())
    assert abs(float((c[:, 1:] * c[:, :-1]).mean())) < 5 / 12 / math.sqrt(c[:, 1:].numel())
    seeds = {row_seed(sd, r, k) for sd in range(3) for r in range(30) for k in range(30)}
    assert len(seeds) == 3 * 30 * 30 and all(0 <= x < 2 ** 63 for x in seeds)
    assert row_seed(1, 2, 3) == row_seed(1, 2, 3)


def test_bad_arguments_are_refused():
    z = torch.randn(3, 10)
    with pytest.raises(ValueError, match="top_p"):
        sample_tokens(z, _seeds(3), 1.0, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        sample_tokens(z, _seeds(3), 1.0, 1.5)
    with pytest.raises(ValueError, match="seeds"):
        sample_tokens(z, _seeds(2), 1.0)
    with pytest.raises(ValueError, match="seeds"):
        sample_tokens(z, None, 1.0)
    with pytest.raises(ValueError, match="logits: expected 2 dims"):
        sample_tokens(z[0], None, 0.0)
    with pytest.raises(TypeError, match="seeds: expected dtype int64"):
        sample_tokens(z, _seeds(3).int(), 1.0)
    with pytest.raises(TypeError, match="logits: expected dtype"):
        sample_tokens(z.double(), _seeds(3), 1.0)
    with pytest.raises(TypeError, match="out: expected dtype int64"):
        sample_tokens(z, _seeds(3), 1.0, out=torch.empty(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="out: expected shape"):
        sample_tokens(z, None, 0.0, out=torch.empty(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="logits: expected the last dim to be contiguous"):
        sample_tokens(z.t(), _seeds(10), 1.0)
    with pytest.raises(ValueError, match="seeds: expected the last dim to be contiguous"):
        sample_tokens(z, _seeds(6)[::2], 1.0)


def test_the_largest_hash_gives_a_uniform_below_one():
    """u = 1 would make g = +inf: that token drawn whatever its probability. With 24 bits of the hash, 2**24 - 0.5
    rounds to 2**24 in fp32; with 23 every u is exact and inside (0, 1)."""
    h = torch.tensor([0, 1 << 8, (1 << 32) - 1, (1 << 32) - (1 << 8)], dtype=torch.int64)
    u = uniform_of_hash(h)
    assert U_BITS == 23 and float(u.max()) == 1 - 2.0 ** -24 and float(u.min()) == 2.0 ** -24
    g = -torch.log(-torch.log(u))
    assert torch.isfinite(g).all() and float(g.max()) < 16.7
    # the 24-bit form this replaced: the largest hash gave u = 1
    assert float(((h[2] >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))) == 1.0


def test_a_token_with_the_largest_hash_is_not_drawn_when_unlikely():
    """Request 6468's first token (run seed 0) has a hash whose top 24 bits are all ones at vocabulary index 3584: the
    draw that the 24-bit uniforms made certain. Here that token is e^-30 less likely than any other and is not drawn,
    by the reference or the kernel."""
    seed = row_seed(0, 6468, 0)
    v = torch.tensor([3584], dtype=torch.int64)
    h = _mix32(_mix32(v ^ ((seed >> 32) & 0xFFFFFFFF)) ^ (seed & 0xFFFFFFFF))
    assert int(h) >> 8 == (1 << 24) - 1  # (the case the test is about)
    z = torch.randn(1, 4096, generator=torch.Generator().manual_seed(3)).clamp(-3, 3)
    z[0, 3584] = -33.0
    seeds = torch.tensor([seed])
    for backend in ("reference", "triton"):
        tok = sample_tokens(z.to(DEVICE), seeds.to(DEVICE), 1.0, 1.0, backend=backend)
        assert int(tok) != 3584, backend
    assert float(gumbel(seeds, 4096)[0, 3584]) > 16.6  # (its noise is the largest there is, and finite)


def _rows(B, V, g, dtype, scale=3.0):
    z = torch.randn(B, V, generator=g) * scale
    if V > 20:
        z[:, 4] = z[:, 11]  # ties
        z[:, 13] = z.max(1).values  # a tie with the top token
        z[:, V // 2:V // 2 + 7] = float("-inf")  # masked vocabulary
    return z.to(dtype)


@pytest.mark.parametrize("B,V,dtype", [(B, V, dt) for B, V in [(1, 1), (3, 7), (6, 1000), (4, 2049), (2, 20000)]
                                       for dt in (torch.float32, torch.bfloat16, torch.float16)]
                         + [(2, 129280, torch.float32)])  # (DeepSeek-V3.2's vocabulary)
def test_kernel_picks_the_reference_tokens(B, V, dtype):
    """Random rows of every dtype, vocabulary sizes not a multiple of the kernel's block or chunk, ties, masked
    (-inf) tokens, rows read through a stride (a slice of a wider tensor), one chunk or many: the kernel's tokens are
    the reference's, for every temperature and top-p, and never a masked token."""
    g = torch.Generator().manual_seed(B * V + dtype.itemsize)
    wide = _rows(B, V + 5, g, dtype).to(DEVICE)
    z = wide[:, 2:V + 2]
    if V + 2 > 20:
        z[:, 1] = float("-inf")
    seeds = torch.tensor([row_seed(V, i, 3) for i in range(B)], dtype=torch.int64, device=DEVICE)
    for T, top_p in [(1.0, 1.0), (0.7, 0.9), (1.3, 0.3), (0.05, 0.95), (1.0, 1e-4), (3.0, 0.999)]:
        got = sample_tokens(z, seeds, T, top_p, backend="triton")
        want = sample_tokens_ref(z, seeds, T, top_p)
        assert got.dtype == torch.int64 and got.device == z.device
        assert torch.equal(got, want), (T, top_p, got.tolist(), want.tolist())
        assert torch.isfinite(z.float().gather(1, got[:, None])).all()


@pytest.mark.parametrize("B,V,seed,run", [(48, 400, 9, 5), (4, 20000, 10, 6)])
def test_kernel_walks_past_candidates_outside_the_nucleus(B, V, seed, run):
    """Flat rows (many tokens of near-equal mass): the argmax of z + g over the whole row is almost never in a small
    nucleus, so the kernel moves through several candidates before it accepts one (counted for these rows: up to 11
    candidates of 400 tokens and 13 of 20,000 at top_p 1e-6; at 20,000, five chunks, the first candidate has 2,197-
    16,604 tokens ahead of it). With top_p below every mass the answer is the most likely token; with 0.05 / 0.3 it
    is the reference's."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(B, V, generator=g) * 0.3).to(DEVICE)
    seeds = _seeds(B, run=run, device=DEVICE)
    tiny = sample_tokens(z, seeds, 1.0, 1e-6, backend="triton")
    assert torch.equal(tiny, torch.argmax(z, -1))
    assert not torch.equal(sample_tokens(z, seeds, 1.0, 1.0, backend="triton"), tiny)  # (the first candidates)
    for top_p in (0.05, 0.3):
        got = sample_tokens(z, seeds, 1.0, top_p, backend="triton")
        assert torch.equal(got, sample_tokens_ref(z, seeds, 1.0, top_p)), top_p
        assert nucleus_ref(scaled_logits(z, 1.0), top_p).gather(1, got[:, None]).all()


@pytest.mark.parametrize("rounds", [0, 1, 3])
def test_kernel_tokens_do_not_depend_on_the_chunked_rounds(monkeypatch, rounds):
    """However many later candidates run in chunked rounds before the row's one program walks on (none, fewer or
    more than the default), the tokens are the reference's: flat rows over three chunks, where rows take from one to
    about a dozen candidates."""
    import dsa.sampling.kernel as K

    monkeypatch.setattr(K, "ROUNDS", rounds)
    B, V = 6, 9000
    z = (torch.randn(B, V, generator=torch.Generator().manual_seed(13)) * 0.3).to(DEVICE)
    seeds = _seeds(B, run=7, device=DEVICE)
    assert torch.equal(sample_tokens(z, seeds, 1.0, 1e-6, backend="triton"), torch.argmax(z, -1))
    for top_p in (0.05, 0.5, 0.97):
        assert torch.equal(sample_tokens(z, seeds, 1.0, top_p, backend="triton"),
                           sample_tokens_ref(z, seeds, 1.0, top_p)), top_p


@pytest.mark.parametrize("B,V,seed", [(16, 20000, 11), (3, 129280, 12)])
def test_kernel_walks_to_candidates_in_a_few_chunks(B, V, seed):
    """Most tokens flat and low, a few hundred high ones in two chunks of the vocabulary (with ties across chunks):
    the first candidate often lies in the low mass and is rejected, and the later candidates lie in those two chunks.
    The kernel's tokens are the reference's at every top_p, and the most likely token (the first of its ties) at a
    top_p below every mass."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(B, V, generator=g) * 0.3
    hot = torch.cat([torch.randint(4096, 8192, (60,), generator=g), torch.randint(12288, 16384, (240,), generator=g)])
    z[:, hot] += 4.0
    z[:, 100] = z[:, hot[7]]  # the same z as a high token, at a smaller index, in a chunk of low tokens
    z[:, V - 1] = z[:, hot].max(1).values  # and a tie with the top token in the last chunk
    z = z.to(DEVICE)
    seeds = _seeds(B, run=seed, device=DEVICE)
    assert torch.equal(sample_tokens(z, seeds, 1.0, 1e-6, backend="triton"), torch.argmax(z, -1))
    first = sample_tokens(z, seeds, 1.0, 1.0, backend="triton")
    for top_p in (0.02, 0.2, 0.6, 0.9):
        got = sample_tokens(z, seeds, 1.0, top_p, backend="triton")
        assert torch.equal(got, sample_tokens_ref(z, seeds, 1.0, top_p)), top_p
        if top_p == 0.2:  # (rows whose first candidate was rejected: these walked)
            assert (got != first).sum() >= B // 3, (got.tolist(), first.tolist())


def test_out_is_written_whole():
    """``out=`` (poisoned first) is every row's token, the same as without it, and is what is returned: greedy,
    sampled and top-p, on the kernel and the reference."""
    z = torch.randn(5, 9000, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    seeds = _seeds(5, run=2, device=DEVICE)
    for backend in ("triton", "reference"):
        for T, top_p in ((0.0, 1.0), (0.9, 1.0), (0.9, 0.8)):
            out = torch.full((5,), -7, dtype=torch.int64, device=DEVICE)
            got = sample_tokens(z, seeds, T, top_p, out=out, backend=backend)
            assert got is out and torch.equal(out, sample_tokens(z, seeds, T, top_p, backend=backend)), (backend, T)


def test_kernel_hash_is_the_reference_hash():
    """At a huge temperature z is ~0 and the draw is the argmax of the Gumbel noise alone: the kernel's hash of
    (seed, index) is the reference's, for seeds that use all 63 bits."""
    B, V = 64, 3000
    z = torch.randn(B, V, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    seeds = _seeds(B, run=123456789, device=DEVICE)
    got = sample_tokens(z, seeds, 1e30, 1.0, backend="triton")
    assert torch.equal(got, torch.argmax(gumbel(seeds, V), -1))


@triton.jit
def _noise_of_every_uniform(g_ptr, up_ptr, U_BITS: tl.constexpr, NOISE: tl.constexpr, BLOCK: tl.constexpr):
    k = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.uint32)
    tl.store(g_ptr + k, K._gumbel_of_bits(k, U_BITS))
    tl.store(up_ptr + k, K._gumbel_bound_of_bits(k, U_BITS, NOISE))


def test_the_screens_noise_bound_holds_for_every_uniform():
    """The screen's cheap bound of the Gumbel noise (``lg2.approx`` on an NVIDIA GPU, ``tl.log2`` elsewhere) against
    the kernel's exact noise, for every one of the 2**23 uniforms: at least ``g`` (so no token that could win is
    skipped) and within ``2 * G_TOL`` of it; its error is measured against ``G_TOL`` as well (it must leave a
    margin of 4x)."""
    n = 1 << U_BITS
    g = torch.full((n,), float("nan"), device=DEVICE)
    up = torch.full((n,), float("nan"), device=DEVICE)
    mode = max(K.noise_mode(g.device), 1)
    _noise_of_every_uniform[(n // 4096,)](g, up, U_BITS=U_BITS, NOISE=mode, BLOCK=4096)
    u = uniform_of_hash(torch.arange(n, dtype=torch.int64) << (32 - U_BITS))
    torch.testing.assert_close(g.cpu(), -torch.log(-torch.log(u)), rtol=1e-6, atol=1e-6)  # (k -> u as the reference)
    tol = K.G_TOL.value
    err = (up.double() - tol - g.double()).abs().max().item()
    assert (up >= g).all() and (up - g <= 2 * tol).all(), err
    assert err < tol / 4, (mode, err)


@pytest.mark.parametrize("noise", [0, None])
def test_noise_forms_pick_the_same_tokens(monkeypatch, noise):
    """The screened argmax of ``z + g`` (``NOISE`` None: the device's form) and the exact one of every token (0, the
    form AMD GPUs take) give the reference's tokens: equal logits whose tokens share the row's largest noise (the
    first index wins, within a block and across chunks), and random rows at scales from 1e-3 to 3e4 (where ``z``'s
    rounding is far above the screen's margin), masked tokens, ties, top-p and not; rows of many +inf logits."""
    monkeypatch.setattr(K, "NOISE", noise)
    # rows whose largest noise is held by two tokens (found by search): same block (2230, 16747), other chunks (394)
    V = 20000
    seeds = torch.tensor([row_seed(0, r, 0) for r in (2230, 16747, 394)], dtype=torch.int64)
    gn = gumbel(seeds, V)
    assert (gn == gn.max(1, keepdim=True).values).sum(1).tolist() == [2, 2, 2]  # (the case the test is about)
    assert torch.argmax(gn, -1).tolist() == [8410, 2109, 2303]
    flat = torch.full((3, V), 0.25)
    for top_p in (1.0, 0.5):
        assert sample_tokens(flat.to(DEVICE), seeds.to(DEVICE), 1.0, top_p, backend="triton").tolist() == \
            [8410, 2109, 2303]
    # +inf logits (the first one is drawn at top-p 1): the screen takes it in one turn of its loop, not one per token
    z = torch.randn(2, 9000, generator=torch.Generator().manual_seed(20))
    z[:, 1000:3000] = float("inf")
    z[1, 500] = float("inf")
    assert sample_tokens(z.to(DEVICE), seeds[:2].to(DEVICE), 1.0, 1.0, backend="triton").tolist() == [1000, 500]
    g = torch.Generator().manual_seed(21)
    for scale in (1e-3, 1.0, 3.0, 3e4):
        z = _rows(5, 9000, g, torch.float32, scale=scale).to(DEVICE)
        s = _seeds(5, run=int(scale * 1000), device=DEVICE)
        for T, top_p in ((1.0, 1.0), (0.8, 0.9), (2.5, 0.3)):
            assert torch.equal(sample_tokens(z, s, T, top_p, backend="triton"), sample_tokens_ref(z, s, T, top_p)), \
                (scale, T, top_p)


@triton.jit
def _screen_rows(x_ptr, up_ptr, seeds_ptr, best_ptr, best_i_ptr, V, inv_t, U_BITS: tl.constexpr,
                 BLOCK: tl.constexpr):
    row = tl.program_id(0)
    xr, s_hi, s_lo = K._row(x_ptr, V, seeds_ptr, row)
    offs = tl.arange(0, BLOCK)
    up = tl.load(up_ptr + row * V + offs, mask=offs < V, other=float("-inf"))
    best, best_i = K._screened_argmax(xr, up, offs, tl.full([], float("-inf"), tl.float32), V, inv_t, s_hi, s_lo,
                                      V, U_BITS)
    tl.store(best_ptr + row, best)
    tl.store(best_i_ptr + row, best_i)


def test_the_screen_takes_the_exact_argmax_under_any_valid_bounds():
    """The screen's loop given bounds far looser than the kernel's, in an order unlike the exact values' (the exact
    ``z + g`` plus a random slack up to 2, or plus a constant 17 so that the tokens come in the order of ``z``):
    it still returns the first argmax of the exact ``z + g`` over the tokens with a bound (-inf: none), and that
    token's exact value. (A loop that stopped after the token with the highest bound would fail here.)"""
    B, V, T = 6, 1000, 0.7
    g = torch.Generator().manual_seed(31)
    x = torch.randn(B, V, generator=g)
    x[:, 10] = x[:, 3]
    seeds = _seeds(B, run=31)
    inv_t = inv_temperature(T)
    y = scaled_logits(x, T) + gumbel(seeds, V)
    up = y + torch.rand(B, V, generator=g) * 2 + 1e-3
    up[1] = scaled_logits(x[1], T) + 17.0
    up[2, ::3] = float("-inf")  # (not candidates)
    up[3] = float("-inf")
    want = torch.where(up > float("-inf"), y, float("-inf")).argmax(1)
    best = torch.full((B,), float("nan"), device=DEVICE)
    best_i = torch.full((B,), -7, dtype=torch.int32, device=DEVICE)
    _screen_rows[(B,)](x.to(DEVICE), up.to(DEVICE), seeds.to(DEVICE), best, best_i, V, inv_t, U_BITS=U_BITS,
                       BLOCK=1024)
    rows = [0, 1, 2, 4, 5]
    torch.testing.assert_close(best[rows].cpu(), y.gather(1, want[:, None])[rows, 0], rtol=1e-6, atol=1e-6)
    want[3] = V  # (no candidate: the index stays the caller's, here V, and the value -inf)
    assert best_i.cpu().tolist() == want.tolist() and best[3].item() == float("-inf")
