// dist_model_util.cuh — what the whole-model multi-rank tests (dist_model.cu, dist_sequence_parallel.cu)
// compare with: each tensor of a rank's own shards against the reference, the optimizer's master
// weights as a local flat buffer, a device buffer as host floats; a rank's tokens and routes within the
// global batch; W ranks against one GPU over ten training steps.
#pragma once
#include "../model.cuh"
#include "dist_util.cuh"
#include "gpu_util.cuh"
#include "model_util.cuh"

// Normwise error of tensor `spec` over the part of it that lies in this rank's shards, between a
// local flat GPU buffer and the same positions of ref; *elements gets that part's size (0: none).
// (The part this rank keeps of it, local_pieces, within its region's shard: under --zero 3 a dense
// tensor's kept part is all in the shard.)
inline double shard_tensor_err(const Model& m, size_t spec, const std::vector<float>& gpu_local,
                               const std::vector<float>& ref_local, size_t* elements) {
  double num = 0, den = 0;
  *elements = 0;
  const ParamRegion& r = m.regions[m.spec_region[spec]];
  for (const LocalPiece& p : local_pieces(model_param_layout(m))) {
    if (p.spec != spec) continue;
    size_t lo = std::max(r.shard_offset, p.at), hi = std::min(r.shard_offset + r.shard, p.at + p.count);
    for (size_t i = lo; i < hi; i++, (*elements)++) {
      num += (gpu_local[i] - ref_local[i]) * (double)(gpu_local[i] - ref_local[i]);
      den += (double)ref_local[i] * ref_local[i];
    }
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Asserts every tensor's part of this rank's shards on its own.
inline void expect_shards_match(const char* what, const char* prefix, const Model& m,
                                const std::vector<float>& gpu_local, const std::vector<float>& ref_local) {
  int checked = 0;
  for (size_t i = 0; i < m.specs.size(); i++) {
    size_t elements = 0;
    double e = shard_tensor_err(m, i, gpu_local, ref_local, &elements);
    if (elements == 0) continue;  // none of this tensor is in this rank's shards
    EXPECT_REL(what, (prefix + m.specs[i].name).c_str(), e, MODEL_TOL);
    checked++;
  }
  EXPECT_GT(checked, 0) << "this rank owns no shard of any tensor";
}

// A first step against the reference over the global batch: the loss, every tensor of this rank's
// gradient shards, and the reference's routing agreeing with the ranks' (FP32; BF16 reports it: the
// router's input carries bf16 error).
inline void expect_first_step_matches(const char* what, const Model& m, double loss, double ref_loss,
                                      const std::vector<float>& grads, const std::vector<float>& ref_local,
                                      long long route_disagreements) {
  EXPECT_REL(what, "loss", std::fabs(loss - ref_loss) / ref_loss, MODEL_TOL);
  expect_shards_match(what, "d", m, grads, ref_local);
  printf("[route] %s: %lld top-k choices differ from the reference's (no gap under 1e-3 in its k + 1 largest keys)\n",
         what, route_disagreements);
#if !defined(FLATMOE_BF16)
  EXPECT_EQ(route_disagreements, 0);
#endif
}

// The optimizer's master weights of this rank's shards, placed at their positions in a local flat
// buffer (zeros elsewhere).
inline std::vector<float> master_as_local(Model& m) {
  std::vector<float> state;
  for (auto& sec : m.opt->save(m.stream))
    if (sec.first == "master") state = sec.second;
  std::vector<float> local(m.num_params, 0.f);
  for (const ShardSegment& g : m.opt->segments) std::copy_n(state.begin() + g.state_offset, g.count, local.begin() + g.param_offset);
  return local;
}

template <typename T>
inline std::vector<float> download_local(const T* dev, size_t n) {
  std::vector<T> h = testutil::download_vec(dev, n);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; i++) out[i] = to_float(h[i]);
  return out;
}

// One pass of this rank's B sequences of T tokens (x, y), keeping the activations and then recomputing
// them: the loss and every gradient of this rank's shards are the same bits. `what` names the case.
inline void expect_recompute_bit_identical(Model& m, const int* x, const int* y, int B, int T, float dloss,
                                           const std::string& what) {
  std::vector<float> grads[2];
  float loss[2];
  for (int recompute = 0; recompute < 2; recompute++) {
    model_zero_grads(m);
    PassOptions o;
    o.dloss = dloss;
    o.recompute = recompute == 1;
    loss[recompute] = model_pass(m, x, y, B, T, o);
    grads[recompute] = download_local(m.main_grads, m.num_params);
  }
  EXPECT_EQ(0, memcmp(&loss[0], &loss[1], sizeof(float))) << what;
  EXPECT_EQ(0, memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)))
      << what << ": recomputation must reproduce the gradients bit for bit";
}

// Every rank has reached this point (an all-reduce of one int, waited for).
inline void barrier(const Comm& world, const char* what) {
  DeviceBuffer<int> one(1, Mem::Workspace, "barrier");
  cudaCheck(cudaMemsetAsync(one.ptr, 0, sizeof(int), 0), "test", "%s", what);
  all_reduce_sum(world, one.ptr, one.ptr, 1, 0);
  comm_sync(world, 0, what);
}

// One MoE layer's top-k choices of every rank in rank order ([W][B·T/D·k], each rank's tokens in
// rank_tokens' order) placed at their tokens of the global batch ([groups·B·T·k]). At D = 1: as they are.
inline std::vector<int> place_routes_globally(const int* ranks_routes, int W, int D, int heads, int B, int T, int k) {
  const int Tl = T / D;
  const size_t per_rank = (size_t)B * Tl * k;
  std::vector<int> global(per_rank * W);
  for (int r = 0; r < W; r++) {
    const SequenceSplit split = sequence_split(r, W, heads, T, D);
    for (int b = 0; b < B; b++)
      for (int i = 0; i < Tl; i++) {
        const size_t token = ((size_t)split.group * B + b) * T + split.first_token + i;
        std::copy_n(ranks_routes + r * per_rank + ((size_t)b * Tl + i) * k, k, global.begin() + token * k);
      }
  }
  return global;
}

// W ranks and one GPU see the same ten global batches of groups·B sequences of T (B = 2; groups = W/D: each
// sequence group of D ranks, par.seq, holds B sequences, each rank its T/D-token slice of them): their losses
// and weights agree over ten steps (clipping, weight decay, router bias updates on), with the W ranks'
// seams. The routing is pinned: the W ranks route by their router and record its choices (--record_routing's
// trace), and the one GPU replays them at their tokens of the global batch, so that a near-tie that the two
// sides' other GEMM shapes round apart cannot send their trajectories apart (one token routed differently
// moves that expert's bias by the whole step u on one side only, and the next step routes many tokens
// differently). What is compared is arithmetic, step by step. `label` names the case in the log and the
// trace's file; the caller makes par (c must fit it: model_parallel_refusal) and releases it.
inline void ten_steps_agree_with_one_gpu(const ModelConfig& c, const Parallel& par, const Seams& seams, int D,
                                         const std::string& label) {
  const Comm& world = test_world();
  TrainConfig t;
  t.lr = 3e-3f; t.warmup = 2; t.steps = 10; t.grad_clip = 0.5f; t.bias_update = 1e-2f;
  // Adam's other near-tie: with eps far below a weight's |gradient|, its update is ±lr whatever the
  // gradient's size, so a gradient near zero, whose sign the two sides' roundings set, moves the weight by
  // lr one way on one side and the other way on the other. eps = 1e-4 (above this model's smallest
  // gradients, below its typical 1e-3) makes those updates proportional to the gradient.
  t.adam_eps = 1e-4f;
  const int B = 2, T = c.seq_len, T_rank = T / D, N = B * T_rank, groups = world.size / D, N_global = groups * B * T;
  const int accum = 2;
  const SequenceSplit split = sequence_split(world.rank, world.size, c.heads, T, D);
  testutil::Rng rng;  // the harness gives every rank the same seed
  std::vector<float> master = testutil::random_master(c, rng);
  std::vector<std::vector<int>> xs, ys;
  for (int i = 0; i < t.steps * accum; i++) {
    xs.emplace_back(); ys.emplace_back();
    testutil::random_tokens(N_global, c.vocab, rng, xs.back(), ys.back());
  }
  const std::string trace = test_log_dir() + "/routing_W" + std::to_string(world.size) + "_" + label + ".trace";

  // the W ranks, recording their routing
  Model dist = model_create(c, 1, par, 0, seams);
  model_set_master(dist, master);
  dist.record_routing = true;
  if (world.rank == 0)
    dist.routing_record = std::make_unique<data::RoutingTraceWriter>(trace, routing_trace_shape(c, N, world.size), 0,
                                                                     t.steps * accum);
  std::vector<float> dist_losses;
  std::vector<std::vector<float>> dist_biases;
  for (int step = 0; step < t.steps; step++) {
    int next = step * accum;
    dist_losses.push_back(model_train_step(dist, t, step, B, T_rank, accum, [&](int* xb, int* yb) {
      const std::vector<int> x_mine = testutil::rank_tokens(xs[next], split, B, T),
                             y_mine = testutil::rank_tokens(ys[next], split, B, T);
      std::copy(x_mine.begin(), x_mine.end(), xb);
      std::copy(y_mine.begin(), y_mine.end(), yb);
      next++;
    }, nullptr));
    dist_biases.push_back(dist.router_bias);
  }
  if (dist.routing_record) dist.routing_record->commit();
  if (dist.zero3.on()) EXPECT_EQ(dist.zero3.most_gathered, 2) << "--zero 3: at most two groups' weights gathered at once";
  barrier(world, "ten_steps_agree_with_one_gpu: trace written");

  // rank 0's GPU alone, all experts, the whole global batch, the W ranks' routing replayed; every rank
  // receives its per-step losses and router biases and its final master weights (one all-gather of host
  // values: W ranks sharing a GPU would otherwise run W copies of the same single-GPU training)
  const size_t nbias = dist.router_bias.size();
  std::vector<float> single_result;  // [steps] losses, [steps × nbias] router biases, then the master weights
  if (world.rank == 0) {
    Model single = model_create(c, 1);
    model_set_master(single, master);
    // every rank's choices, in rank order, placed at their tokens of the global batch
    data::RankRoutes replay = data::rank_routes(data::read_routing_trace(trace), 0, world.size);
    for (size_t block = 0; block < replay.indices.size(); block += replay.per_layer) {
      const std::vector<int> placed = place_routes_globally(replay.indices.data() + block, world.size, D, c.heads, B, T, c.topk);
      std::copy(placed.begin(), placed.end(), replay.indices.begin() + block);
    }
    single.replay = std::make_unique<data::RankRoutes>(std::move(replay));
    std::vector<float> biases;
    for (int step = 0; step < t.steps; step++) {
      int next = step * accum;
      single_result.push_back(model_train_step(single, t, step, groups * B, T, accum, [&](int* xb, int* yb) {
        std::copy_n(xs[next].data(), N_global, xb);
        std::copy_n(ys[next].data(), N_global, yb);
        next++;
      }, nullptr));
      biases.insert(biases.end(), single.router_bias.begin(), single.router_bias.end());
    }
    const std::vector<float> single_master = master_as_local(single);
    single_result.insert(single_result.end(), biases.begin(), biases.end());
    single_result.insert(single_result.end(), single_master.begin(), single_master.end());
    model_destroy(single);
  }
  {
    const size_t n = (size_t)max_over_ranks(world, (long long)single_result.size());
    single_result.resize(n);
    const std::vector<float> all = all_gather_host(world, single_result.data(), n, "ten_steps_agree_with_one_gpu");
    std::copy_n(all.begin(), n, single_result.begin());  // rank 0's part
  }
  double worst = 0;
  for (int step = 0; step < t.steps; step++) {
    const float single_loss = single_result[step];
    const std::vector<float> single_bias(single_result.begin() + t.steps + step * nbias,
                                         single_result.begin() + t.steps + (step + 1) * nbias);
    const double e = std::fabs(dist_losses[step] - single_loss) / single_loss;
    worst = std::max(worst, e);
    if (world.rank == 0)
      printf("[dist] step %d loss W=%d %s %.7f one GPU %.7f rel %.2e (routing pinned)\n", step + 1, world.size,
             label.c_str(), dist_losses[step], single_loss, e);
    EXPECT_LE(e, MODEL_TOL) << "the loss diverges at step " << step + 1
                            << " with the routing pinned (one GPU replays the W ranks' choices)";
    // the same choices, so the same integer loads and the same bias updates
    EXPECT_EQ(dist_biases[step], single_bias)
        << "step " << step + 1 << ": the router biases differ, so the loads did: the replayed routing differed";
  }
  char what[96];
  snprintf(what, sizeof what, "dist_%s_vs_single_rank%d", label.c_str(), world.rank);
  // whole-model training compared over ten Adam steps: the whole-model tolerance of notes/design.md §3
  EXPECT_REL(what, "max loss", worst, MODEL_TOL);
  // each tensor of this rank's master shards against the single GPU's master at the same parameters
  const std::vector<float> single_master(single_result.begin() + t.steps * (1 + nbias), single_result.end());
  std::vector<float> single_local = local_from_global(dist, single_master);
  expect_shards_match(what, "master ", dist, master_as_local(dist), single_local);
  model_destroy(dist);
}
