// tools/toy_trace.hpp — one toy MoE layer traced through standard expert parallelism, on the CPU,
// printing the arrays at each step so that one can follow a token's rows from its rank to its
// experts' ranks and back (`make toy`; tests/cpu_toy_trace.cpp checks it). Plain C++ and Eigen in
// double: it does by hand, for 2 simulated ranks, what ops/ep_moe.cuh does on W GPUs, with the GPU
// code's array names. Each step and the function of ops/ep_moe.cuh / ops/moe.cuh that does it:
//   1 routes              the router's topk_idx / topk_w (ops/router.cuh), the input of ep_moe_forward
//   2 sort by expert      moe_route_plan: route_of_slot, slot_of_route, routes per expert
//   3 send layout         ep_plan (send_rows) and moe_permute_rows (x rows into send order: x_sent)
//   4 exchange            all_to_all_host (counts: received_per_source_expert), ep_plan (recv_rows),
//                         all_to_all_v (x_sent → x_recv, source-major)
//   5 regroup             ep_recv_row_map (recv_row_of_slot), moe_permute_rows (x_recv → xe, expert-major)
//   6 grouped GEMM        grouped_gemm (h13 = xe W13ᵀ), experts_swiglu_down (a = swiglu(h13), y = a W2ᵀ)
//   7 back                ep_scatter_rows (expert-major → source-major y_recv), all_to_all_v (→ y, send order)
//   8 combine             moe_combine: out[n] = Σ_j topk_w[n,j] · y[slot_of_route[n·k+j]]
// All of it lives in ep_moe_forward / ep_moe_forward_planned. The check: each rank's out equals its
// rows of ref::moe_forward over the global batch (ref/moe.hpp), to 1e-12.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <ostream>
#include <random>
#include <string>
#include <vector>
#include "ref/ep_moe.hpp"
#include "ref/moe.hpp"

namespace toy {

using Mat = ref::Mat<double>;
const int RANKS = 2, N = 4, E = 4, K = 2, H = 4, I = 3, E_L = E / RANKS;  // expert e: rank e / E_L, local e % E_L

// Hand-picked routing, [rank][token][slot] → global expert, weight (descending, as the router orders
// them). Rank 0 receives 11 routes (experts 0, 1), rank 1 only 5 (expert 2); expert 3 gets none.
const int TOPK_IDX[RANKS][N][K] = {{{0, 2}, {1, 0}, {2, 1}, {0, 1}}, {{2, 0}, {1, 2}, {0, 1}, {2, 1}}};
const double TOPK_W[RANKS][N][K] = {{{.6, .4}, {.7, .3}, {.5, .5}, {.8, .2}}, {{.6, .4}, {.9, .1}, {.7, .3}, {.6, .4}}};

struct Rank {
  Mat x, topk_w;                          // [N,H], [N,K]
  ref::MatI topk_idx;                     // [N,K]
  std::vector<int> route_of_slot, slot_of_route, routes_per_expert;  // [N·K], [N·K], [E]
  std::vector<long long> send_rows, recv_rows;                       // [RANKS]
  std::vector<int> group_rows, group_offsets, recv_row_of_slot;      // [E_L], [E_L], [R_d]
  std::vector<ref::EPRoute> recv_route;   // [R_d] the route each x_recv row carries (source-major)
  std::vector<ref::EPRoute> slot_route;   // [R_d] the route each xe row carries (expert-major)
  Mat x_sent, x_recv, xe, h13, a, y_group, y_recv, y, out;
};

struct Result {
  std::vector<Mat> W13, W2;    // [E] all experts' weights, [2I,H] and [H,I]: rank d holds experts d·E_L …
  std::vector<Rank> ranks;
  std::vector<Mat> reference;  // [RANKS] each rank's rows of ref::moe_forward over the global batch
  double max_diff = 0;         // max |out − reference| over every rank
};

inline std::string fmt(const char* f, ...) {  // printf into a std::string
  va_list ap, ap2;
  va_start(ap, f);
  va_copy(ap2, ap);
  std::string s((size_t)vsnprintf(nullptr, 0, f, ap) + 1, '\0');
  vsnprintf(&s[0], s.size(), f, ap2);
  va_end(ap2);
  va_end(ap);
  s.pop_back();
  return s;
}
// "1:t2j0" = rank 1's token 2, slot 0: the route r = n·K + j of source rank s.
inline std::string label(const ref::EPRoute& r) { return fmt(" %d:t%dj%d", r.source, r.token, r.slot); }
inline std::string row(const Mat& m, Eigen::Index i) {
  std::string s = "[";
  for (Eigen::Index c = 0; c < m.cols(); c++) s += fmt("%7.3f", m(i, c));
  return s + " ]";
}
template <typename V>
std::string list(const V& v, size_t split = 0) {  // "[3 3 | 2 3]" with a bar every `split` entries
  std::string s = "[";
  for (size_t i = 0; i < v.size(); i++) s += (i ? (split && i % split == 0 ? " | " : " ") : "") + std::to_string(v[i]);
  return s + "]";
}

inline Result toy_trace(std::ostream& os) {
  // Fixed inputs: entries are multiples of 0.1 in [-1, 1] from mt19937 (the same on every platform).
  std::mt19937 rng(17);
  auto draw = [&](int rows, int cols) {
    Mat m(rows, cols);
    for (int i = 0; i < rows * cols; i++) m(i / cols, i % cols) = ((int)(rng() % 21) - 10) / 10.0;
    return m;
  };
  Result res;
  std::vector<Rank>& rk = res.ranks;
  rk.resize(RANKS);
  std::vector<Mat>& W13 = res.W13;  // all E experts; rank d holds W13[d·E_L .. d·E_L+E_L−1]
  std::vector<Mat>& W2 = res.W2;
  for (int e = 0; e < E; e++) W13.push_back(draw(2 * I, H)), W2.push_back(draw(H, I));
  os << fmt("Toy MoE layer through standard expert parallelism (ops/ep_moe.cuh), on the CPU\n"
            "  %d ranks, N = %d tokens each, E = %d experts (expert e on rank e/%d as local expert e%%%d),\n"
            "  top-%d, H = %d, I = %d; W13[e] [2I,H], W2[e] [H,I] drawn from mt19937(17), not printed.\n"
            "  Row labels: 1:t2j0 = rank 1's token 2, slot 0 (route r = n*k + j = 4 of rank 1).\n",
            RANKS, N, E, E_L, E_L, K, H, I);
  os << "x, the token rows:\n";
  for (int s = 0; s < RANKS; s++) {
    rk[s].x = draw(N, H);
    rk[s].topk_idx.resize(N, K);
    rk[s].topk_w.resize(N, K);
    for (int n = 0; n < N; n++)
      for (int j = 0; j < K; j++) rk[s].topk_idx(n, j) = TOPK_IDX[s][n][j], rk[s].topk_w(n, j) = TOPK_W[s][n][j];
    for (int n = 0; n < N; n++) os << fmt("  %d:t%d %s%s", s, n, row(rk[s].x, n).c_str(), n % 2 ? "\n" : "");
  }

  os << "\n1. routes: route r = n*k + j -> expert topk_idx[n,j], weight topk_w[n,j]\n";
  for (int s = 0; s < RANKS; s++) {
    std::string r = "", e = "", w = "";
    for (int i = 0; i < N * K; i++)
      r += fmt("%5d", i), e += fmt("%5d", rk[s].topk_idx(i / K, i % K)), w += fmt("%5.1f", rk[s].topk_w(i / K, i % K));
    os << "  rank " << s << ": r " << r << "\n          e " << e << "\n          w " << w << "\n";
  }

  // 2. A stable counting sort of the routes by expert: slot = position in expert order.
  os << "\n2. route slots, sorted by expert (stable: route order inside an expert) — moe_route_plan\n";
  for (int s = 0; s < RANKS; s++) {
    Rank& q = rk[s];
    q.routes_per_expert.assign(E, 0);
    for (int r = 0; r < N * K; r++) q.routes_per_expert[q.topk_idx(r / K, r % K)]++;
    std::vector<int> next(E, 0);  // first slot of each expert, then the next free one
    for (int e = 1; e < E; e++) next[e] = next[e - 1] + q.routes_per_expert[e - 1];
    q.route_of_slot.assign(N * K, 0);
    q.slot_of_route.assign(N * K, 0);
    for (int r = 0; r < N * K; r++) {
      int slot = next[q.topk_idx(r / K, r % K)]++;
      q.route_of_slot[slot] = r, q.slot_of_route[r] = slot;
    }
    os << "  rank " << s << ": route_of_slot " << list(q.route_of_slot) << "   slot_of_route "
       << list(q.slot_of_route) << "\n          routes per expert " << list(q.routes_per_expert) << "\n";
  }

  // 3. Experts are contiguous per rank, so expert order is destination order: the send buffer is the
  // x rows in slot order, and rank d's part is the slots of its experts.
  os << "\n3. send layout: x_sent[slot] = x[route_of_slot[slot] / k]; send_rows[d] rows go to rank d\n";
  for (int s = 0; s < RANKS; s++) {
    Rank& q = rk[s];
    q.send_rows.assign(RANKS, 0);
    for (int e = 0; e < E; e++) q.send_rows[e / E_L] += q.routes_per_expert[e];
    q.x_sent.resize(N * K, H);
    std::string rows;
    for (int slot = 0; slot < N * K; slot++) {
      int r = q.route_of_slot[slot];
      q.x_sent.row(slot) = q.x.row(r / K);
      rows += label({s, r / K, r % K});
    }
    os << "  rank " << s << ": send_rows " << list(q.send_rows) << "   x_sent" << rows << "\n";
  }

  // 4. Each rank tells each other how many rows of each local expert it sends (a count exchange), then
  // the rows move (all_to_all_v): rank d receives source 0's part for d, then source 1's, ...
  os << "\n4. exchange: counts (all_to_all_host), then rows (all_to_all_v), received source-major\n";
  for (int d = 0; d < RANKS; d++) {
    Rank& q = rk[d];
    std::vector<long long> per_source_expert;  // entry s·E_L + l: routes of source s for local expert l
    q.recv_rows.assign(RANKS, 0);
    for (int s = 0; s < RANKS; s++) {
      for (int l = 0; l < E_L; l++) per_source_expert.push_back(rk[s].routes_per_expert[d * E_L + l]);
      q.recv_rows[s] = rk[s].send_rows[d];
      long long first = 0;  // where source s's part for rank d starts in its send buffer
      for (int d2 = 0; d2 < d; d2++) first += rk[s].send_rows[d2];
      for (long long i = first; i < first + q.recv_rows[s]; i++) {
        int r = rk[s].route_of_slot[i];
        q.recv_route.push_back({s, r / K, r % K});
      }
    }
    q.x_recv.resize(q.recv_route.size(), H);
    std::string rows;
    for (size_t i = 0; i < q.recv_route.size(); i++) {
      const ref::EPRoute& r = q.recv_route[i];
      q.x_recv.row(i) = rk[r.source].x.row(r.token);
      rows += label(r) + (i + 1 < q.recv_route.size() && r.source != q.recv_route[i + 1].source ? " |" : "");
    }
    os << "  rank " << d << ": received_per_source_expert " << list(per_source_expert, E_L) << "   recv_rows "
       << list(q.recv_rows) << "   R_d = " << q.recv_route.size() << "\n          x_recv" << rows << "\n";
  }

  // 5. The GEMM wants each local expert's rows together: expert-major slot → source-major row.
  os << "\n5. regroup expert-major (local expert, then source, then route): xe[slot] = x_recv[recv_row_of_slot[slot]]\n";
  for (int d = 0; d < RANKS; d++) {
    Rank& q = rk[d];
    const int R_d = (int)q.recv_route.size();
    q.group_rows.assign(E_L, 0);
    q.group_offsets.assign(E_L, 0);
    for (const ref::EPRoute& r : q.recv_route) q.group_rows[rk[r.source].topk_idx(r.token, r.slot) % E_L]++;
    for (int l = 1; l < E_L; l++) q.group_offsets[l] = q.group_offsets[l - 1] + q.group_rows[l - 1];
    std::vector<int> next = q.group_offsets;  // source-major rows, visited in order, are route-ordered per (s, l)
    q.recv_row_of_slot.assign(R_d, 0);
    for (int i = 0; i < R_d; i++) {
      const ref::EPRoute& r = q.recv_route[i];
      q.recv_row_of_slot[next[rk[r.source].topk_idx(r.token, r.slot) % E_L]++] = i;
    }
    q.xe.resize(R_d, H);
    std::string rows;
    for (int slot = 0; slot < R_d; slot++) {
      q.xe.row(slot) = q.x_recv.row(q.recv_row_of_slot[slot]);
      q.slot_route.push_back(q.recv_route[q.recv_row_of_slot[slot]]);
      for (int l = 0; l < E_L; l++)
        if (q.group_offsets[l] == slot && q.group_rows[l] > 0) rows += fmt(" e%d:", d * E_L + l);
      rows += label(q.slot_route.back());
    }
    os << "  rank " << d << ": group_rows " << list(q.group_rows) << "   recv_row_of_slot " << list(q.recv_row_of_slot)
       << "\n          xe" << rows << "\n";
  }

  // 6. One GEMM per local expert with rows (an expert with none is left out of the grouped GEMM).
  os << "\n6. grouped GEMM per local expert: h13 = xe W13^T [R_d,2I], a = silu(h1)*h3 [R_d,I], y = a W2^T [R_d,H]\n";
  for (int d = 0; d < RANKS; d++) {
    Rank& q = rk[d];
    const int R_d = (int)q.xe.rows();
    q.h13.resize(R_d, 2 * I), q.a.resize(R_d, I), q.y_group.resize(R_d, H);
    for (int l = 0; l < E_L; l++) {
      const int e = d * E_L + l, first = q.group_offsets[l], rows = q.group_rows[l];
      if (rows == 0) os << "  rank " << d << " expert " << e << ": no rows, no GEMM\n";
      q.h13.middleRows(first, rows) = q.xe.middleRows(first, rows) * W13[e].transpose();
      for (int i = first; i < first + rows; i++)
        for (int c = 0; c < I; c++) q.a(i, c) = ref::silu(q.h13(i, c)) * q.h13(i, I + c);
      q.y_group.middleRows(first, rows) = q.a.middleRows(first, rows) * W2[e].transpose();
      for (int i = first; i < first + rows; i++)
        os << fmt("  rank %d slot %2d e%d%s  a %s y %s\n", d, i, e, label(q.slot_route[i]).c_str(), row(q.a, i).c_str(),
                  row(q.y_group, i).c_str());
    }
  }

  // 7. The inverse path: y rows back to source-major order, then the reverse all_to_all_v; each source
  // receives its rows in exactly the order it sent them (send order, = slot order).
  os << "\n7. back: y_recv[recv_row_of_slot[slot]] = y_group[slot] (source-major, as x_recv),\n"
        "   then the reverse all_to_all_v: each source gets its rows back in send order, y[slot]\n";
  for (int d = 0; d < RANKS; d++) {
    Rank& q = rk[d];
    q.y_recv.resize(q.y_group.rows(), H);
    for (int slot = 0; slot < (int)q.y_group.rows(); slot++) q.y_recv.row(q.recv_row_of_slot[slot]) = q.y_group.row(slot);
    std::string rows;
    for (const ref::EPRoute& r : q.recv_route) rows += label(r);
    os << "  rank " << d << ": y_recv" << rows << "\n";
  }
  for (int s = 0; s < RANKS; s++) {
    Rank& q = rk[s];
    q.y.resize(N * K, H);
    int slot = 0;
    for (int d = 0; d < RANKS; d++) {
      long long first = 0;  // where source s's rows start in rank d's source-major buffer
      for (int s2 = 0; s2 < s; s2++) first += rk[d].recv_rows[s2];
      for (long long i = first; i < first + rk[d].recv_rows[s]; i++) q.y.row(slot++) = rk[d].y_recv.row(i);
    }
    std::string rows;
    for (int i = 0; i < N * K; i++) rows += label({s, q.route_of_slot[i] / K, q.route_of_slot[i] % K});
    os << "  rank " << s << ": recv_rows back " << list(q.send_rows) << "   y" << rows << "\n";
  }

  // 8. Each token sums its k expert outputs, weighted; slot_of_route finds route n·k+j's row of y.
  os << "\n8. combine at the source: out[n] = sum_j w[n,j] * y[slot_of_route[n*k+j]]\n";
  for (int s = 0; s < RANKS; s++) {
    Rank& q = rk[s];
    q.out = Mat::Zero(N, H);
    for (int n = 0; n < N; n++) {
      std::string terms;
      for (int j = 0; j < K; j++) {
        int slot = q.slot_of_route[n * K + j];
        q.out.row(n) += q.topk_w(n, j) * q.y.row(slot);
        terms += fmt("%s%.1f*y[%d]", j ? " + " : "", q.topk_w(n, j), slot);
      }
      os << fmt("  rank %d: out[%d] = %s = %s\n", s, n, terms.c_str(), row(q.out, n).c_str());
    }
  }

  // Check: the single-process MoE over the global batch (rank s holds tokens [s·N, (s+1)·N)).
  Mat x(RANKS * N, H), topk_w(RANKS * N, K);
  ref::MatI topk_idx(RANKS * N, K);
  for (int s = 0; s < RANKS; s++)
    x.middleRows(s * N, N) = rk[s].x, topk_w.middleRows(s * N, N) = rk[s].topk_w, topk_idx.middleRows(s * N, N) = rk[s].topk_idx;
  Mat full = ref::moe_forward(x, topk_idx, topk_w, W13, W2);
  for (int s = 0; s < RANKS; s++) {
    res.reference.push_back(full.middleRows(s * N, N));
    res.max_diff = std::max(res.max_diff, (rk[s].out - res.reference[s]).cwiseAbs().maxCoeff());
  }
  os << fmt("\nref::moe_forward over the global batch (ref/moe.hpp): %s: max |diff| = %.3g\n",
            res.max_diff <= 1e-12 ? "matches the reference" : "DIFFERS from the reference", res.max_diff);
  return res;
}

}  // namespace toy
