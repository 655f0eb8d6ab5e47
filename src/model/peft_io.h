// LoRA adapters in and out in PEFT's format (model/lora.h): a directory holding
// adapter_config.json and adapter_model.safetensors, which PeftModel.from_pretrained(base, DIR)
// loads onto the base model. Tensors are the layout's adapter tensors under PEFT's names
// ("base_model.model." + the layout name, e.g.
// base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight).
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "core/status.h"
#include "model/config.h"
#include "model/hf_io.h"
#include "model/params.h"
#include "model/safetensors.h"

namespace strata::model {

// The files of an adapter directory.
inline constexpr const char* kPeftConfigFile = "adapter_config.json";
inline constexpr const char* kPeftWeightsFile = "adapter_model.safetensors";

// PEFT's name of a layout tensor.
std::string peft_tensor_name(std::string_view layout_name);

// The LoRA settings of DIR/adapter_config.json: r, lora_alpha, lora_dropout, target_modules (a
// list of module names, matched by suffix; or one expression, matched as PEFT does against whole
// module names, strata's own for MoE models among them) and init_lora_weights. Errors name the
// file and key: not a LORA adapter, or a PEFT feature strata does not compute (use_dora,
// use_rslora, a bias, rank_pattern/alpha_pattern, modules_to_save, layers_to_transform,
// fan_in_fan_out).
Result<LoraConfig> read_peft_adapter_config(const std::string& dir);

// Opens DIR/adapter_model.safetensors and checks it against `layout` before anything is read:
// every adapter tensor present with its shape, and no LoRA tensor the layout lacks (an adapter
// on a module strata does not adapt). The caller reads each adapter tensor with
// read_f32(peft_tensor_name(t.name), ...).
Result<SafetensorsReader> open_peft_adapter(const std::string& dir, const ParamLayout& layout);

struct PeftExportOptions {
  SafetensorsWriteDtype dtype = SafetensorsWriteDtype::kF32;
  std::string base_model;  // adapter_config.json's base_model_name_or_path ("" allowed)
};

// Writes the layout's adapters (each read by `read`) as DIR/adapter_config.json and
// DIR/adapter_model.safetensors, atomically as export_hf writes (write_export_dir; a previous
// adapter there is replaced). REQUIRES: layout.has_lora().
Status export_peft_adapter(const std::string& out_dir, const ParamLayout& layout, const TensorReader& read,
                           const PeftExportOptions& options = {});

// The merged weight of an adapted linear layer: w (out, in) += scale * B A, in fp32 (A (r, in),
// B (out, r)). What `--merge` exports.
void merge_lora(float* w, const float* a, const float* b, int64_t out, int64_t in, int64_t r, float scale);

}  // namespace strata::model
