// sco.cuh — SCO, selective checkpoint offload (notes/design.md §6.6, notes/sco.md): the layer
// boundaries of ops/sco_plan.hpp's set S leave the device after their layer's forward, wait in pinned
// host memory, and come back one layer before their recomputation. Copies only: a pass with SCO is
// bit-identical to one without (tests/sco_training.cuh asserts it with memcmp). It computes nothing:
// what it must preserve is the model's own math, ref/model.hpp, which the model tests hold the model to. model.cuh's LayerBoundaries (the layer-boundary seam) calls it; --offload_budget BYTES sets
// the budget (a training pass under --recompute 1 offloads; other passes keep every boundary).
//
// What it bounds: under --recompute 1 the boundaries input[0..L] (N×H each, b bytes per scalar,
// Mem::Checkpoints) are the only activations kept across a pass: (L + 1)·N·H·b device bytes. With S
// offloaded the device holds at most
//     (L + 1 − |S|)·N·H·b  +  min(|S|, 2)·N·H·b
// the kept boundaries plus at most 2 offloaded ones at a time (forward: the one layer l reads, still
// being copied out, and the one it writes; backward: the one being recomputed and the prefetch of the
// next). The host holds |S|·N·H·b pinned bytes, allocated for the first pass of a size and reused.
//
// Schedule (cs: the model's compute stream; xs: this object's copy stream):
//   forward, once layer l is issued (it read input[l]), l in S:
//     xs waits for cs so far (stream_after) → input[l] D2H into its pinned buffer; the device block goes
//     back with pool().free_after(input[l], xs): it leaves the live set at once (the Checkpoints peak
//     falls during the forward) and the pool hands it out again only after an event recorded on xs
//     behind the copy has completed. Chosen over a host wait (cudaEventSynchronize before pool().free):
//     the forward loop never waits for a copy, and no later allocation can get bytes the copy still reads.
//   backward, before layer l is recomputed:
//     l in S: cs waits for input[l]'s arrival point (StreamPoint on xs); the topmost boundary of S,
//       which no earlier step prefetched, is fetched first;
//     l − 1 in S: a fresh pool block (Checkpoints, ready on cs), xs waits for cs so far, input[l − 1]
//       H2D, its arrival point recorded on xs: the copy runs while layer l is recomputed and
//       backpropagated.
//   input[l] is released after layer l's backward (input[L] after the final norm's backward).
//
// Worked example: L = 4, budget 2 boundaries → S = {0, 1}. Device boundaries (after each step):
//   forward   embedding: in0 | layer 0: in0 in1, in0 → host | layer 1: in1 in2, in1 → host
//             layer 2: in2 in3 | layer 3: in2 in3 in4 (3 = L + 1 − |S|)
//   head      in2 in3 in4, then in4 released
//   backward  layer 3: in2 in3 | layer 2: in2 + in1 prefetched | layer 1: wait in1, in0 prefetched
//             → in1 in0 | layer 0: wait in0 → in0
// Peak 3·N·H·b instead of 5·N·H·b; the bound above allows 5 − 2 + 2 = 5 (it does not use the order).
#pragma once
#include <vector>
#include "common.cuh"
#include "sco_plan.hpp"
#include "../runtime/pool.cuh"
#include "../runtime/stream.cuh"

class CheckpointOffload {
 public:
  explicit CheckpointOffload(long long budget) : budget_(budget) {
    if (budget < 0) fm_fail("CheckpointOffload", "the offload budget must be >= 0 bytes", "budget=%lld", budget);
  }
  ~CheckpointOffload() { free_host(); }
  CheckpointOffload(const CheckpointOffload&) = delete;
  CheckpointOffload& operator=(const CheckpointOffload&) = delete;

  long long budget() const { return budget_; }

  // The plan for passes of L layers whose boundaries hold `elements` floatX each (N·H); the pinned
  // buffers of its set, allocated when the size differs from the previous pass's.
  const ScoPlan& plan_for(int L, size_t elements) {
    if (elements == elements_ && plan_.layers() == L) return plan_;
    free_host();
    elements_ = elements;
    plan_ = sco_plan(L, elements * sizeof(floatX), budget_);
    host_.assign(L, nullptr);
    arrived_ = std::vector<StreamPoint>(L);
    if (plan_.count == 0) return plan_;
    copy_stream_ = stream_create("sco");
    for (int l = 0; l < L; l++) {
      if (!plan_.offloaded[l]) continue;
      void* p = nullptr;
      cudaCheck(cudaHostAlloc(&p, plan_.boundary_bytes, cudaHostAllocDefault), "sco", "cudaHostAlloc boundary %d of %zu bytes",
                l, plan_.boundary_bytes);
      host_[l] = (floatX*)p;
    }
    return plan_;
  }

  // Forward, layer l issued on `compute`: input[l] (`device`) D2H on the copy stream; the device block
  // returns to the pool once the copy has read it (free_after, see the header).
  void to_host(int l, floatX* device, cudaStream_t compute) {
    stream_after(copy_stream_, compute, "sco.to_host");
    cudaCheck(cudaMemcpyAsync(host_[l], device, plan_.boundary_bytes, cudaMemcpyDeviceToHost, copy_stream_), "sco.to_host",
              "boundary %d, %zu bytes", l, plan_.boundary_bytes);
    pool().free_after(device, copy_stream_);
    count_copy();
  }

  // Backward: a fresh device block [N, H] for input[l], filled H2D on the copy stream after the work
  // queued on `compute` so far; wait_arrived orders its readers after the copy.
  floatX* prefetch(int l, cudaStream_t compute) {
    floatX* device = pool().alloc_t<floatX>(elements_, Mem::Checkpoints, "residual_prefetched");
    stream_after(copy_stream_, compute, "sco.prefetch");
    cudaCheck(cudaMemcpyAsync(device, host_[l], plan_.boundary_bytes, cudaMemcpyHostToDevice, copy_stream_), "sco.prefetch",
              "boundary %d, %zu bytes", l, plan_.boundary_bytes);
    arrived_[l].record(copy_stream_, "sco.prefetch");
    count_copy();
    return device;
  }

  // Work enqueued on `compute` from now on reads input[l] after its prefetch has landed.
  void wait_arrived(int l, cudaStream_t compute) const { arrived_[l].wait_on(compute, "sco.wait_arrived"); }

  size_t host_bytes() const { return plan_.host_bytes; }  // pinned, held until the next size or the end
  long long copies() const { return copies_; }             // D2H and H2D copies issued so far
  size_t bytes_moved() const { return bytes_moved_; }      // their bytes, both directions

 private:
  void count_copy() {
    copies_++;
    bytes_moved_ += plan_.boundary_bytes;
  }
  // Waits for the copies in flight, then gives the pinned buffers and the copy stream back.
  void free_host() {
    if (copy_stream_ == nullptr) return;
    stream_wait(copy_stream_, "sco", "copies of %d boundaries in flight", plan_.count);
    for (floatX* p : host_)
      if (p != nullptr) cudaCheck(cudaFreeHost(p), "sco", "cudaFreeHost of %zu bytes", plan_.boundary_bytes);
    host_.clear();
    cudaCheck(cudaStreamDestroy(copy_stream_), "sco", "cudaStreamDestroy");
    copy_stream_ = nullptr;
    plan_ = ScoPlan();
  }

  long long budget_;
  ScoPlan plan_;                     // for boundaries of elements_ floatX
  size_t elements_ = 0;              // N·H of the passes the plan is for
  cudaStream_t copy_stream_ = nullptr;
  std::vector<floatX*> host_;        // [L] pinned [N, H] for l in S, nullptr otherwise
  std::vector<StreamPoint> arrived_; // [L] input[l]'s H2D has landed (recorded on the copy stream)
  long long copies_ = 0;
  size_t bytes_moved_ = 0;
};
