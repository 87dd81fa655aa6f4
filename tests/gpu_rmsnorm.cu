// GPU tests of ops/rmsnorm.cuh against ref/rmsnorm.hpp: out, rstd, dx and the += dw at shapes
// that are not multiples of the warp/block sizes, with several rows per backward block
// (N > 1024), with H past the 48 KiB default shared memory, with H in 16-byte pieces and not, and
// bitwise reproducibility.
#include <cstring>
#include "gpu_util.cuh"
#include "../ops/rmsnorm.cuh"
#include "../ref/rmsnorm.hpp"

using namespace testutil;

namespace {

const float kEps = 1e-5f;

struct RmsNormCase {
  int N, H;
  ref::Mat<double> x, w, dout, dw_initial;  // w and dw_initial are H x 1
};

RmsNormCase make_case(int N, int H) {
  Rng rng;
  RmsNormCase c{N, H, round_to_floatX(rng.mat<double>(N, H)), round_to_floatX(rng.mat<double>(H, 1)),
                round_to_floatX(rng.mat<double>(N, H)), round_to_floatX(rng.mat<double>(H, 1))};
  return c;
}

void check_rmsnorm(const char* name, int N, int H) {
  REQUIRE_GPU();
  RmsNormCase c = make_case(N, H);
  ref::Mat<double> out_ref, dx_ref;
  ref::Vec<double> rstd_ref, dw_ref;
  ref::rmsnorm_forward<double>(c.x, c.w.col(0), kEps, out_ref, rstd_ref);
  ref::rmsnorm_backward<double>(c.dout, c.x, c.w.col(0), kEps, dx_ref, dw_ref);

  DeviceBuffer<floatX> d_x = upload<floatX>(c.x, Mem::Activations);
  DeviceBuffer<floatX> d_w = upload<floatX>(c.w, Mem::Weights);
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.out");
  DeviceBuffer<float> d_rstd(N, Mem::Activations, "test.rstd");
  poison(d_out.ptr, d_out.count);
  poison(d_rstd.ptr, d_rstd.count);
  rmsnorm_forward(d_out.ptr, d_rstd.ptr, d_x.ptr, d_w.ptr, N, H, kEps, 0);
  EXPECT_REL(name, "out", rel_err(download(d_out.ptr, N, H), out_ref), OP_TOL);
  EXPECT_REL(name, "rstd", rel_err(download(d_rstd.ptr, N, 1), rstd_ref), OP_TOL);

  DeviceBuffer<floatX> d_dout = upload<floatX>(c.dout, Mem::Activations);
  DeviceBuffer<floatX> d_dx((size_t)N * H, Mem::Activations, "test.dx");
  DeviceBuffer<floatX> d_dw = upload<floatX>(c.dw_initial, Mem::Grads);
  poison(d_dx.ptr, d_dx.count);
  size_t workspace_before = pool().live(Mem::Workspace);
  rmsnorm_backward(d_dx.ptr, d_dw.ptr, d_dout.ptr, d_x.ptr, d_w.ptr, d_rstd.ptr, N, H, 0);
  EXPECT_REL(name, "dx", rel_err(download(d_dx.ptr, N, H), dx_ref), OP_TOL);
  ref::Vec<double> dw_expected = c.dw_initial.col(0) + dw_ref;
  EXPECT_REL(name, "dw(+=)", rel_err(download(d_dw.ptr, H, 1), dw_expected), OP_TOL);
  EXPECT_EQ(pool().live(Mem::Workspace), workspace_before) << "backward must return its workspace";
}

}  // namespace

TEST(RmsNormGpu, MatchesReferenceSmallOddShape) { check_rmsnorm("RmsNormGpu.N37H72", 37, 72); }
TEST(RmsNormGpu, MatchesReferenceHiddenPastBlockSize) { check_rmsnorm("RmsNormGpu.N300H1000", 300, 1000); }
TEST(RmsNormGpu, MatchesReferenceSeveralRowsPerBackwardBlock) { check_rmsnorm("RmsNormGpu.N2500H136", 2500, 136); }
TEST(RmsNormGpu, MatchesReferenceHiddenPastDefaultSharedMemory) { check_rmsnorm("RmsNormGpu.N5H16000", 5, 16000); }
// H not a multiple of ROW_PIECE: one element per thread instead of 16-byte pieces
TEST(RmsNormGpu, MatchesReferenceHiddenNotInWholePieces) { check_rmsnorm("RmsNormGpu.N1100H70", 1100, 70); }

TEST(RmsNormGpu, BackwardIsBitwiseReproducible) {
  REQUIRE_GPU();
  const int N = 3001, H = 264;
  RmsNormCase c = make_case(N, H);
  DeviceBuffer<floatX> d_x = upload<floatX>(c.x, Mem::Activations);
  DeviceBuffer<floatX> d_w = upload<floatX>(c.w, Mem::Weights);
  DeviceBuffer<floatX> d_dout = upload<floatX>(c.dout, Mem::Activations);
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.out");
  DeviceBuffer<float> d_rstd(N, Mem::Activations, "test.rstd");
  rmsnorm_forward(d_out.ptr, d_rstd.ptr, d_x.ptr, d_w.ptr, N, H, kEps, 0);
  std::vector<floatX> dx_runs[2], dw_runs[2];
  for (int run = 0; run < 2; run++) {
    DeviceBuffer<floatX> d_dx((size_t)N * H, Mem::Activations, "test.dx");
    DeviceBuffer<floatX> d_dw = upload<floatX>(c.dw_initial, Mem::Grads);
    rmsnorm_backward(d_dx.ptr, d_dw.ptr, d_dout.ptr, d_x.ptr, d_w.ptr, d_rstd.ptr, N, H, 0);
    dx_runs[run] = download_vec(d_dx.ptr, d_dx.count);
    dw_runs[run] = download_vec(d_dw.ptr, d_dw.count);
  }
  EXPECT_EQ(0, memcmp(dx_runs[0].data(), dx_runs[1].data(), dx_runs[0].size() * sizeof(floatX))) << "dx differs";
  EXPECT_EQ(0, memcmp(dw_runs[0].data(), dw_runs[1].data(), dw_runs[0].size() * sizeof(floatX))) << "dw differs";
}
