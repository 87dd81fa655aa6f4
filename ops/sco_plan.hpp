// sco_plan.hpp — which layer boundaries SCO (selective checkpoint offload, notes/design.md §6.6,
// ops/sco.cuh) keeps in pinned host memory for a host budget: the host-side plan, plain C++ (no CUDA),
// so that the CPU tests check it (tests/cpu_sco_plan.cpp).
//
// Boundaries: input[0..L−1] are the layers' inputs, input[L] the final hidden state; each is N·H
// activations of b bytes (boundary_bytes = N·H·b). The plan walks input[0..L−1] in forward order and
// offloads each boundary that still fits in the budget; input[L] is never offloaded (the head reads it
// at once). Every boundary has the same size, so the set S is the first min(L, ⌊budget/boundary_bytes⌋)
// boundaries: the ones the device would keep longest (input[0] lives from the first layer's forward to
// its backward, the end of the pass).
#pragma once
#include <algorithm>
#include <cstddef>
#include <vector>

struct ScoPlan {
  std::vector<bool> offloaded;  // [L + 1]: offloaded[l] when input[l] is in S; offloaded[L] is false
  int count = 0;                // |S|
  size_t boundary_bytes = 0;    // N·H·b, one boundary
  size_t host_bytes = 0;        // |S|·boundary_bytes: the pinned host memory it needs
  int layers() const { return (int)offloaded.size() - 1; }
};

// The boundaries of L layers, boundary_bytes each, that fit in `budget` host bytes (budget >= 0).
inline ScoPlan sco_plan(int L, size_t boundary_bytes, long long budget) {
  ScoPlan plan;
  plan.offloaded.assign(L + 1, false);
  plan.boundary_bytes = boundary_bytes;
  size_t left = budget > 0 ? (size_t)budget : 0;
  for (int l = 0; l < L; l++) {
    if (boundary_bytes > left) continue;  // does not fit: the next one is no smaller, but the walk is the rule
    plan.offloaded[l] = true;
    plan.count++;
    plan.host_bytes += boundary_bytes;
    left -= boundary_bytes;
  }
  return plan;
}

// The closed form of the boundaries' device bytes (Mem::Checkpoints) during a pass with the plan:
// the L + 1 − |S| boundaries kept on the device, plus at most 2 offloaded ones at a time (forward: the
// one a layer reads while it is copied out and the one it writes; backward: the one being recomputed
// and the prefetch of the next).
inline size_t sco_device_bound(const ScoPlan& plan) {
  return ((size_t)(plan.layers() + 1 - plan.count) + (size_t)std::min(plan.count, 2)) * plan.boundary_bytes;
}

// The peak of those bytes under ops/sco.cuh's schedule, where S is a prefix of the layers and input[l]
// is released after layer l's backward: the L + 1 boundaries without SCO; else the kept ones at the end
// of the forward (L + 1 − |S|), or 2 when fewer (a layer of S reads its input while writing its output;
// in backward, the boundary being recomputed and the prefetch).
inline size_t sco_device_peak(const ScoPlan& plan) {
  const int L = plan.layers();
  if (plan.count == 0) return (size_t)(L + 1) * plan.boundary_bytes;
  return (size_t)std::max(L + 1 - plan.count, 2) * plan.boundary_bytes;
}
