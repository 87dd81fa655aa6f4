// CPU tests of ref/cross_entropy.hpp: the gradient matches finite differences of dloss · Σ losses
// at two small shapes; losses are positive and each gradient row sums to zero.
#include "test_util.hpp"
#include "../ref/cross_entropy.hpp"

using namespace testutil;

namespace {

ref::MatI random_targets(Rng& rng, int N, int V) {
  ref::MatI targets(N, 1);
  for (int n = 0; n < N; n++) targets(n, 0) = rng.integer(0, V - 1);
  return targets;
}

void check_cross_entropy_gradient(int N, int V) {
  Rng rng;
  ref::Mat<double> logits = rng.mat<double>(N, V, 2.0);
  ref::MatI targets = random_targets(rng, N, V);
  const double dloss = rng.uniform(0.1, 1.0);
  auto loss = [&] {
    ref::Vec<double> lse;
    return dloss * ref::loss_sum(ref::cross_entropy_forward(logits, targets, lse));
  };
  ref::Mat<double> numeric = finite_diff(logits, loss);
  ref::Mat<double> dlogits = ref::cross_entropy_backward(logits, targets, dloss);
  EXPECT_REL("CrossEntropyRef.FiniteDiff", "dlogits", rel_err(numeric, dlogits), FD_TOL);
}

}  // namespace

TEST(CrossEntropyRef, LossIsPositiveAndLseBoundsTheMaxLogit) {
  Rng rng;
  const int N = 6, V = 9;
  ref::Mat<double> logits = rng.mat<double>(N, V, 2.0);
  ref::MatI targets = random_targets(rng, N, V);
  ref::Vec<double> lse;
  ref::Vec<double> losses = ref::cross_entropy_forward(logits, targets, lse);
  for (int n = 0; n < N; n++) {
    EXPECT_GT(losses(n), 0.0) << "row " << n;
    EXPECT_GT(lse(n), logits.row(n).maxCoeff()) << "row " << n;
    EXPECT_LE(lse(n), logits.row(n).maxCoeff() + std::log(double(V))) << "row " << n;
  }
}

TEST(CrossEntropyRef, GradientRowsSumToZero) {
  Rng rng;
  const int N = 5, V = 11;
  ref::Mat<double> logits = rng.mat<double>(N, V, 2.0);
  ref::Mat<double> dlogits = ref::cross_entropy_backward(logits, random_targets(rng, N, V), 0.5);
  for (int n = 0; n < N; n++) EXPECT_NEAR(dlogits.row(n).sum(), 0.0, 1e-12) << "row " << n;
}

TEST(CrossEntropyRef, GradientMatchesFiniteDifferencesSmall) { check_cross_entropy_gradient(3, 5); }
TEST(CrossEntropyRef, GradientMatchesFiniteDifferencesWide) { check_cross_entropy_gradient(4, 23); }
