// pipelined_llep.cuh — PipelinedLLEP (DESIGN §6.3; papers/flattening-memory-peaks.txt §3.1,
// appendix B.1, Eq. 1): LLEP's routes (ops/llep.cuh) delivered in K chunks of strided token positions,
// each source emitting at most k·c_eff routes per chunk, so that no rank receives more than E_p·k·c_eff
// routes in one chunk, whatever the router does. Twin of ref/pipelined_llep.hpp (the chunking),
// ref/llep.hpp (each chunk's plan) and ref/moe.hpp (the math). Its own operator and dispatcher
// (--moe pllep), separate from LLEP's file: what it adds is the chunking, the receiver bound and the
// pipeline; each chunk is planned by llep_plan, unchanged.
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
// Receive live set: per chunk in flight, that many rows × H·b per row buffer; the number of chunks in
// flight at once is the pipeline's (dispatch of chunk i+1 and combine of chunk i−1 beside the
// expert GEMMs of chunk i).
// Layout of this file: the host-side plan first (pure C++, no CUDA call: the plan tests run it for up
// to 64 ranks without a GPU); the kernels and launchers of the pipeline go after it (not built yet).
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
