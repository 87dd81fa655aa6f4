// ring_dtp.cuh — Ring-DTP (notes/design.md §6.5; "Flattening Every Memory Peak in Long-Context Mixture-of-Experts
// Training", §3.2, appendix C): the vocabulary projection and cross-entropy over P ranks in a ring, each rank with
// its own batch and its own vocabulary interval of lm_head, without the N×V logits on any rank. Twin of
// ref/ring_dtp.hpp (the ring, round by round, in plain math) and ref/cross_entropy.hpp (the loss).
//
// What it computes: exactly the full head (ops/cross_entropy.cuh FullHead) over the group's batches:
// rank r's loss sum (=) and dx (=) over its own batch X_r [N,H], and dW (+=) of its vocabulary interval
// [lo_r, hi_r) of W [V,H], summed over every rank's batch. Intervals: lo_r = ⌊r·V/P⌋, so sizes differ
// by at most one and V need not be divisible by P. Every rank of the group passes the same N.
//
// The ring: rank r sends to (r+1) mod P, receives from (r−1) mod P; P rounds. At round q rank r holds
// shard (r − q) mod P (weights move) or the batch of rank (r − q) mod P (activations move): every
// batch meets every shard once. A meeting computes the logits block X·W_sᵀ [N, V_s] in sub-blocks of
// at most C = block_cols columns, folds each into the rows' running max m and sum l of exp(logit − m)
// (online softmax, ops/cross_entropy.cuh cross_entropy_block_forward), and the meeting whose shard
// owns a row's target takes its target logit; loss_n = m + log l − target logit. Backward replays the
// meetings: dlogits = dloss·(softmax − onehot), dX += dlogits·W_sub, dW_sub += dlogitsᵀ·X; the
// gradient of the moving tensor travels with it.
//   weights      (N > V/P) batches and statistics stay, shards travel: V_s·H·b bytes per hop and no
//                hop home in forward (the owner has its shard); backward: the shard, and its gradient
//                accumulator one step behind, which takes one more hop, home.
//   activations  (N ≤ V/P) shards stay, batches travel with their statistics: N·H·b + 4·N·4 bytes
//                per hop (x rows; m, l, target logit in fp32, the targets); one more hop takes the
//                statistics home. Backward: x, targets and lse travel, and the dx accumulator one step
//                behind, with one more hop home.
//   fused        no rounds, and no recomputation in backward: steps over blocks of rows. At step t
//                every rank's rows [t·n, t·n + n) are gathered by every rank (all-gather: (P − 1)·n·(H·b + 4)
//                bytes in), each rank projects the P·n rows on its whole shard ([P·n, V_s] logits, with
//                n = head_block_rows(N, ⌈V/P⌉, P, C): at most N·C' of them) and folds them into per-row
//                statistics; the group gathers the statistics (3·P·n fp32) and every rank combines them in
//                rank order into each row's lse (the same bits on every rank) and its own rows' losses. When
//                the loss is final (training: dx asked for) the block's dlogits are formed in place at once,
//                dW_s += dlogitsᵀ·X_rows, and dX partial = dlogits·W_s [P·n, H] fp32 is summed over the group
//                into each row's own rank by a reduce-scatter and rounded to floatX once. Three GEMM-sized
//                passes, as the full head's, against four in the ring branches (their backward recomputes
//                the logits); rows move, not weights, whatever N.
//   auto (the default): fused for a training pass; for a pass without backward (validation) the ring
//   branch by the rule above, from sizes every rank knows (N, and V/P = the widest shard); printed at
//   start-up with both per-hop volumes.
// P = 1 is the chunked head (--head chunked, ops/cross_entropy.cuh FullHead over row blocks): no ring, no
// communicator; the same bytes bound (a block of N·min(C, V) logits), and no recomputation in backward.
//
// Streams: the meetings run on the caller's (compute) stream; the hops on the group communicator's
// own stream, ordered by StreamPoints, never by the host. What a round does not modify — the next
// shard (weights) or the next batch's rows (activations) — is received while the round computes; what
// it modifies — the gradient accumulator, the statistics — leaves after the round and arrives while
// the next round computes its first logits block (the round waits for it before its first product
// into the accumulator). The call returns with the compute stream after every hop.
// fused: step t + 1's rows are gathered, and step t − 1's dx partials reduced, while step t computes
// (two slots of each); the statistics' all-gather is the one wait of a step.
//
// Live set (pool bytes, b = sizeof(floatX), w = ⌈V/P⌉ rows, C' = min(C, w) columns, S = min(2, P − 1)
// slots: the next shard or batch, and at P > 2 the one being computed with), ring_dtp_live_bytes:
//   P = 1       the chunked head's: full_head_live_bytes (its block [n, V] of ≤ N·C' logits, losses, lse)
//   always      logits block N·C'·b (Logits) and losses, lse 2·N·4 (Logits)
//   weights     forward: statistics 3·N·4 + S shard slots S·w·H·b (CommStaging);
//               backward: the shard slots + two gradient accumulators 2·w·H·b + dx's fp32 accumulator
//               N·H·4 (BF16 build)
//   activations forward: statistics twice 6·N·4 + S batch slots S·(N·H·b + N·4);
//               backward: the batch slots + S lse slots S·N·4 + two fp32 dx accumulators 2·N·H·4
//   fused       (g = P·n) logits g·w·b, two row slots 2·g·(H·b + 4), statistics 3·g·4 and the group's
//               3·P·g·4, lse g·4, losses N·4; training: two fp32 dx partial slots 2·g·H·4 and this rank's
//               reduced rows n·H·4. Each term is bounded by the block (g·w ≤ N·C'), not by N·V.
// dx sums every block of every round in fp32 and is rounded to floatX once, as the full head's single
// GEMM does (a bf16 accumulator would round at each of the P·⌈V_s/C⌉ products); a shard's dW
// accumulator is floatX, like the model's gradients (fused: dW adds ⌈N/n⌉ steps in floatX).
// The largest logits block is N × C', never N × V (ring_dtp_block_elems); the full head holds N·V·b.
#pragma once
#include <algorithm>
#include <array>
#include <string>
#include <type_traits>
#include <utility>
#include "../config.hpp"
#include "../runtime/check.cuh"
#include "../runtime/comm.cuh"
#include "../runtime/stream.cuh"
#include "cross_entropy.cuh"

// ---------------------------------------------------------------------------------------------
// Host-side plan (pure C++: no CUDA call)

enum class RingDTPBranch { Weights, Activations, Fused };

inline const char* ring_dtp_branch_name(RingDTPBranch branch) {
  return branch == RingDTPBranch::Weights ? "weights" : branch == RingDTPBranch::Activations ? "activations" : "fused";
}

// Rank r's vocabulary interval [lo, hi) of P: lo = ⌊r·V/P⌋.
inline std::pair<int, int> ring_dtp_vocab_interval(int V, int P, int r) {
  if (V < 1 || P < 1 || P > V || r < 0 || r >= P)
    fm_fail("ring_dtp_vocab_interval", "need 1 <= P <= V and 0 <= r < P", "V=%d P=%d r=%d", V, P, r);
  return vocab_interval(V, P, r);
}

// The widest shard, ⌈V/P⌉ rows.
inline int ring_dtp_widest_shard(int V, int P) { return (int)(((long long)V + P - 1) / P); }

// The branch a run uses and both per-hop volumes (printed at start-up).
struct RingDTPChoice {
  RingDTPBranch branch = RingDTPBranch::Activations;
  long long weight_bytes = 0, activation_bytes = 0;  // per hop
};

// mode "weights", "activations", "fused" or "auto": fused for a pass whose loss is final (training,
// loss_final), else weights exactly when N_max > ⌈V/P⌉, activations otherwise; N_max: the most tokens any
// rank holds; b: bytes per floatX.
inline RingDTPChoice ring_dtp_choose(const std::string& mode, long long N_max, int V, int P, int H, size_t b,
                                     bool loss_final) {
  const char* op = "ring_dtp_choose";
  if (N_max < 0 || V < 1 || P < 1 || P > V || H < 1 || b < 1)
    fm_fail(op, "need N >= 0, 1 <= P <= V, H >= 1 and b >= 1", "N=%lld V=%d P=%d H=%d b=%zu", N_max, V, P, H, b);
  const long long widest = ring_dtp_widest_shard(V, P);
  RingDTPChoice choice;
  choice.weight_bytes = widest * H * (long long)b;
  choice.activation_bytes = N_max * H * (long long)b + 4 * N_max * 4;
  if (mode == "weights") choice.branch = RingDTPBranch::Weights;
  else if (mode == "activations") choice.branch = RingDTPBranch::Activations;
  else if (mode == "fused" || (mode == "auto" && loss_final)) choice.branch = RingDTPBranch::Fused;
  else if (mode == "auto") choice.branch = N_max > widest ? RingDTPBranch::Weights : RingDTPBranch::Activations;
  else fm_fail(op, "the Ring-DTP mode must be weights, activations, fused or auto", "mode=%s", mode.c_str());
  return choice;
}

// What rank `rank` works with at round `round` (0 ≤ round < P): the shard (weights) or the batch's
// source rank (activations), (rank − round) mod P in both.
inline int ring_dtp_visitor(int rank, int round, int P) {
  if (P < 1 || rank < 0 || rank >= P || round < 0 || round >= P)
    fm_fail("ring_dtp_visitor", "need 0 <= rank < P and 0 <= round < P", "rank=%d round=%d P=%d", rank, round, P);
  return ((rank - round) % P + P) % P;
}

// The largest logits block any rank holds: N_max × min(block_cols, ⌈V/P⌉) elements.
inline long long ring_dtp_block_elems(long long N_max, int V, int P, int block_cols) {
  if (block_cols < 1) fm_fail("ring_dtp_block_elems", "need block_cols >= 1", "block_cols=%d", block_cols);
  const int widest = ring_dtp_widest_shard(V, P);
  return N_max * (block_cols < widest ? block_cols : widest);
}

// ---------------------------------------------------------------------------------------------
// The GPU schedule

// Bytes the head holds in the pool at its peak (the header's live set), for N tokens per rank.
inline size_t ring_dtp_live_bytes(RingDTPBranch branch, size_t N, int V, int P, int H, int block_cols, size_t b) {
  if (P == 1) return full_head_live_bytes(N, V, block_cols, b);
  const size_t w = (size_t)ring_dtp_widest_shard(V, P), cols = std::min<size_t>(block_cols, w);
  const size_t always = N * cols * b + 2 * N * 4, slots = std::min(2, P - 1);
  const size_t dx_fp32 = b == 4 ? 0 : N * H * 4;  // dx's fp32 accumulator (the FP32 build sums into dx itself)
  if (branch == RingDTPBranch::Fused) {
    const size_t n = (size_t)head_block_rows((int)N, (int)w, P, block_cols), g = (size_t)P * n;
    return g * w * b + 2 * g * (H * b + 4) + 3 * g * 4 * (1 + P) + g * 4 + N * 4 + 2 * g * H * 4 + n * H * 4;
  }
  if (branch == RingDTPBranch::Weights)
    return always + std::max(3 * N * 4 + slots * w * H * b, (slots + 2) * w * H * b + dx_fp32);
  return always + slots * (N * H * b + N * 4) + std::max(6 * N * 4, slots * N * 4 + 2 * N * H * 4);
}

// Running statistics of a batch, one buffer [3N] fp32 so that they travel in one message.
struct RingDTPStats {
  float* data = nullptr;
  int N = 0;
  float* m() const { return data; }
  float* l() const { return data + N; }
  float* target_logit() const { return data + 2 * (size_t)N; }
};

// A fused step's statistics over the group, combined in rank order (every rank gets the same bits): lse [g]
// (=) of each gathered row and this rank's losses [nt] (=), its rows being gathered rows [own0, own0 + nt).
// gathered [P][3][g]: each rank's running max m, sum l and target logit over its shard (NaN where the target
// lies in another shard).
static __global__ void ring_dtp_fused_stats_kernel(float* lse, float* losses, const float* gathered, int P, int g,
                                                   int own0, int nt) {
  const int j = blockIdx.x * blockDim.x + threadIdx.x;
  if (j >= g) return;
  CrossEntropyOnlineLse total{-INFINITY, 0.f};
  float target_logit = NAN;
  for (int p = 0; p < P; p++) {
    const float* st = gathered + (size_t)p * 3 * g;
    total = cross_entropy_combine(total, CrossEntropyOnlineLse{st[j], st[g + j]});
    if (!isnan(st[2 * g + j])) target_logit = st[2 * g + j];
  }
  lse[j] = total.m + logf(total.s);
  if (j >= own0 && j < own0 + nt) losses[j - own0] = lse[j] - target_logit;
}

inline void ring_dtp_fused_stats(float* lse, float* losses, const float* gathered, int P, int g, int own0, int nt,
                                 cudaStream_t cs) {
  ring_dtp_fused_stats_kernel<<<ceil_div(g, 256), 256, 0, cs>>>(lse, losses, gathered, P, g, own0, nt);
  launchCheck("ring_dtp_fused_stats", "P=%d g=%d own0=%d nt=%d", P, g, own0, nt);
}

// One meeting, forward: batch x [N,H] (targets [N]) meets the shard W_s [rows,H] of vocabulary rows
// [lo, lo + rows): logits [N, ≤ C] block by block into the statistics.
inline void ring_dtp_meet_forward(const RingDTPStats& st, const floatX* x, const int* targets, const floatX* W_s, int lo,
                                  int rows, int N, int H, int block_cols, floatX* logits, cudaStream_t cs) {
  for (int c0 = 0; c0 < rows; c0 += block_cols) {
    const int width = std::min(block_cols, rows - c0);
    prof_sub(cs, "logits matmul");
    matmul_forward(logits, x, W_s + (size_t)c0 * H, N, H, width, cs);
    prof_sub(cs, "statistics");
    cross_entropy_block_forward(st.m(), st.l(), st.target_logit(), logits, targets, N, width, lo + c0, cs);
  }
}

// One meeting, backward: dx_acc [N,H] (+=, fp32) and dW_acc [rows,H] (+=) from the blocks' dlogits. When
// the accumulator that travels is still arriving, acc_ready is its arrival: the first block's logits
// and dlogits are computed before the wait, the products into the accumulators after it.
inline void ring_dtp_meet_backward(float* dx_acc, floatX* dW_acc, const floatX* x, const int* targets, const float* lse,
                                   float dloss, const floatX* W_s, int lo, int rows, int N, int H, int V, int block_cols,
                                   floatX* logits, const StreamPoint* acc_ready, cudaStream_t cs) {
  for (int c0 = 0; c0 < rows; c0 += block_cols) {
    const int width = std::min(block_cols, rows - c0);
    const floatX* W_sub = W_s + (size_t)c0 * H;
    prof_sub(cs, "logits matmul (recomputed)");
    matmul_forward(logits, x, W_sub, N, H, width, cs);
    prof_sub(cs, "cross-entropy bwd");
    cross_entropy_block_backward(logits, logits, lse, targets, dloss, N, width, lo + c0, V, cs);
    prof_sub(cs, "accumulator arrived (wait)");
    if (c0 == 0 && acc_ready != nullptr) acc_ready->wait_on(cs, "ring_dtp");
    prof_sub(cs, "dx matmul");
    matmul_backward_dx(dx_acc, logits, W_sub, N, H, width, cs, true);
    prof_sub(cs, "dW matmul (+=)");
    matmul_backward_dW(dW_acc + (size_t)c0 * H, logits, x, N, H, width, cs);
  }
}

inline void ring_dtp_zero(void* p, size_t bytes, cudaStream_t s) {
  cudaCheck(cudaMemsetAsync(p, 0, bytes, s), "ring_dtp", "memset bytes=%zu", bytes);
}

// --head ring_dtp (P = group.size) and --head chunked (P = 1, a group of one): the output head seam
// over this rank's vocabulary interval W [hi − lo, H] of lm_head and dW (+=) of it.
struct RingDTPHead : OutputHead {
  Comm group;  // the vocabulary group (size 1: the chunked head, no communicator)
  std::string mode;
  int block_cols;
  RingDTPHead(const Comm& vocab_group, const std::string& ring_mode, int block_cols)
      : group(vocab_group), mode(ring_mode), block_cols(block_cols) {
    if (block_cols < 1) fm_fail("ring_dtp", "block_cols must be >= 1", "block_cols=%d", block_cols);
  }

  // Each rank projects its interval ([n, w] padded), the group gathers [P, n, w], and each rank's
  // columns go to their place in [n, V].
  void logits_rows(floatX* logits, const floatX* x, const floatX* W, int n, int H, int V, cudaStream_t cs) override {
    const int P = group.size;
    if (P == 1) return matmul_forward(logits, x, W, n, H, V, cs);
    const size_t w = (size_t)ring_dtp_widest_shard(V, P);
    floatX* mine = pool().alloc_t<floatX>((size_t)n * w, Mem::Logits, "ring_dtp.logits_rows");
    floatX* gathered = pool().alloc_t<floatX>((size_t)P * n * w, Mem::Logits, "ring_dtp.logits_rows_gathered");
    const std::pair<int, int> own = rows_of(group.rank, V);
    ring_dtp_zero(mine, (size_t)n * w * sizeof(floatX), cs);
    matmul_gemm("ring_dtp.logits_rows", CUBLAS_OP_T, CUBLAS_OP_N, own.second - own.first, n, H, W, H, x, H, 0.0f, mine,
                (int)w, n, H, V, cs);
    all_gather(group, mine, gathered, (size_t)n * w, cs);
    for (int p = 0; p < P; p++) {
      const std::pair<int, int> iv = rows_of(p, V);
      cudaCheck(cudaMemcpy2DAsync(logits + iv.first, (size_t)V * sizeof(floatX), gathered + (size_t)p * n * w,
                                  w * sizeof(floatX), (size_t)(iv.second - iv.first) * sizeof(floatX), n,
                                  cudaMemcpyDeviceToDevice, cs),
                "ring_dtp.logits_rows", "n=%d V=%d P=%d", n, V, P);
    }
    for (void* p : {(void*)mine, (void*)gathered}) pool().free(p);
  }

  // dx's fp32 accumulator [N,H], zeroed: dx itself in the FP32 build, a pool buffer (CommStaging) in
  // the BF16 build, so that the products of every block and round add up in fp32 and dx is rounded once.
  static float* dx_accumulator(floatX* dx, int N, int H, cudaStream_t cs) {
    float* acc = std::is_same<floatX, float>::value ? reinterpret_cast<float*>(dx)
                                                     : pool().alloc_t<float>((size_t)N * H, Mem::CommStaging, "ring_dtp.dx_acc");
    ring_dtp_zero(acc, (size_t)N * H * sizeof(float), cs);
    return acc;
  }
  static void dx_from_accumulator(floatX* dx, float* acc, int N, int H, cudaStream_t cs) {
    if ((void*)acc == (void*)dx) return;
    convert(dx, acc, (size_t)N * H, cs);
    pool().free(acc);
  }

  std::pair<int, int> rows_of(int rank, int V) const { return ring_dtp_vocab_interval(V, group.size, rank); }
  size_t live_bytes(int N, int H, int V) const override {
    const RingDTPBranch branch = ring_dtp_choose(mode, N, V, group.size, H, sizeof(floatX), true).branch;
    return ring_dtp_live_bytes(branch, N, V, group.size, H, block_cols, sizeof(floatX));
  }
  int visitor(int round) const { return ring_dtp_visitor(group.rank, round % group.size, group.size); }

  void forward_backward(float* loss_sum_out, floatX* dx, floatX* dW, const floatX* x, const floatX* W,
                        const int* targets, float dloss, int N, int H, int V, cudaStream_t cs) override {
    const int P = group.size;
    if (P == 1) return FullHead(block_cols).forward_backward(loss_sum_out, dx, dW, x, W, targets, dloss, N, H, V, cs);
    const RingDTPBranch branch = ring_dtp_choose(mode, N, V, P, H, sizeof(floatX), dx != nullptr).branch;
    float* losses = pool().alloc_t<float>(N, Mem::Logits, "ring_dtp.losses");
    if (branch == RingDTPBranch::Fused) {
      fused_pass(losses, dx, dW, x, W, targets, dloss, N, H, V, cs);
    } else {
      const size_t w = (size_t)ring_dtp_widest_shard(V, P);
      floatX* logits = pool().alloc_t<floatX>((size_t)N * std::min<size_t>(block_cols, w), Mem::Logits, "ring_dtp.logits");
      float* lse = pool().alloc_t<float>(N, Mem::Logits, "ring_dtp.lse");
      if (branch == RingDTPBranch::Weights) weights_pass(losses, lse, dx, dW, x, W, targets, dloss, N, H, V, logits, cs);
      else activations_pass(losses, lse, dx, dW, x, W, targets, dloss, N, H, V, logits, cs);
      for (void* p : {(void*)logits, (void*)lse}) pool().free(p);
    }
    ::loss_sum(loss_sum_out, losses, N, cs);
    pool().free(losses);
  }

  // Row blocks instead of rounds: at step t every rank's rows [t·n, t·n + n_t) go to every rank (two
  // all-gathers: x rows, targets), each rank projects the gathered block [P·n_t, its shard's columns] and
  // folds it into per-row statistics, the group gathers the statistics (3 values a row and rank) and each
  // rank combines them in rank order into every gathered row's lse, and its own rows' losses. Training:
  // the block's dlogits (in place), dW (+=) of this rank's shard from them and the gathered rows, and the
  // rows' dx partial over this shard (fp32), which a reduce-scatter sums into each row's own rank. The next
  // step's rows are gathered, and the last step's partials reduced, while this step computes (two slots).
  void fused_pass(float* losses, floatX* dx, floatX* dW, const floatX* x, const floatX* W, const int* targets,
                  float dloss, int N, int H, int V, cudaStream_t cs) {
    const int P = group.size;
    const cudaStream_t xs = group.stream;
    const std::pair<int, int> mine = rows_of(group.rank, V);
    const int lo = mine.first, cols = mine.second - mine.first, w = ring_dtp_widest_shard(V, P);
    if (N == 0) return;  // every rank of the group passes the same N: none of them gathers anything
    const int n = head_block_rows(N, w, P, block_cols), steps = ceil_div(N, n);
    const size_t g_max = (size_t)P * n;
    const bool training = dx != nullptr;
    floatX* logits = pool().alloc_t<floatX>(g_max * w, Mem::Logits, "ring_dtp.logits");
    const std::array<floatX*, 2> x_slot = {pool().alloc_t<floatX>(g_max * H, Mem::CommStaging, "ring_dtp.x_rows"),
                                           pool().alloc_t<floatX>(g_max * H, Mem::CommStaging, "ring_dtp.x_rows")};
    const std::array<int*, 2> t_slot = {pool().alloc_t<int>(g_max, Mem::CommStaging, "ring_dtp.targets_rows"),
                                        pool().alloc_t<int>(g_max, Mem::CommStaging, "ring_dtp.targets_rows")};
    RingDTPStats st{pool().alloc_t<float>(3 * g_max, Mem::Logits, "ring_dtp.stats"), 0};
    float* gathered = pool().alloc_t<float>(3 * g_max * P, Mem::CommStaging, "ring_dtp.stats_gathered");
    float* lse = pool().alloc_t<float>(g_max, Mem::Logits, "ring_dtp.lse");
    std::array<float*, 2> dx_part = {nullptr, nullptr};  // [P·n, H] fp32: the gathered rows' dx over this shard
    float* dx_rows = nullptr;                            // [n, H] fp32: this rank's rows, summed over the group
    if (training) {
      for (float*& slot : dx_part) slot = pool().alloc_t<float>(g_max * H, Mem::CommStaging, "ring_dtp.dx_part");
      dx_rows = pool().alloc_t<float>((size_t)n * H, Mem::CommStaging, "ring_dtp.dx_rows");
    }
    auto step_rows = [&](int t) { return std::min(n, N - t * n); };
    StreamPoint arrived, stats_ready, stats_arrived, dx_reduced;
    auto gather_rows = [&](int t) {  // step t's rows of every rank into slot t % 2
      all_gather(group, x + (size_t)t * n * H, x_slot[t % 2], (size_t)step_rows(t) * H, xs);
      all_gather(group, targets + (size_t)t * n, t_slot[t % 2], (size_t)step_rows(t), xs);
      arrived.record(xs, "ring_dtp");
    };
    auto reduce_rows = [&](int t) {  // step t's dx partials into this rank's rows
      reduce_scatter_sum(group, (const float*)dx_part[t % 2], dx_rows, (size_t)step_rows(t) * H, xs);
      dx_reduced.record(xs, "ring_dtp");
    };
    auto take_dx_rows = [&](int t) {  // step t's reduced rows into dx, rounded to floatX once
      dx_reduced.wait_on(cs, "ring_dtp");
      convert(dx + (size_t)t * n * H, dx_rows, (size_t)step_rows(t) * H, cs);
    };
    stream_after(xs, cs, "ring_dtp");  // x and targets are ready for the communicator's stream
    gather_rows(0);
    for (int t = 0; t < steps; t++) {
      const int nt = step_rows(t), g = P * nt;
      st.N = g;
      prof_sub(cs, "rows gathered (wait)");
      arrived.wait_on(cs, "ring_dtp");
      prof_sub(cs, "logits matmul");
      matmul_forward(logits, x_slot[t % 2], W, g, H, cols, cs);
      prof_sub(cs, "statistics");
      cross_entropy_stats_init(st.m(), st.l(), st.target_logit(), g, cs);
      cross_entropy_block_forward(st.m(), st.l(), st.target_logit(), logits, t_slot[t % 2], g, cols, lo, cs);
      // everything the compute stream did before is done once the communicator's stream passes this point:
      // the products of step t − 1 (slot (t + 1) % 2 is free) and its dx partial
      stats_ready.record(cs, "ring_dtp");
      stats_ready.wait_on(xs, "ring_dtp");
      all_gather(group, (const float*)st.data, gathered, 3 * (size_t)g, xs);
      stats_arrived.record(xs, "ring_dtp");
      if (training && t > 0) reduce_rows(t - 1);
      if (t + 1 < steps) gather_rows(t + 1);
      prof_sub(cs, "statistics gathered (wait)");
      stats_arrived.wait_on(cs, "ring_dtp");
      ring_dtp_fused_stats(lse, losses + (size_t)t * n, gathered, P, g, group.rank * nt, nt, cs);
      if (!training) continue;
      prof_sub(cs, "cross-entropy bwd");
      cross_entropy_block_backward(logits, logits, lse, t_slot[t % 2], dloss, g, cols, lo, V, cs);
      prof_sub(cs, "dW matmul (+=)");
      matmul_backward_dW(dW, logits, x_slot[t % 2], g, H, cols, cs);
      prof_sub(cs, "dx rows reduced (wait)");
      if (t > 0) take_dx_rows(t - 1);  // also: the reduce-scatter that read dx_part[t % 2] (step t − 2) is done
      prof_sub(cs, "dx matmul");
      matmul_backward_dx(dx_part[t % 2], logits, W, g, H, cols, cs);
    }
    if (training) {
      stream_after(xs, cs, "ring_dtp");
      reduce_rows(steps - 1);
      take_dx_rows(steps - 1);
    }
    stream_after(cs, xs, "ring_dtp");  // every collective done before the caller reuses x, targets or the slots
    for (void* p : {(void*)logits, (void*)x_slot[0], (void*)x_slot[1], (void*)t_slot[0], (void*)t_slot[1], (void*)st.data,
                    (void*)gathered, (void*)lse, (void*)dx_part[0], (void*)dx_part[1], (void*)dx_rows})
      pool().free(p);
  }

  // Batches stay; shards travel through min(2, P − 1) slots, and in backward the shard's gradient
  // accumulator one step behind (two buffers: one being added to, one arriving).
  void weights_pass(float* losses, float* lse, floatX* dx, floatX* dW, const floatX* x, const floatX* W,
                    const int* targets, float dloss, int N, int H, int V, floatX* logits, cudaStream_t cs) {
    const int P = group.size;
    const size_t w = (size_t)ring_dtp_widest_shard(V, P);
    const cudaStream_t xs = group.stream;
    auto rows = [&](int round) { const std::pair<int, int> iv = rows_of(visitor(round), V); return iv.second - iv.first; };
    auto lo = [&](int round) { return rows_of(visitor(round), V).first; };
    floatX* slot[2] = {pool().alloc_t<floatX>(w * H, Mem::CommStaging, "ring_dtp.shard_slot"),
                       P > 2 ? pool().alloc_t<floatX>(w * H, Mem::CommStaging, "ring_dtp.shard_slot") : nullptr};
    StreamPoint computed, arrived, acc_arrived;
    // The shards' round trip, the same in forward and backward: round q computes with `cur` while
    // the next shard arrives in slot q % 2 (the slot round q − 1 computed with, free once it has).
    auto prefetch_next_shard = [&](int q, const floatX* cur) {
      if (q + 1 == P) return;
      if (q > 0) computed.wait_on(xs, "ring_dtp");
      ring_send_recv(group, cur, (size_t)rows(q) * H, slot[q % 2], (size_t)rows(q + 1) * H, xs);
      arrived.record(xs, "ring_dtp");
    };
    stream_after(xs, cs, "ring_dtp");  // W, x and the slots are ready for the communicator's stream

    RingDTPStats st{pool().alloc_t<float>(3 * (size_t)N, Mem::Logits, "ring_dtp.stats"), N};
    cross_entropy_stats_init(st.m(), st.l(), st.target_logit(), N, cs);
    const floatX* cur = W;
    for (int q = 0; q < P; q++) {
      prefetch_next_shard(q, cur);
      ring_dtp_meet_forward(st, x, targets, cur, lo(q), rows(q), N, H, block_cols, logits, cs);
      computed.record(cs, "ring_dtp");
      if (q + 1 < P) {
        arrived.wait_on(cs, "ring_dtp");
        cur = slot[q % 2];
      }
    }
    cross_entropy_stats_finish(losses, lse, st.m(), st.l(), st.target_logit(), N, cs);
    pool().free(st.data);

    if (dx != nullptr) {
      floatX* acc[2] = {pool().alloc_t<floatX>(w * H, Mem::CommStaging, "ring_dtp.dW_acc"),
                        pool().alloc_t<floatX>(w * H, Mem::CommStaging, "ring_dtp.dW_acc")};
      float* dx_acc = dx_accumulator(dx, N, H, cs);
      ring_dtp_zero(acc[0], w * H * sizeof(floatX), cs);  // round 0's accumulator: nothing yet
      stream_after(xs, cs, "ring_dtp");
      cur = W;
      for (int q = 0; q < P; q++) {
        prefetch_next_shard(q, cur);
        ring_dtp_meet_backward(dx_acc, acc[q % 2], x, targets, lse, dloss, cur, lo(q), rows(q), N, H, V, block_cols,
                               logits, q > 0 ? &acc_arrived : nullptr, cs);
        computed.record(cs, "ring_dtp");
        // the accumulator to the rank that holds this shard next (after the last round: its owner)
        computed.wait_on(xs, "ring_dtp");
        ring_send_recv(group, (const floatX*)acc[q % 2], (size_t)rows(q) * H, acc[(q + 1) % 2],
                       (size_t)rows(q + 1) * H, xs);
        acc_arrived.record(xs, "ring_dtp");
        if (q + 1 < P) {
          arrived.wait_on(cs, "ring_dtp");
          cur = slot[q % 2];
        }
      }
      acc_arrived.wait_on(cs, "ring_dtp");
      add_inplace_or_out(dW, dW, acc[P % 2], (size_t)rows(P) * H, cs);
      dx_from_accumulator(dx, dx_acc, N, H, cs);
      for (void* p : {(void*)acc[0], (void*)acc[1]}) pool().free(p);
    }
    stream_after(cs, xs, "ring_dtp");  // every hop done before the caller reuses W, x or the slots
    for (void* p : {(void*)slot[0], (void*)slot[1]}) pool().free(p);
  }

  // Shards stay; batches travel through min(2, P − 1) slots (rows, targets, and the statistics one step
  // behind in forward; rows, targets, lse, and the dx accumulator one step behind in backward), each one
  // more hop home (the dx accumulator's last hop lands in dx).
  void activations_pass(float* losses, float* lse, floatX* dx, floatX* dW, const floatX* x, const floatX* W,
                        const int* targets, float dloss, int N, int H, int V, floatX* logits, cudaStream_t cs) {
    const int P = group.size;
    const cudaStream_t xs = group.stream;
    const std::pair<int, int> mine = rows_of(group.rank, V);
    const int lo = mine.first, rows = mine.second - mine.first;
    const size_t NH = (size_t)N * H;
    auto slots_of = [&](auto* type, size_t count, const char* tag) {
      using T = std::remove_pointer_t<decltype(type)>;
      return std::array<T*, 2>{pool().alloc_t<T>(count, Mem::CommStaging, tag),
                               P > 2 ? pool().alloc_t<T>(count, Mem::CommStaging, tag) : nullptr};
    };
    const std::array<floatX*, 2> x_slot = slots_of((floatX*)nullptr, NH, "ring_dtp.x_slot");
    const std::array<int*, 2> t_slot = slots_of((int*)nullptr, (size_t)N, "ring_dtp.targets_slot");
    StreamPoint computed, arrived, acc_arrived;
    const floatX* cur_x;
    const int* cur_t;
    // round q computes with (cur_x, cur_t) while the next batch's rows arrive in slot q % 2
    auto prefetch_next_batch = [&](int q) {
      if (q + 1 == P) return;
      if (q > 0) computed.wait_on(xs, "ring_dtp");
      ring_send_recv(group, cur_x, NH, x_slot[q % 2], NH, xs);
      ring_send_recv(group, cur_t, (size_t)N, t_slot[q % 2], (size_t)N, xs);
      arrived.record(xs, "ring_dtp");
    };
    auto take_next_batch = [&](int q) {
      arrived.wait_on(cs, "ring_dtp");
      cur_x = x_slot[q % 2];
      cur_t = t_slot[q % 2];
    };

    RingDTPStats st[2] = {{pool().alloc_t<float>(3 * (size_t)N, Mem::Logits, "ring_dtp.stats"), N},
                          {pool().alloc_t<float>(3 * (size_t)N, Mem::Logits, "ring_dtp.stats"), N}};
    cross_entropy_stats_init(st[0].m(), st[0].l(), st[0].target_logit(), N, cs);
    cur_x = x;
    cur_t = targets;
    stream_after(xs, cs, "ring_dtp");
    for (int q = 0; q < P; q++) {
      prefetch_next_batch(q);
      ring_dtp_meet_forward(st[q % 2], cur_x, cur_t, W, lo, rows, N, H, block_cols, logits, cs);
      computed.record(cs, "ring_dtp");
      computed.wait_on(xs, "ring_dtp");  // the statistics on to the batch's next rank (after the last round: home)
      ring_send_recv(group, (const float*)st[q % 2].data, 3 * (size_t)N, st[(q + 1) % 2].data, 3 * (size_t)N, xs);
      acc_arrived.record(xs, "ring_dtp");
      acc_arrived.wait_on(cs, "ring_dtp");
      if (q + 1 < P) take_next_batch(q);
    }
    const RingDTPStats& home = st[P % 2];
    cross_entropy_stats_finish(losses, lse, home.m(), home.l(), home.target_logit(), N, cs);
    for (const RingDTPStats& s : st) pool().free(s.data);

    if (dx != nullptr) {
      const std::array<float*, 2> lse_slot = slots_of((float*)nullptr, (size_t)N, "ring_dtp.lse_slot");
      float* acc[2] = {pool().alloc_t<float>(NH, Mem::CommStaging, "ring_dtp.dx_acc"),
                       pool().alloc_t<float>(NH, Mem::CommStaging, "ring_dtp.dx_acc")};
      ring_dtp_zero(acc[0], NH * sizeof(float), cs);
      stream_after(xs, cs, "ring_dtp");
      cur_x = x;
      cur_t = targets;
      const float* cur_lse = lse;
      for (int q = 0; q < P; q++) {
        if (q + 1 < P) {
          if (q > 0) computed.wait_on(xs, "ring_dtp");
          ring_send_recv(group, cur_lse, (size_t)N, lse_slot[q % 2], (size_t)N, xs);
        }
        prefetch_next_batch(q);
        ring_dtp_meet_backward(acc[q % 2], dW, cur_x, cur_t, cur_lse, dloss, W, lo, rows, N, H, V, block_cols, logits,
                               q > 0 ? &acc_arrived : nullptr, cs);
        computed.record(cs, "ring_dtp");
        computed.wait_on(xs, "ring_dtp");  // the dx accumulator on with its batch (after the last round: home)
        ring_send_recv(group, (const float*)acc[q % 2], NH, acc[(q + 1) % 2], NH, xs);
        acc_arrived.record(xs, "ring_dtp");
        if (q + 1 < P) {
          take_next_batch(q);
          cur_lse = lse_slot[q % 2];
        }
      }
      acc_arrived.wait_on(cs, "ring_dtp");
      convert(dx, acc[P % 2], NH, cs);  // rounded to floatX once
      for (void* p : {(void*)lse_slot[0], (void*)lse_slot[1], (void*)acc[0], (void*)acc[1]}) pool().free(p);
    }
    stream_after(cs, xs, "ring_dtp");
    for (void* p : {(void*)x_slot[0], (void*)x_slot[1], (void*)t_slot[0], (void*)t_slot[1]}) pool().free(p);
  }
};
