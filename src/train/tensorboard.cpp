#include "train/tensorboard.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>

#include <fmt/format.h>

#include "core/crc32c.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

// Protobuf wire format: a field's key is (number << 3) | wire type.
enum Wire : uint32_t { kVarint = 0, kFixed64 = 1, kBytes = 2, kFixed32 = 5 };

void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7F) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, uint32_t field, Wire wire) { varint(out, (uint64_t{field} << 3) | wire); }
void bytes_field(std::string& out, uint32_t field, const std::string& bytes) {
  key(out, field, kBytes);
  varint(out, bytes.size());
  out += bytes;
}
template <typename T>
void fixed(std::string& out, T value) {  // little-endian, as x86 and the wire format both are
  char raw[sizeof(T)];
  std::memcpy(raw, &value, sizeof(T));
  out.append(raw, sizeof(T));
}

// tensorflow.Event: wall_time = 1 (double), step = 2 (int64), then one of file_version = 3,
// summary = 5, session_log = 7.
constexpr uint32_t kFileVersion = 3, kSummary = 5, kSessionLog = 7;

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// The largest <time> among the event files already in `dir`, 0 when none.
int64_t latest_file_time(const fs::path& dir) {
  int64_t latest = 0;
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    const std::string prefix = "events.out.tfevents.";
    if (name.rfind(prefix, 0) != 0) continue;
    latest = std::max<int64_t>(latest, std::strtoll(name.c_str() + prefix.size(), nullptr, 10));
  }
  return latest;
}

}  // namespace

std::string tensorboard_event(double wall_time, int64_t step, const std::string& body) {
  std::string e;
  key(e, 1, kFixed64);
  fixed(e, wall_time);
  key(e, 2, kVarint);
  varint(e, static_cast<uint64_t>(step));
  e += body;
  return e;
}

std::string tfrecord(const std::string& data) {
  std::string r;
  const uint64_t length = data.size();
  fixed(r, length);
  fixed(r, mask_crc32c(crc32c(&length, sizeof length)));
  r += data;
  fixed(r, mask_crc32c(crc32c(data.data(), data.size())));
  return r;
}

Result<TensorBoardWriter> TensorBoardWriter::open(const std::string& dir, int64_t start_step) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Status::IOError("cannot create the TensorBoard folder " + dir + ": " + ec.message());
  char host[256] = "localhost";
  if (::gethostname(host, sizeof host - 1) != 0) std::strcpy(host, "localhost");
  const int64_t earlier = latest_file_time(dir);
  const int64_t time = std::max(static_cast<int64_t>(now_s()), earlier + 1);
  const std::string path = (fs::path(dir) / fmt::format("events.out.tfevents.{:010d}.{}.{}", time, host, ::getpid())).string();
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr) return Status::IOError("cannot create " + path + ": " + std::strerror(errno));
  TensorBoardWriter w(f, path);
  std::string version;
  bytes_field(version, kFileVersion, "brain.Event:2");
  RETURN_IF_ERROR(w.record(tensorboard_event(now_s(), 0, version)));
  if (earlier > 0) {
    std::string start;  // SessionLog: status = 1 (enum), START = 1
    key(start, 1, kVarint);
    varint(start, 1);
    std::string body;
    bytes_field(body, kSessionLog, start);
    RETURN_IF_ERROR(w.record(tensorboard_event(now_s(), start_step, body)));
  }
  return w;
}

TensorBoardWriter::~TensorBoardWriter() {
  if (file_ != nullptr) std::fclose(file_);
}

Status TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;  // Summary: repeated Value value = 1; Value: tag = 1, simple_value = 2 (float)
  for (const auto& [tag, value] : values) {
    std::string v;
    bytes_field(v, 1, tag);
    key(v, 2, kFixed32);
    fixed(v, static_cast<float>(value));
    bytes_field(summary, 1, v);
  }
  std::string body;
  bytes_field(body, kSummary, summary);
  return record(tensorboard_event(now_s(), step, body));
}

Status TensorBoardWriter::record(const std::string& event) {
  const std::string r = tfrecord(event);
  if (std::fwrite(r.data(), 1, r.size(), file_) != r.size() || std::fflush(file_) != 0)
    return Status::IOError("cannot write " + path_ + ": " + std::strerror(errno));
  return Status::OK();
}

}  // namespace strata
