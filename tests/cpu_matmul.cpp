// CPU tests of ref/matmul.hpp: dx and dW match finite differences of Σ G ⊙ (x Wᵀ)
// (G a random upstream gradient) at two small shapes.
#include "test_util.hpp"
#include "../ref/matmul.hpp"

using namespace testutil;

namespace {

void check_matmul_gradients(int N, int IC, int OC) {
  Rng rng;
  ref::Mat<double> x = rng.mat<double>(N, IC);
  ref::Mat<double> W = rng.mat<double>(OC, IC);
  ref::Mat<double> G = rng.mat<double>(N, OC);
  auto loss = [&] { return ref::matmul_forward(x, W).cwiseProduct(G).sum(); };
  ref::Mat<double> numeric_dx = finite_diff(x, loss);
  ref::Mat<double> numeric_dW = finite_diff(W, loss);
  ref::Mat<double> dx, dW;
  ref::matmul_backward(G, x, W, dx, dW);
  EXPECT_REL("MatmulRef.FiniteDiff", "dx", rel_err(numeric_dx, dx), FD_TOL);
  EXPECT_REL("MatmulRef.FiniteDiff", "dW", rel_err(numeric_dW, dW), FD_TOL);
}

}  // namespace

TEST(MatmulRef, ForwardIsRowTimesWeightRow) {
  Rng rng;
  const int N = 4, IC = 6, OC = 3;
  ref::Mat<double> x = rng.mat<double>(N, IC);
  ref::Mat<double> W = rng.mat<double>(OC, IC);
  ref::Mat<double> out = ref::matmul_forward(x, W);
  for (int n = 0; n < N; n++)
    for (int o = 0; o < OC; o++) EXPECT_NEAR(out(n, o), x.row(n).dot(W.row(o)), 1e-12);
}

TEST(MatmulRef, GradientsMatchFiniteDifferencesSmall) { check_matmul_gradients(3, 4, 5); }
TEST(MatmulRef, GradientsMatchFiniteDifferencesTall) { check_matmul_gradients(9, 7, 2); }
