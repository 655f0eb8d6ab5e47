#include "core/config.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

namespace strata {
namespace {

ConfigSchema make_schema() {
  ConfigSchema s;
  s.add({.name = "train.steps", .type = ConfigType::kInt, .default_value = "10", .min = 1, .help = "steps"});
  s.add({.name = "optim.lr", .type = ConfigType::kFloat, .default_value = "0.001", .min = 0, .max = 1, .help = "lr"});
  s.add({.name = "optim.schedule", .type = ConfigType::kString, .default_value = "cosine",
         .choices = {"cosine", "constant"}, .help = "schedule"});
  s.add({.name = "run.quiet", .type = ConfigType::kBool, .default_value = "false", .help = "quiet"});
  s.add({.name = "memory.device", .type = ConfigType::kBytes, .default_value = "0", .help = "budget"});
  s.add({.name = "data.paths", .type = ConfigType::kStringList, .default_value = "[]", .help = "files"});
  return s;
}

TEST(Config, DefaultsHoldWhenNothingIsSet) {
  auto c = Config::parse(make_schema(), "", "x.yaml");
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->get_int("train.steps"), 10);
  EXPECT_DOUBLE_EQ(c->get_float("optim.lr"), 0.001);
  EXPECT_EQ(c->get_string("optim.schedule"), "cosine");
  EXPECT_FALSE(c->is_set("train.steps"));
  EXPECT_TRUE(c->get_list("data.paths").empty());
}

TEST(Config, NestedYamlAndOverridesApplyInOrder) {
  auto c = Config::parse(make_schema(),
                         "train:\n  steps: 5\noptim: {lr: 3e-4}\nmemory:\n  device: 24GiB\n"
                         "data:\n  paths: [a.bin, b.bin]\n",
                         "x.yaml", {"train.steps=7", "data.paths=[c.bin]", "run.quiet=yes"});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->get_int("train.steps"), 7);
  EXPECT_DOUBLE_EQ(c->get_float("optim.lr"), 3e-4);
  EXPECT_EQ(c->get_bytes("memory.device"), 24ull << 30);
  EXPECT_EQ(c->get_list("data.paths"), std::vector<std::string>{"c.bin"});
  EXPECT_TRUE(c->get_bool("run.quiet"));
  EXPECT_EQ(c->origin("train.steps"), "command line");
  EXPECT_EQ(c->origin("optim.lr"), "x.yaml:3");
}

TEST(Config, UnknownKeyNamesFileLineAndSuggestion) {
  auto c = Config::parse(make_schema(), "train:\n  steps: 5\noptim:\n  lrr: 0.1\n", "run.yaml");
  ASSERT_FALSE(c.ok());
  const std::string& m = c.status().message();
  EXPECT_NE(m.find("run.yaml:4"), std::string::npos) << m;
  EXPECT_NE(m.find("'optim.lrr'"), std::string::npos) << m;
  EXPECT_NE(m.find("did you mean 'optim.lr'"), std::string::npos) << m;
}

TEST(Config, WrongTypeIsRejectedWithKeyAndLine) {
  auto c = Config::parse(make_schema(), "train:\n  steps: many\n", "run.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("run.yaml:2"), std::string::npos) << c.status().message();
  EXPECT_NE(c.status().message().find("'train.steps'"), std::string::npos);
  EXPECT_NE(c.status().message().find("integer"), std::string::npos);
  auto d = Config::parse(make_schema(), "train:\n  steps: [1, 2]\n", "run.yaml");
  EXPECT_FALSE(d.ok());
  auto e = Config::parse(make_schema(), "memory:\n  device: lots\n", "run.yaml");
  EXPECT_FALSE(e.ok());
}

TEST(Config, OutOfRangeAndBadChoiceAreRejected) {
  auto c = Config::parse(make_schema(), "optim:\n  lr: 2.5\n", "run.yaml");
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("between 0 and 1"), std::string::npos) << c.status().message();
  auto d = Config::parse(make_schema(), "", "run.yaml", {"train.steps=0"});
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("command line"), std::string::npos);
  auto e = Config::parse(make_schema(), "optim: {schedule: linear}\n", "run.yaml");
  ASSERT_FALSE(e.ok());
  EXPECT_NE(e.status().message().find("cosine, constant"), std::string::npos) << e.status().message();
  auto f = Config::parse(make_schema(), "optim: {lr: nan}\n", "run.yaml");
  EXPECT_FALSE(f.ok());
}

TEST(Config, MalformedInputIsAnErrorNotACrash) {
  EXPECT_FALSE(Config::parse(make_schema(), "train: [steps", "run.yaml").ok());
  EXPECT_FALSE(Config::parse(make_schema(), "- a\n- b\n", "run.yaml").ok());
  EXPECT_FALSE(Config::parse(make_schema(), "train: 3\n", "run.yaml").ok());
  EXPECT_FALSE(Config::parse(make_schema(), "", "run.yaml", {"no_equals_sign"}).ok());
  EXPECT_FALSE(Config::parse(make_schema(), "", "run.yaml", {"train.stepz=3"}).ok());
  EXPECT_FALSE(Config::load_file(make_schema(), "/nonexistent/run.yaml").ok());
}

// Where the message points: `file:line` and the words that say what is wrong.
void expect_refused(const Result<Config>& c, const std::vector<std::string>& words) {
  ASSERT_FALSE(c.ok());
  for (const std::string& w : words)
    EXPECT_NE(c.status().message().find(w), std::string::npos) << "missing '" << w << "' in: " << c.status().message();
}

TEST(Config, NonScalarKeyIsRefusedWithFileAndLine) {
  // yaml-cpp reads `? [a, b]` as a map key that is a list; converting it to a name used to throw.
  expect_refused(Config::parse(make_schema(), "train:\n  steps: 5\n? [a, b]\n: 1\n", "run.yaml"),
                 {"run.yaml:3", "plain word"});
  expect_refused(Config::parse(make_schema(), "optim:\n  ? {x: 1}\n  : 2\n", "run.yaml"),
                 {"run.yaml:2", "plain word", "'optim'"});
}

TEST(Config, KeyGivenTwiceIsRefusedNamingBothLines) {
  expect_refused(Config::parse(make_schema(), "train:\n  steps: 5\n  steps: 6\n", "run.yaml"),
                 {"run.yaml:3", "'train.steps' is set twice", "first at run.yaml:2"});
  // A repeated section, and the same key spelled nested and dotted.
  expect_refused(Config::parse(make_schema(), "optim: {lr: 0.1}\ntrain: {steps: 2}\noptim: {schedule: constant}\n",
                               "run.yaml"),
                 {"run.yaml:3", "'optim' is set twice", "first at run.yaml:1"});
  expect_refused(Config::parse(make_schema(), "train:\n  steps: 5\ntrain.steps: 6\n", "run.yaml"),
                 {"run.yaml:3", "'train.steps' is set twice"});
  // Overrides on the command line still replace the file's value: they are not duplicates.
  auto c = Config::parse(make_schema(), "train:\n  steps: 5\n", "run.yaml", {"train.steps=6", "train.steps=7"});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->get_int("train.steps"), 7);
}

TEST(Config, DirectoryIsRefusedInsteadOfReadAsEmpty) {
  const std::filesystem::path dir = std::filesystem::path(::testing::TempDir()) / "strata_config_dir_test";
  std::filesystem::create_directories(dir);
  auto c = Config::load_file(make_schema(), dir.string());
  expect_refused(c, {dir.string(), "is a directory"});
  std::ofstream(dir / "run.yaml") << "train:\n  steps: 3\n";
  auto d = Config::load_file(make_schema(), (dir / "run.yaml").string());
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->get_int("train.steps"), 3);
  std::filesystem::remove_all(dir);
}

TEST(Config, ListOverrideWithNestedItemsIsAnError) {
  expect_refused(Config::parse(make_schema(), "", "run.yaml", {"data.paths=[a, [b, c]]"}),
                 {"command line", "data.paths"});
}

TEST(Config, ControlCharactersInValuesAreRefusedByKey) {
  // A lone carriage return at the end of the file stays in the value, and writing the config
  // back (into the run dir) would lose it; such a value is refused rather than changed.
  auto cr = Config::parse(make_schema(), "optim:\n  schedule: cosine\r", "x.yaml");
  ASSERT_FALSE(cr.ok());
  EXPECT_NE(cr.status().message().find("optim.schedule"), std::string::npos) << cr.status().to_string();
  EXPECT_NE(cr.status().message().find("0x0d"), std::string::npos) << cr.status().to_string();
  auto item = Config::parse(make_schema(), "data:\n  paths: [\"a\\x01.bin\"]\n", "x.yaml");
  ASSERT_FALSE(item.ok());
  EXPECT_NE(item.status().message().find("0x01"), std::string::npos) << item.status().to_string();
  // A tab is text, and round-trips.
  auto tab = Config::parse(make_schema(), "data:\n  paths: [\"a\\tb \"]\n", "x.yaml");
  ASSERT_TRUE(tab.ok()) << tab.status().to_string();
  auto again = Config::parse(make_schema(), tab->to_yaml(), "again");
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ(again->get_list("data.paths"), std::vector<std::string>{"a\tb "});
}

TEST(Config, EffectiveConfigRoundTripsThroughYaml) {
  auto c = Config::parse(make_schema(), "optim: {lr: 0.25}\ndata: {paths: [x]}\n", "run.yaml",
                         {"memory.device=1GiB"});
  ASSERT_TRUE(c.ok());
  auto again = Config::parse(make_schema(), c->to_yaml(), "dump.yaml");
  ASSERT_TRUE(again.ok()) << again.status().to_string() << "\n" << c->to_yaml();
  EXPECT_DOUBLE_EQ(again->get_float("optim.lr"), 0.25);
  EXPECT_EQ(again->get_bytes("memory.device"), 1ull << 30);
  EXPECT_EQ(again->get_list("data.paths"), std::vector<std::string>{"x"});
}

TEST(Config, FloatsPrintAsTheShortestTextThatReadsBack) {
  for (const char* lr : {"3e-3", "0.1", "1e-8", "0.3", "1"}) {
    auto c = Config::parse(make_schema(), "", "run.yaml", {std::string("optim.lr=") + lr});
    ASSERT_TRUE(c.ok()) << lr;
    const std::string yaml = c->to_yaml();
    const double value = std::strtod(lr, nullptr);
    const std::string shortest = value == 3e-3 ? "0.003" : value == 1e-8 ? "1e-08" : lr;
    EXPECT_NE(yaml.find("lr: " + shortest + "\n"), std::string::npos) << yaml;
    auto again = Config::parse(make_schema(), yaml, "dump.yaml");
    ASSERT_TRUE(again.ok()) << again.status().to_string();
    EXPECT_EQ(again->get_float("optim.lr"), value) << yaml;
  }
  // Bounds in messages print the same way.
  auto out = Config::parse(make_schema(), "", "run.yaml", {"optim.lr=2"});
  ASSERT_FALSE(out.ok());
  EXPECT_NE(out.status().message().find("between 0 and 1"), std::string::npos) << out.status().message();
}

}  // namespace
}  // namespace strata
