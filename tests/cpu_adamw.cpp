// CPU tests of ref/adamw.hpp. AdamW has no gradient to check; these pin down its defining
// properties: the bias correction makes the first step (and every step of a constant gradient)
// move each weight by lr·g/(|g| + eps); weight decay is decoupled (it shrinks the weight by
// lr·wd·w whatever the gradient scale); the global norm spans all tensors; clipping.
#include "test_util.hpp"
#include "../ref/adamw.hpp"

using namespace testutil;

namespace {

ref::Vec<double> random_vec(Rng& rng, int n, double stddev = 1) { return rng.mat<double>(n, 1, stddev).col(0); }

}  // namespace

TEST(AdamWRef, ConstantGradientMovesEachWeightByLrTimesItsSignEveryStep) {
  Rng rng;
  const int n = 50, steps = 4;
  const double lr = 1e-2, eps = 1e-12;
  ref::Vec<double> master0 = random_vec(rng, n), grad = random_vec(rng, n);
  ref::Vec<double> master = master0, m = ref::Vec<double>::Zero(n), v = ref::Vec<double>::Zero(n);
  for (int t = 1; t <= steps; t++) {
    ref::adamw_update<double>(master, m, v, grad, lr, 0.9, 0.95, eps, 0.0, t, 1.0);
    ref::Vec<double> expected = master0 - double(t) * lr * grad.cwiseSign();
    EXPECT_REL("AdamWRef.ConstantGradient", "master", rel_err(master, expected), 1e-9);
  }
}

TEST(AdamWRef, WeightDecayIsDecoupledFromTheGradient) {
  Rng rng;
  const int n = 40;
  const double lr = 1e-2, wd = 0.1, eps = 1e-12;
  ref::Vec<double> master0 = random_vec(rng, n), grad = random_vec(rng, n);
  // The same gradient at two scales (e.g. clipped or not) gives the same step: Adam is
  // scale-invariant, and the decay term lr·wd·master does not depend on the gradient.
  for (double scale : {1.0, 0.25}) {
    ref::Vec<double> master = master0, m = ref::Vec<double>::Zero(n), v = ref::Vec<double>::Zero(n);
    ref::adamw_update<double>(master, m, v, grad, lr, 0.9, 0.95, eps, wd, 1, scale);
    ref::Vec<double> expected = master0 - lr * (grad.cwiseSign() + wd * master0);
    EXPECT_REL("AdamWRef.DecoupledDecay", "master", rel_err(master, expected), 1e-9);
  }
}

TEST(AdamWRef, MomentsAreExponentialAveragesOfScaledGradients) {
  Rng rng;
  const int n = 30;
  const double b1 = 0.9, b2 = 0.95, scale = 0.5;
  ref::Vec<double> master = random_vec(rng, n), g1 = random_vec(rng, n), g2 = random_vec(rng, n);
  ref::Vec<double> m = ref::Vec<double>::Zero(n), v = ref::Vec<double>::Zero(n);
  ref::adamw_update<double>(master, m, v, g1, 1e-3, b1, b2, 1e-8, 0.0, 1, scale);
  ref::adamw_update<double>(master, m, v, g2, 1e-3, b1, b2, 1e-8, 0.0, 2, scale);
  ref::Vec<double> m_expected = (1 - b1) * (b1 * scale * g1 + scale * g2);
  ref::Vec<double> v_expected = (1 - b2) * (b2 * (scale * g1).cwiseAbs2() + (scale * g2).cwiseAbs2());
  EXPECT_REL("AdamWRef.Moments", "m", rel_err(m, m_expected), 1e-12);
  EXPECT_REL("AdamWRef.Moments", "v", rel_err(v, v_expected), 1e-12);
}

TEST(AdamWRef, GlobalNormSpansAllTensors) {
  Rng rng;
  std::vector<ref::Vec<double>> grads = {random_vec(rng, 7), random_vec(rng, 13), random_vec(rng, 1)};
  double sumsq = 0;
  for (const auto& g : grads)
    for (int i = 0; i < g.size(); i++) sumsq += g(i) * g(i);
  EXPECT_NEAR(ref::global_norm(grads), std::sqrt(sumsq), 1e-12);
}

TEST(AdamWRef, ClipScaleClipsOnlyAboveMaxNormAndZeroDisables) {
  EXPECT_DOUBLE_EQ(ref::clip_scale(0.5, 1.0), 1.0);
  EXPECT_NEAR(ref::clip_scale(4.0, 1.0), 1.0 / (4.0 + 1e-6), 1e-15);
  EXPECT_DOUBLE_EQ(ref::clip_scale(4.0, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(ref::clip_scale(4.0, -1.0), 1.0);
}
