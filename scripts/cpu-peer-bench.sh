#!/usr/bin/env bash
# kvq beside llama.cpp on this machine's CPU, in one run, at the default model's shape
# (6 layers, hidden 256, 4/2 heads, head_dim 64, FFN 768, vocab 4096): a 512-token prompt,
# 128 generated tokens, batch 1 and 8, every KV dtype of each; decode and prefill tokens/s.
#   scripts/cpu-peer-bench.sh [WORK_DIR] [KVQ_BINARY]      (default /tmp/kvq-peer, build/kvq)
# llama.cpp: ../shared/peers/llama.cpp.tar.xz built for the CPU (-DGGML_CUDA=OFF; about 10
# minutes on 2 cores, skipped when WORK_DIR has it), on a random-weights F16 GGUF of the shape
# (../shared/peers/make_gguf_llama.py; needs numpy: Debian's python3-numpy, run with
# /usr/bin/python3). Its llama-batched-bench prefills one prompt, copies it to each sequence
# (-pps), then generates; kvq bench does the same with. THREADS (default
# nproc) threads for both. Output: one table on stdout; raw logs in WORK_DIR.
set -uo pipefail
cd "$(dirname "$0")/.."
W=${1:-/tmp/kvq-peer}
KVQ=${2:-build/kvq}
PEERS=${PEERS:-../shared/peers}
THREADS=${THREADS:-$(nproc)}
PY=${PY:-/usr/bin/python3}
mkdir -p "$W"
bash scripts/install-deps.sh python3-numpy > /dev/null || exit 1  # the GGUF writer needs numpy
if [ ! -x "$W/b/bin/llama-batched-bench" ]; then
  rm -rf "$W/src" && mkdir -p "$W/src" && tar -xJf "$PEERS/llama.cpp.tar.xz" -C "$W/src" || exit 1
  cmake -S "$W/src" -B "$W/b" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DGGML_NATIVE=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF > "$W/build.log" 2>&1 &&
    ninja -C "$W/b" llama-batched-bench >> "$W/build.log" 2>&1 ||
    { echo "llama.cpp build failed: see $W/build.log"; exit 1; }
fi
[ -f "$W/tiny.gguf" ] || PYTHONPATH="$W/src/gguf-py" "$PY" "$PEERS/make_gguf_llama.py" "$W/tiny.gguf" \
  6 256 4 2 768 4096 2048 > "$W/gguf.log" 2>&1 || { echo "GGUF failed: see $W/gguf.log"; exit 1; }

echo "| engine | KV | batch | prefill tok/s | decode tok/s |"
echo "|---|---|---|---|---|"
for kv in f16 q8_0 q4_0; do
  "$W/b/bin/llama-batched-bench" -m "$W/tiny.gguf" -t "$THREADS" -fa on -ctk "$kv" -ctv "$kv" \
    -c 8192 -b 2048 -ub 512 -npp 512 -ntg 128 -npl 1,8 -pps -no-kvu > "$W/llama-$kv.log" 2>&1
  # | PP | TG | B | N_KV | T_PP s | S_PP t/s | T_TG s | S_TG t/s | T s | S t/s |
  grep -E '^\|\s+512' "$W/llama-$kv.log" |
    awk -F'|' -v kv="$kv" '{gsub(/ /,""); printf "| llama.cpp | %s | %s | %s | %s |\n", kv, $4, $7, $9}'
done
for kv in bfloat16 fp8_e4m3 fp8_e5m2 int8_per_token_head fp8_per_token_head int4_per_token_head nvfp4; do
  for b in 1 8; do
    OMP_NUM_THREADS=$THREADS "$KVQ" bench --model models/kvq-code-tiny --device cpu --kv-cache-dtype "$kv" \
      --batch "$b" --input-len 512 --output-len 128 --json > "$W/kvq-$kv-$b.json" 2> "$W/kvq-$kv-$b.log"
    "$PY" - "$W/kvq-$kv-$b.json" "$kv" "$b" <<'PY'
import json, sys
j = json.load(open(sys.argv[1]))
print(f"| kvq | {sys.argv[2]} | {sys.argv[3]} | {j['prefill_tokens_per_s']:.0f} | {j['decode_tokens_per_s']:.0f} |")
PY
  done
done
