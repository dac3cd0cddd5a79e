"""The DSA pipeline on a synthetic workload: what `dsa run` executes until the
serving engine lands.

Per request it fills the paged MLA cache and the paged indexer cache with a
prompt's keys (random activations: no model weights are involved), then runs

* one prefill pass over each prompt: indexer q/k preparation -> gather of the
  request's indexer keys -> ``fp8_mqa_logits`` -> ``top_k_indices`` (ks/ke form)
  -> ``convert_req_index_to_global_index`` -> ``sparse_mla``;
* ``decode_steps`` batched decode steps: cache writes for the new token ->
  ``fp8_paged_mqa_logits`` -> ``top_k_indices`` (decode form) -> index
  conversion -> ``sparse_mla``.

It times each stage and reports which implementation (Triton kernel or PyTorch
reference) ran it. With ``check=True`` every step is recomputed with the
reference backend and the largest differences are reported.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field

import torch

from . import backend as _backend
from .constants import D_QK, INDEXER_HEAD_DIM, INDEXER_NUM_HEADS, KV_LORA_RANK, ROPE_DIM

STAGES = ("cache_write", "indexer_prep", "indexer_logits", "top_k", "index_convert", "attention")


@dataclass
class Workload:
    prompt_lens: list[int]
    decode_steps: int
    num_heads: int = 128
    topk: int = 2048
    block_size: int = 64
    kv_format: str = "bf16"
    next_n: int = 1
    seed: int = 0

    @staticmethod
    def default(device: torch.device) -> "Workload":
        """DeepSeek-V3.2 attention dimensions on a GPU; a scaled-down one on the CPU."""
        if device.type == "cuda":
            return Workload(prompt_lens=[16384, 32768, 65536, 24576], decode_steps=256, num_heads=128, topk=2048,
                            block_size=64, kv_format="fp8_ds_mla")
        return Workload(prompt_lens=[300, 77, 1030, 512], decode_steps=8, num_heads=16, topk=128,
                        block_size=64, kv_format="fp8_ds_mla")


@dataclass
class Report:
    workload: dict
    device: str
    backends: dict
    stage_seconds: dict = field(default_factory=dict)
    prefill_seconds: list = field(default_factory=list)
    decode_step_seconds: list = field(default_factory=list)
    decode_tokens_per_s: float = 0.0
    peak_memory_bytes: int = 0
    check: dict | None = None


class _Timer:
    def __init__(self, device):
        self.device = device
        self.acc = {s: 0.0 for s in STAGES}

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def stage(self, name):
        timer = self

        class _Ctx:
            def __enter__(self):
                timer.sync()
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.sync()
                timer.acc[name] += time.perf_counter() - self.t0

        return _Ctx()


def _rope_tables(positions: torch.Tensor, dim: int, base: float = 10000.0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim))
    ang = positions.float()[:, None] * inv[None, :]
    return ang.cos(), ang.sin()


class Pipeline:
    """Paged caches plus the per-stage DSA ops, on one device."""

    def __init__(self, wl: Workload, device: torch.device, backend: str | None = None):
        from .indexer_cache import indexer_k_quant_and_cache  # noqa: F401  (fail early if missing)

        self.wl, self.device, self.backend = wl, device, backend
        g = torch.Generator(device="cpu")
        g.manual_seed(wl.seed)
        self.g = g
        bs = wl.block_size
        max_len = [L + wl.decode_steps * wl.next_n for L in wl.prompt_lens]
        blocks = [math.ceil(L / bs) for L in max_len]
        self.num_blocks = sum(blocks) + 1
        perm = torch.randperm(self.num_blocks, generator=g)
        self.block_table = torch.full((len(max_len), max(blocks)), -1, dtype=torch.int32)
        pos = 0
        for r, nb in enumerate(blocks):
            self.block_table[r, :nb] = perm[pos:pos + nb].to(torch.int32)
            pos += nb
        self.block_table = self.block_table.to(device)
        if wl.kv_format == "bf16":
            self.kv_cache = torch.empty(self.num_blocks, bs, D_QK, dtype=torch.bfloat16, device=device)
        else:
            from .constants import FP8_DS_MLA_ROW_BYTES

            self.kv_cache = torch.zeros(self.num_blocks, bs, FP8_DS_MLA_ROW_BYTES, dtype=torch.uint8, device=device)
            self.kv_cache[..., :KV_LORA_RANK] = 0x7F  # NaN fp8 in unused slots: must never leak
        from .constants import INDEXER_ROW_BYTES

        self.idx_cache = torch.zeros(self.num_blocks, bs * INDEXER_ROW_BYTES, dtype=torch.uint8, device=device)
        self.lens = [0] * len(max_len)
        self.sm_scale = (128 + ROPE_DIM) ** -0.5

    # -- random activations ------------------------------------------------
    def _randn(self, *shape, scale=1.0):
        return (torch.randn(*shape, generator=self.g) * scale).to(torch.bfloat16).to(self.device)

    def _slots(self, r: int, positions: torch.Tensor) -> torch.Tensor:
        bs = self.wl.block_size
        bt = self.block_table[r].long()
        return bt[positions // bs] * bs + positions % bs

    def write_tokens(self, r: int, n: int, timer: _Timer):
        from .indexer_cache import indexer_k_quant_and_cache
        from .indexer_prep import prepare_indexer_k
        from .mla_cache import concat_and_cache_mla

        pos = torch.arange(self.lens[r], self.lens[r] + n, device=self.device)
        c_kv, k_pe, k_idx = self._randn(n, KV_LORA_RANK), self._randn(n, ROPE_DIM), self._randn(n, INDEXER_HEAD_DIM)
        cos, sin = _rope_tables(pos, ROPE_DIM)
        slots = self._slots(r, pos)
        with timer.stage("indexer_prep"):
            k_idx = prepare_indexer_k(k_idx, cos, sin, backend=self.backend)
        with timer.stage("cache_write"):
            concat_and_cache_mla(c_kv, k_pe, self.kv_cache, slots, kv_format=self.wl.kv_format, backend=self.backend)
            indexer_k_quant_and_cache(k_idx, self.idx_cache, slots, backend=self.backend)
        self.lens[r] += n
        return pos

    def queries(self, positions: torch.Tensor):
        n = positions.numel()
        cos, sin = _rope_tables(positions, ROPE_DIM)
        q_idx = self._randn(n, INDEXER_NUM_HEADS, INDEXER_HEAD_DIM)
        w_idx = torch.randn(n, INDEXER_NUM_HEADS, generator=self.g).to(self.device)
        q = self._randn(n, self.wl.num_heads, D_QK, scale=0.5)
        return q, q_idx, w_idx, cos, sin


def _prefill(p: Pipeline, r: int, timer: _Timer, be, max_logits_bytes: int = 512 << 20):
    """Prefill request ``r``: its keys go into both caches, then its queries run the sparse
    pipeline in query chunks whose fp32 indexer logits stay under ``max_logits_bytes``.
    Returns the state of the first chunk (for ``--check``)."""
    from .indexer_cache import gather_indexer_k
    from .indexer_prep import prepare_indexer_q
    from .metadata import convert_req_index_to_global_index
    from .mqa_logits import fp8_mqa_logits, split_prefill_chunks
    from .mla import sparse_mla
    from .topk import top_k_indices

    L = p.wl.prompt_lens[r]
    pos = p.write_tokens(r, L, timer)
    q, q_idx, w_idx, cos, sin = p.queries(pos)
    dev = p.device
    with timer.stage("indexer_prep"):
        q_fp8, weights = prepare_indexer_q(q_idx, cos, sin, w_idx, backend=be)
    with timer.stage("indexer_logits"):
        cu = torch.tensor([0, L], dtype=torch.int32, device=dev)
        k_fp8, k_scale = gather_indexer_k(p.idx_cache, p.block_table[r:r + 1], cu, num_tokens=L, backend=be)
    ks = torch.zeros(L, dtype=torch.int32, device=dev)
    ke = (pos + 1).to(torch.int32)  # causal: query i sees keys [0, i]
    req = torch.full((L,), r, dtype=torch.int32, device=dev)
    # host-side chunk plan from the known causal ranges (no device sync)
    chunks = split_prefill_chunks([0] * L, list(range(1, L + 1)), L, max_logits_bytes)
    first = None
    for (s, e, k0, k1) in chunks:
        with timer.stage("indexer_logits"):
            logits = fp8_mqa_logits(q_fp8[s:e], (k_fp8[k0:k1], k_scale[k0:k1]), weights[s:e], ks[s:e] - k0, ke[s:e] - k0,
                                    backend=be)
        with timer.stage("top_k"):
            rel = top_k_indices(logits, p.wl.topk, ks[s:e] - k0, ke[s:e] - k0, backend=be)
        with timer.stage("index_convert"):
            glob = convert_req_index_to_global_index(req[s:e], p.block_table, rel, p.wl.block_size, backend=be)
        with timer.stage("attention"):
            out, _, lse = sparse_mla(q[s:e], p.kv_cache, glob, p.sm_scale, backend=be)
        if first is None:
            first = {"q": q[s:e], "q_fp8": q_fp8[s:e], "weights": weights[s:e], "ks": ks[s:e] - k0, "ke": ke[s:e] - k0,
                     "k": (k_fp8[k0:k1], k_scale[k0:k1]), "req": req[s:e], "out": out, "lse": lse, "logits": logits,
                     "rel": rel}
    return first


def _decode(p: Pipeline, timer: _Timer, be):
    from .indexer_prep import prepare_indexer_q
    from .metadata import convert_req_index_to_global_index
    from .mqa_logits import fp8_paged_mqa_logits
    from .mla import sparse_mla
    from .topk import top_k_indices

    nn, B, dev = p.wl.next_n, len(p.lens), p.device
    pos = torch.cat([p.write_tokens(r, nn, timer) for r in range(B)])
    q, q_idx, w_idx, cos, sin = p.queries(pos)
    ctx = torch.tensor(p.lens, dtype=torch.int32, device=dev)
    max_ctx = max(p.lens)
    with timer.stage("indexer_prep"):
        q_fp8, weights = prepare_indexer_q(q_idx, cos, sin, w_idx, backend=be)
    with timer.stage("indexer_logits"):
        logits = fp8_paged_mqa_logits(q_fp8.view(B, nn, INDEXER_NUM_HEADS, INDEXER_HEAD_DIM), p.idx_cache, weights, ctx,
                                      p.block_table, max_ctx, backend=be)
    with timer.stage("top_k"):
        rel = top_k_indices(logits, p.wl.topk, seq_lens=ctx, next_n=nn, backend=be)
    with timer.stage("index_convert"):
        req = torch.arange(B, dtype=torch.int32, device=dev).repeat_interleave(nn)
        glob = convert_req_index_to_global_index(req, p.block_table, rel, p.wl.block_size, backend=be)
    with timer.stage("attention"):
        out, _, lse = sparse_mla(q, p.kv_cache, glob, p.sm_scale, backend=be)
    return {"q": q, "q_fp8": q_fp8, "weights": weights, "ctx": ctx, "max_ctx": max_ctx, "req": req, "out": out,
            "lse": lse, "logits": logits, "rel": rel}


def _check_step(p: Pipeline, st: dict, decode: bool) -> dict:
    """Recompute one step with the reference backend on the same inputs; largest differences."""
    from .mqa_logits import fp8_mqa_logits, fp8_paged_mqa_logits
    from .metadata import convert_req_index_to_global_index
    from .mla import sparse_mla
    from .topk import top_k_indices

    ref = "reference"
    if decode:
        B = len(p.lens)
        logits = fp8_paged_mqa_logits(st["q_fp8"].view(B, p.wl.next_n, INDEXER_NUM_HEADS, INDEXER_HEAD_DIM), p.idx_cache,
                                      st["weights"], st["ctx"], p.block_table, st["max_ctx"], backend=ref)
    else:
        logits = fp8_mqa_logits(st["q_fp8"], st["k"], st["weights"], st["ks"], st["ke"], backend=ref)
    fin = torch.isfinite(logits)
    logit_diff = float((logits[fin] - st["logits"][fin]).abs().max()) if fin.any() else 0.0
    same_inf = bool(torch.equal(fin, torch.isfinite(st["logits"])))
    # top-k: compare selected value multisets on the kernel's own logits (tie-insensitive)
    if decode:
        rel_ref = top_k_indices(st["logits"], p.wl.topk, seq_lens=st["ctx"], next_n=p.wl.next_n, backend=ref)
    else:
        rel_ref = top_k_indices(st["logits"], p.wl.topk, st["ks"], st["ke"], backend=ref)

    def picked(rel):
        v = torch.where(rel >= 0, st["logits"].gather(1, rel.clamp_min(0).long()), torch.full_like(rel, float("-inf"), dtype=torch.float32))
        return v.sort(dim=1).values

    topk_same = bool(torch.equal(picked(rel_ref), picked(st["rel"])))
    glob = convert_req_index_to_global_index(st["req"], p.block_table, st["rel"], p.wl.block_size, backend=ref)
    out, _, lse = sparse_mla(st["q"], p.kv_cache, glob, p.sm_scale, backend=ref)
    return {"logits_max_abs_diff": logit_diff, "logits_inf_pattern_equal": same_inf, "topk_values_equal": topk_same,
            "attn_out_max_abs_diff": float((out.float() - st["out"].float()).abs().max()),
            "lse_max_abs_diff": float((lse - st["lse"]).abs().max())}


def run(wl: Workload, device: torch.device, backend: str | None = None, check: bool = False, progress: bool = True) -> Report:
    p = Pipeline(wl, device, backend)
    be = backend
    resolved = _backend.resolve(backend, device)
    rep = Report(workload=asdict(wl), device=str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
                 backends={s: resolved for s in STAGES})
    timer = _Timer(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    checks = []
    total = len(wl.prompt_lens) + wl.decode_steps
    bar = _Progress(total, enabled=progress)
    for r in range(len(wl.prompt_lens)):
        t0 = time.perf_counter()
        st = _prefill(p, r, timer, be)
        timer.sync()
        rep.prefill_seconds.append(time.perf_counter() - t0)
        if check and r == 0:
            checks.append(_check_step(p, st, decode=False))
        bar.step(f"prefill {r}")
    for i in range(wl.decode_steps):
        t0 = time.perf_counter()
        st = _decode(p, timer, be)
        timer.sync()
        rep.decode_step_seconds.append(time.perf_counter() - t0)
        if check and (i == 0 or i == wl.decode_steps - 1):
            checks.append(_check_step(p, st, decode=True))
        bar.step(f"decode {i}")
    bar.close()
    rep.stage_seconds = dict(timer.acc)
    dec = sum(rep.decode_step_seconds)
    rep.decode_tokens_per_s = (wl.decode_steps * len(wl.prompt_lens) * wl.next_n / dec) if dec > 0 else 0.0
    if device.type == "cuda":
        rep.peak_memory_bytes = int(torch.cuda.max_memory_allocated(device))
    if check:
        rep.check = {k: (max(c[k] for c in checks) if isinstance(checks[0][k], float) else all(c[k] for c in checks))
                     for k in checks[0]}
    return rep


class _Progress:
    """A minimal progress bar on stderr (no dependency)."""

    def __init__(self, total: int, enabled: bool = True):
        import sys

        self.total, self.n, self.enabled, self.out = total, 0, enabled and total > 0, sys.stderr
        self.t0 = time.perf_counter()

    def step(self, what: str = ""):
        self.n += 1
        if not self.enabled:
            return
        w = 30
        done = int(w * self.n / self.total)
        el = time.perf_counter() - self.t0
        self.out.write(f"\r[{'#' * done}{'.' * (w - done)}] {self.n}/{self.total} {what:<14} {el:6.1f}s")
        self.out.flush()

    def close(self):
        if self.enabled:
            self.out.write("\n")
            self.out.flush()


def format_report(rep: Report) -> str:
    wl = rep.workload
    lines = [
        f"dsa run on {rep.device}: {len(wl['prompt_lens'])} requests, prompts {wl['prompt_lens']}, "
        f"{wl['decode_steps']} decode steps, h_q {wl['num_heads']}, topk {wl['topk']}, block {wl['block_size']}, "
        f"MLA cache {wl['kv_format']}",
        "",
        f"{'request':>8} {'prompt':>8} {'TTFT (prefill) ms':>18}",
    ]
    for r, (L, t) in enumerate(zip(wl["prompt_lens"], rep.prefill_seconds)):
        lines.append(f"{r:>8} {L:>8} {t * 1e3:>18.2f}")
    if rep.decode_step_seconds:
        s = sorted(rep.decode_step_seconds)

        def pct(q):
            return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] * 1e3

        lines += ["", f"decode: {rep.decode_tokens_per_s:,.1f} tokens/s; step latency ms p50 {pct(50):.2f}  p90 {pct(90):.2f}  "
                      f"p99 {pct(99):.2f}  max {s[-1] * 1e3:.2f}"]
    tot = sum(rep.stage_seconds.values()) or 1.0
    lines += ["", f"{'stage':<16} {'implementation':<16} {'seconds':>9} {'share':>7}"]
    for st in STAGES:
        lines.append(f"{st:<16} {rep.backends[st]:<16} {rep.stage_seconds[st]:>9.3f} {100 * rep.stage_seconds[st] / tot:>6.1f}%")
    if rep.peak_memory_bytes:
        lines.append(f"\npeak GPU memory: {rep.peak_memory_bytes / 2**30:.2f} GiB")
    if rep.check is not None:
        lines += ["", "check against the PyTorch reference backend (largest over the checked steps):"]
        lines += [f"  {k}: {v}" for k, v in rep.check.items()]
    return "\n".join(lines)
