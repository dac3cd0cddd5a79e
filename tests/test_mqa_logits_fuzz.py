"""Decode indexer logits on random configurations: the public ``dsa.fp8_paged_mqa_logits`` (its kernels, chosen
inside) against the reference, on a configuration drawn from a seed.

``tests/test_mqa_logits.py`` lists its paged cases; here each case draws all of them at once: requests and their
context lengths (one token up to 64K on a GPU, some shorter than ``next_n``), block size (1 to 256), ``next_n`` (1
to 4), ``context_lens`` as ``[B]`` or ``[B, next_n]``, 32 / 64 / 128 heads, an output width past the longest
context, ``clean_logits`` on or off, and a poisoned ``out=``. Every unused cache slot holds NaN, which must never
reach a logit the row can see. The tolerance is ``tests/test_mqa_logits.py``'s (DeepGEMM's criterion), and -inf
must sit exactly where the reference has it.

A failing case prints its configuration; ``fuzz_config(seed, gpu)`` rebuilds it.
"""
from __future__ import annotations

import random

import pytest
import torch

from dsa.mqa_logits import MAX_NEXT_N_HEADS, fp8_paged_mqa_logits, fp8_paged_mqa_logits_ref
from test_mqa_logits import _paged_case, assert_logits_match, row_limits
from utils import DEVICE, gen, poison_

CPU_SEEDS = range(5)
GPU_SEEDS = range(80)


def fuzz_config(seed: int, gpu: bool) -> dict:
    """The configuration of case ``seed``: small enough for the interpreter when ``gpu`` is False."""
    r = random.Random(seed * 7907 + (1 if gpu else 0))
    next_n = r.choice([1, 1, 2, 3, 4])
    heads = [h for h in (32, 64, 128) if (1 << (next_n - 1).bit_length()) * h <= MAX_NEXT_N_HEADS]
    B = r.choice([1, 2, 3, 8, 33]) if gpu else r.choice([1, 2, 3])
    top = r.choice([64, 2000, 8192, 40000, 65536]) if gpu else r.choice([20, 100, 300])
    lens = [r.randint(1, top) for _ in range(B)]
    if B > 1:
        lens[1] = r.randint(1, next_n)  # a context no longer than next_n: some rows see nothing or one key
    return dict(lens=lens, block_size=r.choice([1, 4, 16, 64, 256]), next_n=next_n, two_d=r.random() < 0.3,
                H=r.choice(heads), extra_width=r.choice([0, 0, 1, 77]), clean=r.random() < 0.8,
                with_out=r.random() < 0.6)


def run_case(seed: int, gpu: bool):
    cfg = fuzz_config(seed, gpu)
    try:
        _check(seed, cfg)
    except AssertionError as e:  # the configuration with the failure, as the module's docstring promises
        raise AssertionError(f"seed {seed} (gpu={gpu}): {cfg}: {e}") from e


def _check(seed: int, cfg: dict):
    lens, next_n = cfg["lens"], cfg["next_n"]
    g = gen(9000 + seed)
    max_len = max(lens) + cfg["extra_width"]
    q, cache, w, ctx, bt, max_len, _, _ = _paged_case(lens, cfg["block_size"], next_n, cfg["two_d"], cfg["H"], g,
                                                      max_len=max_len)
    M = len(lens) * next_n
    out = poison_(torch.empty(M, max_len, device=DEVICE)) if cfg["with_out"] else None
    got = fp8_paged_mqa_logits(q, cache, w, ctx, bt, max_len, cfg["clean"], out=out, backend="triton")
    if out is not None:
        assert got.data_ptr() == out.data_ptr()
    ref = fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len)
    if cfg["clean"]:
        assert_logits_match(got, ref)
    else:  # only the entries each row can see are specified
        lim = row_limits(ctx, next_n).reshape(-1, 1).clamp(0, max_len)
        valid = torch.arange(max_len, device=ctx.device)[None, :] < lim
        if valid.any():
            assert_logits_match(got, ref, valid=valid)


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_paged_logits_fuzz_small(seed):
    run_case(seed, gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_gpu_paged_logits_fuzz(seed):
    run_case(seed, gpu=True)


def test_paged_logits_fuzz_configs_cover_the_forms():
    """The GPU draws reach every block size, next_n, head count and form (checked on the configurations alone)."""
    cfgs = [fuzz_config(s, True) for s in GPU_SEEDS]
    assert {c["block_size"] for c in cfgs} == {1, 4, 16, 64, 256}
    assert {c["next_n"] for c in cfgs} == {1, 2, 3, 4} and {c["H"] for c in cfgs} == {32, 64, 128}
    assert {c["two_d"] for c in cfgs} == {False, True} and {c["clean"] for c in cfgs} == {False, True}
    assert any(max(c["lens"]) > 32768 for c in cfgs) and any(c["extra_width"] for c in cfgs)
