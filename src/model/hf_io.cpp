#include "model/hf_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <xxhash.h>
#include <fmt/ranges.h>

#include "ckpt/finite.h"
#include "kernels/fp8.h"
#include "core/atomic_file.h"
#include "core/check.h"
#include "core/log.h"
#include "core/progress.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// Extra tensors named in the warning of load_hf_weights.
constexpr size_t kExtraTensorsNamed = 5;

std::string shape_text(const std::vector<int64_t>& shape) { return fmt::format("[{}]", fmt::join(shape, ", ")); }

// model_type transformers expects for each architecture strata writes.
const char* model_type_of(const std::string& architecture) {
  if (architecture == "LlamaForCausalLM") return "llama";
  if (architecture == "MistralForCausalLM") return "mistral";
  if (architecture == "Qwen2ForCausalLM") return "qwen2";
  return nullptr;
}

Result<std::string> read_text_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::NotFound(fmt::format("cannot open {}", path));
  std::stringstream text;
  text << in.rdbuf();
  if (in.bad()) return Status::IOError(fmt::format("reading {} failed", path));
  return text.str();
}

std::string without_trailing_slashes(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return path;
}

void fsync_path(const std::string& path, bool directory) {
  const int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

const std::vector<std::string>& hf_tokenizer_files() {
  static const std::vector<std::string> files = {
      "tokenizer.json",      "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
      "tokenizer.model",     "vocab.json",            "merges.txt",              "added_tokens.json",
      "chat_template.jinja", "chat_template.json",
  };
  return files;
}

std::optional<SafetensorsWriteDtype> parse_export_dtype(std::string_view name) {
  if (name == "f32") return SafetensorsWriteDtype::kF32;
  if (name == "bf16") return SafetensorsWriteDtype::kBF16;
  if (name == "f16") return SafetensorsWriteDtype::kF16;
  return std::nullopt;
}

const char* export_dtype_name(SafetensorsWriteDtype dtype) {
  switch (dtype) {
    case SafetensorsWriteDtype::kF32: return "f32";
    case SafetensorsWriteDtype::kBF16: return "bf16";
    case SafetensorsWriteDtype::kF16: return "f16";
  }
  CHECK_MSG(false, "unknown SafetensorsWriteDtype");
  return "";
}

std::optional<SafetensorsWriteDtype> parse_torch_dtype(std::string_view torch_dtype) {
  if (torch_dtype == "float32") return SafetensorsWriteDtype::kF32;
  if (torch_dtype == "bfloat16") return SafetensorsWriteDtype::kBF16;
  if (torch_dtype == "float16") return SafetensorsWriteDtype::kF16;
  return std::nullopt;
}

const char* torch_dtype_name(SafetensorsWriteDtype dtype) {
  switch (dtype) {
    case SafetensorsWriteDtype::kF32: return "float32";
    case SafetensorsWriteDtype::kBF16: return "bfloat16";
    case SafetensorsWriteDtype::kF16: return "float16";
  }
  CHECK_MSG(false, "unknown SafetensorsWriteDtype");
  return "";
}

SafetensorsWriteDtype hf_source_dtype(const SafetensorsReader& reader, const ParamLayout& layout,
                                      const json& config_json) {
  // Which of bf16 and f16 hold every tensor exactly (f32 always does).
  bool bf16 = true, f16 = true;
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts >= 0) continue;  // LoRA adapters are not the base's
    const SafetensorsTensorInfo* info = reader.find(t.name);
    CHECK_MSG(info != nullptr, "hf_source_dtype: tensor " + t.name + " is not in the checkpoint");
    const bool fp8 = info->dtype == "F8_E4M3" || info->dtype == "F8_E5M2";  // exact in both
    bf16 &= info->dtype == "BF16" || fp8;
    f16 &= info->dtype == "F16" || fp8;
  }
  if (bf16 && f16) {
    std::optional<SafetensorsWriteDtype> named;
    for (const char* key : {"torch_dtype", "dtype"}) {
      const auto it = config_json.find(key);
      if (!named && it != config_json.end() && it->is_string()) named = parse_torch_dtype(it->get<std::string>());
    }
    return named.value_or(SafetensorsWriteDtype::kBF16);
  }
  if (bf16) return SafetensorsWriteDtype::kBF16;
  if (f16) return SafetensorsWriteDtype::kF16;
  return SafetensorsWriteDtype::kF32;
}

std::string frozen_tensors_fingerprint(const SafetensorsReader& reader, const ParamLayout& layout) {
  XXH3_state_t* h = XXH3_createState();
  XXH3_64bits_reset(h);
  for (const TensorSpec& spec : layout.tensors()) {
    const SafetensorsTensorInfo* info = spec.frozen ? reader.find(spec.name) : nullptr;
    if (info == nullptr) continue;
    const std::string line =
        fmt::format("{} {} [{}] {}\n", info->name, info->dtype, fmt::join(info->shape, ","), info->nbytes);
    XXH3_64bits_update(h, line.data(), line.size());
  }
  const std::string out = fmt::format("{:016x}", XXH3_64bits_digest(h));
  XXH3_freeState(h);
  return out;
}

bool is_hf_directory(const std::string& dir) {
  std::error_code ec;
  return fs::is_directory(dir, ec) && fs::is_regular_file(fs::path(dir) / "config.json", ec);
}

Result<json> read_hf_config_json(const std::string& dir) {
  if (!is_hf_directory(dir)) {
    return Status::NotFound(fmt::format("{}: not a Hugging Face directory (no config.json)", dir));
  }
  const std::string path = (fs::path(dir) / "config.json").string();
  ASSIGN_OR_RETURN(std::string text, read_text_file(path));
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Status::InvalidArgument(fmt::format("{}: not a JSON object", path));
  const auto type = j.find("model_type");
  if (type != j.end() && type->is_string() && type->get<std::string>() == "qwen2" && !j.contains("attention_bias")) {
    j["attention_bias"] = true;  // Qwen2 has q/k/v biases without saying so
  }
  return j;
}

Result<ModelConfig> load_hf_config(const std::string& dir) {
  ASSIGN_OR_RETURN(json j, read_hf_config_json(dir));
  return ModelConfig::from_json(j, (fs::path(dir) / "config.json").string());
}

Status load_hf_weights(const std::string& dir_or_file, const ParamLayout& layout, float* params,
                       const ReaderOptions& options) {
  ASSIGN_OR_RETURN(SafetensorsReader reader, open_hf_weights(dir_or_file, layout, options));
  return read_hf_weights(reader, layout, params);
}

std::string block_scale_name(std::string_view weight_name) { return std::string(weight_name) + "_scale_inv"; }

namespace {

constexpr int64_t kScaleBlock = 128;  // DeepSeek-V3's weight_block_size

// Whether `info`, a layout tensor's entry, is an FP8 weight with block scales beside it, checked:
// InvalidArgument naming the scales when their shape or dtype is not what the weight needs.
Result<bool> has_block_scales(const SafetensorsReader& reader, const TensorSpec& t,
                              const SafetensorsTensorInfo& info) {
  const SafetensorsTensorInfo* scales = reader.find(block_scale_name(t.name));
  if (scales == nullptr) {
    // FP8 weights with scales of another convention (a per-tensor weight_scale) would load unscaled.
    if (const SafetensorsTensorInfo* other = reader.find(t.name + "_scale");
        other != nullptr && info.dtype.starts_with("F8_"))
      return Status::Unimplemented(fmt::format("{}: tensor '{}' is {} with scales '{}'; strata reads FP8 weights with "
                                               "128 x 128 block scales named NAME_scale_inv (DeepSeek-V3's) only",
                                               info.file, t.name, info.dtype, other->name));
    return false;
  }
  if (info.dtype != "F8_E4M3" || t.shape.size() != 2)
    return Status::InvalidArgument(fmt::format("{}: tensor '{}' has block scales '{}' but is {} of {} dims; strata "
                                               "dequantises F8_E4M3 matrices only",
                                               info.file, t.name, scales->name, info.dtype, t.shape.size()));
  const std::vector<int64_t> expected = {(t.shape[0] + kScaleBlock - 1) / kScaleBlock,
                                         (t.shape[1] + kScaleBlock - 1) / kScaleBlock};
  if (scales->shape != expected || !(scales->dtype == "F32" || scales->dtype == "BF16"))
    return Status::InvalidArgument(fmt::format(
        "{}: block scales '{}' are {} {}; weight '{}' of shape {} needs {} F32 scales, one per 128 x 128 block "
        "(quantization_config.weight_block_size [128, 128])",
        scales->file, scales->name, scales->dtype, shape_text(scales->shape), t.name, shape_text(t.shape),
        shape_text(expected)));
  return true;
}

}  // namespace

Status read_hf_tensor(const SafetensorsReader& reader, const TensorSpec& t, float* out) {
  const SafetensorsTensorInfo* info = reader.find(t.name);
  if (info == nullptr) return reader.read_f32(t.name, out);  // its NotFound
  ASSIGN_OR_RETURN(bool scaled, has_block_scales(reader, t, *info));
  if (!scaled) return reader.read_f32(t.name, out);
  const int64_t rows = t.shape[0], cols = t.shape[1];
  const int64_t block_cols = (cols + kScaleBlock - 1) / kScaleBlock;
  std::vector<uint8_t> bytes(static_cast<size_t>(rows * cols));
  std::vector<float> scales(static_cast<size_t>(((rows + kScaleBlock - 1) / kScaleBlock) * block_cols));
  RETURN_IF_ERROR(reader.read_raw(t.name, bytes.data()));
  RETURN_IF_ERROR(reader.read_f32(block_scale_name(t.name), scales.data()));
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = scales.data() + (r / kScaleBlock) * block_cols;
    for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = kernels::e4m3_to_f32(bytes[static_cast<size_t>(r * cols + c)]) * s[c / kScaleBlock];
  }
  return Status::OK();
}

Result<bool> read_hf_fp8_copy(const SafetensorsReader& reader, const TensorSpec& t, uint8_t* copy) {
  const SafetensorsTensorInfo* info = reader.find(t.name);
  if (info == nullptr) return false;
  ASSIGN_OR_RETURN(bool scaled, has_block_scales(reader, t, *info));
  if (!scaled) return false;
  static_assert(kScaleBlock == kernels::kFp8Block, "the checkpoint's blocks are the recipe's");
  const int64_t rows = t.shape[0], cols = t.shape[1];
  RETURN_IF_ERROR(reader.read_raw(t.name, copy));
  RETURN_IF_ERROR(reader.read_f32(block_scale_name(t.name),
                                  reinterpret_cast<float*>(copy + kernels::fp8_matrix_scale_offset(rows, cols))));
  return true;
}

Status read_hf_weights(const SafetensorsReader& reader, const ParamLayout& layout, float* params) {
  uint64_t total = 0;
  for (const TensorSpec& t : layout.tensors())
    if (t.adapts < 0) total += static_cast<uint64_t>(reader.find(t.name)->nbytes);
  Progress progress("loading weights from " + reader.path(), total);
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts >= 0) continue;
    RETURN_IF_ERROR(read_hf_tensor(reader, t, params + t.offset));
    progress.add(static_cast<uint64_t>(reader.find(t.name)->nbytes));
  }
  return Status::OK();
}

Result<SafetensorsReader> open_hf_weights(const std::string& dir_or_file, const ParamLayout& layout,
                                          const ReaderOptions& options) {
  ASSIGN_OR_RETURN(SafetensorsReader reader, SafetensorsReader::open(dir_or_file, options));
  const bool tied = layout.lm_head() == layout.embed_tokens();

  // Check everything before reading, so that a bad checkpoint leaves params untouched.
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts >= 0) continue;  // LoRA adapters are not the base's
    const SafetensorsTensorInfo* info = reader.find(t.name);
    if (info == nullptr) {
      std::string hint;
      if (t.name == "lm_head.weight") hint = " (the config has tie_word_embeddings false, so it is needed)";
      return Status::NotFound(fmt::format("{}: tensor '{}' of shape {} is missing{}", dir_or_file, t.name,
                                          shape_text(t.shape), hint));
    }
    if (info->shape != t.shape) {
      return Status::InvalidArgument(fmt::format("{}: tensor '{}' has shape {}, the model config expects {}",
                                                 info->file, t.name, shape_text(info->shape), shape_text(t.shape)));
    }
    if (Result<bool> scaled = has_block_scales(reader, t, *info); !scaled.ok()) return scaled.status();
    if (!safetensors_dtype_readable(info->dtype)) {
      return Status::Unimplemented(fmt::format("{}: tensor '{}' has dtype {}; strata reads F32, BF16, F16, "
                                               "F8_E4M3 and F8_E5M2",
                                               info->file, t.name, info->dtype));
    }
  }
  std::vector<std::string> extra;
  for (const SafetensorsTensorInfo& info : reader.tensors()) {
    if (layout.find(info.name) != nullptr) continue;
    if (info.name.ends_with("rotary_emb.inv_freq")) continue;  // a buffer older transformers saved
    if (tied && info.name == "lm_head.weight") continue;       // a copy of the tied embeddings
    if (layout.config().router_selection_bias && info.name.ends_with("mlp.gate.e_score_correction_bias"))
      continue;  // read_hf_selection_bias's
    if (info.name.ends_with("_scale_inv") && layout.find(info.name.substr(0, info.name.size() - 10)) != nullptr)
      continue;  // a weight's block scales (read_hf_tensor)
    if (is_mtp_shared_copy(layout.config(), info.name)) continue;  // the module's copies of shared tensors
    extra.push_back(info.name);
  }
  if (!extra.empty()) {
    const size_t named = std::min(extra.size(), kExtraTensorsNamed);
    LOG_WARN("{}: {} tensor(s) the model does not use are ignored: {}{}", dir_or_file, extra.size(),
             fmt::join(extra.begin(), extra.begin() + static_cast<std::ptrdiff_t>(named), ", "),
             extra.size() > named ? ", ..." : "");
  }
  return reader;
}

std::vector<std::pair<std::string, int64_t>> mtp_shared_copies(const ParamLayout& layout) {
  std::vector<std::pair<std::string, int64_t>> out;
  const ModelConfig& c = layout.config();
  for (int64_t b = c.num_hidden_layers; b < c.num_blocks(); ++b) {
    out.emplace_back(fmt::format("model.layers.{}.embed_tokens.weight", b), layout.embed_tokens());
    out.emplace_back(fmt::format("model.layers.{}.shared_head.head.weight", b), layout.lm_head());
  }
  return out;
}

bool is_mtp_shared_copy(const ModelConfig& config, std::string_view name) {
  for (int64_t b = config.num_hidden_layers; b < config.num_blocks(); ++b) {
    if (name == fmt::format("model.layers.{}.embed_tokens.weight", b) ||
        name == fmt::format("model.layers.{}.shared_head.head.weight", b))
      return true;
  }
  return false;
}

std::string selection_bias_name(int64_t layer) {
  return fmt::format("model.layers.{}.mlp.gate.e_score_correction_bias", layer);
}

Status read_hf_selection_bias(const SafetensorsReader& reader, const ModelConfig& config, std::vector<float>* bias) {
  if (!config.router_selection_bias || !config.is_moe()) return Status::OK();
  const int64_t E = config.num_experts;
  std::vector<float> read(static_cast<size_t>(config.num_blocks() * E), 0.0f);
  for (int64_t l = 0; l < config.num_blocks(); ++l) {
    if (!config.is_moe_layer(l)) continue;
    const std::string name = selection_bias_name(l);
    if (reader.find(name) == nullptr)
      return Status::NotFound(fmt::format("tensor '{}' of shape [{}] is missing (topk_method noaux_tc routes "
                                          "by it)",
                                          name, E));
    RETURN_IF_ERROR(reader.read_f32(name, {E}, read.data() + l * E));
  }
  *bias = std::move(read);
  return Status::OK();
}

Status check_export_target(const std::string& out_dir, const std::string& marker) {
  std::error_code ec;
  const fs::path dir(without_trailing_slashes(out_dir));
  if (out_dir.empty()) return Status::InvalidArgument("the export directory is empty; name one");
  if (!fs::exists(dir, ec)) return Status::OK();
  if (!fs::is_directory(dir, ec)) {
    return Status::InvalidArgument(fmt::format("export target {} exists and is not a directory", dir.string()));
  }
  if (fs::is_empty(dir, ec) || fs::exists(dir / marker, ec)) return Status::OK();
  return Status::InvalidArgument(fmt::format(
      "export target {} is a non-empty directory without {}; refusing to replace it (choose a new "
      "directory)",
      dir.string(), marker));
}

Status export_hf(const std::string& out_dir, const ModelConfig& config, const ParamLayout& layout,
                 const float* params, const ExportOptions& options) {
  return export_hf(out_dir, config, layout,
                   [params](const TensorSpec& t, float* out) {
                     std::copy_n(params + t.offset, t.numel, out);
                     return Status::OK();
                   },
                   options);
}

Status write_export_dir(const std::string& out_dir, const std::string& marker,
                        const std::function<Status(const std::string& tmp)>& fill) {
  RETURN_IF_ERROR(check_export_target(out_dir, marker));
  std::error_code ec;
  const fs::path dir(without_trailing_slashes(out_dir));
  const fs::path tmp = dir.string() + ".tmp";
  const fs::path old = dir.string() + ".old";
  fs::remove_all(tmp, ec);  // left by an export that crashed
  // Whatever fails below (a full disk, a read error), no partial DST.tmp stays behind; after the
  // final rename there is no DST.tmp to remove.
  struct RemoveTmp {
    fs::path path;
    ~RemoveTmp() {
      std::error_code ignored;
      fs::remove_all(path, ignored);
    }
  } remove_tmp{tmp};
  fs::create_directories(tmp, ec);
  if (ec) return Status::IOError(fmt::format("cannot create {}: {}", tmp.string(), ec.message()));
  RETURN_IF_ERROR(fill(tmp.string()));
  fsync_path(tmp.string(), /*directory=*/true);

  // Swap the finished export in; a previous one is removed only after the rename.
  const bool replace = fs::exists(dir, ec);
  if (replace) {
    fs::remove_all(old, ec);
    fs::rename(dir, old, ec);
    if (ec) return Status::IOError(fmt::format("cannot move the previous export {} aside: {}", dir.string(), ec.message()));
  }
  fs::rename(tmp, dir, ec);
  if (ec) {
    const std::string why = ec.message();
    if (replace) fs::rename(old, dir, ec);  // the previous export goes back where it was
    return Status::IOError(fmt::format("cannot rename {} to {}: {}", tmp.string(), dir.string(), why));
  }
  if (replace) fs::remove_all(old, ec);
  fsync_path(dir.parent_path().empty() ? "." : dir.parent_path().string(), /*directory=*/true);
  return Status::OK();
}

Status export_hf(const std::string& out_dir, const ModelConfig& config, const ParamLayout& layout,
                 const TensorReader& read, const ExportOptions& options) {
  const fs::path dir(without_trailing_slashes(out_dir));
  return write_export_dir(out_dir, "config.json", [&](const std::string& tmp_dir) -> Status {
  const fs::path tmp(tmp_dir);
  std::error_code ec;
  // config.json
  json j = config.to_json();
  if (const char* type = model_type_of(config.architecture)) j["model_type"] = type;
  j["torch_dtype"] = torch_dtype_name(options.dtype);
  if (!options.copy_tokenizer_from.empty() && is_hf_directory(options.copy_tokenizer_from)) {
    // Special token ids live in config.json too; keep the source's.
    Result<json> source = read_hf_config_json(options.copy_tokenizer_from);
    if (source.ok()) {
      for (const char* key : {"bos_token_id", "eos_token_id", "pad_token_id"}) {
        if (source->contains(key) && !j.contains(key)) j[key] = (*source)[key];
      }
      // A model transformers loads through its own published code (DeepSeek's auto_map and
      // modeling_*.py, trust_remote_code) keeps it: the map here, its files below.
      if (const auto it = source->find("auto_map"); it != source->end() && it->is_object()) j["auto_map"] = *it;
    }
  }
  RETURN_IF_ERROR(write_file_atomic((tmp / "config.json").string(), j.dump(2) + "\n"));

  // Weights, in layout order (first use), like transformers' state dict.
  std::vector<SafetensorsWriteTensor> tensors;
  for (const TensorSpec& t : layout.tensors()) {
    if (t.adapts >= 0) continue;  // the base's tensors only (a merged export reads them merged)
    tensors.push_back({t.name, t.shape, nullptr, [&read, &t, &options](float* out) {
                         RETURN_IF_ERROR(read(t, out));
                         if (options.allow_nonfinite) return Status::OK();
                         const uint64_t bad =
                             ckpt::count_non_finite(DType::kF32, out, static_cast<uint64_t>(t.numel));
                         if (bad == 0) return Status::OK();
                         return Status::InvalidArgument(fmt::format(
                             "tensor '{}' holds {} NaN or Inf values of {}: the weights are of a diverged run and "
                             "would export as such; export an earlier checkpoint, or allow it explicitly "
                             "(strata convert --allow-nonfinite)",
                             t.name, bad, t.numel));
                       }});
  }
  // DeepSeek-V3's selection biases, after their layer's router.
  if (config.router_selection_bias && config.is_moe()) {
    const int64_t E = config.num_experts;
    for (int64_t l = 0; l < config.num_blocks(); ++l) {
      if (!config.is_moe_layer(l)) continue;
      const int64_t router = layout.layer(l).moe.router;
      auto at = std::find_if(tensors.begin(), tensors.end(),
                             [&](const SafetensorsWriteTensor& w) { return w.name == layout.at(router).name; });
      const std::vector<float>* bias = options.selection_bias;
      if (bias == nullptr || bias->size() != static_cast<size_t>(config.num_blocks() * E))
        return Status::InvalidArgument(fmt::format(
            "exporting {}: the routers' selection biases (e_score_correction_bias) are {}, not {} x {} values",
            config.architecture, bias == nullptr ? "missing" : std::to_string(bias->size()) + " values",
            config.num_blocks(), E));
      const float* from = bias->data() + l * E;
      SafetensorsWriteTensor w{selection_bias_name(l), {E}, nullptr,
                               [from, E](float* out) {
                                 std::copy(from, from + E, out);
                                 return Status::OK();
                               },
                               SafetensorsWriteDtype::kF32};  // as published: routing compares it
      tensors.insert(at == tensors.end() ? at : at + 1, std::move(w));
    }
  }
  // The MTP modules' copies of the embedding and the LM head, after the module's last tensor, as
  // DeepSeek's checkpoints hold them (their serving code reads the module's own names).
  for (const auto& [name, offset] : mtp_shared_copies(layout)) {
    const std::string prefix = name.substr(0, name.find(".embed_tokens") != std::string::npos
                                                   ? name.find(".embed_tokens") + 1
                                                   : name.find(".shared_head") + 1);
    auto after = std::find_if(tensors.rbegin(), tensors.rend(),
                              [&](const SafetensorsWriteTensor& w) { return w.name.starts_with(prefix); });
    const TensorSpec* source = &layout.at(offset);
    SafetensorsWriteTensor w{name, source->shape, nullptr, [&read, source](float* out) { return read(*source, out); }};
    tensors.insert(after.base(), std::move(w));
  }
  uint64_t total_bytes = 0;
  for (const SafetensorsWriteTensor& w : tensors) {
    uint64_t n = 1;
    for (int64_t d : w.shape) n *= static_cast<uint64_t>(d);
    total_bytes += n * (options.dtype == SafetensorsWriteDtype::kF32 ? 4 : 2);
  }
  Progress progress(fmt::format("exporting {} weights to {}", export_dtype_name(options.dtype), dir.string()),
                    total_bytes);
  WriterOptions wo;
  wo.dtype = options.dtype;
  wo.max_shard_bytes = options.max_shard_bytes;
  wo.on_written = [&progress](uint64_t bytes) { progress.add(bytes); };
  RETURN_IF_ERROR(write_safetensors_dir(tmp.string(), tensors, wo));
  progress.finish();

  // Tokenizer files, and the code files config.json's auto_map names ("module.Class" -> module.py).
  if (!options.copy_tokenizer_from.empty()) {
    std::vector<std::string> files = hf_tokenizer_files();
    if (j.contains("auto_map")) {
      for (const auto& [kind, target] : j["auto_map"].items()) {
        if (!target.is_string()) continue;
        const std::string ref = target.get<std::string>();
        const std::string module = ref.substr(0, ref.find('.'));
        const std::string file = module + ".py";
        // Plain module names only: a map naming another repository ("repo--module.Class") or a
        // path is not copied.
        if (module.empty() || module.find_first_of("/\\-") != std::string::npos) continue;
        if (std::find(files.begin(), files.end(), file) == files.end()) files.push_back(file);
      }
    }
    for (const std::string& name : files) {
      const fs::path from = fs::path(options.copy_tokenizer_from) / name;
      if (!fs::is_regular_file(from, ec)) continue;
      ASSIGN_OR_RETURN(std::string text, read_text_file(from.string()));
      RETURN_IF_ERROR(write_file_atomic((tmp / name).string(), text));
    }
  }
  return Status::OK();
  });
}

}  // namespace strata::model
