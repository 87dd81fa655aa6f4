// common.cuh — what every operator shares: the activation type, its conversions, the GEMM types,
// small element-wise kernels, and reductions that are deterministic (fixed order, no float atomics)
// so that a resumed run replays bit for bit. Error checks live in runtime/check.cuh, the cuBLAS
// handle with its pooled workspace in runtime/pool.cuh.
//
// Precision (notes/design.md §3), chosen at compile time:
//   -DFLATMOE_BF16  floatX = __nv_bfloat16 (weights/activations); fp32 master weights, optimizer
//                   state, softmax/LSE/loss accumulation; cuBLAS computes in fp32.
//   (default)       floatX = float; every GEMM in pedantic FP32 (no TF32).
#pragma once
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include "../runtime/check.cuh"

#if defined(FLATMOE_BF16)
typedef __nv_bfloat16 floatX;
#define FLATMOE_PRECISION_NAME "BF16"
static const cudaDataType_t CUBLAS_FLOATX = CUDA_R_16BF;
#else
typedef float floatX;
#define FLATMOE_PRECISION_NAME "FP32"
static const cudaDataType_t CUBLAS_FLOATX = CUDA_R_32F;
#endif

// ---------------------------------------------------------------------------------------------
// Conversions between floatX and float inside kernels.

__device__ __host__ inline float to_float(float x) { return x; }
__device__ __host__ inline float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __host__ inline T from_float(float x);
template <> __device__ __host__ inline float from_float<float>(float x) { return x; }
template <> __device__ __host__ inline __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

inline int ceil_div(long long a, long long b) { return (int)((a + b - 1) / b); }

// 2^x in one MUFU.EX2 (ex2.approx.ftz: relative error below 2^-22, results below 2^-126 flush to 0,
// exp2(−inf) = 0). exp2f compiles to the non-ftz form, which adds the denormal scaling around it,
// and expf to a range reduction before it. The attention kernels issue one exponential per 256
// (forward, hd 64) tensor-core FLOPs and the cross-entropy two per logit, so the instruction count
// matters there.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// e^x as 2^(x·log2 e): one multiply and fast_exp2 (its range and error, and the product's rounding).
__device__ __forceinline__ float fast_exp(float x) { return fast_exp2(x * 1.4426950408889634f); }

// SwiGLU's activation of one element, a = silu(g) · u = g / (1 + e^−g) · u, in fp32 from the gate g
// (h1) and the up value u (h3) as stored. Both kernels that write a (ops/moe.cuh's SwiGLU forward, and
// its backward, which writes a over da) compute it by this one expression, so a has the same bits
// whichever wrote it (memcmp in tests/gpu_moe.cu, RowKernelsGiveTheSameBits…).
__device__ __forceinline__ float swiglu_value(float g, float u) { return g / (1.f + expf(-g)) * u; }

// The inclusive prefix sum of v over the 32 lanes of a warp (lane = threadIdx.x % 32), by shuffles:
// lane l gets v_0 + ... + v_l. Every lane of the warp must call it.
template <typename T>
__device__ __forceinline__ T warp_inclusive_scan(T v) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int d = 1; d < 32; d *= 2) {
    const T below = __shfl_up_sync(0xffffffffu, v, d);
    if (lane >= d) v += below;
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Rows moved in 16-byte pieces. A memory-bound kernel reaches HBM bandwidth only when each thread
// moves 16 bytes per access (one 2-byte access per thread keeps too few bytes in flight); so a
// kernel over rows of H floatX (or a flat array of n) takes ROW_PIECE = 16/sizeof(floatX) consecutive
// elements per thread when the rows are whole pieces and every buffer it touches is aligned for them,
// and one element per thread otherwise. An element-wise kernel gives the same bits either way; one that
// reduces along a row (RMSNorm, cross-entropy) sums in another order on each path.

static const int ROW_PIECE = 16 / (int)sizeof(floatX);  // floatX elements in 16 bytes

// N consecutive T, loaded and stored as one access (N·sizeof(T) bytes, aligned to that).
template <typename T, int N>
struct alignas(N * sizeof(T)) Pack {
  T v[N];
};

// true when `p` may be read as Pack<T, n>s: aligned to n·sizeof(T)
template <typename T>
inline bool pack_aligned(const T* p, int n) { return (reinterpret_cast<uintptr_t>(p) % (n * sizeof(T))) == 0; }

// true when rows of `width` floatX at these buffers can be taken in pieces of ROW_PIECE
inline bool row_pieces(int width, std::initializer_list<const floatX*> buffers) {
  if (width % ROW_PIECE != 0) return false;
  for (const floatX* b : buffers)
    if (!pack_aligned(b, ROW_PIECE)) return false;
  return true;
}

// The compute type of every GEMM: fp32 accumulation; pedantic in the FP32 build.
static const cublasComputeType_t CUBLAS_COMPUTE = CUBLAS_COMPUTE_32F;

// ---------------------------------------------------------------------------------------------
// Small element-wise kernels shared by the model.

// One thread per NV consecutive elements (NV = ROW_PIECE, or 1).
template <int NV, typename T, typename TB>
__global__ void add_kernel(T* out, const T* a, const TB* b, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n / NV) return;
  const Pack<T, NV> av = reinterpret_cast<const Pack<T, NV>*>(a)[i];
  const Pack<TB, NV> bv = reinterpret_cast<const Pack<TB, NV>*>(b)[i];
  Pack<T, NV> o;
#pragma unroll
  for (int e = 0; e < NV; e++) o.v[e] = from_float<T>(to_float(av.v[e]) + to_float(bv.v[e]));
  reinterpret_cast<Pack<T, NV>*>(out)[i] = o;
}

// out = a + b in fp32, rounded once to T (out may alias a or b); b may be fp32 beside T operands.
// In pieces of ROW_PIECE elements when n and the buffers allow.
template <typename T, typename TB>
inline void add_inplace_or_out(T* out, const T* a, const TB* b, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (n % ROW_PIECE == 0 && pack_aligned(out, ROW_PIECE) && pack_aligned(a, ROW_PIECE) && pack_aligned(b, ROW_PIECE))
    add_kernel<ROW_PIECE><<<ceil_div(n / ROW_PIECE, 256), 256, 0, stream>>>(out, a, b, n);
  else
    add_kernel<1><<<ceil_div(n, 256), 256, 0, stream>>>(out, a, b, n);
  launchCheck("add", "n=%zu", n);
}

// One thread per NV consecutive elements (NV = ROW_PIECE, or 1).
template <int NV, typename Tin, typename Tout>
__global__ void convert_kernel(Tout* out, const Tin* in, size_t n) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n / NV) return;
  const Pack<Tin, NV> v = reinterpret_cast<const Pack<Tin, NV>*>(in)[i];
  Pack<Tout, NV> o;
#pragma unroll
  for (int e = 0; e < NV; e++) o.v[e] = from_float<Tout>(to_float(v.v[e]));
  reinterpret_cast<Pack<Tout, NV>*>(out)[i] = o;
}

// out[i] = (Tout) in[i]; in pieces of ROW_PIECE elements when n and the buffers allow.
template <typename Tin, typename Tout>
inline void convert(Tout* out, const Tin* in, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (n % ROW_PIECE == 0 && pack_aligned(out, ROW_PIECE) && pack_aligned(in, ROW_PIECE))
    convert_kernel<ROW_PIECE><<<ceil_div(n / ROW_PIECE, 256), 256, 0, stream>>>(out, in, n);
  else
    convert_kernel<1><<<ceil_div(n, 256), 256, 0, stream>>>(out, in, n);
  launchCheck("convert", "n=%zu", n);
}

// ---------------------------------------------------------------------------------------------
// Deterministic sum of squares: fixed grid, fixed per-thread stride, fixed tree; the partial sums
// land in `partials` (SUMSQ_BLOCKS floats) and one block adds them in order into *out (=).
// Each thread loads a piece of SUMSQ_PIECE = 8 elements at a time (16 bytes of bf16, two 16-byte loads
// of fp32) when n is a multiple of the piece and x is aligned for it, else one element: the order of
// the sum, and so its low bits, depend on n and on x's alignment only, never on the run or the element
// type. So the sum over bf16 values and over their fp32 copies is the same float, bit for bit
// (model.cuh's gradient norm reads either).

static const int SUMSQ_BLOCKS = 264;
static const int SUMSQ_PIECE = 8;

// Thread k of the grid adds the squares of pieces k, k + grid, k + 2·grid, ... (NV elements each) in
// that order; its block's warps then reduce by xor butterfly and in warp order into partials[block].
template <int NV, typename T>
__global__ void sumsq_partial_kernel(float* partials, const T* x, size_t n) {
  __shared__ float warp_sums[32];
  const Pack<T, NV>* pieces = reinterpret_cast<const Pack<T, NV>*>(x);
  float acc = 0.f;
#pragma unroll 4
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n / NV; i += (size_t)gridDim.x * blockDim.x) {
    const Pack<T, NV> v = pieces[i];
#pragma unroll
    for (int e = 0; e < NV; e++) acc += to_float(v.v[e]) * to_float(v.v[e]);
  }
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
  if ((threadIdx.x & 31) == 0) warp_sums[threadIdx.x >> 5] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int w = 0; w < (int)(blockDim.x >> 5); w++) s += warp_sums[w];
    partials[blockIdx.x] += s;
  }
}

static __global__ void sum_partials_kernel(float* out, const float* partials, int n) {
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < n; i++) s += partials[i];
    *out = s;
  }
}

// partials (SUMSQ_BLOCKS floats) must be zeroed by the caller before the first tensor;
// calling this on several tensors accumulates (+=) all of them into the same partials.
template <typename T>
inline void sumsq_accumulate(float* partials, const T* x, size_t n, cudaStream_t stream) {
  if (n == 0) return;
  if (n % SUMSQ_PIECE == 0 && pack_aligned(x, SUMSQ_PIECE))
    sumsq_partial_kernel<SUMSQ_PIECE><<<SUMSQ_BLOCKS, 512, 0, stream>>>(partials, x, n);
  else sumsq_partial_kernel<1><<<SUMSQ_BLOCKS, 512, 0, stream>>>(partials, x, n);
  launchCheck("sumsq", "n=%zu", n);
}

inline void sumsq_finish(float* out, const float* partials, cudaStream_t stream) {
  sum_partials_kernel<<<1, 32, 0, stream>>>(out, partials, SUMSQ_BLOCKS);
  launchCheck("sumsq_finish", "blocks=%d", SUMSQ_BLOCKS);
}
