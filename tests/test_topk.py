"""Tests of dsa.topk: reference vs a sort-based brute force, kernel vs reference.

The kernel and the reference both make the canonical choice (lowest positions among
ties, positions ascending), so they are compared for exact equality; in addition the
multiset of selected values is checked (tie-insensitive), as is the structure of each
row (valid positions in range and unique, then exactly -1).
"""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from utils import gen, poison_

from dsa.topk import MAX_K, TopKConfig, top_k_indices
from dsa.topk.kernel import sample_positions
from dsa.topk.reference import (
    decode_row_ranges,
    order_keys,
    top_k_indices_decode_ref,
    top_k_indices_ref,
)

# small launch configs that force the interesting paths on small rows
SMALL = TopKConfig(block=256, cap=0, num_warps=4, sample_groups=16, splits=1, prefetch=4)  # many buffer cuts
SPLIT2 = TopKConfig(split_block=256, sample_groups=16, splits=2, chunk=256, prefetch=2)
SPLIT4 = TopKConfig(split_block=128, sample_groups=16, splits=4, chunk=128, prefetch=3)
# tl.store instead of the inline-PTX stores (the GPU's other store path; on the interpreter the same as above)
PLAIN = dataclasses.replace(SMALL, ptx=False)
PLAIN_SPLIT = dataclasses.replace(SPLIT2, ptx=False)
CONFIGS = {"default": None, "small": SMALL, "split2": SPLIT2, "split4": SPLIT4, "plain": PLAIN,
           "plain_split": PLAIN_SPLIT}


# ----------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------
def brute_top_k(logits, k, starts, ends):
    """Independent formulation: Python sort of (class, value, -position), class 0 for NaN/-inf."""
    M, N = logits.shape
    out = []
    for i in range(M):
        s = min(max(int(starts[i]), 0), N)
        e = min(max(int(ends[i]), s), N)
        vals = logits[i, s:e].tolist()

        def rank(j, vals=vals):
            v = vals[j]
            finite_or_pinf = not (math.isnan(v) or v == float("-inf"))
            return (1 if finite_or_pinf else 0, v if finite_or_pinf else 0.0, -j)

        chosen = sorted(sorted(range(len(vals)), key=rank, reverse=True)[:k])
        out.append(chosen + [-1] * (k - len(chosen)))
    return torch.tensor(out, dtype=torch.int32).reshape(M, k)


def chosen_values(out, logits, starts):
    """Per row: sorted selected values (NaN read as -inf), as a list of lists."""
    res = []
    for i in range(out.shape[0]):
        pos = out[i][out[i] >= 0].long() + int(starts[i])
        v = logits[i, pos].clone()
        v[torch.isnan(v)] = float("-inf")
        res.append(torch.sort(v).values)
    return res


def check_structure(out, k, starts, ends, N):
    out = out.cpu()
    assert out.dtype == torch.int32 and out.shape == (len(starts), k)
    for i in range(out.shape[0]):
        s = min(max(int(starts[i]), 0), N)
        e = min(max(int(ends[i]), s), N)
        nvalid = min(k, e - s)
        row = out[i]
        assert (row[nvalid:] == -1).all(), f"row {i}: -1 padding"
        valid = row[:nvalid]
        assert ((valid >= 0) & (valid < e - s)).all(), f"row {i}: positions out of range"
        assert valid.unique().numel() == nvalid, f"row {i}: repeated positions"


def assert_same(out, ref, logits, starts):
    out, ref, logits, starts = out.cpu(), ref.cpu(), logits.cpu(), starts.cpu()
    for a, b in zip(chosen_values(out, logits, starts), chosen_values(ref, logits, starts)):
        assert torch.equal(a, b), "selected value multisets differ"
    assert torch.equal(out, ref), "positions differ from the canonical choice"


def ragged_rows(M, N, g, *, with_empty=True):
    starts = torch.randint(0, N, (M,), generator=g, dtype=torch.int32)
    ends = torch.randint(0, N + 1, (M,), generator=g, dtype=torch.int32)
    starts, ends = torch.minimum(starts, ends), torch.maximum(starts, ends)
    starts[0], ends[0] = 0, N  # one full row
    if with_empty and M > 2:
        ends[1] = starts[1]  # one empty row
    return starts, ends


def run(logits, k, starts, ends, device, config=None, **kw):
    out = poison_(torch.empty((logits.shape[0], k), dtype=torch.int32, device=device))
    res = top_k_indices(logits.to(device), k, starts.to(device), ends.to(device), out=out,
                        backend="triton", config=config, **kw)
    assert res is out
    return out.cpu()


# ----------------------------------------------------------------------------------------
# reference
# ----------------------------------------------------------------------------------------
def test_order_keys_monotone():
    vals = torch.tensor([float("-inf"), -3e38, -1.0, -1e-40, -0.0, 0.0, 1e-40, 1.0, 3e38, float("inf")])
    keys = order_keys(vals)
    assert keys[0] == 0 and (keys[1:] > keys[:-1]).all()
    assert order_keys(torch.tensor([float("nan"), -float("nan")])).tolist() == [0, 0]


@pytest.mark.parametrize("seed", range(4))
def test_reference_vs_bruteforce(seed):
    g = gen(seed)
    M, N = 12, 300
    x = torch.randn(M, N, generator=g)
    if seed % 2:  # ties from a small set (no zeros: -0.0/+0.0 order differs from Python's ==)
        x = torch.tensor([-2.0, -1.0, 0.5, 1.0, 3.0])[torch.randint(0, 5, (M, N), generator=g)]
    x[torch.rand(M, N, generator=g) < 0.1] = float("nan")
    x[torch.rand(M, N, generator=g) < 0.1] = float("-inf")
    x[2, :] = float("-inf")
    x[3, 5:] = float("nan")
    starts, ends = ragged_rows(M, N, g)
    for k in (1, 7, 40, 299, 400):
        ref = top_k_indices_ref(x, k, starts, ends)
        check_structure(ref, k, starts, ends, N)
        assert torch.equal(ref, brute_top_k(x, k, starts, ends))


def test_reference_decode_ranges():
    sl = torch.tensor([5, 1, 0, 9], dtype=torch.int32)
    s, e = decode_row_ranges(sl, 3)
    assert s.tolist() == [0] * 12
    assert e.tolist() == [3, 4, 5, 0, 0, 1, 0, 0, 0, 7, 8, 9]
    s2, e2 = decode_row_ranges(torch.tensor([[4, 2], [0, 7]], dtype=torch.int32), 2)
    assert e2.tolist() == [4, 2, 0, 7] and s2.tolist() == [0] * 4
    x = torch.randn(12, 10, generator=gen(3))
    assert torch.equal(top_k_indices_decode_ref(x, 4, sl, 3), top_k_indices_ref(x, 4, s, e))


# ----------------------------------------------------------------------------------------
# kernel vs reference
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg", list(CONFIGS))
@pytest.mark.parametrize("k", [1, 100, 300])
def test_kernel_random(cfg, k, device):
    g = gen(100 + k)
    M, N = 8, 3000
    x = torch.randn(M, N, generator=g) * 3
    starts, ends = ragged_rows(M, N, g)
    ends[2] = starts[2] + k  # exactly k
    ends[3] = starts[3] + k + 1  # one more than k
    out = run(x, k, starts, ends, device, CONFIGS[cfg])
    ref = top_k_indices_ref(x, k, starts, ends)
    check_structure(out, k, starts, ends, N)
    assert_same(out, ref, x, starts)


@pytest.mark.parametrize("cfg", ["default", "small", "split4"])
def test_kernel_ties(cfg, device):
    g = gen(7)
    M, N, k = 6, 2501, 200  # odd width: unaligned rows (scalar loads)
    x = torch.tensor([-1.5, 0.25, 1.0, 2.0])[torch.randint(0, 4, (M, N), generator=g)]
    x[1] = 3.0  # a constant row: the first k positions
    x[2, ::3] = 7.0  # more than k maxima
    starts, ends = ragged_rows(M, N, g, with_empty=False)
    out = run(x, k, starts, ends, device, CONFIGS[cfg])
    assert_same(out, top_k_indices_ref(x, k, starts, ends), x, starts)
    check_structure(out, k, starts, ends, N)
    assert out[1].tolist() == list(range(k))


@pytest.mark.parametrize("cfg", ["default", "small", "split2"])
def test_kernel_nan_inf(cfg, device):
    g = gen(11)
    M, N, k = 6, 2003, 150  # odd width: unaligned rows (scalar loads)
    x = torch.randn(M, N, generator=g)
    x[torch.rand(M, N, generator=g) < 0.2] = float("nan")
    x[torch.rand(M, N, generator=g) < 0.2] = float("-inf")
    x[0, 100:110] = float("inf")
    x[1, :] = float("nan")
    x[1, 1500] = -5.0  # one finite value in a NaN row: must come first
    x[2, 40:] = float("-inf")  # fewer than k finite values
    x[3, ::2] = float("nan")
    x[3, 1::2] = float("-inf")
    starts = torch.zeros(M, dtype=torch.int32)
    ends = torch.full((M,), N, dtype=torch.int32)
    out = run(x, k, starts, ends, device, CONFIGS[cfg])
    assert_same(out, top_k_indices_ref(x, k, starts, ends), x, starts)
    check_structure(out, k, starts, ends, N)
    assert 1500 in out[1].tolist()
    assert set(range(40)) <= set(out[2].tolist())
    # never a NaN/-inf where a finite value was left out
    for i in range(M):
        vals = x[i][out[i].long()]
        finite = torch.isfinite(x[i]) | (x[i] == float("inf"))
        if finite.sum() >= k:
            assert not (torch.isnan(vals) | (vals == float("-inf"))).any()


@pytest.mark.parametrize("cfg", ["small", "split2"])
def test_kernel_sorted_rows(cfg, device):
    """Ascending rows cut the buffer at every block; descending rows never refill it."""
    N, k = 3000, 130
    base = torch.arange(N, dtype=torch.float32) / 7
    x = torch.stack([base, base.flip(0), base.remainder(5.0), -base])
    starts = torch.tensor([0, 10, 3, 0], dtype=torch.int32)
    ends = torch.tensor([N, N - 7, 2999, N], dtype=torch.int32)
    out = run(x, k, starts, ends, device, CONFIGS[cfg])
    assert_same(out, top_k_indices_ref(x, k, starts, ends), x, starts)


@pytest.mark.parametrize("cfg", ["default", "split4"])
def test_kernel_sample_misled(cfg, device):
    """Large values exactly at the sampled positions: the sampled bound is far too high,
    fewer than k values pass it, and the kernel must fall back to an unbounded pass."""
    M, N, k = 3, 6000, 400
    groups = (CONFIGS[cfg] or TopKConfig()).sample_groups
    x = torch.randn(M, N, generator=gen(5))
    sp = torch.tensor(sample_positions(N, groups))
    x[:, sp] = 100.0 + 1000.0 * torch.rand(M, sp.numel(), generator=gen(6))
    # precondition: the sampled bound (the r-th largest sample key, cut to 16 bits) lets < k through
    ns = sp.numel()
    m = ns * k / N
    r = int(1.5 * m + 4 * math.sqrt(m) + 16) + 1
    assert r <= ns
    thr_key = int(torch.sort(order_keys(x[0, sp]), descending=True).values[r - 1]) & ~0xFFFF
    assert int((order_keys(x[0]) >= thr_key).sum()) < k
    starts = torch.zeros(M, dtype=torch.int32)
    ends = torch.tensor([N, N - 1, N - 333], dtype=torch.int32)
    out = run(x, k, starts, ends, device, CONFIGS[cfg])
    assert_same(out, top_k_indices_ref(x, k, starts, ends), x, starts)


@pytest.mark.parametrize("next_n", [1, 2, 3, 4])
@pytest.mark.parametrize("two_d", [False, True])
def test_decode_form(next_n, two_d, device):
    g = gen(20 + next_n)
    B, N, k = 3, 2100, 64
    x = torch.randn(B * next_n, N, generator=g)
    if two_d:
        sl = torch.randint(0, N + 1, (B, next_n), generator=g, dtype=torch.int32)
        sl[0, 0] = 0
        sl[-1, -1] = N
    else:
        sl = torch.tensor([N, next_n - 1, 50][:B], dtype=torch.int32)  # full, empty/short, short
    for cfg in (None, SPLIT2):
        out = poison_(torch.empty((B * next_n, k), dtype=torch.int32, device=device))
        top_k_indices(x.to(device), k, seq_lens=sl.to(device), next_n=next_n, out=out, backend="triton", config=cfg)
        ref = top_k_indices_decode_ref(x, k, sl, next_n)
        s, e = decode_row_ranges(sl, next_n)
        check_structure(out, k, s, e, N)
        assert_same(out.cpu(), ref, x, s)


def _slot_table(B, N, bs, g, short=True):
    """A shuffled block table for B requests of up to N positions: one entry negative (unallocated), one so large
    that its slots overflow int32 (block size > 1), and, with ``short``, one block fewer than N needs."""
    nb = -(-N // bs)
    max_blocks = nb - 1 if short else nb
    bt = torch.randperm(B * nb, generator=g)[:B * max_blocks].view(B, max_blocks).int()
    bt[0, 1] = -1
    if bs > 1:
        bt[B - 1, 0] = 2**31 // bs + 3
    return bt


@pytest.mark.parametrize("bs", [1, 16, 64, 256])
@pytest.mark.parametrize("next_n,two_d", [(1, False), (2, False), (3, True)])
@pytest.mark.parametrize("cfg", ["default", "split2"])
def test_decode_form_slots(bs, next_n, two_d, cfg, device):
    """The decode form with ``block_table``: each selected position's global cache slot, exactly
    :func:`convert_req_index_to_global_index` of the positions (unallocated blocks, blocks past the table and
    slots past int32 give -1), on the fused and split paths; rows no longer than k (written whole), a strided
    block table; the reference backend agrees."""
    from dsa.metadata.reference import convert_req_index_to_global_index_ref

    g = gen(40 + bs + next_n)
    B, N, k = 3, 2100, 64
    x = torch.randn(B * next_n, N, generator=g)
    if two_d:
        sl = torch.randint(0, N + 1, (B, next_n), generator=g, dtype=torch.int32)
        sl[0] = N
        sl[1, 0] = 40
    else:
        sl = torch.tensor([N, 50, 1500][:B], dtype=torch.int32)  # full, shorter than k, partial
    bt = _slot_table(B, N, bs, g)
    # make each rule fire: request 0's last row (range [0, N)) selects a position in its unallocated block 1 and
    # the first position past its table; the last request's rows select position 0, whose slot overflows int32
    full = next_n - 1
    x[full, bs] = x[full, bt.shape[1] * bs] = 100.0
    x[(B - 1) * next_n:, 0] = 100.0
    wide = torch.full((B, 2 * bt.shape[1]), -7, dtype=torch.int32)
    wide[:, ::2] = bt
    bt_strided = wide.to(device)[:, ::2]  # block stride 2
    req = torch.div(torch.arange(B * next_n), next_n, rounding_mode="floor").int()
    want = convert_req_index_to_global_index_ref(req, bt, top_k_indices_decode_ref(x, k, sl, next_n), bs)
    assert (want[full] == -1).sum() >= 2 and (want[full] >= 0).any()
    assert (want[(B - 1) * next_n:, 0] == -1).all() == (bs > 1) and (want >= 0).any()
    for table in (bt.to(device), bt_strided):
        out = poison_(torch.empty((B * next_n, k), dtype=torch.int32, device=device))
        got = top_k_indices(x.to(device), k, seq_lens=sl.to(device), next_n=next_n, block_table=table, block_size=bs,
                            out=out, backend="triton", config=CONFIGS[cfg])
        assert got is out and torch.equal(out.cpu(), want), (bs, next_n, cfg)
    ref = top_k_indices(x.to(device), k, seq_lens=sl.to(device), next_n=next_n, block_table=bt.to(device),
                        block_size=bs, backend="reference")
    assert torch.equal(ref.cpu(), want)


def test_k_edge_cases(device):
    g = gen(31)
    x = torch.randn(3, 700, generator=g)
    starts = torch.tensor([0, 5, 0], dtype=torch.int32)
    ends = torch.tensor([700, 690, 0], dtype=torch.int32)
    for k in (1, 2, 3, 257, 689, 700, 1000):  # includes k > N
        out = run(x, k, starts, ends, device)
        check_structure(out, k, starts, ends, 700)
        assert_same(out, top_k_indices_ref(x, k, starts, ends), x, starts)


def test_max_k(device):
    g = gen(32)
    N = MAX_K + 1500
    x = torch.randn(2, N, generator=g)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    ends = torch.tensor([N, N], dtype=torch.int32)
    out = run(x, MAX_K, starts, ends, device)
    assert_same(out, top_k_indices_ref(x, MAX_K, starts, ends), x, starts)


def test_strided_logits_and_defaults(device):
    g = gen(40)
    wide = torch.randn(5, 1200, generator=g).to(device)
    x = wide[:, 100:1100]  # row stride 1200
    starts = torch.tensor([0, 10, 20, 0, 999], dtype=torch.int32, device=device)
    ends = torch.tensor([1000, 900, 800, 1, 1000], dtype=torch.int32, device=device)
    out = top_k_indices(x, 33, starts, ends)  # out allocated, backend auto
    assert out.device == x.device
    ref = top_k_indices_ref(x.cpu().contiguous(), 33, starts.cpu(), ends.cpu())
    assert torch.equal(out.cpu(), ref)
    # reference backend through the public API
    out2 = top_k_indices(x, 33, starts, ends, backend="reference")
    assert torch.equal(out2.cpu(), ref)


@pytest.mark.parametrize("cfg", ["default", "small", "split2"])
def test_padded_row_stride(cfg, device):
    """Width not a multiple of 4 inside a row stride padded to one (how the indexer-logits functions
    allocate): the 16-byte-load variant runs, and the padding (NaN and +inf here) is never chosen."""
    from dsa.topk.kernel import _alignment

    g = gen(42)
    M, N, k = 6, 1001, 50
    buf = torch.randn(M, 1004, generator=g)
    buf[:, N:] = float("nan")
    buf[::2, N:] = float("inf")
    x = buf.to(device)[:, :N]
    assert _alignment(x) == 4
    assert _alignment(torch.randn(M, N, device=device)) == 1  # last row ends mid-vector
    starts, ends = ragged_rows(M, N, g)
    ends[2] = N  # rows that end at the width: the loads cover the padding
    out = run(x, k, starts, ends, device, CONFIGS[cfg])
    assert torch.equal(out, top_k_indices_ref(x.cpu().contiguous(), k, starts, ends))


def test_clamped_ranges(device):
    x = torch.randn(3, 500, generator=gen(41))
    starts = torch.tensor([-20, 400, 300], dtype=torch.int32)
    ends = torch.tensor([600, 100, 900], dtype=torch.int32)  # past N / before start
    out = run(x, 50, starts, ends, device)
    assert torch.equal(out, top_k_indices_ref(x, 50, starts, ends))
    assert (out[1] == -1).all()


def test_deterministic_and_config_independent(device):
    g = gen(50)
    M, N, k = 6, 4000, 256
    x = torch.tensor([0.5, 1.0, 2.0, -1.0])[torch.randint(0, 4, (M, N), generator=g)] + \
        (torch.rand(M, N, generator=g) < 0.5) * torch.randn(M, N, generator=g)
    starts, ends = ragged_rows(M, N, g)
    outs = [run(x, k, starts, ends, device, c) for c in (None, None, SMALL, SPLIT2, SPLIT4)]
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_empty_batch_and_width(device):
    out = top_k_indices(torch.empty(0, 10, device=device), 4, torch.empty(0, dtype=torch.int32, device=device),
                        torch.empty(0, dtype=torch.int32, device=device))
    assert out.shape == (0, 4)
    z = torch.zeros(2, dtype=torch.int32, device=device)
    out = run(torch.empty(2, 0), 4, z.cpu(), z.cpu(), device)
    assert (out == -1).all()


# ----------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------
def _bad_calls(device):
    x = torch.randn(4, 64, device=device)
    s = torch.zeros(4, dtype=torch.int32, device=device)
    e = torch.full((4,), 64, dtype=torch.int32, device=device)
    sl = torch.full((2,), 64, dtype=torch.int32, device=device)
    bt = torch.zeros(2, 4, dtype=torch.int32, device=device)
    return [
        ("logits", TypeError, lambda: top_k_indices(x.double(), 8, s, e)),
        ("logits", TypeError, lambda: top_k_indices(x.numpy() if device == "cpu" else x.cpu().numpy(), 8, s, e)),
        ("logits", ValueError, lambda: top_k_indices(x[None], 8, s, e)),
        ("logits", ValueError, lambda: top_k_indices(x.t(), 8, s, e)),
        ("k", ValueError, lambda: top_k_indices(x, 0, s, e)),
        ("k", ValueError, lambda: top_k_indices(x, MAX_K + 1, s, e)),
        ("k", ValueError, lambda: top_k_indices(x, 2.0, s, e)),
        ("k", ValueError, lambda: top_k_indices(x, True, s, e)),
        ("row_starts", TypeError, lambda: top_k_indices(x, 8, s.long(), e)),
        ("row_ends", ValueError, lambda: top_k_indices(x, 8, s, e[:3])),
        ("row_ends", ValueError, lambda: top_k_indices(x, 8, s, None)),
        ("row_starts", ValueError, lambda: top_k_indices(x, 8)),
        ("seq_lens", ValueError, lambda: top_k_indices(x, 8, s, e, seq_lens=sl)),
        ("seq_lens", TypeError, lambda: top_k_indices(x, 8, seq_lens=sl.long(), next_n=2)),
        ("seq_lens", ValueError, lambda: top_k_indices(x, 8, seq_lens=sl[None, None], next_n=2)),
        ("seq_lens", ValueError, lambda: top_k_indices(x, 8, seq_lens=sl.view(2, 1), next_n=2)),
        ("logits", ValueError, lambda: top_k_indices(x, 8, seq_lens=sl, next_n=3)),
        ("next_n", ValueError, lambda: top_k_indices(x, 8, seq_lens=sl, next_n=0)),
        ("out", TypeError, lambda: top_k_indices(x, 8, s, e, out=torch.empty(4, 8, dtype=torch.int64, device=device))),
        ("out", ValueError, lambda: top_k_indices(x, 8, s, e, out=torch.empty(4, 9, dtype=torch.int32, device=device))),
        ("out", ValueError, lambda: top_k_indices(x, 8, s, e, out=torch.empty(8, 4, dtype=torch.int32, device=device).t())),
        ("backend", ValueError, lambda: top_k_indices(x, 8, s, e, backend="cuda")),
        ("block_table", ValueError, lambda: top_k_indices(x, 8, s, e, block_table=bt, block_size=16)),
        ("block_size", ValueError, lambda: top_k_indices(x, 8, seq_lens=sl, next_n=2, block_table=bt)),
        ("block_table", ValueError, lambda: top_k_indices(x, 8, seq_lens=sl, next_n=2, block_size=16)),
        ("block_table", TypeError, lambda: top_k_indices(x, 8, seq_lens=sl, next_n=2, block_table=bt.long(),
                                                         block_size=16)),
        ("block_table", ValueError, lambda: top_k_indices(x, 8, seq_lens=sl, next_n=2, block_table=bt[:1],
                                                          block_size=16)),
        ("block_size", ValueError, lambda: top_k_indices(x, 8, seq_lens=sl, next_n=2, block_table=bt, block_size=48)),
    ]


@pytest.mark.parametrize("case", range(28))
def test_validation_errors(case, device):
    name, exc, call = _bad_calls(device)[case]
    with pytest.raises(exc, match=name):
        call()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices")
def test_validation_device_mismatch():
    x = torch.randn(4, 64, device="cuda")
    s = torch.zeros(4, dtype=torch.int32)
    with pytest.raises(ValueError, match="row_starts"):
        top_k_indices(x, 8, s, s.cuda())


# ----------------------------------------------------------------------------------------
# GPU: large shapes
# ----------------------------------------------------------------------------------------
def _check_against_torch_topk(x, k, starts, ends, out):
    """Selected values == torch.topk values (as multisets) for every row with len > k."""
    lens = (ends - starts).long()
    full = lens > k
    assert (out[~full][:, :].lt(0).sum(1) == (k - lens[~full]).clamp_min(0)).all()
    if full.any():
        rows = torch.nonzero(full).flatten()
        for chunk in rows.split(512):
            xs = x[chunk]
            col = torch.arange(x.shape[1], device=x.device)[None, :]
            masked = torch.where((col >= starts[chunk, None]) & (col < ends[chunk, None]), xs, float("-inf"))
            want = torch.sort(torch.topk(masked, k, dim=1).values, dim=1).values
            got_pos = out[chunk].long() + starts[chunk, None].long()
            assert (out[chunk] >= 0).all()
            got = torch.sort(torch.gather(xs, 1, got_pos), dim=1).values
            assert torch.equal(got, want)
            assert (torch.sort(out[chunk], dim=1).values.diff(dim=1) > 0).all()  # unique


@pytest.mark.gpu
def test_gpu_prefill_4096x131072():
    g = torch.Generator(device="cuda").manual_seed(0)
    M, N, k = 4096, 131072, 2048
    x = torch.randn(M, N, device="cuda", generator=g)
    starts = torch.zeros(M, dtype=torch.int32, device="cuda")
    ends = torch.full((M,), N, dtype=torch.int32, device="cuda")
    ends[::7] = torch.randint(1, N, (len(range(0, M, 7)),), device="cuda", generator=g, dtype=torch.int32)
    starts[::5] = torch.minimum(ends[::5] // 3, ends[::5])
    out = poison_(torch.empty(M, k, dtype=torch.int32, device="cuda"))
    top_k_indices(x, k, starts, ends, out=out)
    _check_against_torch_topk(x, k, starts, ends, out)
    again = top_k_indices(x, k, starts, ends)
    assert torch.equal(out, again)
    # exact canonical choice on a few rows
    rows = torch.tensor([0, 5, 7, 4095])
    assert torch.equal(out[rows].cpu(), top_k_indices_ref(x[rows].cpu(), k, starts[rows].cpu(), ends[rows].cpu()))


@pytest.mark.gpu
@pytest.mark.parametrize("next_n", [1, 2])
def test_gpu_decode_64x131072(next_n):
    g = torch.Generator(device="cuda").manual_seed(1)
    B, N, k = 64 // next_n, 131072, 2048
    x = torch.randn(B * next_n, N, device="cuda", generator=g)
    sl = torch.randint(N // 2, N + 1, (B,), device="cuda", generator=g, dtype=torch.int32)
    sl[0] = N
    sl[1] = 1000
    out = poison_(torch.empty(B * next_n, k, dtype=torch.int32, device="cuda"))
    top_k_indices(x, k, seq_lens=sl, next_n=next_n, out=out)
    s, e = decode_row_ranges(sl, next_n)
    _check_against_torch_topk(x, k, s, e, out)
    assert torch.equal(out.cpu(), top_k_indices_decode_ref(x.cpu(), k, sl.cpu(), next_n))
    assert torch.equal(out, top_k_indices(x, k, seq_lens=sl, next_n=next_n))


@pytest.mark.gpu
@pytest.mark.parametrize("next_n,bs", [(1, 64), (2, 1)])
def test_gpu_decode_slots_64x131072(next_n, bs):
    """The decode form with ``block_table`` at decode shape (split path) and with rows short enough for the fused
    path: equal to the positions converted by the PyTorch reference of
    :func:`convert_req_index_to_global_index` (the conversion kernel shares the slot code with top-k)."""
    from dsa.metadata.reference import convert_req_index_to_global_index_ref

    g = torch.Generator(device="cuda").manual_seed(2)
    B, N, k = 64 // next_n, 131072, 2048
    x = torch.randn(B * next_n, N, device="cuda", generator=g)
    sl = torch.randint(N // 2, N + 1, (B,), device="cuda", generator=g, dtype=torch.int32)
    sl[1] = 1000
    bt = _slot_table(B, N, bs, torch.Generator().manual_seed(3), short=False).cuda()
    req = torch.div(torch.arange(B * next_n, device="cuda"), next_n, rounding_mode="floor").int()
    for cfg in (None, TopKConfig(splits=1)):
        out = poison_(torch.empty(B * next_n, k, dtype=torch.int32, device="cuda"))
        top_k_indices(x, k, seq_lens=sl, next_n=next_n, block_table=bt, block_size=bs, out=out, config=cfg)
        pos = top_k_indices(x, k, seq_lens=sl, next_n=next_n, config=cfg)
        assert torch.equal(out, convert_req_index_to_global_index_ref(req, bt, pos, bs))


@pytest.mark.gpu
@pytest.mark.parametrize("k", [1, 2048, MAX_K])
def test_gpu_few_long_rows(k):
    g = torch.Generator(device="cuda").manual_seed(2)
    M, N = 3, 262144 + 77
    x = torch.randn(M, N, device="cuda", generator=g)
    x[1] = torch.round(x[1] * 4) / 4  # heavy ties
    x[2, ::3] = float("-inf")
    starts = torch.tensor([0, 5, 100], dtype=torch.int32, device="cuda")
    ends = torch.tensor([N, N - 3, 200000], dtype=torch.int32, device="cuda")
    out = poison_(torch.empty(M, k, dtype=torch.int32, device="cuda"))
    top_k_indices(x, k, starts, ends, out=out)
    assert torch.equal(out.cpu(), top_k_indices_ref(x.cpu(), k, starts.cpu(), ends.cpu()))
    assert torch.equal(top_k_indices(x, k, starts, ends, config=TopKConfig(splits=1)), out)


@pytest.mark.gpu
def test_gpu_adversarial_rows():
    """Ascending rows (buffer cut at every block) and a misled sample, at full size."""
    N, k = 131072, 2048
    base = torch.arange(N, dtype=torch.float32, device="cuda")
    x = torch.stack([base, -base, torch.randn(N, device="cuda")])
    sp = torch.tensor(sample_positions(N), device="cuda")
    x[2, sp] = 50.0
    starts = torch.zeros(3, dtype=torch.int32, device="cuda")
    ends = torch.full((3,), N, dtype=torch.int32, device="cuda")
    for cfg in (TopKConfig(splits=1), TopKConfig(splits=4)):
        out = top_k_indices(x, k, starts, ends, config=cfg)
        assert torch.equal(out.cpu(), top_k_indices_ref(x.cpu(), k, starts.cpu(), ends.cpu()))
