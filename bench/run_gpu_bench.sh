#!/usr/bin/env bash
# Runs the CUDA decode and prefill benchmarks and the PyTorch SDPA comparisons in one go on a
# GPU machine, then prints the merged tables last.
#
#   bench/run_gpu_bench.sh BUILD_DIR OUT_DIR [--quick] [--prefill-only | --decode-only]
#
# Prefill (when cuda_prefill_bench is built): kvq_prefill.json, sdpa_prefill.json and
# prefill_tables.md (time, TFLOP/s, speed relative to the best SDPA).
#
# BUILD_DIR holds a KVQ_CUDA=ON build with the cuda_decode_bench target built. OUT_DIR gets
# kvq_decode.json, sdpa.json, decode_merged.csv (time, effective TB/s, % of copy bandwidth,
# ratio to the best SDPA time for every point) and decode_tables.md (markdown tables).
set -uo pipefail
build=${1:?usage: run_gpu_bench.sh BUILD_DIR OUT_DIR [--quick]}
out=${2:?usage: run_gpu_bench.sh BUILD_DIR OUT_DIR [--quick]}
shift 2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
decode=1 prefill=1 pass=()
for a in "$@"; do
  case "$a" in
    --prefill-only) decode=0 ;;
    --decode-only) prefill=0 ;;
    *) pass+=("$a") ;;
  esac
done
set -- "${pass[@]}"
if [[ $prefill == 1 ]]; then
  pbench=$(find "$build" -name cuda_prefill_bench -type f -perm -u+x | head -1)
  if [[ -n "$pbench" ]]; then
    "$pbench" --json "$out/kvq_prefill.json" "$@" || echo "cuda_prefill_bench failed (rc $?)"
    PYTHONUNBUFFERED=1 python3 "$here/sdpa_bench.py" --prefill --json "$out/sdpa_prefill.json" ||
      echo "sdpa_bench.py --prefill failed (rc $?)"
    python3 "$here/sdpa_bench.py" --prefill-report "$out/kvq_prefill.json" \
      "$out/sdpa_prefill.json" --markdown "$out/prefill_tables.md"
  else
    echo "run_gpu_bench.sh: no cuda_prefill_bench under $build (prefill skipped)" >&2
  fi
fi
[[ $decode == 1 ]] || exit 0
bench=$(find "$build" -name cuda_decode_bench -type f -perm -u+x | head -1)
if [[ -z "$bench" ]]; then
  echo "run_gpu_bench.sh: no cuda_decode_bench under $build" >&2
  exit 1
fi
"$bench" --json "$out/kvq_decode.json" "$@" || echo "cuda_decode_bench failed (rc $?)"
PYTHONUNBUFFERED=1 python3 "$here/sdpa_bench.py" --json "$out/sdpa.json" "$@" ||
  echo "sdpa_bench.py failed (rc $?)"
python3 "$here/sdpa_bench.py" --report "$out/kvq_decode.json" "$out/sdpa.json" \
  --csv "$out/decode_merged.csv" --markdown "$out/decode_tables.md"
