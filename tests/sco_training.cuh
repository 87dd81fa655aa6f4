// tests/sco_training.cuh — SCO (--offload_budget, ops/sco.cuh) training the whole model under
// --recompute 1, on one GPU (gpu_sco.cu) and at W ranks (dist_model.cu).
//
// The same model trains on the same batches for 3 steps of 2 micro-batches at host budgets of 0, 1,
// 2, 3 and all L = 4 boundaries, and 2.5 boundaries (a budget between two sizes). Against budget 0:
//   bit-identity: the losses, every optimizer section of this rank's shards and the weights (memcmp);
//   memory: the peak of Mem::Checkpoints is the schedule's (sco_device_peak: 5, 4, 3, 2, 2 boundaries),
//     within the closed form (L + 1 − |S| + min(|S|, 2) boundaries), falls with every budget up to 3
//     boundaries and never rises; with every boundary offloaded it is at most 3 boundaries (the final
//     hidden state, the one being recomputed, the prefetch);
//   copies: none at budget 0; else each boundary of S once out and once back per micro-batch; the
//     pinned host bytes are |S|·N·H·b.
#pragma once
#include <cstring>
#include "../model.cuh"
#include "gpu_util.cuh"
#include "model_util.cuh"

namespace testutil {

struct ScoTraining {
  std::vector<float> losses;
  StateSections state;         // after the last step
  std::vector<floatX> params;  // this rank's weight buffer after the last step
  size_t checkpoints_peak = 0; // Mem::Checkpoints over the whole run
  long long copies = 0;        // SCO's copies, both directions
  size_t bytes_moved = 0;
  size_t host_bytes = 0;       // pinned
};

inline void sco_trains_alike(const Parallel& par, const char* what) {
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40;
  c.layers = 4; c.experts = 6; c.topk = 2; c.n_dense = 1; c.dense_dim = 48; c.shared_expert = 1;
  TrainConfig t;
  t.lr = 3e-3f; t.warmup = 1; t.steps = 3; t.grad_clip = 0.5f; t.bias_update = 1e-2f; t.recompute = 1;
  const int B = 2, T = c.seq_len, N = B * T, W = par.world.size, rank = par.world.rank, accum = 2;
  const long long boundary = (long long)N * c.hidden * sizeof(floatX);  // b·N·H: one boundary of this rank
  Rng rng;  // at W ranks the harness gives every rank the same seed: the same global batches
  std::vector<float> master = random_master(c, rng);
  std::vector<std::vector<int>> xs, ys;
  for (int i = 0; i < t.steps * accum; i++) {
    xs.emplace_back();
    ys.emplace_back();
    random_tokens(N * W, c.vocab, rng, xs.back(), ys.back());
  }
  auto train = [&](long long budget) {
    ScoTraining out;
    Seams seams;
    seams.offload_budget = budget;
    Model m = model_create(c, 1, par, 0, seams);
    model_set_master(m, master);
    cudaCheck(cudaDeviceSynchronize(), "sco_trains_alike", "sync");
    pool().reset_peak();
    for (int step = 0; step < t.steps; step++) {
      int next = step * accum;
      out.losses.push_back(model_train_step(m, t, step, B, T, accum, [&](int* xb, int* yb) {
        std::copy_n(xs[next].data() + rank * N, N, xb);
        std::copy_n(ys[next].data() + rank * N, N, yb);
        next++;
      }, nullptr));
    }
    out.checkpoints_peak = pool().peak(Mem::Checkpoints);
    out.copies = m.sco->copies();
    out.bytes_moved = m.sco->bytes_moved();
    out.host_bytes = m.sco->host_bytes();
    out.state = m.opt->save(m.stream);
    out.params = download_vec(m.params, m.num_params);
    model_destroy(m);
    return out;
  };

  const ScoTraining kept = train(0);
  EXPECT_EQ(kept.copies, 0) << what << ": budget 0 moves nothing";
  EXPECT_EQ(kept.bytes_moved, 0u) << what;
  EXPECT_EQ(kept.host_bytes, 0u) << what;
  EXPECT_EQ(kept.checkpoints_peak, (size_t)(c.layers + 1) * boundary) << what;
  size_t previous_peak = kept.checkpoints_peak;
  // budgets in boundaries (×2: 5 is 2.5 boundaries); 8 and past: every boundary
  for (int halves : {2, 4, 5, 6, 8, 20}) {
    const long long budget = halves * boundary / 2;
    const ScoPlan plan = sco_plan(c.layers, (size_t)boundary, budget);
    const ScoTraining got = train(budget);
    char run[96];
    snprintf(run, sizeof run, "%s, budget %lld bytes (%.1f boundaries, |S| = %d)", what, budget, halves / 2.0, plan.count);
    printf("[mem] sco %s: checkpoints peak %zu bytes (%.2f boundaries; closed form %zu), %lld copies, %zu pinned bytes\n", run,
           got.checkpoints_peak, (double)got.checkpoints_peak / boundary, sco_device_bound(plan), got.copies, got.host_bytes);

    EXPECT_EQ(got.losses, kept.losses) << run;
    ASSERT_EQ(got.state.size(), kept.state.size()) << run;
    for (size_t i = 0; i < kept.state.size(); i++) {
      ASSERT_EQ(got.state[i].second.size(), kept.state[i].second.size()) << run;
      EXPECT_EQ(0, memcmp(got.state[i].second.data(), kept.state[i].second.data(), kept.state[i].second.size() * sizeof(float)))
          << run << ": section " << kept.state[i].first;
    }
    EXPECT_EQ(0, memcmp(got.params.data(), kept.params.data(), kept.params.size() * sizeof(floatX))) << run << ": weights";

    EXPECT_EQ(got.copies, 2LL * plan.count * t.steps * accum) << run;
    EXPECT_EQ(got.bytes_moved, (size_t)got.copies * (size_t)boundary) << run;
    EXPECT_EQ(got.host_bytes, (size_t)plan.count * (size_t)boundary) << run;
    EXPECT_LE(got.checkpoints_peak, sco_device_bound(plan)) << run;
    EXPECT_EQ(got.checkpoints_peak, sco_device_peak(plan)) << run;
    EXPECT_LE(got.checkpoints_peak, previous_peak) << run << ": a larger budget must not raise the peak";
    if (plan.count <= 3 && halves % 2 == 0) EXPECT_LT(got.checkpoints_peak, previous_peak) << run;
    if (plan.count == c.layers) EXPECT_LE(got.checkpoints_peak, (size_t)3 * boundary) << run;
    previous_peak = got.checkpoints_peak;
  }
}

}  // namespace testutil
