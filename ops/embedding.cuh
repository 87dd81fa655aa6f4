// embedding.cuh — token embedding lookup (twin: ref/embedding.hpp).
//
//   forward:  out[n, :] = wte[tokens[n], :]                          out (=)
//   backward: dwte[v, :] += Σ_{n : tokens[n] = v} dout[n, :]          dwte (+=)
//
// Shapes: tokens [N] int32, wte / dwte [V, H], out / dout [N, H] (floatX, row-major).
//
// Determinism: backward never scatters with atomics. The host, which holds the tokens before
// they are uploaded (like llm.c), groups the positions of each token id (counting sort: stable,
// ascending position within an id) and lists the ids that occur. One thread per (used id,
// column) then adds that id's rows of dout in ascending position order in fp32 and adds the sum
// once into dwte. Rows of ids that do not occur are not touched. Work is proportional to N·H
// (no per-vocabulary-row pass); the longest serial chain is the count of the most frequent token.
// The count of used ids is read on the device and the grid depends only on N, V and H, so that a
// pass launches the same kernel whatever its tokens (a captured pass, runtime/graph.cuh).
//
// Token ids outside [0, V) are refused on the host by build_token_buckets; the forward kernel,
// which reads device tokens, writes a NaN row for such an id instead of reading outside wte, so
// the error shows in the loss.
//
// Memory: no temporaries (the trainer uploads the buckets: token_buckets_ints(N, V) ints).
#pragma once
#include <algorithm>
#include <vector>
#include "common.cuh"

// Host-side grouping of positions by token id (the backward's plan).
struct TokenBuckets {
  std::vector<int> offsets;    // [V + 1]: positions of id v are positions[offsets[v] .. offsets[v+1])
  std::vector<int> positions;  // [N]: grouped by token id, ascending position within an id
  std::vector<int> used_ids;   // [U]: ids with at least one position, ascending (U <= min(N, V))
};

inline TokenBuckets build_token_buckets(const int* tokens_host, int N, int V) {
  if (N < 0 || V <= 0) fm_fail("build_token_buckets", "invalid sizes", "N=%d V=%d", N, V);
  TokenBuckets b;
  b.offsets.assign((size_t)V + 1, 0);
  for (int n = 0; n < N; n++) {
    int t = tokens_host[n];
    if (t < 0 || t >= V)
      fm_fail("build_token_buckets", "token id out of range", "N=%d V=%d position=%d token=%d", N, V, n, t);
    b.offsets[t + 1]++;
  }
  for (int v = 0; v < V; v++) {
    if (b.offsets[v + 1] > 0) b.used_ids.push_back(v);
    b.offsets[v + 1] += b.offsets[v];
  }
  b.positions.resize(N);
  std::vector<int> next(b.offsets.begin(), b.offsets.end() - 1);
  for (int n = 0; n < N; n++) b.positions[next[tokens_host[n]]++] = n;
  return b;
}

// The ints of a pass's buckets on the device: offsets [V + 1], positions [N], then the used ids as
// the backward reads them: their count U, the U ids, zeros up to min(N, V) ids.
inline size_t token_buckets_ints(int N, int V) { return (size_t)V + 1 + N + 1 + std::min(N, V); }

// ---------------------------------------------------------------------------------------------
// Kernels

// One thread per output element; a token id outside [0, V) yields a NaN row.
template <typename T>
__global__ void embedding_forward_kernel(T* out, const int* tokens, const T* wte, int N, int H, int V) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)N * H) return;
  int n = (int)(i / H);
  int c = (int)(i % H);
  int token = tokens[n];
  out[i] = (token >= 0 && token < V) ? wte[(size_t)token * H + c] : from_float<T>(NAN);
}

// Blocks along the used ids: each strides over them (a grid fixed by the sizes, not by U).
constexpr int EMBEDDING_BWD_ID_BLOCKS = 2048;

// grid (min(min(N, V), EMBEDDING_BWD_ID_BLOCKS), ceil(H / blockDim)); thread = (column), for the used
// ids blockIdx.x, + gridDim.x, ... below used[0]. Sums each id's rows of dout in ascending position
// order, then adds the sum into dwte once.
template <typename T>
__global__ void embedding_backward_kernel(T* dwte, const T* dout, const int* bucket_offsets,
                                          const int* bucket_positions, const int* used, int H) {
  int c = blockIdx.y * blockDim.x + threadIdx.x;
  if (c >= H) return;
  const int used_count = used[0];
  for (int u = blockIdx.x; u < used_count; u += gridDim.x) {
    int id = used[1 + u];
    int begin = bucket_offsets[id];
    int end = bucket_offsets[id + 1];
    float acc = 0.f;
#pragma unroll 4
    for (int p = begin; p < end; p++) acc += to_float(dout[(size_t)bucket_positions[p] * H + c]);
    size_t o = (size_t)id * H + c;
    dwte[o] = from_float<T>(to_float(dwte[o]) + acc);
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers

// out [N, H] (=) = wte[tokens]; tokens [N] on the device.
inline void embedding_forward(floatX* out, const int* tokens, const floatX* wte, int N, int H, int V,
                              cudaStream_t stream) {
  if ((size_t)N * H == 0) return;
  const int threads = 256;
  embedding_forward_kernel<<<ceil_div((long long)N * H, threads), threads, 0, stream>>>(out, tokens, wte, N, H, V);
  launchCheck("embedding_forward", "N=%d H=%d V=%d", N, H, V);
}

// dwte [V, H] (+=): rows of the used ids get the sum of their dout rows. The device copies of
// build_token_buckets(tokens, N, V): bucket_offsets_dev [V+1], bucket_positions_dev [N], used_dev
// [1 + U]: the count U ≤ min(N, V), then the used ids.
inline void embedding_backward(floatX* dwte, const floatX* dout, const int* bucket_offsets_dev,
                               const int* bucket_positions_dev, const int* used_dev, int N, int V, int H,
                               cudaStream_t stream) {
  if (N == 0 || H == 0) return;
  if (N < 0 || V < 1 || H < 0) fm_fail("embedding_backward", "invalid sizes", "N=%d V=%d H=%d", N, V, H);
  const int threads = 128;
  dim3 grid(std::min(std::min(N, V), EMBEDDING_BWD_ID_BLOCKS), ceil_div(H, threads));
  embedding_backward_kernel<<<grid, threads, 0, stream>>>(dwte, dout, bucket_offsets_dev, bucket_positions_dev,
                                                          used_dev, H);
  launchCheck("embedding_backward", "N=%d V=%d H=%d", N, V, H);
}
