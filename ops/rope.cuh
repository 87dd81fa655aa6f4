// rope.cuh — rotary position embedding (half-split convention, LLaMA/NeoX) on the packed QKV
// projection output. Twin of ref/rope.hpp.
//
// Shapes: qkv [N = B·T, 3H], H = nh·hd, hd even; row n = b·T + t holds q (nh×hd), then k
// (nh×hd), then v (nh×hd). Position t = n mod T.
// Forward, for every q and k head and i < hd/2, with freq_i = theta^(−2i/hd), angle = t·freq_i:
//   out[i]      = x[i]·cos − x[i+hd/2]·sin
//   out[i+hd/2] = x[i+hd/2]·cos + x[i]·sin
// v is copied unchanged.
// Backward: dqkv_in (=) = the transpose of the rotation (rotation by −angle) applied to dq, dk;
// dv copied.
// Both may run in place (output == input): every element is read and written by one thread.
//
// Angles: cos/sin are computed on the fly, per (token, i), in double (pow, sincos) and rounded
// to fp32 once; the rotation itself runs in fp32. An fp32 angle t·freq would carry an absolute
// error of ~t·2⁻²⁴ rad (≈ 6e-5 at t = 1000), which alone would use most of the FP32 build's
// 1e-5 tolerance; the double angle costs one sincos per (token, i), shared by all 2·nh heads.
//
// Schedule: a block takes ROPE_TOKENS_PER_BLOCK consecutive rows. Its threads first compute the
// cos/sin of every (token, i) of them into shared memory, one each; then each thread takes items
// (token, head, piece p): elements [p·NV, p·NV + NV) of the head's first half and the same of its
// second half, rotated (q, k heads) or copied (v heads, out of place only); consecutive threads take
// consecutive pieces of a head. NV = ROW_PIECE (16 bytes) when hd/2 is a multiple of it and both
// buffers are 16-byte aligned (row_pieces), else 1. Every element gets the same float operations on
// either path, written as explicit fmas (x1·c − x2·s = fma(x1, c, −(x2·s)), x2·c + x1·s = fma(x2, c,
// x1·s)): left to the compiler, the contraction of a·b ± c·d into an fma may pick the other product
// in one instantiation, and the two paths would differ in the last bit.
// Memory: none beyond the input/output; ROPE_TOKENS_PER_BLOCK·hd floats of shared memory per block
// (hd <= ROPE_MAX_HEAD_DIM keeps it within the default 48 KiB).
#pragma once
#include "common.cuh"

static const int ROPE_TOKENS_PER_BLOCK = 4;
static const int ROPE_MAX_HEAD_DIM = 48 * 1024 / (ROPE_TOKENS_PER_BLOCK * (int)sizeof(float));  // 3072

// Block b: rows [b·ROPE_TOKENS_PER_BLOCK, +ROPE_TOKENS_PER_BLOCK) ∩ [0, N). Dynamic shared memory:
// cos then sin of [ROPE_TOKENS_PER_BLOCK, hd/2] (token, i), sin already signed.
// sin_sign = +1 rotates by +angle (forward), −1 by −angle (backward).
template <int NV>
__global__ void rope_rotate_kernel(floatX* out, const floatX* in, int N, int T, int nh, int hd, float theta,
                                   float sin_sign, bool copy_v) {
  using P = Pack<floatX, NV>;
  extern __shared__ float angle_cos_sin[];
  const int half = hd / 2, first_row = blockIdx.x * ROPE_TOKENS_PER_BLOCK;
  const int tokens = min(ROPE_TOKENS_PER_BLOCK, N - first_row);
  float* cos_ti = angle_cos_sin;                                 // [token, i]
  float* sin_ti = angle_cos_sin + ROPE_TOKENS_PER_BLOCK * half;  // [token, i]
  for (int k = threadIdx.x; k < tokens * half; k += blockDim.x) {
    const int t = (first_row + k / half) % T, i = k % half;
    const double freq = pow((double)theta, -2.0 * i / hd);
    double sin_d, cos_d;
    sincos((double)t * freq, &sin_d, &cos_d);
    cos_ti[k] = (float)cos_d;
    sin_ti[k] = sin_sign * (float)sin_d;
  }
  __syncthreads();
  const int pieces = half / NV, heads = copy_v ? 3 * nh : 2 * nh;  // q heads, k heads, then v heads
  for (int k = threadIdx.x; k < tokens * heads * pieces; k += blockDim.x) {
    const int token = k / (heads * pieces), head = k / pieces % heads, p = k % pieces;
    const size_t at = ((size_t)(first_row + token) * 3 * nh + head) * hd + p * NV;  // piece p of the first half
    const P x1 = *reinterpret_cast<const P*>(in + at), x2 = *reinterpret_cast<const P*>(in + at + half);
    P o1 = x1, o2 = x2;
    if (head < 2 * nh) {
      const float* c = cos_ti + token * half + p * NV;
      const float* s = sin_ti + token * half + p * NV;
#pragma unroll
      for (int e = 0; e < NV; e++) {
        const float a = to_float(x1.v[e]), b = to_float(x2.v[e]);
        o1.v[e] = from_float<floatX>(fmaf(a, c[e], -(b * s[e])));
        o2.v[e] = from_float<floatX>(fmaf(b, c[e], a * s[e]));
      }
    }
    *reinterpret_cast<P*>(out + at) = o1;
    *reinterpret_cast<P*>(out + at + half) = o2;
  }
}

template <int NV>
inline void rope_rotate_launch(floatX* out, const floatX* in, int N, int T, int nh, int hd, float theta,
                               float sin_sign, cudaStream_t stream) {
  const int threads = 256;
  const size_t smem = (size_t)ROPE_TOKENS_PER_BLOCK * hd * sizeof(float);
  rope_rotate_kernel<NV><<<ceil_div(N, ROPE_TOKENS_PER_BLOCK), threads, smem, stream>>>(out, in, N, T, nh, hd, theta,
                                                                                       sin_sign, out != in);
}

inline void rope_launch(const char* op, floatX* out, const floatX* in, int B, int T, int nh, int hd,
                        float theta, float sin_sign, cudaStream_t stream) {
  if (B <= 0 || T <= 0 || nh <= 0 || hd <= 0 || hd % 2 != 0 || hd > ROPE_MAX_HEAD_DIM)
    fm_fail(op, "sizes must be positive, hd even and <= ROPE_MAX_HEAD_DIM", "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
  const int N = B * T;
  if (row_pieces(hd / 2, {out, in})) rope_rotate_launch<ROW_PIECE>(out, in, N, T, nh, hd, theta, sin_sign, stream);
  else rope_rotate_launch<1>(out, in, N, T, nh, hd, theta, sin_sign, stream);
  launchCheck(op, "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
}

// qkv_out [N, 3H] (=) = RoPE(qkv_in [N, 3H]); qkv_out may equal qkv_in.
inline void rope_forward(floatX* qkv_out, const floatX* qkv_in, int B, int T, int nh, int hd, float theta,
                         cudaStream_t stream) {
  rope_launch("rope_forward", qkv_out, qkv_in, B, T, nh, hd, theta, +1.f, stream);
}

// dqkv_in [N, 3H] (=) = RoPEᵀ(dqkv_out [N, 3H]); dqkv_in may equal dqkv_out.
inline void rope_backward(floatX* dqkv_in, const floatX* dqkv_out, int B, int T, int nh, int hd, float theta,
                          cudaStream_t stream) {
  rope_launch("rope_backward", dqkv_in, dqkv_out, B, T, nh, hd, theta, -1.f, stream);
}
