// GPU tests of ops/rmsnorm.cuh against ref/rmsnorm.hpp: out, rstd, dx and the += dw at shapes
// that are not multiples of the warp/block sizes: backward blocks of 8 warps with idle warps in the
// last block, G near its bound 512 (rows_per_block = ceil(N / 512), not a multiple of the warps),
// fewer warps per block (5) for wide rows, one warp per block past the 48 KiB default shared memory
// (H 16000), H in 16-byte pieces and not; dx both as = and as += (the residual stream's gradient:
// its update read back as dx_after − dx_before); bitwise reproducibility; and the backward's plan
// (host only).
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
  ref::Mat<double> dx_initial;              // N x H: what dx holds before a backward that adds (+=)
};

RmsNormCase make_case(int N, int H) {
  Rng rng;
  RmsNormCase c{N, H, round_to_floatX(rng.mat<double>(N, H)), round_to_floatX(rng.mat<double>(H, 1)),
                round_to_floatX(rng.mat<double>(N, H)), round_to_floatX(rng.mat<double>(H, 1)),
                round_to_floatX(rng.mat<double>(N, H))};
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
  for (bool accumulate : {false, true}) {
    DeviceBuffer<floatX> d_dx = upload<floatX>(c.dx_initial, Mem::Activations);
    DeviceBuffer<floatX> d_dw = upload<floatX>(c.dw_initial, Mem::Grads);
    if (!accumulate) poison(d_dx.ptr, d_dx.count);
    size_t workspace_before = pool().live(Mem::Workspace);
    rmsnorm_backward(d_dx.ptr, d_dw.ptr, d_dout.ptr, d_x.ptr, d_w.ptr, d_rstd.ptr, N, H, 0, accumulate);
    const ref::Mat<double> dx = download(d_dx.ptr, N, H);
    if (accumulate) EXPECT_REL(name, "dx(+=) update", rel_err(ref::Mat<double>(dx - c.dx_initial), dx_ref), OP_TOL);
    else EXPECT_REL(name, "dx", rel_err(dx, dx_ref), OP_TOL);
    ref::Vec<double> dw_expected = c.dw_initial.col(0) + dw_ref;
    EXPECT_REL(name, "dw(+=)", rel_err(download(d_dw.ptr, H, 1), dw_expected), OP_TOL);
    EXPECT_EQ(pool().live(Mem::Workspace), workspace_before) << "backward must return its workspace";
  }
}

}  // namespace

TEST(RmsNormGpu, MatchesReferenceSmallOddShape) { check_rmsnorm("RmsNormGpu.N37H72", 37, 72); }
TEST(RmsNormGpu, MatchesReferenceHiddenPastBlockSize) { check_rmsnorm("RmsNormGpu.N300H1000", 300, 1000); }
TEST(RmsNormGpu, MatchesReferenceSeveralRowsPerBackwardBlock) { check_rmsnorm("RmsNormGpu.N2500H136", 2500, 136); }
TEST(RmsNormGpu, MatchesReferenceHiddenPastDefaultSharedMemory) { check_rmsnorm("RmsNormGpu.N5H16000", 5, 16000); }
// H not a multiple of ROW_PIECE: one element per thread instead of 16-byte pieces
TEST(RmsNormGpu, MatchesReferenceHiddenNotInWholePieces) { check_rmsnorm("RmsNormGpu.N1100H70", 1100, 70); }
// 65 rows per block (ceil(N / 512) > 8 warps): G = 509, the last block one row
TEST(RmsNormGpu, MatchesReferenceAtTheBlockBound) { check_rmsnorm("RmsNormGpu.N33021H72", 33021, 72); }
// a warp's dw partial 12 KiB: 5 warps per block
TEST(RmsNormGpu, MatchesReferenceFewerWarpsPerBlock) { check_rmsnorm("RmsNormGpu.N1000H3000", 1000, 3000); }

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

// The backward's schedule (host only, runs without a GPU): G within the Workspace bound, covering
// every row with no empty block; a warp's partial holds the whole row; a block's partials within the
// shared-memory budget unless one warp's alone pass it; at B1's shape 8 warps of 4 rows each, at the
// default model's 8 warps of one row each, 512 blocks (4 per SM of an H200:
// notes/speed.md, 'The memory-bound kernels').
TEST(RmsNormHost, BackwardPlanBoundsBlocksAndSharedMemory) {
  for (int NV : {1, ROW_PIECE})
    for (int H : {64, 72, 1000, 1024, 3000, 16000, 40000})
      for (int N : {1, 37, 2500, 16384, 33001, 1 << 20}) {
        if (H % NV != 0) continue;
        const RmsNormBackwardPlan p = rmsnorm_backward_plan(N, H, NV);
        SCOPED_TRACE("NV=" + std::to_string(NV) + " H=" + std::to_string(H) + " N=" + std::to_string(N));
        EXPECT_LE(p.blocks, RMSNORM_BACKWARD_MAX_BLOCKS);
        EXPECT_GE((long long)p.blocks * p.rows_per_block, N);
        EXPECT_LT((long long)(p.blocks - 1) * p.rows_per_block, N);
        EXPECT_GE(p.warp_slots, H);
        EXPECT_GE(p.warps, 1);
        EXPECT_LE(p.warps, RMSNORM_BACKWARD_MAX_WARPS);
        EXPECT_TRUE(p.warps == 1 || p.warps * p.warp_slots * (int)sizeof(float) <= RMSNORM_BACKWARD_SHARED_BYTES);
        EXPECT_GE(p.rows_per_block, p.warps * RMSNORM_BACKWARD_ROWS_PER_WARP);
      }
  const RmsNormBackwardPlan train = rmsnorm_backward_plan(16384, 1024, ROW_PIECE);
  EXPECT_EQ(train.warps, 8);
  EXPECT_EQ(train.rows_per_block, 32);
  EXPECT_EQ(train.blocks, 512);
  const RmsNormBackwardPlan small = rmsnorm_backward_plan(4096, 384, ROW_PIECE);
  EXPECT_EQ(small.warps, 8);
  EXPECT_EQ(small.rows_per_block, 8);
  EXPECT_EQ(small.blocks, 512);
  EXPECT_EQ(rmsnorm_backward_plan(1000, 3000, ROW_PIECE).warps, 5);
  EXPECT_EQ(rmsnorm_backward_plan(5, 16000, ROW_PIECE).warps, 1);
}
