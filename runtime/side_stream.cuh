// side_stream.cuh — work off the critical path on a second stream, forked from and joined back into
// a main stream (notes/design.md §5; model.cuh: the weight gradients beside the backward,
// notes/speed.md, 'The weight-gradient lanes').
//
// In a layer's backward the chain dL/dx → dL/d(layer input) is the critical path; each weight
// gradient (dW += doutᵀ·x) hangs off it and nothing in the layer reads it. On a small model every
// kernel is short and leaves SMs idle, so a weight gradient computed on a side stream runs in the idle
// SMs while the main stream goes on with the next input gradient.
//
//   side.run(main, op, [&](cudaStream_t s) { ...enqueue on s... })   fork: what is enqueued on s runs
//        after the main stream's work so far; every pool free() inside is held (below)
//   side.hold(p)   instead of pool().free(p) for a buffer the side work reads (p stays live)
//   side.join(main, op)   the main stream's next work runs after all the side work so far; the held
//        buffers are freed (now safe: their last users are ordered before the main stream's next work)
//
// Memory: a held buffer stays live from its free (in the host's order) to the join, whether the side
// stream is a stream of its own or the main stream itself (off: run() enqueues on the main stream,
// fork and join are nothing, and the frees are held the same way). So the pool's live bytes and
// peaks, and every kernel and its bits, are the same on or off; only the order in which the GPU runs
// independent kernels differs.
// Lanes: on, the side work goes to LANES streams in turn (run i to lane i mod LANES, counted from the
// last join), so that a weight gradient forked while the one before still runs does not queue behind
// it (the default model's dW2, 72 blocks, still runs when dW13 is forked; each lane's chain of short
// kernels waits out its own latencies). Every run writes a tensor no other run of the same join writes,
// so the lanes never race. Each lane has cuBLAS's workspace of its own (runtime/pool.cuh
// cublas_own_workspace: 32 MiB each, Workspace), since two cuBLAS GEMMs at once must not share one.
// Priorities: the side stream has the lowest (StreamPriority::Background), so that the block scheduler
// gives the critical path's kernels the SMs first (the compute stream's own priority made the default
// model's step 0.02–0.04 ms shorter and B1's 0.2–0.6 ms longer,
// notes/speed.md, 'The weight-gradient lanes'); a captured graph keeps each node's priority
// (runtime/graph.cuh instantiates with cudaGraphInstantiateFlagUseNodePriority).
// A captured pass (runtime/graph.cuh): the fork and join are event edges of the graph; every run()
// must be joined before the capture ends.
#pragma once
#include <vector>
#include "pool.cuh"
#include "stream.cuh"

class SideStream {
 public:
  SideStream() = default;  // off: the main stream itself
  SideStream(const SideStream&) = delete;
  SideStream& operator=(const SideStream&) = delete;
  ~SideStream() { set_on(false); }

  static constexpr int LANES = 2;  // side streams, each with a cuBLAS workspace (on)

  // On: LANES streams of its own (created here), each with cuBLAS's workspace of its own; off: the main
  // stream. Call it with nothing held (between passes).
  void set_on(bool on) {
    if (!held_.empty())
      fm_fail("SideStream.set_on", "buffers are still held: join first", "held=%zu", held_.size());
    if (on && lanes_.empty()) {
      for (int i = 0; i < LANES; i++) {
        lanes_.push_back(stream_create("SideStream", StreamPriority::Background));
        cublas_own_workspace(lanes_.back(), true);
      }
    } else if (!on && !lanes_.empty()) {
      for (cudaStream_t lane : lanes_) {
        stream_wait(lane, "SideStream", "before destroying the stream");
        cublas_own_workspace(lane, false);
        cudaCheck(cudaStreamDestroy(lane), "SideStream", "destroy");
      }
      lanes_.clear();
    }
    next_ = 0;
  }
  bool on() const { return !lanes_.empty(); }
  cudaStream_t stream(int lane) const { return lanes_.empty() ? nullptr : lanes_.at(lane); }  // nullptr when off

  // Enqueues enqueue(s) on the next lane (or on main when off), after main's work so far; the pool
  // frees it makes are held until join.
  template <class F>
  void run(cudaStream_t main, const char* op, F&& enqueue) {
    const cudaStream_t s = lanes_.empty() ? main : lanes_[next_];
    next_ = (next_ + 1) % LANES;
    stream_after(s, main, op);
    pool().hold_frees(&held_);
    enqueue(s);
    pool().hold_frees(nullptr);
  }
  // A buffer the side work reads, given back at the join instead of now.
  void hold(void* p) {
    if (p != nullptr) held_.push_back(p);
  }
  // main's next work runs after all side work enqueued so far; the held buffers go back to the pool.
  void join(cudaStream_t main, const char* op) {
    for (cudaStream_t lane : lanes_) stream_after(main, lane, op);
    for (void* p : held_) pool().free(p);
    held_.clear();
    next_ = 0;
  }

 private:
  std::vector<cudaStream_t> lanes_;  // empty when off
  int next_ = 0;                     // the lane of the next run
  std::vector<void*> held_;
};

// side.run(main, op, enqueue), or enqueue(main) when there is no side stream (side == nullptr: an
// operator called outside the model, whose frees then happen at once as always).
template <class F>
inline void side_run(SideStream* side, cudaStream_t main, const char* op, F&& enqueue) {
  if (side) side->run(main, op, enqueue);
  else enqueue(main);
}
// side->hold(p), or pool().free(p) when there is no side stream.
inline void side_hold(SideStream* side, void* p) {
  if (side) side->hold(p);
  else pool().free(p);
}
