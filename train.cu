// train.cu — the flatmoe trainer, one translation unit like llm.c. Read it top to bottom:
//   1. configuration (config.hpp: flags, validation, parameter layout)
//   2. the model: parameters, gradients, optimizer state, router biases — all in the pool
//   3. forward: embedding → L × [RMSNorm → attention (RoPE) → residual → RMSNorm → FFN (MoE) →
//      residual] → RMSNorm → vocabulary projection → cross-entropy
//   4. backward: the same in reverse; with --recompute 1 only each layer's input is kept and the
//      layer is recomputed just before its backward (layer-level activation checkpointing)
//   5. update: global-norm clipping, AdamW on fp32 master weights, aux-loss-free router bias update
//   6. checkpoints (atomic, versioned header) and resume that continues bit for bit
//   7. the training loop: accumulation, LR schedule, validation, samples, logs, memory report
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
#include "data/tokenizer.hpp"
#include "ops/adamw.cuh"
#include "ops/attention.cuh"
#include "ops/common.cuh"
#include "ops/cross_entropy.cuh"
#include "ops/embedding.cuh"
#include "ops/matmul.cuh"
#include "ops/moe.cuh"
#include "ops/pool.cuh"
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

struct Model {
  ModelConfig cfg;
  std::vector<ParamSpec> specs;
  std::vector<size_t> offsets;  // element offset of each spec in the flat buffers
  size_t num_params = 0;

  floatX* params = nullptr;  // [num_params] floatX weights the kernels read      (Weights)
  floatX* grads = nullptr;   // [num_params] gradients, accumulated over a step   (Grads)
  float* master = nullptr;   // [num_params] fp32 master weights                  (Optimizer)
  float* adam_m = nullptr;   // [num_params]                                      (Optimizer)
  float* adam_v = nullptr;   // [num_params]                                      (Optimizer)
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

// Copies host fp32 master weights into the model (master and the floatX weights).
void model_set_master(Model& m, const std::vector<float>& master) {
  if (master.size() != m.num_params)
    fm_fail("model_set_master", "wrong number of parameters", "got=%zu expected=%zu", master.size(), m.num_params);
  cudaCheck(cudaMemcpy(m.master, master.data(), m.num_params * sizeof(float), cudaMemcpyHostToDevice),
            "model_set_master", "P=%zu", m.num_params);
  convert(m.params, m.master, m.num_params, m.stream);
  cudaCheck(cudaStreamSynchronize(m.stream), "model_set_master", "P=%zu", m.num_params);
}

void model_upload_router_bias(Model& m) {
  if (m.router_bias.empty()) return;
  cudaCheck(cudaMemcpy(m.router_bias_dev, m.router_bias.data(), m.router_bias.size() * sizeof(float),
                       cudaMemcpyHostToDevice),
            "router_bias", "n=%zu", m.router_bias.size());
}

Model model_create(const ModelConfig& cfg, unsigned long long seed) {
  validate(cfg);
  Model m;
  m.cfg = cfg;
  m.specs = param_specs(cfg);
  for (const ParamSpec& s : m.specs) {
    m.offsets.push_back(m.num_params);
    m.num_params += s.numel();
  }
  const size_t P = m.num_params;
  m.params = pool().alloc_t<floatX>(P, Mem::Weights, "params");
  m.grads = pool().alloc_t<floatX>(P, Mem::Grads, "grads");
  m.master = pool().alloc_t<float>(P, Mem::Optimizer, "master");
  m.adam_m = pool().alloc_t<float>(P, Mem::Optimizer, "adam_m");
  m.adam_v = pool().alloc_t<float>(P, Mem::Optimizer, "adam_v");
  cudaCheck(cudaMemset(m.grads, 0, P * sizeof(floatX)), "model_create", "P=%zu", P);
  cudaCheck(cudaMemset(m.adam_m, 0, P * sizeof(float)), "model_create", "P=%zu", P);
  cudaCheck(cudaMemset(m.adam_v, 0, P * sizeof(float)), "model_create", "P=%zu", P);
  m.p = view_tensors(m.params, m);
  m.g = view_tensors(m.grads, m);
  const size_t LE = (size_t)cfg.layers * cfg.experts;
  m.router_bias.assign(LE, 0.f);
  m.step_loads.assign(LE, 0);
  m.router_bias_dev = pool().alloc_t<float>(LE, Mem::Weights, "router_bias");
  model_upload_router_bias(m);
  m.sumsq_partials = pool().alloc_t<float>(SUMSQ_BLOCKS, Mem::Workspace, "sumsq_partials");
  m.scalar_dev = pool().alloc_t<float>(1, Mem::Workspace, "scalar");
  model_set_master(m, init_master_weights(cfg, seed));
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
  MoESaved moe{};               // routed experts, or the dense FFN
  MoESaved shared{};            // shared expert
  bool has_shared = false;
};

void free_acts(LayerActs& a) {
  for (void* p : {(void*)a.ln1, (void*)a.ln1_rstd, (void*)a.qkv, (void*)a.att, (void*)a.lse, (void*)a.x_mid,
                  (void*)a.ln2, (void*)a.ln2_rstd, (void*)a.scores, (void*)a.topk_idx, (void*)a.topk_w})
    pool().free(p);
  moe_saved_free(a.moe);
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
  if (count_loads) {
    int* loads_dev = pool().alloc_t<int>(E, Mem::Workspace, "loads");
    std::vector<int> loads(E);
    router_count_loads(loads_dev, a.topk_idx, N, E, k, s);
    cudaCheck(cudaMemcpyAsync(loads.data(), loads_dev, E * sizeof(int), cudaMemcpyDeviceToHost, s), "count_loads", "E=%d", E);
    cudaCheck(cudaStreamSynchronize(s), "count_loads", "E=%d", E);
    pool().free(loads_dev);
    for (int e = 0; e < E; e++) m.step_loads[(size_t)l * E + e] += loads[e];
  }
  moe_forward(out, a.moe, a.ln2, a.topk_idx, a.topk_w, P.w13, P.w2, N, c.hidden, c.expert_dim, E, k, s);
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

float model_grad_norm(Model& m) {
  cudaCheck(cudaMemsetAsync(m.sumsq_partials, 0, SUMSQ_BLOCKS * sizeof(float), m.stream), "grad_norm", "P=%zu", m.num_params);
  sumsq_accumulate(m.sumsq_partials, m.grads, m.num_params, m.stream);
  sumsq_finish(m.scalar_dev, m.sumsq_partials, m.stream);
  float sumsq = 0.f;
  cudaCheck(cudaMemcpyAsync(&sumsq, m.scalar_dev, sizeof(float), cudaMemcpyDeviceToHost, m.stream), "grad_norm", "P=%zu", m.num_params);
  cudaCheck(cudaStreamSynchronize(m.stream), "grad_norm", "P=%zu", m.num_params);
  return std::sqrt(sumsq);
}

// Clip by global norm, one AdamW step on every tensor, then the router bias update from the
// step's loads. Returns the gradient norm before clipping.
float model_update(Model& m, const TrainConfig& t, float lr) {
  float norm = model_grad_norm(m);
  float scale = clip_scale(norm, t.grad_clip);
  m.adam_t++;
  for (size_t i = 0; i < m.specs.size(); i++) {
    size_t off = m.offsets[i];
    adamw_update(m.master + off, m.params + off, m.adam_m + off, m.adam_v + off, m.grads + off, m.specs[i].numel(), lr,
                 t.beta1, t.beta2, t.adam_eps, m.specs[i].decay ? t.weight_decay : 0.f, m.adam_t, scale, m.stream);
  }
  // aux-loss-free balancing from the step's loads (config.hpp)
  if (t.bias_update > 0) {
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
  o.dloss = 1.f / ((float)B * T * accum);
  o.recompute = t.recompute != 0;
  double loss = 0;
  for (int micro = 0; micro < accum; micro++) {
    next_batch(x.data(), y.data());
    pool().mark(("micro-batch " + std::to_string(micro)).c_str());
    loss += model_pass(m, x.data(), y.data(), B, T, o) / accum;
  }
  pool().mark("optimizer");
  float norm = model_update(m, t, lr_at(t, step));
  cudaCheck(cudaStreamSynchronize(m.stream), "train_step", "step=%d", step);
  if (grad_norm) *grad_norm = norm;
  return (float)loss;
}

// =============================================================================================
// 6. Checkpoints: header of 256 int32 (magic, version, precision, config, step, data position),
// then fp32 master weights, Adam m, Adam v, router biases. Written to a temporary file and renamed,
// so an interrupted write never replaces a good checkpoint.

static const int CKPT_MAGIC = 20261130;
static const int CKPT_VERSION = 1;

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

void checkpoint_save(const std::string& path, const Model& m, const TrainState& st) {
  const size_t P = m.num_params;
  std::vector<int> header(256, 0);
  header[0] = CKPT_MAGIC;
  header[1] = CKPT_VERSION;
  header[2] = sizeof(floatX) == 2 ? 1 : 0;
  header[3] = st.step;
  header[4] = m.adam_t;
  put_u64(&header[5], P);
  header[7] = (int)m.router_bias.size();
  put_u64(&header[40], (unsigned long long)st.train_data.shard);
  put_u64(&header[42], (unsigned long long)st.train_data.position);
  put_u64(&header[44], (unsigned long long)st.train_data.epoch);
  put_u64(&header[46], st.sample_rng_draws);
  header_put_config(header.data(), m.cfg);

  std::vector<float> buf(P);
  std::string tmp = path + ".tmp";
  FILE* f = fopen(tmp.c_str(), "wb");
  if (!f) throw std::runtime_error("cannot write checkpoint " + tmp + ": " + strerror(errno));
  bool ok = fwrite(header.data(), sizeof(int), 256, f) == 256;
  for (const float* src : {m.master, m.adam_m, m.adam_v}) {
    cudaCheck(cudaMemcpy(buf.data(), src, P * sizeof(float), cudaMemcpyDeviceToHost), "checkpoint_save", "P=%zu", P);
    ok = ok && fwrite(buf.data(), sizeof(float), P, f) == P;
  }
  ok = ok && fwrite(m.router_bias.data(), sizeof(float), m.router_bias.size(), f) == m.router_bias.size();
  ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
  ok = (fclose(f) == 0) && ok;
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    remove(tmp.c_str());
    throw std::runtime_error("writing checkpoint " + path + " failed: " + strerror(errno));
  }
}

// Reads a checkpoint into a fresh model. Every mismatch is refused with a message.
Model checkpoint_load(const std::string& path, TrainState& st, cudaStream_t stream = 0) {
  FILE* f = fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("cannot open checkpoint " + path + ": " + strerror(errno));
  std::vector<int> header(256);
  if (fread(header.data(), sizeof(int), 256, f) != 256) {
    fclose(f);
    throw std::runtime_error("checkpoint " + path + " is truncated (no complete 1024-byte header)");
  }
  auto refuse = [&](const std::string& why) {
    fclose(f);
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
  const size_t P = get_u64(&header[5]);
  if (P != param_count(cfg)) refuse("parameter count does not match its configuration");
  if (header[7] != cfg.layers * cfg.experts) refuse("router bias count does not match its configuration");
  struct stat sb;
  size_t expected = 1024 + (3 * P + (size_t)header[7]) * sizeof(float);
  if (fstat(fileno(f), &sb) != 0 || (size_t)sb.st_size != expected)
    refuse("size " + std::to_string((long long)sb.st_size) + " bytes, expected " + std::to_string(expected) +
           " (truncated or corrupt)");
  std::vector<float> master(P), moments(P);
  if (fread(master.data(), sizeof(float), P, f) != P) refuse("truncated master weights");
  Model m = model_create(cfg, 0);
  m.stream = stream;
  model_set_master(m, master);
  for (float* dst : {m.adam_m, m.adam_v}) {
    if (fread(moments.data(), sizeof(float), P, f) != P) refuse("truncated optimizer state");
    cudaCheck(cudaMemcpy(dst, moments.data(), P * sizeof(float), cudaMemcpyHostToDevice), "checkpoint_load", "P=%zu", P);
  }
  if (fread(m.router_bias.data(), sizeof(float), m.router_bias.size(), f) != m.router_bias.size())
    refuse("truncated router biases");
  fclose(f);
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
  return batches > 0 ? (float)(sum / batches) : 0.f;
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
  row("parameters", std::to_string(m.num_params) + " (" + std::to_string(active_param_count(c)) + " active)");
  row("batch B / accum", std::to_string(t.batch) + " / " + std::to_string(accum));
  row("tokens per step", std::to_string((long long)t.batch * c.seq_len * accum));
  row("steps / warmup", std::to_string(t.steps) + " / " + std::to_string(t.warmup));
  char buf[64];
  snprintf(buf, sizeof buf, "%.2e -> %.2e", t.lr, t.lr * t.min_lr_frac);
  row("lr (cosine)", buf);
  snprintf(buf, sizeof buf, "%.3g / %.3g", t.weight_decay, t.grad_clip);
  row("weight decay / clip", buf);
  snprintf(buf, sizeof buf, "%.3g", t.bias_update);
  row("router bias u", buf);
  row("recompute", t.recompute ? "layer-level" : "off");
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
    DataLoader train_data(tc.train_pattern, tc.batch, mc.seq_len);
    DataLoader val_data(tc.val_pattern, tc.batch, mc.seq_len);
    if (gpu_count() == 0) {
      fprintf(stderr, "train: error: no CUDA device found; flatmoe trains on NVIDIA GPUs (see README)\n");
      return 1;
    }
    make_dirs(tc.out_dir);

    const int B = tc.batch, T = mc.seq_len;
    const int accum = tc.total_batch ? tc.total_batch / (B * T) : 1;
    cudaStream_t stream;
    cudaCheck(cudaStreamCreate(&stream), "train", "stream");
    TrainState st;
    Model m;
    if (!tc.resume.empty()) {
      m = checkpoint_load(tc.resume, st, stream);
      if (memcmp(&m.cfg, &mc, sizeof(ModelConfig)) != 0)
        throw std::invalid_argument("--resume " + tc.resume + ": its model configuration differs from the flags");
      train_data.set_state(st.train_data);
      printf("resumed from %s at step %d\n", tc.resume.c_str(), st.step);
    } else {
      m = model_create(mc, tc.seed);
      m.stream = stream;
    }
    const double peak_flops = peak_flops_for_build();
    print_config(mc, tc, m, accum, peak_flops);

    std::mt19937_64 sample_rng(tc.seed ^ 0x5eedULL);
    sample_rng.discard(st.sample_rng_draws);
    const double tokens_per_step = (double)B * T * accum;
    const double flops_per_step = flops_per_token(mc) * tokens_per_step;
    std::string log_path = tc.out_dir + "/log.csv";
    FILE* log = fopen(log_path.c_str(), st.step > 0 ? "a" : "w");
    if (!log) throw std::runtime_error("cannot write " + log_path);
    if (st.step == 0) fprintf(log, "step,train_loss,val_loss,lr,grad_norm,ms,tokens_per_s,mfu,peak_alloc_mib\n");

    const int first_step = st.step;
    for (int step = first_step; step <= tc.steps; step++) {
      bool last = step == tc.steps;
      bool resumed_here = step == first_step && first_step > 0;  // already sampled/saved before the resume
      if (tc.val_every > 0 && (step % tc.val_every == 0 || last)) {
        float val_loss = validation_loss(m, val_data, tc.val_batches, B, T);
        printf("step %5d | val loss %.4f\n", step, val_loss);
        fprintf(log, "%d,nan,%.6f,nan,nan,nan,nan,nan,nan\n", step, val_loss);
      }
      if (tc.sample_every > 0 && step > 0 && !resumed_here && (step % tc.sample_every == 0 || last)) {
        std::string text = generate_sample(m, tok, tc.sample_len, sample_rng, st.sample_rng_draws);
        printf("---- sample at step %d ----\n%s\n---------------------------\n", step, text.c_str());
      }
      if (step > 0 && !resumed_here && tc.ckpt_every > 0 && (step % tc.ckpt_every == 0 || last)) {
        st.step = step;
        st.train_data = train_data.state();
        char name[64];
        snprintf(name, sizeof name, "/ckpt_%06d.bin", step);
        checkpoint_save(tc.out_dir + name, m, st);
        printf("checkpoint written: %s%s\n", tc.out_dir.c_str(), name);
      }
      if (last) break;

      // one optimizer step: accumulate gradients over `accum` micro-batches
      bool timeline = step == tc.timeline_step;
      pool().reset_peak();
      if (timeline) { pool().clear_timeline(); pool().set_timeline(true); }
      cudaCheck(cudaStreamSynchronize(stream), "train", "step=%d", step);
      auto t0 = std::chrono::steady_clock::now();
      float norm = 0.f, lr = lr_at(tc, step);
      double loss = train_step(m, tc, step, B, T, accum, [&](int* xb, int* yb) { train_data.next_batch(xb, yb); }, &norm);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (timeline) { pool().set_timeline(false); write_timeline(tc.out_dir, step); }
      if (!std::isfinite(loss)) throw std::runtime_error("loss is not finite at step " + std::to_string(step));
      double tok_s = tokens_per_step / (ms / 1e3);
      double mfu = flops_per_step / (ms / 1e3) / peak_flops;
      size_t free_b = 0, total_b = 0;
      cudaCheck(cudaMemGetInfo(&free_b, &total_b), "train", "meminfo");
      if (step % tc.log_every == 0 || step == tc.steps - 1)
        printf("step %5d/%d | loss %.4f | lr %.2e | norm %.3f | %.1f ms | %.0f tok/s | MFU %.1f%% | peak %.1f MiB "
               "(device used %.1f MiB)\n",
               step + 1, tc.steps, loss, lr, norm, ms, tok_s, 100 * mfu, pool().peak() / 1048576.0,
               (total_b - free_b) / 1048576.0);
      fprintf(log, "%d,%.6f,nan,%.6e,%.6f,%.3f,%.1f,%.5f,%.2f\n", step + 1, loss, lr, norm, ms, tok_s, mfu,
              pool().peak() / 1048576.0);
      fflush(log);
    }
    fclose(log);
    model_destroy(m);
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
