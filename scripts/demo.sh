#!/usr/bin/env bash
# The main job on the embedded default model: what the KV plan looks like with a
# 16-bit cache and with quantized caches, and which attention backend runs each layer.
set -euo pipefail
kvq=${1:-build/kvq}
model=${2:-models/kvq-code-tiny}
shared=${3:-../shared}

run() {
  echo
  echo "\$ kvq $*"
  "$kvq" "$@"
}

run plan --model "$model"
run plan --model "$model" --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers sliding_window --kv-cache-memory 1GiB
run plan --model "$model" -ctk int4_per_token_head -ctv fp8_per_token_head --kv-cache-memory 1GiB
run backends
if [ -d "$shared/models/stories260K" ]; then
  run plan --model "$shared/models/stories260K" --kv-cache-dtype fp8 --kv-cache-dtype-skip-layers 0
fi
