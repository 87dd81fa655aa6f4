// moe.cuh — dropless Mixture-of-Experts SwiGLU FFN on one GPU (notes/design.md §2, §6.1 without the
// exchange). Twin of ref/moe.hpp. Every (token, expert) route is computed: no capacity, no padding.
//
// Shapes: x [N,H]; topk_idx [N,k] int; topk_w [N,k] float; W13 [E,2I,H] (rows 0..I−1 of expert e =
// W1 "gate", rows I..2I−1 = W3 "up"); W2 [E,H,I]; out [N,H]. R = N·k routes; route r = n·k + j goes
// to expert topk_idx[n,j] with weight topk_w[n,j].
//   Expert e on its R_e routes:  h13 = xp W13_eᵀ [R_e,2I];  a = silu(h1) ⊙ h3 [R_e,I];  y = a W2_eᵀ [R_e,H]
//   out[n] = Σ_j topk_w[n,j] · y[route n·k+j]   (fixed j order, fp32 accumulation)
// Backward:
//   dtopk_w[n,j] = dout[n] · y[r];  dy_r = topk_w[n,j] · dout[n];  da = dy W2_e;  dW2_e += dyᵀ a
//   dh1 = da ⊙ h3 ⊙ silu'(h1);  dh3 = da ⊙ silu(h1);  dxp = dh W13_e;  dW13_e += dhᵀ xp
//   dx[n] = Σ_j dxp[route n·k+j]   (fixed j order, no atomics)
// Gradient outputs: dx (=), dtopk_w (=), dW13 (+=), dW2 (+=).
//
// Schedule (pieces are separate launchers, reused by the expert-parallel versions):
//   moe_route_plan       routes sorted by expert, stable (ascending route index inside an expert):
//                        route_of_slot / slot_of_route; returns the per-expert counts on the host
//   moe_permute_rows     xp[s] = x[route_of_slot[s] / k]
//   grouped_gemm         ops/grouped_gemm.cuh, one problem per expert with ≥ 1 route: one launch of
//                        flatmoe's tensor-core kernel per GEMM (BF16), one cublasGemmGroupedBatchedEx (FP32)
//   swiglu_forward/backward, moe_combine (weighted or plain sum over the k slots), moe_combine_backward;
//                        their window forms (moe_combine_window_add, moe_combine_backward_window) take only
//                        the routes of a range of sorted slots: one ring hop's (ops/relay_moe.cuh)
// Live set (b = bytes per floatX): saved between forward and backward: route maps 2·R·4 B (Dispatch),
// h13 R·2I·b (ExpertIntermediates), y R·H·b (Dispatch). Forward temporaries on top: xp R·H·b
// (Dispatch) and a R·I·b (ExpertIntermediates), plus the plan's ceil(R/256)·E·4 B and cuBLAS's
// pointer arrays (Workspace, FP32 build). Backward temporaries on top: one R·H·b row buffer at a time (dy, dxp, xp; Dispatch)
// and at most R·3I·b of per-route hidden state (ExpertIntermediates). All temporaries are freed
// before each launcher returns. Under skew nothing here is bounded except by R = N·k.
// Determinism: integer atomics only (counting); every float sum has a fixed order; the grouped GEMMs
// are deterministic for a fixed problem list.
// Profiling (runtime/profile.cuh): each piece below opens a sub-range of its caller's range with
// prof_sub (nothing when the profiler is off), with the bytes its memory-bound kernels move.
// BF16 build: the grouped GEMMs need 16-byte aligned bf16 rows (ops/grouped_gemm.cuh); H and I
// multiples of 8 (config.hpp) with pool-allocated tensors always satisfy it.
#pragma once
#include <algorithm>
#include <climits>
#include <cstring>
#include <memory>
#include <vector>
#include "common.cuh"
#include "grouped_gemm.cuh"
#include "../runtime/pool.cuh"
#include "../runtime/profile.cuh"

static const int MOE_PLAN_TILE = 256;          // routes per tile of the stable sort
static const int MOE_MAX_E = 12288;            // the plan keeps one int per expert in shared memory (48 KiB)
static const int MOE_WARPS_PER_BLOCK = 8;      // routes per block in moe_combine_backward

// ---------------------------------------------------------------------------------------------
// Kernels: routing plan (stable counting sort of the routes by expert)

// Grid: one block of MOE_PLAN_TILE threads per tile of routes; dynamic shared memory E ints.
// tile_counts [tiles,E] (=): routes of each expert in the tile; bad_routes (+=): indices outside [0,E).
static __global__ void moe_plan_count_kernel(int* tile_counts, int* bad_routes, const int* topk_idx, int R, int E) {
  extern __shared__ int tile_hist[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) tile_hist[e] = 0;
  __syncthreads();
  int r = blockIdx.x * MOE_PLAN_TILE + threadIdx.x;
  if (r < R) {
    int e = topk_idx[r];
    if (e >= 0 && e < E) atomicAdd(&tile_hist[e], 1);
    else atomicAdd(bad_routes, 1);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) tile_counts[(size_t)blockIdx.x * E + e] = tile_hist[e];
}

// One block. tile_counts becomes, in place, the exclusive prefix over tiles per expert (routes of
// expert e in the tiles before this one); expert_counts [E] (=) the totals; expert_offsets [E] (=)
// their exclusive prefix over experts (first sorted slot of each expert).
static __global__ void moe_plan_scan_kernel(int* tile_counts, int* expert_counts, int* expert_offsets, int tiles, int E) {
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    int running = 0;
    for (int t = 0; t < tiles; t++) {
      int c = tile_counts[(size_t)t * E + e];
      tile_counts[(size_t)t * E + e] = running;
      running += c;
    }
    expert_counts[e] = running;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int offset = 0;
    for (int e = 0; e < E; e++) {
      expert_offsets[e] = offset;
      offset += expert_counts[e];
    }
  }
}

// Grid as moe_plan_count_kernel. Slot of route r = first slot of its expert + routes of that expert
// in earlier tiles + routes of that expert earlier in this tile: a stable sort.
static __global__ void moe_plan_rank_kernel(int* route_of_slot, int* slot_of_route, const int* topk_idx,
                                            const int* tile_prefix, const int* expert_offsets, int R, int E) {
  __shared__ int tile_expert[MOE_PLAN_TILE];
  int t = threadIdx.x;
  int r = blockIdx.x * MOE_PLAN_TILE + t;
  tile_expert[t] = r < R ? topk_idx[r] : -1;
  __syncthreads();
  if (r >= R) return;
  int e = tile_expert[t];
  if (e < 0 || e >= E) return;  // refused by the host check, or by the caller's own count (moe_route_sort)
  int rank = 0;
  for (int u = 0; u < t; u++) rank += tile_expert[u] == e;
  int slot = expert_offsets[e] + tile_prefix[(size_t)blockIdx.x * E + e] + rank;
  slot_of_route[r] = slot;
  route_of_slot[slot] = r;
}

// ---------------------------------------------------------------------------------------------
// Kernels: row movement, activation, combine

// rows [R,H] (=): rows[s] = x[route_of_slot[s] / k]. One thread per NV consecutive elements of a
// row (NV = ROW_PIECE, or 1 when rows are not whole pieces; see common.cuh).
template <int NV>
static __global__ void moe_permute_rows_kernel(floatX* rows, const floatX* x, const int* route_of_slot, int R, int H, int k) {
  const int pieces = H / NV;  // per row
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)R * pieces) return;
  const size_t s = i / pieces;
  const int c = (int)(i % pieces);
  const size_t n = route_of_slot[s] / k;
  reinterpret_cast<Pack<floatX, NV>*>(rows)[i] = reinterpret_cast<const Pack<floatX, NV>*>(x)[n * pieces + c];
}

// a [R,I] (=) = silu(h13[:, :I]) ⊙ h13[:, I:]. One thread per NV consecutive elements of a (NV =
// ROW_PIECE, or 1; see common.cuh).
template <int NV>
static __global__ void swiglu_forward_kernel(floatX* a, const floatX* h13, int R, int I) {
  using P = Pack<floatX, NV>;
  const int pieces = I / NV;  // per row of a
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)R * pieces) return;
  const size_t r = i / pieces;
  const int c = (int)(i % pieces);
  const P h1 = reinterpret_cast<const P*>(h13)[r * 2 * pieces + c];
  const P h3 = reinterpret_cast<const P*>(h13)[r * 2 * pieces + pieces + c];
  P out;
#pragma unroll
  for (int e = 0; e < NV; e++) {
    const float g = to_float(h1.v[e]), u = to_float(h3.v[e]);
    out.v[e] = from_float<floatX>(g / (1.f + expf(-g)) * u);
  }
  reinterpret_cast<P*>(a)[i] = out;
}

// dh13 [R,2I] (=): dh1 = da ⊙ h3 ⊙ silu'(h1), dh3 = da ⊙ silu(h1). One thread per NV consecutive
// elements of da (NV = ROW_PIECE, or 1).
template <int NV>
static __global__ void swiglu_backward_kernel(floatX* dh13, const floatX* da, const floatX* h13, int R, int I) {
  using P = Pack<floatX, NV>;
  const int pieces = I / NV;  // per row of da
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)R * pieces) return;
  const size_t r = i / pieces;
  const int c = (int)(i % pieces);
  const P h1 = reinterpret_cast<const P*>(h13)[r * 2 * pieces + c];
  const P h3 = reinterpret_cast<const P*>(h13)[r * 2 * pieces + pieces + c];
  const P d = reinterpret_cast<const P*>(da)[i];
  P dh1, dh3;
#pragma unroll
  for (int e = 0; e < NV; e++) {
    const float g = to_float(h1.v[e]), u = to_float(h3.v[e]), dv = to_float(d.v[e]);
    const float sig = 1.f / (1.f + expf(-g));
    dh1.v[e] = from_float<floatX>(dv * u * sig * (1.f + g * (1.f - sig)));
    dh3.v[e] = from_float<floatX>(dv * g * sig);
  }
  reinterpret_cast<P*>(dh13)[r * 2 * pieces + c] = dh1;
  reinterpret_cast<P*>(dh13)[r * 2 * pieces + pieces + c] = dh3;
}

// out [N,H]: sum[n] = Σ_j w_j · rows[slot_of_route[n·k+j] − slot_first] over the routes whose slot
// lies in the window [slot_first, slot_first + slot_count) (the whole [0, R) for moe_combine), j
// ascending, fp32; w_j = topk_w[n,j] when WEIGHTED, else 1. ACCUMULATE: out[n] (+=) sum (a ring hop's
// routes added into a running output, ops/relay_moe.cuh); else out[n] (=) sum. One thread per NV
// consecutive elements of out (NV = ROW_PIECE, or 1; see common.cuh): it reads a token's k slots and
// weights once for all NV.
template <bool WEIGHTED, bool ACCUMULATE, int NV, typename TOut>
static __global__ void moe_combine_kernel(TOut* out, const floatX* rows, const int* slot_of_route, const float* topk_w,
                                          int N, int H, int k, int slot_first, int slot_count) {
  const int pieces = H / NV;  // per row
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)N * pieces) return;
  const size_t n = i / pieces;
  const int c = (int)(i % pieces);
  float acc[NV];
#pragma unroll
  for (int e = 0; e < NV; e++) acc[e] = 0.f;
  for (int j = 0; j < k; j++) {
    const size_t r = n * k + j;
    const int s = slot_of_route[r] - slot_first;
    if ((unsigned)s >= (unsigned)slot_count) continue;
    const float w = WEIGHTED ? topk_w[r] : 1.f;
    const Pack<floatX, NV> v = reinterpret_cast<const Pack<floatX, NV>*>(rows)[(size_t)s * pieces + c];
#pragma unroll
    for (int e = 0; e < NV; e++) acc[e] += WEIGHTED ? w * to_float(v.v[e]) : to_float(v.v[e]);
  }
  Pack<TOut, NV>& o = reinterpret_cast<Pack<TOut, NV>*>(out)[i];
  Pack<TOut, NV> result;
  if (ACCUMULATE) result = o;
#pragma unroll
  for (int e = 0; e < NV; e++) result.v[e] = from_float<TOut>(ACCUMULATE ? to_float(result.v[e]) + acc[e] : acc[e]);
  o = result;
}

// One warp per route r (sorted slot s = slot_of_route[r] − slot_first, token n = r / k); routes whose
// slot lies outside the window [slot_first, slot_first + slot_count) are left alone:
// dy [slot_count,H] (=): dy[s] = topk_w[r] · dout[n];  dtopk_w [R] (=): dout[n] · y[s] (lane-strided
// partial sums over pieces of NV elements, NV = ROW_PIECE or 1, then a fixed xor butterfly). dy may be
// y itself (each lane reads a piece of y[s] before it writes that piece of dy[s]).
template <int NV>
static __global__ void moe_combine_backward_kernel(floatX* dy, float* dtopk_w, const floatX* dout, const floatX* y,
                                                   const int* slot_of_route, const float* topk_w, int R, int H, int k,
                                                   int slot_first, int slot_count) {
  using P = Pack<floatX, NV>;
  const int lane = threadIdx.x & 31, pieces = H / NV;
  const int r = blockIdx.x * MOE_WARPS_PER_BLOCK + (threadIdx.x >> 5);
  if (r >= R) return;  // r is the same for the whole warp
  const int window_slot = slot_of_route[r] - slot_first;
  if ((unsigned)window_slot >= (unsigned)slot_count) return;  // the same for the whole warp too
  const P* dout_n = reinterpret_cast<const P*>(dout + (size_t)(r / k) * H);
  const size_t s = window_slot;
  const P* y_s = reinterpret_cast<const P*>(y + s * H);
  P* dy_s = reinterpret_cast<P*>(dy + s * H);
  const float w = topk_w[r];
  float dot = 0.f;
  for (int c = lane; c < pieces; c += 32) {
    const P g = dout_n[c], yv = y_s[c];
    P d;
#pragma unroll
    for (int e = 0; e < NV; e++) {
      dot += to_float(g.v[e]) * to_float(yv.v[e]);
      d.v[e] = from_float<floatX>(w * to_float(g.v[e]));
    }
    dy_s[c] = d;
  }
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, o);
  if (lane == 0) dtopk_w[r] = dot;
}

// topk_idx [N] (=) 0, topk_w [N] (=) 1: the routing of a dense FFN (E = 1, k = 1).
static __global__ void dense_routes_kernel(int* topk_idx, float* topk_w, int N) {
  int n = blockIdx.x * blockDim.x + threadIdx.x;
  if (n >= N) return;
  topk_idx[n] = 0;
  topk_w[n] = 1.f;
}

// ---------------------------------------------------------------------------------------------
// Launchers: pieces

// Sorts the R routes of topk_idx [R] by expert, stably: route_of_slot [R] (=) sorted position ->
// route, slot_of_route [R] (=) route -> sorted position. Expert e owns the sorted positions
// [offset_e, offset_e + count_e), offset = exclusive prefix of count.
// With host_counts: the E per-expert counts come to the host into *host_counts, and expert indices
// outside [0,E) are refused (one D2H copy of E+1 ints: synchronises `stream` once; the grouped
// GEMMs take their sizes from host memory). Without: nothing leaves the GPU and the host does not wait
// — for a caller that counted the routes and checked the indices itself (ops/pipelined_llep.cuh:
// every chunk's counts in one copy); a route outside [0,E) then gets no slot.
inline void moe_route_sort(int* route_of_slot, int* slot_of_route, const int* topk_idx, int R, int E, cudaStream_t stream,
                           std::vector<int>* host_counts) {
  if (E < 1 || E > MOE_MAX_E) fm_fail("moe_route_sort", "need 1 <= E <= 12288 (one int per expert in shared memory)", "R=%d E=%d", R, E);
  if (host_counts) host_counts->assign(E, 0);
  if (R == 0) return;
  const int tiles = ceil_div(R, MOE_PLAN_TILE);
  // plan_ints: [0,E) counts, [E] bad routes, [E+1, 2E+1) offsets
  int* plan_ints = pool().alloc_t<int>(2 * (size_t)E + 1, Mem::Workspace, "moe_route_sort.counts");
  int* tile_counts = pool().alloc_t<int>((size_t)tiles * E, Mem::Workspace, "moe_route_sort.tile_counts");
  int* counts = plan_ints;
  int* bad_routes = plan_ints + E;
  int* offsets = plan_ints + E + 1;
  cudaCheck(cudaMemsetAsync(bad_routes, 0, sizeof(int), stream), "moe_route_sort", "R=%d E=%d", R, E);
  moe_plan_count_kernel<<<tiles, MOE_PLAN_TILE, (size_t)E * sizeof(int), stream>>>(tile_counts, bad_routes, topk_idx, R, E);
  launchCheck("moe_route_sort.count", "R=%d E=%d", R, E);
  moe_plan_scan_kernel<<<1, 256, 0, stream>>>(tile_counts, counts, offsets, tiles, E);
  launchCheck("moe_route_sort.scan", "R=%d E=%d", R, E);
  if (host_counts) {
    host_counts->resize(E + 1);
    copy_to_host(host_counts->data(), plan_ints, (E + 1) * sizeof(int), stream, "moe_route_sort");
    if (host_counts->back() != 0)
      fm_fail("moe_route_sort", "expert index outside [0, E) in topk_idx", "R=%d E=%d bad_routes=%d", R, E, host_counts->back());
    host_counts->pop_back();
  }
  moe_plan_rank_kernel<<<tiles, MOE_PLAN_TILE, 0, stream>>>(route_of_slot, slot_of_route, topk_idx, tile_counts, offsets, R, E);
  launchCheck("moe_route_sort.rank", "R=%d E=%d", R, E);
  pool().free(tile_counts);
  pool().free(plan_ints);
}

// moe_route_sort with the counts on the host (synchronises `stream` once); returns count [E].
inline std::vector<int> moe_route_plan(int* route_of_slot, int* slot_of_route, const int* topk_idx, int R, int E,
                                       cudaStream_t stream) {
  std::vector<int> counts;
  moe_route_sort(route_of_slot, slot_of_route, topk_idx, R, E, stream, &counts);
  return counts;
}

// rows [R,H] (=): rows[s] = x[route_of_slot[s] / k]; x [N,H].
inline void moe_permute_rows(floatX* rows, const floatX* x, const int* route_of_slot, int R, int H, int k,
                             cudaStream_t stream) {
  if ((size_t)R * H == 0) return;
  if (row_pieces(H, {rows, x}))
    moe_permute_rows_kernel<ROW_PIECE><<<ceil_div((size_t)R * (H / ROW_PIECE), 256), 256, 0, stream>>>(rows, x, route_of_slot, R, H, k);
  else
    moe_permute_rows_kernel<1><<<ceil_div((size_t)R * H, 256), 256, 0, stream>>>(rows, x, route_of_slot, R, H, k);
  launchCheck("moe_permute_rows", "R=%d H=%d k=%d", R, H, k);
}

// a [R,I] (=) = silu(h13[:, :I]) ⊙ h13[:, I:]; h13 [R,2I].
inline void swiglu_forward(floatX* a, const floatX* h13, int R, int I, cudaStream_t stream) {
  if ((size_t)R * I == 0) return;
  if (row_pieces(I, {a, h13}))
    swiglu_forward_kernel<ROW_PIECE><<<ceil_div((size_t)R * (I / ROW_PIECE), 256), 256, 0, stream>>>(a, h13, R, I);
  else
    swiglu_forward_kernel<1><<<ceil_div((size_t)R * I, 256), 256, 0, stream>>>(a, h13, R, I);
  launchCheck("swiglu_forward", "R=%d I=%d", R, I);
}

// dh13 [R,2I] (=) from da [R,I] and h13 [R,2I].
inline void swiglu_backward(floatX* dh13, const floatX* da, const floatX* h13, int R, int I, cudaStream_t stream) {
  if ((size_t)R * I == 0) return;
  if (row_pieces(I, {dh13, da, h13}))
    swiglu_backward_kernel<ROW_PIECE><<<ceil_div((size_t)R * (I / ROW_PIECE), 256), 256, 0, stream>>>(dh13, da, h13, R, I);
  else
    swiglu_backward_kernel<1><<<ceil_div((size_t)R * I, 256), 256, 0, stream>>>(dh13, da, h13, R, I);
  launchCheck("swiglu_backward", "R=%d I=%d", R, I);
}

// moe_combine_kernel over the window [slot_first, slot_first + slot_count), weighted when topk_w is
// given, in pieces of ROW_PIECE elements when H and the buffers allow.
template <bool ACCUMULATE, typename TOut>
inline void moe_combine_launch(TOut* out, const floatX* rows, const int* slot_of_route, const float* topk_w, int slot_first,
                               int slot_count, int N, int H, int k, cudaStream_t stream) {
  const bool pieces = row_pieces(H, {rows}) && pack_aligned(out, ROW_PIECE);
  const int grid = ceil_div((size_t)N * (pieces ? H / ROW_PIECE : H), 256);
  if (pieces && topk_w)
    moe_combine_kernel<true, ACCUMULATE, ROW_PIECE><<<grid, 256, 0, stream>>>(out, rows, slot_of_route, topk_w, N, H, k, slot_first, slot_count);
  else if (pieces)
    moe_combine_kernel<false, ACCUMULATE, ROW_PIECE><<<grid, 256, 0, stream>>>(out, rows, slot_of_route, topk_w, N, H, k, slot_first, slot_count);
  else if (topk_w)
    moe_combine_kernel<true, ACCUMULATE, 1><<<grid, 256, 0, stream>>>(out, rows, slot_of_route, topk_w, N, H, k, slot_first, slot_count);
  else
    moe_combine_kernel<false, ACCUMULATE, 1><<<grid, 256, 0, stream>>>(out, rows, slot_of_route, topk_w, N, H, k, slot_first, slot_count);
}

// out [N,H] (=): out[n] = Σ_j topk_w[n,j] · rows[slot_of_route[n·k+j]] (j ascending, fp32);
// topk_w == nullptr means every weight is 1 (the plain sum, used for dx).
inline void moe_combine(floatX* out, const floatX* rows, const int* slot_of_route, const float* topk_w, int N, int H,
                        int k, cudaStream_t stream) {
  if ((size_t)N * H == 0) return;
  moe_combine_launch<false>(out, rows, slot_of_route, topk_w, 0, N * k, N, H, k, stream);
  launchCheck("moe_combine", "N=%d H=%d k=%d", N, H, k);
}

// acc [N,H] (+=, fp32): acc[n] += Σ_j topk_w[n,j] · rows[slot_of_route[n·k+j] − slot_first] over the
// routes whose sorted slot lies in [slot_first, slot_first + slot_count) (j ascending, fp32), rows
// [slot_count,H] holding those slots' rows; topk_w == nullptr: every weight is 1. A ring hop's share of
// moe_combine (ops/relay_moe.cuh): over hops that cover every slot once, acc gains moe_combine's sum,
// added in hop order.
inline void moe_combine_window_add(float* acc, const floatX* rows, const int* slot_of_route, const float* topk_w,
                                   int slot_first, int slot_count, int N, int H, int k, cudaStream_t stream) {
  if ((size_t)N * H == 0 || slot_count == 0) return;
  moe_combine_launch<true>(acc, rows, slot_of_route, topk_w, slot_first, slot_count, N, H, k, stream);
  launchCheck("moe_combine_window_add", "N=%d H=%d k=%d slot_first=%d slot_count=%d", N, H, k, slot_first, slot_count);
}

// moe_combine_backward_kernel over the window [slot_first, slot_first + slot_count), in pieces of
// ROW_PIECE elements when H and the buffers allow.
inline void moe_combine_backward_launch(floatX* dy, float* dtopk_w, const floatX* dout, const floatX* y,
                                        const int* slot_of_route, const float* topk_w, int slot_first, int slot_count,
                                        int R, int H, int k, cudaStream_t stream) {
  const int grid = ceil_div(R, MOE_WARPS_PER_BLOCK), threads = 32 * MOE_WARPS_PER_BLOCK;
  if (row_pieces(H, {dy, dout, y}))
    moe_combine_backward_kernel<ROW_PIECE><<<grid, threads, 0, stream>>>(dy, dtopk_w, dout, y, slot_of_route, topk_w, R, H, k,
                                                                        slot_first, slot_count);
  else
    moe_combine_backward_kernel<1><<<grid, threads, 0, stream>>>(dy, dtopk_w, dout, y, slot_of_route, topk_w, R, H, k,
                                                                slot_first, slot_count);
}

// dy [R,H] (=, sorted order) and dtopk_w [N,k] (=) from dout [N,H] and the expert outputs y [R,H].
inline void moe_combine_backward(floatX* dy, float* dtopk_w, const floatX* dout, const floatX* y, const int* slot_of_route,
                                 const float* topk_w, int N, int H, int k, cudaStream_t stream) {
  int R = N * k;
  if (R == 0) return;
  moe_combine_backward_launch(dy, dtopk_w, dout, y, slot_of_route, topk_w, 0, R, R, H, k, stream);
  launchCheck("moe_combine_backward", "N=%d H=%d k=%d", N, H, k);
}

// moe_combine_backward on the routes whose sorted slot lies in [slot_first, slot_first + slot_count):
// dy [slot_count,H] (=) and those routes' dtopk_w (=) from the window's expert outputs y
// [slot_count,H]; dy may be y (in place). The other routes' dtopk_w are left as they are.
inline void moe_combine_backward_window(floatX* dy, float* dtopk_w, const floatX* dout, const floatX* y,
                                        const int* slot_of_route, const float* topk_w, int slot_first, int slot_count,
                                        int N, int H, int k, cudaStream_t stream) {
  int R = N * k;
  if (R == 0 || slot_count == 0) return;
  moe_combine_backward_launch(dy, dtopk_w, dout, y, slot_of_route, topk_w, slot_first, slot_count, R, H, k, stream);
  launchCheck("moe_combine_backward_window", "N=%d H=%d k=%d slot_first=%d slot_count=%d", N, H, k, slot_first, slot_count);
}

// topk_idx [N] (=) 0 and topk_w [N] (=) 1: the trivial routing (E = 1, k = 1) under which
// moe_forward / moe_backward compute a dense SwiGLU FFN (dense layers, shared expert).
inline void dense_routes(int* topk_idx, float* topk_w, int N, cudaStream_t stream) {
  if (N == 0) return;
  dense_routes_kernel<<<ceil_div(N, 256), 256, 0, stream>>>(topk_idx, topk_w, N);
  launchCheck("dense_routes", "N=%d", N);
}

// ---------------------------------------------------------------------------------------------
// Launchers: the MoE FFN

// What backward needs; allocated from the pool by moe_forward, freed by moe_saved_free.
struct MoESaved {
  int N = 0, H = 0, I = 0, E = 0, k = 0;
  std::vector<int> expert_counts;   // [E] host: routes per expert
  std::vector<int> expert_offsets;  // [E] host: first sorted position of each expert
  int* route_of_slot = nullptr;     // [N·k] device: sorted position -> route index r  (Dispatch)
  int* slot_of_route = nullptr;     // [N·k] device: route index r -> sorted position  (Dispatch)
  floatX* h13 = nullptr;            // [N·k, 2I] sorted order                          (ExpertIntermediates)
  floatX* y = nullptr;              // [N·k, H] expert outputs before weighting, sorted (Dispatch)
};

inline void moe_saved_free(MoESaved& saved) {
  pool().free(saved.route_of_slot);
  pool().free(saved.slot_of_route);
  pool().free(saved.h13);
  pool().free(saved.y);
  saved = MoESaved();
}

// One grouped-GEMM problem per expert with at least one row (rows [offsets[e], offsets[e] + counts[e])
// of the expert-sorted buffers); make(e, first_row, rows) builds it. Shared with ops/ep_moe.cuh.
template <typename F>
std::vector<GroupedGemmProblem> expert_problems(const std::vector<int>& counts, const std::vector<int>& offsets, F make) {
  std::vector<GroupedGemmProblem> problems;
  for (size_t e = 0; e < counts.size(); e++)
    if (counts[e] > 0) problems.push_back(make((int)e, (size_t)offsets[e], counts[e]));
  return problems;
}

template <typename F>
std::vector<GroupedGemmProblem> moe_expert_problems(const MoESaved& saved, F make) {
  return expert_problems(saved.expert_counts, saved.expert_offsets, make);
}

// A pool buffer of `count` elements, or nullptr when count is 0 (a rank that receives no routes
// holds nothing, so the pool's live bytes match the closed forms exactly).
template <typename T>
T* alloc_rows(size_t count, Mem cat, const std::string& tag) {
  return count ? pool().alloc_t<T>(count, cat, tag.c_str()) : nullptr;
}

// The matrices of a stack [E, rows, cols] one by one: stack + e·rows·cols for e = 0..E−1. The
// experts' shared steps below take one weight pointer per group of routes, so that a group can also
// be an expert whose weights were lent by another rank (ops/llep.cuh).
template <typename T>
std::vector<T*> expert_slices(T* stack, int E, size_t stride) {
  std::vector<T*> slices(E);
  for (int e = 0; e < E; e++) slices[e] = stack + e * stride;
  return slices;
}

// The experts' second half, shared by moe_forward and the expert-parallel dispatchers: on R routes
// sorted by group (counts/offsets per group; group g computed with W2[g] [H,I]),
// y_g [R_g,H] (=) = swiglu(h13_g) [R_g,I] · W2_gᵀ. The activation a [R,I] lives only inside
// (ExpertIntermediates).
inline void experts_swiglu_down(floatX* y, const floatX* h13, const std::vector<const floatX*>& W2,
                                const std::vector<int>& counts, const std::vector<int>& offsets, int R, int H, int I,
                                const std::string& op, cudaStream_t stream) {
  floatX* a = alloc_rows<floatX>((size_t)R * I, Mem::ExpertIntermediates, op + ".a");
  prof_sub(stream, "swiglu", 3.0 * R * I * sizeof(floatX));
  swiglu_forward(a, h13, R, I, stream);
  prof_sub(stream, "grouped gemm y = a W2");
  grouped_gemm((op + ".y").c_str(), expert_problems(counts, offsets, [&](int e, size_t first, int rows) {
                 return GroupedGemmProblem{a + first * I, W2[e], y + first * H, rows, H, I};
               }),
               false, true, I, I, H, 0.f, stream);
  pool().free(a);
}

// The experts' backward down to the gate/up gradients, shared by moe_backward and the
// expert-parallel dispatchers, per group g (its weights W2[g], its gradient dW2[g]):
// da_g = dy_g · W2_g; dW2_g (+=) dy_gᵀ · a_g; returns dh13 [R,2I] = swiglu'(h13) ⊙ da
// (ExpertIntermediates, the caller frees it). Frees dy as soon as it is consumed, before dh13 is
// allocated, so that the two are never live together.
inline floatX* experts_backward_to_h13(floatX* dy, const std::vector<floatX*>& dW2, const floatX* h13,
                                       const std::vector<const floatX*>& W2, const std::vector<int>& counts,
                                       const std::vector<int>& offsets, int R, int H, int I, const std::string& op,
                                       cudaStream_t stream) {
  floatX* a = alloc_rows<floatX>((size_t)R * I, Mem::ExpertIntermediates, op + ".a");
  prof_sub(stream, "swiglu (a again)", 3.0 * R * I * sizeof(floatX));
  swiglu_forward(a, h13, R, I, stream);
  prof_sub(stream, "grouped gemms da, dW2");
  // da_e [R_e,I] = dy_e [R_e,H] · W2_e [H,I]
  floatX* da = alloc_rows<floatX>((size_t)R * I, Mem::ExpertIntermediates, op + ".da");
  grouped_gemm((op + ".da").c_str(), expert_problems(counts, offsets, [&](int e, size_t first, int rows) {
                 return GroupedGemmProblem{dy + first * H, W2[e], da + first * I, rows, I, H};
               }),
               false, false, H, I, I, 0.f, stream);
  // dW2_e [H,I] += dy_eᵀ [H,R_e] · a_e [R_e,I]
  grouped_gemm((op + ".dW2").c_str(), expert_problems(counts, offsets, [&](int e, size_t first, int rows) {
                 return GroupedGemmProblem{dy + first * H, a + first * I, dW2[e], H, I, rows};
               }),
               true, false, H, I, I, 1.f, stream);
  pool().free(a);
  pool().free(dy);
  floatX* dh13 = alloc_rows<floatX>((size_t)R * 2 * I, Mem::ExpertIntermediates, op + ".dh13");
  prof_sub(stream, "swiglu bwd", 5.0 * R * I * sizeof(floatX));
  swiglu_backward(dh13, da, h13, R, I, stream);
  pool().free(da);
  return dh13;
}

// out [N,H] (=; nullptr: no combine, only what backward needs — a layer's recomputation, whose
// output is already kept); fills `saved` (which must be empty: moe_saved_free it after backward).
// Synchronises `stream` once, in moe_route_plan (the per-expert counts go to the host: the
// grouped GEMMs take their problem sizes from the host) — except with dense_routes = true: the
// caller's topk_idx is dense_routes' (E = 1, k = 1, every route to expert 0), so the one count is N,
// known on the host, and nothing waits (a dense FFN layer, the shared expert: no host sync).
inline void moe_forward(floatX* out, MoESaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                        const floatX* W13, const floatX* W2, int N, int H, int I, int E, int k, cudaStream_t stream,
                        bool dense_routes = false) {
  if (N < 1 || H < 1 || I < 1 || E < 1 || k < 1)
    fm_fail("moe_forward", "every size must be >= 1", "N=%d H=%d I=%d E=%d k=%d", N, H, I, E, k);
  if ((long long)N * k > INT_MAX)
    fm_fail("moe_forward", "too many routes for int indices", "N=%d k=%d", N, k);
  if (saved.route_of_slot || saved.slot_of_route || saved.h13 || saved.y)
    fm_fail("moe_forward", "MoESaved still holds buffers: call moe_saved_free after backward", "N=%d H=%d I=%d E=%d k=%d", N, H, I, E, k);
  if (dense_routes && (E != 1 || k != 1))
    fm_fail("moe_forward", "dense_routes needs E = 1 and k = 1 (every route to expert 0)", "N=%d E=%d k=%d", N, E, k);
  const int R = N * k;
  const size_t w13_stride = (size_t)2 * I * H;
  saved.N = N; saved.H = H; saved.I = I; saved.E = E; saved.k = k;
  saved.route_of_slot = pool().alloc_t<int>(R, Mem::Dispatch, "moe.route_of_slot");
  saved.slot_of_route = pool().alloc_t<int>(R, Mem::Dispatch, "moe.slot_of_route");
  prof_sub(stream, dense_routes ? "route plan" : "route plan (host wait)");
  if (dense_routes) {  // the same stable sort (here the identity), its one count known without a download
    moe_route_sort(saved.route_of_slot, saved.slot_of_route, topk_idx, R, E, stream, nullptr);
    saved.expert_counts.assign(1, R);
  } else {
    saved.expert_counts = moe_route_plan(saved.route_of_slot, saved.slot_of_route, topk_idx, R, E, stream);
  }
  saved.expert_offsets.assign(E, 0);
  for (int e = 1; e < E; e++) saved.expert_offsets[e] = saved.expert_offsets[e - 1] + saved.expert_counts[e - 1];

  floatX* xp = pool().alloc_t<floatX>((size_t)R * H, Mem::Dispatch, "moe_forward.xp");
  prof_sub(stream, "permute", 2.0 * R * H * sizeof(floatX) + 4.0 * R);
  moe_permute_rows(xp, x, saved.route_of_slot, R, H, k, stream);
  // h13_e [R_e,2I] = xp_e [R_e,H] · W13_eᵀ
  saved.h13 = pool().alloc_t<floatX>((size_t)R * 2 * I, Mem::ExpertIntermediates, "moe.h13");
  prof_sub(stream, "grouped gemm h13 = xp W13");
  grouped_gemm("moe_forward.h13", moe_expert_problems(saved, [&](int e, size_t first, int rows) {
                 return GroupedGemmProblem{xp + first * H, W13 + e * w13_stride, saved.h13 + first * 2 * I, rows, 2 * I, H};
               }),
               false, true, H, H, 2 * I, 0.f, stream);
  pool().free(xp);
  // y_e [R_e,H] = swiglu(h13_e) [R_e,I] · W2_eᵀ
  saved.y = pool().alloc_t<floatX>((size_t)R * H, Mem::Dispatch, "moe.y");
  experts_swiglu_down(saved.y, saved.h13, expert_slices(W2, E, (size_t)H * I), saved.expert_counts, saved.expert_offsets,
                      R, H, I, "moe_forward", stream);
  if (out != nullptr) prof_sub(stream, "combine", ((double)R + N) * H * sizeof(floatX) + 8.0 * R);
  if (out != nullptr) moe_combine(out, saved.y, saved.slot_of_route, topk_w, N, H, k, stream);
}

// dx [N,H] (=), dtopk_w [N,k] (=), dW13 [E,2I,H] (+=), dW2 [E,H,I] (+=) from dout [N,H], the
// forward's saved state and inputs. Does not synchronise.
inline void moe_backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const MoESaved& saved,
                         const floatX* x, const int* topk_idx, const float* topk_w, const floatX* W13, const floatX* W2,
                         cudaStream_t stream) {
  (void)topk_idx;  // the routing is replayed from saved.route_of_slot / slot_of_route (notes/design.md §3)
  if (!saved.route_of_slot || !saved.h13 || !saved.y)
    fm_fail("moe_backward", "MoESaved is empty: run moe_forward first", "N=%d", saved.N);
  const int N = saved.N, H = saved.H, I = saved.I, k = saved.k, R = N * k;
  const size_t w13_stride = (size_t)2 * I * H;

  floatX* dy = pool().alloc_t<floatX>((size_t)R * H, Mem::Dispatch, "moe_backward.dy");
  prof_sub(stream, "combine bwd", 3.0 * R * H * sizeof(floatX) + 12.0 * R);
  moe_combine_backward(dy, dtopk_w, dout, saved.y, saved.slot_of_route, topk_w, N, H, k, stream);
  floatX* dh13 = experts_backward_to_h13(dy, expert_slices(dW2, saved.E, (size_t)H * I), saved.h13,
                                         expert_slices(W2, saved.E, (size_t)H * I), saved.expert_counts,
                                         saved.expert_offsets, R, H, I, "moe_backward", stream);
  // dxp_e [R_e,H] = dh13_e [R_e,2I] · W13_e [2I,H];  dx[n] = Σ_j dxp[route n·k+j]
  floatX* dxp = pool().alloc_t<floatX>((size_t)R * H, Mem::Dispatch, "moe_backward.dxp");
  prof_sub(stream, "grouped gemm dxp");
  grouped_gemm("moe_backward.dxp", moe_expert_problems(saved, [&](int e, size_t first, int rows) {
                 return GroupedGemmProblem{dh13 + first * 2 * I, W13 + e * w13_stride, dxp + first * H, rows, H, 2 * I};
               }),
               false, false, 2 * I, H, H, 0.f, stream);
  prof_sub(stream, "combine (dx)", ((double)R + N) * H * sizeof(floatX) + 4.0 * R);
  moe_combine(dx, dxp, saved.slot_of_route, nullptr, N, H, k, stream);
  pool().free(dxp);
  // dW13_e [2I,H] += dh13_eᵀ [2I,R_e] · xp_e [R_e,H]
  floatX* xp = pool().alloc_t<floatX>((size_t)R * H, Mem::Dispatch, "moe_backward.xp");
  prof_sub(stream, "permute", 2.0 * R * H * sizeof(floatX) + 4.0 * R);
  moe_permute_rows(xp, x, saved.route_of_slot, R, H, k, stream);
  prof_sub(stream, "grouped gemm dW13");
  grouped_gemm("moe_backward.dW13", moe_expert_problems(saved, [&](int e, size_t first, int rows) {
                 return GroupedGemmProblem{dh13 + first * 2 * I, xp + first * H, dW13 + e * w13_stride, 2 * I, H, rows};
               }),
               true, false, 2 * I, H, H, 1.f, stream);
  pool().free(xp);
  pool().free(dh13);
}

// ---------------------------------------------------------------------------------------------
// The MoE dispatcher seam (notes/design.md §1.1): how a layer's routed experts are computed. Every
// dispatcher (ops/moe.cuh: local; ops/ep_moe.cuh: ep; ops/llep.cuh: llep; ops/pipelined_llep.cuh:
// pllep; later relay) has the same three entry points: forward returns its own saved state,
// backward reads it, and destroying the saved state frees it (back to the pool). The model picks
// one dispatcher at start-up (--moe) and calls it in one place. Sizes H, I, E, k are fixed at
// construction; N may change per call. forward with out = nullptr: the caller needs only the saved
// state (a layer's recomputation, whose output is already kept).
//   forward:  out [N,H] (=) = Σ_j topk_w[n,j] · expert_{topk_idx[n,j]}(x[n])
//   backward: dx [N,H] (=), dtopk_w [N,k] (=), dW13 (+=), dW2 (+=) on this rank's experts

struct DispatchSaved {
  virtual ~DispatchSaved() = default;  // frees the dispatcher's saved buffers
};

// What a dispatcher holds in the pool for one layer of N tokens per rank, whatever the router does
// (the per-rank prediction, Eq. 6, adds it): `saved` from its forward to its backward, `peak` at its
// most (saved + the backward's temporaries), every category it allocates in.
struct DispatchBound {
  size_t saved = 0, peak = 0;
};

// moe_forward + moe_backward, R = N·k routes: route maps 2·R·4 B and y R·H·b (Dispatch) and h13 R·2I·b
// (ExpertIntermediates) saved; backward adds dy + a + da (R·H·b + 2·R·I·b), or dh13 + da (3·R·I·b),
// or dxp/xp + dh13 (R·H·b + 2·R·I·b), and a grouped GEMM's pointer table (3 per expert, Workspace;
// only cuBLAS's path has one, counted in both builds).
inline DispatchBound moe_live_bound(long long N, int H, int I, int E, int k, size_t b) {
  const size_t R = (size_t)N * k;
  DispatchBound d;
  d.saved = 8 * R + R * H * b + 2 * R * I * b;
  d.peak = d.saved + std::max(R * H * b + 2 * R * I * b, 3 * R * I * b) + 3 * sizeof(void*) * (size_t)E;
  return d;
}

struct MoEDispatcher {
  int H = 0, I = 0, E = 0, k = 0;
  MoEDispatcher(int H_, int I_, int E_, int k_) : H(H_), I(I_), E(E_), k(k_) {}
  virtual ~MoEDispatcher() = default;
  virtual std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                                 const floatX* W13, const floatX* W2, int N, cudaStream_t stream) = 0;
  virtual void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout,
                        const DispatchSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                        const floatX* W13, const floatX* W2, cudaStream_t stream) = 0;
  virtual DispatchBound live_bound(int N) const = 0;  // N tokens on every rank
};

// --moe local: every expert on this rank (moe_forward / moe_backward).
struct LocalDispatcher : MoEDispatcher {
  struct Saved : DispatchSaved {
    MoESaved moe;
    ~Saved() override { moe_saved_free(moe); }
  };
  using MoEDispatcher::MoEDispatcher;
  std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                         const floatX* W13, const floatX* W2, int N, cudaStream_t stream) override {
    auto saved = std::make_unique<Saved>();
    moe_forward(out, saved->moe, x, topk_idx, topk_w, W13, W2, N, H, I, E, k, stream);
    return saved;
  }
  void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const DispatchSaved& saved,
                const floatX* x, const int* topk_idx, const float* topk_w, const floatX* W13, const floatX* W2,
                cudaStream_t stream) override {
    moe_backward(dx, dtopk_w, dW13, dW2, dout, static_cast<const Saved&>(saved).moe, x, topk_idx, topk_w, W13, W2,
                 stream);
  }
  DispatchBound live_bound(int N) const override { return moe_live_bound(N, H, I, E, k, sizeof(floatX)); }
};
