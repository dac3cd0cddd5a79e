"""Benchmark dsa.sample_tokens (Triton kernels, top-p without a sort) against the PyTorch reference, and the later
candidates' chunked rounds (``dsa.sampling.kernel.ROUNDS``) against the one-program walk alone (``ROUNDS`` 0).

    python benchmarks/bench_sampling.py                 # [B, 129280] fp32 logits, B 1-256, three kinds of rows
    python benchmarks/bench_sampling.py --rounds 0 2    # only these round counts
    TRITON_INTERPRET=1 python benchmarks/bench_sampling.py --cpu-smoke   # tiny shapes, checks the script itself
    python benchmarks/bench_sampling.py --count         # any machine: SASS per logit (sm_90) and the issue floor

Rows (seeded by B): ``randn*3`` (``engine_step_split.py``'s logits), ``hot`` (randn plus 8 on 200 random tokens:
a few tokens hold most of the mass, spread over every chunk), ``flat`` (randn * 0.3: the nucleus is most of the
vocabulary). Temperature 0.8. Times: CUDA-graph medians (``triton.testing.do_bench_cudagraph``), µs. "rejected" is
how many rows' first candidate (the argmax of ``z + g`` over the whole row) lies outside the nucleus: those rows
need later candidates, which cost the time above the top-p 1 column. Every kernel configuration's tokens are checked
against the reference's first ("same" column; a mismatch is a rounding tie at the nucleus' edge, see
``dsa.sampling.kernel``). GB/s: the logits read once (B x V x 4 bytes) over the kernel's time at top-p 1, and its
share of the H200's 4.3 TB/s copy ceiling (``dsa.constants``) on whatever GPU runs it.

``--count`` (no GPU, no ``TRITON_INTERPRET``) compiles the chunked kernels for sm_90 and counts their SASS
instructions per logit (:func:`sass_per_logit`; each program's chunk is one block, so the count is what a program
issues when no branch is skipped), then the time an SM's four schedulers need to issue them for ``[B, 129280]``
rows at the boost clock: the sampler's floor where the instructions, not the logits' bytes, are the bound.
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


#: the H200's (and H100 SXM's) boost clock, Hz, and warp instructions an SM issues per clock (four schedulers)
BOOST_HZ, ISSUE_PER_CLOCK = 1.98e9, 4


def sass_per_logit() -> dict:
    """SASS instructions per logit per thread of pass 1 (top-p 1 and top-p) and of the first candidate's pass,
    compiled for sm_90 on any machine (run without ``TRITON_INTERPRET``), with the exact noise of every token
    (``NOISE`` 0) and with the screen (2: one turn of its loop, the usual count; each further turn adds a few
    instructions per logit). It also counts the per-row counter forms of the kernel (140e3f0, 37fae39, not on
    ``main``), whose passes take ``cnt``, ``st``, ``R`` and ``NCNT``."""
    from bulk_gather import compile_sm90, sass_counts

    ptrs = {"x_ptr": "*fp32", "seeds_ptr": "*i64", "part_f": "*fp32", "part_i": "*i32", "chk_f": "*fp32",
            "chk_i": "*i32", "cnt": "*i32", "st": "*i32"}
    common = dict(U_BITS=K.U_BITS, G_MAX=K.G_MAX, CHUNK=K.CHUNK, BLOCK=K.CHUNK, R=0, NCNT=4)
    per_thread = K.CHUNK / (32 * K.CHUNK_WARPS)
    out = {}
    for noise in (0, 2):
        for name, fn, consts in (("pass 1, top-p 1", K._sample_partials_kernel, dict(CUT=False)),
                                 ("pass 1, top-p", K._sample_partials_kernel, dict(CUT=True)),
                                 ("first candidate's pass", K._sample_check_kernel, dict(S_P2=32))):
            args = set(fn.arg_names)
            k = compile_sm90(fn, {n: v for n, v in {**common, **consts, "NOISE": noise}.items() if n in args},
                             {n: t for n, t in ptrs.items() if n in args}, K.CHUNK_WARPS, floats=("inv_t", "top_p"))
            form = "exact noise" if noise == 0 else "screen"
            out[f"{name}, {form}"] = sum(sass_counts(k, ("",)).values()) / per_thread
    return out


def print_counts(batches, V: int = 129280) -> None:
    from dsa.constants import H200_NUM_SMS

    rate = H200_NUM_SMS * ISSUE_PER_CLOCK * BOOST_HZ  # warp instructions per second
    counts = sass_per_logit()
    print(f"SASS per logit (sm_90) and the time to issue them over [B, {V}] rows on {H200_NUM_SMS} SMs at "
          f"{BOOST_HZ / 1e9:.2f} GHz, µs")
    print("| kernel | SASS per logit | " + " | ".join(f"B {b}" for b in batches) + " |")
    print("|---|---|" + "---|" * len(batches))
    for name, n in counts.items():
        print(f"| {name} | {n:.1f} | " + " | ".join(f"{b * V * n / 32 / rate * 1e6:.1f}" for b in batches) + " |")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, nargs="+", default=[0, 1, 2, 3])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 16, 64, 256])
    ap.add_argument("--top-p", type=float, nargs="+", default=[0.95, 0.8])
    ap.add_argument("--kinds", nargs="+", default=["randn*3", "hot", "flat"])
    ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on the CPU (TRITON_INTERPRET=1)")
    ap.add_argument("--count", action="store_true", help="SASS per logit and the issue floor (any machine)")
    args = ap.parse_args(argv)
    if args.count:
        return print_counts(args.batches)
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
