// The whole GPU model (model.cuh) against the CPU reference model (ref/model.hpp) on identical
// weights and tokens: first-step loss and every parameter gradient, ten training steps,
// recomputation, pool accounting, the model's state saved and restored bit for bit, the optimizer
// beside the next forward (--overlap_update) bit for bit, passes launched as CUDA graphs
// (--cuda_graph) bit for bit, and the trainer
// binary resuming from a checkpoint folder bit for bit, and recording and replaying its routing, at
// W = 1 and W = 2.
#include <sys/stat.h>
#include <unistd.h>
#include <chrono>
#include <sstream>
#include <thread>
#include "../model.cuh"
#include "../checkpoint.hpp"
#include "../data/dataloader.hpp"
#include "../data/routing_trace.hpp"
#include "../data/shards.hpp"
#include "../ref/model.hpp"
#include "gpu_util.cuh"
#include "model_util.cuh"
#include "optimizer_training.cuh"

namespace {

// A test's folder for what it writes (trainer runs, timelines): one per build (build/test-out-NAME-fp32,
// -bf16), so that the two test binaries may run at once. fresh_test_dir empties it of what an earlier
// run of the test left.
std::string test_dir(const std::string& name) { return "build/test-out-" + name + (BUILD_BF16 ? "-bf16" : "-fp32"); }

std::string fresh_test_dir(const std::string& name) {
  const std::string dir = test_dir(name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

using testutil::as_seen_by_gpu;
using testutil::random_master;
using testutil::random_tokens;

// Configurations covering every feature of the model, at sizes that are multiples of nothing:
//   0 softmax scores, renormalised;  1 sigmoid, renormalised, a dense layer and a shared expert;
//   2 softmax, not renormalised;     3 sigmoid, not renormalised, a shared expert
ModelConfig config_variant(int variant) {
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40;  // init_std: the trainer's (model_util.cuh)
  if (variant == 0 || variant == 2) {
    c.layers = 2; c.experts = 5; c.topk = 2; c.score_fn = ROUTER_SOFTMAX;
  } else {
    c.layers = 3; c.experts = 7; c.topk = 3; c.score_fn = ROUTER_SIGMOID; c.n_dense = variant == 1 ? 1 : 0;
    c.dense_dim = 72; c.shared_expert = 1;
  }
  c.renorm = variant < 2 ? 1 : 0;
  return c;
}

// A pass's gradients (its fp32 sum: in the BF16 build the bf16 gradients, folded exactly).
std::vector<float> download_grads(const Model& m) { return testutil::download_vec(m.main_grads, m.num_params); }

// One of the optimizer's state sections ("master", "adam_m", "adam_v": this rank's shard).
std::vector<float> optimizer_section(Model& m, const std::string& name) {
  for (auto& sec : m.opt->save(m.stream))
    if (sec.first == name) return sec.second;
  ADD_FAILURE() << "no optimizer section " << name;
  return {};
}

// Normwise error of one tensor of a flat GPU buffer against the reference's flat buffer.
double tensor_err(const std::vector<float>& gpu, const std::vector<double>& ref, size_t off, size_t n) {
  double num = 0, den = 0;
  for (size_t i = off; i < off + n; i++) {
    num += (gpu[i] - ref[i]) * (gpu[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// A model of random weights (seed `seed`) and B sequences of random tokens x, y, after one forward
// pass over them: the pass sizes the model's own buffers (the trivial routing of dense layers) for
// those tokens, so that a measured pass after it allocates only what it uses.
Model warmed_up_model(const ModelConfig& c, uint64_t seed, int B, std::vector<int>& x, std::vector<int>& y) {
  testutil::Rng rng;
  random_tokens(B * c.seq_len, c.vocab, rng, x, y);
  Model m = model_create(c, seed);
  model_set_master(m, random_master(c, rng));
  PassOptions warmup;
  warmup.backward = false;
  model_pass(m, x.data(), y.data(), B, c.seq_len, warmup);
  return m;
}

void first_step_matches_reference(int variant, const Seams& seams = Seams(), const std::string& label = "") {
  ModelConfig c = config_variant(variant);
  testutil::Rng rng;
  const int B = 2, T = c.seq_len, N = B * T;
  std::vector<float> master = random_master(c, rng);
  std::vector<int> x, y;
  random_tokens(N, c.vocab, rng, x, y);

  Model m = model_create(c, 1, Parallel(), 0, seams);
  model_set_master(m, master);
  for (float& b : m.router_bias) b = (float)rng.normal(0.02);
  model_upload_router_bias(m);
  model_zero_grads(m);
  std::vector<std::vector<int>> routes = model_routes(m, x.data(), B, T);
  PassOptions o;
  o.dloss = 1.f / N;
  float loss = model_pass(m, x.data(), y.data(), B, T, o);
  std::vector<float> grads = download_grads(m);

  ref::Model<double> r(c, as_seen_by_gpu(master));
  r.router_bias = m.router_bias;
  r.forced_routes = &routes;
  double ref_loss = ref_pass(r, x, y, B, T, true, 1.0 / N);

  char what[64];
  snprintf(what, sizeof what, "model_v%d%s_first_step", variant, label.c_str());
  EXPECT_REL(what, "loss", std::fabs(loss - ref_loss) / std::fabs(ref_loss), MODEL_TOL);
  for (size_t i = 0; i < m.specs.size(); i++)
    EXPECT_REL(what, ("d" + m.specs[i].name).c_str(), tensor_err(grads, r.grads, m.offsets[i], m.specs[i].numel()), MODEL_TOL);
  // The router computes in FP32 in both builds, but in BF16 its input (ln2) carries the bf16
  // activations' error (~1e-2 relative after a few layers), so choices whose margin is below about
  // that may differ from the double reference's; they are counted and reported. In FP32 a choice that
  // differs (in its set or its order) where no two of the reference's k + 1 largest keys are within
  // 1e-3 of each other is a bug.
  printf("[route] %s: %lld top-k choices differ from the reference's (no gap under 1e-3 in its k + 1 largest keys)\n",
         what, r.route_disagreements);
#if !defined(FLATMOE_BF16)
  EXPECT_EQ(r.route_disagreements, 0) << "GPU and reference chose different experts with a clear margin";
#endif
  model_destroy(m);
}

}  // namespace

// The two halves of each seam's registry hold the same names in the same order: every choice that
// config.hpp registers has its factory in seams.cuh, and no factory is left without a choice. Host code
// only: it runs with or without a GPU.
TEST(SeamFactories, EveryRegisteredChoiceHasItsFactoryAndNoOther) {
  auto names_of = [](const auto& factories) {
    std::vector<std::string> names;
    for (const auto& f : factories) names.push_back(f.name);
    return names;
  };
  EXPECT_EQ(names_of(dispatcher_factories()), choice_names(moe_choices()));
  EXPECT_EQ(names_of(head_factories()), choice_names(head_choices()));
  EXPECT_EQ(names_of(optimizer_factories()), choice_names(optimizer_choices()));
}

TEST(GpuModel, FirstStepLossAndEveryGradientMatchReference) {
  REQUIRE_GPU();
  first_step_matches_reference(0);
}

TEST(GpuModel, FirstStepDenseLayersSharedExpertSigmoidRouter) {
  REQUIRE_GPU();
  first_step_matches_reference(1);
}

TEST(GpuModel, FirstStepSoftmaxRouterWithoutRenormalisation) {
  REQUIRE_GPU();
  first_step_matches_reference(2);
}

TEST(GpuModel, FirstStepSigmoidRouterWithoutRenormalisation) {
  REQUIRE_GPU();
  first_step_matches_reference(3);
}

// The chunked head (the full head over row blocks, its dlogits formed block by block, no [N,V]) in the
// whole model: the same first step as the full head's against the reference, in blocks of a few rows.
TEST(GpuModel, FirstStepWithTheChunkedHeadMatchesReference) {
  REQUIRE_GPU();
  Seams seams;
  seams.head = "chunked";
  seams.vocab_block = 16;
  first_step_matches_reference(0, seams, "_chunked_head");
}

// Ten optimizer steps with gradient accumulation, clipping, weight decay and the router bias
// update: the GPU's losses follow the reference trainer's.
TEST(GpuModel, TenTrainingStepsMatchReferenceTrainer) {
  REQUIRE_GPU();
  ModelConfig c = config_variant(1);
  TrainConfig t;
  t.lr = 3e-3f; t.warmup = 2; t.steps = 10; t.grad_clip = 0.5f; t.weight_decay = 0.1f; t.bias_update = 1e-2f;
  const int B = 2, T = c.seq_len, N = B * T, accum = 2;
  testutil::Rng rng;
  std::vector<float> master = random_master(c, rng);
  Model m = model_create(c, 1);
  model_set_master(m, master);
  ref::Model<double> r(c, as_seen_by_gpu(master));
  std::vector<std::vector<int>> routes;
  double worst = 0;
  for (int step = 0; step < t.steps; step++) {
    model_zero_grads(m);
    ref_zero_grads(r);
    double gpu_loss = 0, ref_loss = 0;
    for (int micro = 0; micro < accum; micro++) {
      std::vector<int> x, y;
      random_tokens(N, c.vocab, rng, x, y);
      routes = model_routes(m, x.data(), B, T);
      PassOptions o;
      o.dloss = 1.f / (N * accum);
      gpu_loss += model_pass(m, x.data(), y.data(), B, T, o) / accum;
      r.forced_routes = &routes;
      ref_loss += ref_pass(r, x, y, B, T, true, 1.0 / (N * accum)) / accum;
    }
    float lr = lr_at(t, step);
    float gpu_norm = model_update(m, t, lr);
    double ref_norm = ref_update(r, t, (double)lr);
    double e = std::fabs(gpu_loss - ref_loss) / ref_loss;
    worst = std::max(worst, e);
    printf("[train] step %d loss gpu %.6f ref %.6f rel %.2e | grad norm gpu %.5f ref %.5f\n", step + 1, gpu_loss,
           ref_loss, e, gpu_norm, ref_norm);
    // the loads the bias update read: counted on the device over both micro-batches, one download per step
    EXPECT_EQ(m.step_loads, r.step_loads) << "per-expert loads differ at step " << step + 1;
    EXPECT_EQ(m.router_bias, r.router_bias) << "router bias updates diverged at step " << step + 1;
  }
  EXPECT_REL("model_ten_steps", "max loss", worst, MODEL_TOL);
  std::vector<float> gpu_master = optimizer_section(m, "master");
  EXPECT_REL("model_ten_steps", "master weights", tensor_err(gpu_master, r.params, 0, m.num_params), MODEL_TOL);
  printf("[route] model_ten_steps: %lld top-k choices differ from the reference's (no gap under 1e-3 in its k + 1 "
         "largest keys)\n", r.route_disagreements);
#if !defined(FLATMOE_BF16)
  EXPECT_EQ(r.route_disagreements, 0);  // BF16: reported only (see first_step_matches_reference)
#endif
  model_destroy(m);
}

// --optimizer offload_adamw and cpu_adamw train like adamw, bit for bit, and resume adamw's state
// (tests/optimizer_training.cuh).
TEST(GpuModel, OptimizersTrainAlikeAndResumeAcrossOptimizers) {
  REQUIRE_GPU();
  testutil::optimizers_train_alike(Parallel(), "one GPU");
}

// One pass per step: adamw reads the pass's gradients without the fold (BF16), the others fold them.
TEST(GpuModel, OptimizersTrainAlikeOnePassPerStep) {
  REQUIRE_GPU();
  testutil::optimizers_train_alike(Parallel(), "one GPU, one pass per step", 1);
}

// Layer-level recomputation replays the forward exactly: identical gradients, bit for bit, with
// fewer activation bytes live at the peak; the pool returns to where it started.
TEST(GpuModel, RecomputeIsBitIdenticalAndLowersPeak) {
  REQUIRE_GPU();
  ModelConfig c = config_variant(1);
  c.layers = 4;
  const int B = 4, T = c.seq_len, N = B * T;
  std::vector<int> x, y;
  Model m = warmed_up_model(c, 3, B, x, y);
  size_t peak[2];
  std::vector<float> grads[2];
  float loss[2];
  for (int recompute = 0; recompute < 2; recompute++) {
    model_zero_grads(m);
    cudaCheck(cudaDeviceSynchronize(), "test", "sync");
    size_t live_before = pool().live_total();
    pool().reset_peak();
    PassOptions o;
    o.dloss = 1.f / N;
    o.recompute = recompute == 1;
    loss[recompute] = model_pass(m, x.data(), y.data(), B, T, o);
    peak[recompute] = pool().peak(Mem::Activations);
    grads[recompute] = download_grads(m);
    EXPECT_EQ(pool().live_total(), live_before) << "the pass leaked pool memory (recompute=" << recompute << ")";
  }
  printf("[mem] activations peak: %.3f MiB stored, %.3f MiB recomputed\n", peak[0] / 1048576.0, peak[1] / 1048576.0);
  EXPECT_EQ(loss[0], loss[1]);
  EXPECT_EQ(0, memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)))
      << "recomputation must reproduce the gradients bit for bit";
  EXPECT_LT(peak[1], peak[0]);
  model_destroy(m);
}

// Attention in head groups (--attention_groups G; model.cuh's attention_groups_forward/_backward): the
// heads taken nh/G at a time, q, k, v rebuilt per group in the backward. The first step against the
// reference, one head at a time, on the plain variant and on the one with a dense layer and shared experts.
TEST(GpuModel, FirstStepWithAttentionInHeadGroupsMatchesReference) {
  REQUIRE_GPU();
  Seams seams;
  seams.attention_groups = 2;  // config_variant's two heads: one a group
  first_step_matches_reference(0, seams, "_head_groups");
  first_step_matches_reference(1, seams, "_head_groups");
}

// In head groups on 4 heads of 32 (G = 2 and 4), with and without recomputation: the recomputed pass
// reproduces the stored one bit for bit (both take the groups the same way), every gradient is within the
// model tolerance of the whole-heads pass's (the q, k, v GEMMs and the gradients' sums over the groups
// round otherwise), and the pool's peak under recomputation is below the whole heads' (attention's backward
// is the peak at these sizes: 12 N·H elements whole, about 5 + 8/G in groups).
TEST(GpuModel, AttentionInHeadGroupsRecomputesBitIdenticallyAndLowersThePeak) {
  REQUIRE_GPU();
  ModelConfig c = config_variant(0);
  c.hidden = 128; c.heads = 4; c.layers = 3; c.expert_dim = 16;
  const int B = 4, T = c.seq_len, N = B * T;
  testutil::Rng rng;
  const std::vector<float> master = random_master(c, rng);
  std::vector<int> x, y;
  random_tokens(N, c.vocab, rng, x, y);
  std::vector<float> whole_grads;
  size_t whole_peak = 0;
  for (int groups : {1, 2, 4}) {
    Seams seams;
    seams.attention_groups = groups;
    Model m = model_create(c, 1, Parallel(), 0, seams);
    model_set_master(m, master);
    PassOptions warmup;
    warmup.backward = false;
    model_pass(m, x.data(), y.data(), B, T, warmup);  // sizes the model's own buffers
    float loss[2];
    std::vector<float> grads[2];
    size_t peak = 0;
    for (int recompute = 0; recompute < 2; recompute++) {
      model_zero_grads(m);
      cudaCheck(cudaDeviceSynchronize(), "test", "sync");
      const size_t live_before = pool().live_total();
      pool().reset_peak();
      PassOptions o;
      o.dloss = 1.f / N;
      o.recompute = recompute == 1;
      loss[recompute] = model_pass(m, x.data(), y.data(), B, T, o);
      grads[recompute] = download_grads(m);
      if (recompute) peak = pool().peak() - live_before;
      EXPECT_EQ(pool().live_total(), live_before) << "G=" << groups << " recompute=" << recompute << ": the pass leaked";
    }
    printf("[mem] attention in %d head group(s): pass peak under recomputation %.3f MiB\n", groups, peak / 1048576.0);
    EXPECT_EQ(loss[0], loss[1]) << "G=" << groups;
    EXPECT_EQ(0, memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)))
        << "G=" << groups << ": recomputation must reproduce the gradients bit for bit";
    if (groups == 1) whole_grads = grads[0];
    const std::vector<double> whole(whole_grads.begin(), whole_grads.end());
    char what[64];
    snprintf(what, sizeof what, "head_groups_G%d_vs_whole", groups);
    for (size_t i = 0; groups > 1 && i < m.specs.size(); i++)
      EXPECT_REL(what, ("d" + m.specs[i].name).c_str(), tensor_err(grads[0], whole, m.offsets[i], m.specs[i].numel()),
                 MODEL_TOL);
    if (groups == 1) whole_peak = peak;
    else EXPECT_LT(peak, whole_peak) << "G=" << groups << ": the peak must fall below the whole heads'";
    model_destroy(m);
  }
}

// --moe local --token_budget c (ops/moe.cuh's LocalDispatcher): the routed experts in chunks of at most c
// tokens, nothing kept from the forward, each chunk recomputed in the backward (and the dense layers' FFN
// and the shared expert in the same chunks, model.cuh's dense_ffn_dispatcher). With and without
// recomputation, on the plain and the dense-layer + shared-expert variants (B·T = 74 tokens, c = 16: 5
// chunks, of 15 tokens but the last of 14): a pass's loss and every gradient, and four training steps' losses, within the model
// tolerance of the unchunked run's (the chunks' expert GEMMs and weight-gradient sums round otherwise;
// ops/moe.cuh), and the pass's dispatch peak (Dispatch + ExpertIntermediates) below the unchunked one's.
TEST(GpuModel, LocalTokenBudgetTrainsAsTheUnchunkedLayer) {
  REQUIRE_GPU();
  struct Run {
    float loss = 0;
    std::vector<float> grads;
    size_t dispatch_peak = 0;
    std::vector<float> losses;
    std::vector<ParamSpec> specs;
    std::vector<size_t> offsets;  // each tensor's place in the gradients
  };
  for (int variant : {0, 1})
    for (int recompute : {0, 1}) {
      const ModelConfig c = config_variant(variant);
      const int B = 2, T = c.seq_len, N = B * T, steps = 4;
      testutil::Rng rng;
      const std::vector<float> master = random_master(c, rng);
      std::vector<std::vector<int>> xs(steps), ys(steps);
      for (int i = 0; i < steps; i++) random_tokens(N, c.vocab, rng, xs[i], ys[i]);
      auto train = [&](int token_budget) {
        TrainConfig t;
        t.lr = 2e-3f; t.warmup = 1; t.steps = steps; t.recompute = recompute; t.token_budget = token_budget;
        cudaStream_t stream = stream_create("test.compute", StreamPriority::Compute);
        Model m = model_create(c, 11, Parallel(), stream, seams_from(t, c));
        model_set_master(m, master);
        Run r;
        model_zero_grads(m);
        cudaCheck(cudaDeviceSynchronize(), "test", "sync");
        const size_t dispatch_before = pool().live(Mem::Dispatch) + pool().live(Mem::ExpertIntermediates);
        pool().reset_peak();
        PassOptions o;
        o.dloss = 1.f / N;
        o.recompute = recompute == 1;
        r.loss = model_pass(m, xs[0].data(), ys[0].data(), B, T, o);
        r.dispatch_peak = pool().peak(Mem::Dispatch) + pool().peak(Mem::ExpertIntermediates) - dispatch_before;
        r.grads = download_grads(m);
        r.specs = m.specs;
        r.offsets = m.offsets;
        for (int step = 0; step < steps; step++)
          r.losses.push_back(model_train_step(m, t, step, B, T, 1, [&](int* xb, int* yb) {
            std::copy(xs[step].begin(), xs[step].end(), xb);
            std::copy(ys[step].begin(), ys[step].end(), yb);
          }, nullptr));
        model_join_update(m);
        model_destroy(m);
        cudaCheck(cudaStreamDestroy(stream), "test", "stream");
        return r;
      };
      const Run whole = train(0), chunked = train(16);
      char what[96];
      snprintf(what, sizeof what, "model_v%d_recompute%d_token_budget16", variant, recompute);
      EXPECT_REL(what, "loss", std::fabs(chunked.loss - whole.loss) / std::fabs(whole.loss), MODEL_TOL);
      const std::vector<double> whole_grads(whole.grads.begin(), whole.grads.end());
      for (size_t i = 0; i < whole.specs.size(); i++)
        EXPECT_REL(what, ("d" + whole.specs[i].name).c_str(),
                   tensor_err(chunked.grads, whole_grads, whole.offsets[i], whole.specs[i].numel()), MODEL_TOL);
      for (int step = 0; step < steps; step++)
        EXPECT_REL(what, ("loss at step " + std::to_string(step)).c_str(),
                   std::fabs(chunked.losses[step] - whole.losses[step]) / std::fabs(whole.losses[step]), MODEL_TOL);
      EXPECT_LT(chunked.dispatch_peak, whole.dispatch_peak) << what;
      printf("[mem] %s: dispatch peak %.1f KiB in chunks, %.1f KiB unchunked\n", what, chunked.dispatch_peak / 1024.0,
             whole.dispatch_peak / 1024.0);
    }
}

// One GPU's MoE layers do not wait for the host in the BF16 build (the per-expert counts stay on the
// device, ops/moe.cuh): a pass — forward and backward, with or without recomputation — over 4 MoE
// layers waits for the GPU exactly as often as one over 2, for the pass's uploads and its loss only.
// In the FP32 build the grouped GEMMs take the counts from the host: one download per MoE layer's
// forward and one more per recomputed layer, each two waits (runtime/stream.cuh's copy_to_host waits
// for the stream before its copy and for the copy).
TEST(GpuModel, MoELayersDoNotWaitForTheHost) {
  REQUIRE_GPU();
  long long waits[2][2];  // [2 or 4 layers][recompute]
  for (int i = 0; i < 2; i++) {
    ModelConfig c = config_variant(0);
    c.layers = 2 + 2 * i;
    const int B = 2, T = c.seq_len, N = B * T;
    std::vector<int> x, y;
    Model m = warmed_up_model(c, 1, B, x, y);
    for (int recompute = 0; recompute < 2; recompute++) {
      model_zero_grads(m);
      PassOptions o;
      o.dloss = 1.f / N;
      o.recompute = recompute == 1;
      const long long before = host_waits();
      model_pass(m, x.data(), y.data(), B, T, o);
      waits[i][recompute] = host_waits() - before;
    }
    model_destroy(m);
  }
  printf("[waits] one pass over 2 / 4 MoE layers: %lld / %lld host waits (stored), %lld / %lld (recomputed)\n",
         waits[0][0], waits[1][0], waits[0][1], waits[1][1]);
#if defined(FLATMOE_BF16)
  EXPECT_EQ(waits[1][0], waits[0][0]) << "a MoE layer waited for the host";
  EXPECT_EQ(waits[1][1], waits[0][1]) << "a recomputed MoE layer waited for the host";
#else
  EXPECT_EQ(waits[1][0] - waits[0][0], 2 * 2) << "one download per MoE layer's forward";
  EXPECT_EQ(waits[1][1] - waits[0][1], 2 * 4) << "one download per MoE layer's forward and one per recomputation";
#endif
}

// The pool's peak is exactly the largest live total that its own timeline records.
TEST(GpuModel, PoolPeakEqualsLargestLiveTotalInTimeline) {
  REQUIRE_GPU();
  ModelConfig c = config_variant(0);
  const int B = 2, T = c.seq_len, N = B * T;
  testutil::Rng rng;
  std::vector<int> x, y;
  random_tokens(N, c.vocab, rng, x, y);
  Model m = model_create(c, 5);
  model_zero_grads(m);
  pool().reset_peak();
  pool().clear_timeline();
  pool().set_timeline(true);
  size_t start = pool().live_total();
  PassOptions o;
  o.dloss = 1.f / N;
  model_pass(m, x.data(), y.data(), B, T, o);
  pool().set_timeline(false);
  size_t largest = start, live = start;
  for (const PoolEvent& e : pool().events()) {
    if (e.action == 'a') live += e.bytes;
    if (e.action == 'f') live -= e.bytes;
    EXPECT_EQ(live, e.live_after);
    largest = std::max(largest, live);
  }
  EXPECT_EQ(pool().peak(), largest);
  EXPECT_EQ(live, start);
  EXPECT_GT(pool().peak(Mem::Logits), (size_t)N * c.vocab * sizeof(floatX) - 1);
  // the CSV's per-category columns add up to the live total on every row
  const std::string csv = fresh_test_dir("pool") + "/timeline.csv";
  ASSERT_TRUE(pool().write_csv(csv.c_str()));
  FILE* f = fopen(csv.c_str(), "r");
  ASSERT_NE(f, nullptr);
  char line[4096];
  int rows = 0;
  ASSERT_NE(fgets(line, sizeof line, f), nullptr) << "the timeline has a header";
  while (fgets(line, sizeof line, f)) {
    std::vector<std::string> cols;
    std::string cell;
    for (char* p = line; *p && *p != '\n'; p++) {
      if (*p == ',') { cols.push_back(cell); cell.clear(); } else cell += *p;
    }
    cols.push_back(cell);
    ASSERT_EQ(cols.size(), 6u + (size_t)Pool::NCAT);
    long long sum = 0;
    for (int i = 0; i < Pool::NCAT; i++) sum += std::stoll(cols[6 + i]);
    EXPECT_EQ(sum, std::stoll(cols[5])) << "row " << rows;
    rows++;
  }
  fclose(f);
  EXPECT_EQ(rows, (int)pool().events().size());
  pool().clear_timeline();
  model_destroy(m);
}

// The model's whole state — the optimizer's sections (master weights, m, v), its step count and the
// router biases — saved after 3 steps and restored into a fresh model continues exactly like the
// model that never stopped: the same losses, and every state section bit for bit after 6 steps.
TEST(GpuModel, StateSavedAndRestoredContinuesBitIdentically) {
  REQUIRE_GPU();
  ModelConfig c = config_variant(1);
  TrainConfig t;
  t.lr = 2e-3f; t.warmup = 1; t.steps = 6; t.bias_update = 1e-2f;
  const int B = 2, T = c.seq_len, N = B * T, accum = 2;
  testutil::Rng rng;
  std::vector<std::vector<int>> xs(t.steps * accum), ys(t.steps * accum);
  for (size_t i = 0; i < xs.size(); i++) random_tokens(N, c.vocab, rng, xs[i], ys[i]);
  auto run = [&](Model& m, int from, int to, std::vector<float>& losses) {
    for (int step = from; step < to; step++) {
      int micro = step * accum;
      losses.push_back(model_train_step(m, t, step, B, T, accum, [&](int* xb, int* yb) {
        std::copy(xs[micro].begin(), xs[micro].end(), xb);
        std::copy(ys[micro].begin(), ys[micro].end(), yb);
        micro++;
      }, nullptr));
    }
  };
  std::vector<float> straight_losses, first_half, resumed_losses;
  Model a = model_create(c, 11);
  run(a, 0, 6, straight_losses);
  StateSections straight = a.opt->save(a.stream);
  std::vector<float> straight_bias = a.router_bias;
  model_destroy(a);

  Model b = model_create(c, 11);
  run(b, 0, 3, first_half);
  StateSections saved = b.opt->save(b.stream);
  const long long saved_steps = b.opt->steps;
  std::vector<float> saved_bias = b.router_bias;
  model_destroy(b);

  Model r = model_create(c, 99);  // other initial weights: everything must come from the saved state
  r.opt->load(saved, saved_steps, r.stream);
  r.opt->write_weights(r.params, r.stream);
  r.router_bias = saved_bias;
  model_upload_router_bias(r);
  run(r, 3, 6, resumed_losses);
  for (int i = 0; i < 3; i++) {
    EXPECT_EQ(first_half[i], straight_losses[i]);
    EXPECT_EQ(resumed_losses[i], straight_losses[3 + i]) << "step " << 4 + i;
  }
  StateSections resumed = r.opt->save(r.stream);
  ASSERT_EQ(resumed.size(), straight.size());
  for (size_t i = 0; i < straight.size(); i++) {
    EXPECT_EQ(resumed[i].first, straight[i].first);
    ASSERT_EQ(resumed[i].second.size(), straight[i].second.size());
    EXPECT_EQ(0, memcmp(resumed[i].second.data(), straight[i].second.data(), straight[i].second.size() * sizeof(float)))
        << "optimizer section " << straight[i].first;
  }
  EXPECT_EQ(r.opt->steps, 6);
  EXPECT_EQ(0, memcmp(r.router_bias.data(), straight_bias.data(), straight_bias.size() * sizeof(float)));
  model_destroy(r);
}

// --wgrad_stream (Model::wgrad, runtime/side_stream.cuh): each layer's weight gradients on a stream of
// their own, beside its input gradients, give the compute stream's bits (losses, weights, optimizer
// state) and the same pool peak per step (the same buffers held as long), with and without
// recomputation, on a model with a dense FFN layer and a shared expert and on one without. At each
// step's start a host flag holds the side stream for 20 ms, so that the compute stream runs as far
// ahead as the joins let it: without a join it would change d_x, or hand a held buffer to the next
// kernel, under a weight gradient that has not run yet.
TEST(GpuModel, WeightGradientStreamIsBitIdentical) {
  REQUIRE_GPU();
  struct Run {
    std::vector<float> losses;
    std::vector<size_t> step_peaks;  // the pool's peak per step, above what was live before it
    StateSections state;
    std::vector<floatX> params;
  };
  for (int variant : {0, 1})
    for (int recompute : {0, 1}) {
      const ModelConfig c = config_variant(variant);
      const int B = 2, T = c.seq_len, N = B * T, steps = 4;
      testutil::Rng rng;
      std::vector<std::vector<int>> xs(steps), ys(steps);
      for (int i = 0; i < steps; i++) random_tokens(N, c.vocab, rng, xs[i], ys[i]);
      auto train = [&](int side) {
        TrainConfig t;
        t.lr = 2e-3f; t.warmup = 1; t.steps = steps; t.recompute = recompute; t.wgrad_stream = side;
        cudaStream_t stream = stream_create("test.compute", StreamPriority::Compute);
        Model m = model_create(c, 11, Parallel(), stream, seams_from(t, c));
        EXPECT_EQ(m.wgrad->on(), side == 1);
        Run r;
        std::vector<testutil::HostFlag> flags(steps);
        for (int step = 0; step < steps; step++) {
          std::thread release;
          if (side) {
            for (int lane = 0; lane < SideStream::LANES; lane++)
              testutil::wait_for_host_kernel<<<1, 1, 0, m.wgrad->stream(lane)>>>(nullptr, flags[step].device, 0);
            launchCheck("test.hold_weight_gradients", "step=%d", step);
            release = std::thread([flag = &flags[step]] {
              std::this_thread::sleep_for(std::chrono::milliseconds(20));
              flag->set();
            });
          }
          const size_t live_before = pool().live_total();
          pool().reset_peak();
          r.losses.push_back(model_train_step(m, t, step, B, T, 1, [&](int* xb, int* yb) {
            std::copy(xs[step].begin(), xs[step].end(), xb);
            std::copy(ys[step].begin(), ys[step].end(), yb);
          }, nullptr));
          r.step_peaks.push_back(pool().peak() - live_before);
          if (release.joinable()) release.join();
        }
        model_join_update(m);
        r.state = m.opt->save(m.stream);
        r.params = testutil::download_vec(m.params, m.num_params);
        model_destroy(m);
        cudaCheck(cudaStreamDestroy(stream), "test", "stream");
        return r;
      };
      const Run beside = train(1), alone = train(0);
      const std::string what = "variant " + std::to_string(variant) + ", recompute " + std::to_string(recompute);
      EXPECT_EQ(beside.losses, alone.losses) << what;
      EXPECT_EQ(beside.step_peaks, alone.step_peaks) << what << ": the same buffers held as long";
      ASSERT_EQ(beside.state.size(), alone.state.size());
      for (size_t i = 0; i < alone.state.size(); i++)
        EXPECT_EQ(0, memcmp(beside.state[i].second.data(), alone.state[i].second.data(),
                            alone.state[i].second.size() * sizeof(float)))
            << what << ": optimizer section " << alone.state[i].first;
      EXPECT_EQ(0, memcmp(beside.params.data(), alone.params.data(), alone.params.size() * sizeof(floatX))) << what;
      printf("[wgrad] %s: step %d loss %.7f beside, %.7f alone; step peak %.2f MiB both\n", what.c_str(), steps,
             beside.losses.back(), alone.losses.back(), alone.step_peaks.back() / 1048576.0);
    }
}

// --overlap_update 1: the optimizer on its own stream, group by group beside the next step's forward,
// gives the losses, the optimizer's state, the weights and the router biases of the update on the
// compute stream (--overlap_update 0) bit for bit, with one pass per step (the update reads the
// pass's bf16 gradients and zeroes them group by group) and with two (it reads their fp32 sum). So
// that the next forward is certainly queued before the update has run, a kernel that waits for a host
// flag holds the update stream ahead of each update from step 4 on: the step returns with its update
// not started (asserted), and the flag is set 20 ms into the next step, so that only the events keep
// that step's forward from reading the old weights. (Not before step 4: the first steps allocate the
// pool's blocks and the pinned upload buffers, and a device-wide synchronisation there would wait for
// the held update. The flags are allocated before the first step and freed after the last, since
// cudaFreeHost synchronises the device too.) The compute stream is non-blocking, as the trainer's.
// The FP32 build updates on the compute stream (its passes add into the buffer the update reads):
// skipped there.
TEST(GpuModel, UpdateBesideTheNextForwardIsBitIdentical) {
  REQUIRE_GPU();
  if (!BUILD_BF16) GTEST_SKIP() << "the FP32 build updates on the compute stream (update_beside_next_forward)";
  const ModelConfig c = config_variant(1);
  const int B = 2, T = c.seq_len, N = B * T, steps = 7, first_held = 3;
  testutil::Rng rng;
  struct Run {
    std::vector<float> losses, bias;
    StateSections state;
    std::vector<floatX> params;
  };
  for (int accum : {1, 2}) {
    std::vector<std::vector<int>> xs(steps * accum), ys(steps * accum);
    for (size_t i = 0; i < xs.size(); i++) random_tokens(N, c.vocab, rng, xs[i], ys[i]);
    auto train = [&](int overlap) {
      TrainConfig t;
      t.lr = 2e-3f; t.warmup = 1; t.steps = steps; t.bias_update = 1e-2f; t.overlap_update = overlap;
      cudaStream_t stream = stream_create("test.compute", StreamPriority::Compute);
      Model m = model_create(c, 11, Parallel(), stream);
      EXPECT_EQ(update_beside_next_forward(m, t), overlap == 1);
      Run r;
      std::vector<testutil::HostFlag> flags(steps);  // flags[s] holds step s's update
      for (int step = 0; step < steps; step++) {
        std::thread release;
        if (overlap && step > first_held) release = std::thread([flag = &flags[step - 1]] {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          flag->set();
        });
        const bool hold = overlap && step >= first_held;
        if (hold) {
          testutil::wait_for_host_kernel<<<1, 1, 0, m.update.stream>>>(nullptr, flags[step].device, 0);
          launchCheck("test.hold_update", "step=%d", step);
        }
        int micro = step * accum;
        r.losses.push_back(model_train_step(m, t, step, B, T, accum, [&](int* xb, int* yb) {
          std::copy(xs[micro].begin(), xs[micro].end(), xb);
          std::copy(ys[micro].begin(), ys[micro].end(), yb);
          micro++;
        }, nullptr));
        if (release.joinable()) release.join();
        if (hold) EXPECT_EQ(cudaEventQuery(m.update.done[0].event), cudaErrorNotReady) << "step " << step << " waited for its update";
      }
      if (overlap) flags[steps - 1].set();
      model_join_update(m);
      r.state = m.opt->save(m.stream);
      r.params = testutil::download_vec(m.params, m.num_params);
      r.bias = m.router_bias;
      EXPECT_EQ(overlap == 1, m.update.stream != nullptr);
      model_destroy(m);
      cudaCheck(cudaStreamDestroy(stream), "test", "stream");
      return r;
    };
    const Run beside = train(1), after = train(0);
    EXPECT_EQ(beside.losses, after.losses) << "accum " << accum;
    ASSERT_EQ(beside.state.size(), after.state.size());
    for (size_t i = 0; i < after.state.size(); i++)
      EXPECT_EQ(0, memcmp(beside.state[i].second.data(), after.state[i].second.data(), after.state[i].second.size() * sizeof(float)))
          << "accum " << accum << ": optimizer section " << after.state[i].first;
    EXPECT_EQ(0, memcmp(beside.params.data(), after.params.data(), after.params.size() * sizeof(floatX))) << "accum " << accum << ": weights";
    EXPECT_EQ(beside.bias, after.bias) << "accum " << accum;
    printf("[overlap] accum %d: %d steps, step %d loss %.7f beside the next forward, %.7f after the backward\n", accum, steps,
           steps, beside.losses.back(), after.losses.back());
  }
}

// --cuda_graph (model.cuh's model_pass, runtime/graph.cuh): passes launched as captured graphs train
// exactly as eager passes do — the same losses, weights, optimizer state, router biases and pool peak
// per step, bit for bit — with the optimizer beside the next forward (held on the host until 20 ms
// into the next step, so a graph that did not wait for it would read old weights) or after the
// backward, with and without recomputation, one or two passes per step. A pool that gave its cached
// blocks back to CUDA makes the next pass of each kind capture again. Each kind of pass (PassGraphKey)
// runs eagerly once, is captured at its second pass and launched from then on.
TEST(GpuModel, GraphPassesTrainAsEagerPassesDo) {
  REQUIRE_GPU();
  if (!BUILD_BF16) GTEST_SKIP() << "the FP32 build's MoE layers wait for the host in every pass (cuda_graph_refusal)";
  const int steps = 6, first_held = 2, released_at = 4;
  struct Case {
    int variant, overlap, recompute, accum;
  };
  for (const Case k : {Case{0, 1, 0, 1}, Case{1, 1, 1, 1}, Case{1, 0, 0, 2}, Case{0, 1, 1, 2}}) {
    const ModelConfig c = config_variant(k.variant);
    const int B = 2, T = c.seq_len, N = B * T;
    testutil::Rng rng;
    std::vector<std::vector<int>> xs(steps * k.accum), ys(steps * k.accum);
    for (size_t i = 0; i < xs.size(); i++) random_tokens(N, c.vocab, rng, xs[i], ys[i]);
    struct Run {
      std::vector<float> losses, bias;
      std::vector<size_t> peaks;
      StateSections state;
      std::vector<floatX> params;
      long long captures = 0, launches = 0;
    };
    auto train = [&](bool graphs) {
      TrainConfig t;
      t.lr = 2e-3f; t.warmup = 1; t.steps = steps; t.bias_update = 1e-2f; t.overlap_update = k.overlap;
      t.recompute = k.recompute;
      cudaStream_t stream = stream_create("test.compute", StreamPriority::Compute);
      Model m = model_create(c, 11, Parallel(), stream);
      m.graphs.on = graphs;
      Run r;
      std::vector<testutil::HostFlag> flags(steps);  // flags[s] holds step s's update
      for (int step = 0; step < steps; step++) {
        std::thread release;
        if (k.overlap && step > first_held) release = std::thread([flag = &flags[step - 1]] {
          std::this_thread::sleep_for(std::chrono::milliseconds(20));
          flag->set();
        });
        if (step == released_at) pool().release_cached();  // synchronises the device: after the release is on its way
        const bool hold = k.overlap && step >= first_held;
        if (hold) {
          testutil::wait_for_host_kernel<<<1, 1, 0, m.update.stream>>>(nullptr, flags[step].device, 0);
          launchCheck("test.hold_update", "step=%d", step);
        }
        pool().reset_peak();
        int micro = step * k.accum;
        r.losses.push_back(model_train_step(m, t, step, B, T, k.accum, [&](int* xb, int* yb) {
          std::copy(xs[micro].begin(), xs[micro].end(), xb);
          std::copy(ys[micro].begin(), ys[micro].end(), yb);
          micro++;
        }, nullptr));
        r.peaks.push_back(pool().peak());
        if (release.joinable()) release.join();
      }
      if (k.overlap) flags[steps - 1].set();
      model_join_update(m);
      r.state = m.opt->save(m.stream);
      r.params = testutil::download_vec(m.params, m.num_params);
      r.bias = m.router_bias;
      r.captures = m.graphs.captures;
      r.launches = m.graphs.launches;
      model_destroy(m);
      cudaCheck(cudaStreamDestroy(stream), "test", "stream");
      return r;
    };
    const Run graphs = train(true), eager = train(false);
    char what[96];
    snprintf(what, sizeof what, "variant %d, overlap %d, recompute %d, accum %d", k.variant, k.overlap, k.recompute, k.accum);
    EXPECT_EQ(graphs.losses, eager.losses) << what;
    EXPECT_EQ(graphs.peaks, eager.peaks) << what << ": pool peaks per step";
    ASSERT_EQ(graphs.state.size(), eager.state.size());
    for (size_t i = 0; i < eager.state.size(); i++)
      EXPECT_EQ(0, memcmp(graphs.state[i].second.data(), eager.state[i].second.data(), eager.state[i].second.size() * sizeof(float)))
          << what << ": optimizer section " << eager.state[i].first;
    EXPECT_EQ(0, memcmp(graphs.params.data(), eager.params.data(), eager.params.size() * sizeof(floatX))) << what << ": weights";
    EXPECT_EQ(graphs.bias, eager.bias) << what;
    // each kind of pass: eager once, captured at its second pass and again after the release. With the
    // update beside, step 0's first pass (no update to wait for yet) is a kind of its own, seen once.
    EXPECT_EQ(graphs.captures, 2 * k.accum) << what;
    EXPECT_EQ(graphs.launches, (steps - 1) * k.accum - k.overlap) << what;
    EXPECT_EQ(eager.captures + eager.launches, 0) << what;
    printf("[graph] %s: %lld captures, %lld launches in %d steps; step %d loss %.7f (eager %.7f)\n", what, graphs.captures,
           graphs.launches, steps, steps, graphs.losses.back(), eager.losses.back());
  }
}

// The trainer as a user runs it (the FP32 build's binary, trainer_path, on the prepared corpus):
// 6 steps straight, and 3 steps + --resume from the step-3 checkpoint + 3 more, at W = 1 and W = 2.
// The two step-6 checkpoints hold the same state bit for bit (every optimizer section and the router
// biases of every rank, the data position, the sample generator) and the losses of steps 4..6 agree.
namespace {
struct TrainerRun {
  std::string out;
  int rc;
};

// The trainer a test runs: the FP32 build's (FLATMOE_TRAIN when set) or the BF16 build's, in FLATMOE_BIN
// (default build/: the tests run from the repository's root).
std::string trainer_path(bool bf16) {
  const char* train = getenv("FLATMOE_TRAIN");
  if (!bf16 && train != nullptr) return train;
  const char* bin_dir = getenv("FLATMOE_BIN");
  return std::string(bin_dir ? bin_dir : "build/") + (bf16 ? "/bf16/train" : "/fp32/train");
}

// Skips the test where the trainer it runs is not built, naming the binary.
#define SKIP_UNLESS_BUILT(bin)                                                                              \
  if (access((bin).c_str(), X_OK) != 0)                                                                      \
  GTEST_SKIP() << (bin) << " is not built (FLATMOE_TRAIN or FLATMOE_BIN, the build folder, names another)"

// bin: the trainer binary (the FP32 build's by default)
TrainerRun run_trainer(const std::string& out, int gpus, const std::string& extra,
                       const std::string& bin = trainer_path(false)) {
  const std::string cmd = bin + " --gpus " + std::to_string(gpus) +
                          " --data data/fortunes --hidden 64 --layers 2 --heads 2 --experts 4 --topk 2"
                          " --expert_dim 64 --seq_len 32 --batch 4 --total_batch 256 --steps 6 --warmup 2"
                          " --val_every 0 --sample_every 0 --log_every 1 --ckpt_every 3 --out " + out + " " + extra +
                          " > " + out + ".log 2>&1";
  return TrainerRun{out, system(cmd.c_str())};
}

std::vector<std::string> csv_losses(const std::string& path) {
  std::vector<std::string> losses;
  FILE* f = fopen(path.c_str(), "r");
  if (!f) return losses;
  char line[1024];
  while (fgets(line, sizeof line, f)) {
    std::string row(line);
    size_t a = row.find(','), b = row.find(',', a + 1);
    if (a != std::string::npos && b != std::string::npos && row.compare(0, 4, "step") != 0)
      losses.push_back(row.substr(0, a) + ":" + row.substr(a + 1, b - a - 1));
  }
  fclose(f);
  return losses;
}

void trainer_resume_is_bit_identical(int gpus, const std::string& tag = "", const std::string& flags = "") {
  SKIP_UNLESS_BUILT(trainer_path(false));
  if (gpu_count() < gpus && !gpu_sharing())
    GTEST_SKIP() << "needs " << gpus << " GPUs, or ranks sharing them (FLATMOE_SHARE_GPUS=1); this machine has " << gpu_count();
  const std::string dir = fresh_test_dir("trainer-resume" + tag + "-w" + std::to_string(gpus));
  TrainerRun straight = run_trainer(dir + "/straight", gpus, flags);
  ASSERT_EQ(straight.rc, 0) << "see " << straight.out << ".log";
  TrainerRun resumed = run_trainer(dir + "/resumed", gpus, flags + " --resume " + dir + "/straight/ckpt_000003");
  ASSERT_EQ(resumed.rc, 0) << "see " << resumed.out << ".log";
  for (int rank = 0; rank < gpus; rank++) {
    ckpt::RankFile a = ckpt::read_rank_file(ckpt::rank_file(straight.out + "/ckpt_000006", rank));
    ckpt::RankFile b = ckpt::read_rank_file(ckpt::rank_file(resumed.out + "/ckpt_000006", rank));
    EXPECT_EQ(a.step, 6);
    EXPECT_EQ(b.step, 6);
    EXPECT_EQ(a.optimizer_steps, b.optimizer_steps);
    EXPECT_EQ(a.data.shard, b.data.shard);
    EXPECT_EQ(a.data.position, b.data.position);
    EXPECT_EQ(a.data.epoch, b.data.epoch);
    EXPECT_EQ(a.sample_rng_draws, b.sample_rng_draws);
    ASSERT_EQ(a.sections.size(), b.sections.size());
    for (size_t i = 0; i < a.sections.size(); i++) {
      EXPECT_EQ(a.sections[i].first, b.sections[i].first);
      ASSERT_EQ(a.sections[i].second.size(), b.sections[i].second.size());
      EXPECT_EQ(0, memcmp(a.sections[i].second.data(), b.sections[i].second.data(), a.sections[i].second.size() * 4))
          << "rank " << rank << " section " << a.sections[i].first;
    }
  }
  std::vector<std::string> all = csv_losses(straight.out + "/log.csv"), tail = csv_losses(resumed.out + "/log.csv");
  ASSERT_EQ(all.size(), 6u);
  ASSERT_EQ(tail.size(), 3u);
  for (int i = 0; i < 3; i++) EXPECT_EQ(tail[i], all[3 + i]);
}

// The two-rank run `tag`'s step-3 checkpoint resumed with the default flags (run `name`): refused before
// the GPU starts, its log saying `message`.
void expect_resume_refused(const std::string& tag, const std::string& name, const std::string& message) {
  const std::string dir = test_dir("trainer-resume" + tag + "-w2");
  TrainerRun run = run_trainer(dir + "/" + name, 2, "--resume " + dir + "/straight/ckpt_000003");
  EXPECT_NE(run.rc, 0);
  const std::string log = testutil::read_bytes(run.out + ".log");
  EXPECT_NE(log.find(message), std::string::npos) << log;
}
}  // namespace

TEST(Trainer, ResumeFromCheckpointIsBitIdenticalOneRank) {
  REQUIRE_GPU();
  trainer_resume_is_bit_identical(1);
}

TEST(Trainer, ResumeFromCheckpointIsBitIdenticalTwoRanks) {
  REQUIRE_GPU();
  trainer_resume_is_bit_identical(2);
}

// The output heads that never hold [N,V]: chunked on one rank, and Ring-DTP on two (each rank's file
// holds its vocabulary interval of lm_head; the samples at steps 3 and 6 project through the split head).
TEST(Trainer, ResumeWithTheChunkedHeadIsBitIdenticalOneRank) {
  REQUIRE_GPU();
  trainer_resume_is_bit_identical(1, "-chunked", "--head chunked --vocab_block 100 --sample_every 3 --sample_len 8");
}

// Sequence parallelism (--sp 2): the two ranks hold the two halves of each sequence; the checkpoint's
// data position and every rank's sections resume bit for bit.
TEST(Trainer, ResumeUnderSequenceParallelismIsBitIdenticalTwoRanks) {
  REQUIRE_GPU();
  trainer_resume_is_bit_identical(2, "-sp", "--sp 2");
}

// --zero 3: each rank's file holds its shards of every forward group; resumed, the run continues bit for bit.
// Resumed under --zero 1 instead, it is refused before the GPU starts, naming both stages.
TEST(Trainer, ResumeUnderZero3IsBitIdenticalTwoRanks) {
  REQUIRE_GPU();
  trainer_resume_is_bit_identical(2, "-zero3", "--zero 3");
  if (HasFatalFailure() || IsSkipped()) return;
  expect_resume_refused("-zero3", "zero1", "written under --zero 3; this run has --zero 1");
}

TEST(Trainer, ResumeWithTheRingHeadIsBitIdenticalTwoRanks) {
  REQUIRE_GPU();
  const std::string flags = "--head ring_dtp --vocab_block 100 --sample_every 3 --sample_len 8";
  trainer_resume_is_bit_identical(2, "-ring_dtp", flags);
  if (HasFatalFailure() || IsSkipped()) return;
  // the same checkpoint under the full head (lm_head whole on each rank) is refused, naming both splits
  expect_resume_refused("-ring_dtp", "full", "lm_head split over P=2 ranks (--head ring_dtp); this run has P=1 (--head full)");
}

// --cuda_graph as a user runs it (the BF16 build's trainer, trainer_path(true), two passes per
// step): 8 steps with validation every 2 (its batches through a graph from the second on) and a
// checkpoint at 4, with graphs and without, and the graph run resumed from its step-4 checkpoint: every
// logged training and validation loss, norm, pool peak and expert balance is the same, and every rank's
// step-8 checkpoint holds the same state bit for bit. The graph runs count their captures and launches.
// On one GPU, and on two under data parallelism alone (--ep 1: nothing is exchanged inside a pass).
namespace {
// log.csv without its timing columns (ms, tokens/s, MFU)
std::vector<std::string> csv_without_timing(const std::string& path) {
  std::vector<std::string> rows;
  std::istringstream in(testutil::read_bytes(path));
  for (std::string line; std::getline(in, line);) {
    std::vector<std::string> cols;
    std::istringstream fields(line);
    for (std::string col; std::getline(fields, col, ',');) cols.push_back(col);
    if (cols.size() != 13) return {"malformed row: " + line};
    cols.erase(cols.begin() + 5, cols.begin() + 8);
    std::string row;
    for (const std::string& col : cols) row += col + ",";
    rows.push_back(row);
  }
  return rows;
}

void trainer_graph_run_is_the_eager_run(int gpus, const std::string& tag, const std::string& parallel_flags) {
  if (!BUILD_BF16) GTEST_SKIP() << "the BF16 build's test binary runs the BF16 trainer (the FP32 build does not capture)";
  if (gpu_count() < gpus && !gpu_sharing())
    GTEST_SKIP() << "needs " << gpus << " GPUs, or ranks sharing them (FLATMOE_SHARE_GPUS=1); this machine has " << gpu_count();
  const std::string bin = trainer_path(true);
  SKIP_UNLESS_BUILT(bin);
  const std::string dir = fresh_test_dir("trainer-graph" + tag);
  const std::string flags = " --steps 8 --val_every 2 --val_batches 3 --ckpt_every 4 " + parallel_flags;
  TrainerRun eager = run_trainer(dir + "/eager", gpus, "--cuda_graph 0" + flags, bin);
  TrainerRun graphs = run_trainer(dir + "/graphs", gpus, "--cuda_graph 1" + flags, bin);
  ASSERT_EQ(eager.rc, 0) << "see " << eager.out << ".log";
  ASSERT_EQ(graphs.rc, 0) << "see " << graphs.out << ".log";
  TrainerRun resumed =
      run_trainer(dir + "/resumed", gpus, "--cuda_graph 1" + flags + " --resume " + graphs.out + "/ckpt_000004", bin);
  ASSERT_EQ(resumed.rc, 0) << "see " << resumed.out << ".log";
  const std::string eager_log = testutil::read_bytes(eager.out + ".log"), graph_log = testutil::read_bytes(graphs.out + ".log");
  EXPECT_NE(eager_log.find("off (--cuda_graph 0)"), std::string::npos) << eager_log;
  EXPECT_EQ(eager_log.find("cuda graph: "), std::string::npos) << "an eager run counts no graphs";
  const size_t counted = graph_log.find("cuda graph: ");
  ASSERT_NE(counted, std::string::npos) << graph_log;
  long long captures = 0, launches = 0;
  ASSERT_EQ(sscanf(graph_log.c_str() + counted, "cuda graph: %lld captures, %lld launches", &captures, &launches), 2);
  printf("[graph] trainer%s: %s", tag.c_str(), graph_log.substr(counted, graph_log.find('\n', counted) - counted + 1).c_str());
  EXPECT_GE(captures, 3) << "the training passes (two kinds) and the validation batches";
  EXPECT_GT(launches, captures);

  const std::vector<std::string> eager_rows = csv_without_timing(eager.out + "/log.csv");
  EXPECT_EQ(eager_rows.size(), 1u + 8 + 5) << "header, 8 steps, 5 validations";
  EXPECT_EQ(csv_without_timing(graphs.out + "/log.csv"), eager_rows);
  for (const std::string& run : {graphs.out, resumed.out})
    for (int rank = 0; rank < gpus; rank++) {
      ckpt::RankFile a = ckpt::read_rank_file(ckpt::rank_file(eager.out + "/ckpt_000008", rank));
      ckpt::RankFile b = ckpt::read_rank_file(ckpt::rank_file(run + "/ckpt_000008", rank));
      EXPECT_EQ(a.optimizer_steps, b.optimizer_steps) << run << " rank " << rank;
      ASSERT_EQ(a.sections.size(), b.sections.size()) << run << " rank " << rank;
      for (size_t i = 0; i < a.sections.size(); i++) {
        ASSERT_EQ(a.sections[i].second.size(), b.sections[i].second.size()) << run << " rank " << rank;
        EXPECT_EQ(0, memcmp(a.sections[i].second.data(), b.sections[i].second.data(), a.sections[i].second.size() * 4))
            << run << " rank " << rank << ": section " << a.sections[i].first;
      }
    }
}
}  // namespace

TEST(Trainer, CudaGraphRunIsTheEagerRunBF16) {
  REQUIRE_GPU();
  trainer_graph_run_is_the_eager_run(1, "", "");
}

TEST(Trainer, CudaGraphRunIsTheEagerRunBF16TwoRanksDataParallel) {
  REQUIRE_GPU();
  trainer_graph_run_is_the_eager_run(2, "-dp-w2", "--ep 1 --total_batch 512");  // two passes per step on each rank
}

// Routing traces through the trainer (the FP32 build's binary, trainer_path), at W = 1 and W = 2:
//   recorded   --record_routing: 6 steps of 2 micro-batches, a trace of 12 batches
//   replayed   --routing trace: of that trace, recording its own routing: the same experts, memcmp,
//              and the same losses bit for bit (the router's own choice replayed with its own scores)
//   other      --seed 7 replaying the trace: the trace's experts, not what its router chooses, which
//   router     (--seed 7 without the trace) differs
//   resumed    the replayed run resumed at step 3 with the trace: training pass 6 onwards takes batches
//              6.. of the trace (batch (pass − first) mod S), and the losses of steps 4..6 agree
namespace {
data::RoutingTrace read_trace(const std::string& path) {
  try {
    return data::read_routing_trace(path);
  } catch (const std::exception& e) {
    ADD_FAILURE() << e.what();
    return data::RoutingTrace();
  }
}

bool same_indices(const data::RoutingTrace& a, const data::RoutingTrace& b, size_t b_from = 0) {
  return b_from + a.indices.size() <= b.indices.size() &&
         memcmp(a.indices.data(), b.indices.data() + b_from, a.indices.size() * sizeof(int32_t)) == 0;
}

void trainer_replays_its_routing_trace(int gpus) {
  SKIP_UNLESS_BUILT(trainer_path(false));
  if (gpu_count() < gpus && !gpu_sharing())
    GTEST_SKIP() << "needs " << gpus << " GPUs, or ranks sharing them (FLATMOE_SHARE_GPUS=1); this machine has " << gpu_count();
  const std::string dir = fresh_test_dir("trainer-trace-w" + std::to_string(gpus));
  const std::string trace = dir + "/recorded.trace", replay = " --routing trace:" + trace;
  for (const auto& [name, extra] : std::vector<std::pair<std::string, std::string>>{
           {"recorded", ""},
           {"replayed", replay},
           {"other", "--seed 7" + replay},
           {"router", "--seed 7"},
           {"resumed", "--resume " + dir + "/replayed/ckpt_000003" + replay}}) {
    TrainerRun run = run_trainer(dir + "/" + name, gpus, extra + " --record_routing " + dir + "/" + name + ".trace");
    ASSERT_EQ(run.rc, 0) << "see " << run.out << ".log";
  }
  const data::RoutingTrace recorded = read_trace(trace), replayed = read_trace(dir + "/replayed.trace"),
                           other = read_trace(dir + "/other.trace"), router = read_trace(dir + "/router.trace"),
                           resumed = read_trace(dir + "/resumed.trace");
  EXPECT_EQ(recorded.shape.world, gpus);
  EXPECT_EQ(recorded.shape.layers, (std::vector<int>{0, 1}));
  EXPECT_EQ(recorded.shape.tokens, std::vector<int>(gpus, 4 * 32));
  EXPECT_EQ(recorded.first, 0);
  EXPECT_EQ(recorded.batches, 12);  // 6 steps × 2 micro-batches
  EXPECT_TRUE(same_indices(recorded, replayed)) << "the replay must route exactly as the trace says";
  EXPECT_TRUE(same_indices(recorded, other)) << "another model replaying the trace must route as the trace says";
  EXPECT_FALSE(same_indices(recorded, router)) << "--seed 7's own router must choose otherwise (else the test shows nothing)";
  EXPECT_EQ(resumed.first, 6);
  EXPECT_EQ(resumed.batches, 6);
  EXPECT_TRUE(same_indices(resumed, recorded, recorded.shape.batch_indices() * 6)) << "resumed at pass 6: batches 6..11";
  const std::vector<std::string> recorded_losses = csv_losses(dir + "/recorded/log.csv");
  ASSERT_EQ(recorded_losses.size(), 6u);
  EXPECT_EQ(csv_losses(dir + "/replayed/log.csv"), recorded_losses) << "replaying its own trace, bit for bit";
  EXPECT_NE(csv_losses(dir + "/other/log.csv"), recorded_losses);
  const std::vector<std::string> resumed_losses = csv_losses(dir + "/resumed/log.csv");
  ASSERT_EQ(resumed_losses.size(), 3u);
  for (int i = 0; i < 3; i++) EXPECT_EQ(resumed_losses[i], recorded_losses[3 + i]);
}
}  // namespace

TEST(Trainer, ReplaysItsRoutingTraceExactlyOneRank) {
  REQUIRE_GPU();
  trainer_replays_its_routing_trace(1);
}

TEST(Trainer, ReplaysItsRoutingTraceExactlyTwoRanks) {
  REQUIRE_GPU();
  trainer_replays_its_routing_trace(2);
}
