// graph.cuh — a stream's work captured once as a CUDA graph and launched again
// (notes/speed.md, 'CUDA graphs').
//
// Why: a small model's pass is hundreds of short kernels, and the host issues each through the CUDA
// runtime (a few µs apiece, cuBLAS's more), so the GPU waits for the host between them. A graph is
// the same work issued in one launch: the GPU runs its kernels back to back.
//
// What makes a launch the same work as the eager pass it was captured from: the same kernels with the
// same arguments (sizes, pointers, tensor maps), copies from the same pinned host buffers, waits on
// the same events. The caller keys its graphs by everything the host decides per pass (model.cuh's
// PassGraphKey); the pool's blocks are this file's part:
//   * the capture runs the pass's host code once: every pool alloc and free happens then, and the
//     pool remembers the blocks it handed out (Pool::begin_capture/end_capture); the captured work must
//     free all of them before it ends;
//   * a launch is valid only while each of those blocks is a free cached block of the pool (so nothing
//     else holds one): run() asks once per pass, and captures again when it is not (the cache was
//     given back to CUDA, or another pass holds a block);
//   * a launch raises the pool's peaks by the capture's rise (Pool::replay), so the trainer's peak per
//     step is the eager pass's.
// Capture mode: relaxed, so that a pool that must grow may call cudaMalloc while it captures. A host
// wait inside the captured work is an error (the stream cannot be queried while it is captured): the
// caller captures only work that it has seen run without one.
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>
#include "check.cuh"
#include "pool.cuh"
#include "stream.cuh"

struct CapturedWork {
  cudaGraphExec_t exec = nullptr;
  Pool::CapturedUse pool_use;  // the blocks the capture handed out, and how far the live bytes rose
  size_t nodes = 0;            // the graph's kernels, copies, memsets and event waits
  CapturedWork() = default;
  CapturedWork(const CapturedWork&) = delete;
  CapturedWork& operator=(const CapturedWork&) = delete;
  ~CapturedWork() { clear(); }

  void clear() {
    if (exec != nullptr) cudaCheck(cudaGraphExecDestroy(exec), "CapturedWork", "cudaGraphExecDestroy");
    exec = nullptr;
    pool_use = Pool::CapturedUse();
    nodes = 0;
  }

  // Runs enqueue()'s work on `stream`, after what is queued there, as this graph: captured first when
  // there is none yet or its pool blocks are not all free (replayable), then launched. True: captured.
  bool run(cudaStream_t stream, const char* op, const std::function<void()>& enqueue) {
    const bool capture_now = !replayable();
    if (capture_now) capture(stream, op, enqueue);  // end_capture left every block it used free and cached
    pool().replay(pool_use);
    cudaCheck(cudaGraphLaunch(exec, stream), op, "cudaGraphLaunch");
    return capture_now;
  }

 private:
  bool replayable() const { return exec != nullptr && pool().replayable(pool_use); }

  // Captures what enqueue() puts on `stream` (nothing runs yet).
  void capture(cudaStream_t stream, const char* op, const std::function<void()>& enqueue) {
    clear();
    if (stream == nullptr) fm_fail(op, "a graph is captured from a created stream, not the legacy default stream", "stream=0");
    if (stream_capturing(stream)) fm_fail(op, "the stream is being captured already", "stream=%p", (void*)stream);
    pool().begin_capture(op);
    cudaCheck(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed), op, "cudaStreamBeginCapture");
    enqueue();
    cudaGraph_t graph = nullptr;
    cudaCheck(cudaStreamEndCapture(stream, &graph), op, "cudaStreamEndCapture");
    pool_use = pool().end_capture();
    cudaCheck(cudaGraphGetNodes(graph, nullptr, &nodes), op, "cudaGraphGetNodes");
    // each kernel node keeps the priority of the stream it was captured from (a side stream's weight
    // gradients below the critical path's kernels, runtime/side_stream.cuh), as in the eager pass
    cudaCheck(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority), op,
              "cudaGraphInstantiate (%zu nodes)", nodes);
    cudaCheck(cudaGraphDestroy(graph), op, "cudaGraphDestroy");
  }
};

// Passes launched as graphs (model.cuh's model_pass under --cuda_graph): one entry per Key, the value of
// everything the host decides for a pass (==). A key's first pass runs eagerly and counts the host waits
// inside it; a key whose eager pass waited stays eager (eager_why says why), the others are captured at
// their second pass and launched from then on.
template <typename Key>
struct GraphedPasses {
  struct Entry {
    Key key;
    bool ran_eagerly = false;  // the key's first pass ran without the graph
    std::string eager_why;     // not empty: the key's passes stay eager, and why
    CapturedWork work;         // captured at the key's second pass, again whenever its blocks are not all free
  };
  bool on = false;  // --cuda_graph
  std::vector<std::unique_ptr<Entry>> entries;
  long long captures = 0, launches = 0;

  // One pass of key k on `stream`, as a graph where it can be (`allowed`, and on): enqueue(after_forward)
  // queues the pass's work and calls after_forward() on the host once its forward is queued; stage() is the
  // host's staging of the pass's inputs, which an eager pass does at after_forward (its host waits not
  // counted as the pass's) and a launch before it. True: the pass was launched as a graph.
  bool run(const Key& k, bool allowed, cudaStream_t stream, const std::function<void(const std::function<void()>&)>& enqueue,
           const std::function<void()>& stage) {
    Entry* e = on && allowed ? &entry(k) : nullptr;
    if (e == nullptr || !e->eager_why.empty()) {
      enqueue(stage);
      return false;
    }
    if (!e->ran_eagerly) {  // sizes the caller's lazy buffers, and shows whether the pass waits for the host
      long long staging_waits = 0;
      const long long before = host_waits();
      enqueue([&] {
        const long long w = host_waits();
        stage();
        staging_waits = host_waits() - w;
      });
      const long long inside = host_waits() - before - staging_waits;
      e->ran_eagerly = true;
      if (inside > 0) e->eager_why = std::to_string(inside) + " host waits inside the pass";
      return false;
    }
    stage();
    if (e->work.run(stream, "graphed pass", [&] { enqueue(nullptr); })) captures++;
    launches++;
    return true;
  }

 private:
  Entry& entry(const Key& k) {
    for (auto& e : entries)
      if (e->key == k) return *e;
    entries.push_back(std::make_unique<Entry>());
    entries.back()->key = k;
    return *entries.back();
  }
};
