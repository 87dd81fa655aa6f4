// cpu_adamw.hpp — AdamW on the CPU over host state (--optimizer cpu_adamw, the ZeRO-Offload design;
// twin: ref/adamw.hpp). The element arithmetic is ops/adamw_math.hpp's adamw_element, the GPU
// kernel's, so the CPU and the GPU give bit-identical master weights, moments and weights.
//
// Compiled on its own (ops/cpu_adamw.cpp, Makefile: CPU_ADAMW_FLAGS = -O3 -march=native
// -fno-math-errno -ffp-contract=off): -march=native gives the build machine's widest vectors
// (AVX-512 or AVX2 with FMA), -fno-math-errno lets sqrtf become vsqrtps (with errno it needs a scalar
// branch per element), and -ffp-contract=off keeps the arithmetic exactly adamw_element's fmas. How
// to check that the loop vectorises: `make build/cpu_adamw.vec` writes g++'s -fopt-info-vec report
// (the vectorised loops of cpu_adamw.cpp, "optimized: loop vectorized using 64 byte vectors" with
// AVX-512) and counts the packed vfmadd/vdivps/vsqrtps instructions in the object.
//
// Shapes: master, m, v, grad [S] fp32 and param [S] (fp32, or bf16 bits rounded to nearest even as
// __float2bfloat16_rn does; NaN becomes 0x7FFF), all indexed by the state offset of
// config.hpp's ShardSegment; the elements between segments (shard padding) are not touched.
//
// Chunks, for a pipeline with the copies (ops/offload_adamw.cuh's CpuAdamW): the segments' elements,
// concatenated, are cut into chunks of `chunk` elements, and every thread updates its slice of chunk
// 0, then of chunk 1, ... (a slice: whole 64-byte lines of fp32, the chunk split over the threads).
// Before a thread reads its slice of chunk i it calls arrived(i), which returns once chunk i's
// gradients are on the host (so arrived may be called by several threads at once); once every slice of
// chunk i is written, the thread that wrote the last one calls updated(i) (once per chunk), which sends
// the chunk's weights on. The threads never wait for each other: while one chunk's weights go up and
// a later chunk's gradients come down, the CPU updates the chunks between. Element by element the
// arithmetic is the same whatever the chunks and threads: bit-identical results.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <vector>
#include "adamw_math.hpp"
#include "../config.hpp"

struct CpuAdamWChunks {
  size_t chunk = std::numeric_limits<size_t>::max();  // elements per chunk (>= 1); the default: one chunk
  std::function<void(size_t)> arrived;                // chunk i's gradients are on the host (may be empty)
  std::function<void(size_t)> updated;                // chunk i's weights are written (may be empty)
};

// One AdamW step over the segments (step t, 1-based), split over `threads` std::threads in equal slices
// of each chunk. Vectorised loop.
template <typename Param>
void cpu_adamw_step(float* master, float* m, float* v, const float* grad, Param* param,
                    const std::vector<ShardSegment>& segments, float lr, const AdamWSettings& s, int t,
                    float grad_scale, int threads, const CpuAdamWChunks& chunks = CpuAdamWChunks());

// The elements of the segments, concatenated: range(segment, lo, hi) for each segment's part of the
// slice [first, last) of that concatenation, lo and hi as state offsets.
template <typename Range>
void for_segments_slice(const std::vector<ShardSegment>& segments, size_t first, size_t last, Range range) {
  size_t start = 0;  // the segment's first element in the concatenation
  for (const ShardSegment& g : segments) {
    const size_t lo = std::max(first, start), hi = std::min(last, start + g.count);
    if (lo < hi) range(g, g.state_offset + (lo - start), g.state_offset + (hi - start));
    start += g.count;
  }
}

inline size_t segments_elements(const std::vector<ShardSegment>& segments) {
  size_t total = 0;
  for (const ShardSegment& g : segments) total += g.count;
  return total;
}

// The same step in one thread, by a loop the compiler must not vectorise: the plain scalar baseline
// that tools/bench_optimizer.cu measures the vectorised loop against (and the CPU tests compare it with).
template <typename Param>
void cpu_adamw_step_scalar(float* master, float* m, float* v, const float* grad, Param* param,
                           const std::vector<ShardSegment>& segments, float lr, const AdamWSettings& s, int t,
                           float grad_scale);

// param = Param(master) over the segments (the weights from loaded master weights).
template <typename Param>
void cpu_params_from_master(const float* master, Param* param, const std::vector<ShardSegment>& segments);

// bf16 bits of x, rounded to nearest even (NaN: 0x7FFF), as __float2bfloat16_rn.
inline uint16_t bf16_bits_rn(float x) {
  uint32_t bits;
  __builtin_memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
  return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}
