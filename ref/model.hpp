// ref/model.hpp — the whole model and its trainer on the CPU, composed from the operator
// references (twin of train.cu's forward, backward and update). Same configuration, same flat
// parameter layout (config.hpp: param_specs), same update rules; plain math in a scalar T.
//
// It also reports the smallest routing margin it met: for every token of every MoE layer, the gap
// between the k-th and the (k+1)-th largest score + bias. A test that compares the GPU with this
// model needs that margin well above rounding, otherwise the two may legitimately pick different
// experts (notes/design.md §3: near-ties must not make a correct implementation fail).
#pragma once
#include <limits>
#include <string>
#include <vector>
#include "../config.hpp"
#include "adamw.hpp"
#include "attention.hpp"
#include "common.hpp"
#include "cross_entropy.hpp"
#include "embedding.hpp"
#include "matmul.hpp"
#include "moe.hpp"
#include "rmsnorm.hpp"
#include "rope.hpp"
#include "router.hpp"

namespace ref {

template <typename T>
struct Model {
  ModelConfig cfg;
  std::vector<ParamSpec> specs;
  std::vector<size_t> offsets;
  std::vector<T> params, grads;          // flat, in param_specs order
  std::vector<T> adam_m, adam_v;
  std::vector<float> router_bias;        // [L·E], fp32 like the GPU trainer's
  std::vector<long long> step_loads;     // [L·E]
  int adam_t = 0;
  T min_route_margin = std::numeric_limits<T>::infinity();
  // Optional: take each MoE layer's top-k choices from outside ([L][N·k], e.g. the GPU's), so
  // that a reduced-precision model can be compared at all; the weights are still computed here.
  // A token's choices (in order) that differ from this model's own are counted when every gap
  // between its k + 1 largest keys exceeds 1e-3: a near-tie anywhere in them (also between two
  // chosen experts, which only reorders the choice) excuses a difference.
  const std::vector<std::vector<int>>* forced_routes = nullptr;
  long long route_disagreements = 0;

  Model(const ModelConfig& c, const std::vector<T>& initial) : cfg(c), specs(param_specs(c)) {
    size_t n = 0;
    for (const ParamSpec& s : specs) {
      offsets.push_back(n);
      n += s.numel();
    }
    params = initial;
    grads.assign(n, T(0));
    adam_m.assign(n, T(0));
    adam_v.assign(n, T(0));
    router_bias.assign((size_t)c.layers * c.experts, 0.f);
    step_loads.assign((size_t)c.layers * c.experts, 0);
  }

  size_t index(const std::string& name) const {
    for (size_t i = 0; i < specs.size(); i++)
      if (specs[i].name == name) return i;
    throw std::invalid_argument("no parameter " + name);
  }
  // A tensor as a matrix [rows, cols] (a copy), and adding a gradient into the flat buffer.
  Mat<T> get(const std::string& name) const {
    size_t i = index(name);
    Mat<T> m(specs[i].rows, specs[i].cols);
    for (size_t j = 0; j < specs[i].numel(); j++) m.data()[j] = params[offsets[i] + j];
    return m;
  }
  Vec<T> get_vec(const std::string& name) const {
    Mat<T> m = get(name);
    return Eigen::Map<Vec<T>>(m.data(), m.size());
  }
  // An expert stack [E·R, C] as E matrices [R, C].
  std::vector<Mat<T>> get_stack(const std::string& name, int E) const {
    Mat<T> m = get(name);
    std::vector<Mat<T>> out;
    const Eigen::Index R = m.rows() / E;
    for (int e = 0; e < E; e++) out.push_back(m.middleRows(e * R, R));
    return out;
  }
  template <typename M>
  void add_grad(const std::string& name, const M& g) {
    size_t i = index(name);
    for (size_t j = 0; j < specs[i].numel(); j++) grads[offsets[i] + j] += g.data()[j];
  }
  void add_grad_stack(const std::string& name, const std::vector<Mat<T>>& g) {
    size_t i = index(name), j = 0;
    for (const Mat<T>& m : g)
      for (Eigen::Index q = 0; q < m.size(); q++) grads[offsets[i] + j++] += m.data()[q];
  }
};

// What a layer's backward needs from its forward.
template <typename T>
struct RefLayerActs {
  Mat<T> x_in, ln1, qkv, att, x_mid, ln2, lse;
  Vec<T> ln1_rstd, ln2_rstd;
  RouterResult<T> route;
};

// FFN on ln2 [N,H]. MoE layers: router → top-k → experts (+ shared expert); dense layers: SwiGLU.
template <typename T>
Mat<T> ref_ffn_forward(Model<T>& m, int l, RefLayerActs<T>& a, bool count_loads) {
  const ModelConfig& c = m.cfg;
  const std::string p = "layer" + std::to_string(l) + ".";
  const int N = (int)a.ln2.rows();
  MatI one_idx = MatI::Zero(N, 1);
  Mat<T> one_w = Mat<T>::Ones(N, 1);
  if (!c.is_moe_layer(l))
    return moe_forward(a.ln2, one_idx, one_w, m.get_stack(p + "dense_w13", 1), m.get_stack(p + "dense_w2", 1));
  const int E = c.experts, k = c.topk;
  Vec<T> bias(E);
  for (int e = 0; e < E; e++) bias(e) = T(m.router_bias[(size_t)l * E + e]);
  Mat<T> logits = matmul_forward(a.ln2, m.get(p + "router"));
  a.route = router_forward(logits, bias, k, c.score_fn, c.renorm != 0);
  for (int n = 0; n < N && k < E; n++) {
    std::vector<T> key(E);
    for (int e = 0; e < E; e++) key[e] = a.route.scores(n, e) + bias(e);
    std::sort(key.begin(), key.end(), [](T x, T y) { return x > y; });
    const T margin = key[k - 1] - key[k];  // what decides the set of chosen experts
    m.min_route_margin = std::min(m.min_route_margin, margin);
    T order_margin = margin;  // what decides the choice in order
    for (int j = 0; j < k - 1; j++) order_margin = std::min(order_margin, key[j] - key[j + 1]);
    if (!m.forced_routes) continue;
    const std::vector<int>& forced = (*m.forced_routes)[l];
    bool same = true;
    for (int j = 0; j < k; j++) {
      same = same && forced[(size_t)n * k + j] == a.route.topk_idx(n, j);
      a.route.topk_idx(n, j) = forced[(size_t)n * k + j];
    }
    if (!same && order_margin > T(1e-3)) m.route_disagreements++;
  }
  if (m.forced_routes) a.route.topk_w = router_weights(a.route.scores, a.route.topk_idx, c.renorm != 0);
  if (count_loads) {
    std::vector<int> loads = router_count_loads(a.route.topk_idx, E);
    for (int e = 0; e < E; e++) m.step_loads[(size_t)l * E + e] += loads[e];
  }
  Mat<T> out = moe_forward(a.ln2, a.route.topk_idx, a.route.topk_w, m.get_stack(p + "w13", E), m.get_stack(p + "w2", E));
  if (c.shared_expert)
    out += moe_forward(a.ln2, one_idx, one_w, m.get_stack(p + "shared_w13", 1), m.get_stack(p + "shared_w2", 1));
  return out;
}

// Returns d ln2 and adds the FFN's weight gradients.
template <typename T>
Mat<T> ref_ffn_backward(Model<T>& m, int l, const RefLayerActs<T>& a, const Mat<T>& dout) {
  const ModelConfig& c = m.cfg;
  const std::string p = "layer" + std::to_string(l) + ".";
  const int N = (int)a.ln2.rows();
  MatI one_idx = MatI::Zero(N, 1);
  Mat<T> one_w = Mat<T>::Ones(N, 1);
  if (!c.is_moe_layer(l)) {
    MoEGrads<T> g = moe_backward(dout, a.ln2, one_idx, one_w, m.get_stack(p + "dense_w13", 1), m.get_stack(p + "dense_w2", 1));
    m.add_grad_stack(p + "dense_w13", g.dW13);
    m.add_grad_stack(p + "dense_w2", g.dW2);
    return g.dx;
  }
  const int E = c.experts;
  MoEGrads<T> g = moe_backward(dout, a.ln2, a.route.topk_idx, a.route.topk_w, m.get_stack(p + "w13", E), m.get_stack(p + "w2", E));
  m.add_grad_stack(p + "w13", g.dW13);
  m.add_grad_stack(p + "w2", g.dW2);
  Mat<T> d_ln2 = g.dx;
  if (c.shared_expert) {
    MoEGrads<T> gs = moe_backward(dout, a.ln2, one_idx, one_w, m.get_stack(p + "shared_w13", 1), m.get_stack(p + "shared_w2", 1));
    m.add_grad_stack(p + "shared_w13", gs.dW13);
    m.add_grad_stack(p + "shared_w2", gs.dW2);
    d_ln2 += gs.dx;
  }
  Mat<T> d_logits = router_backward(g.dtopk_w, a.route.scores, a.route.topk_idx, c.score_fn, c.renorm != 0);
  Mat<T> d_from_router, d_router;
  matmul_backward(d_logits, a.ln2, m.get(p + "router"), d_from_router, d_router);
  m.add_grad(p + "router", d_router);
  return d_ln2 + d_from_router;
}

// One micro-batch: tokens/targets [B·T]. Returns the mean loss; with backward, adds
// dloss-scaled gradients (dloss = d objective / d per-token loss) into m.grads.
template <typename T>
T ref_pass(Model<T>& m, const std::vector<int>& tokens, const std::vector<int>& targets, int B, int Tlen, bool backward,
           T dloss, bool count_loads = true) {
  const ModelConfig& c = m.cfg;
  const int N = B * Tlen, L = c.layers, nh = c.heads, hd = c.head_dim();
  const T eps = T(c.norm_eps);
  MatI tok(N, 1), tgt(N, 1);
  for (int n = 0; n < N; n++) {
    tok(n, 0) = tokens[n];
    tgt(n, 0) = targets[n];
  }
  std::vector<RefLayerActs<T>> acts(L);
  Mat<T> x = embedding_forward(tok, m.get("wte"));
  for (int l = 0; l < L; l++) {
    const std::string p = "layer" + std::to_string(l) + ".";
    RefLayerActs<T>& a = acts[l];
    a.x_in = x;
    rmsnorm_forward(a.x_in, m.get_vec(p + "ln1"), eps, a.ln1, a.ln1_rstd);
    a.qkv = rope_forward(matmul_forward(a.ln1, m.get(p + "wqkv")), B, Tlen, nh, hd, (double)c.rope_theta);
    attention_forward(a.qkv, B, Tlen, nh, hd, a.att, a.lse);
    a.x_mid = a.x_in + matmul_forward(a.att, m.get(p + "wo"));
    rmsnorm_forward(a.x_mid, m.get_vec(p + "ln2"), eps, a.ln2, a.ln2_rstd);
    x = a.x_mid + ref_ffn_forward(m, l, a, count_loads);
  }
  Mat<T> lnf;
  Vec<T> lnf_rstd, lse;
  rmsnorm_forward(x, m.get_vec("lnf"), eps, lnf, lnf_rstd);
  Mat<T> logits = matmul_forward(lnf, m.get("lm_head"));
  Vec<T> losses = cross_entropy_forward(logits, tgt, lse);
  T loss = loss_sum(losses) / T(N);
  if (!backward) return loss;

  Mat<T> d_lnf, d_head, d_x, d_norm, d_att, d_ln1, d_qkv, d_w;
  Vec<T> d_gain;
  matmul_backward(cross_entropy_backward(logits, tgt, dloss), lnf, m.get("lm_head"), d_lnf, d_head);
  m.add_grad("lm_head", d_head);
  rmsnorm_backward(d_lnf, x, m.get_vec("lnf"), eps, d_x, d_gain);
  m.add_grad("lnf", d_gain);
  for (int l = L - 1; l >= 0; l--) {
    const std::string p = "layer" + std::to_string(l) + ".";
    const RefLayerActs<T>& a = acts[l];
    Mat<T> d_ln2 = ref_ffn_backward(m, l, a, d_x);
    rmsnorm_backward(d_ln2, a.x_mid, m.get_vec(p + "ln2"), eps, d_norm, d_gain);
    m.add_grad(p + "ln2", d_gain);
    d_x += d_norm;
    matmul_backward(d_x, a.att, m.get(p + "wo"), d_att, d_w);
    m.add_grad(p + "wo", d_w);
    d_qkv = rope_backward(attention_backward(d_att, a.qkv, B, Tlen, nh, hd), B, Tlen, nh, hd, (double)c.rope_theta);
    matmul_backward(d_qkv, a.ln1, m.get(p + "wqkv"), d_ln1, d_w);
    m.add_grad(p + "wqkv", d_w);
    rmsnorm_backward(d_ln1, a.x_in, m.get_vec(p + "ln1"), eps, d_norm, d_gain);
    m.add_grad(p + "ln1", d_gain);
    d_x += d_norm;
  }
  m.add_grad("wte", embedding_backward(tok, d_x, c.vocab));
  return loss;
}

template <typename T>
void ref_zero_grads(Model<T>& m) {
  std::fill(m.grads.begin(), m.grads.end(), T(0));
  std::fill(m.step_loads.begin(), m.step_loads.end(), 0);
}

// Clip, AdamW per tensor (norm gains not decayed), router bias update. Returns the grad norm.
template <typename T>
T ref_update(Model<T>& m, const TrainConfig& t, T lr) {
  Vec<T> all = Eigen::Map<Vec<T>>(m.grads.data(), m.grads.size());
  T norm = global_norm(std::vector<Vec<T>>{all});
  T scale = clip_scale(norm, T(t.grad_clip));
  m.adam_t++;
  for (size_t i = 0; i < m.specs.size(); i++) {
    const size_t off = m.offsets[i], n = m.specs[i].numel();
    Vec<T> w = Eigen::Map<Vec<T>>(m.params.data() + off, n);
    Vec<T> mm = Eigen::Map<Vec<T>>(m.adam_m.data() + off, n);
    Vec<T> vv = Eigen::Map<Vec<T>>(m.adam_v.data() + off, n);
    Vec<T> g = Eigen::Map<Vec<T>>(m.grads.data() + off, n);
    adamw_update(w, mm, vv, g, lr, T(t.beta1), T(t.beta2), T(t.adam_eps), m.specs[i].decay ? T(t.weight_decay) : T(0),
                 m.adam_t, scale);
    std::copy(w.data(), w.data() + n, m.params.data() + off);
    std::copy(mm.data(), mm.data() + n, m.adam_m.data() + off);
    std::copy(vv.data(), vv.data() + n, m.adam_v.data() + off);
  }
  update_router_bias(m.router_bias, m.step_loads, m.cfg, t.bias_update);
  return norm;
}

}  // namespace ref
