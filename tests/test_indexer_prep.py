"""dsa.indexer_prep: RoPE / Hadamard / fp8 quantisation of the lightning indexer's q and k.

Exactness claims (reference.py fixes the order of every operation, the kernel follows it):
* Without Hadamard the kernel is bit-exact: RoPE is rounded op by op (no FMA:
  the kernel is launched with enable_fp_fusion=False), the scale uses an IEEE
  division, ue8m0 rounding is done on the bits, casts are RNE / satfinite. So
  q_fp8 bytes, q_scale and weights_out are compared with torch.equal, k too.
* With Hadamard the 128-term fp32 sum of the dot may be ordered differently
  (tensor cores vs BLAS): rows can differ by an fp32 ulp before rounding. Then
  q_fp8 may differ by one fp8 step at rare rounding ties (we check that the
  dequantised values agree within one fp8 ulp, and that such ties are rare),
  q_scale / weights_out within 2^-19 relative (scale = amax/448 follows amax's few-ulp
  change; exact when ue8m0 unless amax/448 sits that close to a power of two, which
  may then double the scale in a tiny fraction of rows: allowed for <= 1e-4 of them),
  k within one bf16 ulp.
"""
from __future__ import annotations

import math

import pytest
import torch

from dsa.constants import FP8_MAX, INDEXER_HEAD_DIM, INDEXER_NUM_HEADS
from dsa.indexer_prep import (
    apply_rope_ref,
    hadamard_128,
    hadamard_matrix,
    prepare_indexer_k,
    prepare_indexer_k_ref,
    prepare_indexer_q,
    prepare_indexer_q_ref,
)
from dsa.indexer_prep.kernel import prepare_indexer_k_triton

from utils import DEVICE, gen, poison_

H, D = INDEXER_NUM_HEADS, INDEXER_HEAD_DIM


def rope_tables(positions: torch.Tensor, dtype=torch.float32, base: float = 10000.0):
    inv_freq = base ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    ang = positions.double()[:, None] * inv_freq[None, :]
    return ang.cos().to(dtype), ang.sin().to(dtype)


def make_q_case(seed: int, T: int, device=DEVICE, w_dtype=torch.float32, cs_dtype=torch.float32):
    g = gen(seed)
    q = (torch.randn(T, H, D, generator=g) * torch.rand(T, H, 1, generator=g).mul(4).exp()).to(torch.bfloat16)
    if T > 2:
        q[1, 3] = 0  # an all-zero head: amax below the 1e-4 floor
        q[2, 5] *= 1e-6
    pos = torch.randint(0, 100000, (T,), generator=g)
    cos, sin = rope_tables(pos, cs_dtype)
    w = torch.randn(T, H, generator=g).to(w_dtype)
    return q.to(device), cos.to(device), sin.to(device), w.to(device)


def fp8_ulp(x: torch.Tensor) -> torch.Tensor:
    """Spacing of e4m3fn numbers at |x| (3 mantissa bits; subnormal spacing 2^-9)."""
    e = torch.floor(torch.log2(x.abs().clamp_min(2.0**-6)))
    return torch.exp2(e - 3)


def assert_q_close(got, ref, exact: bool):
    qg, wg, sg = got
    qr, wr, sr = ref
    assert qg.dtype == torch.float8_e4m3fn and wg.dtype == torch.float32 and sg.dtype == torch.float32
    if exact:
        assert torch.equal(qg.view(torch.uint8), qr.view(torch.uint8))
        assert torch.equal(sg, sr) and torch.equal(wg, wr)
        return
    # a few fp32 ulps (scale follows amax); with ue8m0 a row whose amax/448 sits within those ulps
    # of a power of two may pick the neighbouring power: allowed for a tiny fraction of rows
    far = ((sg - sr).abs() > 2.0**-19 * sr) | ((wg - wr).abs() > 2.0**-19 * wr.abs())
    assert far.float().mean().item() <= 1e-4, far.sum().item()
    # dequantised values agree within one fp8 step (of the larger magnitude) at ties
    dg, dr = qg.float() * sg[..., None], qr.float() * sr[..., None]
    tol = fp8_ulp(torch.maximum(qg.float().abs(), qr.float().abs())) * torch.maximum(sg, sr)[..., None]
    assert ((dg - dr).abs() <= tol * 1.0001).all()  # rows with a doubled scale included
    mism = (qg.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item()
    assert mism < 1e-3, mism


# ----------------------------------------------------------------------------- references


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_matches_complex_formulation(interleaved):
    g = gen(1)
    T = 6
    x = torch.randn(T, 3, D, generator=g, dtype=torch.float64)
    pos = torch.randint(0, 5000, (T,), generator=g)
    cos, sin = rope_tables(pos, torch.float64)
    got = apply_rope_ref(x, cos, sin, 64, interleaved)
    # independent: pairs as complex numbers times e^{i theta}
    r = x[..., :64]
    if interleaved:
        z = torch.complex(r[..., 0::2], r[..., 1::2])
    else:
        z = torch.complex(r[..., :32], r[..., 32:])
    w = z * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[:, None, :]
    if interleaved:
        want = torch.view_as_real(w).flatten(-2)
    else:
        want = torch.cat([w.real, w.imag], -1)
    torch.testing.assert_close(got[..., :64], want, rtol=0, atol=1e-12)
    assert torch.equal(got[..., 64:], x[..., 64:])  # the last 64 dims pass through
    # relative positions: <rope(q, m), rope(k, n)> depends on m - n only
    q, k = x[0, 0], x[0, 1]
    c1, s1 = rope_tables(torch.tensor([17, 5]), torch.float64)
    c2, s2 = rope_tables(torch.tensor([1017, 1005]), torch.float64)
    a = apply_rope_ref(torch.stack([q, k]), c1, s1, 64, interleaved)
    b = apply_rope_ref(torch.stack([q, k]), c2, s2, 64, interleaved)
    assert abs(float(a[0] @ a[1]) - float(b[0] @ b[1])) < 1e-9


def test_rotate_half_and_interleaved_differ():
    """A unit vector on dim 1 rotates into dim 33 (rotate-half) or dim 0 (interleaved): a kernel or
    reference that mixes the pairings up fails here."""
    T = 3
    k = torch.zeros(T, D)
    k[:, 1] = 1.0
    k[:, 100] = 2.0  # outside the rope dims: untouched
    cos, sin = rope_tables(torch.tensor([1, 2, 3]))
    kb = k.to(torch.bfloat16).to(DEVICE)
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    for backend in ("reference", "triton"):
        neox = prepare_indexer_k(kb.clone(), cos, sin, interleaved=False, backend=backend).float().cpu()
        gptj = prepare_indexer_k(kb.clone(), cos, sin, interleaved=True, backend=backend).float().cpu()
        nz_neox = sorted(set(torch.nonzero(neox[0]).flatten().tolist()))
        nz_gptj = sorted(set(torch.nonzero(gptj[0]).flatten().tolist()))
        assert nz_neox == [1, 33, 100], (backend, nz_neox)
        assert nz_gptj == [0, 1, 100], (backend, nz_gptj)
        # dim 1 is the second half of pair 0 (interleaved: b' = b cos + a sin) or the first half
        # of pair 1 (rotate-half: a' = a cos - b sin); the partner gets -sin / +sin
        s1, s0 = float(sin[0, 1]), float(sin[0, 0])
        torch.testing.assert_close(neox[0, 33], torch.tensor(s1), atol=4e-3, rtol=0)
        torch.testing.assert_close(gptj[0, 0], torch.tensor(-s0), atol=4e-3, rtol=0)
    q, cos, sin, w = make_q_case(2, 4)
    a = prepare_indexer_q_ref(q, cos, sin, w, interleaved=False)[0].float()
    b = prepare_indexer_q_ref(q, cos, sin, w, interleaved=True)[0].float()
    assert (a[..., :64] != b[..., :64]).float().mean() > 0.5


def test_hadamard_orthonormal():
    h = hadamard_matrix(128, dtype=torch.float64)
    assert set(h.unique().tolist()) == {-1.0, 1.0}
    assert torch.equal(h, h.T)
    assert torch.equal(h @ h, 128 * torch.eye(128, dtype=torch.float64))
    # Sylvester entries: (-1)^popcount(i & j)
    i = torch.arange(128)
    pc = torch.tensor([bin(v).count("1") for v in range(128)])
    assert torch.equal(h, 1.0 - 2.0 * (pc[(i[:, None] & i[None, :])] % 2).double())
    # the normalised transform is an involution and an isometry
    x = torch.randn(5, 7, 128, generator=gen(3), dtype=torch.float64)
    y = hadamard_128(x)
    torch.testing.assert_close(hadamard_128(y), x, rtol=0, atol=1e-12)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-12, atol=0)
    # vs an explicit python loop on one row
    row = x[0, 0].tolist()
    want = [sum(row[j] * (-1) ** bin(k & j).count("1") for j in range(128)) / math.sqrt(128) for k in range(128)]
    torch.testing.assert_close(y[0, 0], torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-12)
    assert hadamard_128(x.float()).dtype == torch.float32


def test_hadamard_on_q_and_k_keeps_scores():
    """Rotating both q and k by the Hadamard transform leaves every q.k score unchanged (exactly in
    fp64; through the bf16/fp8 kernels, to their rounding)."""
    g = gen(4)
    qd = torch.randn(4, 3, D, generator=g, dtype=torch.float64)
    kd = torch.randn(9, D, generator=g, dtype=torch.float64)
    s = torch.einsum("thd,nd->thn", qd, kd)
    sh = torch.einsum("thd,nd->thn", hadamard_128(qd), hadamard_128(kd))
    torch.testing.assert_close(sh, s, rtol=0, atol=1e-10)
    # through the ops: q dequantised from fp8, k in bf16
    T = 8
    q, cos, sin, w = make_q_case(5, T)
    k = torch.randn(T, D, generator=g).to(torch.bfloat16).to(DEVICE)
    scores = {}
    for had in (False, True):
        qf, _, sc = prepare_indexer_q(q, cos, sin, w, hadamard=had, return_scale=True, backend="triton")
        kk = prepare_indexer_k(k.clone(), cos, sin, hadamard=had, backend="triton")
        scores[had] = torch.einsum("thd,nd->thn", qf.float() * sc[..., None], kk.float())
    ref = scores[False]
    err = (scores[True] - ref).norm() / ref.norm()
    assert err < 0.06, err  # two independent fp8 roundings (rel. step 2^-3 at most, ~3% rms)


# ----------------------------------------------------------------------------- kernel vs reference


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_q_kernel_vs_reference(interleaved, hadamard, scale_fmt):
    T = 5
    seed = 10 + 4 * interleaved + 2 * hadamard + (scale_fmt is None)
    q, cos, sin, w = make_q_case(seed, T, w_dtype=torch.bfloat16 if hadamard else torch.float32,
                                 cs_dtype=torch.bfloat16 if interleaved else torch.float32)
    qo = poison_(torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=DEVICE))
    wo = poison_(torch.empty(T, H, dtype=torch.float32, device=DEVICE))
    got = prepare_indexer_q(q, cos, sin, w, interleaved=interleaved, hadamard=hadamard, scale_fmt=scale_fmt,
                            return_scale=True, out=(qo, wo), backend="triton")
    assert got[0] is qo and got[1] is wo
    ref = prepare_indexer_q_ref(q, cos, sin, w, interleaved=interleaved, hadamard=hadamard, scale_fmt=scale_fmt)
    assert not torch.isnan(qo.float()).any() and not torch.isnan(wo).any()
    assert_q_close(got, ref, exact=not hadamard)
    # the reference's own contract
    qr, wr, sr = ref
    if scale_fmt == "ue8m0":
        assert torch.equal(sr, torch.exp2(torch.log2(sr).round()))  # powers of two
    assert (qr.float().abs() <= FP8_MAX).all()
    torch.testing.assert_close(wr, w.float() * sr / math.sqrt(128 * 64), rtol=3e-7, atol=0)


def test_q_strided_inputs_and_default_args():
    """q a view with padded heads, cos/sin halves of one [T, 64] table, weights transposed."""
    T = 3
    q, cos, sin, w = make_q_case(21, T)
    q_big = torch.randn(T, H, 2 * D, device=DEVICE).to(torch.bfloat16)
    q_big[..., :D] = q
    cs = torch.cat([cos, sin], dim=1)  # [T, 64]
    w_t = w.t().contiguous().t()  # strides (1, T)
    got = prepare_indexer_q(q_big[..., :D], cs[:, :32], cs[:, 32:], w_t, backend="triton")
    ref = prepare_indexer_q_ref(q, cos, sin, w)
    assert torch.equal(got[0].view(torch.uint8), ref[0].view(torch.uint8)) and torch.equal(got[1], ref[1])
    assert len(got) == 2


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("hadamard", [False, True])
def test_k_kernel_vs_reference(interleaved, hadamard):
    T = 77  # not a multiple of the token tile
    g = gen(30 + 2 * interleaved + hadamard)
    k = (torch.randn(T, D, generator=g) * 3).to(torch.bfloat16).to(DEVICE)
    cos, sin = rope_tables(torch.randint(0, 50000, (T,), generator=g))
    cos, sin = cos.to(DEVICE), sin.to(DEVICE)
    ref = prepare_indexer_k_ref(k, cos, sin, interleaved=interleaved, hadamard=hadamard)
    # into a poisoned out: k untouched
    out = poison_(torch.empty(T, D, dtype=torch.bfloat16, device=DEVICE))
    k0 = k.clone()
    assert prepare_indexer_k(k, cos, sin, interleaved=interleaved, hadamard=hadamard, out=out, backend="triton") is out
    assert torch.equal(k, k0)
    # in place, with a small token tile (several persistent iterations and a ragged last tile)
    kk = k.clone()
    prepare_indexer_k_triton(kk, cos, sin, kk, interleaved=interleaved, hadamard=hadamard, block_t=16)
    for got in (out, kk):
        assert not torch.isnan(got).any()
        if hadamard:
            ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) - 7)
            assert ((got.float() - ref.float()).abs() <= ulp).all()
            assert (got != ref).float().mean() < 1e-3
        else:
            assert torch.equal(got, ref)
    # in place through the public wrapper
    assert prepare_indexer_k(k, cos, sin, interleaved=interleaved, hadamard=hadamard, backend="triton") is k
    assert torch.equal(k, kk)


def test_q_quantisation_properties():
    """Independent checks of the quantiser (reference and kernel): every row's scale covers its
    amax, the largest code hits 448 exactly without ue8m0, and dequantisation is within fp8 precision."""
    T = 4
    q, cos, sin, w = make_q_case(40, T)
    y = apply_rope_ref(q.float(), cos, sin, 64, False)
    for fmt in ("ue8m0", None):
        for backend in ("reference", "triton"):
            qf, wf, sc = prepare_indexer_q(q, cos, sin, w, scale_fmt=fmt, return_scale=True, backend=backend)
            amax = y.abs().amax(-1)
            assert (sc >= amax.clamp_min(1e-4) / FP8_MAX * (1 - 1e-7)).all()
            codes = qf.float().abs().amax(-1)
            big = amax > 1e-4
            if fmt is None:
                assert (codes[big] == FP8_MAX).all()
            else:
                assert (codes[big] >= FP8_MAX / 2).all()  # the scale is within a factor 2 of amax/448
            deq = qf.float() * sc[..., None]
            assert ((deq - y).abs() <= fp8_ulp(y / sc[..., None]) * sc[..., None] / 2 * 1.0001).all()
            floor = torch.tensor(1e-4, dtype=torch.float32) / FP8_MAX  # the all-zero head: amax floored at 1e-4
            assert float(sc[1, 3]) == (float(floor) if fmt is None else 2.0**-22)
            assert (qf[1, 3].float() == 0).all()


def test_empty_and_single_token():
    q, cos, sin, w = make_q_case(50, 1)
    got = prepare_indexer_q(q, cos, sin, w, hadamard=True, return_scale=True, backend="triton")
    assert_q_close(got, prepare_indexer_q_ref(q, cos, sin, w, hadamard=True), exact=False)
    qe, we = prepare_indexer_q(q[:0], cos[:0], sin[:0], w[:0], backend="triton")
    assert qe.shape == (0, H, D) and we.shape == (0, H)
    assert prepare_indexer_k(torch.zeros(0, D, dtype=torch.bfloat16, device=DEVICE), cos[:0], sin[:0],
                             backend="triton").shape == (0, D)


# ----------------------------------------------------------------------------- validation


def _q_args():
    q, cos, sin, w = make_q_case(0, 2, device="cpu")
    return dict(q=q, cos=cos, sin=sin, weights=w)


@pytest.mark.parametrize(
    "mutate,exc,name",
    [
        (lambda a: a.update(q=a["q"].float()), TypeError, "q"),
        (lambda a: a.update(q=a["q"][:, :32]), ValueError, "q"),
        (lambda a: a.update(q=a["q"][..., :64]), ValueError, "q"),
        (lambda a: a.update(q=a["q"].transpose(1, 2)), ValueError, "q"),
        (lambda a: a.update(q=a["q"].reshape(2, -1)), ValueError, "q"),
        (lambda a: a.update(cos=a["cos"].double()), TypeError, "cos"),
        (lambda a: a.update(cos=a["cos"][:1]), ValueError, "cos"),
        (lambda a: a.update(sin=torch.zeros(2, 64)), ValueError, "sin"),
        (lambda a: a.update(weights=a["weights"].half()), TypeError, "weights"),
        (lambda a: a.update(weights=a["weights"][:, :8]), ValueError, "weights"),
        (lambda a: a.update(scale_fmt="e8m0"), ValueError, "scale_fmt"),
        (lambda a: a.update(interleaved=None), TypeError, "interleaved"),
        (lambda a: a.update(hadamard=1), TypeError, "hadamard"),
        (lambda a: a.update(out=torch.zeros(1)), TypeError, "out"),
        (lambda a: a.update(out=(torch.zeros(2, H, D), torch.zeros(2, H))), TypeError, r"out\[0\]"),
        (lambda a: a.update(out=(torch.zeros(2, H, D, dtype=torch.float8_e4m3fn), torch.zeros(2, H + 1))),
         ValueError, r"out\[1\]"),
        (lambda a: a.update(backend="fast"), ValueError, "backend"),
    ],
)
def test_q_validation(mutate, exc, name):
    args = _q_args()
    mutate(args)
    with pytest.raises(exc, match=name):
        prepare_indexer_q(**args)


@pytest.mark.parametrize(
    "mutate,exc,name",
    [
        (lambda a: a.update(k=a["k"].half()), TypeError, "k"),
        (lambda a: a.update(k=a["k"][:, :64]), ValueError, "k"),
        (lambda a: a.update(k=a["k"][None]), ValueError, "k"),
        (lambda a: a.update(cos=a["cos"][:, :16]), ValueError, "cos"),
        (lambda a: a.update(sin=a["sin"].long()), TypeError, "sin"),
        (lambda a: a.update(out=torch.zeros(3, 128)), TypeError, "out"),
        (lambda a: a.update(out=torch.zeros(2, 128, dtype=torch.bfloat16)), ValueError, "out"),
        (lambda a: a.update(hadamard="yes"), TypeError, "hadamard"),
    ],
)
def test_k_validation(mutate, exc, name):
    q, cos, sin, _ = make_q_case(0, 3, device="cpu")
    args = dict(k=q[:, 0].contiguous(), cos=cos, sin=sin)
    mutate(args)
    with pytest.raises(exc, match=name):
        prepare_indexer_k(**args)


# ----------------------------------------------------------------------------- GPU (larger shapes)


@pytest.mark.gpu
@pytest.mark.parametrize("hadamard", [False, True])
@pytest.mark.parametrize("interleaved", [False, True])
def test_gpu_large(hadamard, interleaved):
    T = 4099
    q, cos, sin, w = make_q_case(60, T)
    for fmt in ("ue8m0", None):
        got = prepare_indexer_q(q, cos, sin, w, interleaved=interleaved, hadamard=hadamard, scale_fmt=fmt,
                                return_scale=True)
        ref = prepare_indexer_q_ref(q, cos, sin, w, interleaved=interleaved, hadamard=hadamard, scale_fmt=fmt)
        assert_q_close(got, ref, exact=not hadamard)
    k = torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
    ref = prepare_indexer_k_ref(k, cos, sin, interleaved=interleaved, hadamard=hadamard)
    got = prepare_indexer_k(k, cos, sin, interleaved=interleaved, hadamard=hadamard)
    if hadamard:
        ulp = torch.exp2(torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) - 7)
        assert ((got.float() - ref.float()).abs() <= ulp).all() and (got != ref).float().mean() < 1e-3
    else:
        assert torch.equal(got, ref)


def _capture(fn):
    """Capture ``fn`` into a CUDA graph; returns its replay."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


@pytest.mark.gpu
def test_gpu_cuda_graph():
    """Both ops capture into a CUDA graph (no sync, no allocation outside the graph pool) and replay
    correctly on new inputs copied into the static buffers."""
    T = 300
    q, cos, sin, w = make_q_case(70, T)
    k = torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
    k_in = k.clone()
    qo = torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=DEVICE)
    wo = torch.empty(T, H, dtype=torch.float32, device=DEVICE)

    held = {}

    def step():
        held["q"] = prepare_indexer_q(q, cos, sin, w, hadamard=True, out=(qo, wo), return_scale=True)
        prepare_indexer_k(k, cos, sin, hadamard=True)

    step()  # compile outside the capture
    k.copy_(k_in)
    torch.cuda.synchronize()
    replay = _capture(step)
    q2, cos2, sin2, w2 = make_q_case(71, T)
    k2 = torch.randn(T, D, device=DEVICE).to(torch.bfloat16)
    q.copy_(q2), cos.copy_(cos2), sin.copy_(sin2), w.copy_(w2), k.copy_(k2)
    replay()
    torch.cuda.synchronize()
    qr, wr, sr = prepare_indexer_q_ref(q2, cos2, sin2, w2, hadamard=True)
    assert held["q"][0] is qo and held["q"][1] is wo
    assert_q_close(held["q"], (qr, wr, sr), exact=False)
    kr = prepare_indexer_k_ref(k2, cos2, sin2, hadamard=True)
    ulp = torch.exp2(torch.floor(torch.log2(kr.float().abs().clamp_min(1e-30))) - 7)
    assert ((k.float() - kr.float()).abs() <= ulp).all()
