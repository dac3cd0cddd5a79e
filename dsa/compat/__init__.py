"""Drop-in forms of the vendor calls that DSA code is written against, running on dsa's kernels.

* :mod:`dsa.compat.flash_mla`: FlashMLA's sparse attention, ``flash_mla_sparse_fwd`` (prefill) and
  ``flash_mla_with_kvcache`` with ``indices`` (decode), with ``get_mla_metadata``.
* :mod:`dsa.compat.deep_gemm`: DeepGEMM's indexer logits, ``fp8_mqa_logits`` (with its compressed
  ``max_seqlen_k`` form) and ``fp8_paged_mqa_logits``, with ``get_paged_mqa_logits_metadata`` and ``get_num_sms``.

Each function has the vendor's name, argument order, tensor shapes and return convention, so that an engine's
call site changes only its import, e.g. ``from dsa.compat import flash_mla`` in place of ``import flash_mla``.
What each one does not take (e.g. FlashMLA's dense decode) raises ``ValueError`` naming the argument, before any
launch. The meaning of every result is that of the public op it calls (``dsa.sparse_mla``,
``dsa.fp8_mqa_logits``, ``dsa.fp8_paged_mqa_logits``; SPEC.md), and so is the choice of kernel or reference
(``DSA_BACKEND``, or the keyword-only ``backend``).
"""
from . import deep_gemm, flash_mla

__all__ = ["deep_gemm", "flash_mla"]
