// strata data tokenize --tokenizer DIR --input FILES... --out DIR [options]
#include <cstdio>
#include <string>
#include <vector>

#include "tools/strata/commands.h"
#include "data/tokenize.h"

namespace strata::tools {
namespace {

constexpr const char* kDataUsage = R"(Usage: strata data tokenize --tokenizer DIR --input FILE... --out DIR [options]

Tokenizes text into llm.c shards (OUT/train_000000.bin, ...) that `strata train` reads with
data.format=auto or llmc. DIR holds a Hugging Face tokenizer.json (byte-level BPE: GPT-2,
Llama-3, Qwen2 and the like; sentencepiece-style BPE with byte fallback: Llama-2, Mistral,
Mixtral) and optionally tokenizer_config.json (bos/eos tokens, chat template).

Options:
  --tokenizer DIR        tokenizer directory (or its tokenizer.json)
  --input FILE...        input files, in order (every argument up to the next option)
  --out DIR              output directory; created if missing, must hold no shards yet
  --format F             text (default): each file is one document
                         jsonl: one JSON object per line, its "text" string a document
                         chat: one conversation per line: {"messages": [{"role", "content"}]}
                               (OpenAI), {"conversations": [{"from", "value"}]} (ShareGPT)
                               or {"instruction", "input", "output"} (Alpaca), rendered by
                               strata's Jinja interpreter as transformers renders the
                               model's chat_template (or chat_template.jinja); also writes
                               OUT/masks/train_NNNNNN.mask, 1 byte per token, 1 = the token is
                               part of an assistant turn (the reply and its end marker, not
                               the generation prompt) and counts towards the loss
  --shard-tokens N       tokens per shard (default 100M; K/M/B suffixes are powers of 1000)
  --no-special-tokens    do not put the tokenizer's template tokens (e.g. Llama-3 BOS) around
                         each document
  --quiet                no progress lines on stderr

Every text or jsonl document is followed by the EOS token; a conversation is written as the
template renders it, nothing added. Shards are what llm.c writes: uint16 tokens (version 1) when
the vocabulary has at most 65536 ids, else uint32 tokens (version 7).
)";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "strata data: error: %s (see strata data --help)\n", message.c_str());
  return 2;
}

int tokenize_command(const std::vector<std::string>& args) {
  TokenizeOptions options;
  options.progress = true;
  bool have_out = false;
  for (size_t i = 0; i < args.size(); ++i) {
    std::string a = args[i];
    std::string inline_value;
    bool has_inline = false;
    if (a.rfind("--", 0) == 0 && a.find('=') != std::string::npos) {
      inline_value = a.substr(a.find('=') + 1);
      a = a.substr(0, a.find('='));
      has_inline = true;
    }
    auto value = [&](std::string* out) {
      if (has_inline) {
        *out = inline_value;
        return true;
      }
      if (i + 1 >= args.size() || args[i + 1].rfind("--", 0) == 0) return false;
      *out = args[++i];
      return true;
    };
    std::string v;
    if (a == "--help" || a == "-h") {
      std::fputs(kDataUsage, stdout);
      return 0;
    } else if (a == "--tokenizer") {
      if (!value(&options.tokenizer)) return usage_error("--tokenizer needs a directory");
    } else if (a == "--out") {
      if (!value(&options.out_dir)) return usage_error("--out needs a directory");
      have_out = true;
    } else if (a == "--input") {
      if (has_inline) options.inputs.push_back(inline_value);
      while (i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0) options.inputs.push_back(args[++i]);
      if (options.inputs.empty()) return usage_error("--input needs at least one file");
    } else if (a == "--format") {
      if (!value(&v)) return usage_error("--format needs text, jsonl or chat");
      Result<TokenizeFormat> f = parse_tokenize_format(v);
      if (!f.ok()) return usage_error(f.status().message());
      options.format = *f;
    } else if (a == "--shard-tokens") {
      if (!value(&v)) return usage_error("--shard-tokens needs a count");
      Result<int64_t> n = parse_token_count(v);
      if (!n.ok()) return usage_error(n.status().message());
      options.shard_tokens = *n;
    } else if (a == "--no-special-tokens") {
      options.add_special_tokens = false;
    } else if (a == "--quiet") {
      options.progress = false;
    } else {
      return usage_error("unknown option '" + args[i] + "'");
    }
  }
  if (options.tokenizer.empty()) return usage_error("--tokenizer is required");
  if (options.inputs.empty()) return usage_error("--input is required");
  if (!have_out || options.out_dir.empty()) return usage_error("--out is required");
  Result<TokenizeSummary> s = tokenize_to_shards(options);
  if (!s.ok()) {
    std::fprintf(stderr, "strata data tokenize: error: %s\n", s.status().message().c_str());
    return 1;
  }
  std::printf("wrote %zu shard(s) to %s: %lld documents, %lld tokens (%lld count towards the loss), vocab %lld\n",
              s->shards.size(), options.out_dir.c_str(), static_cast<long long>(s->documents),
              static_cast<long long>(s->tokens), static_cast<long long>(s->loss_tokens),
              static_cast<long long>(s->vocab_size));
  return 0;
}

}  // namespace

int data_command(const std::vector<std::string>& args) {
  if (args.empty()) {
    std::fputs(kDataUsage, stderr);
    return 2;
  }
  if (args[0] == "--help" || args[0] == "-h" || args[0] == "help") {
    std::fputs(kDataUsage, stdout);
    return 0;
  }
  if (args[0] == "tokenize") return tokenize_command(std::vector<std::string>(args.begin() + 1, args.end()));
  return usage_error("unknown subcommand '" + args[0] + "'");
}

}  // namespace strata::tools
