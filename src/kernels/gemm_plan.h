// What the cuBLASLt GEMMs (kernels/cuda: gemm() in context.cpp, fp8_gemm_nt in fp8_gemm.cpp)
// share that is plain C++: a cache of plans per shape, and the description of a GEMM that a
// failed algorithm search prints. Kept free of CUDA so that the CPU build compiles and tests it;
// usable from C++17 (nvcc) and C++20.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

namespace strata::kernels {

// Plans (descriptors, layouts, the chosen algorithm: whatever a GEMM needs that depends on its
// shape only) built once per key and kept until the cache dies. Key: ordered by operator<.
// A dense model repeats a few dozen shapes; the experts' GEMMs take a new shape for each new
// count of tokens routed to an expert, so the cache is bounded: a new plan that would exceed
// `capacity` empties it first (the plans are rebuilt as they come back). Not thread safe: one
// cache belongs to one Context, which belongs to one stream.
template <class Key, class Plan>
class PlanCache {
 public:
  static constexpr size_t kDefaultCapacity = 4096;
  explicit PlanCache(size_t capacity = kDefaultCapacity) : capacity_(capacity < 1 ? 1 : capacity) {}

  // The plan of `key`; `build()` (returning std::unique_ptr<Plan>) makes it on the first request.
  // The reference stays valid until the next get() of a new key, clear() or the cache's end.
  template <class Build>
  Plan& get(const Key& key, Build&& build) {
    auto it = plans_.find(key);
    if (it == plans_.end()) {
      std::unique_ptr<Plan> plan = std::forward<Build>(build)();
      if (plans_.size() >= capacity_) plans_.clear();
      ++built_;
      it = plans_.emplace(key, std::move(plan)).first;
    }
    return *it->second;
  }
  // How many plans have been built (what a repeated shape must not increase).
  int64_t built() const { return built_; }
  size_t size() const { return plans_.size(); }
  void clear() { plans_.clear(); }

 private:
  size_t capacity_;
  std::map<Key, std::unique_ptr<Plan>> plans_;
  int64_t built_ = 0;
};

// A row-major GEMM C (M, N) = op(A) (M, K) @ op(B) (K, N) as a message names it.
struct GemmDescription {
  int64_t M = 0, N = 0, K = 0;
  bool trans_a = false, trans_b = false;
  std::string a_type, b_type, c_type;  // "bf16", "fp32", "e4m3 (1x128 tiles)", ...
  std::string epilogue = "none";        // "none", "bias", ...
  std::string accumulate = "beta = 0";  // "beta = 0", "beta = 1", "beta = 1 on a separate input C"
};

// "C (M x N, c_type) = A^T (M x K, a_type) @ B (K x N, b_type); M=.., N=.., K=.., trans_a=..,
// trans_b=.., epilogue .., beta = .."
std::string describe(const GemmDescription& gemm);

// The message of a failed cuBLASLt algorithm search: the GEMM, the status the heuristic
// returned (name and text) and how many algorithms it found.
std::string gemm_heuristic_failure_message(const GemmDescription& gemm, const std::string& status_name,
                                           const std::string& status_text, int found);

}  // namespace strata::kernels
