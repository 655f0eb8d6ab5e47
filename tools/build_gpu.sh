#!/usr/bin/env bash
# Builds what tools/gpu_check.sh runs, for a GPU machine that is reached by copying a build
# folder: a Hopper-only CUDA build (sm_90a) without OpenBLAS (smaller, and the GPU path does not
# use it), only the strata binary and the GPU test binary, and -- when a runtime packer is given
# -- the shared libraries the GPU machine may lack, in BUILD_DIR/devlibs.
#
#   tools/build_gpu.sh [BUILD_DIR] [PACKER]     (default: build-gpu; PACKER e.g. pack-runtime.sh)
#
# Then, on the GPU machine, from the repository root with BUILD_DIR copied beside it:
#   bash tools/gpu_check.sh build-gpu        (it puts build-gpu/devlibs on the library path)
# The carried folder must stay small: the script prints its size last.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
build="${1:-build-gpu}"
packer="${2:-}"
[[ "$build" = /* ]] || build="$repo/$build"
archs="${STRATA_CUDA_ARCHS:-90a}"

cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DSTRATA_CUDA=ON \
  -DSTRATA_CUDA_ARCHS="$archs" -DSTRATA_USE_OPENBLAS=OFF
cmake --build "$build" --target strata test_gpu

if [[ -n "$packer" ]]; then
  bash "$packer" "$build/devlibs" "$build/strata" "$build/tests/test_gpu"
fi
# A copy of the folder needs the binaries, devlibs and the CTest files gpu_check runs, not the
# objects and static libraries (tens of MB); this folder is for GPU checks only, so they go.
find "$build" \( -name '*.o' -o -name '*.a' \) -delete
echo "build folder: $(du -sh "$build" | cut -f1) ($build)"
