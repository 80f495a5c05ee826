#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang, AddressSanitizer + UBSan, every library
# instrumented) in build-fuzz/ and runs each for SECONDS (default 60) from a copy of its seed
# corpus; new inputs stay in build-fuzz/corpus/<target>, crashes in build-fuzz/crashes/<target>.
#   scripts/fuzz.sh [SECONDS] [TARGET...]     (`make fuzz`, `make fuzz FUZZ_SECONDS=600`)
# Targets: safetensors model_config tokenizer openai_request flags (default: all).
# A finding: the fuzzer's crash file; minimize it (kvq_fuzz_<t> -minimize_crash=1 FILE), fix
# the parser, and commit the input as tests/fuzz/corpus/<t>/regress-<what>.bin so that
# kvq_fuzz_tests replays it in every build. Exit status: 0 when no target found anything.
set -uo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
shift || true
TARGETS=("$@")
[ ${#TARGETS[@]} -gt 0 ] || TARGETS=(safetensors model_config tokenizer openai_request flags)
B=${KVQ_FUZZ_BUILD:-build-fuzz}
JOBS=${JOBS:-$(nproc)}
bash scripts/install-deps.sh clang libclang-rt-14-dev
if [ ! -f "$B/build.ninja" ]; then
  CC=clang CXX=clang++ cmake -S . -B "$B" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DKVQ_FUZZ=ON -DKVQ_CUDA=OFF -DKVQ_BUILD_TESTS=OFF -DKVQ_BUILD_BENCH=OFF > /dev/null || exit 2
fi
cmake --build "$B" -j "$JOBS" --target $(printf 'kvq_fuzz_%s ' "${TARGETS[@]}") || exit 2
export KVQ_FUZZ_TOKENIZER="$PWD/models/kvq-code-tiny/tokenizer.json"
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
status=0
printf '%-16s %12s %10s %8s %s\n' target executions exec/s corpus result
for t in "${TARGETS[@]}"; do
  mkdir -p "$B/corpus/$t" "$B/crashes/$t"
  cp -n tests/fuzz/corpus/"$t"/* "$B/corpus/$t/" 2>/dev/null
  log="$B/fuzz-$t.log"
  "$B/tests/fuzz/kvq_fuzz_$t" "$B/corpus/$t" -max_total_time="$SECONDS_EACH" -timeout=1 \
    -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
    -artifact_prefix="$B/crashes/$t/" > "$log" 2>&1
  rc=$?
  execs=$(grep -a 'stat::number_of_executed_units' "$log" | awk '{print $2}')
  speed=$(grep -a 'stat::average_exec_per_sec' "$log" | awk '{print $2}')
  corpus=$(ls "$B/corpus/$t" | wc -l)
  if [ $rc -eq 0 ]; then result=ok; else result="FINDING (exit $rc): $(ls "$B/crashes/$t" | head -3 | tr '\n' ' ') see $log"; status=1; fi
  printf '%-16s %12s %10s %8s %s\n' "$t" "${execs:-?}" "${speed:-?}" "$corpus" "$result"
done
exit $status
