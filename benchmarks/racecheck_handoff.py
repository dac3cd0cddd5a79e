"""What compute-sanitizer's racecheck makes of the hand-off the Hopper kernels use between warp-specialised partitions
(``benchmarks/run_sanitizer.sh`` found hazards on them): every thread of a 4-warp worker partition stores to shared
memory, the partition meets at its own barrier (``gl.thread_barrier``: ``bar.sync id, 128``), one thread arrives on an
mbarrier (``mbarrier.arrive``, release at CTA scope), and the default partition waits on it (acquire) and reads what
other threads stored. Under PTX's memory model the barrier and the release are cumulative, so every store happens
before every read. Variants:

* ``one``: as the kernels do (one arrival after the partition's barrier; the mbarrier's count 1);
* ``loop``: the ping-pong's running max (``kernel_sm90._math_pp``): one slot written and read by both partitions in
  turn, ``ROUNDS`` rounds (the default partition writes and arrives on mbarrier 0; the worker waits on it, reads,
  writes its own value and arrives on mbarrier 1; the default waits on that and reads), the phases alternating;
* ``none``: no hand-off at all (the default partition reads what the parent region stored before the
  warp-specialised region began): Triton's own start of the region alone.

Each variant's result is checked (the default partition must read the worker's values). Run it under the tool:

    compute-sanitizer --tool racecheck python3 benchmarks/racecheck_handoff.py [one|loop|none]
"""
from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

N = gl.constexpr(128)
ROUNDS = gl.constexpr(8)


@gluon.jit
def _loop_default(buf, bar, out_ptr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    i = gl.arange(0, N, layout)
    acc = gl.zeros([N], gl.float32, layout)
    for r in range(ROUNDS):
        buf.store((i + r).to(gl.float32))
        gl.thread_barrier()
        mbarrier.arrive(bar.index(0))
        mbarrier.wait(bar.index(1), r & 1)
        acc += buf.load(layout)
    gl.store(out_ptr + i, acc)


@gluon.jit
def _loop_worker(buf, bar):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    for r in range(ROUNDS):
        mbarrier.wait(bar.index(0), r & 1)
        v = buf.load(layout)  # what a thread of the other partition stored
        buf.store(v * 2.0)
        gl.thread_barrier()
        mbarrier.arrive(bar.index(1))


@gluon.jit
def _loop_kernel(out_ptr):
    buf = gl.allocate_shared_memory(gl.float32, [N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.init(bar.index(1), count=1)
    gl.thread_barrier()
    gl.warp_specialize([(_loop_default, (buf, bar, out_ptr)), (_loop_worker, (buf, bar))], [4], [48])


@gluon.jit
def _reader(buf, bar, out_ptr, MODE: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if MODE == 0:
        mbarrier.wait(bar, 0)
    i = gl.arange(0, N, layout)
    # thread i reads element i, which thread i of the other partition (another warp) stored, and stores it one place
    # down (out[i - 1]): the check in main() sees that each value came from the other partition and where it landed
    vals = buf.load(layout)
    gl.store(out_ptr + (i + N - 1) % N, vals)


@gluon.jit
def _writer(buf, bar, MODE: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    if MODE == 0:
        i = gl.arange(0, N, layout)
        buf.store((i * 3 + 1).to(gl.float32))
        gl.thread_barrier()
        mbarrier.arrive(bar)


@gluon.jit
def _handoff_kernel(out_ptr, MODE: gl.constexpr):
    buf = gl.allocate_shared_memory(gl.float32, [N], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if MODE == 1:
        buf.store(gl.full([N], 1.0, gl.float32, gl.BlockedLayout([1], [32], [4], [0])))
    mbarrier.init(bar, count=1)
    gl.thread_barrier()
    gl.warp_specialize([(_reader, (buf, bar, out_ptr, MODE)), (_writer, (buf, bar, MODE))], [4], [48])


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "one"
    out = torch.full((128,), float("nan"), device="cuda")
    i = torch.arange(128, device="cuda")
    if mode == "loop":
        _loop_kernel[(1,)](out, num_warps=4)
        want = sum(2.0 * (i + r) for r in range(8)).float()
    else:
        _handoff_kernel[(1,)](out, MODE={"one": 0, "none": 1}[mode], num_warps=4)
        want = torch.ones(128, device="cuda") if mode == "none" else ((i + 1) % 128 * 3 + 1).float()
    torch.cuda.synchronize()
    print(mode, "values", "ok" if torch.equal(out, want) else f"WRONG {out[:8].tolist()}")


if __name__ == "__main__":
    main()
