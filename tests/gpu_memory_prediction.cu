// The per-rank prediction of the pool's peak (model.cuh predict_rank_memory, paper Eq. 6, printed by
// the trainer at start-up) against one training step on one GPU, for each option that moves the peak:
// recomputation off and on, the full and the chunked head, SCO's host budget, selective attention
// recomputation, the three optimizers, the FFNs in token chunks (--token_budget) and attention in head
// groups (--attention_groups). The prediction is
// >= the measured peak and within 10 % of it (tests/memory_prediction.cuh). Model: H 256, L 4 (one dense
// layer), 4 heads, E 8, top-2, I 256, a shared expert, V 512, B 16 × T 256 (N = 4096 tokens: the
// activations, not the fixed buffers, make the peak).
#include "gpu_util.cuh"
#include "memory_prediction.cuh"

TEST(GpuMemoryPrediction, IsAtLeastThePoolPeakAndWithinTenPercent) {
  REQUIRE_GPU();
  ModelConfig c;
  c.vocab = 512; c.hidden = 256; c.heads = 4; c.layers = 4; c.experts = 8; c.topk = 2; c.expert_dim = 256;
  c.n_dense = 1; c.dense_dim = 512; c.shared_expert = 1; c.seq_len = 256;
  const int B = 16, T = c.seq_len;
  const long long boundary = (long long)B * T * c.hidden * sizeof(floatX);
  std::vector<testutil::PredictionCase> cases(13);
  cases[0].name = "recompute off";
  cases[0].recompute = false;
  cases[1].name = "recompute on";
  cases[2].name = "recompute on, chunked head";
  cases[2].seams.head = "chunked";
  cases[2].seams.vocab_block = 128;
  cases[3].name = "recompute on, SCO 2 of 4 boundaries";
  cases[3].seams.offload_budget = 2 * boundary;
  cases[4].name = "recompute on, SCO every boundary";
  cases[4].seams.offload_budget = 4 * boundary;
  cases[5].name = "recompute on, 3 attention options kept";
  cases[5].attention_budget = 3 * sar_option_bytes(SarOption::Projection, B * T, c.hidden, c.heads, sizeof(floatX), 1);
  cases[6].name = "recompute on, offload_adamw";
  cases[6].seams.optimizer = "offload_adamw";
  cases[6].seams.offload_bucket = 1 << 16;
  cases[7].name = "recompute on, cpu_adamw";
  cases[7].seams.optimizer = "cpu_adamw";
  // the local MoE in token chunks, the dense layer's FFN and the shared expert in the same chunks
  cases[8].name = "recompute off, --token_budget 512";
  cases[8].recompute = false;
  cases[8].seams.token_budget = 512;
  cases[9].name = "recompute on, --token_budget 512";
  cases[9].seams.token_budget = 512;
  // attention one head at a time (model.cuh's attention_groups_forward/_backward), alone and in the most frugal setting
  cases[10].name = "recompute off, --attention_groups 4";
  cases[10].recompute = false;
  cases[10].seams.attention_groups = 4;
  cases[11].name = "recompute on, --attention_groups 4";
  cases[11].seams.attention_groups = 4;
  cases[12].name = "recompute on, --attention_groups 2 --token_budget 512, SCO every boundary";
  cases[12].seams.attention_groups = 2;
  cases[12].seams.token_budget = 512;
  cases[12].seams.offload_budget = 4 * boundary;
  for (const testutil::PredictionCase& pc : cases)
    testutil::expect_prediction_holds(testutil::predict_and_measure(c, Parallel(), pc, B, T), "one GPU, " + pc.name, true);
}

// --zero 3 on one GPU (runtime/zero3.cuh): the gathered groups (here whole, W = 1) beside the kept weights,
// the prediction's "gathered groups" term against the pool's peak.
TEST(GpuMemoryPrediction, HoldsUnderZero3) {
  REQUIRE_GPU();
  ModelConfig c;
  c.vocab = 512; c.hidden = 256; c.heads = 4; c.layers = 4; c.experts = 8; c.topk = 2; c.expert_dim = 256;
  c.n_dense = 1; c.dense_dim = 512; c.shared_expert = 1; c.seq_len = 256;
  Parallel par;
  par.zero = 3;
  for (bool recompute : {false, true}) {
    testutil::PredictionCase pc;
    pc.name = std::string("--zero 3, recompute ") + (recompute ? "on" : "off");
    pc.recompute = recompute;
    testutil::expect_prediction_holds(testutil::predict_and_measure(c, par, pc, 16, c.seq_len), "one GPU, " + pc.name, true);
  }
}

// The prediction's ZeRO-3 terms from the layout alone (no GPU): at W = 8 ranks (E_p = 8) a rank under --zero 3
// keeps (P_1 − P_3) fewer elements than under --zero 1 (the dense weights but its shards), which leave the
// weights term (b bytes each) and the gradients term (b, and 4 for the BF16 build's fp32 sum); what it gathers
// at the peak is the running group's weights and gradients and the prefetched group's weights (at a group's
// reduce-scatter also their fp32 copy and the reduced shard): at most (3b + 8) bytes an element of the largest
// group; under --zero 1 that term is 0.
TEST(MemoryPrediction, Zero3MovesTheDenseWeightsOutAndGathersTwoGroups) {
  ModelConfig c;
  c.vocab = 4096; c.hidden = 384; c.heads = 6; c.layers = 6; c.experts = 8; c.topk = 2; c.expert_dim = 384;
  c.seq_len = 256;
  const int W = 8, B = 4;
  auto shape = [&](int zero) {
    Parallel par;
    par.world.size = W;
    par.ep.size = W;
    par.zero = zero;
    par.dense.size = zero == 3 ? W : 1;
    return par;
  };
  auto term = [](const MemoryPrediction& p, const std::string& name) {
    for (const MemoryTerm& t : p.terms)
      if (t.name == name) return t.bytes;
    ADD_FAILURE() << "no term " << name;
    return (size_t)0;
  };
  const std::vector<ParamSpec> specs = param_specs(c);
  const ParamLayout one = param_layout(specs, W, RegionGroup{W, 0}, RegionGroup{1, 0});
  const ParamLayout three = param_layout(specs, W, RegionGroup{W, 0}, RegionGroup{1, 0}, VocabSplit(), true);
  size_t largest_group = 0;
  for (const ParamRegion& r : three.regions)
    if (r.gathered) largest_group = std::max(largest_group, r.padded);
  const size_t b = sizeof(floatX), moved = one.num_params - three.num_params;
  const bool fp32_sum = !std::is_same<floatX, float>::value;
  for (bool recompute : {false, true}) {
    const MemoryPrediction p1 = predict_rank_memory(c, shape(1), Seams(), B, c.seq_len, recompute);
    const MemoryPrediction p3 = predict_rank_memory(c, shape(3), Seams(), B, c.seq_len, recompute);
    printf("[mem] W=%d recompute %d: --zero 1 %.1f MiB at %s; --zero 3 %.1f MiB at %s (%s)\n", W, recompute,
           p1.total() / 1048576.0, p1.peak_at.c_str(), p3.total() / 1048576.0, p3.peak_at.c_str(), p3.describe().c_str());
    EXPECT_EQ(term(p1, "weights") - term(p3, "weights"), moved * b);
    EXPECT_EQ(term(p1, "grads") - term(p3, "grads"), moved * (b + (fp32_sum ? 4 : 0)));
    EXPECT_EQ(term(p1, "gathered groups (ZeRO-3)"), 0u);
    EXPECT_GT(term(p3, "gathered groups (ZeRO-3)"), 0u);
    EXPECT_LE(term(p3, "gathered groups (ZeRO-3)"), (3 * b + 8) * largest_group);
    EXPECT_LT(p3.total(), p1.total()) << "the dense weights moved out outweigh two gathered groups here";
  }
}
