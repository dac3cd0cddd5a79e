"""dsa.metadata: convert_req_index_to_global_index and generate_sparse_seqlen.

Both ops are integer-exact: every comparison below is torch.equal.
"""
from __future__ import annotations

import pytest
import torch

from dsa.metadata import (
    convert_req_index_to_global_index,
    convert_req_index_to_global_index_ref,
    generate_sparse_seqlen,
    generate_sparse_seqlen_ref,
)
from dsa.metadata.kernel import convert_req_index_to_global_index_triton, generate_sparse_seqlen_triton

from utils import DEVICE, gen, poison_, random_block_table, ragged_lengths

try:  # hypothesis is not installed on the GPU machine: only the property tests need it
    from hypothesis import given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover
    HAVE_HYPOTHESIS = False

SENTINEL = -12345  # what poison_ writes into int32 tensors


# ----------------------------------------------------------------------------- helpers


def make_convert_case(seed: int, T: int, K: int, R: int, B: int, device=DEVICE, long_len=(100, 400)):
    """Ragged requests with a shuffled block table (-1 padded), some allocated-but-negative holes,
    and top-k indices mixing valid positions, -1 (scattered), other negatives, positions past the
    sequence (negative table entries) and past the table."""
    g = gen(seed)
    lens = ragged_lengths(R, (1, 40), long_len, max(1, R // 4), g)
    bt, num_blocks = random_block_table(lens, B, g, extra_blocks=5)
    max_blocks = bt.shape[1]
    # unallocated holes inside used ranges
    holes = torch.rand(bt.shape, generator=g) < 0.1
    bt[holes] = -1
    req_id = torch.randint(0, R, (T,), generator=g, dtype=torch.int32)
    L = torch.tensor(lens, dtype=torch.int64)[req_id.long()]
    u = torch.rand(T, K, generator=g)
    idx = (torch.rand(T, K, generator=g) * L[:, None].double()).long()  # inside the sequence
    beyond_seq = torch.randint(0, max_blocks * B + 1, (T, K), generator=g)
    beyond_table = max_blocks * B + torch.randint(0, 3 * B + 5, (T, K), generator=g)
    neg = -torch.randint(1, 2**20, (T, K), generator=g)
    idx = torch.where(u < 0.15, torch.full_like(idx, -1), idx)
    idx = torch.where((u >= 0.15) & (u < 0.2), neg, idx)
    idx = torch.where((u >= 0.2) & (u < 0.27), beyond_seq, idx)
    idx = torch.where((u >= 0.27) & (u < 0.32), beyond_table, idx)
    return (req_id.to(device), bt.to(device), idx.to(torch.int32).to(device))


def brute_convert(req_id, bt, ti, B):
    T, K = ti.shape
    R, MB = bt.shape
    out = [[-1] * K for _ in range(T)]
    for t in range(T):
        r = int(req_id[t])
        for c in range(K):
            i = int(ti[t, c])
            if not (0 <= r < R) or i < 0 or i // B >= MB:
                continue
            e = int(bt[r, i // B])
            if e < 0 or e * B + i % B >= 2**31:
                continue
            out[t][c] = e * B + i % B
    return torch.tensor(out, dtype=torch.int32).reshape(T, K)


def pack_dense(dense: torch.Tensor, indptr: torch.Tensor) -> torch.Tensor:
    parts = []
    for t in range(dense.shape[0]):
        n = int(indptr[t + 1] - indptr[t])
        parts.append(dense[t, :n])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)


def random_indptr(T: int, K: int, seed: int, device=DEVICE) -> torch.Tensor:
    n = torch.randint(0, K + 1, (T,), generator=gen(seed))
    indptr = torch.zeros(T + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(n, 0)
    return indptr.to(device)


def make_seqlen_case(seed: int, R: int, max_q: int = 40, device=DEVICE):
    """Ragged query lengths (some empty), context lengths around the query length (some 0, some
    shorter than the query: invalid but must clamp to >= 0)."""
    g = gen(seed)
    q = torch.randint(0, max_q + 1, (R,), generator=g)
    q[torch.rand(R, generator=g) < 0.2] = 0
    q[torch.rand(R, generator=g) < 0.3] = 1  # decode tokens
    ctx = torch.randint(0, 300, (R,), generator=g)
    L = q + ctx
    L[torch.rand(R, generator=g) < 0.1] = 0
    short = torch.rand(R, generator=g) < 0.1
    L[short] = (q[short] // 2)
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    return qsl.to(device), L.to(torch.int32).to(device)


def brute_seqlen(qsl, L, topk, T):
    out = [0] * T
    for r in range(L.shape[0]):
        s, e = int(qsl[r]), int(qsl[r + 1])
        for i in range(e - s):
            if s + i < T:
                out[s + i] = max(0, min(int(L[r]) - (e - s) + i + 1, topk))
    return torch.tensor(out, dtype=torch.int32)


# ----------------------------------------------------------------------------- reference vs brute force


@pytest.mark.parametrize("B", [1, 4, 16])
def test_convert_reference_vs_bruteforce(B):
    req_id, bt, ti = make_convert_case(1 + B, T=9, K=13, R=4, B=B, device="cpu", long_len=(30, 60))
    req_id[3] = 7  # out-of-range request -> whole row invalid
    req_id[5] = -1
    want = brute_convert(req_id, bt, ti, B)
    out, cnt = convert_req_index_to_global_index_ref(req_id, bt, ti, B, return_valid_counts=True)
    assert torch.equal(out, want)
    assert torch.equal(cnt, (want >= 0).sum(1).to(torch.int32))
    assert (out[3] == -1).all() and (out[5] == -1).all()
    assert (want >= 0).any() and (want == -1).any()
    # CSR reference == packing the brute-force rows
    indptr = random_indptr(9, 13, seed=B, device="cpu")
    packed, pcnt = convert_req_index_to_global_index_ref(req_id, bt, ti, B, indptr=indptr, return_valid_counts=True)
    assert torch.equal(packed, pack_dense(want, indptr))
    n = (indptr[1:] - indptr[:-1]).tolist()
    assert pcnt.tolist() == [int((want[t, : n[t]] >= 0).sum()) for t in range(9)]


def test_seqlen_reference_vs_bruteforce():
    for seed in range(3):
        qsl, L = make_seqlen_case(seed, R=7, max_q=9, device="cpu")
        for topk in (1, 5, 64, 2048):
            T = int(qsl[-1]) + 3
            got = generate_sparse_seqlen_ref(qsl, L, topk, num_tokens=T)
            assert torch.equal(got, brute_seqlen(qsl, L, topk, T))


def test_seqlen_reference_examples():
    # one prefill of 4 new tokens on a context of 10, one decode at 3, one empty request, one L == 0
    qsl = torch.tensor([0, 4, 5, 5, 7], dtype=torch.int32)
    L = torch.tensor([10, 3, 8, 0], dtype=torch.int32)
    got = generate_sparse_seqlen_ref(qsl, L, topk=8)
    assert got.tolist() == [7, 8, 8, 8, 3, 0, 0]


# ----------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("B", [1, 16, 64, 256])
@pytest.mark.parametrize("T,K", [(13, 100), (1, 1), (1, 37), (6, 1), (5, 1031)])
def test_convert_kernel_dense(B, T, K):
    req_id, bt, ti = make_convert_case(100 * B + T + K, T, K, R=5, B=B)
    out = poison_(torch.empty(T, K, dtype=torch.int32, device=DEVICE))
    res, cnt = convert_req_index_to_global_index(req_id, bt, ti, B, out=out, return_valid_counts=True, backend="triton")
    ref, rcnt = convert_req_index_to_global_index_ref(req_id, bt, ti, B, return_valid_counts=True)
    assert res is out
    assert not (out == SENTINEL).any()
    assert torch.equal(out, ref) and torch.equal(cnt, rcnt)
    if T * K > 50:
        assert (ref >= 0).any() and (ref == -1).any()
    # without out / counts
    assert torch.equal(convert_req_index_to_global_index(req_id, bt, ti, B, backend="triton"), ref)


@pytest.mark.parametrize("block_n", [16, 32])
def test_convert_kernel_multi_tile(block_n):
    """K not a multiple of BLOCK_N, several tiles per row, strided inputs, row-strided out."""
    T, K, B = 7, 75, 16
    req_id, bt, ti = make_convert_case(7 + block_n, T, K, R=3, B=B)
    bt_wide = torch.full((bt.shape[0] + 2, bt.shape[1] + 5), 999, dtype=torch.int32, device=DEVICE)
    bt_wide[: bt.shape[0], : bt.shape[1]] = bt
    bt_view = bt_wide[: bt.shape[0], : bt.shape[1]]  # row stride != max_blocks
    ti_wide = torch.full((T, K + 9), 5, dtype=torch.int32, device=DEVICE)
    ti_wide[:, :K] = ti
    ti_view = ti_wide[:, :K]
    out_wide = poison_(torch.empty(T, K + 3, dtype=torch.int32, device=DEVICE))
    out = out_wide[:, :K]
    cnt = torch.zeros(T, dtype=torch.int32, device=DEVICE)
    convert_req_index_to_global_index_triton(req_id, bt_view, ti_view, B, out, None, cnt, block_n=block_n)
    ref, rcnt = convert_req_index_to_global_index_ref(req_id, bt, ti, B, return_valid_counts=True)
    assert torch.equal(out, ref) and torch.equal(cnt, rcnt)
    assert (out_wide[:, K:] == SENTINEL).all()  # nothing written past the row
    # CSR through the same tiles
    indptr = random_indptr(T, K, seed=block_n)
    n_total = int(indptr[-1])
    packed = poison_(torch.empty(n_total + 4, dtype=torch.int32, device=DEVICE))
    cnt.zero_()
    convert_req_index_to_global_index_triton(req_id, bt_view, ti_view, B, packed, indptr, cnt, block_n=block_n)
    assert torch.equal(packed[:n_total].cpu(), pack_dense(ref.cpu(), indptr.cpu()))
    assert (packed[n_total:] == SENTINEL).all()
    _, pcnt = convert_req_index_to_global_index_ref(req_id, bt, ti, B, indptr=indptr, return_valid_counts=True)
    assert torch.equal(cnt, pcnt)


@pytest.mark.parametrize("B", [1, 64])
def test_convert_kernel_csr(B):
    T, K = 11, 200
    req_id, bt, ti = make_convert_case(31 + B, T, K, R=4, B=B)
    indptr = random_indptr(T, K, seed=B)
    indptr_cpu = indptr.cpu()
    # full rows and empty rows too
    n = (indptr_cpu[1:] - indptr_cpu[:-1])
    n[2], n[4] = K, 0
    indptr_cpu[1:] = torch.cumsum(n, 0)
    indptr = indptr_cpu.to(DEVICE)
    n_total = int(indptr_cpu[-1])
    dense = convert_req_index_to_global_index_ref(req_id, bt, ti, B)
    want = pack_dense(dense.cpu(), indptr_cpu)
    # implicit size (host sync)
    got, cnt = convert_req_index_to_global_index(req_id, bt, ti, B, indptr=indptr, return_valid_counts=True,
                                                 backend="triton")
    assert got.shape == (n_total,) and torch.equal(got.cpu(), want)
    assert torch.equal(cnt.cpu(), torch.tensor([int((dense[t, : n[t]] >= 0).sum()) for t in range(T)],
                                               dtype=torch.int32))
    # invalid entries stay -1 (never 0 = a real slot)
    assert (want == -1).any()
    assert torch.equal(got.cpu() == -1, want == -1)
    # given out (poisoned, bigger than needed) and counts buffer (poisoned)
    out = poison_(torch.empty(n_total + 10, dtype=torch.int32, device=DEVICE))
    cbuf = poison_(torch.empty(T, dtype=torch.int32, device=DEVICE))
    got2, cnt2 = convert_req_index_to_global_index(req_id, bt, ti, B, indptr=indptr, out=out, valid_counts_out=cbuf,
                                                   backend="triton")
    assert got2 is out and cnt2 is cbuf
    assert torch.equal(out[:n_total].cpu(), want) and (out[n_total:] == SENTINEL).all()
    assert torch.equal(cbuf, cnt)
    # an out too small: writes are clipped, never out of bounds
    small = poison_(torch.empty(n_total // 2, dtype=torch.int32, device=DEVICE))
    convert_req_index_to_global_index(req_id, bt, ti, B, indptr=indptr, out=small, backend="triton")
    assert torch.equal(small.cpu(), want[: n_total // 2])


def test_convert_edge_values():
    """Slots that overflow int32 and out-of-range request ids become -1 (never wrap)."""
    B = 256
    bt = torch.tensor([[2**23 - 1, 2**23, 5, -7], [0, 1, 2**31 - 1, 3]], dtype=torch.int32, device=DEVICE)
    req_id = torch.tensor([0, 1, 2, -1, 1], dtype=torch.int32, device=DEVICE)
    ti = torch.tensor(
        [[255, 256, 2 * 256 + 3, 3 * 256, 4 * 256, -1],
         [0, 257, 2 * 256, 3 * 256 + 255, 2**31 - 1, -(2**31)],
         [0, 1, 2, 3, 4, 5],
         [0, 1, 2, 3, 4, 5],
         [-2, 511, 512, 1023, 1024, 1025]],
        dtype=torch.int32, device=DEVICE)
    want = torch.tensor(
        [[2**31 - 1, -1, 5 * 256 + 3, -1, -1, -1],
         [0, 257, -1, 3 * 256 + 255, -1, -1],
         [-1] * 6,
         [-1] * 6,
         [-1, 511, -1, 3 * 256 + 255, -1, -1]],
        dtype=torch.int32)
    for backend in ("reference", "triton"):
        out, cnt = convert_req_index_to_global_index(req_id, bt, ti, B, return_valid_counts=True, backend=backend)
        assert torch.equal(out.cpu(), want), backend
        assert cnt.tolist() == [2, 3, 0, 0, 2]


def test_convert_empty_and_zero_width_table():
    bt = torch.zeros(2, 0, dtype=torch.int32, device=DEVICE)
    req_id = torch.tensor([0, 1, 1], dtype=torch.int32, device=DEVICE)
    ti = torch.tensor([[0, 3], [-1, 1], [2, 0]], dtype=torch.int32, device=DEVICE)
    out, cnt = convert_req_index_to_global_index(req_id, bt, ti, 16, return_valid_counts=True, backend="triton")
    assert (out == -1).all() and (cnt == 0).all()
    e = convert_req_index_to_global_index(req_id[:0], bt, ti[:0], 16, backend="triton")
    assert e.shape == (0, 2)
    e = convert_req_index_to_global_index(req_id, bt, ti[:, :0], 16, backend="triton")
    assert e.shape == (3, 0)
    e, c = convert_req_index_to_global_index(req_id[:0], bt, ti[:0], 16, indptr=torch.zeros(1, dtype=torch.int32,
                                             device=DEVICE), return_valid_counts=True, backend="triton")
    assert e.shape == (0,) and c.shape == (0,)


@pytest.mark.parametrize("R,max_q,block_t", [(1, 30, None), (9, 40, 16), (37, 25, 16), (130, 6, 64)])
def test_seqlen_kernel(R, max_q, block_t):
    qsl, L = make_seqlen_case(R + max_q, R, max_q)
    total = int(qsl[-1])
    for topk in (1, 7, 2048):
        ref = generate_sparse_seqlen_ref(qsl, L, topk)
        got = generate_sparse_seqlen(qsl, L, topk, backend="triton")  # T = qsl[-1] (sync)
        assert torch.equal(got, ref)
        # padded output: poisoned, bigger than the real token count -> padding gets 0
        out = poison_(torch.empty(total + 5, dtype=torch.int32, device=DEVICE))
        generate_sparse_seqlen_triton(qsl, L, topk, out, block_t=block_t)
        assert torch.equal(out[:total], ref) and (out[total:] == 0).all()
        assert torch.equal(out.cpu(), brute_seqlen(qsl.cpu(), L.cpu(), topk, total + 5))


def test_seqlen_kernel_edges():
    # no requests; all-empty requests; a truncated T
    for qsl, L in [([0], []), ([0, 0, 0], [5, 0]), ([0, 3, 3, 10], [3, 1, 100])]:
        qsl = torch.tensor(qsl, dtype=torch.int32, device=DEVICE)
        L = torch.tensor(L, dtype=torch.int32, device=DEVICE)
        for T in (0, 1, 4, 12):
            out = poison_(torch.empty(T, dtype=torch.int32, device=DEVICE))
            got = generate_sparse_seqlen(qsl, L, 4, out=out, backend="triton")
            assert got is out
            assert torch.equal(out.cpu(), brute_seqlen(qsl.cpu(), L.cpu(), 4, T))
            assert torch.equal(generate_sparse_seqlen(qsl, L, 4, num_tokens=T, backend="reference").cpu(), out.cpu())


def test_sparse_seqlen_cumsum_is_indptr():
    """The CSR indptr built from generate_sparse_seqlen feeds the packed conversion."""
    B, topk = 16, 24
    qsl, L = make_seqlen_case(5, R=4, max_q=6)
    T = int(qsl[-1])
    n = generate_sparse_seqlen(qsl, L, topk, num_tokens=T, backend="triton")
    indptr = torch.zeros(T + 1, dtype=torch.int32, device=DEVICE)
    indptr[1:] = torch.cumsum(n, 0)
    lens = L.cpu().tolist()
    bt, _ = random_block_table([max(x, 1) for x in lens], B, gen(3))
    bt = bt.to(DEVICE)
    req_id = (torch.searchsorted(qsl.long(), torch.arange(T, device=DEVICE), right=True) - 1).to(torch.int32)
    ti = torch.arange(topk, dtype=torch.int32, device=DEVICE).repeat(T, 1)  # the first topk positions
    packed = convert_req_index_to_global_index(req_id, bt, ti, B, indptr=indptr, backend="triton")
    ref = pack_dense(convert_req_index_to_global_index_ref(req_id, bt, ti, B).cpu(), indptr.cpu())
    assert torch.equal(packed.cpu(), ref)
    assert (packed >= 0).all()  # every kept position is inside its request's allocated blocks


# ----------------------------------------------------------------------------- property-based

if HAVE_HYPOTHESIS:

    @settings(max_examples=25, deadline=None)
    @given(
        T=st.integers(1, 6), K=st.integers(1, 40), R=st.integers(1, 4), log_b=st.integers(0, 8),
        seed=st.integers(0, 2**16), csr=st.booleans(), block_n=st.sampled_from([None, 16]),
    )
    def test_convert_property(T, K, R, log_b, seed, csr, block_n):
        B = 1 << log_b
        req_id, bt, ti = make_convert_case(seed, T, K, R, B, long_len=(10, 3 * B + 7))
        dense, cnt = convert_req_index_to_global_index_ref(req_id, bt, ti, B, return_valid_counts=True)
        assert torch.equal(dense.cpu(), brute_convert(req_id.cpu(), bt.cpu(), ti.cpu(), B))
        counts = torch.zeros(T, dtype=torch.int32, device=DEVICE)
        if csr:
            indptr = random_indptr(T, K, seed)
            out = poison_(torch.empty(int(indptr[-1]), dtype=torch.int32, device=DEVICE))
            convert_req_index_to_global_index_triton(req_id, bt, ti, B, out, indptr, counts, block_n=block_n)
            assert torch.equal(out.cpu(), pack_dense(dense.cpu(), indptr.cpu()))
            n = (indptr[1:] - indptr[:-1]).cpu()
            assert counts.cpu().tolist() == [int((dense[t, : n[t]] >= 0).sum()) for t in range(T)]
        else:
            out = poison_(torch.empty(T, K, dtype=torch.int32, device=DEVICE))
            convert_req_index_to_global_index_triton(req_id, bt, ti, B, out, None, counts, block_n=block_n)
            assert torch.equal(out, dense) and torch.equal(counts, cnt)

    @settings(max_examples=25, deadline=None)
    @given(
        lens=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 40)), min_size=0, max_size=12),
        topk=st.integers(1, 50), pad=st.integers(0, 5), block_t=st.sampled_from([None, 16]),
    )
    def test_seqlen_property(lens, topk, pad, block_t):
        q = [a for a, _ in lens]
        L = [b for _, b in lens]
        qsl = torch.tensor([0] + torch.tensor(q, dtype=torch.int64).cumsum(0).tolist(), dtype=torch.int32)
        L = torch.tensor(L, dtype=torch.int32)
        T = int(qsl[-1]) + pad
        want = brute_seqlen(qsl, L, topk, T)
        assert torch.equal(generate_sparse_seqlen_ref(qsl, L, topk, num_tokens=T), want)
        out = poison_(torch.empty(T, dtype=torch.int32, device=DEVICE))
        generate_sparse_seqlen_triton(qsl.to(DEVICE), L.to(DEVICE), topk, out, block_t=block_t)
        assert torch.equal(out.cpu(), want)

else:  # pragma: no cover

    @pytest.mark.skip(reason="hypothesis not installed")
    def test_property_based():
        pass


# ----------------------------------------------------------------------------- validation


def _good_convert():
    return make_convert_case(0, T=4, K=8, R=2, B=16, device="cpu")


@pytest.mark.parametrize(
    "mutate,exc,name",
    [
        (lambda a: a.update(req_id=a["req_id"].long()), TypeError, "req_id"),
        (lambda a: a.update(req_id=a["req_id"][:3]), ValueError, "req_id"),
        (lambda a: a.update(req_id=[0, 1, 0, 1]), TypeError, "req_id"),
        (lambda a: a.update(block_table=a["block_table"].float()), TypeError, "block_table"),
        (lambda a: a.update(block_table=a["block_table"][0]), ValueError, "block_table"),
        (lambda a: a.update(token_indices=a["token_indices"].long()), TypeError, "token_indices"),
        (lambda a: a.update(token_indices=a["token_indices"].t()), ValueError, "token_indices"),
        (lambda a: a.update(token_indices=a["token_indices"][None]), ValueError, "token_indices"),
        (lambda a: a.update(block_size=12), ValueError, "block_size"),
        (lambda a: a.update(block_size=512), ValueError, "block_size"),
        (lambda a: a.update(block_size=16.0), ValueError, "block_size"),
        (lambda a: a.update(indptr=torch.zeros(4, dtype=torch.int32)), ValueError, "indptr"),
        (lambda a: a.update(indptr=torch.zeros(5, dtype=torch.int64)), TypeError, "indptr"),
        (lambda a: a.update(out=torch.zeros(4, 7, dtype=torch.int32)), ValueError, "out"),
        (lambda a: a.update(out=torch.zeros(4, 8, dtype=torch.int64)), TypeError, "out"),
        (lambda a: a.update(out=torch.zeros(4, 8, dtype=torch.int32),
                            indptr=torch.zeros(5, dtype=torch.int32)), ValueError, "out"),
        (lambda a: a.update(valid_counts_out=torch.zeros(3, dtype=torch.int32)), ValueError, "valid_counts_out"),
        (lambda a: a.update(return_valid_counts=1), TypeError, "return_valid_counts"),
        (lambda a: a.update(backend="cuda"), ValueError, "backend"),
    ],
)
def test_convert_validation(mutate, exc, name):
    req_id, bt, ti = _good_convert()
    args = dict(req_id=req_id, block_table=bt, token_indices=ti, block_size=16)
    mutate(args)
    with pytest.raises(exc, match=name):
        convert_req_index_to_global_index(**args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs two devices")
def test_convert_validation_device():
    req_id, bt, ti = _good_convert()
    with pytest.raises(ValueError, match="block_table"):
        convert_req_index_to_global_index(req_id.cuda(), bt, ti.cuda(), 16)


@pytest.mark.parametrize(
    "mutate,exc,name",
    [
        (lambda a: a.update(query_start_loc=a["query_start_loc"].long()), TypeError, "query_start_loc"),
        (lambda a: a.update(query_start_loc=a["query_start_loc"][:-1]), ValueError, "query_start_loc"),
        (lambda a: a.update(seq_lens=a["seq_lens"].float()), TypeError, "seq_lens"),
        (lambda a: a.update(seq_lens=a["seq_lens"][None]), ValueError, "seq_lens"),
        (lambda a: a.update(topk=0), ValueError, "topk"),
        (lambda a: a.update(topk=2.5), ValueError, "topk"),
        (lambda a: a.update(num_tokens=-1), ValueError, "num_tokens"),
        (lambda a: a.update(out=torch.zeros(5, dtype=torch.int64)), TypeError, "out"),
        (lambda a: a.update(out=torch.zeros(5, 1, dtype=torch.int32)), ValueError, "out"),
        (lambda a: a.update(out=torch.zeros(5, dtype=torch.int32), num_tokens=6), ValueError, "out"),
        (lambda a: a.update(backend="gpu"), ValueError, "backend"),
    ],
)
def test_seqlen_validation(mutate, exc, name):
    qsl = torch.tensor([0, 2, 5], dtype=torch.int32)
    L = torch.tensor([4, 9], dtype=torch.int32)
    args = dict(query_start_loc=qsl, seq_lens=L, topk=4)
    mutate(args)
    with pytest.raises(exc, match=name):
        generate_sparse_seqlen(**args)


# ----------------------------------------------------------------------------- GPU (larger shapes)


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64, 256])
def test_convert_gpu_large(B):
    T, K = 4000, 2048
    req_id, bt, ti = make_convert_case(B, T, K, R=64, B=B, long_len=(3000, 9000))
    out = poison_(torch.empty(T, K, dtype=torch.int32, device=DEVICE))
    _, cnt = convert_req_index_to_global_index(req_id, bt, ti, B, out=out, return_valid_counts=True)
    ref, rcnt = convert_req_index_to_global_index_ref(req_id, bt, ti, B, return_valid_counts=True)
    assert torch.equal(out, ref) and torch.equal(cnt, rcnt)
    indptr = random_indptr(T, K, seed=B)
    packed = poison_(torch.empty(T * K, dtype=torch.int32, device=DEVICE))
    _, pc = convert_req_index_to_global_index(req_id, bt, ti, B, indptr=indptr, out=packed, return_valid_counts=True)
    rp, rpc = convert_req_index_to_global_index_ref(req_id, bt, ti, B, indptr=indptr, return_valid_counts=True)
    n = int(indptr[-1])
    assert torch.equal(packed[:n], rp) and torch.equal(pc, rpc) and (packed[n:] == SENTINEL).all()


@pytest.mark.gpu
def test_seqlen_gpu_large():
    qsl, L = make_seqlen_case(0, R=3000, max_q=20)
    T = int(qsl[-1])
    for topk in (512, 2048):
        out = poison_(torch.empty(T + 100, dtype=torch.int32, device=DEVICE))
        generate_sparse_seqlen(qsl, L, topk, out=out)
        assert torch.equal(out, generate_sparse_seqlen_ref(qsl, L, topk, num_tokens=T + 100))


def _capture(fn):
    """Capture ``fn`` into a CUDA graph; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@pytest.mark.gpu
def test_gpu_cuda_graph():
    """Capture both ops (with out= buffers: no sync) in a CUDA graph; replay on new inputs."""
    T, K, B, R = 512, 256, 16, 8
    req_id, bt, ti = make_convert_case(90, T, K, R, B)
    qsl, L = make_seqlen_case(91, R=R, max_q=50)
    Tq = int(qsl[-1]) + 7
    out = torch.empty(T, K, dtype=torch.int32, device=DEVICE)
    cnt = torch.empty(T, dtype=torch.int32, device=DEVICE)
    indptr = random_indptr(T, K, seed=92)
    packed = torch.empty(T * K, dtype=torch.int32, device=DEVICE)
    pcnt = torch.empty(T, dtype=torch.int32, device=DEVICE)
    n_out = torch.empty(Tq, dtype=torch.int32, device=DEVICE)

    def step():
        convert_req_index_to_global_index(req_id, bt, ti, B, out=out, valid_counts_out=cnt)
        convert_req_index_to_global_index(req_id, bt, ti, B, indptr=indptr, out=packed, valid_counts_out=pcnt)
        generate_sparse_seqlen(qsl, L, 100, out=n_out)

    step()
    torch.cuda.synchronize()
    replay = _capture(step)
    g = gen(93)  # new values, same shapes
    r2 = torch.randint(0, R, (T,), generator=g, dtype=torch.int32)
    b2 = bt.cpu()[torch.randperm(R, generator=g)]
    t2 = ti.cpu()[torch.randperm(T, generator=g)]
    req_id.copy_(r2), bt.copy_(b2), ti.copy_(t2), L.copy_(L.flip(0) + 3)
    replay()
    torch.cuda.synchronize()
    ref, rcnt = convert_req_index_to_global_index_ref(req_id, bt, ti, B, return_valid_counts=True)
    assert torch.equal(out, ref) and torch.equal(cnt, rcnt)
    rp, rpc = convert_req_index_to_global_index_ref(req_id, bt, ti, B, indptr=indptr, return_valid_counts=True)
    assert torch.equal(packed[: rp.numel()], rp) and torch.equal(pcnt, rpc)
    assert torch.equal(n_out, generate_sparse_seqlen_ref(qsl, L, 100, num_tokens=Tq))
