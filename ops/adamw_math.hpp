// adamw_math.hpp — one AdamW element update, the arithmetic every optimizer runs: the GPU kernel of
// ops/adamw.cuh (--optimizer adamw, and offload_adamw through that kernel) and the CPU loop of
// ops/cpu_adamw.cpp (--optimizer cpu_adamw). Plain C++ (no CUDA needed): the CPU tests include it.
//
//   g = grad · grad_scale
//   m = fma(β1, m, (1 − β1)·g)                    v = fma(β2, v, ((1 − β2)·g)·g)
//   u = fma(wd, master, (m / bc1) / (√(v / bc2) + eps))
//   master = fma(−lr, u, master)                  bc1 = 1 − β1ᵗ, bc2 = 1 − β2ᵗ (double, then fp32)
//
// Bit-identical on the GPU and the CPU: every product that feeds a sum is an explicit fma, so no
// compiler has a multiply-add left to contract or not (nvcc contracts by default, g++ does under
// -ffp-contract=fast); division and square root are IEEE round-to-nearest on both (nvcc without
// --use_fast_math: div.rn, sqrt.rn; the CPU's vdivps/vsqrtps), denormals are kept on both (no
// flush-to-zero). The same math as ref/adamw.hpp to fp32 rounding: fma rounds once where the
// reference's a·b + c rounds twice.
#pragma once
#include <cmath>

#if defined(__CUDACC__)
#define FM_HOST_DEVICE __host__ __device__
#else
#define FM_HOST_DEVICE
#endif

struct AdamWSettings {
  float beta1, beta2, eps, weight_decay;
};

// The per-step scalars of one AdamW update (one tensor's weight decay).
struct AdamWCoefficients {
  float lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2, grad_scale;
};

// Step t (1-based); weight_decay is this tensor's (0 for the norm gains).
inline AdamWCoefficients adamw_coefficients(float lr, float beta1, float beta2, float eps, float weight_decay, int t,
                                            float grad_scale) {
  return AdamWCoefficients{lr, beta1, beta2, eps, weight_decay, (float)(1.0 - std::pow((double)beta1, t)),
                           (float)(1.0 - std::pow((double)beta2, t)), grad_scale};
}

// Updates m and v in place and returns the new master weight.
FM_HOST_DEVICE inline float adamw_element(float& m, float& v, float master, float grad, const AdamWCoefficients& c) {
  const float g = grad * c.grad_scale;
  m = fmaf(c.beta1, m, (1.f - c.beta1) * g);
  v = fmaf(c.beta2, v, (1.f - c.beta2) * g * g);
  const float m_hat = m / c.bias_correction1;
  const float v_hat = v / c.bias_correction2;
  const float update = fmaf(c.weight_decay, master, m_hat / (sqrtf(v_hat) + c.eps));
  return fmaf(-c.lr, update, master);
}
