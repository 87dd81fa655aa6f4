// ref/rope.hpp — rotary position embedding (half-split convention, LLaMA/NeoX), plain math.
// Twin of ops/rope.cuh.
//
// qkv [N = B·T, 3H], H = nh·hd; row n = b·T + t holds q (nh×hd), k (nh×hd), v (nh×hd).
// For every q and k head, position t (within its sequence) and i < hd/2:
//   freq_i = theta^(−2i/hd), angle = t·freq_i
//   out[i]        = x[i]·cos(angle) − x[i+hd/2]·sin(angle)
//   out[i+hd/2]   = x[i+hd/2]·cos(angle) + x[i]·sin(angle)
// v passes through unchanged.
// Backward: the transpose of that rotation, i.e. the rotation by −angle; dv passes through.
#pragma once
#include <cassert>
#include "common.hpp"

namespace ref {

// Rotates every (i, i + hd/2) pair of every q and k head by sign·angle(t, i); v is copied.
template <typename T>
Mat<T> rope_rotate(const Mat<T>& x, int B, int Tlen, int nh, int hd, double theta, int sign) {
  const int H = nh * hd, half = hd / 2;
  assert(x.rows() == (Eigen::Index)B * Tlen && x.cols() == 3 * H && hd % 2 == 0);
  Mat<T> out = x;
  for (int b = 0; b < B; b++)
    for (int t = 0; t < Tlen; t++) {
      const int n = b * Tlen + t;
      for (int i = 0; i < half; i++) {
        const T freq = std::pow(T(theta), -T(2 * i) / T(hd));
        const T angle = T(t) * freq;
        const T c = std::cos(angle), s = T(sign) * std::sin(angle);
        for (int head = 0; head < 2 * nh; head++) {  // q heads, then k heads
          const int col = head * hd;
          const T x1 = x(n, col + i), x2 = x(n, col + i + half);
          out(n, col + i) = x1 * c - x2 * s;
          out(n, col + i + half) = x2 * c + x1 * s;
        }
      }
    }
  return out;
}

// qkv_out [N, 3H] = RoPE(qkv_in)
template <typename T>
Mat<T> rope_forward(const Mat<T>& qkv_in, int B, int Tlen, int nh, int hd, double theta) {
  return rope_rotate(qkv_in, B, Tlen, nh, hd, theta, +1);
}

// dqkv_in [N, 3H] = RoPEᵀ(dqkv_out): dq, dk rotated back by −angle, dv copied.
template <typename T>
Mat<T> rope_backward(const Mat<T>& dqkv_out, int B, int Tlen, int nh, int hd, double theta) {
  return rope_rotate(dqkv_out, B, Tlen, nh, hd, theta, -1);
}

}  // namespace ref
