#!/usr/bin/env bash
# Runs on the GPU machine (the device tool): builds the kernel areas with CUDA, runs the CUDA
# test binary, compute-sanitizer memcheck and racecheck, and optionally the decode / prefill
# benchmarks (--bench: both; --prefill-bench: prefill only).
#
# The GPU machine has CUDA, CMake, ninja and PyTorch but not GoogleTest, PCRE2, OpenBLAS or
# CLI11, so this builds with KVQ_KERNELS_ONLY and GoogleTest from sources carried along:
#   here:   scripts/gpu-check.sh --prepare     (copies /usr/src/googletest to .carry/, git-ignored)
#   device: run(command="bash scripts/gpu-check.sh [--bench|--prefill-bench]", carry=[".carry"])
# KVQ_NO_SANITIZERS=1 skips memcheck / racecheck.
# Logs go to $OUT (or ./out-gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  mkdir -p .carry && rm -rf .carry/googletest && cp -r /usr/src/googletest .carry/googletest
  grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
  echo "prepared .carry/googletest"
  exit 0
fi
OUT=${OUT:-$PWD/out-gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/gpu-check.log") 2>&1
step() { echo "=== [${SECONDS}s] $*"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
nvcc --version | tail -2 | head -1

step "build"
B=build-gpu
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DKVQ_KERNELS_ONLY=ON \
  -DKVQ_GTEST_SOURCE_DIR="$PWD/.carry/googletest" > "$OUT/build.log" 2>&1 &&
  ninja -C "$B" -j16 kvq_cuda_tests kvq_attention_tests kvq_cache_tests cuda_decode_bench cuda_prefill_bench >> "$OUT/build.log" 2>&1 ||
  { echo "BUILD FAILED"; grep -B2 -A10 -m3 -E "error|Error|FAILED" "$OUT/build.log"; exit 1; }

step "kvq_cuda_tests"
"$B/tests/kvq_cuda_tests" > "$OUT/tests.log" 2>&1; echo "tests rc=$?"
grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$OUT/tests.log"
"$B/tests/kvq_attention_tests" --gtest_brief=1 2>&1 | tail -2

if [ -z "${KVQ_NO_SANITIZERS:-}" ]; then
step "compute-sanitizer memcheck"
compute-sanitizer --tool memcheck --error-exitcode 9 "$B/tests/kvq_cuda_tests" --gtest_brief=1 \
  > "$OUT/memcheck.log" 2>&1; echo "memcheck rc=$?"; tail -2 "$OUT/memcheck.log"

step "compute-sanitizer racecheck"
compute-sanitizer --tool racecheck --error-exitcode 9 "$B/tests/kvq_cuda_tests" --gtest_brief=1 \
  --gtest_filter='CudaDecode.*:*CudaDecodeGrid.MatchesCpuReference/fp8_e4m3:*CudaDecodeGrid.MatchesCpuReference/int4_per_token_head:CudaPrefill.SmallForSanitizers' \
  > "$OUT/racecheck.log" 2>&1; echo "racecheck rc=$?"; tail -2 "$OUT/racecheck.log"
fi

if [ "${1:-}" = "--bench" ]; then
  step "decode + prefill benchmarks"
  bash bench/run_gpu_bench.sh "$B" "$OUT/bench"
elif [ "${1:-}" = "--prefill-bench" ]; then
  step "prefill benchmark"
  bash bench/run_gpu_bench.sh "$B" "$OUT/bench" --prefill-only
fi
step "done"
