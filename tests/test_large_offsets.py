"""Caches past 2**33 bytes (GPU only): every writer and reader of the MLA cache and of the indexer cache must
compute its offsets in int64. Past 2**33 bytes the offsets overflow int32 in every element size the kernels address
the caches in (fp8 / uint8 bytes, bf16, fp32 scales). Rows are written by the library's writers at slots wholly past
that (and a few low ones), checked byte for byte against the reference quantisers, then read back by the kernels and
compared with the references. Unused bytes hold 0xFF (NaN in e4m3fn, bf16 and fp32), outputs are poisoned.
About 8.7 GB of GPU memory per test."""
from __future__ import annotations

import pytest
import torch

from dsa import (concat_and_cache_mla, fp8_paged_mqa_logits, gather_indexer_k, indexer_k_quant,
                 indexer_k_quant_and_cache)
from dsa.backend import on_hopper
from dsa.constants import D_QK, D_V, FP8_DS_MLA_ROW_BYTES, KV_LORA_RANK
from dsa.layouts import indexer_cache_views
from dsa.mla import kernel_sm90, sparse_mla_ref
from dsa.mla.kernel import sparse_mla_triton
from dsa.mla_cache.reference import quantize_fp8_ds_mla
from dsa.mqa_logits.reference import fp8_paged_mqa_logits_ref
from test_mla import assert_matches, max_abs_v
from test_mqa_logits import assert_logits_match
from utils import ON_GPU, gen, poison_, record_launches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason="needs a GPU with 9 GB free")]

LIMIT = 2**33  # bytes: 2**31 fp32 elements


def _high_and_low_slots(n_high, n_low, first_high, stop, g):
    """``n_high`` distinct slots in ``[first_high, stop)`` and ``n_low`` distinct ones below 1000, shuffled."""
    high = first_high + torch.randperm(stop - first_high, generator=g)[:n_high]
    low = torch.randperm(1000, generator=g)[:n_low]
    slots = torch.cat([high, low])
    return slots[torch.randperm(len(slots), generator=g)]


@pytest.mark.parametrize("kv_format", ["bf16", "fp8_ds_mla"])
@pytest.mark.parametrize("H", [16, 64])
@pytest.mark.parametrize("gluon", [True, False])
def test_gpu_mla_cache_past_8gib(kv_format, H, gluon, monkeypatch):
    """concat_and_cache_mla writes rows past byte 2**33 exactly as the reference packs them, and sparse MLA
    (the Hopper kernels where present, and the portable Triton kernel) reads them back."""
    g = gen(7 + H)
    row_bytes = 2 * D_QK if kv_format == "bf16" else FP8_DS_MLA_ROW_BYTES
    S = LIMIT // row_bytes + 60_000
    block_size = 64
    S -= S % block_size
    first_high = LIMIT // row_bytes + 1  # every byte of these rows lies past 2**33
    cache_u8 = torch.full((S // block_size, block_size, row_bytes), 0xFF, dtype=torch.uint8, device="cuda")
    cache = cache_u8.view(torch.bfloat16) if kv_format == "bf16" else cache_u8
    assert cache_u8.numel() > LIMIT + 50_000 * row_bytes

    T, topk = 6, 512
    slots = _high_and_low_slots(T * topk - 64, 64, first_high, S, g)
    c_kv = (torch.randn(len(slots), KV_LORA_RANK, generator=g) * 2).to(torch.bfloat16).cuda()
    k_pe = torch.randn(len(slots), D_QK - KV_LORA_RANK, generator=g).to(torch.bfloat16).cuda()
    slots = slots.cuda()
    concat_and_cache_mla(c_kv, k_pe, cache, slots, kv_format)
    flat_u8 = cache_u8.view(S, row_bytes)
    want_rows = (torch.cat([c_kv, k_pe], -1).view(torch.uint8) if kv_format == "bf16"
                 else quantize_fp8_ds_mla(c_kv, k_pe))
    assert torch.equal(flat_u8[slots], want_rows)  # the writer, byte for byte

    idx = slots.view(T, topk).to(torch.int32).clone()
    idx[0, 5] = -1
    idx[1, 100:140] = S  # out of range
    idx[2, -3:] = 2**31 - 1
    q = torch.randn(T, H, D_QK, generator=g).to(torch.bfloat16).cuda()
    sm = 192**-0.5
    want = sparse_mla_ref(q, cache, idx, sm)
    hopper = gluon and on_hopper(q.device)
    calls = record_launches(monkeypatch, kernel_sm90) if hopper else []
    for splits in (None, 3):  # (3: the partials and their merge)
        out = poison_(torch.empty(T, H, D_V, dtype=torch.bfloat16, device="cuda"))
        got = sparse_mla_triton(q, cache.view(S, -1), idx, sm, D_V, None, None, out, num_splits=splits,
                                config=None if gluon else dict(gluon=False))
        assert got[0] is out
        assert_matches(got, want, max_abs_v(cache, idx, S), f"{kv_format} H={H} gluon={gluon} splits={splits}")
    assert len(calls) == (2 if hopper else 0)  # the Hopper kernel served both calls where there is one
    if hopper and kv_format == "fp8_ds_mla" and H == 16:  # and the bulk-copy kernel (dsa.mla.kernel_bulk)
        for splits in (None, 3):
            got = sparse_mla_triton(q, cache.view(S, -1), idx, sm, D_V, None, None, None, num_splits=splits,
                                    config=dict(bulk=True))
            assert_matches(got, want, max_abs_v(cache, idx, S), f"bulk splits={splits}")
        assert len(calls) == 2


@pytest.mark.parametrize("block_size", [1, 64])
def test_gpu_indexer_cache_past_8gib(block_size):
    """indexer_k_quant_and_cache writes keys past byte 2**33 as indexer_k_quant quantises them; gather_indexer_k
    and fp8_paged_mqa_logits read them back through a block table of high blocks."""
    g = gen(11 + block_size)
    block_bytes = block_size * 132
    nb = LIMIT // block_bytes + 60_000 // block_size + 8
    cache = torch.full((nb, block_bytes), 0xFF, dtype=torch.uint8, device="cuda")
    first_high = LIMIT // block_bytes + 1  # blocks wholly past 2**33
    B, next_n, H = 3, 2, 64
    lens = [1000, 257, 3000 // block_size * block_size + 1 if block_size > 1 else 2999]
    need = [(L + block_size - 1) // block_size for L in lens]
    blocks = first_high + torch.randperm(nb - first_high, generator=g)[:sum(need)]
    blocks[: 2] = torch.tensor([0, 3])  # and two low ones
    bt = torch.full((B, max(need)), -1, dtype=torch.int32)
    o = 0
    for b, n in enumerate(need):
        bt[b, :n] = blocks[o:o + n]
        o += n
    keys = [torch.randn(L, 128, generator=g).to(torch.bfloat16).cuda() for L in lens]
    slots = torch.cat([bt[b, torch.arange(L) // block_size].long() * block_size + torch.arange(L) % block_size
                       for b, L in enumerate(lens)]).cuda()
    k_all = torch.cat(keys)
    indexer_k_quant_and_cache(k_all, cache, slots)
    bt = bt.cuda()

    k_fp8, k_scale = indexer_k_quant(k_all)
    values, scales = indexer_cache_views(cache)
    assert torch.equal(values.view(torch.uint8).reshape(-1, 128)[slots], k_fp8.view(torch.uint8))
    assert torch.equal(scales.reshape(-1)[slots], k_scale.reshape(-1))

    cu = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).int().cuda()
    got_k = poison_(torch.empty(sum(lens), 128, dtype=torch.float8_e4m3fn, device="cuda"))
    got_s = poison_(torch.empty(sum(lens), dtype=torch.float32, device="cuda"))
    gather_indexer_k(cache, bt, cu, out=(got_k, got_s))
    assert torch.equal(got_k.view(torch.uint8), k_fp8.view(torch.uint8)) and torch.equal(got_s, k_scale.reshape(-1))

    q = (torch.randn(B, next_n, H, 128, generator=g) * 2).to(torch.float8_e4m3fn).cuda()
    w = torch.randn(B * next_n, H, generator=g).cuda()
    ctx = torch.tensor(lens, dtype=torch.int32, device="cuda")
    max_len = max(lens)
    out = poison_(torch.empty(B * next_n, max_len, device="cuda"))
    fp8_paged_mqa_logits(q, cache, w, ctx, bt, max_len, out=out)
    assert_logits_match(out, fp8_paged_mqa_logits_ref(q, cache, w, ctx, bt, max_len))
