// Fuzzes the token file headers: an llm.c shard, or a Megatron .idx with its .bin. The first
// byte picks the format; for Megatron the next two give the .bin's length, taken from the
// input after them, and the rest is the .idx. Accepted files are read, a bounded amount.
#include <algorithm>
#include <cstdlib>
#include <vector>

#include "data/token_files.h"
#include "fuzz_util.h"

namespace {

using namespace strata;

constexpr int64_t kMaxReadTokens = 4096;

void read_some(const TokenSource& source) {
  const int64_t n = source.num_tokens();
  if (n < 0) abort();
  std::vector<int32_t> out(static_cast<size_t>(std::min(n, kMaxReadTokens)));
  // Front and back; a read may fail (ids beyond int32) but must not crash.
  (void)source.read(0, static_cast<int64_t>(out.size()), out.data());
  (void)source.read(n - static_cast<int64_t>(out.size()), static_cast<int64_t>(out.size()), out.data());
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view rest = fuzz::as_view(data + 1, size - 1);
  auto open = [&]() -> Result<std::unique_ptr<TokenSource>> {
    if (data[0] % 2 == 0) return open_llmc_shard(fuzz::write_scratch("shard.bin", rest));
    if (rest.size() < 2) return Status::InvalidArgument("too short");
    const size_t bin_bytes = std::min<size_t>(data[1] | (size_t{data[2]} << 8), rest.size() - 2);
    fuzz::write_scratch("mega.bin", rest.substr(2, bin_bytes));
    fuzz::write_scratch("mega.idx", rest.substr(2 + bin_bytes));
    return open_megatron(fuzz::scratch_dir() + "/mega");
  };
  auto source = open();
  if (source.ok()) read_some(**source);
  return 0;
}
