// tests/gpu_rope.cu — ops/rope.cuh against ref/rope.hpp: forward and backward, out of place
// and in place, at several shapes (every head dim the attention supports, T up to 1024 so that
// large angles are covered, hd 6 on the element path, N not a multiple of a block's tokens), the
// same bits in 16-byte pieces and element by element, and the refusal of an odd head dim.
#include <cstring>
#include "../ops/rope.cuh"
#include "../ref/rope.hpp"
#include "gpu_util.cuh"

using ref::Mat;
using testutil::download;
using testutil::download_vec;
using testutil::poison;
using testutil::round_to_floatX;
using testutil::upload;
using testutil::upload_vec;

namespace {

struct RopeCase {
  int B, T, nh, hd;
};

const RopeCase kCases[] = {
    {2, 37, 3, 32},
    {1, 200, 4, 64},
    {2, 67, 2, 128},
    {1, 1024, 2, 64},
    {3, 5, 1, 6},  // head dim outside the attention's set: RoPE takes any even hd (hd/2 = 3: by element)
};

const double kTheta = 10000.0;

std::string case_name(const char* test, const RopeCase& c) {
  char buf[128];
  snprintf(buf, sizeof(buf), "%s B%d T%d nh%d hd%d", test, c.B, c.T, c.nh, c.hd);
  return buf;
}

// Fresh qkv and dqkv of a case, rounded to what a floatX buffer holds, and the reference's results.
struct RopeData {
  int N, cols;  // rows B·T, row width 3·nh·hd
  Mat<double> x, dy, y_ref, dx_ref;
};

RopeData rope_data(const RopeCase& c, testutil::Rng& rng) {
  RopeData d;
  d.N = c.B * c.T;
  d.cols = 3 * c.nh * c.hd;
  d.x = round_to_floatX(rng.mat<double>(d.N, d.cols));
  d.dy = round_to_floatX(rng.mat<double>(d.N, d.cols));
  d.y_ref = ref::rope_forward(d.x, c.B, c.T, c.nh, c.hd, kTheta);
  d.dx_ref = ref::rope_backward(d.dy, c.B, c.T, c.nh, c.hd, kTheta);
  return d;
}

TEST(GpuRope, ForwardAndBackwardMatchReference) {
  REQUIRE_GPU();
  for (const RopeCase& c : kCases) {
    testutil::Rng rng;
    const RopeData d = rope_data(c, rng);
    const int N = d.N, cols = d.cols;
    DeviceBuffer<floatX> d_x = upload<floatX>(d.x);
    DeviceBuffer<floatX> d_dy = upload<floatX>(d.dy);
    DeviceBuffer<floatX> d_y((size_t)N * cols, Mem::Activations, "test.rope.y");
    DeviceBuffer<floatX> d_dx((size_t)N * cols, Mem::Grads, "test.rope.dx");
    poison(d_y.ptr, d_y.count);
    poison(d_dx.ptr, d_dx.count);
    rope_forward(d_y.ptr, d_x.ptr, c.B, c.T, c.nh, c.hd, (float)kTheta, 0);
    rope_backward(d_dx.ptr, d_dy.ptr, c.B, c.T, c.nh, c.hd, (float)kTheta, 0);

    const std::string name = case_name("GpuRope", c);
    EXPECT_REL(name.c_str(), "qkv_out", testutil::rel_err(download(d_y.ptr, N, cols), d.y_ref), OP_TOL);
    EXPECT_REL(name.c_str(), "dqkv_in", testutil::rel_err(download(d_dx.ptr, N, cols), d.dx_ref), OP_TOL);
  }
}

TEST(GpuRope, InPlaceMatchesReference) {
  REQUIRE_GPU();
  for (const RopeCase& c : {kCases[0], kCases[1]}) {
    testutil::Rng rng;
    const RopeData d = rope_data(c, rng);
    DeviceBuffer<floatX> d_x = upload<floatX>(d.x);
    DeviceBuffer<floatX> d_dy = upload<floatX>(d.dy);
    rope_forward(d_x.ptr, d_x.ptr, c.B, c.T, c.nh, c.hd, (float)kTheta, 0);
    rope_backward(d_dy.ptr, d_dy.ptr, c.B, c.T, c.nh, c.hd, (float)kTheta, 0);

    const std::string name = case_name("GpuRope.InPlace", c);
    EXPECT_REL(name.c_str(), "qkv_out", testutil::rel_err(download(d_x.ptr, d.N, d.cols), d.y_ref), OP_TOL);
    EXPECT_REL(name.c_str(), "dqkv_in", testutil::rel_err(download(d_dy.ptr, d.N, d.cols), d.dx_ref), OP_TOL);
  }
}

// hd/2 a multiple of ROW_PIECE: with every buffer at an aligned address the kernels take 16-byte
// pieces, with every buffer one element past it they take single elements. Forward out of place (v
// copied), backward in place; each path against the reference, and the two paths' bits equal.
TEST(GpuRope, PiecesAndElementsGiveTheSameBits) {
  REQUIRE_GPU();
  const RopeCase c{2, 67, 3, 64};
  testutil::Rng rng;
  const RopeData d = rope_data(c, rng);
  const int N = d.N, cols = d.cols;
  auto placed = [&](const Mat<double>& m, int offset) {  // m at `offset` elements past a pool address
    std::vector<floatX> host(offset + m.size(), from_float<floatX>((float)rng.normal()));
    for (Eigen::Index i = 0; i < m.size(); i++) host[offset + i] = from_float<floatX>((float)m.data()[i]);
    return upload_vec(host, Mem::Activations, "test.rope.placed");
  };
  std::vector<floatX> y_bits[2], dx_bits[2];
  for (int offset : {0, 1}) {
    const std::string name = case_name(offset == 0 ? "GpuRope.Pieces" : "GpuRope.Elements", c);
    DeviceBuffer<floatX> d_x = placed(d.x, offset), d_dy = placed(d.dy, offset);
    DeviceBuffer<floatX> d_y(offset + (size_t)N * cols, Mem::Activations, "test.rope.y");
    poison(d_y.ptr, d_y.count);
    EXPECT_EQ(row_pieces(c.hd / 2, {d_y.ptr + offset, d_x.ptr + offset}), offset == 0) << name;
    rope_forward(d_y.ptr + offset, d_x.ptr + offset, c.B, c.T, c.nh, c.hd, (float)kTheta, 0);
    rope_backward(d_dy.ptr + offset, d_dy.ptr + offset, c.B, c.T, c.nh, c.hd, (float)kTheta, 0);
    EXPECT_REL(name.c_str(), "qkv_out", testutil::rel_err(download(d_y.ptr + offset, N, cols), d.y_ref), OP_TOL);
    EXPECT_REL(name.c_str(), "dqkv_in", testutil::rel_err(download(d_dy.ptr + offset, N, cols), d.dx_ref), OP_TOL);
    y_bits[offset] = download_vec(d_y.ptr + offset, (size_t)N * cols);
    dx_bits[offset] = download_vec(d_dy.ptr + offset, (size_t)N * cols);
  }
  EXPECT_EQ(0, memcmp(y_bits[0].data(), y_bits[1].data(), y_bits[0].size() * sizeof(floatX))) << "forward";
  EXPECT_EQ(0, memcmp(dx_bits[0].data(), dx_bits[1].data(), dx_bits[0].size() * sizeof(floatX))) << "backward";
}

// An odd head dim is refused before any device work (runs with or without a GPU).
TEST(GpuRopeDeathTest, RefusesOddHeadDim) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(rope_forward(nullptr, nullptr, 1, 8, 2, 7, 10000.f, 0), "rope_forward \\(B=1 T=8 nh=2 hd=7\\)");
}

}  // namespace
