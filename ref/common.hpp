// ref/common.hpp — shared types of the Eigen references. The references are plain math in a
// templated scalar (double in the tests), row-major like the device tensors, with no
// distribution, no fusion and no memory tricks: they define what each operator computes.
#pragma once
#include <Eigen/Dense>
#include <cmath>
#include <utility>
#include <vector>

namespace ref {

template <typename T>
using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
template <typename T>
using Vec = Eigen::Matrix<T, Eigen::Dynamic, 1>;
using MatI = Eigen::Matrix<int, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

template <typename T>
T silu(T x) { return x / (T(1) + std::exp(-x)); }
template <typename T>
T sigmoid(T x) { return T(1) / (T(1) + std::exp(-x)); }

// One hop of a ring of ranks (ref/relay_moe.hpp, ref/ring_dtp.hpp): what rank r holds goes to rank
// (r + 1) mod ranks.
template <typename X>
void ring_pass_right(std::vector<X>& held) {
  std::vector<X> next(held.size());
  for (size_t r = 0; r < held.size(); r++) next[(r + 1) % held.size()] = std::move(held[r]);
  held = std::move(next);
}

}  // namespace ref
