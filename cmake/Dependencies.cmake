# Every dependency comes from a Debian package (scripts/setup.sh installs them) or the CUDA toolkit.
find_package(Threads REQUIRED)
find_package(PkgConfig REQUIRED)
find_package(fmt REQUIRED)            # formatting of messages
find_package(spdlog REQUIRED)         # logging
find_package(yaml-cpp REQUIRED)       # training configs
find_package(nlohmann_json REQUIRED)  # HF config.json, manifests, JSONL metrics
find_package(OpenMP REQUIRED)         # CPU kernels across cores
pkg_check_modules(URING REQUIRED IMPORTED_TARGET liburing)     # async NVMe I/O
pkg_check_modules(HWLOC REQUIRED IMPORTED_TARGET hwloc)        # NUMA placement
pkg_check_modules(JEMALLOC REQUIRED IMPORTED_TARGET jemalloc)  # pageable host allocations
pkg_check_modules(XXHASH REQUIRED IMPORTED_TARGET libxxhash)   # checkpoint checksums
find_package(Gloo QUIET)              # CPU collectives (multi-process tests)

add_library(strata_deps_core INTERFACE)
target_link_libraries(strata_deps_core INTERFACE
  Threads::Threads fmt::fmt spdlog::spdlog yaml-cpp nlohmann_json::nlohmann_json
  OpenMP::OpenMP_CXX PkgConfig::URING PkgConfig::HWLOC PkgConfig::XXHASH)
if(TARGET gloo)
  target_compile_definitions(strata_deps_core INTERFACE STRATA_HAVE_GLOO=1)
else()
  message(STATUS "strata: no Gloo (libgloo-dev): multi-process runs on the CPU are unavailable")
endif()

add_library(strata_deps_blas INTERFACE)
if(STRATA_USE_OPENBLAS)
  pkg_check_modules(OPENBLAS QUIET IMPORTED_TARGET openblas)
  if(OPENBLAS_FOUND)
    target_link_libraries(strata_deps_blas INTERFACE PkgConfig::OPENBLAS)
    target_compile_definitions(strata_deps_blas INTERFACE STRATA_HAVE_OPENBLAS=1)
    message(STATUS "strata: CPU GEMM through OpenBLAS")
  else()
    message(STATUS "strata: OpenBLAS not found; CPU GEMM uses the built-in blocked kernel")
  endif()
endif()

# CUDA: AUTO builds the backend when nvcc is found.
set(STRATA_WITH_CUDA OFF)
if(NOT STRATA_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  include(CheckLanguage)
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    set(CMAKE_CUDA_ARCHITECTURES ${STRATA_CUDA_ARCHS})
    enable_language(CUDA)
    # nvcc 13 with Debian's fmt 9 fails on consteval in C++20; CUDA sources are C++17 and log nothing.
    set(CMAKE_CUDA_STANDARD 17)
    find_package(CUDAToolkit REQUIRED)
    set(STRATA_WITH_CUDA ON)
    target_link_libraries(strata_deps_core INTERFACE CUDA::cudart)
    target_compile_definitions(strata_deps_core INTERFACE STRATA_HAVE_CUDA=1)
    message(STATUS "strata: CUDA backend ON (architectures ${STRATA_CUDA_ARCHS})")
  elseif(STRATA_CUDA STREQUAL "ON")
    message(FATAL_ERROR "STRATA_CUDA=ON but no CUDA compiler was found; install the CUDA toolkit or use -DSTRATA_CUDA=OFF")
  else()
    message(STATUS "strata: no CUDA compiler; building the CPU backend only")
  endif()
endif()

target_link_libraries(strata_deps_core INTERFACE PkgConfig::JEMALLOC)
