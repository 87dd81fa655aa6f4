// tools/bench_attention.cu — causal attention forward and backward (ops/attention.cuh) on one GPU:
// every form of the kernels the build has for the head dim (attention_forward_with /
// attention_backward_with: SIMT; in the BF16 build the tensor cores' mma.sync kernels at hd 64 and 128
// and, in sm_90a builds, their wgmma form at hd 64, which attention_forward / attention_backward
// take), in one process on the same inputs.
//
//   build/bf16/bench_attention [--seqs 1024,2048,4096] [--hds 64,128] [--pairs 64] [--width 1024]
//                              [--warmup 2] [--iters 10]
//
// Per (T, hd): nh = width / hd heads, B = ⌈pairs / nh⌉ sequences (B·nh ≥ pairs). FLOP counts are the
// causal ones: forward 2·2·B·nh·T²·hd / 2 (QKᵀ and PV over the lower triangle), backward 2.5× that
// (five products: QKᵀ recomputed, dO Vᵀ, Pᵀ dO, dSᵀ Q, dS K). Time: CUDA events around one call on
// a stream, median of --iters after --warmup. The backward's time includes its delta kernel and the
// pool allocation of delta. Markdown rows, the SIMT kernels first (the FP32 build has only them).
// "vs SIMT": on a tensor-core row, ‖x − x_simt‖ / ‖x_simt‖ of out and of dqkv (each form's backward
// on its own out, lse): a check of the tensor-core kernels at sizes the tests do not reach (expect
// bf16 level, ~1e-2).
#include <cmath>
#include <string>
#include <vector>
#include "../ops/attention.cuh"
#include "bench_util.cuh"

namespace {

struct BenchFlags {
  int warmup = 2, iters = 10, pairs = 64, width = 1024;
  std::vector<int> seqs = {1024, 2048, 4096};
  std::vector<int> hds = {64, 128};
};

[[noreturn]] void bench_usage(const std::string& why) {
  fprintf(stderr,
          "bench_attention: %s\n"
          "usage: bench_attention [--seqs T,...] [--hds hd,... (32, 64, 128)] [--pairs n (minimum B·nh)]\n"
          "                       [--width H (nh = H / hd)] [--warmup n] [--iters n]\n",
          why.c_str());
  exit(EXIT_FAILURE);
}

BenchFlags parse_bench_flags(int argc, char** argv) {
  BenchFlags f;
  parse_flag_pairs(argc, argv, bench_usage, [&](const std::string& flag, const char* value) {
    if (flag == "--warmup") f.warmup = (int)parse_flag_int(flag, value, 0, 1000);
    else if (flag == "--iters") f.iters = (int)parse_flag_int(flag, value, 1, 1000);
    else if (flag == "--pairs") f.pairs = (int)parse_flag_int(flag, value, 1, 1 << 20);
    else if (flag == "--width") f.width = (int)parse_flag_int(flag, value, 32, 1 << 16);
    else if (flag == "--seqs") {
      f.seqs.clear();
      for (const std::string& item : split_list(value)) f.seqs.push_back((int)parse_flag_int("--seqs", item.c_str(), 1, 1 << 20));
    } else if (flag == "--hds") {
      f.hds.clear();
      for (const std::string& item : split_list(value)) {
        const int hd = (int)parse_flag_int("--hds", item.c_str(), 32, 128);
        if (hd != 32 && hd != 64 && hd != 128) bench_usage("--hds: " + item + " is not 32, 64 or 128");
        f.hds.push_back(hd);
      }
    } else bench_usage("unknown flag " + flag);
  });
  for (const int hd : f.hds)
    if (f.width % hd != 0) bench_usage("--width " + std::to_string(f.width) + " is not a multiple of hd " + std::to_string(hd));
  return f;
}

std::vector<floatX> download(const floatX* p, size_t n, cudaStream_t s) {
  std::vector<floatX> host(n);
  cudaCheck(cudaMemcpyAsync(host.data(), p, n * sizeof(floatX), cudaMemcpyDeviceToHost, s), "bench_attention",
            "download %zu", n);
  stream_wait(s, "bench_attention", "download");
  return host;
}

// ‖a − b‖ / ‖b‖ (2-norms over every element).
double rel_diff(const std::vector<floatX>& a, const std::vector<floatX>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); i++) {
    const double x = to_float(a[i]), y = to_float(b[i]);
    num += (x - y) * (x - y);
    den += y * y;
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

}  // namespace

int main(int argc, char** argv) {
  const BenchFlags f = parse_bench_flags(argc, argv);
  cudaStream_t stream = stream_create("bench_attention");
  printf("causal attention fwd / bwd, %s, median of %d after %d warm-ups, TFLOP/s of the causal count\n\n",
         bench_setting(1, "bench_attention").c_str(), f.iters, f.warmup);
  printf("| T | hd | B | nh | path | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | vs SIMT: out, dqkv |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|\n");
  fflush(stdout);
  for (const int hd : f.hds)
    for (const int T : f.seqs) {
      const int nh = f.width / hd, B = ceil_div(f.pairs, nh), N = B * T, H = nh * hd;
      DeviceBuffer<floatX> qkv((size_t)N * 3 * H, Mem::Activations, "bench.qkv");
      DeviceBuffer<floatX> dout((size_t)N * H, Mem::Activations, "bench.dout");
      DeviceBuffer<floatX> out((size_t)N * H, Mem::Activations, "bench.out");
      DeviceBuffer<float> lse((size_t)B * nh * T, Mem::Activations, "bench.lse");
      DeviceBuffer<floatX> dqkv((size_t)N * 3 * H, Mem::Grads, "bench.dqkv");
      bench_fill(qkv.ptr, qkv.count, 17, 1.0f, stream);
      bench_fill(dout.ptr, dout.count, 29, 1.0f, stream);
      const double fwd_flop = 2.0 * 2.0 * B * nh * (double)T * T * hd / 2.0, bwd_flop = 2.5 * fwd_flop;

      std::vector<floatX> simt_out, simt_dqkv;  // the SIMT kernels' results (they run first)
      for (const AttentionKernels k : {AttentionKernels::Simt, AttentionKernels::MmaSync, AttentionKernels::Wgmma}) {
        if (!attention_has_kernels(k, hd, {qkv.ptr, dout.ptr, out.ptr, dqkv.ptr})) continue;
        auto fwd = [&] { attention_forward_with(k, out.ptr, lse.ptr, qkv.ptr, B, T, nh, hd, stream); };
        auto bwd = [&] { attention_backward_with(k, dqkv.ptr, dout.ptr, qkv.ptr, out.ptr, lse.ptr, B, T, nh, hd, stream); };
        const double fwd_ms = median_ms(fwd, f.warmup, f.iters, stream, "bench_attention");
        const double bwd_ms = median_ms(bwd, f.warmup, f.iters, stream, "bench_attention");  // on this path's out, lse
        char vs[64] = "";
        if (k == AttentionKernels::Simt) {
          simt_out = download(out.ptr, out.count, stream);
          simt_dqkv = download(dqkv.ptr, dqkv.count, stream);
        } else {
          snprintf(vs, sizeof vs, "%.2e, %.2e", rel_diff(download(out.ptr, out.count, stream), simt_out),
                   rel_diff(download(dqkv.ptr, dqkv.count, stream), simt_dqkv));
        }
        printf("| %d | %d | %d | %d | %s | %.3f | %.1f | %.3f | %.1f | %s |\n", T, hd, B, nh, attention_kernels_name(k),
               fwd_ms, fwd_flop / (fwd_ms * 1e9), bwd_ms, bwd_flop / (bwd_ms * 1e9), vs);
        fflush(stdout);
      }
      stream_wait(stream, "bench_attention", "T=%d hd=%d", T, hd);
    }
  cudaCheck(cudaStreamDestroy(stream), "bench_attention", "stream");
  return EXIT_SUCCESS;
}
