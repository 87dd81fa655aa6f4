// tests/dist_ep_moe.cu — ops/ep_moe.cuh on W ranks (E_p = W, the whole test world) against
// ref/ep_moe.hpp over the global batch: every rank builds the same global inputs from a shared seed
// (the launcher gives every rank one FLATMOE_SEED, so testutil::fresh_seed agrees across ranks),
// runs its token shard with its expert shard, and checks only what it holds — out, dx, dtopk_w of
// its tokens, dW13/dW2 (+=, onto random starting values) of its experts — plus its received route
// count R_d, the pool's Dispatch and ExpertIntermediates peaks against the closed forms, the pool
// returning to its starting bytes, and agreement with the single-GPU moe_forward/moe_backward run on
// the same global batch (schedules agree to rounding, notes/design.md §3). Routing: balanced, hot (with a
// hot token's routes repeating an expert), every route to rank 0 (the other ranks receive nothing,
// and rank 0 has a local expert without routes), random per rank (and a bit-for-bit replay).
#include "dist_moe_case.cuh"
#include "../ops/router.cuh"
#include "../ref/pipelined_llep.hpp"

namespace {

// This rank's shard against the reference over the global batch, the closed-form peaks, and the
// single-GPU schedule. `name` labels the [err] lines.
void check_case(const std::string& label, const GlobalCase& c, const Comm& ep, cudaStream_t stream) {
  const int r = ep.rank, E_l = c.E / c.ranks;
  const std::string name = label + " rank " + std::to_string(r);
  SCOPED_TRACE(name);
  Shard got = run_ep(c, ep, stream);
  expect_shard_near(name, got, reference_shard(c, r), OP_TOL, OP_TOL);

  // routes received, per local expert; an expert without routes keeps its gradient bit for bit
  std::vector<ref::EPRoute> received = ref::ep_received_routes(c.topk_idx, c.E, c.ranks, r, ref::EPOrder::ByExpert);
  EXPECT_EQ(got.received, (long long)received.size());
  std::vector<int> routes_of_local(E_l, 0);
  for (const ref::EPRoute& route : received) routes_of_local[c.topk_idx(route.source * c.N + route.token, route.slot) % E_l]++;
  for (int l = 0; l < E_l; l++) {
    if (routes_of_local[l] > 0) continue;
    EXPECT_EQ(got.dW13.middleRows(l * 2 * c.I, 2 * c.I), c.dW13_init[r * E_l + l]) << "local expert " << l;
    EXPECT_EQ(got.dW2.middleRows(l * c.H, c.H), c.dW2_init[r * E_l + l]) << "local expert " << l;
  }

  // measured live set = the closed form for this rank's R_d
  const long long R = (long long)c.N * c.k, R_d = (long long)received.size();
  const size_t dispatch_bound = ep_moe_dispatch_peak_bytes(R, R_d, c.H, sizeof(floatX));
  const size_t inter_bound = ep_moe_intermediates_peak_bytes(R_d, c.I, sizeof(floatX));
  printf("[peak] %-36s R=%lld R_d=%lld dispatch=%zu B (closed form %zu) expert_intermediates=%zu B (closed form %zu)\n",
         name.c_str(), R, R_d, got.dispatch_peak, dispatch_bound, got.intermediates_peak, inter_bound);
  EXPECT_EQ(got.dispatch_peak, dispatch_bound);
  EXPECT_EQ(got.intermediates_peak, inter_bound);

  // the single-GPU schedule on the same global batch
  Shard single = run_single_gpu(c, r, stream);
  expect_shard_near(name + " vs 1 GPU", got, single, SCHEDULE_TOL, SCHEDULE_TOL);
}

}  // namespace

TEST(EpMoEDist, BalancedRouting) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 37, 64, 40, 2, 2, profile_routing("balanced"));
  check_case("ep balanced N=37 E_l=2 k=2", c, world, stream.stream);
}

// hot:0.5/2 with k = 3: a hot token's slots go to experts 0, 1, 0 (both on rank 0), the rest walk
// the cold experts of every rank.
TEST(EpMoEDist, HotRoutingWithRepeatedExperts) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 53, 128, 96, 4, 3, profile_routing("hot:0.5/2"));
  check_case("ep hot:0.5/2 N=53 E_l=4 k=3", c, world, stream.stream);
}

// hot:1/2 with E_l = 3: every token of every rank picks experts 0 and 1, so rank 0 receives all
// W·N·k routes (local expert 2 none) and every other rank receives nothing, yet takes part.
TEST(EpMoEDist, AllRoutesToRankZero) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 29, 64, 48, 3, 2, profile_routing("hot:1/2"));
  check_case("ep all to rank 0 N=29 E_l=3 k=2", c, world, stream.stream);
}

TEST(EpMoEDist, RandomRoutingReplaysBitForBit) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 45, 64, 40, 2, 2, random_routing());
  check_case("ep random N=45 E_l=2 k=2", c, world, stream.stream);
  Shard first = run_ep(c, world, stream.stream), second = run_ep(c, world, stream.stream);
  EXPECT_EQ(first.out, second.out);
  EXPECT_EQ(first.dx, second.dx);
  EXPECT_EQ(first.dtopk_w, second.dtopk_w);
  EXPECT_EQ(first.dW13, second.dW13);
  EXPECT_EQ(first.dW2, second.dW2);
}

// ---------------------------------------------------------------------------------------------
// LLEP (--moe llep) and PipelinedLLEP (--moe pllep) on the same cases: against the reference over
// the global batch, against standard EP (schedules of one operator), each rank's routes computed =
// the host plan's, the receiver bounds, and the pool's peaks against the closed forms.

namespace {

// Chunk i of K's counts [E_p·E] source-major (what every rank all-gathers), from ref/pipelined_llep.hpp.
std::vector<long long> chunk_counts(const GlobalCase& c, int K, int i) {
  std::vector<std::vector<int>> per_source;
  for (int s = 0; s < c.ranks; s++) per_source.push_back(flat(c.topk_idx.middleRows(s * c.N, c.N)));
  const std::vector<std::vector<std::vector<long long>>> all = ref::pllep_chunk_counts(per_source, c.k, c.E, K);
  std::vector<long long> counts;
  for (const std::vector<long long>& source : all[i]) counts.insert(counts.end(), source.begin(), source.end());
  return counts;
}

void check_llep_case(const std::string& label, const GlobalCase& c, double alpha, long long min_rows,
                     const std::vector<int>& chunk_counts_to_run, const Comm& ep, cudaStream_t stream) {
  const int r = ep.rank, H = c.H, I = c.I, k = c.k;
  const size_t b = sizeof(floatX);
  const Shard want = reference_shard(c, r);
  const Shard standard = run_ep(c, ep, stream);
  auto expect_exact = [&](const std::string& name, const Shard& got) {
    SCOPED_TRACE(name);
    expect_shard_near(name, got, want, OP_TOL, OP_TOL);
    expect_shard_near(name + " vs ep", got, standard, SCHEDULE_TOL, SPLIT_TOL);
  };

  // LLEP: this rank computes the plan's R_d, within cap + min_rows − 1, with standard EP's schedule
  // (hence its closed forms at this R_d)
  const LLEPPlan plan = llep_plan(chunk_counts(c, 1, 0), c.ranks, alpha, min_rows);
  LLEPDispatcher llep(H, I, c.E, k, ep, alpha, min_rows);
  const Shard lent = run_dispatch(c, llep, r, stream);
  const std::string name = label + " llep rank " + std::to_string(r);
  expect_exact(name, lent);
  const long long R = (long long)c.N * k;
  EXPECT_EQ(lent.received, plan.received[r]) << name;
  EXPECT_LE(lent.received, llep_receive_bound(plan)) << name;
  EXPECT_EQ(lent.dispatch_peak, ep_moe_dispatch_peak_bytes(R, lent.received, H, b)) << name;
  EXPECT_EQ(lent.intermediates_peak, ep_moe_intermediates_peak_bytes(lent.received, I, b)) << name;
  printf("[peak] %-44s R_d ep=%lld llep=%lld (cap %lld, %zu weight transfers) dispatch ep=%zu B llep=%zu B\n",
         name.c_str(), standard.received, lent.received, plan.capacity, plan.transfers.size(),
         standard.dispatch_peak, lent.dispatch_peak);

  // PipelinedLLEP with K chunks (token budget 1, K_max = K): each chunk's R_d = its plan's, within the
  // receiver bound; a few consecutive chunks in flight: the peaks within pllep's closed forms
  for (int K : chunk_counts_to_run) {
    PLLEPDispatcher pllep(H, I, c.E, k, ep, 1, K, alpha, min_rows);
    const Shard chunked = run_dispatch(c, pllep, r, stream);
    const std::string pname = label + " pllep K=" + std::to_string(K) + " rank " + std::to_string(r);
    expect_exact(pname, chunked);
    const PLLEPChunking chunking = pllep_chunking(std::vector<int>(c.ranks, c.N), 1, K);
    ASSERT_EQ(chunking.chunks, K) << pname;
    std::vector<std::vector<long long>> counts;
    for (int i = 0; i < K; i++) counts.push_back(chunk_counts(c, K, i));
    const std::vector<LLEPPlan> plans = pllep_plan(chunking, counts, k, alpha, min_rows);
    ASSERT_EQ(chunked.chunk_received.size(), (size_t)K) << pname;
    std::vector<int> chunk_tokens;
    for (int i = 0; i < K; i++) {
      const long long R_d = chunked.chunk_received[i];
      chunk_tokens.push_back(pllep_chunk_tokens(c.N, K, i));
      EXPECT_EQ(R_d, plans[i].received[r]) << pname << " chunk " << i;
      EXPECT_LE(R_d, pllep_receive_bound(chunking, k)) << pname << " chunk " << i;
    }
    const size_t dispatch_bound = pllep_dispatch_bound(chunk_tokens, chunked.chunk_received, H, k, b);
    const size_t inter_bound = pllep_intermediates_bound(chunked.chunk_received, I, b);
    EXPECT_LE(chunked.dispatch_peak, dispatch_bound) << pname;
    EXPECT_LE(chunked.intermediates_peak, inter_bound) << pname;
    // with K ≥ 7 chunks, the (at most 3) in flight hold less than LLEP's whole pass
    if (K >= 7 && lent.received > 0) EXPECT_LT(chunked.dispatch_peak, lent.dispatch_peak) << pname;
    long long most = 0;
    for (long long R_d : chunked.chunk_received) most = std::max(most, R_d);
    printf("[peak] %-44s largest chunk R_d=%lld (bound %lld) dispatch=%zu B (closed form %zu; %.0f%% of llep's) "
           "intermediates=%zu B (closed form %zu)\n",
           pname.c_str(), most, pllep_receive_bound(chunking, k), chunked.dispatch_peak, dispatch_bound,
           100.0 * chunked.dispatch_peak / std::max<size_t>(1, lent.dispatch_peak), chunked.intermediates_peak, inter_bound);
  }
}

}  // namespace

// hot:1/2: every route of every rank goes to experts 0 and 1 (rank 0's): standard EP computes all of
// them on rank 0; LLEP lends both experts' overflow to the other ranks.
TEST(LlepDist, AllRoutesToRankZeroAreSpreadOverTheGroup) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 29, 64, 48, 3, 2, profile_routing("hot:1/2"));
  check_llep_case("hot:1/2 N=29 E_l=3 k=2", c, 1.0, 4, {1, 2, 3, 7}, world, stream.stream);
}

// hot:0.5/2 with k = 3 (a hot token's routes repeat expert 0), α = 1.1, pieces of any size.
TEST(LlepDist, HotRoutingWithRepeatedExperts) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 53, 128, 96, 4, 3, profile_routing("hot:0.5/2"));
  check_llep_case("hot:0.5/2 N=53 E_l=4 k=3", c, 1.1, 1, {2, 7}, world, stream.stream);
}

TEST(LlepDist, BalancedRouting) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 37, 64, 40, 2, 2, profile_routing("balanced"));
  check_llep_case("balanced N=37 E_l=2 k=2", c, 1.0, 1, {3}, world, stream.stream);
}

TEST(LlepDist, PipelinedReplaysBitForBit) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 45, 64, 40, 2, 2, random_routing());
  PLLEPDispatcher pllep(c.H, c.I, c.E, c.k, world, 1, 3, 1.0, 2);
  Shard first = run_dispatch(c, pllep, world.rank, stream.stream), second = run_dispatch(c, pllep, world.rank, stream.stream);
  EXPECT_EQ(first.out, second.out);
  EXPECT_EQ(first.dx, second.dx);
  EXPECT_EQ(first.dtopk_w, second.dtopk_w);
  EXPECT_EQ(first.dW13, second.dW13);
  EXPECT_EQ(first.dW2, second.dW2);
}

// A layer under --recompute calls the dispatcher's forward twice: once for its output, once
// (out = nullptr) for what backward needs. Every dispatcher's gradients are then bit for bit those
// of one forward + backward; pllep's second forward only plans: it adds nothing to the pool's peak
// beyond what its backward holds.
TEST(LlepDist, RecomputedForwardGivesTheSameGradients) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  testutil::TestStream stream;
  GlobalCase c = make_case(testutil::fresh_seed(), world.size, 41, 64, 40, 2, 2, profile_routing("hot:0.5/2"));
  EPDispatcher ep(c.H, c.I, c.E, c.k, world);
  LLEPDispatcher llep(c.H, c.I, c.E, c.k, world, 1.0, 2);
  PLLEPDispatcher pllep(c.H, c.I, c.E, c.k, world, 1, 3, 1.0, 2);
  for (MoEDispatcher* d : std::vector<MoEDispatcher*>{&ep, &llep, &pllep}) {
    const Shard once = run_dispatch(c, *d, world.rank, stream.stream);
    const Shard twice = run_dispatch(c, *d, world.rank, stream.stream, true);
    const std::string name = d == &ep ? "ep" : d == &llep ? "llep" : "pllep";
    SCOPED_TRACE(name);
    EXPECT_EQ(once.out, twice.out);
    EXPECT_EQ(once.dx, twice.dx);
    EXPECT_EQ(once.dtopk_w, twice.dtopk_w);
    EXPECT_EQ(once.dW13, twice.dW13);
    EXPECT_EQ(once.dW2, twice.dW2);
    printf("[recompute] %-5s rank %d dispatch peak %zu B (one forward) %zu B (forward + recomputation's forward)\n",
           name.c_str(), world.rank, once.dispatch_peak, twice.dispatch_peak);
  }
}
