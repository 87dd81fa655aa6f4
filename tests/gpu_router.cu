// tests/gpu_router.cu — ops/router.cuh against ref/router.hpp: selection (exact), weights, scores,
// dlogits and loads, on well-separated scores (DESIGN §3), at sizes that are not multiples of the
// warp; plus exact ties, which must pick the lower expert index on GPU and CPU alike.
#include <algorithm>
#include "gpu_util.cuh"
#include "router_util.hpp"
#include "../ops/router.cuh"
#include "../ref/router.hpp"

namespace {

using testutil::Rng;
using Mat = ref::Mat<double>;
using Vec = ref::Vec<double>;

// A float-representable random bias (the GPU holds it as float).
Vec random_bias(Rng& rng, int E, double stddev) {
  Vec b(E);
  for (int e = 0; e < E; e++) b(e) = (double)(float)rng.normal(stddev);
  return b;
}

std::vector<float> as_floats(const Vec& v) {
  std::vector<float> f(v.size());
  for (Eigen::Index i = 0; i < v.size(); i++) f[i] = (float)v(i);
  return f;
}

int count_mismatches(const std::vector<int>& gpu, const ref::MatI& expected) {
  int bad = 0;
  for (Eigen::Index i = 0; i < expected.size(); i++) bad += gpu[i] != expected.data()[i];
  return bad;
}

// Forward, backward and loads of one configuration against the reference.
void check_router(const char* name, int N, int E, int k, int score_fn, bool renorm) {
  Rng rng;
  Vec bias = random_bias(rng, E, score_fn == ROUTER_SOFTMAX ? 0.3 / E : 0.2);
  Mat logits = testutil::well_separated_logits(rng, N, E, k, bias, score_fn, 1e-4, testutil::round_to_floatX);
  Mat dtopk_w = rng.mat<double>(N, k).cast<float>().cast<double>();
  auto r = ref::router_forward(logits, bias, k, score_fn, renorm);
  Mat dlogits_ref = ref::router_backward(dtopk_w, r.scores, r.topk_idx, score_fn, renorm);

  auto d_logits = testutil::upload<floatX>(logits);
  auto d_bias = testutil::upload_vec(as_floats(bias));
  auto d_dtopk_w = testutil::upload<float>(dtopk_w);
  DeviceBuffer<int> d_idx((size_t)N * k, Mem::Workspace, "test.topk_idx");
  DeviceBuffer<float> d_w((size_t)N * k, Mem::Workspace, "test.topk_w");
  DeviceBuffer<float> d_scores((size_t)N * E, Mem::Workspace, "test.scores");
  DeviceBuffer<floatX> d_dlogits((size_t)N * E, Mem::Workspace, "test.dlogits");
  DeviceBuffer<int> d_loads(E, Mem::Workspace, "test.loads");
  testutil::poison(d_idx.ptr, d_idx.count);
  testutil::poison(d_w.ptr, d_w.count);
  testutil::poison(d_scores.ptr, d_scores.count);
  testutil::poison(d_dlogits.ptr, d_dlogits.count);
  testutil::poison(d_loads.ptr, d_loads.count);
  cudaCheck(cudaDeviceSynchronize(), "test", "setup");

  router_forward(d_idx.ptr, d_w.ptr, d_scores.ptr, d_logits.ptr, d_bias.ptr, N, E, k, score_fn, renorm, 0);
  router_backward(d_dlogits.ptr, d_dtopk_w.ptr, d_scores.ptr, d_idx.ptr, N, E, k, score_fn, renorm, 0);
  router_count_loads(d_loads.ptr, d_idx.ptr, N, E, k, 0);

  EXPECT_EQ(count_mismatches(testutil::download_vec(d_idx.ptr, d_idx.count), r.topk_idx), 0) << name << " topk_idx";
  EXPECT_REL(name, "topk_w", testutil::rel_err(testutil::download(d_w.ptr, N, k), r.topk_w), OP_TOL);
  EXPECT_REL(name, "scores", testutil::rel_err(testutil::download(d_scores.ptr, N, E), r.scores), OP_TOL);
  EXPECT_REL(name, "dlogits", testutil::rel_err(testutil::download(d_dlogits.ptr, N, E), dlogits_ref), OP_TOL);
  EXPECT_EQ(testutil::download_vec(d_loads.ptr, E), ref::router_count_loads(r.topk_idx, E)) << name << " loads";
}

}  // namespace

TEST(RouterGpu, SoftmaxRenormSmall) {
  REQUIRE_GPU();
  check_router("router softmax renorm", 37, 5, 2, ROUTER_SOFTMAX, true);
}

TEST(RouterGpu, SigmoidRenormOddExpertCount) {
  REQUIRE_GPU();
  check_router("router sigmoid renorm", 300, 77, 6, ROUTER_SIGMOID, true);
}

TEST(RouterGpu, SoftmaxMaxExpertsMaxK) {
  REQUIRE_GPU();
  check_router("router softmax E=256 k=8", 129, ROUTER_MAX_E, ROUTER_MAX_K, ROUTER_SOFTMAX, false);
}

TEST(RouterGpu, SigmoidTopOne) {
  REQUIRE_GPU();
  check_router("router sigmoid k=1", 1001, 160, 1, ROUTER_SIGMOID, false);
}

// Exact ties: equal keys go to the lower expert index, on the GPU as in the reference, also when
// the tied experts sit in the same lane (3, 35) or in different lanes (35, 36).
TEST(RouterGpu, TiesGoToLowerExpertIndex) {
  REQUIRE_GPU();
  const int N = 3, E = 40, k = 3;
  Mat logits = Mat::Zero(N, E);                    // token 0: every key equal
  for (int e = 0; e < E; e++) logits(1, e) = logits(2, e) = -0.05 * e;
  for (int e : {35, 3, 36}) logits(1, e) = 2.0;    // token 1: three-way tie at the top
  logits(2, 30) = logits(2, 7) = 1.5;              // token 2: tie for the second place
  logits(2, 20) = 3.0;
  logits = testutil::round_to_floatX(logits);
  Vec bias = Vec::Zero(E);
  const std::vector<int> expected = {0, 1, 2, 3, 35, 36, 20, 7, 30};

  auto d_logits = testutil::upload<floatX>(logits);
  auto d_bias = testutil::upload_vec(as_floats(bias));
  DeviceBuffer<int> d_idx(N * k, Mem::Workspace, "test.topk_idx");
  DeviceBuffer<float> d_w(N * k, Mem::Workspace, "test.topk_w");
  DeviceBuffer<float> d_scores(N * E, Mem::Workspace, "test.scores");
  for (int score_fn : {ROUTER_SOFTMAX, ROUTER_SIGMOID}) {
    auto r = ref::router_forward(logits, bias, k, score_fn, true);
    testutil::poison(d_idx.ptr, d_idx.count);
    cudaCheck(cudaDeviceSynchronize(), "test", "setup");
    router_forward(d_idx.ptr, d_w.ptr, d_scores.ptr, d_logits.ptr, d_bias.ptr, N, E, k, score_fn, true, 0);
    std::vector<int> gpu = testutil::download_vec(d_idx.ptr, d_idx.count);
    EXPECT_EQ(gpu, expected) << "score_fn=" << score_fn;
    EXPECT_EQ(count_mismatches(expected, r.topk_idx), 0) << "reference, score_fn=" << score_fn;
    EXPECT_REL("router ties", "topk_w", testutil::rel_err(testutil::download(d_w.ptr, N, k), r.topk_w), OP_TOL);
  }
}

// A routing profile's choice overrides the selection: its weights are the selected scores,
// renormalised, exactly as the reference computes them.
TEST(RouterGpu, WeightsOfAGivenChoice) {
  REQUIRE_GPU();
  for (bool renorm : {false, true}) {
    Rng rng;
    const int N = 93, E = 13, k = 3;
    Mat logits = testutil::round_to_floatX(rng.mat<double>(N, E, 1.0));
    Mat scores = ref::router_scores(logits, ROUTER_SOFTMAX);
    ref::MatI idx(N, k);
    for (int n = 0; n < N; n++)
      for (int j = 0; j < k; j++) idx(n, j) = rng.integer(0, E - 1);  // repeats allowed, as in hot profiles
    std::vector<float> scores_f(scores.size());
    for (Eigen::Index i = 0; i < scores.size(); i++) scores_f[i] = (float)scores.data()[i];
    std::vector<int> idx_v(idx.data(), idx.data() + idx.size());
    DeviceBuffer<float> scores_dev = testutil::upload_vec(scores_f);
    DeviceBuffer<int> idx_dev = testutil::upload_vec(idx_v);
    DeviceBuffer<float> w_dev((size_t)N * k, Mem::Workspace, "topk_w");
    testutil::poison(w_dev.ptr, w_dev.count);
    router_weights(w_dev.ptr, scores_dev.ptr, idx_dev.ptr, N, E, k, renorm, 0);
    Mat expected = ref::router_weights(scores, idx, renorm);
    EXPECT_REL(renorm ? "router weights renorm" : "router weights", "topk_w",
               testutil::rel_err(testutil::download(w_dev.ptr, N, k), expected), OP_TOL);
  }
}
