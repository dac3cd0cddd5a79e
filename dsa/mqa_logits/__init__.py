"""The lightning indexer's logits (SPEC.md "Indexer"): prefill ``fp8_mqa_logits`` over
contiguous fp8 keys, decode ``fp8_paged_mqa_logits`` straight from the paged
indexer cache, and ``split_prefill_chunks`` to keep prefill logits under a memory
budget.

    logits[i, j] = sum_h weights[i, h] * relu(q[i, h] . k[j]) * k_scale[j]

fp8 products, fp32 accumulation. Row i's valid keys are ``ks[i] <= j < ke[i]``
(prefill) or ``0 <= s < limit`` (decode); with ``clean_logits=True`` every other
entry of the output is ``-inf``; with ``clean_logits=False`` those entries are
unspecified (possibly left unwritten), but valid entries are never NaN: unused
cache slots never reach the output (the Triton kernels do not read them; the
Hopper decode kernel may copy the rest of a request's last block with its tile
and replaces those positions without multiplying them).
"""
from __future__ import annotations

import torch

from .. import _replay
from .._checks import check_block_size, check_same_device, check_tensor
from ..backend import resolve
from ..constants import INDEXER_HEAD_DIM, INDEXER_ROW_BYTES
from ..layouts import indexer_cache_blocks
from .reference import fp8_mqa_logits_ref, fp8_paged_mqa_logits_ref

__all__ = [
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "split_prefill_chunks",
    "fp8_mqa_logits_ref",
    "fp8_paged_mqa_logits_ref",
    "SUPPORTED_NUM_HEADS",
    "MAX_NEXT_N_HEADS",
]

#: Query heads per token the kernels accept (the model's indexer has 64).
SUPPORTED_NUM_HEADS = (16, 32, 64, 128)
#: Decode: ``next_power_of_2(next_n) * H`` may not exceed this (next_n <= 4 for 64 heads).
MAX_NEXT_N_HEADS = 256

_FP8 = torch.float8_e4m3fn


def _check_heads(name: str, H: int) -> None:
    if H not in SUPPORTED_NUM_HEADS:
        raise ValueError(f"{name}: expected a head count in {SUPPORTED_NUM_HEADS}, got {H}")


def _check_bool(name: str, v) -> bool:
    if not isinstance(v, bool):
        raise TypeError(f"{name}: expected a bool, got {type(v).__name__}")
    return v


def _empty_logits(rows: int, cols: int, device) -> torch.Tensor:
    """``[rows, cols]`` float32 whose row stride is ``cols`` rounded up to a multiple of 4 (a view):
    every row starts 16-byte aligned, so the top-k reads it with 16-byte loads whatever ``cols`` is
    (and compiles one variant for all widths)."""
    return torch.empty(rows, (cols + 3) // 4 * 4, dtype=torch.float32, device=device)[:, :cols]


def _check_out(out, shape, device):
    if out is None:
        return None
    check_tensor("out", out, dtype=torch.float32, shape=shape)
    if out.device != device:
        raise ValueError(f"out: expected device {device} (that of q), got {out.device}")
    return out


@_replay.planned
def fp8_mqa_logits(
    q: torch.Tensor,
    kv,
    weights: torch.Tensor,
    cu_seqlen_ks: torch.Tensor,
    cu_seqlen_ke: torch.Tensor,
    clean_logits: bool = True,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Prefill indexer logits (DeepGEMM's ``fp8_mqa_logits`` signature).

    Args:
        q: ``[M, H, 128]`` float8_e4m3fn, H in ``SUPPORTED_NUM_HEADS`` (last dim contiguous).
        kv: ``(k [N, 128] float8_e4m3fn, k_scale [N] float32)`` (``[N, 1]`` scales accepted).
        weights: ``[M, H]`` float32 (the q scale and softmax factors already folded in).
        cu_seqlen_ks, cu_seqlen_ke: ``[M]`` int32, row i's key range ``[ks[i], ke[i])``
            (clamped to ``[0, N)``; an empty range gives an all ``-inf`` row).
        clean_logits: write ``-inf`` outside each row's range (else those entries are unspecified).
        out: optional ``[M, N]`` float32 to write into (last dim contiguous).
        backend: ``None | "auto" | "triton" | "reference"`` (see ``dsa.backend``).

    Returns:
        ``[M, N]`` float32 logits (allocated here: a view with the row stride padded to a multiple of
        4, i.e. 16-byte aligned rows). No host-device synchronisation; CUDA-graph safe.
        The kernel skips key tiles outside ``[min ks, max ke)`` of each group of rows, so the cost
        follows the ranges, but the output is always ``[M, N]``: use :func:`split_prefill_chunks`
        to bound its memory.
    """
    check_tensor("q", q, dtype=_FP8, ndim=3)
    M, H, D = q.shape
    if D != INDEXER_HEAD_DIM:
        raise ValueError(f"q: expected head dim {INDEXER_HEAD_DIM}, got shape {list(q.shape)}")
    _check_heads("q", H)
    if not isinstance(kv, (tuple, list)) or len(kv) != 2:
        raise TypeError(f"kv: expected a (k, k_scale) pair, got {type(kv).__name__}")
    k, k_scale = kv
    check_tensor("kv[0] (k)", k, dtype=_FP8, shape=[None, INDEXER_HEAD_DIM])
    N = k.shape[0]
    check_tensor("kv[1] (k_scale)", k_scale, dtype=torch.float32, ndim=(1, 2))
    if list(k_scale.shape) not in ([N], [N, 1]):
        raise ValueError(f"kv[1] (k_scale): expected shape [{N}] or [{N}, 1], got {list(k_scale.shape)}")
    check_tensor("weights", weights, dtype=torch.float32, shape=[M, H])
    check_tensor("cu_seqlen_ks", cu_seqlen_ks, dtype=torch.int32, shape=[M])
    check_tensor("cu_seqlen_ke", cu_seqlen_ke, dtype=torch.int32, shape=[M])
    _check_bool("clean_logits", clean_logits)
    device = check_same_device(q=q, k=k, k_scale=k_scale, weights=weights, cu_seqlen_ks=cu_seqlen_ks,
                               cu_seqlen_ke=cu_seqlen_ke)
    _check_out(out, [M, N], device)
    k_scale = k_scale.reshape(N)  # a view

    if resolve(backend, device) == "reference":
        ref = fp8_mqa_logits_ref(q, (k, k_scale), weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits)
        return ref if out is None else out.copy_(ref)
    from .kernel import fp8_mqa_logits_triton

    if out is None:
        out = _empty_logits(M, N, device)
    return fp8_mqa_logits_triton(q, k, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, out)


@_replay.planned
def fp8_paged_mqa_logits(
    q: torch.Tensor,
    cache: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_context_len: int,
    clean_logits: bool = True,
    *,
    out: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Decode indexer logits read straight from the paged indexer cache, in ONE kernel launch.

    Args:
        q: ``[B, next_n, H, 128]`` float8_e4m3fn (last dim contiguous); ``next_power_of_2(next_n) * H``
            at most ``MAX_NEXT_N_HEADS`` (next_n 1..4 for 64 heads).
        cache: the indexer K cache, ``[num_blocks, block_size*132]`` uint8 (or ``[nb, bs, 132]`` /
            ``[nb, bs, 1, 132]``), block size a power of two from 1 to 256.
        weights: ``[B*next_n, H]`` float32.
        context_lens: ``[B]`` int32 (row ``b*next_n + j`` sees keys ``s < L_b - next_n + j + 1``) or
            ``[B, next_n]`` int32 (row sees ``s < context_lens[b, j]``).
        block_table: ``[B, max_blocks]`` int32; position s of request b lives in block
            ``block_table[b, s // block_size]`` at offset ``s % block_size``.
        max_context_len: the output width (a Python int, normally ``max(context_lens)``; not
            checked against ``context_lens``, which would need a host sync: keys at or past it are
            not computed).
        clean_logits: write ``-inf`` outside each row's range (else those entries are unspecified).
        out: optional ``[B*next_n, max_context_len]`` float32 to write into.
        backend: ``None | "auto" | "triton" | "reference"``.

    Returns:
        ``[B*next_n, max_context_len]`` float32 (allocated here: row stride padded to a multiple of 4).
        No host-device synchronisation; CUDA-graph safe.
        Cache slots beyond a request's context never reach the output (they may hold NaN). A block-table entry
        outside ``[0, num_blocks)`` that a row needs is invalid input: the kernel reads nothing for it.
    """
    check_tensor("q", q, dtype=_FP8, ndim=4)
    B, next_n, H, D = q.shape
    if D != INDEXER_HEAD_DIM:
        raise ValueError(f"q: expected head dim {INDEXER_HEAD_DIM}, got shape {list(q.shape)}")
    _check_heads("q", H)
    if next_n < 1 or (1 << (next_n - 1).bit_length()) * H > MAX_NEXT_N_HEADS:
        raise ValueError(f"q: expected next_n >= 1 with next_power_of_2(next_n) * H <= {MAX_NEXT_N_HEADS}, "
                         f"got next_n={next_n}, H={H}")
    blocks = indexer_cache_blocks(cache)
    block_size = blocks.shape[1] // INDEXER_ROW_BYTES
    check_block_size("cache (block size)", block_size)
    check_tensor("weights", weights, dtype=torch.float32, shape=[B * next_n, H])
    check_tensor("context_lens", context_lens, dtype=torch.int32, ndim=(1, 2))
    if list(context_lens.shape) not in ([B], [B, next_n]):
        raise ValueError(f"context_lens: expected shape [{B}] or [{B}, {next_n}], got {list(context_lens.shape)}")
    check_tensor("block_table", block_table, dtype=torch.int32, shape=[B, None])
    if isinstance(max_context_len, bool) or not isinstance(max_context_len, int) or max_context_len < 0:
        raise ValueError(f"max_context_len: expected a non-negative int, got {max_context_len!r}")
    _check_bool("clean_logits", clean_logits)
    device = check_same_device(q=q, cache=cache, weights=weights, context_lens=context_lens, block_table=block_table)
    _check_out(out, [B * next_n, max_context_len], device)

    if resolve(backend, device) == "reference":
        ref = fp8_paged_mqa_logits_ref(q, blocks, weights, context_lens, block_table, max_context_len, clean_logits)
        return ref if out is None else out.copy_(ref)
    from .kernel import fp8_paged_mqa_logits_triton

    if out is None:
        out = _empty_logits(B * next_n, max_context_len, device)
    return fp8_paged_mqa_logits_triton(q, blocks, weights, context_lens, block_table, max_context_len,
                                       clean_logits, out)


def split_prefill_chunks(cu_seqlen_ks, cu_seqlen_ke, num_keys: int, max_logits_bytes: int = 512 << 20):
    """Split the prefill query rows into chunks whose fp32 logits fit in ``max_logits_bytes``.

    Reads ``cu_seqlen_ks`` / ``cu_seqlen_ke`` ([M] int tensors or sequences) **on the host**: with
    CUDA tensors this is a device-to-host copy and a synchronisation; call it once per step while
    building metadata, not inside a captured graph.

    Returns a list of ``(start, end, key_start, key_end)``: rows ``[start, end)`` (consecutive, covering
    every row exactly once) need only keys ``[key_start, key_end)`` (the union of their clamped ranges),
    and ``(end - start) * (key_end - key_start) * 4 <= max_logits_bytes``. Use each chunk as::

        logits = fp8_mqa_logits(q[start:end], (k[key_start:key_end], k_scale[key_start:key_end]),
                                weights[start:end], ks[start:end] - key_start, ke[start:end] - key_start)

    Logit ``[i, j]`` of a chunk is the key ``key_start + j`` of row ``start + i``. Rows with empty
    ranges add no keys. Raises ``ValueError`` if one row alone needs more than the budget.
    """
    if isinstance(num_keys, bool) or not isinstance(num_keys, int) or num_keys < 0:
        raise ValueError(f"num_keys: expected a non-negative int, got {num_keys!r}")
    if isinstance(max_logits_bytes, bool) or not isinstance(max_logits_bytes, int) or max_logits_bytes < 4:
        raise ValueError(f"max_logits_bytes: expected an int >= 4, got {max_logits_bytes!r}")
    ks = cu_seqlen_ks.tolist() if isinstance(cu_seqlen_ks, torch.Tensor) else list(cu_seqlen_ks)
    ke = cu_seqlen_ke.tolist() if isinstance(cu_seqlen_ke, torch.Tensor) else list(cu_seqlen_ke)
    if len(ks) != len(ke):
        raise ValueError(f"cu_seqlen_ke: expected {len(ks)} entries (as cu_seqlen_ks), got {len(ke)}")
    budget = max_logits_bytes // 4  # fp32 entries
    chunks = []
    start, lo, hi = 0, None, None
    for i, (a, b) in enumerate(zip(ks, ke)):
        a, b = max(0, min(int(a), num_keys)), max(0, min(int(b), num_keys))
        if b - a > budget:
            raise ValueError(f"max_logits_bytes: row {i} alone needs {(b - a) * 4} bytes, budget is {max_logits_bytes}")
        nlo, nhi = lo, hi
        if a < b:
            nlo, nhi = (a, b) if lo is None else (min(lo, a), max(hi, b))
        span = 0 if nlo is None else nhi - nlo
        if i > start and (i + 1 - start) * span > budget:
            chunks.append((start, i, *((lo, hi) if lo is not None else (0, 0))))
            start, (lo, hi) = i, ((a, b) if a < b else (None, None))
        else:
            lo, hi = nlo, nhi
    if start < len(ks):
        chunks.append((start, len(ks), *((lo, hi) if lo is not None else (0, 0))))
    return chunks
