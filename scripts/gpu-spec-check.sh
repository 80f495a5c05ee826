#!/usr/bin/env bash
# Speculative decoding on the GPU machine, inside a gpu-bundle holding $KVQ_E2E_BUILD/kvq and
# $KVQ_E2E_BUILD/tests/kvq_cuda_model_tests (default build):
#   here:   KVQ_BUNDLE_FILE=.carry/bundle-spec.tar.xz bash scripts/gpu-bundle.sh build/kvq build/tests/kvq_cuda_model_tests
#   device: KVQ_BUNDLE_FILE=.carry/bundle-spec.tar.xz bash scripts/gpu-bundle.sh --run 'bash scripts/gpu-spec-check.sh PART'
# (KVQ=path overrides the binary, e.g. KVQ=build-cpu/kvq DEVICE=cpu for the CPU grid; KVS, BATCHES,
# KS, SPECS, NUMP, OUTLEN narrow it.)
# PART: tests (CUDA model tests + CPU/GPU greedy agreement with speculation), grid (the default
# model on held-out text: proposers x k x KV dtype x batch, kvq bench --speculative-config),
# verify8b (the Llama-3-8B shape: a verification step of 1 + 7 tokens vs a decode step).
# JSON lines go to $OUT/spec-*.jsonl.
set -uo pipefail
OUT=${OUT:-$PWD/out-spec}
mkdir -p "$OUT"
B=bundle/${KVQ_E2E_BUILD:-build}
K=$B/kvq
PART=${1:-tests}
# One JSON object on stdin: passed on to stdout, a one-line summary to stderr.
cat > /tmp/spec_fmt.py <<'PY'
import json, sys
j = json.load(sys.stdin)
print(json.dumps(j))
if "speedup" in j:
    print(f"{j['method']:11s} k={j['num_speculative_tokens']} B={j['batch']:2d} {j['plan'][:22]:22s} "
          f"plain {j['plain_tokens_per_s']:8.0f} spec {j['speculative_tokens_per_s']:8.0f} "
          f"x{j['speedup']:.2f} acc {j['acceptance_rate']:.2f} len {j['mean_accepted_length']:.2f} "
          f"same {j['greedy_outputs_identical']}/{j['num_prompts']}", file=sys.stderr)
else:
    print(f"{j['plan'][:10]:10s} ctx {j['input_len']:5d} B={j['batch']:2d} verify {j['verify_tokens']}: "
          f"{j['decode_step_ms_median']:.3f} ms/step", file=sys.stderr)
PY
step() { echo "=== [${SECONDS}s] $*"; }
DRAFT='"method":"draft_model","model":"models/kvq-code-tiny-draft"'
NGRAM='"method":"ngram","prompt_lookup_min":1,"prompt_lookup_max":3'
DFLASH='"method":"dflash","model":"models/kvq-code-tiny-dflash"'
# The grid also runs on the CPU here: DEVICE=cpu K=build-cpu/kvq SPECS="$NGRAM $DRAFT $DFLASH" ...
K=${KVQ:-$K}
case "$PART" in
tests)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  step "kvq_cuda_model_tests"
  $B/tests/kvq_cuda_model_tests > "$OUT/model_tests.log" 2>&1; echo "rc=$?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|^note:|identical, " "$OUT/model_tests.log"
  step "kvq generate: plain vs speculative, CPU and GPU (64 greedy tokens)"
  for kv in bfloat16 fp8 int4_per_token_head; do
    for spec in "{$NGRAM,\"num_speculative_tokens\":4}" "{$DRAFT,\"num_speculative_tokens\":4}" "{$DFLASH,\"num_speculative_tokens\":8}"; do
      for dev in cpu cuda; do
        a=$($K generate --model models/kvq-code-tiny --prompt $'import os\n\ndef ' --temperature 0 -n 64 --output-ids --kv-cache-dtype $kv --device $dev 2>/dev/null)
        b=$($K generate --model models/kvq-code-tiny --prompt $'import os\n\ndef ' --temperature 0 -n 64 --output-ids --kv-cache-dtype $kv --device $dev --speculative-config "$spec" 2>"$OUT/gen.err")
        echo "$kv $dev $(echo "$spec" | cut -c1-40): $([ "$a" = "$b" ] && echo identical || echo DIFFERENT) | $(grep speculative "$OUT/gen.err" | sed 's/.*| drafted/drafted/')"
      done
    done
  done
  ;;
grid)
  for kv in ${KVS:-bfloat16 fp8 int4_per_token_head}; do
    for batch in ${BATCHES:-1 8 32}; do
      for k in ${KS:-2 4 8}; do
        for spec in ${SPECS:-"$NGRAM" "$DRAFT" "$DFLASH"}; do
          $K bench --model models/kvq-code-tiny --device ${DEVICE:-cuda} --kv-cache-dtype $kv --batch $batch \
            --input-len 256 --output-len ${OUTLEN:-128} --num-prompts ${NUMP:-$((batch < 16 ? 16 : batch))} \
            --dataset models/kvq-code-tiny/heldout.txt \
            --speculative-config "{$spec,\"num_speculative_tokens\":$k}" --json 2>/dev/null |
            python3 /tmp/spec_fmt.py \
            >> "$OUT/spec-grid.jsonl"
        done
      done
    done
  done
  ;;
verify8b)
  for kv in bfloat16 fp8; do
    for ctx in 1024 8000; do
      for batch in 1 8 32; do
        for v in 0 7; do
          $K bench --synthetic llama3-8b --device cuda --kv-cache-dtype $kv --batch $batch \
            --input-len $ctx --output-len 24 --prefill-sequences 1 --verify-tokens $v --json 2>/dev/null |
            python3 /tmp/spec_fmt.py \
            >> "$OUT/spec-verify8b.jsonl"
        done
      done
    done
  done
  ;;
esac
step done
