// tests/dist_relay_moe.cu — RelayMoE (ops/relay_moe.cuh, --moe relay), expert mode and token mode, on W
// ranks (E_p = W, the whole test world) against ref/ep_moe.hpp over the global batch: every rank
// builds the same global inputs from the shared seed (tests/dist_moe_case.cuh), runs its token shard
// and its expert partition around the ring, and checks only what it holds — out, dx, dtopk_w of its
// tokens, dW13/dW2 (+=, onto random starting values) of its experts — per tensor, within the operator
// tolerance (notes/design.md §3). Besides: agreement with standard EP (EPDispatcher) on the same inputs
// (two schedules of one operator), the pool's peaks of forward and of backward within the closed forms
// (relay_expert_live_bytes, relay_token_live_bytes) per category, the pool back at its starting bytes, a bit-for-bit replay,
// and the recomputed forward (out = nullptr, only the plan) giving the same gradients bit for bit.
// Routing: balanced, hot with repeated experts, every route of every rank to ONE expert (the other
// rank's partition idle in every hop), every route to rank 0's partition, random per rank. Every case
// runs in both modes.
#include <cstring>
#include "dist_moe_case.cuh"
#include "../ops/relay_moe.cuh"

namespace {

// Relay against standard EP: out, dx and dtopk_w differ in the order of their fp32 sums only (hop by
// hop rather than j by j), so SCHEDULE_TOL; a weight gradient is summed hop by hop into a floatX
// accumulator that travels, then added at the owner (expert mode), or hop by hop into the gradient
// itself (token mode): in the BF16 build one bf16 rounding per hop more than EP's single GEMM per
// expert, the same as LLEP's split experts (SPLIT_TOL).

// This rank's routes per global expert, from the global routing.
std::vector<int> expert_counts_of(const GlobalCase& c, int r) {
  std::vector<int> counts(c.E, 0);
  for (int n = 0; n < c.N; n++)
    for (int j = 0; j < c.k; j++) counts[c.topk_idx(r * c.N + n, j)]++;
  return counts;
}

void expect_bitwise_equal(const std::string& name, const Shard& a, const Shard& b) {
  auto same = [](const Mat& x, const Mat& y) {
    return x.rows() == y.rows() && x.cols() == y.cols() && memcmp(x.data(), y.data(), x.size() * sizeof(double)) == 0;
  };
  EXPECT_TRUE(same(a.out, b.out)) << name << ": out differs";
  EXPECT_TRUE(same(a.dx, b.dx)) << name << ": dx differs";
  EXPECT_TRUE(same(a.dtopk_w, b.dtopk_w)) << name << ": dtopk_w differs";
  EXPECT_TRUE(same(a.dW13, b.dW13)) << name << ": dW13 differs";
  EXPECT_TRUE(same(a.dW2, b.dW2)) << name << ": dW2 differs";
}

// The most routes of one visiting block (token mode: each rank's tokens) to partition r's experts.
long long token_mode_max_hop_routes(const GlobalCase& c, int r) {
  const int E_l = c.E / c.ranks;
  long long most = 0;
  for (int s = 0; s < c.ranks; s++) {
    std::vector<int> counts = expert_counts_of(c, s);
    most = std::max<long long>(most, relay_hop_slice(counts, r, E_l).count);
  }
  return most;
}

Shard run_relay(const GlobalCase& c, const Comm& ep, cudaStream_t stream, RelayMode mode, bool recomputed = false) {
  RelayDispatcher relay(c.H, c.I, c.E, c.k, ep, mode);
  return run_dispatch(c, relay, ep.rank, stream, recomputed);
}

// This rank's shard against the reference over the global batch and against standard EP; the measured
// peaks of forward and backward against the closed forms.
void check_relay_mode(const std::string& label, const GlobalCase& c, const Comm& ep, cudaStream_t stream, RelayMode mode) {
  const int r = ep.rank, E_l = c.E / c.ranks, E_p = c.ranks;
  const std::string name = label + " relay " + relay_mode_name(mode) + " rank " + std::to_string(r);
  SCOPED_TRACE(name);
  const Shard got = run_relay(c, ep, stream, mode);
  expect_shard_near(name, got, reference_shard(c, r), OP_TOL, OP_TOL);

  // a local expert that no rank routes to: its accumulator went round the ring empty and added nothing
  for (int l = 0; l < E_l; l++) {
    bool routed = false;
    for (Eigen::Index n = 0; n < c.topk_idx.rows(); n++)
      for (int j = 0; j < c.k; j++) routed |= c.topk_idx(n, j) == r * E_l + l;
    if (routed) continue;
    EXPECT_EQ(got.dW13.middleRows(l * 2 * c.I, 2 * c.I), c.dW13_init[r * E_l + l]) << "local expert " << l;
    EXPECT_EQ(got.dW2.middleRows(l * c.H, c.H), c.dW2_init[r * E_l + l]) << "local expert " << l;
  }

  const Shard standard = run_ep(c, ep, stream);
  expect_shard_near(name + " vs ep", got, standard, SCHEDULE_TOL, SPLIT_TOL);

  // the live set: each category of each pass within the closed form for this rank's largest hop
  const bool expert = mode == RelayMode::Expert;
  const long long R_max = expert ? relay_max_hop_routes(expert_counts_of(c, r), E_l) : token_mode_max_hop_routes(c, r);
  const size_t b = sizeof(floatX);
  const RelayLiveBytes fwd = expert ? relay_expert_live_bytes(false, c.N, c.k, R_max, c.H, c.I, E_l, E_p, b)
                                    : relay_token_live_bytes(false, c.N, c.k, R_max, c.H, c.I, E_p, b);
  const RelayLiveBytes bwd = expert ? relay_expert_live_bytes(true, c.N, c.k, R_max, c.H, c.I, E_l, E_p, b)
                                    : relay_token_live_bytes(true, c.N, c.k, R_max, c.H, c.I, E_p, b);
  EXPECT_LE(got.forward_peak.dispatch, fwd.dispatch) << "forward dispatch";
  EXPECT_LE(got.forward_peak.intermediates, fwd.intermediates) << "forward expert intermediates";
  EXPECT_LE(got.forward_peak.staging, fwd.staging) << "forward comm staging";
  EXPECT_LE(got.backward_peak.dispatch, bwd.dispatch) << "backward dispatch";
  EXPECT_LE(got.backward_peak.intermediates, bwd.intermediates) << "backward expert intermediates";
  EXPECT_LE(got.backward_peak.staging, bwd.staging) << "backward comm staging";
  printf("[peak] %-48s R=%d R_max=%lld forward D/EI/CS = %zu/%zu/%zu B (closed form %zu/%zu/%zu) "
         "backward %zu/%zu/%zu B (closed form %zu/%zu/%zu); ep dispatch+intermediates %zu B, R_d=%lld\n",
         name.c_str(), c.N * c.k, R_max, got.forward_peak.dispatch, got.forward_peak.intermediates,
         got.forward_peak.staging, fwd.dispatch, fwd.intermediates, fwd.staging, got.backward_peak.dispatch,
         got.backward_peak.intermediates, got.backward_peak.staging, bwd.dispatch, bwd.intermediates, bwd.staging,
         standard.dispatch_peak + standard.intermediates_peak, standard.received);
}

void check_relay_case(const std::string& label, const GlobalCase& c, const Comm& ep, cudaStream_t stream) {
  for (RelayMode mode : {RelayMode::Expert, RelayMode::Token}) check_relay_mode(label, c, ep, stream, mode);
}

}  // namespace

TEST(RelayMoEDist, BalancedRouting) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 37, 64, 40, 2, 2, profile_routing("balanced"));
  check_relay_case("balanced N=37 E_l=2 k=2", c, world, stream.stream);
}

// hot:0.5/2 with k = 3: a hot token's slots go to experts 0, 1, 0 (a repeated expert in one hop).
TEST(RelayMoEDist, HotRoutingWithRepeatedExperts) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 53, 128, 96, 4, 3, profile_routing("hot:0.5/2"));
  check_relay_case("hot:0.5/2 N=53 E_l=4 k=3", c, world, stream.stream);
}

// hot:1/1 with k = 2: every route of every rank goes to expert 0 (both of a token's routes): in expert
// mode one hop computes all of a rank's routes (R_max = R), the other hops none; in token mode rank 0
// computes every block's routes, the other ranks none; rank 0's other local expert and every other
// partition's experts keep their gradients' starting values.
TEST(RelayMoEDist, EveryRouteToOneExpert) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 29, 64, 48, 2, 2, profile_routing("hot:1/1"));
  check_relay_case("hot:1/1 N=29 E_l=2 k=2", c, world, stream.stream);
}

// hot:1/2 with E_l = 3: every token picks experts 0 and 1, both in rank 0's partition.
TEST(RelayMoEDist, EveryRouteToRankZero) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 29, 64, 48, 3, 2, profile_routing("hot:1/2"));
  check_relay_case("hot:1/2 N=29 E_l=3 k=2", c, world, stream.stream);
}

TEST(RelayMoEDist, RandomRoutingReplaysBitForBit) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 45, 64, 40, 2, 2, random_routing());
  check_relay_case("random N=45 E_l=2 k=2", c, world, stream.stream);
  for (RelayMode mode : {RelayMode::Expert, RelayMode::Token}) {
    const Shard first = run_relay(c, world, stream.stream, mode), second = run_relay(c, world, stream.stream, mode);
    expect_bitwise_equal(std::string("relay ") + relay_mode_name(mode) + " replay rank " + std::to_string(world.rank), first,
                         second);
  }
}

// Under --recompute a layer calls forward twice, the second time with out = nullptr: relay then only
// plans (expert mode: the route sort; token mode: the blocks' sizes) since its backward recomputes every
// hop anyway, so the gradients are bit for bit those of one forward + backward, and the recomputation's
// forward adds nothing to the peaks.
TEST(RelayMoEDist, RecomputedForwardGivesTheSameGradients) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 41, 64, 40, 2, 2, profile_routing("hot:0.5/2"));
  for (RelayMode mode : {RelayMode::Expert, RelayMode::Token}) {
    const Shard once = run_relay(c, world, stream.stream, mode), twice = run_relay(c, world, stream.stream, mode, true);
    const std::string name = std::string("relay ") + relay_mode_name(mode) + " recomputed rank " + std::to_string(world.rank);
    EXPECT_TRUE(memcmp(once.dx.data(), twice.dx.data(), once.dx.size() * sizeof(double)) == 0) << name << ": dx";
    EXPECT_TRUE(memcmp(once.dtopk_w.data(), twice.dtopk_w.data(), once.dtopk_w.size() * sizeof(double)) == 0)
        << name << ": dtopk_w";
    EXPECT_TRUE(memcmp(once.dW13.data(), twice.dW13.data(), once.dW13.size() * sizeof(double)) == 0) << name << ": dW13";
    EXPECT_TRUE(memcmp(once.dW2.data(), twice.dW2.data(), once.dW2.size() * sizeof(double)) == 0) << name << ": dW2";
    EXPECT_TRUE(memcmp(once.out.data(), twice.out.data(), once.out.size() * sizeof(double)) == 0) << name << ": out";
    // the planning-only forward adds nothing to either pass's peak
    EXPECT_EQ(twice.forward_peak.dispatch, once.forward_peak.dispatch) << name;
    EXPECT_EQ(twice.forward_peak.staging, once.forward_peak.staging) << name;
    EXPECT_EQ(twice.backward_peak.dispatch, once.backward_peak.dispatch) << name;
  }
}
