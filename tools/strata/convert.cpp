// strata convert --from SRC --to DST [--dtype auto|f32|bf16|f16] [--shard-size 5GB] [--merge]
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/log.h"
#include "core/units.h"
#include "model/hf_io.h"
#include "model/params.h"
#include "model/peft_io.h"
#include "tools/strata/commands.h"
#include "tools/strata/model_source.h"

namespace strata::tools {
namespace {

constexpr const char* kConvertUsage = R"(Usage: strata convert --from SRC --to DST [--dtype auto|f32|bf16|f16] [--shard-size 5GB]
                      [--merge] [--allow-nonfinite]

Reads a Hugging Face model directory (config.json plus model.safetensors or sharded
model-*.safetensors with model.safetensors.index.json) and writes it again as a Hugging Face
directory: to change the weights' dtype or reshard. Tokenizer files are copied along.

SRC may also be a strata checkpoint: a checkpoint directory (RUN/checkpoints, holding `latest`),
its `latest` file, or one step-N directory. Its checksums are verified, the model's config comes
from the manifest's model_config and the parameters are exported (optimizer state is not). It is
checked as a resume checks it first: the manifest's fields, every tensor the config implies with
exactly its shape, and no tensor the config lacks.

A checkpoint of a LoRA run (train.method=lora) holds the adapters; the frozen base is read from
the model the run started from (the manifest records its path and a fingerprint of its tensors).
DST is then a PEFT adapter directory (adapter_config.json, adapter_model.safetensors), or with
--merge the base with the adapters merged into its weights, a plain Hugging Face model.

Weights holding NaN or Inf are refused, naming the first such tensor, unless --allow-nonfinite.

Options:
  --from SRC         Hugging Face model directory or strata checkpoint to read
  --to DST           directory to write; must not exist or be empty (written to DST.tmp, then renamed)
  --dtype D          f32, bf16 or f16 (bf16 and f16 round to nearest even), or auto (the default):
                     the source's precision. For a Hugging Face SRC the narrowest of the three
                     that holds its tensors exactly (a bf16 model stays bf16; config.json's
                     torch_dtype decides for FP8 weights); for a checkpoint the precision of the
                     weights its run started from (the manifest's model_config torch_dtype; f32
                     when it names none). The export's config.json torch_dtype says which.
  --shard-size S     largest shard, e.g. 5GB (the default, as transformers), 500MB, 2GiB
  --merge            a LoRA checkpoint: write the merged model instead of the adapter
  --allow-nonfinite  write weights that hold NaN or Inf (to inspect a diverged run)
  -h, --help         this text
)";

int usage_error(const std::string& message) {
  std::fprintf(stderr, "strata convert: error: %s (see strata convert --help)\n", message.c_str());
  return 2;
}

int fail(const Status& st) {
  std::fprintf(stderr, "strata convert: error: %s\n", st.message().c_str());
  return 1;
}

}  // namespace

int convert_command(const std::vector<std::string>& args) {
  std::string from, to, dtype, shard_size;
  bool allow_nonfinite = false, merge = false;
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& a = args[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kConvertUsage, stdout);
      return 0;
    }
    if (a == "--allow-nonfinite") {
      allow_nonfinite = true;
      continue;
    }
    if (a == "--merge") {
      merge = true;
      continue;
    }
    std::string* target = a == "--from" ? &from : a == "--to" ? &to : a == "--dtype" ? &dtype
                        : a == "--shard-size" ? &shard_size : nullptr;
    if (target == nullptr) return usage_error("unknown argument '" + a + "'");
    if (i + 1 >= args.size()) return usage_error(a + " needs a value");
    *target = args[++i];
  }
  if (from.empty() || to.empty()) return usage_error("--from and --to are required");
  if (dtype.empty()) dtype = "auto";
  if (dtype != "auto" && !model::parse_export_dtype(dtype)) {
    return usage_error("--dtype is '" + dtype + "'; choose auto, f32, bf16 or f16");
  }
  model::ExportOptions eo;
  if (!shard_size.empty()) {
    Result<uint64_t> bytes = parse_bytes(shard_size);
    if (!bytes.ok()) return usage_error("--shard-size: " + bytes.status().message());
    if (*bytes == 0) return usage_error("--shard-size must be positive");
    eo.max_shard_bytes = *bytes;
  }
  init_logging(LogOptions{});

  const bool from_checkpoint = looks_like_checkpoint(from);
  if (!from_checkpoint && !model::is_hf_directory(from)) {
    return fail(Status::InvalidArgument(from + ": not a Hugging Face directory (no config.json) nor a strata "
                                        "checkpoint (no latest or manifest.json); pass a model directory, "
                                        "a checkpoint directory such as RUN/checkpoints, or a step-N directory"));
  }
  std::error_code ec;
  if (std::filesystem::exists(to, ec) && !std::filesystem::is_empty(to, ec)) {
    return fail(Status::InvalidArgument(to + " exists and is not empty; choose a new --to directory"));
  }

  model::ModelConfig config;
  std::vector<float> params;
  std::vector<float> selection_bias;  // DeepSeek-V3's routers' (model/hf_io.h)
  if (from_checkpoint) {
    Result<LoadedModel> loaded = load_checkpoint(from);
    if (!loaded.ok()) return fail(loaded.status());
    config = std::move(loaded->config);
    params = std::move(loaded->params);
    selection_bias = std::move(loaded->selection_bias);
    if (dtype == "auto") dtype = model::export_dtype_name(loaded->source_dtype);
  } else {
    Result<nlohmann::json> source_json = model::read_hf_config_json(from);
    if (!source_json.ok()) return fail(source_json.status());
    Result<model::ModelConfig> hf_config = model::load_hf_config(from);
    if (!hf_config.ok()) return fail(hf_config.status());
    config = *hf_config;
    eo.copy_tokenizer_from = from;
    const model::ParamLayout layout(config);
    // The weights' names, shapes and dtypes (from the safetensors headers) are checked against
    // the config before the model's memory is allocated.
    Result<model::SafetensorsReader> reader = model::open_hf_weights(from, layout);
    if (!reader.ok()) return fail(reader.status());
    if (dtype == "auto") dtype = model::export_dtype_name(model::hf_source_dtype(*reader, layout, *source_json));
    params.assign(static_cast<size_t>(layout.total_size()), 0.0f);
    LOG_INFO("reading {} ({} parameters, {} in fp32)", from, layout.num_parameters(),
             format_bytes(static_cast<uint64_t>(layout.total_size()) * sizeof(float)));
    Status st = model::read_hf_weights(*reader, layout, params.data());
    if (!st.ok()) return fail(st);
    st = model::read_hf_selection_bias(*reader, config, &selection_bias);
    if (!st.ok()) return fail(st);
  }
  eo.dtype = *model::parse_export_dtype(dtype);

  eo.allow_nonfinite = allow_nonfinite;
  eo.selection_bias = &selection_bias;
  const model::ParamLayout layout(config);
  if (merge && !layout.has_lora())
    return usage_error("--merge merges LoRA adapters; " + from + " holds a model without them");
  if (layout.has_lora() && !merge) {
    auto read = [&params](const model::TensorSpec& t, float* out) {
      std::copy_n(params.data() + t.offset, t.numel, out);
      return Status::OK();
    };
    Status st = model::export_peft_adapter(to, layout, read, {.dtype = eo.dtype});
    if (!st.ok()) return fail(st);
    LOG_INFO("wrote the LoRA adapter to {} ({}; --merge writes the merged model)", to, dtype);
    return 0;
  }
  if (layout.has_lora()) {
    for (const model::TensorSpec& t : layout.tensors()) {
      const model::LoraOffsets* lo = layout.lora_of(t.offset);
      if (lo == nullptr) continue;
      model::merge_lora(params.data() + t.offset, params.data() + lo->a, params.data() + lo->b, t.shape[0], t.shape[1],
                        config.lora.rank, config.lora.scale());
    }
  }
  Status st = model::export_hf(to, config, layout, params.data(), eo);
  if (!st.ok()) return fail(st);
  LOG_INFO("wrote {} ({}, shards of at most {})", to, dtype, format_bytes(eo.max_shard_bytes));
  return 0;
}

}  // namespace strata::tools
