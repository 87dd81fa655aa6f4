// pipelined_llep.cuh — PipelinedLLEP (notes/design.md §6.3; "Flattening Every Memory Peak in Long-Context
// Mixture-of-Experts Training", §3.1, appendix B.1, Eq. 1): LLEP's routes (ops/llep.cuh) delivered in K chunks of
// strided token positions, each source emitting at most k·c_eff routes per chunk, so that no rank receives more than
// E_p·k·c_eff routes in one chunk, whatever the router does. Twin of ref/pipelined_llep.hpp (the chunking),
// ref/llep.hpp (each chunk's plan) and ref/moe.hpp (the math). Its own operator and dispatcher (--moe pllep), separate
// from LLEP's file: what it adds is the chunking, the receiver bound and the pipeline; each chunk is planned by
// llep_plan, unchanged.
//
// What it computes: exactly what llep.cuh and ep_moe.cuh compute (the same routes, the same expert
// choices); chunking changes only when a route travels, never where it goes within its chunk's plan.
//
// Chunking (host side, below). Rank r holds N_r tokens (N_r may be 0); token budget c; ceiling K_max.
//   K      = min(K_max, max_r ⌈N_r / c⌉), at least 1. The N_r are all-gathered first, so every rank
//            runs the same K rounds of collectives, also through chunks that are empty on it.
//   chunk  i of rank r = its token positions {i, i+K, i+2K, …} ∩ [0, N_r): ⌈(N_r − i)/K⌉ tokens for
//            i < N_r, none otherwise. Strided, not contiguous: LLEP places a route by its position in
//            its expert's route list, so a chunk of consecutive tokens would carry an expert's
//            relocated tail to one helper; strides spread every chunk over the helpers (paper §3.1).
//            Membership depends on N_r and K only: a recomputation cuts the same chunks.
//   c_eff  = ⌈max_r N_r / K⌉: no rank has more tokens in one chunk (c_eff ≤ c unless K_max binds).
//   plans  chunk i's LLEP plan (llep_plan) from chunk i's counts: each source's routes of its chunk-i
//            tokens per expert, k per token (dropless top-k; pllep_plan refuses anything else).
// Receiver bound (paper Eq. 1): a chunk holds at most k·c_eff routes of each source, so a rank receives
// at most E_p·k·c_eff routes in one chunk (pllep_receive_bound), whatever the router does. LLEP's
// balancing inside the chunk tightens it to cap_i + min_rows − 1 ≤ ⌈α·k·c_eff⌉ + min_rows − 1
// (llep_receive_bound of the chunk's plan, cap_i = ⌈α·T_i/E_p⌉ with T_i ≤ E_p·k·c_eff).
// Schedule. cs = the caller's (compute) stream, xs = the EP communicator's own stream (runtime/comm.cuh);
// exchanges run on xs, kernels and GEMMs on cs, ordered by events (StreamPoint), never by the host.
//   plans     (pllep_make_plans) the N_r all-gathered → the chunking → this rank's routes counted per
//             (chunk, expert) in one kernel → one all-gather of all K·E counts → every chunk's LLEP
//             plan (llep_plan, unchanged) before any chunk moves. Three host synchronisations per
//             layer, whatever K; the plans are kept (host) for backward.
//   loans     every chunk plan's helper pieces name an (expert, helper) pair; their union is lent
//             once per pass, home → helper, before the first chunk's rows (xs), and in backward the
//             borrowed experts' gradients accumulate over all chunks and go home once, after the
//             last chunk's GEMMs. (Lent per chunk, the same expert would cross K times.)
//   forward   per chunk: pack (gather its tokens' rows and routing, sort its routes, put them in
//             its plan's send order, pack x's rows) → dispatch (rows, xs) → experts
//             (grouped GEMMs, cs) → return (xs) → combine into out's chunk rows (cs). The host issues
//             pack/dispatch of chunk i+1 before chunk i's experts, and chunk i−1's combine after
//             them: chunk i's GEMMs run while chunk i+1's rows and chunk i−1's outputs travel.
//             Nothing stays on the device for backward: the layer's inputs (x, topk_idx, topk_w)
//             are the routing that backward replays. With out = nullptr (a layer's recomputation,
//             model.cuh) the forward only plans.
//   backward  per chunk: the forward recomputed from the kept plans (pack, dispatch, experts with
//             h13 kept, return: no counts exchanged again) → dy = w·dout and dtopk_w at the source →
//             dy out → backward GEMMs, weight gradients += (own experts in place, borrowed ones
//             into the layer's zeroed borrowed gradients) → dx back → dx's chunk rows; after the
//             last chunk the borrowed gradients go home and the home adds them. Issued so that
//             chunk i's backward GEMMs run while chunk i+1's recomputed outputs come back and chunk
//             i+2's rows go out, and chunk i+1's recomputed GEMMs while chunk i's dy travels.
// Live set (the pool's categories; b = bytes per floatX). Chunk i (n_i tokens, R_d(i) routes computed)
// holds at most what one LLEP pass holds at its R's (ops/ep_moe.cuh's closed forms with R = k·n_i) plus
// its gathered rows and routing: D_i = ep_moe_dispatch_peak_bytes(k·n_i, R_d(i), H, b) + 3·n_i·H·b +
// 12·n_i·k. In flight at once: 3 consecutive chunks, in forward (i−1 returning, i computing, i+1
// dispatched) and in backward (i−1's dx returning or i+2 dispatched, i, i+1), so
//   Dispatch             ≤ max over 3 consecutive chunks of Σ D_i                (pllep_dispatch_bound)
//   ExpertIntermediates  ≤ I·b·max_i max(5·R_d(i) + 2·R_d(i+1), 2·R_d(i) + 3·R_d(i+1))
//                          (chunk i's backward with chunk i+1's recomputed h13, or chunk i+1's
//                          recomputation with chunk i's h13; forward: 3·R_d(i)·I·b, one chunk)
//                                                                               (pllep_intermediates_bound)
// with R_d(i) ≤ the receiver bound above. Both depend on the budget c, never on the router, nor on N
// until K_max binds: K grows with N and every chunk stays under Eq. 1. The paper keeps every chunk's checkpoint to backward
// (Θ(K) chunks live); here backward recomputes, so a few chunks are all that is ever live. The price:
// each chunk's forward exchanges and expert GEMMs run twice — which a layer under --recompute pays
// anyway: its recomputation calls this forward with out = nullptr, which only plans.
// Beside, for the pass: the layer's borrowed weights B·3·H·I·b (Weights) and in backward their
// gradients B·3·H·I·b plus the returned ones L·3·H·I·b (Grads), B and L the experts this rank
// borrows and lends over all chunks (B ≤ E − E_l: never its own). Workspace: the K plans' send
// orders and block tables (4·(R + 2·Σ_i G_i·E_p) B, uploaded once per pass) and the K·E counts.
// Layout of this file: the host-side plan first (pure C++, no CUDA call: the plan tests run it for up
// to 64 ranks without a GPU), then the kernels and launchers.
#pragma once
#include <algorithm>
#include <vector>
#include "llep.cuh"

// ---------------------------------------------------------------------------------------------
// Host-side plan (pure C++: no CUDA call)

static const int PLLEP_TOKEN_BUDGET = 4096;  // c where --token_budget is not given (0)

struct PLLEPChunking {
  int chunks = 0;                    // K
  int c_eff = 0;                     // ⌈max_r N_r / K⌉
  std::vector<int> tokens_per_rank;  // [E_p] N_r
};

// tokens_per_rank [E_p] (the all-gather of every rank's N), token budget c ≥ 1, ceiling K_max ≥ 1.
inline PLLEPChunking pllep_chunking(const std::vector<int>& tokens_per_rank, int token_budget, int max_chunks) {
  const char* op = "pllep_chunking";
  if (tokens_per_rank.empty() || token_budget < 1 || max_chunks < 1)
    fm_fail(op, "need at least one rank, a token budget >= 1 and a chunk ceiling >= 1", "ranks=%zu c=%d K_max=%d",
            tokens_per_rank.size(), token_budget, max_chunks);
  int max_tokens = 0;
  for (size_t r = 0; r < tokens_per_rank.size(); r++) {
    if (tokens_per_rank[r] < 0) fm_fail(op, "negative token count", "rank=%zu N=%d", r, tokens_per_rank[r]);
    max_tokens = std::max(max_tokens, tokens_per_rank[r]);
  }
  PLLEPChunking chunking;
  const long long wanted = ((long long)max_tokens + token_budget - 1) / token_budget;
  chunking.chunks = (int)std::max(1LL, std::min((long long)max_chunks, wanted));
  chunking.c_eff = (int)(((long long)max_tokens + chunking.chunks - 1) / chunking.chunks);
  chunking.tokens_per_rank = tokens_per_rank;
  return chunking;
}

// Tokens of a rank with N tokens in chunk `chunk` of `chunks`: |{chunk, chunk + K, …} ∩ [0, N)|.
__host__ __device__ inline int pllep_chunk_tokens(int N, int chunks, int chunk) {
  return chunk < N ? (int)(((long long)N - chunk + chunks - 1) / chunks) : 0;
}

// Token position of member `member` (0, 1, …) of chunk `chunk`.
__host__ __device__ inline int pllep_chunk_token(int chunk, int member, int chunks) { return chunk + member * chunks; }

// Paper Eq. 1: the most routes any rank receives in one chunk, E_p·k·c_eff.
inline long long pllep_receive_bound(const PLLEPChunking& chunking, int k) {
  return (long long)chunking.tokens_per_rank.size() * k * chunking.c_eff;
}

// One LLEP plan per chunk. chunk_counts [K][E_p·E]: chunk i's counts as llep_plan takes them (source
// s's routes of its chunk-i tokens per global expert). Refuses a chunk count other than K and a source
// whose chunk-i routes are not k per chunk-i token: the receiver bound rests on that count.
inline std::vector<LLEPPlan> pllep_plan(const PLLEPChunking& chunking, const std::vector<std::vector<long long>>& chunk_counts,
                                        int k, double alpha, long long min_rows) {
  const char* op = "pllep_plan";
  const int ranks = (int)chunking.tokens_per_rank.size(), K = chunking.chunks;
  if (k < 1 || (int)chunk_counts.size() != K)
    fm_fail(op, "need k >= 1 and one count vector per chunk", "k=%d chunks=%d count_vectors=%zu", k, K, chunk_counts.size());
  std::vector<LLEPPlan> plans;
  for (int i = 0; i < K; i++) {
    const std::vector<long long>& counts = chunk_counts[i];
    if (counts.size() % ranks != 0)
      fm_fail(op, "chunk counts are not ranks x E", "chunk=%d ranks=%d counts=%zu", i, ranks, counts.size());
    const size_t E = counts.size() / ranks;
    for (int s = 0; s < ranks; s++) {
      long long routes = 0;
      for (size_t e = 0; e < E; e++) routes += counts[s * E + e];
      const long long expected = (long long)k * pllep_chunk_tokens(chunking.tokens_per_rank[s], K, i);
      if (routes != expected)
        fm_fail(op, "a source's chunk routes are not k per chunk token", "chunk=%d source=%d N=%d K=%d k=%d routes=%lld expected=%lld",
                i, s, chunking.tokens_per_rank[s], K, k, routes, expected);
    }
    plans.push_back(llep_plan(counts, ranks, alpha, min_rows));
  }
  return plans;
}

// Closed-form bounds of what one pllep_forward + pllep_backward adds to the pool's Dispatch and
// ExpertIntermediates bytes (see the header), from each chunk's tokens n_i and routes computed R_d(i).
inline size_t pllep_dispatch_bound(const std::vector<int>& chunk_tokens, const std::vector<long long>& chunk_received,
                                   int H, int k, size_t b) {
  const size_t K = chunk_tokens.size();
  std::vector<size_t> per_chunk(K);
  for (size_t i = 0; i < K; i++) {
    const long long n = chunk_tokens[i];
    per_chunk[i] = ep_moe_dispatch_peak_bytes(n * k, chunk_received[i], H, b) + 3 * (size_t)n * H * b + 12 * (size_t)n * k;
  }
  size_t bound = 0;
  for (size_t i = 0; i < K; i++) {
    size_t window = 0;
    for (size_t j = i; j < std::min(K, i + 3); j++) window += per_chunk[j];
    bound = std::max(bound, window);
  }
  return bound;
}
inline size_t pllep_intermediates_bound(const std::vector<long long>& chunk_received, int I, size_t b) {
  long long most = 0;
  for (size_t i = 0; i < chunk_received.size(); i++) {
    const long long here = chunk_received[i], next = i + 1 < chunk_received.size() ? chunk_received[i + 1] : 0;
    most = std::max({most, 5 * here + 2 * next, 2 * here + 3 * next});
  }
  return (size_t)most * I * b;
}

// ---------------------------------------------------------------------------------------------
// Kernels

// chunk_counts [K·E + 1] (+=, zeroed by the caller): entry i·E + e counts this rank's routes of its
// chunk-i tokens to expert e (route r = n·k + j belongs to token n, in chunk n mod K); the last entry
// counts expert indices outside [0,E). One thread per route; integer atomics (the counts are exact).
static __global__ void pllep_chunk_counts_kernel(int* chunk_counts, const int* topk_idx, int R, int k, int K, int E) {
  int r = blockIdx.x * blockDim.x + threadIdx.x;
  if (r >= R) return;
  const int e = topk_idx[r], chunk = (r / k) % K;
  atomicAdd(e >= 0 && e < E ? &chunk_counts[chunk * E + e] : &chunk_counts[K * E], 1);
}

// chunk [n, cols] (=): row m = src row (i + m·K), the chunk's m-th token. One thread per element.
template <typename T>
static __global__ void pllep_gather_kernel(T* chunk, const T* src, int n, int cols, int K, int i) {
  size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= (size_t)n * cols) return;
  const size_t m = e / cols, c = e % cols;
  chunk[e] = src[((size_t)i + m * K) * cols + c];
}

// dst row (i + m·K) (=) = chunk row m. One thread per element.
template <typename T>
static __global__ void pllep_scatter_kernel(T* dst, const T* chunk, int n, int cols, int K, int i) {
  size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (e >= (size_t)n * cols) return;
  const size_t m = e / cols, c = e % cols;
  dst[((size_t)i + m * K) * cols + c] = chunk[e];
}

// ---------------------------------------------------------------------------------------------
// Launchers

// Chunk i's rows of a [N, cols] tensor, gathered into a new pool buffer [n_i, cols] (nullptr when
// the chunk is empty on this rank), or scattered back.
template <typename T>
T* pllep_gather(const T* src, int n, int cols, int K, int i, Mem cat, const char* tag, cudaStream_t stream) {
  T* chunk = alloc_rows<T>((size_t)n * cols, cat, tag);
  if (chunk == nullptr) return nullptr;
  pllep_gather_kernel<<<ceil_div((size_t)n * cols, 256), 256, 0, stream>>>(chunk, src, n, cols, K, i);
  launchCheck("pllep_gather", "%s n=%d cols=%d K=%d chunk=%d", tag, n, cols, K, i);
  return chunk;
}
template <typename T>
void pllep_scatter(T* dst, const T* chunk, int n, int cols, int K, int i, cudaStream_t stream) {
  if ((size_t)n * cols == 0) return;
  pllep_scatter_kernel<<<ceil_div((size_t)n * cols, 256), 256, 0, stream>>>(dst, chunk, n, cols, K, i);
  launchCheck("pllep_scatter", "n=%d cols=%d K=%d chunk=%d", n, cols, K, i);
}

// What the forward leaves for backward: the chunking and every chunk's plan (host only; nothing on
// the device — the layer's inputs x, topk_idx, topk_w are the routing that backward replays).
struct PLLEPSaved {
  int N = 0;
  PLLEPChunking chunking;
  std::vector<LLEPPlan> plans;            // [K] each chunk's plan of the group
  std::vector<LLEPRankPlan> mine;         // [K] this rank's share of each
  std::vector<int> tables;                // each chunk's send order [R_i] and block tables, for one upload per pass
  std::vector<size_t> send_order_at;      // [K] offset of chunk i's send order in `tables`
  std::vector<size_t> blocks_at;          // [K] offset of chunk i's block tables
  std::vector<long long> chunk_received;  // [K] routes this rank computes in each chunk (R_d of its plan)
  // The experts lent for the whole layer, once: every chunk plan's helper pieces, one transfer per
  // (expert, helper), by expert then helper. This rank's share: what it borrows (the chunks' groups
  // index these, LLEPRankPlan::group_borrowed) and what it lends.
  std::vector<LLEPTransfer> borrowed, lent;
};

// The plans of every chunk, before any chunk moves: the N_r all-gathered (all_to_all_host) → the
// chunking → this rank's routes counted per (chunk, expert) in one kernel and one copy (expert indices
// outside [0,E) refused) → one all-gather of the K·E counts → pllep_plan and llep_rank_plan per
// chunk. Synchronises `stream` three times (the N_r, the counts' copy, their exchange).
inline void pllep_make_plans(PLLEPSaved& saved, const int* topk_idx, int N, int E, int k, int token_budget,
                             int max_chunks, double alpha, long long min_rows, const Comm& ep, cudaStream_t stream) {
  const char* op = "pllep_make_plans";
  if (N < 0 || E < 1 || k < 1 || (long long)N * k > INT_MAX)
    fm_fail(op, "need N >= 0, E, k >= 1 and N·k routes within int indices", "N=%d E=%d k=%d group=%s", N, E, k, ep.name.c_str());
  const std::vector<long long> n_all = all_to_all_host(ep, std::vector<long long>(ep.size, N), 1, stream);
  saved = PLLEPSaved();
  saved.N = N;
  saved.chunking = pllep_chunking(std::vector<int>(n_all.begin(), n_all.end()), token_budget, max_chunks);
  const int K = saved.chunking.chunks, R = N * k, W = ep.size;
  if ((long long)K * E + 1 > INT_MAX) fm_fail(op, "too many (chunk, expert) counts", "K=%d E=%d", K, E);

  std::vector<int> mine_counts((size_t)K * E + 1, 0);
  if (R > 0) {
    int* counts_dev = pool().alloc_t<int>(mine_counts.size(), Mem::Workspace, "pllep.chunk_counts");
    cudaCheck(cudaMemsetAsync(counts_dev, 0, mine_counts.size() * sizeof(int), stream), op, "K=%d E=%d", K, E);
    pllep_chunk_counts_kernel<<<ceil_div(R, 256), 256, 0, stream>>>(counts_dev, topk_idx, R, k, K, E);
    launchCheck("pllep_chunk_counts", "R=%d k=%d K=%d E=%d", R, k, K, E);
    copy_to_host(mine_counts.data(), counts_dev, mine_counts.size() * sizeof(int), stream, op);
    pool().free(counts_dev);
  }
  if (mine_counts.back() != 0)
    fm_fail(op, "expert index outside [0, E) in topk_idx", "R=%d E=%d bad_routes=%d", R, E, mine_counts.back());
  std::vector<long long> mine_to_all;
  for (int d = 0; d < W; d++) mine_to_all.insert(mine_to_all.end(), mine_counts.begin(), mine_counts.end() - 1);
  const std::vector<long long> all = all_to_all_host(ep, mine_to_all, K * E, stream);  // [s][i][e]
  std::vector<std::vector<long long>> chunk_counts(K, std::vector<long long>((size_t)W * E));
  for (int s = 0; s < W; s++)
    for (int i = 0; i < K; i++)
      for (int e = 0; e < E; e++) chunk_counts[i][(size_t)s * E + e] = all[((size_t)s * K + i) * E + e];
  saved.plans = pllep_plan(saved.chunking, chunk_counts, k, alpha, min_rows);
  std::vector<std::pair<int, int>> loans;  // (expert, helper) of every chunk's helper pieces
  for (const LLEPPlan& plan : saved.plans)
    for (const LLEPTransfer& t : plan.transfers) loans.push_back({t.expert, t.helper});
  std::sort(loans.begin(), loans.end());
  loans.erase(std::unique(loans.begin(), loans.end()), loans.end());
  const int E_l = E / W;
  std::vector<int> borrowed_index(E, -1);  // this rank's index of each expert it borrows
  for (const std::pair<int, int>& loan : loans) {
    const LLEPTransfer t{loan.first, loan.first / E_l, loan.second};
    if (t.helper == ep.rank) {
      borrowed_index[t.expert] = (int)saved.borrowed.size();
      saved.borrowed.push_back(t);
    }
    if (t.home == ep.rank) saved.lent.push_back(t);
  }
  for (int i = 0; i < K; i++) {
    saved.mine.push_back(llep_rank_plan(saved.plans[i], chunk_counts[i], ep.rank));
    LLEPRankPlan& m = saved.mine.back();
    for (size_t g = 0; g < m.group_expert.size(); g++)  // the layer's borrowed copies instead of the chunk's
      if (m.group_borrowed[g] >= 0) m.group_borrowed[g] = borrowed_index[m.group_expert[g]];
    m.borrowed.clear();  // lent once for the layer: saved.borrowed, saved.lent
    m.lent.clear();
    saved.chunk_received.push_back(m.ep.received);
    saved.send_order_at.push_back(saved.tables.size());
    saved.tables.insert(saved.tables.end(), m.send_slot_of_row.begin(), m.send_slot_of_row.end());
    saved.blocks_at.push_back(saved.tables.size());
    const std::vector<int> blocks = ep_blocks_table(m.ep);
    saved.tables.insert(saved.tables.end(), blocks.begin(), blocks.end());
  }
}

// One chunk on its way through the pipeline: its LLEP state (ops/llep.cuh) and the rows in flight.
struct PLLEPChunkRun {
  int index = 0;
  float* topk_w = nullptr;      // [n_i, k] gathered (Dispatch), kept to the combine
  LLEPSaved llep;               // route maps, receive map, xe, h13, y, borrowed weights
  EPExchange dispatch, ret;     // rows in flight (ops/ep_moe.cuh)
  StreamPoint dispatched, returned;  // the latest exchange out and back, on the communicator's stream
  ~PLLEPChunkRun() {
    pool().free(topk_w);
    llep_saved_free(llep);
  }
};

// The shapes, weights and streams one pass works with; tables_dev: PLLEPSaved::tables on the device;
// loans: the layer's borrowed weights (its mine.borrowed / lent = PLLEPSaved's); home: their
// gradients (backward).
struct PLLEPPass {
  const PLLEPSaved& saved;
  int H, I, E, k;
  const floatX *W13_local, *W2_local;
  const int* tables_dev;
  const Comm& ep;
  cudaStream_t cs;  // compute: kernels and GEMMs
  cudaStream_t xs;  // exchanges: the communicator's own stream
  LLEPSaved* loans;
  LLEPGradsHome* home;
  int K() const { return saved.chunking.chunks; }
  int E_l() const { return E / ep.size; }
  GroupWeights weights(const PLLEPChunkRun& run) const {
    return llep_group_weights(run.llep.mine, E_l(), H, I, loans->borrowed_W13, loans->borrowed_W2, W13_local, W2_local);
  }
};

// The layer's loans (every chunk's borrowed experts, once), as an LLEPSaved that ops/llep.cuh's
// lending and gradient return act on; lent home → helper on xs (after the work on cs so far).
inline void pllep_lend_layer(LLEPSaved& loans, const PLLEPSaved& saved, int H, int I, int E, const floatX* W13_local,
                             const floatX* W2_local, const Comm& ep, cudaStream_t cs) {
  loans.ep.H = H;
  loans.ep.I = I;
  loans.plan.local_experts = E / ep.size;
  loans.mine.borrowed = saved.borrowed;
  loans.mine.lent = saved.lent;
  llep_alloc_borrowed(loans);
  stream_after(ep.stream, cs, "pllep_lend_layer");
  llep_lend_weights(loans, W13_local, W2_local, ep, ep.stream);
}

// (cs) Chunk i's routing gathered, its routes sorted by expert and put in send order (its plan's,
// from the uploaded tables), x's rows packed for the dispatch; the gathered x and topk_idx freed.
inline std::unique_ptr<PLLEPChunkRun> pllep_chunk_pack(const PLLEPPass& p, int i, const floatX* x, const int* topk_idx,
                                                       const float* topk_w) {
  auto run = std::make_unique<PLLEPChunkRun>();
  const int K = p.K(), n = pllep_chunk_tokens(p.saved.N, K, i), R = n * p.k;
  run->index = i;
  LLEPSaved& ls = run->llep;
  EPSaved& es = ls.ep;
  es.N = n; es.H = p.H; es.I = p.I; es.E = p.E; es.k = p.k;
  ls.plan = p.saved.plans[i];
  ls.mine = p.saved.mine[i];
  es.plan = ls.mine.ep;
  floatX* x_chunk = pllep_gather(x, n, p.H, K, i, Mem::Dispatch, "pllep.x_chunk", p.cs);
  int* idx_chunk = pllep_gather(topk_idx, n, p.k, K, i, Mem::Dispatch, "pllep.topk_idx_chunk", p.cs);
  run->topk_w = pllep_gather(topk_w, n, p.k, K, i, Mem::Dispatch, "pllep.topk_w_chunk", p.cs);
  es.route_of_slot = alloc_rows<int>(R, Mem::Dispatch, "pllep.route_of_slot");
  es.slot_of_route = alloc_rows<int>(R, Mem::Dispatch, "pllep.slot_of_route");
  moe_route_sort(es.route_of_slot, es.slot_of_route, nullptr, idx_chunk, R, p.E, p.cs, nullptr);  // counted and checked in pllep_make_plans
  pool().free(idx_chunk);
  llep_send_order(es, p.tables_dev + p.saved.send_order_at[i], p.cs);
  ep_forward_pack(run->dispatch, es, x_chunk, p.tables_dev + p.saved.blocks_at[i], "pllep", p.cs);
  pool().free(x_chunk);
  return run;
}

// (xs) The chunk's rows out to the ranks that compute its routes (x's in forward, dy's in backward;
// after the layer's lent weights, on the same stream), or back to their sources (the expert outputs,
// dxe); `tag` names the rows that arrive.
inline void pllep_chunk_send_out(const PLLEPPass& p, PLLEPChunkRun& run, const char* tag) {
  const EPPlan& plan = run.llep.ep.plan;
  ep_exchange_rows(run.dispatch, plan.send_rows, plan.recv_rows, p.H, p.ep, tag, p.cs, p.xs);
  run.dispatched.record(p.xs, tag);
}
inline void pllep_chunk_send_back(const PLLEPPass& p, PLLEPChunkRun& run, const char* tag) {
  const EPPlan& plan = run.llep.ep.plan;
  ep_exchange_rows(run.ret, plan.recv_rows, plan.send_rows, p.H, p.ep, tag, p.cs, p.xs);
  run.returned.record(p.xs, tag);
}

// (cs, after the dispatch) The chunk's expert GEMMs; keep_h13 for a backward that follows.
inline void pllep_chunk_experts(const PLLEPPass& p, PLLEPChunkRun& run, bool keep_h13) {
  run.dispatched.wait_on(p.cs, "pllep.experts");
  ep_forward_experts(run.ret, run.dispatch, run.llep.ep, p.weights(run), keep_h13, "pllep", p.cs);
}

// (cs, after the rows came back) The chunk's rows of `rows` (=): out, the weighted combine of the
// expert outputs (forward), or dx, the sum of each token's routes' input gradients (backward); the
// chunk freed.
inline void pllep_chunk_combine(const PLLEPPass& p, std::unique_ptr<PLLEPChunkRun>& run, floatX* rows, bool backward) {
  run->returned.wait_on(p.cs, "pllep.combine");
  const int n = run->llep.ep.N;
  floatX* chunk_rows = alloc_rows<floatX>((size_t)n * p.H, Mem::Dispatch, backward ? "pllep.dx_chunk" : "pllep.out_chunk");
  if (backward) ep_backward_combine(chunk_rows, run->ret, run->llep.ep, p.cs);
  else ep_forward_combine(chunk_rows, run->ret, run->llep.ep, run->topk_w, p.cs);
  pllep_scatter(rows, chunk_rows, n, p.H, p.K(), run->index, p.cs);
  pool().free(chunk_rows);
  run.reset();
}

// (cs, after the recomputation's return) dtopk_w's chunk-i rows (=) = dout·y and dy = w·dout packed
// for the dispatch; y, dout's gathered rows and the chunk's dtopk_w freed.
inline void pllep_chunk_backward_pack(const PLLEPPass& p, PLLEPChunkRun& run, const floatX* dout, float* dtopk_w) {
  run.returned.wait_on(p.cs, "pllep_backward.pack");
  EPSaved& es = run.llep.ep;
  const int n = es.N;
  ep_forward_combine(nullptr, run.ret, es, run.topk_w, p.cs);
  floatX* dout_chunk = pllep_gather(dout, n, p.H, p.K(), run.index, Mem::Dispatch, "pllep.dout_chunk", p.cs);
  float* dtopk_w_chunk = alloc_rows<float>((size_t)n * p.k, Mem::Dispatch, "pllep.dtopk_w_chunk");
  ep_backward_pack(run.dispatch, dtopk_w_chunk, dout_chunk, es, run.topk_w, "pllep_backward", p.cs);
  pllep_scatter(dtopk_w, dtopk_w_chunk, n, p.k, p.K(), run.index, p.cs);
  for (void* q : {(void*)es.y, (void*)dout_chunk, (void*)dtopk_w_chunk}) pool().free(q);
  es.y = nullptr;
}

// (cs, after dy arrived) The chunk's backward GEMMs: its weight gradients (+=) into dW*_local or the
// layer's borrowed experts' gradients; dxe packed for the return.
inline void pllep_chunk_backward_experts(const PLLEPPass& p, PLLEPChunkRun& run, floatX* dW13_local, floatX* dW2_local) {
  run.dispatched.wait_on(p.cs, "pllep_backward.experts");
  const GroupGrads grads = llep_group_grads(run.llep.mine, p.E_l(), p.H, p.I, *p.home, dW13_local, dW2_local);
  EPSaved& es = run.llep.ep;
  ep_backward_experts(run.ret, run.dispatch, grads, es, p.weights(run), "pllep_backward", p.cs);
  pool().free(es.h13);  // the chunk's last use of its recomputed intermediates and received rows
  pool().free(es.xe);
  es.h13 = nullptr;
  es.xe = nullptr;
}

// The saved tables on the device for one pass (Workspace; one copy, synchronises `stream`).
inline int* pllep_upload_tables(const PLLEPSaved& saved, cudaStream_t stream) {
  int* tables_dev = alloc_rows<int>(saved.tables.size(), Mem::Workspace, "pllep.tables");
  copy_to_device(tables_dev, saved.tables.data(), saved.tables.size() * sizeof(int), stream, "pllep_upload_tables");
  return tables_dev;
}

// out [N,H] (=). Collective over `ep`. With out = nullptr only the plans are made (a layer's
// recomputation: backward replays the chunks itself). Synchronises `stream` four times (three in
// pllep_make_plans, the tables' upload); the chunks then run without the host waiting.
// Pipeline (cs = `stream`, xs = ep.stream), in the order the host issues it:
//   pack 0, dispatch 0; for i: [pack i+1, dispatch i+1], experts i, return i, [combine i−1]; combine K−1
// so that while chunk i is in its expert GEMMs, chunk i+1's rows and chunk i−1's outputs are on the
// interconnect. At most three chunks are in flight: i+1 dispatched, i computing, i−1 returned.
inline void pllep_forward(floatX* out, PLLEPSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                          const floatX* W13_local, const floatX* W2_local, int N, int H, int I, int E, int k,
                          int token_budget, int max_chunks, double alpha, long long min_rows, const Comm& ep,
                          cudaStream_t stream) {
  pllep_make_plans(saved, topk_idx, N, E, k, token_budget, max_chunks, alpha, min_rows, ep, stream);
  if (out == nullptr) return;
  int* tables_dev = pllep_upload_tables(saved, stream);
  LLEPSaved loans;
  pllep_lend_layer(loans, saved, H, I, E, W13_local, W2_local, ep, stream);
  const PLLEPPass p{saved, H, I, E, k, W13_local, W2_local, tables_dev, ep, stream, ep.stream, &loans, nullptr};
  const int K = p.K();
  std::vector<std::unique_ptr<PLLEPChunkRun>> runs(K);
  runs[0] = pllep_chunk_pack(p, 0, x, topk_idx, topk_w);
  pllep_chunk_send_out(p, *runs[0], "pllep.x_recv");
  for (int i = 0; i < K; i++) {
    if (i + 1 < K) {
      runs[i + 1] = pllep_chunk_pack(p, i + 1, x, topk_idx, topk_w);
      pllep_chunk_send_out(p, *runs[i + 1], "pllep.x_recv");
    }
    pllep_chunk_experts(p, *runs[i], false);
    pllep_chunk_send_back(p, *runs[i], "pllep.y");
    if (i >= 1) pllep_chunk_combine(p, runs[i - 1], out, false);
  }
  pllep_chunk_combine(p, runs[K - 1], out, false);
  llep_saved_free(loans);  // the lent weights' last users were the experts' GEMMs on `stream`
  pool().free(tables_dev);
}

// dx [N,H] (=), dtopk_w [N,k] (=), dW13_local, dW2_local (+=), chunk by chunk with each chunk's
// forward recomputed from the saved plans (no counts exchanged again). Collective over `ep`.
// Synchronises `stream` once (the tables' upload).
// Pipeline: per chunk i, recomputation (pack, dispatch, experts with h13 kept, return), then backward
// (pack dy = w·dout, dispatch, experts, return dx, combine). The host issues, for each i: backward
// pack i, dispatch dy i; [experts i+1 (recomputed), return i+1]; [combine i−1]; [pack i+2, dispatch
// i+2]; backward experts i, return i — so that chunk i's backward GEMMs run while chunk i+1's outputs
// come back and chunk i+2's rows go out, and chunk i+1's recomputed GEMMs while chunk i's dy and chunk
// i−1's dx travel. Chunk i−1 is combined (and freed) before chunk i+2 is packed: three chunks in
// flight. After the last chunk, the borrowed gradients go home once.
inline void pllep_backward(floatX* dx, float* dtopk_w, floatX* dW13_local, floatX* dW2_local, const floatX* dout,
                           const PLLEPSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                           const floatX* W13_local, const floatX* W2_local, int H, int I, int E, int k, const Comm& ep,
                           cudaStream_t stream) {
  if (saved.chunking.chunks < 1 || (int)saved.plans.size() != saved.chunking.chunks)
    fm_fail("pllep_backward", "no forward to replay: run pllep_forward first", "N=%d", saved.N);
  int* tables_dev = pllep_upload_tables(saved, stream);
  LLEPSaved loans;
  LLEPGradsHome home;
  pllep_lend_layer(loans, saved, H, I, E, W13_local, W2_local, ep, stream);
  llep_zero_borrowed_grads(home, loans, stream);
  const PLLEPPass p{saved, H, I, E, k, W13_local, W2_local, tables_dev, ep, stream, ep.stream, &loans, &home};
  const int K = p.K();
  std::vector<std::unique_ptr<PLLEPChunkRun>> runs(K);
  auto start_chunk = [&](int i) {  // pack and dispatch
    runs[i] = pllep_chunk_pack(p, i, x, topk_idx, topk_w);
    pllep_chunk_send_out(p, *runs[i], "pllep.x_recv");
  };
  auto recompute_chunk = [&](int i) {  // experts with h13 kept, return
    pllep_chunk_experts(p, *runs[i], true);
    pllep_chunk_send_back(p, *runs[i], "pllep.y");
  };
  start_chunk(0);
  recompute_chunk(0);
  if (K > 1) start_chunk(1);
  for (int i = 0; i < K; i++) {
    pllep_chunk_backward_pack(p, *runs[i], dout, dtopk_w);
    pllep_chunk_send_out(p, *runs[i], "pllep_backward.dy_recv");
    if (i + 1 < K) recompute_chunk(i + 1);
    if (i >= 1) pllep_chunk_combine(p, runs[i - 1], dx, true);  // before chunk i+2 takes its memory
    if (i + 2 < K) start_chunk(i + 2);
    pllep_chunk_backward_experts(p, *runs[i], dW13_local, dW2_local);
    pllep_chunk_send_back(p, *runs[i], "pllep_backward.dx_sent");
  }
  StreamPoint gradients_home;  // every chunk's borrowed gradients, home once
  llep_send_gradients_home(home, loans, ep, stream, ep.stream);
  gradients_home.record(ep.stream, "pllep_backward.gradients_home");
  pllep_chunk_combine(p, runs[K - 1], dx, true);
  gradients_home.wait_on(stream, "pllep_backward.gradients_home");
  llep_add_gradients_home(home, loans, dW13_local, dW2_local, stream);
  llep_saved_free(loans);
  pool().free(tables_dev);
}

// --moe pllep: the dispatcher seam (ops/moe.cuh) with the token budget c (--token_budget), the chunk
// ceiling K_max (--kmax) and LLEP's α and smallest helper piece for each chunk's plan.
struct PLLEPDispatcher : MoEDispatcher {
  struct Saved : DispatchSaved {
    PLLEPSaved pllep;
  };
  Comm group;
  int token_budget, max_chunks;
  double alpha;
  long long min_rows;
  PLLEPDispatcher(int H_, int I_, int E_, int k_, const Comm& ep_group, int token_budget_, int max_chunks_, double alpha_,
                  long long min_rows_)
      : MoEDispatcher(H_, I_, E_, k_), group(ep_group), token_budget(token_budget_), max_chunks(max_chunks_),
        alpha(alpha_), min_rows(min_rows_) {}
  std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                         const floatX* W13, const floatX* W2, int N, cudaStream_t stream) override {
    auto saved = std::make_unique<Saved>();
    pllep_forward(out, saved->pllep, x, topk_idx, topk_w, W13, W2, N, H, I, E, k, token_budget, max_chunks, alpha,
                  min_rows, group, stream);
    return saved;
  }
  void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const DispatchSaved& saved,
                const floatX* x, const int* topk_idx, const float* topk_w, const floatX* W13, const floatX* W2,
                cudaStream_t stream) override {
    pllep_backward(dx, dtopk_w, dW13, dW2, dout, static_cast<const Saved&>(saved).pllep, x, topk_idx, topk_w, W13, W2,
                   H, I, E, k, group, stream);
  }
  // Eq. 1's receiver bound in every chunk (pllep_dispatch_bound, pllep_intermediates_bound), the K plans'
  // tables and counts (Workspace), and LLEP's borrowed and lent experts (llep_live_bound); nothing is
  // saved but the borrowed weights.
  DispatchBound live_bound(int N) const override {
    const int E_p = group.size;
    const PLLEPChunking chunking = pllep_chunking(std::vector<int>(E_p, N), token_budget, max_chunks);
    std::vector<int> chunk_tokens(chunking.chunks);
    for (int i = 0; i < chunking.chunks; i++) chunk_tokens[i] = pllep_chunk_tokens(N, chunking.chunks, i);
    const std::vector<long long> received(chunking.chunks, pllep_receive_bound(chunking, k));
    const size_t b = sizeof(floatX), K = chunking.chunks;
    const size_t tables = 4 * ((size_t)N * k + 2 * K * E * E_p) + 4 * K * E * E_p;
    DispatchBound chunks{0, pllep_dispatch_bound(chunk_tokens, received, H, k, b) + pllep_intermediates_bound(received, I, b) +
                                tables + 3 * sizeof(void*) * (size_t)E};
    return llep_live_bound(chunks, H, I, E, E_p, b);
  }
};
