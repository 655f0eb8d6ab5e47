// The trainer's own manifest fields are checked against the values it writes before a resume
// believes them: a recipe, moment format or seed strata never writes is refused naming the
// manifest and the field.
#include "train/manifest_fields.h"

#include <gtest/gtest.h>

#include <string>

namespace strata {
namespace {

using json = nlohmann::json;

// A manifest as the trainer writes it (train/checkpointing.cpp), for step 12 of 2 ranks.
ckpt::Manifest written() {
  ckpt::Manifest m;
  m.step = 12;
  m.fields.rng = {{"data_order_seed", 1234}};
  m.fields.lr_schedule = {{"step", 12}};
  m.fields.precision = {{"recipe", "fp8, int8 moments (stochastic)"}, {"moments", "int8"},
                        {"moments_rounding", "stochastic"}};
  m.fields.layout = {{"kind", "flat fp32 per tensor"},
                     {"tensors", 25},
                     {"sharding", {{"world_size", 2}, {"by", "parameter groups"}, {"group_owner", {0, 1, 0, 1}}}}};
  return m;
}

void expect_refused(const ckpt::Manifest& m, const std::string& field) {
  const Status s = check_trainer_fields(m, "ckpt/step-12/manifest.json");
  EXPECT_FALSE(s.ok()) << field << " was accepted";
  EXPECT_EQ(s.code(), StatusCode::kCorruption) << s.to_string();
  EXPECT_NE(s.message().find("ckpt/step-12/manifest.json: field '" + field + "'"), std::string::npos) << s.message();
}

TEST(ManifestFields, WhatTheTrainerWritesIsAccepted) {
  EXPECT_TRUE(check_trainer_fields(written(), "m.json").ok()) << check_trainer_fields(written(), "m.json").to_string();
  ckpt::Manifest plain = written();
  plain.fields.precision = {{"recipe", "bf16"}, {"moments", "fp32"}, {"moments_rounding", "nearest"}};
  plain.fields.layout.erase("sharding");
  EXPECT_TRUE(check_trainer_fields(plain, "m.json").ok());
  // A checkpoint written before the precision object existed holds an empty one.
  plain.fields.precision = json::object();
  EXPECT_TRUE(check_trainer_fields(plain, "m.json").ok());
}

TEST(ManifestFields, ValuesStrataNeverWritesAreRefusedByField) {
  struct Case {
    const char* field;
    void (*edit)(ckpt::Manifest&);
  };
  const Case cases[] = {
      {"precision.recipe", [](ckpt::Manifest& m) { m.fields.precision["recipe"] = "fp16"; }},
      {"precision.recipe", [](ckpt::Manifest& m) { m.fields.precision["recipe"] = "bf16, int4 moments"; }},
      {"precision.moments", [](ckpt::Manifest& m) { m.fields.precision["moments"] = "int4"; }},
      {"precision.moments", [](ckpt::Manifest& m) { m.fields.precision["moments"] = 8; }},
      {"precision.moments_rounding", [](ckpt::Manifest& m) { m.fields.precision["moments_rounding"] = "up"; }},
      {"precision.loss_scale", [](ckpt::Manifest& m) { m.fields.precision["loss_scale"] = 1024; }},
      {"rng.data_order_seed", [](ckpt::Manifest& m) { m.fields.rng["data_order_seed"] = -1; }},
      {"rng.data_order_seed", [](ckpt::Manifest& m) { m.fields.rng["data_order_seed"] = 1.5; }},
      {"lr_schedule.step", [](ckpt::Manifest& m) { m.fields.lr_schedule["step"] = 11; }},
      {"layout.kind", [](ckpt::Manifest& m) { m.fields.layout["kind"] = "chunks"; }},
      {"layout.tensors", [](ckpt::Manifest& m) { m.fields.layout["tensors"] = -3; }},
      {"layout.sharding.world_size", [](ckpt::Manifest& m) { m.fields.layout["sharding"]["world_size"] = 0; }},
      {"layout.sharding.group_owner", [](ckpt::Manifest& m) { m.fields.layout["sharding"]["group_owner"] = {0, 2}; }},
      {"layout.sharding.by", [](ckpt::Manifest& m) { m.fields.layout["sharding"]["by"] = "chunks"; }},
  };
  for (const Case& c : cases) {
    ckpt::Manifest m = written();
    c.edit(m);
    expect_refused(m, c.field);
  }
}

}  // namespace
}  // namespace strata
