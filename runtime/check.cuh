// check.cuh — error checks that name the operator and its sizes, and device presence. No math:
// every operator and every runtime piece includes it.
#pragma once
#include <atomic>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <unistd.h>
#include <string>
#include <cuda_runtime.h>
#include <cublas_v2.h>
#include <cublasLt.h>

// ---------------------------------------------------------------------------------------------
// Errors: every failure names the operator and its sizes, then exits non-zero.

inline std::string fm_format(const char* fmt, va_list ap) {
  char buf[1024];
  vsnprintf(buf, sizeof(buf), fmt, ap);
  return buf;
}

// What a failing process does before it exits, whatever failed (a CUDA call, a plan, the pool, a
// wait): runtime/comm.cuh installs "abort every live NCCL communicator", so that the other ranks'
// collectives with this one stop at once instead of waiting for a rank that is gone. nullptr: nothing.
inline void (*&failure_hook())() {
  static void (*hook)() = nullptr;
  return hook;
}

// How every failure leaves, once its message is printed: flushes the output, runs the failure hook
// once (a failure inside the hook does not run it again), then ends the process at once with status 1
// (_exit: tearing CUDA down could wait behind a kernel that waits for a rank that is gone).
// Callable from any thread (the wait watchdog of runtime/stream.cuh calls it from its own).
[[noreturn]] inline void fm_exit_failure() {
  static std::atomic<bool> leaving{false};
  fflush(nullptr);
  if (!leaving.exchange(true) && failure_hook() != nullptr) failure_hook()();
  fflush(nullptr);
  _exit(EXIT_FAILURE);
}

// The world rank of this process, named in failure messages (set by comm_world_init; 0 before).
inline int& comm_process_rank() {
  static int rank = 0;
  return rank;
}

[[noreturn]] inline void fm_fail(const char* op, const char* what, const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string sizes = fm_format(fmt, ap);
  va_end(ap);
  fprintf(stderr, "flatmoe error in %s (%s): %s\n", op, sizes.c_str(), what);
  fm_exit_failure();
}

// cudaCheck(call, "operator", "N=%d H=%d", N, H)
#define cudaCheck(call, op, ...)                                                    \
  do {                                                                              \
    cudaError_t fm_err_ = (call);                                                   \
    if (fm_err_ != cudaSuccess) fm_fail(op, cudaGetErrorString(fm_err_), __VA_ARGS__); \
  } while (0)

#define cublasCheck(call, op, ...)                                                  \
  do {                                                                              \
    cublasStatus_t fm_st_ = (call);                                                 \
    if (fm_st_ != CUBLAS_STATUS_SUCCESS)                                            \
      fm_fail(op, cublasGetStatusString(fm_st_), __VA_ARGS__);                      \
  } while (0)

// After every kernel launch: catches bad launch configurations at the launch site.
#define launchCheck(op, ...) cudaCheck(cudaGetLastError(), op, __VA_ARGS__)

// ---------------------------------------------------------------------------------------------
// How long any wait on other ranks may take

// Parses a timeout in seconds: a finite number > 0 and nothing else. Returns false when malformed.
inline bool parse_timeout_s(const char* text, double* seconds) {
  if (text == nullptr || text[0] == '\0') return false;
  char* end = nullptr;
  double v = strtod(text, &end);
  if (*end != '\0' || !(v > 0) || v > 1e9) return false;
  *seconds = v;
  return true;
}

// FLATMOE_COMM_TIMEOUT_S (default 600 s): the longest any communication wait may take.
inline double comm_timeout_s() {
  static const double timeout = [] {
    const char* text = getenv("FLATMOE_COMM_TIMEOUT_S");
    double v = 600;
    if (text != nullptr && !parse_timeout_s(text, &v)) {
      fprintf(stderr, "flatmoe: FLATMOE_COMM_TIMEOUT_S='%s' is not a positive number of seconds\n", text);
      exit(EXIT_FAILURE);
    }
    return v;
  }();
  return timeout;
}

// ---------------------------------------------------------------------------------------------
// Device presence (tests skip GPU cases when this is false).

inline int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no device" error
    return 0;
  }
  return n;
}
