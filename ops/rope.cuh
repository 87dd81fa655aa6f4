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
// Memory: none beyond the input/output.
#pragma once
#include "common.cuh"

// One thread per (token n, pair index i < hd/2); it rotates pair i of all 2·nh q/k heads of
// row n and, when copy_v, copies the two v elements i, i+hd/2 of every v head.
// sin_sign = +1 rotates by +angle (forward), −1 by −angle (backward).
static __global__ void rope_rotate_kernel(floatX* out, const floatX* in, int N, int T, int nh, int hd,
                                          float theta, float sin_sign, bool copy_v) {
  const int half = hd / 2;
  const long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (g >= (long long)N * half) return;
  const int n = (int)(g / half), i = (int)(g % half);
  const int t = n % T;
  const double freq = pow((double)theta, -2.0 * i / hd);
  double sin_d, cos_d;
  sincos((double)t * freq, &sin_d, &cos_d);
  const float c = (float)cos_d, s = sin_sign * (float)sin_d;
  const int H = nh * hd;
  const size_t row = (size_t)n * 3 * H;
  for (int head = 0; head < 2 * nh; head++) {  // q heads, then k heads
    const size_t off = row + (size_t)head * hd + i;
    const float x1 = to_float(in[off]), x2 = to_float(in[off + half]);
    out[off] = from_float<floatX>(x1 * c - x2 * s);
    out[off + half] = from_float<floatX>(x2 * c + x1 * s);
  }
  if (copy_v) {
    for (int head = 0; head < nh; head++) {
      const size_t off = row + 2 * (size_t)H + (size_t)head * hd + i;
      out[off] = in[off];
      out[off + half] = in[off + half];
    }
  }
}

inline void rope_launch(const char* op, floatX* out, const floatX* in, int B, int T, int nh, int hd,
                        float theta, float sin_sign, cudaStream_t stream) {
  if (B <= 0 || T <= 0 || nh <= 0 || hd <= 0 || hd % 2 != 0)
    fm_fail(op, "sizes must be positive and hd even", "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
  const int N = B * T;
  const int threads = 256;
  const int blocks = ceil_div((long long)N * (hd / 2), threads);
  rope_rotate_kernel<<<blocks, threads, 0, stream>>>(out, in, N, T, nh, hd, theta, sin_sign, out != in);
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
