set -u
export PYTHONUNBUFFERED=1
for v in "ol pad" "reg swz" "ol swz" "reg pad"; do set -- $v
  echo "=== store $1 red $2"
  PROTO_STORE=$1 PROTO_RED=$2 timeout 150 python benchmarks/proto_bulk_fp8.py --configs "2,1,0" > $OUT/proto_$1_$2.txt 2>&1
  grep -E "check T 64|^ +(32|64|128) " $OUT/proto_$1_$2.txt
done
timeout 200 python3 benchmarks/sweep.py --groups mla_decode_defaults --workers 8 --out "$OUT/decode.jsonl" > "$OUT/decode.txt" 2>&1
tail -25 $OUT/decode.txt
