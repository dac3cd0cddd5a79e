"""MLA cache writer / reader (dsa.mla_cache): Triton vs reference byte for byte, and the reference
against an independent float64 formulation (fp8 e4m3fn decoded from its bit fields, round to
nearest even by table search). Everything here is exact: quantisation and dequantisation are
deterministic roundings, so every comparison is bitwise.

The independent formulation lives in tests/quant_utils.py (shared with tests/test_indexer_cache.py).
"""
from __future__ import annotations


import pytest
import torch

from dsa.constants import (
    D_QK,
    FP8_DS_MLA_GROUP,
    FP8_DS_MLA_NUM_GROUPS,
    FP8_DS_MLA_ROW_BYTES,
    FP8_MAX,
    KV_LORA_RANK,
    ROPE_DIM,
)
from dsa.layouts import fp8_ds_mla_views
from dsa.mla_cache import (
    concat_and_cache_mla,
    concat_and_cache_mla_ref,
    dequantize_fp8_ds_mla,
    quantize_fp8_ds_mla,
)
from dsa.mla_cache import kernel as mla_kernel
from dsa.mla_cache import reference as ref
from quant_utils import (
    _bits,
    across_magnitudes,
    independent_dequant,
    independent_quant,
    launch_config,
    paged_slot_mapping,
    pow2_ceil_f64,
    random_bytes,
)
from utils import DEVICE, gen, poison_, ragged_lengths

BACKENDS = ["triton", "reference"]


# ----------------------------------------------------------------------------------------------
# quantiser / dequantiser
# ----------------------------------------------------------------------------------------------
def test_pow2_ceil_exact():
    s = torch.tensor([1.0, 0.75, 2.0**-22, 2.0**-22 * (1 + 2.0**-23), 3.0, 2.0**100, 1e-4 / 448], dtype=torch.float32)
    want = pow2_ceil_f64(s).to(torch.float32)
    assert torch.equal(ref.pow2_ceil(s), want)
    # float log2 would round 2**-22 * (1 + 2**-23) down to 2**-22; the bit trick does not
    assert ref.pow2_ceil(s)[3] == 2.0**-21


@pytest.mark.parametrize("backend", BACKENDS)
def test_quantize_matches_independent(backend):
    g = gen(1)
    t = 40
    c_kv = across_magnitudes(t, KV_LORA_RANK, FP8_DS_MLA_GROUP, g)
    k_pe = torch.randn(t, ROPE_DIM, generator=g).to(torch.bfloat16)
    rows = quantize_fp8_ds_mla(c_kv.to(DEVICE), k_pe.to(DEVICE), backend=backend).cpu()
    codes, scales = independent_quant(c_kv, FP8_DS_MLA_GROUP, ue8m0=True)
    values, sc, rope = fp8_ds_mla_views(rows)
    assert torch.equal(values.view(torch.uint8), codes)
    assert torch.equal(sc, scales)
    assert torch.equal(_bits(rope), _bits(k_pe))
    # scales are powers of two and cover amax: |x| / scale <= 448
    m, _ = torch.frexp(sc)
    assert bool((m == 0.5).all())
    amax = c_kv.float().view(t, FP8_DS_MLA_NUM_GROUPS, -1).abs().amax(-1)
    assert bool((amax / sc <= FP8_MAX).all())


def test_quantize_out_and_poison():
    g = gen(2)
    t = 13
    c_kv = across_magnitudes(t, KV_LORA_RANK, FP8_DS_MLA_GROUP, g).to(DEVICE)
    k_pe = torch.randn(t, ROPE_DIM, generator=g).to(torch.bfloat16).to(DEVICE)
    want = quantize_fp8_ds_mla(c_kv, k_pe, backend="reference")
    out = poison_(torch.empty(t, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8, device=DEVICE))
    got = quantize_fp8_ds_mla(c_kv, k_pe, out=out, backend="triton")
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(out, want)


@pytest.mark.parametrize("backend", BACKENDS)
def test_dequantize_matches_independent(backend):
    """The reader on arbitrary bytes: any finite fp8 code, any positive fp32 scale (not only 2**k)."""
    g = gen(3)
    n = 24
    rows = random_bytes((n, FP8_DS_MLA_ROW_BYTES), g)
    values, scales, rope = fp8_ds_mla_views(rows)
    v = values.view(torch.uint8)
    v[(v & 0x7F) == 0x7F] = 0x3C  # no NaN codes
    scales.copy_(10.0 ** (torch.rand(n, FP8_DS_MLA_NUM_GROUPS, generator=g) * 30 - 15))
    rope.copy_(torch.randn(n, ROPE_DIM, generator=g).to(torch.bfloat16))
    want = torch.cat([independent_dequant(v, scales, FP8_DS_MLA_GROUP), rope], dim=-1)
    got = dequantize_fp8_ds_mla(rows.to(DEVICE), backend=backend).cpu()
    assert got.shape == (n, D_QK) and got.dtype == torch.bfloat16
    assert torch.equal(_bits(got), _bits(want))


@pytest.mark.parametrize("backend", BACKENDS)
def test_round_trip(backend):
    """quantise -> dequantise == nearest e4m3 value times the power-of-two scale, exactly."""
    g = gen(4)
    t = 33
    c_kv = across_magnitudes(t, KV_LORA_RANK, FP8_DS_MLA_GROUP, g)
    k_pe = torch.randn(t, ROPE_DIM, generator=g).to(torch.bfloat16)
    rows = ref.quantize_fp8_ds_mla(c_kv, k_pe)  # bytes packed by the reference packer
    got = dequantize_fp8_ds_mla(rows.to(DEVICE), backend=backend).cpu()
    codes, scales = independent_quant(c_kv, FP8_DS_MLA_GROUP, ue8m0=True)
    want = torch.cat([independent_dequant(codes, scales, FP8_DS_MLA_GROUP), k_pe], dim=-1)
    assert torch.equal(_bits(got), _bits(want))
    # and as close as e4m3 allows: at most half an fp8 ulp, |x| * 2**-4 (normal) or scale * 2**-10 (subnormal)
    x = c_kv.double().view(t, FP8_DS_MLA_NUM_GROUPS, -1)
    err = (got[:, :KV_LORA_RANK].double().view_as(x) - x).abs()
    bound = torch.maximum(x.abs() * 2.0**-4, scales.double().unsqueeze(-1) * 2.0**-10)
    assert bool((err <= bound).all())


def test_dequantize_paged_shape_and_out():
    g = gen(5)
    cache = random_bytes((3, 16, 1, FP8_DS_MLA_ROW_BYTES), g)
    values, scales, _ = fp8_ds_mla_views(cache)
    values.view(torch.uint8)[(values.view(torch.uint8) & 0x7F) == 0x7F] = 0
    scales.copy_(torch.rand(scales.shape, generator=g) + 0.5)
    cache = cache.to(DEVICE)
    want = dequantize_fp8_ds_mla(cache, backend="reference")
    out = poison_(torch.empty(3, 16, 1, D_QK, dtype=torch.bfloat16, device=DEVICE))
    got = dequantize_fp8_ds_mla(cache, out=out, backend="triton")
    assert got.data_ptr() == out.data_ptr()
    assert torch.equal(_bits(got), _bits(want))


# ----------------------------------------------------------------------------------------------
# cache writer
# ----------------------------------------------------------------------------------------------
def _make_cache(kv_format, num_slots, block_size, form, g):
    nb = num_slots // block_size
    if kv_format == "bf16":
        raw = random_bytes((num_slots, D_QK * 2), g).view(torch.bfloat16)
        raw.view(-1)[:: 7] = float("nan")  # NaN poison among random bits
        shape = (nb, block_size, D_QK) if form == "paged" else (num_slots, D_QK)
        return raw.reshape(shape)
    raw = random_bytes((num_slots, FP8_DS_MLA_ROW_BYTES), g)
    shape = {
        "paged": (nb, block_size, FP8_DS_MLA_ROW_BYTES),
        "paged4": (nb, block_size, 1, FP8_DS_MLA_ROW_BYTES),
        "flat": (num_slots, FP8_DS_MLA_ROW_BYTES),
    }[form]
    return raw.reshape(shape)


def _brute_force(c_kv, k_pe, cache, slot_mapping, kv_format):
    """Token-by-token loop, independent of the reference's vectorised indexing."""
    rows = cache.view(-1, cache.shape[-1])
    for t in range(slot_mapping.shape[0]):
        s = int(slot_mapping[t])
        if 0 <= s < rows.shape[0]:
            if kv_format == "bf16":
                rows[s] = torch.cat([c_kv[t], k_pe[t]])
            else:
                codes, scales = independent_quant(c_kv[t : t + 1], FP8_DS_MLA_GROUP, ue8m0=True)
                v, sc, rp = fp8_ds_mla_views(rows[s])
                v.view(torch.uint8).copy_(codes[0])
                sc.copy_(scales[0])
                rp.copy_(k_pe[t])


CASES = [
    # (kv_format, form, block_size, slot dtype)
    ("bf16", "paged", 1, torch.int64),
    ("bf16", "paged", 16, torch.int32),
    ("bf16", "flat", 64, torch.int64),
    ("bf16", "paged", 256, torch.int64),
    ("fp8_ds_mla", "paged", 1, torch.int64),
    ("fp8_ds_mla", "paged4", 16, torch.int64),
    ("fp8_ds_mla", "paged", 64, torch.int32),
    ("fp8_ds_mla", "flat", 16, torch.int64),
    ("fp8_ds_mla", "paged4", 256, torch.int64),
]


@pytest.mark.parametrize("kv_format,form,block_size,slot_dtype", CASES)
def test_concat_and_cache_matches_reference(kv_format, form, block_size, slot_dtype):
    g = gen(10 + block_size)
    q_lens = ragged_lengths(4, (1, 7), (9, 23), 1, g)
    ctx_lens = [int(torch.randint(0, 40, (1,), generator=g)) for _ in q_lens]
    sm, num_slots = paged_slot_mapping(q_lens, ctx_lens, block_size, g, pad=3, oob=2)
    t = sm.numel() + 5  # c_kv has more rows than slot_mapping: the extra rows must be ignored
    wide = across_magnitudes(t, KV_LORA_RANK + FP8_DS_MLA_GROUP, FP8_DS_MLA_GROUP, g)
    c_kv = wide[:, :KV_LORA_RANK]  # row stride 640: not contiguous
    k_pe = torch.randn(t, ROPE_DIM, generator=g).to(torch.bfloat16)
    cache0 = _make_cache(kv_format, num_slots, block_size, form, g)

    want = cache0.clone()
    concat_and_cache_mla_ref(c_kv, k_pe, want, sm.to(slot_dtype), kv_format)
    brute = cache0.clone()
    _brute_force(c_kv, k_pe, brute, sm, kv_format)
    assert torch.equal(_bits(want), _bits(brute))

    got = cache0.clone().to(DEVICE)
    concat_and_cache_mla(c_kv.to(DEVICE), k_pe.to(DEVICE), got, sm.to(slot_dtype).to(DEVICE), kv_format, backend="triton")
    got = got.cpu()
    assert torch.equal(_bits(got), _bits(want))  # the whole cache, byte for byte
    # slots no valid token maps to kept their bytes (NaN / random) exactly
    written = torch.zeros(num_slots, dtype=torch.bool)
    written[sm[(sm >= 0) & (sm < num_slots)]] = True
    rows0, rows = _bits(cache0).view(num_slots, -1), _bits(got).view(num_slots, -1)
    assert torch.equal(rows[~written], rows0[~written])
    assert bool((rows[written] != rows0[written]).any(dim=1).all())


def test_concat_and_cache_empty_and_all_skipped():
    g = gen(7)
    c_kv = torch.randn(4, KV_LORA_RANK, generator=g).to(torch.bfloat16).to(DEVICE)
    k_pe = torch.randn(4, ROPE_DIM, generator=g).to(torch.bfloat16).to(DEVICE)
    cache = random_bytes((2, 16, FP8_DS_MLA_ROW_BYTES), g).to(DEVICE)
    before = cache.clone()
    concat_and_cache_mla(c_kv, k_pe, cache, torch.empty(0, dtype=torch.int64, device=DEVICE), "fp8_ds_mla")
    concat_and_cache_mla(c_kv, k_pe, cache, torch.tensor([-1, -5, 32, 10**12], device=DEVICE), "fp8_ds_mla")
    assert torch.equal(cache, before)


@pytest.mark.parametrize("key", ["write_bf16", "write_fp8", "read"])
def test_launch_configs(key):
    """The smallest and largest tiles of the benchmark's sweep give the same bytes (ragged tails)."""
    g = gen(11)
    t = 37
    c_kv = across_magnitudes(t, KV_LORA_RANK, FP8_DS_MLA_GROUP, g).to(DEVICE)
    k_pe = torch.randn(t, ROPE_DIM, generator=g).to(torch.bfloat16).to(DEVICE)
    sm = torch.randperm(64, generator=g)[:t].to(DEVICE)
    sm[5] = -1
    fmt = "bf16" if key == "write_bf16" else "fp8_ds_mla"
    width = D_QK * 2 if fmt == "bf16" else FP8_DS_MLA_ROW_BYTES
    cache0 = random_bytes((4, 16, width), g).to(DEVICE)
    if fmt == "bf16":
        cache0 = cache0.view(torch.bfloat16)
    want = cache0.clone()
    concat_and_cache_mla_ref(c_kv, k_pe, want, sm, fmt)
    for cfg in (mla_kernel.CONFIG_SWEEP[key][0], mla_kernel.CONFIG_SWEEP[key][-1]):
        with launch_config(mla_kernel.CONFIG, key, cfg):
            if key == "read":
                rows = want.view(-1, FP8_DS_MLA_ROW_BYTES)[sm[sm >= 0]]  # written rows: no NaN codes
                assert torch.equal(_bits(dequantize_fp8_ds_mla(rows, backend="triton")),
                                   _bits(dequantize_fp8_ds_mla(rows, backend="reference")))
            else:
                got = cache0.clone()
                concat_and_cache_mla(c_kv, k_pe, got, sm, fmt, backend="triton")
                assert torch.equal(_bits(got), _bits(want)), cfg


# ----------------------------------------------------------------------------------------------
# validation
# ----------------------------------------------------------------------------------------------
def _args(**over):
    a = dict(
        c_kv=torch.zeros(4, KV_LORA_RANK, dtype=torch.bfloat16),
        k_pe=torch.zeros(4, ROPE_DIM, dtype=torch.bfloat16),
        cache=torch.zeros(2, 16, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8),
        slot_mapping=torch.zeros(4, dtype=torch.int64),
        kv_format="fp8_ds_mla",
    )
    a.update(over)
    return a


BAD = [
    (dict(c_kv=torch.zeros(4, KV_LORA_RANK)), TypeError, "c_kv"),
    (dict(c_kv=torch.zeros(4, 576, dtype=torch.bfloat16)), ValueError, "c_kv"),
    (dict(c_kv=torch.zeros(KV_LORA_RANK, 4, dtype=torch.bfloat16).t()), ValueError, "c_kv"),
    (dict(c_kv=[0.0]), TypeError, "c_kv"),
    (dict(k_pe=torch.zeros(3, ROPE_DIM, dtype=torch.bfloat16)), ValueError, "k_pe"),
    (dict(k_pe=torch.zeros(4, ROPE_DIM, dtype=torch.float16)), TypeError, "k_pe"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.float32)), TypeError, "slot_mapping"),
    (dict(slot_mapping=torch.zeros(4, 1, dtype=torch.int64)), ValueError, "slot_mapping"),
    (dict(slot_mapping=torch.zeros(5, dtype=torch.int64)), ValueError, "slot_mapping"),
    (dict(kv_format="fp8"), ValueError, "kv_format"),
    (dict(cache=torch.zeros(2, 16, 576, dtype=torch.uint8)), ValueError, "cache"),
    (dict(cache=torch.zeros(2, 16, FP8_DS_MLA_ROW_BYTES, dtype=torch.bfloat16)), TypeError, "cache"),
    (dict(cache=torch.zeros(2, 16, 2, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8)), ValueError, "cache"),
    (dict(cache=torch.zeros(2, 12, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8)), ValueError, "block_size"),
    (dict(cache=torch.zeros(2, 512, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8)), ValueError, "block_size"),
    (dict(cache=torch.zeros(16, 2, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8).transpose(0, 1)), ValueError, "cache"),
    (dict(cache=torch.zeros(2, 16, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8), kv_format="bf16"), TypeError, "cache"),
    (dict(cache=torch.zeros(2, 16, FP8_DS_MLA_ROW_BYTES, dtype=torch.bfloat16), kv_format="bf16"), ValueError, "cache"),
    (dict(slot_mapping=torch.zeros(4, dtype=torch.int64, device="meta")), ValueError, "slot_mapping"),
]


@pytest.mark.parametrize("over,exc,name", BAD)
def test_concat_and_cache_validation(over, exc, name):
    with pytest.raises(exc, match=name):
        concat_and_cache_mla(**_args(**over), backend="triton")


def test_other_validation():
    with pytest.raises(ValueError, match="backend"):
        concat_and_cache_mla(**_args(), backend="cuda")
    with pytest.raises(ValueError, match="out"):
        quantize_fp8_ds_mla(_args()["c_kv"], _args()["k_pe"], out=torch.zeros(4, 576, dtype=torch.uint8))
    with pytest.raises(ValueError, match="rows"):
        dequantize_fp8_ds_mla(torch.zeros(4, 576, dtype=torch.uint8))
    with pytest.raises(TypeError, match="rows"):
        dequantize_fp8_ds_mla(torch.zeros(4, FP8_DS_MLA_ROW_BYTES, dtype=torch.int8))
    with pytest.raises(ValueError, match="out"):
        dequantize_fp8_ds_mla(torch.zeros(4, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8),
                              out=torch.zeros(4, D_QK + 1, dtype=torch.bfloat16))


# ----------------------------------------------------------------------------------------------
# GPU: larger shapes
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("block_size", [1, 64])
def test_gpu_large(kv_format, block_size):
    g = gen(99)
    q_lens = ragged_lengths(64, (1, 40), (800, 3000), 4, g)
    ctx_lens = [int(torch.randint(0, 2000, (1,), generator=g)) for _ in q_lens]
    sm, num_slots = paged_slot_mapping(q_lens, ctx_lens, block_size, g, pad=50, oob=7)
    t = sm.numel()
    c_kv = across_magnitudes(t, KV_LORA_RANK, FP8_DS_MLA_GROUP, g)
    k_pe = torch.randn(t, ROPE_DIM, generator=g).to(torch.bfloat16)
    cache0 = _make_cache(kv_format, num_slots, block_size, "paged", g).cuda()
    want = cache0.clone()
    concat_and_cache_mla_ref(c_kv.cuda(), k_pe.cuda(), want, sm.cuda(), kv_format)
    key = "write_fp8" if kv_format == "fp8_ds_mla" else "write_bf16"
    for cfg in mla_kernel.CONFIG_SWEEP[key]:  # every launch configuration the benchmark may pick
        got = cache0.clone()
        with launch_config(mla_kernel.CONFIG, key, cfg):
            concat_and_cache_mla(c_kv.cuda(), k_pe.cuda(), got, sm.cuda(), kv_format, backend="triton")
        assert torch.equal(_bits(got), _bits(want)), cfg
    if kv_format == "fp8_ds_mla":
        rows = got.view(-1, FP8_DS_MLA_ROW_BYTES)[sm[(sm >= 0) & (sm < num_slots)].cuda()]
        want_rows = dequantize_fp8_ds_mla(rows, backend="reference")
        for cfg in mla_kernel.CONFIG_SWEEP["read"]:
            with launch_config(mla_kernel.CONFIG, "read", cfg):
                assert torch.equal(_bits(dequantize_fp8_ds_mla(rows, backend="triton")), _bits(want_rows)), cfg
