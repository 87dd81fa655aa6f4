// mma.cuh — the PTX that flatmoe's tensor-core kernels share (ops/attention_mma.cuh,
// ops/grouped_gemm.cuh): asynchronous 16-byte copies into shared memory, ldmatrix, and the bf16
// mma.sync m16n8k16 with fp32 accumulation (sm_80 and later); and Hopper's warpgroup MMA (wgmma),
// mbarriers and the tensor memory accelerator's copies (TMA) both ways, with the host's encoder of
// the tensor maps those copies read (sm_90a builds only: FLATMOE_WGMMA, GPU_ARCH=90a). Not an
// operator: no twin of its own; its users' twins (ref/attention.hpp, ref/moe.hpp) check what is built
// from it.
//
// MMA fragments relied on (PTX ISA, mma.m16n8k16 .bf16, lane l, g = l/4, t = l%4):
//   A (16×16, row-major), 4 × b32 of two bf16 (lower column in the low half):
//     a[0]: (row g,   cols 2t, 2t+1)   a[1]: (row g+8, cols 2t, 2t+1)
//     a[2]: (row g,   cols 2t+8, +9)   a[3]: (row g+8, cols 2t+8, +9)
//   B (16×8, "col": k-pairs contiguous), 2 × b32:  b[0]: (k 2t, 2t+1; n g)  b[1]: (k 2t+8, +9; n g)
//   C/D (16×8 fp32): c[0], c[1]: (row g, cols 2t, 2t+1)   c[2], c[3]: (row g+8, cols 2t, 2t+1)
// ldmatrix.x4 (non-transposed): lanes 8i … 8i+7 give the 8 row addresses of matrix i, and lane
// l receives row g, columns 2t, 2t+1 of matrix i in register i; .trans gives rows 2t, 2t+1 of
// column g instead. So:
//   - an A fragment is ldmatrix.x4 of (rows 0–7, 8–15) × (cols 0–7, 8–15) of a tile stored
//     [m][k]; of a tile stored [k][m] it is the transposed ldmatrix of (k rows) × (m columns);
//   - a B fragment of an operand stored [n][k] is the non-transposed ldmatrix of its rows, and of
//     an operand stored [k][n] the transposed one.
#pragma once
#include <cstdint>
#include <cuda.h>          // CUtensorMap (the TMA copies)
#include <cudaTypedefs.h>  // cuTensorMapEncodeTiled's type, found through the runtime
#include <cuda_bf16.h>
#include "../runtime/check.cuh"

__device__ __forceinline__ uint32_t smem_addr(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global → shared, asynchronously; src_bytes = 0 writes zeros (rows past a matrix's edge).
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
// Waits until at most `pending` of this thread's committed groups are still in flight.
template <int pending>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory"); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const __nv_bfloat16* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// d += A·B for one m16n8k16 (bf16 inputs, fp32 accumulator).
__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two fp32 → one b32 of two bf16 (lo in the low half: the lower column of a fragment).
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Byte offset of the 16-byte piece c (< 8) of row r in a tile stored in the 128-byte swizzle (below):
// rows of 128 bytes, piece c stored at piece c ^ (r % 8), so the 8 rows of an ldmatrix phase or a
// wgmma core matrix fall on 8 distinct bank groups.
__host__ __device__ constexpr int swizzle_128b(int r, int c) { return r * 128 + ((c ^ (r % 8)) << 4); }

#if defined(FLATMOE_WGMMA)
// ---- Hopper's warpgroup MMA (PTX ISA "asynchronous warpgroup level matrix multiply") ----
// A warpgroup (4 consecutive warps, 128 threads) multiplies a 64 × 16 tile of A by a 16 × N tile of B,
// both read from shared memory through 64-bit descriptors, into a 64 × N fp32 accumulator held in its
// registers: warp w of the group holds rows 16w … 16w+15, and in each 8-column block j a lane holds
// d[4j … 4j+3] at (row g, cols 8j+2t, +1) and (row g+8, cols 8j+2t, +1), g = lane/4, t = lane%4 — the
// mma.sync C fragment above, once per 8 columns. The MMA runs asynchronously: fence, issue, commit,
// then wait before the accumulator or the shared-memory tiles are touched again.
//
// Shared-memory tiles in the 128-byte swizzle: rows of 128 bytes (64 bf16), the 16-byte piece c of row
// r stored at piece c ^ (r % 8), tiles 1024-byte aligned (the hardware un-swizzles by address bits).
// A descriptor holds the start address, the leading and stride byte offsets and the swizzle mode:
//   stored with k contiguous (K-major: A [m][k], B [n][k]): rows are m or n; 8-row groups 1024 bytes
//     apart (stride offset); the leading offset is unused; k-step s of 16 starts 32·s bytes further;
//   stored with m or n contiguous (MN-major, imm-trans 1): rows are k, each holding 64 m or n; 8-row
//     groups 1024 bytes apart (stride offset), the next 64 m or n `leading` bytes further; k-step s
//     starts 16 rows (2048 bytes) further.
__device__ __forceinline__ uint64_t wgmma_descriptor(uint32_t shared_address, uint32_t leading_bytes) {
  const uint32_t stride_bytes = 1024;
  return (uint64_t)((shared_address & 0x3FFFF) >> 4) | (uint64_t)(leading_bytes >> 4) << 16 |
         (uint64_t)(stride_bytes >> 4) << 32 | 1ull << 62;  // 1 << 62: the 128-byte swizzle
}

// Orders this thread's earlier generic-proxy writes to shared memory (st.shared, cp.async) before the
// async proxy's reads (wgmma's operands).
__device__ __forceinline__ void fence_proxy_async_shared() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// mbarriers in shared memory (a block's producer/consumer pipeline): init with the arrivals that
// complete a phase; arrive; wait until the phase of the given parity has completed (a fresh barrier
// is in phase 0, so a wait on parity 1 returns at once).
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(arrivals) : "memory");
}
// makes the barriers' initialisation visible to the other threads and to the tensor copies' arrivals
__device__ __forceinline__ void fence_mbarrier_init() { asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory"); }
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(smem_addr(bar)) : "memory");
}
// one arrival that also makes the phase wait for `bytes` more of asynchronous copies (tma_load_*)
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
// makes the phase wait for `bytes` more of asynchronous copies, without an arrival
__device__ __forceinline__ void mbarrier_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [%0], %1;\n" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "\tWAIT:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "\t@!done bra WAIT;\n\t}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}
// The tensor memory accelerator (TMA): one thread copies a box of a tensor (described by a CUtensorMap
// the host encoded: global address, sizes, strides, the box, the 128-byte swizzle) into shared memory
// at `dst`; the box's bytes complete on `bar` (its expected transactions, mbarrier_arrive_expect_tx).
// Parts of the box outside the tensor land as zeros. Coordinates in elements, innermost first.
__device__ __forceinline__ void tma_load_2d(void* dst, const void* map, int c0, int c1, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n" ::
          "r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void tma_load_3d(void* dst, const void* map, int c0, int c1, int c2, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];\n" ::
          "r"(smem_addr(dst)), "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(smem_addr(bar))
      : "memory");
}
// The TMA's store, the other way: one thread copies a box from shared memory at `src` (laid out in the
// map's swizzle, 1024-byte aligned) into the tensor; parts of the box outside the tensor are not
// written. A thread's stores form bulk groups: tma_store_commit closes its open group;
// tma_store_wait_read<n> waits until at most n of its groups still read shared memory (their sources
// may then be written again), tma_store_wait<n> until at most n still write (before the block exits).
__device__ __forceinline__ void tma_store_2d(const void* map, int c0, int c1, const void* src) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.tile.bulk_group [%0, {%1, %2}], [%3];\n" ::"l"(map), "r"(c0),
               "r"(c1), "r"(smem_addr(src))
               : "memory");
}
__device__ __forceinline__ void tma_store_commit() { asm volatile("cp.async.bulk.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void tma_store_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N>
__device__ __forceinline__ void tma_store_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
// Waits until at most `pending` of this warpgroup's committed MMA groups are still running.
template <int pending>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(pending) : "memory"); }

// Keeps the compiler from moving reads or writes of an MMA's registers across a wgmma_wait: the MMA
// writes its accumulator (and reads an A fragment held in registers) asynchronously, which the asm's
// operands alone do not say.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; i++) asm volatile("" : "+f"(d[i])::"memory");
}
template <int N, int M>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int j = 0; j < M; j++) asm volatile("" : "+f"(d[i][j])::"memory");
}
template <int N, int M>
__device__ __forceinline__ void wgmma_fence_operands(uint32_t (&a)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; i++)
#pragma unroll
    for (int j = 0; j < M; j++) asm volatile("" : "+r"(a[i][j])::"memory");
}

// d (64 × 128, fp32) = A (64 × 16) · B (16 × 128), or += when accumulate ≠ 0; bf16, from shared
// memory. MN_MAJOR_A / MN_MAJOR_B: the tile is stored with m / n contiguous (1), else with k contiguous (0).
template <int MN_MAJOR_A, int MN_MAJOR_B>
__device__ __forceinline__ void wgmma_m64n128k16(float (&d)[64], uint64_t descriptor_a, uint64_t descriptor_b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "
      "%64, %65, accumulate, 1, 1, %67, %68;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate), "n"(MN_MAJOR_A), "n"(MN_MAJOR_B));
}

// d (64 × 256, fp32) = A (64 × 16) · B (16 × 256), or += when accumulate ≠ 0; both from shared memory,
// MN_MAJOR_A / MN_MAJOR_B as in wgmma_m64n128k16. d[4j … 4j+3]: the C fragment of columns 8j … 8j+7.
template <int MN_MAJOR_A, int MN_MAJOR_B>
__device__ __forceinline__ void wgmma_m64n256k16(float (&d)[128], uint64_t descriptor_a, uint64_t descriptor_b,
                                                 int accumulate) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, "
      "%128, %129, accumulate, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate), "n"(MN_MAJOR_A), "n"(MN_MAJOR_B));
}

// d (64 × 64, fp32; d[j] the C fragment of columns 8j … 8j+7) = A · B, or += when accumulate ≠ 0; A
// (64 × 16, stored with k contiguous) and B (16 × 64, MN_MAJOR_B as above) from shared memory.
template <int MN_MAJOR_B>
__device__ __forceinline__ void wgmma_m64n64k16_ss(float (&d)[8][4], uint64_t descriptor_a, uint64_t descriptor_b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "%32, %33, accumulate, 1, 1, 0, %35;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "l"(descriptor_a), "l"(descriptor_b), "r"(accumulate), "n"(MN_MAJOR_B));
}

// d (64 × 64, fp32; d[j] the C fragment of columns 8j … 8j+7) = A · B, or += when accumulate ≠ 0. A
// (64 × 16) comes from registers: each warp's 16 rows as the mma.sync A fragment above (so two
// n-blocks of a C fragment, rounded to bf16, are the A fragment of the next product); B (16 × 64) from
// shared memory through a descriptor, MN_MAJOR_B as above. The registers of a must not change until
// the MMA has been waited for. Keep such fragments short-lived: with fragments loaded once before a
// loop and read by this MMA in every iteration, ptxas (CUDA 13.0, sm_90a) gave their registers to
// other values inside the loop (notes/attention.md); shared-memory operands (_ss) serve that case.
template <int MN_MAJOR_B>
__device__ __forceinline__ void wgmma_m64n64k16_rs(float (&d)[8][4], const uint32_t (&a)[4], uint64_t descriptor_b,
                                                   int accumulate) {
  asm volatile(
      "{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
      "{%32, %33, %34, %35}, %36, accumulate, 1, 1, %38;\n}\n"
      : "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]),
        "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]),
        "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]),
        "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]),
        "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(descriptor_b), "r"(accumulate), "n"(MN_MAJOR_B));
}
// ---- host: the tensor maps the TMA copies read (encoded once per call, passed as __grid_constant__)

// cuTensorMapEncodeTiled, a driver function, found once through the runtime (no link to the driver).
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder(const char* op) {
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    cudaCheck(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found), op,
              "looking up cuTensorMapEncodeTiled");
    if (found != cudaDriverEntryPointSuccess || fn == nullptr)
      fm_fail(op, "the driver has no cuTensorMapEncodeTiled (the TMA copies)", "query result %d", (int)found);
    encode = reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }
  return encode;
}

// A bf16 tensor of `rank` dims (innermost first; strides in bytes, of dims 1 …) read in boxes of
// `box`, 128-byte swizzled as the wgmma tiles are stored (wgmma_descriptor), zeros past its edges.
inline CUtensorMap encode_tensor_map(const char* op, const char* what, const void* first, int rank, const cuuint64_t* dims,
                                     const cuuint64_t* strides, const cuuint32_t* box) {
  CUtensorMap map;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  const CUresult result = tensor_map_encoder(op)(
      &map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, const_cast<void*>(first), dims, strides, box,
      element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (result != CUDA_SUCCESS)
    fm_fail(op, "cuTensorMapEncodeTiled refused a tensor of a TMA copy",
            "%s: CUresult %d, dims %llu x %llu x %llu, box %u x %u", what, (int)result, (unsigned long long)dims[0],
            (unsigned long long)dims[1], rank > 2 ? (unsigned long long)dims[2] : 1ull, box[0], box[1]);
  return map;
}
#endif
