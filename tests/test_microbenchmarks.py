"""The instruction-level microbenchmarks behind BENCHMARKS.md's thirty-second and thirty-third sessions:
``benchmarks/mma_small_n.py`` (wgmma clocks by N, bf16 and fp8; the fp8 products' exactness; a chain's wait) and
``benchmarks/instr_rate.py`` (SASS instruction rates). They run only on an sm_90 GPU; here, on any machine, what their
recorded numbers rest on: the exact two-term fp8 split of a bf16 operand, and that each variant compiles for sm_90a
to the instructions it claims to time."""
import sys

import torch

from utils import BENCHMARKS, compiled_in_subprocess

_COMPILE = r"""
import mma_small_n as M
import instr_rate as I

for mode, n in ((3, 16), (3, 32), (4, 16)):
    k = G.compile_sm90(M._mma_kernel, dict(N=n, MODE=mode), {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv",
                                                            "clk_ptr": "*i64", "out_ptr": "*fp32"}, 4)
    out[f"mma mode {mode} N {n}"] = G.sass_counts(k, PRE)
for terms in (1, 2, 3):
    k = G.compile_sm90(M._prec_kernel, dict(N=16, K=64, TERMS=terms), {"a_ptr": "*fp8e4nv", "b_ptr": "*fp8e4nv",
                                                                       "out_ptr": "*fp32"}, 4)
    out[f"precision terms {terms}"] = G.sass_counts(k, PRE)
k = G.compile_sm90(M._overlap_kernel, dict(N=16, WG=1, ASM=M.OTHER["cvt"], ROUNDS=8),
                   {"a_ptr": "*bf16", "b_ptr": "*bf16", "clk_ptr": "*i64", "out_ptr": "*fp32"}, 4)
out["overlap"] = G.sass_counts(k, PRE)
for a in (0, 1, 2):
    k = G.compile_sm90(M._lat_kernel, dict(N=16, KS=4, A=a), {"a_ptr": "*fp16", "a8_ptr": "*fp8e4nv", "b_ptr": "*fp16",
                                                              "clk_ptr": "*i64", "out_ptr": "*fp32"}, 4)
    out[f"latency A {a}"] = G.sass_counts(k, PRE)
for name in I.OPS:
    out[f"rate {name}"] = G.sass_counts(I.compile_sm90(name), PRE)
"""
_PRE = ("QGMMA", "HGMMA", "HMMA", "F2FP", "PRMT", "FFMA", "HFMA2", "MOVM", "MUFU", "STL", "LDL")


def _split_fp8():
    sys.path.insert(0, BENCHMARKS)
    from mma_small_n import split_fp8

    return split_fp8


def test_split_fp8_is_exact():
    """``x · scale == hi + lo`` for every bf16 value with ``|x · scale| >= 1/4`` (a row's largest lands in
    [128, 256)); below that ``lo`` rounds to e4m3's subnormal step, so the error is at most half of 2^-9. Rows of
    wide range, zeros and negative values included."""
    split_fp8 = _split_fp8()
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 512, generator=g) * torch.exp2(torch.randint(-12, 12, (64, 512), generator=g).float())
    x[32:] = torch.randn(32, 512, generator=g)  # rows of a normal range: nearly every value exact
    x[0] = 0.0
    x[1, :7] = torch.tensor([1.0, -1.0, 3.0e-5, -2.5, 448.0, 1e-8, 0.0])
    x = x.to(torch.bfloat16)
    hi, lo, scale = split_fp8(x)
    assert hi.dtype == lo.dtype == torch.float8_e4m3fn
    xs = x.double() * scale.double()
    got = hi.double() + lo.double()
    big = xs.abs() >= 0.25
    assert big.sum() > 20000  # (most of the values: the test must reach the exact case)
    assert torch.equal(got[big], xs[big])
    assert (got - xs).abs().max().item() <= 2.0 ** -10
    amax = xs.abs().amax(dim=1)
    assert bool(((amax >= 128) & (amax < 256) | (amax == 0)).all())
    assert torch.equal(hi.double().abs() <= 448, torch.ones_like(big))


def test_microbenchmarks_compile_for_sm90():
    c = compiled_in_subprocess(_COMPILE, _PRE)
    for mode, n in ((3, 16), (3, 32), (4, 16)):
        counts = c[f"mma mode {mode} N {n}"]
        assert counts.get("QGMMA.64", 0) == 32, counts  # 32 fp8 wgmmas (QGMMA; bf16 would be HGMMA) per iteration
        assert "STL" not in counts and "LDL" not in counts, counts
    assert c["precision terms 1"]["QGMMA.64"] == 2  # K 64: two k32 steps, one term
    assert c["precision terms 2"]["QGMMA.64"] == 4
    assert c["precision terms 3"]["QGMMA.64"] == 4
    assert c["overlap"].get("F2FP.F16.E4M3.UNPACK_B", 0) >= 8 * 8, c["overlap"]  # 8 rounds x 8 chains per iteration
    assert c["overlap"].get("HGMMA.64", 0) == 32, c["overlap"]
    for a in (0, 1, 2):  # --latency: chains of 4 wgmmas (the loop unrolled 8 times); only A 1 converts, every time
        counts = c[f"latency A {a}"]
        assert counts.get("HGMMA.64", 0) % 4 == 0 and counts.get("HGMMA.64", 0) >= 4, counts
        assert (counts.get("F2FP.F16.E4M3.UNPACK_B", 0) >= 16 * counts["HGMMA.64"] // 4) == (a == 1), counts
        assert "STL" not in counts, counts
    want = {"cvt_e4m3x2_f16x2": "F2FP.F16.E4M3.UNPACK_B", "prmt": "PRMT", "ffma": "FFMA", "movmatrix": "MOVM.16.MT88",
            "hmma": "HMMA.16816.F32", "hmma_f16acc": "HMMA.16816.F16", "hmma_k8": "HMMA.1688.F32", "ex2": "MUFU.EX2"}
    for name, mnemonic in want.items():
        counts = c[f"rate {name}"]
        assert counts.get(mnemonic, 0) >= 8, (name, counts)  # every chain's instruction is there, not folded
        assert "STL" not in counts, (name, counts)


def test_whatif_variants_still_apply():
    """``benchmarks/whatif_bulk.py`` builds its variants by replacing exact source text of
    ``dsa/mla/kernel_bulk.py``: each replacement must still find its text once (the variant imports)."""
    sys.path.insert(0, BENCHMARKS)
    import whatif_bulk

    for name in ("noconv", "noexp", "both", "noqkload", "qkmin"):
        mod = whatif_bulk.variant(name)
        assert mod.sparse_mla_bulk is not None and mod.__name__ == f"dsa.mla._whatif_{name}"


_HANDOFF = r"""
import racecheck_handoff as R

for plain in (False, True):
    for mode in (0, 1):
        k = G.compile_sm90(R._handoff_kernel, dict(MODE=mode, PLAIN=plain), {"out_ptr": "*fp32"}, 4)
        out[f"handoff {mode}" + " plain" * plain] = G.sass_counts(k, PRE)
    k = G.compile_sm90(R._loop_kernel, dict(PLAIN=plain), {"out_ptr": "*fp32"}, 4)
    out["loop" + " plain" * plain] = G.sass_counts(k, PRE)
for name, kw in (("pp False", {}), ("pp True", dict(SLOW=True)), ("pp1lane", dict(REP=False)),
                 ("ppnoidle", dict(IDLE=False))):
    k = G.compile_sm90(R._pp_kernel, dict(dict(SLOW=False, REP=True, IDLE=True), **kw), {"out_ptr": "*fp32"}, 4)
    out[name] = G.sass_counts(k, PRE)
    out[name + " meta"] = dict(shared=k.metadata.shared, warps=k.metadata.num_warps)
"""


def test_racecheck_handoff_compiles_for_sm90():
    """``benchmarks/racecheck_handoff.py`` (what racecheck makes of the partitions' hand-off; BENCHMARKS.md,
    forty-second session): each form compiles for sm_90a, and the hand-off is there: ``one``, ``loop`` and ``pp``
    arrive on and wait for mbarriers, ``none`` does neither, and only ``ppslow`` sleeps; ``pp1lane`` and
    ``ppnoidle`` have ``pp``'s hand-offs with one change each (one lane per value; no third partition); the plain
    controls (``oneplain``, ``noneplain``, ``loopplain``) move by plain shared loads and stores what ``one``,
    ``none`` and ``loop`` move by ``stmatrix`` / ``ldmatrix``, with the same synchronisation."""
    c = compiled_in_subprocess(_HANDOFF, ("SYNCS", "BAR", "LDS", "STS", "NANOSLEEP"))
    one, none, loop = c["handoff 0"], c["handoff 1"], c["loop"]
    arrive = [k for k in one if k.startswith("SYNCS.ARRIVE")]
    wait = [k for k in one if k.startswith("SYNCS.PHASECHK")]
    assert arrive and wait, one
    assert not any(k.startswith(("SYNCS.ARRIVE", "SYNCS.PHASECHK")) for k in none), none
    assert any(k.startswith("SYNCS.ARRIVE") for k in loop) and any(k.startswith("SYNCS.PHASECHK") for k in loop), loop
    for slow in (False, True):
        pp = c[f"pp {slow}"]
        # (4 arrivals: the max both ways, the row sums both ways)
        assert sum(v for k, v in pp.items() if k.startswith("SYNCS.ARRIVE")) >= 4, pp
        assert any(k.startswith("SYNCS.PHASECHK") for k in pp), pp
        assert any(k.startswith("NANOSLEEP") for k in pp) == slow, pp
    # the bisecting forms: pp's hand-offs (the same arrivals and waits) with one change each
    count = lambda f, kind: sum(v for k, v in f.items() if k.startswith(kind))  # noqa: E731
    for name in ("pp1lane", "ppnoidle"):
        for kind in ("SYNCS.ARRIVE", "SYNCS.PHASECHK"):
            assert count(c[name], kind) == count(c["pp False"], kind), (name, kind, c[name])
    assert c["pp False"].get("STS", 0) > 0 and c["pp False"].get("LDS", 0) > 0  # 4-byte moves, 4 lanes per value
    assert c["pp1lane"].get("STS.64", 0) > 2 and c["pp1lane"].get("LDS.64", 0) > 0  # one lane, plain 8-byte moves
    assert "STS" not in c["pp1lane"] and not any(k.startswith(("STSM", "LDSM")) for k in c["pp1lane"])
    # the controls: one / loop hand their values over by stmatrix / ldmatrix (racecheck drew no report on them), the
    # plain forms by 8-byte st.shared / ld.shared, with the same arrivals, waits and barriers
    for name in ("handoff 0", "handoff 1", "loop"):
        base, plain = c[name], c[name + " plain"]
        moved = lambda f: {k: v for k, v in f.items() if k.startswith(("LDSM", "STSM", "LDS.64", "STS.64"))}  # noqa: E731
        assert set(moved(base)) == {"LDSM.16.M88", "STSM.16.M88"}, (name, base)
        assert set(moved(plain)) == {"LDS.64", "STS.64"} and sorted(moved(plain).values()) == sorted(
            moved(base).values()), (name, plain)
        for kind in ("SYNCS", "BAR"):
            assert count(plain, kind) == count(base, kind), (name, kind, plain)
    assert c["ppnoidle meta"]["warps"] == 8 and c["pp False meta"]["warps"] == c["pp1lane meta"]["warps"] == 12


_WHATIF_SM90 = r"""
import re

import whatif_sm90 as W

for v in ("real", "nomath", "nocopy", "nowait", "nosoftmax", "nolazy+nosoftmax", "none", "nomath+loadonly",
          "nomath+fewstores", "cg", "tpr8", "trace"):
    mod = W.kernel_sm90 if v == "real" else W.variant(v)
    for fp8, bh in ((False, 16), (True, 32)):
        if ("stores" in v or "loadonly" in v or v in ("cg", "tpr8")) and not fp8:  # (fp8_ds_mla, 32 heads)
            continue
        k = W.compile_sm90(mod, fp8, bh)
        ptx = k.asm["ptx"]
        out[f"{v} {bh}"] = dict(wgmma=ptx.count("wgmma.mma_async"), cp=ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                                ex2=ptx.count("ex2.approx"), ld=ptx.count("ld.global"), smem=k.metadata.shared,
                                waits=ptx.count("mbarrier.try_wait"), sts=ptx.count("st.shared"), cvt=ptx.count("cvt."),
                                ldcg=ptx.count("ld.global.cg"), ld128=len(re.findall(r"ld\.global[.\w]*\.v4", ptx)),
                                clock=ptx.count("%clock"))
k = W.compile_sm90(W.variant("real+nocopy", W.kernel_sm90.__file__), False, 16)  # (--base: from a given source)
out["base:nocopy 16"] = dict(wgmma=k.asm["ptx"].count("wgmma.mma_async"), cp=k.asm["ptx"].count("cp.async.cg"))
"""


def test_whatif_sm90_variants_remove_what_they_claim():
    """``benchmarks/whatif_sm90.py``'s variants of ``dsa/mla/kernel_sm90.py`` (16/32-head path), compiled for sm_90a:
    each removes exactly the work it names and no other, so its timing bounds what it claims."""
    c = compiled_in_subprocess(_WHATIF_SM90, ())
    for bh in (16, 32):
        real = c[f"real {bh}"]
        assert real["wgmma"] == 4 + 32 + 32 and real["cp"] > 0 and real["ex2"] > 0, real  # rope + values QK, P.V
        assert c[f"nomath {bh}"]["wgmma"] == 0 and c[f"nomath {bh}"]["ex2"] == 0
        assert c[f"nomath {bh}"]["cp"] == real["cp"]  # (the math's own index-list loads go, being unused)
        nocopy = c[f"nocopy {bh}"]
        assert nocopy["cp"] == 0 and nocopy["wgmma"] == real["wgmma"] and nocopy["ex2"] == real["ex2"]
        assert nocopy["ld"] < real["ld"]  # (fp8: the raw rows' loads; the index lists' loads stay)
        nowait = c[f"nowait {bh}"]  # the same work, two fewer waits in each loop (math; each producer)
        assert {k: v for k, v in nowait.items() if k != "waits"} == {k: v for k, v in real.items() if k != "waits"}
        assert nowait["waits"] < real["waits"], (nowait, real)
        assert c[f"nolazy+nosoftmax {bh}"]["ex2"] == 0 and c[f"nolazy+nosoftmax {bh}"]["wgmma"] == real["wgmma"]
    assert c["nosoftmax 16"]["ex2"] == 0 and c["nosoftmax 16"]["wgmma"] == c["real 16"]["wgmma"]
    assert c["nosoftmax 32"] == c["real 32"]  # (32-head groups take the lazy softmax, untouched by it)
    for bh in (16, 32):  # none: neither, so only q's shared memory is left
        assert c[f"none {bh}"]["wgmma"] == c[f"none {bh}"]["cp"] == 0 and c[f"none {bh}"]["smem"] < 40 * 1024
    # the fp8 producers' loads alone / without three quarters of their stores: the same loads, half the shared stores
    # (the rest are the rope part's and the barriers'), fewer conversions where only the loads are left
    nomath, loads, few = c["nomath 32"], c["nomath+loadonly 32"], c["nomath+fewstores 32"]
    assert loads["ld"] == few["ld"] == nomath["ld"] and loads["wgmma"] == few["wgmma"] == 0
    assert loads["sts"] == few["sts"] < nomath["sts"] and loads["cvt"] < few["cvt"] < nomath["cvt"], (loads, few, nomath)
    # cg: the same kernel with its 16-byte row loads cached in L2 only; tpr8: the same work in another layout (its
    # layout conversions take other scratch, so the shared memory differs)
    real, cg, tpr8 = c["real 32"], c["cg 32"], c["tpr8 32"]
    assert real["ldcg"] == 0 and cg["ldcg"] > 0 and cg["ldcg"] == real["ld128"], (cg, real)
    assert {k: v for k, v in cg.items() if k != "ldcg"} == {k: v for k, v in real.items() if k != "ldcg"}
    assert {k: tpr8[k] for k in ("wgmma", "cp", "ex2", "waits")} == {k: real[k] for k in ("wgmma", "cp", "ex2", "waits")}
    assert tpr8 != real
    assert c["base:nocopy 16"] == {"wgmma": c["nocopy 16"]["wgmma"], "cp": 0}  # (a variant of a source given by path)
    # trace: the same work, with the clock read at the loop top and at the eight points of TRACE_POINTS (32 heads:
    # the lazy softmax's; 16 heads: the plain softmax's)
    same = ("wgmma", "cp", "ex2", "waits", "ld128")
    for bh in (16, 32):
        trace, real = c[f"trace {bh}"], c[f"real {bh}"]
        assert trace["clock"] == 1 + 8 and real["clock"] == 0, (bh, trace)
        assert {k: trace[k] for k in same} == {k: real[k] for k in same}, (bh, trace, real)


def test_sampler_instruction_count_compiles_for_sm90():
    """``benchmarks/bench_sampling.py --count`` (BENCHMARKS.md, sixty-seventh and sixty-eighth sessions): the chunked
    sampler kernels compile for sm_90 on any machine, with the exact noise of every token and with the screen, and
    their SASS per logit is counted. Pass 1 with top-p adds the softmax sum to pass 1 without it; the first
    candidate's pass reads the row again (the mass ahead at least); the screen issues fewer instructions than the
    exact noise in every kernel (it leaves out the two logarithms of all but a token or two per block)."""
    c = compiled_in_subprocess("import bench_sampling as S\nout.update(S.sass_per_logit())", ())
    kernels = ("pass 1, top-p 1", "pass 1, top-p", "first candidate's pass")
    assert set(c) == {f"{k}, {n}" for k in kernels for n in ("exact noise", "screen")}
    for n in ("exact noise", "screen"):
        assert 30 < c[f"pass 1, top-p 1, {n}"] < c[f"pass 1, top-p, {n}"] < 400
        assert 10 < c[f"first candidate's pass, {n}"] < 400
    assert all(c[f"{k}, screen"] < 0.9 * c[f"{k}, exact noise"] for k in kernels), c
