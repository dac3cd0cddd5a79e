"""Batched prefill + decode over a paged KV cache: greedy or sampled continuation of token prompts.

One step = one :func:`~dsa.model.metadata.build_step_metadata` call (host work) followed by one
model forward over all the step's tokens. The first step prefills every prompt together (prompts
of different lengths in one flattened batch; a 1-token prompt counts as a decode); each later
step decodes one token for every unfinished request.
"""
from __future__ import annotations

import torch

from .metadata import RequestSpec, build_step_metadata
from ..sampling import row_seed, sample_tokens


class _Req:
    def __init__(self, tokens: list, blocks: list):
        self.tokens = list(tokens)
        self.num_computed = 0
        self.blocks = blocks
        self.out: list = []
        self.done = False


def _cache_for(model, seqs_max_len: list, block_size: int, num_blocks: int | None):
    need = sum(-(-L // block_size) for L in seqs_max_len)
    return model.new_cache(num_blocks if num_blocks is not None else need + 1, block_size)


def _run_step(model, cache, reqs: list, block_size: int, max_logits_bytes: int, all_logits: bool = False):
    """Forward the pending tokens of ``reqs``; returns fp32 logits per request (its last token, or all
    its new tokens when ``all_logits``), in the order of ``reqs``."""
    specs = [RequestSpec(r.num_computed, len(r.tokens) - r.num_computed, r.blocks) for r in reqs]
    dev = model.lm_head.weight.device
    md = build_step_metadata(specs, block_size=block_size, index_topk=model.config.index_topk, device=dev,
                             max_logits_bytes=max_logits_bytes, backend=model.backend)
    ids = torch.tensor([t for i in md.order for t in reqs[i].tokens[reqs[i].num_computed:]],
                       dtype=torch.long, device=dev)
    hidden = model(ids, md, cache)
    for r in reqs:
        r.num_computed = len(r.tokens)
    if all_logits:
        logits = model.logits(hidden)
        qsl = md.query_start_loc.tolist()
        res = [None] * len(reqs)
        for j, i in enumerate(md.order):
            res[i] = logits[qsl[j]:qsl[j + 1]]
        return res, md
    last = model.logits(hidden[md.last_token_index])  # [R, V] in step order
    res = [None] * len(reqs)
    for j, i in enumerate(md.order):
        res[i] = last[j]
    return res, md


@torch.no_grad()
def prefill_logits(model, prompts: list, *, block_size: int = 64, max_logits_bytes: int = 512 << 20,
                   cache=None) -> list:
    """fp32 logits ``[len(p), vocab]`` of every position of every prompt, all prompts in one step."""
    if cache is None:
        cache = _cache_for(model, [len(p) for p in prompts], block_size, None)
    reqs = [_Req(p, cache.allocate(-(-len(p) // block_size))) for p in prompts]
    out, _ = _run_step(model, cache, reqs, block_size, max_logits_bytes, all_logits=True)
    return out


@torch.no_grad()
def generate(model, prompts: list, max_new_tokens: int, *, greedy: bool = True, temperature: float = 1.0,
             top_p: float = 1.0, seed: int = 0, ignore_eos: bool = False, block_size: int = 64,
             max_logits_bytes: int = 512 << 20, num_blocks: int | None = None, return_logits: bool = False):
    """Continue each prompt (a list of token ids) by up to ``max_new_tokens`` tokens.

    Greedy: ``argmax`` of the fp32 logits (first index among equal maxima). Sampled: softmax of
    ``logits / temperature`` restricted to the smallest top-``top_p`` nucleus
    (:func:`~dsa.sampling.sample_tokens`), the ``k``-th new token of prompt ``i`` drawn with the seed
    ``row_seed(seed, i, k)``: the same tokens as :class:`dsa.engine.Engine` gives its ``i``-th request under the
    same ``seed``, whatever the batching. A request stops at the config's ``eos_token_id`` (kept in its
    output) unless ``ignore_eos``. Returns the new tokens of each prompt (and, with
    ``return_logits``, the fp32 logits each token was chosen from).
    """
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens: expected >= 0, got {max_new_tokens}")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("prompts: expected at least one non-empty prompt")
    vocab = model.config.vocab_size
    for p in prompts:
        bad = [t for t in p if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompts: token ids must be in [0, {vocab}), got {bad[:3]}")
    eos = model.config.eos_token_id
    eos = set() if ignore_eos or eos is None else set(eos if isinstance(eos, list) else [eos])
    cache = _cache_for(model, [len(p) + max_new_tokens for p in prompts], block_size, num_blocks)
    reqs = [_Req(p, cache.allocate(-(-(len(p) + max_new_tokens) // block_size))) for p in prompts]
    logs = [[] for _ in prompts]
    index = {id(r): i for i, r in enumerate(reqs)}
    temp = 0.0 if greedy else temperature
    active = [r for r in reqs] if max_new_tokens > 0 else []
    while active:
        last, _ = _run_step(model, cache, active, block_size, max_logits_bytes)
        seeds = None if temp <= 0 else torch.tensor([row_seed(seed, index[id(r)], len(r.out)) for r in active],
                                                    dtype=torch.int64, device=last[0].device)
        picked = sample_tokens(torch.stack(last), seeds, temp, top_p, backend=model.backend).tolist()
        for r, lg, tok in zip(active, last, picked):
            r.tokens.append(tok)
            r.out.append(tok)
            if return_logits:
                logs[index[id(r)]].append(lg)
            if tok in eos or len(r.out) >= max_new_tokens:
                r.done = True
        active = [r for r in active if not r.done]
    for r in reqs:
        cache.free(r.blocks)
    outs = [r.out for r in reqs]
    return (outs, logs) if return_logits else outs

