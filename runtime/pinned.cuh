// pinned.cuh — a pass's host inputs and its loss through pinned host memory, so that the copies are queued
// in stream order without a host wait, and a captured pass (runtime/graph.cuh) holds them as its nodes.
// model.cuh's passes use them: PinnedUpload for the tokens, targets and the embedding backward's buckets,
// PinnedLoss for the summed loss.
#pragma once
#include <algorithm>
#include <initializer_list>
#include <utility>

#include "check.cuh"
#include "pool.cuh"
#include "stream.cuh"

// Host ints to the device in stream order without a host wait (a pass's tokens and targets, the
// embedding backward's buckets): stage() writes them into pinned host memory, then enqueue_copy()
// queues one cudaMemcpyAsync into a pool buffer, which CUDA queues without staging or synchronising
// (from pageable memory, copy_to_device must wait for the stream before and after). A caller stages
// the same number of ints every time (the parts, then zeros), so the copy is the same copy each pass:
// a captured pass (runtime/graph.cuh) holds it as a node that reads the pinned memory when it runs.
// The pinned memory is rewritten only after the copy that last read it has run: host_wait on its
// stream point, which returns at once in a training step (a pass ends with its loss's download). It
// only grows: cudaFreeHost synchronises the device, which would also wait for the optimizer beside
// the pass (runtime/update_stream.cuh).
struct PinnedUpload {
  int* host = nullptr;
  size_t capacity = 0;  // ints
  size_t staged = 0;    // ints written by the last stage()
  StreamPoint copied;   // after the last copy that read `host`
  PinnedUpload() = default;
  PinnedUpload(const PinnedUpload&) = delete;
  PinnedUpload& operator=(const PinnedUpload&) = delete;
  ~PinnedUpload() {
    if (host != nullptr) cudaCheck(cudaFreeHost(host), "PinnedUpload", "cudaFreeHost of %zu ints", capacity);
  }
  // Room for `total` ints (the pinned memory where the next stage() writes them).
  void reserve(size_t total, const char* tag) {
    if (total <= capacity) return;
    host_wait(copied, tag);
    if (host != nullptr) cudaCheck(cudaFreeHost(host), tag, "cudaFreeHost of %zu ints", capacity);
    host = nullptr;
    capacity = 0;
    cudaCheck(cudaHostAlloc(&host, total * sizeof(int), cudaHostAllocDefault), tag, "cudaHostAlloc of %zu ints", total);
    capacity = total;
  }
  // The parts one after another, then zeros up to `total` ints.
  void stage(std::initializer_list<std::pair<const int*, size_t>> parts, size_t total, const char* tag) {
    size_t n = 0;
    for (const auto& part : parts) n += part.second;
    if (n > total) fm_fail(tag, "staged parts longer than their total", "parts=%zu total=%zu", n, total);
    if (total > capacity) reserve(total, tag);  // waits for the last copy, then grows
    else host_wait(copied, tag);
    size_t at = 0;
    for (const auto& part : parts) {
      std::copy(part.first, part.first + part.second, host + at);
      at += part.second;
    }
    std::fill(host + at, host + total, 0);
    staged = total;
  }
  // A pool buffer (category cat) holding the staged ints, filled in stream order. While `s` is
  // captured the graph's launch records `copied` (copied_by).
  int* enqueue_copy(Mem cat, const char* tag, cudaStream_t s) {
    int* dev = pool().alloc_t<int>(staged, cat, tag);
    cudaCheck(cudaMemcpyAsync(dev, host, staged * sizeof(int), cudaMemcpyHostToDevice, s), tag, "copy of %zu ints", staged);
    if (!stream_capturing(s)) copied.record(s, tag);
    return dev;
  }
  // The staged ints have been read once the work queued on `s` so far has run.
  void copied_by(cudaStream_t s, const char* tag) { copied.record(s, tag); }
};

// A pass's summed loss, copied at the pass's end into pinned memory (model_pass): a copy that a
// captured pass holds as one of its nodes. Allocated on first use.
struct PinnedLoss {
  float* host = nullptr;
  PinnedLoss() = default;
  PinnedLoss(const PinnedLoss&) = delete;
  PinnedLoss& operator=(const PinnedLoss&) = delete;
  ~PinnedLoss() {
    if (host != nullptr) cudaCheck(cudaFreeHost(host), "PinnedLoss", "cudaFreeHost");
  }
  float* get() {
    if (host == nullptr) cudaCheck(cudaHostAlloc(&host, sizeof(float), cudaHostAllocDefault), "PinnedLoss", "cudaHostAlloc");
    return host;
  }
};
