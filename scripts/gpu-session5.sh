set -u
B=bundle/build
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "=== all CUDA model tests"
timeout 330 $B/tests/kvq_cuda_model_tests > $OUT/model_tests.log 2>&1; echo rc=$?
grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|identical, |mean accepted|worst|Failure" $OUT/model_tests.log | head -60
echo "=== grid"
KVS="bfloat16 fp8" BATCHES="1 8 32" KS="8" NUMP=16 timeout 200 bash scripts/gpu-spec-check.sh grid 2>&1 | tail -20
