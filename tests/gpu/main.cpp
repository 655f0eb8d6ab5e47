// test_gpu entry point: returns 77, which ctest reports as skipped, on a machine without a
// usable CUDA device (listing the tests needs none); otherwise runs every GPU test. `--perf`
// turns on the perf mode of the op parity runner (same as STRATA_PERF=1; see
// ops_perf_test.cpp).
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>

int main(int argc, char** argv) {
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--perf") == 0) {
      setenv("STRATA_PERF", "1", /*overwrite=*/1);
    } else {
      argv[kept++] = argv[i];
    }
  }
  argc = kept;
  // Listing the tests needs no device: tools/gpu_check.sh lists the groups it runs one by one.
  bool listing = false;
  for (int i = 1; i < argc; ++i) listing |= std::strcmp(argv[i], "--gtest_list_tests") == 0;
  if (listing) {
    ::testing::InitGoogleTest(&argc, argv);
    return RUN_ALL_TESTS();
  }
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess || count == 0) {
    std::printf("test_gpu: no CUDA device (%s); skipping\n",
                error != cudaSuccess ? cudaGetErrorString(error) : "0 devices");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
