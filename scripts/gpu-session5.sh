set -u
B=bundle/build
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "=== prefill tests (split-KV, live warps)"
timeout 200 $B/tests/kvq_cuda_tests --gtest_filter='CudaPrefill*' > $OUT/prefill_tests.log 2>&1; echo rc=$?
grep -E "^\[  (FAILED|PASSED) |^\[==========\]|split-KV|Failure" $OUT/prefill_tests.log | head -30
echo "=== racecheck small"
timeout 100 compute-sanitizer --tool racecheck $B/tests/kvq_cuda_tests --gtest_filter='CudaPrefill.SmallForSanitizers' 2>&1 | tail -2
echo "=== model tests"
timeout 120 $B/tests/kvq_cuda_model_tests > $OUT/model_tests.log 2>&1; echo rc=$?
grep -E "^\[  (FAILED|PASSED) |^\[==========\]|identical, |Failure" $OUT/model_tests.log | head -30
echo "=== verify8b"
for kv in bfloat16 fp8; do for ctx in 1024 8000; do for b in 1 8 32; do for v in 0 7; do
 timeout 40 $B/kvq bench --synthetic llama3-8b --device cuda --kv-cache-dtype $kv --batch $b --input-len $ctx --output-len 24 --prefill-sequences 1 --verify-tokens $v --json 2>/dev/null | python3 -c "import json,sys; j=json.load(sys.stdin); print(json.dumps(j)); print(j['plan'][:8], j['input_len'], j['batch'], j['verify_tokens'], round(j['decode_step_ms_median'],3), file=sys.stderr)" >> $OUT/verify8b.jsonl
done; done; done; done
