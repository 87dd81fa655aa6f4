// matmul.cuh — bias-free linear layer through cuBLAS (twin: ref/matmul.hpp).
//
//   forward:  out = x · Wᵀ                    out [N, OC] (=)                 matmul_forward
//             out = residual + x · Wᵀ         out [N, OC] (=; not residual)   matmul_forward_residual
//   backward: dx  = dout · W                  dx  [N, IC] (=, or += asked;    matmul_backward_dx
//                                                          fp32 dx allowed)
//             dW += doutᵀ · x                 dW  [OC, IC] (+=)               matmul_backward_dW
//             both                            dx skipped when dx == nullptr   matmul_backward
//
// Shapes (row-major, weights [out, in] like PyTorch / llm.c): x [N, IC], W [OC, IC], dout [N, OC].
// cuBLAS is column-major: a row-major [R, C] matrix is a column-major [C, R] one with leading
// dimension C, so each product is computed transposed:
//   outᵀ [OC, N] = op_T(W as [IC, OC]) · xᵀ [IC, N]
//   dxᵀ  [IC, N] = W as [IC, OC] · doutᵀ [OC, N]
//   dWᵀ  [IC, OC] += xᵀ [IC, N] · op_T(doutᵀ as [OC, N])
// Element type: every launcher is a template over the type T of all its operands — floatX (the
// model's layers) or float (the router, FP32 in both builds, notes/design.md §3); MatmulTypes<T> gives the
// cuBLAS types. bf16 operands (CUDA_R_16BF) accumulate in fp32 (CUBLAS_COMPUTE_32F, tensor cores).
// float operands (CUDA_R_32F) run CUBLAS_COMPUTE_32F in both builds: FP32 arithmetic, never TF32 —
// the shared handle's math mode is pedantic in the FP32 build and CUBLAS_DEFAULT_MATH in the BF16
// build, and TF32 would need CUBLAS_TF32_TENSOR_OP_MATH or a FAST_TF32 compute type (the float
// cases of tests/gpu_matmul.cu hold both builds to 1e-5, which a TF32 GEMM misses).
// alpha/beta are fp32 on the host. cuBLAS GEMMs are bit-reproducible run to run on the same GPU
// model and toolkit.
// matmul_forward_residual is one cuBLASLt GEMM whose epilogue adds the residual (its C) while it
// writes out (its D, a separate buffer; in place, C = D, the BF16 build's bits differ from those into
// a separate buffer on the H200, so it is refused): the sum is taken in fp32 and rounded once, and
// the product never goes to memory. Against matmul_forward and a separate add, that saves the add's
// launch and N·OC elements written and read (model.cuh's x_mid = x + att·woᵀ: 2·N·H elements moved
// beside the GEMM's operands instead of 4).
//
// Memory: none of its own (the cuBLAS and cuBLASLt workspace is the pool's, CublasRuntime).
#pragma once
#include <map>
#include <tuple>
#include "common.cuh"
#include "../runtime/pool.cuh"

// The cuBLAS operand and compute types of a GEMM whose operands are all T.
template <typename T>
struct MatmulTypes;
template <>
struct MatmulTypes<float> {
  static constexpr cudaDataType_t data = CUDA_R_32F;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  static constexpr const char* name = "fp32";
};
template <>
struct MatmulTypes<__nv_bfloat16> {
  static constexpr cudaDataType_t data = CUDA_R_16BF;
  static constexpr cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  static constexpr const char* name = "bf16";
};

// T in a non-deduced context: matmul_backward's dx takes its type from the other operands, so
// that it may be a literal nullptr.
template <typename T>
struct MatmulSameType {
  typedef T type;
};

// C [m, n] (column-major, ldc) = alpha · op(A) · op(B) + beta · C, on `stream`; N, IC, OC name the
// layer's sizes in the error message. C may be fp32 beside bf16 A and B (TC = float: the products
// accumulate in fp32 across calls, e.g. an output head's dx over vocabulary blocks).
template <typename T, typename TC = T>
inline void matmul_gemm(const char* op_name, cublasOperation_t op_a, cublasOperation_t op_b, int m, int n, int k,
                        const T* A, int lda, const T* B, int ldb, float beta, TC* C, int ldc, int N, int IC, int OC,
                        cudaStream_t stream) {
  const float alpha = 1.0f;
  const cudaDataType_t type = MatmulTypes<T>::data;
  cublasHandle_t handle = cublas_on(stream, op_name);
  cublasCheck(cublasGemmEx(handle, op_a, op_b, m, n, k, &alpha, A, type, lda, B, type, ldb, &beta, C,
                           MatmulTypes<TC>::data, ldc, MatmulTypes<T>::compute, CUBLAS_GEMM_DEFAULT),
              op_name, "N=%d IC=%d OC=%d type=%s out=%s", N, IC, OC, MatmulTypes<T>::name, MatmulTypes<TC>::name);
}

// out [N, OC] (=) = x [N, IC] · W [OC, IC]ᵀ; out of type T, or fp32 (TO) beside bf16 x and W.
template <typename T, typename TO>
inline void matmul_forward(TO* out, const T* x, const T* W, int N, int IC, int OC, cudaStream_t stream) {
  if (N == 0 || OC == 0) return;
  if (IC <= 0) fm_fail("matmul_forward", "IC must be positive", "N=%d IC=%d OC=%d", N, IC, OC);
  matmul_gemm("matmul_forward", CUBLAS_OP_T, CUBLAS_OP_N, OC, N, IC, W, IC, x, IC, 0.0f, out, OC, N, IC, OC, stream);
}

// cuBLASLt's choice of algorithm for one GEMM shape, asked once (the heuristic query costs more host
// time than a launch of the small models' GEMMs) and reused: the same shape, types and pointer
// alignment always run the same algorithm, so the bits do not depend on the call.
struct LtGemmKey {
  int m, n, k, align;
  cudaDataType_t type;
  bool operator<(const LtGemmKey& o) const {
    return std::tie(m, n, k, align, type) < std::tie(o.m, o.n, o.k, o.align, o.type);
  }
};

// The descriptors of one cuBLASLt GEMM, destroyed with it (host memory only).
struct LtGemmDescs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulPreference_t pref = nullptr;
  ~LtGemmDescs() {
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    for (cublasLtMatrixLayout_t l : {a, b, c})
      if (l) cublasLtMatrixLayoutDestroy(l);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

// out [N, OC] (=) = residual [N, OC] + x [N, IC] · W [OC, IC]ᵀ, all of type T; out is not residual.
// Column-major, as matmul_forward: outᵀ [OC, N] = op_T(W as [IC, OC]) · xᵀ [IC, N] + residualᵀ.
template <typename T>
inline void matmul_forward_residual(T* out, const T* residual, const T* x, const T* W, int N, int IC, int OC,
                                    cudaStream_t stream) {
  const char* op_name = "matmul_forward_residual";
  if (N == 0 || OC == 0) return;
  if (IC <= 0) fm_fail(op_name, "IC must be positive", "N=%d IC=%d OC=%d", N, IC, OC);
  if (out == residual) fm_fail(op_name, "out must be another buffer than residual", "N=%d IC=%d OC=%d", N, IC, OC);
  runtime_prepare();
  const CublasRuntime& rt = cublas_runtime();
  const cudaDataType_t type = MatmulTypes<T>::data;
#if defined(FLATMOE_BF16)
  const cublasComputeType_t compute = MatmulTypes<T>::compute;
#else
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F_PEDANTIC;  // the handle's pedantic math mode
#endif
  // the largest power of two, up to 256, that divides every operand's address
  const uintptr_t any = reinterpret_cast<uintptr_t>(out) | reinterpret_cast<uintptr_t>(residual) |
                        reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(W) | 256;
  const uint32_t align = (uint32_t)(any & (~any + 1));

  auto check = [&](cublasStatus_t status) {
    cublasCheck(status, op_name, "N=%d IC=%d OC=%d type=%s align=%u", N, IC, OC, MatmulTypes<T>::name, align);
  };
  LtGemmDescs d;
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  const size_t workspace = CublasRuntime::workspace_bytes;
  check(cublasLtMatmulDescCreate(&d.op, compute, CUDA_R_32F));
  check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof op_t));
  check(cublasLtMatmulDescSetAttribute(d.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof op_n));
  check(cublasLtMatrixLayoutCreate(&d.a, type, IC, OC, IC));
  check(cublasLtMatrixLayoutCreate(&d.b, type, IC, N, IC));
  check(cublasLtMatrixLayoutCreate(&d.c, type, OC, N, OC));  // C and D

  static std::map<LtGemmKey, cublasLtMatmulAlgo_t> chosen;
  const LtGemmKey key{OC, N, IC, (int)align, type};
  auto found = chosen.find(key);
  if (found == chosen.end()) {
    check(cublasLtMatmulPreferenceCreate(&d.pref));
    check(cublasLtMatmulPreferenceSetAttribute(d.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace,
                                               sizeof workspace));
    for (cublasLtMatmulPreferenceAttributes_t a :
         {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
          CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
      check(cublasLtMatmulPreferenceSetAttribute(d.pref, a, &align, sizeof align));
    cublasLtMatmulHeuristicResult_t result = {};
    int returned = 0;
    check(cublasLtMatmulAlgoGetHeuristic(rt.lt, d.op, d.a, d.b, d.c, d.c, d.pref, 1, &result, &returned));
    if (returned == 0)
      fm_fail(op_name, "cuBLASLt offers no algorithm for this GEMM", "N=%d IC=%d OC=%d type=%s align=%u", N, IC, OC,
              MatmulTypes<T>::name, align);
    found = chosen.emplace(key, result.algo).first;
  }
  const float alpha = 1.0f, beta = 1.0f;
  check(cublasLtMatmul(rt.lt, d.op, &alpha, W, d.a, x, d.b, &beta, residual, d.c, out, d.c, &found->second,
                       cublas_workspace(stream), workspace, stream));
}

// dx [N, IC] (=, or += with accumulate) = dout [N, OC] · W [OC, IC]; dx of type T, or fp32 (TD).
template <typename T, typename TD>
inline void matmul_backward_dx(TD* dx, const T* dout, const T* W, int N, int IC, int OC, cudaStream_t stream,
                               bool accumulate = false) {
  if (N == 0 || IC == 0) return;
  if (OC <= 0) fm_fail("matmul_backward.dx", "OC must be positive", "N=%d IC=%d OC=%d", N, IC, OC);
  matmul_gemm("matmul_backward.dx", CUBLAS_OP_N, CUBLAS_OP_N, IC, N, OC, W, IC, dout, OC, accumulate ? 1.0f : 0.0f, dx,
              IC, N, IC, OC, stream);
}

// dW [OC, IC] (+=, or = when not accumulate) doutᵀ [OC, N] · x [N, IC]; dW of type T, or fp32 (TW)
// beside bf16 dout and x.
template <typename T, typename TW>
inline void matmul_backward_dW(TW* dW, const T* dout, const T* x, int N, int IC, int OC, cudaStream_t stream,
                               bool accumulate = true) {
  if (N == 0 || IC == 0 || OC == 0) return;
  matmul_gemm("matmul_backward.dW", CUBLAS_OP_N, CUBLAS_OP_T, IC, OC, N, x, IC, dout, OC, accumulate ? 1.0f : 0.0f, dW,
              IC, N, IC, OC, stream);
}

// dx [N, IC] (=) = dout · W (skipped when dx == nullptr); dW [OC, IC] (+=) doutᵀ · x.
template <typename T>
inline void matmul_backward(typename MatmulSameType<T>::type* dx, T* dW, const T* dout, const T* x, const T* W, int N,
                            int IC, int OC, cudaStream_t stream) {
  if (dx != nullptr) matmul_backward_dx(dx, dout, W, N, IC, OC, stream);
  matmul_backward_dW(dW, dout, x, N, IC, OC, stream);
}
