// data.eval_fraction: a dataset's documents split into the ones training reads and the ones held
// out for evaluation, so that no held-out token is ever trained on.
#pragma once

#include <cstdint>
#include <memory>

#include "core/status.h"
#include "data/data.h"

namespace strata {

struct DocumentSplit {
  std::unique_ptr<TokenDataset> train;     // the kept documents, back to back in stream order
  std::unique_ptr<TokenDataset> held_out;  // the held-out ones, likewise
  int64_t documents = 0;                   // in the whole stream
  int64_t held_out_documents = 0;
};

// Documents end at each eos_id token (the EOS belongs to the document it ends); the stream's last
// document may lack one. Document i (counted from the start of the stream) is held out when a
// splitmix64 hash of i falls below fraction of its range: the split is a function of the token
// stream, eos_id and fraction only (not of train.seed), so every run and every resume over the
// same data holds out the same documents. Both datasets carry the loss masks of their tokens and
// read through `dataset`, which they share. InvalidArgument when fraction is not in (0, 1), or
// when either side gets no document (naming the count and what to change).
Result<DocumentSplit> split_documents(std::shared_ptr<const TokenDataset> dataset, int64_t eos_id, double fraction);

}  // namespace strata
