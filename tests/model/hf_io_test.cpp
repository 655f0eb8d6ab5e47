// Hugging Face directories in and out, against the real client: tests/model/hf_reference.py
// saves tiny random transformers models (Llama untied and tied, Mistral, Qwen2 with q/k/v
// biases) with save_pretrained, single-file and sharded. strata loads them, matches their loss
// and gradients, and exports directories that transformers loads back with identical weights.
#include "model/hf_io.h"

#include <gtest/gtest.h>
#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/decoder.h"
#include "model/flat_model.h"
#include "../test_util.h"
#include "reference_util.h"

namespace strata::model {
namespace {

namespace fs = std::filesystem;

constexpr double kLossTolerance = 1e-5;  // relative
constexpr double kGradTolerance = 1e-4;  // relative norm, per tensor
constexpr double kLogitTolerance = 1e-5;  // max |diff| / max |logit|

fs::path script() { return fs::path(STRATA_SOURCE_DIR) / "tests" / "model" / "hf_reference.py"; }

// Looks the packages up without importing them (importing transformers takes seconds); a
// package that is installed but broken then fails the tests instead of skipping them.
bool python_has_transformers() {
  const std::string cmd = std::string(kReferencePython) +
                          " -c 'import importlib.util as u, sys; "
                          "sys.exit(0 if u.find_spec(\"transformers\") and u.find_spec(\"safetensors\") else 1)'"
                          " >/dev/null 2>&1";
  return fs::exists(kReferencePython) && std::system(cmd.c_str()) == 0;
}

using strata::testing::read_json;

double relative(double a, double b) {
  if (!std::isfinite(a) || !std::isfinite(b)) return INFINITY;
  return std::fabs(a - b) / std::max(std::fabs(b), 1e-30);
}

// Whether `dir` holds a reference newer than the script that generates it.
bool fresh(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / "reference.json", ec) &&
         fs::last_write_time(dir / "reference.json", ec) >= fs::last_write_time(script(), ec);
}

// The reference directory of `variant`, generated once and reused while newer than the script.
// ctest runs each test in its own process, several at once. Generation holds a lock on the
// variant, so one process generates while the others wait and then reuse its directory; a
// fresh directory is never replaced while another test may be reading it.
fs::path reference(const std::string& variant) {
  const fs::path root = fs::path(STRATA_BINARY_DIR) / "tests" / "model_hf";
  const fs::path dir = root / variant;
  if (fresh(dir)) return dir;
  std::error_code ec;
  fs::create_directories(root, ec);
  const std::string lock_path = (root / (variant + ".lock")).string();
  const int lock = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  EXPECT_GE(lock, 0) << "cannot open " << lock_path;
  if (lock >= 0) {
    EXPECT_EQ(::flock(lock, LOCK_EX), 0) << "cannot lock " << lock_path;
  }
  if (!fresh(dir)) {
    const fs::path tmp = root / (variant + ".tmp." + std::to_string(::getpid()));
    fs::remove_all(tmp, ec);
    const std::string log = (root / (variant + ".log")).string();
    const std::string cmd = std::string(kReferencePython) + " " + script().string() + " generate " + tmp.string() + " " +
                            variant + " >" + log + " 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << "reference script failed; see " << log;
    fs::remove_all(dir, ec);  // stale: the script changed since it was generated
    fs::rename(tmp, dir, ec);
    EXPECT_FALSE(ec) << "cannot move " << tmp << " to " << dir << ": " << ec.message();
  }
  if (lock >= 0) ::close(lock);  // releases the lock
  return dir;
}

// A fresh output directory for this test.
fs::path out_dir(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string test = info->name();
  std::replace(test.begin(), test.end(), '/', '_');
  const fs::path dir = fs::path(STRATA_BINARY_DIR) / "tests" / "model_hf_out" / test / name;
  fs::remove_all(dir);
  fs::create_directories(dir.parent_path());
  return dir;
}

// Every tensor of two checkpoints, byte for byte.
void expect_same_tensors(const std::string& a_path, const std::string& b_path) {
  Result<SafetensorsReader> a = SafetensorsReader::open(a_path);
  Result<SafetensorsReader> b = SafetensorsReader::open(b_path);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  ASSERT_EQ(a->tensors().size(), b->tensors().size());
  for (size_t i = 0; i < a->tensors().size(); ++i) {
    const SafetensorsTensorInfo& ta = a->tensors()[i];
    const SafetensorsTensorInfo& tb = b->tensors()[i];
    ASSERT_EQ(ta.name, tb.name);
    EXPECT_EQ(ta.dtype, tb.dtype) << ta.name;
    EXPECT_EQ(ta.shape, tb.shape) << ta.name;
    std::vector<uint8_t> ba(static_cast<size_t>(ta.nbytes)), bb(static_cast<size_t>(tb.nbytes));
    ASSERT_TRUE(a->read_raw(ta.name, ba.data()).ok());
    ASSERT_TRUE(b->read_raw(tb.name, bb.data()).ok());
    EXPECT_TRUE(ba == bb) << ta.name << " differs between " << a_path << " and " << b_path;
  }
}

struct Loaded {
  ModelConfig config;
  ParamLayout layout;
  std::vector<float> params;
};

Loaded load(const fs::path& hf_dir) {
  Loaded l;
  Result<ModelConfig> config = load_hf_config(hf_dir.string());
  EXPECT_TRUE(config.ok()) << config.status().to_string();
  if (!config.ok()) return l;
  l.config = *config;
  l.layout = ParamLayout(l.config);
  l.params.assign(static_cast<size_t>(l.layout.total_size()), 0.0f);
  Status st = load_hf_weights(hf_dir.string(), l.layout, l.params.data());
  EXPECT_TRUE(st.ok()) << st.to_string();
  return l;
}

class HfVariantTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!python_has_transformers()) {
      GTEST_SKIP() << kReferencePython << " cannot import transformers and safetensors; these tests compare with them";
    }
    ref_ = reference(GetParam());
    ASSERT_FALSE(HasFailure());
  }
  fs::path ref_;
};

TEST_P(HfVariantTest, ConfigReadsTheArchitecture) {
  Result<ModelConfig> c = load_hf_config((ref_ / "hf").string());
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  const nlohmann::json ref = read_json(ref_ / "reference.json");
  EXPECT_EQ(c->architecture, ref["architecture"].get<std::string>());
  EXPECT_EQ(c->attention_bias, GetParam() == "qwen2");
  EXPECT_EQ(c->tie_word_embeddings, GetParam() == "llama_tied");
  const bool dynamic = GetParam() == "llama_dynamic";
  EXPECT_EQ(c->rope.scaling, dynamic ? kernels::RopeScaling::kDynamic : kernels::RopeScaling::kNone);
  if (dynamic) {
    EXPECT_EQ(c->rope.factor, 2.0);
  }
}

TEST_P(HfVariantTest, LoadThenExportIsBitwiseIdentical) {
  // Single file in, single file out.
  Loaded single = load(ref_ / "hf");
  ASSERT_FALSE(HasFailure());
  const fs::path out = out_dir("single");
  ExportOptions eo;
  eo.copy_tokenizer_from = (ref_ / "hf").string();
  ASSERT_TRUE(export_hf(out.string(), single.config, single.layout, single.params.data(), eo).ok());
  expect_same_tensors((ref_ / "hf").string(), out.string());
  EXPECT_TRUE(fs::exists(out / "tokenizer_config.json"));
  EXPECT_TRUE(fs::exists(out / "generation_config.json"));
  EXPECT_FALSE(fs::exists(out.string() + ".tmp"));
  const nlohmann::json config = read_json(out / "config.json");
  EXPECT_EQ(config["torch_dtype"], "float32");
  EXPECT_EQ(config["model_type"], read_json(ref_ / "hf" / "config.json")["model_type"]);

  // Sharded in (transformers' shards), sharded out (strata's): the same tensors.
  Loaded sharded = load(ref_ / "hf_sharded");
  ASSERT_FALSE(HasFailure());
  EXPECT_TRUE(sharded.params == single.params);
  const fs::path out_sharded = out_dir("sharded");
  ExportOptions small;
  small.max_shard_bytes = 30000;
  ASSERT_TRUE(export_hf(out_sharded.string(), sharded.config, sharded.layout, sharded.params.data(), small).ok());
  EXPECT_TRUE(fs::exists(out_sharded / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(out_sharded / "model.safetensors"));
  expect_same_tensors((ref_ / "hf_sharded").string(), out_sharded.string());
}

TEST_P(HfVariantTest, LossAndGradientsMatchTransformers) {
  Result<ModelConfig> config = load_hf_config((ref_ / "hf_sharded").string());
  ASSERT_TRUE(config.ok()) << config.status().to_string();
  FlatModel<LlamaModel> model(*config);
  Status st = model.load_safetensors((ref_ / "hf_sharded").string());
  ASSERT_TRUE(st.ok()) << st.to_string();

  const nlohmann::json ref = read_json(ref_ / "reference.json");
  ASSERT_FALSE(ref.is_discarded());
  const int64_t B = ref["batch"].get<int64_t>(), T = ref["seq"].get<int64_t>();
  std::vector<int32_t> inputs, targets;
  for (const auto& row : ref["inputs"])
    for (const auto& tok : row) inputs.push_back(tok.get<int32_t>());
  for (const auto& row : ref["targets"])
    for (const auto& tok : row) targets.push_back(tok.get<int32_t>());
  ASSERT_EQ(static_cast<int64_t>(inputs.size()), B * T);
  const int64_t valid = count_valid_targets(targets.data(), B * T);
  ASSERT_GT(valid, 0);
  model.zero_grads();
  const double loss =
      model.forward_backward(inputs.data(), targets.data(), B, T, 1.0f / static_cast<float>(valid)) / valid;
  EXPECT_WITHIN(relative(loss, ref["loss"].get<double>()), kLossTolerance)
      << " loss " << loss << " vs transformers " << ref["loss"].get<double>();

  Result<SafetensorsReader> grads = SafetensorsReader::open((ref_ / "grads.safetensors").string());
  ASSERT_TRUE(grads.ok()) << grads.status().to_string();
  EXPECT_EQ(grads->tensors().size(), model.layout().tensors().size());
  double worst = 0;
  for (const TensorSpec& t : model.layout().tensors()) {
    std::vector<float> expected(static_cast<size_t>(t.numel));
    Status rs = grads->read_f32(t.name, t.shape, expected.data());
    ASSERT_TRUE(rs.ok()) << rs.to_string();
    const double err = testing::relative_error(model.grads() + t.offset, expected.data(), t.numel);
    EXPECT_WITHIN(err, kGradTolerance) << " gradient of " << t.name;
    worst = std::max(worst, err);
  }
  // The margins, for whoever tightens or loosens the tolerances.
  std::printf("%s: loss error %.2e, worst gradient error %.2e\n", GetParam().c_str(),
              relative(loss, ref["loss"].get<double>()), worst);
}

// Runs the script's check of exports against the reference; it writes EXPORT.check.json each.
void check_in_transformers(const std::vector<fs::path>& export_dirs, const fs::path& ref) {
  const std::string log = export_dirs.at(0).string() + ".check.log";
  std::string cmd = std::string(kReferencePython) + " " + script().string() + " check " + ref.string();
  for (const auto& d : export_dirs) cmd += " " + d.string();
  cmd += " >" + log + " 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << "transformers could not load an export; see " << log;
}

TEST_P(HfVariantTest, ExportLoadsInTransformersWithTheSameLogitsAndLoss) {
  Loaded l = load(ref_ / "hf");
  ASSERT_FALSE(HasFailure());
  const nlohmann::json ref = read_json(ref_ / "reference.json");
  const fs::path f32_out = out_dir("f32"), bf16_out = out_dir("bf16"), f16_out = out_dir("f16");
  ExportOptions f32_options;
  ASSERT_TRUE(export_hf(f32_out.string(), l.config, l.layout, l.params.data(), f32_options).ok());
  ExportOptions bf16_options;
  bf16_options.dtype = SafetensorsWriteDtype::kBF16;
  bf16_options.max_shard_bytes = 20000;
  ASSERT_TRUE(export_hf(bf16_out.string(), l.config, l.layout, l.params.data(), bf16_options).ok());
  ExportOptions f16_options;
  f16_options.dtype = SafetensorsWriteDtype::kF16;
  ASSERT_TRUE(export_hf(f16_out.string(), l.config, l.layout, l.params.data(), f16_options).ok());
  check_in_transformers({f32_out, bf16_out, f16_out}, ref_);
  const std::vector<std::pair<SafetensorsWriteDtype, fs::path>> exports = {
      {SafetensorsWriteDtype::kF32, f32_out}, {SafetensorsWriteDtype::kBF16, bf16_out},
      {SafetensorsWriteDtype::kF16, f16_out}};
  for (const auto& [dtype, out] : exports) {
    SCOPED_TRACE(std::string(export_dtype_name(dtype)) + " export");
    const bool rounded = dtype != SafetensorsWriteDtype::kF32;  // the loss is then only checked finite
    const nlohmann::json c = read_json(out.string() + ".check.json");
    ASSERT_FALSE(c.is_discarded());
    ASSERT_TRUE(c.is_object());
    EXPECT_EQ(c["class"], ref["architecture"]);
    EXPECT_EQ(c["torch_dtype"], torch_dtype_name(dtype));
    EXPECT_TRUE(c["missing_keys"].empty()) << c["missing_keys"].dump();
    EXPECT_TRUE(c["unexpected_keys"].empty()) << c["unexpected_keys"].dump();
    EXPECT_TRUE(c["mismatched_keys"].empty()) << c["mismatched_keys"].dump();
    EXPECT_TRUE(c["same_keys"].get<bool>());
    // Weights: identical, or identical to torch's own BF16 / F16 rounding of the originals.
    EXPECT_EQ(c["max_weight_diff"].get<double>(), 0.0);
    if (!rounded) {
      const double logit_err = c["logits_max_diff"].get<double>() / c["logits_max_abs"].get<double>();
      EXPECT_WITHIN(logit_err, kLogitTolerance);
      EXPECT_WITHIN(relative(c["loss_export"].get<double>(), ref["loss"].get<double>()), kLossTolerance);
    } else {
      EXPECT_TRUE(std::isfinite(c["loss_export"].get<double>()));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Architectures, HfVariantTest,
                         ::testing::Values("llama", "llama_tied", "mistral", "qwen2", "llama_dynamic"),
                         [](const ::testing::TestParamInfo<std::string>& info) { return info.param; });

// ---- without Python ---------------------------------------------------------------------------

ModelConfig tiny_config(bool tied) {
  ModelConfig c;
  c.vocab_size = 11;
  c.hidden_size = 8;
  c.intermediate_size = 12;
  c.num_hidden_layers = 1;
  c.num_attention_heads = 2;
  c.num_key_value_heads = 1;
  c.max_position_embeddings = 16;
  c.tie_word_embeddings = tied;
  c.fill_defaults();
  return c;
}

TEST(HfIoTest, NotAHuggingFaceDirectoryIsNamed) {
  const fs::path dir = out_dir("empty");
  fs::create_directories(dir);
  Result<ModelConfig> c = load_hf_config(dir.string());
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("not a Hugging Face directory (no config.json)"), std::string::npos);
  EXPECT_NE(c.status().message().find(dir.string()), std::string::npos);
}

TEST(HfIoTest, MissingOrMisshapenTensorsFailBeforeTouchingParameters) {
  const ModelConfig config = tiny_config(false);
  const ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()));
  init_weights(layout, params.data(), 5);
  const fs::path dir = out_dir("ckpt");
  std::vector<SafetensorsWriteTensor> tensors;
  for (const TensorSpec& t : layout.tensors()) {
    if (t.name == "lm_head.weight") continue;
    std::vector<int64_t> shape = t.shape;
    if (t.name == "model.layers.0.mlp.up_proj.weight") shape = {t.numel};
    tensors.push_back({t.name, shape, params.data() + t.offset});
  }
  ASSERT_TRUE(write_safetensors_dir(dir.string(), tensors).ok());
  std::vector<float> loaded(params.size(), -1.0f);
  Status st = load_hf_weights(dir.string(), layout, loaded.data());
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.to_string();
  EXPECT_NE(st.message().find("model.layers.0.mlp.up_proj.weight"), std::string::npos) << st.to_string();
  EXPECT_NE(st.message().find("model.safetensors"), std::string::npos) << st.to_string();

  tensors.erase(std::remove_if(tensors.begin(), tensors.end(),
                               [](const auto& t) { return t.name == "model.layers.0.mlp.up_proj.weight"; }),
                tensors.end());
  fs::remove_all(dir);
  ASSERT_TRUE(write_safetensors_dir(dir.string(), tensors).ok());
  st = load_hf_weights(dir.string(), layout, loaded.data());
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), StatusCode::kNotFound) << st.to_string();
  EXPECT_NE(st.message().find("model.layers.0.mlp.up_proj.weight"), std::string::npos) << st.to_string();
  EXPECT_TRUE(std::all_of(loaded.begin(), loaded.end(), [](float x) { return x == -1.0f; }));
}

TEST(HfIoTest, TiedLayoutIgnoresLmHeadAndExtrasOnlyWarn) {
  const ModelConfig config = tiny_config(true);
  const ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.0f);
  init_weights(layout, params.data(), 6);
  const fs::path dir = out_dir("ckpt");
  std::vector<SafetensorsWriteTensor> tensors;
  for (const TensorSpec& t : layout.tensors()) tensors.push_back({t.name, t.shape, params.data() + t.offset});
  const TensorSpec* embed = layout.find("model.embed_tokens.weight");
  ASSERT_NE(embed, nullptr);
  const std::vector<float> inv_freq(4, 1.0f), stray(3, 2.0f);
  tensors.push_back({"lm_head.weight", embed->shape, params.data() + embed->offset});
  tensors.push_back({"model.layers.0.self_attn.rotary_emb.inv_freq", {4}, inv_freq.data()});
  tensors.push_back({"model.stray", {3}, stray.data()});
  ASSERT_TRUE(write_safetensors_dir(dir.string(), tensors).ok());
  std::vector<float> loaded(params.size(), 0.0f);
  Status st = load_hf_weights(dir.string(), layout, loaded.data());
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_TRUE(loaded == params);
}

TEST(HfIoTest, ExportReplacesAPreviousExportButNotOtherDirectories) {
  const ModelConfig config = tiny_config(false);
  const ParamLayout layout(config);
  std::vector<float> params(static_cast<size_t>(layout.total_size()), 0.0f);
  init_weights(layout, params.data(), 7);
  const fs::path dir = out_dir("export");
  ASSERT_TRUE(export_hf(dir.string(), config, layout, params.data()).ok());
  init_weights(layout, params.data(), 8);
  ASSERT_TRUE(export_hf(dir.string(), config, layout, params.data()).ok());
  EXPECT_FALSE(fs::exists(dir.string() + ".old"));
  std::vector<float> loaded(params.size(), 0.0f);
  ASSERT_TRUE(load_hf_weights(dir.string(), layout, loaded.data()).ok());
  EXPECT_TRUE(loaded == params);
  Result<ModelConfig> back = load_hf_config(dir.string());
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->to_json(), config.to_json());

  const fs::path other = out_dir("other");
  fs::create_directories(other);
  std::ofstream(other / "notes.txt") << "keep me";
  Status st = export_hf(other.string(), config, layout, params.data());
  ASSERT_FALSE(st.ok());
  EXPECT_NE(st.message().find(other.string()), std::string::npos) << st.to_string();
  EXPECT_TRUE(fs::exists(other / "notes.txt"));
}

}  // namespace
}  // namespace strata::model
