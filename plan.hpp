// plan.hpp — what the per-rank memory prediction says (MemoryPrediction; model.cuh's
// predict_rank_memory computes it, paper Eq. 6) and --plan auto: the settings a run should take so
// that it fits its GPU and host, the fastest that fit. Plain C++ (no CUDA), so that the CPU tests drive
// the search with made-up predictions (tests/cpu_plan.cpp); train.cu gives it the real prediction.
//
// The settings searched, each unless the user gave its flag (then only the given value):
//   --recompute 0|1 (layer-level recomputation), with --device_budget set to the pool's budget so that
//     selective attention recomputation keeps what fits (ops/sar_plan.hpp);
//   --offload_budget: SCO's boundaries in pinned host memory, 0..L of them (under --recompute 1);
//   --attention_groups 1 | nh: attention whole, or one head at a time with its projection rebuilt in the backward
//     (model.cuh; whole sequences on the rank only, and then without kept attention: --device_budget 0);
//   --head full | chunked with --vocab_block 8192, 4096, 2048, 1024 (one rank of the vocabulary);
//   --optimizer adamw | offload_adamw (β = 2^22, 2 slots) | cpu_adamw;
//   the MoE, the outermost choice: on one rank of the experts (--moe local), --token_budget (the routed
//     experts in chunks, ops/moe.cuh's LocalDispatcher): none, or 16384, 8192, 4096, 2048, 1024, 512 tokens
//     (below the rank's B·T); across ranks (an expert group), the dispatcher given (ep unless --moe says),
//     then --moe pllep at --token_budget 4096, 2048, 1024, 512 (below B·T; PipelinedLLEP's receive bound,
//     ops/pipelined_llep.cuh; --kmax raised to the ⌈B·T / c⌉ chunks the budget needs, unless given), then --moe relay --relay_mode expert and token (RelayMoE's ring: one partition
//     or one rank's tokens at a time, ops/relay_moe.cuh). --moe given: its token budgets alone (pllep).
// A setting fits when the prediction's pool peak is within the device budget and its pinned host bytes
// within the host budget. Among those that fit it takes the one of the smallest estimated step time
// (plan_step_seconds), the first in the order above on a tie: the FLOPs the step computes at the GPU's
// GEMM rate, plus what each memory saver adds —
//   recomputation: the layers' forward once more (flops_per_token less the head's, a third of it),
//     less the attention FLOPs that kept tensors save;
//   the chunked head: the logits' GEMM once more in the backward (2·N·V·H per micro-batch);
//   SCO: 2 % of the step per L offloaded boundaries (paper: < 2 %, the copies hidden behind compute);
//   attention in head groups: the q, k, v projection once more (2·N·H·3H a layer);
//   offload_adamw: 12 bytes per parameter of the shard each way over the host link (notes/design.md
//     §6.7's floor); cpu_adamw: 2.05 times that (paper: OffloadStreamAdamW 2.05x faster than CPU Adam);
//   the local token budget (in more than one chunk), pllep and relay: the routed experts' forward GEMMs
//     once more in the backward (each chunk's or hop's), 6·N·k·H·I per MoE layer, and under the local
//     budget the dense FFNs' and the shared expert's too (6·N·H·I_d a layer: they run in the same chunks) — but under
//     recomputation, whose recomputed layers then skip them (the same FLOPs: a tie, which the unchunked
//     setting wins by coming first). The exchanges are not in the estimate: among dispatchers of the same
//     FLOPs, the order above decides (ep's one exchange each way first; pllep's K; relay's E_p hops).
// Nothing fits: the refusal names the largest term of the most frugal setting's prediction.
#pragma once
#include <algorithm>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>
#include "config.hpp"
#include "ops/sar_plan.hpp"

struct MemoryTerm {
  std::string name;
  size_t bytes;
};

struct MemoryPrediction {
  std::vector<MemoryTerm> terms;  // at the predicted peak
  std::string peak_at;            // "the output head" or "layer l's backward"
  size_t total() const {
    size_t t = 0;
    for (const MemoryTerm& x : terms) t += x.bytes;
    return t;
  }
  std::string describe() const {
    std::string text;
    char buf[160];
    for (const MemoryTerm& x : terms) {
      if (x.bytes == 0) continue;
      snprintf(buf, sizeof buf, "%s%s %.1f MiB", text.empty() ? "" : " + ", x.name.c_str(), x.bytes / 1048576.0);
      text += buf;
    }
    return text;
  }
  const MemoryTerm& largest() const {
    return *std::max_element(terms.begin(), terms.end(),
                             [](const MemoryTerm& a, const MemoryTerm& b) { return a.bytes < b.bytes; });
  }
};

// One setting's memory on a rank, from the trainer's prediction.
struct RankUse {
  MemoryPrediction device;  // the pool's peak, with the attention that --device_budget keeps
  size_t host = 0;          // pinned host bytes: SCO's boundaries and the optimizer's offloaded state
  size_t shard = 0;         // S: the rank's parameters of the optimizer's shard
  SarPlan attention_kept;   // what --device_budget keeps (empty without recomputation)
};
using RankUsePredictor = std::function<RankUse(const TrainConfig&)>;

struct PlanLimits {
  long long device = 0;           // the pool's bytes per rank
  long long host = 0;             // pinned host bytes per rank
  double gemm_flops = 0;          // the GPU's sustained GEMM rate (FLOP/s)
  double link_bytes_per_s = 0;    // the host link, one way (both ways run at once)
};

struct PlanChoice {
  TrainConfig train;
  RankUse use;
  double seconds = 0;  // the estimated step time (plan_step_seconds)
};

struct PlanResult {
  bool fits = false;
  PlanChoice chosen;    // fits: the fastest that fits; else the one of the smallest pool peak, for the refusal
  int settings = 0;     // how many settings were predicted
  std::string refusal;  // !fits: why, naming the largest term
};

// Whether setting `t` runs the local dispatcher's routed experts in more than one chunk of its N tokens.
inline bool local_chunked(const TrainConfig& t, long long N) {
  return moe_dispatcher(t) == "local" && t.token_budget > 0 && N > t.token_budget;
}

// Whether setting `t`'s backward computes the routed experts' forward again (the header's cost model):
// the local MoE in chunks, pllep's chunks, relay's hops.
inline bool experts_forward_again(const TrainConfig& t, long long N) {
  const std::string moe = moe_dispatcher(t);
  return local_chunked(t, N) || moe == "pllep" || moe == "relay";
}

// The estimated step time of setting `t` (the header's cost model); B, T, accum: one rank's batch; b:
// bytes per activation.
inline double plan_step_seconds(const ModelConfig& c, const TrainConfig& t, const RankUse& use, const PlanLimits& limits,
                                int B, int T, int accum, size_t b) {
  const double N = (double)B * T, head = 6.0 * c.vocab * (double)c.hidden;  // the head's FLOPs per token
  double flops = flops_per_token(c) * N;
  if (t.recompute) flops += (flops_per_token(c) - head) / 3 * N - use.attention_kept.flops_saved;
  if (t.head == "chunked") flops += 2.0 * N * c.vocab * c.hidden;
  if (t.attention_groups > 1) flops += 6.0 * N * c.hidden * (double)c.hidden * c.layers;
  if (experts_forward_again(t, (long long)N) && !t.recompute)
    flops += 6.0 * N * c.topk * c.hidden * (double)c.expert_dim * (c.layers - c.n_dense);
  if (local_chunked(t, (long long)N) && !t.recompute)  // the dense FFNs and the shared experts in the same chunks
    flops += 6.0 * N * c.hidden *
             ((double)c.dense_dim * c.n_dense + (c.shared_expert ? (double)c.expert_dim * (c.layers - c.n_dense) : 0));
  double seconds = flops * accum / limits.gemm_flops;
  const double base = seconds;
  if (t.recompute && t.offload_budget > 0) {
    const long long boundary = (long long)N * c.hidden * (long long)b;
    const long long offloaded = std::min<long long>(c.layers, t.offload_budget / boundary);
    seconds += 0.02 * base * offloaded / c.layers;
  }
  const double optimizer_link = 12.0 * use.shard / limits.link_bytes_per_s;
  if (t.optimizer == "offload_adamw") seconds += optimizer_link;
  if (t.optimizer == "cpu_adamw") seconds += 2.05 * optimizer_link;
  return seconds;
}

// The settings of `given` to search (see the header), those whose flag is in `explicit_flags` fixed.
inline std::vector<TrainConfig> plan_settings(const ModelConfig& c, const TrainConfig& given,
                                              const std::vector<std::string>& explicit_flags, int B, int T, size_t b,
                                              long long device_budget) {
  auto fixed = [&](const char* flag) {
    return std::find(explicit_flags.begin(), explicit_flags.end(), flag) != explicit_flags.end();
  };
  std::vector<int> recompute = {0, 1};
  if (fixed("--recompute")) recompute = {given.recompute};
  std::vector<std::pair<std::string, int>> heads = {{"full", given.vocab_block}};
  for (int block : {8192, 4096, 2048, 1024})
    if (block < c.vocab) heads.push_back({"chunked", block});
  if (fixed("--head") || fixed("--vocab_block") || vocab_group_size(given) > 1) heads = {{given.head, given.vocab_block}};
  std::vector<std::pair<std::string, int>> optimizers = {{"adamw", given.offload_bucket},
                                                         {"offload_adamw", 1 << 22},
                                                         {"cpu_adamw", 1 << 22}};
  if (fixed("--optimizer") || fixed("--offload_bucket")) optimizers = {{given.optimizer, given.offload_bucket}};
  struct MoESetting {
    std::string moe, relay_mode;
    int token_budget, kmax;
  };
  std::vector<MoESetting> moes = {{given.moe, given.relay_mode, given.token_budget, given.kmax}};
  auto budgets_of = [&](const std::string& moe, std::initializer_list<int> budgets) {
    for (int budget : budgets) {
      const long long chunks = ((long long)B * T + budget - 1) / budget;
      const int kmax = moe == "pllep" && !fixed("--kmax") ? (int)std::max<long long>(given.kmax, chunks) : given.kmax;
      if (budget < (long long)B * T) moes.push_back({moe, "auto", budget, kmax});
    }
  };
  const std::string dispatcher = moe_dispatcher(given);
  const SeamChoice* choice = find_choice(moe_choices(), dispatcher);
  const bool across_ranks = choice != nullptr && choice->needs == SeamNeeds::ExpertGroup;
  if (!fixed("--token_budget") && dispatcher == "local") budgets_of(given.moe, {16384, 8192, 4096, 2048, 1024, 512});
  if (!fixed("--token_budget") && dispatcher == "pllep" && fixed("--moe")) budgets_of("pllep", {4096, 2048, 1024, 512});
  if (across_ranks && !fixed("--moe") && !fixed("--token_budget") && !fixed("--relay_mode")) {
    budgets_of("pllep", {4096, 2048, 1024, 512});
    for (const char* mode : {"expert", "token"}) moes.push_back({"relay", mode, 0, given.kmax});
  }
  std::vector<int> attention_groups = {1};
  if (c.heads > 1 && given.sp == 1 && !(fixed("--device_budget") && parse_device_budget(given.device_budget).on()))
    attention_groups.push_back(c.heads);
  if (fixed("--attention_groups")) attention_groups = {given.attention_groups};
  const long long boundary = (long long)B * T * c.hidden * (long long)b;
  std::vector<TrainConfig> settings;
  for (const MoESetting& moe : moes)
    for (int r : recompute)
      for (int groups : attention_groups)
        for (const auto& [head, block] : heads)
          for (const auto& [optimizer, bucket] : optimizers)
            for (int offloaded = 0; offloaded <= (r ? c.layers : 0); offloaded++) {
              if (fixed("--offload_budget") && offloaded > 0) break;
              TrainConfig t = given;
              t.attention_groups = groups;
              t.moe = moe.moe;
              t.relay_mode = moe.relay_mode;
              t.token_budget = moe.token_budget;
              t.kmax = moe.kmax;
              t.recompute = r;
              t.head = head;
              t.vocab_block = block;
              t.optimizer = optimizer;
              t.offload_bucket = bucket;
              if (!fixed("--offload_budget")) t.offload_budget = offloaded * boundary;
              if (!fixed("--device_budget"))
                t.device_budget = r && groups == 1 ? std::to_string(std::max(2LL, device_budget)) : "0";
              settings.push_back(t);
            }
  return settings;
}

// --plan auto (the header): the fastest setting that fits `limits`, or the refusal.
inline PlanResult plan_auto(const ModelConfig& c, const TrainConfig& given, const std::vector<std::string>& explicit_flags,
                            int B, int T, int accum, size_t b, const PlanLimits& limits, const RankUsePredictor& predict) {
  PlanResult result;
  PlanChoice frugal;  // the smallest pool peak of those that do not fit
  for (const TrainConfig& t : plan_settings(c, given, explicit_flags, B, T, b, limits.device)) {
    PlanChoice choice{t, predict(t), 0};
    result.settings++;
    const bool fits = (long long)choice.use.device.total() <= limits.device && (long long)choice.use.host <= limits.host;
    if (!fits) {
      if (frugal.use.device.terms.empty() || choice.use.device.total() < frugal.use.device.total()) frugal = choice;
      continue;
    }
    choice.seconds = plan_step_seconds(c, t, choice.use, limits, B, T, accum, b);
    if (!result.fits || choice.seconds < result.chosen.seconds) result.chosen = choice;
    result.fits = true;
  }
  if (!result.fits) {
    result.chosen = frugal;
    const RankUse& use = frugal.use;
    const MemoryTerm& largest = use.device.largest();
    char buf[512];
    snprintf(buf, sizeof buf,
             "--plan auto: none of %d settings fits: the most frugal needs %.1f MiB of the pool (%.1f MiB "
             "available) and %.1f MiB of pinned host memory (%.1f MiB available); its largest term is %s, "
             "%.1f MiB at %s",
             result.settings, use.device.total() / 1048576.0, limits.device / 1048576.0, use.host / 1048576.0,
             limits.host / 1048576.0, largest.name.c_str(), largest.bytes / 1048576.0, use.device.peak_at.c_str());
    result.refusal = buf;
  }
  return result;
}

// The flags of `chosen` that --plan auto set (those that differ from `given`), as a command line.
inline std::string plan_flags(const TrainConfig& given, const TrainConfig& chosen) {
  const std::vector<std::pair<std::string, std::string>> before = train_flag_values(given), after = train_flag_values(chosen);
  std::string line;
  for (size_t i = 0; i < after.size(); i++)
    if (after[i].second != before[i].second) line += (line.empty() ? "" : " ") + after[i].first + " " + after[i].second;
  return line;
}
