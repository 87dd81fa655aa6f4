// cross_entropy.cuh — softmax cross-entropy over full logits (twin: ref/cross_entropy.hpp).
// The baseline that the vocabulary-parallel Ring-DTP operator replaces: the whole [N, V] logits
// tensor exists (Mem::Logits, owned by the caller).
//
//   forward:  lse[n]    = log Σ_j exp(logits[n,j])             (fp32, one pass, online max/sum)   lse (=)
//             losses[n] = lse[n] − logits[n, targets[n]]                                         losses (=)
//   backward: dlogits[n,j] = dloss · (exp(logits[n,j] − lse[n]) − [j == targets[n]])             dlogits (=)
//             dloss = d(total loss)/d(losses[n]), the same for every row (e.g. 1/(N·grad_accum)).
//             dlogits may alias logits (each element is read, then written, by the same thread).
//   forward_backward: both in one kernel, each row read from HBM once (the backward re-reads the
//             row its block has just read, from L1/L2): the same losses, lse and dlogits bits as the
//             two kernels (the same lse reduction, the same per-element formula).
//   loss_sum: *out = Σ_n losses[n]                              (fp32, fixed order)              out (=)
//
// Shapes: logits, dlogits [N, V] floatX; targets [N] int32; losses, lse [N] float.
// A target outside [0, V) gives a NaN loss and a NaN gradient row (no read outside the row).
//
// Exponentials (cross_entropy_exp), two per logit (the sum, then the gradient): in the BF16 build
// common.cuh's fast_exp, one multiply and one MUFU.EX2 (relative error ~2^-22, far below the bf16
// rounding of the logits and of dlogits), which took the fused kernel from 2.7 to 3.5 TB/s at B1's
// shape (notes/speed.md, 'The memory-bound kernels'); in the FP32 build expf, the pedantic reference path.
//
// Determinism: one block per row; each thread folds its strided columns (in 16-byte pieces when the
// rows are whole pieces and aligned, common.cuh's ROW_PIECE) into a running (max, sum-exp) pair, and
// the pairs are combined by a fixed warp xor butterfly (the combine is commutative, so every lane gets
// the same value), then the warps' pairs by the same butterfly in warp 0.
//
// Memory: none of its own in the launchers. The output head at the end of this file (the
// seam of notes/design.md §1.1, --head full) owns its logits: N·V·b (Logits) + 2·N·4 B (losses, lse).
#pragma once
#include "common.cuh"
#include "matmul.cuh"
#include "../runtime/profile.cuh"

static const int CROSS_ENTROPY_THREADS = 512;
static const int LOSS_SUM_THREADS = 1024;

// ---------------------------------------------------------------------------------------------
// Kernels

// e^x: fast_exp in the BF16 build, expf in the FP32 build (header comment).
__device__ __forceinline__ float cross_entropy_exp(float x) {
#ifdef FLATMOE_BF16
  return fast_exp(x);
#else
  return expf(x);
#endif
}

// (m, s) represents s · exp(m): a running max and the sum of exp(z − m) over the columns seen;
// m = −inf, s = 0 is the empty set.
struct CrossEntropyOnlineLse {
  float m, s;
};

__device__ inline CrossEntropyOnlineLse cross_entropy_combine(CrossEntropyOnlineLse a, CrossEntropyOnlineLse b) {
  float m = fmaxf(a.m, b.m);
  float sa = a.m == -INFINITY ? 0.f : a.s * cross_entropy_exp(a.m - m);
  float sb = b.m == -INFINITY ? 0.f : b.s * cross_entropy_exp(b.m - m);
  return CrossEntropyOnlineLse{m, sa + sb};
}

// (m, s) of one row's `width` values, in thread 0 of the block (the other threads' results are
// partial): each thread folds its strided pieces of NV consecutive columns (common.cuh: NV =
// ROW_PIECE when the row is whole 16-byte pieces, else 1) — per piece, the running max is raised to
// the piece's max first, so the piece costs one rescale and NV independent exponentials, not a
// chain of NV dependent ones —, a warp xor butterfly combines the lanes (every lane gets the same
// value: the combine is commutative), and warp 0 combines the warps' pairs by the same butterfly.
// Call with all threads.
template <int NV, typename T>
__device__ CrossEntropyOnlineLse row_online_lse(const T* z, int width) {
  __shared__ CrossEntropyOnlineLse warp_acc[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, num_warps = blockDim.x / 32;
  CrossEntropyOnlineLse acc{-INFINITY, 0.f};
#pragma unroll 4
  for (int c = threadIdx.x; c < width / NV; c += blockDim.x) {
    const Pack<T, NV> v = reinterpret_cast<const Pack<T, NV>*>(z)[c];
    float m = acc.m;
#pragma unroll
    for (int e = 0; e < NV; e++) m = fmaxf(m, to_float(v.v[e]));
    float s = acc.m == -INFINITY ? 0.f : acc.s * cross_entropy_exp(acc.m - m);
#pragma unroll
    for (int e = 0; e < NV; e++) s += cross_entropy_exp(to_float(v.v[e]) - m);
    acc = CrossEntropyOnlineLse{m, s};
  }
  auto butterfly = [](CrossEntropyOnlineLse a) {
    for (int o = 16; o > 0; o >>= 1)
      a = cross_entropy_combine(a, CrossEntropyOnlineLse{__shfl_xor_sync(0xffffffff, a.m, o),
                                                         __shfl_xor_sync(0xffffffff, a.s, o)});
    return a;
  };
  acc = butterfly(acc);
  if (lane == 0) warp_acc[warp] = acc;
  __syncthreads();
  CrossEntropyOnlineLse total{-INFINITY, 0.f};
  if (warp == 0) total = butterfly(lane < num_warps ? warp_acc[lane] : CrossEntropyOnlineLse{-INFINITY, 0.f});
  return total;
}

// Row `row`'s lse and loss (lse[row], losses[row]) from its online max and sum over the row z [V] and
// its target t (NaN outside [0, V)); returns the lse. One thread of the row's block.
template <typename T>
__device__ __forceinline__ float cross_entropy_row_loss(float* losses, float* lse, const CrossEntropyOnlineLse& total,
                                                        const T* z, int row, int t, int V) {
  const float row_lse = total.m + logf(total.s);
  lse[row] = row_lse;
  losses[row] = (t >= 0 && t < V) ? row_lse - to_float(z[t]) : NAN;
  return row_lse;
}

// One block per row.
template <int NV, typename T>
__global__ void cross_entropy_forward_kernel(float* losses, float* lse, const T* logits, const int* targets, int V) {
  const int row = blockIdx.x;
  const T* z = logits + (size_t)row * V;
  CrossEntropyOnlineLse total = row_online_lse<NV>(z, V);
  if (threadIdx.x == 0) cross_entropy_row_loss(losses, lse, total, z, row, targets[row], V);
}

// A block of columns [col0, col0 + width) of the vocabulary (logits [N, width]) folded into each
// row's running statistics: max m, sum l of exp(z − m), and the target's logit when the target lies
// in the block. One block per row.
template <int NV, typename T>
__global__ void cross_entropy_block_forward_kernel(float* m, float* l, float* target_logit, const T* logits,
                                                   const int* targets, int width, int col0) {
  const int row = blockIdx.x;
  const T* z = logits + (size_t)row * width;
  CrossEntropyOnlineLse total = row_online_lse<NV>(z, width);
  if (threadIdx.x == 0) {
    CrossEntropyOnlineLse running = cross_entropy_combine(CrossEntropyOnlineLse{m[row], l[row]}, total);
    m[row] = running.m;
    l[row] = running.s;
    const int t = targets[row] - col0;
    if (t >= 0 && t < width) target_logit[row] = to_float(z[t]);
  }
}

// Running statistics before the first block: m = −inf, l = 0, target logit NaN (a target in no block,
// i.e. outside [0, V), keeps a NaN loss).
static __global__ void cross_entropy_stats_init_kernel(float* m, float* l, float* target_logit, int N) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) {
    m[i] = -INFINITY;
    l[i] = 0.f;
    target_logit[i] = NAN;
  }
}

// lse = m + log l, losses = lse − target logit.
static __global__ void cross_entropy_stats_finish_kernel(float* losses, float* lse, const float* m, const float* l,
                                                         const float* target_logit, int N) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < N) {
    lse[i] = m[i] + logf(l[i]);
    losses[i] = lse[i] - target_logit[i];
  }
}

// dlogits of one row (called by every thread of its block): the row holds vocabulary columns [col0,
// col0 + width) of V, taken in pieces of NV (ROW_PIECE or 1), each thread its strided pieces; t is
// the row's target (outside [0, V): a NaN row). No __restrict__: dz may alias z (each piece is read,
// then written, by the same thread).
template <int NV, typename T>
__device__ inline void cross_entropy_row_backward(T* dz_row, const T* z_row, float row_lse, int t, float dloss,
                                                  int width, int col0, int V) {
  using P = Pack<T, NV>;
  const bool valid = t >= 0 && t < V;
  const P* z = reinterpret_cast<const P*>(z_row);
  P* dz = reinterpret_cast<P*>(dz_row);
  for (int c = threadIdx.x; c < width / NV; c += blockDim.x) {
    const P v = z[c];
    P d;
#pragma unroll
    for (int e = 0; e < NV; e++) {
      const float p = cross_entropy_exp(to_float(v.v[e]) - row_lse);
      d.v[e] = from_float<T>(valid ? dloss * (p - (col0 + c * NV + e == t ? 1.f : 0.f)) : NAN);
    }
    dz[c] = d;
  }
}

// One block per row.
template <int NV, typename T>
__global__ void cross_entropy_backward_kernel(T* dlogits, const T* logits, const float* lse, const int* targets,
                                              float dloss, int width, int col0, int V) {
  const int row = blockIdx.x;
  cross_entropy_row_backward<NV>(dlogits + (size_t)row * width, logits + (size_t)row * width, lse[row], targets[row],
                                 dloss, width, col0, V);
}

// One block per row: the forward kernel's lse and loss, then the backward kernel's dlogits from them.
// Thread 0 reads the target's logit before the barrier after which the row may be overwritten
// (dlogits may alias logits).
template <int NV, typename T>
__global__ void cross_entropy_forward_backward_kernel(T* dlogits, float* losses, float* lse, const T* logits,
                                                      const int* targets, float dloss, int V) {
  __shared__ float row_lse_shared;
  const int row = blockIdx.x, t = targets[row];
  const T* z = logits + (size_t)row * V;
  CrossEntropyOnlineLse total = row_online_lse<NV>(z, V);
  if (threadIdx.x == 0) row_lse_shared = cross_entropy_row_loss(losses, lse, total, z, row, t, V);
  __syncthreads();
  cross_entropy_row_backward<NV>(dlogits + (size_t)row * V, z, row_lse_shared, t, dloss, V, 0, V);
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
  if (row_pieces(V, {logits}))
    cross_entropy_forward_kernel<ROW_PIECE><<<N, CROSS_ENTROPY_THREADS, 0, stream>>>(losses, lse, logits, targets, V);
  else
    cross_entropy_forward_kernel<1><<<N, CROSS_ENTROPY_THREADS, 0, stream>>>(losses, lse, logits, targets, V);
  launchCheck("cross_entropy_forward", "N=%d V=%d", N, V);
}

// The online form over vocabulary blocks (ops/ring_dtp.cuh): statistics m, l, target_logit [N]
// (fp32) are set to the empty set by cross_entropy_stats_init, each block of columns [col0, col0 +
// width) of logits [N, width] is folded in by cross_entropy_block_forward (in any order of blocks),
// and cross_entropy_stats_finish gives lse and losses [N] (=) as cross_entropy_forward would.
inline void cross_entropy_stats_init(float* m, float* l, float* target_logit, int N, cudaStream_t stream) {
  if (N == 0) return;
  cross_entropy_stats_init_kernel<<<ceil_div(N, 256), 256, 0, stream>>>(m, l, target_logit, N);
  launchCheck("cross_entropy_stats_init", "N=%d", N);
}

inline void cross_entropy_block_forward(float* m, float* l, float* target_logit, const floatX* logits,
                                        const int* targets, int N, int width, int col0, cudaStream_t stream) {
  if (N == 0) return;
  if (width <= 0) fm_fail("cross_entropy_block_forward", "width must be positive", "N=%d width=%d col0=%d", N, width, col0);
  if (row_pieces(width, {logits}))
    cross_entropy_block_forward_kernel<ROW_PIECE><<<N, CROSS_ENTROPY_THREADS, 0, stream>>>(m, l, target_logit, logits, targets,
                                                                                           width, col0);
  else
    cross_entropy_block_forward_kernel<1><<<N, CROSS_ENTROPY_THREADS, 0, stream>>>(m, l, target_logit, logits, targets, width,
                                                                                   col0);
  launchCheck("cross_entropy_block_forward", "N=%d width=%d col0=%d", N, width, col0);
}

inline void cross_entropy_stats_finish(float* losses, float* lse, const float* m, const float* l,
                                       const float* target_logit, int N, cudaStream_t stream) {
  if (N == 0) return;
  cross_entropy_stats_finish_kernel<<<ceil_div(N, 256), 256, 0, stream>>>(losses, lse, m, l, target_logit, N);
  launchCheck("cross_entropy_stats_finish", "N=%d", N);
}

// dlogits [N, width] (=) = dloss · (softmax − onehot(targets)) over the vocabulary columns [col0,
// col0 + width) of V, with each row's lse over all V; may alias logits.
inline void cross_entropy_block_backward(floatX* dlogits, const floatX* logits, const float* lse, const int* targets,
                                         float dloss, int N, int width, int col0, int V, cudaStream_t stream) {
  if (N == 0) return;
  if (width <= 0 || V <= 0)
    fm_fail("cross_entropy_backward", "width and V must be positive", "N=%d width=%d col0=%d V=%d", N, width, col0, V);
  if (row_pieces(width, {dlogits, logits}))
    cross_entropy_backward_kernel<ROW_PIECE><<<N, 256, 0, stream>>>(dlogits, logits, lse, targets, dloss, width, col0, V);
  else
    cross_entropy_backward_kernel<1><<<N, 256, 0, stream>>>(dlogits, logits, lse, targets, dloss, width, col0, V);
  launchCheck("cross_entropy_backward", "N=%d width=%d col0=%d V=%d", N, width, col0, V);
}

// dlogits [N, V] (=) = dloss · (softmax(logits) − onehot(targets)); may alias logits.
inline void cross_entropy_backward(floatX* dlogits, const floatX* logits, const float* lse, const int* targets,
                                   float dloss, int N, int V, cudaStream_t stream) {
  cross_entropy_block_backward(dlogits, logits, lse, targets, dloss, N, V, 0, V, stream);
}

// losses, lse [N] (=) as cross_entropy_forward and dlogits [N, V] (=) as cross_entropy_backward, the
// same bits, in one pass over the logits when the two would take the rows in the same pieces (else
// the two kernels); dlogits may alias logits.
inline void cross_entropy_forward_backward(floatX* dlogits, float* losses, float* lse, const floatX* logits,
                                           const int* targets, float dloss, int N, int V, cudaStream_t stream) {
  if (N == 0) return;
  if (V <= 0) fm_fail("cross_entropy_forward_backward", "V must be positive", "N=%d V=%d", N, V);
  const bool forward_pieces = row_pieces(V, {logits}), backward_pieces = row_pieces(V, {dlogits, logits});
  if (forward_pieces != backward_pieces) {
    cross_entropy_forward(losses, lse, logits, targets, N, V, stream);
    cross_entropy_backward(dlogits, logits, lse, targets, dloss, N, V, stream);
    return;
  }
  if (forward_pieces)
    cross_entropy_forward_backward_kernel<ROW_PIECE><<<N, CROSS_ENTROPY_THREADS, 0, stream>>>(dlogits, losses, lse, logits,
                                                                                              targets, dloss, V);
  else
    cross_entropy_forward_backward_kernel<1><<<N, CROSS_ENTROPY_THREADS, 0, stream>>>(dlogits, losses, lse, logits,
                                                                                      targets, dloss, V);
  launchCheck("cross_entropy_forward_backward", "N=%d V=%d", N, V);
}

// *out (=) = Σ losses[0..N), fixed order (N = 0 writes 0).
inline void loss_sum(float* out, const float* losses, int N, cudaStream_t stream) {
  loss_sum_kernel<<<1, LOSS_SUM_THREADS, 0, stream>>>(out, losses, N);
  launchCheck("loss_sum", "N=%d", N);
}

// ---------------------------------------------------------------------------------------------
// The output head seam (notes/design.md §1.1, notes/seams.md): the vocabulary projection and the loss.
// Each head is a class derived from OutputHead (ops/cross_entropy.cuh: full; ops/ring_dtp.cuh: chunked,
// ring_dtp), registered by one line of config.hpp's head_choices (its name, needs and flags) and made by
// its line of seams.cuh's head_factories. The model makes one at start-up (--head) and calls it in one
// place (model.cuh). The contract, the whole of it:
//   made      allocating nothing. V is always the whole vocabulary. W and dW are lm_head [V,H], or,
//             for a head that splits the vocabulary (SeamNeeds::VocabularyGroup), this rank's interval
//             of its rows (ring_dtp_vocab_interval); such a head is collective over its vocabulary
//             group: every rank of it calls it in the same order.
//   forward_backward: from the final normed hidden states x [N,H] and the targets [N] (device), the
//             summed token loss *loss_sum (=, device fp32); with dx != nullptr also the backward of the
//             objective dloss · Σ_n loss_n: dx [N,H] (=) and dW (+=: the model sums a step's
//             micro-batches in it). dx == nullptr: the loss alone. The logits exist only inside, for
//             as long as the call.
//   logits_rows: logits [n,V] (=) of a few rows x [n,H] over the whole vocabulary (sampling: n = 1).
//   live_bytes(N, H, V): the most bytes forward_backward holds in the pool at once for N tokens (the
//             per-rank prediction adds it).

struct OutputHead {
  virtual ~OutputHead() = default;
  virtual void forward_backward(float* loss_sum, floatX* dx, floatX* dW, const floatX* x, const floatX* W,
                                const int* targets, float dloss, int N, int H, int V, cudaStream_t stream) = 0;
  virtual void logits_rows(floatX* logits, const floatX* x, const floatX* W, int n, int H, int V, cudaStream_t stream) {
    matmul_forward(logits, x, W, n, H, V, stream);
  }
  virtual size_t live_bytes(int N, int H, int V) const = 0;
};

// The rows of each rank's batch of N that a head projects at once, when the rows of `group` ranks go
// together onto `width` columns (the chunked head: one rank's rows over the whole vocabulary, width V;
// Ring-DTP's fused steps, ops/ring_dtp.cuh: P ranks' rows over a shard, width ⌈V/P⌉): the most n with
// group·n·width ≤ N·min(C, width), so that the block [group·n, width] holds at most as many logits as N rows
// of C columns; one row at least. C = 0: all N (the full head).
inline int head_block_rows(int N, int width, int group, int vocab_block) {
  if (N < 0 || width < 1 || group < 1 || vocab_block < 0)
    fm_fail("head_block_rows", "need N >= 0, width >= 1, group >= 1 and vocab_block >= 0", "N=%d width=%d group=%d vocab_block=%d",
            N, width, group, vocab_block);
  if (vocab_block == 0 || N == 0) return N;
  const long long rows = (long long)N * std::min(vocab_block, width) / ((long long)group * width);
  return (int)std::max(1LL, std::min<long long>(rows, N));
}

// Bytes the head holds in the pool at its peak: the logits block [n, V] and the losses and lse [N] fp32.
inline size_t full_head_live_bytes(size_t N, int V, int vocab_block, size_t b) {
  return (size_t)head_block_rows((int)N, V, 1, vocab_block) * V * b + 8 * N;
}

// --head full (vocab_block = 0): logits [N,V] = x Wᵀ, cross-entropy over all of them (the Ring-DTP
// baseline). --head chunked (vocab_block = C): the same, n rows at a time (head_block_rows): each
// block's logits are overwritten by their gradient while on the device, and dx rows (=) and dW (+=) are
// formed from them at once, so that no pass recomputes the logits — three GEMM-sized passes over the
// whole head, as the full head's (fused: the loss is final when dx is asked for). dx's rows each come from
// one GEMM over the whole vocabulary (summed in fp32, rounded once); dW sums ⌈N/n⌉ blocks in floatX, as it
// sums a step's micro-batches.
struct FullHead : OutputHead {
  int vocab_block;
  explicit FullHead(int vocab_block = 0) : vocab_block(vocab_block) {
    if (vocab_block < 0) fm_fail("full_head", "vocab_block must be >= 0 (0: every row at once)", "vocab_block=%d", vocab_block);
  }
  void forward_backward(float* loss_sum, floatX* dx, floatX* dW, const floatX* x, const floatX* W, const int* targets,
                        float dloss, int N, int H, int V, cudaStream_t stream) override {
    const int rows = head_block_rows(N, V, 1, vocab_block);
    floatX* logits = pool().alloc_t<floatX>((size_t)rows * V, Mem::Logits, "logits");
    float* losses = pool().alloc_t<float>(N, Mem::Logits, "losses");
    float* lse = pool().alloc_t<float>(N, Mem::Logits, "lse");
    // profiling (runtime/profile.cuh): sub-ranges of the caller's; the cross-entropy kernel reads the
    // block's logits (forward), or reads them and overwrites them with their gradient (fwd+bwd)
    for (int r0 = 0; r0 < N; r0 += rows) {
      const int n = std::min(rows, N - r0);
      const floatX* x_rows = x + (size_t)r0 * H;
      prof_sub(stream, "logits matmul");
      matmul_forward(logits, x_rows, W, n, H, V, stream);
      if (dx == nullptr) {
        prof_sub(stream, "cross-entropy fwd", (double)n * V * sizeof(floatX) + 12.0 * n);
        cross_entropy_forward(losses + r0, lse + r0, logits, targets + r0, n, V, stream);
        continue;
      }
      prof_sub(stream, "cross-entropy fwd+bwd", 2.0 * n * V * sizeof(floatX) + 12.0 * n);
      cross_entropy_forward_backward(logits, losses + r0, lse + r0, logits, targets + r0, dloss, n, V, stream);
      prof_sub(stream, "dx matmul");
      matmul_backward_dx(dx + (size_t)r0 * H, logits, W, n, H, V, stream);
      prof_sub(stream, "dW matmul (+=)");
      matmul_backward_dW(dW, logits, x_rows, n, H, V, stream);
    }
    ::loss_sum(loss_sum, losses, N, stream);
    for (void* p : {(void*)logits, (void*)losses, (void*)lse}) pool().free(p);
  }
  size_t live_bytes(int N, int, int V) const override { return full_head_live_bytes(N, V, vocab_block, sizeof(floatX)); }
};
