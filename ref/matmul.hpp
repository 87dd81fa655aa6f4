// ref/matmul.hpp — bias-free linear layer, plain math (twin: ops/matmul.cuh).
//
//   forward:  out = x · Wᵀ             x N x IC, W OC x IC, out N x OC
//             out = residual + x · Wᵀ  residual N x OC
//   backward: dx = dout · W  (=)       dW = doutᵀ · x  (=, fresh gradient)
#pragma once
#include "common.hpp"

namespace ref {

template <typename T>
Mat<T> matmul_forward(const Mat<T>& x, const Mat<T>& W) {
  return x * W.transpose();
}

template <typename T>
Mat<T> matmul_forward_residual(const Mat<T>& residual, const Mat<T>& x, const Mat<T>& W) {
  return residual + x * W.transpose();
}

template <typename T>
void matmul_backward(const Mat<T>& dout, const Mat<T>& x, const Mat<T>& W, Mat<T>& dx, Mat<T>& dW) {
  dx = dout * W;
  dW = dout.transpose() * x;
}

}  // namespace ref
