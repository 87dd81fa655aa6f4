// SCO, selective checkpoint offload (ops/sco.cuh, --offload_budget) on one GPU: training under
// --recompute 1 at budgets of none, one, half, three and all of the boundaries (and between sizes)
// is bit-identical to keeping every boundary on the device (losses, optimizer state and weights,
// memcmp), the peak of Mem::Checkpoints is the schedule's, within the closed form and falling with the
// budget, and budget 0 copies nothing (tests/sco_training.cuh). The plan itself: tests/cpu_sco_plan.cpp.
#include "gpu_util.cuh"
#include "sco_training.cuh"

TEST(GpuSco, TrainingIsBitIdenticalAndTheCheckpointPeakFallsWithTheBudget) {
  REQUIRE_GPU();
  testutil::sco_trains_alike(Parallel(), "one GPU");
}

// A pass without backward (validation, sampling) or without recomputation keeps every boundary on the
// device whatever the budget: nothing to recompute from the host.
TEST(GpuSco, PassesWithoutRecomputationCopyNothing) {
  REQUIRE_GPU();
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40; c.layers = 3; c.experts = 5; c.topk = 2;
  const int B = 2, T = c.seq_len, N = B * T;
  testutil::Rng rng;
  std::vector<int> x, y;
  testutil::random_tokens(N, c.vocab, rng, x, y);
  Seams seams;
  seams.offload_budget = 1LL << 40;  // every boundary, were it a training pass under recomputation
  Model m = model_create(c, 3, Parallel(), 0, seams);
  EXPECT_EQ(m.sco->budget(), 1LL << 40);
  PassOptions validation;
  validation.backward = false;
  model_pass(m, x.data(), y.data(), B, T, validation);
  PassOptions stored;
  stored.dloss = 1.f / N;
  model_pass(m, x.data(), y.data(), B, T, stored);
  model_logits_row(m, x.data(), T, T - 1);
  EXPECT_EQ(m.sco->copies(), 0);
  EXPECT_EQ(m.sco->host_bytes(), 0u);
  PassOptions recomputed = stored;
  recomputed.recompute = true;
  model_pass(m, x.data(), y.data(), B, T, recomputed);
  EXPECT_EQ(m.sco->copies(), 2LL * c.layers);
  model_destroy(m);
}

// Selective attention recomputation (--device_budget, ops/sar_plan.hpp): keeping some layers' attention
// tensors instead of recomputing them trains bit-identically, alone and beside SCO.
TEST(GpuSco, KeptAttentionTrainsBitIdenticallyToFullRecomputation) {
  REQUIRE_GPU();
  testutil::attention_keep_trains_alike(Parallel(), testutil::recompute_config(Parallel()), "one GPU");
}
