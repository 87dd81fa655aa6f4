// tests/cpu_routing_trace.cpp — specification of data/routing_trace.hpp: a trace reads back bit for
// bit in the documented layout; every way a file can be damaged is refused, naming the file and the
// problem; a trace that does not fit a run is refused naming each field with both values; writing is
// atomic (a failed write leaves the file that was there); a rank keeps its own part, and training
// pass p replays batch (p − first) mod S.
#include <sys/stat.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "data/routing_trace.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;
using data::RoutingTrace;
using data::RoutingTraceShape;

namespace {

using testutil::read_bytes;
using testutil::TempDir;
using testutil::write_bytes;

// The message of the exception that `call` throws, every part of `parts` expected in it; "accepted"
// when it throws nothing.
template <typename F>
std::string expect_refused(F call, const std::vector<std::string>& parts) {
  std::string message = "accepted";
  try {
    call();
  } catch (const std::exception& e) {
    message = e.what();
  }
  printf("[refused] %s\n", message.c_str());
  for (const std::string& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "expected '" << part << "' in: " << message;
  return message;
}

// The value the layout tests put at [batch][layer][rank][token][slot]: every coordinate shows in it.
int coordinate_value(int b, int j, int r, int n, int s, int E) { return (b * 7 + j * 5 + r * 3 + n * 11 + s) % E; }

// A trace with every field drawn at random (ranks with no tokens included), its indices in [0, E).
RoutingTrace random_trace(testutil::Rng& rng) {
  RoutingTrace t;
  RoutingTraceShape& s = t.shape;
  s.world = rng.integer(1, 5);
  s.experts = rng.integer(1, 40);
  s.topk = rng.integer(1, std::min(s.experts, 8));
  for (int layer = rng.integer(0, 3), L = rng.integer(1, 4); L > 0; L--, layer += rng.integer(1, 3)) s.layers.push_back(layer);
  for (int r = 0; r < s.world; r++) s.tokens.push_back(rng.integer(0, 3) == 0 ? 0 : rng.integer(1, 50));
  t.batches = rng.integer(1, 4);
  t.first = rng.integer(0, 1) ? rng.integer(0, 1000) : (1LL << 33) + rng.integer(0, 1000);  // the high word too
  t.indices.resize(s.batch_indices() * t.batches);
  for (int32_t& e : t.indices) e = rng.integer(0, s.experts - 1);
  return t;
}

// A small trace in the documented order, coordinate_value at every position.
RoutingTrace layout_trace() {
  RoutingTrace t;
  t.shape.world = 3;
  t.shape.experts = 97;
  t.shape.topk = 2;
  t.shape.layers = {1, 3};
  t.shape.tokens = {4, 0, 3};
  t.batches = 3;
  t.first = 10;
  for (int b = 0; b < t.batches; b++)
    for (int j = 0; j < (int)t.shape.layers.size(); j++)
      for (int r = 0; r < t.shape.world; r++)
        for (int n = 0; n < t.shape.tokens[r]; n++)
          for (int s = 0; s < t.shape.topk; s++) t.indices.push_back(coordinate_value(b, j, r, n, s, t.shape.experts));
  return t;
}

int32_t word_at(const std::string& bytes, size_t word) {
  return data::load_i32_le(reinterpret_cast<const unsigned char*>(bytes.data()) + 4 * word);
}

void set_word(std::string& bytes, size_t word, int32_t value) {
  std::string le;
  data::append_i32_le(le, value);
  bytes.replace(4 * word, 4, le);
}

void expect_same_trace(const RoutingTrace& a, const RoutingTrace& b) {
  EXPECT_EQ(a.shape.world, b.shape.world);
  EXPECT_EQ(a.shape.experts, b.shape.experts);
  EXPECT_EQ(a.shape.topk, b.shape.topk);
  EXPECT_EQ(a.shape.layers, b.shape.layers);
  EXPECT_EQ(a.shape.tokens, b.shape.tokens);
  EXPECT_EQ(a.first, b.first);
  EXPECT_EQ(a.batches, b.batches);
  ASSERT_EQ(a.indices.size(), b.indices.size());
  EXPECT_EQ(0, memcmp(a.indices.data(), b.indices.data(), a.indices.size() * sizeof(int32_t)));
}

}  // namespace

// ---- the file ------------------------------------------------------------------------------------

TEST(RoutingTraceFile, RoundTripIsBitIdentical) {
  testutil::Rng rng;
  TempDir dir;
  for (int draw = 0; draw < 50; draw++) {
    const RoutingTrace written = random_trace(rng);
    const std::string path = dir.file("trace.bin"), again = dir.file("again.bin");
    data::write_routing_trace(path, written);
    EXPECT_FALSE(fs::exists(path + ".tmp"));
    const RoutingTrace read = data::read_routing_trace(path);
    EXPECT_EQ(read.path, path);
    expect_same_trace(read, written);
    data::write_routing_trace(again, read);
    EXPECT_EQ(read_bytes(again), read_bytes(path)) << "draw " << draw;
  }
}

// The header words and the index order are the ones documented at the top of routing_trace.hpp.
TEST(RoutingTraceFile, LayoutIsTheDocumentedOne) {
  TempDir dir;
  const RoutingTrace t = layout_trace();
  const std::string path = dir.file("trace.bin");
  data::write_routing_trace(path, t);
  const std::string bytes = read_bytes(path);
  const size_t L = 2, W = 3, header_words = 9 + L + W, sum_tokens = 7;
  ASSERT_EQ(bytes.size(), 4 * header_words + 4 * t.batches * L * t.shape.topk * sum_tokens);
  const std::vector<int32_t> header = {20261201, 1, 3, 97, 2, 2, 3, 10, 0, 1, 3, 4, 0, 3};
  for (size_t w = 0; w < header.size(); w++) EXPECT_EQ(word_at(bytes, w), header[w]) << "header word " << w;
  size_t word = header_words;  // [S][L][W][N_r][k]
  for (int b = 0; b < t.batches; b++)
    for (int j = 0; j < 2; j++)
      for (int r = 0; r < 3; r++)
        for (int n = 0; n < t.shape.tokens[r]; n++)
          for (int s = 0; s < 2; s++)
            EXPECT_EQ(word_at(bytes, word++), coordinate_value(b, j, r, n, s, 97)) << b << j << r << n << s;
}

TEST(RoutingTraceFile, ReadRefusesEveryDamageNamingFileAndProblem) {
  TempDir dir;
  const std::string good_path = dir.file("good.bin");
  data::write_routing_trace(good_path, layout_trace());
  const std::string good = read_bytes(good_path);
  const std::string path = dir.file("bad.bin");
  const auto refused = [&](const std::string& bytes, const std::vector<std::string>& problem) {
    write_bytes(path, bytes);
    std::vector<std::string> parts = {"routing trace " + path + ": "};
    parts.insert(parts.end(), problem.begin(), problem.end());
    expect_refused([&] { data::read_routing_trace(path); }, parts);
  };
  expect_refused([&] { data::read_routing_trace(dir.file("missing.bin")); },
                 {"routing trace " + dir.file("missing.bin"), "cannot open", "No such file"});
  std::string b = good;
  set_word(b, 0, 20240520);
  refused(b, {"bad magic 20240520", "not a flatmoe routing trace"});
  b = good;
  set_word(b, 1, 2);
  refused(b, {"unsupported version 2", "reads version 1"});
  refused("", {"truncated: 0 bytes, shorter than its header"});
  refused(good.substr(0, 20), {"truncated: 20 bytes, shorter than its header"});
  refused(good.substr(0, 4 * 12), {"truncated: 48 bytes, shorter than its header"});  // the rank token counts cut
  refused(good.substr(0, good.size() - 4), {"truncated: " + std::to_string(good.size() - 4) + " bytes of the " +
                                            std::to_string(good.size()) + " its header describes"});
  refused(good + std::string(8, '\0'),
          {"trailing bytes: 8 after the " + std::to_string(good.size()) + " its header describes"});
  // each header field outside its range (words: 2 W, 3 E, 4 k, 5 L, 6 S, 7-8 first, 9-10 layers, 11-13 N)
  const std::vector<std::pair<std::pair<size_t, int32_t>, std::string>> fields = {
      {{2, 0}, "W = 0 ranks (need >= 1)"},
      {{3, 0}, "E = 0 experts (need >= 1)"},
      {{4, 0}, "k = 0 (need 1 <= k <= E = 97)"},
      {{4, 98}, "k = 98 (need 1 <= k <= E = 97)"},
      {{5, 0}, "L = 0 MoE layers (need >= 1)"},
      {{6, 0}, "S = 0 batches (need >= 1)"},
      {{8, -1}, "first training pass -"},
      {{10, 1}, "layer indices [1, 1] are not ascending"},
      {{9, -2}, "layer indices [-2, 3] are not ascending"},
      {{12, -4}, "rank 1 has N = -4 tokens"}};
  for (const auto& [change, problem] : fields) {
    b = good;
    set_word(b, change.first, change.second);
    refused(b, {"malformed header: " + problem});
  }
  // an expert index outside [0, E), named by its position: batch 1, layer 3, rank 2, token 1, slot 0
  const size_t per_batch = 2 * 2 * 7, position = 14 + per_batch + 14 + 8 + 2;
  for (int32_t expert : {-1, 97}) {
    b = good;
    set_word(b, position, expert);
    refused(b, {"batch 1, layer 3, rank 2, token 1, slot 0: expert " + std::to_string(expert) + " outside [0, 97)"});
  }
}

// A trace whose batches hold no token (N = 0 on every rank) has nothing to read per batch: one that
// claims 2^31 − 1 such batches (44 bytes) is read at once, not batch by batch.
TEST(RoutingTraceFile, BatchesWithoutTokensAreNotReadOneByOne) {
  TempDir dir;
  const std::string path = dir.file("empty_batches.bin");
  std::string bytes(4 * 11, '\0');
  const int32_t words[] = {data::kRoutingTraceMagic, data::kRoutingTraceVersion, 1, 1, 1, 1, INT32_MAX, 0, 0, 0, 0};
  for (size_t i = 0; i < std::size(words); i++) set_word(bytes, i, words[i]);
  write_bytes(path, bytes);
  const auto start = std::chrono::steady_clock::now();
  const RoutingTrace trace = data::read_routing_trace(path);
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 1.0);
  EXPECT_EQ(trace.batches, INT32_MAX);
  EXPECT_TRUE(trace.indices.empty());
}

// A trace is read from a regular file only: a FIFO is refused, not waited on.
TEST(RoutingTraceFile, PathThatIsNotARegularFileIsRefused) {
  TempDir dir;
  const std::string fifo = dir.file("fifo");
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  expect_refused([&] { data::read_routing_trace(fifo); }, {"routing trace " + fifo + ": is a FIFO, not a regular file"});
  expect_refused([&] { data::read_routing_trace(dir.path.string()); }, {"is a folder, not a regular file"});
}

// ---- writing -------------------------------------------------------------------------------------

TEST(RoutingTraceWriter, RefusesWhatItCouldNotReadBackAndLeavesTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("trace.bin");
  const RoutingTrace good = layout_trace();
  data::write_routing_trace(path, good);
  const std::string before = read_bytes(path);
  const uint64_t per_batch = good.shape.batch_indices();
  const auto unchanged = [&] {
    EXPECT_EQ(read_bytes(path), before);
    EXPECT_FALSE(fs::exists(path + ".tmp"));
  };

  RoutingTrace bad = good;
  bad.shape.topk = 98;
  expect_refused([&] { data::write_routing_trace(path, bad); }, {path, "cannot write it: k = 98 (need 1 <= k <= E = 97)"});
  unchanged();
  bad = good;
  bad.shape.tokens.pop_back();
  expect_refused([&] { data::write_routing_trace(path, bad); }, {path, "cannot write it: 2 token counts for W = 3 ranks"});
  unchanged();
  bad = good;
  bad.indices[per_batch + 3] = 97;  // batch 1, layer 1, rank 0, token 1, slot 1: the run fails in its second batch
  expect_refused([&] { data::write_routing_trace(path, bad); },
                 {path, "batch 1, layer 1, rank 0, token 1, slot 1: expert 97 outside [0, 97)"});
  unchanged();
  {
    data::RoutingTraceWriter writer(path, good.shape, good.first, good.batches);
    expect_refused([&] { writer.append(good.indices.data(), per_batch - 1); },
                   {path, "batch 0: " + std::to_string(per_batch - 1) + " indices, a batch has " + std::to_string(per_batch)});
    writer.append(good.indices.data(), per_batch);
    expect_refused([&] { writer.commit(); }, {path, "1 of its 3 batches written: not committed"});
    EXPECT_TRUE(fs::exists(path + ".tmp"));
  }  // a run that stops here: the writer goes, and so does its temporary file
  unchanged();
  {
    data::RoutingTraceWriter writer(path, good.shape, good.first, good.batches);
    for (int b = 0; b < good.batches; b++) writer.append(good.indices.data() + b * per_batch, per_batch);
    expect_refused([&] { writer.append(good.indices.data(), per_batch); }, {path, "batch 3: the trace holds 3 batches"});
  }
  unchanged();
  expect_refused([&] { data::write_routing_trace(dir.file("absent/trace.bin"), good); },
                 {dir.file("absent/trace.bin"), "cannot create", "No such file"});
  EXPECT_FALSE(fs::exists(dir.file("absent")));
}

TEST(RoutingTraceWriter, ReplacesAnExistingFileAndLeavesNothingElse) {
  testutil::Rng rng;
  TempDir dir;
  const std::string path = dir.file("trace.bin");
  data::write_routing_trace(path, layout_trace());
  const RoutingTrace next = random_trace(rng);
  data::write_routing_trace(path, next);
  expect_same_trace(data::read_routing_trace(path), next);
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir.path)) names.push_back(entry.path().filename());
  EXPECT_EQ(names, std::vector<std::string>{"trace.bin"});
}

// Where a run will record (--record_routing FILE), checked before it starts: the folder must exist;
// an existing FILE is replaced only when it is a routing trace; a FILE.tmp (left by a run killed
// outright, or not this program's) is refused, never removed. Nothing is written or removed.
TEST(RoutingTraceWriter, TargetIsCheckedBeforeARunRecords) {
  TempDir dir;
  const std::string path = dir.file("trace.bin");
  EXPECT_NO_THROW(data::check_routing_trace_target(path));
  expect_refused([&] { data::check_routing_trace_target(dir.file("absent/trace.bin")); },
                 {"routing trace " + dir.file("absent/trace.bin") + ": cannot record it: folder " + dir.file("absent") +
                  ": No such file or directory"});
  write_bytes(path, "my notes, not a trace");
  expect_refused([&] { data::check_routing_trace_target(path); }, {path, "it exists and is not a routing trace"});
  EXPECT_EQ(read_bytes(path), "my notes, not a trace");
  data::write_routing_trace(dir.file("other.bin"), layout_trace());
  fs::rename(dir.file("other.bin"), path);
  EXPECT_NO_THROW(data::check_routing_trace_target(path));
  write_bytes(path + ".tmp", "x");
  expect_refused([&] { data::check_routing_trace_target(path); }, {path + ".tmp exists"});
  EXPECT_EQ(read_bytes(path + ".tmp"), "x");
}

// ---- a run and its trace -------------------------------------------------------------------------

TEST(RoutingTraceFits, NamesEachFieldThatDiffersWithBothValues) {
  RoutingTrace t = layout_trace();
  t.path = "runs/a/trace.bin";
  const RoutingTraceShape fits = t.shape;
  EXPECT_EQ(data::routing_trace_mismatch(t.shape, fits), "");
  EXPECT_NO_THROW(data::check_routing_trace_fits(t, fits));
  const std::string head = "routing trace runs/a/trace.bin does not match this run: ";
  RoutingTraceShape run = fits;
  run.world = 2;
  run.tokens = {4, 0};
  expect_refused([&] { data::check_routing_trace_fits(t, run); },
                 {head + "W (ranks): the trace has 3, this run 2; N per rank (tokens per batch): the trace has [4, 0, 3], "
                         "this run [4, 0]"});
  run = fits;
  run.experts = 96;
  expect_refused([&] { data::check_routing_trace_fits(t, run); }, {head + "E (experts): the trace has 97, this run 96"});
  run = fits;
  run.topk = 3;
  expect_refused([&] { data::check_routing_trace_fits(t, run); }, {head + "k (top-k): the trace has 2, this run 3"});
  run = fits;
  run.layers = {0, 1, 3};
  expect_refused([&] { data::check_routing_trace_fits(t, run); },
                 {head + "MoE layers: the trace has [1, 3], this run [0, 1, 3]"});
  run = fits;
  run.tokens = {4, 1, 3};
  expect_refused([&] { data::check_routing_trace_fits(t, run); },
                 {head + "N per rank (tokens per batch): the trace has [4, 0, 3], this run [4, 1, 3]"});
}

// A rank keeps its own tokens of every batch and layer; pass p takes batch (p − first) mod S.
TEST(RoutingTraceReplay, EachRankGetsItsOwnChoicesOfEachPass) {
  const RoutingTrace t = layout_trace();  // first 10, S = 3
  for (int r = 0; r < t.shape.world; r++) {
    const data::RankRoutes routes = data::rank_routes(t, r);
    EXPECT_EQ(routes.per_layer, (size_t)t.shape.tokens[r] * 2);
    for (long long pass : {0LL, 4LL, 9LL, 10LL, 11LL, 12LL, 13LL, 1000001LL}) {
      const int b = (int)(((pass - 10) % 3 + 3) % 3);
      for (int j = 0; j < 2; j++) {
        const int32_t* choices = routes.at(pass, j);
        for (int n = 0; n < t.shape.tokens[r]; n++)
          for (int s = 0; s < 2; s++)
            EXPECT_EQ(choices[n * 2 + s], coordinate_value(b, j, r, n, s, 97)) << "pass " << pass << " rank " << r;
      }
    }
  }
  expect_refused([&] { data::rank_routes(t, 3); }, {"no ranks 3..3 among its 3"});
}

// One GPU replaying a W-rank run holds every rank's tokens in rank order (tests/dist_model.cu pins the
// routing of its W-ranks-against-one-GPU trajectories so); any run of consecutive ranks likewise.
TEST(RoutingTraceReplay, ConsecutiveRanksAsOneHoldTheirTokensInRankOrder) {
  const RoutingTrace t = layout_trace();  // W = 3, N_r = [4, 0, 3], k = 2, first 10, S = 3
  for (int first = 0; first < t.shape.world; first++)
    for (int ranks = 1; first + ranks <= t.shape.world; ranks++) {
      const data::RankRoutes routes = data::rank_routes(t, first, ranks);
      size_t tokens = 0;
      for (int r = first; r < first + ranks; r++) tokens += t.shape.tokens[r];
      EXPECT_EQ(routes.per_layer, tokens * 2);
      for (long long pass : {10LL, 11LL, 12LL, 14LL})
        for (int j = 0; j < 2; j++) {
          std::vector<int32_t> expected;  // each rank's own choices, one rank after the other
          for (int r = first; r < first + ranks; r++) {
            const data::RankRoutes own = data::rank_routes(t, r);
            expected.insert(expected.end(), own.at(pass, j), own.at(pass, j) + own.per_layer);
          }
          EXPECT_EQ(std::vector<int32_t>(routes.at(pass, j), routes.at(pass, j) + routes.per_layer), expected)
              << "ranks " << first << ".." << first + ranks - 1 << " pass " << pass << " layer slot " << j;
        }
    }
  expect_refused([&] { data::rank_routes(t, 1, 3); }, {"no ranks 1..3 among its 3"});
  expect_refused([&] { data::rank_routes(t, 0, 0); }, {"no ranks 0..-1 among its 3"});
}

TEST(RoutingTraceReplay, LayerSlotsAreTheRecordedLayers) {
  RoutingTrace t = layout_trace();
  t.path = "t.bin";
  EXPECT_EQ(data::routing_trace_layer_slot(t, 1), 0);
  EXPECT_EQ(data::routing_trace_layer_slot(t, 3), 1);
  expect_refused([&] { data::routing_trace_layer_slot(t, 2); }, {"routing trace t.bin records MoE layers [1, 3], not layer 2"});
}

TEST(RoutingTraceSpelling, TraceColonFile) {
  EXPECT_EQ(data::routing_trace_path("trace:runs/a/trace.bin"), "runs/a/trace.bin");
  EXPECT_EQ(data::routing_trace_path("trace:x:y"), "x:y");
  for (const char* other : {"router", "balanced", "hot:0.5/2", "Trace:x", "tracex"}) EXPECT_EQ(data::routing_trace_path(other), "");
  expect_refused([] { data::routing_trace_path("trace:"); }, {"routing 'trace:': expected trace:FILE"});
}
