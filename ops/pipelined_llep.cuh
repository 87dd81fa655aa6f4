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
// Schedule (built so far: the chunks run one after another on the caller's stream; the pipeline that
// overlaps chunk i+1's dispatch and chunk i−1's combine with chunk i's expert GEMMs is the next step):
//   forward   the N_r all-gathered (all_to_all_host) → the chunking → for each chunk i: its tokens'
//             rows x_i [n_i,H], topk_idx_i, topk_w_i gathered → llep_forward on them (its own count
//             exchange and plan, ops/llep.cuh) → out_i scattered to out → everything of chunk i freed.
//             Nothing stays on the device for backward: the layer's inputs (x, topk_idx, topk_w) are
//             the routing that backward replays.
//   backward  for each chunk i: gather again → llep_forward without the combine (the recomputation:
//             the same counts, hence the same plan and exchanges) → llep_backward with dout_i → dx_i,
//             dtopk_w_i scattered; the weight gradients accumulate (+=) chunk after chunk.
// Live set: one chunk at a time, in forward and in backward — its dispatch rows and expert
// intermediates (ops/ep_moe.cuh's closed forms with R = k·n_i and the chunk's R_d ≤ the receiver
// bound) and its gathered rows (x_i and out_i, or x_i, dout_i and dx_i: ≤ 3·c_eff·H·b, Dispatch).
// The paper keeps every chunk's checkpoint to backward; here backward recomputes the chunk, so the
// expert intermediates of one chunk are all that is ever live. The price: each chunk's exchanges and
// expert GEMMs of the forward run twice.
// Layout of this file: the host-side plan first (pure C++, no CUDA call: the plan tests run it for up
// to 64 ranks without a GPU), then the kernels and launchers.
#pragma once
#include <algorithm>
#include <vector>
#include "llep.cuh"

// ---------------------------------------------------------------------------------------------
// Host-side plan (pure C++: no CUDA call)

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

// ---------------------------------------------------------------------------------------------
// Kernels

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

// The layer's settings and what its forward leaves for backward (host only).
struct PLLEPSaved {
  int N = 0;
  PLLEPChunking chunking;
  std::vector<long long> chunk_received;  // [K] routes this rank computed in each chunk of the forward
};

// The chunk's token rows and routing, gathered (Dispatch; topk_idx_i and topk_w_i are [n_i·k]).
struct PLLEPChunk {
  int n = 0;
  floatX* x = nullptr;
  int* topk_idx = nullptr;
  float* topk_w = nullptr;
  PLLEPChunk(const floatX* x_all, const int* idx_all, const float* w_all, int N, int H, int k, int K, int i,
             cudaStream_t stream)
      : n(pllep_chunk_tokens(N, K, i)) {
    x = pllep_gather(x_all, n, H, K, i, Mem::Dispatch, "pllep.x_chunk", stream);
    topk_idx = pllep_gather(idx_all, n, k, K, i, Mem::Dispatch, "pllep.topk_idx_chunk", stream);
    topk_w = pllep_gather(w_all, n, k, K, i, Mem::Dispatch, "pllep.topk_w_chunk", stream);
  }
  ~PLLEPChunk() {
    pool().free(topk_w);
    pool().free(topk_idx);
    pool().free(x);
  }
};

// out [N,H] (=). Collective over `ep`. Synchronises `stream` 1 + 2K times (the token counts, then
// each chunk's route counts and count exchange).
inline void pllep_forward(floatX* out, PLLEPSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                          const floatX* W13_local, const floatX* W2_local, int N, int H, int I, int E, int k,
                          int token_budget, int max_chunks, double alpha, long long min_rows, const Comm& ep,
                          cudaStream_t stream) {
  if (N < 0) fm_fail("pllep_forward", "need N >= 0", "N=%d group=%s", N, ep.name.c_str());
  const std::vector<long long> n_all = all_to_all_host(ep, std::vector<long long>(ep.size, N), 1, stream);
  saved.N = N;
  saved.chunking = pllep_chunking(std::vector<int>(n_all.begin(), n_all.end()), token_budget, max_chunks);
  saved.chunk_received.clear();
  const int K = saved.chunking.chunks;
  for (int i = 0; i < K; i++) {
    PLLEPChunk chunk(x, topk_idx, topk_w, N, H, k, K, i, stream);
    floatX* out_chunk = alloc_rows<floatX>((size_t)chunk.n * H, Mem::Dispatch, "pllep.out_chunk");
    LLEPSaved ls;
    llep_forward(out_chunk, ls, chunk.x, chunk.topk_idx, chunk.topk_w, W13_local, W2_local, chunk.n, H, I, E, k, alpha,
                 min_rows, ep, stream);
    saved.chunk_received.push_back(ls.ep.plan.received);
    llep_saved_free(ls);
    pllep_scatter(out, out_chunk, chunk.n, H, K, i, stream);
    pool().free(out_chunk);
  }
}

// dx [N,H] (=), dtopk_w [N,k] (=), dW13_local, dW2_local (+=), chunk by chunk with each chunk's
// forward recomputed. Collective over `ep`. Synchronises `stream` 2K times.
inline void pllep_backward(floatX* dx, float* dtopk_w, floatX* dW13_local, floatX* dW2_local, const floatX* dout,
                           const PLLEPSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                           const floatX* W13_local, const floatX* W2_local, int H, int I, int E, int k, double alpha,
                           long long min_rows, const Comm& ep, cudaStream_t stream) {
  const int N = saved.N, K = saved.chunking.chunks;
  if (K < 1) fm_fail("pllep_backward", "no forward to replay: run pllep_forward first", "N=%d", N);
  for (int i = 0; i < K; i++) {
    PLLEPChunk chunk(x, topk_idx, topk_w, N, H, k, K, i, stream);
    LLEPSaved ls;
    llep_forward(nullptr, ls, chunk.x, chunk.topk_idx, chunk.topk_w, W13_local, W2_local, chunk.n, H, I, E, k, alpha,
                 min_rows, ep, stream);
    floatX* dout_chunk = pllep_gather(dout, chunk.n, H, K, i, Mem::Dispatch, "pllep.dout_chunk", stream);
    floatX* dx_chunk = alloc_rows<floatX>((size_t)chunk.n * H, Mem::Dispatch, "pllep.dx_chunk");
    float* dtopk_w_chunk = alloc_rows<float>((size_t)chunk.n * k, Mem::Dispatch, "pllep.dtopk_w_chunk");
    llep_backward(dx_chunk, dtopk_w_chunk, dW13_local, dW2_local, dout_chunk, ls, chunk.topk_w, W13_local, W2_local, ep,
                  stream);
    llep_saved_free(ls);
    pllep_scatter(dx, dx_chunk, chunk.n, H, K, i, stream);
    pllep_scatter(dtopk_w, dtopk_w_chunk, chunk.n, k, K, i, stream);
    for (void* p : {(void*)dtopk_w_chunk, (void*)dx_chunk, (void*)dout_chunk}) pool().free(p);
  }
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
                   H, I, E, k, alpha, min_rows, group, stream);
  }
};
