// tools/bench_ep_moe.cu — standard expert parallelism (ops/ep_moe.cuh) on W ranks against the
// single-GPU MoE (ops/moe.cuh) in the same run, under the routing profiles of the paper's appendix B.2
// (data/routing_profile.hpp: balanced, hot:r/h) or a recorded routing trace (data/routing_trace.hpp:
// trace:FILE); routing weights 1/k.
//
//   build/bf16/bench_ep_moe --gpus 2 [--tokens 8192 --hidden 2048 --inter 1408 --experts 16 --topk 4
//                            --warmup 5 --iters 20 --seed 1 --profiles balanced,hot:0.25/1,hot:0.5/2,hot:1/4]
//                            [--profiles trace:FILE --trace_batch 0 --trace_layer L]
//
// Per profile, every rank routes its N tokens by the profile (the same on every rank) or by the
// trace (each rank its own recorded tokens: batch --trace_batch, MoE layer --trace_layer, by default
// the first recorded; the trace must have been recorded by W ranks of --tokens tokens, with --experts
// and --topk, else it is refused before the GPU starts), then:
//   EP      ep_moe_forward + ep_moe_backward over the group of all W ranks (E_p = W, E/W experts each)
//   1 GPU   moe_forward + moe_backward of the same N tokens with all E experts, on every rank at once
// Latency: CUDA events around forward + backward, median of `iters` passes after `warmup`, the
// slowest rank's median. Peak: the most loaded rank's peak of Dispatch + ExpertIntermediates live
// bytes over one forward + backward (replayed from the pool's timeline), with the closed form of
// the Dispatch part and the largest R_d (routes received by one rank). Markdown rows from rank 0.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <ctime>
#include <stdexcept>
#include <string>
#include <vector>
#include "../runtime/comm.cuh"
#include "../ops/ep_moe.cuh"
#include "../runtime/launch.cuh"
#include "../ops/moe.cuh"
#include "../ops/router.cuh"
#include "../data/routing_profile.hpp"
#include "../data/routing_trace.hpp"

struct BenchFlags {
  int gpus = 1, tokens = 8192, hidden = 2048, inter = 1408, experts = 16, topk = 4, warmup = 5, iters = 20;
  unsigned long long seed = 1;
  std::vector<std::string> profiles = {"balanced", "hot:0.25/1", "hot:0.5/2", "hot:1/4"};
  int trace_batch = 0;   // the batch of a trace:FILE profile
  int trace_layer = -1;  // its MoE layer (the model's layer index); -1: the first the trace records
};

[[noreturn]] void bench_usage(const std::string& why) {
  fprintf(stderr,
          "bench_ep_moe: %s\n"
          "usage: bench_ep_moe [--gpus W] [--tokens N per rank] [--hidden H] [--inter I] [--experts E] [--topk k]\n"
          "                    [--warmup n] [--iters n] [--seed s] [--profiles balanced,hot:r/h,trace:FILE,...]\n"
          "                    [--trace_batch b] [--trace_layer l]\n",
          why.c_str());
  exit(EXIT_FAILURE);
}

// A decimal integer in [lo, hi] and nothing else.
long long parse_flag_int(const std::string& flag, const char* text, long long lo, long long hi) {
  char* end = nullptr;
  errno = 0;
  long long v = strtoll(text, &end, 10);
  if (text[0] == '\0' || *end != '\0' || errno != 0 || v < lo || v > hi)
    bench_usage(flag + " '" + text + "': expected an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) + "]");
  return v;
}

// The routes [N·k] of `rank` of `world` under profile `name`, and the name of the routing for the table.
struct BenchRoutes {
  std::vector<int> topk_idx;
  std::string label;
};

BenchRoutes bench_routes(const BenchFlags& f, const std::string& name, int world, int rank) {
  const std::string trace_path = data::routing_trace_path(name);
  if (trace_path.empty()) return {routing_profile_indices(parse_routing_profile(name), f.tokens, f.experts, f.topk), name};
  const data::RoutingTrace trace = data::read_routing_trace(trace_path);
  data::RoutingTraceShape run = trace.shape;  // a benchmark has no layers of its own: it takes one of the trace's
  run.world = world;
  run.experts = f.experts;
  run.topk = f.topk;
  run.tokens.assign(world, f.tokens);
  data::check_routing_trace_fits(trace, run);
  const int layer = f.trace_layer < 0 ? trace.shape.layers.front() : f.trace_layer;
  const int slot = data::routing_trace_layer_slot(trace, layer);
  if (f.trace_batch >= trace.batches)
    throw std::invalid_argument("--trace_batch " + std::to_string(f.trace_batch) + ": routing trace " + trace_path +
                                " holds " + std::to_string(trace.batches) + " batches");
  const data::RankRoutes routes = data::rank_routes(trace, rank);
  const int32_t* idx = routes.at(trace.first + f.trace_batch, slot);
  return {std::vector<int>(idx, idx + routes.per_layer),
          name + " (batch " + std::to_string(f.trace_batch) + ", layer " + std::to_string(layer) + ")"};
}

BenchFlags parse_bench_flags(int argc, char** argv) {
  BenchFlags f;
  for (int i = 1; i < argc; i++) {
    const std::string flag = argv[i];
    if (flag == "--help") bench_usage("help");
    if (i + 1 >= argc) bench_usage(flag + " needs a value (or is not a flag)");
    const char* value = argv[++i];
    if (flag == "--gpus") f.gpus = (int)parse_flag_int(flag, value, 1, 1024);
    else if (flag == "--tokens") f.tokens = (int)parse_flag_int(flag, value, 1, 1 << 24);
    else if (flag == "--hidden") f.hidden = (int)parse_flag_int(flag, value, 1, 1 << 16);
    else if (flag == "--inter") f.inter = (int)parse_flag_int(flag, value, 1, 1 << 16);
    else if (flag == "--experts") f.experts = (int)parse_flag_int(flag, value, 1, MOE_MAX_E);
    else if (flag == "--topk") f.topk = (int)parse_flag_int(flag, value, 1, 64);
    else if (flag == "--warmup") f.warmup = (int)parse_flag_int(flag, value, 0, 1000);
    else if (flag == "--iters") f.iters = (int)parse_flag_int(flag, value, 1, 10000);
    else if (flag == "--seed") f.seed = (unsigned long long)parse_flag_int(flag, value, 0, LLONG_MAX);
    else if (flag == "--trace_batch") f.trace_batch = (int)parse_flag_int(flag, value, 0, INT_MAX);
    else if (flag == "--trace_layer") f.trace_layer = (int)parse_flag_int(flag, value, 0, INT_MAX);
    else if (flag == "--profiles") {
      f.profiles.clear();
      std::string list = value;
      for (size_t start = 0; start <= list.size();) {
        size_t comma = list.find(',', start);
        if (comma == std::string::npos) comma = list.size();
        f.profiles.push_back(list.substr(start, comma - start));
        start = comma + 1;
      }
    } else bench_usage("unknown flag " + flag);
  }
  if ((long long)f.tokens * f.topk * f.gpus > INT_MAX) bench_usage("--tokens x --topk x --gpus exceeds int route indices");
  // every profile and trace, before any GPU work, at the world the launcher starts (else launch() names the problem)
  LaunchEnv started;
  const bool world_known = parse_launch_env([](const char* name) -> const char* { return getenv(name); }, f.gpus, &started).empty();
  for (const std::string& name : f.profiles) {
    try {
      if (world_known || data::routing_trace_path(name).empty()) bench_routes(f, name, started.world, 0);
    } catch (const std::exception& e) {
      bench_usage(e.what());
    }
  }
  return f;
}

// p[i] = scale · u, u uniform in [−1, 1) from a hash of (seed, i) (splitmix64): inputs without a host round trip.
static __global__ void fill_uniform_kernel(floatX* p, size_t n, float scale, unsigned long long seed) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  unsigned long long z = seed + (i + 1) * 0x9E3779B97F4A7C15ULL;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  z ^= z >> 31;
  float u = (float)(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
  p[i] = from_float<floatX>(scale * u);
}

DeviceBuffer<floatX> random_buffer(size_t n, float scale, unsigned long long seed, Mem cat, const char* tag,
                                   cudaStream_t stream) {
  DeviceBuffer<floatX> buf(n, cat, tag);
  fill_uniform_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(buf.ptr, n, scale, seed);
  launchCheck("bench_ep_moe.fill_uniform", "n=%zu tag=%s", n, tag);
  return buf;
}

// Median of the CUDA-event time of `pass` over `iters` runs after `warmup` runs, in ms.
template <typename F>
double median_ms(F pass, int warmup, int iters, cudaStream_t stream) {
  cudaEvent_t start, stop;
  cudaCheck(cudaEventCreate(&start), "bench_ep_moe", "event");
  cudaCheck(cudaEventCreate(&stop), "bench_ep_moe", "event");
  std::vector<float> times;
  for (int it = 0; it < warmup + iters; it++) {
    cudaCheck(cudaEventRecord(start, stream), "bench_ep_moe", "event record, pass %d", it);
    pass();
    cudaCheck(cudaEventRecord(stop, stream), "bench_ep_moe", "event record, pass %d", it);
    stream_wait(stream, "bench_ep_moe", "pass %d", it);
    float ms = 0;
    cudaCheck(cudaEventElapsedTime(&ms, start, stop), "bench_ep_moe", "elapsed, pass %d", it);
    if (it >= warmup) times.push_back(ms);
  }
  cudaCheck(cudaEventDestroy(start), "bench_ep_moe", "event");
  cudaCheck(cudaEventDestroy(stop), "bench_ep_moe", "event");
  std::sort(times.begin(), times.end());
  const size_t m = times.size() / 2;
  return times.size() % 2 ? times[m] : 0.5 * (times[m - 1] + times[m]);
}

// Peak of Dispatch + ExpertIntermediates live bytes that one run of `pass` adds, replayed from the
// pool's timeline (the pool keeps per-category peaks only, not the peak of their sum).
template <typename F>
size_t peak_dispatch_and_intermediates(F pass, cudaStream_t stream) {
  const long long base = (long long)(pool().live(Mem::Dispatch) + pool().live(Mem::ExpertIntermediates));
  pool().clear_timeline();
  pool().set_timeline(true);
  pass();
  stream_wait(stream, "bench_ep_moe", "peak pass");
  pool().set_timeline(false);
  long long live = base, peak = base;
  for (const PoolEvent& e : pool().events()) {
    if (e.cat != Mem::Dispatch && e.cat != Mem::ExpertIntermediates) continue;
    if (e.action == 'a') live += (long long)e.bytes;
    if (e.action == 'f') live -= (long long)e.bytes;
    peak = std::max(peak, live);
  }
  pool().clear_timeline();
  return (size_t)(peak - base);
}

// Every rank's `values` (the same count on each), rank-major: [rank·count + i].
std::vector<long long> gather_all(const Comm& world, const std::vector<long long>& values, cudaStream_t stream) {
  std::vector<long long> send;
  for (int d = 0; d < world.size; d++) send.insert(send.end(), values.begin(), values.end());
  return all_to_all_host(world, send, (int)values.size(), stream);
}

int main(int argc, char** argv) {
  const BenchFlags f = parse_bench_flags(argc, argv);
  LaunchInfo info = launch(argc, argv, f.gpus);
  Comm world = comm_world_init(info);
  const int W = world.size, N = f.tokens, H = f.hidden, I = f.inter, E = f.experts, k = f.topk;
  if (E % W != 0) {
    if (world.rank == 0) fprintf(stderr, "bench_ep_moe: --experts %d is not a multiple of the %d ranks\n", E, W);
    exit(EXIT_FAILURE);
  }
  const int E_l = E / W;
  const size_t w13_stride = (size_t)2 * I * H, w2_stride = (size_t)H * I;
  cudaStream_t stream = stream_create("bench_ep_moe");

  // every rank holds all E experts (the 1-GPU baseline needs them); EP uses its slice [rank·E_l, +E_l)
  const unsigned long long seed = f.seed * 1000003ULL + (unsigned long long)world.rank;
  DeviceBuffer<floatX> x = random_buffer((size_t)N * H, 1.f, seed + 1, Mem::Activations, "bench.x", stream);
  DeviceBuffer<floatX> dout = random_buffer((size_t)N * H, 1.f, seed + 2, Mem::Activations, "bench.dout", stream);
  DeviceBuffer<floatX> W13 = random_buffer(E * w13_stride, 1.f / sqrtf((float)H), f.seed + 3, Mem::Weights, "bench.W13", stream);
  DeviceBuffer<floatX> W2 = random_buffer(E * w2_stride, 1.f / sqrtf((float)I), f.seed + 4, Mem::Weights, "bench.W2", stream);
  DeviceBuffer<floatX> dW13(E * w13_stride, Mem::Grads, "bench.dW13"), dW2(E * w2_stride, Mem::Grads, "bench.dW2");
  cudaCheck(cudaMemsetAsync(dW13.ptr, 0, dW13.bytes(), stream), "bench_ep_moe", "dW13 elements=%zu", dW13.count);
  cudaCheck(cudaMemsetAsync(dW2.ptr, 0, dW2.bytes(), stream), "bench_ep_moe", "dW2 elements=%zu", dW2.count);
  DeviceBuffer<floatX> out((size_t)N * H, Mem::Activations, "bench.out");
  DeviceBuffer<floatX> dx((size_t)N * H, Mem::Activations, "bench.dx");
  DeviceBuffer<float> dtopk_w((size_t)N * k, Mem::Activations, "bench.dtopk_w");
  DeviceBuffer<float> topk_w((size_t)N * k, Mem::Activations, "bench.topk_w");
  DeviceBuffer<int> topk_idx((size_t)N * k, Mem::Activations, "bench.topk_idx");
  const std::vector<float> weights((size_t)N * k, 1.f / k);  // the paper's routing weights 1/k
  copy_to_device(topk_w.ptr, weights.data(), topk_w.bytes(), stream, "bench_ep_moe.topk_w");
  const floatX* W13_local = W13.ptr + (size_t)world.rank * E_l * w13_stride;
  const floatX* W2_local = W2.ptr + (size_t)world.rank * E_l * w2_stride;
  floatX* dW13_local = dW13.ptr + (size_t)world.rank * E_l * w13_stride;
  floatX* dW2_local = dW2.ptr + (size_t)world.rank * E_l * w2_stride;

  if (world.rank == 0) {
    cudaDeviceProp prop;
    const int device = rank_device(info);
    cudaCheck(cudaGetDeviceProperties(&prop, device), "bench_ep_moe", "device %d", device);
    char date[32];
    time_t now = time(nullptr);
    strftime(date, sizeof(date), "%Y-%m-%d", localtime(&now));
    printf("standard EP MoE vs 1 GPU, %s, %d x %s, %s: N=%d tokens/rank, H=%d, I=%d, E=%d (E_l=%d), k=%d, "
           "fwd+bwd median of %d after %d warm-ups\n\n",
           date, W, prop.name, FLATMOE_PRECISION_NAME, N, H, I, E, E_l, k, f.iters, f.warmup);
    printf("| profile | W | max R_d | EP ms | 1-GPU ms | EP/1-GPU time | EP peak D+EI MiB | 1-GPU peak D+EI MiB | "
           "EP/1-GPU peak | EP Dispatch closed form MiB |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);
  }

  for (const std::string& name : f.profiles) {
    const BenchRoutes routes = bench_routes(f, name, W, world.rank);
    copy_to_device(topk_idx.ptr, routes.topk_idx.data(), topk_idx.bytes(), stream, "bench_ep_moe.topk_idx");

    long long received = 0;
    auto ep_pass = [&] {
      EPSaved saved;
      ep_moe_forward(out.ptr, saved, x.ptr, topk_idx.ptr, topk_w.ptr, W13_local, W2_local, N, H, I, E, k, world, stream);
      ep_moe_backward(dx.ptr, dtopk_w.ptr, dW13_local, dW2_local, dout.ptr, saved, topk_w.ptr, W13_local, W2_local, world,
                      stream);
      received = saved.plan.received;
      ep_saved_free(saved);
    };
    auto single_pass = [&] {
      MoESaved saved;
      moe_forward(out.ptr, saved, x.ptr, topk_idx.ptr, topk_w.ptr, W13.ptr, W2.ptr, N, H, I, E, k, stream);
      moe_backward(dx.ptr, dtopk_w.ptr, dW13.ptr, dW2.ptr, dout.ptr, saved, x.ptr, topk_idx.ptr, topk_w.ptr, W13.ptr,
                   W2.ptr, stream);
      moe_saved_free(saved);
    };
    const double ep_ms = median_ms(ep_pass, f.warmup, f.iters, stream);
    const size_t ep_peak = peak_dispatch_and_intermediates(ep_pass, stream);
    comm_sync(world, stream, "bench_ep_moe");
    const double single_ms = median_ms(single_pass, f.warmup, f.iters, stream);
    const size_t single_peak = peak_dispatch_and_intermediates(single_pass, stream);

    std::vector<long long> all = gather_all(
        world, {(long long)(ep_ms * 1e3), (long long)ep_peak, received, (long long)(single_ms * 1e3), (long long)single_peak},
        stream);
    long long max_ep_us = 0, max_ep_peak = 0, max_received = 0, max_single_us = 0, max_single_peak = 0;
    for (int r = 0; r < W; r++) {
      max_ep_us = std::max(max_ep_us, all[r * 5 + 0]);
      max_ep_peak = std::max(max_ep_peak, all[r * 5 + 1]);
      max_received = std::max(max_received, all[r * 5 + 2]);
      max_single_us = std::max(max_single_us, all[r * 5 + 3]);
      max_single_peak = std::max(max_single_peak, all[r * 5 + 4]);
    }
    if (world.rank == 0) {
      const double MiB = 1048576.0;
      const size_t closed_form = ep_moe_dispatch_peak_bytes((long long)N * k, max_received, H, sizeof(floatX));
      printf("| %s | %d | %lld | %.3f | %.3f | %.2f | %.1f | %.1f | %.2f | %.1f |\n", routes.label.c_str(), W, max_received,
             max_ep_us / 1e3, max_single_us / 1e3, (double)max_ep_us / max_single_us, max_ep_peak / MiB,
             max_single_peak / MiB, (double)max_ep_peak / max_single_peak, closed_form / MiB);
      fflush(stdout);
    }
  }
  stream_wait(stream, "bench_ep_moe", "end");
  cudaCheck(cudaStreamDestroy(stream), "bench_ep_moe", "stream");
  comm_destroy(world);
  return 0;
}
