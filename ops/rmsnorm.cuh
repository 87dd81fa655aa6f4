// rmsnorm.cuh — RMS normalisation with a learned gain (twin: ref/rmsnorm.hpp).
//
//   forward:  rstd[n] = 1 / sqrt(mean_j x[n,j]² + eps)     (fp32)             rstd (=)
//             out[n,j] = x[n,j] · rstd[n] · w[j]                              out (=)
//   backward: dx[n,j] = rstd[n] · (w[j]·dout[n,j] − x[n,j] · rstd[n]² · mean_i(dout[n,i]·w[i]·x[n,i]))
//                                                                              dx (=)
//             dw[j] += Σ_n dout[n,j] · x[n,j] · rstd[n]                       dw (+=)
//
// Shapes: x, out, dout, dx [N, H] floatX; w, dw [H] floatX; rstd [N] float. Sums in fp32.
//
// Determinism: forward reduces each row in one warp (xor butterfly: every lane gets the same
// value). Backward splits the rows into G = ceil(N / rows_per_block) contiguous chunks, one block
// each (G <= RMSNORM_BACKWARD_MAX_BLOCKS); a block walks its rows in order, keeps its dw partial
// in shared memory (column j is owned by thread j mod blockDim, so no two threads touch it),
// and writes it to a [G, H] fp32 Workspace buffer; a second kernel adds the G partials of each
// column in block order into dw. G depends on N only, so the result is bit-reproducible.
//
// Memory: backward takes G·H·4 bytes of Workspace (<= 1024·H·4) for the duration of the call
// (freed when the launcher returns; the kernels are ordered on `stream`).
// Limits: backward needs H·4 bytes of shared memory per block (H <= ~57000 on sm_90).
#pragma once
#include "common.cuh"
#include "../runtime/pool.cuh"

static const int RMSNORM_BACKWARD_MAX_BLOCKS = 1024;

// ---------------------------------------------------------------------------------------------
// Kernels

// One warp per row.
template <typename T>
__global__ void rmsnorm_forward_kernel(T* out, float* rstd, const T* x, const T* w, int N, int H, float eps) {
  int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  int lane = threadIdx.x % 32;
  if (row >= N) return;  // whole warps leave together
  const T* xr = x + (size_t)row * H;
  float sumsq = 0.f;
  for (int c = lane; c < H; c += 32) {
    float v = to_float(xr[c]);
    sumsq += v * v;
  }
  for (int o = 16; o > 0; o >>= 1) sumsq += __shfl_xor_sync(0xffffffff, sumsq, o);
  float r = 1.0f / sqrtf(sumsq / (float)H + eps);
  T* outr = out + (size_t)row * H;
  for (int c = lane; c < H; c += 32) outr[c] = from_float<T>(to_float(xr[c]) * r * to_float(w[c]));
  if (lane == 0) rstd[row] = r;
}

// One block per chunk of rows_per_block consecutive rows; dynamic shared memory: H floats.
template <typename T>
__global__ void rmsnorm_backward_kernel(T* dx, float* dw_partials /*G,H*/, const T* dout, const T* x,
                                        const T* w, const float* rstd, int N, int H, int rows_per_block) {
  extern __shared__ float dw_acc[];  // [H], column j owned by thread j % blockDim.x
  __shared__ float warp_sums[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  for (int c = threadIdx.x; c < H; c += blockDim.x) dw_acc[c] = 0.f;
  int row_begin = blockIdx.x * rows_per_block;
  int row_end = min(N, row_begin + rows_per_block);
  for (int row = row_begin; row < row_end; row++) {
    const T* xr = x + (size_t)row * H;
    const T* dyr = dout + (size_t)row * H;
    float r = rstd[row];
    float dot = 0.f;  // Σ_i dout·w·x over this row
    for (int c = threadIdx.x; c < H; c += blockDim.x) dot += to_float(dyr[c]) * to_float(w[c]) * to_float(xr[c]);
    for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
    if (lane == 0) warp_sums[warp] = dot;
    __syncthreads();
    float row_dot = 0.f;
    for (int i = 0; i < num_warps; i++) row_dot += warp_sums[i];
    __syncthreads();  // warp_sums is rewritten by the next row
    float coef = r * r * row_dot / (float)H;
    T* dxr = dx + (size_t)row * H;
    for (int c = threadIdx.x; c < H; c += blockDim.x) {
      float xv = to_float(xr[c]);
      float dyv = to_float(dyr[c]);
      dxr[c] = from_float<T>(r * (to_float(w[c]) * dyv - xv * coef));
      dw_acc[c] += dyv * xv * r;
    }
  }
  for (int c = threadIdx.x; c < H; c += blockDim.x) dw_partials[(size_t)blockIdx.x * H + c] = dw_acc[c];
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

// out [N, H] (=), rstd [N] (=).
inline void rmsnorm_forward(floatX* out, float* rstd, const floatX* x, const floatX* w, int N, int H, float eps,
                            cudaStream_t stream) {
  if (N == 0) return;
  if (H <= 0) fm_fail("rmsnorm_forward", "H must be positive", "N=%d H=%d", N, H);
  const int threads = 256, rows_per_launch_block = threads / 32;
  rmsnorm_forward_kernel<<<ceil_div(N, rows_per_launch_block), threads, 0, stream>>>(out, rstd, x, w, N, H, eps);
  launchCheck("rmsnorm_forward", "N=%d H=%d", N, H);
}

// dx [N, H] (=), dw [H] (+=); rstd [N] from rmsnorm_forward.
inline void rmsnorm_backward(floatX* dx, floatX* dw, const floatX* dout, const floatX* x, const floatX* w,
                             const float* rstd, int N, int H, cudaStream_t stream) {
  if (N == 0) return;
  if (H <= 0) fm_fail("rmsnorm_backward", "H must be positive", "N=%d H=%d", N, H);
  const int threads = 256;
  int rows_per_block = ceil_div(N, RMSNORM_BACKWARD_MAX_BLOCKS);
  int G = ceil_div(N, rows_per_block);
  size_t smem = (size_t)H * sizeof(float);
  if (smem > 48 * 1024)
    cudaCheck(cudaFuncSetAttribute(rmsnorm_backward_kernel<floatX>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem),
              "rmsnorm_backward", "N=%d H=%d shared=%zu bytes", N, H, smem);
  DeviceBuffer<float> dw_partials((size_t)G * H, Mem::Workspace, "rmsnorm.dw_partials");
  rmsnorm_backward_kernel<<<G, threads, smem, stream>>>(dx, dw_partials.ptr, dout, x, w, rstd, N, H, rows_per_block);
  launchCheck("rmsnorm_backward", "N=%d H=%d G=%d", N, H, G);
  rmsnorm_dw_reduce_kernel<<<ceil_div(H, threads), threads, 0, stream>>>(dw, dw_partials.ptr, G, H);
  launchCheck("rmsnorm_backward.dw_reduce", "N=%d H=%d G=%d", N, H, G);
}
