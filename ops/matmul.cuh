// matmul.cuh — bias-free linear layer through cuBLAS (twin: ref/matmul.hpp).
//
//   forward:  out = x · Wᵀ                    out [N, OC] (=)
//   backward: dx  = dout · W                  dx  [N, IC] (=), skipped when dx == nullptr
//             dW += doutᵀ · x                 dW  [OC, IC] (+=)
//
// Shapes (row-major, weights [out, in] like PyTorch / llm.c): x [N, IC], W [OC, IC], dout [N, OC].
// cuBLAS is column-major: a row-major [R, C] matrix is a column-major [C, R] one with leading
// dimension C, so each product is computed transposed:
//   outᵀ [OC, N] = op_T(W as [IC, OC]) · xᵀ [IC, N]
//   dxᵀ  [IC, N] = W as [IC, OC] · doutᵀ [OC, N]
//   dWᵀ  [IC, OC] += xᵀ [IC, N] · op_T(doutᵀ as [OC, N])
// Operands are CUBLAS_FLOATX, accumulation CUBLAS_COMPUTE (fp32; pedantic FP32 in the FP32
// build), alpha/beta fp32 on the host. cuBLAS GEMMs are bit-reproducible run to run on the same
// GPU model and toolkit.
//
// Memory: none of its own (cuBLAS's workspace is the pool's, set by cublas_on).
#pragma once
#include "common.cuh"
#include "../runtime/pool.cuh"

// C [m, n] (column-major, ldc) = alpha · op(A) · op(B) + beta · C, on `stream`.
inline void matmul_gemm(const char* op_name, cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k,
                        const floatX* A, int lda, const floatX* B, int ldb, float beta, floatX* C, int ldc,
                        int N, int IC, int OC, cudaStream_t stream) {
  const float alpha = 1.0f;
  cublasHandle_t handle = cublas_on(stream, op_name);
  cublasCheck(cublasGemmEx(handle, op_a, op_b, m, n, k, &alpha, A, CUBLAS_FLOATX, lda, B, CUBLAS_FLOATX, ldb, &beta,
                           C, CUBLAS_FLOATX, ldc, CUBLAS_COMPUTE, CUBLAS_GEMM_DEFAULT),
              op_name, "N=%d IC=%d OC=%d", N, IC, OC);
}

// out [N, OC] (=) = x [N, IC] · W [OC, IC]ᵀ
inline void matmul_forward(floatX* out, const floatX* x, const floatX* W, int N, int IC, int OC, cudaStream_t stream) {
  if (N == 0 || OC == 0) return;
  if (IC <= 0) fm_fail("matmul_forward", "IC must be positive", "N=%d IC=%d OC=%d", N, IC, OC);
  matmul_gemm("matmul_forward", CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, W, IC, x, IC, 0.0f, out, OC, N, IC, OC, stream);
}

// dx [N, IC] (=) = dout · W (skipped when dx == nullptr); dW [OC, IC] (+=) doutᵀ · x.
inline void matmul_backward(floatX* dx, floatX* dW, const floatX* dout, const floatX* x, const floatX* W, int N, int IC,
                            int OC, cudaStream_t stream) {
  if (N == 0 || IC == 0 || OC == 0) return;
  if (dx != nullptr)
    matmul_gemm("matmul_backward.dx", CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, W, IC, dout, OC, 0.0f, dx, IC, N, IC, OC, stream);
  matmul_gemm("matmul_backward.dW", CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, x, IC, dout, OC, 1.0f, dW, IC, N, IC, OC, stream);
}
