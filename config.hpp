// config.hpp — the model and training configuration, its flags, its validation, and the
// parameter layout shared by the GPU trainer (train.cu), the CPU reference model (ref/model.hpp)
// and the tests. Plain C++17: CPU tests check flag errors without a GPU.
#pragma once
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "data/routing_profile.hpp"
#include "data/routing_trace.hpp"

// The model (notes/design.md §2). Every dimension is a flag.
struct ModelConfig {
  int vocab = 0;          // V: 0 = read from the tokenizer
  int hidden = 384;       // H
  int layers = 6;         // L
  int heads = 6;          // nh (head dim hd = H / nh)
  int experts = 8;        // E
  int topk = 2;           // k
  int expert_dim = 384;   // I: intermediate size of each routed expert
  int n_dense = 0;        // first n_dense layers use a dense SwiGLU FFN instead of MoE
  int dense_dim = 1024;   // intermediate size of the dense FFN layers
  int shared_expert = 0;  // 1: every MoE layer adds a shared SwiGLU expert of size expert_dim
  int seq_len = 256;      // T (also the longest context the model sees)
  int score_fn = 0;       // router scores: 0 softmax, 1 sigmoid
  int renorm = 1;         // 1: combine weights = selected scores / their sum
  float rope_theta = 10000.f;
  float norm_eps = 1e-5f;
  float init_std = 0.02f;

  int head_dim() const { return hidden / heads; }
  bool is_moe_layer(int l) const { return l >= n_dense; }
};

// Training (everything that is not the model).
struct TrainConfig {
  std::string data_dir = "data/fortunes";  // tokenizer.bin, train_*.bin, val_*.bin
  std::string train_pattern;               // default: data_dir/train_*.bin
  std::string val_pattern;                 // default: data_dir/val_*.bin
  std::string tokenizer;                   // default: data_dir/tokenizer.bin
  std::string out_dir = "runs/default";    // checkpoints, logs, memory timeline
  std::string resume;                      // a checkpoint file to resume from
  int batch = 16;                          // B: sequences per micro-batch
  int total_batch = 0;                     // tokens per optimizer step (0 = B·T, no accumulation)
  int steps = 1200;                        // ≈ 6 epochs of the fortunes corpus at B·T = 4096
  float lr = 1e-3f;
  float min_lr_frac = 0.1f;                // cosine decays to lr · min_lr_frac
  int warmup = 100;
  float weight_decay = 0.1f;
  float beta1 = 0.9f, beta2 = 0.95f, adam_eps = 1e-8f;
  float grad_clip = 1.0f;                  // global-norm clip; 0 = off
  float bias_update = 1e-3f;               // u of the aux-loss-free router bias update; 0 = off
  int recompute = 0;                       // 1: layer-level activation checkpointing
  int overlap_update = 1;                  // 1: the optimizer beside the next forward where it can (model.cuh)
  int wgrad_stream = 1;                    // 1: the weight gradients on their own stream beside the backward
  int cuda_graph = 1;                      // 1: a pass captured once as a CUDA graph and launched again where it can
  int val_every = 100;
  int val_batches = 10;                    // at most; capped at the windows the validation shards hold
  int sample_every = 400;
  int sample_len = 128;
  int ckpt_every = 1000;                   // every S steps and at the end; 0 = never
  int log_every = 10;
  int timeline_step = -1;                  // write the pool timeline of this step (CSV + plot)
  int profile_step = -1;                   // print this step's GPU time per operator (runtime/profile.cuh); -1 = none
  int gpus = 1;                            // W: ranks (one process per GPU) started on this node
  int share_gpus = 0;                      // 1: W may exceed the GPUs; ranks share them round-robin (runtime/launch.cuh)
  int ep = 0;                              // E_p: expert-parallel group size (0 = W)
  int sp = 1;                              // D: sequence-parallel group size (Ulysses; 1 = every rank whole sequences)
  int zero = 1;                            // the dense weights' ZeRO stage: 1 (whole on every rank, the update's state
                                           // sharded) or 3 (1/W each, gathered per layer: runtime/zero3.cuh)
  std::string routing = "router";          // "router", or what overrides its choice: "balanced", "hot:r/h", "trace:FILE"
  std::string record_routing;              // a routing trace of the training passes goes to this file ("" = none)
  // Seams (notes/design.md §1.1): which implementation serves each; chosen once, at start-up.
  std::string moe = "";                    // MoE dispatcher: local (E_p = 1) | ep | llep | pllep | relay; "" = local at E_p = 1, else ep
  float llep_alpha = 1.0f;                 // llep, pllep: capacity cap = ⌈α·routes/E_p⌉ per rank (α >= 1)
  int llep_min_rows = 32;                  // llep, pllep: the smallest helper piece (one weight transfer + one GEMM)
  int token_budget = 0;                    // local, pllep: c, tokens per rank per chunk; 0 = the dispatcher's
                                           // default (local: no chunks; pllep: 4096)
  int kmax = 10;                           // pllep: K_max, the most chunks
  std::string relay_mode = "auto";         // relay: what travels the ring: auto | expert | token
  std::string head = "full";               // output head: full (logits [N,V] inside the head) | chunked (the
                                           // full head over blocks of rows, no [N,V]) | ring_dtp (vocabulary
                                           // shards over P ranks, ops/ring_dtp.cuh)
  int vocab_group = 0;                     // ring_dtp: P, ranks of a vocabulary group (contiguous blocks; 0 = W)
  std::string ring_dtp = "auto";           // ring_dtp: auto (fused when training) | fused | weights | activations
  int vocab_block = 4096;                  // ring_dtp: logits columns per block; chunked: a block of N×C logits
  std::string optimizer = "adamw";         // optimizer: adamw (fp32 master weights and moments on the GPU),
                                           // cpu_adamw (on the host, updated by the CPU), offload_adamw (on the
                                           // host, streamed through the GPU in buckets)
  int offload_bucket = 1 << 22;            // offload_adamw, cpu_adamw: β, parameters per bucket (a staging
                                           // slot's; cpu_adamw: a chunk of its copy-update-copy pipeline)
  int offload_slots = 2;                   // offload_adamw: s, staging slots on the GPU (s·β·12 bytes)
  long long offload_budget = 0;            // SCO: host bytes for layer boundaries (--recompute 1); 0 = none
  std::string device_budget = "0";         // selective attention recomputation (--recompute 1): the pool bytes a
                                           // rank may use, or a fraction (0, 1] of the GPU's memory; "0" = off
  int attention_groups = 1;                // G: attention runs on nh/G heads at a time, its projection rebuilt in
                                           // the backward (model.cuh, attention in head groups); 1 = all heads at once
  int dry_run = 0;                         // 1: print the memory prediction (and refuse what cannot fit), then exit
  std::string device_capacity;             // --dry_run 1 on a machine without a GPU: the GPU's memory, bytes
  std::string plan = "off";                // "auto": the memory savers that fit, the fastest (plan.hpp)
                                           // or with a unit (80GiB); "" = none given
  unsigned long long seed = 1337;
};

// ------------------------------------------------------------------------------------------
// Parameter layout: one flat buffer, tensors in this order. Norm weights are not decayed.

struct ParamSpec {
  std::string name;
  size_t rows, cols;  // a [E, R, C] expert stack is rows = E·R
  bool decay;
  bool expert;        // a routed-expert stack: split over the E_p ranks of the expert-parallel group
  bool vocab = false; // rows are vocabulary entries: split over the P ranks of a vocabulary group (Ring-DTP)
  // where the forward first reads it: 0 = the embedding and layer 0, l = layer l, L = the final norm
  // and the head (the order in which the optimizer's update can release the next forward: model.cuh)
  int forward_group = 0;
  size_t numel() const { return rows * cols; }
};

// Order: every tensor that each rank holds whole (dense tensors), then the routed-expert stacks,
// so that the flat buffer has one dense region and one expert region (each sharded for ZeRO-1 over
// the ranks that hold it).
inline std::vector<ParamSpec> param_specs(const ModelConfig& c) {
  const size_t V = c.vocab, H = c.hidden, E = c.experts, I = c.expert_dim, Id = c.dense_dim;
  std::vector<ParamSpec> specs, experts;
  specs.push_back({"wte", V, H, true, false, false, 0});
  for (int l = 0; l < c.layers; l++) {
    std::string p = "layer" + std::to_string(l) + ".";
    specs.push_back({p + "ln1", 1, H, false, false, false, l});
    specs.push_back({p + "wqkv", 3 * H, H, true, false, false, l});
    specs.push_back({p + "wo", H, H, true, false, false, l});
    specs.push_back({p + "ln2", 1, H, false, false, false, l});
    if (!c.is_moe_layer(l)) {
      specs.push_back({p + "dense_w13", 2 * Id, H, true, false, false, l});
      specs.push_back({p + "dense_w2", H, Id, true, false, false, l});
      continue;
    }
    specs.push_back({p + "router", E, H, true, false, false, l});
    if (c.shared_expert) {
      specs.push_back({p + "shared_w13", 2 * I, H, true, false, false, l});
      specs.push_back({p + "shared_w2", H, I, true, false, false, l});
    }
    experts.push_back({p + "w13", E * 2 * I, H, true, true, false, l});
    experts.push_back({p + "w2", E * H, I, true, true, false, l});
  }
  specs.push_back({"lnf", 1, H, false, false, false, c.layers});
  specs.push_back({"lm_head", V, H, true, false, true, c.layers});
  specs.insert(specs.end(), experts.begin(), experts.end());
  return specs;
}

inline size_t param_count(const ModelConfig& c) {
  size_t n = 0;
  for (const ParamSpec& s : param_specs(c)) n += s.numel();
  return n;
}

// A region of a rank's local flat parameter buffer whose tensors are shared by the same ranks: the
// gradient reduction, the norm, the optimizer, the weight all-gather and the checkpoint each loop
// over the regions once.
enum class Sharding { Replicated, Expert, Vocab };

struct ParamRegion {
  Sharding sharding;
  size_t offset = 0;        // first element in the local flat buffers (gathered: where its shard is kept)
  size_t count = 0;         // elements of its tensors
  size_t padded = 0;        // count rounded up to a multiple of the group size
  size_t shard = 0;         // padded / group size: the elements this rank updates
  size_t shard_offset = 0;  // where this rank's shard starts in the local flat buffers
  // --zero 3 (runtime/zero3.cuh): the replicated tensors of one forward group, of which a rank keeps only
  // its shard; the whole region [padded] is gathered into a buffer of its own while the group runs, and
  // its tensors' offsets count from that buffer's start
  bool gathered = false;
  int group = -1;           // gathered: the forward group (ParamSpec.forward_group)
  size_t shard_first = 0;   // this rank's shard's first element, counted as its tensors' offsets are
};

// The ranks that share a region: how many, and this rank's place among them.
struct RegionGroup {
  int size = 1, rank = 0;
};

// Rank r's interval [lo, hi) of V vocabulary rows split over P ranks: lo = ⌊r·V/P⌋, so the sizes
// differ by at most one and V need not be divisible by P (callers check 1 <= P <= V, 0 <= r < P).
inline std::pair<int, int> vocab_interval(int V, int P, int r) {
  return {(int)((long long)r * V / P), (int)((long long)(r + 1) * V / P)};
}

// The vocabulary split of the output head (Ring-DTP): P ranks of a vocabulary group each hold one
// interval of lm_head's rows; `replicas` are the ranks that hold the same interval (the same place in
// their groups). P = 1: every rank holds the whole head, in the replicated region.
struct VocabSplit {
  int size = 1, rank = 0;
  RegionGroup replicas;
};

// The sequence split (Ulysses sequence parallelism, notes/design.md §5; ops/ulysses.cuh): the W ranks
// form W/D sequence groups, contiguous blocks of D ranks (the places comm_block_group gives: group =
// world rank / D, rank within it = world rank mod D). The D ranks of a group read the same sequences
// (the W/D groups read distinct ones, group g as data-parallel rank g of W/D), and rank r of a group
// holds the tokens [r·T/D, (r+1)·T/D) of each sequence, at those global positions (RoPE's); in
// attention, after the all-to-all, it holds all T tokens of the heads [r·nh/D, (r+1)·nh/D).
// D = 1: every rank holds whole sequences and every head.
struct SequenceSplit {
  int size = 1, rank = 0;                // D, and this rank's place in its sequence group
  int group = 0, groups = 1;             // which sequence group (what it reads), and W/D of them
  int first_token = 0, end_token = 0;    // [t0, t1): this rank's tokens of each sequence
  int first_head = 0, end_head = 0;      // [h0, h1): this rank's heads in attention
  int first_world_rank() const { return group * size; }  // the group's rank 0; its D ranks follow it
};

// "" when sequence groups of D ranks can split W ranks, nh heads and sequences of T tokens evenly,
// else why not, naming each of them that D does not divide.
inline std::string sequence_split_refusal(int W, int heads, int T, int D) {
  if (W < 1 || heads < 1 || T < 1)
    return "the sequence split needs W, nh and T >= 1, got W = " + std::to_string(W) + ", nh = " +
           std::to_string(heads) + ", T = " + std::to_string(T);
  if (D < 1) return "the sequence-parallel group size D must be >= 1, got " + std::to_string(D);
  std::string undivided;
  for (const std::pair<const char*, int>& n : {std::pair<const char*, int>{"the ranks W", W}, {"the heads nh", heads},
                                               {"the sequence length T", T}})
    if (n.second % D != 0) undivided += (undivided.empty() ? "" : ", ") + std::string(n.first) + " = " + std::to_string(n.second);
  if (undivided.empty()) return "";
  return "the sequence-parallel group size D = " + std::to_string(D) + " does not divide " + undivided;
}

// World rank `world_rank`'s place in the sequence split of W ranks into groups of D (refused, naming
// what D does not divide, by std::invalid_argument).
inline SequenceSplit sequence_split(int world_rank, int W, int heads, int T, int D) {
  const std::string refused = sequence_split_refusal(W, heads, T, D);
  if (!refused.empty()) throw std::invalid_argument(refused);
  if (world_rank < 0 || world_rank >= W)
    throw std::invalid_argument("rank " + std::to_string(world_rank) + " is not one of the " + std::to_string(W) + " ranks");
  SequenceSplit s;
  s.size = D;
  s.rank = world_rank % D;
  s.group = world_rank / D;
  s.groups = W / D;
  s.first_token = s.rank * (T / D);
  s.end_token = s.first_token + T / D;
  s.first_head = s.rank * (heads / D);
  s.end_head = s.first_head + heads / D;
  return s;
}

// One rank's local flat parameter buffer.
struct ParamLayout {
  std::vector<size_t> offsets;       // element offset of each spec in the local flat buffer (in a gathered
                                     // region: in the region's gathered buffer)
  std::vector<size_t> local_numel;   // expert stacks hold E/E_p experts here, lm_head its vocabulary interval
  std::vector<ParamRegion> regions;  // [replicated, expert] (+ [vocab] when P > 1), in buffer order; under
                                     // --zero 3 one gathered region per forward group in place of replicated
  size_t num_params = 0;             // local flat buffer length (regions padded; gathered ones: their shards)
  size_t vocab_first_row = 0;        // lo of this rank's vocabulary interval (0 when P = 1)
  std::vector<int> region;           // each spec's region (an index into regions)
};

// Lays the local flat buffer out as regions: [replicated | pad | expert | pad] and, with a vocabulary
// split (P > 1), [vocab | pad] holding this rank's rows of lm_head; each padded to a multiple of the
// size of the group that shares it, each rank updating one shard of each. The expert stacks are split
// over the ep ranks of the expert-parallel group. Every size is a size_t: one rank's expert region
// passes 2^31 elements at H 2048, I 1024, E 64, L 6 on one GPU.
// zero3 (--zero 3): the replicated tensors form one region per forward group (the embedding with layer 0,
// each layer, the final norm with a whole head), padded to a multiple of the ranks, of which the local
// buffers keep only this rank's shard: [shard 0 | … | shard L | expert | pad (| vocab | pad)].
inline ParamLayout param_layout(const std::vector<ParamSpec>& specs, int ep, RegionGroup replicated, RegionGroup expert,
                                VocabSplit vocab = VocabSplit(), bool zero3 = false) {
  ParamLayout layout;
  int groups = 1;  // regions of replicated tensors
  if (zero3)
    for (const ParamSpec& s : specs) groups = std::max(groups, s.forward_group + 1);
  for (int g = 0; g < groups; g++) {
    layout.regions.push_back(ParamRegion{Sharding::Replicated});
    layout.regions.back().gathered = zero3;
    layout.regions.back().group = zero3 ? g : -1;
  }
  const int expert_region = groups, vocab_region = groups + 1;
  layout.regions.push_back(ParamRegion{Sharding::Expert});
  if (vocab.size > 1) layout.regions.push_back(ParamRegion{Sharding::Vocab});
  auto region_of = [&](const ParamSpec& s) {
    return s.expert ? expert_region : s.vocab && vocab.size > 1 ? vocab_region : zero3 ? s.forward_group : 0;
  };
  for (const ParamSpec& s : specs) {
    layout.region.push_back(region_of(s));
    size_t n = s.expert ? s.numel() / ep : s.numel();
    if (s.vocab && vocab.size > 1) {
      const std::pair<int, int> rows = vocab_interval((int)s.rows, vocab.size, vocab.rank);
      layout.vocab_first_row = rows.first;
      n = (size_t)(rows.second - rows.first) * s.cols;
    }
    layout.local_numel.push_back(n);
  }
  for (size_t i = 0; i < specs.size(); i++) layout.regions[layout.region[i]].count += layout.local_numel[i];
  size_t next = 0;
  for (ParamRegion& r : layout.regions) {
    const RegionGroup g = r.sharding == Sharding::Expert ? expert : r.sharding == Sharding::Vocab ? vocab.replicas : replicated;
    const size_t group = (size_t)g.size;
    r.offset = next;
    r.padded = (r.count + group - 1) / group * group;
    r.shard = r.padded / group;
    r.shard_offset = r.gathered ? r.offset : r.offset + (size_t)g.rank * r.shard;
    r.shard_first = r.gathered ? (size_t)g.rank * r.shard : r.shard_offset;
    next += r.gathered ? r.shard : r.padded;
  }
  layout.num_params = next;
  std::vector<size_t> region_next;
  for (const ParamRegion& r : layout.regions) region_next.push_back(r.gathered ? 0 : r.offset);
  for (size_t i = 0; i < specs.size(); i++) {
    size_t& at = region_next[layout.region[i]];
    layout.offsets.push_back(at);
    at += layout.local_numel[i];
  }
  return layout;
}

// The part of spec `spec`'s local elements [first, first + count) that this rank keeps, at local element
// `at`: the whole tensor, or in a gathered region (--zero 3) its overlap with this rank's shard (or none).
struct LocalPiece {
  size_t spec, first, count, at;
};

inline std::vector<LocalPiece> local_pieces(const ParamLayout& layout) {
  std::vector<LocalPiece> pieces;
  for (size_t i = 0; i < layout.offsets.size(); i++) {
    const ParamRegion& r = layout.regions[layout.region[i]];
    if (!r.gathered) {
      pieces.push_back(LocalPiece{i, 0, layout.local_numel[i], layout.offsets[i]});
      continue;
    }
    const size_t lo = std::max(r.shard_first, layout.offsets[i]);
    const size_t hi = std::min(r.shard_first + r.shard, layout.offsets[i] + layout.local_numel[i]);
    if (lo < hi) pieces.push_back(LocalPiece{i, lo - layout.offsets[i], hi - lo, r.shard_offset + (lo - r.shard_first)});
  }
  return pieces;
}

// Where a spec's local elements sit in the global flat buffer (param_specs order, all experts):
// global element global_first(i) + j is local element layout.offsets[i] + j, j < local_numel[i]. An
// expert stack's E/E_p experts of this rank are contiguous: rank ep_rank holds the ep_rank-th slice;
// lm_head's rows of this rank start at its vocabulary interval's first row.
inline std::vector<size_t> global_firsts(const std::vector<ParamSpec>& specs, const ParamLayout& layout, int ep_rank) {
  std::vector<size_t> first;
  size_t global_off = 0;
  for (size_t i = 0; i < specs.size(); i++) {
    first.push_back(global_off + (specs[i].expert ? (size_t)ep_rank * layout.local_numel[i]
                                  : specs[i].vocab ? layout.vocab_first_row * specs[i].cols
                                                   : 0));
    global_off += specs[i].numel();
  }
  return first;
}

// The local flat buffer (this rank's experts, zero padding) from a global one in param_specs order.
inline std::vector<float> local_from_global(const std::vector<ParamSpec>& specs, const ParamLayout& layout, int ep_rank,
                                            const std::vector<float>& global) {
  std::vector<float> local(layout.num_params, 0.f);
  const std::vector<size_t> first = global_firsts(specs, layout, ep_rank);
  for (const LocalPiece& p : local_pieces(layout))
    std::copy_n(global.begin() + first[p.spec] + p.first, p.count, local.begin() + p.at);
  return local;
}

// This rank's shard of the optimizer: each tensor's part of each region's shard, in buffer order.
// state_offset counts the shard's elements (padding included) region after region; S = Σ shards.
struct ShardSegment {
  size_t param_offset;  // first element in the local flat buffers (params, grads)
  size_t state_offset;  // first element in the optimizer state [S]
  size_t count;
  bool decay;           // weight decay applies (not norm gains)
  int group = 0;        // its tensor's ParamSpec.forward_group
};

inline std::vector<ShardSegment> shard_segments(const std::vector<ParamSpec>& specs, const ParamLayout& layout,
                                                size_t* state_count) {
  std::vector<ShardSegment> segments;
  size_t state = 0;
  for (size_t k = 0; k < layout.regions.size(); k++) {
    const ParamRegion& r = layout.regions[k];
    for (size_t i = 0; i < specs.size(); i++) {
      if (layout.region[i] != (int)k) continue;
      const size_t lo = std::max(r.shard_first, layout.offsets[i]);
      const size_t hi = std::min(r.shard_first + r.shard, layout.offsets[i] + layout.local_numel[i]);
      if (lo < hi) segments.push_back(ShardSegment{r.shard_offset + (lo - r.shard_first), state + (lo - r.shard_first),
                                                   hi - lo, specs[i].decay, specs[i].forward_group});
    }
    state += r.shard;
  }
  *state_count = state;
  return segments;
}

// ------------------------------------------------------------------------------------------
// Initialisation, GPT-2 style, deterministic in the seed: normal(0, init_std) for matrices, output
// projections (wo, w2) scaled by 1/sqrt(2L), norms = 1. Element g of the global flat buffer draws
// from a counter-based generator (splitmix64 of seed and g, Box-Muller), so its value does not depend
// on the order of generation or on which rank computes it: the same seed gives the same model at any
// W, and each rank computes only the elements it holds.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

inline float normal_at(uint64_t seed, uint64_t i) {
  uint64_t a = splitmix64(seed ^ splitmix64(2 * i)), b = splitmix64(seed ^ splitmix64(2 * i + 1));
  double u1 = ((a >> 11) + 1.0) / 9007199254740993.0;  // (0, 1]
  double u2 = (b >> 11) / 9007199254740992.0;          // [0, 1)
  return (float)(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// Global element g of tensor s: its initial value.
inline float init_value(const ModelConfig& c, const ParamSpec& s, uint64_t seed, uint64_t g) {
  if (!s.decay) return 1.f;  // norm gains
  const bool is_out_proj = s.name.find(".wo") != std::string::npos || s.name.find("w2") != std::string::npos;
  return c.init_std * (is_out_proj ? 1.f / std::sqrt(2.f * c.layers) : 1.f) * normal_at(seed, g);
}

// This rank's initial weights in its local flat layout (zero padding), computed only at the elements
// it holds (a rank of a 20B-parameter model does not draw the other ranks' experts).
inline std::vector<float> init_local_weights(const ModelConfig& c, const std::vector<ParamSpec>& specs,
                                             const ParamLayout& layout, int ep_rank, unsigned long long seed) {
  std::vector<float> local(layout.num_params, 0.f);
  const std::vector<size_t> first = global_firsts(specs, layout, ep_rank);
  for (const LocalPiece& p : local_pieces(layout))
    for (size_t j = 0; j < p.count; j++) local[p.at + j] = init_value(c, specs[p.spec], seed, first[p.spec] + p.first + j);
  return local;
}

// Parameters a token actually uses (routed experts count k of E): the FLOPs basis of MFU.
inline size_t active_param_count(const ModelConfig& c) {
  size_t n = 0;
  for (const ParamSpec& s : param_specs(c)) n += s.expert ? s.numel() / c.experts * c.topk : s.numel();
  return n - (size_t)c.vocab * c.hidden;  // the embedding lookup does no multiply-adds
}

// Training FLOPs per token: 6 per active parameter + attention (12·L·H·T per token, causal
// halves the scores but flash kernels compute full tiles; we count the causal half: 6·L·H·T).
inline double flops_per_token(const ModelConfig& c) {
  return 6.0 * (double)active_param_count(c) + 6.0 * c.layers * (double)c.hidden * c.seq_len;
}

// ------------------------------------------------------------------------------------------
// Validation: every inconsistency is refused with a message that names it.

inline void validate(const ModelConfig& c) {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(c.vocab >= 2, "vocab must be >= 2 (got " + std::to_string(c.vocab) + ")");
  need(c.hidden > 0 && c.layers > 0 && c.heads > 0, "hidden, layers and heads must be positive");
  need(c.hidden % c.heads == 0, "hidden (" + std::to_string(c.hidden) + ") must be divisible by heads (" +
                                    std::to_string(c.heads) + ")");
  int hd = c.head_dim();
  need(hd == 32 || hd == 64 || hd == 128,
       "head dim hidden/heads = " + std::to_string(hd) + " is not supported (32, 64 or 128)");
  need(c.n_dense >= 0 && c.n_dense <= c.layers,
       "n_dense (" + std::to_string(c.n_dense) + ") must be in [0, layers=" + std::to_string(c.layers) + "]");
  if (c.n_dense < c.layers) {
    // The router's selection keeps a token's scores in one warp, 8 experts per lane, and its picks
    // in 8 registers (ops/router.cuh: ROUTER_MAX_E, ROUTER_MAX_K).
    need(c.experts >= 1 && c.experts <= 256, "experts must be in [1, 256] (got " + std::to_string(c.experts) +
                                                 "): the router's selection holds at most 256 experts");
    need(c.topk >= 1 && c.topk <= c.experts && c.topk <= 8,
         "topk (" + std::to_string(c.topk) + ") must be in [1, min(experts, 8)]: the router picks at most 8 experts");
    need(c.expert_dim > 0, "expert_dim must be positive");
  }
  if (c.n_dense > 0) need(c.dense_dim > 0, "dense_dim must be positive");
  need(c.hidden % 8 == 0 && c.expert_dim % 8 == 0 && c.dense_dim % 8 == 0,
       "hidden, expert_dim and dense_dim must be multiples of 8 (16-byte rows for the grouped GEMM)");
  need(c.shared_expert == 0 || c.shared_expert == 1, "shared_expert must be 0 or 1");
  // Attention runs one block per 64-query tile of a sequence on gridDim.z, at most 65535 of them
  // (ops/attention.cuh).
  need(c.seq_len >= 2 && c.seq_len <= 65535 * 64,
       "seq_len must be in [2, 4194240] (got " + std::to_string(c.seq_len) +
           "): attention launches one block per 64 positions on a grid dimension of at most 65535");
  need(c.score_fn == 0 || c.score_fn == 1, "score_fn must be softmax or sigmoid");
  need(c.renorm == 0 || c.renorm == 1, "renorm must be 0 or 1");
  need(c.rope_theta > 0 && c.norm_eps > 0 && c.init_std > 0, "rope_theta, norm_eps and init_std must be positive");
}

// --device_budget: "0" (off), an integer number of bytes (> 1), or a fraction of the GPU's memory in (0, 1]
// (a decimal such as 0.9). Throws naming the flag and the text when it is neither.
struct DeviceBudget {
  long long bytes = 0;    // > 0: the pool's bytes per rank
  double fraction = 0;    // > 0: of the device's total memory, less what lies outside the pool
  bool on() const { return bytes > 0 || fraction > 0; }
};
inline DeviceBudget parse_device_budget(const std::string& text) {
  DeviceBudget d;
  const bool decimal = text.find('.') != std::string::npos;
  char* end = nullptr;
  errno = 0;
  if (!text.empty() && decimal) d.fraction = strtod(text.c_str(), &end);
  else if (!text.empty() && text[0] != '-') d.bytes = strtoll(text.c_str(), &end, 10);
  const bool parsed = end != nullptr && *end == '\0' && end != text.c_str() && errno == 0;
  if (!parsed || (decimal && !(d.fraction > 0 && d.fraction <= 1)) || (!decimal && d.bytes == 1))
    throw std::invalid_argument("--device_budget '" + text +
                                "': expects 0 (off), bytes (an integer > 1) or a fraction of the GPU in (0, 1] such as 0.9");
  return d;
}

// --device_capacity: bytes, an integer or a decimal with a unit (B, KiB, MiB, GiB, TiB, or KB, MB, GB,
// TB: powers of 1000), such as 81559 MiB or 80GiB. Throws naming the flag and the text when it is not.
inline long long parse_device_capacity(const std::string& text) {
  const std::pair<const char*, double> units[] = {{"", 1},          {"B", 1},       {"KiB", 1024.0},
                                                  {"MiB", 1048576.0}, {"GiB", 1073741824.0}, {"TiB", 1099511627776.0},
                                                  {"KB", 1e3},      {"MB", 1e6},    {"GB", 1e9},
                                                  {"TB", 1e12}};
  char* end = nullptr;
  const double number = !text.empty() && std::isdigit((unsigned char)text[0]) ? strtod(text.c_str(), &end) : 0;
  if (end != nullptr) {
    std::string unit(end);
    unit.erase(0, unit.find_first_not_of(' '));
    for (const auto& [name, scale] : units)
      if (unit == name && number * scale >= 1 && number * scale < 9.2e18) return (long long)(number * scale);
  }
  throw std::invalid_argument("--device_capacity '" + text +
                              "': expects the GPU's memory in bytes, or with a unit such as 80GiB or 141GB");
}

// The MoE dispatcher that --moe names, with its default resolved: local at E_p = 1, else ep.
inline std::string moe_dispatcher(const TrainConfig& t) {
  if (!t.moe.empty()) return t.moe;
  const int ep = t.ep ? t.ep : t.gpus;
  return ep == 1 ? "local" : "ep";
}

// ------------------------------------------------------------------------------------------
// The seams' registries (notes/seams.md): each seam that a flag chooses (--moe, --head, --optimizer)
// is one table, a line per choice: its name, what it is, where it is built, what it needs of the
// ranks, the flags it reads and the checks of those it brings. validate() and --help (usage) read
// the tables, and so do the start-up table (train.cu), tools/bench_ep_moe and tests/dist_model.cu.
// Each line's other half, the choice's factory, is seams.cuh's (dispatcher_factories, head_factories,
// optimizer_factories): a test of both builds (tests/gpu_model.cu) holds the halves to the same names.

// What a choice needs of the run beyond its flags; validate() refuses a run that lacks it.
enum class SeamNeeds {
  Nothing,
  EveryExpert,      // every routed expert on each rank: E_p = 1
  ExpertGroup,      // routes exchanged over the expert-parallel group: W > 1
  VocabularyGroup,  // lm_head's rows split over the P ranks of a vocabulary group: P divides W, P <= V
};

struct SeamChoice {
  std::string name;     // the seam flag's value: --moe llep
  std::string summary;  // what it is, in one line (--help)
  std::string file;     // where it is built
  SeamNeeds needs;
  std::string flags;    // the flags it reads beyond the seam's own, as --help shows them ("" = none)
  // Why the values of the flags it brings are refused ("" = they are not), checked whichever choice
  // runs; nullptr: it brings none. A flag read by several choices is checked by the first.
  std::string (*refuse_flags)(const SeamChoice& self, const TrainConfig& t);
  // Its mode flag (as set_train_flag names it) and every value that flag takes: the benchmarks and
  // the distributed tests run the choice once in each mode ("" and none: it has one way to run).
  std::string mode_flag;
  std::vector<std::string> modes;
};

inline bool has_name(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// "a, b, c" (sep ", "), "a|b|c" (sep "|").
inline std::string joined(const std::vector<std::string>& names, const std::string& sep) {
  std::string text;
  for (const std::string& n : names) text += (text.empty() ? "" : sep) + n;
  return text;
}

// "a, b or c".
inline std::string either(const std::vector<std::string>& names) {
  if (names.size() < 2) return joined(names, "");
  return joined(std::vector<std::string>(names.begin(), names.end() - 1), ", ") + " or " + names.back();
}

// --moe: how a layer's routed experts are computed (MoEDispatcher, ops/moe.cuh).
inline const std::vector<SeamChoice>& moe_choices() {
  static const std::vector<SeamChoice> choices = {
      {"local", "every expert on each rank, no exchange; with --token_budget c, in chunks of at most c tokens",
       "ops/moe.cuh", SeamNeeds::EveryExpert, "--token_budget c (0: no chunks)",
       [](const SeamChoice&, const TrainConfig& t) -> std::string {  // --token_budget, for every dispatcher that reads it
         if (t.token_budget < 0)
           return "token_budget must be >= 0 (0: the dispatcher's default), got " + std::to_string(t.token_budget);
         std::vector<std::string> readers;
         for (const SeamChoice& c : moe_choices())
           if (c.flags.find("--token_budget") != std::string::npos) readers.push_back(c.name);
         if (t.token_budget > 0 && !has_name(readers, moe_dispatcher(t)))
           return "--token_budget " + std::to_string(t.token_budget) + " chunks the routes of --moe " + either(readers) +
                  " (this run has --moe " + moe_dispatcher(t) + ")";
         return "";
       },
       "", {}},
      {"ep", "standard expert parallelism: routes to their expert's rank and back", "ops/ep_moe.cuh",
       SeamNeeds::ExpertGroup, "", nullptr, "", {}},
      {"llep", "LLEP: an overloaded rank lends experts' routes and weights to helpers", "ops/llep.cuh",
       SeamNeeds::ExpertGroup, "--llep_alpha a --llep_min_rows n",
       [](const SeamChoice&, const TrainConfig& t) -> std::string {
         if (!(t.llep_alpha >= 1.0f && std::isfinite(t.llep_alpha)))
           return "llep_alpha must be >= 1 (the ranks' capacities must hold every route), got " +
                  std::to_string(t.llep_alpha);
         if (t.llep_min_rows < 1) return "llep_min_rows must be >= 1, got " + std::to_string(t.llep_min_rows);
         return "";
       },
       "", {}},
      {"pllep", "PipelinedLLEP: LLEP in chunks of c tokens per rank, pipelined", "ops/pipelined_llep.cuh",
       SeamNeeds::ExpertGroup, "--token_budget c (0: 4096) --kmax K --llep_alpha a --llep_min_rows n",
       [](const SeamChoice&, const TrainConfig& t) -> std::string {
         if (t.kmax < 1) return "kmax must be >= 1, got " + std::to_string(t.kmax);
         return "";
       },
       "", {}},
      {"relay", "RelayMoE: expert partitions or token blocks travel a ring", "ops/relay_moe.cuh",
       SeamNeeds::ExpertGroup, "--relay_mode auto|expert|token (auto: the smaller per-hop volume)",
       [](const SeamChoice& self, const TrainConfig& t) -> std::string {
         if (!has_name(self.modes, t.relay_mode))
           return "--relay_mode expects one of " + joined(self.modes, ", ") + ", got '" + t.relay_mode + "'";
         if (t.relay_mode != "auto" && t.moe != "relay")
           return "--relay_mode " + t.relay_mode + " chooses what travels the ring of --moe relay (this run has --moe " +
                  moe_dispatcher(t) + ")";
         return "";
       },
       "--relay_mode", {"expert", "token", "auto"}}};
  return choices;
}

// --head: the vocabulary projection and the loss (OutputHead, ops/cross_entropy.cuh).
inline const std::vector<SeamChoice>& head_choices() {
  static const std::vector<SeamChoice> choices = {
      {"full", "the logits [N,V] inside the head, then cross-entropy", "ops/cross_entropy.cuh", SeamNeeds::Nothing, "",
       nullptr, "", {}},
      {"chunked", "the full head over blocks of rows (N×C logits at a time), no [N,V]", "ops/cross_entropy.cuh",
       SeamNeeds::Nothing, "--vocab_block C",
       [](const SeamChoice&, const TrainConfig& t) -> std::string {
         if (t.vocab_block < 1)
           return "vocab_block (ring_dtp: logits columns per block; chunked: a block of N×C logits) must be >= 1, got " + std::to_string(t.vocab_block);
         return "";
       },
       "", {}},
      {"ring_dtp", "Ring-DTP: lm_head's rows over P ranks; rows (fused) or weights or activations (a ring) move",
       "ops/ring_dtp.cuh", SeamNeeds::VocabularyGroup, "--vocab_group P --ring_dtp auto|fused|weights|activations --vocab_block C",
       [](const SeamChoice& self, const TrainConfig& t) -> std::string {
         if (t.vocab_group < 0) return "vocab_group must be >= 0 (0 = every rank), got " + std::to_string(t.vocab_group);
         if (t.vocab_group != 0 && t.head != "ring_dtp")
           return "--vocab_group " + std::to_string(t.vocab_group) +
                  " splits the vocabulary of --head ring_dtp (this run has --head " + t.head + ")";
         if (!has_name(self.modes, t.ring_dtp))
           return "--ring_dtp expects " + either(self.modes) + ", got '" + t.ring_dtp + "'";
         return "";
       },
       "--ring_dtp", {"auto", "fused", "weights", "activations"}}};
  return choices;
}

// --optimizer: the fp32 master weights and moments of this rank's shard (Optimizer, ops/adamw.cuh).
inline const std::vector<SeamChoice>& optimizer_choices() {
  static const std::vector<SeamChoice> choices = {
      {"adamw", "AdamW, its state on the GPU", "ops/adamw.cuh", SeamNeeds::Nothing, "", nullptr, "", {}},
      {"cpu_adamw", "AdamW, its state in pinned host memory, updated by the CPU", "ops/offload_adamw.cuh",
       SeamNeeds::Nothing, "--offload_bucket β (parameters per chunk of its copy-update-copy pipeline)",
       [](const SeamChoice&, const TrainConfig& t) -> std::string {
         if (t.offload_bucket < 1)
           return "offload_bucket (β, parameters per bucket of offload_adamw and cpu_adamw) must be >= 1, got " +
                  std::to_string(t.offload_bucket);
         return "";
       },
       "", {}},
      {"offload_adamw", "AdamW, its state in pinned host memory, streamed through the GPU",
       "ops/offload_adamw.cuh", SeamNeeds::Nothing, "--offload_bucket β --offload_slots s (s·β·12 bytes on the GPU)",
       [](const SeamChoice&, const TrainConfig& t) -> std::string {
         if (t.offload_slots < 1 || t.offload_slots > 16)
           return "offload_slots (s, offload_adamw's staging slots on the GPU) must be in [1, 16], got " +
                  std::to_string(t.offload_slots) + " (2 already overlap both copies with the update)";
         return "";
       },
       "", {}}};
  return choices;
}

// The line of `name` in a seam's table, or nullptr.
inline const SeamChoice* find_choice(const std::vector<SeamChoice>& choices, const std::string& name) {
  for (const SeamChoice& c : choices)
    if (c.name == name) return &c;
  return nullptr;
}

inline std::vector<std::string> choice_names(const std::vector<SeamChoice>& choices) {
  std::vector<std::string> names;
  for (const SeamChoice& c : choices) names.push_back(c.name);
  return names;
}

// Each way a seam's choices run: a choice without modes once (label = its name), one with modes once
// in each (label NAME_MODE: relay_expert, relay_token, relay_auto). tools/bench_ep_moe measures, and
// tests/dist_model.cu trains with, each run of the dispatchers that exchange routes.
struct SeamRun {
  std::string label, choice, mode;
};
inline std::vector<SeamRun> seam_runs(const std::vector<SeamChoice>& choices, SeamNeeds needs) {
  std::vector<SeamRun> runs;
  for (const SeamChoice& c : choices) {
    if (c.needs != needs) continue;
    if (c.modes.empty()) runs.push_back({c.name, c.name, ""});
    for (const std::string& mode : c.modes) runs.push_back({c.name + "_" + mode, c.name, mode});
  }
  return runs;
}

// P, the ranks of a vocabulary group: --vocab_group (0 = W) under a head that splits the vocabulary, else 1.
inline int vocab_group_size(const TrainConfig& t) {
  const SeamChoice* head = find_choice(head_choices(), t.head);
  if (head == nullptr || head->needs != SeamNeeds::VocabularyGroup) return 1;
  return t.vocab_group ? t.vocab_group : t.gpus;
}

// Why this run's passes are not captured as CUDA graphs (--cuda_graph 1, model.cuh's model_pass), or
// "" when they may be. A captured pass replays the host's decisions of its capture, so the host may
// not decide anything per pass inside it, nor wait for the GPU there; model_pass also finds the last
// by itself (a pass that waited for the host is never captured).
inline std::string cuda_graph_refusal(const TrainConfig& t, bool bf16_build) {
  if (!t.cuda_graph) return "off (--cuda_graph 0)";
  if (!bf16_build) return "off: the FP32 build's MoE layers download their per-expert counts (a host wait in every pass)";
  // Data parallelism alone (--ep 1, the local dispatcher, a whole head on each rank) exchanges nothing
  // inside a pass: the gradients' reduce-scatter and the weights' all-gather come after the passes.
  if (t.gpus > 1 && (moe_dispatcher(t) != "local" || vocab_group_size(t) > 1))
    return "off: with " + std::to_string(t.gpus) + " ranks only data parallelism is captured (--ep 1, --moe local, the full or "
           "chunked head): a pass's collectives and their bounded waits stay on the host";
  if (t.sp > 1) return "off: --sp " + std::to_string(t.sp) + " exchanges q, k, v and attention's output inside every pass";
  if (t.zero == 3) return "off: --zero 3 gathers the dense weights inside every pass";
  if (t.offload_budget > 0) return "off: SCO's copies to and from the host follow a plan the host keeps (--offload_budget)";
  if (!data::routing_trace_path(t.routing).empty())
    return "off: --routing " + t.routing + " copies each pass's recorded experts from the host";
  if (!t.record_routing.empty()) return "off: --record_routing downloads each pass's choices";
  return "";
}

// Why --sp D cannot run with these flags ("" when it can): D must divide the ranks, the heads and the
// sequence (sequence_split_refusal); and what does not compose with the sequence split yet is refused
// by name: a routing trace (--routing trace:FILE, --record_routing) holds each rank's tokens in world-rank
// order.
inline std::string sequence_parallel_refusal(const TrainConfig& t, const ModelConfig& c) {
  if (t.sp < 1) return "--sp must be >= 1 (the ranks of a sequence group), got " + std::to_string(t.sp);
  if (t.sp == 1) return "";
  const std::string refused = sequence_split_refusal(t.gpus, c.heads, c.seq_len, t.sp);
  if (!refused.empty()) return "--sp " + std::to_string(t.sp) + ": " + refused;
  const std::string sp = "--sp " + std::to_string(t.sp);
  if (!data::routing_trace_path(t.routing).empty() || !t.record_routing.empty())
    return sp + " with " + (t.record_routing.empty() ? "--routing " + t.routing : "--record_routing " + t.record_routing) +
           ": routing traces are not built for sequence groups yet";
  return "";
}

inline void validate(const TrainConfig& t, const ModelConfig& c) {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  // Attention runs one block row per sequence on gridDim.y, at most 65535 (ops/attention.cuh).
  need(t.batch > 0 && t.batch <= 65535, "batch must be in [1, 65535] (got " + std::to_string(t.batch) +
                                            "): attention launches one block row per sequence on a grid "
                                            "dimension of at most 65535");
  long long micro = (long long)t.batch * c.seq_len;
  // A rank's tokens of a micro-batch, and the MoE layers' routes (token, pick), are int indices.
  need(micro <= INT_MAX, "batch·seq_len = " + std::to_string(micro) +
                             " tokens per micro-batch: the kernels index a rank's tokens with int (at most 2^31 − 1)");
  need(c.n_dense == c.layers || micro * c.topk <= INT_MAX,
       "batch·seq_len·topk = " + std::to_string(micro * c.topk) +
           " routes per micro-batch: the MoE kernels index routes with int (at most 2^31 − 1)");
  need(t.total_batch == 0 || t.total_batch % micro == 0,
       "total_batch (" + std::to_string(t.total_batch) + " tokens) must be a multiple of batch·seq_len = " +
           std::to_string(micro));
  need(t.steps >= 0, "steps must be >= 0");
  need(t.lr > 0 && t.min_lr_frac >= 0 && t.min_lr_frac <= 1, "lr must be > 0 and min_lr_frac in [0, 1]");
  need(t.warmup >= 0, "warmup must be >= 0");
  need(t.beta1 >= 0 && t.beta1 < 1 && t.beta2 >= 0 && t.beta2 < 1, "beta1 and beta2 must be in [0, 1)");
  need(t.adam_eps > 0 && t.weight_decay >= 0 && t.grad_clip >= 0 && t.bias_update >= 0,
       "adam_eps must be > 0; weight_decay, grad_clip, bias_update >= 0");
  need(t.recompute == 0 || t.recompute == 1, "recompute must be 0 or 1");
  need(t.overlap_update == 0 || t.overlap_update == 1, "overlap_update must be 0 or 1");
  need(t.wgrad_stream == 0 || t.wgrad_stream == 1, "wgrad_stream must be 0 or 1");
  need(t.cuda_graph == 0 || t.cuda_graph == 1, "cuda_graph must be 0 or 1");
  need(t.dry_run == 0 || t.dry_run == 1, "dry_run must be 0 or 1");
  need(t.plan == "off" || t.plan == "auto", "--plan must be off or auto, got '" + t.plan + "'");
  need(t.share_gpus == 0 || t.share_gpus == 1, "share_gpus must be 0 or 1");
  need(t.zero == 1 || t.zero == 3, "--zero must be 1 (ZeRO-1: every rank holds the dense weights) or 3 (ZeRO-3: 1/W each), got " +
                                       std::to_string(t.zero) + " (ZeRO-2 is not built: ZeRO-3 shards what it would)");
  need(t.gpus >= 1, "gpus must be >= 1");
  const int ep = t.ep ? t.ep : t.gpus;
  need(ep >= 1 && t.gpus % ep == 0, "ep (" + std::to_string(ep) + ") must divide the number of ranks (" +
                                        std::to_string(t.gpus) + ")");
  need(c.n_dense == c.layers || c.experts % ep == 0,
       "experts (" + std::to_string(c.experts) + ") must be divisible by " +
           (t.ep ? "--ep " + std::to_string(ep) : "--gpus " + std::to_string(ep) + " (E_p = W when --ep is left out)"));
  // Seams (their registries above): a choice its seam's table names; every choice's flags; then what
  // the chosen one needs of the ranks.
  auto check_seam = [&](const std::string& flag, const std::string& name, const std::vector<SeamChoice>& choices) {
    const SeamChoice* chosen = find_choice(choices, name);
    need(chosen != nullptr, flag + " expects one of " + joined(choice_names(choices), ", ") + ", got '" + name + "'");
    for (const SeamChoice& choice : choices)
      if (choice.refuse_flags != nullptr) {
        const std::string refused = choice.refuse_flags(choice, t);
        need(refused.empty(), refused);
      }
    const int P = vocab_group_size(t);
    switch (chosen->needs) {
      case SeamNeeds::Nothing: break;
      case SeamNeeds::EveryExpert:
        need(ep == 1, flag + " " + name + " keeps every expert on each rank: it needs --ep 1 (got ep " +
                          std::to_string(ep) + ")");
        break;
      case SeamNeeds::ExpertGroup:
        need(t.gpus > 1, flag + " " + name + " exchanges routes between ranks: it needs --gpus > 1 (got " +
                             std::to_string(t.gpus) + ")");
        break;
      case SeamNeeds::VocabularyGroup:
        need(t.gpus % P == 0, "vocab_group (" + std::to_string(P) + ") must divide the number of ranks (" +
                                  std::to_string(t.gpus) + ")");
        need(P <= c.vocab, "vocab_group (" + std::to_string(P) + ") must be at most the vocabulary (" +
                               std::to_string(c.vocab) + "): every rank holds at least one row");
        break;
    }
  };
  check_seam("--moe", moe_dispatcher(t), moe_choices());
  check_seam("--head", t.head, head_choices());
  check_seam("--optimizer", t.optimizer, optimizer_choices());
  need(t.offload_budget >= 0, "offload_budget (SCO's pinned host bytes for layer boundaries) must be >= 0, got " +
                                  std::to_string(t.offload_budget));
  need(t.offload_budget == 0 || t.recompute == 1,
       "--offload_budget " + std::to_string(t.offload_budget) +
           " moves the layer boundaries that recomputation keeps: it needs --recompute 1 (got --recompute " +
           std::to_string(t.recompute) + ")");
  need(t.profile_step == -1 || (t.profile_step >= 0 && t.profile_step < t.steps),
       "--profile_step " + std::to_string(t.profile_step) + " is not a step of this run: it must be -1 (off) or in [0, " +
           std::to_string(t.steps) + ") (--steps " + std::to_string(t.steps) + ")");
  if (!t.device_capacity.empty()) parse_device_capacity(t.device_capacity);
  need(t.device_capacity.empty() || t.dry_run == 1,
       "--device_capacity " + t.device_capacity + " is the GPU's memory for --dry_run 1 without a GPU (got --dry_run " +
           std::to_string(t.dry_run) + ")");
  const DeviceBudget device = parse_device_budget(t.device_budget);
  need(!device.on() || t.recompute == 1, "--device_budget " + t.device_budget +
                                             " chooses attention tensors to keep instead of recomputing them: it needs "
                                             "--recompute 1 (got --recompute " + std::to_string(t.recompute) + ")");
  need(t.attention_groups >= 1 && c.heads % t.attention_groups == 0,
       "--attention_groups " + std::to_string(t.attention_groups) + " must divide the heads (" + std::to_string(c.heads) +
           ") into groups of equal size");
  need(t.attention_groups == 1 || !device.on(),
       "--attention_groups " + std::to_string(t.attention_groups) + " rebuilds attention's projection group by group in "
       "the backward, --device_budget " + t.device_budget + " keeps it whole: choose one (--device_budget 0 or "
       "--attention_groups 1)");
  need(t.attention_groups == 1 || t.sp == 1,
       "--attention_groups " + std::to_string(t.attention_groups) + " is for one rank's whole sequences: under --sp " +
           std::to_string(t.sp) + " attention already runs on nh/D heads of each rank (use --attention_groups 1)");
  need(t.val_every >= 0 && t.val_batches >= 0 && t.sample_every >= 0 && t.sample_len >= 0 &&
           t.ckpt_every >= 0 && t.log_every > 0,
       "val_every, val_batches, sample_every, sample_len, ckpt_every must be >= 0, log_every > 0");
  // --routing: a profile must fit the model (h <= E); a trace's file is checked against the run at
  // start-up, before any GPU work (train.cu). A trace holds MoE layers' choices over training steps: a
  // model without a MoE layer, or a run without a step, has none to record or replay.
  const std::string trace = data::routing_trace_path(t.routing);
  if (t.routing != "router" && trace.empty()) {
    RoutingProfile profile;
    try {
      profile = parse_routing_profile(t.routing);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--routing expects router, trace:FILE or a profile: ") + e.what());
    }
    routing_profile_indices(profile, t.batch * c.seq_len, c.experts, c.topk);  // refuses h > E
  }
  need(c.n_dense < c.layers || (trace.empty() && t.record_routing.empty()),
       "--routing trace:FILE and --record_routing need a MoE layer (n_dense " + std::to_string(c.n_dense) + " of " +
           std::to_string(c.layers) + " layers)");
  need(t.record_routing.empty() || t.steps > 0,
       "--record_routing " + t.record_routing + ": --steps 0 has no training step to record");
  const std::string sequence_refused = sequence_parallel_refusal(t, c);
  need(sequence_refused.empty(), sequence_refused);
}

// ------------------------------------------------------------------------------------------
// Flags: --name value. Unknown flags, words that are not flags, --name=value, missing values and
// malformed numbers (a leading space, past the type's range) are refused.

struct FlagError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// --help's lines of one seam: its flag and choices, then each choice's summary and the flags it reads.
inline std::string seam_usage(const std::string& flag, const std::vector<SeamChoice>& choices, const std::string& note) {
  std::string text = "        " + flag + " " + joined(choice_names(choices), "|") + note + "\n";
  for (const SeamChoice& c : choices) {
    text += "          " + c.name + ": " + c.summary + " (" + c.file + ")\n";
    if (!c.flags.empty()) text += "            " + c.flags + "\n";
  }
  return text;
}

inline std::string usage() {
  return "usage: train [--flag value]...\n"
         "model:  --hidden H --layers L --heads nh --experts E --topk k --expert_dim I\n"
         "        --n_dense N --dense_dim Id --shared_expert 0|1 --seq_len T --vocab V (default: tokenizer)\n"
         "        --score softmax|sigmoid --renorm 0|1 --rope_theta X --norm_eps X --init_std X\n"
         "train:  --batch B --total_batch tokens --steps S --lr X --min_lr_frac X --warmup S\n"
         "        --weight_decay X --beta1 X --beta2 X --adam_eps X --grad_clip X --bias_update u\n"
         "        --recompute 0|1 --offload_budget BYTES (SCO: layer boundaries in pinned host memory; needs\n"
         "        --recompute 1) --device_budget BYTES|FRACTION (the pool's bytes per rank, or a fraction of the\n"
         "        GPU: what the predicted peak leaves keeps attention tensors; needs --recompute 1) --seed S\n"
         "        --attention_groups G (attention on nh/G heads at a time, q, k, v rebuilt per group in the backward:\n"
         "        a layer's backward holds about 5 N·H instead of 12; G divides nh; not with --device_budget or --sp)\n"
         "        --dry_run 1 (print the per-rank memory prediction, exit 0 if it fits, 1 if not; trains nothing;\n"
         "        needs no GPU: --device_capacity BYTES|80GiB gives the GPU's memory where there is none)\n"
         "        --plan auto (the memory savers that fit the GPU and the host, the fastest: recomputation and kept\n"
         "        attention, SCO, the chunked head, the offloaded optimizer; the flags given stay; prints its choice)\n"
         "        --overlap_update 0|1 (1, the default: one rank's --optimizer adamw steps layer by layer beside the\n"
         "        next step's forward, BF16 build; 0: after the backward, on the compute stream)\n"
         "        --wgrad_stream 0|1 (1, the default: each layer's weight gradients on a stream of their own,\n"
         "        beside its input gradients; 0: on the compute stream. The same bits and memory either way)\n"
         "        --cuda_graph 0|1 (1, the default: where a run allows it, each kind of pass is captured once as a\n"
         "        CUDA graph and launched again, the same kernels with the same arguments; 0: every launch from\n"
         "        the host. The start-up table says which)\n"
         "ranks:  --gpus W (processes on this node, one per GPU) --ep E_p (expert-parallel group, default W)\n"
         "        --sp D (sequence-parallel group, default 1: its D ranks share each sequence, T/D tokens each,\n"
         "        attention over all T through an all-to-all of heads; D divides W, nh and T)\n"
         "        --zero 1|3 (default 1: each rank holds every dense weight and updates 1/W of them; 3: it keeps\n"
         "        only that 1/W, and each layer's dense weights are all-gathered just before it runs)\n"
         "        --share_gpus 1 (W may exceed the node's GPUs: the ranks share them round-robin, collectives go\n"
         "        through NCCL's sockets; for correctness and memory, never speed; with a GPU for every rank it\n"
         "        changes nothing. FLATMOE_SHARE_GPUS=1 does the same)\n"
         "        --routing router|balanced|hot:r/h|trace:FILE (a profile or a recorded trace overrides the\n"
         "        router's expert choice) --record_routing FILE (a trace of every training step's routing)\n"
         "seams:  one choice each, from its table (notes/seams.md), with the flags it reads\n" +
         seam_usage("--moe", moe_choices(), " (default: local at E_p = 1, else ep)") + seam_usage("--head", head_choices(), "") +
         seam_usage("--optimizer", optimizer_choices(), "") +
         "data:   --data DIR --train PATTERN --val PATTERN --tokenizer FILE\n"
         "output: --out DIR --val_every S --val_batches N --sample_every S --sample_len N\n"
         "        --ckpt_every S --log_every S --timeline_step S --resume DIR (a checkpoint folder)\n"
         "        --profile_step S (step S's GPU time per operator, from CUDA events; S counts from 0 like\n"
         "        --timeline_step, in [0, steps); -1 = off)\n";
}

// The flag tables: every flag once, with how its value is read from text and written as text.
// parse_flags reads the command line through them; a checkpoint keeps the training flags as text
// (train_flag_values) and reads them back (set_train_flag): the text of a value reads back as the
// same value, bit for bit.

template <typename Config>
struct Flag {
  std::string name;  // "--hidden"
  bool free_text;    // a path, pattern or word, kept as given: the command line refuses it empty
  std::function<void(Config&, const std::string&)> set;  // from text; throws FlagError naming the flag
  std::function<std::string(const Config&)> text;
};

// Whether a numeric flag's value starts with its number: strtol and its kin skip leading whitespace,
// which the command line refuses (" -1" is not a number as written).
inline bool starts_with_number(const std::string& v) { return !v.empty() && !std::isspace((unsigned char)v[0]); }

inline int int_from_flag(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  long x = strtol(v.c_str(), &end, 10);
  if (!starts_with_number(v) || *end != '\0' || errno == ERANGE || x < -2147483647L || x > 2147483647L)
    throw FlagError("flag " + flag + " expects an integer, got '" + v + "'");
  return (int)x;
}

inline long long int64_from_flag(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  errno = 0;
  long long x = strtoll(v.c_str(), &end, 10);
  if (!starts_with_number(v) || *end != '\0' || errno == ERANGE) throw FlagError("flag " + flag + " expects an integer, got '" + v + "'");
  return x;
}

inline float float_from_flag(const std::string& flag, const std::string& v) {
  char* end = nullptr;
  float x = strtof(v.c_str(), &end);
  if (!starts_with_number(v) || *end != '\0' || !std::isfinite(x))
    throw FlagError("flag " + flag + " expects a number, got '" + v + "'");
  return x;
}

// The shortest decimal text that reads back as exactly x: "0.001", not "0.00100000005".
inline std::string float_text(float x) {
  char text[32];
  for (int digits = 1;; digits++) {
    snprintf(text, sizeof text, "%.*g", digits, x);
    if (strtof(text, nullptr) == x || digits == 9) return text;  // 9 significant digits always suffice
  }
}

template <typename Config>
Flag<Config> int_flag(const std::string& name, int Config::*field) {
  return {name, false, [name, field](Config& c, const std::string& v) { c.*field = int_from_flag(name, v); },
          [field](const Config& c) { return std::to_string(c.*field); }};
}

template <typename Config>
Flag<Config> int64_flag(const std::string& name, long long Config::*field) {
  return {name, false, [name, field](Config& c, const std::string& v) { c.*field = int64_from_flag(name, v); },
          [field](const Config& c) { return std::to_string(c.*field); }};
}

template <typename Config>
Flag<Config> float_flag(const std::string& name, float Config::*field) {
  return {name, false, [name, field](Config& c, const std::string& v) { c.*field = float_from_flag(name, v); },
          [field](const Config& c) { return float_text(c.*field); }};
}

template <typename Config>
Flag<Config> text_flag(const std::string& name, std::string Config::*field) {
  return {name, true, [field](Config& c, const std::string& v) { c.*field = v; },
          [field](const Config& c) { return c.*field; }};
}

// Every ModelConfig field, in the struct's order.
inline const std::vector<Flag<ModelConfig>>& model_flags() {
  using M = ModelConfig;
  static const std::vector<Flag<M>> flags = {
      int_flag("--vocab", &M::vocab),
      int_flag("--hidden", &M::hidden),
      int_flag("--layers", &M::layers),
      int_flag("--heads", &M::heads),
      int_flag("--experts", &M::experts),
      int_flag("--topk", &M::topk),
      int_flag("--expert_dim", &M::expert_dim),
      int_flag("--n_dense", &M::n_dense),
      int_flag("--dense_dim", &M::dense_dim),
      int_flag("--shared_expert", &M::shared_expert),
      int_flag("--seq_len", &M::seq_len),
      {"--score", false,
       [](M& m, const std::string& v) {
         if (v == "softmax") m.score_fn = 0;
         else if (v == "sigmoid") m.score_fn = 1;
         else throw FlagError("flag --score expects softmax or sigmoid, got '" + v + "'");
       },
       [](const M& m) {
         if (m.score_fn == 0) return std::string("softmax");
         if (m.score_fn == 1) return std::string("sigmoid");
         return std::to_string(m.score_fn);  // not a valid configuration, but written as it is
       }},
      int_flag("--renorm", &M::renorm),
      float_flag("--rope_theta", &M::rope_theta),
      float_flag("--norm_eps", &M::norm_eps),
      float_flag("--init_std", &M::init_std)};
  return flags;
}

// Every TrainConfig field, in the struct's order.
inline const std::vector<Flag<TrainConfig>>& train_flags() {
  using T = TrainConfig;
  static const std::vector<Flag<T>> flags = {
      text_flag("--data", &T::data_dir),
      text_flag("--train", &T::train_pattern),
      text_flag("--val", &T::val_pattern),
      text_flag("--tokenizer", &T::tokenizer),
      text_flag("--out", &T::out_dir),
      text_flag("--resume", &T::resume),
      int_flag("--batch", &T::batch),
      int_flag("--total_batch", &T::total_batch),
      int_flag("--steps", &T::steps),
      float_flag("--lr", &T::lr),
      float_flag("--min_lr_frac", &T::min_lr_frac),
      int_flag("--warmup", &T::warmup),
      float_flag("--weight_decay", &T::weight_decay),
      float_flag("--beta1", &T::beta1),
      float_flag("--beta2", &T::beta2),
      float_flag("--adam_eps", &T::adam_eps),
      float_flag("--grad_clip", &T::grad_clip),
      float_flag("--bias_update", &T::bias_update),
      int_flag("--recompute", &T::recompute),
      int_flag("--overlap_update", &T::overlap_update),
      int_flag("--wgrad_stream", &T::wgrad_stream),
      int_flag("--cuda_graph", &T::cuda_graph),
      int_flag("--val_every", &T::val_every),
      int_flag("--val_batches", &T::val_batches),
      int_flag("--sample_every", &T::sample_every),
      int_flag("--sample_len", &T::sample_len),
      int_flag("--ckpt_every", &T::ckpt_every),
      int_flag("--log_every", &T::log_every),
      int_flag("--timeline_step", &T::timeline_step),
      int_flag("--profile_step", &T::profile_step),
      int_flag("--gpus", &T::gpus),
      int_flag("--share_gpus", &T::share_gpus),
      int_flag("--ep", &T::ep),
      int_flag("--sp", &T::sp),
      int_flag("--zero", &T::zero),
      text_flag("--routing", &T::routing),
      text_flag("--record_routing", &T::record_routing),
      text_flag("--moe", &T::moe),
      float_flag("--llep_alpha", &T::llep_alpha),
      int_flag("--llep_min_rows", &T::llep_min_rows),
      int_flag("--token_budget", &T::token_budget),
      int_flag("--kmax", &T::kmax),
      text_flag("--relay_mode", &T::relay_mode),
      text_flag("--head", &T::head),
      int_flag("--vocab_group", &T::vocab_group),
      text_flag("--ring_dtp", &T::ring_dtp),
      int_flag("--vocab_block", &T::vocab_block),
      text_flag("--optimizer", &T::optimizer),
      int_flag("--offload_bucket", &T::offload_bucket),
      int_flag("--offload_slots", &T::offload_slots),
      int64_flag("--offload_budget", &T::offload_budget),
      text_flag("--device_budget", &T::device_budget),
      int_flag("--attention_groups", &T::attention_groups),
      int_flag("--dry_run", &T::dry_run),
      text_flag("--device_capacity", &T::device_capacity),
      text_flag("--plan", &T::plan),
      {"--seed", false,
       [](T& t, const std::string& v) {
         char* end = nullptr;
         errno = 0;
         unsigned long long s = strtoull(v.c_str(), &end, 10);
         if (v.empty() || !std::isdigit((unsigned char)v[0]) || *end != '\0' || errno == ERANGE)
           throw FlagError("flag --seed expects a non-negative integer below 2^64, got '" + v + "'");
         t.seed = s;
       },
       [](const T& t) { return std::to_string(t.seed); }}};
  return flags;
}

template <typename Config>
const Flag<Config>* find_flag(const std::vector<Flag<Config>>& flags, const std::string& name) {
  for (const Flag<Config>& f : flags)
    if (f.name == name) return &f;
  return nullptr;
}

template <typename Config>
std::vector<std::pair<std::string, std::string>> flag_values(const std::vector<Flag<Config>>& flags, const Config& c) {
  std::vector<std::pair<std::string, std::string>> values;
  for (const Flag<Config>& f : flags) values.emplace_back(f.name, f.text(c));
  return values;
}

// Every training flag and its value as text, in the table's order: {"--data", "data/fortunes"}, ...
inline std::vector<std::pair<std::string, std::string>> train_flag_values(const TrainConfig& t) {
  return flag_values(train_flags(), t);
}

// Every model flag and its value as text: {"--vocab", "4096"}, ..., {"--score", "softmax"}, ...
inline std::vector<std::pair<std::string, std::string>> model_flag_values(const ModelConfig& m) {
  return flag_values(model_flags(), m);
}

// The inverse of train_flag_values, one flag at a time: reads `value` as the command line would,
// except that a free-text flag may be empty (train_flag_values writes an unset --resume as "").
inline void set_train_flag(TrainConfig& t, const std::string& flag, const std::string& value) {
  const Flag<TrainConfig>* f = find_flag(train_flags(), flag);
  if (!f) throw FlagError("unknown flag " + flag);
  f->set(t, value);
}

// `given` (when not null) gets each flag the command line names, in order.
inline void parse_flags(int argc, char** argv, ModelConfig& m, TrainConfig& t, std::vector<std::string>* given = nullptr) {
  for (int i = 1; i < argc; i++) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") throw FlagError("help");
    if (flag.rfind("--", 0) != 0) throw FlagError("unexpected argument '" + flag + "'");
    if (flag.find('=') != std::string::npos)
      throw FlagError("flag " + flag + ": give the value as the next word, " + flag.substr(0, flag.find('=')) + " " +
                      flag.substr(flag.find('=') + 1) + " (flags take no '=')");
    if (i + 1 >= argc) throw FlagError("flag " + flag + " needs a value");
    const std::string v = argv[++i];
    const auto set = [&](const auto* f, auto& config) {
      if (f->free_text && v.empty()) throw FlagError("flag " + flag + " expects a non-empty value");
      f->set(config, v);
    };
    if (const Flag<ModelConfig>* model_flag = find_flag(model_flags(), flag)) set(model_flag, m);
    else if (const Flag<TrainConfig>* train_flag = find_flag(train_flags(), flag)) set(train_flag, t);
    else throw FlagError("unknown flag " + flag);
    if (given) given->push_back(flag);
  }
  if (t.train_pattern.empty()) t.train_pattern = t.data_dir + "/train_*.bin";
  if (t.val_pattern.empty()) t.val_pattern = t.data_dir + "/val_*.bin";
  if (t.tokenizer.empty()) t.tokenizer = t.data_dir + "/tokenizer.bin";
}

// The shape of a routing trace of this model on `world` ranks of `tokens` tokens per training pass
// (data/routing_trace.hpp): every MoE layer, n_dense..L−1, in order.
inline data::RoutingTraceShape routing_trace_shape(const ModelConfig& c, int tokens, int world) {
  data::RoutingTraceShape shape;
  shape.world = world;
  shape.experts = c.experts;
  shape.topk = c.topk;
  for (int l = 0; l < c.layers; l++)
    if (c.is_moe_layer(l)) shape.layers.push_back(l);
  shape.tokens.assign(world, tokens);
  return shape;
}

// Learning rate at optimizer step s (0-based): linear warmup, then cosine to lr·min_lr_frac.
inline float lr_at(const TrainConfig& t, int s) {
  if (s < t.warmup) return t.lr * (float)(s + 1) / (float)t.warmup;
  if (t.steps <= t.warmup) return t.lr;
  float progress = (float)(s - t.warmup) / (float)(t.steps - t.warmup);
  float min_lr = t.lr * t.min_lr_frac;
  return min_lr + 0.5f * (t.lr - min_lr) * (1.f + std::cos(3.14159265358979f * std::min(progress, 1.f)));
}

// ------------------------------------------------------------------------------------------
// Aux-loss-free router balancing (DeepSeek-V3), shared by the trainer and the reference:
// after every step, b_e += u · sign(mean_load − load_e) per MoE layer, with loads counted over the
// whole global batch. The bias changes which experts are selected, never the combine weights.
inline void update_router_bias(std::vector<float>& bias /*[L·E]*/, const std::vector<long long>& loads /*[L·E]*/,
                               const ModelConfig& c, float u) {
  if (u <= 0) return;
  for (int l = 0; l < c.layers; l++) {
    if (!c.is_moe_layer(l)) continue;
    long long total = 0;
    for (int e = 0; e < c.experts; e++) total += loads[(size_t)l * c.experts + e];
    const double mean = (double)total / c.experts;
    for (int e = 0; e < c.experts; e++) {
      const double load = (double)loads[(size_t)l * c.experts + e];
      const float sign = load < mean ? 1.f : (load > mean ? -1.f : 0.f);
      bias[(size_t)l * c.experts + e] += u * sign;
    }
  }
}
