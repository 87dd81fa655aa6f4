// The sequence split of Ulysses sequence parallelism (config.hpp: sequence_split, notes/design.md §5):
// for every W up to 64 and every D that divides it, the sequence groups are contiguous blocks of D
// ranks that cover the world once (the places comm_block_group gives), the groups read distinct
// sequences, a group's token slices tile [0, T) and its head slices tile [0, nh) in rank order; what D
// does not divide — W, nh, T, any of them or several — is refused naming each.
#include <gtest/gtest.h>
#include <stdexcept>
#include <string>
#include <vector>
#include "../config.hpp"

TEST(SequenceSplit, GroupsAreContiguousBlocksThatTileTokensAndHeads) {
  for (int W = 1; W <= 64; W++)
    for (int D = 1; D <= W; D++) {
      if (W % D != 0) continue;
      const int heads = 3 * D, T = 5 * D;  // neither a power of two
      std::vector<int> readers(W / D, 0);  // ranks per sequence group
      for (int r = 0; r < W; r++) {
        const std::string what = "W=" + std::to_string(W) + " D=" + std::to_string(D) + " rank " + std::to_string(r);
        const SequenceSplit s = sequence_split(r, W, heads, T, D);
        EXPECT_EQ(s.size, D) << what;
        EXPECT_EQ(s.groups, W / D) << what;
        EXPECT_EQ(s.group, r / D) << what << ": contiguous blocks, as comm_block_group makes them";
        EXPECT_EQ(s.rank, r % D) << what;
        EXPECT_EQ(s.first_world_rank() + s.rank, r) << what;
        ASSERT_GE(s.group, 0) << what;
        ASSERT_LT(s.group, W / D) << what;
        readers[s.group]++;
        EXPECT_EQ(s.end_token - s.first_token, T / D) << what;
        EXPECT_EQ(s.end_head - s.first_head, heads / D) << what;
        // the slices follow each other in rank order: rank 0 starts at 0, rank D−1 ends at T (nh)
        if (s.rank == 0) {
          EXPECT_EQ(s.first_token, 0) << what;
          EXPECT_EQ(s.first_head, 0) << what;
        }
        if (s.rank == D - 1) {
          EXPECT_EQ(s.end_token, T) << what;
          EXPECT_EQ(s.end_head, heads) << what;
        }
        if (s.rank > 0) {
          const SequenceSplit before = sequence_split(r - 1, W, heads, T, D);
          EXPECT_EQ(before.group, s.group) << what;
          EXPECT_EQ(before.end_token, s.first_token) << what;
          EXPECT_EQ(before.end_head, s.first_head) << what;
        }
      }
      for (int g = 0; g < W / D; g++) EXPECT_EQ(readers[g], D) << "W=" << W << " D=" << D << " group " << g;
    }
}

// D = 1: whole sequences, every head, one group per rank (each reads its own sequences).
TEST(SequenceSplit, OneRankPerGroupHoldsEverything) {
  for (int r = 0; r < 6; r++) {
    const SequenceSplit s = sequence_split(r, 6, 7, 37, 1);
    EXPECT_EQ(s.group, r);
    EXPECT_EQ(s.groups, 6);
    EXPECT_EQ(s.rank, 0);
    EXPECT_EQ(s.first_token, 0);
    EXPECT_EQ(s.end_token, 37);
    EXPECT_EQ(s.first_head, 0);
    EXPECT_EQ(s.end_head, 7);
  }
}

// Rank 5 of 8 at D = 4, nh = 12, T = 20: group 1 (ranks 4..7), place 1, tokens [5, 10), heads [3, 6).
TEST(SequenceSplit, HandCheckedPlace) {
  const SequenceSplit s = sequence_split(5, 8, 12, 20, 4);
  EXPECT_EQ(s.group, 1);
  EXPECT_EQ(s.rank, 1);
  EXPECT_EQ(s.first_world_rank(), 4);
  EXPECT_EQ(s.first_token, 5);
  EXPECT_EQ(s.end_token, 10);
  EXPECT_EQ(s.first_head, 3);
  EXPECT_EQ(s.end_head, 6);
}

TEST(SequenceSplit, RefusesNamingWhatDDoesNotDivide) {
  EXPECT_EQ(sequence_split_refusal(8, 12, 20, 4), "");
  EXPECT_EQ(sequence_split_refusal(6, 6, 24, 4),
            "the sequence-parallel group size D = 4 does not divide the ranks W = 6, the heads nh = 6");
  EXPECT_EQ(sequence_split_refusal(4, 6, 24, 4), "the sequence-parallel group size D = 4 does not divide the heads nh = 6");
  EXPECT_EQ(sequence_split_refusal(4, 8, 10, 4),
            "the sequence-parallel group size D = 4 does not divide the sequence length T = 10");
  EXPECT_EQ(sequence_split_refusal(6, 6, 12, 3), "");
  EXPECT_EQ(sequence_split_refusal(4, 4, 4, 8),
            "the sequence-parallel group size D = 8 does not divide the ranks W = 4, the heads nh = 4, the sequence "
            "length T = 4");
  EXPECT_EQ(sequence_split_refusal(4, 4, 4, 0), "the sequence-parallel group size D must be >= 1, got 0");
  EXPECT_EQ(sequence_split_refusal(0, 4, 4, 1), "the sequence split needs W, nh and T >= 1, got W = 0, nh = 4, T = 4");
  try {
    sequence_split(0, 4, 6, 24, 4);
    ADD_FAILURE() << "D = 4 with nh = 6 was not refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_EQ(std::string(e.what()), "the sequence-parallel group size D = 4 does not divide the heads nh = 6");
  }
  EXPECT_THROW(sequence_split(4, 4, 4, 8, 2), std::invalid_argument) << "rank outside the world";
  EXPECT_THROW(sequence_split(-1, 4, 4, 8, 2), std::invalid_argument) << "rank outside the world";
}
