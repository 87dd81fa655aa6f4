// ZeRO-3 on one GPU (--zero 3, runtime/zero3.cuh). At W = 1 a group's gather is a copy and its
// gradients' reduce-scatter an add into the shard (the whole group): the arithmetic of ZeRO-1, so a
// model under ZeRO-3 trains to the same bits as under ZeRO-1 — every step's loss and gradient norm,
// the optimizer's master weights and moments — with gradient accumulation and recomputation. Its
// memory: the local buffers keep the groups' shards and the experts, at most two groups are gathered at
// once, and the pool's peak of Weights is the kept weights plus the two largest neighbouring groups
// (the group running and the one prefetched), exactly.
#include "../model.cuh"
#include "gpu_util.cuh"
#include "model_util.cuh"

namespace {

// A dense layer, a shared expert and MoE layers, at sizes that are multiples of nothing.
ModelConfig zero3_config() {
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40;
  c.layers = 3; c.experts = 7; c.topk = 3; c.score_fn = ROUTER_SIGMOID; c.n_dense = 1; c.dense_dim = 72;
  c.shared_expert = 1;
  return c;
}

const int kBatch = 2;  // B sequences a micro-batch

// The runs' inputs: one draw of the master weights and `batches` micro-batches of kBatch sequences.
struct Zero3Inputs {
  std::vector<float> master;
  std::vector<std::vector<int>> xs, ys;
};

Zero3Inputs zero3_inputs(const ModelConfig& c, int batches) {
  testutil::Rng rng;
  Zero3Inputs in;
  in.master = testutil::random_master(c, rng);
  in.xs.resize(batches);
  in.ys.resize(batches);
  for (int i = 0; i < batches; i++) testutil::random_tokens(kBatch * c.seq_len, c.vocab, rng, in.xs[i], in.ys[i]);
  return in;
}

struct Zero3Run {
  std::vector<float> losses, norms;
  std::vector<std::pair<std::string, std::vector<float>>> state;  // the optimizer's sections
  size_t weights_peak = 0, kept_params = 0;
  int most_gathered = 0;
  std::vector<ParamRegion> regions;
};

// The run's settings: ten-step training's, with recomputation as asked.
TrainConfig zero3_train(bool recompute) {
  TrainConfig t;
  t.lr = 3e-3f; t.warmup = 1; t.steps = 4; t.grad_clip = 0.5f; t.bias_update = 1e-2f; t.recompute = recompute;
  return t;
}

// t.steps steps of `accum` micro-batches under --zero `zero`, the seams from t's flags; attention_budget > 0:
// the attention tensors that many pool bytes keep under recomputation (--device_budget's plan).
Zero3Run train_steps(int zero, int accum, const TrainConfig& t, const Zero3Inputs& in, long long attention_budget = 0) {
  const ModelConfig c = zero3_config();
  const int B = kBatch, steps = t.steps;
  Parallel par;
  par.zero = zero;
  Model m = model_create(c, 1, par, 0, seams_from(t, c));
  model_set_master(m, in.master);
  if (attention_budget > 0)
    m.attention_kept = attention_kept_plan(c, par, B, c.seq_len, attention_budget);
  pool().reset_peak();
  Zero3Run r;
  int next = 0;
  for (int step = 0; step < steps; step++) {
    float norm = 0.f;
    r.losses.push_back(model_train_step(m, t, step, B, c.seq_len, accum, [&](int* x, int* y) {
      std::copy(in.xs[next].begin(), in.xs[next].end(), x);
      std::copy(in.ys[next].begin(), in.ys[next].end(), y);
      next++;
    }, &norm));
    r.norms.push_back(norm);
  }
  model_join_update(m);
  r.state = m.opt->save(m.stream);
  r.weights_peak = pool().peak(Mem::Weights);
  r.kept_params = m.num_params;
  r.most_gathered = m.zero3.most_gathered;
  r.regions = m.regions;
  model_destroy(m);
  return r;
}

// ZeRO-3's run against ZeRO-1's: every step's loss and norm, and each of the optimizer's sections (one
// rank's shard: the whole model) — memcmp-equal where the arithmetic is the same, else within the
// whole-model tolerance.
void expect_runs_agree(const Zero3Run& one, const Zero3Run& three, bool same_arithmetic, const std::string& what) {
  for (size_t s = 0; s < one.losses.size(); s++)
    printf("[zero3] %s step %zu loss ZeRO-1 %.8f ZeRO-3 %.8f norm %.8f %.8f\n", what.c_str(), s + 1, one.losses[s],
           three.losses[s], one.norms[s], three.norms[s]);
  ASSERT_EQ(one.state.size(), three.state.size()) << what;
  for (size_t k = 0; k < one.state.size(); k++) {
    const std::vector<float>&a = one.state[k].second, &b = three.state[k].second;
    ASSERT_EQ(a.size(), b.size()) << what << " " << one.state[k].first << ": one rank's shard is the whole model";
    if (same_arithmetic) {
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what << " " << one.state[k].first;
    } else {
      double num = 0, den = 0;
      for (size_t i = 0; i < a.size(); i++) num += (a[i] - b[i]) * (double)(a[i] - b[i]), den += (double)a[i] * a[i];
      const double e = den == 0 ? std::sqrt(num) : std::sqrt(num / den);
      std::string label = "zero3_vs_zero1_" + what;  // one word for the [err] line's readers (tools/error_table.sh)
      for (char& ch : label)
        if (ch == ' ' || ch == ',') ch = '_';
      EXPECT_REL(label.c_str(), one.state[k].first.c_str(), e, MODEL_TOL);
    }
  }
  if (same_arithmetic) {
    EXPECT_EQ(one.losses, three.losses) << what;
    EXPECT_EQ(one.norms, three.norms) << what;
  }
}

}  // namespace

TEST(GpuZero3, TrainsBitIdenticallyToZero1OnOneGpuAndGathersTwoGroupsAtMost) {
  REQUIRE_GPU();
  const ModelConfig c = zero3_config();
  const Zero3Inputs in = zero3_inputs(c, 8);  // 4 steps of 2 micro-batches
  for (int accum : {1, 2})
    for (bool recompute : {false, true}) {
      const std::string what = "accum " + std::to_string(accum) + (recompute ? ", recompute" : "");
      const Zero3Run one = train_steps(1, accum, zero3_train(recompute), in);
      const Zero3Run three = train_steps(3, accum, zero3_train(recompute), in);
      // The FP32 build's passes add into the step's sum in place under ZeRO-1 (old + c1 + c2 for a tensor
      // that one pass adds to twice) and into a zeroed group buffer under ZeRO-3 (old + (c1 + c2)): with
      // two passes a step the sums may round apart there, within the whole-model tolerance.
      const bool same_arithmetic = accum == 1 || !std::is_same<floatX, float>::value;
      expect_runs_agree(one, three, same_arithmetic, what);
      // memory: the kept weights are the groups' shards (here whole: W = 1) and the experts, and the
      // Weights peak adds the two largest neighbouring groups (g and g + 1 in the forward, the head's
      // group beside L − 1's prefetch, l and l − 1 in the backward)
      EXPECT_EQ(three.most_gathered, 2) << what;
      size_t neighbours = 0, kept = 0;
      const int L = c.layers;
      std::vector<size_t> group(L + 1, 0);
      for (const ParamRegion& r : three.regions) {
        kept += r.gathered ? r.shard : r.padded;
        if (r.gathered) group[r.group] = r.padded;
      }
      for (int g = 0; g < L; g++) neighbours = std::max(neighbours, group[g] + group[g + 1]);
      EXPECT_EQ(three.kept_params, kept) << what;
      const size_t router_bias = sizeof(float) * (size_t)c.layers * c.experts;
      EXPECT_EQ(one.weights_peak, one.kept_params * sizeof(floatX) + router_bias) << what;
      EXPECT_EQ(three.weights_peak, (three.kept_params + neighbours) * sizeof(floatX) + router_bias) << what;
      printf("[mem] zero3 %s: Weights peak %zu B (kept %zu + gathered %zu elements) against ZeRO-1's %zu B\n", what.c_str(),
             three.weights_peak, three.kept_params, neighbours, one.weights_peak);
    }
}

// ZeRO-3 changes where the dense weights live, not what any operator computes: with each optimizer (the
// host-state ones update the same shards), SCO's boundaries on the host, kept attention and the local MoE
// in token chunks, four steps under --zero 3 are bit-identical to --zero 1's (one micro-batch a step:
// the same arithmetic, as above).
TEST(GpuZero3, EveryOptimizerAndMemorySaverTrainsAsUnderZero1) {
  REQUIRE_GPU();
  const ModelConfig c = zero3_config();
  const Zero3Inputs in = zero3_inputs(c, 4);  // 4 steps of one micro-batch
  const size_t boundary = (size_t)kBatch * c.seq_len * c.hidden * sizeof(floatX);
  struct Variant {
    std::string name;
    TrainConfig t;
    long long attention_budget;
  };
  std::vector<Variant> variants;
  for (const char* opt : {"offload_adamw", "cpu_adamw"}) {
    TrainConfig t = zero3_train(false);
    t.optimizer = opt;
    t.offload_bucket = 4096;  // several buckets
    variants.push_back({std::string("--optimizer ") + opt, t, 0});
  }
  TrainConfig sco = zero3_train(true);
  sco.offload_budget = (long long)(2 * boundary);  // two of the four boundaries on the host
  variants.push_back({"SCO, 2 boundaries on the host", sco, 0});
  variants.push_back({"kept attention", zero3_train(true), (long long)(8 * boundary)});
  TrainConfig chunks = zero3_train(true);
  chunks.token_budget = 16;  // 74 tokens in 5 chunks
  variants.push_back({"--moe local --token_budget 16", chunks, 0});
  for (const Variant& v : variants) {
    const Zero3Run one = train_steps(1, 1, v.t, in, v.attention_budget);
    const Zero3Run three = train_steps(3, 1, v.t, in, v.attention_budget);
    expect_runs_agree(one, three, true, v.name);
    EXPECT_EQ(three.most_gathered, 2) << v.name;
  }
}
