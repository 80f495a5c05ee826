#!/usr/bin/env bash
# FP8 weights on the GPU machine (issue #13), inside a gpu-bundle holding build/kvq and
# build/tests/kvq_cuda_model_tests:
#   here:   KVQ_BUNDLE_FILE=.carry/bundle-fp8.tar.xz bash scripts/gpu-bundle.sh build/kvq build/tests/kvq_cuda_model_tests
#   device: KVQ_BUNDLE_FILE=.carry/bundle-fp8.tar.xz bash scripts/gpu-bundle.sh --run 'bash scripts/gpu-fp8-check.sh PART'
# PART:
#   tests  the FP8 GEMM and model tests, then the whole CUDA model test binary (the bf16 path
#          goes through the same Linear / tuner code).
#   bench  `kvq bench --synthetic llama3-8b` decode at weights bf16 / fp8 x KV dtypes x batch x
#          context (WEIGHTS, KVS, BATCHES, CTXS narrow it; OUTLEN generated tokens, default 32),
#          JSON lines in $OUT/fp8-bench.jsonl and one summary line per point on stderr.
# Logs go to $OUT (or ./out-fp8).
set -uo pipefail
OUT=${OUT:-$PWD/out-fp8}
mkdir -p "$OUT"
B=bundle/build
step() { echo "=== [${SECONDS}s] $*"; }
case "${1:-tests}" in
tests)
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  step "FP8 tests"
  timeout 300 $B/tests/kvq_cuda_model_tests --gtest_filter='GemmTuner.*:CudaModelFp8*' \
    > "$OUT/fp8-tests.log" 2>&1; echo "rc=$?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|Failure|FP8|seed" "$OUT/fp8-tests.log" | head -40
  step "the whole CUDA model test binary"
  timeout 500 $B/tests/kvq_cuda_model_tests > "$OUT/model-tests.log" 2>&1; echo "rc=$?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$OUT/model-tests.log" | tail -15
  ;;
bench)
  for w in ${WEIGHTS:-bfloat16 fp8}; do
    for kv in ${KVS:-bfloat16 fp8 int4_per_token_head}; do
      for ctx in ${CTXS:-1024 4096}; do
        for b in ${BATCHES:-1 16 64}; do
          timeout 90 $B/kvq bench --synthetic llama3-8b --device cuda --dtype $w --kv-cache-dtype $kv \
            --batch $b --input-len $ctx --output-len ${OUTLEN:-32} --prefill-sequences 1 --json \
            2>>"$OUT/fp8-bench.err" |
            python3 -c "import json,sys; j=json.load(sys.stdin); print(json.dumps(j)); m=j['memory']; print(f\"w={m['weight_dtype']:8s} kv={j['plan'][:12]:12s} ctx {j['input_len']:5d} B={j['batch']:2d}: {j['decode_tokens_per_s']:8.0f} tok/s {j['decode_step_ms_median']:.3f} ms/step floor {j['decode_floor_ms']:.3f} ({j['decode_step_ms_median']/max(j['decode_floor_ms'],1e-9):.2f}x) prefill {j['prefill_tokens_per_s']:.0f} tok/s\", file=sys.stderr)" \
            >> "$OUT/fp8-bench.jsonl"
        done
      done
    done
  done
  ;;
esac
step done
