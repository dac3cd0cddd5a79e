"""The 1-16-head fp8_ds_mla decode kernel on the bulk-copy ring (``dsa.mla.kernel_bulk``, sm_90 only).

Its Gluon kernel cannot run under the CPU interpreter. Here on any machine: what its compiled sm_90a code must hold
(the ring at the offset the copies use, no spills, every operand converted in registers,
the index validity by ballots) and its host-side rules. On a Hopper GPU: the kernel against the reference with
invalid entries scattered through the rows, NaN in every unused cache slot, rows with no valid entry,
``topk_length``, sink, 1-4 and 32 splits (3 merged as 4, one padding split), poisoned and padded outputs, a
strided q, reruns (bitwise equal), the default dispatch, and a CUDA-graph replay; with 1, 8 and 12 heads too."""
import pytest
import torch

import dsa.mla.reference as ref_mod
from dsa.constants import D_V
from dsa.mla import kernel_bulk as KB
from dsa.mla import sparse_mla, sparse_mla_ref
from dsa.mla.kernel import sparse_mla_triton
from test_mla import assert_matches, make_case, max_abs_v
from utils import compiled_in_subprocess, poison_, record_launches, skip_unless_hopper

_COMPILE = r"""
import bench_mla_bulk as B

for name, args in (("1 split", (1, )), ("4 splits", (4, )), ("3 splits", (3, )),
                   ("len sink", (2, True, True)),
                   ("len sink 1 split", (1, True, True)), ("copies", (1, False, False, True)),
                   ("trace", (2, False, False, False, True)),
                   ("8 heads", (1, False, False, False, False, True, 8)),
                   ("8 heads 4 splits len sink", (4, True, True, False, False, True, 8))):
    out[name] = G.sass_counts(B.compile_only(*args), PRE)
"""
_PRE = ("LDS", "LDG", "STS", "STG", "STL", "LDL", "HMMA", "F2FP", "UBLKCP", "VOTE")


def test_bulk_kernel_compiles_for_sm90():
    c = compiled_in_subprocess(_COMPILE, _PRE)
    for name, counts in c.items():
        assert counts.get("UBLKCP.S.G", 0) > 0, (name, counts)  # the rows go in by bulk copies
        assert "STL" not in counts and "LDL" not in counts, (name, counts)  # no spills
    one = c["1 split"]
    # per thread and 64-row tile: 16 + 16 16-byte operand reads, 8 8-byte rope reads, 256 fp8 -> f16 conversions,
    # 128 + 8 products; the other shared traffic: the logits' sum (16 8-byte stores of the partials, 16 8-byte reads
    # of the warp's quarter of them, 4 8-byte stores of its sums, 16 8-byte reads of all the sums) and the output's
    # reorder (16 16-byte stores); the tile's validity from two ballots; at one split the bf16 output in 8-byte stores
    assert one["LDS.128"] == 32 and one["F2FP.F16.E4M3.UNPACK_B"] == 256 and one["LDS.64"] == 40, one
    assert one["HMMA.16816.F32"] == 128 and one["HMMA.16816.F32.BF16"] == 8, one
    assert one["STS.64"] == 20 and one["STS.128"] == 16 and one["STG.E.64"] == 16, one
    assert one["VOTE.ANY"] == 2, one
    # more splits: fp32 partials in 16-byte stores, the last program's merge in 16-byte loads
    assert c["4 splits"]["STG.E.128"] == 16 and c["4 splits"]["LDG.E.128"] == 64, c["4 splits"]
    # the merge pads the splits' lse to a power of two (the padding's loads masked off at compile time) and loads
    # each partial value once: 16 heads x 512 / 128 threads / 4 per load, per split
    assert c["3 splits"]["LDG.E.128"] == 48, c["3 splits"]
    assert "HMMA.16816.F32" not in c["copies"], c["copies"]  # SKIP: the copies alone
    # 8 heads: the same 16-head products and conversions; half the output's stores, and the merge loads the partials
    # of the 8 stored heads only
    h8 = c["8 heads"]
    assert h8["HMMA.16816.F32"] == 128 and h8["F2FP.F16.E4M3.UNPACK_B"] == 256 and h8["STG.E.64"] == 8, h8
    assert c["8 heads 4 splits len sink"]["LDG.E.128"] == 32, c["8 heads 4 splits len sink"]


def test_bulk_host_rules(monkeypatch):
    """Where the kernel applies and serves, and its split count (one CTA per SM)."""
    q = torch.zeros(64, 16, 576, dtype=torch.bfloat16)
    kv = torch.zeros(100, 656, dtype=torch.uint8)
    idx = torch.zeros(64, 2048, dtype=torch.int32)
    assert not KB.applies(q, kv, idx, None)  # not on a Hopper GPU (or under the interpreter)
    with monkeypatch.context() as m:  # on one, a flat view whose rows are not 656 bytes apart is not served
        m.setattr("dsa.backend.on_hopper", lambda dev: True)
        assert KB.applies(q, kv, idx, None) and KB.applies(q, kv, idx, torch.zeros(64, 16, 512))
        assert not KB.applies(q, torch.zeros(100, 700, dtype=torch.uint8)[:, :656], idx, None)
        assert not KB.applies(q, torch.zeros(100, 576, dtype=torch.bfloat16), idx, None)
        for h_q, ok in ((1, True), (8, True), (12, True), (17, False), (32, False)):  # 1-16 heads
            assert KB.applies(torch.zeros(64, h_q, 576, dtype=torch.bfloat16), kv, idx, None) == ok, h_q
    assert not KB.serves(KB.MIN_T - 1, 2048) and KB.serves(KB.MIN_T, 2048) and KB.serves(256, 2048)
    assert [KB.num_splits_for(T, 2048, 132) for T in (1, 32, 64, 66, 67, 128, 256)] == [32, 4, 2, 2, 1, 1, 1]
    assert KB.num_splits_for(1, 100, 132) == 2  # at most one program per 64-entry tile
    assert KB.split_plan(5, 1000, 3, 132) == (3, 384) and KB.split_plan(3, 300, 4, 132) == (3, 128)
    assert KB.split_plan(2, 1, None, 132) == (1, 64) and KB.split_plan(64, 2048, None, 132) == (2, 1024)
    assert 4 * KB.ring_words()["RING_WORDS"] == KB.STAGES * 64 * 656


def test_bulk_specialisation():
    """The key of the compiled variants whose shared offsets are checked: what the launcher specialises on."""
    x = torch.zeros(64, dtype=torch.int32)
    assert KB.specialisation((x, x[1:], 32, 1, 7, 2**31, 0.5)) == (
        True, False, (True, False, True), (False, True, True), (False, False, True), (True, False, False))


def test_bulk_dispatch_on_cpu_is_the_reference():
    """Off Hopper ``config=dict(bulk=True)`` cannot take the kernel: the call is served as without it."""
    q, kv, idx, sm, sink, tl_ = make_case(2, 16, 70, 200, "fp8_ds_mla", seed=5, with_len=True, with_sink=True)
    flat = ref_mod.flat_kv(kv)
    got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, None, config=dict(bulk=True))
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, 200))


# ----------------------------------------------------------------------------------------------
# GPU (sm_90)
# ----------------------------------------------------------------------------------------------
def _launches(monkeypatch) -> list:
    """Records the split count of every launch of the bulk kernel."""
    calls = []
    kern = KB._sparse_mla_bulk_kernel
    spy = lambda self, grid: lambda *a, **k: (calls.append(k["NSPLIT"]), kern[grid](*a, **k))[1]  # noqa: E731
    monkeypatch.setattr(KB, "_sparse_mla_bulk_kernel", type("Spy", (), {"__getitem__": spy,
                                                                        "warmup": kern.warmup})())
    return calls


def _check_bulk(monkeypatch, T, H, topk, S, splits, seed, extras, msg):
    """The bulk kernel on a fresh case (20% invalid entries, NaN in unused slots, a row with no valid entry; with
    ``extras`` also topk_length (full, 0, random) and a sink) against the reference, twice into poisoned output
    rows padded on both sides (head stride 640; the split counters are the call's own): its split count, nothing
    written outside the output rows, lse and max_logits of exactly ``H`` heads, bitwise equal reruns; and against
    ``kernel_sm90``."""
    skip_unless_hopper()
    q, kv, idx, sm, sink, tl_ = make_case(T, H, topk, S, "fp8_ds_mla", seed=seed, with_len=extras,
                                          with_sink=extras, empty_rows=(1,) if T > 2 else ())
    if tl_ is not None:
        tl_[0] = topk
        if T > 2:
            tl_[2] = 0
    flat = ref_mod.flat_kv(kv)
    calls = _launches(monkeypatch)
    outs, bigs = [], []
    for _ in range(2):
        big = poison_(torch.empty(T, H, 640, dtype=torch.bfloat16, device=q.device))
        out = big[:, :, 64:64 + D_V]
        got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, out, num_splits=splits, config=dict(bulk=True))
        assert got[0] is out and got[1].shape == (T, H) and got[2].shape == (T, H)
        outs.append(got)
        bigs.append(big)
    nsm = torch.cuda.get_device_properties(q.device).multi_processor_count
    assert calls == [KB.split_plan(T, topk, splits, nsm)[0]] * 2
    for big in bigs:  # nothing written outside the output rows
        assert torch.isnan(big[:, :, :64].float()).all() and torch.isnan(big[:, :, 64 + D_V:].float()).all()
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    vmax = max_abs_v(kv, idx, S)
    assert_matches(outs[0], want, vmax, msg)
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    other = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, None, num_splits=splits, config=dict(bulk=False))
    assert_matches(outs[0], other, vmax, f"{msg} against kernel_sm90")


@pytest.mark.gpu
@pytest.mark.parametrize("T,topk,S,splits", [(1, 37, 90, None), (3, 2048, 1 << 15, None), (3, 300, 4096, 4),
                                             (5, 1000, 5056, 3), (64, 2048, 1 << 16, None), (7, 64, 500, 1),
                                             (70, 129, 4096, None), (200, 640, 8192, 2), (2, 1, 50, None)])
@pytest.mark.parametrize("extras", [False, True])
def test_gpu_bulk_kernel(T, topk, S, splits, extras, monkeypatch):
    """16 heads (:func:`_check_bulk`), with and without topk_length and a sink."""
    _check_bulk(monkeypatch, T, 16, topk, S, splits, T * 7 + topk, extras, str((T, topk, S, splits, extras)))


@pytest.mark.gpu
@pytest.mark.parametrize("T,topk,S,splits", [(3, 2048, 1 << 15, None), (5, 1000, 5056, 3), (64, 2048, 1 << 16, None),
                                             (70, 129, 4096, None), (7, 64, 500, 1)])
@pytest.mark.parametrize("H", [8, 1, 12])
def test_gpu_bulk_kernel_fewer_heads(T, topk, S, splits, H, monkeypatch):
    """Fewer than 16 heads (the missing ones zero in the products, never stored; :func:`_check_bulk`), with
    topk_length and a sink."""
    _check_bulk(monkeypatch, T, H, topk, S, splits, T * 11 + topk + H, True, str((T, topk, S, splits, H)))


@pytest.mark.gpu
def test_gpu_bulk_strided_q_and_paged_cache(monkeypatch):
    """q with a head stride of 640 and the paged cache view [blocks, 64, 1, 656] through the public op."""
    skip_unless_hopper()
    T, S = 80, 1 << 14
    q0, kv, idx, sm, sink, tl_ = make_case(T, 16, 512, S, "fp8_ds_mla", seed=3, block_size=64, with_len=True,
                                           with_sink=True)
    qbig = poison_(torch.empty(T, 16, 640, dtype=torch.bfloat16, device=q0.device))
    qbig[:, :, 32:32 + 576] = q0
    q = qbig[:, :, 32:32 + 576]
    calls = _launches(monkeypatch)
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert calls == [1]  # (80 tokens: one split each, the default dispatch)
    assert_matches(got, sparse_mla_ref(q0, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, S))


@pytest.mark.gpu
@pytest.mark.parametrize("T,H,kv_format,bulk", [(64, 16, "fp8_ds_mla", True), (200, 16, "fp8_ds_mla", True),
                                                (32, 16, "fp8_ds_mla", True), (31, 16, "fp8_ds_mla", False),
                                                (64, 32, "fp8_ds_mla", False), (64, 8, "fp8_ds_mla", True),
                                                (31, 8, "fp8_ds_mla", False), (40, 24, "fp8_ds_mla", False),
                                                (64, 16, "bf16", False)])
def test_gpu_bulk_default_dispatch(T, H, kv_format, bulk, monkeypatch):
    """Without a config, fp8 decode with 1-16 heads from ``MIN_T`` tokens takes the bulk kernel; the rest
    ``kernel_sm90``."""
    from dsa.mla import kernel_sm90

    skip_unless_hopper()
    q, kv, idx, sm, sink, tl_ = make_case(T, H, 256, 2048, kv_format, seed=T + H, with_len=True, with_sink=True)
    sm90 = record_launches(monkeypatch, kernel_sm90)
    calls = _launches(monkeypatch)
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert (len(calls), len(sm90)) == ((1, 0) if bulk else (0, 1))
    assert_matches(got, sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_), max_abs_v(kv, idx, 2048))


@pytest.mark.gpu
@pytest.mark.parametrize("T", [64, 128])
def test_gpu_bulk_cuda_graph(T):
    """Captured in a CUDA graph (with the split merge at 64 tokens: its counters zeroed by the captured call) and
    replayed on new inputs: equal to the eager call, bitwise."""
    skip_unless_hopper()
    q, kv, idx, sm, sink, _ = make_case(T, 16, 2048, 1 << 16, "fp8_ds_mla", seed=T, with_sink=True)
    flat = ref_mod.flat_kv(kv)
    out = torch.empty(T, 16, D_V, dtype=torch.bfloat16, device=q.device)
    sparse_mla(q, flat, idx, sm, attn_sink=sink, out=out)  # (compiled outside the capture)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        _, ml_g, lse_g = sparse_mla(q, flat, idx, sm, attn_sink=sink, out=out)
    for seed in (1, 2):
        q.copy_(torch.randn(q.shape, generator=torch.Generator(device="cpu").manual_seed(seed)).to(q))
        g.replay()
        want = sparse_mla(q, flat, idx, sm, attn_sink=sink)
        assert torch.equal(out, want[0]) and torch.equal(ml_g, want[1]) and torch.equal(lse_g, want[2])
