"""Next-token choice (``dsa.model.sampling``): greedy is argmax; sampled tokens follow softmax(logits / T) over the
top-p nucleus (frequencies of many seeded draws against the exact probabilities, within 5 standard deviations);
each row depends only on its own logits and seed (not on the batch around it); the hash's uniforms are uniform and
the row seeds distinct. Engine and ``generate`` agreement under sampling is in tests/test_engine.py."""
from __future__ import annotations

import math

import pytest
import torch

from dsa.model.sampling import nucleus, nucleus_ref, row_seed, sample_tokens, uniforms

N = 40_000  # draws per distribution: 5 sigma of a frequency p is 5 sqrt(p (1 - p) / N) <= 0.0125


def _nucleus_probs(z: torch.Tensor, T: float, top_p: float) -> torch.Tensor:
    """The exact distribution: softmax(z / T) in float64, cut to the nucleus (the tokens whose preceding mass in
    descending order is below top_p), renormalised."""
    p = torch.softmax(z.double() / T, 0)
    q = p * nucleus_ref(p[None], top_p)[0]
    return q / q.sum()


def _seeds(n: int, run: int = 0) -> torch.Tensor:
    return torch.tensor([row_seed(run, i, 7) for i in range(n)], dtype=torch.int64)


@pytest.mark.parametrize("T,top_p", [(1.0, 1.0), (0.6, 1.0), (1.7, 1.0), (1.0, 0.8), (0.5, 0.5), (2.0, 0.95)])
def test_frequencies_follow_the_nucleus_distribution(T, top_p):
    g = torch.Generator().manual_seed(int(T * 10 + top_p * 100))
    z = torch.randn(12, generator=g) * 1.5
    want = _nucleus_probs(z, T, top_p)
    tok = sample_tokens(z.expand(N, -1), _seeds(N), T, top_p)
    freq = torch.bincount(tok, minlength=12).double() / N
    sigma = torch.sqrt(want * (1 - want) / N)
    assert torch.all((freq - want).abs() <= 5 * sigma + 1e-12), (freq, want)
    assert torch.all(freq[want == 0] == 0)  # never a token outside the nucleus
    if top_p < 1.0:
        assert (want == 0).any()  # (the cases do cut the tail)


@pytest.mark.parametrize("B,V", [(1, 7), (5, 1000), (3, 129280)])
def test_nucleus_equals_the_row_by_row_sorted_rule(B, V):
    """The nucleus from one 1-D sort of (row, probability bits) keys equals the rule written out row by row: a stable
    descending sort, the tokens whose preceding mass is below top_p (the first always), with ties (equal logits) and
    underflowed zeros in the rows."""
    g = torch.Generator().manual_seed(B * V)
    z = torch.randn(B, V, generator=g) * 4
    z[:, 3] = z[:, 5]  # a tie
    z[:, -(V // 3):] = -200.0  # probabilities that underflow to 0
    p = torch.softmax(z, -1)
    for top_p in (1e-3, 0.3, 0.9, 0.999, 1.0):
        assert torch.equal(nucleus(p, top_p), nucleus_ref(p, top_p)), top_p


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
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        sample_tokens(z[0], None, 0.0)
