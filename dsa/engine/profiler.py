"""Per-stage timing inside a model forward, off unless asked for.

:class:`StageProfiler` wraps the ops of the DSA stages while it is active (``with prof:``):

* ``indexer_logits``: ``dsa.mqa_logits.fp8_mqa_logits`` / ``fp8_paged_mqa_logits`` and the bf16
  indexer's logits (``dsa.model.layers._bf16_prefill_logits`` / ``_bf16_decode_logits``);
* ``top_k``: ``dsa.topk.top_k_indices``;
* ``attention``: ``dsa.mla.sparse_mla``;

and :meth:`step` brackets a whole step; ``rest`` = step time minus the three stages. The model's
layers import those ops at call time, so the wrappers take effect only while the profiler is
entered and cost nothing otherwise. On a GPU each interval is a pair of CUDA events (no
synchronisation in the forward; the events are read once, by :meth:`totals`); on the CPU it is
``time.perf_counter``. ``enabled = False`` suspends recording (e.g. while a CUDA graph is captured
or replayed: the ops inside a replay cannot be timed one by one).
"""
from __future__ import annotations

import importlib
import time
from contextlib import contextmanager

import torch

STAGES = ("indexer_logits", "top_k", "attention", "rest")

_TARGETS = [
    ("dsa.mqa_logits", "fp8_mqa_logits", "indexer_logits"),
    ("dsa.mqa_logits", "fp8_paged_mqa_logits", "indexer_logits"),
    ("dsa.model.layers", "_bf16_prefill_logits", "indexer_logits"),
    ("dsa.model.layers", "_bf16_decode_logits", "indexer_logits"),
    ("dsa.topk", "top_k_indices", "top_k"),
    ("dsa.mla", "sparse_mla", "attention"),
]


class StageProfiler:
    def __init__(self, device):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.enabled = True
        self._saved = []
        self._open = []  # (kind, stage, start, end) not yet resolved
        self._acc = {}  # kind -> {stage: seconds}
        self._kind = "step"

    # -- patching -----------------------------------------------------------------
    def __enter__(self):
        for mod_name, attr, stage in _TARGETS:
            mod = importlib.import_module(mod_name)
            fn = getattr(mod, attr)
            self._saved.append((mod, attr, fn))
            setattr(mod, attr, self._wrap(fn, stage))
        return self

    def __exit__(self, *exc):
        for mod, attr, fn in reversed(self._saved):
            setattr(mod, attr, fn)
        self._saved.clear()
        return False

    def _mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def _wrap(self, fn, stage):
        prof = self

        def timed(*a, **k):
            if not prof.enabled:
                return fn(*a, **k)
            t0 = prof._mark()
            out = fn(*a, **k)
            prof._open.append((prof._kind, stage, t0, prof._mark()))
            return out

        timed.__wrapped__ = fn
        return timed

    @contextmanager
    def step(self, kind: str):
        """Time one whole step of ``kind`` (``"prefill"``, ``"decode"``, ...)."""
        if not self.enabled:
            yield
            return
        self._kind = kind
        t0 = self._mark()
        yield
        self._open.append((kind, "_total", t0, self._mark()))

    # -- results -------------------------------------------------------------------
    def _resolve(self):
        if self._open and self.cuda:
            torch.cuda.synchronize(self.device)
        for kind, stage, a, b in self._open:
            sec = a.elapsed_time(b) / 1e3 if self.cuda else b - a
            d = self._acc.setdefault(kind, {})
            d[stage] = d.get(stage, 0.0) + sec
        self._open.clear()

    def totals(self) -> dict:
        """``{kind: {stage: seconds}}`` with ``rest`` = step time - the timed stages (>= 0)."""
        self._resolve()
        out = {}
        for kind, d in self._acc.items():
            tot = d.get("_total", 0.0)
            st = {s: d.get(s, 0.0) for s in STAGES[:-1]}
            st["rest"] = max(tot - sum(st.values()), 0.0)
            out[kind] = st
        return out
