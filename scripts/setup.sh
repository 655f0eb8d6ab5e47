#!/usr/bin/env bash
# Installs everything strata needs to build and test, from Debian packages. Idempotent: when
# every package is present it changes nothing and needs no network.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config  # toolchain
  libspdlog-dev libfmt-dev                      # logging
  libyaml-cpp-dev                               # training configs
  nlohmann-json3-dev                            # config.json, manifests, JSONL metrics
  liburing-dev                                  # asynchronous NVMe I/O
  libhwloc-dev                                  # NUMA placement of buffers and threads
  libjemalloc-dev                               # pageable host allocations
  libgloo-dev                                   # CPU collectives for multi-process tests
  libxxhash-dev                                 # checkpoint checksums
  libopenblas-dev                               # CPU GEMM (optional at build time)
  libgtest-dev                                  # tests
  python3-torch python3-numpy                   # PyTorch reference for parity tests
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages already installed"
  exit 0
fi

sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
echo "setup: done"
