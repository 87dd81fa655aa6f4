// tests/ring_dtp_check.cuh — the output-head check that tests/gpu_ring_dtp.cu (the chunked head, P = 1)
// and tests/dist_ring_dtp.cu (Ring-DTP, P = W) share: P ranks' batches and one lm_head, the full logits
// and cross-entropy over the global batch in double (ref/cross_entropy.hpp), and one rank's head run
// against it — its loss sum, dx (=) and dW (+=) of its vocabulary interval, per tensor, with the pool
// peak of the call against the closed form ring_dtp_live_bytes.
#pragma once
#include <cstring>
#include <string>
#include <vector>
#include "gpu_util.cuh"
#include "../ops/ring_dtp.cuh"
#include "../ref/cross_entropy.hpp"

namespace testutil {

// P ranks' batches x[r] [N,H] and targets, lm_head W [V,H] and an initial dW (+=) of the gradient's size, in
// floatX values.
// Rank r's first P targets aim at each shard in turn, so that every shard owns targets of every batch.
struct HeadCase {
  int P, N, V, H;
  std::vector<ref::Mat<double>> x;
  std::vector<std::vector<int>> targets;
  ref::Mat<double> W, dW_initial;
  float dloss;
  // the full head over the global batch
  std::vector<double> loss_sum;  // [P]
  ref::Mat<double> dX, dW;       // [P·N, H], [V, H] (without dW_initial)
};

inline HeadCase make_head_case(int P, int N, int V, int H) {
  Rng rng;
  HeadCase c{P, N, V, H};
  c.W = round_to_floatX(rng.mat<double>(V, H));
  c.dloss = float(rng.uniform(0.5, 2.0) / (P * N));
  ref::Mat<double> X(P * N, H);
  ref::MatI T(P * N, 1);
  for (int r = 0; r < P; r++) {
    c.x.push_back(round_to_floatX(rng.mat<double>(N, H)));
    std::vector<int> t(N);
    for (int n = 0; n < N; n++) {
      const std::pair<int, int> shard = vocab_interval(V, P, n % P);
      t[n] = n < P ? rng.integer(shard.first, shard.second - 1) : rng.integer(0, V - 1);
      T(r * N + n, 0) = t[n];
    }
    c.targets.push_back(t);
    X.middleRows(r * N, N) = c.x[r];
  }
  const ref::Mat<double> logits = X * c.W.transpose();
  ref::Vec<double> lse;
  const ref::Vec<double> losses = ref::cross_entropy_forward(logits, T, lse);
  const ref::Mat<double> dlogits = ref::cross_entropy_backward(logits, T, double(c.dloss));
  c.dX = dlogits * c.W;
  c.dW = dlogits.transpose() * X;
  // the gradient already in dW (+=) at the gradient's own scale, so that an error in the sum shows
  c.dW_initial = round_to_floatX(rng.mat<double>(V, H) * (c.dW.norm() / std::sqrt((double)V * H)));
  for (int r = 0; r < P; r++) c.loss_sum.push_back(losses.segment(r * N, N).sum());
  return c;
}

// What one rank's head call gave.
struct HeadRun {
  std::vector<floatX> dx, dW;
  float loss_sum;
  size_t peak;  // pool bytes above what was live before the call
};

// Rank `rank` of the case runs `head` (its group: P ranks, this one at `rank`) on its batch and its
// interval of W, with the backward (training) or the loss alone (backward = false: no dx, dW untouched);
// every rank of the group calls it together.
inline HeadRun run_head(OutputHead& head, const HeadCase& c, int rank, bool backward = true) {
  const std::pair<int, int> iv = vocab_interval(c.V, c.P, rank);
  const int rows = iv.second - iv.first;
  DeviceBuffer<floatX> x = upload<floatX>(c.x[rank], Mem::Activations);
  DeviceBuffer<int> targets = upload_vec(c.targets[rank]);
  const ref::Mat<double> W_rows = c.W.middleRows(iv.first, rows);  // row-major, as the GPU reads it
  const ref::Mat<double> dW_rows = c.dW_initial.middleRows(iv.first, rows);
  DeviceBuffer<floatX> W = upload<floatX>(W_rows, Mem::Weights);
  DeviceBuffer<floatX> dW = upload<floatX>(dW_rows, Mem::Grads);
  DeviceBuffer<floatX> dx((size_t)c.N * c.H, Mem::Activations, "test.dx");
  DeviceBuffer<float> loss(1, Mem::Workspace, "test.loss_sum");
  poison(dx.ptr, dx.count);
  poison(loss.ptr, 1);
  cudaCheck(cudaDeviceSynchronize(), "test", "before the head");
  const size_t live_before = pool().live_total();
  pool().reset_peak();
  head.forward_backward(loss.ptr, backward ? dx.ptr : nullptr, dW.ptr, x.ptr, W.ptr, targets.ptr, c.dloss, c.N, c.H, c.V, 0);
  HeadRun run;
  run.peak = pool().peak() - live_before;
  EXPECT_EQ(pool().live_total(), live_before) << "the head must return everything it allocated";
  run.dx = download_vec(dx.ptr, dx.count);
  run.dW = download_vec(dW.ptr, dW.count);
  run.loss_sum = download_vec(loss.ptr, 1)[0];
  return run;
}

// floatX [rows, cols] as a double matrix.
inline ref::Mat<double> rows_as_mat(const std::vector<floatX>& v, int rows, int cols) {
  ref::Mat<double> m(rows, cols);
  for (size_t i = 0; i < v.size(); i++) m.data()[i] = to_float(v[i]);
  return m;
}

// The run of rank `rank` against the full head: loss sum, dx, dW (+=) per tensor within the
// operator tolerance (backward = false: the loss, and dW untouched), and the pool peak within the closed
// form of the branch `mode` takes for such a pass.
inline void expect_head_matches(const std::string& name, const HeadCase& c, int rank, const HeadRun& run,
                                const std::string& mode, int block_cols, bool backward = true) {
  const std::pair<int, int> iv = vocab_interval(c.V, c.P, rank);
  const int rows = iv.second - iv.first;
  const double loss_err = std::abs(run.loss_sum - c.loss_sum[rank]) / std::abs(c.loss_sum[rank]);
  EXPECT_REL(name.c_str(), "loss_sum", loss_err, OP_TOL);
  if (backward) {
    EXPECT_REL(name.c_str(), "dx", rel_err(rows_as_mat(run.dx, c.N, c.H), ref::Mat<double>(c.dX.middleRows(rank * c.N, c.N))), OP_TOL);
    const ref::Mat<double> dW_want = c.dW_initial.middleRows(iv.first, rows) + c.dW.middleRows(iv.first, rows);
    EXPECT_REL(name.c_str(), "dW(+=)", rel_err(rows_as_mat(run.dW, rows, c.H), dW_want), OP_TOL);
  } else {
    EXPECT_TRUE(rows_as_mat(run.dW, rows, c.H) == ref::Mat<double>(c.dW_initial.middleRows(iv.first, rows)))
        << name << ": a pass without backward leaves dW alone";
  }
  const RingDTPBranch branch = ring_dtp_choose(mode, c.N, c.V, c.P, c.H, sizeof(floatX), backward).branch;
  const size_t bound = ring_dtp_live_bytes(branch, c.N, c.V, c.P, c.H, block_cols, sizeof(floatX));
  const size_t full_logits = (size_t)c.N * c.V * sizeof(floatX);
  printf("[%s] rank %d %s: peak %zu B <= closed form %zu B (full logits alone: %zu B)\n", name.c_str(), rank,
         c.P == 1 ? "chunked" : ring_dtp_branch_name(branch), run.peak, bound, full_logits);
  EXPECT_LE(run.peak, bound) << name << " rank " << rank;
}

}  // namespace testutil
