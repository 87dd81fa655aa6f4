// relay_moe.cuh — RelayMoE (notes/design.md §6.4; "RelayMoE", §3): the dropless MoE FFN of ops/moe.cuh
// over an EP group of E_p ranks in a ring, without an all-to-all and without a k·N expanded buffer.
// Twin of ref/relay_moe.hpp (the ring, hop by hop, in plain math) and ref/moe.hpp (the math).
//
// What it computes: exactly moe_forward / moe_backward over the group's global batch, each rank
// holding its own token shard (N_r tokens, N_r may differ and be 0) and its own E_l = E/E_p experts
// [r·E_l, (r+1)·E_l) — partition r — as in ops/ep_moe.cuh. Only where and when a (token, expert)
// pair is computed changes: in the ring, at the hop where the pair's token and its expert's weights
// meet.
//
// The ring: rank r sends to (r+1) mod E_p and receives from (r−1) mod E_p; E_p hops h = 0 … E_p−1.
//   expert mode (--relay_mode expert): tokens stay, expert partitions travel. At hop h rank r holds
//             partition (r − h) mod E_p (its own at hop 0) and computes its own tokens' routes to
//             those experts, scaled by the combine weights, into its output; meanwhile the next
//             partition comes from its left neighbour into a second buffer. Backward: the same ring;
//             each hop recomputes that hop's intermediates, adds the input and combine-weight
//             gradients locally, and adds the partition's weight gradient into an accumulator that
//             travels one hop behind the weights: the partition at hop h is on rank (p + h) mod E_p,
//             and one more pass after the last hop brings its accumulator home to p.
//   token mode (--relay_mode token): experts stay, token blocks travel with their routing (indices
//             and weights) and an output accumulator. At hop h rank r holds the block of source
//             (r − h) mod E_p and computes its routes to r's own experts into the block's
//             accumulator; one more pass after the last hop brings every block home. Backward:
//             inputs, output gradients and the accumulated input and combine-weight gradients
//             travel; the weight gradients accumulate where the experts live.
//   auto (the default): the smaller per-hop volume, decided once at start-up from sizes every rank
//             knows (N = the most tokens any rank holds, so that every rank makes the same choice):
//               experts  E_l·3·H·I·b                       (a partition's W13 [2I,H] and W2 [H,I])
//               tokens   N·H·b + N·H·b_acc + N·k·8         (rows, output accumulator, routing)
//             b = bytes per floatX, b_acc = bytes per accumulator element.
// Every (token, expert) pair is computed exactly once: a token's route to expert e meets e's
// partition e / E_l at exactly one hop (tests/gpu_relay_plan.cu checks it for E_p up to 64).
//
// Built so far: the host-side plan below (the choice, the volumes, the ring's schedule), checked
// against its twin for both modes. The GPU schedule (double-buffered prefetch on the communicator's
// stream, one grouped GEMM per hop, per-hop recomputation in backward) is the next step; until then
// --moe relay is refused at start-up.
#pragma once
#include <string>
#include <vector>
#include "../runtime/check.cuh"

// ---------------------------------------------------------------------------------------------
// Host-side plan (pure C++: no CUDA call; the plan tests run it for up to 64 ranks without a GPU)

enum class RelayMode { Expert, Token };

inline const char* relay_mode_name(RelayMode mode) { return mode == RelayMode::Expert ? "expert" : "token"; }

// Bytes that one hop moves from each rank to the next.
inline long long relay_expert_hop_bytes(int E_l, int H, int I, size_t b) { return (long long)E_l * 3 * H * I * (long long)b; }
inline long long relay_token_hop_bytes(long long N, int H, int k, size_t b, size_t b_acc) {
  return N * H * (long long)b + N * H * (long long)b_acc + N * k * 8;
}

// The mode a run uses and both per-hop volumes (printed at start-up).
struct RelayChoice {
  RelayMode mode = RelayMode::Expert;
  long long expert_bytes = 0, token_bytes = 0;  // per hop
};

// mode "expert", "token" or "auto" (the smaller volume; a tie keeps the tokens in place: expert).
// N_max: the most tokens any rank of the group holds.
inline RelayChoice relay_choose(const std::string& mode, long long N_max, int H, int I, int E_l, int k, size_t b,
                                size_t b_acc) {
  const char* op = "relay_choose";
  if (N_max < 0 || H < 1 || I < 1 || E_l < 1 || k < 1 || b < 1 || b_acc < 1)
    fm_fail(op, "need N >= 0 and H, I, E_l, k and the element sizes >= 1", "N=%lld H=%d I=%d E_l=%d k=%d b=%zu b_acc=%zu",
            N_max, H, I, E_l, k, b, b_acc);
  RelayChoice choice;
  choice.expert_bytes = relay_expert_hop_bytes(E_l, H, I, b);
  choice.token_bytes = relay_token_hop_bytes(N_max, H, k, b, b_acc);
  if (mode == "expert") choice.mode = RelayMode::Expert;
  else if (mode == "token") choice.mode = RelayMode::Token;
  else if (mode == "auto") choice.mode = choice.token_bytes < choice.expert_bytes ? RelayMode::Token : RelayMode::Expert;
  else fm_fail(op, "the relay mode must be expert, token or auto", "mode=%s", mode.c_str());
  return choice;
}

// The ring's neighbours.
inline int relay_next(int rank, int ranks) { return (rank + 1) % ranks; }
inline int relay_prev(int rank, int ranks) { return (rank + ranks - 1) % ranks; }

// What rank `rank` works with at hop `hop` (0 ≤ hop < ranks): the expert partition (expert mode)
// or the token block's source rank (token mode), (rank − hop) mod E_p in both.
inline int relay_visitor(int rank, int hop, int ranks) {
  if (ranks < 1 || rank < 0 || rank >= ranks || hop < 0 || hop >= ranks)
    fm_fail("relay_visitor", "need 0 <= rank < ranks and 0 <= hop < ranks", "rank=%d hop=%d ranks=%d", rank, hop, ranks);
  return ((rank - hop) % ranks + ranks) % ranks;
}

// Expert-mode backward: the rank that adds to partition p's weight-gradient accumulator at hop h,
// the rank that holds p's weights then ((p + h) mod E_p). After the last hop the accumulator moves on
// once more, to relay_next of the last: p itself.
inline int relay_accumulator_rank(int partition, int hop, int ranks) { return (partition + hop) % ranks; }

// The routes of one hop, in route order (route r = n·k + j of topk_idx [N·k]): those whose expert
// lies in partition `partition` (experts [partition·E_l, (partition+1)·E_l)). Expert mode: the
// rank's own routes with the visiting partition; token mode: the visiting block's routes with the
// rank's own partition.
inline std::vector<int> relay_hop_routes(const std::vector<int>& topk_idx, int partition, int E_l) {
  std::vector<int> routes;
  for (size_t r = 0; r < topk_idx.size(); r++)
    if (topk_idx[r] / E_l == partition) routes.push_back((int)r);
  return routes;
}
