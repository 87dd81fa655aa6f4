// attention.cuh — causal multi-head self-attention, flash-style (FlashAttention-2 schedule on
// SIMT cores, fp32 accumulation). Twin of ref/attention.hpp.
//
// Three forms of one contract (AttentionKernels): the SIMT kernels below (the FP32 build's only
// form, verified against the double reference at 1e-5, and the BF16 build's for hd = 32), and the
// tensor-core kernels of attention_mma.cuh (bf16 MMAs, fp32 softmax statistics; same schedule, same
// workspace, deterministic too): mma.sync at hd 64 and 128 in the BF16 build, and their wgmma form
// at hd 64 in sm_90a builds. attention_forward / attention_backward take the fastest form the build
// has (attention_kernels_for); attention_forward_with / attention_backward_with take a given one
// (the tests and tools/bench_attention.cu compare them).
//
// Shapes: qkv [N = B·T, 3H] (q and k already rotated by RoPE), H = nh·hd; row n = b·T + t holds
// q (nh×hd), then k (nh×hd), then v (nh×hd). out [N, H]; lse [B, nh, T] (fp32).
// Per sequence b and head h (Q, K, V: T×hd), scale = 1/sqrt(hd):
//   S = Q Kᵀ·scale, P = causal softmax of S (row i over keys j ≤ i), out = P V,
//   lse[b, h, i] = log Σ_{j≤i} exp(S[i, j])                                   (=)
// Backward, given dout [N, H], the forward's out and lse:
//   delta_i = Σ_d dout[i, d]·out[i, d],  P = exp(S − lse) (recomputed tile by tile)
//   dV = Pᵀ dO, dP = dO Vᵀ, dS = P ⊙ (dP − delta), dQ = dS K·scale, dK = dSᵀ Q·scale
//   dqkv [N, 3H] (=): the q, k and v columns of every row are written (no accumulation).
// RoPE's backward in the stores (optional, a RoPE table given): dq and dk rotated back by −angle at
// their positions (ops/rope.cuh's rope_rotate_pair, in fp32, before the one rounding to floatX), so
// that dqkv is the gradient of the qkv before RoPE: the model's layer then needs no rope_backward
// launch. In the FP32 build the bits are those of rope_backward after the unrotated stores; in the BF16
// build dq and dk are rounded once instead of twice.
//
// Live set: the T×T score/probability matrix never exists in device memory; each block holds
// 64×64 tiles in shared memory and registers only. Device memory beyond inputs/outputs:
// backward allocates delta, B·nh·T floats (Mem::Workspace, tag "attention.delta"), freed on
// return (ordered on `stream`; a caller reusing pool blocks from another stream synchronises
// first, as for every pool block).
//
// Schedule: one block of 256 threads (16×16) per (head, sequence, 64-row tile). A thread owns
// rows ty + 16r (r < 4) and, within a tile, columns tx + 16c: score micro-tiles are 4×4 and
// output micro-tiles 4×(hd/16), so every shared-memory load feeds several FMAs.
//   forward:          per query tile, loop over key tiles 0 … diagonal with an online softmax
//                     (running row max m, running sum l, rescaled accumulator).
//   backward dK, dV:  per key tile, loop over query tiles diagonal … last, accumulating dK, dV.
//   backward dQ:      per query tile, loop over key tiles 0 … diagonal, accumulating dQ.
// Every output element is summed by one thread in a fixed order: deterministic, no atomics.
// Tiles are scheduled on blockIdx.z, heaviest (longest causal loop) first.
// Head dims: 32, 64, 128 (compile-time); others are refused. Shared memory per block (fp32 tiles,
// rows padded by one float against bank conflicts), for hd = 32 / 64 / 128:
//   forward 40.75 / 64.75 / 112.75 KiB, backward dK/dV 66 / 98 / 162 KiB, backward dQ
//   49.75 / 81.75 / 145.75 KiB (the 227 KiB opt-in limit of sm_90 holds them all).
// Registers (ptxas, sm_90, __launch_bounds__(256, 2) caps them at 128): forward 80 / 96 / 114,
// dK/dV 122 / 127 / 128, dQ 94 / 120 / 128; no spills in either build.
#pragma once
#include <cmath>
#include <initializer_list>
#include "common.cuh"
#include "../runtime/pool.cuh"
#include "attention_mma.cuh"  // the tensor-core kernels of the BF16 build (hd 64, 128)
#include "rope.cuh"           // RoPE's backward in the stores

static const int ATTN_TILE = 64;       // query and key rows per tile
static const int ATTN_THREADS = 256;   // 16 × 16
static const int ATTN_LDP = ATTN_TILE + 1;  // padded row stride of the tile×tile smem blocks

// ---------------------------------------------------------------------------------------------
// Kernels

// Copies rows [0, rows_valid) of a tile (TILE rows × HD columns, global row stride `stride`)
// into shared memory as fp32 with row stride LD; rows past the sequence end are zero.
template <int HD, int LD>
__device__ inline void attention_load_tile(float* dst, const floatX* src, size_t stride, int rows_valid) {
  for (int idx = threadIdx.x; idx < ATTN_TILE * HD; idx += ATTN_THREADS) {
    const int r = idx / HD, d = idx % HD;
    dst[r * LD + d] = r < rows_valid ? to_float(src[(size_t)r * stride + d]) : 0.f;
  }
}

// Reductions over the 16 threads (tx = 0 … 15) that share a row; every lane gets the same value.
// acc[r][c] = Σ_d rows_s[ty + 16r][d] · cols_s[tx + 16c][d] over the head dim (fp32 FMA in d
// order), for the 4×4 (row, column) pairs of thread (ty, tx) in a 64×64 tile pair.
template <int HD, int LD>
__device__ __forceinline__ void attention_tile_dot(float (&acc)[4][4], const float* rows_s, const float* cols_s, int ty,
                                                   int tx) {
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int c = 0; c < 4; c++) acc[r][c] = 0.f;
#pragma unroll 4
  for (int d = 0; d < HD; d++) {
    float rv[4], cv[4];
#pragma unroll
    for (int r = 0; r < 4; r++) rv[r] = rows_s[(ty + 16 * r) * LD + d];
#pragma unroll
    for (int c = 0; c < 4; c++) cv[c] = cols_s[(tx + 16 * c) * LD + d];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int c = 0; c < 4; c++) acc[r][c] = fmaf(rv[r], cv[c], acc[r][c]);
  }
}

// acc[r][c] += Σ_{j < count} A_s[ty + 16r][j] · B_s[j][tx + 16c] (A's rows ATTN_LDP apart, B's
// LDB apart; fp32 FMA in j order): a 64×count by count×(16·C) tile product, 4×C outputs per thread.
template <int C, int LDB>
__device__ __forceinline__ void attention_tile_accumulate(float (&acc)[4][C], const float* A_s, const float* B_s,
                                                          int count, int ty, int tx) {
#pragma unroll 4
  for (int j = 0; j < count; j++) {
    float av[4], bv[C];
#pragma unroll
    for (int r = 0; r < 4; r++) av[r] = A_s[(ty + 16 * r) * ATTN_LDP + j];
#pragma unroll
    for (int c = 0; c < C; c++) bv[c] = B_s[j * LDB + tx + 16 * c];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int c = 0; c < C; c++) acc[r][c] = fmaf(av[r], bv[c], acc[r][c]);
  }
}

// One head's row of a gradient (16·C columns, the thread's tx + 16c), times scale, stored at `row`; with
// a RoPE table (rope.cos_sin set), RoPE's backward at position t first, in fp32: the pair (i, i + HD/2)
// is the thread's columns c and c + C/2.
template <int C>
__device__ __forceinline__ void attention_store_row(floatX* row, const float (&acc)[C], float scale, int t, int tx,
                                                    const RopeAngles& rope) {
  float v[C];
#pragma unroll
  for (int c = 0; c < C; c++) v[c] = acc[c] * scale;
  if (rope.cos_sin)
#pragma unroll
    for (int c = 0; c < C / 2; c++) rope_backward_pair(rope, t, tx + 16 * c, v[c], v[c + C / 2]);
#pragma unroll
  for (int c = 0; c < C; c++) row[tx + 16 * c] = from_float<floatX>(v[c]);
}

__device__ inline float attention_row_max(float v) {
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffff, v, o));
  return v;
}
__device__ inline float attention_row_sum(float v) {
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffff, v, o);
  return v;
}

// grid (nh, B, ceil(T/64)); block 256. Writes out and lse for one 64-query tile of one head.
template <int HD>
__global__ void __launch_bounds__(ATTN_THREADS, 2)
    attention_forward_kernel(floatX* out, float* lse, const floatX* qkv, int T, int nh) {
  constexpr int C = HD / 16;  // output columns per thread
  constexpr int LD = HD + 1;  // padded row stride of Q_s, K_s
  extern __shared__ float smem[];
  float* Q_s = smem;                   // [TILE][LD]
  float* K_s = Q_s + ATTN_TILE * LD;   // [TILE][LD]
  float* V_s = K_s + ATTN_TILE * LD;   // [TILE][HD]
  float* P_s = V_s + ATTN_TILE * HD;   // [TILE][LDP]  probabilities of the current key tile
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int h = blockIdx.x, b = blockIdx.y;
  const int qt = gridDim.z - 1 - blockIdx.z;  // last query tile (most key tiles) first
  const int q0 = qt * ATTN_TILE;
  const int H = nh * HD;
  const size_t stride = 3 * (size_t)H;
  const floatX* q_base = qkv + (size_t)b * T * stride + (size_t)h * HD;  // q of (b, t = 0, h)
  const float scale = 1.f / sqrtf((float)HD);

  attention_load_tile<HD, LD>(Q_s, q_base + q0 * stride, stride, min(ATTN_TILE, T - q0));
  float o[4][C], m[4], l[4];  // l: this thread's partial row sum (its 4 keys of each tile)
#pragma unroll
  for (int r = 0; r < 4; r++) {
    m[r] = -INFINITY;
    l[r] = 0.f;
#pragma unroll
    for (int c = 0; c < C; c++) o[r][c] = 0.f;
  }

  for (int kt = 0; kt <= qt; kt++) {
    const int k0 = kt * ATTN_TILE;
    const int keys_valid = min(ATTN_TILE, T - k0);
    attention_load_tile<HD, LD>(K_s, q_base + H + k0 * stride, stride, keys_valid);
    attention_load_tile<HD, HD>(V_s, q_base + 2 * H + k0 * stride, stride, keys_valid);
    __syncthreads();

    float s[4][4];  // s[r][c]: query q0 + ty + 16r, key k0 + tx + 16c
    attention_tile_dot<HD, LD>(s, Q_s, K_s, ty, tx);

    // Online softmax. Key 0 is visible to every query, so after tile 0 each row max is finite
    // and exp(−inf − m) = 0 handles masked keys and the first rescale (m = −inf).
#pragma unroll
    for (int r = 0; r < 4; r++) {
      const int q = q0 + ty + 16 * r;
      float tile_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int k = k0 + tx + 16 * c;
        s[r][c] = (k <= q && k < T) ? s[r][c] * scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[r][c]);
      }
      const float m_new = fmaxf(m[r], attention_row_max(tile_max));
      const float alpha = expf(m[r] - m_new);
      l[r] *= alpha;
#pragma unroll
      for (int c = 0; c < C; c++) o[r][c] *= alpha;
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const float p = expf(s[r][c] - m_new);
        l[r] += p;
        P_s[(ty + 16 * r) * ATTN_LDP + tx + 16 * c] = p;
      }
      m[r] = m_new;
    }
    __syncthreads();

    attention_tile_accumulate<C, HD>(o, P_s, V_s, keys_valid, ty, tx);  // o += P V
    __syncthreads();  // K_s, V_s, P_s are overwritten by the next tile
  }

#pragma unroll
  for (int r = 0; r < 4; r++) {
    const float row_sum = attention_row_sum(l[r]);
    const int q = q0 + ty + 16 * r;
    if (q < T) {
      floatX* out_row = out + ((size_t)b * T + q) * H + (size_t)h * HD;
#pragma unroll
      for (int c = 0; c < C; c++) out_row[tx + 16 * c] = from_float<floatX>(o[r][c] / row_sum);
      if (tx == 0) lse[((size_t)b * nh + h) * T + q] = m[r] + logf(row_sum);
    }
  }
}

// delta[b, h, t] = Σ_d dout[n, h·hd + d]·out[n, h·hd + d], n = b·T + t. A group of G lanes per (n, h)
// (G = attention_delta_group: the fewest, a power of two, that give each lane at most one piece of NV
// elements at hd <= 256 and NV = 8; 8 lanes at hd = 64): lane g of the group sums pieces g, g + G, ...
// (a piece's elements in order), then the group adds its lanes by an xor butterfly. Every lane of the
// warp takes part in the butterfly; a group past the last row writes nothing.
template <int NV>
__global__ void attention_delta_kernel(float* delta, const floatX* dout, const floatX* out, int N, int T, int nh,
                                       int hd, int G) {
  using P = Pack<floatX, NV>;
  const long long thread = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  const long long row = thread / G;  // (n, h) = (row / nh, row % nh)
  const int g = (int)(thread % G), pieces = hd / NV;
  const bool valid = row < (long long)N * nh;
  float acc = 0.f;
  if (valid) {
    const P* dout_row = reinterpret_cast<const P*>(dout + (size_t)row * hd);
    const P* out_row = reinterpret_cast<const P*>(out + (size_t)row * hd);
    for (int c = g; c < pieces; c += G) {
      const P d = dout_row[c], o = out_row[c];
#pragma unroll
      for (int e = 0; e < NV; e++) acc = fmaf(to_float(d.v[e]), to_float(o.v[e]), acc);
    }
  }
  for (int o = G / 2; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
  if (valid && g == 0) {
    const int n = (int)(row / nh), h = (int)(row % nh);
    delta[((size_t)(n / T) * nh + h) * T + n % T] = acc;
  }
}

// The lanes per (n, h) row of attention_delta_kernel: pieces = hd / NV rounded up to a power of two, at most 32.
inline int attention_delta_group(int hd, int NV) {
  int G = 1;
  while (G < 32 && G * NV < hd) G *= 2;
  return G;
}

// grid (nh, B, ceil(T/64)); block 256. Writes dK and dV of one 64-key tile of one head.
template <int HD>
__global__ void __launch_bounds__(ATTN_THREADS, 2)
    attention_backward_dkdv_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                   const float* delta, int T, int nh, const RopeAngles rope) {
  constexpr int C = HD / 16;
  constexpr int LD = HD + 1;
  extern __shared__ float smem[];
  float* K_s = smem;                        // [TILE][LD]
  float* V_s = K_s + ATTN_TILE * LD;        // [TILE][LD]
  float* Q_s = V_s + ATTN_TILE * LD;        // [TILE][LD]
  float* dO_s = Q_s + ATTN_TILE * LD;       // [TILE][LD]
  float* Pt_s = dO_s + ATTN_TILE * LD;      // [TILE keys][LDP]  Pᵀ of the current query tile
  float* dSt_s = Pt_s + ATTN_TILE * ATTN_LDP;   // [TILE keys][LDP]  dSᵀ
  float* lse_s = dSt_s + ATTN_TILE * ATTN_LDP;  // [TILE]
  float* delta_s = lse_s + ATTN_TILE;           // [TILE]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int h = blockIdx.x, b = blockIdx.y;
  const int kt = blockIdx.z;  // key tile 0 (most query tiles) first
  const int q_tiles = gridDim.z;
  const int k0 = kt * ATTN_TILE;
  const int H = nh * HD;
  const size_t stride = 3 * (size_t)H;
  const floatX* q_base = qkv + (size_t)b * T * stride + (size_t)h * HD;
  const floatX* dout_base = dout + (size_t)b * T * H + (size_t)h * HD;
  const float* lse_bh = lse + ((size_t)b * nh + h) * T;
  const float* delta_bh = delta + ((size_t)b * nh + h) * T;
  const float scale = 1.f / sqrtf((float)HD);

  const int keys_valid = min(ATTN_TILE, T - k0);
  attention_load_tile<HD, LD>(K_s, q_base + H + k0 * stride, stride, keys_valid);
  attention_load_tile<HD, LD>(V_s, q_base + 2 * H + k0 * stride, stride, keys_valid);
  float dk[4][C], dv[4][C];  // key k0 + ty + 16r, column tx + 16c
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int c = 0; c < C; c++) dk[r][c] = dv[r][c] = 0.f;

  for (int qt = kt; qt < q_tiles; qt++) {
    const int q0 = qt * ATTN_TILE;
    const int queries_valid = min(ATTN_TILE, T - q0);
    attention_load_tile<HD, LD>(Q_s, q_base + q0 * stride, stride, queries_valid);
    attention_load_tile<HD, LD>(dO_s, dout_base + (size_t)q0 * H, H, queries_valid);
    for (int i = threadIdx.x; i < ATTN_TILE; i += ATTN_THREADS) {
      lse_s[i] = i < queries_valid ? lse_bh[q0 + i] : 0.f;
      delta_s[i] = i < queries_valid ? delta_bh[q0 + i] : 0.f;
    }
    __syncthreads();

    float s[4][4], dp[4][4];  // [r][c]: key k0 + ty + 16r, query q0 + tx + 16c
    attention_tile_dot<HD, LD>(s, K_s, Q_s, ty, tx);
    attention_tile_dot<HD, LD>(dp, V_s, dO_s, ty, tx);
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int k = k0 + ty + 16 * r, qi = tx + 16 * c, q = q0 + qi;
        float p = 0.f, ds = 0.f;
        if (k <= q && q < T) {  // implies k < T
          p = expf(s[r][c] * scale - lse_s[qi]);
          ds = p * (dp[r][c] - delta_s[qi]);
        }
        Pt_s[(ty + 16 * r) * ATTN_LDP + qi] = p;
        dSt_s[(ty + 16 * r) * ATTN_LDP + qi] = ds;
      }
    __syncthreads();

    attention_tile_accumulate<C, LD>(dv, Pt_s, dO_s, queries_valid, ty, tx);   // dV += Pᵀ dO
    attention_tile_accumulate<C, LD>(dk, dSt_s, Q_s, queries_valid, ty, tx);   // dK += dSᵀ Q
    __syncthreads();  // Q_s, dO_s, Pt_s, dSt_s, lse_s, delta_s are overwritten by the next tile
  }

#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int k = k0 + ty + 16 * r;
    if (k < T) {
      floatX* row = dqkv + ((size_t)b * T + k) * stride + (size_t)h * HD;
      attention_store_row<C>(row + H, dk[r], scale, k, tx, rope);
      attention_store_row<C>(row + 2 * H, dv[r], 1.f, k, tx, RopeAngles{});
    }
  }
}

// grid (nh, B, ceil(T/64)); block 256. Writes dQ of one 64-query tile of one head.
template <int HD>
__global__ void __launch_bounds__(ATTN_THREADS, 2)
    attention_backward_dq_kernel(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                 const float* delta, int T, int nh, const RopeAngles rope) {
  constexpr int C = HD / 16;
  constexpr int LD = HD + 1;
  extern __shared__ float smem[];
  float* Q_s = smem;                       // [TILE][LD]
  float* dO_s = Q_s + ATTN_TILE * LD;      // [TILE][LD]
  float* K_s = dO_s + ATTN_TILE * LD;      // [TILE][LD]
  float* V_s = K_s + ATTN_TILE * LD;       // [TILE][LD]
  float* dS_s = V_s + ATTN_TILE * LD;      // [TILE queries][LDP]  dS of the current key tile
  float* lse_s = dS_s + ATTN_TILE * ATTN_LDP;  // [TILE]
  float* delta_s = lse_s + ATTN_TILE;          // [TILE]
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  const int h = blockIdx.x, b = blockIdx.y;
  const int qt = gridDim.z - 1 - blockIdx.z;  // last query tile (most key tiles) first
  const int q0 = qt * ATTN_TILE;
  const int H = nh * HD;
  const size_t stride = 3 * (size_t)H;
  const floatX* q_base = qkv + (size_t)b * T * stride + (size_t)h * HD;
  const floatX* dout_base = dout + (size_t)b * T * H + (size_t)h * HD;
  const float* lse_bh = lse + ((size_t)b * nh + h) * T;
  const float* delta_bh = delta + ((size_t)b * nh + h) * T;
  const float scale = 1.f / sqrtf((float)HD);

  const int queries_valid = min(ATTN_TILE, T - q0);
  attention_load_tile<HD, LD>(Q_s, q_base + q0 * stride, stride, queries_valid);
  attention_load_tile<HD, LD>(dO_s, dout_base + (size_t)q0 * H, H, queries_valid);
  for (int i = threadIdx.x; i < ATTN_TILE; i += ATTN_THREADS) {
    lse_s[i] = i < queries_valid ? lse_bh[q0 + i] : 0.f;
    delta_s[i] = i < queries_valid ? delta_bh[q0 + i] : 0.f;
  }
  float dq[4][C];  // query q0 + ty + 16r, column tx + 16c
#pragma unroll
  for (int r = 0; r < 4; r++)
#pragma unroll
    for (int c = 0; c < C; c++) dq[r][c] = 0.f;

  for (int kt = 0; kt <= qt; kt++) {
    const int k0 = kt * ATTN_TILE;
    const int keys_valid = min(ATTN_TILE, T - k0);
    attention_load_tile<HD, LD>(K_s, q_base + H + k0 * stride, stride, keys_valid);
    attention_load_tile<HD, LD>(V_s, q_base + 2 * H + k0 * stride, stride, keys_valid);
    __syncthreads();

    float s[4][4], dp[4][4];  // [r][c]: query q0 + ty + 16r, key k0 + tx + 16c
    attention_tile_dot<HD, LD>(s, Q_s, K_s, ty, tx);
    attention_tile_dot<HD, LD>(dp, dO_s, V_s, ty, tx);
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
      for (int c = 0; c < 4; c++) {
        const int qi = ty + 16 * r, q = q0 + qi, k = k0 + tx + 16 * c;
        float ds = 0.f;
        if (k <= q && q < T) {  // implies k < T
          const float p = expf(s[r][c] * scale - lse_s[qi]);
          ds = p * (dp[r][c] - delta_s[qi]);
        }
        dS_s[qi * ATTN_LDP + tx + 16 * c] = ds;
      }
    __syncthreads();

    attention_tile_accumulate<C, LD>(dq, dS_s, K_s, keys_valid, ty, tx);  // dQ += dS K
    __syncthreads();  // K_s, V_s, dS_s are overwritten by the next tile
  }

#pragma unroll
  for (int r = 0; r < 4; r++) {
    const int q = q0 + ty + 16 * r;
    if (q < T) attention_store_row<C>(dqkv + ((size_t)b * T + q) * stride + (size_t)h * HD, dq[r], scale, q, tx, rope);
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers

template <int HD>
inline size_t attention_forward_smem() {
  return sizeof(float) * (2 * ATTN_TILE * (HD + 1) + ATTN_TILE * HD + ATTN_TILE * ATTN_LDP);
}
template <int HD>
inline size_t attention_dkdv_smem() {
  return sizeof(float) * (4 * ATTN_TILE * (HD + 1) + 2 * ATTN_TILE * ATTN_LDP + 2 * ATTN_TILE);
}
template <int HD>
inline size_t attention_dq_smem() {
  return sizeof(float) * (4 * ATTN_TILE * (HD + 1) + ATTN_TILE * ATTN_LDP + 2 * ATTN_TILE);
}

inline void attention_check_sizes(const char* op, int B, int T, int nh, int hd) {
  if (B <= 0 || T <= 0 || nh <= 0 || B > 65535 || ceil_div(T, ATTN_TILE) > 65535)
    fm_fail(op, "sizes must be positive, B <= 65535 and T <= 65535·64", "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
  if (hd != 32 && hd != 64 && hd != 128)
    fm_fail(op, "unsupported head dim: hd must be 32, 64 or 128", "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
}

// Kernels using more than 48 KB of dynamic shared memory must opt in. Set before every launch
// (the attribute is per device; the call is host-side only and does not synchronise).
template <typename Kernel>
inline void attention_allow_smem(const char* op, Kernel kernel, size_t bytes, int B, int T, int nh, int hd) {
  cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes), op,
            "B=%d T=%d nh=%d hd=%d smem=%zu", B, T, nh, hd, bytes);
}

template <int HD>
inline void attention_forward_hd(floatX* out, float* lse, const floatX* qkv, int B, int T, int nh,
                                 cudaStream_t stream) {
  const size_t smem = attention_forward_smem<HD>();
  attention_allow_smem("attention_forward", attention_forward_kernel<HD>, smem, B, T, nh, HD);
  const dim3 grid(nh, B, ceil_div(T, ATTN_TILE));
  attention_forward_kernel<HD><<<grid, ATTN_THREADS, smem, stream>>>(out, lse, qkv, T, nh);
  launchCheck("attention_forward", "B=%d T=%d nh=%d hd=%d", B, T, nh, HD);
}

template <int HD>
inline void attention_backward_hd(floatX* dqkv, const floatX* dout, const floatX* qkv, const float* lse,
                                  const float* delta, int B, int T, int nh, const RopeAngles& rope,
                                  cudaStream_t stream) {
  const dim3 grid(nh, B, ceil_div(T, ATTN_TILE));
  const size_t smem_dkdv = attention_dkdv_smem<HD>();
  attention_allow_smem("attention_backward", attention_backward_dkdv_kernel<HD>, smem_dkdv, B, T, nh, HD);
  attention_backward_dkdv_kernel<HD><<<grid, ATTN_THREADS, smem_dkdv, stream>>>(dqkv, dout, qkv, lse, delta, T, nh, rope);
  launchCheck("attention_backward", "dK/dV kernel: B=%d T=%d nh=%d hd=%d", B, T, nh, HD);
  const size_t smem_dq = attention_dq_smem<HD>();
  attention_allow_smem("attention_backward", attention_backward_dq_kernel<HD>, smem_dq, B, T, nh, HD);
  attention_backward_dq_kernel<HD><<<grid, ATTN_THREADS, smem_dq, stream>>>(dqkv, dout, qkv, lse, delta, T, nh, rope);
  launchCheck("attention_backward", "dQ kernel: B=%d T=%d nh=%d hd=%d", B, T, nh, HD);
}

// ---------------------------------------------------------------------------------------------
// Which kernels run

// The three forms of the contract: the SIMT kernels above (any build, any supported hd), the
// tensor cores' mma.sync kernels and their wgmma form (attention_mma.cuh; BF16 build; wgmma only in
// sm_90a builds and at hd 64).
enum class AttentionKernels { Simt, MmaSync, Wgmma };

inline const char* attention_kernels_name(AttentionKernels k) {
  return k == AttentionKernels::Simt ? "SIMT" : k == AttentionKernels::MmaSync ? "mma.sync" : "wgmma";
}

// Whether this build has `kernels` for head dim hd and these tensors (the tensor-core kernels copy
// 16-byte pieces: every tensor 16-byte aligned).
inline bool attention_has_kernels(AttentionKernels kernels, int hd, std::initializer_list<const void*> ptrs) {
  if (kernels == AttentionKernels::Simt) return true;
#ifdef FLATMOE_BF16
  if (!attn_mma::supported(hd, ptrs)) return false;
#if defined(FLATMOE_WGMMA)
  return kernels == AttentionKernels::MmaSync || hd == attn_mma::WG_HD;
#else
  return kernels == AttentionKernels::MmaSync;
#endif
#else
  (void)hd;
  (void)ptrs;
  return false;
#endif
}

// What attention_forward / attention_backward take: the fastest kernels the build has for hd and
// the tensors (wgmma, then mma.sync, then SIMT).
inline AttentionKernels attention_kernels_for(int hd, std::initializer_list<const void*> ptrs) {
  for (const AttentionKernels k : {AttentionKernels::Wgmma, AttentionKernels::MmaSync})
    if (attention_has_kernels(k, hd, ptrs)) return k;
  return AttentionKernels::Simt;
}

// attention_forward (below) on the given kernels; refused when the build does not have them for hd.
inline void attention_forward_with(AttentionKernels kernels, floatX* out, float* lse, const floatX* qkv, int B, int T,
                                   int nh, int hd, cudaStream_t stream) {
  attention_check_sizes("attention_forward", B, T, nh, hd);
  if (!attention_has_kernels(kernels, hd, {out, qkv}))
    fm_fail("attention_forward", "this build has no such kernels for this head dim", "kernels=%s B=%d T=%d nh=%d hd=%d",
            attention_kernels_name(kernels), B, T, nh, hd);
#ifdef FLATMOE_BF16
#if defined(FLATMOE_WGMMA)
  if (kernels == AttentionKernels::Wgmma) return attn_mma::forward_wgmma(out, lse, qkv, B, T, nh, stream);
#endif
  if (kernels == AttentionKernels::MmaSync) return attn_mma::forward(out, lse, qkv, B, T, nh, hd, stream);
#endif
  switch (hd) {
    case 32: attention_forward_hd<32>(out, lse, qkv, B, T, nh, stream); break;
    case 64: attention_forward_hd<64>(out, lse, qkv, B, T, nh, stream); break;
    default: attention_forward_hd<128>(out, lse, qkv, B, T, nh, stream); break;
  }
}

// attention_backward (below) on the given kernels: delta (the only workspace), then the dK/dV and
// dQ kernels.
inline void attention_backward_with(AttentionKernels kernels, floatX* dqkv, const floatX* dout, const floatX* qkv,
                                    const floatX* out, const float* lse, int B, int T, int nh, int hd,
                                    cudaStream_t stream, const RopeAngles& rope = RopeAngles{}) {
  attention_check_sizes("attention_backward", B, T, nh, hd);
  if (rope.cos_sin) rope_check_table("attention_backward", rope, B, T, nh, hd);
  if (!attention_has_kernels(kernels, hd, {dqkv, dout, qkv}))
    fm_fail("attention_backward", "this build has no such kernels for this head dim",
            "kernels=%s B=%d T=%d nh=%d hd=%d", attention_kernels_name(kernels), B, T, nh, hd);
  const int N = B * T;
  DeviceBuffer<float> delta((size_t)N * nh, Mem::Workspace, "attention.delta");
  const int threads = 256;
  const int NV = row_pieces(hd, {dout, out}) ? ROW_PIECE : 1;  // hd·nh = H: every (n, h) row aligned as the first
  const int G = attention_delta_group(hd, NV);
  auto* delta_kernel = NV == 1 ? attention_delta_kernel<1> : attention_delta_kernel<ROW_PIECE>;
  delta_kernel<<<ceil_div((long long)N * nh * G, threads), threads, 0, stream>>>(delta.ptr, dout, out, N, T, nh, hd, G);
  launchCheck("attention_backward", "delta kernel: B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
#ifdef FLATMOE_BF16
#if defined(FLATMOE_WGMMA)
  if (kernels == AttentionKernels::Wgmma)
    return attn_mma::backward_wgmma(dqkv, dout, qkv, lse, delta.ptr, B, T, nh, rope, stream);
#endif
  if (kernels == AttentionKernels::MmaSync)
    return attn_mma::backward(dqkv, dout, qkv, lse, delta.ptr, B, T, nh, hd, rope, stream);
#endif
  switch (hd) {
    case 32: attention_backward_hd<32>(dqkv, dout, qkv, lse, delta.ptr, B, T, nh, rope, stream); break;
    case 64: attention_backward_hd<64>(dqkv, dout, qkv, lse, delta.ptr, B, T, nh, rope, stream); break;
    default: attention_backward_hd<128>(dqkv, dout, qkv, lse, delta.ptr, B, T, nh, rope, stream); break;
  }
}

// out [N, H] (=), lse [B, nh, T] (=) from qkv [N, 3H] (q, k rotated). out must not alias qkv.
inline void attention_forward(floatX* out, float* lse, const floatX* qkv, int B, int T, int nh, int hd,
                              cudaStream_t stream) {
  attention_forward_with(attention_kernels_for(hd, {out, qkv}), out, lse, qkv, B, T, nh, hd, stream);
}

// dqkv [N, 3H] (=) from dout [N, H] and the forward's qkv, out, lse. dqkv must not alias inputs.
// With rope (a RoPE table, ops/rope.cuh): dqkv's q and k columns are the gradients of q and k before
// their rotation, RoPE's backward applied in the kernels' stores (the same as rope_backward after).
inline void attention_backward(floatX* dqkv, const floatX* dout, const floatX* qkv, const floatX* out,
                               const float* lse, int B, int T, int nh, int hd, cudaStream_t stream,
                               const RopeAngles& rope = RopeAngles{}) {
  attention_backward_with(attention_kernels_for(hd, {dqkv, dout, qkv}), dqkv, dout, qkv, out, lse, B, T, nh, hd,
                          stream, rope);
}
