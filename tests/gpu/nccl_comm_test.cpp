// The NCCL Comm at a world of one (all one GPU can run): every operation on device buffers
// queued on a stream, and the host-buffer operations through its bootstrap. The multi-GPU
// figures come from tools/nccl_bench.sh.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <vector>

#include "core/cuda/cuda_check.h"
#include "core/device.h"
#include "core/units.h"
#include "parallel/comm.h"

namespace strata::parallel {
namespace {

#if STRATA_HAVE_NCCL

TEST(NcclComm, EveryOperationAtAWorldOfOne) {
  Result<std::unique_ptr<Device>> device = open_device("cuda", 0, 64 * kMiB);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  CUDA_CHECK(cudaSetDevice(0));
  CommOptions options;
  options.backend = "nccl";
  Result<std::unique_ptr<Comm>> connected = connect(LaunchInfo{}, options);
  ASSERT_TRUE(connected.ok()) << connected.status().to_string();
  Comm& comm = **connected;
  EXPECT_STREQ(comm.backend(), "nccl");
  std::unique_ptr<Stream> stream = (*device)->create_stream();

  const size_t n = 1000;
  std::vector<float> host(n);
  for (size_t i = 0; i < n; ++i) host[i] = 0.5f * static_cast<float>(i) - 7.f;
  float *a = nullptr, *b = nullptr;
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&a), n * sizeof(float)));
  CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&b), n * sizeof(float)));
  CUDA_CHECK(cudaMemcpy(a, host.data(), n * sizeof(float), cudaMemcpyHostToDevice));
  auto expect_b_is_host = [&](const char* what) {
    std::vector<float> back(n, -1.f);
    stream->synchronize();
    CUDA_CHECK(cudaMemcpy(back.data(), b, n * sizeof(float), cudaMemcpyDeviceToHost));
    EXPECT_EQ(back, host) << what;
    CUDA_CHECK(cudaMemset(b, 0, n * sizeof(float)));
  };
  ASSERT_TRUE(comm.all_gather(a, b, n * sizeof(float), stream.get()).ok());
  expect_b_is_host("all_gather");
  ASSERT_TRUE(comm.reduce_scatter_sum(a, b, n, stream.get()).ok());
  expect_b_is_host("reduce_scatter_sum");
  std::vector<size_t> sizes = {n * sizeof(float)};
  ASSERT_TRUE(comm.all_to_all_v(a, sizes, b, sizes, stream.get()).ok());
  expect_b_is_host("all_to_all_v");
  CUDA_CHECK(cudaMemcpy(b, a, n * sizeof(float), cudaMemcpyDeviceToDevice));
  ASSERT_TRUE(comm.all_reduce_sum(b, n, stream.get()).ok());
  ASSERT_TRUE(comm.broadcast(b, n * sizeof(float), 0, stream.get()).ok());
  expect_b_is_host("all_reduce_sum and broadcast");
  ASSERT_TRUE(comm.barrier().ok());
  Result<double> sum = sum_over_ranks(comm, 3.25);
  ASSERT_TRUE(sum.ok()) << sum.status().to_string();
  EXPECT_EQ(*sum, 3.25);
  CUDA_CHECK(cudaFree(a));
  CUDA_CHECK(cudaFree(b));
}

#endif  // STRATA_HAVE_NCCL

}  // namespace
}  // namespace strata::parallel
