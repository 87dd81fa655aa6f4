// SCO's plan (ops/sco_plan.hpp): which layer boundaries a host budget offloads — walking input[0..L−1]
// in forward order and taking each one that still fits, never input[L] — and the closed form of the
// device bytes the boundaries then take.
#include <gtest/gtest.h>
#include <vector>
#include "../ops/sco_plan.hpp"
#include "test_util.hpp"

namespace {

std::vector<int> chosen(const ScoPlan& plan) {
  std::vector<int> set;
  for (int l = 0; l <= plan.layers(); l++)
    if (plan.offloaded[l]) set.push_back(l);
  return set;
}

}  // namespace

TEST(ScoPlan, TakesBoundariesInForwardOrderWhileTheyFit) {
  const int L = 4;
  const size_t b = 1000;  // N·H·sizeof(floatX)
  EXPECT_EQ(chosen(sco_plan(L, b, 0)), std::vector<int>{});
  EXPECT_EQ(chosen(sco_plan(L, b, 999)), std::vector<int>{}) << "one byte short of a boundary";
  EXPECT_EQ(chosen(sco_plan(L, b, 1000)), std::vector<int>{0});
  EXPECT_EQ(chosen(sco_plan(L, b, 2999)), (std::vector<int>{0, 1}));
  EXPECT_EQ(chosen(sco_plan(L, b, 3000)), (std::vector<int>{0, 1, 2}));
  EXPECT_EQ(chosen(sco_plan(L, b, 4000)), (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(chosen(sco_plan(L, b, 1000000)), (std::vector<int>{0, 1, 2, 3})) << "input[L], the final hidden state, stays";
  const ScoPlan plan = sco_plan(L, b, 2500);
  EXPECT_EQ(plan.count, 2);
  EXPECT_EQ(plan.host_bytes, 2000u);
  EXPECT_EQ(plan.boundary_bytes, b);
  EXPECT_EQ(plan.layers(), L);
  EXPECT_EQ(plan.offloaded.size(), (size_t)L + 1);
}

TEST(ScoPlan, NegativeBudgetOffloadsNothing) {
  const ScoPlan plan = sco_plan(3, 64, -5);
  EXPECT_EQ(plan.count, 0);
  EXPECT_EQ(plan.host_bytes, 0u);
}

// Budgets past 2^32 bytes, at the paper's sizes (N·H·b of a few hundred MiB per boundary).
TEST(ScoPlan, LargeBudgets) {
  const size_t b = (size_t)16384 * 7168 * 2;  // N = 16384 tokens, H = 7168, bf16: 224 MiB
  const ScoPlan plan = sco_plan(61, b, 10LL << 30);
  EXPECT_EQ(plan.count, (int)((10LL << 30) / (long long)b));
  EXPECT_EQ(plan.host_bytes, (size_t)plan.count * b);
  EXPECT_LE(plan.host_bytes, (size_t)10 << 30);
}

// For random L, boundary sizes and budgets: the set is the first ⌊budget/b⌋ boundaries (at most L), its
// host bytes fit the budget, no further boundary would fit, and the device bound falls as the budget grows.
TEST(ScoPlan, RandomBudgetsAgreeWithTheClosedForm) {
  testutil::Rng rng;
  for (int trial = 0; trial < 2000; trial++) {
    const int L = rng.integer(1, 64);
    const size_t b = (size_t)rng.integer(1, 1 << 20);
    const long long budget = (long long)rng.integer(0, 70) * (long long)b + rng.integer(0, (int)b - 1);
    const ScoPlan plan = sco_plan(L, b, budget);
    const int expected = (int)std::min<long long>(L, budget / (long long)b);
    ASSERT_EQ(plan.count, expected) << "L=" << L << " b=" << b << " budget=" << budget;
    for (int l = 0; l <= L; l++) ASSERT_EQ(plan.offloaded[l], l < expected) << "boundary " << l;
    ASSERT_LE((long long)plan.host_bytes, budget);
    ASSERT_TRUE(plan.count == L || (long long)(plan.host_bytes + b) > budget) << "a further boundary would fit";
    ASSERT_EQ(sco_device_bound(plan), ((size_t)(L + 1 - expected) + (size_t)std::min(expected, 2)) * b);
    ASSERT_LE(sco_device_peak(plan), sco_device_bound(plan));
    ASSERT_LE(sco_device_peak(plan), (size_t)(L + 1) * b);
    const ScoPlan more = sco_plan(L, b, budget + (long long)b);
    ASSERT_LE(sco_device_bound(more), sco_device_bound(plan));
  }
}

// The closed form at L = 4: all kept (5 boundaries), then L + 1 − |S| + min(|S|, 2); with every
// boundary offloaded the final hidden state, the one being recomputed and the prefetch (3). The
// schedule's peak (ops/sco.cuh's worked example): 5, 4, 3, then 2 (a layer's input and output).
TEST(ScoPlan, DeviceBoundAndPeakAtFourLayers) {
  const size_t b = 512;
  std::vector<size_t> bound, peak;
  for (int s = 0; s <= 4; s++) {
    const ScoPlan plan = sco_plan(4, b, (long long)s * b);
    bound.push_back(sco_device_bound(plan) / b);
    peak.push_back(sco_device_peak(plan) / b);
  }
  EXPECT_EQ(bound, (std::vector<size_t>{5, 5, 5, 4, 3}));
  EXPECT_EQ(peak, (std::vector<size_t>{5, 4, 3, 2, 2}));
}
