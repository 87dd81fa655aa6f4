// ref/relay_moe.hpp — RelayMoE's ring in plain math (twin of ops/relay_moe.cuh): E_p ranks in a ring,
// hop by hop, forward and backward, in both modes. Nothing here computes who holds what: after every
// hop each rank hands what travels to its right neighbour, and a rank works with whatever arrived.
// The math of each (token, expert) pair is ref/moe.hpp's; what the twin adds is where and when it
// happens, and a record of every hop (what each rank held, what it sent on).
//   expert mode  tokens stay; a partition (E_l experts' W13, W2) travels; backward: the partition and
//                its weight-gradient accumulator travel, the accumulator one more hop at the end.
//   token mode   experts stay; a block (its source's x rows, routing, output accumulator) travels;
//                backward: x, dout, routing and the dx and dtopk_w accumulators travel, one more hop
//                at the end; weight gradients stay where the experts live.
// Inputs per rank r: x[r] [N_r,H], topk_idx[r] [N_r,k] (global expert ids), topk_w[r] [N_r,k],
// dout[r] [N_r,H]; all E experts' W13 [2I,H] and W2 [H,I] (rank r owns [r·E_l, (r+1)·E_l)).
#pragma once
#include <stdexcept>
#include <string>
#include <vector>
#include "ep_moe.hpp"

namespace ref {

// One rank at one hop: what it worked with (the partition, or the block's source rank) and the
// elements it handed on afterwards, by kind (the volume model of ops/relay_moe.cuh counts them).
struct RelayHop {
  int rank = 0, hop = 0, visitor = 0;
  long long weight_elems = 0;   // W13 + W2 entries (expert mode)
  long long row_elems = 0;      // x / dout rows, H per token (token mode)
  long long acc_elems = 0;      // accumulators: out or dx rows (token mode), weight gradients (expert mode backward)
  long long routing_pairs = 0;  // (index, weight) pairs of a block's routing (token mode), and dtopk_w entries in backward
};

template <typename T>
struct RelayRun {
  std::vector<EPShard<T>> shards;                // [E_p] each rank's out, dx, dtopk_w and its experts' dW13, dW2
  std::vector<RelayHop> forward, backward;       // every (rank, hop), hop-major
  std::vector<std::vector<int>> computed;        // [E_p][N_r·k]: times each route was computed in forward
};

namespace relay_detail {

// One (token, expert) pair: y = W2 (silu(h1) ⊙ h3), h = W13 x; backward adds dW13, dW2 (+=) and
// returns dx; dtopk_w = dout · y.
template <typename T>
struct Pair {
  Vec<T> h, a, y;
  Pair(const Mat<T>& W13, const Mat<T>& W2, const Vec<T>& x) : h(W13 * x) {
    const Eigen::Index I = W2.cols();
    a.resize(I);
    for (Eigen::Index i = 0; i < I; i++) a(i) = silu(h(i)) * h(I + i);
    y = W2 * a;
  }
  Vec<T> backward(const Mat<T>& W13, const Mat<T>& W2, const Vec<T>& x, const Vec<T>& dy, Mat<T>& dW13, Mat<T>& dW2) const {
    const Eigen::Index I = W2.cols();
    Vec<T> da = W2.transpose() * dy, dh(2 * I);
    dW2 += dy * a.transpose();
    for (Eigen::Index i = 0; i < I; i++) {
      dh(i) = da(i) * h(I + i) * silu_grad(h(i));
      dh(I + i) = da(i) * silu(h(i));
    }
    dW13 += dh * x.transpose();
    return W13.transpose() * dh;
  }
};

template <typename T>
std::vector<Mat<T>> zeros_like(const std::vector<Mat<T>>& mats) {
  std::vector<Mat<T>> z;
  for (const Mat<T>& m : mats) z.push_back(Mat<T>::Zero(m.rows(), m.cols()));
  return z;
}

}  // namespace relay_detail

// The ring in expert mode (tokens stay, partitions travel).
template <typename T>
RelayRun<T> relay_expert_mode(const std::vector<Mat<T>>& x, const std::vector<MatI>& topk_idx,
                              const std::vector<Mat<T>>& topk_w, const std::vector<Mat<T>>& dout,
                              const std::vector<Mat<T>>& W13, const std::vector<Mat<T>>& W2) {
  using namespace relay_detail;
  const int ranks = (int)x.size(), E_l = (int)W13.size() / ranks, k = (int)topk_idx[0].cols();
  struct Partition {
    int id = -1;
    std::vector<Mat<T>> W13, W2, dW13, dW2;  // weights; the weight-gradient accumulator (backward)
  };
  auto own = [&](int r) {
    Partition p;
    p.id = r;
    p.W13.assign(W13.begin() + r * E_l, W13.begin() + (r + 1) * E_l);
    p.W2.assign(W2.begin() + r * E_l, W2.begin() + (r + 1) * E_l);
    return p;
  };
  auto weight_elems = [](const Partition& p) {
    long long n = 0;
    for (size_t e = 0; e < p.W13.size(); e++) n += p.W13[e].size() + p.W2[e].size();
    return n;
  };
  RelayRun<T> run;
  run.shards.resize(ranks);
  std::vector<Partition> held(ranks);
  for (int r = 0; r < ranks; r++) {
    held[r] = own(r);
    run.shards[r].out = Mat<T>::Zero(x[r].rows(), x[r].cols());
    run.computed.push_back(std::vector<int>(topk_idx[r].size(), 0));
  }
  // forward: each rank's routes to the partition it holds, into its output
  for (int hop = 0; hop < ranks; hop++) {
    for (int r = 0; r < ranks; r++) {
      const Partition& p = held[r];
      for (Eigen::Index n = 0; n < x[r].rows(); n++)
        for (int j = 0; j < k; j++) {
          const int e = topk_idx[r](n, j);
          if (e / E_l != p.id) continue;
          const Pair<T> pair(p.W13[e % E_l], p.W2[e % E_l], x[r].row(n).transpose());
          run.shards[r].out.row(n) += topk_w[r](n, j) * pair.y.transpose();
          run.computed[r][n * k + j]++;
        }
      run.forward.push_back(RelayHop{r, hop, p.id, hop + 1 < ranks ? weight_elems(p) : 0, 0, 0, 0});
    }
    if (hop + 1 < ranks) ring_pass_right(held);
  }
  // backward: the same ring from each rank's own partition, with its zeroed weight-gradient accumulator
  for (int r = 0; r < ranks; r++) {
    held[r] = own(r);
    held[r].dW13 = zeros_like(held[r].W13);
    held[r].dW2 = zeros_like(held[r].W2);
    run.shards[r].dx = Mat<T>::Zero(x[r].rows(), x[r].cols());
    run.shards[r].dtopk_w = Mat<T>::Zero(x[r].rows(), k);
  }
  for (int hop = 0; hop < ranks; hop++) {
    for (int r = 0; r < ranks; r++) {
      Partition& p = held[r];
      for (Eigen::Index n = 0; n < x[r].rows(); n++)
        for (int j = 0; j < k; j++) {
          const int e = topk_idx[r](n, j), l = e % E_l;
          if (e / E_l != p.id) continue;
          const Vec<T> xn = x[r].row(n).transpose(), dout_n = dout[r].row(n).transpose();
          const Pair<T> pair(p.W13[l], p.W2[l], xn);  // this hop's intermediates, recomputed
          run.shards[r].dtopk_w(n, j) = dout_n.dot(pair.y);
          run.shards[r].dx.row(n) += pair.backward(p.W13[l], p.W2[l], xn, topk_w[r](n, j) * dout_n, p.dW13[l], p.dW2[l]).transpose();
        }
      long long acc = 0;
      for (size_t e = 0; e < p.dW13.size(); e++) acc += p.dW13[e].size() + p.dW2[e].size();
      run.backward.push_back(RelayHop{r, hop, p.id, hop + 1 < ranks ? weight_elems(p) : 0, 0, acc, 0});
    }
    ring_pass_right(held);  // after the last hop only the accumulators' pass matters: it takes each one home
  }
  for (int r = 0; r < ranks; r++) {
    if (held[r].id != r) throw std::logic_error("relay_expert_mode: an accumulator did not end at its owner");
    run.shards[r].dW13 = held[r].dW13;
    run.shards[r].dW2 = held[r].dW2;
  }
  return run;
}

// The ring in token mode (experts stay, token blocks travel).
template <typename T>
RelayRun<T> relay_token_mode(const std::vector<Mat<T>>& x, const std::vector<MatI>& topk_idx,
                             const std::vector<Mat<T>>& topk_w, const std::vector<Mat<T>>& dout,
                             const std::vector<Mat<T>>& W13, const std::vector<Mat<T>>& W2) {
  using namespace relay_detail;
  const int ranks = (int)x.size(), E_l = (int)W13.size() / ranks, k = (int)topk_idx[0].cols();
  struct Block {
    int source = -1;
    Mat<T> x, topk_w, dout, out, dx, dtopk_w;  // out: forward accumulator; dx, dtopk_w: backward accumulators
    MatI topk_idx;
  };
  RelayRun<T> run;
  run.shards.resize(ranks);
  std::vector<Block> held(ranks);
  for (int r = 0; r < ranks; r++) {
    held[r].source = r;
    held[r].x = x[r];
    held[r].topk_idx = topk_idx[r];
    held[r].topk_w = topk_w[r];
    held[r].out = Mat<T>::Zero(x[r].rows(), x[r].cols());
    run.computed.push_back(std::vector<int>(topk_idx[r].size(), 0));
    run.shards[r].dW13.assign(W13.begin() + r * E_l, W13.begin() + (r + 1) * E_l);
    run.shards[r].dW2.assign(W2.begin() + r * E_l, W2.begin() + (r + 1) * E_l);
    run.shards[r].dW13 = zeros_like(run.shards[r].dW13);
    run.shards[r].dW2 = zeros_like(run.shards[r].dW2);
  }
  // forward: the visiting block's routes to this rank's experts, into the block's output accumulator
  for (int hop = 0; hop < ranks; hop++) {
    for (int r = 0; r < ranks; r++) {
      Block& b = held[r];
      for (Eigen::Index n = 0; n < b.x.rows(); n++)
        for (int j = 0; j < k; j++) {
          const int e = b.topk_idx(n, j);
          if (e / E_l != r) continue;
          const Pair<T> pair(W13[e], W2[e], b.x.row(n).transpose());
          b.out.row(n) += b.topk_w(n, j) * pair.y.transpose();
          run.computed[b.source][n * k + j]++;
        }
      run.forward.push_back(RelayHop{r, hop, b.source, 0, b.x.size(), b.out.size(), b.topk_idx.size()});
    }
    ring_pass_right(held);  // after the last hop: every block home, with its output
  }
  for (int r = 0; r < ranks; r++) {
    if (held[r].source != r) throw std::logic_error("relay_token_mode: a block did not come home");
    run.shards[r].out = held[r].out;
    held[r].dout = dout[r];
    held[r].dx = Mat<T>::Zero(x[r].rows(), x[r].cols());
    held[r].dtopk_w = Mat<T>::Zero(x[r].rows(), k);
  }
  // backward: blocks travel with x, dout, routing and their dx, dtopk_w accumulators
  for (int hop = 0; hop < ranks; hop++) {
    for (int r = 0; r < ranks; r++) {
      Block& b = held[r];
      for (Eigen::Index n = 0; n < b.x.rows(); n++)
        for (int j = 0; j < k; j++) {
          const int e = b.topk_idx(n, j), l = e % E_l;
          if (e / E_l != r) continue;
          const Vec<T> xn = b.x.row(n).transpose(), dout_n = b.dout.row(n).transpose();
          const Pair<T> pair(W13[e], W2[e], xn);  // this hop's intermediates, recomputed
          b.dtopk_w(n, j) = dout_n.dot(pair.y);
          b.dx.row(n) += pair.backward(W13[e], W2[e], xn, b.topk_w(n, j) * dout_n, run.shards[r].dW13[l], run.shards[r].dW2[l]).transpose();
        }
      run.backward.push_back(RelayHop{r, hop, b.source, 0, b.x.size() + b.dout.size(), b.dx.size(),
                                      b.topk_idx.size() + b.dtopk_w.size()});
    }
    ring_pass_right(held);
  }
  for (int r = 0; r < ranks; r++) {
    if (held[r].source != r) throw std::logic_error("relay_token_mode: a block did not come home");
    run.shards[r].dx = held[r].dx;
    run.shards[r].dtopk_w = held[r].dtopk_w;
  }
  return run;
}

}  // namespace ref
