#!/usr/bin/env bash
# The pair schedule's first measurements (kernel_sm90._math_pair; BENCHMARKS.md, thirty-eighth and thirty-ninth
# sessions), one device call per step, each under 10 minutes:
#   bash benchmarks/run_pair_ab.sh tests   # its GPU tests (a hung test ends after 60 s), then its clock trace
#   bash benchmarks/run_pair_ab.sh fp8     # the A/B over the fp8_ds_mla cache, 16 and 32 heads, forced splits
#   bash benchmarks/run_pair_ab.sh bf16    # the A/B over the bf16 cache, 16 and 32 heads, and prefill
# Each step prints its table last (the output is not cut: the device tool returns the last 12,000 characters).
set -u
source benchmarks/device_env.sh
case "${1:-}" in
  tests)
    DSA_TEST_HANG_S=60 timeout 240 python3 -m pytest -q -x -n "${WORKERS:-8}" -p no:cacheprovider tests/test_mla.py \
      -k "pair or moving_max"
    timeout 300 python3 benchmarks/ab_mla_pair.py --trace ;;
  fp8)
    timeout 560 python3 benchmarks/ab_mla_pair.py 3 --splits 1,2,4 --cases fp8_h32,fp8_h16 ;;
  bf16)
    timeout 560 python3 benchmarks/ab_mla_pair.py 3 --splits 1,2,4 --cases bf16_h32,bf16_h16,prefill ;;
  *)
    echo "usage: bash benchmarks/run_pair_ab.sh tests|fp8|bf16" >&2; exit 2 ;;
esac
