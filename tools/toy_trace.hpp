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
// All of it lives in ep_moe_forward / ep_moe_forward_planned. The backward (ep_moe_backward_planned)
// runs the same path the other way, replaying the forward's plan (no counts exchanged):
//   9 dy at the source    moe_combine_backward: dy = w·dout in send order, dtopk_w = dout·y
//  10 dy out              all_to_all_v (dy_sent → dy_recv), then expert-major (moe_permute_rows)
//  11 expert backward     experts_backward_to_h13 (da, dW2 +=, dh13), grouped GEMMs (dW13 +=, dxe)
//  12 dx back             ep_scatter_rows, reverse all_to_all_v, moe_combine: dx[n] = Σ_j dxp[slot]
// An expert's dW13, dW2 sum the routes of every source and stay on the expert's rank.
// After each step: the bytes each rank holds per pool category (runtime/pool.cuh's Mem: dispatch,
// expert_intermediates), buffer by buffer as ep_moe.cuh allocates and frees them (Ledger). The checks:
// each rank's out, dx, dtopk_w and its experts' dW13, dW2 equal its shard of ref::moe_forward /
// moe_backward over the global batch (ref/ep_moe.hpp's ep_moe_shard), to 1e-12.
// Then the ring operators' toys on the same inputs, one line per step (toy_pllep, toy_relay,
// toy_ring_dtp, below), and Ulysses' all-to-all on 2 ranks and 4 heads (toy_ulysses).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <map>
#include <ostream>
#include <random>
#include <string>
#include <vector>
#include "config.hpp"
#include "ref/cross_entropy.hpp"
#include "ref/ep_moe.hpp"
#include "ref/llep.hpp"
#include "ref/moe.hpp"
#include "ref/pipelined_llep.hpp"
#include "ref/relay_moe.hpp"
#include "ref/ring_dtp.hpp"
#include "ref/ulysses.hpp"

namespace toy {

using Mat = ref::Mat<double>;
const int RANKS = 2, N = 4, E = 4, K = 2, H = 4, I = 3, E_L = E / RANKS;  // expert e: rank e / E_L, local e % E_L
const int B = 4;  // bytes per activation scalar in the bytes the toy prints: the FP32 build's floatX

// Hand-picked routing, [rank][token][slot] → global expert, weight (descending, as the router orders
// them). Rank 0 receives 11 routes (experts 0, 1), rank 1 only 5 (expert 2); expert 3 gets none.
const int TOPK_IDX[RANKS][N][K] = {{{0, 2}, {1, 0}, {2, 1}, {0, 1}}, {{2, 0}, {1, 2}, {0, 1}, {2, 1}}};
const double TOPK_W[RANKS][N][K] = {{{.6, .4}, {.7, .3}, {.5, .5}, {.8, .2}}, {{.6, .4}, {.9, .1}, {.7, .3}, {.6, .4}}};

// One rank's device pool (runtime/pool.cuh) as ops/ep_moe.cuh uses it: the live buffers, by tag, and
// their bytes per category (mem_name's names: "dispatch", "expert_intermediates").
struct Ledger {
  struct Buffer {
    std::string tag, category;
    long long bytes;
  };
  std::vector<Buffer> live;
  std::map<std::string, long long> held, peak, step_peak;  // per category: now, over the run, since the step began
  void alloc(const std::string& category, const std::string& tag, long long bytes) {
    live.push_back({tag, category, bytes});
    held[category] += bytes;
    peak[category] = std::max(peak[category], held[category]);
    step_peak[category] = std::max(step_peak[category], held[category]);
  }
  void free(const std::string& tag) {
    for (size_t i = 0; i < live.size(); i++)
      if (live[i].tag == tag) {
        held[live[i].category] -= live[i].bytes;
        live.erase(live.begin() + i);
        return;
      }
    throw std::logic_error("toy Ledger: free of " + tag + ", which is not live");
  }
};
const char* const DISPATCH = "dispatch";                  // Mem::Dispatch: routed rows and their maps
const char* const INTERMEDIATES = "expert_intermediates";  // Mem::ExpertIntermediates: h13, a, da, dh13

struct Rank {
  Mat x, topk_w;                          // [N,H], [N,K]
  ref::MatI topk_idx;                     // [N,K]
  std::vector<int> route_of_slot, slot_of_route, routes_per_expert;  // [N·K], [N·K], [E]
  std::vector<long long> send_rows, recv_rows;                       // [RANKS]
  std::vector<int> group_rows, group_offsets, recv_row_of_slot;      // [E_L], [E_L], [R_d]
  std::vector<ref::EPRoute> recv_route;   // [R_d] the route each x_recv row carries (source-major)
  std::vector<ref::EPRoute> slot_route;   // [R_d] the route each xe row carries (expert-major)
  Mat x_sent, x_recv, xe, h13, a, y_group, y_recv, y, out;
  Mat dout, dtopk_w, dy_sent, dy_recv, dy_group, dxe, dx_recv, dxp, dx;  // backward: [N,H] [N,K] then as forward
  std::vector<Mat> dW13, dW2;             // [E_L] this rank's experts' weight gradients, [2I,H] and [H,I]
  Ledger pool;
};

struct Result {
  std::vector<Mat> W13, W2;    // [E] all experts' weights, [2I,H] and [H,I]: rank d holds experts d·E_L …
  std::vector<Rank> ranks;
  std::vector<Mat> reference;  // [RANKS] each rank's rows of ref::moe_forward over the global batch
  std::vector<ref::EPShard<double>> shards;  // [RANKS] each rank's shard of forward and backward (ref/ep_moe.hpp)
  double max_diff = 0;         // max |out − reference| over every rank
  double grad_max_diff = 0;    // max |dx, dtopk_w, dW13, dW2 − the shard's| over every rank
};

// Fixed inputs: entries are multiples of 0.1 in [-1, 1] from mt19937 (the same on every platform).
inline Mat draw(std::mt19937& rng, int rows, int cols) {
  Mat m(rows, cols);
  for (int i = 0; i < rows * cols; i++) m(i / cols, i % cols) = ((int)(rng() % 21) - 10) / 10.0;
  return m;
}

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

// After a step: each rank's bytes per category now and at most during the step, and its live buffers.
inline void print_bytes(std::ostream& os, std::vector<Rank>& rk) {
  for (int d = 0; d < RANKS; d++) {
    Ledger& p = rk[d].pool;
    std::string tags;
    for (const Ledger::Buffer& b : p.live) tags += " " + b.tag;
    os << fmt("  [bytes] rank %d: %s %lld (step peak %lld), %s %lld (step peak %lld); live:%s\n", d, DISPATCH,
              p.held[DISPATCH], p.step_peak[DISPATCH], INTERMEDIATES, p.held[INTERMEDIATES], p.step_peak[INTERMEDIATES],
              tags.empty() ? " nothing" : tags.c_str());
    p.step_peak = p.held;
  }
}

// The sources whose routes rank d computed for its local expert l, as "rank 0: 3, rank 1: 2".
inline std::string sources_of(const Rank& q, int l) {
  std::vector<int> per_source(RANKS, 0);
  for (int i = q.group_offsets[l]; i < q.group_offsets[l] + q.group_rows[l]; i++) per_source[q.slot_route[i].source]++;
  std::string s;
  for (int src = 0; src < RANKS; src++) s += fmt("%srank %d: %d", src ? ", " : "", src, per_source[src]);
  return s;
}

inline Result toy_trace(std::ostream& os) {
  std::mt19937 rng(17);
  auto draw = [&](int rows, int cols) { return toy::draw(rng, rows, cols); };
  Result res;
  std::vector<Rank>& rk = res.ranks;
  rk.resize(RANKS);
  std::vector<Mat>& W13 = res.W13;  // all E experts; rank d holds W13[d·E_L .. d·E_L+E_L−1]
  std::vector<Mat>& W2 = res.W2;
  for (int e = 0; e < E; e++) W13.push_back(draw(2 * I, H)), W2.push_back(draw(H, I));
  os << fmt("Toy MoE layer through standard expert parallelism (ops/ep_moe.cuh), on the CPU\n"
            "  %d ranks, N = %d tokens each, E = %d experts (expert e on rank e/%d as local expert e%%%d),\n"
            "  top-%d, H = %d, I = %d; W13[e] [2I,H], W2[e] [H,I] drawn from mt19937(17), not printed.\n"
            "  Row labels: 1:t2j0 = rank 1's token 2, slot 0 (route r = n*k + j = 4 of rank 1).\n"
            "  [bytes]: what each rank's pool holds after the step, b = %d bytes per scalar (the FP32 build).\n",
            RANKS, N, E, E_L, E_L, K, H, I, B);
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
    q.pool.alloc(DISPATCH, "route_of_slot", 4 * N * K);
    q.pool.alloc(DISPATCH, "slot_of_route", 4 * N * K);
  }
  print_bytes(os, rk);

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
  // ep_moe_forward exchanges the counts (step 4) before it packs: R_d, the rows rank d receives, is known.
  for (int d = 0; d < RANKS; d++) {
    long long R_d = 0;
    for (int s = 0; s < RANKS; s++) R_d += rk[s].send_rows[d];
    rk[d].pool.alloc(DISPATCH, "recv_row_of_slot", 4 * R_d);
    rk[d].pool.alloc(DISPATCH, "x_sent", (long long)N * K * H * B);
  }
  print_bytes(os, rk);

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
    q.pool.alloc(DISPATCH, "x_recv", (long long)q.recv_route.size() * H * B);
  }
  print_bytes(os, rk);

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
    q.pool.free("x_sent");
    q.pool.alloc(DISPATCH, "xe", (long long)R_d * H * B);
    q.pool.free("x_recv");
  }
  print_bytes(os, rk);

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
    // h13 is kept for backward; experts_swiglu_down frees a as soon as y is computed
    q.pool.alloc(INTERMEDIATES, "h13", (long long)R_d * 2 * I * B);
    q.pool.alloc(DISPATCH, "y_group", (long long)R_d * H * B);
    q.pool.alloc(INTERMEDIATES, "a", (long long)R_d * I * B);
    q.pool.free("a");
  }
  print_bytes(os, rk);

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
    q.pool.alloc(DISPATCH, "y_recv", (long long)q.y_group.rows() * H * B);
    q.pool.free("y_group");
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
    q.pool.alloc(DISPATCH, "y", (long long)N * K * H * B);  // kept for backward (dtopk_w = dout·y)
  }
  print_bytes(os, rk);

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
    q.pool.free("y_recv");
  }
  print_bytes(os, rk);

  // 9. The backward starts at the source: the combine's gradient gives every route's dy and dtopk_w.
  os << "\n--- backward: dout given, dx back; the forward's plan is replayed (no counts exchanged) ---\n"
        "9. dy at the source: dy[slot] = w[n,j] * dout[n] (send order, as x_sent), dtopk_w[n,j] = dout[n].y[slot]\n";
  for (int s = 0; s < RANKS; s++) {
    Rank& q = rk[s];
    q.dout = draw(N, H);
    q.dy_sent.resize(N * K, H);
    q.dtopk_w.resize(N, K);
    for (int slot = 0; slot < N * K; slot++) {
      const int r = q.route_of_slot[slot], n = r / K, j = r % K;
      q.dy_sent.row(slot) = q.topk_w(n, j) * q.dout.row(n);
      q.dtopk_w(n, j) = q.dout.row(n).dot(q.y.row(slot));
    }
    for (int n = 0; n < N; n++)
      os << fmt("  rank %d: dout[%d] %s   dtopk_w[%d] %s\n", s, n, row(q.dout, n).c_str(), n, row(q.dtopk_w, n).c_str());
    q.pool.alloc(DISPATCH, "dy_sent", (long long)N * K * H * B);
  }
  print_bytes(os, rk);

  // 10. dy travels as x did (same send_rows / recv_rows), then is regrouped as xe was.
  os << "\n10. dy out: all_to_all_v with the forward's send_rows / recv_rows (dy_recv, source-major as x_recv),\n"
        "    then dy_group[slot] = dy_recv[recv_row_of_slot[slot]] (expert-major, as xe)\n";
  for (int d = 0; d < RANKS; d++) {
    Rank& q = rk[d];
    const int R_d = (int)q.recv_route.size();
    q.dy_recv.resize(R_d, H);
    for (int i = 0; i < R_d; i++) {  // row i of the source-major buffer is the source's route in send order
      const ref::EPRoute& r = q.recv_route[i];
      q.dy_recv.row(i) = rk[r.source].dy_sent.row(rk[r.source].slot_of_route[r.token * K + r.slot]);
    }
    q.dy_group.resize(R_d, H);
    for (int slot = 0; slot < R_d; slot++) q.dy_group.row(slot) = q.dy_recv.row(q.recv_row_of_slot[slot]);
    os << "  rank " << d << ": recv_rows " << list(q.recv_rows) << "   R_d = " << R_d << " rows of dy\n";
    q.pool.alloc(DISPATCH, "dy_recv", (long long)R_d * H * B);
    q.pool.free("dy_sent");
    q.pool.alloc(DISPATCH, "dy", (long long)R_d * H * B);
    q.pool.free("dy_recv");
  }
  print_bytes(os, rk);

  // 11. Per local expert: the SwiGLU backward, the weight gradients (summed over every source's
  // routes: they stay here, with the expert) and dxe, the rows' input gradients.
  os << "\n11. expert backward per local expert: da = dy W2 [R_d,I], dW2 += dy^T a, dh13 = swiglu'(h13) da [R_d,2I],\n"
        "    dW13 += dh13^T xe, dxe = dh13 W13 [R_d,H]\n";
  for (int d = 0; d < RANKS; d++) {
    Rank& q = rk[d];
    const int R_d = (int)q.xe.rows();
    q.dxe.resize(R_d, H);
    for (int l = 0; l < E_L; l++) {
      const int e = d * E_L + l, first = q.group_offsets[l], rows = q.group_rows[l];
      const Mat da = q.dy_group.middleRows(first, rows) * W2[e];
      Mat dh13(rows, 2 * I);
      for (int i = 0; i < rows; i++)
        for (int c = 0; c < I; c++) {
          const double h1 = q.h13(first + i, c), h3 = q.h13(first + i, I + c);
          dh13(i, c) = da(i, c) * h3 * ref::silu_grad(h1);
          dh13(i, I + c) = da(i, c) * ref::silu(h1);
        }
      q.dW2.push_back(q.dy_group.middleRows(first, rows).transpose() * q.a.middleRows(first, rows));
      q.dW13.push_back(dh13.transpose() * q.xe.middleRows(first, rows));
      q.dxe.middleRows(first, rows) = dh13 * W13[e];
      os << fmt("  rank %d expert %d: %d routes (%s): |dW13| %.3f |dW2| %.3f, kept on rank %d\n", d, e, rows,
                sources_of(q, l).c_str(), q.dW13.back().norm(), q.dW2.back().norm(), d);
    }
    for (int i = 0; i < R_d; i++)
      os << fmt("  rank %d slot %2d%s  dxe %s\n", d, i, label(q.slot_route[i]).c_str(), row(q.dxe, i).c_str());
    // experts_backward_to_h13 (H13::Keep: h13 is the saved state): a again, da; then dh13; then dxe
    q.pool.alloc(INTERMEDIATES, "a", (long long)R_d * I * B);
    q.pool.alloc(INTERMEDIATES, "da", (long long)R_d * I * B);
    q.pool.free("a");
    q.pool.free("dy");
    q.pool.alloc(INTERMEDIATES, "dh13", (long long)R_d * 2 * I * B);
    q.pool.free("da");
    q.pool.alloc(DISPATCH, "dxe", (long long)R_d * H * B);
    q.pool.free("dh13");
  }
  print_bytes(os, rk);

  // 12. dxe goes home the way y did, and each token sums its k rows' gradients.
  os << "\n12. dx back: dx_recv[recv_row_of_slot[slot]] = dxe[slot], the reverse all_to_all_v (dxp, send order),\n"
        "    then at the source dx[n] = sum_j dxp[slot_of_route[n*k+j]]\n";
  for (int s = 0; s < RANKS; s++) rk[s].dxp.resize(N * K, H);
  for (int d = 0; d < RANKS; d++) {
    Rank& q = rk[d];
    const int R_d = (int)q.dxe.rows();
    q.dx_recv.resize(R_d, H);
    for (int slot = 0; slot < R_d; slot++) q.dx_recv.row(q.recv_row_of_slot[slot]) = q.dxe.row(slot);
    for (int i = 0; i < R_d; i++) {
      const ref::EPRoute& r = q.recv_route[i];
      rk[r.source].dxp.row(rk[r.source].slot_of_route[r.token * K + r.slot]) = q.dx_recv.row(i);
    }
    q.pool.alloc(DISPATCH, "dx_recv", (long long)R_d * H * B);
    q.pool.free("dxe");
  }
  for (int s = 0; s < RANKS; s++) {
    Rank& q = rk[s];
    q.dx = Mat::Zero(N, H);
    for (int n = 0; n < N; n++) {
      std::string terms;
      for (int j = 0; j < K; j++) {
        const int slot = q.slot_of_route[n * K + j];
        q.dx.row(n) += q.dxp.row(slot);
        terms += fmt("%sdxp[%d]", j ? " + " : "", slot);
      }
      os << fmt("  rank %d: dx[%d] = %s = %s\n", s, n, terms.c_str(), row(q.dx, n).c_str());
    }
    q.pool.alloc(DISPATCH, "dx_sent", (long long)N * K * H * B);  // the received dxp
    q.pool.free("dx_recv");
    q.pool.free("dx_sent");
  }
  print_bytes(os, rk);
  os << "  ep_saved_free: the forward's saved state goes (route maps, recv_row_of_slot, xe, h13, y)\n";
  for (Rank& q : rk)
    for (const char* tag : {"route_of_slot", "slot_of_route", "recv_row_of_slot", "xe", "h13", "y"}) q.pool.free(tag);
  print_bytes(os, rk);
  os << "  peak bytes over forward and backward:";
  for (int d = 0; d < RANKS; d++)
    os << fmt(" rank %d %s %lld %s %lld;", d, DISPATCH, rk[d].pool.peak[DISPATCH], INTERMEDIATES, rk[d].pool.peak[INTERMEDIATES]);
  os << "\n  (ops/ep_moe.cuh's closed forms: dispatch 4(2R + R_d) + H b (R + 2 R_d + max(R, R_d)), expert_intermediates 5 R_d I b)\n";

  // Check: each rank's shard of the single-process MoE over the global batch (rank s holds tokens [s·N, (s+1)·N)).
  Mat x(RANKS * N, H), topk_w(RANKS * N, K), dout(RANKS * N, H);
  ref::MatI topk_idx(RANKS * N, K);
  for (int s = 0; s < RANKS; s++) {
    x.middleRows(s * N, N) = rk[s].x, topk_w.middleRows(s * N, N) = rk[s].topk_w, topk_idx.middleRows(s * N, N) = rk[s].topk_idx;
    dout.middleRows(s * N, N) = rk[s].dout;
  }
  for (int s = 0; s < RANKS; s++) {
    res.shards.push_back(ref::ep_moe_shard(x, topk_idx, topk_w, dout, W13, W2, RANKS, s));
    const ref::EPShard<double>& want = res.shards.back();
    res.reference.push_back(want.out);
    res.max_diff = std::max(res.max_diff, (rk[s].out - want.out).cwiseAbs().maxCoeff());
    double g = std::max((rk[s].dx - want.dx).cwiseAbs().maxCoeff(), (rk[s].dtopk_w - want.dtopk_w).cwiseAbs().maxCoeff());
    for (int l = 0; l < E_L; l++)
      g = std::max({g, (rk[s].dW13[l] - want.dW13[l]).cwiseAbs().maxCoeff(), (rk[s].dW2[l] - want.dW2[l]).cwiseAbs().maxCoeff()});
    res.grad_max_diff = std::max(res.grad_max_diff, g);
  }
  os << fmt("\nref::ep_moe_shard over the global batch (ref/ep_moe.hpp): out %s: max |diff| = %.3g; "
            "dx, dtopk_w, dW13, dW2 %s: max |diff| = %.3g\n",
            res.max_diff <= 1e-12 ? "matches the reference" : "DIFFERS from the reference", res.max_diff,
            res.grad_max_diff <= 1e-12 ? "match" : "DIFFER", res.grad_max_diff);
  return res;
}

// The toy's routing per rank as the ring twins take it: topk_idx[s] flattened, route n·k + j at n·k + j.
inline std::vector<std::vector<int>> flat_routes(const Result& res) {
  std::vector<std::vector<int>> routes(RANKS);
  for (int s = 0; s < RANKS; s++)
    for (int r = 0; r < N * K; r++) routes[s].push_back(res.ranks[s].topk_idx(r / K, r % K));
  return routes;
}

// PipelinedLLEP (ops/pipelined_llep.cuh) on the toy's routing: K chunks of strided tokens, each with
// its own LLEP plan. The schedule is ref/pipelined_llep.hpp's and ref/llep.hpp's, the twins that
// tests/cpu_llep_plan.cu checks the operator's host-side plan (pllep_plan, llep_plan) against.
struct PllepToy {
  int chunks = 0, c_eff = 0;
  long long bound = 0;                         // E_p · k · c_eff: routes any rank receives in one chunk
  std::vector<std::vector<long long>> received;  // [chunk][rank]
  std::vector<long long> llep_received, ep_received;  // [rank] LLEP (one chunk) and standard EP
};
inline PllepToy toy_pllep(std::ostream& os, const Result& res, int token_budget = 2, int max_chunks = 4,
                          double alpha = 1.0, long long min_rows = 1) {
  PllepToy t;
  const std::vector<int> tokens(RANKS, N);
  t.chunks = ref::pllep_chunks(tokens, token_budget, max_chunks);
  t.c_eff = ref::pllep_largest_chunk(tokens, t.chunks);
  t.bound = (long long)RANKS * K * t.c_eff;
  const auto routes = flat_routes(res);
  os << fmt("\nPipelinedLLEP (ops/pipelined_llep.cuh) on the same routing: token budget c = %d, K_max = %d -> K = %d chunks,\n"
            "  chunk i = tokens {i, i+K, ...} of every rank, c_eff = %d; LLEP plan per chunk (alpha %.1f, min_rows %lld);\n"
            "  bound: any rank receives <= E_p*k*c_eff = %lld routes per chunk\n",
            token_budget, max_chunks, t.chunks, t.c_eff, alpha, min_rows, t.bound);
  auto plan_line = [&](const std::vector<std::vector<long long>>& counts, std::vector<long long>& received) {
    const ref::LLEPAssignment a = ref::llep_assign(counts, alpha, min_rows);
    const auto rows = ref::llep_rows(counts, a);
    std::vector<long long> per_expert(E, 0);
    for (int s = 0; s < RANKS; s++)
      for (int e = 0; e < E; e++) per_expert[e] += counts[s][e];
    std::string line = "routes per expert " + list(per_expert) + fmt(", cap %lld;", a.capacity);
    received.assign(RANKS, 0);
    for (int d = 0; d < RANKS; d++) {
      std::vector<long long> from;
      for (int s = 0; s < RANKS; s++) received[d] += rows[s][d], from.push_back(rows[s][d]);
      line += fmt(" rank %d computes %lld (from sources %s);", d, received[d], list(from).c_str());
    }
    for (const auto& tr : ref::llep_weight_transfers(a, RANKS))
      line += fmt(" expert %d's weights %d -> %d, its dW back;", tr[0], tr[1], tr[2]);
    return line;
  };
  const auto counts = ref::pllep_chunk_counts(routes, K, E, t.chunks);
  for (int i = 0; i < t.chunks; i++) {
    t.received.emplace_back();
    std::string line = plan_line(counts[i], t.received.back());
    long long most = *std::max_element(t.received.back().begin(), t.received.back().end());
    os << fmt("  chunk %d: %s max received %lld %s %lld\n", i, line.c_str(), most, most <= t.bound ? "<=" : "EXCEEDS", t.bound);
  }
  const auto whole = ref::pllep_chunk_counts(routes, K, E, 1)[0];
  os << "  LLEP (one chunk): " << plan_line(whole, t.llep_received) << "\n";
  for (int d = 0; d < RANKS; d++) t.ep_received.push_back((long long)res.ranks[d].recv_route.size());
  os << "  standard EP: rank d receives R_d = " << list(t.ep_received) << " (the EP toy's step 4): no bound but the router's\n";
  return t;
}

// RelayMoE (ops/relay_moe.cuh) on the toy's inputs, both modes, through its twin ref/relay_moe.hpp:
// one line per hop, forward and backward. Per-hop volumes: notes/design.md §6.4's formulas (the
// operator's relay_expert_hop_bytes / relay_token_hop_bytes live in the .cuh).
struct RelayToy {
  ref::RelayRun<double> expert, token;
  long long expert_hop_bytes = 0, token_hop_bytes = 0;  // forward, per hop, b = B and b_acc = 4
  double max_diff = 0;                                   // both modes against the EP toy's shards
};
inline RelayToy toy_relay(std::ostream& os, const Result& res) {
  RelayToy t;
  std::vector<Mat> x, topk_w, dout;
  std::vector<ref::MatI> topk_idx;
  for (const Rank& q : res.ranks) x.push_back(q.x), topk_w.push_back(q.topk_w), dout.push_back(q.dout), topk_idx.push_back(q.topk_idx);
  t.expert = ref::relay_expert_mode(x, topk_idx, topk_w, dout, res.W13, res.W2);
  t.token = ref::relay_token_mode(x, topk_idx, topk_w, dout, res.W13, res.W2);
  t.expert_hop_bytes = (long long)E_L * 3 * H * I * B;
  t.token_hop_bytes = (long long)N * H * B + (long long)N * H * 4 + (long long)N * K * 8;
  os << fmt("\nRelayMoE (ops/relay_moe.cuh) on the same inputs: at hop h rank r works with (r - h) mod E_p,\n"
            "  then hands it to rank r+1. Per hop: experts E_l*3*H*I*b = %lld B, tokens N*H*(b + 4) + N*k*8 = %lld B:\n"
            "  auto picks %s. Elements handed on after the hop (W: weights, rows: x/dout, acc: accumulators, routing):\n",
            t.expert_hop_bytes, t.token_hop_bytes, t.token_hop_bytes < t.expert_hop_bytes ? "token" : "expert");
  // pairs computed at (rank r, visitor v): routes of r's tokens to partition v (expert mode), of
  // source v's tokens to r's experts (token mode)
  auto pairs = [&](int tokens_of, int experts_of) {
    int n = 0;
    for (int r = 0; r < N * K; r++) n += res.ranks[tokens_of].topk_idx(r / K, r % K) / E_L == experts_of;
    return n;
  };
  auto hops = [&](const char* mode, const char* pass, const std::vector<ref::RelayHop>& rec, bool expert_mode) {
    for (int h = 0; h < RANKS; h++) {
      std::string line;
      for (const ref::RelayHop& r : rec)
        if (r.hop == h)
          line += fmt(" rank %d: %s %d, %d pairs, hands on W %lld rows %lld acc %lld routing %lld;", r.rank,
                      expert_mode ? "partition" : "block of rank", r.visitor,
                      expert_mode ? pairs(r.rank, r.visitor) : pairs(r.visitor, r.rank), r.weight_elems, r.row_elems,
                      r.acc_elems, r.routing_pairs);
      os << fmt("  %s %s hop %d:%s\n", mode, pass, h, line.c_str());
    }
  };
  hops("expert mode", "forward ", t.expert.forward, true);
  hops("expert mode", "backward", t.expert.backward, true);
  os << "  expert mode: each partition's dW accumulator ends at its owner after the last hop; dx stays with the tokens\n";
  hops("token mode ", "forward ", t.token.forward, false);
  hops("token mode ", "backward", t.token.backward, false);
  os << "  token mode: each block (out; then dx, dtopk_w) ends at its source after the last hop; dW stays with the experts\n";
  for (const ref::RelayRun<double>* run : {&t.expert, &t.token})
    for (int s = 0; s < RANKS; s++) {
      const ref::EPShard<double>&got = run->shards[s], &want = res.shards[s];
      double d = std::max({(got.out - want.out).cwiseAbs().maxCoeff(), (got.dx - want.dx).cwiseAbs().maxCoeff(),
                           (got.dtopk_w - want.dtopk_w).cwiseAbs().maxCoeff()});
      for (int l = 0; l < E_L; l++)
        d = std::max({d, (got.dW13[l] - want.dW13[l]).cwiseAbs().maxCoeff(), (got.dW2[l] - want.dW2[l]).cwiseAbs().maxCoeff()});
      t.max_diff = std::max(t.max_diff, d);
    }
  os << fmt("  both modes' out, dx, dtopk_w, dW13, dW2 against the EP toy's shards: max |diff| = %.3g\n", t.max_diff);
  return t;
}

// Ring-DTP (ops/ring_dtp.cuh): the toy's x as each rank's batch, a head W [V,H] split by vocabulary,
// through its twin ref/ring_dtp.hpp; one line per round. The vocabulary split is config.hpp's
// vocab_interval; the auto rule (weights move when N > ⌈V/P⌉) is ring_dtp_choose's, from the .cuh.
const int V = 6;  // the toy head's vocabulary: V/P = 3 < N, so the weights move
struct RingDTPToy {
  ref::RingDTPRun<double> run;
  bool weights_move = false;
  double max_diff = 0;  // loss sums, dx and dW shards against full logits (ref/cross_entropy.hpp)
};
inline RingDTPToy toy_ring_dtp(std::ostream& os, const Result& res) {
  RingDTPToy t;
  std::mt19937 rng(19);
  const Mat W = draw(rng, V, H);
  std::vector<Mat> x;
  std::vector<ref::MatI> targets;
  std::vector<std::pair<int, int>> intervals;
  for (int r = 0; r < RANKS; r++) {
    x.push_back(res.ranks[r].x);
    targets.push_back(ref::MatI(N, 1));
    for (int n = 0; n < N; n++) targets.back()(n, 0) = (int)(rng() % V);
    intervals.push_back(vocab_interval(V, RANKS, r));
  }
  const int widest = (V + RANKS - 1) / RANKS;
  t.weights_move = N > widest;
  const ref::RingDTPMoves moves = t.weights_move ? ref::RingDTPMoves::Weights : ref::RingDTPMoves::Activations;
  t.run = ref::ring_dtp(moves, x, targets, W, intervals, 1.0, 2);
  os << fmt("\nRing-DTP (ops/ring_dtp.cuh): each rank's x [N=%d,H] meets every vocabulary shard of W [V=%d,H] (rank r: rows\n"
            "  [rV/P, (r+1)V/P)) once per round, logits in blocks of <= 2 columns (online softmax); N %s ceil(V/P) = %d:\n"
            "  the %s travel. Elements handed on after the round (W: shard rows x H, rows: x rows, stats: per-row values):\n",
            N, V, t.weights_move ? ">" : "<=", widest, t.weights_move ? "weight shards" : "batches");
  auto rounds = [&](const char* pass, const std::vector<ref::RingDTPRound>& rec) {
    for (int round = 0; round < RANKS; round++) {
      std::string line;
      for (const ref::RingDTPRound& m : rec)
        if (m.round == round) {
          const int b = t.weights_move ? m.rank : m.visitor, sh = t.weights_move ? m.visitor : m.rank;
          line += fmt(" rank %d: batch %d x shard %d [%d,%d), hands on W %lld rows %lld stats %lld;", m.rank, b, sh,
                      intervals[sh].first, intervals[sh].second, m.weight_elems, m.row_elems, m.stat_elems);
        }
      os << fmt("  %s round %d:%s\n", pass, round, line.c_str());
    }
  };
  rounds("forward ", t.run.forward);
  rounds("backward", t.run.backward);
  os << fmt("  widest logits block: %lld columns (never N x V)\n", t.run.widest_block);
  // the plain computation: every batch's full logits [N,V]; shard r's dW = Σ_q dlogits_q[:, its columns]ᵀ x_q
  std::string losses;
  Mat dW = Mat::Zero(V, H);
  for (int r = 0; r < RANKS; r++) {
    ref::Vec<double> lse;
    const Mat logits = x[r] * W.transpose();
    const double loss = ref::loss_sum(ref::cross_entropy_forward(logits, targets[r], lse));
    const Mat dlogits = ref::cross_entropy_backward(logits, targets[r], 1.0);
    dW += dlogits.transpose() * x[r];
    t.max_diff = std::max({t.max_diff, std::abs(t.run.loss_sum[r] - loss), (t.run.dx[r] - dlogits * W).cwiseAbs().maxCoeff()});
    losses += fmt("%s%.4f", r ? ", " : "", t.run.loss_sum[r]);
  }
  for (int r = 0; r < RANKS; r++) {
    const Mat want = dW.middleRows(intervals[r].first, intervals[r].second - intervals[r].first);
    t.max_diff = std::max(t.max_diff, (t.run.dW[r] - want).cwiseAbs().maxCoeff());
  }
  os << fmt("  loss sums [%s]; loss sums, dx and dW shards against full logits (ref/cross_entropy.hpp): max |diff| = %.3g\n",
            losses.c_str(), t.max_diff);
  return t;
}

// Ulysses (ops/ulysses.cuh) through its twin ref/ulysses.hpp: 2 ranks share one sequence of T = 4
// tokens with 4 heads of one element (config.hpp's sequence_split: rank r holds tokens [2r, 2r + 2),
// and the heads [2r, 2r + 2) in attention). Each element is labelled by its token and head ("t2h1"); the
// toy prints who holds which before the exchange, the message each rank sends each peer (the pack's
// contiguous blocks), who holds which after it, and after the reverse exchange.
const int UL_RANKS = 2, UL_T = 4, UL_HEADS = 4;
struct UlyssesToy {
  ref::UlyssesShape shape{1, UL_T, 1, UL_HEADS, 1, UL_RANKS};
  std::vector<std::vector<double>> sequence, heads, back;  // [rank]: before, after to_heads, after to_sequence
  long long staging_bytes = 0;                             // per rank, either direction: 2·B·(T/D)·G·nh·hd·b
};
inline std::string ulysses_cells(const std::vector<double>& values, size_t from, size_t to, size_t per_token) {
  std::string s;
  for (size_t i = from; i < to; i++) {
    const int v = (int)values[i];
    s += fmt("%st%dh%d", i == from ? "" : i % per_token == 0 ? " | " : " ", v / 10, v % 10);
  }
  return s;
}
inline UlyssesToy toy_ulysses(std::ostream& os) {
  UlyssesToy t;
  const ref::UlyssesShape& s = t.shape;
  std::vector<double> global;  // 10·t + h
  for (int tok = 0; tok < UL_T; tok++)
    for (int h = 0; h < UL_HEADS; h++) global.push_back(10 * tok + h);
  t.sequence = ref::ulysses_sequence_shards(global, s);
  t.heads = ref::ulysses_to_heads(t.sequence, s);
  t.back = ref::ulysses_to_sequence(t.heads, s);
  t.staging_bytes = 2LL * s.B * (s.T / s.D) * s.parts * s.heads * s.head_dim * B;
  const size_t T_local = UL_T / UL_RANKS, heads_local = UL_HEADS / UL_RANKS, message = T_local * heads_local;
  auto split = [](int r) { return sequence_split(r, UL_RANKS, UL_HEADS, UL_T, UL_RANKS); };
  os << fmt("\nUlysses (ops/ulysses.cuh): %d ranks share a sequence of T = %d tokens with nh = %d heads (tNhM: token N,\n"
            "  head M). Attention needs whole sequences: an all-to-all trades tokens for heads, and back.\n"
            "  before: sequence shards [T/D = %zu tokens, nh = %d heads], each rank's tokens from config.hpp's sequence_split\n",
            UL_RANKS, UL_T, UL_HEADS, T_local, UL_HEADS);
  for (int r = 0; r < UL_RANKS; r++)
    os << fmt("    rank %d, tokens [%d, %d): %s\n", r, split(r).first_token, split(r).end_token,
              ulysses_cells(t.sequence[r], 0, t.sequence[r].size(), UL_HEADS).c_str());
  os << fmt("  pack: the message to each peer p contiguous, [p, T/D tokens, nh/D heads]: peer p's heads of my tokens\n");
  for (int r = 0; r < UL_RANKS; r++) {
    std::string line;
    for (int p = 0; p < UL_RANKS; p++)  // the block of peer p's head shard that came from rank r
      line += fmt("%sto rank %d: %s", p ? "; " : "", p,
                  ulysses_cells(t.heads[p], r * message, (r + 1) * message, heads_local).c_str());
    os << fmt("    rank %d sends %s\n", r, line.c_str());
  }
  os << fmt("  all-to-all, unpack: head shards [T = %d tokens, nh/D = %zu heads]\n", UL_T, heads_local);
  for (int r = 0; r < UL_RANKS; r++)
    os << fmt("    rank %d, heads [%d, %d): %s\n", r, split(r).first_head, split(r).end_head,
              ulysses_cells(t.heads[r], 0, t.heads[r].size(), heads_local).c_str());
  os << "  attention runs here, on whole sequences of each rank's heads; the reverse exchange (ulysses_to_sequence,\n"
        "  also the forward's backward) brings its output back to the sequence shards:\n";
  for (int r = 0; r < UL_RANKS; r++)
    os << fmt("    rank %d, tokens [%d, %d): %s\n", r, split(r).first_token, split(r).end_token,
              ulysses_cells(t.back[r], 0, t.back[r].size(), UL_HEADS).c_str());
  os << fmt("  [bytes] each rank, either direction: comm_staging %lld (send + receive buffers, 2·B·(T/D)·G·nh·hd·b)\n",
            t.staging_bytes);
  return t;
}

}  // namespace toy
