// Ring-DTP (ops/ring_dtp.cuh) on W ranks, the vocabulary group = the world (P = W): each rank's loss
// sum, dx and dW (+=) of its vocabulary interval against the full logits and cross-entropy over the
// global batch in double, per tensor, in both ring branches, fused and auto (training and the loss alone), with V
// not divisible by P, N on both sides of V/P, targets in every shard, logits blocks narrower and wider than a
// shard, fused steps whose last is partial; each rank's
// pool peak within the closed form; bit-identical replay; the sampling path (logits_rows) gathers
// every rank's columns into the full rows.
#include <cstring>
#include "dist_util.cuh"
#include "ring_dtp_check.cuh"

using namespace testutil;

namespace {

void check_ring(int N, int V, int H, const std::string& mode, int block_cols, bool backward = true) {
  const Comm& world = test_world();
  const std::string name = "RingDTP." + mode + (backward ? "" : ".loss_only") + ".P" + std::to_string(world.size) + "N" +
                           std::to_string(N) + "V" + std::to_string(V) + "block" + std::to_string(block_cols);
  const HeadCase c = make_head_case(world.size, N, V, H);
  RingDTPHead head(world, mode, block_cols);
  expect_head_matches(name, c, world.rank, run_head(head, c, world.rank, backward), mode, block_cols, backward);
}

}  // namespace

// V/P = 500.5 at P = 2: N = 37 is below it (auto moves activations), N = 700 above (auto moves weights)
TEST(RingDTPDist, WeightsMoveMatchesTheFullHead) {
  REQUIRE_WORLD(2);
  for (int N : {37, 700})
    for (int block : {128, 100000}) check_ring(N, 1001, 64, "weights", block);
}

TEST(RingDTPDist, ActivationsMoveMatchesTheFullHead) {
  REQUIRE_WORLD(2);
  for (int N : {37, 700})
    for (int block : {128, 100000}) check_ring(N, 1001, 64, "activations", block);
}

// Fused: steps of n rows per rank (head_block_rows(N, ⌈V/P⌉, P, C)): at P = 2, N = 37 and C = 128 four
// rows a step and one in the last; N = 700: 89 and 77; C = 100000: two steps. Also the loss alone.
TEST(RingDTPDist, FusedMatchesTheFullHead) {
  REQUIRE_WORLD(2);
  for (int N : {37, 700})
    for (int block : {128, 100000}) {
      check_ring(N, 1001, 64, "fused", block);
      check_ring(N, 1001, 64, "fused", block, false);
    }
}

// auto: fused when training; a pass without backward takes the ring branch of the N > V/P rule
TEST(RingDTPDist, AutoMatchesTheFullHeadTrainingAndOnBothSidesOfTheRule) {
  REQUIRE_WORLD(2);
  for (int N : {37, 700}) {
    check_ring(N, 1001, 96, "auto", 300);
    check_ring(N, 1001, 96, "auto", 300, false);
  }
}

TEST(RingDTPDist, IsBitwiseReproducible) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  for (const char* mode : {"weights", "activations", "fused"}) {
    const HeadCase c = make_head_case(world.size, 129, 777, 64);
    RingDTPHead head(world, mode, 100);
    const HeadRun a = run_head(head, c, world.rank), b = run_head(head, c, world.rank);
    EXPECT_EQ(0, memcmp(&a.loss_sum, &b.loss_sum, sizeof(float))) << mode << " loss sum differs";
    EXPECT_EQ(0, memcmp(a.dx.data(), b.dx.data(), a.dx.size() * sizeof(floatX))) << mode << " dx differs";
    EXPECT_EQ(0, memcmp(a.dW.data(), b.dW.data(), a.dW.size() * sizeof(floatX))) << mode << " dW differs";
  }
}

// Sampling with a sharded head: every rank gets the full logits rows x Wᵀ [n, V].
TEST(RingDTPDist, LogitsRowsGatherEveryShard) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  const int n = 3, V = 1001, H = 64;
  const HeadCase c = make_head_case(world.size, n, V, H);
  const std::pair<int, int> iv = vocab_interval(V, world.size, world.rank);
  DeviceBuffer<floatX> x = upload<floatX>(c.x[0], Mem::Activations);  // the same rows on every rank
  DeviceBuffer<floatX> W = upload<floatX>(ref::Mat<double>(c.W.middleRows(iv.first, iv.second - iv.first)), Mem::Weights);
  DeviceBuffer<floatX> logits((size_t)n * V, Mem::Logits, "test.logits");
  poison(logits.ptr, logits.count);
  RingDTPHead head(world, "auto", 64);
  head.logits_rows(logits.ptr, x.ptr, W.ptr, n, H, V, 0);
  const ref::Mat<double> want = c.x[0] * c.W.transpose();
  EXPECT_REL("RingDTP.logits_rows", "logits", rel_err(download(logits.ptr, n, V), want), OP_TOL);
}
