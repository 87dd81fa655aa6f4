// data/dataloader.hpp — llm.c-style loader of token shards for next-token prediction.
//
// Shards: one file, or every file matching a glob (sorted by name), read with read_shard.
// Each step reads one window of W·B·T + 1 consecutive tokens starting at `position` in the
// current shard; rank r of W takes the r-th B·T slice of it:
//   p = position + r·B·T,  inputs = tokens[p, p + B·T),  targets = tokens[p + 1, p + B·T + 1)
// (row b of the B×T batch is tokens[p + b·T, p + (b+1)·T)). Then position += W·B·T; when the next
// window would not fit (position + W·B·T + 1 > shard size) the loader moves to the next shard at
// position 0, and after the last shard back to the first with epoch + 1. Refused at construction,
// before any batch (notes/design.md §9): a shard shorter than one window (W·B·T + 1 tokens), and a shard
// holding a token id outside the vocabulary [0, V) (every shard is read once to check it).
//
// State {shard, position, epoch} names the next batch and is the same on every rank; saving it in
// a checkpoint and restoring it with set_state() replays exactly the batches that would have come.
// Only the current shard's tokens are held in memory.
#pragma once
#include <glob.h>

#include <algorithm>
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
      const std::vector<int> tokens = read_shard(file);
      const long long num_tokens = (long long)tokens.size();
      if (num_tokens < window + 1)
        throw std::runtime_error("data loader: shard " + file + " has " + std::to_string(num_tokens) +
                                 " tokens, too few for one batch: world " + std::to_string(world) + " × B " +
                                 std::to_string(B) + " × T " + std::to_string(T) + " + 1 = " +
                                 std::to_string(window + 1));
      for (size_t i = 0; i < tokens.size(); i++)
        if (tokens[i] >= vocab)
          throw std::runtime_error("data loader: shard " + file + ": token id " + std::to_string(tokens[i]) +
                                   " at position " + std::to_string(i) + " is outside the vocabulary [0, V = " +
                                   std::to_string(vocab) + ")");
      shard_tokens_.push_back(num_tokens);
      total_tokens_ += num_tokens;
    }
    reset();
  }

  // inputs, targets: host arrays of B·T ints each (B×T row-major).
  void next_batch(int* inputs, int* targets) {
    if (loaded_shard_ != state_.shard) {
      tokens_ = read_shard(files_[state_.shard]);
      if ((long long)tokens_.size() != shard_tokens_[state_.shard])
        throw std::runtime_error("data loader: shard " + files_[state_.shard] + " changed size since it was opened");
      loaded_shard_ = state_.shard;
    }
    const long long batch = (long long)B_ * T_;
    const int* start = tokens_.data() + state_.position + rank_ * batch;
    std::copy(start, start + batch, inputs);
    std::copy(start + 1, start + batch + 1, targets);
    state_.position += window_tokens();
    if (state_.position + window_tokens() + 1 > shard_tokens_[state_.shard]) {
      state_.position = 0;
      if (++state_.shard == int(files_.size())) {
        state_.shard = 0;
        state_.epoch++;
      }
    }
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

 private:
  long long window_tokens() const { return (long long)world_ * B_ * T_; }

  int B_, T_, rank_, world_;
  std::vector<std::string> files_;
  std::vector<long long> shard_tokens_;
  long long total_tokens_ = 0;
  State state_{0, 0, 0};
  int loaded_shard_ = -1;
  std::vector<int> tokens_;  // the tokens of shard loaded_shard_
};

}  // namespace data
