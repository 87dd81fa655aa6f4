// ref/ulysses.hpp, the twin of ops/ulysses.cuh, alone: a hand-checked exchange at D = 2 with 4 heads and
// T = 4, the q, k, v rows of a head shard as attention takes them, the round trips in both directions
// are the identity and every element moves exactly once (a permutation), the exchange agrees with
// cutting the global tensor, each rank's shards hold the token and head slices of config.hpp's
// sequence_split, and a D that does not divide T or nh is refused.
#include <gtest/gtest.h>
#include <algorithm>
#include <numeric>
#include <stdexcept>
#include <vector>
#include "../config.hpp"
#include "../ref/ulysses.hpp"

namespace {

// The global tensor with element i holding the value i: a shard says where each element came from.
std::vector<double> numbered(const ref::UlyssesShape& s) {
  std::vector<double> global(s.global_elems());
  std::iota(global.begin(), global.end(), 0.0);
  return global;
}

}  // namespace

// Rank 0 holds tokens 0, 1 and rank 1 tokens 2, 3, every head; after the exchange rank 0 holds heads
// 0, 1 and rank 1 heads 2, 3 of every token. Value 10·t + h marks token t, head h.
TEST(UlyssesRef, HandCheckedTwoRanksFourHeadsFourTokens) {
  const ref::UlyssesShape s{1, 4, 1, 4, 1, 2};
  std::vector<double> global;
  for (int t = 0; t < 4; t++)
    for (int h = 0; h < 4; h++) global.push_back(10 * t + h);
  const std::vector<std::vector<double>> sequence = ref::ulysses_sequence_shards(global, s);
  EXPECT_EQ(sequence[0], (std::vector<double>{0, 1, 2, 3, 10, 11, 12, 13}));
  EXPECT_EQ(sequence[1], (std::vector<double>{20, 21, 22, 23, 30, 31, 32, 33}));
  const std::vector<std::vector<double>> heads = ref::ulysses_to_heads(sequence, s);
  EXPECT_EQ(heads[0], (std::vector<double>{0, 1, 10, 11, 20, 21, 30, 31}));
  EXPECT_EQ(heads[1], (std::vector<double>{2, 3, 12, 13, 22, 23, 32, 33}));
  EXPECT_EQ(ref::ulysses_to_sequence(heads, s), sequence);
}

// G = 3 (q, k, v side by side, as the model's qkv [N, 3H]): a token's row of a head shard holds q, then
// k, then v of the rank's heads — the qkv that attention takes for nh/D heads. Value 100·g + 10·t + h.
TEST(UlyssesRef, QkvHeadShardIsAttentionsLayout) {
  const ref::UlyssesShape s{1, 2, 3, 2, 1, 2};
  std::vector<double> global;
  for (int t = 0; t < 2; t++)
    for (int g = 0; g < 3; g++)
      for (int h = 0; h < 2; h++) global.push_back(100 * g + 10 * t + h);
  const std::vector<std::vector<double>> heads = ref::ulysses_to_heads(ref::ulysses_sequence_shards(global, s), s);
  EXPECT_EQ(heads[0], (std::vector<double>{0, 100, 200, 10, 110, 210}));
  EXPECT_EQ(heads[1], (std::vector<double>{1, 101, 201, 11, 111, 211}));
}

// Shapes with B > 1, G = 1 and 3, nh and T no powers of two, D up to 6.
TEST(UlyssesRef, RoundTripsAreTheIdentityAndEveryElementMovesOnce) {
  for (const ref::UlyssesShape& s :
       {ref::UlyssesShape{2, 12, 3, 6, 5, 2}, ref::UlyssesShape{3, 12, 1, 6, 4, 3}, ref::UlyssesShape{1, 30, 3, 12, 2, 6},
        ref::UlyssesShape{2, 8, 1, 4, 3, 4}, ref::UlyssesShape{1, 5, 2, 3, 7, 1}}) {
    SCOPED_TRACE("B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " G=" + std::to_string(s.parts) +
                 " nh=" + std::to_string(s.heads) + " hd=" + std::to_string(s.head_dim) + " D=" + std::to_string(s.D));
    const std::vector<double> global = numbered(s);
    const std::vector<std::vector<double>> sequence = ref::ulysses_sequence_shards(global, s);
    const std::vector<std::vector<double>> heads = ref::ulysses_to_heads(sequence, s);
    EXPECT_EQ(heads, ref::ulysses_head_shards(global, s)) << "the exchange cuts the same global tensor";
    EXPECT_EQ(ref::ulysses_to_sequence(heads, s), sequence);
    EXPECT_EQ(ref::ulysses_to_heads(ref::ulysses_to_sequence(heads, s), s), heads);
    std::vector<double> all;
    for (const std::vector<double>& shard : heads) all.insert(all.end(), shard.begin(), shard.end());
    std::sort(all.begin(), all.end());
    EXPECT_EQ(all, global) << "every element once";
  }
}

// Element i of the numbered global tensor [B, T, G, nh, hd] is token (i / (G·nh·hd)) % T, head
// (i / hd) % nh: the shards of the rank at group place r hold exactly the tokens and heads that
// sequence_split gives it.
TEST(UlyssesRef, ShardsHoldTheSequenceSplitsSlices) {
  const ref::UlyssesShape s{2, 15, 3, 6, 2, 3};
  const std::vector<double> global = numbered(s);
  const std::vector<std::vector<double>> sequence = ref::ulysses_sequence_shards(global, s),
                                         heads = ref::ulysses_head_shards(global, s);
  for (int world_rank = 0; world_rank < 6; world_rank++) {
    const SequenceSplit split = sequence_split(world_rank, 6, s.heads, s.T, s.D);
    auto token = [&](double i) { return (long long)i / (s.parts * s.heads * s.head_dim) % s.T; };
    auto head = [&](double i) { return (long long)i / s.head_dim % s.heads; };
    for (double i : sequence[split.rank]) {
      EXPECT_GE(token(i), split.first_token) << "world rank " << world_rank;
      EXPECT_LT(token(i), split.end_token) << "world rank " << world_rank;
    }
    for (double i : heads[split.rank]) {
      EXPECT_GE(head(i), split.first_head) << "world rank " << world_rank;
      EXPECT_LT(head(i), split.end_head) << "world rank " << world_rank;
    }
  }
}

TEST(UlyssesRef, RefusesADThatDoesNotDivideTokensOrHeads) {
  const std::vector<double> global(2 * 6 * 4, 1.0);
  EXPECT_THROW(ref::ulysses_sequence_shards(global, ref::UlyssesShape{1, 6, 1, 4, 2, 4}), std::invalid_argument);
  EXPECT_THROW(ref::ulysses_head_shards(global, ref::UlyssesShape{1, 8, 1, 6, 2, 4}), std::invalid_argument);
  const ref::UlyssesShape s{1, 4, 1, 4, 1, 2};
  EXPECT_THROW(ref::ulysses_to_heads(std::vector<std::vector<double>>(3, std::vector<double>(8)), s),
               std::invalid_argument)
      << "three shards for D = 2";
  EXPECT_THROW(ref::ulysses_to_sequence(std::vector<std::vector<double>>(2, std::vector<double>(7)), s),
               std::invalid_argument)
      << "a shard of the wrong size";
}
