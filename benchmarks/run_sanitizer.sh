#!/usr/bin/env bash
# The GPU tests under compute-sanitizer (one device call): memcheck (out-of-bounds and misaligned accesses to
# global and shared memory), racecheck (shared-memory hazards between threads), synccheck (barriers used wrongly)
# and initcheck (reads of device memory never written), each on its own set of tests, the four side by side.
# Every kernel runs 10-100x slower under a tool, so each set is small: the Hopper (Gluon) sparse MLA tests whole,
# because their mbarrier hand-offs, bulk copies and clusters are what a CPU run cannot check, and the first
# ${PER_FUNCTION:-2} cases of every other kernel test (the conftest's --per-function). The caching allocator is
# off, so that an access past a tensor's end lands outside any allocation and memcheck sees it, and initcheck sees
# each tensor as new. Logs go to $OUT (or ./out); the last lines printed are the summaries.
#   bash benchmarks/run_sanitizer.sh [tools...]        (default: memcheck racecheck synccheck initcheck)
set -u
OUT=${OUT:-out}
mkdir -p "$OUT"
source benchmarks/device_env.sh
compute-sanitizer --version | tail -1
export PYTORCH_NO_CUDA_MEMORY_CACHING=1 DSA_TEST_HANG_S=0
LIMIT=${LIMIT:-500}
PF=${PER_FUNCTION:-2}
KERNEL_TESTS="tests/test_mla.py tests/test_mla_bulk.py tests/test_compat.py tests/test_mqa_logits.py tests/test_topk.py
  tests/test_mla_cache.py tests/test_indexer_cache.py tests/test_indexer_prep.py tests/test_metadata.py
  tests/test_mla_order.py"
GLUON="gpu_sm90 or gpu_bulk"

# one tool over one set of tests: sanitize TOOL NAME WORKERS PYTEST_ARGS...
sanitize() {
  local tool=$1 name=$2 n=$3
  shift 3
  timeout "$LIMIT" compute-sanitizer --tool "$tool" --target-processes all --print-limit 20 \
    --log-file "$OUT/$name.%p.san" python3 -m pytest -p no:cacheprovider -n "$n" -v -rfE "$@" \
    > "$OUT/$name.pytest" 2>&1
  echo "rc=$?" >> "$OUT/$name.pytest"
}

TOOLS=${*:-memcheck racecheck synccheck initcheck}
for tool in $TOOLS; do
  case $tool in
    memcheck)
      sanitize memcheck memcheck_gluon 3 tests/test_mla.py tests/test_mla_bulk.py -k "$GLUON" &
      sanitize memcheck memcheck_rest 3 $KERNEL_TESTS --per-function "$PF" -k "not ($GLUON)" & ;;
    racecheck) sanitize racecheck racecheck_gluon 3 tests/test_mla.py tests/test_mla_bulk.py -k "$GLUON" \
      --per-function "$PF" & ;;
    synccheck) sanitize synccheck synccheck_gluon 2 tests/test_mla.py tests/test_mla_bulk.py -k "$GLUON" \
      --per-function "$PF" & ;;
    initcheck) sanitize initcheck initcheck 3 $KERNEL_TESTS --per-function "$PF" & ;;
  esac
done
wait
for f in "$OUT"/*.pytest; do
  name=$(basename "$f" .pytest)
  echo "== $name: $(grep -E "passed|failed|error" "$f" | tail -1) $(tail -1 "$f")"
  grep -h "ERROR SUMMARY" "$OUT/$name".*.san 2>/dev/null | sort | uniq -c
  grep -h -E "^========= (Invalid|Race|Barrier|Uninitialized|Misaligned|Error|Warning)" "$OUT/$name".*.san 2>/dev/null \
    | sort | uniq -c | sort -rn | head -8
  grep -E "^(FAILED|ERROR) " "$f" | head -8
done
