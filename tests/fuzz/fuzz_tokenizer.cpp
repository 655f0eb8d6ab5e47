// Fuzzes tokenizer.json through Tokenizer::load, then encodes and decodes a fixed text with
// whatever it accepted (merges, added tokens, pre-tokenizer and normalizer all take part).
#include <cstdlib>
#include <vector>

#include "data/tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace strata;
  const std::string path = fuzz::write_scratch("tokenizer.json", fuzz::as_view(data, size));
  auto tokenizer = model::Tokenizer::load(path);
  if (!tokenizer.ok()) return 0;
  const std::string text = "Hello world, caf\xc3\xa9 n\xcc\x83 123 <|endoftext|>\n\n  x=1;\t\xe4\xbd\xa0\xe5\xa5\xbd";
  std::vector<int32_t> ids;
  std::vector<model::ByteSpan> spans;
  tokenizer->encode_with_spans(text, {}, &ids, &spans);
  if (spans.size() != ids.size()) abort();
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= tokenizer->vocab_size()) abort();
    if (spans[i].begin > spans[i].end || spans[i].end > text.size()) abort();
  }
  (void)tokenizer->decode(ids);
  return 0;
}
