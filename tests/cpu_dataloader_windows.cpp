// The data loader reads one window per batch from the shard file (issue 14, item 5) instead of the
// whole shard: on shards of uint16 and uint32 tokens whose sizes are no multiple of the window, every
// (rank, W, B, T) gets exactly the batches and states that the whole-shard loader gave, across shards
// and epochs and after a resume; the loader keeps O(B·T) bytes, never a shard; bad files and token ids
// ≥ V are refused with the messages of before, a bad id past the first scan block included.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include "data/dataloader.hpp"
#include "data/shards.hpp"
#include "tests/test_util.hpp"

namespace {

using testutil::TempDir;

struct Batch {
  std::vector<int> inputs, targets;
  data::DataLoader::State after;  // the loader's state once the batch is read
};

// The loader's batch logic before windowed reads (whole shards in memory, data/dataloader.hpp up to
// issue 14): from state `s`, `count` batches of rank `rank` of `W` over `shards`.
std::vector<Batch> batches_before_windowed_reads(const std::vector<std::vector<int>>& shards, int B, int T, int rank,
                                                 int W, data::DataLoader::State s, int count) {
  const long long batch = (long long)B * T, window = (long long)W * B * T;
  std::vector<Batch> out;
  for (int i = 0; i < count; i++) {
    const std::vector<int>& tokens = shards[s.shard];
    const int* start = tokens.data() + s.position + rank * batch;
    Batch b{std::vector<int>(start, start + batch), std::vector<int>(start + 1, start + batch + 1), {}};
    s.position += window;
    if (s.position + window + 1 > (long long)tokens.size()) {
      s.position = 0;
      if (++s.shard == int(shards.size())) {
        s.shard = 0;
        s.epoch++;
      }
    }
    b.after = s;
    out.push_back(b);
  }
  return out;
}

Batch next(data::DataLoader& loader, int B, int T) {
  Batch b{std::vector<int>(size_t(B) * T, -7), std::vector<int>(size_t(B) * T, -7), {}};
  loader.next_batch(b.inputs.data(), b.targets.data());
  b.after = loader.state();
  return b;
}

std::vector<std::vector<int>> write_shards(const TempDir& dir, testutil::Rng& rng, const std::vector<int>& sizes,
                                           int vocab) {
  std::vector<std::vector<int>> shards;
  for (size_t s = 0; s < sizes.size(); s++) {
    std::vector<int> tokens(size_t(sizes[s]));
    for (int& t : tokens) t = rng.integer(0, vocab - 1);
    data::write_shard(dir.file("train_" + std::to_string(s) + ".bin"), tokens, vocab);
    shards.push_back(tokens);
  }
  return shards;
}

using testutil::expect_refused;

void expect_same(const Batch& got, const Batch& want, const std::string& what) {
  ASSERT_EQ(got.inputs, want.inputs) << what;
  ASSERT_EQ(got.targets, want.targets) << what;
  ASSERT_EQ(got.after.shard, want.after.shard) << what;
  ASSERT_EQ(got.after.position, want.after.position) << what;
  ASSERT_EQ(got.after.epoch, want.after.epoch) << what;
}

}  // namespace

TEST(DataLoaderWindows, SameBatchesAsWholeShardsForEveryRankAcrossEpochsAndResume) {
  testutil::Rng rng;
  struct Shape {
    int B, T, W;
  };
  for (const int V : {300, 70000}) {  // uint16 and uint32 tokens
    TempDir dir;
    const auto shards = write_shards(dir, rng, {1001, 257, 613, 130}, V);
    for (const Shape sh : {Shape{1, 1, 1}, Shape{2, 8, 1}, Shape{3, 5, 2}, Shape{2, 7, 3}, Shape{4, 4, 4}, Shape{1, 32, 4}})
      for (int rank = 0; rank < sh.W; rank++) {
        const std::string what = "V=" + std::to_string(V) + " B=" + std::to_string(sh.B) + " T=" +
                                 std::to_string(sh.T) + " W=" + std::to_string(sh.W) + " rank " + std::to_string(rank);
        data::DataLoader loader(dir.file("train_*.bin"), sh.B, sh.T, V, rank, sh.W);
        const int count = int(2 * loader.windows_per_epoch() + 3);  // two epochs and a bit
        const auto want = batches_before_windowed_reads(shards, sh.B, sh.T, rank, sh.W, {0, 0, 0}, count);
        for (int i = 0; i < count; i++) expect_same(next(loader, sh.B, sh.T), want[i], what + " batch " + std::to_string(i));
        EXPECT_EQ(loader.state().epoch, 2) << what;

        // Resume from a state saved mid-epoch, in a fresh loader.
        const int at = rng.integer(0, count - 1);
        const data::DataLoader::State saved = at == 0 ? data::DataLoader::State{0, 0, 0} : want[at - 1].after;
        data::DataLoader resumed(dir.file("train_*.bin"), sh.B, sh.T, V, rank, sh.W);
        resumed.set_state(saved);
        const auto again = batches_before_windowed_reads(shards, sh.B, sh.T, rank, sh.W, saved, count);
        for (int i = 0; i < count; i++)
          expect_same(next(resumed, sh.B, sh.T), again[i], what + " resumed at " + std::to_string(at) + ", batch " + std::to_string(i));
        // reset() starts over at the first window, also after a shard other than the first was open.
        resumed.reset();
        expect_same(next(resumed, sh.B, sh.T), want[0], what + " after reset");
      }
  }
}

// Copies of a loader (a std::vector of loaders grows by moving them) read the same batches.
TEST(DataLoaderWindows, CopiedAndMovedLoadersReadTheirOwnFile) {
  testutil::Rng rng;
  TempDir dir;
  const int V = 500, B = 2, T = 3;
  const auto shards = write_shards(dir, rng, {50, 41}, V);
  data::DataLoader a(dir.file("train_*.bin"), B, T, V);
  next(a, B, T);
  data::DataLoader b = a;  // b's first batch opens its own file
  const auto want = batches_before_windowed_reads(shards, B, T, 0, 1, a.state(), 30);
  for (int i = 0; i < 30; i++) expect_same(next(b, B, T), want[i], "copy, batch " + std::to_string(i));
  std::vector<data::DataLoader> moved;
  moved.push_back(std::move(a));
  for (int i = 0; i < 30; i++) expect_same(next(moved[0], B, T), want[i], "moved, batch " + std::to_string(i));
}

// The loader keeps one window of B·T + 1 tokens (raw bytes and ints), not the shard.
TEST(DataLoaderWindows, KeepsOneWindowNotTheShard) {
  testutil::Rng rng;
  for (const int V : {300, 70000}) {
    TempDir dir;
    const int B = 4, T = 16, n = 200000;
    write_shards(dir, rng, {n, n / 3}, V);
    data::DataLoader loader(dir.file("train_*.bin"), B, T, V);
    EXPECT_EQ(loader.buffered_bytes(), 0u) << "nothing is read before the first batch";
    const size_t window_bytes = size_t(B * T + 1) * (4 + (V > 65535 ? 4 : 2));
    for (int i = 0; i < 4000; i++) {  // crosses into the second shard
      next(loader, B, T);
      ASSERT_LE(loader.buffered_bytes(), 2 * window_bytes) << "batch " << i;
    }
    EXPECT_EQ(loader.state().shard, 1);
    EXPECT_LT(2 * window_bytes, size_t(n) / 100);
  }
}

// Refusals keep today's messages: header errors from read_shard_header, a token id ≥ V found by the
// open-time scan (also past its first block of 2^20 tokens), a uint32 token that does not fit an int
// (reported before an earlier id ≥ V, as reading the whole shard did), and a shard truncated after
// the loader was constructed, when its batches come.
TEST(DataLoaderWindows, RefusesBadShardsWithTheMessagesOfBefore) {
  testutil::Rng rng;
  TempDir dir;
  const int V = 300;
  const std::string path = dir.file("train_0.bin");

  std::vector<int> tokens((1 << 20) + 5000);
  for (int& t : tokens) t = rng.integer(0, V - 1);
  const long long bad_position = (1 << 20) + 1234;
  tokens[size_t(bad_position)] = V + 7;
  data::write_shard(path, tokens, V + 8);
  expect_refused([&] { data::DataLoader(path, 2, 8, V); },
                 {path, "token id " + std::to_string(V + 7), "position " + std::to_string(bad_position),
                  "is outside the vocabulary [0, V = " + std::to_string(V) + ")"});

  // Truncated file, bad magic, unsupported version.
  data::write_shard(path, std::vector<int>(100, 1), V);
  std::filesystem::resize_file(path, 1024 + 2 * 100 - 1);
  expect_refused([&] { data::DataLoader(path, 2, 8, V); }, {"shard " + path, "truncated", "1223 bytes, expected 1224"});
  std::filesystem::resize_file(path, 1000);
  expect_refused([&] { data::DataLoader(path, 2, 8, V); }, {"shard " + path, "truncated header"});
  data::write_shard(path, std::vector<int>(100, 1), V);
  {
    FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_TRUE(f);
    const unsigned char magic[4] = {1, 2, 3, 4};
    std::fwrite(magic, 1, 4, f);
    std::fclose(f);
  }
  expect_refused([&] { data::DataLoader(path, 2, 8, V); }, {"shard " + path, "bad magic 67305985"});

  // A uint32 token ≥ 2^31 after an id ≥ V: the int error comes first, as before.
  std::vector<int> wide(100, 5);
  wide[10] = 90000;
  data::write_shard(path, wide, 100000);
  {
    FILE* f = std::fopen(path.c_str(), "r+b");
    ASSERT_TRUE(f);
    std::fseek(f, 1024 + 4 * 60, SEEK_SET);
    const unsigned char big[4] = {0, 0, 0, 0x80};
    std::fwrite(big, 1, 4, f);
    std::fclose(f);
  }
  expect_refused([&] { data::DataLoader(path, 2, 8, 70000); }, {"shard " + path, "token 60 = 2147483648 does not fit an int"});

  // Truncated after construction: refused when its batches come, with read_shard_header's message.
  TempDir two;
  write_shards(two, rng, {40, 40}, V);
  data::DataLoader loader(two.file("train_*.bin"), 2, 4, V);
  std::filesystem::resize_file(two.file("train_1.bin"), 1024 + 2 * 40 - 2);
  std::vector<int> in(8), tg(8);
  for (int i = 0; i < 4; i++) loader.next_batch(in.data(), tg.data());  // shard 0: windows at 0, 8, 16, 24
  EXPECT_EQ(loader.state().shard, 1);
  expect_refused([&] { loader.next_batch(in.data(), tg.data()); }, {"shard " + two.file("train_1.bin"), "truncated"});
}
