// GPU tests of ops/grouped_gemm.cuh: every problem of a grouped call against the double-precision
// product of the same (floatX) inputs, per problem, within the per-operator tolerance; the four
// storage forms of A and B the kernel reads; beta 1 (the weight gradients' +=); problems whose sizes
// are multiples of no tile (M, N, K past the 128 × 128 × 64 tiles, M = 1, K = 1); more problems than
// one launch takes; more tiles than the GPU has SMs; bytes of C outside the problems untouched; a
// replay bit-identical (memcmp). In the BF16 build the shapes here take flatmoe's tensor-core kernel
// (asserted), except one that its requirements send to cuBLAS; in the wgmma form every check runs
// through grouped_gemm and in each tile shape forced (narrow 128 × 128, wide 128 × 256 fed by every
// thread's copies, and fed by the TMA where the problems are laid out for it: the same bits as the
// thread-fed wide tiles, memcmp). In the FP32 build every call is cuBLAS's. On the host (runs in CI):
// which calls grouped_gemm gives to which implementation, which tile shape and feed, and where the
// TMA form finds its two tensors.
#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <string>
#include <vector>
#include "gpu_util.cuh"
#include "../ops/grouped_gemm.cuh"

using namespace testutil;

namespace {

// The ways a test runs a grouped call: grouped_gemm as the layers call it, and in the wgmma build, when
// the kernel takes the call, each tile shape forced (ops/grouped_gemm.cuh, grouped_gemm_tiles): narrow
// 128 × 128, wide 128 × 256 fed by every thread's copies, and wide fed by the TMA when the problems are
// laid out as its two tensors (`tma`).
struct Way {
  const char* name;
  std::function<void(const GroupedGemmProblems&, bool transA, bool transB, int lda, int ldb, int ldc, float beta)> run;
};
std::vector<Way> ways_to_run(const char* op, bool kernel_expected, bool tma) {
  std::vector<Way> ways = {{"grouped_gemm", [op](const GroupedGemmProblems& p, bool ta, bool tb, int lda, int ldb, int ldc,
                                                 float beta) { grouped_gemm(op, p, ta, tb, lda, ldb, ldc, beta, 0); }}};
  std::vector<std::pair<GroupedGemmTiles, const char*>> forced = {{GroupedGemmTiles::Narrow, "narrow tiles"},
                                                                  {GroupedGemmTiles::Wide, "wide tiles"}};
  if (tma) forced.push_back({GroupedGemmTiles::WideTma, "wide tiles, TMA"});
  if (BUILD_WGMMA && kernel_expected)
    for (auto [tiles, name] : forced)
      ways.push_back({name, [op, tiles = tiles](const GroupedGemmProblems& p, bool ta, bool tb, int lda, int ldb, int ldc,
                                                float beta) { grouped_gemm_mma(op, p, ta, tb, lda, ldb, ldc, beta, tiles, 0); }});
  return ways;
}

// true when the problems are laid out as the TMA form's two tensors (grouped_gemm_tma_layout)
bool tma_layout(const GroupedGemmProblems& problems, bool transA, bool transB, int lda, int ldb) {
  GroupedGemmTmaLayout layout;
  return grouped_gemm_tma_layout(problems, transA, transB, lda, ldb, layout);
}

// Problems as the MoE layer stacks them: each operand's per-problem matrices one after another in
// one buffer, all with the same row width. Stored shapes (rows × width): A [M,K], or [K,M] with
// transA; B [K,N], or [N,K] with transB; C [M,N]. `sizes` gives each problem's (M, N, K). So laid
// out, problems of one N and K without transA are the TMA form's two tensors; `reversed` lists them
// last to first, which they are not.
struct Case {
  const char* name;
  bool transA, transB;
  float beta;
  std::vector<std::array<int, 3>> sizes;
  bool kernel_expected;  // BF16 build: the tensor-core kernel takes it
  bool reversed = false;
};

void check_grouped_gemm(const Case& c) {
  REQUIRE_GPU();
  Rng rng;
  const int G = (int)c.sizes.size();
  // stored shapes of problem g's operands
  auto a_shape = [&](int g) { auto [M, N, K] = c.sizes[g]; (void)N; return c.transA ? std::array<int, 2>{K, M} : std::array<int, 2>{M, K}; };
  auto b_shape = [&](int g) { auto [M, N, K] = c.sizes[g]; (void)M; return c.transB ? std::array<int, 2>{N, K} : std::array<int, 2>{K, N}; };
  std::vector<ref::Mat<double>> A(G), B(G), C0(G);
  size_t a_count = 0, b_count = 0, c_count = 0;
  std::vector<size_t> a_off(G), b_off(G), c_off(G);
  for (int g = 0; g < G; g++) {
    auto [M, N, K] = c.sizes[g];
    A[g] = round_to_floatX(rng.mat<double>(a_shape(g)[0], a_shape(g)[1]));
    B[g] = round_to_floatX(rng.mat<double>(b_shape(g)[0], b_shape(g)[1]));
    C0[g] = round_to_floatX(rng.mat<double>(M, N));
    a_off[g] = a_count, b_off[g] = b_count, c_off[g] = c_count;
    a_count += A[g].size(), b_count += B[g].size(), c_count += (size_t)M * N;
  }
  const int lda = a_shape(0)[1], ldb = b_shape(0)[1], ldc = c.sizes[0][1];
  const size_t guard = 64;  // floatX elements after the last C: must stay as they are
  std::vector<floatX> a_host(a_count), b_host(b_count), c_host(c_count + guard);
  for (int g = 0; g < G; g++) {
    for (Eigen::Index i = 0; i < A[g].size(); i++) a_host[a_off[g] + i] = from_float<floatX>((float)A[g].data()[i]);
    for (Eigen::Index i = 0; i < B[g].size(); i++) b_host[b_off[g] + i] = from_float<floatX>((float)B[g].data()[i]);
    for (Eigen::Index i = 0; i < C0[g].size(); i++) c_host[c_off[g] + i] = from_float<floatX>((float)C0[g].data()[i]);
  }
  for (size_t i = c_count; i < c_host.size(); i++) c_host[i] = from_float<floatX>(1000.f + (float)i);
  DeviceBuffer<floatX> d_A = upload_vec(a_host, Mem::Activations, "test.A");
  DeviceBuffer<floatX> d_B = upload_vec(b_host, Mem::Weights, "test.B");
  DeviceBuffer<floatX> d_C = upload_vec(c_host, Mem::Activations, "test.C");
  std::vector<GroupedGemmProblem> problems;
  for (int g = 0; g < G; g++)
    problems.push_back({d_A.ptr + a_off[g], d_B.ptr + b_off[g], d_C.ptr + c_off[g], c.sizes[g][0], c.sizes[g][1], c.sizes[g][2]});
  if (c.reversed) std::reverse(problems.begin(), problems.end());
#if defined(FLATMOE_BF16)
  ASSERT_EQ(grouped_gemm_takes_kernel(problems, c.transA, c.transB, lda, ldb, ldc), c.kernel_expected) << c.name;
#endif
  bool same_widths = true;  // one N, and one K (one M with transA): the TMA form's tensors have one width each
  for (const auto& size : c.sizes)
    same_widths = same_widths && size[1] == c.sizes[0][1] && size[c.transA ? 0 : 2] == c.sizes[0][c.transA ? 0 : 2];
  const bool tma = tma_layout(problems, c.transA, c.transB, lda, ldb);
  EXPECT_EQ(tma, !(c.transA && c.transB) && !c.reversed && same_widths) << c.name << ": grouped_gemm_tma_layout";

  std::vector<floatX> wide_result;  // the wide tiles fed by every thread's copies
  for (const Way& way : ways_to_run(c.name, c.kernel_expected, tma)) {
    cudaCheck(cudaMemcpy(d_C.ptr, c_host.data(), c_host.size() * sizeof(floatX), cudaMemcpyHostToDevice), "test", "reset C");
    way.run(problems, c.transA, c.transB, lda, ldb, ldc, c.beta);
    const std::vector<floatX> first = download_vec(d_C.ptr, d_C.count);
    if (std::string(way.name) == "wide tiles") wide_result = first;
    if (std::string(way.name) == "wide tiles, TMA")  // the same tiles and k order, only fed otherwise
      EXPECT_EQ(memcmp(first.data(), wide_result.data(), first.size() * sizeof(floatX)), 0)
          << c.name << ": the TMA-fed wide tiles differ from the thread-fed ones";
    double worst = 0;
    for (int g = 0; g < G; g++) {
      auto [M, N, K] = c.sizes[g];
      const ref::Mat<double> opA = c.transA ? ref::Mat<double>(A[g].transpose()) : A[g];
      const ref::Mat<double> opB = c.transB ? ref::Mat<double>(B[g].transpose()) : B[g];
      const ref::Mat<double> expected = opA * opB + (double)c.beta * C0[g];
      ref::Mat<double> got(M, N);
      for (Eigen::Index i = 0; i < got.size(); i++) got.data()[i] = to_float(first[c_off[g] + i]);
      const double err = rel_err(got, expected);
      worst = std::max(worst, err);
      EXPECT_LE(err, OP_TOL) << c.name << " (" << way.name << ") problem " << g << " (M " << M << ", N " << N << ", K "
                             << K << ")";
    }
    printf("[err] %s (%s): %d problems, worst per-problem relative error %.3e (tol %.0e)\n", c.name, way.name, G, worst,
           OP_TOL);
    EXPECT_EQ(memcmp(first.data() + c_count, c_host.data() + c_count, guard * sizeof(floatX)), 0)
        << c.name << " (" << way.name << "): bytes after the last problem's C were written";

    // the same call from the same C again: the same bits
    cudaCheck(cudaMemcpy(d_C.ptr, c_host.data(), c_host.size() * sizeof(floatX), cudaMemcpyHostToDevice), "test", "reset C");
    way.run(problems, c.transA, c.transB, lda, ldb, ldc, c.beta);
    const std::vector<floatX> again = download_vec(d_C.ptr, d_C.count);
    EXPECT_EQ(memcmp(first.data(), again.data(), first.size() * sizeof(floatX)), 0)
        << c.name << " (" << way.name << "): replay differs";
  }
}

// n problems with M from 1 to `most` rows, the same N and K: the forward and input-gradient form.
std::vector<std::array<int, 3>> rows_vary(Rng& rng, int n, int most, int N, int K) {
  std::vector<std::array<int, 3>> s;
  for (int g = 0; g < n; g++) s.push_back({rng.integer(1, most), N, K});
  return s;
}


// Routed problems (ops/grouped_gemm.cuh): G experts' routes sorted by expert in one buffer, `counts`
// routes each (0 for some), the offsets only on the device. Without transA the routes are the rows of
// A [R,K] and C [R,N] and each expert has its B; with transA they are the rows of A [R,M] and B [R,N]
// and each expert has its C [M,N]. The routed call must give the same bits as grouped_gemm on the
// host's list of the same problems (experts without routes left out) over all of C and guard
// elements past it; an expert with routes gets a new C, one without keeps its C bit for bit.
void check_routed(const char* name, bool transA, bool transB, float beta, const std::vector<int>& counts, int fixed_rows,
                  int fixed_cols, bool kernel_expected) {
  REQUIRE_GPU();
  Rng rng;
  const int G = (int)counts.size();
  std::vector<int> offsets(G + 1, 0);
  for (int g = 0; g < G; g++) offsets[g + 1] = offsets[g] + counts[g];
  const int R = offsets[G];
  // without transA: fixed_rows = K, fixed_cols = N; with transA: fixed_rows = M, fixed_cols = N
  const int N = fixed_cols, K = fixed_rows, M = fixed_rows;
  const size_t a_count = (size_t)R * (transA ? M : K);
  const size_t b_count = transA ? (size_t)R * N : (size_t)G * K * N;
  const size_t c_count = transA ? (size_t)G * M * N : (size_t)R * N, guard = 64;
  auto random_floatX = [&](size_t n) {
    std::vector<floatX> v(n);
    for (floatX& e : v) e = from_float<floatX>((float)rng.uniform());
    return v;
  };
  const std::vector<floatX> c_start = random_floatX(c_count + guard);
  DeviceBuffer<floatX> d_A = upload_vec(random_floatX(a_count), Mem::Activations, "test.A");
  DeviceBuffer<floatX> d_B = upload_vec(random_floatX(b_count), Mem::Weights, "test.B");
  DeviceBuffer<floatX> d_C = upload_vec(c_start, Mem::Activations, "test.C");
  DeviceBuffer<int> d_offsets = upload_vec(offsets, Mem::Workspace, "test.offsets");
  const int lda = transA ? M : K, ldb = transB ? K : N, ldc = N;

  // expert g's problem at route row `first` with `rows` routes (the host form), or at row 0 with 0 (routed)
  auto problem = [&](int g, size_t first, int rows) {
    if (transA) return GroupedGemmProblem{d_A.ptr + first * lda, d_B.ptr + first * ldb, d_C.ptr + (size_t)g * M * N, M, N, rows};
    return GroupedGemmProblem{d_A.ptr + first * lda, d_B.ptr + (size_t)g * K * N, d_C.ptr + first * ldc, rows, N, K};
  };
  GroupedGemmProblems on_host, routed;
  for (int g = 0; g < G; g++) {
    if (counts[g] > 0) on_host.list.push_back(problem(g, (size_t)offsets[g], counts[g]));
    routed.list.push_back(problem(g, 0, 0));
  }
  routed.route_offsets = d_offsets.ptr;
  routed.routes = R;
#if defined(FLATMOE_BF16)
  ASSERT_EQ(grouped_gemm_takes_kernel(routed, transA, transB, lda, ldb, ldc), kernel_expected) << name;
#else
  (void)kernel_expected;
#endif

  const bool tma = tma_layout(routed, transA, transB, lda, ldb);
  EXPECT_EQ(tma, !(transA && transB)) << name << ": grouped_gemm_tma_layout (routed)";
  EXPECT_EQ(tma_layout(on_host, transA, transB, lda, ldb), !(transA && transB))
      << name << ": grouped_gemm_tma_layout (host's list)";
  for (const Way& way : ways_to_run(name, kernel_expected, tma)) {
    cudaCheck(cudaMemcpy(d_C.ptr, c_start.data(), c_start.size() * sizeof(floatX), cudaMemcpyHostToDevice), "test", "reset C");
    way.run(on_host, transA, transB, lda, ldb, ldc, beta);
    const std::vector<floatX> host_result = download_vec(d_C.ptr, d_C.count);
    cudaCheck(cudaMemcpy(d_C.ptr, c_start.data(), c_start.size() * sizeof(floatX), cudaMemcpyHostToDevice), "test", "reset C");
    way.run(routed, transA, transB, lda, ldb, ldc, beta);
    const std::vector<floatX> routed_result = download_vec(d_C.ptr, d_C.count);
    EXPECT_EQ(memcmp(host_result.data(), routed_result.data(), host_result.size() * sizeof(floatX)), 0)
        << name << " (" << way.name << "): the routed call differs from the host's list";
    int changed = 0, kept = 0;  // experts with routes whose C changed; experts without whose C did not
    for (int g = 0; g < G; g++) {
      const size_t first = transA ? (size_t)g * M * N : (size_t)offsets[g] * N;
      const size_t size = transA ? (size_t)M * N : (size_t)counts[g] * N;
      const bool same = memcmp(routed_result.data() + first, c_start.data() + first, size * sizeof(floatX)) == 0;
      if (counts[g] > 0) changed += !same;
      else kept += same;
    }
    const int empty = (int)std::count(counts.begin(), counts.end(), 0);
    EXPECT_EQ(changed, G - empty) << name << " (" << way.name << ")";
    if (transA) EXPECT_EQ(kept, empty) << name << " (" << way.name << "): an expert without routes had its C written";
    printf("[routed] %s (%s): %d experts (%d without routes), %d routes: same bits as the host's list\n", name, way.name, G,
           empty, R);
  }
}

// `experts` route counts from 1 to `most`, with `empty` of them (spread out) set to 0.
std::vector<int> routes_per_expert(Rng& rng, int experts, int most, int empty) {
  std::vector<int> counts(experts);
  for (int& c : counts) c = rng.integer(1, most);
  for (int i = 0; i < empty; i++) counts[(size_t)i * experts / empty] = 0;
  return counts;
}
}  // namespace

// h13 = xp W13ᵀ, y = a W2ᵀ: A [M,K], B [N,K]. N = 272 and K = 200 end inside a tile; M = 1, 129, 300.
TEST(GroupedGemmGpu, ForwardFormRowsPerExpertUneven) {
  check_grouped_gemm({"GroupedGemmGpu.NT", false, true, 0.f, {{1, 272, 200}, {37, 272, 200}, {129, 272, 200}, {300, 272, 200}, {8, 272, 200}}, true});
}

// da = dy W2, dxp = dh13 W13: A [M,K], B [K,N].
TEST(GroupedGemmGpu, InputGradientFormRowsPerExpertUneven) {
  check_grouped_gemm({"GroupedGemmGpu.NN", false, false, 0.f, {{130, 264, 136}, {1, 264, 136}, {257, 264, 136}, {64, 264, 136}}, true});
}

// dW2 += dyᵀ a, dW13 += dh13ᵀ xp: A [K,M], B [K,N], K = the expert's routes (1, odd, past a k-tile), beta 1.
TEST(GroupedGemmGpu, WeightGradientFormAccumulatesOverUnevenRoutes) {
  check_grouped_gemm({"GroupedGemmGpu.TN+=", true, false, 1.f, {{200, 136, 1}, {200, 136, 33}, {200, 136, 300}, {200, 136, 7}, {200, 136, 64}}, true});
}

// Both operands transposed: A [K,M], B [N,K] (no MoE GEMM uses it; the kernel takes it). The row
// widths M, K and N are shared by the problems, so they have one size.
TEST(GroupedGemmGpu, BothTransposed) {
  check_grouped_gemm({"GroupedGemmGpu.TT", true, true, 0.f, {{136, 72, 40}, {136, 72, 40}, {136, 72, 40}}, true});
}

// More problems than one launch takes (GGEMM_PROBLEMS_PER_LAUNCH = 64): two launches.
TEST(GroupedGemmGpu, MoreProblemsThanOneLaunchTakes) {
  Rng rng;
  check_grouped_gemm({"GroupedGemmGpu.NT.70", false, true, 0.f, rows_vary(rng, 70, 40, 136, 72), true});
}

// The forward form adding into C (beta 1): the TMA form's stores of 16 bytes read C too.
TEST(GroupedGemmGpu, ForwardFormAddsIntoC) {
  check_grouped_gemm({"GroupedGemmGpu.NT+=", false, true, 1.f, {{37, 264, 200}, {129, 264, 200}, {300, 264, 200}}, true});
}

// The forward form's problems not one after another (listed last to first): the wide tiles fed by
// every thread's copies, not by the TMA.
TEST(GroupedGemmGpu, ForwardFormProblemsOutOfOrder) {
  check_grouped_gemm({"GroupedGemmGpu.NT.reversed", false, true, 0.f, {{1, 272, 200}, {37, 272, 200}, {129, 272, 200}, {300, 272, 200}, {8, 272, 200}}, true, true});
}

// More tiles than the GPU has SMs (H200: 132) in wide tiles (128 × 256): a wide launch's persistent
// blocks each take several tiles, the next one's first copies overlapping this one's stores. N = 776
// ends 8 columns into a fourth wide tile, K = 136 inside a third k-tile.
TEST(GroupedGemmGpu, InputGradientFormMoreTilesThanSMs) {
  check_grouped_gemm({"GroupedGemmGpu.NN.many", false, false, 0.f, {{1500, 776, 136}, {1100, 776, 136}, {700, 776, 136}, {900, 776, 136}, {300, 776, 136}}, true});
}

// K = 36 is not a multiple of 8: the kernel's 16-byte copies would straddle rows, so cuBLAS takes it.
TEST(GroupedGemmGpu, ShapesTheKernelRefusesGoToCublas) {
  check_grouped_gemm({"GroupedGemmGpu.NT.K36", false, true, 0.f, {{50, 64, 36}, {3, 64, 36}}, false});
}

// The forward form (A [R,K] routes, B [N,K] per expert): uneven routes, 2 of 8 experts without any.
TEST(GroupedGemmGpu, RoutedProblemsForwardFormGiveTheHostListsBits) {
  Rng rng;
  check_routed("GroupedGemmGpu.NT.routed", false, true, 0.f, routes_per_expert(rng, 8, 300, 2), 136, 264, true);
}

// The forward form with more tiles than the GPU has SMs (wide tiles: see InputGradientFormMoreTilesThanSMs).
TEST(GroupedGemmGpu, RoutedProblemsForwardFormMoreTilesThanSMs) {
  Rng rng;
  check_routed("GroupedGemmGpu.NT.routed.many", false, true, 0.f, routes_per_expert(rng, 8, 2000, 1), 136, 776, true);
}

// The input-gradient form (B [K,N] per expert) over 70 experts: two launches, each with its offsets.
TEST(GroupedGemmGpu, RoutedProblemsInputGradientFormOverTwoLaunches) {
  Rng rng;
  check_routed("GroupedGemmGpu.NN.routed", false, false, 0.f, routes_per_expert(rng, 70, 40, 5), 72, 136, true);
}

// The weight-gradient form (K = the expert's routes, beta 1) over 70 experts: an expert without
// routes keeps its gradient.
TEST(GroupedGemmGpu, RoutedProblemsWeightGradientFormKeepsEmptyExperts) {
  Rng rng;
  check_routed("GroupedGemmGpu.TN+=.routed", true, false, 1.f, routes_per_expert(rng, 70, 300, 6), 136, 72, true);
}

// K = 36 is not a multiple of 8: the kernel does not take it, so the routed call downloads the
// offsets and runs the host's list on cuBLAS (as every routed call does in the FP32 build).
TEST(GroupedGemmGpu, RoutedProblemsTheKernelRefusesAreResolvedOnTheHost) {
  Rng rng;
  check_routed("GroupedGemmGpu.NT.routed.K36", false, true, 0.f, routes_per_expert(rng, 5, 60, 1), 36, 64, false);
}

// The choice of implementation, on B1's layer (H 1024, I 512, E 32, 2048 routes per expert) and the
// default model's (H 384, I 384, E 8, 1024 routes per expert): the tensor-core kernel for every
// forward and input-gradient GEMM; for the weight gradients always in its wgmma form, and in its
// mma.sync form only below GGEMM_CUBLAS_MIN_FLOP per problem (B1's dW13, 4.3 GFLOP per expert, goes
// to cuBLAS); cuBLAS for everything in the FP32 build. Routed problems: the kernel whenever it fits.
TEST(GroupedGemmHost, KernelOrCublasByFormAndSize) {
  // 16-byte aligned fake pointers: the choice reads only sizes and alignment
  const floatX* A = reinterpret_cast<const floatX*>(uintptr_t(1) << 20);
  floatX* C = reinterpret_cast<floatX*>(uintptr_t(1) << 24);
  auto call = [&](int groups, int M, int N, int K) { return std::vector<GroupedGemmProblem>(groups, {A, A, C, M, N, K}); };
  const bool bf16 = BUILD_BF16, wgmma = BUILD_WGMMA;
  EXPECT_EQ(grouped_gemm_takes_kernel(call(32, 2048, 1024, 1024), false, true, 1024, 1024, 1024), bf16) << "B1 h13";
  EXPECT_EQ(grouped_gemm_takes_kernel(call(32, 2048, 1024, 1024), false, false, 1024, 1024, 1024), bf16) << "B1 dxp";
  EXPECT_EQ(grouped_gemm_takes_kernel(call(32, 1024, 512, 2048), true, false, 1024, 512, 512), bf16) << "B1 dW2 (2.1 GFLOP)";
  EXPECT_EQ(grouped_gemm_takes_kernel(call(32, 1024, 1024, 2048), true, false, 1024, 1024, 1024), wgmma)
      << "B1 dW13 (4.3 GFLOP)";
  EXPECT_EQ(grouped_gemm_takes_kernel(call(8, 768, 384, 1024), true, false, 768, 384, 384), bf16) << "default dW13";
  EXPECT_FALSE(grouped_gemm_takes_kernel(call(8, 768, 384, 1020), false, true, 1020, 1020, 384)) << "K % 8 != 0";
  // Routed problems (sizes on the device): the kernel whenever it fits, whatever their size, since
  // cuBLAS would need the sizes downloaded first; never with transA and transB (K routed would be
  // a contiguous dimension).
  const int* offsets = reinterpret_cast<const int*>(uintptr_t(1) << 28);
  auto routed = [&](int groups, int M, int N, int K) {
    GroupedGemmProblems p(call(groups, M, N, K));
    p.route_offsets = offsets;
    p.routes = 65536;
    return p;
  };
  EXPECT_EQ(grouped_gemm_takes_kernel(routed(32, 1024, 1024, 0), true, false, 1024, 1024, 1024), bf16) << "B1 dW13, routed";
  EXPECT_EQ(grouped_gemm_takes_kernel(routed(32, 0, 1024, 1024), false, true, 1024, 1024, 1024), bf16) << "B1 h13, routed";
  EXPECT_FALSE(grouped_gemm_takes_kernel(routed(32, 136, 72, 0), true, true, 136, 72, 72)) << "routed, both transposed";
}

// The wgmma form's tile shape (ops/grouped_gemm.cuh, grouped_gemm_tiles) on an H200 (132 SMs): wide
// tiles (128 × 256) for B1's forward and input-gradient GEMMs, routed or not (≥ 4 waves of wide
// tiles), and for a weight gradient of ≥ 2 waves only fed by the TMA (B1's dW13 and dW2: 1024 and 512
// wide tiles); narrow tiles (128 × 128) for the default model's smaller layers and a weight gradient
// not laid out as two tensors; narrow always without wgmma.
TEST(GroupedGemmHost, TileShapeByFormAndSize) {
  const int sms_h200 = 132;
  const floatX* A = reinterpret_cast<const floatX*>(uintptr_t(1) << 32);
  const floatX* B = reinterpret_cast<const floatX*>(uintptr_t(1) << 36);
  floatX* C = reinterpret_cast<floatX*>(uintptr_t(1) << 40);
  // `groups` problems as the MoE layer lays them out: A's rows one after another, B's experts stacked
  auto call = [&](int groups, int M, int N, int K) {
    GroupedGemmProblems p;
    for (int g = 0; g < groups; g++)
      p.list.push_back({A + (size_t)g * M * K, B + (size_t)g * N * K, C + (size_t)g * M * N, M, N, K});
    return p;
  };
  auto routed = [&](int groups, int N, int K, int routes) {
    GroupedGemmProblems p = call(groups, 0, N, K);
    p.route_offsets = reinterpret_cast<const int*>(uintptr_t(1) << 28);
    p.routes = routes;
    return p;
  };
  // the tile shape of the forward form (transB, ldb = K), of the input-gradient form (ldb = N), of the
  // weight-gradient form
  auto forward = [&](const GroupedGemmProblems& p) {
    return grouped_gemm_tiles(p, false, true, p.list[0].K, p.list[0].K, sms_h200);
  };
  auto input_gradient = [&](const GroupedGemmProblems& p) {
    return grouped_gemm_tiles(p, false, false, p.list[0].K, p.list[0].N, sms_h200);
  };
  auto weight_gradient = [&](const GroupedGemmProblems& p) {
    return grouped_gemm_tiles(p, true, false, p.list[0].M, p.list[0].N, sms_h200);
  };
  const GroupedGemmTiles tma = BUILD_WGMMA ? GroupedGemmTiles::WideTma : GroupedGemmTiles::Narrow;
  const GroupedGemmTiles wide = BUILD_WGMMA ? GroupedGemmTiles::Wide : GroupedGemmTiles::Narrow;
  EXPECT_EQ(forward(call(32, 2048, 1024, 1024)), tma) << "B1 h13 (2048 wide tiles)";
  EXPECT_EQ(input_gradient(call(32, 2048, 512, 1024)), tma) << "B1 da (1024 wide tiles)";
  EXPECT_EQ(forward(routed(32, 1024, 512, 65536)), tma) << "B1 y, routed";
  EXPECT_EQ(input_gradient(routed(32, 512, 1024, 65536)), tma) << "B1 da, routed";
  GroupedGemmProblems lent = call(32, 2048, 1024, 1024);
  lent.list[5].B = B - (size_t)1024 * 1024 - 8;  // an expert whose weights another rank lent (ops/llep.cuh)
  EXPECT_EQ(forward(lent), wide) << "B1 h13 with one expert's weights outside the stack";
  // the weight gradients: A [routes][M] and B [routes][N] row slices (routed: all at row 0), C per expert
  auto weight_gradients = [&](int groups, int M, int N, int routes_each, bool is_routed) {
    GroupedGemmProblems p;
    for (int g = 0; g < groups; g++) {
      const size_t row = is_routed ? 0 : (size_t)g * routes_each;
      p.list.push_back({A + row * M, B + row * N, C + (size_t)g * M * N, M, N, is_routed ? 0 : routes_each});
    }
    if (is_routed) {
      p.route_offsets = reinterpret_cast<const int*>(uintptr_t(1) << 28);
      p.routes = groups * routes_each;
    }
    return p;
  };
  EXPECT_EQ(weight_gradient(weight_gradients(32, 1024, 1024, 2048, false)), tma) << "B1 dW13 (1024 wide tiles)";
  EXPECT_EQ(weight_gradient(weight_gradients(32, 1024, 1024, 2048, true)), tma) << "B1 dW13, routed";
  EXPECT_EQ(weight_gradient(weight_gradients(32, 1024, 512, 2048, true)), tma) << "B1 dW2, routed (512 wide tiles)";
  EXPECT_EQ(weight_gradient(weight_gradients(1, 128 * 2 * sms_h200, 256, 64, false)), tma) << "2 waves";
  EXPECT_EQ(weight_gradient(weight_gradients(1, 128 * 2 * sms_h200 - 128, 256, 64, false)), GroupedGemmTiles::Narrow)
      << "one tile short of 2 waves";
  GroupedGemmProblems apart = weight_gradients(32, 1024, 1024, 2048, false);
  apart.list[7].A += 1024;  // a row between two experts' routes: not one tensor
  EXPECT_EQ(weight_gradient(apart), GroupedGemmTiles::Narrow) << "B1 dW13 not laid out as two tensors: never thread-fed wide";
  EXPECT_EQ(weight_gradient(weight_gradients(8, 768, 384, 1024, true)), GroupedGemmTiles::Narrow) << "default model dW13";
  EXPECT_EQ(forward(routed(8, 768, 384, 8192)), GroupedGemmTiles::Narrow) << "default model h13, routed (216 wide tiles)";
  EXPECT_EQ(input_gradient(call(8, 1024, 384, 768)), GroupedGemmTiles::Narrow) << "default model dxp";
  // the threshold: 4 waves of wide tiles
  EXPECT_EQ(forward(call(1, 128 * 4 * sms_h200, 256, 64)), tma) << "4 waves";
  EXPECT_EQ(forward(call(1, 128 * 4 * sms_h200 - 128, 256, 64)), GroupedGemmTiles::Narrow) << "one tile short of 4 waves";
}

// The TMA form's two tensors (ops/grouped_gemm.cuh, grouped_gemm_tma_layout): found where the problems
// are laid out as one A matrix and one stack of B (an expert without routes may be left out of a
// host's list), or, for the weight gradients, as the same rows of one A and one B matrix; refused
// otherwise. And C as a third, stored by the TMA, where its rows lie beside A's
// (grouped_gemm_tma_c_beside_a).
TEST(GroupedGemmHost, TmaLayoutFindsTheTwoTensors) {
  const floatX* A = reinterpret_cast<const floatX*>(uintptr_t(1) << 32);
  const floatX* B = reinterpret_cast<const floatX*>(uintptr_t(1) << 36);
  floatX* C = reinterpret_cast<floatX*>(uintptr_t(1) << 40);
  const int N = 512, K = 1024;  // the forward form: B [N,K] per expert, ldb = K
  // experts 1, 2, 4 with 300, 7, 129 routes (0 and 3 without routes, left out)
  const std::vector<std::pair<int, int>> experts = {{1, 300}, {2, 7}, {4, 129}};
  auto host_list = [&] {
    GroupedGemmProblems p;
    size_t row = 0;
    for (auto [e, rows] : experts) {
      p.list.push_back({A + row * K, B + (size_t)e * N * K, C + row * N, rows, N, K});
      row += rows;
    }
    return p;
  };
  GroupedGemmTmaLayout l;
  ASSERT_TRUE(grouped_gemm_tma_layout(host_list(), false, true, K, K, l));
  EXPECT_EQ(l.a_first, A);
  EXPECT_EQ(l.a_rows, 436);
  EXPECT_EQ(l.b_first, B + (size_t)N * K) << "the stack starts at the first expert listed";
  EXPECT_EQ(l.b_expert, (long long)N * K);
  EXPECT_EQ(l.experts, 4) << "experts 1 … 4 of the stack";
  EXPECT_FALSE(grouped_gemm_tma_layout(host_list(), true, true, K, K, l)) << "transA and transB";

  GroupedGemmProblems gap = host_list();
  gap.list[1].A += K;  // one row between the first problem's rows and the second's
  EXPECT_FALSE(grouped_gemm_tma_layout(gap, false, true, K, K, l)) << "A's rows not one after another";
  GroupedGemmProblems lent = host_list();
  lent.list[2].B = B + (size_t)4 * N * K + 8;  // not whole matrices from the others
  EXPECT_FALSE(grouped_gemm_tma_layout(lent, false, true, K, K, l)) << "B outside the stack";
  GroupedGemmProblems two_k = host_list();
  two_k.list[2].K = K / 2;
  EXPECT_FALSE(grouped_gemm_tma_layout(two_k, false, true, K, K, l)) << "two values of K";
  GroupedGemmProblems n_516 = host_list();
  for (GroupedGemmProblem& q : n_516.list) q.N = 516;
  EXPECT_FALSE(grouped_gemm_tma_layout(n_516, false, true, K, K, l)) << "N % 8 != 0 (16-byte stores of C)";
  GroupedGemmProblems c_off = host_list();
  c_off.list[1].C += 2;  // 4 bytes off in the BF16 build, 8 in the FP32 one
  EXPECT_FALSE(grouped_gemm_tma_layout(c_off, false, true, K, K, l)) << "a C not 16-byte aligned";
  // C stored by the TMA (beta 0): C's rows beside A's, one [rows][N] matrix addressed by A's rows
  ASSERT_TRUE(grouped_gemm_tma_layout(host_list(), false, true, K, K, l));
  EXPECT_TRUE(grouped_gemm_tma_c_beside_a(host_list(), l, false, K, N));
  GroupedGemmProblems c_gap = host_list();
  c_gap.list[2].C += N;  // one row of C between the second problem's and the third's
  EXPECT_FALSE(grouped_gemm_tma_c_beside_a(c_gap, l, false, K, N)) << "C's rows not beside A's";
  EXPECT_FALSE(grouped_gemm_tma_c_beside_a(host_list(), l, true, K, N)) << "the weight-gradient form";

  GroupedGemmProblems routed;
  for (int e = 0; e < 5; e++) routed.list.push_back({A, B + (size_t)e * N * K, C, 0, N, K});
  routed.route_offsets = reinterpret_cast<const int*>(uintptr_t(1) << 28);
  routed.routes = 436;
  ASSERT_TRUE(grouped_gemm_tma_layout(routed, false, true, K, K, l));
  EXPECT_EQ(l.a_rows, 436);
  EXPECT_EQ(l.experts, 5);
  EXPECT_TRUE(grouped_gemm_tma_c_beside_a(routed, l, false, K, N)) << "routed: every C at row 0";
  routed.list[3].A = A + K;
  EXPECT_FALSE(grouped_gemm_tma_layout(routed, false, true, K, K, l)) << "a routed problem's A not at row 0";

  // The weight-gradient form (transA): A [routes][M] and B [routes][N], each expert's routes the next
  // rows of both, C per expert (M × N).
  const int M = 1024;
  auto weight_gradients = [&] {
    GroupedGemmProblems p;
    size_t row = 0;
    for (auto [e, rows] : experts) {
      p.list.push_back({A + row * M, B + row * N, C + (size_t)e * M * N, M, N, rows});
      row += rows;
    }
    return p;
  };
  ASSERT_TRUE(grouped_gemm_tma_layout(weight_gradients(), true, false, M, N, l));
  EXPECT_EQ(l.a_first, A);
  EXPECT_EQ(l.b_first, B);
  EXPECT_EQ(l.a_rows, 436);
  EXPECT_EQ(l.M, M);
  EXPECT_EQ(l.N, N);
  GroupedGemmProblems b_gap = weight_gradients();
  b_gap.list[2].B += N;  // B's routes one row apart from A's
  EXPECT_FALSE(grouped_gemm_tma_layout(b_gap, true, false, M, N, l)) << "B's routes not at A's rows";
  GroupedGemmProblems two_m = weight_gradients();
  two_m.list[1].M = M / 2;
  EXPECT_FALSE(grouped_gemm_tma_layout(two_m, true, false, M, N, l)) << "two values of M";
  GroupedGemmProblems routed_wg;
  for (int e = 0; e < 5; e++) routed_wg.list.push_back({A, B, C + (size_t)e * M * N, M, N, 0});
  routed_wg.route_offsets = reinterpret_cast<const int*>(uintptr_t(1) << 28);
  routed_wg.routes = 436;
  ASSERT_TRUE(grouped_gemm_tma_layout(routed_wg, true, false, M, N, l));
  EXPECT_EQ(l.a_rows, 436);
  routed_wg.list[4].B = B + N;
  EXPECT_FALSE(grouped_gemm_tma_layout(routed_wg, true, false, M, N, l)) << "a routed problem's B not at row 0";
}
