#include "memory/tier.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "core/progress.h"
#include "core/log.h"
#include "core/units.h"

namespace strata {
namespace {

std::string errno_text(int err) { return std::strerror(err); }

// Reserves [0, bytes) of fd on disk. Returns 0 or an errno value.
int preallocate(int fd, uint64_t bytes) {
  if (::fallocate(fd, 0, 0, static_cast<off_t>(bytes)) == 0) return 0;
  const int err = errno;
  if (err != EOPNOTSUPP && err != ENOSYS) return err;
  // The filesystem cannot reserve blocks; size the file so that offsets are valid. Running out
  // of space then shows up as ENOSPC on a write-back.
  return ::ftruncate(fd, static_cast<off_t>(bytes)) == 0 ? 0 : errno;
}

}  // namespace

const char* tier_name(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "device";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

const char* tier_budget_key(Tier tier) {
  switch (tier) {
    case Tier::kDevice:
      return "memory.device";
    case Tier::kHost:
      return "memory.host";
    case Tier::kNvme:
      return "memory.nvme.size";
  }
  return "?";
}

TierSlots::TierSlots(Tier tier, uint64_t budget, uint64_t slot_bytes, uint32_t slot_count)
    : tier_(tier), budget_(budget), slot_bytes_(slot_bytes), slot_count_(slot_count) {
  free_.reserve(slot_count);
  for (uint32_t i = slot_count; i > 0; --i) free_.push_back(i - 1);
  taken_.assign(slot_count, false);
}

TierSlots::~TierSlots() {
  for (const NvmeFile& f : files_) {
    if (f.fd >= 0) ::close(f.fd);
    if (f.linked) ::unlink(f.path.c_str());
  }
}

Result<uint32_t> TierSlots::slots_for(Tier tier, uint64_t budget, uint64_t slot_bytes) {
  CHECK(slot_bytes > 0 && slot_bytes % 4096 == 0);
  const uint64_t n = budget / slot_bytes;
  if (n == 0) {
    return Status::InvalidArgument(
        std::string("tier '") + tier_name(tier) + "' budget " + format_bytes(budget) +
        " holds no chunk of " + format_bytes(slot_bytes) + "; raise " + tier_budget_key(tier) +
        " to at least " + format_bytes(slot_bytes) + ", set it to 0 to go without the tier, or " +
        "lower memory.chunk_size");
  }
  if (n > UINT32_MAX) {
    return Status::InvalidArgument(std::string("tier '") + tier_name(tier) + "' budget " +
                                   format_bytes(budget) + " holds more than 2^32 chunks; " +
                                   "raise memory.chunk_size");
  }
  return static_cast<uint32_t>(n);
}

Result<std::unique_ptr<TierSlots>> TierSlots::create_device(Device& device, uint64_t budget,
                                                            uint64_t slot_bytes) {
  if (budget == 0) return std::unique_ptr<TierSlots>();
  ASSIGN_OR_RETURN(uint32_t n, slots_for(Tier::kDevice, budget, slot_bytes));
  std::unique_ptr<TierSlots> t(new TierSlots(Tier::kDevice, budget, slot_bytes, n));
  auto memory = device.allocate(uint64_t{n} * slot_bytes);
  if (!memory.ok()) {
    return memory.status().with_context("reserving the device tier (" +
                                        format_bytes(uint64_t{n} * slot_bytes) + " on " +
                                        device.name() + ")");
  }
  t->device_memory_ = std::move(memory).value();
  return t;
}

Result<std::unique_ptr<TierSlots>> TierSlots::create_host(Device& device, IoEngine* io,
                                                          uint64_t budget, uint64_t slot_bytes,
                                                          uint64_t block_bytes) {
  if (budget == 0) return std::unique_ptr<TierSlots>();
  ASSIGN_OR_RETURN(uint32_t n, slots_for(Tier::kHost, budget, slot_bytes));
  std::unique_ptr<TierSlots> t(new TierSlots(Tier::kHost, budget, slot_bytes, n));
  t->slots_per_block_ = static_cast<uint32_t>(
      std::clamp<uint64_t>(block_bytes / slot_bytes, 1, uint64_t{n}));
  // Page-locking is slow (reserving 61.7 GiB is likely most of the 39 s a paged 3.6B run spent before
  // initialising its weights on an H200 machine): say so when it takes a while.
  Progress progress("reserving the host tier", uint64_t{n} * slot_bytes);
  for (uint32_t first = 0; first < n; first += t->slots_per_block_) {
    const uint64_t bytes = uint64_t{std::min(t->slots_per_block_, n - first)} * slot_bytes;
    auto block = device.allocate_pinned(bytes);
    if (!block.ok()) {
      return block.status().with_context("reserving the host tier (" + format_bytes(budget) +
                                         " pinned); lower memory.host");
    }
    // NUMA binding of the block goes here (see the header); nothing to do on one node.
    if (io != nullptr) {
      Status st = io->register_buffer(block->data(), bytes);
      if (!st.ok()) return st.with_context("registering the host tier with the I/O engine");
    }
    t->blocks_.push_back(std::move(block).value());
    progress.add(bytes);
  }
  return t;
}

Result<std::unique_ptr<TierSlots>> TierSlots::create_nvme(IoEngine& io, const std::string& dir,
                                                          uint64_t budget, uint64_t slot_bytes,
                                                          uint64_t file_bytes) {
  if (budget == 0) return std::unique_ptr<TierSlots>();
  ASSIGN_OR_RETURN(uint32_t n, slots_for(Tier::kNvme, budget, slot_bytes));
  struct stat st {};
  if (dir.empty() || ::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status::NotFound("nvme directory '" + dir +
                            "' does not exist; create it or point memory.nvme.path elsewhere");
  }
  const uint64_t needed = uint64_t{n} * slot_bytes;
  struct statvfs vfs {};
  if (::statvfs(dir.c_str(), &vfs) == 0) {
    const uint64_t available = uint64_t{vfs.f_bavail} * vfs.f_frsize;
    if (available < needed) {
      return Status::IOError("no space left for the nvme tier in '" + dir + "': it needs " +
                             format_bytes(needed) + " and " + format_bytes(available) +
                             " are free; free space there or lower memory.nvme.size");
    }
  }

  std::unique_ptr<TierSlots> t(new TierSlots(Tier::kNvme, budget, slot_bytes, n));
  t->dir_ = dir;
  t->slots_per_file_ =
      static_cast<uint32_t>(std::clamp<uint64_t>(file_bytes / slot_bytes, 1, uint64_t{n}));
  bool warned = false;
  t->direct_io_ = true;
  for (uint32_t first = 0; first < n; first += t->slots_per_file_) {
    const uint64_t bytes = uint64_t{std::min(t->slots_per_file_, n - first)} * slot_bytes;
    std::string path = dir + "/strata-nvme-XXXXXX";
    const int tmp_fd = ::mkstemp(path.data());
    if (tmp_fd < 0) {
      return Status::IOError("cannot create a file in nvme directory '" + dir +
                             "': " + errno_text(errno));
    }
    // Registered before anything can fail, so the destructor removes it.
    t->files_.push_back(NvmeFile{-1, path});
    const int err = preallocate(tmp_fd, bytes);
    ::close(tmp_fd);
    if (err == ENOSPC || err == EDQUOT) {
      return Status::IOError("no space left for the nvme tier in '" + dir + "': it needs " +
                             format_bytes(needed) + " (" + errno_text(err) + " preallocating " +
                             path + "); free space there or lower memory.nvme.size");
    }
    if (err != 0) {
      return Status::IOError("cannot preallocate " + format_bytes(bytes) + " for " + path +
                             ": " + errno_text(err));
    }
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC | O_DIRECT);
    if (fd < 0 && errno == EINVAL) {
      if (!warned) {
        LOG_WARN("the filesystem of '{}' refuses O_DIRECT; the nvme tier uses buffered I/O",
                 dir);
        warned = true;
      }
      t->direct_io_ = false;
      fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    }
    if (fd < 0) return Status::IOError("cannot open " + path + ": " + errno_text(errno));
    t->files_.back().fd = fd;
    // Only the descriptor is needed from here on: without a name the file goes away with the
    // process, even one killed by SIGKILL, instead of leaving its size on the disk.
    if (::unlink(path.c_str()) == 0) t->files_.back().linked = false;
    ASSIGN_OR_RETURN(int index, io.register_file(fd, path));
    t->file_index_.push_back(index);
  }
  return t;
}

Result<std::unique_ptr<TierSlots>> TierSlots::create_nvme_without_files(uint64_t budget, uint64_t slot_bytes) {
  if (budget == 0) return std::unique_ptr<TierSlots>();
  ASSIGN_OR_RETURN(uint32_t n, slots_for(Tier::kNvme, budget, slot_bytes));
  return std::unique_ptr<TierSlots>(new TierSlots(Tier::kNvme, budget, slot_bytes, n));
}

std::optional<uint32_t> TierSlots::take() {
  if (free_.empty()) return std::nullopt;
  const uint32_t slot = free_.back();
  free_.pop_back();
  taken_[slot] = true;
  peak_bytes_ = std::max(peak_bytes_, in_use_bytes());
  return slot;
}

void TierSlots::give_back(uint32_t slot) {
  CHECK(slot < slot_count_ && taken_[slot]);
  taken_[slot] = false;
  free_.push_back(slot);
}

void* TierSlots::data(uint32_t slot) const {
  CHECK(slot < slot_count_);
  if (tier_ == Tier::kDevice) {
    return device_memory_.as<char>() + uint64_t{slot} * slot_bytes_;
  }
  CHECK(tier_ == Tier::kHost);
  const HostAllocation& block = blocks_[slot / slots_per_block_];
  return block.as<char>() + uint64_t{slot % slots_per_block_} * slot_bytes_;
}

FileSpan TierSlots::file_span(uint32_t slot) const {
  CHECK(tier_ == Tier::kNvme && slot < slot_count_);
  if (file_index_.empty()) return FileSpan{-1, uint64_t{slot} * slot_bytes_};  // no files
  return FileSpan{file_index_[slot / slots_per_file_],
                  uint64_t{slot % slots_per_file_} * slot_bytes_};
}

}  // namespace strata
