// strata generate --from RUN_DIR|CHECKPOINT|HF_DIR --prompt TEXT | --chat FILE [options]
#include <algorithm>
#include <charconv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/device.h"
#include "core/io_engine.h"
#include "core/log.h"
#include "core/units.h"
#include "data/conversation.h"
#include "data/tokenizer.h"
#include "model/cuda/decoder_cuda.h"
#include "model/decoder.h"
#include "model/generate.h"
#include "model/params.h"
#include "offload/state_layout.h"
#include "train/paged_weights.h"
#include "tools/strata/commands.h"
#include "tools/strata/model_source.h"

namespace strata::tools {
namespace {

constexpr const char* kGenerateUsage = R"(Usage: strata generate --from SRC (--prompt TEXT | --chat FILE) [options]

Generates text from a model, streaming the new tokens to stdout as they are chosen. The prompt
runs through the model once (prefill); then each new token runs alone, the keys and values of
the tokens before it read from a KV cache.

SRC is one of:
  a Hugging Face directory   config.json and model.safetensors (or sharded model-*.safetensors),
                             its tokenizer.json and tokenizer_config.json beside them
  a strata checkpoint        RUN/checkpoints, its `latest` file or a step-N directory
  a run directory            what `strata train` wrote (config.yaml): its latest checkpoint
For a checkpoint or a run, the tokenizer is the one of the Hugging Face model the run started
from (model.from in its config.yaml) or of its export (run.export); otherwise pass --tokenizer.

Options:
  --from SRC              the model (above)
  --prompt TEXT           text to continue, encoded with the tokenizer's special tokens around it
                          (e.g. Llama-3's BOS) unless --no-special-tokens
  --chat FILE             a JSON conversation to answer: a list of {"role", "content"} messages,
                          or one object as `strata data tokenize --format chat` reads them
                          (OpenAI "messages", ShareGPT "conversations", Alpaca); rendered by the
                          tokenizer's chat template with the generation prompt appended
  --tokenizer DIR         tokenizer directory (tokenizer.json, tokenizer_config.json); default:
                          the one that comes with SRC (above)
  --max-new-tokens N      tokens to generate at most (default 128, or fewer where the prompt
                          leaves less of the model's max_position_embeddings); prompt + N - 1
                          must fit in max_position_embeddings
  --temperature T         0 (the default): greedy, the most likely token each time; T > 0
                          samples from softmax(logits / T)
  --top-p P               with T > 0, sample among the most likely tokens whose probabilities
                          add up to P (default 1: all of them)
  --seed S                seed of the sampler (default 0): the same seed, model and prompt give
                          the same text (std::mt19937_64, README: Generate)
  --ignore-eos            do not stop at the end-of-sequence tokens (the tokenizer's EOS and
                          generation_config.json's eos_token_id)
  --no-special-tokens     --prompt without the tokenizer's special tokens around it
  --device D              cpu (the default) or cuda (GPU builds: head_dim 64 or 128)
  --precision P           the compute copy of the weights, as strata train's recipes hold it:
                          fp32 (the cpu default), bf16 (the cuda default; on cpu the GPU's bf16
                          recipe emulated) or fp8 (E4M3 blocks of the linear layers' weights)
  -h, --help              this text

Memory (the keys strata train reads, as key=value):
  memory.device=SIZE      device memory for the weights (default: all of them on the cpu, at
                          most three quarters of the GPU's free memory on cuda). A smaller
                          budget pages them: the groups that do not fit (a decoder layer each,
                          the embedding, the head) live in host memory or on nvme and are
                          copied up, ahead of use, for each token. It must hold the largest
                          layer (with all its experts) at once, and more makes it faster.
  memory.host=SIZE        host memory for the weights the device has no room for (default: all
                          of them; with an nvme tier, only the slots it stages through: two
                          chunks and the largest group's, plus one)
  memory.nvme.path=DIR    a directory on a fast disk for what host memory has no room for
  memory.nvme.size=SIZE   (made when missing), and its budget
A budget too small for what the weights need says which key to raise and by how much. The
weights are read whole into host memory once and copied into their tiers, so loading takes
their fp32 size in host memory besides the host tier.
)";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "strata generate: error: %s (see strata generate --help)\n", message.c_str());
  return 2;
}

int fail(const Status& st) {
  std::fprintf(stderr, "strata generate: error: %s\n", st.message().c_str());
  return 1;
}

struct Options {
  std::string from, prompt, chat, tokenizer, device = "cpu", precision;
  // Tier budgets of the weights (memory.* as strata train names them); 0: not given.
  uint64_t memory_device = 0, memory_host = 0, nvme_size = 0;
  std::string nvme_path;
  bool have_prompt = false, ignore_eos = false, special_tokens = true;
  bool max_new_given = false;  // --max-new-tokens was given (else 128, or the context left)
  model::GenerateOptions generate;
};

bool parse_int(const std::string& s, int64_t lo, int64_t hi, int64_t* out) {
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || end != s.data() + s.size() || v < lo || v > hi) return false;
  *out = v;
  return true;
}

bool parse_double(const std::string& s, double* out) {
  if (s.empty()) return false;
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  *out = v;
  return true;
}

// Returns "" when the arguments are good, else the usage error.
std::string parse_args(const std::vector<std::string>& args, Options* o) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--ignore-eos") {
      o->ignore_eos = true;
      continue;
    }
    if (a == "--no-special-tokens") {
      o->special_tokens = false;
      continue;
    }
    if (a.rfind("memory.", 0) == 0) {
      const size_t eq = a.find('=');
      const std::string key = a.substr(0, eq), value = eq == std::string::npos ? "" : a.substr(eq + 1);
      if (eq == std::string::npos || value.empty()) return key + " needs a value: " + key + "=VALUE";
      if (key == "memory.nvme.path") {
        o->nvme_path = value;
        continue;
      }
      uint64_t* budget = key == "memory.device"      ? &o->memory_device
                         : key == "memory.host"      ? &o->memory_host
                         : key == "memory.nvme.size" ? &o->nvme_size
                                                     : nullptr;
      if (budget == nullptr) {
        return "unknown key '" + key + "'; generate reads memory.device, memory.host, memory.nvme.path and "
               "memory.nvme.size";
      }
      Result<uint64_t> bytes = parse_bytes(value);
      if (!bytes.ok() || *bytes == 0) return key + " is '" + value + "'; use a size such as 8GiB";
      *budget = *bytes;
      continue;
    }
    if (a.rfind("--", 0) != 0) return "unexpected argument '" + a + "'";
    if (i + 1 >= args.size()) return a + " needs a value";
    const std::string& v = args[++i];
    int64_t n = 0;
    double x = 0;
    if (a == "--from") {
      o->from = v;
    } else if (a == "--prompt") {
      o->prompt = v;
      o->have_prompt = true;
    } else if (a == "--chat") {
      o->chat = v;
    } else if (a == "--tokenizer") {
      o->tokenizer = v;
    } else if (a == "--device") {
      o->device = v;
    } else if (a == "--precision") {
      o->precision = v;
    } else if (a == "--max-new-tokens") {
      if (!parse_int(v, 1, 1 << 20, &n)) return "--max-new-tokens is '" + v + "'; use a whole number from 1 to 1048576";
      o->generate.max_new_tokens = n;
      o->max_new_given = true;
    } else if (a == "--seed") {
      if (!parse_int(v, 0, INT64_MAX, &n)) return "--seed is '" + v + "'; use a whole number of 0 or more";
      o->generate.sampling.seed = static_cast<uint64_t>(n);
    } else if (a == "--temperature") {
      if (!parse_double(v, &x) || x < 0) return "--temperature is '" + v + "'; use 0 (greedy) or a positive number";
      o->generate.sampling.temperature = x;
    } else if (a == "--top-p") {
      if (!parse_double(v, &x) || !(x > 0 && x <= 1)) return "--top-p is '" + v + "'; use a probability in (0, 1]";
      o->generate.sampling.top_p = x;
    } else {
      return "unknown option '" + a + "'";
    }
  }
  if (o->from.empty()) return "--from is required: a run directory, a checkpoint or a Hugging Face directory";
  if (o->have_prompt == !o->chat.empty()) return "give exactly one of --prompt TEXT and --chat FILE";
  if (o->device != "cpu" && o->device != "cuda") return "--device is '" + o->device + "'; choose cpu or cuda";
  if (o->precision.empty()) o->precision = o->device == "cuda" ? "bf16" : "fp32";
  if (!parse_precision(o->precision)) return "--precision is '" + o->precision + "'; choose fp32, bf16 or fp8";
  if (o->device == "cuda" && o->precision == "fp32") return "--device cuda computes in bf16 or fp8; not fp32";
  if (o->nvme_path.empty() != (o->nvme_size == 0))
    return "an nvme tier needs both memory.nvme.path=DIR and memory.nvme.size=SIZE";
  if (o->memory_device == 0 && (o->memory_host > 0 || o->nvme_size > 0))
    return "memory.host and memory.nvme.* hold what memory.device has no room for; give memory.device too";
  return "";
}

// The conversation of a --chat file: a list of messages, or one object in a shape of
// data/conversation.h. Ends with a turn that is not the assistant's (the reply is generated).
Result<nlohmann::ordered_json> read_chat(const std::string& path) {
  constexpr std::uintmax_t kMaxBytes = 64ull << 20;
  std::error_code ec;
  const std::uintmax_t size = std::filesystem::file_size(path, ec);
  if (ec) return Status::NotFound("cannot read --chat file " + path + ": " + ec.message());
  if (size > kMaxBytes) return Status::InvalidArgument("--chat file " + path + " is larger than 64 MiB");
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  if (!in) return Status::IOError("cannot read --chat file " + path);
  const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return Status::InvalidArgument("--chat file " + path + " is not JSON");
  nlohmann::ordered_json messages = doc;
  if (!doc.is_array()) {
    Result<nlohmann::ordered_json> m = conversation_messages(doc);
    if (!m.ok()) return m.status().with_context("--chat file " + path);
    messages = std::move(*m);
  }
  if (messages.empty()) return Status::InvalidArgument("--chat file " + path + " holds no messages");
  const nlohmann::ordered_json& last = messages.back();
  if (last.is_object() && last.value("role", "") == "assistant") {
    return Status::InvalidArgument("the conversation in " + path +
                                   " ends with an assistant turn; end it with the turn to answer (the reply is "
                                   "what strata generate writes)");
  }
  return messages;
}

// generation_config.json's eos_token_id (a number or a list), when the directory has one.
std::vector<int32_t> generation_config_eos(const std::string& dir) {
  std::vector<int32_t> ids;
  std::ifstream in(std::filesystem::path(dir) / "generation_config.json");
  if (!in) return ids;
  const nlohmann::json j = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return ids;
  const auto it = j.find("eos_token_id");
  if (it == j.end()) return ids;
  for (const nlohmann::json& v : it->is_array() ? *it : nlohmann::json::array({*it}))
    if (v.is_number_integer()) ids.push_back(v.get<int32_t>());
  return ids;
}

// The length of the longest prefix of s that does not end inside a UTF-8 character: what can be
// printed while the rest of a character may still come with the next token.
size_t complete_utf8_prefix(const std::string& s) {
  const size_t n = s.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const unsigned char c = static_cast<unsigned char>(s[n - back]);
    if ((c & 0xC0) == 0x80) continue;  // a continuation byte: look further back
    const size_t need = c >= 0xF0 ? 4 : c >= 0xE0 ? 3 : c >= 0xC0 ? 2 : 1;
    return need > back ? n - back : n;
  }
  return n;
}

// The model and the chunk space its weights page through.
struct Runner {
  std::unique_ptr<Device> device;
  std::unique_ptr<IoEngine> io;  // with an nvme tier
  std::unique_ptr<PagedWeights> weights;
  std::unique_ptr<model::Model> model;
  ~Runner() {
    if (model) model->set_access(nullptr);
  }
};

Status make_runner(const Options& o, LoadedModel loaded, Runner* r) {
  const model::ParamLayout layout(loaded.config);
  const Precision precision = *parse_precision(o.precision);
  const DType compute = StateLayout::of(precision).compute_dtype();
  if (o.device == "cuda") {
#if STRATA_HAVE_CUDA
    if (Status st = model::cuda_supports(loaded.config, compute); !st.ok()) {
      return Status::Unimplemented("--device cuda cannot run this model (" + st.message() + "); use --device cpu");
    }
#else
    return Status::Unimplemented("this strata is built without CUDA; use --device cpu");
#endif
  }
  ASSIGN_OR_RETURN(r->device, open_device(o.device, 0, 0));
  PagedWeightsOptions po;
  po.precision = precision;
  // Without memory.device: three quarters of a capped device (a GPU's free memory), the rest
  // left to the KV cache and the activations; place_weights takes no more than the weights need,
  // and pages them when they need more.
  const uint64_t budget = r->device->memory_budget();
  if (o.memory_device > 0 && budget != Device::kUnlimited && o.memory_device > budget) {
    return Status::OutOfMemory("memory.device = " + format_bytes(o.memory_device) + " is more than the " + o.device +
                               " device has free (" + format_bytes(budget) + "); lower memory.device");
  }
  po.device_bytes = o.memory_device > 0 ? o.memory_device : budget == Device::kUnlimited ? UINT64_MAX / 2 : budget / 4 * 3;
  po.host_bytes = o.memory_host;
  po.nvme_bytes = o.nvme_size;
  po.nvme_dir = o.nvme_path;
  if (po.nvme_bytes > 0) {
    // As strata train does: the directory is made when missing.
    std::error_code ec;
    std::filesystem::create_directories(po.nvme_dir, ec);
    if (ec) return Status::IOError("cannot create memory.nvme.path " + po.nvme_dir + ": " + ec.message());
    ASSIGN_OR_RETURN(r->io, make_io_engine(IoEngineOptions{}));
  }
  ASSIGN_OR_RETURN(r->weights, PagedWeights::create(*r->device, r->io.get(), layout, po));
  RETURN_IF_ERROR(r->weights->load(loaded.params.data()));
  loaded.params = {};
  const WeightsPlacement& p = r->weights->placement();
  int in[kNumTiers] = {};
  for (Tier t : p.homes) ++in[static_cast<int>(t)];
  if (in[static_cast<int>(Tier::kDevice)] < static_cast<int>(p.homes.size())) {
    LOG_INFO("weights paged in chunks of {}: {} of {} groups on the device ({}), {} in host memory, {} on nvme",
             format_bytes(p.chunk_bytes), in[static_cast<int>(Tier::kDevice)], p.homes.size(),
             format_bytes(p.device_slots * p.chunk_bytes), in[static_cast<int>(Tier::kHost)],
             in[static_cast<int>(Tier::kNvme)]);
  }
  if (o.device == "cpu") {
    r->model = model::make_cpu_decoder(compute, loaded.config);
  } else {
#if STRATA_HAVE_CUDA
    ASSIGN_OR_RETURN(r->model, model::make_cuda_decoder(*r->device, loaded.config, compute));
#endif
  }
  r->model->set_access(r->weights.get());
  return Status::OK();
}

// The prompt's token ids, from --prompt or --chat.
Result<std::vector<int32_t>> encode_prompt(const Options& o, const model::Tokenizer& tok) {
  if (o.have_prompt) {
    model::EncodeOptions eo;
    eo.add_special_tokens = o.special_tokens;
    return tok.encode_all(o.prompt, eo, "--prompt");
  }
  if (!tok.chat_template()) {
    return Status::InvalidArgument("the tokenizer has no chat template (tokenizer_config.json chat_template or "
                                   "chat_template.jinja) to render --chat " + o.chat + "; use --prompt");
  }
  ASSIGN_OR_RETURN(nlohmann::ordered_json messages, read_chat(o.chat));
  // As apply_chat_template(add_generation_prompt=True, tokenize=True): the rendered text with
  // its added tokens parsed and nothing put around it.
  model::ChatRenderOptions ro;
  ro.add_generation_prompt = true;
  ASSIGN_OR_RETURN(std::string text, tok.chat_template()->render(messages, ro));
  return tok.encode_all(text, model::EncodeOptions{.add_special_tokens = false, .parse_special = true},
                        "--chat " + o.chat + " rendered");
}

int run(const Options& o) {
  Result<ModelSource> source = resolve_model_source(o.from);
  if (!source.ok()) return fail(source.status());
  // A model it cannot generate from is said before anything else is asked for.
  if (source->kind == ModelSource::Kind::kHuggingFace) {
    if (Result<model::ModelConfig> mc = model::load_hf_config(source->model_path); mc.ok()) {
      if (Status st = mc->check_generation(); !st.ok()) return fail(st);
    }
  }
  std::string tokenizer_dir = o.tokenizer.empty() ? source->tokenizer_dir : o.tokenizer;
  if (tokenizer_dir.empty()) {
    return fail(Status::InvalidArgument("no tokenizer for " + o.from + ": " + source->tokenizer_note +
                                        "; pass --tokenizer DIR (a Hugging Face tokenizer directory: tokenizer.json, "
                                        "tokenizer_config.json)"));
  }
  Result<model::Tokenizer> tok = model::Tokenizer::load(tokenizer_dir);
  if (!tok.ok()) return fail(tok.status().with_context("--tokenizer " + tokenizer_dir));
  Result<std::vector<int32_t>> prompt = encode_prompt(o, *tok);
  if (!prompt.ok()) return fail(prompt.status());
  if (prompt->empty()) return fail(Status::InvalidArgument("the prompt encodes to no tokens; give some text"));

  Result<LoadedModel> loaded = source->kind == ModelSource::Kind::kHuggingFace
                                   ? load_hf_model(source->model_path)
                                   : load_checkpoint(source->model_path);
  if (!loaded.ok()) return fail(loaded.status());
  const model::ModelConfig config = loaded->config;
  const int64_t P = static_cast<int64_t>(prompt->size());
  for (int32_t id : *prompt) {
    if (id >= config.vocab_size) {
      return fail(Status::InvalidArgument("the tokenizer " + tokenizer_dir + " gives token " + std::to_string(id) +
                                          ", outside the model's vocabulary of " +
                                          std::to_string(config.vocab_size) + ": not this model's tokenizer?"));
    }
  }
  const int64_t context = config.max_position_embeddings;
  if (P > context) {
    return fail(Status::InvalidArgument("the prompt (" + std::to_string(P) +
                                        " tokens) is longer than the model's max_position_embeddings (" +
                                        std::to_string(context) + "); shorten it"));
  }
  model::GenerateOptions go = o.generate;
  if (!o.max_new_given) go.max_new_tokens = std::min(go.max_new_tokens, context - P + 1);
  if (P + go.max_new_tokens - 1 > context) {
    return fail(Status::InvalidArgument(
        "the prompt (" + std::to_string(P) + " tokens) and --max-new-tokens " +
        std::to_string(go.max_new_tokens) + " run past the model's max_position_embeddings (" +
        std::to_string(config.max_position_embeddings) + "); ask for fewer new tokens or shorten the prompt"));
  }
  Runner runner;
  if (Status st = make_runner(o, std::move(*loaded), &runner); !st.ok()) return fail(st);

  if (!o.ignore_eos) {
    if (tok->eos_id() >= 0) go.stop_ids.push_back(tok->eos_id());
    // generation_config.json beside the weights, or beside the tokenizer (the model a run
    // started from).
    const std::string config_dir =
        source->kind == ModelSource::Kind::kHuggingFace ? source->model_path : tokenizer_dir;
    for (int32_t id : generation_config_eos(config_dir)) go.stop_ids.push_back(id);
  }
  LOG_INFO("generating up to {} tokens after a prompt of {} on {} ({}), {}", go.max_new_tokens, P, o.device,
           o.precision,
           go.sampling.temperature == 0 ? std::string("greedy")
                                        : fmt::format("temperature {}, top-p {}, seed {}", go.sampling.temperature,
                                                      go.sampling.top_p, go.sampling.seed));
  // Streams the text of the new tokens: the whole of it decoded again each time (a tokenizer's
  // decoding of a token can depend on the ones before), printed from where the last print ended.
  std::vector<int32_t> shown;
  size_t printed = 0;
  const auto start = std::chrono::steady_clock::now();
  auto on_token = [&](int32_t token) {
    if (std::find(go.stop_ids.begin(), go.stop_ids.end(), token) != go.stop_ids.end()) return true;
    shown.push_back(token);
    const std::string text = tok->decode(shown);
    const size_t end = complete_utf8_prefix(text);
    if (end > printed) {
      std::fwrite(text.data() + printed, 1, end - printed, stdout);
      std::fflush(stdout);
      printed = end;
    }
    return true;
  };
  Result<std::vector<int32_t>> out = model::generate(*runner.model, *prompt, go, on_token);
  const std::string text = tok->decode(shown);
  if (text.size() > printed) std::fwrite(text.data() + printed, 1, text.size() - printed, stdout);
  std::fputc('\n', stdout);
  std::fflush(stdout);
  if (!out.ok()) return fail(out.status());
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  LOG_INFO("{} new tokens in {:.2f} s ({:.1f} tokens/s){}", out->size(), seconds,
           static_cast<double>(out->size()) / std::max(seconds, 1e-9),
           !out->empty() && std::find(go.stop_ids.begin(), go.stop_ids.end(), out->back()) != go.stop_ids.end()
               ? ", stopped at end-of-sequence"
               : "");
  return 0;
}

}  // namespace

int generate_command(const std::vector<std::string>& args) {
  for (const std::string& a : args) {
    if (a == "--help" || a == "-h") {
      std::fputs(kGenerateUsage, stdout);
      return 0;
    }
  }
  if (args.empty()) {
    std::fputs(kGenerateUsage, stderr);
    return 2;
  }
  Options o;
  if (const std::string error = parse_args(args, &o); !error.empty()) return usage_error(error);
  return run(o);
}

}  // namespace strata::tools
