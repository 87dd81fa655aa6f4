// ref/moe.hpp — the dropless MoE FFN's plain math (twin of ops/moe.cuh): per token, per slot,
// no permutation, no grouping.
//   For token n and slot j, e = topk_idx(n,j), w = topk_w(n,j):
//     h = W13[e] x_n          [2I]   (rows 0..I−1 of W13[e] = W1 "gate", rows I..2I−1 = W3 "up")
//     a = silu(h1) ⊙ h3       [I]
//     y = W2[e] a             [H]
//     out_n += w · y
// Backward (all outputs are fresh gradients, "="):
//   dtopk_w(n,j) = dout_n · y;  dy = w · dout_n;  da = W2[e]ᵀ dy;  dW2[e] += dy aᵀ
//   dh1 = da ⊙ h3 ⊙ silu'(h1);  dh3 = da ⊙ silu(h1);  dx_n += W13[e]ᵀ dh;  dW13[e] += dh x_nᵀ
#pragma once
#include "common.hpp"

namespace ref {

template <typename T>
T silu_grad(T x) {
  T s = sigmoid(x);
  return s * (T(1) + x * (T(1) - s));
}

// x [N,H], topk_idx [N,k], topk_w [N,k], W13: E matrices [2I,H], W2: E matrices [H,I] -> out [N,H]
template <typename T>
Mat<T> moe_forward(const Mat<T>& x, const MatI& topk_idx, const Mat<T>& topk_w, const std::vector<Mat<T>>& W13,
                   const std::vector<Mat<T>>& W2) {
  const int N = (int)x.rows(), H = (int)x.cols(), k = (int)topk_idx.cols();
  const int I = (int)W2[0].cols();
  Mat<T> out = Mat<T>::Zero(N, H);
  for (int n = 0; n < N; n++) {
    for (int j = 0; j < k; j++) {
      int e = topk_idx(n, j);
      Vec<T> h = W13[e] * x.row(n).transpose();
      Vec<T> a(I);
      for (int i = 0; i < I; i++) a(i) = silu(h(i)) * h(I + i);
      Vec<T> y = W2[e] * a;
      out.row(n) += topk_w(n, j) * y.transpose();
    }
  }
  return out;
}

template <typename T>
struct MoEGrads {
  Mat<T> dx;                 // [N,H]
  Mat<T> dtopk_w;            // [N,k]
  std::vector<Mat<T>> dW13;  // E × [2I,H]
  std::vector<Mat<T>> dW2;   // E × [H,I]
};

// Gradients of Σ dout ⊙ moe_forward(x, topk_idx, topk_w, W13, W2).
template <typename T>
MoEGrads<T> moe_backward(const Mat<T>& dout, const Mat<T>& x, const MatI& topk_idx, const Mat<T>& topk_w,
                         const std::vector<Mat<T>>& W13, const std::vector<Mat<T>>& W2) {
  const int N = (int)x.rows(), H = (int)x.cols(), k = (int)topk_idx.cols();
  const int E = (int)W13.size(), I = (int)W2[0].cols();
  MoEGrads<T> g;
  g.dx = Mat<T>::Zero(N, H);
  g.dtopk_w = Mat<T>::Zero(N, k);
  for (int e = 0; e < E; e++) {
    g.dW13.push_back(Mat<T>::Zero(2 * I, H));
    g.dW2.push_back(Mat<T>::Zero(H, I));
  }
  for (int n = 0; n < N; n++) {
    Vec<T> xn = x.row(n).transpose();
    Vec<T> dout_n = dout.row(n).transpose();
    for (int j = 0; j < k; j++) {
      int e = topk_idx(n, j);
      Vec<T> h = W13[e] * xn;
      Vec<T> a(I);
      for (int i = 0; i < I; i++) a(i) = silu(h(i)) * h(I + i);
      Vec<T> y = W2[e] * a;
      g.dtopk_w(n, j) = dout_n.dot(y);
      Vec<T> dy = topk_w(n, j) * dout_n;
      Vec<T> da = W2[e].transpose() * dy;
      g.dW2[e] += dy * a.transpose();
      Vec<T> dh(2 * I);
      for (int i = 0; i < I; i++) {
        dh(i) = da(i) * h(I + i) * silu_grad(h(i));
        dh(I + i) = da(i) * silu(h(i));
      }
      g.dx.row(n) += (W13[e].transpose() * dh).transpose();
      g.dW13[e] += dh * xn.transpose();
    }
  }
  return g;
}

}  // namespace ref
