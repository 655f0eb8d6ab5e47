// CheckpointWriter: the background save, copy-on-write and the atomic commit.
//
// Piece life cycle (guarded by Job::mu):
//   kPending ──writer or trainer copies into a staging slot──> kCapturing ──> kCaptured
//   kPending (direct) or kCaptured ──submit──> kInFlight ──completion──> kWritten
// Every piece is hashed in file order before it is submitted (XXH3 streaming state per file),
// from its slot when it has one, otherwise from the region (flagged `hashing`; a region with a
// reader is read into a scratch buffer for that, and read again when the piece is staged).
// A piece no longer needs its region ("released") once its bytes sit in a slot or on disk and
// no hash is reading the region; before_modify returns when every piece it touches is released.
#include "ckpt/writer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <fstream>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <set>

#include "ckpt/finite.h"
#include "ckpt/fs_util.h"
#include "ckpt/reader.h"
#include "ckpt/save_plan.h"
#include "core/log.h"
#include "core/trace.h"

namespace strata::ckpt {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

enum class PieceState : uint8_t { kPending, kCapturing, kCaptured, kInFlight, kWritten };

struct PieceStatus {
  PieceState state = PieceState::kPending;
  bool hashed = false;
  bool hashing = false;  // the writer is hashing straight from the region
  bool urgent = false;   // a before_modify caller waits for it
  char* slot = nullptr;
};

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

struct Xxh3Deleter {
  void operator()(XXH3_state_t* s) const { XXH3_freeState(s); }
};

}  // namespace

struct CheckpointWriter::Job {
  SaveRequest request;
  SavePlan plan;
  std::string dir, tmp_dir, final_dir;
  std::unique_ptr<IoEngine> engine;
  std::vector<UniqueFd> fds;       // per planned file
  std::vector<int> engine_files;   // per planned file
  std::vector<uint64_t> hashes;    // per planned file, once written
  char* staging = nullptr;  // the writer's staging memory (kept across saves)
  char* scratch = nullptr;  // hashing pieces of reader regions; writer thread
  uint64_t piece_bytes = 0;
  Clock::time_point started;
  std::atomic<bool> cancel{false};
  std::atomic<uint64_t> written_bytes{0};  // file bytes of the pieces written so far
  Status result;

  std::mutex mu;
  std::condition_variable cv;      // any piece changed state, a slot freed, urgent work queued
  std::vector<PieceStatus> pieces;  // GUARDED_BY(mu)
  std::vector<char*> free_slots;   // GUARDED_BY(mu)
  std::deque<int> urgent;          // GUARDED_BY(mu)
  std::set<int> captured;          // pieces in kCaptured; GUARDED_BY(mu)
  bool released_all = false;       // GUARDED_BY(mu): the regions are no longer read
  Status failure;                  // GUARDED_BY(mu): a reader failed; the save is lost
  bool ready = false;              // GUARDED_BY(mu): setup() is done, the staging slots exist
  SaveStats stats;                 // GUARDED_BY(mu)

  bool released(int p) const {
    const PieceStatus& s = pieces[p];
    if (released_all || !failure.ok()) return true;
    if (s.hashing) return false;
    return s.state == PieceState::kWritten || (s.slot != nullptr && s.state != PieceState::kCapturing);
  }
  std::string path_of(int file) const { return tmp_dir + "/" + plan.files[file].name; }
  bool exchanged = false;  // a sharded save told the other ranks its outcome

  // Copies a piece's bytes into `slot` and zeroes its padding. Runs without the lock; the
  // caller has marked the piece kCapturing.
  Status copy_piece(int p, char* slot) const {
    const Piece& piece = plan.pieces[p];
    for (const PieceSource& s : piece.sources) RETURN_IF_ERROR(copy_source(piece, s, slot + s.dst));
    std::memset(slot + piece.real, 0, piece.length - piece.real);
    return Status::OK();
  }
  Status copy_source(const Piece& piece, const PieceSource& s, char* dst) const {
    if (s.region >= 0 && request.regions[s.region].read) {
      return request.regions[s.region].read(s.region_offset, s.length, dst)
          .with_context("reading " + std::string(tensor_kind_name(request.regions[s.region].kind)) +
                        " bytes for the checkpoint");
    }
    std::memcpy(dst, source_data(plan, piece, s), s.length);
    return Status::OK();
  }
  bool has_reader() const {
    for (const Region& r : request.regions)
      if (r.read) return true;
    return false;
  }
};

CheckpointWriter::CheckpointWriter(CheckpointWriterOptions options) : options_(std::move(options)) {}

CheckpointWriter::~CheckpointWriter() { (void)wait(); }

bool CheckpointWriter::in_flight() const { return running_.load(); }

void CheckpointWriter::join_locked_out() {
  if (thread_.joinable()) {
    thread_.join();
    last_status_ = job_->result;
  }
}

Status CheckpointWriter::wait() {
  join_locked_out();
  return last_status_;
}

Status CheckpointWriter::poll() {
  if (running_.load()) return Status::OK();
  return wait();
}

void CheckpointWriter::cancel() {
  if (!running_.load() || job_ == nullptr) return;
  job_->cancel = true;
  std::lock_guard<std::mutex> lock(job_->mu);
  job_->cv.notify_all();
}

std::pair<uint64_t, uint64_t> CheckpointWriter::save_progress() const {
  if (!running_.load() || job_ == nullptr) return {0, 0};
  uint64_t total = 0;
  for (const Piece& piece : job_->plan.pieces) total += piece.real;
  return {job_->written_bytes.load(std::memory_order_relaxed), total};
}

SaveStats CheckpointWriter::last_stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

Status remove_stale_tmp_dirs(const std::string& dir) {
  std::vector<StepEntry> tmp;
  RETURN_IF_ERROR(list_step_dirs(dir, nullptr, &tmp));
  for (const StepEntry& e : tmp) {
    const std::string path = dir + "/" + e.name;
    LOG_WARN("removing {}, left unfinished by an interrupted checkpoint {}", path,
             e.name.ends_with(".deleting") ? "removal" : "save");
    RETURN_IF_ERROR(remove_tree(path));
  }
  return Status::OK();
}

std::string read_best_step(const std::string& dir) {
  std::ifstream in(dir + "/" + kBestFile);
  std::string name;
  if (!in || !std::getline(in, name)) return "";
  return name;
}

Status apply_retention(const std::string& dir, int keep_last, const std::string& protect,
                       const std::function<Status(const std::string&)>& remove) {
  if (keep_last <= 0) return Status::OK();
  std::vector<StepEntry> committed;
  RETURN_IF_ERROR(list_step_dirs(dir, &committed, nullptr));
  // The newest keep_last stay, and older ones that latest or best name stay on top of them.
  const std::string best = read_best_step(dir);
  const int excess = static_cast<int>(committed.size()) - keep_last;
  for (int i = 0; i < excess; ++i) {
    if (committed[i].name == protect || committed[i].name == best) continue;
    const std::string path = dir + "/" + committed[i].name;
    const std::string deleting = path + ".deleting";
    LOG_INFO("removing checkpoint {} (keeping the last {})", path, keep_last);
    RETURN_IF_ERROR(remove(deleting));  // what an earlier removal of the same step left
    RETURN_IF_ERROR(rename_durable(path, deleting));
    RETURN_IF_ERROR(remove(deleting));
  }
  return Status::OK();
}

Result<SaveStart> CheckpointWriter::begin_save(const SaveRequest& request) {
  if (running_.load()) {
    if (options_.if_busy == IfBusy::kSkip) {
      LOG_INFO("checkpoint of step {} skipped: the save of step {} is still being written", request.step,
               job_->request.step);
      return SaveStart::kSkippedBusy;
    }
  }
  (void)wait();  // the previous outcome was reported by its own wait()/poll() or log line
  if (options_.staging_bytes < 64 * kKiB) {
    return Status::InvalidArgument("checkpoint staging_bytes is " + format_bytes(options_.staging_bytes) +
                                   "; it must be at least 64 KiB");
  }
  if (request.dir.empty()) return Status::InvalidArgument("checkpoint directory is empty");
  if (request.step < 0) return Status::InvalidArgument("checkpoint step is negative");

  auto job = std::make_unique<Job>();
  job->started = Clock::now();
  job->request = request;
  job->piece_bytes = piece_bytes_for_staging(options_.staging_bytes);
  ASSIGN_OR_RETURN(job->plan, make_save_plan(job->request, job->piece_bytes));
  job->dir = request.dir;
  while (job->dir.size() > 1 && job->dir.back() == '/') job->dir.pop_back();
  job->final_dir = job->dir + "/" + step_dir_name(request.step);
  job->tmp_dir = job->final_dir + ".tmp";

  job->pieces.resize(job->plan.pieces.size());
  job->stats.step = request.step;

  job_ = std::move(job);
  running_ = true;
  cow_active_ = true;
  thread_ = std::thread([this, raw = job_.get()] { run(raw); });
  return SaveStart::kStarted;
}

// The file-system half of starting a save, on the writer's thread so that the trainer does not
// wait for it: stale tmp dirs, DIR/step-N.tmp, the engine, the files (reserved with
// fallocate), the staging memory. On failure nothing of step-N.tmp is left.
Status CheckpointWriter::setup(Job* job) {
  std::error_code ec;
  std::filesystem::create_directories(job->dir, ec);
  if (ec) return Status::IOError("cannot create checkpoint directory " + job->dir + ": " + ec.message());
  const bool sharded = job->request.shard.sharded();
  if (sharded) {
    // Every rank writes into the same step-N.tmp: none may remove what another made (stale
    // folders are cleared before the run's first save, and a failed save by rank 0 once all
    // ranks have reported).
    if (::mkdir(job->tmp_dir.c_str(), 0755) != 0 && errno != EEXIST) return sys_error("mkdir of", job->tmp_dir, errno);
  } else {
    RETURN_IF_ERROR(remove_stale_tmp_dirs(job->dir));
    if (::mkdir(job->tmp_dir.c_str(), 0755) != 0) return sys_error("mkdir of", job->tmp_dir, errno);
  }

  // From here on a failure must remove tmp_dir (this rank's files of it, when sharded).
  auto fail = [&](const Status& st) {
    job->fds.clear();
    if (sharded) {
      for (const PlannedFile& f : job->plan.files) (void)::unlink((job->tmp_dir + "/" + f.name).c_str());
    } else {
      (void)remove_tree(job->tmp_dir);
    }
    return st;
  };
  if (options_.engine_factory) {
    Result<std::unique_ptr<IoEngine>> engine = options_.engine_factory();
    if (!engine.ok()) return fail(engine.status());
    job->engine = std::move(engine).value();
  } else {
    Result<std::unique_ptr<IoEngine>> engine = make_io_engine(options_.io);
    if (!engine.ok()) return fail(engine.status());
    job->engine = std::move(engine).value();
  }
  for (size_t f = 0; f < job->plan.files.size(); ++f) {
    const std::string path = job->path_of(static_cast<int>(f));
    const int flags = O_WRONLY | O_CREAT | O_TRUNC;
    Result<UniqueFd> fd = open_file(path, flags | (options_.direct_io ? O_DIRECT : 0));
    if (!fd.ok() && options_.direct_io) {
      LOG_DEBUG("O_DIRECT refused for {} ({}); writing through the page cache", path, fd.status().message());
      fd = open_file(path, flags);
    }
    if (!fd.ok()) return fail(fd.status());
    const uint64_t alloc = round_up(job->plan.files[f].size, kFileAlign);
    if (::fallocate(fd->get(), 0, 0, static_cast<off_t>(alloc)) != 0 && errno != EOPNOTSUPP) {
      return fail(sys_error("reserving " + format_bytes(alloc) + " for", path, errno));
    }
    Result<int> index = job->engine->register_file(fd->get(), path);
    if (!index.ok()) return fail(index.status());
    job->engine_files.push_back(*index);
    job->fds.push_back(std::move(fd).value());
  }
  const uint64_t slots = options_.staging_bytes / job->piece_bytes;
  // Staging is allocated by the first save and kept: its pages are faulted in once, not on
  // every save. Its size depends on the options only. A save with reader regions uses its
  // last piece as the hashing scratch (at least 4 pieces fit: piece_bytes_for_staging).
  if (staging_ == nullptr) {
    staging_.reset(static_cast<char*>(std::aligned_alloc(kFileAlign, slots * job->piece_bytes)));
    if (staging_ == nullptr) {
      return fail(Status::OutOfMemory("cannot allocate " + format_bytes(slots * job->piece_bytes) +
                                      " of checkpoint staging memory"));
    }
  }
  job->staging = staging_.get();
  const uint64_t usable = job->has_reader() ? slots - 1 : slots;
  if (job->has_reader()) job->scratch = job->staging + usable * job->piece_bytes;
  std::lock_guard<std::mutex> lock(job->mu);
  for (uint64_t i = 0; i < usable; ++i) job->free_slots.push_back(job->staging + i * job->piece_bytes);
  job->ready = true;
  job->stats.engine = job->engine->name();
  job->cv.notify_all();  // before_modify callers may wait for slots
  return Status::OK();
}

void CheckpointWriter::before_modify(int region, uint64_t begin, uint64_t end) {
  if (!cow_active_.load(std::memory_order_acquire)) return;
  Job* job = job_.get();
  CHECK_MSG(region >= 0 && region < static_cast<int>(job->request.regions.size()),
            "before_modify of region " + std::to_string(region) + " of a save with " +
                std::to_string(job->request.regions.size()) + " regions");
  CHECK(begin <= end && end <= job->request.regions[region].size);
  const std::vector<RegionSpan>& spans = job->plan.region_spans[region];
  auto it = std::lower_bound(spans.begin(), spans.end(), begin,
                             [](const RegionSpan& s, uint64_t b) { return s.end <= b; });
  std::unique_lock<std::mutex> lock(job->mu);
  // Until the writer's thread has set up the save there are no staging slots to copy into.
  job->cv.wait(lock, [&] { return job->ready || job->released_all; });
  for (; it != spans.end() && it->begin < end; ++it) {
    const int p = it->piece;
    while (!job->released(p)) {
      PieceStatus& s = job->pieces[p];
      if (s.state == PieceState::kPending && !job->free_slots.empty()) {
        char* slot = job->free_slots.back();
        job->free_slots.pop_back();
        s.slot = slot;
        s.state = PieceState::kCapturing;
        lock.unlock();
        Status copied = job->copy_piece(p, slot);
        lock.lock();
        if (!copied.ok()) {
          // The save is lost (the writer thread reports it); the caller may go on.
          if (job->failure.ok()) job->failure = copied;
          s.state = PieceState::kPending;
          s.slot = nullptr;
          job->free_slots.push_back(slot);
          job->cv.notify_all();
          break;
        }
        s.state = PieceState::kCaptured;
        job->captured.insert(p);
        job->stats.cow_copied_bytes += job->plan.pieces[p].real;
        job->cv.notify_all();
        continue;
      }
      if (!s.urgent) {
        s.urgent = true;
        job->urgent.push_back(p);
      }
      job->cv.notify_all();
      const Clock::time_point t0 = Clock::now();
      job->cv.wait(lock, [&] { return job->released(p); });
      job->stats.cow_waits++;
      job->stats.cow_wait_seconds += seconds_since(t0);
    }
  }
}

Status CheckpointWriter::write_data(Job* job) {
  std::unique_lock<std::mutex> lock(job->mu);
  const int n = static_cast<int>(job->plan.pieces.size());
  std::vector<int> hash_cursor;
  std::vector<std::unique_ptr<XXH3_state_t, Xxh3Deleter>> states;
  // What is hashed is what is written: the finite check rides on the hash pass.
  std::vector<FiniteScan> scans;
  for (const PlannedFile& f : job->plan.files) {
    std::vector<ScannedTensor> tensors;
    if (options_.refuse_non_finite)
      for (const HeaderEntry& e : f.tensors)
        tensors.push_back({e.name, e.dtype, f.data_start + e.begin, f.data_start + e.end, 0});
    scans.emplace_back(std::move(tensors));
    hash_cursor.push_back(f.first_piece);
    states.emplace_back(XXH3_createState());
    CHECK(states.back() != nullptr);
    XXH3_64bits_reset(states.back().get());
  }
  std::deque<std::pair<IoTicket, int>> in_flight;
  int next = 0;
  int written = 0;
  Status error;

  auto complete_oldest = [&] {
    auto [ticket, p] = in_flight.front();
    in_flight.pop_front();
    lock.unlock();
    Status st = job->engine->wait(ticket);
    lock.lock();
    PieceStatus& s = job->pieces[p];
    s.state = PieceState::kWritten;
    if (s.slot != nullptr) job->free_slots.push_back(s.slot);
    s.slot = nullptr;
    ++written;
    job->written_bytes.fetch_add(job->plan.pieces[p].real, std::memory_order_relaxed);
    if (!st.ok() && error.ok()) error = st;
    job->cv.notify_all();
  };
  // Hashes the pieces of target's file up to and including target. May release the lock.
  auto hash_through = [&](int target) {
    const int f = job->plan.pieces[target].file;
    while (hash_cursor[f] <= target) {
      const int p = hash_cursor[f];
      PieceStatus& s = job->pieces[p];
      job->cv.wait(lock, [&] { return s.state != PieceState::kCapturing; });
      CHECK(s.state != PieceState::kWritten && !s.hashed);
      const Piece& piece = job->plan.pieces[p];
      XXH3_state_t* state = states[f].get();
      if (s.slot != nullptr) {
        const char* slot = s.slot;  // freed only by complete_oldest, on this thread
        lock.unlock();
        XXH3_64bits_update(state, slot, piece.real);
        scans[f].feed(piece.offset, slot, piece.real);
        lock.lock();
      } else {
        s.hashing = true;
        lock.unlock();
        Status read = Status::OK();
        for (const PieceSource& src : piece.sources) {
          if (src.region >= 0 && job->request.regions[src.region].read) {
            read = job->copy_source(piece, src, job->scratch);
            if (!read.ok()) break;
            XXH3_64bits_update(state, job->scratch, src.length);
            scans[f].feed(piece.offset + src.dst, job->scratch, src.length);
          } else {
            XXH3_64bits_update(state, source_data(job->plan, piece, src), src.length);
            scans[f].feed(piece.offset + src.dst, source_data(job->plan, piece, src), src.length);
          }
        }
        lock.lock();
        s.hashing = false;
        job->cv.notify_all();
        if (!read.ok()) {
          if (error.ok()) error = read;
          return;
        }
      }
      s.hashed = true;
      ++hash_cursor[f];
    }
  };
  // The next piece to submit, or -1.
  auto pick = [&]() -> int {
    while (!job->urgent.empty()) {
      const int p = job->urgent.front();
      if (job->pieces[p].state == PieceState::kPending) return p;
      job->urgent.pop_front();
    }
    if (!job->captured.empty()) return *job->captured.begin();
    while (next < n && job->pieces[next].state != PieceState::kPending) ++next;
    return next < n ? next : -1;
  };

  const uint32_t max_in_flight = std::max<uint32_t>(1, options_.max_in_flight);
  while (written < n && error.ok() && job->failure.ok() && !job->cancel.load()) {
    int target = pick();
    if (target < 0) {
      if (!in_flight.empty()) {
        complete_oldest();
      } else {
        job->cv.wait(lock);  // the remaining pieces are being captured by before_modify
      }
      continue;
    }
    if (in_flight.size() >= max_in_flight) {
      complete_oldest();
      continue;
    }
    const bool needs_slot = job->pieces[target].state == PieceState::kPending && !job->plan.pieces[target].direct;
    if (needs_slot && job->free_slots.empty()) {
      if (!in_flight.empty()) {
        complete_oldest();
        continue;
      }
      if (job->captured.empty()) {
        job->cv.wait(lock);  // before_modify is filling the slots; they become writable soon
        continue;
      }
      target = *job->captured.begin();  // writing it frees its slot
    }
    if (!job->pieces[target].hashed) {
      hash_through(target);
      continue;  // the lock was released (or an error set); look again
    }
    PieceStatus& t = job->pieces[target];
    const Piece& tp = job->plan.pieces[target];
    char* buffer;
    if (t.state == PieceState::kCaptured) {
      job->captured.erase(target);
      buffer = t.slot;
    } else if (tp.direct) {
      buffer = const_cast<char*>(tp.sources[0].data);
      job->stats.direct_bytes += tp.length;
    } else {
      CHECK(!job->free_slots.empty());
      t.slot = job->free_slots.back();
      job->free_slots.pop_back();
      t.state = PieceState::kCapturing;
      lock.unlock();
      Status copied = job->copy_piece(target, t.slot);
      lock.lock();
      if (!copied.ok()) {
        error = copied;
        t.state = PieceState::kWritten;  // never submitted; its slot is simply dropped
        job->cv.notify_all();
        break;
      }
      buffer = t.slot;
      job->stats.staged_bytes += tp.length;
    }
    t.state = PieceState::kInFlight;
    job->cv.notify_all();
    IoRequest req;
    req.op = IoOp::kWrite;
    req.file = job->engine_files[tp.file];
    req.buffer = buffer;
    req.length = tp.length;
    req.offset = tp.offset;
    req.trace_name = "checkpoint write";
    lock.unlock();
    Result<IoTicket> ticket = job->engine->submit(req);
    lock.lock();
    if (!ticket.ok()) {
      error = ticket.status();
      t.state = PieceState::kWritten;  // never submitted; nothing reads its buffer
      break;
    }
    in_flight.emplace_back(*ticket, target);
  }
  while (!in_flight.empty()) complete_oldest();
  if (error.ok() && !job->failure.ok()) error = job->failure;
  job->released_all = true;
  job->cv.notify_all();
  cow_active_.store(false, std::memory_order_release);
  if (!error.ok()) return error;
  if (job->cancel.load()) return Status::Internal("the save was cancelled");
  std::vector<ScannedTensor> non_finite;
  for (const FiniteScan& scan : scans)
    for (const ScannedTensor& t : scan.tensors())
      if (t.non_finite > 0) non_finite.push_back(t);
  if (!non_finite.empty()) {
    return Status::Corruption("the training state is not finite (" + describe_non_finite(non_finite) +
                              "); such a checkpoint is never committed, so the last finite one stays in `latest`");
  }
  for (size_t f = 0; f < states.size(); ++f) job->hashes.push_back(XXH3_64bits_digest(states[f].get()));
  job->stats.write_seconds = seconds_since(job->started);
  return Status::OK();
}

Status CheckpointWriter::commit(Job* job) {
  Manifest manifest;
  manifest.step = job->request.step;
  manifest.fields = job->request.manifest;
  for (size_t f = 0; f < job->plan.files.size(); ++f) {
    const PlannedFile& file = job->plan.files[f];
    const std::string path = job->path_of(static_cast<int>(f));
    const int fd = job->fds[f].get();
    if (::ftruncate(fd, static_cast<off_t>(file.size)) != 0) return sys_error("truncate of", path, errno);
    if (::fsync(fd) != 0) return sys_error("fsync of", path, errno);
    RETURN_IF_ERROR(job->fds[f].close_checked(path));
    manifest.files[file.name] = FileRecord{file.size, job->hashes[f]};
  }
  if (job->request.shard.sharded()) {
    // Rank 0 commits every rank's files; the others are done once theirs are durable.
    job->exchanged = true;
    using Files = std::map<std::string, FileRecord>;
    ASSIGN_OR_RETURN(Files all, job->request.shard.exchange(Status::OK(), manifest.files));
    if (job->request.shard.rank != 0) return Status::OK();
    manifest.files = std::move(all);
  }
  RETURN_IF_ERROR(write_file_durable(job->tmp_dir + "/" + kManifestFile, manifest_to_json(manifest).dump(2) + "\n"));
  RETURN_IF_ERROR(fsync_path(job->tmp_dir));
  const std::string step_name = step_dir_name(job->request.step);
  struct stat st;
  if (::stat(job->final_dir.c_str(), &st) == 0) {
    // Saving a step again (after a resume): swap atomically, then drop the old copy.
    RETURN_IF_ERROR(exchange_paths(job->tmp_dir, job->final_dir));
    RETURN_IF_ERROR(remove_tree(job->tmp_dir));
  } else {
    RETURN_IF_ERROR(rename_durable(job->tmp_dir, job->final_dir));
  }
  const std::string latest = job->dir + "/" + kLatestFile;
  RETURN_IF_ERROR(write_file_durable(latest + ".tmp", step_name + "\n"));
  RETURN_IF_ERROR(rename_durable(latest + ".tmp", latest));
  const std::string best = job->dir + "/" + kBestFile;
  if (!job->request.best_note.empty()) {
    RETURN_IF_ERROR(write_file_durable(best + ".tmp", step_name + "\n" + job->request.best_note + "\n"));
    RETURN_IF_ERROR(rename_durable(best + ".tmp", best));
  } else if (read_best_step(job->dir) == step_name) {
    // The step best named was saved again (a run resumed from before it): its weights are no
    // longer the ones evaluated, so best names nothing until the next best save.
    if (::unlink(best.c_str()) != 0 && errno != ENOENT) return sys_error("removal of", best, errno);
    RETURN_IF_ERROR(fsync_path(job->dir));
  }
  Status retention = apply_retention(job->dir, options_.keep_last, step_name);
  if (!retention.ok()) LOG_WARN("checkpoint retention in {}: {}", job->dir, retention.message());
  return Status::OK();
}

void CheckpointWriter::run(Job* job) {
  trace::name_thread("checkpoint writer");
  trace::Span span("checkpoint", "checkpoint save");
  span.arg("step", static_cast<double>(job->request.step));
  Status st = setup(job);
  if (!st.ok()) {
    // Nothing was written; let before_modify callers go.
    std::lock_guard<std::mutex> lock(job->mu);
    job->released_all = true;
    job->cv.notify_all();
    cow_active_.store(false, std::memory_order_release);
  }
  if (st.ok()) st = write_data(job);
  if (st.ok()) st = commit(job);
  const ShardedSave& shard = job->request.shard;
  if (shard.sharded() && !job->exchanged) {
    // The other ranks wait to hear from this one: it reports its failure.
    job->exchanged = true;
    Result<std::map<std::string, FileRecord>> heard = shard.exchange(st, {});
    if (st.ok() && !heard.ok()) st = heard.status();
  }
  job->fds.clear();
  job->engine.reset();  // releases the files registered with it
  SaveStats stats;
  {
    std::lock_guard<std::mutex> lock(job->mu);
    stats = job->stats;
  }
  for (const PlannedFile& f : job->plan.files) stats.file_bytes += f.size;
  stats.total_seconds = seconds_since(job->started);
  span.arg("bytes", static_cast<double>(stats.file_bytes));
  if (st.ok()) {
    std::string cow;
    if (stats.cow_copied_bytes > 0 || stats.cow_waits > 0) {
      cow = fmt::format("; the optimizer had {} copied first and waited {} times ({:.0f} ms)",
                        format_bytes(stats.cow_copied_bytes), stats.cow_waits, stats.cow_wait_seconds * 1e3);
    }
    LOG_INFO("checkpoint {} written: {} in {:.2f} s ({:.2f} GB/s){}", job->final_dir, format_bytes(stats.file_bytes),
             stats.total_seconds, stats.file_bytes / std::max(stats.total_seconds, 1e-9) / 1e9, cow);
  } else {
    struct stat sb;
    const bool committed = ::stat(job->tmp_dir.c_str(), &sb) != 0 && ::stat(job->final_dir.c_str(), &sb) == 0;
    // Sharded: every rank has reported by now, so rank 0 may remove the whole folder.
    if (!committed && (!shard.sharded() || shard.rank == 0)) (void)remove_tree(job->tmp_dir);
    if (!committed && shard.sharded() && shard.rank != 0)
      for (const PlannedFile& f : job->plan.files) (void)::unlink((job->tmp_dir + "/" + f.name).c_str());
    Result<std::string> latest = read_latest_file(job->dir + "/" + kLatestFile);
    const std::string latest_says = latest.ok() ? latest.value() : "nothing";
    LOG_ERROR("checkpoint of step {} in {} failed: {}; {} {}; {}/latest still names {}; training continues",
              job->request.step, job->dir, st.message(), committed ? "kept" : "removed",
              committed ? job->final_dir : job->tmp_dir, job->dir, latest_says);
    st = st.with_context("checkpoint of step " + std::to_string(job->request.step) + " in " + job->dir);
  }
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    stats_ = stats;
  }
  job->result = st;
  cow_active_.store(false);
  running_.store(false);
}

}  // namespace strata::ckpt
