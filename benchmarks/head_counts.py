"""Sparse MLA at every head count a GPU may hold: the default call against the same heads as power-of-two slices.

    python benchmarks/head_counts.py [--heads 8,24,40] [--cases fp8_decode,bf16_decode,bf16_prefill]
    python benchmarks/head_counts.py --threshold   # 72 and 96 heads, one call or two slices, by token count

A kernel program holds a power-of-two group of heads (16, 32 or 64; the products of Triton and Gluon need
power-of-two tensor shapes). A head count that is not one, e.g. 40 or 96, runs in the smallest such groups that
cover it, the missing heads masked (40: one 64-head group; 96: two). The other way is to cut the heads into
power-of-two slices (40 = 32 + 8, 96 = 64 + 32) and call each alone: no masked heads, but every slice reads the
token's cache rows again. This times both, per head count, on three cases (H200):

  * ``fp8_decode``: batch 64, s_q 1, topk 2048 of 32K per request, fp8_ds_mla cache (CUDA-graph medians);
  * ``bf16_decode``: the same over the bf16 cache;
  * ``bf16_prefill``: 4096 tokens, topk 2048 of a 128K bf16 cache (``do_bench`` medians).

"default" is ``sparse_mla`` as it picks; "one call" the same with the heads never sliced (``slice_heads=False``: it
differs from the default only where :func:`dsa.mla.kernel.slice_pays`); "sliced" calls ``sparse_mla`` on each
power-of-two slice into its columns of one ``out`` (their lse and max_logits left in their own tensors: the cost of
gathering those, a few us at most, is not counted). Rates count the heads asked
for: TFLOP/s = 2 h_q valid_topk (576 + 512) per token; GB/s = the rows' bytes once (T topk row bytes). The PyTorch
baseline (``dsa.bench.mla_baseline``: gather, dequantise, two bmm's) is timed in the same run. The table is printed
last.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from dsa import sparse_mla  # noqa: E402
from dsa.bench import mla_baseline, mla_baseline_chunk, mla_inputs  # noqa: E402
from dsa.mla.kernel import sparse_mla_triton  # noqa: E402
from dsa.constants import D_QK, D_V, FP8_DS_MLA_ROW_BYTES  # noqa: E402

SM_SCALE = 192 ** -0.5
HEADS = (8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 96, 112, 128)
#: case -> (tokens, requests, cached tokens per request, cache format, CUDA graph)
CASES = dict(fp8_decode=(64, 64, 32768, "fp8_ds_mla", True), bf16_decode=(64, 64, 32768, "bf16", True),
             bf16_prefill=(4096, 1, 131072, "bf16", False))
TOPK = 2048


def slices(h: int) -> list:
    """``h`` (a multiple of 8) as power-of-two slices, largest first, at most 64 each: 40 -> [32, 8]."""
    out = []
    while h:
        s = min(64, 1 << (h.bit_length() - 1))
        out.append(s)
        h -= s
    return out


def _ms(fn, graph: bool) -> float:
    if graph:
        return triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    return triton.testing.do_bench(fn, rep=50, return_mode="median")


def run(heads, cases):
    rows = []
    for case in cases:
        T, nreq, s_kv, fmt, graph = CASES[case]
        row_bytes = FP8_DS_MLA_ROW_BYTES if fmt == "fp8_ds_mla" else 2 * D_QK
        q_all, kv, idx = mla_inputs(T, max(heads), TOPK, nreq, s_kv, fmt)
        for h in heads:
            q = q_all[:, :h].contiguous()
            out = torch.empty(T, h, D_V, dtype=torch.bfloat16, device="cuda")
            parts = []
            h0 = 0
            for s in slices(h):
                parts.append((q[:, h0:h0 + s].contiguous(), out[:, h0:h0 + s]))
                h0 += s
            whole = lambda: sparse_mla(q, kv, idx, SM_SCALE, out=out)  # noqa: E731
            flat = kv.reshape(-1, kv.shape[-1])
            one = lambda: sparse_mla_triton(q, flat, idx, SM_SCALE, out=out,  # noqa: E731
                                            config=dict(slice_heads=False))

            def sliced():
                for qs, os_ in parts:
                    sparse_mla(qs, kv, idx, SM_SCALE, out=os_)

            whole()
            want = out.clone()
            sliced()
            torch.cuda.synchronize()
            diff = (out.float() - want.float()).abs().max().item()
            ms_whole = _ms(whole, graph)
            ms_one = _ms(one, graph) if h > 64 else ms_whole
            ms_sliced = _ms(sliced, graph) if len(parts) > 1 else float("nan")
            chunk = mla_baseline_chunk(TOPK, h)
            ms_torch = triton.testing.do_bench(lambda: mla_baseline(q, kv, idx, SM_SCALE, chunk), rep=20,
                                               return_mode="median")
            rows.append((case, h, "+".join(map(str, slices(h))), ms_whole, ms_one, ms_sliced, ms_torch, diff,
                         2.0 * T * h * TOPK * (D_QK + D_V), T * TOPK * row_bytes))
            r = rows[-1]
            print(f"{case} h_q {h}: default {ms_whole * 1e3:.1f} us, one call {ms_one * 1e3:.1f} us, "
                  f"sliced {r[2]} {ms_sliced * 1e3:.1f} us, "
                  f"PyTorch {ms_torch * 1e3:.1f} us (max |default - sliced| {diff:.4f})", flush=True)
    print(f"\n{'case':<13} {'h_q':>4} {'slices':>9} {'default us':>10} {'TFLOP/s':>8} {'GB/s':>6} "
          f"{'one call':>9} {'sliced us':>9} {'sliced/def':>10} {'PyTorch us':>10} {'speed-up':>8}")
    for case, h, sl, a, o, b, c, _, flop, nbytes in rows:
        print(f"{case:<13} {h:4d} {sl:>9} {a * 1e3:10.1f} {flop / a / 1e9:8.1f} {nbytes / a / 1e6:6.0f} "
              f"{o * 1e3:9.1f} {b * 1e3:9.1f} {b / a:10.2f} {c * 1e3:10.1f} {c / a:7.1f}x")


def threshold(heads=(72, 96), tokens=(64, 128, 256, 512, 1024, 2048), s_kv=4096):
    """One call against the library's two slices (``slice_heads``) by token count: decode-like calls, each token
    its own request of ``s_kv`` cached tokens (topk 2048 of them), both formats (CUDA-graph medians), with the
    PyTorch baseline of each shape."""
    rows = []
    for fmt in ("fp8_ds_mla", "bf16"):
        for T in tokens:
            q_all, kv, idx = mla_inputs(T, max(heads), TOPK, T, s_kv, fmt)
            flat = kv.reshape(-1, kv.shape[-1])
            for h in heads:
                q = q_all[:, :h].contiguous()
                out = torch.empty(T, h, D_V, dtype=torch.bfloat16, device="cuda")
                one = _ms(lambda: sparse_mla_triton(q, flat, idx, SM_SCALE, out=out, config=dict(slice_heads=False)),
                          True)
                two = _ms(lambda: sparse_mla_triton(q, flat, idx, SM_SCALE, out=out, config=dict(slice_heads=True)),
                          True)
                dflt = _ms(lambda: sparse_mla(q, kv, idx, SM_SCALE, out=out), True)
                chunk = mla_baseline_chunk(TOPK, h)
                base = triton.testing.do_bench(lambda: mla_baseline(q, kv, idx, SM_SCALE, chunk), rep=20,
                                               return_mode="median")
                rows.append((fmt, h, T, one, two, dflt, base))
                print(f"{fmt} h_q {h} T {T}: one call {one * 1e3:.1f} us, two slices {two * 1e3:.1f}, default "
                      f"{dflt * 1e3:.1f}, PyTorch {base * 1e3:.1f}", flush=True)
    print(f"\n{'cache':<10} {'h_q':>4} {'T':>5} {'one call us':>11} {'two slices':>10} {'two/one':>7} "
          f"{'default':>8} {'TFLOP/s':>8} {'PyTorch us':>10}")
    for fmt, h, T, one, two, dflt, base in rows:
        print(f"{fmt:<10} {h:4d} {T:5d} {one * 1e3:11.1f} {two * 1e3:10.1f} {two / one:7.2f} {dflt * 1e3:8.1f} "
              f"{2.0 * T * h * TOPK * (D_QK + D_V) / dflt / 1e9:8.1f} {base * 1e3:10.1f}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default=",".join(map(str, HEADS)))
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--threshold", action="store_true")
    a = ap.parse_args()
    if a.threshold:
        threshold()
    else:
        run([int(x) for x in a.heads.split(",")], a.cases.split(","))
