#!/usr/bin/env bash
# The main job on the embedded default model (models/kvq-code-tiny, a Qwen3 with
# alternating sliding-window layers): the KV plan, the same prompt with a bf16 and an
# fp8 KV cache side by side, then the accuracy table for every KV dtype.
set -euo pipefail
kvq=${1:-build/kvq}
model=${2:-models/kvq-code-tiny}
shared=${3:-../shared}

run() {
  echo
  printf '$ kvq'
  printf ' %q' "$@"
  echo
  "$kvq" "$@"
}

prompt=$'import os\n\n\ndef '
run plan --model "$model" --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window --kv-cache-memory 1GiB

for dtype in bfloat16 fp8; do
  run generate --model "$model" --prompt "$prompt" --kv-cache-dtype "$dtype" --temperature 0 --max-tokens 96
done

run eval --model "$model" --text "$model/heldout.txt" --all-dtypes --max-tokens 16384

if [ -d "$shared/models/stories260K" ]; then
  run generate --model "$shared/models/stories260K" --prompt "" --kv-cache-dtype fp8 \
    --kv-cache-dtype-skip-layers 0 --temperature 0 --max-tokens 64
fi
