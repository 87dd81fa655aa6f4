// GPU tests of ops/adamw.cuh against ref/adamw.hpp: several steps of AdamW over two parameter
// tensors from a random mid-training state (t > 1, non-zero moments), with the global gradient
// norm from common.cuh's deterministic sumsq, clipping on in some steps and off in others.
// Every step's update θ_new − θ_old is compared with the reference's (θ_new itself is dominated by
// θ_old, so a wrong update would hide in it); then the final master, moments and weights.
#include "gpu_util.cuh"
#include "../ops/adamw.cuh"
#include "../ref/adamw.hpp"

using namespace testutil;

namespace {

// Rounds a double vector through float: the reference starts from exactly the GPU's fp32 state.
ref::Vec<double> round_to_float(const ref::Vec<double>& v) { return v.cast<float>().cast<double>(); }

struct ParamTensor {
  int n;
  ref::Vec<double> master, m, v, grad;       // reference state (double)
  DeviceBuffer<float> d_master, d_m, d_v;    // GPU state (fp32)
  DeviceBuffer<floatX> d_param;
  DeviceBuffer<float> d_grad;                // fp32 gradients (model.cuh's main_grads): a fresh upload every step
};

ParamTensor make_tensor(Rng& rng, int n) {
  ParamTensor p;
  p.n = n;
  p.master = round_to_float(rng.mat<double>(n, 1).col(0));
  p.m = round_to_float(rng.mat<double>(n, 1, 0.1).col(0));
  p.v = round_to_float(rng.mat<double>(n, 1, 0.1).col(0).cwiseAbs2());
  p.d_master = upload<float>(p.master, Mem::Optimizer);
  p.d_m = upload<float>(p.m, Mem::Optimizer);
  p.d_v = upload<float>(p.v, Mem::Optimizer);
  p.d_param = DeviceBuffer<floatX>(n, Mem::Weights, "test.param");
  poison(p.d_param.ptr, n);
  return p;
}

void check_adamw(const char* name, int n1, int n2) {
  REQUIRE_GPU();
  Rng rng;
  const float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, wd = 0.1f;
  const int first_step = 7, steps = 4;
  ParamTensor tensors[2] = {make_tensor(rng, n1), make_tensor(rng, n2)};
  DeviceBuffer<float> d_partials(SUMSQ_BLOCKS, Mem::Workspace, "test.sumsq_partials");
  DeviceBuffer<float> d_sumsq(1, Mem::Workspace, "test.sumsq");

  for (int t = first_step; t < first_step + steps; t++) {
    std::vector<ref::Vec<double>> grads;
    for (ParamTensor& p : tensors) {
      p.grad = round_to_float(rng.mat<double>(p.n, 1, 0.3).col(0));
      grads.push_back(p.grad);
      p.d_grad = upload<float>(p.grad, Mem::Grads);
    }
    cudaCheck(cudaMemsetAsync(d_partials.ptr, 0, d_partials.bytes(), 0), "test", "sumsq");
    for (ParamTensor& p : tensors) sumsq_accumulate(d_partials.ptr, p.d_grad.ptr, p.n, 0);
    sumsq_finish(d_sumsq.ptr, d_partials.ptr, 0);
    float norm = std::sqrt(download_vec(d_sumsq.ptr, 1)[0]);
    double norm_ref = ref::global_norm(grads);
    EXPECT_REL(name, "grad_norm", std::abs(norm - norm_ref) / norm_ref, OP_TOL);

    double max_norm = (t % 2 == 0) ? 0.5 * norm_ref : 0.0;  // clipping on even steps only
    float scale = clip_scale(norm, (float)max_norm);
    double scale_ref = ref::clip_scale(norm_ref, max_norm);
    for (int i = 0; i < 2; i++) {
      ParamTensor& p = tensors[i];
      const ref::Mat<double> master_old = download(p.d_master.ptr, p.n, 1);  // [n, 1]
      const ref::Vec<double> master_old_ref = p.master;                      // [n]
      adamw_update(p.d_master.ptr, p.d_param.ptr, p.d_m.ptr, p.d_v.ptr, p.d_grad.ptr, p.n, lr, beta1, beta2, eps, wd,
                   t, scale, 0);
      ref::adamw_update<double>(p.master, p.m, p.v, p.grad, lr, beta1, beta2, eps, wd, t, scale_ref);
      const ref::Mat<double> update = download(p.d_master.ptr, p.n, 1) - master_old;
      const ref::Vec<double> update_ref = p.master - master_old_ref;
      const std::string tensor = "update t" + std::to_string(t) + " p" + std::to_string(i);
      EXPECT_REL(name, tensor.c_str(), rel_err(update, update_ref), OP_TOL);
    }
  }

  for (ParamTensor& p : tensors) {
    ref::Mat<double> master = download(p.d_master.ptr, p.n, 1);
    EXPECT_REL(name, "master", rel_err(master, p.master), OP_TOL);
    EXPECT_REL(name, "m", rel_err(download(p.d_m.ptr, p.n, 1), p.m), OP_TOL);
    EXPECT_REL(name, "v", rel_err(download(p.d_v.ptr, p.n, 1), p.v), OP_TOL);
    EXPECT_REL(name, "param", rel_err(download(p.d_param.ptr, p.n, 1), p.master), OP_TOL);
    ref::Mat<double> param = download(p.d_param.ptr, p.n, 1);
    int not_rounded_master = 0;
    for (int i = 0; i < p.n; i++)
      if (param(i, 0) != to_float(from_float<floatX>((float)master(i, 0)))) not_rounded_master++;
    EXPECT_EQ(not_rounded_master, 0) << "param must be floatX(master)";
  }
}

}  // namespace

TEST(AdamWGpu, MatchesReferenceOverStepsSmall) { check_adamw("AdamWGpu.n1000+37", 1000, 37); }
TEST(AdamWGpu, MatchesReferenceOverStepsLarge) { check_adamw("AdamWGpu.n100003+4099", 100003, 4099); }

TEST(AdamWHost, ClipScaleMatchesReference) {
  for (float norm : {0.1f, 1.0f, 3.5f, 1e4f})
    for (float max_norm : {-1.0f, 0.0f, 0.5f, 1.0f, 2.0f})
      EXPECT_NEAR(clip_scale(norm, max_norm), ref::clip_scale<double>(norm, max_norm), 1e-6)
          << "norm=" << norm << " max_norm=" << max_norm;
}
