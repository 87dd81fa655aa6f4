// zero3.cuh — ZeRO-3's dense weights (--zero 3; notes/zero3.md, paper §3.5 "MoP").
//
// Under ZeRO-1 every rank holds every dense weight in floatX and updates 1/W of them; under ZeRO-3 it
// keeps only that 1/W. The dense (replicated) tensors form one region per forward group — the embedding
// with layer 0, each layer, the final norm with a whole lm_head (config.hpp: param_layout with zero3,
// ParamRegion.gathered) — and a rank's local buffers keep its shard of each [padded / W]. The model asks
// for a group just before the group runs:
//
//   acquire(g)      the group's whole weights [padded] in a pool buffer (Weights), ready on the compute
//                   stream: all-gathered from every rank's shard by the gathering communicator (all W
//                   ranks, Parallel.dense) on that communicator's own stream, after the compute
//                   stream's work so far (which wrote the shards, and last read the memory the pool
//                   hands out);
//   prefetch(g)     the same, queued without waiting: the model prefetches the group it runs next while
//                   this one computes;
//   release(g)      the buffer back to the pool (its last reader is the compute stream);
//   grads_begin(g)  a zeroed buffer [padded] (Grads) for the group's weight gradients in a backward pass;
//   grads_end(g)    after the group's backward: its fp32 sum over the W ranks reduce-scattered (on the
//                   gathering communicator's stream, beside the next group's backward) and added into
//                   this rank's fp32 shard of the step's gradients (main_grads), the buffers freed after it;
//   join()          the compute stream waits for every reduce-scatter queued (before the update reads
//                   main_grads).
//
// Bound: at most two groups' gathered weights are live at once (the group running and the one
// prefetched), and one group's gradients with their fp32 copy and its reduced shard;
// `most_gathered` counts it, and the pool's peak of Weights shows it (tests/gpu_zero3.cu).
// The sum: BF16 gradients are converted to fp32 before the reduce-scatter, so the sum over the ranks
// is fp32, as ZeRO-1's reduce-scatter of main_grads; what differs is the order — ZeRO-1 sums a step's
// passes on each rank, then the ranks; ZeRO-3 sums the ranks in each pass, then the passes (one pass: the
// same terms, NCCL's order over the ranks). W = 1: the gather is a copy on the compute stream and the
// reduce-scatter an add of the group's gradients into the shard (which is the whole group): the
// arithmetic of ZeRO-1 at W = 1, bit for bit.
#pragma once
#include <vector>

#include "../ops/common.cuh"
#include "comm.cuh"
#include "pool.cuh"
#include "stream.cuh"

struct Zero3Weights {
  Comm comm;                        // the gathering communicator: all W ranks (Parallel.dense; size 1 at W = 1)
  std::vector<ParamRegion> groups;  // the gathered regions, by forward group (empty: ZeRO-1)

  struct Group {
    floatX* weights = nullptr;  // [padded] while gathered
    floatX* grads = nullptr;    // [padded] during the group's backward
    StreamPoint gathered;       // the weights' all-gather done (on comm's stream)
  };
  std::vector<Group> live;
  int gathered_now = 0;   // groups whose weights are in a pool buffer now
  int most_gathered = 0;  // the most at once since the model was made (the bound: 2)

  bool on() const { return !groups.empty(); }

  void init(const Comm& c, const std::vector<ParamRegion>& regions) {
    comm = c;
    groups.clear();
    for (const ParamRegion& r : regions)
      if (r.gathered) groups.push_back(r);
    live = std::vector<Group>(groups.size());
  }

  void prefetch(int g, const floatX* params, cudaStream_t compute) {
    Group& G = live.at(g);
    if (G.weights != nullptr) return;
    const ParamRegion& r = groups[g];
    G.weights = pool().alloc_t<floatX>(r.padded, Mem::Weights, "zero3_weights");
    most_gathered = std::max(most_gathered, ++gathered_now);
    if (comm.size == 1) {
      cudaCheck(cudaMemcpyAsync(G.weights, params + r.shard_offset, r.padded * sizeof(floatX), cudaMemcpyDeviceToDevice,
                                compute),
                "zero3.gather", "group=%d count=%zu", g, r.padded);
      G.gathered.record(compute, "zero3.gather");
      return;
    }
    stream_after(comm.stream, compute, "zero3.gather");
    all_gather(comm, params + r.shard_offset, G.weights, r.shard, comm.stream);
    G.gathered.record(comm.stream, "zero3.gather");
  }

  floatX* acquire(int g, const floatX* params, cudaStream_t compute) {
    prefetch(g, params, compute);
    live[g].gathered.wait_on(compute, "zero3.acquire");
    return live[g].weights;
  }

  void release(int g) {
    Group& G = live.at(g);
    if (G.weights == nullptr) return;
    pool().free(G.weights);
    G.weights = nullptr;
    gathered_now--;
  }

  floatX* grads_begin(int g, cudaStream_t compute) {
    Group& G = live.at(g);
    const ParamRegion& r = groups[g];
    G.grads = pool().alloc_t<floatX>(r.padded, Mem::Grads, "zero3_grads");
    cudaCheck(cudaMemsetAsync(G.grads, 0, r.padded * sizeof(floatX), compute), "zero3.grads_begin", "group=%d count=%zu", g,
              r.padded);
    return G.grads;
  }

  void grads_end(int g, float* main_grads, cudaStream_t compute) {
    Group& G = live.at(g);
    const ParamRegion& r = groups[g];
    float* shard = main_grads + r.shard_offset;
    if (comm.size == 1) {
      add_inplace_or_out(shard, shard, G.grads, r.padded, compute);
      pool().free(G.grads);
      G.grads = nullptr;
      return;
    }
    // fp32 gradients of the whole group (the BF16 build converts; the FP32 build's are fp32 already)
    float* whole = reinterpret_cast<float*>(G.grads);
    if (!std::is_same<floatX, float>::value) {
      whole = pool().alloc_t<float>(r.padded, Mem::Grads, "zero3_grads_fp32");
      convert(whole, G.grads, r.padded, compute);
    }
    float* reduced = pool().alloc_t<float>(r.shard, Mem::Grads, "zero3_grads_shard");
    stream_after(comm.stream, compute, "zero3.reduce_scatter");
    reduce_scatter_sum(comm, whole, reduced, r.shard, comm.stream);
    add_inplace_or_out(shard, shard, reduced, r.shard, comm.stream);
    for (void* p : {(void*)reduced, (void*)whole}) pool().free_after(p, comm.stream);
    if ((void*)whole != (void*)G.grads) pool().free_after(G.grads, comm.stream);
    G.grads = nullptr;
  }

  void join(cudaStream_t compute) {
    if (on() && comm.size > 1) stream_after(compute, comm.stream, "zero3.join");
  }
};
