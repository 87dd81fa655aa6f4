// tests/cpu_attention.cpp — the causal attention reference (ref/attention.hpp): every gradient
// against finite differences, the log-sum-exp, and causality.
#include "../ref/attention.hpp"
#include "test_util.hpp"

using ref::Mat;

namespace {

struct AttnShape {
  int B, T, nh, hd;
};

// L = Σ W ⊙ out(qkv): the gradient with respect to qkv (q, k and v parts) is
// attention_backward(W, qkv).
TEST(CpuAttention, BackwardMatchesFiniteDifferences) {
  for (AttnShape s : {AttnShape{2, 5, 2, 4}, AttnShape{1, 7, 3, 2}}) {
    testutil::Rng rng;
    const int N = s.B * s.T, H = s.nh * s.hd;
    Mat<double> qkv = rng.mat<double>(N, 3 * H);
    const Mat<double> w = rng.mat<double>(N, H);
    auto loss = [&] {
      Mat<double> out, lse;
      ref::attention_forward(qkv, s.B, s.T, s.nh, s.hd, out, lse);
      return out.cwiseProduct(w).sum();
    };
    const Mat<double> numeric = testutil::finite_diff(qkv, loss);
    const Mat<double> analytic = ref::attention_backward(w, qkv, s.B, s.T, s.nh, s.hd);
    const char* parts[3] = {"dq", "dk", "dv"};
    for (int p = 0; p < 3; p++)
      EXPECT_REL("CpuAttention.FiniteDiff", parts[p],
                 testutil::rel_err(Mat<double>(analytic.middleCols(p * H, H)), Mat<double>(numeric.middleCols(p * H, H))),
                 testutil::FD_TOL);
  }
}

// lse[b·nh + h, t] = log Σ_{s≤t} exp(q_t·k_s / sqrt(hd)), written out directly.
TEST(CpuAttention, LogSumExpOfScaledCausalScores) {
  testutil::Rng rng;
  const int B = 2, T = 6, nh = 2, hd = 4, H = nh * hd;
  const Mat<double> qkv = rng.mat<double>(B * T, 3 * H);
  Mat<double> out, lse;
  ref::attention_forward(qkv, B, T, nh, hd, out, lse);
  Mat<double> want(B * nh, T);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < nh; h++)
      for (int t = 0; t < T; t++) {
        double sum = 0;
        for (int s = 0; s <= t; s++)
          sum += std::exp(qkv.row(b * T + t).segment(h * hd, hd).dot(qkv.row(b * T + s).segment(H + h * hd, hd)) /
                          std::sqrt(double(hd)));
        want(b * nh + h, t) = std::log(sum);
      }
  EXPECT_REL("CpuAttention.LSE", "lse", testutil::rel_err(lse, want), 1e-14);
}

// Causal: changing position u of a sequence leaves the outputs of positions t < u unchanged
// and the first position attends only to itself (out = its own v).
TEST(CpuAttention, IsCausal) {
  testutil::Rng rng;
  const int T = 8, nh = 2, hd = 4, H = nh * hd, u = 5;
  Mat<double> qkv = rng.mat<double>(T, 3 * H);
  Mat<double> out1, out2, lse;
  ref::attention_forward(qkv, 1, T, nh, hd, out1, lse);
  qkv.row(u) = rng.mat<double>(1, 3 * H);
  ref::attention_forward(qkv, 1, T, nh, hd, out2, lse);
  EXPECT_REL("CpuAttention.Causal", "out[t<u]", testutil::rel_err(Mat<double>(out2.topRows(u)), Mat<double>(out1.topRows(u))), 0.0);
  EXPECT_GT(testutil::rel_err(Mat<double>(out2.bottomRows(T - u)), Mat<double>(out1.bottomRows(T - u))), 1e-3);
  EXPECT_REL("CpuAttention.Causal", "out[0] = v[0]",
             testutil::rel_err(Mat<double>(out2.row(0)), Mat<double>(qkv.row(0).segment(2 * H, H))), 1e-15);
}

}  // namespace
