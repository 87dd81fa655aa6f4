// ref/ring_dtp.hpp — Ring-DTP in plain math (twin of ops/ring_dtp.cuh): the vocabulary projection and
// cross-entropy over P ranks in a ring, each with its own batch and its own vocabulary interval of
// the output weight, round by round, with what travels handed explicitly to the right neighbour.
// Nothing here computes who holds what: a rank works with whatever arrived.
//   Rank r: x[r] [N_r,H] (its batch), targets[r] [N_r], shard r = rows [lo_r, hi_r) of W [V,H]
//   (ops/ring_dtp.cuh's ring_dtp_vocab_interval). Objective: dloss · Σ over every rank's tokens of
//   loss_n = lse_n − logit_n[target_n], lse_n = log Σ_v exp(x_n · W_v).
//   Per (batch, shard) meeting, the shard's columns in sub-blocks of at most block_cols: logits
//   [N_r, ≤ block_cols] = x W_subᵀ update the running max m and sum l of exp(logit − m) of each row
//   (online softmax), and the meeting whose shard holds a row's target adds its target logit.
//   Backward replays the meetings: dlogits = dloss · (exp(logit − lse) − onehot),
//   dx += dlogits W_sub, dW_sub += dlogitsᵀ x.
//   weights      batches stay (with their statistics); shards travel. Backward: a shard travels with
//                its gradient accumulator, which takes one more hop at the end, to the shard's owner.
//   activations  shards stay; batches travel with their targets and statistics (one more hop at the
//                end brings the statistics home). Backward: x, targets, lse and the dx accumulator
//                travel (one more hop home); each shard's gradient adds up where the shard lives.
// Returns each rank's loss sum, dx and dW shard, the widest logits block that ever existed, and a
// record of every round (what each rank worked with, what it handed on). ring_dtp_fused (at the end):
// the fused schedule, steps over blocks of rows.
#pragma once
#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>
#include "common.hpp"

namespace ref {

enum class RingDTPMoves { Weights, Activations };

// One rank at one round: the shard (weights) or the batch's source rank (activations) it worked
// with, and the elements it handed on afterwards.
struct RingDTPRound {
  int rank = 0, round = 0, visitor = 0;
  long long weight_elems = 0;  // a shard's rows × H (weights), and its gradient accumulator in backward
  long long row_elems = 0;     // a batch's x rows (activations), and its dx accumulator in backward
  long long stat_elems = 0;    // 4-byte values per row: m, l, target logit, target (forward); lse, target (backward)
};

template <typename T>
struct RingDTPRun {
  std::vector<T> loss_sum;        // [P] Σ loss_n over rank r's batch
  std::vector<Mat<T>> dx;         // [P] [N_r,H]
  std::vector<Mat<T>> dW;         // [P] [hi_r − lo_r, H], rank r's shard
  long long widest_block = 0;     // the most logits columns of one block (rows: the batch at hand)
  long long block_elems = 0;      // the most logits of one block, rows × columns
  std::vector<RingDTPRound> forward, backward;
};

namespace ring_dtp_detail {

// A batch with its running statistics: max m, sum l of exp(logit − m), target logit, lse; dx.
template <typename T>
struct Batch {
  int source = -1;
  Mat<T> x, dx;
  MatI targets;
  Vec<T> m, l, target_logit, lse;
};

// A shard: rows [lo, hi) of W, and its gradient accumulator (backward).
template <typename T>
struct Shard {
  int owner = -1;
  int lo = 0;
  Mat<T> W, dW;
};

// One meeting of a batch and a shard, forward: the online-softmax update, block by block.
template <typename T>
void meet_forward(Batch<T>& b, const Shard<T>& s, int block_cols, long long& widest) {
  const Eigen::Index N = b.x.rows(), cols = s.W.rows();
  for (Eigen::Index c0 = 0; c0 < cols; c0 += block_cols) {
    const Eigen::Index width = std::min<Eigen::Index>(block_cols, cols - c0);
    widest = std::max<long long>(widest, width);
    const Mat<T> logits = b.x * s.W.middleRows(c0, width).transpose();  // [N, width]
    for (Eigen::Index n = 0; n < N; n++) {
      const T block_max = logits.row(n).maxCoeff(), m_new = std::max(b.m(n), block_max);
      b.l(n) = b.l(n) * std::exp(b.m(n) - m_new) + (logits.row(n).array() - m_new).exp().sum();
      b.m(n) = m_new;
      const int t = b.targets(n, 0) - s.lo - (int)c0;
      if (t >= 0 && t < width) b.target_logit(n) = logits(n, t);
    }
  }
}

// One meeting, backward: dlogits of each block into dx (the batch's) and dW (the shard's).
template <typename T>
void meet_backward(Batch<T>& b, const Shard<T>& s, T dloss, int block_cols, Mat<T>& dW) {
  const Eigen::Index N = b.x.rows(), cols = s.W.rows();
  for (Eigen::Index c0 = 0; c0 < cols; c0 += block_cols) {
    const Eigen::Index width = std::min<Eigen::Index>(block_cols, cols - c0);
    Mat<T> dlogits = b.x * s.W.middleRows(c0, width).transpose();
    for (Eigen::Index n = 0; n < N; n++) {
      dlogits.row(n) = (dlogits.row(n).array() - b.lse(n)).exp().matrix();
      const int t = b.targets(n, 0) - s.lo - (int)c0;
      if (t >= 0 && t < width) dlogits(n, t) -= T(1);
    }
    dlogits *= dloss;
    b.dx += dlogits * s.W.middleRows(c0, width);
    dW.middleRows(c0, width) += dlogits.transpose() * b.x;
  }
}

}  // namespace ring_dtp_detail

// intervals: [P] (lo, hi) of each rank's shard, tiling [0, V). block_cols ≥ 1.
template <typename T>
RingDTPRun<T> ring_dtp(RingDTPMoves moves, const std::vector<Mat<T>>& x, const std::vector<MatI>& targets,
                       const Mat<T>& W, const std::vector<std::pair<int, int>>& intervals, T dloss, int block_cols) {
  using namespace ring_dtp_detail;
  const int P = (int)x.size();
  RingDTPRun<T> run;
  std::vector<Batch<T>> batches(P);
  std::vector<Shard<T>> shards(P);
  auto shards_at_home = [&] {  // each owner's own shard (and a zeroed gradient accumulator)
    for (int r = 0; r < P; r++) {
      shards[r].owner = r;
      shards[r].lo = intervals[r].first;
      shards[r].W = W.middleRows(intervals[r].first, intervals[r].second - intervals[r].first);
      shards[r].dW = Mat<T>::Zero(shards[r].W.rows(), shards[r].W.cols());
    }
  };
  shards_at_home();
  for (int r = 0; r < P; r++) {
    const Eigen::Index N = x[r].rows();
    batches[r].source = r;
    batches[r].x = x[r];
    batches[r].targets = targets[r];
    batches[r].m = Vec<T>::Constant(N, -std::numeric_limits<T>::infinity());
    batches[r].l = Vec<T>::Zero(N);
    batches[r].target_logit = Vec<T>::Constant(N, std::numeric_limits<T>::quiet_NaN());  // set by the target's shard
  }
  const bool weights_move = moves == RingDTPMoves::Weights;
  auto visitor = [&](int r) { return weights_move ? shards[r].owner : batches[r].source; };

  // forward: P rounds; then the statistics are where their batch started
  for (int round = 0; round < P; round++) {
    for (int r = 0; r < P; r++) {
      meet_forward(batches[r], shards[r], block_cols, run.widest_block);
      RingDTPRound rec{r, round, visitor(r), 0, 0, 0};
      if (weights_move && round + 1 < P) rec.weight_elems = shards[r].W.size();  // no hop home: the owner has its shard
      if (!weights_move) {
        rec.row_elems = round + 1 < P ? batches[r].x.size() : 0;  // home, only the statistics travel
        rec.stat_elems = (round + 1 < P ? 4 : 3) * batches[r].x.rows();  // home: the targets are there
      }
      run.forward.push_back(rec);
    }
    if (weights_move && round + 1 < P) ring_pass_right(shards);
    if (!weights_move) ring_pass_right(batches);  // after the last round: every batch home
  }
  for (const Mat<T>& xr : x) run.block_elems = std::max<long long>(run.block_elems, (long long)xr.rows() * run.widest_block);
  for (int r = 0; r < P; r++) {
    Batch<T>& b = batches[r];
    if (b.source != r) throw std::logic_error("ring_dtp: a batch did not come home");
    b.lse = b.m.array() + b.l.array().log();
    T sum = 0;
    for (Eigen::Index n = 0; n < b.x.rows(); n++) sum += b.lse(n) - b.target_logit(n);
    run.loss_sum.push_back(sum);
    b.dx = Mat<T>::Zero(b.x.rows(), b.x.cols());
  }

  // backward: the same rounds from the start (each owner starts from its own shard again); the
  // moving tensor's gradient travels with it
  shards_at_home();
  for (int round = 0; round < P; round++) {
    for (int r = 0; r < P; r++) {
      meet_backward(batches[r], shards[r], dloss, block_cols, shards[r].dW);
      RingDTPRound rec{r, round, visitor(r), 0, 0, 0};
      if (weights_move) rec.weight_elems = shards[r].W.size() * (round + 1 < P ? 2 : 1);  // W and dW; dW alone home
      else {
        rec.row_elems = batches[r].x.size() * (round + 1 < P ? 2 : 1);  // x and its dx; dx alone home
        rec.stat_elems = round + 1 < P ? 2 * batches[r].x.rows() : 0;  // lse and targets
      }
      run.backward.push_back(rec);
    }
    if (weights_move) ring_pass_right(shards);  // after the last round: every accumulator to its owner
    else ring_pass_right(batches);              // after the last round: every batch (and its dx) home
  }
  for (int r = 0; r < P; r++) {
    if (shards[r].owner != r || batches[r].source != r) throw std::logic_error("ring_dtp: a gradient did not come home");
    run.dx.push_back(batches[r].dx);
    run.dW.push_back(shards[r].dW);
  }
  return run;
}

// The fused schedule (ops/ring_dtp.cuh, fused): steps over blocks of rows instead of rounds. Every rank
// holds N rows (the same N); at step t the rows [t·n, t·n + n_t) of every rank, gathered in rank order
// (P·n_t rows), meet every shard at once: shard s's logits [P·n_t, V_s] give each row's running max and
// sum over its columns (and the target's logit where the shard holds it); the shards' statistics,
// combined in rank order, give each row's lse and its loss. Then, at once: dlogits = dloss · (softmax −
// onehot) of each shard's block, dW_s += dlogitsᵀ·X_rows, and the rows' dx is the sum over the shards of
// dlogits·W_s, each row's to its own rank. No logits block is computed twice.
template <typename T>
RingDTPRun<T> ring_dtp_fused(const std::vector<Mat<T>>& x, const std::vector<MatI>& targets, const Mat<T>& W,
                             const std::vector<std::pair<int, int>>& intervals, T dloss, int rows_per_step) {
  const int P = (int)x.size();
  const Eigen::Index N = x[0].rows(), H = W.cols();
  for (const Mat<T>& xr : x)
    if (xr.rows() != N) throw std::invalid_argument("ring_dtp_fused: every rank holds the same number of rows");
  if (rows_per_step < 1) throw std::invalid_argument("ring_dtp_fused: rows_per_step must be >= 1");
  RingDTPRun<T> run;
  run.loss_sum.assign(P, T(0));
  for (int r = 0; r < P; r++) {
    run.dx.push_back(Mat<T>::Zero(N, H));
    run.dW.push_back(Mat<T>::Zero(intervals[r].second - intervals[r].first, H));
  }
  for (Eigen::Index r0 = 0; r0 < N; r0 += rows_per_step) {
    const Eigen::Index nt = std::min<Eigen::Index>(rows_per_step, N - r0), g = P * nt;
    Mat<T> rows(g, H);  // the gathered rows, rank by rank
    MatI row_targets(g, 1);
    for (int p = 0; p < P; p++) {
      rows.middleRows(p * nt, nt) = x[p].middleRows(r0, nt);
      row_targets.middleRows(p * nt, nt) = targets[p].middleRows(r0, nt);
    }
    std::vector<Mat<T>> logits(P);  // shard s's block [g, V_s], kept until the lse is known
    Vec<T> m = Vec<T>::Constant(g, -std::numeric_limits<T>::infinity()), l = Vec<T>::Zero(g);
    Vec<T> target_logit = Vec<T>::Constant(g, std::numeric_limits<T>::quiet_NaN());
    for (int s = 0; s < P; s++) {  // each shard's statistics, combined in rank order
      const int lo = intervals[s].first, cols = intervals[s].second - lo;
      logits[s] = rows * W.middleRows(lo, cols).transpose();
      run.widest_block = std::max<long long>(run.widest_block, cols);
      run.block_elems = std::max<long long>(run.block_elems, (long long)logits[s].size());
      for (Eigen::Index j = 0; j < g; j++) {
        const T m_new = std::max(m(j), logits[s].row(j).maxCoeff());
        l(j) = l(j) * std::exp(m(j) - m_new) + (logits[s].row(j).array() - m_new).exp().sum();
        m(j) = m_new;
        const int t = row_targets(j, 0) - lo;
        if (t >= 0 && t < cols) target_logit(j) = logits[s](j, t);
      }
    }
    const Vec<T> lse = m.array() + l.array().log();
    for (int p = 0; p < P; p++) run.loss_sum[p] += (lse - target_logit).segment(p * nt, nt).sum();
    Mat<T> dx_rows = Mat<T>::Zero(g, H);
    for (int s = 0; s < P; s++) {
      const int lo = intervals[s].first, cols = intervals[s].second - lo;
      Mat<T> dlogits = (logits[s].colwise() - lse).array().exp().matrix();
      for (Eigen::Index j = 0; j < g; j++) {
        const int t = row_targets(j, 0) - lo;
        if (t >= 0 && t < cols) dlogits(j, t) -= T(1);
      }
      dlogits *= dloss;
      run.dW[s] += dlogits.transpose() * rows;
      dx_rows += dlogits * W.middleRows(lo, cols);
    }
    for (int p = 0; p < P; p++) run.dx[p].middleRows(r0, nt) = dx_rows.middleRows(p * nt, nt);
  }
  return run;
}

}  // namespace ref
