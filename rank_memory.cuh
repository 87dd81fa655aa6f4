// rank_memory.cuh — the trainer's per-rank memory plan, decided before the model allocates anything
// (notes/design.md §6.9): the prediction (model.cuh, Eq. 6) against this rank's GPU as it is, or
// against --device_capacity for --dry_run 1 without a GPU; the attention that --device_budget keeps;
// and --plan auto's choice of settings (plan.hpp's search with the real prediction). train.cu calls it.
#pragma once
#include <unistd.h>
#include <cmath>
#include <string>
#include <vector>
#include "model.cuh"
#include "plan.hpp"

// Dense peak of the GPU's matrix units for MFU: H100/H200 SXM datasheet (dense bf16 989 TFLOP/s,
// fp32 67 TFLOP/s). MFU = flops_per_token · tokens/s / peak.
inline double peak_flops_for_build() { return sizeof(floatX) == 2 ? 989e12 : 67e12; }

// The per-rank memory plan, decided before the model allocates anything: the prediction of the pool's
// peak (model.cuh, Eq. 6), what the device holds outside the pool so far (the CUDA context, the
// communicators, the cuBLAS handle: runtime/pool.cuh's ledger) and its capacity; under --device_budget,
// the attention tensors that the budget leaves room to keep (ops/sar_plan.hpp). Refuses what cannot fit.
// The check sets the live bytes beside the device; the pool holds each block rounded up to its size class,
// at most 2 MiB more from 32 MiB up (runtime/pool.cuh round_size), which the check does not add (the
// trainer's first step prints its blocks as held beside its pool peak).
// With ranks sharing the GPU (--share_gpus 1) its capacity is theirs together: `ranks_on_gpu` pools of the
// predicted peak beside what the device holds outside the pools (every rank's context and communicators).
struct RankMemoryPlan {
  MemoryPrediction predicted;
  SarPlan attention_kept;
  long long outside = 0, capacity = 0, budget = 0;  // budget: --device_budget in bytes (0: none)
  int ranks_on_gpu = 1;
  bool on_gpu = true;  // outside and capacity measured; false: no GPU, capacity from --device_capacity
};

// The plan from the prediction alone (host arithmetic), against a device of `capacity` bytes that
// holds `outside` bytes outside the pool and is shared by `ranks_on_gpu` ranks.
inline RankMemoryPlan plan_memory(const ModelConfig& c, const TrainConfig& t, const Parallel& par, int B, int T,
                                  long long capacity, long long outside, int ranks_on_gpu) {
  RankMemoryPlan plan;
  plan.outside = outside;
  plan.capacity = capacity;
  plan.ranks_on_gpu = ranks_on_gpu;
  const DeviceBudget device_budget = parse_device_budget(t.device_budget);
  const auto mib = [](long long x) { return std::to_string((long long)std::llround(x / 1048576.0)) + " MiB"; };
  if (device_budget.on())
    plan.budget = device_budget.bytes > 0
                      ? device_budget.bytes
                      : ((long long)(device_budget.fraction * plan.capacity) - plan.outside) / plan.ranks_on_gpu;
  const RankUse use = rank_use(c, t, par, B, T, plan.budget);
  plan.predicted = use.device;
  plan.attention_kept = use.attention_kept;
  if (device_budget.on() && (long long)plan.predicted.total() > plan.budget)
    throw std::invalid_argument("--device_budget " + t.device_budget + " (" + mib(plan.budget) +
                                " for the pool) is below the predicted peak under full recomputation, " +
                                mib(plan.predicted.total()) + " (" + plan.predicted.describe() + ")");
  const long long pools = (long long)plan.predicted.total() * plan.ranks_on_gpu;
  if (pools + plan.outside > plan.capacity)
    throw std::invalid_argument(
        "this configuration cannot fit on the GPU: " +
        (plan.ranks_on_gpu > 1 ? "the " + std::to_string(plan.ranks_on_gpu) + " ranks sharing it need " +
                                     std::to_string(plan.ranks_on_gpu) + " x " : std::string()) +
        "the pool's predicted peak " + mib(plan.predicted.total()) + " at " + plan.predicted.peak_at + " (" +
        plan.predicted.describe() + ") + " + mib(plan.outside) + " outside the pool" +
        (plan.ranks_on_gpu > 1 ? "s (every rank's context and communicators) = " + mib(pools + plan.outside) : "") +
        " > the device's " + mib(plan.capacity) +
        " (try --recompute 1, --offload_budget, a smaller --batch, --moe pllep, --head chunked" +
        (plan.ranks_on_gpu > 1 ? " or fewer ranks per GPU)" : ")"));
  return plan;
}

// This rank's GPU: its capacity and what it holds outside the pool so far, measured.
struct DeviceNow {
  long long capacity = 0, outside = 0;
};
inline DeviceNow device_now() {
  size_t free_b = 0, total_b = 0;
  cudaCheck(cudaMemGetInfo(&free_b, &total_b), "train", "meminfo");
  const DeviceMemoryNow now = device_memory_now();
  return DeviceNow{(long long)total_b, now.used - now.reserved};
}

// The GPU as every rank of `world` plans with it, before any allocates its model: the smallest capacity and
// the most outside a pool. Ranks sharing a GPU (`sharing`: ranks_sharing_this_gpu) see each other's memory,
// so each measures once all have come this far (their contexts, communicators and cuBLAS handles made: an
// exchange) and takes from the GPU's used bytes every pool on it, its own and those of the ranks beside it
// (the next exchange, of the reservations as measured); none allocates until all have measured (the last
// exchanges). So the GPU's dry run and a real step see the same outside, whichever rank is quicker.
inline DeviceNow device_now_agreed(const Comm& world, const std::vector<bool>& sharing) {
  if (world.size == 1) return device_now();
  max_over_ranks(world, 0);  // every rank has come this far (and the exchanges below reuse its buffers)
  const DeviceNow now = device_now();
  const long long reserved = (long long)pool().reserved();
  const std::vector<long long> pools = all_gather_host(world, &reserved, 1, "device_now_agreed");
  long long beside = 0;  // the pools of the other ranks on this GPU
  for (int r = 0; r < world.size; r++)
    if (sharing[r] && r != world.rank) beside += pools[r];
  return DeviceNow{-max_over_ranks(world, -now.capacity), max_over_ranks(world, now.outside - beside)};
}

// The group sizes of rank 0 of `world` ranks as parallel_init makes them, without a communicator: what
// the prediction reads of a Parallel (--dry_run 1 without a GPU).
inline Parallel parallel_shape(int world, int ep_size, int vocab_size, int seq_size, int zero = 1) {
  Parallel par;
  par.zero = zero;
  par.dense.size = zero == 3 ? world : 1;
  par.seq.size = seq_size;
  par.world.size = world;
  par.ep.size = ep_size;
  par.expert_replicas.size = world / ep_size;
  par.vocab.size = vocab_size;
  par.vocab_replicas.size = vocab_size > 1 ? world / vocab_size : 1;
  return par;
}

// --dry_run 1 without a GPU: the device's capacity, from --device_capacity (refused when missing).
inline long long capacity_without_gpu(const TrainConfig& t) {
  if (t.device_capacity.empty())
    throw std::invalid_argument("--dry_run 1: this machine has no GPU to take the memory from: give the GPU's "
                                "with --device_capacity (bytes, or with a unit such as 80GiB)");
  return parse_device_capacity(t.device_capacity);
}
// The group sizes of the run that the flags describe.
inline Parallel parallel_shape_of(const TrainConfig& t) {
  return parallel_shape(t.gpus, t.ep ? t.ep : t.gpus, vocab_group_size(t), t.sp, t.zero);
}

// --dry_run 1 on a machine without a GPU: rank 0's plan of a run of `t.gpus` ranks against
// --device_capacity (nothing outside the pool is measured: there is no device); with --share_gpus 1,
// all of them on one device of that capacity. Refuses a missing --device_capacity, and what cannot fit.
inline RankMemoryPlan plan_memory_without_gpu(const ModelConfig& c, const TrainConfig& t) {
  RankMemoryPlan plan = plan_memory(c, t, parallel_shape_of(t), t.batch, c.seq_len / t.sp, capacity_without_gpu(t), 0,
                                    t.share_gpus ? t.gpus : 1);
  plan.on_gpu = false;
  return plan;
}

inline void print_memory_plan(const RankMemoryPlan& plan, const ModelConfig& c) {
  if (plan.on_gpu)
    printf("memory prediction (Eq. 6, rank 0): pool peak %.1f MiB at %s = %s; outside the pool %.1f MiB (measured); "
           "device %.1f MiB%s\n",
           plan.predicted.total() / 1048576.0, plan.predicted.peak_at.c_str(), plan.predicted.describe().c_str(),
           plan.outside / 1048576.0, plan.capacity / 1048576.0,
           plan.ranks_on_gpu > 1 ? (", shared by " + std::to_string(plan.ranks_on_gpu) + " ranks: " +
                                    std::to_string(plan.ranks_on_gpu) + " pools + outside = " +
                                    std::to_string((long long)std::llround(
                                        (plan.predicted.total() * (double)plan.ranks_on_gpu + plan.outside) / 1048576.0)) +
                                    " MiB").c_str()
                                  : "");
  else
    printf("memory prediction (Eq. 6, rank 0): pool peak %.1f MiB at %s = %s; outside the pool not measured (no GPU: "
           "the CUDA context, communicators and cuBLAS take some hundreds of MiB more per rank); device %.1f MiB "
           "(--device_capacity)%s\n",
           plan.predicted.total() / 1048576.0, plan.predicted.peak_at.c_str(), plan.predicted.describe().c_str(),
           plan.capacity / 1048576.0,
           plan.ranks_on_gpu > 1 ? (", shared by " + std::to_string(plan.ranks_on_gpu) + " ranks (--share_gpus 1): " +
                                    std::to_string((long long)std::llround(plan.predicted.total() *
                                                                           (double)plan.ranks_on_gpu / 1048576.0)) +
                                    " MiB of pools")
                                       .c_str()
                                 : "");
  if (plan.budget == 0) return;
  int core = 0, projection = 0;
  for (const SarChoice& x : plan.attention_kept.taken) (x.option == SarOption::Core ? core : projection)++;
  printf("selective attention recomputation: --device_budget %.1f MiB for the pool keeps %d core and %d projection "
         "options of %d layers (%.1f MiB), %.0f %% of the attention recomputation's FLOPs saved\n",
         plan.budget / 1048576.0, core, projection, c.layers, plan.attention_kept.bytes / 1048576.0,
         100 * plan.attention_kept.flops_saved / plan.attention_kept.flops_recomputed);
}

// --plan auto (plan.hpp): the fastest setting that fits the pool — the device's capacity less what lies
// outside the pool and 5 % of the capacity as a margin, shared by the ranks on the GPU; or the
// --device_budget the user gave — and its share of 80 % of the host's memory (W ranks on the node). The
// step-time estimate takes 40 % of the build's peak for the GEMMs and 55 GB/s each way for the host link
// (an H200's pinned copies). Prints the choice (when `print`) as the command that trains with it
// (without --plan, --dry_run and --device_capacity), with each term of its prediction; refuses, naming
// the largest term, when nothing fits. Every rank must choose alike: the caller gives every rank the
// same inputs (rank 0's shape, the smallest capacity, the most outside a pool).
inline TrainConfig apply_plan_auto(const ModelConfig& c, const TrainConfig& t, const std::vector<std::string>& given_flags,
                                   const Parallel& par, int B, int T, int accum, long long capacity, long long outside,
                                   int ranks_on_gpu, bool print, int argc, char** argv) {
  PlanLimits limits;
  const DeviceBudget device_budget = parse_device_budget(t.device_budget);
  limits.device = device_budget.bytes > 0 ? device_budget.bytes
                                          : ((long long)((device_budget.on() ? device_budget.fraction : 0.95) * capacity) -
                                             outside) / ranks_on_gpu;
  limits.host = (long long)(0.8 * (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGESIZE)) / par.world.size;
  limits.gemm_flops = 0.4 * peak_flops_for_build();
  limits.link_bytes_per_s = 55e9;
  const PlanResult result = plan_auto(c, t, given_flags, B, T, accum, sizeof(floatX), limits, [&](const TrainConfig& s) {
    return rank_use(c, s, par, B, T, parse_device_budget(s.device_budget).bytes);
  });
  if (!result.fits) throw std::invalid_argument(result.refusal);
  const PlanChoice& chosen = result.chosen;
  if (print) {
    std::string command = argv[0];  // without --plan and a dry run's flags
    for (int i = 1; i < argc; i++) {
      const std::string flag = argv[i];
      if (flag == "--plan" || flag == "--dry_run" || flag == "--device_capacity") i++;  // and its value
      else command += " " + flag;
    }
    printf("--plan auto: %d settings predicted; the fastest that fits (estimated %.1f ms per step) is\n  %s %s\n"
           "  pool peak %.1f MiB of %.1f MiB at %s = %s; pinned host %.1f MiB of %.1f MiB\n",
           result.settings, 1e3 * chosen.seconds, command.c_str(), plan_flags(t, chosen.train).c_str(),
           chosen.use.device.total() / 1048576.0, limits.device / 1048576.0, chosen.use.device.peak_at.c_str(),
           chosen.use.device.describe().c_str(), chosen.use.host / 1048576.0, limits.host / 1048576.0);
  }
  validate(chosen.train, c);
  return chosen.train;
}
