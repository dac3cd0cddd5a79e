"""The per-step metadata builder: run once per forward step, shared by every layer.

All host-side arithmetic of a step happens here, on Python integers, before the
forward: the layers only slice by the integers stored in :class:`StepMetadata`
and pass its device tensors to the ops, so no layer synchronises with the host.

Layout of a step (vLLM's convention):

* requests are reordered **decodes first**: a request is a decode when it brings exactly
  ``next_n`` new tokens (1 normally; more with multi-token prediction); its tokens are
  the first ``num_decode_tokens`` rows of the step, ``next_n`` per request;
* the prefill (and chunked-prefill) requests follow, each with any number of new tokens
  on top of ``num_computed`` cached ones.

For the indexer:

* decodes read their keys straight from the paged cache (``fp8_paged_mqa_logits``) with
  ``decode_context_lens`` (the full length ``L_b`` of each decode request after this step:
  row ``b·next_n + j`` sees positions ``< L_b - next_n + j + 1``), into logits
  ``max_decode_context_len`` wide: the longest ``L_b`` rounded up to whole blocks, so that
  the ops' arguments keep one shape for a block's worth of decode steps and their eager calls
  replay (:mod:`dsa._replay`; the columns past a row's length are ``-inf``, never selected);
* prefills gather the keys of all prefill requests once (``gather_indexer_k`` with
  ``prefill_cu_seq_lens``); token ``i`` of prefill request ``p`` (position ``pos``) scores
  keys ``[ks, ke) = [cu[p], cu[p] + pos + 1)`` of that gathered array; the rows are split
  into chunks (:func:`dsa.mqa_logits.split_prefill_chunks`) whose fp32 logits
  ``rows × keys × 4`` bytes stay under ``max_logits_bytes``.

For the attention: per-token request id (row of ``block_table``), ``slot_mapping``
(where each new token's key goes), and the sparse sequence length of each token
(``min(visible keys, index_topk)``, from :func:`dsa.metadata.generate_sparse_seqlen`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from .._checks import check_block_size


@dataclass
class RequestSpec:
    """One request of a step: ``num_computed`` tokens already cached, ``num_new`` tokens now,
    ``block_ids`` its physical blocks (enough for ``num_computed + num_new`` tokens)."""

    num_computed: int
    num_new: int
    block_ids: Sequence[int]


@dataclass
class PrefillChunk:
    start: int  # prefill rows [start, end) (add num_decode_tokens for step rows)
    end: int
    key_start: int  # keys [key_start, key_end) of the gathered prefill keys
    key_end: int
    ks: torch.Tensor  # [end - start] int32, relative to key_start
    ke: torch.Tensor


@dataclass
class StepMetadata:
    block_size: int
    index_topk: int
    next_n: int
    order: list  # caller's request indices in step order (decodes first)
    num_reqs: int
    num_tokens: int
    num_decodes: int
    num_decode_tokens: int
    num_prefills: int
    num_prefill_tokens: int
    # per request, step order
    query_start_loc: torch.Tensor  # [R+1] int32
    seq_lens: torch.Tensor  # [R] int32 (cached + new)
    block_table: torch.Tensor  # [R, max_blocks] int32, -1 padded
    last_token_index: torch.Tensor  # [R] int64: row of each request's last token
    # per token
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64
    req_id: torch.Tensor  # [T] int32
    sparse_seqlens: torch.Tensor  # [T] int32
    # decode
    decode_context_lens: torch.Tensor  # [B] int32
    decode_block_table: torch.Tensor  # [B, max_blocks] int32
    max_decode_context_len: int  # the longest decode context rounded up to whole blocks
    # prefill
    prefill_cu_seq_lens: torch.Tensor  # [P+1] int32
    prefill_block_table: torch.Tensor  # [P, max_blocks] int32
    num_prefill_keys: int
    prefill_chunks: list = field(default_factory=list)
    #: the bf16 indexer's slot lists (:func:`indexer_slots`), set by the model's forward for its layers
    indexer_slots: IndexerSlots | None = None


@dataclass
class IndexerSlots:
    """The bf16 indexer's slot lists of a step (:func:`indexer_slots`), over its side cache ``[num_slots + 1, 128]``
    whose last row (``num_slots``, the dump row) absorbs what no slot holds."""

    slot_mapping: torch.Tensor  # [T] int64: where each new token's key goes (negatives -> num_slots)
    decode_keys: torch.Tensor  # [B, max_decode_context_len] int64: each decode request's keys by position
    prefill_keys: torch.Tensor  # [num_prefill_keys] int64: the prefill requests' keys, request after request


def indexer_slots(md: StepMetadata, num_slots: int) -> IndexerSlots:
    """The bf16 indexer's slot lists, computed on ``md``'s device from its block table and lengths (torch ops only:
    no host work in the step's size, no synchronisation, capturable in a CUDA graph). Position ``p`` of a request
    with block row ``bt`` is slot ``bt[p // block_size] * block_size + p % block_size``; positions at or past a
    decode request's length (and the unwritten columns up to ``max_decode_context_len``) give ``num_slots``."""
    bs = md.block_size
    dev = md.slot_mapping.device
    sm = torch.where(md.slot_mapping >= 0, md.slot_mapping, num_slots)
    L = md.max_decode_context_len
    bt = md.decode_block_table[:, : L // bs].long()
    p = torch.arange(L, dtype=torch.int64, device=dev)
    dk = bt[:, p // bs] * bs + p % bs
    dk = torch.where((p[None, :] < md.decode_context_lens[:, None].long()) & (dk >= 0), dk, num_slots)
    n, nb = md.num_prefill_keys, md.num_decodes
    pk = torch.zeros(0, dtype=torch.int64, device=dev)
    if n:
        P = md.num_prefills
        req = torch.repeat_interleave(torch.arange(P, device=dev), md.seq_lens[nb:].long(), output_size=n)
        pos = torch.arange(n, dtype=torch.int64, device=dev) - md.prefill_cu_seq_lens[:-1].long()[req]
        pk = md.prefill_block_table.long()[req, pos // bs] * bs + pos % bs
    return IndexerSlots(sm, dk, pk)


def build_step_metadata(
    requests: Sequence[RequestSpec],
    *,
    block_size: int,
    index_topk: int,
    device: torch.device | str = "cpu",
    next_n: int = 1,
    max_logits_bytes: int = 512 << 20,
    backend: str | None = None,
) -> StepMetadata:
    """Build the metadata of one forward step (see the module docstring).

    Args:
        requests: the step's requests in the caller's order (:class:`RequestSpec`).
        block_size: tokens per cache block (both caches).
        index_topk: the indexer's top-k width.
        device: where the tensors go.
        next_n: new tokens of a decode request (MTP; 1 without it).
        max_logits_bytes: budget of one prefill chunk's fp32 indexer logits.
        backend: for the ops called here (``generate_sparse_seqlen``).

    Host work only (Python lists), then one copy of each tensor to ``device``.
    """
    from ..metadata import generate_sparse_seqlen
    from ..mqa_logits import split_prefill_chunks

    check_block_size("block_size", block_size)
    if isinstance(next_n, bool) or not isinstance(next_n, int) or next_n < 1:
        raise ValueError(f"next_n: expected a positive int, got {next_n!r}")
    if isinstance(index_topk, bool) or not isinstance(index_topk, int) or index_topk < 1:
        raise ValueError(f"index_topk: expected a positive int, got {index_topk!r}")
    if not requests:
        raise ValueError("requests: expected at least one request, got none")
    for i, r in enumerate(requests):
        if r.num_new < 1 or r.num_computed < 0:
            raise ValueError(f"requests[{i}]: expected num_new >= 1 and num_computed >= 0, got "
                             f"num_new={r.num_new}, num_computed={r.num_computed}")
        need = -(-(r.num_computed + r.num_new) // block_size)
        if len(r.block_ids) < need:
            raise ValueError(f"requests[{i}].block_ids: expected at least {need} blocks for "
                             f"{r.num_computed + r.num_new} tokens, got {len(r.block_ids)}")
    device = torch.device(device)

    order = [i for i, r in enumerate(requests) if r.num_new == next_n]
    nb = len(order)
    order += [i for i, r in enumerate(requests) if r.num_new != next_n]
    reqs = [requests[i] for i in order]
    R = len(reqs)
    max_blocks = max(1, max(len(r.block_ids) for r in reqs))

    qsl, seq_lens, positions, slots, req_id = [0], [], [], [], []
    bt = [[-1] * max_blocks for _ in range(R)]
    for j, r in enumerate(reqs):
        bt[j][: len(r.block_ids)] = list(r.block_ids)
        L = r.num_computed + r.num_new
        seq_lens.append(L)
        qsl.append(qsl[-1] + r.num_new)
        for p in range(r.num_computed, L):
            positions.append(p)
            slots.append(r.block_ids[p // block_size] * block_size + p % block_size)
            req_id.append(j)
    T = qsl[-1]
    nd = qsl[nb]

    # prefill ranges over the gathered keys of all prefill requests
    cu, ks, ke = [0], [], []
    for j in range(nb, R):
        r = reqs[j]
        base = cu[-1]
        for p in range(r.num_computed, r.num_computed + r.num_new):
            ks.append(base)
            ke.append(base + p + 1)
        cu.append(base + seq_lens[j])
    n_keys = cu[-1]
    chunks_host = split_prefill_chunks(ks, ke, n_keys, max_logits_bytes) if ks else []

    i32 = dict(dtype=torch.int32, device=device)
    i64 = dict(dtype=torch.int64, device=device)
    block_table = torch.tensor(bt, **i32)
    query_start_loc = torch.tensor(qsl, **i32)
    seq_lens_t = torch.tensor(seq_lens, **i32)
    chunks = [
        PrefillChunk(s, e, k0, k1, torch.tensor([v - k0 for v in ks[s:e]], **i32),
                     torch.tensor([v - k0 for v in ke[s:e]], **i32))
        for (s, e, k0, k1) in chunks_host
    ]
    md = StepMetadata(
        block_size=block_size, index_topk=index_topk, next_n=next_n, order=order, num_reqs=R, num_tokens=T,
        num_decodes=nb, num_decode_tokens=nd, num_prefills=R - nb, num_prefill_tokens=T - nd,
        query_start_loc=query_start_loc, seq_lens=seq_lens_t, block_table=block_table,
        last_token_index=torch.tensor([q - 1 for q in qsl[1:]], **i64),
        positions=torch.tensor(positions, **i64), slot_mapping=torch.tensor(slots, **i64),
        req_id=torch.tensor(req_id, **i32),
        sparse_seqlens=generate_sparse_seqlen(query_start_loc, seq_lens_t, index_topk, num_tokens=T, backend=backend),
        decode_context_lens=seq_lens_t[:nb], decode_block_table=block_table[:nb],
        max_decode_context_len=-(-max(seq_lens[:nb], default=0) // block_size) * block_size,
        prefill_cu_seq_lens=torch.tensor(cu, **i32), prefill_block_table=block_table[nb:],
        num_prefill_keys=n_keys, prefill_chunks=chunks,
    )
    return md
