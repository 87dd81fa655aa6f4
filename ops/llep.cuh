// llep.cuh — least-loaded expert parallelism, LLEP (notes/design.md §6.2; Nguyen et al. 2026a, as used in "Flattening
// Every Memory Peak in Long-Context Mixture-of-Experts Training", §1, §3.1): the dropless MoE FFN of ops/moe.cuh over
// an EP group, with standard EP's expert shards and the router's expert choices (ops/ep_moe.cuh), where only the rank
// that computes a route changes: the overflow of a popular expert is computed on ranks that would otherwise wait, with
// the expert's weights lent by its home rank. Twin of ref/llep.hpp (the plan, route by route) and ref/moe.hpp (the math
// over the global batch, as for ep_moe.cuh).
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
// Guarantees (asserted by tests/cpu_llep_plan.cu for E_p up to 64, adversarial routing):
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
// Schedule (each rank; the pass of ops/ep_moe.cuh with a different placement):
//   forward   moe_route_plan sorts this rank's routes by expert → counts per expert all-gathered
//             (all_to_all_host: every rank's [E], synchronises) → llep_plan, the same on every rank →
//             llep_rank_plan: this rank's share (its groups = its pieces by expert, the send order =
//             destination rank, then piece) → the route maps put into send order → the lent weights
//             move (one point-to-point group: each helper piece's W13_e and W2_e, home → helper) →
//             ep_moe_forward_planned: rows out, one grouped GEMM per product over this rank's pieces
//             (own experts' weights in place, lent ones from the borrowed copies), rows back, combine.
//   backward  ep_moe_backward_planned with each piece's gradient going to dW*_local (own expert, +=)
//             or to a zeroed borrowed gradient → the borrowed gradients go home (one point-to-point
//             group) → the home adds each, in plan order, to its expert's gradient.
// Live set beyond ep_moe.cuh's (the same Dispatch and ExpertIntermediates closed forms with this
// rank's R_d): the borrowed weights B·3·H·I·b (Weights), kept from forward to backward, and in
// backward the borrowed gradients B·3·H·I·b plus the returned ones L·3·H·I·b (Grads), where B and L
// are the helper pieces this rank computes and lends.
// Layout of this file: the host-side plan first (pure C++, no CUDA call: the plan tests run it for up
// to 64 ranks without a GPU), then the kernels and launchers that dispatch by it.
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>
#include <vector>
#include "ep_moe.cuh"

// ---------------------------------------------------------------------------------------------
// Host-side plan (pure C++: no CUDA call)

// The live set above whatever the router does (model.cuh's per-rank prediction): a rank computes at
// most every route (ep_moe_live_bound's R_d = E_p·R, passed in as `ep`), borrows at most the E − E_l
// experts it does not own (weights saved, their gradients in backward) and lends each of its E_l
// experts to at most E_p − 1 helpers (their gradients come back in backward).
inline DispatchBound llep_live_bound(DispatchBound ep, int H, int I, int E, int E_p, size_t b) {
  const int E_l = E / E_p;
  const size_t expert = 3 * (size_t)H * I * b, borrowed = (size_t)(E - E_l) * expert;
  return DispatchBound{ep.saved + borrowed, ep.peak + 2 * borrowed + (size_t)E_l * (E_p - 1) * expert};
}

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

// The part of the group's plan that one rank acts on.
struct LLEPRankPlan {
  EPPlan ep;                           // this rank's blocks; its groups are its pieces, expert ascending
  std::vector<int> group_expert;       // [G] global expert of each group
  std::vector<int> group_borrowed;     // [G] index into the borrowed weights, or −1 for an own expert
  std::vector<int> send_slot_of_row;   // [R] moe_route_plan's slot (routes sorted by expert) of each send position
  std::vector<LLEPTransfer> lent;      // transfers with this rank as home, plan order
  std::vector<LLEPTransfer> borrowed;  // transfers with this rank as helper, plan order (= its borrowed groups)
};

// counts [E_p·E] as given to llep_plan; `rank` = this rank. This rank's routes to expert e sit at
// slots [off_e, off_e + counts[rank·E + e]) of moe_route_plan's order (off_e = its routes to experts
// below e); the pieces of e cut that range in order, so its rows in piece p are the next
// piece_rows[p·E_p + rank] of them. The send order is destination rank, then piece (expert
// ascending), then slot: what ep_moe_forward_planned sends as one block per destination.
inline LLEPRankPlan llep_rank_plan(const LLEPPlan& plan, const std::vector<long long>& counts, int rank) {
  const int ranks = plan.ranks, E = plan.experts, E_l = plan.local_experts, P = (int)plan.pieces.size();
  if (rank < 0 || rank >= ranks || counts.size() != (size_t)ranks * E)
    fm_fail("llep_rank_plan", "need 0 <= rank < ranks and ranks x E counts", "rank=%d ranks=%d E=%d counts=%zu", rank,
            ranks, E, counts.size());
  LLEPRankPlan mine;
  std::vector<long long> expert_slot(E, 0);
  for (int e = 1; e < E; e++) expert_slot[e] = expert_slot[e - 1] + counts[(size_t)rank * E + e - 1];
  std::vector<long long> piece_slot(P, 0);  // this rank's first slot in each piece
  for (int e = 0; e < E; e++) {
    long long slot = expert_slot[e];
    for (int p = plan.expert_first_piece[e]; p < plan.expert_first_piece[e + 1]; p++) {
      piece_slot[p] = slot;
      slot += plan.piece_rows[(size_t)p * ranks + rank];
    }
  }
  for (int d = 0; d < ranks; d++)
    for (int p = 0; p < P; p++)
      if (plan.pieces[p].rank == d)
        for (long long i = 0; i < plan.piece_rows[(size_t)p * ranks + rank]; i++)
          mine.send_slot_of_row.push_back((int)(piece_slot[p] + i));
  std::vector<int> groups;  // piece ids this rank computes
  for (int p = 0; p < P; p++)
    if (plan.pieces[p].rank == rank) groups.push_back(p);
  const int G = (int)groups.size();
  std::vector<long long> received_per_source_group((size_t)ranks * G), send_rows(ranks);
  for (int s = 0; s < ranks; s++)
    for (int g = 0; g < G; g++) received_per_source_group[(size_t)s * G + g] = plan.piece_rows[(size_t)groups[g] * ranks + s];
  for (int d = 0; d < ranks; d++) send_rows[d] = plan.send_rows[(size_t)rank * ranks + d];
  mine.ep = ep_plan_groups(send_rows, received_per_source_group, ranks, G);
  for (int p : groups) {
    const int e = plan.pieces[p].expert;
    mine.group_expert.push_back(e);
    mine.group_borrowed.push_back(e / E_l == rank ? -1 : (int)mine.borrowed.size());
    if (e / E_l != rank) mine.borrowed.push_back(LLEPTransfer{e, e / E_l, rank});
  }
  for (const LLEPTransfer& t : plan.transfers)
    if (t.home == rank) mine.lent.push_back(t);
  return mine;
}

// ---------------------------------------------------------------------------------------------
// Kernels

// Puts the route maps into the send order: slot_of_route[route_of_slot[send_slot_of_row[i]]] = i for
// every send position i (=; a permutation, so every route is written once). One thread per position.
static __global__ void llep_send_order_kernel(int* slot_of_route, const int* route_of_slot, const int* send_slot_of_row,
                                              int R) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < R) slot_of_route[route_of_slot[send_slot_of_row[i]]] = i;
}

// route_of_slot[slot_of_route[r]] = r (=): the inverse permutation. One thread per route.
static __global__ void invert_permutation_kernel(int* route_of_slot, const int* slot_of_route, int R) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r < R) route_of_slot[slot_of_route[r]] = r;
}

// ---------------------------------------------------------------------------------------------
// Launchers

// What backward needs beyond ep_moe.cuh's state: the plan this rank acts on and the borrowed weights.
struct LLEPSaved {
  EPSaved ep;
  LLEPPlan plan;                     // the group's plan (host)
  LLEPRankPlan mine;                 // this rank's share (host)
  floatX* borrowed_W13 = nullptr;    // [B, 2I, H] lent by the homes (Weights)
  floatX* borrowed_W2 = nullptr;     // [B, H, I]                    (Weights)
};

inline void llep_saved_free(LLEPSaved& saved) {
  ep_saved_free(saved.ep);
  pool().free(saved.borrowed_W13);
  pool().free(saved.borrowed_W2);
  saved = LLEPSaved();
}

// Each group's weights: an own expert's in place, a borrowed one's at its index (mine.group_borrowed)
// in borrowed_W13 [B,2I,H] / borrowed_W2 [B,H,I].
inline GroupWeights llep_group_weights(const LLEPRankPlan& mine, int E_l, int H, int I, const floatX* borrowed_W13,
                                       const floatX* borrowed_W2, const floatX* W13_local, const floatX* W2_local) {
  const size_t w13 = (size_t)2 * I * H, w2 = (size_t)H * I;
  GroupWeights w;
  for (size_t g = 0; g < mine.group_expert.size(); g++) {
    const int b = mine.group_borrowed[g], l = mine.group_expert[g] % E_l;
    w.W13.push_back(b < 0 ? W13_local + l * w13 : borrowed_W13 + b * w13);
    w.W2.push_back(b < 0 ? W2_local + l * w2 : borrowed_W2 + b * w2);
  }
  return w;
}
inline GroupWeights llep_group_weights(const LLEPSaved& saved, const floatX* W13_local, const floatX* W2_local) {
  return llep_group_weights(saved.mine, saved.plan.local_experts, saved.ep.H, saved.ep.I, saved.borrowed_W13,
                            saved.borrowed_W2, W13_local, W2_local);
}

// Forward: each lent expert's W13 [2I,H] and W2 [H,I], home → helper, into the helper's borrowed
// copies [B,...] (B = its borrowed groups, plan order). One point-to-point group; every rank calls it,
// and a pair's messages match in plan order.
inline void llep_lend_weights(const LLEPSaved& saved, const floatX* W13_local, const floatX* W2_local, const Comm& ep,
                              cudaStream_t stream) {
  const int H = saved.ep.H, I = saved.ep.I, E_l = saved.plan.local_experts;
  const size_t w13 = (size_t)2 * I * H, w2 = (size_t)H * I;
  std::vector<PeerMessage<const floatX>> sends;
  std::vector<PeerMessage<floatX>> recvs;
  for (const LLEPTransfer& t : saved.mine.lent) {
    sends.push_back({W13_local + (t.expert % E_l) * w13, w13, t.helper});
    sends.push_back({W2_local + (t.expert % E_l) * w2, w2, t.helper});
  }
  for (size_t b = 0; b < saved.mine.borrowed.size(); b++) {
    recvs.push_back({saved.borrowed_W13 + b * w13, w13, saved.mine.borrowed[b].home});
    recvs.push_back({saved.borrowed_W2 + b * w2, w2, saved.mine.borrowed[b].home});
  }
  point_to_point(ep, sends, recvs, stream);
}

// Backward: each borrowed expert's weight gradient, helper → home: borrowed_dW* [B,...] out,
// returned_dW* [L,...] in (L = the pieces this rank lent, plan order). One point-to-point group.
inline void llep_return_gradients(const LLEPSaved& saved, const floatX* borrowed_dW13, const floatX* borrowed_dW2,
                                  floatX* returned_dW13, floatX* returned_dW2, const Comm& ep, cudaStream_t stream) {
  const size_t w13 = (size_t)2 * saved.ep.I * saved.ep.H, w2 = (size_t)saved.ep.H * saved.ep.I;
  std::vector<PeerMessage<const floatX>> sends;
  std::vector<PeerMessage<floatX>> recvs;
  for (size_t b = 0; b < saved.mine.borrowed.size(); b++) {
    sends.push_back({borrowed_dW13 + b * w13, w13, saved.mine.borrowed[b].home});
    sends.push_back({borrowed_dW2 + b * w2, w2, saved.mine.borrowed[b].home});
  }
  for (size_t j = 0; j < saved.mine.lent.size(); j++) {
    recvs.push_back({returned_dW13 + j * w13, w13, saved.mine.lent[j].helper});
    recvs.push_back({returned_dW2 + j * w2, w2, saved.mine.lent[j].helper});
  }
  point_to_point(ep, sends, recvs, stream);
}

// Pieces of the forward and backward, shared by llep_forward / llep_backward and the chunks of
// ops/pipelined_llep.cuh.

// The plan this rank acts on, from the group's counts [E_p·E] (llep_plan's input): saved.plan,
// saved.mine and the EP pass's plan.
inline void llep_adopt_plan(LLEPSaved& saved, LLEPPlan plan, const std::vector<long long>& counts, int rank) {
  saved.mine = llep_rank_plan(plan, counts, rank);
  saved.plan = std::move(plan);
  saved.ep.plan = saved.mine.ep;
}

// The route maps in send order (=), from moe_route_sort's order (routes by expert) and this rank's
// send order on the device (send_slot_of_row [R], LLEPRankPlan::send_slot_of_row).
inline void llep_send_order(EPSaved& es, const int* send_slot_of_row_dev, cudaStream_t stream) {
  const int R = es.N * es.k;
  if (R == 0) return;
  llep_send_order_kernel<<<ceil_div(R, 256), 256, 0, stream>>>(es.slot_of_route, es.route_of_slot, send_slot_of_row_dev, R);
  launchCheck("llep_send_order", "R=%d", R);
  invert_permutation_kernel<<<ceil_div(R, 256), 256, 0, stream>>>(es.route_of_slot, es.slot_of_route, R);
  launchCheck("llep_invert_permutation", "R=%d", R);
}

// The borrowed weights' buffers, [B,2I,H] and [B,H,I] (Weights), filled by llep_lend_weights.
inline void llep_alloc_borrowed(LLEPSaved& saved) {
  const size_t B = saved.mine.borrowed.size(), H = saved.ep.H, I = saved.ep.I;
  saved.borrowed_W13 = alloc_rows<floatX>(B * 2 * I * H, Mem::Weights, "llep.borrowed_W13");
  saved.borrowed_W2 = alloc_rows<floatX>(B * H * I, Mem::Weights, "llep.borrowed_W2");
}

// The weight gradients of the borrowed experts on their way home (Grads): borrowed [B,...] (zeroed,
// then += by this rank's pieces), returned [L,...] (what this rank's helpers computed for its experts).
struct LLEPGradsHome {
  floatX *borrowed_dW13 = nullptr, *borrowed_dW2 = nullptr;
  floatX *returned_dW13 = nullptr, *returned_dW2 = nullptr;
};

// Backward, before the pass: the borrowed experts' gradients [B,...] (B = saved.mine.borrowed)
// allocated and zeroed on `stream`.
inline void llep_zero_borrowed_grads(LLEPGradsHome& home, const LLEPSaved& saved, cudaStream_t stream) {
  const size_t w13 = (size_t)2 * saved.ep.I * saved.ep.H, w2 = (size_t)saved.ep.H * saved.ep.I, B = saved.mine.borrowed.size();
  home.borrowed_dW13 = alloc_rows<floatX>(B * w13, Mem::Grads, "llep.borrowed_dW13");
  home.borrowed_dW2 = alloc_rows<floatX>(B * w2, Mem::Grads, "llep.borrowed_dW2");
  if (B > 0) {
    cudaCheck(cudaMemsetAsync(home.borrowed_dW13, 0, B * w13 * sizeof(floatX), stream), "llep_zero_borrowed_grads", "B=%zu", B);
    cudaCheck(cudaMemsetAsync(home.borrowed_dW2, 0, B * w2 * sizeof(floatX), stream), "llep_zero_borrowed_grads", "B=%zu", B);
  }
}

// Where each group's weight gradient goes (+=): an own expert's dW*_local slice, a borrowed expert's
// gradient at its index (mine.group_borrowed) in home's borrowed gradients.
inline GroupGrads llep_group_grads(const LLEPRankPlan& mine, int E_l, int H, int I, const LLEPGradsHome& home,
                                   floatX* dW13_local, floatX* dW2_local) {
  const size_t w13 = (size_t)2 * I * H, w2 = (size_t)H * I;
  GroupGrads grads;
  for (size_t g = 0; g < mine.group_expert.size(); g++) {
    const int b = mine.group_borrowed[g], l = mine.group_expert[g] % E_l;
    grads.dW13.push_back(b < 0 ? dW13_local + l * w13 : home.borrowed_dW13 + b * w13);
    grads.dW2.push_back(b < 0 ? dW2_local + l * w2 : home.borrowed_dW2 + b * w2);
  }
  return grads;
}

// Backward, after the pass: the borrowed gradients go home (one point-to-point group on `xs`, after
// the work queued on `cs` so far) into the returned buffers.
inline void llep_send_gradients_home(LLEPGradsHome& home, const LLEPSaved& saved, const Comm& ep, cudaStream_t cs,
                                     cudaStream_t xs) {
  const size_t w13 = (size_t)2 * saved.ep.I * saved.ep.H, w2 = (size_t)saved.ep.H * saved.ep.I, L = saved.mine.lent.size();
  home.returned_dW13 = alloc_rows<floatX>(L * w13, Mem::Grads, "llep.returned_dW13");
  home.returned_dW2 = alloc_rows<floatX>(L * w2, Mem::Grads, "llep.returned_dW2");
  stream_after(xs, cs, "llep_send_gradients_home");
  llep_return_gradients(saved, home.borrowed_dW13, home.borrowed_dW2, home.returned_dW13, home.returned_dW2, ep, xs);
}

// Backward, last (cs, after the gradients came home): the home adds each returned gradient, in plan
// order, to its expert's dW*_local (+=); every buffer of `home` freed.
inline void llep_add_gradients_home(LLEPGradsHome& home, const LLEPSaved& saved, floatX* dW13_local, floatX* dW2_local,
                                    cudaStream_t cs) {
  const int E_l = saved.plan.local_experts;
  const size_t w13 = (size_t)2 * saved.ep.I * saved.ep.H, w2 = (size_t)saved.ep.H * saved.ep.I;
  pool().free(home.borrowed_dW13);
  pool().free(home.borrowed_dW2);
  for (size_t j = 0; j < saved.mine.lent.size(); j++) {
    const int l = saved.mine.lent[j].expert % E_l;
    add_inplace_or_out(dW13_local + l * w13, dW13_local + l * w13, home.returned_dW13 + j * w13, w13, cs);
    add_inplace_or_out(dW2_local + l * w2, dW2_local + l * w2, home.returned_dW2 + j * w2, w2, cs);
  }
  pool().free(home.returned_dW13);
  pool().free(home.returned_dW2);
  home = LLEPGradsHome();
}

// out [N,H] (=; nullptr: no combine, see ep_moe_forward_planned); fills `saved` (which must be
// empty: llep_saved_free it after backward). Collective over `ep`. Synchronises `stream` three times
// (moe_route_plan's counts, the all-gather of the counts, the upload of the send order).
inline void llep_forward(floatX* out, LLEPSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                         const floatX* W13_local, const floatX* W2_local, int N, int H, int I, int E, int k, double alpha,
                         long long min_rows, const Comm& ep, cudaStream_t stream) {
  const char* op = "llep_forward";
  ep_moe_check(op, saved.ep, N, H, I, E, k, ep);
  const int R = N * k, W = ep.size;
  EPSaved& es = saved.ep;
  es.N = N; es.H = H; es.I = I; es.E = E; es.k = k;

  // plan: sort routes by expert, all-gather the counts, the group's plan, this rank's share
  es.route_of_slot = alloc_rows<int>(R, Mem::Dispatch, "llep.route_of_slot");
  es.slot_of_route = alloc_rows<int>(R, Mem::Dispatch, "llep.slot_of_route");
  std::vector<int> routes_per_expert = moe_route_plan(es.route_of_slot, es.slot_of_route, topk_idx, R, E, stream);
  std::vector<long long> mine_to_all;
  for (int d = 0; d < W; d++) mine_to_all.insert(mine_to_all.end(), routes_per_expert.begin(), routes_per_expert.end());
  const std::vector<long long> counts = all_to_all_host(ep, mine_to_all, E, stream);
  llep_adopt_plan(saved, llep_plan(counts, W, alpha, min_rows), counts, ep.rank);

  // the route maps in send order
  int* send_slot = alloc_rows<int>(R, Mem::Workspace, "llep.send_slot_of_row");
  copy_to_device(send_slot, saved.mine.send_slot_of_row.data(), (size_t)R * sizeof(int), stream, op);
  llep_send_order(es, send_slot, stream);
  pool().free(send_slot);

  // lent weights, home → helper; the pass
  llep_alloc_borrowed(saved);
  llep_lend_weights(saved, W13_local, W2_local, ep, stream);
  ep_moe_forward_planned(out, es, x, topk_w, llep_group_weights(saved, W13_local, W2_local), ep, op, stream);
}

// dx [N,H] (=), dtopk_w [N,k] (=), dW13_local [E_l,2I,H] (+=), dW2_local [E_l,H,I] (+=): every route
// of this rank's experts, wherever it was computed. Collective over `ep`. Does not synchronise.
inline void llep_backward(floatX* dx, float* dtopk_w, floatX* dW13_local, floatX* dW2_local, const floatX* dout,
                          const LLEPSaved& saved, const float* topk_w, const floatX* W13_local, const floatX* W2_local,
                          const Comm& ep, cudaStream_t stream) {
  LLEPGradsHome home;
  llep_zero_borrowed_grads(home, saved, stream);
  const GroupGrads grads =
      llep_group_grads(saved.mine, saved.plan.local_experts, saved.ep.H, saved.ep.I, home, dW13_local, dW2_local);
  ep_moe_backward_planned(dx, dtopk_w, grads, dout, saved.ep, topk_w, llep_group_weights(saved, W13_local, W2_local),
                          ep, "llep_backward", stream);
  llep_send_gradients_home(home, saved, ep, stream, stream);
  llep_add_gradients_home(home, saved, dW13_local, dW2_local, stream);
}

// --moe llep: the dispatcher seam (ops/moe.cuh) over this rank's expert-parallel group, with the
// plan's α (--llep_alpha) and smallest helper piece (--llep_min_rows).
struct LLEPDispatcher : MoEDispatcher {
  struct Saved : DispatchSaved {
    LLEPSaved llep;
    ~Saved() override { llep_saved_free(llep); }
  };
  Comm group;
  double alpha;
  long long min_rows;
  LLEPDispatcher(int H_, int I_, int E_, int k_, const Comm& ep_group, double alpha_, long long min_rows_)
      : MoEDispatcher(H_, I_, E_, k_), group(ep_group), alpha(alpha_), min_rows(min_rows_) {}
  std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                         const floatX* W13, const floatX* W2, int N, cudaStream_t stream) override {
    auto saved = std::make_unique<Saved>();
    llep_forward(out, saved->llep, x, topk_idx, topk_w, W13, W2, N, H, I, E, k, alpha, min_rows, group, stream);
    return saved;
  }
  void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const DispatchSaved& saved,
                const floatX*, const int*, const float* topk_w, const floatX* W13, const floatX* W2,
                cudaStream_t stream) override {
    llep_backward(dx, dtopk_w, dW13, dW2, dout, static_cast<const Saved&>(saved).llep, topk_w, W13, W2, group, stream);
  }
  DispatchBound live_bound(int N) const override {
    return llep_live_bound(ep_moe_live_bound(N, H, I, E / group.size, k, group.size, sizeof(floatX)), H, I, E, group.size,
                           sizeof(floatX));
  }
};
