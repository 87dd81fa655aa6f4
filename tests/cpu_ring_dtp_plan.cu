// tests/cpu_ring_dtp_plan.cu — the host side of Ring-DTP (ops/ring_dtp.cuh), without a GPU: the ring's
// schedule, the fused schedule, the branch rule and the widest logits block, against the twin
// ref/ring_dtp.hpp, which runs the ring round by round (each rank handing what travels to its right
// neighbour) and the fused schedule step by step, in double precision.
//   - The twin, both ring branches, P ∈ {1, 2, 3, 5}, V not divisible by P, N on both sides of V/P,
//     unequal batches, targets in every shard, logits in sub-blocks (1 column, a width that divides
//     no shard, wider than any shard): each rank's loss sum and dx and each shard's dW equal the full
//     logits and cross-entropy (ref/cross_entropy.hpp) over the global batch; at every round a rank
//     holds the plan's ring_dtp_visitor; every hop moves the plan's per-hop volume; the widest
//     logits block is the plan's closed form.
//   - The fused schedule with the plan's rows per step: the same, and its blocks within N·min(C, ⌈V/P⌉).
//   - The vocabulary intervals tile [0, V) for P up to 64, and the branch rule on both sides of V/P.
//   - The chunked head's block rows.
// Fresh inputs every run (FLATMOE_SEED replays a run).
#include "test_util.hpp"
#include "../ops/ring_dtp.cuh"
#include "../ref/cross_entropy.hpp"
#include "../ref/ring_dtp.hpp"

using MatD = ref::Mat<double>;

namespace {

// P ranks' batches (N rows each, or N + 1 on odd ranks when unequal), targets whose first rows aim at
// every shard in turn, lm_head W, dloss, and the full head over the global batch: each rank's loss sum
// and dx rows, each shard's dW.
struct PlanCase {
  int P, V, H;
  std::vector<std::pair<int, int>> intervals;
  MatD W;
  std::vector<MatD> x;
  std::vector<ref::MatI> targets;
  double dloss;
  std::vector<double> loss_sum;
  MatD dX, dW;
  int row_of(int r) const {  // rank r's first row in the global batch
    int row = 0;
    for (int p = 0; p < r; p++) row += (int)x[p].rows();
    return row;
  }
  // the largest relative error of a run against the full head, over every rank's loss sum, dx and dW
  double worst(const ref::RingDTPRun<double>& run) const {
    double worst = 0;
    for (int r = 0; r < P; r++) {
      const int rows = (int)x[r].rows();
      worst = std::max(worst, std::abs(run.loss_sum[r] - loss_sum[r]) / std::abs(loss_sum[r]));
      worst = std::max(worst, testutil::rel_err(run.dx[r], MatD(dX.middleRows(row_of(r), rows))));
      worst = std::max(worst, testutil::rel_err(run.dW[r], MatD(dW.middleRows(intervals[r].first,
                                                                           intervals[r].second - intervals[r].first))));
    }
    return worst;
  }
};

PlanCase make_plan_case(testutil::Rng& rng, int P, int V, int N, int H, bool unequal_batches) {
  PlanCase c{P, V, H};
  for (int r = 0; r < P; r++) c.intervals.push_back(ring_dtp_vocab_interval(V, P, r));
  c.W = rng.mat<double>(V, H);
  for (int r = 0; r < P; r++) {
    const int rows = N + (unequal_batches ? r % 2 : 0);
    c.x.push_back(rng.mat<double>(rows, H));
    ref::MatI t(rows, 1);
    for (int n = 0; n < rows; n++)  // the first rows aim at every shard in turn, the rest anywhere
      t(n, 0) = n < P ? rng.integer(c.intervals[n].first, c.intervals[n].second - 1) : rng.integer(0, V - 1);
    c.targets.push_back(t);
  }
  c.dloss = rng.uniform(0.5, 2.0);
  const int total = c.row_of(P);
  MatD X(total, H);
  ref::MatI T(total, 1);
  for (int r = 0; r < P; r++) {
    X.middleRows(c.row_of(r), c.x[r].rows()) = c.x[r];
    T.middleRows(c.row_of(r), c.x[r].rows()) = c.targets[r];
  }
  const MatD logits = X * c.W.transpose();
  ref::Vec<double> lse;
  const ref::Vec<double> losses = ref::cross_entropy_forward(logits, T, lse);
  const MatD dlogits = ref::cross_entropy_backward(logits, T, c.dloss);
  c.dX = dlogits * c.W;
  c.dW = dlogits.transpose() * X;
  for (int r = 0; r < P; r++) c.loss_sum.push_back(losses.segment(c.row_of(r), c.x[r].rows()).sum());
  return c;
}

}  // namespace

TEST(RingDTPPlan, RingMatchesTheFullHeadRoundByRound) {
  testutil::Rng rng;
  const int H = 6;
  const size_t b = 2;  // BF16 rows and weights: the volumes' element size
  for (int P : {1, 2, 3, 5})
    for (int V : {13, 29})
      for (int N : {2, 9}) {  // V/P is 2.6..29: N falls on both sides of it
        if (P > V) continue;
        const PlanCase c = make_plan_case(rng, P, V, N, H, true);  // unequal batches
        const std::vector<std::pair<int, int>>& intervals = c.intervals;
        const std::vector<MatD>& x = c.x;
        const int widest = ring_dtp_widest_shard(V, P);
        for (int block_cols : {1, 4, widest + 3})
          for (ref::RingDTPMoves moves : {ref::RingDTPMoves::Weights, ref::RingDTPMoves::Activations}) {
            const bool weights = moves == ref::RingDTPMoves::Weights;
            const std::string name = std::string("ring_dtp ") + (weights ? "weights" : "activations") + " P=" +
                                     std::to_string(P) + " V=" + std::to_string(V) + " N=" + std::to_string(N) +
                                     " block=" + std::to_string(block_cols);
            SCOPED_TRACE(name);
            const ref::RingDTPRun<double> run = ref::ring_dtp(moves, x, c.targets, c.W, intervals, c.dloss, block_cols);
            EXPECT_LE(c.worst(run), 1e-12) << name;
            long long N_max = 0;
            for (const MatD& xr : x) N_max = std::max<long long>(N_max, xr.rows());
            EXPECT_EQ(run.widest_block * N_max, ring_dtp_block_elems(N_max, V, P, block_cols)) << name;
            ASSERT_EQ(run.forward.size(), (size_t)P * P);
            for (size_t i = 0; i < run.forward.size(); i++) {
              const ref::RingDTPRound &f = run.forward[i], &bw = run.backward[i];
              EXPECT_EQ(f.visitor, ring_dtp_visitor(f.rank, f.round, P)) << name;
              EXPECT_EQ(bw.visitor, ring_dtp_visitor(bw.rank, bw.round, P)) << name;
              if (f.round + 1 == P) continue;  // the hop home (statistics or an accumulator) is not a round's payload
              const long long rows = x[weights ? f.rank : f.visitor].rows();  // the batch that moves or stays
              const RingDTPChoice want = ring_dtp_choose(weights ? "weights" : "activations", rows, V, P, H, b, true);
              const long long shard_rows = intervals[f.visitor].second - intervals[f.visitor].first;
              if (weights) EXPECT_EQ(f.weight_elems * (long long)b, shard_rows * H * (long long)b) << name;
              else EXPECT_EQ(f.row_elems * (long long)b + f.stat_elems * 4, want.activation_bytes) << name;
              if (weights && shard_rows == widest) EXPECT_EQ(f.weight_elems * (long long)b, want.weight_bytes) << name;
            }
          }
      }
}

// The fused schedule, step by step in the twin (ref::ring_dtp_fused), with the plan's rows per step
// (head_block_rows over ⌈V/P⌉ columns of P ranks' rows): the full head's losses, dx and dW, and no block
// above N·min(C, ⌈V/P⌉) logits (P·⌈V/P⌉ when one row of each rank is already more).
TEST(RingDTPPlan, FusedMatchesTheFullHeadStepByStep) {
  testutil::Rng rng;
  for (int P : {1, 2, 3, 5})
    for (int V : {13, 29})
      for (int N : {2, 9}) {
        if (P > V) continue;
        const PlanCase c = make_plan_case(rng, P, V, N, 6, false);  // the fused schedule: the same N on every rank
        const int widest = ring_dtp_widest_shard(V, P);
        for (int block_cols : {1, 4, widest + 3}) {
          const int n = head_block_rows(N, widest, P, block_cols);
          const std::string name = "ring_dtp fused P=" + std::to_string(P) + " V=" + std::to_string(V) +
                                   " N=" + std::to_string(N) + " block=" + std::to_string(block_cols) + " rows=" + std::to_string(n);
          const ref::RingDTPRun<double> run = ref::ring_dtp_fused(c.x, c.targets, c.W, c.intervals, c.dloss, n);
          EXPECT_LE(c.worst(run), 1e-12) << name;
          EXPECT_EQ(run.block_elems, (long long)P * n * widest) << name;
          EXPECT_LE(run.block_elems, std::max((long long)N * std::min(block_cols, widest), (long long)P * widest)) << name;
        }
      }
}

// Intervals tile [0, V) and differ by at most one; auto moves weights exactly when N > ⌈V/P⌉ in a pass
// without backward, and is fused in a training pass.
TEST(RingDTPPlan, IntervalsAndTheBranchRule) {
  for (int P : {1, 2, 3, 7, 8, 63, 64})
    for (int V : {64, 97, 200000}) {
      int next = 0, smallest = V, largest = 0;
      for (int r = 0; r < P; r++) {
        const std::pair<int, int> iv = ring_dtp_vocab_interval(V, P, r);
        EXPECT_EQ(iv.first, next) << "P=" << P << " V=" << V << " r=" << r;
        next = iv.second;
        smallest = std::min(smallest, iv.second - iv.first);
        largest = std::max(largest, iv.second - iv.first);
      }
      EXPECT_EQ(next, V);
      EXPECT_LE(largest - smallest, 1);
      EXPECT_EQ(largest, ring_dtp_widest_shard(V, P));
      for (long long N : {(long long)largest - 1, (long long)largest, (long long)largest + 1}) {
        if (N < 0) continue;
        const RingDTPChoice c = ring_dtp_choose("auto", N, V, P, 7168, 4, false);
        EXPECT_EQ(c.branch, N > largest ? RingDTPBranch::Weights : RingDTPBranch::Activations) << "N=" << N;
        EXPECT_EQ(ring_dtp_choose("auto", N, V, P, 7168, 4, true).branch, RingDTPBranch::Fused) << "training: N=" << N;
        EXPECT_EQ(ring_dtp_choose("fused", N, V, P, 7168, 4, false).branch, RingDTPBranch::Fused) << "N=" << N;
      }
    }
  // the paper's Table 2 shape at P = 2 (H 7168, V 200000, FP32): both branches occur at 1 GPU's sizes
  for (long long N : {4096LL, 131072LL}) {
    const RingDTPChoice c = ring_dtp_choose("auto", N, 200000, 2, 7168, 4, false);
    printf("[ring_dtp] N=%lld V=200000 P=2 H=7168 fp32: weights %lld B/hop, activations %lld B/hop -> %s\n", N,
           c.weight_bytes, c.activation_bytes, ring_dtp_branch_name(c.branch));
    EXPECT_EQ(c.branch, N > 100000 ? RingDTPBranch::Weights : RingDTPBranch::Activations);
  }
  EXPECT_EQ(ring_dtp_block_elems(4096, 200000, 2, 8192), 4096LL * 8192);
  EXPECT_DEATH(ring_dtp_choose("ring", 16, 64, 2, 8, 2, true), "ring_dtp_choose.*weights, activations, fused or auto");
  EXPECT_DEATH(ring_dtp_vocab_interval(3, 4, 0), "ring_dtp_vocab_interval.*1 <= P <= V");
}

// The chunked head's block (ops/cross_entropy.cuh): the most rows of the whole vocabulary whose logits fit
// in N × min(C, V) elements, one row at least; C = 0 is the full head (every row at once).
TEST(RingDTPPlan, ChunkedHeadBlockHoldsAtMostNTimesCLogits) {
  for (int N : {1, 9, 37, 300, 4096, 65536})
    for (int V : {40, 777, 1000, 5003, 200000})
      for (int C : {1, 250, 1024, 4096, 8192, 1 << 20}) {
        const int n = head_block_rows(N, V, 1, C);
        const long long budget = (long long)N * std::min(C, V);
        EXPECT_GE(n, 1);
        EXPECT_LE(n, N);
        EXPECT_TRUE((long long)n * V <= budget || n == 1) << "N=" << N << " V=" << V << " C=" << C;
        EXPECT_TRUE(n == N || (long long)(n + 1) * V > budget) << "the largest such block: N=" << N << " V=" << V << " C=" << C;
        EXPECT_EQ(full_head_live_bytes(N, V, C, 2), (size_t)n * V * 2 + 8 * (size_t)N);
        EXPECT_EQ(ring_dtp_live_bytes(RingDTPBranch::Activations, N, V, 1, 64, C, 2), full_head_live_bytes(N, V, C, 2));
      }
  EXPECT_EQ(head_block_rows(4096, 200000, 1, 0), 4096);
  EXPECT_EQ(full_head_live_bytes(4096, 200000, 0, 4), 4096ull * 200000 * 4 + 8 * 4096);
  EXPECT_EQ(head_block_rows(4096, 200000, 1, 8192), 167);  // the paper's Table 2 shape: 25 blocks
  EXPECT_EQ(head_block_rows(16384, 32768, 1, 4096), 2048);  // a BF16 training shape: 8 blocks
  EXPECT_DEATH(head_block_rows(16, 64, 1, -1), "head_block_rows.*vocab_block >= 0");
}
