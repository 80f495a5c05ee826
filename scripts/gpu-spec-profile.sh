#!/usr/bin/env bash
# Where a speculative step's time goes on the GPU machine (inside a gpu-bundle holding
# bundle/build/kvq): kvq bench --speculative-config with KVQ_SPEC_PROFILE=1 (the DFlash
# proposer's split: context K/V writes, block pass, the rest) and the bench's per-step times
# (drafting, forward + verification). METHODS, BATCHES, KV narrow it; output to $OUT/spec-profile.*.
set -uo pipefail
OUT=${OUT:-$PWD/out-spec}
mkdir -p "$OUT"
K=${KVQ:-bundle/build/kvq}
NGRAM='"method":"ngram","prompt_lookup_min":1,"prompt_lookup_max":3'
DFLASH='"method":"dflash","model":"models/kvq-code-tiny-dflash"'
DRAFT='"method":"draft_model","model":"models/kvq-code-tiny-draft"'
for kv in ${KV:-bfloat16}; do
  for batch in ${BATCHES:-1 8 32}; do
    for spec in ${METHODS:-"$DFLASH" "$NGRAM"}; do
      echo "=== $kv B=$batch $spec" | tee -a "$OUT/spec-profile.log"
      KVQ_SPEC_PROFILE=1 $K bench --model models/kvq-code-tiny --device ${DEVICE:-cuda} --kv-cache-dtype $kv \
        --batch $batch --input-len 256 --output-len ${OUTLEN:-128} \
        --num-prompts ${NUMP:-$((batch < 16 ? 16 : batch))} --dataset models/kvq-code-tiny/heldout.txt \
        --speculative-config "{$spec,\"num_speculative_tokens\":${KS:-8}}" 2>&1 | grep -v "^model:\|^speculative:" |
        tee -a "$OUT/spec-profile.log"
    done
  done
done
