"""What one warpgroup MMA (wgmma, bf16 in, fp32 accumulate) costs on this GPU as N shrinks: the products of the
16/32-head sparse MLA kernels (``dsa.mla.kernel_sm90._math_rows``) have the heads as N.

Each CTA (one warpgroup, one per SM, 132 CTAs) repeats one tile's product ``iters`` times, waiting for it each time as
the kernel does, and reads the SM clock (``%clock64``) before and after. Printed per product and N: SM clocks per
wgmma instruction (m64nNk16, fp8 m64nNk32; median over the CTAs), what the tensor cores' peak would allow (2048 bf16
or 4096 e4m3 multiply-adds per clock per SM, H100/H200 SXM: 989 TFLOP/s bf16 at 1.83 GHz), and the rate over all SMs
by ``do_bench``.

* ``qk``: S^T [64 rows, N] = K [64, 576] (shared memory, K-major) x q^T (q [N, 576] in shared memory), one tile's QK.
* ``pv``: O^T [512, N] += V^T (the [64 rows, 512] tile read transposed) x P^T [64, N], one tile's P.V.
* ``qk_rs``: as ``qk`` but K's values in registers (loaded once; wgmma's A operand from registers), 512 of the 576.
* ``qk8``: as ``qk_rs`` with K's 512 values as fp8 e4m3 in registers and q as two fp8 terms (hi + lo, an exact split
  of a bf16 q scaled by a power of two) in shared memory: two m64nNk32 fp8 wgmmas per 32 values.
* ``pv8``: O^T [512, N] += V^T (fp8 in registers) x P^T (two fp8 terms in shared memory): two per 32 rows.

``--overlap`` (GPU): whether fp8 -> f16 conversions, byte permutes or FMAs issued by the same warps run while their
async wgmmas do.

``--latency`` (GPU): a chain of KS m64nNk16 wgmmas (A in registers, loaded once or loaded from fp8 in shared memory
and converted every time, or A in shared memory) and its wait, per iteration, for KS 1-8: the intercept is what one
wait on a chain costs beyond its products.

``--precision`` (GPU): how exact the fp8 products with a two-term q are, against float64 on the same values. Measured
(BENCHMARKS.md, thirty-second session): an fp8 wgmma costs the clocks of a bf16 one with half its K, but its sums are
not exact (up to 1.8e-3 of max |S| chained, 3.4e-4 with every wgmma's result added in fp32), so the sparse MLA
logits, which must match the reference to ``lse`` rtol 2/65536, cannot take fp8 products with a split q.

Run on the GPU: ``python benchmarks/mma_small_n.py [ITERS]``.
"""
from __future__ import annotations

import sys

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

PEAK_MAC_PER_CLK = 2048  # bf16 dense, per SM (H100/H200 SXM)


@gluon.jit
def _clk():
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 1, lay)
    return gl.inline_asm_elementwise("mov.u64 $0, %clock64;", "=l,r", [offs], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def _fill(smem, src_ptr, R: gl.constexpr, C: gl.constexpr, stride, col0):
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    r = gl.arange(0, R, gl.SliceLayout(1, lay))
    c = gl.arange(0, C, gl.SliceLayout(0, lay))
    smem.store(gl.load(src_ptr + r[:, None] * stride + col0 + c[None, :]))


@gluon.jit
def _mma_kernel(a_ptr, b_ptr, clk_ptr, out_ptr, iters, N: gl.constexpr, MODE: gl.constexpr):
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    if MODE == 1:  # pv
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], sh)
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [64, N], gl.NVMMASharedLayout.get_default_for([64, N],
                                                                                                        gl.bfloat16))
        _fill(a_smem, a_ptr, 64, 512, 512, 0)
        _fill(b_smem, b_ptr, 64, N, N, 0)
        acc = gl.zeros([512, N], gl.float32, acc_l)
    elif MODE >= 3:  # fp8: qk8 (A = K [64, 512]), pv8 (A = V^T [512, 64]); B's two terms [2 N, K]
        sh8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128 if MODE == 3 else 64, element_bitwidth=8,
                                                 rank=2)
        acc8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
        AM: gl.constexpr = 64 if MODE == 3 else 512
        AK: gl.constexpr = 512 if MODE == 3 else 64
        a_smem = gl.allocate_shared_memory(gl.float8e4nv, [AM, AK], sh8)
        bh_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, AK], sh8)
        bl_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, AK], sh8)
        _fill(a_smem, a_ptr, AM, AK, AK, 0)
        _fill(bh_smem, b_ptr, N, AK, AK, 0)
        _fill(bl_smem, b_ptr + N * AK, N, AK, AK, 0)
        acc = gl.zeros([AM, N], gl.float32, acc8)
    else:  # qk (the rope part then the values, as the kernel), qk_rs (the values only)
        a_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], sh)
        b_smem = gl.allocate_shared_memory(gl.bfloat16, [N, 512], sh)
        ar_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 64], sh)
        br_smem = gl.allocate_shared_memory(gl.bfloat16, [N, 64], sh)
        _fill(a_smem, a_ptr, 64, 512, 576, 0)
        _fill(b_smem, b_ptr, N, 512, 576, 0)
        _fill(ar_smem, a_ptr, 64, 64, 576, 512)
        _fill(br_smem, b_ptr, N, 64, 576, 512)
        acc = gl.zeros([64, N], gl.float32, acc_l)
    fence_async_shared()
    gl.thread_barrier()
    if MODE == 2:
        a_reg = a_smem.load(gl.DotOperandLayout(0, acc_l, 2))
    if MODE >= 3:
        a_reg = a_smem.load(gl.DotOperandLayout(0, acc8, 4))
    t0 = _clk()
    for _ in range(iters):
        if MODE == 0:
            acc = warpgroup_mma(ar_smem, br_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
        elif MODE == 1:
            acc = warpgroup_mma(a_smem.permute((1, 0)), b_smem, acc, is_async=True)
        elif MODE == 2:
            acc = warpgroup_mma(a_reg, b_smem.permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(a_reg, bh_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a_reg, bl_smem.permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    t1 = _clk()
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 1, lay)
    smid = gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [offs], dtype=gl.int32, is_pure=False, pack=1)
    gl.store(clk_ptr + 2 * gl.program_id(0) + offs, t1 - t0, mask=offs == 0)
    gl.store(clk_ptr + 2 * gl.program_id(0) + 1 + offs, smid.to(gl.int64), mask=offs == 0)
    gl.store(out_ptr + gl.program_id(0) + offs, gl.sum(gl.sum(acc, 1), 0) + offs.to(gl.float32), mask=offs == 0)


#: product: mode id, wgmma instructions per product, the N measured (P.V's accumulator of 512 x N spills past N 32,
#: K's 512 values in registers past N 64)
MODES = {"qk": (0, 36, (16, 32, 64, 128)), "pv": (1, 32, (16, 32)), "qk_rs": (2, 32, (16, 32, 64)),
         "qk8": (3, 32, (16, 32, 64)), "pv8": (4, 32, (16, 32))}
FP8_PEAK_MAC_PER_CLK = 4096  # e4m3 dense, per SM


@gluon.jit
def _prec_kernel(a_ptr, b_ptr, out_ptr, N: gl.constexpr, K: gl.constexpr, TERMS: gl.constexpr):
    """out [64, N] = A [64, K] (fp8, registers) x (B_hi + B_lo)^T (B [2 N, K] fp8, shared memory; TERMS 1: B_hi only),
    every wgmma into one fp32 accumulator, in the order the kernel would issue them (per 32 values: hi, then lo);
    TERMS 3: both terms, each wgmma into a zero accumulator and the results summed in fp32."""
    sh8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128 if K >= 128 else K, element_bitwidth=8, rank=2)
    acc8: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 32])
    a_smem = gl.allocate_shared_memory(gl.float8e4nv, [64, K], sh8)
    bh_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, K], sh8)
    bl_smem = gl.allocate_shared_memory(gl.float8e4nv, [N, K], sh8)
    _fill(a_smem, a_ptr, 64, K, K, 0)
    _fill(bh_smem, b_ptr, N, K, K, 0)
    _fill(bl_smem, b_ptr + N * K, N, K, K, 0)
    fence_async_shared()
    gl.thread_barrier()
    acc = gl.zeros([64, N], gl.float32, acc8)
    zero = gl.zeros([64, N], gl.float32, acc8)
    for k in gl.static_range(K // 32):
        a_k = a_smem.slice(32 * k, 32, dim=1).load(gl.DotOperandLayout(0, acc8, 4))
        if TERMS == 3:  # each wgmma into a zero accumulator, the sums in fp32 on the CUDA cores
            acc += warpgroup_mma(a_k, bh_smem.slice(32 * k, 32, dim=1).permute((1, 0)), zero, use_acc=False)
            acc += warpgroup_mma(a_k, bl_smem.slice(32 * k, 32, dim=1).permute((1, 0)), zero, use_acc=False)
        else:
            acc = warpgroup_mma(a_k, bh_smem.slice(32 * k, 32, dim=1).permute((1, 0)), acc)
            if TERMS == 2:
                acc = warpgroup_mma(a_k, bl_smem.slice(32 * k, 32, dim=1).permute((1, 0)), acc)
    lay: gl.constexpr = gl.BlockedLayout([1, 4], [8, 4], [4, 1], [1, 0])
    r = gl.arange(0, 64, gl.SliceLayout(1, lay))
    c = gl.arange(0, N, gl.SliceLayout(0, lay))
    gl.store(out_ptr + r[:, None] * N + c[None, :], gl.convert_layout(acc, lay))


def split_fp8(x: torch.Tensor):
    """A bf16 ``[N, K]`` as ``(hi, lo, scale)``: ``x · scale == hi + lo`` exactly (fp8 e4m3 terms, ``scale`` a power of
    two per row bringing the row's largest |x| into [128, 256)) except where |x · scale| < 1/4 (lo then rounds to
    e4m3's subnormal step, 2^-9)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    scale = torch.exp2(7 - torch.floor(torch.log2(amax)))
    xs = xf * scale
    hi = xs.to(torch.float8_e4m3fn)
    lo = (xs - hi.float()).to(torch.float8_e4m3fn)
    return hi, lo, scale


def precision() -> None:
    """QK: max |err| / max |exact| of the fp8 products (q as 1 or 2 fp8 terms; 3: both, each wgmma promoted to fp32)
    against float64 on the bf16 q, and against exact arithmetic on the same fp8 terms (the tensor cores' own error).
    P.V: the error against float64 over max |v| times the sum of the weights (the measure of the out tolerance)."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    print("| N | K | K's values | terms | max err / max |S| | max err against exact arithmetic on the same fp8 terms |")
    print("|---|---|---|---|---|---|")
    for n in (16, 32):
        for k in (128, 512):
            for kind in ("normal", "wide"):
                a = torch.randn(64, k, device=dev, generator=g) * (64 if kind == "normal" else 1)
                if kind == "wide":
                    a = a * torch.exp2(torch.randint(-8, 8, (64, k), device=dev, generator=g).float())
                a8 = a.clamp(-448, 448).to(torch.float8_e4m3fn)
                q = torch.randn(n, k, device=dev, generator=g).to(torch.bfloat16)
                if kind == "wide":
                    q = (q.float() * torch.exp2(torch.randint(-6, 6, (n, k), device=dev, generator=g).float())
                         ).to(torch.bfloat16)
                hi, lo, scale = split_fp8(q)
                exact = a8.double() @ q.double().t()
                for terms in (1, 2, 3):
                    host = (a8.double() @ (hi.double() + (lo.double() if terms > 1 else 0)).t()) / scale.double().t()
                    out = torch.empty(64, n, device=dev, dtype=torch.float32)
                    _prec_kernel[(1, )](a8, torch.cat([hi, lo]).contiguous(), out, n, k, terms, num_warps=4)
                    got = out.double() / scale.double().t()
                    err = ((got - exact).abs().max() / exact.abs().max()).item()
                    herr = ((got - host).abs().max() / exact.abs().max()).item()
                    print(f"| {n} | {k} | {kind} | {terms} | {err:.2e} | {herr:.2e} |")
    print("\nP.V: A = 64 value columns x K rows (fp8), B = P^T (softmax weights of random logits, two fp8 terms). "
          "Error / (max |v| · Σ P), the measure of the out tolerance (2^-7):")
    print("| N | K (rows) | terms | max err / (max |v| Σ P) |")
    print("|---|---|---|---|")
    for n in (16, 32):
        for k in (64, 1024):
            v8 = (torch.randn(64, k, device=dev, generator=g) * 64).to(torch.float8_e4m3fn)
            logits = torch.randn(n, k, device=dev, generator=g) * 3
            p = torch.exp(logits - logits.amax(dim=1, keepdim=True))
            hi, lo, scale = split_fp8(p)
            exact = v8.double() @ p.double().t()
            norm = v8.double().abs().max() * p.double().sum(dim=1)[None, :]
            for terms in (2, 3):
                out = torch.empty(64, n, device=dev, dtype=torch.float32)
                _prec_kernel[(1, )](v8, torch.cat([hi, lo]).contiguous(), out, n, k, terms, num_warps=4)
                err = ((out.double() / scale.double().t() - exact).abs() / norm).max().item()
                print(f"| {n} | {k} | {terms} | {err:.2e} |")


#: the streams run beside the products in ``overlap``: one instruction per chain and round (inline PTX)
OTHER = {"cvt": "{ .reg .b16 l, h; mov.b32 {l, h}, $1; cvt.rn.f16x2.e4m3x2 $0, l; }",
         "prmt": "prmt.b32 $0, $1, $1, 0x5140;",
         "ffma": "{ .reg .f32 a; mov.b32 a, $1; fma.rn.f32 a, a, a, a; mov.b32 $0, a; }"}


@gluon.jit
def _overlap_kernel(a_ptr, b_ptr, clk_ptr, out_ptr, iters, N: gl.constexpr, WG: gl.constexpr, ASM: gl.constexpr,
                    ROUNDS: gl.constexpr):
    """Per iteration: one tile's QK (32 async m64nNk16 wgmmas; ``WG`` 1: A in registers as ``qk_rs``, 2: A in shared
    memory as ``qk``, 0: no products), then ``ROUNDS`` rounds of 8 independent chains per thread of the instruction
    ``ASM`` (none if empty) issued while the products run, then the wait."""
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    a_smem = gl.allocate_shared_memory(gl.bfloat16, [64, 512], sh)
    b_smem = gl.allocate_shared_memory(gl.bfloat16, [N, 512], sh)
    _fill(a_smem, a_ptr, 64, 512, 576, 0)
    _fill(b_smem, b_ptr, N, 512, 576, 0)
    fence_async_shared()
    gl.thread_barrier()
    a_reg = a_smem.load(gl.DotOperandLayout(0, acc_l, 2))
    acc = gl.zeros([64, N], gl.float32, acc_l)
    xl: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
    x = gl.arange(0, 1024, xl) * 40503 + 0x3C003C00
    t0 = _clk()
    for _ in range(iters):
        if WG == 1:
            acc = warpgroup_mma(a_reg, b_smem.permute((1, 0)), acc, is_async=True)
        if WG == 2:
            acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
        if ASM != "":
            for r in gl.static_range(ROUNDS):
                x = gl.inline_asm_elementwise(ASM, "=r,r", [x], dtype=gl.int32, is_pure=True, pack=1)
        if WG:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
    t1 = _clk()
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 1, lay)
    gl.store(clk_ptr + 2 * gl.program_id(0) + offs, t1 - t0, mask=offs == 0)
    gl.store(out_ptr + gl.program_id(0) + offs, gl.sum(gl.sum(acc, 1), 0) + gl.sum(x, 0).to(gl.float32)
             + offs.to(gl.float32), mask=offs == 0)


def overlap(iters: int = 1000) -> None:
    """Do other instructions run while the warpgroup's async products do? Clocks per iteration (median over 132
    CTAs) of the products alone, each stream alone, and both; "hidden" is how much of the shorter one runs beside the
    other: (alone + stream alone - both) / the shorter (100%: fully, 0%: additive)."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print("| N | A | stream | rounds (x 8 chains) | products alone | stream alone | both | hidden |")
    print("|---|---|---|---|---|---|---|---|")
    for n, wg in ((16, 1), (32, 1), (16, 2), (32, 2)):
        a = torch.randn(64, 576, device=dev).to(torch.bfloat16)
        b = torch.randn(n, 576, device=dev).to(torch.bfloat16)
        clk = torch.zeros(sms, 2, dtype=torch.int64, device=dev)
        out = torch.empty(sms, dtype=torch.float32, device=dev)

        def clocks(wg, asm, rounds):
            _overlap_kernel[(sms, )](a, b, clk, out, iters, n, wg, asm, rounds, num_warps=4)
            torch.cuda.synchronize()
            return clk[:, 0].double().median().item() / iters

        alone = clocks(wg, "", 1)
        for name in ("cvt", "prmt", "ffma"):
            for rounds in (8, 16, 32):
                s_alone = clocks(0, OTHER[name], rounds)
                both = clocks(wg, OTHER[name], rounds)
                hidden = (alone + s_alone - both) / min(alone, s_alone)
                where = "registers" if wg == 1 else "shared"
                print(f"| {n} | {where} | {name} | {rounds} | {alone:.0f} | {s_alone:.0f} | {both:.0f} | "
                      f"{hidden:.0%} |", flush=True)


@gluon.jit
def _lat_kernel(a_ptr, a8_ptr, b_ptr, clk_ptr, out_ptr, iters, N: gl.constexpr, KS: gl.constexpr, A: gl.constexpr):
    """Per iteration: one chain of ``KS`` m64nNk16 wgmmas (K = 16 ``KS``) into a fresh accumulator, then its wait.
    ``A``: 0 in registers, loaded once; 1 loaded from fp8 in shared memory and converted to f16 every iteration; 2 in
    shared memory."""
    sh: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    sh8: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, N, 16])
    a_l: gl.constexpr = gl.DotOperandLayout(0, acc_l, 2)
    a_smem = gl.allocate_shared_memory(gl.float16, [64, 128], sh)
    a8_smem = gl.allocate_shared_memory(gl.float8e4nv, [64, 128], sh8)
    b_smem = gl.allocate_shared_memory(gl.float16, [N, 128], sh)
    _fill(a_smem, a_ptr, 64, 128, 128, 0)
    _fill(a8_smem, a8_ptr, 64, 128, 128, 0)
    _fill(b_smem, b_ptr, N, 128, 128, 0)
    fence_async_shared()
    gl.thread_barrier()
    a_reg = a_smem.slice(0, 16 * KS, dim=1).load(a_l)
    zero = gl.zeros([64, N], gl.float32, acc_l)
    tot = zero
    t0 = _clk()
    for _ in range(iters):
        if A == 0:
            acc = warpgroup_mma(a_reg, b_smem.slice(0, 16 * KS, dim=1).permute((1, 0)), zero, use_acc=False,
                                is_async=True)
        elif A == 1:
            a16 = a8_smem.slice(0, 16 * KS, dim=1).load(a_l).to(gl.float16)
            acc = warpgroup_mma(a16, b_smem.slice(0, 16 * KS, dim=1).permute((1, 0)), zero, use_acc=False,
                                is_async=True)
        else:
            acc = warpgroup_mma(a_smem.slice(0, 16 * KS, dim=1), b_smem.slice(0, 16 * KS, dim=1).permute((1, 0)),
                                zero, use_acc=False, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        tot += acc
    t1 = _clk()
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    offs = gl.arange(0, 1, lay)
    gl.store(clk_ptr + 2 * gl.program_id(0) + offs, t1 - t0, mask=offs == 0)
    gl.store(out_ptr + gl.program_id(0) + offs, gl.sum(gl.sum(tot, 1), 0) + offs.to(gl.float32), mask=offs == 0)


def latency(iters: int = 2000) -> None:
    """Clocks per iteration (median over 132 CTAs, one warpgroup each) of one chain of KS wgmmas and its wait."""
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    names = ("A in registers (loaded once)", "A from fp8 in shared memory, converted every time", "A in shared memory")
    print("| N | A | KS 1 | KS 2 | KS 4 | KS 8 | slope per wgmma | intercept |")
    print("|---|---|---|---|---|---|---|---|")
    for n in (16, 32):
        a = torch.randn(64, 128, device=dev).to(torch.float16)
        a8 = torch.randn(64, 128, device=dev).to(torch.float8_e4m3fn)
        b = torch.randn(n, 128, device=dev).to(torch.float16)
        clk = torch.zeros(sms, 2, dtype=torch.int64, device=dev)
        out = torch.empty(sms, dtype=torch.float32, device=dev)
        for mode, name in enumerate(names):
            cl = []
            for ks in (1, 2, 4, 8):
                _lat_kernel[(sms, )](a, a8, b, clk, out, iters, n, ks, mode, num_warps=4)
                torch.cuda.synchronize()
                cl.append(clk[:, 0].double().median().item() / iters)
            slope = (cl[3] - cl[1]) / 6
            print(f"| {n} | {name} | " + " | ".join(f"{c:.0f}" for c in cl) + f" | {slope:.1f} | "
                  f"{cl[1] - 2 * slope:.0f} |", flush=True)


def main(iters: int = 2000) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for name, (mode, n_instr, ns) in MODES.items():
        for n in ns:
            if mode >= 3:
                am, ak = (64, 512) if mode == 3 else (512, 64)
                a = torch.randn(am, ak, device=dev).to(torch.float8_e4m3fn)
                b = torch.randn(2 * n, ak, device=dev).to(torch.float8_e4m3fn)
            else:
                a = torch.randn(64, 512 if mode == 1 else 576, device=dev).to(torch.bfloat16)
                b = torch.randn(64 if mode == 1 else n, n if mode == 1 else 576, device=dev).to(torch.bfloat16)
            clk = torch.zeros(sms, 2, dtype=torch.int64, device=dev)
            out = torch.empty(sms, dtype=torch.float32, device=dev)

            def run():
                _mma_kernel[(sms, )](a, b, clk, out, iters, n, mode, num_warps=4)

            ms = triton.testing.do_bench(run, warmup=50, rep=300)
            run()
            torch.cuda.synchronize()
            if clk[:, 1].unique().numel() != sms:
                print(f"(N {n}: the CTAs ran on {clk[:, 1].unique().numel()} SMs, not {sms})")
            per_instr = clk[:, 0].float().median().item() / (iters * n_instr)
            kk = 32 if mode >= 3 else 16
            ideal = 64 * n * kk / (FP8_PEAK_MAC_PER_CLK if mode >= 3 else PEAK_MAC_PER_CLK)
            tflops = 2 * 64 * n * kk * n_instr * iters * sms / ms / 1e9
            rows.append((name, n, per_instr, ideal, tflops))
            print(f"{name:6s} N {n:3d}: {per_instr:6.1f} clocks per m64n{n}k{kk} (peak {ideal:4.1f}, "
                  f"{ideal / per_instr:5.1%}); {tflops:6.1f} TFLOP/s over {sms} SMs", flush=True)
    print("\n| product | N | clocks per wgmma | at the tensor peak | fraction | TFLOP/s, all SMs |")
    print("|---|---|---|---|---|---|")
    for name, n, per_instr, ideal, tflops in rows:
        print(f"| {name} | {n} | {per_instr:.1f} | {ideal:.1f} | {ideal / per_instr:.0%} | {tflops:.1f} |")


if __name__ == "__main__":
    if "--precision" in sys.argv:
        precision()
    elif "--latency" in sys.argv:
        latency()
    elif "--overlap" in sys.argv:
        overlap()
    else:
        main(*(int(x) for x in sys.argv[1:2]))
