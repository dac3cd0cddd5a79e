"""Benchmark dsa.sample_tokens (Triton kernels, top-p without a sort) against the PyTorch reference, and the later
candidates' chunked rounds (``dsa.sampling.kernel.ROUNDS``) against the one-program walk alone (``ROUNDS`` 0).

    python benchmarks/bench_sampling.py                 # [B, 129280] fp32 logits, B 1-256, three kinds of rows
    python benchmarks/bench_sampling.py --rounds 0 2    # only these round counts
    TRITON_INTERPRET=1 python benchmarks/bench_sampling.py --cpu-smoke   # tiny shapes, checks the script itself

Rows (seeded by B): ``randn*3`` (``engine_step_split.py``'s logits), ``hot`` (randn plus 8 on 200 random tokens:
a few tokens hold most of the mass, spread over every chunk), ``flat`` (randn * 0.3: the nucleus is most of the
vocabulary). Temperature 0.8. Times: CUDA-graph medians (``triton.testing.do_bench_cudagraph``), µs. "rejected" is
how many rows' first candidate (the argmax of ``z + g`` over the whole row) lies outside the nucleus: those rows
need later candidates, which cost the time above the top-p 1 column. Every kernel configuration's tokens are checked
against the reference's first ("same" column; a mismatch is a rounding tie at the nucleus' edge, see
``dsa.sampling.kernel``). GB/s: the logits read once (B x V x 4 bytes) over the kernel's time at top-p 1, and its
share of the H200's 4.3 TB/s copy ceiling (``dsa.constants``) on whatever GPU runs it.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dsa.sampling.kernel as K  # noqa: E402
from dsa.constants import H200_COPY_BYTES_PER_S  # noqa: E402
from dsa.sampling import nucleus, row_seed, sample_tokens, scaled_logits  # noqa: E402


def make_rows(kind: str, B: int, V: int, dev) -> torch.Tensor:
    g = torch.Generator(device=dev).manual_seed(B * 31 + len(kind))
    if kind == "flat":
        return torch.randn(B, V, device=dev, generator=g) * 0.3
    z = torch.randn(B, V, device=dev, generator=g)
    if kind == "randn*3":
        return z * 3
    hot = torch.randint(0, V, (200,), device=dev, generator=g)
    z[:, hot] += 8.0
    return z


def bench(fn, interpret: bool) -> float:
    if interpret:
        fn()
        return float("nan")
    import triton

    return triton.testing.do_bench_cudagraph(fn) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64, 256])
    ap.add_argument("--top-p", type=float, nargs="+", default=[0.95, 0.8])
    ap.add_argument("--kinds", nargs="+", default=["randn*3", "hot", "flat"])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    args = ap.parse_args(argv)
    interpret = args.cpu_smoke
    dev = "cpu" if interpret else "cuda"
    V = 9000 if interpret else 129280
    batches = [1, 3] if interpret else args.batches
    default_rounds = K.ROUNDS
    T = 0.8
    name = "CPU (interpreter)" if interpret else torch.cuda.get_device_name()
    print(f"sample_tokens over [B, {V}] fp32 logits, T {T}, {name}; CUDA-graph medians, µs; the default ROUNDS is "
          f"{default_rounds}")
    head = " | ".join(f"top-p, ROUNDS {r}" for r in args.rounds)
    print(f"| rows | B | top-p | rejected | top-p 1 (GB/s, % of the H200's copy) | {head} | reference | same |")
    print("|---|---|---|---|---|" + "---|" * len(args.rounds) + "---|---|")
    try:
        for kind in args.kinds:
            for B in batches:
                lg = make_rows(kind, B, V, dev)
                seeds = torch.tensor([row_seed(0, i, 5) for i in range(B)], device=dev)
                K.ROUNDS = default_rounds
                t1 = bench(lambda: sample_tokens(lg, seeds, T, 1.0, backend="triton"), interpret)
                first = sample_tokens(lg, seeds, T, 1.0, backend="triton")
                gbs = B * V * 4 / t1 * 1e-3
                for top_p in args.top_p:
                    want = sample_tokens(lg, seeds, T, top_p, backend="reference")
                    rejected = int((~nucleus(scaled_logits(lg, T), top_p).gather(1, first[:, None])).sum())
                    times, same = [], True
                    for r in args.rounds:
                        K.ROUNDS = r
                        same &= torch.equal(sample_tokens(lg, seeds, T, top_p, backend="triton"), want)
                        times.append(bench(lambda: sample_tokens(lg, seeds, T, top_p, backend="triton"), interpret))
                    K.ROUNDS = default_rounds
                    tr = bench(lambda: sample_tokens(lg, seeds, T, top_p, backend="reference"), interpret)
                    share = gbs * 1e9 / H200_COPY_BYTES_PER_S
                    print(f"| {kind} | {B} | {top_p} | {rejected} | {t1:.1f} ({gbs:.0f}, {share:.1%}) | "
                          + " | ".join(f"{t:.1f}" for t in times) + f" | {tr:.1f} | {same} |", flush=True)
    finally:
        K.ROUNDS = default_rounds


if __name__ == "__main__":
    main()
