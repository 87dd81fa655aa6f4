// ref/rmsnorm.hpp — RMS normalisation with a learned gain, plain math (twin: ops/rmsnorm.cuh).
//
//   forward:  rstd[n] = 1 / sqrt(mean_j x[n,j]² + eps);  out[n,j] = x[n,j] · rstd[n] · w[j]
//   backward: with r = rstd[n] and dot = mean_i(dout[n,i] · w[i] · x[n,i]):
//             dx[n,j] = r · (w[j] · dout[n,j] − x[n,j] · r² · dot)     (=)
//             dw[j]   = Σ_n dout[n,j] · x[n,j] · r                      (=, fresh gradient)
// Shapes: x, out, dout, dx N x H; w, dw, rstd vectors (H, H, N).
#pragma once
#include "common.hpp"

namespace ref {

template <typename T>
void rmsnorm_forward(const Mat<T>& x, const Vec<T>& w, T eps, Mat<T>& out, Vec<T>& rstd) {
  const Eigen::Index N = x.rows(), H = x.cols();
  out.resize(N, H);
  rstd.resize(N);
  for (Eigen::Index n = 0; n < N; n++) {
    rstd(n) = T(1) / std::sqrt(x.row(n).squaredNorm() / T(H) + eps);
    out.row(n) = (x.row(n) * rstd(n)).cwiseProduct(w.transpose());
  }
}

template <typename T>
void rmsnorm_backward(const Mat<T>& dout, const Mat<T>& x, const Vec<T>& w, T eps, Mat<T>& dx, Vec<T>& dw) {
  const Eigen::Index N = x.rows(), H = x.cols();
  dx.resize(N, H);
  dw = Vec<T>::Zero(H);
  for (Eigen::Index n = 0; n < N; n++) {
    T r = T(1) / std::sqrt(x.row(n).squaredNorm() / T(H) + eps);
    T dot = dout.row(n).cwiseProduct(w.transpose()).cwiseProduct(x.row(n)).sum() / T(H);
    dx.row(n) = r * (dout.row(n).cwiseProduct(w.transpose()) - x.row(n) * (r * r * dot));
    dw += (dout.row(n).cwiseProduct(x.row(n)) * r).transpose();
  }
}

}  // namespace ref
