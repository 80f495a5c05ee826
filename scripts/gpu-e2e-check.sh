#!/usr/bin/env bash
# Runs on the GPU machine inside a gpu-bundle (see scripts/gpu-bundle.sh) holding build-cuda/kvq
# and build-cuda/tests/kvq_cuda_model_tests: the CUDA model tests, greedy agreement of
# `kvq generate` on the CPU and the GPU, and (with --bench) the issue-6 grid.
#   here:   KVQ_BUNDLE_FILE=.carry/bundle-e2e.tar.xz bash scripts/gpu-bundle.sh build-cuda/kvq build-cuda/tests/kvq_cuda_model_tests
#   device: KVQ_BUNDLE_FILE=.carry/bundle-e2e.tar.xz bash scripts/gpu-bundle.sh --run 'bash scripts/gpu-e2e-check.sh [--bench]'
# KVQ_E2E_BUILD names the bundled build directory (default build-cuda). stories260K (head_dim 8,
# the generic CUDA attention) is looked up in KVQ_STORIES260K_DIR, .carry/stories260K (carry it:
# the GPU machine has no ../shared), then ../shared/models/stories260K; the model tests read the
# same variable.
set -uo pipefail
OUT=${OUT:-$PWD/out-e2e}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-e2e-check.log") 2>&1
B=bundle/${KVQ_E2E_BUILD:-build-cuda}
K=$B/kvq
STORIES=${KVQ_STORIES260K_DIR:-}
for d in .carry/stories260K ../shared/models/stories260K; do
  [ -z "$STORIES" ] && [ -f "$d/model.safetensors" ] && STORIES=$PWD/$d
done
export KVQ_STORIES260K_DIR=$STORIES
step() { echo "=== [${SECONDS}s] $*"; }
step "kvq_cuda_model_tests"
$B/tests/kvq_cuda_model_tests > "$OUT/model_tests.log" 2>&1; echo "rc=$?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$OUT/model_tests.log"
step "greedy agreement, kvq-code-tiny, 64 tokens from 4 prompts"
for prompt in "def main(" "import os" "class Config:" "    for i in range("; do
  for kv in auto fp8 int8_per_token_head; do
    cpu=$($K generate --model models/kvq-code-tiny --prompt "$prompt" --temperature 0 --max-tokens 64 --output-ids --kv-cache-dtype $kv 2>/dev/null)
    for dt in float32 bfloat16; do
      gpu=$($K generate --model models/kvq-code-tiny --prompt "$prompt" --temperature 0 --max-tokens 64 --output-ids --kv-cache-dtype $kv --device cuda --dtype $dt 2>/dev/null)
      python3 - "$kv" "$dt" "$cpu" "$gpu" <<'PY'
import sys
kv, dt, a, b = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
print(f"kv {kv:22s} weights {dt:9s} identical prefix {n}/{len(a)} tokens")
PY
    done
  done
done
step "greedy agreement, stories260K (head_dim 8: generic CUDA attention), 64 tokens"
if [ -n "$STORIES" ]; then
  for prompt in "" "Once upon a time" "Lily and Tom"; do
    for kv in auto fp8 int8_per_token_head; do
      cpu=$($K generate --model "$STORIES" --prompt "$prompt" --temperature 0 --max-tokens 64 --output-ids --kv-cache-dtype $kv 2>/dev/null)
      gpu=$($K generate --model "$STORIES" --prompt "$prompt" --temperature 0 --max-tokens 64 --output-ids --kv-cache-dtype $kv --device cuda --dtype auto 2>/dev/null)
      python3 - "$kv" "$prompt" "$cpu" "$gpu" <<'PY'
import sys
kv, prompt, a, b = sys.argv[1], sys.argv[2], sys.argv[3].split(), sys.argv[4].split()
n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
ok = "identical" if a == b and a else "DIFFERENT"
print(f"stories260K kv {kv:20s} prompt {prompt!r:20s} identical prefix {n}/{len(a)} tokens ({ok})")
PY
    done
  done
else
  echo "stories260K not found (carry .carry/stories260K or set KVQ_STORIES260K_DIR): skipped"
fi
step "kvq eval on the GPU (float32 weights) vs the CPU"
$K eval --model models/kvq-code-tiny --text models/kvq-code-tiny/heldout.txt --max-tokens 4096 --kv-cache-dtype fp8 --device cuda --dtype float32 2>&1 | tail -4
$K eval --model models/kvq-code-tiny --text models/kvq-code-tiny/heldout.txt --max-tokens 4096 --kv-cache-dtype fp8 2>&1 | tail -4
if [ "${1:-}" = "--bench" ]; then
  step "issue-6 grid"
  OUT="$OUT" bash bench/run_e2e_bench.sh "$K" llama3-8b
  step "qwen3-8b spot check"
  for dt in bfloat16 fp8_e4m3; do $K bench --synthetic qwen3-8b --device cuda --batch 64 --input-len 4096 --output-len 64 --prefill-sequences 1 --kv-cache-dtype $dt 2>&1 | grep -v warning; done
  if command -v nsys > /dev/null; then
    step "nsys: fp8, batch 64, context 4096"
    nsys profile -o "$OUT/fp8_b64" --force-overwrite true $K bench --synthetic llama3-8b --device cuda --batch 64 --input-len 4096 --output-len 24 --prefill-sequences 1 --kv-cache-dtype fp8 > /dev/null 2>&1
    nsys stats --report cuda_gpu_kern_sum --format csv "$OUT/fp8_b64.nsys-rep" 2>/dev/null | head -25 | cut -c1-220
  fi
fi
step "done"
