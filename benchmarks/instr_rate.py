"""How many of one SASS instruction an SM issues per clock: the instructions the small-head fp8 decode kernels spend
their tiles on (``dsa.mla.kernel_bulk``: fp8 -> f16 conversions, byte permutes, FMAs; BENCHMARKS.md).

Each CTA (one per SM, 132 CTAs, ``W`` warps) runs ``iters`` rounds in which every thread applies the instruction (inline
PTX) to each of its ``CHAINS`` independent registers, so ``W * CHAINS`` chains are in flight per SM and the result of
one round feeds the next. ``%clock64`` is read before and after the loop. Printed per instruction and warp count:
warp-instructions per clock per SM (median over the CTAs) and clocks per warp-instruction on one of the SM's four
sub-partitions. A pair ``a+b`` runs both in every round on separate chains: if it takes the sum of their times they
share a pipe; if the longer one, they run side by side.

Run on the GPU: ``python benchmarks/instr_rate.py [ITERS]``; ``--latency``: the rate against the chains per thread at
4 warps; ``--compile-only`` (CPU) prints each variant's SASS counts.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

CHAINS = 8

#: name: (PTX with $0 the result and $1 / $2 two inputs of the chain, SASS mnemonic it should compile to). Integer
#: chains that ptxas can fold (adds of a constant, LOP3 of LOP3 on the same inputs) are left out: their count shrinks.
OPS = {
    "cvt_e4m3x2_f16x2": ("{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 $0, l; }", "F2FP"),
    "prmt": ("prmt.b32 $0, $1, $2, 0x5140;", "PRMT"),
    "ffma": ("{ .reg .f32 a, b; mov.b32 a, $1; mov.b32 b, $2; fma.rn.f32 a, a, b, b; mov.b32 $0, a; }", "FFMA"),
    "hfma2": ("fma.rn.f16x2 $0, $1, $2, $2;", "HFMA2"),  # (ptxas issues half of them as HFMA2.MMA)
    "movmatrix": ("movmatrix.sync.aligned.m8n8.trans.b16 $0, $1;", "MOVM"),
    "hmma": ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5, $4, $5}, {$5, $4},"
             " {$0, $1, $2, $3};", "HMMA"),
    "hmma_f16acc": ("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {$0, $1}, {$2, $3, $2, $3}, {$3, $2}, {$0, $1};",
                    "HMMA"),
    "hmma_k8": ("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {$0, $1, $2, $3}, {$4, $5}, {$5},"
                " {$0, $1, $2, $3};", "HMMA"),
    "ex2": ("{ .reg .f32 a; mov.b32 a, $1; ex2.approx.ftz.f32 a, a; mov.b32 $0, a; }", "MUFU"),
}
#: pairs run on separate chains in the same round
PAIRS = (("cvt_e4m3x2_f16x2", "prmt"), ("cvt_e4m3x2_f16x2", "ffma"), ("cvt_e4m3x2_f16x2", "hfma2"),
         ("movmatrix", "cvt_e4m3x2_f16x2"), ("movmatrix", "prmt"), ("prmt", "ffma"), ("hmma", "cvt_e4m3x2_f16x2"),
         ("hmma", "prmt"))


@triton.jit
def _clock(x):
    return tl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [x], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _rate_kernel(out_ptr, clk_ptr, iters, ASM_A: tl.constexpr, ASM_B: tl.constexpr, E: tl.constexpr,
                 CH: tl.constexpr):
    offs = tl.arange(0, E)
    lane = tl.reshape(offs, [E // CH, CH])
    x = (lane * 40503 + tl.program_id(0) * 7 + 0x3C003C00).to(tl.int32)
    y = x ^ 0x12345
    z = x + 0x01010101
    t0 = _clock(tl.min(tl.min(x, 1), 0))
    c1 = x + 1
    c2 = x + 2
    c3 = x + 3
    for _ in range(iters):
        if ASM_A.startswith("mma.sync.aligned.m16n8k16.row.col.f16"):  # two accumulator registers per chain
            x, c1 = tl.inline_asm_elementwise(ASM_A, "=r,=r,r,r,0,1", [y, z, x, c1], dtype=(tl.int32, tl.int32),
                                              is_pure=True, pack=1)
        elif ASM_A.startswith("mma"):  # four accumulator registers per chain, read and written in place ("+r")
            x, c1, c2, c3 = tl.inline_asm_elementwise(ASM_A, "=r,=r,=r,=r,r,r,0,1,2,3", [y, z, x, c1, c2, c3],
                                                      dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                      pack=1)
        else:
            x = tl.inline_asm_elementwise(ASM_A, "=r,r,r", [x, y], dtype=tl.int32, is_pure=True, pack=1)
        if ASM_B != "":
            z = tl.inline_asm_elementwise(ASM_B, "=r,r,r", [z, y], dtype=tl.int32, is_pure=True, pack=1)
    x = x + c1 + c2 + c3
    t1 = _clock(tl.min(tl.min(x + z, 1), 0))
    tl.store(out_ptr + tl.program_id(0) * E + lane, x + z)
    tl.store(clk_ptr + 2 * tl.program_id(0), t1 - t0)
    smid = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [tl.min(tl.min(x, 1), 0)], dtype=tl.int32,
                                     is_pure=False, pack=1)
    tl.store(clk_ptr + 2 * tl.program_id(0) + 1, smid.to(tl.int64))


def _variants():
    for w in (4, 8, 16):
        for name in OPS:
            yield name, "", w
        for a, b in PAIRS:
            yield a, b, w


def compile_sm90(a: str, b: str = "", w: int = 4, chains: int = CHAINS):
    """The variant (instruction ``a``, optional pair ``b``, ``w`` warps, ``chains`` per thread) compiled for sm_90a on
    any machine."""
    from triton.backends.compiler import GPUTarget

    sig = {"out_ptr": "*i32", "clk_ptr": "*i64", "iters": "i32", "ASM_A": "constexpr", "ASM_B": "constexpr",
           "E": "constexpr", "CH": "constexpr"}
    consts = {(3, ): OPS[a][0], (4, ): OPS[b][0] if b else "", (5, ): chains * 32 * w, (6, ): chains}
    return triton.compile(triton.compiler.ASTSource(_rate_kernel, sig, consts), target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=w))


def compile_only() -> None:
    """CPU: compile every variant at 4 warps for sm_90a and print the SASS count of each instruction's mnemonic."""
    from bulk_gather import sass_counts

    for a, b, w in _variants():
        if w == 4:
            mn = {OPS[a][1]} | ({OPS[b][1]} if b else set())
            print(f"{a}{'+' + b if b else ''}: {sass_counts(compile_sm90(a, b, w), tuple(mn))}")


def _clocks(a: str, b: str, w: int, chains: int, iters: int) -> float:
    """Run the variant on every SM; the median over the CTAs of the loop's SM clocks."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    e = chains * 32 * w
    out = torch.empty(sms * e, dtype=torch.int32, device=dev)
    clk = torch.zeros(sms, 2, dtype=torch.int64, device=dev)
    _rate_kernel[(sms, )](out, clk, iters, OPS[a][0], OPS[b][0] if b else "", e, chains, num_warps=w)
    torch.cuda.synchronize()
    if clk[:, 1].unique().numel() != sms:
        print(f"({a} {b} W {w}: the CTAs ran on {clk[:, 1].unique().numel()} SMs, not {sms})")
    return clk[:, 0].double().median().item()


def latency(iters: int = 4096) -> None:
    """The three ``mma.sync`` forms, F2FP and FFMA with 1, 2, 4, 8, 16 and 32 chains per thread at 4 warps (one per
    sub-partition): where the rate stops growing with the chains, the pipe (or the warp's issue) is the bound;
    below, the latency of one chain (about chains x clocks)."""
    print("| instruction | chains per thread | clocks per warp-instruction per SMSP | clocks per round |")
    print("|---|---|---|---|")
    for name in ("hmma", "hmma_f16acc", "hmma_k8", "cvt_e4m3x2_f16x2", "ffma"):
        for ch in (1, 2, 4, 8, 16, 32):
            clocks = _clocks(name, "", 4, ch, iters)
            print(f"| {name} | {ch} | {clocks / (ch * iters):.2f} | {clocks / iters:.1f} |", flush=True)


def main(iters: int = 4096) -> None:
    rows = []
    for a, b, w in _variants():
        clocks = _clocks(a, b, w, CHAINS, iters)
        n = (2 if b else 1) * w * CHAINS * iters  # warp-instructions per SM
        rows.append((a + ("+" + b if b else ""), w, n / clocks, 4 * clocks / n))
        print(f"{rows[-1][0]:30s} W {w:2d}: {rows[-1][2]:6.3f} warp-instr / clock / SM", flush=True)
    print("\n| instruction(s) | warps | warp-instructions per clock per SM | clocks per warp-instruction per SMSP |")
    print("|---|---|---|---|")
    for name, w, rate, per in rows:
        print(f"| {name} | {w} | {rate:.3f} | {per:.2f} |")


if __name__ == "__main__":
    if "--compile-only" in sys.argv:
        compile_only()
    elif "--latency" in sys.argv:
        latency()
    else:
        main(*(int(x) for x in sys.argv[1:2]))
