// ref/pipelined_llep.hpp — PipelinedLLEP's chunking in plain code (twin of the host-side plan of
// ops/pipelined_llep.cuh); each chunk's plan is ref/llep.hpp's over that chunk's counts.
//   K        min(K_max, max_r ⌈N_r / c⌉), at least 1
//   chunk    token n of every rank belongs to chunk n mod K
//   c_eff    the most tokens that one rank has in one chunk
#pragma once
#include <algorithm>
#include <cmath>
#include <vector>

namespace ref {

inline int pllep_chunks(const std::vector<int>& tokens_per_rank, int token_budget, int max_chunks) {
  int wanted = 0;
  for (int N : tokens_per_rank) wanted = std::max(wanted, (int)std::ceil((double)N / token_budget));
  return std::max(1, std::min(max_chunks, wanted));
}

inline int pllep_largest_chunk(const std::vector<int>& tokens_per_rank, int chunks) {
  int largest = 0;
  for (int N : tokens_per_rank) {
    std::vector<int> members(chunks, 0);
    for (int n = 0; n < N; n++) members[n % chunks]++;
    for (int m : members) largest = std::max(largest, m);
  }
  return largest;
}

// counts[i][s][e]: routes of source s's chunk-i tokens to expert e. topk_idx[s] [N_s·k]: slot j of
// token n at n·k + j (global expert ids).
inline std::vector<std::vector<std::vector<long long>>> pllep_chunk_counts(const std::vector<std::vector<int>>& topk_idx,
                                                                           int k, int E, int chunks) {
  const int ranks = (int)topk_idx.size();
  std::vector<std::vector<std::vector<long long>>> counts(
      chunks, std::vector<std::vector<long long>>(ranks, std::vector<long long>(E, 0)));
  for (int s = 0; s < ranks; s++)
    for (size_t route = 0; route < topk_idx[s].size(); route++) {
      const int n = (int)(route / k);
      counts[n % chunks][s][topk_idx[s][route]]++;
    }
  return counts;
}

}  // namespace ref
