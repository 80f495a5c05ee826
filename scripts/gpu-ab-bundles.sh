#!/usr/bin/env bash
# A/B of two builds on the GPU machine: the same kvq bench commands from two bundles made by
# scripts/gpu-bundle.sh (A = the baseline, B = the change), interleaved REPS times, one JSON
# line per run (with "ab" and "case") in $OUT/ab-bundles.jsonl and a summary on stdout.
#   device: run(command="bash scripts/gpu-ab-bundles.sh .carry/bundle-old.tar.xz .carry/bundle-new.tar.xz",
#               carry=[".carry/bundle-old.tar.xz", ".carry/bundle-new.tar.xz"])
# CASES (default below) are `kvq bench` argument strings, one per line. A_BIN / B_BIN name each
# side's binary inside its bundle (default build/kvq): one bundle holding both builds (e.g.
# build-old/kvq and build/kvq) may serve as A and B, which halves what is carried.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out-ab}
mkdir -p "$OUT"
A=$1 B=$2
for side in A B; do
  f=${!side}
  rm -rf "ab-$side" && mkdir -p "ab-$side" && tar -xJf "$f" -C "ab-$side"
done
export LD_LIBRARY_PATH="$PWD/ab-A/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}"
DFLASH='{"method":"dflash","model":"models/kvq-code-tiny-dflash","num_speculative_tokens":8}'
DEFAULT_CASES="--model models/kvq-code-tiny --batch 1 --input-len 256 --output-len 128 --num-prompts 32 --dataset models/kvq-code-tiny/heldout.txt --speculative-config $DFLASH
--model models/kvq-code-tiny --batch 8 --input-len 256 --output-len 128 --num-prompts 32 --dataset models/kvq-code-tiny/heldout.txt --speculative-config $DFLASH
--synthetic llama3-8b --batch 1 --input-len 1024 --output-len 24 --prefill-sequences 1
--synthetic llama3-8b --batch 8 --input-len 8000 --output-len 24 --prefill-sequences 1"
CASES=${CASES:-$DEFAULT_CASES}
for rep in $(seq 1 "${REPS:-2}"); do
  while IFS= read -r c; do
    [ -z "$c" ] && continue
    for side in A B; do
      for kv in ${KVS:-bfloat16}; do
        # shellcheck disable=SC2086
        bin_var=${side}_BIN
        timeout 120 "ab-$side/${!bin_var:-build/kvq}" bench --device cuda --kv-cache-dtype "$kv" $c --json 2>/dev/null |
          SIDE=$side CASE="$c" python3 -c "
import json, os, sys
j = json.load(sys.stdin); j['ab'] = os.environ['SIDE']; j['case'] = os.environ['CASE']
print(json.dumps(j))
step = j.get('decode_step_ms_median') or j.get('plain_ms_per_step')
spec = j.get('spec_ms_per_step')
extra = f\" spec {spec:.3f} ms x{j['speedup']:.2f} len {j['mean_accepted_length']:.2f}\" if spec else ''
print(f\"{j['ab']} {j['plan'][:10]:10s} B={j['batch']:2d} {os.environ['CASE'][:24]:24s} step {step:.3f} ms{extra}\", file=sys.stderr)
" >> "$OUT/ab-bundles.jsonl"
      done
    done
  done <<< "$CASES"
done
