// rope.cuh — rotary position embedding (half-split convention, LLaMA/NeoX) on the packed QKV
// projection output, with cos/sin read from a table of the angles made once. Twin of ref/rope.hpp.
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
// The angle table (RopeAngles): cos_sin [2, T_max, hd/2] fp32, cos(t·freq_i) of every position
// t < T_max and i < hd/2, then sin(t·freq_i); made once by rope_angles_fill for a head dim hd and a
// theta, read by every rope_forward and rope_backward of that hd and of a T <= T_max (any other T or
// hd is refused).
//
// Angles: each table entry is computed in double (pow, sincos) and rounded to fp32 once; the rotation
// itself runs in fp32. An fp32 angle t·freq would carry an absolute error of ~t·2⁻²⁴ rad (≈ 6e-5 at
// t = 1000), which alone would use most of the FP32 build's 1e-5 tolerance; the double angle costs
// one sincos per (t, i), once, when the table is filled (one thread per entry), not in the rotation.
//
// Schedule: a block takes ROPE_TOKENS_PER_BLOCK consecutive rows; each thread takes items (token,
// head, piece p): elements [p·NV, p·NV + NV) of the head's first half and the same of its second half,
// rotated (q, k heads, by the NV cos and NV sin at [t, p·NV] read from the table in global memory:
// no shared-memory staging, no double math; the table is small and stays in L2) or copied (v heads,
// out of place only); consecutive threads take consecutive pieces of a head. NV = ROW_PIECE (16 bytes
// of floatX) when hd/2 is a multiple of it, both buffers are 16-byte aligned (row_pieces) and the table
// is aligned for NV floats, else 1.
// Every element gets the same float operations on either path (rope_rotate_pair, which attention's
// backward also applies in its stores: attention.cuh), written as explicit fmas (x1·c − x2·s
// = fma(x1, c, −(x2·s)), x2·c + x1·s = fma(x2, c, x1·s), s negated for the backward): left to the
// compiler, the contraction of a·b ± c·d into an fma may pick the other product in one instantiation,
// and the two paths would differ in the last bit.
// Memory: the table, 2·T_max·(hd/2)·4 bytes, held by its owner for as long as it rotates (the model:
// T_max = seq_len, 64 KiB at T 256, hd 64); the rotation needs nothing beyond the input/output and no
// shared memory.
#pragma once
#include "common.cuh"

static const int ROPE_TOKENS_PER_BLOCK = 4;

// The table of the angles: cos_sin [2, T_max, hd/2] fp32, cos(t·freq_i) at [0, t, i] and sin(t·freq_i)
// at [1, t, i], freq_i = theta^(−2i/hd). Made by rope_angles_fill; the buffer is its owner's.
struct RopeAngles {
  const float* cos_sin = nullptr;  // [2, T_max, hd/2]
  int T_max = 0;                   // positions held: t in [0, T_max)
  int hd = 0;                      // the head dim it was made for (hd/2 frequencies)
};

// Bytes of the table for positions t < T_max and head dim hd: 2·T_max·(hd/2) floats.
inline size_t rope_angles_bytes(int T_max, int hd) { return 2 * (size_t)T_max * (hd / 2) * sizeof(float); }

// Thread k = t·(hd/2) + i writes cos_sin[0, t, i] and cos_sin[1, t, i].
static __global__ void rope_angles_kernel(float* cos_sin, int T_max, int hd, float theta) {
  const int half = hd / 2;
  const size_t k = (size_t)blockIdx.x * blockDim.x + threadIdx.x, entries = (size_t)T_max * half;
  if (k >= entries) return;
  const int t = (int)(k / half), i = (int)(k % half);
  const double freq = pow((double)theta, -2.0 * i / hd);
  double sin_d, cos_d;
  sincos((double)t * freq, &sin_d, &cos_d);
  cos_sin[k] = (float)cos_d;
  cos_sin[entries + k] = (float)sin_d;
}

// cos_sin [2, T_max, hd/2] (=) the angles of positions t < T_max for head dim hd (enqueued on `stream`);
// returns the table that reads them. cos_sin holds rope_angles_bytes(T_max, hd).
inline RopeAngles rope_angles_fill(float* cos_sin, int T_max, int hd, float theta, cudaStream_t stream) {
  if (T_max <= 0 || hd <= 0 || hd % 2 != 0 || !(theta > 0.f))
    fm_fail("rope_angles_fill", "T_max and hd must be positive, hd even and theta positive", "T_max=%d hd=%d theta=%g",
            T_max, hd, theta);
  const size_t entries = (size_t)T_max * (hd / 2);
  rope_angles_kernel<<<ceil_div(entries, 256), 256, 0, stream>>>(cos_sin, T_max, hd, theta);
  launchCheck("rope_angles_fill", "T_max=%d hd=%d theta=%g", T_max, hd, theta);
  return RopeAngles{cos_sin, T_max, hd};
}

// The rotation of one pair, x1 = element i of a head's first half and x2 = element i of its second half,
// by the angle of cos a_cos and sin signed_sin (sin for the forward, −sin for the backward): the float
// operations of every rotation here and of the kernels that rotate in their stores (attention's backward).
__device__ __forceinline__ void rope_rotate_pair(float& x1, float& x2, float a_cos, float signed_sin) {
  const float a = x1, b = x2;
  x1 = fmaf(a, a_cos, -(b * signed_sin));
  x2 = fmaf(b, a_cos, a * signed_sin);
}

// RoPE's backward of the pair (i, i + hd/2) of a q or k head at position t, in registers: the rotation
// by −angle with the table's cos and sin of (t, i).
__device__ __forceinline__ void rope_backward_pair(const RopeAngles& angles, int t, int i, float& x1, float& x2) {
  const size_t at = (size_t)t * (angles.hd / 2) + i, sin_at = (size_t)angles.T_max * (angles.hd / 2) + at;
  rope_rotate_pair(x1, x2, angles.cos_sin[at], -angles.cos_sin[sin_at]);
}

// Refuses a table that does not hold the positions t < T or whose head dim is not hd.
inline void rope_check_table(const char* op, const RopeAngles& angles, int B, int T, int nh, int hd) {
  if (T > angles.T_max || hd != angles.hd)
    fm_fail(op, "the angle table holds positions t < T_max of one head dim: T must be <= T_max and hd the table's",
            "B=%d T=%d nh=%d hd=%d T_max=%d table hd=%d", B, T, nh, hd, angles.T_max, angles.hd);
}

// Block b: rows [b·ROPE_TOKENS_PER_BLOCK, +ROPE_TOKENS_PER_BLOCK) ∩ [0, N). cos_ti, sin_ti: the table's
// [T_max, hd/2] halves. sin_sign = +1 rotates by +angle (forward), −1 by −angle (backward).
template <int NV>
__global__ void rope_rotate_kernel(floatX* out, const floatX* in, const float* cos_ti, const float* sin_ti, int N,
                                   int T, int nh, int hd, float sin_sign, bool copy_v) {
  using P = Pack<floatX, NV>;
  using A = Pack<float, NV>;
  const int half = hd / 2, first_row = blockIdx.x * ROPE_TOKENS_PER_BLOCK;
  const int tokens = min(ROPE_TOKENS_PER_BLOCK, N - first_row);
  const int pieces = half / NV, heads = copy_v ? 3 * nh : 2 * nh;  // q heads, k heads, then v heads
  for (int k = threadIdx.x; k < tokens * heads * pieces; k += blockDim.x) {
    const int token = k / (heads * pieces), head = k / pieces % heads, p = k % pieces;
    const size_t at = ((size_t)(first_row + token) * 3 * nh + head) * hd + p * NV;  // piece p of the first half
    const P x1 = *reinterpret_cast<const P*>(in + at), x2 = *reinterpret_cast<const P*>(in + at + half);
    P o1 = x1, o2 = x2;
    if (head < 2 * nh) {
      const size_t angle_at = (size_t)((first_row + token) % T) * half + p * NV;  // [t, p·NV]
      const A c = *reinterpret_cast<const A*>(cos_ti + angle_at), s = *reinterpret_cast<const A*>(sin_ti + angle_at);
#pragma unroll
      for (int e = 0; e < NV; e++) {
        float a = to_float(x1.v[e]), b = to_float(x2.v[e]);
        rope_rotate_pair(a, b, c.v[e], sin_sign * s.v[e]);
        o1.v[e] = from_float<floatX>(a);
        o2.v[e] = from_float<floatX>(b);
      }
    }
    *reinterpret_cast<P*>(out + at) = o1;
    *reinterpret_cast<P*>(out + at + half) = o2;
  }
}

template <int NV>
inline void rope_rotate_launch(floatX* out, const floatX* in, const RopeAngles& angles, int N, int T, int nh, int hd,
                               float sin_sign, cudaStream_t stream) {
  const float* cos_ti = angles.cos_sin;
  const float* sin_ti = angles.cos_sin + (size_t)angles.T_max * (hd / 2);
  rope_rotate_kernel<NV><<<ceil_div(N, ROPE_TOKENS_PER_BLOCK), 256, 0, stream>>>(out, in, cos_ti, sin_ti, N, T, nh, hd,
                                                                                  sin_sign, out != in);
}

inline void rope_launch(const char* op, floatX* out, const floatX* in, const RopeAngles& angles, int B, int T, int nh,
                        int hd, float sin_sign, cudaStream_t stream) {
  if (B <= 0 || T <= 0 || nh <= 0 || hd <= 0 || hd % 2 != 0)
    fm_fail(op, "sizes must be positive and hd even", "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
  rope_check_table(op, angles, B, T, nh, hd);
  const int N = B * T;
  if (row_pieces(hd / 2, {out, in}) && pack_aligned(angles.cos_sin, ROW_PIECE))
    rope_rotate_launch<ROW_PIECE>(out, in, angles, N, T, nh, hd, sin_sign, stream);
  else rope_rotate_launch<1>(out, in, angles, N, T, nh, hd, sin_sign, stream);
  launchCheck(op, "B=%d T=%d nh=%d hd=%d", B, T, nh, hd);
}

// qkv_out [N, 3H] (=) = RoPE(qkv_in [N, 3H]) by the angles of `angles` (T <= T_max, hd its hd);
// qkv_out may equal qkv_in.
inline void rope_forward(floatX* qkv_out, const floatX* qkv_in, const RopeAngles& angles, int B, int T, int nh, int hd,
                         cudaStream_t stream) {
  rope_launch("rope_forward", qkv_out, qkv_in, angles, B, T, nh, hd, +1.f, stream);
}

// dqkv_in [N, 3H] (=) = RoPEᵀ(dqkv_out [N, 3H]) by the angles of `angles` (T <= T_max, hd its hd);
// dqkv_in may equal dqkv_out.
inline void rope_backward(floatX* dqkv_in, const floatX* dqkv_out, const RopeAngles& angles, int B, int T, int nh,
                          int hd, cudaStream_t stream) {
  rope_launch("rope_backward", dqkv_in, dqkv_out, angles, B, T, nh, hd, -1.f, stream);
}
