// tests/cpu_checkpoint.cpp — specification of checkpoint.hpp: a rank file reads back bit for bit;
// every way it can be damaged is refused, naming the file and the reason; a checkpoint set is
// checked whole before any GPU work; resume reports what differs; and the directory operations
// that make a multi-rank save atomic.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <vector>

#include "checkpoint.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using ckpt::RankFile;

namespace {

using testutil::read_bytes;
using testutil::TempDir;
using testutil::write_bytes;

// XORs byte `pos` of the file with `mask` in place (the same call again restores it).
void flip_byte(const std::string& path, size_t pos, unsigned char mask) {
  std::fstream file(path, std::ios::binary | std::ios::in | std::ios::out);
  file.seekg((std::streamoff)pos);
  const char byte = char(file.get() ^ mask);
  file.seekp((std::streamoff)pos);
  file.put(byte);
  ASSERT_TRUE(file.good()) << path << " byte " << pos;
}

// The message of the std::runtime_error that `call` throws; "accepted" when it throws nothing.
template <typename F>
std::string refusal(F call) {
  try {
    call();
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  return "accepted";
}

#define EXPECT_MENTIONS(message, part) \
  EXPECT_NE((message).find(part), std::string::npos) << "expected '" << (part) << "' in: " << (message)

// ---- random payloads -----------------------------------------------------------------------

float random_bits_float(testutil::Rng& rng) {  // any bit pattern: NaN payloads, infinities, denormals
  const uint32_t bits = (uint32_t)rng.gen();
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

float random_finite_float(testutil::Rng& rng) {
  for (;;)
    if (const float x = random_bits_float(rng); std::isfinite(x)) return x;
}

std::string random_text(testutil::Rng& rng, int min_length) {  // printable ASCII, spaces included
  std::string text(rng.integer(min_length, 16), ' ');
  for (char& c : text) c = char(rng.integer(32, 126));
  return text;
}

// Every field random; each text has at least `min_text_length` characters.
TrainConfig random_train(testutil::Rng& rng, int min_text_length) {
  using T = TrainConfig;
  TrainConfig t;
  for (std::string T::*field : {&T::data_dir, &T::train_pattern, &T::val_pattern, &T::tokenizer, &T::out_dir,
                                &T::resume, &T::routing, &T::record_routing, &T::moe, &T::head, &T::optimizer,
                                &T::ring_dtp, &T::relay_mode, &T::device_budget, &T::device_capacity, &T::plan})
    t.*field = random_text(rng, min_text_length);
  for (int T::*field :
       {&T::batch, &T::total_batch, &T::steps, &T::warmup, &T::recompute, &T::overlap_update, &T::wgrad_stream, &T::cuda_graph, &T::val_every,
        &T::val_batches, &T::sample_every, &T::sample_len, &T::ckpt_every, &T::log_every, &T::timeline_step, &T::profile_step, &T::gpus, &T::share_gpus, &T::ep, &T::sp,
        &T::llep_min_rows, &T::token_budget, &T::kmax, &T::offload_bucket, &T::offload_slots, &T::vocab_group,
        &T::vocab_block, &T::dry_run, &T::zero, &T::attention_groups})
    t.*field = rng.integer(-2147483647, 2147483647);
  for (float T::*field :
       {&T::lr, &T::min_lr_frac, &T::weight_decay, &T::beta1, &T::beta2, &T::adam_eps, &T::grad_clip, &T::bias_update,
        &T::llep_alpha})
    t.*field = random_finite_float(rng);
  t.offload_budget = (long long)rng.gen();
  t.seed = rng.gen();
  return t;
}

ModelConfig random_valid_model(testutil::Rng& rng) {
  ModelConfig m;
  m.heads = rng.integer(1, 8);
  m.hidden = m.heads * (32 << rng.integer(0, 2));  // head dim 32, 64 or 128
  m.layers = rng.integer(1, 12);
  m.n_dense = rng.integer(0, m.layers);
  m.experts = rng.integer(1, 64);
  m.topk = rng.integer(1, std::min(m.experts, 8));
  m.expert_dim = 8 * rng.integer(1, 256);
  m.dense_dim = 8 * rng.integer(1, 256);
  m.shared_expert = rng.integer(0, 1);
  m.seq_len = rng.integer(2, 4096);
  m.vocab = rng.integer(2, 200000);
  m.score_fn = rng.integer(0, 1);
  m.renorm = rng.integer(0, 1);
  m.rope_theta = (float)rng.uniform(100, 1e6);
  m.norm_eps = (float)rng.uniform(1e-8, 1e-3);
  m.init_std = (float)rng.uniform(1e-4, 0.1);
  return m;
}

std::vector<float> random_section(testutil::Rng& rng, int max_elements) {
  std::vector<float> values(rng.integer(0, max_elements));
  for (float& v : values) v = random_bits_float(rng);
  return values;
}

// Every field random; the optimizer's four sections, of up to `max_elements` elements each.
RankFile random_rank_file(testutil::Rng& rng, int max_elements = 3000) {
  RankFile f;
  f.bf16 = rng.integer(0, 1) == 1;
  f.world = rng.integer(1, 64);
  f.ep = rng.integer(1, f.world);
  f.rank = rng.integer(0, f.world - 1);
  f.step = rng.integer(0, 2147483647);
  f.optimizer_steps = (long long)(rng.gen() >> 1);
  f.data = {rng.integer(0, 2147483647), (long long)(rng.gen() >> 1), (long long)(rng.gen() >> 1)};
  f.sample_rng_draws = rng.gen();
  f.model = random_valid_model(rng);
  f.train = random_train(rng, 0);
  for (const char* name : {"master", "adam_m", "adam_v", "router_bias"})
    f.sections.emplace_back(name, random_section(rng, max_elements));
  return f;
}

void expect_same_rank_file(const RankFile& got, const RankFile& want) {
  EXPECT_EQ(got.bf16, want.bf16);
  EXPECT_EQ(got.world, want.world);
  EXPECT_EQ(got.ep, want.ep);
  EXPECT_EQ(got.rank, want.rank);
  EXPECT_EQ(got.step, want.step);
  EXPECT_EQ(got.optimizer_steps, want.optimizer_steps);
  EXPECT_EQ(got.data.shard, want.data.shard);
  EXPECT_EQ(got.data.position, want.data.position);
  EXPECT_EQ(got.data.epoch, want.data.epoch);
  EXPECT_EQ(got.sample_rng_draws, want.sample_rng_draws);
  EXPECT_EQ(std::memcmp(&got.model, &want.model, sizeof(ModelConfig)), 0) << "model configuration";
  EXPECT_EQ(train_flag_values(got.train), train_flag_values(want.train));
  ASSERT_EQ(got.sections.size(), want.sections.size());
  for (size_t i = 0; i < want.sections.size(); i++) {
    EXPECT_EQ(got.sections[i].first, want.sections[i].first);
    ASSERT_EQ(got.sections[i].second.size(), want.sections[i].second.size()) << want.sections[i].first;
    EXPECT_EQ(std::memcmp(got.sections[i].second.data(), want.sections[i].second.data(),
                          want.sections[i].second.size() * sizeof(float)),
              0)
        << want.sections[i].first;
  }
}

// Rank files 0..world-1 of one consistent save, written into `dir`; each rank's sections differ.
std::vector<RankFile> write_consistent_set(testutil::Rng& rng, const std::string& dir, int world, bool bf16) {
  RankFile base = random_rank_file(rng, 200);
  base.world = world;
  base.ep = rng.integer(1, world);
  base.bf16 = bf16;
  std::vector<RankFile> files;
  for (int rank = 0; rank < world; rank++) {
    RankFile f = base;
    f.rank = rank;
    for (auto& section : f.sections) section.second = random_section(rng, 200);
    ckpt::write_rank_file(ckpt::rank_file(dir, rank), f);
    files.push_back(f);
  }
  return files;
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

// ---- one rank file -------------------------------------------------------------------------

TEST(CheckpointFile, ReadsBackEveryFieldAndEverySectionBitForBit) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  const RankFile written = random_rank_file(rng);
  ckpt::write_rank_file(path, written);
  const RankFile read = ckpt::read_rank_file(path);
  expect_same_rank_file(read, written);
  EXPECT_EQ(read.path, path);
  for (const auto& [name, values] : read.sections) EXPECT_EQ(&read.section(name), &values) << name;
  EXPECT_EQ(entries(tmp.path.string()), std::vector<std::string>{"rank0.bin"}) << "no .part file is left";
}

TEST(CheckpointFile, RewritingReplacesTheWholeFile) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  ckpt::write_rank_file(path, random_rank_file(rng));
  const RankFile second = random_rank_file(rng, 100);
  ckpt::write_rank_file(path, second);
  expect_same_rank_file(ckpt::read_rank_file(path), second);
}

TEST(CheckpointFile, FileLayoutStartsWithMagicVersionAndHeaderOfFixedSize) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  const RankFile f = random_rank_file(rng);
  ckpt::write_rank_file(path, f);
  const std::string bytes = read_bytes(path);
  const auto u32_at = [&](size_t offset) {
    uint32_t v;
    std::memcpy(&v, bytes.data() + offset, 4);
    return v;
  };
  const auto u64_at = [&](size_t offset) {
    uint64_t v;
    std::memcpy(&v, bytes.data() + offset, 8);
    return v;
  };
  EXPECT_EQ(u32_at(0), 20261130u);
  EXPECT_EQ(u32_at(4), 3u);
  EXPECT_EQ(u64_at(ckpt::at::file_bytes), bytes.size());
  EXPECT_EQ(u64_at(1016), ckpt::fnv1a64(bytes.data(), 1016)) << "the header checksum covers the header before it";
  EXPECT_EQ(u64_at(bytes.size() - 8), ckpt::fnv1a64(bytes.data(), bytes.size() - 8))
      << "the file checksum covers every byte before it";
  EXPECT_EQ(bytes.compare(1024, 7, "--data "), 0) << "the training flags follow the 1024-byte header";
}

TEST(CheckpointFile, EveryFlippedByteAfterTheVersionIsAChecksumMismatch) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  ckpt::write_rank_file(path, random_rank_file(rng, 40));
  const size_t size = fs::file_size(path);
  std::vector<size_t> accepted_or_misnamed;
  for (size_t pos = 8; pos < size; pos++) {  // header, flags text, every section, both checksums
    const unsigned char mask = (unsigned char)rng.integer(1, 255);
    flip_byte(path, pos, mask);
    const std::string message = refusal([&] { ckpt::read_rank_file(path); });
    flip_byte(path, pos, mask);
    if (message.find("checksum mismatch: the file is corrupt") == std::string::npos ||
        message.find(path) == std::string::npos)
      accepted_or_misnamed.push_back(pos);
    if (pos == 100 || pos == size - 1) printf("[refused] byte %zu: %s\n", pos, message.c_str());
  }
  EXPECT_EQ(accepted_or_misnamed, std::vector<size_t>{}) << "bytes whose flip was not a checksum mismatch";
}

TEST(CheckpointFile, FileThatIsNotACheckpointIsABadMagic) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  ckpt::write_rank_file(path, random_rank_file(rng, 10));
  flip_byte(path, rng.integer(0, 3), (unsigned char)rng.integer(1, 255));
  const std::string message = refusal([&] { ckpt::read_rank_file(path); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "bad magic number");
}

TEST(CheckpointFile, OlderFormatIsAnUnsupportedVersion) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  ckpt::write_rank_file(path, random_rank_file(rng, 10));
  std::string bytes = read_bytes(path);
  bytes[4] = 2;  // the 256-int32-header format before this one
  write_bytes(path, bytes);
  const std::string message = refusal([&] { ckpt::read_rank_file(path); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "unsupported version 2 (this build reads version 3)");
}

TEST(CheckpointFile, FileCutAnywhereIsTruncated) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  ckpt::write_rank_file(path, random_rank_file(rng));
  const std::string good = read_bytes(path);
  for (size_t cut : {(size_t)0, (size_t)rng.integer(1, 1023), (size_t)rng.integer(1024, (int)good.size() - 1)}) {
    write_bytes(path, good.substr(0, cut));
    const std::string message = refusal([&] { ckpt::read_rank_file(path); });
    EXPECT_MENTIONS(message, path);
    EXPECT_MENTIONS(message, "truncated: " + std::to_string(cut) + " bytes");
  }
}

TEST(CheckpointFile, BytesAfterTheChecksumAreTrailingBytes) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  ckpt::write_rank_file(path, random_rank_file(rng));
  const std::string good = read_bytes(path);
  std::string tail(rng.integer(1, 100), '\0');
  for (char& c : tail) c = char(rng.integer(0, 255));
  write_bytes(path, good + tail);
  const std::string message = refusal([&] { ckpt::read_rank_file(path); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "trailing bytes: " + std::to_string(tail.size()) + " after the " +
                               std::to_string(good.size()) + " it was written with");
}

TEST(CheckpointFile, MissingFileCannotBeOpened) {
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  const std::string message = refusal([&] { ckpt::read_rank_file(path); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "cannot open: No such file or directory");
}

TEST(CheckpointFile, HeaderWhoseLengthsDoNotAddUpIsMalformed) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  ckpt::write_rank_file(path, random_rank_file(rng));
  std::string bytes = read_bytes(path);
  uint64_t flags_bytes;  // longer flags text, same file length, and a header checksum that matches
  std::memcpy(&flags_bytes, &bytes[ckpt::at::flags_bytes], 8);
  flags_bytes += 4 * rng.integer(1, 1000);
  std::memcpy(&bytes[ckpt::at::flags_bytes], &flags_bytes, 8);
  const uint64_t header_checksum = ckpt::fnv1a64(bytes.data(), ckpt::at::header_checksum);
  std::memcpy(&bytes[ckpt::at::header_checksum], &header_checksum, 8);
  write_bytes(path, bytes);
  const std::string message = refusal([&] { ckpt::read_rank_file(path); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "malformed header: its lengths do not add up");
}

TEST(CheckpointFile, InvalidModelConfigurationIsRefused) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  RankFile f = random_rank_file(rng, 10);
  f.model.heads = 2 * rng.integer(1, 4);
  f.model.hidden = 64 * f.model.heads + 1;
  ckpt::write_rank_file(path, f);
  const std::string message = refusal([&] { ckpt::read_rank_file(path); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "invalid model configuration: hidden (" + std::to_string(f.model.hidden) +
                               ") must be divisible by heads");
}

TEST(CheckpointFile, MissingSectionIsNamedWithTheFile) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  RankFile f = random_rank_file(rng, 10);
  f.sections.pop_back();
  ckpt::write_rank_file(path, f);
  const RankFile read = ckpt::read_rank_file(path);
  const std::string message = refusal([&] { read.section("router_bias"); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "no section 'router_bias' (it has: master, adam_m, adam_v)");
}

TEST(CheckpointFile, WritingIntoAMissingDirectoryThrowsAndLeavesNothing) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string dir = tmp.file("absent"), path = ckpt::rank_file(dir, 0);
  const std::string message = refusal([&] { ckpt::write_rank_file(path, random_rank_file(rng, 10)); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "No such file or directory");
  EXPECT_FALSE(fs::exists(dir));
  EXPECT_TRUE(entries(tmp.path.string()).empty());
}

TEST(CheckpointFile, MoreSectionsThanTheHeaderHoldsAreRefusedBeforeWriting) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  RankFile f = random_rank_file(rng, 10);
  while (f.sections.size() <= ckpt::kMaxSections)
    f.sections.emplace_back("extra" + std::to_string(f.sections.size()), random_section(rng, 10));
  const std::string message = refusal([&] { ckpt::write_rank_file(path, f); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "19 sections, the header holds at most 18");
  EXPECT_TRUE(entries(tmp.path.string()).empty());
}

TEST(CheckpointFile, SectionNamesThatCannotIdentifyASectionAreRefusedBeforeWriting) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  for (const std::string& name :
       {std::string(), std::string(40, 'n'), std::string("adam\0m", 6), std::string("master")}) {
    RankFile f = random_rank_file(rng, 10);
    f.sections.emplace_back(name, random_section(rng, 10));
    const std::string message = refusal([&] { ckpt::write_rank_file(path, f); });
    EXPECT_MENTIONS(message, path);
    if (name == "master")
      EXPECT_MENTIONS(message, "two sections are named 'master'");
    else
      EXPECT_MENTIONS(message, "section 4: its name must have 1 to 39 bytes and no NUL byte (it has " +
                                   std::to_string(name.size()) + ")");
  }
  EXPECT_TRUE(entries(tmp.path.string()).empty());
}

TEST(CheckpointFile, FlagValueWithANewlineIsRefusedBeforeWriting) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string path = tmp.file("rank0.bin");
  RankFile f = random_rank_file(rng, 10);
  f.train.out_dir = random_text(rng, 0) + "\n" + random_text(rng, 0);
  const std::string message = refusal([&] { ckpt::write_rank_file(path, f); });
  EXPECT_MENTIONS(message, path);
  EXPECT_MENTIONS(message, "the value of --out has a newline");
  EXPECT_TRUE(entries(tmp.path.string()).empty());
}

// ---- a checkpoint set ------------------------------------------------------------------------

TEST(CheckpointSet, ConsistentSetIsAccepted) {
  testutil::Rng rng;
  TempDir tmp;
  const int world = rng.integer(1, 4);
  const bool bf16 = rng.integer(0, 1) == 1;
  write_consistent_set(rng, tmp.path.string(), world, bf16);
  EXPECT_NO_THROW(ckpt::check_checkpoint_set(tmp.path.string(), world, bf16));
}

TEST(CheckpointSet, MissingRankFileIsNamed) {
  testutil::Rng rng;
  TempDir tmp;
  const int world = rng.integer(2, 4), missing = rng.integer(0, world - 1);
  write_consistent_set(rng, tmp.path.string(), world, false);
  fs::remove(ckpt::rank_file(tmp.path.string(), missing));
  const std::string message = refusal([&] { ckpt::check_checkpoint_set(tmp.path.string(), world, false); });
  EXPECT_MENTIONS(message, ckpt::rank_file(tmp.path.string(), missing) + ": cannot open");
}

TEST(CheckpointSet, CorruptRankFileIsNamed) {
  testutil::Rng rng;
  TempDir tmp;
  const int world = rng.integer(2, 4), corrupt = rng.integer(0, world - 1);
  write_consistent_set(rng, tmp.path.string(), world, false);
  const std::string path = ckpt::rank_file(tmp.path.string(), corrupt);
  flip_byte(path, rng.integer(1024, (int)fs::file_size(path) - 1), (unsigned char)rng.integer(1, 255));
  const std::string message = refusal([&] { ckpt::check_checkpoint_set(tmp.path.string(), world, false); });
  EXPECT_MENTIONS(message, path + ": checksum mismatch");
}

TEST(CheckpointSet, SetFromAnotherWIsRefused) {
  testutil::Rng rng;
  TempDir tmp;
  const int written_world = rng.integer(2, 4);
  write_consistent_set(rng, tmp.path.string(), written_world, false);
  const std::string message = refusal([&] { ckpt::check_checkpoint_set(tmp.path.string(), written_world - 1, false); });
  EXPECT_MENTIONS(message, ckpt::rank_file(tmp.path.string(), 0) + ": W: written by a run of W=" +
                               std::to_string(written_world) + "; this run has W=" + std::to_string(written_world - 1));
}

TEST(CheckpointSet, RankFileFromAnotherWIsNamed) {
  testutil::Rng rng;
  TempDir tmp;
  const int world = rng.integer(2, 4), stranger = rng.integer(0, world - 1);
  std::vector<RankFile> files = write_consistent_set(rng, tmp.path.string(), world, false);
  files[stranger].world = world + 1;
  ckpt::write_rank_file(ckpt::rank_file(tmp.path.string(), stranger), files[stranger]);
  const std::string message = refusal([&] { ckpt::check_checkpoint_set(tmp.path.string(), world, false); });
  EXPECT_MENTIONS(message, ckpt::rank_file(tmp.path.string(), stranger) +
                               ": W: written by a run of W=" + std::to_string(world + 1));
}

TEST(CheckpointSet, FileHoldingAnotherRankIsNamed) {
  testutil::Rng rng;
  TempDir tmp;
  const int world = rng.integer(2, 4);
  write_consistent_set(rng, tmp.path.string(), world, false);
  fs::copy_file(ckpt::rank_file(tmp.path.string(), 1), ckpt::rank_file(tmp.path.string(), 0),
                fs::copy_options::overwrite_existing);
  const std::string message = refusal([&] { ckpt::check_checkpoint_set(tmp.path.string(), world, false); });
  EXPECT_MENTIONS(message, ckpt::rank_file(tmp.path.string(), 0) + ": rank: the file holds rank 1");
}

TEST(CheckpointSet, OtherPrecisionIsRefused) {
  testutil::Rng rng;
  TempDir tmp;
  const int world = rng.integer(1, 4);
  write_consistent_set(rng, tmp.path.string(), world, true);
  const std::string message = refusal([&] { ckpt::check_checkpoint_set(tmp.path.string(), world, false); });
  EXPECT_MENTIONS(message, ckpt::rank_file(tmp.path.string(), 0) +
                               ": precision: written by the BF16 build; this is the FP32 build");
}

TEST(CheckpointSet, FilesThatDisagreeOnTheStepAreRefused) {
  testutil::Rng rng;
  TempDir tmp;
  const int world = rng.integer(2, 4), late = rng.integer(1, world - 1);
  std::vector<RankFile> files = write_consistent_set(rng, tmp.path.string(), world, false);
  const int step = files[0].step;
  files[late].step = step == 0 ? 1 : step - 1;
  ckpt::write_rank_file(ckpt::rank_file(tmp.path.string(), late), files[late]);
  const std::string message = refusal([&] { ckpt::check_checkpoint_set(tmp.path.string(), world, false); });
  const std::string late_name = "rank" + std::to_string(late) + ".bin";
  EXPECT_MENTIONS(message, ckpt::rank_file(tmp.path.string(), late) + ": disagrees with rank0.bin on step: rank0.bin " +
                               std::to_string(step) + ", " + late_name + " " + std::to_string(files[late].step));
}

TEST(CheckpointSet, FilesThatDisagreeOnTheModelAreRefused) {
  testutil::Rng rng;
  TempDir tmp;
  const int world = rng.integer(2, 4), other = rng.integer(1, world - 1);
  std::vector<RankFile> files = write_consistent_set(rng, tmp.path.string(), world, false);
  files[other].model.layers += 1;
  ckpt::write_rank_file(ckpt::rank_file(tmp.path.string(), other), files[other]);
  const std::string message = refusal([&] { ckpt::check_checkpoint_set(tmp.path.string(), world, false); });
  EXPECT_MENTIONS(message, ckpt::rank_file(tmp.path.string(), other) +
                               ": disagrees with rank0.bin on layers: rank0.bin " +
                               std::to_string(files[0].model.layers));
}

// ---- what differs on resume --------------------------------------------------------------------

TEST(ModelConfigDifference, EqualConfigurationsHaveNone) {
  testutil::Rng rng;
  const ModelConfig m = random_valid_model(rng);
  const ModelConfig same = m;
  EXPECT_EQ(ckpt::model_config_difference(m, same), "");
}

TEST(ModelConfigDifference, NamesEachDifferingFieldWithBothValues) {
  testutil::Rng rng;
  const ModelConfig checkpoint = random_valid_model(rng);
  ModelConfig flags = checkpoint;
  const std::vector<std::pair<std::string, std::function<std::string(ModelConfig&)>>> changes = {
      {"vocab", [](ModelConfig& m) { return std::to_string(m.vocab += 1); }},
      {"hidden", [](ModelConfig& m) { return std::to_string(m.hidden *= 2); }},
      {"layers", [](ModelConfig& m) { return std::to_string(m.layers += 1); }},
      {"heads", [](ModelConfig& m) { return std::to_string(m.heads += 1); }},
      {"experts", [](ModelConfig& m) { return std::to_string(m.experts += 1); }},
      {"topk", [](ModelConfig& m) { return std::to_string(m.topk += 1); }},
      {"expert_dim", [](ModelConfig& m) { return std::to_string(m.expert_dim += 8); }},
      {"n_dense", [](ModelConfig& m) { return std::to_string(m.n_dense += 1); }},
      {"dense_dim", [](ModelConfig& m) { return std::to_string(m.dense_dim += 8); }},
      {"shared_expert", [](ModelConfig& m) { return std::to_string(m.shared_expert = 1 - m.shared_expert); }},
      {"seq_len", [](ModelConfig& m) { return std::to_string(m.seq_len += 1); }},
      {"score", [](ModelConfig& m) { return (m.score_fn = 1 - m.score_fn) ? "sigmoid" : "softmax"; }},
      {"renorm", [](ModelConfig& m) { return std::to_string(m.renorm = 1 - m.renorm); }},
      {"rope_theta", [](ModelConfig& m) { return float_text(m.rope_theta *= 2); }},
      {"norm_eps", [](ModelConfig& m) { return float_text(m.norm_eps *= 2); }},
      {"init_std", [](ModelConfig& m) { return float_text(m.init_std *= 2); }}};
  const std::vector<std::pair<std::string, std::string>> before = model_flag_values(checkpoint);
  std::string expected;
  for (size_t i = 0; i < changes.size(); i++) {
    if (rng.integer(0, 1) == 0) continue;
    const std::string now = changes[i].second(flags);
    expected +=
        (expected.empty() ? "" : "; ") + changes[i].first + ": checkpoint " + before[i].second + ", flags " + now;
  }
  printf("[difference] %s\n", ckpt::model_config_difference(checkpoint, flags).c_str());
  EXPECT_EQ(ckpt::model_config_difference(checkpoint, flags), expected);
}

TEST(TrainFlagDifferences, NamesEachChangedFlagWithBothValues) {
  TrainConfig checkpoint, now;
  now.steps = 2000;
  now.lr = 2e-3f;
  now.out_dir = "runs/longer";
  EXPECT_EQ(ckpt::train_flag_differences(checkpoint, now),
            (std::vector<std::string>{"--out: checkpoint runs/default, now runs/longer",
                                      "--steps: checkpoint 1200, now 2000", "--lr: checkpoint 0.001, now 0.002"}));
}

TEST(TrainFlagDifferences, ListsExactlyTheFlagsThatDiffer) {
  testutil::Rng rng;
  const TrainConfig checkpoint = random_train(rng, 8);
  TrainConfig now = random_train(rng, 8);  // every value differs from the checkpoint's (texts of 8+ characters)
  const std::vector<std::pair<std::string, std::string>> checkpoint_values = train_flag_values(checkpoint);
  std::vector<bool> agrees(checkpoint_values.size());
  for (size_t i = 0; i < checkpoint_values.size(); i++)
    if ((agrees[i] = rng.integer(0, 1) == 1))
      set_train_flag(now, checkpoint_values[i].first, checkpoint_values[i].second);
  const std::vector<std::pair<std::string, std::string>> now_values = train_flag_values(now);
  std::vector<std::string> expected;
  for (size_t i = 0; i < checkpoint_values.size(); i++)
    if (!agrees[i] && checkpoint_values[i].first != "--resume")
      expected.push_back(checkpoint_values[i].first + ": checkpoint " + checkpoint_values[i].second + ", now " +
                         now_values[i].second);
  EXPECT_EQ(ckpt::train_flag_differences(checkpoint, now), expected);
}

TEST(TrainFlagDifferences, LeavesOutResume) {
  testutil::Rng rng;
  const TrainConfig checkpoint = random_train(rng, 0);
  TrainConfig now = checkpoint;
  now.resume = random_text(rng, 1) + checkpoint.resume;
  EXPECT_TRUE(ckpt::train_flag_differences(checkpoint, now).empty());
}

// ---- directories: the atomic save of a set ---------------------------------------------------

TEST(CheckpointSave, MultiRankSaveProtocolPublishesACheckedSet) {
  testutil::Rng rng;
  TempDir tmp;
  const std::string dir = tmp.file("ckpt_000100"), staging = dir + ".tmp";
  const int world = rng.integer(1, 4);
  fs::create_directories(staging);  // left by an interrupted save: its rank files must not survive
  write_bytes(staging + "/rank0.bin", "x");
  write_bytes(staging + "/rank7.bin.part", "x");
  ckpt::make_empty_dir(staging);
  const std::vector<RankFile> files = write_consistent_set(rng, staging, world, false);
  ckpt::publish_dir(staging, dir);
  EXPECT_NO_THROW(ckpt::check_checkpoint_set(dir, world, false));
  for (int rank = 0; rank < world; rank++)
    expect_same_rank_file(ckpt::read_rank_file(ckpt::rank_file(dir, rank)), files[rank]);
  EXPECT_EQ(entries(tmp.path.string()), std::vector<std::string>{"ckpt_000100"});
  EXPECT_EQ(entries(dir).size(), (size_t)world);
}

TEST(PublishDir, ReplacesTheOldSetAndLeavesNoTmpOrOld) {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt"), staging = tmp.file("ckpt.tmp");
  fs::create_directories(dir);
  write_bytes(dir + "/rank0.bin", "old");
  write_bytes(dir + "/rank1.bin", "old");
  fs::create_directories(staging);
  write_bytes(staging + "/rank0.bin", "new");
  ckpt::publish_dir(staging, dir);
  EXPECT_EQ(entries(tmp.path.string()), std::vector<std::string>{"ckpt"});
  EXPECT_EQ(entries(dir), std::vector<std::string>{"rank0.bin"});
  EXPECT_EQ(read_bytes(dir + "/rank0.bin"), "new");
}

TEST(PublishDir, CreatesTheSetWhereNoneWas) {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt"), staging = tmp.file("ckpt.tmp");
  fs::create_directories(staging);
  write_bytes(staging + "/rank0.bin", "new");
  ckpt::publish_dir(staging, dir);
  EXPECT_EQ(entries(tmp.path.string()), std::vector<std::string>{"ckpt"});
  EXPECT_EQ(read_bytes(dir + "/rank0.bin"), "new");
}

TEST(PublishDir, FailureKeepsTheOldSetIntact) {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt"), staging = tmp.file("ckpt.tmp");
  fs::create_directories(dir);
  write_bytes(dir + "/rank0.bin", "old");
  const std::string message = refusal([&] { ckpt::publish_dir(staging, dir); });  // no staging folder
  EXPECT_MENTIONS(message, "cannot move " + staging + " to " + dir + ": No such file or directory");
  EXPECT_MENTIONS(message, "the previous set is kept");
  EXPECT_EQ(entries(tmp.path.string()), std::vector<std::string>{"ckpt"});
  EXPECT_EQ(read_bytes(dir + "/rank0.bin"), "old");
}

TEST(PublishDir, SetLeftAsideByAnInterruptedPublishIsKeptUntilTheNewOneIsIn) {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt"), staging = tmp.file("ckpt.tmp"), aside = tmp.file("ckpt.old");
  fs::create_directories(aside);  // the only complete set: an earlier publish stopped after moving it aside
  write_bytes(aside + "/rank0.bin", "old");
  EXPECT_MENTIONS(refusal([&] { ckpt::publish_dir(staging, dir); }), "cannot move " + staging);
  EXPECT_EQ(read_bytes(aside + "/rank0.bin"), "old");
  fs::create_directories(staging);
  write_bytes(staging + "/rank0.bin", "new");
  ckpt::publish_dir(staging, dir);
  EXPECT_EQ(entries(tmp.path.string()), std::vector<std::string>{"ckpt"});
  EXPECT_EQ(read_bytes(dir + "/rank0.bin"), "new");
}

TEST(CheckpointFileName, NamesARankFileOrOneBeingWritten) {
  for (const char* name : {"rank0.bin", "rank17.bin", "rank3.bin.part"}) EXPECT_TRUE(ckpt::is_checkpoint_file_name(name)) << name;
  for (const char* name : {"rank.bin", "rankx.bin", "rank0.bin.old", "rank0.binpart", "notes.txt", "rank0.bin.part.part"})
    EXPECT_FALSE(ckpt::is_checkpoint_file_name(name)) << name;
}

TEST(RemoveCheckpointDir, RemovesAFolderOfRankFiles) {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt");
  fs::create_directories(dir);
  write_bytes(dir + "/rank0.bin", "x");
  write_bytes(dir + "/rank1.bin.part", "x");
  ckpt::remove_checkpoint_dir(dir);
  EXPECT_TRUE(entries(tmp.path.string()).empty());
  EXPECT_NO_THROW(ckpt::remove_checkpoint_dir(tmp.file("absent")));
}

// What a save did not write is never removed: a folder holding another file or a folder, a link
// (not followed: what it points to stays), a plain file. Each is refused naming it, and left whole.
TEST(RemoveCheckpointDir, RefusesAnythingASaveDidNotWrite) {
  TempDir tmp;
  const std::string outside = tmp.file("outside");
  fs::create_directories(outside);
  write_bytes(outside + "/rank0.bin", "kept");
  const std::string with_file = tmp.file("with_file"), with_folder = tmp.file("with_folder"), link = tmp.file("link"),
                    file = tmp.file("file");
  fs::create_directories(with_file);
  write_bytes(with_file + "/rank0.bin", "x");
  write_bytes(with_file + "/thesis.txt", "mine");
  fs::create_directories(with_folder + "/rank1.bin");
  fs::create_directory_symlink(outside, link);
  write_bytes(file, "mine");
  EXPECT_MENTIONS(refusal([&] { ckpt::remove_checkpoint_dir(with_file); }),
                  "refusing to remove " + with_file + ": it holds thesis.txt, which a checkpoint save does not write");
  EXPECT_MENTIONS(refusal([&] { ckpt::remove_checkpoint_dir(with_folder); }), "it holds rank1.bin");
  EXPECT_MENTIONS(refusal([&] { ckpt::remove_checkpoint_dir(link); }), "refusing to remove " + link + ": it is a link");
  EXPECT_MENTIONS(refusal([&] { ckpt::remove_checkpoint_dir(file); }), "refusing to remove " + file + ": it is not a folder");
  EXPECT_EQ(read_bytes(with_file + "/rank0.bin"), "x");
  EXPECT_EQ(read_bytes(with_file + "/thesis.txt"), "mine");
  EXPECT_TRUE(fs::is_directory(with_folder + "/rank1.bin"));
  EXPECT_TRUE(fs::is_symlink(link));
  EXPECT_EQ(read_bytes(outside + "/rank0.bin"), "kept");
  EXPECT_EQ(read_bytes(file), "mine");
}

// The staging folder DIR.tmp of a save: a user's folder of that name, or a link there, is refused,
// never emptied.
TEST(MakeEmptyDir, RefusesAFolderASaveDidNotWrite) {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt_000010.tmp"), target = tmp.file("mine");
  fs::create_directories(dir);
  write_bytes(dir + "/thesis.txt", "mine");
  EXPECT_MENTIONS(refusal([&] { ckpt::make_empty_dir(dir); }), "refusing to remove " + dir + ": it holds thesis.txt");
  EXPECT_EQ(read_bytes(dir + "/thesis.txt"), "mine");
  fs::remove_all(dir);
  fs::create_directories(target);
  write_bytes(target + "/rank0.bin", "mine");
  fs::create_directory_symlink(target, dir);
  EXPECT_MENTIONS(refusal([&] { ckpt::make_empty_dir(dir); }), "it is a link");
  EXPECT_EQ(read_bytes(target + "/rank0.bin"), "mine");
}

// publish_dir replaces DIR (moved to DIR.old, then removed) only when DIR and DIR.old are checkpoint
// folders: otherwise it refuses before anything moves, and the new set stays in DIR.tmp.
TEST(PublishDir, RefusesToReplaceWhatASaveDidNotWrite) {
  TempDir tmp;
  const std::string dir = tmp.file("ckpt"), staging = tmp.file("ckpt.tmp"), aside = tmp.file("ckpt.old");
  fs::create_directories(staging);
  write_bytes(staging + "/rank0.bin", "new");
  write_bytes(dir, "a file of the user's");
  EXPECT_MENTIONS(refusal([&] { ckpt::publish_dir(staging, dir); }), "refusing to remove " + dir + ": it is not a folder");
  EXPECT_EQ(read_bytes(dir), "a file of the user's");
  fs::remove(dir);
  fs::create_directories(aside);
  write_bytes(aside + "/notes", "mine");
  EXPECT_MENTIONS(refusal([&] { ckpt::publish_dir(staging, dir); }), "refusing to remove " + aside + ": it holds notes");
  EXPECT_EQ(read_bytes(aside + "/notes"), "mine");
  EXPECT_EQ(read_bytes(staging + "/rank0.bin"), "new");
  EXPECT_FALSE(fs::exists(dir));
}

TEST(MakeEmptyDir, MissingParentIsNamed) {
  TempDir tmp;
  const std::string dir = tmp.file("absent") + "/staging";
  EXPECT_MENTIONS(refusal([&] { ckpt::make_empty_dir(dir); }),
                  "cannot create directory " + dir + ": No such file or directory");
}
