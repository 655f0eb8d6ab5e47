// Non-finite counts over F32 and BF16 bytes, in one call or streamed piece by piece.
#include "ckpt/finite.h"

#include <algorithm>
#include <cstring>

namespace strata::ckpt {
namespace {

// An element is non-finite when its exponent bits are all ones.
uint64_t count_f32(const unsigned char* p, uint64_t n) {
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, p + 4 * i, 4);
    bad += (u & 0x7f800000u) == 0x7f800000u;
  }
  return bad;
}

uint64_t count_bf16(const unsigned char* p, uint64_t n) {
  uint64_t bad = 0;
  for (uint64_t i = 0; i < n; ++i) {
    uint16_t u;
    std::memcpy(&u, p + 2 * i, 2);
    bad += (u & 0x7f80u) == 0x7f80u;
  }
  return bad;
}

}  // namespace

uint64_t count_non_finite(DType dtype, const void* data, uint64_t numel) {
  const auto* p = static_cast<const unsigned char*>(data);
  return dtype == DType::kF32 ? count_f32(p, numel) : count_bf16(p, numel);
}

void FiniteScan::feed(uint64_t offset, const void* data, uint64_t length) {
  const auto* p = static_cast<const unsigned char*>(data);
  const uint64_t end = offset + length;
  while (next_ < tensors_.size() && offset < end) {
    ScannedTensor& t = tensors_[next_];
    if (t.end <= offset) {
      ++next_;
      carried_ = 0;
      continue;
    }
    if (t.begin >= end) return;
    if (offset < t.begin) {  // header or gap bytes
      p += t.begin - offset;
      offset = t.begin;
    }
    const uint64_t esize = dtype_size(t.dtype);
    const uint64_t stop = std::min(end, t.end);
    // Complete an element split between two calls.
    if (carried_ > 0) {
      const uint64_t take = std::min(esize - carried_, stop - offset);
      std::memcpy(carry_ + carried_, p, take);
      carried_ += take, p += take, offset += take;
      if (carried_ < esize) continue;
      t.non_finite += count_non_finite(t.dtype, carry_, 1);
      carried_ = 0;
    }
    const uint64_t whole = (stop - offset) / esize;
    t.non_finite += count_non_finite(t.dtype, p, whole);
    p += whole * esize, offset += whole * esize;
    if (offset < stop) {  // the start of an element the next call completes
      carried_ = stop - offset;
      std::memcpy(carry_, p, carried_);
      p += carried_, offset = stop;
    }
    if (offset == t.end) ++next_, carried_ = 0;
  }
}

uint64_t FiniteScan::total_non_finite() const {
  uint64_t n = 0;
  for (const ScannedTensor& t : tensors_) n += t.non_finite;
  return n;
}

std::string describe_non_finite(const std::vector<ScannedTensor>& tensors) {
  constexpr int kNamed = 3;
  std::string out;
  int named = 0, more = 0;
  for (const ScannedTensor& t : tensors) {
    if (t.non_finite == 0) continue;
    if (named == kNamed) {
      ++more;
      continue;
    }
    out += (named == 0 ? "tensor '" : ", tensor '") + t.name + "' holds " + std::to_string(t.non_finite) +
           " non-finite value" + (t.non_finite == 1 ? "" : "s");
    ++named;
  }
  if (more > 0) out += " (and " + std::to_string(more) + " more tensor" + (more == 1 ? "" : "s") + ")";
  return out;
}

}  // namespace strata::ckpt
