// The CPU reference model: its gradients agree with central finite differences of its loss, and
// its trainer overfits a tiny batch. (The GPU model is checked against this model in gpu_model.cu.)
#include <random>
#include "../ref/model.hpp"
#include "test_util.hpp"

namespace {

ModelConfig tiny_config(int shared, int n_dense, int score_fn) {
  ModelConfig c;
  c.vocab = 19; c.hidden = 32; c.layers = 2; c.heads = 1; c.experts = 5; c.topk = 2; c.expert_dim = 12;
  c.n_dense = n_dense; c.dense_dim = 20; c.shared_expert = shared; c.seq_len = 6; c.score_fn = score_fn;
  c.init_std = 0.3f;  // large enough that router scores are well separated
  return c;
}

std::vector<double> random_weights(const ModelConfig& c, testutil::Rng& rng) {
  std::vector<double> w;
  for (const ParamSpec& s : param_specs(c))
    for (size_t i = 0; i < s.numel(); i++) w.push_back(s.decay ? rng.normal(c.init_std) : 1.0 + rng.normal(0.1));
  return w;
}

void random_tokens(const ModelConfig& c, int N, testutil::Rng& rng, std::vector<int>& x, std::vector<int>& y) {
  x.resize(N); y.resize(N);
  for (int n = 0; n < N; n++) { x[n] = rng.integer(0, c.vocab - 1); y[n] = rng.integer(0, c.vocab - 1); }
}

// Draws weights and tokens until every routing margin is far above the finite-difference step, then
// compares a random subset of each parameter tensor's gradient entries with central differences,
// asserting every tensor on its own (notes/design.md §3).
void check_gradients(const char* what, const ModelConfig& c) {
  const int B = 2, T = c.seq_len, N = B * T;
  for (int attempt = 0; attempt < 20; attempt++) {
    testutil::Rng rng;
    std::vector<int> x, y;
    random_tokens(c, N, rng, x, y);
    ref::Model<double> m(c, random_weights(c, rng));
    for (float& b : m.router_bias) b = (float)rng.normal(0.05);
    ref_pass(m, x, y, B, T, true, 1.0 / N);
    if (m.min_route_margin < 1e-3) continue;  // a near-tie: finite differences would cross it
    for (size_t i = 0; i < m.specs.size(); i++) {
      std::vector<double> numeric, analytic;  // [samples] of tensor i
      for (int sample = 0; sample < 6; sample++) {
        size_t j = m.offsets[i] + rng.integer(0, (int)m.specs[i].numel() - 1);
        double keep = m.params[j], h = 1e-5;
        m.params[j] = keep + h;
        double fp = ref_pass(m, x, y, B, T, false, 0.0, false);
        m.params[j] = keep - h;
        double fm = ref_pass(m, x, y, B, T, false, 0.0, false);
        m.params[j] = keep;
        numeric.push_back((fp - fm) / (2 * h));
        analytic.push_back(m.grads[j]);
      }
      EXPECT_REL(what, m.specs[i].name.c_str(), testutil::rel_err(analytic, numeric), testutil::FD_TOL);
    }
    return;
  }
  FAIL() << "no draw without a routing near-tie in 20 attempts";
}

}  // namespace

TEST(RefModel, GradientsMatchFiniteDifferencesSoftmaxRouter) {
  check_gradients("ref_model_fd softmax", tiny_config(0, 0, 0));
}
TEST(RefModel, GradientsMatchFiniteDifferencesSigmoidSharedDense) {
  check_gradients("ref_model_fd sigmoid+sh+dense", tiny_config(1, 1, 1));
}

TEST(RefModel, OverfitsATinyBatch) {
  ModelConfig c = tiny_config(1, 0, 0);
  c.init_std = 0.05f;
  TrainConfig t;
  t.lr = 1e-2f; t.warmup = 0; t.steps = 80; t.weight_decay = 0.f; t.grad_clip = 1.f; t.bias_update = 1e-3f;
  testutil::Rng rng;
  const int B = 2, T = c.seq_len, N = B * T;
  std::vector<int> x, y;
  random_tokens(c, N, rng, x, y);
  ref::Model<double> m(c, random_weights(c, rng));
  double first = 0, last = 0;
  for (int step = 0; step < t.steps; step++) {
    ref_zero_grads(m);
    double loss = ref_pass(m, x, y, B, T, true, 1.0 / N);
    ref_update(m, t, (double)lr_at(t, step));
    if (step == 0) first = loss;
    last = loss;
  }
  printf("[overfit] loss %.4f -> %.4f after %d steps (ln V = %.3f)\n", first, last, t.steps, std::log((double)c.vocab));
  EXPECT_LT(last, 0.1 * first);
}
