// tests/gpu_rope.cu — ops/rope.cuh against ref/rope.hpp: the angle table against the host's double
// cos/sin, forward and backward, out of place and in place, at several shapes (every head dim the
// attention supports, T up to 1024 so that large angles are covered, hd 6 on the element path, N not
// a multiple of a block's tokens, T below the table's T_max), the same bits in 16-byte pieces and
// element by element, and the refusal of an odd head dim, of a T past the table and of another hd.
#include <algorithm>
#include <cmath>
#include <cstring>
#include "../ops/rope.cuh"
#include "../ref/rope.hpp"
#include "gpu_util.cuh"
#include "rope_table.cuh"

using testutil::AngleTable;
using testutil::angle_table;
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

const RopeCase kRopeCases[] = {
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
  ref::Mat<double> x, dy, y_ref, dx_ref;
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

// The angle table of each case's T and hd, at a fresh theta, against cos/sin of t·theta^(−2i/hd)
// computed on the host in double and rounded to float: every entry within one float ulp of the host's
// (the device's double pow and sincos may differ from the host's in the last bits, which can move the
// float rounding by one), plus what 4 double ulps of the angle move it by (which matters only within
// ~1e-5 of zero, where a float ulp is smaller than that).
TEST(GpuRope, AngleTableMatchesHostDoubleWithinOneUlp) {
  REQUIRE_GPU();
  for (const RopeCase& c : kRopeCases) {
    testutil::Rng rng;
    const float theta = (float)rng.uniform(100, 1e6);
    const AngleTable table = angle_table(c.T, c.hd, theta);
    const int half = c.hd / 2;
    const size_t entries = (size_t)c.T * half;
    const std::vector<float> got = download_vec(table.angles.cos_sin, 2 * entries);  // [2, T, hd/2]
    size_t differ = 0, past_one_ulp = 0, past_tolerance = 0;
    double max_abs = 0, max_ulps = 0;
    for (int t = 0; t < c.T; t++)
      for (int i = 0; i < half; i++) {
        const double angle = (double)t * std::pow((double)theta, -2.0 * i / c.hd);
        const double want[2] = {std::cos(angle), std::sin(angle)};
        for (int part = 0; part < 2; part++) {
          const float host = (float)want[part], device = got[part * entries + (size_t)t * half + i];
          const double ulp = std::nextafter(std::fabs(host), INFINITY) - std::fabs(host);
          const double diff = std::fabs((double)device - (double)host);
          differ += device != host;
          past_one_ulp += diff > ulp;
          max_abs = std::max(max_abs, diff);
          max_ulps = std::max(max_ulps, diff / ulp);
          past_tolerance += diff > ulp + 4 * angle * 0x1p-52;
        }
      }
    printf("[table] T_max %d hd %d theta %.1f: %zu of %zu entries differ from the host's (%zu by more than one ulp), "
           "max |diff| %.3e, max %.2f ulp\n",
           c.T, c.hd, theta, differ, 2 * entries, past_one_ulp, max_abs, max_ulps);
    EXPECT_EQ(past_tolerance, 0u) << case_name("GpuRope.AngleTable", c) << " theta " << theta;
  }
}

TEST(GpuRope, ForwardAndBackwardMatchReference) {
  REQUIRE_GPU();
  for (const RopeCase& c : kRopeCases) {
    testutil::Rng rng;
    const RopeData d = rope_data(c, rng);
    const int N = d.N, cols = d.cols;
    DeviceBuffer<floatX> d_x = upload<floatX>(d.x);
    DeviceBuffer<floatX> d_dy = upload<floatX>(d.dy);
    DeviceBuffer<floatX> d_y((size_t)N * cols, Mem::Activations, "test.rope.y");
    DeviceBuffer<floatX> d_dx((size_t)N * cols, Mem::Grads, "test.rope.dx");
    poison(d_y.ptr, d_y.count);
    poison(d_dx.ptr, d_dx.count);
    const AngleTable table = angle_table(c.T, c.hd, kTheta);
    rope_forward(d_y.ptr, d_x.ptr, table.angles, c.B, c.T, c.nh, c.hd, 0);
    rope_backward(d_dx.ptr, d_dy.ptr, table.angles, c.B, c.T, c.nh, c.hd, 0);

    const std::string name = case_name("GpuRope", c);
    EXPECT_REL(name.c_str(), "qkv_out", testutil::rel_err(download(d_y.ptr, N, cols), d.y_ref), OP_TOL);
    EXPECT_REL(name.c_str(), "dqkv_in", testutil::rel_err(download(d_dx.ptr, N, cols), d.dx_ref), OP_TOL);
  }
}

// In place, from a table made for longer sequences (T_max = 2T: a pass shorter than the model's seq_len).
TEST(GpuRope, InPlaceMatchesReference) {
  REQUIRE_GPU();
  for (const RopeCase& c : {kRopeCases[0], kRopeCases[1]}) {
    testutil::Rng rng;
    const RopeData d = rope_data(c, rng);
    DeviceBuffer<floatX> d_x = upload<floatX>(d.x);
    DeviceBuffer<floatX> d_dy = upload<floatX>(d.dy);
    const AngleTable table = angle_table(2 * c.T, c.hd, kTheta);
    rope_forward(d_x.ptr, d_x.ptr, table.angles, c.B, c.T, c.nh, c.hd, 0);
    rope_backward(d_dy.ptr, d_dy.ptr, table.angles, c.B, c.T, c.nh, c.hd, 0);

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
  auto placed = [&](const ref::Mat<double>& m, int offset) {  // m at `offset` elements past a pool address
    std::vector<floatX> host(offset + m.size(), from_float<floatX>((float)rng.normal()));
    for (Eigen::Index i = 0; i < m.size(); i++) host[offset + i] = from_float<floatX>((float)m.data()[i]);
    return upload_vec(host, Mem::Activations, "test.rope.placed");
  };
  const AngleTable table = angle_table(c.T, c.hd, kTheta);
  std::vector<floatX> y_bits[2], dx_bits[2];
  for (int offset : {0, 1}) {
    const std::string name = case_name(offset == 0 ? "GpuRope.Pieces" : "GpuRope.Elements", c);
    DeviceBuffer<floatX> d_x = placed(d.x, offset), d_dy = placed(d.dy, offset);
    DeviceBuffer<floatX> d_y(offset + (size_t)N * cols, Mem::Activations, "test.rope.y");
    poison(d_y.ptr, d_y.count);
    EXPECT_EQ(row_pieces(c.hd / 2, {d_y.ptr + offset, d_x.ptr + offset}), offset == 0) << name;
    rope_forward(d_y.ptr + offset, d_x.ptr + offset, table.angles, c.B, c.T, c.nh, c.hd, 0);
    rope_backward(d_dy.ptr + offset, d_dy.ptr + offset, table.angles, c.B, c.T, c.nh, c.hd, 0);
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
  const RopeAngles angles{nullptr, 8, 7};
  EXPECT_DEATH(rope_forward(nullptr, nullptr, angles, 1, 8, 2, 7, 0), "rope_forward \\(B=1 T=8 nh=2 hd=7\\)");
}

// A T past the table's positions, and a head dim other than the table's, are refused before any device
// work (runs with or without a GPU).
TEST(GpuRopeDeathTest, RefusesTLongerThanTheTableAndAnotherHeadDim) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const RopeAngles angles{nullptr, 8, 64};
  EXPECT_DEATH(rope_forward(nullptr, nullptr, angles, 1, 9, 2, 64, 0),
               "rope_forward \\(B=1 T=9 nh=2 hd=64 T_max=8 table hd=64\\): .*T must be <= T_max");
  EXPECT_DEATH(rope_backward(nullptr, nullptr, angles, 2, 8, 2, 32, 0),
               "rope_backward \\(B=2 T=8 nh=2 hd=32 T_max=8 table hd=64\\): .*hd the table's");
}

}  // namespace
