r"""The 16-head fp8_ds_mla decode kernel fed by a bulk-copy ring (``dsa.mla.kernel_bulk``): checks, timings by batch
and split count beside the other Hopper kernel, and where its tile's clocks go.

    python benchmarks/bench_mla_bulk.py                 # H200: checks, then batch 32 / 64 / 128 against the default
    python benchmarks/bench_mla_bulk.py --heads 8       # H200: the timings alone with 8 heads (1-16)
    python benchmarks/bench_mla_bulk.py --sweep         # H200: batch 1-256 x split counts (the dispatch rule's data)
    python benchmarks/bench_mla_bulk.py --trace         # H200: the math warps' and loaders' clocks per tile
    python benchmarks/bench_mla_bulk.py --compile-only  # CPU: compile for sm_90a, print offsets and instruction counts

Every timing is a CUDA-graph median (``do_bench_cudagraph``) with the PyTorch baseline of the same run; "sm90": the
same call with the bulk kernel off (``config={"bulk": False}``: :mod:`dsa.mla.kernel_sm90`), "default": what
``sparse_mla`` picks. The kernel's design and history: its module docstring, BENCHMARKS.md (twenty-fifth to
twenty-eighth sessions; the prototype it grew from is ``benchmarks/proto_bulk_fp8.py`` in git history).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bulk_gather import baseline_and_floor, bulk_walk, compile_sm90, poisoned_case, sass_counts  # noqa: E402

from dsa.mla import kernel_bulk as KB  # noqa: E402

SM_SCALE = 576 ** -0.5
PTRS = dict(q_ptr="*bf16", kv_ptr="*u8", zero_ptr="*u8", idx_ptr="*i32", len_ptr="*i32", sink_ptr="*fp32",
            o_ptr="*fp32", lse_ptr="*fp32", ml_ptr="*fp32", out_ptr="*bf16", fl_ptr="*fp32", fm_ptr="*fp32",
            cnt_ptr="*i32", trace_ptr="*i32", ltr_ptr="*i32")
DIVISIBLE = ("stride_qt", "stride_qh", "stride_it", "stride_ot", "stride_oh", "split_len")  # (as at the decode shapes)


def compile_only(nsplit=1, has_len=False, has_sink=False, skip=False, trace=False, quiet=False, heads=16):
    """CPU: compile for sm_90a with the offsets resolved (:func:`dsa.mla.kernel_bulk.resolve_offsets`); returns
    the compiled kernel."""
    consts = KB.constexprs(nsplit, has_len, has_sink, skip, trace, heads)
    k = [None]

    def build(c):
        k[0] = compile_sm90(KB._sparse_mla_bulk_kernel, c, PTRS, 4, ("sm_scale_log2", ), DIVISIBLE)
        return k[0]

    KB.resolve_offsets(consts, build)
    if not quiet:
        print(f"splits {nsplit}, len {has_len}, sink {has_sink}, skip {skip}, trace {trace}: ring at "
              f"{consts['RING_OFF']}, barriers at {consts['BAR_OFF']} / {consts['EMPTY_OFF']}; shared "
              f"{k[0].metadata.shared} B")
        print(sass_counts(k[0], ("LDS", "LDG", "HMMA", "STS", "STG", "BAR", "STL", "LDL", "UBLKCP", "F2FP", "VOTE")))
    return k[0]


def _sm90(q, kv, idx, **kw):
    from dsa.mla.kernel import sparse_mla_triton

    return sparse_mla_triton(q, kv, idx, SM_SCALE, config={"bulk": False}, **kw)


def checks():
    """Against ``sparse_mla_ref``: 5% invalid entries, NaN in every unused row, poisoned outputs, a token with no
    valid entry; 1, 2, 3 and 4 splits; ``topk_length`` (0, full, 1000, 64, 1) with a sink; ``out=`` with padded
    rows; each twice (the split merge's counters must be back at 0)."""
    from dsa.mla import sparse_mla_ref

    worst = 0.0
    for T, ns, extra in ((3, 4, 0), (32, 4, 0), (64, 2, 0), (3, 1, 0), (128, 1, 0), (5, 3, 0), (3, 4, 1), (64, 2, 1),
                         (128, 1, 1), (7, 3, 1)):
        q, flat, idx = poisoned_case(T, "fp8_ds_mla", "cuda")
        g = torch.Generator(device="cuda").manual_seed(T + 11)
        lens = sink = None
        if extra:
            lens = torch.randint(0, 2049, (T, ), generator=g, device="cuda", dtype=torch.int32)
            lens[0], lens[-1] = 2048, 0
            if T > 3:
                lens[1:4] = torch.tensor([1000, 64, 1], dtype=torch.int32, device="cuda")
            sink = torch.randn(16, generator=g, device="cuda", dtype=torch.float32)
        ref = sparse_mla_ref(q, flat, idx, SM_SCALE, attn_sink=sink, topk_length=lens)
        for rep in range(2):
            out = None
            if rep:  # padded output rows (head stride 640), poisoned
                out = torch.full((T, 16, 640), float("nan"), dtype=torch.bfloat16, device="cuda")[:, :, :512]
            got = KB.sparse_mla_bulk(q, flat, idx, SM_SCALE, sink, lens, out, ns)
            torch.cuda.synchronize()
            d_out = (got[0].float() - ref[0].float()).abs().max().item()
            ok = torch.isfinite(ref[2])
            d_lse = (got[2][ok] - ref[2][ok]).abs().max().item() if ok.any() else 0.0
            d_ml = (got[1][ok] - ref[1][ok]).abs().max().item() if ok.any() else 0.0
            same_inf = bool(torch.equal(torch.isinf(got[2]), torch.isinf(ref[2]))
                            and torch.equal(torch.isinf(got[1]), torch.isinf(ref[1])))
            scale = ref[0].float().abs().max().item()
            bad = (d_out > scale / 128 + 1e-3 or d_lse > 1e-5 or d_ml > 1e-5 or not same_inf
                   or bool(torch.isnan(got[0]).any()))
            worst = max(worst, d_out / max(scale, 1e-6))
            print(f"check T {T} splits {ns}{' topk_length + sink' if extra else ''}{' out=' if rep else ''}: "
                  f"max |out - ref| {d_out:.5f} (max |ref| {scale:.3f}), lse {d_lse:.2e}, max_logits {d_ml:.2e}, "
                  f"inf pattern {'same' if same_inf else 'DIFFERENT'}{'  FAILED' if bad else ''}", flush=True)
            assert not bad
    print(f"all checks passed (largest |out - ref| / max |ref|: {worst:.2e})", flush=True)


def _ms(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=20, return_mode="median")


def timings(batches=(32, 64, 128), heads=16):
    """The bulk kernel at its own split count and one more, against the other Hopper kernel and the default
    (``heads``: h_q, 1 to 16)."""
    from dsa import sparse_mla
    from dsa.bench import mla_inputs

    rows = []
    for T in batches:
        q, kv, idx = mla_inputs(T, heads, 2048, T, 32768, "fp8_ds_mla", dev="cuda")
        flat = kv.reshape(-1, 656)
        baseline_and_floor(q, kv, idx, SM_SCALE, 656, "gather, dequantise, bmm")
        ms_sm90 = _ms(lambda: _sm90(q, flat, idx))
        ms_def = _ms(lambda: sparse_mla(q, kv, idx, SM_SCALE))
        ms_walk = _ms(lambda: bulk_walk(flat.view(torch.int32), idx, torch.empty(T, 2048, dtype=torch.int32,
                                                                                 device="cuda"), 1, 4, 0, 2, 1, 0, 4))
        own = KB.num_splits_for(T, 2048, torch.cuda.get_device_properties(0).multi_processor_count)
        for ns in sorted({own, own + 1}):
            copies = _ms(lambda: KB.sparse_mla_bulk(q, flat, idx, SM_SCALE, num_splits=ns, skip=True))
            whole = _ms(lambda: KB.sparse_mla_bulk(q, flat, idx, SM_SCALE, num_splits=ns))
            rows.append((T, ns, ms_sm90, ms_def, ms_walk, copies, whole))
            print(f"T {T} splits {ns}: sm90 {ms_sm90 * 1e3:.1f} us, default {ms_def * 1e3:.1f}, walk (one split) "
                  f"{ms_walk * 1e3:.1f}, bulk kernel: copies alone {copies * 1e3:.1f}, whole call {whole * 1e3:.1f}",
                  flush=True)
    print(f"\nus, h_q {heads}, fp8_ds_mla, topk 2048 of 32K per token; "
          "'walk': bulk_gather.py's copies alone (one split)")
    print(f"{'batch':>5} {'splits':>6} {'sm90':>6} {'default':>7} {'walk':>6} {'copies':>6} {'bulk':>6}")
    for r in rows:
        print(f"{r[0]:5d} {r[1]:6d} " + " ".join(f"{x * 1e3:{w}.1f}" for x, w in zip(r[2:], (6, 7, 6, 6, 6))))


def sweep(batches=(1, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 256)):
    """Batch x split count: the bulk kernel against the other Hopper kernel (the data of ``kernel_bulk``'s rule)."""
    from dsa.bench import mla_inputs

    nsm = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{'batch':>5} {'sm90':>6} " + " ".join(f"{'bulk/' + str(n):>7}" for n in (1, 2, 3, 4, 8)) + "   own")
    for T in batches:
        q, kv, idx = mla_inputs(T, 16, 2048, T, 32768, "fp8_ds_mla", dev="cuda")
        flat = kv.reshape(-1, 656)
        ms_sm90 = _ms(lambda: _sm90(q, flat, idx))
        cells = []
        for ns in (1, 2, 3, 4, 8):
            if T * ns > 4 * nsm or (ns > 1 and T * (ns - 1) >= nsm):
                cells.append(float("nan"))
                continue
            cells.append(_ms(lambda: KB.sparse_mla_bulk(q, flat, idx, SM_SCALE, num_splits=ns)))
        print(f"{T:5d} {ms_sm90 * 1e3:6.1f} " + " ".join(f"{c * 1e3:7.1f}" for c in cells)
              + f"   {KB.num_splits_for(T, 2048, nsm)}", flush=True)


def trace_phases(cases=((32, 4), (64, 2), (128, 1))):
    """Where the math warps' tile goes (clock sums per tile by phase) and the loaders' waits, beside the time of
    the call with and without the trace."""
    from dsa.bench import mla_inputs

    names = ("wait for the stage (and the barrier before it)", "QK + logits sum", "softmax + P.V + release",
             "to the next tile")
    for T, ns in cases:
        q, kv, idx = mla_inputs(T, 16, 2048, T, 32768, "fp8_ds_mla", dev="cuda")
        flat = kv.reshape(-1, 656)
        tr = torch.zeros(ns * T, 4, 128, dtype=torch.int32, device="cuda")
        ltr = torch.zeros(ns * T, 2, 2, 64, dtype=torch.int32, device="cuda")
        call = lambda t: KB.sparse_mla_bulk(q, flat, idx, SM_SCALE, num_splits=ns, trace=t,  # noqa: E731
                                            ltrace=None if t is None else ltr)
        call(tr)
        torch.cuda.synchronize()
        tiles = 2048 // 64 // ns
        per_tile = tr.double().mean(dim=(0, 2)) / tiles
        ms0, ms1 = _ms(lambda: call(None)), _ms(lambda: call(tr))
        print(f"T {T}, {ns} splits ({tiles} tiles per program): {ms0 * 1e3:.1f} us, traced {ms1 * 1e3:.1f} us; "
              f"clocks per tile: " + ", ".join(f"{n} {c:.0f}" for n, c in zip(names, per_tile.tolist()))
              + f"; total {per_tile.sum().item():.0f}; each loader, per tile of its own: wait for a free stage "
              f"{ltr[:, :, 0].double().mean().item() / (tiles / 2):.0f}, issue "
              f"{ltr[:, :, 1].double().mean().item() / (tiles / 2):.0f}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--trace", action="store_true")
    ap.add_argument("--heads", type=int, default=16, help="h_q of the timings (1-16); not 16: the timings alone")
    a = ap.parse_args()
    if a.compile_only:
        for args in ((1, ), (4, ), (2, True, True), (1, False, False, True), (2, False, False, False, True)):
            compile_only(*args)
    elif a.sweep:
        sweep()
    elif a.trace:
        trace_phases()
    elif a.heads != 16:
        timings(heads=a.heads)
    else:
        checks()
        timings()
