#include "core/arena.h"

#include <algorithm>
#include <iterator>

#include "core/units.h"

namespace strata {
namespace {

uint64_t align_up(uint64_t x, uint64_t alignment) { return (x + alignment - 1) & ~(alignment - 1); }

ArenaOptions checked(ArenaOptions options) {
  const uint64_t a = options.alignment;
  CHECK_MSG(a != 0 && (a & (a - 1)) == 0,
            "arena alignment must be a power of two, got " + std::to_string(a));
  return options;
}

}  // namespace

Arena::Arena(void* base, uint64_t size, ArenaOptions options)
    : options_(checked(std::move(options))),
      base_(static_cast<char*>(base) +
            (align_up(reinterpret_cast<uintptr_t>(base), options_.alignment) -
             reinterpret_cast<uintptr_t>(base))),
      capacity_([&] {
        const uint64_t skip = static_cast<uint64_t>(base_ - static_cast<char*>(base));
        return size > skip ? (size - skip) & ~(options_.alignment - 1) : 0;
      }()) {
  CHECK(base != nullptr || size == 0);
  if (capacity_ > 0) insert_free(0, capacity_);
}

Arena::~Arena() {
  // Blocks still live here would be handed back later to a dead arena.
  CHECK_MSG(live_.empty(), "tier '" + options_.tier + "' destroyed with " +
                               std::to_string(live_.size()) + " live blocks (" +
                               format_bytes(in_use_) + ")");
}

void Arena::insert_free(uint64_t offset, uint64_t size) {
  free_by_offset_.emplace(offset, size);
  free_by_size_.emplace(size, offset);
}

void Arena::erase_free(std::map<uint64_t, uint64_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_by_offset_.erase(it);
}

Result<void*> Arena::allocate(uint64_t bytes) {
  const uint64_t max_request = UINT64_MAX - options_.alignment;
  const uint64_t size = align_up(bytes == 0 ? 1 : std::min(bytes, max_request), options_.alignment);
  std::lock_guard<std::mutex> lock(mu_);
  // Best fit: the smallest free block that holds the request (lowest address among equals).
  auto fit = free_by_size_.lower_bound({size, 0});
  if (fit == free_by_size_.end()) {
    const uint64_t largest = free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
    std::string msg = "tier '" + options_.tier + "' cannot allocate " + format_bytes(bytes) + ": " +
                      format_bytes(in_use_) + " of its " + format_bytes(capacity_) +
                      " budget in use";
    if (capacity_ - in_use_ >= size) {
      msg += " and the largest free block is " + format_bytes(largest) + " (fragmented)";
    }
    if (!options_.advice.empty()) msg += "; " + options_.advice;
    return Status::OutOfMemory(std::move(msg));
  }
  const auto [block_size, offset] = *fit;
  erase_free(free_by_offset_.find(offset));
  if (block_size > size) insert_free(offset + size, block_size - size);
  live_.emplace(offset, size);
  in_use_ += size;
  peak_ = std::max(peak_, in_use_);
  return static_cast<void*>(base_ + offset);
}

void Arena::free(void* ptr) {
  if (ptr == nullptr) return;
  const char* p = static_cast<const char*>(ptr);
  CHECK_MSG(p >= base_ && p < base_ + capacity_,
            "pointer freed to tier '" + options_.tier + "' lies outside its region");
  uint64_t offset = static_cast<uint64_t>(p - base_);
  std::lock_guard<std::mutex> lock(mu_);
  auto live = live_.find(offset);
  CHECK_MSG(live != live_.end(), "tier '" + options_.tier +
                                     "': free of a block that is not live "
                                     "(double free or interior pointer) at offset " +
                                     std::to_string(offset));
  uint64_t size = live->second;
  live_.erase(live);
  in_use_ -= size;

  // Coalesce with the free neighbours on either side.
  auto next = free_by_offset_.lower_bound(offset);
  if (next != free_by_offset_.end() && next->first == offset + size) {
    size += next->second;
    erase_free(next);
  }
  auto after = free_by_offset_.lower_bound(offset);
  if (after != free_by_offset_.begin()) {
    auto prev = std::prev(after);
    if (prev->first + prev->second == offset) {
      offset = prev->first;
      size += prev->second;
      erase_free(prev);
    }
  }
  insert_free(offset, size);
}

uint64_t Arena::in_use() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_;
}

uint64_t Arena::peak() const {
  std::lock_guard<std::mutex> lock(mu_);
  return peak_;
}

uint64_t Arena::largest_free_block() const {
  std::lock_guard<std::mutex> lock(mu_);
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

size_t Arena::live_blocks() const {
  std::lock_guard<std::mutex> lock(mu_);
  return live_.size();
}

void Arena::reset_peak() {
  std::lock_guard<std::mutex> lock(mu_);
  peak_ = in_use_;
}

}  // namespace strata
