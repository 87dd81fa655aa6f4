// stream.cuh — streams, the order between them, and host waits that cannot hang (notes/design.md §5).
//
// One process drives one GPU with several streams: the model's compute stream (created by the
// trainer; stream 0 in single-stream tests) and one stream per NCCL communicator (runtime/comm.cuh),
// so that an exchange can run while the compute stream multiplies. The rules that keep them from
// racing and every rank from hanging:
//   * Order between streams only through events on the GPU: stream_after(waiter, producer) makes the
//     work enqueued on `waiter` from now on wait for everything enqueued on `producer` so far. The
//     host never synchronises to order two streams.
//   * Memory crosses streams through the pool's two frees (runtime/pool.cuh): free() when every user
//     ran on, or was joined into, the stream that allocates next; free_after(p, stream) when the last
//     user is work still queued on another stream. A side stream forked from and joined into the
//     compute stream (runtime/side_stream.cuh) holds the frees of what its work reads until the join.
//   * Every host wait is stream_wait, host_wait (a stream point) or copy_to_host / copy_to_device
//     (which wait before and after their copy: CUDA may synchronise with the stream inside a copy from
//     or to pageable memory): it
//     gives up after FLATMOE_COMM_TIMEOUT_S (runtime/check.cuh) and, while it waits, asks the wait
//     watcher (runtime/comm.cuh installs one that polls every live NCCL communicator's asynchronous
//     error). A timeout, a CUDA error on the stream or an NCCL error ends the process through fm_fail,
//     whose failure hook aborts every communicator first, so that the other ranks stop too.
//   * No synchronous copy (cudaMemcpy, or cudaMemcpyAsync from or to pageable memory while the
//     stream is busy; from pinned memory it is queued: runtime/pinned.cuh's PinnedUpload) and no
//     legacy-default-stream work while communicators overlap: either can wait
//     without a bound, or serialise streams that were meant to overlap.
#pragma once
#include <algorithm>
#include <atomic>
#include <chrono>
#include <mutex>
#include <string>
#include <thread>
#include "check.cuh"

// Why the ranks cannot go on ("" while they can): asked in every wait. runtime/comm.cuh installs one
// that polls the asynchronous error of every live communicator; nullptr: nothing to watch.
inline std::string (*&wait_watcher())() {
  static std::string (*watcher)() = nullptr;
  return watcher;
}

// Stream priorities, lowest first. Background: the least (copies, a side stream's bulk work such as
// the optimizer beside the next forward, model.cuh). Compute: one above it, for the trainer's compute
// stream, so that the block scheduler gives a forward's kernels the SMs before a background kernel's
// next blocks. Comm: the greatest, for a communicator's stream — its kernels are small and
// latency-bound, and a block scheduler that picks them before the next wave of a GEMM's blocks keeps
// an exchange from waiting out a whole GEMM it was meant to overlap.
enum class StreamPriority { Background, Compute, Comm };

inline int stream_priority(StreamPriority p, const char* op) {
  int least = 0, greatest = 0;
  cudaCheck(cudaDeviceGetStreamPriorityRange(&least, &greatest), op, "cudaDeviceGetStreamPriorityRange");
  if (p == StreamPriority::Comm) return greatest;
  if (p == StreamPriority::Compute) return std::max(greatest, least - 1);  // numerically lower = higher priority
  return least;
}

// A stream that never synchronises with the legacy default stream (cudaStreamNonBlocking).
inline cudaStream_t stream_create(const char* op, StreamPriority priority = StreamPriority::Background) {
  cudaStream_t s = nullptr;
  const int value = stream_priority(priority, op);
  cudaCheck(cudaStreamCreateWithPriority(&s, cudaStreamNonBlocking, value), op,
            "cudaStreamCreateWithPriority(non-blocking, priority %d)", value);
  return s;
}

// The event stream_after records into. One suffices: cudaStreamWaitEvent waits for the event's state
// at the time of the call, and later records do not change that wait.
inline cudaEvent_t& stream_order_event() {
  static cudaEvent_t event = nullptr;
  return event;
}

// Work enqueued on `waiter` from now on runs after the work enqueued on `producer` so far.
inline void stream_after(cudaStream_t waiter, cudaStream_t producer, const char* op) {
  if (waiter == producer) return;
  cudaEvent_t& event = stream_order_event();
  if (event == nullptr) cudaCheck(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), op, "stream_after: event");
  cudaCheck(cudaEventRecord(event, producer), op, "stream_after: record on the producer stream");
  cudaCheck(cudaStreamWaitEvent(waiter, event, 0), op, "stream_after: wait on the waiter stream");
}

// Whether `stream` is being captured into a graph (runtime/graph.cuh).
inline bool stream_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaCheck(cudaStreamIsCapturing(stream, &capture), "stream_capturing", "stream=%p", (void*)stream);
  return capture == cudaStreamCaptureStatusActive;
}

// One point of a stream's work, waited for later by another stream: where stream_after orders the
// waiter after everything the producer has so far, a schedule that keeps several exchanges in flight
// marks each (record after enqueuing it) and waits for one of them (wait_on) when its consumer comes.
struct StreamPoint {
  cudaEvent_t event = nullptr;
  bool recorded_in_capture = false;  // the last record() was on a stream being captured
  StreamPoint() = default;
  StreamPoint(const StreamPoint&) = delete;
  StreamPoint& operator=(const StreamPoint&) = delete;
  ~StreamPoint() {
    if (event != nullptr) cudaEventDestroy(event);
  }
  void record(cudaStream_t producer, const char* op) {
    if (event == nullptr) cudaCheck(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), op, "StreamPoint: event");
    cudaCheck(cudaEventRecord(event, producer), op, "StreamPoint: record");
    recorded_in_capture = stream_capturing(producer);
  }
  // Work enqueued on `waiter` from now on runs after the recorded point. On a stream being captured
  // (runtime/graph.cuh), two cases:
  //   * the point was recorded outside the capture (another stream's work, e.g. the update's): the
  //     wait becomes a node of the graph (cudaEventWaitExternal), and each time the graph runs it
  //     waits for the point as last recorded before the launch;
  //   * the point was recorded inside the same capture: a plain wait, which makes the captured work
  //     that follows depend on the captured work before the record. An external wait would order
  //     nothing here — the record inside a capture is no node, so the graph would wait for an
  //     earlier, finished record (notes/speed.md, 'CUDA graphs': two runs, two losses).
  void wait_on(cudaStream_t waiter, const char* op) const {
    if (event == nullptr) fm_fail(op, "waiting for a stream point that was never recorded", "waiter=%p", (void*)waiter);
    const bool external = stream_capturing(waiter) && !recorded_in_capture;
    cudaCheck(cudaStreamWaitEvent(waiter, event, external ? cudaEventWaitExternal : cudaEventWaitDefault), op,
              "StreamPoint: wait");
  }
};

// Gives the stream-order event back to CUDA (runtime_release; it is made again when needed).
inline void stream_order_release() {
  cudaEvent_t& event = stream_order_event();
  if (event != nullptr) cudaCheck(cudaEventDestroy(event), "stream_order_release", "cudaEventDestroy");
  event = nullptr;
}

// A wait whose own polling blocks (a CUDA or NCCL query stuck behind a peer that is gone) cannot time
// itself out. The wait watchdog — a thread started by the first wait — ends the process, through
// fm_exit_failure, when the wait in progress has not returned WAIT_WATCHDOG_GRACE_S after its timeout.
constexpr double WAIT_WATCHDOG_GRACE_S = 5;

struct WaitWatchdog {
  std::atomic<long long> overdue_at_ns{0};  // steady clock; 0: no wait in progress
  std::atomic<const char*> what{""};        // a string literal naming the wait
};

inline long long steady_now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline WaitWatchdog& wait_watchdog() {
  static WaitWatchdog watchdog;
  static std::once_flag started;
  std::call_once(started, [] {
    std::thread([] {
      for (;;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
        const long long overdue_at = watchdog.overdue_at_ns.load();
        if (overdue_at == 0 || steady_now_ns() < overdue_at) continue;
        fprintf(stderr,
                "flatmoe: rank %d: %s did not return within %.0f s of its timeout (FLATMOE_COMM_TIMEOUT_S): a query "
                "it polls is stuck behind a rank that is gone\n",
                comm_process_rank(), watchdog.what.load(), WAIT_WATCHDOG_GRACE_S);
        fm_exit_failure();
      }
    }).detach();
  });
  return watchdog;
}

// Brackets one bounded wait (not nested) for the watchdog.
struct WatchedWait {
  explicit WatchedWait(const char* what) {
    WaitWatchdog& w = wait_watchdog();
    w.what = what;
    w.overdue_at_ns = steady_now_ns() + (long long)((comm_timeout_s() + WAIT_WATCHDOG_GRACE_S) * 1e9);
  }
  ~WatchedWait() { wait_watchdog().overdue_at_ns = 0; }
  WatchedWait(const WatchedWait&) = delete;
  WatchedWait& operator=(const WatchedWait&) = delete;
};

// How many times this process's host has waited for the GPU (wait_why, which every wait here goes
// through: stream_wait, copy_to_host, copy_to_device, host_wait). While the host waits nothing new is
// queued, so the GPU runs dry; --profile_step prints a step's count, and GpuModel.* counts a pass's.
inline std::atomic<long long>& host_waits() {
  static std::atomic<long long> count{0};
  return count;
}

// Polls query() (a cudaStreamQuery or cudaEventQuery) until the work it asks about has finished.
// Returns "" then, or why it gave up: a CUDA error, what the wait watcher reports, or the timeout (both
// asked once per millisecond of waiting). Spins, yielding the CPU between polls, however long the wait:
// a sleep between polls returns tens of µs after the work is done (the kernel's timer slack), and the
// GPU idles until the host wakes and queues more — after every long wait of a step
// (notes/speed.md, 'Host waits').
template <typename Query>
inline std::string wait_why(const char* what, Query query) {
  host_waits()++;
  WatchedWait watched(what);
  const auto start = std::chrono::steady_clock::now();
  double next_check = 0;  // seconds waited when the watcher and the timeout are asked next
  for (;;) {
    cudaError_t q = query();
    if (q == cudaSuccess) return "";
    if (q != cudaErrorNotReady) return std::string("CUDA error on the stream: ") + cudaGetErrorString(q);
    const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited >= next_check) {
      if (wait_watcher() != nullptr) {
        std::string why = wait_watcher()();
        if (!why.empty()) return why;
      }
      if (waited > comm_timeout_s()) {
        char why[256];
        snprintf(why, sizeof why,
                 "timed out: the stream did not finish within %.0f s (FLATMOE_COMM_TIMEOUT_S); a rank stopped, or the "
                 "ranks called collectives in different orders",
                 waited);
        return why;
      }
      next_check = waited + 1e-3;
    }
    std::this_thread::yield();
  }
}

// Polls until `stream` has finished its work (wait_why).
inline std::string stream_wait_why(cudaStream_t stream) {
  return wait_why("a wait for a stream", [stream] { return cudaStreamQuery(stream); });
}

// Waits for `stream` (stream_wait_why); on failure fm_fail names `op` and the sizes (printf format).
__attribute__((format(printf, 3, 4))) inline void stream_wait(cudaStream_t stream, const char* op, const char* fmt, ...) {
  std::string why = stream_wait_why(stream);
  if (why.empty()) return;
  va_list ap;
  va_start(ap, fmt);
  std::string sizes = fm_format(fmt, ap);
  va_end(ap);
  fm_fail(op, why.c_str(), "%s", sizes.c_str());
}

// The host waits until a stream point's work has run (wait_why); a point never recorded has none.
inline void host_wait(const StreamPoint& point, const char* op) {
  if (point.event == nullptr) return;
  const std::string why = wait_why("a wait for a stream point", [&point] { return cudaEventQuery(point.event); });
  if (!why.empty()) fm_fail(op, why.c_str(), "waiting for a stream point");
}

// host [bytes] = device [bytes] after the work queued on `stream`. Waits for the stream first (a copy
// to pageable memory would otherwise wait for it without a bound), then for the copy.
inline void copy_to_host(void* host, const void* device, size_t bytes, cudaStream_t stream, const char* op) {
  if (bytes == 0) return;
  stream_wait(stream, op, "before copying %zu bytes to the host", bytes);
  cudaCheck(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream), op, "copy of %zu bytes to the host",
            bytes);
  stream_wait(stream, op, "copying %zu bytes to the host", bytes);
}

// device [bytes] = host [bytes], in the order of `stream`. Waits for the stream first: CUDA may stage
// a copy from pageable memory after synchronising with the stream, which would otherwise wait without
// a bound behind a collective whose partner is gone. Returns once the data is on the device (the host
// buffer may then go).
inline void copy_to_device(void* device, const void* host, size_t bytes, cudaStream_t stream, const char* op) {
  if (bytes == 0) return;
  stream_wait(stream, op, "before copying %zu bytes to the device", bytes);
  cudaCheck(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream), op,
            "copy of %zu bytes to the device", bytes);
  stream_wait(stream, op, "copying %zu bytes to the device", bytes);
}
