"""Persistent ping-pong programs (``kernel_sm90.PERSIST``: one program per SM walking the (token, 64-head group)
items, the next item's q and first tiles copied while the last one finishes) against one program per item, in
interleaved rounds, on the unsplit bf16 sparse-MLA launches (prefill; the library takes them for h_q > 64 only, here
both variants are forced with ``config=dict(persist=...)``). Reports the largest difference between the
variants (0: bitwise equal) and the ``do_bench`` medians; with SECONDS > 0 also each variant run back to back for
that long while ``nvidia-smi`` samples the SM clock (both are power-capped on the H200, so a faster kernel can run
at a lower clock). CASES: a comma-separated subset of the case names. H200.

    python benchmarks/ab_mla_persist.py [ROUNDS [SECONDS [CASES]]]
"""
from __future__ import annotations

import os
import sys

import torch
from triton.testing import do_bench

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa.bench import MLA_SHAPES, mla_inputs  # noqa: E402
from dsa.mla.kernel import sparse_mla_triton  # noqa: E402
from power_probe import fields, sampled  # noqa: E402

VARIANTS = {"per item": False, "persistent": True}
# (name, T, h_q, topk, num_req, s_kv, format, causal): causal = topk_length min(t + 1, topk), a prefill from position 0
CASES = [(n, *MLA_SHAPES[n], False) for n in ("prefill_bf16_h128", "prefill_bf16_h64")]
CASES += [("prefill h128 T1024", 1024, 128, 2048, 1, 131072, "bf16", False),
          ("prefill h128 causal", 4096, 128, 2048, 1, 131072, "bf16", True)]


def clock(fn, secs):
    """ms per launch and the median SM clock (MHz) with ``fn`` run back to back for ``secs`` seconds."""
    import statistics

    ms, text = sampled(fn, secs, fields(), per_sync=5)
    mhz = []
    for line in text.splitlines():
        try:
            mhz.append(float(line.split(",")[0]))
        except ValueError:
            pass
    return ms, statistics.median(mhz[len(mhz) // 5:]) if mhz else float("nan")


def main():
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    secs = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else None
    sm = 192 ** -0.5
    rows = []
    for name, T, h_q, topk, nreq, s_kv, fmt, causal in CASES:
        if only and name not in only:
            continue
        q, kv, idx = mla_inputs(T, h_q, topk, nreq, s_kv, fmt)
        tl_ = torch.clamp(torch.arange(1, T + 1, device="cuda"), max=topk).to(torch.int32) if causal else None
        valid = float(tl_.sum()) if causal else float(T * topk)
        flops = 2 * h_q * valid * (576 + 512)
        out = torch.empty(T, h_q, 512, dtype=torch.bfloat16, device="cuda")
        flat = kv.reshape(-1, kv.shape[-1])

        def fn(p):
            return sparse_mla_triton(q, flat, idx, sm, 512, None, tl_, out, config=dict(persist=p))
        res = {}
        for n, v in VARIANTS.items():
            out.fill_(float("nan"))
            _, ml, lse = fn(v)
            torch.cuda.synchronize()
            res[n] = (out.clone(), ml.clone(), lse.clone())
        a, b = res.values()
        d = max((x.float() - y.float()).abs().nan_to_num(0).max().item() for x, y in zip(a, b))
        times = {n: [] for n in VARIANTS}
        for _ in range(rounds):
            for n, v in VARIANTS.items():
                times[n].append(do_bench(lambda: fn(v), warmup=20, rep=200, return_mode="median") * 1e3)
        clocks = {}
        if secs > 0:
            for n, v in VARIANTS.items():
                clocks[n] = clock(lambda: fn(v), secs)
        rows.append((name, d, flops, times, clocks))
        print(name, f"diff {d:.3g}", {k: [round(t, 1) for t in ts] for k, ts in times.items()},
              {k: f"{ms * 1e3:.0f} us at {mhz:.0f} MHz" for k, (ms, mhz) in clocks.items()}, flush=True)
        q = kv = flat = idx = out = res = None
        torch.cuda.empty_cache()
    print(f"\n{'case':<22}{'diff':>6}  " + "".join(f"{n + ' µs (TFLOP/s)':<34}" for n in VARIANTS))
    for name, d, flops, t, _ in rows:
        med = {n: sorted(t[n])[len(t[n]) // 2] for n in VARIANTS}
        base = med["per item"]
        print(f"{name:<22}{d:6.2g}  " + "".join(
            f"{' / '.join(f'{x:.0f}' for x in t[n]) + f' ({flops / med[n] / 1e6:.1f}) {(med[n] / base - 1) * 100:+.1f}%':<34}"
            for n in VARIANTS))
    if secs > 0:
        print(f"\nback to back for {secs:g} s: µs per launch at the median SM clock")
        for name, _, _, _, c in rows:
            print(f"{name:<22}" + "".join(f"{n}: {ms * 1e3:.0f} µs at {mhz:.0f} MHz   " for n, (ms, mhz) in c.items()))


if __name__ == "__main__":
    main()
