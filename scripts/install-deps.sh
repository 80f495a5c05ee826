#!/usr/bin/env bash
# Installs kvq's build and test dependencies from Debian 12's archive.
# Idempotent: only packages that are missing are installed. Arguments: more packages.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config
  nlohmann-json3-dev libcli11-dev libpcre2-dev libopenblas-dev libcpp-httplib-dev
  libgtest-dev libgmock-dev libbenchmark-dev libomp-dev
  python3
)

# Extra packages named on the command line (scripts/fuzz.sh: clang and its libFuzzer runtime).
packages+=("$@")

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}" >&2
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
  sudo_cmd=(sudo)
fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
