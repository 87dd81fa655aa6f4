// adamw_check.hpp — one AdamW step of fp32 state checked element by element against ref/adamw.hpp
// (double) from the same fp32 inputs: m, v and θ each within a few fp32 roundings (u = 2⁻²⁴) of the
// magnitudes its formula adds. That is what "to FP32 rounding" can promise per element; a normwise
// bound alone fails on a one-element tensor whose update cancels. Used by the CPU optimizer's test
// (cpu_host_adamw.cpp) and the GPU optimizers' (gpu_offload_adamw.cu).
#pragma once
#include <cmath>
#include <cstddef>
#include <cstdio>
#include "../ref/adamw.hpp"

namespace testutil {

struct AdamWStepCheck {
  int outside = 0;                                  // elements of m, v or θ beyond fp32 rounding
  ref::Vec<double> master_ref, m_ref, v_ref;        // the reference's step
};

// `before`/`after`: n floats of the fp32 state; grad the step's gradients.
inline AdamWStepCheck check_adamw_step(const float* master_before, const float* m_before, const float* v_before,
                                       const float* grad, const float* master_after, const float* m_after,
                                       const float* v_after, size_t n, double lr, double beta1, double beta2,
                                       double eps, double weight_decay, int t, double grad_scale) {
  AdamWStepCheck c;
  ref::Vec<double> g(n);
  c.master_ref.resize(n);
  c.m_ref.resize(n);
  c.v_ref.resize(n);
  for (size_t i = 0; i < n; i++) {
    c.master_ref(i) = master_before[i];
    c.m_ref(i) = m_before[i];
    c.v_ref(i) = v_before[i];
    g(i) = grad[i];
  }
  ref::adamw_update<double>(c.master_ref, c.m_ref, c.v_ref, g, lr, beta1, beta2, eps, weight_decay, t, grad_scale);
  const double u = std::ldexp(1.0, -24), bc1 = 1 - std::pow(beta1, t), bc2 = 1 - std::pow(beta2, t);
  for (size_t i = 0; i < n; i++) {
    const double gs = g(i) * grad_scale;
    const double m_terms = std::fabs(beta1 * m_before[i]) + std::fabs((1 - beta1) * gs);
    const double v_terms = beta2 * v_before[i] + (1 - beta2) * gs * gs;
    const double step_terms =
        m_terms / bc1 / (std::sqrt(c.v_ref(i) / bc2) + eps) + weight_decay * std::fabs((double)master_before[i]);
    c.outside += std::fabs(m_after[i] - c.m_ref(i)) > 4 * u * m_terms;
    c.outside += std::fabs(v_after[i] - c.v_ref(i)) > 4 * u * v_terms;
    c.outside += std::fabs(master_after[i] - c.master_ref(i)) > 2 * u * std::fabs(c.master_ref(i)) + 16 * u * lr * step_terms;
  }
  return c;
}

// The greppable [err] line of test_util.hpp's report, for a normwise error that is reported but not
// asserted (the assertion is check_adamw_step's, element by element).
inline void report_normwise(const char* what, const char* tensor, double err) {
  printf("[err] %-28s %-14s rel=%.3e tol=per-element\n", what, tensor, err);
}

}  // namespace testutil
