#!/usr/bin/env bash
# One device call that checks and measures everything (248 s on an H200 at 1f192b3, before dsa bench had the
# small-head rows; at bacf7df on an H100 with an empty Triton cache, the tests alone ran past 330 s at 8 workers,
# while with the cache filled they took 101 s at 12 workers: on a fresh machine run STAGES=tests first, then the
# rest in a second call while the machine is warm):
#   1. the whole test suite with the GPU shapes (pytest-xdist and hypothesis carried as wheels
#      in .whl/ when the machine lacks them; see the device tool's README), the fp8 ops on both e4m3fn paths,
#      without the cross-target compile tests,
#   2. `dsa run` on the default GPU workload (Triton ops, CUDA-graph decode), first with an empty
#      Triton cache (its report counts the kernel variants compiled inside the timed run: 0 when the
#      warm-up covered them), then again,
#   3. the same workload on the PyTorch reference backend (shorter decode, no warm-up: nothing to
#      compile; the report's per-step numbers are what compare),
#   4. `dsa bench` at the goal shapes, with a plot (BENCH_ARGS picks a subset, e.g. "--kernels topk"),
#   5. the SM clock and board power while the machine-dependent goal kernels run back to back
#      (benchmarks/power_probe.py: every kernel here runs at the 700 W cap, so the clock varies by machine),
#   6. small-head decode at the defaults (h_q 16/32, both formats, batch 1-128; CUDA graphs), the rows of
#      the sparse-MLA goal that asks for 70% of the bandwidth floor,
#   7. eager calls replayed from launch plans (dsa/_replay.py): their tests (which ops replay inside the engine),
#      the host time of eager sparse_mla decode calls with plans off and on, and the `dsa run` workload with eager
#      decode (--cuda-graph off), plans off and on, with each planned op's host time (benchmarks/plans_engine.py),
#   8. where the `dsa run` workload's CUDA-graph decode steps spend their time, with each step waiting for its tokens
#      and without (benchmarks/engine_step_split.py).
# STAGES picks a subset, space-separated (default: all): tests run bench power decode plans engine. Not in the
# default: trace (the 16/32-head math warpgroup's clocks per tile, benchmarks/whatif_sm90.py's trace variant) and
# whatif (which side sets small-head prefill: the call, the fill alone and the math alone, whatif_sm90.py's real,
# nomath and nocopy variants; 18 s on a fresh H100 machine, its six kernels compiled inside that time; then the same
# with the index lists as given, `--as-given`, to see whether the fill alone depends on the lists' grouping). The
# stages run in this file's order, whatever order STAGES names them in.
# NEED=H200 stops at once, before any stage, on any other GPU (the issue-4 goal rows are H200 numbers):
#   NEED=H200 STAGES="bench whatif" BENCH_ARGS="--kernels mla" bash benchmarks/run_on_h200.sh
# Logs go to $OUT (or ./out); the last lines printed are the summaries.
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
if [[ -n ${NEED:-} ]] && ! nvidia-smi --query-gpu=name --format=csv,noheader | grep -q "$NEED"; then
  echo "not an $NEED: nothing run"; exit 3
fi
N=${WORKERS:-16}  # (the machine's 16 CPU cores: an empty Triton cache makes the tests compile-bound)
STAGES=" ${STAGES:-tests run bench power decode plans engine} "
on() { [[ $STAGES == *" $1 "* ]]; }
# (tests/test_targets.py compiles for other GPUs on the CPU, 4-6 CPU-minutes: CI runs it, this call leaves it out)
# (the drawn-configuration tests run apart, at 4 workers: 16 processes each holding a many-token case ran the GPU out
# of memory, 40 of 167 sparse-MLA draws on an H100 in the sixty-fourth session; at 4 workers all passed in 34 s)
if on tests; then
  timeout "${TEST_LIMIT:-330}" python3 -m pytest -q -n "$N" -p no:cacheprovider -p no:benchmark --durations=20 tests \
    -k "not portable_kernels_compile_and_fit" --ignore-glob='tests/test_*_fuzz.py' > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$?" >> "$OUT/pytest.log"
  timeout 300 python3 -m pytest -q -n 4 -p no:cacheprovider -p no:benchmark tests/test_*_fuzz.py \
    >> "$OUT/pytest.log" 2>&1; echo "pytest (drawn configurations) rc=$?" >> "$OUT/pytest.log"
fi
if on run; then
  TRITON_CACHE_DIR=/tmp/triton_cache_empty timeout 200 python3 -m dsa run --no-progress > "$OUT/run_triton_cold.txt" 2>&1
  echo "run rc=$?" >> "$OUT/run_triton_cold.txt"
  timeout 150 python3 -m dsa run --no-progress > "$OUT/run_triton.txt" 2>&1; echo "run rc=$?" >> "$OUT/run_triton.txt"
  timeout 150 python3 -m dsa run --no-progress --backend reference --decode-steps 16 --warmup off \
    > "$OUT/run_reference.txt" 2>&1
  echo "run rc=$?" >> "$OUT/run_reference.txt"
fi
if on bench; then
  timeout 240 python3 -m dsa bench ${BENCH_ARGS:-} --plot "$OUT/bench.png" > "$OUT/bench.txt" 2>&1
  echo "bench rc=$?" >> "$OUT/bench.txt"
fi
if on power; then
  timeout 90 python3 benchmarks/power_probe.py 2 > "$OUT/power.txt" 2>&1; echo "power rc=$?" >> "$OUT/power.txt"
fi
if on decode; then
  # (its JSON lines appended to the log: the device tool brings back at most 8 files, and this call writes 8 others)
  rm -f /tmp/decode.jsonl  # (a warm machine may hold an earlier call's)
  timeout 200 python3 benchmarks/sweep.py --groups mla_decode_defaults --workers 8 --out /tmp/decode.jsonl \
    > "$OUT/decode.txt" 2>&1; echo "decode rc=$?" >> "$OUT/decode.txt"
  cat /tmp/decode.jsonl >> "$OUT/decode.txt" 2>/dev/null
fi
if on plans; then
  {
    timeout 150 python3 -m pytest -q -s -p no:cacheprovider -p no:benchmark tests/test_replay.py 2>&1 \
      | grep -E "REPLAY STATUS|passed|failed|Error"
    timeout 120 python3 benchmarks/host_overhead.py 2>&1 | tail -7
    timeout 200 python3 benchmarks/plans_engine.py 2>&1 | grep -E "^== plans|^replay stats|^  [a-z_0-9]+ +(own|rep)|^\|"
  } > "$OUT/plans.txt" 2>&1
fi
if on trace; then
  timeout 200 python3 benchmarks/whatif_sm90.py --variants=real,trace,nocopy+trace 3 decode_fp8_h32_b64 \
    prefill_bf16_h32 decode_fp8_h16_b16 prefill_bf16_h16 > "$OUT/trace.txt" 2>&1; echo "trace rc=$?" >> "$OUT/trace.txt"
fi
if on whatif; then
  timeout 120 python3 benchmarks/whatif_sm90.py --variants=real,nomath,nocopy 3 prefill_bf16_h32 prefill_bf16_h16 \
    > "$OUT/whatif.txt" 2>&1; echo "whatif rc=$?" >> "$OUT/whatif.txt"
  timeout 120 python3 benchmarks/whatif_sm90.py --as-given --variants=real,nomath,nocopy 3 prefill_bf16_h32 \
    prefill_bf16_h16 > "$OUT/whatif_as_given.txt" 2>&1; echo "whatif --as-given rc=$?" >> "$OUT/whatif_as_given.txt"
fi
if on engine; then
  timeout 300 python3 benchmarks/engine_step_split.py > "$OUT/engine.txt" 2>&1; echo "engine rc=$?" >> "$OUT/engine.txt"
fi
if on tests; then echo "== pytest"; grep -E "passed|failed|rc=" "$OUT/pytest.log" | tail -3; fi
if on run; then
  echo "== dsa run, empty Triton cache"; grep -E "warm-up|^decode" "$OUT/run_triton_cold.txt"
  echo "== dsa run";   cat "$OUT/run_triton.txt"
  echo "== reference"; tail -25 "$OUT/run_reference.txt"
fi
if on bench; then echo "== bench"; tail -50 "$OUT/bench.txt"; fi
if on power; then echo "== power"; tail -9 "$OUT/power.txt"; fi
if on plans; then echo "== plans"; cat "$OUT/plans.txt"; fi
if on trace; then
  echo "== trace (clocks per tile)"; grep -E "clocks per tile|^case|^decode|^prefill|rc=" "$OUT/trace.txt"
fi
if on whatif; then
  echo "== whatif (us: the call, the fill alone, the math alone)"; tail -12 "$OUT/whatif.txt"
  echo "== whatif, the lists as given"; tail -12 "$OUT/whatif_as_given.txt"
fi
if on engine; then echo "== engine (CUDA-graph decode steps)"; grep -E "eager decode|^\||rc=" "$OUT/engine.txt"; fi
if on decode; then
  echo "== small-head decode (us)"; grep -E "^== mla_|rc=" "$OUT/decode.txt" | sed 's/ *(1 variants; worst / /; s/)$//'
fi
