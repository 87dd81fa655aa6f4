// data/routing_trace.hpp — routing traces: the top-k expert choices of each MoE layer of every rank
// over a run's training passes, recorded by the trainer (--record_routing FILE) and replayed by the
// trainer and the dispatch benchmark (--routing trace:FILE), so that skew can be studied on what a
// real router chose, and replayed exactly. Plain C++17: the CPU tests write and read traces.
//
// A trace holds S batches. A batch is one training pass of all W ranks (one micro-batch forward):
// rank r routes its N_r tokens through each of the L recorded MoE layers, k experts per token. The
// trainer numbers its training passes p = step · accum + micro-batch (accum micro-batches per
// optimizer step); batch b of a trace recorded pass first + b. Validation and sampling passes are not
// training passes: they are neither recorded nor replayed. Replay: training pass p takes batch
// (p − first) mod S, wrapping both ways, so that a run replaying its own trace chooses what it chose
// when it was recorded, also after a resume, and a shorter trace repeats.
//
// The file: little-endian int32 words.
//   word 0        magic 20261201
//   word 1        format version 1
//   word 2        W      ranks, >= 1
//   word 3        E      experts, >= 1
//   word 4        k      top-k, 1..E
//   word 5        L      MoE layers recorded, >= 1
//   word 6        S      batches, >= 1
//   words 7, 8    first  the training pass of batch 0: int64, low word then high word, >= 0
//   next L words  the model's index of each recorded layer (0-based, dense layers counted), strictly
//                 ascending
//   next W words  N_0 .. N_{W−1}: the tokens of each rank in every batch, >= 0
//   then          the expert indices, int32 in [0, E), [S][L][W][N_r][k]: batch, then layer, then rank,
//                 then token, then the token's k choices in the router's order
// Size: 4 · (9 + L + W) + 4 · S · L · k · ΣN_r bytes.
//
// Reading refuses, naming the file: cannot open, or not a regular file; bad magic; unsupported version; truncated (shorter
// than its header); a malformed header (a field outside its range above); truncated or trailing bytes
// against the size the header implies; an index outside [0, E), named by batch, layer, rank, token and
// slot. A run refuses a trace that does not fit it (check_routing_trace_fits), naming each field that
// differs — W, E, k, the MoE layers, N per rank — with the trace's value and the run's.
// Writing goes to FILE.tmp, renamed to FILE once every batch is out (AtomicFileWriter): a run that
// fails leaves FILE as it was (a process killed outright may leave FILE.tmp, never a partial FILE,
// and the next run refuses that FILE.tmp rather than remove it). A run checks where it will record
// before it starts (check_routing_trace_target): an existing FILE is replaced only when it is a trace.
#pragma once
#include <sys/stat.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "file_io.hpp"

namespace data {

constexpr int32_t kRoutingTraceMagic = 20261201;
constexpr int32_t kRoutingTraceVersion = 1;
constexpr int kRoutingTraceFixedWords = 9;  // magic .. first: the words before the layer indices

// The prefix of a --routing value (and of a benchmark profile) that names a trace file.
constexpr const char kRoutingTracePrefix[] = "trace:";

// FILE of a routing spelled "trace:FILE"; "" for any other spelling. Refuses "trace:" without a file.
inline std::string routing_trace_path(const std::string& routing) {
  const std::string prefix = kRoutingTracePrefix;
  if (routing.compare(0, prefix.size(), prefix) != 0) return "";
  if (routing.size() == prefix.size())
    throw std::invalid_argument("routing '" + routing + "': expected trace:FILE, with the trace's file name");
  return routing.substr(prefix.size());
}

// What a trace records: its ranks, experts, top-k, layers and the tokens of each rank per batch.
struct RoutingTraceShape {
  int world = 1;            // W
  int experts = 1;          // E
  int topk = 1;             // k
  std::vector<int> layers;  // L: the model's index of each recorded MoE layer, ascending
  std::vector<int> tokens;  // N_r of each of the W ranks

  // Indices in one batch of a well-formed shape, L · k · ΣN_r, saturating at UINT64_MAX (only a
  // hand-made header gets there: a file that size cannot exist, so it is refused as truncated).
  uint64_t batch_indices() const {
    uint64_t total_tokens = 0;
    for (int n : tokens) total_tokens += (uint64_t)n;
    return saturated_product(saturated_product(layers.size(), (uint64_t)topk), total_tokens);
  }

  static uint64_t saturated_product(uint64_t a, uint64_t b) { return a != 0 && b > UINT64_MAX / a ? UINT64_MAX : a * b; }
};

struct RoutingTrace {
  RoutingTraceShape shape;
  long long first = 0;           // the training pass that batch 0 recorded
  int batches = 0;               // S
  std::vector<int32_t> indices;  // [S][L][W][N_r][k]
  std::string path;              // the file it was read from ("" when built in memory): named in errors
};

namespace trace_detail {

inline std::string list_text(const std::vector<int>& values) {
  std::string text = "[";
  for (size_t i = 0; i < values.size(); i++) text += (i ? ", " : "") + std::to_string(values[i]);
  return text + "]";
}

// "" when a header with these fields is well formed, else which field is out of its range.
inline std::string header_problem(const RoutingTraceShape& s, long long first, int batches) {
  if (s.world < 1) return "W = " + std::to_string(s.world) + " ranks (need >= 1)";
  if (s.experts < 1) return "E = " + std::to_string(s.experts) + " experts (need >= 1)";
  if (s.topk < 1 || s.topk > s.experts)
    return "k = " + std::to_string(s.topk) + " (need 1 <= k <= E = " + std::to_string(s.experts) + ")";
  if (s.layers.empty()) return "L = 0 MoE layers (need >= 1)";
  if (batches < 1) return "S = " + std::to_string(batches) + " batches (need >= 1)";
  if (first < 0) return "first training pass " + std::to_string(first) + " (need >= 0)";
  for (size_t j = 0; j < s.layers.size(); j++)
    if (s.layers[j] < 0 || (j > 0 && s.layers[j] <= s.layers[j - 1]))
      return "layer indices " + list_text(s.layers) + " are not ascending from 0 or more";
  if ((int)s.tokens.size() != s.world)
    return std::to_string(s.tokens.size()) + " token counts for W = " + std::to_string(s.world) + " ranks";
  for (int r = 0; r < s.world; r++)
    if (s.tokens[r] < 0) return "rank " + std::to_string(r) + " has N = " + std::to_string(s.tokens[r]) + " tokens";
  return "";
}

// Where index i of one batch ([L][W][N_r][k]) lies: "layer 3, rank 1, token 17, slot 0".
inline std::string batch_position(const RoutingTraceShape& s, uint64_t i) {
  const uint64_t k = (uint64_t)s.topk;
  uint64_t per_layer = 0;
  for (int n : s.tokens) per_layer += (uint64_t)n * k;
  const size_t slot = (size_t)(i / per_layer);
  uint64_t in_layer = i % per_layer;
  int rank = 0;
  while (in_layer >= (uint64_t)s.tokens[rank] * k) in_layer -= (uint64_t)s.tokens[rank++] * k;
  return "layer " + std::to_string(s.layers[slot]) + ", rank " + std::to_string(rank) + ", token " +
         std::to_string(in_layer / k) + ", slot " + std::to_string(in_layer % k);
}

// "" when every index of one batch is in [0, E), else where the first one that is not lies.
inline std::string batch_index_problem(const RoutingTraceShape& s, const int32_t* indices, uint64_t count) {
  for (uint64_t i = 0; i < count; i++)
    if (indices[i] < 0 || indices[i] >= s.experts)
      return batch_position(s, i) + ": expert " + std::to_string(indices[i]) + " outside [0, " +
             std::to_string(s.experts) + ")";
  return "";
}

inline std::string encode_header(const RoutingTraceShape& s, long long first, int batches) {
  std::string h;
  for (int32_t word : {kRoutingTraceMagic, kRoutingTraceVersion, (int32_t)s.world, (int32_t)s.experts,
                       (int32_t)s.topk, (int32_t)s.layers.size(), (int32_t)batches})
    append_i32_le(h, word);
  append_i32_le(h, (int32_t)(uint32_t)((uint64_t)first & 0xFFFFFFFFu));
  append_i32_le(h, (int32_t)(uint32_t)((uint64_t)first >> 32));
  for (int layer : s.layers) append_i32_le(h, layer);
  for (int n : s.tokens) append_i32_le(h, n);
  return h;
}

}  // namespace trace_detail

// Writes a trace one batch at a time (the trainer appends each training pass as it ends, so only one
// batch is held in memory): PATH.tmp, renamed to PATH by commit() once all S batches are out.
// Destroyed without commit() — a run that failed — it removes PATH.tmp and leaves PATH as it was.
// Refuses, naming PATH, a header it could not read back, a batch of the wrong size or with an index
// outside [0, E), a batch more than S, and a commit before the S-th.
class RoutingTraceWriter {
 public:
  RoutingTraceWriter(const std::string& path, const RoutingTraceShape& shape, long long first, int batches)
      : path_(path), shape_(checked(path, shape, first, batches)), batches_(batches), file_(path) {
    file_.write(trace_detail::encode_header(shape_, first, batches));
  }

  // The next batch: [L][W][N_r][k] expert indices.
  void append(const int32_t* indices, size_t count) {
    const std::string batch = "batch " + std::to_string(written_);
    if (written_ == batches_)
      throw std::runtime_error(refusal(batch + ": the trace holds " + std::to_string(batches_) + " batches"));
    if ((uint64_t)count != shape_.batch_indices())
      throw std::runtime_error(refusal(batch + ": " + std::to_string(count) + " indices, a batch has " +
                                       std::to_string(shape_.batch_indices())));
    const std::string out_of_range = trace_detail::batch_index_problem(shape_, indices, count);
    if (!out_of_range.empty()) throw std::runtime_error(refusal(batch + ", " + out_of_range));
    std::string bytes;
    bytes.reserve(4 * count);
    for (size_t i = 0; i < count; i++) append_i32_le(bytes, indices[i]);
    file_.write(bytes);
    written_++;
  }

  // PATH.tmp becomes PATH; refused before all S batches are appended.
  void commit() {
    if (written_ != batches_)
      throw std::runtime_error(refusal(std::to_string(written_) + " of its " + std::to_string(batches_) +
                                       " batches written: not committed"));
    file_.commit();
  }

  int written() const { return written_; }
  const RoutingTraceShape& shape() const { return shape_; }

 private:
  std::string refusal(const std::string& why) const { return "routing trace " + path_ + ": " + why; }

  static const RoutingTraceShape& checked(const std::string& path, const RoutingTraceShape& shape, long long first,
                                          int batches) {
    const std::string problem = trace_detail::header_problem(shape, first, batches);
    if (!problem.empty()) throw std::invalid_argument("routing trace " + path + ": cannot write it: " + problem);
    return shape;
  }

  std::string path_;
  RoutingTraceShape shape_;
  int batches_;
  int written_ = 0;
  AtomicFileWriter file_;
};

// A whole trace in memory to PATH, atomically (tests and tools; the trainer streams with the writer).
inline void write_routing_trace(const std::string& path, const RoutingTrace& trace) {
  RoutingTraceWriter writer(path, trace.shape, trace.first, trace.batches);
  const uint64_t per_batch = trace.shape.batch_indices();
  if (trace.indices.size() != per_batch * (uint64_t)trace.batches)
    throw std::invalid_argument("routing trace " + path + ": " + std::to_string(trace.indices.size()) +
                                " indices for " + std::to_string(trace.batches) + " batches of " +
                                std::to_string(per_batch));
  for (int b = 0; b < trace.batches; b++) writer.append(trace.indices.data() + b * per_batch, per_batch);
  writer.commit();
}

// Reads and checks a trace file (the refusals are listed at the top of this file).
inline RoutingTrace read_routing_trace(const std::string& path) {
  const auto refusal = [&](const std::string& why) { return std::runtime_error("routing trace " + path + ": " + why); };
  long long file_bytes = 0;
  std::unique_ptr<FILE, int (*)(FILE*)> file(nullptr, &std::fclose);
  try {
    file.reset(open_regular_file(path, &file_bytes));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("routing trace ") + e.what());
  }
  const uint64_t size = (uint64_t)file_bytes;
  // Reads `words` int32 words into `out`; false when the file ends first.
  const auto read_words = [&](int32_t* out, size_t words) {
    std::vector<unsigned char> bytes(4 * words);
    const size_t got = std::fread(bytes.data(), 1, bytes.size(), file.get());
    if (std::ferror(file.get())) throw refusal(std::string("cannot read: ") + std::strerror(errno));
    for (size_t i = 0; i < got / 4; i++) out[i] = load_i32_le(&bytes[4 * i]);
    return got == bytes.size();
  };
  const auto truncated_header = [&]() {
    return refusal("truncated: " + std::to_string(size) + " bytes, shorter than its header");
  };

  int32_t fixed[kRoutingTraceFixedWords] = {};
  const bool whole_fixed = read_words(fixed, kRoutingTraceFixedWords);
  if (size >= 4 && fixed[0] != kRoutingTraceMagic)
    throw refusal("bad magic " + std::to_string(fixed[0]) + " (not a flatmoe routing trace)");
  if (size >= 8 && fixed[1] != kRoutingTraceVersion)
    throw refusal("unsupported version " + std::to_string(fixed[1]) + " (this build reads version " +
                  std::to_string(kRoutingTraceVersion) + ")");
  if (!whole_fixed) throw truncated_header();
  RoutingTrace t;
  t.path = path;
  t.shape.world = fixed[2];
  t.shape.experts = fixed[3];
  t.shape.topk = fixed[4];
  const int32_t layer_count = fixed[5];
  t.batches = fixed[6];
  t.first = (long long)((uint64_t)(uint32_t)fixed[7] | (uint64_t)(uint32_t)fixed[8] << 32);
  const auto malformed = [&](const std::string& why) { return refusal("malformed header: " + why); };
  if (layer_count < 1) throw malformed("L = " + std::to_string(layer_count) + " MoE layers (need >= 1)");
  if (t.shape.world < 1) throw malformed("W = " + std::to_string(t.shape.world) + " ranks (need >= 1)");
  // the variable part's length comes from the header: checked against the file before it is allocated
  const uint64_t header_bytes = 4 * ((uint64_t)kRoutingTraceFixedWords + (uint64_t)layer_count + (uint64_t)t.shape.world);
  if (size < header_bytes) throw truncated_header();
  t.shape.layers.resize(layer_count);
  t.shape.tokens.resize(t.shape.world);
  if (!read_words(t.shape.layers.data(), t.shape.layers.size()) || !read_words(t.shape.tokens.data(), t.shape.tokens.size()))
    throw refusal("it changed while being read");
  const std::string problem = trace_detail::header_problem(t.shape, t.first, t.batches);
  if (!problem.empty()) throw malformed(problem);

  const uint64_t per_batch = t.shape.batch_indices();
  const uint64_t body = RoutingTraceShape::saturated_product(RoutingTraceShape::saturated_product(per_batch, 4),
                                                             (uint64_t)t.batches);
  const uint64_t expected = body > UINT64_MAX - header_bytes ? UINT64_MAX : header_bytes + body;
  if (size < expected)
    throw refusal("truncated: " + std::to_string(size) + " bytes of the " + std::to_string(expected) + " its header describes");
  if (size > expected)
    throw refusal("trailing bytes: " + std::to_string(size - expected) + " after the " + std::to_string(expected) +
                  " its header describes");
  t.indices.resize(per_batch * t.batches);
  // Batches without a token hold nothing to read or check: S alone does not bound the loop.
  for (int b = 0; per_batch > 0 && b < t.batches; b++) {
    int32_t* batch = t.indices.data() + b * per_batch;
    if (!read_words(batch, per_batch)) throw refusal("it changed while being read");
    const std::string out_of_range = trace_detail::batch_index_problem(t.shape, batch, per_batch);
    if (!out_of_range.empty()) throw refusal("batch " + std::to_string(b) + ", " + out_of_range);
  }
  return t;
}

// Refuses, naming `path`, a trace that a run could not record there or should not replace, before the
// run starts: a folder that does not exist; an existing `path` that is not a routing trace (a trace is
// replaced, never a file of another kind); an existing PATH.tmp (the writer creates it new, never
// truncates or removes one it did not make).
inline void check_routing_trace_target(const std::string& path) {
  const auto refusal = [&](const std::string& why) { return std::runtime_error("routing trace " + path + ": cannot record it: " + why); };
  const size_t slash = path.find_last_of('/');
  const std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  struct stat st;
  if (stat(folder.c_str(), &st) != 0) throw refusal("folder " + folder + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) throw refusal(folder + " is not a folder");
  if (lstat((path + ".tmp").c_str(), &st) == 0)
    throw refusal(path + ".tmp exists (left by an interrupted run, or not this program's file); remove it");
  if (lstat(path.c_str(), &st) != 0) return;
  long long size = 0;
  std::unique_ptr<FILE, int (*)(FILE*)> file(open_regular_file(path, &size), &std::fclose);
  unsigned char magic[4] = {};
  if (std::fread(magic, 1, 4, file.get()) != 4 || load_i32_le(magic) != kRoutingTraceMagic)
    throw refusal("it exists and is not a routing trace: only a trace is replaced");
}

// "" when a trace of shape `trace` fits a run of shape `run`, else each field that differs with both
// values: "W (ranks): the trace has 2, this run 1; N per rank: the trace has [128, 128], this run [128]".
inline std::string routing_trace_mismatch(const RoutingTraceShape& trace, const RoutingTraceShape& run) {
  std::string text;
  const auto field = [&](const std::string& name, const std::string& in_trace, const std::string& in_run) {
    if (in_trace != in_run) text += (text.empty() ? "" : "; ") + name + ": the trace has " + in_trace + ", this run " + in_run;
  };
  field("W (ranks)", std::to_string(trace.world), std::to_string(run.world));
  field("E (experts)", std::to_string(trace.experts), std::to_string(run.experts));
  field("k (top-k)", std::to_string(trace.topk), std::to_string(run.topk));
  field("MoE layers", trace_detail::list_text(trace.layers), trace_detail::list_text(run.layers));
  field("N per rank (tokens per batch)", trace_detail::list_text(trace.tokens), trace_detail::list_text(run.tokens));
  return text;
}

// Refuses (std::invalid_argument) a trace that does not fit a run of shape `run`, naming its file
// and every field that differs.
inline void check_routing_trace_fits(const RoutingTrace& trace, const RoutingTraceShape& run) {
  const std::string mismatch = routing_trace_mismatch(trace.shape, run);
  if (!mismatch.empty())
    throw std::invalid_argument("routing trace " + trace.path + " does not match this run: " + mismatch);
}

// Where the model's layer `layer` is among the trace's recorded MoE layers (0..L−1); refuses a layer
// the trace does not record.
inline int routing_trace_layer_slot(const RoutingTrace& trace, int layer) {
  const std::vector<int>& layers = trace.shape.layers;
  for (size_t slot = 0; slot < layers.size(); slot++)
    if (layers[slot] == layer) return (int)slot;
  throw std::invalid_argument("routing trace " + trace.path + " records MoE layers " +
                              trace_detail::list_text(layers) + ", not layer " + std::to_string(layer));
}

// One rank's part of a trace: what a replaying rank keeps (1/W of the trace's indices when the
// ranks hold the same number of tokens).
struct RankRoutes {
  long long first = 0;
  int batches = 0;                // S
  int layers = 0;                 // L
  size_t per_layer = 0;           // N_r · k
  std::vector<int32_t> indices;   // [S][L][N_r · k]

  // The choices [N_r · k] of recorded layer `slot` (0..L−1) in training pass `pass`: those of batch
  // (pass − first) mod S.
  const int32_t* at(long long pass, int slot) const {
    const long long batch = ((pass - first) % batches + batches) % batches;
    return indices.data() + ((size_t)batch * layers + slot) * per_layer;
  }
};

// The part of ranks [rank, rank + ranks) as one rank that holds their tokens in rank order: a rank's
// own (ranks = 1), or one GPU replaying the whole global batch of a W-rank run (rank 0, ranks = W).
inline RankRoutes rank_routes(const RoutingTrace& trace, int rank, int ranks = 1) {
  const RoutingTraceShape& s = trace.shape;
  if (rank < 0 || ranks < 1 || rank + ranks > s.world)
    throw std::invalid_argument("routing trace " + trace.path + ": no ranks " + std::to_string(rank) + ".." +
                                std::to_string(rank + ranks - 1) + " among its " + std::to_string(s.world));
  RankRoutes routes;
  routes.first = trace.first;
  routes.batches = trace.batches;
  routes.layers = (int)s.layers.size();
  size_t before = 0, per_layer_all = 0;  // indices of the ranks before `rank`, and of all ranks, in one layer
  for (int r = 0; r < s.world; r++) {
    if (r < rank) before += (size_t)s.tokens[r] * s.topk;
    if (r >= rank && r < rank + ranks) routes.per_layer += (size_t)s.tokens[r] * s.topk;
    per_layer_all += (size_t)s.tokens[r] * s.topk;
  }
  routes.indices.reserve((size_t)trace.batches * routes.layers * routes.per_layer);
  for (size_t batch_layer = 0; batch_layer < (size_t)trace.batches * routes.layers; batch_layer++) {
    const int32_t* from = trace.indices.data() + batch_layer * per_layer_all + before;
    routes.indices.insert(routes.indices.end(), from, from + routes.per_layer);
  }
  return routes;
}

}  // namespace data
