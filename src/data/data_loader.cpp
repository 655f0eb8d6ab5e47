// DataLoader and the window order it serves (declared in data.h).
#include <algorithm>
#include <cstring>
#include <utility>

#include "data/data.h"

namespace strata {

namespace {

// splitmix64 (Steele, Lea, Flood 2014): a tiny generator whose output depends only on
// unsigned 64-bit arithmetic, so an order is the same on every compiler and platform, unlike
// std::shuffle whose algorithm the standard leaves open.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    state_ += 0x9E3779B97F4A7C15ull;
    return mix(state_);
  }
  // Uniform in [0, bound) by rejection, without the bias of a bare modulo.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
    for (;;) {
      uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }
  static uint64_t mix(uint64_t z) { return splitmix64_mix(z); }

 private:
  uint64_t state_;
};

}  // namespace

uint64_t splitmix64_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

const char* packing_name(Packing packing) { return packing == Packing::kDocument ? "document" : "concat"; }

Result<Packing> parse_packing(std::string_view name, std::string_view key) {
  if (name == "concat") return Packing::kConcat;
  if (name == "document") return Packing::kDocument;
  return Status::InvalidArgument("key '" + std::string(key) + "': '" + std::string(name) +
                                 "' is not a packing; use concat (documents run into each other, the default) or "
                                 "document (attention and positions restart at each EOS)");
}

std::vector<int64_t> window_order(int64_t n, uint64_t seed, uint64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(std::max<int64_t>(n, 0)));
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int64_t>(i);
  // Epoch and seed are mixed before seeding so that nearby (seed, epoch) pairs give unrelated
  // streams rather than shifted copies of one another.
  SplitMix64 rng(SplitMix64::mix(seed) ^ SplitMix64::mix(epoch + 0x632BE59BD9B4E019ull));
  for (size_t i = order.size(); i > 1; --i) {
    size_t j = static_cast<size_t>(rng.below(i));
    std::swap(order[i - 1], order[j]);
  }
  return order;
}

Result<DataLoader> DataLoader::create(const TokenDataset* dataset, const DataLoaderOptions& o) {
  CHECK(dataset != nullptr);
  if (o.batch_size <= 0 || o.seq_len <= 0) {
    return Status::InvalidArgument("data loader: batch size " + std::to_string(o.batch_size) + " and sequence length " +
                                   std::to_string(o.seq_len) + " must both be positive");
  }
  if (o.world_size <= 0 || o.rank < 0 || o.rank >= o.world_size) {
    return Status::InvalidArgument("data loader: rank " + std::to_string(o.rank) + " is not in [0, world size " +
                                   std::to_string(o.world_size) + ")");
  }
  if (o.vocab_size < 0) {
    return Status::InvalidArgument("data loader: vocab size " + std::to_string(o.vocab_size) +
                                   " is negative (0 disables the check)");
  }
  if (o.packing == Packing::kDocument && (o.eos_id < 0 || (o.vocab_size > 0 && o.eos_id >= o.vocab_size))) {
    return Status::InvalidArgument(
        "data.packing: document needs data.eos_id, the token id that ends each document (the tokenizer's "
        "eos_token, which strata data tokenize writes after every document), in [0, " +
        (o.vocab_size > 0 ? std::to_string(o.vocab_size) : std::string("vocab_size")) + "); it is " +
        std::to_string(o.eos_id));
  }
  const int64_t n = dataset->num_tokens();
  const int64_t windows = n > o.seq_len ? (n - 1) / o.seq_len : 0;
  const int64_t per_step = o.batch_size * o.world_size;
  if (windows < per_step) {
    return Status::InvalidArgument(
        "dataset too small: " + std::to_string(n) + " tokens make " + std::to_string(windows) + " windows of " +
        std::to_string(o.seq_len + 1) + " tokens, but a step of batch size " + std::to_string(o.batch_size) +
        " on " + std::to_string(o.world_size) + " rank(s) needs " + std::to_string(per_step) +
        " windows, i.e. at least " + std::to_string(per_step * o.seq_len + 1) +
        " tokens; add data or lower the batch size or sequence length");
  }
  return DataLoader(dataset, o, windows);
}

DataLoader::DataLoader(const TokenDataset* dataset, const DataLoaderOptions& options, int64_t num_windows)
    : dataset_(dataset), options_(options), num_windows_(num_windows),
      window_(static_cast<size_t>(options.seq_len + 1)) {}

void DataLoader::ensure_order(uint64_t epoch) {
  if (!order_.empty() && order_epoch_ == epoch) return;
  order_ = window_order(num_windows_, options_.seed, epoch);
  order_epoch_ = epoch;
}

Status DataLoader::set_cursor(const DataCursor& cursor) {
  if (cursor.index > static_cast<uint64_t>(num_windows_)) {
    return Status::InvalidArgument("data cursor index " + std::to_string(cursor.index) + " exceeds the " +
                                   std::to_string(num_windows_) +
                                   " windows of this dataset; was the checkpoint made with other data or "
                                   "another sequence length?");
  }
  cursor_ = cursor;
  return Status::OK();
}

namespace {

// Document packing of one row (DataLoaderOptions): positions restart after each EOS, and an
// EOS's target, the next document's first token, is not predicted.
void mark_documents(const int32_t* inputs, int32_t* targets, int32_t* positions, int64_t T, int64_t eos) {
  for (int64_t t = 0; t < T; ++t) {
    positions[t] = t == 0 || inputs[t - 1] == eos ? 0 : positions[t - 1] + 1;
    if (inputs[t] == eos) targets[t] = -1;
  }
}

}  // namespace

Status DataLoader::next(int32_t* inputs, int32_t* targets, int32_t* positions) {
  const bool documents = options_.packing == Packing::kDocument;
  CHECK_MSG(!documents || positions != nullptr, "document packing fills positions: pass an array of B * T");
  const int64_t B = options_.batch_size;
  const int64_t T = options_.seq_len;
  const uint64_t per_step = static_cast<uint64_t>(B * options_.world_size);
  DataCursor c = cursor_;
  if (c.index + per_step > static_cast<uint64_t>(num_windows_)) {
    ++c.epoch;
    c.index = 0;
  }
  ensure_order(c.epoch);
  const uint64_t first = c.index + static_cast<uint64_t>(options_.rank * B);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t start = order_[first + static_cast<uint64_t>(b)] * T;
    if (b == 0) last_start_ = start;
    RETURN_IF_ERROR(dataset_->read(start, T + 1, window_.data()));
    if (options_.vocab_size > 0) {
      for (int64_t i = 0; i <= T; ++i) {
        const int32_t tok = window_[static_cast<size_t>(i)];
        if (tok < 0 || tok >= options_.vocab_size) {
          return Status::InvalidArgument("token " + std::to_string(tok) + " at " +
                                         dataset_->describe_position(start + i) +
                                         " is outside the model's vocabulary of " +
                                         std::to_string(options_.vocab_size) +
                                         "; was the data tokenized for another model?");
        }
      }
    }
    std::memcpy(inputs + b * T, window_.data(), static_cast<size_t>(T) * sizeof(int32_t));
    std::memcpy(targets + b * T, window_.data() + 1, static_cast<size_t>(T) * sizeof(int32_t));
    if (dataset_->has_masks()) {
      // Masked positions (prompt tokens of chat data) are not prediction targets.
      mask_.resize(static_cast<size_t>(T + 1));
      dataset_->read_mask(start, T + 1, mask_.data());
      for (int64_t t = 0; t < T; ++t)
        if (mask_[static_cast<size_t>(t + 1)] == 0) targets[b * T + t] = -1;
    }
    if (documents) mark_documents(inputs + b * T, targets + b * T, positions + b * T, T, options_.eos_id);
  }
  c.index += per_step;
  cursor_ = c;
  return Status::OK();
}

}  // namespace strata
