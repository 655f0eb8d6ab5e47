// Where the commands that read a trained model (`strata convert`, `strata generate`) find it: a
// Hugging Face directory, a strata checkpoint, or (generate) a run directory, and the tokenizer
// that goes with it.
#pragma once

#include <string>
#include <vector>

#include "core/status.h"
#include "model/config.h"
#include "model/hf_io.h"

namespace strata::tools {

// A strata checkpoint: a `latest` file, a directory holding `latest` or manifest.json, or a
// directory named step-N (whose manifest may be missing: the reader then names what is wrong).
bool looks_like_checkpoint(const std::string& path);

// A run directory of `strata train`: it holds the config.yaml the run wrote.
bool looks_like_run_dir(const std::string& path);

struct LoadedModel {
  model::ModelConfig config;
  std::vector<float> params;  // (ParamLayout(config).total_size()) fp32
  model::SafetensorsWriteDtype source_dtype = model::SafetensorsWriteDtype::kF32;  // what --dtype auto writes
  // The routers' selection biases (L x E) when the config has them (model/hf_io.h), else empty.
  std::vector<float> selection_bias;
};

// Reads the parameters of a checkpoint (checksums verified first) and the config the trainer
// recorded in its manifest, checked as a resume checks them.
Result<LoadedModel> load_checkpoint(const std::string& path);
// Reads a Hugging Face directory's config.json and weights (names, shapes and dtypes checked
// against the config before the parameters' memory is allocated).
Result<LoadedModel> load_hf_model(const std::string& dir);

// What --from names, resolved: the model to load and the tokenizer that goes with it.
struct ModelSource {
  enum class Kind { kHuggingFace, kCheckpoint };
  Kind kind = Kind::kHuggingFace;
  std::string model_path;     // the Hugging Face directory, or the checkpoint
  std::string tokenizer_dir;  // a directory holding tokenizer.json, or "" when none was found
  std::string tokenizer_note; // where tokenizer_dir came from, or why none was found
};

// from: a Hugging Face directory (its own tokenizer), a checkpoint (the tokenizer of the run
// it belongs to, when its config.yaml is beside or above it), or a run directory (its
// checkpoints' latest step; the tokenizer of the Hugging Face model it started from, model.from,
// or of its export, run.export). InvalidArgument naming `from` when it is none of these.
Result<ModelSource> resolve_model_source(const std::string& from);

}  // namespace strata::tools
