// tools/bench_optimizer.cu — the optimizer step on this rank's state (notes/design.md §6.7,
// notes/offload_adamw.md): --optimizer offload_adamw over a sweep of bucket sizes β and slot counts s,
// cpu_adamw on the node's cores (split over the W ranks) with its pipeline's chunks of β and as one
// chunk (β = "all": download, update, upload one after another), all over the same pinned host state, and
// adamw with the state on the GPU; against the link floor, 12 bytes per parameter each way at the
// pinned H2D and D2H bandwidth measured with both directions at once.
//
//   build/bf16/bench_optimizer [--gpus W] [--mparams 1000,4000,16000] [--buckets 1048576,4194304,16777216]
//                              [--slots 1,2,3] [--optimizers offload_adamw,cpu_adamw,adamw] [--warmup 1] [--iters 3]
//
// --mparams: the sizes, in millions of parameters per rank (one tensor with weight decay, the state
// S = P). A size whose host memory (12·P state, + (4 + sizeof(floatX))·P for cpu_adamw, times the W
// ranks of the node) is over 85 % of the machine's, or whose device memory is over what is free, gets a
// row that says so instead of a time; adamw alone is skipped when its 12·P bytes of device state do not fit.
// Time: CUDA events on the compute stream around one step (cpu_adamw: the gradients' D2H, the CPU
// update, the weights' H2D), median of --iters after --warmup, the slowest rank's. "x cpu_adamw": against
// the fastest cpu_adamw row of the size (the strongest baseline). Every rank runs
// each measurement at once (W GPUs share the host's memory bandwidth). Staging: the pool's
// Mem::Optimizer peak during the step. Markdown rows from rank 0.
#include <unistd.h>
#include <algorithm>
#include <climits>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>
#include "../ops/offload_adamw.cuh"
#include "../runtime/launch.cuh"
#include "bench_util.cuh"

namespace {

struct BenchFlags {
  int gpus = 1, warmup = 1, iters = 3;
  std::vector<long long> mparams = {1000, 4000, 16000};
  std::vector<long long> buckets = {1 << 20, 1 << 22, 1 << 24};
  std::vector<long long> slots = {1, 2, 3};
  std::vector<std::string> optimizers = {"offload_adamw", "cpu_adamw", "adamw"};
};

[[noreturn]] void bench_usage(const std::string& why) {
  fprintf(stderr,
          "bench_optimizer: %s\n"
          "usage: bench_optimizer [--gpus W] [--share_gpus 0|1] [--mparams M,... (millions of parameters per rank)] [--buckets beta,...]\n"
          "                       [--slots s,...] [--optimizers offload_adamw,cpu_adamw,adamw] [--warmup n] [--iters n]\n",
          why.c_str());
  exit(EXIT_FAILURE);
}

std::vector<long long> int_list(const std::string& flag, const char* text, long long lo, long long hi) {
  std::vector<long long> values;
  for (const std::string& item : split_list(text)) values.push_back(parse_flag_int(flag, item.c_str(), lo, hi));
  return values;
}

BenchFlags parse_bench_flags(int argc, char** argv) {
  BenchFlags f;
  parse_flag_pairs(argc, argv, bench_usage, [&](const std::string& flag, const char* value) {
    if (flag == "--gpus") f.gpus = (int)parse_flag_int(flag, value, 1, 1024);
    else if (flag == "--share_gpus") parse_share_gpus(flag, value);
    else if (flag == "--warmup") f.warmup = (int)parse_flag_int(flag, value, 0, 1000);
    else if (flag == "--iters") f.iters = (int)parse_flag_int(flag, value, 1, 1000);
    else if (flag == "--mparams") f.mparams = int_list(flag, value, 1, 1 << 20);
    else if (flag == "--buckets") f.buckets = int_list(flag, value, 1, INT_MAX);
    else if (flag == "--slots") f.slots = int_list(flag, value, 1, 16);
    else if (flag == "--optimizers") {
      f.optimizers = word_list(flag, value, {"offload_adamw", "cpu_adamw", "adamw"});
    } else bench_usage("unknown flag " + flag);
  });
  return f;
}

bool wants(const BenchFlags& f, const char* optimizer) {
  return std::find(f.optimizers.begin(), f.optimizers.end(), optimizer) != f.optimizers.end();
}

// Pinned H2D and D2H of `bytes` each: alone, and both directions at once. Milliseconds, medians of 5.
struct LinkTimes {
  double h2d_ms, d2h_ms, both_ms;
  size_t bytes;
};

LinkTimes measure_link(const Comm& world, cudaStream_t stream) {
  LinkTimes t;
  t.bytes = size_t(1) << 30;
  const size_t n = t.bytes / sizeof(float);
  float* up = pinned_floats(n, "bench_optimizer.link");
  float* down = pinned_floats(n, "bench_optimizer.link");
  DeviceBuffer<float> up_dev(n, Mem::Workspace, "bench.link_h2d"), down_dev(n, Mem::Workspace, "bench.link_d2h");
  cudaStream_t h2d = stream_create("bench_optimizer.link"), d2h = stream_create("bench_optimizer.link");
  auto copies = [&](bool do_h2d, bool do_d2h) {
    return [&, do_h2d, do_d2h] {
      stream_after(h2d, stream, "bench_optimizer.link");
      stream_after(d2h, stream, "bench_optimizer.link");
      if (do_h2d)
        cudaCheck(cudaMemcpyAsync(up_dev.ptr, up, t.bytes, cudaMemcpyHostToDevice, h2d), "bench_optimizer.link", "H2D %zu B", t.bytes);
      if (do_d2h)
        cudaCheck(cudaMemcpyAsync(down, down_dev.ptr, t.bytes, cudaMemcpyDeviceToHost, d2h), "bench_optimizer.link", "D2H %zu B", t.bytes);
      stream_after(stream, h2d, "bench_optimizer.link");
      stream_after(stream, d2h, "bench_optimizer.link");
    };
  };
  auto timed = [&](bool do_h2d, bool do_d2h) {
    slowest(world, 0, stream);  // every rank starts together
    return slowest(world, (long long)(median_ms(copies(do_h2d, do_d2h), 2, 5, stream, "bench_optimizer.link") * 1e3),
                   stream) / 1e3;
  };
  t.h2d_ms = timed(true, false);
  t.d2h_ms = timed(false, true);
  t.both_ms = timed(true, true);
  cudaCheck(cudaStreamDestroy(h2d), "bench_optimizer.link", "stream");
  cudaCheck(cudaStreamDestroy(d2h), "bench_optimizer.link", "stream");
  cudaCheck(cudaFreeHost(up), "bench_optimizer.link", "cudaFreeHost");
  cudaCheck(cudaFreeHost(down), "bench_optimizer.link", "cudaFreeHost");
  return t;
}

struct Row {
  std::string optimizer, bucket = "-", slots = "-";
  double device_mib = 0, ms = 0;
  std::string note;  // instead of a time
};

}  // namespace

int main(int argc, char** argv) {
  const BenchFlags f = parse_bench_flags(argc, argv);
  LaunchInfo info = launch(argc, argv, f.gpus);
  Comm world = comm_world_init(info);
  const int W = world.size;
  cudaStream_t stream = stream_create("bench_optimizer");
  const int threads = std::max(1, (int)std::thread::hardware_concurrency() / W);
  const double host_bytes_total = (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE);
  const AdamWSettings settings{0.9f, 0.95f, 1e-8f, 0.1f};
  const double MiB = 1048576.0;

  const LinkTimes link = measure_link(world, stream);
  const double floor_ms_per_param = link.both_ms * 12.0 / link.bytes;  // 12 B/param each way, both at once
  if (world.rank == 0) {
    printf("optimizer step, %s, host %.0f GiB, %u CPU threads (cpu_adamw: %d per rank), "
           "median of %d after %d warm-ups, slowest rank\n",
           bench_setting(W, "bench_optimizer").c_str(), host_bytes_total / (1024 * MiB),
           std::thread::hardware_concurrency(), threads, f.iters, f.warmup);
    printf("pinned link per GPU (1 GiB copies, all %d GPUs at once): H2D %.1f GB/s, D2H %.1f GB/s alone; both at once "
           "%.1f GB/s each way -> floor %.3f s per Gparam (12 B/param each way)\n\n",
           W, link.bytes / link.h2d_ms / 1e6, link.bytes / link.d2h_ms / 1e6, link.bytes / link.both_ms / 1e6,
           floor_ms_per_param * 1e9 / 1e3);
    printf("| params/rank | optimizer | beta | s | optimizer device MiB | ms/step | s per Gparam | x cpu_adamw | link floor ms | floor / time |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);
  }

  for (long long mp : f.mparams) {
    const size_t P = (size_t)mp * 1000000;
    const std::vector<ShardSegment> segments = {ShardSegment{0, 0, P, true}};
    std::vector<Row> rows;
    const double host_need = (12.0 + (wants(f, "cpu_adamw") ? 4.0 + sizeof(floatX) : 0.0)) * P * W;
    size_t free_dev = 0, total_dev = 0;
    cudaCheck(cudaMemGetInfo(&free_dev, &total_dev), "bench_optimizer", "cudaMemGetInfo");
    const double dev_need = (4.0 + sizeof(floatX)) * P + 3.0 * 4 * (*std::max_element(f.buckets.begin(), f.buckets.end())) *
                                                             (*std::max_element(f.slots.begin(), f.slots.end()));
    // every rank decides alike: the fullest rank's device
    const bool fits = host_need <= 0.85 * host_bytes_total &&
                      slowest(world, dev_need > 0.95 * free_dev ? 1 : 0, stream) == 0;
    if (!fits) {
      Row r;
      r.optimizer = "all";
      char note[160];
      snprintf(note, sizeof note, "does not fit: host %.0f GiB of %.0f, device %.0f GiB of %.0f free", host_need / (1024 * MiB),
               host_bytes_total / (1024 * MiB), dev_need / (1024 * MiB), free_dev / (1024 * MiB));
      r.note = note;
      rows.push_back(r);
    } else {
      DeviceBuffer<float> grads(P, Mem::Grads, "bench.grads");
      DeviceBuffer<floatX> params(P, Mem::Weights, "bench.params");
      cudaCheck(cudaMemsetAsync(grads.ptr, 0x3c, grads.bytes(), stream), "bench_optimizer", "grads P=%zu", P);  // 0.0115
      const float one = 1.f;  // the clip factor, on the device as the trainer's is
      DeviceBuffer<float> grad_scale(1, Mem::Workspace, "bench.grad_scale");
      cudaCheck(cudaMemcpy(grad_scale.ptr, &one, sizeof(float), cudaMemcpyHostToDevice), "bench_optimizer", "grad_scale");
      auto state = std::make_shared<PinnedAdamWState>(P);
      const size_t optimizer_base = pool().live(Mem::Optimizer);  // before each optimizer allocates its device part
      auto measure = [&](Optimizer& opt, Row& r) {
        pool().reset_peak();
        slowest(world, 0, stream);  // every rank starts together
        const double ms = median_ms([&] { opt.step(params.ptr, grads.ptr, 1e-4f, settings, grad_scale.ptr, stream); }, f.warmup,
                                    f.iters, stream, "bench_optimizer");
        r.ms = slowest(world, (long long)(ms * 1e3), stream) / 1e3;
        r.device_mib = (pool().peak(Mem::Optimizer) - optimizer_base) / MiB;
        rows.push_back(r);
      };
      if (wants(f, "cpu_adamw")) {
        std::vector<long long> chunks = f.buckets;
        chunks.push_back((long long)P);  // one chunk
        for (long long beta : chunks) {
          CpuAdamW opt(segments, P, threads, (size_t)beta, stream, state);
          Row r;
          r.optimizer = "cpu_adamw (" + std::to_string(threads) + " threads)";
          r.bucket = (size_t)beta >= P ? "all" : std::to_string(beta);
          measure(opt, r);
        }
      }
      if (wants(f, "offload_adamw"))
        for (long long beta : f.buckets)
          for (long long s : f.slots) {
            OffloadAdamW opt(segments, P, (size_t)beta, (int)s, stream, state);
            Row r;
            r.optimizer = "offload_adamw";
            r.bucket = std::to_string(beta);
            r.slots = std::to_string(s);
            measure(opt, r);
          }
      if (wants(f, "adamw")) {
        cudaCheck(cudaMemGetInfo(&free_dev, &total_dev), "bench_optimizer", "cudaMemGetInfo");
        if (slowest(world, 12.0 * P > 0.95 * free_dev ? 1 : 0, stream) == 0) {
          DeviceAdamW opt(segments, P, stream);
          Row r;
          r.optimizer = "adamw (state on the GPU)";
          measure(opt, r);
        } else {
          Row r;
          r.optimizer = "adamw (state on the GPU)";
          r.note = "does not fit: " + std::to_string((long long)(12.0 * P / (1024 * MiB))) + " GiB of state";
          rows.push_back(r);
        }
      }
    }
    if (world.rank == 0) {
      double cpu_ms = 0;  // the fastest cpu_adamw
      for (const Row& r : rows)
        if (r.optimizer.rfind("cpu_adamw", 0) == 0 && r.note.empty() && (cpu_ms == 0 || r.ms < cpu_ms)) cpu_ms = r.ms;
      const double floor_ms = floor_ms_per_param * P;
      for (const Row& r : rows) {
        if (!r.note.empty()) {
          printf("| %.3g B | %s | %s | %s | | %s | | | %.1f | |\n", P / 1e9, r.optimizer.c_str(), r.bucket.c_str(),
                 r.slots.c_str(), r.note.c_str(), floor_ms);
          continue;
        }
        char vs_cpu[32] = "";
        if (cpu_ms > 0) snprintf(vs_cpu, sizeof vs_cpu, "%.2f", cpu_ms / r.ms);
        printf("| %.3g B | %s | %s | %s | %.1f | %.1f | %.3f | %s | %.1f | %.0f %% |\n", P / 1e9, r.optimizer.c_str(),
               r.bucket.c_str(), r.slots.c_str(), r.device_mib, r.ms, r.ms / 1e3 / (P / 1e9), vs_cpu, floor_ms,
               100.0 * floor_ms / r.ms);
      }
      fflush(stdout);
    }
  }
  stream_wait(stream, "bench_optimizer", "end");
  cudaCheck(cudaStreamDestroy(stream), "bench_optimizer", "stream");
  comm_destroy(world);
  return EXIT_SUCCESS;
}
