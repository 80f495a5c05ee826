#!/usr/bin/env bash
# The decode kernel's cluster merge (DecodePlan::cluster, docs/notes/decode-tuning.md version
# 17) on the GPU machine, inside a gpu-bundle holding build/kvq, build/bench/cuda_decode_bench
# and the CUDA test binaries:
#   here:   KVQ_BUNDLE_FILE=.carry/bundle-new.tar.xz bash scripts/gpu-bundle.sh build/kvq \
#             build/bench/cuda_decode_bench build/tests/kvq_cuda_tests build/tests/kvq_cuda_model_tests
#   device: KVQ_BUNDLE_FILE=.carry/bundle-new.tar.xz bash scripts/gpu-bundle.sh --run \
#             'bash scripts/gpu-decode-cluster.sh PART...'
# PARTs (run in order):
#   tests     kvq_cuda_tests' decode and cache-write tests (the cluster test among them)
#   sanitize  compute-sanitizer memcheck and racecheck on the cluster test (bf16, fp8, int4)
#   model     the whole CUDA model test binary, then the skinny-GEMM tests
#   ab        `kvq bench` steps with KVQ_DECODE_CLUSTER=0 against the default rule (or AB=...):
#             Llama-3-8B shape at BATCHES x CTXS x VERIFY (verification steps of 1 + k tokens,
#             default 0: decode; EIGHTB=0 skips it), then the default model at batch 1 / 8 plain
#             (TINY_PLAIN=0 skips it) and with the DFlash drafter, k in DFLASH_K (default 8;
#             TINY=0 skips both)
#   lab       cuda_decode_bench at small batches, cluster merge off and on
# Logs and JSON lines go to $OUT (or ./out-cluster).
set -uo pipefail
OUT=${OUT:-$PWD/out-cluster}
mkdir -p "$OUT"
B=bundle/build
step() { echo "=== [${SECONDS}s] $*"; }
summary() { grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$1" | tail -8; }
AB=${AB:-KVQ_DECODE_CLUSTER=0 KVQ_DECODE_CLUSTER=auto}
DFLASH='{"method":"dflash","model":"models/kvq-code-tiny-dflash","num_speculative_tokens":8}'
for part in "$@"; do
  case "$part" in
  tests)
    step "kvq_cuda_tests: decode and cache writes"
    timeout 300 $B/tests/kvq_cuda_tests --gtest_filter='*Write*:*CudaDecode*' \
      > "$OUT/cuda-tests.log" 2>&1
    echo "rc=$?"
    summary "$OUT/cuda-tests.log"
    ;;
  sanitize)
    for tool in memcheck racecheck; do
      step "compute-sanitizer $tool"
      timeout 200 compute-sanitizer --tool $tool --error-exitcode 9 $B/tests/kvq_cuda_tests \
        --gtest_filter='*CudaDecodeCluster.MatchesCpuReference/bfloat16:*CudaDecodeCluster.MatchesCpuReference/fp8_e4m3:*CudaDecodeCluster.MatchesCpuReference/int4_per_token_head' \
        > "$OUT/sanitize-$tool.log" 2>&1
      echo "rc=$?"
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|^\[  (FAILED|PASSED) " "$OUT/sanitize-$tool.log" | tail -4
    done
    ;;
  model)
    step "the whole CUDA model test binary"
    timeout 420 $B/tests/kvq_cuda_model_tests > "$OUT/model-tests.log" 2>&1
    echo "rc=$?"
    summary "$OUT/model-tests.log"
    ;;
  ab)
    for rep in $(seq 1 "${REPS:-2}"); do
      for kv in ${KVS:-bfloat16 fp8}; do
        for ctx in ${CTXS:-1024}; do
          [ "${EIGHTB:-1}" = 0 ] && break
          for b in ${BATCHES:-1}; do
            for v in ${VERIFY:-0}; do
              for ab in $AB; do
                env ${ab//,/ } timeout 90 $B/kvq bench --synthetic llama3-8b --device cuda \
                  --kv-cache-dtype $kv --batch $b --input-len $ctx --output-len 32 \
                  --prefill-sequences 1 --verify-tokens $v --json 2>>"$OUT/ab.err" |
                  python3 bench/step_summary.py "$ab verify=$v" >> "$OUT/ab.jsonl"
              done
            done
          done
        done
        for b in 1 8; do
          [ "${TINY:-1}" = 0 ] && break
          for ab in $AB; do
            [ "${TINY_PLAIN:-1}" = 1 ] &&
              env ${ab//,/ } timeout 90 $B/kvq bench --model models/kvq-code-tiny --device cuda \
                --kv-cache-dtype $kv --batch $b --input-len 256 --output-len 128 --json \
                2>>"$OUT/ab.err" | python3 bench/step_summary.py "$ab" >> "$OUT/ab-tiny.jsonl"
            for k in ${DFLASH_K:-8}; do
              env ${ab//,/ } timeout 120 $B/kvq bench --model models/kvq-code-tiny --device cuda \
                --kv-cache-dtype $kv --batch $b --input-len 256 --output-len 128 --num-prompts 16 \
                --dataset models/kvq-code-tiny/heldout.txt --speculative-config "${DFLASH/:8/:$k}" \
                --json 2>>"$OUT/ab.err" | python3 bench/step_summary.py "$ab k=$k" >> "$OUT/ab-dflash.jsonl"
            done
          done
        done
      done
    done
    ;;
  lab)
    for ab in $AB; do
      step "cuda_decode_bench $ab"
      env ${ab//,/ } timeout 200 $B/bench/cuda_decode_bench --dtypes ${DTYPES:-bfloat16,fp8_e4m3,int4_per_token_head} \
        --batches ${LAB_BATCHES:-1,2} --contexts ${LAB_CTXS:-256,1024,4096} --heads 32 > "$OUT/lab-${ab//[=,]/_}.txt" 2>&1
      echo "rc=$?"
    done
    ;;
  *)
    echo "unknown part $part" >&2
    exit 2
    ;;
  esac
done
