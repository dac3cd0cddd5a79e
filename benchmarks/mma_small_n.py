"""What one warpgroup MMA (wgmma, bf16 in, fp32 accumulate) costs on this GPU as N shrinks: the products of the
16/32-head sparse MLA kernels (``dsa.mla.kernel_sm90._math_rows``) have the heads as N.

Each CTA (one warpgroup, one per SM, 132 CTAs) repeats one tile's product ``iters`` times, waiting for it each time as
the kernel does, and reads the SM clock (``%clock64``) before and after. Printed per product and N: SM clocks per
wgmma instruction (m64nNk16; median over the CTAs), what the tensor cores' peak would allow (2048 bf16
multiply-adds per clock per SM, H100/H200 SXM: 989 TFLOP/s at 1.83 GHz), and the rate over all SMs by ``do_bench``.

* ``qk``: S^T [64 rows, N] = K [64, 576] (shared memory, K-major) x q^T (q [N, 576] in shared memory), one tile's QK.
* ``pv``: O^T [512, N] += V^T (the [64 rows, 512] tile read transposed) x P^T [64, N], one tile's P.V.
* ``qk_rs``: as ``qk`` but K's values in registers (loaded once; wgmma's A operand from registers), 512 of the 576.

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
    t0 = _clk()
    for _ in range(iters):
        if MODE == 0:
            acc = warpgroup_mma(ar_smem, br_smem.permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a_smem, b_smem.permute((1, 0)), acc, is_async=True)
        elif MODE == 1:
            acc = warpgroup_mma(a_smem.permute((1, 0)), b_smem, acc, is_async=True)
        else:
            acc = warpgroup_mma(a_reg, b_smem.permute((1, 0)), acc, is_async=True)
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
MODES = {"qk": (0, 36, (16, 32, 64, 128)), "pv": (1, 32, (16, 32)), "qk_rs": (2, 32, (16, 32, 64))}


def main(iters: int = 2000) -> None:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = []
    for name, (mode, n_instr, ns) in MODES.items():
        for n in ns:
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
            ideal = 64 * n * 16 / PEAK_MAC_PER_CLK
            tflops = 2 * 64 * n * 16 * n_instr * iters * sms / ms / 1e9
            rows.append((name, n, per_instr, ideal, tflops))
            print(f"{name:6s} N {n:3d}: {per_instr:6.1f} clocks per m64n{n}k16 (peak {ideal:4.1f}, "
                  f"{ideal / per_instr:5.1%}); {tflops:6.1f} TFLOP/s over {sms} SMs", flush=True)
    print("\n| product | N | clocks per wgmma | at the tensor peak | fraction | TFLOP/s, all SMs |")
    print("|---|---|---|---|---|---|")
    for name, n, per_instr, ideal, tflops in rows:
        print(f"| {name} | {n} | {per_instr:.1f} | {ideal:.1f} | {ideal / per_instr:.0%} | {tflops:.1f} |")


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:2]))
