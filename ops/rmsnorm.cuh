// rmsnorm.cuh — RMS normalisation with a learned gain (twin: ref/rmsnorm.hpp).
//
//   forward:  rstd[n] = 1 / sqrt(mean_j x[n,j]² + eps)     (fp32)             rstd (=)
//             out[n,j] = x[n,j] · rstd[n] · w[j]                              out (=)
//   backward: dx[n,j] = rstd[n] · (w[j]·dout[n,j] − x[n,j] · rstd[n]² · mean_i(dout[n,i]·w[i]·x[n,i]))
//                                                                              dx (=, or += asked:
//                                                        the residual stream's gradient, one rounding)
//             dw[j] += Σ_n dout[n,j] · x[n,j] · rstd[n]                       dw (+=)
//
// Shapes: x, out, dout, dx [N, H] floatX; w, dw [H] floatX; rstd [N] float. Sums in fp32.
// Memory-bound: each thread reads and writes 16-byte pieces of a row when H is a multiple of
// ROW_PIECE and the buffers are aligned for it (common.cuh), and single elements otherwise; the two
// paths sum a row's products in different orders (both within fp32 rounding of the reference).
//
// Schedule: forward and backward reduce each row in one warp (xor butterfly: every lane gets the
// same value, no block barrier); lane l takes pieces l, l + 32, l + 64, ... of the row.
// Backward (rmsnorm_backward_plan): blocks of W warps, W the most, up to 8, whose dw partials fit
// RMSNORM_BACKWARD_SHARED_BYTES (64 KiB), at least 1. The rows are split into G contiguous chunks of
// rows_per_block = max(W, ceil(N / 512)) rows, one block each, so that G <= 512
// (RMSNORM_BACKWARD_MAX_BLOCKS) and every warp walks at least one row (but in the last block). Warp w
// takes rows w, w + W, w + 2W, ... of its block's chunk, in that order, and adds dout·x·rstd into its
// own dw partial in shared memory (the columns of the pieces its lanes own). At the end the block adds
// its W partials, in warp order, into row g of a [G, H] fp32 Workspace buffer; a second kernel adds
// the G rows of each column into dw (32 warps per 32 columns, each warp every 32nd row in ascending
// order, 4 loads in flight, then the warps in order). At N = 16384, H = 1024 (B1): W = 8, 32 rows per
// block, G = 512. At N = 4096, H = 384 (the default model): W = 8, 8 rows per block (one per warp),
// G = 512; with at least 4 rows per warp, as before, it had G = 128, a block per SM and 8 warps in
// flight, and took 12.3 µs a call against 7.9 (notes/speed.md, 'The memory-bound kernels').
//
// Determinism: W, rows_per_block and G depend on N, H and the path (pieces or elements) only, and
// every sum runs in a fixed order, so a replay is bit-identical.
//
// Memory: backward takes G·H·4 bytes of Workspace (G <= 512, so <= 512·H·4) for the duration of the
// call (freed when the launcher returns; the kernels are ordered on `stream`) — or, with a
// weight-gradient stream (runtime/side_stream.cuh), where the reduction into dw then runs, until the
// caller joins that stream (rmsnorm_backward_workspace_bytes bounds it).
// Limits: backward needs W·S·4 bytes of shared memory per block, S = H rounded up to a whole number of
// 32-piece rounds; with W = 1 that is H·4 bytes and a little more (H <= ~58000 on sm_90).
#pragma once
#include <algorithm>
#include "common.cuh"
#include "../runtime/pool.cuh"
#include "../runtime/side_stream.cuh"

static const int RMSNORM_BACKWARD_MAX_BLOCKS = 512;          // G: the rows of the dw_partials Workspace
static const int RMSNORM_BACKWARD_MAX_WARPS = 8;             // W: warps per block
static const int RMSNORM_BACKWARD_ROWS_PER_WARP = 1;         // the fewest rows a warp walks (but in the last block)
static const int RMSNORM_BACKWARD_SHARED_BYTES = 64 * 1024;  // a block's dw partials (unless one warp's pass it)

// ---------------------------------------------------------------------------------------------
// Kernels. Each thread takes a row's elements in pieces of NV consecutive ones (common.cuh: NV =
// ROW_PIECE, 16 bytes, when H and the buffers allow; else 1): piece c is elements [c·NV, c·NV + NV).

// One warp per row.
template <int NV, typename T>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* x, const T* w, int N, int H, float eps) {
  using P = Pack<T, NV>;
  const int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x % 32, pieces = H / NV;
  if (row >= N) return;  // whole warps leave together
  const P* xr = reinterpret_cast<const P*>(x + (size_t)row * H);
  float sumsq = 0.f;
  for (int c = lane; c < pieces; c += 32) {
    const P v = xr[c];
#pragma unroll
    for (int e = 0; e < NV; e++) sumsq += to_float(v.v[e]) * to_float(v.v[e]);
  }
  for (int o = 16; o > 0; o >>= 1) sumsq += __shfl_xor_sync(0xffffffff, sumsq, o);
  const float r = 1.0f / sqrtf(sumsq / (float)H + eps);
  P* outr = reinterpret_cast<P*>(out + (size_t)row * H);
  for (int c = lane; c < pieces; c += 32) {
    const P v = xr[c], g = reinterpret_cast<const P*>(w)[c];
    P o;
#pragma unroll
    for (int e = 0; e < NV; e++) o.v[e] = from_float<T>(to_float(v.v[e]) * r * to_float(g.v[e]));
    outr[c] = o;
  }
  if (lane == 0) rstd[row] = r;
}

// One warp per row. Block g takes rows [g·rows_per_block, (g+1)·rows_per_block), its warp w the rows
// w, w + W, w + 2W, ... of them in order. Dynamic shared memory: W·warp_slots floats, warp w's dw partial
// from float w·warp_slots on; in it element e of piece l + 32k (k-th round of lane l) is at slot
// (k·NV + e)·32 + l, so that a warp's 32 lanes touch 32 consecutive floats (one per bank), and no slot
// is touched by two lanes (no barrier until the block adds its warps' partials).
template <int NV, typename T>
__global__ void rmsnorm_backward_kernel(T* dx, float* dw_partials /*G,H*/, const T* dout, const T* x, const T* w,
                                        const float* rstd, int N, int H, int rows_per_block, int warp_slots,
                                        bool accumulate) {
  using P = Pack<T, NV>;
  extern __shared__ float dw_acc[];  // [W, warp_slots]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32, pieces = H / NV;
  const P* wp = reinterpret_cast<const P*>(w);
  float* lane_acc = dw_acc + warp * warp_slots + lane;  // this lane's slots: every 32nd float
  for (int s = 0; s < warp_slots; s += 32) lane_acc[s] = 0.f;
  const int row_begin = blockIdx.x * rows_per_block;
  const int row_end = min(N, row_begin + rows_per_block);
  for (int row = row_begin + warp; row < row_end; row += num_warps) {
    const P* xr = reinterpret_cast<const P*>(x + (size_t)row * H);
    const P* dyr = reinterpret_cast<const P*>(dout + (size_t)row * H);
    const float r = rstd[row];
    float dot = 0.f;  // Σ_i dout·w·x over this row
    for (int c = lane; c < pieces; c += 32) {
      const P xv = xr[c], dv = dyr[c], wv = wp[c];
#pragma unroll
      for (int e = 0; e < NV; e++) dot += to_float(dv.v[e]) * to_float(wv.v[e]) * to_float(xv.v[e]);
    }
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
    const float coef = r * r * dot / (float)H;
    P* dxr = reinterpret_cast<P*>(dx + (size_t)row * H);
    for (int c = lane; c < pieces; c += 32) {
      const P xv = xr[c], dv = dyr[c], wv = wp[c];
      float* acc = lane_acc + (c / 32) * NV * 32;  // element e of piece c at acc[e·32]
      P o;
      if (accumulate) o = dxr[c];
#pragma unroll
      for (int e = 0; e < NV; e++) {
        const float xe = to_float(xv.v[e]), dye = to_float(dv.v[e]);
        float g = r * (to_float(wv.v[e]) * dye - xe * coef);
        if (accumulate) g += to_float(o.v[e]);
        o.v[e] = from_float<T>(g);
        acc[e * 32] += dye * xe * r;
      }
      dxr[c] = o;
    }
  }
  __syncthreads();
  for (int j = threadIdx.x; j < H; j += blockDim.x) {  // column j: element j % NV of piece j / NV
    const int c = j / NV, slot = ((c / 32) * NV + j % NV) * 32 + c % 32;
    float sum = 0.f;
    for (int i = 0; i < num_warps; i++) sum += dw_acc[i * warp_slots + slot];
    dw_partials[(size_t)blockIdx.x * H + j] = sum;
  }
}

// dw[j] += Σ_g dw_partials[g, j]. One block of RMSNORM_REDUCE_WARPS warps per 32 columns (lane =
// column, so each load is 128 coalesced bytes): warp w sums the rows g ≡ w (mod RMSNORM_REDUCE_WARPS)
// in ascending g (the loads of 4 rows issued before their adds), then the warps' sums are added in
// warp order. A fixed order for given G and H.
static const int RMSNORM_REDUCE_WARPS = 32;
template <typename T>
__global__ void rmsnorm_dw_reduce_kernel(T* dw, const float* dw_partials, int G, int H) {
  __shared__ float warp_sums[RMSNORM_REDUCE_WARPS][32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c = blockIdx.x * 32 + lane;
  float s = 0.f;
  if (c < H)
#pragma unroll 4
    for (int g = warp; g < G; g += RMSNORM_REDUCE_WARPS) s += dw_partials[(size_t)g * H + c];
  warp_sums[warp][lane] = s;
  __syncthreads();
  if (warp != 0 || c >= H) return;
  float total = 0.f;
  for (int i = 0; i < RMSNORM_REDUCE_WARPS; i++) total += warp_sums[i][lane];
  dw[c] = from_float<T>(to_float(dw[c]) + total);
}

// ---------------------------------------------------------------------------------------------
// Launchers

template <int NV>
inline void rmsnorm_forward_launch(floatX* out, float* rstd, const floatX* x, const floatX* w, int N, int H, float eps,
                                   cudaStream_t stream) {
  const int threads = 256, rows_per_launch_block = threads / 32;
  rmsnorm_forward_kernel<NV><<<ceil_div(N, rows_per_launch_block), threads, 0, stream>>>(out, rstd, x, w, N, H, eps);
}

// out [N, H] (=), rstd [N] (=).
inline void rmsnorm_forward(floatX* out, float* rstd, const floatX* x, const floatX* w, int N, int H, float eps,
                            cudaStream_t stream) {
  if (N == 0) return;
  if (H <= 0) fm_fail("rmsnorm_forward", "H must be positive", "N=%d H=%d", N, H);
  if (row_pieces(H, {out, x, w})) rmsnorm_forward_launch<ROW_PIECE>(out, rstd, x, w, N, H, eps, stream);
  else rmsnorm_forward_launch<1>(out, rstd, x, w, N, H, eps, stream);
  launchCheck("rmsnorm_forward", "N=%d H=%d", N, H);
}

// The backward's schedule (header comment): a function of N, H and the piece width NV only.
struct RmsNormBackwardPlan {
  int warp_slots;      // floats of one warp's dw partial: 32·NV per round of 32 pieces, ceil(H / NV / 32) rounds
  int warps;           // W, per block
  int rows_per_block;  // consecutive rows of one block
  int blocks;          // G
};

inline RmsNormBackwardPlan rmsnorm_backward_plan(int N, int H, int NV) {
  RmsNormBackwardPlan p;
  p.warp_slots = 32 * NV * ceil_div(H / NV, 32);
  p.warps = std::clamp(RMSNORM_BACKWARD_SHARED_BYTES / (p.warp_slots * (int)sizeof(float)), 1, RMSNORM_BACKWARD_MAX_WARPS);
  p.rows_per_block = std::max(p.warps * RMSNORM_BACKWARD_ROWS_PER_WARP, ceil_div(N, RMSNORM_BACKWARD_MAX_BLOCKS));
  p.blocks = ceil_div(N, p.rows_per_block);
  return p;
}

// The Workspace bytes of rmsnorm_backward's dw partials at N rows of H (either path).
inline size_t rmsnorm_backward_workspace_bytes(int N, int H) {
  const int most = std::max(rmsnorm_backward_plan(N, H, 1).blocks, rmsnorm_backward_plan(N, H, ROW_PIECE).blocks);
  return (size_t)most * H * sizeof(float);
}

// The backward kernel on the plan's G blocks of W warps, then the reduction of its partials into dw
// (on weight_grads when given).
template <int NV>
inline void rmsnorm_backward_launch(floatX* dx, floatX* dw, const floatX* dout, const floatX* x, const floatX* w,
                                    const float* rstd, int N, int H, bool accumulate, cudaStream_t stream,
                                    SideStream* weight_grads) {
  const RmsNormBackwardPlan plan = rmsnorm_backward_plan(N, H, NV);
  float* dw_partials = pool().alloc_t<float>((size_t)plan.blocks * H, Mem::Workspace, "rmsnorm.dw_partials");
  const size_t smem = (size_t)plan.warps * plan.warp_slots * sizeof(float);
  if (smem > 48 * 1024)
    cudaCheck(cudaFuncSetAttribute(rmsnorm_backward_kernel<NV, floatX>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
              "rmsnorm_backward", "N=%d H=%d shared=%zu bytes", N, H, smem);
  rmsnorm_backward_kernel<NV><<<plan.blocks, 32 * plan.warps, smem, stream>>>(dx, dw_partials, dout, x, w, rstd, N, H,
                                                                              plan.rows_per_block, plan.warp_slots,
                                                                              accumulate);
  launchCheck("rmsnorm_backward", "N=%d H=%d G=%d W=%d", N, H, plan.blocks, plan.warps);
  side_run(weight_grads, stream, "rmsnorm_backward.dw_reduce", [&](cudaStream_t s) {
    rmsnorm_dw_reduce_kernel<<<ceil_div(H, 32), 32 * RMSNORM_REDUCE_WARPS, 0, s>>>(dw, dw_partials, plan.blocks, H);
    launchCheck("rmsnorm_backward.dw_reduce", "N=%d H=%d G=%d", N, H, plan.blocks);
  });
  side_hold(weight_grads, dw_partials);
}

// dx [N, H] (=, or += with accumulate: dx = floatX(float(dx) + the gradient), one rounding), dw [H]
// (+=); rstd [N] from rmsnorm_forward. dx must not overlap dout or x. weight_grads (nullptr: none):
// dw's reduction runs there, and its partials are held until the caller joins it.
inline void rmsnorm_backward(floatX* dx, floatX* dw, const floatX* dout, const floatX* x, const floatX* w,
                             const float* rstd, int N, int H, cudaStream_t stream, bool accumulate = false,
                             SideStream* weight_grads = nullptr) {
  if (N == 0) return;
  if (H <= 0) fm_fail("rmsnorm_backward", "H must be positive", "N=%d H=%d", N, H);
  if (row_pieces(H, {dx, dout, x, w}))
    rmsnorm_backward_launch<ROW_PIECE>(dx, dw, dout, x, w, rstd, N, H, accumulate, stream, weight_grads);
  else rmsnorm_backward_launch<1>(dx, dw, dout, x, w, rstd, N, H, accumulate, stream, weight_grads);
}
