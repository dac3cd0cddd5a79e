"""A small random DeepSeek-V3.2 checkpoint in the Hugging Face format (for tests and demos).

The attention keeps DeepSeek's dimensions (``kv_lora_rank`` 512, rope 64, ``qk_nope`` 128,
indexer 64 heads x 128), which ``dsa``'s ops are built for; everything else is small:
hidden 256, 8 query heads, vocab 512, 3 layers (the first dense, then MoE with 4 routed
experts in 2 groups, top-2 from the best group, 1 shared expert), ``index_topk`` 16 so that
prompts of a few dozen tokens already run real sparse attention, and the released model's
YaRN RoPE (factor 40, so the softmax scale carries ``mscale² ≈ 1.87``).

The weights are drawn so that every part matters to the output (attention logits of order
1-3, a rope share comparable to the nope share, peaked next-token logits); norms get random
weights (and the indexer's LayerNorm a bias) so that a misplaced norm shows.
Written as the released checkpoints are: per-expert matrices, ``rope_scaling`` with ``type``,
two safetensors shards plus ``model.safetensors.index.json``.
"""
from __future__ import annotations

import json
import math
import os

import torch

from .config import ModelConfig
from .loader import cast_model_, hf_state_dict, save_safetensors

TINY_CONFIG = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=8, num_key_value_heads=8, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
    kv_lora_rank=512, q_lora_rank=128, qk_rope_head_dim=64, v_head_dim=128, qk_nope_head_dim=128,
    n_group=2, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, hidden_act="silu",
    max_position_embeddings=163840, rms_norm_eps=1e-6, rope_theta=10000.0,
    rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                  "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    index_topk=16, index_head_dim=128, index_n_heads=64, first_k_dense_replace=1, tie_word_embeddings=False,
    bos_token_id=0, eos_token_id=1, model_type="deepseek_v32", torch_dtype="bfloat16",
)


#: (mean, std) of the random init, by parameter-name suffix (first match wins); the rest get
#: std 1/sqrt(fan_in) (unit-scale outputs: q_a, kv_a, wk, weights_proj, gate/up projections)
INIT = {
    "layernorm.weight": (1.0, 0.1), "norm.weight": (1.0, 0.1), "k_norm.bias": (0.0, 0.1),
    "embed_tokens.weight": (0.0, 1.0), "lm_head.weight": (0.0, 0.25),
    "e_score_correction_bias": (0.0, 0.05), "mlp.gate.weight": (0.0, 0.2),
    "q_b_proj.weight": (0.0, 0.05), "indexer.wq_b.weight": (0.0, 0.1), "kv_b_proj.weight": (0.0, 0.03),
    "o_proj.weight": (0.0, 0.015),
}
DOWN_GAIN = 0.25  # down projections: std DOWN_GAIN/sqrt(fan_in)


def _std(name: str, shape, init: dict) -> tuple[float, float]:
    """(mean, std) of a parameter's random init."""
    for suffix, ms in init.items():
        if name.endswith(suffix):
            return ms
    if name.endswith("down_proj") or name.endswith("down_proj.weight"):
        return 0.0, init.get("down_gain", DOWN_GAIN) / math.sqrt(shape[-1])
    return 0.0, 1.0 / math.sqrt(shape[-1])


def random_model(cfg: ModelConfig, seed: int = 0, init: dict | None = None):
    from .layers import RotaryEmbedding
    from .model import DeepseekV32ForCausalLM

    init = {**INIT, **(init or {})}
    g = torch.Generator().manual_seed(seed)
    model = DeepseekV32ForCausalLM(cfg)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("inv_freq"):
                continue
            mean, std = _std(name, t.shape, init)
            t.copy_(torch.randn(t.shape, generator=g) * std + mean)
    cast_model_(model)
    model.model.rotary_emb = RotaryEmbedding(cfg)
    return model.eval()


def tiny_config(**overrides) -> ModelConfig:
    d = dict(TINY_CONFIG)
    d.update(overrides)
    return ModelConfig.from_dict(d)


def make_tiny_model(path: str, seed: int = 0, shards: int = 2, init: dict | None = None, **overrides) -> str:
    """Write ``config.json`` and the weights of a random tiny DeepSeek-V3.2 into ``path``; returns ``path``."""
    d = dict(TINY_CONFIG)
    d.update(overrides)
    cfg = ModelConfig.from_dict(d)
    model = random_model(cfg, seed, init)
    os.makedirs(path, exist_ok=True)
    hf = dict(d)
    hf["architectures"] = ["DeepseekV32ForCausalLM"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f, indent=1)
    sd = hf_state_dict(model)
    names = list(sd)
    per = -(-len(names) // max(shards, 1))
    groups = [names[i:i + per] for i in range(0, len(names), per)]
    if len(groups) == 1:
        save_safetensors({n: sd[n] for n in names}, os.path.join(path, "model.safetensors"), {"format": "pt"})
        return path
    weight_map, total = {}, 0
    for i, grp in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_safetensors({n: sd[n] for n in grp}, os.path.join(path, fn), {"format": "pt"})
        for n in grp:
            weight_map[n] = fn
            total += sd[n].numel() * sd[n].element_size()
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return path
