// cross_entropy.cuh — softmax cross-entropy over full logits (twin: ref/cross_entropy.hpp).
// The baseline that the vocabulary-parallel Ring-DTP operator replaces: the whole [N, V] logits
// tensor exists (Mem::Logits, owned by the caller).
//
//   forward:  lse[n]    = log Σ_j exp(logits[n,j])             (fp32, one pass, online max/sum)   lse (=)
//             losses[n] = lse[n] − logits[n, targets[n]]                                         losses (=)
//   backward: dlogits[n,j] = dloss · (exp(logits[n,j] − lse[n]) − [j == targets[n]])             dlogits (=)
//             dloss = d(total loss)/d(losses[n]), the same for every row (e.g. 1/(N·grad_accum)).
//             dlogits may alias logits (each element is read, then written, by the same thread).
//   loss_sum: *out = Σ_n losses[n]                              (fp32, fixed order)              out (=)
//
// Shapes: logits, dlogits [N, V] floatX; targets [N] int32; losses, lse [N] float.
// A target outside [0, V) gives a NaN loss and a NaN gradient row (no read outside the row).
//
// Determinism: one block per row; each thread folds its strided columns into a running
// (max, sum-exp) pair, and the pairs are combined by a warp xor butterfly (the combine is
// commutative, so every lane gets the same value) and then across warps in warp order.
//
// Memory: none of its own in the three launchers. The output head at the end of this file (the
// seam of notes/design.md §1.1, --head full) owns its logits: N·V·b (Logits) + 2·N·4 B (losses, lse).
#pragma once
#include "common.cuh"
#include "matmul.cuh"

static const int CROSS_ENTROPY_THREADS = 512;
static const int LOSS_SUM_THREADS = 1024;

// ---------------------------------------------------------------------------------------------
// Kernels

// (m, s) represents s · exp(m): a running max and the sum of exp(z − m) over the columns seen;
// m = −inf, s = 0 is the empty set.
struct CrossEntropyOnlineLse {
  float m, s;
};

__device__ inline CrossEntropyOnlineLse cross_entropy_combine(CrossEntropyOnlineLse a, CrossEntropyOnlineLse b) {
  float m = fmaxf(a.m, b.m);
  float sa = a.m == -INFINITY ? 0.f : a.s * expf(a.m - m);
  float sb = b.m == -INFINITY ? 0.f : b.s * expf(b.m - m);
  return CrossEntropyOnlineLse{m, sa + sb};
}

// One block per row.
template <typename T>
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const T* logits, const int* targets, int V) {
  __shared__ CrossEntropyOnlineLse warp_acc[32];
  const int row = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  const T* z = logits + (size_t)row * V;
  CrossEntropyOnlineLse acc{-INFINITY, 0.f};
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    float zj = to_float(z[j]);
    if (zj > acc.m) {
      acc.s = acc.s * expf(acc.m - zj) + 1.f;
      acc.m = zj;
    } else {
      acc.s += expf(zj - acc.m);
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    CrossEntropyOnlineLse other{__shfl_xor_sync(0xffffffff, acc.m, o), __shfl_xor_sync(0xffffffff, acc.s, o)};
    acc = cross_entropy_combine(acc, other);
  }
  if (lane == 0) warp_acc[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    CrossEntropyOnlineLse total = warp_acc[0];
    for (int i = 1; i < num_warps; i++) total = cross_entropy_combine(total, warp_acc[i]);
    float row_lse = total.m + logf(total.s);
    int t = targets[row];
    lse[row] = row_lse;
    losses[row] = (t >= 0 && t < V) ? row_lse - to_float(z[t]) : NAN;
  }
}

// One block per row. No __restrict__: dlogits may alias logits.
template <typename T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits, const float* lse, const int* targets,
                                              float dloss, int V) {
  const int row = blockIdx.x;
  const int t = targets[row];
  const bool valid = t >= 0 && t < V;
  const float row_lse = lse[row];
  const T* z = logits + (size_t)row * V;
  T* dz = dlogits + (size_t)row * V;
  for (int j = threadIdx.x; j < V; j += blockDim.x) {
    float p = expf(to_float(z[j]) - row_lse);
    float g = valid ? dloss * (p - (j == t ? 1.f : 0.f)) : NAN;
    dz[j] = from_float<T>(g);
  }
}

// One block: strided per-thread sums, xor butterfly per warp, warps added in order.
static __global__ void loss_sum_kernel(float* out, const float* losses, int N) {
  __shared__ float warp_sums[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  float acc = 0.f;
  for (int i = threadIdx.x; i < N; i += blockDim.x) acc += losses[i];
  for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, o);
  if (lane == 0) warp_sums[warp] = acc;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.f;
    for (int i = 0; i < num_warps; i++) s += warp_sums[i];
    *out = s;
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers

// losses [N] (=), lse [N] (=) from logits [N, V] and targets [N].
inline void cross_entropy_forward(float* losses, float* lse, const floatX* logits, const int* targets, int N, int V,
                                  cudaStream_t stream) {
  if (N == 0) return;
  if (V <= 0) fm_fail("cross_entropy_forward", "V must be positive", "N=%d V=%d", N, V);
  cross_entropy_forward_kernel<<<N, CROSS_ENTROPY_THREADS, 0, stream>>>(losses, lse, logits, targets, V);
  launchCheck("cross_entropy_forward", "N=%d V=%d", N, V);
}

// dlogits [N, V] (=) = dloss · (softmax(logits) − onehot(targets)); may alias logits.
inline void cross_entropy_backward(floatX* dlogits, const floatX* logits, const float* lse, const int* targets,
                                   float dloss, int N, int V, cudaStream_t stream) {
  if (N == 0) return;
  if (V <= 0) fm_fail("cross_entropy_backward", "V must be positive", "N=%d V=%d", N, V);
  cross_entropy_backward_kernel<<<N, 256, 0, stream>>>(dlogits, logits, lse, targets, dloss, V);
  launchCheck("cross_entropy_backward", "N=%d V=%d", N, V);
}

// *out (=) = Σ losses[0..N), fixed order (N = 0 writes 0).
inline void loss_sum(float* out, const float* losses, int N, cudaStream_t stream) {
  loss_sum_kernel<<<1, LOSS_SUM_THREADS, 0, stream>>>(out, losses, N);
  launchCheck("loss_sum", "N=%d", N);
}

// ---------------------------------------------------------------------------------------------
// The output head seam (notes/design.md §1.1): from the final normed hidden states x [N,H], the vocabulary
// projection W [V,H] and the targets [N] (device), the summed token loss *loss_sum (=, device fp32);
// with dx != nullptr also the backward of the objective dloss · Σ_n loss_n: dx [N,H] (=) and
// dW [V,H] (+=). Logits exist only inside a head. A head is chosen once (--head).

struct OutputHead {
  virtual ~OutputHead() = default;
  virtual void forward_backward(float* loss_sum, floatX* dx, floatX* dW, const floatX* x, const floatX* W,
                                const int* targets, float dloss, int N, int H, int V, cudaStream_t stream) = 0;
};

// --head full: logits [N,V] = x Wᵀ, cross-entropy over all of them (the Ring-DTP baseline).
struct FullHead : OutputHead {
  void forward_backward(float* loss_sum, floatX* dx, floatX* dW, const floatX* x, const floatX* W, const int* targets,
                        float dloss, int N, int H, int V, cudaStream_t stream) override {
    floatX* logits = pool().alloc_t<floatX>((size_t)N * V, Mem::Logits, "logits");
    float* losses = pool().alloc_t<float>(N, Mem::Logits, "losses");
    float* lse = pool().alloc_t<float>(N, Mem::Logits, "lse");
    matmul_forward(logits, x, W, N, H, V, stream);
    cross_entropy_forward(losses, lse, logits, targets, N, V, stream);
    ::loss_sum(loss_sum, losses, N, stream);
    if (dx != nullptr) {
      cross_entropy_backward(logits, logits, lse, targets, dloss, N, V, stream);
      matmul_backward(dx, dW, logits, x, W, N, H, V, stream);
    }
    for (void* p : {(void*)logits, (void*)losses, (void*)lse}) pool().free(p);
  }
};
