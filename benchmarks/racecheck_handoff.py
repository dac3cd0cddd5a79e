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
  warp-specialised region began): Triton's own start of the region alone;
* ``pp`` / ``ppslow``: the ping-pong's own hand-offs, line for line (``_math_pp``'s running max through one
  ``[64]`` slot, then the row sums through ``[128]``), in its layouts (a row of the m64n64 wgmma result, held by
  4 lanes), with a third, idle partition as the producers are; ``ppslow`` sleeps before each wait so that the
  other partition's arrival has already completed the phase when it waits, as in the kernel, where each
  warpgroup's products run between its arrival and the other's wait;
* ``pp1lane`` / ``ppnoidle``: ``pp`` with one change each, to find what in it draws racecheck's reports when ``loop``
  draws none (forty-eighth session): ``pp1lane`` holds each value in one lane (256 values, two per thread, plain
  8-byte shared loads and stores) instead of 4 (a row of the wgmma result), ``ppnoidle`` has no third partition.
  Both still drew the reports (forty-ninth session: 18 and 34).
* ``oneplain`` / ``noneplain`` / ``loopplain``: the controls with plain shared moves. With one value per thread,
  ``one``, ``none`` and ``loop`` move their values by ``stmatrix`` / ``ldmatrix`` (the sm_90a SASS has ``STSM`` /
  ``LDSM`` and no ``STS`` / ``LDS`` for them), while ``pp`` moves them by ``st.shared`` / ``ld.shared``. If racecheck
  does not follow the matrix moves, the controls' silence says nothing about the hand-off. These forms hold 256
  values, two per thread (8-byte ``STS.64`` / ``LDS.64``), with the same arrivals, waits and barriers.

Each variant's result is checked (the default partition must read the worker's values). Run it under the tool:

    compute-sanitizer --tool racecheck python3 benchmarks/racecheck_handoff.py \
        [one|loop|none|pp|ppslow|pp1lane|ppnoidle|oneplain|noneplain|loopplain]
"""
from __future__ import annotations

import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from dsa.mla.kernel_sm90 import _signal  # (the kernel's own: the warpgroup's barrier, then one arrival)

N = gl.constexpr(128)
ROUNDS = gl.constexpr(8)


@gluon.jit
def _loop_default(buf, bar, out_ptr, PLAIN: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1 + PLAIN], [32], [4], [0])
    NV: gl.constexpr = N * (1 + PLAIN)
    i = gl.arange(0, NV, layout)
    acc = gl.zeros([NV], gl.float32, layout)
    for r in range(ROUNDS):
        buf.store((i + r).to(gl.float32))
        gl.thread_barrier()
        mbarrier.arrive(bar.index(0))
        mbarrier.wait(bar.index(1), r & 1)
        acc += buf.load(layout)
    gl.store(out_ptr + i, acc)


@gluon.jit
def _loop_worker(buf, bar, PLAIN: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1 + PLAIN], [32], [4], [0])
    for r in range(ROUNDS):
        mbarrier.wait(bar.index(0), r & 1)
        v = buf.load(layout)  # what a thread of the other partition stored
        buf.store(v * 2.0)
        gl.thread_barrier()
        mbarrier.arrive(bar.index(1))


@gluon.jit
def _loop_kernel(out_ptr, PLAIN: gl.constexpr = False):
    buf = gl.allocate_shared_memory(gl.float32, [N * (1 + PLAIN)], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bar.index(0), count=1)
    mbarrier.init(bar.index(1), count=1)
    gl.thread_barrier()
    gl.warp_specialize([(_loop_default, (buf, bar, out_ptr, PLAIN)), (_loop_worker, (buf, bar, PLAIN))], [4], [48])


@gluon.jit
def _reader(buf, bar, out_ptr, MODE: gl.constexpr, PLAIN: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1 + PLAIN], [32], [4], [0])
    NV: gl.constexpr = N * (1 + PLAIN)
    if MODE == 0:
        mbarrier.wait(bar, 0)
    i = gl.arange(0, NV, layout)
    # thread i reads element i, which thread i of the other partition (another warp) stored, and stores it one place
    # down (out[i - 1]): the check in main() sees that each value came from the other partition and where it landed
    vals = buf.load(layout)
    gl.store(out_ptr + (i + NV - 1) % NV, vals)


@gluon.jit
def _writer(buf, bar, MODE: gl.constexpr, PLAIN: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1 + PLAIN], [32], [4], [0])
    NV: gl.constexpr = N * (1 + PLAIN)
    if MODE == 0:
        i = gl.arange(0, NV, layout)
        buf.store((i * 3 + 1).to(gl.float32))
        gl.thread_barrier()
        mbarrier.arrive(bar)


@gluon.jit
def _handoff_kernel(out_ptr, MODE: gl.constexpr, PLAIN: gl.constexpr = False):
    NV: gl.constexpr = N * (1 + PLAIN)
    buf = gl.allocate_shared_memory(gl.float32, [NV], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    if MODE == 1:
        buf.store(gl.full([NV], 1.0, gl.float32, gl.BlockedLayout([1 + PLAIN], [32], [4], [0])))
    mbarrier.init(bar, count=1)
    gl.thread_barrier()
    gl.warp_specialize([(_reader, (buf, bar, out_ptr, MODE, PLAIN)), (_writer, (buf, bar, MODE, PLAIN))], [4], [48])


@gluon.jit
def _nap(x, SLOW: gl.constexpr):
    """``x``, after every thread has slept about a microsecond when ``SLOW``."""
    if SLOW:
        x = gl.inline_asm_elementwise("nanosleep.u32 1000;\n mov.b32 $0, $1;", "=r,r", [x], dtype=gl.int32,
                                      is_pure=False, pack=1)
    return x


@gluon.jit
def _pp_part(m_smem, l_smem, xbar, out_ptr, WG: gl.constexpr, SLOW: gl.constexpr, REP: gl.constexpr = True):
    """One math warpgroup of ``pp``: the hand-offs of ``kernel_sm90._math_pp`` on made-up values. Warpgroup 0
    publishes its max (xbar 0), warpgroup 1 folds it into its own and publishes the pair's (xbar 1), which warpgroup
    0 reads; at the end each adds the other's row sum (xbar 5, 6). Warpgroup 0 stores what it read. ``REP``: the
    kernel's layout (64 rows of the m64n64 wgmma result, 4 lanes each), else 256 values, each in one lane (two per
    thread: with one, Triton moves them by ``stmatrix`` / ``ldmatrix`` instead of plain stores and loads)."""
    NV: gl.constexpr = 64 if REP else 256
    if REP:
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    else:
        row_s: gl.constexpr = gl.BlockedLayout([2], [32], [4], [0])
    h = gl.arange(0, NV, row_s)
    hi = _nap(h, SLOW)
    m_run = gl.full([NV], float("-inf"), gl.float32, row_s)
    l_run = gl.zeros([NV], gl.float32, row_s)
    got = gl.zeros([NV], gl.float32, row_s)
    for p in range(ROUNDS):
        ph = p & 1
        mine = ((hi * 7 + p * 13 + WG * 5) % 17).to(gl.float32)  # this warpgroup's tile max
        m_prev = m_run
        if WG == 1:
            hi = _nap(hi, SLOW)
            mbarrier.wait(xbar.index(0), ph)
            m_prev = m_smem.load(row_s)
        m_new = gl.maximum(m_prev, mine)
        l_run = l_run + mine
        m_run = m_new
        m_smem.store(m_new)
        _signal(xbar.index(WG))
        if WG == 0:
            hi = _nap(hi, SLOW)
            mbarrier.wait(xbar.index(1), ph)
            m_run = m_smem.load(row_s)
            got += m_run
    if WG == 0:
        l_smem.slice(0, NV).store(l_run)
        _signal(xbar.index(5))
        hi = _nap(hi, SLOW)
        mbarrier.wait(xbar.index(6), 0)
        l_tot = l_run + l_smem.slice(NV, NV).load(row_s)
        gl.store(out_ptr + h, got)
        gl.store(out_ptr + NV + h, l_tot)
    else:
        hi = _nap(hi, SLOW)
        mbarrier.wait(xbar.index(5), 0)
        l_tot = l_run + l_smem.slice(0, NV).load(row_s)
        l_smem.slice(NV, NV).store(l_run)
        _signal(xbar.index(6))


@gluon.jit
def _pp_idle(xbar):
    pass


@gluon.jit
def _pp_kernel(out_ptr, SLOW: gl.constexpr, REP: gl.constexpr = True, IDLE: gl.constexpr = True):
    NV: gl.constexpr = 64 if REP else 256
    vec: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    m_smem = gl.allocate_shared_memory(gl.float32, [NV], vec)
    l_smem = gl.allocate_shared_memory(gl.float32, [2 * NV], vec)
    xbar = gl.allocate_shared_memory(gl.int64, [7, 1], mbarrier.MBarrierLayout())
    for j in gl.static_range(7):
        mbarrier.init(xbar.index(j), count=1)
    if IDLE:
        gl.warp_specialize([(_pp_part, (m_smem, l_smem, xbar, out_ptr, 0, SLOW, REP)),
                            (_pp_part, (m_smem, l_smem, xbar, out_ptr, 1, SLOW, REP)), (_pp_idle, (xbar, ))], [4, 4],
                           [96, 48])
    else:
        gl.warp_specialize([(_pp_part, (m_smem, l_smem, xbar, out_ptr, 0, SLOW, REP)),
                            (_pp_part, (m_smem, l_smem, xbar, out_ptr, 1, SLOW, REP))], [4], [96])


def _pp_want(dev, nv=64):
    """What ``pp`` must give (``nv`` values): the pair's max summed over the rounds, and both row sums."""
    h = torch.arange(nv, device=dev)
    got, m = torch.zeros(nv, device=dev), torch.full((nv,), float("-inf"), device=dev)
    for p in range(ROUNDS.value):
        m = torch.maximum(m, ((h * 7 + p * 13) % 17).float())
        m = torch.maximum(m, ((h * 7 + p * 13 + 5) % 17).float())
        got += m
    l_tot = sum(((h * 7 + p * 13 + wg * 5) % 17).float() for p in range(ROUNDS.value) for wg in (0, 1))
    return torch.cat([got, l_tot])


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "one"
    plain = mode.endswith("plain")  # oneplain / loopplain / noneplain: the control with plain shared moves
    base = mode[:-len("plain")] if plain else mode
    nv = 256 if plain else 128
    out = torch.full((512 if mode == "pp1lane" else nv,), float("nan"), device="cuda")
    i = torch.arange(nv, device="cuda")
    if mode in ("pp", "ppslow", "pp1lane", "ppnoidle"):
        _pp_kernel[(1,)](out, SLOW=mode == "ppslow", REP=mode != "pp1lane", IDLE=mode != "ppnoidle", num_warps=4)
        want = _pp_want("cuda", 256 if mode == "pp1lane" else 64)
    elif base == "loop":
        _loop_kernel[(1,)](out, PLAIN=plain, num_warps=4)
        want = sum(2.0 * (i + r) for r in range(ROUNDS.value)).float()
    else:
        _handoff_kernel[(1,)](out, MODE={"one": 0, "none": 1}[base], PLAIN=plain, num_warps=4)
        want = torch.ones(nv, device="cuda") if base == "none" else ((i + 1) % nv * 3 + 1).float()
    torch.cuda.synchronize()
    print(mode, "values", "ok" if torch.equal(out, want) else f"WRONG {out[:8].tolist()}")


if __name__ == "__main__":
    main()
