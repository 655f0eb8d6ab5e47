// The data tool's work: text, JSONL or chat JSONL files tokenized into llm.c shards that
// open_dataset (data.h) reads. `strata data tokenize` (tools/strata/data.cpp) is the front end.
//
// Output, in options.out_dir:
//   train_000000.bin, train_000001.bin, ...  llm.c shards: 256 little-endian int32 header
//       (kLlmcMagicU16 and version 1 when the vocabulary has at most 65536 ids, else
//       kLlmcMagicU32 and version 7, as llm.c writes them; token count), then the tokens as
//       uint16 or uint32. Every shard but the last holds
//       exactly shard_tokens tokens; documents run on across shard boundaries.
//   masks/train_000000.mask, ...  (chat format only) one loss mask per shard, in a subdirectory
//       so that opening out_dir as a dataset sees the token shards alone: 256 little-endian
//       int32 header (kLossMaskMagic, version 1, token count) then one byte per token of the
//       shard with the same name: 1 when the token counts towards the loss as a prediction
//       target (assistant replies and the end marker after each), 0 when it is prompt (system
//       and user turns, role headers, default system messages, the newline after <|im_end|>).
// Each file is written as NAME.tmp and renamed when complete; a failed run removes the files
// it wrote.
//
// Documents: text format, each input file whole; jsonl, the "text" string of each line;
// chat, the conversation of each line (OpenAI messages, ShareGPT or Alpaca: conversation.h)
// rendered as the tokenizer's
// chat template renders it (chat_template.h). A text or jsonl document is encoded with the
// tokenizer's post-processor template (e.g. Llama-3's BOS) unless add_special_tokens is off,
// and followed by the EOS token. A conversation is encoded as apply_chat_template(tokenize=True)
// encodes it, with nothing added (BOS only where the template writes bos_token, no EOS after
// ChatML's closing "<|im_end|>\n"). Blank JSONL lines are skipped.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "core/status.h"

namespace strata {

// header[0] of a loss mask file.
inline constexpr int32_t kLossMaskMagic = 20240911;

enum class TokenizeFormat : uint8_t { kText, kJsonl, kChat };

// "text" | "jsonl" | "chat"; InvalidArgument otherwise.
Result<TokenizeFormat> parse_tokenize_format(std::string_view name);
// A token count as people write it: "100M", "1.5B", "250k", "4096" (K, M, G or B, T: powers of
// 1000, case-insensitive). InvalidArgument for anything else or a count below 1.
Result<int64_t> parse_token_count(std::string_view text);

struct TokenizeOptions {
  std::string tokenizer;            // directory with tokenizer.json (tokenizer_config.json)
  std::vector<std::string> inputs;  // files, read in this order
  std::string out_dir;              // created when missing; must not hold train_*.bin already
  TokenizeFormat format = TokenizeFormat::kText;
  int64_t shard_tokens = 100'000'000;
  bool add_special_tokens = true;  // the post-processor template around each document
  bool progress = false;           // a progress line on stderr when it takes long (core/progress.h)
};

struct TokenizeSummary {
  int64_t documents = 0;
  int64_t tokens = 0;
  int64_t loss_tokens = 0;  // chat: tokens with mask 1; other formats: all tokens
  int64_t bytes = 0;        // input bytes read
  int64_t vocab_size = 0;
  std::vector<std::string> shards;  // paths, in order
  std::vector<std::string> masks;   // chat only: the mask of each shard
};

// Tokenizes options.inputs into shards. Missing inputs are NotFound before anything is
// written; a malformed JSONL line is InvalidArgument naming FILE:LINE; a tokenizer without an
// EOS token is InvalidArgument.
Result<TokenizeSummary> tokenize_to_shards(const TokenizeOptions& options);

// The mask file of a shard: DIR/train_000000.bin -> DIR/masks/train_000000.mask.
std::string loss_mask_path(const std::string& shard_path);
// Reads a whole mask file; Corruption on a wrong magic, version or size.
Result<std::vector<uint8_t>> read_loss_mask(const std::string& path);

}  // namespace strata
