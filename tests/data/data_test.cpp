// Token file readers, dataset assembly, the shuffled window loader and the default corpus.
#include "data/data.h"

#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include "data/tokenize.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

class DataTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = ::testing::TempDir() + "strata_data_XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  static void write_bytes(const std::string& file, const void* data, size_t n) {
    std::ofstream out(file, std::ios::binary | std::ios::trunc);
    out.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
    ASSERT_TRUE(out.good()) << file;
  }
  static void append(std::vector<uint8_t>* buf, const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    buf->insert(buf->end(), b, b + n);
  }

  // An llm.c shard laid out as llm.c's dev/data/data_common.py write_datafile writes it: 256
  // int32 (magic, version, token count, zeros), then the tokens as uint16 (magic 20240520,
  // version 1) or uint32 (magic 20240801, version 7). header_count overrides the token count
  // when >= 0, magic and version the header's when not 0.
  std::string write_llmc(const std::string& name, const std::vector<uint32_t>& tokens, bool u32,
                         int32_t header_count = -1, int32_t magic = 0, int32_t version = 0) const {
    std::vector<int32_t> header(256, 0);
    header[0] = magic != 0 ? magic : (u32 ? 20240801 : 20240520);
    header[1] = version != 0 ? version : (u32 ? 7 : 1);
    header[2] = header_count >= 0 ? header_count : static_cast<int32_t>(tokens.size());
    std::vector<uint8_t> buf;
    append(&buf, header.data(), header.size() * 4);
    for (uint32_t t : tokens) {
      if (u32) {
        append(&buf, &t, 4);
      } else {
        uint16_t v = static_cast<uint16_t>(t);
        append(&buf, &v, 2);
      }
    }
    write_bytes(path(name), buf.data(), buf.size());
    return path(name);
  }

  // A Megatron pair with uint16 tokens (dtype 8). Sequences are written to .bin in reverse
  // order with a gap, so that reading back in order proves the pointers are followed.
  // pointer_bump is added to the last sequence's pointer (to corrupt it).
  std::string write_megatron(const std::string& prefix, const std::vector<std::vector<uint16_t>>& seqs,
                             int64_t pointer_bump = 0, const char* magic = "MMIDIDX\0\0",
                             uint8_t dtype = 8) const {
    std::vector<uint8_t> bin;
    std::vector<int64_t> pointers(seqs.size());
    for (size_t i = seqs.size(); i-- > 0;) {
      uint16_t gap = 0xEEEE;
      append(&bin, &gap, 2);
      pointers[i] = static_cast<int64_t>(bin.size());
      append(&bin, seqs[i].data(), seqs[i].size() * 2);
    }
    if (!pointers.empty()) pointers.back() += pointer_bump;
    std::vector<uint8_t> idx;
    append(&idx, magic, 9);
    uint64_t version = 1, num_seq = seqs.size(), num_docs = seqs.size() + 1;
    append(&idx, &version, 8);
    append(&idx, &dtype, 1);
    append(&idx, &num_seq, 8);
    append(&idx, &num_docs, 8);
    for (const auto& s : seqs) {
      int32_t n = static_cast<int32_t>(s.size());
      append(&idx, &n, 4);
    }
    append(&idx, pointers.data(), pointers.size() * 8);
    for (int64_t d = 0; d <= static_cast<int64_t>(seqs.size()); ++d) append(&idx, &d, 8);
    write_bytes(path(prefix + ".bin"), bin.data(), bin.size());
    write_bytes(path(prefix + ".idx"), idx.data(), idx.size());
    return path(prefix);
  }

  std::string write_text(const std::string& name, const std::string& text) const {
    write_bytes(path(name), text.data(), text.size());
    return path(name);
  }

  static std::vector<int32_t> read_all(const TokenDataset& d) {
    std::vector<int32_t> out(static_cast<size_t>(d.num_tokens()));
    EXPECT_TRUE(d.read(0, d.num_tokens(), out.data()).ok());
    return out;
  }

  static Result<std::unique_ptr<TokenDataset>> open(const std::vector<std::string>& paths,
                                                    const std::string& format = "auto") {
    DataConfig config;
    config.paths = paths;
    config.format = format;
    return open_dataset(config);
  }

  // A dataset whose token at stream position p is p: a window's first input names it.
  std::unique_ptr<TokenDataset> counting_dataset(int64_t n) {
    std::vector<uint32_t> tokens(static_cast<size_t>(n));
    std::iota(tokens.begin(), tokens.end(), 0u);
    auto d = open({write_llmc("count.bin", tokens, /*u32=*/true)});
    EXPECT_TRUE(d.ok()) << d.status().to_string();
    return std::move(d).value();
  }

  std::string dir_;
};

void expect_error(const Status& s, StatusCode code, const std::vector<std::string>& needles) {
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), code) << s.to_string();
  for (const auto& n : needles) EXPECT_NE(s.message().find(n), std::string::npos) << s.message() << " lacks " << n;
}

// ---------------------------------------------------------------------------------------------
// Readers

TEST_F(DataTest, LlmcShardWithUint16TokensReadsBack) {
  auto d = open({write_llmc("a.bin", {5, 0, 65535, 7}, /*u32=*/false)});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->num_tokens(), 4);
  EXPECT_EQ((*d)->vocab_hint(), -1);
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{5, 0, 65535, 7}));
}

TEST_F(DataTest, LlmcShardWithUint32TokensReadsBack) {
  auto d = open({write_llmc("a.bin", {1, 128255, 70000}, /*u32=*/true)});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{1, 128255, 70000}));
  std::vector<int32_t> mid(1);
  ASSERT_TRUE((*d)->read(1, 1, mid.data()).ok());
  EXPECT_EQ(mid[0], 128255);
}

TEST_F(DataTest, LlmcLlama3ShardHasVersion7AndReads) {
  const std::string f = write_llmc("llama3.bin", {128000, 9906, 128001}, /*u32=*/true);
  std::ifstream in(f, std::ios::binary);
  int32_t header[2];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  ASSERT_EQ(header[1], 7);  // the helper writes what llm.c writes
  auto d = open({f}, "llmc");
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{128000, 9906, 128001}));
}

TEST_F(DataTest, LlmcUint32ShardWithStrataVersion1StillReads) {
  auto d = open({write_llmc("old.bin", {1, 70000}, /*u32=*/true, -1, 0, /*version=*/1)});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{1, 70000}));
}

TEST_F(DataTest, LlmcVersionNotMatchingTheMagicIsCorruption) {
  // llm.c reads uint16 shards only as version 1 and uint32 shards as version 7.
  std::string f = write_llmc("v7u16.bin", {1, 2}, /*u32=*/false, -1, 0, /*version=*/7);
  expect_error(open({f}, "llmc").status(), StatusCode::kCorruption, {"v7u16.bin", "version 7", "expected 1"});
  f = write_llmc("v3u32.bin", {1, 2}, /*u32=*/true, -1, 0, /*version=*/3);
  expect_error(open({f}, "llmc").status(), StatusCode::kCorruption, {"v3u32.bin", "version 3", "expected 7"});
}

TEST_F(DataTest, LlmcTokenAboveInt32RangeIsCorruption) {
  auto d = open({write_llmc("big.bin", {1, 0x80000000u}, /*u32=*/true)});
  ASSERT_TRUE(d.ok());
  std::vector<int32_t> out(2);
  expect_error((*d)->read(0, 2, out.data()), StatusCode::kCorruption, {"big.bin", "position 1"});
}

// A token file truncated while a run reads it: the reads past its new end fail naming the file
// (the mapping it was read through raised SIGBUS and killed the process); a file replaced by
// rename is still read as it was opened.
TEST_F(DataTest, AFileTruncatedUnderneathTheReaderIsAnErrorNotASignal) {
  std::vector<uint32_t> tokens(5000);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<uint32_t>(i % 1000);
  const std::string shard = write_llmc("shard.bin", tokens, /*u32=*/true);
  const std::string prefix = write_megatron("shrinks", {std::vector<uint16_t>(3000, 7), std::vector<uint16_t>(3000, 9)});
  const std::string text = path("shrinks.txt");
  std::ofstream(text) << std::string(9000, 'x');
  for (const std::string& f : {shard, prefix + ".bin", text}) {
    auto d = open({f == prefix + ".bin" ? prefix : f});
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    const int64_t n = (*d)->num_tokens();
    ASSERT_EQ(::truncate(f.c_str(), 1024), 0);
    std::vector<int32_t> out(64);
    expect_error((*d)->read(n - 64, 64, out.data()), StatusCode::kCorruption,
                 {fs::path(f).filename().string(), "truncated while the run read it"});
  }
  // Replaced by rename: the open reader keeps the file it opened.
  const std::string kept = write_llmc("kept.bin", {11, 12, 13}, /*u32=*/true);
  auto d = open({kept});
  ASSERT_TRUE(d.ok());
  const std::string other = write_llmc("other.bin", {1}, /*u32=*/true);
  fs::rename(other, kept);
  std::vector<int32_t> out(3);
  ASSERT_TRUE((*d)->read(0, 3, out.data()).ok());
  EXPECT_EQ(out, (std::vector<int32_t>{11, 12, 13}));
}

TEST_F(DataTest, MegatronPairReadsSequencesAsOneStream) {
  std::string prefix = write_megatron("mega", {{1, 2, 3}, {}, {4, 5}, {6}});
  for (const std::string& p : {prefix, prefix + ".bin", prefix + ".idx"}) {
    auto d = open({p});
    ASSERT_TRUE(d.ok()) << p << ": " << d.status().to_string();
    EXPECT_EQ((*d)->num_sources(), 1);
    EXPECT_EQ(read_all(**d), (std::vector<int32_t>{1, 2, 3, 4, 5, 6}));
    std::vector<int32_t> span(3);
    ASSERT_TRUE((*d)->read(2, 3, span.data()).ok());
    EXPECT_EQ(span, (std::vector<int32_t>{3, 4, 5}));
  }
}

TEST_F(DataTest, MegatronPairInDirectoryIsOpenedOnce) {
  write_megatron("mega", {{1, 2}, {3}});
  auto d = open({dir_, path("mega.bin")});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->num_sources(), 1);
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{1, 2, 3}));
}

TEST_F(DataTest, MegatronFormatExplicit) {
  std::string prefix = write_megatron("m", {{9, 8}});
  auto d = open({prefix + ".bin"}, "megatron");
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{9, 8}));
}

TEST_F(DataTest, TextIsOneTokenPerByte) {
  auto d = open({write_text("notes.txt", "Hi\n\xff")});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->vocab_hint(), 256);
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{'H', 'i', '\n', 255}));
}

TEST_F(DataTest, AutoReadsFilesWithoutLlmcMagicAsText) {
  auto d = open({write_text("README", "abc")});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{'a', 'b', 'c'}));
  // An llm.c shard is recognised by its magic whatever its name.
  auto s = open({write_llmc("shard.dat", {3, 4}, false)});
  ASSERT_TRUE(s.ok()) << s.status().to_string();
  EXPECT_EQ(read_all(**s), (std::vector<int32_t>{3, 4}));
}

TEST_F(DataTest, BinWithoutMagicIsAnErrorUnlessFormatIsText) {
  std::string f = write_text("blob.bin", std::string(2000, 'x'));
  expect_error(open({f}).status(), StatusCode::kCorruption, {"blob.bin", "magic"});
  auto d = open({f}, "text");
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->num_tokens(), 2000);
}

// ---------------------------------------------------------------------------------------------
// Bad inputs

TEST_F(DataTest, MissingPathIsNotFoundNamingIt) {
  expect_error(open({path("nope.bin")}).status(), StatusCode::kNotFound, {"nope.bin", "glob"});
  expect_error(open({path("*.nothing")}).status(), StatusCode::kNotFound, {"*.nothing"});
  expect_error(open_llmc_shard(path("gone.bin")).status(), StatusCode::kNotFound, {"gone.bin"});
}

TEST_F(DataTest, WrongMagicIsCorruption) {
  std::string f = write_llmc("bad.bin", {1, 2}, false, -1, /*magic=*/12345);
  expect_error(open({f}, "llmc").status(), StatusCode::kCorruption, {"bad.bin", "12345", "20240520"});
}

TEST_F(DataTest, TruncatedShardIsCorruptionWithSizes) {
  std::string f = write_llmc("t.bin", {1, 2, 3}, false, /*header_count=*/1000);
  expect_error(open({f}).status(), StatusCode::kCorruption,
               {"t.bin", "truncated", "1000 tokens", "3024 bytes", "1030 bytes", "re-create"});
}

TEST_F(DataTest, FileShorterThanHeaderIsCorruption) {
  std::string f = write_text("short.bin", "tiny");
  expect_error(open({f}, "llmc").status(), StatusCode::kCorruption, {"short.bin", "1024 bytes"});
}

TEST_F(DataTest, MegatronPointerOutOfRangeIsCorruption) {
  write_megatron("m", {{1, 2}, {3, 4}}, /*pointer_bump=*/1000);
  expect_error(open({path("m.bin")}).status(), StatusCode::kCorruption, {"m.idx", "m.bin", "sequence 1"});
}

// A uint16 sequence at an odd byte offset would be read a byte off, as garbage tokens.
TEST_F(DataTest, MegatronPointerMisalignedToItsDtypeIsCorruption) {
  write_megatron("m", {{1, 2}, {3, 4}}, /*pointer_bump=*/1);
  expect_error(open({path("m.bin")}).status(), StatusCode::kCorruption,
               {"m.idx", "sequence 1", "not a multiple of its 2-byte tokens"});
}

TEST_F(DataTest, MegatronBadMagicAndFloatDtypeAreCorruption) {
  write_megatron("a", {{1}}, 0, "NOTANIDX\0");
  expect_error(open({path("a.idx")}).status(), StatusCode::kCorruption, {"a.idx", "magic"});
  write_megatron("f", {{1}}, 0, "MMIDIDX\0\0", /*dtype=*/7);
  expect_error(open({path("f.idx")}).status(), StatusCode::kCorruption, {"f.idx", "dtype"});
}

TEST_F(DataTest, EmptyDatasetIsAnError) {
  write_text("empty.txt", "");
  expect_error(open({dir_}).status(), StatusCode::kInvalidArgument, {"no tokens", dir_});
  expect_error(open({}).status(), StatusCode::kInvalidArgument, {"no data paths"});
  expect_error(open({dir_}, "csv").status(), StatusCode::kInvalidArgument, {"csv"});
}

// ---------------------------------------------------------------------------------------------
// Datasets of several files

TEST_F(DataTest, DirectoryAndGlobConcatenateSortedFiles) {
  write_llmc("b.bin", {20, 21}, false);
  write_llmc("a.bin", {10, 11, 12}, true);
  write_text(".hidden", "zzz");
  auto d = open({dir_});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->num_sources(), 2);
  EXPECT_EQ(read_all(**d), (std::vector<int32_t>{10, 11, 12, 20, 21}));
  std::vector<int32_t> span(2);
  ASSERT_TRUE((*d)->read(2, 2, span.data()).ok());
  EXPECT_EQ(span, (std::vector<int32_t>{12, 20}));
  EXPECT_EQ((*d)->describe_position(4), "position 1 in " + path("b.bin"));

  auto g = open({dir_ + "/*.bin", path("a.bin")});  // a.bin named twice is read once
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_EQ(read_all(**g), (std::vector<int32_t>{10, 11, 12, 20, 21}));
}

// ---------------------------------------------------------------------------------------------
// Loader

TEST(WindowOrderTest, IsADeterministicPermutationPerSeedAndEpoch) {
  auto a = window_order(1000, 7, 0);
  std::vector<int64_t> sorted = a;
  std::sort(sorted.begin(), sorted.end());
  std::vector<int64_t> iota(1000);
  std::iota(iota.begin(), iota.end(), 0);
  EXPECT_EQ(sorted, iota);
  EXPECT_EQ(a, window_order(1000, 7, 0));
  EXPECT_NE(a, window_order(1000, 7, 1));
  EXPECT_NE(a, window_order(1000, 8, 0));
  EXPECT_NE(a, iota);
}

TEST(WindowOrderTest, MatchesPinnedValues) {
  // Pinned (and checked against an independent Python version of splitmix64 + Fisher-Yates) so
  // that a change of generator, which would silently change resumed runs, fails.
  EXPECT_EQ(window_order(10, 42, 3), (std::vector<int64_t>{7, 8, 5, 3, 4, 9, 0, 6, 2, 1}));
}

TEST_F(DataTest, BatchesAreShiftedWindowsAtStrideT) {
  auto d = counting_dataset(1001);
  const int64_t B = 4, T = 10;
  auto loader = DataLoader::create(d.get(), {.batch_size = B, .seq_len = T, .seed = 1});
  ASSERT_TRUE(loader.ok()) << loader.status().to_string();
  EXPECT_EQ(loader->num_windows(), 100);
  EXPECT_EQ(loader->batches_per_epoch(), 25);
  std::vector<int32_t> in(B * T), tg(B * T);
  ASSERT_TRUE(loader->next(in.data(), tg.data()).ok());
  for (int64_t b = 0; b < B; ++b) {
    int32_t start = in[b * T];
    EXPECT_EQ(start % T, 0);
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(in[b * T + t], start + t);
      EXPECT_EQ(tg[b * T + t], start + t + 1);
    }
  }
}

// The windows (by start token) a loader serves in `steps` micro-batches.
std::vector<int32_t> serve(DataLoader* loader, int steps) {
  const int64_t B = loader->options().batch_size, T = loader->options().seq_len;
  std::vector<int32_t> in(B * T), tg(B * T), starts;
  for (int s = 0; s < steps; ++s) {
    Status st = loader->next(in.data(), tg.data());
    EXPECT_TRUE(st.ok()) << st.to_string();
    for (int64_t b = 0; b < B; ++b) starts.push_back(in[b * T]);
  }
  return starts;
}

TEST_F(DataTest, SameSeedGivesSameBatchesOtherSeedDiffers) {
  auto d = counting_dataset(2001);
  DataLoaderOptions o{.batch_size = 3, .seq_len = 8, .seed = 5};
  auto a = DataLoader::create(d.get(), o);
  auto b = DataLoader::create(d.get(), o);
  o.seed = 6;
  auto c = DataLoader::create(d.get(), o);
  ASSERT_TRUE(a.ok() && b.ok() && c.ok());
  auto sa = serve(&*a, 20);
  EXPECT_EQ(sa, serve(&*b, 20));
  EXPECT_NE(sa, serve(&*c, 20));
}

TEST_F(DataTest, CursorResumeGivesTheSameBatches) {
  auto d = counting_dataset(2001);
  DataLoaderOptions o{.batch_size = 2, .seq_len = 16, .seed = 11};
  auto a = DataLoader::create(d.get(), o);
  ASSERT_TRUE(a.ok());
  serve(&*a, 70);  // past the first epoch (62 steps)
  DataCursor saved = a->cursor();
  EXPECT_EQ(saved.epoch, 1u);
  auto expected = serve(&*a, 10);

  auto b = DataLoader::create(d.get(), o);
  ASSERT_TRUE(b.ok());
  ASSERT_TRUE(b->set_cursor(saved).ok());
  EXPECT_EQ(b->cursor(), saved);
  EXPECT_EQ(serve(&*b, 10), expected);
  EXPECT_FALSE(b->set_cursor({0, 1000}).ok());
}

TEST_F(DataTest, EpochVisitsEachWindowOnceThenRollsOver) {
  auto d = counting_dataset(10 * 8 + 1);  // 10 windows of T = 8
  DataLoaderOptions o{.batch_size = 3, .seq_len = 8, .seed = 2};
  auto l = DataLoader::create(d.get(), o);
  ASSERT_TRUE(l.ok());
  ASSERT_EQ(l->batches_per_epoch(), 3);
  auto e0 = serve(&*l, 3);
  EXPECT_EQ(std::set<int32_t>(e0.begin(), e0.end()).size(), 9u);  // one window left over
  EXPECT_EQ(l->cursor(), (DataCursor{0, 9}));
  auto e1 = serve(&*l, 3);
  EXPECT_EQ(l->cursor(), (DataCursor{1, 9}));
  EXPECT_EQ(std::set<int32_t>(e1.begin(), e1.end()).size(), 9u);
  EXPECT_NE(e0, e1);
}

TEST_F(DataTest, RanksServeDisjointWindows) {
  auto d = counting_dataset(64 * 4 + 1);  // 64 windows of T = 4
  const int kWorld = 3;
  std::vector<std::vector<int32_t>> per_rank;
  for (int r = 0; r < kWorld; ++r) {
    auto l = DataLoader::create(d.get(), {.batch_size = 2, .seq_len = 4, .seed = 9, .rank = r, .world_size = kWorld});
    ASSERT_TRUE(l.ok());
    EXPECT_EQ(l->batches_per_epoch(), 10);
    per_rank.push_back(serve(&*l, 10));
  }
  std::set<int32_t> all;
  for (const auto& s : per_rank) all.insert(s.begin(), s.end());
  EXPECT_EQ(all.size(), 60u);  // 3 ranks x 10 steps x 2 sequences, none shared
}

TEST_F(DataTest, TooSmallDatasetSaysHowManyTokensAreNeeded) {
  auto d = counting_dataset(50);
  auto l = DataLoader::create(d.get(), {.batch_size = 4, .seq_len = 8, .world_size = 2});
  expect_error(l.status(), StatusCode::kInvalidArgument, {"50 tokens", "6 windows", "65 tokens"});
}

TEST_F(DataTest, TokenOutsideVocabularyNamesFileAndPosition) {
  std::vector<uint32_t> tokens(33, 1);
  tokens[20] = 50257;
  auto d = open({write_llmc("v.bin", tokens, false)});
  ASSERT_TRUE(d.ok());
  auto l = DataLoader::create(d->get(), {.batch_size = 4, .seq_len = 8, .vocab_size = 32000});
  ASSERT_TRUE(l.ok());
  std::vector<int32_t> in(32), tg(32);
  expect_error(l->next(in.data(), tg.data()), StatusCode::kInvalidArgument,
               {"token 50257", "position 20 in " + path("v.bin"), "32000"});
  EXPECT_EQ(l->cursor(), (DataCursor{0, 0}));
}

// ---------------------------------------------------------------------------------------------
// Default corpus

// data.packing: document. The windows are those of concat packing, and within each row the
// positions restart after every EOS ('\n' here) and the EOS's target, the next document's first
// token, is -1; everything else is as concat serves it.
TEST_F(DataTest, DocumentPackingRestartsPositionsAfterEachEosAndSkipsItsTarget) {
  std::string text;
  for (int d = 0; d < 40; ++d) text += std::string(1 + (d * 7) % 11, static_cast<char>('a' + d % 26)) + "\n";
  auto d = open({write_text("docs.txt", text)});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  const int64_t B = 3, T = 16;
  DataLoaderOptions o{.batch_size = B, .seq_len = T, .seed = 5};
  auto concat = DataLoader::create(d->get(), o);
  o.packing = Packing::kDocument;
  o.eos_id = '\n';
  auto docs = DataLoader::create(d->get(), o);
  ASSERT_TRUE(concat.ok() && docs.ok());
  std::vector<int32_t> in(B * T), tg(B * T), pos(B * T), cin(B * T), ctg(B * T);
  int64_t restarts = 0;
  for (int step = 0; step < 6; ++step) {
    ASSERT_TRUE(concat->next(cin.data(), ctg.data()).ok());
    ASSERT_TRUE(docs->next(in.data(), tg.data(), pos.data()).ok());
    EXPECT_EQ(in, cin);
    for (int64_t i = 0; i < B * T; ++i) {
      const int64_t t = i % T;
      const bool after_eos = t > 0 && in[i - 1] == '\n';
      EXPECT_EQ(pos[i], t == 0 || after_eos ? 0 : pos[i - 1] + 1) << "step " << step << " token " << i;
      EXPECT_EQ(tg[i], in[i] == '\n' ? -1 : ctg[i]) << "step " << step << " token " << i;
      restarts += after_eos ? 1 : 0;
    }
  }
  EXPECT_GT(restarts, 10);
}

TEST_F(DataTest, DocumentPackingNeedsAnEosIdAndNamesIt) {
  auto d = counting_dataset(200);
  auto loader = DataLoader::create(d.get(), {.batch_size = 2, .seq_len = 8, .packing = Packing::kDocument});
  expect_error(loader.status(), StatusCode::kInvalidArgument, {"data.packing: document", "data.eos_id"});
  auto outside = DataLoader::create(
      d.get(), {.batch_size = 2, .seq_len = 8, .vocab_size = 300, .packing = Packing::kDocument, .eos_id = 300});
  expect_error(outside.status(), StatusCode::kInvalidArgument, {"data.eos_id", "[0, 300)"});
  EXPECT_EQ(parse_packing("document").value(), Packing::kDocument);
  EXPECT_EQ(parse_packing("concat").value(), Packing::kConcat);
  expect_error(parse_packing("docs").status(), StatusCode::kInvalidArgument,
               {"data.packing", "'docs'", "concat", "document"});
}

TEST_F(DataTest, DefaultCorpusConcatenatesSortedTextsOnce) {
  fs::create_directory(path("lic"));
  write_text("lic/B", "bee\n");
  write_text("lic/A", "ay");
  fs::create_symlink(path("lic/B"), path("lic/C"));  // duplicate of B
  std::string out = path("out/corpus.txt");
  auto r = build_default_corpus(out, path("lic"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, out);
  std::ifstream in(out);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "ay\nbee\n");
  EXPECT_FALSE(fs::exists(out + ".tmp"));
}

TEST_F(DataTest, DefaultCorpusFromMissingFolderNamesIt) {
  expect_error(build_default_corpus(path("c.txt"), path("no_licenses")).status(), StatusCode::kNotFound,
               {"no_licenses"});
}

TEST_F(DataTest, DefaultCorpusFromSystemLicensesLoads) {
  if (!fs::is_directory(kDefaultCorpusSource)) GTEST_SKIP() << kDefaultCorpusSource << " is absent";
  auto r = build_default_corpus(path("corpus.txt"));
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  auto d = open({*r});
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ((*d)->vocab_hint(), 256);
  EXPECT_GT((*d)->num_tokens(), 100000);
}

}  // namespace
}  // namespace strata

namespace strata {
namespace {

// A shard with a loss mask beside it (as `strata data tokenize` writes for chat data): the
// loader turns the targets at masked positions into -1, so they do not count in the loss.
TEST(DataLoaderMasks, MaskedTokensAreNotTargets) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::path(::testing::TempDir()) / "strata_mask_test";
  fs::remove_all(dir);
  fs::create_directories(dir / "masks");
  constexpr int32_t kTokens = 64;
  std::vector<int32_t> header(256, 0);
  header[0] = kLlmcMagicU16;
  header[1] = 1;
  header[2] = kTokens;
  {
    std::ofstream shard(dir / "train_000000.bin", std::ios::binary);
    shard.write(reinterpret_cast<const char*>(header.data()), 1024);
    for (uint16_t t = 0; t < kTokens; ++t) shard.write(reinterpret_cast<const char*>(&t), 2);
  }
  header[0] = kLossMaskMagic;
  {
    std::ofstream mask(dir / "masks" / "train_000000.mask", std::ios::binary);
    mask.write(reinterpret_cast<const char*>(header.data()), 1024);
    for (int32_t t = 0; t < kTokens; ++t) mask.put(static_cast<char>(t % 3 == 0 ? 1 : 0));
  }
  auto ds = open_dataset({.paths = {(dir / "train_000000.bin").string()}, .format = "auto"});
  ASSERT_TRUE(ds.ok()) << ds.status().to_string();
  ASSERT_TRUE((*ds)->has_masks());
  auto loader = DataLoader::create(ds->get(), {.batch_size = 2, .seq_len = 8, .seed = 3});
  ASSERT_TRUE(loader.ok()) << loader.status().to_string();
  std::vector<int32_t> in(16), tgt(16);
  int counted = 0;
  for (int step = 0; step < 4; ++step) {
    ASSERT_TRUE(loader->next(in.data(), tgt.data()).ok());
    for (int i = 0; i < 16; ++i) {
      const int32_t next_token = in[i] + 1;  // tokens are 0, 1, 2, ...: the target is the next id
      if (next_token % 3 == 0) {
        EXPECT_EQ(tgt[i], next_token);
        ++counted;
      } else {
        EXPECT_EQ(tgt[i], -1) << "target " << next_token << " is masked";
      }
    }
  }
  EXPECT_GT(counted, 0);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace strata
