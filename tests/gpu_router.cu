// tests/gpu_router.cu — ops/router.cuh against ref/router.hpp and ref/matmul.hpp (double), on fresh
// random inputs and poisoned outputs. The router is FP32 in both builds (notes/design.md §3), so its fp32
// results — logits, scores, weights, dlogits — are held to the FP32 tolerance 1e-5 in BOTH builds.
// dx and the += dW end in one rounding to floatX: held to OP_TOL, and in the BF16 build nearly every
// element must equal the correctly rounded exact value. Cases: selection (exact), weights, scores,
// dlogits and loads on well-separated scores, at sizes that are not multiples of the warp; exact
// ties, which must pick the lower expert index on GPU and CPU alike; the weights of a given choice; a
// routing profile's choice made on the device, index for index its host twin's;
// the logits GEMM and its backward at odd shapes, with their Workspace peak and bit-identical replay.
#include <algorithm>
#include <cmath>
#include <cstring>
#include "gpu_util.cuh"
#include "router_util.hpp"
#include "../ops/router.cuh"
#include "../ref/matmul.hpp"
#include "../ref/router.hpp"

namespace {

using testutil::Rng;
using Mat = ref::Mat<double>;
using Vec = ref::Vec<double>;

using testutil::round_to_float;  // the values a float buffer holds

// A float-representable random bias (the GPU holds it as float).
Vec random_bias(Rng& rng, int E, double stddev) {
  Vec b(E);
  for (int e = 0; e < E; e++) b(e) = (double)(float)rng.normal(stddev);
  return b;
}

std::vector<float> as_floats(const Vec& v) {
  std::vector<float> f(v.size());
  for (Eigen::Index i = 0; i < v.size(); i++) f[i] = (float)v(i);
  return f;
}

int count_mismatches(const std::vector<int>& gpu, const ref::MatI& expected) {
  int bad = 0;
  for (Eigen::Index i = 0; i < expected.size(); i++) bad += gpu[i] != expected.data()[i];
  return bad;
}

#if defined(FLATMOE_BF16)
// An fp32 result rounded once to bf16 equals the correctly rounded exact value except where its fp32
// error (~1e-6 relative) straddles a rounding midpoint (bf16 spacing ~4e-3 relative): about one
// element in 10^3. A second rounding (ΔW rounded to bf16 before the add, or bf16 dlogits, as before
// the router went FP32) moves a large share of them. Prints the count; asserts ≤ 1 %.
void expect_rounded_once(const char* name, const char* tensor, const Mat& gpu, const Mat& exact) {
  const Mat rounded = testutil::round_to_floatX(exact);
  long long differ = 0;
  for (Eigen::Index i = 0; i < gpu.size(); i++) differ += gpu.data()[i] != rounded.data()[i];
  printf("[round] %-28s %-14s %lld of %lld elements differ from the correctly rounded value\n", name, tensor, differ,
         (long long)gpu.size());
  EXPECT_LE((double)differ, 0.01 * gpu.size()) << name << " " << tensor << ": not one rounding of an fp32 result";
}
#endif

// Forward, backward and loads of one configuration against the reference, from fp32 logits. The
// forward also adds its choice's loads (+=) into a buffer that starts from fresh counts.
void check_router(const char* name, int N, int E, int k, int score_fn, bool renorm) {
  Rng rng;
  Vec bias = random_bias(rng, E, score_fn == ROUTER_SOFTMAX ? 0.3 / E : 0.2);
  Mat logits = testutil::well_separated_logits(rng, N, E, k, bias, score_fn, 1e-4, round_to_float<Mat>);
  Mat dtopk_w = round_to_float(rng.mat<double>(N, k));
  auto r = ref::router_forward(logits, bias, k, score_fn, renorm);
  Mat dlogits_ref = ref::router_backward(dtopk_w, r.scores, r.topk_idx, score_fn, renorm);

  auto d_logits = testutil::upload<float>(logits);
  auto d_bias = testutil::upload_vec(as_floats(bias));
  auto d_dtopk_w = testutil::upload<float>(dtopk_w);
  DeviceBuffer<int> d_idx((size_t)N * k, Mem::Workspace, "test.topk_idx");
  DeviceBuffer<float> d_w((size_t)N * k, Mem::Workspace, "test.topk_w");
  DeviceBuffer<float> d_scores((size_t)N * E, Mem::Workspace, "test.scores");
  DeviceBuffer<float> d_dlogits((size_t)N * E, Mem::Workspace, "test.dlogits");
  DeviceBuffer<int> d_loads(E, Mem::Workspace, "test.loads");
  testutil::poison(d_idx.ptr, d_idx.count);
  testutil::poison(d_w.ptr, d_w.count);
  testutil::poison(d_scores.ptr, d_scores.count);
  testutil::poison(d_dlogits.ptr, d_dlogits.count);
  testutil::poison(d_loads.ptr, d_loads.count);
  std::vector<int> loads_before(E);
  for (int& count : loads_before) count = rng.integer(0, 1000);
  auto d_loads_added = testutil::upload_vec(loads_before);
  cudaCheck(cudaDeviceSynchronize(), "test", "setup");

  router_forward(d_idx.ptr, d_w.ptr, d_scores.ptr, d_logits.ptr, d_bias.ptr, N, E, k, score_fn, renorm, 0,
                 d_loads_added.ptr);
  router_backward(d_dlogits.ptr, d_dtopk_w.ptr, d_scores.ptr, d_idx.ptr, N, E, k, score_fn, renorm, 0);
  router_count_loads(d_loads.ptr, d_idx.ptr, N, E, k, 0);

  EXPECT_EQ(count_mismatches(testutil::download_vec(d_idx.ptr, d_idx.count), r.topk_idx), 0) << name << " topk_idx";
  EXPECT_REL(name, "topk_w", testutil::rel_err(testutil::download(d_w.ptr, N, k), r.topk_w), FP32_TOL);
  EXPECT_REL(name, "scores", testutil::rel_err(testutil::download(d_scores.ptr, N, E), r.scores), FP32_TOL);
  EXPECT_REL(name, "dlogits", testutil::rel_err(testutil::download(d_dlogits.ptr, N, E), dlogits_ref), FP32_TOL);
  const std::vector<int> loads = ref::router_count_loads(r.topk_idx, E);
  EXPECT_EQ(testutil::download_vec(d_loads.ptr, E), loads) << name << " loads";
  std::vector<int> loads_after = loads_before;
  for (int e = 0; e < E; e++) loads_after[e] += loads[e];
  EXPECT_EQ(testutil::download_vec(d_loads_added.ptr, E), loads_after) << name << " loads added by router_forward";
}

// router_logits_forward and router_logits_backward on fresh x [N,H] and W [E,H] (floatX values),
// dlogits [N,E] (fp32 values) and a random starting dx and dW (both +=), against ref/matmul.hpp in
// double. Also: the Workspace peak of the two launchers is router_logits_workspace_bytes, every byte
// comes back, and the backward run again from the same dx and dW gives the same bits.
void check_router_logits(const char* name, int N, int H, int E) {
  Rng rng;
  const Mat x = testutil::round_to_floatX(rng.mat<double>(N, H));
  const Mat W = testutil::round_to_floatX(rng.mat<double>(E, H, 1.0 / std::sqrt((double)H)));
  const Mat dlogits = round_to_float(rng.mat<double>(N, E));
  // The starting gradient is as large as the update (entries of dlogitsᵀ·x are ~√N): dW's update is
  // read back as dW_after − dW_before, and dW_after carries one rounding of dW_before + ΔW, i.e. a
  // relative error ≤ u·‖dW_before + ΔW‖/‖ΔW‖ ≈ √2·u of the update (u = 2^-8 bf16: a few 1e-3, under
  // OP_TOL; u = 2^-24 fp32: ~1e-7, under 1e-5). A much larger dW_before would scale that error up.
  // dx starts at the scale of its update (the RMS of dlogits·W), for the same reason.
  const Mat dW_before = testutil::round_to_floatX(rng.mat<double>(E, H, std::sqrt((double)N)));
  Mat dx_ref, dW_ref;
  ref::matmul_backward(dlogits, x, W, dx_ref, dW_ref);
  const Mat dx_before = testutil::round_to_floatX(rng.mat<double>(N, H, dx_ref.norm() / std::sqrt((double)dx_ref.size())));

  auto d_x = testutil::upload<floatX>(x, Mem::Activations);
  auto d_W = testutil::upload<floatX>(W, Mem::Weights);
  auto d_dlogits = testutil::upload<float>(dlogits, Mem::Activations);
  auto d_dW = testutil::upload<floatX>(dW_before, Mem::Grads);
  DeviceBuffer<float> d_logits((size_t)N * E, Mem::Activations, "test.logits");
  auto d_dx = testutil::upload<floatX>(dx_before, Mem::Activations);
  testutil::poison(d_logits.ptr, d_logits.count);
  cublas_on(0, "test");  // cuBLAS's workspace comes from the pool once per process: not the operator's
  cudaCheck(cudaDeviceSynchronize(), "test", "setup");

  const size_t live_start = pool().live_total(), workspace_start = pool().live(Mem::Workspace);
  pool().reset_peak();
  router_logits_forward(d_logits.ptr, d_x.ptr, d_W.ptr, N, H, E, 0);
  router_logits_backward(d_dx.ptr, d_dW.ptr, d_dlogits.ptr, d_x.ptr, d_W.ptr, N, H, E, 0);
  EXPECT_EQ(pool().peak(Mem::Workspace) - workspace_start, router_logits_workspace_bytes(N, H, E)) << name;
  EXPECT_EQ(pool().live_total(), live_start) << name << ": the launchers did not return their pool bytes";

  const Mat dx_after = testutil::download(d_dx.ptr, N, H);
  const Mat dW_after = testutil::download(d_dW.ptr, E, H);
  {  // the backward again from the same dx and dW: the same bits
    const std::vector<floatX> dx_first = testutil::download_vec(d_dx.ptr, d_dx.count);
    const std::vector<floatX> dW_first = testutil::download_vec(d_dW.ptr, d_dW.count);
    auto d_dx_again = testutil::upload<floatX>(dx_before, Mem::Activations);
    auto d_dW_again = testutil::upload<floatX>(dW_before, Mem::Grads);
    router_logits_backward(d_dx_again.ptr, d_dW_again.ptr, d_dlogits.ptr, d_x.ptr, d_W.ptr, N, H, E, 0);
    EXPECT_EQ(0, memcmp(testutil::download_vec(d_dx_again.ptr, d_dx_again.count).data(), dx_first.data(),
                        dx_first.size() * sizeof(floatX))) << name << ": dx differs on replay";
    EXPECT_EQ(0, memcmp(testutil::download_vec(d_dW_again.ptr, d_dW_again.count).data(), dW_first.data(),
                        dW_first.size() * sizeof(floatX))) << name << ": dW differs on replay";
  }
  EXPECT_REL(name, "logits", testutil::rel_err(testutil::download(d_logits.ptr, N, E), ref::matmul_forward(x, W)),
             FP32_TOL);
  const Mat dx_update = dx_after - dx_before, dW_update = dW_after - dW_before;
  EXPECT_REL(name, "dx update (+=)", testutil::rel_err(dx_update, dx_ref), OP_TOL);
  EXPECT_REL(name, "dW update (+=)", testutil::rel_err(dW_update, dW_ref), OP_TOL);
#if defined(FLATMOE_BF16)
  expect_rounded_once(name, "dx (+=)", dx_after, dx_before + dx_ref);
  expect_rounded_once(name, "dW (+=)", dW_after, dW_before + dW_ref);
#endif
}

}  // namespace

TEST(RouterGpu, SoftmaxRenormSmall) {
  REQUIRE_GPU();
  check_router("router softmax renorm", 37, 5, 2, ROUTER_SOFTMAX, true);
}

TEST(RouterGpu, SigmoidRenormOddExpertCount) {
  REQUIRE_GPU();
  check_router("router sigmoid renorm", 300, 77, 6, ROUTER_SIGMOID, true);
}

TEST(RouterGpu, SoftmaxMaxExpertsMaxK) {
  REQUIRE_GPU();
  check_router("router softmax E=256 k=8", 129, ROUTER_MAX_E, ROUTER_MAX_K, ROUTER_SOFTMAX, false);
}

TEST(RouterGpu, SigmoidTopOne) {
  REQUIRE_GPU();
  check_router("router sigmoid k=1", 1001, 160, 1, ROUTER_SIGMOID, false);
}

TEST(RouterGpu, LogitsSmallOddShape) {
  REQUIRE_GPU();
  check_router_logits("router logits N=37 H=72 E=5", 37, 72, 5);
}

TEST(RouterGpu, LogitsMediumOddShape) {
  REQUIRE_GPU();
  check_router_logits("router logits N=301 H=136 E=77", 301, 136, 77);
}

TEST(RouterGpu, LogitsMaxExperts) {
  REQUIRE_GPU();
  check_router_logits("router logits N=1001 H=384 E=256", 1001, 384, ROUTER_MAX_E);
}

// The BF16 build adds the router's dx in the grouped GEMM's kernel (cuBLAS's beta = 1 on a bf16 C
// rounds twice), which needs H % 8 == 0: another H is refused, with its name and sizes.
TEST(RouterGpu, LogitsBackwardRefusesHiddenNotMultipleOf8) {
#if defined(FLATMOE_BF16)  // refused before any CUDA call: runs without a GPU too
  EXPECT_DEATH(router_logits_backward(nullptr, nullptr, nullptr, nullptr, nullptr, 37, 75, 5, 0),
               "router_logits_backward .N=37 H=75 E=5.: .*H must be a multiple of 8");
#else
  GTEST_SKIP() << "the FP32 build's dx is a plain fp32 GEMM, any H";
#endif
}

// ... and it copies W's rows in 16-byte pieces (three times, for the three parts), so a W that is
// not 16-byte aligned is refused too (the model's parameters always are: every tensor's size is a
// multiple of 8 elements).
TEST(RouterGpu, LogitsBackwardRefusesMisalignedWeight) {
#if defined(FLATMOE_BF16)  // refused before any CUDA call: runs without a GPU too
  const floatX* W = reinterpret_cast<const floatX*>(uintptr_t{4096 + 2});
  EXPECT_DEATH(router_logits_backward(nullptr, nullptr, nullptr, nullptr, W, 37, 72, 5, 0),
               "router_logits_backward .N=37 H=72 E=5 W=0x1002.: .*W must be 16-byte aligned");
#else
  GTEST_SKIP() << "the FP32 build's dW and dx are plain fp32 GEMMs on W as it is";
#endif
}

// Exact ties: equal keys go to the lower expert index, on the GPU as in the reference, also when
// the tied experts sit in the same lane (3, 35) or in different lanes (35, 36).
TEST(RouterGpu, TiesGoToLowerExpertIndex) {
  REQUIRE_GPU();
  const int N = 3, E = 40, k = 3;
  Mat logits = Mat::Zero(N, E);                    // token 0: every key equal
  for (int e = 0; e < E; e++) logits(1, e) = logits(2, e) = -0.05 * e;
  for (int e : {35, 3, 36}) logits(1, e) = 2.0;    // token 1: three-way tie at the top
  logits(2, 30) = logits(2, 7) = 1.5;              // token 2: tie for the second place
  logits(2, 20) = 3.0;
  logits = round_to_float(logits);
  Vec bias = Vec::Zero(E);
  const std::vector<int> expected = {0, 1, 2, 3, 35, 36, 20, 7, 30};

  auto d_logits = testutil::upload<float>(logits);
  auto d_bias = testutil::upload_vec(as_floats(bias));
  DeviceBuffer<int> d_idx(N * k, Mem::Workspace, "test.topk_idx");
  DeviceBuffer<float> d_w(N * k, Mem::Workspace, "test.topk_w");
  DeviceBuffer<float> d_scores(N * E, Mem::Workspace, "test.scores");
  for (int score_fn : {ROUTER_SOFTMAX, ROUTER_SIGMOID}) {
    auto r = ref::router_forward(logits, bias, k, score_fn, true);
    testutil::poison(d_idx.ptr, d_idx.count);
    testutil::poison(d_w.ptr, d_w.count);
    cudaCheck(cudaDeviceSynchronize(), "test", "setup");
    router_forward(d_idx.ptr, d_w.ptr, d_scores.ptr, d_logits.ptr, d_bias.ptr, N, E, k, score_fn, true, 0);
    std::vector<int> gpu = testutil::download_vec(d_idx.ptr, d_idx.count);
    EXPECT_EQ(gpu, expected) << "score_fn=" << score_fn;
    EXPECT_EQ(count_mismatches(expected, r.topk_idx), 0) << "reference, score_fn=" << score_fn;
    EXPECT_REL("router ties", "topk_w", testutil::rel_err(testutil::download(d_w.ptr, N, k), r.topk_w), FP32_TOL);
  }
}

// The launchers give a token router_lanes(E) lanes of a warp, fewer than the 32 that E = 256 needs:
// the same reductions over the same tree of expert positions, so the same bits as the 32-lane kernels
// (memcmp), at every E from one lane per token to a warp, on token counts that leave a warp's last
// groups empty. Counting the loads in the forward (the launchers' run) leaves the choice's bits alone.
TEST(RouterGpu, FewerLanesGiveTheSameBits) {
  REQUIRE_GPU();
  struct Case { int N, E, k, score_fn, lanes; };
  for (const Case c : {Case{4096, 8, 2, ROUTER_SOFTMAX, 1}, Case{1001, 13, 3, ROUTER_SIGMOID, 2},
                       Case{333, 32, 4, ROUTER_SOFTMAX, 4}, Case{333, 40, 3, ROUTER_SIGMOID, 8},
                       Case{257, 100, 4, ROUTER_SOFTMAX, 16}, Case{65, 256, 8, ROUTER_SOFTMAX, 32}}) {
    SCOPED_TRACE("E=" + std::to_string(c.E));
    EXPECT_EQ(router_lanes(c.E), c.lanes);
    Rng rng;
    const Mat logits = round_to_float(rng.mat<double>(c.N, c.E));
    auto d_logits = testutil::upload<float>(logits);
    auto d_bias = testutil::upload_vec(as_floats(random_bias(rng, c.E, 0.1)));
    auto d_dtopk_w = testutil::upload<float>(round_to_float(rng.mat<double>(c.N, c.k)));
    std::vector<int> idx[2];
    std::vector<float> w[2], scores[2], dlogits[2];
    DeviceBuffer<int> d_loads(c.E, Mem::Workspace, "test.loads");
    cudaCheck(cudaMemsetAsync(d_loads.ptr, 0, d_loads.bytes(), 0), "test", "zero loads");
    for (int run = 0; run < 2; run++) {  // run 0: the launchers, counting loads; run 1: the 32-lane kernels, not
      DeviceBuffer<int> d_idx((size_t)c.N * c.k, Mem::Workspace, "test.topk_idx");
      DeviceBuffer<float> d_w((size_t)c.N * c.k, Mem::Workspace, "test.topk_w");
      DeviceBuffer<float> d_scores((size_t)c.N * c.E, Mem::Workspace, "test.scores");
      DeviceBuffer<float> d_dlogits((size_t)c.N * c.E, Mem::Workspace, "test.dlogits");
      testutil::poison(d_idx.ptr, d_idx.count);
      testutil::poison(d_w.ptr, d_w.count);
      testutil::poison(d_scores.ptr, d_scores.count);
      testutil::poison(d_dlogits.ptr, d_dlogits.count);
      if (run == 0) {
        router_forward(d_idx.ptr, d_w.ptr, d_scores.ptr, d_logits.ptr, d_bias.ptr, c.N, c.E, c.k, c.score_fn, true, 0,
                       d_loads.ptr);
        router_backward(d_dlogits.ptr, d_dtopk_w.ptr, d_scores.ptr, d_idx.ptr, c.N, c.E, c.k, c.score_fn, true, 0);
      } else {
        const dim3 grid(ceil_div((size_t)c.N * 32, ROUTER_BLOCK)), block(ROUTER_BLOCK);
        router_forward_kernel<32><<<grid, block>>>(d_idx.ptr, d_w.ptr, d_scores.ptr, nullptr, d_logits.ptr, d_bias.ptr,
                                                   c.N, c.E, c.k, c.score_fn, true);
        router_backward_kernel<32><<<grid, block>>>(d_dlogits.ptr, d_dtopk_w.ptr, d_scores.ptr, d_idx.ptr, c.N, c.E,
                                                    c.k, c.score_fn, true);
        launchCheck("test", "32-lane router kernels");
      }
      idx[run] = testutil::download_vec(d_idx.ptr, d_idx.count);
      w[run] = testutil::download_vec(d_w.ptr, d_w.count);
      scores[run] = testutil::download_vec(d_scores.ptr, d_scores.count);
      dlogits[run] = testutil::download_vec(d_dlogits.ptr, d_dlogits.count);
    }
    EXPECT_EQ(idx[0], idx[1]);
    std::vector<int> loads(c.E, 0);
    for (int e : idx[1]) loads[e]++;
    EXPECT_EQ(testutil::download_vec(d_loads.ptr, c.E), loads) << "loads";
    EXPECT_EQ(0, memcmp(w[0].data(), w[1].data(), w[0].size() * sizeof(float))) << "topk_w";
    EXPECT_EQ(0, memcmp(scores[0].data(), scores[1].data(), scores[0].size() * sizeof(float))) << "scores";
    EXPECT_EQ(0, memcmp(dlogits[0].data(), dlogits[1].data(), dlogits[0].size() * sizeof(float))) << "dlogits";
  }
}

// A routing profile's choice overrides the selection: its weights are the selected scores,
// renormalised, exactly as the reference computes them.
TEST(RouterGpu, WeightsOfAGivenChoice) {
  REQUIRE_GPU();
  for (bool renorm : {false, true}) {
    Rng rng;
    const int N = 93, E = 13, k = 3;
    Mat scores = round_to_float(ref::router_scores(rng.mat<double>(N, E, 1.0), ROUTER_SOFTMAX));
    ref::MatI idx(N, k);
    for (int n = 0; n < N; n++)
      for (int j = 0; j < k; j++) idx(n, j) = rng.integer(0, E - 1);  // repeats allowed, as in hot profiles
    std::vector<int> idx_v(idx.data(), idx.data() + idx.size());
    DeviceBuffer<float> scores_dev = testutil::upload<float>(scores);
    DeviceBuffer<int> idx_dev = testutil::upload_vec(idx_v);
    DeviceBuffer<float> w_dev((size_t)N * k, Mem::Workspace, "topk_w");
    testutil::poison(w_dev.ptr, w_dev.count);
    router_weights(w_dev.ptr, scores_dev.ptr, idx_dev.ptr, N, E, k, renorm, 0);
    Mat expected = ref::router_weights(scores, idx, renorm);
    EXPECT_REL(renorm ? "router weights renorm" : "router weights", "topk_w",
               testutil::rel_err(testutil::download(w_dev.ptr, N, k), expected), FP32_TOL);
  }
}

// A routing profile's experts made on the device (router_profile_choice) are its host twin's
// (routing_profile_indices), index for index: balanced, hot with h < k, h = k, h > k, every token hot at
// h = E, a fraction whose r·N falls just below an integer in binary (0.29 · 100); N not a multiple of the
// block. A size the profile cannot fill is refused.
TEST(RouterGpu, ProfileChoiceOnTheDeviceIsTheHostProfile) {
  REQUIRE_GPU();
  struct Case {
    const char* profile;
    int N, E, k;
  };
  for (const Case& c : {Case{"balanced", 1000, 13, 3}, Case{"hot:0.5/2", 777, 16, 4}, Case{"hot:0.25/4", 301, 16, 4},
                        Case{"hot:0.29/5", 100, 8, 3}, Case{"hot:1/6", 257, 6, 4}, Case{"hot:0/3", 64, 32, 8}}) {
    const RoutingProfile p = parse_routing_profile(c.profile);
    DeviceBuffer<int> idx((size_t)c.N * c.k, Mem::Workspace, "test.topk_idx");
    testutil::poison(idx.ptr, idx.count);
    router_profile_choice(idx.ptr, p, c.N, c.E, c.k, 0);
    EXPECT_EQ(testutil::download_vec(idx.ptr, idx.count), routing_profile_indices(p, c.N, c.E, c.k)) << c.profile;
  }
  DeviceBuffer<int> idx(64, Mem::Workspace, "test.topk_idx");
  EXPECT_DEATH(router_profile_choice(idx.ptr, parse_routing_profile("hot:0.5/9"), 16, 8, 4, 0),
               "router_profile_choice.*h <= E");
}

// router_add_loads adds (+=) into one layer's slice of a step-wide [L·E] buffer, as model.cuh does
// over a step's micro-batches: after three choices per layer the buffer holds, exactly, the sums of
// ref::router_count_loads over them, and no neighbouring slice is touched.
TEST(RouterGpu, AddLoadsAccumulatesIntoLayerSlices) {
  REQUIRE_GPU();
  Rng rng;
  const int L = 3, E = 37, k = 4;
  DeviceBuffer<int> loads_dev((size_t)L * E, Mem::Workspace, "test.step_loads");
  cudaCheck(cudaMemsetAsync(loads_dev.ptr, 0, loads_dev.bytes(), 0), "test", "zero");
  std::vector<int> expected((size_t)L * E, 0);
  for (int pass = 0; pass < 3; pass++)
    for (int l = 0; l < L; l++) {
      const int N = 1 + 97 * pass + 31 * l;  // odd sizes, not multiples of the block
      ref::MatI idx(N, k);
      for (int n = 0; n < N; n++)
        for (int j = 0; j < k; j++) idx(n, j) = rng.integer(0, E - 1);
      std::vector<int> idx_v(idx.data(), idx.data() + idx.size());
      DeviceBuffer<int> idx_dev = testutil::upload_vec(idx_v);
      router_add_loads(loads_dev.ptr + (size_t)l * E, idx_dev.ptr, N, E, k, 0);
      const std::vector<int> counted = ref::router_count_loads(idx, E);
      for (int e = 0; e < E; e++) expected[(size_t)l * E + e] += counted[e];
    }
  EXPECT_EQ(testutil::download_vec(loads_dev.ptr, (size_t)L * E), expected);
}
