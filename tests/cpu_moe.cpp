// tests/cpu_moe.cpp — the MoE FFN reference (ref/moe.hpp) as a specification: it is the weighted
// sum of SwiGLU experts, a dense SwiGLU FFN under the trivial routing, and its gradients match
// finite differences.
#include <algorithm>
#include <string>
#include "test_util.hpp"
#include "../ref/moe.hpp"

namespace {

using testutil::Rng;
using Mat = ref::Mat<double>;

struct MoEInputs {
  Mat x, topk_w;
  ref::MatI topk_idx;
  std::vector<Mat> W13, W2;
};

// Random inputs; each token picks k distinct experts among the first `used` (the rest get no route).
MoEInputs random_moe(Rng& rng, int N, int H, int I, int E, int k, int used) {
  MoEInputs in;
  in.x = rng.mat<double>(N, H);
  in.topk_idx.resize(N, k);
  in.topk_w.resize(N, k);
  for (int n = 0; n < N; n++) {
    std::vector<int> experts(used);
    for (int e = 0; e < used; e++) experts[e] = e;
    std::shuffle(experts.begin(), experts.end(), rng.gen);
    for (int j = 0; j < k; j++) {
      in.topk_idx(n, j) = experts[j];
      in.topk_w(n, j) = rng.uniform(0.1, 1.0);
    }
  }
  for (int e = 0; e < E; e++) {
    in.W13.push_back(rng.mat<double>(2 * I, H, 1.0 / std::sqrt(H)));
    in.W2.push_back(rng.mat<double>(H, I, 1.0 / std::sqrt(I)));
  }
  return in;
}

double weighted_sum(const Mat& a, const Mat& b) { return (a.array() * b.array()).sum(); }

}  // namespace

// Every gradient of Σ dout ⊙ moe_forward(...) against central differences.
TEST(MoERef, GradientsMatchFiniteDifferences) {
  Rng rng;
  const int N = 5, H = 6, I = 4, E = 3, k = 2;
  MoEInputs in = random_moe(rng, N, H, I, E, k, E);
  Mat dout = rng.mat<double>(N, H);
  auto loss = [&] { return weighted_sum(ref::moe_forward(in.x, in.topk_idx, in.topk_w, in.W13, in.W2), dout); };
  auto g = ref::moe_backward(dout, in.x, in.topk_idx, in.topk_w, in.W13, in.W2);

  EXPECT_REL("moe ref fd", "dx", testutil::rel_err(g.dx, testutil::finite_diff(in.x, loss)), testutil::FD_TOL);
  EXPECT_REL("moe ref fd", "dtopk_w", testutil::rel_err(g.dtopk_w, testutil::finite_diff(in.topk_w, loss)), testutil::FD_TOL);
  for (int e = 0; e < E; e++) {
    std::string dW13 = "dW13[" + std::to_string(e) + "]", dW2 = "dW2[" + std::to_string(e) + "]";
    EXPECT_REL("moe ref fd", dW13.c_str(), testutil::rel_err(g.dW13[e], testutil::finite_diff(in.W13[e], loss)), testutil::FD_TOL);
    EXPECT_REL("moe ref fd", dW2.c_str(), testutil::rel_err(g.dW2[e], testutil::finite_diff(in.W2[e], loss)), testutil::FD_TOL);
  }
}

// Routing every token to expert 0 with weight 1 (E = 1, k = 1) is the dense SwiGLU FFN
// W2 (silu(W1 x) ⊙ W3 x), written here with whole-matrix products.
TEST(MoERef, TrivialRoutingIsDenseSwiGLU) {
  Rng rng;
  const int N = 7, H = 5, I = 3;
  MoEInputs in = random_moe(rng, N, H, I, 1, 1, 1);
  in.topk_w.setOnes();
  Mat h1 = in.x * in.W13[0].topRows(I).transpose();
  Mat h3 = in.x * in.W13[0].bottomRows(I).transpose();
  Mat a = h1.unaryExpr([](double v) { return ref::silu(v); }).cwiseProduct(h3);
  Mat dense = a * in.W2[0].transpose();
  Mat out = ref::moe_forward(in.x, in.topk_idx, in.topk_w, in.W13, in.W2);
  EXPECT_REL("moe ref dense", "out", testutil::rel_err(out, dense), 1e-14);
}

// The output is linear in the combine weights: out = Σ_j w_j · (output with only slot j, weight 1).
TEST(MoERef, OutputIsWeightedSumOfSlots) {
  Rng rng;
  const int N = 6, H = 4, I = 5, E = 4, k = 3;
  MoEInputs in = random_moe(rng, N, H, I, E, k, E);
  Mat expected = Mat::Zero(N, H);
  for (int j = 0; j < k; j++) {
    ref::MatI one_idx = in.topk_idx.col(j);
    Mat ones = Mat::Ones(N, 1);
    Mat y = ref::moe_forward(in.x, one_idx, ones, in.W13, in.W2);
    for (int n = 0; n < N; n++) expected.row(n) += in.topk_w(n, j) * y.row(n);
  }
  Mat out = ref::moe_forward(in.x, in.topk_idx, in.topk_w, in.W13, in.W2);
  EXPECT_REL("moe ref slots", "out", testutil::rel_err(out, expected), 1e-14);
}

// An expert that receives no route gets an exactly zero weight gradient.
TEST(MoERef, ExpertWithoutRoutesHasZeroGradient) {
  Rng rng;
  const int N = 8, H = 4, I = 3, E = 4, k = 2;
  MoEInputs in = random_moe(rng, N, H, I, E, k, 3);  // expert 3 unused
  auto g = ref::moe_backward(rng.mat<double>(N, H), in.x, in.topk_idx, in.topk_w, in.W13, in.W2);
  EXPECT_EQ(g.dW13[3].cwiseAbs().maxCoeff(), 0.0);
  EXPECT_EQ(g.dW2[3].cwiseAbs().maxCoeff(), 0.0);
  EXPECT_GT(g.dW13[0].cwiseAbs().maxCoeff(), 0.0);
}
