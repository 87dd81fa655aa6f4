// router.cuh — MoE router: logits, scores, top-k selection with aux-loss-free bias, combine
// weights, and their backward (notes/design.md §2). Twin of ref/router.hpp (scores, selection, weights,
// dlogits) and ref/matmul.hpp (the logits GEMM and its gradients).
//
// Precision: FP32 in both builds (notes/design.md §3). Only the inputs x, W and the gradients dx, dW are
// floatX; logits, scores, selection keys, weights, dlogits and the three GEMMs are fp32 (never TF32):
// bf16 logits change routing decisions, and the router's own roundings should not add to the error
// its gradient inherits from its bf16 inputs. How the GEMMs stay fp32:
//   FP32 build: plain fp32 GEMMs (ops/matmul.cuh on float operands, pedantic).
//   BF16 build: bf16 tensor-core GEMMs that round no operand. x and W are bf16 already, so each
//   product x·w is exact in fp32 and the products are summed in fp32. The fp32 dlogits is first
//   split into three bf16 parts whose sum is exactly the fp32 value (hi = bf16(d), mid = bf16(d − hi),
//   lo = d − hi − mid, which fits bf16's 8 bits), laid side by side as a K = 3E operand (zero columns
//   up to K3 = 3E rounded up to a multiple of 8, for the grouped GEMM's 16-byte copies):
//     dx += [hi mid lo] · [W; W; W]              ops/grouped_gemm.cuh, one problem with beta 1: the
//                                                product and float(dx) summed in fp32, rounded once
//     ΔW = hiᵀx + midᵀx + loᵀx                   one cuBLAS GEMM → [3E, H] fp32 parts, folded in that order
//   dx is added into in place, not written: the model's FFN input gradient already holds the experts'
//   part, and the add inside the GEMM's store replaces a separate add over [N,H]
//   (notes/speed.md, 'The router'). cuBLAS's own beta = 1 on a bf16 C is not one rounding (the same
//   section), so the BF16 build's dx takes the grouped GEMM's kernel, which needs H % 8 == 0: other sizes
//   are refused (the model's hidden is a multiple of 8, config.hpp).
//   The only difference from a SIMT fp32 GEMM is the order and rounding of the fp32 additions inside
//   the tensor cores (tests/gpu_router.cu holds logits to 1e-5 and dx, dW to one rounding in both builds).
//
// Per token n (N tokens, H hidden, E experts, k top-k):
//   logits[n] = x[n] · Wᵀ (router_logits_forward, an fp32 GEMM: see Precision)
//   s = softmax(logits[n]) over E (score_fn ROUTER_SOFTMAX) or sigmoid(logits[n]) (ROUTER_SIGMOID)
//   topk_idx[n,:] = the k experts with the largest s_e + bias_e, in descending order of s + bias;
//                   equal keys go to the LOWER expert index first (same rule as the reference)
//   topk_w[n,j]   = s_{topk_idx[n,j]}, divided by Σ_j s_{topk_idx[n,j]} (in j order) when renorm
// The bias [E] (DeepSeek-V3 aux-loss-free balancing) changes the selection only, never the weights.
//
// Backward: the selection is piecewise constant, so the gradient flows only through the weights:
//   ds_e   = dtopk_w[n,j] for e = topk_idx[n,j]; with renorm ds_e = (dtopk_w[n,j] − Σ_m dtopk_w[n,m] w_m) / S
//   dlogit = s ⊙ (ds − Σ_f s_f ds_f)            (softmax)
//   dlogit = ds ⊙ s ⊙ (1 − s)                   (sigmoid)
// and through the logits GEMM (router_logits_backward):
//   dx += dlogits · W      Δx = dlogits · W in fp32, then dx[i] = floatX(float(dx[i]) + Δx[i]) (one rounding)
//   dW += dlogitsᵀ · x     ΔW = dlogitsᵀ · x in fp32, then dW[i] = floatX(float(dW[i]) + ΔW[i]) (one rounding)
//
// A routing profile or trace (data/routing_profile.hpp, data/routing_trace.hpp; the trainer's --routing)
// may replace the selection: router_weights then sets topk_w[n,j] = s_{topk_idx[n,j]}, the router's own
// scores for the forced experts (the bias plays no part), divided by their sum over the k slots when
// renorm (an expert forced into two slots counts twice). Not 1/k: only tools/bench_ep_moe.cu uses 1/k.
//
// Shapes: x [N,H] floatX; W [E,H] floatX; logits [N,E] float; bias [E] float; dtopk_w [N,k] float.
// Outputs: logits (=), topk_idx [N,k] int (=), topk_w [N,k] float (=), scores [N,E] float (=, saved
// for backward), dlogits [N,E] float (=), dx [N,H] floatX (+=), dW [E,H] floatX (+=), loads [E] int (=
// router_count_loads; += router_add_loads, and router_forward when given loads).
// Limits of the selection and its backward: E ≤ ROUTER_MAX_E (256), k ≤ ROUTER_MAX_K (8), k ≤ E;
// larger sizes are refused.
// Memory: router_forward, router_backward, router_weights, router_count_loads, router_add_loads allocate nothing.
// router_logits_forward allocates nothing. router_logits_backward (BF16 build) takes from the pool
// (Workspace) the split dlogits [N, K3] bf16, the fp32 parts of ΔW [K3, H] and [W; W; W] [K3, H]
// bf16: router_logits_workspace_bytes(N,H,E) = 2·N·K3 + 6·K3·H bytes (K3 = 3E rounded up to a
// multiple of 8) live at once, freed before it returns (stream-ordered) — or, with a weight-gradient
// stream, the first two held until its join (2·N·K3 + 4·K3·H). The FP32 build's backward allocates
// nothing. cuBLAS's own workspace is the pool's (cublas_on).
// Kernels: a token's experts on router_lanes(E) lanes of a warp, ROUTER_SLOTS each; every reduction is
// one fixed tree over the expert positions (inside a lane, then xor shuffles: all lanes end with the
// same bits, whatever the number of lanes), so results are deterministic. Loads use integer atomics (exact).
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>
#include "common.cuh"
#include "grouped_gemm.cuh"
#include "../data/routing_profile.hpp"
#include "matmul.cuh"
#include "../runtime/pool.cuh"
#include "../runtime/side_stream.cuh"

static const int ROUTER_SOFTMAX = 0;
static const int ROUTER_SIGMOID = 1;
static const int ROUTER_MAX_E = 256;
static const int ROUTER_MAX_K = 8;
static const int ROUTER_BLOCK = 256;                  // threads per block of the selection kernels
static const int ROUTER_SLOTS = 8;                    // experts per lane: E ≤ 8·32 = ROUTER_MAX_E

// A token's lanes: the fewest (a power of two ≤ 32) whose ROUTER_SLOTS slots cover E experts, so that
// a warp holds 32 / lanes tokens (E = 8: 1 lane, 32 tokens; E = 32: 4 lanes; E = 256: 32 lanes, a warp
// per token). Lane l of a token's group holds experts l, l + lanes, l + 2·lanes, ...
// (notes/speed.md, 'The router').
inline int router_lanes(int E) {
  int lanes = 1;
  while (lanes * ROUTER_SLOTS < E && lanes < 32) lanes *= 2;
  return lanes;
}

// Of a kernel's 1-, 2-, 4-, 8-, 16- and 32-lane instances, the one for E experts.
template <typename Kernel>
Kernel router_kernel_for(int E, Kernel one, Kernel two, Kernel four, Kernel eight, Kernel sixteen, Kernel thirtytwo) {
  switch (router_lanes(E)) {
    case 1: return one;
    case 2: return two;
    case 4: return four;
    case 8: return eight;
    case 16: return sixteen;
    default: return thirtytwo;
  }
}

// ---------------------------------------------------------------------------------------------
// Kernels

// A token's reductions over its E experts, placed at positions e = lane + LANES·slot (positions
// ≥ E hold 0 for a sum, −inf for a max). Both form one tree over the positions, pairing e with
// e xor 2^b for b from the highest bit down: first inside a lane (slot i with slot i + SLOTS/2, ...),
// then across the token's lanes (xor shuffles over LANES/2, ..., 1). The tree does not depend on
// LANES: every instance gives the same bits (tests/gpu_router.cu). `group` masks the token's lanes.
template <int LANES>
__device__ inline float router_token_sum(const float (&v)[ROUTER_SLOTS], unsigned group) {
  float t[ROUTER_SLOTS];
#pragma unroll
  for (int i = 0; i < ROUTER_SLOTS; i++) t[i] = v[i];
#pragma unroll
  for (int half = ROUTER_SLOTS / 2; half > 0; half /= 2)
#pragma unroll
    for (int i = 0; i < half; i++) t[i] += t[i + half];
#pragma unroll
  for (int o = LANES / 2; o > 0; o /= 2) t[0] += __shfl_xor_sync(group, t[0], o);
  return t[0];
}

template <int LANES>
__device__ inline float router_token_max(const float (&v)[ROUTER_SLOTS], unsigned group) {
  float m = v[0];
#pragma unroll
  for (int i = 1; i < ROUTER_SLOTS; i++) m = fmaxf(m, v[i]);
#pragma unroll
  for (int o = LANES / 2; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(group, m, o));
  return m;
}

// The token of a thread, its lane in the token's group and the group's shuffle mask.
template <int LANES>
struct RouterLane {
  int n, lane;
  unsigned group;
  __device__ RouterLane() {
    const int warp_lane = threadIdx.x & 31;
    lane = warp_lane & (LANES - 1);
    n = (blockIdx.x * ROUTER_BLOCK + threadIdx.x) / LANES;
    group = LANES == 32 ? 0xffffffffu : ((1u << LANES) - 1) << (warp_lane - lane);
  }
};

// Token me.n's choice: its scores, its top k experts (by score + bias) and their weights; each choice
// counted into block_loads (shared memory) unless nullptr.
template <int LANES>
__device__ inline void router_choose(int* topk_idx, float* topk_w, float* scores, int* block_loads,
                                     const float* logits, const float* bias, const RouterLane<LANES>& me, int E,
                                     int k, int score_fn, bool renorm) {
  const int lane = me.lane, n = me.n;
  const float* row = logits + (size_t)n * E;

  float s[ROUTER_SLOTS];  // this lane's scores, expert e = lane + LANES·i
#pragma unroll
  for (int i = 0; i < ROUTER_SLOTS; i++) {
    int e = lane + LANES * i;
    s[i] = e < E ? row[e] : -INFINITY;
  }
  if (score_fn == ROUTER_SOFTMAX) {
    const float mx = router_token_max<LANES>(s, me.group);
#pragma unroll
    for (int i = 0; i < ROUTER_SLOTS; i++) s[i] = lane + LANES * i < E ? expf(s[i] - mx) : 0.f;
    const float sum = router_token_sum<LANES>(s, me.group);
#pragma unroll
    for (int i = 0; i < ROUTER_SLOTS; i++) s[i] /= sum;
  } else {
#pragma unroll
    for (int i = 0; i < ROUTER_SLOTS; i++) s[i] = 1.f / (1.f + expf(-s[i]));
  }

  float key[ROUTER_SLOTS];  // selection key s + bias; -inf once taken (and for e ≥ E)
#pragma unroll
  for (int i = 0; i < ROUTER_SLOTS; i++) {
    int e = lane + LANES * i;
    if (e < E) scores[(size_t)n * E + e] = s[i];
    key[i] = e < E ? s[i] + bias[e] : -INFINITY;
  }

  float picked[ROUTER_MAX_K];  // scores of the selected experts, in selection order
  float picked_sum = 0.f;
#pragma unroll
  for (int j = 0; j < ROUTER_MAX_K; j++) {
    if (j >= k) break;
    // this lane's best (key, expert); its experts ascend with i, so ">" keeps the lower index
    float best_key = -INFINITY, best_s = 0.f;
    int best_e = INT_MAX;
#pragma unroll
    for (int i = 0; i < ROUTER_SLOTS; i++) {
      int e = lane + LANES * i;
      if (e < E && (key[i] > best_key || best_e == INT_MAX)) {
        best_key = key[i];
        best_s = s[i];
        best_e = e;
      }
    }
    // argmax over the token's lanes: larger key wins, equal keys go to the lower expert index (a
    // total order, so every lane ends with the same winner)
#pragma unroll
    for (int o = LANES / 2; o > 0; o /= 2) {
      float other_key = __shfl_xor_sync(me.group, best_key, o);
      float other_s = __shfl_xor_sync(me.group, best_s, o);
      int other_e = __shfl_xor_sync(me.group, best_e, o);
      if (other_key > best_key || (other_key == best_key && other_e < best_e)) {
        best_key = other_key;
        best_s = other_s;
        best_e = other_e;
      }
    }
#pragma unroll
    for (int i = 0; i < ROUTER_SLOTS; i++)
      if (lane + LANES * i == best_e) key[i] = -INFINITY;
    picked[j] = best_s;
    picked_sum += best_s;
    if (lane == 0) {
      topk_idx[(size_t)n * k + j] = best_e;
      if (block_loads) atomicAdd(&block_loads[best_e], 1);
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_K; j++) {
      if (j >= k) break;
      topk_w[(size_t)n * k + j] = renorm ? picked[j] / picked_sum : picked[j];
    }
  }
}

// Grid: ceil(N·LANES / ROUTER_BLOCK) blocks of ROUTER_BLOCK threads; LANES = router_lanes(E) lanes per token.
// loads [E] (+=, or nullptr): the block's choices counted in shared memory, then one integer atomic
// per expert per block (router_count_loads_kernel's scheme, without a launch of its own).
template <int LANES>
__global__ void __launch_bounds__(ROUTER_BLOCK) router_forward_kernel(int* topk_idx, float* topk_w, float* scores,
                                                                      int* loads, const float* logits,
                                                                      const float* bias, int N, int E, int k,
                                                                      int score_fn, bool renorm) {
  __shared__ int block_loads[ROUTER_MAX_E];
  if (loads) {
    for (int e = threadIdx.x; e < E; e += ROUTER_BLOCK) block_loads[e] = 0;
    __syncthreads();
  }
  const RouterLane<LANES> me;
  if (me.n < N) router_choose<LANES>(topk_idx, topk_w, scores, loads ? block_loads : nullptr, logits, bias, me, E, k,
                                     score_fn, renorm);  // a token's lanes choose together
  if (loads) {
    __syncthreads();
    for (int e = threadIdx.x; e < E; e += ROUTER_BLOCK)
      if (block_loads[e]) atomicAdd(&loads[e], block_loads[e]);
  }
}

// Grid and LANES as router_forward_kernel. Every lane of a token computes the same k-long ds (k ≤ 8),
// then writes its experts.
template <int LANES>
__global__ void __launch_bounds__(ROUTER_BLOCK) router_backward_kernel(float* dlogits, const float* dtopk_w,
                                                                       const float* scores, const int* topk_idx, int N,
                                                                       int E, int k, int score_fn, bool renorm) {
  const RouterLane<LANES> me;
  const int lane = me.lane, n = me.n;
  if (n >= N) return;
  const float* s_row = scores + (size_t)n * E;

  int sel_e[ROUTER_MAX_K];
  float sel_s[ROUTER_MAX_K], ds[ROUTER_MAX_K];
  float sum = 0.f;
#pragma unroll
  for (int j = 0; j < ROUTER_MAX_K; j++) {
    sel_e[j] = j < k ? topk_idx[(size_t)n * k + j] : -1;
    sel_s[j] = j < k ? s_row[sel_e[j]] : 0.f;
    ds[j] = j < k ? dtopk_w[(size_t)n * k + j] : 0.f;
    sum += sel_s[j];
  }
  if (renorm) {
    float dw_dot_w = 0.f;  // Σ_m dw_m · w_m
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_K; j++) dw_dot_w += ds[j] * (sel_s[j] / sum);
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_K; j++) ds[j] = j < k ? (ds[j] - dw_dot_w) / sum : 0.f;
  }
  float s_dot_ds = 0.f;  // Σ_f s_f ds_f (softmax only)
#pragma unroll
  for (int j = 0; j < ROUTER_MAX_K; j++) s_dot_ds += sel_s[j] * ds[j];

#pragma unroll
  for (int i = 0; i < ROUTER_SLOTS; i++) {
    int e = lane + LANES * i;
    if (e >= E) continue;
    float d = 0.f;
#pragma unroll
    for (int j = 0; j < ROUTER_MAX_K; j++)
      if (sel_e[j] == e) d += ds[j];
    float se = s_row[e];
    float dl = score_fn == ROUTER_SOFTMAX ? se * (d - s_dot_ds) : d * se * (1.f - se);
    dlogits[(size_t)n * E + e] = dl;
  }
}

// One thread per token: the combine weights of a given choice (a routing profile overriding the
// selection), the same arithmetic as router_forward_kernel's weights (sum in j order, then divide).
static __global__ void router_weights_kernel(float* topk_w, const float* scores, const int* topk_idx, int N, int E,
                                             int k, bool renorm) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  float sum = 0.f;
  for (int j = 0; j < k; j++) sum += scores[(size_t)n * E + topk_idx[(size_t)n * k + j]];
  for (int j = 0; j < k; j++) {
    float s = scores[(size_t)n * E + topk_idx[(size_t)n * k + j]];
    topk_w[(size_t)n * k + j] = renorm ? s / sum : s;
  }
}

#if defined(FLATMOE_BF16)
// The K width of the split dlogits: 3E parts rounded up to a multiple of 8 (16-byte rows of bf16).
inline int router_split_width(int E) { return (3 * E + 7) / 8 * 8; }

// The two operands of dx's product, in one launch. Threads [0, N·(K3 − 2E)): one per element of
// dlogits [N,E], its three bf16 parts, hi + mid + lo == d exactly (d − hi and d − hi − mid are exact
// in fp32, and the last remainder has at most 8 significant bits; values below 2^-100 in magnitude
// would lose bits to bf16's subnormals). Row n of parts [N, K3] is (hi[0..E), mid[0..E), lo[0..E),
// zeros up to K3): threads e in [E, E + K3 − 3E) of a row write the zeros. The threads after them:
// [W; W; W; 0] [K3,H] (=) from W [E,H], NV consecutive elements each (ROW_PIECE: H % 8 == 0 and W
// 16-byte aligned, which router_logits_backward demands): each of the split's three parts meets W,
// and its zero columns meet zero rows (the pool's bytes may hold NaN patterns).
static __global__ void router_split_kernel(__nv_bfloat16* parts, __nv_bfloat16* W_thrice, const float* dlogits,
                                           const __nv_bfloat16* W, int N, int E, int H, int K3) {
  const int per_row = E + (K3 - 3 * E);
  const size_t split_threads = (size_t)N * per_row;
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= split_threads) {  // a piece of [W; W; W; 0]
    constexpr int NV = ROW_PIECE;
    using P = Pack<__nv_bfloat16, NV>;
    const int pieces = H / NV;  // per row
    const size_t piece = i - split_threads;
    if (piece >= (size_t)K3 * pieces) return;
    const int row = (int)(piece / pieces), c = (int)(piece % pieces);
    P v;
    if (row < 3 * E) {
      v = reinterpret_cast<const P*>(W)[(size_t)(row % E) * pieces + c];
    } else {
#pragma unroll
      for (int e = 0; e < NV; e++) v.v[e] = __float2bfloat16_rn(0.f);
    }
    reinterpret_cast<P*>(W_thrice)[piece] = v;
    return;
  }
  const size_t n = i / per_row;
  const int e = (int)(i % per_row);
  __nv_bfloat16* row = parts + n * K3;
  if (e >= E) {
    row[2 * E + e] = __float2bfloat16_rn(0.f);
    return;
  }
  const float d = dlogits[n * E + e];
  const __nv_bfloat16 hi = __float2bfloat16_rn(d);
  const float after_hi = d - __bfloat162float(hi);
  const __nv_bfloat16 mid = __float2bfloat16_rn(after_hi);
  const __nv_bfloat16 lo = __float2bfloat16_rn(after_hi - __bfloat162float(mid));
  row[e] = hi;
  row[E + e] = mid;
  row[2 * E + e] = lo;
}

// dW [E,H] (+=): dW = bf16(float(dW) + ((ΔW_hi + ΔW_mid) + ΔW_lo)), one rounding; parts [3E,H] fp32.
static __global__ void router_fold_weight_grad_kernel(__nv_bfloat16* dW, const float* parts, size_t EH) {
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= EH) return;
  const float update = (parts[i] + parts[EH + i]) + parts[2 * EH + i];
  dW[i] = __float2bfloat16_rn(__bfloat162float(dW[i]) + update);
}
#endif

// Histogram in shared memory (E ints), then one integer atomic per expert per block.
// A routing profile's experts (data/routing_profile.hpp, routing_profile_indices: its twin): token i's
// slot j is (i + j) mod E (balanced), j mod h for the first hot_tokens tokens and h + (i + j) mod (E − h)
// for the others (hot:r/h, h > 0).
static __global__ void router_profile_choice_kernel(int* topk_idx, int N, int E, int k, int h, int hot_tokens) {
  const size_t slot = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  if (slot >= (size_t)N * k) return;
  const long long i = (long long)(slot / k), j = (long long)(slot % k);
  int e;
  if (h == 0) e = (int)((i + j) % E);
  else if (i < hot_tokens) e = (int)(j % h);
  else e = h + (int)((i + j) % (E - h));
  topk_idx[slot] = e;
}

static __global__ void router_count_loads_kernel(int* loads, const int* topk_idx, size_t routes, int E) {
  extern __shared__ int block_loads[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) block_loads[e] = 0;
  __syncthreads();
  for (size_t r = (size_t)blockIdx.x * blockDim.x + threadIdx.x; r < routes; r += (size_t)gridDim.x * blockDim.x) {
    int e = topk_idx[r];
    if (e >= 0 && e < E) atomicAdd(&block_loads[e], 1);  // indices from router_forward are always in range
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x)
    if (block_loads[e]) atomicAdd(&loads[e], block_loads[e]);
}

// ---------------------------------------------------------------------------------------------
// Launchers

inline void router_check_sizes(const char* op, int N, int E, int k, int score_fn) {
  if (N < 0 || E < 1 || E > ROUTER_MAX_E || k < 1 || k > ROUTER_MAX_K || k > E)
    fm_fail(op, "unsupported size: need 1 <= k <= min(E, 8) and E <= 256", "N=%d E=%d k=%d", N, E, k);
  if (score_fn != ROUTER_SOFTMAX && score_fn != ROUTER_SIGMOID)
    fm_fail(op, "score_fn must be 0 (softmax) or 1 (sigmoid)", "score_fn=%d", score_fn);
}

inline void router_check_logits_sizes(const char* op, int N, int H, int E) {
  if (N < 0 || H < 1 || E < 1) fm_fail(op, "need N >= 0, H >= 1, E >= 1", "N=%d H=%d E=%d", N, H, E);
}

// Workspace bytes that router_logits_backward, given a weight-gradient stream, leaves held until the
// caller joins it: the split dlogits [N,K3] bf16 and ΔW's fp32 parts [K3,H] (BF16 build); none in
// the FP32 build.
inline size_t router_logits_held_bytes(int N, int H, int E) {
#if defined(FLATMOE_BF16)
  const size_t K3 = router_split_width(E);
  return 2 * K3 * (size_t)N + 4 * K3 * (size_t)H;
#else
  (void)N, (void)H, (void)E;
  return 0;
#endif
}

// Workspace bytes that router_logits_backward holds at most at once (the forward holds none): in the
// BF16 build the held ones (the split dlogits, ΔW's fp32 parts) and [W; W; W] [K3,H] bf16 beside
// them (K3 = router_split_width(E)); none in the FP32 build.
inline size_t router_logits_workspace_bytes(int N, int H, int E) {
#if defined(FLATMOE_BF16)
  return router_logits_held_bytes(N, H, E) + 2 * (size_t)router_split_width(E) * H;
#else
  (void)N, (void)H, (void)E;
  return 0;
#endif
}

// logits [N,E] (=, fp32) = x [N,H] · W [E,H]ᵀ: an fp32 GEMM on the floatX operands (see Precision).
inline void router_logits_forward(float* logits, const floatX* x, const floatX* W, int N, int H, int E,
                                  cudaStream_t stream) {
  router_check_logits_sizes("router_logits_forward", N, H, E);
  if (N == 0) return;
  matmul_forward(logits, x, W, N, H, E, stream);
}

// topk_idx [N,k] (=), topk_w [N,k] (=), scores [N,E] (=, saved for backward) from logits [N,E], bias [E].
// loads [E] (+=; nullptr: none): the routes of this choice per expert, as router_add_loads adds them.
inline void router_forward(int* topk_idx, float* topk_w, float* scores, const float* logits, const float* bias,
                           int N, int E, int k, int score_fn, bool renorm, cudaStream_t stream, int* loads = nullptr) {
  router_check_sizes("router_forward", N, E, k, score_fn);
  if (N == 0) return;
  auto* kernel = router_kernel_for(E, router_forward_kernel<1>, router_forward_kernel<2>, router_forward_kernel<4>,
                                   router_forward_kernel<8>, router_forward_kernel<16>, router_forward_kernel<32>);
  const dim3 grid(ceil_div((size_t)N * router_lanes(E), ROUTER_BLOCK)), block(ROUTER_BLOCK);
  kernel<<<grid, block, 0, stream>>>(topk_idx, topk_w, scores, loads, logits, bias, N, E, k, score_fn, renorm);
  launchCheck("router_forward", "N=%d E=%d k=%d", N, E, k);
}

// dlogits [N,E] (=) from dtopk_w [N,k] and the forward's scores and topk_idx.
inline void router_backward(float* dlogits, const float* dtopk_w, const float* scores, const int* topk_idx,
                            int N, int E, int k, int score_fn, bool renorm, cudaStream_t stream) {
  router_check_sizes("router_backward", N, E, k, score_fn);
  if (N == 0) return;
  auto* kernel = router_kernel_for(E, router_backward_kernel<1>, router_backward_kernel<2>, router_backward_kernel<4>,
                                   router_backward_kernel<8>, router_backward_kernel<16>, router_backward_kernel<32>);
  const dim3 grid(ceil_div((size_t)N * router_lanes(E), ROUTER_BLOCK)), block(ROUTER_BLOCK);
  kernel<<<grid, block, 0, stream>>>(dlogits, dtopk_w, scores, topk_idx, N, E, k, score_fn, renorm);
  launchCheck("router_backward", "N=%d E=%d k=%d", N, E, k);
}

// dx [N,H] (+=) dlogits [N,E] · W [E,H]: the product and float(dx) summed in fp32, rounded once to floatX;
// dW [E,H] (+=) dlogitsᵀ · x: ΔW summed in fp32, then added to dW with one rounding.
// BF16 build: through dlogits' three bf16 parts (see Precision), Workspace freed before return; dx
// needs H % 8 == 0 (the grouped GEMM's kernel), else it is refused.
// weight_grads (runtime/side_stream.cuh; nullptr: none): dW's product (and its fold) runs there, beside
// dx's and the caller's next work; the split dlogits and ΔW's parts are held until the caller joins it,
// and x must stay until then.
inline void router_logits_backward(floatX* dx, floatX* dW, const float* dlogits, const floatX* x, const floatX* W,
                                   int N, int H, int E, cudaStream_t stream, SideStream* weight_grads = nullptr) {
  const char* op = "router_logits_backward";
  router_check_logits_sizes(op, N, H, E);
  if (N == 0) return;  // dx has no rows, ΔW = 0
#if defined(FLATMOE_BF16)
  if (H % 8)  // the grouped GEMM's kernel takes the product's N = H in 16-byte pieces
    fm_fail(op, "the BF16 build adds into dx in the grouped GEMM's kernel: H must be a multiple of 8", "N=%d H=%d E=%d",
            N, H, E);
  if (!pack_aligned(W, ROW_PIECE))  // its rows are copied in 16-byte pieces
    fm_fail(op, "the BF16 build copies W in 16-byte pieces: W must be 16-byte aligned", "N=%d H=%d E=%d W=%p", N, H, E,
            (const void*)W);
  const int K3 = router_split_width(E);
  const size_t K3H = (size_t)K3 * H, EH = (size_t)E * H;
  floatX* dlogits_parts = pool().alloc_t<floatX>((size_t)N * K3, Mem::Workspace, "router_logits_backward.dlogits_parts");
  DeviceBuffer<floatX> W_thrice(K3H, Mem::Workspace, "router_logits_backward.W_thrice");
  router_split_kernel<<<ceil_div((size_t)N * (K3 - 2 * E) + K3H / ROW_PIECE, 256), 256, 0, stream>>>(
      dlogits_parts, W_thrice.ptr, dlogits, W, N, E, H, K3);
  launchCheck(op, "split N=%d E=%d H=%d K3=%d", N, E, H, K3);
  // ΔW's parts [K3,H] = [hi mid lo 0]ᵀ · x (the last K3 − 3E rows zero), folded into dW
  float* dW_parts = pool().alloc_t<float>(K3H, Mem::Workspace, "router_logits_backward.dW_parts");
  side_run(weight_grads, stream, "router_logits_backward.dW", [&](cudaStream_t s) {
    matmul_backward_dW(dW_parts, dlogits_parts, x, N, H, K3, s, /*accumulate=*/false);
    router_fold_weight_grad_kernel<<<ceil_div(EH, 256), 256, 0, s>>>(dW, dW_parts, EH);
    launchCheck(op, "fold E=%d H=%d", E, H);
  });
  {  // dx += [hi mid lo 0] · [W; W; W; 0]
    const GroupedGemmProblems product{{{dlogits_parts, W_thrice.ptr, dx, N, H, K3}}};
    if (!grouped_gemm_takes_kernel(product, false, false, K3, H, H))  // cuBLAS's beta = 1 would round twice
      fm_fail(op, "the grouped GEMM's kernel does not take dx's product (dx must be 4-byte aligned)",
              "N=%d H=%d E=%d dx=%p", N, H, E, (void*)dx);
    grouped_gemm("router_logits_backward.dx", product, false, false, K3, H, H, 1.f, stream);
  }
  side_hold(weight_grads, dW_parts);
  side_hold(weight_grads, dlogits_parts);
#else
  side_run(weight_grads, stream, "router_logits_backward.dW",
           [&](cudaStream_t s) { matmul_backward_dW(dW, dlogits, x, N, H, E, s); });
  matmul_backward_dx(dx, dlogits, W, N, H, E, stream, /*accumulate=*/true);  // fp32 throughout, one rounding each
#endif
}

// topk_idx [N,k] (=) of a routing profile, made on the device (no copy from the host, so a pass captured as a
// CUDA graph replays it): the same indices as routing_profile_indices, refusing the same sizes (routing_profile_refusal).
inline void router_profile_choice(int* topk_idx, const RoutingProfile& p, int N, int E, int k, cudaStream_t stream) {
  const std::string refused = routing_profile_refusal(p, N, E, k);
  if (!refused.empty()) fm_fail("router_profile_choice", refused.c_str(), "N=%d E=%d k=%d", N, E, k);
  if (N == 0) return;
  const int hot_tokens = routing_profile_hot_tokens(p, N);
  const size_t slots = (size_t)N * k;
  router_profile_choice_kernel<<<(unsigned)((slots + 255) / 256), 256, 0, stream>>>(
      topk_idx, N, E, k, p.kind == RoutingProfile::Hot ? p.h : 0, hot_tokens);
  launchCheck("router_profile_choice", "profile=%s N=%d E=%d k=%d", routing_profile_name(p).c_str(), N, E, k);
}

// topk_w [N,k] (=) for a choice topk_idx [N,k] made elsewhere (a routing profile): the selected
// scores, renormalised when renorm. The backward is router_backward with the same topk_idx.
inline void router_weights(float* topk_w, const float* scores, const int* topk_idx, int N, int E, int k, bool renorm,
                           cudaStream_t stream) {
  router_check_sizes("router_weights", N, E, k, ROUTER_SOFTMAX);
  if (N == 0) return;
  router_weights_kernel<<<ceil_div(N, 128), 128, 0, stream>>>(topk_w, scores, topk_idx, N, E, k, renorm);
  launchCheck("router_weights", "N=%d E=%d k=%d", N, E, k);
}

// loads [E] (+=): adds the number of routes in topk_idx [N,k] that select each expert. Integer
// atomics (exact, any order gives the same sums); no host wait — model.cuh accumulates a step's
// loads of every MoE layer in one device buffer this way and downloads it once per step.
inline void router_add_loads(int* loads, const int* topk_idx, int N, int E, int k, cudaStream_t stream) {
  if (N < 0 || E < 1 || E > ROUTER_MAX_E || k < 1)
    fm_fail("router_add_loads", "unsupported size: need N >= 0, 1 <= E <= 256, k >= 1", "N=%d E=%d k=%d", N, E, k);
  size_t routes = (size_t)N * k;
  if (routes == 0) return;
  int blocks = (int)std::min<size_t>((routes + 255) / 256, 1024);
  router_count_loads_kernel<<<blocks, 256, (size_t)E * sizeof(int), stream>>>(loads, topk_idx, routes, E);
  launchCheck("router_add_loads", "N=%d E=%d k=%d", N, E, k);
}

// loads [E] (=): number of routes in topk_idx [N,k] that select each expert.
inline void router_count_loads(int* loads, const int* topk_idx, int N, int E, int k, cudaStream_t stream) {
  if (N < 0 || E < 1 || E > ROUTER_MAX_E || k < 1)
    fm_fail("router_count_loads", "unsupported size: need N >= 0, 1 <= E <= 256, k >= 1", "N=%d E=%d k=%d", N, E, k);
  cudaCheck(cudaMemsetAsync(loads, 0, (size_t)E * sizeof(int), stream), "router_count_loads", "E=%d", E);
  router_add_loads(loads, topk_idx, N, E, k, stream);
}
