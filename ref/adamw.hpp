// ref/adamw.hpp — AdamW with decoupled weight decay and global-norm clipping, plain math
// (twin: ops/adamw.cuh).
//
//   g = grad · grad_scale;  m = β1·m + (1 − β1)·g;  v = β2·v + (1 − β2)·g²
//   m̂ = m / (1 − β1ᵗ);  v̂ = v / (1 − β2ᵗ);  master −= lr · (m̂ / (√v̂ + eps) + wd · master)
//   global_norm = sqrt(Σ over all tensors and elements of grad²)
//   clip_scale  = min(1, max_norm / (global_norm + 1e-6)), or 1 when max_norm <= 0
#pragma once
#include <algorithm>
#include "common.hpp"

namespace ref {

template <typename T>
void adamw_update(Vec<T>& master, Vec<T>& m, Vec<T>& v, const Vec<T>& grad, T lr, T beta1, T beta2, T eps,
                  T weight_decay, int t, T grad_scale) {
  const T bias_correction1 = T(1) - std::pow(beta1, T(t));
  const T bias_correction2 = T(1) - std::pow(beta2, T(t));
  for (Eigen::Index i = 0; i < master.size(); i++) {
    T g = grad(i) * grad_scale;
    m(i) = beta1 * m(i) + (T(1) - beta1) * g;
    v(i) = beta2 * v(i) + (T(1) - beta2) * g * g;
    T m_hat = m(i) / bias_correction1;
    T v_hat = v(i) / bias_correction2;
    master(i) -= lr * (m_hat / (std::sqrt(v_hat) + eps) + weight_decay * master(i));
  }
}

template <typename T>
T global_norm(const std::vector<Vec<T>>& grads) {
  T sumsq = 0;
  for (const Vec<T>& g : grads) sumsq += g.squaredNorm();
  return std::sqrt(sumsq);
}

template <typename T>
T clip_scale(T grad_norm, T max_norm) {
  if (max_norm <= T(0)) return T(1);
  return std::min(T(1), max_norm / (grad_norm + T(1e-6)));
}

}  // namespace ref
