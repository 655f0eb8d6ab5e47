// Hugging Face model directories in and out: config.json, safetensors weights (single file or
// sharded with model.safetensors.index.json) and the tokenizer files beside them.
//
// Weights travel by Hugging Face name through ParamLayout::tensors(), so every tensor a layout
// declares (MoE experts included) loads and exports without code here knowing about it.
// Functions are stateless; concurrent calls are safe when they touch different directories.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "model/config.h"
#include "model/params.h"
#include "model/safetensors.h"

namespace strata::model {

// Files copied from a source model directory into an export when present.
const std::vector<std::string>& hf_tokenizer_files();

// True when `dir` is a directory holding config.json.
bool is_hf_directory(const std::string& dir);

// DIR/config.json as JSON with the implicit settings of some model types made explicit (Qwen2
// always has q/k/v biases: "attention_bias": true unless the file says otherwise).
// NotFound names the directory: "not a Hugging Face directory (no config.json)".
Result<nlohmann::json> read_hf_config_json(const std::string& dir);
// ModelConfig::from_json of read_hf_config_json(dir).
Result<ModelConfig> load_hf_config(const std::string& dir);

// Fills params (layout.total_size() elements) from a Hugging Face checkpoint: a directory, a
// .safetensors file or a model.safetensors.index.json. Every layout tensor but the LoRA
// adapters (TensorSpec::adapts, left as they are; model/peft_io.h reads them) must be present
// with its shape (any dtype SafetensorsReader converts); a tied layout ignores lm_head.weight.
// Extra checkpoint tensors produce one warning naming a few (rotary_emb.inv_freq is expected
// and ignored). Everything is checked before any byte is read, so on a NotFound, shape or
// dtype error params are unchanged; an I/O error part-way leaves them partly written.
Status load_hf_weights(const std::string& dir_or_file, const ParamLayout& layout, float* params,
                       const ReaderOptions& options = {});
// The reads of load_hf_weights from a reader open_hf_weights returned, with a progress line on
// stderr when they take long.
Status read_hf_weights(const SafetensorsReader& reader, const ParamLayout& layout, float* params);
// Reads one layout tensor from a reader open_hf_weights returned, converted to fp32. An FP8
// weight with block scales beside it (DeepSeek-V3's checkpoints: NAME_scale_inv, one fp32 per
// 128 x 128 block, ceil(rows/128) x ceil(cols/128) of them) is dequantised as DeepSeek's own
// weight_dequant does: each element's E4M3 value times its block's scale, in fp32.
Status read_hf_tensor(const SafetensorsReader& reader, const TensorSpec& t, float* out);
// Such a weight's own E4M3 codes and block scales, written to `copy` in the fp8 recipe's matrix
// layout (kernels/fp8.h: the rows x cols codes, then the fp32 scales of the 128 x 128 blocks at
// fp8_matrix_scale_offset), unconverted; false (nothing written) for a tensor without them.
Result<bool> read_hf_fp8_copy(const SafetensorsReader& reader, const TensorSpec& t, uint8_t* copy);
// The name of a weight's block scales in such a checkpoint ("....weight" -> "....weight_scale_inv").
std::string block_scale_name(std::string_view weight_name);

// The checks of load_hf_weights alone, returning the open reader: the caller then reads each
// layout tensor with read_f32(name, ...) wherever it wants it (e.g. straight into its chunks,
// so that the model is never held twice in memory).
Result<SafetensorsReader> open_hf_weights(const std::string& dir_or_file, const ParamLayout& layout,
                                          const ReaderOptions& options = {});

// The copies of shared tensors a DeepSeek checkpoint stores in each multi-token prediction module
// (model.layers.{b}.embed_tokens.weight and .shared_head.head.weight, b >= num_hidden_layers),
// each with the layout offset of the tensor it copies (the embedding, the LM head). Loading
// ignores them (the module shares the model's); exports write them.
std::vector<std::pair<std::string, int64_t>> mtp_shared_copies(const ParamLayout& layout);
bool is_mtp_shared_copy(const ModelConfig& config, std::string_view name);

// DeepSeek-V3's routers' selection biases (ModelConfig::router_selection_bias): one (E) tensor
// per MoE block (the MTP modules' too), model.layers.{l}.mlp.gate.e_score_correction_bias. The decoder holds them with
// the training state besides the parameters (the loss-free balancing bias), not in the layout.
std::string selection_bias_name(int64_t layer);
// Reads them into bias (blocks x E, zero for dense blocks) from a checkpoint holding them; NotFound
// naming the first missing one. Does nothing (bias left as it is) when the config has none.
Status read_hf_selection_bias(const SafetensorsReader& reader, const ModelConfig& config, std::vector<float>* bias);

// A fingerprint of the frozen tensors (TensorSpec::frozen) as `reader` stores them: xxh3 of their
// names, dtypes, shapes and sizes, in hex. A run records it beside the source's path, since its
// checkpoints hold the trained tensors only; it tells another model apart, not the same
// architecture with other values.
std::string frozen_tensors_fingerprint(const SafetensorsReader& reader, const ParamLayout& layout);

// Export dtypes by the names of `strata convert --dtype` and run.export_dtype ("f32", "bf16",
// "f16"), and by transformers' torch_dtype ("float32", "bfloat16", "float16").
std::optional<SafetensorsWriteDtype> parse_export_dtype(std::string_view name);
const char* export_dtype_name(SafetensorsWriteDtype dtype);
std::optional<SafetensorsWriteDtype> parse_torch_dtype(std::string_view torch_dtype);
const char* torch_dtype_name(SafetensorsWriteDtype dtype);

// The precision a Hugging Face source holds its weights in, which an export keeps by default:
// the narrowest of f32, bf16 and f16 that holds every tensor of `layout` in `reader` exactly
// (bf16 for a bf16 model; f32 when fp32 and bf16 tensors mix). Where more than one does (FP8
// weights fit both bf16 and f16), `config_json`'s torch_dtype (or dtype, its newer name)
// chooses, bf16 otherwise. REQUIRES: reader holds every layout tensor (open_hf_weights).
SafetensorsWriteDtype hf_source_dtype(const SafetensorsReader& reader, const ParamLayout& layout,
                                      const nlohmann::json& config_json = nlohmann::json::object());

struct ExportOptions {
  SafetensorsWriteDtype dtype = SafetensorsWriteDtype::kF32;
  uint64_t max_shard_bytes = kDefaultMaxShardBytes;
  std::string copy_tokenizer_from;  // a model directory whose hf_tokenizer_files() to copy; "" = none
  // The routers' selection biases (L x E, read_hf_selection_bias's layout) written beside the
  // weights when the config has them (DeepSeek-V3); null writes zeros.
  const std::vector<float>* selection_bias = nullptr;
  // Weights holding NaN or Inf are refused (InvalidArgument naming the first such tensor and its
  // count; nothing is written) unless this is set.
  bool allow_nonfinite = false;
};

// OK when export_hf may write `out_dir`: it does not exist, is empty, or holds a previous
// export (a `marker` file: config.json, or a PEFT adapter's adapter_config.json), which the export
// replaces. Lets callers fail before long work.
Status check_export_target(const std::string& out_dir, const std::string& marker = "config.json");
// How every export directory is written: check_export_target(out_dir, marker), then `fill`
// writes the files into OUT_DIR.tmp (a fresh directory), which is fsynced and renamed to out_dir;
// a previous export there is replaced only once the new one is complete, and on any error no
// OUT_DIR.tmp stays behind.
Status write_export_dir(const std::string& out_dir, const std::string& marker,
                        const std::function<Status(const std::string& tmp)>& fill);

// Writes a directory transformers' from_pretrained loads unchanged: config.json
// (ModelConfig::to_json with model_type matching the architecture and the torch_dtype of
// options.dtype), the weights
// (model.safetensors, or shards plus index beyond max_shard_bytes) and the tokenizer files.
// Everything is written into OUT_DIR.tmp, fsynced, then renamed to out_dir (a previous export
// there is replaced only once the new one is complete). A long export shows a progress line.
Status export_hf(const std::string& out_dir, const ModelConfig& config, const ParamLayout& layout,
                 const float* params, const ExportOptions& options = {});
// The same with each tensor read by `read` (into a buffer of t.numel floats) as it is written,
// so that only one tensor is held in memory at a time.
using TensorReader = std::function<Status(const TensorSpec& t, float* out)>;
Status export_hf(const std::string& out_dir, const ModelConfig& config, const ParamLayout& layout,
                 const TensorReader& read, const ExportOptions& options = {});

}  // namespace strata::model
