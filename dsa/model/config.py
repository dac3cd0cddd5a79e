"""The DeepSeek-V3.2 model configuration, read from a Hugging Face ``config.json``.

Only the fields the architecture needs are kept. Both spellings of the RoPE
settings are accepted: the original checkpoints' ``rope_theta`` + ``rope_scaling``
(``{"type": "yarn", "factor": 40, ...}``) and transformers 5's ``rope_parameters``
(``{"rope_type": "yarn", "rope_theta": 10000, ...}``).

The attention dimensions are those of ``dsa``'s ops (``kv_lora_rank`` 512,
``qk_rope_head_dim`` 64, indexer 64 heads x 128): a config asking for anything
else is refused with a ``ValueError`` naming the field.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields

from ..constants import INDEXER_HEAD_DIM, INDEXER_NUM_HEADS, INDEXER_ROPE_DIM, KV_LORA_RANK, ROPE_DIM

#: model types whose indexer uses interleaved (GPT-J) RoPE instead of rotate-half
_INTERLEAVED_INDEXER_MODEL_TYPES = ("glm_moe_dsa",)


@dataclass
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 7168
    intermediate_size: int = 18432
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 61
    num_attention_heads: int = 128
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = KV_LORA_RANK
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = ROPE_DIM
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    n_group: int = 8
    topk_group: int = 4
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 163840
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: normalised RoPE scaling: None (plain RoPE) or a dict with "rope_type" ("yarn") and its parameters
    rope_scaling: dict | None = None
    index_topk: int = 2048
    index_head_dim: int = INDEXER_HEAD_DIM
    index_n_heads: int = INDEXER_NUM_HEADS
    indexer_rope_interleave: bool = False
    first_k_dense_replace: int = 3
    moe_layer_freq: int = 1
    #: "dense" / "sparse" per layer (transformers' ``mlp_layer_types``); derived when absent
    mlp_layer_types: list | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = 0
    eos_token_id: int | list | None = 1
    model_type: str = "deepseek_v32"
    torch_dtype: str = "bfloat16"
    quantization_config: dict | None = None
    extra: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def rope_type(self) -> str:
        return (self.rope_scaling or {}).get("rope_type", "default")

    def is_moe_layer(self, i: int) -> bool:
        return self.mlp_layer_types[i] == "sparse"

    @property
    def softmax_scale(self) -> float:
        """``(qk_nope + qk_rope)^-0.5``, times ``mscale^2`` under YaRN (``mscale = 0.1·mscale_all_dim·ln(factor) + 1``)."""
        scale = self.qk_head_dim ** -0.5
        rs = self.rope_scaling
        if rs is not None and self.rope_type != "default":
            mscale_all_dim = rs.get("mscale_all_dim") or 0
            if mscale_all_dim:
                m = yarn_get_mscale(float(rs["factor"]), float(mscale_all_dim))
                scale = scale * m * m
        return scale

    # ------------------------------------------------------------------ I/O
    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        known = {f.name for f in fields(cls)} - {"extra", "rope_scaling"}
        kw = {k: d[k] for k in known if k in d and (d[k] is not None or k == "q_lora_rank")}
        # RoPE: rope_parameters (transformers 5) or rope_theta + rope_scaling (original checkpoints)
        rp = d.get("rope_parameters")
        rs = d.get("rope_scaling")
        theta = d.get("rope_theta")
        scaling = None
        if isinstance(rp, dict) and rp:
            scaling = dict(rp)
            theta = scaling.pop("rope_theta", theta)
        elif isinstance(rs, dict) and rs:
            scaling = dict(rs)
        if scaling is not None:
            rt = scaling.pop("type", None)
            scaling["rope_type"] = scaling.get("rope_type") or rt or "default"
            if scaling["rope_type"] == "default":
                scaling = None
        if theta is not None:
            kw["rope_theta"] = float(theta)
        kw["rope_scaling"] = scaling
        if "num_experts" in d and d.get("n_routed_experts") is None:
            kw["n_routed_experts"] = d["num_experts"]
        if d.get("model_type") in _INTERLEAVED_INDEXER_MODEL_TYPES and "indexer_rope_interleave" not in d:
            kw["indexer_rope_interleave"] = True
        if "dtype" in d and "torch_dtype" not in d and isinstance(d["dtype"], str):
            kw["torch_dtype"] = d["dtype"]
        kw["extra"] = {k: v for k, v in d.items() if k not in known and k not in ("rope_parameters", "rope_scaling")}
        cfg = cls(**kw)
        cfg._finish()
        return cfg

    @classmethod
    def from_json(cls, path: str) -> "ModelConfig":
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    # ------------------------------------------------------------------ checks
    def _finish(self) -> None:
        if self.mlp_layer_types is None:
            self.mlp_layer_types = [
                "sparse" if (i >= self.first_k_dense_replace and i % max(self.moe_layer_freq, 1) == 0) else "dense"
                for i in range(self.num_hidden_layers)
            ]
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"mlp_layer_types: expected {self.num_hidden_layers} entries, got {len(self.mlp_layer_types)}")
        fixed = dict(kv_lora_rank=KV_LORA_RANK, qk_rope_head_dim=ROPE_DIM, index_n_heads=INDEXER_NUM_HEADS,
                     index_head_dim=INDEXER_HEAD_DIM)
        for name, want in fixed.items():
            if getattr(self, name) != want:
                raise ValueError(f"{name}: dsa's attention ops are built for {want}, got {getattr(self, name)}")
        assert INDEXER_ROPE_DIM == self.qk_rope_head_dim
        if self.num_attention_heads % 8 or not 8 <= self.num_attention_heads <= 128:
            raise ValueError(f"num_attention_heads: expected a multiple of 8 from 8 to 128, got {self.num_attention_heads}")
        if self.q_lora_rank is None:
            raise ValueError("q_lora_rank: expected an int (the DSA indexer reads the q LoRA latent), got None")
        if self.index_topk <= 0:
            raise ValueError(f"index_topk: expected a positive int, got {self.index_topk}")
        if self.rope_type not in ("default", "yarn"):
            raise ValueError(f"rope_scaling: expected rope type 'yarn' or none, got {self.rope_type!r}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")
        if any(t == "sparse" for t in self.mlp_layer_types):
            if self.n_routed_experts % self.n_group:
                raise ValueError(f"n_group: expected a divisor of n_routed_experts={self.n_routed_experts}, got {self.n_group}")
            if not 1 <= self.topk_group <= self.n_group:
                raise ValueError(f"topk_group: expected 1..n_group={self.n_group}, got {self.topk_group}")
        scoring = self.extra.get("scoring_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"scoring_func: expected 'sigmoid' (DeepSeek-V3 router), got {scoring!r}")


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention-temperature factor ``0.1·mscale·ln(scale) + 1`` (1 when ``scale <= 1``)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0
