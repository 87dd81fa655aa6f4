// grouped_gemm.cuh — many row-major GEMMs of different sizes in one call: the expert GEMMs of a MoE
// layer (ops/moe.cuh: one problem per expert; the expert-parallel dispatchers: one per group of
// routes). Twin: plain products in ref/moe.hpp (tests/gpu_grouped_gemm.cu holds each problem to a
// double-precision product of the same inputs).
//
//   problem g:  C_g [M,N] = op(A_g) [M,K] · op(B_g) [K,N] + beta · C_g          C (=, or += with beta 1)
//   op(A) = A stored [M,K] (row stride lda), or, with transA, Aᵀ of A stored [K,M]; likewise op(B) =
//   B stored [K,N], or, with transB, Bᵀ of B stored [N,K] (ldb); C row stride ldc. The six expert
//   GEMMs: h13 = xp W13ᵀ and y = a W2ᵀ (transB), da = dy W2 and dxp = dh13 W13 (neither),
//   dW2 += dyᵀ a and dW13 += dh13ᵀ xp (transA, beta 1; K = the group's routes, different per group).
//
// Two implementations behind grouped_gemm (grouped_gemm_takes_kernel):
//   - BF16 build: flatmoe's own kernel below, bf16 tensor-core MMAs with fp32 accumulation, ONE launch
//     for up to GGEMM_PROBLEMS_PER_LAUNCH problems, their sizes passed as the launch's argument — except
//     shapes the kernel does not take (requirements below) and, in builds without wgmma, weight-gradient
//     problems (transA) of ≥ GGEMM_CUBLAS_MIN_FLOP each. Two forms of the same kernel: Hopper's
//     warpgroup MMA (wgmma, GPU_ARCH=90a, the default: FLATMOE_WGMMA) and mma.sync (any other GPU_ARCH).
//   - otherwise, and always in the FP32 build (pedantic fp32, no TF32): one cublasGemmGroupedBatchedEx.
// Why (notes/speed.md, 'The grouped expert GEMMs'; tools/bench_expert_gemm): cublasGemmGroupedBatchedEx
// runs the forward and input-gradient forms on an sm80 grouped kernel (240–290 TFLOP/s on B1's layer,
// 70–130 on the default model's), where the wgmma form reaches 310–420 and the mma.sync form 260–320
// (110–160 on the default model's). The weight-gradient forms, whose K differs per problem, cuBLAS does not
// group: it issues one GEMM per problem from the host, ~8 µs each, on its Hopper kernels (~340–400
// TFLOP/s). The wgmma form is faster at every size measured (B1's dW13, 4.3 GFLOP per expert: 430 against
// 340). The mma.sync form is not above ~3 GFLOP per problem (8 µs at 400 TFLOP/s; B1's dW13: 250 against
// 400), so without wgmma those go to cuBLAS; a smaller one leaves the GPU waiting on the host (the default
// model's dW: 0.3–0.6 GFLOP per expert, 30–60 TFLOP/s through cuBLAS, 70–110 on the kernel). cuBLAS's
// per-problem choice is not steady either: in one process of B1 with recomputation its dW13 and dW2
// took 2–3× their usual time (the same section).
//
// The kernel. Every problem is cut into tiles of BM × BN = 128 × 128 of C; the launch's blocks take
// the tiles of problem 0, then of problem 1, …, each problem's tiles row by row (so neighbouring
// blocks share a row panel of op(A)); a block finds its problem by a binary search over the
// problems' first tiles (kernel argument, constant cache). Per block, 4 warps in 2 × 2, each a 64 × 64
// piece of the tile (4 × 8 mma m16n8k16 per k-step of 16; 4 + 4 ldmatrix.x4 feed its 32 MMAs):
//
//                 BN = 128 columns of C (op(B)'s tile: BK × 128)
//             +-------------------+-------------------+
//   BM = 128  |      warp 0       |      warp 1       |  rows  0–63
//   rows of C |      warp 2       |      warp 3       |  rows 64–127
//             +-------------------+-------------------+
//
// The k loop takes BK = 64 at a time through a STAGES = 3 deep ring of shared-memory tiles filled
// by cp.async (the copy of k-tile kt + 2 is in flight while kt is multiplied). Each operand's tile
// is copied as it is stored, 16 bytes at a time, and ldmatrix (ops/mma.cuh) turns either storage
// into fragments:
//   stored with k contiguous ([m][k]: A; [n][k]: B with transB): 128 rows × 64 k, row stride 72
//     bf16 (144 bytes: the 8 rows of one ldmatrix phase hit 8 distinct 16-byte bank groups);
//   stored with m or n contiguous ([k][m]: A with transA; [k][n]: B): 64 k-rows × 128, row stride
//     136 bf16 (272 bytes, likewise conflict-free), read with the transposed ldmatrix.
// Shared memory: 3 stages × 2 operands × 18 KiB = 108 KiB per block, 2 blocks per SM (236–254
// registers per thread, 128 threads). Tiles measured on B1's and the default model's layers (2026-12-01,
// notes/speed.md, 'The grouped expert GEMMs'): 128 × 128 × 64 with 4 warps of 64 × 64 beat 128 × 128 × 32
// with 8 warps of 64 × 32 (the first version: 250–265 TFLOP/s, limited by L2 traffic and ldmatrix per MMA),
// 128 × 256 and 256 × 128 (one block per SM: 190–267).
//
// The wgmma form (sm_90a) keeps the tiles, the ring and the k order, and changes who multiplies:
// two warpgroups of 4 warps (256 threads), each 64 rows × all 128 columns of the tile, four wgmma
// m64n128k16 per k-tile read their operands straight from shared memory (no ldmatrix, no fragments
// in registers but the 64 accumulators per thread):
//
//             +---------------------------------------+
//   BM = 128  |  warpgroup 0 (warps 0–3, 16 rows each) |  rows  0–63
//   rows of C |  warpgroup 1 (warps 4–7)               |  rows 64–127
//             +---------------------------------------+
//
// wgmma reads tiles in its own 128-byte swizzle (ops/mma.cuh) rather than padded rows, and reads
// both storages: k contiguous as rows of 64 k (128 bytes each), m or n contiguous as pieces of 64 m
// or n, each 64 k-rows of 128 bytes; 16 KiB per 128 rows of an operand and stage. The copies land in
// the generic proxy, the MMA reads through the async proxy: each k-tile is fenced (fence.proxy.async)
// before the block barrier that publishes it, and no slot is refilled before a later barrier that
// every warpgroup reaches after waiting for the MMAs that read it.
//
// Two tile shapes in the wgmma form (grouped_gemm_tiles picks per call;
// notes/speed.md, 'The grouped expert GEMMs'):
//   narrow, 128 × 128 (as above): 3 stages, 96 KiB, 2 blocks per SM of one tile each; a warpgroup
//     waits for its MMAs at the end of each k-tile; C is stored through the ring, free by then, in
//     16-byte pieces (store_c_staged) where N % 8 == 0 and C's rows are 16-byte aligned. Launches of
//     fewer than 4 waves of wide tiles (2 for the weight gradients), and weight gradients whose
//     operands are not laid out for the TMA. (A 6-deep ring, one block per SM, for launches of at
//     most a tile per SM was measured and not kept: notes/speed.md, 'Tried and not kept'.)
//   wide, 128 × 256: each warpgroup 64 × 256 (wgmma m64n256k16, 128 accumulators per thread);
//     4 stages, 192 KiB, one block per SM. The grid is one block per SM, each looping over the
//     launch's tiles (blockIdx.x, + gridDim.x, …), except for the weight gradients (below). B1's
//     expert GEMMs. Fed one of two ways:
//     - by the TMA (grouped_gemm_tma_kernel), when the operands are laid out as two tensors
//       (grouped_gemm_tma_layout: the MoE layers' expert GEMMs; the weight gradients' A and B are
//       the routes' rows of two matrices). A ninth warp, one thread of it, issues each k-tile as
//       2 to 6 tensor copies and the ring runs on mbarriers (full / empty per slot), up to 4
//       k-tiles ahead and across tiles: the two warpgroups multiply with no block barrier, and the
//       next tile's copies run while this tile's C is stored. With beta 0 (the forward and
//       input-gradient forms) the TMA stores C too: each warp leaves its strip of C in shared memory,
//       half of it at a time, and multiplies on while the TMA writes it out (grouped_gemm_tma_kernel).
//       A weight gradient's tiles run their k loops over their experts' routes, as long as the
//       router made them: there the grid is a block per tile, which the GPU hands to SMs as they
//       free up (a round robin over persistent blocks gave an expert at 8× the mean routes' blocks
//       their share of the other tiles too, and ran B1's dW13 at 389 TFLOP/s where a block per tile
//       runs it at 507).
//     - by every thread's cp.async copies otherwise (grouped_gemm_wgmma_kernel, block barriers
//       per k-tile, one k-tile of MMAs left running across each barrier, the next tile's first
//       k-tiles copied while this tile's C is stored).
//     A warp of cp.async copies in place of the TMA was measured and not kept
//     (notes/speed.md, 'The grouped expert GEMMs'): the copies' instructions, 96 per lane and k-tile, bound
//     it at a third of the rate.
//
// Parts of a tile past M, N or K are copied as zeros (cp.async with 0 source bytes), so the edges
// need no branch in the MMA loop; C is written (or read and written) only inside [M, N].
// Requirements (else cuBLAS): every 16-byte copy lies wholly inside or outside its matrix — the
// contiguous dimension of each stored operand (K of a [m][k] or [n][k] operand, M of A stored [k][m],
// N of B stored [k][n]) and lda, ldb, ldc are multiples of 8, A and B 16-byte aligned, C 4-byte
// aligned, N even.
//
// Routed problems (GroupedGemmProblems::route_offsets): the expert GEMMs of a layer whose per-expert
// row counts are only on the device (ops/moe.cuh's local layer: nothing waits for a download). Problem
// g is expert g's; its routes are the rows [route_offsets[g], route_offsets[g+1]) of expert-sorted
// buffers — the rows of A and C (its M) without transA, of A and B (its K) with transA — and the
// problem names those buffers' row 0 (the other operand: the expert's own matrix). The kernel reads
// the two offsets and moves the route-indexed pointers by offset × ld. A block cannot know its problem
// from the host's tile table, so each block has its first warp lay the problems' tiles out from the
// offsets (a prefix over ≤ 64 problems, shuffles) in shared memory and searches that:
//   - without transA the routes are rows of C, so a problem's tiles are ⌈routes/BM⌉ rows of them, in
//     problem order; the launch has blocks for the most tiles any split of the routes can need,
//     ⌈routes/BM⌉ + problems per column of tiles, and the surplus blocks return at once;
//   - with transA the tiles are fixed (M × N, the expert's weight) but each one's k loop runs over the
//     routes, so the problems with the most routes take the first tiles: under skewed routing the
//     longest tiles start first instead of trailing the launch (the weight gradients' tail).
// A problem without routes has no tiles and leaves its C untouched, as the host form does by leaving
// it out. The same tiles in the same k order as the host
// form: the same bits (GroupedGemmGpu.RoutedProblems…). Routed problems that the kernel does not take
// (the FP32 build; shapes outside its requirements) are resolved on the host: one download of the
// offsets, a host wait.
//
// Exactness: each C element is one lane's fp32 sum over k in a fixed order (16 per MMA, k-tiles in
// order), plus beta · C read as bf16, rounded once to bf16: deterministic, and bit-identical on replay.
// The two forms (wgmma, mma.sync) add the same products in the same order of k-steps; the tensor
// cores' rounding inside a step may differ, and the tests hold each form to the same tolerance.
// It differs from cuBLAS's (another summation order) by fp32 rounding before the one bf16 rounding.
// Memory: none besides its operands (the problems, and the TMA form's two tensor maps, travel as kernel
// arguments; the cuBLAS path keeps a pointer table of 3 per problem in the Workspace for the call).
#pragma once
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>
#include "common.cuh"
#include "mma.cuh"
#include "../runtime/pool.cuh"
#include "../runtime/stream.cuh"

// Row-major problem g: C_g [M,N] = op(A_g) [M,K] · op(B_g) [K,N] + beta · C_g (see the header).
struct GroupedGemmProblem {
  const floatX* A;
  const floatX* B;
  floatX* C;
  int M, N, K;
};

// ---------------------------------------------------------------------------------------------
// The tensor-core kernel (bf16)

namespace ggemm {

typedef __nv_bfloat16 bf16;
constexpr int BM = 128, BK = 64;  // rows of a C tile and the k-step of a block, in both forms
// The wgmma form's two tile shapes (header; grouped_gemm_tiles picks one per call). Both have two
// warpgroups, each 64 rows × all BN columns of the tile, and a ring of STAGES k-tiles, with the copy
// of k-tile kt + AHEAD in flight while kt is multiplied (AHEAD = STAGES − 1 − IN_FLIGHT); IN_FLIGHT:
// the k-tiles of MMAs a warpgroup leaves running when it reaches the next barrier.
struct NarrowTiles {  // 128 × 128, 96 KiB: two blocks per SM, one tile each (the mma.sync form's tile)
  static constexpr int BN = 128, STAGES = 3, IN_FLIGHT = 0;
  static constexpr bool PERSISTENT = false;
};
struct WideTiles {  // 128 × 256, 192 KiB: one block per SM, looping over the launch's tiles
  static constexpr int BN = 256, STAGES = 4, IN_FLIGHT = 1;
  static constexpr bool PERSISTENT = true;
};
// the mma.sync form: the narrow tiles, 4 warps
constexpr int BN = NarrowTiles::BN;         // columns of a C tile
constexpr int STAGES = NarrowTiles::STAGES; // shared-memory tiles in flight per operand
constexpr int WARPS_M = 2, WARPS_N = 2;     // warps per block: rows × columns of the C tile
constexpr int THREADS = 32 * WARPS_M * WARPS_N;
constexpr int WARP_M = BM / WARPS_M, WARP_N = BN / WARPS_N;  // a warp's piece of C
constexpr int MT = WARP_M / 16, NT = WARP_N / 8;             // its 16 × 8 MMA blocks
constexpr int LD_K = BK + 8;                // row stride of a tile stored with k contiguous (bf16)
// one operand's tile of `rows` (BM for A, BN for B) in shared memory, either way it is stored
constexpr int tile_elems(int rows) { return rows * LD_K > BK * (rows + 8) ? rows * LD_K : BK * (rows + 8); }
constexpr int A_TILE = tile_elems(BM), B_TILE = tile_elems(BN);
constexpr size_t SHARED_BYTES = (size_t)STAGES * (A_TILE + B_TILE) * sizeof(bf16);  // both rings

// One problem as the kernel reads it: its tiles are the launch's blocks [first_tile, first_tile +
// ⌈M/BM⌉·tiles_n).
struct Problem {
  const bf16* A;
  const bf16* B;
  bf16* C;
  int M, N, K, tiles_n;
  unsigned int first_tile;
};

}  // namespace ggemm

// One launch's problems, by value as its kernel argument (3 KiB).
static const int GGEMM_PROBLEMS_PER_LAUNCH = 64;
struct GroupedGemmBatch {
  ggemm::Problem p[GGEMM_PROBLEMS_PER_LAUNCH];
  int count = 0;            // problems in p
  unsigned int tiles = 0;   // the launch's blocks
  // routed problems (header): [count + 1] on the device; p's routed size (M, or K with transA) is
  // then read there, and without transA p's first_tile too. nullptr: p holds every size.
  const int* route_offsets = nullptr;
};

// A routed problem p (header), given at row 0 of the expert-sorted buffers, moved to its `routes` rows
// from row `first`: the route-indexed operands' pointers by first × their row stride, and its routed
// size set. P: the host's GroupedGemmProblem or the kernel's ggemm::Problem.
template <typename P>
__host__ __device__ __forceinline__ void move_to_routes(P& p, int first, int routes, bool transA, int lda, int ldb,
                                                        int ldc) {
  p.A += (size_t)first * lda;
  if (transA) {  // routes = rows of A and B: K
    p.B += (size_t)first * ldb;
    p.K = routes;
  } else {       // routes = rows of A and C: M
    p.C += (size_t)first * ldc;
    p.M = routes;
  }
}

// The problems of one grouped GEMM: `list`, and for routed problems (header) their offsets.
struct GroupedGemmProblems {
  std::vector<GroupedGemmProblem> list;
  const int* route_offsets = nullptr;  // [list.size() + 1] device, or nullptr: every size in list
  int routes = 0;                      // routed: the buffers' rows (route_offsets[list.size()] at most)
  GroupedGemmProblems() = default;
  GroupedGemmProblems(std::vector<GroupedGemmProblem> problems) : list(std::move(problems)) {}
};

// The operands of the wide tiles' TMA form (header) as the two tensors its copies read, encoded on
// the host (grouped_gemm_tensors): A's rows [rows][K] from a_first; the experts' B, a stack
// [experts][N][K] (transB) or [experts][K][N] from b_first, b_expert elements apart. A problem's rows
// of A are found as (its A − a_first) / lda, its expert as (its B − b_first) / b_expert. With C stored
// by the TMA (beta 0, C's rows beside A's), the third tensor C: row r of it is C's row beside A's row r.
struct GroupedGemmTensors {
  CUtensorMap a, b;
  CUtensorMap c;  // when the TMA stores C: [rows][N], row r beside A's row r (grouped_gemm_tma_c_beside_a)
  const ggemm::bf16* a_first;
  const ggemm::bf16* b_first;
  long long b_expert;
};

namespace ggemm {

// One BK-deep tile of an operand into shared memory, as it is stored. K_CONTIGUOUS: ROWS rows (m
// or n) × BK, element (r, k) at src[r·ld + k], row stride LD_K; else BK k-rows × ROWS, element (k, c)
// at src[k·ld + c], row stride ROWS + 8. src points at the tile's first element; rows_left / k_left:
// how many of its rows (m or n) and k lie inside the matrix; the rest is zero-filled. ROWS·BK/8
// copies of 16 bytes, spread over the block's threads.
template <bool K_CONTIGUOUS, int ROWS>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* src, int ld, int rows_left, int k_left) {
  static_assert(ROWS * BK / 8 % THREADS == 0, "whole copies per thread");
#pragma unroll
  for (int i = 0; i < ROWS * BK / 8 / THREADS; i++) {
    const int idx = threadIdx.x + i * THREADS;
    if (K_CONTIGUOUS) {
      const int r = idx / (BK / 8), k = (idx % (BK / 8)) * 8;
      const bool inside = r < rows_left && k < k_left;
      cp_async_16(dst + r * LD_K + k, inside ? src + (size_t)r * ld + k : src, inside ? 16 : 0);
    } else {
      const int k = idx / (ROWS / 8), c = (idx % (ROWS / 8)) * 8;
      const bool inside = k < k_left && c < rows_left;
      cp_async_16(dst + k * (ROWS + 8) + c, inside ? src + (size_t)k * ld + c : src, inside ? 16 : 0);
    }
  }
}

// The A fragments of k-step ks (k 16ks … 16ks+15) for the warp's MT 16-row strips starting at row0.
template <bool TRANS_A>
__device__ __forceinline__ void load_a_fragments(uint32_t (&a)[MT][4], const bf16* tile, int row0, int ks, int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; mt++) {
    const int m = row0 + mt * 16;
    if (!TRANS_A)  // stored [m][k]
      ldmatrix_x4(a[mt], tile + (m + lane % 8 + 8 * ((lane / 8) % 2)) * LD_K + ks * 16 + 8 * (lane / 16));
    else           // stored [k][m]
      ldmatrix_x4_trans(a[mt], tile + (ks * 16 + lane % 8 + 8 * (lane / 16)) * (BM + 8) + m + 8 * ((lane / 8) % 2));
  }
}

// The B fragments of k-step ks for the warp's NT 8-column blocks starting at col0: b[nt][0..1].
template <bool TRANS_B>
__device__ __forceinline__ void load_b_fragments(uint32_t (&b)[NT][2], const bf16* tile, int col0, int ks, int lane) {
#pragma unroll
  for (int np = 0; np < NT / 2; np++) {  // 16 columns per ldmatrix.x4: blocks 2np, 2np + 1
    const int n = col0 + np * 16;
    uint32_t r[4];
    if (TRANS_B)  // stored [n][k]
      ldmatrix_x4(r, tile + (n + lane % 8 + 8 * (lane / 16)) * LD_K + ks * 16 + 8 * ((lane / 8) % 2));
    else          // stored [k][n]
      ldmatrix_x4_trans(r, tile + (ks * 16 + lane % 8 + 8 * ((lane / 8) % 2)) * (BN + 8) + n + 8 * (lane / 16));
    b[2 * np][0] = r[0];
    b[2 * np][1] = r[1];
    b[2 * np + 1][0] = r[2];
    b[2 * np + 1][1] = r[3];
  }
}

// A routed launch's tiles (header), laid out once per block in shared memory by its first warp.
struct RoutedTiles {
  int routes[GGEMM_PROBLEMS_PER_LAUNCH];                 // [problem]: its routes (0 past the launch's problems)
  int problem[GGEMM_PROBLEMS_PER_LAUNCH];                // [place]: the problem whose tiles come place-th
  unsigned int first_tile[GGEMM_PROBLEMS_PER_LAUNCH + 1];  // [place]: that problem's first tile; [G]: all tiles
};

// Fills `routed` from the launch's offsets (warp 0; routed_tiles synchronises the block after it).
template <bool TRANS_A>
__device__ __forceinline__ void lay_out_routed_tiles(const GroupedGemmBatch& batch, RoutedTiles& routed) {
  constexpr int G = GGEMM_PROBLEMS_PER_LAUNCH;
  if (threadIdx.x >= 32) return;  // warp 0, lane l: problems 2l and 2l + 1, then places 2l and 2l + 1
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const int g = 2 * threadIdx.x + j;
    routed.routes[g] = g < batch.count ? batch.route_offsets[g + 1] - batch.route_offsets[g] : 0;
  }
  __syncwarp();
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const int g = 2 * threadIdx.x + j, routes = routed.routes[g];
    int place = g;  // without transA, problem order
    if (TRANS_A) {  // a tile's k loop runs over the routes: more routes first (ties: lower index first)
      place = 0;
      for (int h = 0; h < G; h++) place += routed.routes[h] > routes || (routed.routes[h] == routes && h < g);
    }
    routed.problem[place] = g;
  }
  __syncwarp();
  unsigned int mine[2];  // the tiles of places 2l and 2l + 1
#pragma unroll
  for (int j = 0; j < 2; j++) {
    const int g = routed.problem[2 * threadIdx.x + j], routes = routed.routes[g];
    const int rows = TRANS_A ? batch.p[g].M : routes;  // routes: rows of C, or k
    mine[j] = g < batch.count && routes > 0 ? (unsigned)((rows + BM - 1) / BM) * batch.p[g].tiles_n : 0;
  }
  const unsigned int through = warp_inclusive_scan(mine[0] + mine[1]);  // inclusive prefix over lanes
  const unsigned int before = through - mine[0] - mine[1];
  routed.first_tile[2 * threadIdx.x] = before;
  routed.first_tile[2 * threadIdx.x + 1] = before + mine[0];
  if (threadIdx.x == 31) routed.first_tile[G] = through;
}

// A routed launch's tiles, laid out once in this block's shared memory by its first warp; every thread
// returns once they are. Unset for a launch without route offsets.
template <bool TRANS_A>
__device__ __forceinline__ const RoutedTiles& routed_tiles(const GroupedGemmBatch& batch) {
  __shared__ RoutedTiles routed;
  if (batch.route_offsets) {
    lay_out_routed_tiles<TRANS_A>(batch, routed);
    __syncthreads();
  }
  return routed;
}

// The launch's tile number `index`: its problem p and its tile within p; false: no such tile (past a
// routed launch's tiles, or past the launch's). `routed`: lay_out_routed_tiles's, for a routed launch.
template <bool TRANS_A>
__device__ __forceinline__ bool tile_problem(const GroupedGemmBatch& batch, const RoutedTiles& routed, unsigned int index,
                                             int lda, int ldb, int ldc, Problem& p, int& tile) {
  const bool is_routed = batch.route_offsets != nullptr;
  if (index >= (is_routed ? routed.first_tile[GGEMM_PROBLEMS_PER_LAUNCH] : batch.tiles)) return false;
  // the last place whose first tile is ≤ index (a place without tiles shares its first tile with the
  // next, so the search passes over it); routed, places past batch.count hold no tiles
  auto first_tile = [&](int place) { return is_routed ? routed.first_tile[place] : batch.p[place].first_tile; };
  int lo = 0, hi = batch.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first_tile(mid) <= index) lo = mid;
    else hi = mid - 1;
  }
  const int g = is_routed ? routed.problem[lo] : lo;
  p = batch.p[g];
  tile = index - first_tile(lo);
  if (is_routed) {
    const int first = batch.route_offsets[g];
    move_to_routes(p, first, batch.route_offsets[g + 1] - first, TRANS_A, lda, ldb, ldc);
  }
  return true;
}

// Stores one C fragment row pair of a 16-row strip: the 8-column blocks j < BLOCKS hold, in acc[4j …
// 4j+3], (row, col + 8j … +1) and (row + 8, col + 8j … +1) (ops/mma.cuh: the fragment); beta · C
// added as read; only inside [M, N].
template <int BLOCKS>
__device__ __forceinline__ void store_c_fragments(const Problem& p, int row, int col, const float* acc, int ldc,
                                                  float beta) {
#pragma unroll
  for (int half = 0; half < 2; half++) {
    const int r = row + 8 * half;
    if (r >= p.M) continue;
#pragma unroll
    for (int j = 0; j < BLOCKS; j++) {
      const int c = col + 8 * j;
      if (c >= p.N) continue;
      __nv_bfloat162* dst = reinterpret_cast<__nv_bfloat162*>(p.C + (size_t)r * ldc + c);
      float v0 = acc[4 * j + 2 * half], v1 = acc[4 * j + 2 * half + 1];
      if (beta != 0.f) {
        const float2 old = __bfloat1622float2(*dst);
        v0 += beta * old.x;
        v1 += beta * old.y;
      }
      *dst = __floats2bfloat162_rn(v0, v1);
    }
  }
}

// With beta ≠ 0, a block asks L2 for its tile's C rows (128-byte lines) when the tile starts, so that
// the epilogue's reads of C, one round trip per 32 columns, find them there rather than in HBM: a GEMM
// of short K that adds into a large C (ops/router.cuh's dx, K = 96) is otherwise bound by those reads.
template <int TILE_N>
__device__ __forceinline__ void prefetch_c_tile(const Problem& p, int m0, int n0, int ldc) {
  constexpr int LINES = TILE_N * 2 / 128;  // per row of the tile
  for (int i = threadIdx.x; i < BM * LINES; i += blockDim.x) {
    const int row = m0 + i / LINES, col = n0 + (i % LINES) * 64;
    if (row < p.M && col < p.N) asm volatile("prefetch.global.L2 [%0];" ::"l"(p.C + (size_t)row * ldc + col));
  }
}

// store_c_fragments's values (the same fp32 sum, beta · C added, one rounding) for one warp's 16-row
// strip, written through shared memory so that each store is 16 bytes and a strip's row is written
// 64 contiguous bytes at a time (the fragments' own stores are 4 bytes, 8 rows apart). 32 columns at a
// time: the warp puts its fragments into `staging` (16 rows × STAGED_ROW floats, this warp's), then
// each lane takes 8 columns of one row. Needs N % 8 == 0 and 16-byte aligned rows of C. The narrow
// tiles and the TMA form store C so; the thread-fed wide tiles, whose ring already holds the next
// tile's k-tiles, and the mma.sync form store the fragments as they are.
constexpr int STAGED_ROW = 40;  // floats: a half-warp's 8-byte fragment writes fall in 32 distinct banks
constexpr int STAGED_FLOATS = 16 * STAGED_ROW;  // per warp
template <int BLOCKS>
__device__ __forceinline__ void store_c_staged(const Problem& p, int row0, int col0, const float* acc, int ldc, float beta,
                                               float* staging, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int part = 0; part < BLOCKS / 4; part++) {  // columns 32·part … +31: blocks 4·part … +3
    // beta · C: both pieces' old values are read first, while the fragments are staged (the compiler
    // would not move the second read above the first store): one round trip per part, not two
    uint4 olds[2] = {};
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int row = row0 + 8 * i + lane / 4, col = col0 + 32 * part + 8 * (lane % 4);
      if (beta != 0.f && row < p.M && col < p.N) olds[i] = *reinterpret_cast<const uint4*>(p.C + (size_t)row * ldc + col);
    }
#pragma unroll
    for (int jj = 0; jj < 4; jj++) {
      const float* a = acc + 4 * (4 * part + jj);
      *reinterpret_cast<float2*>(staging + g * STAGED_ROW + 8 * jj + 2 * t) = make_float2(a[0], a[1]);
      *reinterpret_cast<float2*>(staging + (g + 8) * STAGED_ROW + 8 * jj + 2 * t) = make_float2(a[2], a[3]);
    }
    __syncwarp();
#pragma unroll
    for (int i = 0; i < 2; i++) {
      const int r = 8 * i + lane / 4, c = 8 * (lane % 4);  // the strip's row, the first of 8 columns
      const int row = row0 + r, col = col0 + 32 * part + c;
      if (row < p.M && col < p.N) {
        const float4 lo = *reinterpret_cast<const float4*>(staging + r * STAGED_ROW + c);
        const float4 hi = *reinterpret_cast<const float4*>(staging + r * STAGED_ROW + c + 4);
        float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        uint4* dst = reinterpret_cast<uint4*>(p.C + (size_t)row * ldc + col);
        if (beta != 0.f) {
          const uint4 old = olds[i];
          const __nv_bfloat162* old2 = reinterpret_cast<const __nv_bfloat162*>(&old);
#pragma unroll
          for (int q = 0; q < 4; q++) {
            const float2 o = __bfloat1622float2(old2[q]);
            v[2 * q] += beta * o.x;
            v[2 * q + 1] += beta * o.y;
          }
        }
        uint4 out;
        __nv_bfloat162* out2 = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
        for (int q = 0; q < 4; q++) out2[q] = __floats2bfloat162_rn(v[2 * q], v[2 * q + 1]);
        *dst = out;
      }
    }
    __syncwarp();  // the strip's next 32 columns reuse `staging`
  }
}

// One block = one 128 × 128 tile of C of one problem (header).
template <bool TRANS_A, bool TRANS_B>
__global__ void __launch_bounds__(THREADS) grouped_gemm_kernel(const GroupedGemmBatch batch, int lda, int ldb, int ldc,
                                                                  float beta) {
  extern __shared__ __align__(16) bf16 shared[];
  bf16* a_ring = shared;                    // STAGES tiles of op(A)
  bf16* b_ring = shared + STAGES * A_TILE;  // STAGES tiles of op(B)
  Problem p;
  int tile;
  // false: a routed launch's surplus block
  if (!tile_problem<TRANS_A>(batch, routed_tiles<TRANS_A>(batch), blockIdx.x, lda, ldb, ldc, p, tile)) return;
  const int m0 = (tile / p.tiles_n) * BM, n0 = (tile % p.tiles_n) * BN;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int warp_row = (warp / WARPS_N) * WARP_M, warp_col = (warp % WARPS_N) * WARP_N;

  // k-tile kt of each operand into ring slot kt % STAGES
  auto load_stage = [&](int kt) {
    const int k0 = kt * BK, slot = kt % STAGES;
    const bf16* a_src = TRANS_A ? p.A + (size_t)k0 * lda + m0 : p.A + (size_t)m0 * lda + k0;
    const bf16* b_src = TRANS_B ? p.B + (size_t)n0 * ldb + k0 : p.B + (size_t)k0 * ldb + n0;
    load_tile<!TRANS_A, BM>(a_ring + slot * A_TILE, a_src, lda, p.M - m0, p.K - k0);
    load_tile<TRANS_B, BN>(b_ring + slot * B_TILE, b_src, ldb, p.N - n0, p.K - k0);
  };

  float acc[MT][NT][4] = {};  // [16-row strip][8-column block][C fragment]
  const int k_tiles = (p.K + BK - 1) / BK;
#pragma unroll
  for (int kt = 0; kt < STAGES - 1; kt++) {  // one commit group per k-tile, empty past the last
    if (kt < k_tiles) load_stage(kt);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; kt++) {
    cp_async_wait<STAGES - 2>();  // k-tile kt has landed (this thread's copies) …
    __syncthreads();              // … everyone's; and every warp is done with slot (kt − 1) % STAGES
    if (kt + STAGES - 1 < k_tiles) load_stage(kt + STAGES - 1);
    cp_async_commit();
    const bf16* a_tile = a_ring + (kt % STAGES) * A_TILE;
    const bf16* b_tile = b_ring + (kt % STAGES) * B_TILE;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++) {
      uint32_t a[MT][4], b[NT][2];
      load_a_fragments<TRANS_A>(a, a_tile, warp_row, ks, lane);
      load_b_fragments<TRANS_B>(b, b_tile, warp_col, ks, lane);
#pragma unroll
      for (int mt = 0; mt < MT; mt++)
#pragma unroll
        for (int nt = 0; nt < NT; nt++) mma_16816(acc[mt][nt], a[mt], b[nt][0], b[nt][1]);
    }
  }
  cp_async_wait_all();

  // each 16-row strip's C fragments: (row g or g + 8, columns 2t, 2t + 1) of each 16 × 8 block
#pragma unroll
  for (int mt = 0; mt < MT; mt++)
    store_c_fragments<NT>(p, m0 + warp_row + mt * 16 + lane / 4, n0 + warp_col + 2 * (lane % 4), &acc[mt][0][0], ldc,
                          beta);
}

#if defined(FLATMOE_WGMMA)
// ---- the wgmma form (sm_90a builds; header) ----
constexpr int WG_THREADS = 256;
template <class Tiles>
constexpr size_t wgmma_shared_bytes() {  // + 1 KiB: the 1024-byte alignment of the tiles
  return (size_t)Tiles::STAGES * (BM + Tiles::BN) * BK * sizeof(bf16) + 1024;
}
template <class Tiles>
constexpr int wgmma_blocks_per_sm() { return wgmma_shared_bytes<Tiles>() * 2 <= 227 * 1024 ? 2 : 1; }

// Byte offset in a swizzled tile of the 16-byte piece holding (r, 8c … 8c+7): K_CONTIGUOUS: r a row (m
// or n, < the tile's rows), c the piece of k (< 8); else r a k-row (< 64), c the piece of m or n (< the
// tile's rows / 8), in 64-wide pieces of m or n BK·128 bytes apart.
template <bool K_CONTIGUOUS>
__device__ __forceinline__ int swizzled_piece(int r, int c) {
  if (K_CONTIGUOUS) return swizzle_128b(r, c);
  return (c / 8) * (BK * 128) + swizzle_128b(r, c % 8);
}

// load_tile's copies (same tile, same zero-filled edges) into the swizzled layout.
template <bool K_CONTIGUOUS, int ROWS>
__device__ __forceinline__ void load_swizzled_tile(uint8_t* dst, const bf16* src, int ld, int rows_left, int k_left) {
  static_assert(ROWS * BK / 8 % WG_THREADS == 0, "whole copies per thread");
#pragma unroll
  for (int i = 0; i < ROWS * BK / 8 / WG_THREADS; i++) {
    const int idx = threadIdx.x + i * WG_THREADS;
    if (K_CONTIGUOUS) {
      const int r = idx / (BK / 8), c = idx % (BK / 8);
      const bool inside = r < rows_left && 8 * c < k_left;
      cp_async_16(dst + swizzled_piece<true>(r, c), inside ? src + (size_t)r * ld + 8 * c : src, inside ? 16 : 0);
    } else {
      const int k = idx / (ROWS / 8), c = idx % (ROWS / 8);
      const bool inside = k < k_left && 8 * c < rows_left;
      cp_async_16(dst + swizzled_piece<false>(k, c), inside ? src + (size_t)k * ld + 8 * c : src, inside ? 16 : 0);
    }
  }
}

// The descriptor of k-step ks (k 16ks … 16ks+15) of a swizzled tile at shared address `tile`, for its
// piece starting at row `row0` (a multiple of 64): A's 64 rows of this warpgroup, or all of B's.
template <bool K_CONTIGUOUS>
__device__ __forceinline__ uint64_t tile_descriptor(uint32_t tile, int row0, int ks) {
  if (K_CONTIGUOUS) return wgmma_descriptor(tile + row0 * 128 + ks * 32, 16);
  return wgmma_descriptor(tile + (row0 / 64) * (BK * 128) + ks * 16 * 128, BK * 128);
}

// grouped_gemm_kernel's k order and epilogue on wgmma, in tiles of BM × Tiles::BN (header). A block
// takes the launch's tiles blockIdx.x, + gridDim.x, …: one with a grid of every tile; with a
// persistent grid, the copies of its next tile's first k-tiles start before this tile's C is stored.
template <bool TRANS_A, bool TRANS_B, class Tiles>
__global__ void __launch_bounds__(WG_THREADS, wgmma_blocks_per_sm<Tiles>())
    grouped_gemm_wgmma_kernel(const GroupedGemmBatch batch, int lda, int ldb, int ldc, float beta) {
  constexpr int TILE_N = Tiles::BN, STAGES = Tiles::STAGES, IN_FLIGHT = Tiles::IN_FLIGHT;
  constexpr int AHEAD = STAGES - 1 - IN_FLIGHT;  // k-tiles copied ahead of the one multiplied
  constexpr int A_TILE_BYTES = BM * BK * 2, B_TILE_BYTES = TILE_N * BK * 2;
  extern __shared__ __align__(16) uint8_t shared_bytes[];
  const uint32_t shared_start = smem_addr(shared_bytes);
  const uint32_t aligned = (shared_start + 1023) & ~1023u;  // the swizzle needs 1024-byte aligned tiles
  uint8_t* a_ring = shared_bytes + (aligned - shared_start);  // STAGES tiles of op(A)
  uint8_t* b_ring = a_ring + STAGES * A_TILE_BYTES;           // STAGES tiles of op(B)
  const RoutedTiles& routed = routed_tiles<TRANS_A>(batch);
  const int warpgroup = threadIdx.x / 128;  // rows 64·warpgroup … +63 of the tile

  // k-tile kt of the tile at (m0, n0) of problem p into ring slot kt % STAGES
  auto load_stage = [&](const Problem& p, int m0, int n0, int kt) {
    const int k0 = kt * BK, slot = kt % STAGES;
    const bf16* a_src = TRANS_A ? p.A + (size_t)k0 * lda + m0 : p.A + (size_t)m0 * lda + k0;
    const bf16* b_src = TRANS_B ? p.B + (size_t)n0 * ldb + k0 : p.B + (size_t)k0 * ldb + n0;
    load_swizzled_tile<!TRANS_A, BM>(a_ring + slot * A_TILE_BYTES, a_src, lda, p.M - m0, p.K - k0);
    load_swizzled_tile<TRANS_B, TILE_N>(b_ring + slot * B_TILE_BYTES, b_src, ldb, p.N - n0, p.K - k0);
  };
  auto load_first_stages = [&](const Problem& p, int m0, int n0) {  // one commit group per k-tile
    const int k_tiles = (p.K + BK - 1) / BK;
#pragma unroll
    for (int kt = 0; kt < AHEAD; kt++) {
      if (kt < k_tiles) load_stage(p, m0, n0, kt);
      cp_async_commit();
    }
  };

  Problem p;
  int tile;
  unsigned int index = blockIdx.x;
  if (!tile_problem<TRANS_A>(batch, routed, index, lda, ldb, ldc, p, tile)) return;
  int m0 = (tile / p.tiles_n) * BM, n0 = (tile % p.tiles_n) * TILE_N;
  load_first_stages(p, m0, n0);
  if (!Tiles::PERSISTENT && beta != 0.f) prefetch_c_tile<TILE_N>(p, m0, n0, ldc);
  while (true) {
    float acc[TILE_N / 2] = {};  // this warpgroup's 64 × TILE_N piece of C (ops/mma.cuh: the fragment)
    const int k_tiles = (p.K + BK - 1) / BK;
    for (int kt = 0; kt < k_tiles; kt++) {
      cp_async_wait<AHEAD - 1>();  // k-tile kt has landed (this thread's copies) …
      fence_proxy_async_shared();  // … is visible to the MMA's reads …
      __syncthreads();             // … everyone's; both warpgroups are done with slot (kt − 1 − IN_FLIGHT) % STAGES
      if (kt + AHEAD < k_tiles) load_stage(p, m0, n0, kt + AHEAD);
      cp_async_commit();
      const uint32_t a_tile = smem_addr(a_ring + (kt % STAGES) * A_TILE_BYTES);
      const uint32_t b_tile = smem_addr(b_ring + (kt % STAGES) * B_TILE_BYTES);
      wgmma_fence();
      wgmma_fence_operands(acc);
#pragma unroll
      for (int ks = 0; ks < BK / 16; ks++) {
        const uint64_t a = tile_descriptor<!TRANS_A>(a_tile, 64 * warpgroup, ks);
        const uint64_t b = tile_descriptor<TRANS_B>(b_tile, 0, ks);
        if constexpr (TILE_N == 128) wgmma_m64n128k16<TRANS_A, !TRANS_B>(acc, a, b, 1);
        else wgmma_m64n256k16<TRANS_A, !TRANS_B>(acc, a, b, 1);
      }
      wgmma_commit();
      wgmma_wait<IN_FLIGHT>();
      wgmma_fence_operands(acc);
    }
    wgmma_wait<0>();
    wgmma_fence_operands(acc);

    Problem next_p;
    int next_tile;
    index += gridDim.x;
    const bool more =
        Tiles::PERSISTENT && tile_problem<TRANS_A>(batch, routed, index, lda, ldb, ldc, next_p, next_tile);
    if (more) {         // the next tile's first k-tiles are copied while this one's C is stored
      __syncthreads();  // both warpgroups are done reading the ring
      load_first_stages(next_p, (next_tile / next_p.tiles_n) * BM, (next_tile % next_p.tiles_n) * TILE_N);
    }
    const int lane = threadIdx.x % 32, strip = m0 + 64 * warpgroup + 16 * ((threadIdx.x / 32) % 4);
    if (!Tiles::PERSISTENT && p.N % 8 == 0 && ldc % 8 == 0 && (uintptr_t)p.C % 16 == 0) {
      // one tile per block: the ring is free once both warpgroups are done with it, and holds C's staging
      cp_async_wait_all();
      __syncthreads();
      float* staging = reinterpret_cast<float*>(a_ring) + (threadIdx.x / 32) * STAGED_FLOATS;
      store_c_staged<TILE_N / 8>(p, strip, n0, acc, ldc, beta, staging, lane);
      break;
    }
    store_c_fragments<TILE_N / 8>(p, strip + lane / 4, n0 + 2 * (lane % 4), acc, ldc, beta);
    if (!more) break;
    p = next_p;
    m0 = (next_tile / p.tiles_n) * BM;
    n0 = (next_tile % p.tiles_n) * TILE_N;
  }
  cp_async_wait_all();
}

// The wide tiles fed by the TMA (header): warps 0–7 are the two consumer warpgroups, 64 rows × 256
// columns of the tile each, as in the kernel above; lane 0 of warp 8 is the producer. For k-tile
// number `it` of this block (counted across its tiles) the producer waits until ring slot
// s = it % STAGES is empty, announces the k-tile's bytes on full[s] and issues its copies: A's 128
// rows × 64 k as one box, B's 256 × 64 as one box (transB) or four of 64 n × 64 k. Each consumer
// warpgroup waits for full[s], runs the k-tile's MMAs, and once the MMAs of k-tile it − 1 are done
// each of its warps arrives on empty[(it − 1) % STAGES] (8 arrivals free a slot). Phases alternate
// every STAGES k-tiles: a wait on full[s] for k-tile it is for parity (it / STAGES) & 1; the producer's
// wait on empty[s], one phase behind, passes at once for the first STAGES. So the producer runs up
// to STAGES k-tiles ahead, into the next tile while this one's C is stored, and no barrier of the
// whole block is in the k loop. Rows past a problem's M come from the next problem's rows (or are
// zeros past the tensor) and only feed C rows that are not stored; K and N stop at the tensor's
// edge, past which the TMA fills zeros, so the sums are those of the kernel above: the same bits.
// C is written through shared memory in 16-byte stores (store_c_staged; 20 KiB besides the ring), or,
// C_BY_TMA (beta 0 and C's rows beside A's: the forward and input-gradient forms of the MoE layers), by
// the TMA: each consumer warp writes its 16 × 256 strip of C, rounded to bf16, in two halves of 128
// columns through its own 4 KiB of shared memory in the 128-byte swizzle (two pieces of 64 columns);
// lane 0 issues each half's two boxes' stores (waiting, before the second half, until the first
// half's have read the 4 KiB) and the warp goes on to the next tile's MMAs while the TMA writes the
// second half out; before the warp writes its strip again, lane 0 waits until those stores have read
// it. Without it the two warpgroups stop multiplying while they store
// (notes/speed.md, 'The grouped expert GEMMs': without any store the wide tiles run 16–32 % faster). A
// strip with rows past its problem's M (the TMA would write the next problem's rows) is stored as
// before, through the same 4 KiB. The ring stays 4 stages deep (4 × 48 + 32 KiB of C). The same values,
// rounded the same way: the same bits.
// The weight-gradient form (TRANS_A: A [routes][M], B [routes][N], k = the problem's routes) copies
// A's 64 k-rows × 128 m as two boxes of 64 m and B's as four of 64 n; its k loop ends inside the
// tensor (the next problem's routes follow), so on a problem's last k-tile, when it is partial, the
// consumers overwrite the k-rows past K with zeros in both tiles before the MMAs read them (fenced
// for the async proxy, then a barrier of the 256 consumer threads): the sums are those of the
// thread-fed kernel, whose copies zero-fill past K.
constexpr int TMA_THREADS = 9 * 32;
constexpr int C_STRIP_BYTES = 16 * WideTiles::BN;  // half a consumer warp's strip of C in bf16 (C_BY_TMA)
template <bool C_BY_TMA>
constexpr size_t tma_shared_bytes() {  // the ring, then the consumer warps' C strips or staging
  return wgmma_shared_bytes<WideTiles>() + 8 * (C_BY_TMA ? (size_t)C_STRIP_BYTES : STAGED_FLOATS * sizeof(float));
}
static_assert(tma_shared_bytes<true>() <= 227 * 1024 && tma_shared_bytes<false>() <= 227 * 1024, "one block per SM");
static_assert(STAGED_FLOATS * sizeof(float) <= C_STRIP_BYTES, "a partial strip is staged in the warp's C strip");

// Half a consumer warp's strip of C, 16 × 128 (acc: the half's fragments, ops/mma.cuh), into `strip` as
// bf16, in the 128-byte swizzle the TMA's store reads: two pieces of 64 columns, 16 rows × 128 bytes. Lane
// (g, t) writes (row g and g + 8, columns 8j + 2t, +1) for each 8-column block j: the 32 lanes of one
// write hit 32 distinct banks (the swizzle moves row r's 16-byte pieces by r % 8).
__device__ __forceinline__ void write_c_strip(uint8_t* strip, const float* acc, int lane) {
  const int g = lane / 4, t = lane % 4;
#pragma unroll
  for (int j = 0; j < WideTiles::BN / 16; j++) {
    uint8_t* piece = strip + (j / 8) * (16 * 128);
#pragma unroll
    for (int half = 0; half < 2; half++) {
      const int r = g + 8 * half;
      *reinterpret_cast<uint32_t*>(piece + swizzle_128b(r, j % 8) + 4 * t) =
          pack_bf16(acc[4 * j + 2 * half], acc[4 * j + 2 * half + 1]);
    }
  }
}
// Zeros in the k-rows k_left … BK − 1 of a slot's A and B tiles, stored with m or n contiguous (pieces of
// 64 columns, one 128-byte row per k: the row is zero whatever its swizzle), by the 256 consumer
// threads; then visible to their MMAs.
template <int A_PIECES, int B_PIECES>
__device__ __forceinline__ void zero_k_rows_past(uint8_t* a_tile, uint8_t* b_tile, int k_left) {
  constexpr int CHUNKS = (A_PIECES + B_PIECES) * BK * 8;  // 16 bytes each
  for (int i = threadIdx.x; i < CHUNKS; i += 256) {
    const int piece = i / (BK * 8), k = (i / 8) % BK, chunk = i % 8;
    if (k < k_left) continue;
    uint8_t* tile = piece < A_PIECES ? a_tile + piece * (BK * 128) : b_tile + (piece - A_PIECES) * (BK * 128);
    *reinterpret_cast<int4*>(tile + k * 128 + chunk * 16) = make_int4(0, 0, 0, 0);
  }
  fence_proxy_async_shared();
  asm volatile("bar.sync 1, 256;\n" ::: "memory");  // the consumer warps 0–7 only
}

template <bool TRANS_A, bool TRANS_B, bool C_BY_TMA>
__global__ void __launch_bounds__(TMA_THREADS, 1)
    grouped_gemm_tma_kernel(const GroupedGemmBatch batch, const __grid_constant__ GroupedGemmTensors tensors, int lda,
                            int ldb, int ldc, float beta) {
  static_assert(!(TRANS_A && TRANS_B), "the TMA form: forward, input-gradient and weight-gradient forms");
  static_assert(!(TRANS_A && C_BY_TMA), "C by the TMA: the forward and input-gradient forms (beta 0)");
  constexpr int TILE_N = WideTiles::BN, STAGES = WideTiles::STAGES, CONSUMER_WARPS = 8;
  constexpr int A_TILE_BYTES = BM * BK * 2, B_TILE_BYTES = TILE_N * BK * 2;
  extern __shared__ __align__(16) uint8_t shared_bytes[];
  __shared__ uint64_t full[STAGES], empty[STAGES];
  const uint32_t shared_start = smem_addr(shared_bytes);
  const uint32_t aligned = (shared_start + 1023) & ~1023u;  // the swizzle needs 1024-byte aligned tiles
  uint8_t* a_ring = shared_bytes + (aligned - shared_start);  // STAGES tiles of A
  uint8_t* b_ring = a_ring + STAGES * A_TILE_BYTES;           // STAGES tiles of op(B)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // a consumer warp's C strip (C_BY_TMA; 1024-byte aligned, as the ring's tiles) or staging of C
  uint8_t* c_strip = b_ring + STAGES * B_TILE_BYTES + (size_t)warp * C_STRIP_BYTES;
  float* staging = C_BY_TMA ? reinterpret_cast<float*>(c_strip)
                            : reinterpret_cast<float*>(b_ring + STAGES * B_TILE_BYTES) + warp * STAGED_FLOATS;
  const RoutedTiles& routed = routed_tiles<TRANS_A>(batch);
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; s++) {
      mbarrier_init(&full[s], 1);
      mbarrier_init(&empty[s], CONSUMER_WARPS);
    }
    fence_mbarrier_init();
  }
  __syncthreads();
  Problem p;
  int tile;
  uint32_t it = 0;  // k-tiles this thread has copied or multiplied

  if (warp == CONSUMER_WARPS) {  // the producer
    if (lane != 0) return;
    for (unsigned int index = blockIdx.x; tile_problem<TRANS_A>(batch, routed, index, lda, ldb, ldc, p, tile);
         index += gridDim.x) {
      const int m0 = (tile / p.tiles_n) * BM, n0 = (tile % p.tiles_n) * TILE_N;
      const int a_row = (int)((p.A - tensors.a_first) / lda);  // the problem's first row of A (TRANS_A: its first route)
      const int k_tiles = (p.K + BK - 1) / BK;
      for (int kt = 0; kt < k_tiles; kt++, it++) {
        const int slot = it % STAGES, k0 = kt * BK;
        mbarrier_wait(&empty[slot], ((it / STAGES) & 1) ^ 1);
        mbarrier_arrive_expect_tx(&full[slot], A_TILE_BYTES + B_TILE_BYTES);
        uint8_t* a_tile = a_ring + slot * A_TILE_BYTES;
        uint8_t* b_tile = b_ring + slot * B_TILE_BYTES;
        if (TRANS_A) {  // k-rows a_row + k0 … of A and B, in pieces of 64 m or n (swizzled_piece<false>)
          const int b_row = (int)((p.B - tensors.b_first) / ldb);
#pragma unroll
          for (int piece = 0; piece < BM / 64; piece++)
            tma_load_2d(a_tile + piece * (BK * 128), &tensors.a, m0 + 64 * piece, a_row + k0, &full[slot]);
#pragma unroll
          for (int piece = 0; piece < TILE_N / 64; piece++)
            tma_load_2d(b_tile + piece * (BK * 128), &tensors.b, n0 + 64 * piece, b_row + k0, &full[slot]);
          continue;
        }
        tma_load_2d(a_tile, &tensors.a, k0, a_row + m0, &full[slot]);
        const int expert = (int)((p.B - tensors.b_first) / tensors.b_expert);
        if (TRANS_B) {
          tma_load_3d(b_tile, &tensors.b, k0, n0, expert, &full[slot]);
        } else {
#pragma unroll
          for (int piece = 0; piece < TILE_N / 64; piece++)  // 64 n wide, BK·128 bytes apart (swizzled_piece)
            tma_load_3d(b_tile + piece * (BK * 128), &tensors.b, n0 + 64 * piece, k0, expert, &full[slot]);
        }
      }
    }
    return;
  }

  const int rows = 64 * (warp / 4);  // this warpgroup's rows of the tile
  for (unsigned int index = blockIdx.x; tile_problem<TRANS_A>(batch, routed, index, lda, ldb, ldc, p, tile);
       index += gridDim.x) {
    const int k_tiles = (p.K + BK - 1) / BK;
    float acc[TILE_N / 2] = {};  // this warpgroup's 64 × TILE_N piece of C (ops/mma.cuh: the fragment)
    for (int kt = 0; kt < k_tiles; kt++, it++) {
      const int slot = it % STAGES;
      mbarrier_wait(&full[slot], (it / STAGES) & 1);
      if (TRANS_A && p.K - kt * BK < BK)  // the next problem's routes (or zeros) past K
        zero_k_rows_past<BM / 64, TILE_N / 64>(a_ring + slot * A_TILE_BYTES, b_ring + slot * B_TILE_BYTES, p.K - kt * BK);
      const uint32_t a_tile = smem_addr(a_ring + slot * A_TILE_BYTES);
      const uint32_t b_tile = smem_addr(b_ring + slot * B_TILE_BYTES);
      wgmma_fence();
      wgmma_fence_operands(acc);
#pragma unroll
      for (int ks = 0; ks < BK / 16; ks++)
        wgmma_m64n256k16<TRANS_A, !TRANS_B>(acc, tile_descriptor<!TRANS_A>(a_tile, rows, ks),
                                            tile_descriptor<TRANS_B>(b_tile, 0, ks), 1);
      wgmma_commit();
      wgmma_wait<1>();  // the MMAs of k-tile it − 1 are done: its slot may be refilled
      wgmma_fence_operands(acc);
      if (kt > 0 && lane == 0) mbarrier_arrive(&empty[(it - 1) % STAGES]);
    }
    wgmma_wait<0>();
    wgmma_fence_operands(acc);
    if (k_tiles > 0 && lane == 0) mbarrier_arrive(&empty[(it - 1) % STAGES]);
    const int m0 = (tile / p.tiles_n) * BM, n0 = (tile % p.tiles_n) * TILE_N;
    const int strip = m0 + rows + 16 * (warp % 4);  // this warp's 16 rows of C
    if (C_BY_TMA) {
      if (lane == 0) tma_store_wait_read<0>();  // the last tile's stores have read c_strip
      __syncwarp();
      if (strip + 16 <= p.M) {
#pragma unroll
        for (int half = 0; half < 2; half++) {  // columns n0 + 128·half … +127
          if (half == 1) {
            if (lane == 0) tma_store_wait_read<0>();  // the first half's stores have read c_strip
            __syncwarp();
          }
          write_c_strip(c_strip, acc + TILE_N / 4 * half, lane);
          fence_proxy_async_shared();  // the strip's writes, visible to the TMA's reads
          __syncwarp();
          if (lane == 0) {
            const int c_row = (int)((p.A - tensors.a_first) / lda) + strip;  // C's rows are A's
#pragma unroll
            for (int piece = 0; piece < TILE_N / 128; piece++)
              tma_store_2d(&tensors.c, n0 + TILE_N / 2 * half + 64 * piece, c_row, c_strip + piece * (16 * 128));
            tma_store_commit();
          }
        }
        continue;
      }
    }
    store_c_staged<TILE_N / 8>(p, strip, n0, acc, ldc, beta, staging, lane);
  }
  if (C_BY_TMA && lane == 0) tma_store_wait<0>();  // the stores are done before the block exits
}
#endif

}  // namespace ggemm

// true when the kernel takes these problems (the header's requirements); the BF16 build only. A
// routed problem's routed size is unknown here: routed problems need it to be no operand's contiguous
// dimension (it is not in the expert GEMMs; it would be with transA and transB both).
inline bool grouped_gemm_mma_fits(const GroupedGemmProblems& problems, bool transA, bool transB, int lda, int ldb,
                                  int ldc) {
#if defined(FLATMOE_BF16)
  if (lda % 8 || ldb % 8 || ldc % 8) return false;
  if (problems.route_offsets && transA && transB) return false;
  for (const GroupedGemmProblem& p : problems.list) {
    if (!pack_aligned(p.A, 8) || !pack_aligned(p.B, 8) || !pack_aligned(p.C, 2) || p.N % 2) return false;
    if ((transA ? p.M : p.K) % 8 || (transB ? p.K : p.N) % 8) return false;
  }
  return true;
#else
  (void)problems, (void)transA, (void)transB, (void)lda, (void)ldb, (void)ldc;
  return false;
#endif
}

// The current device's SMs (the wide tiles' persistent grid, the choice of tiles).
inline int grouped_gemm_sms(const char* op) {
  int device = 0, sms = 0;
  cudaCheck(cudaGetDevice(&device), op, "grouped_gemm: current device");
  cudaCheck(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), op,
            "grouped_gemm: SM count of device %d", device);
  return sms;
}

// Where the wide tiles' TMA form (header) finds its two tensors, or false (grouped_gemm_tma_layout)
// when the problems are not laid out as two tensors:
//   - without transA: A's problems consecutive row slices of one [rows][K] matrix in list order
//     (routed problems: all at its row 0, `routes` rows), the experts' B matrices in one stack
//     [experts][N][K] (transB) or [experts][K][N] (whole matrices apart), one N and one K for all;
//   - with transA (the weight gradients; not with transB): A's and B's problems consecutive row slices
//     (K rows each: the routes) of one [rows][M] and one [rows][N] matrix, at the same rows, in list
//     order (routed: all at row 0), one M and one N for all;
// and, for its stores of 16 bytes (store_c_staged), N % 8 == 0 and C 16-byte aligned. The MoE layers'
// expert GEMMs are laid out so; B lent by another rank (ops/llep.cuh) is not.
struct GroupedGemmTmaLayout {
  const floatX* a_first = nullptr;  // A's row 0
  long long a_rows = 0;             // A's rows (with transA: B's too)
  const floatX* b_first = nullptr;  // the stack's expert 0 (with transA: B's row 0)
  long long b_expert = 0, experts = 0;  // elements from one expert's B to the next; experts in the stack
  int M = 0, N = 0, K = 0;          // M: with transA only; K: without
};
inline bool grouped_gemm_tma_layout(const GroupedGemmProblems& problems, bool transA, bool transB, int lda, int ldb,
                                    GroupedGemmTmaLayout& layout) {
  const std::vector<GroupedGemmProblem>& list = problems.list;
  if ((transA && transB) || list.empty()) return false;
  GroupedGemmTmaLayout l;
  l.a_first = list[0].A;
  l.b_first = list[0].B;
  l.N = list[0].N;
  auto elements_apart = [](const floatX* from, const floatX* to) {
    return ((long long)(uintptr_t)to - (long long)(uintptr_t)from) / (long long)sizeof(floatX);
  };
  if (transA) {
    l.M = list[0].M;
    for (const GroupedGemmProblem& q : list) {
      if (q.M != l.M || q.N != l.N || q.N % 8 || (uintptr_t)q.C % 16) return false;
      const long long row = problems.route_offsets ? 0 : l.a_rows;  // where this problem's routes must start
      if (elements_apart(l.a_first, q.A) != row * lda || elements_apart(l.b_first, q.B) != row * ldb) return false;
      if (!problems.route_offsets) l.a_rows += q.K;
    }
    if (problems.route_offsets) l.a_rows = problems.routes;
    if (l.a_rows <= 0 || l.a_rows > INT_MAX) return false;  // the TMA's coordinates: int32
    layout = l;
    return true;
  }
  l.K = list[0].K;
  for (const GroupedGemmProblem& q : list) {
    if (q.N != l.N || q.K != l.K || q.N % 8 || (uintptr_t)q.C % 16) return false;
    if (elements_apart(l.b_first, q.B) < 0) l.b_first = q.B;
    const long long row = problems.route_offsets ? 0 : l.a_rows;  // where this problem's A must start
    if (elements_apart(l.a_first, q.A) != row * lda) return false;
    if (!problems.route_offsets) l.a_rows += q.M;
  }
  if (problems.route_offsets) l.a_rows = problems.routes;
  l.b_expert = (long long)(transB ? l.N : l.K) * ldb;
  for (const GroupedGemmProblem& q : list) {
    const long long apart = elements_apart(l.b_first, q.B);
    if (apart % l.b_expert) return false;
    l.experts = std::max(l.experts, apart / l.b_expert + 1);
  }
  if (l.a_rows <= 0 || l.a_rows > INT_MAX || l.experts > INT_MAX) return false;  // the TMA's coordinates: int32
  layout = l;
  return true;
}

// true when, without transA, every problem's C rows lie beside its A rows in one matrix: C = C_0 + r·ldc
// where A = A_0 + r·lda (C_0, A_0: the first problem's; routed problems: all at row 0), so that the TMA
// form can store C as one tensor addressed by A's rows (C_BY_TMA, the kernel's header). The MoE
// layers' route-sorted buffers are so.
inline bool grouped_gemm_tma_c_beside_a(const GroupedGemmProblems& problems, const GroupedGemmTmaLayout& layout,
                                        bool transA, int lda, int ldc) {
  if (transA || problems.list.empty()) return false;
  const floatX* c_first = problems.list[0].C;
  for (const GroupedGemmProblem& q : problems.list) {
    const long long row = (long long)(q.A - layout.a_first) / lda;
    if (q.C - c_first != row * ldc) return false;
  }
  return true;
}

// The wgmma form's tiles and how they are fed (header): wide tiles (128 × 256) when a launch has at
// least GGEMM_WIDE_MIN_WAVES waves of them, fed by the TMA (WideTma) when the operands are laid out as
// two tensors (grouped_gemm_tma_layout), else by every thread's copies (Wide); 128 × 128 otherwise. The
// weight gradients (transA) take the wide tiles only fed by the TMA, a block per tile, from
// GGEMM_WIDE_MIN_WAVES_TRANS_A waves on. Measured (notes/speed.md, 'The grouped expert GEMMs'): fed by
// every thread the wide tiles gain 8–18 % on B1's h13, y, da and dxp, lose 5–8 % on its dW2 and dW13 and
// 5–30 % on the default model's smaller layers; fed by the TMA, B1's dW13 (1024 wide tiles) and dW2 (512)
// gain 5–10 % over the narrow tiles, with routes even or one expert at 8× the mean, and the default model's
// weight gradients (48 and 96 wide tiles) lose up to 15 %. The mma.sync form has only 128 × 128.
enum class GroupedGemmTiles { Narrow, Wide, WideTma };
static const int GGEMM_WIDE_MIN_WAVES = 4;
static const int GGEMM_WIDE_MIN_WAVES_TRANS_A = 2;
inline GroupedGemmTiles grouped_gemm_tiles(const GroupedGemmProblems& problems, bool transA, bool transB, int lda,
                                           int ldb, int sms) {
#if defined(FLATMOE_BF16) && defined(FLATMOE_WGMMA)
  long long wide_tiles = 0;  // routed without transA (M unknown here): the most any split of the routes can need
  int most_tiles_n = 0;
  for (const GroupedGemmProblem& p : problems.list) {
    const int tiles_n = ceil_div(p.N, ggemm::WideTiles::BN);
    wide_tiles += (long long)ceil_div(p.M, ggemm::BM) * tiles_n;
    most_tiles_n = std::max(most_tiles_n, tiles_n);
  }
  if (problems.route_offsets && !transA)
    wide_tiles = (long long)(ceil_div(problems.routes, ggemm::BM) + (int)problems.list.size()) * most_tiles_n;
  if (wide_tiles < (long long)(transA ? GGEMM_WIDE_MIN_WAVES_TRANS_A : GGEMM_WIDE_MIN_WAVES) * sms)
    return GroupedGemmTiles::Narrow;
  GroupedGemmTmaLayout layout;
  if (grouped_gemm_tma_layout(problems, transA, transB, lda, ldb, layout)) return GroupedGemmTiles::WideTma;
  return transA ? GroupedGemmTiles::Narrow : GroupedGemmTiles::Wide;
#else
  (void)problems, (void)transA, (void)transB, (void)lda, (void)ldb, (void)sms;
  return GroupedGemmTiles::Narrow;
#endif
}

#if defined(FLATMOE_BF16) && defined(FLATMOE_WGMMA)
// The tensors of the TMA form (GroupedGemmTensors) from their layout: A in boxes of BK × BM, B in
// boxes of BK × 256 (transB: k contiguous) or of 64 n × BK (n contiguous, four per k-tile); with
// transA both in boxes of 64 columns × BK k-rows (two per k-tile of A, four of B); and, given c_first,
// C in boxes of 64 columns × 16 rows (a consumer warp's strip).
inline GroupedGemmTensors grouped_gemm_tensors(const char* op, const GroupedGemmTmaLayout& l, bool transA, bool transB,
                                               int lda, int ldb, const floatX* c_first = nullptr, int ldc = 0) {
  GroupedGemmTensors t;
  if (c_first) {  // C stored by the TMA: [a_rows][N] beside A's rows
    const cuuint64_t c_dims[2] = {(cuuint64_t)l.N, (cuuint64_t)l.a_rows}, c_strides[1] = {(cuuint64_t)ldc * 2};
    const cuuint32_t c_box[2] = {64, 16};
    t.c = encode_tensor_map(op, "C", c_first, 2, c_dims, c_strides, c_box);
  }
  const cuuint64_t a_strides[1] = {(cuuint64_t)lda * 2};
  t.a_first = l.a_first;
  t.b_first = l.b_first;
  if (transA) {  // A [rows][M] and B [rows][N] in boxes of 64 columns × BK k-rows
    const cuuint64_t a_dims[2] = {(cuuint64_t)l.M, (cuuint64_t)l.a_rows}, b_dims[2] = {(cuuint64_t)l.N, (cuuint64_t)l.a_rows};
    const cuuint64_t b_strides[1] = {(cuuint64_t)ldb * 2};
    const cuuint32_t box[2] = {64, ggemm::BK};
    t.a = encode_tensor_map(op, "A", l.a_first, 2, a_dims, a_strides, box);
    t.b = encode_tensor_map(op, "B", l.b_first, 2, b_dims, b_strides, box);
    t.b_expert = 0;
    return t;
  }
  const cuuint64_t a_dims[2] = {(cuuint64_t)l.K, (cuuint64_t)l.a_rows};
  const cuuint32_t a_box[2] = {ggemm::BK, ggemm::BM};
  t.a = encode_tensor_map(op, "A", l.a_first, 2, a_dims, a_strides, a_box);
  const cuuint64_t b_strides[2] = {(cuuint64_t)ldb * 2, (cuuint64_t)l.b_expert * 2};
  if (transB) {
    const cuuint64_t b_dims[3] = {(cuuint64_t)l.K, (cuuint64_t)l.N, (cuuint64_t)l.experts};
    const cuuint32_t b_box[3] = {ggemm::BK, ggemm::WideTiles::BN, 1};
    t.b = encode_tensor_map(op, "B", l.b_first, 3, b_dims, b_strides, b_box);
  } else {
    const cuuint64_t b_dims[3] = {(cuuint64_t)l.N, (cuuint64_t)l.K, (cuuint64_t)l.experts};
    const cuuint32_t b_box[3] = {64, ggemm::BK, 1};
    t.b = encode_tensor_map(op, "B", l.b_first, 3, b_dims, b_strides, b_box);
  }
  t.b_expert = l.b_expert;
  return t;
}

template <bool TRANS_A, bool TRANS_B, bool C_BY_TMA>
inline void grouped_gemm_tma_launch(const char* op, const GroupedGemmBatch& batch, const GroupedGemmTensors& tensors,
                                    int lda, int ldb, int ldc, float beta, int sms, cudaStream_t stream) {
  const auto kernel = ggemm::grouped_gemm_tma_kernel<TRANS_A, TRANS_B, C_BY_TMA>;
  const size_t shared = ggemm::tma_shared_bytes<C_BY_TMA>();
  // the weight gradients: a block per tile, handed to the SMs as they free up (their tiles' lengths
  // follow the experts' routes); else one persistent block per SM
  const unsigned int blocks = TRANS_A ? batch.tiles : std::min(batch.tiles, (unsigned)sms);
  cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared), op,
            "grouped_gemm (TMA) shared=%zu bytes", shared);
  kernel<<<blocks, ggemm::TMA_THREADS, shared, stream>>>(batch, tensors, lda, ldb, ldc, beta);
  launchCheck(op, "grouped_gemm (TMA) problems=%d tiles=%u blocks=%u transA=%d transB=%d", batch.count, batch.tiles,
              blocks, (int)TRANS_A, (int)TRANS_B);
}
#endif

#if defined(FLATMOE_BF16)
template <bool TRANS_A, bool TRANS_B, class Tiles>
inline void grouped_gemm_mma_launch(const char* op, const GroupedGemmBatch& batch, int lda, int ldb, int ldc, float beta,
                                    int sms, cudaStream_t stream) {
#if defined(FLATMOE_WGMMA)
  const auto kernel = ggemm::grouped_gemm_wgmma_kernel<TRANS_A, TRANS_B, Tiles>;
  const int threads = ggemm::WG_THREADS;
  const size_t shared = ggemm::wgmma_shared_bytes<Tiles>();
  const unsigned int blocks =
      Tiles::PERSISTENT ? std::min(batch.tiles, (unsigned)(sms * ggemm::wgmma_blocks_per_sm<Tiles>())) : batch.tiles;
#else
  static_assert(std::is_same<Tiles, ggemm::NarrowTiles>::value, "the mma.sync form has the narrow tiles only");
  const auto kernel = ggemm::grouped_gemm_kernel<TRANS_A, TRANS_B>;
  const int threads = ggemm::THREADS;
  const size_t shared = ggemm::SHARED_BYTES;
  const unsigned int blocks = batch.tiles;
  (void)sms;
#endif
  // 96–193 KiB is past the default 48 KiB; set on every call, since the current device may differ
  cudaCheck(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared), op,
            "grouped_gemm (mma) shared=%zu bytes", shared);
  kernel<<<blocks, threads, shared, stream>>>(batch, lda, ldb, ldc, beta);
  launchCheck(op, "grouped_gemm (mma) problems=%d tiles=%u blocks=%u transA=%d transB=%d", batch.count, batch.tiles,
              blocks, (int)TRANS_A, (int)TRANS_B);
}

template <class Tiles>
inline void grouped_gemm_mma_launch(const char* op, const GroupedGemmBatch& batch, bool transA, bool transB, int lda,
                                    int ldb, int ldc, float beta, int sms, cudaStream_t stream) {
  if (transA && transB) grouped_gemm_mma_launch<true, true, Tiles>(op, batch, lda, ldb, ldc, beta, sms, stream);
  else if (transA) grouped_gemm_mma_launch<true, false, Tiles>(op, batch, lda, ldb, ldc, beta, sms, stream);
  else if (transB) grouped_gemm_mma_launch<false, true, Tiles>(op, batch, lda, ldb, ldc, beta, sms, stream);
  else grouped_gemm_mma_launch<false, false, Tiles>(op, batch, lda, ldb, ldc, beta, sms, stream);
}
#endif

// The problems on the tensor-core kernel in tiles of the given shape (grouped_gemm_tiles; Wide and
// WideTma: the wgmma form only; WideTma: problems laid out as grouped_gemm_tma_layout asks): one launch
// per GGEMM_PROBLEMS_PER_LAUNCH problems, on `stream`, nothing waits. Callers check
// grouped_gemm_mma_fits first.
inline void grouped_gemm_mma(const char* op, const GroupedGemmProblems& problems, bool transA, bool transB, int lda,
                             int ldb, int ldc, float beta, GroupedGemmTiles tiles, cudaStream_t stream) {
#if defined(FLATMOE_BF16)
#if !defined(FLATMOE_WGMMA)
  if (tiles != GroupedGemmTiles::Narrow)
    fm_fail(op, "grouped_gemm: wide tiles are the wgmma form's (GPU_ARCH=90a)", "problems=%zu", problems.list.size());
#endif
  const int tile_n = tiles == GroupedGemmTiles::Narrow ? ggemm::NarrowTiles::BN : ggemm::WideTiles::BN;
  const int sms = grouped_gemm_sms(op);
#if defined(FLATMOE_WGMMA)
  GroupedGemmTensors tensors;
  bool c_by_tma = false;  // C stored by the TMA (the kernel's header): beta 0 and C's rows beside A's
  if (tiles == GroupedGemmTiles::WideTma) {
    GroupedGemmTmaLayout layout;
    if (!grouped_gemm_tma_layout(problems, transA, transB, lda, ldb, layout))
      fm_fail(op, "grouped_gemm: the TMA form needs the problems laid out as two tensors (grouped_gemm_tma_layout)",
              "problems=%zu transA=%d transB=%d", problems.list.size(), (int)transA, (int)transB);
    c_by_tma = beta == 0.f && grouped_gemm_tma_c_beside_a(problems, layout, transA, lda, ldc);
    tensors = grouped_gemm_tensors(op, layout, transA, transB, lda, ldb, c_by_tma ? problems.list[0].C : nullptr, ldc);
  }
#endif
  const std::vector<GroupedGemmProblem>& list = problems.list;
  const bool tiles_from_routes = problems.route_offsets != nullptr && !transA;
  for (size_t first = 0; first < list.size(); first += GGEMM_PROBLEMS_PER_LAUNCH) {
    GroupedGemmBatch batch;
    if (problems.route_offsets) batch.route_offsets = problems.route_offsets + first;
    int most_tiles_n = 0;
    for (size_t g = first; g < std::min(list.size(), first + GGEMM_PROBLEMS_PER_LAUNCH); g++) {
      const GroupedGemmProblem& q = list[g];
      const int tiles_n = ceil_div(q.N, tile_n);
      batch.p[batch.count++] = ggemm::Problem{q.A, q.B, q.C, q.M, q.N, q.K, tiles_n, batch.tiles};
      batch.tiles += (unsigned)ceil_div(q.M, ggemm::BM) * tiles_n;  // routed without transA: M is 0 here
      most_tiles_n = std::max(most_tiles_n, tiles_n);
    }
    if (tiles_from_routes)  // the most any split of the routes over these problems needs
      batch.tiles = (unsigned)(ceil_div(problems.routes, ggemm::BM) + batch.count) * most_tiles_n;
    if (batch.tiles == 0) continue;
#if defined(FLATMOE_WGMMA)
    if (tiles == GroupedGemmTiles::WideTma && transA)
      grouped_gemm_tma_launch<true, false, false>(op, batch, tensors, lda, ldb, ldc, beta, sms, stream);
    else if (tiles == GroupedGemmTiles::WideTma && transB && c_by_tma)
      grouped_gemm_tma_launch<false, true, true>(op, batch, tensors, lda, ldb, ldc, beta, sms, stream);
    else if (tiles == GroupedGemmTiles::WideTma && transB)
      grouped_gemm_tma_launch<false, true, false>(op, batch, tensors, lda, ldb, ldc, beta, sms, stream);
    else if (tiles == GroupedGemmTiles::WideTma && c_by_tma)
      grouped_gemm_tma_launch<false, false, true>(op, batch, tensors, lda, ldb, ldc, beta, sms, stream);
    else if (tiles == GroupedGemmTiles::WideTma)
      grouped_gemm_tma_launch<false, false, false>(op, batch, tensors, lda, ldb, ldc, beta, sms, stream);
    else if (tiles == GroupedGemmTiles::Wide)
      grouped_gemm_mma_launch<ggemm::WideTiles>(op, batch, transA, transB, lda, ldb, ldc, beta, sms, stream);
    else
#endif
      grouped_gemm_mma_launch<ggemm::NarrowTiles>(op, batch, transA, transB, lda, ldb, ldc, beta, sms, stream);
  }
#else
  (void)tiles;
  fm_fail(op, "grouped_gemm_mma is the BF16 build's kernel", "problems=%zu", problems.list.size());
#endif
}

// ---------------------------------------------------------------------------------------------
// cuBLAS: all problems in ONE cublasGemmGroupedBatchedEx call

static const int GROUPED_GEMM_PTR_CHUNK = 480;  // pointers per launch argument (kernel arguments ≤ 4 KiB)

// Writes `count` pointers, passed by value as a kernel argument, to dst (device).
struct GroupedGemmPointerChunk {
  void* ptr[GROUPED_GEMM_PTR_CHUNK];
};
static __global__ void grouped_gemm_pointers_kernel(void** dst, GroupedGemmPointerChunk chunk, int count) {
  for (int i = threadIdx.x; i < count; i += blockDim.x) dst[i] = chunk.ptr[i];
}

// Each problem its own group of one (sizes differ per expert). cuBLAS is column-major: row-major C =
// op(A)·op(B) is column-major Cᵀ = op(B)ᵀ·op(A)ᵀ, so cuBLAS's A is our B and vice versa. Sizes,
// leading dimensions, transposes and alpha/beta are host arrays; the A/B/C pointer arrays are device
// arrays (pool, Workspace), written by a kernel that takes them as launch arguments, so no host-side
// staging buffer and no synchronisation is needed. cuBLAS issues the problems whose K differs one by
// one from the host (notes/speed.md, 'The grouped expert GEMMs').
inline void grouped_gemm_cublas(const char* op, const std::vector<GroupedGemmProblem>& problems, bool transA, bool transB,
                                int lda, int ldb, int ldc, float beta, cudaStream_t stream) {
  const int G = (int)problems.size();
  std::vector<cublasOperation_t> op_a(G, transB ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<cublasOperation_t> op_b(G, transA ? CUBLAS_OP_T : CUBLAS_OP_N);
  std::vector<int> m(G), n(G), kk(G), ld_a(G, ldb), ld_b(G, lda), ld_c(G, ldc), group_size(G, 1);
  std::vector<float> alpha(G, 1.f), betas(G, beta);
  std::vector<void*> ptrs(3 * (size_t)G);  // [cuBLAS A = our B | cuBLAS B = our A | C]; A, B only read
  for (int g = 0; g < G; g++) {
    const GroupedGemmProblem& p = problems[g];
#if defined(FLATMOE_BF16)
    // cuBLAS's rule for bf16 matrix pointers: 16-byte aligned when K % 8 == 0, 4-byte when K is even.
    size_t need = p.K % 8 == 0 ? 16 : p.K % 2 == 0 ? 4 : 1;
    if ((uintptr_t)p.A % need || (uintptr_t)p.B % need || (uintptr_t)p.C % need)
      fm_fail(op, "bf16 matrix pointer misaligned for cuBLAS (keep H and I multiples of 8)",
              "problem=%d M=%d N=%d K=%d need=%zu-byte alignment", g, p.M, p.N, p.K, need);
#endif
    m[g] = p.N;
    n[g] = p.M;
    kk[g] = p.K;
    ptrs[g] = const_cast<floatX*>(p.B);
    ptrs[G + g] = const_cast<floatX*>(p.A);
    ptrs[2 * (size_t)G + g] = p.C;
  }
  void** dev_ptrs = pool().alloc_t<void*>(ptrs.size(), Mem::Workspace, "grouped_gemm.pointers");
  for (size_t first = 0; first < ptrs.size(); first += GROUPED_GEMM_PTR_CHUNK) {
    int count = (int)std::min<size_t>(GROUPED_GEMM_PTR_CHUNK, ptrs.size() - first);
    GroupedGemmPointerChunk chunk;
    memcpy(chunk.ptr, ptrs.data() + first, count * sizeof(void*));
    grouped_gemm_pointers_kernel<<<1, 256, 0, stream>>>(dev_ptrs + first, chunk, count);
    launchCheck(op, "grouped_gemm pointers groups=%d", G);
  }
  cublasHandle_t handle = cublas_on(stream, op);
  cublasCheck(cublasSetPointerMode(handle, CUBLAS_POINTER_MODE_HOST), op, "groups=%d", G);
  cublasCheck(cublasGemmGroupedBatchedEx(handle, op_a.data(), op_b.data(), m.data(), n.data(), kk.data(),
                                         alpha.data(), dev_ptrs, CUBLAS_FLOATX, ld_a.data(), dev_ptrs + G,
                                         CUBLAS_FLOATX, ld_b.data(), betas.data(),
                                         dev_ptrs + 2 * (size_t)G, CUBLAS_FLOATX,
                                         ld_c.data(), G, group_size.data(), CUBLAS_COMPUTE),
              op, "groups=%d transA=%d transB=%d lda=%d ldb=%d ldc=%d", G, (int)transA, (int)transB, lda, ldb, ldc);
  pool().free(dev_ptrs);  // stream-ordered reuse: the next user of this block runs after the GEMM on `stream`
}

// ---------------------------------------------------------------------------------------------
// The entry point

// Weight-gradient problems (transA) at least this large, on average, go to cuBLAS (header): never with
// the wgmma form.
#if defined(FLATMOE_WGMMA)
static const double GGEMM_CUBLAS_MIN_FLOP = HUGE_VAL;
#else
static const double GGEMM_CUBLAS_MIN_FLOP = 3e9;
#endif

// true when weight-gradient problems of this many FLOPs each, on average, run faster on the kernel
// than on cuBLAS's per-problem GEMMs (header).
inline bool weight_gradient_takes_kernel(double flop_per_problem) { return flop_per_problem < GGEMM_CUBLAS_MIN_FLOP; }

// true when grouped_gemm runs these problems on the tensor-core kernel, false when on cuBLAS (header).
// Routed problems take the kernel whenever it fits them (header).
inline bool grouped_gemm_takes_kernel(const GroupedGemmProblems& problems, bool transA, bool transB, int lda, int ldb,
                                      int ldc) {
  if (!grouped_gemm_mma_fits(problems, transA, transB, lda, ldb, ldc)) return false;
  if (!transA || problems.route_offsets) return true;
  double flop = 0;
  for (const GroupedGemmProblem& p : problems.list) flop += 2.0 * p.M * p.N * p.K;
  return weight_gradient_takes_kernel(flop / (double)problems.list.size());
}

// Routed problems with their sizes and pointers from the offsets, downloaded (a host wait); problems
// without routes left out.
inline std::vector<GroupedGemmProblem> grouped_gemm_routes_on_host(const char* op, const GroupedGemmProblems& problems,
                                                                   bool transA, int lda, int ldb, int ldc,
                                                                   cudaStream_t stream) {
  std::vector<int> offsets(problems.list.size() + 1);
  copy_to_host(offsets.data(), problems.route_offsets, offsets.size() * sizeof(int), stream, op);
  std::vector<GroupedGemmProblem> list;
  for (size_t g = 0; g < problems.list.size(); g++) {
    if (offsets[g + 1] == offsets[g]) continue;
    GroupedGemmProblem p = problems.list[g];
    move_to_routes(p, offsets[g], offsets[g + 1] - offsets[g], transA, lda, ldb, ldc);
    list.push_back(p);
  }
  return list;
}

// The problems (every M, N, K ≥ 1 but a routed one's routed size: callers leave out experts without
// routes) on the tensor-core kernel or in one cuBLAS call (grouped_gemm_takes_kernel). Does not
// synchronise, except for routed problems the kernel does not take (header).
inline void grouped_gemm(const char* op, const GroupedGemmProblems& problems, bool transA, bool transB, int lda,
                         int ldb, int ldc, float beta, cudaStream_t stream) {
  for (size_t g = 0; g < problems.list.size(); g++) {
    const GroupedGemmProblem& p = problems.list[g];
    const bool routed = problems.route_offsets != nullptr;
    if ((p.M < 1 && !(routed && !transA)) || p.N < 1 || (p.K < 1 && !(routed && transA)))
      fm_fail(op, "grouped_gemm problem with an empty dimension", "problem=%zu M=%d N=%d K=%d", g, p.M, p.N, p.K);
  }
  if (problems.list.empty()) return;
  if (grouped_gemm_takes_kernel(problems, transA, transB, lda, ldb, ldc))
    grouped_gemm_mma(op, problems, transA, transB, lda, ldb, ldc, beta,
                     grouped_gemm_tiles(problems, transA, transB, lda, ldb, grouped_gemm_sms(op)), stream);
  else if (problems.route_offsets)
    grouped_gemm(op, grouped_gemm_routes_on_host(op, problems, transA, lda, ldb, ldc, stream), transA, transB, lda, ldb,
                 ldc, beta, stream);
  else
    grouped_gemm_cublas(op, problems.list, transA, transB, lda, ldb, ldc, beta, stream);
}
