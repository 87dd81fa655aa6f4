// config.hpp — the model and training configuration, its flags, its validation, and the
// parameter layout shared by the GPU trainer (train.cu), the CPU reference model (ref/model.hpp)
// and the tests. Plain C++17: CPU tests check flag errors without a GPU.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

// The model (DESIGN §2). Every dimension is a flag.
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
  int val_every = 100;
  int val_batches = 10;                    // 10 × 16 × 256 tokens ≈ the whole fortunes validation shard
  int sample_every = 400;
  int sample_len = 128;
  int ckpt_every = 1000;                   // every S steps and at the end; 0 = never
  int log_every = 10;
  int timeline_step = -1;                  // write the pool timeline of this step (CSV + plot)
  int gpus = 1;                            // W: ranks (one process per GPU) started on this node
  int ep = 0;                              // E_p: expert-parallel group size (0 = W)
  std::string routing = "router";          // "router", or a profile that overrides its choice: "balanced", "hot:r/h"
  // Seams (DESIGN §1.1): which implementation serves each; chosen once, at start-up.
  std::string moe = "";                    // MoE dispatcher: local (E_p = 1) | ep; "" = local at E_p = 1, else ep
  std::string head = "full";               // output head: full (logits [N,V] inside the head)
  std::string optimizer = "adamw";         // optimizer: adamw (fp32 master weights and moments on the GPU)
  unsigned long long seed = 1337;
};

// ------------------------------------------------------------------------------------------
// Parameter layout: one flat buffer, tensors in this order. Norm weights are not decayed.

struct ParamSpec {
  std::string name;
  size_t rows, cols;  // a [E, R, C] expert stack is rows = E·R
  bool decay;
  bool expert;        // a routed-expert stack: split over the E_p ranks of the expert-parallel group
  size_t numel() const { return rows * cols; }
};

// Order: every tensor that each rank holds whole (dense tensors), then the routed-expert stacks,
// so that the flat buffer has one dense region and one expert region (each sharded for ZeRO-1 over
// the ranks that hold it).
inline std::vector<ParamSpec> param_specs(const ModelConfig& c) {
  const size_t V = c.vocab, H = c.hidden, E = c.experts, I = c.expert_dim, Id = c.dense_dim;
  std::vector<ParamSpec> specs, experts;
  specs.push_back({"wte", V, H, true, false});
  for (int l = 0; l < c.layers; l++) {
    std::string p = "layer" + std::to_string(l) + ".";
    specs.push_back({p + "ln1", 1, H, false, false});
    specs.push_back({p + "wqkv", 3 * H, H, true, false});
    specs.push_back({p + "wo", H, H, true, false});
    specs.push_back({p + "ln2", 1, H, false, false});
    if (!c.is_moe_layer(l)) {
      specs.push_back({p + "dense_w13", 2 * Id, H, true, false});
      specs.push_back({p + "dense_w2", H, Id, true, false});
      continue;
    }
    specs.push_back({p + "router", E, H, true, false});
    if (c.shared_expert) {
      specs.push_back({p + "shared_w13", 2 * I, H, true, false});
      specs.push_back({p + "shared_w2", H, I, true, false});
    }
    experts.push_back({p + "w13", E * 2 * I, H, true, true});
    experts.push_back({p + "w2", E * H, I, true, true});
  }
  specs.push_back({"lnf", 1, H, false, false});
  specs.push_back({"lm_head", V, H, true, false});
  specs.insert(specs.end(), experts.begin(), experts.end());
  return specs;
}

inline size_t param_count(const ModelConfig& c) {
  size_t n = 0;
  for (const ParamSpec& s : param_specs(c)) n += s.numel();
  return n;
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
    need(c.experts >= 1 && c.experts <= 256, "experts must be in [1, 256] (got " + std::to_string(c.experts) + ")");
    need(c.topk >= 1 && c.topk <= c.experts && c.topk <= 8,
         "topk (" + std::to_string(c.topk) + ") must be in [1, min(experts, 8)]");
    need(c.expert_dim > 0, "expert_dim must be positive");
  }
  if (c.n_dense > 0) need(c.dense_dim > 0, "dense_dim must be positive");
  need(c.hidden % 8 == 0 && c.expert_dim % 8 == 0 && c.dense_dim % 8 == 0,
       "hidden, expert_dim and dense_dim must be multiples of 8 (16-byte rows for the grouped GEMM)");
  need(c.shared_expert == 0 || c.shared_expert == 1, "shared_expert must be 0 or 1");
  need(c.seq_len >= 2, "seq_len must be >= 2");
  need(c.score_fn == 0 || c.score_fn == 1, "score_fn must be softmax or sigmoid");
  need(c.renorm == 0 || c.renorm == 1, "renorm must be 0 or 1");
  need(c.rope_theta > 0 && c.norm_eps > 0 && c.init_std > 0, "rope_theta, norm_eps and init_std must be positive");
}

inline void validate(const TrainConfig& t, const ModelConfig& c) {
  auto need = [](bool ok, const std::string& msg) {
    if (!ok) throw std::invalid_argument(msg);
  };
  need(t.batch > 0, "batch must be positive");
  long long micro = (long long)t.batch * c.seq_len;
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
  need(t.gpus >= 1, "gpus must be >= 1");
  const int ep = t.ep ? t.ep : t.gpus;
  need(ep >= 1 && t.gpus % ep == 0, "ep (" + std::to_string(ep) + ") must divide the number of ranks (" +
                                        std::to_string(t.gpus) + ")");
  need(c.n_dense == c.layers || c.experts % ep == 0,
       "experts (" + std::to_string(c.experts) + ") must be divisible by ep (" + std::to_string(ep) + ")");
  // Seams: what exists is accepted, what a paper operator will add later is refused by name.
  auto refuse_unbuilt = [&](const std::string& flag, const std::string& v, const std::vector<std::string>& built,
                            const std::vector<std::string>& planned) {
    for (const std::string& b : built)
      if (v == b) return;
    std::string list;
    for (const std::string& b : built) list += (list.empty() ? "" : ", ") + b;
    for (const std::string& p : planned)
      if (v == p) throw std::invalid_argument(flag + " " + v + " is not built yet (available: " + list + ")");
    throw std::invalid_argument(flag + " expects one of " + list + ", got '" + v + "'");
  };
  refuse_unbuilt("--moe", t.moe.empty() ? "ep" : t.moe, {"local", "ep"}, {"llep", "pllep", "relay"});
  need(t.moe != "local" || ep == 1, "--moe local keeps every expert on each rank: it needs --ep 1 (got ep " +
                                        std::to_string(ep) + ")");
  refuse_unbuilt("--head", t.head, {"full"}, {"ring_dtp"});
  refuse_unbuilt("--optimizer", t.optimizer, {"adamw"}, {"cpu_adamw", "offload_adamw"});
  need(t.val_every >= 0 && t.val_batches >= 0 && t.sample_every >= 0 && t.sample_len >= 0 &&
           t.ckpt_every >= 0 && t.log_every > 0,
       "val_every, val_batches, sample_every, sample_len, ckpt_every must be >= 0, log_every > 0");
}

// ------------------------------------------------------------------------------------------
// Flags: --name value. Unknown flags, missing values and malformed numbers are refused.

struct FlagError : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

inline std::string usage() {
  return "usage: train [--flag value]...\n"
         "model:  --hidden H --layers L --heads nh --experts E --topk k --expert_dim I\n"
         "        --n_dense N --dense_dim Id --shared_expert 0|1 --seq_len T --vocab V (default: tokenizer)\n"
         "        --score softmax|sigmoid --renorm 0|1 --rope_theta X --norm_eps X --init_std X\n"
         "train:  --batch B --total_batch tokens --steps S --lr X --min_lr_frac X --warmup S\n"
         "        --weight_decay X --beta1 X --beta2 X --adam_eps X --grad_clip X --bias_update u\n"
         "        --recompute 0|1 --seed S\n"
         "ranks:  --gpus W (processes on this node, one per GPU) --ep E_p (expert-parallel group, default W)\n"
         "        --routing router|balanced|hot:r/h (a profile overrides the router's expert choice)\n"
         "seams:  --moe local|ep (default: local at E_p = 1, else ep) --head full --optimizer adamw\n"
         "data:   --data DIR --train PATTERN --val PATTERN --tokenizer FILE\n"
         "output: --out DIR --val_every S --val_batches N --sample_every S --sample_len N\n"
         "        --ckpt_every S --log_every S --timeline_step S --resume FILE\n";
}

inline void parse_flags(int argc, char** argv, ModelConfig& m, TrainConfig& t) {
  auto as_int = [](const std::string& flag, const std::string& v) {
    char* end = nullptr;
    long x = strtol(v.c_str(), &end, 10);
    if (v.empty() || *end != '\0' || x < -2147483647L || x > 2147483647L)
      throw FlagError("flag " + flag + " expects an integer, got '" + v + "'");
    return (int)x;
  };
  auto as_float = [](const std::string& flag, const std::string& v) {
    char* end = nullptr;
    float x = strtof(v.c_str(), &end);
    if (v.empty() || *end != '\0' || !std::isfinite(x))
      throw FlagError("flag " + flag + " expects a number, got '" + v + "'");
    return x;
  };
  std::map<std::string, int*> ints = {
      {"--vocab", &m.vocab},           {"--hidden", &m.hidden},
      {"--layers", &m.layers},         {"--heads", &m.heads},
      {"--experts", &m.experts},       {"--topk", &m.topk},
      {"--expert_dim", &m.expert_dim}, {"--n_dense", &m.n_dense},
      {"--dense_dim", &m.dense_dim},   {"--shared_expert", &m.shared_expert},
      {"--seq_len", &m.seq_len},       {"--renorm", &m.renorm},
      {"--batch", &t.batch},           {"--total_batch", &t.total_batch},
      {"--steps", &t.steps},           {"--warmup", &t.warmup},
      {"--recompute", &t.recompute},   {"--val_every", &t.val_every},
      {"--val_batches", &t.val_batches}, {"--sample_every", &t.sample_every},
      {"--sample_len", &t.sample_len}, {"--ckpt_every", &t.ckpt_every},
      {"--log_every", &t.log_every},   {"--timeline_step", &t.timeline_step},
      {"--gpus", &t.gpus},             {"--ep", &t.ep}};
  std::map<std::string, float*> floats = {
      {"--rope_theta", &m.rope_theta}, {"--norm_eps", &m.norm_eps},     {"--init_std", &m.init_std},
      {"--lr", &t.lr},                 {"--min_lr_frac", &t.min_lr_frac}, {"--weight_decay", &t.weight_decay},
      {"--beta1", &t.beta1},           {"--beta2", &t.beta2},           {"--adam_eps", &t.adam_eps},
      {"--grad_clip", &t.grad_clip},   {"--bias_update", &t.bias_update}};
  std::map<std::string, std::string*> strings = {
      {"--data", &t.data_dir}, {"--train", &t.train_pattern},   {"--val", &t.val_pattern},
      {"--tokenizer", &t.tokenizer}, {"--out", &t.out_dir}, {"--resume", &t.resume},
      {"--routing", &t.routing}, {"--moe", &t.moe}, {"--head", &t.head}, {"--optimizer", &t.optimizer}};
  for (int i = 1; i < argc; i++) {
    std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") throw FlagError("help");
    if (i + 1 >= argc) throw FlagError("flag " + flag + " needs a value");
    std::string v = argv[++i];
    if (ints.count(flag)) {
      *ints[flag] = as_int(flag, v);
    } else if (floats.count(flag)) {
      *floats[flag] = as_float(flag, v);
    } else if (strings.count(flag)) {
      if (v.empty()) throw FlagError("flag " + flag + " expects a non-empty value");
      *strings[flag] = v;
    } else if (flag == "--score") {
      if (v == "softmax") m.score_fn = 0;
      else if (v == "sigmoid") m.score_fn = 1;
      else throw FlagError("flag --score expects softmax or sigmoid, got '" + v + "'");
    } else if (flag == "--seed") {
      char* end = nullptr;
      unsigned long long s = strtoull(v.c_str(), &end, 10);
      if (v.empty() || *end != '\0' || v[0] == '-') throw FlagError("flag --seed expects a non-negative integer, got '" + v + "'");
      t.seed = s;
    } else {
      throw FlagError("unknown flag " + flag);
    }
  }
  if (t.train_pattern.empty()) t.train_pattern = t.data_dir + "/train_*.bin";
  if (t.val_pattern.empty()) t.val_pattern = t.data_dir + "/val_*.bin";
  if (t.tokenizer.empty()) t.tokenizer = t.data_dir + "/tokenizer.bin";
}

// The MoE dispatcher that --moe names, with its default resolved: local at E_p = 1, else ep.
inline std::string moe_dispatcher(const TrainConfig& t) {
  if (!t.moe.empty()) return t.moe;
  const int ep = t.ep ? t.ep : t.gpus;
  return ep == 1 ? "local" : "ep";
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
