"""Top-k on random configurations: the public ``dsa.top_k_indices`` (its kernels, launch parameters chosen inside)
against the reference, bitwise, on a configuration drawn from a seed.

``tests/test_topk.py`` fixes the paths one at a time; here each case draws all of its inputs at once: the form
(explicit ranges, decode with ``seq_lens [B]`` or ``[B, next_n]``, decode with a block table giving global slots),
row count and length (around the block and split sizes, up to 128K), k (1 to 8192, odd and round), values (plain,
rounded to a few levels so that ties abound, with ``-inf`` and NaN sprinkled in and whole rows of ``-inf``), empty
and out-of-range ranges, strided rows and a poisoned ``out=``. The result is fully determined by the input, so it
must equal the reference's bit for bit.

A failing case prints its configuration; ``fuzz_config(seed, gpu)`` rebuilds it.
"""
from __future__ import annotations

import random

import pytest
import torch

from dsa.topk import MAX_K, top_k_indices
from utils import DEVICE, gen, poison_

CPU_SEEDS = range(6)
GPU_SEEDS = range(120)


def fuzz_config(seed: int, gpu: bool) -> dict:
    """The configuration of case ``seed``: small enough for the interpreter when ``gpu`` is False."""
    r = random.Random(seed * 104729 + (1 if gpu else 0))
    form = r.choice(["ranges", "decode", "decode2d", "table"])
    if gpu:
        N = r.choice([1, 63, 64, 1000, 2048, 2049, 8192, 32768, 65537, 131072])
        M = r.choice([1, 2, 3, 7, 64, 129, 300, 1024])
        k = r.choice([1, 7, 64, 513, 2048, 2048, 4096, MAX_K, r.randint(1, MAX_K)])
    else:
        N = r.choice([1, 63, 300, 1000, 2900])
        M = r.choice([2, 5, 8])
        k = r.choice([1, 7, 64, r.randint(1, 300)])
    next_n = r.choice([1, 1, 2, 3, 4]) if form != "ranges" else 1
    M = max(next_n, M - M % next_n)
    return dict(form=form, N=N, M=M, k=k, next_n=next_n, values=r.choice(["randn", "levels", "specials"]),
                strided=r.random() < 0.3, with_out=r.random() < 0.5, block_size=r.choice([1, 16, 64, 256]),
                odd_ranges=r.random() < 0.3)


def make_inputs(cfg: dict, seed: int):
    """``(logits, kwargs)`` of a case, on the test device."""
    g = gen(seed)
    M, N, next_n = cfg["M"], cfg["N"], cfg["next_n"]
    logits = torch.randn(M, N, generator=g)
    if cfg["values"] == "levels":  # a few distinct values: ties everywhere
        logits = torch.round(logits * 2) / 2
    elif cfg["values"] == "specials":
        u = torch.rand(M, N, generator=g)
        logits[u < 0.1] = float("-inf")
        logits[(u >= 0.1) & (u < 0.15)] = float("nan")
        logits[(u >= 0.15) & (u < 0.16)] = float("inf")
        if M > 1:
            logits[M // 2] = float("-inf")  # a row with nothing but -inf
    if cfg["strided"]:  # rows of a wider buffer (the last dim stays contiguous)
        wide = torch.full((M, N + 37), float("nan"))
        wide[:, :N] = logits
        logits = wide[:, :N]
    kw = {}
    if cfg["form"] == "ranges":
        a = torch.randint(0, N + 1, (M,), generator=g)
        b = torch.randint(0, N + 1, (M,), generator=g)
        starts, ends = torch.minimum(a, b), torch.maximum(a, b)
        if M > 1:
            ends[0] = starts[0]  # an empty range
        if cfg["odd_ranges"] and M > 2:  # documented clamping: past the row, or a start below 0
            starts[1], ends[1] = -5, N + 100
        kw = dict(row_starts=starts.int(), row_ends=ends.int())
    else:
        B = M // next_n
        if cfg["form"] == "decode2d":
            kw = dict(seq_lens=torch.randint(0, N + 1, (B, next_n), generator=g).int(), next_n=next_n)
        else:
            sl = torch.randint(0, N + 1, (B,), generator=g)
            if B > 1:
                sl[0] = min(int(sl[0]), next_n - 1)  # shorter than next_n: its first rows are empty
            kw = dict(seq_lens=sl.int(), next_n=next_n)
        if cfg["form"] == "table":
            bs = cfg["block_size"]
            max_blocks = max(1, -(-N // bs) - (1 if cfg["odd_ranges"] else 0))  # odd: some positions past the table
            bt = torch.randperm(B * max_blocks + 3, generator=g)[: B * max_blocks].reshape(B, max_blocks).int()
            if max_blocks > 1:
                bt[0, 1] = -1  # a negative block entry
            kw.update(block_table=bt, block_size=bs)
    dev = lambda x: x.to(DEVICE) if isinstance(x, torch.Tensor) else x  # noqa: E731
    return logits.to(DEVICE), {n: dev(v) for n, v in kw.items()}


def run_case(seed: int, gpu: bool):
    cfg = fuzz_config(seed, gpu)
    logits, kw = make_inputs(cfg, 5000 + seed)
    out = poison_(torch.empty(cfg["M"], cfg["k"], dtype=torch.int32, device=logits.device)) if cfg["with_out"] \
        else None
    got = top_k_indices(logits, cfg["k"], out=out, backend="triton", **kw)
    if out is not None:
        assert got.data_ptr() == out.data_ptr()
    want = top_k_indices(logits, cfg["k"], backend="reference", **kw)
    assert got.dtype == torch.int32 and got.shape == (cfg["M"], cfg["k"])
    bad = (got != want).any(dim=1).nonzero().flatten().tolist()
    assert not bad, f"seed {seed}: {cfg}: rows {bad[:8]} differ from the reference"


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_topk_fuzz_small(seed):
    run_case(seed, gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_gpu_topk_fuzz(seed):
    run_case(seed, gpu=True)


def test_topk_fuzz_configs_cover_the_forms():
    """The GPU draws reach every form, k up to MAX_K above and below the row length, rows of 128K and many rows,
    every kind of values (checked on the configurations alone, on any machine)."""
    cfgs = [fuzz_config(s, True) for s in GPU_SEEDS]
    assert {c["form"] for c in cfgs} == {"ranges", "decode", "decode2d", "table"}
    assert {c["values"] for c in cfgs} == {"randn", "levels", "specials"}
    assert any(c["k"] == MAX_K for c in cfgs) and any(c["k"] > c["N"] for c in cfgs)
    assert any(c["k"] < c["N"] and c["N"] >= 1 << 17 for c in cfgs) and any(c["M"] >= 1024 for c in cfgs)
    assert {c["next_n"] for c in cfgs if c["form"] != "ranges"} == {1, 2, 3, 4}
    assert {c["block_size"] for c in cfgs if c["form"] == "table"} == {1, 16, 64, 256}
