"""The DeepSeek-V3.2 model: embeddings, RMSNorm, DSA attention on ``dsa``'s ops, dense MLP / MoE.

Module and parameter names follow transformers' ``DeepseekV32ForCausalLM`` (``model.embed_tokens``,
``model.layers.{i}.{input_layernorm, self_attn, post_attention_layernorm, mlp}``, ``model.norm``,
``lm_head``); the routed experts are stored fused, ``mlp.experts.gate_up_proj [E, 2·I, H]`` and
``mlp.experts.down_proj [E, H, I]`` (the loader stacks the checkpoints' per-expert matrices).
MLP and MoE are plain PyTorch, in the same arithmetic order as transformers' eager code.

A step runs on flattened tokens ``[T]`` with a :class:`~dsa.model.metadata.StepMetadata` and a
:class:`PagedKVCache`; see :mod:`dsa.model.generate` for the request loop.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..constants import D_QK, FP8_DS_MLA_ROW_BYTES, INDEXER_HEAD_DIM, INDEXER_ROW_BYTES
from .config import ModelConfig
from .layers import INDEXER_DTYPES, KV_FORMATS, MLAAttention, RMSNorm, RotaryEmbedding
from .metadata import indexer_slots


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """DeepSeek-V3's router (``noaux_tc``): sigmoid scores, a bias used for the choice only, group-limited
    top-k (groups ranked by the sum of their two best biased scores), weights renormalised and scaled."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.n_experts = cfg.num_experts_per_tok, cfg.n_routed_experts
        self.n_group, self.topk_group = cfg.n_group, cfg.topk_group
        self.norm_topk_prob, self.scale = cfg.norm_topk_prob, cfg.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(self.n_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.n_experts, dtype=torch.float32))

    def forward(self, x: torch.Tensor):
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        biased = scores + self.e_score_correction_bias
        T = x.shape[0]
        per = self.n_experts // self.n_group
        group_scores = biased.view(T, self.n_group, per).topk(min(2, per), dim=-1)[0].sum(-1)
        groups = group_scores.topk(self.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, groups, 1).bool()
        keep = keep[:, :, None].expand(T, self.n_group, per).reshape(T, self.n_experts)
        idx = biased.masked_fill(~keep, float("-inf")).topk(self.top_k, dim=-1, sorted=False)[1]
        w = scores.gather(1, idx)
        if self.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return idx, w * self.scale


class Experts(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, H, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, H))
        self.down_proj = nn.Parameter(torch.empty(E, H, I))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Experts in ascending order, each added (bf16) into the output: transformers' eager order."""
        out = torch.zeros_like(x)
        # which (token, slot) pairs go to each expert; the host loop over experts is the one place the
        # MoE syncs (plain PyTorch MoE, as allowed; the attention path never syncs)
        for e in torch.unique(idx).tolist():
            slot, tok = torch.where(idx.T == e)  # slot-major, as transformers orders its rows
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * w[tok, slot, None]
            out.index_add_(0, tok, y.to(out.dtype))
        return out


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Router(cfg)
        self.experts = Experts(cfg)
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x):
        idx, w = self.gate(x)
        return self.experts(x, idx, w) + self.shared_experts(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLAAttention(cfg, i)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(i) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x, rope, md, cache):
        x = x + self.self_attn(self.input_layernorm(x), rope, md, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


class LayerCache:
    """One layer's caches: ``mla`` (bf16 ``[nb, bs, 576]`` or fp8_ds_mla uint8 ``[nb, bs, 656]``) and
    ``indexer`` (uint8 ``[nb, bs·132]``) or, for the bf16 indexer, ``indexer_bf16`` ``[nb·bs + 1, 128]``."""

    def __init__(self, mla, indexer=None, indexer_bf16=None):
        self.mla, self.indexer, self.indexer_bf16 = mla, indexer, indexer_bf16


class PagedKVCache:
    """The paged caches of all layers plus a free list of blocks (block ids shared by both caches)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, *, kv_format: str = "bf16",
                 indexer_dtype: str = "fp8", device="cpu"):
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")
        if indexer_dtype not in INDEXER_DTYPES:
            raise ValueError(f"indexer_dtype: expected one of {INDEXER_DTYPES}, got {indexer_dtype!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.num_slots = num_blocks * block_size
        self.kv_format, self.indexer_dtype = kv_format, indexer_dtype
        self.layers = []
        for _ in range(cfg.num_hidden_layers):
            if kv_format == "bf16":
                mla = torch.zeros(num_blocks, block_size, D_QK, dtype=torch.bfloat16, device=device)
            else:
                mla = torch.zeros(num_blocks, block_size, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8, device=device)
            if indexer_dtype == "fp8":
                lc = LayerCache(mla, indexer=torch.zeros(num_blocks, block_size * INDEXER_ROW_BYTES,
                                                         dtype=torch.uint8, device=device))
            else:
                lc = LayerCache(mla, indexer_bf16=torch.zeros(self.num_slots + 1, INDEXER_HEAD_DIM,
                                                              dtype=torch.bfloat16, device=device))
            self.layers.append(lc)
        self._free = list(range(num_blocks))

    def allocate(self, n: int) -> list:
        if n > len(self._free):
            raise RuntimeError(f"PagedKVCache: out of blocks (need {n}, {len(self._free)} free of {self.num_blocks})")
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, blocks) -> None:
        self._free.extend(blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)


class DeepseekV32ForCausalLM(nn.Module):
    """DeepSeek-V3.2 for causal LM; attention on ``dsa``'s ops.

    Options (:meth:`set_options`): ``indexer_dtype`` ``"fp8"`` (default, the real model's arithmetic)
    or ``"bf16"`` (exact; see :mod:`dsa.model.layers`), ``hadamard`` (default: on for fp8, off for bf16),
    ``kv_format`` ``"bf16"`` or ``"fp8_ds_mla"``, ``backend`` for every op.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.set_options()

    def set_options(self, *, indexer_dtype: str = "fp8", hadamard: bool | None = None, kv_format: str = "bf16",
                    backend: str | None = None) -> "DeepseekV32ForCausalLM":
        if indexer_dtype not in INDEXER_DTYPES:
            raise ValueError(f"indexer_dtype: expected one of {INDEXER_DTYPES}, got {indexer_dtype!r}")
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format: expected one of {KV_FORMATS}, got {kv_format!r}")
        if hadamard is None:
            hadamard = indexer_dtype == "fp8"
        self.indexer_dtype, self.hadamard, self.kv_format, self.backend = indexer_dtype, bool(hadamard), kv_format, backend
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.kv_format, attn.backend = kv_format, backend
            attn.indexer.indexer_dtype, attn.indexer.hadamard, attn.indexer.backend = indexer_dtype, bool(hadamard), backend
        return self

    def new_cache(self, num_blocks: int, block_size: int = 64) -> PagedKVCache:
        dev = self.lm_head.weight.device
        return PagedKVCache(self.config, num_blocks, block_size, kv_format=self.kv_format,
                            indexer_dtype=self.indexer_dtype, device=dev)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, md, cache: PagedKVCache) -> torch.Tensor:
        """``input_ids [T]`` in step order (``md.order``) -> final hidden states ``[T, hidden]`` (normed)."""
        if cache.kv_format != self.kv_format or cache.indexer_dtype != self.indexer_dtype:
            raise ValueError(f"cache: built for kv_format={cache.kv_format!r}, indexer_dtype={cache.indexer_dtype!r}; "
                             f"the model runs kv_format={self.kv_format!r}, indexer_dtype={self.indexer_dtype!r}")
        if cache.block_size != md.block_size:
            raise ValueError(f"md: built for block_size {md.block_size}, the cache has {cache.block_size}")
        if self.indexer_dtype == "bf16":  # its slot lists, once for every layer (on the device, capturable)
            md = dataclasses.replace(md, indexer_slots=indexer_slots(md, cache.num_slots))
        x = self.model.embed_tokens(input_ids)
        rope = self.model.rotary_emb(md.positions)
        for layer, lc in zip(self.model.layers, cache.layers):
            x = layer(x, rope, md, lc)
        return self.model.norm(x)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``lm_head`` in the model dtype (as transformers), returned as fp32."""
        return self.lm_head(hidden).float()

    def set_record(self, on: bool = True) -> None:
        """Keep each indexer's last top-k selection (``layer.self_attn.indexer.last_topk``)."""
        for layer in self.model.layers:
            layer.self_attn.indexer.record = on
            layer.self_attn.indexer.last_topk = None
