// adamw.cuh — AdamW with decoupled weight decay on fp32 master weights (twin: ref/adamw.hpp).
//
//   g  = grad · grad_scale                       (grad_scale: the clip factor, see clip_scale; read on
//                                                 the device, where clip_scale_on_device wrote it)
//   m  = β1·m + (1 − β1)·g                       m (in place)
//   v  = β2·v + (1 − β2)·g²                      v (in place)
//   m̂ = m / (1 − β1ᵗ),  v̂ = v / (1 − β2ᵗ)        t = 1-based step
//   master −= lr · (m̂ / (√v̂ + eps) + wd · master)   master (in place)
//   param  = floatX(master)                      param (=), round to nearest
// The element arithmetic, with its multiply-adds as explicit fmas, is ops/adamw_math.hpp's
// adamw_element, shared with the CPU loop of --optimizer cpu_adamw (bit-identical results).
//
// Shapes: master, m, v [n] float; param [n] floatX; grad [n] float (the model's fp32 gradients summed
// over a step's micro-batches, model.cuh's main_grads) or, in adamw_multi_update, floatX (the one
// pass's gradients of a step that has only one, read as fp32: the same values, model.cuh's
// model_train_step). Element-wise, fp32; the bias
// corrections are computed on the host in double and passed as fp32.
// The gradient norm for clipping comes from common.cuh's deterministic sumsq_accumulate /
// sumsq_finish over all gradient tensors; clip_scale_on_device turns it into grad_scale on the GPU
// (the host's clip_scale, the same bits), so that the host queues the update without waiting for the
// norm.
//
// Launches: adamw_update is one launch over one tensor; adamw_multi_update is one launch per layer's
// segments of a rank's shard (up to 64 per launch; the multi-tensor form that --optimizer adamw steps
// with, instead of a launch per segment: L + 1 launches instead of ~118 on a 334M MoE, so that the
// next forward can start on a layer once its weights are written: model.cuh). Both run adamw_chunk, one block per
// chunk of ADAMW_CHUNK elements, with the same coefficients per element, so their results are
// bit-identical (tests/gpu_adamw.cu asserts it with memcmp). Memory-bound: 30 bytes per element
// (master, m, v, grad read; master, m, v, param written) at HBM speed.
//
// Memory: none of their own (the segments travel as kernel arguments). The optimizer seam at the end
// of this file (notes/design.md §1.1, --optimizer adamw) owns this rank's shard of the state: master,
// m, v, 3·S·4 B (Optimizer).
#pragma once
#include <algorithm>
#include <cmath>
#include <functional>
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
FM_HOST_DEVICE inline float clip_scale(float grad_norm, float max_norm) {
  if (max_norm <= 0.f) return 1.f;
  return fminf(1.f, max_norm / (grad_norm + 1e-6f));
}

static __global__ void clip_scale_kernel(float* grad_scale, const float* sumsq, float max_norm) {
  *grad_scale = clip_scale(sqrtf(*sumsq), max_norm);  // sqrtf and the division round as the host's (IEEE)
}

// *grad_scale (=, device) = clip_scale(√*sumsq, max_norm), sumsq on the device (sumsq_finish's).
inline void clip_scale_on_device(float* grad_scale, const float* sumsq, float max_norm, cudaStream_t stream) {
  clip_scale_kernel<<<1, 1, 0, stream>>>(grad_scale, sumsq, max_norm);
  launchCheck("clip_scale_on_device", "max_norm=%g", max_norm);
}

// One launch's unit of work: a chunk of ADAMW_CHUNK consecutive elements, ADAMW_PER_THREAD per thread,
// thread-strided (each step of a loop over j is one coalesced access per array).
static const int ADAMW_THREADS = 256;
static const int ADAMW_PER_THREAD = 4;                               // elements per thread
static const int ADAMW_CHUNK = ADAMW_THREADS * ADAMW_PER_THREAD;     // elements per block and chunk

// The elements [first, first + ADAMW_CHUNK) ∩ [0, count) of one tensor's part: master, m, v at the
// state's offset and param, grad at the parameters' offset. Every load of the chunk is issued before
// any store, 16 independent loads in flight per thread (the compiler cannot move an element's loads
// above the previous element's stores: it cannot prove that the arrays do not overlap). One block per
// chunk this way moves 4.0 TB/s on an H200, one element per thread 3.3 TB/s
// (notes/speed.md, 'The update beside the next forward').
template <typename T, typename G>
__device__ inline void adamw_chunk(float* master, T* param, float* m, float* v, const G* grad, size_t count,
                                   size_t first, const AdamWCoefficients& c) {
  float mi[ADAMW_PER_THREAD], vi[ADAMW_PER_THREAD], wi[ADAMW_PER_THREAD], gi[ADAMW_PER_THREAD];
#pragma unroll
  for (int j = 0; j < ADAMW_PER_THREAD; j++) {
    const size_t i = first + (size_t)j * ADAMW_THREADS + threadIdx.x;
    if (i < count) {
      mi[j] = m[i];
      vi[j] = v[i];
      wi[j] = master[i];
      gi[j] = to_float(grad[i]);
    }
  }
#pragma unroll
  for (int j = 0; j < ADAMW_PER_THREAD; j++) {
    const size_t i = first + (size_t)j * ADAMW_THREADS + threadIdx.x;
    if (i < count) {
      const float w = adamw_element(mi[j], vi[j], wi[j], gi[j], c);
      m[i] = mi[j];
      v[i] = vi[j];
      master[i] = w;
      param[i] = from_float<T>(w);
    }
  }
}

// One tensor: block b takes chunk b. c's grad_scale is the device's *grad_scale.
template <typename T>
__global__ void adamw_kernel(float* master, T* param, float* m, float* v, const float* grad, size_t n,
                             AdamWCoefficients c, const float* grad_scale) {
  c.grad_scale = *grad_scale;
  adamw_chunk(master, param, m, v, grad, n, (size_t)blockIdx.x * ADAMW_CHUNK, c);
}

// One AdamW step over n parameters (see the header comment); grad_scale: device [1].
inline void adamw_update(float* master, floatX* param, float* m, float* v, const float* grad, size_t n, float lr,
                         float beta1, float beta2, float eps, float weight_decay, int t, const float* grad_scale,
                         cudaStream_t stream) {
  if (t < 1) fm_fail("adamw_update", "step t must be >= 1", "n=%zu t=%d", n, t);
  if (n == 0) return;
  adamw_kernel<<<ceil_div((long long)n, ADAMW_CHUNK), ADAMW_THREADS, 0, stream>>>(
      master, param, m, v, grad, n, adamw_coefficients(lr, beta1, beta2, eps, weight_decay, t, 1.f), grad_scale);
  launchCheck("adamw_update", "n=%zu t=%d", n, t);
}

// ---------------------------------------------------------------------------------------------
// Multi-tensor AdamW: one launch over many segments of the same flat buffers.

// One non-empty segment as the kernel reads it: its blocks [first_block, first_block + ⌈count/CHUNK⌉)
// of the launch it is in.
struct AdamWSegmentArg {
  size_t param_offset, state_offset, count;
  unsigned int first_block;
  int decay;
};

// One launch's segments, passed by value as its kernel argument (2 KiB; kernel arguments ≤ 4 KiB):
// a block finds its segment by a binary search in the constant cache, and the optimizer holds no
// device memory besides its state.
static const int ADAMW_SEGMENTS_PER_LAUNCH = 64;
struct AdamWSegmentBatch {
  AdamWSegmentArg seg[ADAMW_SEGMENTS_PER_LAUNCH];
  int count = 0;            // segments in seg
  unsigned int blocks = 0;  // the launch's blocks: chunks of ADAMW_CHUNK elements over its segments
};

// The launches of adamw_multi_update: the non-empty segments by group (ShardSegment.group: the layer
// whose forward reads them first), in order within a group, ADAMW_SEGMENTS_PER_LAUNCH per launch and a
// new launch for each group (one launch per layer of a shard, ~L + 1 in all), so that the update can
// release the next forward layer by layer (model.cuh). Each element's arithmetic does not depend on
// the launch it is in. Empty segments are left out (they update nothing). Host memory only; built once.
struct AdamWLaunchPlan {
  std::vector<AdamWSegmentBatch> batches;
  std::vector<int> batch_group;  // [batch]: the group its segments belong to (ascending)
  int segments = 0;  // non-empty
  AdamWLaunchPlan() = default;
  explicit AdamWLaunchPlan(std::vector<ShardSegment> segs) {
    std::stable_sort(segs.begin(), segs.end(), [](const ShardSegment& a, const ShardSegment& b) { return a.group < b.group; });
    for (const ShardSegment& g : segs) {
      if (g.count == 0) continue;
      if (batches.empty() || batches.back().count == ADAMW_SEGMENTS_PER_LAUNCH || batch_group.back() != g.group) {
        batches.emplace_back();
        batch_group.push_back(g.group);
      }
      AdamWSegmentBatch& b = batches.back();
      const unsigned long long blocks = b.blocks + (g.count + ADAMW_CHUNK - 1) / ADAMW_CHUNK;
      if (blocks > 0x7fffffffULL)
        fm_fail("adamw_multi_update", "too many elements for one launch", "blocks=%llu segments=%d", blocks, b.count + 1);
      b.seg[b.count++] = AdamWSegmentArg{g.param_offset, g.state_offset, g.count, b.blocks, g.decay ? 1 : 0};
      b.blocks = (unsigned int)blocks;
      segments++;
    }
  }
};

// Block q does chunk q (ADAMW_CHUNK elements) of the launch, which belongs to the last segment whose
// first_block <= q. The coefficients are one struct whose weight decay is replaced in a register where
// the segment has none, and whose grad_scale is the device's *grad_scale. (Choosing between two
// coefficient arguments by reference made every use of a coefficient a load through a generic
// address: the kernel ran at 57 % of adamw_update's rate.)
template <typename T, typename G>
__global__ void adamw_multi_kernel(float* master, T* param, float* m, float* v, const G* grad,
                                   const AdamWSegmentBatch batch, const AdamWCoefficients decay_c,
                                   const float* grad_scale) {
  const unsigned int q = blockIdx.x;
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (batch.seg[mid].first_block <= q) lo = mid;
    else hi = mid - 1;
  }
  const AdamWSegmentArg g = batch.seg[lo];
  AdamWCoefficients c = decay_c;
  if (!g.decay) c.weight_decay = 0.f;
  c.grad_scale = *grad_scale;
  adamw_chunk(master + g.state_offset, param + g.param_offset, m + g.state_offset, v + g.state_offset,
              grad + g.param_offset, g.count, (size_t)(q - g.first_block) * ADAMW_CHUNK, c);
}

// Called on the host once a group's launches are queued, with the group (ascending; groups without
// segments are skipped): what is recorded on the stream then follows that group's writes.
using GroupDone = std::function<void(int group)>;

// One AdamW step over every segment of `plan`: for each segment g, the state master/m/v at
// [g.state_offset, +g.count) and param/grad at [g.param_offset, +g.count), with weight_decay where
// g.decay and 0 elsewhere — exactly adamw_update per segment, in plan.batches.size() launches.
// G: float, or floatX (converted exactly when read). grad_scale: device [1].
template <typename G>
inline void adamw_multi_update(float* master, floatX* param, float* m, float* v, const G* grad,
                               const AdamWLaunchPlan& plan, float lr, float beta1, float beta2, float eps,
                               float weight_decay, int t, const float* grad_scale, cudaStream_t stream,
                               const GroupDone& group_done = nullptr) {
  if (t < 1) fm_fail("adamw_multi_update", "step t must be >= 1", "segments=%d t=%d", plan.segments, t);
  const AdamWCoefficients c = adamw_coefficients(lr, beta1, beta2, eps, weight_decay, t, 1.f);
  for (size_t i = 0; i < plan.batches.size(); i++) {
    const AdamWSegmentBatch& b = plan.batches[i];
    adamw_multi_kernel<<<b.blocks, ADAMW_THREADS, 0, stream>>>(master, param, m, v, grad, b, c, grad_scale);
    launchCheck("adamw_multi_update", "segments=%d blocks=%u t=%d", b.count, b.blocks, t);
    const bool group_ends = i + 1 == plan.batches.size() || plan.batch_group[i + 1] != plan.batch_group[i];
    if (group_done && group_ends) group_done(plan.batch_group[i]);
  }
}

// ---------------------------------------------------------------------------------------------
// The optimizer seam (notes/design.md §1.1, notes/seams.md): one unit owns the fp32 master weights and the
// moments of this rank's shards (ZeRO-1), steps them, and saves/loads them in the one checkpoint format
// (named sections "master", "adam_m", "adam_v", each [S] floats, S = the shard's element count, and the
// step count). The shard is a list of segments of the local flat parameter buffer, each one
// tensor's part of this rank's shard (so that weight decay is per tensor): config.hpp's ShardSegment
// and shard_segments, pure functions of the layout that the CPU tests check at any size.
// Each optimizer is a class derived from Optimizer (ops/adamw.cuh: adamw; ops/offload_adamw.cuh:
// cpu_adamw, offload_adamw), registered by one line of config.hpp's optimizer_choices (its name and
// flags) and made by its line of seams.cuh's optimizer_factories, which also gives its state's device
// and pinned host bytes for a shard of S parameters (the per-rank prediction). The model makes one at
// start-up (--optimizer). The contract, the whole of it (each virtual below says its part):
//   made      with its state allocated and zeroed on the stream it is given; Optimizer::steps = 0.
//   the model's calls: set_master once the weights are set (model_set_local_master), write_weights,
//             step once per optimizer step on the gradients summed over the step's micro-batches and
//             reduced over the ranks that share each region (main_grads; step_from_pass_grads instead
//             where reads_pass_grads()), save and load for checkpoints (the same sections from any
//             optimizer: a run may resume with another).
//   every call in the order of the stream it is given; a step adds 1 to `steps` and writes params at
//             the segments only (the model all-gathers the rest).

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
  // one step from the gradients at the segments (× *grad_scale, a device float: the clip factor);
  // writes master, moments and params there
  virtual void step(floatX* params, const float* grads, float lr, const AdamWSettings& s, const float* grad_scale,
                    cudaStream_t stream) = 0;
  // Whether step_from_pass_grads exists: a step of one pass on one rank then reads that pass's floatX
  // gradients, the values main_grads would hold after the fold that the step can skip (model.cuh).
  virtual bool reads_pass_grads() const { return false; }
  // step, from floatX gradients (converted exactly when read): the same update, bit for bit
  virtual void step_from_pass_grads(floatX* params, const floatX* grads, float lr, const AdamWSettings& s,
                                    const float* grad_scale, cudaStream_t stream) {
    (void)params, (void)grads, (void)lr, (void)s, (void)grad_scale, (void)stream;
    fm_fail("optimizer", "this optimizer reads fp32 gradients only (reads_pass_grads() is false)", "steps=%lld", steps);
  }
  // Whether the step is launches on `stream` only, group by group (ShardSegment.group), calling
  // group_done after each group's: the model then runs it beside the next forward (model.cuh,
  // model_update). Only such an optimizer calls group_done; the model sets it only for one.
  virtual bool steps_by_group() const { return false; }
  GroupDone group_done;
  virtual StateSections save(cudaStream_t stream) = 0;
  virtual void load(const StateSections& sections, long long steps_taken, cudaStream_t stream) = 0;
  // pinned host memory it holds (the device memory is the pool's, under Mem::Optimizer)
  virtual size_t host_bytes() const { return 0; }
};

// --optimizer adamw: the state on the GPU, stepped by adamw_multi_update: one launch per group of segments.
struct DeviceAdamW : Optimizer {
  float *master = nullptr, *m = nullptr, *v = nullptr;  // [S] each (Optimizer)
  AdamWLaunchPlan plan;                                  // the segments as a few launches' arguments
  // the device bytes it holds for S state elements (predict_rank_memory)
  static size_t device_bytes(size_t S) { return 3 * S * sizeof(float); }

  // Zeroed on `stream` (the shard's padding stays 0).
  DeviceAdamW(std::vector<ShardSegment> segs, size_t S, cudaStream_t stream) : Optimizer(std::move(segs), S) {
    plan = AdamWLaunchPlan(segments);
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
  void step(floatX* params, const float* grads, float lr, const AdamWSettings& s, const float* grad_scale,
            cudaStream_t stream) override {
    step_on(params, grads, lr, s, grad_scale, stream);
  }
  bool reads_pass_grads() const override { return true; }
  bool steps_by_group() const override { return true; }
  void step_from_pass_grads(floatX* params, const floatX* grads, float lr, const AdamWSettings& s,
                            const float* grad_scale, cudaStream_t stream) override {
    step_on(params, grads, lr, s, grad_scale, stream);
  }
  template <typename G>
  void step_on(floatX* params, const G* grads, float lr, const AdamWSettings& s, const float* grad_scale,
               cudaStream_t stream) {
    steps++;
    adamw_multi_update(master, params, m, v, grads, plan, lr, s.beta1, s.beta2, s.eps, s.weight_decay, (int)steps,
                       grad_scale, stream, group_done);
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
