// offload_adamw.cuh — AdamW with its state in pinned host memory (notes/design.md §6.7; paper:
// OffloadStreamAdamW; twin: ref/adamw.hpp): the optimizer seam's two other implementations.
//
// Both keep this rank's shard of the fp32 master weights, m and v in pinned host memory
// (cudaHostAlloc, 12·S bytes; S = the shard's element count, padding included) and save/load the same
// checkpoint sections as --optimizer adamw ("master", "adam_m", "adam_v", [S] each), so that a run
// can resume with any of the three.
//
// --optimizer offload_adamw (OffloadAdamW): the state streams through the GPU in buckets of β
// parameters (the state's [S] cut at multiples of β; a bucket may span tensors, and each tensor's part
// gets its own weight decay). Bucket i goes through slot i mod s of s staging slots on the GPU:
//   h2d stream:      wait until slot's previous bucket is home (emptied) → θ, m, v H2D → loaded
//   compute stream:  wait loaded → ops/adamw.cuh's adamw_update on the bucket's pieces (the same
//                    kernel as --optimizer adamw: grads read and weights written in place on the GPU) → updated
//   d2h stream:      wait updated → θ, m, v D2H → emptied
// so with s >= 2 the H2D of bucket i+1 and the D2H of bucket i−1 run while bucket i is updated, and
// both directions of the link are busy at once. The step ends (on the compute stream) when the last
// bucket is home. Device memory: one allocation of s·min(β, S)·12 bytes (Mem::Optimizer, "offload_slots").
// Bit-identical to --optimizer adamw: the same kernel on the same fp32 values.
//
// --optimizer cpu_adamw (CpuAdamW, the ZeRO-Offload design): gradients D2H into pinned [S] fp32, the
// CPU loop of ops/cpu_adamw.cpp over every core it is given (vectorised, the same element arithmetic
// as the kernel: bit-identical master, m, v and weights), the weights (floatX, rounded on the CPU) H2D.
// The three run as a pipeline over chunks of β parameters (the same --offload_bucket):
//   d2h stream:   chunk 0's gradients, chunk 1's, ... all queued at once, an event after each
//   CPU threads:  each waits for chunk i's event, updates its slice of chunk i, goes on to chunk i+1
//   compute stream: chunk i's weights H2D, queued by the thread that finishes chunk i's last slice
// so the step takes about one chunk's download + the CPU's update + one chunk's upload; with β >= S
// (one chunk) the three phases run one after another.
// Host memory: 12·S state + 4·S gradients + sizeof(floatX)·S weights; no device memory of its own.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <type_traits>
#include "adamw.cuh"
#include "cpu_adamw.hpp"

// Pinned host floats, zeroed.
inline float* pinned_floats(size_t n, const char* op) {
  void* p = nullptr;
  cudaCheck(cudaHostAlloc(&p, std::max<size_t>(n, 1) * sizeof(float), cudaHostAllocDefault), op,
            "cudaHostAlloc of %zu floats", n);
  std::memset(p, 0, n * sizeof(float));
  return (float*)p;
}

// master, m, v [S] fp32 each in pinned host memory, zeroed: 12·S bytes. One optimizer owns it, or
// several share it (tools/bench_optimizer.cu runs offload_adamw and cpu_adamw over the same state).
struct PinnedAdamWState {
  float *master = nullptr, *m = nullptr, *v = nullptr;
  size_t count;
  explicit PinnedAdamWState(size_t S) : count(S) {
    master = pinned_floats(S, "optimizer state: master");
    m = pinned_floats(S, "optimizer state: adam_m");
    v = pinned_floats(S, "optimizer state: adam_v");
  }
  ~PinnedAdamWState() {
    for (float* p : {master, m, v}) cudaCheck(cudaFreeHost(p), "optimizer state", "cudaFreeHost S=%zu", count);
  }
  PinnedAdamWState(const PinnedAdamWState&) = delete;
  PinnedAdamWState& operator=(const PinnedAdamWState&) = delete;
};

// The host side of both: the state in pinned memory, set/save/load.
struct HostAdamW : Optimizer {
  std::shared_ptr<PinnedAdamWState> state;
  float *master, *m, *v;  // state's [S] each
  const char* name;
  cudaStream_t home;  // the compute stream: its copies read and write the state

  // shared: a state of S elements to use (nullptr: a new one)
  HostAdamW(std::vector<ShardSegment> segs, size_t S, const char* optimizer_name, cudaStream_t stream,
            std::shared_ptr<PinnedAdamWState> shared)
      : Optimizer(std::move(segs), S),
        state(shared ? std::move(shared) : std::make_shared<PinnedAdamWState>(S)),
        master(state->master), m(state->m), v(state->v), name(optimizer_name), home(stream) {
    if (state->count != S) fm_fail(name, "the shared host state has the wrong size", "state=%zu S=%zu", state->count, S);
  }
  ~HostAdamW() override { stream_wait(home, name, "before releasing the host state, S=%zu", state_count); }
  HostAdamW(const HostAdamW&) = delete;
  HostAdamW& operator=(const HostAdamW&) = delete;

  void set_master(const float* local_weights, cudaStream_t stream) override {
    for (const ShardSegment& g : segments)
      copy_to_host(master + g.state_offset, local_weights + g.param_offset, g.count * sizeof(float), stream, name);
  }
  StateSections save(cudaStream_t stream) override {
    stream_wait(stream, name, "before saving the host state, S=%zu", state_count);
    StateSections out;
    for (auto [section, src] : {std::pair<const char*, float*>{"master", master}, {"adam_m", m}, {"adam_v", v}})
      out.emplace_back(section, std::vector<float>(src, src + state_count));
    return out;
  }
  void load(const StateSections& sections, long long steps_taken, cudaStream_t stream) override {
    stream_wait(stream, name, "before loading the host state, S=%zu", state_count);
    for (auto [section, dst] : {std::pair<const char*, float*>{"master", master}, {"adam_m", m}, {"adam_v", v}})
      std::memcpy(dst, state_section(sections, section, state_count).data(), state_count * sizeof(float));
    steps = steps_taken;
  }
  // the pinned fp32 master weights, m and v of a shard of S parameters
  static size_t host_bytes_for(size_t S) { return 3 * S * sizeof(float); }
  size_t host_bytes() const override { return host_bytes_for(state_count); }
};

// --optimizer cpu_adamw.
struct CpuAdamW : HostAdamW {
  // the weights as the CPU writes them: fp32, or bf16 bits (ops/cpu_adamw.hpp)
  using HostParam = std::conditional_t<sizeof(floatX) == 2, uint16_t, float>;
  float* grad = nullptr;         // [S] pinned: this step's gradients
  HostParam* param = nullptr;    // [S] pinned: the updated weights on their way to the GPU
  int threads;
  size_t chunk;                        // β: parameters per pipeline chunk, capped at the segments' total
  cudaStream_t d2h = nullptr;          // the gradients' copies
  std::vector<StreamPoint> gradients_home;  // per chunk: its gradients' copies

  CpuAdamW(std::vector<ShardSegment> segs, size_t S, int cpu_threads, size_t chunk_params, cudaStream_t stream,
           std::shared_ptr<PinnedAdamWState> shared = nullptr)
      : HostAdamW(std::move(segs), S, "cpu_adamw", stream, std::move(shared)), threads(cpu_threads) {
    if (threads < 1 || chunk_params < 1)
      fm_fail(name, "needs at least one thread and a chunk of >= 1 parameter", "threads=%d chunk=%zu S=%zu", threads,
              chunk_params, S);
    const size_t total = segments_elements(segments);
    chunk = std::max<size_t>(1, std::min(chunk_params, total));
    grad = pinned_floats(S, name);
    void* p = nullptr;
    cudaCheck(cudaHostAlloc(&p, std::max<size_t>(S, 1) * sizeof(HostParam), cudaHostAllocDefault), name,
              "cudaHostAlloc of %zu weights", S);
    param = (HostParam*)p;
    d2h = stream_create(name);
    gradients_home = std::vector<StreamPoint>((total + chunk - 1) / chunk);
  }
  ~CpuAdamW() override {
    stream_wait(home, name, "before freeing the host buffers, S=%zu", state_count);
    stream_wait(d2h, name, "d2h stream before freeing the host buffers, S=%zu", state_count);
    cudaCheck(cudaStreamDestroy(d2h), name, "cudaStreamDestroy d2h");
    cudaCheck(cudaFreeHost(grad), name, "cudaFreeHost gradients S=%zu", state_count);
    cudaCheck(cudaFreeHost(param), name, "cudaFreeHost weights S=%zu", state_count);
  }

  void write_weights(floatX* params, cudaStream_t stream) override {
    stream_wait(stream, name, "before rounding the weights, S=%zu", state_count);  // param may still be in a copy
    cpu_params_from_master(master, param, segments);
    copy_weights_up(params, 0, segments_elements(segments), stream);
  }
  void step(floatX* params, const float* grads, float lr, const AdamWSettings& s, const float* grad_scale,
            cudaStream_t stream) override {
    steps++;
    stream_after(d2h, stream, name);  // the gradients are final
    const size_t total = segments_elements(segments), num_chunks = gradients_home.size();
    for (size_t c = 0; c < num_chunks; c++) {
      for_segments_slice(segments, c * chunk, std::min(total, (c + 1) * chunk), [&](const ShardSegment& g, size_t a, size_t e) {
        cudaCheck(cudaMemcpyAsync(grad + a, grads + g.param_offset + (a - g.state_offset), (e - a) * sizeof(float),
                                  cudaMemcpyDeviceToHost, d2h), name, "gradients D2H chunk %zu of %zu, count=%zu", c,
                  num_chunks, e - a);
      });
      gradients_home[c].record(d2h, name);
    }
    // the clip factor, computed on the GPU; this wait also ends the previous step's weight copies,
    // whose host buffer the CPU now overwrites
    float scale = 1.f;
    copy_to_host(&scale, grad_scale, sizeof(float), stream, name);
    int device = 0;
    cudaCheck(cudaGetDevice(&device), name, "cudaGetDevice");
    // chunks [0, chunks_home) have their gradients on the host; one CPU thread at a time waits for more
    // (host_wait: bounded, and one wait at a time, as the wait watchdog expects)
    std::atomic<size_t> chunks_home{0};
    std::mutex waiting;
    CpuAdamWChunks pipeline;
    pipeline.chunk = chunk;
    pipeline.arrived = [&](size_t c) {  // on a CPU thread
      if (chunks_home.load(std::memory_order_acquire) > c) return;
      std::lock_guard<std::mutex> lock(waiting);
      cudaCheck(cudaSetDevice(device), name, "cudaSetDevice(%d) on a CPU thread", device);
      for (size_t next = chunks_home.load(std::memory_order_relaxed); next <= c; next++) {
        host_wait(gradients_home[next], name);
        chunks_home.store(next + 1, std::memory_order_release);
      }
    };
    pipeline.updated = [&](size_t c) {  // on a CPU thread
      cudaCheck(cudaSetDevice(device), name, "cudaSetDevice(%d) on a CPU thread", device);
      copy_weights_up(params, c * chunk, std::min(total, (c + 1) * chunk), stream);
    };
    cpu_adamw_step(master, m, v, grad, param, segments, lr, s, (int)steps, scale, threads, pipeline);
  }
  // the state, and the gradients and weights on their way
  static size_t host_bytes_for(size_t S) { return HostAdamW::host_bytes_for(S) + S * (sizeof(float) + sizeof(HostParam)); }
  size_t host_bytes() const override { return host_bytes_for(state_count); }

 private:
  // The weights of the segments' elements [first, last) (their concatenation) H2D on `stream`.
  void copy_weights_up(floatX* params, size_t first, size_t last, cudaStream_t stream) {
    for_segments_slice(segments, first, last, [&](const ShardSegment& g, size_t a, size_t e) {
      cudaCheck(cudaMemcpyAsync(params + g.param_offset + (a - g.state_offset), param + a, (e - a) * sizeof(floatX),
                                cudaMemcpyHostToDevice, stream), name, "weights H2D [%zu, %zu) count=%zu", first, last, e - a);
    });
  }
};

// --optimizer offload_adamw.
struct OffloadAdamW : HostAdamW {
  size_t bucket;  // β, capped at S
  int slots;      // s
  float* staging = nullptr;  // [s][3][β] on the GPU: θ, m, v of one bucket per slot (Optimizer)
  cudaStream_t h2d = nullptr, d2h = nullptr;
  std::vector<cudaEvent_t> loaded, updated, emptied;  // per slot
  // The staging slots, s·3·β floats (β capped at S): the optimizer's only device memory.
  static size_t device_bytes(size_t S, size_t bucket_params, int slots) {
    return (size_t)slots * 3 * std::max<size_t>(1, std::min(bucket_params, S)) * sizeof(float);
  }

  OffloadAdamW(std::vector<ShardSegment> segs, size_t S, size_t bucket_params, int staging_slots, cudaStream_t stream,
               std::shared_ptr<PinnedAdamWState> shared = nullptr)
      : HostAdamW(std::move(segs), S, "offload_adamw", stream, std::move(shared)),
        bucket(std::max<size_t>(1, std::min(bucket_params, S))), slots(staging_slots) {
    if (bucket_params < 1 || slots < 1)
      fm_fail(name, "needs a bucket of >= 1 parameter and >= 1 slot", "beta=%zu s=%d S=%zu", bucket_params, slots, S);
    for (size_t i = 1; i < segments.size(); i++)
      if (segments[i].state_offset < segments[i - 1].state_offset + segments[i - 1].count)
        fm_fail(name, "segments must be in state order", "segment %zu of %zu", i, segments.size());
    staging = pool().alloc_t<float>(device_bytes(S, bucket_params, slots) / sizeof(float), Mem::Optimizer, "offload_slots");
    h2d = stream_create(name);
    d2h = stream_create(name);
    for (auto* events : {&loaded, &updated, &emptied})
      for (int k = 0; k < slots; k++) {
        cudaEvent_t e = nullptr;
        cudaCheck(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), name, "event for slot %d of %d", k, slots);
        events->push_back(e);
      }
  }
  ~OffloadAdamW() override {
    stream_wait(h2d, name, "h2d stream before freeing the slots, s=%d", slots);
    stream_wait(d2h, name, "d2h stream before freeing the slots, s=%d", slots);
    for (auto* events : {&loaded, &updated, &emptied})
      for (cudaEvent_t e : *events) cudaCheck(cudaEventDestroy(e), name, "cudaEventDestroy s=%d", slots);
    cudaCheck(cudaStreamDestroy(h2d), name, "cudaStreamDestroy h2d");
    cudaCheck(cudaStreamDestroy(d2h), name, "cudaStreamDestroy d2h");
    pool().free(staging);
  }

  float* slot_master(int k) { return staging + (size_t)k * 3 * bucket; }

  // θ (= floatX(master)): master through slot 0 bucket by bucket, converted on the GPU.
  void write_weights(floatX* params, cudaStream_t stream) override {
    for (size_t lo = 0; lo < state_count; lo += bucket) {
      const size_t hi = std::min(state_count, lo + bucket);
      cudaCheck(cudaMemcpyAsync(slot_master(0), master + lo, (hi - lo) * sizeof(float), cudaMemcpyHostToDevice, stream),
                name, "write_weights H2D [%zu, %zu) of S=%zu", lo, hi, state_count);
      for_pieces(lo, hi, [&](const ShardSegment& g, size_t a, size_t e) {
        convert(params + g.param_offset + (a - g.state_offset), slot_master(0) + (a - lo), e - a, stream);
      });
    }
  }

  void step(floatX* params, const float* grads, float lr, const AdamWSettings& s, const float* grad_scale,
            cudaStream_t stream) override {
    steps++;
    stream_after(h2d, stream, name);  // after the previous step's copies home (joined into `stream`)
    float* host[3] = {master, m, v};
    for (size_t lo = 0, i = 0; lo < state_count; lo += bucket, i++) {
      const size_t hi = std::min(state_count, lo + bucket), n = hi - lo;
      const int k = (int)(i % slots);
      float* slot = slot_master(k);
      cudaCheck(cudaStreamWaitEvent(h2d, emptied[k], 0), name, "slot %d emptied, bucket %zu", k, i);
      for (int j = 0; j < 3; j++)
        cudaCheck(cudaMemcpyAsync(slot + j * bucket, host[j] + lo, n * sizeof(float), cudaMemcpyHostToDevice, h2d), name,
                  "H2D bucket %zu [%zu, %zu) slot %d of %d, beta=%zu", i, lo, hi, k, slots, bucket);
      cudaCheck(cudaEventRecord(loaded[k], h2d), name, "loaded, bucket %zu", i);
      cudaCheck(cudaStreamWaitEvent(stream, loaded[k], 0), name, "wait loaded, bucket %zu", i);
      for_pieces(lo, hi, [&](const ShardSegment& g, size_t a, size_t e) {
        const size_t p = g.param_offset + (a - g.state_offset), at = a - lo;
        adamw_update(slot + at, params + p, slot + bucket + at, slot + 2 * bucket + at, grads + p, e - a, lr, s.beta1,
                     s.beta2, s.eps, g.decay ? s.weight_decay : 0.f, (int)steps, grad_scale, stream);
      });
      cudaCheck(cudaEventRecord(updated[k], stream), name, "updated, bucket %zu", i);
      cudaCheck(cudaStreamWaitEvent(d2h, updated[k], 0), name, "wait updated, bucket %zu", i);
      for (int j = 0; j < 3; j++)
        cudaCheck(cudaMemcpyAsync(host[j] + lo, slot + j * bucket, n * sizeof(float), cudaMemcpyDeviceToHost, d2h), name,
                  "D2H bucket %zu [%zu, %zu) slot %d of %d, beta=%zu", i, lo, hi, k, slots, bucket);
      cudaCheck(cudaEventRecord(emptied[k], d2h), name, "emptied, bucket %zu", i);
    }
    stream_after(stream, d2h, name);  // the step ends when the state is home
  }

 private:
  // piece(segment, a, e) for each segment's part [a, e) of the state range [lo, hi)
  template <typename Piece>
  void for_pieces(size_t lo, size_t hi, Piece piece) {
    const auto first = std::partition_point(segments.begin(), segments.end(),
                                            [&](const ShardSegment& g) { return g.state_offset + g.count <= lo; });
    for (auto g = first; g != segments.end() && g->state_offset < hi; ++g) {
      const size_t a = std::max(lo, g->state_offset), e = std::min(hi, g->state_offset + g->count);
      if (a < e) piece(*g, a, e);
    }
  }
};
