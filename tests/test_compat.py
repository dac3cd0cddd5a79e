"""dsa.compat: FlashMLA's and DeepGEMM's call forms on dsa's kernels.

The FlashMLA forms are checked against test_mla's float64 brute force, called as FlashMLA defines the results
(decode: out ``[b, s_q, h_q, 512]``, lse ``[b, h_q, s_q]``, ``topk_length`` per request, the sink as the
factor ``exp(lse) / (exp(lse) + exp(sink))``, +inf lse and zero output for a query with no valid entry), with
sparse_mla's tolerances (tests/test_mla.py). The DeepGEMM forms: the full and paged logits are the public ops'
results unchanged (bitwise); the compressed form against the full logits, window by window.
"""
from __future__ import annotations

import pytest
import torch
from test_mla import LSE_ATOL, LSE_RTOL, OUT_ATOL_REL, brute_force, make_cache, make_indices, max_abs_v
from test_mqa_logits import build_paged, prefill_inputs, rand_fp8
from utils import DEVICE, gen

import dsa
from dsa.compat import deep_gemm, flash_mla
from dsa.constants import D_QK, D_V


# ----------------------------------------------------------------------------------------------
# FlashMLA
# ----------------------------------------------------------------------------------------------
def flat(kv):
    """A cache in any accepted shape and form as dsa's flat rows ``[S, 576]`` bf16 / ``[S, 656]`` uint8."""
    rows = kv.reshape(-1, kv.shape[-1])  # (a copy for a padded cache)
    return rows if kv.dtype == torch.bfloat16 else rows.view(torch.uint8)


def assert_close(out, lse, want_out, want_lse, vmax, ml=None, want_ml=None):
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    torch.testing.assert_close(out.float().cpu(), want_out.float(), atol=OUT_ATOL_REL * vmax, rtol=0)
    torch.testing.assert_close(lse.cpu(), want_lse.float(), atol=LSE_ATOL, rtol=LSE_RTOL)
    if ml is not None:
        torch.testing.assert_close(ml.cpu(), want_ml.float(), atol=LSE_ATOL, rtol=LSE_RTOL)


DECODE_CASES = [
    # b, s_q, h_q, topk, block size, blocks, cache form, topk_length, sink
    (3, 2, 16, 64, 16, 6, "fp8 float8_e4m3fn", True, True),
    (2, 1, 32, 40, 8, 5, "bf16", False, False),
    (2, 3, 8, 70, 64, 2, "fp8 uint8", True, False),
    (1, 4, 64, 33, 4, 9, "fp8 uint8 3-dim", True, True),  # b 1: the lengths broadcast without a copy
    (2, 2, 16, 64, 16, 5, "fp8 float8_e4m3fn padded", True, False),  # blocks a whole number of rows apart
    (3, 1, 32, 50, 1, 40, "bf16 padded", False, True),
]


def pad_blocks(kv, extra_rows):
    """The same paged cache with ``extra_rows`` more rows per block, NaN (all-ones bytes) in them, as the
    ``[num_blocks, block_size, ...]`` slice of that bigger tensor (FlashMLA's tests pad their caches so)."""
    nb, bs = kv.shape[:2]
    big = torch.empty((nb, bs + extra_rows) + tuple(kv.shape[2:]), dtype=kv.dtype)
    big.view(torch.uint8).fill_(0xFF)  # NaN in bf16, e4m3fn and fp32
    big[:, :bs] = kv
    return big[:, :bs]


@pytest.mark.parametrize("b,s_q,h_q,topk,bs,nb,form,with_len,with_sink", DECODE_CASES)
def test_flash_mla_with_kvcache_matches_flashmla_definition(b, s_q, h_q, topk, bs, nb, form, with_len, with_sink):
    g = gen(7100 + b * 31 + s_q * 7 + h_q)
    S, T = nb * bs, b * s_q
    idx = make_indices(T, topk, S, g, empty_rows=(T - 1,))  # -1 and >= S entries, duplicates, a lonely query
    used = torch.zeros(S, dtype=torch.bool)
    used[idx[(idx >= 0) & (idx < S)].long()] = True
    bf16 = form.startswith("bf16")
    kv = make_cache(S, "bf16" if bf16 else "fp8_ds_mla", g, used, block_size=bs)  # NaN in unused slots
    if bf16:
        kv = kv.unsqueeze(2)  # FlashMLA's [num_blocks, block_size, 1, 576]
    elif "float8" in form:
        kv = kv.view(torch.float8_e4m3fn)  # FlashMLA's own dtype for the 656-byte rows
    elif "3-dim" in form:
        kv = kv.squeeze(2)
    if "padded" in form:
        kv = pad_blocks(kv, 3)
        assert not kv.is_contiguous()
    q = torch.randn(b, s_q, h_q, D_QK, generator=g).to(torch.bfloat16)
    topk_length = torch.randint(0, topk + 1, (b,), generator=g, dtype=torch.int32) if with_len else None
    sink = torch.randn(h_q, generator=g) * 2 if with_sink else None
    if sink is not None:
        sink[0], sink[1] = float("inf"), float("-inf")  # FlashMLA: +inf zeroes the output, -inf changes nothing

    meta, none = flash_mla.get_mla_metadata(torch.zeros(1), 64, 1)
    assert none is None and isinstance(meta, flash_mla.FlashMLASchedMeta)
    to = lambda x: None if x is None else x.to(DEVICE)  # noqa: E731
    out, lse = flash_mla.flash_mla_with_kvcache(
        to(q), to(kv), None, None, D_V, meta, is_fp8_kvcache=not bf16, indices=to(idx.view(b, s_q, topk)),
        attn_sink=to(sink), topk_length=to(topk_length))
    assert out.shape == (b, s_q, h_q, D_V) and lse.shape == (b, h_q, s_q)

    per_token = None if topk_length is None else topk_length.repeat_interleave(s_q)  # FlashMLA: one per request
    want_out, _, want_lse = brute_force(q.view(T, h_q, D_QK), flat(kv), idx, D_QK ** -0.5, sink, per_token)
    vmax = max_abs_v(flat(kv), idx, S)
    assert_close(out.reshape(T, h_q, D_V), lse.transpose(1, 2).reshape(T, h_q), want_out, want_lse, vmax)
    assert (out.reshape(T, h_q, D_V)[T - 1] == 0).all()
    assert (lse.transpose(1, 2).reshape(T, h_q)[T - 1] == float("inf")).all()
    if sink is not None:
        assert (out[..., 0, :] == 0).all()

    # the same placeholder serves another shape (dsa has no schedule to keep consistent), and so do the two
    # tensors of FlashMLA's older get_mla_metadata
    out2, _ = flash_mla.flash_mla_with_kvcache(to(q[:1]), to(kv), None, None, D_V, to(torch.zeros(132, 8).int()),
                                               to(torch.zeros(2).int()), softmax_scale=0.1,
                                               is_fp8_kvcache=not bf16, indices=to(idx.view(b, s_q, topk)[:1]))
    want2, _, _ = brute_force(q[:1].reshape(s_q, h_q, D_QK), flat(kv), idx[:s_q], 0.1)
    torch.testing.assert_close(out2.reshape(s_q, h_q, D_V).float().cpu(), want2.float(), atol=OUT_ATOL_REL * vmax,
                               rtol=0)


@pytest.mark.parametrize("shaped", [True, False])
def test_flash_mla_sparse_fwd_matches_flashmla_definition(shaped):
    g = gen(7200 + shaped)
    s_q, h_q, topk, s_kv = 5, 16, 72, 90
    idx = make_indices(s_q, topk, s_kv, g, empty_rows=(2,))
    used = torch.zeros(s_kv, dtype=torch.bool)
    used[idx[(idx >= 0) & (idx < s_kv)].long()] = True
    kv = make_cache(s_kv, "bf16", g, used)
    q = torch.randn(s_q, h_q, D_QK, generator=g).to(torch.bfloat16)
    topk_length = torch.randint(0, topk + 1, (s_q,), generator=g, dtype=torch.int32)
    sink = torch.randn(h_q, generator=g)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    args = (to(kv.unsqueeze(1)), to(idx.unsqueeze(1))) if shaped else (to(kv), to(idx))
    out, ml, lse = flash_mla.flash_mla_sparse_fwd(to(q), *args, 0.07, attn_sink=to(sink),
                                                  topk_length=to(topk_length))
    want_out, want_ml, want_lse = brute_force(q, kv, idx, 0.07, sink, topk_length)
    vmax = max_abs_v(kv, idx, s_kv)
    assert_close(out, lse, want_out, want_lse, vmax, ml, want_ml)
    assert (out[2] == 0).all() and (lse[2] == float("inf")).all() and (ml[2] == float("-inf")).all()


def _decode_args():
    g = gen(7300)
    q = torch.randn(2, 1, 16, D_QK, generator=g).to(torch.bfloat16)
    kv = torch.zeros(4, 16, 1, 656, dtype=torch.uint8)
    idx = torch.zeros(2, 1, 64, dtype=torch.int32)
    return dict(q=q, k_cache=kv, block_table=None, cache_seqlens=None, head_dim_v=D_V,
                tile_scheduler_metadata=flash_mla.FlashMLASchedMeta(), is_fp8_kvcache=True, indices=idx)


BAD_DECODE = [
    (dict(indices=None), "indices"),
    (dict(causal=True), "causal"),
    (dict(extra_k_cache=torch.zeros(4, 16, 1, 656, dtype=torch.uint8)), "extra_k_cache"),
    (dict(extra_indices_in_kvcache=torch.zeros(2, 1, 8, dtype=torch.int32)), "extra_indices_in_kvcache"),
    (dict(extra_topk_length=torch.zeros(2, dtype=torch.int32)), "extra_topk_length"),
    (dict(is_fp8_kvcache=False), "is_fp8_kvcache"),
    (dict(k_cache=torch.zeros(4, 16 * 656 + 8, dtype=torch.uint8)[:, :16 * 656].view(4, 16, 656)), "k_cache"),
    (dict(k_cache=torch.zeros(4, 16, 1, 700, dtype=torch.uint8)[..., :656]), "k_cache"),  # rows apart
    (dict(k_cache=torch.zeros(4, 16, 2, 656, dtype=torch.uint8)), "k_cache"),
    (dict(indices=torch.zeros(2, 2, 64, dtype=torch.int32)), "indices"),
    (dict(topk_length=torch.zeros(3, dtype=torch.int32)), "topk_length"),
    (dict(head_dim_v=576), "d_v"),
    (dict(q=torch.zeros(2, 16, D_QK, dtype=torch.bfloat16)), "q"),
]


@pytest.mark.parametrize("i", range(len(BAD_DECODE)))
def test_flash_mla_with_kvcache_rejects(i):
    change, name = BAD_DECODE[i]
    args = {**_decode_args(), **change}
    with pytest.raises((ValueError, TypeError), match=name):
        flash_mla.flash_mla_with_kvcache(**args)


def test_flash_mla_sparse_fwd_rejects():
    q = torch.zeros(2, 16, D_QK, dtype=torch.bfloat16)
    kv = torch.zeros(8, 1, D_QK, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 4, dtype=torch.int32)
    for args, kw, name in [((q, kv, idx, 0.1), dict(indexer_topk=512), "indexer_topk"),
                           ((q, torch.zeros(8, 2, D_QK, dtype=torch.bfloat16), idx, 0.1), {}, "kv"),
                           ((q, kv, torch.zeros(2, 2, 4, dtype=torch.int32), 0.1), {}, "indices"),
                           ((q, kv.view(torch.uint8), idx, 0.1), {}, "kv")]:
        with pytest.raises((ValueError, TypeError), match=name):
            flash_mla.flash_mla_sparse_fwd(*args, **kw)


# ----------------------------------------------------------------------------------------------
# DeepGEMM
# ----------------------------------------------------------------------------------------------
def test_deep_gemm_full_logits_are_the_ops():
    g = gen(7400)
    q, kv, w, ks, ke = prefill_inputs(9, 150, 32, g, empty_rows=(4,))
    want = dsa.fp8_mqa_logits(q, kv, w, ks, ke)
    assert torch.equal(deep_gemm.fp8_mqa_logits(q, kv, w, ks, ke), want)
    assert torch.equal(deep_gemm.fp8_mqa_logits((q, None), kv, w, ks, ke, clean_logits=True), want)
    with pytest.raises(ValueError, match="q"):
        deep_gemm.fp8_mqa_logits((q, torch.ones(9)), kv, w, ks, ke)


@pytest.mark.parametrize("width,chunk_rows", [(40, None), (160, 3), (7, 2)])
def test_deep_gemm_compressed_logits(monkeypatch, width, chunk_rows):
    g = gen(7500 + width)
    M, N = 11, 130
    q, kv, w, ks, ke = prefill_inputs(M, N, 64, g, empty_rows=(5,))  # ks from -3, ke past N, an empty row
    if chunk_rows is not None:  # several chunks of rows
        monkeypatch.setattr(deep_gemm, "COMPRESSED_CHUNK_BYTES", chunk_rows * 4 * N)
    got = deep_gemm.fp8_mqa_logits(q, kv, w, ks, ke, clean_logits=False, max_seqlen_k=width).cpu()
    full = dsa.fp8_mqa_logits(q, kv, w, ks, ke).cpu()
    assert got.shape == (M, width)
    for i in range(M):
        for j in range(width):
            key = int(ks[i]) + j
            want = full[i, key] if 0 <= key < min(N, int(ke[i])) else float("-inf")
            assert got[i, j] == want, (i, j, key)
    assert torch.isfinite(got).any()


def test_deep_gemm_compressed_logits_edges():
    g = gen(7600)
    q, kv, w, ks, ke = prefill_inputs(4, 20, 16, g)
    empty = deep_gemm.fp8_mqa_logits(q[:0], kv, w[:0], ks[:0], ke[:0], max_seqlen_k=5)
    assert empty.shape == (0, 5)
    no_keys = deep_gemm.fp8_mqa_logits(q, (kv[0][:0], kv[1][:0]), w, ks, ke, max_seqlen_k=3)
    assert (no_keys == float("-inf")).all()
    with pytest.raises(ValueError, match="max_seqlen_k"):
        deep_gemm.fp8_mqa_logits(q, kv, w, ks, ke, max_seqlen_k=-1)
    with pytest.raises(ValueError, match="weights"):
        deep_gemm.fp8_mqa_logits(q, kv, w[:3], ks, ke, max_seqlen_k=4)
    with pytest.raises(TypeError, match="k"):
        deep_gemm.fp8_mqa_logits(q, (kv[0].float(), kv[1]), w, ks, ke, max_seqlen_k=4)


@pytest.mark.parametrize("two_d", [False, True])
def test_deep_gemm_paged_logits_are_the_ops(two_d):
    g = gen(7700 + two_d)
    lens, bs, next_n, H = [37, 5, 70], 16, 2, 64
    cache, bt, _, _ = build_paged(lens, bs, g)
    cache = cache.view(cache.shape[0], bs, 1, 132)  # DeepGEMM's shape
    B = len(lens)
    q = rand_fp8((B, next_n, H, 128), g).to(DEVICE)
    w = torch.randn(B * next_n, H, generator=g).to(DEVICE)
    ctx = torch.tensor(lens, dtype=torch.int32)
    if two_d:
        ctx = torch.stack([torch.tensor([L - 1, L]) for L in lens]).int()
    ctx = ctx.to(DEVICE)
    for meta in (deep_gemm.get_paged_mqa_logits_metadata(ctx, bs, deep_gemm.get_num_sms()),
                 deep_gemm.get_paged_mqa_logits_metadata(ctx, deep_gemm.get_num_sms())):
        assert meta.dtype == torch.int32 and meta.device == ctx.device
        got = deep_gemm.fp8_paged_mqa_logits(q, cache, w, ctx, bt, meta, max(lens), clean_logits=True)
        assert torch.equal(got, dsa.fp8_paged_mqa_logits(q, cache, w, ctx, bt, max(lens)))
    assert deep_gemm.get_num_sms() >= 1


def test_readme_example_runs():
    """The README's dsa.compat block, run as written on small inputs of the shapes it names."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    section = text[text.index("### In place of FlashMLA and DeepGEMM"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    g = gen(7800)
    b, h_q, topk, S = 2, 16, 64, 128
    idx = make_indices(b, topk, S, g)
    used = torch.ones(S, dtype=torch.bool)
    lens = [70, 9]
    kv_cache, block_table, _, _ = build_paged(lens, 64, g)
    q_fp8, (k_fp8, k_scale), weights, ks, ke = prefill_inputs(5, 40, 64, g)
    to = lambda x: x.to(DEVICE)  # noqa: E731
    env = dict(
        q=to(torch.randn(b, h_q, D_QK, generator=g).to(torch.bfloat16)), kv=to(make_cache(S, "bf16", g, used)),
        indices=to(idx), sm_scale=192 ** -0.5, k_cache=to(make_cache(S, "fp8_ds_mla", g, used, block_size=64)),
        q_fp8=q_fp8, k_fp8=k_fp8, k_scale=k_scale, weights=weights, ks=ks, ke=ke)
    exec(code.split("meta, _")[0], env)  # the prefill call: q [s_q, h_q, 576], kv [s_kv, 576], indices [s_q, topk]
    assert env["out"].shape == (b, h_q, D_V)
    env.update(q=env["q"].unsqueeze(1), indices=env["indices"].unsqueeze(1))  # decode: [b, s_q, ...]
    decode = "meta, _" + code.split("meta, _")[1].split("logits =")[0]
    exec(decode, env)
    assert env["out"].shape == (b, 1, h_q, D_V) and env["lse"].shape == (b, h_q, 1)
    env.update(q_fp8=to(rand_fp8((2, 1, 64, 128), g)), weights=to(torch.randn(2, 64, generator=g)),
               kv_cache=kv_cache.view(-1, 64, 1, 132), block_table=block_table,
               context_lens=to(torch.tensor(lens, dtype=torch.int32)), max_context_len=max(lens))
    exec("logits =" + code.split("logits =")[2], env)
    assert env["logits"].shape == (2, max(lens))
    env.update(q_fp8=q_fp8, weights=weights)
    exec("logits =" + code.split("logits =")[1], env)
    assert env["logits"].shape == (5, 40)


def test_padded_cache_slot_map():
    """Slots of a padded cache map to rows of its flat view; every invalid slot to -1, also those whose row would
    wrap around int32 onto a real one (block size 1, 3 rows per block: slot 1431655766 -> row 2**32 + 2)."""
    kv = pad_blocks(torch.zeros(5, 1, 1, 656, dtype=torch.uint8), 2)
    idx = torch.tensor([[0, 1, 4, 5, -1, 1431655766, 2**31 - 1, -2**31]], dtype=torch.int32)
    flat, rows = flash_mla._cache_rows(kv, True, idx)
    assert flat.shape == (13, 656) and flat.is_contiguous() and flat.data_ptr() == kv.data_ptr()
    assert rows.tolist() == [[0, 3, 12, -1, -1, -1, -1, -1]]
