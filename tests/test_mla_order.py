"""The slot-range grouping of index lists before many-token sparse MLA (dsa.mla.order): the kernel against its
PyTorch reference (exact), the reference against the definition (an independent check), and sparse MLA with the
grouping forced on against the sparse-MLA reference."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import dsa.mla.reference as ref_mod
from dsa.constants import D_V
from dsa.mla.kernel import order_pays, sparse_mla_triton
from dsa.mla.order import INVALID, MAX_ORDER_TOPK, order_indices, order_indices_ref
from dsa.mla import sparse_mla_ref
from test_mla import assert_matches, make_case, make_indices, max_abs_v
from utils import BENCHMARKS, DEVICE, gen, poison_


def _lists(T, topk, S, seed, with_len):
    g = gen(seed)
    idx = make_indices(T, topk, S, g, frac_invalid=0.2, empty_rows=(1,) if T > 1 else ())
    ln = torch.randint(-1, topk + 3, (T,), generator=g, dtype=torch.int32) if with_len else None
    if ln is not None:
        ln[0] = topk + 5  # past the end: every position counts
    return idx.to(DEVICE), None if ln is None else ln.to(DEVICE)


@pytest.mark.parametrize("T,topk,S", [(5, 300, 1000), (3, 64, 50), (2, 2048, 1 << 17), (4, 1, 10), (3, 77, INVALID),
                                      (2, 5000, 100000)])
@pytest.mark.parametrize("with_len", [False, True])
@pytest.mark.parametrize("buckets", [1, 4, 32])
def test_order_kernel_matches_reference(T, topk, S, with_len, buckets):
    """Bit for bit: -1 / >= S / INT32_MAX entries, duplicates, an empty row, topk_length past the end, below 0
    and 0, row lengths not powers of two; the output poisoned first; the input untouched."""
    idx, ln = _lists(T, topk, S, seed=topk + buckets, with_len=with_len)
    before = idx.clone()
    want = order_indices_ref(idx, S, ln, buckets)
    out = poison_(torch.empty(T, topk, dtype=torch.int32, device=DEVICE))
    assert order_indices(idx, S, ln, buckets, out=out) is out
    assert torch.equal(out, want)
    got = order_indices(idx, S, ln, buckets)
    assert got.dtype == torch.int32 and got.shape == (T, topk) and got.is_contiguous()
    assert torch.equal(got, want)
    assert torch.equal(idx, before)


def test_order_kernel_skip():
    """``skip = (flag, value)``: where the device flag holds ``value`` the kernel writes nothing (the output stays
    poisoned), else the plain grouping bit for bit."""
    T, topk, S = 4, 300, 5000
    idx, ln = _lists(T, topk, S, seed=9, with_len=True)
    want = order_indices_ref(idx, S, ln, 4)
    for flag, value in ((1, 1), (0, 0), (0, 1), (1, 0)):
        out = poison_(torch.empty(T, topk, dtype=torch.int32, device=DEVICE))
        before = out.clone()
        skip = (torch.tensor([flag], dtype=torch.int32, device=DEVICE), value)
        assert order_indices(idx, S, ln, 4, out=out, skip=skip) is out
        assert torch.equal(out, before if flag == value else want), (flag, value)


@pytest.mark.parametrize("wave,groups", [(1, 1), (2, 1), (3, 2), (4, 3)])
def test_order_kernel_serpentine_matches_reference(wave, groups):
    """The serpentine order (``wave``: rows whose first program falls in an odd wave take their ranges from the top
    down) bit for bit against the reference, over the same hard rows; the output poisoned first. Rows of even waves
    are the plain grouping."""
    T, topk, S = 9, 300, 70000
    idx, ln = _lists(T, topk, S, seed=wave * 10 + groups, with_len=True)
    ln[4], ln[6] = 0, -1  # lengths that leave nothing valid, beside the empty row 1 and a length past the end
    want = order_indices_ref(idx, S, ln, 4, wave=wave, groups=groups)
    out = poison_(torch.empty(T, topk, dtype=torch.int32, device=DEVICE))
    assert order_indices(idx, S, ln, 4, out=out, wave=wave, groups=groups) is out
    assert torch.equal(out, want)
    plain = order_indices_ref(idx, S, ln, 4)
    odd = [(t * groups) // wave % 2 == 1 for t in range(T)]
    assert any(odd) and not all(odd)
    assert not all(torch.equal(want[t], plain[t]) for t in range(T) if odd[t])
    for t in range(T):
        if not odd[t]:
            assert torch.equal(want[t], plain[t])


def test_order_kernel_strided_rows():
    idx, ln = _lists(3, 200, 5000, seed=3, with_len=True)
    wide = torch.full((3, 256), -1, dtype=torch.int32, device=DEVICE)
    wide[:, :200] = idx
    assert torch.equal(order_indices(wide[:, :200], 5000, ln), order_indices_ref(idx, 5000, ln))


@pytest.mark.parametrize("buckets,wave", [(1, 0), (2, 0), (4, 0), (8, 0), (4, 2), (8, 1)])
def test_order_reference_is_a_grouping(buckets, wave):
    """What the grouping promises, checked from its definition on the reference: each row's valid entries (as a
    multiset) first, their slot ranges non-decreasing (non-increasing in the rows of odd waves, with ``wave``) and
    each range's entries in their original order, at most ``buckets`` ranges and at least half that (a row spanning
    more than ``buckets`` slots), then INVALID."""
    T, topk, S = 6, 400, 70000
    idx, ln = _lists(T, topk, S, seed=buckets, with_len=True)
    got = order_indices_ref(idx, S, ln, buckets, wave=wave).cpu()
    idx, ln = idx.cpu(), ln.cpu()
    for t in range(T):
        row = idx[t].tolist()
        valid = [x for j, x in enumerate(row) if 0 <= x < S and j < ln[t]]
        out = got[t].tolist()
        assert out[len(valid):] == [INVALID] * (topk - len(valid))
        assert sorted(out[:len(valid)]) == sorted(valid)
        if not valid:
            continue
        lo, hi = min(valid), max(valid)
        width = 1
        while (hi - lo) // width >= buckets:
            width *= 2
        ranges = [(x - lo) // width for x in out[:len(valid)]]
        assert ranges == sorted(ranges, reverse=wave > 0 and (t // wave) % 2 == 1)
        assert max(ranges) < buckets and (hi - lo < buckets or max(ranges) >= buckets // 2)
        for r in set(ranges):
            assert [x for x in out[:len(valid)] if (x - lo) // width == r] == \
                [x for x in valid if (x - lo) // width == r]


_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from dsa.mla.order import _order_rows_kernel as fn

for has_len, block in ((False, 2048), (True, 8192), (True, 1)):
    consts = dict(HAS_LEN=has_len, BLOCK=block, LOG2_NB=2, BITS=block.bit_length())
    sig = {n: "constexpr" if n in consts else "*i32" if n.endswith("_ptr") else "i32" for n in fn.arg_names}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4 if block <= 2048 else 8))
    print(has_len, block, len(k.asm["cubin"]) > 0)
"""


def test_order_kernel_compiles_for_sm90():
    """The kernel compiles for sm_90 on any machine (Triton's own ptxas, in a process without the CPU interpreter):
    the interpreter accepts what the compiler refuses, such as a module-level int read inside the kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["False", "2048", "True", "True", "8192", "True", "True", "1", "True"]


def test_order_rejects():
    idx = torch.zeros(2, 8, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="power of two"):
        order_indices(idx, 10, None, 3)
    with pytest.raises(ValueError, match="topk"):
        order_indices(torch.zeros(1, MAX_ORDER_TOPK + 1, dtype=torch.int32, device=DEVICE), 10)
    with pytest.raises(ValueError, match="out"):
        order_indices(idx, 10, out=torch.empty(2, 9, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="wave"):
        order_indices(idx, 10, wave=-1)
    with pytest.raises(ValueError, match="groups"):
        order_indices(idx, 10, wave=4, groups=0)


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("h_q", [16, 64])
def test_sparse_mla_with_order(kv_format, h_q):
    """Sparse MLA with the grouping forced on: -1 / >= S entries, duplicates, an empty row, topk_length, a sink,
    NaN in unused slots, the output poisoned first; the same as the reference and as the call without it."""
    T = 4
    q, kv, idx, sm, sink, tl_ = make_case(T, h_q, 150, 700, kv_format, seed=h_q, empty_rows=(2,), with_len=True,
                                          with_sink=True)
    flat = ref_mod.flat_kv(kv)
    out = poison_(torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=DEVICE))
    got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, out, order=4)
    assert got[0] is out
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(got, want, max_abs_v(kv, idx, flat.shape[0]), f"order h_q={h_q} {kv_format}")
    plain = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, None, order=False)
    assert_matches(got, plain, max_abs_v(kv, idx, flat.shape[0]), "order on vs off")


@pytest.mark.parametrize("h_q,groups", [(16, 1), (128, 2), (96, 1)])
def test_sparse_mla_serpentine(h_q, groups, monkeypatch):
    """Sparse MLA with the grouping in serpentine order (``ORDER_SERPENTINE``, waves of 2 programs here, so that
    odd waves occur), one or two head groups per token, and the heads sliced (96 = 64 + 32, one grouping for both
    calls): the grouping gets the wave and the head groups per token, and the results match the reference and the
    call without grouping (the attention is a sum over the set of entries: this checks the plumbing, the tests
    above the order)."""
    import dsa.mla.kernel as K

    seen, asked = [], []
    real = K.order_indices
    monkeypatch.setattr(K, "ORDER_SERPENTINE", True)
    monkeypatch.setattr(K, "_num_sms", lambda dev: 2)
    real_wave = K._serpentine_wave
    assert real_wave(DEVICE, False) == 0 and real_wave(DEVICE, True) == 2  # the portable kernel: plain ranges
    # here the portable kernel serves the call; let it take the waves as the Hopper kernels would
    monkeypatch.setattr(K, "_serpentine_wave", lambda dev, one_per_sm: (asked.append(one_per_sm), 2)[1])
    monkeypatch.setattr(K, "order_indices",
                        lambda *a, **k: (seen.append((k.get("wave"), k.get("groups", 1))), real(*a, **k))[1])
    config = None
    if h_q == 96:  # the two slices share one grouping, made before them
        monkeypatch.setattr(K, "order_pays", lambda *a: True)
        config = dict(slice_heads=True)
    T = 5
    q, kv, idx, sm, sink, tl_ = make_case(T, h_q, 150, 700, "bf16", seed=h_q, empty_rows=(2,), with_len=True,
                                          with_sink=True)
    flat = ref_mod.flat_kv(kv)
    out = poison_(torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=DEVICE))
    got = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, out, order=None if h_q == 96 else 4, config=config)
    assert seen == [(2, groups)]
    assert asked and (DEVICE != "cpu" or not any(asked))  # under the interpreter: the portable kernel
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(got, want, max_abs_v(kv, idx, flat.shape[0]), f"serpentine h_q={h_q}")
    plain = sparse_mla_triton(q, flat, idx, sm, D_V, sink, tl_, None, order=False, config=config)
    assert_matches(got, plain, max_abs_v(kv, idx, flat.shape[0]), "serpentine vs off")


def test_l2_model_of_the_grouping():
    """``benchmarks/l2_order_sim.py``, the CPU model behind the grouping's predictions, at a small scale (24 programs,
    4 waves, a 16K-row cache, a 3 MB L2 as one partition): grouped lists hit more than the lists as given, and the
    serpentine order more than the plain grouping (its rows differ from the plain grouping's only in the odd waves).
    Programs that choose their direction at their start (``bNd``) do as well as serpentine while the waves stay
    aligned. The tile times depend on the order only through the miss cost."""
    sys.path.insert(0, BENCHMARKS)
    import l2_order_sim as M

    T, topk, S, sms = 96, 512, 16384, 24
    idx = M.random_lists(T, topk, S)
    assert all(len(set(r)) == topk for r in idx.tolist())
    rows = int(3 * 2**20 / M.ROW_BYTES)
    run = {v: M.simulate(M.variant(idx, S, v, sms), rows, sms, follow=v.endswith("d"), slots=S, partitions=1)
           for v in ("off", "b4", "b4s", "b4d")}
    assert all(r["lookups"] == 1.0 and abs(r["hit"] - r["served"]) < 1e-12 for r in run.values())  # one lookup a row
    h = {v: r["served"] for v, r in run.items()}
    assert 0.1 < h["off"] < h["b4"] < h["b4s"] < 0.6, h
    assert h["b4d"] > h["b4"] + 0.03 and abs(h["b4d"] - h["b4s"]) < 0.02, h
    assert len({r["time"] for r in run.values()}) == 1  # no miss cost: the same tile times whatever the order
    plain, serp = M.variant(idx, S, "b4", sms), M.variant(idx, S, "b4s", sms)
    assert torch.equal(serp[:sms], plain[:sms]) and torch.equal(serp[2 * sms:3 * sms], plain[2 * sms:3 * sms])
    assert not any(torch.equal(serp[t], plain[t]) for t in range(sms, 2 * sms))  # every row spans several ranges
    costly = {v: M.simulate(M.variant(idx, S, v, sms), rows, sms, slots=S, miss_cost=0.7, sm_spread=0.05,
                            partitions=1) for v in ("off", "b4")}
    assert costly["b4"]["time"] < costly["off"]["time"] and costly["b4"]["served"] > costly["off"]["served"], costly


def test_l2_model_partitions():
    """The model's two L2 partitions: with room for every row, each distinct row comes from DRAM exactly once, and
    a row read first by one partition's SMs and then by the other's is a far hit (two lookups, one hit); a row
    homed in the own partition never crosses. At the H200's scale (132 programs, 1024 tokens, 60 MB in two
    partitions, the default jitter) the model gives the sixteenth session's two profiles of h_q 16 prefill
    (BENCHMARKS.md, forty-sixth session) without a fitted parameter: the share of row reads served by L2 (1 - DRAM
    reads / row bytes), L2 lookups per row read (L2 bytes / row bytes) and ncu's hit rate."""
    sys.path.insert(0, BENCHMARKS)
    import l2_order_sim as M

    T, topk, S, sms = 48, 256, 4096, 8
    idx = M.random_lists(T, topk, S, seed=3)
    r = M.simulate(idx, 10 * S, sms, slots=S, partitions=2)
    reads, distinct = T * topk, len(set(idx.flatten().tolist()))
    assert abs(r["served"] - (1 - distinct / reads)) < 1e-12
    assert 1.0 < r["lookups"] < 1.5 and r["hit"] < r["served"], r
    # the same list on SM 0 (partition 0) and SM 1 (partition 1) in step, SM 0 reading each tile first: its rows
    # homed in partition 1 cost it a crossing and are kept there too; SM 1 then finds those in its own partition
    # and the others (homed in partition 0) behind one crossing
    same = idx[:1].repeat(2, 1)
    one = M.simulate(same, 10 * S, 2, jitter=0.0, slots=S, partitions=2)
    home = torch.randint(0, 2, (S,), generator=torch.Generator().manual_seed(2)).tolist()  # seed + 1, as simulate's
    far_first = sum(home[x] == 1 for x in same[0].tolist())
    assert one["served"] == 0.5
    assert one["lookups"] == (2 * topk + far_first + (topk - far_first)) / (2 * topk), (one, far_first)

    big = M.random_lists(1024, 2048, 131072)
    l2 = int(60 * 2**20 / M.ROW_BYTES)
    measured = {"off": (0.262, 1.440, 0.189), "b4": (0.532, 1.334, 0.409)}
    for v, (served, lookups, hit) in measured.items():
        got = M.simulate(M.variant(big, 131072, v, 132), l2, 132, partitions=2)
        assert abs(got["served"] - served) < 0.03 and abs(got["lookups"] - lookups) < 0.02, (v, got)
        assert abs(got["hit"] - hit) < 0.02, (v, got)


def test_order_profiler_reads_ncu_csv(tmp_path, monkeypatch, capsys):
    """``benchmarks/profile_order.py`` (Nsight Compute per grouping, for the next device call) reads ncu's CSV: the
    metrics in whatever units ncu chose, other lines (ncu's own, the program's) skipped, and asks only for the
    optional metrics that ``ncu --query-metrics`` lists. A stand-in ``ncu`` prints what ncu prints and records its
    arguments."""
    sys.path.insert(0, BENCHMARKS)
    import profile_order as P

    # ncu's units, long and short (the H200's ncu gives gpu__time_duration in "ns")
    for value, unit, base in [("1,610,976", "ns", 1.610976e-3), ("1,620.50", "usecond", 1.6205e-3), ("2", "ms", 2e-3),
                              ("4.57", "Gbyte", 4.57e9), ("4.57", "GB", 4.57e9), ("1.78", "cycle/nsecond", 1.78e9),
                              ("1.78", "Ghz", 1.78e9), ("305", "sector", 305.0), ("88.6", "%", 88.6)]:
        assert P.to_base(value, unit) == pytest.approx(base), (value, unit)

    fake = tmp_path / "ncu"
    fake.write_text(f"""#!{sys.executable}
import csv, sys
if sys.argv[1:] == ["--query-metrics"]:
    print("Device NVIDIA H200 (GH100)")
    print("lts__t_sectors_srcunit_tex    Counter    sector    # of LTS sectors from unit TEX")
    print("lts__t_sectors_srcunit_ltcfabric    Counter    sector    # of LTS sectors from unit LTCFABRIC")
    sys.exit(0)
open({str(tmp_path / "args")!r}, "w").write(" ".join(sys.argv[1:]))
print("==PROF== Connected to process 1")
print("some output of the program")
w = csv.writer(sys.stdout, quoting=csv.QUOTE_ALL)
w.writerow(["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value"])
for r in [("gpu__time_duration.sum", "usecond", "1,620.50"),
          ("sm__cycles_elapsed.avg.per_second", "cycle/nsecond", "1.78"),
          ("dram__bytes_read.sum", "Gbyte", "4.57"), ("lts__t_bytes.sum", "Mbyte", "13,030.00"),
          ("lts__t_sector_hit_rate.pct", "%", "40.90"),
          ("lts__throughput.avg.pct_of_peak_sustained_elapsed", "%", "88.6"), ("other.metric", "byte", "7"),
          ("lts__t_sectors_srcunit_tex.sum", "sector", "305,000,000"),
          ("lts__t_sectors_srcunit_ltcfabric.sum", "sector", "99,125,000")]:
    w.writerow(["0", "_sparse_mla_sm90_kernel", "Command line profiler metrics", *r])
""")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    got = P.profile("prefill_bf16_h16", "b4s")
    assert got == pytest.approx({"ms": 1.6205, "SM GHz": 1.78, "DRAM read GB": 4.57, "L2 GB": 13.03, "L2 hit %": 40.9,
                                 "L2 % peak": 88.6}), got
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("--metrics") + 1].split(",") == list(P.METRICS)
    assert args[-3:] == ["prefill_bf16_h16", "bf16", "order=b4s"]
    listed = ["lts__t_sectors_srcunit_tex.sum", "lts__t_sectors_srcunit_ltcfabric.sum"]
    assert P.known(P.FABRIC) == {m: P.FABRIC[m] for m in listed}
    capsys.readouterr()
    P.main(["prefill_bf16_h16", "off"])
    args = (tmp_path / "args").read_text().split()
    assert args[args.index("--metrics") + 1].split(",") == list(P.METRICS) + listed
    row = capsys.readouterr().out.splitlines()[-1].split("|")[1:-1]
    assert [c.strip() for c in row][-4:] == ["0.305", "0.099", "-", "0.325"]  # crossings: fabric / SM sectors


def test_order_pays():
    """Arguments: T, splits, topk, S, row bytes. Prefill-like calls over a cache far past L2 group; decode
    batches, small caches, split calls and single-tile lists do not."""
    assert order_pays(4096, 1, 2048, 131072, 1152)
    assert order_pays(512, 1, 2048, 131072, 1152)
    assert not order_pays(256, 1, 2048, 128 * 32768, 656)  # decode batch 128 x s_q 2
    assert not order_pays(4096, 1, 2048, 65536, 1152)  # 75 MB
    assert not order_pays(4096, 1, 2048, 131072, 656)  # fp8, 86 MB
    assert not order_pays(4096, 2, 2048, 131072, 1152)
    assert not order_pays(4096, 1, 64, 131072, 1152)


@pytest.mark.gpu
@pytest.mark.parametrize("serpentine", [False, True])
@pytest.mark.parametrize("h_q", [16, 128])
def test_gpu_public_call_groups(h_q, serpentine, monkeypatch):
    """A prefill-like public call (512 tokens, 2048 of 128K bf16 rows: 151 MB) takes the grouping by itself (also in
    serpentine order) and matches the reference: -1 / >= S entries, topk_length, a sink, an empty row, NaN in unused
    slots."""
    import dsa.mla.kernel as K
    from dsa.mla import sparse_mla

    calls = []
    real = K.order_indices
    monkeypatch.setattr(K, "ORDER_SERPENTINE", serpentine)
    monkeypatch.setattr(K, "order_indices", lambda *a, **k: (calls.append((a[1], k.get("wave", 0) > 0,
                                                                            k.get("groups", 1))), real(*a, **k))[1])
    T, topk, S = 512, 2048, 1 << 17
    q, kv, idx, sm, sink, tl_ = make_case(T, h_q, topk, S, "bf16", seed=7, block_size=64, with_len=True,
                                          with_sink=True, empty_rows=(1,))
    out = poison_(torch.empty(T, h_q, D_V, dtype=torch.bfloat16, device=DEVICE))
    got = sparse_mla(q, kv, idx, sm, attn_sink=sink, topk_length=tl_, out=out)
    assert calls == [(S, serpentine, h_q // 64 or 1)]
    want = sparse_mla_ref(q, kv, idx, sm, attn_sink=sink, topk_length=tl_)
    assert_matches(got, want, max_abs_v(kv, idx, S), f"grouped h_q={h_q}")
