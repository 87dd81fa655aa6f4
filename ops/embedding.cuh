// embedding.cuh — token embedding lookup (twin: ref/embedding.hpp).
//
//   forward:  out[n, :] = wte[tokens[n], :]                          out (=)
//   backward: dwte[v, :] += Σ_{n : tokens[n] = v} dout[n, :]          dwte (+=)
//
// Shapes: tokens [N] int32, wte / dwte [V, H], out / dout [N, H] (floatX, row-major).
//
// Determinism: backward never scatters with atomics. The host, which holds the tokens before
// they are uploaded (like llm.c), groups the positions of each token id (counting sort: stable,
// ascending position within an id) and lists the ids that occur. A block of EMBEDDING_BWD_SEGMENTS
// warps then takes a used id: its c positions are cut into S = 8 segments of ceil(c / S) consecutive
// ones, warp s sums segment s of dout's rows in ascending position order in fp32 (a lane per piece
// of 16 bytes, or per element), and the segments' sums are added in segment order and then once
// into dwte. An id of at most S positions is summed in plain position order. The longest serial
// chain is ceil(c / S) rows of the most frequent token (it was c, one thread per column: the default
// model's backward ran 31 µs on that chain, notes/speed.md, 'The memory-bound kernels'). Rows of ids that
// do not occur are not touched.
// Work is proportional to N·H (no per-vocabulary-row pass). The count of used ids is read on the
// device and the grid depends only on N and V, so that a pass launches the same kernel whatever its
// tokens (a captured pass, runtime/graph.cuh).
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

// One thread per NV consecutive elements of an output row (NV = ROW_PIECE, or 1); a token id outside
// [0, V) yields a NaN row.
template <int NV, typename T>
__global__ void embedding_forward_kernel(T* out, const int* tokens, const T* wte, int N, int H, int V) {
  using P = Pack<T, NV>;
  const int pieces = H / NV;  // per row
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)N * pieces) return;
  const int n = (int)(i / pieces), c = (int)(i % pieces);
  const int token = tokens[n];
  P piece;
  if (token >= 0 && token < V) {
    piece = reinterpret_cast<const P*>(wte)[(size_t)token * pieces + c];
  } else {
#pragma unroll
    for (int e = 0; e < NV; e++) piece.v[e] = from_float<T>(NAN);
  }
  reinterpret_cast<P*>(out)[i] = piece;
}

// Blocks along the used ids: each strides over them (a grid fixed by the sizes, not by U).
constexpr int EMBEDDING_BWD_ID_BLOCKS = 2048;
constexpr int EMBEDDING_BWD_SEGMENTS = 8;  // S: warps per block, one segment of an id's positions each
constexpr int EMBEDDING_BWD_ROUNDS = 4;    // rounds of 32 pieces a lane sums at once (H <= 1024 at NV = 8)

// grid min(min(N, V), EMBEDDING_BWD_ID_BLOCKS), block 32·S; the used ids blockIdx.x, + gridDim.x, ...
// below used[0]. Lane l of warp s takes pieces l, l + 32, ... of a row (NV elements each), R rounds of
// 32 pieces at a time: it sums segment s of the id's positions (the warp loads 32 positions at once
// and passes each to every lane, so the rows' loads do not wait on one another), the block adds the S
// segment sums in order (thread t: elements t, t + 32·S, ... of the R rounds), and adds the total into
// dwte once.
template <int NV, typename T>
__global__ void embedding_backward_kernel(T* dwte, const T* dout, const int* bucket_offsets,
                                          const int* bucket_positions, const int* used, int H) {
  using P = Pack<T, NV>;
  constexpr int S = EMBEDDING_BWD_SEGMENTS, R = EMBEDDING_BWD_ROUNDS, GROUP = R * 32 * NV;  // elements of R rounds
  __shared__ float segment_sums[S][GROUP];
  const int segment = threadIdx.x / 32, lane = threadIdx.x % 32, pieces = H / NV;
  const int used_count = used[0];
  for (int u = blockIdx.x; u < used_count; u += gridDim.x) {
    const int id = used[1 + u];
    const int begin = bucket_offsets[id], count = bucket_offsets[id + 1] - begin;
    const int length = (count + S - 1) / S;
    const int seg_begin = begin + min(count, segment * length), seg_end = begin + min(count, (segment + 1) * length);
    for (int first_piece = 0; first_piece < pieces; first_piece += R * 32) {
      float acc[R][NV] = {};
      for (int p0 = seg_begin; p0 < seg_end; p0 += 32) {
        const int mine = p0 + lane < seg_end ? bucket_positions[p0 + lane] : 0, n = min(32, seg_end - p0);
#pragma unroll 4
        for (int j = 0; j < n; j++) {
          const P* row = reinterpret_cast<const P*>(dout + (size_t)__shfl_sync(0xffffffff, mine, j) * H);
#pragma unroll
          for (int r = 0; r < R; r++) {
            const int piece = first_piece + r * 32 + lane;
            if (piece < pieces) {
              const P d = row[piece];
#pragma unroll
              for (int e = 0; e < NV; e++) acc[r][e] += to_float(d.v[e]);
            }
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; r++)
#pragma unroll
        for (int e = 0; e < NV; e++) segment_sums[segment][(r * 32 + lane) * NV + e] = acc[r][e];
      __syncthreads();
      for (int t = threadIdx.x; t < GROUP; t += blockDim.x) {
        const int c = first_piece * NV + t;
        if (c < H) {
          float total = segment_sums[0][t];
#pragma unroll
          for (int s = 1; s < S; s++) total += segment_sums[s][t];
          const size_t o = (size_t)id * H + c;
          dwte[o] = from_float<T>(to_float(dwte[o]) + total);
        }
      }
      __syncthreads();  // segment_sums is the next group's
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers

// out [N, H] (=) = wte[tokens]; tokens [N] on the device.
inline void embedding_forward(floatX* out, const int* tokens, const floatX* wte, int N, int H, int V,
                              cudaStream_t stream) {
  if ((size_t)N * H == 0) return;
  const int threads = 256;
  if (row_pieces(H, {out, wte}))
    embedding_forward_kernel<ROW_PIECE><<<ceil_div((long long)N * (H / ROW_PIECE), threads), threads, 0, stream>>>(
        out, tokens, wte, N, H, V);
  else
    embedding_forward_kernel<1><<<ceil_div((long long)N * H, threads), threads, 0, stream>>>(out, tokens, wte, N, H, V);
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
  const int blocks = std::min(std::min(N, V), EMBEDDING_BWD_ID_BLOCKS), threads = 32 * EMBEDDING_BWD_SEGMENTS;
  auto* kernel = row_pieces(H, {dwte, dout}) ? embedding_backward_kernel<ROW_PIECE, floatX>
                                             : embedding_backward_kernel<1, floatX>;
  kernel<<<blocks, threads, 0, stream>>>(dwte, dout, bucket_offsets_dev, bucket_positions_dev, used_dev, H);
  launchCheck("embedding_backward", "N=%d V=%d H=%d", N, V, H);
}
