// GPU tests of ops/matmul.cuh against ref/matmul.hpp: out, dx and the += dW at shapes that
// are not multiples of any GEMM tile, and the dx == nullptr path (only dW accumulates).
#include "gpu_util.cuh"
#include "../ops/matmul.cuh"
#include "../ref/matmul.hpp"

using namespace testutil;

namespace {

void check_matmul(const char* name, int N, int IC, int OC, bool with_dx) {
  REQUIRE_GPU();
  Rng rng;
  ref::Mat<double> x = round_to_floatX(rng.mat<double>(N, IC));
  ref::Mat<double> W = round_to_floatX(rng.mat<double>(OC, IC));
  ref::Mat<double> dout = round_to_floatX(rng.mat<double>(N, OC));
  ref::Mat<double> dW_initial = round_to_floatX(rng.mat<double>(OC, IC));
  ref::Mat<double> dx_ref, dW_ref;
  ref::matmul_backward(dout, x, W, dx_ref, dW_ref);

  DeviceBuffer<floatX> d_x = upload<floatX>(x, Mem::Activations);
  DeviceBuffer<floatX> d_W = upload<floatX>(W, Mem::Weights);
  DeviceBuffer<floatX> d_out((size_t)N * OC, Mem::Activations, "test.out");
  poison(d_out.ptr, d_out.count);
  matmul_forward(d_out.ptr, d_x.ptr, d_W.ptr, N, IC, OC, 0);
  EXPECT_REL(name, "out", rel_err(download(d_out.ptr, N, OC), ref::matmul_forward(x, W)), OP_TOL);

  DeviceBuffer<floatX> d_dout = upload<floatX>(dout, Mem::Activations);
  DeviceBuffer<floatX> d_dW = upload<floatX>(dW_initial, Mem::Grads);
  DeviceBuffer<floatX> d_dx;
  if (with_dx) {
    d_dx = DeviceBuffer<floatX>((size_t)N * IC, Mem::Activations, "test.dx");
    poison(d_dx.ptr, d_dx.count);
  }
  matmul_backward(d_dx.ptr, d_dW.ptr, d_dout.ptr, d_x.ptr, d_W.ptr, N, IC, OC, 0);
  if (with_dx) EXPECT_REL(name, "dx", rel_err(download(d_dx.ptr, N, IC), dx_ref), OP_TOL);
  ref::Mat<double> dW_expected = dW_initial + dW_ref;
  EXPECT_REL(name, "dW(+=)", rel_err(download(d_dW.ptr, OC, IC), dW_expected), OP_TOL);
}

}  // namespace

TEST(MatmulGpu, MatchesReferenceSmallOddShape) { check_matmul("MatmulGpu.N37IC72OC45", 37, 72, 45, true); }
TEST(MatmulGpu, MatchesReferenceMediumShape) { check_matmul("MatmulGpu.N300IC128OC200", 300, 128, 200, true); }
TEST(MatmulGpu, MatchesReferenceWideOutput) { check_matmul("MatmulGpu.N513IC384OC1000", 513, 384, 1000, true); }
TEST(MatmulGpu, BackwardWithoutDxOnlyAccumulatesDW) { check_matmul("MatmulGpu.NoDx.N77IC40OC33", 77, 40, 33, false); }
