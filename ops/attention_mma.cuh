// attention_mma.cuh — causal multi-head self-attention on tensor cores (BF16 build only): the
// same contract as the SIMT kernels of attention.cuh (shapes, out, lse, dqkv (=), the delta
// workspace, RoPE's backward in the dq and dk stores when given a table), computed with bf16
// mma.sync (m16n8k16, fp32 accumulation) instead of fp32 FMA, and, in sm_90a builds at hd 64, with
// Hopper's warpgroup MMA (the wgmma form, at the end of this file).
// Twin: ref/attention.hpp (the same math; tests/gpu_attention.cu holds every form to it).
// Included by attention.cuh; attention_forward / attention_backward dispatch here for the BF16
// build and hd ∈ {64, 128} (qkv, dout, out, dqkv 16-byte aligned); everything else stays SIMT.
//
// What is rounded: S = QKᵀ and dP = dO Vᵀ come out of the MMA in fp32; the softmax statistics
// (row max m, row sum l, lse) and P = exp(S − lse), dS = P ⊙ (dP − delta) are fp32; P and dS are
// rounded to bf16 only as the A operand of the P·V, Pᵀ·dO, dS·K and dSᵀ·Q products (as in
// FlashAttention-2). Exponentials are exp2 of log2(e)-scaled scores; lse is stored in natural log.
//
// Tiling. Every kernel runs one block of 4 warps (128 threads) on a 64-row tile of one
// (sequence, head); the tile is split into 4 warp strips of 16 rows. Each warp's strip is the
// M = 16 side of its MMAs, so the softmax of a row never leaves the 4 lanes that hold it. The
// forward at hd 64 gives each warp two strips (a block of 128 queries, FORWARD_STRIPS): each K and V
// fragment it reads from shared memory then feeds two MMAs instead of one.
//
//                  key tile kt: 64 keys (shared memory, double-buffered, cp.async)
//                +----------------------------------+
//     warp 0     | rows  0-15 x 64 keys: S = Q K^T  |  per lane s[8][4]: 8 n-blocks of 8 keys
//     warp 1     | rows 16-31                       |
//     warp 2     | rows 32-47                       |  query tile qt: 64 rows (Q in shared
//     warp 3     | rows 48-63                       |  memory, A fragments in registers)
//                +----------------------------------+
//   Inside one 16 x 8 n-block (C fragment), lane l = 4g + t holds:
//                cols 0 1   cols 2 3   cols 4 5   cols 6 7
//     row g      lane 4g    lane 4g+1  lane 4g+2  lane 4g+3    (c[0], c[1])
//     row g+8    lane 4g    lane 4g+1  lane 4g+2  lane 4g+3    (c[2], c[3])
//   so a row's max and sum are two __shfl_xor_sync (1, 2) away.
//
//   forward:         block = query tile (64 or 128 rows); loop key tiles 0 … the last query's
//                    (online softmax; O in registers).
//   backward dK, dV: block = key tile (warp strips are 16 keys); loop query tiles kt … last,
//                    computing Sᵀ = K Qᵀ and dPᵀ = V dOᵀ per strip, then dV += Pᵀ dO, dK += dSᵀ Q.
//   backward dQ:     block = query tile; loop key tiles 0 … qt: S, dP, then dQ += dS K.
// Every output element is accumulated by one lane in a fixed order (no atomics): deterministic.
// Only the key tiles from the block's first query on (the diagonal) and, in the backward, the tile
// holding T are masked.
//
// Shared memory: bf16 tiles of 64 rows with row stride LD = HD + 8 (HD + 8 bf16 = 144 / 272
// bytes: the 8 row addresses of one ldmatrix phase fall on 8 distinct 16-byte bank groups, so
// ldmatrix is conflict-free; cp.async writes 16-byte chunks, CopiedTiles). Tiles per block: forward one Q tile
// per strip + 2 K + 2 V (6 at hd 64, 5 at hd 128), dK/dV K + V + 2 Q + 2 dO (6, + 2·2·64 floats of
// lse/delta), dQ Q + dO + 2 K + 2 V (6): hd = 64: 55 / 55 / 54 KiB, hd = 128: 85 / 103 / 102 KiB (two
// blocks per SM fit the 227 KiB of sm_90). Registers per lane: O (or dQ, dK + dV) HD/8·4 fp32 per
// strip, S and dP 32 fp32 per strip, the forward's Q fragments HD/16·4 words per strip (ptxas
// counts: notes/attention.md).
//
// The MMA fragments and ldmatrix forms these kernels rely on are drawn in ops/mma.cuh. Two n-blocks
// of C side by side (keys 16j … 16j+15) are exactly the A fragment of k-step j for the next
// product: P never touches shared memory.
#pragma once
#ifdef FLATMOE_BF16
#include <cstdint>
#include <initializer_list>
#include "common.cuh"
#include "mma.cuh"
#include "rope.cuh"

namespace attn_mma {

constexpr int TILE = 64;     // rows per query / key tile
constexpr int THREADS = 128; // 4 warps × 16 rows
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;
typedef __nv_bfloat16 bf16;

template <int HD>
constexpr int ld() { return HD + 8; }  // shared-memory row stride in bf16
template <int HD>
constexpr int tile_elems() { return TILE * ld<HD>(); }
// Query strips of 16 rows per warp in the forward: two at hd 64 (128 queries per block, each K and V
// fragment read from shared memory once for both), one at hd 128 (two would not fit the registers).
template <int HD>
constexpr int FORWARD_STRIPS = HD == 64 ? 2 : 1;

// ---- tile helpers (lane = threadIdx.x % 32) -----------------------------------------------

// Rows [0, rows_valid) of a 64 × HD tile (global row stride `stride` elements) into a padded
// shared-memory tile (rows of ld<HD>() bf16) with cp.async; rows past rows_valid become zeros. src
// must be readable even when rows_valid ≤ 0 (every row zeros).
template <int HD>
__device__ __forceinline__ void load_tile_async(bf16* dst, const bf16* src, size_t stride, int rows_valid) {
  constexpr int CHUNKS = HD / 8;  // 16-byte chunks per row
  for (int idx = threadIdx.x; idx < TILE * CHUNKS; idx += THREADS) {
    const int r = idx / CHUNKS, c = (idx % CHUNKS) * 8;
    const bool valid = r < rows_valid;
    cp_async_16(dst + r * ld<HD>() + c, src + (size_t)(valid ? r : 0) * stride + c, valid ? 16 : 0);
  }
}

// The operands the kernels copy into shared memory, as 64-row tiles of one (sequence, head): Q, K and V
// from qkv [B, T, 3H] (columns 0, H, 2H on, then the head's HD), dO from dout [B, T, H].
enum class Operand { Q = 0, K = 1, V = 2, dO = 3 };
struct TilePointers {
  const bf16* qkv;
  const bf16* dout;
};

// Tiles copied by every thread (cp.async, 16-byte chunks): the mma.sync kernels. A stage of tiles
// (`tile` calls, then `commit`) is in once every thread has waited for its own copies (`wait`) and the
// block has met at a barrier. The buffer and parity arguments are the TMA form's (TmaTiles).
template <int HD>
struct CopiedTiles {
  const TilePointers& tensors;
  int b, h, T, H;
  __device__ void init() const {}  // nothing to set up: each thread waits for its own copies
  // rows row0 … row0 + 63 of operand x into dst; rows past T become zeros
  __device__ void tile(bf16* dst, Operand x, int row0, int /*buffer*/) const {
    const bool is_dout = x == Operand::dO;
    const size_t stride = is_dout ? (size_t)H : 3 * (size_t)H;
    const bf16* first = is_dout ? tensors.dout + (size_t)b * T * H + (size_t)h * HD
                                : tensors.qkv + (size_t)b * T * stride + (size_t)x * H + (size_t)h * HD;
    load_tile_async<HD>(dst, row0 < T ? first + (size_t)row0 * stride : first, stride, T - row0);
  }
  __device__ void commit(int /*buffer*/) const { cp_async_commit(); }
  __device__ void wait(int /*buffer*/, int /*parity*/) const { cp_async_wait_all(); }
};

// A fragment of k-step ks (columns 16ks … 16ks+15) of the 16-row strip starting at `rows`.
template <int HD>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const bf16* rows, int ks, int lane) {
  ldmatrix_x4(a, rows + ((lane % 8) + 8 * ((lane / 8) % 2)) * ld<HD>() + ks * 16 + 8 * (lane / 16));
}

// Columns 16j … 16j+15 of a 16 × 8NB strip held as C fragments (n-blocks 2j, 2j+1), rounded to bf16,
// as the A fragment of k-step j of the next product.
template <int NB>
__device__ __forceinline__ void c_to_a(uint32_t (&a)[4], const float (&c)[NB][4], int j) {
  a[0] = pack_bf16(c[2 * j][0], c[2 * j][1]);
  a[1] = pack_bf16(c[2 * j][2], c[2 * j][3]);
  a[2] = pack_bf16(c[2 * j + 1][0], c[2 * j + 1][1]);
  a[3] = pack_bf16(c[2 * j + 1][2], c[2 * j + 1][3]);
}

// acc = strip(16 × HD) · Xᵀ for the 8·NB rows of X (stored [n][k], n = row of X): the
// 16 × 8NB score-like product. The strip's A fragments come from shared memory (a_rows).
template <int HD, int NB>
__device__ __forceinline__ void strip_times_tile_t(float (&acc)[NB][4], const bf16* a_rows, const bf16* X, int lane) {
#pragma unroll
  for (int nb = 0; nb < NB; nb++)
#pragma unroll
    for (int e = 0; e < 4; e++) acc[nb][e] = 0.f;
#pragma unroll
  for (int kp = 0; kp < HD / 32; kp++) {  // pairs of k-steps: one x4 B load covers 32 columns
    uint32_t a0[4], a1[4];
    load_a<HD>(a0, a_rows, 2 * kp, lane);
    load_a<HD>(a1, a_rows, 2 * kp + 1, lane);
#pragma unroll
    for (int nb = 0; nb < NB; nb++) {
      uint32_t b[4];
      ldmatrix_x4(b, X + (nb * 8 + lane % 8) * ld<HD>() + kp * 32 + 8 * (lane / 8));
      mma_16816(acc[nb], a0, b[0], b[1]);
      mma_16816(acc[nb], a1, b[2], b[3]);
    }
  }
}

// acc[i] += P_i · Y for i < MB: each P_i a 16 × 8NB strip held as C fragments (p[i][NB][4], rounded
// to bf16 here) and Y an 8NB × HD tile stored [k][n] (row = the keys or queries P's columns index).
// Each fragment of Y is loaded once for the MB strips; each strip's products are added in the same
// order whatever MB is.
template <int HD, int NB, int MB = 1>
__device__ __forceinline__ void c_strip_times_tile(float (*acc)[HD / 8][4], const float (*p)[NB][4], const bf16* Y,
                                                   int lane) {
#pragma unroll
  for (int j = 0; j < NB / 2; j++) {  // k-step j: columns 16j … 16j+15 of P = n-blocks 2j, 2j+1
    uint32_t a[MB][4];
#pragma unroll
    for (int i = 0; i < MB; i++) c_to_a<NB>(a[i], p[i], j);
#pragma unroll
    for (int np = 0; np < HD / 16; np++) {  // pairs of n-blocks: columns 16np … 16np+15 of Y
      uint32_t b[4];
      ldmatrix_x4_trans(b, Y + (j * 16 + (lane % 8) + 8 * ((lane / 8) % 2)) * ld<HD>() + np * 16 + 8 * (lane / 16));
#pragma unroll
      for (int i = 0; i < MB; i++) {
        mma_16816(acc[i][2 * np], a[i], b[0], b[1]);
        mma_16816(acc[i][2 * np + 1], a[i], b[2], b[3]);
      }
    }
  }
}

// ---- one strip's softmax and gradient steps (the mma.sync and the wgmma kernels) -----------

// One key tile's online-softmax step for a 16-row strip (rows row0, row0 + 8): s, the scores of keys
// k0 … k0 + 8NB − 1 (C fragments, unscaled), becomes P (unnormalised, fp32); m (log2 units), l and O
// are rescaled to the new row maxima. Only tiles from the block's first query on (`diagonal`) have
// keys after a query. A row meets its own key tile before any tile wholly after it, and that tile
// holds key k0 ≤ row, so m is finite from then on: exp2(−inf − m) = 0 covers the masked keys, and a
// tile wholly masked for a row leaves its m, l and O as they are (alpha = 1, P = 0). The maxima are
// taken on the unscaled scores (scale > 0), and P = exp2(s · scale − m) is one fused multiply-add.
template <int HD, int NB>
__device__ __forceinline__ void online_softmax_step(float (&s)[NB][4], float (&o)[HD / 8][4], float (&m)[2],
                                                    float (&l)[2], int row0, int k0, bool diagonal, float scale_log2,
                                                    int t) {
  if (diagonal)
#pragma unroll
    for (int nb = 0; nb < NB; nb++)
#pragma unroll
      for (int e = 0; e < 4; e++)
        if (k0 + nb * 8 + 2 * t + (e & 1) > row0 + 8 * (e >> 1)) s[nb][e] = -INFINITY;
  float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int nb = 0; nb < NB; nb++)
#pragma unroll
    for (int e = 0; e < 4; e++) tile_max[e >> 1] = fmaxf(tile_max[e >> 1], s[nb][e]);
  float alpha[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {  // the 4 lanes t = 0 … 3 of group g hold the row
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 1));
    tile_max[r] = fmaxf(tile_max[r], __shfl_xor_sync(0xffffffff, tile_max[r], 2));
    const float m_new = fmaxf(m[r], tile_max[r] * scale_log2);
    alpha[r] = fast_exp2(m[r] - m_new);
    m[r] = m_new;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int nb = 0; nb < HD / 8; nb++)
#pragma unroll
    for (int e = 0; e < 4; e++) o[nb][e] *= alpha[e >> 1];
#pragma unroll
  for (int nb = 0; nb < NB; nb++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      s[nb][e] = fast_exp2(fmaf(s[nb][e], scale_log2, -m[e >> 1]));  // now P (unnormalised), fp32
      l[e >> 1] += s[nb][e];
    }
}

// out rows row0, row0 + 8 (those < T) of a strip: O / l as bf16, and lse = (m + log2 l)·ln 2.
template <int HD>
__device__ __forceinline__ void store_out_strip(bf16* out, float* lse_bh, const float (&o)[HD / 8][4],
                                                const float (&m)[2], float (&l)[2], int row0, int T, int H, int t) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
    const int row = row0 + 8 * r;
    if (row < T) {
      const float inv = 1.f / l[r];
      bf16* out_row = out + (size_t)row * H;
#pragma unroll
      for (int nb = 0; nb < HD / 8; nb++)
        *reinterpret_cast<__nv_bfloat162*>(out_row + nb * 8 + 2 * t) =
            __floats2bfloat162_rn(o[nb][2 * r] * inv, o[nb][2 * r + 1] * inv);
      if (t == 0) lse_bh[row] = (m[r] + log2f(l[r])) * LN2;
    }
  }
}

// The dK/dV kernels' step for a 16-key strip (keys key0, key0 + 8) against 8NB queries q_first +
// 8nb + 2t + (e%2): st (Sᵀ, unscaled) becomes Pᵀ and dpt (dPᵀ) becomes dSᵀ = Pᵀ ⊙ (dPᵀ − delta).
// lse2 and delta are the queries' lse·log2(e) and delta from q_first on. `edge`: the tile is on the
// causal diagonal or holds queries ≥ T (whose P is 0).
template <int NB>
__device__ __forceinline__ void key_strip_grads(float (&st)[NB][4], float (&dpt)[NB][4], const float* lse2,
                                                const float* delta, int q_first, int key0, bool edge, int T,
                                                float scale_log2, int t) {
#pragma unroll
  for (int nb = 0; nb < NB; nb++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int qi = nb * 8 + 2 * t + (e & 1), q = q_first + qi, key = key0 + 8 * (e >> 1);
      float p = fast_exp2(st[nb][e] * scale_log2 - lse2[qi]);
      if (edge && (key > q || q >= T)) p = 0.f;
      st[nb][e] = p;                                  // Pᵀ
      dpt[nb][e] = p * (dpt[nb][e] - delta[qi]);      // dSᵀ
    }
}

// The dQ kernels' step for a 16-query strip (rows row0, row0 + 8) against keys k0 + 8nb + 2t + (e%2):
// dp (dP = dO Vᵀ) becomes dS = P ⊙ (dP − delta), P recomputed from s (S, unscaled) and lse2. `edge`:
// the diagonal tile, which also holds every query ≥ T.
__device__ __forceinline__ void query_strip_grads(const float (&s)[8][4], float (&dp)[8][4], const float (&lse2)[2],
                                                  const float (&dlt)[2], int row0, int k0, bool edge, int T,
                                                  float scale_log2, int t) {
#pragma unroll
  for (int nb = 0; nb < 8; nb++)
#pragma unroll
    for (int e = 0; e < 4; e++) {
      const int key = k0 + nb * 8 + 2 * t + (e & 1), row = row0 + 8 * (e >> 1);
      float p = fast_exp2(s[nb][e] * scale_log2 - lse2[e >> 1]);
      if (edge && (key > row || row >= T)) p = 0.f;
      dp[nb][e] = p * (dp[nb][e] - dlt[e >> 1]);  // dS
    }
}

// lse·log2(e) and delta of rows row0, row0 + 8 (0 for rows ≥ T) from one (sequence, head)'s rows.
__device__ __forceinline__ void load_row_stats(float (&lse2)[2], float (&dlt)[2], const float* lse_bh,
                                               const float* delta_bh, int row0, int T) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = row0 + 8 * r;
    lse2[r] = row < T ? lse_bh[row] * LOG2E : 0.f;
    dlt[r] = row < T ? delta_bh[row] : 0.f;
  }
}

// Rows row0, row0 + 8 (those < T: the positions in the sequence) of a 16 × HD strip, times scale, as
// bf16 at dst + row · row_stride; with a RoPE table (rope.cos_sin set), RoPE's backward first, in fp32:
// the thread holds columns 8nb + 2t + e of the strip, so each pair (i, i + HD/2) is its own (nb and
// nb + HD/16).
template <int HD>
__device__ __forceinline__ void store_strip(bf16* dst, size_t row_stride, const float (&acc)[HD / 8][4], int row0,
                                            int T, float scale, int t, const RopeAngles& rope) {
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = row0 + 8 * r;
    if (row < T) {
      float v[HD / 8][2];
#pragma unroll
      for (int nb = 0; nb < HD / 8; nb++)
#pragma unroll
        for (int e = 0; e < 2; e++) v[nb][e] = acc[nb][2 * r + e] * scale;
      if (rope.cos_sin)
#pragma unroll
        for (int nb = 0; nb < HD / 16; nb++)
#pragma unroll
          for (int e = 0; e < 2; e++) rope_backward_pair(rope, row, nb * 8 + 2 * t + e, v[nb][e], v[nb + HD / 16][e]);
      bf16* dst_row = dst + (size_t)row * row_stride;
#pragma unroll
      for (int nb = 0; nb < HD / 8; nb++)
        *reinterpret_cast<__nv_bfloat162*>(dst_row + nb * 8 + 2 * t) = __floats2bfloat162_rn(v[nb][0], v[nb][1]);
    }
  }
}

// ---- kernels ------------------------------------------------------------------------------

// grid (nh, B, ceil(T/(64·MB))); block 128. out and lse of one tile of 64·MB queries of one head;
// warp w owns the MB strips of 16 rows from 16·MB·w on (MB = FORWARD_STRIPS<HD>).
template <int HD, int MB>
__global__ void __launch_bounds__(THREADS) forward_kernel(bf16* out, float* lse, const bf16* qkv, int T, int nh) {
  constexpr int TE = tile_elems<HD>();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* Q_s = reinterpret_cast<bf16*>(smem_raw);  // [64·MB][LD]
  bf16* K_s = Q_s + MB * TE;                       // [2][64][LD]
  bf16* V_s = K_s + 2 * TE;                        // [2][64][LD]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.x, b = blockIdx.y;
  const int qt = gridDim.z - 1 - blockIdx.z;  // last query tile (most key tiles) first
  const int q0 = qt * TILE * MB;
  const int last_kt = (min(q0 + TILE * MB, T) - 1) / TILE;  // the key tile of the last query
  const int H = nh * HD;
  const float scale_log2 = LOG2E / sqrtf((float)HD);
  const TilePointers tensors{qkv, nullptr};
  const CopiedTiles<HD> tiles{tensors, b, h, T, H};

#pragma unroll
  for (int i = 0; i < MB; i++) tiles.tile(Q_s + i * TE, Operand::Q, q0 + i * TILE, 0);  // 64 queries at a time
  tiles.tile(K_s, Operand::K, 0, 0);
  tiles.tile(V_s, Operand::V, 0, 0);
  tiles.commit(0);

  uint32_t qf[MB][HD / 16][4];  // the warp's query strips as A fragments, loaded once
  float o[MB][HD / 8][4];       // O strips 16 × HD (C fragments), unnormalised
  float m[MB][2], l[MB][2];     // per strip, rows g, g+8: max (log2 units), partial sum
  int row0[MB];                 // per strip, the query of c[0], c[1]; c[2], c[3] are row0 + 8
#pragma unroll
  for (int i = 0; i < MB; i++) {
    row0[i] = q0 + (warp * MB + i) * 16 + g;
#pragma unroll
    for (int r = 0; r < 2; r++) m[i][r] = -INFINITY, l[i][r] = 0.f;
#pragma unroll
    for (int nb = 0; nb < HD / 8; nb++)
#pragma unroll
      for (int e = 0; e < 4; e++) o[i][nb][e] = 0.f;
  }

  for (int kt = 0; kt <= last_kt; kt++) {
    tiles.wait(kt & 1, 0);
    __syncthreads();  // tile kt is in; every warp is done with the buffer of tile kt − 1
    if (kt == 0) {
#pragma unroll
      for (int i = 0; i < MB; i++)
#pragma unroll
        for (int ks = 0; ks < HD / 16; ks++) load_a<HD>(qf[i][ks], Q_s + (warp * MB + i) * 16 * ld<HD>(), ks, lane);
    }
    if (kt < last_kt) {  // prefetch tile kt + 1 into the other buffer
      const int next = (kt + 1) & 1;
      tiles.tile(K_s + next * TE, Operand::K, (kt + 1) * TILE, next);
      tiles.tile(V_s + next * TE, Operand::V, (kt + 1) * TILE, next);
      tiles.commit(next);
    }
    const bf16* Kt = K_s + (kt & 1) * TE;
    const bf16* Vt = V_s + (kt & 1) * TE;

    // S = Q Kᵀ (16 × 64 per strip), Q from registers; each K fragment loaded once for the MB strips.
    float s[MB][8][4];
#pragma unroll
    for (int i = 0; i < MB; i++)
#pragma unroll
      for (int nb = 0; nb < 8; nb++)
#pragma unroll
        for (int e = 0; e < 4; e++) s[i][nb][e] = 0.f;
#pragma unroll
    for (int kp = 0; kp < HD / 32; kp++)
#pragma unroll
      for (int nb = 0; nb < 8; nb++) {
        uint32_t kb[4];
        ldmatrix_x4(kb, Kt + (nb * 8 + lane % 8) * ld<HD>() + kp * 32 + 8 * (lane / 8));
#pragma unroll
        for (int i = 0; i < MB; i++) {
          mma_16816(s[i][nb], qf[i][2 * kp], kb[0], kb[1]);
          mma_16816(s[i][nb], qf[i][2 * kp + 1], kb[2], kb[3]);
        }
      }

    // Online softmax in log2 units (P replaces S).
    const int k0 = kt * TILE;
    const bool diagonal = k0 + TILE > q0;
#pragma unroll
    for (int i = 0; i < MB; i++)
      online_softmax_step<HD, 8>(s[i], o[i], m[i], l[i], row0[i], k0, diagonal, scale_log2, t);

    c_strip_times_tile<HD, 8, MB>(o, s, Vt, lane);  // O += P V
  }

#pragma unroll
  for (int i = 0; i < MB; i++)
    store_out_strip<HD>(out + (size_t)b * T * H + (size_t)h * HD, lse + ((size_t)b * nh + h) * T, o[i], m[i], l[i],
                        row0[i], T, H, t);
}

#if defined(FLATMOE_WGMMA)
// ---- the wgmma form (sm_90a builds, hd 64) -------------------------------------------------
// The same blocks, loops and per-strip steps as the mma.sync kernels (forward_kernel<64, 1>; the
// backward kernels below take either form: backward_dkdv_kernel<64, WgmmaProducts>), with each tile
// product a chain of warpgroup MMAs (ops/mma.cuh): the block's 4 warps are one warpgroup, and its
// 64 × N accumulator is exactly the 4 warp strips' C fragments, so the per-strip steps
// (online_softmax_step, key_strip_grads, query_strip_grads, the stores) are shared with the
// mma.sync kernels.
//   - The score-like products (S = Q Kᵀ, dP = dO Vᵀ, Sᵀ = K Qᵀ, dPᵀ = V dOᵀ) read both operands
//     from shared memory through descriptors.
//   - The accumulating products (O += P V, dV += Pᵀ dO, dK += dSᵀ Q, dQ += dS K) take P or dS from
//     registers (c_to_a: C fragments rounded to bf16), as the mma.sync kernels do; they replace
//     every ldmatrix B load.
//   - The tiles are copied by the tensor memory accelerator (TMA, TmaTiles): thread 0 issues one copy
//     per 64-row tile, whose bytes complete on the buffer's mbarrier; the other threads issue no
//     load instruction at all, and a stage is in when the mbarrier's phase completes.
//   - Shared-memory tiles are unpadded, in the 128-byte swizzle (swizzle_128b), and one tile X
//     (64 rows × 64, row = a query or key) serves three ways: as A (rows = m, K-major) and as Xᵀ
//     (B[k = column][n = row], K-major), k-step ks at +32·ks bytes; as X (B[k = row][n = column],
//     MN-major), k-step ks at +2048·ks bytes.
//   - The forward's key tiles are 128 keys (two 64-row tiles, one after the other): one 64 × 128
//     score tile per softmax step, half the waits and barriers per key of 64-key tiles.
// Each product runs its k in ascending steps of 16. Shared memory per block: forward 73 KiB, dK/dV
// 50 KiB, dQ 49 KiB (+ two 8-byte mbarriers); registers (ptxas, sm_90a, 128 threads, no spills):
// forward 128, dK/dV 165, dQ 122. Q, K, V and dO are not held as register A fragments across the loop: with fragments loaded
// once before it, ptxas (CUDA 13.0) handed their registers to P inside the loop, and every key tile
// after the first read P for Q (notes/attention.md).

constexpr int WG_HD = 64;
constexpr int WG_TILE_BYTES = TILE * WG_HD * 2;  // 8 KiB, a multiple of the swizzle's 1024 bytes

__device__ __forceinline__ uint64_t rows_as_n(const bf16* tile, int ks) {
  return wgmma_descriptor(smem_addr(tile) + 32 * ks, 16);
}
__device__ __forceinline__ uint64_t rows_as_k(const bf16* tile, int ks) {
  return wgmma_descriptor(smem_addr(tile) + 2048 * ks, WG_TILE_BYTES);  // one 64-column atom: leading unused
}
// The dynamic shared memory from its first 1024-byte boundary on (the swizzle needs aligned tiles;
// the launch asks for 1024 bytes more).
__device__ __forceinline__ bf16* aligned_tiles(unsigned char* smem) {
  const uint32_t start = smem_addr(smem);
  return reinterpret_cast<bf16*>(smem + (((start + 1023) & ~1023u) - start));
}

// The tensor maps of the TMA form: qkv as [B][T][3H] and dout as [B][T][H] (innermost last), read in
// boxes of 64 columns (one head) × 64 rows of one sequence, in the 128-byte swizzle the wgmma
// descriptors read. Rows past T are outside the map and land as zeros, as CopiedTiles writes them.
struct TmaMaps {
  CUtensorMap qkv, dout;
};

inline TmaMaps tma_maps(const char* op, const bf16* qkv, const bf16* dout, int B, int T, int nh) {
  const size_t H = (size_t)nh * WG_HD;
  const cuuint32_t box[3] = {WG_HD, TILE, 1};
  TmaMaps maps{};  // the forward leaves dout's map zero (unused)
  const cuuint64_t qkv_dims[3] = {3 * H, (cuuint64_t)T, (cuuint64_t)B}, qkv_strides[2] = {3 * H * 2, 3 * H * 2 * T};
  maps.qkv = encode_tensor_map(op, "qkv", qkv, 3, qkv_dims, qkv_strides, box);
  if (dout != nullptr) {
    const cuuint64_t dout_dims[3] = {H, (cuuint64_t)T, (cuuint64_t)B}, dout_strides[2] = {H * 2, H * 2 * T};
    maps.dout = encode_tensor_map(op, "dout", dout, 3, dout_dims, dout_strides, box);
  }
  return maps;
}

// Tiles copied by the TMA (the wgmma kernels): the same contract as CopiedTiles. Buffer i of a stage
// is mbarrier full[i] (one arrival: thread 0's commit, and the bytes of its tiles); a stage's wait
// takes the phase's parity, 0 for the first stage in that buffer, then 1, 0, ...
struct TmaTiles {
  const TmaMaps& tensors;
  int b, h, H;     // the sequence, the head, the width of dout (the maps hold T)
  uint64_t* full;  // [2] in shared memory

  // before any tile: the barriers, visible to every thread and to the copies
  __device__ void init() const {
    if (threadIdx.x == 0) {
      mbarrier_init(&full[0], 1);
      mbarrier_init(&full[1], 1);
      fence_mbarrier_init();
    }
    __syncthreads();
  }
  __device__ void tile(bf16* dst, Operand x, int row0, int buffer) const {
    if (threadIdx.x != 0) return;
    mbarrier_expect_tx(&full[buffer], WG_TILE_BYTES);
    const bool is_dout = x == Operand::dO;
    tma_load_3d(dst, is_dout ? &tensors.dout : &tensors.qkv, (is_dout ? 0 : (int)x * H) + h * WG_HD, row0, b,
                &full[buffer]);
  }
  __device__ void commit(int buffer) const {
    if (threadIdx.x == 0) mbarrier_arrive(&full[buffer]);
  }
  __device__ void wait(int buffer, int parity) const { mbarrier_wait(&full[buffer], parity); }
};

// acc = A · Xᵀ over one 64-wide k: A and X tiles (A's 64 rows are the warpgroup's rows).
__device__ __forceinline__ void wgmma_tile_times_tile_t(float (&acc)[8][4], const bf16* A, const bf16* X) {
#pragma unroll
  for (int ks = 0; ks < 4; ks++) wgmma_m64n64k16_ss<0>(acc, rows_as_n(A, ks), rows_as_n(X, ks), ks > 0);
}
// acc += P · X over one 64-wide k: p[ks] the A fragments (P rounded to bf16), X a tile.
__device__ __forceinline__ void wgmma_fragments_times_tile(float (&acc)[8][4], uint32_t (&p)[4][4], const bf16* X) {
#pragma unroll
  for (int ks = 0; ks < 4; ks++) wgmma_m64n64k16_rs<1>(acc, p[ks], rows_as_k(X, ks), 1);
}

// The forward's key tiles on wgmma: 128 keys, so each softmax step is one 64 × 128 score tile.
constexpr int WG_KEYS = 2 * TILE;

// forward_kernel<64, 1> on wgmma, with key tiles of 128: grid (nh, B, ceil(T/64)); block 128.
template <int HD>
__global__ void __launch_bounds__(THREADS)
    forward_wgmma_kernel(bf16* out, float* lse, const __grid_constant__ TmaMaps tensors, int T, int nh) {
  static_assert(HD == WG_HD, "the wgmma kernels take hd 64");
  constexpr int TE = TILE * HD;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t full[2];
  bf16* Q_s = aligned_tiles(smem_raw);  // [64][64]
  bf16* K_s = Q_s + TE;                 // [2][128][64]
  bf16* V_s = K_s + 4 * TE;             // [2][128][64]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.x, b = blockIdx.y;
  const int qt = gridDim.z - 1 - blockIdx.z;  // last query tile (most key tiles) first
  const int q0 = qt * TILE;
  const int last_kt = (min(q0 + TILE, T) - 1) / WG_KEYS;  // the key tile of the last query
  const int H = nh * HD;
  const float scale_log2 = LOG2E / sqrtf((float)HD);
  const TmaTiles tiles{tensors, b, h, H, full};

  auto load_key_tile = [&](int kt) {  // keys and values of key tile kt into buffer kt & 1, as two 64-row tiles
    const int buffer = kt & 1;
#pragma unroll
    for (int half = 0; half < 2; half++) {
      tiles.tile(K_s + (buffer * 2 + half) * TE, Operand::K, kt * WG_KEYS + half * TILE, buffer);
      tiles.tile(V_s + (buffer * 2 + half) * TE, Operand::V, kt * WG_KEYS + half * TILE, buffer);
    }
    tiles.commit(buffer);
  };
  tiles.init();
  tiles.tile(Q_s, Operand::Q, q0, 0);
  load_key_tile(0);

  float o[8][4] = {};
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  const int row0 = q0 + warp * 16 + g;

  for (int kt = 0; kt <= last_kt; kt++) {
    tiles.wait(kt & 1, (kt >> 1) & 1);
    __syncthreads();  // every warp has waited for its MMAs of tile kt − 1, whose buffer the next copies take
    if (kt < last_kt) load_key_tile(kt + 1);
    const bf16* Kt = K_s + (kt & 1) * 2 * TE;
    const bf16* Vt = V_s + (kt & 1) * 2 * TE;

    float s[16][4];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 4; ks++)  // S = Q Kᵀ (64 × 128)
      wgmma_m64n128k16<0, 0>(reinterpret_cast<float(&)[64]>(s), rows_as_n(Q_s, ks), rows_as_n(Kt, ks), ks > 0);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s);
    const int k0 = kt * WG_KEYS;
    online_softmax_step<HD, 16>(s, o, m, l, row0, k0, k0 + WG_KEYS > q0, scale_log2, t);

    uint32_t pf[8][4];
#pragma unroll
    for (int j = 0; j < 8; j++) c_to_a<16>(pf[j], s, j);
    wgmma_fence_operands(o);
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < 8; ks++) wgmma_m64n64k16_rs<1>(o, pf[ks], rows_as_k(Vt, ks), 1);  // O += P V
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(o);
    wgmma_fence_operands(pf);
  }
  store_out_strip<HD>(out + (size_t)b * T * H + (size_t)h * HD, lse + ((size_t)b * nh + h) * T, o, m, l, row0, T, H,
                      t);
}

// Shared memory of the wgmma forward: 9 tiles of 8 KiB, + 1024 bytes to align them.
constexpr size_t WG_FORWARD_SMEM = 9 * WG_TILE_BYTES + 1024;
#endif  // FLATMOE_WGMMA

// ---- the backward kernels, in either form ---------------------------------------------------
// One kernel per role (dK/dV, dQ), templated on the form of its tile products: Products is
// MmaSyncProducts<HD> (per warp, its 16-row strip, ldmatrix + mma.sync, padded tiles) or, in sm_90a
// builds at hd 64, WgmmaProducts (the warpgroup's 64 rows, wgmma, swizzled tiles). The blocks, loops,
// masking, per-strip steps and stores are the same; so are the products' k orders.

// acc += P · Y: P a 16 × 8NB strip per warp held as C fragments (rounded to bf16 as the product's A
// operand), Y an 8NB × HD tile (row = the keys or queries P's columns index).
template <int HD, int NB_>
struct FragmentsTimesTile {
  static constexpr int NB = NB_;
  float (&acc)[HD / 8][4];
  const float (&p)[NB][4];
  const bf16* Y;
};

template <int HD>
struct MmaSyncProducts {
  static constexpr const char* FORM = "tensor-core";
  static constexpr int ROW = ld<HD>();         // elements per shared-memory tile row (padded)
  static constexpr size_t ALIGN_BYTES = 0;     // shared memory the launch adds to align the tiles
  __device__ static bf16* tiles(unsigned char* smem) { return reinterpret_cast<bf16*>(smem); }
  // how the tiles come in: every thread's cp.async copies, from the tensors' pointers
  using Tensors = TilePointers;
  using Tiles = CopiedTiles<HD>;
  __device__ static Tiles tiles_of(const Tensors& t, int b, int h, int T, int H, uint64_t* /*the TMA form's barriers*/) {
    return {t, b, h, T, H};
  }
  static Tensors tensors(const char*, const bf16* qkv, const bf16* dout, int, int, int) { return {qkv, dout}; }
  // s1 = A1 · X1ᵀ, s2 = A2 · X2ᵀ for this warp's 16-row strip of the 64-row tiles A1, A2 (8NB rows of X)
  template <int NB>
  __device__ static void scores_t(float (&s1)[NB][4], const bf16* A1, const bf16* X1, float (&s2)[NB][4],
                                  const bf16* A2, const bf16* X2) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    strip_times_tile_t<HD, NB>(s1, A1 + warp * 16 * ROW, X1, lane);
    strip_times_tile_t<HD, NB>(s2, A2 + warp * 16 * ROW, X2, lane);
  }
  template <typename... Products>
  __device__ static void accumulate(const Products&... products) {
    (c_strip_times_tile<HD, Products::NB>(&products.acc, &products.p, products.Y, threadIdx.x % 32), ...);
  }
};

#if defined(FLATMOE_WGMMA)
struct WgmmaProducts {
  static constexpr const char* FORM = "wgmma";
  static constexpr int ROW = WG_HD;          // unpadded 128-byte rows in the 128-byte swizzle
  static constexpr size_t ALIGN_BYTES = 1024;
  __device__ static bf16* tiles(unsigned char* smem) { return aligned_tiles(smem); }
  // how the tiles come in: the TMA's copies, through the tensors' maps
  using Tensors = TmaMaps;
  using Tiles = TmaTiles;
  __device__ static Tiles tiles_of(const Tensors& t, int b, int h, int /*T: the maps'*/, int H, uint64_t* full) {
    return {t, b, h, H, full};
  }
  static Tensors tensors(const char* op, const bf16* qkv, const bf16* dout, int B, int T, int nh) {
    return tma_maps(op, qkv, dout, B, T, nh);
  }
  // s1 = A1 · X1ᵀ, s2 = A2 · X2ᵀ for the warpgroup's 64 rows: one group of MMAs, waited for
  template <int NB>
  __device__ static void scores_t(float (&s1)[NB][4], const bf16* A1, const bf16* X1, float (&s2)[NB][4],
                                  const bf16* A2, const bf16* X2) {
    static_assert(NB == 8, "the wgmma kernels' score tiles are 64 × 64");
    wgmma_fence();
    wgmma_tile_times_tile_t(s1, A1, X1);
    wgmma_tile_times_tile_t(s2, A2, X2);
    wgmma_commit();
    wgmma_wait<0>();
    wgmma_fence_operands(s1);
    wgmma_fence_operands(s2);
  }
  // every product's MMAs in one group, waited for; P as register A fragments
  template <typename... Products>
  __device__ static void accumulate(const Products&... products) {
    static_assert(((Products::NB == 8) && ...), "the wgmma kernels' P tiles are 64 × 64");
    uint32_t pf[sizeof...(Products)][4][4];
    int i = 0;
    ((c_to_a_all(pf[i++], products.p)), ...);
    (wgmma_fence_operands(products.acc), ...);
    wgmma_fence();
    i = 0;
    (wgmma_fragments_times_tile(products.acc, pf[i++], products.Y), ...);
    wgmma_commit();
    wgmma_wait<0>();
    (wgmma_fence_operands(products.acc), ...);
#pragma unroll
    for (auto& fragments : pf) wgmma_fence_operands(fragments);
  }

 private:
  __device__ static void c_to_a_all(uint32_t (&pf)[4][4], const float (&p)[8][4]) {
#pragma unroll
    for (int j = 0; j < 4; j++) c_to_a<8>(pf[j], p, j);
  }
};
#endif  // FLATMOE_WGMMA

// grid (nh, B, ceil(T/64)); block 128. dK and dV of one 64-key tile of one head; warp w owns
// keys k0 + 16w … k0 + 16w + 15.
template <int HD, class Products>
__global__ void __launch_bounds__(THREADS)
    backward_dkdv_kernel(bf16* dqkv, const __grid_constant__ typename Products::Tensors tensors, const float* lse,
                         const float* delta, int T, int nh, const RopeAngles rope) {
  constexpr int ROW = Products::ROW, TE = TILE * ROW;
  constexpr int QC = HD == 128 ? 32 : 64;  // query columns per Sᵀ chunk
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* K_s = Products::tiles(smem_raw);                    // [64][ROW]
  bf16* V_s = K_s + TE;                                     // [64][ROW]
  bf16* Q_s = V_s + TE;                                     // [2][64][ROW]
  bf16* dO_s = Q_s + 2 * TE;                                // [2][64][ROW]
  float* lse_s = reinterpret_cast<float*>(dO_s + 2 * TE);  // [2][64]  lse·log2(e) of the query tile
  float* delta_s = lse_s + 2 * TILE;                        // [2][64]
  __shared__ uint64_t full[2];                              // the TMA form's stage barriers
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.x, b = blockIdx.y;
  const int kt = blockIdx.z;  // key tile 0 (most query tiles) first
  const int q_tiles = gridDim.z;
  const int k0 = kt * TILE;
  const int H = nh * HD;
  const float* lse_bh = lse + ((size_t)b * nh + h) * T;
  const float* delta_bh = delta + ((size_t)b * nh + h) * T;
  const float scale_log2 = LOG2E / sqrtf((float)HD);
  const typename Products::Tiles tiles = Products::tiles_of(tensors, b, h, T, H, full);

  // Stages query tile qt (Q, dO as tiles; lse, delta by plain loads) into buffer qt & 1.
  auto stage = [&](int qt) {
    const int q0 = qt * TILE, valid = min(TILE, T - q0), buf = qt & 1;
    tiles.tile(Q_s + buf * TE, Operand::Q, q0, buf);
    tiles.tile(dO_s + buf * TE, Operand::dO, q0, buf);
    tiles.commit(buf);
    for (int i = threadIdx.x; i < TILE; i += THREADS) {
      lse_s[buf * TILE + i] = i < valid ? lse_bh[q0 + i] * LOG2E : 0.f;
      delta_s[buf * TILE + i] = i < valid ? delta_bh[q0 + i] : 0.f;
    }
  };
  tiles.init();
  tiles.tile(K_s, Operand::K, k0, kt & 1);
  tiles.tile(V_s, Operand::V, k0, kt & 1);
  stage(kt);

  float dk[HD / 8][4] = {}, dv[HD / 8][4] = {};  // keys (rows) key0, key0 + 8; columns 8nb + 2t, +1
  const int key0 = k0 + warp * 16 + g;

  for (int qt = kt; qt < q_tiles; qt++) {
    tiles.wait(qt & 1, ((qt - kt) >> 1) & 1);
    __syncthreads();  // query tile qt is in, its lse and delta too; every warp is done with the buffer of qt − 1
    if (qt + 1 < q_tiles) stage(qt + 1);
    const int buf = qt & 1, q0 = qt * TILE;
    const bf16* Qt = Q_s + buf * TE;
    const bf16* dOt = dO_s + buf * TE;

    // The query tile in chunks of QC columns (one chunk for hd 64; two for hd 128, where
    // dK, dV take 128 registers and a 64-column Sᵀ, dPᵀ would spill).
#pragma unroll 1
    for (int c0 = 0; c0 < TILE; c0 += QC) {
      float st[QC / 8][4], dpt[QC / 8][4];  // [nb][e]: key key0 + 8(e/2), query q0 + c0 + 8nb + 2t + (e%2)
      Products::template scores_t<QC / 8>(st, K_s, Qt + c0 * ROW, dpt, V_s, dOt + c0 * ROW);  // Sᵀ = K Qᵀ, dPᵀ = V dOᵀ
      const bool edge = qt == kt || q0 + TILE > T;  // causal diagonal or queries past T
      key_strip_grads<QC / 8>(st, dpt, lse_s + buf * TILE + c0, delta_s + buf * TILE + c0, q0 + c0, key0, edge, T,
                              scale_log2, t);
      Products::accumulate(FragmentsTimesTile<HD, QC / 8>{dv, st, dOt + c0 * ROW},   // dV += Pᵀ dO
                           FragmentsTimesTile<HD, QC / 8>{dk, dpt, Qt + c0 * ROW});  // dK += dSᵀ Q
    }
  }

  const size_t stride = 3 * (size_t)H;                                 // of dqkv, laid out as qkv
  bf16* dk_rows = dqkv + (size_t)b * T * stride + H + (size_t)h * HD;  // dk of (b, t = 0, h)
  store_strip<HD>(dk_rows, stride, dk, key0, T, 1.f / sqrtf((float)HD), t, rope);
  store_strip<HD>(dk_rows + H, stride, dv, key0, T, 1.f, t, RopeAngles{});
}

// grid (nh, B, ceil(T/64)); block 128. dQ of one 64-query tile of one head.
template <int HD, class Products>
__global__ void __launch_bounds__(THREADS)
    backward_dq_kernel(bf16* dqkv, const __grid_constant__ typename Products::Tensors tensors, const float* lse,
                       const float* delta, int T, int nh, const RopeAngles rope) {
  constexpr int TE = TILE * Products::ROW;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ uint64_t full[2];  // the TMA form's stage barriers
  bf16* Q_s = Products::tiles(smem_raw);  // [64][ROW]
  bf16* dO_s = Q_s + TE;                  // [64][ROW]
  bf16* K_s = dO_s + TE;                  // [2][64][ROW]
  bf16* V_s = K_s + 2 * TE;               // [2][64][ROW]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int h = blockIdx.x, b = blockIdx.y;
  const int qt = gridDim.z - 1 - blockIdx.z;  // last query tile (most key tiles) first
  const int q0 = qt * TILE;
  const int H = nh * HD;
  const float scale_log2 = LOG2E / sqrtf((float)HD);
  const typename Products::Tiles tiles = Products::tiles_of(tensors, b, h, T, H, full);

  tiles.init();
  tiles.tile(Q_s, Operand::Q, q0, 0);
  tiles.tile(dO_s, Operand::dO, q0, 0);
  tiles.tile(K_s, Operand::K, 0, 0);
  tiles.tile(V_s, Operand::V, 0, 0);
  tiles.commit(0);

  const int row0 = q0 + warp * 16 + g;  // rows row0, row0 + 8
  float lse2[2], dlt[2];
  load_row_stats(lse2, dlt, lse + ((size_t)b * nh + h) * T, delta + ((size_t)b * nh + h) * T, row0, T);
  float dq[HD / 8][4] = {};

  for (int kt = 0; kt <= qt; kt++) {
    tiles.wait(kt & 1, (kt >> 1) & 1);
    __syncthreads();  // key tile kt is in; every warp is done with the buffer of kt − 1
    if (kt < qt) {
      const int next = (kt + 1) & 1;
      tiles.tile(K_s + next * TE, Operand::K, (kt + 1) * TILE, next);
      tiles.tile(V_s + next * TE, Operand::V, (kt + 1) * TILE, next);
      tiles.commit(next);
    }
    const bf16* Kt = K_s + (kt & 1) * TE;
    const bf16* Vt = V_s + (kt & 1) * TE;
    const int k0 = kt * TILE;

    float s[8][4], dp[8][4];  // [nb][e]: query row0 + 8(e/2), key k0 + 8nb + 2t + (e%2)
    Products::template scores_t<8>(s, Q_s, Kt, dp, dO_s, Vt);  // S = Q Kᵀ (unscaled), dP = dO Vᵀ
    query_strip_grads(s, dp, lse2, dlt, row0, k0, kt == qt, T, scale_log2, t);
    Products::accumulate(FragmentsTimesTile<HD, 8>{dq, dp, Kt});  // dQ += dS K
  }

  const size_t stride = 3 * (size_t)H;  // of dqkv, laid out as qkv
  store_strip<HD>(dqkv + (size_t)b * T * stride + (size_t)h * HD, stride, dq, row0, T, 1.f / sqrtf((float)HD), t,
                  rope);
}

// ---- shared-memory sizes ------------------------------------------------------------------

template <int HD, int MB>
inline size_t forward_smem() { return sizeof(bf16) * (MB + 4) * tile_elems<HD>(); }
// the backward kernels: 6 tiles (+ the dK/dV kernel's lse and delta), + the tiles' alignment
template <int HD, class Products>
inline size_t dkdv_smem() {
  return sizeof(bf16) * 6 * TILE * Products::ROW + sizeof(float) * 4 * TILE + Products::ALIGN_BYTES;
}
template <int HD, class Products>
inline size_t dq_smem() { return sizeof(bf16) * 6 * TILE * Products::ROW + Products::ALIGN_BYTES; }

// ---- launchers (sizes already checked by attention.cuh's attention_check_sizes) ------------

// Whether the tensor-core kernels take (hd, pointers): hd 64 or 128 and every bf16 tensor
// 16-byte aligned (cp.async moves 16-byte chunks; row strides 3H and H are multiples of 8).
inline bool supported(int hd, std::initializer_list<const void*> ptrs) {
  if (hd != 64 && hd != 128) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

template <typename Kernel>
inline void allow_smem(const char* op, Kernel kernel, size_t bytes, int B, int T, int nh, int hd) {
  cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes), op,
            "tensor cores: B=%d T=%d nh=%d hd=%d smem=%zu", B, T, nh, hd, bytes);
}

// The forward with MB query strips of 16 rows per warp (a block of 64·MB queries); forward() takes
// FORWARD_STRIPS<HD>. Any MB gives the same bits (the same products in the same order per row;
// GpuAttention.ForwardQueryTilesOf64And128GiveTheSameBits).
template <int HD, int MB>
inline void forward_hd(bf16* out, float* lse, const bf16* qkv, int B, int T, int nh, cudaStream_t stream) {
  const size_t smem = forward_smem<HD, MB>();
  allow_smem("attention_forward", forward_kernel<HD, MB>, smem, B, T, nh, HD);
  const dim3 grid(nh, B, ceil_div(T, TILE * MB));
  forward_kernel<HD, MB><<<grid, THREADS, smem, stream>>>(out, lse, qkv, T, nh);
  launchCheck("attention_forward", "tensor-core kernel: B=%d T=%d nh=%d hd=%d strips=%d", B, T, nh, HD, MB);
}

// The backward in either form (Products above): the dK/dV kernel, then the dQ kernel (RoPE's backward
// in their q and k stores when rope's table is set).
template <int HD, class Products>
inline void backward_hd(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta, int B,
                        int T, int nh, const RopeAngles& rope, cudaStream_t stream) {
  const dim3 grid(nh, B, ceil_div(T, TILE));
  const char* form = Products::FORM;
  const typename Products::Tensors tensors = Products::tensors("attention_backward", qkv, dout, B, T, nh);
  const size_t smem_dkdv = dkdv_smem<HD, Products>();
  allow_smem("attention_backward", backward_dkdv_kernel<HD, Products>, smem_dkdv, B, T, nh, HD);
  backward_dkdv_kernel<HD, Products><<<grid, THREADS, smem_dkdv, stream>>>(dqkv, tensors, lse, delta, T, nh, rope);
  launchCheck("attention_backward", "%s dK/dV kernel: B=%d T=%d nh=%d hd=%d", form, B, T, nh, HD);
  const size_t smem_dq = dq_smem<HD, Products>();
  allow_smem("attention_backward", backward_dq_kernel<HD, Products>, smem_dq, B, T, nh, HD);
  backward_dq_kernel<HD, Products><<<grid, THREADS, smem_dq, stream>>>(dqkv, tensors, lse, delta, T, nh, rope);
  launchCheck("attention_backward", "%s dQ kernel: B=%d T=%d nh=%d hd=%d", form, B, T, nh, HD);
}

#if defined(FLATMOE_WGMMA)
inline void forward_wgmma(bf16* out, float* lse, const bf16* qkv, int B, int T, int nh, cudaStream_t stream) {
  allow_smem("attention_forward", forward_wgmma_kernel<WG_HD>, WG_FORWARD_SMEM, B, T, nh, WG_HD);
  const dim3 grid(nh, B, ceil_div(T, TILE));
  const TmaMaps tensors = tma_maps("attention_forward", qkv, nullptr, B, T, nh);
  forward_wgmma_kernel<WG_HD><<<grid, THREADS, WG_FORWARD_SMEM, stream>>>(out, lse, tensors, T, nh);
  launchCheck("attention_forward", "wgmma kernel: B=%d T=%d nh=%d hd=%d", B, T, nh, WG_HD);
}

inline void backward_wgmma(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta, int B,
                           int T, int nh, const RopeAngles& rope, cudaStream_t stream) {
  backward_hd<WG_HD, WgmmaProducts>(dqkv, dout, qkv, lse, delta, B, T, nh, rope, stream);
}
#endif

// The mma.sync kernels at hd 64 or 128.
inline void forward(bf16* out, float* lse, const bf16* qkv, int B, int T, int nh, int hd, cudaStream_t stream) {
  if (hd == 64) forward_hd<64, FORWARD_STRIPS<64>>(out, lse, qkv, B, T, nh, stream);
  else if (hd == 128) forward_hd<128, FORWARD_STRIPS<128>>(out, lse, qkv, B, T, nh, stream);
  else fm_fail("attention_forward", "tensor-core kernels take hd 64 or 128", "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
}

inline void backward(bf16* dqkv, const bf16* dout, const bf16* qkv, const float* lse, const float* delta, int B, int T,
                     int nh, int hd, const RopeAngles& rope, cudaStream_t stream) {
  if (hd == 64) backward_hd<64, MmaSyncProducts<64>>(dqkv, dout, qkv, lse, delta, B, T, nh, rope, stream);
  else if (hd == 128) backward_hd<128, MmaSyncProducts<128>>(dqkv, dout, qkv, lse, delta, B, T, nh, rope, stream);
  else fm_fail("attention_backward", "tensor-core kernels take hd 64 or 128", "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
}

}  // namespace attn_mma

#endif  // FLATMOE_BF16
