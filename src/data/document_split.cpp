#include "data/document_split.h"

#include <algorithm>
#include <string>
#include <vector>

namespace strata {

namespace {

// Stream positions [begin, end) of the underlying dataset.
struct Range {
  int64_t begin, end;
};

// Ranges of a dataset seen as one stream of their tokens, back to back.
class RangeSource final : public TokenSource {
 public:
  RangeSource(std::shared_ptr<const TokenDataset> base, std::vector<Range> ranges, std::string path)
      : base_(std::move(base)), ranges_(std::move(ranges)), path_(std::move(path)) {
    offsets_.push_back(0);
    for (const Range& r : ranges_) offsets_.push_back(offsets_.back() + (r.end - r.begin));
  }
  const std::string& path() const override { return path_; }
  int64_t num_tokens() const override { return offsets_.back(); }
  int64_t vocab_hint() const override { return base_->vocab_hint(); }
  Status read(int64_t pos, int64_t n, int32_t* out) const override {
    size_t r = range_index(pos);
    while (n > 0) {
      const int64_t within = pos - offsets_[r];
      const int64_t take = std::min(n, (ranges_[r].end - ranges_[r].begin) - within);
      if (take > 0) RETURN_IF_ERROR(base_->read(ranges_[r].begin + within, take, out));
      pos += take, out += take, n -= take;
      ++r;
    }
    return Status::OK();
  }
  // The loss mask of the whole view, from the base's.
  std::vector<uint8_t> mask() const {
    std::vector<uint8_t> m(static_cast<size_t>(num_tokens()));
    for (size_t r = 0; r < ranges_.size(); ++r)
      base_->read_mask(ranges_[r].begin, ranges_[r].end - ranges_[r].begin, m.data() + offsets_[r]);
    return m;
  }

 private:
  size_t range_index(int64_t pos) const {
    auto it = std::upper_bound(offsets_.begin(), offsets_.end(), pos);
    return static_cast<size_t>(it - offsets_.begin()) - 1;
  }

  std::shared_ptr<const TokenDataset> base_;
  std::vector<Range> ranges_;
  std::vector<int64_t> offsets_;  // (ranges + 1) where each range starts in this stream
  std::string path_;
};

// Whether document i is held out: a fixed salt, so the split never follows train.seed.
bool held_out(int64_t i, double fraction) {
  constexpr uint64_t kSalt = 0x5EED0F0E7A1D0C5ull;
  const uint64_t h = splitmix64_mix(static_cast<uint64_t>(i) ^ kSalt);
  return static_cast<double>(h) < fraction * 18446744073709551616.0;  // 2^64
}

// Appends [begin, end) to ranges, merged with the last range when they touch.
void add_range(std::vector<Range>* ranges, int64_t begin, int64_t end) {
  if (!ranges->empty() && ranges->back().end == begin) {
    ranges->back().end = end;
  } else {
    ranges->push_back({begin, end});
  }
}

Result<std::unique_ptr<TokenDataset>> view(std::shared_ptr<const TokenDataset> base, std::vector<Range> ranges,
                                           const std::string& path) {
  const bool masked = base->has_masks();
  auto source = std::make_unique<RangeSource>(std::move(base), std::move(ranges), path);
  std::vector<uint8_t> mask = masked ? source->mask() : std::vector<uint8_t>();
  std::vector<std::unique_ptr<TokenSource>> sources;
  sources.push_back(std::move(source));
  auto dataset = std::make_unique<TokenDataset>(std::move(sources));
  if (masked) RETURN_IF_ERROR(dataset->attach_mask(0, std::move(mask)));
  return dataset;
}

}  // namespace

Result<DocumentSplit> split_documents(std::shared_ptr<const TokenDataset> dataset, int64_t eos_id, double fraction) {
  CHECK(dataset != nullptr);
  if (!(fraction > 0.0 && fraction < 1.0))
    return Status::InvalidArgument("data.eval_fraction " + std::to_string(fraction) +
                                   " is not in (0, 1): it is the share of the training documents held out");
  if (eos_id < 0)
    return Status::InvalidArgument("data.eval_fraction holds out whole documents and needs data.eos_id, the token "
                                   "id that ends each document");
  DocumentSplit split;
  std::vector<Range> kept, out;
  const int64_t n = dataset->num_tokens();
  constexpr int64_t kBlock = int64_t{1} << 20;  // tokens read at a time
  std::vector<int32_t> block(static_cast<size_t>(std::min(n, kBlock)));
  int64_t doc_start = 0;
  auto end_document = [&](int64_t end) {
    const bool held = held_out(split.documents, fraction);
    add_range(held ? &out : &kept, doc_start, end);
    split.held_out_documents += held ? 1 : 0;
    ++split.documents;
    doc_start = end;
  };
  for (int64_t pos = 0; pos < n; pos += kBlock) {
    const int64_t len = std::min(kBlock, n - pos);
    RETURN_IF_ERROR(dataset->read(pos, len, block.data()));
    for (int64_t i = 0; i < len; ++i)
      if (block[static_cast<size_t>(i)] == eos_id) end_document(pos + i + 1);
  }
  if (doc_start < n) end_document(n);  // the last document, without an EOS
  const int64_t held = split.held_out_documents;
  if (kept.empty() || out.empty()) {
    return Status::InvalidArgument(
        "data.eval_fraction " + std::to_string(fraction) + " of " + std::to_string(split.documents) +
        " documents (ended by token " + std::to_string(eos_id) + ") holds out " + std::to_string(held) +
        " and keeps " + std::to_string(split.documents - held) +
        "; each side needs a document: change the fraction, add data, or check data.eos_id");
  }
  ASSIGN_OR_RETURN(split.train, view(dataset, std::move(kept), dataset->source(0).path() + " (training documents)"));
  ASSIGN_OR_RETURN(split.held_out, view(dataset, std::move(out), dataset->source(0).path() + " (held-out documents)"));
  return split;
}

}  // namespace strata
