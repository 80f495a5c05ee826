#!/usr/bin/env bash
# Runs binaries built on the dev machine on the GPU machine (the device tool), which lacks
# OpenBLAS, PCRE2, GoogleTest and cpp-httplib but has a newer glibc, CUDA 13 and cuBLAS.
#   here:   scripts/gpu-bundle.sh BINARY...       packs the binaries (paths relative to the repo)
#                                                 and their non-system shared libraries into
#                                                 .carry/bundle.tar.xz (git-ignored)
#   device: run(command="bash scripts/gpu-bundle.sh --run 'CMD'", carry=[".carry/bundle.tar.xz"])
#           unpacks to bundle/ and runs CMD there (bash -c) with the libraries on
#           LD_LIBRARY_PATH; the binaries keep their relative paths (build-x/kvq -> bundle/build-x/kvq),
#           so CMD names them as bundle/<path>. The repo (models/, tests/fixtures/) is the working dir.
# cuBLAS, NCCL and the CUDA runtime come from the GPU machine's toolkit (same major version, 13;
# NCCL, 200 MB, from its toolkit or else from its PyTorch's nvidia-nccl package).
# Several engineers share the working tree: set KVQ_BUNDLE_FILE=.carry/bundle-<you>.tar.xz on
# BOTH sides (packing here, and in the device command) so you do not overwrite each other's
# bundle; carry that file.
set -euo pipefail
cd "$(dirname "$0")/.."
BUNDLE_FILE=${KVQ_BUNDLE_FILE:-.carry/bundle.tar.xz}
if [ "${1:-}" = "--run" ]; then
  shift
  rm -rf bundle && mkdir -p bundle && tar -xJf "$BUNDLE_FILE" -C bundle
  nccl=""
  if ! ls /usr/local/cuda/lib64/libnccl.so.2 /usr/local/cuda/lib/libnccl.so.2 >/dev/null 2>&1; then
    nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' 2>/dev/null || true)
  fi
  export LD_LIBRARY_PATH="$PWD/bundle/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib${nccl:+:$nccl}:${LD_LIBRARY_PATH:-}"
  export KVQ_BUNDLE=1
  exec bash -c "$1"
fi
[ $# -ge 1 ] || { echo "usage: scripts/gpu-bundle.sh BINARY... | --run 'CMD'" >&2; exit 2; }
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/lib"
for bin in "$@"; do
  [ -x "$bin" ] || { echo "gpu-bundle: $bin is not an executable" >&2; exit 2; }
  mkdir -p "$stage/$(dirname "$bin")"
  cp "$bin" "$stage/$bin"
  # Every resolved library except glibc's own and the CUDA ones (those come from the device).
  ldd "$bin" | awk '/=> \//{print $3}' |
    grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*)\.so|libcuda\.so|libcudart|libcublas|libnccl' |
    while read -r lib; do cp -Lu "$lib" "$stage/lib/"; done
done
mkdir -p .carry
# -9e: its 64 MiB window finds what binaries built from one tree share (a second build of
# the same bench costs ~1 MB, not ~8), which keeps a bundle with a baseline under the
# device's 64 MiB working-tree limit; ~1 minute for three binaries on 2 cores.
tar -cf - -C "$stage" . | xz -T2 -9e > "$BUNDLE_FILE"
grep -qx '/.carry/' .git/info/exclude 2>/dev/null || echo '/.carry/' >> .git/info/exclude
grep -qx '/bundle/' .git/info/exclude 2>/dev/null || echo '/bundle/' >> .git/info/exclude
echo "gpu-bundle: $BUNDLE_FILE $(du -h "$BUNDLE_FILE" | cut -f1) ($*)"
