// GPU tests of ops/matmul.cuh against ref/matmul.hpp: out, out with the residual added in the GEMM's
// epilogue (into a poisoned buffer, the same bits run to run), dx and the += dW at shapes that are not
// multiples of any GEMM tile, and the dx == nullptr path (only dW accumulates); for floatX operands
// (OP_TOL) and for float operands, which run FP32 (no TF32) in both builds and are held to the FP32
// tolerance 1e-5 in both (TF32's 10-bit mantissa would miss it by over an order of magnitude).
#include <cstring>
#include <type_traits>
#include "gpu_util.cuh"
#include "../ops/matmul.cuh"
#include "../ref/matmul.hpp"

using namespace testutil;

namespace {

template <typename T>
void check_matmul(const char* name, int N, int IC, int OC, bool with_dx) {
  REQUIRE_GPU();
  const bool fp32 = std::is_same<T, float>::value;
  const double tol = fp32 ? FP32_TOL : OP_TOL;
  // the values a T buffer holds
  auto held = [fp32](const ref::Mat<double>& m) -> ref::Mat<double> {
    return fp32 ? round_to_float(m) : round_to_floatX(m);
  };
  Rng rng;
  ref::Mat<double> x = held(rng.mat<double>(N, IC));
  ref::Mat<double> W = held(rng.mat<double>(OC, IC));
  ref::Mat<double> dout = held(rng.mat<double>(N, OC));
  ref::Mat<double> dW_initial = held(rng.mat<double>(OC, IC));
  ref::Mat<double> dx_ref, dW_ref;
  ref::matmul_backward(dout, x, W, dx_ref, dW_ref);

  DeviceBuffer<T> d_x = upload<T>(x, Mem::Activations);
  DeviceBuffer<T> d_W = upload<T>(W, Mem::Weights);
  DeviceBuffer<T> d_out((size_t)N * OC, Mem::Activations, "test.out");
  poison(d_out.ptr, d_out.count);
  matmul_forward(d_out.ptr, d_x.ptr, d_W.ptr, N, IC, OC, 0);
  EXPECT_REL(name, "out", rel_err(download(d_out.ptr, N, OC), ref::matmul_forward(x, W)), tol);

  // out = residual + x Wᵀ: into a poisoned buffer, then again into it (the same bits)
  ref::Mat<double> residual = held(rng.mat<double>(N, OC));
  DeviceBuffer<T> d_residual = upload<T>(residual, Mem::Activations);
  poison(d_out.ptr, d_out.count);
  matmul_forward_residual(d_out.ptr, d_residual.ptr, d_x.ptr, d_W.ptr, N, IC, OC, 0);
  const std::vector<T> with_residual = download_vec(d_out.ptr, d_out.count);
  EXPECT_REL(name, "out(residual +)", rel_err(download(d_out.ptr, N, OC), ref::matmul_forward_residual(residual, x, W)),
             tol);
  matmul_forward_residual(d_out.ptr, d_residual.ptr, d_x.ptr, d_W.ptr, N, IC, OC, 0);
  EXPECT_EQ(0, memcmp(with_residual.data(), download_vec(d_out.ptr, d_out.count).data(), d_out.bytes()))
      << name << ": two runs differ";
  EXPECT_REL(name, "residual unchanged", rel_err(download(d_residual.ptr, N, OC), residual), 0.0);

  DeviceBuffer<T> d_dout = upload<T>(dout, Mem::Activations);
  DeviceBuffer<T> d_dW = upload<T>(dW_initial, Mem::Grads);
  DeviceBuffer<T> d_dx;
  if (with_dx) {
    d_dx = DeviceBuffer<T>((size_t)N * IC, Mem::Activations, "test.dx");
    poison(d_dx.ptr, d_dx.count);
  }
  matmul_backward(d_dx.ptr, d_dW.ptr, d_dout.ptr, d_x.ptr, d_W.ptr, N, IC, OC, 0);
  if (with_dx) EXPECT_REL(name, "dx", rel_err(download(d_dx.ptr, N, IC), dx_ref), tol);
  ref::Mat<double> dW_expected = dW_initial + dW_ref;
  EXPECT_REL(name, "dW(+=)", rel_err(download(d_dW.ptr, OC, IC), dW_expected), tol);
}

}  // namespace

TEST(MatmulGpu, MatchesReferenceSmallOddShape) { check_matmul<floatX>("MatmulGpu.N37IC72OC45", 37, 72, 45, true); }
TEST(MatmulGpu, MatchesReferenceMediumShape) { check_matmul<floatX>("MatmulGpu.N300IC128OC200", 300, 128, 200, true); }
TEST(MatmulGpu, MatchesReferenceWideOutput) { check_matmul<floatX>("MatmulGpu.N513IC384OC1000", 513, 384, 1000, true); }
TEST(MatmulGpu, BackwardWithoutDxOnlyAccumulatesDW) {
  check_matmul<floatX>("MatmulGpu.NoDx.N77IC40OC33", 77, 40, 33, false);
}
TEST(MatmulGpu, Fp32OperandsSmallOddShape) { check_matmul<float>("MatmulGpu.fp32.N37IC75OC5", 37, 75, 5, true); }
TEST(MatmulGpu, Fp32OperandsWideOutput) { check_matmul<float>("MatmulGpu.fp32.N513IC384OC1000", 513, 384, 1000, true); }
TEST(MatmulGpu, Fp32BackwardWithoutDx) { check_matmul<float>("MatmulGpu.fp32.NoDx.N77IC40OC33", 77, 40, 33, false); }
