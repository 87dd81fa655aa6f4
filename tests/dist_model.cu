// The whole model on W ranks (data parallel + ZeRO-1 + expert parallel over all W ranks) against
// the CPU reference over the global batch, each rank checking each tensor of its own shards; W ranks
// against one GPU on the same global batch over ten steps; the model's state saved and restored at
// W ranks, bit for bit; recomputation at W ranks, bit for bit, with and without SCO; the GPU's memory as
// the ranks agree on it before their models allocate, whatever the pools beside them hold. A rank that
// leaves in the middle of a layer's exchange: the others stop within the communication timeout,
// aborting every communicator.
#include <unistd.h>
#include "../model.cuh"
#include "../rank_memory.cuh"
#include "../ref/model.hpp"
#include "dist_jobs.cuh"
#include "dist_util.cuh"
#include "gpu_util.cuh"
#include "model_util.cuh"
#include "optimizer_training.cuh"
#include "sco_training.cuh"
#include "memory_prediction.cuh"
#include "dist_model_util.cuh"

namespace {

using testutil::as_seen_by_gpu;
using testutil::random_master;
using testutil::random_tokens;

// The toy model at this run's W: E = 6 where E_p = W divides it, else the next multiple of W (8 at W = 4
// and 8).
ModelConfig dist_config() {
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40;  // init_std: the trainer's (model_util.cuh)
  c.layers = 3; c.experts = testutil::experts_for(6, test_world_size()); c.topk = 2; c.score_fn = 0; c.n_dense = 1;
  c.dense_dim = 48; c.shared_expert = 1;
  return c;
}

// Expert parallel over every rank (E_p = W), so each rank holds E/W experts of every MoE layer; with
// vocab_split (--head ring_dtp) lm_head's rows are split over every rank too (P = W); zero = 3: each rank
// keeps 1/W of the dense weights (--zero 3).
Parallel test_parallel(bool vocab_split = false, int zero = 1) {
  const Comm& world = test_world();
  Parallel par;
  par.world = world;
  par.ep = comm_block_group(world, world.size, "ep");
  par.expert_replicas = comm_split(world, world.rank % world.size, world.rank, "expert_replicas");
  if (vocab_split) par.vocab = comm_block_group(world, world.size, "vocab");
  par.zero = zero;
  if (zero == 3) par.dense = comm_block_group(world, world.size, "dense");
  return par;
}

void release(Parallel& par) {
  comm_destroy(par.ep);
  comm_destroy(par.expert_replicas);
  comm_destroy(par.vocab);
  comm_destroy(par.dense);
}

// A configuration that does not fit this run's layout fails the calling test on every rank alike
// (model_create would end the whole binary).
#define ASSERT_MODEL_FITS(c, par)                                                        \
  do {                                                                                   \
    const std::string refused_ = model_parallel_refusal(c, par);                         \
    if (!refused_.empty()) {                                                             \
      release(par);                                                                      \
      FAIL() << "the test's model does not fit W=" << test_world_size() << ": " << refused_; \
    }                                                                                    \
  } while (0)

// Every rank's top-k choices of every MoE layer, in global token order ([L][N_global·k]).
std::vector<std::vector<int>> gather_routes(const std::vector<std::vector<int>>& local, const Comm& world) {
  std::vector<std::vector<int>> global(local.size());
  for (size_t l = 0; l < local.size(); l++) {
    if (local[l].empty()) continue;
    DeviceBuffer<int> mine(local[l].size(), Mem::Workspace, "routes");
    DeviceBuffer<int> all(local[l].size() * world.size, Mem::Workspace, "routes");
    cudaCheck(cudaMemcpy(mine.ptr, local[l].data(), local[l].size() * 4, cudaMemcpyHostToDevice), "test", "routes");
    all_gather(world, mine.ptr, all.ptr, local[l].size(), 0);
    comm_sync(world, 0, "gather_routes");
    global[l].resize(all.count);
    cudaCheck(cudaMemcpy(global[l].data(), all.ptr, all.count * 4, cudaMemcpyDeviceToHost), "test", "routes");
  }
  return global;
}

}  // namespace

// First step: loss and every gradient, each rank checking the shards it owns after the
// reduce-scatter, against the reference model over the global batch.
TEST(DistModel, FirstStepShardsMatchReferenceOverGlobalBatch) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  Parallel par = test_parallel();
  ModelConfig c = dist_config();
  ASSERT_MODEL_FITS(c, par);
  const int B = 2, T = c.seq_len, N = B * T, N_global = N * world.size;
  testutil::Rng rng;  // the harness gives every rank the same seed
  std::vector<float> master = random_master(c, rng);
  std::vector<int> x, y;
  random_tokens(N_global, c.vocab, rng, x, y);

  Model m = model_create(c, 1, par);
  model_set_master(m, master);
  model_zero_grads(m);
  std::vector<std::vector<int>> routes = model_routes(m, x.data() + world.rank * N, B, T);
  PassOptions o;
  o.dloss = 1.f / N_global;
  float loss = mean_over_ranks(m, model_pass(m, x.data() + world.rank * N, y.data() + world.rank * N, B, T, o));
  reduce_scatter_grads(m);
  std::vector<float> grads = download_local(m.main_grads, m.num_params);

  ref::Model<double> r(c, as_seen_by_gpu(master));
  std::vector<std::vector<int>> global_routes = gather_routes(routes, world);
  r.forced_routes = &global_routes;
  double ref_loss = ref_pass(r, x, y, world.size * B, T, true, 1.0 / N_global);
  std::vector<float> ref_grads_global(r.grads.begin(), r.grads.end());
  std::vector<float> ref_local = local_from_global(m, ref_grads_global);

  char what[64];
  snprintf(what, sizeof what, "dist_model_W%d_rank%d", world.size, world.rank);
  expect_first_step_matches(what, m, loss, ref_loss, grads, ref_local, r.route_disagreements);
  model_destroy(m);
  release(par);
}

// W ranks with B sequences each and one GPU with W·B sequences see the same global batches over ten steps
// (dist_model_util.cuh, ten_steps_agree_with_one_gpu), the W ranks' MoE layers dispatched by `seams.moe`,
// their dense weights under ZeRO stage `zero`.
static void ten_steps_agree_with_one_gpu(const Seams& seams, int zero = 1) {
  ModelConfig c = dist_config();
  Parallel par = test_parallel(seams.head == "ring_dtp", zero);
  ASSERT_MODEL_FITS(c, par);
  const std::string moe_label = seams.moe + (seams.moe == "relay" ? std::string("_") + relay_mode_name(seams.relay_mode) : "");
  const std::string head_label = seams.head == "ring_dtp" ? "ring_dtp_" + seams.ring_dtp : seams.head;
  ten_steps_agree_with_one_gpu(c, par, seams, 1, moe_label + "_" + head_label + (zero == 3 ? "_zero3" : ""));
  release(par);
}

// The W ranks' seams with dispatcher `moe` in `mode` ("": its default) for model c at B sequences per
// rank, made as the trainer makes them from its flags (seams_from).
static Seams dispatcher_seams(const std::string& moe, const std::string& mode, const ModelConfig& c, int B) {
  TrainConfig t;
  t.gpus = test_world().size;
  t.batch = B;  // relay's auto mode chooses from B·T
  t.moe = moe;
  if (!mode.empty()) set_train_flag(t, find_choice(moe_choices(), moe)->mode_flag, mode);
  return seams_from(t, c);
}

// The toy model's (ten_steps_agree_with_one_gpu: B = 2), with small LLEP pieces and PipelinedLLEP chunks.
static Seams moe_seams(const std::string& moe, const std::string& mode = "") {
  Seams seams = dispatcher_seams(moe, mode, dist_config(), 2);
  seams.llep_min_rows = 4;  // small pieces, so that helpers compute some routes of the toy model
  seams.token_budget = 20;  // pllep: B·T = 74 tokens per rank in 4 chunks
  return seams;
}

// Every registered dispatcher that exchanges routes (config.hpp's moe_choices), once in each of its
// modes (seam_runs: ep, llep, pllep, relay_expert, relay_token, relay_auto).
class DistModelTenSteps : public testing::TestWithParam<SeamRun> {};

TEST_P(DistModelTenSteps, AgreeWithOneGpu) {
  REQUIRE_WORLD(2);
  ten_steps_agree_with_one_gpu(moe_seams(GetParam().choice, GetParam().mode));
}

INSTANTIATE_TEST_SUITE_P(Dispatchers, DistModelTenSteps, testing::ValuesIn(seam_runs(moe_choices(), SeamNeeds::ExpertGroup)),
                         [](const testing::TestParamInfo<SeamRun>& run) { return run.param.label; });

// --head ring_dtp (lm_head split over the W ranks) against one GPU's full head, in both ring branches and
// the fused schedule: B·T = 74 tokens per rank against shards of 33 and 34 rows (V = 67), in blocks of 16
// columns (fused: steps of ⌊74·16/(W·34)⌋ rows a rank at W = 2, i.e. 17).
static Seams ring_seams(const std::string& moves) {
  Seams seams = moe_seams("ep");
  seams.head = "ring_dtp";
  seams.ring_dtp = moves;
  seams.vocab_block = 16;
  return seams;
}

TEST(DistModel, TenStepsWithTheRingHeadAgreeWithOneGpuFullHead) {
  REQUIRE_WORLD(2);
  ten_steps_agree_with_one_gpu(ring_seams("weights"));
  ten_steps_agree_with_one_gpu(ring_seams("activations"));
  ten_steps_agree_with_one_gpu(ring_seams("fused"));
}

// --zero 3 (runtime/zero3.cuh): each rank keeps 1/W of the dense weights and all-gathers each forward
// group's as it runs, its gradients reduce-scattered after the group's backward. Against one GPU over ten
// steps (the routing pinned): with the full head (lm_head gathered with the final norm) and with the ring
// head (lm_head keeps its vocabulary split; the final norm alone is gathered for it), under --moe relay,
// and under --moe pllep, whose chunks' exchanges run beside the groups' gathers on another communicator.
TEST(DistModel, Zero3TenStepsAgreeWithOneGpu) {
  REQUIRE_WORLD(2);
  ten_steps_agree_with_one_gpu(moe_seams("ep"), 3);
  ten_steps_agree_with_one_gpu(ring_seams("fused"), 3);
  ten_steps_agree_with_one_gpu(moe_seams("relay", "token"), 3);
  ten_steps_agree_with_one_gpu(moe_seams("pllep"), 3);
}

// --optimizer offload_adamw and cpu_adamw at W ranks (each rank's ZeRO-1 shards in its own pinned
// memory) train like adamw, bit for bit, and resume adamw's state (tests/optimizer_training.cuh).
TEST(DistModel, OptimizersTrainAlikeAndResumeAcrossOptimizersAtWRanks) {
  REQUIRE_WORLD(2);
  Parallel par = test_parallel();
  char what[32];
  snprintf(what, sizeof what, "W=%d rank %d", par.world.size, par.world.rank);
  testutil::optimizers_train_alike(par, what);
  release(par);
}

// The model's state at W ranks — every rank's optimizer sections, step count and router biases —
// saved after 2 steps and restored into fresh models continues bit-identically to not stopping; with
// the full head and with lm_head split over the ranks (--head ring_dtp: each rank's sections hold its
// vocabulary interval); under --zero 3 (each rank's sections hold its shards of every forward group).
static void state_saved_and_restored_is_bit_identical(const Seams& seams, int zero = 1) {
  const Comm& world = test_world();
  Parallel par = test_parallel(seams.head == "ring_dtp", zero);
  ModelConfig c = dist_config();
  ASSERT_MODEL_FITS(c, par);
  TrainConfig t;
  t.lr = 2e-3f; t.warmup = 1; t.steps = 4; t.bias_update = 1e-2f;
  const int B = 2, T = c.seq_len, N = B * T;
  testutil::Rng rng;  // the harness gives every rank the same seed
  std::vector<std::vector<int>> xs, ys;
  for (int i = 0; i < t.steps; i++) {
    xs.emplace_back(); ys.emplace_back();
    random_tokens(N * world.size, c.vocab, rng, xs.back(), ys.back());
  }
  auto run = [&](Model& m, int from, int to, std::vector<float>& losses) {
    for (int step = from; step < to; step++) {
      losses.push_back(model_train_step(m, t, step, B, T, 1, [&](int* xb, int* yb) {
        std::copy_n(xs[step].data() + world.rank * N, N, xb);
        std::copy_n(ys[step].data() + world.rank * N, N, yb);
      }, nullptr));
    }
  };
  std::vector<float> straight_losses, first, resumed_losses;
  Model a = model_create(c, 21, par, 0, seams);
  run(a, 0, 4, straight_losses);
  StateSections straight = a.opt->save(a.stream);
  std::vector<float> straight_bias = a.router_bias;
  model_destroy(a);
  Model b = model_create(c, 21, par, 0, seams);
  run(b, 0, 2, first);
  StateSections saved = b.opt->save(b.stream);
  const long long saved_steps = b.opt->steps;
  std::vector<float> saved_bias = b.router_bias;
  model_destroy(b);
  Model r = model_create(c, 77, par, 0, seams);  // other initial weights: everything must come from the saved state
  r.opt->load(saved, saved_steps, r.stream);
  r.opt->write_weights(r.params, r.stream);
  all_gather_weights(r);
  r.router_bias = saved_bias;
  model_upload_router_bias(r);
  run(r, 2, 4, resumed_losses);
  EXPECT_EQ(first[0], straight_losses[0]);
  EXPECT_EQ(first[1], straight_losses[1]);
  EXPECT_EQ(resumed_losses[0], straight_losses[2]);
  EXPECT_EQ(resumed_losses[1], straight_losses[3]);
  StateSections resumed = r.opt->save(r.stream);
  EXPECT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < std::min(resumed.size(), straight.size()); i++) {
    EXPECT_EQ(resumed[i].second.size(), straight[i].second.size());
    if (resumed[i].second.size() == straight[i].second.size())
      EXPECT_EQ(0, memcmp(resumed[i].second.data(), straight[i].second.data(), straight[i].second.size() * sizeof(float)))
          << "rank " << world.rank << " optimizer section " << straight[i].first;
  }
  EXPECT_EQ(0, memcmp(r.router_bias.data(), straight_bias.data(), straight_bias.size() * sizeof(float)));
  model_destroy(r);
  release(par);
}

TEST(DistModel, StateSavedAndRestoredAtWRanksIsBitIdentical) {
  REQUIRE_WORLD(2);
  state_saved_and_restored_is_bit_identical(Seams());
  state_saved_and_restored_is_bit_identical(ring_seams("auto"));
  state_saved_and_restored_is_bit_identical(moe_seams("relay", "expert"));
  state_saved_and_restored_is_bit_identical(moe_seams("relay", "token"));
  state_saved_and_restored_is_bit_identical(Seams(), 3);
}

// Layer-level recomputation with expert parallelism: the backward reruns each layer's forward,
// router and token exchanges included, and the gradients of every rank are bit-identical to the
// pass that kept its activations. Rerunning is exact because every step of the forward is
// deterministic given the layer input (FP32 router, top-k ties to the lower index, a stable route
// sort, a plan that depends only on the counts, fixed-order combines); the cost is a second forward
// exchange per MoE layer (counts + rows out and back: 2·R·H·b bytes per rank) besides the backward's.
static void recompute_is_bit_identical(const Seams& seams, int zero = 1) {
  const Comm& world = test_world();
  Parallel par = test_parallel(false, zero);
  ModelConfig c = dist_config();
  ASSERT_MODEL_FITS(c, par);
  const int B = 2, T = c.seq_len, N = B * T;
  testutil::Rng rng;
  std::vector<float> master = random_master(c, rng);
  std::vector<int> x, y;
  random_tokens(N * world.size, c.vocab, rng, x, y);
  Model m = model_create(c, 1, par, 0, seams);
  model_set_master(m, master);
  expect_recompute_bit_identical(m, x.data() + world.rank * N, y.data() + world.rank * N, B, T, 1.f / (N * world.size),
                                 "rank " + std::to_string(world.rank) + " --moe " + seams.moe + " --zero " + std::to_string(zero));
  model_destroy(m);
  release(par);
}

// ep (the default at W > 1) reruns the layer's exchanges; relay's recomputed forward only plans (its
// backward recomputes every hop).
TEST(DistModel, RecomputeAtWRanksIsBitIdentical) {
  REQUIRE_WORLD(2);
  recompute_is_bit_identical(Seams());
  recompute_is_bit_identical(moe_seams("relay", "expert"));
  recompute_is_bit_identical(moe_seams("relay", "token"));
  recompute_is_bit_identical(Seams(), 3);  // --zero 3: each group gathered again for its recomputation
}

// SCO (--offload_budget) at W ranks with expert parallelism: each rank offloads its own boundaries
// while the recomputation's exchanges run; training is bit-identical to keeping them on the device and
// each rank's checkpoint peak falls with the budget (tests/sco_training.cuh).
TEST(DistModel, ScoAtWRanksIsBitIdenticalAndLowersTheCheckpointPeak) {
  REQUIRE_WORLD(2);
  Parallel par = test_parallel();
  char what[32];
  snprintf(what, sizeof what, "W=%d rank %d", par.world.size, par.world.rank);
  testutil::sco_trains_alike(par, what);
  release(par);
}

// The per-rank prediction (tests/memory_prediction.cuh) at W ranks for each dispatcher and the ring head:
// >= the pool's peak on every rank, and within 10 % where the routing attains the dispatcher's bound
// (hot:1/2 sends every route to experts 0 and 1, both on rank 0 with E/W >= 2: R_d = E_p·N·k there under --moe ep).
TEST(DistModel, MemoryPredictionHoldsForEachDispatcherAndHead) {
  REQUIRE_WORLD(2);
  ModelConfig c;
  c.vocab = 512; c.hidden = 256; c.heads = 4; c.layers = 4; c.experts = testutil::experts_for(std::max(8, 2 * test_world_size()), test_world_size());
  c.topk = 2; c.expert_dim = 256;
  c.n_dense = 1; c.dense_dim = 512; c.shared_expert = 1; c.seq_len = 256;
  const int B = 8, T = c.seq_len;
  for (const SeamRun& run : seam_runs(moe_choices(), SeamNeeds::ExpertGroup))  // every dispatcher in each mode
    for (const char* routing : {"hot:1/2", ""}) {
      testutil::PredictionCase pc;
      pc.name = "--moe " + run.label + (*routing ? std::string(", ") + routing : ", the router");
      pc.seams = dispatcher_seams(run.choice, run.mode, c, B);
      pc.seams.token_budget = 512;
      pc.routing = routing;
      Parallel par = test_parallel();
      const bool tight = run.label == "ep" && *routing && par.world.rank == 0;
      testutil::expect_prediction_holds(testutil::predict_and_measure(c, par, pc, B, T),
                                        "W=" + std::to_string(par.world.size) + " rank " + std::to_string(par.world.rank) +
                                            ", " + pc.name,
                                        tight);
      release(par);
    }
  {  // --zero 3: the gathered groups beside the dispatcher's bound in a layer's backward
    testutil::PredictionCase pc;
    pc.name = "--moe ep, hot:1/2, --zero 3";
    pc.seams = dispatcher_seams("ep", "", c, B);
    pc.routing = "hot:1/2";
    Parallel par = test_parallel(false, 3);
    testutil::expect_prediction_holds(testutil::predict_and_measure(c, par, pc, B, T),
                                      "W=" + std::to_string(par.world.size) + " rank " + std::to_string(par.world.rank) +
                                          ", " + pc.name,
                                      par.world.rank == 0);
    release(par);
  }
  testutil::PredictionCase ring;
  ring.name = "--head ring_dtp, hot:1/2";
  ring.seams.head = "ring_dtp";
  ring.seams.vocab_block = 128;
  ring.routing = "hot:1/2";
  Parallel par = test_parallel(true);
  testutil::expect_prediction_holds(testutil::predict_and_measure(c, par, ring, B, T),
                                    "W=" + std::to_string(par.world.size) + " rank " + std::to_string(par.world.rank) +
                                        ", " + ring.name,
                                    par.world.rank == 0);
  release(par);
}

// The GPU as the trainer's ranks plan with it (rank_memory.cuh device_now_agreed): the same capacity and the
// same outside on every rank, however much the pools of the ranks beside it hold. Where ranks share a GPU a
// rank's own measure counts its neighbours' pools as outside (the check below that this test can fail).
TEST(DistModel, RanksAgreeOnTheGpuWhateverTheirPoolsHold) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  const std::vector<bool> sharing = ranks_sharing_this_gpu(world);
  const DeviceNow before = device_now_agreed(world, sharing);
  const size_t held_bytes = (size_t)256 << 20;  // the odd ranks' pools grow by 256 MiB
  void* held = world.rank % 2 ? pool().alloc(held_bytes, Mem::Workspace, "test.held") : nullptr;
  const DeviceNow after = device_now_agreed(world, sharing);
  const long long MiB = 1 << 20;
  printf("[mem] rank %d of %d (%d on its GPU): outside %.1f MiB, then %.1f with the odd ranks' pools 256 MiB larger\n",
         world.rank, world.size, (int)std::count(sharing.begin(), sharing.end(), true), before.outside / (double)MiB,
         after.outside / (double)MiB);
  EXPECT_EQ(after.capacity, before.capacity);
  EXPECT_NEAR((double)after.outside, (double)before.outside, 16.0 * MiB) << "rank " << world.rank;
  const long long mine[2] = {after.capacity, after.outside};
  const std::vector<long long> all = all_gather_host(world, mine, 2, "test.agreed");
  for (int r = 0; r < world.size; r++)
    EXPECT_TRUE(all[2 * r] == mine[0] && all[2 * r + 1] == mine[1]) << "rank " << r << " plans with another GPU";
  bool odd_beside = false;
  for (int r = 1; r < world.size; r += 2) odd_beside |= sharing[r] && r != world.rank;
  if (odd_beside)
    EXPECT_GE(device_now().outside, after.outside + (long long)held_bytes - 16 * MiB)
        << "rank " << world.rank << " alone counts its neighbours' pools";
  max_over_ranks(world, 0);  // every rank has measured before the pools shrink
  if (held) pool().free(held);
}

TEST(DistModel, KeptAttentionAtWRanksTrainsBitIdenticallyToFullRecomputation) {
  REQUIRE_WORLD(2);
  Parallel par = test_parallel();
  char what[32];
  snprintf(what, sizeof what, "W=%d rank %d", par.world.size, par.world.rank);
  testutil::attention_keep_trains_alike(par, testutil::recompute_config(par), what);
  release(par);
}

// ---------------------------------------------------------------------------------------------
// A rank that leaves in the middle of a layer's exchange

// The --moe ep dispatcher of a rank that leaves: at its `calls`-th forward it enqueues the layer's
// exchanges (counts, rows out, rows back) and the process ends at once, exit status 0, with its NCCL
// work still in flight. That is how a rank on another node looks to the others when its machine
// fails: this node's launcher sees nothing wrong, and only the others' bounded waits can end the job.
namespace {
struct LeavingDispatcher : MoEDispatcher {
  std::unique_ptr<MoEDispatcher> inner;
  int calls_left;
  LeavingDispatcher(std::unique_ptr<MoEDispatcher> d, int calls)
      : MoEDispatcher(d->H, d->I, d->E, d->k), inner(std::move(d)), calls_left(calls) {}
  std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                         const floatX* W13, const floatX* W2, int N, cudaStream_t stream) override {
    std::unique_ptr<DispatchSaved> saved = inner->forward(out, x, topk_idx, topk_w, W13, W2, N, stream);
    if (--calls_left == 0) {
      printf("rank 1 leaves during a MoE layer's exchange\n");
      fflush(stdout);
      _exit(0);
    }
    return saved;
  }
  void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const DispatchSaved& saved,
                const floatX* x, const int* topk_idx, const float* topk_w, const floatX* W13, const floatX* W2,
                cudaStream_t stream) override {
    inner->backward(dx, dtopk_w, dW13, dW2, dout, saved, x, topk_idx, topk_w, W13, W2, stream);
  }
  DispatchBound live_bound(int N) const override { return inner->live_bound(N); }
};

}  // namespace

// After one whole pass on both ranks (as in training, where a rank fails after its first step: every
// kernel has run once, so CUDA's lazy module loading, whose first launch of a kernel may wait for the
// whole device, is behind us), rank 1 leaves during the last MoE layer's forward exchange of the
// second pass; rank 0 goes on (its next waits: the backward's, the loss) and must fail in one of them.
TEST(DistScenario, DISABLED_RankLeavesDuringAllToAll) {
  const Comm& world = test_world();
  Parallel par = test_parallel();
  const ModelConfig c = dist_config();
  const int B = 2, T = c.seq_len, N = B * T;
  testutil::Rng rng;
  std::vector<int> x, y;
  random_tokens(N, c.vocab, rng, x, y);
  Model m = model_create(c, 1, par);
  PassOptions o;
  o.dloss = 1.f / (N * world.size);
  model_pass(m, x.data(), y.data(), B, T, o);
  if (world.rank == 1) m.moe = std::make_unique<LeavingDispatcher>(std::move(m.moe), c.layers - c.n_dense);
  model_pass(m, x.data(), y.data(), B, T, o);
  ADD_FAILURE() << "rank " << world.rank << " finished a pass whose partner left";
  model_destroy(m);
  release(par);
}

TEST(CommFailure, RankLeavingDuringAllToAllStopsTheOthersWithinTheTimeout) {
  REQUIRE_WORLD(2);
  if (test_rank() != 0) return others_wait_for_rank_zero();  // rank 0 runs the sub-job
  JobResult job = run_scenario_job("RankLeavesDuringAllToAll", 2);
  EXPECT_NE(job.exit_code, 0);
  EXPECT_LT(job.seconds, 60) << "FLATMOE_COMM_TIMEOUT_S=10 in the sub-job";
  expect_contains(job, "rank 1 leaves during a MoE layer's exchange");
  // Over NVLink or shared memory rank 0's kernels wait for the rank that left until the bounded wait
  // times out; over NCCL's sockets (ranks sharing a GPU, or on other hosts) NCCL sees the connection
  // close and reports the lost peer first. Either way rank 0 stops within the timeout, naming why.
  const bool timed_out = job.output.find("timed out") != std::string::npos;
  const bool peer_lost = job.output.find("remote process exited or there was a network error") != std::string::npos;
  EXPECT_TRUE(timed_out || peer_lost) << "expected a timeout or NCCL's lost peer in the job's output:\n" << job.output;
  expect_contains(job, "flatmoe: rank 0: aborting 3 communicator(s): world, ep, expert_replicas");
  expect_contains(job, "flatmoe launch: rank 0 (pid ");
}
