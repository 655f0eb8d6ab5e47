#!/usr/bin/env bash
# Installs everything strata needs to build and test, from Debian packages. Idempotent: when
# every package is present it changes nothing and needs no network.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config  # toolchain
  clang libclang-rt-14-dev libomp-dev           # sanitizer and fuzz builds (libFuzzer, OpenMP for clang)
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
  python3-torch python3-numpy python3-pip       # PyTorch reference for parity tests
  python3-venv                                  # a newer transformers beside it for the Qwen3 reference
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done

install_reference_python() {
  # Hugging Face transformers for the parity tests (reference only; strata never needs Python).
  # 4.40 runs on Debian's torch 1.13 (later releases need torch 2). Tests that need it skip when
  # it cannot be installed (no network), saying so.
  if ! /usr/bin/python3 -c "import transformers" 2>/dev/null; then
    echo "setup: installing transformers==4.40.2 for /usr/bin/python3 (reference tests)"
    $sudo /usr/bin/python3 -m pip install -q --break-system-packages "transformers==4.40.2" ||
      echo "setup: warning: transformers could not be installed; the tests that compare with it will be skipped" >&2
  fi
  # PEFT for the LoRA reference (tests/model/reference_lora.py): 0.11.1 runs on torch 1.13 and
  # transformers 4.40. Its requirement torch>=1.13.0 rejects Debian's 1.13.0a0, so pip would pull
  # torch 2: install it without dependencies, after those it needs (accelerate before 1.0, which
  # still takes torch 1.x, and Jinja2 for the model card its save_pretrained writes).
  if ! /usr/bin/python3 -c "import peft, jinja2" 2>/dev/null; then
    echo "setup: installing peft==0.11.1 for /usr/bin/python3 (LoRA reference test)"
    { $sudo /usr/bin/python3 -m pip install -q --break-system-packages "accelerate>=0.21.0,<1" Jinja2 &&
      $sudo /usr/bin/python3 -m pip install -q --break-system-packages --no-deps "peft==0.11.1"; } ||
      echo "setup: warning: peft could not be installed; the LoRA parity tests will be skipped" >&2
  fi
  # Qwen3 parity against transformers' own Qwen3ForCausalLM (tests/model/reference_qwen3.py): the
  # release that added it (4.51), in a virtual environment beside Debian's torch so that the
  # system's 4.40 stays for the other references.
  local venv="${STRATA_REFERENCE_VENV:-${HOME:-/root}/.cache/strata/reference-transformers-4.51}"
  if ! "$venv/bin/python" -c "import transformers.models.qwen3" 2>/dev/null; then
    echo "setup: installing transformers==4.51.3 into $venv (Qwen3 reference test)"
    { /usr/bin/python3 -m venv --system-site-packages "$venv" &&
      "$venv/bin/python" -m pip install -q "transformers==4.51.3"; } ||
      echo "setup: warning: transformers 4.51 could not be installed; the Qwen3 parity test will be skipped" >&2
  fi
  # TensorBoard's own event reader checks strata's event files (tests/tools/tensorboard_test.cpp).
  if ! /usr/bin/python3 -c "import tensorboard" 2>/dev/null; then
    echo "setup: installing tensorboard for /usr/bin/python3 (reference test)"
    $sudo /usr/bin/python3 -m pip install -q --break-system-packages tensorboard ||
      echo "setup: warning: tensorboard could not be installed; the test that reads events with it will be skipped" >&2
  fi
}

sudo=""
if [[ $(id -u) -ne 0 ]]; then sudo="sudo"; fi

if ((${#missing[@]} == 0)); then
  echo "setup: all ${#packages[@]} packages already installed"
  install_reference_python
  exit 0
fi

if [[ -n $sudo ]]; then
  command -v sudo >/dev/null || { echo "setup: need root (or sudo) to install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
echo "setup: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
install_reference_python
echo "setup: done"
