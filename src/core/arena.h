// Arena: strata's budget allocator over one contiguous region (device memory carved from a
// single cudaMalloc, or host memory standing in for it). Best-fit over an address-ordered free
// list; freed blocks coalesce with their free neighbours, so a budget that fits a workload
// keeps fitting it however allocations interleave, as long as live blocks do not fragment it.
//
// The arena never reads or writes the region (it may be device memory); it only hands out
// addresses inside it. It does not own the region: whoever created the region frees it after
// the arena is gone. Every method is safe for concurrent use.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>

#include "core/status.h"

namespace strata {

struct ArenaOptions {
  // Shown in errors: "tier 'device (cuda:0)' cannot allocate ...".
  std::string tier = "device";
  // Every block starts at a multiple of this (a power of two) and spans a multiple of it.
  uint64_t alignment = 256;
  // What the user can do when a request does not fit; ends the OutOfMemory message.
  std::string advice = "raise memory.device or lower the micro-batch";
};

class Arena {
 public:
  // Manages [base, base + size). The usable capacity is what remains after aligning the start
  // up and the end down to options.alignment.
  Arena(void* base, uint64_t size, ArenaOptions options);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // A block of at least `bytes` (rounded up to the alignment; 0 counts as one unit).
  // OutOfMemory when no free block is large enough; the message names the tier, the request,
  // the budget, what is in use and, if the region is merely fragmented, the largest free block.
  Result<void*> allocate(uint64_t bytes);
  // REQUIRES: ptr came from allocate() on this arena and was not freed since.
  void free(void* ptr);

  uint64_t capacity() const { return capacity_; }
  uint64_t alignment() const { return options_.alignment; }
  const std::string& tier() const { return options_.tier; }
  uint64_t in_use() const;
  uint64_t peak() const;
  uint64_t largest_free_block() const;
  size_t live_blocks() const;
  void reset_peak();

 private:
  void insert_free(uint64_t offset, uint64_t size);            // REQUIRES: mu_ held
  void erase_free(std::map<uint64_t, uint64_t>::iterator it);  // REQUIRES: mu_ held

  const ArenaOptions options_;
  char* const base_;         // aligned start of the usable region
  const uint64_t capacity_;  // usable bytes, a multiple of the alignment

  mutable std::mutex mu_;
  std::map<uint64_t, uint64_t> free_by_offset_;           // offset -> size; GUARDED_BY(mu_)
  std::set<std::pair<uint64_t, uint64_t>> free_by_size_;  // (size, offset); GUARDED_BY(mu_)
  std::unordered_map<uint64_t, uint64_t> live_;           // offset -> size; GUARDED_BY(mu_)
  uint64_t in_use_ = 0;                                   // GUARDED_BY(mu_)
  uint64_t peak_ = 0;                                     // GUARDED_BY(mu_)
};

}  // namespace strata
