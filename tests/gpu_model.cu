// The whole GPU model against the CPU reference model (ref/model.hpp) on identical weights and
// tokens: first-step loss and every parameter gradient, ten training steps, recomputation,
// pool accounting, and save → resume continuing bit for bit.
#define FLATMOE_NO_MAIN
#include "../train.cu"
#include "../data/shards.hpp"
#include "../ref/model.hpp"
#include "gpu_util.cuh"
#include "model_util.cuh"

namespace {

using testutil::as_seen_by_gpu;
using testutil::random_master;
using testutil::random_tokens;

// Two configurations: every feature of the model, at sizes that are multiples of nothing.
ModelConfig config_variant(int variant) {
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40; c.init_std = 0.1f;
  if (variant == 0) {
    c.layers = 2; c.experts = 5; c.topk = 2; c.score_fn = 0; c.renorm = 1;
  } else {
    c.layers = 3; c.experts = 7; c.topk = 3; c.score_fn = 1; c.renorm = 1; c.n_dense = 1; c.dense_dim = 72;
    c.shared_expert = 1;
  }
  return c;
}

std::vector<float> download_grads(const Model& m) {
  std::vector<floatX> g = testutil::download_vec(m.grads, m.num_params);
  std::vector<float> out(g.size());
  for (size_t i = 0; i < g.size(); i++) out[i] = to_float(g[i]);
  return out;
}

std::vector<float> download_master(const Model& m) { return testutil::download_vec(m.master, m.num_params); }

// Normwise error of one tensor of a flat GPU buffer against the reference's flat buffer.
double tensor_err(const std::vector<float>& gpu, const std::vector<double>& ref, size_t off, size_t n) {
  double num = 0, den = 0;
  for (size_t i = off; i < off + n; i++) {
    num += (gpu[i] - ref[i]) * (gpu[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

void first_step_matches_reference(int variant) {
  ModelConfig c = config_variant(variant);
  testutil::Rng rng;
  const int B = 2, T = c.seq_len, N = B * T;
  std::vector<float> master = random_master(c, rng);
  std::vector<int> x, y;
  random_tokens(N, c.vocab, rng, x, y);

  Model m = model_create(c, 1);
  model_set_master(m, master);
  for (float& b : m.router_bias) b = (float)rng.normal(0.02);
  model_upload_router_bias(m);
  model_zero_grads(m);
  std::vector<std::vector<int>> routes;
  PassOptions o;
  o.dloss = 1.f / N;
  o.routes_out = &routes;
  float loss = model_pass(m, x.data(), y.data(), B, T, o);
  std::vector<float> grads = download_grads(m);

  ref::Model<double> r(c, as_seen_by_gpu(master));
  r.router_bias = m.router_bias;
  r.forced_routes = &routes;
  double ref_loss = ref_pass(r, x, y, B, T, true, 1.0 / N);

  char what[64];
  snprintf(what, sizeof what, "model_v%d_first_step", variant);
  EXPECT_REL(what, "loss", std::fabs(loss - ref_loss) / std::fabs(ref_loss), MODEL_TOL);
  for (size_t i = 0; i < m.specs.size(); i++) {
    double e = tensor_err(grads, r.grads, m.offsets[i], m.specs[i].numel());
#if defined(FLATMOE_BF16)
    // bf16 activations and gradients through every layer: a small tensor whose gradient is a sum
    // with heavy cancellation (the router's) reaches 2e-2 on its own (measured 1.4e-2 to 2.02e-2);
    // DESIGN §3's whole-model criterion, the normwise error over all parameters, is asserted below.
    testutil::report(what, ("d" + m.specs[i].name).c_str(), e, MODEL_TOL);
#else
    EXPECT_REL(what, ("d" + m.specs[i].name).c_str(), e, MODEL_TOL);
#endif
  }
  EXPECT_REL(what, "d(all params)", tensor_err(grads, r.grads, 0, m.num_params), MODEL_TOL);
#if !defined(FLATMOE_BF16)
  EXPECT_EQ(r.route_disagreements, 0) << "GPU and reference chose different experts with a clear margin";
#endif
  model_destroy(m);
}

}  // namespace

TEST(GpuModel, FirstStepLossAndEveryGradientMatchReference) {
  REQUIRE_GPU();
  first_step_matches_reference(0);
}

TEST(GpuModel, FirstStepDenseLayersSharedExpertSigmoidRouter) {
  REQUIRE_GPU();
  first_step_matches_reference(1);
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
      PassOptions o;
      o.dloss = 1.f / (N * accum);
      o.routes_out = &routes;
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
    EXPECT_EQ(m.router_bias, r.router_bias) << "router bias updates diverged at step " << step + 1;
  }
  EXPECT_REL("model_ten_steps", "max loss", worst, MODEL_TOL);
  std::vector<float> gpu_master = download_master(m);
  EXPECT_REL("model_ten_steps", "master weights", tensor_err(gpu_master, r.params, 0, m.num_params), MODEL_TOL);
#if !defined(FLATMOE_BF16)
  EXPECT_EQ(r.route_disagreements, 0);
#endif
  model_destroy(m);
}

// Layer-level recomputation replays the forward exactly: identical gradients, bit for bit, with
// fewer activation bytes live at the peak; the pool returns to where it started.
TEST(GpuModel, RecomputeIsBitIdenticalAndLowersPeak) {
  REQUIRE_GPU();
  ModelConfig c = config_variant(1);
  c.layers = 4;
  const int B = 4, T = c.seq_len, N = B * T;
  testutil::Rng rng;
  std::vector<int> x, y;
  random_tokens(N, c.vocab, rng, x, y);
  Model m = model_create(c, 3);
  model_set_master(m, random_master(c, rng));
  size_t peak[2];
  std::vector<float> grads[2];
  float loss[2];
  PassOptions warmup;  // sizes the model's own buffers (the trivial routing of dense layers) for N tokens
  warmup.backward = false;
  model_pass(m, x.data(), y.data(), B, T, warmup);
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
  make_dirs("build/test-out-pool");
  ASSERT_TRUE(pool().write_csv("build/test-out-pool/timeline.csv"));
  FILE* f = fopen("build/test-out-pool/timeline.csv", "r");
  ASSERT_NE(f, nullptr);
  char line[4096];
  int rows = 0;
  fgets(line, sizeof line, f);  // header
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

// Train 6 steps from a token shard; separately train 3, save, load into a fresh model and data
// loader, train 3 more: the losses and the final weights and optimizer state agree bit for bit.
TEST(GpuModel, SaveThenResumeContinuesBitIdentically) {
  REQUIRE_GPU();
  ModelConfig c = config_variant(1);
  TrainConfig t;
  t.lr = 2e-3f; t.warmup = 1; t.steps = 6; t.bias_update = 1e-2f;
  const int B = 2, T = c.seq_len, accum = 2;
  testutil::Rng rng;
  std::string dir = "build/test-out-resume";
  make_dirs(dir);
  std::vector<int> tokens(20000);
  for (int& tk : tokens) tk = rng.integer(0, c.vocab - 1);
  data::write_shard(dir + "/train_000.bin", tokens, c.vocab);

  auto run = [&](Model& m, DataLoader& data, int from, int to, std::vector<float>& losses) {
    for (int step = from; step < to; step++)
      losses.push_back(train_step(m, t, step, B, T, accum, [&](int* xb, int* yb) { data.next_batch(xb, yb); }, nullptr));
  };
  std::vector<float> straight_losses, resumed_losses;
  Model a = model_create(c, 11);
  DataLoader data_a(dir + "/train_*.bin", B, T);
  run(a, data_a, 0, 6, straight_losses);
  std::vector<float> straight_master = download_master(a);
  std::vector<float> straight_m = testutil::download_vec(a.adam_m, a.num_params);
  std::vector<float> straight_bias = a.router_bias;
  model_destroy(a);

  Model b = model_create(c, 11);
  DataLoader data_b(dir + "/train_*.bin", B, T);
  std::vector<float> first_half;
  run(b, data_b, 0, 3, first_half);
  TrainState st;
  st.step = 3;
  st.train_data = data_b.state();
  checkpoint_save(dir + "/ckpt", b, st);
  model_destroy(b);

  TrainState loaded;
  Model r = checkpoint_load(dir + "/ckpt", loaded);
  EXPECT_EQ(loaded.step, 3);
  DataLoader data_r(dir + "/train_*.bin", B, T);
  data_r.set_state(loaded.train_data);
  run(r, data_r, 3, 6, resumed_losses);
  for (int i = 0; i < 3; i++) {
    EXPECT_EQ(first_half[i], straight_losses[i]);
    EXPECT_EQ(resumed_losses[i], straight_losses[3 + i]) << "step " << 4 + i;
  }
  EXPECT_EQ(0, memcmp(download_master(r).data(), straight_master.data(), straight_master.size() * sizeof(float)));
  EXPECT_EQ(0, memcmp(testutil::download_vec(r.adam_m, r.num_params).data(), straight_m.data(), straight_m.size() * sizeof(float)));
  EXPECT_EQ(r.router_bias, straight_bias);
  model_destroy(r);
}

// Bad checkpoint files are refused with a message before anything touches the GPU.
TEST(Checkpoint, RefusesMissingTruncatedAndForeignFiles) {
  std::string dir = "build/test-out-ckpt";
  TrainState st;
  auto message = [&](const std::string& name) {
    try {
      checkpoint_load(dir + "/" + name, st);
    } catch (const std::exception& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  auto write = [&](const std::string& name, const void* data, size_t bytes) {
    make_dirs(dir + "/" + name);
    FILE* f = fopen(rank_file(dir + "/" + name, 0).c_str(), "wb");
    ASSERT_NE(f, nullptr);
    fwrite(data, 1, bytes, f);
    fclose(f);
  };
  EXPECT_NE(message("missing").find("cannot open"), std::string::npos);
  write("short", "abc", 3);
  EXPECT_NE(message("short").find("truncated"), std::string::npos);
  std::vector<int> header(256, 0);
  header[0] = 12345;
  write("foreign", header.data(), 1024);
  EXPECT_NE(message("foreign").find("bad magic"), std::string::npos);
  ModelConfig c = config_variant(0);
  header[0] = CKPT_MAGIC;
  header[1] = CKPT_VERSION;
  header[2] = sizeof(floatX) == 2 ? 1 : 0;
  header[7] = c.layers * c.experts;
  header[8] = 1;  // W
  header[9] = 1;  // E_p
  put_u64(&header[11], param_count(c));
  header_put_config(header.data(), c);
  std::vector<int> cut(header);
  cut.resize(256 + 1000, 0);
  write("cut", cut.data(), cut.size() * 4);
  EXPECT_NE(message("cut").find("truncated or corrupt"), std::string::npos);
  std::vector<int> other_world(header);
  other_world[8] = 2;
  write("other_world", other_world.data(), 1024);
  EXPECT_NE(message("other_world").find("of W=2"), std::string::npos);
  std::vector<int> other_precision(header);
  other_precision[2] = 1 - header[2];
  write("other_precision", other_precision.data(), 1024);
  EXPECT_NE(message("other_precision").find("build"), std::string::npos);
  header[1] = 99;
  write("version", header.data(), 1024);
  EXPECT_NE(message("version").find("unsupported version"), std::string::npos);
}
