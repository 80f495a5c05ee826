#!/usr/bin/env bash
# The speculative verification shape on the GPU machine (the device tool): the small-q prefill
# block shape against the default one.
#   kernels  builds the kernel areas there (KVQ_KERNELS_ONLY, GoogleTest carried by
#            `scripts/gpu-check.sh --prepare`), runs the CUDA prefill tests, compute-sanitizer
#            memcheck / racecheck on the small shapes, and `cuda_prefill_bench --verify`.
#            device: run(command="bash scripts/gpu-verify-shape.sh kernels", carry=[".carry"])
#   verify8b inside a gpu-bundle holding build/kvq: `kvq bench --synthetic llama3-8b` decode
#            steps and 1 + 7-token verification steps on the decode kernel and on the prefill
#            kernel's small-q block (KVQ_VERIFY_KERNEL), in one run. KVS, CTXS, BATCHES narrow
#            it; RUNS="TOKENS,SMALL_Q,KERNEL ..." replaces the runs (e.g. RUNS="0,1,decode").
#            device: KVQ_BUNDLE_FILE=... bash scripts/gpu-bundle.sh --run 'bash scripts/gpu-verify-shape.sh verify8b'
#   model-tests  the CUDA model's speculative / DFlash tests from the bundle.
#   grid     `kvq bench --speculative-config` on the default model, k = 8, dflash and ngram,
#            (or draft_model, k = 4),
#            batch 1 / 8 / 32 (KVS, BATCHES, METHODS narrow it; AB="VAR=a VAR=b" runs each
#            point under each setting; WAVES=n runs n x batch prompts, so the batch stays full
#            while requests queue, instead of max(16, batch) prompts; SPEC_EXTRA is appended
#            to the speculative config, e.g. SPEC_EXTRA=',"auto_disable":true').
# Logs and JSON lines go to $OUT (or ./out-verify).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out-verify}
mkdir -p "$OUT"
step() { echo "=== [${SECONDS}s] $*"; }
case "${1:-kernels}" in
kernels)
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  step "build"
  B=build-gpu
  cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=Release -DKVQ_CUDA=ON -DKVQ_KERNELS_ONLY=ON \
    -DKVQ_GTEST_SOURCE_DIR="$PWD/.carry/googletest" > "$OUT/build.log" 2>&1 &&
    ninja -C "$B" -j16 kvq_cuda_tests cuda_prefill_bench >> "$OUT/build.log" 2>&1 ||
    { echo "BUILD FAILED"; grep -B2 -A10 -m3 -E "error|FAILED" "$OUT/build.log"; exit 1; }
  step "CUDA prefill tests"
  timeout 300 "$B/tests/kvq_cuda_tests" --gtest_filter='CudaPrefill*:*CudaPrefillGrid*' \
    > "$OUT/prefill_tests.log" 2>&1; echo "rc=$?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|largest|Failure" "$OUT/prefill_tests.log" | head -40
  step "compute-sanitizer memcheck + racecheck (small shapes, small-q included)"
  timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 "$B/tests/kvq_cuda_tests" \
    --gtest_brief=1 --gtest_filter='CudaPrefill.SmallForSanitizers' > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?"; tail -2 "$OUT/memcheck.log"
  timeout 200 compute-sanitizer --tool racecheck --error-exitcode 9 "$B/tests/kvq_cuda_tests" \
    --gtest_brief=1 --gtest_filter='CudaPrefill.SmallForSanitizers' > "$OUT/racecheck.log" 2>&1
  echo "racecheck rc=$?"; tail -2 "$OUT/racecheck.log"
  step "cuda_prefill_bench --verify"
  timeout 300 "$B/bench/cuda_prefill_bench" --verify \
    --dtypes bfloat16,fp8_e4m3,int8_per_token_head,int4_per_token_head,nvfp4 \
    --json "$OUT/prefill-verify.json" 2>&1 | tee "$OUT/prefill-verify.txt"
  ;;
verify8b)
  K=bundle/build/kvq
  for kv in ${KVS:-bfloat16 fp8}; do
    for ctx in ${CTXS:-1024 8000}; do
      for b in ${BATCHES:-1 8 32}; do
        # (verify tokens, small-q prefill block, verification kernel)
        for run in ${RUNS:-0,1,decode 7,1,decode 7,1,prefill}; do
          set -- ${run//,/ }
          KVQ_PREFILL_SMALL_Q=$2 KVQ_VERIFY_KERNEL=$3 timeout 60 $K bench --synthetic llama3-8b \
            --device cuda --kv-cache-dtype $kv --batch $b --input-len $ctx --output-len 24 \
            --prefill-sequences 1 --verify-tokens $1 --json 2>/dev/null |
            python3 -c "import json,sys; j=json.load(sys.stdin); j['small_q']=$2; j['verify_kernel']='$3'; print(json.dumps(j)); print(f\"{j['plan'][:10]:10s} ctx {j['input_len']:5d} B={j['batch']:2d} verify {j['verify_tokens']} small_q $2 kernel $3: {j['decode_step_ms_median']:.3f} ms/step\", file=sys.stderr)" \
              >> "$OUT/verify8b.jsonl"
        done
      done
    done
  done
  ;;
model-tests)
  # The CUDA model's speculative and DFlash tests (bundle: build/tests/kvq_cuda_model_tests).
  timeout ${TESTS_TIMEOUT:-150} bundle/build/tests/kvq_cuda_model_tests \
    --gtest_filter='*Speculation*:DflashCuda*:CudaModel.GraphsOnAndOff*:*QuantizedKv*' \
    > "$OUT/model_tests.log" 2>&1; echo "model tests rc=$?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|identical, |Failure" "$OUT/model_tests.log" | head -30
  ;;
grid)
  # The default model, held-out text, k = 8: dflash and ngram at batch 1 / 8 / 32 (bundle).
  # METHODS may name draft_model too (models/kvq-code-tiny-draft, k = K_DRAFT, default 4, or a list;
  # DRAFT_MODELS="dir1 dir2" runs each draft model at each point, interleaved);
  # K sets dflash's and ngram's k (default 8); DFLASH_MODEL another DFlash drafter.
  DFLASH="\"method\":\"dflash\",\"model\":\"${DFLASH_MODEL:-models/kvq-code-tiny-dflash}\""
  NGRAM='"method":"ngram","prompt_lookup_min":1,"prompt_lookup_max":3'
  for kv in ${KVS:-bfloat16}; do
    for batch in ${BATCHES:-1 8 32}; do
      for method in ${METHODS:-dflash ngram}; do
       drafters=-
       [ "$method" = draft_model ] && drafters=${DRAFT_MODELS:-models/kvq-code-tiny-draft}
       # AB: settings to compare in the same run, e.g. AB="KVQ_DFLASH_FUSE=1 KVQ_DFLASH_FUSE=0".
       for ab in ${AB:-KVQ_AB=none}; do
       for dm in $drafters; do
       ks=${K:-8}
       [ "$method" = draft_model ] && ks=${K_DRAFT:-4}
       for k in $ks; do
        spec=$DFLASH
        [ "$method" = ngram ] && spec=$NGRAM
        [ "$method" = draft_model ] && spec="\"method\":\"draft_model\",\"model\":\"$dm\""
        env "$ab" timeout 60 bundle/build/kvq bench --model models/kvq-code-tiny --device cuda --kv-cache-dtype $kv \
          --batch $batch --input-len 256 --output-len 128 --num-prompts $((${WAVES:-0} > 0 ? batch * ${WAVES:-0} : (batch < 16 ? 16 : batch))) \
          --dataset models/kvq-code-tiny/heldout.txt \
          --speculative-config "{$spec,\"num_speculative_tokens\":$k${SPEC_EXTRA:-}}" --json 2>/dev/null |
          AB="$ab" DM="$dm" python3 -c "import json,os,sys; j=json.load(sys.stdin); j['ab']=os.environ['AB']; j['drafter_dir']=os.environ['DM']; print(json.dumps(j)); print(f\"{j['ab']:18s} {j['drafter_dir'][-28:]:28s} k={j.get('num_speculative_tokens','?')} {j['plan'][:10]:10s} {j['method']:6s} B={j['batch']:2d} plain {j['plain_tokens_per_s']:8.0f} spec {j['speculative_tokens_per_s']:8.0f} x{j['speedup']:.2f} len {j['mean_accepted_length']:.2f} same {j['greedy_outputs_identical']}/{j['num_prompts']} ms/step {j['plain_ms_per_step']:.3f} / {j['spec_ms_per_step']:.3f} ({j['spec_draft_ms_per_step']:.3f} + {j['spec_forward_ms_per_step']:.3f})\", file=sys.stderr)" \
            >> "$OUT/spec-grid.jsonl"
       done
       done
       done
      done
    done
  done
  ;;
*)
  echo "usage: $0 kernels|verify8b|model-tests|grid" >&2
  exit 2
  ;;
esac
step "done"
