// ref/attention.hpp — causal multi-head self-attention, plain math. Twin of ops/attention.cuh.
//
// qkv [N = B·T, 3H] (q, k already rotated), H = nh·hd; row n = b·T + t holds q (nh×hd), then
// k (nh×hd), then v (nh×hd). For every sequence b and head h (Q, K, V: T×hd):
//   S   = Q Kᵀ / sqrt(hd)                 (T×T)
//   P   = softmax over j ≤ i of S[i, j]   (P[i, j] = 0 for j > i)
//   lse[b·nh + h, i] = log Σ_{j≤i} exp(S[i, j])
//   out = P V                             (T×hd, columns h·hd … of out [N, H])
// Backward, given dout:
//   dV = Pᵀ dO,  dP = dO Vᵀ,  dS[i, j] = P[i, j]·(dP[i, j] − Σ_j' P[i, j']·dP[i, j'])
//   dQ = dS K / sqrt(hd),  dK = dSᵀ Q / sqrt(hd)
#pragma once
#include <algorithm>
#include <cassert>
#include "common.hpp"

namespace ref {

// Causal softmax probabilities P (T×T) of one head, and the log-sum-exp of each row of S.
template <typename T>
Mat<T> attention_probs(const Mat<T>& q, const Mat<T>& k, Vec<T>& lse) {
  const int Tlen = (int)q.rows();
  const T scale = T(1) / std::sqrt(T(q.cols()));
  Mat<T> s = q * k.transpose() * scale;
  Mat<T> p = Mat<T>::Zero(Tlen, Tlen);
  lse.resize(Tlen);
  for (int i = 0; i < Tlen; i++) {
    T row_max = s(i, 0);
    for (int j = 1; j <= i; j++) row_max = std::max(row_max, s(i, j));
    T sum = 0;
    for (int j = 0; j <= i; j++) sum += std::exp(s(i, j) - row_max);
    for (int j = 0; j <= i; j++) p(i, j) = std::exp(s(i, j) - row_max) / sum;
    lse(i) = row_max + std::log(sum);
  }
  return p;
}

// out [N, H] = attention(qkv); lse [B·nh, T].
template <typename T>
void attention_forward(const Mat<T>& qkv, int B, int Tlen, int nh, int hd, Mat<T>& out, Mat<T>& lse) {
  const int H = nh * hd;
  assert(qkv.rows() == (Eigen::Index)B * Tlen && qkv.cols() == 3 * H);
  out.resize(B * Tlen, H);
  lse.resize(B * nh, Tlen);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < nh; h++) {
      const Mat<T> q = qkv.block(b * Tlen, h * hd, Tlen, hd);
      const Mat<T> k = qkv.block(b * Tlen, H + h * hd, Tlen, hd);
      const Mat<T> v = qkv.block(b * Tlen, 2 * H + h * hd, Tlen, hd);
      Vec<T> head_lse;
      const Mat<T> p = attention_probs(q, k, head_lse);
      out.block(b * Tlen, h * hd, Tlen, hd) = p * v;
      lse.row(b * nh + h) = head_lse.transpose();
    }
}

// Returns dqkv [N, 3H] (gradients of q, k, v) given dout [N, H].
template <typename T>
Mat<T> attention_backward(const Mat<T>& dout, const Mat<T>& qkv, int B, int Tlen, int nh, int hd) {
  const int H = nh * hd;
  assert(qkv.rows() == (Eigen::Index)B * Tlen && qkv.cols() == 3 * H);
  assert(dout.rows() == qkv.rows() && dout.cols() == H);
  const T scale = T(1) / std::sqrt(T(hd));
  Mat<T> dqkv(B * Tlen, 3 * H);
  for (int b = 0; b < B; b++)
    for (int h = 0; h < nh; h++) {
      const Mat<T> q = qkv.block(b * Tlen, h * hd, Tlen, hd);
      const Mat<T> k = qkv.block(b * Tlen, H + h * hd, Tlen, hd);
      const Mat<T> v = qkv.block(b * Tlen, 2 * H + h * hd, Tlen, hd);
      const Mat<T> dO = dout.block(b * Tlen, h * hd, Tlen, hd);
      Vec<T> head_lse;
      const Mat<T> p = attention_probs(q, k, head_lse);
      const Mat<T> dP = dO * v.transpose();
      const Vec<T> row_dot = p.cwiseProduct(dP).rowwise().sum();
      const Mat<T> dS = p.cwiseProduct(dP - row_dot.replicate(1, Tlen));
      dqkv.block(b * Tlen, h * hd, Tlen, hd) = dS * k * scale;
      dqkv.block(b * Tlen, H + h * hd, Tlen, hd) = dS.transpose() * q * scale;
      dqkv.block(b * Tlen, 2 * H + h * hd, Tlen, hd) = p.transpose() * dO;
    }
  return dqkv;
}

}  // namespace ref
