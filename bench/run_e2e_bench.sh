#!/usr/bin/env bash
# The issue-#6 grid on the GPU machine: `kvq bench` on a synthetic model shape, batch x context
# x KV dtype, one JSON line per point in $OUT/e2e_bench.jsonl, then the markdown tables.
#   device: KVQ_BUNDLE_FILE=... bash scripts/gpu-bundle.sh --run 'bash bench/run_e2e_bench.sh bundle/build-cuda/kvq'
# Each point prefills one sequence for real and copies its KV blocks to the rest of the batch
# (--prefill-sequences 1), then decodes --output-len 64 tokens; context = input length.
# The peer in the same call (PEER=1, the default where the peers folder is found): llama.cpp
# with CUDA (../shared/peers/run_llamacpp.sh: built on first use, ~4.5 min with 16 cores, in
# build-peer/, which a warm machine keeps), a random-weights Llama-3-8B GGUF, 4096-token
# prompt, 64 generated tokens, at the batches of BATCHES up to 64 (PEER_BATCHES overrides) and its
# f16 / q8_0 / q4_0 caches; its rows join the JSON lines (engine "llama.cpp") and the report
# prints them beside kvq's (bf16 ~ f16, fp8 and int8_per_token_head ~ q8_0,
# int4_per_token_head ~ q4_0). The peers folder: $KVQ_PEERS, else ../shared/peers beside the
# checkout, else .carry/peers (the device tool does not send ../shared: copy it there and
# carry it). Only the 8B shape has a peer GGUF writer, so other models run without it.
set -uo pipefail
KVQ=${1:?usage: run_e2e_bench.sh KVQ_BINARY [MODEL]}
MODEL=${2:-llama3-8b}
OUT=${OUT:-$PWD/out-e2e}
mkdir -p "$OUT"
J="$OUT/e2e_bench.jsonl"
: > "$J"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
DTYPES=${DTYPES:-"bfloat16 fp8_e4m3 int8_per_token_head int4_per_token_head"}
PEERS=${KVQ_PEERS:-}
for d in "$(dirname "$0")/../../shared/peers" .carry/peers; do
  [ -z "$PEERS" ] && [ -x "$d/run_llamacpp.sh" ] && PEERS=$d
done
PEER_ON=0
if [ "${PEER:-1}" = 1 ] && [ -n "$PEERS" ] && [ "$MODEL" = llama3-8b ]; then
  PEER_ON=1
  # Build llama.cpp and write its GGUF while kvq runs (niced: kvq's steps replay CUDA graphs and
  # need little CPU); its own benchmark runs after kvq's, alone on the GPU.
  # (KV " ": no cache type, so the script only builds; "" would mean its default list.)
  nice -n 19 bash "$PEERS/run_llamacpp.sh" "$PWD/build-peer" 1 " " > "$OUT/peer_build.txt" 2>&1 &
  PEER_BUILD=$!
fi
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
if [ "$PEER_ON" = 1 ]; then
  wait "$PEER_BUILD" || echo "peer build failed: $(tail -3 "$OUT/peer_build.txt")"
  # Batches above 64 leave llama.cpp's one f16 context (batch x 4160 tokens) no room on 80 GB.
  PB=$(for b in ${PEER_BATCHES:-$BATCHES}; do [ "$b" -le 64 ] && echo "$b"; done | paste -sd,)
  echo "peer: llama.cpp from $PEERS, batches $PB"
  timeout ${PEER_TIMEOUT:-900} bash "$PEERS/run_llamacpp.sh" "$PWD/build-peer" "$PB" "${PEER_KV:-f16 q8_0 q4_0}" \
    > "$OUT/peer_llamacpp.txt" 2>&1
  echo "peer rc=$?"
  python3 "$(dirname "$0")/peer_llamacpp.py" < "$OUT/peer_llamacpp.txt" | tee -a "$J" | cut -c1-200
elif [ "${PEER:-1}" = 1 ]; then
  echo "peer: skipped (peers folder found: ${PEERS:-none}; model $MODEL)"
fi
python3 "$(dirname "$0")/e2e_report.py" "$J" | tee "$OUT/e2e_tables.md"
