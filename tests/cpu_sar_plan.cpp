// Selective attention recomputation's plan (ops/sar_plan.hpp): the two options per layer, their bytes
// and FLOPs from the shapes, ranked by FLOPs saved per byte (ties in layer order) and taken greedily
// while they fit in the budget.
#include <gtest/gtest.h>
#include <random>
#include "../ops/sar_plan.hpp"
#include "test_util.hpp"

TEST(SarPlan, OptionsCostTheirTensorsAndSaveTheirFlops) {
  const long long N = 2 * 1024;  // B = 2, T = 1024
  const int T = 1024, H = 768, nh = 12;
  const size_t b = 2;
  EXPECT_EQ(sar_option_bytes(SarOption::Core, N, H, nh, b, 1), (size_t)N * H * b + 4 * (size_t)N * nh) << "att + lse";
  EXPECT_EQ(sar_option_bytes(SarOption::Projection, N, H, nh, b, 1), 4 * (size_t)N * H * b + 4 * (size_t)N)
      << "ln1 + qkv + ln1_rstd";
  EXPECT_DOUBLE_EQ(sar_option_flops(SarOption::Core, N, T, H), 2.0 * N * T * H) << "causal attention forward";
  EXPECT_DOUBLE_EQ(sar_option_flops(SarOption::Projection, N, T, H), 6.0 * N * H * H) << "the QKV GEMM";
}

// Under sequence groups of D ranks (--sp D) the rank holds N = B·T/D tokens of sequences of T; attention
// runs on whole sequences of nh/D heads, and its output lives in both shards: the core option keeps one
// N·H·b more (att_heads) for the same FLOPs; the projection option is the same count of elements.
TEST(SarPlan, CoreKeepsBothShardsOfTheOutputInSequenceGroups) {
  const int T = 4096, H = 1024, nh = 16, L = 3;
  const size_t b = 2;
  for (int D : {2, 4, 8}) {
    const long long N = 2LL * T / D;  // B = 2
    EXPECT_EQ(sar_option_bytes(SarOption::Core, N, H, nh, b, D), 2 * (size_t)N * H * b + 4 * (size_t)N * nh)
        << "att + att_heads + lse, D = " << D;
    EXPECT_EQ(sar_option_bytes(SarOption::Projection, N, H, nh, b, D), sar_option_bytes(SarOption::Projection, N, H, nh, b, 1))
        << "ln1 + qkv (head shard) + ln1_rstd, D = " << D;
    const size_t core = sar_option_bytes(SarOption::Core, N, H, nh, b, D);
    const SarPlan plan = sar_plan(L, N, T, H, nh, b, D, 2 * core);
    ASSERT_EQ(plan.taken.size(), 2u) << "D = " << D;
    EXPECT_EQ(plan.bytes, 2 * core);
    EXPECT_DOUBLE_EQ(plan.taken[0].flops, 2.0 * N * T * H) << "B sequences of T at nh/D heads";
  }
}

TEST(SarPlan, RanksByFlopsPerByteAndTakesWhatFits) {
  const int L = 4, H = 1024, nh = 16;
  const size_t b = 2;
  // long sequences (T > 0.75·H): every layer's core option before any projection option
  {
    const int T = 2048;
    const long long N = 4LL * T;
    const size_t core = sar_option_bytes(SarOption::Core, N, H, nh, b, 1);
    const size_t projection = sar_option_bytes(SarOption::Projection, N, H, nh, b, 1);
    SarPlan plan = sar_plan(L, N, T, H, nh, b, 1, 0);
    EXPECT_TRUE(plan.taken.empty());
    EXPECT_EQ(plan.tokens, N);
    plan = sar_plan(L, N, T, H, nh, b, 1, 3 * core + core / 2);
    ASSERT_EQ(plan.taken.size(), 3u);
    for (int l = 0; l < 3; l++) {
      EXPECT_EQ(plan.taken[l].layer, l) << "ties in layer order";
      EXPECT_EQ(plan.taken[l].option, SarOption::Core);
    }
    EXPECT_FALSE(plan.keep_core[3]);
    EXPECT_EQ(plan.bytes, 3 * core);
    // a budget that fits every core option and one projection option
    plan = sar_plan(L, N, T, H, nh, b, 1, L * core + projection);
    EXPECT_EQ(plan.taken.size(), (size_t)L + 1);
    EXPECT_TRUE(plan.keep_projection[0]);
    EXPECT_FALSE(plan.keep_projection[1]);
    plan = sar_plan(L, N, T, H, nh, b, 1, 1LL << 40);
    EXPECT_EQ(plan.taken.size(), 2u * L) << "a budget past every option takes them all";
    EXPECT_DOUBLE_EQ(plan.flops_saved, plan.flops_recomputed);
  }
  // short sequences (T < 0.75·H): projection options first
  {
    const int T = 256;
    const long long N = 8LL * T;
    const size_t projection = sar_option_bytes(SarOption::Projection, N, H, nh, b, 1);
    const SarPlan plan = sar_plan(L, N, T, H, nh, b, 1, 2 * projection);
    ASSERT_EQ(plan.taken.size(), 2u);
    EXPECT_EQ(plan.taken[0].option, SarOption::Projection);
    EXPECT_TRUE(plan.keep_projection[0] && plan.keep_projection[1]);
  }
}

TEST(SarPlan, NeverPassesTheBudgetAndSkipsOnlyWhatDoesNotFit) {
  std::mt19937 rng((uint32_t)testutil::fresh_seed());
  for (int trial = 0; trial < 200; trial++) {
    const int L = 1 + rng() % 12, nh = 1 << (rng() % 4), H = nh * 32 * (1 + rng() % 8), T = 16 << (rng() % 8);
    const long long N = (long long)T * (1 + rng() % 4);
    const size_t b = rng() % 2 ? 2 : 4;
    const long long budget =
        (long long)(rng() % (2 * L + 1)) * sar_option_bytes(SarOption::Core, N, H, nh, b, 1) + rng() % 1000;
    const SarPlan plan = sar_plan(L, N, T, H, nh, b, 1, budget);
    EXPECT_LE(plan.bytes, (size_t)budget);
    size_t bytes = 0;
    for (const SarChoice& x : plan.taken) bytes += x.bytes;
    EXPECT_EQ(bytes, plan.bytes);
    // every option left out is larger than what the budget had left when the greedy reached it, so in
    // particular larger than what is left at the end
    for (int l = 0; l < L; l++)
      for (SarOption o : {SarOption::Core, SarOption::Projection}) {
        const bool taken = o == SarOption::Core ? plan.keep_core[l] : plan.keep_projection[l];
        if (!taken) {
          EXPECT_GT(sar_option_bytes(o, N, H, nh, b, 1), (size_t)budget - plan.bytes) << "layer " << l;
        }
      }
    for (size_t i = 1; i < plan.taken.size(); i++)
      EXPECT_GE(plan.taken[i - 1].flops / plan.taken[i - 1].bytes, plan.taken[i].flops / plan.taken[i].bytes);
  }
}
