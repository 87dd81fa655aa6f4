// tests/cpu_relay_plan.cu — the host side of RelayMoE (ops/relay_moe.cuh), without a GPU: the ring's
// schedule and the mode choice, against the twin ref/relay_moe.hpp, which runs the ring hop by hop
// (each rank handing what travels to its right neighbour) in double precision.
//   - The twin, both modes, E_p ∈ {1, 2, 3, 5}, unequal token counts (0 included): every route
//     computed exactly once; each rank's out, dx, dtopk_w and its experts' dW13, dW2 equal the MoE
//     over the global batch (ref/moe.hpp); at every hop, what a rank holds is the plan's
//     relay_visitor, the expert-mode weight-gradient accumulator is where relay_accumulator_rank says
//     and ends at its owner; the bytes each hop moves are the plan's per-hop volumes.
//   - The plan alone for E_p up to 64: every (token, expert) pair meets at exactly one hop, in both
//     modes; what rank r holds at hop h is what rank r+1 holds at hop h+1.
//   - The adaptive choice on both sides of its crossover, for several shapes.
// Fresh routings every run (FLATMOE_SEED replays a run).
#include <algorithm>
#include <map>
#include "test_util.hpp"
#include "../ops/relay_moe.cuh"
#include "../ref/relay_moe.hpp"

namespace {

using Mat = ref::Mat<double>;

// A group's inputs: rank r holds N_r tokens (x, routing, dout); every expert's weights.
struct RingCase {
  int ranks = 0, H = 0, I = 0, E = 0, k = 0;
  std::vector<Mat> x, topk_w, dout, W13, W2;
  std::vector<ref::MatI> topk_idx;
};

RingCase make_ring_case(testutil::Rng& rng, int ranks, int E_l, int k, int H, int I) {
  RingCase c;
  c.ranks = ranks;
  c.H = H;
  c.I = I;
  c.E = ranks * E_l;
  c.k = k;
  for (int e = 0; e < c.E; e++) {
    c.W13.push_back(rng.mat<double>(2 * I, H, 0.5));
    c.W2.push_back(rng.mat<double>(H, I, 0.5));
  }
  for (int r = 0; r < ranks; r++) {
    const int N = r == 1 ? 0 : rng.integer(1, 9);  // rank 1 (when there is one) holds no tokens
    c.x.push_back(rng.mat<double>(N, H));
    c.dout.push_back(rng.mat<double>(N, H));
    c.topk_w.push_back(rng.mat<double>(N, k));
    ref::MatI idx(N, k);
    for (int n = 0; n < N; n++)
      for (int j = 0; j < k; j++) idx(n, j) = rng.integer(0, c.E - 1);  // repeats allowed: a token may pick an expert twice
    c.topk_idx.push_back(idx);
  }
  return c;
}

// The global batch (ranks' tokens one after the other) through ref/moe.hpp; each rank's rows and
// experts compared with the ring's shard.
void expect_shards_match_the_global_moe(const RingCase& c, const ref::RelayRun<double>& run, const std::string& name) {
  int total = 0;
  for (const Mat& x : c.x) total += (int)x.rows();
  Mat x(total, c.H), dout(total, c.H), w(total, c.k);
  ref::MatI idx(total, c.k);
  std::vector<int> first;
  for (int r = 0, row = 0; r < c.ranks; row += (int)c.x[r].rows(), r++) {
    first.push_back(row);
    x.middleRows(row, c.x[r].rows()) = c.x[r];
    dout.middleRows(row, c.x[r].rows()) = c.dout[r];
    w.middleRows(row, c.x[r].rows()) = c.topk_w[r];
    idx.middleRows(row, c.x[r].rows()) = c.topk_idx[r];
  }
  const Mat out = ref::moe_forward(x, idx, w, c.W13, c.W2);
  const ref::MoEGrads<double> g = ref::moe_backward(dout, x, idx, w, c.W13, c.W2);
  const int E_l = c.E / c.ranks;
  double worst = 0;
  for (int r = 0; r < c.ranks; r++) {
    const int N = (int)c.x[r].rows();
    const ref::EPShard<double>& s = run.shards[r];
    worst = std::max({worst, testutil::rel_err(s.out, Mat(out.middleRows(first[r], N))),
                      testutil::rel_err(s.dx, Mat(g.dx.middleRows(first[r], N))),
                      testutil::rel_err(s.dtopk_w, Mat(g.dtopk_w.middleRows(first[r], N)))});
    for (int l = 0; l < E_l; l++)
      worst = std::max({worst, testutil::rel_err(s.dW13[l], g.dW13[r * E_l + l]), testutil::rel_err(s.dW2[l], g.dW2[r * E_l + l])});
  }
  EXPECT_REL(name.c_str(), "all shards", worst, 1e-12);
}

}  // namespace

// The twin's ring, both modes: exact, every route once, and where everything is at every hop.
TEST(RelayPlan, RingMatchesItsTwinHopByHop) {
  testutil::Rng rng;
  const size_t b = 2, b_acc = 4;  // BF16 rows and weights, FP32 accumulators: the volumes' element sizes
  for (int ranks : {1, 2, 3, 5})
    for (int E_l : {1, 3})
      for (int k : {1, 2, 4}) {
        const RingCase c = make_ring_case(rng, ranks, E_l, k, 8, 6);
        const std::string label = "E_p=" + std::to_string(ranks) + " E_l=" + std::to_string(E_l) + " k=" + std::to_string(k);
        SCOPED_TRACE(label);
        for (RelayMode mode : {RelayMode::Expert, RelayMode::Token}) {
          const ref::RelayRun<double> run = mode == RelayMode::Expert
                                                ? ref::relay_expert_mode(c.x, c.topk_idx, c.topk_w, c.dout, c.W13, c.W2)
                                                : ref::relay_token_mode(c.x, c.topk_idx, c.topk_w, c.dout, c.W13, c.W2);
          const std::string name = std::string("relay ") + relay_mode_name(mode) + " " + label;
          expect_shards_match_the_global_moe(c, run, name);
          for (int r = 0; r < ranks; r++)
            for (int times : run.computed[r]) EXPECT_EQ(times, 1) << name << " rank " << r;
          ASSERT_EQ(run.forward.size(), (size_t)ranks * ranks);
          ASSERT_EQ(run.backward.size(), (size_t)ranks * ranks);
          for (size_t i = 0; i < run.forward.size(); i++) {
            const ref::RelayHop &f = run.forward[i], &bw = run.backward[i];
            EXPECT_EQ(f.visitor, relay_visitor(f.rank, f.hop, ranks)) << name;
            EXPECT_EQ(bw.visitor, relay_visitor(bw.rank, bw.hop, ranks)) << name;
            if (mode == RelayMode::Expert) {
              // a partition's W13 and W2 go on after every hop but the last; its accumulator is added to
              // where its weights are, and goes on after every hop
              EXPECT_EQ(bw.rank, relay_accumulator_rank(bw.visitor, bw.hop, ranks)) << name;
              const long long moved = f.hop + 1 < ranks ? relay_expert_hop_bytes(E_l, c.H, c.I, b) : 0;
              EXPECT_EQ(f.weight_elems * (long long)b, moved) << name << " rank " << f.rank << " hop " << f.hop;
            } else {
              // a block goes on after every hop (the last pass takes it home): rows, accumulator, routing
              const long long N = c.x[f.visitor].rows();
              EXPECT_EQ(f.row_elems * (long long)b + f.acc_elems * (long long)b_acc + f.routing_pairs * 8,
                        relay_token_hop_bytes(N, c.H, c.k, b, b_acc))
                  << name << " rank " << f.rank << " hop " << f.hop;
            }
          }
        }
      }
  for (int p = 0; p < 5; p++) EXPECT_EQ(relay_next(relay_accumulator_rank(p, 4, 5), 5), p);
}

// The plan alone, up to 64 ranks: every (token, expert) pair meets at exactly one hop.
TEST(RelayPlan, EveryRouteMeetsItsExpertAtExactlyOneHop) {
  testutil::Rng rng;
  for (int ranks : {1, 2, 3, 7, 8, 16, 63, 64})
    for (int E_l : {1, 4})
      for (int k : {1, 4, 8}) {
        std::vector<std::vector<int>> topk_idx(ranks);
        for (int r = 0; r < ranks; r++) {
          const int N = rng.integer(0, 12);
          for (int i = 0; i < N * k; i++) topk_idx[r].push_back(rng.integer(0, ranks * E_l - 1));
        }
        std::vector<std::vector<int>> expert_mode(ranks), token_mode(ranks);  // times each route is computed
        for (int r = 0; r < ranks; r++) {
          expert_mode[r].assign(topk_idx[r].size(), 0);
          token_mode[r].assign(topk_idx[r].size(), 0);
        }
        for (int hop = 0; hop < ranks; hop++)
          for (int r = 0; r < ranks; r++) {
            const int visitor = relay_visitor(r, hop, ranks);
            if (hop + 1 < ranks) EXPECT_EQ(relay_visitor(relay_next(r, ranks), hop + 1, ranks), visitor);
            EXPECT_EQ(relay_visitor(relay_prev(r, ranks), hop, ranks), relay_prev(visitor, ranks));
            for (int route : relay_hop_routes(topk_idx[r], visitor, E_l)) expert_mode[r][route]++;      // r's tokens, visiting experts
            for (int route : relay_hop_routes(topk_idx[visitor], r, E_l)) token_mode[visitor][route]++;  // visiting tokens, r's experts
          }
        for (int r = 0; r < ranks; r++)
          for (size_t route = 0; route < topk_idx[r].size(); route++) {
            EXPECT_EQ(expert_mode[r][route], 1) << "expert mode E_p=" << ranks << " rank " << r << " route " << route;
            EXPECT_EQ(token_mode[r][route], 1) << "token mode E_p=" << ranks << " rank " << r << " route " << route;
          }
      }
}

// auto: the mode whose hop moves fewer bytes, on both sides of the crossover
// N* = E_l·3·H·I·b / (H·b + H·b_acc + 8k); forced modes stay forced; anything else is refused.
TEST(RelayPlan, AutoPicksTheSmallerPerHopVolume) {
  struct Shape {
    int H, I, E_l, k;
  };
  for (const Shape& s : {Shape{2048, 1408, 8, 4}, Shape{768, 512, 16, 4}, Shape{4096, 1536, 4, 8}, Shape{64, 48, 1, 2}}) {
    const size_t b = 2, b_acc = 4;
    const long long expert = relay_expert_hop_bytes(s.E_l, s.H, s.I, b);
    const long long per_token = (long long)s.H * b + (long long)s.H * b_acc + 8LL * s.k;
    const long long crossover = expert / per_token;  // N*·per_token ≤ expert < (N* + 1)·per_token
    for (long long N : {crossover - 1, crossover, crossover + 1, crossover + 2}) {
      if (N < 0) continue;
      const RelayChoice choice = relay_choose("auto", N, s.H, s.I, s.E_l, s.k, b, b_acc);
      EXPECT_EQ(choice.expert_bytes, expert);
      EXPECT_EQ(choice.token_bytes, N * per_token);
      EXPECT_EQ(choice.mode, N * per_token < expert ? RelayMode::Token : RelayMode::Expert) << "N=" << N;
      printf("[relay] H=%d I=%d E_l=%d k=%d N=%lld: experts %lld B/hop, tokens %lld B/hop -> %s\n", s.H, s.I, s.E_l, s.k,
             N, choice.expert_bytes, choice.token_bytes, relay_mode_name(choice.mode));
    }
    EXPECT_EQ(relay_choose("auto", crossover - 1, s.H, s.I, s.E_l, s.k, b, b_acc).mode, RelayMode::Token);
    EXPECT_EQ(relay_choose("auto", crossover + 1, s.H, s.I, s.E_l, s.k, b, b_acc).mode, RelayMode::Expert);
    EXPECT_EQ(relay_choose("token", 1 << 30, s.H, s.I, s.E_l, s.k, b, b_acc).mode, RelayMode::Token);
    EXPECT_EQ(relay_choose("expert", 0, s.H, s.I, s.E_l, s.k, b, b_acc).mode, RelayMode::Expert);
  }
  EXPECT_DEATH(relay_choose("ring", 16, 64, 48, 1, 2, 2, 4), "relay_choose.*expert, token or auto");
}

// The GPU schedule's hop: the sorted slots of partition p's experts (relay_hop_slice, from the
// per-expert counts of a stable sort by expert) are exactly the plan's routes of that hop
// (relay_hop_routes), as a set (a slice is in expert order), and the hops cover the R routes once. The live-set closed
// form (relay_expert_live_bytes) under adversarial routing for E_p up to 64: every route of a rank to
// one expert gives R_max = R, and the form never depends on what the other ranks route (no R_d term):
// its largest hop holds at most R rows, whatever E_p.
TEST(RelayPlan, HopSlicesAreThePlansRoutesAndTheLiveSetIsBoundedByTheRanksOwnRoutes) {
  testutil::Rng rng;
  for (int ranks : {1, 2, 3, 8, 64})
    for (int E_l : {1, 3})
      for (int k : {1, 4}) {
        const int E = ranks * E_l, N = rng.integer(0, 40);
        for (int profile = 0; profile < 3; profile++) {  // random, every route to expert 0, every route to the last partition
          std::vector<int> idx;
          for (int i = 0; i < N * k; i++)
            idx.push_back(profile == 0 ? rng.integer(0, E - 1) : profile == 1 ? 0 : E - 1 - (i % E_l));
          std::vector<int> counts(E, 0), sorted;  // the stable sort by expert: route indices in slot order
          for (int e : idx) counts[e]++;
          for (int e = 0; e < E; e++)
            for (int r = 0; r < N * k; r++)
              if (idx[r] == e) sorted.push_back(r);
          long long covered = 0, largest = 0;
          for (int p = 0; p < ranks; p++) {
            const RelayHopSlice slice = relay_hop_slice(counts, p, E_l);
            const std::vector<int> routes = relay_hop_routes(idx, p, E_l);
            ASSERT_EQ(slice.count, (int)routes.size()) << "E_p=" << ranks << " partition " << p;
            std::vector<int> in_slice(sorted.begin() + slice.first, sorted.begin() + slice.first + slice.count);
            std::sort(in_slice.begin(), in_slice.end());
            EXPECT_EQ(in_slice, routes) << "E_p=" << ranks << " partition " << p;
            for (int l = 0; l < E_l; l++) {
              EXPECT_EQ(slice.counts[l], counts[p * E_l + l]);
              EXPECT_EQ(slice.offsets[l], l == 0 ? 0 : slice.offsets[l - 1] + slice.counts[l - 1]);
            }
            covered += slice.count;
            largest = std::max<long long>(largest, slice.count);
          }
          EXPECT_EQ(covered, (long long)N * k);
          EXPECT_EQ(relay_max_hop_routes(counts, E_l), largest);
          if (profile > 0) EXPECT_EQ(largest, (long long)N * k) << "skewed routing: one hop holds every route";
          const int H = 64, I = 48;
          for (size_t b : {(size_t)2, (size_t)4})
            for (bool backward : {false, true}) {
              const RelayLiveBytes live = relay_expert_live_bytes(backward, N, k, largest, H, I, E_l, ranks, b);
              const RelayLiveBytes worst = relay_expert_live_bytes(backward, N, k, (long long)N * k, H, I, E_l, ranks, b);
              EXPECT_LE(live.total(), worst.total());
              const size_t partition = (size_t)E_l * 3 * H * I * b, rows = (size_t)N * k * H * b;
              // at most: the route maps, two (backward) row buffers of the rank's own routes, five of I,
              // two visiting partitions (+ two accumulators in backward) and the fp32 output accumulator
              EXPECT_LE(worst.total(), 8 * (size_t)N * k + 2 * rows + 5 * (size_t)N * k * I * b + 4 * partition +
                                           (size_t)N * H * 4);
            }
        }
      }
}

// Token mode's live set (relay_token_live_bytes) for E_p up to 64: rank r's largest hop is the most
// routes of one visiting block to r's experts (the plan's relay_hop_routes of that block); under the
// skew of every route to expert 0, rank 0's hops hold whole blocks (R_max = N_max·k) and every other
// rank computes nothing (its Dispatch holds only a block's route maps); the staging (two block slots,
// two accumulators) depends on N_max and not on the routing; and from E_p = 3 on nothing in backward grows
// with E_p.
TEST(RelayPlan, TokenModeLiveSetFollowsTheLargestVisitingBlock) {
  testutil::Rng rng;
  const int H = 64, I = 48;
  for (int ranks : {2, 3, 8, 64})
    for (int E_l : {1, 3})
      for (int k : {1, 4})
        for (bool skewed : {false, true}) {
          const int E = ranks * E_l;
          std::vector<std::vector<int>> idx(ranks);
          long long N_max = 0;
          for (int s = 0; s < ranks; s++) {
            const int N = rng.integer(0, 30);
            N_max = std::max<long long>(N_max, N);
            for (int i = 0; i < N * k; i++) idx[s].push_back(skewed ? 0 : rng.integer(0, E - 1));
          }
          for (int r = 0; r < ranks; r++) {
            long long R_max = 0;
            for (int hop = 0; hop < ranks; hop++)
              R_max = std::max<long long>(R_max, relay_hop_routes(idx[relay_visitor(r, hop, ranks)], r, E_l).size());
            if (skewed) EXPECT_EQ(R_max, r == 0 ? N_max * k : 0) << "E_p=" << ranks << " rank " << r;
            for (size_t b : {(size_t)2, (size_t)4})
              for (bool backward : {false, true}) {
                const RelayLiveBytes live = relay_token_live_bytes(backward, N_max, k, R_max, H, I, ranks, b);
                const RelayLiveBytes whole = relay_token_live_bytes(backward, N_max, k, N_max * k, H, I, ranks, b);
                EXPECT_LE(live.total(), whole.total());
                EXPECT_EQ(live.staging, whole.staging);
                if (skewed && r > 0) {
                  EXPECT_EQ(live.dispatch, 8 * (size_t)N_max * k);
                  EXPECT_EQ(live.intermediates, 0u);
                }
                if (ranks >= 3 && backward) {  // (the forward's exchange of the sizes stages 16·E_p bytes)
                  const RelayLiveBytes more = relay_token_live_bytes(backward, N_max, k, R_max, H, I, 2 * ranks, b);
                  EXPECT_EQ(more.total(), live.total()) << "E_p=" << ranks;
                }
              }
          }
        }
}
