// The per-rank prediction of the pool's peak (model.cuh predict_rank_memory, paper Eq. 6, printed by
// the trainer at start-up) against one training step on one GPU, for each option that moves the peak:
// recomputation off and on, the full and the chunked head, SCO's host budget, selective attention
// recomputation, and the three optimizers. The prediction is >= the measured peak and within 10 % of it
// (tests/memory_prediction.cuh). Model: H 256, L 4 (one dense layer), 4 heads, E 8, top-2, I 256,
// a shared expert, V 512, B 16 × T 256 (N = 4096 tokens: the activations, not the fixed buffers, make
// the peak).
#include "gpu_util.cuh"
#include "memory_prediction.cuh"

TEST(GpuMemoryPrediction, IsAtLeastThePoolPeakAndWithinTenPercent) {
  REQUIRE_GPU();
  ModelConfig c;
  c.vocab = 512; c.hidden = 256; c.heads = 4; c.layers = 4; c.experts = 8; c.topk = 2; c.expert_dim = 256;
  c.n_dense = 1; c.dense_dim = 512; c.shared_expert = 1; c.seq_len = 256;
  const int B = 16, T = c.seq_len;
  const long long boundary = (long long)B * T * c.hidden * sizeof(floatX);
  std::vector<testutil::PredictionCase> cases(8);
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
  cases[5].attention_budget = 3 * sar_option_bytes(SarOption::Projection, B * T, c.hidden, c.heads, sizeof(floatX));
  cases[6].name = "recompute on, offload_adamw";
  cases[6].seams.optimizer = "offload_adamw";
  cases[6].seams.offload_bucket = 1 << 16;
  cases[7].name = "recompute on, cpu_adamw";
  cases[7].seams.optimizer = "cpu_adamw";
  for (const testutil::PredictionCase& pc : cases)
    testutil::expect_prediction_holds(testutil::predict_and_measure(c, Parallel(), pc, B, T), "one GPU, " + pc.name, true);
}
