// tests/gpu_attention.cu — ops/attention.cuh against ref/attention.hpp: out, lse and the q, k, v
// gradients at several shapes (T not a multiple of the 64-row tile, every supported head dim,
// T = 1 and 2, B > 1 and nh > 1), RoPE's backward in the backward's stores, bitwise determinism, and
// the refusal of unsupported head dims and of a RoPE table too short.
// The BF16 build runs hd 64 and 128 on the tensor-core kernels (ops/attention_mma.cuh: wgmma at hd 64
// in sm_90a builds, mma.sync otherwise) and hd 32 on the SIMT ones; every form a build has is checked
// at hd 64 and 128 too (EveryKernelFormMatchesReference).
#include <cstring>
#include <optional>
#include <vector>
#include "../ops/attention.cuh"
#include "../ref/attention.hpp"
#include "../ref/rope.hpp"
#include "gpu_util.cuh"
#include "rope_table.cuh"

using ref::Mat;
using testutil::download;
using testutil::poison;
using testutil::round_to_floatX;
using testutil::upload;

namespace {

struct AttnCase {
  int B, T, nh, hd;
};

const AttnCase kAttentionCases[] = {
    {2, 37, 3, 32},   // one partial tile
    {1, 200, 4, 64},  // 4 tiles, the last partial
    {2, 130, 2, 128}, // 3 tiles, the last with 2 rows
    {1, 128, 2, 64},  // exact multiple of the tile
    {3, 2, 2, 32},    // two tokens per sequence
    {2, 37, 3, 64},   // one partial tile, hd 64
    {3, 37, 2, 128},  // one partial tile, hd 128
    {2, 1000, 2, 64}, // 16 tiles, the last with 40 rows
    {1, 1000, 3, 128},
    {2, 2, 3, 64},    // two tokens, hd 64 / 128
    {2, 2, 2, 128},
    {2, 1, 3, 128},   // one token (forward only in BackwardMatchesReference)
};

std::string case_name(const char* test, const AttnCase& c) {
  char buf[128];
  snprintf(buf, sizeof(buf), "%s B%d T%d nh%d hd%d", test, c.B, c.T, c.nh, c.hd);
  return buf;
}

// The q (p = 0), k (1) or v (2) columns of a [N, 3H] matrix.
Mat<double> part(const Mat<double>& m, int p, int H) { return m.middleCols(p * H, H); }

TEST(GpuAttention, ForwardMatchesReference) {
  REQUIRE_GPU();
  for (const AttnCase& c : kAttentionCases) {
    testutil::Rng rng;
    const int N = c.B * c.T, H = c.nh * c.hd;
    const Mat<double> qkv = round_to_floatX(rng.mat<double>(N, 3 * H));
    Mat<double> out_ref, lse_ref;
    ref::attention_forward(qkv, c.B, c.T, c.nh, c.hd, out_ref, lse_ref);

    DeviceBuffer<floatX> d_qkv = upload<floatX>(qkv);
    DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.attention.out");
    DeviceBuffer<float> d_lse((size_t)c.B * c.nh * c.T, Mem::Activations, "test.attention.lse");
    poison(d_out.ptr, d_out.count);
    poison(d_lse.ptr, d_lse.count);
    attention_forward(d_out.ptr, d_lse.ptr, d_qkv.ptr, c.B, c.T, c.nh, c.hd, 0);
    const Mat<double> out = download(d_out.ptr, N, H);
    const Mat<double> lse = download(d_lse.ptr, c.B * c.nh, c.T);

    const std::string name = case_name("GpuAttention.Fwd", c);
    EXPECT_REL(name.c_str(), "out", testutil::rel_err(out, out_ref), OP_TOL);
    EXPECT_REL(name.c_str(), "lse", testutil::rel_err(lse, lse_ref), OP_TOL);
  }
}

// A sequence of one token attends only to itself: out = v, lse = q·k/sqrt(hd). (Its dq and dk
// are exactly zero, which a relative error cannot measure, so T = 1 is a forward-only case.)
TEST(GpuAttention, SingleTokenAttendsToItself) {
  REQUIRE_GPU();
  for (const int hd : {32, 64, 128}) {
    testutil::Rng rng;
    const int B = 3, T = 1, nh = 2, N = B * T, H = nh * hd;
    const Mat<double> qkv = round_to_floatX(rng.mat<double>(N, 3 * H));
    Mat<double> lse_want(B * nh, T);
    for (int b = 0; b < B; b++)
      for (int h = 0; h < nh; h++)
        lse_want(b * nh + h, 0) =
            qkv.row(b).segment(h * hd, hd).dot(qkv.row(b).segment(H + h * hd, hd)) / std::sqrt((double)hd);

    DeviceBuffer<floatX> d_qkv = upload<floatX>(qkv);
    DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.attention.out");
    DeviceBuffer<float> d_lse((size_t)B * nh * T, Mem::Activations, "test.attention.lse");
    poison(d_out.ptr, d_out.count);
    poison(d_lse.ptr, d_lse.count);
    attention_forward(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, nh, hd, 0);
    const std::string name = "GpuAttention.SingleToken hd" + std::to_string(hd);
    EXPECT_REL(name.c_str(), "out = v", testutil::rel_err(download(d_out.ptr, N, H), part(qkv, 2, H)), OP_TOL);
    EXPECT_REL(name.c_str(), "lse", testutil::rel_err(download(d_lse.ptr, B * nh, T), lse_want), OP_TOL);
  }
}

// Forward and backward of one case against the reference; the backward runs on the GPU forward's
// own out and lse, as in training. kernels: those given (attention_*_with), or (none) those
// attention_forward / attention_backward pick.
void check_case(const AttnCase& c, std::optional<AttentionKernels> kernels, const char* test) {
  testutil::Rng rng;
  const int N = c.B * c.T, H = c.nh * c.hd;
  const Mat<double> qkv = round_to_floatX(rng.mat<double>(N, 3 * H));
  const Mat<double> dout = round_to_floatX(rng.mat<double>(N, H));
  const Mat<double> dqkv_ref = ref::attention_backward(dout, qkv, c.B, c.T, c.nh, c.hd);
  Mat<double> out_ref, lse_ref;
  ref::attention_forward(qkv, c.B, c.T, c.nh, c.hd, out_ref, lse_ref);

  DeviceBuffer<floatX> d_qkv = upload<floatX>(qkv);
  DeviceBuffer<floatX> d_dout = upload<floatX>(dout);
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.attention.out");
  DeviceBuffer<float> d_lse((size_t)c.B * c.nh * c.T, Mem::Activations, "test.attention.lse");
  DeviceBuffer<floatX> d_dqkv((size_t)N * 3 * H, Mem::Grads, "test.attention.dqkv");
  poison(d_out.ptr, d_out.count);
  poison(d_lse.ptr, d_lse.count);
  poison(d_dqkv.ptr, d_dqkv.count);
  if (kernels) attention_forward_with(*kernels, d_out.ptr, d_lse.ptr, d_qkv.ptr, c.B, c.T, c.nh, c.hd, 0);
  else attention_forward(d_out.ptr, d_lse.ptr, d_qkv.ptr, c.B, c.T, c.nh, c.hd, 0);
  const std::string fwd = case_name(test, c) + " fwd";
  EXPECT_REL(fwd.c_str(), "out", testutil::rel_err(download(d_out.ptr, N, H), out_ref), OP_TOL);
  EXPECT_REL(fwd.c_str(), "lse", testutil::rel_err(download(d_lse.ptr, c.B * c.nh, c.T), lse_ref), OP_TOL);
  if (c.T == 1) return;  // dq, dk are exactly zero: a relative error cannot measure them
  if (kernels)
    attention_backward_with(*kernels, d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, c.B, c.T, c.nh, c.hd, 0);
  else attention_backward(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, c.B, c.T, c.nh, c.hd, 0);
  const Mat<double> dqkv = download(d_dqkv.ptr, N, 3 * H);
  const std::string bwd = case_name(test, c) + " bwd";
  const char* parts[3] = {"dq", "dk", "dv"};
  for (int p = 0; p < 3; p++)
    EXPECT_REL(bwd.c_str(), parts[p], testutil::rel_err(part(dqkv, p, H), part(dqkv_ref, p, H)), OP_TOL);
}

TEST(GpuAttention, BackwardMatchesReference) {
  REQUIRE_GPU();
  for (const AttnCase& c : kAttentionCases) check_case(c, std::nullopt, "GpuAttention");
}

// Every form of the kernels the build has, at the head dims with tensor-core forms, also those
// attention_forward does not pick (SIMT in the BF16 build; mma.sync at hd 64 in sm_90a builds). In
// the FP32 build this repeats cases above on the SIMT kernels, its only form.
TEST(GpuAttention, EveryKernelFormMatchesReference) {
  REQUIRE_GPU();
  for (const AttentionKernels k : {AttentionKernels::Simt, AttentionKernels::MmaSync, AttentionKernels::Wgmma})
    for (const AttnCase& c : {AttnCase{2, 200, 2, 64}, AttnCase{2, 130, 2, 128}, AttnCase{1, 1000, 2, 64}})
      if (attention_has_kernels(k, c.hd, {}))
        check_case(c, k, (std::string("GpuAttention.") + attention_kernels_name(k)).c_str());
}

// The form attention_forward / attention_backward take (notes/attention.md, "What runs where"): in
// the BF16 build wgmma at hd 64 when built for sm_90a, mma.sync at hd 128 (and at 64 otherwise), SIMT
// at hd 32, for tensors not 16-byte aligned, and in the FP32 build. Host-only: runs without a GPU.
TEST(GpuAttentionHost, FormByBuildHeadDimAndAlignment) {
  const void* aligned = reinterpret_cast<const void*>(uintptr_t(1) << 20);
  const void* misaligned = reinterpret_cast<const void*>((uintptr_t(1) << 20) + 2);
  const AttentionKernels tensor_cores_64 = BUILD_WGMMA  ? AttentionKernels::Wgmma
                                           : BUILD_BF16 ? AttentionKernels::MmaSync
                                                        : AttentionKernels::Simt;
  const AttentionKernels tensor_cores_128 = BUILD_BF16 ? AttentionKernels::MmaSync : AttentionKernels::Simt;
  EXPECT_EQ(attention_kernels_for(64, {aligned, aligned}), tensor_cores_64);
  EXPECT_EQ(attention_kernels_for(128, {aligned, aligned}), tensor_cores_128);
  EXPECT_EQ(attention_kernels_for(32, {aligned, aligned}), AttentionKernels::Simt);
  EXPECT_EQ(attention_kernels_for(64, {aligned, misaligned}), AttentionKernels::Simt);
  EXPECT_EQ(attention_has_kernels(AttentionKernels::MmaSync, 64, {aligned}), BUILD_BF16);
  EXPECT_TRUE(attention_has_kernels(AttentionKernels::Simt, 64, {misaligned}));
}

// Two runs on the same inputs give the same bits (fixed reduction order, no atomics).
TEST(GpuAttention, IsBitwiseDeterministic) {
  REQUIRE_GPU();
  for (const int hd : {32, 64, 128}) {
    testutil::Rng rng;
    const int B = 2, T = 150, nh = 3, N = B * T, H = nh * hd;
    DeviceBuffer<floatX> d_qkv = upload<floatX>(rng.mat<double>(N, 3 * H));
    DeviceBuffer<floatX> d_dout = upload<floatX>(rng.mat<double>(N, H));
    std::vector<floatX> out[2], dqkv[2];
    std::vector<float> lse[2];
    for (int run = 0; run < 2; run++) {
      DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.attention.out");
      DeviceBuffer<float> d_lse((size_t)B * nh * T, Mem::Activations, "test.attention.lse");
      DeviceBuffer<floatX> d_dqkv((size_t)N * 3 * H, Mem::Grads, "test.attention.dqkv");
      attention_forward(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, nh, hd, 0);
      attention_backward(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, B, T, nh, hd, 0);
      out[run] = testutil::download_vec(d_out.ptr, d_out.count);
      lse[run] = testutil::download_vec(d_lse.ptr, d_lse.count);
      dqkv[run] = testutil::download_vec(d_dqkv.ptr, d_dqkv.count);
    }
    EXPECT_EQ(0, memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(floatX)));
    EXPECT_EQ(0, memcmp(lse[0].data(), lse[1].data(), lse[0].size() * sizeof(float)));
    EXPECT_EQ(0, memcmp(dqkv[0].data(), dqkv[1].data(), dqkv[0].size() * sizeof(floatX))) << "hd " << hd;
  }
}

// A sequence's tiles end at its own T: rows past it read as zeros, never as the next sequence's rows
// (the cp.async copies stop at T; the wgmma form's tensor maps give each sequence its own T rows).
// Sequence 0's out, lse and dq, dk, dv are the same bits whether sequence 1 holds fresh numbers or
// NaN, in every form the build has; a form that read sequence 1's keys, values or dO into sequence 0's
// last tile would turn the masked products 0 · NaN into NaN.
TEST(GpuAttention, ASequenceNeverReadsTheNextOnesRows) {
  REQUIRE_GPU();
  for (const AttentionKernels k : {AttentionKernels::Simt, AttentionKernels::MmaSync, AttentionKernels::Wgmma})
    for (const AttnCase c : {AttnCase{2, 37, 2, 64}, AttnCase{2, 100, 2, 64}, AttnCase{2, 100, 2, 128}}) {
      if (!attention_has_kernels(k, c.hd, {})) continue;
      testutil::Rng rng;
      const int N = c.B * c.T, H = c.nh * c.hd;
      Mat<double> qkv = rng.mat<double>(N, 3 * H), dout = rng.mat<double>(N, H);
      std::vector<floatX> out[2], dqkv[2];
      std::vector<float> lse[2];
      for (int run = 0; run < 2; run++) {
        if (run == 1) {  // sequence 1 (rows T … 2T − 1) becomes NaN
          qkv.bottomRows(c.T).setConstant(NAN);
          dout.bottomRows(c.T).setConstant(NAN);
        }
        DeviceBuffer<floatX> d_qkv = upload<floatX>(qkv), d_dout = upload<floatX>(dout);
        DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.attention.out");
        DeviceBuffer<float> d_lse((size_t)c.B * c.nh * c.T, Mem::Activations, "test.attention.lse");
        DeviceBuffer<floatX> d_dqkv((size_t)N * 3 * H, Mem::Grads, "test.attention.dqkv");
        attention_forward_with(k, d_out.ptr, d_lse.ptr, d_qkv.ptr, c.B, c.T, c.nh, c.hd, 0);
        attention_backward_with(k, d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, c.B, c.T, c.nh, c.hd, 0);
        out[run] = testutil::download_vec(d_out.ptr, (size_t)c.T * H);          // sequence 0's rows
        lse[run] = testutil::download_vec(d_lse.ptr, (size_t)c.nh * c.T);       // sequence 0's heads
        dqkv[run] = testutil::download_vec(d_dqkv.ptr, (size_t)c.T * 3 * H);
      }
      const std::string name = case_name("GpuAttention.ASequenceNeverReadsTheNextOnesRows", c) + " " +
                               attention_kernels_name(k);
      for (const floatX& x : out[1]) ASSERT_TRUE(std::isfinite(to_float(x))) << name << ": out";
      for (const floatX& x : dqkv[1]) ASSERT_TRUE(std::isfinite(to_float(x))) << name << ": dqkv";
      EXPECT_EQ(0, memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(floatX))) << name;
      EXPECT_EQ(0, memcmp(lse[0].data(), lse[1].data(), lse[0].size() * sizeof(float))) << name;
      EXPECT_EQ(0, memcmp(dqkv[0].data(), dqkv[1].data(), dqkv[0].size() * sizeof(floatX))) << name;
    }
}

#if defined(FLATMOE_BF16)
// The tensor-core forward at hd 64 runs blocks of 128 queries (two 16-row strips per warp) where it
// ran blocks of 64: every row sums the same products in the same order, so out and lse are the same
// bits either way. T = 150 ends inside a 64-query tile, T = 192 has an odd number of them (the last
// 128-query block holds 64 queries), T = 37 and T = 1 fit in one.
TEST(GpuAttention, ForwardQueryTilesOf64And128GiveTheSameBits) {
  REQUIRE_GPU();
  for (const int T : {150, 192, 37, 1}) {
    testutil::Rng rng;
    const int hd = 64, B = 2, nh = 3, N = B * T, H = nh * hd;
    DeviceBuffer<floatX> d_qkv = upload<floatX>(rng.mat<double>(N, 3 * H));
    std::vector<floatX> out[2];
    std::vector<float> lse[2];
    for (int strips = 1; strips <= 2; strips++) {
      DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.attention.out");
      DeviceBuffer<float> d_lse((size_t)B * nh * T, Mem::Activations, "test.attention.lse");
      testutil::poison(d_out.ptr, d_out.count);
      testutil::poison(d_lse.ptr, d_lse.count);
      if (strips == 1) attn_mma::forward_hd<64, 1>(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, nh, 0);
      else attn_mma::forward_hd<64, 2>(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, nh, 0);
      out[strips - 1] = testutil::download_vec(d_out.ptr, d_out.count);
      lse[strips - 1] = testutil::download_vec(d_lse.ptr, d_lse.count);
    }
    EXPECT_EQ(0, memcmp(out[0].data(), out[1].data(), out[0].size() * sizeof(floatX))) << "T " << T;
    EXPECT_EQ(0, memcmp(lse[0].data(), lse[1].data(), lse[0].size() * sizeof(float))) << "T " << T;
  }
}
#endif

// With a RoPE table the backward's q and k gradients are RoPE's backward of its plain ones (the model's
// layer runs no rope_backward launch): against the reference's rope_backward(attention_backward) at
// the operator tolerance, in every form the build has, at positions t < T of a longer table. dv is
// the plain run's, bit for bit; in the FP32 build so are dq and dk after rope_backward (the same fp32
// operations); in the BF16 build they are rounded once where rope_backward after rounds twice.
TEST(GpuAttention, RopeBackwardInTheStoresIsRopeBackwardAfter) {
  REQUIRE_GPU();
  const double theta = 10000.0;
  for (const AttentionKernels k : {AttentionKernels::Simt, AttentionKernels::MmaSync, AttentionKernels::Wgmma})
    for (const AttnCase& c : {AttnCase{2, 37, 3, 32}, AttnCase{2, 200, 2, 64}, AttnCase{1, 130, 2, 128}}) {
      if (!attention_has_kernels(k, c.hd, {})) continue;
      testutil::Rng rng;
      const int N = c.B * c.T, H = c.nh * c.hd;
      const Mat<double> qkv = round_to_floatX(rng.mat<double>(N, 3 * H));
      const Mat<double> dout = round_to_floatX(rng.mat<double>(N, H));
      const Mat<double> dqkv_ref =
          ref::rope_backward(ref::attention_backward(dout, qkv, c.B, c.T, c.nh, c.hd), c.B, c.T, c.nh, c.hd, theta);
      const testutil::AngleTable table = testutil::angle_table(c.T + 50, c.hd, theta);

      DeviceBuffer<floatX> d_qkv = upload<floatX>(qkv), d_dout = upload<floatX>(dout);
      DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.attention.out");
      DeviceBuffer<float> d_lse((size_t)c.B * c.nh * c.T, Mem::Activations, "test.attention.lse");
      DeviceBuffer<floatX> d_fused((size_t)N * 3 * H, Mem::Grads, "test.attention.dqkv_rope_in_stores");
      DeviceBuffer<floatX> d_after((size_t)N * 3 * H, Mem::Grads, "test.attention.dqkv_rope_after");
      poison(d_fused.ptr, d_fused.count);
      poison(d_after.ptr, d_after.count);
      attention_forward_with(k, d_out.ptr, d_lse.ptr, d_qkv.ptr, c.B, c.T, c.nh, c.hd, 0);
      attention_backward_with(k, d_fused.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, c.B, c.T, c.nh, c.hd, 0,
                              table.angles);
      attention_backward_with(k, d_after.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, c.B, c.T, c.nh, c.hd, 0);
      rope_backward(d_after.ptr, d_after.ptr, table.angles, c.B, c.T, c.nh, c.hd, 0);
      const Mat<double> fused = download(d_fused.ptr, N, 3 * H), after = download(d_after.ptr, N, 3 * H);

      const std::string name = case_name("GpuAttention.RopeInTheStores", c) + " " + attention_kernels_name(k);
      const char* parts[3] = {"dq", "dk", "dv"};
      for (int p = 0; p < 3; p++) {
        EXPECT_REL(name.c_str(), parts[p], testutil::rel_err(part(fused, p, H), part(dqkv_ref, p, H)), OP_TOL);
        printf("  %s %s: rope in the stores %.3e, rope_backward after %.3e\n", name.c_str(), parts[p],
               testutil::rel_err(part(fused, p, H), part(dqkv_ref, p, H)),
               testutil::rel_err(part(after, p, H), part(dqkv_ref, p, H)));
      }
      const std::vector<floatX> fused_bits = testutil::download_vec(d_fused.ptr, d_fused.count);
      const std::vector<floatX> after_bits = testutil::download_vec(d_after.ptr, d_after.count);
      for (int n = 0; n < N; n++) {
        const size_t dv_at = (size_t)n * 3 * H + 2 * H;
        ASSERT_EQ(0, memcmp(&fused_bits[dv_at], &after_bits[dv_at], H * sizeof(floatX))) << name << ": dv of row " << n;
      }
      if (!BUILD_BF16)
        EXPECT_EQ(0, memcmp(fused_bits.data(), after_bits.data(), fused_bits.size() * sizeof(floatX)))
            << name << ": the FP32 build's bits are rope_backward's after";
    }
}

// The backward's only device memory is delta (B·nh·T floats of workspace), released on return.
TEST(GpuAttention, BackwardWorkspaceIsDeltaOnly) {
  REQUIRE_GPU();
  for (const int hd : {32, 64, 128}) {
    testutil::Rng rng;
    const int B = 2, T = 100, nh = 2, N = B * T, H = nh * hd;
    DeviceBuffer<floatX> d_qkv = upload<floatX>(rng.mat<double>(N, 3 * H));
    DeviceBuffer<floatX> d_dout = upload<floatX>(rng.mat<double>(N, H));
    DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.attention.out");
    DeviceBuffer<float> d_lse((size_t)B * nh * T, Mem::Activations, "test.attention.lse");
    DeviceBuffer<floatX> d_dqkv((size_t)N * 3 * H, Mem::Grads, "test.attention.dqkv");
    attention_forward(d_out.ptr, d_lse.ptr, d_qkv.ptr, B, T, nh, hd, 0);
    const size_t live_before = pool().live_total();
    pool().reset_peak();
    attention_backward(d_dqkv.ptr, d_dout.ptr, d_qkv.ptr, d_out.ptr, d_lse.ptr, B, T, nh, hd, 0);
    cudaCheck(cudaDeviceSynchronize(), "test", "attention_backward");
    EXPECT_EQ(pool().peak() - live_before, (size_t)B * nh * T * sizeof(float));
    EXPECT_EQ(pool().live_total(), live_before);
  }
}

// Head dims other than 32, 64, 128 are refused with a message that names the sizes (checked
// before any device work, so this runs with or without a GPU).
TEST(GpuAttentionDeathTest, RefusesUnsupportedHeadDim) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(attention_forward(nullptr, nullptr, nullptr, 1, 16, 2, 48, 0),
               "attention_forward \\(B=1 T=16 nh=2 hd=48\\): unsupported head dim");
  EXPECT_DEATH(attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 16, 2, 96, 0),
               "attention_backward \\(B=1 T=16 nh=2 hd=96\\): unsupported head dim");
}

// A RoPE table that does not hold every position t < T, or made for another head dim, is refused
// before any device work.
TEST(GpuAttentionDeathTest, RefusesARopeTableTooShortOrOfAnotherHeadDim) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const float* unread = reinterpret_cast<const float*>(uintptr_t(1) << 20);
  EXPECT_DEATH(attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 16, 2, 64, 0, RopeAngles{unread, 8, 64}),
               "attention_backward \\(B=1 T=16 nh=2 hd=64 T_max=8 table hd=64\\): .*T must be <= T_max");
  EXPECT_DEATH(attention_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 1, 16, 2, 64, 0, RopeAngles{unread, 16, 32}),
               "attention_backward \\(B=1 T=16 nh=2 hd=64 T_max=16 table hd=32\\): .*hd the table's");
}

// Kernels the build does not have for a head dim are refused by name (wgmma only runs hd 64; the
// FP32 build has no tensor-core kernels at all), before any device work.
TEST(GpuAttentionDeathTest, RefusesKernelsTheBuildLacks) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(attention_forward_with(AttentionKernels::Wgmma, nullptr, nullptr, nullptr, 1, 16, 2, 128, 0),
               "attention_forward \\(kernels=wgmma B=1 T=16 nh=2 hd=128\\): this build has no such kernels");
  EXPECT_DEATH(attention_backward_with(AttentionKernels::Wgmma, nullptr, nullptr, nullptr, nullptr, nullptr, 1, 16, 2,
                                       32, 0),
               "attention_backward \\(kernels=wgmma B=1 T=16 nh=2 hd=32\\): this build has no such kernels");
}

}  // namespace
