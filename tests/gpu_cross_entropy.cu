// GPU tests of ops/cross_entropy.cuh against ref/cross_entropy.hpp: losses, lse, dlogits (also
// in place over the logits, and from the one-kernel forward_backward) and loss_sum, at vocabulary
// sizes that are not multiples of the block size (including GPT-2's 50257); out-of-range targets;
// bitwise reproducibility; forward_backward the two kernels' bits.
#include <cstring>
#include "gpu_util.cuh"
#include "../ops/cross_entropy.cuh"
#include "../ref/cross_entropy.hpp"

using namespace testutil;

namespace {

std::vector<int> random_targets(Rng& rng, int N, int V) {
  std::vector<int> t(N);
  for (int n = 0; n < N; n++) t[n] = rng.integer(0, V - 1);
  return t;
}

void check_cross_entropy(const char* name, int N, int V) {
  REQUIRE_GPU();
  Rng rng;
  ref::Mat<double> logits = round_to_floatX(rng.mat<double>(N, V, 2.0));
  std::vector<int> targets = random_targets(rng, N, V);
  const float dloss = float(rng.uniform(0.5, 2.0) / N);
  ref::Vec<double> lse_ref;
  ref::Vec<double> losses_ref = ref::cross_entropy_forward(logits, as_column(targets), lse_ref);
  ref::Mat<double> dlogits_ref = ref::cross_entropy_backward(logits, as_column(targets), double(dloss));

  DeviceBuffer<floatX> d_logits = upload<floatX>(logits, Mem::Logits);
  DeviceBuffer<int> d_targets = upload_vec(targets);
  DeviceBuffer<float> d_losses(N, Mem::Logits, "test.losses"), d_lse(N, Mem::Logits, "test.lse");
  DeviceBuffer<float> d_sum(1, Mem::Logits, "test.loss_sum");
  poison(d_losses.ptr, N);
  poison(d_lse.ptr, N);
  poison(d_sum.ptr, 1);
  cross_entropy_forward(d_losses.ptr, d_lse.ptr, d_logits.ptr, d_targets.ptr, N, V, 0);
  loss_sum(d_sum.ptr, d_losses.ptr, N, 0);
  EXPECT_REL(name, "losses", rel_err(download(d_losses.ptr, N, 1), losses_ref), OP_TOL);
  EXPECT_REL(name, "lse", rel_err(download(d_lse.ptr, N, 1), lse_ref), OP_TOL);
  double sum = download(d_sum.ptr, 1, 1)(0, 0), sum_ref = ref::loss_sum(losses_ref);
  EXPECT_REL(name, "loss_sum", std::abs(sum - sum_ref) / std::abs(sum_ref), OP_TOL);

  DeviceBuffer<floatX> d_dlogits((size_t)N * V, Mem::Logits, "test.dlogits");
  poison(d_dlogits.ptr, d_dlogits.count);
  cross_entropy_backward(d_dlogits.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr, dloss, N, V, 0);
  EXPECT_REL(name, "dlogits", rel_err(download(d_dlogits.ptr, N, V), dlogits_ref), OP_TOL);

  cross_entropy_backward(d_logits.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr, dloss, N, V, 0);
  EXPECT_REL(name, "dlogits(in place)", rel_err(download(d_logits.ptr, N, V), dlogits_ref), OP_TOL);

  // the head's form: one kernel, in place over a fresh copy of the logits
  DeviceBuffer<floatX> d_fused = upload<floatX>(logits, Mem::Logits);
  poison(d_losses.ptr, N);
  poison(d_lse.ptr, N);
  cross_entropy_forward_backward(d_fused.ptr, d_losses.ptr, d_lse.ptr, d_fused.ptr, d_targets.ptr, dloss, N, V, 0);
  EXPECT_REL(name, "losses(fwd+bwd)", rel_err(download(d_losses.ptr, N, 1), losses_ref), OP_TOL);
  EXPECT_REL(name, "lse(fwd+bwd)", rel_err(download(d_lse.ptr, N, 1), lse_ref), OP_TOL);
  EXPECT_REL(name, "dlogits(fwd+bwd)", rel_err(download(d_fused.ptr, N, V), dlogits_ref), OP_TOL);
}

// forward_backward against cross_entropy_forward then cross_entropy_backward on the same logits:
// losses, lse and dlogits compared with memcmp. dlogits_offset 1 puts dlogits one element off 16-byte
// alignment (the two kernels would take the rows in different pieces: forward_backward runs them).
void check_forward_backward_bits(const char* name, int N, int V, bool in_place, int dlogits_offset) {
  REQUIRE_GPU();
  Rng rng;
  const ref::Mat<double> logits = rng.mat<double>(N, V, 3.0);
  std::vector<int> targets = random_targets(rng, N, V);
  targets[N / 2] = V;  // a NaN row
  const float dloss = float(rng.uniform(0.5, 2.0) / N);
  DeviceBuffer<int> d_targets = upload_vec(targets);
  struct Outputs {
    std::vector<float> losses, lse;
    std::vector<floatX> dlogits;
  } out[2];
  for (int fused = 0; fused < 2; fused++) {
    DeviceBuffer<floatX> d_logits = upload<floatX>(logits, Mem::Logits);
    DeviceBuffer<floatX> d_grad((size_t)N * V + dlogits_offset, Mem::Logits, "test.dlogits");
    DeviceBuffer<float> d_losses(N, Mem::Logits, "test.losses"), d_lse(N, Mem::Logits, "test.lse");
    floatX* dlogits = in_place ? d_logits.ptr : d_grad.ptr + dlogits_offset;
    poison(d_grad.ptr, d_grad.count);
    poison(d_losses.ptr, N);
    poison(d_lse.ptr, N);
    if (fused) {
      cross_entropy_forward_backward(dlogits, d_losses.ptr, d_lse.ptr, d_logits.ptr, d_targets.ptr, dloss, N, V, 0);
    } else {
      cross_entropy_forward(d_losses.ptr, d_lse.ptr, d_logits.ptr, d_targets.ptr, N, V, 0);
      cross_entropy_backward(dlogits, d_logits.ptr, d_lse.ptr, d_targets.ptr, dloss, N, V, 0);
    }
    out[fused].losses = download_vec(d_losses.ptr, N);
    out[fused].lse = download_vec(d_lse.ptr, N);
    out[fused].dlogits = download_vec(dlogits, (size_t)N * V);
  }
  EXPECT_TRUE(std::isnan(out[1].losses[N / 2])) << name;
  EXPECT_EQ(0, memcmp(out[0].losses.data(), out[1].losses.data(), N * sizeof(float))) << name << ": losses";
  EXPECT_EQ(0, memcmp(out[0].lse.data(), out[1].lse.data(), N * sizeof(float))) << name << ": lse";
  EXPECT_EQ(0, memcmp(out[0].dlogits.data(), out[1].dlogits.data(), out[0].dlogits.size() * sizeof(floatX)))
      << name << ": dlogits";
}

}  // namespace

TEST(CrossEntropyGpu, MatchesReferenceSmallOddShape) { check_cross_entropy("CrossEntropyGpu.N37V1000", 37, 1000); }
TEST(CrossEntropyGpu, MatchesReferenceOddVocab) { check_cross_entropy("CrossEntropyGpu.N300V5003", 300, 5003); }
TEST(CrossEntropyGpu, MatchesReferenceGpt2Vocab) { check_cross_entropy("CrossEntropyGpu.N16V50257", 16, 50257); }
TEST(CrossEntropyGpu, MatchesReferenceVocabSmallerThanBlock) { check_cross_entropy("CrossEntropyGpu.N9V40", 9, 40); }

TEST(CrossEntropyGpu, OutOfRangeTargetGivesNanLossAndGradientOnlyForItsRow) {
  REQUIRE_GPU();
  Rng rng;
  const int N = 6, V = 77;
  ref::Mat<double> logits = round_to_floatX(rng.mat<double>(N, V));
  std::vector<int> targets = random_targets(rng, N, V);
  targets[2] = V;
  targets[4] = -1;
  DeviceBuffer<floatX> d_logits = upload<floatX>(logits, Mem::Logits);
  DeviceBuffer<int> d_targets = upload_vec(targets);
  DeviceBuffer<float> d_losses(N, Mem::Logits, "test.losses"), d_lse(N, Mem::Logits, "test.lse");
  DeviceBuffer<floatX> d_dlogits((size_t)N * V, Mem::Logits, "test.dlogits");
  cross_entropy_forward(d_losses.ptr, d_lse.ptr, d_logits.ptr, d_targets.ptr, N, V, 0);
  cross_entropy_backward(d_dlogits.ptr, d_logits.ptr, d_lse.ptr, d_targets.ptr, 1.0f / N, N, V, 0);
  ref::Mat<double> losses = download(d_losses.ptr, N, 1);
  ref::Mat<double> dlogits = download(d_dlogits.ptr, N, V);
  for (int n = 0; n < N; n++) {
    bool valid = targets[n] >= 0 && targets[n] < V;
    EXPECT_EQ(std::isnan(losses(n, 0)), !valid) << "row " << n;
    EXPECT_EQ(dlogits.row(n).array().isNaN().all(), !valid) << "row " << n;
    if (valid) EXPECT_TRUE(dlogits.row(n).allFinite()) << "row " << n;
  }
}

TEST(CrossEntropyGpu, ForwardAndLossSumAreBitwiseReproducible) {
  REQUIRE_GPU();
  Rng rng;
  const int N = 64, V = 10007;
  DeviceBuffer<floatX> d_logits = upload<floatX>(rng.mat<double>(N, V, 3.0), Mem::Logits);
  DeviceBuffer<int> d_targets = upload_vec(random_targets(rng, N, V));
  std::vector<float> runs[2];
  for (int run = 0; run < 2; run++) {
    DeviceBuffer<float> d_losses(N, Mem::Logits, "test.losses"), d_lse(N, Mem::Logits, "test.lse");
    DeviceBuffer<float> d_sum(1, Mem::Logits, "test.loss_sum");
    cross_entropy_forward(d_losses.ptr, d_lse.ptr, d_logits.ptr, d_targets.ptr, N, V, 0);
    loss_sum(d_sum.ptr, d_losses.ptr, N, 0);
    runs[run] = download_vec(d_lse.ptr, N);
    runs[run].push_back(download_vec(d_sum.ptr, 1)[0]);
  }
  EXPECT_EQ(0, memcmp(runs[0].data(), runs[1].data(), runs[0].size() * sizeof(float)));
}

TEST(CrossEntropyGpu, ForwardBackwardInOneKernelIsTheTwoKernelsBitForBit) {
  check_forward_backward_bits("pieces, in place", 37, 1000, true, 0);
  check_forward_backward_bits("pieces, own buffer", 64, 16384, false, 0);
  check_forward_backward_bits("single elements (V odd)", 16, 5003, true, 0);
  check_forward_backward_bits("dlogits off 16-byte alignment", 9, 1000, false, 1);
}
