"""DeepSeek-V3.2 attention on ``dsa``'s ops: RoPE tables, the lightning indexer and absorbed MLA.

Parameter names and shapes are those of the Hugging Face DeepSeek-V3.2 checkpoints
(``self_attn.q_a_proj``, ``q_a_layernorm``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``, ``indexer.{wq_b, wk, k_norm, weights_proj}``).

Arithmetic (bf16 activations unless said otherwise):

* RoPE tables: ``cos/sin(pos · inv_freq) · attention_factor`` in fp32 (YaRN inverse
  frequencies when the config asks for them), rounded to bf16 where bf16 tensors are
  rotated. MLA's RoPE is interleaved (GPT-J pairs ``(2i, 2i+1)``) and keeps that layout;
  it is computed in bf16, one rounding per product and per sum, as transformers does.
* Absorbed MLA: ``kv_b_proj.weight`` viewed ``[h, nope + v, 512]`` gives
  ``W_UK = [:, :nope]`` and ``W_UV = [:, nope:]``; the query is
  ``[q_nope · W_UK (512) | q_pe (64)]`` (bf16), the cache row ``[c_kv (512) | k_pe (64)]``,
  :func:`dsa.sparse_mla` returns the 512-wide latent output and ``W_UV`` maps it to the
  ``v_head_dim`` values of each head before ``o_proj``. Softmax scale
  ``(qk_nope + qk_rope)^-0.5 · mscale²`` (:attr:`ModelConfig.softmax_scale`).
* Indexer: ``q = wq_b(q_lora)`` ``[T, 64, 128]``, ``k = LayerNorm(wk(x))`` ``[T, 128]``,
  RoPE on the first 64 dims (rotate-half; interleaved when the config says
  ``indexer_rope_interleave``), optional Hadamard of both, per-head weights
  ``weights_proj(x)`` (a bf16 GEMM, as transformers and vLLM run it) taken to fp32.

  - ``indexer_dtype="fp8"`` (default; the real model's arithmetic): q/k through
    :func:`dsa.indexer_prep.prepare_indexer_q` / ``prepare_indexer_k`` (RoPE in fp32,
    Hadamard, q quantised with its scale folded into the weights), K written by
    :func:`indexer_k_quant_and_cache`, logits by ``fp8_mqa_logits`` (prefill, over keys
    gathered with ``gather_indexer_k``) and ``fp8_paged_mqa_logits`` (decode).
  - ``indexer_dtype="bf16"`` (exact, for checking against transformers, which has no fp8
    indexer): q/k rotated in bf16 exactly as transformers does, K kept in a bf16 side cache
    ``[num_slots + 1, 128]`` (the last row absorbs writes of skipped slots), and the logits
    ``Σ_h w[h]·64^-0.5 · relu(128^-0.5 · q_h·k)`` computed here in PyTorch (fp32). The ranges,
    the chunking and the top-k are those of the fp8 path.

  Both paths then pick ``index_topk`` keys per token with :func:`dsa.topk.top_k_indices`.

No layer forward synchronises with the host: every size it slices by was computed by the
metadata builder (:mod:`dsa.model.metadata`) before the step.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..constants import INDEXER_HEAD_DIM, INDEXER_NUM_HEADS, INDEXER_ROPE_DIM, KV_LORA_RANK, ROPE_DIM
from .config import ModelConfig, yarn_get_mscale
from .metadata import indexer_slots

INDEXER_DTYPES = ("fp8", "bf16")
KV_FORMATS = ("bf16", "fp8_ds_mla")


# --------------------------------------------------------------------------- norms
class RMSNorm(nn.Module):
    """``weight · bf16(x · rsqrt(mean(x²) + eps))`` with the statistics in fp32 (transformers' order)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dt)


# --------------------------------------------------------------------------- RoPE
def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[rope_dim / 2]`` fp32 and the cos/sin multiplier (YaRN's attention factor)."""
    dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if cfg.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    rs = cfg.rope_scaling
    factor = rs.get("factor")
    orig = rs.get("original_max_position_embeddings") or cfg.max_position_embeddings
    if factor is None:
        factor = cfg.max_position_embeddings / orig
    factor = float(factor)
    attention_factor = rs.get("attention_factor")
    mscale, mscale_all_dim = rs.get("mscale"), rs.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = rs.get("beta_fast") or 32
    beta_slow = rs.get("beta_slow") or 1

    def correction_dim(num_rot):
        return (dim * math.log(orig / (num_rot * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rs.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrap = 1 - ramp  # 1: keep the original frequency (high frequencies), 0: interpolate
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    return inv_inter * (1 - extrap) + inv_extra * extrap, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inv_freq, self.attention_factor = rope_inv_freq(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, positions: torch.Tensor) -> "RopeTables":
        ang = positions.float()[:, None] * self.inv_freq.float()[None, :]
        ang = torch.cat([ang, ang], dim=-1)  # same tensor shape as transformers' tables (identical cos/sin bits)
        half = ang.shape[-1] // 2
        cos = (ang.cos() * self.attention_factor)[:, :half].contiguous()
        sin = (ang.sin() * self.attention_factor)[:, :half].contiguous()
        return RopeTables(cos, sin)


class RopeTables:
    """Per-step ``cos``/``sin`` ``[T, 32]`` in fp32 and rounded to bf16."""

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin
        self.cos_bf16, self.sin_bf16 = cos.to(torch.bfloat16), sin.to(torch.bfloat16)


def rope_bf16(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate ``x [T, ..., 64]`` (bf16) in bf16 arithmetic, one rounding per product and sum.

    ``cos``/``sin`` ``[T, 32]`` bf16. Interleaved: pairs ``(2i, 2i+1)`` (layout kept);
    otherwise rotate-half pairs ``(i, i+32)``. Pair i: ``a' = a·c - b·s``, ``b' = b·c + a·s``.
    """
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c, s = cos.reshape(shape), sin.reshape(shape)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
    else:
        h = x.shape[-1] // 2
        a, b = x[..., :h], x[..., h:]
    a2 = a * c - b * s
    b2 = b * c + a * s
    if interleaved:
        return torch.stack([a2, b2], dim=-1).flatten(-2)
    return torch.cat([a2, b2], dim=-1)


# --------------------------------------------------------------------------- indexer
class Indexer(nn.Module):
    """The lightning indexer: ``index_topk`` key positions per query token (relative to its request)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.head_dim = cfg.index_n_heads, cfg.index_head_dim
        self.index_topk = cfg.index_topk
        self.interleaved = bool(cfg.indexer_rope_interleave)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        # set by the model (DeepseekV32ForCausalLM.set_options)
        self.indexer_dtype = "fp8"
        self.hadamard = True
        self.backend: str | None = None
        self.record = False  # keep the last selection in self.last_topk (tests, debugging)
        self.last_topk: torch.Tensor | None = None

    # -- q / k before their logits (methods so that tests can swap them) ---------------
    def _bf16_q(self, q: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        r = INDEXER_ROPE_DIM
        q = torch.cat([rope_bf16(q[..., :r], rope.cos_bf16, rope.sin_bf16, self.interleaved), q[..., r:]], -1)
        return self._hadamard(q) if self.hadamard else q

    def _bf16_k(self, k: torch.Tensor, rope: RopeTables) -> torch.Tensor:
        r = INDEXER_ROPE_DIM
        k = torch.cat([rope_bf16(k[..., :r], rope.cos_bf16, rope.sin_bf16, self.interleaved), k[..., r:]], -1)
        return self._hadamard(k) if self.hadamard else k

    def _hadamard(self, x: torch.Tensor) -> torch.Tensor:
        from ..indexer_prep import hadamard_128

        return hadamard_128(x)

    def _fp8_q(self, q, rope, w):
        from ..indexer_prep import prepare_indexer_q

        res = prepare_indexer_q(q, rope.cos, rope.sin, w, interleaved=self.interleaved, hadamard=self.hadamard,
                                scale_fmt="ue8m0", backend=self.backend)
        return res[0], res[1]

    def _fp8_k(self, k, rope):
        from ..indexer_prep import prepare_indexer_k

        return prepare_indexer_k(k, rope.cos, rope.sin, interleaved=self.interleaved, hadamard=self.hadamard,
                                 backend=self.backend)

    # -- forward ------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, x: torch.Tensor, q_lora: torch.Tensor, rope: RopeTables, md, cache) -> torch.Tensor:
        """``x [T, hidden]``, ``q_lora [T, q_lora_rank]`` (bf16) -> ``[T, index_topk]`` int32 positions
        inside each token's request, valid first, then -1. Writes this step's keys into ``cache``."""
        from ..topk import top_k_indices

        T = x.shape[0]
        q = self.wq_b(q_lora).view(T, self.n_heads, self.head_dim)
        k = F.layer_norm(self.wk(x), (self.head_dim,), self.k_norm.weight, self.k_norm.bias, self.k_norm.eps)
        w = self.weights_proj(x).float()  # [T, 64]: a bf16 GEMM, as transformers and vLLM
        nd = md.num_decode_tokens
        pieces = []
        if self.indexer_dtype == "bf16":
            q = self._bf16_q(q, rope)
            k = self._bf16_k(k, rope)
            w = w * (self.n_heads ** -0.5)
            kc = cache.indexer_bf16
            sl = md.indexer_slots if md.indexer_slots is not None else indexer_slots(md, kc.shape[0] - 1)
            kc.index_copy_(0, sl.slot_mapping, k)
            if md.num_decodes:
                keys = kc[sl.decode_keys]  # [B, maxL, 128]
                logits = _bf16_decode_logits(q[:nd], keys, w[:nd], md, self.head_dim ** -0.5)
                pieces.append(top_k_indices(logits, self.index_topk, seq_lens=md.decode_context_lens,
                                            next_n=md.next_n, backend=self.backend))
            if md.num_prefills:
                keys_all = kc[sl.prefill_keys]  # [N, 128]
                for ch in md.prefill_chunks:
                    a, b = nd + ch.start, nd + ch.end
                    logits = _bf16_prefill_logits(q[a:b], keys_all[ch.key_start:ch.key_end], w[a:b], ch.ks, ch.ke,
                                                  self.head_dim ** -0.5)
                    pieces.append(top_k_indices(logits, self.index_topk, ch.ks, ch.ke, backend=self.backend))
        else:
            from ..indexer_cache import gather_indexer_k, indexer_k_quant_and_cache
            from ..mqa_logits import fp8_mqa_logits, fp8_paged_mqa_logits

            q_fp8, w = self._fp8_q(q, rope, w)
            k = self._fp8_k(k, rope)
            indexer_k_quant_and_cache(k, cache.indexer, md.slot_mapping, scale_fmt="ue8m0", backend=self.backend)
            if md.num_decodes:
                qd = q_fp8[:nd].view(md.num_decodes, md.next_n, self.n_heads, self.head_dim)
                logits = fp8_paged_mqa_logits(qd, cache.indexer, w[:nd], md.decode_context_lens,
                                              md.decode_block_table, md.max_decode_context_len, backend=self.backend)
                pieces.append(top_k_indices(logits, self.index_topk, seq_lens=md.decode_context_lens,
                                            next_n=md.next_n, backend=self.backend))
            if md.num_prefills:
                k_fp8, k_scale = gather_indexer_k(cache.indexer, md.prefill_block_table, md.prefill_cu_seq_lens,
                                                  num_tokens=md.num_prefill_keys, backend=self.backend)
                for ch in md.prefill_chunks:
                    a, b = nd + ch.start, nd + ch.end
                    kv = (k_fp8[ch.key_start:ch.key_end], k_scale[ch.key_start:ch.key_end])
                    logits = fp8_mqa_logits(q_fp8[a:b], kv, w[a:b], ch.ks, ch.ke, backend=self.backend)
                    pieces.append(top_k_indices(logits, self.index_topk, ch.ks, ch.ke, backend=self.backend))
        topk = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 0)
        if self.record:
            self.last_topk = topk
        return topk


def _bf16_prefill_logits(q, keys, w, ks, ke, scale):
    """``[M, N]`` fp32: ``Σ_h w[m,h]·relu(scale·q[m,h]·k[n])`` for ``ks[m] <= n < ke[m]``, ``-inf`` elsewhere."""
    M, N = q.shape[0], keys.shape[0]
    kf = keys.float()
    logits = torch.zeros(M, N, dtype=torch.float32, device=q.device)
    qf = q.float()
    for h in range(q.shape[1]):  # one head at a time: the fp32 scores of all heads would be 64x the logits
        logits += w[:, h, None] * torch.relu((qf[:, h] @ kf.T) * scale)
    n = torch.arange(N, device=q.device)
    inside = (n[None, :] >= ks[:, None]) & (n[None, :] < ke[:, None])
    return logits.masked_fill(~inside, float("-inf"))


def _bf16_decode_logits(q, keys, w, md, scale):
    """``[B·next_n, maxL]`` fp32 over the decode requests' keys ``keys [B, maxL, 128]``; row
    ``b·next_n + j`` sees positions ``s < L_b - next_n + j + 1``."""
    B, L = keys.shape[0], keys.shape[1]
    nn_ = md.next_n
    qf = q.float().view(B, nn_, q.shape[1], q.shape[2])
    kf = keys.float()
    logits = torch.zeros(B, nn_, L, dtype=torch.float32, device=q.device)
    wv = w.view(B, nn_, -1)
    for h in range(q.shape[1]):
        logits += wv[:, :, h, None] * torch.relu(torch.bmm(qf[:, :, h], kf.transpose(1, 2)) * scale)
    s = torch.arange(L, device=q.device)
    lim = md.decode_context_lens[:, None].long() - nn_ + torch.arange(nn_, device=q.device)[None, :] + 1  # [B, nn]
    logits = logits.masked_fill(s[None, None, :] >= lim[:, :, None], float("-inf"))
    return logits.view(B * nn_, L)


# --------------------------------------------------------------------------- MLA
class MLAAttention(nn.Module):
    """DeepSeek MLA with the DSA indexer, weights absorbed: attention runs on the 576-wide latent cache."""

    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads
        self.qk_nope, self.qk_rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        bias = cfg.attention_bias
        h = self.num_heads
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=bias)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, h * (self.qk_nope + self.qk_rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, self.kv_lora_rank + self.qk_rope, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, h * (self.qk_nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(h * self.v_dim, cfg.hidden_size, bias=bias)
        self.indexer = Indexer(cfg, layer_idx)
        self.softmax_scale = cfg.softmax_scale
        self.kv_format = "bf16"
        self.backend: str | None = None

    def absorbed_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(W_UK [h, qk_nope, 512], W_UV [h, v_head_dim, 512])`` views of ``kv_b_proj.weight``
        (its rows are per head ``[k_nope (qk_nope) | v (v_head_dim)]``)."""
        w = self.kv_b_proj.weight.view(self.num_heads, self.qk_nope + self.v_dim, self.kv_lora_rank)
        return w[:, : self.qk_nope], w[:, self.qk_nope:]

    @torch.no_grad()
    def forward(self, x: torch.Tensor, rope: RopeTables, md, cache) -> torch.Tensor:
        from ..metadata import convert_req_index_to_global_index
        from ..mla_cache import concat_and_cache_mla
        from ..mla import sparse_mla

        T, h = x.shape[0], self.num_heads
        q_lora = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_lora).view(T, h, self.qk_nope + self.qk_rope)
        q_nope, q_pe = q[..., : self.qk_nope], q[..., self.qk_nope:]
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        k_pe = rope_bf16(kv[:, self.kv_lora_rank:], rope.cos_bf16, rope.sin_bf16, interleaved=True)
        q_pe = rope_bf16(q_pe, rope.cos_bf16, rope.sin_bf16, interleaved=True)
        concat_and_cache_mla(c_kv.contiguous(), k_pe.contiguous(), cache.mla, md.slot_mapping,
                             kv_format=self.kv_format, backend=self.backend)

        rel = self.indexer(x, q_lora, rope, md, cache)
        slots = convert_req_index_to_global_index(md.req_id, md.block_table, rel, md.block_size, backend=self.backend)

        w_uk, w_uv = self.absorbed_weights()
        q_abs = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, h, 512]
        q_full = torch.cat([q_abs, q_pe], dim=-1).contiguous()  # [T, h, 576] bf16
        out = sparse_mla(q_full, cache.mla, slots, self.softmax_scale, topk_length=md.sparse_seqlens,
                         backend=self.backend)[0]  # [T, h, 512]
        o = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, h, v]
        return self.o_proj(o.reshape(T, h * self.v_dim))


assert KV_LORA_RANK == 512 and ROPE_DIM == 64 and INDEXER_NUM_HEADS == 64 and INDEXER_HEAD_DIM == 128
