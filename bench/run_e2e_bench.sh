#!/usr/bin/env bash
# The issue-#6 grid on the GPU machine: `kvq bench` on a synthetic model shape, batch x context
# x KV dtype, one JSON line per point in $OUT/e2e_bench.jsonl, then the markdown tables.
#   device: KVQ_BUNDLE_FILE=... bash scripts/gpu-bundle.sh --run 'bash bench/run_e2e_bench.sh bundle/build-cuda/kvq'
# Each point prefills one sequence for real and copies its KV blocks to the rest of the batch
# (--prefill-sequences 1), then decodes --output-len 64 tokens; context = input length.
set -uo pipefail
KVQ=${1:?usage: run_e2e_bench.sh KVQ_BINARY [MODEL]}
MODEL=${2:-llama3-8b}
OUT=${OUT:-$PWD/out-e2e}
mkdir -p "$OUT"
J="$OUT/e2e_bench.jsonl"
: > "$J"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
DTYPES=${DTYPES:-"bfloat16 fp8_e4m3 int8_per_token_head int4_per_token_head"}
BATCHES=${BATCHES:-"1 16 64 128"}
CONTEXTS=${CONTEXTS:-"1024 4096 16384"}
for dt in $DTYPES; do
  for ctx in $CONTEXTS; do
    for b in $BATCHES; do
      line=$("$KVQ" bench --synthetic "$MODEL" --device cuda --batch "$b" --input-len "$ctx" \
        --output-len 64 --prefill-sequences 1 --kv-cache-dtype "$dt" --json 2> "$OUT/err.txt")
      if [ $? -eq 0 ]; then
        echo "$line" | python3 -c 'import json,sys; print(json.dumps(json.load(sys.stdin)))' >> "$J"
      else
        python3 -c 'import json,sys; print(json.dumps({"kv_dtype": sys.argv[1], "batch": int(sys.argv[2]), "input_len": int(sys.argv[3]), "error": open(sys.argv[4]).read().strip().splitlines()[-1]}))' \
          "$dt" "$b" "$ctx" "$OUT/err.txt" >> "$J"
      fi
      tail -1 "$J" | cut -c1-200
    done
  done
done
python3 "$(dirname "$0")/e2e_report.py" "$J" | tee "$OUT/e2e_tables.md"
