// CPU tests of ops/cpu_adamw.cpp (--optimizer cpu_adamw's arithmetic) against ref/adamw.hpp: several
// steps from a random mid-training state over segments of odd sizes (1, 37, 1001, 5) with shard padding
// between them and weight decay on some, clipping scales that change per step. Per segment: θ, m and
// v element by element within fp32 rounding of the reference (normwise errors of the update
// θ_new − θ_old, m and v reported); the weights are the master rounded (fp32: equal;
// bf16: round to nearest even); the padding is untouched. Any thread count and the scalar baseline loop
// give bit-identical results (memcmp), and so does a step cut into chunks for the copies' pipeline.
#include <atomic>
#include <cmath>
#include <cstring>
#include <mutex>
#include "adamw_check.hpp"
#include "test_util.hpp"
#include "../ops/cpu_adamw.hpp"

using namespace testutil;

namespace {

const AdamWSettings kSettings{0.9f, 0.95f, 1e-8f, 0.1f};
const float kLr = 1e-2f;
const float kPadding = -7.f;  // what the elements between segments hold; no step may change it

// {param_offset, state_offset, count, decay}: segments in state order with padding between them
const std::vector<ShardSegment> kSegments = {{0, 0, 1, false}, {5, 3, 37, true}, {50, 41, 1001, true}, {1100, 1045, 5, false}};
const size_t kState = 1053;

struct HostState {
  std::vector<float> master, m, v, grad;
  std::vector<float> param_fp32;
  std::vector<uint16_t> param_bf16;
};

// Random mid-training state (non-zero moments); padding everywhere outside the segments.
HostState random_state(Rng& rng) {
  HostState h;
  for (auto* x : {&h.master, &h.m, &h.v, &h.grad, &h.param_fp32}) x->assign(kState, kPadding);
  h.param_bf16.assign(kState, 0xdead);
  for (const ShardSegment& g : kSegments)
    for (size_t i = g.state_offset; i < g.state_offset + g.count; i++) {
      h.master[i] = (float)rng.normal();
      h.m[i] = (float)rng.normal(0.1);
      h.v[i] = (float)std::pow(rng.normal(0.1), 2);
    }
  return h;
}

void new_gradients(Rng& rng, HostState& h) {
  for (const ShardSegment& g : kSegments)
    for (size_t i = g.state_offset; i < g.state_offset + g.count; i++) h.grad[i] = (float)rng.normal(0.3);
}

ref::Vec<double> segment_of(const std::vector<float>& x, const ShardSegment& g) {
  ref::Vec<double> out(g.count);
  for (size_t i = 0; i < g.count; i++) out(i) = x[g.state_offset + i];
  return out;
}

bool padding_untouched(const std::vector<float>& x) {
  size_t next = 0;
  for (const ShardSegment& g : kSegments) {
    for (size_t i = next; i < g.state_offset; i++)
      if (x[i] != kPadding) return false;
    next = g.state_offset + g.count;
  }
  for (size_t i = next; i < kState; i++)
    if (x[i] != kPadding) return false;
  return true;
}

}  // namespace

// Each step from the same fp32 state on both sides (the reference restarts from the CPU's state, so that
// one step's arithmetic is measured, not five steps' compounding): every element of m, v and θ within
// fp32 rounding of the reference (adamw_check.hpp); the normwise errors per segment are reported.
TEST(CpuAdamW, MatchesReferenceOverStepsPerSegment) {
  Rng rng;
  HostState h = random_state(rng);
  const int first_step = 7, steps = 5;
  for (int t = first_step; t < first_step + steps; t++) {
    new_gradients(rng, h);
    const float grad_scale = (t % 2 == 0) ? 0.37f : 1.f;  // clipped on even steps
    const HostState before = h;
    cpu_adamw_step(h.master.data(), h.m.data(), h.v.data(), h.grad.data(), h.param_fp32.data(), kSegments, kLr,
                   kSettings, t, grad_scale, 3);
    for (const ShardSegment& g : kSegments) {
      const size_t o = g.state_offset;
      const AdamWStepCheck c = check_adamw_step(
          &before.master[o], &before.m[o], &before.v[o], &h.grad[o], &h.master[o], &h.m[o], &h.v[o], g.count, kLr,
          kSettings.beta1, kSettings.beta2, kSettings.eps, g.decay ? kSettings.weight_decay : 0.0, t, grad_scale);
      EXPECT_EQ(c.outside, 0) << "elements beyond fp32 rounding, t=" << t << " n=" << g.count;
      const std::string seg = " t" + std::to_string(t) + " n" + std::to_string(g.count);
      const ref::Vec<double> update = segment_of(h.master, g) - segment_of(before.master, g);
      const ref::Vec<double> update_ref = c.master_ref - segment_of(before.master, g);
      report_normwise("CpuAdamW", ("update" + seg).c_str(), rel_err(update, update_ref));
      report_normwise("CpuAdamW", ("m" + seg).c_str(), rel_err(segment_of(h.m, g), c.m_ref));
      report_normwise("CpuAdamW", ("v" + seg).c_str(), rel_err(segment_of(h.v, g), c.v_ref));
    }
  }
  for (const ShardSegment& g : kSegments)
    EXPECT_EQ(0, memcmp(h.param_fp32.data() + g.state_offset, h.master.data() + g.state_offset, g.count * sizeof(float)))
        << "fp32 weights must equal the master weights, n=" << g.count;
  for (auto* x : {&h.master, &h.m, &h.v, &h.param_fp32}) EXPECT_TRUE(padding_untouched(*x));
}

TEST(CpuAdamW, AnyThreadCountAndTheScalarLoopAreBitIdentical) {
  Rng rng;
  const HostState start = random_state(rng);
  HostState scalar = start;
  new_gradients(rng, scalar);
  const std::vector<float> grad = scalar.grad;
  for (int t = 3; t < 6; t++)
    cpu_adamw_step_scalar(scalar.master.data(), scalar.m.data(), scalar.v.data(), grad.data(),
                          scalar.param_bf16.data(), kSegments, kLr, kSettings, t, 0.5f);
  for (int threads : {1, 2, 3, 7, 64}) {
    HostState h = start;
    for (int t = 3; t < 6; t++)
      cpu_adamw_step(h.master.data(), h.m.data(), h.v.data(), grad.data(), h.param_bf16.data(), kSegments, kLr,
                     kSettings, t, 0.5f, threads);
    EXPECT_EQ(0, memcmp(h.master.data(), scalar.master.data(), kState * sizeof(float))) << threads << " threads";
    EXPECT_EQ(0, memcmp(h.m.data(), scalar.m.data(), kState * sizeof(float))) << threads << " threads";
    EXPECT_EQ(0, memcmp(h.v.data(), scalar.v.data(), kState * sizeof(float))) << threads << " threads";
    EXPECT_EQ(h.param_bf16, scalar.param_bf16) << threads << " threads";
  }
  std::vector<uint16_t> from_master(kState, 0xdead);
  cpu_params_from_master(scalar.master.data(), from_master.data(), kSegments);
  EXPECT_EQ(from_master, scalar.param_bf16) << "weights from loaded master weights = the step's weights";
  int rounded_wrong = 0;
  for (const ShardSegment& g : kSegments)
    for (size_t i = g.state_offset; i < g.state_offset + g.count; i++)
      rounded_wrong += scalar.param_bf16[i] != bf16_bits_rn(scalar.master[i]);
  EXPECT_EQ(rounded_wrong, 0);
}

// The pipeline's chunks (cpu_adamw.hpp): the gradients of a chunk exist only once arrived(c) returns
// (NaN before: a slice read early would poison the result), and updated(c) copies the chunk's weights
// out (a weight read before its slice is written would be stale). For chunk sizes from 1 element to
// more than the state, and thread counts up to more than a chunk's lines: every chunk updated exactly
// once, the state and the weights copied out bit-identical to the one-chunk step.
TEST(CpuAdamW, ChunkedStepsAreBitIdenticalAndEachChunkIsSentOnce) {
  Rng rng;
  const HostState start = random_state(rng);
  HostState one_chunk = start;
  new_gradients(rng, one_chunk);
  const std::vector<float> grad = one_chunk.grad;
  cpu_adamw_step(one_chunk.master.data(), one_chunk.m.data(), one_chunk.v.data(), grad.data(),
                 one_chunk.param_bf16.data(), kSegments, kLr, kSettings, 4, 0.7f, 2);
  const size_t total = segments_elements(kSegments);
  for (size_t chunk : {(size_t)1, (size_t)7, (size_t)16, (size_t)100, total, (size_t)1 << 40})
    for (int threads : {1, 3, 7}) {
      const std::string what = "chunk=" + std::to_string(chunk) + " threads=" + std::to_string(threads);
      HostState h = start;
      std::vector<float> host_grad(kState, std::nanf(""));  // filled chunk by chunk, as the copies arrive
      std::vector<uint16_t> sent(kState, 0xdead);             // the weights as updated(c) sends them
      const size_t num_chunks = (total + std::min(chunk, total) - 1) / std::min(chunk, total);
      std::vector<std::once_flag> arrivals(num_chunks);
      std::vector<std::atomic<int>> sends(num_chunks);
      for (std::atomic<int>& n : sends) n.store(0);
      CpuAdamWChunks chunks;
      chunks.chunk = chunk;
      auto chunk_range = [&](size_t c, auto copy) {
        const size_t c_chunk = std::min(chunk, total);
        for_segments_slice(kSegments, c * c_chunk, std::min(total, (c + 1) * c_chunk),
                           [&](const ShardSegment&, size_t a, size_t e) { copy(a, e); });
      };
      chunks.arrived = [&](size_t c) {
        std::call_once(arrivals[c], [&] {
          chunk_range(c, [&](size_t a, size_t e) { std::copy(grad.begin() + a, grad.begin() + e, host_grad.begin() + a); });
        });
      };
      chunks.updated = [&](size_t c) {
        sends[c]++;
        chunk_range(c, [&](size_t a, size_t e) { std::copy(h.param_bf16.begin() + a, h.param_bf16.begin() + e, sent.begin() + a); });
      };
      cpu_adamw_step(h.master.data(), h.m.data(), h.v.data(), host_grad.data(), h.param_bf16.data(), kSegments, kLr,
                     kSettings, 4, 0.7f, threads, chunks);
      for (size_t c = 0; c < num_chunks; c++) EXPECT_EQ(sends[c].load(), 1) << what << ": chunk " << c << " sent";
      EXPECT_EQ(0, memcmp(h.master.data(), one_chunk.master.data(), kState * sizeof(float))) << what;
      EXPECT_EQ(0, memcmp(h.m.data(), one_chunk.m.data(), kState * sizeof(float))) << what;
      EXPECT_EQ(0, memcmp(h.v.data(), one_chunk.v.data(), kState * sizeof(float))) << what;
      for (const ShardSegment& g : kSegments)
        EXPECT_EQ(0, memcmp(sent.data() + g.state_offset, one_chunk.param_bf16.data() + g.state_offset, g.count * 2))
            << what << ": the weights sent, segment of " << g.count;
    }
}

// The pipeline's order: a thread sends chunk i's weights before it waits for chunk i+1's gradients, so
// that the upload of one chunk runs beside the update of the next. With one thread the order is fixed:
// arrived(0), updated(0), arrived(1), updated(1), ...
TEST(CpuAdamW, OneThreadSendsEachChunkBeforeWaitingForTheNext) {
  Rng rng;
  HostState h = random_state(rng);
  new_gradients(rng, h);
  const size_t total = segments_elements(kSegments), chunk = 100, num_chunks = (total + chunk - 1) / chunk;
  std::vector<std::pair<char, size_t>> calls;  // ('a', i): arrived(i); ('u', i): updated(i)
  CpuAdamWChunks chunks;
  chunks.chunk = chunk;
  chunks.arrived = [&](size_t c) { calls.emplace_back('a', c); };
  chunks.updated = [&](size_t c) { calls.emplace_back('u', c); };
  cpu_adamw_step(h.master.data(), h.m.data(), h.v.data(), h.grad.data(), h.param_bf16.data(), kSegments, kLr,
                 kSettings, 2, 1.f, 1, chunks);
  std::vector<std::pair<char, size_t>> want;
  for (size_t c = 0; c < num_chunks; c++) {
    want.emplace_back('a', c);
    want.emplace_back('u', c);
  }
  EXPECT_EQ(calls, want) << num_chunks << " chunks of " << chunk;
}

TEST(CpuAdamW, Bf16RoundsToNearestEven) {
  auto bits = [](uint32_t b) {
    float x;
    memcpy(&x, &b, sizeof x);
    return bf16_bits_rn(x);
  };
  EXPECT_EQ(bits(0x3f800000u), 0x3f80);  // 1
  EXPECT_EQ(bits(0x3f807fffu), 0x3f80);  // below half: down
  EXPECT_EQ(bits(0x3f808000u), 0x3f80);  // tie, even below: down
  EXPECT_EQ(bits(0x3f818000u), 0x3f82);  // tie, odd below: up
  EXPECT_EQ(bits(0x3f808001u), 0x3f81);  // above half: up
  EXPECT_EQ(bits(0xbf808001u), 0xbf81);  // sign kept
  EXPECT_EQ(bits(0x7f7fffffu), 0x7f80);  // largest float rounds to infinity
  EXPECT_EQ(bits(0x7f800000u), 0x7f80);  // infinity
  EXPECT_EQ(bits(0x7fc00001u), 0x7fff);  // NaN
  EXPECT_EQ(bits(0x00000001u), 0x0000);  // smallest denormal
}
