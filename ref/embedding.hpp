// ref/embedding.hpp — token embedding lookup, plain math (twin: ops/embedding.cuh).
//
//   forward:  out[n, :] = wte[tokens[n], :]                   tokens N x 1, wte V x H, out N x H
//   backward: dwte[v, :] = Σ_{n : tokens[n] = v} dout[n, :]   (=) V x H, summed in ascending n;
//             rows of ids that do not occur are zero
#pragma once
#include "common.hpp"

namespace ref {

template <typename T>
Mat<T> embedding_forward(const MatI& tokens, const Mat<T>& wte) {
  Mat<T> out(tokens.rows(), wte.cols());
  for (Eigen::Index n = 0; n < tokens.rows(); n++) out.row(n) = wte.row(tokens(n, 0));
  return out;
}

template <typename T>
Mat<T> embedding_backward(const MatI& tokens, const Mat<T>& dout, int V) {
  Mat<T> dwte = Mat<T>::Zero(V, dout.cols());
  for (Eigen::Index n = 0; n < tokens.rows(); n++) dwte.row(tokens(n, 0)) += dout.row(n);
  return dwte;
}

}  // namespace ref
