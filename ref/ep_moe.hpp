// ref/ep_moe.hpp — what each rank of standard expert parallelism must hold (twin of ops/ep_moe.cuh),
// as plain math over the GLOBAL inputs; no exchange, no plan.
//   Global batch: the ranks' token shards one after the other; rank s holds tokens [s·N, (s+1)·N)
//   of x [ranks·N, H], topk_idx / topk_w [ranks·N, k] (global expert ids), dout [ranks·N, H].
//   Experts: rank d owns the E_l = E / ranks experts [d·E_l, (d+1)·E_l).
//   Rank d's shard = its token rows of out, dx, dtopk_w and its experts' dW13, dW2 (all "=", fresh),
//   taken from ref::moe_forward / moe_backward over the global batch.
// Dispatch bookkeeping: the routes rank d receives are the (source s, token n, slot j) with
// topk_idx[s·N + n, j] owned by d (n local to s); the two orders in which it holds them are
//   as received   source ascending, then local expert, then route n·k + j ascending
//   by expert     local expert ascending, then source, then route n·k + j ascending (the GEMM order)
#pragma once
#include <algorithm>
#include <tuple>
#include "moe.hpp"

namespace ref {

template <typename T>
struct EPShard {
  Mat<T> out;                // [N,H]  rank's tokens
  Mat<T> dx;                 // [N,H]  rank's tokens
  Mat<T> dtopk_w;            // [N,k]  rank's tokens
  std::vector<Mat<T>> dW13;  // E_l × [2I,H]  rank's experts
  std::vector<Mat<T>> dW2;   // E_l × [H,I]   rank's experts
};

// Rank `rank`'s shard of the MoE FFN over the global batch (global shapes above; W13, W2: all E experts).
template <typename T>
EPShard<T> ep_moe_shard(const Mat<T>& x, const MatI& topk_idx, const Mat<T>& topk_w, const Mat<T>& dout,
                        const std::vector<Mat<T>>& W13, const std::vector<Mat<T>>& W2, int ranks, int rank) {
  const int N = (int)x.rows() / ranks, E_l = (int)W13.size() / ranks;
  Mat<T> out = moe_forward(x, topk_idx, topk_w, W13, W2);
  MoEGrads<T> g = moe_backward(dout, x, topk_idx, topk_w, W13, W2);
  EPShard<T> shard;
  shard.out = out.middleRows(rank * N, N);
  shard.dx = g.dx.middleRows(rank * N, N);
  shard.dtopk_w = g.dtopk_w.middleRows(rank * N, N);
  shard.dW13.assign(g.dW13.begin() + rank * E_l, g.dW13.begin() + (rank + 1) * E_l);
  shard.dW2.assign(g.dW2.begin() + rank * E_l, g.dW2.begin() + (rank + 1) * E_l);
  return shard;
}

struct EPRoute {
  int source, token, slot;  // token local to the source rank
  bool operator==(const EPRoute& o) const { return source == o.source && token == o.token && slot == o.slot; }
};

enum class EPOrder { AsReceived, ByExpert };

// The routes of the global topk_idx [ranks·N, k] that rank `rank` receives, in the given order.
inline std::vector<EPRoute> ep_received_routes(const MatI& topk_idx, int E, int ranks, int rank, EPOrder order) {
  const int N = (int)topk_idx.rows() / ranks, k = (int)topk_idx.cols(), E_l = E / ranks;
  std::vector<std::tuple<int, int, int, EPRoute>> keyed;  // (first key, second key, route n·k+j, route)
  for (int s = 0; s < ranks; s++)
    for (int n = 0; n < N; n++)
      for (int j = 0; j < k; j++) {
        int e = topk_idx(s * N + n, j);
        if (e / E_l != rank) continue;
        int l = e % E_l;
        EPRoute route{s, n, j};
        if (order == EPOrder::AsReceived) keyed.emplace_back(s, l, n * k + j, route);
        else keyed.emplace_back(l, s, n * k + j, route);
      }
  std::sort(keyed.begin(), keyed.end(), [](const auto& a, const auto& b) {
    return std::make_tuple(std::get<0>(a), std::get<1>(a), std::get<2>(a)) <
           std::make_tuple(std::get<0>(b), std::get<1>(b), std::get<2>(b));
  });
  std::vector<EPRoute> routes;
  for (const auto& t : keyed) routes.push_back(std::get<3>(t));
  return routes;
}

}  // namespace ref
