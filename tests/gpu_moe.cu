// tests/gpu_moe.cu — ops/moe.cuh against ref/moe.hpp. Routing decisions are inputs (random
// distinct experts per token, random positive weights; notes/design.md §3): uniform, skewed onto one expert,
// with experts that receive no route, the dense E = 1, k = 1 case, and enough experts to need
// several pointer chunks. Checks out, dx, dtopk_w, dW13 and dW2 (+=), the measured live set, the
// pool returning to its starting bytes, bit-for-bit replay, and the stable sort of the plan.
#include <algorithm>
#include <cstring>
#include <functional>
#include <numeric>
#include "gpu_util.cuh"
#include "moe_inputs.cuh"
#include "../ops/moe.cuh"
#include "../ref/moe.hpp"

namespace {

using testutil::Rng;
using Mat = ref::Mat<double>;

// Chooses the k distinct experts of token n, in slot order.
using RouteChooser = std::function<std::vector<int>(Rng&, int n)>;

// k distinct experts drawn uniformly from `allowed`.
RouteChooser uniform_routes(std::vector<int> allowed, int k) {
  return [allowed, k](Rng& rng, int) {
    std::vector<int> experts = allowed;
    std::shuffle(experts.begin(), experts.end(), rng.gen);
    experts.resize(k);
    return experts;
  };
}

// Slot 0 goes to expert 0 for ~90 % of the tokens; the other slots are distinct experts from `others`.
RouteChooser skewed_routes(std::vector<int> others, int k) {
  return [others, k](Rng& rng, int) {
    std::vector<int> experts = others;
    std::shuffle(experts.begin(), experts.end(), rng.gen);
    if (rng.uniform(0, 1) < 0.9) experts.insert(experts.begin(), 0);
    experts.resize(k);
    return experts;
  };
}

// Global inputs of one check, rounded to what the GPU holds (floatX activations/weights, float routing weights).
struct MoECase : ExpertWeights {
  int N, H, I, E, k;
  Mat x, dout, topk_w;
  ref::MatI topk_idx;
};

MoECase make_case(Rng& rng, int N, int H, int I, int E, int k, const RouteChooser& choose) {
  MoECase c;
  c.N = N; c.H = H; c.I = I; c.E = E; c.k = k;
  c.x = testutil::round_to_floatX(rng.mat<double>(N, H));
  c.dout = testutil::round_to_floatX(rng.mat<double>(N, H));
  c.topk_idx.resize(N, k);
  c.topk_w.resize(N, k);
  for (int n = 0; n < N; n++) {
    std::vector<int> experts = choose(rng, n);
    for (int j = 0; j < k; j++) {
      c.topk_idx(n, j) = experts[j];
      c.topk_w(n, j) = (double)(float)rng.uniform(0.1, 1.0);
    }
  }
  static_cast<ExpertWeights&>(c) = random_experts(rng, E, H, I);
  return c;
}

std::vector<int> routes_per_expert(const ref::MatI& topk_idx, int E) {
  std::vector<int> counts(E, 0);
  for (Eigen::Index i = 0; i < topk_idx.size(); i++) counts[topk_idx.data()[i]]++;
  return counts;
}

// What one forward + backward on the device produced.
struct MoEResult {
  Mat out, dx, dtopk_w, dW13, dW2;
};

// Runs moe_forward + moe_backward on a non-default stream, with poisoned outputs and gradient
// buffers that start at dW*_init; checks the saved and peak live set and that the pool returns to
// its starting bytes. dense_routes: moe_forward's known-count path (E = 1, k = 1, no download).
MoEResult run_device(const MoECase& c, bool dense_routes = false) {
  const int N = c.N, H = c.H, I = c.I, E = c.E, k = c.k;
  const size_t R = (size_t)N * k, b = sizeof(floatX);
  auto d_x = testutil::upload<floatX>(c.x);
  auto d_dout = testutil::upload<floatX>(c.dout);
  auto d_idx = testutil::upload_vec(flat(c.topk_idx));
  auto d_w = testutil::upload<float>(c.topk_w);
  auto d_W13 = testutil::upload<floatX>(stack(c.W13));
  auto d_W2 = testutil::upload<floatX>(stack(c.W2));
  auto d_dW13 = testutil::upload<floatX>(stack(c.dW13_init));
  auto d_dW2 = testutil::upload<floatX>(stack(c.dW2_init));
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Workspace, "test.out");
  DeviceBuffer<floatX> d_dx((size_t)N * H, Mem::Workspace, "test.dx");
  DeviceBuffer<float> d_dtopk_w(R, Mem::Workspace, "test.dtopk_w");
  testutil::poison(d_out.ptr, d_out.count);
  testutil::poison(d_dx.ptr, d_dx.count);
  testutil::poison(d_dtopk_w.ptr, d_dtopk_w.count);
  cudaStream_t stream;
  cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "test", "stream");
  cudaCheck(cudaDeviceSynchronize(), "test", "setup");

  const size_t live_start = pool().live_total();
  const size_t dispatch_start = pool().live(Mem::Dispatch), inter_start = pool().live(Mem::ExpertIntermediates);
  pool().reset_peak();
  MoESaved saved;
  moe_forward(d_out.ptr, saved, d_x.ptr, d_idx.ptr, d_w.ptr, d_W13.ptr, d_W2.ptr, N, H, I, E, k, stream, dense_routes);
  // the experts' offsets on the device; the counts on the host too unless they stay on the device
  const std::vector<int> offsets = testutil::download_vec(saved.expert_offsets, (size_t)E + 1);
  std::vector<int> counts(E);
  for (int e = 0; e < E; e++) counts[e] = offsets[e + 1] - offsets[e];
  EXPECT_EQ(counts, routes_per_expert(c.topk_idx, E));
  EXPECT_EQ(offsets[0], 0);
  EXPECT_EQ(saved.rows.device_offsets != nullptr, !dense_routes && moe_counts_stay_on_device(H, I, E, (long long)R));
  if (!saved.rows.device_offsets) EXPECT_EQ(saved.rows.counts, counts);
  // saved between forward and backward: route maps, expert offsets + y (Dispatch), h13 (ExpertIntermediates)
  EXPECT_EQ(pool().live(Mem::Dispatch) - dispatch_start, 2 * R * sizeof(int) + (E + 1) * sizeof(int) + R * H * b);
  EXPECT_EQ(pool().live(Mem::ExpertIntermediates) - inter_start, R * 2 * I * b);
  moe_backward(d_dx.ptr, d_dtopk_w.ptr, d_dW13.ptr, d_dW2.ptr, d_dout.ptr, saved, d_x.ptr, d_idx.ptr, d_w.ptr,
               d_W13.ptr, d_W2.ptr, stream);
  // peak live set: one R·H row buffer beside y; per-route hidden state at most 3·R·I (h13 and da:
  // dh13 over h13, a over da)
  EXPECT_LE(pool().peak(Mem::Dispatch) - dispatch_start, 2 * R * sizeof(int) + (E + 1) * sizeof(int) + 2 * R * H * b);
  EXPECT_LE(pool().peak(Mem::ExpertIntermediates) - inter_start, 3 * R * I * b);
  moe_saved_free(saved);
  EXPECT_EQ(pool().live_total(), live_start) << "moe_forward/backward/saved_free leaked pool bytes";

  MoEResult res;
  res.out = testutil::download(d_out.ptr, N, H);
  res.dx = testutil::download(d_dx.ptr, N, H);
  res.dtopk_w = testutil::download(d_dtopk_w.ptr, N, k);
  res.dW13 = testutil::download(d_dW13.ptr, E * 2 * I, H);
  res.dW2 = testutil::download(d_dW2.ptr, E * H, I);
  cudaCheck(cudaStreamDestroy(stream), "test", "stream");
  return res;
}

// Device results against the reference; weight gradients accumulate onto their starting values,
// and experts without routes keep them bit for bit.
void check_case(const char* name, const MoECase& c) {
  Mat out_ref = ref::moe_forward(c.x, c.topk_idx, c.topk_w, c.W13, c.W2);
  auto g = ref::moe_backward(c.dout, c.x, c.topk_idx, c.topk_w, c.W13, c.W2);
  MoEResult res = run_device(c);
  EXPECT_REL(name, "out", testutil::rel_err(res.out, out_ref), OP_TOL);
  EXPECT_REL(name, "dx", testutil::rel_err(res.dx, g.dx), OP_TOL);
  EXPECT_REL(name, "dtopk_w", testutil::rel_err(res.dtopk_w, g.dtopk_w), OP_TOL);
  Mat dW13_expected = stack(c.dW13_init) + stack(g.dW13);
  Mat dW2_expected = stack(c.dW2_init) + stack(g.dW2);
  EXPECT_REL(name, "dW13 (+=)", testutil::rel_err(res.dW13, dW13_expected), OP_TOL);
  EXPECT_REL(name, "dW2 (+=)", testutil::rel_err(res.dW2, dW2_expected), OP_TOL);
  std::vector<int> counts = routes_per_expert(c.topk_idx, c.E);
  for (int e = 0; e < c.E; e++) {
    if (counts[e] > 0) continue;
    EXPECT_EQ(res.dW13.middleRows(e * 2 * c.I, 2 * c.I), c.dW13_init[e]) << name << " expert " << e;
    EXPECT_EQ(res.dW2.middleRows(e * c.H, c.H), c.dW2_init[e]) << name << " expert " << e;
  }
}

// Two runs' results equal value for value (the downloads are the floatX values, exactly).
void expect_same_results(const MoEResult& a, const MoEResult& b) {
  EXPECT_EQ(a.out, b.out);
  EXPECT_EQ(a.dx, b.dx);
  EXPECT_EQ(a.dtopk_w, b.dtopk_w);
  EXPECT_EQ(a.dW13, b.dW13);
  EXPECT_EQ(a.dW2, b.dW2);
}

}  // namespace

TEST(MoEGpu, UniformRoutingWithAnEmptyExpert) {
  REQUIRE_GPU();
  Rng rng;
  MoECase c = make_case(rng, 37, 72, 40, 5, 2, uniform_routes({0, 1, 2, 4}, 2));  // expert 3 gets nothing
  check_case("moe N=37 E=5 k=2", c);
}

TEST(MoEGpu, SkewedRoutingOntoOneExpert) {
  REQUIRE_GPU();
  Rng rng;
  MoECase c = make_case(rng, 300, 128, 96, 8, 3, skewed_routes({1, 2, 3, 4, 5}, 3));  // experts 6, 7 get nothing
  check_case("moe N=300 E=8 k=3 skewed", c);
}

// More experts than one launch argument of pointers holds (3·groups > 480), most with few routes.
TEST(MoEGpu, ManySmallExperts) {
  REQUIRE_GPU();
  Rng rng;
  std::vector<int> all(200);
  for (int e = 0; e < 200; e++) all[e] = e;
  MoECase c = make_case(rng, 400, 32, 16, 200, 2, uniform_routes(all, 2));
  check_case("moe N=400 E=200 k=2", c);
}

// E = 1, k = 1 with dense_routes: the dense SwiGLU FFN.
TEST(MoEGpu, DenseRoutesGiveDenseSwiGLU) {
  REQUIRE_GPU();
  const int N = 45;
  DeviceBuffer<int> d_idx(N, Mem::Workspace, "test.topk_idx");
  DeviceBuffer<float> d_w(N, Mem::Workspace, "test.topk_w");
  testutil::poison(d_idx.ptr, N);
  testutil::poison(d_w.ptr, N);
  dense_routes(d_idx.ptr, d_w.ptr, N, 0);
  EXPECT_EQ(testutil::download_vec(d_idx.ptr, N), std::vector<int>(N, 0));
  EXPECT_EQ(testutil::download_vec(d_w.ptr, N), std::vector<float>(N, 1.f));
  Rng rng;
  MoECase c = make_case(rng, N, 64, 88, 1, 1, uniform_routes({0}, 1));
  c.topk_w.setOnes();
  check_case("moe dense E=1 k=1", c);
}

// moe_forward's dense_routes path (the count N known on the host, no download: model.cuh's dense
// layers and shared expert) gives the same bits as the downloaded plan; it refuses E > 1.
TEST(MoEGpu, DenseRoutesKnownCountIsBitIdentical) {
  REQUIRE_GPU();
  Rng rng;
  MoECase c = make_case(rng, 77, 64, 40, 1, 1, uniform_routes({0}, 1));
  c.topk_w.setOnes();
  expect_same_results(run_device(c, false), run_device(c, true));
}

// dense_routes with E > 1 or k > 1 is refused before any device work (runs with or without a GPU).
TEST(MoEGpuDeathTest, DenseRoutesRefuseMoreThanOneExpert) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  MoESaved saved;
  EXPECT_DEATH(moe_forward(nullptr, saved, nullptr, nullptr, nullptr, nullptr, nullptr, 8, 16, 8, 2, 1, 0, true),
               "moe_forward \\(N=8 E=2 k=1\\): dense_routes needs E = 1 and k = 1");
  EXPECT_DEATH(moe_forward(nullptr, saved, nullptr, nullptr, nullptr, nullptr, nullptr, 8, 16, 8, 1, 2, 0, true),
               "moe_forward \\(N=8 E=1 k=2\\): dense_routes needs E = 1 and k = 1");
}

// The same inputs replay bit for bit (no float atomics, fixed orders).
TEST(MoEGpu, ReplaysBitForBit) {
  REQUIRE_GPU();
  Rng rng;
  MoECase c = make_case(rng, 211, 64, 48, 6, 2, skewed_routes({1, 2, 3, 4, 5}, 2));
  expect_same_results(run_device(c), run_device(c));
}

// moe_forward onto a residual (model.cuh's x_out = x_mid + FFN(ln2), added in the combine): out =
// residual + the FFN, within the operator tolerance of the reference, into a separate buffer (the
// residual untouched) and in place (out holding the residual) with the same bits, and in the BF16
// build one rounding of the exact sum (the fp32 combine plus the residual, not two roundings). The
// residual is at the scale of the FFN's output, so both parts of the sum matter.
TEST(MoEGpu, ForwardOntoAResidualAddsItInTheCombine) {
  REQUIRE_GPU();
  Rng rng;
  const MoECase c = make_case(rng, 53, 72, 40, 5, 2, uniform_routes({0, 1, 2, 3, 4}, 2));
  const int N = c.N, H = c.H, I = c.I, E = c.E, k = c.k;
  const Mat out_ref = ref::moe_forward(c.x, c.topk_idx, c.topk_w, c.W13, c.W2);
  const Mat residual = testutil::round_to_floatX(rng.mat<double>(N, H, out_ref.norm() / std::sqrt((double)out_ref.size())));
  auto d_x = testutil::upload<floatX>(c.x);
  auto d_idx = testutil::upload_vec(flat(c.topk_idx));
  auto d_w = testutil::upload<float>(c.topk_w);
  auto d_W13 = testutil::upload<floatX>(stack(c.W13));
  auto d_W2 = testutil::upload<floatX>(stack(c.W2));
  auto d_residual = testutil::upload<floatX>(residual);
  auto d_in_place = testutil::upload<floatX>(residual);
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Workspace, "test.out");
  testutil::poison(d_out.ptr, d_out.count);
  MoESaved apart, in_place;
  moe_forward(d_out.ptr, apart, d_x.ptr, d_idx.ptr, d_w.ptr, d_W13.ptr, d_W2.ptr, N, H, I, E, k, 0, false, d_residual.ptr);
  moe_forward(d_in_place.ptr, in_place, d_x.ptr, d_idx.ptr, d_w.ptr, d_W13.ptr, d_W2.ptr, N, H, I, E, k, 0, false,
              d_in_place.ptr);
  const Mat out = testutil::download(d_out.ptr, N, H);
  EXPECT_EQ(testutil::download(d_residual.ptr, N, H), residual) << "the residual is read, not written";
  EXPECT_EQ(testutil::download(d_in_place.ptr, N, H), out) << "in place: the same bits";
  const Mat expected = residual + out_ref;
  EXPECT_REL("moe onto a residual", "out", testutil::rel_err(out, expected), OP_TOL);
#if defined(FLATMOE_BF16)
  // the exact sum of what the combine adds: the residual and Σ_j w_j · y_j over the GPU's own y rows
  const std::vector<int> slot_of_route = testutil::download_vec(apart.slot_of_route, (size_t)N * k);
  const Mat y = testutil::download(apart.y, N * k, H);
  Mat exact = residual;
  for (int n = 0; n < N; n++)
    for (int j = 0; j < k; j++) exact.row(n) += c.topk_w(n, j) * y.row(slot_of_route[(size_t)n * k + j]);
  const Mat rounded = testutil::round_to_floatX(exact);
  long long differ = 0;
  for (Eigen::Index i = 0; i < out.size(); i++) differ += out.data()[i] != rounded.data()[i];
  printf("[round] moe onto a residual: %lld of %lld elements differ from the correctly rounded sum\n", differ,
         (long long)out.size());
  EXPECT_LE((double)differ, 0.01 * out.size()) << "not one rounding of residual + combine";
#endif
  moe_saved_free(apart);
  moe_saved_free(in_place);
}

// moe_route_plan is the stable sort of the routes by expert (std::stable_sort on the host); slot_of_route
// is its inverse and the counts come back.
namespace {
void check_route_plan(const ref::MatI& topk_idx, int E) {
  const int R = (int)topk_idx.size();
  std::vector<int> idx = flat(topk_idx);
  std::vector<int> expected(R);
  for (int r = 0; r < R; r++) expected[r] = r;
  std::stable_sort(expected.begin(), expected.end(), [&](int a, int b) { return idx[a] < idx[b]; });

  auto d_idx = testutil::upload_vec(idx);
  DeviceBuffer<int> d_route_of_slot(R, Mem::Dispatch, "test.route_of_slot");
  DeviceBuffer<int> d_slot_of_route(R, Mem::Dispatch, "test.slot_of_route");
  testutil::poison(d_route_of_slot.ptr, R);
  testutil::poison(d_slot_of_route.ptr, R);
  std::vector<int> counts = moe_route_plan(d_route_of_slot.ptr, d_slot_of_route.ptr, d_idx.ptr, R, E, 0);
  std::vector<int> route_of_slot = testutil::download_vec(d_route_of_slot.ptr, R);
  std::vector<int> slot_of_route = testutil::download_vec(d_slot_of_route.ptr, R);
  EXPECT_EQ(counts, routes_per_expert(topk_idx, E));
  EXPECT_EQ(route_of_slot, expected);
  int not_inverse = 0;
  for (int s = 0; s < R; s++) not_inverse += slot_of_route[route_of_slot[s]] != s;
  EXPECT_EQ(not_inverse, 0);
}

ref::MatI chosen_routes(const RouteChooser& choose, int N, int k) {
  Rng rng;
  ref::MatI topk_idx(N, k);
  for (int n = 0; n < N; n++) {
    std::vector<int> experts = choose(rng, n);
    for (int j = 0; j < k; j++) topk_idx(n, j) = experts[j];
  }
  return topk_idx;
}
}  // namespace

// Across 32 tiles, under skew, with empty experts (4, 6, 7, 10, ... get nothing); the rank kernel
// scans the counts itself (32 tiles × 17 bins).
TEST(MoEGpu, RoutePlanIsStableSortByExpert) {
  REQUIRE_GPU();
  ASSERT_TRUE(moe_plan_scans_in_rank(2001 * 4, 16));
  check_route_plan(chosen_routes(skewed_routes({1, 2, 3, 5, 8, 9, 13}, 4), 2001, 4), 16);
}

// The rank kernel's own scan where its bins outnumber its warps and one round of warp 0's scan of
// the totals (48 bins), over tiles more than a lane's one load (300 tiles: 300 × 48 counts, under
// MOE_PLAN_SCAN_IN_RANK), under skew (expert 0 and three others).
TEST(MoEGpu, RoutePlanScannedInTheRankKernelOverManyTilesAndBins) {
  REQUIRE_GPU();
  ASSERT_TRUE(moe_plan_scans_in_rank(300 * MOE_PLAN_TILE, 47));
  check_route_plan(chosen_routes(skewed_routes({20, 33, 46}, 3), 25600, 3), 47);
}

// Where the plan's scan is a launch of its own, with more than one chunk of tiles per lane and the
// last lane fewer (1172 tiles: 37 a lane, 25 for lane 31), more bins than its warps and than one
// round of warp 0's scan of the totals (71), under skew (expert 0 and four others).
TEST(MoEGpu, RoutePlanIsStableSortByExpertOverManyTilesAndBins) {
  REQUIRE_GPU();
  ASSERT_FALSE(moe_plan_scans_in_rank(150001 * 2, 70));
  check_route_plan(chosen_routes(skewed_routes({33, 34, 50, 69}, 2), 150001, 2), 70);
}

// With the offsets kept on the device (what moe_forward does in the BF16 build, where nothing refuses
// an index), a route whose expert index is outside [0, E) still gets a slot: after every expert's,
// in route order, so that the maps stay a permutation of [0, R) and no kernel reads outside them;
// offsets[E] is where those routes start.
TEST(MoEGpu, RouteSortPutsIndicesOutsideTheExpertsAfterThem) {
  REQUIRE_GPU();
  Rng rng;
  const int R = 1500, E = 6;
  std::vector<int> idx(R);
  for (int& e : idx) e = rng.integer(0, E - 1);
  for (int r : {3, 700, 701, 1499}) idx[r] = r % 2 ? E : -1;  // outside, in both directions
  idx[900] = 1000;
  auto bin = [&](int e) { return e >= 0 && e < E ? e : E; };
  std::vector<int> expected(R);
  for (int r = 0; r < R; r++) expected[r] = r;
  std::stable_sort(expected.begin(), expected.end(), [&](int a, int b) { return bin(idx[a]) < bin(idx[b]); });
  std::vector<int> expected_offsets(E + 1, 0);
  for (int e = 0; e < E; e++) expected_offsets[e + 1] = expected_offsets[e] + (int)std::count(idx.begin(), idx.end(), e);

  auto d_idx = testutil::upload_vec(idx);
  DeviceBuffer<int> d_route_of_slot(R, Mem::Dispatch, "test.route_of_slot");
  DeviceBuffer<int> d_slot_of_route(R, Mem::Dispatch, "test.slot_of_route");
  DeviceBuffer<int> d_offsets(E + 1, Mem::Dispatch, "test.offsets");
  testutil::poison(d_route_of_slot.ptr, R);
  testutil::poison(d_slot_of_route.ptr, R);
  testutil::poison(d_offsets.ptr, E + 1);
  moe_route_sort(d_route_of_slot.ptr, d_slot_of_route.ptr, d_offsets.ptr, d_idx.ptr, R, E, 0, nullptr);
  std::vector<int> route_of_slot = testutil::download_vec(d_route_of_slot.ptr, R);
  std::vector<int> slot_of_route = testutil::download_vec(d_slot_of_route.ptr, R);
  EXPECT_EQ(testutil::download_vec(d_offsets.ptr, E + 1), expected_offsets);
  EXPECT_EQ(expected_offsets[E], R - 5);
  EXPECT_EQ(route_of_slot, expected);
  int not_inverse = 0;
  for (int s = 0; s < R; s++) not_inverse += slot_of_route[route_of_slot[s]] != s;
  EXPECT_EQ(not_inverse, 0);
}

// Which plans scan their counts in the rank kernel (two launches) and which launch the scan (three):
// (E + 1)·tiles counts up to MOE_PLAN_SCAN_IN_RANK. The default model's 8192 routes over 8 experts
// and B1's 65536 over 32 do; 150002 routes over 70 experts (1172 tiles) do not. Runs without a GPU (CI).
TEST(MoEHost, RoutePlanScansInTheRankKernelUpToItsBound) {
  EXPECT_TRUE(moe_plan_scans_in_rank(4096 * 2, 8));
  EXPECT_TRUE(moe_plan_scans_in_rank(16384 * 4, 32));
  EXPECT_FALSE(moe_plan_scans_in_rank(150001 * 2, 70));
  EXPECT_TRUE(moe_plan_scans_in_rank(512 * MOE_PLAN_TILE, 31));       // 512 tiles × 32 bins = the bound
  EXPECT_FALSE(moe_plan_scans_in_rank(512 * MOE_PLAN_TILE + 1, 31));  // one tile more
  EXPECT_TRUE(moe_plan_scans_in_rank(1, 12287));                       // one tile of the most bins
}

// Which layers keep their per-expert counts on the device (no host wait in the layer): in the BF16
// build the default model's (H 384, I 384, E 8, 8192 routes: dW13 0.6 GFLOP per expert) and, with the
// grouped GEMM's wgmma form, config B1's (H 1024, I 512, E 32, 65536 routes: dW13 4.3 GFLOP per
// expert, which without wgmma is faster on cuBLAS, which takes its sizes from the host); not a width
// that is not a multiple of 8; none in the FP32 build. Runs without a GPU (CI).
TEST(MoEHost, CountsStayOnTheDeviceUnlessCublasTakesTheWeightGradients) {
  const bool bf16 = BUILD_BF16, wgmma = BUILD_WGMMA;
  EXPECT_EQ(moe_counts_stay_on_device(384, 384, 8, 8192), bf16) << "the default model";
  EXPECT_EQ(moe_counts_stay_on_device(1024, 512, 32, 65536), wgmma) << "B1";
  EXPECT_EQ(moe_counts_stay_on_device(1024, 512, 32, 32768), bf16) << "B1's layer at half the tokens (2.1 GFLOP)";
  EXPECT_FALSE(moe_counts_stay_on_device(384, 36, 8, 8192)) << "I not a multiple of 8";
}

// The row kernels (moe_permute_rows, moe_combine weighted and plain, moe_combine_window_add,
// swiglu_forward and swiglu_backward, moe_combine_backward; and common.cuh's add_inplace_or_out,
// floatX + floatX and fp32 += floatX) move rows in 16-byte pieces when H and the buffers allow and
// one element per thread otherwise (ops/common.cuh, ROW_PIECE). Both paths give the same bits — but
// for moe_combine_backward's dtopk_w, a dot product whose lanes sum in another order — and the values
// of the reference: the element path is taken here by placing every buffer one element past an
// aligned address.
TEST(MoEGpu, RowKernelsGiveTheSameBitsInPiecesAndByElement) {
  REQUIRE_GPU();
  Rng rng;
  const int N = 53, H = 72, k = 3, R = N * k, first = 17, count = 60;  // the window: slots [17, 77)
  const int I = 40;                                                     // SwiGLU on R rows of [2I]
  std::vector<int> route_of_slot(R), slot_of_route(R);
  std::iota(route_of_slot.begin(), route_of_slot.end(), 0);
  std::shuffle(route_of_slot.begin(), route_of_slot.end(), rng.gen);
  for (int s = 0; s < R; s++) slot_of_route[route_of_slot[s]] = s;
  const Mat x = testutil::round_to_floatX(rng.mat<double>(N, H));
  const Mat rows = testutil::round_to_floatX(rng.mat<double>(R, H));
  const Mat acc0 = testutil::round_to_float(rng.mat<double>(N, H));
  const Mat h13 = testutil::round_to_floatX(rng.mat<double>(R, 2 * I, 2.0));
  const Mat da = testutil::round_to_floatX(rng.mat<double>(R, I));
  Mat topk_w(N, k);
  for (Eigen::Index i = 0; i < topk_w.size(); i++) topk_w.data()[i] = (double)(float)rng.uniform(0.1, 1.0);
  auto d_route_of_slot = testutil::upload_vec(route_of_slot);
  auto d_slot_of_route = testutil::upload_vec(slot_of_route);
  auto d_w = testutil::upload<float>(topk_w);

  // Each output's bits, with every buffer at `offset` elements past a pool (aligned) address.
  struct Outputs {
    std::vector<floatX> permuted, weighted, plain, onto, a, dh13, a_in_place, dh13_in_place, sum, dy;
    std::vector<float> window, sum32, dtopk_w;
  };
  auto run = [&](int offset) {
    auto placed = [&](auto zero, const Mat& m, const char* tag) {  // m at `offset`, as decltype(zero)
      using T = decltype(zero);
      std::vector<T> host(offset + m.size(), zero);
      for (Eigen::Index i = 0; i < m.size(); i++) host[offset + i] = from_float<T>((float)m.data()[i]);
      return testutil::upload_vec(host, Mem::Workspace, tag);
    };
    auto d_x = placed(floatX(), x, "test.x");
    auto d_rows = placed(floatX(), rows, "test.rows");
    auto d_acc = placed(0.f, acc0, "test.acc");
    auto d_h13 = placed(floatX(), h13, "test.h13");
    auto d_da = placed(floatX(), da, "test.da");
    auto d_h13_in_place = placed(floatX(), h13, "test.h13_in_place");  // becomes dh13
    auto d_da_in_place = placed(floatX(), da, "test.da_in_place");     // becomes a
    DeviceBuffer<floatX> d_a(offset + (size_t)R * I, Mem::Workspace, "test.a");
    DeviceBuffer<floatX> d_dh13(offset + (size_t)R * 2 * I, Mem::Workspace, "test.dh13");
    DeviceBuffer<floatX> d_permuted(offset + (size_t)R * H, Mem::Workspace, "test.permuted");
    DeviceBuffer<floatX> d_weighted(offset + (size_t)N * H, Mem::Workspace, "test.weighted");
    DeviceBuffer<floatX> d_plain(offset + (size_t)N * H, Mem::Workspace, "test.plain");
    DeviceBuffer<floatX> d_onto(offset + (size_t)N * H, Mem::Workspace, "test.onto");
    DeviceBuffer<floatX> d_sum(offset + (size_t)N * H, Mem::Workspace, "test.sum");
    DeviceBuffer<floatX> d_dy(offset + (size_t)R * H, Mem::Workspace, "test.dy");
    DeviceBuffer<float> d_dtopk_w(R, Mem::Workspace, "test.dtopk_w");
    for (auto* b : {&d_permuted, &d_weighted, &d_plain, &d_onto, &d_a, &d_dh13, &d_sum, &d_dy})
      testutil::poison(b->ptr, b->count);
    testutil::poison(d_dtopk_w.ptr, R);
    auto d_sum32 = placed(0.f, acc0, "test.sum32");  // fp32 += floatX in place, as the fold of the gradients
    moe_permute_rows(d_permuted.ptr + offset, d_x.ptr + offset, d_route_of_slot.ptr, R, H, k, 0);
    moe_combine(d_weighted.ptr + offset, d_rows.ptr + offset, d_slot_of_route.ptr, d_w.ptr, N, H, k, 0);
    moe_combine(d_plain.ptr + offset, d_rows.ptr + offset, d_slot_of_route.ptr, nullptr, N, H, k, 0);
    moe_combine(d_onto.ptr + offset, d_rows.ptr + offset, d_slot_of_route.ptr, d_w.ptr, N, H, k, 0, d_x.ptr + offset);
    moe_combine_window_add(d_acc.ptr + offset, d_rows.ptr + offset + (size_t)first * H, d_slot_of_route.ptr, d_w.ptr,
                           first, count, N, H, k, 0);
    swiglu_forward(d_a.ptr + offset, d_h13.ptr + offset, R, I, 0);
    swiglu_backward(d_dh13.ptr + offset, d_da.ptr + offset, d_h13.ptr + offset, R, I, 0);
    swiglu_backward(d_h13_in_place.ptr + offset, d_da_in_place.ptr + offset, d_h13_in_place.ptr + offset, R, I, 0,
                    d_da_in_place.ptr + offset);  // dh13 over h13, a over da
    add_inplace_or_out(d_sum.ptr + offset, d_x.ptr + offset, d_rows.ptr + offset, (size_t)N * H, 0);
    add_inplace_or_out(d_sum32.ptr + offset, d_sum32.ptr + offset, d_x.ptr + offset, (size_t)N * H, 0);
    // dout = x, the expert outputs y = rows
    moe_combine_backward(d_dy.ptr + offset, d_dtopk_w.ptr, d_x.ptr + offset, d_rows.ptr + offset, d_slot_of_route.ptr,
                         d_w.ptr, N, H, k, 0);
    Outputs o;
    o.permuted = testutil::download_vec(d_permuted.ptr + offset, (size_t)R * H);
    o.weighted = testutil::download_vec(d_weighted.ptr + offset, (size_t)N * H);
    o.plain = testutil::download_vec(d_plain.ptr + offset, (size_t)N * H);
    o.onto = testutil::download_vec(d_onto.ptr + offset, (size_t)N * H);
    o.window = testutil::download_vec(d_acc.ptr + offset, (size_t)N * H);
    o.a = testutil::download_vec(d_a.ptr + offset, (size_t)R * I);
    o.dh13 = testutil::download_vec(d_dh13.ptr + offset, (size_t)R * 2 * I);
    o.a_in_place = testutil::download_vec(d_da_in_place.ptr + offset, (size_t)R * I);
    o.dh13_in_place = testutil::download_vec(d_h13_in_place.ptr + offset, (size_t)R * 2 * I);
    o.sum = testutil::download_vec(d_sum.ptr + offset, (size_t)N * H);
    o.sum32 = testutil::download_vec(d_sum32.ptr + offset, (size_t)N * H);
    o.dy = testutil::download_vec(d_dy.ptr + offset, (size_t)R * H);
    o.dtopk_w = testutil::download_vec(d_dtopk_w.ptr, R);
    return o;
  };
  const Outputs pieces = run(0), elements = run(1);

  auto same_bits = [](const auto& a, const auto& b) {
    return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
  };
  EXPECT_TRUE(same_bits(pieces.permuted, elements.permuted));
  EXPECT_TRUE(same_bits(pieces.weighted, elements.weighted));
  EXPECT_TRUE(same_bits(pieces.plain, elements.plain));
  EXPECT_TRUE(same_bits(pieces.onto, elements.onto));
  EXPECT_TRUE(same_bits(pieces.window, elements.window));
  EXPECT_TRUE(same_bits(pieces.a, elements.a));
  EXPECT_TRUE(same_bits(pieces.dh13, elements.dh13));
  // SwiGLU's backward in place (moe_backward's H13::Overwrite): swiglu_forward's a and the same dh13
  for (const Outputs* o : {&pieces, &elements}) {
    EXPECT_TRUE(same_bits(o->a_in_place, o->a)) << "a from swiglu_backward";
    EXPECT_TRUE(same_bits(o->dh13_in_place, o->dh13)) << "dh13 over h13";
  }
  EXPECT_TRUE(same_bits(pieces.sum, elements.sum));
  EXPECT_TRUE(same_bits(pieces.sum32, elements.sum32));
  EXPECT_TRUE(same_bits(pieces.dy, elements.dy));
  // the adds are one fp32 addition rounded once: exactly what the host computes
  int add_wrong = 0;
  for (int i = 0; i < N * H; i++) {
    const float x_i = (float)x.data()[i], row_i = (float)rows.data()[i];
    add_wrong += to_float(pieces.sum[i]) != to_float(from_float<floatX>(x_i + row_i));
    add_wrong += pieces.sum32[i] != (float)acc0.data()[i] + x_i;
  }
  EXPECT_EQ(add_wrong, 0);

  Mat permuted_want(R, H), weighted_want = Mat::Zero(N, H), plain_want = Mat::Zero(N, H), window_want = acc0;
  for (int s = 0; s < R; s++) permuted_want.row(s) = x.row(route_of_slot[s] / k);
  for (int r = 0; r < R; r++) {
    const int n = r / k, s = slot_of_route[r];
    weighted_want.row(n) += topk_w(n, r % k) * rows.row(s);
    plain_want.row(n) += rows.row(s);
    if (s >= first && s < first + count) window_want.row(n) += topk_w(n, r % k) * rows.row(s);
  }
  Mat dy_want(R, H), dtopk_w_want(N, k);
  for (int r = 0; r < R; r++) {
    const int n = r / k, s = slot_of_route[r];
    dy_want.row(s) = topk_w(n, r % k) * x.row(n);
    dtopk_w_want(n, r % k) = x.row(n).dot(rows.row(s));
  }
  Mat a_want(R, I), dh13_want(R, 2 * I);
  for (int r = 0; r < R; r++)
    for (int c = 0; c < I; c++) {
      const double g = h13(r, c), u = h13(r, I + c), sig = 1 / (1 + std::exp(-g));
      a_want(r, c) = g * sig * u;
      dh13_want(r, c) = da(r, c) * u * sig * (1 + g * (1 - sig));
      dh13_want(r, I + c) = da(r, c) * g * sig;
    }
  auto as_mat = [](const auto& v, int r, int c) {
    Mat m(r, c);
    for (Eigen::Index i = 0; i < m.size(); i++) m.data()[i] = to_float(v[i]);
    return m;
  };
  EXPECT_EQ(as_mat(pieces.permuted, R, H), permuted_want);  // a copy: exact
  EXPECT_REL("row kernels", "combine weighted", testutil::rel_err(as_mat(pieces.weighted, N, H), weighted_want), OP_TOL);
  EXPECT_REL("row kernels", "combine plain", testutil::rel_err(as_mat(pieces.plain, N, H), plain_want), OP_TOL);
  const Mat onto_want = x + weighted_want;
  EXPECT_REL("row kernels", "combine onto x", testutil::rel_err(as_mat(pieces.onto, N, H), onto_want), OP_TOL);
  EXPECT_REL("row kernels", "combine window (+=, fp32)", testutil::rel_err(as_mat(pieces.window, N, H), window_want), OP_TOL);
  EXPECT_REL("row kernels", "swiglu forward", testutil::rel_err(as_mat(pieces.a, R, I), a_want), OP_TOL);
  EXPECT_REL("row kernels", "swiglu backward", testutil::rel_err(as_mat(pieces.dh13, R, 2 * I), dh13_want), OP_TOL);
  EXPECT_REL("row kernels", "combine bwd dy", testutil::rel_err(as_mat(pieces.dy, R, H), dy_want), OP_TOL);
  EXPECT_REL("row kernels", "combine bwd dtopk_w, pieces", testutil::rel_err(as_mat(pieces.dtopk_w, N, k), dtopk_w_want), OP_TOL);
  EXPECT_REL("row kernels", "combine bwd dtopk_w, elements", testutil::rel_err(as_mat(elements.dtopk_w, N, k), dtopk_w_want), OP_TOL);
}

// ---------------------------------------------------------------------------------------------
// --moe local with a token budget c (ops/moe.cuh's LocalDispatcher): the layer in K = ⌈N/c⌉ chunks of
// consecutive tokens, nothing kept from the forward, each chunk recomputed in the backward. Against the
// reference and against the unchunked dispatcher (c = 0) on the same inputs: out, dx and dtopk_w are
// computed row by row as unchunked, but by expert GEMMs cut into other problems, whose kernel may differ
// (cuBLAS's choice in the FP32 build, the tile shape in the BF16 build's): within the operator
// tolerance, the count of elements whose bits differ printed; dW13 and dW2 sum the chunks one after the
// other (K roundings of the += in the BF16 build): within the operator tolerance of the reference.
namespace {

// What one forward + backward through LocalDispatcher gave (the bits of each output), and the pool's
// bytes above what was live before it: after forward (saved), at the forward's and the backward's peaks,
// and after backward with the saved state still alive (saved + held).
struct LocalRun {
  std::vector<floatX> out, dx, dW13, dW2;
  std::vector<float> dtopk_w;
  size_t saved = 0, forward_peak = 0, backward_peak = 0, after_backward = 0;
  DispatchBound bound;  // the dispatcher's live_bound(N)
};

// LocalDispatcher(H, I, E, k, token_budget) on case c, on a non-default stream, with poisoned outputs
// and weight gradients starting at dW*_init. recomputation: forward with out = nullptr (a layer under
// --recompute), out left poisoned. weight_grads: the layer's weight-gradient stream (on), joined after
// the backward. Checks that the pool returns to its starting bytes.
LocalRun run_local(const MoECase& c, int token_budget, bool recomputation = false, bool weight_grads = false) {
  const int N = c.N, H = c.H, I = c.I, E = c.E, k = c.k;
  auto d_x = testutil::upload<floatX>(c.x);
  auto d_dout = testutil::upload<floatX>(c.dout);
  auto d_idx = testutil::upload_vec(flat(c.topk_idx));
  auto d_w = testutil::upload<float>(c.topk_w);
  auto d_W13 = testutil::upload<floatX>(stack(c.W13));
  auto d_W2 = testutil::upload<floatX>(stack(c.W2));
  auto d_dW13 = testutil::upload<floatX>(stack(c.dW13_init));
  auto d_dW2 = testutil::upload<floatX>(stack(c.dW2_init));
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Workspace, "test.out");
  DeviceBuffer<floatX> d_dx((size_t)N * H, Mem::Workspace, "test.dx");
  DeviceBuffer<float> d_dtopk_w((size_t)N * k, Mem::Workspace, "test.dtopk_w");
  testutil::poison(d_out.ptr, d_out.count);
  testutil::poison(d_dx.ptr, d_dx.count);
  testutil::poison(d_dtopk_w.ptr, d_dtopk_w.count);
  SideStream side;
  side.set_on(weight_grads);  // its lanes' cuBLAS workspaces before the measurement
  cudaStream_t stream;
  cudaCheck(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "test", "stream");
  cudaCheck(cudaDeviceSynchronize(), "test", "setup");

  LocalDispatcher local(H, I, E, k, token_budget);
  if (weight_grads) local.weight_grads = &side;
  LocalRun r;
  r.bound = local.live_bound(N);
  const size_t live_start = pool().live_total();
  pool().reset_peak();
  std::unique_ptr<DispatchSaved> saved =
      local.forward(recomputation ? nullptr : d_out.ptr, d_x.ptr, d_idx.ptr, d_w.ptr, d_W13.ptr, d_W2.ptr, N, stream);
  r.saved = pool().live_total() - live_start;
  r.forward_peak = pool().peak() - live_start;
  pool().reset_peak();
  local.backward(d_dx.ptr, d_dtopk_w.ptr, d_dW13.ptr, d_dW2.ptr, d_dout.ptr, *saved, d_x.ptr, d_idx.ptr, d_w.ptr,
                 d_W13.ptr, d_W2.ptr, stream);
  r.backward_peak = pool().peak() - live_start;
  r.after_backward = pool().live_total() - live_start;
  side.join(stream, "test.local");
  saved.reset();
  EXPECT_EQ(pool().live_total(), live_start) << "LocalDispatcher c=" << token_budget << " leaked pool bytes";
  r.out = testutil::download_vec(d_out.ptr, d_out.count);
  r.dx = testutil::download_vec(d_dx.ptr, d_dx.count);
  r.dtopk_w = testutil::download_vec(d_dtopk_w.ptr, d_dtopk_w.count);
  r.dW13 = testutil::download_vec(d_dW13.ptr, (size_t)E * 2 * I * H);
  r.dW2 = testutil::download_vec(d_dW2.ptr, (size_t)E * H * I);
  cudaCheck(cudaStreamDestroy(stream), "test", "stream");
  return r;
}

template <typename T>
bool same_bits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <typename T>
long long bits_that_differ(const std::vector<T>& a, const std::vector<T>& b) {
  long long n = 0;
  for (size_t i = 0; i < a.size(); i++) n += std::memcmp(&a[i], &b[i], sizeof(T)) != 0;
  return n;
}

template <typename T>
Mat as_mat(const std::vector<T>& v, Eigen::Index rows, Eigen::Index cols) {
  Mat m(rows, cols);
  for (Eigen::Index i = 0; i < m.size(); i++) m.data()[i] = to_float(v[i]);
  return m;
}

// The chunked layer (budget c < N) against the reference and the unchunked layer, and its live set:
// nothing saved, the forward's and the backward's peaks within live_bound(N) — one chunk's
// moe_live_bound — which is below the unchunked bound.
void check_chunked(const char* name, const MoECase& c, int token_budget) {
  ASSERT_GT(token_budget, 0);
  ASSERT_LT(token_budget, c.N);
  const Mat out_ref = ref::moe_forward(c.x, c.topk_idx, c.topk_w, c.W13, c.W2);
  const auto g = ref::moe_backward(c.dout, c.x, c.topk_idx, c.topk_w, c.W13, c.W2);
  const LocalRun whole = run_local(c, 0), chunked = run_local(c, token_budget);
  const int N = c.N, H = c.H, I = c.I, E = c.E, k = c.k;
  EXPECT_REL(name, "out", testutil::rel_err(as_mat(chunked.out, N, H), out_ref), OP_TOL);
  EXPECT_REL(name, "dx", testutil::rel_err(as_mat(chunked.dx, N, H), g.dx), OP_TOL);
  EXPECT_REL(name, "dtopk_w", testutil::rel_err(as_mat(chunked.dtopk_w, N, k), g.dtopk_w), OP_TOL);
  EXPECT_REL(name, "dW13 (+=)", testutil::rel_err(as_mat(chunked.dW13, E * 2 * I, H), Mat(stack(c.dW13_init) + stack(g.dW13))), OP_TOL);
  EXPECT_REL(name, "dW2 (+=)", testutil::rel_err(as_mat(chunked.dW2, E * H, I), Mat(stack(c.dW2_init) + stack(g.dW2))), OP_TOL);
  EXPECT_REL(name, "out against unchunked", testutil::rel_err(as_mat(chunked.out, N, H), as_mat(whole.out, N, H)), OP_TOL);
  EXPECT_REL(name, "dx against unchunked", testutil::rel_err(as_mat(chunked.dx, N, H), as_mat(whole.dx, N, H)), OP_TOL);
  printf("[bits] %s: out %lld of %zu, dx %lld of %zu, dtopk_w %lld of %zu elements differ from the unchunked layer's\n",
         name, bits_that_differ(chunked.out, whole.out), whole.out.size(), bits_that_differ(chunked.dx, whole.dx),
         whole.dx.size(), bits_that_differ(chunked.dtopk_w, whole.dtopk_w), whole.dtopk_w.size());

  const TokenChunks chunks = token_chunks(N, token_budget);
  const DispatchBound chunk = moe_live_bound(chunks.size, H, I, E, k, sizeof(floatX));
  EXPECT_EQ(chunked.bound.saved, 0u);
  EXPECT_EQ(chunked.bound.peak, chunk.peak) << "one chunk's moe_live_bound";
  EXPECT_EQ(chunked.bound.held, 0u);
  EXPECT_EQ(chunked.saved, 0u) << "nothing kept from the forward";
  EXPECT_LE(chunked.forward_peak, chunked.bound.peak);
  EXPECT_LE(chunked.backward_peak, chunked.bound.peak);
  EXPECT_EQ(chunked.after_backward, 0u) << "nothing held after the backward";
  EXPECT_LT(chunked.bound.peak, whole.bound.peak);
  EXPECT_EQ(whole.saved, whole.bound.saved);
  EXPECT_LE(whole.backward_peak, whole.bound.peak);
  printf("[mem] %s: K=%d chunks of %d tokens: peak fwd %.1f / bwd %.1f KiB <= bound %.1f KiB; unchunked saved %.1f, "
         "peak %.1f KiB <= bound %.1f KiB\n",
         name, chunks.count, chunks.size, chunked.forward_peak / 1024.0, chunked.backward_peak / 1024.0,
         chunked.bound.peak / 1024.0, whole.saved / 1024.0, whole.backward_peak / 1024.0, whole.bound.peak / 1024.0);
}

}  // namespace

// N = 300 in chunks of at most 64 (K = 5 chunks of 60: N not a multiple of c), skewed onto expert 0.
TEST(LocalTokenBudget, ChunksMatchTheReferenceAndTheUnchunkedLayer) {
  REQUIRE_GPU();
  Rng rng;
  const MoECase c = make_case(rng, 300, 128, 96, 8, 3, skewed_routes({1, 2, 3, 4, 5}, 3));  // experts 6, 7 get nothing
  check_chunked("local c=64 N=300 E=8 k=3 skewed", c, 64);
}

// c = 1: every token a chunk of its own (K = N = 13), most experts without a route in each.
TEST(LocalTokenBudget, OneTokenAChunk) {
  REQUIRE_GPU();
  Rng rng;
  const MoECase c = make_case(rng, 13, 72, 40, 5, 2, uniform_routes({0, 1, 2, 3, 4}, 2));
  check_chunked("local c=1 N=13 E=5 k=2", c, 1);
}

// Hot routing: every route to one expert (k = 1), the others idle in every chunk.
TEST(LocalTokenBudget, EveryRouteToOneExpert) {
  REQUIRE_GPU();
  Rng rng;
  const MoECase c = make_case(rng, 200, 64, 48, 4, 1, uniform_routes({2}, 1));
  check_chunked("local c=48 N=200 E=4 k=1 hot", c, 48);
}

// A budget of at least N tokens is the unchunked layer: the same bits, the same saved state and bound.
TEST(LocalTokenBudget, AtLeastNTokensIsTheUnchunkedLayer) {
  REQUIRE_GPU();
  Rng rng;
  const MoECase c = make_case(rng, 211, 64, 48, 6, 2, skewed_routes({1, 2, 3, 4, 5}, 2));
  const LocalRun whole = run_local(c, 0);
  for (int budget : {211, 268}) {
    const LocalRun r = run_local(c, budget);
    EXPECT_TRUE(same_bits(r.out, whole.out)) << budget;
    EXPECT_TRUE(same_bits(r.dx, whole.dx)) << budget;
    EXPECT_TRUE(same_bits(r.dtopk_w, whole.dtopk_w)) << budget;
    EXPECT_TRUE(same_bits(r.dW13, whole.dW13)) << budget;
    EXPECT_TRUE(same_bits(r.dW2, whole.dW2)) << budget;
    EXPECT_EQ(r.saved, whole.saved) << budget;
    EXPECT_EQ(r.bound.saved, whole.bound.saved) << budget;
    EXPECT_EQ(r.bound.peak, whole.bound.peak) << budget;
  }
}

// A layer under --recompute calls forward with out = nullptr: in chunks it allocates nothing, and the
// backward, which recomputes every chunk anyway, gives the bits of a backward after a forward with out.
TEST(LocalTokenBudget, ARecomputationHoldsNothingAndBackwardGivesTheSameBits) {
  REQUIRE_GPU();
  Rng rng;
  const MoECase c = make_case(rng, 150, 64, 48, 6, 2, uniform_routes({0, 1, 2, 3, 4, 5}, 2));
  const LocalRun with_out = run_local(c, 32), recomputed = run_local(c, 32, /*recomputation=*/true);
  EXPECT_EQ(recomputed.saved, 0u);
  EXPECT_EQ(recomputed.forward_peak, 0u) << "forward with out = nullptr allocates nothing";
  EXPECT_TRUE(same_bits(recomputed.dx, with_out.dx));
  EXPECT_TRUE(same_bits(recomputed.dtopk_w, with_out.dtopk_w));
  EXPECT_TRUE(same_bits(recomputed.dW13, with_out.dW13));
  EXPECT_TRUE(same_bits(recomputed.dW2, with_out.dW2));
}

// With the layer's weight-gradient stream on, the chunked backward computes its weight gradients on the
// compute stream: nothing is held after it returns (live_bound's held = 0), and the bits are the same.
TEST(LocalTokenBudget, HoldsNothingForTheWeightGradientStream) {
  REQUIRE_GPU();
  Rng rng;
  const MoECase c = make_case(rng, 150, 64, 48, 6, 2, uniform_routes({0, 1, 2, 3, 4, 5}, 2));
  const LocalRun alone = run_local(c, 40), beside = run_local(c, 40, false, /*weight_grads=*/true);
  EXPECT_EQ(beside.after_backward, 0u);
  EXPECT_EQ(beside.bound.held, 0u);
  EXPECT_TRUE(same_bits(beside.dx, alone.dx));
  EXPECT_TRUE(same_bits(beside.dW13, alone.dW13));
  EXPECT_TRUE(same_bits(beside.dW2, alone.dW2));
}

// forward_residual in chunks (the model's x_out = x_mid + FFN(ln2)): each chunk's combine adds its
// rows of the residual, into a separate buffer or in place (the same bits), within the operator
// tolerance of residual + the reference.
TEST(LocalTokenBudget, ForwardOntoAResidualInChunks) {
  REQUIRE_GPU();
  Rng rng;
  const MoECase c = make_case(rng, 101, 72, 40, 5, 2, uniform_routes({0, 1, 2, 3, 4}, 2));
  const int N = c.N, H = c.H;
  const Mat out_ref = ref::moe_forward(c.x, c.topk_idx, c.topk_w, c.W13, c.W2);
  const Mat residual = testutil::round_to_floatX(rng.mat<double>(N, H, out_ref.norm() / std::sqrt((double)out_ref.size())));
  auto d_x = testutil::upload<floatX>(c.x);
  auto d_idx = testutil::upload_vec(flat(c.topk_idx));
  auto d_w = testutil::upload<float>(c.topk_w);
  auto d_W13 = testutil::upload<floatX>(stack(c.W13));
  auto d_W2 = testutil::upload<floatX>(stack(c.W2));
  auto d_residual = testutil::upload<floatX>(residual);
  auto d_in_place = testutil::upload<floatX>(residual);
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Workspace, "test.out");
  testutil::poison(d_out.ptr, d_out.count);
  LocalDispatcher local(H, c.I, c.E, c.k, 16);  // K = 7 chunks of 15 tokens, the last 11
  local.forward_residual(d_out.ptr, d_residual.ptr, d_x.ptr, d_idx.ptr, d_w.ptr, d_W13.ptr, d_W2.ptr, N, 0);
  local.forward_residual(d_in_place.ptr, d_in_place.ptr, d_x.ptr, d_idx.ptr, d_w.ptr, d_W13.ptr, d_W2.ptr, N, 0);
  const std::vector<floatX> out = testutil::download_vec(d_out.ptr, d_out.count);
  EXPECT_EQ(testutil::download(d_residual.ptr, N, H), residual) << "the residual is read, not written";
  EXPECT_TRUE(same_bits(testutil::download_vec(d_in_place.ptr, d_in_place.count), out)) << "in place: the same bits";
  EXPECT_REL("local c=16 onto a residual", "out", testutil::rel_err(as_mat(out, N, H), Mat(residual + out_ref)), OP_TOL);
}

// The chunks (host arithmetic; runs without a GPU): K = ⌈N/c⌉ chunks of ⌈N/K⌉ ≤ c consecutive tokens,
// none empty, covering [0, N); one chunk of N for c = 0 or c ≥ N. A negative budget is refused.
TEST(LocalTokenBudgetHost, ChunksAreAtMostCConsecutiveTokensNoneEmpty) {
  for (int N = 1; N <= 130; N++)
    for (int c = 0; c <= 140; c++) {
      const TokenChunks chunks = token_chunks(N, c);
      if (c == 0 || c >= N) {
        EXPECT_EQ(chunks.count, 1) << N << " " << c;
        EXPECT_EQ(chunks.size, N) << N << " " << c;
        continue;
      }
      EXPECT_EQ(chunks.count, (N + c - 1) / c) << N << " " << c;
      EXPECT_LE(chunks.size, c) << N << " " << c;
      const int last = N - (chunks.count - 1) * chunks.size;
      EXPECT_GE(last, 1) << N << " " << c << ": the last chunk is empty";
      EXPECT_LE(last, chunks.size) << N << " " << c;
    }
}

TEST(LocalTokenBudgetDeathTest, ANegativeBudgetIsRefused) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(LocalDispatcher(64, 48, 4, 2, -1), "LocalDispatcher \\(c=-1\\): the token budget must be >= 0");
  EXPECT_DEATH(token_chunks(10, -3), "token_chunks \\(N=10 c=-3\\): need N >= 0 and a token budget >= 0");
}
