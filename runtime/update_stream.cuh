// update_stream.cuh — the optimizer beside the next forward (--overlap_update 1; notes/speed.md, 'The update
// beside the next forward').
//
// A step's update is memory-bound (AdamW: 28 bytes per parameter) and the next step's forward mostly
// compute-bound, and layer l's forward needs only the weights of its own group (ParamSpec.forward_group:
// the embedding with layer 0, each layer, the final norm with the head). So on one rank the update runs
// on a stream of its own, group by group in the forward's order, an event after each (finish_through, which
// the optimizer calls as each group's last launch is queued); the next pass waits for group g just before
// it reads it (wait) and everything else that reads the weights, the moments or the pass's gradients waits
// for all of them (join). The same launches with the same arguments: the weights are bit-identical to the
// update on the compute stream. model.cuh's model_update decides when (update_beside_next_forward).
#pragma once
#include <algorithm>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "../ops/common.cuh"
#include "check.cuh"
#include "stream.cuh"

struct UpdateStream {
  cudaStream_t stream = nullptr;  // created on the first overlapped update
  std::vector<StreamPoint> done;  // [G]: group g's weights written (and its pass grads zeroed)
  // [G]: the pass's gradient ranges of each group (merged segments), zeroed after its update
  std::vector<std::vector<std::pair<size_t, size_t>>> grad_ranges;
  int next_wait = 0;  // groups [0, next_wait) the compute stream waits for already
  int groups = 0;     // G = L + 1 (0: no update queued yet)
  int finished = 0;   // groups [0, finished) of this update have their stream point recorded

  // The compute stream waits for group g (and every group before it), once per update.
  void wait(cudaStream_t compute, int g) {
    for (; next_wait < groups && next_wait <= g; next_wait++) done[next_wait].wait_on(compute, "update_stream.wait");
  }
  void join(cudaStream_t compute) { wait(compute, groups - 1); }

  // Ready for an update of G groups: created with its events on the first call, with the pass's gradient
  // ranges of each group from the optimizer's segments, which together must be every gradient (one rank's
  // shard is the whole buffer of num_params); it waits for the compute stream's work so far (the norm, the
  // clip factor). Returns the stream to queue the update on.
  cudaStream_t begin(const std::vector<ShardSegment>& segments, size_t num_params, int G, cudaStream_t compute) {
    if (!stream) {
      // a blocking stream (work on the legacy default stream, a test's model or a cudaMemcpy, waits for
      // it) of the background priority (runtime/stream.cuh: the trainer's forward takes the SMs first)
      const int priority = stream_priority(StreamPriority::Background, "update_stream");
      cudaCheck(cudaStreamCreateWithPriority(&stream, cudaStreamDefault, priority), "update_stream", "G=%d", G);
      done = std::vector<StreamPoint>(G);
      grad_ranges.assign(G, {});
      std::vector<ShardSegment> segs = segments;
      std::sort(segs.begin(), segs.end(), [](const ShardSegment& a, const ShardSegment& b) { return a.param_offset < b.param_offset; });
      size_t covered = 0;
      for (const ShardSegment& g : segs) {
        auto& ranges = grad_ranges.at(g.group);
        if (!ranges.empty() && ranges.back().first + ranges.back().second == g.param_offset) ranges.back().second += g.count;
        else if (g.count > 0) ranges.emplace_back(g.param_offset, g.count);
        covered += g.count;
      }
      if (covered != num_params)
        fm_fail("update_stream", "the optimizer's segments must cover every gradient", "covered=%zu P=%zu", covered, num_params);
    }
    groups = G;
    next_wait = 0;
    finished = 0;
    stream_after(stream, compute, "update_stream");
    return stream;
  }

  // Groups up to g are queued: each one's pass gradients in pass_grads zeroed (the fold's other half, where
  // the update read them unfolded; nullptr: none), then its stream point recorded.
  void finish_through(int g, floatX* pass_grads) {
    for (; finished <= g; finished++) {
      if (pass_grads != nullptr)
        for (auto [offset, count] : grad_ranges[finished])
          cudaCheck(cudaMemsetAsync(pass_grads + offset, 0, count * sizeof(floatX), stream), "update_stream",
                    "group=%d count=%zu", finished, count);
      done[finished].record(stream, "update_stream");
    }
  }

  void destroy() {
    if (stream) cudaCheck(cudaStreamDestroy(stream), "update_stream", "destroy");
    stream = nullptr;
  }
};
