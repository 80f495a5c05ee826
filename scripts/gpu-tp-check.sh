#!/usr/bin/env bash
# Tensor parallelism on a GPU machine with 2+ GPUs (issue #17), inside a gpu-bundle holding
# build/kvq and build/tests/kvq_cuda_model_tests:
#   here:   KVQ_BUNDLE_FILE=.carry/bundle-tp.tar.xz bash scripts/gpu-bundle.sh build/kvq build/tests/kvq_cuda_model_tests
#   device: (kind nvidia-h100-x2 / nvidia-h200-x2)
#           KVQ_BUNDLE_FILE=.carry/bundle-tp.tar.xz bash scripts/gpu-bundle.sh --run 'bash scripts/gpu-tp-check.sh PART...'
# PARTs (in order):
#   info   the GPUs, how they are linked (nvidia-smi topo -m), the NCCL library in use.
#   tests  the TensorParallel* tests, then the whole CUDA model test binary.
#   smoke  kvq serve / eval / bench (ngram speculation) at -tp 2 on the default model.
#   sanitize  compute-sanitizer memcheck of the peer all-reduce tests.
#   bench  `kvq bench --synthetic llama3-8b` decode at TP 1 and 2 (TPS), KV dtypes (KVS),
#          batches (BATCHES), context CTX (default 4096); JSON lines in $OUT/tp-bench.jsonl. TP 2
#          also runs with KVQ_TP_ALLREDUCE=off (timing only: the all-reduces' share of a step;
#          ALLREDUCE_AB=0 skips it).
#   bench70  the Llama-3-70B shape at TP 2 (H200s: 70 GB of bf16 weights a rank), batch 1 / 32 at
#          4k (KVS70) and the largest batch at 16k per KV dtype (KVS70_16K); $OUT/tp70-bench.jsonl.
# NVLink multicast stays off (the device notes: NCCL_NVLS_ENABLE=0).
set -uo pipefail
export NCCL_NVLS_ENABLE=0
OUT=${OUT:-$PWD/out-tp}
mkdir -p "$OUT"
B=bundle/build
step() { echo "=== [${SECONDS}s] $*"; }
for part in "${@:-info tests}"; do
  case "$part" in
  info)
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader
    nvidia-smi topo -m 2>&1 | head -12
    ldd $B/kvq | grep -i nccl
    ;;
  tests)
    step "TensorParallel tests"
    timeout 500 $B/tests/kvq_cuda_model_tests --gtest_filter='*TensorParallel*' \
      > "$OUT/tp-tests.log" 2>&1; echo "rc=$?"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|TP 2 vs 1|Failure|first:|second:|after" "$OUT/tp-tests.log" | head -40
    step "the whole CUDA model test binary"
    timeout 500 $B/tests/kvq_cuda_model_tests --gtest_filter='-*TensorParallel*' > "$OUT/model-tests.log" 2>&1; echo "rc=$?"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]" "$OUT/model-tests.log" | tail -8
    ;;
  tp-tests)
    step "TensorParallel tests"
    timeout 500 $B/tests/kvq_cuda_model_tests --gtest_filter='*TensorParallel*' \
      > "$OUT/tp-tests.log" 2>&1; echo "rc=$?"
    grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|TP 2 vs 1|vs bf16 TP 1|Failure|first:|second:|after" "$OUT/tp-tests.log" | head -40
    ;;
  bench)
    for kv in ${KVS:-fp8}; do
      for b in ${BATCHES:-1 64}; do
        for tp in ${TPS:-1 2}; do
          modes="on"
          [ "$tp" -gt 1 ] && [ "${ALLREDUCE_AB:-1}" = 1 ] && modes="on off"
          # TP2_ENVS: variants of the TP > 1 runs, each a comma-separated list of VAR=value
          # ("-": none), e.g. "- KVQ_TP_PEER_ALLREDUCE=0 KVQ_TP_VOCAB_PARALLEL=0".
          envs="-"
          [ "$tp" -gt 1 ] && envs=${TP2_ENVS:--}
          for ev in $envs; do
            for ar in $modes; do
              [ "$ev" != "-" ] && [ "$ar" = off ] && continue  # the share once, with the defaults
              env $( [ "$ev" != "-" ] && echo "$ev" | tr ',' ' ') KVQ_TP_ALLREDUCE=$ar \
                timeout 120 $B/kvq bench --synthetic llama3-8b --device cuda \
                --tensor-parallel-size $tp --kv-cache-dtype $kv --batch $b --input-len ${CTX:-4096} \
                --output-len ${OUTLEN:-32} --prefill-sequences 1 --json 2>>"$OUT/tp-bench.err" |
                python3 bench/step_summary.py "tp=$tp allreduce=$ar env=$ev" >> "$OUT/tp-bench.jsonl"
            done
          done
        done
      done
    done
    ;;
  smoke)
    # The engine paths around the model under TP: `kvq serve -tp 2` (the engine moves the cache
    # object), `kvq eval -tp 2` (with_plan), `kvq bench -tp 2` with ngram speculation.
    M=models/kvq-code-tiny
    serve_ids() {  # TP PORT -> greedy completions of 6 concurrent prompts, one JSON line each
      $B/kvq serve --model $M --device cuda -tp $1 --kv-cache-dtype fp8 --port $2 \
        > "$OUT/serve-tp$1.log" 2>&1 &
      local pid=$!
      for _ in $(seq 100); do curl -sf localhost:$2/health >/dev/null && break; sleep 0.3; done
      for i in 0 1 2 3 4 5; do
        curl -s localhost:$2/v1/completions -H 'Content-Type: application/json' \
          -d "{\"prompt\": \"def f$i(x):\\n    return\", \"max_tokens\": 40, \"temperature\": 0}" \
          > "$OUT/serve-tp$1-$i.json" &
      done
      wait $(jobs -p | grep -v "^$pid$") 2>/dev/null
      curl -s localhost:$2/metrics | grep -E "^kvq_(kv_blocks_used|request_finished_total|request_errors_total)" || true
      kill $pid; wait $pid; echo "serve tp=$1 rc=$?"
    }
    step "serve -tp 1 / -tp 2"
    serve_ids 1 8301; serve_ids 2 8302
    for i in 0 1 2 3 4 5; do
      python3 -c 'import json,sys; a,b=(json.load(open(f))["choices"][0]["text"] for f in sys.argv[1:]); print("same" if a==b else "DIFFERENT", repr(b[:50]))' \
        "$OUT/serve-tp1-$i.json" "$OUT/serve-tp2-$i.json"
    done
    step "eval -tp 2"
    for tp in 1 2; do
      timeout 120 $B/kvq eval --model $M --device cuda -tp $tp --kv-cache-dtype fp8 \
        --text tests/fixtures/text/short_stories.txt --max-tokens 2048 2>&1 | tail -2
    done
    step "bench -tp 2 with ngram speculation"
    timeout 120 $B/kvq bench --model $M --device cuda -tp 2 --kv-cache-dtype fp8 --batch 4 \
      --input-len 256 --output-len 64 --dataset tests/fixtures/text/short_stories.txt \
      --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' 2>&1 | tail -4
    ;;
  sanitize)
    # compute-sanitizer memcheck of the peer all-reduce's tests (BackToBack hangs under the tool:
    # it does not run the two ranks' queued kernels side by side).
    step "memcheck of the peer all-reduce"
    timeout 300 /usr/local/cuda/bin/compute-sanitizer --tool memcheck $B/tests/kvq_cuda_model_tests \
      --gtest_filter='*PeerAllReduce*:-*BackToBack*' > "$OUT/sanitizer.log" 2>&1; echo "rc=$?"
    grep -E "^\[  (PASSED|FAILED|SKIPPED) |ERROR SUMMARY" "$OUT/sanitizer.log" | head
    ;;
  bench70)
    # Llama-3-70B shape at TP 2 (bf16 weights: 70 GB a rank, so H200s): batch 1 and 32 at 4k
    # for KV bf16 / fp8; then per KV dtype the largest batch that fits at 16k context.
    run70() {  # KV BATCH INPUT_LEN TAG (16k: the Llama-3.1 shape, whose context is 128k)
      timeout 200 $B/kvq bench --synthetic $([ $3 -gt 8000 ] && echo llama3.1-70b || echo llama3-70b) \
        --device cuda --tensor-parallel-size 2 \
        --kv-cache-dtype $1 --batch $2 --input-len $3 --output-len ${OUTLEN:-32} \
        --prefill-sequences 1 --json 2>>"$OUT/tp70-bench.err" |
        python3 bench/step_summary.py "$4" >> "$OUT/tp70-bench.jsonl"
    }
    for kv in ${KVS70:-bfloat16 fp8}; do
      for b in 1 32; do run70 $kv $b 4096 "70b tp=2"; done
    done
    for kv in ${KVS70_16K:-bfloat16 fp8 int4_per_token_head}; do
      lb=$(timeout 200 $B/kvq bench --synthetic llama3.1-70b --device cuda --tensor-parallel-size 2 \
        --kv-cache-dtype $kv --batch 1 --input-len 16384 --output-len ${OUTLEN:-32} \
        --prefill-sequences 1 --json 2>>"$OUT/tp70-bench.err" |
        python3 -c 'import json,sys; print(json.load(sys.stdin)["largest_batch"])')
      echo "70b tp=2 kv=$kv: largest batch at 16k: $lb"
      [ -n "$lb" ] && [ "$lb" -gt 0 ] && run70 $kv $(( lb < 256 ? lb : 256 )) 16384 "70b tp=2 largest@16k"
    done
    ;;
  *) echo "gpu-tp-check: unknown part $part (info, tests, tp-tests, smoke, sanitize, bench, bench70)" >&2; exit 2 ;;
  esac
done
step done
