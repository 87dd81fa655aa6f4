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
// partition e / E_l at exactly one hop (tests/cpu_relay_plan.cu checks it for E_p up to 64).
//
// Built: both modes, forward and backward (RelayDispatcher: --moe relay --relay_mode expert|token|auto).
//
// Shapes on rank r: x [N,H]; topk_idx [N,k] global expert ids; topk_w [N,k] float; W13 [E_l,2I,H] and
// W2 [E_l,H,I] (partition r); out, dx, dout [N,H]; dtopk_w [N,k]. N may differ between ranks (N = 0
// takes part in every hop). R = N·k routes; R_h = this rank's routes to the experts of hop h's
// partition (Σ_h R_h = R).
// Gradient outputs (as ops/ep_moe.cuh): dx (=), dtopk_w (=), dW13 (+=), dW2 (+=); an expert's weight
// gradient is summed over every rank's routes and added, once, at its owner.
//
// Schedule, expert mode. cs = the caller's (compute) stream, xs = the EP communicator's own stream
// (runtime/comm.cuh). Hops on xs, GEMMs and kernels on cs, ordered by StreamPoints, never by the host.
//   plan      (forward, once) moe_route_plan sorts this rank's routes by global expert: the routes of
//             partition p are then the contiguous sorted slots of experts [p·E_l, (p+1)·E_l)
//             (relay_hop_slice), and the per-expert counts come to the host (one synchronisation).
//             The two route maps are the saved state; backward replays them (notes/design.md §3).
//             forward with out = nullptr (a layer's recomputation) only plans.
//   forward   hop h: the next partition is received from the left neighbour into a slot while hop h
//             computes (the send of the partition in use, and the receive, run on xs after the
//             previous hop's compute, whose slot they overwrite); hop h gathers its R_h rows of x
//             (moe_permute_rows on the hop's slot window), one grouped GEMM per product over the
//             visiting experts (h13 = xp W13ᵀ, a = swiglu(h13), y = a W2ᵀ) and adds w·y into the
//             output (moe_combine_window_add: fixed j order inside a hop, hops in ring order, fp32).
//   backward  the same ring, the partitions travelling again. Hop h recomputes its xp, h13 and y
//             from the saved slots, writes dtopk_w of its routes and dy = w·dout in place of y
//             (moe_combine_backward_window), and then — after the partition's weight-gradient
//             accumulator has arrived from the left (it travels one hop behind the weights) — adds
//             dW2 += dyᵀa and dW13 += dh13ᵀ xp into it, and dx += dh13 W13 locally. The accumulator
//             leaves for the right after the hop; after the last hop that pass brings each partition's
//             accumulator home, where dW13, dW2 += it.
// out and dx sum in fp32 over the hops and are rounded to floatX once (the FP32 build sums in place).
// A weight-gradient accumulator is floatX, like the model's gradients: in the BF16 build each hop's
// partial sum is rounded into it, one more rounding per hop than EP's single GEMM per expert.
//
// Live set (pool bytes; b = sizeof(floatX); R_max = max_h R_h ≤ R; P_b = E_l·3·H·I·b one partition;
// S = min(2, E_p − 1) weight slots; O = N·H·4 the fp32 out/dx accumulator in the BF16 build, 0 in the
// FP32 build), relay_expert_live_bytes:
//   saved (forward → backward)  route maps 2·R·4                                    (Dispatch)
//   forward    Dispatch 8R + R_max·H·b (xp, then y)   ExpertIntermediates 3·R_max·I·b (h13 + a)
//              CommStaging S·P_b + O
//   backward   Dispatch 8R + 2·R_max·H·b (xp + y, y becomes dy in place)
//              ExpertIntermediates 5·R_max·I·b (h13 + da + dh13, as in ops/moe.cuh)
//              CommStaging (S + 2)·P_b + O (the slots, the accumulator in use and the one arriving)
// i.e. the rank's tokens and output (the caller's), two visiting partitions, and ONE hop's
// intermediates: nothing is sized by the routes that other ranks send (standard EP's R_d·H·b, which
// grows with E_p under skew) and no buffer holds all k·N expanded rows at once unless every one of this
// rank's routes meets one partition (R_max = R: all of them to one rank's experts).
//
// Schedule, token mode (same streams). The blocks' sizes (every rank's N) are exchanged once per forward
// (synchronises) and saved; nothing else is, and a recomputed forward (out = nullptr) only exchanges them.
//   forward   hop h: block (r − h) mod E_p (x rows, topk_idx, topk_w) is here; the next block arrives
//             into a slot while the hop computes. The hop sorts the block's routes by expert
//             (moe_route_plan: one synchronisation per hop, the counts size the GEMMs), computes those
//             to this rank's experts and, once the block's fp32 output accumulator has arrived (one
//             hop behind the rows), adds w·y into it; the accumulator then leaves for the right, and
//             the pass after the last hop brings every block's accumulator home: out = it, rounded once.
//   backward  blocks travel with x, dout and their routing; each hop recomputes the block's routes to
//             this rank's experts, adds their weight gradients in place (dW13, dW2 +=, where the experts
//             live), and writes their dtopk_w and adds their dx into the block's fp32 accumulator
//             [dx n·H | dtopk_w n·k], which travels one hop behind and comes home after the last hop.
// Live set, token mode (relay_token_live_bytes; N_max = the largest block, R_max = the most routes of
// one visiting block to this rank's experts; block = N_max·(H·b + 8k) in forward, N_max·(2·H·b + 8k) in
// backward; A = N_max·H·4 in forward, N_max·(H + k)·4 in backward; two of each when E_p > 1):
//   forward    Dispatch 8·N_max·k + R_max·H·b   ExpertIntermediates 3·R_max·I·b
//              CommStaging S·block + 2·A (the forward's exchange of sizes stages 16·E_p bytes before)
//   backward   Dispatch 8·N_max·k + 2·R_max·H·b   ExpertIntermediates 5·R_max·I·b   CommStaging S·block + 2·A
// Weight gradients in token mode are added hop by hop into dW13, dW2 (floatX): in the BF16 build one
// rounding per hop that brings routes, as in expert mode's travelling accumulator.
// Determinism: fixed hop order, fixed j order inside a hop, grouped GEMMs and NCCL copies: a rerun
// gives the same bits.
#pragma once
#include <algorithm>
#include <climits>
#include <memory>
#include <type_traits>
#include <string>
#include <vector>
#include "../runtime/check.cuh"
#include "../runtime/comm.cuh"
#include "../runtime/stream.cuh"
#include "common.cuh"
#include "moe.cuh"

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

// Hop h's share of the expert-sorted routes (moe_route_plan's order): the sorted slots [first,
// first + count) of partition `partition`'s experts, and per local expert l its routes counts[l] and
// first slot offsets[l], relative to `first`. expert_counts [E]: routes per global expert.
struct RelayHopSlice {
  int first = 0, count = 0;
  std::vector<int> counts, offsets;  // [E_l]
  ExpertRows rows() const { return ExpertRows::on_host(counts, offsets, count); }
};

inline RelayHopSlice relay_hop_slice(const std::vector<int>& expert_counts, int partition, int E_l) {
  const int E = (int)expert_counts.size();
  if (E_l < 1 || E % E_l != 0 || partition < 0 || partition >= E / E_l)
    fm_fail("relay_hop_slice", "need E_l >= 1 dividing E and 0 <= partition < E/E_l", "E=%d E_l=%d partition=%d", E, E_l,
            partition);
  RelayHopSlice slice;
  for (int e = 0; e < partition * E_l; e++) slice.first += expert_counts[e];
  slice.counts.assign(expert_counts.begin() + partition * E_l, expert_counts.begin() + (partition + 1) * E_l);
  slice.offsets.assign(E_l, 0);
  for (int l = 0; l < E_l; l++) {
    slice.offsets[l] = slice.count;
    slice.count += slice.counts[l];
  }
  return slice;
}

// The most routes of one hop, R_max = max over partitions of the routes to its experts.
inline long long relay_max_hop_routes(const std::vector<int>& expert_counts, int E_l) {
  long long most = 0;
  for (int p = 0; p * E_l < (int)expert_counts.size(); p++) most = std::max<long long>(most, relay_hop_slice(expert_counts, p, E_l).count);
  return most;
}

// The live set of the header, per pool category, for one pass.
struct RelayLiveBytes {
  size_t dispatch = 0, intermediates = 0, staging = 0;  // Dispatch, ExpertIntermediates, CommStaging
  size_t total() const { return dispatch + intermediates + staging; }
};

// Expert mode: the peaks of one forward (backward = false) or one backward, on a rank with N tokens,
// R = N·k routes and R_max routes in its largest hop. b = sizeof(floatX); the fp32 out/dx
// accumulator exists when b != 4.
inline RelayLiveBytes relay_expert_live_bytes(bool backward, long long N, int k, long long R_max, int H, int I, int E_l,
                                              int E_p, size_t b) {
  const size_t R = (size_t)N * k, slots = (size_t)std::min(2, E_p - 1), partition = (size_t)E_l * 3 * H * I * b;
  const size_t acc_fp32 = b == 4 ? 0 : (size_t)N * H * 4;
  RelayLiveBytes live;
  live.dispatch = 8 * R + (backward ? 2 : 1) * (size_t)R_max * H * b;
  live.intermediates = (backward ? 5 : 3) * (size_t)R_max * I * b;
  live.staging = (slots + (backward && E_p > 1 ? 2 : backward ? 1 : 0)) * partition + acc_fp32;
  return live;
}

// Token mode: the peaks of one forward or one backward on a rank of a group whose largest block holds
// N_max tokens, R_max = the most routes of one visiting block to this rank's experts. A block slot holds
// x rows (and in backward dout rows), indices and weights; an accumulator the block's fp32 output (in
// backward dx rows and dtopk_w). The forward's exchange of the blocks' sizes stages 16·E_p bytes first.
inline RelayLiveBytes relay_token_live_bytes(bool backward, long long N_max, int k, long long R_max, int H, int I,
                                             int E_p, size_t b) {
  const size_t slots = (size_t)std::min(2, E_p - 1), accumulators = E_p > 1 ? 2 : 1;
  const size_t block = (size_t)N_max * ((backward ? 2 : 1) * (size_t)H * b + 8 * (size_t)k);
  const size_t accumulator = (size_t)N_max * (H + (backward ? k : 0)) * 4;
  RelayLiveBytes live;
  live.dispatch = 8 * (size_t)N_max * k + (backward ? 2 : 1) * (size_t)R_max * H * b;
  live.intermediates = (backward ? 5 : 3) * (size_t)R_max * I * b;
  live.staging = std::max(!backward && E_p > 1 ? 16 * (size_t)E_p : 0, slots * block + accumulators * accumulator);
  return live;
}

// ---------------------------------------------------------------------------------------------
// The GPU schedule

// What backward replays: the forward's route sort. Pointers are nullptr when R = 0.
struct RelaySaved {
  int N = 0;
  bool planned = false;
  std::vector<long long> block_tokens;  // [E_p] host, token mode: every rank's N (the blocks' sizes)
  std::vector<int> expert_counts;  // [E] host, expert mode: routes per global expert
  int* route_of_slot = nullptr;    // [N·k] sorted slot -> route index r   (Dispatch)
  int* slot_of_route = nullptr;    // [N·k] route index r -> sorted slot   (Dispatch)
};

inline void relay_saved_free(RelaySaved& saved) {
  pool().free(saved.route_of_slot);
  pool().free(saved.slot_of_route);
  saved = RelaySaved();
}

// A partition as it travels: W13 [E_l,2I,H] then W2 [E_l,H,I] (a slot holds both, contiguous), or a
// weight-gradient accumulator of the same layout.
struct RelayPartition {
  floatX* W13 = nullptr;
  floatX* W2 = nullptr;
};

// --moe relay: the dispatcher seam (ops/moe.cuh) over this rank's EP group in a ring. Holds a copy of
// the group's Comm (a handle; the trainer owns and destroys the communicator).
struct RelayDispatcher : MoEDispatcher {
  struct Saved : DispatchSaved {
    RelaySaved relay;
    ~Saved() override { relay_saved_free(relay); }
  };
  Comm group;
  RelayMode mode;
  RelayDispatcher(int H_, int I_, int E_, int k_, const Comm& ep_group, RelayMode mode_)
      : MoEDispatcher(H_, I_, E_, k_), group(ep_group), mode(mode_) {
    if (group.size < 1 || E % group.size != 0)
      fm_fail("relay_moe", "the EP group size must divide the number of experts", "E=%d group=%s size=%d", E,
              group.name.c_str(), group.size);
  }
  int E_l() const { return E / group.size; }
  // The live set above at R_max = N·k (every route of a hop, or of a visiting block, meets one partition),
  // whatever the router does; expert mode saves the route maps, token mode nothing.
  DispatchBound live_bound(int N) const override {
    const long long R = (long long)N * k;
    const size_t b = sizeof(floatX);
    auto live = [&](bool backward) {
      return mode == RelayMode::Expert ? relay_expert_live_bytes(backward, N, k, R, H, I, E_l(), group.size, b)
                                       : relay_token_live_bytes(backward, N, k, R, H, I, group.size, b);
    };
    return DispatchBound{mode == RelayMode::Expert ? 8 * (size_t)R : 0,
                         std::max(live(false).total(), live(true).total()) + 3 * sizeof(void*) * (size_t)E_l()};
  }
  size_t w13_elems() const { return (size_t)E_l() * 2 * I * H; }
  size_t w2_elems() const { return (size_t)E_l() * H * I; }
  int partition_at(int hop) const { return relay_visitor(group.rank, hop, group.size); }

  RelayPartition alloc_partition(const char* tag) const {
    floatX* p = pool().alloc_t<floatX>(w13_elems() + w2_elems(), Mem::CommStaging, tag);
    return RelayPartition{p, p + w13_elems()};
  }
  static void free_partition(RelayPartition& p) {
    pool().free(p.W13);  // W2 lies in the same block
    p = RelayPartition();
  }
  // `send` to the right neighbour, `recv` (nullptr W13: nothing) from the left, in one NCCL group on xs.
  void pass_right(const RelayPartition& send, const RelayPartition& recv, cudaStream_t xs) const {
    const int next = relay_next(group.rank, group.size), prev = relay_prev(group.rank, group.size);
    std::vector<PeerMessage<const floatX>> sends;
    std::vector<PeerMessage<floatX>> recvs;
    if (send.W13 != nullptr) sends = {{send.W13, w13_elems(), next}, {send.W2, w2_elems(), next}};
    if (recv.W13 != nullptr) recvs = {{recv.W13, w13_elems(), prev}, {recv.W2, w2_elems(), prev}};
    point_to_point(group, sends, recvs, xs);
  }
  std::vector<const floatX*> slices13(const RelayPartition& p) const {
    std::vector<floatX*> s = expert_slices<floatX>(p.W13, E_l(), (size_t)2 * I * H);
    return std::vector<const floatX*>(s.begin(), s.end());
  }
  std::vector<const floatX*> slices2(const RelayPartition& p) const {
    std::vector<floatX*> s = expert_slices<floatX>(p.W2, E_l(), (size_t)H * I);
    return std::vector<const floatX*>(s.begin(), s.end());
  }

  // The hop's rows of x in slot order: xp [R_h,H] (Dispatch) and h13 [R_h,2I] = xp W13ᵀ
  // (ExpertIntermediates); y [R_h,H] = swiglu(h13) W2ᵀ (Dispatch), allocated after xp is freed
  // when keep_xp is false.
  void hop_forward(floatX** xp, floatX** h13, floatX** y, bool keep_xp, const int* route_of_slot,
                   const RelayHopSlice& slice, const floatX* x, const RelayPartition& w, cudaStream_t cs) const {
    const int R_h = slice.count;
    *xp = alloc_rows<floatX>((size_t)R_h * H, Mem::Dispatch, "relay_moe.xp");
    moe_permute_rows(*xp, x, route_of_slot + slice.first, R_h, H, k, cs);
    *h13 = alloc_rows<floatX>((size_t)R_h * 2 * I, Mem::ExpertIntermediates, "relay_moe.h13");
    const std::vector<const floatX*> W13 = slices13(w);
    grouped_gemm("relay_moe.h13", expert_problems(slice.rows(), [&](int l, size_t first, int rows) {
                   return GroupedGemmProblem{*xp + first * H, W13[l], *h13 + first * 2 * I, rows, 2 * I, H};
                 }),
                 false, true, H, H, 2 * I, 0.f, cs);
    if (!keep_xp) {
      pool().free(*xp);
      *xp = nullptr;
    }
    *y = alloc_rows<floatX>((size_t)R_h * H, Mem::Dispatch, "relay_moe.y");
    experts_swiglu_down(*y, *h13, slices2(w), slice.rows(), H, I, "relay_moe", cs);
  }

  // out [N,H] (=; nullptr: only the plan). Collective over the EP group.
  std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                         const floatX* W13, const floatX* W2, int N, cudaStream_t cs) override {
    const char* op = "relay_moe_forward";
    if (N < 0 || (long long)N * k > INT_MAX)
      fm_fail(op, "need 0 <= N and N·k within int indices", "N=%d k=%d group=%s", N, k, group.name.c_str());
    if (mode == RelayMode::Token) return token_forward(out, x, topk_idx, topk_w, W13, W2, N, cs);
    auto saved_ptr = std::make_unique<Saved>();
    RelaySaved& saved = saved_ptr->relay;
    const int R = N * k, E_p = group.size;
    saved.N = N;
    saved.route_of_slot = alloc_rows<int>(R, Mem::Dispatch, "relay_moe.route_of_slot");
    saved.slot_of_route = alloc_rows<int>(R, Mem::Dispatch, "relay_moe.slot_of_route");
    saved.expert_counts = moe_route_plan(saved.route_of_slot, saved.slot_of_route, topk_idx, R, E, cs);
    saved.planned = true;
    if (out == nullptr) return saved_ptr;

    const size_t NH = (size_t)N * H;
    float* out_acc = fp32_accumulator(out, NH, "relay_moe.out_acc", cs);
    RelayPartition slot[2];
    if (E_p > 1) slot[0] = alloc_partition("relay_moe.weight_slot");
    if (E_p > 2) slot[1] = alloc_partition("relay_moe.weight_slot");
    const cudaStream_t xs = group.stream;
    StreamPoint computed, arrived;
    if (E_p > 1) stream_after(xs, cs, op);  // W, x and the slots ready for the communicator's stream
    RelayPartition cur{const_cast<floatX*>(W13), const_cast<floatX*>(W2)};
    for (int h = 0; h < E_p; h++) {
      if (h + 1 < E_p) {  // the next partition arrives while this hop computes
        if (h > 0) computed.wait_on(xs, op);
        pass_right(cur, slot[h % 2], xs);
        arrived.record(xs, op);
      }
      const RelayHopSlice slice = relay_hop_slice(saved.expert_counts, partition_at(h), E_l());
      if (slice.count > 0) {
        floatX *xp, *h13, *y;
        hop_forward(&xp, &h13, &y, false, saved.route_of_slot, slice, x, cur, cs);
        pool().free(h13);
        moe_combine_window_add(out_acc, y, saved.slot_of_route, topk_w, slice.first, slice.count, N, H, k, cs);
        pool().free(y);
      }
      if (h + 1 < E_p) {
        computed.record(cs, op);
        arrived.wait_on(cs, op);
        cur = slot[h % 2];
      }
    }
    fp32_accumulator_finish(out, out_acc, NH, cs);
    if (E_p > 1) stream_after(cs, xs, op);  // every hop done before the caller reuses W or the slots
    for (RelayPartition& s : slot) free_partition(s);
    return saved_ptr;
  }

  // dx [N,H] (=), dtopk_w [N,k] (=), dW13 [E_l,2I,H] (+=), dW2 [E_l,H,I] (+=). Collective over the
  // forward's group. Does not synchronise.
  void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const DispatchSaved& saved_base,
                const floatX* x, const int* topk_idx, const float* topk_w, const floatX* W13, const floatX* W2,
                cudaStream_t cs) override {
    const char* op = "relay_moe_backward";
    const RelaySaved& saved = static_cast<const Saved&>(saved_base).relay;
    if (!saved.planned) fm_fail(op, "the saved state is empty: run the forward first", "group=%s", group.name.c_str());
    if (mode == RelayMode::Token)
      return token_backward(dx, dtopk_w, dW13, dW2, dout, saved, x, topk_idx, topk_w, W13, W2, cs);
    const int N = saved.N, E_p = group.size;
    const size_t NH = (size_t)N * H;
    float* dx_acc = fp32_accumulator(dx, NH, "relay_moe.dx_acc", cs);
    RelayPartition slot[2], acc[2];
    if (E_p > 1) slot[0] = alloc_partition("relay_moe.weight_slot");
    if (E_p > 2) slot[1] = alloc_partition("relay_moe.weight_slot");
    acc[0] = alloc_partition("relay_moe.dW_acc");
    if (E_p > 1) acc[1] = alloc_partition("relay_moe.dW_acc");
    zero(acc[0].W13, (w13_elems() + w2_elems()) * sizeof(floatX), cs);  // hop 0's accumulator: nothing yet
    const cudaStream_t xs = group.stream;
    StreamPoint computed, arrived, acc_arrived;
    if (E_p > 1) stream_after(xs, cs, op);
    RelayPartition cur{const_cast<floatX*>(W13), const_cast<floatX*>(W2)};
    for (int h = 0; h < E_p; h++) {
      if (h + 1 < E_p) {
        if (h > 0) computed.wait_on(xs, op);
        pass_right(cur, slot[h % 2], xs);
        arrived.record(xs, op);
      }
      const RelayHopSlice slice = relay_hop_slice(saved.expert_counts, partition_at(h), E_l());
      const RelayPartition& grad = acc[h % 2];
      floatX *xp = nullptr, *h13 = nullptr, *y = nullptr;
      if (slice.count > 0) {  // this hop's intermediates, recomputed; dy = w·dout in place of y
        hop_forward(&xp, &h13, &y, true, saved.route_of_slot, slice, x, cur, cs);
        moe_combine_backward_window(y, dtopk_w, dout, y, saved.slot_of_route, topk_w, slice.first, slice.count, N, H, k, cs);
      }
      if (h > 0) acc_arrived.wait_on(cs, op);  // the partition's accumulator, one hop behind its weights
      if (slice.count > 0) {
        const int R_h = slice.count;
        floatX* dh13 = experts_backward_to_h13(y, expert_slices<floatX>(grad.W2, E_l(), (size_t)H * I), h13, slices2(cur),
                                               slice.rows(), H, I, "relay_moe_backward", cs);
        // dW13_l [2I,H] += dh13_lᵀ [2I,R_l] · xp_l [R_l,H]
        grouped_gemm("relay_moe_backward.dW13", expert_problems(slice.rows(), [&](int l, size_t first, int rows) {
                       return GroupedGemmProblem{dh13 + first * 2 * I, xp + first * H, grad.W13 + l * (size_t)2 * I * H,
                                                 2 * I, H, rows};
                     }),
                     true, false, 2 * I, H, H, 1.f, cs);
        pool().free(xp);
        // dxp_l [R_l,H] = dh13_l [R_l,2I] · W13_l [2I,H];  dx[n] += Σ_j of the hop's routes
        floatX* dxp = alloc_rows<floatX>((size_t)R_h * H, Mem::Dispatch, "relay_moe.dxp");
        const std::vector<const floatX*> W13_cur = slices13(cur);
        grouped_gemm("relay_moe_backward.dxp", expert_problems(slice.rows(), [&](int l, size_t first, int rows) {
                       return GroupedGemmProblem{dh13 + first * 2 * I, W13_cur[l], dxp + first * H, rows, H, 2 * I};
                     }),
                     false, false, 2 * I, H, H, 0.f, cs);
        pool().free(dh13);
        pool().free(h13);
        moe_combine_window_add(dx_acc, dxp, saved.slot_of_route, nullptr, slice.first, slice.count, N, H, k, cs);
        pool().free(dxp);
      }
      computed.record(cs, op);
      if (E_p > 1) {  // the accumulator on to the rank that holds this partition next (after the last hop: its owner)
        computed.wait_on(xs, op);
        pass_right(grad, acc[(h + 1) % 2], xs);
        acc_arrived.record(xs, op);
      }
      if (h + 1 < E_p) {
        arrived.wait_on(cs, op);
        cur = slot[h % 2];
      }
    }
    if (E_p > 1) acc_arrived.wait_on(cs, op);
    const RelayPartition& home = acc[E_p > 1 ? E_p % 2 : 0];
    add_inplace_or_out(dW13, dW13, home.W13, w13_elems(), cs);
    add_inplace_or_out(dW2, dW2, home.W2, w2_elems(), cs);
    fp32_accumulator_finish(dx, dx_acc, NH, cs);
    if (E_p > 1) stream_after(cs, xs, op);
    for (RelayPartition* p : {&slot[0], &slot[1], &acc[0], &acc[1]}) free_partition(*p);
  }

  // ---- token mode: experts stay, blocks of tokens travel

  // A block as it is read (the rank's own inputs, or a slot that received them): x [n,H], topk_idx
  // [n,k], topk_w [n,k], and in backward dout [n,H].
  struct Block {
    const floatX* x = nullptr;
    const int* idx = nullptr;
    const float* w = nullptr;
    const floatX* dout = nullptr;
  };
  struct BlockSlot {  // room for the largest block (CommStaging)
    floatX* x = nullptr;
    int* idx = nullptr;
    float* w = nullptr;
    floatX* dout = nullptr;
    Block view() const { return Block{x, idx, w, dout}; }
  };
  BlockSlot alloc_block(long long n, bool with_dout) const {
    BlockSlot b;
    b.x = alloc_rows<floatX>((size_t)n * H, Mem::CommStaging, "relay_moe.block_x");
    b.idx = alloc_rows<int>((size_t)n * k, Mem::CommStaging, "relay_moe.block_idx");
    b.w = alloc_rows<float>((size_t)n * k, Mem::CommStaging, "relay_moe.block_w");
    if (with_dout) b.dout = alloc_rows<floatX>((size_t)n * H, Mem::CommStaging, "relay_moe.block_dout");
    return b;
  }
  static void free_block(BlockSlot& b) {
    for (void* p : {(void*)b.x, (void*)b.idx, (void*)b.w, (void*)b.dout}) pool().free(p);
    b = BlockSlot();
  }
  // Block `send` (n_send tokens) to the right neighbour, the left neighbour's (n_recv tokens) into
  // `recv`, on xs; a size of 0 moves nothing on that side.
  void pass_block(const Block& send, long long n_send, const BlockSlot& recv, long long n_recv, bool with_dout,
                  cudaStream_t xs) const {
    ring_send_recv(group, send.x, (size_t)n_send * H, recv.x, (size_t)n_recv * H, xs);
    ring_send_recv(group, send.idx, (size_t)n_send * k, recv.idx, (size_t)n_recv * k, xs);
    ring_send_recv(group, send.w, (size_t)n_send * k, recv.w, (size_t)n_recv * k, xs);
    if (with_dout) ring_send_recv(group, send.dout, (size_t)n_send * H, recv.dout, (size_t)n_recv * H, xs);
  }
  // Every rank's N, the sizes of the blocks (one exchange of host integers; synchronises cs).
  std::vector<long long> exchange_block_tokens(int N, cudaStream_t cs) const {
    if (group.size == 1) return {(long long)N};
    return all_to_all_host(group, std::vector<long long>(group.size, N), 1, cs);
  }
  // The source of the block this rank holds at hop h (h = E_p: its own, home again).
  int block_at(int hop) const { return ((group.rank - hop) % group.size + group.size) % group.size; }

  // The visiting block's routes to this rank's experts: its route maps (Dispatch, freed by the
  // caller) and the slice of partition `group.rank` (synchronises cs: the counts size the GEMMs).
  RelayHopSlice block_routes(int** route_of_slot, int** slot_of_route, const Block& b, long long n, cudaStream_t cs) const {
    const int routes = (int)(n * k);
    *route_of_slot = alloc_rows<int>(routes, Mem::Dispatch, "relay_moe.block_route_of_slot");
    *slot_of_route = alloc_rows<int>(routes, Mem::Dispatch, "relay_moe.block_slot_of_route");
    return relay_hop_slice(moe_route_plan(*route_of_slot, *slot_of_route, b.idx, routes, E, cs), group.rank, E_l());
  }

  // Token mode forward: the block of source (r − h) mod E_p visits at hop h with its routing; its routes
  // to this rank's experts add w·y into its fp32 output accumulator, which travels one hop behind the
  // block's rows and comes home after the last hop.
  std::unique_ptr<DispatchSaved> token_forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                               const floatX* W13, const floatX* W2, int N, cudaStream_t cs) {
    const char* op = "relay_moe_forward";
    auto saved_ptr = std::make_unique<Saved>();
    RelaySaved& saved = saved_ptr->relay;
    saved.N = N;
    saved.block_tokens = exchange_block_tokens(N, cs);
    saved.planned = true;
    if (out == nullptr) return saved_ptr;
    const int E_p = group.size;
    const long long N_max = *std::max_element(saved.block_tokens.begin(), saved.block_tokens.end());
    auto tokens_at = [&](int hop) { return saved.block_tokens[block_at(hop)]; };
    BlockSlot slot[2];
    if (E_p > 1) slot[0] = alloc_block(N_max, false);
    if (E_p > 2) slot[1] = alloc_block(N_max, false);
    float* acc[2] = {alloc_rows<float>((size_t)N_max * H, Mem::CommStaging, "relay_moe.out_acc"),
                     E_p > 1 ? alloc_rows<float>((size_t)N_max * H, Mem::CommStaging, "relay_moe.out_acc") : nullptr};
    zero(acc[0], (size_t)N * H * sizeof(float), cs);  // the own block's accumulator: nothing yet
    const RelayPartition own{const_cast<floatX*>(W13), const_cast<floatX*>(W2)};
    const cudaStream_t xs = group.stream;
    StreamPoint computed, arrived, acc_arrived;
    if (E_p > 1) stream_after(xs, cs, op);
    Block cur{x, topk_idx, topk_w, nullptr};
    for (int h = 0; h < E_p; h++) {
      const long long n = tokens_at(h);
      if (h + 1 < E_p) {  // the next block arrives while this hop computes
        if (h > 0) computed.wait_on(xs, op);
        pass_block(cur, n, slot[h % 2], tokens_at(h + 1), false, xs);
        arrived.record(xs, op);
      }
      int *route_of_slot, *slot_of_route;
      const RelayHopSlice slice = block_routes(&route_of_slot, &slot_of_route, cur, n, cs);
      floatX *xp = nullptr, *h13 = nullptr, *y = nullptr;
      if (slice.count > 0) {
        hop_forward(&xp, &h13, &y, false, route_of_slot, slice, cur.x, own, cs);
        pool().free(h13);
      }
      if (h > 0) acc_arrived.wait_on(cs, op);  // the block's accumulator, one hop behind its rows
      if (slice.count > 0) {
        moe_combine_window_add(acc[h % 2], y, slot_of_route, cur.w, slice.first, slice.count, (int)n, H, k, cs);
        pool().free(y);
      }
      pool().free(route_of_slot);
      pool().free(slot_of_route);
      computed.record(cs, op);
      if (E_p > 1) {  // the accumulator on with its block (after the last hop: home)
        computed.wait_on(xs, op);
        ring_send_recv(group, (const float*)acc[h % 2], (size_t)n * H, acc[(h + 1) % 2], (size_t)tokens_at(h + 1) * H, xs);
        acc_arrived.record(xs, op);
      }
      if (h + 1 < E_p) {
        arrived.wait_on(cs, op);
        cur = slot[h % 2].view();
      }
    }
    if (E_p > 1) acc_arrived.wait_on(cs, op);
    convert(out, acc[E_p > 1 ? E_p % 2 : 0], (size_t)N * H, cs);  // rounded to floatX once
    if (E_p > 1) stream_after(cs, xs, op);
    for (BlockSlot& b : slot) free_block(b);
    for (float* a : acc) pool().free(a);
    return saved_ptr;
  }

  // Token mode backward: blocks travel with x, dout and their routing; each hop recomputes the block's
  // routes to this rank's experts, adds their weight gradients here (dW13, dW2 +=), and writes their
  // dtopk_w and adds their dx into the block's accumulator [dx rows n·H | dtopk_w n·k] (fp32), which
  // travels one hop behind and comes home after the last hop.
  void token_backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const RelaySaved& saved,
                      const floatX* x, const int* topk_idx, const float* topk_w, const floatX* W13, const floatX* W2,
                      cudaStream_t cs) {
    const char* op = "relay_moe_backward";
    const int E_p = group.size, N = saved.N;
    if ((int)saved.block_tokens.size() != E_p)
      fm_fail(op, "the saved state holds no block sizes of this group: run the forward on this group first",
              "saved=%zu group=%s size=%d", saved.block_tokens.size(), group.name.c_str(), E_p);
    const long long N_max = *std::max_element(saved.block_tokens.begin(), saved.block_tokens.end());
    auto tokens_at = [&](int hop) { return saved.block_tokens[block_at(hop)]; };
    BlockSlot slot[2];
    if (E_p > 1) slot[0] = alloc_block(N_max, true);
    if (E_p > 2) slot[1] = alloc_block(N_max, true);
    const size_t acc_elems = (size_t)N_max * (H + k);
    float* acc[2] = {alloc_rows<float>(acc_elems, Mem::CommStaging, "relay_moe.dx_acc"),
                     E_p > 1 ? alloc_rows<float>(acc_elems, Mem::CommStaging, "relay_moe.dx_acc") : nullptr};
    zero(acc[0], (size_t)N * (H + k) * sizeof(float), cs);
    const RelayPartition own{const_cast<floatX*>(W13), const_cast<floatX*>(W2)};
    const std::vector<floatX*> dW2_own = expert_slices<floatX>(dW2, E_l(), (size_t)H * I);
    const cudaStream_t xs = group.stream;
    StreamPoint computed, arrived, acc_arrived;
    if (E_p > 1) stream_after(xs, cs, op);
    Block cur{x, topk_idx, topk_w, dout};
    for (int h = 0; h < E_p; h++) {
      const long long n = tokens_at(h);
      if (h + 1 < E_p) {
        if (h > 0) computed.wait_on(xs, op);
        pass_block(cur, n, slot[h % 2], tokens_at(h + 1), true, xs);
        arrived.record(xs, op);
      }
      int *route_of_slot, *slot_of_route;
      const RelayHopSlice slice = block_routes(&route_of_slot, &slot_of_route, cur, n, cs);
      floatX *xp = nullptr, *h13 = nullptr, *y = nullptr;
      if (slice.count > 0) hop_forward(&xp, &h13, &y, true, route_of_slot, slice, cur.x, own, cs);  // recomputed
      if (h > 0) acc_arrived.wait_on(cs, op);  // the block's dx and dtopk_w accumulator
      float* acc_dx = acc[h % 2];
      float* acc_dtopk_w = acc[h % 2] + (size_t)n * H;
      if (slice.count > 0) {
        const int R_h = slice.count;
        moe_combine_backward_window(y, acc_dtopk_w, cur.dout, y, slot_of_route, cur.w, slice.first, R_h, (int)n, H, k, cs);
        floatX* dh13 = experts_backward_to_h13(y, dW2_own, h13, slices2(own), slice.rows(), H, I,
                                               "relay_moe_backward", cs);
        grouped_gemm("relay_moe_backward.dW13", expert_problems(slice.rows(), [&](int l, size_t first, int rows) {
                       return GroupedGemmProblem{dh13 + first * 2 * I, xp + first * H, dW13 + l * (size_t)2 * I * H, 2 * I,
                                                 H, rows};
                     }),
                     true, false, 2 * I, H, H, 1.f, cs);
        pool().free(xp);
        floatX* dxp = alloc_rows<floatX>((size_t)R_h * H, Mem::Dispatch, "relay_moe.dxp");
        const std::vector<const floatX*> W13_own = slices13(own);
        grouped_gemm("relay_moe_backward.dxp", expert_problems(slice.rows(), [&](int l, size_t first, int rows) {
                       return GroupedGemmProblem{dh13 + first * 2 * I, W13_own[l], dxp + first * H, rows, H, 2 * I};
                     }),
                     false, false, 2 * I, H, H, 0.f, cs);
        pool().free(dh13);
        pool().free(h13);
        moe_combine_window_add(acc_dx, dxp, slot_of_route, nullptr, slice.first, R_h, (int)n, H, k, cs);
        pool().free(dxp);
      }
      pool().free(route_of_slot);
      pool().free(slot_of_route);
      computed.record(cs, op);
      if (E_p > 1) {
        computed.wait_on(xs, op);
        ring_send_recv(group, (const float*)acc[h % 2], (size_t)n * (H + k), acc[(h + 1) % 2],
                       (size_t)tokens_at(h + 1) * (H + k), xs);
        acc_arrived.record(xs, op);
      }
      if (h + 1 < E_p) {
        arrived.wait_on(cs, op);
        cur = slot[h % 2].view();
      }
    }
    if (E_p > 1) acc_arrived.wait_on(cs, op);
    const float* home = acc[E_p > 1 ? E_p % 2 : 0];
    convert(dx, home, (size_t)N * H, cs);
    if (N > 0)
      cudaCheck(cudaMemcpyAsync(dtopk_w, home + (size_t)N * H, (size_t)N * k * sizeof(float), cudaMemcpyDeviceToDevice, cs),
                op, "dtopk_w N=%d k=%d", N, k);
    if (E_p > 1) stream_after(cs, xs, op);
    for (BlockSlot& b : slot) free_block(b);
    for (float* a : acc) pool().free(a);
  }

  static void zero(void* p, size_t bytes, cudaStream_t cs) {
    if (bytes > 0) cudaCheck(cudaMemsetAsync(p, 0, bytes, cs), "relay_moe", "memset bytes=%zu", bytes);
  }
  // A zeroed fp32 accumulator of `count` elements for `out`: out itself in the FP32 build, a pool
  // buffer (CommStaging) in the BF16 build, so that the hops add up in fp32 and out is rounded once.
  static float* fp32_accumulator(floatX* out, size_t count, const char* tag, cudaStream_t cs) {
    float* acc = std::is_same<floatX, float>::value ? reinterpret_cast<float*>(out)
                                                     : alloc_rows<float>(count, Mem::CommStaging, tag);
    zero(acc, count * sizeof(float), cs);
    return acc;
  }
  static void fp32_accumulator_finish(floatX* out, float* acc, size_t count, cudaStream_t cs) {
    if ((void*)acc == (void*)out) return;
    convert(out, acc, count, cs);
    pool().free(acc);
  }
};
