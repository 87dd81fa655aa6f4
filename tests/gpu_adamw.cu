// GPU tests of ops/adamw.cuh against ref/adamw.hpp: several steps of AdamW over two parameter
// tensors from a random mid-training state (t > 1, non-zero moments), with the global gradient
// norm from common.cuh's deterministic sumsq, clipping on in some steps and off in others.
// Every step's update θ_new − θ_old is compared with the reference's (θ_new itself is dominated by
// θ_old, so a wrong update would hide in it); then the final master, moments and weights.
// The multi-tensor launch (adamw_multi_update, --optimizer adamw's step) over many odd-sized segments,
// empty ones included: bit-identical to one adamw_update per segment, each element within fp32
// rounding of the reference, and nothing outside the segments written.
#include <cstring>
#include "adamw_check.hpp"
#include "gpu_util.cuh"
#include "../ops/adamw.cuh"
#include "../ref/adamw.hpp"

using namespace testutil;

namespace {

struct ParamTensor {
  int n;
  ref::Vec<double> master, m, v, grad;       // reference state (double)
  DeviceBuffer<float> d_master, d_m, d_v;    // GPU state (fp32)
  DeviceBuffer<floatX> d_param;
  DeviceBuffer<float> d_grad;                // fp32 gradients (model.cuh's main_grads): a fresh upload every step
};

ParamTensor make_tensor(Rng& rng, int n) {
  ParamTensor p;
  p.n = n;
  p.master = round_to_float(rng.mat<double>(n, 1).col(0));
  p.m = round_to_float(rng.mat<double>(n, 1, 0.1).col(0));
  p.v = round_to_float(rng.mat<double>(n, 1, 0.1).col(0).cwiseAbs2());
  p.d_master = upload<float>(p.master, Mem::Optimizer);
  p.d_m = upload<float>(p.m, Mem::Optimizer);
  p.d_v = upload<float>(p.v, Mem::Optimizer);
  p.d_param = DeviceBuffer<floatX>(n, Mem::Weights, "test.param");
  poison(p.d_param.ptr, n);
  return p;
}

void check_adamw(const char* name, int n1, int n2) {
  REQUIRE_GPU();
  Rng rng;
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  const int first_step = 7, steps = 4;
  ParamTensor tensors[2] = {make_tensor(rng, n1), make_tensor(rng, n2)};
  DeviceBuffer<float> d_partials(SUMSQ_BLOCKS, Mem::Workspace, "test.sumsq_partials");
  DeviceBuffer<float> d_sumsq(1, Mem::Workspace, "test.sumsq");
  DeviceBuffer<float> d_scale(1, Mem::Workspace, "test.grad_scale");

  for (int t = first_step; t < first_step + steps; t++) {
    std::vector<ref::Vec<double>> grads;
    for (ParamTensor& p : tensors) {
      p.grad = round_to_float(rng.mat<double>(p.n, 1, 0.3).col(0));
      grads.push_back(p.grad);
      p.d_grad = upload<float>(p.grad, Mem::Grads);
    }
    cudaCheck(cudaMemsetAsync(d_partials.ptr, 0, d_partials.bytes(), 0), "test", "sumsq");
    for (ParamTensor& p : tensors) sumsq_accumulate(d_partials.ptr, p.d_grad.ptr, p.n, 0);
    sumsq_finish(d_sumsq.ptr, d_partials.ptr, 0);
    float norm = std::sqrt(download_vec(d_sumsq.ptr, 1)[0]);
    double norm_ref = ref::global_norm(grads);
    EXPECT_REL(name, "grad_norm", std::abs(norm - norm_ref) / norm_ref, OP_TOL);

    double max_norm = (t % 2 == 0) ? 0.5 * norm_ref : 0.0;  // clipping on even steps only
    float scale = clip_scale(norm, (float)max_norm);
    double scale_ref = ref::clip_scale(norm_ref, max_norm);
    poison(d_scale.ptr, 1);
    clip_scale_on_device(d_scale.ptr, d_sumsq.ptr, (float)max_norm, 0);
    EXPECT_EQ(download_vec(d_scale.ptr, 1)[0], scale) << name << ": the device's clip factor is the host's, bit for bit";
    for (int i = 0; i < 2; i++) {
      ParamTensor& p = tensors[i];
      const ref::Mat<double> master_old = download(p.d_master.ptr, p.n, 1);  // [n, 1]
      const ref::Vec<double> master_old_ref = p.master;                      // [n]
      adamw_update(p.d_master.ptr, p.d_param.ptr, p.d_m.ptr, p.d_v.ptr, p.d_grad.ptr, p.n, lr, beta1, beta2, eps, wd,
                   t, d_scale.ptr, 0);
      ref::adamw_update<double>(p.master, p.m, p.v, p.grad, lr, beta1, beta2, eps, wd, t, scale_ref);
      const ref::Mat<double> update = download(p.d_master.ptr, p.n, 1) - master_old;
      const ref::Vec<double> update_ref = p.master - master_old_ref;
      const std::string tensor = "update t" + std::to_string(t) + " p" + std::to_string(i);
      EXPECT_REL(name, tensor.c_str(), rel_err(update, update_ref), OP_TOL);
    }
  }

  for (ParamTensor& p : tensors) {
    ref::Mat<double> master = download(p.d_master.ptr, p.n, 1);
    EXPECT_REL(name, "master", rel_err(master, p.master), OP_TOL);
    EXPECT_REL(name, "m", rel_err(download(p.d_m.ptr, p.n, 1), p.m), OP_TOL);
    EXPECT_REL(name, "v", rel_err(download(p.d_v.ptr, p.n, 1), p.v), OP_TOL);
    EXPECT_REL(name, "param", rel_err(download(p.d_param.ptr, p.n, 1), p.master), OP_TOL);
    ref::Mat<double> param = download(p.d_param.ptr, p.n, 1);
    int not_rounded_master = 0;
    for (int i = 0; i < p.n; i++)
      if (param(i, 0) != to_float(from_float<floatX>((float)master(i, 0)))) not_rounded_master++;
    EXPECT_EQ(not_rounded_master, 0) << "param must be floatX(master)";
  }
}

// Segments {param_offset, state_offset, count, decay, group} with gaps in both layouts: empty segments
// (first, between, last), one element, odd counts, exactly one block's chunk and one more, several
// chunks, and enough segments that they take two launches and the kernel's binary search has depth;
// with groups > 1 their groups descend and repeat (groups − 1 − i mod groups), so that the plan must
// reorder them.
std::vector<ShardSegment> odd_segments(Rng& rng, size_t* S, size_t* P, int groups) {
  std::vector<size_t> counts = {0, 1, 3, 0, 37, (size_t)ADAMW_CHUNK, (size_t)ADAMW_CHUNK + 1, 0, 255, 257,
                                5 * (size_t)ADAMW_CHUNK - 3, 1, 0, 100003};
  for (int i = 0; i < 100; i++) counts.push_back(i % 7 == 0 ? 0 : (size_t)rng.integer(1, 3000));
  counts.push_back(0);
  std::vector<ShardSegment> segs;
  size_t p = 5, st = 2;  // gaps before the first segment too
  for (size_t i = 0; i < counts.size(); i++) {
    segs.push_back(ShardSegment{p, st, counts[i], i % 3 != 1, groups - 1 - (int)(i % groups)});
    p += counts[i] + (size_t)rng.integer(0, 9);
    st += counts[i] + (size_t)rng.integer(0, 3);
  }
  *S = st + 4;
  *P = p + 6;
  return segs;
}

void check_multi_tensor(int t, float grad_scale, int groups) {
  REQUIRE_GPU();
  Rng rng;
  const float lr = 3e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  size_t S = 0, P = 0;
  const std::vector<ShardSegment> segs = odd_segments(rng, &S, &P, groups);
  std::vector<float> master(S), m(S), v(S), grad(P);
  for (size_t i = 0; i < S; i++) {
    master[i] = (float)rng.normal();
    m[i] = (float)rng.normal(0.1);
    v[i] = (float)std::pow(rng.normal(0.1), 2);
  }
  for (float& g : grad) g = (float)rng.normal(0.3);
  struct State {
    DeviceBuffer<float> master, m, v;
    DeviceBuffer<floatX> param;
  };
  auto make_state = [&]() {
    State x{upload_vec(master, Mem::Optimizer), upload_vec(m, Mem::Optimizer), upload_vec(v, Mem::Optimizer),
            DeviceBuffer<floatX>(P, Mem::Weights, "test.param")};
    poison(x.param.ptr, P);
    return x;
  };
  State multi = make_state(), per_segment = make_state();
  DeviceBuffer<float> d_grad = upload_vec(grad, Mem::Grads);
  DeviceBuffer<float> d_scale = upload_vec(std::vector<float>{grad_scale}, Mem::Workspace, "test.grad_scale");
  const AdamWLaunchPlan plan(segs);
  EXPECT_LT(plan.segments, (int)segs.size()) << "empty segments are left out of the launches";
  std::vector<int> in_group(groups, 0);  // non-empty segments per group
  for (const ShardSegment& g : segs) in_group[g.group] += g.count > 0;
  size_t launches = 0;
  std::vector<int> groups_with_segments;
  for (int g = 0; g < groups; g++) {
    launches += (in_group[g] + ADAMW_SEGMENTS_PER_LAUNCH - 1) / ADAMW_SEGMENTS_PER_LAUNCH;
    if (in_group[g] > 0) groups_with_segments.push_back(g);
  }
  EXPECT_EQ(plan.batches.size(), launches) << "64 segments per launch, a new launch for each group";
  EXPECT_GE(plan.batches.size(), 2u) << "the segments must span more than one launch";
  std::vector<int> done;  // the groups whose launches were queued, in the order the host heard of them
  adamw_multi_update(multi.master.ptr, multi.param.ptr, multi.m.ptr, multi.v.ptr, d_grad.ptr, plan, lr, beta1, beta2,
                     eps, wd, t, d_scale.ptr, 0, [&](int g) { done.push_back(g); });
  EXPECT_EQ(done, groups_with_segments) << "group_done: once per group with segments, ascending";
  for (const ShardSegment& g : segs)
    adamw_update(per_segment.master.ptr + g.state_offset, per_segment.param.ptr + g.param_offset,
                 per_segment.m.ptr + g.state_offset, per_segment.v.ptr + g.state_offset, d_grad.ptr + g.param_offset,
                 g.count, lr, beta1, beta2, eps, g.decay ? wd : 0.f, t, d_scale.ptr, 0);
  const char* name = "adamw_multi_update";
  std::vector<float> got[3], want[3];
  int i = 0;
  for (auto [a, b] : {std::pair<float*, float*>{multi.master.ptr, per_segment.master.ptr}, {multi.m.ptr, per_segment.m.ptr},
                      {multi.v.ptr, per_segment.v.ptr}}) {
    got[i] = download_vec(a, S);
    want[i] = download_vec(b, S);
    EXPECT_EQ(0, memcmp(got[i].data(), want[i].data(), S * sizeof(float))) << name << " state section " << i;
    i++;
  }
  const std::vector<floatX> param = download_vec(multi.param.ptr, P), param_want = download_vec(per_segment.param.ptr, P);
  EXPECT_EQ(0, memcmp(param.data(), param_want.data(), P * sizeof(floatX))) << name << " weights";
  // against the reference, element by element, and the gaps untouched (state as before, weights poisoned)
  std::vector<char> in_segment_s(S, 0), in_segment_p(P, 0);
  for (const ShardSegment& g : segs) {
    if (g.count == 0) continue;
    const size_t o = g.state_offset;
    const AdamWStepCheck c = check_adamw_step(&master[o], &m[o], &v[o], &grad[g.param_offset], &got[0][o], &got[1][o],
                                              &got[2][o], g.count, lr, beta1, beta2, eps, g.decay ? wd : 0.0, t, grad_scale);
    EXPECT_EQ(c.outside, 0) << name << ": elements beyond fp32 rounding in a segment of " << g.count;
    for (size_t e = 0; e < g.count; e++) {
      in_segment_s[o + e] = 1;
      in_segment_p[g.param_offset + e] = 1;
      EXPECT_EQ(to_float(param[g.param_offset + e]), to_float(from_float<floatX>(got[0][o + e]))) << "param = floatX(master)";
    }
  }
  size_t touched = 0;
  for (size_t e = 0; e < S; e++)
    if (!in_segment_s[e]) touched += memcmp(&got[0][e], &master[e], 4) != 0 || memcmp(&got[1][e], &m[e], 4) != 0 ||
                                     memcmp(&got[2][e], &v[e], 4) != 0;
  unsigned char poisoned[sizeof(floatX)];
  memset(poisoned, 0xFF, sizeof poisoned);
  for (size_t e = 0; e < P; e++)
    if (!in_segment_p[e]) touched += memcmp(&param[e], poisoned, sizeof(floatX)) != 0;
  EXPECT_EQ(touched, 0u) << name << " wrote outside its segments";
  printf("[adamw] multi-tensor: %zu segments (%d non-empty) in %d groups, %zu launches (one block per chunk), S=%zu\n",
         segs.size(), plan.segments, groups, plan.batches.size(), S);
}

}  // namespace

TEST(AdamWGpu, MultiTensorLaunchMatchesPerSegmentLaunchesBitForBit) { check_multi_tensor(7, 1.f, 1); }
TEST(AdamWGpu, MultiTensorLaunchFirstStepClipped) { check_multi_tensor(1, 0.37f, 1); }
TEST(AdamWGpu, MultiTensorLaunchesInGroupsMatchPerSegmentLaunchesBitForBit) { check_multi_tensor(3, 0.61f, 5); }

TEST(AdamWGpu, MultiTensorLaunchOfOnlyEmptySegmentsDoesNothing) {
  REQUIRE_GPU();
  const AdamWLaunchPlan plan({ShardSegment{0, 0, 0, true}, ShardSegment{3, 2, 0, false}});
  EXPECT_EQ(plan.segments, 0);
  EXPECT_TRUE(plan.batches.empty());
  adamw_multi_update(nullptr, nullptr, nullptr, nullptr, (const float*)nullptr, plan, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1,
                     nullptr, 0);
  cudaCheck(cudaDeviceSynchronize(), "test", "empty launch");
}

TEST(AdamWGpu, MatchesReferenceOverStepsSmall) { check_adamw("AdamWGpu.n1000+37", 1000, 37); }
TEST(AdamWGpu, MatchesReferenceOverStepsLarge) { check_adamw("AdamWGpu.n100003+4099", 100003, 4099); }

TEST(AdamWHost, ClipScaleMatchesReference) {
  for (float norm : {0.1f, 1.0f, 3.5f, 1e4f})
    for (float max_norm : {-1.0f, 0.0f, 0.5f, 1.0f, 2.0f})
      EXPECT_NEAR(clip_scale(norm, max_norm), ref::clip_scale<double>(norm, max_norm), 1e-6)
          << "norm=" << norm << " max_norm=" << max_norm;
}

// The launch plan (host only, runs without a GPU): the non-empty segments in order, 64 per launch;
// within a launch each segment's blocks follow the previous one's, one block per ADAMW_CHUNK elements
// (a partial chunk gets its own block), so block q's binary search finds exactly one segment.
TEST(AdamWHost, LaunchPlanCutsTheSegmentsIntoLaunchesOf64) {
  std::vector<ShardSegment> segs;
  size_t offset = 0, state = 0, non_empty = 0;
  for (int i = 0; i < 150; i++) {
    const size_t count = i % 9 == 4 ? 0 : (size_t)(i * 37 % 5000) + 1;  // some empty, some under a chunk
    segs.push_back(ShardSegment{offset, state, count, i % 2 == 0});
    offset += count + 3;
    state += count;
    non_empty += count > 0;
  }
  const AdamWLaunchPlan plan(segs);
  EXPECT_EQ(plan.segments, (int)non_empty);
  ASSERT_EQ(plan.batches.size(), (non_empty + ADAMW_SEGMENTS_PER_LAUNCH - 1) / ADAMW_SEGMENTS_PER_LAUNCH);
  size_t next = 0;  // the next non-empty segment of segs
  for (const AdamWSegmentBatch& b : plan.batches) {
    EXPECT_LE(b.count, ADAMW_SEGMENTS_PER_LAUNCH);
    unsigned int blocks = 0;
    for (int j = 0; j < b.count; j++) {
      while (segs[next].count == 0) next++;
      const ShardSegment& g = segs[next++];
      const AdamWSegmentArg& a = b.seg[j];
      EXPECT_EQ(a.param_offset, g.param_offset);
      EXPECT_EQ(a.state_offset, g.state_offset);
      EXPECT_EQ(a.count, g.count);
      EXPECT_EQ(a.decay, g.decay ? 1 : 0);
      EXPECT_EQ(a.first_block, blocks) << "segment " << j << " of a launch";
      blocks += (unsigned int)((g.count + ADAMW_CHUNK - 1) / ADAMW_CHUNK);
    }
    EXPECT_EQ(b.blocks, blocks);
  }
  while (next < segs.size() && segs[next].count == 0) next++;
  EXPECT_EQ(next, segs.size()) << "every non-empty segment is in a launch";
}

// Groups (host only): the segments of each group in their order, the groups ascending whatever the
// segments' order, and a launch never holds two groups.
TEST(AdamWHost, LaunchPlanStartsALaunchForEachGroupInGroupOrder) {
  std::vector<ShardSegment> segs;
  for (int i = 0; i < 200; i++) segs.push_back(ShardSegment{(size_t)i * 10, (size_t)i * 10, (size_t)(i % 5 == 0 ? 0 : 7), true, (i * 7) % 4});
  const AdamWLaunchPlan plan(segs);
  ASSERT_EQ(plan.batch_group.size(), plan.batches.size());
  std::vector<size_t> order;  // param offsets in the plan's order
  for (size_t b = 0; b < plan.batches.size(); b++) {
    if (b > 0) EXPECT_LE(plan.batch_group[b - 1], plan.batch_group[b]) << "groups ascend";
    for (int j = 0; j < plan.batches[b].count; j++) {
      const size_t i = plan.batches[b].seg[j].param_offset / 10;
      EXPECT_EQ(segs[i].group, plan.batch_group[b]) << "segment " << i << " in launch " << b;
      order.push_back(i);
    }
  }
  std::vector<size_t> want;
  for (int g = 0; g < 4; g++)
    for (size_t i = 0; i < segs.size(); i++)
      if (segs[i].group == g && segs[i].count > 0) want.push_back(i);
  EXPECT_EQ(order, want);
  EXPECT_EQ(plan.batches.size(), 4u) << "40 non-empty segments in each group: one launch per group";
}

// common.cuh's sum of squares (the gradient norm) against a double sum over the same values, within
// FP32_TOL: in pieces of SUMSQ_PIECE elements (n a multiple of the piece, x aligned) and by element (n
// not a multiple, or x one element past an aligned address), for fp32 and bf16 inputs; two runs give
// the same bits; a value of 1000 just outside [x, x + n) would show in the error if it were read;
// several tensors on both paths accumulate into the same partials; and the sum over bf16 values is
// the sum over their fp32 copies bit for bit, on both paths (model.cuh's norm reads either).
namespace {

template <typename T>
struct SumSqInput {
  DeviceBuffer<T> buffer;
  const T* x;
  size_t n;
  double sumsq;  // in double, over the values the GPU sees
};

// n fresh values of T at `offset` elements past a pool (aligned) address; 1000 in the elements before
// them and in the one after.
template <typename T>
SumSqInput<T> sumsq_input(Rng& rng, size_t n, int offset) {
  std::vector<T> host(offset + n + 1, from_float<T>(1000.f));
  double sumsq = 0;
  for (size_t i = 0; i < n; i++) {
    host[offset + i] = from_float<T>((float)rng.normal());
    sumsq += (double)to_float(host[offset + i]) * to_float(host[offset + i]);
  }
  SumSqInput<T> in{upload_vec(host, Mem::Grads, "test.sumsq_x"), nullptr, n, sumsq};
  in.x = in.buffer.ptr + offset;
  return in;
}

// sumsq_finish after sumsq_accumulate of each `accumulate(partials)` call, from zeroed partials.
template <typename F>
float gpu_sumsq(F accumulate) {
  DeviceBuffer<float> d_partials(SUMSQ_BLOCKS, Mem::Workspace, "test.sumsq_partials");
  DeviceBuffer<float> d_sumsq(1, Mem::Workspace, "test.sumsq");
  cudaCheck(cudaMemsetAsync(d_partials.ptr, 0, d_partials.bytes(), 0), "test", "sumsq");
  accumulate(d_partials.ptr);
  sumsq_finish(d_sumsq.ptr, d_partials.ptr, 0);
  return download_vec(d_sumsq.ptr, 1)[0];
}

template <typename T>
void check_sumsq(const char* name, size_t n, int offset, bool pieces) {
  REQUIRE_GPU();
  Rng rng;
  const SumSqInput<T> in = sumsq_input<T>(rng, n, offset);
  EXPECT_EQ(n % SUMSQ_PIECE == 0 && pack_aligned(in.x, SUMSQ_PIECE), pieces) << name << ": not the path meant";
  float runs[2];
  for (float& r : runs) r = gpu_sumsq([&](float* partials) { sumsq_accumulate(partials, in.x, in.n, 0); });
  EXPECT_REL(name, "sumsq", std::abs(runs[0] - in.sumsq) / in.sumsq, FP32_TOL);
  EXPECT_EQ(0, memcmp(&runs[0], &runs[1], sizeof(float))) << name << ": two runs differ";
}

}  // namespace

TEST(SumSqGpu, Fp32InPiecesMatchesDoubleSum) { check_sumsq<float>("SumSqGpu.fp32.n2^20", 1 << 20, 0, true); }
TEST(SumSqGpu, Fp32NotWholePiecesMatchesDoubleSum) { check_sumsq<float>("SumSqGpu.fp32.n1000003", 1000003, 0, false); }
TEST(SumSqGpu, Fp32UnalignedMatchesDoubleSum) { check_sumsq<float>("SumSqGpu.fp32.n2^20+1", 1 << 20, 1, false); }
TEST(SumSqGpu, Bf16InPiecesMatchesDoubleSum) { check_sumsq<__nv_bfloat16>("SumSqGpu.bf16.n2^20", 1 << 20, 0, true); }
TEST(SumSqGpu, Bf16UnalignedMatchesDoubleSum) { check_sumsq<__nv_bfloat16>("SumSqGpu.bf16.n2^20+1", 1 << 20, 1, false); }

// The same values as bf16 and as fp32 copies (exact): the same float, bit for bit.
TEST(SumSqGpu, Bf16SumIsTheSumOverItsFp32CopyBitForBit) {
  REQUIRE_GPU();
  Rng rng;
  for (size_t n : {(size_t)1 << 20, (size_t)1000003}) {
    const SumSqInput<__nv_bfloat16> x = sumsq_input<__nv_bfloat16>(rng, n, 0);
    std::vector<float> copy(n);
    const std::vector<__nv_bfloat16> host = download_vec(x.x, n);
    for (size_t i = 0; i < n; i++) copy[i] = to_float(host[i]);
    DeviceBuffer<float> d_copy = upload_vec(copy, Mem::Grads, "test.sumsq_copy");
    const float from_bf16 = gpu_sumsq([&](float* partials) { sumsq_accumulate(partials, x.x, n, 0); });
    const float from_fp32 = gpu_sumsq([&](float* partials) { sumsq_accumulate(partials, d_copy.ptr, n, 0); });
    printf("[err] SumSqGpu.bf16_vs_fp32_copy n=%zu: %.9g and %.9g\n", n, from_bf16, from_fp32);
    EXPECT_EQ(0, memcmp(&from_bf16, &from_fp32, sizeof(float))) << "n=" << n;
  }
}

TEST(SumSqGpu, AccumulatesTensorsOnBothPathsIntoThePartials) {
  REQUIRE_GPU();
  Rng rng;
  const SumSqInput<float> a = sumsq_input<float>(rng, 1 << 18, 0), b = sumsq_input<float>(rng, 100003, 1);
  const SumSqInput<__nv_bfloat16> c = sumsq_input<__nv_bfloat16>(rng, 4096, 0);
  const float got = gpu_sumsq([&](float* partials) {
    sumsq_accumulate(partials, a.x, a.n, 0);
    sumsq_accumulate(partials, b.x, b.n, 0);
    sumsq_accumulate(partials, c.x, c.n, 0);
  });
  const double want = a.sumsq + b.sumsq + c.sumsq;
  EXPECT_REL("SumSqGpu.three_tensors", "sumsq", std::abs(got - want) / want, FP32_TOL);
}
