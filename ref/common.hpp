// ref/common.hpp — shared types of the Eigen references. The references are plain math in a
// templated scalar (double in the tests), row-major like the device tensors, with no
// distribution, no fusion and no memory tricks: they define what each operator computes.
#pragma once
#include <Eigen/Dense>
#include <cmath>
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

}  // namespace ref
