"""DeepSeek-V3.2 on ``dsa``: the DSA attention layers, the per-step metadata builder, the model,
a Hugging Face checkpoint loader, batched generation and a tiny random checkpoint writer.

    from dsa.model import load_model, generate
    model = load_model("path/to/DeepSeek-V3.2", "cuda")            # config.json + *.safetensors
    outs = generate(model, [[1, 2, 3], [4, 5]], max_new_tokens=32)  # greedy by default
"""
from .config import ModelConfig
from .generate import generate, prefill_logits
from .layers import Indexer, MLAAttention, RotaryEmbedding
from .loader import load_model
from .metadata import RequestSpec, StepMetadata, build_step_metadata
from .model import DeepseekV32ForCausalLM, PagedKVCache
from .tiny import make_tiny_model

__all__ = [
    "ModelConfig", "DeepseekV32ForCausalLM", "PagedKVCache", "Indexer", "MLAAttention", "RotaryEmbedding",
    "RequestSpec", "StepMetadata", "build_step_metadata", "load_model", "generate", "prefill_logits",
    "make_tiny_model",
]
