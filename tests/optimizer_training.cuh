// tests/optimizer_training.cuh — the three optimizers (--optimizer adamw, offload_adamw, cpu_adamw) training
// the whole model, on one GPU (gpu_model.cu) and at W ranks with ZeRO-1 shards (dist_model.cu).
//
// Ten steps with gradient accumulation, clipping, weight decay and router bias updates, the same
// batches for each optimizer: the losses, every optimizer section of this rank's shards (master, m,
// v) and the weights are bit-identical to adamw's after the ten steps (memcmp): offload_adamw runs
// adamw's kernel on the same values, cpu_adamw the same element arithmetic (ops/adamw_math.hpp).
// Then a resume across optimizers: adamw's state after five steps, loaded into a fresh model with
// another optimizer (other initial weights), continues bit-identically to adamw's ten.
// With accum = 1 on one rank, adamw's steps skip the fold and read the pass's bf16 gradients
// (model_train_step) while the other two fold them into fp32 and read those: bit-identical still.
#pragma once
#include <cstring>
#include "../model.cuh"
#include "gpu_util.cuh"
#include "model_util.cuh"

namespace testutil {

struct OptimizerTraining {
  std::vector<float> losses;
  StateSections state;         // after the last step
  std::vector<float> router_bias;
  std::vector<floatX> params;  // this rank's weight buffer after the last step
};

inline void optimizers_train_alike(const Parallel& par, const char* what, int accum = 2) {
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40;
  c.layers = 3; c.experts = experts_for(6, par.ep.size); c.topk = 2; c.n_dense = 1; c.dense_dim = 48; c.shared_expert = 1;
  TrainConfig t;
  t.lr = 3e-3f; t.warmup = 2; t.steps = 10; t.grad_clip = 0.5f; t.weight_decay = 0.1f; t.bias_update = 1e-2f;
  const int B = 2, T = c.seq_len, N = B * T, W = par.world.size, rank = par.world.rank, half = t.steps / 2;
  Rng rng;  // at W ranks the harness gives every rank the same seed: the same global batches
  std::vector<float> master = random_master(c, rng);
  std::vector<std::vector<int>> xs, ys;
  for (int i = 0; i < t.steps * accum; i++) {
    xs.emplace_back();
    ys.emplace_back();
    random_tokens(N * W, c.vocab, rng, xs.back(), ys.back());
  }
  auto seams_for = [](const std::string& optimizer) {
    Seams s;
    s.optimizer = optimizer;
    s.offload_bucket = 997;  // several buckets (cpu_adamw: chunks) per region, a multiple of no tensor size
    s.offload_slots = 2;
    return s;
  };
  auto train = [&](Model& m, int from, int to, OptimizerTraining& out) {
    for (int step = from; step < to; step++) {
      int next = step * accum;
      out.losses.push_back(model_train_step(m, t, step, B, T, accum, [&](int* xb, int* yb) {
        std::copy_n(xs[next].data() + rank * N, N, xb);
        std::copy_n(ys[next].data() + rank * N, N, yb);
        next++;
      }, nullptr));
    }
    out.state = m.opt->save(m.stream);
    out.router_bias = m.router_bias;
    out.params = download_vec(m.params, m.num_params);
  };
  auto expect_same = [&](const OptimizerTraining& got, const OptimizerTraining& want, const std::string& run) {
    EXPECT_EQ(got.losses, want.losses) << what << " " << run;
    ASSERT_EQ(got.state.size(), want.state.size()) << what << " " << run;
    for (size_t i = 0; i < want.state.size(); i++) {
      EXPECT_EQ(got.state[i].first, want.state[i].first);
      ASSERT_EQ(got.state[i].second.size(), want.state[i].second.size());
      EXPECT_EQ(0, memcmp(got.state[i].second.data(), want.state[i].second.data(), want.state[i].second.size() * sizeof(float)))
          << what << " " << run << ": section " << want.state[i].first;
    }
    EXPECT_EQ(got.router_bias, want.router_bias) << what << " " << run;
    EXPECT_EQ(0, memcmp(got.params.data(), want.params.data(), want.params.size() * sizeof(floatX))) << what << " " << run << ": weights";
  };

  OptimizerTraining adamw, adamw_half;
  {
    Model m = model_create(c, 1, par, 0, seams_for("adamw"));
    model_set_master(m, master);
    train(m, 0, half, adamw_half);
    adamw.losses = adamw_half.losses;
    train(m, half, t.steps, adamw);
    model_destroy(m);
  }
  for (const char* optimizer : {"offload_adamw", "cpu_adamw"}) {
    OptimizerTraining got;
    Model m = model_create(c, 1, par, 0, seams_for(optimizer));
    model_set_master(m, master);
    train(m, 0, t.steps, got);
    printf("[train] %s: --optimizer %s step 10 loss %.7f, adamw %.7f, pinned host %.1f KiB\n", what, optimizer,
           got.losses.back(), adamw.losses.back(), m.opt->host_bytes() / 1024.0);
    model_destroy(m);
    expect_same(got, adamw, std::string("--optimizer ") + optimizer);

    OptimizerTraining resumed;
    resumed.losses = adamw_half.losses;
    Model r = model_create(c, 77, par, 0, seams_for(optimizer));  // other weights: all must come from the state
    r.opt->load(adamw_half.state, half, r.stream);
    r.opt->write_weights(r.params, r.stream);
    all_gather_weights(r);
    r.router_bias = adamw_half.router_bias;
    model_upload_router_bias(r);
    train(r, half, t.steps, resumed);
    model_destroy(r);
    expect_same(resumed, adamw, std::string("adamw's state at step 5 resumed by --optimizer ") + optimizer);
  }
}

}  // namespace testutil
