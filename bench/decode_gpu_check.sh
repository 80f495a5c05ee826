#!/usr/bin/env bash
# Runs binaries built on the dev machine (carried in DIR) on the GPU machine: the CUDA tests,
# compute-sanitizer memcheck / racecheck on the decode and cache-write tests, and a narrowed
# decode benchmark of every bench_* binary in DIR (so two kernel versions time in one call).
#
#   here:   cp build/tests/kvq_cuda_tests build/bench/cuda_decode_bench DIR/  (DIR git-ignored)
#   device: run(command="bash bench/decode_gpu_check.sh DIR [tests|bench|all] [bench flags]",
#               carry=[DIR])
# Logs go to $OUT (or ./out-gpu); the last lines printed are the summary.
set -uo pipefail
dir=${1:?usage: decode_gpu_check.sh DIR [tests|bench|all] [bench flags...]}
what=${2:-all}
shift 2 || shift $#
OUT=${OUT:-$PWD/out-gpu}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu --format=csv,noheader
if [ "$what" != bench ]; then
  "$dir/kvq_cuda_tests" > "$OUT/tests.log" 2>&1
  echo "kvq_cuda_tests rc=$?"
  grep -E "^\[  (FAILED|PASSED|SKIPPED) |^\[==========\]|largest" "$OUT/tests.log"
fi
sanitize() {
  filt='CudaDecode*:CudaCacheWrite*:*MatchesCpuReference/fp8_e4m3:*MatchesCpuReference/int4_per_token_head'
  compute-sanitizer --tool memcheck --error-exitcode 9 "$dir/kvq_cuda_tests" --gtest_brief=1 \
    --gtest_filter="$filt" > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$?: $(grep -E 'ERROR SUMMARY' "$OUT/memcheck.log" | tail -1)"
  compute-sanitizer --tool racecheck --error-exitcode 9 "$dir/kvq_cuda_tests" --gtest_brief=1 \
    --gtest_filter='CudaDecode.*:*EveryMixedPair/fp8_e4m3__int4*:*MatchesCpuReference/int4_per_token_head' \
    > "$OUT/racecheck.log" 2>&1
  echo "racecheck rc=$?: $(grep -E 'RACECHECK SUMMARY|hazards' "$OUT/racecheck.log" | tail -1)"
}
if [ "$what" != tests ]; then
  for b in "$dir"/bench_*; do
    [ -x "$b" ] || continue
    echo "=== $(basename "$b") $*"
    "$b" --csv "$OUT/$(basename "$b").csv" "$@" 2>&1 | tee "$OUT/$(basename "$b").log" | grep -v "^kvq"
  done
  # Side by side: time of each bench binary per point.
  python3 - "$OUT" <<'PY'
import csv, glob, os, sys
runs = {os.path.basename(f)[:-4]: list(csv.DictReader(open(f))) for f in sorted(glob.glob(sys.argv[1] + "/bench_*.csv"))}
names = list(runs)
keys = []
for n in names:
    for r in runs[n]:
        k = (r["dtype"], r["hq"], r["batch"], r["ctx"])
        if k not in keys: keys.append(k)
print("dtype hq B ctx " + " ".join(f"{n}:us(TB/s)" for n in names))
for k in keys:
    cells = []
    for n in names:
        r = next((r for r in runs[n] if (r["dtype"], r["hq"], r["batch"], r["ctx"]) == k), None)
        cells.append(f"{float(r['time_us']):.1f}({float(r['eff_tbs']):.2f})" if r and r["time_us"] != "0" else "-")
    print(" ".join(k) + " " + " ".join(cells))
PY
fi
# Sanitizers last, so a slow run still leaves the timings.
[ "$what" != bench ] && sanitize
exit 0
