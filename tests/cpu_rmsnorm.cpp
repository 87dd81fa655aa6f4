// CPU tests of ref/rmsnorm.hpp: dx and dw match finite differences of Σ G ⊙ forward(x, w)
// (G a random upstream gradient) at two small shapes; rows of the output have unit RMS when w = 1.
#include "test_util.hpp"
#include "../ref/rmsnorm.hpp"

using namespace testutil;

namespace {

const double kEps = 1e-5;

void check_rmsnorm_gradients(int N, int H) {
  Rng rng;
  ref::Mat<double> x = rng.mat<double>(N, H);
  ref::Mat<double> w = rng.mat<double>(H, 1);  // a matrix so that finite_diff can perturb it
  ref::Mat<double> G = rng.mat<double>(N, H);
  auto loss = [&] {
    ref::Mat<double> out;
    ref::Vec<double> rstd;
    ref::rmsnorm_forward<double>(x, w.col(0), kEps, out, rstd);
    return out.cwiseProduct(G).sum();
  };
  ref::Mat<double> numeric_dx = finite_diff(x, loss);
  ref::Mat<double> numeric_dw = finite_diff(w, loss);
  ref::Mat<double> dx;
  ref::Vec<double> dw;
  ref::rmsnorm_backward<double>(G, x, w.col(0), kEps, dx, dw);
  EXPECT_REL("RmsNormRef.FiniteDiff", "dx", rel_err(numeric_dx, dx), FD_TOL);
  EXPECT_REL("RmsNormRef.FiniteDiff", "dw", rel_err(numeric_dw, dw), FD_TOL);
}

}  // namespace

TEST(RmsNormRef, UnitGainGivesRowsOfUnitRms) {
  Rng rng;
  const int N = 5, H = 16;
  ref::Mat<double> x = rng.mat<double>(N, H, 3.0);
  ref::Mat<double> out;
  ref::Vec<double> rstd;
  ref::rmsnorm_forward<double>(x, ref::Vec<double>::Ones(H), 0.0, out, rstd);
  for (int n = 0; n < N; n++) {
    EXPECT_NEAR(std::sqrt(out.row(n).squaredNorm() / H), 1.0, 1e-12) << "row " << n;
    EXPECT_NEAR(rstd(n), 1.0 / std::sqrt(x.row(n).squaredNorm() / H), 1e-12) << "row " << n;
  }
}

TEST(RmsNormRef, GradientsMatchFiniteDifferencesSmall) { check_rmsnorm_gradients(3, 7); }
TEST(RmsNormRef, GradientsMatchFiniteDifferencesWider) { check_rmsnorm_gradients(6, 19); }
