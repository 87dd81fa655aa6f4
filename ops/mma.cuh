// mma.cuh — the PTX that flatmoe's tensor-core kernels share (ops/attention_mma.cuh,
// ops/grouped_gemm.cuh): asynchronous 16-byte copies into shared memory, ldmatrix, and the bf16
// mma.sync m16n8k16 with fp32 accumulation (sm_80 and later). Not an operator: no twin of its own;
// its users' twins (ref/attention.hpp, ref/moe.hpp) check what is built from it.
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
#include <cuda_bf16.h>

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
