"""Requests and the continuous-batching scheduler (decodes first, then chunked prefill).

Every step the scheduler

1. admits arrived requests (first come, first served) while fewer than ``max_num_seqs`` run and
   the free cache blocks cover the whole request (prompt + new tokens): a request admitted once
   never waits for blocks again, so nothing is ever preempted and no cache is overwritten;
2. schedules one token for every running request that is decoding (its prompt is cached);
3. fills what is left of the ``max_num_batched_tokens`` budget with prefill chunks of the
   running requests in admission order, at most ``max_prefill_chunk`` tokens per request;
4. allocates, for each scheduled request, the blocks its cached + new tokens need (lazily,
   out of the reservation made at admission).

A request that can never be served (empty prompt, bad token ids, more blocks than the whole
cache, longer than ``max_model_len``) is rejected when it is added, with a message saying why;
the others run on.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .block_manager import BlockManager

WAITING, RUNNING, FINISHED, REJECTED = "waiting", "running", "finished", "rejected"


@dataclass
class Request:
    rid: int
    prompt: list
    max_new_tokens: int
    arrival_step: int = 0
    status: str = WAITING
    error: str | None = None
    tokens: list = field(default_factory=list)  # prompt + generated
    output: list = field(default_factory=list)
    num_computed: int = 0  # tokens whose keys are in the cache
    blocks: list = field(default_factory=list)
    blocks_needed: int = 0  # whole-request reservation
    last_in_flight: bool = False  # its last token is sampled on the GPU, not yet read (Engine's async_decode)
    finish_reason: str | None = None
    # wall-clock marks (seconds, engine clock)
    t_arrival: float | None = None
    t_first_token: float | None = None
    t_finish: float | None = None

    @property
    def prompt_done(self) -> bool:
        return self.num_computed >= len(self.prompt)

    @property
    def ttft(self) -> float | None:
        if self.t_first_token is None or self.t_arrival is None:
            return None
        return self.t_first_token - self.t_arrival


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 16  # running requests at most (= largest decode batch)
    max_prefill_chunk: int | None = None  # tokens of one request's prefill chunk (None: budget)
    max_model_len: int | None = None  # prompt + new tokens at most (None: cache capacity)

    def __post_init__(self):
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens: expected >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs: expected >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens: expected >= max_num_seqs={self.max_num_seqs} (one decode "
                             f"token per running request), got {self.max_num_batched_tokens}")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk: expected >= 1 or None, got {self.max_prefill_chunk}")


def cache_tokens_needed(prompt_len: int, max_new_tokens: int) -> int:
    """Cache positions a request fills: the prompt and every generated token but the last."""
    return prompt_len + max(max_new_tokens - 1, 0)


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager, vocab_size: int):
        self.cfg, self.blocks, self.vocab_size = cfg, blocks, vocab_size
        self.waiting: list = []
        self.running: list = []
        self.finished: list = []
        self.step_index = 0

    # ------------------------------------------------------------------ admission
    def validate(self, req: Request) -> str | None:
        """Why ``req`` can never be served, or None."""
        p = req.prompt
        if not isinstance(p, (list, tuple)):
            return f"prompt: expected a list of token ids, got {type(p).__name__}"
        if len(p) == 0:
            return "prompt: expected at least one token id, got an empty prompt"
        bad = [t for t in p if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt: token ids must be ints in [0, {self.vocab_size}), got {bad[:3]}"
        if isinstance(req.max_new_tokens, bool) or not isinstance(req.max_new_tokens, int) or req.max_new_tokens < 0:
            return f"max_new_tokens: expected an int >= 0, got {req.max_new_tokens!r}"
        need = self.blocks.blocks_for(cache_tokens_needed(len(p), req.max_new_tokens))
        if need > self.blocks.capacity:
            return (f"request too large: {len(p)} prompt + {req.max_new_tokens} new tokens need {need} cache blocks of "
                    f"{self.blocks.block_size} tokens, the cache has {self.blocks.capacity}")
        total = len(p) + req.max_new_tokens
        if self.cfg.max_model_len is not None and total > self.cfg.max_model_len:
            return (f"request too long: {len(p)} prompt + {req.max_new_tokens} new tokens = {total} > "
                    f"max_model_len {self.cfg.max_model_len}")
        return None

    def add(self, req: Request) -> Request:
        err = self.validate(req)
        if err is not None:
            req.status, req.error, req.finish_reason = REJECTED, err, "rejected"
            self.finished.append(req)
            return req
        req.prompt = list(req.prompt)
        req.tokens = list(req.prompt)
        req.blocks_needed = self.blocks.blocks_for(cache_tokens_needed(len(req.prompt), req.max_new_tokens))
        req.status = WAITING
        self.waiting.append(req)
        return req

    def _outstanding(self) -> int:
        """Blocks promised to running requests but not yet allocated."""
        return sum(r.blocks_needed - len(r.blocks) for r in self.running)

    def _admit(self) -> list:
        admitted = []
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            r = next((r for r in self.waiting if r.arrival_step <= self.step_index), None)
            if r is None:
                break
            if r.max_new_tokens == 0:  # nothing to generate: done without a forward
                self.waiting.remove(r)
                admitted.append(r)
                self._finish(r, "length")
                continue
            if self.blocks.num_free - self._outstanding() < r.blocks_needed:
                break  # FCFS: wait for blocks to come back
            self.waiting.remove(r)
            r.status = RUNNING
            self.running.append(r)
            admitted.append(r)
        return admitted

    # ------------------------------------------------------------------ a step
    def schedule(self) -> tuple[list, list]:
        """-> (newly admitted requests, ``[(request, num_new_tokens)]`` of this step: decodes first)."""
        admitted = self._admit()
        budget = self.cfg.max_num_batched_tokens
        out = []
        for r in self.running:  # decodes: the prompt is cached, one pending token
            if r.prompt_done and budget > 0 and not r.last_in_flight:
                out.append((r, len(r.tokens) - r.num_computed))
                budget -= out[-1][1]
        for r in self.running:  # prefill chunks
            if budget <= 0:
                break
            if not r.prompt_done:
                n = min(len(r.prompt) - r.num_computed, budget, self.cfg.max_prefill_chunk or budget)
                out.append((r, n))
                budget -= n
        for r, n in out:
            need = self.blocks.blocks_for(r.num_computed + n) - len(r.blocks)
            if need > 0:
                r.blocks += self.blocks.allocate(need)
        return admitted, out

    def _finish(self, r: Request, reason: str) -> None:
        r.status, r.finish_reason = FINISHED, reason
        if r.blocks:
            self.blocks.free(r.blocks)
            r.blocks = []
        if r in self.running:
            self.running.remove(r)
        self.finished.append(r)

    def finish(self, r: Request, reason: str) -> None:
        self._finish(r, reason)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
