// sar_plan.hpp — selective attention recomputation (notes/design.md §6.8; RelayMoE §3.4): which layers'
// attention activations a training pass under --recompute 1 keeps from the forward to the backward
// instead of recomputing them, for a device budget. The host-side plan, plain C++ (no CUDA), so that the
// CPU tests check it (tests/cpu_sar_plan.cpp); model.cuh's attention_step uses it.
//
// Under layer recomputation the backward of layer l first runs the layer forward again from its input.
// Its attention step computes, from x_in [N,H]:
//   ln1 = RMSNorm(x_in) [N,H] (+ ln1_rstd [N] fp32) → qkv = RoPE(ln1 · wqkvᵀ) [N,3H] → att, lse = Attn(qkv)
//   ([N,H] and [B,nh,T] fp32)
// Two options per layer, each a set of those tensors kept from the forward (b bytes per floatX,
// N = B·T tokens, nh heads, T the sequence length):
//   core        att + lse: the backward skips the attention forward, 2·N·T·H FLOPs (causal:
//               2·2·B·nh·T²·hd / 2), for N·H·b + 4·N·nh bytes
//   projection  ln1 + ln1_rstd + qkv: the backward skips the RMSNorm, the QKV GEMM (6·N·H² FLOPs) and
//               RoPE, for 4·N·H·b + 4·N bytes (the RMSNorm and RoPE are not counted: memory-bound)
// Under sequence groups of D ranks (--sp D, notes/sequence_parallel.md) N is the rank's tokens (its T/D of
// each of B sequences), T the whole sequence's length, and attention runs on whole sequences of nh/D
// heads: the core option also keeps that output in the head shard (att_heads, N·H·b more; the backward
// reads it there, wo's backward in the token shard), and saves the same 2·N·T·H FLOPs (B sequences of T
// at nh/D heads); the projection's tensors are the same count (qkv in the head shard).
// Either option alone is valid: with only core kept the recomputation still builds qkv (the attention
// backward reads it); with only projection kept it runs the attention forward on the kept qkv.
// Bit-identical to full recomputation: the forward is deterministic (the same kernels on the same
// inputs), so a kept tensor holds the bytes its recomputation would write.
//
// The plan ranks the 2·L options by FLOPs saved per byte (core first when T > 0.75·H, since its ratio
// is 2T/b against 1.5H/b; ties in layer order) and takes each that still fits in the budget: the bytes
// the device has beyond the pass's peak under full recomputation. Kept tensors of layer l live from its
// forward to its backward, so all of them are live together at the output head: the plan adds its
// bytes to the peak at most once.
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

enum class SarOption { Core, Projection };

struct SarChoice {
  int layer;
  SarOption option;
  size_t bytes;  // kept from the forward to the backward
  double flops;  // the recomputation it saves, per micro-batch
};

struct SarPlan {
  long long tokens = 0;                          // N: the passes it is for (others keep nothing)
  std::vector<bool> keep_core, keep_projection;  // [L]
  std::vector<SarChoice> taken;                  // in the order the greedy took them
  size_t bytes = 0;                              // Σ taken bytes
  double flops_saved = 0;                        // Σ taken FLOPs
  double flops_recomputed = 0;                   // what full recomputation spends on attention, for comparison
  bool keeps(int l) const { return keep_core[l] || keep_projection[l]; }
};

inline size_t sar_option_bytes(SarOption o, long long N, int H, int nh, size_t b, int D) {
  return o == SarOption::Core ? (D > 1 ? 2 : 1) * (size_t)N * H * b + 4 * (size_t)N * nh
                              : 4 * (size_t)N * H * b + 4 * (size_t)N;
}
inline double sar_option_flops(SarOption o, long long N, int T, int H) {
  return o == SarOption::Core ? 2.0 * N * T * H : 6.0 * N * H * H;
}

// The plan for L layers of N tokens on this rank (T the sequence length), H hidden, nh heads, b bytes per
// floatX, sequence groups of D ranks, within `budget` bytes (<= 0: keep nothing).
inline SarPlan sar_plan(int L, long long N, int T, int H, int nh, size_t b, int D, long long budget) {
  SarPlan plan;
  plan.tokens = N;
  plan.keep_core.assign(L, false);
  plan.keep_projection.assign(L, false);
  std::vector<SarChoice> options;
  for (SarOption o : {SarOption::Core, SarOption::Projection})
    for (int l = 0; l < L; l++) {
      options.push_back(SarChoice{l, o, sar_option_bytes(o, N, H, nh, b, D), sar_option_flops(o, N, T, H)});
      plan.flops_recomputed += options.back().flops;
    }
  std::stable_sort(options.begin(), options.end(), [](const SarChoice& x, const SarChoice& y) {
    return x.flops / x.bytes > y.flops / y.bytes;
  });
  size_t left = budget > 0 ? (size_t)budget : 0;
  for (const SarChoice& c : options) {
    if (c.bytes > left) continue;
    (c.option == SarOption::Core ? plan.keep_core : plan.keep_projection)[c.layer] = true;
    plan.taken.push_back(c);
    plan.bytes += c.bytes;
    plan.flops_saved += c.flops;
    left -= c.bytes;
  }
  return plan;
}
