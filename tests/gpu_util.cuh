// tests/gpu_util.cuh — GPU-side helpers for the tests: skip (or, with FLATMOE_REQUIRE_GPU=1, fail)
// when there is no usable device, the runtime prepared before the first test and released after the
// last, moving reference matrices to and from floatX device buffers (through the pool), and the
// tolerance of notes/design.md §3 for the build.
#pragma once
#include <atomic>
#include <string>
#include "test_util.hpp"
#include "../ops/common.cuh"
#include "../runtime/pool.cuh"

// Per-operator tolerance (notes/design.md §3): 1e-5 in FP32, 2e-2 in BF16; the whole model 1e-4 in FP32.
// Computation in fp32 (the router, float GEMMs) is held to the FP32 per-operator tolerance in both builds.
static const double FP32_TOL = 1e-5;
#if defined(FLATMOE_BF16)
static const double OP_TOL = 2e-2;
static const double MODEL_TOL = 2e-2;
#else
static const double OP_TOL = 1e-5;
static const double MODEL_TOL = 1e-4;
#endif

// The build, for tests whose expectation depends on it: BF16 (else FP32); and the grouped GEMM's
// wgmma form (a BF16 build for GPU_ARCH=90a), else its mma.sync form or cuBLAS.
#if defined(FLATMOE_BF16)
static const bool BUILD_BF16 = true;
#else
static const bool BUILD_BF16 = false;
#endif
#if defined(FLATMOE_BF16) && defined(FLATMOE_WGMMA)
static const bool BUILD_WGMMA = true;
#else
static const bool BUILD_WGMMA = false;
#endif

namespace testutil {

// FLATMOE_REQUIRE_GPU=1 (set by the device scripts, notes/design.md §3): a test that needs a GPU fails
// instead of skipping when none is usable.
inline bool gpu_required() {
  const char* value = getenv("FLATMOE_REQUIRE_GPU");
  return value != nullptr && std::string(value) == "1";
}

// "" when this process can use its current CUDA device, else why not (the CUDA call and its error).
// Asked once; creates the device's context.
inline const std::string& gpu_unusable_reason() {
  static const std::string why = []() -> std::string {
    int devices = 0;
    cudaError_t err = cudaGetDeviceCount(&devices);
    if (err == cudaSuccess && devices == 0) return "cudaGetDeviceCount found 0 devices";
    const char* call = "cudaGetDeviceCount";
    if (err == cudaSuccess) {
      err = cudaFree(nullptr);  // creates the context: a device that is listed but broken fails here
      call = "cudaFree(nullptr) (context creation)";
    }
    if (err == cudaSuccess) return "";
    cudaGetLastError();  // clear the sticky error
    return std::string(call) + ": " + cudaGetErrorString(err);
  }();
  return why;
}

// Prepares the runtime (runtime/pool.cuh) before the first test, so that the shared cuBLAS workspace
// never appears inside a test's pool measurement, and releases it after the last, which fails on
// any device memory that a test left live.
class RuntimeEnvironment : public testing::Environment {
 public:
  void SetUp() override {
    if (gpu_unusable_reason().empty()) runtime_prepare();
  }
  void TearDown() override {
    if (gpu_unusable_reason().empty()) runtime_release();
  }
};

// Registered once per binary, whichever translation units include this file.
inline testing::Environment* const runtime_environment = testing::AddGlobalTestEnvironment(new RuntimeEnvironment);

}  // namespace testutil

#define REQUIRE_GPU()                                                                                   \
  do {                                                                                                  \
    const std::string& fm_unusable_ = testutil::gpu_unusable_reason();                                  \
    if (!fm_unusable_.empty()) {                                                                        \
      if (testutil::gpu_required()) FAIL() << "FLATMOE_REQUIRE_GPU=1 but no usable CUDA device: " << fm_unusable_; \
      GTEST_SKIP() << "no usable CUDA device (" << fm_unusable_ << "): GPU test skipped";              \
    }                                                                                                   \
  } while (0)

namespace testutil {

// Upload a double matrix as T (floatX, float or int) into a new pool buffer.
template <typename T, typename M>
DeviceBuffer<T> upload(const M& m, Mem cat = Mem::Workspace, const char* tag = "test") {
  std::vector<T> host(m.size());
  for (Eigen::Index i = 0; i < m.size(); i++) host[i] = from_float<T>(float(m.data()[i]));
  DeviceBuffer<T> buf(host.size(), cat, tag);
  cudaCheck(cudaMemcpy(buf.ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "test.upload", "n=%zu", host.size());
  return buf;
}

template <typename T>
DeviceBuffer<T> upload_vec(const std::vector<T>& host, Mem cat = Mem::Workspace, const char* tag = "test") {
  DeviceBuffer<T> buf(host.size(), cat, tag);
  cudaCheck(cudaMemcpy(buf.ptr, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice), "test.upload", "n=%zu", host.size());
  return buf;
}

// Download a device buffer of T into a double matrix of the given shape.
template <typename T>
ref::Mat<double> download(const T* dev, int rows, int cols) {
  std::vector<T> host((size_t)rows * cols);
  cudaCheck(cudaDeviceSynchronize(), "test.download", "rows=%d cols=%d", rows, cols);
  cudaCheck(cudaMemcpy(host.data(), dev, host.size() * sizeof(T), cudaMemcpyDeviceToHost), "test.download", "rows=%d cols=%d", rows, cols);
  ref::Mat<double> m(rows, cols);
  for (size_t i = 0; i < host.size(); i++) m.data()[i] = to_float(host[i]);
  return m;
}

template <typename T>
std::vector<T> download_vec(const T* dev, size_t n) {
  std::vector<T> host(n);
  cudaCheck(cudaDeviceSynchronize(), "test.download", "n=%zu", n);
  cudaCheck(cudaMemcpy(host.data(), dev, n * sizeof(T), cudaMemcpyDeviceToHost), "test.download", "n=%zu", n);
  return host;
}

// Round through float: the values a float buffer holds, so that the reference starts from them.
template <typename Derived>
typename Derived::PlainObject round_to_float(const Eigen::MatrixBase<Derived>& m) {
  return m.template cast<float>().template cast<double>();
}

// Round a double matrix through floatX so that the reference sees exactly the values the GPU sees.
inline ref::Mat<double> round_to_floatX(const ref::Mat<double>& m) {
  ref::Mat<double> r(m.rows(), m.cols());
  for (Eigen::Index i = 0; i < m.size(); i++) r.data()[i] = to_float(from_float<floatX>(float(m.data()[i])));
  return r;
}

// Poison: fill a buffer with NaN bytes so that an unwritten output is caught.
template <typename T>
void poison(T* dev, size_t n) {
  cudaCheck(cudaMemset(dev, 0xFF, n * sizeof(T)), "test.poison", "n=%zu", n);
}

// A stream held until the host says so: wait_for_host_kernel waits until *release != 0 (HostFlag.set,
// from the host), then writes `value` into out[0] (when out is not nullptr). It gives up after about
// 20 s of GPU time so that a failing test cannot hang the machine.
static __global__ void wait_for_host_kernel(int* out, const volatile int* release, int value) {
  const long long start = clock64();
  while (*release == 0 && clock64() - start < 20LL * 2000000000LL) __nanosleep(1000);
  if (out) out[0] = value;
}

// A vector of token ids or targets as a column, the form the references take.
inline ref::MatI as_column(const std::vector<int>& v) {
  ref::MatI m((int)v.size(), 1);
  for (size_t i = 0; i < v.size(); i++) m((int)i, 0) = v[i];
  return m;
}

// A stream for one test, destroyed at the end.
struct TestStream {
  cudaStream_t stream = nullptr;
  TestStream() { cudaCheck(cudaStreamCreate(&stream), "test.stream", "create"); }
  ~TestStream() { cudaCheck(cudaStreamDestroy(stream), "test.stream", "destroy"); }
  TestStream(const TestStream&) = delete;
  TestStream& operator=(const TestStream&) = delete;
};

// A host flag the GPU can read while a kernel runs.
struct HostFlag {
  int* host = nullptr;
  int* device = nullptr;
  HostFlag() {
    cudaCheck(cudaHostAlloc(&host, sizeof(int), cudaHostAllocMapped), "test.flag", "cudaHostAlloc");
    *host = 0;
    cudaCheck(cudaHostGetDevicePointer(&device, host, 0), "test.flag", "device pointer");
  }
  ~HostFlag() { cudaFreeHost(host); }
  HostFlag(const HostFlag&) = delete;
  HostFlag& operator=(const HostFlag&) = delete;
  void set() {
    std::atomic_thread_fence(std::memory_order_seq_cst);
    *(volatile int*)host = 1;
  }
};

}  // namespace testutil
