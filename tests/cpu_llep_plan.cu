// tests/cpu_llep_plan.cu — the host side of LLEP (ops/llep.cuh) and PipelinedLLEP
// (ops/pipelined_llep.cuh), without a GPU: EP groups of E_p ∈ {1, 2, 3, 5, 8, 12, 63, 64} ranks are
// simulated on the host, each rank with its own token count N_r (0 included) and its own routing
// (topk_idx). Routings: the paper's profiles (balanced, hot:r/h), every route to one expert, every
// route to one rank's experts, empty ranks, random skew; drawn afresh every run (FLATMOE_SEED replays
// a run). For α ∈ {1.0, 1.1} and min_rows from 1 to beyond any expert's routes, each plan is checked:
//   - against its twin ref/llep.hpp: the rank of every route of every expert's list, the capacity, the
//     rows per (source, destination), the weight transfers;
//   - every route placed exactly once (walking each source's routes in order), pieces that tile each
//     expert's list on distinct ranks, per-piece rows per source;
//   - the capacity rule, replayed piece by piece in placement order: see check_capacity_rule;
//   - every rank's load ≤ llep_receive_bound = min(T, cap + min_rows − 1), ≤ cap when min_rows = 1;
//   - the same plan on every rank, each rank planning from its own copy of the all-gathered counts.
// PipelinedLLEP: K and c_eff against ref/pipelined_llep.hpp, every token in exactly one chunk, each
// chunk's plan checked as above, and every chunk's receive count ≤ E_p·k·c_eff (paper Eq. 1).
// [plan] lines print the measured loads next to their bounds.
#include <algorithm>
#include <array>
#include <numeric>
#include "test_util.hpp"
#include "../ops/pipelined_llep.cuh"
#include "../data/routing_profile.hpp"
#include "../ref/llep.hpp"
#include "../ref/pipelined_llep.hpp"

namespace {

// A simulated EP group: every rank's routing, topk_idx [N_r·k] (global expert ids, slot j of token n
// at n·k + j). N_r may differ between ranks and be 0.
struct RaggedGroup {
  std::string routing;  // names the case in failures and [plan] lines
  int ranks = 0, E = 0, k = 0;
  std::vector<std::vector<int>> topk_idx;
  std::vector<int> tokens_per_rank() const {
    std::vector<int> tokens;
    for (const std::vector<int>& idx : topk_idx) tokens.push_back((int)idx.size() / k);
    return tokens;
  }
};

// counts[s][e]: routes of source s to expert e, each source counting its own routes.
std::vector<std::vector<long long>> count_matrix(const RaggedGroup& g) {
  std::vector<std::vector<long long>> counts(g.ranks, std::vector<long long>(g.E, 0));
  for (int s = 0; s < g.ranks; s++)
    for (int e : g.topk_idx[s]) counts[s][e]++;
  return counts;
}

// The all-gather of the counts as llep_plan takes it: [E_p·E], source-major.
std::vector<long long> gathered(const std::vector<std::vector<long long>>& counts) {
  std::vector<long long> flat;
  for (const std::vector<long long>& row : counts) flat.insert(flat.end(), row.begin(), row.end());
  return flat;
}

// Standard EP's receive count: the most routes that any rank's own experts get.
long long ep_max_received(const std::vector<std::vector<long long>>& counts) {
  const int ranks = (int)counts.size(), E_l = (int)counts[0].size() / ranks;
  long long most = 0;
  for (int d = 0; d < ranks; d++) {
    long long load = 0;
    for (const std::vector<long long>& row : counts)
      for (int l = 0; l < E_l; l++) load += row[d * E_l + l];
    most = std::max(most, load);
  }
  return most;
}

// ---------------------------------------------------------------------------------------------
// Routings

struct LlepGroupShape {
  int ranks, E_l;
};
const LlepGroupShape kLlepShapes[] = {{1, 4}, {2, 4}, {3, 5}, {5, 2}, {8, 4}, {12, 3}, {63, 1}, {64, 4}};
const int kLlepTopK = 4, kMaxTokens = 48;

// N_r for every rank, drawn in [max_tokens/2, max_tokens].
std::vector<int> drawn_tokens(testutil::Rng& rng, int ranks, int max_tokens) {
  std::vector<int> tokens(ranks);
  for (int& N : tokens) N = rng.integer(max_tokens / 2, max_tokens);
  return tokens;
}

RaggedGroup empty_group(const std::string& routing, const LlepGroupShape& shape) {
  RaggedGroup g;
  g.routing = routing;
  g.ranks = shape.ranks;
  g.E = shape.ranks * shape.E_l;
  g.k = kLlepTopK;
  return g;
}

// Every rank routes by the profile over its own N_r tokens.
RaggedGroup profile_group(const std::string& name, testutil::Rng& rng, const LlepGroupShape& shape) {
  RaggedGroup g = empty_group(name, shape);
  const RoutingProfile p = parse_routing_profile(name);
  for (int N : drawn_tokens(rng, g.ranks, kMaxTokens)) g.topk_idx.push_back(routing_profile_indices(p, N, g.E, g.k));
  return g;
}

// Each route's expert drawn by `pick` (called once per route).
template <typename Pick>
RaggedGroup drawn_group(const std::string& routing, const LlepGroupShape& shape, const std::vector<int>& tokens, Pick pick) {
  RaggedGroup g = empty_group(routing, shape);
  for (int N : tokens) {
    std::vector<int> idx((size_t)N * g.k);
    for (int& e : idx) e = pick();
    g.topk_idx.push_back(idx);
  }
  return g;
}

// Every route of every rank to one expert, drawn.
RaggedGroup one_expert_group(testutil::Rng& rng, const LlepGroupShape& shape) {
  const int expert = rng.integer(0, shape.ranks * shape.E_l - 1);
  return drawn_group("one expert (" + std::to_string(expert) + ")", shape, drawn_tokens(rng, shape.ranks, kMaxTokens),
                     [&] { return expert; });
}

// Every route to the experts of one rank, drawn; each route picks one of them.
RaggedGroup one_rank_group(testutil::Rng& rng, const LlepGroupShape& shape) {
  const int rank = rng.integer(0, shape.ranks - 1);
  return drawn_group("one rank (" + std::to_string(rank) + ")", shape, drawn_tokens(rng, shape.ranks, kMaxTokens),
                     [&] { return rank * shape.E_l + rng.integer(0, shape.E_l - 1); });
}

// About half of the ranks hold no token (with E_p = 1, the only rank: no route at all); the others
// route uniformly.
RaggedGroup empty_ranks_group(testutil::Rng& rng, const LlepGroupShape& shape) {
  std::vector<int> tokens = drawn_tokens(rng, shape.ranks, kMaxTokens);
  for (int& N : tokens)
    if (shape.ranks == 1 || rng.integer(0, 1) == 0) N = 0;
  const int E = shape.ranks * shape.E_l;
  return drawn_group("empty ranks", shape, tokens, [&] { return rng.integer(0, E - 1); });
}

// Every route to the experts of one rank that holds no token itself; about half of the others hold
// none either.
RaggedGroup to_empty_rank_group(testutil::Rng& rng, const LlepGroupShape& shape) {
  const int target = rng.integer(0, shape.ranks - 1);
  std::vector<int> tokens = drawn_tokens(rng, shape.ranks, kMaxTokens);
  for (int r = 0; r < shape.ranks; r++)
    if (r == target || rng.integer(0, 1) == 0) tokens[r] = 0;
  return drawn_group("to empty rank " + std::to_string(target), shape, tokens,
                     [&] { return target * shape.E_l + rng.integer(0, shape.E_l - 1); });
}

// A random power-law skew: expert rank u³ of a random permutation of the experts, u uniform in [0, 1).
RaggedGroup skewed_group(testutil::Rng& rng, const LlepGroupShape& shape) {
  const int E = shape.ranks * shape.E_l;
  std::vector<int> permutation(E);
  std::iota(permutation.begin(), permutation.end(), 0);
  std::shuffle(permutation.begin(), permutation.end(), rng.gen);
  return drawn_group("random skew", shape, drawn_tokens(rng, shape.ranks, kMaxTokens), [&] {
    const double u = rng.uniform(0, 1);
    return permutation[std::min(E - 1, (int)(u * u * u * E))];
  });
}

// Every routing of the tests for one group shape.
std::vector<RaggedGroup> adversarial_groups(testutil::Rng& rng, const LlepGroupShape& shape) {
  std::vector<RaggedGroup> groups;
  for (const char* profile : {"balanced", "hot:0.25/1", "hot:0.5/2", "hot:1/4"})
    groups.push_back(profile_group(profile, rng, shape));
  groups.push_back(one_expert_group(rng, shape));
  groups.push_back(one_rank_group(rng, shape));
  groups.push_back(empty_ranks_group(rng, shape));
  groups.push_back(to_empty_rank_group(rng, shape));
  groups.push_back(skewed_group(rng, shape));
  return groups;
}

// min_rows: none, small, drawn, and beyond any expert's routes (every overflow one piece).
std::vector<long long> min_rows_values(testutil::Rng& rng) { return {1, 2, rng.integer(3, 64), 1000000}; }

std::string case_name(const RaggedGroup& g, double alpha, long long min_rows) {
  return "W=" + std::to_string(g.ranks) + " E=" + std::to_string(g.E) + " " + g.routing +
         " alpha=" + std::to_string(alpha).substr(0, 4) + " min_rows=" + std::to_string(min_rows);
}

// ---------------------------------------------------------------------------------------------
// Checks of one plan

// The capacity rule, replayed in placement order (experts by count descending, ties by lower id) with
// every rank's effective load eff(r) = routes placed on r + routes of r's own experts not placed yet
// (the expert being placed excluded) and room(r) = cap − eff(r). "Held" means, piece by piece:
//   home piece    first, on the home, exactly min(C_e, max(0, room(home))): the home is filled up to
//                 cap and never above it, before any helper gets a route of the expert;
//   helper piece  on a rank ≠ home of least eff (ties: lower rank); ≥ min_rows routes unless it is
//                 the expert's last; within cap it takes all the helper's room or all that is left;
//                 above cap only where the helper's room (≥ 1) is below min_rows, and then it is
//                 min_rows routes or all that is left (so above cap by less than min_rows);
// and at the end every rank's load ≤ cap + min_rows − 1 (≤ cap when min_rows = 1).
void check_capacity_rule(const LLEPPlan& plan) {
  const int ranks = plan.ranks, E_l = plan.local_experts;
  const long long cap = plan.capacity;
  std::vector<long long> placed(ranks, 0), pending(ranks, 0);
  for (int e = 0; e < plan.experts; e++) pending[e / E_l] += plan.expert_routes[e];
  auto eff = [&](int r) { return placed[r] + pending[r]; };
  std::vector<int> order;
  for (int e = 0; e < plan.experts; e++)
    if (plan.expert_routes[e] > 0) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return plan.expert_routes[a] > plan.expert_routes[b]; });
  for (int e : order) {
    SCOPED_TRACE("expert " + std::to_string(e));
    const int home = e / E_l, first = plan.expert_first_piece[e], last = plan.expert_first_piece[e + 1];
    const long long routes = plan.expert_routes[e];
    pending[home] -= routes;
    const long long home_rows = std::min(routes, std::max(0LL, cap - eff(home)));
    int p = first;
    if (home_rows > 0) {
      ASSERT_LT(p, last);
      EXPECT_EQ(plan.pieces[p].rank, home);
      EXPECT_EQ(plan.pieces[p].end - plan.pieces[p].start, home_rows) << "the home is filled up to cap";
      placed[home] += plan.pieces[p].end - plan.pieces[p].start;
      p++;
    }
    if (p < last) {
      EXPECT_GE(eff(home), cap) << "a helper got routes while the home had room";
    }
    for (; p < last; p++) {
      const LLEPPiece& piece = plan.pieces[p];
      const long long rows = piece.end - piece.start, remaining = routes - piece.start, room = cap - eff(piece.rank);
      int least = -1;
      for (int r = 0; r < ranks; r++)
        if (r != home && (least < 0 || eff(r) < eff(least))) least = r;
      EXPECT_EQ(piece.rank, least) << "piece " << p - first << " not on the least-loaded helper";
      if (p + 1 < last) {
        EXPECT_GE(rows, plan.min_rows) << "a helper piece below min_rows that is not the last";
      }
      if (rows > room) {  // above cap: only as far as min_rows forces
        EXPECT_GE(room, 1) << "the least-loaded helper had no room";
        EXPECT_LT(room, plan.min_rows) << "above cap with room for a min_rows piece";
        EXPECT_TRUE(rows == plan.min_rows || rows == remaining) << "rows=" << rows << " remaining=" << remaining;
        EXPECT_LE(rows, plan.min_rows);
      } else {
        EXPECT_TRUE(rows == room || rows == remaining) << "a helper piece that neither fills its room nor ends the "
                                                       << "expert: rows=" << rows << " room=" << room
                                                       << " remaining=" << remaining;
      }
      placed[piece.rank] += rows;
    }
  }
  for (int r = 0; r < ranks; r++) {
    EXPECT_EQ(placed[r], plan.received[r]) << "rank " << r;
    EXPECT_LE(plan.received[r], cap + plan.min_rows - 1) << "rank " << r;
  }
}

// Every route of every source, walked in its route order: its position in its expert's list (sources
// one after the other), the piece that holds it. Each position must be hit exactly once, the pieces
// must tile the list on distinct ranks, and the rows per (source, destination) and per (piece, source)
// must be the plan's.
void check_every_route_once(const RaggedGroup& g, const LLEPPlan& plan) {
  const std::vector<std::vector<long long>> counts = count_matrix(g);
  for (int e = 0; e < g.E; e++) {
    SCOPED_TRACE("expert " + std::to_string(e));
    const int first = plan.expert_first_piece[e], last = plan.expert_first_piece[e + 1];
    std::vector<bool> rank_used(g.ranks, false);
    long long end = 0;
    for (int p = first; p < last; p++) {
      const LLEPPiece& piece = plan.pieces[p];
      EXPECT_EQ(piece.expert, e);
      EXPECT_EQ(piece.start, end) << "pieces do not tile the list";
      EXPECT_LT(piece.start, piece.end) << "empty piece";
      EXPECT_FALSE(rank_used[piece.rank]) << "two pieces of one expert on rank " << piece.rank;
      rank_used[piece.rank] = true;
      end = piece.end;
    }
    EXPECT_EQ(end, plan.expert_routes[e]);
  }
  std::vector<std::vector<long long>> first_of(g.ranks, std::vector<long long>(g.E, 0));  // source s's first position
  for (int s = 1; s < g.ranks; s++)
    for (int e = 0; e < g.E; e++) first_of[s][e] = first_of[s - 1][e] + counts[s - 1][e];
  std::vector<std::vector<int>> hits(g.E);
  for (int e = 0; e < g.E; e++) hits[e].assign(plan.expert_routes[e], 0);
  std::vector<long long> send_rows((size_t)g.ranks * g.ranks, 0), piece_rows(plan.piece_rows.size(), 0);
  for (int s = 0; s < g.ranks; s++) {
    std::vector<long long> next(g.E, 0);
    for (int e : g.topk_idx[s]) {
      const long long position = first_of[s][e] + next[e]++;
      ASSERT_LT(position, (long long)hits[e].size());
      hits[e][position]++;
      int p = plan.expert_first_piece[e];
      while (p < plan.expert_first_piece[e + 1] && plan.pieces[p].end <= position) p++;
      ASSERT_LT(p, plan.expert_first_piece[e + 1]) << "source " << s << " expert " << e << " position " << position;
      send_rows[(size_t)s * g.ranks + plan.pieces[p].rank]++;
      piece_rows[(size_t)p * g.ranks + s]++;
    }
  }
  long long wrong = 0;
  for (const std::vector<int>& h : hits)
    for (int c : h) wrong += c != 1;
  EXPECT_EQ(wrong, 0) << "route positions not hit exactly once";
  EXPECT_TRUE(send_rows == plan.send_rows) << "rows per (source, destination) differ from the routes walked";
  EXPECT_TRUE(piece_rows == plan.piece_rows) << "rows per (piece, source) differ from the routes walked";
}

// The plan against its twin ref/llep.hpp, entry by entry.
void check_against_twin(const std::vector<std::vector<long long>>& counts, const LLEPPlan& plan, double alpha,
                        long long min_rows) {
  const ref::LLEPAssignment twin = ref::llep_assign(counts, alpha, min_rows);
  EXPECT_EQ(plan.capacity, twin.capacity);
  for (int e = 0; e < plan.experts; e++) {
    std::vector<int> rank_of_route;
    for (int p = plan.expert_first_piece[e]; p < plan.expert_first_piece[e + 1]; p++)
      rank_of_route.insert(rank_of_route.end(), plan.pieces[p].end - plan.pieces[p].start, plan.pieces[p].rank);
    ASSERT_EQ(rank_of_route.size(), twin.rank_of_route[e].size()) << "expert " << e;
    for (size_t i = 0; i < rank_of_route.size(); i++)
      ASSERT_EQ(rank_of_route[i], twin.rank_of_route[e][i]) << "expert " << e << " route " << i;
  }
  const std::vector<std::vector<long long>> rows = ref::llep_rows(counts, twin);
  for (int s = 0; s < plan.ranks; s++)
    for (int d = 0; d < plan.ranks; d++)
      EXPECT_EQ(plan.send_rows[(size_t)s * plan.ranks + d], rows[s][d]) << "source " << s << " -> rank " << d;
  for (int d = 0; d < plan.ranks; d++) {
    long long received = 0;
    for (int s = 0; s < plan.ranks; s++) received += rows[s][d];
    EXPECT_EQ(plan.received[d], received) << "rank " << d;
  }
  const std::vector<std::array<int, 3>> transfers = ref::llep_weight_transfers(twin, plan.ranks);
  ASSERT_EQ(plan.transfers.size(), transfers.size());
  for (size_t i = 0; i < transfers.size(); i++) {
    const LLEPTransfer& t = plan.transfers[i];
    EXPECT_TRUE((std::array<int, 3>{t.expert, t.home, t.helper}) == transfers[i])
        << "transfer " << i << ": expert " << t.expert << " " << t.home << " -> " << t.helper;
  }
}

// All checks of one plan of group g's routes. Returns the most routes any rank computes.
long long check_plan(const RaggedGroup& g, const LLEPPlan& plan, double alpha, long long min_rows) {
  const std::vector<std::vector<long long>> counts = count_matrix(g);
  EXPECT_EQ(plan.ranks, g.ranks);
  EXPECT_EQ(plan.experts, g.E);
  EXPECT_EQ(plan.local_experts, g.E / g.ranks);
  long long total = 0;
  for (int e = 0; e < g.E; e++) {
    long long routes = 0;
    for (int s = 0; s < g.ranks; s++) routes += counts[s][e];
    EXPECT_EQ(plan.expert_routes[e], routes) << "expert " << e;
    total += routes;
  }
  EXPECT_EQ(plan.total, total);
  EXPECT_EQ(plan.capacity, llep_capacity(total, g.ranks, alpha));
  check_against_twin(counts, plan, alpha, min_rows);
  check_every_route_once(g, plan);
  check_capacity_rule(plan);
  const long long bound = llep_receive_bound(plan);
  EXPECT_EQ(bound, std::min(total, plan.capacity + min_rows - 1));
  long long most = 0, sum = 0;
  for (int d = 0; d < g.ranks; d++) {
    EXPECT_LE(plan.received[d], bound) << "rank " << d;
    if (min_rows == 1) {
      EXPECT_LE(plan.received[d], plan.capacity) << "rank " << d;
    }
    most = std::max(most, plan.received[d]);
    sum += plan.received[d];
  }
  EXPECT_EQ(sum, total);
  return most;
}

// Every field of two plans.
bool same_plan(const LLEPPlan& a, const LLEPPlan& b) {
  auto same_pieces = [](const std::vector<LLEPPiece>& x, const std::vector<LLEPPiece>& y) {
    return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](const LLEPPiece& p, const LLEPPiece& q) {
             return p.expert == q.expert && p.rank == q.rank && p.start == q.start && p.end == q.end;
           });
  };
  auto same_transfers = [](const std::vector<LLEPTransfer>& x, const std::vector<LLEPTransfer>& y) {
    return x.size() == y.size() && std::equal(x.begin(), x.end(), y.begin(), [](const LLEPTransfer& p, const LLEPTransfer& q) {
             return p.expert == q.expert && p.home == q.home && p.helper == q.helper;
           });
  };
  return a.ranks == b.ranks && a.experts == b.experts && a.local_experts == b.local_experts && a.total == b.total &&
         a.capacity == b.capacity && a.min_rows == b.min_rows && a.expert_routes == b.expert_routes &&
         same_pieces(a.pieces, b.pieces) && a.expert_first_piece == b.expert_first_piece &&
         a.piece_rows == b.piece_rows && a.send_rows == b.send_rows && a.received == b.received &&
         same_transfers(a.transfers, b.transfers);
}

// Rank v's view of the all-gather: its own counts as it computed them, the others' as they arrived
// (each source counted its own routes).
std::vector<long long> view_of_rank(const RaggedGroup& g, int v) {
  std::vector<std::vector<long long>> counts = count_matrix(g);
  std::vector<long long> own(g.E, 0);
  for (int e : g.topk_idx[v]) own[e]++;
  counts[v] = own;
  return gathered(counts);
}

// Chunk i of the group under K chunks: every rank's chunk-i tokens in member order (positions i, i+K, ...),
// found with the ops-side membership (pllep_chunk_tokens, pllep_chunk_token) as the device will.
RaggedGroup chunk_group(const RaggedGroup& g, int chunks, int chunk) {
  RaggedGroup c = g;
  c.routing = g.routing + " chunk " + std::to_string(chunk);
  for (int s = 0; s < g.ranks; s++) {
    const int N = (int)g.topk_idx[s].size() / g.k;
    c.topk_idx[s].clear();
    for (int j = 0; j < pllep_chunk_tokens(N, chunks, chunk); j++) {
      const int n = pllep_chunk_token(chunk, j, chunks);
      c.topk_idx[s].insert(c.topk_idx[s].end(), g.topk_idx[s].begin() + (size_t)n * g.k,
                           g.topk_idx[s].begin() + (size_t)(n + 1) * g.k);
    }
  }
  return c;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// LLEP

// The rules on small counts, worked by hand (E_p = 3, E_l = 2, T = 15, α = 1: cap = 5). Source 0 has
// 3 routes to e0, 5 to e1, 2 to e2; source 1 has 4 to e0, 1 to e4; rank 2 holds no token. Standard
// EP would put 12 routes on rank 0. Experts in order e0 (7), e1 (5), e2 (2), e4 (1):
//   e0  home 0 has eff = pending e1 = 5 = cap: no room, e0 leaves its home entirely. Helper of least
//       eff: rank 2 (eff 1: e4 pending) takes its room 4 → [0,4); then rank 1 (eff 2: e2) → [4,7).
//   e1  home 0, eff 0: [0,5).   e2  home 1, eff 3: [0,2).   e4  home 2, eff 4: [0,1).
// Every rank computes 5 routes. With min_rows = 5, rank 2 takes 5 of e0 (over cap by 1, as min_rows
// forces), rank 1 the last 2; e4 then finds its home full (eff 5) and goes to rank 1 (eff 4).
TEST(LlepPlan, WorkedExample) {
  const std::vector<long long> counts = {3, 5, 2, 0, 0, 0,   // source 0
                                         4, 0, 0, 0, 1, 0,   // source 1
                                         0, 0, 0, 0, 0, 0};  // source 2
  auto pieces_of = [](const LLEPPlan& plan, int e) {
    std::vector<std::array<long long, 3>> pieces;  // (rank, start, end)
    for (int p = plan.expert_first_piece[e]; p < plan.expert_first_piece[e + 1]; p++)
      pieces.push_back({plan.pieces[p].rank, plan.pieces[p].start, plan.pieces[p].end});
    return pieces;
  };
  using Pieces = std::vector<std::array<long long, 3>>;
  for (long long min_rows : {1, 2, 4}) {
    SCOPED_TRACE("min_rows=" + std::to_string(min_rows));
    const LLEPPlan plan = llep_plan(counts, 3, 1.0, min_rows);
    EXPECT_EQ(plan.total, 15);
    EXPECT_EQ(plan.capacity, 5);
    EXPECT_EQ(pieces_of(plan, 0), (Pieces{{2, 0, 4}, {1, 4, 7}}));
    EXPECT_EQ(pieces_of(plan, 1), (Pieces{{0, 0, 5}}));
    EXPECT_EQ(pieces_of(plan, 2), (Pieces{{1, 0, 2}}));
    EXPECT_EQ(pieces_of(plan, 3), Pieces{});
    EXPECT_EQ(pieces_of(plan, 4), (Pieces{{2, 0, 1}}));
    // e0's list: source 0's 3 routes, then source 1's 4: [0,4) holds 3 of source 0 and 1 of source 1
    EXPECT_EQ(plan.piece_rows, (std::vector<long long>{3, 1, 0, 0, 3, 0, 5, 0, 0, 2, 0, 0, 0, 1, 0}));
    EXPECT_EQ(plan.send_rows, (std::vector<long long>{5, 2, 3, 0, 3, 2, 0, 0, 0}));
    EXPECT_EQ(plan.received, (std::vector<long long>{5, 5, 5}));
    ASSERT_EQ(plan.transfers.size(), 2u);
    EXPECT_EQ((std::array<int, 3>{plan.transfers[0].expert, plan.transfers[0].home, plan.transfers[0].helper}),
              (std::array<int, 3>{0, 0, 2}));
    EXPECT_EQ((std::array<int, 3>{plan.transfers[1].expert, plan.transfers[1].home, plan.transfers[1].helper}),
              (std::array<int, 3>{0, 0, 1}));
  }
  const LLEPPlan forced = llep_plan(counts, 3, 1.0, 5);
  EXPECT_EQ(pieces_of(forced, 0), (Pieces{{2, 0, 5}, {1, 5, 7}}));
  EXPECT_EQ(pieces_of(forced, 4), (Pieces{{1, 0, 1}}));
  EXPECT_EQ(forced.received, (std::vector<long long>{5, 5, 5}));
  // α = 1.1: cap = ⌈1.1·15 / 3⌉ = ⌈5.5⌉ = 6
  EXPECT_EQ(llep_plan(counts, 3, 1.1, 1).capacity, 6);
}

// The bound cap + min_rows − 1 is reached: one source, 3 routes to e0, E_p = 3, cap = 1, min_rows = 2.
// The home takes 1, the least-loaded helper (rank 1) has room 1 but the last 2 routes go together.
TEST(LlepPlan, BoundIsReachedWhenMinRowsForcesAPiece) {
  const LLEPPlan plan = llep_plan({3, 0, 0, 0, 0, 0, 0, 0, 0}, 3, 1.0, 2);
  EXPECT_EQ(plan.capacity, 1);
  EXPECT_EQ(plan.received, (std::vector<long long>{1, 2, 0}));
  EXPECT_EQ(llep_receive_bound(plan), 2);
  EXPECT_EQ(llep_plan({3, 0, 0, 0, 0, 0, 0, 0, 0}, 3, 1.0, 1).received, (std::vector<long long>{1, 1, 1}));
}

TEST(LlepPlan, CapacityRoundsUpTheStatedProduct) {
  EXPECT_EQ(llep_capacity(100, 2, 1.1), 55);  // 1.1·100/2 = 55.000000000000007 in doubles
  EXPECT_EQ(llep_capacity(100, 3, 1.0), 34);
  EXPECT_EQ(llep_capacity(99, 3, 1.0), 33);
  EXPECT_EQ(llep_capacity(10, 4, 1.1), 3);  // 2.75
  EXPECT_EQ(llep_capacity(7, 1, 1.1), 7);   // never above T
  EXPECT_EQ(llep_capacity(0, 8, 1.1), 0);
  EXPECT_EQ(llep_capacity(64000000, 64, 1.000001), 1000001);  // six decimals count
  EXPECT_EQ(llep_capacity(64000000, 64, 1.0000001), 1000000);  // the seventh does not
  testutil::Rng rng;
  for (int i = 0; i < 2000; i++) {  // α with two decimals, T up to 2^40: cap = ⌈α·T/E_p⌉ exactly, E_p·cap ≥ T
    const long long T = (long long)rng.integer(0, 1 << 30) << rng.integer(0, 10);
    const int ranks = rng.integer(1, 64), percent = rng.integer(100, 150);
    const long long cap = llep_capacity(T, ranks, percent / 100.0);
    EXPECT_GE(cap * ranks, T);
    EXPECT_EQ(cap, std::min(T, (percent * T + 100LL * ranks - 1) / (100LL * ranks)))
        << "T=" << T << " ranks=" << ranks << " alpha=" << percent / 100.0;
  }
}

// Every adversarial routing at every group size, α ∈ {1.0, 1.1}, several min_rows: every check of
// check_plan. One [plan] line per group: standard EP's most loaded rank, then for each α LLEP's cap and
// its most loaded rank for each min_rows (in brackets): cap at min_rows = 1, more as min_rows grows.
TEST(LlepPlan, AdversarialRoutingEveryGroupSize) {
  testutil::Rng rng;
  for (const LlepGroupShape& shape : kLlepShapes)
    for (const RaggedGroup& g : adversarial_groups(rng, shape)) {
      const std::vector<std::vector<long long>> counts = count_matrix(g);
      std::string line;
      for (double alpha : {1.0, 1.1}) {
        char part[64];
        for (long long min_rows : min_rows_values(rng)) {
          SCOPED_TRACE(case_name(g, alpha, min_rows));
          const LLEPPlan plan = llep_plan(gathered(counts), g.ranks, alpha, min_rows);
          const long long most = check_plan(g, plan, alpha, min_rows);
          if (min_rows == 1) snprintf(part, sizeof(part), " | a=%.1f cap %lld: max R_d", alpha, plan.capacity), line += part;
          snprintf(part, sizeof(part), " %lld (%lld)", most, min_rows);
          line += part;
        }
      }
      long long total = 0;
      for (const std::vector<long long>& row : counts) total += std::accumulate(row.begin(), row.end(), 0LL);
      printf("[plan] llep W=%-2d E=%-3d %-16s T=%-5lld EP max R_d %-5lld%s\n", g.ranks, g.E, g.routing.c_str(), total,
             ep_max_received(counts), line.c_str());
    }
}

// Every rank plans from its own copy of the all-gathered counts (its own row counted by itself): the
// plans are identical, field by field; so are PipelinedLLEP's K and every chunk's plan.
TEST(LlepPlan, SamePlanOnEveryRank) {
  testutil::Rng rng;
  for (const LlepGroupShape& shape : kLlepShapes)
    for (const RaggedGroup& g : adversarial_groups(rng, shape)) {
      const double alpha = rng.integer(0, 1) ? 1.1 : 1.0;
      const long long min_rows = rng.integer(1, 16);
      SCOPED_TRACE(case_name(g, alpha, min_rows));
      const LLEPPlan plan0 = llep_plan(view_of_rank(g, 0), g.ranks, alpha, min_rows);
      const std::vector<int> tokens = g.tokens_per_rank();
      const PLLEPChunking chunking0 = pllep_chunking(tokens, 8, 4);
      std::vector<std::vector<long long>> chunk_counts;
      for (int i = 0; i < chunking0.chunks; i++) chunk_counts.push_back(gathered(count_matrix(chunk_group(g, chunking0.chunks, i))));
      const std::vector<LLEPPlan> chunk_plans0 = pllep_plan(chunking0, chunk_counts, g.k, alpha, min_rows);
      for (int v = 1; v < g.ranks; v++) {
        EXPECT_TRUE(same_plan(llep_plan(view_of_rank(g, v), g.ranks, alpha, min_rows), plan0)) << "rank " << v;
        std::vector<int> view_tokens = tokens;  // rank v's copy of the all-gathered N_r
        const PLLEPChunking chunking = pllep_chunking(view_tokens, 8, 4);
        EXPECT_EQ(chunking.chunks, chunking0.chunks) << "rank " << v;
        EXPECT_EQ(chunking.c_eff, chunking0.c_eff) << "rank " << v;
        const std::vector<LLEPPlan> chunk_plans = pllep_plan(chunking, chunk_counts, g.k, alpha, min_rows);
        for (int i = 0; i < chunking.chunks; i++)
          EXPECT_TRUE(same_plan(chunk_plans[i], chunk_plans0[i])) << "rank " << v << " chunk " << i;
      }
    }
}

// Each rank's share of the plan (llep_rank_plan) moves every route to the rank and group the plan
// gives it. Simulated route by route: each source sends its routes, sorted by expert as
// moe_route_plan sorts them, in its send order (send_slot_of_row), one block per destination; each
// receiver reads its source-major buffer group-major through its block tables (ep_recv_row_of_slot,
// the function the device kernel calls). Then every route arrives exactly once, on its piece's rank,
// in the group of its piece, and a group's weights are borrowed exactly when its expert lives on
// another rank.
TEST(LlepPlan, RankPlansDeliverEveryRouteToItsPiece) {
  testutil::Rng rng;
  for (const LlepGroupShape& shape : kLlepShapes)
    for (const RaggedGroup& g : adversarial_groups(rng, shape)) {
      const double alpha = rng.integer(0, 1) ? 1.1 : 1.0;
      const long long min_rows = rng.integer(1, 16);
      SCOPED_TRACE(case_name(g, alpha, min_rows));
      const std::vector<long long> counts = gathered(count_matrix(g));
      const LLEPPlan plan = llep_plan(counts, g.ranks, alpha, min_rows);
      const int E_l = g.E / g.ranks;
      std::vector<LLEPRankPlan> mine;
      for (int r = 0; r < g.ranks; r++) mine.push_back(llep_rank_plan(plan, counts, r));
      // position of route (s, n·k + j) in its expert's global list: sources in order, routes in order
      std::vector<std::vector<long long>> position(g.ranks);
      std::vector<long long> listed(g.E, 0);
      for (int s = 0; s < g.ranks; s++)
        for (int e : g.topk_idx[s]) position[s].push_back(listed[e]++);
      // moe_route_plan's order: routes by expert, then by route index
      std::vector<std::vector<int>> sorted(g.ranks);
      for (int s = 0; s < g.ranks; s++) {
        sorted[s].resize(g.topk_idx[s].size());
        std::iota(sorted[s].begin(), sorted[s].end(), 0);
        std::stable_sort(sorted[s].begin(), sorted[s].end(), [&](int a, int b) { return g.topk_idx[s][a] < g.topk_idx[s][b]; });
        std::vector<int> slots = mine[s].send_slot_of_row;
        std::sort(slots.begin(), slots.end());
        for (size_t i = 0; i < slots.size(); i++) ASSERT_EQ(slots[i], (int)i) << "source " << s << ": not a permutation";
        ASSERT_EQ(slots.size(), sorted[s].size()) << "source " << s;
      }
      std::vector<std::vector<char>> seen(g.ranks);
      for (int s = 0; s < g.ranks; s++) seen[s].assign(g.topk_idx[s].size(), 0);
      for (int d = 0; d < g.ranks; d++) {
        const EPPlan& ep = mine[d].ep;
        std::vector<std::pair<int, int>> source_major;  // (source, route) as received
        for (int s = 0; s < g.ranks; s++) {
          ASSERT_EQ(ep.recv_rows[s], mine[s].ep.send_rows[d]) << "source " << s << " -> rank " << d;
          long long first = 0;
          for (int dd = 0; dd < d; dd++) first += mine[s].ep.send_rows[dd];
          for (long long i = first; i < first + mine[s].ep.send_rows[d]; i++)
            source_major.push_back({s, sorted[s][mine[s].send_slot_of_row[i]]});
        }
        ASSERT_EQ((long long)source_major.size(), plan.received[d]) << "rank " << d;
        std::vector<int> pieces_here;
        for (int p = 0; p < (int)plan.pieces.size(); p++)
          if (plan.pieces[p].rank == d) pieces_here.push_back(p);
        ASSERT_EQ(ep.groups, (int)pieces_here.size()) << "rank " << d;
        for (int grp = 0; grp < ep.groups; grp++) {
          const LLEPPiece& piece = plan.pieces[pieces_here[grp]];
          EXPECT_EQ(mine[d].group_expert[grp], piece.expert);
          EXPECT_EQ(ep.group_rows[grp], piece.end - piece.start) << "rank " << d << " group " << grp;
          const int b = mine[d].group_borrowed[grp];
          EXPECT_EQ(b >= 0, piece.expert / E_l != d) << "rank " << d << " group " << grp;
          if (b >= 0) EXPECT_EQ(mine[d].borrowed[b].expert, piece.expert);
          for (int slot = ep.group_offsets[grp]; slot < ep.group_offsets[grp] + ep.group_rows[grp]; slot++) {
            const int row = ep_recv_row_of_slot(slot, ep.block_slot_offset.data(), ep.block_recv_row.data(), ep.groups * g.ranks);
            const auto [s, route] = source_major[row];
            EXPECT_EQ(g.topk_idx[s][route], piece.expert) << "rank " << d << " slot " << slot;
            EXPECT_GE(position[s][route], piece.start);
            EXPECT_LT(position[s][route], piece.end);
            EXPECT_EQ(seen[s][route]++, 0) << "source " << s << " route " << route << " arrived twice";
          }
        }
      }
      for (int s = 0; s < g.ranks; s++)
        EXPECT_EQ(std::count(seen[s].begin(), seen[s].end(), 1), (long)seen[s].size()) << "source " << s;
    }
}

TEST(LlepPlan, RefusesBadInputs) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(llep_plan({1, 2, 3}, 2, 1.0, 1), "llep_plan \\(ranks=2 counts=3\\)");       // not ranks x E
  EXPECT_DEATH(llep_plan({1, 2, 3, 4, 5, 6}, 2, 1.0, 1), "llep_plan \\(ranks=2 counts=6\\)");  // E = 3 not divisible by 2
  EXPECT_DEATH(llep_plan({1, 2}, 0, 1.0, 1), "llep_plan \\(ranks=0 counts=2\\)");
  EXPECT_DEATH(llep_plan({1, -2, 3, 4}, 2, 1.0, 1), "llep_plan \\(source=0 expert=1 count=-2\\): negative route count");
  EXPECT_DEATH(llep_plan({1, 2, 3, 4}, 2, 0.9, 1), "llep_plan \\(alpha=0.9 min_rows=1\\)");
  EXPECT_DEATH(llep_plan({1, 2, 3, 4}, 2, std::nan(""), 1), "llep_plan \\(alpha=nan min_rows=1\\)");
  EXPECT_DEATH(llep_plan({1, 2, 3, 4}, 2, 1.0, 0), "llep_plan \\(alpha=1 min_rows=0\\)");
  EXPECT_DEATH(llep_plan({INT_MAX, 1, 0, 0}, 2, 1.0, 1), "llep_plan \\(source=0 routes=2147483648\\): a source has more routes");
  EXPECT_DEATH(llep_plan({INT_MAX, 0, INT_MAX, 0}, 2, 2.0, 1),  // α = E_p: cap = T, all on rank 0
               "llep_plan \\(rank=0 received=4294967294 .*\\): a rank computes more routes than int indices hold");
}

// ---------------------------------------------------------------------------------------------
// PipelinedLLEP

TEST(PipelinedLlepPlan, ChunkCountFollowsTheBudget) {
  struct Case {
    std::vector<int> tokens;
    int c, K_max, K, c_eff;
  };
  const Case cases[] = {{{100, 100}, 25, 10, 4, 25},  {{100, 37}, 30, 10, 4, 25},  {{100, 0}, 7, 10, 10, 10},
                        {{0, 0, 0}, 5, 10, 1, 0},     {{5, 3, 0}, 100, 10, 1, 5},  {{1, 1}, 1, 10, 1, 1},
                        {{64}, 1, 1000, 64, 1},      {{65, 2}, 16, 3, 3, 22}};
  for (const Case& c : cases) {
    const PLLEPChunking chunking = pllep_chunking(c.tokens, c.c, c.K_max);
    EXPECT_EQ(chunking.chunks, c.K) << "c=" << c.c << " K_max=" << c.K_max;
    EXPECT_EQ(chunking.c_eff, c.c_eff) << "c=" << c.c << " K_max=" << c.K_max;
  }
  testutil::Rng rng;
  for (int i = 0; i < 500; i++) {
    std::vector<int> tokens(rng.integer(1, 64));
    for (int& N : tokens) N = rng.integer(0, 3) == 0 ? 0 : rng.integer(0, 300);
    const int c = rng.integer(1, 120), K_max = rng.integer(1, 16);
    SCOPED_TRACE("ranks=" + std::to_string(tokens.size()) + " c=" + std::to_string(c) + " K_max=" + std::to_string(K_max));
    const PLLEPChunking chunking = pllep_chunking(tokens, c, K_max);
    ASSERT_EQ(chunking.chunks, ref::pllep_chunks(tokens, c, K_max));
    EXPECT_EQ(chunking.c_eff, ref::pllep_largest_chunk(tokens, chunking.chunks));
    if (chunking.chunks < K_max) {
      EXPECT_LE(chunking.c_eff, c) << "c_eff above the budget while K_max does not bind";
    }
    for (int N : tokens) {  // every token in exactly one chunk, member j of chunk i at i + j·K
      std::vector<int> hits(N, 0);
      for (int chunk = 0; chunk < chunking.chunks; chunk++) {
        const int members = pllep_chunk_tokens(N, chunking.chunks, chunk);
        EXPECT_LE(members, chunking.c_eff);
        for (int j = 0; j < members; j++) {
          const int n = pllep_chunk_token(chunk, j, chunking.chunks);
          ASSERT_LT(n, N);
          EXPECT_EQ(n % chunking.chunks, chunk);
          hits[n]++;
        }
      }
      EXPECT_TRUE(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; })) << "N=" << N;
    }
  }
}

// Every adversarial routing at every group size, budgets giving K = 1, a few and K_max: the chunks'
// counts against the twin's (token n in chunk n mod K), every chunk's plan checked as LLEP's, and every
// chunk's receive count ≤ E_p·k·c_eff (Eq. 1) and ≤ its LLEP bound ≤ ⌈α·k·c_eff⌉ + min_rows − 1.
// One [plan] line per group: the largest chunk receive count against Eq. 1, for each budget.
TEST(PipelinedLlepPlan, ReceiverBoundPerChunk) {
  testutil::Rng rng;
  struct Budget {
    int c, K_max;
  };
  const Budget budgets[] = {{kMaxTokens, 10}, {10, 10}, {3, 7}};
  for (const LlepGroupShape& shape : kLlepShapes)
    for (const RaggedGroup& g : adversarial_groups(rng, shape)) {
      const std::vector<int> tokens = g.tokens_per_rank();
      const std::vector<std::vector<long long>> whole = count_matrix(g);
      std::string line;
      for (const Budget& b : budgets) {
        const PLLEPChunking chunking = pllep_chunking(tokens, b.c, b.K_max);
        const int K = chunking.chunks;
        ASSERT_EQ(K, ref::pllep_chunks(tokens, b.c, b.K_max));
        ASSERT_EQ(chunking.c_eff, ref::pllep_largest_chunk(tokens, K));
        const auto twin_counts = ref::pllep_chunk_counts(g.topk_idx, g.k, g.E, K);
        std::vector<RaggedGroup> chunks;
        std::vector<std::vector<long long>> chunk_counts;
        std::vector<std::vector<long long>> summed(g.ranks, std::vector<long long>(g.E, 0));
        for (int i = 0; i < K; i++) {
          chunks.push_back(chunk_group(g, K, i));
          const std::vector<std::vector<long long>> counts = count_matrix(chunks.back());
          ASSERT_TRUE(counts == twin_counts[i]) << "chunk " << i << " counts differ from the twin's";
          for (int s = 0; s < g.ranks; s++)
            for (int e = 0; e < g.E; e++) summed[s][e] += counts[s][e];
          chunk_counts.push_back(gathered(counts));
        }
        ASSERT_TRUE(summed == whole) << "the chunks' routes are not the layer's";
        const long long bound = pllep_receive_bound(chunking, g.k);
        EXPECT_EQ(bound, (long long)g.ranks * g.k * chunking.c_eff);
        long long most = 0;  // at α = 1.0, min_rows = 1
        for (double alpha : {1.0, 1.1})
          for (long long min_rows : {1LL, (long long)rng.integer(2, 16)}) {
            SCOPED_TRACE(case_name(g, alpha, min_rows) + " c=" + std::to_string(b.c) + " K=" + std::to_string(K));
            const std::vector<LLEPPlan> plans = pllep_plan(chunking, chunk_counts, g.k, alpha, min_rows);
            ASSERT_EQ((int)plans.size(), K);
            for (int i = 0; i < K; i++) {
              SCOPED_TRACE("chunk " + std::to_string(i));
              const long long chunk_most = check_plan(chunks[i], plans[i], alpha, min_rows);
              EXPECT_LE(plans[i].total, bound);
              EXPECT_LE(chunk_most, bound) << "Eq. 1";
              EXPECT_LE(plans[i].capacity, llep_capacity((long long)g.ranks * g.k * chunking.c_eff, g.ranks, alpha));
              if (alpha == 1.0 && min_rows == 1) most = std::max(most, chunk_most);
            }
          }
        char part[96];
        snprintf(part, sizeof(part), " | c=%-2d K=%-2d c_eff=%-2d max R_d %4lld <= %5lld (%.3f)", b.c, K, chunking.c_eff, most,
                 bound, bound > 0 ? (double)most / bound : 0.0);
        line += part;
      }
      printf("[plan] pllep W=%-2d E=%-3d %-16s%s\n", g.ranks, g.E, g.routing.c_str(), line.c_str());
    }
}

// The budget sweep on skewed routing at W = 8 (N = 2048 per rank, k = 4, E = 32): the per-chunk
// receive count falls with c, against standard EP's and whole-layer LLEP's.
TEST(PipelinedLlepPlan, ReceiveCountFallsWithTheBudget) {
  const LlepGroupShape shape{8, 4};
  const int N = 2048;
  for (const char* profile : {"hot:1/4", "hot:0.5/2", "balanced"}) {
    RaggedGroup g = empty_group(profile, shape);
    for (int r = 0; r < shape.ranks; r++)
      g.topk_idx.push_back(routing_profile_indices(parse_routing_profile(profile), N, g.E, g.k));
    const std::vector<std::vector<long long>> whole = count_matrix(g);
    const std::vector<long long> layer = llep_plan(gathered(whole), g.ranks, 1.0, 1).received;
    const long long layer_most = *std::max_element(layer.begin(), layer.end());
    long long previous = LLONG_MAX;
    for (int c = N; c >= 64; c /= 2) {
      const PLLEPChunking chunking = pllep_chunking(g.tokens_per_rank(), c, 1000);
      std::vector<std::vector<long long>> chunk_counts;
      for (int i = 0; i < chunking.chunks; i++) chunk_counts.push_back(gathered(count_matrix(chunk_group(g, chunking.chunks, i))));
      long long most = 0;
      for (const LLEPPlan& plan : pllep_plan(chunking, chunk_counts, g.k, 1.0, 1))
        most = std::max(most, *std::max_element(plan.received.begin(), plan.received.end()));
      const long long bound = pllep_receive_bound(chunking, g.k);
      printf("[plan] pllep sweep W=8 E=32 N=%d %-9s c=%-4d K=%-2d c_eff=%-4d max R_d per chunk %5lld <= Eq.1 %6lld"
             " | whole-layer LLEP %5lld, EP %5lld\n",
             N, profile, c, chunking.chunks, chunking.c_eff, most, bound, layer_most, ep_max_received(whole));
      EXPECT_LE(most, bound);
      EXPECT_LE(most, previous) << "c=" << c;
      previous = most;
    }
  }
}

TEST(PipelinedLlepPlan, RefusesBadInputs) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH(pllep_chunking({8, 8}, 0, 4), "pllep_chunking \\(ranks=2 c=0 K_max=4\\)");
  EXPECT_DEATH(pllep_chunking({8, -1}, 4, 4), "pllep_chunking \\(rank=1 N=-1\\): negative token count");
  const PLLEPChunking chunking = pllep_chunking({3, 1}, 2, 4);  // K = 2: rank 0 has 2 + 1 tokens, rank 1 has 1 + 0
  const std::vector<long long> chunk0 = {2, 2, 1, 1}, chunk1 = {1, 1, 0, 0};  // k = 2, E = 2
  EXPECT_DEATH(pllep_plan(chunking, {chunk0}, 2, 1.0, 1), "pllep_plan \\(k=2 chunks=2 count_vectors=1\\)");
  EXPECT_DEATH(pllep_plan(chunking, {chunk0, {1, 1, 0}}, 2, 1.0, 1), "pllep_plan \\(chunk=1 ranks=2 counts=3\\)");
  EXPECT_DEATH(pllep_plan(chunking, {{2, 2, 0, 1}, chunk1}, 2, 1.0, 1),
               "pllep_plan \\(chunk=0 source=1 N=1 K=2 k=2 routes=1 expected=2\\)");
  EXPECT_EQ(pllep_plan(chunking, {chunk0, chunk1}, 2, 1.0, 1).size(), 2u);
}
