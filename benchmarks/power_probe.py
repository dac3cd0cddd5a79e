"""What clock and power the GPU runs each goal kernel at: every case runs back to back for a few seconds while
``nvidia-smi`` samples the SM clock, the board power and the active clock-event reasons (H200).

    python benchmarks/power_probe.py [SECONDS]

Prints, per case: ms per launch, the median SM clock (MHz), median power (W) against the limit, the share of
samples with the software power cap active, and the largest temperature. The fp8 matmul row (torch._scaled_mm,
8192^3) is how the 1270 TFLOP/s ceiling of dsa.constants was measured.
"""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from dsa import bench as B  # noqa: E402
from dsa.layouts import indexer_cache_blocks  # noqa: E402
from dsa.mla import sparse_mla  # noqa: E402
from dsa.mqa_logits import kernel as LK  # noqa: E402

FIELDS = "clocks.sm,power.draw,power.limit,temperature.gpu,{}.sw_power_cap"


def fields():
    """The query fields this driver knows (``clocks_event_reasons`` since driver 535, ``clocks_throttle_reasons``
    before)."""
    for name in ("clocks_event_reasons", "clocks_throttle_reasons"):
        f = FIELDS.format(name)
        r = subprocess.run(["nvidia-smi", f"--query-gpu={f}", "--format=csv,noheader,nounits"], capture_output=True,
                           text=True)
        if r.returncode == 0 and len(r.stdout.split(",")) == 5:
            return f
    raise SystemExit("nvidia-smi knows neither clock-event field: " + r.stdout + r.stderr)


def cases():
    g = torch.Generator(device="cuda").manual_seed(1)
    for nn in (1, 2):
        q, cache, w, ctx, bt, max_len = B.indexer_decode_inputs(64, 32768, 131072, 64, nn, g, "cuda")
        out = torch.empty(64 * nn, max_len, dtype=torch.float32, device="cuda")
        blocks = indexer_cache_blocks(cache)
        yield (f"indexer decode logits, block 64, next_n {nn}",
               lambda q=q, blocks=blocks, w=w, ctx=ctx, bt=bt, m=max_len, out=out:
               LK.fp8_paged_mqa_logits_triton(q, blocks, w, ctx, bt, m, True, out))
    for h in (128, 32, 16):
        q, kv, idx = B.mla_inputs(*B.MLA_SHAPES[f"prefill_bf16_h{h}"])
        out = torch.empty(q.shape[0], q.shape[1], 512, dtype=torch.bfloat16, device="cuda")
        yield (f"MLA prefill bf16 h{h}",
               lambda q=q, kv=kv, idx=idx, out=out: sparse_mla(q, kv, idx, 192 ** -0.5, out=out, backend="triton"))
        q = kv = idx = out = None
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    yield "torch fp8 matmul 8192^3", lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)


def sampled(fn, secs, query, per_sync=10):
    """Run ``fn`` back to back for ``secs`` seconds (``per_sync`` launches between host syncs) while ``nvidia-smi``
    samples ``query`` every 50 ms: ``(ms per launch, nvidia-smi's output)``."""
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "50"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(0.3)
    n, t0 = 0, time.perf_counter()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while time.perf_counter() - t0 < secs:
        for _ in range(per_sync):
            fn()
        n += per_sync
        torch.cuda.synchronize()
    end.record()
    torch.cuda.synchronize()
    smi.terminate()
    return start.elapsed_time(end) / n, smi.communicate()[0]


def main():
    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
    rows = []
    query = fields()
    for name, fn in cases():
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        ms, text = sampled(fn, secs, query)
        samples = []
        for line in text.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 5:
                try:
                    samples.append((float(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]), parts[4]))
                except ValueError:
                    pass
        keep = samples[len(samples) // 5:]  # drop the ramp
        if not keep:
            print(name, "no nvidia-smi samples:", text[:300])
            continue
        row = (name, ms, statistics.median(s[0] for s in keep),
               statistics.median(s[1] for s in keep), keep[0][2], max(s[3] for s in keep),
               100 * sum(s[4] == "Active" for s in keep) / len(keep), len(keep))
        rows.append(row)
        print(row, flush=True)
    print(f"\n{'case':<40}{'ms/launch':>10}{'SM MHz':>8}{'W':>7}{'limit W':>9}{'max C':>7}{'power cap':>11}{'n':>5}")
    for r in rows:
        print(f"{r[0]:<40}{r[1]:>10.4f}{r[2]:>8.0f}{r[3]:>7.0f}{r[4]:>9.0f}{r[5]:>7.0f}{r[6]:>10.0f}%{r[7]:>5}")


if __name__ == "__main__":
    main()
