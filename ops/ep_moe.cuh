// ep_moe.cuh — standard expert parallelism (notes/design.md §6.1): the dropless MoE FFN of ops/moe.cuh with
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

// One rank's dispatch plan. This rank computes its received routes in G groups, one weight matrix
// pair each: its local experts under --moe ep (G = E_l), its pieces under --moe llep (a piece of an
// expert of its own or of one lent by its home rank, ops/llep.cuh). Received rows arrive
// source-major (all of source 0, then source 1, ...; inside a source by group, then by the source's
// route order); the grouped GEMM wants them group-major. Block (g, s) = the routes of source s in
// group g; blocks are numbered b = g·ranks + s in group-major order.
struct EPPlan {
  int ranks = 0, groups = 0;           // E_p, G
  std::vector<long long> send_rows;    // [E_p] routes this rank sends to each destination rank
  std::vector<long long> recv_rows;    // [E_p] routes this rank receives from each source rank
  std::vector<int> group_rows;         // [G] routes received per group (from all sources)
  std::vector<int> group_offsets;      // [G] first group-major slot of each group
  std::vector<int> block_slot_offset;  // [G·E_p] first group-major slot of block (g, s)
  std::vector<int> block_recv_row;     // [G·E_p] first row of block (g, s) in the source-major receive buffer
  long long received = 0;              // R_d = Σ recv_rows
};

// The blocks of a plan from what this rank sends to each rank, send_rows [E_p], and what it receives,
// received_per_source_group [E_p·G] (entry s·G + g = routes of source s in group g). Refuses totals
// beyond int indices.
inline EPPlan ep_plan_groups(const std::vector<long long>& send_rows,
                             const std::vector<long long>& received_per_source_group, int ranks, int groups) {
  EPPlan plan;
  plan.ranks = ranks;
  plan.groups = groups;
  plan.send_rows = send_rows;
  plan.recv_rows.assign(ranks, 0);
  std::vector<long long> group_total(groups, 0);
  for (int s = 0; s < ranks; s++)
    for (int g = 0; g < groups; g++) {
      const long long got = received_per_source_group[(size_t)s * groups + g];
      if (got < 0) fm_fail("ep_plan", "negative route count", "rank=%d group=%d received=%lld", s, g, got);
      plan.recv_rows[s] += got;
      group_total[g] += got;
    }
  for (int s = 0; s < ranks; s++) plan.received += plan.recv_rows[s];
  if (plan.received > INT_MAX)
    fm_fail("ep_plan", "too many received routes for int indices", "ranks=%d groups=%d received=%lld", ranks, groups,
            plan.received);
  plan.group_rows.assign(groups, 0);
  plan.group_offsets.assign(groups, 0);
  for (int g = 0; g < groups; g++) {
    plan.group_rows[g] = (int)group_total[g];
    if (g > 0) plan.group_offsets[g] = plan.group_offsets[g - 1] + plan.group_rows[g - 1];
  }
  plan.block_slot_offset.assign((size_t)groups * ranks, 0);
  plan.block_recv_row.assign((size_t)groups * ranks, 0);
  long long row = 0;  // source-major: source s, then group g
  for (int s = 0; s < ranks; s++)
    for (int g = 0; g < groups; g++) {
      plan.block_recv_row[(size_t)g * ranks + s] = (int)row;
      row += received_per_source_group[(size_t)s * groups + g];
    }
  for (int g = 0; g < groups; g++) {  // group-major: group g, then source s
    long long slot = plan.group_offsets[g];
    for (int s = 0; s < ranks; s++) {
      plan.block_slot_offset[(size_t)g * ranks + s] = (int)slot;
      slot += received_per_source_group[(size_t)s * groups + g];
    }
  }
  return plan;
}

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
  std::vector<long long> send_rows(ranks, 0);
  for (int d = 0; d < ranks; d++)
    for (int l = 0; l < E_l; l++) {
      const int sent = routes_per_expert[d * E_l + l];
      if (sent < 0) fm_fail("ep_plan", "negative route count", "rank=%d local_expert=%d sent=%d", d, l, sent);
      send_rows[d] += sent;
    }
  return ep_plan_groups(send_rows, received_per_source_expert, ranks, E_l);
}

// Group-major slot → row of the source-major receive buffer: the block holding `slot` is the last
// one whose first slot is ≤ slot (empty blocks share their first slot with the next block, so the
// last such block is the one that holds it). blocks = G·E_p ≥ 1; block_slot_offset ascending,
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

// The two categories together: they do not peak at the same moment. With the saved maps, xe [R_d,H],
// y [R,H] and h13 [R_d,2I] live throughout, the backward holds beside them
//   dy's rows in flight and regrouped      (R + R_d or 2·R_d more rows of H)        + nothing of I
//   dy [R_d,H], a and da [R_d,I] each      (R_d more rows of H)                     + 2·R_d·I
//   da and dh13 [R_d,2I], dy freed         (nothing of H)                           + 3·R_d·I
//   dh13 and dxe [R_d,H], da freed         (R_d more rows of H)                     + 2·R_d·I
//   dxe's rows in flight                   (R + R_d or 2·R_d more rows of H)        + nothing of I
// so the largest sum is that of one of three moments (the forward's are below the first).
inline size_t ep_moe_layer_peak_bytes(long long R, long long R_d, int H, int I, size_t b) {
  const size_t maps = 4 * (size_t)(2 * R + R_d), rows = (size_t)H * b, inter = (size_t)I * b;
  return maps + std::max({(size_t)(R + 2 * R_d + std::max(R, R_d)) * rows + 2 * (size_t)R_d * inter,
                          (size_t)(R + 2 * R_d) * rows + 4 * (size_t)R_d * inter,
                          (size_t)(R + R_d) * rows + 5 * (size_t)R_d * inter});
}

// What the dispatcher holds whatever the router does (model.cuh's per-rank prediction): with N tokens
// on each of the E_p ranks, R = N·k routes leave a rank and at most R_d = E_p·R arrive (every route of
// every source to this rank's experts). Saved: the route and receive maps, xe, y and h13; at most the
// layer's peak above plus a grouped GEMM's pointer table (3 per local expert).
inline DispatchBound ep_moe_live_bound(long long N, int H, int I, int E_l, int k, int E_p, size_t b) {
  const long long R = N * k, R_d = (long long)E_p * R;
  DispatchBound d;
  d.saved = 4 * (size_t)(2 * R + R_d) + (size_t)(R_d + R) * H * b + 2 * (size_t)R_d * I * b;
  d.peak = ep_moe_layer_peak_bytes(R, R_d, H, I, b) + 3 * sizeof(void*) * (size_t)E_l;
  return d;
}

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

// The plan's block tables as ep_recv_row_map_kernel reads them: block_slot_offset then block_recv_row.
inline std::vector<int> ep_blocks_table(const EPPlan& plan) {
  std::vector<int> table(plan.block_slot_offset);
  table.insert(table.end(), plan.block_recv_row.begin(), plan.block_recv_row.end());
  return table;
}

// recv_row_of_slot [R_d] (=) from the plan's block tables: blocks_table_dev, already on the device
// (ep_blocks_table's layout), or nullptr to upload them here (a Workspace buffer; synchronises).
inline void ep_recv_row_map(int* recv_row_of_slot, const EPPlan& plan, const int* blocks_table_dev, cudaStream_t stream) {
  const int R_d = (int)plan.received, blocks = plan.groups * plan.ranks;
  if (R_d == 0) return;
  int* uploaded = nullptr;
  if (blocks_table_dev == nullptr) {
    const std::vector<int> table = ep_blocks_table(plan);
    uploaded = pool().alloc_t<int>(table.size(), Mem::Workspace, "ep_recv_row_map.blocks");
    copy_to_device(uploaded, table.data(), table.size() * sizeof(int), stream, "ep_recv_row_map");
    blocks_table_dev = uploaded;
  }
  ep_recv_row_map_kernel<<<ceil_div(R_d, 256), 256, 0, stream>>>(recv_row_of_slot, blocks_table_dev, blocks, R_d);
  launchCheck("ep_recv_row_map", "blocks=%d R_d=%d", blocks, R_d);
  pool().free(uploaded);  // stream-ordered reuse: the next user of this block runs after the kernel
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

// What backward needs; allocated from the pool by the forward, freed by ep_saved_free. A pointer is
// nullptr when its buffer has no element (N = 0, or nothing received).
struct EPSaved {
  int N = 0, H = 0, I = 0, E = 0, k = 0;
  EPPlan plan;                      // host: send/receive rows per rank, blocks, R_d (plan.ranks = 0: empty)
  int* route_of_slot = nullptr;     // [N·k] send position -> route index r              (Dispatch)
  int* slot_of_route = nullptr;     // [N·k] route index r -> send position              (Dispatch)
  int* recv_row_of_slot = nullptr;  // [R_d] group-major slot -> source-major row        (Dispatch)
  floatX* xe = nullptr;             // [R_d, H] received token rows, group-major         (Dispatch)
  floatX* h13 = nullptr;            // [R_d, 2I] group-major                             (ExpertIntermediates)
  floatX* y = nullptr;              // [N·k, H] expert outputs back at the source, in send order (Dispatch)
};

inline void ep_saved_free(EPSaved& saved) {
  for (void* p : {(void*)saved.route_of_slot, (void*)saved.slot_of_route, (void*)saved.recv_row_of_slot,
                  (void*)saved.xe, (void*)saved.h13, (void*)saved.y})
    pool().free(p);
  saved = EPSaved();
}

// The weights of each group this rank computes, and where each group's weight gradient goes (+=).
struct GroupWeights {
  std::vector<const floatX*> W13, W2;  // [G]: [2I,H], [H,I]
};
struct GroupGrads {
  std::vector<floatX*> dW13, dW2;      // [G]: [2I,H], [H,I]
};

// The received routes' groups, on the host.
inline ExpertRows ep_group_rows(const EPPlan& plan) {
  return ExpertRows::on_host(plan.group_rows, plan.group_offsets, (int)plan.received);
}

// One problem per group with at least one received route; make(g, first_row, rows) builds it.
template <typename F>
GroupedGemmProblems ep_group_problems(const EPPlan& plan, F make) {
  return expert_problems(ep_group_rows(plan), make);
}

// Checks shared by the expert-parallel forwards; records the sizes in `saved`.
inline void ep_moe_check(const char* op, const EPSaved& saved, int N, int H, int I, int E, int k, const Comm& ep) {
  if (N < 0 || H < 1 || I < 1 || E < 1 || k < 1)
    fm_fail(op, "need N >= 0 and H, I, E, k >= 1", "N=%d H=%d I=%d E=%d k=%d group=%s", N, H, I, E, k, ep.name.c_str());
  if (ep.size < 1 || E % ep.size != 0)
    fm_fail(op, "the EP group size must divide the number of experts", "E=%d group=%s size=%d", E, ep.name.c_str(), ep.size);
  if ((long long)N * k > INT_MAX) fm_fail(op, "too many routes for int indices", "N=%d k=%d", N, k);
  if (saved.plan.ranks != 0)
    fm_fail(op, "the saved state still holds a forward: free it after backward", "N=%d H=%d I=%d E=%d k=%d", N, H, I, E, k);
}

// The pass once the plan is known, shared by ep, llep and pllep, cut at its four exchanges into
// stages: a compute stage runs on the compute stream `cs`, an exchange (ep_exchange_rows) on an
// exchange stream `xs`. ep_moe_forward_planned / ep_moe_backward_planned run the stages in order on
// one stream; ops/pipelined_llep.cuh runs them on two, several chunks in flight. Rows in flight
// between two stages are an EPExchange: a compute stage fills `sent`, the exchange allocates and
// fills `received`, and the next compute stage frees `sent` once it runs after the exchange (the
// caller makes `cs` wait for it first when xs ≠ cs), so the pool's live bytes are exact whatever
// the streams' timing.
struct EPExchange {
  floatX* sent = nullptr;      // [Σ send_rows, H]
  floatX* received = nullptr;  // [Σ recv_rows, H]
};

// received (=, allocated here: Dispatch, `tag`) ← the ranks' `sent`, on `xs` after the work queued
// on `cs` so far. Collective over `ep`.
inline void ep_exchange_rows(EPExchange& rows, const std::vector<long long>& send_rows,
                             const std::vector<long long>& recv_rows, int H, const Comm& ep, const std::string& tag,
                             cudaStream_t cs, cudaStream_t xs) {
  long long received = 0;
  for (long long r : recv_rows) received += r;
  rows.received = alloc_rows<floatX>((size_t)received * H, Mem::Dispatch, tag);
  stream_after(xs, cs, tag.c_str());
  all_to_all_v(ep, rows.sent, send_rows, rows.received, recv_rows, (size_t)H, xs);
}

// Forward stage 1 (cs): on entry saved.plan, route_of_slot and slot_of_route are set (the send
// order: destination rank, then group, then route order). The receive map from the plan's block
// tables (blocks_table_dev, see ep_recv_row_map); x's rows in send order into dispatch.sent.
inline void ep_forward_pack(EPExchange& dispatch, EPSaved& saved, const floatX* x, const int* blocks_table_dev,
                            const std::string& name, cudaStream_t cs) {
  const int R = saved.N * saved.k, R_d = (int)saved.plan.received, H = saved.H;
  saved.recv_row_of_slot = alloc_rows<int>(R_d, Mem::Dispatch, name + ".recv_row_of_slot");
  ep_recv_row_map(saved.recv_row_of_slot, saved.plan, blocks_table_dev, cs);
  dispatch.sent = alloc_rows<floatX>((size_t)R * H, Mem::Dispatch, name + ".x_sent");
  moe_permute_rows(dispatch.sent, x, saved.route_of_slot, R, H, saved.k, cs);
}

// Forward stage 2 (cs), after the dispatch: group-major xe [R_d,H] from the received rows; each
// group: h13_g [R_g,2I] = xe_g W13_gᵀ, a = swiglu(h13), y_g [R_g,H] = a_g W2_gᵀ; y to source-major
// rows in ret.sent. keep_h13 = false frees h13 at once (a forward that backward recomputes).
inline void ep_forward_experts(EPExchange& ret, EPExchange& dispatch, EPSaved& saved, const GroupWeights& w,
                               bool keep_h13, const std::string& name, cudaStream_t cs) {
  const EPPlan& plan = saved.plan;
  const int H = saved.H, I = saved.I, R_d = (int)plan.received;
  pool().free(dispatch.sent);
  saved.xe = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, name + ".xe");
  moe_permute_rows(saved.xe, dispatch.received, saved.recv_row_of_slot, R_d, H, 1, cs);
  pool().free(dispatch.received);
  dispatch = EPExchange();
  saved.h13 = alloc_rows<floatX>((size_t)R_d * 2 * I, Mem::ExpertIntermediates, name + ".h13");
  grouped_gemm((name + ".h13").c_str(), ep_group_problems(plan, [&](int g, size_t first, int rows) {
                 return GroupedGemmProblem{saved.xe + first * H, w.W13[g], saved.h13 + first * 2 * I, rows, 2 * I, H};
               }),
               false, true, H, H, 2 * I, 0.f, cs);
  floatX* y_group = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, name + ".y_group");
  experts_swiglu_down(y_group, saved.h13, w.W2, ep_group_rows(plan), H, I, name, cs);
  if (!keep_h13) {
    pool().free(saved.h13);
    saved.h13 = nullptr;
  }
  ret.sent = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, name + ".y_recv");
  ep_scatter_rows(ret.sent, y_group, saved.recv_row_of_slot, R_d, H, cs);
  pool().free(y_group);
}

// Forward stage 3 (cs), after the return: the expert outputs back at the source become saved.y
// [N·k,H] (send order); out [N,H] (=) = their weighted combine (out = nullptr: no combine, a
// recomputation that needs only saved.y).
inline void ep_forward_combine(floatX* out, EPExchange& ret, EPSaved& saved, const float* topk_w, cudaStream_t cs) {
  pool().free(ret.sent);
  saved.y = ret.received;
  ret = EPExchange();
  if (out != nullptr) moe_combine(out, saved.y, saved.slot_of_route, topk_w, saved.N, saved.H, saved.k, cs);
}

// Backward stage 1 (cs): dy = w·dout at the source (send order) into dispatch.sent, dtopk_w [N,k]
// (=) = dout·y.
inline void ep_backward_pack(EPExchange& dispatch, float* dtopk_w, const floatX* dout, const EPSaved& saved,
                             const float* topk_w, const std::string& name, cudaStream_t cs) {
  const int N = saved.N, H = saved.H, k = saved.k;
  dispatch.sent = alloc_rows<floatX>((size_t)N * k * H, Mem::Dispatch, name + ".dy_sent");
  moe_combine_backward(dispatch.sent, dtopk_w, dout, saved.y, saved.slot_of_route, topk_w, N, H, k, cs);
}

// Backward stage 2 (cs), after the dispatch of dy: group-major dy; each group: da_g = dy_g W2_g,
// dW2_g += dy_gᵀa_g, dh13 = swiglu'(da), dW13_g += dh13_gᵀ xe_g, dxe_g = dh13_g W13_g; dxe to
// source-major rows in ret.sent.
inline void ep_backward_experts(EPExchange& ret, EPExchange& dispatch, const GroupGrads& grads, const EPSaved& saved,
                                const GroupWeights& w, const std::string& name, cudaStream_t cs) {
  const EPPlan& plan = saved.plan;
  const int H = saved.H, I = saved.I, R_d = (int)plan.received;
  pool().free(dispatch.sent);
  floatX* dy = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, name + ".dy");
  moe_permute_rows(dy, dispatch.received, saved.recv_row_of_slot, R_d, H, 1, cs);
  pool().free(dispatch.received);
  dispatch = EPExchange();
  floatX* dh13 = experts_backward_to_h13(dy, grads.dW2, saved.h13, w.W2, ep_group_rows(plan), H, I, name, cs);
  grouped_gemm((name + ".dW13").c_str(), ep_group_problems(plan, [&](int g, size_t first, int rows) {
                 return GroupedGemmProblem{dh13 + first * 2 * I, saved.xe + first * H, grads.dW13[g], 2 * I, H, rows};
               }),
               true, false, 2 * I, H, H, 1.f, cs);
  floatX* dxe = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, name + ".dxe");
  grouped_gemm((name + ".dxe").c_str(), ep_group_problems(plan, [&](int g, size_t first, int rows) {
                 return GroupedGemmProblem{dh13 + first * 2 * I, w.W13[g], dxe + first * H, rows, H, 2 * I};
               }),
               false, false, 2 * I, H, H, 0.f, cs);
  pool().free(dh13);
  ret.sent = alloc_rows<floatX>((size_t)R_d * H, Mem::Dispatch, name + ".dx_recv");
  ep_scatter_rows(ret.sent, dxe, saved.recv_row_of_slot, R_d, H, cs);
  pool().free(dxe);
}

// Backward stage 3 (cs), after the return: dx [N,H] (=) = Σ_j dxp[route n·k+j].
inline void ep_backward_combine(floatX* dx, EPExchange& ret, const EPSaved& saved, cudaStream_t cs) {
  pool().free(ret.sent);
  moe_combine(dx, ret.received, saved.slot_of_route, nullptr, saved.N, saved.H, saved.k, cs);
  pool().free(ret.received);
  ret = EPExchange();
}

// The forward pass on one stream: dispatch x's rows, compute each group with its weights, return the
// expert outputs into saved.y and combine them: out [N,H] (=; nullptr: no combine).
inline void ep_moe_forward_planned(floatX* out, EPSaved& saved, const floatX* x, const float* topk_w,
                                   const GroupWeights& w, const Comm& ep, const char* op, cudaStream_t stream) {
  const std::string name(op);
  EPExchange dispatch, ret;
  ep_forward_pack(dispatch, saved, x, nullptr, name, stream);
  ep_exchange_rows(dispatch, saved.plan.send_rows, saved.plan.recv_rows, saved.H, ep, name + ".x_recv", stream, stream);
  ep_forward_experts(ret, dispatch, saved, w, true, name, stream);
  ep_exchange_rows(ret, saved.plan.recv_rows, saved.plan.send_rows, saved.H, ep, name + ".y", stream, stream);
  ep_forward_combine(out, ret, saved, topk_w, stream);
}

// dx [N,H] (=), dtopk_w [N,k] (=), each group's weight gradient (+=) from dout [N,H] and the
// forward's saved state: backward of ep_moe_forward_planned on one stream. Collective over `ep`
// (the forward's group). Does not synchronise.
inline void ep_moe_backward_planned(floatX* dx, float* dtopk_w, const GroupGrads& grads, const floatX* dout,
                                    const EPSaved& saved, const float* topk_w, const GroupWeights& w, const Comm& ep,
                                    const char* op, cudaStream_t stream) {
  if (saved.plan.ranks != ep.size)
    fm_fail(op, "the saved state is empty or from another group: run the forward on this group first",
            "saved ranks=%d group=%s size=%d", saved.plan.ranks, ep.name.c_str(), ep.size);
  const std::string name(op);
  EPExchange dispatch, ret;
  ep_backward_pack(dispatch, dtopk_w, dout, saved, topk_w, name, stream);
  ep_exchange_rows(dispatch, saved.plan.send_rows, saved.plan.recv_rows, saved.H, ep, name + ".dy_recv", stream, stream);
  ep_backward_experts(ret, dispatch, grads, saved, w, name, stream);
  ep_exchange_rows(ret, saved.plan.recv_rows, saved.plan.send_rows, saved.H, ep, name + ".dx_sent", stream, stream);
  ep_backward_combine(dx, ret, saved, stream);
}

// out [N,H] (=); fills `saved` (which must be empty: ep_saved_free it after backward). Collective
// over `ep`: every rank of the group calls it. Synchronises `stream` twice (moe_route_plan's counts,
// all_to_all_host's exchange of counts: buffer sizes come from the host).
inline void ep_moe_forward(floatX* out, EPSaved& saved, const floatX* x, const int* topk_idx, const float* topk_w,
                           const floatX* W13_local, const floatX* W2_local, int N, int H, int I, int E, int k,
                           const Comm& ep, cudaStream_t stream) {
  ep_moe_check("ep_moe_forward", saved, N, H, I, E, k, ep);
  const int R = N * k, E_l = E / ep.size;
  saved.N = N; saved.H = H; saved.I = I; saved.E = E; saved.k = k;
  // plan: sort routes by expert (= by destination rank, then local expert: the send order), exchange the counts
  saved.route_of_slot = alloc_rows<int>(R, Mem::Dispatch, "ep_moe.route_of_slot");
  saved.slot_of_route = alloc_rows<int>(R, Mem::Dispatch, "ep_moe.slot_of_route");
  std::vector<int> routes_per_expert = moe_route_plan(saved.route_of_slot, saved.slot_of_route, topk_idx, R, E, stream);
  std::vector<long long> sent_per_expert(routes_per_expert.begin(), routes_per_expert.end());
  std::vector<long long> received_per_source_expert = all_to_all_host(ep, sent_per_expert, E_l, stream);
  saved.plan = ep_plan(routes_per_expert, received_per_source_expert, ep.size);
  const GroupWeights w{expert_slices(W13_local, E_l, (size_t)2 * I * H), expert_slices(W2_local, E_l, (size_t)H * I)};
  ep_moe_forward_planned(out, saved, x, topk_w, w, ep, "ep_moe_forward", stream);
}

// dx [N,H] (=), dtopk_w [N,k] (=), dW13_local [E_l,2I,H] (+=), dW2_local [E_l,H,I] (+=) from dout
// [N,H] and the forward's saved state. Collective over `ep` (the forward's group). Does not synchronise.
inline void ep_moe_backward(floatX* dx, float* dtopk_w, floatX* dW13_local, floatX* dW2_local, const floatX* dout,
                            const EPSaved& saved, const float* topk_w, const floatX* W13_local, const floatX* W2_local,
                            const Comm& ep, cudaStream_t stream) {
  const int E_l = saved.plan.groups, H = saved.H, I = saved.I;
  const GroupWeights w{expert_slices(W13_local, E_l, (size_t)2 * I * H), expert_slices(W2_local, E_l, (size_t)H * I)};
  const GroupGrads grads{expert_slices(dW13_local, E_l, (size_t)2 * I * H), expert_slices(dW2_local, E_l, (size_t)H * I)};
  ep_moe_backward_planned(dx, dtopk_w, grads, dout, saved, topk_w, w, ep, "ep_moe_backward", stream);
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
  DispatchBound live_bound(int N) const override {
    return ep_moe_live_bound(N, H, I, E / group.size, k, group.size, sizeof(floatX));
  }
};
