// tests/cpu_ep_plan.cu — the host side of standard expert parallelism (ops/ep_moe.cuh) and the
// routing profiles (ops/router.cuh), without a GPU: W ∈ {1, 2, 3, 8, 64} ranks are simulated on the
// host. Each rank's sort of its routes by expert (what moe_route_plan computes, checked on the GPU
// in gpu_moe.cu) is a std::stable_sort; the exchange of counts is a transpose; rows "sent" are route
// ids. Checked against ref/ep_moe.hpp's bookkeeping: every route delivered exactly once to its
// expert's owner, what s sends to d is what d receives from s (counts and routes, in order), the
// per-expert receive counts add up, and the expert-major regrouping (ep_recv_row_of_slot, the
// function the device kernel runs) gives the reference's GEMM order. Profiles: the paper's
// definition element by element, ranges, distinctness where the definition gives it, refusals.
#include <algorithm>
#include <numeric>
#include <set>
#include "gpu_util.cuh"
#include "../ops/ep_moe.cuh"
#include "../ops/router.cuh"
#include "../data/routing_profile.hpp"
#include "../ref/ep_moe.hpp"

namespace {

// A simulated EP group: every rank's routing (topk_idx [N·k], global expert ids).
struct SimGroup {
  int ranks, E, k, N;
  std::vector<std::vector<int>> topk_idx;  // [ranks][N·k]
};

// The global topk_idx [ranks·N, k] of the group (rank s's tokens are rows s·N .. s·N + N − 1).
ref::MatI global_topk_idx(const SimGroup& g) {
  ref::MatI m(g.ranks * g.N, g.k);
  for (int s = 0; s < g.ranks; s++)
    for (int i = 0; i < g.N * g.k; i++) m(s * g.N + i / g.k, i % g.k) = g.topk_idx[s][i];
  return m;
}

// Every rank routes by the same profile.
SimGroup profile_group(const RoutingProfile& p, int ranks, int E_l, int k, int N) {
  SimGroup g{ranks, ranks * E_l, k, N, {}};
  for (int s = 0; s < ranks; s++) g.topk_idx.push_back(routing_profile_indices(p, N, g.E, k));
  return g;
}

// Every rank draws its own routes: k experts per token, uniform, repeats allowed.
SimGroup random_group(testutil::Rng& rng, int ranks, int E_l, int k, int N) {
  SimGroup g{ranks, ranks * E_l, k, N, {}};
  for (int s = 0; s < ranks; s++) {
    std::vector<int> idx((size_t)N * k);
    for (int& e : idx) e = rng.integer(0, g.E - 1);
    g.topk_idx.push_back(idx);
  }
  return g;
}

// One rank's side of the forward plan, as the device computes it.
struct SimRank {
  std::vector<int> routes_per_expert;  // [E]
  std::vector<int> route_of_slot;      // [N·k] stable sort of the routes by expert
  EPPlan plan;
};

std::vector<SimRank> simulate_plans(const SimGroup& g) {
  const int E_l = g.E / g.ranks, R = g.N * g.k;
  std::vector<SimRank> sim(g.ranks);
  for (int s = 0; s < g.ranks; s++) {
    const std::vector<int>& idx = g.topk_idx[s];
    sim[s].routes_per_expert.assign(g.E, 0);
    for (int e : idx) sim[s].routes_per_expert[e]++;
    sim[s].route_of_slot.resize(R);
    std::iota(sim[s].route_of_slot.begin(), sim[s].route_of_slot.end(), 0);
    std::stable_sort(sim[s].route_of_slot.begin(), sim[s].route_of_slot.end(),
                     [&](int a, int b) { return idx[a] < idx[b]; });
  }
  for (int d = 0; d < g.ranks; d++) {
    std::vector<long long> received(g.E);  // all_to_all_host: entry s·E_l + l from rank s's d·E_l + l
    for (int s = 0; s < g.ranks; s++)
      for (int l = 0; l < E_l; l++) received[(size_t)s * E_l + l] = sim[s].routes_per_expert[d * E_l + l];
    sim[d].plan = ep_plan(sim[d].routes_per_expert, received, g.ranks);
  }
  return sim;
}

// The rows rank s sends to rank d, as routes: its sorted routes in the block of destination d.
std::vector<ref::EPRoute> sent_block(const SimGroup& g, const std::vector<SimRank>& sim, int s, int d) {
  long long first = 0;
  for (int r = 0; r < d; r++) first += sim[s].plan.send_rows[r];
  std::vector<ref::EPRoute> block;
  for (long long i = first; i < first + sim[s].plan.send_rows[d]; i++) {
    int route = sim[s].route_of_slot[i];
    block.push_back(ref::EPRoute{s, route / g.k, route % g.k});
  }
  return block;
}

std::string route_text(const ref::EPRoute& r) {
  return "(source " + std::to_string(r.source) + ", token " + std::to_string(r.token) + ", slot " +
         std::to_string(r.slot) + ")";
}

// All plan checks of one simulated group; `what` names it in failures.
void check_group(const SimGroup& g, const std::string& what) {
  SCOPED_TRACE(what);
  const int E_l = g.E / g.ranks;
  const ref::MatI global = global_topk_idx(g);
  std::vector<SimRank> sim = simulate_plans(g);
  std::vector<int> deliveries((size_t)g.ranks * g.N * g.k, 0);  // per global route
  for (int d = 0; d < g.ranks; d++) {
    const EPPlan& plan = sim[d].plan;
    ASSERT_EQ(plan.ranks, g.ranks);
    ASSERT_EQ(plan.groups, E_l);
    // what s sends to d = what d receives from s: row counts, then the routes in wire order
    std::vector<ref::EPRoute> wire;
    for (int s = 0; s < g.ranks; s++) {
      EXPECT_EQ(sim[s].plan.send_rows[d], plan.recv_rows[s]) << "rank " << s << " -> rank " << d;
      std::vector<ref::EPRoute> block = sent_block(g, sim, s, d);
      wire.insert(wire.end(), block.begin(), block.end());
    }
    std::vector<ref::EPRoute> as_received = ref::ep_received_routes(global, g.E, g.ranks, d, ref::EPOrder::AsReceived);
    EXPECT_TRUE(wire == as_received) << "rank " << d << ": rows on the wire differ from the reference order";
    EXPECT_EQ(plan.received, (long long)as_received.size()) << "rank " << d;
    // receive counts per local expert add up
    long long expert_sum = 0;
    for (int l = 0; l < E_l; l++) {
      EXPECT_EQ(plan.group_offsets[l], expert_sum) << "rank " << d << " local expert " << l;
      expert_sum += plan.group_rows[l];
    }
    EXPECT_EQ(expert_sum, plan.received) << "rank " << d;
    // regrouping: expert-major slot → received row gives the reference's GEMM order
    const int blocks = E_l * g.ranks;
    std::vector<ref::EPRoute> by_expert;
    for (int slot = 0; slot < (int)plan.received && slot < (int)wire.size(); slot++) {
      int row = ep_recv_row_of_slot(slot, plan.block_slot_offset.data(), plan.block_recv_row.data(), blocks);
      ASSERT_GE(row, 0) << "rank " << d << " slot " << slot;
      ASSERT_LT(row, (int)wire.size()) << "rank " << d << " slot " << slot;
      by_expert.push_back(wire[row]);
    }
    std::vector<ref::EPRoute> expected = ref::ep_received_routes(global, g.E, g.ranks, d, ref::EPOrder::ByExpert);
    ASSERT_EQ(by_expert.size(), expected.size()) << "rank " << d;
    for (size_t p = 0; p < expected.size(); p++)
      ASSERT_TRUE(by_expert[p] == expected[p]) << "rank " << d << " slot " << p << ": " << route_text(by_expert[p])
                                               << " instead of " << route_text(expected[p]);
    // each slot of local expert l holds a route to global expert d·E_l + l
    for (int l = 0; l < E_l; l++)
      for (int p = plan.group_offsets[l]; p < plan.group_offsets[l] + plan.group_rows[l]; p++) {
        const ref::EPRoute& r = by_expert[p];
        EXPECT_EQ(global(r.source * g.N + r.token, r.slot), d * E_l + l) << "rank " << d << " slot " << p;
      }
    for (const ref::EPRoute& r : by_expert) deliveries[((size_t)r.source * g.N + r.token) * g.k + r.slot]++;
  }
  // every route delivered exactly once
  int wrong = 0;
  for (int c : deliveries) wrong += c != 1;
  EXPECT_EQ(wrong, 0) << "routes not delivered exactly once";
}

// The group sizes of the plan tests: E_l = 4 local experts, except W = 3 (E_l = 5), k = 4, N = 37.
struct GroupShape {
  int ranks, E_l;
};
const GroupShape kShapes[] = {{1, 4}, {2, 4}, {3, 5}, {8, 4}, {64, 4}};
const int kTopK = 4, kTokens = 37;

}  // namespace

TEST(EpPlan, EveryProfileEveryGroupSize) {
  for (const GroupShape& shape : kShapes) {
    const std::string all_to_rank0 = "hot:1/" + std::to_string(shape.E_l);  // every expert chosen lives on rank 0
    for (const std::string& name : {std::string("balanced"), std::string("hot:0.25/1"), std::string("hot:0.5/2"),
                                    std::string("hot:1/4"), all_to_rank0}) {
      SimGroup g = profile_group(parse_routing_profile(name), shape.ranks, shape.E_l, kTopK, kTokens);
      check_group(g, "W=" + std::to_string(shape.ranks) + " E=" + std::to_string(g.E) + " " + name);
    }
  }
}

TEST(EpPlan, RandomRoutingDifferentOnEveryRank) {
  testutil::Rng rng;
  for (const GroupShape& shape : kShapes) {
    SimGroup g = random_group(rng, shape.ranks, shape.E_l, kTopK, kTokens);
    check_group(g, "W=" + std::to_string(shape.ranks) + " random routing");
  }
}

// Under "every route to rank 0" rank 0 receives W·N·k routes and its Dispatch peak grows linearly with
// W (the bound standard EP does not have); the others receive nothing. Balanced routing with E | N
// gives every rank exactly N·k.
TEST(EpPlan, ReceiverLoadGrowsWithGroupSizeUnderSkew) {
  const int N = 64, H = 256;
  for (const GroupShape& shape : kShapes) {
    SCOPED_TRACE("W=" + std::to_string(shape.ranks));
    const int E = shape.ranks * shape.E_l;
    std::vector<SimRank> skewed =
        simulate_plans(profile_group(parse_routing_profile("hot:1/" + std::to_string(shape.E_l)), shape.ranks, shape.E_l, kTopK, N));
    EXPECT_EQ(skewed[0].plan.received, (long long)shape.ranks * N * kTopK);
    for (int d = 1; d < shape.ranks; d++) EXPECT_EQ(skewed[d].plan.received, 0) << "rank " << d;
    const long long R = (long long)N * kTopK, R0 = skewed[0].plan.received;
    EXPECT_EQ(ep_moe_dispatch_peak_bytes(R, R0, H, 2), 4 * (2 * R + R0) + (size_t)H * 2 * (R + 3 * R0));
    if (N % E == 0) {
      std::vector<SimRank> balanced = simulate_plans(profile_group(RoutingProfile(), shape.ranks, shape.E_l, kTopK, N));
      for (int d = 0; d < shape.ranks; d++) EXPECT_EQ(balanced[d].plan.received, R) << "balanced, rank " << d;
    }
  }
}

// The layer's peak of Dispatch and ExpertIntermediates together (the per-rank prediction's term): the
// largest of the backward's three moments, never above the two categories' own peaks added, and below
// them by the rows that are not live when the intermediates peak. The model test that found it
// (DistModel.MemoryPredictionHoldsForEachDispatcherAndHead: H = I = 256, N = 2048, k = 2, FP32, every
// route to rank 0) measured the sum of the two peaks 2·R_d·H·b above the pool's at W = 2, 4 and 8.
TEST(EpPlan, LayerPeakIsTheLargestMomentOfTheBackward) {
  for (int W : {1, 2, 4, 8, 64}) {
    const long long R = 2048 * 2, R_d = (long long)W * R;
    const size_t b = 4, maps = 4 * (size_t)(2 * R + R_d);
    const size_t both = ep_moe_dispatch_peak_bytes(R, R_d, 256, b) + ep_moe_intermediates_peak_bytes(R_d, 256, b);
    EXPECT_EQ(ep_moe_layer_peak_bytes(R, R_d, 256, 256, b), both - 2 * (size_t)R_d * 256 * b) << "W=" << W;
    EXPECT_EQ(ep_moe_layer_peak_bytes(R, R_d, 256, 256, b), maps + (size_t)(R + 6 * R_d) * 256 * b) << "W=" << W;
  }
  // rows of H dominate (small I: the Dispatch peak's moment, the saved h13 beside it) or the intermediates
  // do (small H: the dh13 moment, xe and y beside it); never above the two peaks added
  const long long R = 1000, R_d = 3000;
  const size_t b = 2, maps = 4 * (size_t)(2 * R + R_d);
  EXPECT_EQ(ep_moe_layer_peak_bytes(R, R_d, 4096, 8, b), ep_moe_dispatch_peak_bytes(R, R_d, 4096, b) + 2 * (size_t)R_d * 8 * b);
  EXPECT_EQ(ep_moe_layer_peak_bytes(R, R_d, 8, 4096, b), maps + (size_t)(R + R_d) * 8 * b + ep_moe_intermediates_peak_bytes(R_d, 4096, b));
  for (int H : {8, 256, 4096})
    for (int I : {8, 256, 4096})
      EXPECT_LE(ep_moe_layer_peak_bytes(R, R_d, H, I, b),
                ep_moe_dispatch_peak_bytes(R, R_d, H, b) + ep_moe_intermediates_peak_bytes(R_d, I, b))
          << "H=" << H << " I=" << I;
}

TEST(EpPlan, RefusesCountsThatDoNotFit) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(ep_plan({1, 2, 3}, {1, 2, 3}, 2), "ep_plan \\(ranks=2 E=3 received_entries=3\\)");
  EXPECT_DEATH(ep_plan({1, 2, 3, 4}, {1, 2, 3}, 2), "ep_plan \\(ranks=2 E=4 received_entries=3\\)");
  EXPECT_DEATH(ep_plan({1, 2, 3, 4}, {1, -2, 3, 4}, 2), "ep_plan.*negative route count");
}

// ---------------------------------------------------------------------------------------------
// Routing profiles

TEST(RoutingProfile, MatchesThePaperDefinition) {
  struct Case {
    const char* name;
    int N, E, k;
  };
  const Case cases[] = {{"balanced", 37, 8, 4},   {"balanced", 10, 3, 3},  {"hot:0.25/1", 37, 8, 4},
                        {"hot:0.5/2", 37, 8, 4},  {"hot:1/4", 37, 8, 4},   {"hot:0.3/16", 100, 64, 8},
                        {"hot:0.95/16", 50, 32, 4}, {"hot:0.5/2", 20, 4, 3}, {"hot:0/3", 11, 6, 2},
                        {"hot:1/8", 13, 8, 2}};
  for (const Case& c : cases) {
    SCOPED_TRACE(std::string(c.name) + " N=" + std::to_string(c.N) + " E=" + std::to_string(c.E) + " k=" + std::to_string(c.k));
    RoutingProfile p = parse_routing_profile(c.name);
    std::vector<int> idx = routing_profile_indices(p, c.N, c.E, c.k);
    ASSERT_EQ(idx.size(), (size_t)c.N * c.k);
    const int hot = p.kind == RoutingProfile::Hot ? (int)std::floor(p.r * c.N + 1e-9) : 0;
    EXPECT_EQ(routing_profile_hot_tokens(p, c.N), hot);
    for (int i = 0; i < c.N; i++) {
      std::set<int> distinct;
      for (int j = 0; j < c.k; j++) {
        int e = idx[(size_t)i * c.k + j];
        int expected = p.kind == RoutingProfile::Balanced ? (i + j) % c.E
                       : i < hot                          ? j % p.h
                                                          : p.h + (i + j) % (c.E - p.h);
        ASSERT_EQ(e, expected) << "token " << i << " slot " << j;
        ASSERT_GE(e, 0);
        ASSERT_LT(e, c.E);
        distinct.insert(e);
      }
      // distinct experts: k wherever the definition has room for k, min(k, h) on a hot token
      if (p.kind == RoutingProfile::Balanced) EXPECT_EQ((int)distinct.size(), std::min(c.k, c.E)) << "token " << i;
      else if (i < hot) EXPECT_EQ((int)distinct.size(), std::min(c.k, p.h)) << "token " << i;
      else EXPECT_EQ((int)distinct.size(), std::min(c.k, c.E - p.h)) << "token " << i;
    }
  }
}

TEST(RoutingProfile, HotTokenCountIsFloorOfTheWrittenFraction) {
  EXPECT_EQ(routing_profile_hot_tokens(parse_routing_profile("hot:0.29/2"), 100), 29);  // 0.29·100 = 28.999… in binary
  EXPECT_EQ(routing_profile_hot_tokens(parse_routing_profile("hot:0.7/2"), 10), 7);
  EXPECT_EQ(routing_profile_hot_tokens(parse_routing_profile("hot:0.25/2"), 37), 9);
  EXPECT_EQ(routing_profile_hot_tokens(parse_routing_profile("hot:.5/2"), 37), 18);
  EXPECT_EQ(routing_profile_hot_tokens(parse_routing_profile("hot:1/2"), 37), 37);
  EXPECT_EQ(routing_profile_hot_tokens(parse_routing_profile("hot:0/2"), 37), 0);
  EXPECT_EQ(routing_profile_hot_tokens(parse_routing_profile("balanced"), 37), 0);
}

TEST(RoutingProfile, ParsesAndNamesProfiles) {
  RoutingProfile b = parse_routing_profile("balanced");
  EXPECT_EQ(b.kind, RoutingProfile::Balanced);
  RoutingProfile h = parse_routing_profile("hot:0.5/2");
  EXPECT_EQ(h.kind, RoutingProfile::Hot);
  EXPECT_EQ(h.r, 0.5);
  EXPECT_EQ(h.h, 2);
  for (const char* name : {"balanced", "hot:0.25/1", "hot:0.5/2", "hot:1/4", "hot:0.95/16", "hot:0/3"})
    EXPECT_EQ(routing_profile_name(parse_routing_profile(name)), name);
}

TEST(RoutingProfile, RefusesBadSpellings) {
  for (const char* bad : {"", "Balanced", "balanced ", "hot", "hot:", "hot:0.5", "hot:0.5/", "hot:/2", "hot:./2",
                          "hot:1.5/2", "hot:-0.5/2", "hot:+0.5/2", "hot:0.5/0", "hot:0.5/-1", "hot:0.5/2x",
                          "hot:0.5/2.0", "hot:1e-1/2", "hot:nan/2", "hot:inf/2", "hot:0.5.1/2", "hot: 0.5/2",
                          "hot:0.5/ 2", "cold:0.5/2", "hot:0.5/2/3", "hot:0.5/99999999999"}) {
    try {
      parse_routing_profile(bad);
      ADD_FAILURE() << "accepted '" << bad << "'";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(std::string("'") + bad + "'"), std::string::npos)
          << "message does not name the spelling: " << e.what();
    }
  }
}

TEST(RoutingProfile, RefusesSizesTheProfileCannotFill) {
  EXPECT_THROW(routing_profile_indices(parse_routing_profile("hot:0.5/9"), 10, 8, 2), std::invalid_argument);  // h > E
  EXPECT_THROW(routing_profile_indices(parse_routing_profile("hot:0.5/8"), 10, 8, 2), std::invalid_argument);  // no cold expert
  EXPECT_NO_THROW(routing_profile_indices(parse_routing_profile("hot:1/8"), 10, 8, 2));  // every token hot
  EXPECT_THROW(routing_profile_indices(RoutingProfile(), 10, 0, 2), std::invalid_argument);
  EXPECT_THROW(routing_profile_indices(RoutingProfile(), 10, 8, 0), std::invalid_argument);
}
