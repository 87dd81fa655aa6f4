// adamw.cuh — AdamW with decoupled weight decay on fp32 master weights (twin: ref/adamw.hpp).
//
//   g  = grad · grad_scale                       (grad_scale: the clip factor, see clip_scale)
//   m  = β1·m + (1 − β1)·g                       m (in place)
//   v  = β2·v + (1 − β2)·g²                      v (in place)
//   m̂ = m / (1 − β1ᵗ),  v̂ = v / (1 − β2ᵗ)        t = 1-based step
//   master −= lr · (m̂ / (√v̂ + eps) + wd · master)   master (in place)
//   param  = floatX(master)                      param (=), round to nearest
//
// Shapes: master, m, v [n] float; param, grad [n] floatX. Element-wise, fp32; the bias
// corrections are computed on the host in double and passed as fp32.
// The gradient norm for clipping comes from common.cuh's deterministic sumsq_accumulate /
// sumsq_finish over all gradient tensors; clip_scale turns it into grad_scale on the host.
//
// Memory: none of its own.
#pragma once
#include <cmath>
#include "common.cuh"

// grad_scale for clipping the global gradient norm to max_norm: min(1, max_norm / (norm + 1e-6));
// max_norm <= 0 disables clipping (1).
inline float clip_scale(float grad_norm, float max_norm) {
  if (max_norm <= 0.f) return 1.f;
  return fminf(1.f, max_norm / (grad_norm + 1e-6f));
}

template <typename T>
__global__ void adamw_kernel(float* master, T* param, float* m, float* v, const T* grad, size_t n, float lr,
                             float beta1, float beta2, float eps, float weight_decay, float bias_correction1,
                             float bias_correction2, float grad_scale) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float g = to_float(grad[i]) * grad_scale;
  float mi = beta1 * m[i] + (1.f - beta1) * g;
  float vi = beta2 * v[i] + (1.f - beta2) * g * g;
  float m_hat = mi / bias_correction1;
  float v_hat = vi / bias_correction2;
  float p = master[i];
  p -= lr * (m_hat / (sqrtf(v_hat) + eps) + weight_decay * p);
  m[i] = mi;
  v[i] = vi;
  master[i] = p;
  param[i] = from_float<T>(p);
}

// One AdamW step over n parameters (see the header comment).
inline void adamw_update(float* master, floatX* param, float* m, float* v, const floatX* grad, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int t, float grad_scale,
                         cudaStream_t stream) {
  if (t < 1) fm_fail("adamw_update", "step t must be >= 1", "n=%zu t=%d", n, t);
  if (n == 0) return;
  float bias_correction1 = (float)(1.0 - std::pow((double)beta1, t));
  float bias_correction2 = (float)(1.0 - std::pow((double)beta2, t));
  const int threads = 256;
  adamw_kernel<<<ceil_div((long long)n, threads), threads, 0, stream>>>(master, param, m, v, grad, n, lr, beta1, beta2,
                                                                       eps, weight_decay, bias_correction1,
                                                                       bias_correction2, grad_scale);
  launchCheck("adamw_update", "n=%zu t=%d", n, t);
}
