"""Sparse MLA on random configurations: the public ``dsa.sparse_mla`` (its kernels, every choice made inside as a user
calls it) against the reference, on a configuration drawn from a seed.

The other tests fix one or two of the things that steer the work split and pick a kernel (head count, topk, tokens,
cache size and format, paged or flat, ``topk_length``, the sink, invalid and duplicated entries, strided q, ``out=``);
here each case draws all of them at once, so the combinations nobody listed run too. The draws lean on the
boundaries: topk just off a multiple of 64, head counts that are not a power of two, token counts around the
split, cluster and bulk-kernel thresholds, and (on a GPU) the many-token paths: index lists grouped by slot range
over a cache of more than 128 MiB, 72-96 heads as two calls, and the fp8 cache dequantised first. Every case
poisons ``out`` and every unused cache slot (NaN), and holds the tolerances of ``tests/test_mla.py``.

A failing case prints its configuration; ``fuzz_config(seed, gpu)`` rebuilds it.
"""
from __future__ import annotations

import random

import pytest
import torch

from dsa.constants import D_QK, D_V
from dsa.mla import sparse_mla, sparse_mla_ref
from test_mla import assert_matches, make_case, max_abs_v
from utils import poison_

CPU_SEEDS = range(6)
GPU_SEEDS = range(160)


def fuzz_config(seed: int, gpu: bool) -> dict:
    """The configuration of case ``seed``: small enough for the interpreter when ``gpu`` is False."""
    r = random.Random(seed * 7919 + (1 if gpu else 0))
    kv_format = r.choice(["bf16", "fp8_ds_mla"])
    if gpu:
        h_q = r.choice([8, 16, 16, 32, 32, 24, 40, 64, 72, 96, 112, 128])
        size = r.choices(["decode", "mid", "many"], weights=[5, 3, 2])[0]
        T = {"decode": r.choice([1, 2, 3, 4, 5, 8, 16, 30, 32, 33, 64, 65, 128]),
             "mid": r.randint(129, 300), "many": r.choice([256, 512, 520, 1024])}[size]
        topk = r.choice([2048, 2048, 1024, 64 * r.randint(1, 32), 64 * r.randint(1, 32) + r.choice([-1, 1]),
                         r.randint(1, 200)])
        if size == "many":
            S = r.choice([1 << 17, 150_016, 40_000])  # > 128 MiB of bf16 rows (lists grouped), or a smaller cache
        else:
            S = r.choice([topk + 64, 5056, 1 << 15, 1 << 16])
    else:
        h_q = r.choice([8, 16, 24, 32])
        T = r.randint(1, 4)
        topk = r.choice([64, r.randint(1, 130)])
        S = r.choice([96, 256, 1000])
    block_size = r.choice([None, 1, 16, 64])
    S = -(-S // 64) * 64  # every block size divides it
    return dict(T=T, h_q=h_q, topk=topk, S=S, kv_format=kv_format, block_size=block_size,
                frac_invalid=r.choice([0.0, 0.05, 0.3]), with_len=r.random() < 0.5, with_sink=r.random() < 0.5,
                empty_row=r.random() < 0.4 and T > 1, strided_q=r.random() < 0.3, with_out=r.random() < 0.7)


def run_case(seed: int, gpu: bool):
    cfg = fuzz_config(seed, gpu)
    T, h_q = cfg["T"], cfg["h_q"]
    q, kv, idx, sm, sink, tl_ = make_case(T, h_q, cfg["topk"], cfg["S"], cfg["kv_format"], seed=1000 + seed,
                                          block_size=cfg["block_size"], frac_invalid=cfg["frac_invalid"],
                                          with_len=cfg["with_len"], with_sink=cfg["with_sink"],
                                          empty_rows=(T // 2, ) if cfg["empty_row"] else ())
    if cfg["strided_q"]:  # q as the first 576 values of wider rows (the last dim stays contiguous)
        wide = poison_(torch.empty(T, h_q, D_QK + 8, dtype=torch.bfloat16, device=q.device))
        wide[..., :D_QK] = q
        q = wide[..., :D_QK]
    out = poison_(torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=q.device)) if cfg["with_out"] else None
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, out=out, backend="triton")
    if out is not None:
        assert got[0].data_ptr() == out.data_ptr()
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(got, want, max_abs_v(kv, idx, cfg["S"]), f"seed {seed}: {cfg}")


@pytest.mark.parametrize("seed", CPU_SEEDS)
def test_fuzz_small(seed):
    run_case(seed, gpu=False)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", GPU_SEEDS)
def test_gpu_fuzz(seed):
    run_case(seed, gpu=True)


def test_fuzz_configs_cover_the_boundaries():
    """The GPU draws reach what they are for: every head count, odd and sub-64 topk, the many-token sizes over a
    cache past 128 MiB, fp8 and bf16, paged and flat (checked on the configurations alone, on any machine)."""
    cfgs = [fuzz_config(s, True) for s in GPU_SEEDS]
    assert {c["h_q"] for c in cfgs} >= {8, 16, 32, 64, 72, 96, 128}
    assert any(c["topk"] % 64 and c["topk"] > 64 for c in cfgs) and any(c["topk"] < 64 for c in cfgs)
    assert any(c["T"] >= 512 and c["S"] >= 1 << 17 for c in cfgs)
    assert any(c["T"] >= 256 and c["h_q"] in (72, 96) for c in cfgs)
    assert any(c["T"] >= 256 and c["h_q"] > 16 and c["kv_format"] == "fp8_ds_mla" for c in cfgs)
    assert {c["kv_format"] for c in cfgs} == {"bf16", "fp8_ds_mla"}
    assert {c["block_size"] for c in cfgs} == {None, 1, 16, 64}
    assert all(c["S"] % 64 == 0 and c["h_q"] % 8 == 0 for c in cfgs)
