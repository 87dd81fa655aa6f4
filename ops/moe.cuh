// moe.cuh — dropless Mixture-of-Experts SwiGLU FFN on one GPU (notes/design.md §2, §6.1 without the
// exchange). Twin of ref/moe.hpp. Every (token, expert) route is computed: no capacity, no padding.
//
// Shapes: x [N,H]; topk_idx [N,k] int; topk_w [N,k] float; W13 [E,2I,H] (rows 0..I−1 of expert e =
// W1 "gate", rows I..2I−1 = W3 "up"); W2 [E,H,I]; out [N,H]. R = N·k routes; route r = n·k + j goes
// to expert topk_idx[n,j] with weight topk_w[n,j].
//   Expert e on its R_e routes:  h13 = xp W13_eᵀ [R_e,2I];  a = silu(h1) ⊙ h3 [R_e,I];  y = a W2_eᵀ [R_e,H]
//   out[n] = Σ_j topk_w[n,j] · y[route n·k+j]   (fixed j order, fp32 accumulation)
//   or, given a residual [N,H]: out[n] = residual[n] + that sum, added in fp32 and rounded once (the
//   layer's residual add folded into the combine: model.cuh's x_out = x_mid + FFN(ln2))
// Backward:
//   dtopk_w[n,j] = dout[n] · y[r];  dy_r = topk_w[n,j] · dout[n];  da = dy W2_e;  dW2_e += dyᵀ a
//   dh1 = da ⊙ h3 ⊙ silu'(h1);  dh3 = da ⊙ silu(h1);  dxp = dh W13_e;  dW13_e += dhᵀ xp
//   dx[n] = Σ_j dxp[route n·k+j]   (fixed j order, no atomics)
// Gradient outputs: dx (=), dtopk_w (=), dW13 (+=), dW2 (+=).
//
// Schedule (pieces are separate launchers, reused by the expert-parallel versions):
//   moe_route_sort       routes sorted by expert, stable (ascending route index inside an expert):
//                        route_of_slot / slot_of_route and the experts' offsets, which stay on the device
//                        in the BF16 build (the grouped GEMMs read them there: no host wait in the
//                        layer); in the FP32 build the counts come to the host (moe_route_plan)
//   moe_permute_rows     xp[s] = x[route_of_slot[s] / k]
//   grouped_gemm         ops/grouped_gemm.cuh, one problem per expert: one launch of flatmoe's
//                        tensor-core kernel per GEMM (BF16), one cublasGemmGroupedBatchedEx (FP32)
//   swiglu_forward/backward, moe_combine (weighted or plain sum over the k slots), moe_combine_backward;
//                        their window forms (moe_combine_window_add, moe_combine_backward_window) take only
//                        the routes of a range of sorted slots: one ring hop's (ops/relay_moe.cuh)
// Live set (b = bytes per floatX): saved between forward and backward: route maps 2·R·4 B and the
// expert offsets (E+1)·4 B (Dispatch), h13 R·2I·b (ExpertIntermediates), y R·H·b (Dispatch).
// Forward temporaries on top: xp R·H·b (Dispatch) and a R·I·b (ExpertIntermediates), plus the plan's
// ceil(R/256)·(E+1)·4 B and cuBLAS's pointer arrays (Workspace, FP32 build). Backward temporaries
// on top: da R·I·b (ExpertIntermediates) and beside it one R·H·b row buffer at a time (dxp, xp;
// Dispatch): dy is written over the saved y, SwiGLU's backward writes dh13 over the saved h13 and a
// over da, so the backward consumes y and h13 and a is not computed on its own. All temporaries are
// freed before each launcher returns, but for moe_backward's da and xp when its dW2 and dW13 run on a
// weight-gradient stream (held until the caller joins it). Under skew nothing here is bounded except
// by R = N·k; --moe local's token budget c bounds it by one chunk's, R = c·k (LocalDispatcher, below).
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
#include "../runtime/side_stream.cuh"

static const int MOE_PLAN_TILE = 256;          // routes per tile of the stable sort
static const int MOE_MAX_E = 12287;            // the plan keeps E + 1 ints in shared memory (48 KiB)
static const int MOE_WARPS_PER_BLOCK = 8;      // routes per block in moe_combine_backward
static const int MOE_PLAN_SCAN_IN_RANK = 16384; // at most this many (E + 1)·tiles counts: no scan launch

// ---------------------------------------------------------------------------------------------
// Kernels: routing plan (stable counting sort of the routes by expert)

// The plan sorts the routes into E + 1 bins: expert e's for topk_idx in [0,E), and bin E for any other
// index, so that every route gets a slot inside [0,R) whatever its index (no expert computes bin E).
__device__ __forceinline__ int moe_plan_bin(int expert, int E) { return expert >= 0 && expert < E ? expert : E; }

// Grid: one block of MOE_PLAN_TILE threads per tile of routes; dynamic shared memory E + 1 ints.
// tile_counts [E+1,tiles] (=, bin-major): routes of each bin in each tile, a bin's tiles contiguous
// (the scan reads a bin's column in whole sectors: notes/speed.md, 'The route plan').
static __global__ void moe_plan_count_kernel(int* tile_counts, const int* topk_idx, int R, int E) {
  extern __shared__ int tile_hist[];
  for (int e = threadIdx.x; e <= E; e += blockDim.x) tile_hist[e] = 0;
  __syncthreads();
  int r = blockIdx.x * MOE_PLAN_TILE + threadIdx.x;
  if (r < R) atomicAdd(&tile_hist[moe_plan_bin(topk_idx[r], E)], 1);
  __syncthreads();
  for (int e = threadIdx.x; e <= E; e += blockDim.x) tile_counts[(size_t)e * gridDim.x + blockIdx.x] = tile_hist[e];
}

// One block of MOE_SCAN_THREADS, over B = E + 1 bins. tile_counts becomes, in place, the exclusive
// prefix over tiles per bin (routes of bin e in the tiles before this one); bin_counts [B] (=) the
// totals; bin_offsets [B] (=) their exclusive prefix over bins (first sorted slot of each bin).
// Warp w takes bins w, w + W, ...; in a bin, lane l takes the tiles [l·P, l·P + P) (P = ceil(tiles /
// 32)): it sums their counts (independent loads), a shuffle scan over the lanes gives the counts of
// the tiles before its own, and it writes its tiles' prefixes in chunks (the chunk's loads first). So
// a bin costs a few memory round trips, not one per tile: the plan sits between a layer's router and
// its expert GEMMs, where a chain of loads waits out every trip (notes/speed.md, 'The route plan'). A bin's
// tiles are contiguous (bin-major), so a lane's P counts share one or two 32-byte sectors: the scan moves
// each sector of tile_counts once per pass, where tile-major rows (a bin's counts E + 1 ints apart) put
// every count in a sector of its own and the one SM's traffic, 8× larger, set its time. Warp 0
// then scans the bins' totals the same way, 32 at a time.
static const int MOE_SCAN_THREADS = 256;
static const int MOE_SCAN_CHUNK = 8;

// Exclusive prefix over the warp's lanes of v (common.cuh's warp_inclusive_scan); *total (=) the sum
// over all 32.
__device__ __forceinline__ int warp_exclusive_scan(int v, int* total) {
  const int inclusive = warp_inclusive_scan(v);
  *total = __shfl_sync(0xffffffff, inclusive, 31);
  return inclusive - v;
}

static __global__ void __launch_bounds__(MOE_SCAN_THREADS)
moe_plan_scan_kernel(int* tile_counts, int* bin_counts, int* bin_offsets, int tiles, int B) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = MOE_SCAN_THREADS / 32;
  const int per_lane = (tiles + 31) / 32;
  const int first = min(tiles, lane * per_lane), last = min(tiles, first + per_lane);  // this lane's tiles
  for (int e = warp; e < B; e += warps) {
    int* bin = tile_counts + (size_t)e * tiles;  // tile t's count of bin e at bin[t]
    int lane_sum = 0;
#pragma unroll MOE_SCAN_CHUNK
    for (int t = first; t < last; t++) lane_sum += bin[t];
    int total;
    int running = warp_exclusive_scan(lane_sum, &total);
    for (int t = first; t < last; t += MOE_SCAN_CHUNK) {
      int count[MOE_SCAN_CHUNK];
#pragma unroll
      for (int j = 0; j < MOE_SCAN_CHUNK; j++) count[j] = t + j < last ? bin[t + j] : 0;
#pragma unroll
      for (int j = 0; j < MOE_SCAN_CHUNK; j++)
        if (t + j < last) {
          bin[t + j] = running;
          running += count[j];
        }
    }
    if (lane == 0) bin_counts[e] = total;
  }
  __syncthreads();
  if (warp != 0) return;
  int carry = 0;
  for (int base = 0; base < B; base += 32) {
    const int count = base + lane < B ? bin_counts[base + lane] : 0;
    int total;
    const int before = warp_exclusive_scan(count, &total);
    if (base + lane < B) bin_offsets[base + lane] = carry + before;
    carry += total;
  }
}

// Grid as moe_plan_count_kernel; dynamic shared memory E + 1 ints when SCAN_HERE. Slot of route r =
// first slot of its bin + routes of that bin in earlier tiles + routes of that bin earlier in this
// tile: a stable sort.
// SCAN_HERE (the plan's counts are few, moe_plan_scans_in_rank): each block finds the first two terms
// itself from tile_counts [E+1,tiles] (the count kernel's, bin-major): the bins' totals over every
// tile, their exclusive prefix over bins (block 0 also writes them to bin_counts and bin_offsets),
// plus the bin's counts in the tiles before its own — one launch fewer in the chain between a layer's
// router and its expert GEMMs (notes/speed.md, 'The route plan'), for (E + 1)·tiles more loads per block.
// Otherwise moe_plan_scan_kernel ran first: tile_counts holds each tile's prefix per bin and
// bin_offsets the bins' first slots.
template <bool SCAN_HERE>
static __global__ void moe_plan_rank_kernel(int* route_of_slot, int* slot_of_route, int* bin_counts, int* bin_offsets,
                                            const int* topk_idx, const int* tile_counts, int R, int E) {
  extern __shared__ int bin_base[];  // [E+1] (SCAN_HERE): the first slot of each bin's routes in this tile
  __shared__ int tile_bin[MOE_PLAN_TILE];
  const int t = threadIdx.x, tile = blockIdx.x, tiles = gridDim.x, B = E + 1;
  const int r = tile * MOE_PLAN_TILE + t;
  tile_bin[t] = r < R ? moe_plan_bin(topk_idx[r], E) : -1;
  if (SCAN_HERE) {
    const int warp = t / 32, lane = t % 32, warps = MOE_PLAN_TILE / 32;
    for (int e = warp; e < B; e += warps) {  // each bin's total over every tile
      int sum = 0;
      for (int u = lane; u < tiles; u += 32) sum += tile_counts[(size_t)e * tiles + u];
      sum = __reduce_add_sync(0xffffffffu, sum);
      if (lane == 0) bin_base[e] = sum;
    }
    __syncthreads();
    if (warp == 0) {  // the totals' exclusive prefix over bins, 32 at a time
      int carry = 0;
      for (int base = 0; base < B; base += 32) {
        const int e = base + lane;
        const int count = e < B ? bin_base[e] : 0;
        int total;
        const int before = warp_exclusive_scan(count, &total);
        if (e < B) {
          bin_base[e] = carry + before;
          if (tile == 0) {
            bin_counts[e] = count;
            bin_offsets[e] = carry + before;
          }
        }
        carry += total;
      }
    }
    __syncthreads();
    for (int e = warp; e < B; e += warps) {  // + the bin's routes in the tiles before this one
      int sum = 0;
      for (int u = lane; u < tile; u += 32) sum += tile_counts[(size_t)e * tiles + u];
      sum = __reduce_add_sync(0xffffffffu, sum);
      if (lane == 0) bin_base[e] += sum;
    }
  }
  __syncthreads();
  if (r >= R) return;
  const int e = tile_bin[t];
  int rank = 0;
  for (int u = 0; u < t; u++) rank += tile_bin[u] == e;
  const int first = SCAN_HERE ? bin_base[e] : bin_offsets[e] + tile_counts[(size_t)e * tiles + tile];
  const int slot = first + rank;
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
  for (int e = 0; e < NV; e++) out.v[e] = from_float<floatX>(swiglu_value(to_float(h1.v[e]), to_float(h3.v[e])));
  reinterpret_cast<P*>(a)[i] = out;
}

// dh13 [R,2I] (=): dh1 = da ⊙ h3 ⊙ silu'(h1), dh3 = da ⊙ silu(h1); with WRITE_A also a [R,I] (=) =
// silu(h1) ⊙ h3 by swiglu_value, as swiglu_forward_kernel (the same bits). One thread per NV consecutive
// elements of da (NV = ROW_PIECE, or 1); it reads its pieces of h13 and da before it writes, so dh13
// may be h13 and a may be da (in place).
template <int NV, bool WRITE_A>
static __global__ void swiglu_backward_kernel(floatX* dh13, floatX* a, const floatX* da, const floatX* h13, int R, int I) {
  using P = Pack<floatX, NV>;
  const int pieces = I / NV;  // per row of da
  const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)R * pieces) return;
  const size_t r = i / pieces;
  const int c = (int)(i % pieces);
  const P h1 = reinterpret_cast<const P*>(h13)[r * 2 * pieces + c];
  const P h3 = reinterpret_cast<const P*>(h13)[r * 2 * pieces + pieces + c];
  const P d = reinterpret_cast<const P*>(da)[i];
  P dh1, dh3, act;
#pragma unroll
  for (int e = 0; e < NV; e++) {
    const float g = to_float(h1.v[e]), u = to_float(h3.v[e]), dv = to_float(d.v[e]);
    const float sig = 1.f / (1.f + expf(-g));
    dh1.v[e] = from_float<floatX>(dv * u * sig * (1.f + g * (1.f - sig)));
    dh3.v[e] = from_float<floatX>(dv * g * sig);
    if (WRITE_A) act.v[e] = from_float<floatX>(swiglu_value(g, u));
  }
  reinterpret_cast<P*>(dh13)[r * 2 * pieces + c] = dh1;
  reinterpret_cast<P*>(dh13)[r * 2 * pieces + pieces + c] = dh3;
  if (WRITE_A) reinterpret_cast<P*>(a)[i] = act;
}

// out [N,H]: sum[n] = Σ_j w_j · rows[slot_of_route[n·k+j] − slot_first] over the routes whose slot
// lies in the window [slot_first, slot_first + slot_count) (the whole [0, R) for moe_combine), j
// ascending, fp32; w_j = topk_w[n,j] when WEIGHTED, else 1. out[n] (=) addend[n] + sum, added in fp32
// and rounded once, when addend is given, else (=) sum. addend may be out itself (a ring hop's routes
// added into a running output, ops/relay_moe.cuh; a layer's residual stream): each thread reads its
// piece of addend before it writes that piece of out. One thread per NV consecutive elements of out
// (NV = ROW_PIECE, or 1; see common.cuh): it reads a token's k slots and weights once for all NV.
template <bool WEIGHTED, int NV, typename TOut>
static __global__ void moe_combine_kernel(TOut* out, const TOut* addend, const floatX* rows, const int* slot_of_route,
                                          const float* topk_w, int N, int H, int k, int slot_first, int slot_count) {
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
  Pack<TOut, NV> result;
  if (addend) result = reinterpret_cast<const Pack<TOut, NV>*>(addend)[i];
#pragma unroll
  for (int e = 0; e < NV; e++) result.v[e] = from_float<TOut>(addend ? to_float(result.v[e]) + acc[e] : acc[e]);
  reinterpret_cast<Pack<TOut, NV>*>(out)[i] = result;
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

// Whether the rank kernel scans the plan's counts itself ((E + 1)·tiles of them at most
// MOE_PLAN_SCAN_IN_RANK: each of its blocks reads them all) instead of a one-block scan launched
// before it: two launches instead of three (the default model's 32 tiles of 9 bins, B1's 256 of 33).
inline bool moe_plan_scans_in_rank(int R, int E) {
  return (long long)ceil_div(R, MOE_PLAN_TILE) * (E + 1) <= MOE_PLAN_SCAN_IN_RANK;
}

// Sorts the R routes of topk_idx [R] by expert, stably: route_of_slot [R] (=) sorted position ->
// route, slot_of_route [R] (=) route -> sorted position. Expert e owns the sorted positions
// [offset_e, offset_e + count_e), offset = exclusive prefix of count; routes whose index is outside
// [0,E) follow all experts' (slots [offset_E, R); no expert computes them).
// expert_offsets [E+1] (=, device; may be nullptr): offset_0 … offset_E, which the grouped GEMMs can
// read on the device (ops/grouped_gemm.cuh, routed problems).
// With host_counts: the E per-expert counts come to the host into *host_counts, and expert indices
// outside [0,E) are refused (one D2H copy of E+1 ints: synchronises `stream` once). Without: nothing
// leaves the GPU and the host does not wait — for a caller whose indices are in [0,E) by
// construction (the router's top-k; a routing checked on the host when it was loaded) or that counted
// and checked them itself (ops/pipelined_llep.cuh: every chunk's counts in one copy).
inline void moe_route_sort(int* route_of_slot, int* slot_of_route, int* expert_offsets, const int* topk_idx, int R,
                           int E, cudaStream_t stream, std::vector<int>* host_counts) {
  if (E < 1 || E > MOE_MAX_E) fm_fail("moe_route_sort", "need 1 <= E <= 12287 (E + 1 ints in shared memory)", "R=%d E=%d", R, E);
  if (host_counts) host_counts->assign(E, 0);
  if (R == 0) {
    if (expert_offsets) cudaCheck(cudaMemsetAsync(expert_offsets, 0, (E + 1) * sizeof(int), stream), "moe_route_sort", "R=0 E=%d", E);
    return;
  }
  const int tiles = ceil_div(R, MOE_PLAN_TILE), bins = E + 1;
  // plan_ints: [0, bins) counts per bin (bin E: indices outside [0,E)), then the offsets if the caller keeps none
  int* plan_ints = pool().alloc_t<int>((size_t)bins * (expert_offsets ? 1 : 2), Mem::Workspace, "moe_route_sort.counts");
  int* tile_counts = pool().alloc_t<int>((size_t)tiles * bins, Mem::Workspace, "moe_route_sort.tile_counts");
  int* counts = plan_ints;
  int* offsets = expert_offsets ? expert_offsets : plan_ints + bins;
  moe_plan_count_kernel<<<tiles, MOE_PLAN_TILE, (size_t)bins * sizeof(int), stream>>>(tile_counts, topk_idx, R, E);
  launchCheck("moe_route_sort.count", "R=%d E=%d", R, E);
  if (moe_plan_scans_in_rank(R, E)) {
    moe_plan_rank_kernel<true><<<tiles, MOE_PLAN_TILE, (size_t)bins * sizeof(int), stream>>>(
        route_of_slot, slot_of_route, counts, offsets, topk_idx, tile_counts, R, E);
  } else {
    moe_plan_scan_kernel<<<1, MOE_SCAN_THREADS, 0, stream>>>(tile_counts, counts, offsets, tiles, bins);
    launchCheck("moe_route_sort.scan", "R=%d E=%d", R, E);
    moe_plan_rank_kernel<false><<<tiles, MOE_PLAN_TILE, 0, stream>>>(route_of_slot, slot_of_route, counts, offsets,
                                                                     topk_idx, tile_counts, R, E);
  }
  launchCheck("moe_route_sort.rank", "R=%d E=%d", R, E);
  if (host_counts) {  // slots outside [0,E) went past every expert's: the refusal below leaves the maps a permutation
    host_counts->resize(bins);
    copy_to_host(host_counts->data(), counts, bins * sizeof(int), stream, "moe_route_sort");
    if (host_counts->back() != 0)
      fm_fail("moe_route_sort", "expert index outside [0, E) in topk_idx", "R=%d E=%d bad_routes=%d", R, E, host_counts->back());
    host_counts->pop_back();
  }
  pool().free(tile_counts);
  pool().free(plan_ints);
}

// moe_route_sort with the counts on the host (synchronises `stream` once); returns count [E].
inline std::vector<int> moe_route_plan(int* route_of_slot, int* slot_of_route, const int* topk_idx, int R, int E,
                                       cudaStream_t stream) {
  std::vector<int> counts;
  moe_route_sort(route_of_slot, slot_of_route, nullptr, topk_idx, R, E, stream, &counts);
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

// dh13 [R,2I] (=) from da [R,I] and h13 [R,2I]; and a [R,I] (=) = swiglu(h13), swiglu_forward's bits,
// when a is given. dh13 may be h13, a may be da (each element is read before it is written).
inline void swiglu_backward(floatX* dh13, const floatX* da, const floatX* h13, int R, int I, cudaStream_t stream,
                            floatX* a = nullptr) {
  if ((size_t)R * I == 0) return;
  const bool pieces = row_pieces(I, {dh13, da, h13}) && pack_aligned(a, ROW_PIECE);
  auto* kernel = pieces ? (a ? swiglu_backward_kernel<ROW_PIECE, true> : swiglu_backward_kernel<ROW_PIECE, false>)
                        : (a ? swiglu_backward_kernel<1, true> : swiglu_backward_kernel<1, false>);
  kernel<<<ceil_div((size_t)R * (pieces ? I / ROW_PIECE : I), 256), 256, 0, stream>>>(dh13, a, da, h13, R, I);
  launchCheck("swiglu_backward", "R=%d I=%d", R, I);
}

// moe_combine_kernel over the window [slot_first, slot_first + slot_count), weighted when topk_w is
// given, in pieces of ROW_PIECE elements when H and the buffers allow.
template <typename TOut>
inline void moe_combine_launch(TOut* out, const TOut* addend, const floatX* rows, const int* slot_of_route,
                               const float* topk_w, int slot_first, int slot_count, int N, int H, int k,
                               cudaStream_t stream) {
  const bool pieces = row_pieces(H, {rows}) && pack_aligned(out, ROW_PIECE) && pack_aligned(addend, ROW_PIECE);
  const int grid = ceil_div((size_t)N * (pieces ? H / ROW_PIECE : H), 256);
  auto* kernel = pieces ? (topk_w ? moe_combine_kernel<true, ROW_PIECE, TOut> : moe_combine_kernel<false, ROW_PIECE, TOut>)
                        : (topk_w ? moe_combine_kernel<true, 1, TOut> : moe_combine_kernel<false, 1, TOut>);
  kernel<<<grid, 256, 0, stream>>>(out, addend, rows, slot_of_route, topk_w, N, H, k, slot_first, slot_count);
}

// out [N,H] (=): out[n] = Σ_j topk_w[n,j] · rows[slot_of_route[n·k+j]] (j ascending, fp32), plus
// residual[n] when given (added in fp32, rounded once; residual may be out itself);
// topk_w == nullptr means every weight is 1 (the plain sum, used for dx).
inline void moe_combine(floatX* out, const floatX* rows, const int* slot_of_route, const float* topk_w, int N, int H,
                        int k, cudaStream_t stream, const floatX* residual = nullptr) {
  if ((size_t)N * H == 0) return;
  moe_combine_launch(out, residual, rows, slot_of_route, topk_w, 0, N * k, N, H, k, stream);
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
  moe_combine_launch(acc, acc, rows, slot_of_route, topk_w, slot_first, slot_count, N, H, k, stream);
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

// Which rows of group-sorted buffers each group (an expert, or a group of routes of an expert-parallel
// dispatcher) owns: group g has rows [offset_g, offset_g + count_g). Host form: counts and offsets on
// the host, which sizes each grouped-GEMM problem there. Device form: only device_offsets [G+1], read
// by the grouped GEMMs on the device — nothing waits for the counts (ops/grouped_gemm.cuh, routed
// problems).
struct ExpertRows {
  std::vector<int> counts, offsets;     // host form: [G] each
  const int* device_offsets = nullptr;  // device form: [G+1]
  int groups = 0;                       // G
  int rows = 0;                         // rows of the buffers (the routes)

  static ExpertRows on_host(std::vector<int> counts, std::vector<int> offsets, int rows) {
    ExpertRows r;
    r.groups = (int)counts.size();
    r.counts = std::move(counts);
    r.offsets = std::move(offsets);
    r.rows = rows;
    return r;
  }
  static ExpertRows on_device(const int* offsets, int groups, int rows) {
    ExpertRows r;
    r.device_offsets = offsets;
    r.groups = groups;
    r.rows = rows;
    return r;
  }
};

// true when a layer's expert GEMMs take the per-expert counts from the device (routed problems on the
// BF16 build's kernel; its 16-byte copies need H and I multiples of 8, and pool buffers and the
// model's weights are aligned) — unless its larger weight gradient, dW13 (2·2I·H·R/E FLOPs per expert
// on average), is faster on cuBLAS's per-expert GEMMs (weight_gradient_takes_kernel; only in builds
// without wgmma): cuBLAS needs the counts on the host, and there one wait per layer costs less than
// the mma.sync form's slower transposed form (B1's layer: 4.3 GFLOP per expert, 245 TFLOP/s on it
// against 405 on cuBLAS, 0.22 ms more per layer against a ~0.1 ms wait; notes/speed.md, 'Host waits').
// Otherwise the counts come to the host first: one host wait.
inline bool moe_counts_stay_on_device(int H, int I, int E, long long R) {
#if defined(FLATMOE_BF16)
  return H % 8 == 0 && I % 8 == 0 && weight_gradient_takes_kernel(2.0 * 2 * I * H * (double)R / E);
#else
  (void)H, (void)I, (void)E, (void)R;
  return false;
#endif
}

// What backward needs; allocated from the pool by moe_forward, freed by moe_saved_free.
struct MoESaved {
  int N = 0, H = 0, I = 0, E = 0, k = 0;
  ExpertRows rows;                  // each expert's rows of the sorted buffers (host or device form)
  int* expert_offsets = nullptr;    // [E+1] device: first sorted position of each expert, then the end (Dispatch)
  int* route_of_slot = nullptr;     // [N·k] device: sorted position -> route index r  (Dispatch)
  int* slot_of_route = nullptr;     // [N·k] device: route index r -> sorted position  (Dispatch)
  floatX* h13 = nullptr;            // [N·k, 2I] sorted order                          (ExpertIntermediates)
  floatX* y = nullptr;              // [N·k, H] expert outputs before weighting, sorted (Dispatch)
};

inline void moe_saved_free(MoESaved& saved) {
  pool().free(saved.expert_offsets);
  pool().free(saved.route_of_slot);
  pool().free(saved.slot_of_route);
  pool().free(saved.h13);
  pool().free(saved.y);
  saved = MoESaved();
}

// One grouped-GEMM problem per group, make(g, first_row, rows) building group g's from its rows
// [first_row, first_row + rows) of the group-sorted buffers. Host form: the groups with at least one
// row. Device form: every group, built at row 0 with 0 rows, its rows read on the device (routed
// problems, ops/grouped_gemm.cuh; make must be linear in first_row with each operand's row stride,
// as a pointer into a row-major buffer is). Shared with the expert-parallel dispatchers.
template <typename F>
GroupedGemmProblems expert_problems(const ExpertRows& groups, F make) {
  GroupedGemmProblems problems;
  if (groups.device_offsets) {
    for (int g = 0; g < groups.groups; g++) problems.list.push_back(make(g, 0, 0));
    problems.route_offsets = groups.device_offsets;
    problems.routes = groups.rows;
    return problems;
  }
  for (int g = 0; g < groups.groups; g++)
    if (groups.counts[g] > 0) problems.list.push_back(make(g, (size_t)groups.offsets[g], groups.counts[g]));
  return problems;
}

template <typename F>
GroupedGemmProblems moe_expert_problems(const MoESaved& saved, F make) {
  return expert_problems(saved.rows, make);
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

// The experts' second half, shared by moe_forward and the expert-parallel dispatchers: on R =
// groups.rows routes sorted by group (group g computed with W2[g] [H,I]),
// y_g [R_g,H] (=) = swiglu(h13_g) [R_g,I] · W2_gᵀ. The activation a [R,I] lives only inside
// (ExpertIntermediates).
inline void experts_swiglu_down(floatX* y, const floatX* h13, const std::vector<const floatX*>& W2,
                                const ExpertRows& groups, int H, int I, const std::string& op, cudaStream_t stream) {
  const int R = groups.rows;
  floatX* a = alloc_rows<floatX>((size_t)R * I, Mem::ExpertIntermediates, op + ".a");
  prof_sub(stream, "swiglu", 3.0 * R * I * sizeof(floatX));
  swiglu_forward(a, h13, R, I, stream);
  prof_sub(stream, "grouped gemm y = a W2");
  grouped_gemm((op + ".y").c_str(), expert_problems(groups, [&](int e, size_t first, int rows) {
                 return GroupedGemmProblem{a + first * I, W2[e], y + first * H, rows, H, I};
               }),
               false, true, I, I, H, 0.f, stream);
  pool().free(a);
}

// What experts_backward_to_h13 may do with h13: Keep it (the caller reads it again: the expert-parallel
// dispatchers and RelayMoE, whose bounds count this form) or Overwrite it (moe_backward: h13 is the
// forward's saved state and nothing reads it after this).
enum class H13 { Keep, Overwrite };

// The experts' backward down to the gate/up gradients, shared by moe_backward and the
// expert-parallel dispatchers, per group g (its weights W2[g], its gradient dW2[g]):
// da_g = dy_g · W2_g; dW2_g (+=) dy_gᵀ · a_g; returns dh13 [R,2I] = swiglu'(h13) ⊙ da.
//   Keep: a is computed again from h13 before dW2 (the forward did not keep it), dy is freed before
//   dh13 is allocated (ExpertIntermediates, the caller frees it), so the two are never live together:
//   at most dy + a + da, then dh13 + da, beside h13.
//   Overwrite: SwiGLU's backward writes dh13 over h13 and a over da in one pass (h13 read once, a not
//   computed on its own), then dW2; the returned dh13 is h13's buffer (not the caller's to free): at
//   most da beside h13 and dy, which stays the caller's (moe_backward's is the forward's y, written
//   over), and the same bits as Keep. With a weight-gradient stream (runtime/side_stream.cuh) dW2 runs
//   there, beside the caller's next work: da is held until the caller joins it, and dy must stay too.
inline floatX* experts_backward_to_h13(floatX* dy, const std::vector<floatX*>& dW2, floatX* h13,
                                       const std::vector<const floatX*>& W2, const ExpertRows& groups, int H, int I,
                                       const std::string& op, cudaStream_t stream, H13 mode = H13::Keep,
                                       SideStream* weight_grads = nullptr) {
  const int R = groups.rows;
  auto dW2_from = [&](const floatX* a, cudaStream_t s) {  // dW2_e [H,I] += dy_eᵀ [H,R_e] · a_e [R_e,I]
    prof_sub(s, "grouped gemm dW2");
    grouped_gemm((op + ".dW2").c_str(), expert_problems(groups, [&](int e, size_t first, int rows) {
                   return GroupedGemmProblem{dy + first * H, a + first * I, dW2[e], H, I, rows};
                 }),
                 true, false, H, I, I, 1.f, s);
  };
  floatX* a = nullptr;
  if (mode == H13::Keep) {
    a = alloc_rows<floatX>((size_t)R * I, Mem::ExpertIntermediates, op + ".a");
    prof_sub(stream, "swiglu (a again)", 3.0 * R * I * sizeof(floatX));
    swiglu_forward(a, h13, R, I, stream);
  }
  prof_sub(stream, "grouped gemm da");
  // da_e [R_e,I] = dy_e [R_e,H] · W2_e [H,I]
  floatX* da = alloc_rows<floatX>((size_t)R * I, Mem::ExpertIntermediates, op + ".da");
  grouped_gemm((op + ".da").c_str(), expert_problems(groups, [&](int e, size_t first, int rows) {
                 return GroupedGemmProblem{dy + first * H, W2[e], da + first * I, rows, I, H};
               }),
               false, false, H, I, I, 0.f, stream);
  if (mode == H13::Overwrite) {
    prof_sub(stream, "swiglu bwd (+ a)", 6.0 * R * I * sizeof(floatX));
    swiglu_backward(h13, da, h13, R, I, stream, /*a=*/da);  // dh13 over h13, a over da
    side_run(weight_grads, stream, (op + ".dW2").c_str(), [&](cudaStream_t s) { dW2_from(da, s); });
    side_hold(weight_grads, da);
    return h13;
  }
  dW2_from(a, stream);
  pool().free(a);
  pool().free(dy);
  floatX* dh13 = alloc_rows<floatX>((size_t)R * 2 * I, Mem::ExpertIntermediates, op + ".dh13");
  prof_sub(stream, "swiglu bwd", 5.0 * R * I * sizeof(floatX));
  swiglu_backward(dh13, da, h13, R, I, stream);
  pool().free(da);
  return dh13;
}

// out [N,H] (=; nullptr: no combine, only what backward needs — a layer's recomputation, whose
// output is already kept); with a residual [N,H], out = residual + the layer's output, added in the
// combine in fp32 and rounded once (residual may be out itself); fills `saved` (which must be empty:
// moe_saved_free it after backward).
// The per-expert counts stay on the device and the host does not wait when the grouped GEMMs read
// them there (moe_counts_stay_on_device: the BF16 build, but for large layers); topk_idx must then hold indices in
// [0,E) — the router's always do — since none is refused (a route outside gets a slot past every
// expert's and no output). Otherwise the counts come to the host (moe_route_plan: one wait, and
// indices outside [0,E) are refused). With dense_routes = true the caller's topk_idx is
// dense_routes' (E = 1, k = 1, every route to expert 0), so the one count is N, known on the host, and
// nothing waits either (a dense FFN layer, the shared expert).
inline void moe_forward(floatX* out, MoESaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                        const floatX* W13, const floatX* W2, int N, int H, int I, int E, int k, cudaStream_t stream,
                        bool dense_routes = false, const floatX* residual = nullptr) {
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
  saved.expert_offsets = pool().alloc_t<int>((size_t)E + 1, Mem::Dispatch, "moe.expert_offsets");
  saved.route_of_slot = pool().alloc_t<int>(R, Mem::Dispatch, "moe.route_of_slot");
  saved.slot_of_route = pool().alloc_t<int>(R, Mem::Dispatch, "moe.slot_of_route");
  const bool counts_on_device = !dense_routes && moe_counts_stay_on_device(H, I, E, R);
  prof_sub(stream, dense_routes || counts_on_device ? "route plan" : "route plan (host wait)");
  if (dense_routes) {  // the same stable sort (here the identity), its one count known without a download
    moe_route_sort(saved.route_of_slot, saved.slot_of_route, saved.expert_offsets, topk_idx, R, E, stream, nullptr);
    saved.rows = ExpertRows::on_host({R}, {0}, R);
  } else if (counts_on_device) {
    moe_route_sort(saved.route_of_slot, saved.slot_of_route, saved.expert_offsets, topk_idx, R, E, stream, nullptr);
    saved.rows = ExpertRows::on_device(saved.expert_offsets, E, R);
  } else {
    std::vector<int> counts;
    moe_route_sort(saved.route_of_slot, saved.slot_of_route, saved.expert_offsets, topk_idx, R, E, stream, &counts);
    std::vector<int> offsets(E, 0);
    for (int e = 1; e < E; e++) offsets[e] = offsets[e - 1] + counts[e - 1];
    saved.rows = ExpertRows::on_host(std::move(counts), std::move(offsets), R);
  }

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
  experts_swiglu_down(saved.y, saved.h13, expert_slices(W2, E, (size_t)H * I), saved.rows, H, I, "moe_forward", stream);
  if (out != nullptr) prof_sub(stream, "combine", ((double)R + N * (residual ? 2 : 1)) * H * sizeof(floatX) + 8.0 * R);
  if (out != nullptr) moe_combine(out, saved.y, saved.slot_of_route, topk_w, N, H, k, stream, residual);
}

// dx [N,H] (=), dtopk_w [N,k] (=), dW13 [E,2I,H] (+=), dW2 [E,H,I] (+=) from dout [N,H], the
// forward's saved state and inputs. Does not synchronise (with counts on the device, unless a
// gradient buffer is not aligned for the grouped GEMM kernel: ops/grouped_gemm.cuh). Consumes
// saved.h13: dh13 is written over it (H13::Overwrite), so a saved state serves one backward, then
// moe_saved_free.
// Consumes saved.y too: dy is written over it.
// weight_grads (runtime/side_stream.cuh; nullptr: none): dW2's product runs there beside dxp's, and
// dW13's, with the permute of x that feeds it, after dx's combine is queued, beside the caller's next
// work. da [R,I] and xp [R,H] are then held until the caller joins that stream (moe_live_bound's
// `held`), and saved (dy over y, dh13 over h13) must not be freed before the join either.
inline void moe_backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const MoESaved& saved,
                         const floatX* x, const int* topk_idx, const float* topk_w, const floatX* W13, const floatX* W2,
                         cudaStream_t stream, SideStream* weight_grads = nullptr) {
  (void)topk_idx;  // the routing is replayed from saved.route_of_slot / slot_of_route (notes/design.md §3)
  if (!saved.route_of_slot || !saved.h13 || !saved.y)
    fm_fail("moe_backward", "MoESaved is empty: run moe_forward first", "N=%d", saved.N);
  const int N = saved.N, H = saved.H, I = saved.I, k = saved.k, R = N * k;
  const size_t w13_stride = (size_t)2 * I * H;

  floatX* dy = saved.y;  // written over y, which nothing reads after this
  prof_sub(stream, "combine bwd", 3.0 * R * H * sizeof(floatX) + 12.0 * R);
  moe_combine_backward(dy, dtopk_w, dout, saved.y, saved.slot_of_route, topk_w, N, H, k, stream);
  floatX* dh13 = experts_backward_to_h13(dy, expert_slices(dW2, saved.E, (size_t)H * I), saved.h13,
                                         expert_slices(W2, saved.E, (size_t)H * I), saved.rows, H, I, "moe_backward",
                                         stream, H13::Overwrite, weight_grads);  // dh13 is saved.h13's buffer
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
  side_run(weight_grads, stream, "moe_backward.dW13", [&](cudaStream_t s) {
    prof_sub(s, "permute", 2.0 * R * H * sizeof(floatX) + 4.0 * R);
    moe_permute_rows(xp, x, saved.route_of_slot, R, H, k, s);
    prof_sub(s, "grouped gemm dW13");
    grouped_gemm("moe_backward.dW13", moe_expert_problems(saved, [&](int e, size_t first, int rows) {
                   return GroupedGemmProblem{dh13 + first * 2 * I, xp + first * H, dW13 + e * w13_stride, 2 * I, H, rows};
                 }),
                 true, false, 2 * I, H, H, 1.f, s);
  });
  side_hold(weight_grads, xp);
}

// ---------------------------------------------------------------------------------------------
// The MoE dispatcher seam (notes/design.md §1.1, notes/seams.md): how a layer's routed experts are
// computed. Each dispatcher is a class derived from MoEDispatcher in its own ops file (ops/moe.cuh: local;
// ops/ep_moe.cuh: ep; ops/llep.cuh: llep; ops/pipelined_llep.cuh: pllep; ops/relay_moe.cuh: relay),
// registered by one line of config.hpp's moe_choices (its name, needs and flags) and made by its line
// of seams.cuh's dispatcher_factories. The model makes one at start-up (--moe) and calls it in one
// place (model.cuh). The contract, the whole of it:
//   sizes     H, I, E, k fixed when made (which allocates nothing); N, this rank's tokens, may change
//             per call and differ between ranks. W13 [E_l,2I,H] and W2 [E_l,H,I] are this rank's E_l
//             experts (E_l = E/E_p; all E where E_p = 1). A dispatcher that exchanges routes is
//             collective over its expert-parallel group: every rank of it calls forward and backward in
//             the same order.
//   forward:  out [N,H] (=) = Σ_j topk_w[n,j] · expert_{topk_idx[n,j]}(x[n]), and returns the
//             dispatcher's own saved state: what its backward needs, held in the pool until the state
//             is destroyed (which frees it).
//             out == nullptr: a layer's recomputation (--recompute), whose output is already kept: only
//             the saved state is wanted, and backward from it gives the same bits as from a forward
//             with out. A dispatcher may then skip the combine, or only plan where its backward
//             recomputes anyway (pllep, relay).
//   forward_residual: out [N,H] (=) = residual + forward's out, for the layer's residual stream.
//             By default forward, then a residual add (two roundings); a dispatcher may fold the add
//             into its combine (one rounding, and the [N,H] output never goes to memory on its own):
//             --moe local does. out == nullptr as in forward.
//   backward: once per saved state, with the forward's x, topk_idx, topk_w and weights: dx [N,H] (=),
//             dtopk_w [N,k] (=), and this rank's expert gradients dW13 (+=) and dW2 (+=): they
//             accumulate, since the model sums a step's micro-batches in them.
//   weight_grads: the layer's weight-gradient stream (nullptr: none), set by the model after making
//             the dispatcher. backward may enqueue its weight gradients there (side_run) and keep
//             their inputs until the model joins the stream at the end of the layer's backward
//             (side_hold); --moe local does, unless in chunks. Otherwise it computes everything on `stream`.
//   live_bound(N): what it holds in the pool for one layer with N tokens on every rank, whatever the
//             routing (DispatchBound: saved, peak, held); the per-rank prediction (Eq. 6) adds it, and
//             the tests hold the measured peaks to it.

struct DispatchSaved {
  virtual ~DispatchSaved() = default;  // frees the dispatcher's saved buffers
};

// What a dispatcher holds in the pool for one layer of N tokens per rank, whatever the router does
// (the per-rank prediction, Eq. 6, adds it): `saved` from its forward to its backward, `peak` at its
// most (saved + the backward's temporaries), every category it allocates in.
struct DispatchBound {
  size_t saved = 0, peak = 0;
  // what its backward leaves held for the layer's weight-gradient stream (MoEDispatcher::weight_grads)
  // after it returns, until the model joins that stream at the end of the layer's backward
  size_t held = 0;
};

// moe_forward + moe_backward, R = N·k routes: route maps 2·R·4 B, expert offsets (E+1)·4 B and y R·H·b
// (Dispatch) and h13 R·2I·b (ExpertIntermediates) saved; backward adds da (R·I·b; dy is written over
// y, dh13 over h13 and a over da, H13::Overwrite), beside it dxp, then xp (R·H·b), and a grouped
// GEMM's pointer table (3 per expert, Workspace; only cuBLAS's path has one, counted in both builds).
// With a weight-gradient stream, da, xp and the pointer tables of dW2 and dW13 stay held after it
// returns (dW2's is live beside dxp's).
inline DispatchBound moe_live_bound(long long N, int H, int I, int E, int k, size_t b, bool weight_grads = false) {
  const size_t R = (size_t)N * k;
  DispatchBound d;
  d.saved = 8 * R + 4 * ((size_t)E + 1) + R * H * b + 2 * R * I * b;
  const size_t tables = (weight_grads ? 6 : 3) * sizeof(void*) * (size_t)E;  // dW2's held beside dxp's, then dW13's
  d.peak = d.saved + R * H * b + R * I * b + tables;
  d.held = weight_grads ? R * H * b + R * I * b + tables : 0;
  return d;
}

struct MoEDispatcher {
  int H = 0, I = 0, E = 0, k = 0;
  MoEDispatcher(int H_, int I_, int E_, int k_) : H(H_), I(I_), E(E_), k(k_) {}
  virtual ~MoEDispatcher() = default;
  virtual std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                                 const floatX* W13, const floatX* W2, int N, cudaStream_t stream) = 0;
  virtual std::unique_ptr<DispatchSaved> forward_residual(floatX* out, const floatX* residual, const floatX* x,
                                                          const int* topk_idx, const float* topk_w, const floatX* W13,
                                                          const floatX* W2, int N, cudaStream_t stream) {
    std::unique_ptr<DispatchSaved> saved = forward(out, x, topk_idx, topk_w, W13, W2, N, stream);
    if (out != nullptr) add_inplace_or_out(out, residual, out, (size_t)N * H, stream);
    return saved;
  }
  virtual void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout,
                        const DispatchSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                        const floatX* W13, const floatX* W2, cudaStream_t stream) = 0;
  virtual DispatchBound live_bound(int N) const = 0;
  SideStream* weight_grads = nullptr;
};

// --moe local with a token budget c (--token_budget; 0 = none): a layer of N > c tokens computed in K =
// ⌈N/c⌉ chunks of s = ⌈N/K⌉ ≤ c consecutive tokens (chunk i: tokens [i·s, min(N, (i+1)·s)), the last
// shorter; none empty since (K−1)·s < N). At N ≤ c, or c = 0, one chunk: the whole layer at once.
struct TokenChunks {
  int count = 1;  // K
  int size = 0;   // s, the tokens of every chunk but the last
};
inline TokenChunks token_chunks(int N, int token_budget) {
  if (N < 0 || token_budget < 0)
    fm_fail("token_chunks", "need N >= 0 and a token budget >= 0 (0: one chunk)", "N=%d c=%d", N, token_budget);
  TokenChunks chunks;
  if (token_budget > 0 && N > token_budget) chunks.count = (int)(((long long)N + token_budget - 1) / token_budget);
  chunks.size = (int)(((long long)N + chunks.count - 1) / chunks.count);
  return chunks;
}

// --moe local: every expert on this rank (moe_forward / moe_backward), in chunks of at most c tokens
// when a token budget c < N is given (--token_budget; token_chunks).
// One chunk (c = 0 or N ≤ c): moe_forward's saved state kept to the backward (moe_live_bound at N).
// K > 1 chunks: forward computes each chunk's out rows (moe_forward with the chunk's rows of x, topk_idx,
//   topk_w, out and residual) and frees its state before the next; nothing is kept, the layer's x,
//   topk_idx and topk_w being the routing its backward replays. backward recomputes each chunk's
//   forward (moe_forward, out = nullptr) and runs its moe_backward: dx and dtopk_w chunk rows (=), dW13
//   and dW2 (+=, over the chunks in order). forward with out = nullptr (a layer's recomputation) does
//   nothing: backward recomputes anyway. The price: the experts' forward GEMMs run once more, which a
//   layer under --recompute pays anyway (its recomputation skips them here).
//   Contiguous chunks, not PipelinedLLEP's strided ones (ops/pipelined_llep.cuh): strides spread an
//   expert's relocated routes over LLEP's helpers, and one rank has no helpers; a contiguous chunk's
//   rows of x, out, dout, dx, topk_idx, topk_w and dtopk_w are slices of the layer's (pointer offsets),
//   so nothing is gathered or scattered, and every row's arithmetic is the unchunked one's but for the
//   expert GEMMs' cut into problems (which may change their kernel: out, dx, dtopk_w within the
//   operator tolerance, not bit for bit) and the weight gradients, summed chunk by chunk (K roundings
//   of the += in the BF16 build).
//   Weight gradients on `stream`, not on the layer's weight-gradient stream: a chunk's dW13 and dW2 read
//   its saved state, xp and da, which would stay held until the layer's join — K chunks of them, the
//   live set the chunks bound. So backward holds nothing after it returns (held = 0).
//   Live set: one chunk's moe_live_bound at s tokens, without a weight-gradient stream — saved 0, peak
//   8·R_s + 4·(E+1) + 2·R_s·H·b + 3·R_s·I·b + 3·8·E B (R_s = s·k routes), held 0 — whatever the routing:
//   the chunk loop holds nothing beside it. The forward's chunks hold at most the backward's (moe_live_bound).
// dense_routes: every token's one route goes to expert 0 (E = k = 1: the model's dense FFN and shared
//   expert, model.cuh's dense_ffn_dispatcher), so the one count is known without the host (moe_forward).
struct LocalDispatcher : MoEDispatcher {
  struct Saved : DispatchSaved {
    MoESaved moe;            // one chunk: moe_forward's state; K > 1: empty
    int chunked_tokens = 0;  // K > 1: N, the tokens backward recomputes in chunks; one chunk: 0
    ~Saved() override { moe_saved_free(moe); }
  };
  int token_budget = 0;      // c; 0: none
  bool dense_routes = false;  // E = k = 1, every route to expert 0
  LocalDispatcher(int H_, int I_, int E_, int k_, int token_budget_ = 0, bool dense_routes_ = false)
      : MoEDispatcher(H_, I_, E_, k_), token_budget(token_budget_), dense_routes(dense_routes_) {
    if (token_budget < 0) fm_fail("LocalDispatcher", "the token budget must be >= 0 (0: none)", "c=%d", token_budget);
  }
  std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                         const floatX* W13, const floatX* W2, int N, cudaStream_t stream) override {
    return forward_residual(out, nullptr, x, topk_idx, topk_w, W13, W2, N, stream);
  }
  std::unique_ptr<DispatchSaved> forward_residual(floatX* out, const floatX* residual, const floatX* x,
                                                  const int* topk_idx, const float* topk_w, const floatX* W13,
                                                  const floatX* W2, int N, cudaStream_t stream) override {
    auto saved = std::make_unique<Saved>();
    const TokenChunks chunks = token_chunks(N, token_budget);
    if (chunks.count == 1) {
      moe_forward(out, saved->moe, x, topk_idx, topk_w, W13, W2, N, H, I, E, k, stream, dense_routes, residual);
      return saved;
    }
    saved->chunked_tokens = N;
    if (out == nullptr) return saved;  // a recomputation: backward recomputes every chunk
    for_each_chunk(N, chunks, [&](size_t first, int n) {
      MoESaved chunk;
      moe_forward(out + first * H, chunk, x + first * H, topk_idx + first * k, topk_w + first * k, W13, W2, n, H, I, E,
                  k, stream, dense_routes, residual ? residual + first * H : nullptr);
      moe_saved_free(chunk);
    });
    return saved;
  }
  void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const DispatchSaved& saved,
                const floatX* x, const int* topk_idx, const float* topk_w, const floatX* W13, const floatX* W2,
                cudaStream_t stream) override {
    const Saved& local = static_cast<const Saved&>(saved);
    if (local.chunked_tokens == 0) {
      moe_backward(dx, dtopk_w, dW13, dW2, dout, local.moe, x, topk_idx, topk_w, W13, W2, stream, weight_grads);
      return;
    }
    const int N = local.chunked_tokens;
    for_each_chunk(N, token_chunks(N, token_budget), [&](size_t first, int n) {
      MoESaved chunk;
      const floatX* x_chunk = x + first * H;
      const int* idx_chunk = topk_idx + first * k;
      const float* w_chunk = topk_w + first * k;
      moe_forward(nullptr, chunk, x_chunk, idx_chunk, w_chunk, W13, W2, n, H, I, E, k, stream, dense_routes);
      moe_backward(dx + first * H, dtopk_w + first * k, dW13, dW2, dout + first * H, chunk, x_chunk, idx_chunk, w_chunk,
                   W13, W2, stream, nullptr);
      moe_saved_free(chunk);
    });
  }
  DispatchBound live_bound(int N) const override {
    const TokenChunks chunks = token_chunks(N, token_budget);
    if (chunks.count == 1) return moe_live_bound(N, H, I, E, k, sizeof(floatX), weight_grads != nullptr);
    return DispatchBound{0, moe_live_bound(chunks.size, H, I, E, k, sizeof(floatX), false).peak, 0};
  }

 private:
  // f(first token, tokens) for each chunk, in order.
  template <typename F>
  static void for_each_chunk(int N, const TokenChunks& chunks, F f) {
    for (int i = 0; i < chunks.count; i++) {
      const size_t first = (size_t)i * chunks.size;
      f(first, (int)std::min<size_t>(chunks.size, N - first));
    }
  }
};
