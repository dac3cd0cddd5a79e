"""dsa: DeepSeek Sparse Attention (lightning indexer -> top-k -> sparse MLA) in portable Triton.

Every public op takes and returns torch tensors and a keyword ``backend``
(``None``/"auto", "triton", "reference"; see :mod:`dsa.backend`). Each op family
lives in its own folder with its Triton kernel (``kernel.py``) beside its PyTorch
reference (``reference.py``).
"""
from .backend import interpreter_on as _interpreter_on

if _interpreter_on():  # fix Triton's CPU interpreter before any kernel is defined
    from ._interpreter import patch_interpreter as _patch

    _patch()

from .indexer_cache import gather_indexer_k, indexer_k_quant, indexer_k_quant_and_cache  # noqa: E402
from .indexer_prep import hadamard_128, prepare_indexer_k, prepare_indexer_q  # noqa: E402
from .metadata import convert_req_index_to_global_index, generate_sparse_seqlen  # noqa: E402
from .mla_cache import concat_and_cache_mla, dequantize_fp8_ds_mla, quantize_fp8_ds_mla  # noqa: E402
from .mqa_logits import fp8_mqa_logits, fp8_paged_mqa_logits, split_prefill_chunks  # noqa: E402
from .mla import sparse_mla  # noqa: E402
from .topk import top_k_indices  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "concat_and_cache_mla",
    "convert_req_index_to_global_index",
    "dequantize_fp8_ds_mla",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "gather_indexer_k",
    "generate_sparse_seqlen",
    "hadamard_128",
    "indexer_k_quant",
    "indexer_k_quant_and_cache",
    "prepare_indexer_k",
    "prepare_indexer_q",
    "quantize_fp8_ds_mla",
    "sparse_mla",
    "split_prefill_chunks",
    "top_k_indices",
]
