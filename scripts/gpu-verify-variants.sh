#!/usr/bin/env bash
# Variants of the verification kernel side by side on the GPU machine, in one device call: for
# each variant (a folder build-<name>/ in the bundle holding its cuda_prefill_bench and, where
# its tests should run, its kvq_cuda_tests): the CudaPrefill* / CudaBackend* tests,
# compute-sanitizer memcheck and racecheck on CudaPrefillVerify.SmallForSanitizers,
# `cuda_prefill_bench --verify` over the #15 verification shapes (all variants interleaved,
# REPS rounds), and one Nsight Compute profile of the int4 32 x 4k launch (details and the
# per-instruction SASS counts). Everything lands in $OUT/verify-variants.tar.xz (the device
# returns at most 8 files).
#   here:   scripts/gpu-bundle.sh build-v19/cuda_prefill_bench build-v20a/cuda_prefill_bench \
#             build-v20a/kvq_cuda_tests ...      (KVQ_BUNDLE_FILE=.carry/bundle-<you>.tar.xz)
#   device: run(command="export KVQ_BUNDLE_FILE=.carry/bundle-<you>.tar.xz; bash scripts/gpu-bundle.sh
#               --run 'VARIANTS=\"v19 v20a\" bash scripts/gpu-verify-variants.sh'",
#               carry=[".carry/bundle-<you>.tar.xz"])
# VARIANTS (required): the names, first = the baseline. DTYPES / SHAPES / REPS: the bench's
# lists (defaults below). NCU=0 skips the profiles, SAN=0 the sanitizers; NCU_DTYPE: the profiled
# cache dtype (int4_per_token_head).
set -uo pipefail
B=$PWD/bundle
[ -d "$B" ] || B=$PWD
L=${OUT:-$PWD/out}/verify-variants
mkdir -p "$L"
: "${VARIANTS:?set VARIANTS to the build-<name> folders to compare}"
DTYPES=${DTYPES:-int4_per_token_head,fp8_e4m3,int8_per_token_head,fp8_per_token_head,nvfp4}
SHAPES=${SHAPES:-1x8192,8x4096,32x4096,64x4096,32x8192}
nvidia-smi --query-gpu=name,clocks.max.sm,clocks.max.mem --format=csv > "$L/gpu.txt" 2>&1
for v in $VARIANTS; do
  t=$B/build-$v/kvq_cuda_tests
  [ -x "$t" ] || continue
  "$t" --gtest_filter='CudaPrefill*:CudaBackend*' > "$L/$v-tests.txt" 2>&1
  echo "rc $?" >> "$L/$v-tests.txt"
  if [ "${SAN:-1}" = 1 ]; then
    for tool in memcheck racecheck; do
      /usr/local/cuda/bin/compute-sanitizer --tool $tool "$t" \
        --gtest_filter='CudaPrefillVerify.SmallForSanitizers' > "$L/$v-$tool.txt" 2>&1
      echo "rc $?" >> "$L/$v-$tool.txt"
    done
  fi
done
for r in $(seq 1 "${REPS:-2}"); do
  for v in $VARIANTS; do
    "$B/build-$v/cuda_prefill_bench" --verify --quick --dtypes "$DTYPES" --shapes "$SHAPES" \
      > "$L/$v-bench-$r.txt" 2>&1
  done
done
if [ "${NCU:-1}" = 1 ] && command -v ncu > /dev/null; then
  for v in $VARIANTS; do
    ncu --clock-control none --set full --import-source no -k regex:prefill_verify_kernel \
      --launch-skip 3 --launch-count 1 -o "$L/$v-ncu" "$B/build-$v/cuda_prefill_bench" --verify \
      --quick --dtypes "${NCU_DTYPE:-int4_per_token_head}" --shapes 32x4096 > "$L/$v-ncu-run.txt" 2>&1
    ncu --import "$L/$v-ncu.ncu-rep" --page details > "$L/$v-ncu-details.txt" 2>&1
    ncu --import "$L/$v-ncu.ncu-rep" --page source --csv --print-source sass \
      > "$L/$v-ncu-sass.csv" 2>&1
    rm -f "$L/$v-ncu.ncu-rep"
  done
fi
# One line a (dtype, shape) per variant: verify us and its ratio to the decode kernel.
python3 - "$L" $VARIANTS > "$L/summary.txt" <<'PY'
import re, sys, glob, collections
d, names = sys.argv[1], sys.argv[2:]
rows = collections.defaultdict(dict)
for v in names:
    for f in sorted(glob.glob(f"{d}/{v}-bench-*.txt")):
        for line in open(f):
            m = re.match(r"(\S+)\s+(\d+)\s+(\d+) \|\s+verify\s+([\d.]+).*\|\s+([\d.]+) \(\s*[\d.]+%\) \| ", line)
            if m:
                key = (m.group(1), int(m.group(2)), int(m.group(3)))
                rows[key].setdefault(v, []).append((float(m.group(4)), float(m.group(5))))
for key in sorted(rows):
    cells = []
    for v in names:
        runs = rows[key].get(v, [])
        if runs:
            ver = [a for a, _ in runs]
            dec = [b for _, b in runs]
            cells.append(f"{v} {min(ver):.1f}-{max(ver):.1f} us ({min(ver) / min(dec):.2f}x decode)")
    print(f"{key[0]:22s} {key[1]:3d} x {key[2]:5d}: " + "; ".join(cells))
PY
cat "$L/summary.txt"
grep -h "PASSED\|FAILED\|ERROR SUMMARY\|RACECHECK SUMMARY\|^rc" "$L"/*-tests.txt "$L"/*-memcheck.txt \
  "$L"/*-racecheck.txt 2>/dev/null | sort | uniq -c
cd "$(dirname "$L")" && tar cJf verify-variants.tar.xz "$(basename "$L")" && rm -rf "$L"
