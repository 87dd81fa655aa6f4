// tests/model_util.cuh — weights shared by the whole-model tests (one GPU and W ranks).
#pragma once
#include "../config.hpp"
#include "gpu_util.cuh"

namespace testutil {

// The fewest experts, at least `at_least`, that E_p ranks hold in equal shares: a test model's E at any
// W (E = 6 at E_p = 2 or 3, 8 at 4 or 8).
inline int experts_for(int at_least, int ep) { return (at_least + ep - 1) / ep * ep; }

// Random weights (norm gains near 1), as fp32 master weights in param_specs order; matrices at the
// configuration's init_std, the scale the trainer starts from (0.02 by default). At a hotter 0.1 the
// BF16 model's errors double (mean over tensors 1.2e-2 instead of 6.3e-3, measured over 40 draws ×
// 4 configurations on the H200): bf16 activations then carry more error through each layer, and a
// small tensor's normwise error (the router's, E×H elements) spreads past 2e-2 in about 4 % of draws.
inline std::vector<float> random_master(const ModelConfig& c, Rng& rng) {
  std::vector<float> w;
  for (const ParamSpec& s : param_specs(c))
    for (size_t i = 0; i < s.numel(); i++)
      w.push_back((float)(s.decay ? rng.normal(c.init_std) : 1.0 + rng.normal(0.1)));
  return w;
}

// The weights the GPU kernels see (floatX), as doubles for the reference.
inline std::vector<double> as_seen_by_gpu(const std::vector<float>& master) {
  std::vector<double> w(master.size());
  for (size_t i = 0; i < w.size(); i++) w[i] = to_float(from_float<floatX>(master[i]));
  return w;
}

// Random input tokens x and targets y, N of each, in [0, V).
inline void random_tokens(int N, int V, Rng& rng, std::vector<int>& x, std::vector<int>& y) {
  x.resize(N);
  y.resize(N);
  for (int n = 0; n < N; n++) {
    x[n] = rng.integer(0, V - 1);
    y[n] = rng.integer(0, V - 1);
  }
}

// This rank's tokens of a global batch of groups·B sequences of T (x [groups·B·T]) under sequence groups of
// D ranks (split: sequence_split): its slice [first_token, end_token) of each of its group's B sequences,
// [B·T/D]. At D = 1: its B whole sequences, x[rank·B·T, (rank + 1)·B·T).
inline std::vector<int> rank_tokens(const std::vector<int>& global, const SequenceSplit& split, int B, int T) {
  std::vector<int> mine;
  for (int b = 0; b < B; b++) {
    const auto row = global.begin() + ((size_t)split.group * B + b) * T;
    mine.insert(mine.end(), row + split.first_token, row + split.end_token);
  }
  return mine;
}

}  // namespace testutil
