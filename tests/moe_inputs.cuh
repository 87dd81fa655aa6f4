// tests/moe_inputs.cuh — the inputs the MoE tests share (tests/gpu_moe.cu on one GPU,
// tests/dist_moe_case.cuh for the dispatchers on W ranks): random experts, rounded to what the GPU
// holds, and the host layouts the device buffers take.
#pragma once
#include <cmath>
#include <vector>
#include "gpu_util.cuh"

namespace {

// E experts [2I,H] and [H,I], and the weight gradients their backward adds onto (+=): fresh random
// values (scale 1/√fan-in for the weights, 0.5 for the starting gradients), rounded through floatX.
struct ExpertWeights {
  std::vector<ref::Mat<double>> W13, W2, dW13_init, dW2_init;
};

ExpertWeights random_experts(testutil::Rng& rng, int E, int H, int I) {
  ExpertWeights w;
  for (int e = 0; e < E; e++) {
    w.W13.push_back(testutil::round_to_floatX(rng.mat<double>(2 * I, H, 1.0 / std::sqrt(H))));
    w.W2.push_back(testutil::round_to_floatX(rng.mat<double>(H, I, 1.0 / std::sqrt(I))));
    w.dW13_init.push_back(testutil::round_to_floatX(rng.mat<double>(2 * I, H, 0.5)));
    w.dW2_init.push_back(testutil::round_to_floatX(rng.mat<double>(H, I, 0.5)));
  }
  return w;
}

// Experts [first, first + count) of `mats` stacked into one [count·r, c] (the device layout [count,r,c]).
ref::Mat<double> stack(const std::vector<ref::Mat<double>>& mats, int first, int count) {
  const Eigen::Index rows = mats[0].rows();
  ref::Mat<double> s(count * rows, mats[0].cols());
  for (int e = 0; e < count; e++) s.middleRows(e * rows, rows) = mats[first + e];
  return s;
}

// All of `mats` stacked.
ref::Mat<double> stack(const std::vector<ref::Mat<double>>& mats) { return stack(mats, 0, (int)mats.size()); }

// A row-major int matrix as the flat vector the device holds.
std::vector<int> flat(const ref::MatI& m) { return std::vector<int>(m.data(), m.data() + m.size()); }

}  // namespace
