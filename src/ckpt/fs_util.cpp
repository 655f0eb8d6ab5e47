// POSIX helpers for checkpoint directories.
#include "ckpt/fs_util.h"

#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include "ckpt/format.h"
#include "core/io_engine.h"

namespace strata::ckpt {

void UniqueFd::reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status UniqueFd::close_checked(const std::string& path) {
  if (fd_ < 0) return Status::OK();
  const int rc = ::close(fd_);
  fd_ = -1;
  if (rc != 0 && errno != EINTR) return sys_error("close of", path, errno);
  return Status::OK();
}

Status sys_error(const std::string& what, const std::string& path, int err) {
  return Status::IOError(what + " " + path + " failed: " + std::strerror(err) + " (" + errno_name(err) + ")");
}

Result<UniqueFd> open_file(const std::string& path, int flags, int mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) return Status::NotFound(path + " does not exist");
    return sys_error("open of", path, err);
  }
  return UniqueFd(fd);
}

Status fsync_path(const std::string& path) {
  ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, O_RDONLY));
  if (::fsync(fd.get()) != 0) return sys_error("fsync of", path, errno);
  return Status::OK();
}

Status write_file_durable(const std::string& path, const std::string& content) {
  ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, O_WRONLY | O_CREAT | O_TRUNC));
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd.get(), content.data() + done, content.size() - done);
    if (n < 0) {
      if (errno == EINTR) continue;
      return sys_error("write of", path, errno);
    }
    if (n == 0) return sys_error("write of", path, ENOSPC);
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) return sys_error("fsync of", path, errno);
  return fd.close_checked(path);
}

Result<std::string> read_small_file(const std::string& path, uint64_t max_bytes) {
  ASSIGN_OR_RETURN(UniqueFd fd, open_file(path, O_RDONLY));
  std::string out;
  char buf[65536];
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0) {
      if (errno == EINTR) continue;
      return sys_error("read of", path, errno);
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
    if (out.size() > max_bytes) return Status::Corruption(path + " is larger than " + std::to_string(max_bytes) + " bytes");
  }
  return out;
}

Status rename_durable(const std::string& from, const std::string& to) {
  if (::rename(from.c_str(), to.c_str()) != 0) return sys_error("rename of " + from + " to", to, errno);
  return fsync_path(std::filesystem::path(to).parent_path().string());
}

Status exchange_paths(const std::string& a, const std::string& b) {
  if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0) {
    return sys_error("exchange of " + a + " with", b, errno);
  }
  return fsync_path(std::filesystem::path(b).parent_path().string());
}

Status remove_tree(const std::string& path) {
  std::error_code ec;
  // Entries may vanish while the tree is walked (the ranks of a failed sharded save each
  // remove their own files while rank 0 removes the folder): the walk then fails with ENOENT
  // and is taken again over what is left.
  for (int attempt = 0; attempt < 8; ++attempt) {
    ec.clear();
    std::filesystem::remove_all(path, ec);
    if (ec != std::errc::no_such_file_or_directory) break;
  }
  if (ec) return Status::IOError("removing " + path + " failed: " + ec.message());
  return Status::OK();
}

Status list_step_dirs(const std::string& dir, std::vector<StepEntry>* committed, std::vector<StepEntry>* tmp) {
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return sys_error("listing of", dir, errno);
  while (dirent* e = ::readdir(d)) {
    const std::string name = e->d_name;
    std::string base = name;
    bool is_tmp = false;
    for (const std::string_view suffix : {std::string_view(".tmp"), std::string_view(".deleting")}) {
      if (name.size() > suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
        base = name.substr(0, name.size() - suffix.size());
        is_tmp = true;
      }
    }
    std::optional<int64_t> step = parse_step_dir_name(base);
    if (!step) continue;
    struct stat st;
    if (::stat((dir + "/" + name).c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) continue;
    std::vector<StepEntry>* out = is_tmp ? tmp : committed;
    if (out != nullptr) out->push_back(StepEntry{*step, name});
  }
  ::closedir(d);
  auto by_step = [](const StepEntry& a, const StepEntry& b) { return a.step < b.step; };
  if (committed != nullptr) std::sort(committed->begin(), committed->end(), by_step);
  if (tmp != nullptr) std::sort(tmp->begin(), tmp->end(), by_step);
  return Status::OK();
}

}  // namespace strata::ckpt
