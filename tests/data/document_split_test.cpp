// data.eval_fraction's split (data/document_split.h): documents go whole to one side, the
// held-out ones are never in the training stream, and the split is the same on every call.
#include "data/document_split.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace strata {
namespace {

namespace fs = std::filesystem;

// Text documents, one line each ending in '\n' (the EOS, byte 10), each naming itself "<i>".
std::shared_ptr<const TokenDataset> documents(const fs::path& dir, int count, bool last_without_eos) {
  fs::create_directories(dir);
  std::string text;
  for (int i = 0; i < count; ++i) text += "<" + std::to_string(i) + "> words " + std::string(i % 5, 'w') + "\n";
  if (last_without_eos) text += "<" + std::to_string(count) + "> no end";
  std::ofstream(dir / "docs.txt") << text;
  auto d = open_dataset({.paths = {(dir / "docs.txt").string()}, .format = "text"});
  EXPECT_TRUE(d.ok()) << d.status().to_string();
  return std::shared_ptr<const TokenDataset>(std::move(d).value());
}

std::string text_of(const TokenDataset& d) {
  std::vector<int32_t> ids(static_cast<size_t>(d.num_tokens()));
  EXPECT_TRUE(d.read(0, d.num_tokens(), ids.data()).ok());
  return std::string(ids.begin(), ids.end());
}

// The document names ("<i>") of a stream, in order.
std::vector<std::string> names(const std::string& text) {
  std::vector<std::string> out;
  for (size_t p = text.find('<'); p != std::string::npos; p = text.find('<', p + 1))
    out.push_back(text.substr(p, text.find('>', p) - p + 1));
  return out;
}

TEST(DocumentSplit, HeldOutDocumentsAreWholeNeverTrainedOnAndTheSameEveryTime) {
  const fs::path dir = fs::path(::testing::TempDir()) / "strata_document_split";
  fs::remove_all(dir);
  auto all = documents(dir, 400, /*last_without_eos=*/true);
  Result<DocumentSplit> a = split_documents(all, '\n', 0.1);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->documents, 401);
  EXPECT_GT(a->held_out_documents, 20);  // about 40 of 401
  EXPECT_LT(a->held_out_documents, 65);
  const std::string train = text_of(*a->train), held = text_of(*a->held_out);
  EXPECT_EQ(train.size() + held.size(), static_cast<size_t>(all->num_tokens()));
  const std::vector<std::string> train_names = names(train), held_names = names(held);
  EXPECT_EQ(static_cast<int64_t>(held_names.size()), a->held_out_documents);
  const std::set<std::string> trained(train_names.begin(), train_names.end());
  for (const std::string& n : held_names) EXPECT_EQ(trained.count(n), 0u) << n << " is held out and trained on";
  // Whole documents: every held-out one is its own line, as in the data.
  const std::string all_text = text_of(*all);
  for (const std::string& n : held_names) {
    const size_t at = held.find(n), in_all = all_text.find(n);
    const size_t end = all_text.find('\n', in_all);
    EXPECT_EQ(held.substr(at, end - in_all), all_text.substr(in_all, end - in_all)) << n;
  }

  Result<DocumentSplit> b = split_documents(all, '\n', 0.1);
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(text_of(*b->held_out), held);
  EXPECT_EQ(text_of(*b->train), train);
  fs::remove_all(dir);
}

// Pinned (and checked against an independent Python splitmix64): a change of hash would move
// documents between training and evaluation for runs resumed over the same data.
TEST(DocumentSplit, HeldOutDocumentsMatchPinnedValues) {
  const fs::path dir = fs::path(::testing::TempDir()) / "strata_document_split_pinned";
  fs::remove_all(dir);
  Result<DocumentSplit> s = split_documents(documents(dir, 40, false), '\n', 0.25);
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(names(text_of(*s->held_out)), (std::vector<std::string>{"<4>", "<8>", "<14>", "<15>", "<18>", "<21>",
                                                                     "<24>", "<26>", "<31>", "<32>", "<34>", "<38>",
                                                                     "<39>"}));
  fs::remove_all(dir);
}

TEST(DocumentSplit, AFractionOutsideTheRangeOrASideWithoutDocumentsIsRefused) {
  const fs::path dir = fs::path(::testing::TempDir()) / "strata_document_split_bad";
  fs::remove_all(dir);
  auto all = documents(dir, 3, false);
  for (double f : {0.0, 1.0, -0.5}) {
    Result<DocumentSplit> s = split_documents(all, '\n', f);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("data.eval_fraction"), std::string::npos) << s.status().to_string();
  }
  // No EOS in the data: one document, which cannot go to both sides.
  Result<DocumentSplit> one = split_documents(all, 7, 0.5);
  ASSERT_FALSE(one.ok());
  EXPECT_NE(one.status().message().find("1 documents"), std::string::npos) << one.status().to_string();
  EXPECT_NE(one.status().message().find("data.eos_id"), std::string::npos) << one.status().to_string();
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
