// ref/cross_entropy.hpp — softmax cross-entropy over full logits, plain math
// (twin: ops/cross_entropy.cuh).
//
//   forward:  lse[n] = log Σ_j exp(logits[n,j]);  losses[n] = lse[n] − logits[n, targets[n]]
//   backward: dlogits[n,j] = dloss · (softmax(logits[n,:])_j − [j == targets[n]])   (=)
//             (dloss = d(total loss)/d(losses[n]), the same for every row)
//   loss_sum: Σ_n losses[n]
// Shapes: logits, dlogits N x V; targets N x 1; losses, lse N.
#pragma once
#include "common.hpp"

namespace ref {

template <typename T>
Vec<T> cross_entropy_forward(const Mat<T>& logits, const MatI& targets, Vec<T>& lse) {
  const Eigen::Index N = logits.rows();
  Vec<T> losses(N);
  lse.resize(N);
  for (Eigen::Index n = 0; n < N; n++) {
    T m = logits.row(n).maxCoeff();
    lse(n) = m + std::log((logits.row(n).array() - m).exp().sum());
    losses(n) = lse(n) - logits(n, targets(n, 0));
  }
  return losses;
}

template <typename T>
Mat<T> cross_entropy_backward(const Mat<T>& logits, const MatI& targets, T dloss) {
  Vec<T> lse;
  cross_entropy_forward(logits, targets, lse);
  Mat<T> dlogits(logits.rows(), logits.cols());
  for (Eigen::Index n = 0; n < logits.rows(); n++) {
    dlogits.row(n) = (logits.row(n).array() - lse(n)).exp().matrix();
    dlogits(n, targets(n, 0)) -= T(1);
  }
  return dlogits * dloss;
}

template <typename T>
T loss_sum(const Vec<T>& losses) {
  return losses.sum();
}

}  // namespace ref
