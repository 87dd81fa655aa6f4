// data/dataloader.hpp — llm.c-style loader of token shards for next-token prediction.
//
// Shards: one file, or every file matching a glob (sorted by name), in llm.c's format (shards.hpp).
// Each step reads one window of W·B·T + 1 consecutive tokens starting at `position` in the
// current shard; rank r of W takes the r-th B·T slice of it:
//   p = position + r·B·T,  inputs = tokens[p, p + B·T),  targets = tokens[p + 1, p + B·T + 1)
// (row b of the B×T batch is tokens[p + b·T, p + (b+1)·T)). Then position += W·B·T; when the next
// window would not fit (position + W·B·T + 1 > shard size) the loader moves to the next shard at
// position 0, and after the last shard back to the first with epoch + 1. Refused at construction,
// before any batch (notes/design.md §9): a shard shorter than one window (W·B·T + 1 tokens), and a shard
// holding a token id outside the vocabulary [0, V) (every shard is scanned once to check it, in blocks
// of kScanTokens tokens, so the check needs no memory of the shard's size).
//
// A rank of a sequence group (--sp D, config.hpp's SequenceSplit) builds its loader as the group's
// data-parallel rank (group g of W/D) and keeps only its tokens [t0, t1) of each row (keep_tokens):
//   inputs[b·(t1 − t0) + i] = tokens[p + b·T + t0 + i],  targets the same one token on
// so the D ranks of a group read one window slice and each takes its part of every sequence.
//
// State {shard, position, epoch} names the next batch and is the same on every rank; saving it in
// a checkpoint and restoring it with set_state() replays exactly the batches that would have come.
// No shard is held in memory (issue 14): like llm.c, the current shard's file stays open and each
// batch reads only this rank's B·T + 1 tokens of it (fseek to the token offset, fread), so the
// loader keeps O(B·T) bytes whatever the shard size.
#pragma once
#include <glob.h>

#include <algorithm>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "shards.hpp"

namespace data {

class DataLoader {
 public:
  struct State {
    int shard;
    long long position;
    long long epoch;
  };

  // vocab: V, the model's vocabulary size; every token of every shard must be in [0, V).
  DataLoader(const std::string& pattern, int B, int T, int vocab, int rank = 0, int world = 1)
      : B_(B), T_(T), rank_(rank), world_(world) {
    if (B <= 0 || T <= 0 || vocab <= 0 || world <= 0 || rank < 0 || rank >= world)
      throw std::runtime_error("data loader: need B > 0, T > 0, vocab > 0, 0 <= rank < world; got B=" +
                               std::to_string(B) + " T=" + std::to_string(T) + " vocab=" + std::to_string(vocab) +
                               " rank=" + std::to_string(rank) + " world=" + std::to_string(world));
    glob_t matches;
    const int rc = glob(pattern.c_str(), 0, nullptr, &matches);
    if (rc == GLOB_NOMATCH) throw std::runtime_error("data loader: no file matches " + pattern);
    if (rc != 0) {
      globfree(&matches);
      throw std::runtime_error("data loader: cannot expand " + pattern + " (glob error " + std::to_string(rc) + ")");
    }
    files_.assign(matches.gl_pathv, matches.gl_pathv + matches.gl_pathc);
    globfree(&matches);
    const long long window = window_tokens();
    for (const std::string& file : files_) {
      // The checks, and their order, of reading the whole shard: the header and file size, every
      // uint32 token fitting an int, the shard holding one window, then the first id ≥ V.
      long long bad_position = -1;
      int bad_id = 0;
      const long long num_tokens = scan_shard(file, vocab, bad_position, bad_id);
      if (num_tokens < window + 1)
        throw std::runtime_error("data loader: shard " + file + " has " + std::to_string(num_tokens) +
                                 " tokens, too few for one batch: world " + std::to_string(world) + " × B " +
                                 std::to_string(B) + " × T " + std::to_string(T) + " + 1 = " +
                                 std::to_string(window + 1));
      if (bad_position >= 0)
        throw std::runtime_error("data loader: shard " + file + ": token id " + std::to_string(bad_id) +
                                 " at position " + std::to_string(bad_position) + " is outside the vocabulary [0, V = " +
                                 std::to_string(vocab) + ")");
      shard_tokens_.push_back(num_tokens);
      total_tokens_ += num_tokens;
    }
    reset();
  }

  // inputs, targets: host arrays of B·(t1 − t0) ints each (B×(t1 − t0) row-major; B·T unless
  // keep_tokens). Reads this rank's B·T + 1 tokens of the current window from the shard file: inputs
  // are the tokens [t0, t1) of each row of the first B·T, targets the same one token on.
  void next_batch(int* inputs, int* targets) {
    if (open_.shard != state_.shard) open_shard(state_.shard);
    const long long batch = (long long)B_ * T_;
    const long long first = state_.position + rank_ * batch;  // token index of inputs[0] in the shard
    read_tokens(first, batch + 1, window_);
    const int kept = end_token_ - first_token_;
    for (int b = 0; b < B_; b++) {
      const auto row = window_.begin() + (long long)b * T_ + first_token_;
      std::copy(row, row + kept, inputs + (long long)b * kept);
      std::copy(row + 1, row + kept + 1, targets + (long long)b * kept);
    }
    state_.position += window_tokens();
    if (state_.position + window_tokens() + 1 > shard_tokens_[state_.shard]) {
      state_.position = 0;
      if (++state_.shard == int(files_.size())) {
        state_.shard = 0;
        state_.epoch++;
      }
    }
  }

  // Only the tokens [first, end) of each row from now on (a rank of a sequence group); [0, T): all.
  void keep_tokens(int first, int end) {
    if (first < 0 || end <= first || end > T_)
      throw std::runtime_error("data loader: tokens [" + std::to_string(first) + ", " + std::to_string(end) +
                               ") are not a slice of rows of T = " + std::to_string(T_));
    first_token_ = first;
    end_token_ = end;
  }

  void reset() { state_ = {0, 0, 0}; }

  State state() const { return state_; }

  void set_state(const State& s) {
    if (s.shard < 0 || s.shard >= int(files_.size()) || s.epoch < 0 || s.position < 0 ||
        s.position + window_tokens() + 1 > shard_tokens_[s.shard])
      throw std::runtime_error("data loader: state (shard " + std::to_string(s.shard) + ", position " +
                               std::to_string(s.position) + ", epoch " + std::to_string(s.epoch) +
                               ") does not fit the " + std::to_string(files_.size()) +
                               " shard(s) with a window of " + std::to_string(window_tokens() + 1) + " tokens");
    state_ = s;
  }

  long long num_tokens() const { return total_tokens_; }  // over all shards

  // Batches in one pass over the shards, after which they repeat (epoch + 1): validation reads at
  // most this many so that no rank sees a window twice. Each shard of n tokens holds
  // ⌊(n − 1) / (W·B·T)⌋ windows.
  long long windows_per_epoch() const {
    long long windows = 0;
    for (long long n : shard_tokens_) windows += (n - 1) / window_tokens();
    return windows;
  }
  const std::vector<std::string>& files() const { return files_; }

  // Bytes of token data the loader keeps between batches: the B·T + 1 tokens of one window, raw and
  // converted (none before the first batch). Not the shard size.
  size_t buffered_bytes() const { return raw_.capacity() + window_.capacity() * sizeof(int); }

 private:
  static constexpr long long kScanTokens = 1 << 20;  // tokens per block of the open-time scan

  // The open file of one shard. Copying a loader does not share the file: the copy opens its own
  // at its next batch.
  struct OpenShard {
    FILE* file = nullptr;
    int shard = -1;  // index in files_, -1 when none is open
    int bytes_per_token = 0;
    OpenShard() = default;
    OpenShard(const OpenShard&) {}
    OpenShard& operator=(const OpenShard&) {
      close();
      return *this;
    }
    OpenShard(OpenShard&& o) noexcept : file(o.file), shard(o.shard), bytes_per_token(o.bytes_per_token) {
      o.file = nullptr;
      o.shard = -1;
    }
    OpenShard& operator=(OpenShard&& o) noexcept {
      if (this != &o) {
        close();
        std::swap(file, o.file);
        std::swap(shard, o.shard);
        std::swap(bytes_per_token, o.bytes_per_token);
      }
      return *this;
    }
    ~OpenShard() { close(); }
    void close() {
      if (file) std::fclose(file);
      file = nullptr;
      shard = -1;
    }
  };

  long long window_tokens() const { return (long long)world_ * B_ * T_; }

  // Opens shard s for batches: its header and size are validated again (read_shard_header), and it
  // must hold as many tokens as when the loader was constructed.
  void open_shard(int s) {
    open_.close();
    const std::string& path = files_[s];
    const ShardInfo info = read_shard_header(path);
    if (info.num_tokens != shard_tokens_[s])
      throw std::runtime_error("data loader: shard " + path + " changed size since it was opened");
    open_.file = open_shard_file(path);
    open_.shard = s;
    open_.bytes_per_token = info.bytes_per_token;
  }

  // Tokens [first, first + count) of the open shard into `out`, converted to int as read_shard does
  // (uint16 or uint32 little-endian; a uint32 token that does not fit an int is refused).
  void read_tokens(long long first, long long count, std::vector<int>& out) {
    const std::string& path = files_[open_.shard];
    const int width = open_.bytes_per_token;
    raw_.resize(size_t(count) * width);
    const bool ok = std::fseek(open_.file, long(kHeaderBytes + first * width), SEEK_SET) == 0 &&
                    std::fread(raw_.data(), 1, raw_.size(), open_.file) == raw_.size();
    if (!ok) throw std::runtime_error("shard " + path + ": cannot read its tokens");
    out.resize(size_t(count));
    convert(path, raw_.data(), width, first, count, out.data());
  }

  // Converts `count` little-endian tokens of `width` bytes, the first being token `first` of the
  // shard at `path` (for the message), into `out`.
  static void convert(const std::string& path, const unsigned char* raw, int width, long long first, long long count,
                      int* out) {
    for (long long i = 0; i < count; i++) {
      const unsigned char* p = raw + i * width;
      if (width == 2) {
        out[i] = int(p[0]) | int(p[1]) << 8;
      } else {
        const int32_t token = load_i32_le(p);
        if (token < 0)
          throw std::runtime_error("shard " + path + ": token " + std::to_string(first + i) + " = " +
                                   std::to_string(uint32_t(token)) + " does not fit an int");
        out[i] = token;
      }
    }
  }

  // Reads the whole shard once, kScanTokens tokens at a time, with read_shard's checks (header,
  // size, tokens fitting an int, same messages); returns its number of tokens and sets
  // bad_position / bad_id to the first id ≥ vocab (bad_position −1 when there is none).
  static long long scan_shard(const std::string& path, int vocab, long long& bad_position, int& bad_id) {
    const ShardInfo info = read_shard_header(path);
    FILE* f = open_shard_file(path);
    std::vector<unsigned char> raw(size_t(std::min(info.num_tokens, kScanTokens)) * info.bytes_per_token);
    std::vector<int> tokens(size_t(std::min(info.num_tokens, kScanTokens)));
    bool ok = std::fseek(f, long(kHeaderBytes), SEEK_SET) == 0;
    try {
      for (long long first = 0; ok && first < info.num_tokens; first += kScanTokens) {
        const long long count = std::min(kScanTokens, info.num_tokens - first);
        const size_t bytes = size_t(count) * info.bytes_per_token;
        ok = std::fread(raw.data(), 1, bytes, f) == bytes;
        if (!ok) break;
        convert(path, raw.data(), info.bytes_per_token, first, count, tokens.data());
        if (bad_position < 0)
          for (long long i = 0; i < count; i++)
            if (tokens[i] >= vocab) {
              bad_position = first + i;
              bad_id = tokens[i];
              break;
            }
      }
    } catch (...) {
      std::fclose(f);
      throw;
    }
    std::fclose(f);
    if (!ok) throw std::runtime_error("shard " + path + ": cannot read its tokens");
    return info.num_tokens;
  }

  int B_, T_, rank_, world_;
  int first_token_ = 0, end_token_ = T_;  // [t0, t1): the tokens of each row next_batch keeps (keep_tokens)
  std::vector<std::string> files_;
  std::vector<long long> shard_tokens_;
  long long total_tokens_ = 0;
  State state_{0, 0, 0};
  OpenShard open_;                 // the shard next_batch reads from
  std::vector<unsigned char> raw_;  // one window's bytes as in the file: (B·T + 1) × 2 or 4
  std::vector<int> window_;         // the same B·T + 1 tokens as ints
};

}  // namespace data
