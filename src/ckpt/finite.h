// Counting non-finite values (NaN, +-Inf) in checkpoint tensors: what the writer refuses to
// commit and what `strata ckpt verify` reports. A diverged run's state is NaN; a checkpoint of
// it would replace the last good one in `latest` and, through keep-last-K, delete it.
//
// Pure functions and a small value type; safe for concurrent use on different objects.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "core/dtype.h"

namespace strata::ckpt {

// Non-finite elements among `numel` elements of `dtype` at `data` (no alignment required).
uint64_t count_non_finite(DType dtype, const void* data, uint64_t numel);

// One tensor of a file, by absolute file offsets, and what a scan found in it.
struct ScannedTensor {
  std::string name;  // qualified
  DType dtype = DType::kF32;
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t non_finite = 0;
};

// Streams a file's bytes in file order (any piece boundaries, header bytes included) and counts
// the non-finite elements of each tensor. Elements split between two calls are carried over.
// REQUIRES: tensors sorted by begin and disjoint; feed() called with contiguous, increasing
// offsets.
class FiniteScan {
 public:
  FiniteScan() = default;
  explicit FiniteScan(std::vector<ScannedTensor> tensors) : tensors_(std::move(tensors)) {}

  void feed(uint64_t file_offset, const void* data, uint64_t length);
  const std::vector<ScannedTensor>& tensors() const { return tensors_; }
  uint64_t total_non_finite() const;

 private:
  std::vector<ScannedTensor> tensors_;
  size_t next_ = 0;          // the first tensor not yet completely scanned
  unsigned char carry_[8] = {};  // the first bytes of an element split between calls
  uint64_t carried_ = 0;
};

// "tensor 'a' holds 3 non-finite values, tensor 'b' 1 (and 2 more tensors)": the first few.
std::string describe_non_finite(const std::vector<ScannedTensor>& tensors);

}  // namespace strata::ckpt
