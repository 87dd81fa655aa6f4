// GPU tests of ops/offload_adamw.cuh (--optimizer offload_adamw and cpu_adamw) through the optimizer
// seam, against --optimizer adamw (ops/adamw.cuh) and ref/adamw.hpp. A problem: segments of odd sizes
// (1, 37, 1001, 4099) with shard padding between them, weight decay on some, a random mid-training
// state (t > 1, non-zero moments) and three steps of fresh gradients, clipped on some. S = 5153 is a
// multiple of no bucket size tried but 1.
//   * adamw's every step, each segment's m, v and θ within fp32 rounding of the reference, element by
//     element (adamw_check.hpp; normwise errors reported);
//   * offload_adamw with β = 1, 7, 64, 1000 and β > S, s = 1, 2, 3, and cpu_adamw with 1 and 3 threads
//     and chunks of β = 1, 7, 1000 and β > S (the last: copies, update and copies one after another):
//     after every step the state (master, m, v: the checkpoint sections) and the weights are
//     bit-identical to adamw's (memcmp): the same kernel (offload), the same element arithmetic (cpu);
//   * the pool's Mem::Optimizer peak while offload_adamw runs is s·min(β, S)·12 bytes (≤ s·β·12); cpu_adamw's is 0;
//   * W = 2: both ranks' segments of a small model's ZeRO-1 layout (config.hpp) step alike;
//   * resume across optimizers: the state one saves after two steps, loaded into another, continues
//     bit-identically to the first.
#include <cstring>
#include <functional>
#include "adamw_check.hpp"
#include "gpu_util.cuh"
#include "../ops/offload_adamw.cuh"

using namespace testutil;

namespace {

const AdamWSettings kSettings{0.9f, 0.95f, 1e-8f, 0.1f};
const float kLr = 1e-2f;
const int kFirstStep = 5, kSteps = 3;

struct Problem {
  std::vector<ShardSegment> segments;
  size_t S = 0, P = 0;                    // state elements, weight-buffer elements
  std::vector<float> master, m, v;        // [S] the state to start from (padding 0)
  std::vector<std::vector<float>> grads;  // [steps][P]
  std::vector<float> scales;              // [steps] clip factors
};

Problem make_problem(Rng& rng, std::vector<ShardSegment> segments, size_t S, size_t P) {
  Problem p;
  p.segments = std::move(segments);
  p.S = S;
  p.P = P;
  p.master.assign(S, 0.f);
  p.m.assign(S, 0.f);
  p.v.assign(S, 0.f);
  for (const ShardSegment& g : p.segments)
    for (size_t i = g.state_offset; i < g.state_offset + g.count; i++) {
      p.master[i] = (float)rng.normal();
      p.m[i] = (float)rng.normal(0.1);
      p.v[i] = (float)std::pow(rng.normal(0.1), 2);
    }
  for (int s = 0; s < kSteps; s++) {
    p.grads.emplace_back(P);
    for (float& x : p.grads.back()) x = (float)rng.normal(0.3);
    p.scales.push_back(s % 2 ? 0.41f : 1.f);
  }
  return p;
}

// {param_offset, state_offset, count, decay}: odd sizes, padding between them in both layouts.
Problem odd_problem(Rng& rng) {
  return make_problem(rng, {{2, 0, 1, false}, {7, 3, 37, true}, {60, 41, 1001, true}, {1070, 1045, 4099, true}},
                      5153, 5200);
}

struct AfterStep {
  StateSections state;
  std::vector<floatX> params;
};

struct OptimizerRun {
  std::vector<AfterStep> steps;
  size_t optimizer_peak = 0;  // pool's Mem::Optimizer peak over the run, above what was live before
};

using MakeOptimizer = std::function<std::unique_ptr<Optimizer>(const Problem&)>;

StateSections sections_of(const std::vector<float>& master, const std::vector<float>& m, const std::vector<float>& v) {
  return {{"master", master}, {"adam_m", m}, {"adam_v", v}};
}

// Loads the problem's state (step kFirstStep − 1 taken), then steps `from`..kSteps−1 on stream 0.
OptimizerRun run(const Problem& p, const MakeOptimizer& make, const StateSections& start, int from) {
  pool().reset_peak();
  const size_t live_before = pool().live(Mem::Optimizer);
  OptimizerRun r;
  DeviceBuffer<floatX> params(p.P, Mem::Weights, "test.params");
  DeviceBuffer<float> grads(p.P, Mem::Grads, "test.grads");
  DeviceBuffer<float> scale(1, Mem::Workspace, "test.grad_scale");  // the clip factor, read on the device
  poison(params.ptr, p.P);
  {
    std::unique_ptr<Optimizer> opt = make(p);
    opt->load(start, kFirstStep - 1 + from, 0);
    opt->write_weights(params.ptr, 0);
    for (int s = from; s < kSteps; s++) {
      cudaCheck(cudaMemcpy(grads.ptr, p.grads[s].data(), p.P * sizeof(float), cudaMemcpyHostToDevice), "test", "grads");
      cudaCheck(cudaMemcpy(scale.ptr, &p.scales[s], sizeof(float), cudaMemcpyHostToDevice), "test", "grad_scale");
      opt->step(params.ptr, grads.ptr, kLr, kSettings, scale.ptr, 0);
      r.steps.push_back(AfterStep{opt->save(0), download_vec(params.ptr, p.P)});
    }
    r.optimizer_peak = pool().peak(Mem::Optimizer) - live_before;
  }
  return r;
}

OptimizerRun run(const Problem& p, const MakeOptimizer& make) { return run(p, make, sections_of(p.master, p.m, p.v), 0); }

MakeOptimizer device_adamw() {
  return [](const Problem& p) { return std::make_unique<DeviceAdamW>(p.segments, p.S, (cudaStream_t)0); };
}
MakeOptimizer offload_adamw(size_t bucket, int slots) {
  return [=](const Problem& p) { return std::make_unique<OffloadAdamW>(p.segments, p.S, bucket, slots, (cudaStream_t)0); };
}
MakeOptimizer cpu_adamw(int threads, size_t chunk) {
  return [=](const Problem& p) { return std::make_unique<CpuAdamW>(p.segments, p.S, threads, chunk, (cudaStream_t)0); };
}

const std::vector<float>& section(const AfterStep& a, const char* name) {
  for (const auto& sec : a.state)
    if (sec.first == name) return sec.second;
  throw std::runtime_error(std::string("no optimizer section ") + name);
}

// Every step's state and weights the same bytes.
void expect_bit_identical(const OptimizerRun& got, const OptimizerRun& want, const std::string& what) {
  ASSERT_EQ(got.steps.size(), want.steps.size()) << what;
  for (size_t s = 0; s < want.steps.size(); s++) {
    for (const char* name : {"master", "adam_m", "adam_v"}) {
      const std::vector<float>&a = section(got.steps[s], name), &b = section(want.steps[s], name);
      ASSERT_EQ(a.size(), b.size()) << what << " " << name;
      EXPECT_EQ(0, memcmp(a.data(), b.data(), a.size() * sizeof(float))) << what << ": " << name << " after step " << s + 1;
    }
    EXPECT_EQ(0, memcmp(got.steps[s].params.data(), want.steps[s].params.data(), want.steps[s].params.size() * sizeof(floatX)))
        << what << ": weights after step " << s + 1;
  }
}

// Each step of `r` against the reference from the state before it, segment by segment.
void expect_reference_steps(const Problem& p, const OptimizerRun& r, const char* what) {
  std::vector<float> master = p.master, m = p.m, v = p.v;
  for (int s = 0; s < kSteps; s++) {
    const std::vector<float>&master_after = section(r.steps[s], "master"), &m_after = section(r.steps[s], "adam_m"),
                        &v_after = section(r.steps[s], "adam_v");
    for (const ShardSegment& g : p.segments) {
      const size_t o = g.state_offset;
      std::vector<float> grad(p.grads[s].begin() + g.param_offset, p.grads[s].begin() + g.param_offset + g.count);
      const AdamWStepCheck c = check_adamw_step(&master[o], &m[o], &v[o], grad.data(), &master_after[o], &m_after[o],
                                                &v_after[o], g.count, kLr, kSettings.beta1, kSettings.beta2, kSettings.eps,
                                                g.decay ? kSettings.weight_decay : 0.0, kFirstStep + s, p.scales[s]);
      EXPECT_EQ(c.outside, 0) << what << ": elements beyond fp32 rounding, step " << s + 1 << " n=" << g.count;
      ref::Vec<double> update(g.count), update_ref(g.count), m_got(g.count), v_got(g.count);
      for (size_t i = 0; i < g.count; i++) {
        update(i) = (double)master_after[o + i] - master[o + i];
        update_ref(i) = c.master_ref(i) - master[o + i];
        m_got(i) = m_after[o + i];
        v_got(i) = v_after[o + i];
      }
      const std::string tensor = " s" + std::to_string(s + 1) + " n" + std::to_string(g.count);
      report_normwise(what, ("update" + tensor).c_str(), rel_err(update, update_ref));
      report_normwise(what, ("m" + tensor).c_str(), rel_err(m_got, c.m_ref));
      report_normwise(what, ("v" + tensor).c_str(), rel_err(v_got, c.v_ref));
    }
    master = master_after;
    m = m_after;
    v = v_after;
  }
}

}  // namespace

TEST(OffloadAdamWGpu, AdamWStepsMatchTheReferencePerElement) {
  REQUIRE_GPU();
  Rng rng;
  const Problem p = odd_problem(rng);
  expect_reference_steps(p, run(p, device_adamw()), "adamw");
}

TEST(OffloadAdamWGpu, EveryBucketAndSlotCountIsBitIdenticalToAdamWWithinItsStaging) {
  REQUIRE_GPU();
  Rng rng;
  const Problem p = odd_problem(rng);
  const OptimizerRun want = run(p, device_adamw());
  for (size_t bucket : {(size_t)1, (size_t)7, (size_t)64, (size_t)1000, (size_t)1 << 20})
    for (int slots : {1, 2, 3}) {
      const std::string what = "offload_adamw beta=" + std::to_string(bucket) + " s=" + std::to_string(slots);
      const OptimizerRun got = run(p, offload_adamw(bucket, slots));
      expect_bit_identical(got, want, what);
      EXPECT_LE(got.optimizer_peak, (size_t)slots * bucket * 12) << what;
      EXPECT_EQ(got.optimizer_peak, (size_t)slots * std::min(bucket, p.S) * 12) << what;
      printf("[mem] %s: Mem::Optimizer peak %zu bytes (s*min(beta,S)*12 = %zu)\n", what.c_str(), got.optimizer_peak,
             (size_t)slots * std::min(bucket, p.S) * 12);
    }
}

TEST(OffloadAdamWGpu, CpuAdamWIsBitIdenticalToAdamWWithNoDeviceState) {
  REQUIRE_GPU();
  Rng rng;
  const Problem p = odd_problem(rng);
  const OptimizerRun want = run(p, device_adamw());
  for (size_t chunk : {(size_t)1, (size_t)7, (size_t)1000, (size_t)1 << 20})
    for (int threads : {1, 3}) {
      const OptimizerRun got = run(p, cpu_adamw(threads, chunk));
      expect_bit_identical(got, want, "cpu_adamw threads=" + std::to_string(threads) + " chunk=" + std::to_string(chunk));
      EXPECT_EQ(got.optimizer_peak, 0u);
    }
}

// Both ranks' shards of a small model at W = 2 (ZeRO-1 over the dense region, experts split E_p = 2).
TEST(OffloadAdamWGpu, ShardsOfBothRanksAtW2) {
  REQUIRE_GPU();
  ModelConfig c;
  c.vocab = 67; c.hidden = 64; c.heads = 2; c.seq_len = 37; c.expert_dim = 40;
  c.layers = 3; c.experts = 6; c.topk = 2; c.n_dense = 1; c.dense_dim = 48; c.shared_expert = 1;
  const std::vector<ParamSpec> specs = param_specs(c);
  for (int rank = 0; rank < 2; rank++) {
    const ParamLayout layout = param_layout(specs, 2, RegionGroup{2, rank}, RegionGroup{1, 0});
    size_t S = 0;
    std::vector<ShardSegment> segments = shard_segments(specs, layout, &S);
    Rng rng;
    const Problem p = make_problem(rng, segments, S, layout.num_params);
    const OptimizerRun want = run(p, device_adamw());
    expect_reference_steps(p, want, rank ? "adamw W2 rank1" : "adamw W2 rank0");
    expect_bit_identical(run(p, offload_adamw(1000, 2)), want, "offload_adamw W=2 rank " + std::to_string(rank));
    expect_bit_identical(run(p, cpu_adamw(2, 1000)), want, "cpu_adamw W=2 rank " + std::to_string(rank));
  }
}

// The state one optimizer saves after its first step, loaded into another, continues as the first would.
TEST(OffloadAdamWGpu, ResumesAcrossOptimizers) {
  REQUIRE_GPU();
  Rng rng;
  const Problem p = odd_problem(rng);
  const std::vector<std::pair<std::string, MakeOptimizer>> optimizers = {
      {"adamw", device_adamw()}, {"offload_adamw", offload_adamw(64, 2)}, {"cpu_adamw", cpu_adamw(2, 64)}};
  for (const auto& [first_name, first] : optimizers) {
    const OptimizerRun straight = run(p, first);
    for (const auto& [then_name, then] : optimizers) {
      const OptimizerRun resumed = run(p, then, straight.steps[0].state, 1);
      OptimizerRun want;
      want.steps.assign(straight.steps.begin() + 1, straight.steps.end());
      expect_bit_identical(resumed, want, first_name + " then " + then_name);
    }
  }
}
