#!/usr/bin/env bash
# The GPU tests under compute-sanitizer (one device call): memcheck (out-of-bounds and misaligned accesses to
# global and shared memory), synccheck (barriers used wrongly), initcheck (reads of device memory never written) and
# racecheck (shared-memory hazards between threads), side by side, each over its own tests and within LIMIT seconds.
# Every kernel runs 10-100x slower under a tool, so the sets are small: the Hopper (Gluon) sparse-MLA tests, whose
# mbarrier hand-offs, bulk copies and clusters a CPU run cannot check, and the first PER_FUNCTION cases of every
# other kernel test (the conftest's --per-function, counted after -k). The caching allocator is off, so that an
# access past a tensor's end lands outside any allocation, where memcheck sees it, and initcheck sees each tensor as
# new.
#
# What the tools report here (BENCHMARKS.md, forty-second session):
# * memcheck and synccheck: nothing.
# * initcheck flags the top-k's whole-tile load of its scratch buffer (`_compact`): the entries past the count
#   were never written and are masked out of the keys (`_tile_keys`), by design. The top-k is left out of it.
# * racecheck flags Triton's own start of every warp-specialised region (the worker warps' read of their partition
#   byte after `bar.sync 1`, at the kernel's offset 0x100; `python3 benchmarks/racecheck_handoff.py none` under the
#   tool shows it on a small kernel), and hand-offs in the 64-head ping-pong (`_math_pp`) not yet explained: the
#   same hand-off done once (`racecheck_handoff.py one`) draws no report. Forty-eighth session (H200): `loop` (one
#   slot both ways, phases alternating) draws none either, while `pp` / `ppslow` (`_math_pp`'s own hand-offs in its
#   layouts, 4 lanes storing each value, beside a third partition) draw the kernel's kind (35 / 7 reports, values
#   right): every reported pair is a store and the read after the mbarrier wait that orders it. Forty-ninth (H100):
#   `pp1lane` (one lane per value, plain 8-byte moves) and `ppnoidle` (no third partition) still draw them (18 /
#   34). The SASS shows why the controls may be silent: `one`, `none` and `loop` move their values by stmatrix /
#   ldmatrix, `pp` by plain st.shared / ld.shared. Fiftieth (H100): with plain moves the controls draw them too
#   (`oneplain`, one hand-off with right values: 1,016 hazards, the store against the load after the wait;
#   `loopplain` 3 x 1,016; `noneplain` only the region start). So racecheck reports every mbarrier hand-off between
#   partitions that it can see: those reports are the tool's, not races.
# * Under racecheck and synccheck, every test that launched clusters (the in-kernel split merge: `rows_kernel` and
#   `rows_moving_max` at 3 tokens, `variants_prefer_l1` at 4) ran past 500 s, and every test that finished launched
#   none (forty-eighth session). So those jobs run with `--no-clusters` (conftest: the merge kernel instead) and
#   without the cluster tests; so run, synccheck finished its 17 Gluon tests (one case each) with no error
#   (forty-ninth). A job of their own (`*_cluster`, CLUSTER_LIMIT seconds) runs the first cluster-merge case under
#   each tool: it did not finish in 150 s under either (forty-ninth).
# * Tests that capture CUDA graphs are left out: with the caching allocator off, each allocation inside a capture
#   is a cudaMalloc, which the capture forbids.
#
# One file per job in $OUT (or ./out): the tool's report and pytest's, interleaved; the last lines printed are the
# summaries.
#   bash benchmarks/run_sanitizer.sh [tools...]        (default: memcheck synccheck initcheck racecheck)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
compute-sanitizer --version | tail -1
# (the ptxas Triton compiles with: the SASS offsets in the reports are of its code)
python3 -c "from triton.backends.nvidia.compiler import get_ptxas; t = get_ptxas(90); print('ptxas', t.version, t.path)"
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 DSA_TEST_HANG_S=0
LIMIT=${LIMIT:-400}
PF=${PER_FUNCTION:-1}
CLUSTER_LIMIT=${CLUSTER_LIMIT:-200}
KERNEL_TESTS="tests/test_mla.py tests/test_mla_bulk.py tests/test_compat.py tests/test_mqa_logits.py tests/test_topk.py
  tests/test_mla_cache.py tests/test_indexer_cache.py tests/test_indexer_prep.py tests/test_metadata.py
  tests/test_mla_order.py tests/test_engine.py"
GLUON="gpu_sm90 or gpu_bulk"
NOGRAPH="not cuda_graph"

# one tool over one set of tests: sanitize TOOL NAME WORKERS PYTEST_ARGS...
sanitize() {
  local tool=$1 name=$2 n=$3
  shift 3
  timeout "$LIMIT" compute-sanitizer --tool "$tool" --target-processes all --print-limit 30 \
    python3 -m pytest -p no:cacheprovider -n "$n" -v -rfE "$@" > "$OUT/$name.txt" 2>&1
  echo "rc=$?" >> "$OUT/$name.txt"
}

TOOLS=${*:-memcheck synccheck initcheck racecheck}
for tool in $TOOLS; do
  case $tool in
    memcheck)
      sanitize memcheck memcheck_gluon 4 tests/test_mla.py tests/test_mla_bulk.py -k "($GLUON) and $NOGRAPH" \
        --per-function 3 &
      sanitize memcheck memcheck_rest 3 $KERNEL_TESTS --per-function "$PF" -k "not ($GLUON) and $NOGRAPH" & ;;
    synccheck)
      sanitize synccheck synccheck_gluon 3 tests/test_mla.py tests/test_mla_bulk.py \
        -k "($GLUON) and $NOGRAPH and not cluster" --per-function "$PF" --no-clusters &
      LIMIT=$CLUSTER_LIMIT sanitize synccheck synccheck_cluster 1 tests/test_mla.py -k gpu_sm90_cluster_merge \
        --per-function 1 & ;;
    initcheck)  # (without the top-k's tests: their one known report fills the print limit)
      sanitize initcheck initcheck 3 ${KERNEL_TESTS/tests\/test_topk.py/} --per-function "$PF" -k "$NOGRAPH" & ;;
    racecheck)
      (echo "== the ping-pong's hand-offs in this machine's SASS (no tool)"
      python3 -m pytest -p no:cacheprovider -q tests/test_mla.py -k pingpong_handoffs 2>&1 | tail -1
      for m in one loop none pp ppslow pp1lane ppnoidle oneplain noneplain loopplain; do
        echo "== racecheck_handoff.py $m"
        timeout 120 compute-sanitizer --tool racecheck python3 benchmarks/racecheck_handoff.py $m
      done) > "$OUT/racecheck_handoff.txt" 2>&1 &
      sanitize racecheck racecheck_gluon 4 tests/test_mla.py tests/test_mla_bulk.py \
        -k "($GLUON) and $NOGRAPH and not cluster" --per-function "$PF" --no-clusters &
      LIMIT=$CLUSTER_LIMIT sanitize racecheck racecheck_cluster 1 tests/test_mla.py -k gpu_sm90_cluster_merge \
        --per-function 1 &
      # the ping-pong's reports hazard by hazard (kind, threads, addresses)
      (timeout "$LIMIT" compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 12 \
        --target-processes all python3 -m pytest -p no:cacheprovider -q "tests/test_mla.py::test_gpu_sm90_pingpong[case0]"
       echo "rc=$?") > "$OUT/racecheck_pp_hazards.txt" 2>&1 & ;;
  esac
done
wait
for f in "$OUT"/*.txt; do
  echo "== $(basename "$f" .txt): $(grep -c PASSED "$f") passed, $(grep -c FAILED "$f") failed; $(tail -1 "$f")"
  grep -h -E "ERROR SUMMARY|RACECHECK SUMMARY" "$f" | sort | uniq -c
  grep -h -E "^========= [A-Z]" "$f" | grep -v SUMMARY | sort | uniq -c | sort -rn | head -6
  grep -h -E "^=========     at " "$f" | sort | uniq -c | sort -rn | head -6
done
if [ -f "$OUT/racecheck_handoff.txt" ]; then  # each hand-off form: its values and what racecheck made of it
  echo "== racecheck_handoff.py, form by form"
  grep -E "^== |passed|failed|values|RACECHECK SUMMARY|Race reported" "$OUT/racecheck_handoff.txt"
fi
