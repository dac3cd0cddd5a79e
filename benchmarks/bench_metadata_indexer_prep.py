"""GPU benchmark: index conversion / ragged metadata (dsa.metadata) and indexer q/k preparation
(dsa.indexer_prep). All memory-bound: reported as GB/s of the bytes that must move (each input read
once, each output written once) against the measured H200 copy ceiling, next to the PyTorch
reference measured in the same run, plus a small sweep of launch configurations. Large shapes move
several times the 60 MB L2; the decode-sized ones are launch-bound and reported in microseconds.

    python benchmarks/bench_metadata_indexer_prep.py
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton

from dsa.constants import H200_BF16_FLOPS, H200_COPY_BYTES_PER_S
from dsa.indexer_prep import prepare_indexer_k, prepare_indexer_q
from dsa.indexer_prep.kernel import prepare_indexer_k_triton, prepare_indexer_q_triton
from dsa.indexer_prep.reference import prepare_indexer_k_ref, prepare_indexer_q_ref
from dsa.metadata import convert_req_index_to_global_index, generate_sparse_seqlen
from dsa.metadata.kernel import convert_req_index_to_global_index_triton
from dsa.metadata.reference import convert_req_index_to_global_index_ref, generate_sparse_seqlen_ref


SMALL = not torch.cuda.is_available()  # CPU dry run (TRITON_INTERPRET=1): tiny shapes, one call each


def bench(fn) -> float:
    if SMALL:
        import time

        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e-3  # seconds


def bench_graph(fn) -> float:
    """GPU time alone (launch overhead removed): fn captured in a CUDA graph, replays timed."""
    if SMALL:
        return bench(fn)
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e-3


ROWS = []


def add(name, shape, nbytes, t, t_torch, flops=None, ok=""):
    ROWS.append((name, shape, t * 1e6, nbytes / t / 1e9, 100 * nbytes / t / H200_COPY_BYTES_PER_S,
                 (100 * flops / t / H200_BF16_FLOPS) if flops else None, t_torch * 1e6 if t_torch else None, ok))


def same_q(got, ref, exact):
    """'ok' when the kernel's (q_fp8, weights) match the reference as the tests demand."""
    qg, wg = got
    qr, wr = ref[0], ref[1]
    if exact:
        return "ok" if torch.equal(qg.view(torch.uint8), qr.view(torch.uint8)) and torch.equal(wg, wr) else "BAD"
    mism = (qg.view(torch.uint8) != qr.view(torch.uint8)).float().mean().item()
    far = ((wg - wr).abs() > 2.0**-19 * wr.abs()).float().mean().item()
    return "ok" if mism < 1e-3 and far <= 1e-4 else f"BAD {mism:.1e}/{far:.1e}"


def convert_inputs(T, K, R, B, dev):
    g = torch.Generator(device="cpu").manual_seed(0)
    lens = torch.randint(2000, 60000, (R,), generator=g)
    need = (lens + B - 1) // B
    mb = int(need.max())
    perm = torch.randperm(int(need.sum()) + 7, generator=g).to(torch.int32)
    bt = torch.full((R, mb), -1, dtype=torch.int32)
    pos = 0
    for r in range(R):
        bt[r, : need[r]] = perm[pos : pos + need[r]]
        pos += int(need[r])
    req = torch.randint(0, R, (T,), generator=g, dtype=torch.int32)
    idx = (torch.rand(T, K, generator=g) * lens[req.long()][:, None]).to(torch.int32)
    idx[torch.rand(T, K, generator=g) < 0.1] = -1
    return req.to(dev), bt.to(dev), idx.to(dev)


def bench_metadata(dev):
    B = 64
    for T, K in (((8192, 2048), (128, 2048)) if not SMALL else ((8, 64),)):
        req, bt, ti = convert_inputs(T, K, 64, B, dev)
        out = torch.empty(T, K, dtype=torch.int32, device=dev)
        nbytes = T * K * 8 + T * 4
        t_ref = bench(lambda: convert_req_index_to_global_index_ref(req, bt, ti, B))
        configs = ((256, 4), (512, 4), (1024, 4), (1024, 8), (2048, 8)) if T > 1000 else ((512, 4), (2048, 8))
        ref = convert_req_index_to_global_index_ref(req, bt, ti, B)
        for bn, nw in configs:
            fn = lambda: convert_req_index_to_global_index_triton(req, bt, ti, B, out, None, None,  # noqa: E731
                                                                  block_n=bn, num_warps=nw)
            out.fill_(-7)
            fn()
            add(f"convert dense BLOCK_N={bn} w={nw}", f"T={T} K={K} B={B}", nbytes, bench(fn), t_ref,
                ok="ok" if torch.equal(out, ref) else "BAD")
        cnt = torch.zeros(T, dtype=torch.int32, device=dev)
        t = bench(lambda: convert_req_index_to_global_index_triton(req, bt, ti, B, out, None, cnt))
        add("convert dense+counts (kernel only)", f"T={T} K={K} B={B}", nbytes + T * 4, t, None)
        t = bench(lambda: convert_req_index_to_global_index(req, bt, ti, B, out=out, valid_counts_out=cnt))
        add("convert dense+counts (public)", f"T={T} K={K} B={B}", nbytes + T * 4, t, None)
        t = bench_graph(lambda: convert_req_index_to_global_index(req, bt, ti, B, out=out, valid_counts_out=cnt))
        add("convert dense+counts (public, graph)", f"T={T} K={K} B={B}", nbytes + T * 4, t, None)
        # one token per request with 3000 context tokens: every row keeps all K entries
        n = generate_sparse_seqlen(torch.arange(0, T + 1, dtype=torch.int32, device=dev),
                                   torch.full((T,), 3000, dtype=torch.int32, device=dev), K)
        indptr = torch.zeros(T + 1, dtype=torch.int32, device=dev)
        indptr[1:] = torch.cumsum(n, 0)
        packed = torch.empty(T * K, dtype=torch.int32, device=dev)
        fn = lambda: convert_req_index_to_global_index(req, bt, ti, B, indptr=indptr, out=packed,  # noqa: E731
                                                       valid_counts_out=cnt)
        t_ref = bench(lambda: convert_req_index_to_global_index_ref(req, bt, ti, B, indptr=indptr, out=packed))
        add("convert CSR+counts (public)", f"T={T} K={K} B={B}", nbytes + T * 4, bench(fn), t_ref)
        add("convert CSR+counts (public, graph)", f"T={T} K={K} B={B}", nbytes + T * 4, bench_graph(fn), None)
    # sparse seqlens: 256 requests, 8192 tokens (a mix of long prefills and decodes)
    R, T = (256, 8192) if not SMALL else (8, 40)
    g = torch.Generator(device="cpu").manual_seed(1)
    q = torch.randint(1, 2 * T // R, (R,), generator=g)
    q = (q * T / q.sum()).floor().long().clamp_min(1)
    qsl = torch.zeros(R + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(q, 0)
    L = (q + torch.randint(0, 10000, (R,), generator=g)).to(torch.int32)
    qsl, L = qsl.to(dev), L.to(dev)
    Tn = int(qsl[-1])
    out = torch.empty(Tn, dtype=torch.int32, device=dev)
    t_ref = bench(lambda: generate_sparse_seqlen_ref(qsl, L, 2048, num_tokens=Tn))
    fn = lambda: generate_sparse_seqlen(qsl, L, 2048, out=out)  # noqa: E731
    fn()
    ok = "ok" if torch.equal(out, generate_sparse_seqlen_ref(qsl, L, 2048, num_tokens=Tn)) else "BAD"
    add("generate_sparse_seqlen", f"R={R} T={Tn}", Tn * 4 + R * 8, bench(fn), t_ref, ok=ok)
    add("generate_sparse_seqlen (graph)", f"R={R} T={Tn}", Tn * 4 + R * 8, bench_graph(fn), None)


def bench_indexer_prep(dev):
    for T in ((8192, 64) if not SMALL else (3,)):
        q = torch.randn(T, 64, 128, device=dev).to(torch.bfloat16)
        ang = torch.rand(T, 32, device=dev) * 6
        cos, sin = ang.cos(), ang.sin()
        w = torch.randn(T, 64, device=dev)
        qo = torch.empty(T, 64, 128, dtype=torch.float8_e4m3fn, device=dev)
        wo = torch.empty(T, 64, dtype=torch.float32, device=dev)
        nbytes = T * 64 * 128 * 3 + T * 64 * 8 + T * 32 * 8
        for had in (False, True):
            flops = 2 * T * 64 * 128 * 128 if had else None
            ref = prepare_indexer_q_ref(q, cos, sin, w, hadamard=had)
            t_ref = bench(lambda: prepare_indexer_q_ref(q, cos, sin, w, hadamard=had))
            if T > 1000:
                configs = ((32, 4, 8), (32, 4, 16), (32, 4, 0), (16, 4, 0), (64, 4, 0), (64, 8, 0), (32, 2, 0)) \
                    if not had else ((64, 8, 2), (64, 8, 4), (64, 8, 8), (64, 4, 8), (32, 4, 16), (64, 16, 2))
            else:
                configs = ((None, None, None),)
            for bh, nw, ps in configs:
                fn = lambda: prepare_indexer_q_triton(q, cos, sin, w, qo, wo, None, interleaved=False,  # noqa: E731
                                                      hadamard=had, scale_fmt="ue8m0", block_h=bh,
                                                      num_warps=nw, per_sm=ps)
                fn()
                ok = same_q((qo, wo), ref, exact=not had)
                add(f"prep q had={int(had)} BH={bh} w={nw} psm={ps}", f"T={T}", nbytes, bench(fn), t_ref, flops, ok)
            fn = lambda: prepare_indexer_q(q, cos, sin, w, hadamard=had, out=(qo, wo))  # noqa: E731
            add(f"prep q had={int(had)} (public, graph)", f"T={T}", nbytes, bench_graph(fn), None, flops)
    for T in ((262144, 64) if not SMALL else (50,)):
        k = torch.randn(T, 128, device=dev).to(torch.bfloat16)
        ang = torch.rand(T, 32, device=dev) * 6
        cos, sin = ang.cos(), ang.sin()
        nbytes = T * 128 * 4 + T * 32 * 8
        ko = torch.empty_like(k)
        for had in (False, True):
            flops = 2 * T * 128 * 128 if had else None
            ref = prepare_indexer_k_ref(k, cos, sin, hadamard=had)
            t_ref = bench(lambda: prepare_indexer_k_ref(k, cos, sin, hadamard=had))
            if T > 1000:
                configs = ((16, 4, 8), (16, 4, 0), (32, 4, 0), (16, 2, 0), (64, 8, 0)) if not had else \
                    ((16, 4, 8), (16, 4, 16), (16, 4, 0), (32, 4, 8))
            else:
                configs = ((None, 4, None),)
            for bt, nw, ps in configs:
                fn = lambda: prepare_indexer_k_triton(k, cos, sin, ko, interleaved=False, hadamard=had,  # noqa: E731
                                                      block_t=bt, num_warps=nw, per_sm=ps)
                fn()
                if had:
                    ok = "ok" if (ko != ref).float().mean().item() < 1e-3 else "BAD"
                else:
                    ok = "ok" if torch.equal(ko, ref) else "BAD"
                add(f"prep k had={int(had)} BT={bt} w={nw} psm={ps}", f"T={T}", nbytes, bench(fn), t_ref, flops, ok)
            fn = lambda: prepare_indexer_k(k, cos, sin, hadamard=had, out=ko)  # noqa: E731
            add(f"prep k had={int(had)} (public, graph)", f"T={T}", nbytes, bench_graph(fn), None, flops)


def main():
    dev = "cpu" if SMALL else "cuda"
    name = "CPU dry run (interpreter)" if SMALL else torch.cuda.get_device_name()
    print("device:", name, "| torch", torch.__version__, "| triton", triton.__version__)
    bench_metadata(dev)
    bench_indexer_prep(dev)
    lines = [f"{'op':40s} {'shape':20s} {'us':>8s} {'GB/s':>7s} {'%copy':>5s} {'%bf16':>5s} {'torch us':>8s} "
             f"{'x':>5s} chk"]
    for name, shape, us, gbs, pct, pf, tus, ok in ROWS:
        lines.append(f"{name:40s} {shape:20s} {us:8.2f} {gbs:7.1f} {pct:5.1f} "
                     f"{(f'{pf:5.1f}' if pf is not None else '    -')} "
                     f"{(f'{tus:8.1f}' if tus is not None else '       -')} "
                     f"{(f'{tus / us:5.1f}' if tus is not None else '    -')} {ok}")
    text = "\n".join(lines)
    out_dir = os.environ.get("OUT")
    if out_dir:
        with open(os.path.join(out_dir, "bench_metadata_indexer_prep.txt"), "w") as f:
            f.write(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
