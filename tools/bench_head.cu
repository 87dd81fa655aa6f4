// tools/bench_head.cu — the output head (notes/design.md §6.5, notes/ring_dtp.md): the full-logit head
// (--head full), the chunked head (--head chunked, one GPU) and Ring-DTP over the W ranks (P = W, auto
// and each branch forced), in one process on the same inputs: forward + backward latency, where it goes
// (each part of the head in one more call, profiled: runtime/profile.cuh's events around each
// prof_sub of ops/cross_entropy.cuh and ops/ring_dtp.cuh, summed over blocks and steps), and the output
// layer's memory.
//
//   build/fp32/bench_head [--gpus W] [--shapes N:V:H,...] [--block C] [--heads full,chunked,ring]
//                         [--modes auto,fused,weights,activations] [--warmup 1] [--iters 3] [--timeline DIR]
//
// Each rank holds its own batch of N tokens (x [N,H], targets), as in data-parallel training. Time:
// CUDA events around one forward_backward on the compute stream, median of --iters after --warmup,
// the slowest rank's. Memory, per rank: "transient" is the pool's peak above what was live before
// the call (the logits and everything the head allocates: for the full head N·V·b + 2·N·4); "lm_head"
// is the weights and gradient the rank holds (2·V·H·b whole, 2·⌈V/P⌉·H·b split); "output layer" is
// their sum. A head whose closed-form transient does not fit the free device memory gets a row that
// says so. Markdown rows from rank 0. --timeline DIR: rank 0's pool timeline of each head's first
// pass, DIR/N_V_H_HEAD[_MODE].csv (tools/plot_timeline.sh plots one).
#include <algorithm>
#include <memory>
#include <string>
#include <vector>
#include "../ops/ring_dtp.cuh"
#include "../runtime/launch.cuh"
#include "bench_util.cuh"

namespace {

struct Shape {
  long long N, V, H;
};

struct BenchFlags {
  int gpus = 1, warmup = 1, iters = 3, block = 4096;
  std::vector<Shape> shapes = {{4096, 200000, 7168}};
  std::vector<std::string> heads = {"full", "chunked", "ring"};
  std::vector<std::string> modes = {"auto", "weights", "activations"};  // ring's (auto: fused in a training pass)
  std::string timeline_dir;                                              // "": no timelines
};

[[noreturn]] void bench_usage(const std::string& why) {
  fprintf(stderr,
          "bench_head: %s\n"
          "usage: bench_head [--gpus W] [--share_gpus 0|1] [--shapes N:V:H,... (tokens per rank, vocabulary, hidden)] [--block C]\n"
          "                  [--heads full,chunked,ring] [--modes auto,fused,weights,activations] [--warmup n] [--iters n]\n"
          "                  [--timeline DIR]\n",
          why.c_str());
  exit(EXIT_FAILURE);
}

BenchFlags parse_bench_flags(int argc, char** argv) {
  BenchFlags f;
  parse_flag_pairs(argc, argv, bench_usage, [&](const std::string& flag, const char* value) {
    if (flag == "--gpus") f.gpus = (int)parse_flag_int(flag, value, 1, 1024);
    else if (flag == "--share_gpus") parse_share_gpus(flag, value);
    else if (flag == "--warmup") f.warmup = (int)parse_flag_int(flag, value, 0, 1000);
    else if (flag == "--iters") f.iters = (int)parse_flag_int(flag, value, 1, 1000);
    else if (flag == "--block") f.block = (int)parse_flag_int(flag, value, 1, 1 << 30);
    else if (flag == "--shapes") {
      f.shapes.clear();
      for (const std::string& item : split_list(value)) {
        const std::vector<std::string> parts = [&] {
          std::string colons = item;
          std::replace(colons.begin(), colons.end(), ':', ',');
          return split_list(colons);
        }();
        if (parts.size() != 3) bench_usage("--shapes: '" + item + "' is not N:V:H");
        f.shapes.push_back(Shape{parse_flag_int("--shapes N", parts[0].c_str(), 1, 1 << 30),
                                 parse_flag_int("--shapes V", parts[1].c_str(), 2, 1 << 30),
                                 parse_flag_int("--shapes H", parts[2].c_str(), 1, 1 << 20)});
      }
    } else if (flag == "--heads") {
      f.heads = word_list(flag, value, {"full", "chunked", "ring"});
    } else if (flag == "--timeline") {
      f.timeline_dir = value;
    } else if (flag == "--modes") {
      f.modes = word_list(flag, value, {"auto", "fused", "weights", "activations"});
    } else bench_usage("unknown flag " + flag);
  });
  return f;
}

}  // namespace

int main(int argc, char** argv) {
  const BenchFlags f = parse_bench_flags(argc, argv);
  LaunchInfo info = launch(argc, argv, f.gpus);
  Comm world = comm_world_init(info);
  runtime_prepare();  // the cuBLAS workspace, before any head is measured
  const int W = world.size;
  cudaStream_t stream = stream_create("bench_head");
  const size_t b = sizeof(floatX);
  const double MiB = 1048576.0;
  if (world.rank == 0) {
    printf("output head fwd+bwd, %s, P = %d, vocabulary block %d columns, median of %d after %d warm-ups, slowest rank\n\n",
           bench_setting(W, "bench_head").c_str(), W, f.block, f.iters, f.warmup);
    printf("| N/rank | V | H | head | moves | ms | vs full | transient MiB | lm_head MiB | output layer MiB | vs full | "
           "ms per part, one profiled call (rank 0) |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);
  }
  for (const Shape& sh : f.shapes) {
    const int N = (int)sh.N, V = (int)sh.V, H = (int)sh.H;
    const std::pair<int, int> mine = vocab_interval(V, W, world.rank);
    const size_t shard_rows = (size_t)ring_dtp_widest_shard(V, W);
    // the rank's inputs: x, targets, and the whole lm_head (its interval for the ring is a view of it)
    floatX* x = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "bench.x");
    floatX* dx = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "bench.dx");
    floatX* Wfull = pool().alloc_t<floatX>((size_t)V * H, Mem::Weights, "bench.lm_head");
    floatX* dW = pool().alloc_t<floatX>((size_t)V * H, Mem::Grads, "bench.dlm_head");
    int* targets = pool().alloc_t<int>(N, Mem::Activations, "bench.targets");
    float* loss = pool().alloc_t<float>(1, Mem::Workspace, "bench.loss");
    bench_fill(x, (size_t)N * H, 17 + world.rank, 1.0f, stream);
    bench_fill(Wfull, (size_t)V * H, 29, 0.05f, stream);
    cudaCheck(cudaMemsetAsync(dW, 0, (size_t)V * H * b, stream), "bench_head", "dW");
    std::vector<int> host_targets(N);
    for (int n = 0; n < N; n++) host_targets[n] = (int)(((long long)n * 7919 + world.rank * 104729) % V);
    copy_to_device(targets, host_targets.data(), N * sizeof(int), stream, "bench_head");
    const float dloss = 1.0f / ((float)N * W);

    struct Case {
      std::string head, mode;
    };
    std::vector<Case> cases;
    for (const std::string& h : f.heads) {
      if (h == "full" || h == "chunked") cases.push_back({h, ""});
      if (h == "ring" && W > 1)
        for (const std::string& mode : f.modes) cases.push_back({h, mode});
    }
    double full_ms = 0, full_layer = 0;
    for (const Case& c : cases) {
      std::unique_ptr<OutputHead> head;
      size_t bound = 0, lm_head_bytes = 2 * (size_t)V * H * b;
      const floatX* Wuse = Wfull;
      floatX* dWuse = dW;
      std::string moves = "-";
      if (c.head == "full" || c.head == "chunked") {
        const int block = c.head == "full" ? 0 : f.block;  // the chunked head: the full head over row blocks
        head = std::make_unique<FullHead>(block);
        bound = full_head_live_bytes(N, V, block, b);
      } else {
        const RingDTPBranch branch = ring_dtp_choose(c.mode, N, V, W, H, b, true).branch;
        head = std::make_unique<RingDTPHead>(world, c.mode, f.block);
        bound = ring_dtp_live_bytes(branch, N, V, W, H, f.block, b);
        lm_head_bytes = 2 * shard_rows * H * b;
        Wuse = Wfull + (size_t)mine.first * H;
        dWuse = dW + (size_t)mine.first * H;
        moves = std::string(ring_dtp_branch_name(branch)) + (c.mode == "auto" ? " (auto)" : "");
      }
      size_t free_dev = 0, total_dev = 0;
      pool().release_cached();
      cudaCheck(cudaMemGetInfo(&free_dev, &total_dev), "bench_head", "cudaMemGetInfo");
      const bool fits = slowest(world, bound > 0.95 * free_dev ? 1 : 0, stream) == 0;  // every rank decides alike
      if (!fits) {
        if (world.rank == 0)
          printf("| %d | %d | %d | %s | %s | does not fit: %.0f MiB transient, %.0f MiB free | | %.0f | %.0f | | | |\n", N,
                 V, H, c.head.c_str(), moves.c_str(), bound / MiB, free_dev / MiB, bound / MiB, lm_head_bytes / MiB);
        fflush(stdout);
        continue;
      }
      auto pass = [&] { head->forward_backward(loss, dx, dWuse, x, Wuse, targets, dloss, N, H, V, stream); };
      stream_wait(stream, "bench_head", "before %s", c.head.c_str());
      const size_t live_before = pool().live_total();
      pool().reset_peak();
      const bool timeline = !f.timeline_dir.empty() && world.rank == 0;
      pool().clear_timeline();
      pool().set_timeline(timeline);
      pass();
      stream_wait(stream, "bench_head", "%s", c.head.c_str());
      pool().set_timeline(false);
      if (timeline) {
        const std::string csv = f.timeline_dir + "/" + std::to_string(N) + "_" + std::to_string(V) + "_" +
                                std::to_string(H) + "_" + c.head + (c.mode.empty() ? "" : "_" + c.mode) + ".csv";
        if (!pool().write_csv(csv.c_str())) fprintf(stderr, "bench_head: could not write %s\n", csv.c_str());
      }
      pool().clear_timeline();
      const long long transient = slowest(world, (long long)(pool().peak() - live_before), stream);
      const double ms = median_ms(pass, f.warmup, f.iters, stream, "bench_head");
      // one more call with the profiler's events around each part (runtime/profile.cuh): rank 0's time per pass
      profiler().begin(stream);
      prof_mark(stream, "head");
      pass();
      double profiled_ms = 0;
      std::string parts;
      for (const ProfileRow& row : profiler().end(&profiled_ms))
        if (row.name.rfind("head: ", 0) == 0) {
          char part[128];
          snprintf(part, sizeof part, "%s%s %.2f", parts.empty() ? "" : ", ", row.name.c_str() + 6, row.ms);
          parts += part;
        }
      const double slowest_ms = slowest(world, (long long)(ms * 1000.0), stream) / 1000.0;
      const double layer = (double)transient + lm_head_bytes;
      if (c.head == "full") full_ms = slowest_ms, full_layer = layer;
      if (world.rank == 0) {
        char vs_time[32] = "", vs_mem[32] = "";
        if (full_ms > 0) snprintf(vs_time, sizeof vs_time, "%+.1f %%", 100.0 * (slowest_ms / full_ms - 1));
        if (full_layer > 0) snprintf(vs_mem, sizeof vs_mem, "%+.1f %%", 100.0 * (layer / full_layer - 1));
        printf("| %d | %d | %d | %s | %s | %.2f | %s | %.1f | %.1f | %.1f | %s | %s |\n", N, V, H, c.head.c_str(),
               moves.c_str(), slowest_ms, vs_time, transient / MiB, lm_head_bytes / MiB, layer / MiB, vs_mem, parts.c_str());
        fflush(stdout);
      }
    }
    stream_wait(stream, "bench_head", "end of shape");
    for (void* p : {(void*)x, (void*)dx, (void*)Wfull, (void*)dW, (void*)targets, (void*)loss}) pool().free(p);
  }
  stream_wait(stream, "bench_head", "end");
  cudaCheck(cudaStreamDestroy(stream), "bench_head", "stream");
  comm_destroy(world);
  return EXIT_SUCCESS;
}
