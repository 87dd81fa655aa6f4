// tools/bench_expert_gemm.cu — the six expert GEMMs of one MoE layer (ops/moe.cuh: h13 = xp W13ᵀ,
// y = a W2ᵀ, da = dy W2, dW2 += dyᵀ a, dxp = dh13 W13, dW13 += dh13ᵀ xp) on one GPU, each four ways
// on the same inputs: ops/grouped_gemm.cuh's grouped_gemm with the sizes on the host (what the
// expert-parallel dispatchers run: flatmoe's tensor-core kernel, one launch per GEMM, or cuBLAS — the
// "runs" column), grouped_gemm with routed problems (the sizes read on the device: what one GPU's
// layer runs in the BF16 build, always on the kernel), grouped_gemm_cublas (ONE
// cublasGemmGroupedBatchedEx call, one group per expert) and a loop of one cublasGemmEx per expert.
//
//   build/bf16/bench_expert_gemm [--configs H:I:E:R,...] [--spread s] [--warmup 2] [--iters 10]
//
// --configs: hidden H, expert width I, experts E, routes R = N·k on this GPU (default: the default
// model's 384:384:8:8192 and config B1's 1024:512:32:65536). The routes are split over the experts
// unevenly: expert e's share is proportional to 1 − s + 2s·u_e, u_e uniform in [0, 1) from a fixed seed
// (--spread s, default 0.3: shares within ±30 % of even). Time: CUDA events around one call on a stream,
// median of --iters after --warmup; "host ms": the median host time to issue the call (when it is near
// the GPU time, the call is bound by the host). TFLOP/s = 2·M·N·K summed over the experts / time.
// "rel diff": ‖C − C_loop‖ / ‖C_loop‖ for the first three ways, after one call of each from the same C
// (0: the same bits). Markdown rows.
#include <algorithm>
#include <cmath>
#include <functional>
#include <random>
#include <string>
#include <vector>
#include "../ops/moe.cuh"
#include "bench_util.cuh"

namespace {

struct Config {
  int H, I, E, R;
};

struct BenchFlags {
  int warmup = 2, iters = 10;
  double spread = 0.3;
  std::vector<Config> configs = {{384, 384, 8, 8192}, {1024, 512, 32, 65536}};
};

[[noreturn]] void bench_usage(const std::string& why) {
  fprintf(stderr,
          "bench_expert_gemm: %s\n"
          "usage: bench_expert_gemm [--configs H:I:E:R,... (multiples of 8; R routes)] [--spread s (0 to 1)]\n"
          "                         [--warmup n] [--iters n]\n",
          why.c_str());
  exit(EXIT_FAILURE);
}

Config parse_config(const std::string& item) {
  std::vector<long long> v;
  size_t start = 0;
  while (true) {
    const size_t colon = item.find(':', start);
    v.push_back(parse_flag_int("--configs", item.substr(start, colon - start).c_str(), 1, 1 << 24));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (v.size() != 4) bench_usage("--configs: " + item + " is not H:I:E:R");
  const Config c{(int)v[0], (int)v[1], (int)v[2], (int)v[3]};
  if (c.H % 8 || c.I % 8) bench_usage("--configs: " + item + ": H and I must be multiples of 8 (cuBLAS's bf16 alignment)");
  if (c.R < c.E) bench_usage("--configs: " + item + ": fewer routes than experts");
  return c;
}

BenchFlags parse_bench_flags(int argc, char** argv) {
  BenchFlags f;
  parse_flag_pairs(argc, argv, bench_usage, [&](const std::string& flag, const char* value) {
    if (flag == "--warmup") f.warmup = (int)parse_flag_int(flag, value, 0, 1000);
    else if (flag == "--iters") f.iters = (int)parse_flag_int(flag, value, 1, 1000);
    else if (flag == "--spread") {
      char* end = nullptr;
      f.spread = strtod(value, &end);
      if (end == value || *end != '\0' || !(f.spread >= 0 && f.spread <= 1)) bench_usage("--spread: " + std::string(value) + " is not in [0, 1]");
    } else if (flag == "--configs") {
      f.configs.clear();
      for (const std::string& item : split_list(value)) f.configs.push_back(parse_config(item));
    } else bench_usage("unknown flag " + flag);
  });
  return f;
}

// The routes per expert: shares 1 − s + 2s·u_e (fixed seed), every expert at least one route.
std::vector<int> uneven_counts(int R, int E, double spread) {
  std::mt19937 gen(2026);
  std::uniform_real_distribution<double> u(0, 1);
  std::vector<double> share(E);
  double total = 0;
  for (double& s : share) total += s = 1 - spread + 2 * spread * u(gen);
  std::vector<int> counts(E);
  int given = 0;
  for (int e = 0; e < E; e++) given += counts[e] = std::max(1, (int)(R * share[e] / total));
  counts[E - 1] += R - given;  // the rounding's remainder
  if (counts[E - 1] < 1) bench_usage("--configs: too few routes for the experts' shares");
  return counts;
}

// One cublasGemmEx per problem, with grouped_gemm's conventions (row-major problems, see ops/moe.cuh).
void gemm_per_expert(const std::vector<GroupedGemmProblem>& problems, bool transA, bool transB, int lda, int ldb, int ldc,
                     float beta, cudaStream_t stream) {
  cublasHandle_t handle = cublas_on(stream, "bench_expert_gemm");
  const float alpha = 1.f;
  for (const GroupedGemmProblem& p : problems)
    cublasCheck(cublasGemmEx(handle, transB ? CUBLAS_OP_T : CUBLAS_OP_N, transA ? CUBLAS_OP_T : CUBLAS_OP_N, p.N, p.M, p.K,
                             &alpha, p.B, CUBLAS_FLOATX, ldb, p.A, CUBLAS_FLOATX, lda, &beta, p.C, CUBLAS_FLOATX, ldc,
                             CUBLAS_COMPUTE, CUBLAS_GEMM_DEFAULT),
                "bench_expert_gemm", "M=%d N=%d K=%d", p.M, p.N, p.K);
}

std::vector<float> download(const floatX* p, size_t n, cudaStream_t s) {
  std::vector<floatX> host(n);
  cudaCheck(cudaMemcpyAsync(host.data(), p, n * sizeof(floatX), cudaMemcpyDeviceToHost, s), "bench_expert_gemm", "download");
  stream_wait(s, "bench_expert_gemm", "download");
  std::vector<float> out(n);
  for (size_t i = 0; i < n; i++) out[i] = to_float(host[i]);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  const BenchFlags f = parse_bench_flags(argc, argv);
  cudaStream_t stream = stream_create("bench_expert_gemm");
  printf("expert GEMMs of one MoE layer, %s, median of %d after %d warm-ups, routes spread ±%.0f %% around even\n",
         bench_setting(1, "bench_expert_gemm").c_str(), f.iters, f.warmup, 100 * f.spread);
  for (const Config& c : f.configs) {
    const int H = c.H, I = c.I, E = c.E, R = c.R;
    const std::vector<int> counts = uneven_counts(R, E, f.spread);
    std::vector<int> offsets(E + 1, 0);
    for (int e = 0; e < E; e++) offsets[e + 1] = offsets[e] + counts[e];
    DeviceBuffer<int> device_offsets(E + 1, Mem::Workspace, "bench.offsets");
    cudaCheck(cudaMemcpy(device_offsets.ptr, offsets.data(), (E + 1) * sizeof(int), cudaMemcpyHostToDevice), "bench_expert_gemm",
              "offsets");
    offsets.pop_back();
    const ExpertRows on_host = ExpertRows::on_host(counts, offsets, R);
    const ExpertRows on_device = ExpertRows::on_device(device_offsets.ptr, E, R);
    const auto [lo, hi] = std::minmax_element(counts.begin(), counts.end());
    printf("\n### H %d, I %d, E %d, R %d (routes per expert %d to %d)\n\n", H, I, E, R, *lo, *hi);
    printf("| GEMM | GFLOP | grouped_gemm runs | grouped_gemm ms | TFLOP/s | host ms | routed ms | TFLOP/s | host ms | "
           "cuBLAS grouped ms | TFLOP/s | host ms | per-expert loop ms | TFLOP/s | host ms | rel diff grouped_gemm | "
           "rel diff routed | rel diff cuBLAS grouped |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);
    auto filled = [&](size_t n, unsigned seed, const char* tag) {
      DeviceBuffer<floatX> b(n, Mem::Workspace, tag);
      bench_fill(b.ptr, n, seed, 1.0f, stream);
      return b;
    };
    DeviceBuffer<floatX> xp = filled((size_t)R * H, 1, "bench.xp"), W13 = filled((size_t)E * 2 * I * H, 2, "bench.W13");
    DeviceBuffer<floatX> h13 = filled((size_t)R * 2 * I, 3, "bench.h13"), W2 = filled((size_t)E * H * I, 4, "bench.W2");
    DeviceBuffer<floatX> a = filled((size_t)R * I, 5, "bench.a"), dy = filled((size_t)R * H, 6, "bench.dy");
    DeviceBuffer<floatX> y((size_t)R * H, Mem::Workspace, "bench.y"), da((size_t)R * I, Mem::Workspace, "bench.da");
    DeviceBuffer<floatX> dxp((size_t)R * H, Mem::Workspace, "bench.dxp"), dh13 = filled((size_t)R * 2 * I, 7, "bench.dh13");
    DeviceBuffer<floatX> dW2((size_t)E * H * I, Mem::Workspace, "bench.dW2"), dW13((size_t)E * 2 * I * H, Mem::Workspace, "bench.dW13");
    const size_t w13 = (size_t)2 * I * H, w2 = (size_t)H * I;
    struct Gemm {
      const char* name;
      GroupedGemmProblems problems, routed;
      bool transA, transB;
      int lda, ldb, ldc;
      float beta;
      floatX* C;
      size_t C_count;
    };
    // one GEMM's problems both ways: sizes on the host, and routed (sizes on the device)
    auto both = [&](auto make) { return std::make_pair(expert_problems(on_host, make), expert_problems(on_device, make)); };
    auto gemm = [&](const char* name, auto problems, bool transA, bool transB, int lda, int ldb, int ldc, float beta,
                    floatX* C, size_t C_count) {
      return Gemm{name, problems.first, problems.second, transA, transB, lda, ldb, ldc, beta, C, C_count};
    };
    const std::vector<Gemm> gemms = {
        gemm("h13 = xp W13ᵀ", both([&](int e, size_t r0, int rows) { return GroupedGemmProblem{xp.ptr + r0 * H, W13.ptr + e * w13, h13.ptr + r0 * 2 * I, rows, 2 * I, H}; }),
             false, true, H, H, 2 * I, 0.f, h13.ptr, h13.count),
        gemm("y = a W2ᵀ", both([&](int e, size_t r0, int rows) { return GroupedGemmProblem{a.ptr + r0 * I, W2.ptr + e * w2, y.ptr + r0 * H, rows, H, I}; }),
             false, true, I, I, H, 0.f, y.ptr, y.count),
        gemm("da = dy W2", both([&](int e, size_t r0, int rows) { return GroupedGemmProblem{dy.ptr + r0 * H, W2.ptr + e * w2, da.ptr + r0 * I, rows, I, H}; }),
             false, false, H, I, I, 0.f, da.ptr, da.count),
        gemm("dW2 += dyᵀ a", both([&](int e, size_t r0, int rows) { return GroupedGemmProblem{dy.ptr + r0 * H, a.ptr + r0 * I, dW2.ptr + e * w2, H, I, rows}; }),
             true, false, H, I, I, 1.f, dW2.ptr, dW2.count),
        gemm("dxp = dh13 W13", both([&](int e, size_t r0, int rows) { return GroupedGemmProblem{dh13.ptr + r0 * 2 * I, W13.ptr + e * w13, dxp.ptr + r0 * H, rows, H, 2 * I}; }),
             false, false, 2 * I, H, H, 0.f, dxp.ptr, dxp.count),
        gemm("dW13 += dh13ᵀ xp", both([&](int e, size_t r0, int rows) { return GroupedGemmProblem{dh13.ptr + r0 * 2 * I, xp.ptr + r0 * H, dW13.ptr + e * w13, 2 * I, H, rows}; }),
             true, false, 2 * I, H, H, 1.f, dW13.ptr, dW13.count),
    };
    for (const Gemm& g : gemms) {
      double flop = 0;
      for (const GroupedGemmProblem& p : g.problems.list) flop += 2.0 * p.M * p.N * p.K;
      const std::vector<std::function<void()>> ways = {
          [&] { grouped_gemm(g.name, g.problems, g.transA, g.transB, g.lda, g.ldb, g.ldc, g.beta, stream); },
          [&] { grouped_gemm(g.name, g.routed, g.transA, g.transB, g.lda, g.ldb, g.ldc, g.beta, stream); },
          [&] { grouped_gemm_cublas(g.name, g.problems.list, g.transA, g.transB, g.lda, g.ldb, g.ldc, g.beta, stream); },
          [&] { gemm_per_expert(g.problems.list, g.transA, g.transB, g.lda, g.ldb, g.ldc, g.beta, stream); }};
      const int ways_count = (int)ways.size(), loop = ways_count - 1;
      std::vector<std::vector<float>> results(ways_count);
      for (int way = 0; way < ways_count; way++) {  // one call of each from C = 0 (dW: += onto 0)
        cudaCheck(cudaMemsetAsync(g.C, 0, g.C_count * sizeof(floatX), stream), "bench_expert_gemm", "zero C");
        ways[way]();
        results[way] = download(g.C, g.C_count, stream);
      }
      auto rel_diff_to_loop = [&](const std::vector<float>& c) {
        double num = 0, den = 0;
        for (size_t i = 0; i < g.C_count; i++) {
          const double d = (double)c[i] - results[loop][i];
          num += d * d;
          den += (double)results[loop][i] * results[loop][i];
        }
        return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
      };
      printf("| %s | %.1f | %s", g.name, flop / 1e9,
             grouped_gemm_takes_kernel(g.problems, g.transA, g.transB, g.lda, g.ldb, g.ldc) ? "kernel" : "cuBLAS");
      for (int way = 0; way < ways_count; way++) {
        double issue_ms = 0;
        const double ms = median_ms(ways[way], f.warmup, f.iters, stream, "bench_expert_gemm", &issue_ms);
        printf(" | %.3f | %.0f | %.3f", ms, flop / (ms * 1e9), issue_ms);
      }
      for (int way = 0; way < loop; way++) printf(" | %.1e", rel_diff_to_loop(results[way]));
      printf(" |\n");
      fflush(stdout);
    }
  }
  cudaCheck(cudaStreamDestroy(stream), "bench_expert_gemm", "stream");
  return EXIT_SUCCESS;
}
