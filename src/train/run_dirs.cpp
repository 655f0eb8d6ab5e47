#include "train/run_dirs.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "ckpt/reader.h"
#include "core/log.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

std::string host_name() {
  char name[256] = {};
  if (::gethostname(name, sizeof name - 1) != 0) return "unknown";
  return name;
}

// The holder's line from a lock file, kept printable and short: the file is ours, but whatever
// is in it goes into an error message.
std::string holder_of(int fd) {
  char buf[160] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string line;
  for (ssize_t i = 0; i < n && buf[i] != '\n'; ++i) line += (buf[i] >= 0x20 && buf[i] < 0x7f) ? buf[i] : '?';
  return line.empty() ? "a process that has not yet written its name" : line;
}

// N of "version_N", or -1.
int64_t version_of(const std::string& name) {
  if (name.rfind("version_", 0) != 0 || name.size() == 8 || name.size() > 8 + 9) return -1;
  int64_t n = -1;
  const auto [end, ec] = std::from_chars(name.data() + 8, name.data() + name.size(), n);
  return ec == std::errc() && end == name.data() + name.size() ? n : -1;
}

int64_t newest_version(const fs::path& base) {
  int64_t newest = -1;
  std::error_code ec;
  if (!fs::is_directory(base, ec)) return -1;
  for (const auto& e : fs::directory_iterator(base, ec))
    if (e.is_directory(ec)) newest = std::max(newest, version_of(e.path().filename().string()));
  return newest;
}

// A committed checkpoint name in ckpt.dir (step-N, not step-N.tmp), or "".
std::string some_committed_step(const fs::path& ckpt) {
  std::error_code ec;
  std::string step;
  if (!fs::is_directory(ckpt, ec)) return step;
  for (const auto& e : fs::directory_iterator(ckpt, ec)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("step-", 0) == 0 && !name.ends_with(".tmp")) step = name;
  }
  return step;
}

bool holds_latest(const fs::path& ckpt) {
  std::error_code ec;
  return fs::exists(ckpt / "latest", ec);
}

// A run dir is continued only through a checkpoint: the old checkpoints would mix with a new
// run's (and retention could delete them), and the old metrics would be overwritten. With
// --resume auto and no checkpoint at all, the earlier metrics are set aside and the run starts.
Status check_run_dirs(const TrainConfig& t, std::string* set_aside) {
  if (!t.resume.empty() && t.resume != "auto") return Status::OK();
  const fs::path ckpt(t.ckpt_dir);
  const std::string elsewhere = "choose another run.dir (or ckpt.dir), or remove it first";
  if (holds_latest(ckpt)) {
    if (t.resume == "auto") return Status::OK();
    // Never echo what `latest` holds unless it is a step name (it may point anywhere).
    Result<std::string> named = ckpt::read_latest_file((ckpt / "latest").string());
    const std::string latest = named.ok() ? *named : "not a step name";
    return Status::InvalidArgument("ckpt.dir '" + t.ckpt_dir + "' already holds checkpoints of a run (latest: " + latest +
                                   "); pass --resume auto to continue that run, or " + elsewhere);
  }
  // Committed step-N directories without `latest`; step-N.tmp ones are unfinished saves that the
  // next save removes anyway.
  if (const std::string step = some_committed_step(ckpt); !step.empty())
    return Status::InvalidArgument("ckpt.dir '" + t.ckpt_dir + "' holds checkpoints (e.g. " + step +
                                   ") but no 'latest'; continue from one with --resume " + (ckpt / step).string() +
                                   ", or " + elsewhere);
  const fs::path metrics = fs::path(t.run_dir) / "metrics.jsonl";
  std::error_code ec;
  if (!fs::exists(metrics, ec)) return Status::OK();
  if (t.resume != "auto")
    return Status::InvalidArgument("run.dir '" + t.run_dir + "' already holds a run's metrics (" + metrics.string() +
                                   ") and no checkpoint to continue it from; pass --resume auto to start it again "
                                   "from step 1 (the old metrics are kept), or " + elsewhere);
  // A requeued job that was stopped before its first checkpoint: start again, keep the metrics.
  fs::path kept;
  for (int k = 1;; ++k) {
    kept = fs::path(t.run_dir) / fmt::format("metrics.restart-{}.jsonl", k);
    if (!fs::exists(kept, ec)) break;
  }
  fs::rename(metrics, kept, ec);
  if (ec) return Status::IOError("cannot set aside " + metrics.string() + " as " + kept.string() + ": " + ec.message());
  *set_aside = kept.string();
  LOG_WARN("resume: {} holds no checkpoint to continue from (the run stopped before its first save); starting "
           "from step 1, the earlier metrics kept as {}",
           t.ckpt_dir, kept.string());
  return Status::OK();
}

bool same_folder(const std::string& a, const std::string& b) {
  std::error_code ec;
  return fs::weakly_canonical(a, ec) == fs::weakly_canonical(b, ec);
}

}  // namespace

Result<DirLock> DirLock::acquire(const std::string& dir, const std::string& what, bool* created) {
  std::error_code ec;
  const bool made = fs::create_directories(dir, ec);
  if (ec) return Status::IOError("cannot create " + what + " '" + dir + "': " + ec.message());
  if (created != nullptr) *created = made;
  const std::string path = (fs::path(dir) / kLockFileName).string();
  DirLock lock;
  lock.fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock.fd_ < 0)
    return Status::IOError("cannot open " + path + " to lock " + what + ": " + std::strerror(errno) +
                           "; check that the folder is writable");
  if (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      return Status::InvalidArgument(what + " '" + dir + "' is in use by another strata run (" + holder_of(lock.fd_) +
                                     "); wait for it to finish, or choose another " + what);
    return Status::IOError("cannot lock " + path + ": " + std::strerror(errno));
  }
  const auto now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char when[32] = {};
  std::strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  const std::string holder = fmt::format("pid {} on host {}, since {}\n", ::getpid(), host_name(), when);
  if (::ftruncate(lock.fd_, 0) != 0 || ::pwrite(lock.fd_, holder.data(), holder.size(), 0) < 0)
    LOG_WARN("cannot write the holder's name into {}: {}", path, std::strerror(errno));
  return lock;
}

DirLock::DirLock(DirLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }

DirLock& DirLock::operator=(DirLock&& other) noexcept {
  if (this != &other) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = other.fd_;
    other.fd_ = -1;
  }
  return *this;
}

// The file stays: removing it while another process waits on it would let two runs lock two
// different files of one name.
DirLock::~DirLock() {
  if (fd_ >= 0) ::close(fd_);
}

Result<RunDirs> RunDirs::open(TrainConfig& t) {
  RunDirs dirs;
  if (!t.run_dir_named) {
    const fs::path base(t.run_dir);
    const int64_t newest = newest_version(base);
    if (t.resume == "auto" && newest >= 0) {
      t.run_dir = (base / fmt::format("version_{}", newest)).string();
    } else {
      // mkdir is the claim: two unnamed runs starting at once take different versions.
      std::error_code ec;
      fs::create_directories(base, ec);
      if (ec) return Status::IOError("cannot create run.dir '" + base.string() + "': " + ec.message());
      for (int64_t n = newest + 1;; ++n) {
        const fs::path v = base / fmt::format("version_{}", n);
        if (fs::create_directory(v, ec)) {
          t.run_dir = v.string();
          dirs.created_ = t.run_dir;
          break;
        }
        if (ec) return Status::IOError("cannot create run.dir '" + v.string() + "': " + ec.message());
      }
    }
  }
  if (!t.ckpt_dir_named) t.ckpt_dir = (fs::path(t.run_dir) / "checkpoints").string();
  if (!t.nvme_path.empty() && fs::path(t.nvme_path).is_relative())
    t.nvme_path = (fs::path(t.run_dir) / t.nvme_path).string();

  // A folder counts as this run's own (removed if the run is refused) only when this run made
  // it and holds its lock: a folder someone else locked first is theirs.
  bool made = false;
  ASSIGN_OR_RETURN(DirLock run_lock, DirLock::acquire(t.run_dir, "run.dir", &made));
  dirs.run_lock_ = std::make_unique<DirLock>(std::move(run_lock));
  if (made) dirs.created_ = t.run_dir;
  if (!same_folder(t.ckpt_dir, t.run_dir)) {
    Result<DirLock> ckpt_lock = DirLock::acquire(t.ckpt_dir, "ckpt.dir", &made);
    if (!ckpt_lock.ok()) {
      dirs.discard_if_unused();
      return ckpt_lock.status();
    }
    dirs.ckpt_lock_ = std::make_unique<DirLock>(std::move(ckpt_lock).value());
    if (made) dirs.created_ckpt_ = t.ckpt_dir;
  }
  if (Status checked = check_run_dirs(t, &dirs.set_aside_metrics_); !checked.ok()) {
    dirs.discard_if_unused();
    return checked;
  }
  return dirs;
}

RunDirs::~RunDirs() = default;

void RunDirs::discard_if_unused() {
  std::error_code ec;
  if (!created_.empty() && fs::exists(fs::path(created_) / "metrics.jsonl", ec)) return;  // the run started
  // Removed while the locks are held, so that no other run can have taken the folders meanwhile.
  if (ckpt_lock_ && !created_ckpt_.empty()) fs::remove_all(created_ckpt_, ec);
  if (run_lock_ && !created_.empty()) fs::remove_all(created_, ec);
  created_ckpt_.clear();
  created_.clear();
  ckpt_lock_.reset();
  run_lock_.reset();
}

}  // namespace strata
