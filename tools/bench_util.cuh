// tools/bench_util.cuh — what the benchmarks share: flag values, the median of CUDA-event timings,
// and every rank's numbers on every rank.
#pragma once
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <ctime>
#include <stdexcept>
#include <string>
#include <vector>
#include "../ops/common.cuh"
#include "../runtime/comm.cuh"

// "a,b,c" → {"a", "b", "c"}
inline std::vector<std::string> split_list(const std::string& list) {
  std::vector<std::string> items;
  for (size_t start = 0; start <= list.size();) {
    size_t comma = list.find(',', start);
    if (comma == std::string::npos) comma = list.size();
    items.push_back(list.substr(start, comma - start));
    start = comma + 1;
  }
  return items;
}

// "a,b" for flag `flag`, each item one of `allowed`; throws std::invalid_argument naming the flag,
// the item and the allowed words (parse_flag_pairs sends it to the usage).
inline std::vector<std::string> word_list(const std::string& flag, const char* text, const std::vector<std::string>& allowed) {
  std::vector<std::string> items = split_list(text);
  for (const std::string& item : items)
    if (std::find(allowed.begin(), allowed.end(), item) == allowed.end()) {
      std::string words;
      for (const std::string& a : allowed) words += (words.empty() ? "" : ", ") + a;
      throw std::invalid_argument(flag + ": unknown '" + item + "' (" + words + ")");
    }
  return items;
}

// A decimal integer in [lo, hi] and nothing else; throws std::invalid_argument naming the flag.
inline long long parse_flag_int(const std::string& flag, const char* text, long long lo, long long hi) {
  char* end = nullptr;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (text[0] == '\0' || *end != '\0' || errno != 0 || v < lo || v > hi)
    throw std::invalid_argument(flag + " '" + text + "': expected an integer in [" + std::to_string(lo) + ", " +
                                std::to_string(hi) + "]");
  return v;
}

// --share_gpus 0|1 of the benchmarks that start ranks (--gpus W): 1 lets W exceed the GPUs, the ranks
// sharing them (FLATMOE_SHARE_GPUS=1, which launch() reads: runtime/launch.cuh).
inline void parse_share_gpus(const std::string& flag, const char* value) {
  if (parse_flag_int(flag, value, 0, 1) == 1 && setenv("FLATMOE_SHARE_GPUS", "1", 1) != 0)
    throw std::runtime_error("setenv FLATMOE_SHARE_GPUS");
}

// "DATE, W x GPU, PRECISION" (the current device's name, the build's precision): what a benchmark's
// first line states before its own settings. Ranks sharing GPUs (--share_gpus 1) say so there: their
// timings are not GPU timings, and no speed claim takes them.
inline std::string bench_setting(int W, const char* op) {
  int device = 0;
  cudaDeviceProp prop;
  cudaCheck(cudaGetDevice(&device), op, "cudaGetDevice");
  cudaCheck(cudaGetDeviceProperties(&prop, device), op, "device %d", device);
  char date[32];
  const time_t now = time(nullptr);
  strftime(date, sizeof(date), "%Y-%m-%d", localtime(&now));
  const int gpus = gpu_count();
  if (gpu_sharing() && W > gpus)
    return std::string(date) + ", " + std::to_string(W) + " ranks sharing " + std::to_string(gpus) + " x " + prop.name +
           ", " + FLATMOE_PRECISION_NAME + " (SHARED GPUS: collectives through sockets, not GPU timings)";
  return std::string(date) + ", " + std::to_string(W) + " x " + prop.name + ", " + FLATMOE_PRECISION_NAME;
}

// Every "--flag value" pair of argv to on_flag(flag, value); --help, a flag without its value and a
// malformed value (std::invalid_argument from on_flag, e.g. parse_flag_int's) go to usage(why),
// which does not return.
template <typename Usage, typename OnFlag>
void parse_flag_pairs(int argc, char** argv, Usage usage, OnFlag on_flag) {
  try {
    for (int i = 1; i < argc; i++) {
      const std::string flag = argv[i];
      if (flag == "--help") usage("help");
      if (i + 1 >= argc) usage(flag + " needs a value (or is not a flag)");
      on_flag(flag, argv[++i]);
    }
  } catch (const std::invalid_argument& e) {
    usage(e.what());
  }
}

// Median of the CUDA-event time of `pass` over `iters` runs after `warmup` runs, in ms; issue_ms
// (when given): the median host time to enqueue the pass (from its start to its return, before the
// wait) — near the GPU time, the pass is bound by the host's launches, not by the GPU.
template <typename F>
double median_ms(F pass, int warmup, int iters, cudaStream_t stream, const char* op, double* issue_ms = nullptr) {
  cudaEvent_t start, stop;
  cudaCheck(cudaEventCreate(&start), op, "event");
  cudaCheck(cudaEventCreate(&stop), op, "event");
  std::vector<float> times;
  std::vector<double> issue_times;
  for (int it = 0; it < warmup + iters; it++) {
    cudaCheck(cudaEventRecord(start, stream), op, "event record, pass %d", it);
    const auto issue_start = std::chrono::steady_clock::now();
    pass();
    if (it >= warmup)
      issue_times.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - issue_start).count());
    cudaCheck(cudaEventRecord(stop, stream), op, "event record, pass %d", it);
    stream_wait(stream, op, "pass %d", it);
    float ms = 0;
    cudaCheck(cudaEventElapsedTime(&ms, start, stop), op, "elapsed, pass %d", it);
    if (it >= warmup) times.push_back(ms);
  }
  cudaCheck(cudaEventDestroy(start), op, "event");
  cudaCheck(cudaEventDestroy(stop), op, "event");
  if (issue_ms != nullptr) {
    std::sort(issue_times.begin(), issue_times.end());
    *issue_ms = issue_times[issue_times.size() / 2];
  }
  std::sort(times.begin(), times.end());
  const size_t m = times.size() / 2;
  return times.size() % 2 ? times[m] : 0.5 * (times[m - 1] + times[m]);
}

// Every rank's `values` (the same count on each), rank-major: [rank·count + i].
inline std::vector<long long> gather_all(const Comm& world, const std::vector<long long>& values, cudaStream_t stream) {
  std::vector<long long> send;
  for (int d = 0; d < world.size; d++) send.insert(send.end(), values.begin(), values.end());
  return all_to_all_host(world, send, (int)values.size(), stream);
}

// The largest of every rank's value (a collective: every rank calls it at the same point).
inline long long slowest(const Comm& world, long long value, cudaStream_t stream) {
  if (world.size == 1) return value;
  const std::vector<long long> all = gather_all(world, {value}, stream);
  return *std::max_element(all.begin(), all.end());
}

// Random floatX values in [-scale, scale) from a hash of the index and `seed` (a benchmark's inputs,
// with no host copy of a large tensor).
static __global__ void bench_fill_kernel(floatX* p, size_t n, unsigned seed, float scale) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 15;
    h *= 2246822519u;
    h ^= h >> 13;
    p[i] = from_float<floatX>(scale * ((h & 0xffffff) / 8388608.0f - 1.0f));
  }
}

inline void bench_fill(floatX* p, size_t n, unsigned seed, float scale, cudaStream_t s) {
  bench_fill_kernel<<<1024, 256, 0, s>>>(p, n, seed, scale);
  launchCheck("bench_fill", "n=%zu", n);
}
