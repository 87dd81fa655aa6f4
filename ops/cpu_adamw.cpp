// cpu_adamw.cpp — see cpu_adamw.hpp (built with CPU_ADAMW_FLAGS, Makefile).
#include "cpu_adamw.hpp"
#include <algorithm>
#include <atomic>
#include <thread>

namespace {

inline void store_param(float* param, size_t i, float x) { param[i] = x; }
inline void store_param(uint16_t* param, size_t i, float x) { param[i] = bf16_bits_rn(x); }

// Elements [lo, hi) of one segment's state; the loop the compiler vectorises.
template <typename Param>
void adamw_range(float* __restrict master, float* __restrict m, float* __restrict v, const float* __restrict grad,
                 Param* __restrict param, size_t lo, size_t hi, const AdamWCoefficients c) {
  for (size_t i = lo; i < hi; i++) {
    float mi = m[i], vi = v[i];
    const float p = adamw_element(mi, vi, master[i], grad[i], c);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    store_param(param, i, p);
  }
}

// The same loop, kept scalar (the baseline).
template <typename Param>
__attribute__((optimize("no-tree-vectorize"))) void adamw_range_scalar(float* master, float* m, float* v,
                                                                       const float* grad, Param* param, size_t lo,
                                                                       size_t hi, const AdamWCoefficients c) {
  for (size_t i = lo; i < hi; i++) {
    float mi = m[i], vi = v[i];
    const float p = adamw_element(mi, vi, master[i], grad[i], c);
    m[i] = mi;
    v[i] = vi;
    master[i] = p;
    store_param(param, i, p);
  }
}

AdamWCoefficients segment_coefficients(const ShardSegment& g, float lr, const AdamWSettings& s, int t,
                                       float grad_scale) {
  return adamw_coefficients(lr, s.beta1, s.beta2, s.eps, g.decay ? s.weight_decay : 0.f, t, grad_scale);
}

}  // namespace

template <typename Param>
void cpu_adamw_step(float* master, float* m, float* v, const float* grad, Param* param,
                    const std::vector<ShardSegment>& segments, float lr, const AdamWSettings& s, int t,
                    float grad_scale, int threads, const CpuAdamWChunks& chunks) {
  const size_t total = segments_elements(segments);
  if (total == 0) return;
  threads = std::max(threads, 1);
  const size_t chunk = std::max<size_t>(1, std::min(chunks.chunk, total));
  const size_t num_chunks = (total + chunk - 1) / chunk;
  std::vector<std::atomic<int>> slices_done(num_chunks);  // per chunk: threads past their slice
  for (std::atomic<int>& n : slices_done) n.store(0, std::memory_order_relaxed);
  auto work = [&](int thread) {
    for (size_t c = 0; c < num_chunks; c++) {
      const size_t lo = c * chunk, hi = std::min(total, lo + chunk);
      const size_t per_thread = (hi - lo + threads - 1) / threads;
      const size_t slice = (per_thread + 15) & ~size_t(15);  // whole 64-byte lines of fp32 per thread
      const size_t first = std::min(hi, lo + thread * slice), last = std::min(hi, first + slice);
      if (first < last) {
        if (chunks.arrived) chunks.arrived(c);
        for_segments_slice(segments, first, last, [&](const ShardSegment& g, size_t a, size_t e) {
          adamw_range(master, m, v, grad, param, a, e, segment_coefficients(g, lr, s, t, grad_scale));
        });
      }
      // acq_rel: the thread that finishes the chunk sees every other slice's writes
      if (slices_done[c].fetch_add(1, std::memory_order_acq_rel) + 1 == threads && chunks.updated) chunks.updated(c);
    }
  };
  std::vector<std::thread> workers;
  for (int thread = 1; thread < threads; thread++) workers.emplace_back(work, thread);
  work(0);
  for (std::thread& w : workers) w.join();
}

template <typename Param>
void cpu_adamw_step_scalar(float* master, float* m, float* v, const float* grad, Param* param,
                           const std::vector<ShardSegment>& segments, float lr, const AdamWSettings& s, int t,
                           float grad_scale) {
  for (const ShardSegment& g : segments)
    adamw_range_scalar(master, m, v, grad, param, g.state_offset, g.state_offset + g.count,
                       segment_coefficients(g, lr, s, t, grad_scale));
}

template <typename Param>
void cpu_params_from_master(const float* master, Param* param, const std::vector<ShardSegment>& segments) {
  for (const ShardSegment& g : segments)
    for (size_t i = g.state_offset; i < g.state_offset + g.count; i++) store_param(param, i, master[i]);
}

#define FM_CPU_ADAMW_INSTANTIATE(Param)                                                                         \
  template void cpu_adamw_step<Param>(float*, float*, float*, const float*, Param*,                             \
                                      const std::vector<ShardSegment>&, float, const AdamWSettings&, int, float, \
                                      int, const CpuAdamWChunks&);                                              \
  template void cpu_adamw_step_scalar<Param>(float*, float*, float*, const float*, Param*,                      \
                                             const std::vector<ShardSegment>&, float, const AdamWSettings&, int, \
                                             float);                                                            \
  template void cpu_params_from_master<Param>(const float*, Param*, const std::vector<ShardSegment>&);
FM_CPU_ADAMW_INSTANTIATE(float)
FM_CPU_ADAMW_INSTANTIATE(uint16_t)
