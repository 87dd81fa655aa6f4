// ring_dtp.cuh — Ring-DTP (notes/design.md §6.5; "Flattening Every Memory Peak in Long-Context Mixture-of-Experts
// Training", §3.2, appendix C): the vocabulary projection and cross-entropy over P ranks in a ring, each rank with
// its own batch and its own vocabulary interval of lm_head, without the N×V logits on any rank. Twin of
// ref/ring_dtp.hpp (the ring, round by round, in plain math) and ref/cross_entropy.hpp (the loss).
//
// What it computes: exactly the full head (ops/cross_entropy.cuh FullHead) over the group's batches:
// rank r's loss sum and dx over its own batch X_r [N_r,H], and dW (+=) of its vocabulary interval
// [lo_r, hi_r) of W [V,H], summed over every rank's batch. Intervals: lo_r = ⌊r·V/P⌋, so sizes differ
// by at most one and V need not be divisible by P.
//
// The ring: rank r sends to (r+1) mod P, receives from (r−1) mod P; P rounds. At round q rank r holds
// shard (r − q) mod P (weights move) or the batch of rank (r − q) mod P (activations move): every
// batch meets every shard once. A meeting computes the logits block X·W_sᵀ [N, V_s] in sub-blocks of
// at most block_cols columns, updates each row's running max m and sum l of exp(logit − m) (online
// softmax), and the meeting whose shard owns a row's target takes its target logit;
// loss_n = m + log l − target logit. Backward replays the meetings: dlogits = dloss·(softmax − onehot),
// dX += dlogits·W_sub, dW_sub += dlogitsᵀ·X; the gradient of the moving tensor travels with it.
//   weights      (N > V/P) batches and statistics stay, shards travel: V_s·H·b bytes per hop and no
//                hop home in forward (the owner has its shard); backward: the shard and its gradient
//                accumulator, which takes one more hop, home.
//   activations  (N ≤ V/P) shards stay, batches travel with their statistics: N·H·b + 3·N·4 bytes
//                per hop (x rows; m, l, target logit in fp32); one more hop takes the statistics home.
//   auto (the default) picks by that rule, from sizes every rank knows (N = the most tokens any rank
//   holds, V/P = the widest shard), printed at start-up with both volumes.
// Largest live block: N × min(block_cols, ⌈V/P⌉) logits, never N × V (ring_dtp_block_elems).
//
// Built so far: the host-side plan below (intervals, the branch, the ring's schedule, the widest
// block), checked against its twin on the CPU. The GPU schedule and the single-GPU chunked head
// (--head chunked: the same online softmax over vocabulary blocks on one rank, P = 1) are the next
// step; until then --head ring_dtp and --head chunked are refused at start-up.
#pragma once
#include <string>
#include <utility>
#include "../runtime/check.cuh"

// ---------------------------------------------------------------------------------------------
// Host-side plan (pure C++: no CUDA call)

enum class RingDTPBranch { Weights, Activations };

inline const char* ring_dtp_branch_name(RingDTPBranch branch) { return branch == RingDTPBranch::Weights ? "weights" : "activations"; }

// Rank r's vocabulary interval [lo, hi) of P: lo = ⌊r·V/P⌋.
inline std::pair<int, int> ring_dtp_vocab_interval(int V, int P, int r) {
  if (V < 1 || P < 1 || P > V || r < 0 || r >= P)
    fm_fail("ring_dtp_vocab_interval", "need 1 <= P <= V and 0 <= r < P", "V=%d P=%d r=%d", V, P, r);
  return {(int)((long long)r * V / P), (int)((long long)(r + 1) * V / P)};
}

// The widest shard, ⌈V/P⌉ rows.
inline int ring_dtp_widest_shard(int V, int P) { return (int)(((long long)V + P - 1) / P); }

// The branch a run uses and both per-hop volumes (printed at start-up).
struct RingDTPChoice {
  RingDTPBranch branch = RingDTPBranch::Activations;
  long long weight_bytes = 0, activation_bytes = 0;  // per hop
};

// mode "weights", "activations" or "auto" (weights exactly when N_max > ⌈V/P⌉); N_max: the most
// tokens any rank holds; b: bytes per floatX.
inline RingDTPChoice ring_dtp_choose(const std::string& mode, long long N_max, int V, int P, int H, size_t b) {
  const char* op = "ring_dtp_choose";
  if (N_max < 0 || V < 1 || P < 1 || P > V || H < 1 || b < 1)
    fm_fail(op, "need N >= 0, 1 <= P <= V, H >= 1 and b >= 1", "N=%lld V=%d P=%d H=%d b=%zu", N_max, V, P, H, b);
  const long long widest = ring_dtp_widest_shard(V, P);
  RingDTPChoice choice;
  choice.weight_bytes = widest * H * (long long)b;
  choice.activation_bytes = N_max * H * (long long)b + 3 * N_max * 4;
  if (mode == "weights") choice.branch = RingDTPBranch::Weights;
  else if (mode == "activations") choice.branch = RingDTPBranch::Activations;
  else if (mode == "auto") choice.branch = N_max > widest ? RingDTPBranch::Weights : RingDTPBranch::Activations;
  else fm_fail(op, "the Ring-DTP mode must be weights, activations or auto", "mode=%s", mode.c_str());
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
