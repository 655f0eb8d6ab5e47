// strata convert --from SRC --to DST [--dtype f32|bf16] [--shard-size 5GB]
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "core/log.h"
#include "core/units.h"
#include "model/hf_io.h"
#include "model/params.h"
#include "tools/strata/commands.h"

namespace strata::tools {
namespace {

constexpr const char* kConvertUsage = R"(Usage: strata convert --from SRC --to DST [--dtype f32|bf16] [--shard-size 5GB]

Reads a Hugging Face model directory (config.json plus model.safetensors or sharded
model-*.safetensors with model.safetensors.index.json) and writes it again as a Hugging Face
directory: to change the weights' dtype or reshard. Tokenizer files are copied along.

Options:
  --from SRC         Hugging Face model directory to read
  --to DST           directory to write; must not exist or be empty (written to DST.tmp, then renamed)
  --dtype D          f32 or bf16 (bf16 rounds to nearest even); default: bf16 when SRC's config.json
                     says torch_dtype bfloat16, f32 otherwise
  --shard-size S     largest shard, e.g. 5GB (the default, as transformers), 500MB, 2GiB
  -h, --help         this text
)";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "strata convert: %s (see strata convert --help)\n", message.c_str());
  return 2;
}

int fail(const Status& st) {
  std::fprintf(stderr, "strata convert: error: %s\n", st.message().c_str());
  return 1;
}

}  // namespace

int convert_command(const std::vector<std::string>& args) {
  std::string from, to, dtype, shard_size;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kConvertUsage, stdout);
      return 0;
    }
    std::string* target = a == "--from" ? &from : a == "--to" ? &to : a == "--dtype" ? &dtype
                        : a == "--shard-size" ? &shard_size : nullptr;
    if (target == nullptr) return usage_error("unknown argument '" + a + "'");
    if (i + 1 >= args.size()) return usage_error(a + " needs a value");
    *target = args[++i];
  }
  if (from.empty() || to.empty()) return usage_error("--from and --to are required");
  if (!dtype.empty() && dtype != "f32" && dtype != "bf16") {
    return usage_error("--dtype is '" + dtype + "'; choose f32 or bf16");
  }
  model::ExportOptions eo;
  if (!shard_size.empty()) {
    Result<uint64_t> bytes = parse_bytes(shard_size);
    if (!bytes.ok()) return usage_error("--shard-size: " + bytes.status().message());
    if (*bytes == 0) return usage_error("--shard-size must be positive");
    eo.max_shard_bytes = *bytes;
  }
  init_logging(LogOptions{});

  if (!model::is_hf_directory(from)) {
    return fail(Status::InvalidArgument(from + ": not a Hugging Face directory (no config.json)"));
  }
  std::error_code ec;
  if (std::filesystem::exists(to, ec) && !std::filesystem::is_empty(to, ec)) {
    return fail(Status::InvalidArgument(to + " exists and is not empty; choose a new --to directory"));
  }
  Result<nlohmann::json> source_json = model::read_hf_config_json(from);
  if (!source_json.ok()) return fail(source_json.status());
  Result<model::ModelConfig> config = model::load_hf_config(from);
  if (!config.ok()) return fail(config.status());
  if (dtype.empty()) {
    const auto it = source_json->find("torch_dtype");
    dtype = it != source_json->end() && *it == "bfloat16" ? "bf16" : "f32";
  }
  eo.dtype = dtype == "bf16" ? model::SafetensorsWriteDtype::kBF16 : model::SafetensorsWriteDtype::kF32;
  eo.copy_tokenizer_from = from;

  const model::ParamLayout layout(*config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.0f);
  LOG_INFO("reading {} ({} parameters, {} in fp32)", from, layout.num_parameters(),
           format_bytes(static_cast<uint64_t>(layout.total_size()) * sizeof(float)));
  Status st = model::load_hf_weights(from, layout, params.data());
  if (!st.ok()) return fail(st);
  st = model::export_hf(to, *config, layout, params.data(), eo);
  if (!st.ok()) return fail(st);
  LOG_INFO("wrote {} ({}, shards of at most {})", to, dtype, format_bytes(eo.max_shard_bytes));
  return 0;
}

}  // namespace strata::tools
