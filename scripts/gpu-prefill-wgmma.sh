#!/usr/bin/env bash
# Runs on the GPU machine (the device tool): the warpgroup-MMA prefill kernel's lab loop in one
# call. Builds the kernel areas (KVQ_KERNELS_ONLY, GoogleTest carried: scripts/gpu-check.sh
# --prepare), runs the prefill tests, compute-sanitizer memcheck / racecheck on the small
# wgmma cases, then the prefill benchmark (mma.sync and wgmma kernels side by side) and, with
# --sdpa, PyTorch SDPA (cuDNN, flash) on the same shapes with the merged table last.
#   device: run(command="bash scripts/gpu-prefill-wgmma.sh [--quick] [--sdpa] [--dtypes a,b]",
#               carry=[".carry"])
# Each step has a time limit, so a hung kernel ends the step, not the call. Logs go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out-gpu}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/prefill-wgmma.log") 2>&1
step() { echo "=== [${SECONDS}s] $*"; }
quick="" sdpa=0 lab="" dtypes="bfloat16,fp8_e4m3,float16,fp8_e5m2,int8_per_token_head,int4_per_token_head"
tests="CudaPrefill*:*CudaPrefillGrid*"
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick="--quick" ;;
    --sdpa) sdpa=1 ;;
    --dtypes) dtypes="$2"; shift ;;
    --tests) tests="$2"; shift ;;
    # --lab "ENV=V ENV=V;ENV=V ...": after the tests, the quick bench once per ';'-separated set
    # of kernel-lab variables (KVQ_PREFILL_LAB, KVQ_PREFILL_KERNEL), wgmma lines only.
    --lab) lab="$2"; shift ;;
  esac
  shift
done

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
step "build"
B=build-gpu
cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DKVQ_KERNELS_ONLY=ON \
  -DKVQ_GTEST_SOURCE_DIR="$PWD/.carry/googletest" > "$OUT/build.log" 2>&1 &&
  ninja -C "$B" -j16 kvq_cuda_tests cuda_prefill_bench >> "$OUT/build.log" 2>&1 ||
  { echo "BUILD FAILED"; grep -B2 -A10 -m3 -E "error|Error|FAILED" "$OUT/build.log"; exit 1; }

if [ -n "${KVQ_SASS:-}" ]; then
  # SASS of the bf16 wgmma kernels (instruction mix: HGMMA, barriers, waits).
  obj=$(find "$B" -name 'prefill_bfloat16.cu.o' | head -1)
  cuobjdump -sass "$obj" > "$OUT/sass-prefill-bf16.txt" 2>&1
  awk '/Function : .*prefill_wgmma/{f=1} /Function : .*prefill_kernel/{f=0} f' "$OUT/sass-prefill-bf16.txt" |
    grep -oE '^\s+/\*[0-9a-f]+\*/\s+[A-Z0-9_.]+' | awk '{print $2}' | sort | uniq -c | sort -rn | head -40
fi
step "wgmma tests"
timeout 300 "$B/tests/kvq_cuda_tests" --gtest_filter='CudaPrefillWgmma.*' > "$OUT/wgmma-tests.log" 2>&1
echo "wgmma tests rc=$?"
grep -E "^\[  (FAILED|PASSED|SKIPPED|     OK) |largest|Failure|error" "$OUT/wgmma-tests.log" | head -40
if [ -n "$tests" ]; then
  step "prefill tests ($tests)"
  timeout 400 "$B/tests/kvq_cuda_tests" --gtest_filter="$tests" > "$OUT/tests.log" 2>&1
  echo "tests rc=$?"
  grep -E "^\[  (FAILED|PASSED) |^\[==========\]" "$OUT/tests.log" | tail -8
fi
if [ -z "${KVQ_NO_SANITIZERS:-}" ]; then
  step "compute-sanitizer memcheck / racecheck (wgmma small cases)"
  timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/tests/kvq_cuda_tests" \
    --gtest_brief=1 --gtest_filter='CudaPrefillWgmma.SmallForSanitizers' > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?"; tail -3 "$OUT/memcheck.log"
  timeout 300 compute-sanitizer --tool racecheck --error-exitcode 9 "$B/tests/kvq_cuda_tests" \
    --gtest_brief=1 --gtest_filter='CudaPrefillWgmma.SmallForSanitizers' > "$OUT/racecheck.log" 2>&1
  echo "racecheck rc=$?"; tail -3 "$OUT/racecheck.log"
fi
if [ -n "$lab" ]; then
  IFS=';' read -ra sets <<< "$lab"
  for set in "${sets[@]}"; do
    step "lab: $set"
    env $set timeout 120 "$B/bench/cuda_prefill_bench" --quick --dtypes "$dtypes" | grep wgmma
  done
fi
step "prefill bench"
timeout 300 "$B/bench/cuda_prefill_bench" $quick --dtypes "$dtypes" --json "$OUT/kvq_prefill.json"
echo "bench rc=$?"
if [ "$sdpa" = 1 ]; then
  step "sdpa"
  PYTHONUNBUFFERED=1 timeout 300 python3 bench/sdpa_bench.py --prefill --json "$OUT/sdpa_prefill.json"
  python3 bench/sdpa_bench.py --prefill-report "$OUT/kvq_prefill.json" "$OUT/sdpa_prefill.json" \
    --markdown "$OUT/prefill_tables.md"
fi
step "done"
