// tests/cpu_rope.cpp — the RoPE reference (ref/rope.hpp): its gradient against finite
// differences, and the properties that make it a rotary position embedding.
#include "../ref/rope.hpp"
#include "test_util.hpp"

using ref::Mat;

namespace {

struct RopeShape {
  int B, T, nh, hd;
};

// L = Σ W ⊙ rope_forward(x): its gradient with respect to x is rope_backward(W).
TEST(CpuRope, BackwardMatchesFiniteDifferences) {
  const double theta = 10000.0;
  for (RopeShape s : {RopeShape{2, 5, 2, 4}, RopeShape{1, 7, 1, 6}}) {
    testutil::Rng rng;
    const int N = s.B * s.T, H = s.nh * s.hd;
    Mat<double> x = rng.mat<double>(N, 3 * H);
    const Mat<double> w = rng.mat<double>(N, 3 * H);
    auto loss = [&] { return ref::rope_forward(x, s.B, s.T, s.nh, s.hd, theta).cwiseProduct(w).sum(); };
    const Mat<double> numeric = testutil::finite_diff(x, loss);
    const Mat<double> analytic = ref::rope_backward(w, s.B, s.T, s.nh, s.hd, theta);
    EXPECT_REL("CpuRope.FiniteDiff", "dqkv", testutil::rel_err(analytic, numeric), testutil::FD_TOL);
  }
}

// Position 0 is the identity; v is never changed; each (i, i+hd/2) pair keeps its length.
TEST(CpuRope, RotatesQKPairsAndPassesV) {
  testutil::Rng rng;
  const int B = 2, T = 6, nh = 3, hd = 8, H = nh * hd, half = hd / 2;
  const Mat<double> x = rng.mat<double>(B * T, 3 * H);
  const Mat<double> y = ref::rope_forward(x, B, T, nh, hd, 500.0);
  for (int b = 0; b < B; b++)
    EXPECT_REL("CpuRope.Position0", "row t=0", testutil::rel_err(y.row(b * T), x.row(b * T)), 1e-15);
  EXPECT_REL("CpuRope.PassV", "v", testutil::rel_err(Mat<double>(y.rightCols(H)), Mat<double>(x.rightCols(H))), 0.0);
  double max_len_err = 0;
  for (int n = 0; n < B * T; n++)
    for (int head = 0; head < 2 * nh; head++)
      for (int i = 0; i < half; i++) {
        const int c1 = head * hd + i, c2 = c1 + half;
        const double before = std::hypot(x(n, c1), x(n, c2)), after = std::hypot(y(n, c1), y(n, c2));
        max_len_err = std::max(max_len_err, std::abs(after - before) / before);
      }
  EXPECT_REL("CpuRope.Rotation", "pair length", max_len_err, 1e-14);
}

// The point of RoPE: q(t)·k(s) after rotation depends only on t − s. Copying the same raw
// q and k to every position, the rotated dot products along each diagonal t − s are equal.
TEST(CpuRope, DotProductDependsOnlyOnRelativePosition) {
  testutil::Rng rng;
  const int T = 9, nh = 1, hd = 6, H = nh * hd;
  const Mat<double> one = rng.mat<double>(1, 3 * H);
  const Mat<double> x = one.replicate(T, 1);
  const Mat<double> y = ref::rope_forward(x, 1, T, nh, hd, 10000.0);
  const Mat<double> q = y.leftCols(H), k = y.middleCols(H, H);
  const Mat<double> dots = q * k.transpose();
  std::vector<double> got, want;
  for (int t = 0; t < T; t++)
    for (int s = 0; s <= t; s++) {
      got.push_back(dots(t, s));
      want.push_back(dots(t - s, 0));
    }
  EXPECT_REL("CpuRope.RelativePosition", "q.k", testutil::rel_err(got, want), 1e-13);
}

// Backward is the inverse rotation: rope_backward(rope_forward(x)) = x.
TEST(CpuRope, BackwardUndoesForward) {
  testutil::Rng rng;
  const int B = 2, T = 11, nh = 2, hd = 10;
  const Mat<double> x = rng.mat<double>(B * T, 3 * nh * hd);
  const Mat<double> back = ref::rope_backward(ref::rope_forward(x, B, T, nh, hd, 10000.0), B, T, nh, hd, 10000.0);
  EXPECT_REL("CpuRope.Inverse", "x", testutil::rel_err(back, x), 1e-14);
}

}  // namespace
