// ref/llep.hpp — LLEP's plan in plain code (twin of the host-side plan of ops/llep.cuh): the rules of
// notes/design.md §6.2 applied one route at a time, every load counted afresh when it is needed. What each rank
// computes is then ref/moe.hpp over the global batch, as for standard EP (ref/ep_moe.hpp).
//   counts[s][e]  routes of source rank s to expert e; C_e = Σ_s counts[s][e]; T = Σ_e C_e
//   home(e)       e / E_l, E_l = E / E_p
//   cap           ⌈α·T / E_p⌉ with α to 6 decimals, at most T: the least c with c·E_p·10^6 ≥ round(α·10^6)·T
//   expert order  C_e descending, ties by the lower id; experts without routes are skipped
//   load(r)       routes already given to r + routes of r's own experts not handled yet (the expert
//                 being handled no longer counts)
//   each expert   its routes in list order (source 0's in route order, then source 1's, ...): to the
//                 home while load(home) < cap; then, until none is left, to the helper (≠ home) of
//                 least load (ties: lower rank) as many as max(cap − load(helper), min_rows), or what is left
#pragma once
#include <algorithm>
#include <array>
#include <cmath>
#include <stdexcept>
#include <vector>

namespace ref {

struct LLEPAssignment {
  long long capacity = 0;
  std::vector<std::vector<int>> rank_of_route;  // [E][C_e]: the rank that computes route p of expert e's list
};

inline LLEPAssignment llep_assign(const std::vector<std::vector<long long>>& counts, double alpha, long long min_rows) {
  const int ranks = (int)counts.size(), E = (int)counts[0].size(), E_l = E / ranks;
  std::vector<long long> routes(E, 0);
  long long total = 0;
  for (int s = 0; s < ranks; s++)
    for (int e = 0; e < E; e++) {
      routes[e] += counts[s][e];
      total += counts[s][e];
    }
  LLEPAssignment a;
  const __int128 per_rank = (__int128)1000000 * ranks;
  a.capacity = std::min(total, (long long)(((__int128)std::llround(alpha * 1e6) * total + per_rank - 1) / per_rank));

  std::vector<bool> handled(E, false);
  std::vector<long long> given(ranks, 0);
  auto load = [&](int r) {
    long long l = given[r];
    for (int e = r * E_l; e < (r + 1) * E_l; e++)
      if (!handled[e]) l += routes[e];
    return l;
  };
  std::vector<int> order;
  for (int e = 0; e < E; e++)
    if (routes[e] > 0) order.push_back(e);
  std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return routes[x] > routes[y]; });

  a.rank_of_route.resize(E);
  for (int e : order) {
    const int home = e / E_l;
    std::vector<int>& rank_of = a.rank_of_route[e];
    auto give = [&](int r) {
      rank_of.push_back(r);
      given[r]++;
    };
    handled[e] = true;
    while ((long long)rank_of.size() < routes[e] && load(home) < a.capacity) give(home);
    while ((long long)rank_of.size() < routes[e]) {
      int helper = -1;
      for (int r = 0; r < ranks; r++)
        if (r != home && (helper < 0 || load(r) < load(helper))) helper = r;
      if (helper < 0) throw std::logic_error("llep_assign: an expert overflows its home and there is no other rank");
      const long long take = std::max(a.capacity - load(helper), min_rows);
      for (long long i = 0; i < take && (long long)rank_of.size() < routes[e]; i++) give(helper);
    }
  }
  return a;
}

// rows[s][d]: routes of source s that rank d computes (walking every route of every expert's list).
inline std::vector<std::vector<long long>> llep_rows(const std::vector<std::vector<long long>>& counts,
                                                     const LLEPAssignment& a) {
  const int ranks = (int)counts.size(), E = (int)counts[0].size();
  std::vector<std::vector<long long>> rows(ranks, std::vector<long long>(ranks, 0));
  for (int e = 0; e < E; e++) {
    size_t p = 0;
    for (int s = 0; s < ranks; s++)
      for (long long i = 0; i < counts[s][e]; i++) rows[s][a.rank_of_route[e][p++]]++;
  }
  return rows;
}

// (expert, home, helper): every rank other than the home that computes routes of an expert, in the
// order the helpers first appear along the expert's list.
inline std::vector<std::array<int, 3>> llep_weight_transfers(const LLEPAssignment& a, int ranks) {
  const int E = (int)a.rank_of_route.size(), E_l = E / ranks;
  std::vector<std::array<int, 3>> transfers;
  for (int e = 0; e < E; e++) {
    std::vector<bool> seen(ranks, false);
    seen[e / E_l] = true;
    for (int r : a.rank_of_route[e])
      if (!seen[r]) {
        seen[r] = true;
        transfers.push_back({e, e / E_l, r});
      }
  }
  return transfers;
}

}  // namespace ref
