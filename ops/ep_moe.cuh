// ep_moe.cuh — standard expert parallelism (DESIGN §6.1): the dropless MoE FFN of ops/moe.cuh with
// its experts split over the E_p ranks of an EP group. Twin of ref/ep_moe.hpp. The baseline that the
// memory-bounded MoE operators are compared with.
//
// What it computes: exactly moe_forward / moe_backward over the group's global batch (the
// concatenation of every rank's tokens), each rank holding its own token shard and its own expert
// shard. Rank d of the group (E_p = ep.size ranks, E_p divides E) owns the E_l = E/E_p experts
// [d·E_l, (d+1)·E_l); global expert e lives on rank e / E_l as local expert e % E_l.
//
// Shapes on each rank: x [N,H]; topk_idx [N,k] global expert ids; topk_w [N,k] float; W13_local
// [E_l,2I,H]; W2_local [E_l,H,I]; out, dx, dout [N,H]; dtopk_w [N,k]. N may differ between ranks
// (N = 0 is allowed); H, I, E, k must be the same on every rank.
// Gradient outputs: dx (=), dtopk_w (=), dW13_local (+=), dW2_local (+=); an expert's weight
// gradient is summed over the routes of every source rank and stays with its owner.
//
// Schedule. R = N·k routes leave each rank; R_d = routes that arrive at rank d from all sources.
//   forward   moe_route_plan sorts this rank's routes by global expert, which sorts them by destination
//             rank and then by local expert (experts are contiguous per rank) → counts per (rank,
//             local expert) exchanged (all_to_all_host, synchronises) → the host plan ep_plan →
//             rows sent (all_to_all_v) and received source-major: [source s][local expert l][route]
//             → regrouped expert-major: [l][s][route] → one grouped GEMM per product over the local
//             experts (h13 = xe W13ᵀ, a = swiglu(h13), y = a W2ᵀ) → y rows back to source-major →
//             reverse all_to_all_v → weighted combine at the source (moe_combine).
//   backward  dy = w·dout at the source (moe_combine_backward, which also gives dtopk_w) → dy rows to
//             the expert's rank → regrouped → da = dy W2, dW2 += dyᵀa, dh13, dW13 += dh13ᵀ xe,
//             dxe = dh13 W13 → back to source-major → reverse exchange → dx = Σ_j dxp (moe_combine).
//             Replays the forward's plan (no counts exchanged, no host synchronisation).
// Every rank takes part in every collective, also one that sends or receives nothing.
//
// Live set (b = bytes per floatX). Saved from forward to backward: route maps 2·R·4 B and the
// receive map R_d·4 B (Dispatch), received rows xe R_d·H·b (Dispatch), expert outputs back at the
// source y R·H·b (Dispatch), h13 R_d·2I·b (ExpertIntermediates). Temporaries: at most two row
// buffers beside the saved ones (sent + received, or received + regrouped). Peaks over forward +
// backward, measured from the pool (ep_moe_dispatch_peak_bytes, ep_moe_intermediates_peak_bytes):
//   Dispatch             4·(2R + R_d) + H·b·(R + 2·R_d + max(R, R_d))
//   ExpertIntermediates  5·R_d·I·b
// The receiver live set is R_d·H·b (up to three such row buffers at once) with R_d = Σ_s (routes of
// source s to rank d) ≤ Σ_s N_s·k: NOT bounded by anything but the router. Under skew (every route
// to rank 0, equal shards) R_d = E_p·N·k: it grows with the group size. This is the bound standard
// EP does not have.
// Layout of this file: the host-side plan first (the launchers use it), then kernels, launchers.
// Determinism: integer atomics only in the plan; every float sum has a fixed order; grouped GEMMs
// and NCCL point-to-point copies are deterministic. Row maps are permutations (no write races).
#pragma once
#include <algorithm>
#include <climits>
#include <vector>
#include "../runtime/comm.cuh"
#include "common.cuh"
#include "moe.cuh"
#include "../runtime/pool.cuh"

// ---------------------------------------------------------------------------------------------
// Host-side plan (pure C++: no CUDA call; the plan tests drive it for up to 64 ranks without a GPU)

// One rank's dispatch plan. Received rows arrive source-major (all of source 0, then source 1, ...;
// inside a source by local expert, then by the source's route order); the grouped GEMM wants them
// expert-major. Block (l, s) = the routes of source s for local expert l; blocks are numbered
// b = l·ranks + s in expert-major order.
struct EPPlan {
  int ranks = 0, local_experts = 0;    // E_p, E_l
  std::vector<long long> send_rows;    // [E_p] routes this rank sends to each destination rank
  std::vector<long long> recv_rows;    // [E_p] routes this rank receives from each source rank
  std::vector<int> expert_rows;        // [E_l] routes received per local expert (from all sources)
  std::vector<int> expert_offsets;     // [E_l] first expert-major slot of each local expert
  std::vector<int> block_slot_offset;  // [E_l·E_p] first expert-major slot of block (l, s)
  std::vector<int> block_recv_row;     // [E_l·E_p] first row of block (l, s) in the source-major receive buffer
  long long received = 0;              // R_d = Σ recv_rows
};

// routes_per_expert [E]: this rank's routes per global expert (from moe_route_plan); its entries
// d·E_l .. d·E_l+E_l−1 are what this rank sends to rank d (the payload of all_to_all_host).
// received_per_source_expert [E_p·E_l]: entry s·E_l + l = routes of source s for local expert l
// (what all_to_all_host returns). Refuses sizes that do not fit and totals beyond int indices.
inline EPPlan ep_plan(const std::vector<int>& routes_per_expert, const std::vector<long long>& received_per_source_expert,
                      int ranks) {
  const int E = (int)routes_per_expert.size();
  if (ranks < 1 || E < 1 || E % ranks != 0 || received_per_source_expert.size() != (size_t)E)
    fm_fail("ep_plan", "need ranks >= 1 dividing E, and E received counts (ranks x local experts)",
            "ranks=%d E=%d received_entries=%zu", ranks, E, received_per_source_expert.size());
  const int E_l = E / ranks;
  EPPlan plan;
  plan.ranks = ranks;
  plan.local_experts = E_l;
  plan.send_rows.assign(ranks, 0);
  plan.recv_rows.assign(ranks, 0);
  std::vector<long long> expert_total(E_l, 0);
  for (int r = 0; r < ranks; r++)
    for (int l = 0; l < E_l; l++) {
      const int sent = routes_per_expert[r * E_l + l];
      const long long got = received_per_source_expert[(size_t)r * E_l + l];
      if (sent < 0 || got < 0)
        fm_fail("ep_plan", "negative route count", "rank=%d local_expert=%d sent=%d received=%lld", r, l, sent, got);
      plan.send_rows[r] += sent;
      plan.recv_rows[r] += got;
      expert_total[l] += got;
    }
  for (int s = 0; s < ranks; s++) plan.received += plan.recv_rows[s];
  if (plan.received > INT_MAX)
    fm_fail("ep_plan", "too many received routes for int indices", "ranks=%d E=%d received=%lld", ranks, E, plan.received);
  plan.expert_rows.assign(E_l, 0);
  plan.expert_offsets.assign(E_l, 0);
  for (int l = 0; l < E_l; l++) {
    plan.expert_rows[l] = (int)expert_total[l];
    if (l > 0) plan.expert_offsets[l] = plan.expert_offsets[l - 1] + plan.expert_rows[l - 1];
  }
  plan.block_slot_offset.assign((size_t)E_l * ranks, 0);
  plan.block_recv_row.assign((size_t)E_l * ranks, 0);
  long long row = 0;  // source-major: source s, then local expert l
  for (int s = 0; s < ranks; s++)
    for (int l = 0; l < E_l; l++) {
      plan.block_recv_row[(size_t)l * ranks + s] = (int)row;
      row += received_per_source_expert[(size_t)s * E_l + l];
    }
  for (int l = 0; l < E_l; l++) {  // expert-major: local expert l, then source s
    long long slot = plan.expert_offsets[l];
    for (int s = 0; s < ranks; s++) {
      plan.block_slot_offset[(size_t)l * ranks + s] = (int)slot;
      slot += received_per_source_expert[(size_t)s * E_l + l];
    }
  }
  return plan;
}

// Expert-major slot → row of the source-major receive buffer: the block holding `slot` is the last
// one whose first slot is ≤ slot (empty blocks share their first slot with the next block, so the
// last such block is the one that holds it). blocks = E_l·E_p ≥ 1; block_slot_offset ascending,
// block_slot_offset[0] = 0. Shared by the device kernel and the plan tests.
__host__ __device__ inline int ep_recv_row_of_slot(int slot, const int* block_slot_offset, const int* block_recv_row,
                                                   int blocks) {
  int lo = 0, hi = blocks;  // invariant: block_slot_offset[lo] <= slot < block_slot_offset[hi] (hi = blocks: +∞)
  while (hi - lo > 1) {
    int mid = lo + (hi - lo) / 2;
    if (block_slot_offset[mid] <= slot) lo = mid;
    else hi = mid;
  }
  return block_recv_row[lo] + (slot - block_slot_offset[lo]);
}

// Closed-form peaks of the live bytes that one ep_moe_forward + ep_moe_backward adds to each
// category (the schedule above, allocation by allocation); R = routes sent, R_d = routes received.
inline size_t ep_moe_dispatch_peak_bytes(long long R, long long R_d, int H, size_t b) {
  return 4 * (size_t)(2 * R + R_d) + (size_t)H * b * (size_t)(R + 2 * R_d + std::max(R, R_d));
}
inline size_t ep_moe_intermediates_peak_bytes(long long R_d, int I, size_t b) { return 5 * (size_t)R_d * I * b; }

// ---------------------------------------------------------------------------------------------
// Kernels

// recv_row_of_slot [R_d] (=): expert-major slot → source-major row. blocks_table [2·blocks]:
// block_slot_offset then block_recv_row. One thread per slot.
static __global__ void ep_recv_row_map_kernel(int* recv_row_of_slot, const int* blocks_table, int blocks, int R_d) {
  int slot = blockIdx.x * blockDim.x + threadIdx.x;
  if (slot >= R_d) return;
  recv_row_of_slot[slot] = ep_recv_row_of_slot(slot, blocks_table, blocks_table + blocks, blocks);
}

// dst [R_d,H] (=): dst[recv_row_of_slot[s]] = src[s] (expert-major → source-major). One thread per element.
static __global__ void ep_scatter_rows_kernel(floatX* dst, const floatX* src, const int* recv_row_of_slot, int R_d, int H) {
  size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= (size_t)R_d * H) return;
  size_t s = i / H;
  int c = (int)(i % H);
  dst[(size_t)recv_row_of_slot[s] * H + c] = src[i];
}

// ---------------------------------------------------------------------------------------------
// Launchers: pieces

// recv_row_of_slot [R_d] (=) from the plan's block tables (uploaded to a Workspace buffer).
inline void ep_recv_row_map(int* recv_row_of_slot, const EPPlan& plan, cudaStream_t stream) {
  const int R_d = (int)plan.received, blocks = plan.local_experts * plan.ranks;
  if (R_d == 0) return;
  std::vector<int> table(plan.block_slot_offset);
  table.insert(table.end(), plan.block_recv_row.begin(), plan.block_recv_row.end());
  int* table_dev = pool().alloc_t<int>(table.size(), Mem::Workspace, "ep_recv_row_map.blocks");
  copy_to_device(table_dev, table.data(), table.size() * sizeof(int), stream, "ep_recv_row_map");
  ep_recv_row_map_kernel<<<ceil_div(R_d, 256), 256, 0, stream>>>(recv_row_of_slot, table_dev, blocks, R_d);
  launchCheck("ep_recv_row_map", "blocks=%d R_d=%d", blocks, R_d);
  pool().free(table_dev);  // stream-ordered reuse: the next user of this block runs after the kernel
}

// src_major [R_d,H] (=): src_major[recv_row_of_slot[s]] = expert_major[s].
inline void ep_scatter_rows(floatX* src_major, const floatX* expert_major, const int* recv_row_of_slot, int R_d, int H,
                            cudaStream_t stream) {
  size_t total = (size_t)R_d * H;
  if (total == 0) return;
  ep_scatter_rows_kernel<<<ceil_div(total, 256), 256, 0, stream>>>(src_major, expert_major, recv_row_of_slot, R_d, H);
  launchCheck("ep_scatter_rows", "R_d=%d H=%d", R_d, H);
}

// ---------------------------------------------------------------------------------------------
// Launchers: the expert-parallel MoE FFN

// What backward needs; allocated from the pool by ep_moe_forward, freed by ep_saved_free. A pointer
// is nullptr when its buffer has no element (N = 0, or nothing received).
struct EPSaved {
  int N = 0, H = 0, I = 0, E = 0, k = 0;
  EPPlan plan;                      // host: send/receive rows per rank, blocks, R_d (plan.ranks = 0: empty)
  int* route_of_slot = nullptr;     // [N·k] sorted send position -> route index r        (Dispatch)
  int* slot_of_route = nullptr;     // [N·k] route index r -> sorted send position        (Dispatch)
  int* recv_row_of_slot = nullptr;  // [R_d] expert-major slot -> source-major row        (Dispatch)
  floatX* xe = nullptr;             // [R_d, H] received token rows, expert-major         (Dispatch)
  floatX* h13 = nullptr;            // [R_d, 2I] expert-major                             (ExpertIntermediates)
  floatX* y = nullptr;              // [N·k, H] expert outputs back at the source, sorted (Dispatch)
};

inline void ep_saved_free(EPSaved& saved) {
  for (void* p : {(void*)saved.route_of_slot, (void*)saved.slot_of_route, (void*)saved.recv_row_of_slot,
                  (void*)saved.xe, (void*)saved.h13, (void*)saved.y})
    pool().free(p);
  saved = EPSaved();
}

// One problem per local expert with at least one received route; make(l, first_row, rows) builds it.
template <typename F>
std::vector<GroupedGemmProblem> ep_local_expert_problems(const EPPlan& plan, F make) {
  return expert_problems(plan.expert_rows, plan.expert_offsets, make);
}

// out [N,H] (=); fills `saved` (which must be empty: ep_saved_free it after backward). Collective
// over `ep`: every rank of the group calls it. Synchronises `stream` twice (moe_route_plan's counts,
// all_to_all_host's exchange of counts: buffer sizes come from the host).
inline void ep_moe_forward(floatX* out, EPSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                           const floatX* W13_local, const floatX* W2_local, int N, int H, int I, int E, int k,
                           const Comm& ep, cudaStream_t stream) {
  const char* op = "ep_moe_forward";
  if (N < 0 || H < 1 || I < 1 || E < 1 || k < 1)
    fm_fail(op, "need N >= 0 and H, I, E, k >= 1", "N=%d H=%d I=%d E=%d k=%d group=%s", N, H, I, E, k, ep.name.c_str());
  if (ep.size < 1 || E % ep.size != 0)
    fm_fail(op, "the EP group size must divide the number of experts", "E=%d group=%s size=%d", E, ep.name.c_str(), ep.size);
  if ((long long)N * k > INT_MAX) fm_fail(op, "too many routes for int indices", "N=%d k=%d", N, k);
  if (saved.plan.ranks != 0)
    fm_fail(op, "EPSaved still holds a forward: call ep_saved_free after backward", "N=%d H=%d I=%d E=%d k=%d", N, H, I, E, k);
  const int R = N * k, E_l = E / ep.size;
  const size_t w13_stride = (size_t)2 * I * H;
  saved.N = N; saved.H = H; saved.I = I; saved.E = E; saved.k = k;

  // plan: sort routes by expert (= by destination rank, then local expert), exchange the counts
  saved.route_of_slot = alloc_rows<int>(R, Mem::Dispatch, "ep_moe.route_of_slot");
  saved.slot_of_route = alloc_rows<int>(R, Mem::Dispatch, "ep_moe.slot_of_route");
  std::vector<int> routes_per_expert = moe_route_plan(saved.route_of_slot, saved.slot_of_route, topk_idx, R, E, stream);
  std::vector<long long> sent_per_expert(routes_per_expert.begin(), routes_per_expert.end());
  std::vector<long long> received_per_source_expert = all_to_all_host(ep, sent_per_expert, E_l, stream);
  saved.plan = ep_plan(routes_per_expert, received_per_source_expert, ep.size);
  const EPPlan& plan = saved.plan;
  const int R_d = (int)plan.received;
  saved.recv_row_of_slot = alloc_rows<int>(R_d, Mem::Dispatch, "ep_moe.recv_row_of_slot");
  ep_recv_row_map(saved.recv_row_of_slot, plan, stream);

  // dispatch: x rows in sorted order → their experts' ranks (source-major) → expert-major xe [R_d,H]
  floatX* x_sent = alloc_rows<floatX>((size_t)R * H, Mem::Dispatch, "ep_moe_forward.x_sent");
  moe_permute_rows(x_sent, x, saved.route_of_slot, R, H, k, stream);
  floatX* x_recv = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, "ep_moe_forward.x_recv");
  all_to_all_v(ep, x_sent, plan.send_rows, x_recv, plan.recv_rows, (size_t)H, stream);
  pool().free(x_sent);
  saved.xe = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, "ep_moe.xe");
  moe_permute_rows(saved.xe, x_recv, saved.recv_row_of_slot, R_d, H, 1, stream);
  pool().free(x_recv);

  // local experts: h13_l [R_l,2I] = xe_l W13_lᵀ;  a = swiglu(h13);  y_l [R_l,H] = a_l W2_lᵀ
  saved.h13 = alloc_rows<floatX>((size_t)R_d * 2 * I, Mem::ExpertIntermediates, "ep_moe.h13");
  grouped_gemm("ep_moe_forward.h13", ep_local_expert_problems(plan, [&](int l, size_t first, int rows) {
                 return GroupedGemmProblem{saved.xe + first * H, W13_local + l * w13_stride, saved.h13 + first * 2 * I,
                                           rows, 2 * I, H};
               }),
               false, true, H, H, 2 * I, 0.f, stream);
  floatX* y_expert = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, "ep_moe_forward.y_expert");
  experts_swiglu_down(y_expert, saved.h13, W2_local, plan.expert_rows, plan.expert_offsets, R_d, H, I, "ep_moe_forward",
                      stream);

  // return: expert-major → source-major → back to the sources (sorted order) → weighted combine
  floatX* y_recv = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, "ep_moe_forward.y_recv");
  ep_scatter_rows(y_recv, y_expert, saved.recv_row_of_slot, R_d, H, stream);
  pool().free(y_expert);
  saved.y = alloc_rows<floatX>((size_t)R * H, Mem::Dispatch, "ep_moe.y");
  all_to_all_v(ep, y_recv, plan.recv_rows, saved.y, plan.send_rows, (size_t)H, stream);
  pool().free(y_recv);
  moe_combine(out, saved.y, saved.slot_of_route, topk_w, N, H, k, stream);
}

// dx [N,H] (=), dtopk_w [N,k] (=), dW13_local [E_l,2I,H] (+=), dW2_local [E_l,H,I] (+=) from dout
// [N,H] and the forward's saved state. Collective over `ep` (the forward's group). Does not synchronise.
inline void ep_moe_backward(floatX* dx, float* dtopk_w, floatX* dW13_local, floatX* dW2_local, const floatX* dout,
                            const EPSaved& saved, const float* topk_w, const floatX* W13_local, const floatX* W2_local,
                            const Comm& ep, cudaStream_t stream) {
  const EPPlan& plan = saved.plan;
  if (plan.ranks != ep.size)
    fm_fail("ep_moe_backward", "EPSaved is empty or from another group: run ep_moe_forward on this group first",
            "saved ranks=%d group=%s size=%d", plan.ranks, ep.name.c_str(), ep.size);
  const int N = saved.N, H = saved.H, I = saved.I, k = saved.k, R = N * k, R_d = (int)plan.received;
  const size_t w13_stride = (size_t)2 * I * H;

  // dy = w·dout at the source (sorted order), dtopk_w = dout·y → the experts' ranks → expert-major
  floatX* dy_sent = alloc_rows<floatX>((size_t)R * H, Mem::Dispatch, "ep_moe_backward.dy_sent");
  moe_combine_backward(dy_sent, dtopk_w, dout, saved.y, saved.slot_of_route, topk_w, N, H, k, stream);
  floatX* dy_recv = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, "ep_moe_backward.dy_recv");
  all_to_all_v(ep, dy_sent, plan.send_rows, dy_recv, plan.recv_rows, (size_t)H, stream);
  pool().free(dy_sent);
  floatX* dy = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, "ep_moe_backward.dy");
  moe_permute_rows(dy, dy_recv, saved.recv_row_of_slot, R_d, H, 1, stream);
  pool().free(dy_recv);

  // local experts: da_l = dy_l W2_l;  dW2_l += dy_lᵀ a_l;  dh13 = swiglu'(da);  dW13_l += dh13_lᵀ xe_l;  dxe_l = dh13_l W13_l
  floatX* dh13 = experts_backward_to_h13(dy, dW2_local, saved.h13, W2_local, plan.expert_rows, plan.expert_offsets,
                                         R_d, H, I, "ep_moe_backward", stream);
  grouped_gemm("ep_moe_backward.dW13", ep_local_expert_problems(plan, [&](int l, size_t first, int rows) {
                 return GroupedGemmProblem{dh13 + first * 2 * I, saved.xe + first * H, dW13_local + l * w13_stride,
                                           2 * I, H, rows};
               }),
               true, false, 2 * I, H, H, 1.f, stream);
  floatX* dxe = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, "ep_moe_backward.dxe");
  grouped_gemm("ep_moe_backward.dxe", ep_local_expert_problems(plan, [&](int l, size_t first, int rows) {
                 return GroupedGemmProblem{dh13 + first * 2 * I, W13_local + l * w13_stride, dxe + first * H, rows, H,
                                           2 * I};
               }),
               false, false, 2 * I, H, H, 0.f, stream);
  pool().free(dh13);

  // input gradients: expert-major → source-major → back to the sources → dx[n] = Σ_j dxp[route n·k+j]
  floatX* dx_recv = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, "ep_moe_backward.dx_recv");
  ep_scatter_rows(dx_recv, dxe, saved.recv_row_of_slot, R_d, H, stream);
  pool().free(dxe);
  floatX* dx_sent = alloc_rows<floatX>((size_t)R * H, Mem::Dispatch, "ep_moe_backward.dx_sent");
  all_to_all_v(ep, dx_recv, plan.recv_rows, dx_sent, plan.send_rows, (size_t)H, stream);
  pool().free(dx_recv);
  moe_combine(dx, dx_sent, saved.slot_of_route, nullptr, N, H, k, stream);
  pool().free(dx_sent);
}

// --moe ep: the dispatcher seam (ops/moe.cuh) over this rank's expert-parallel group. Holds a copy
// of the group's Comm (a handle; the trainer owns and destroys the communicator).
struct EPDispatcher : MoEDispatcher {
  struct Saved : DispatchSaved {
    EPSaved ep;
    ~Saved() override { ep_saved_free(ep); }
  };
  Comm group;
  EPDispatcher(int H_, int I_, int E_, int k_, const Comm& ep_group) : MoEDispatcher(H_, I_, E_, k_), group(ep_group) {}
  std::unique_ptr<DispatchSaved> forward(floatX* out, const floatX* x, const int* topk_idx, const float* topk_w,
                                         const floatX* W13, const floatX* W2, int N, cudaStream_t stream) override {
    auto saved = std::make_unique<Saved>();
    ep_moe_forward(out, saved->ep, x, topk_idx, topk_w, W13, W2, N, H, I, E, k, group, stream);
    return saved;
  }
  void backward(floatX* dx, float* dtopk_w, floatX* dW13, floatX* dW2, const floatX* dout, const DispatchSaved& saved,
                const floatX*, const int*, const float* topk_w, const floatX* W13, const floatX* W2,
                cudaStream_t stream) override {
    ep_moe_backward(dx, dtopk_w, dW13, dW2, dout, static_cast<const Saved&>(saved).ep, topk_w, W13, W2, group, stream);
  }
};
