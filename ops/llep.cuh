// llep.cuh — least-loaded expert parallelism, LLEP (DESIGN §6.2; Nguyen et al. 2026a, the LLEP of
// papers/flattening-memory-peaks.txt §1 and §3.1): the dropless MoE FFN of ops/moe.cuh over an EP
// group, with standard EP's expert shards and the router's expert choices (ops/ep_moe.cuh), where
// only the rank that computes a route changes: the overflow of a popular expert is computed on ranks
// that would otherwise wait, with the expert's weights lent by its home rank. Twin of ref/llep.hpp
// (the plan, route by route) and ref/moe.hpp (the math over the global batch, as for ep_moe.cuh).
//
// What it computes: exactly moe_forward / moe_backward over the group's global batch, each rank
// holding its own token shard and its own expert shard, as in ep_moe.cuh (same shapes, N may differ
// between ranks and be 0). Rank d of the E_p ranks is the home of the E_l = E/E_p experts
// [d·E_l, (d+1)·E_l): home(e) = e / E_l. A helper that computes routes of a borrowed expert returns
// that expert's weight gradient to the home rank, which adds it: dW13_local, dW2_local (+=) hold the
// gradient of every route of the home's experts, wherever it was computed.
//
// The plan (host side, below): a pure function of the group's counts, so every rank computes the
// same plan from the same all-gathered numbers. Input: counts[s·E + e] = routes of source rank s to
// expert e; C_e = Σ_s counts[s·E + e]; T = Σ_e C_e, the group's routes.
//   cap    ⌈α·T / E_p⌉ (α ≥ 1; see llep_capacity for the rounding), so that E_p·cap ≥ T.
//   order  experts with C_e > 0 by C_e descending, ties by the lower expert id.
//   loads  assigned[r] = routes already placed on rank r; pending[r] = routes of r's own experts not
//          placed yet; effective load eff(r) = assigned[r] + pending[r]; room(r) = cap − eff(r).
//   place  for each expert e in order, h = home(e): pending[h] −= C_e (e is no longer pending); the
//          home takes min(C_e, max(0, room(h))) routes (filled up to cap, no minimum: it holds the
//          weights); while routes remain, the helper g ≠ h with the least eff (ties: lower rank)
//          takes min(remaining, max(room(g), min_rows)): all its room, but never a piece below
//          min_rows (one weight transfer and one GEMM per piece) unless it is the expert's last.
//          When even the least-loaded helper has room for less than min_rows, it still takes
//          min_rows (Nguyen et al.'s code puts the whole rest on it): the overshoot stays below
//          min_rows and the rest goes on to the next helper.
// Pieces are ranges [start, end) of the expert's global route list: source 0's routes to e in its
// route order (token n, slot j at n·k + j), then source 1's, and so on; the home's piece comes first.
// From the pieces: the rows each source sends to each rank, what each rank receives, and one weight
// transfer (expert, home → helper) per helper piece.
// Guarantees (asserted by tests/gpu_llep_plan.cu for E_p up to 64, adversarial routing):
//   - every route is placed exactly once; an expert's pieces lie on distinct ranks (a helper borrows
//     an expert's weights once);
//   - while an expert has routes left, Σ_r eff(r) = T − remaining < E_p·cap and the home is at or
//     above cap, so the least-loaded helper has room ≥ 1: a piece takes its rank above cap only when
//     min_rows forces it, by at most min_rows − 1; a rank above cap gets nothing more (it is not the
//     least-loaded helper, and as a home it has no room), and no piece raises eff otherwise. Hence
//     every rank computes R_d ≤ cap + min_rows − 1 routes (≤ cap when min_rows = 1):
//     llep_receive_bound.
//
// Receive live set: a rank's dispatch buffers hold the R_d rows it computes, R_d·H·b bytes each.
// Standard EP's R_d follows the router (up to T: every route to one rank); LLEP's is at most
// cap + min_rows − 1 ≈ α·T/E_p, the group's average, whatever the skew. It still grows with N·k,
// the whole routed batch at once: ops/pipelined_llep.cuh delivers it in chunks and bounds that.
// Layout of this file: the host-side plan first (pure C++, no CUDA call: the plan tests run it for up
// to 64 ranks without a GPU); the kernels and launchers that dispatch by it go after it (not built yet).
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>
#include "../runtime/check.cuh"

// ---------------------------------------------------------------------------------------------
// Host-side plan (pure C++: no CUDA call)

// cap = ⌈α·T / E_p⌉, at most T, with α taken to 6 decimals (α_micro = round(α·10^6): the decimal α
// that a flag states, 1.1 or 1.05, exactly) and the quotient in integers: in doubles, α·T/E_p can land
// above the integer that α states (1.1·100/2 = 55.000000000000007), while a true fraction can be as
// small as 1/(10^6·E_p) of a route. Rounding up gives E_p·cap ≥ α·T ≥ T: the ranks can hold every route.
inline long long llep_capacity(long long total_routes, int ranks, double alpha) {
  if (alpha >= ranks) return total_routes;  // α·T/E_p ≥ T (and α_micro stays far below overflow)
  const __int128 alpha_micro = std::llround(alpha * 1e6), denominator = (__int128)1000000 * ranks;
  return (long long)std::min<__int128>(total_routes, (alpha_micro * total_routes + denominator - 1) / denominator);
}

// One piece of an expert's global route list and the rank that computes it.
struct LLEPPiece {
  int expert = 0, rank = 0;
  long long start = 0, end = 0;  // [start, end) of the expert's route list
};

// A helper borrows an expert's weights from its home (and returns the expert's weight gradient).
struct LLEPTransfer {
  int expert = 0, home = 0, helper = 0;
};

// The group's plan; the same on every rank.
struct LLEPPlan {
  int ranks = 0, experts = 0, local_experts = 0;  // E_p, E, E_l
  long long total = 0;                            // T: the group's routes
  long long capacity = 0;                         // cap
  long long min_rows = 0;                         // the smallest helper piece but an expert's last
  std::vector<long long> expert_routes;           // [E] C_e
  std::vector<LLEPPiece> pieces;                  // by expert ascending, inside an expert in route-list order
  std::vector<int> expert_first_piece;            // [E+1] expert e's pieces: [expert_first_piece[e], expert_first_piece[e+1])
  std::vector<long long> piece_rows;              // [pieces·E_p] entry p·E_p + s: routes of source s in piece p
  std::vector<long long> send_rows;               // [E_p·E_p] entry s·E_p + d: routes source s sends to rank d
  std::vector<long long> received;                // [E_p] R_d: routes rank d computes, its own included
  std::vector<LLEPTransfer> transfers;            // one per helper piece, in piece order
};

// counts [E_p·E] source-major (the all-gather of every rank's routes per global expert), α ≥ 1,
// min_rows ≥ 1. Refuses sizes that do not fit, negative counts, a source with more routes than int
// indices hold, and a plan whose R_d does not fit int indices.
inline LLEPPlan llep_plan(const std::vector<long long>& counts, int ranks, double alpha, long long min_rows) {
  const char* op = "llep_plan";
  if (ranks < 1 || counts.empty() || counts.size() % ranks != 0 || (counts.size() / ranks) % ranks != 0)
    fm_fail(op, "need ranks >= 1 and ranks x E counts with ranks dividing E", "ranks=%d counts=%zu", ranks, counts.size());
  if (!(alpha >= 1.0) || !std::isfinite(alpha) || min_rows < 1)
    fm_fail(op, "need a finite alpha >= 1 (E_p·cap >= T: room for every route) and min_rows >= 1", "alpha=%g min_rows=%lld",
            alpha, min_rows);
  const int E = (int)(counts.size() / ranks), E_l = E / ranks;
  LLEPPlan plan;
  plan.ranks = ranks;
  plan.experts = E;
  plan.local_experts = E_l;
  plan.min_rows = min_rows;
  plan.expert_routes.assign(E, 0);
  for (int s = 0; s < ranks; s++) {
    long long source_routes = 0;
    for (int e = 0; e < E; e++) {
      const long long c = counts[(size_t)s * E + e];
      if (c < 0) fm_fail(op, "negative route count", "source=%d expert=%d count=%lld", s, e, c);
      source_routes += c;
      plan.expert_routes[e] += c;
    }
    if (source_routes > INT_MAX)
      fm_fail(op, "a source has more routes than int indices hold", "source=%d routes=%lld", s, source_routes);
    plan.total += source_routes;
  }
  plan.capacity = llep_capacity(plan.total, ranks, alpha);
  const long long cap = plan.capacity;

  std::vector<long long> assigned(ranks, 0), pending(ranks, 0);
  for (int e = 0; e < E; e++) pending[e / E_l] += plan.expert_routes[e];
  auto effective_load = [&](int r) { return assigned[r] + pending[r]; };
  std::vector<int> order;
  for (int e = 0; e < E; e++)
    if (plan.expert_routes[e] > 0) order.push_back(e);
  std::sort(order.begin(), order.end(), [&](int a, int b) {
    return plan.expert_routes[a] != plan.expert_routes[b] ? plan.expert_routes[a] > plan.expert_routes[b] : a < b;
  });
  std::vector<std::vector<LLEPPiece>> expert_pieces(E);
  for (int e : order) {
    const int home = e / E_l;
    const long long routes = plan.expert_routes[e];
    long long placed = 0;
    auto place = [&](int rank, long long rows) {
      expert_pieces[e].push_back(LLEPPiece{e, rank, placed, placed + rows});
      assigned[rank] += rows;
      placed += rows;
    };
    pending[home] -= routes;
    const long long home_rows = std::min(routes, std::max(0LL, cap - effective_load(home)));
    if (home_rows > 0) place(home, home_rows);
    // An overflow has a helper: with E_p = 1 the home's room is cap − (T − C_e) ≥ C_e.
    while (placed < routes) {
      int helper = -1;
      for (int r = 0; r < ranks; r++)
        if (r != home && (helper < 0 || effective_load(r) < effective_load(helper))) helper = r;
      place(helper, std::min(routes - placed, std::max(cap - effective_load(helper), min_rows)));
    }
  }

  // Pieces by expert; each piece's rows per source (source s holds [first, first + counts) of the list).
  plan.expert_first_piece.assign(E + 1, 0);
  plan.send_rows.assign((size_t)ranks * ranks, 0);
  plan.received.assign(ranks, 0);
  for (int e = 0; e < E; e++) {
    plan.expert_first_piece[e] = (int)plan.pieces.size();
    for (const LLEPPiece& piece : expert_pieces[e]) {
      long long first = 0;
      for (int s = 0; s < ranks; s++) {
        const long long last = first + counts[(size_t)s * E + e];
        const long long rows = std::max(0LL, std::min(piece.end, last) - std::max(piece.start, first));
        plan.piece_rows.push_back(rows);
        plan.send_rows[(size_t)s * ranks + piece.rank] += rows;
        first = last;
      }
      plan.received[piece.rank] += piece.end - piece.start;
      if (piece.rank != e / E_l) plan.transfers.push_back(LLEPTransfer{e, e / E_l, piece.rank});
      plan.pieces.push_back(piece);
    }
  }
  plan.expert_first_piece[E] = (int)plan.pieces.size();
  for (int d = 0; d < ranks; d++)
    if (plan.received[d] > INT_MAX)
      fm_fail(op, "a rank computes more routes than int indices hold", "rank=%d received=%lld T=%lld cap=%lld", d,
              plan.received[d], plan.total, cap);
  return plan;
}

// The most routes any rank computes under the plan's rules (see the header): cap + min_rows − 1, and
// never more than the group's routes.
inline long long llep_receive_bound(const LLEPPlan& plan) {
  return std::min(plan.total, plan.capacity + plan.min_rows - 1);
}
