// Tiers (DESIGN §3.2): budgeted pools of fixed-size chunk slots, one per level of the memory
// hierarchy, fastest first.
//
//   device  one Device::allocate() of the whole budget at start-up, carved into slots; no
//           allocation calls in the steady state.
//   host    pinned memory from a few large Device::allocate_pinned() blocks, carved into slots
//           and registered with the IoEngine (fixed buffers for io_uring).
//   nvme    slots in files preallocated under a directory (fallocate, or ftruncate where the
//           filesystem cannot), opened with O_DIRECT (buffered with a log line where the
//           filesystem refuses it) and registered with the IoEngine.
//
// NUMA: pinned host blocks and I/O threads belong on the NUMA node of the GPU. On a single
// node there is nothing to do; on several, the binding goes in create_host() right after each
// allocate_pinned() (hwloc_set_area_membind on the block), before the memory is first touched.
//
// Ownership: a TierSlots owns its memory or files and gives them back on destruction (nvme
// files are closed and removed). The Device and IoEngine it was created with must outlive it,
// and no queued copy or I/O may still use a slot when it is destroyed.
// Thread safety: none; the owner (ChunkSpace) serializes all calls.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/device.h"
#include "core/status.h"
#include "core/io_engine.h"

namespace strata {

enum class Tier : uint8_t { kDevice = 0, kHost = 1, kNvme = 2 };
inline constexpr int kNumTiers = 3;
const char* tier_name(Tier tier);        // "device", "host", "nvme"
const char* tier_budget_key(Tier tier);  // "memory.device", "memory.host", "memory.nvme.size"

// Where an nvme slot lives.
struct FileSpan {
  int file = -1;        // IoEngine file index
  uint64_t offset = 0;  // a multiple of the slot size (so of 4 KiB)
};

class TierSlots {
 public:
  // Each returns nullptr (no tier) for budget 0, and InvalidArgument when a non-zero budget
  // holds no slot of `slot_bytes`. REQUIRES: slot_bytes a positive multiple of 4 KiB.
  static Result<std::unique_ptr<TierSlots>> create_device(Device& device, uint64_t budget,
                                                          uint64_t slot_bytes);
  // block_bytes caps each pinned allocation (rounded down to whole slots, at least one slot).
  // io may be null; otherwise the blocks are registered with it.
  static Result<std::unique_ptr<TierSlots>> create_host(Device& device, IoEngine* io,
                                                        uint64_t budget, uint64_t slot_bytes,
                                                        uint64_t block_bytes);
  // Files of at most file_bytes (whole slots, at least one) under `dir`. NotFound when `dir`
  // is missing; IOError naming the directory and the bytes needed when the filesystem has not
  // enough free space (checked first with statvfs, then by fallocate's ENOSPC).
  static Result<std::unique_ptr<TierSlots>> create_nvme(IoEngine& io, const std::string& dir,
                                                        uint64_t budget, uint64_t slot_bytes,
                                                        uint64_t file_bytes);
  // An nvme tier of numbered slots and no files, for an IoEngine that moves no bytes
  // (IoEngine::moves_bytes): the planner's replay. Its slots' file is -1.
  static Result<std::unique_ptr<TierSlots>> create_nvme_without_files(uint64_t budget, uint64_t slot_bytes);
  ~TierSlots();
  TierSlots(const TierSlots&) = delete;
  TierSlots& operator=(const TierSlots&) = delete;

  Tier tier() const { return tier_; }
  const char* name() const { return tier_name(tier_); }
  uint64_t budget() const { return budget_; }
  uint64_t slot_bytes() const { return slot_bytes_; }
  uint32_t slot_count() const { return slot_count_; }
  uint32_t free_count() const { return static_cast<uint32_t>(free_.size()); }
  uint64_t in_use_bytes() const { return uint64_t{slot_count_ - free_count()} * slot_bytes_; }
  uint64_t peak_bytes() const { return peak_bytes_; }
  // nvme: the directory, and whether its files were opened with O_DIRECT.
  const std::string& dir() const { return dir_; }
  bool direct_io() const { return direct_io_; }

  // A free slot (lowest index first after creation), or nullopt when all are taken.
  std::optional<uint32_t> take();
  // REQUIRES: slot was taken and not given back since.
  void give_back(uint32_t slot);
  bool is_free(uint32_t slot) const { return !taken_[slot]; }

  // REQUIRES: a device or host tier; slot < slot_count().
  void* data(uint32_t slot) const;
  // REQUIRES: the nvme tier; slot < slot_count().
  FileSpan file_span(uint32_t slot) const;

 private:
  struct NvmeFile {
    int fd = -1;
    std::string path;    // for messages; the name is removed once the file is open
    bool linked = true;  // the name still exists (removed by the destructor)
  };

  TierSlots(Tier tier, uint64_t budget, uint64_t slot_bytes, uint32_t slot_count);
  static Result<uint32_t> slots_for(Tier tier, uint64_t budget, uint64_t slot_bytes);

  const Tier tier_;
  const uint64_t budget_;
  const uint64_t slot_bytes_;
  const uint32_t slot_count_;
  std::vector<uint32_t> free_;  // stack; back() is handed out next
  std::vector<bool> taken_;
  uint64_t peak_bytes_ = 0;

  DeviceAllocation device_memory_;       // device tier
  std::vector<HostAllocation> blocks_;   // host tier
  uint32_t slots_per_block_ = 0;         // host tier
  std::vector<NvmeFile> files_;          // nvme tier
  std::vector<int> file_index_;          // nvme tier: IoEngine index of files_[i]
  uint32_t slots_per_file_ = 0;          // nvme tier
  std::string dir_;                      // nvme tier
  bool direct_io_ = false;               // nvme tier
};

}  // namespace strata
