// tests/cpu_router.cpp — the router reference (ref/router.hpp) as a specification: what it
// selects, what it weighs, how ties break, its loads, and its gradient against finite differences;
// and the aux-loss-free bias update (config.hpp update_router_bias) against hand-computed moves.
#include <algorithm>
#include <cstring>
#include "router_util.hpp"
#include "test_util.hpp"
#include "../config.hpp"
#include "../ref/router.hpp"

namespace {

using testutil::Rng;
using Mat = ref::Mat<double>;
using Vec = ref::Vec<double>;

Vec random_bias(Rng& rng, int E, double stddev) {
  Vec b(E);
  for (int e = 0; e < E; e++) b(e) = rng.normal(stddev);
  return b;
}

bool is_selected(const ref::MatI& topk_idx, int n, int e) {
  for (int j = 0; j < topk_idx.cols(); j++)
    if (topk_idx(n, j) == e) return true;
  return false;
}

}  // namespace

// topk_idx holds the k largest s + bias in descending order; the weights are the selected scores
// (not s + bias), divided by their sum under renorm.
TEST(RouterRef, SelectsLargestScorePlusBiasAndWeighsByScore) {
  Rng rng;
  const int N = 40, E = 12, k = 4;
  for (int score_fn : {ref::ROUTER_SOFTMAX, ref::ROUTER_SIGMOID}) {
    for (bool renorm : {false, true}) {
      Vec bias = random_bias(rng, E, score_fn == ref::ROUTER_SOFTMAX ? 0.05 : 0.2);
      Mat logits = testutil::well_separated_logits(rng, N, E, k, bias, score_fn, 1e-3);
      auto r = ref::router_forward(logits, bias, k, score_fn, renorm);
      for (int n = 0; n < N; n++) {
        double sum = 0;
        for (int j = 0; j < k; j++) sum += r.scores(n, r.topk_idx(n, j));
        for (int j = 0; j < k; j++) {
          int e = r.topk_idx(n, j);
          double key = r.scores(n, e) + bias(e);
          if (j > 0) {
            EXPECT_LT(key, r.scores(n, r.topk_idx(n, j - 1)) + bias(r.topk_idx(n, j - 1)));
          }
          for (int f = 0; f < E; f++) {
            if (!is_selected(r.topk_idx, n, f)) {
              EXPECT_GT(key, r.scores(n, f) + bias(f));
            }
          }
          EXPECT_DOUBLE_EQ(r.topk_w(n, j), renorm ? r.scores(n, e) / sum : r.scores(n, e));
        }
      }
    }
  }
}

// Softmax scores are a distribution over the experts; sigmoid scores are per expert.
TEST(RouterRef, ScoresAreSoftmaxOrSigmoid) {
  Rng rng;
  Mat logits = rng.mat<double>(9, 7, 2.0);
  Mat soft = ref::router_scores(logits, ref::ROUTER_SOFTMAX);
  Mat sig = ref::router_scores(logits, ref::ROUTER_SIGMOID);
  for (int n = 0; n < 9; n++) {
    EXPECT_NEAR(soft.row(n).sum(), 1.0, 1e-12);
    for (int e = 0; e < 7; e++) {
      EXPECT_NEAR(soft(n, e) / soft(n, 0), std::exp(logits(n, e) - logits(n, 0)), 1e-9 * soft(n, e) / soft(n, 0));
      EXPECT_DOUBLE_EQ(sig(n, e), 1.0 / (1.0 + std::exp(-logits(n, e))));
    }
  }
}

// The bias moves experts in and out of the selection but never enters the weights.
TEST(RouterRef, BiasChangesSelectionNotWeights) {
  Rng rng;
  const int N = 64, E = 16, k = 2;
  Vec zero = Vec::Zero(E);
  Vec bias = random_bias(rng, E, 0.3);
  Mat logits = testutil::well_separated_logits(rng, N, E, k, bias, ref::ROUTER_SIGMOID, 1e-3);
  auto with_bias = ref::router_forward(logits, bias, k, ref::ROUTER_SIGMOID, false);
  auto without = ref::router_forward(logits, zero, k, ref::ROUTER_SIGMOID, false);
  EXPECT_NE(with_bias.topk_idx, without.topk_idx) << "a bias of this size should change some selection";
  for (int n = 0; n < N; n++)
    for (int j = 0; j < k; j++)
      EXPECT_DOUBLE_EQ(with_bias.topk_w(n, j), with_bias.scores(n, with_bias.topk_idx(n, j)));
}

// Equal keys go to the lower expert index first.
TEST(RouterRef, TiesGoToLowerExpertIndex) {
  const int E = 40;
  Mat logits = Mat::Zero(3, E);                     // token 0: every key equal
  for (int e = 0; e < E; e++) logits(1, e) = logits(2, e) = -0.05 * e;
  for (int e : {35, 3, 36}) logits(1, e) = 2.0;     // token 1: three-way tie at the top
  logits(2, 30) = logits(2, 7) = 1.5;               // token 2: tie for the second place
  logits(2, 20) = 3.0;
  Vec bias = Vec::Zero(E);
  for (int score_fn : {ref::ROUTER_SOFTMAX, ref::ROUTER_SIGMOID}) {
    auto r = ref::router_forward(logits, bias, 3, score_fn, true);
    EXPECT_EQ(r.topk_idx(0, 0), 0); EXPECT_EQ(r.topk_idx(0, 1), 1); EXPECT_EQ(r.topk_idx(0, 2), 2);
    EXPECT_EQ(r.topk_idx(1, 0), 3); EXPECT_EQ(r.topk_idx(1, 1), 35); EXPECT_EQ(r.topk_idx(1, 2), 36);
    EXPECT_EQ(r.topk_idx(2, 0), 20); EXPECT_EQ(r.topk_idx(2, 1), 7); EXPECT_EQ(r.topk_idx(2, 2), 30);
    EXPECT_DOUBLE_EQ(r.topk_w(1, 0), 1.0 / 3);
  }
}

// dlogits = ∂/∂logits Σ dtopk_w ⊙ topk_w(logits), with the selection held fixed.
TEST(RouterRef, BackwardMatchesFiniteDifferences) {
  Rng rng;
  const int N = 6, E = 7, k = 3;
  for (int score_fn : {ref::ROUTER_SOFTMAX, ref::ROUTER_SIGMOID}) {
    for (bool renorm : {false, true}) {
      Vec bias = random_bias(rng, E, 0.05);
      Mat logits = testutil::well_separated_logits(rng, N, E, k, bias, score_fn, 1e-3);
      Mat dtopk_w = rng.mat<double>(N, k);
      auto r = ref::router_forward(logits, bias, k, score_fn, renorm);
      Mat dlogits = ref::router_backward(dtopk_w, r.scores, r.topk_idx, score_fn, renorm);
      Mat numeric = testutil::finite_diff(logits, [&] {
        auto p = ref::router_forward(logits, bias, k, score_fn, renorm);
        EXPECT_EQ(p.topk_idx, r.topk_idx);
        return (p.topk_w.array() * dtopk_w.array()).sum();
      });
      const char* name = score_fn == ref::ROUTER_SOFTMAX ? (renorm ? "router softmax renorm" : "router softmax")
                                                         : (renorm ? "router sigmoid renorm" : "router sigmoid");
      EXPECT_REL(name, "dlogits", testutil::rel_err(dlogits, numeric), testutil::FD_TOL);
    }
  }
}

// loads[e] = number of routes that select expert e.
TEST(RouterRef, CountLoads) {
  ref::MatI idx(4, 2);
  idx << 0, 3, 3, 1, 3, 0, 2, 3;
  std::vector<int> loads = ref::router_count_loads(idx, 5);
  EXPECT_EQ(loads, (std::vector<int>{2, 1, 1, 4, 0}));
}

// ---------------------------------------------------------------------------------------------
// Aux-loss-free balancing: after every step, b_e += u · sign(mean_load − load_e) in every MoE layer
// (config.hpp update_router_bias, called by both the trainer and the reference model, so that no
// other test would see a sign error). bias and loads are [L·E], layer-major.

namespace {

ModelConfig bias_config(int layers, int experts, int n_dense) {
  ModelConfig c;
  c.layers = layers;
  c.experts = experts;
  c.n_dense = n_dense;
  return c;
}

std::vector<float> random_biases(Rng& rng, size_t n) {
  std::vector<float> b(n);
  for (float& x : b) x = (float)rng.normal(0.1);
  return b;
}

std::vector<long long> random_loads(Rng& rng, size_t n) {
  std::vector<long long> loads(n);
  for (long long& x : loads) x = rng.integer(0, 60);
  return loads;
}

// bias == before + u · step for every entry (step −1, 0 or +1): a move of exactly u, or none.
void expect_moved(const std::vector<float>& bias, const std::vector<float>& before, const std::vector<int>& steps,
                  float u) {
  ASSERT_EQ(bias.size(), steps.size());
  for (size_t i = 0; i < steps.size(); i++)
    EXPECT_EQ(bias[i], before[i] + u * (float)steps[i]) << "entry " << i << " (step " << steps[i] << ")";
}

}  // namespace

// Loads {9, 1, 5, 5}, mean 5: the overloaded expert 0 goes down by u, the underloaded expert 1 up by
// u, and experts 2 and 3, exactly at the mean, keep their bias.
TEST(RouterBiasUpdate, OverloadedGoesDownUnderloadedUpAtTheMeanUnchanged) {
  Rng rng;
  const float u = (float)rng.uniform(1e-4, 1e-2);
  std::vector<float> bias = random_biases(rng, 4);
  const std::vector<float> before = bias;
  update_router_bias(bias, {9, 1, 5, 5}, bias_config(1, 4, 0), u);
  expect_moved(bias, before, {-1, +1, 0, 0}, u);
}

// Random loads in every layer, plus a perfectly balanced layer: each expert moves by u toward the
// layer's mean, decided on integers (load_e · E against the layer's total), and not at all at the mean.
TEST(RouterBiasUpdate, EveryExpertMovesByUTowardItsLayersMean) {
  Rng rng;
  const int L = 4, E = 7;
  const float u = (float)rng.uniform(1e-4, 1e-2);
  std::vector<long long> loads = random_loads(rng, (size_t)L * E);
  std::fill(loads.begin() + 2 * E, loads.begin() + 3 * E, 12);  // layer 2: balanced
  std::vector<float> bias = random_biases(rng, loads.size());
  const std::vector<float> before = bias;
  update_router_bias(bias, loads, bias_config(L, E, 0), u);
  std::vector<int> steps(loads.size());
  for (int l = 0; l < L; l++) {
    long long total = 0;
    for (int e = 0; e < E; e++) total += loads[(size_t)l * E + e];
    for (int e = 0; e < E; e++) {
      const long long scaled = loads[(size_t)l * E + e] * E;
      steps[(size_t)l * E + e] = scaled < total ? +1 : scaled > total ? -1 : 0;
    }
  }
  expect_moved(bias, before, steps, u);
}

// The first n_dense layers have no router: their biases stay bit for bit whatever their loads say.
TEST(RouterBiasUpdate, DenseLayersUntouched) {
  Rng rng;
  const int L = 4, E = 5, n_dense = 2;
  const float u = (float)rng.uniform(1e-4, 1e-2);
  std::vector<long long> loads = random_loads(rng, (size_t)L * E);
  for (int l = 0; l < L; l++) loads[(size_t)l * E] = 1000;  // expert 0 overloaded in every layer
  std::vector<float> bias = random_biases(rng, loads.size());
  const std::vector<float> before = bias;
  update_router_bias(bias, loads, bias_config(L, E, n_dense), u);
  EXPECT_EQ(0, memcmp(bias.data(), before.data(), (size_t)n_dense * E * sizeof(float)));
  for (int l = n_dense; l < L; l++) EXPECT_EQ(bias[(size_t)l * E], before[(size_t)l * E] - u) << "layer " << l;
}

// u = 0 turns balancing off: nothing moves, however skewed the loads.
TEST(RouterBiasUpdate, ZeroRateDoesNothing) {
  Rng rng;
  const int L = 3, E = 6;
  std::vector<long long> loads = random_loads(rng, (size_t)L * E);
  for (int l = 0; l < L; l++) loads[(size_t)l * E + 1] = 1000;
  std::vector<float> bias = random_biases(rng, loads.size());
  const std::vector<float> before = bias;
  update_router_bias(bias, loads, bias_config(L, E, 0), 0.f);
  EXPECT_EQ(0, memcmp(bias.data(), before.data(), bias.size() * sizeof(float)));
}

// Loads count over the whole global batch: two ranks' loads are added before the update. Rank 0
// {6, 2, 0, 0} (mean 2) alone would move {−, 0, +, +}, rank 1 {0, 0, 3, 7} (mean 2.5) alone
// {+, +, −, −}; their sum {6, 2, 3, 7} (mean 4.5) moves {−, +, +, −}, the update of neither.
TEST(RouterBiasUpdate, LoadsSummedOverRanksGiveTheUpdateOfTheSum) {
  Rng rng;
  const ModelConfig c = bias_config(1, 4, 0);
  const float u = (float)rng.uniform(1e-4, 1e-2);
  const std::vector<long long> rank0 = {6, 2, 0, 0}, rank1 = {0, 0, 3, 7};
  std::vector<long long> global(4);
  for (int e = 0; e < 4; e++) global[e] = rank0[e] + rank1[e];
  const std::vector<float> before = random_biases(rng, 4);
  std::vector<float> from_rank0 = before, from_rank1 = before, from_global = before;
  update_router_bias(from_rank0, rank0, c, u);
  update_router_bias(from_rank1, rank1, c, u);
  update_router_bias(from_global, global, c, u);
  expect_moved(from_rank0, before, {-1, 0, +1, +1}, u);
  expect_moved(from_rank1, before, {+1, +1, -1, -1}, u);
  expect_moved(from_global, before, {-1, +1, +1, -1}, u);
}
