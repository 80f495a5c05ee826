#!/usr/bin/env bash
# Decode-step overheads on the GPU machine (issue #14, batch-1 steps at the weight floor),
# inside a gpu-bundle holding build/kvq, build/bench/cuda_gemm_bench and the CUDA test binaries:
#   here:   KVQ_BUNDLE_FILE=.carry/bundle-step.tar.xz bash scripts/gpu-bundle.sh build/kvq \
#             build/bench/cuda_gemm_bench build/tests/kvq_cuda_tests build/tests/kvq_cuda_model_tests
#   device: KVQ_BUNDLE_FILE=.carry/bundle-step.tar.xz bash scripts/gpu-bundle.sh --run 'bash scripts/gpu-step-check.sh PART...'
# PARTs (run in order):
#   lab    cuda_gemm_bench, bf16, the 8B projections at m 1 / 8 / 64, beta 0 and beta 1.
#   ab     `kvq bench --synthetic llama3-8b` decode, each point with AB settings in turn
#          (AB="KVQ_FP8_FUSE=1 KVQ_FP8_FUSE=0" for example; a setting may join several variables with
#          commas, "A=1,B=2"; default one plain run; KVS, BATCHES, CTXS, DTYPES,
#          REPS narrow it; VERIFY=k times verification steps of 1 + k tokens), then the default
#          model (models/kvq-code-tiny) at batch 1 / 8 (TINY=0: not).
#   trace  a kernel timeline of graph-replayed 8B steps through CUPTI (bench/trace/cupti_trace.cc,
#          the bundle holds build/bench/libkvq_cupti_trace.so) summarised by bench/trace_summary.py:
#          the step's period against its GPU span, every kernel class's time and launch gaps, the
#          host calls (KVS, BATCHES, CTXS, DTYPES, VERIFY, AB as for ab; TINY=1 adds the default
#          model).
#   ncu    per-kernel times of 8B decode steps at batch 1 (Nsight Compute, in place; VERIFY=k:
#          of verification steps).
#   tests  the cache-write and decode tests of kvq_cuda_tests, then the whole CUDA model tests.
#   gemv   kvq's skinny GEMM (src/model/cuda/gemv.h): its tests, compute-sanitizer memcheck and
#          racecheck, then cuda_gemm_bench bf16 (cuBLASLt's best) vs gemv on the 8B shapes and
#          one TP-2 rank's (M, default 1,2,4,8,16; MODES, default bf16,gemv).
#   forced the whole CUDA model test binary with KVQ_GEMV=force (every tuned shape it takes on
#          the skinny kernel).
# Logs and JSON lines go to $OUT (or ./out-step).
set -uo pipefail
OUT=${OUT:-$PWD/out-step}
mkdir -p "$OUT"
B=bundle/build
step() { echo "=== [${SECONDS}s] $*"; }
for part in "${@:-lab ab tests}"; do
  case "$part" in
  lab)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    for beta in 0 1; do
      step "cuda_gemm_bench bf16 beta $beta"
      $B/bench/cuda_gemm_bench --modes bf16 --m 1,8,64 --beta $beta | tee -a "$OUT/gemm-lab.jsonl"
    done
    ;;
  ab)
    for rep in $(seq 1 "${REPS:-1}"); do
      for w in ${DTYPES:-bfloat16}; do
        for kv in ${KVS:-bfloat16 fp8}; do
          for ctx in ${CTXS:-1024}; do
            for b in ${BATCHES:-1 8 64}; do
              for ab in ${AB:-KVQ_AB=plain}; do
                env ${ab//,/ } timeout 90 $B/kvq bench --synthetic llama3-8b --device cuda --dtype $w \
                  --kv-cache-dtype $kv --batch $b --input-len $ctx --output-len ${OUTLEN:-32} \
                  --prefill-sequences 1 --verify-tokens ${VERIFY:-0} --json 2>>"$OUT/ab.err" |
                  python3 bench/step_summary.py "$ab" >> "$OUT/ab.jsonl"
              done
            done
          done
        done
      done
      [ "${TINY:-1}" = 1 ] || continue
      for kv in ${KVS:-bfloat16 fp8}; do
        for b in 1 8; do
          for ab in ${AB:-KVQ_AB=plain}; do
            env ${ab//,/ } timeout 90 $B/kvq bench --model models/kvq-code-tiny --device cuda \
              --kv-cache-dtype $kv --batch $b --input-len 256 --output-len 128 --json \
              2>>"$OUT/ab.err" | python3 bench/step_summary.py "$ab" >> "$OUT/ab-tiny.jsonl"
          done
        done
      done
    done
    ;;
  trace)
    for w in ${DTYPES:-bfloat16}; do
      for kv in ${KVS:-bfloat16}; do
        for ctx in ${CTXS:-1024}; do
          for b in ${BATCHES:-1}; do
            for ab in ${AB:-KVQ_AB=plain}; do
              tag="$w-$kv-b$b-c$ctx-v${VERIFY:-0}-${ab//[^A-Za-z0-9_]/_}"
              step "trace $tag"
              env ${ab//,/ } CUDA_INJECTION64_PATH=$PWD/$B/bench/libkvq_cupti_trace.so \
                KVQ_TRACE_OUT="$OUT/trace-$tag.csv" timeout 120 $B/kvq bench --synthetic llama3-8b \
                --device cuda --dtype $w --kv-cache-dtype $kv --batch $b --input-len $ctx \
                --output-len ${OUTLEN:-32} --prefill-sequences 1 --verify-tokens ${VERIFY:-0} \
                --json > "$OUT/trace-$tag.json" 2>>"$OUT/trace.err"
              python3 bench/trace_summary.py "$OUT/trace-$tag.csv" --label "$tag" \
                --json "$OUT/trace.jsonl" | tee "$OUT/trace-$tag.txt"
              gzip -f "$OUT/trace-$tag.csv"
            done
          done
        done
      done
    done
    if [ "${TINY:-0}" = 1 ]; then
      for kv in ${KVS:-bfloat16}; do
        for b in 1 8; do
          tag="tiny-$kv-b$b"
          step "trace $tag"
          CUDA_INJECTION64_PATH=$PWD/$B/bench/libkvq_cupti_trace.so KVQ_TRACE_OUT="$OUT/trace-$tag.csv" \
            timeout 120 $B/kvq bench --model models/kvq-code-tiny --device cuda --kv-cache-dtype $kv \
            --batch $b --input-len 256 --output-len 64 --json > "$OUT/trace-$tag.json" 2>>"$OUT/trace.err"
          python3 bench/trace_summary.py "$OUT/trace-$tag.csv" --label "$tag" \
            --json "$OUT/trace.jsonl" | tee "$OUT/trace-$tag.txt"
          gzip -f "$OUT/trace-$tag.csv"
        done
      done
    fi
    ;;
  ncu)
    for kv in ${KVS:-bfloat16}; do
      step "ncu 8B batch 1 kv $kv"
      timeout 240 ncu --cache-control none --clock-control none --metrics gpu__time_duration.sum \
        --launch-skip 30000 --launch-count 1000 --csv \
        $B/kvq bench --synthetic llama3-8b --device cuda --kv-cache-dtype $kv --batch 1 \
        --input-len 1024 --output-len 128 --prefill-sequences 1 --verify-tokens ${VERIFY:-0} --json \
        > "$OUT/ncu-b1-$kv-v${VERIFY:-0}.csv" 2> "$OUT/ncu-b1-$kv-v${VERIFY:-0}.err"
      gzip -f "$OUT/ncu-b1-$kv-v${VERIFY:-0}.csv"
    done
    ;;
  tests)
    step "kvq_cuda_tests: cache writes and decode"
    timeout 400 $B/tests/kvq_cuda_tests --gtest_filter='*Write*:*CudaDecode*:*CudaPrefill*' \
      > "$OUT/cuda-tests.log" 2>&1; echo "rc=$?"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$OUT/cuda-tests.log" | tail -8
    step "the whole CUDA model test binary"
    timeout 500 $B/tests/kvq_cuda_model_tests > "$OUT/model-tests.log" 2>&1; echo "rc=$?"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$OUT/model-tests.log" | tail -8
    ;;
  gemv)
    nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
    step "GemvBf16 and GemmTuner tests"
    timeout 120 $B/tests/kvq_cuda_model_tests --gtest_filter='Gemv*:GemmTuner.*' \
      > "$OUT/gemv-tests.log" 2>&1; echo "rc=$?"
    grep -E "^\[  (FAILED|PASSED|SKIPPED|     OK) |^\[==========\]" "$OUT/gemv-tests.log" | tail -8
    for tool in memcheck racecheck; do
      step "compute-sanitizer $tool Gemv*.Match*, the SiLU epilogue and the norm prologue"
      timeout 240 compute-sanitizer --tool $tool $B/tests/kvq_cuda_model_tests \
        --gtest_filter='Gemv*.Match*:GemvBf16.SiluMul*:GemvBf16.NormPrologue*' > "$OUT/gemv-$tool.log" 2>&1
      echo "rc=$?"; tail -3 "$OUT/gemv-$tool.log"
    done
    for set in llama3-8b llama3-8b-tp2; do
      step "cuda_gemm_bench bf16 vs gemv, $set"
      timeout 200 $B/bench/cuda_gemm_bench --shapes $set --modes ${MODES:-bf16,gemv} --layers ${LAYERS:-4} \
        --m ${GEMV_M:-1,2,4,8,16} | tee -a "$OUT/gemv-lab.jsonl"
    done
    ;;
  forced)
    step "the whole CUDA model test binary, KVQ_GEMV=force"
    KVQ_GEMV=force timeout 500 $B/tests/kvq_cuda_model_tests > "$OUT/model-tests-gemv.log" 2>&1
    echo "rc=$?"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$OUT/model-tests-gemv.log" | tail -8
    ;;
  *) echo "gpu-step-check: unknown part $part (lab, ab, ncu, tests, gemv, forced)" >&2; exit 2 ;;
  esac
done
step done
