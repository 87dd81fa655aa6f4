// dist_model_util.cuh — what the whole-model multi-rank tests (dist_model.cu, dist_sequence_parallel.cu)
// compare with: each tensor of a rank's own shards against the reference, the optimizer's master
// weights as a local flat buffer, a device buffer as host floats.
#pragma once
#include "../model.cuh"
#include "gpu_util.cuh"
#include "model_util.cuh"

// Normwise error of tensor `spec` over the part of it that lies in this rank's shards, between a
// local flat GPU buffer and the same positions of ref; *elements gets that part's size (0: none).
inline double shard_tensor_err(const Model& m, size_t spec, const std::vector<float>& gpu_local,
                               const std::vector<float>& ref_local, size_t* elements) {
  double num = 0, den = 0;
  *elements = 0;
  for (const ParamRegion& r : m.regions) {
    size_t lo = std::max(r.shard_offset, m.offsets[spec]), hi = std::min(r.shard_offset + r.shard, m.offsets[spec] + m.local_numel[spec]);
    for (size_t i = lo; i < hi; i++, (*elements)++) {
      num += (gpu_local[i] - ref_local[i]) * (double)(gpu_local[i] - ref_local[i]);
      den += (double)ref_local[i] * ref_local[i];
    }
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Asserts every tensor's part of this rank's shards on its own.
inline void expect_shards_match(const char* what, const char* prefix, const Model& m,
                                const std::vector<float>& gpu_local, const std::vector<float>& ref_local) {
  int checked = 0;
  for (size_t i = 0; i < m.specs.size(); i++) {
    size_t elements = 0;
    double e = shard_tensor_err(m, i, gpu_local, ref_local, &elements);
    if (elements == 0) continue;  // none of this tensor is in this rank's shards
    EXPECT_REL(what, (prefix + m.specs[i].name).c_str(), e, MODEL_TOL);
    checked++;
  }
  EXPECT_GT(checked, 0) << "this rank owns no shard of any tensor";
}

// A first step against the reference over the global batch: the loss, every tensor of this rank's
// gradient shards, and the reference's routing agreeing with the ranks' (FP32; BF16 reports it: the
// router's input carries bf16 error).
inline void expect_first_step_matches(const char* what, const Model& m, double loss, double ref_loss,
                                      const std::vector<float>& grads, const std::vector<float>& ref_local,
                                      long long route_disagreements) {
  EXPECT_REL(what, "loss", std::fabs(loss - ref_loss) / ref_loss, MODEL_TOL);
  expect_shards_match(what, "d", m, grads, ref_local);
  printf("[route] %s: %lld top-k choices differ from the reference's (no gap under 1e-3 in its k + 1 largest keys)\n",
         what, route_disagreements);
#if !defined(FLATMOE_BF16)
  EXPECT_EQ(route_disagreements, 0);
#endif
}

// The optimizer's master weights of this rank's shards, placed at their positions in a local flat
// buffer (zeros elsewhere).
inline std::vector<float> master_as_local(Model& m) {
  std::vector<float> state;
  for (auto& sec : m.opt->save(m.stream))
    if (sec.first == "master") state = sec.second;
  std::vector<float> local(m.num_params, 0.f);
  for (const ShardSegment& g : m.opt->segments) std::copy_n(state.begin() + g.state_offset, g.count, local.begin() + g.param_offset);
  return local;
}

template <typename T>
inline std::vector<float> download_local(const T* dev, size_t n) {
  std::vector<T> h = testutil::download_vec(dev, n);
  std::vector<float> out(n);
  for (size_t i = 0; i < n; i++) out[i] = to_float(h[i]);
  return out;
}

// One pass of this rank's B sequences of T tokens (x, y), keeping the activations and then recomputing
// them: the loss and every gradient of this rank's shards are the same bits. `what` names the case.
inline void expect_recompute_bit_identical(Model& m, const int* x, const int* y, int B, int T, float dloss,
                                           const std::string& what) {
  std::vector<float> grads[2];
  float loss[2];
  for (int recompute = 0; recompute < 2; recompute++) {
    model_zero_grads(m);
    PassOptions o;
    o.dloss = dloss;
    o.recompute = recompute == 1;
    loss[recompute] = model_pass(m, x, y, B, T, o);
    grads[recompute] = download_local(m.main_grads, m.num_params);
  }
  EXPECT_EQ(0, memcmp(&loss[0], &loss[1], sizeof(float))) << what;
  EXPECT_EQ(0, memcmp(grads[0].data(), grads[1].data(), grads[0].size() * sizeof(float)))
      << what << ": recomputation must reproduce the gradients bit for bit";
}
