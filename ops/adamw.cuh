// adamw.cuh — AdamW with decoupled weight decay on fp32 master weights (twin: ref/adamw.hpp).
//
//   g  = grad · grad_scale                       (grad_scale: the clip factor, see clip_scale)
//   m  = β1·m + (1 − β1)·g                       m (in place)
//   v  = β2·v + (1 − β2)·g²                      v (in place)
//   m̂ = m / (1 − β1ᵗ),  v̂ = v / (1 − β2ᵗ)        t = 1-based step
//   master −= lr · (m̂ / (√v̂ + eps) + wd · master)   master (in place)
//   param  = floatX(master)                      param (=), round to nearest
// The element arithmetic, with its multiply-adds as explicit fmas, is ops/adamw_math.hpp's
// adamw_element, shared with the CPU loop of --optimizer cpu_adamw (bit-identical results).
//
// Shapes: master, m, v [n] float; param [n] floatX; grad [n] float (the model's fp32 gradients summed
// over a step's micro-batches, model.cuh's main_grads). Element-wise, fp32; the bias
// corrections are computed on the host in double and passed as fp32.
// The gradient norm for clipping comes from common.cuh's deterministic sumsq_accumulate /
// sumsq_finish over all gradient tensors; clip_scale turns it into grad_scale on the host.
//
// Launches: adamw_update is one launch over one tensor; adamw_multi_update is ONE launch over every
// segment of a rank's shard (the multi-tensor form that --optimizer adamw steps with, instead of a
// launch per segment: ~118 on a 334M MoE). Both run adamw_element with the same coefficients per
// element, so their results are bit-identical (tests/gpu_adamw.cu asserts it with memcmp).
//
// Memory: adamw_update has none of its own; adamw_multi_update reads an AdamWSegmentTable (built
// once: 32 B per non-empty segment, Optimizer). The optimizer seam at the end of this file
// (notes/design.md §1.1, --optimizer adamw) owns this rank's shard of the state: master, m, v,
// 3·S·4 B (Optimizer), and its table.
#pragma once
#include <algorithm>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>
#include "adamw_math.hpp"
#include "common.cuh"
#include "../config.hpp"
#include "../runtime/pool.cuh"

// grad_scale for clipping the global gradient norm to max_norm: min(1, max_norm / (norm + 1e-6));
// max_norm <= 0 disables clipping (1).
inline float clip_scale(float grad_norm, float max_norm) {
  if (max_norm <= 0.f) return 1.f;
  return fminf(1.f, max_norm / (grad_norm + 1e-6f));
}

template <typename T>
__global__ void adamw_kernel(float* master, T* param, float* m, float* v, const float* grad, size_t n,
                             const AdamWCoefficients c) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  float mi = m[i], vi = v[i];
  const float p = adamw_element(mi, vi, master[i], grad[i], c);
  m[i] = mi;
  v[i] = vi;
  master[i] = p;
  param[i] = from_float<T>(p);
}

// One AdamW step over n parameters (see the header comment).
inline void adamw_update(float* master, floatX* param, float* m, float* v, const float* grad, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int t, float grad_scale,
                         cudaStream_t stream) {
  if (t < 1) fm_fail("adamw_update", "step t must be >= 1", "n=%zu t=%d", n, t);
  if (n == 0) return;
  const int threads = 256;
  adamw_kernel<<<ceil_div((long long)n, threads), threads, 0, stream>>>(
      master, param, m, v, grad, n, adamw_coefficients(lr, beta1, beta2, eps, weight_decay, t, grad_scale));
  launchCheck("adamw_update", "n=%zu t=%d", n, t);
}

// ---------------------------------------------------------------------------------------------
// Multi-tensor AdamW: one launch over many segments of the same flat buffers.

static const int ADAMW_MT_THREADS = 256;
static const int ADAMW_MT_PER_THREAD = 4;                                    // elements per thread
static const int ADAMW_MT_CHUNK = ADAMW_MT_THREADS * ADAMW_MT_PER_THREAD;  // elements per block

// One non-empty segment as the kernel reads it: blocks [first_block, first_block + ⌈count/CHUNK⌉).
struct AdamWSegmentDev {
  size_t param_offset, state_offset, count;
  unsigned int first_block;
  int decay;
};

// The work list of adamw_multi_update: the non-empty segments in order, on the device (pool,
// Optimizer), uploaded once when built. Empty segments are left out (they update nothing). The
// launch's grid is at most enough blocks to fill the GPU once (ADAMW_MT_BLOCKS_PER_SM per SM); each
// block steps through chunks blockIdx.x, blockIdx.x + grid, ...
static const int ADAMW_MT_BLOCKS_PER_SM = 8;
struct AdamWSegmentTable {
  AdamWSegmentDev* dev = nullptr;  // [segments]
  int segments = 0;
  unsigned int blocks = 0;         // chunks of ADAMW_MT_CHUNK elements over all segments
  unsigned int grid = 0;           // the launch's blocks: min(blocks, SMs · ADAMW_MT_BLOCKS_PER_SM)
  AdamWSegmentTable() = default;
  // max_grid: at most this many blocks (0: fill the GPU once; tests pass a few, so that each block
  // walks through many chunks and segments)
  AdamWSegmentTable(const std::vector<ShardSegment>& segs, cudaStream_t stream, unsigned int max_grid = 0) {
    std::vector<AdamWSegmentDev> host;
    unsigned long long blocks_total = 0;
    for (const ShardSegment& g : segs) {
      if (g.count == 0) continue;
      host.push_back(AdamWSegmentDev{g.param_offset, g.state_offset, g.count, (unsigned int)blocks_total, g.decay ? 1 : 0});
      blocks_total += (g.count + ADAMW_MT_CHUNK - 1) / ADAMW_MT_CHUNK;
    }
    if (blocks_total > 0x7fffffffULL)
      fm_fail("adamw_multi_update", "too many elements for one launch", "blocks=%llu", blocks_total);
    segments = (int)host.size();
    blocks = (unsigned int)blocks_total;
    if (segments == 0) return;
    int device = 0, sms = 0;
    cudaCheck(cudaGetDevice(&device), "adamw.segment_table", "segments=%d", segments);
    cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "adamw.segment_table", "device=%d", device);
    const unsigned long long fill = max_grid ? max_grid : (unsigned long long)std::max(sms, 1) * ADAMW_MT_BLOCKS_PER_SM;
    grid = (unsigned int)std::min<unsigned long long>(blocks_total, fill);
    dev = pool().alloc_t<AdamWSegmentDev>(host.size(), Mem::Optimizer, "adamw.segment_table");
    copy_to_device(dev, host.data(), host.size() * sizeof(AdamWSegmentDev), stream, "adamw.segment_table");
  }
  ~AdamWSegmentTable() { pool().free(dev); }
  // the pool bytes a table of these segments holds (its non-empty ones)
  static size_t bytes(const std::vector<ShardSegment>& segs) {
    size_t n = 0;
    for (const ShardSegment& g : segs) n += g.count > 0;
    return n * sizeof(AdamWSegmentDev);
  }
  AdamWSegmentTable(const AdamWSegmentTable&) = delete;
  AdamWSegmentTable& operator=(const AdamWSegmentTable&) = delete;
};

// Chunk q (ADAMW_MT_CHUNK elements) belongs to the last segment whose first_block <= q. Block b
// takes chunks b, b + gridDim.x, ...: it finds its first chunk's segment by binary search, then only
// walks forward (the chunks ascend). Every thread of the block reads the same table entries (one
// cached broadcast); its elements are thread-strided, so each step of the inner loop is coalesced.
template <typename T>
__global__ void adamw_multi_kernel(float* master, T* param, float* m, float* v, const float* grad,
                                   const AdamWSegmentDev* table, int segments, unsigned int chunks,
                                   const AdamWCoefficients decay_c, const AdamWCoefficients no_decay_c) {
  int seg = 0;
  {
    int lo = 0, hi = segments - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (table[mid].first_block <= blockIdx.x) lo = mid;
      else hi = mid - 1;
    }
    seg = lo;
  }
  for (unsigned int q = blockIdx.x; q < chunks; q += gridDim.x) {
    while (seg + 1 < segments && table[seg + 1].first_block <= q) seg++;
    const AdamWSegmentDev g = table[seg];
    const AdamWCoefficients& c = g.decay ? decay_c : no_decay_c;
    const size_t first = (size_t)(q - g.first_block) * ADAMW_MT_CHUNK;
#pragma unroll
    for (int j = 0; j < ADAMW_MT_PER_THREAD; j++) {
      const size_t i = first + (size_t)j * ADAMW_MT_THREADS + threadIdx.x;
      if (i < g.count) {
        const size_t s = g.state_offset + i, p = g.param_offset + i;
        float mi = m[s], vi = v[s];
        const float w = adamw_element(mi, vi, master[s], grad[p], c);
        m[s] = mi;
        v[s] = vi;
        master[s] = w;
        param[p] = from_float<T>(w);
      }
    }
  }
}

// One AdamW step over every segment of `table` in one launch: for each segment g, the state
// master/m/v at [g.state_offset, +g.count) and param/grad at [g.param_offset, +g.count), with
// weight_decay where g.decay and 0 elsewhere — exactly adamw_update per segment, one launch.
inline void adamw_multi_update(float* master, floatX* param, float* m, float* v, const float* grad,
                               const AdamWSegmentTable& table, float lr, float beta1, float beta2, float eps,
                               float weight_decay, int t, float grad_scale, cudaStream_t stream) {
  if (t < 1) fm_fail("adamw_multi_update", "step t must be >= 1", "segments=%d t=%d", table.segments, t);
  if (table.blocks == 0) return;
  adamw_multi_kernel<<<table.grid, ADAMW_MT_THREADS, 0, stream>>>(
      master, param, m, v, grad, table.dev, table.segments, table.blocks,
      adamw_coefficients(lr, beta1, beta2, eps, weight_decay, t, grad_scale),
      adamw_coefficients(lr, beta1, beta2, eps, 0.f, t, grad_scale));
  launchCheck("adamw_multi_update", "segments=%d chunks=%u grid=%u t=%d", table.segments, table.blocks, table.grid, t);
}

// ---------------------------------------------------------------------------------------------
// The optimizer seam (notes/design.md §1.1): one unit owns the fp32 master weights and the moments of this
// rank's shards (ZeRO-1), steps them, and saves/loads them in the one checkpoint format (named
// sections "master", "adam_m", "adam_v", each [S] floats, S = the shard's element count, and the
// step count). The shard is a list of segments of the local flat parameter buffer, each one
// tensor's part of this rank's shard (so that weight decay is per tensor): config.hpp's ShardSegment
// and shard_segments, pure functions of the layout that the CPU tests check at any size.

using StateSections = std::vector<std::pair<std::string, std::vector<float>>>;

// The section `name` of a checkpoint's optimizer state, refused when missing or not [S] floats.
inline const std::vector<float>& state_section(const StateSections& sections, const char* name, size_t S) {
  const std::vector<float>* found = nullptr;
  for (const auto& sec : sections)
    if (sec.first == name) found = &sec.second;
  if (found == nullptr || found->size() != S)
    throw std::runtime_error(std::string("optimizer state: section ") + name + (found ? " has the wrong size" : " is missing") +
                             " (expected " + std::to_string(S) + " floats)");
  return *found;
}

struct Optimizer {
  std::vector<ShardSegment> segments;
  size_t state_count = 0;  // S
  long long steps = 0;     // steps taken (AdamW's t)
  Optimizer(std::vector<ShardSegment> segs, size_t S) : segments(std::move(segs)), state_count(S) {}
  virtual ~Optimizer() = default;
  // master (=) local_weights at the segments (device fp32, the local flat layout)
  virtual void set_master(const float* local_weights, cudaStream_t stream) = 0;
  // params (=) floatX(master) at the segments
  virtual void write_weights(floatX* params, cudaStream_t stream) = 0;
  // one step from the gradients at the segments (× grad_scale); writes master, moments and params there
  virtual void step(floatX* params, const float* grads, float lr, const AdamWSettings& s, float grad_scale,
                    cudaStream_t stream) = 0;
  virtual StateSections save(cudaStream_t stream) = 0;
  virtual void load(const StateSections& sections, long long steps_taken, cudaStream_t stream) = 0;
  // pinned host memory it holds (the device memory is the pool's, under Mem::Optimizer)
  virtual size_t host_bytes() const { return 0; }
};

// --optimizer adamw: the state on the GPU, stepped by one adamw_multi_update launch over all segments.
struct DeviceAdamW : Optimizer {
  float *master = nullptr, *m = nullptr, *v = nullptr;  // [S] each (Optimizer)
  std::unique_ptr<AdamWSegmentTable> table;             // the segments as one launch's work list
  // the device bytes it holds for S state elements over `segments` (predict_rank_memory)
  static size_t device_bytes(size_t S, const std::vector<ShardSegment>& segments) {
    return 3 * S * sizeof(float) + AdamWSegmentTable::bytes(segments);
  }

  // Zeroed on `stream` (the shard's padding stays 0).
  DeviceAdamW(std::vector<ShardSegment> segs, size_t S, cudaStream_t stream) : Optimizer(std::move(segs), S) {
    table = std::make_unique<AdamWSegmentTable>(segments, stream);
    master = pool().alloc_t<float>(S, Mem::Optimizer, "master");
    m = pool().alloc_t<float>(S, Mem::Optimizer, "adam_m");
    v = pool().alloc_t<float>(S, Mem::Optimizer, "adam_v");
    for (float* p : {master, m, v}) cudaCheck(cudaMemsetAsync(p, 0, S * sizeof(float), stream), "adamw", "S=%zu", S);
  }
  ~DeviceAdamW() override {
    for (float* p : {master, m, v}) pool().free(p);
  }
  void set_master(const float* local_weights, cudaStream_t stream) override {
    for (const ShardSegment& g : segments)
      cudaCheck(cudaMemcpyAsync(master + g.state_offset, local_weights + g.param_offset, g.count * sizeof(float),
                                cudaMemcpyDeviceToDevice, stream), "adamw.set_master", "count=%zu", g.count);
  }
  void write_weights(floatX* params, cudaStream_t stream) override {
    for (const ShardSegment& g : segments) convert(params + g.param_offset, master + g.state_offset, g.count, stream);
  }
  void step(floatX* params, const float* grads, float lr, const AdamWSettings& s, float grad_scale,
            cudaStream_t stream) override {
    steps++;
    adamw_multi_update(master, params, m, v, grads, *table, lr, s.beta1, s.beta2, s.eps, s.weight_decay, (int)steps,
                       grad_scale, stream);
  }
  StateSections save(cudaStream_t stream) override {
    StateSections out;
    for (auto [name, src] : {std::pair<const char*, float*>{"master", master}, {"adam_m", m}, {"adam_v", v}}) {
      std::vector<float> host(state_count);
      copy_to_host(host.data(), src, state_count * sizeof(float), stream, "adamw.save");
      out.emplace_back(name, std::move(host));
    }
    return out;
  }
  void load(const StateSections& sections, long long steps_taken, cudaStream_t stream) override {
    for (auto [name, dst] : {std::pair<const char*, float*>{"master", master}, {"adam_m", m}, {"adam_v", v}})
      copy_to_device(dst, state_section(sections, name, state_count).data(), state_count * sizeof(float), stream,
                     "adamw.load");
    steps = steps_taken;
  }
};
