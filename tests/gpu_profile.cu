// tests/gpu_profile.cu — runtime/profile.cuh, the per-operator breakdown of --profile_step: its ranges
// partition the stream's timeline (the rows sum to the total), are summed per name with their bytes,
// sub-ranges and prefixes are named after their parent, nothing is recorded while it is off; and on a
// whole training step of a small model, every operator's range appears as often as the model runs it,
// while the step's results (loss, norm, weights, router biases) are the same bits as without it.
#include <cmath>
#include <cstring>
#include <set>
#include "../model.cuh"
#include "gpu_util.cuh"
#include "model_util.cuh"

namespace {

const ProfileRow* find_row(const std::vector<ProfileRow>& rows, const std::string& name) {
  for (const ProfileRow& r : rows)
    if (r.name == name) return &r;
  return nullptr;
}

int calls_of(const std::vector<ProfileRow>& rows, const std::string& name) {
  const ProfileRow* r = find_row(rows, name);
  return r ? r->calls : 0;
}

double sum_ms(const std::vector<ProfileRow>& rows) {
  double s = 0;
  for (const ProfileRow& r : rows) s += r.ms;
  return s;
}

}  // namespace

TEST(ProfileGpu, RangesPartitionTheStreamAndSumPerName) {
  REQUIRE_GPU();
  DeviceBuffer<float> buf(1 << 20, Mem::Workspace, "test.profile");
  prof_mark(0, "dropped while off", 1);  // the profiler is off: nothing recorded
  {
    ProfPrefix ignored("ignored ");        // off: no prefix either
  }
  profiler().begin(0);
  prof_mark(0, "a", 100);
  cudaCheck(cudaMemsetAsync(buf.ptr, 0, buf.bytes(), 0), "test", "memset");
  prof_mark(0, "b");
  prof_sub(0, "x", 50);
  cudaCheck(cudaMemsetAsync(buf.ptr, 1, buf.bytes(), 0), "test", "memset");
  {
    ProfPrefix again("again ");
    prof_mark(0, "a", 100);
    cudaCheck(cudaMemsetAsync(buf.ptr, 2, buf.bytes(), 0), "test", "memset");
  }
  prof_mark(0, "a", 1);
  double total = 0;
  const std::vector<ProfileRow> rows = profiler().end(&total);
  std::set<std::string> names;
  for (const ProfileRow& r : rows) names.insert(r.name);
  EXPECT_EQ(names, (std::set<std::string>{"(step start)", "a", "b", "b: x", "again a"}));
  ASSERT_NE(find_row(rows, "a"), nullptr);
  EXPECT_EQ(find_row(rows, "a")->calls, 2);
  EXPECT_EQ(find_row(rows, "a")->bytes, 101.0);
  EXPECT_EQ(find_row(rows, "b: x")->bytes, 50.0);
  EXPECT_EQ(find_row(rows, "b")->bytes, 0.0);
  EXPECT_GT(total, 0.0);
  EXPECT_NEAR(sum_ms(rows), total, 1e-9 * std::max(1.0, total)) << "the ranges must partition the profiled time";
  for (size_t i = 1; i < rows.size(); i++) EXPECT_GE(rows[i - 1].ms, rows[i].ms) << "rows sorted by time";
  EXPECT_FALSE(profiler().on);

  // off again: marks are dropped, so the next profiled step holds only its own
  prof_mark(0, "dropped after end", 1);
  profiler().begin(0);
  const std::vector<ProfileRow> empty = profiler().end(&total);
  ASSERT_EQ(empty.size(), 1u);
  EXPECT_EQ(empty[0].name, "(step start)");
  profiler().release();
}

// One training step of a small model (a dense layer, a shared expert, recomputation, accumulation over
// two micro-batches), profiled and not, from the same weights and tokens.
TEST(ProfileGpu, TrainingStepBreakdownNamesEveryOperatorAndChangesNoBits) {
  REQUIRE_GPU();
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40;
  c.layers = 3; c.experts = 7; c.topk = 3; c.n_dense = 1; c.dense_dim = 72; c.shared_expert = 1;
  TrainConfig t;
  t.recompute = 1;
  t.bias_update = 1e-2f;
  t.overlap_update = 0;  // the optimizer's range on the compute stream, with its bytes (not on the update stream)
  const int B = 2, T = c.seq_len, accum = 2, L = c.layers, L_moe = c.layers - c.n_dense;
  struct Result {
    float loss, norm;
    std::vector<floatX> params;
    std::vector<float> bias;
    std::vector<long long> loads;
  };
  std::vector<ProfileRow> rows;
  double total = 0;
  size_t state_count = 0;
  const uint64_t token_seed = testutil::fresh_seed();  // fresh tokens, the same for both runs
  auto run = [&](bool profile) {
    Model m = model_create(c, 11);
    testutil::Rng rng(token_seed);
    auto next_batch = [&](int* x, int* y) {
      std::vector<int> xs, ys;
      random_tokens(B * T, c.vocab, rng, xs, ys);
      std::copy(xs.begin(), xs.end(), x);
      std::copy(ys.begin(), ys.end(), y);
    };
    Result r;
    model_train_step(m, t, 0, B, T, accum, next_batch, &r.norm);  // warm-up: pool blocks, dense routes
    if (profile) profiler().begin(m.stream);
    r.loss = model_train_step(m, t, 1, B, T, accum, next_batch, &r.norm);
    if (profile) rows = profiler().end(&total);
    r.params = testutil::download_vec(m.params, m.num_params);
    r.bias = m.router_bias;
    r.loads = m.step_loads;
    state_count = m.opt->state_count;
    model_destroy(m);
    return r;
  };
  const Result off = run(false), on = run(true);
  profiler().release();
  EXPECT_EQ(on.loss, off.loss);
  EXPECT_EQ(on.norm, off.norm);
  EXPECT_EQ(0, memcmp(on.params.data(), off.params.data(), on.params.size() * sizeof(floatX)));
  EXPECT_EQ(on.bias, off.bias);
  EXPECT_EQ(on.loads, off.loads);

  EXPECT_NEAR(sum_ms(rows), total, 1e-9 * std::max(1.0, total));
  // per pass: the embedding, 2 RMSNorms per layer + the final one, attention per layer (forward, its
  // recomputation, backward), the router and the routed dispatcher per MoE layer, the dense FFN once
  const int passes = accum;
  EXPECT_EQ(calls_of(rows, "embedding fwd"), passes);
  EXPECT_EQ(calls_of(rows, "embedding bwd"), passes);
  EXPECT_EQ(calls_of(rows, "rmsnorm fwd"), passes * (2 * L + 1));
  EXPECT_EQ(calls_of(rows, "recompute rmsnorm fwd"), passes * 2 * L);
  EXPECT_EQ(calls_of(rows, "rmsnorm bwd"), passes * (2 * L + 1));
  for (const char* op : {"qkv matmul fwd", "rope fwd", "attention fwd", "wo matmul fwd + residual add"}) {
    EXPECT_EQ(calls_of(rows, op), passes * L) << op;
    EXPECT_EQ(calls_of(rows, std::string("recompute ") + op), passes * L) << op;
  }
  for (const char* op : {"wo matmul bwd", "attention bwd (+ rope bwd)", "qkv matmul bwd"})
    EXPECT_EQ(calls_of(rows, op), passes * L) << op;
  EXPECT_EQ(calls_of(rows, "rope bwd"), 0) << "RoPE's backward runs in attention's backward stores";
  EXPECT_EQ(calls_of(rows, "router fwd"), passes * L_moe);
  EXPECT_EQ(calls_of(rows, "router bwd"), passes * L_moe);
  // the routed experts' plan waits for the host unless the counts stay on the device (BF16 build)
  const std::string plan = moe_counts_stay_on_device(c.hidden, c.expert_dim, c.experts, (long long)B * T * c.topk) ? "route plan" : "route plan (host wait)";
  EXPECT_EQ(calls_of(rows, "dispatcher fwd: " + plan), passes * L_moe);
  EXPECT_EQ(calls_of(rows, "recompute dispatcher fwd: " + plan), passes * L_moe);
  EXPECT_EQ(calls_of(rows, "dispatcher fwd: combine"), passes * L_moe);
  EXPECT_EQ(calls_of(rows, "recompute dispatcher fwd: combine"), 0) << "a recomputation does not combine";
  EXPECT_EQ(calls_of(rows, "dispatcher bwd: combine bwd"), passes * L_moe);
  EXPECT_EQ(calls_of(rows, "shared expert fwd: route plan"), passes * L_moe) << "no host wait: the count is known";
  EXPECT_EQ(calls_of(rows, "shared expert fwd: route plan (host wait)"), 0);
  EXPECT_EQ(calls_of(rows, "dense ffn fwd: route plan"), passes * c.n_dense);
  EXPECT_EQ(calls_of(rows, "dense ffn bwd"), passes * c.n_dense);
  EXPECT_EQ(calls_of(rows, "head (fwd+bwd): cross-entropy fwd+bwd"), passes) << "one kernel: the loss and its gradient";
  EXPECT_EQ(calls_of(rows, "pass start: token uploads"), passes);
  EXPECT_EQ(calls_of(rows, "data: next batch (host)"), passes);
  for (const char* op : {"zero grads", "grad norm", "optimizer", "norm download, loads all-reduce + download (host wait)",
                         "router bias update (host wait)", "step end: rank sync, loss mean (host wait)"})
    EXPECT_EQ(calls_of(rows, op), 1) << op;
  ASSERT_NE(find_row(rows, "optimizer"), nullptr);
  EXPECT_EQ(find_row(rows, "optimizer")->bytes, (double)state_count * (28 + sizeof(floatX)));
  ASSERT_NE(find_row(rows, "rope fwd"), nullptr);
  EXPECT_EQ(find_row(rows, "rope fwd")->bytes, passes * L * 4.0 * B * T * c.hidden * sizeof(floatX));
  print_profile(stdout, rows, total, 0, "[profile] small model, one step");
}
