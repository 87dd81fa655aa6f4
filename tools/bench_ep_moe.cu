// tools/bench_ep_moe.cu — the expert-parallel MoE dispatchers on W ranks in one run, on the same
// inputs: standard EP (ops/ep_moe.cuh), LLEP (ops/llep.cuh), PipelinedLLEP (ops/pipelined_llep.cuh) and
// RelayMoE (ops/relay_moe.cuh),
// with the single-GPU MoE (ops/moe.cuh) as the baseline, under the routing profiles of the paper's
// appendix B.2 (data/routing_profile.hpp: balanced, hot:r/h) or a recorded routing trace
// (data/routing_trace.hpp: trace:FILE); routing weights 1/k.
//
//   build/bf16/bench_ep_moe --gpus 2 [--tokens 8192 --hidden 2048 --inter 1408 --experts 16 --topk 4
//                            --warmup 5 --iters 20 --seed 1 --profiles balanced,hot:0.25/1,hot:0.5/2,hot:1/4]
//                            [--dispatchers 1gpu,ep,llep,pllep,relay_expert,relay_token,relay_auto --llep_alpha 1.0 --llep_min_rows 32
//                             --token_budget 4096 --kmax 10] [--check 1] [--timeline DIR]
//                            [--profiles trace:FILE --trace_batch 0 --trace_layer L]
//
// Per profile, every rank routes its N tokens by the profile (the same on every rank) or by the
// trace (each rank its own recorded tokens: batch --trace_batch, MoE layer --trace_layer, by default
// the first recorded; the trace must have been recorded by W ranks of --tokens tokens, with --experts
// and --topk, else it is refused before the GPU starts), then runs forward + backward with each of:
//   1gpu    moe_forward + moe_backward of the same N tokens with all E experts, on every rank at once
//           (--moe local)
//   then every registered dispatcher that exchanges routes (config.hpp's moe_choices), over the group
//   of all W ranks (E_p = W, E/W experts each), once in each of its modes (seam_runs):
//   ep      standard EP
//   llep    LLEP (--llep_alpha, --llep_min_rows)
//   pllep   PipelinedLLEP (--token_budget c, --kmax K_max, and LLEP's settings for each chunk)
//   relay_expert  RelayMoE in expert mode (the partitions travel the ring)
//   relay_token   RelayMoE in token mode (the token blocks travel, with their routing and accumulators)
//   relay_auto    RelayMoE with the mode auto picks for this shape (relay_choose; the pick is printed)
// Latency: CUDA events around three passes, each the median of `iters` runs after `warmup`, the
// slowest rank's median: the forward alone (the paper's measure), forward + backward, and the
// checkpointed step — forward, forward again with out = nullptr, backward: what a layer under
// --recompute runs (model.cuh), where pllep's and relay's second forward only plans since their backward recomputes.
// Peak: the most loaded rank's peak of Dispatch + ExpertIntermediates live bytes over one forward +
// backward (replayed from the pool's timeline), and the same with CommStaging (relay's weight slots,
// weight-gradient accumulators and fp32 output accumulator live there); LLEP's borrowed expert
// weights and gradients (Weights, Grads) are in neither. R_d: the most routes one rank computed (for
// pllep in one chunk, for relay's expert mode in one hop; "-" for its token mode). --check 1: one more pass of each dispatcher from zeroed weight gradients,
// every output and gradient compared with ep's on this rank (normwise), the largest difference per
// dispatcher printed; exits with status 1 when one is above the tolerance (FP32 1e-5, BF16 2e-2).
// --timeline DIR: rank 0's pool timeline of the measured pass, DIR/PROFILE_DISPATCHER.csv (the
// folder must exist). Markdown rows from rank 0.
#include <algorithm>
#include <cerrno>
#include <climits>
#include <cmath>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>
#include "../runtime/comm.cuh"
#include "../runtime/launch.cuh"
#include "../seams.cuh"
#include "bench_util.cuh"
#include "../ops/router.cuh"
#include "../data/routing_profile.hpp"
#include "../data/routing_trace.hpp"

struct BenchFlags {
  int gpus = 1, tokens = 8192, hidden = 2048, inter = 1408, experts = 16, topk = 4, warmup = 5, iters = 20;
  unsigned long long seed = 1;
  std::vector<std::string> profiles = {"balanced", "hot:0.25/1", "hot:0.5/2", "hot:1/4"};
  int trace_batch = 0;   // the batch of a trace:FILE profile
  int trace_layer = -1;  // its MoE layer (the model's layer index); -1: the first the trace records
  std::vector<std::string> dispatchers;  // labels of bench_dispatchers(); default: all of them
  double llep_alpha = 1.0;
  int llep_min_rows = 32, token_budget = 4096, kmax = 10, check = 0;
  std::string timeline_dir;  // "": no timelines
};

// What it runs: 1gpu (the local dispatcher with all E experts on each rank), then each run of the
// registered dispatchers that exchange routes (config.hpp: seam_runs), labelled NAME or NAME_MODE.
std::vector<SeamRun> bench_dispatchers() {
  std::vector<SeamRun> runs = {{"1gpu", "local", ""}};
  for (const SeamRun& run : seam_runs(moe_choices(), SeamNeeds::ExpertGroup)) runs.push_back(run);
  return runs;
}

std::vector<std::string> bench_dispatcher_labels() {
  std::vector<std::string> labels;
  for (const SeamRun& run : bench_dispatchers()) labels.push_back(run.label);
  return labels;
}

[[noreturn]] void bench_usage(const std::string& why) {
  fprintf(stderr,
          "bench_ep_moe: %s\n"
          "usage: bench_ep_moe [--gpus W] [--share_gpus 0|1] [--tokens N per rank] [--hidden H] [--inter I] [--experts E] [--topk k]\n"
          "                    [--warmup n] [--iters n] [--seed s] [--profiles balanced,hot:r/h,trace:FILE,...]\n"
          "                    [--trace_batch b] [--trace_layer l]\n"
          "                    [--dispatchers %s]\n"
          "                    [--llep_alpha a] [--llep_min_rows n] [--token_budget c] [--kmax K] [--check 0|1]\n"
          "                    [--timeline DIR]\n",
          why.c_str(), joined(bench_dispatcher_labels(), ",").c_str());
  exit(EXIT_FAILURE);
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

// relay_auto's pick: every rank holds --tokens tokens, partitions of E/W experts, fp32 accumulators.
RelayChoice bench_relay_choice(const BenchFlags& f) {
  return relay_choose("auto", f.tokens, f.hidden, f.inter, f.experts / f.gpus, f.topk, sizeof(floatX), sizeof(float));
}

BenchFlags parse_bench_flags(int argc, char** argv) {
  BenchFlags f;
  f.dispatchers = bench_dispatcher_labels();
  parse_flag_pairs(argc, argv, bench_usage, [&](const std::string& flag, const char* value) {
    if (flag == "--gpus") f.gpus = (int)parse_flag_int(flag, value, 1, 1024);
    else if (flag == "--share_gpus") parse_share_gpus(flag, value);
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
    else if (flag == "--llep_min_rows") f.llep_min_rows = (int)parse_flag_int(flag, value, 1, INT_MAX);
    else if (flag == "--token_budget") f.token_budget = (int)parse_flag_int(flag, value, 1, INT_MAX);
    else if (flag == "--kmax") f.kmax = (int)parse_flag_int(flag, value, 1, INT_MAX);
    else if (flag == "--check") f.check = (int)parse_flag_int(flag, value, 0, 1);
    else if (flag == "--timeline") f.timeline_dir = value;
    else if (flag == "--llep_alpha") {
      char* end = nullptr;
      f.llep_alpha = strtod(value, &end);
      if (value[0] == '\0' || *end != '\0' || !(f.llep_alpha >= 1.0) || !std::isfinite(f.llep_alpha))
        bench_usage(flag + " '" + value + "': expected a number >= 1");
    } else if (flag == "--profiles") f.profiles = split_list(value);
    else if (flag == "--dispatchers") {
      f.dispatchers = split_list(value);
      for (const std::string& d : f.dispatchers)
        if (!has_name(bench_dispatcher_labels(), d))
          bench_usage("--dispatchers: unknown dispatcher '" + d + "' (" + joined(bench_dispatcher_labels(), ", ") + ")");
    } else bench_usage("unknown flag " + flag);
  });
  if (f.check && std::find(f.dispatchers.begin(), f.dispatchers.end(), "ep") == f.dispatchers.end())
    bench_usage("--check 1 compares every dispatcher with ep: --dispatchers must include ep");
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

// Peak of Dispatch + ExpertIntermediates live bytes (with_staging: + CommStaging) that one run of
// `pass` adds, replayed from the pool's timeline (the pool keeps per-category peaks only, not the peak
// of their sum). A non-empty `csv` gets that timeline (tools/plot_timeline.sh plots it).
template <typename F>
size_t peak_dispatch_and_intermediates(F pass, cudaStream_t stream, const std::string& csv, bool with_staging = false) {
  auto counted = [&](Mem c) { return c == Mem::Dispatch || c == Mem::ExpertIntermediates || (with_staging && c == Mem::CommStaging); };
  const long long base = (long long)(pool().live(Mem::Dispatch) + pool().live(Mem::ExpertIntermediates) +
                                     (with_staging ? pool().live(Mem::CommStaging) : 0));
  pool().clear_timeline();
  pool().set_timeline(true);
  pass();
  stream_wait(stream, "bench_ep_moe", "peak pass");
  pool().set_timeline(false);
  if (!csv.empty() && !pool().write_csv(csv.c_str())) fprintf(stderr, "bench_ep_moe: could not write %s\n", csv.c_str());
  long long live = base, peak = base;
  for (const PoolEvent& e : pool().events()) {
    if (!counted(e.cat)) continue;
    if (e.action == 'a') live += (long long)e.bytes;
    if (e.action == 'f') live -= (long long)e.bytes;
    peak = std::max(peak, live);
  }
  pool().clear_timeline();
  return (size_t)(peak - base);
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
    printf("expert-parallel MoE dispatchers, %s: N=%d tokens/rank, H=%d, I=%d, E=%d (E_l=%d), k=%d, "
           "llep alpha=%g min_rows=%d, pllep c=%d K_max=%d, medians of %d after %d warm-ups\n",
           bench_setting(W, "bench_ep_moe").c_str(), N, H, I, E, E_l, k, f.llep_alpha, f.llep_min_rows,
           f.token_budget, f.kmax, f.iters, f.warmup);
    const RelayChoice relay = bench_relay_choice(f);
    printf("relay per hop: experts %.2f MiB, tokens %.2f MiB: auto picks %s\n\n", relay.expert_bytes / 1048576.0,
           relay.token_bytes / 1048576.0, relay_mode_name(relay.mode));
    printf("| profile | dispatcher | max R_d | fwd ms | / llep | fwd+bwd ms | / llep | checkpointed ms | / llep | "
           "peak D+EI MiB | peak / llep | peak D+EI+CS MiB | Dispatch closed form MiB | fwd host issue ms |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    fflush(stdout);
  }

  // the dispatchers of the MoE seam by label, each made by its registered factory (seams.cuh) for this
  // layer as a model of one sequence of N tokens per rank; 1gpu (local) holds all E experts, the others
  // exchange over the world (E_p = W)
  auto make_dispatcher = [&](const std::string& label) -> std::unique_ptr<MoEDispatcher> {
    const std::vector<SeamRun> runs = bench_dispatchers();
    const SeamRun& run = *std::find_if(runs.begin(), runs.end(), [&](const SeamRun& r) { return r.label == label; });
    ModelConfig c;
    c.hidden = H, c.expert_dim = I, c.experts = E, c.topk = k, c.seq_len = N;
    TrainConfig t;
    t.gpus = t.ep = W;
    t.batch = 1;
    t.moe = run.choice;
    if (!run.mode.empty()) set_train_flag(t, find_choice(moe_choices(), run.choice)->mode_flag, run.mode);
    Seams s = seams_from(t, c);
    s.llep_alpha = f.llep_alpha, s.llep_min_rows = f.llep_min_rows, s.kmax = f.kmax;
    s.token_budget = run.choice == "pllep" ? f.token_budget : 0;  // pllep's c; the 1gpu baseline is the unchunked layer
    return factory_of(dispatcher_factories(), "--moe", run.choice).make(c, world, s);
  };
  const double MiB = 1048576.0;
  int status = EXIT_SUCCESS;
  for (const std::string& name : f.profiles) {
    const BenchRoutes routes = bench_routes(f, name, W, world.rank);
    copy_to_device(topk_idx.ptr, routes.topk_idx.data(), topk_idx.bytes(), stream, "bench_ep_moe.topk_idx");
    struct Row {
      std::string dispatcher;
      long long fwd_us, fwd_issue_us, pass_us, checkpointed_us, peak, peak_staging, received;
    };
    std::vector<Row> rows;
    for (const std::string& dname : f.dispatchers) {
      std::unique_ptr<MoEDispatcher> d = make_dispatcher(dname);
      const bool single = dname == "1gpu";
      const floatX* W13_used = single ? W13.ptr : W13_local;
      const floatX* W2_used = single ? W2.ptr : W2_local;
      floatX* dW13_used = single ? dW13.ptr : dW13_local;
      floatX* dW2_used = single ? dW2.ptr : dW2_local;
      long long received = 0;
      auto pass = [&] {
        std::unique_ptr<DispatchSaved> saved = d->forward(out.ptr, x.ptr, topk_idx.ptr, topk_w.ptr, W13_used, W2_used, N, stream);
        d->backward(dx.ptr, dtopk_w.ptr, dW13_used, dW2_used, dout.ptr, *saved, x.ptr, topk_idx.ptr, topk_w.ptr, W13_used,
                    W2_used, stream);
        if (auto* s = dynamic_cast<EPDispatcher::Saved*>(saved.get())) received = s->ep.plan.received;
        if (auto* s = dynamic_cast<LLEPDispatcher::Saved*>(saved.get())) received = s->llep.ep.plan.received;
        if (auto* s = dynamic_cast<PLLEPDispatcher::Saved*>(saved.get()))
          received = *std::max_element(s->pllep.chunk_received.begin(), s->pllep.chunk_received.end());
        if (auto* s = dynamic_cast<RelayDispatcher::Saved*>(saved.get()))  // expert mode: its largest hop
          if (!s->relay.expert_counts.empty()) received = relay_max_hop_routes(s->relay.expert_counts, E_l);
        if (single) received = (long long)N * k;
      };
      auto forward_only = [&] {
        d->forward(out.ptr, x.ptr, topk_idx.ptr, topk_w.ptr, W13_used, W2_used, N, stream).reset();
      };
      auto checkpointed = [&] {
        d->forward(out.ptr, x.ptr, topk_idx.ptr, topk_w.ptr, W13_used, W2_used, N, stream).reset();
        std::unique_ptr<DispatchSaved> saved = d->forward(nullptr, x.ptr, topk_idx.ptr, topk_w.ptr, W13_used, W2_used, N, stream);
        d->backward(dx.ptr, dtopk_w.ptr, dW13_used, dW2_used, dout.ptr, *saved, x.ptr, topk_idx.ptr, topk_w.ptr, W13_used,
                    W2_used, stream);
      };
      double fwd_issue_ms = 0;
      const double fwd_ms = median_ms(forward_only, f.warmup, f.iters, stream, "bench_ep_moe", &fwd_issue_ms);
      const double ms = median_ms(pass, f.warmup, f.iters, stream, "bench_ep_moe");
      const double checkpointed_ms = median_ms(checkpointed, f.warmup, f.iters, stream, "bench_ep_moe");
      std::string csv;  // --timeline DIR: rank 0's pass, DIR/PROFILE_DISPATCHER.csv
      if (!f.timeline_dir.empty() && world.rank == 0) {
        csv = f.timeline_dir + "/" + name + "_" + dname + ".csv";
        for (size_t c = f.timeline_dir.size() + 1; c < csv.size(); c++)
          if (csv[c] == '/' || csv[c] == ':') csv[c] = '-';
      }
      const size_t peak = peak_dispatch_and_intermediates(pass, stream, csv);
      const size_t peak_staging = peak_dispatch_and_intermediates(pass, stream, "", true);
      comm_sync(world, stream, "bench_ep_moe");
      const std::vector<long long> all = gather_all(
          world, {(long long)(fwd_ms * 1e3), (long long)(fwd_issue_ms * 1e3), (long long)(ms * 1e3),
                  (long long)(checkpointed_ms * 1e3), (long long)peak, (long long)peak_staging, received},
          stream);
      Row row{dname, 0, 0, 0, 0, 0, 0, 0};
      const int fields = 7;
      for (int r = 0; r < W; r++) {
        row.fwd_us = std::max(row.fwd_us, all[r * fields + 0]);
        row.fwd_issue_us = std::max(row.fwd_issue_us, all[r * fields + 1]);
        row.pass_us = std::max(row.pass_us, all[r * fields + 2]);
        row.checkpointed_us = std::max(row.checkpointed_us, all[r * fields + 3]);
        row.peak = std::max(row.peak, all[r * fields + 4]);
        row.peak_staging = std::max(row.peak_staging, all[r * fields + 5]);
        row.received = std::max(row.received, all[r * fields + 6]);
      }
      rows.push_back(row);
    }
    const Row* llep = nullptr;
    for (const Row& row : rows)
      if (row.dispatcher == "llep") llep = &row;
    if (world.rank == 0)
      for (const Row& row : rows) {
        char vs_fwd[32] = "-", vs_pass[32] = "-", vs_checkpointed[32] = "-", vs_peak[32] = "-";
        if (llep != nullptr) {
          snprintf(vs_fwd, sizeof vs_fwd, "%.2f", (double)row.fwd_us / llep->fwd_us);
          snprintf(vs_pass, sizeof vs_pass, "%.2f", (double)row.pass_us / llep->pass_us);
          snprintf(vs_checkpointed, sizeof vs_checkpointed, "%.2f", (double)row.checkpointed_us / llep->checkpointed_us);
          snprintf(vs_peak, sizeof vs_peak, "%.2f", (double)row.peak / llep->peak);
        }
        // ep and llep share one schedule and its closed form at their R_d; relay's expert mode (backward,
        // the larger) at its largest hop (1gpu, pllep and relay's token mode have their own)
        char closed[32] = "-";
        if (row.dispatcher == "ep" || row.dispatcher == "llep")
          snprintf(closed, sizeof closed, "%.1f", ep_moe_dispatch_peak_bytes((long long)N * k, row.received, H, sizeof(floatX)) / MiB);
        const bool relay_expert_row = row.dispatcher == "relay_expert" ||
                                      (row.dispatcher == "relay_auto" && bench_relay_choice(f).mode == RelayMode::Expert);
        if (relay_expert_row)
          snprintf(closed, sizeof closed, "%.1f",
                   relay_expert_live_bytes(true, N, k, row.received, H, I, E_l, W, sizeof(floatX)).dispatch / MiB);
        // R_d of relay's token mode is not recorded (its blocks' routes are sorted hop by hop): "-"
        const bool relay_token_row = row.dispatcher.compare(0, 5, "relay") == 0 && !relay_expert_row;
        const std::string received = relay_token_row ? "-" : std::to_string(row.received);
        printf("| %s | %s | %s | %.3f | %s | %.3f | %s | %.3f | %s | %.1f | %s | %.1f | %s | %.3f |\n", routes.label.c_str(),
               row.dispatcher.c_str(), received.c_str(), row.fwd_us / 1e3, vs_fwd, row.pass_us / 1e3, vs_pass,
               row.checkpointed_us / 1e3, vs_checkpointed, row.peak / MiB, vs_peak, row.peak_staging / MiB, closed,
               row.fwd_issue_us / 1e3);
      }
    fflush(stdout);

    if (f.check) {
      // every dispatcher of the EP group once more from zeroed weight gradients; outputs and this
      // rank's gradients against ep's (1gpu sees another batch: this rank's N tokens alone)
      auto outputs = [&](MoEDispatcher& d) {
        const size_t local13 = (size_t)E_l * w13_stride, local2 = (size_t)E_l * w2_stride;
        cudaCheck(cudaMemsetAsync(dW13.ptr, 0, dW13.bytes(), stream), "bench_ep_moe.check", "dW13");
        cudaCheck(cudaMemsetAsync(dW2.ptr, 0, dW2.bytes(), stream), "bench_ep_moe.check", "dW2");
        std::unique_ptr<DispatchSaved> saved = d.forward(out.ptr, x.ptr, topk_idx.ptr, topk_w.ptr, W13_local,
                                                         W2_local, N, stream);
        d.backward(dx.ptr, dtopk_w.ptr, dW13_local, dW2_local, dout.ptr, *saved,
                   x.ptr, topk_idx.ptr, topk_w.ptr, W13_local, W2_local, stream);
        saved.reset();
        std::vector<std::vector<double>> got;
        auto take = [&](const auto* p, size_t n) {
          std::vector<typename std::remove_const<typename std::remove_pointer<decltype(p)>::type>::type> h(n);
          copy_to_host(h.data(), p, n * sizeof(h[0]), stream, "bench_ep_moe.check");
          std::vector<double> v;
          for (const auto& e : h) v.push_back((double)to_float(e));
          got.push_back(v);
        };
        take(out.ptr, (size_t)N * H);
        take(dx.ptr, (size_t)N * H);
        take(dtopk_w.ptr, (size_t)N * k);
        take(dW13_local, local13);
        take(dW2_local, local2);
        return got;
      };
      std::unique_ptr<MoEDispatcher> ep = make_dispatcher("ep");
      const std::vector<std::vector<double>> want = outputs(*ep);
      const char* what[] = {"out", "dx", "dtopk_w", "dW13", "dW2"};
#if defined(FLATMOE_BF16)
      const double tol = 2e-2;
#else
      const double tol = 1e-5;
#endif
      for (const std::string& dname : f.dispatchers) {
        if (dname == "ep" || dname == "1gpu") continue;  // 1gpu sees a different batch (this rank's N tokens only)
        std::unique_ptr<MoEDispatcher> d = make_dispatcher(dname);
        const std::vector<std::vector<double>> got = outputs(*d);
        double worst = 0;
        int worst_at = 0;
        for (int t = 0; t < 5; t++) {
          double diff = 0, norm = 0;
          for (size_t i = 0; i < want[t].size(); i++) {
            diff += (got[t][i] - want[t][i]) * (got[t][i] - want[t][i]);
            norm += want[t][i] * want[t][i];
          }
          const double rel = norm > 0 ? std::sqrt(diff / norm) : std::sqrt(diff);
          if (rel > worst) worst = rel, worst_at = t;
        }
        const std::vector<long long> ranks_worst = gather_all(world, {(long long)(worst * 1e12)}, stream);
        const double group_worst = *std::max_element(ranks_worst.begin(), ranks_worst.end()) / 1e12;
        if (group_worst > tol) status = EXIT_FAILURE;
        if (world.rank == 0)
          printf("check %s %s vs ep: largest normwise difference over the ranks %.3e (rank 0's largest: %s), tolerance %.0e: %s\n",
                 routes.label.c_str(), dname.c_str(), group_worst, what[worst_at], tol,
                 group_worst > tol ? "FAILED" : "ok");
      }
      fflush(stdout);
    }
  }
  stream_wait(stream, "bench_ep_moe", "end");
  cudaCheck(cudaStreamDestroy(stream), "bench_ep_moe", "stream");
  comm_destroy(world);
  return status;
}
