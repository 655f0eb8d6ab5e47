// Helpers for the GPU tests: bf16 rounding on the host, RAII device buffers and streams.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/cuda/cuda_check.h"
#include "kernels/cuda/ops.h"

namespace strata::testing {

using kernels::cuda::bf16;

// fp32 -> bf16 bits, round to nearest even (NaN stays NaN).
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_value(uint16_t bits) {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
// Rounds every element to the nearest bf16 value, in place; returns the bf16 bits.
inline std::vector<uint16_t> round_to_bf16(std::vector<float>& v) {
  std::vector<uint16_t> bits(v.size());
  for (size_t i = 0; i < v.size(); ++i) {
    bits[i] = bf16_bits(v[i]);
    v[i] = bf16_value(bits[i]);
  }
  return bits;
}
inline std::vector<float> bf16_to_float(const std::vector<uint16_t>& bits) {
  std::vector<float> v(bits.size());
  for (size_t i = 0; i < bits.size(); ++i) v[i] = bf16_value(bits[i]);
  return v;
}

// A device allocation of n elements of T (T = bf16 is handled as uint16_t on the host).
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t n) : n_(n) {
    CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&ptr_), (n == 0 ? 1 : n) * sizeof(T)));
  }
  template <typename H>
  explicit DeviceBuffer(const std::vector<H>& host) : DeviceBuffer(host.size()) {
    upload(host);
  }
  ~DeviceBuffer() { CUDA_CHECK(cudaFree(ptr_)); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  T* get() const { return ptr_; }
  size_t size() const { return n_; }
  template <typename H>
  void upload(const std::vector<H>& host) {
    static_assert(sizeof(H) == sizeof(T), "host and device element sizes differ");
    CHECK(host.size() == n_);
    CUDA_CHECK(cudaMemcpy(ptr_, host.data(), n_ * sizeof(T), cudaMemcpyHostToDevice));
    // From pageable memory cudaMemcpy may return once the data is staged, before the DMA to
    // the device has finished, and it runs on the legacy default stream, which the tests'
    // non-blocking streams do not wait for: wait here so that kernels see the upload.
    CUDA_CHECK(cudaDeviceSynchronize());
  }
  template <typename H>
  std::vector<H> download() const {
    static_assert(sizeof(H) == sizeof(T), "host and device element sizes differ");
    std::vector<H> host(n_);
    CUDA_CHECK(cudaDeviceSynchronize());
    CUDA_CHECK(cudaMemcpy(host.data(), ptr_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t n_;
};

// Uploads a host fp32 vector as bf16 (after rounding it in place, so that the CPU reference
// sees exactly the values the GPU sees).
inline DeviceBuffer<bf16> upload_bf16(std::vector<float>& v) {
  const std::vector<uint16_t> bits = round_to_bf16(v);
  return DeviceBuffer<bf16>(bits);
}
inline std::vector<float> download_bf16(const DeviceBuffer<bf16>& buffer) {
  return bf16_to_float(buffer.download<uint16_t>());
}
inline std::vector<float> download_f32(const DeviceBuffer<float>& buffer) {
  return buffer.download<float>();
}

// A kernels Context over device buffers of its own: scratch_bytes of scratch and a GEMM
// workspace of the Context's default size. The buffers are declared first, so they are freed
// after the Context has waited for the device.
class TestContextBuffers {
 protected:
  TestContextBuffers(size_t scratch_bytes, size_t workspace_bytes)
      : scratch_buffer_(scratch_bytes), workspace_buffer_(workspace_bytes) {}
  DeviceBuffer<uint8_t> scratch_buffer_;
  DeviceBuffer<uint8_t> workspace_buffer_;
};
class TestContext : private TestContextBuffers, public kernels::cuda::Context {
 public:
  explicit TestContext(size_t scratch_bytes = kDefaultScratchBytes,
                       size_t workspace_bytes = kDefaultGemmWorkspaceBytes)
      : TestContextBuffers(scratch_bytes, workspace_bytes),
        Context(scratch_buffer_.get(), scratch_bytes, workspace_buffer_.get(), workspace_bytes) {}
};

class StreamGuard {
 public:
  StreamGuard() { CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking)); }
  ~StreamGuard() {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    CUDA_CHECK(cudaStreamDestroy(stream_));
  }
  StreamGuard(const StreamGuard&) = delete;
  StreamGuard& operator=(const StreamGuard&) = delete;
  cudaStream_t get() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
};

}  // namespace strata::testing
