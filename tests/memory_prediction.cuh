// tests/memory_prediction.cuh — the per-rank prediction (model.cuh predict_rank_memory, paper Eq. 6)
// against the pool's measured peak of one training step, on one GPU (gpu_memory_prediction.cu) and at
// W ranks (dist_model.cu). Both sides leave out what was live in the pool before the model was made
// (the cuBLAS workspace, the prediction's fixed 32 MiB): what is compared is what the model adds, so
// that the fixed term cannot hide an error in the others.
#pragma once
#include <string>
#include "../model.cuh"
#include "gpu_util.cuh"
#include "model_util.cuh"

namespace testutil {

struct PredictionCase {
  std::string name;
  Seams seams;
  bool recompute = true;
  long long attention_budget = 0;  // bytes for selective attention recomputation (0: none)
  std::string routing;             // a routing profile ("" = the router)
};

struct PredictionResult {
  size_t predicted = 0, measured = 0;  // bytes above what was live before the model
  std::string peak_at, terms;
};

inline PredictionResult predict_and_measure(const ModelConfig& c, const Parallel& par, const PredictionCase& pc, int B, int T) {
  runtime_prepare();
  cudaCheck(cudaDeviceSynchronize(), "predict_and_measure", "sync");
  const size_t live_before = pool().live_total();
  const SarPlan kept = pc.attention_budget > 0 ? attention_kept_plan(c, par, B, T, pc.attention_budget) : SarPlan();
  const MemoryPrediction prediction = predict_rank_memory(c, par, pc.seams, B, T, pc.recompute, &kept);
  Rng rng;  // at W ranks every rank draws the same weights and global batch
  const std::vector<float> master = random_master(c, rng);
  std::vector<int> x, y;
  random_tokens(B * T * par.world.size, c.vocab, rng, x, y);
  Model m = model_create(c, 1, par, 0, pc.seams);
  model_set_master(m, master);
  m.attention_kept = kept;
  if (!pc.routing.empty()) {
    m.routing_override = true;
    m.routing = parse_routing_profile(pc.routing);
  }
  TrainConfig t;
  t.recompute = pc.recompute ? 1 : 0;
  cudaCheck(cudaDeviceSynchronize(), "predict_and_measure", "sync");
  pool().reset_peak();
  const int rank = par.world.rank, N = B * T;
  model_train_step(m, t, 0, B, T, 1, [&](int* xb, int* yb) {
    std::copy_n(x.data() + rank * N, N, xb);
    std::copy_n(y.data() + rank * N, N, yb);
  }, nullptr);
  PredictionResult r;
  r.measured = pool().peak() - live_before;
  r.predicted = prediction.total() - CublasRuntime::workspace_bytes;
  r.peak_at = prediction.peak_at;
  r.terms = prediction.describe();
  model_destroy(m);
  return r;
}

// Asserts the prediction >= the measured peak and, when `tight`, within 10 % of it.
inline void expect_prediction_holds(const PredictionResult& r, const std::string& what, bool tight) {
  const double over = (double)r.predicted / (double)r.measured - 1;
  printf("[mem] prediction %s: predicted %.2f MiB at %s, measured %.2f MiB (%+.1f %%) | %s\n", what.c_str(),
         r.predicted / 1048576.0, r.peak_at.c_str(), r.measured / 1048576.0, 100 * over, r.terms.c_str());
  EXPECT_GE(r.predicted, r.measured) << what << ": the prediction must not be below the pool's peak";
  if (tight) EXPECT_LE(over, 0.10) << what << ": more than 10 % above the pool's peak";
}

}  // namespace testutil
