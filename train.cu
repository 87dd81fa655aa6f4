// train.cu — the flatmoe trainer, one translation unit like llm.c. Read it top to bottom:
//   1. configuration (config.hpp: flags, validation, parameter layout)
//   2. the model: parameters, gradients, optimizer state, router biases — all in the pool
//   3. forward: embedding → L × [RMSNorm → attention (RoPE) → residual → RMSNorm → FFN (MoE) →
//      residual] → RMSNorm → vocabulary projection → cross-entropy
//   4. backward: the same in reverse; with --recompute 1 only each layer's input is kept and the
//      layer is recomputed just before its backward (layer-level activation checkpointing)
//   5. update: gradients reduce-scattered over the ranks that share them (ZeRO-1), global-norm
//      clipping, AdamW on this rank's shard of the fp32 master weights, weights all-gathered,
//      aux-loss-free router bias update from the loads of the whole global batch
//   6. checkpoints (atomic, versioned header) and resume that continues bit for bit
//   7. the training loop: accumulation, LR schedule, validation, samples, logs, memory report
//
// Parallel layout (DESIGN §5): W ranks, one process per GPU. Every rank reads its own part of the
// data. Dense tensors are replicated; routed experts are split over the E_p ranks of an
// expert-parallel group (contiguous blocks of E_p ranks) and replicated over the W/E_p groups.
// Optimizer state is sharded (ZeRO-1) over the ranks that hold each tensor.
//
// Tests include this file with FLATMOE_NO_MAIN defined and drive the same functions.
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "config.hpp"
#include "data/dataloader.hpp"
#include "data/routing_profile.hpp"
#include "data/tokenizer.hpp"
#include "ops/adamw.cuh"
#include "ops/attention.cuh"
#include "runtime/comm.cuh"
#include "ops/common.cuh"
#include "ops/cross_entropy.cuh"
#include "ops/embedding.cuh"
#include "ops/ep_moe.cuh"
#include "runtime/launch.cuh"
#include "ops/matmul.cuh"
#include "ops/moe.cuh"
#include "runtime/pool.cuh"
#include "ops/rmsnorm.cuh"
#include "ops/rope.cuh"
#include "ops/router.cuh"

using data::DataLoader;
using data::Tokenizer;

// =============================================================================================
// 2. The model

// Pointers of one layer's tensors inside a flat buffer (parameters or their gradients).
struct LayerTensors {
  floatX *ln1, *wqkv, *wo, *ln2;
  floatX *router, *w13, *w2;             // MoE layers
  floatX *shared_w13, *shared_w2;        // MoE layers with a shared expert
  floatX *dense_w13, *dense_w2;          // dense FFN layers
};

struct ModelTensors {
  floatX *wte, *lnf, *lm_head;
  std::vector<LayerTensors> layers;
};

// This process's place among the W ranks. At W = 1 every group has size 1 and no NCCL
// communicator exists.
struct Parallel {
  Comm world;            // all W ranks
  Comm ep;               // the E_p ranks that hold disjoint expert shards (contiguous block of ranks)
  Comm expert_replicas;  // the W/E_p ranks that hold the same expert shard (same rank in their ep group)
};

struct Model {
  ModelConfig cfg;
  Parallel par;
  std::vector<ParamSpec> specs;     // config.hpp: dense tensors, then routed-expert stacks
  std::vector<size_t> offsets;      // element offset of each spec in the local flat buffers
  std::vector<size_t> local_numel;  // expert stacks hold E/E_p experts here

  // Local flat buffer: [dense region | pad | expert region | pad]. Each region is padded to a
  // multiple of the size of the group that shares it, and each rank updates one shard of it.
  size_t dense_count = 0, expert_count = 0;    // elements of each region
  size_t dense_padded = 0, expert_padded = 0;
  size_t dense_shard = 0, expert_shard = 0;    // elements this rank updates in each region
  size_t dense_shard_start = 0, expert_shard_start = 0;  // where, in the local flat buffer
  size_t num_params = 0;                       // dense_padded + expert_padded

  floatX* params = nullptr;  // [num_params] floatX weights the kernels read      (Weights)
  floatX* grads = nullptr;   // [num_params] gradients, accumulated over a step   (Grads)
  float* master = nullptr;   // [dense_shard + expert_shard] fp32 master weights  (Optimizer)
  float* adam_m = nullptr;   // [dense_shard + expert_shard]                      (Optimizer)
  float* adam_v = nullptr;   // [dense_shard + expert_shard]                      (Optimizer)
  ModelTensors p, g;         // views into params / grads

  // Router biases (aux-loss-free balancing): [L, E] floats, host copy is the source of truth.
  std::vector<float> router_bias;       // host [L·E]
  float* router_bias_dev = nullptr;     // device [L·E]                           (Weights)
  std::vector<long long> step_loads;    // host [L·E] routes per expert over the current step

  // Trivial routing for dense FFNs and the shared expert (every token → expert 0, weight 1).
  int* dense_idx = nullptr;
  float* dense_w = nullptr;
  int dense_rows = 0;

  float* sumsq_partials = nullptr;  // [SUMSQ_BLOCKS]                          (Workspace)
  float* scalar_dev = nullptr;      // [1]                                      (Workspace)
  int adam_t = 0;                   // AdamW steps taken
  cudaStream_t stream = 0;

  // --routing: a profile (paper appendix B.2) that replaces the router's expert choice
  bool routing_override = false;
  RoutingProfile routing;

  size_t shard_count() const { return dense_shard + expert_shard; }
  int experts_local() const { return cfg.experts / par.ep.size; }
};

inline floatX* tensor_at(floatX* base, const Model& m, const std::string& name) {
  for (size_t i = 0; i < m.specs.size(); i++)
    if (m.specs[i].name == name) return base + m.offsets[i];
  return nullptr;
}

ModelTensors view_tensors(floatX* base, const Model& m) {
  ModelTensors t;
  t.wte = tensor_at(base, m, "wte");
  t.lnf = tensor_at(base, m, "lnf");
  t.lm_head = tensor_at(base, m, "lm_head");
  for (int l = 0; l < m.cfg.layers; l++) {
    std::string p = "layer" + std::to_string(l) + ".";
    LayerTensors lt;
    lt.ln1 = tensor_at(base, m, p + "ln1");
    lt.wqkv = tensor_at(base, m, p + "wqkv");
    lt.wo = tensor_at(base, m, p + "wo");
    lt.ln2 = tensor_at(base, m, p + "ln2");
    lt.router = tensor_at(base, m, p + "router");
    lt.w13 = tensor_at(base, m, p + "w13");
    lt.w2 = tensor_at(base, m, p + "w2");
    lt.shared_w13 = tensor_at(base, m, p + "shared_w13");
    lt.shared_w2 = tensor_at(base, m, p + "shared_w2");
    lt.dense_w13 = tensor_at(base, m, p + "dense_w13");
    lt.dense_w2 = tensor_at(base, m, p + "dense_w2");
    t.layers.push_back(lt);
  }
  return t;
}

// GPT-2 style initialisation on the host, deterministic in the seed: normal(0, init_std) for
// matrices, output projections (wo, w2) scaled by 1/sqrt(2L), norms = 1. Element i of the flat
// buffer draws from a counter-based generator (splitmix64 of seed and i, Box-Muller), so the
// result does not depend on the order of generation and a 100M-parameter model starts in a second.
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

std::vector<float> init_master_weights(const ModelConfig& c, unsigned long long seed) {
  std::vector<float> w(param_count(c));
  size_t off = 0;
  for (const ParamSpec& s : param_specs(c)) {
    bool is_norm = !s.decay;
    bool is_out_proj = s.name.find(".wo") != std::string::npos || s.name.find("w2") != std::string::npos;
    float std = c.init_std * (is_out_proj ? 1.f / std::sqrt(2.f * c.layers) : 1.f);
    for (size_t i = 0; i < s.numel(); i++, off++) w[off] = is_norm ? 1.f : std * normal_at(seed, off);
  }
  return w;
}

// The local flat buffer (this rank's experts) from a global one in param_specs order.
std::vector<float> local_from_global(const Model& m, const std::vector<float>& global) {
  std::vector<float> local(m.num_params, 0.f);
  size_t global_off = 0;
  for (size_t i = 0; i < m.specs.size(); i++) {
    const size_t n = m.local_numel[i];
    const size_t first = m.specs[i].expert ? (size_t)m.par.ep.rank * n : 0;  // this rank's contiguous experts
    std::copy(global.begin() + global_off + first, global.begin() + global_off + first + n, local.begin() + m.offsets[i]);
    global_off += m.specs[i].numel();
  }
  return local;
}

// Sets the weights from global host fp32 master weights (param_specs order, all experts): the
// floatX copy of everything this rank holds, and the fp32 master weights of its shards.
void model_set_master(Model& m, const std::vector<float>& global) {
  if (global.size() != param_count(m.cfg))
    fm_fail("model_set_master", "wrong number of parameters", "got=%zu expected=%zu", global.size(), param_count(m.cfg));
  std::vector<float> local = local_from_global(m, global);
  float* staging = pool().alloc_t<float>(m.num_params, Mem::Workspace, "set_master");
  cudaCheck(cudaMemcpy(staging, local.data(), m.num_params * sizeof(float), cudaMemcpyHostToDevice),
            "model_set_master", "P=%zu", m.num_params);
  convert(m.params, staging, m.num_params, m.stream);
  cudaCheck(cudaMemcpyAsync(m.master, staging + m.dense_shard_start, m.dense_shard * sizeof(float),
                            cudaMemcpyDeviceToDevice, m.stream), "model_set_master", "dense shard=%zu", m.dense_shard);
  cudaCheck(cudaMemcpyAsync(m.master + m.dense_shard, staging + m.expert_shard_start, m.expert_shard * sizeof(float),
                            cudaMemcpyDeviceToDevice, m.stream), "model_set_master", "expert shard=%zu", m.expert_shard);
  cudaCheck(cudaStreamSynchronize(m.stream), "model_set_master", "P=%zu", m.num_params);
  pool().free(staging);
}

void model_upload_router_bias(Model& m) {
  if (m.router_bias.empty()) return;
  cudaCheck(cudaMemcpy(m.router_bias_dev, m.router_bias.data(), m.router_bias.size() * sizeof(float),
                       cudaMemcpyHostToDevice),
            "router_bias", "n=%zu", m.router_bias.size());
}

Model model_create(const ModelConfig& cfg, unsigned long long seed, const Parallel& par = Parallel(),
                   cudaStream_t stream = 0) {
  validate(cfg);
  Model m;
  m.cfg = cfg;
  m.par = par;
  m.stream = stream;
  m.specs = param_specs(cfg);
  const int ep = par.ep.size;
  if (cfg.experts % ep != 0) fm_fail("model_create", "experts must be divisible by the expert-parallel size", "E=%d E_p=%d", cfg.experts, ep);
  // layout: dense region, padded to a multiple of W; expert region, padded to a multiple of W/E_p
  auto local_count = [&](const ParamSpec& s) { return s.expert ? s.numel() / ep : s.numel(); };
  for (const ParamSpec& s : m.specs) (s.expert ? m.expert_count : m.dense_count) += local_count(s);
  m.dense_padded = ceil_div(m.dense_count, par.world.size) * (size_t)par.world.size;
  size_t dense_next = 0, expert_next = m.dense_padded;
  for (const ParamSpec& s : m.specs) {
    size_t& next = s.expert ? expert_next : dense_next;
    m.offsets.push_back(next);
    m.local_numel.push_back(local_count(s));
    next += local_count(s);
  }
  m.expert_padded = ceil_div(m.expert_count, par.expert_replicas.size) * (size_t)par.expert_replicas.size;
  m.num_params = m.dense_padded + m.expert_padded;
  m.dense_shard = m.dense_padded / par.world.size;
  m.expert_shard = m.expert_padded / par.expert_replicas.size;
  m.dense_shard_start = (size_t)par.world.rank * m.dense_shard;
  m.expert_shard_start = m.dense_padded + (size_t)par.expert_replicas.rank * m.expert_shard;

  const size_t P = m.num_params, S = m.shard_count();
  m.params = pool().alloc_t<floatX>(P, Mem::Weights, "params");
  m.grads = pool().alloc_t<floatX>(P, Mem::Grads, "grads");
  m.master = pool().alloc_t<float>(S, Mem::Optimizer, "master");
  m.adam_m = pool().alloc_t<float>(S, Mem::Optimizer, "adam_m");
  m.adam_v = pool().alloc_t<float>(S, Mem::Optimizer, "adam_v");
  cudaCheck(cudaMemset(m.grads, 0, P * sizeof(floatX)), "model_create", "P=%zu", P);
  cudaCheck(cudaMemset(m.adam_m, 0, S * sizeof(float)), "model_create", "shard=%zu", S);
  cudaCheck(cudaMemset(m.adam_v, 0, S * sizeof(float)), "model_create", "shard=%zu", S);
  m.p = view_tensors(m.params, m);
  m.g = view_tensors(m.grads, m);
  const size_t LE = (size_t)cfg.layers * cfg.experts;
  m.router_bias.assign(LE, 0.f);
  m.step_loads.assign(LE, 0);
  m.router_bias_dev = pool().alloc_t<float>(LE, Mem::Weights, "router_bias");
  model_upload_router_bias(m);
  m.sumsq_partials = pool().alloc_t<float>(SUMSQ_BLOCKS, Mem::Workspace, "sumsq_partials");
  m.scalar_dev = pool().alloc_t<float>(1, Mem::Workspace, "scalar");
  model_set_master(m, init_master_weights(cfg, seed));  // every rank draws the same global weights
  return m;
}

void model_destroy(Model& m) {
  for (void* p : {(void*)m.params, (void*)m.grads, (void*)m.master, (void*)m.adam_m, (void*)m.adam_v,
                  (void*)m.router_bias_dev, (void*)m.sumsq_partials, (void*)m.scalar_dev,
                  (void*)m.dense_idx, (void*)m.dense_w})
    pool().free(p);
  m = Model();
}

// The trivial routing buffers (token → expert 0, weight 1) for N tokens.
void ensure_dense_routes(Model& m, int N) {
  if (m.dense_rows >= N) return;
  pool().free(m.dense_idx);
  pool().free(m.dense_w);
  m.dense_idx = pool().alloc_t<int>(N, Mem::Workspace, "dense_routes_idx");
  m.dense_w = pool().alloc_t<float>(N, Mem::Workspace, "dense_routes_w");
  dense_routes(m.dense_idx, m.dense_w, N, m.stream);
  m.dense_rows = N;
}

// =============================================================================================
// 3. Forward

// What one layer's backward needs, kept from its forward (or recomputed).
struct LayerActs {
  floatX* ln1 = nullptr;        // [N, H]
  float* ln1_rstd = nullptr;    // [N]
  floatX* qkv = nullptr;        // [N, 3H] after RoPE
  floatX* att = nullptr;        // [N, H] attention output (before wo)
  float* lse = nullptr;         // [B, nh, T]
  floatX* x_mid = nullptr;      // [N, H] residual after attention
  floatX* ln2 = nullptr;        // [N, H]
  float* ln2_rstd = nullptr;    // [N]
  float* scores = nullptr;      // [N, E] router scores (MoE layers)
  int* topk_idx = nullptr;      // [N, k]
  float* topk_w = nullptr;      // [N, k]
  MoESaved moe{};               // routed experts on one rank, or the dense FFN
  EPSaved ep_moe{};             // routed experts split over the expert-parallel group
  bool expert_parallel = false;
  MoESaved shared{};            // shared expert
  bool has_shared = false;
};

void free_acts(LayerActs& a) {
  for (void* p : {(void*)a.ln1, (void*)a.ln1_rstd, (void*)a.qkv, (void*)a.att, (void*)a.lse, (void*)a.x_mid,
                  (void*)a.ln2, (void*)a.ln2_rstd, (void*)a.scores, (void*)a.topk_idx, (void*)a.topk_w})
    pool().free(p);
  if (a.expert_parallel) ep_saved_free(a.ep_moe);
  else moe_saved_free(a.moe);
  if (a.has_shared) moe_saved_free(a.shared);
  a = LayerActs();
}

// FFN of layer l on ln2 (N×H) → out (N×H, =). Counts routes per expert into m.step_loads when asked.
void ffn_forward(Model& m, int l, LayerActs& a, floatX* out, int N, bool count_loads) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  cudaStream_t s = m.stream;
  if (!c.is_moe_layer(l)) {
    ensure_dense_routes(m, N);
    moe_forward(out, a.moe, a.ln2, m.dense_idx, m.dense_w, P.dense_w13, P.dense_w2, N, c.hidden, c.dense_dim, 1, 1, s);
    return;
  }
  const int E = c.experts, k = c.topk;
  floatX* logits = pool().alloc_t<floatX>((size_t)N * E, Mem::Activations, "router_logits");
  a.scores = pool().alloc_t<float>((size_t)N * E, Mem::Activations, "router_scores");
  a.topk_idx = pool().alloc_t<int>((size_t)N * k, Mem::Activations, "topk_idx");
  a.topk_w = pool().alloc_t<float>((size_t)N * k, Mem::Activations, "topk_w");
  matmul_forward(logits, a.ln2, P.router, N, c.hidden, E, s);
  router_forward(a.topk_idx, a.topk_w, a.scores, logits, m.router_bias_dev + (size_t)l * E, N, E, k, c.score_fn,
                 c.renorm != 0, s);
  pool().free(logits);
  if (m.routing_override) {  // the profile's experts, weighted by the router's scores for them
    std::vector<int> idx = routing_profile_indices(m.routing, N, E, k);
    cudaCheck(cudaMemcpyAsync(a.topk_idx, idx.data(), idx.size() * sizeof(int), cudaMemcpyHostToDevice, s),
              "routing_profile", "N=%d k=%d", N, k);
    router_weights(a.topk_w, a.scores, a.topk_idx, N, E, k, c.renorm != 0, s);
    cudaCheck(cudaStreamSynchronize(s), "routing_profile", "N=%d", N);  // idx (host) must outlive the copy
  }
  if (count_loads) {
    int* loads_dev = pool().alloc_t<int>(E, Mem::Workspace, "loads");
    std::vector<int> loads(E);
    router_count_loads(loads_dev, a.topk_idx, N, E, k, s);
    cudaCheck(cudaMemcpyAsync(loads.data(), loads_dev, E * sizeof(int), cudaMemcpyDeviceToHost, s), "count_loads", "E=%d", E);
    cudaCheck(cudaStreamSynchronize(s), "count_loads", "E=%d", E);
    pool().free(loads_dev);
    for (int e = 0; e < E; e++) m.step_loads[(size_t)l * E + e] += loads[e];
  }
  if (m.par.ep.size > 1) {
    a.expert_parallel = true;
    ep_moe_forward(out, a.ep_moe, a.ln2, a.topk_idx, a.topk_w, P.w13, P.w2, N, c.hidden, c.expert_dim, E, k, m.par.ep, s);
  } else {
    moe_forward(out, a.moe, a.ln2, a.topk_idx, a.topk_w, P.w13, P.w2, N, c.hidden, c.expert_dim, E, k, s);
  }
  if (c.shared_expert) {
    ensure_dense_routes(m, N);
    floatX* shared_out = pool().alloc_t<floatX>((size_t)N * c.hidden, Mem::Activations, "shared_out");
    moe_forward(shared_out, a.shared, a.ln2, m.dense_idx, m.dense_w, P.shared_w13, P.shared_w2, N, c.hidden,
                c.expert_dim, 1, 1, s);
    a.has_shared = true;
    add_inplace_or_out(out, out, shared_out, (size_t)N * c.hidden, s);
    pool().free(shared_out);
  }
}

// One transformer layer: x_out = x_mid + FFN(ln2(x_mid)), x_mid = x_in + wo·Attn(RoPE(wqkv·ln1(x_in))).
void layer_forward(Model& m, int l, const floatX* x_in, floatX* x_out, LayerActs& a, int B, int T, bool count_loads) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  const int N = B * T, H = c.hidden, nh = c.heads, hd = c.head_dim();
  cudaStream_t s = m.stream;
  a.ln1 = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "ln1");
  a.ln1_rstd = pool().alloc_t<float>(N, Mem::Activations, "ln1_rstd");
  a.qkv = pool().alloc_t<floatX>((size_t)N * 3 * H, Mem::Activations, "qkv");
  a.att = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "att");
  a.lse = pool().alloc_t<float>((size_t)N * nh, Mem::Activations, "att_lse");
  a.x_mid = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "x_mid");
  a.ln2 = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "ln2");
  a.ln2_rstd = pool().alloc_t<float>(N, Mem::Activations, "ln2_rstd");

  rmsnorm_forward(a.ln1, a.ln1_rstd, x_in, P.ln1, N, H, c.norm_eps, s);
  matmul_forward(a.qkv, a.ln1, P.wqkv, N, H, 3 * H, s);
  rope_forward(a.qkv, a.qkv, B, T, nh, hd, c.rope_theta, s);
  attention_forward(a.att, a.lse, a.qkv, B, T, nh, hd, s);
  floatX* att_proj = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "att_proj");
  matmul_forward(att_proj, a.att, P.wo, N, H, H, s);
  add_inplace_or_out(a.x_mid, x_in, att_proj, (size_t)N * H, s);
  pool().free(att_proj);

  rmsnorm_forward(a.ln2, a.ln2_rstd, a.x_mid, P.ln2, N, H, c.norm_eps, s);
  floatX* ffn_out = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "ffn_out");
  ffn_forward(m, l, a, ffn_out, N, count_loads);
  add_inplace_or_out(x_out, a.x_mid, ffn_out, (size_t)N * H, s);
  pool().free(ffn_out);
}

// =============================================================================================
// 4. Backward

// d_ln2 (=) from d_out (gradient of the FFN output); weight gradients +=.
void ffn_backward(Model& m, int l, const LayerActs& a, floatX* d_ln2, const floatX* d_out, int N) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  const LayerTensors& G = m.g.layers[l];
  cudaStream_t s = m.stream;
  const size_t NH = (size_t)N * c.hidden;
  if (!c.is_moe_layer(l)) {
    float* d_dense_w = pool().alloc_t<float>(N, Mem::Workspace, "d_dense_w");
    moe_backward(d_ln2, d_dense_w, G.dense_w13, G.dense_w2, d_out, a.moe, a.ln2, m.dense_idx, m.dense_w,
                 P.dense_w13, P.dense_w2, s);
    pool().free(d_dense_w);
    return;
  }
  const int E = c.experts, k = c.topk;
  float* d_topk_w = pool().alloc_t<float>((size_t)N * k, Mem::Workspace, "d_topk_w");
  if (a.expert_parallel)
    ep_moe_backward(d_ln2, d_topk_w, G.w13, G.w2, d_out, a.ep_moe, a.topk_w, P.w13, P.w2, m.par.ep, s);
  else
    moe_backward(d_ln2, d_topk_w, G.w13, G.w2, d_out, a.moe, a.ln2, a.topk_idx, a.topk_w, P.w13, P.w2, s);
  floatX* d_part = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_ln2_part");
  if (a.has_shared) {
    float* d_shared_w = pool().alloc_t<float>(N, Mem::Workspace, "d_shared_w");
    moe_backward(d_part, d_shared_w, G.shared_w13, G.shared_w2, d_out, a.shared, a.ln2, m.dense_idx, m.dense_w,
                 P.shared_w13, P.shared_w2, s);
    add_inplace_or_out(d_ln2, d_ln2, d_part, NH, s);
    pool().free(d_shared_w);
  }
  floatX* d_logits = pool().alloc_t<floatX>((size_t)N * E, Mem::Workspace, "d_router_logits");
  router_backward(d_logits, d_topk_w, a.scores, a.topk_idx, N, E, k, c.score_fn, c.renorm != 0, s);
  matmul_backward(d_part, G.router, d_logits, a.ln2, P.router, N, c.hidden, E, s);
  add_inplace_or_out(d_ln2, d_ln2, d_part, NH, s);
  for (void* p : {(void*)d_topk_w, (void*)d_part, (void*)d_logits}) pool().free(p);
}

// d_x (in: gradient of the layer output; out: gradient of the layer input).
void layer_backward(Model& m, int l, const LayerActs& a, const floatX* x_in, floatX* d_x, int B, int T) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  const LayerTensors& G = m.g.layers[l];
  const int N = B * T, H = c.hidden, nh = c.heads, hd = c.head_dim();
  const size_t NH = (size_t)N * H;
  cudaStream_t s = m.stream;
  floatX* d_norm_out = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_norm_out");
  floatX* d_branch = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_branch");
  floatX* d_qkv = pool().alloc_t<floatX>((size_t)N * 3 * H, Mem::Workspace, "d_qkv");

  // FFN branch: d_x_mid = d_x + ln2ᵀ(FFNᵀ(d_x))
  ffn_backward(m, l, a, d_norm_out, d_x, N);
  rmsnorm_backward(d_branch, G.ln2, d_norm_out, a.x_mid, P.ln2, a.ln2_rstd, N, H, s);
  add_inplace_or_out(d_x, d_x, d_branch, NH, s);

  // Attention branch: d_x_in = d_x_mid + ln1ᵀ(wqkvᵀ(RoPEᵀ(Attnᵀ(woᵀ d_x_mid))))
  matmul_backward(d_norm_out, G.wo, d_x, a.att, P.wo, N, H, H, s);
  attention_backward(d_qkv, d_norm_out, a.qkv, a.att, a.lse, B, T, nh, hd, s);
  rope_backward(d_qkv, d_qkv, B, T, nh, hd, c.rope_theta, s);
  matmul_backward(d_norm_out, G.wqkv, d_qkv, a.ln1, P.wqkv, N, H, 3 * H, s);
  rmsnorm_backward(d_branch, G.ln1, d_norm_out, x_in, P.ln1, a.ln1_rstd, N, H, s);
  add_inplace_or_out(d_x, d_x, d_branch, NH, s);
  for (void* p : {(void*)d_norm_out, (void*)d_branch, (void*)d_qkv}) pool().free(p);
}

// What a forward(+backward) pass over one micro-batch does.
struct PassOptions {
  bool backward = true;       // accumulate gradients (+=) into m.grads
  bool count_loads = true;    // add routes per expert into m.step_loads
  float dloss = 0.f;          // d(objective)/d(loss of one token), e.g. 1/(B·T·accum)
  int logits_row = -1;        // ≥ 0: copy the logits of this token row into logits_out (sampling)
  std::vector<float>* logits_out = nullptr;
  bool recompute = false;     // layer-level activation checkpointing
  std::vector<std::vector<int>>* routes_out = nullptr;  // tests: each MoE layer's top-k choices [N·k]
};

// inputs/targets: host [B·T]. Returns the mean loss over the B·T tokens.
float model_pass(Model& m, const int* inputs, const int* targets, int B, int T, const PassOptions& o) {
  const ModelConfig& c = m.cfg;
  const int N = B * T, H = c.hidden, V = c.vocab, L = c.layers;
  const size_t NH = (size_t)N * H;
  cudaStream_t s = m.stream;
  if (T > c.seq_len || T < 1) fm_fail("model_pass", "sequence longer than the model's seq_len", "T=%d seq_len=%d", T, c.seq_len);

  int* tokens_dev = pool().alloc_t<int>(N, Mem::Activations, "tokens");
  int* targets_dev = pool().alloc_t<int>(N, Mem::Activations, "targets");
  cudaCheck(cudaMemcpyAsync(tokens_dev, inputs, N * sizeof(int), cudaMemcpyHostToDevice, s), "model_pass", "N=%d", N);
  cudaCheck(cudaMemcpyAsync(targets_dev, targets, N * sizeof(int), cudaMemcpyHostToDevice, s), "model_pass", "N=%d", N);

  // Residual stream at every layer boundary: residual[l] is layer l's input (the checkpoint).
  std::vector<floatX*> residual(L + 1);
  for (int l = 0; l <= L; l++) residual[l] = pool().alloc_t<floatX>(NH, Mem::Checkpoints, "residual");
  std::vector<LayerActs> acts(L);
  embedding_forward(residual[0], tokens_dev, m.p.wte, N, H, V, s);
  if (o.routes_out) o.routes_out->assign(L, {});
  for (int l = 0; l < L; l++) {
    layer_forward(m, l, residual[l], residual[l + 1], acts[l], B, T, o.count_loads);
    if (o.routes_out && c.is_moe_layer(l)) {
      (*o.routes_out)[l].resize((size_t)N * c.topk);
      cudaCheck(cudaMemcpy((*o.routes_out)[l].data(), acts[l].topk_idx, (size_t)N * c.topk * sizeof(int),
                           cudaMemcpyDeviceToHost), "model_pass.routes_out", "N=%d k=%d", N, c.topk);
    }
    if (!o.backward || o.recompute) free_acts(acts[l]);
  }

  floatX* lnf = pool().alloc_t<floatX>(NH, Mem::Activations, "lnf");
  float* lnf_rstd = pool().alloc_t<float>(N, Mem::Activations, "lnf_rstd");
  floatX* logits = pool().alloc_t<floatX>((size_t)N * V, Mem::Logits, "logits");
  float* losses = pool().alloc_t<float>(N, Mem::Logits, "losses");
  float* lse = pool().alloc_t<float>(N, Mem::Logits, "lse");
  rmsnorm_forward(lnf, lnf_rstd, residual[L], m.p.lnf, N, H, c.norm_eps, s);
  matmul_forward(logits, lnf, m.p.lm_head, N, H, V, s);
  if (o.logits_row >= 0) {
    std::vector<floatX> row(V);
    cudaCheck(cudaMemcpyAsync(row.data(), logits + (size_t)o.logits_row * V, V * sizeof(floatX), cudaMemcpyDeviceToHost, s),
              "model_pass.logits_row", "V=%d", V);
    cudaCheck(cudaStreamSynchronize(s), "model_pass.logits_row", "V=%d", V);
    o.logits_out->resize(V);
    for (int v = 0; v < V; v++) (*o.logits_out)[v] = to_float(row[v]);
  }
  cross_entropy_forward(losses, lse, logits, targets_dev, N, V, s);
  loss_sum(m.scalar_dev, losses, N, s);
  float loss_total = 0.f;
  cudaCheck(cudaMemcpyAsync(&loss_total, m.scalar_dev, sizeof(float), cudaMemcpyDeviceToHost, s), "model_pass", "N=%d", N);

  if (o.backward) {
    // vocabulary projection and final norm
    cross_entropy_backward(logits, logits, lse, targets_dev, o.dloss, N, V, s);
    floatX* d_lnf = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_lnf");
    floatX* d_x = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_residual");
    matmul_backward(d_lnf, m.g.lm_head, logits, lnf, m.p.lm_head, N, H, V, s);
    pool().free(logits);
    logits = nullptr;
    rmsnorm_backward(d_x, m.g.lnf, d_lnf, residual[L], m.p.lnf, lnf_rstd, N, H, s);
    pool().free(d_lnf);
    // layers in reverse; with recompute, rebuild each layer's activations from its input first
    for (int l = L - 1; l >= 0; l--) {
      if (o.recompute) layer_forward(m, l, residual[l], residual[l + 1], acts[l], B, T, false);
      layer_backward(m, l, acts[l], residual[l], d_x, B, T);
      free_acts(acts[l]);
      pool().free(residual[l + 1]);
      residual[l + 1] = nullptr;
    }
    // embedding: deterministic per-token sums over host-built buckets
    TokenBuckets buckets = build_token_buckets(inputs, N, V);
    std::vector<int*> bucket_dev;
    for (const std::vector<int>* v : {&buckets.offsets, &buckets.positions, &buckets.used_ids}) {
      bucket_dev.push_back(pool().alloc_t<int>(v->size(), Mem::Workspace, "token_buckets"));
      cudaCheck(cudaMemcpyAsync(bucket_dev.back(), v->data(), v->size() * sizeof(int), cudaMemcpyHostToDevice, s),
                "embedding_backward", "N=%d V=%d", N, V);
    }
    embedding_backward(m.g.wte, d_x, bucket_dev[0], bucket_dev[1], bucket_dev[2], (int)buckets.used_ids.size(), V, H, s);
    cudaCheck(cudaStreamSynchronize(s), "model_pass", "N=%d", N);  // the host buckets must outlive the copies
    pool().free(d_x);
    for (int* p : bucket_dev) pool().free(p);
  }
  cudaCheck(cudaStreamSynchronize(s), "model_pass", "N=%d", N);
  for (void* p : {(void*)tokens_dev, (void*)targets_dev, (void*)lnf, (void*)lnf_rstd, (void*)logits, (void*)losses, (void*)lse})
    pool().free(p);
  for (floatX* r : residual) pool().free(r);
  return loss_total / N;
}

// =============================================================================================
// 5. Update

void model_zero_grads(Model& m) {
  cudaCheck(cudaMemsetAsync(m.grads, 0, m.num_params * sizeof(floatX), m.stream), "zero_grads", "P=%zu", m.num_params);
  std::fill(m.step_loads.begin(), m.step_loads.end(), 0);
}

// The mean of a per-rank value over all ranks (losses are averaged this way).
float mean_over_ranks(Model& m, float x) {
  if (m.par.world.size == 1) return x;
  cudaCheck(cudaMemcpyAsync(m.scalar_dev, &x, sizeof(float), cudaMemcpyHostToDevice, m.stream), "mean_over_ranks", "W=%d", m.par.world.size);
  all_reduce_sum(m.par.world, m.scalar_dev, m.scalar_dev, 1, m.stream);
  comm_sync(m.par.world, m.stream, "mean_over_ranks");  // before the copy: a pageable copy would wait without a timeout
  cudaCheck(cudaMemcpy(&x, m.scalar_dev, sizeof(float), cudaMemcpyDeviceToHost), "mean_over_ranks", "W=%d", m.par.world.size);
  return x / m.par.world.size;
}

// Sums each region's gradients over the ranks that hold it, leaving this rank's shard (ZeRO-1:
// in-place reduce-scatter; the rest of the buffer is not used until the next zeroing).
void reduce_scatter_grads(Model& m) {
  if (m.par.world.size > 1)
    reduce_scatter_sum(m.par.world, m.grads, m.grads + m.dense_shard_start, m.dense_shard, m.stream);
  if (m.par.expert_replicas.size > 1)
    reduce_scatter_sum(m.par.expert_replicas, m.grads + m.dense_padded, m.grads + m.expert_shard_start, m.expert_shard,
                       m.stream);
}

// Global gradient norm: every element of the model lies in exactly one rank's shard.
float model_grad_norm(Model& m) {
  cudaCheck(cudaMemsetAsync(m.sumsq_partials, 0, SUMSQ_BLOCKS * sizeof(float), m.stream), "grad_norm", "P=%zu", m.num_params);
  sumsq_accumulate(m.sumsq_partials, m.grads + m.dense_shard_start, m.dense_shard, m.stream);
  sumsq_accumulate(m.sumsq_partials, m.grads + m.expert_shard_start, m.expert_shard, m.stream);
  sumsq_finish(m.scalar_dev, m.sumsq_partials, m.stream);
  if (m.par.world.size > 1) all_reduce_sum(m.par.world, m.scalar_dev, m.scalar_dev, 1, m.stream);
  comm_sync(m.par.world, m.stream, "grad_norm");
  float sumsq = 0.f;
  cudaCheck(cudaMemcpy(&sumsq, m.scalar_dev, sizeof(float), cudaMemcpyDeviceToHost), "grad_norm", "P=%zu", m.num_params);
  return std::sqrt(sumsq);
}

// Adds the step's per-expert loads of every rank (the router bias sees the global batch).
void all_reduce_loads(Model& m) {
  if (m.par.world.size == 1) return;
  const size_t n = m.step_loads.size();
  std::vector<int> loads(m.step_loads.begin(), m.step_loads.end());
  int* loads_dev = pool().alloc_t<int>(n, Mem::CommStaging, "step_loads");
  cudaCheck(cudaMemcpyAsync(loads_dev, loads.data(), n * sizeof(int), cudaMemcpyHostToDevice, m.stream), "all_reduce_loads", "n=%zu", n);
  all_reduce_sum(m.par.world, loads_dev, loads_dev, n, m.stream);
  comm_sync(m.par.world, m.stream, "all_reduce_loads");
  cudaCheck(cudaMemcpy(loads.data(), loads_dev, n * sizeof(int), cudaMemcpyDeviceToHost), "all_reduce_loads", "n=%zu", n);
  pool().free(loads_dev);
  std::copy(loads.begin(), loads.end(), m.step_loads.begin());
}

// One optimizer step on this rank's shards: reduce-scatter the gradients, clip by the global norm,
// AdamW on the fp32 master shard (per tensor, for its weight decay), all-gather the updated floatX
// weights, then the router bias update from the global batch's loads. Returns the norm before
// clipping.
float model_update(Model& m, const TrainConfig& t, float lr) {
  reduce_scatter_grads(m);
  float norm = model_grad_norm(m);
  float scale = clip_scale(norm, t.grad_clip);
  m.adam_t++;
  // shard [start, start + count) of the local buffer ↔ master [master_off, master_off + count)
  auto update_shard = [&](size_t start, size_t count, size_t master_off) {
    for (size_t i = 0; i < m.specs.size(); i++) {
      size_t lo = std::max(start, m.offsets[i]), hi = std::min(start + count, m.offsets[i] + m.local_numel[i]);
      if (lo >= hi) continue;
      size_t mo = master_off + (lo - start);
      adamw_update(m.master + mo, m.params + lo, m.adam_m + mo, m.adam_v + mo, m.grads + lo, hi - lo, lr, t.beta1,
                   t.beta2, t.adam_eps, m.specs[i].decay ? t.weight_decay : 0.f, m.adam_t, scale, m.stream);
    }
  };
  update_shard(m.dense_shard_start, m.dense_shard, 0);
  update_shard(m.expert_shard_start, m.expert_shard, m.dense_shard);
  if (m.par.world.size > 1) all_gather(m.par.world, m.params + m.dense_shard_start, m.params, m.dense_shard, m.stream);
  if (m.par.expert_replicas.size > 1)
    all_gather(m.par.expert_replicas, m.params + m.expert_shard_start, m.params + m.dense_padded, m.expert_shard, m.stream);
  // aux-loss-free balancing from the step's loads over the whole global batch (config.hpp)
  if (t.bias_update > 0) {
    all_reduce_loads(m);
    update_router_bias(m.router_bias, m.step_loads, m.cfg, t.bias_update);
    model_upload_router_bias(m);
  }
  return norm;
}

// One optimizer step: zero the gradients, accumulate over `accum` micro-batches drawn from
// next_batch(inputs, targets), then update. Returns the mean loss; *grad_norm gets the norm.
template <typename NextBatch>
float train_step(Model& m, const TrainConfig& t, int step, int B, int T, int accum, NextBatch next_batch,
                 float* grad_norm) {
  std::vector<int> x((size_t)B * T), y((size_t)B * T);
  model_zero_grads(m);
  PassOptions o;
  o.dloss = 1.f / ((float)B * T * accum * m.par.world.size);  // the mean over the global batch
  o.recompute = t.recompute != 0;
  double loss = 0;
  for (int micro = 0; micro < accum; micro++) {
    next_batch(x.data(), y.data());
    pool().mark(("micro-batch " + std::to_string(micro)).c_str());
    loss += model_pass(m, x.data(), y.data(), B, T, o) / accum;
  }
  pool().mark("optimizer");
  float norm = model_update(m, t, lr_at(t, step));
  comm_sync(m.par.world, m.stream, "train_step");
  if (grad_norm) *grad_norm = norm;
  return mean_over_ranks(m, (float)loss);
}

// =============================================================================================
// 6. Checkpoints. A checkpoint is a directory with one file per rank, rankR.bin: a header of 256
// int32 (magic, version, precision, W, E_p, rank, step, shard sizes, model configuration, data
// position), then this rank's shards of the fp32 master weights, Adam m and Adam v, then the router
// biases. Every rank writes into DIR.tmp/, and after all have finished rank 0 renames it to DIR,
// so an interrupted save never replaces a good checkpoint. Resume needs the same W and E_p.

static const int CKPT_MAGIC = 20261130;
static const int CKPT_VERSION = 2;

struct TrainState {
  int step = 0;              // optimizer steps completed
  DataLoader::State train_data{};
  unsigned long long sample_rng_draws = 0;
};

void header_put_config(int* h, const ModelConfig& c) {
  int* f = h + 16;
  f[0] = c.vocab; f[1] = c.hidden; f[2] = c.layers; f[3] = c.heads; f[4] = c.experts; f[5] = c.topk;
  f[6] = c.expert_dim; f[7] = c.n_dense; f[8] = c.dense_dim; f[9] = c.shared_expert; f[10] = c.seq_len;
  f[11] = c.score_fn; f[12] = c.renorm;
  memcpy(&f[13], &c.rope_theta, 4); memcpy(&f[14], &c.norm_eps, 4); memcpy(&f[15], &c.init_std, 4);
}

ModelConfig header_get_config(const int* h) {
  const int* f = h + 16;
  ModelConfig c;
  c.vocab = f[0]; c.hidden = f[1]; c.layers = f[2]; c.heads = f[3]; c.experts = f[4]; c.topk = f[5];
  c.expert_dim = f[6]; c.n_dense = f[7]; c.dense_dim = f[8]; c.shared_expert = f[9]; c.seq_len = f[10];
  c.score_fn = f[11]; c.renorm = f[12];
  memcpy(&c.rope_theta, &f[13], 4); memcpy(&c.norm_eps, &f[14], 4); memcpy(&c.init_std, &f[15], 4);
  return c;
}

void put_u64(int* slot, unsigned long long v) { memcpy(slot, &v, 8); }
unsigned long long get_u64(const int* slot) { unsigned long long v; memcpy(&v, slot, 8); return v; }

std::string rank_file(const std::string& dir, int rank) { return dir + "/rank" + std::to_string(rank) + ".bin"; }

// Every rank reaches this point before any goes on.
void barrier(Model& m, const char* what) {
  if (m.par.world.size == 1) return;
  all_reduce_sum(m.par.world, m.scalar_dev, m.scalar_dev, 1, m.stream);
  comm_sync(m.par.world, m.stream, what);
}

void checkpoint_save(const std::string& dir, Model& m, const TrainState& st) {
  const size_t S = m.shard_count();
  std::vector<int> header(256, 0);
  header[0] = CKPT_MAGIC;
  header[1] = CKPT_VERSION;
  header[2] = sizeof(floatX) == 2 ? 1 : 0;
  header[3] = st.step;
  header[4] = m.adam_t;
  header[7] = (int)m.router_bias.size();
  header[8] = m.par.world.size;
  header[9] = m.par.ep.size;
  header[10] = m.par.world.rank;
  put_u64(&header[11], m.dense_shard);
  put_u64(&header[13], m.expert_shard);
  put_u64(&header[40], (unsigned long long)st.train_data.shard);
  put_u64(&header[42], (unsigned long long)st.train_data.position);
  put_u64(&header[44], (unsigned long long)st.train_data.epoch);
  put_u64(&header[46], st.sample_rng_draws);
  header_put_config(header.data(), m.cfg);

  const std::string tmp_dir = dir + ".tmp";
  if (m.par.world.rank == 0) {
    std::string cmd = "rm -rf '" + tmp_dir + "'";
    if (system(cmd.c_str()) != 0 || mkdir(tmp_dir.c_str(), 0755) != 0)
      throw std::runtime_error("cannot create checkpoint directory " + tmp_dir + ": " + strerror(errno));
  }
  barrier(m, "checkpoint_save.mkdir");
  std::vector<float> buf(S);
  const std::string path = rank_file(tmp_dir, m.par.world.rank), part = path + ".part";
  FILE* f = fopen(part.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write checkpoint " + part + ": " + strerror(errno));
  bool ok = fwrite(header.data(), sizeof(int), 256, f) == 256;
  for (const float* src : {m.master, m.adam_m, m.adam_v}) {
    cudaCheck(cudaMemcpy(buf.data(), src, S * sizeof(float), cudaMemcpyDeviceToHost), "checkpoint_save", "shard=%zu", S);
    ok = ok && fwrite(buf.data(), sizeof(float), S, f) == S;
  }
  ok = ok && fwrite(m.router_bias.data(), sizeof(float), m.router_bias.size(), f) == m.router_bias.size();
  ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(part.c_str(), path.c_str()) != 0) {
    remove(part.c_str());
    throw std::runtime_error("writing checkpoint " + path + " failed: " + strerror(errno));
  }
  barrier(m, "checkpoint_save.files");
  if (m.par.world.rank == 0) {
    const std::string old_dir = dir + ".old";
    struct stat sb;
    bool had_old = stat(dir.c_str(), &sb) == 0;
    if ((had_old && rename(dir.c_str(), old_dir.c_str()) != 0) || rename(tmp_dir.c_str(), dir.c_str()) != 0)
      throw std::runtime_error("cannot move checkpoint " + tmp_dir + " to " + dir + ": " + strerror(errno));
    if (had_old && system(("rm -rf '" + old_dir + "'").c_str()) != 0)
      fprintf(stderr, "warning: could not remove %s\n", old_dir.c_str());
  }
  barrier(m, "checkpoint_save.rename");
}

// Reads this rank's file of a checkpoint directory into a fresh model. Every mismatch is refused
// with a message that names the file; nothing touches the GPU before the file has been checked.
Model checkpoint_load(const std::string& dir, TrainState& st, const Parallel& par = Parallel(), cudaStream_t stream = 0) {
  const std::string path = rank_file(dir, par.world.rank);
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open checkpoint " + path + ": " + strerror(errno));
  std::vector<int> header(256);
  if (fread(header.data(), sizeof(int), 256, f) != 256) {
    fclose(f);
    throw std::runtime_error("checkpoint " + path + " is truncated (no complete 1024-byte header)");
  }
  auto refuse = [&](const std::string& why) {
    if (f) fclose(f);
    throw std::runtime_error("checkpoint " + path + ": " + why);
  };
  if (header[0] != CKPT_MAGIC) refuse("bad magic number (not a flatmoe checkpoint)");
  if (header[1] != CKPT_VERSION) refuse("unsupported version " + std::to_string(header[1]));
  ModelConfig cfg = header_get_config(header.data());
  try {
    validate(cfg);
  } catch (const std::exception& e) {
    refuse(std::string("invalid model configuration in header: ") + e.what());
  }
  if (header[2] != (sizeof(floatX) == 2 ? 1 : 0))
    refuse(std::string("written by the ") + (header[2] ? "BF16" : "FP32") + " build; this is the " + FLATMOE_PRECISION_NAME + " build");
  if (header[8] != par.world.size || header[9] != par.ep.size || header[10] != par.world.rank)
    refuse("written by rank " + std::to_string(header[10]) + " of W=" + std::to_string(header[8]) + " (E_p=" +
           std::to_string(header[9]) + "); this is rank " + std::to_string(par.world.rank) + " of W=" +
           std::to_string(par.world.size) + " (E_p=" + std::to_string(par.ep.size) + ")");
  if (header[7] != cfg.layers * cfg.experts) refuse("router bias count does not match its configuration");
  const size_t dense_shard = get_u64(&header[11]), expert_shard = get_u64(&header[13]), S = dense_shard + expert_shard;
  if (S > param_count(cfg)) refuse("shard sizes do not match its configuration");
  struct stat sb;
  size_t expected = 1024 + (3 * S + (size_t)header[7]) * sizeof(float);
  if (fstat(fileno(f), &sb) != 0 || (size_t)sb.st_size != expected)
    refuse("size " + std::to_string((long long)sb.st_size) + " bytes, expected " + std::to_string(expected) +
           " (truncated or corrupt)");
  std::vector<float> master(S), adam_m(S), adam_v(S);
  bool ok = fread(master.data(), sizeof(float), S, f) == S && fread(adam_m.data(), sizeof(float), S, f) == S &&
            fread(adam_v.data(), sizeof(float), S, f) == S;
  std::vector<float> bias(header[7]);
  ok = ok && fread(bias.data(), sizeof(float), bias.size(), f) == bias.size();
  fclose(f);
  f = nullptr;
  if (!ok) refuse("cannot read its contents");

  Model m = model_create(cfg, 0, par, stream);
  if (m.dense_shard != dense_shard || m.expert_shard != expert_shard) {
    model_destroy(m);
    refuse("shard sizes do not match this build's layout");
  }
  for (auto [dst, src] : {std::pair<float*, float*>{m.master, master.data()}, {m.adam_m, adam_m.data()}, {m.adam_v, adam_v.data()}})
    cudaCheck(cudaMemcpy(dst, src, S * sizeof(float), cudaMemcpyHostToDevice), "checkpoint_load", "shard=%zu", S);
  // the floatX weights of this rank's shards, then everyone's
  convert(m.params + m.dense_shard_start, m.master, m.dense_shard, m.stream);
  convert(m.params + m.expert_shard_start, m.master + m.dense_shard, m.expert_shard, m.stream);
  if (m.par.world.size > 1) all_gather(m.par.world, m.params + m.dense_shard_start, m.params, m.dense_shard, m.stream);
  if (m.par.expert_replicas.size > 1)
    all_gather(m.par.expert_replicas, m.params + m.expert_shard_start, m.params + m.dense_padded, m.expert_shard, m.stream);
  comm_sync(m.par.world, m.stream, "checkpoint_load");
  m.router_bias = bias;
  model_upload_router_bias(m);
  m.adam_t = header[4];
  st.step = header[3];
  st.train_data.shard = (int)get_u64(&header[40]);
  st.train_data.position = (long long)get_u64(&header[42]);
  st.train_data.epoch = (long long)get_u64(&header[44]);
  st.sample_rng_draws = get_u64(&header[46]);
  return m;
}

// =============================================================================================
// 7. The training loop

// Draws a token from softmax(logits) with a uniform u in [0, 1).
int sample_token(const std::vector<float>& logits, float u) {
  float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp((double)x - mx);
  double acc = 0;
  for (size_t i = 0; i < logits.size(); i++) {
    acc += std::exp((double)logits[i] - mx) / sum;
    if (u < acc) return (int)i;
  }
  return (int)logits.size() - 1;
}

// Autoregressive sample from EOT, the whole context recomputed each token (llm.c style).
std::string generate_sample(Model& m, const Tokenizer& tok, int len, std::mt19937_64& rng, unsigned long long& draws) {
  const int T = m.cfg.seq_len;
  std::vector<int> ctx(T, tok.eot()), targets(T, 0);
  std::vector<int> generated;
  std::vector<float> row;
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  for (int t = 1; t < std::min(len + 1, T); t++) {
    PassOptions o;
    o.backward = false;
    o.count_loads = false;
    o.logits_row = t - 1;
    o.logits_out = &row;
    model_pass(m, ctx.data(), targets.data(), 1, T, o);
    int next = sample_token(row, uni(rng));
    draws++;
    ctx[t] = next;
    if (next == tok.eot()) break;
    generated.push_back(next);
  }
  return tok.decode(generated);
}

float validation_loss(Model& m, DataLoader& val, int batches, int B, int T) {
  val.reset();
  std::vector<int> x((size_t)B * T), y((size_t)B * T);
  double sum = 0;
  PassOptions o;
  o.backward = false;
  o.count_loads = false;
  for (int i = 0; i < batches; i++) {
    val.next_batch(x.data(), y.data());
    sum += model_pass(m, x.data(), y.data(), B, T, o);
  }
  return mean_over_ranks(m, batches > 0 ? (float)(sum / batches) : 0.f);
}

void make_dirs(const std::string& path) {
  std::string cur;
  for (size_t i = 0; i <= path.size(); i++) {
    if (i == path.size() || path[i] == '/') {
      if (!cur.empty()) mkdir(cur.c_str(), 0755);
    }
    if (i < path.size()) cur += path[i];
  }
  struct stat sb;
  if (stat(path.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode)) throw std::runtime_error("cannot create directory " + path);
}

void print_config(const ModelConfig& c, const TrainConfig& t, const Model& m, int accum, double peak_flops) {
  printf("+----------------------+------------------------------+\n");
  auto row = [](const char* k, const std::string& v) { printf("| %-20s | %-28s |\n", k, v.c_str()); };
  row("precision", FLATMOE_PRECISION_NAME);
  row("vocab V", std::to_string(c.vocab));
  row("hidden H", std::to_string(c.hidden));
  row("layers L", std::to_string(c.layers) + " (" + std::to_string(c.n_dense) + " dense)");
  row("heads nh / hd", std::to_string(c.heads) + " / " + std::to_string(c.head_dim()));
  row("experts E / top-k", std::to_string(c.experts) + " / " + std::to_string(c.topk));
  row("expert_dim I", std::to_string(c.expert_dim) + (c.shared_expert ? " (+ shared expert)" : ""));
  row("router", std::string(c.score_fn ? "sigmoid" : "softmax") + (c.renorm ? ", renormalised" : ""));
  row("seq_len T", std::to_string(c.seq_len));
  row("parameters", std::to_string(param_count(c)) + " (" + std::to_string(active_param_count(c)) + " active)");
  row("ranks W / E_p", std::to_string(m.par.world.size) + " / " + std::to_string(m.par.ep.size));
  row("batch B / accum", std::to_string(t.batch) + " / " + std::to_string(accum) + " per rank");
  row("tokens per step", std::to_string((long long)t.batch * c.seq_len * accum * m.par.world.size));
  row("steps / warmup", std::to_string(t.steps) + " / " + std::to_string(t.warmup));
  char buf[64];
  snprintf(buf, sizeof buf, "%.2e -> %.2e", t.lr, t.lr * t.min_lr_frac);
  row("lr (cosine)", buf);
  snprintf(buf, sizeof buf, "%.3g / %.3g", t.weight_decay, t.grad_clip);
  row("weight decay / clip", buf);
  snprintf(buf, sizeof buf, "%.3g", t.bias_update);
  row("router bias u", buf);
  row("recompute", t.recompute ? "layer-level" : "off");
  row("routing", t.routing);
  snprintf(buf, sizeof buf, "%.0f TFLOP/s", peak_flops / 1e12);
  row("MFU peak basis", buf);
  row("out dir", t.out_dir);
  printf("+----------------------+------------------------------+\n");
  printf("memory: weights %.1f MiB, grads %.1f MiB, optimizer %.1f MiB\n", pool().live(Mem::Weights) / 1048576.0,
         pool().live(Mem::Grads) / 1048576.0, pool().live(Mem::Optimizer) / 1048576.0);
}

// Dense peak of the GPU's matrix units for MFU: H100/H200 SXM datasheet (dense bf16 989 TFLOP/s,
// fp32 67 TFLOP/s). MFU = flops_per_token · tokens/s / peak.
double peak_flops_for_build() { return sizeof(floatX) == 2 ? 989e12 : 67e12; }

void write_timeline(const std::string& out_dir, int step) {
  std::string csv = out_dir + "/timeline_step" + std::to_string(step) + ".csv";
  if (!pool().write_csv(csv.c_str())) {
    fprintf(stderr, "warning: could not write %s\n", csv.c_str());
    return;
  }
  std::string png = out_dir + "/timeline_step" + std::to_string(step) + ".png";
  std::string cmd = "tools/plot_timeline.sh '" + csv + "' '" + png + "' > /dev/null 2>&1";
  bool plotted = system(cmd.c_str()) == 0;
  printf("memory timeline of step %d: %s%s\n", step, csv.c_str(), plotted ? (", plot " + png).c_str() : " (no plot: gnuplot missing)");
}

// The communicators of W ranks: the world, the expert-parallel groups (contiguous blocks of E_p
// ranks) and the groups of ranks that hold the same expert shard.
Parallel parallel_init(const LaunchInfo& li, int ep_size) {
  Parallel par;
  if (li.world == 1) {
    cudaCheck(cudaSetDevice(0), "parallel_init", "W=1");
    return par;
  }
  par.world = comm_world_init(li);
  par.ep = comm_block_group(par.world, ep_size, "ep");
  par.expert_replicas = comm_split(par.world, par.world.rank % ep_size, par.world.rank, "expert_replicas");
  return par;
}

void parallel_destroy(Parallel& par) {
  for (Comm* c : {&par.expert_replicas, &par.ep, &par.world}) comm_destroy(*c);
}

int train_main(int argc, char** argv) {
  ModelConfig mc;
  TrainConfig tc;
  try {
    parse_flags(argc, argv, mc, tc);
  } catch (const FlagError& e) {
    if (std::string(e.what()) == "help") {
      printf("%s", usage().c_str());
      return 0;
    }
    fprintf(stderr, "train: error: %s\n%s", e.what(), usage().c_str());
    return 1;
  }
  try {
    Tokenizer tok = Tokenizer::load(tc.tokenizer);
    if (mc.vocab == 0) mc.vocab = tok.vocab_size();
    if (mc.vocab < tok.vocab_size())
      throw std::invalid_argument("--vocab " + std::to_string(mc.vocab) + " is smaller than the tokenizer's " +
                                  std::to_string(tok.vocab_size()));
    validate(mc);
    validate(tc, mc);
    { DataLoader check_train(tc.train_pattern, tc.batch, mc.seq_len), check_val(tc.val_pattern, tc.batch, mc.seq_len); }
    RoutingProfile routing;
    if (tc.routing != "router") {
      routing = parse_routing_profile(tc.routing);
      routing_profile_indices(routing, tc.batch * mc.seq_len, mc.experts, mc.topk);  // refuses h > E
    }
    const int gpus = gpu_count();
    if (gpus == 0) {
      fprintf(stderr, "train: error: no CUDA device found; flatmoe trains on NVIDIA GPUs (see README)\n");
      return 1;
    }
    // W processes, one per GPU: started here (--gpus W) or by mpirun/srun; the launching parent
    // waits for its children and never returns from launch().
    if (tc.gpus > gpus && getenv("FLATMOE_RANK") == nullptr)
      throw std::invalid_argument("--gpus " + std::to_string(tc.gpus) + " but this node has " + std::to_string(gpus) + " CUDA devices");
    LaunchInfo li = launch(argc, argv, tc.gpus);
    if (tc.gpus != 1 && tc.gpus != li.world)
      throw std::invalid_argument("--gpus " + std::to_string(tc.gpus) + " differs from the " + std::to_string(li.world) +
                                  " ranks started by the launcher");
    tc.gpus = li.world;
    validate(tc, mc);
    Parallel par = parallel_init(li, tc.ep ? tc.ep : tc.gpus);
    const bool main_rank = par.world.rank == 0;
    const int W = par.world.size;
    DataLoader train_data(tc.train_pattern, tc.batch, mc.seq_len, par.world.rank, W);
    DataLoader val_data(tc.val_pattern, tc.batch, mc.seq_len, par.world.rank, W);
    make_dirs(tc.out_dir);

    const int B = tc.batch, T = mc.seq_len;
    const int accum = tc.total_batch ? tc.total_batch / (B * T) : 1;
    cudaStream_t stream;
    cudaCheck(cudaStreamCreate(&stream), "train", "stream");
    TrainState st;
    Model m;
    if (!tc.resume.empty()) {
      m = checkpoint_load(tc.resume, st, par, stream);
      if (memcmp(&m.cfg, &mc, sizeof(ModelConfig)) != 0)
        throw std::invalid_argument("--resume " + tc.resume + ": its model configuration differs from the flags");
      train_data.set_state(st.train_data);
      if (main_rank) printf("resumed from %s at step %d\n", tc.resume.c_str(), st.step);
    } else {
      m = model_create(mc, tc.seed, par, stream);
    }
    m.routing_override = tc.routing != "router";
    m.routing = routing;
    const double peak_flops = peak_flops_for_build() * W;
    if (main_rank) print_config(mc, tc, m, accum, peak_flops / W);

    std::mt19937_64 sample_rng(tc.seed ^ 0x5eedULL);
    sample_rng.discard(st.sample_rng_draws);
    const double tokens_per_step = (double)B * T * accum * W;
    const double flops_per_step = flops_per_token(mc) * tokens_per_step;
    FILE* log = nullptr;
    if (main_rank) {
      std::string log_path = tc.out_dir + "/log.csv";
      log = fopen(log_path.c_str(), st.step > 0 ? "a" : "w");
      if (!log) throw std::runtime_error("cannot write " + log_path);
      if (st.step == 0) fprintf(log, "step,train_loss,val_loss,lr,grad_norm,ms,tokens_per_s,mfu,peak_alloc_mib\n");
    }

    const int first_step = st.step;
    for (int step = first_step; step <= tc.steps; step++) {
      bool last = step == tc.steps;
      bool resumed_here = step == first_step && first_step > 0;  // already sampled/saved before the resume
      if (tc.val_every > 0 && (step % tc.val_every == 0 || last)) {
        float val_loss = validation_loss(m, val_data, tc.val_batches, B, T);
        if (main_rank) {
          printf("step %5d | val loss %.4f\n", step, val_loss);
          fprintf(log, "%d,nan,%.6f,nan,nan,nan,nan,nan,nan\n", step, val_loss);
        }
      }
      if (tc.sample_every > 0 && step > 0 && !resumed_here && (step % tc.sample_every == 0 || last)) {
        // every rank samples the same context (same weights, same generator): expert-parallel
        // layers need all of them in every collective
        std::string text = generate_sample(m, tok, tc.sample_len, sample_rng, st.sample_rng_draws);
        if (main_rank) printf("---- sample at step %d ----\n%s\n---------------------------\n", step, text.c_str());
      }
      if (step > 0 && !resumed_here && tc.ckpt_every > 0 && (step % tc.ckpt_every == 0 || last)) {
        st.step = step;
        st.train_data = train_data.state();
        char name[64];
        snprintf(name, sizeof name, "/ckpt_%06d", step);
        checkpoint_save(tc.out_dir + name, m, st);
        if (main_rank) printf("checkpoint written: %s%s\n", tc.out_dir.c_str(), name);
      }
      if (last) break;

      // one optimizer step: accumulate gradients over `accum` micro-batches on every rank
      bool timeline = step == tc.timeline_step && main_rank;
      pool().reset_peak();
      if (timeline) { pool().clear_timeline(); pool().set_timeline(true); }
      cudaCheck(cudaStreamSynchronize(stream), "train", "step=%d", step);
      auto t0 = std::chrono::steady_clock::now();
      float norm = 0.f, lr = lr_at(tc, step);
      double loss = train_step(m, tc, step, B, T, accum, [&](int* xb, int* yb) { train_data.next_batch(xb, yb); }, &norm);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (timeline) { pool().set_timeline(false); write_timeline(tc.out_dir, step); }
      if (!std::isfinite(loss)) throw std::runtime_error("loss is not finite at step " + std::to_string(step));
      if (!main_rank) continue;
      double tok_s = tokens_per_step / (ms / 1e3);
      double mfu = flops_per_step / (ms / 1e3) / peak_flops;
      size_t free_b = 0, total_b = 0;
      cudaCheck(cudaMemGetInfo(&free_b, &total_b), "train", "meminfo");
      if (step % tc.log_every == 0 || step == tc.steps - 1)
        printf("step %5d/%d | loss %.4f | lr %.2e | norm %.3f | %.1f ms | %.0f tok/s | MFU %.1f%% | peak %.1f MiB "
               "(device used %.1f MiB)%s\n",
               step + 1, tc.steps, loss, lr, norm, ms, tok_s, 100 * mfu, pool().peak() / 1048576.0,
               (total_b - free_b) / 1048576.0, W > 1 ? " [rank 0]" : "");
      fprintf(log, "%d,%.6f,nan,%.6e,%.6f,%.3f,%.1f,%.5f,%.2f\n", step + 1, loss, lr, norm, ms, tok_s, mfu,
              pool().peak() / 1048576.0);
      fflush(log);
    }
    if (log) fclose(log);
    model_destroy(m);
    parallel_destroy(par);
    cudaCheck(cudaStreamDestroy(stream), "train", "stream");
  } catch (const std::exception& e) {
    fprintf(stderr, "train: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

#ifndef FLATMOE_NO_MAIN
int main(int argc, char** argv) { return train_main(argc, argv); }
#endif
