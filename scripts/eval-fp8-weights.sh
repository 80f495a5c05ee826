#!/usr/bin/env bash
# Accuracy of FP8 weights with each KV dtype on a model (issue #13), on the CPU:
#   scripts/eval-fp8-weights.sh [MODEL] [TEXT] [MAX_TOKENS]
# Writes two checkpoints with `kvq quantize` into a temporary folder (removed at exit): FP8
# weights alone, and FP8 weights + an fp8 KV cache with k/v scales calibrated on CALIB (default:
# 256 KiB of this machine's Python standard library, the default model's training domain, not
# its held-out text); the same k/v calibration with bf16 weights. Then `kvq eval` of every
# combination against the bf16 model with a bf16 KV cache (--reference-model), one JSON line
# each on stdout and a table on stderr.
set -euo pipefail
KVQ=${KVQ:-build/kvq}
MODEL=${1:-models/kvq-code-tiny}
TEXT=${2:-$MODEL/heldout.txt}
MAX=${3:-16384}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
CALIB=${CALIB:-}
if [ -z "$CALIB" ]; then
  CALIB=$tmp/calib.txt
  python3 - "$CALIB" <<'PY'
import glob, sys, sysconfig
text = ""
for f in sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py")):
    text += open(f, encoding="utf-8", errors="replace").read()
    if len(text) >= 262144:
        break
open(sys.argv[1], "w", encoding="utf-8").write(text[:262144])
PY
fi
$KVQ quantize --model "$MODEL" --out "$tmp/w8" --weights fp8 > /dev/null 2>&1
$KVQ quantize --model "$MODEL" --out "$tmp/w8kv8" --weights fp8 --kv-cache-dtype fp8 \
  --calibration-text "$CALIB" --calibration-tokens 8192 > /dev/null 2>&1
$KVQ quantize --model "$MODEL" --out "$tmp/kv8" --weights none --kv-cache-dtype fp8 \
  --calibration-text "$CALIB" --calibration-tokens 8192 > /dev/null 2>&1
run() {  # label model kv-dtype
  $KVQ eval --model "$2" --text "$TEXT" --max-tokens "$MAX" --kv-cache-dtype "$3" \
    --reference-model "$MODEL" --reference-kv-cache-dtype bfloat16 --json 2>/dev/null |
    python3 -c "import json,sys; j=json.load(sys.stdin); j['label']='$1'; print(json.dumps(j))"
}
{
  for kv in bfloat16 fp8_e4m3 int8_per_token_head int4_per_token_head; do
    run "weights bf16, KV $kv" "$MODEL" $kv
  done
  run "weights bf16, KV fp8 calibrated" "$tmp/kv8" auto
  for kv in bfloat16 fp8_e4m3 int8_per_token_head int4_per_token_head; do
    run "weights fp8, KV $kv" "$tmp/w8" $kv
  done
  run "weights fp8, KV fp8 calibrated" "$tmp/w8kv8" auto
} | tee "$tmp/all.jsonl"
python3 - "$tmp/all.jsonl" >&2 <<'PY'
import json, sys
for line in open(sys.argv[1]):
    j = json.loads(line)
    r = j["rows"][0]
    print(f'{j["label"]:36s} | {r["ppl"]:.4f} | {r["delta_ppl"]:+.4f} | {r["mean_kl"]:.6f} | '
          f'{100 * r["top1_agreement"]:.2f}% | ref PPL {j["reference"]["ppl"]:.4f}')
PY
