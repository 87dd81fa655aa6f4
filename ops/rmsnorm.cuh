// rmsnorm.cuh — RMS normalisation with a learned gain (twin: ref/rmsnorm.hpp).
//
//   forward:  rstd[n] = 1 / sqrt(mean_j x[n,j]² + eps)     (fp32)             rstd (=)
//             out[n,j] = x[n,j] · rstd[n] · w[j]                              out (=)
//   backward: dx[n,j] = rstd[n] · (w[j]·dout[n,j] − x[n,j] · rstd[n]² · mean_i(dout[n,i]·w[i]·x[n,i]))
//                                                                              dx (=)
//             dw[j] += Σ_n dout[n,j] · x[n,j] · rstd[n]                       dw (+=)
//
// Shapes: x, out, dout, dx [N, H] floatX; w, dw [H] floatX; rstd [N] float. Sums in fp32.
// Memory-bound: each thread reads and writes 16-byte pieces of a row when H is a multiple of
// ROW_PIECE and the buffers are aligned for it (common.cuh), and single elements otherwise; the two
// paths sum a row's products in different orders (both within fp32 rounding of the reference).
//
// Determinism: forward reduces each row in one warp (xor butterfly: every lane gets the same
// value). Backward splits the rows into G = ceil(N / rows_per_block) contiguous chunks, one block
// each (G <= RMSNORM_BACKWARD_MAX_BLOCKS); a block walks its rows in order, keeps its dw partial
// in shared memory (the columns of piece c are owned by thread c mod blockDim, so no two threads
// touch one),
// and writes it to a [G, H] fp32 Workspace buffer; a second kernel adds the G partials of each
// column in block order into dw. G depends on N only, and the block size and the pieces (below) on H
// and on whether the buffers are 16-byte aligned, so the result is bit-reproducible.
//
// Memory: backward takes G·H·4 bytes of Workspace (<= 1024·H·4) for the duration of the call
// (freed when the launcher returns; the kernels are ordered on `stream`).
// Limits: backward needs H·4 bytes of shared memory per block (H <= ~57000 on sm_90).
#pragma once
#include <algorithm>
#include "common.cuh"
#include "../runtime/pool.cuh"

static const int RMSNORM_BACKWARD_MAX_BLOCKS = 1024;

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

// One block per chunk of rows_per_block consecutive rows; dynamic shared memory: H floats.
template <int NV, typename T>
__global__ void rmsnorm_backward_kernel(T* dx, float* dw_partials /*G,H*/, const T* dout, const T* x,
                                        const T* w, const float* rstd, int N, int H, int rows_per_block) {
  using P = Pack<T, NV>;
  extern __shared__ float dw_acc[];  // [H], the columns of piece c owned by thread c % blockDim.x
  __shared__ float warp_sums[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32, pieces = H / NV;
  const P* wp = reinterpret_cast<const P*>(w);
  for (int c = threadIdx.x; c < pieces; c += blockDim.x)
    for (int e = 0; e < NV; e++) dw_acc[c * NV + e] = 0.f;
  int row_begin = blockIdx.x * rows_per_block;
  int row_end = min(N, row_begin + rows_per_block);
  for (int row = row_begin; row < row_end; row++) {
    const P* xr = reinterpret_cast<const P*>(x + (size_t)row * H);
    const P* dyr = reinterpret_cast<const P*>(dout + (size_t)row * H);
    float r = rstd[row];
    float dot = 0.f;  // Σ_i dout·w·x over this row
    for (int c = threadIdx.x; c < pieces; c += blockDim.x) {
      const P xv = xr[c], dv = dyr[c], wv = wp[c];
#pragma unroll
      for (int e = 0; e < NV; e++) dot += to_float(dv.v[e]) * to_float(wv.v[e]) * to_float(xv.v[e]);
    }
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
    if (lane == 0) warp_sums[warp] = dot;
    __syncthreads();
    float row_dot = 0.f;
    for (int i = 0; i < num_warps; i++) row_dot += warp_sums[i];
    __syncthreads();  // warp_sums is rewritten by the next row
    float coef = r * r * row_dot / (float)H;
    P* dxr = reinterpret_cast<P*>(dx + (size_t)row * H);
    for (int c = threadIdx.x; c < pieces; c += blockDim.x) {
      const P xv = xr[c], dv = dyr[c], wv = wp[c];
      P o;
#pragma unroll
      for (int e = 0; e < NV; e++) {
        const float xe = to_float(xv.v[e]), dye = to_float(dv.v[e]);
        o.v[e] = from_float<T>(r * (to_float(wv.v[e]) * dye - xe * coef));
        dw_acc[c * NV + e] += dye * xe * r;
      }
      dxr[c] = o;
    }
  }
  for (int c = threadIdx.x; c < pieces; c += blockDim.x)
    for (int e = 0; e < NV; e++) dw_partials[(size_t)blockIdx.x * H + c * NV + e] = dw_acc[c * NV + e];
}

// dw[j] += Σ_{g = 0..G-1} dw_partials[g, j], in g order.
template <typename T>
__global__ void rmsnorm_dw_reduce_kernel(T* dw, const float* dw_partials, int G, int H) {
  int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= H) return;
  float s = 0.f;
  for (int g = 0; g < G; g++) s += dw_partials[(size_t)g * H + c];
  dw[c] = from_float<T>(to_float(dw[c]) + s);
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

// The backward kernel on G blocks of as many threads as a row has pieces (a multiple of 32, at most 256).
template <int NV>
inline void rmsnorm_backward_launch(floatX* dx, float* dw_partials, const floatX* dout, const floatX* x, const floatX* w,
                                    const float* rstd, int N, int H, int G, int rows_per_block, cudaStream_t stream) {
  const int threads = std::min(256, 32 * ceil_div(H / NV, 32));
  const size_t smem = (size_t)H * sizeof(float);
  if (smem > 48 * 1024)
    cudaCheck(cudaFuncSetAttribute(rmsnorm_backward_kernel<NV, floatX>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
              "rmsnorm_backward", "N=%d H=%d shared=%zu bytes", N, H, smem);
  rmsnorm_backward_kernel<NV><<<G, threads, smem, stream>>>(dx, dw_partials, dout, x, w, rstd, N, H, rows_per_block);
}

// dx [N, H] (=), dw [H] (+=); rstd [N] from rmsnorm_forward.
inline void rmsnorm_backward(floatX* dx, floatX* dw, const floatX* dout, const floatX* x, const floatX* w,
                             const float* rstd, int N, int H, cudaStream_t stream) {
  if (N == 0) return;
  if (H <= 0) fm_fail("rmsnorm_backward", "H must be positive", "N=%d H=%d", N, H);
  int rows_per_block = ceil_div(N, RMSNORM_BACKWARD_MAX_BLOCKS);
  int G = ceil_div(N, rows_per_block);
  DeviceBuffer<float> dw_partials((size_t)G * H, Mem::Workspace, "rmsnorm.dw_partials");
  if (row_pieces(H, {dx, dout, x, w}))
    rmsnorm_backward_launch<ROW_PIECE>(dx, dw_partials.ptr, dout, x, w, rstd, N, H, G, rows_per_block, stream);
  else
    rmsnorm_backward_launch<1>(dx, dw_partials.ptr, dout, x, w, rstd, N, H, G, rows_per_block, stream);
  launchCheck("rmsnorm_backward", "N=%d H=%d G=%d", N, H, G);
  rmsnorm_dw_reduce_kernel<<<ceil_div(H, 256), 256, 0, stream>>>(dw, dw_partials.ptr, G, H);
  launchCheck("rmsnorm_backward.dw_reduce", "N=%d H=%d G=%d", N, H, G);
}
