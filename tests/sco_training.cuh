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
  size_t peak = 0;             // the pool's peak over the whole run
  long long copies = 0;        // SCO's copies, both directions
  size_t bytes_moved = 0;
  size_t host_bytes = 0;       // pinned
};

// The SCO and kept-attention tests' model: 4 layers (a dense one, a shared expert), 2 heads, T = 37.
inline ModelConfig recompute_config(const Parallel& par) {
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40;
  c.layers = 4; c.experts = experts_for(6, par.ep.size); c.topk = 2; c.n_dense = 1; c.dense_dim = 48;
  c.shared_expert = 1;
  return c;
}

// The model, the batches and a run of 3 steps of 2 micro-batches under --recompute 1, shared by the
// SCO and selective attention recomputation tests: every run starts from the same weights and reads
// the same global batches, each rank its part of each (under sequence groups of D ranks, --sp D, its
// T/D tokens of each of its group's B sequences: rank_tokens).
struct RecomputeTraining {
  ModelConfig c;
  TrainConfig t;
  int B = 2, T = 0, N = 0, accum = 2;  // T: the whole sequence; N: this rank's tokens, B·T/D
  std::vector<float> master;
  std::vector<std::vector<int>> xs, ys;
  const Parallel& par;
  SequenceSplit split;

  RecomputeTraining(const Parallel& parallel, const ModelConfig& config) : c(config), par(parallel) {
    t.lr = 3e-3f; t.warmup = 1; t.steps = 3; t.grad_clip = 0.5f; t.bias_update = 1e-2f; t.recompute = 1;
    T = c.seq_len;
    const int D = par.seq.size;
    split = sequence_split(par.world.rank, par.world.size, c.heads, T, D);
    N = B * T / D;
    Rng rng;  // at W ranks the harness gives every rank the same seed: the same global batches
    master = random_master(c, rng);
    for (int i = 0; i < t.steps * accum; i++) {
      xs.emplace_back();
      ys.emplace_back();
      random_tokens(split.groups * B * T, c.vocab, rng, xs.back(), ys.back());
    }
  }
  size_t boundary() const { return (size_t)N * c.hidden * sizeof(floatX); }  // b·N·H: one boundary of this rank

  // Trains with SCO's host budget and the kept attention tensors (selective attention recomputation).
  ScoTraining run(long long offload_budget, const SarPlan& attention_kept = SarPlan()) {
    ScoTraining out;
    Seams seams;
    seams.offload_budget = offload_budget;
    Model m = model_create(c, 1, par, 0, seams);
    m.attention_kept = attention_kept;
    model_set_master(m, master);
    cudaCheck(cudaDeviceSynchronize(), "recompute_training", "sync");
    pool().reset_peak();
    for (int step = 0; step < t.steps; step++) {
      int next = step * accum;
      out.losses.push_back(model_train_step(m, t, step, B, N / B, accum, [&](int* xb, int* yb) {
        const std::vector<int> x = rank_tokens(xs[next], split, B, T), y = rank_tokens(ys[next], split, B, T);
        std::copy(x.begin(), x.end(), xb);
        std::copy(y.begin(), y.end(), yb);
        next++;
      }, nullptr));
    }
    out.checkpoints_peak = pool().peak(Mem::Checkpoints);
    out.peak = pool().peak();
    out.copies = m.sco->copies();
    out.bytes_moved = m.sco->bytes_moved();
    out.host_bytes = m.sco->host_bytes();
    out.state = m.opt->save(m.stream);
    out.params = download_vec(m.params, m.num_params);
    model_destroy(m);
    return out;
  }
};

// Bit-identity of two runs: the losses, every optimizer section of this rank's shards, the weights.
inline void expect_trained_alike(const ScoTraining& got, const ScoTraining& kept, const char* run) {
  EXPECT_EQ(got.losses, kept.losses) << run;
  ASSERT_EQ(got.state.size(), kept.state.size()) << run;
  for (size_t i = 0; i < kept.state.size(); i++) {
    ASSERT_EQ(got.state[i].second.size(), kept.state[i].second.size()) << run;
    EXPECT_EQ(0, memcmp(got.state[i].second.data(), kept.state[i].second.data(), kept.state[i].second.size() * sizeof(float)))
        << run << ": section " << kept.state[i].first;
  }
  EXPECT_EQ(0, memcmp(got.params.data(), kept.params.data(), kept.params.size() * sizeof(floatX))) << run << ": weights";
}

inline void sco_trains_alike(const Parallel& par, const char* what) {
  RecomputeTraining fixture(par, recompute_config(par));
  const ModelConfig& c = fixture.c;
  const TrainConfig& t = fixture.t;
  const int accum = fixture.accum;
  const long long boundary = (long long)fixture.boundary();
  auto train = [&](long long budget) { return fixture.run(budget); };
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

    expect_trained_alike(got, kept, run);

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

// Selective attention recomputation (ops/sar_plan.hpp) under --recompute 1, alone and beside SCO: the
// plans for budgets of 0, 1, 3 and every one of the 2·L options train bit-identically to full
// recomputation, and the pool's peak rises by at most the kept bytes. Under sequence groups (par.seq)
// the core option keeps attention's output in both shards (sar_option_bytes at D).
inline void attention_keep_trains_alike(const Parallel& par, const ModelConfig& config, const char* what) {
  RecomputeTraining fixture(par, config);
  const ModelConfig& c = fixture.c;
  const size_t b = sizeof(floatX);
  const int D = par.seq.size;
  const size_t core = sar_option_bytes(SarOption::Core, fixture.N, c.hidden, c.heads, b, D);
  const size_t projection = sar_option_bytes(SarOption::Projection, fixture.N, c.hidden, c.heads, b, D);
  for (long long offload : {0LL, 2 * (long long)fixture.boundary()}) {
    const ScoTraining full = fixture.run(offload);
    for (long long budget : {0LL, (long long)std::max(core, projection), (long long)(2 * core + projection),
                             (long long)(c.layers * (core + projection))}) {
      const SarPlan plan = attention_kept_plan(c, par, fixture.B, fixture.N / fixture.B, budget);
      const ScoTraining got = fixture.run(offload, plan);
      char run[160];
      snprintf(run, sizeof run, "%s, SCO budget %lld, attention budget %lld bytes: %zu options kept (%zu bytes)", what, offload,
               budget, plan.taken.size(), plan.bytes);
      printf("[mem] keep attention %s: pool peak %zu bytes, %+lld vs full recomputation\n", run, got.peak,
             (long long)got.peak - (long long)full.peak);
      EXPECT_LE(plan.bytes, (size_t)budget) << run;
      expect_trained_alike(got, full, run);
      EXPECT_LE(got.peak, full.peak + plan.bytes) << run;
    }
  }
}

}  // namespace testutil
