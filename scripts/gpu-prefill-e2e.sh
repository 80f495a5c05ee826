#!/usr/bin/env bash
# Runs on the GPU machine inside a bundle (scripts/gpu-bundle.sh --run): the prefill kernels'
# checks and benchmarks with binaries built here.
#   here:   scripts/gpu-bundle.sh build/kvq build/tests/kvq_cuda_tests \
#             build/tests/kvq_cuda_model_tests build/bench/cuda_prefill_bench
#   device: run(command="bash scripts/gpu-bundle.sh --run 'bash scripts/gpu-prefill-e2e.sh tests'",
#               carry=[".carry/bundle.tar.xz"])
# Modes: tests  (kvq_cuda_tests, kvq_cuda_model_tests, compute-sanitizer on the wgmma cases)
#        bench  (cuda_prefill_bench on every shape, PyTorch SDPA cuDNN / flash, the merged table,
#                then end-to-end prefill of the Llama-3.1-8B shape (MODEL) at 4k and 16k per KV dtype on
#                the mma.sync and wgmma kernels: KVQ_PREFILL_KERNEL=mma | auto)
#        e2e    (the end-to-end part of bench only)
# Every step has a time limit. Logs and JSON go to $OUT (the end-to-end JSON to E2E_DIR if set).
set -uo pipefail
OUT=${OUT:-$PWD/out-gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/prefill-e2e.log") 2>&1
step() { echo "=== [${SECONDS}s] $*"; }
B=bundle/build
mode=${1:-tests}
step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "$mode" = tests ]; then
  step "kvq_cuda_tests"
  timeout 280 "$B/tests/kvq_cuda_tests" --gtest_brief=1 > "$OUT/cuda-tests.log" 2>&1
  echo "rc=$?"; grep -E "^\[  (FAILED|PASSED) |^\[==========\]" "$OUT/cuda-tests.log" | tail -6
  step "kvq_cuda_model_tests"
  timeout 280 "$B/tests/kvq_cuda_model_tests" --gtest_brief=1 > "$OUT/model-tests.log" 2>&1
  echo "rc=$?"; grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$OUT/model-tests.log" | tail -8
  step "compute-sanitizer (wgmma)"
  for tool in memcheck racecheck; do
    timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 "$B/tests/kvq_cuda_tests" \
      --gtest_brief=1 --gtest_filter='CudaPrefillWgmma.SmallForSanitizers' > "$OUT/$tool.log" 2>&1
    echo "$tool rc=$?"; tail -1 "$OUT/$tool.log"
  done
else
  if [ "$mode" = bench ]; then
  step "cuda_prefill_bench"
  timeout 240 "$B/bench/cuda_prefill_bench" --dtypes "${DTYPES:-bfloat16,fp8_e4m3,int8_per_token_head,int4_per_token_head}" \
    --json "$OUT/kvq_prefill.json" | grep -v "^$"
  step "sdpa"
  PYTHONUNBUFFERED=1 timeout 200 python3 bench/sdpa_bench.py --prefill --json "$OUT/sdpa_prefill.json"
  python3 bench/sdpa_bench.py --prefill-report "$OUT/kvq_prefill.json" "$OUT/sdpa_prefill.json" \
    --markdown "$OUT/prefill_tables.md"
  fi
  step "end to end: ${MODEL:-llama3.1-8b} shape, batch 1, prefill"
  for len in ${LENS:-4096 16384}; do
    for kv in bfloat16 fp8; do
      for k in mma auto; do
        mkdir -p "${E2E_DIR:-$OUT}"
        f="${E2E_DIR:-$OUT}/e2e-$len-$kv-$k.json"
        KVQ_PREFILL_KERNEL=$k timeout 120 "$B/kvq" bench --synthetic "${MODEL:-llama3.1-8b}" --device cuda --batch 1 \
          --input-len "$len" --output-len 2 --kv-cache-dtype "$kv" --json > "$f" 2> "$f.err" ||
          { echo "$len $kv $k: failed"; tail -2 "$f.err"; continue; }
        python3 -c "import json,sys; j=json.load(open(sys.argv[1])); print(sys.argv[2], 'prefill tok/s %.0f' % j['prefill_tokens_per_s'])" "$f" "$len $kv $k:"
      done
    done
  done
fi
step "done"
