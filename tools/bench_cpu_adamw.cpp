// tools/bench_cpu_adamw.cpp — the CPU AdamW loop of --optimizer cpu_adamw (ops/cpu_adamw.cpp) alone,
// on host memory, no GPU: the plain scalar loop on one thread (the baseline), the vectorised loop on
// one thread, and the vectorised loop on 1, 2, 4, ... up to every hardware thread. Gparam/s = parameters
// updated per second (each reads θ, m, v, g and writes θ, m, v and the bf16 weight: 30 bytes).
//
//   build/bench_cpu_adamw [--mparams 64] [--iters 5]
//
// Median wall time of --iters steps after one warm-up step; markdown rows. The state (one tensor,
// weight decay on) is larger than the last-level cache at the default size, as a model's is.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>
#include "../ops/cpu_adamw.hpp"

namespace {

[[noreturn]] void usage(const std::string& why) {
  fprintf(stderr, "bench_cpu_adamw: %s\nusage: bench_cpu_adamw [--mparams M (millions of parameters)] [--iters n]\n",
          why.c_str());
  exit(EXIT_FAILURE);
}

int parse_int(const std::string& flag, const char* text, int lo, int hi) {
  char* end = nullptr;
  const long v = strtol(text, &end, 10);
  if (text[0] == '\0' || *end != '\0' || v < lo || v > hi)
    usage(flag + " '" + text + "': expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return (int)v;
}

template <typename Step>
double median_ms(Step step, int iters) {
  std::vector<double> times;
  for (int it = 0; it <= iters; it++) {
    const auto start = std::chrono::steady_clock::now();
    step(it + 1);
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    if (it > 0) times.push_back(ms);  // the first is the warm-up
  }
  std::sort(times.begin(), times.end());
  const size_t m = times.size() / 2;
  return times.size() % 2 ? times[m] : 0.5 * (times[m - 1] + times[m]);
}

}  // namespace

int main(int argc, char** argv) {
  int mparams = 64, iters = 5;
  for (int i = 1; i < argc; i++) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) usage(flag + " needs a value (or is not a flag)");
    const char* value = argv[++i];
    if (flag == "--mparams") mparams = parse_int(flag, value, 1, 1 << 16);
    else if (flag == "--iters") iters = parse_int(flag, value, 1, 1000);
    else usage("unknown flag " + flag);
  }
  const size_t P = (size_t)mparams * 1000000;
  const unsigned hw = std::max(1u, std::thread::hardware_concurrency());
  std::vector<float> master(P, 0.5f), m(P, 0.01f), v(P, 1e-4f), grad(P, 0.0115f);
  std::vector<uint16_t> param(P);
  const std::vector<ShardSegment> segments = {ShardSegment{0, 0, P, true}};
  const AdamWSettings settings{0.9f, 0.95f, 1e-8f, 0.1f};
  printf("CPU AdamW loop (ops/cpu_adamw.cpp), %zu M parameters, fp32 state + bf16 weights, %u hardware threads, "
         "median of %d steps after 1 warm-up\n\n", P / 1000000, hw, iters);
  printf("| loop | threads | ms/step | Gparam/s | GB/s (30 B/param) | x scalar |\n|---|---|---|---|---|---|\n");
  auto row = [&](const char* loop, unsigned threads, double ms, double scalar_ms) {
    const double gps = P / (ms / 1e3) / 1e9;
    printf("| %s | %u | %.1f | %.3f | %.1f | %.2f |\n", loop, threads, ms, gps, gps * 30, scalar_ms / ms);
    fflush(stdout);
  };
  const double scalar_ms = median_ms([&](int t) {
    cpu_adamw_step_scalar(master.data(), m.data(), v.data(), grad.data(), param.data(), segments, 1e-4f, settings, t, 1.f);
  }, iters);
  row("scalar (not vectorised)", 1, scalar_ms, scalar_ms);
  std::vector<unsigned> counts;
  for (unsigned n = 1; n < hw; n *= 2) counts.push_back(n);
  counts.push_back(hw);
  for (unsigned n : counts) {
    const double ms = median_ms([&](int t) {
      cpu_adamw_step(master.data(), m.data(), v.data(), grad.data(), param.data(), segments, 1e-4f, settings, t, 1.f, (int)n);
    }, iters);
    row("vectorised", n, ms, scalar_ms);
  }
  return EXIT_SUCCESS;
}
