// seams.cuh — the other half of the seams' registries (config.hpp: moe_choices, head_choices,
// optimizer_choices name each choice, what it needs, its flags and their checks): each choice's
// factory, by its name, and the rows it adds to the start-up table; the settings the factories read
// (Seams) and how they come from the flags (seams_from). model.cuh makes its seams here (make_dispatcher,
// make_head, model_make_seams); tools/bench_ep_moe makes its dispatchers here. notes/seams.md: the
// contract of each seam and what a new choice takes.
#pragma once
#include <algorithm>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "config.hpp"
#include "ops/adamw.cuh"
#include "ops/cross_entropy.cuh"
#include "ops/ep_moe.cuh"
#include "ops/moe.cuh"
#include "ops/offload_adamw.cuh"
#include "ops/pipelined_llep.cuh"
#include "ops/relay_moe.cuh"
#include "ops/ring_dtp.cuh"
#include "runtime/comm.cuh"

// The seams' choices (--moe, --head, --optimizer, --offload_budget); moe "" = local at E_p = 1, else ep.
// The llep settings serve llep and pllep, the token budget local and pllep (0: the dispatcher's default), the
// chunk ceiling pllep, relay_mode relay, the bucket offload_adamw and
// cpu_adamw, the slots offload_adamw, the offload budget (host bytes for layer boundaries, 0 = none) SCO;
// attention_groups (G) how many groups of heads a layer's attention takes one after another (model.cuh).
struct Seams {
  std::string moe, head = "full", optimizer = "adamw";
  std::string ring_dtp = "auto";
  int vocab_block = 4096;
  double llep_alpha = 1.0;
  long long llep_min_rows = 32;
  int token_budget = 0, kmax = 10;
  int offload_bucket = 1 << 22, offload_slots = 2;
  long long offload_budget = 0;
  RelayMode relay_mode = RelayMode::Expert;  // relay: what travels the ring (auto resolved by relay_choice)
  bool wgrad_stream = true;  // the weight gradients on a stream of their own beside the backward (Model::wgrad)
  int attention_groups = 1;
};

// --moe relay's mode and both per-hop volumes, from sizes every rank knows: N = batch·seq_len tokens
// per rank of a training micro-batch, E_l = E/E_p experts per partition, fp32 output accumulators.
inline RelayChoice relay_choice(const TrainConfig& t, const ModelConfig& c) {
  const int ep = t.ep ? t.ep : t.gpus;
  return relay_choose(t.relay_mode, (long long)t.batch * c.seq_len, c.hidden, c.expert_dim, c.experts / ep, c.topk,
                      sizeof(floatX), sizeof(float));
}

inline Seams seams_from(const TrainConfig& t, const ModelConfig& c) {
  return Seams{moe_dispatcher(t), t.head,           t.optimizer,     t.ring_dtp,       t.vocab_block,  t.llep_alpha,
               t.llep_min_rows,   t.token_budget,   t.kmax,          t.offload_bucket, t.offload_slots, t.offload_budget,
               moe_dispatcher(t) == "relay" ? relay_choice(t, c).mode : RelayMode::Expert,
               t.wgrad_stream != 0, t.attention_groups};
}

// The seams' factories: the other half of config.hpp's registries, one line per registered choice,
// by its name. Each makes the choice's object from the model's sizes, this rank's groups and the
// settings (Seams) — a dispatcher or a head allocates nothing when made, so that the per-rank
// prediction can ask it for its bounds; an optimizer allocates its state — and gives the rows it adds
// to the start-up table (train.cu; nullptr: none).
using StartupRows = std::vector<std::pair<std::string, std::string>>;

struct DispatcherFactory {
  std::string name;
  std::unique_ptr<MoEDispatcher> (*make)(const ModelConfig& c, const Comm& ep, const Seams& s);
  StartupRows (*rows)(const TrainConfig& t, const ModelConfig& c);
};

struct HeadFactory {
  std::string name;
  std::unique_ptr<OutputHead> (*make)(const Comm& vocab, const Seams& s);
  StartupRows (*rows)(const TrainConfig& t, const ModelConfig& c);
};

struct OptimizerFactory {
  std::string name;
  // the state of this rank's shard (S parameters at the segments), zeroed on `stream`
  std::unique_ptr<Optimizer> (*make)(std::vector<ShardSegment> segments, size_t S, int ranks, const Seams& s,
                                     cudaStream_t stream);  // ranks: W
  size_t (*device_bytes)(const Seams& s, size_t S);  // the state's device bytes for a shard of S parameters
  size_t (*host_bytes)(const Seams& s, size_t S);    // and its pinned host bytes
  StartupRows (*rows)(const TrainConfig& t, const ModelConfig& c);
};

// pllep's token budget c: --token_budget, or PLLEP_TOKEN_BUDGET where it is 0 (not given).
inline int pllep_token_budget(int token_budget) { return token_budget > 0 ? token_budget : PLLEP_TOKEN_BUDGET; }

// llep's settings, which pllep shares.
inline StartupRows llep_rows(const TrainConfig& t, const ModelConfig&) {
  return {{"llep alpha/min_rows", std::to_string(t.llep_alpha).substr(0, 5) + " / " + std::to_string(t.llep_min_rows)}};
}

inline const std::vector<DispatcherFactory>& dispatcher_factories() {
  using Made = std::unique_ptr<MoEDispatcher>;
  static const std::vector<DispatcherFactory> factories = {
      {"local",
       [](const ModelConfig& c, const Comm&, const Seams& s) -> Made {
         return std::make_unique<LocalDispatcher>(c.hidden, c.expert_dim, c.experts, c.topk, s.token_budget);
       },
       [](const TrainConfig& t, const ModelConfig& c) {  // the chunks of a training micro-batch, when there is a budget
         if (t.token_budget == 0) return StartupRows{};
         const TokenChunks chunks = token_chunks(t.batch * c.seq_len, t.token_budget);
         return StartupRows{{"local c/K", std::to_string(t.token_budget) + " / " + std::to_string(chunks.count) + " (" +
                                              std::to_string(chunks.size) + " tokens a chunk)"}};
       }},
      {"ep",
       [](const ModelConfig& c, const Comm& ep, const Seams&) -> Made {
         return std::make_unique<EPDispatcher>(c.hidden, c.expert_dim, c.experts, c.topk, ep);
       },
       nullptr},
      {"llep",
       [](const ModelConfig& c, const Comm& ep, const Seams& s) -> Made {
         return std::make_unique<LLEPDispatcher>(c.hidden, c.expert_dim, c.experts, c.topk, ep, s.llep_alpha, s.llep_min_rows);
       },
       llep_rows},
      {"pllep",
       [](const ModelConfig& c, const Comm& ep, const Seams& s) -> Made {
         return std::make_unique<PLLEPDispatcher>(c.hidden, c.expert_dim, c.experts, c.topk, ep, pllep_token_budget(s.token_budget), s.kmax,
                                                  s.llep_alpha, s.llep_min_rows);
       },
       [](const TrainConfig& t, const ModelConfig& c) {
         StartupRows rows = llep_rows(t, c);
         rows.push_back({"pllep c/K_max", std::to_string(pllep_token_budget(t.token_budget)) + " / " + std::to_string(t.kmax)});
         return rows;
       }},
      {"relay",
       [](const ModelConfig& c, const Comm& ep, const Seams& s) -> Made {
         return std::make_unique<RelayDispatcher>(c.hidden, c.expert_dim, c.experts, c.topk, ep, s.relay_mode);
       },
       [](const TrainConfig& t, const ModelConfig& c) {  // the mode and both per-hop volumes, from sizes every rank knows
         const RelayChoice relay = relay_choice(t, c);
         char hop[64];
         snprintf(hop, sizeof hop, "%.2f / %.2f MiB", relay.expert_bytes / 1048576.0, relay.token_bytes / 1048576.0);
         return StartupRows{{"relay E_p / moves", std::to_string(t.ep ? t.ep : t.gpus) + " / " +
                                                      relay_mode_name(relay.mode) + " (" + t.relay_mode + ")"},
                            {"hop experts / tokens", hop}};
       }}};
  return factories;
}

inline const std::vector<HeadFactory>& head_factories() {
  using Made = std::unique_ptr<OutputHead>;
  static const std::vector<HeadFactory> factories = {
      {"full", [](const Comm&, const Seams&) -> Made { return std::make_unique<FullHead>(); }, nullptr},
      {"chunked", [](const Comm&, const Seams& s) -> Made { return std::make_unique<FullHead>(s.vocab_block); },
       [](const TrainConfig& t, const ModelConfig& c) {
         const int N = t.batch * c.seq_len;
         return StartupRows{{"head block", std::to_string(head_block_rows(N, c.vocab, 1, t.vocab_block)) + " of " +
                                               std::to_string(N) + " rows (--vocab_block " + std::to_string(t.vocab_block) + ")"}};
       }},
      {"ring_dtp",
       [](const Comm& vocab, const Seams& s) -> Made { return std::make_unique<RingDTPHead>(vocab, s.ring_dtp, s.vocab_block); },
       [](const TrainConfig& t, const ModelConfig& c) {  // the branches and both per-hop volumes, from sizes every rank knows
         const int P = vocab_group_size(t);
         const long long N = (long long)t.batch * c.seq_len;
         const RingDTPChoice train = ring_dtp_choose(t.ring_dtp, N, c.vocab, P, c.hidden, sizeof(floatX), true);
         const RingDTPChoice ring = ring_dtp_choose(t.ring_dtp, N, c.vocab, P, c.hidden, sizeof(floatX), false);
         char hop[64];
         snprintf(hop, sizeof hop, "%.2f / %.2f MiB", ring.weight_bytes / 1048576.0, ring.activation_bytes / 1048576.0);
         return StartupRows{{"ring_dtp P / moves",
                             std::to_string(P) + " / " + ring_dtp_branch_name(train.branch) + " (training), " +
                                 ring_dtp_branch_name(ring.branch) + " (validation) (" + t.ring_dtp + ")"},
                            {"hop weights / acts", hop},
                            {"vocab block", std::to_string(t.vocab_block) + " columns"}};
       }}};
  return factories;
}

inline const std::vector<OptimizerFactory>& optimizer_factories() {
  using Made = std::unique_ptr<Optimizer>;
  static const std::vector<OptimizerFactory> factories = {
      {"adamw",
       [](std::vector<ShardSegment> segments, size_t S, int, const Seams&, cudaStream_t stream) -> Made {
         return std::make_unique<DeviceAdamW>(std::move(segments), S, stream);
       },
       [](const Seams&, size_t S) { return DeviceAdamW::device_bytes(S); }, [](const Seams&, size_t) { return (size_t)0; },
       nullptr},
      {"cpu_adamw",
       [](std::vector<ShardSegment> segments, size_t S, int ranks, const Seams& s, cudaStream_t stream) -> Made {
         const int threads = std::max(1, (int)std::thread::hardware_concurrency() / ranks);  // the node's cores shared by its W ranks
         return std::make_unique<CpuAdamW>(std::move(segments), S, threads, (size_t)s.offload_bucket, stream);
       },
       [](const Seams&, size_t) { return (size_t)0; }, [](const Seams&, size_t S) { return CpuAdamW::host_bytes_for(S); },
       [](const TrainConfig& t, const ModelConfig&) {
         return StartupRows{{"cpu_adamw chunk", std::to_string(t.offload_bucket) + " parameters"}};
       }},
      {"offload_adamw",
       [](std::vector<ShardSegment> segments, size_t S, int, const Seams& s, cudaStream_t stream) -> Made {
         return std::make_unique<OffloadAdamW>(std::move(segments), S, (size_t)s.offload_bucket, s.offload_slots, stream);
       },
       [](const Seams& s, size_t S) { return OffloadAdamW::device_bytes(S, (size_t)s.offload_bucket, s.offload_slots); },
       [](const Seams&, size_t S) { return OffloadAdamW::host_bytes_for(S); },
       [](const TrainConfig& t, const ModelConfig&) {
         return StartupRows{{"offload beta/slots", std::to_string(t.offload_bucket) + " / " + std::to_string(t.offload_slots)}};
       }}};
  return factories;
}

// The factory of a registered choice; a name registered without one is refused naming both halves.
template <typename Factory>
const Factory& factory_of(const std::vector<Factory>& factories, const char* flag, const std::string& name) {
  for (const Factory& f : factories)
    if (f.name == name) return f;
  fm_fail("model_create", (std::string(flag) + " " + name + " has no factory in seams.cuh (config.hpp registers the choices)").c_str(),
          "factories=%zu", factories.size());
}

// The rows the chosen dispatcher, head and optimizer add to the start-up table (train.cu).
inline StartupRows seam_startup_rows(const TrainConfig& t, const ModelConfig& c) {
  StartupRows rows;
  for (StartupRows (*seam_rows)(const TrainConfig&, const ModelConfig&) :
       {factory_of(dispatcher_factories(), "--moe", moe_dispatcher(t)).rows, factory_of(head_factories(), "--head", t.head).rows,
        factory_of(optimizer_factories(), "--optimizer", t.optimizer).rows})
    if (seam_rows != nullptr)
      for (const auto& row : seam_rows(t, c)) rows.push_back(row);
  return rows;
}
