"""Decode steps as CUDA graphs: captured once per batch-size bucket (all of them when the engine starts), then
replayed.

A pure-decode step of ``B`` requests runs as the graph of the smallest bucket ``>= B``; the
``bucket - B`` padding rows are decodes of context 1 whose only key lives in a scratch block
that no request owns (the block manager keeps it out of circulation), so they can never touch
a request's cache. Every shape inside the graph is fixed per bucket:

* the block tables are padded to ``max_blocks = ceil(max_model_len / block_size)`` columns;
* the decode indexer logits are ``max_blocks * block_size`` wide (``max_decode_context_len`` is
  fixed; each row is limited by its device-side context length);
* the step metadata lives in static tensors that each replay overwrites: views of one packed int32 and one int64
  buffer, written by two host-to-device copies (the values of :func:`~dsa.model.build_step_metadata` on the padded
  step, built here directly, and the step's token ids); with the bf16 indexer the graph derives its slot lists from
  them on the device (:func:`~dsa.model.metadata.indexer_slots`).

A graph also takes each row's token from the device, and picks the next tokens on it: a row
whose ``src`` field is ``>= 0`` reads its id from row ``src`` of :attr:`DecodeGraphRunner.last_tok` (the tokens the
previous graph step picked, never read back by the host in between), and every replay ends by writing there the
tokens :func:`~dsa.sampling.sample_tokens` picks from its logits (greedy, or sampled with each row's ``seed``
field). :meth:`DecodeGraphRunner.fetch_tokens` copies them to the host without waiting for them, so that the engine
can prepare the next step while the GPU runs this one (:class:`~dsa.engine.Engine`, ``async_decode``).

MoE layers run :func:`static_experts_forward` inside the graph (the eager expert loop syncs).

``capture=False`` runs the very same padded, fixed-shape step eagerly: this is how the CPU tests
check the padding, the static metadata and the static MoE.
"""
from __future__ import annotations

import numpy as np
import torch

from ..model.metadata import StepMetadata
from ..sampling import sample_tokens


def default_buckets(max_num_seqs: int) -> list:
    out, b = [], 1
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    out.append(max_num_seqs)
    return sorted(set(out))


def graph_unsupported_reason(model) -> str | None:
    """Why the model's decode forward cannot be captured, or None (MoE layers are captured with
    :func:`static_experts_forward` in place of their host-synchronising expert loop)."""
    return None


def static_experts_forward(experts, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The routed experts of :class:`dsa.model.model.Experts` without a host sync (capturable).

    The eager forward loops on the host over the experts in use (``torch.unique(...).tolist()``).
    Here each token's ``top_k`` slots are sorted by expert id and, slot by slot, every token's
    expert matrices are gathered (``[T, 2I, H]``) and applied as batched mat-vecs; the results are
    added into the bf16 output in ascending expert order, each rounded as the eager path rounds
    (bf16 projections, fp32 routing weight, bf16 accumulation). Only the fp32 summation order
    inside a projection differs from the eager GEMM. Memory: ``T`` expert matrices per slot, so
    meant for decode batches.
    """
    import torch.nn.functional as F

    order = idx.argsort(dim=1)
    idx_s, w_s = idx.gather(1, order), w.gather(1, order)
    out = torch.zeros_like(x)
    for k in range(idx.shape[1]):
        e = idx_s[:, k]
        gate, up = torch.bmm(experts.gate_up_proj[e], x[:, :, None])[..., 0].chunk(2, dim=-1)
        y = torch.bmm(experts.down_proj[e], (F.silu(gate) * up)[:, :, None])[..., 0] * w_s[:, k, None]
        out += y.to(out.dtype)
    return out


class _StaticExperts:
    """Swap every MoE layer's expert loop for :func:`static_experts_forward` while entered."""

    def __init__(self, model):
        self.experts = [layer.mlp.experts for layer in model.model.layers if hasattr(layer.mlp, "experts")]

    def __enter__(self):
        import types

        for ex in self.experts:
            ex.forward = types.MethodType(static_experts_forward, ex)
        return self

    def __exit__(self, *exc):
        for ex in self.experts:
            del ex.forward  # back to the class's forward
        return False


class DecodeGraphRunner:
    def __init__(self, model, cache, *, max_model_len: int, buckets: list, pad_block: int, capture: bool = True,
                 max_logits_bytes: int = 512 << 20, temperature: float = 0.0, top_p: float = 1.0):
        self.model, self.cache = model, cache
        self.bs = cache.block_size
        self.max_blocks = -(-max_model_len // self.bs)
        self.max_ctx = self.max_blocks * self.bs
        self.buckets = sorted(buckets)
        self.pad_block = pad_block
        self.capture = capture
        self.max_logits_bytes = max_logits_bytes
        #: how each replay picks the tokens it leaves in :attr:`last_tok` (fixed when captured):
        #: greedy at ``temperature <= 0``, else sampled with each row's seed (:func:`sample_tokens`)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self.device = model.lm_head.weight.device
        self._graphs: dict = {}  # bucket -> (graph or None, static ids, static md, static logits)
        self._host: dict = {}  # bucket -> (host int32, host int64, device int32, device int64) packed metadata
        self._copied: dict = {}  # bucket -> CUDA event after the last host-to-device copy of the packed metadata
        self._pool = None
        #: the tokens the last graph step picked, rows as its batch: the next step's ``src`` reads them
        self.last_tok = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        pin = self.device.type == "cuda"
        self._tok_host = [torch.zeros(self.max_batch, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._tok_events = [torch.cuda.Event() if pin else None for _ in range(2)]
        self._tok_flip = 0
        self.num_captures = 0
        self.num_replays = 0
        self.num_padded_steps = 0  # steps whose batch was padded up to its bucket

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, n: int) -> int:
        for b in self.buckets:
            if b >= n:
                return b
        raise ValueError(f"decode batch {n} exceeds the largest bucket {self.buckets[-1]}")

    # -- the static metadata in two packed buffers -------------------------------------------------
    @staticmethod
    def _packed_layout(B: int, MB: int) -> tuple:
        """(int32 field sizes, their offsets, int32 total, int64 field size, its offsets, int64 total) of the
        packed buffers of a bucket of ``B`` decodes: int32 [qsl B+1, seq_lens B, block table B x MB, req_id B,
        sparse_seqlens B, prefill cu 1], int64 [last_token_index B, positions B, slot_mapping B, token ids B,
        src B, seed B] (``src``: the row of :attr:`last_tok` a row takes its token id from, or -1; ``seed``: the
        seed its next token is sampled with).
        Every field starts on a 16-byte boundary: Triton specialises kernels on pointer alignment, so aligned fields
        keep every bucket on the same compiled variants."""
        def place(sizes, per16):
            offs, o = [], 0
            for n in sizes:
                offs.append(o)
                o += -(-n // per16) * per16
            return offs, o

        n32 = [B + 1, B, B * MB, B, B, 1]
        o32, t32 = place(n32, 4)
        o64, t64 = place([B] * 6, 2)
        return n32, o32, t32, B, o64, t64

    def _packed(self, bucket: int) -> tuple:
        """A static :class:`StepMetadata` of ``bucket`` decodes whose tensors are views of one int32
        and one int64 device buffer (refreshed by two host-to-device copies per step), and the step's
        token ids, their ``src`` rows (:attr:`last_tok`) and the rows' sampling seeds, views of the int64 buffer
        too."""
        B, MB, dev = bucket, self.max_blocks, self.device
        n32, o32, t32, n64, o64, t64 = self._packed_layout(B, MB)
        i32 = torch.zeros(t32, dtype=torch.int32, device=dev)
        i64 = torch.zeros(t64, dtype=torch.int64, device=dev)
        qsl, seq, bt, req, sps, pcu = (i32[o:o + n] for o, n in zip(o32, n32))
        bt = bt.view(B, MB)
        last, pos, slots, ids, src, seeds = (i64[o:o + n64] for o in o64)
        m = self.model
        md = StepMetadata(
            block_size=self.bs, index_topk=m.config.index_topk, next_n=1, order=list(range(B)), num_reqs=B,
            num_tokens=B, num_decodes=B, num_decode_tokens=B, num_prefills=0, num_prefill_tokens=0,
            query_start_loc=qsl, seq_lens=seq, block_table=bt, last_token_index=last, positions=pos,
            slot_mapping=slots, req_id=req, sparse_seqlens=sps, decode_context_lens=seq, decode_block_table=bt,
            max_decode_context_len=self.max_ctx, prefill_cu_seq_lens=pcu, prefill_block_table=bt[B:],
            num_prefill_keys=0, prefill_chunks=[])
        pin = dev.type == "cuda"
        h32 = torch.zeros(t32, dtype=torch.int32, pin_memory=pin)
        h64 = torch.zeros(t64, dtype=torch.int64, pin_memory=pin)
        a32, a64 = h32.numpy(), h64.numpy()
        a32[o32[0]:o32[0] + B + 1] = np.arange(B + 1)  # query starts (the prefill start, the last field, stays 0)
        a32[o32[3]:o32[3] + B] = np.arange(B)  # request ids
        a64[o64[0]:o64[0] + B] = np.arange(B)  # last-token rows
        self._host[B] = (h32, h64, i32, i64)
        return md, ids, src, seeds

    def _fill_packed(self, specs: list, bucket: int, token_ids=(), src=(), seeds=()) -> None:
        """Write the padded decode metadata of ``specs``, their ``token_ids``, ``src`` rows (default: none, -1) and
        sampling ``seeds`` (default: 0) into the packed buffers of ``bucket`` (the same values as
        :func:`build_step_metadata` on the padded specs, see the tests). The fields that never change (query starts,
        request ids, last-token rows) were written with the buffers; the rest are written in place through numpy
        views of the pinned host buffers."""
        h32, h64, i32, i64 = self._host[bucket]
        B, MB, bs, K = bucket, self.max_blocks, self.bs, self.model.config.index_topk
        _, o32, _, _, o64, _ = self._packed_layout(B, MB)
        a32, a64 = h32.numpy(), h64.numpy()
        lens = [sp.num_computed + sp.num_new for sp in specs]
        slots = []
        for sp, L in zip(specs, lens):
            b = sp.block_ids
            if len(b) > MB:
                raise ValueError(f"DecodeGraphRunner: a request holds {len(b)} blocks, the graphs were built for "
                                 f"{MB} (max_model_len)")
            slots.append(b[(L - 1) // bs] * bs + (L - 1) % bs)
        pad = B - len(specs)
        lens += [1] * pad
        slots += [self.pad_block * bs] * pad
        evt = self._copied.get(bucket)
        if evt is not None:
            evt.synchronize()  # the previous copy out of the host buffers is done (normally long ago)
        L = np.asarray(lens, dtype=np.int64)
        a32[o32[1]:o32[1] + B] = L
        bt = a32[o32[2]:o32[2] + B * MB].reshape(B, MB)
        bt.fill(-1)
        for j, sp in enumerate(specs):
            bt[j, :len(sp.block_ids)] = sp.block_ids
        bt[len(specs):, 0] = self.pad_block
        a32[o32[4]:o32[4] + B] = np.minimum(L, K)
        a64[o64[1]:o64[1] + B] = L - 1
        a64[o64[2]:o64[2] + B] = slots
        ids = a64[o64[3]:o64[3] + B]
        ids[:len(token_ids)] = token_ids
        ids[len(token_ids):] = 0
        rows = a64[o64[4]:o64[4] + B]
        rows[:len(src)] = src
        rows[len(src):] = -1
        sd = a64[o64[5]:o64[5] + B]
        sd[:len(seeds)] = seeds
        sd[len(seeds):] = 0
        i32.copy_(h32, non_blocking=True)
        i64.copy_(h64, non_blocking=True)
        if self.device.type == "cuda":
            evt = self._copied.setdefault(bucket, torch.cuda.Event())
            evt.record()

    def _forward(self, ids, md, src, seeds):
        """The step (captured once per bucket): the ids of rows with ``src >= 0`` from :attr:`last_tok` first, and
        the picked tokens (``seeds``: each row's) into :attr:`last_tok` last."""
        ids = torch.where(src >= 0, self.last_tok[src.clamp(min=0)], ids)
        with _StaticExperts(self.model):
            hidden = self.model(ids, md, self.cache)
        logits = self.model.logits(hidden[md.last_token_index])
        sample_tokens(logits, seeds, self.temperature, self.top_p, out=self.last_tok[:logits.shape[0]],
                      backend=self.model.backend)
        return logits

    def _get(self, bucket: int):
        if bucket in self._graphs:
            return self._graphs[bucket]
        md, ids, src, seeds = self._packed(bucket)
        self._fill_packed([], bucket)  # all rows: padding (touch the scratch block only)
        graph, logits = None, None
        if self.capture:
            s = torch.cuda.Stream(self.device)
            s.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(s):
                for _ in range(2):  # compile / warm up every kernel outside the capture
                    self._forward(ids, md, src, seeds)
            torch.cuda.current_stream(self.device).wait_stream(s)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            with torch.cuda.graph(graph, pool=self._pool):
                logits = self._forward(ids, md, src, seeds)
            self.num_captures += 1
        self._graphs[bucket] = (graph, ids, md, logits, src, seeds)
        return self._graphs[bucket]

    def set_sampling(self, temperature: float, top_p: float = 1.0) -> None:
        """Pick later steps' tokens greedily (``temperature <= 0``) or sampled with ``temperature`` / ``top_p``. The
        captured graphs hold the old choice: they are dropped with their memory pool (a pool whose graphs are all
        gone cannot take a new capture) and each bucket is captured again on its next step."""
        if self._graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # (no replay still running on what is freed)
        self.temperature, self.top_p = float(temperature), float(top_p)
        self._graphs.clear()
        self._pool = None

    def capture_all(self) -> None:
        """Capture every bucket's graph now (as an engine does when it starts), so that no step pays for a capture."""
        for b in self.buckets:
            self._get(b)

    # -- a step ---------------------------------------------------------------------
    @torch.no_grad()
    def run(self, specs: list, token_ids: list, src=None, seeds=None) -> torch.Tensor:
        """Decode ``specs`` (each ``num_new == 1``, in this order) fed ``token_ids``: fp32 logits ``[B, V]``.
        ``src``: per row, the row of the previous graph step's tokens (:attr:`last_tok`) to
        take its id from instead, or -1. ``seeds`` (sampled): per row, the seed of its next token
        (:func:`~dsa.sampling.row_seed`). The tokens picked land in :attr:`last_tok` (:meth:`fetch_tokens`).
        Does not wait for the GPU."""
        B = len(specs)
        bucket = self.bucket_for(B)
        self.num_padded_steps += bucket > B
        graph, ids, md_s, logits, _, _ = self._get(bucket)
        self._fill_packed(specs, bucket, token_ids, src or (), seeds or ())  # (ids, src, seeds: packed fields)
        if graph is None:
            logits = self._forward(ids, md_s, *self._graphs[bucket][4:])
        else:
            graph.replay()
            self.num_replays += 1
        return logits[:B]

    def fetch_tokens(self, n: int) -> tuple:
        """Start copying the last graph step's ``n`` tokens to the host: ``(host int64 [n], CUDA
        event or None)``; the values are there once the event is done. Two host buffers take turns: read each before
        the second call after it."""
        k = self._tok_flip
        self._tok_flip ^= 1
        host = self._tok_host[k][:n]
        host.copy_(self.last_tok[:n], non_blocking=self.device.type == "cuda")
        evt = self._tok_events[k]
        if evt is not None:
            evt.record()
        return host, evt
