// GPU tests of the chunked head (ops/cross_entropy.cuh FullHead over blocks of rows, --head chunked; the
// same through RingDTPHead over a group of one) against the full logits and cross-entropy in double
// (ref/cross_entropy.hpp): the loss sum, dx (=) and dW (+=) per tensor, with row blocks that divide N, that
// do not, one row each, and one block of every row; the pool peak of the call within the closed form
// (full_head_live_bytes), far below the N×V logits; bit-identical replay.
#include <cstring>
#include "ring_dtp_check.cuh"

using namespace testutil;

namespace {

void check_chunked(int N, int V, int H, int block_cols) {
  REQUIRE_GPU();
  const std::string name = "ChunkedHead.N" + std::to_string(N) + "V" + std::to_string(V) + "H" + std::to_string(H) +
                           "block" + std::to_string(block_cols) + "rows" + std::to_string(head_block_rows(N, V, 1, block_cols));
  const HeadCase c = make_head_case(1, N, V, H);
  FullHead head(block_cols);
  expect_head_matches(name, c, 0, run_head(head, c, 0), "auto", block_cols);
  RingDTPHead ring_of_one(Comm(), "auto", block_cols);
  expect_head_matches(name + ".ring_of_one", c, 0, run_head(ring_of_one, c, 0), "auto", block_cols);
}

}  // namespace

TEST(ChunkedHeadGpu, MatchesTheFullHeadRowBlocksDividingN) { check_chunked(40, 1000, 64, 250); }        // 4 blocks of 10
TEST(ChunkedHeadGpu, MatchesTheFullHeadRowBlocksNotDividingN) { check_chunked(300, 5003, 96, 1024); }   // 61 × 4 + 56
TEST(ChunkedHeadGpu, MatchesTheFullHeadOneRowBlocks) { check_chunked(9, 40, 64, 1); }
TEST(ChunkedHeadGpu, MatchesTheFullHeadOneBlockOfEveryRow) { check_chunked(64, 777, 128, 4096); }

TEST(ChunkedHeadGpu, PeakIsFarBelowTheFullLogits) {
  REQUIRE_GPU();
  const int N = 2048, V = 32768, H = 64, block = 2048;
  const HeadCase c = make_head_case(1, N, V, H);
  FullHead head(block);
  const HeadRun run = run_head(head, c, 0);
  expect_head_matches("ChunkedHead.N2048V32768", c, 0, run, "auto", block);
  EXPECT_LE(run.peak * 8, (size_t)N * V * sizeof(floatX)) << "the chunked head holds 128 of 2048 rows (2048 × 2048 logits)";
}

TEST(ChunkedHeadGpu, IsBitwiseReproducible) {
  REQUIRE_GPU();
  const HeadCase c = make_head_case(1, 211, 3001, 64);
  FullHead head(512);
  const HeadRun a = run_head(head, c, 0), b = run_head(head, c, 0);
  EXPECT_EQ(0, memcmp(&a.loss_sum, &b.loss_sum, sizeof(float))) << "loss sum differs";
  EXPECT_EQ(0, memcmp(a.dx.data(), b.dx.data(), a.dx.size() * sizeof(floatX))) << "dx differs";
  EXPECT_EQ(0, memcmp(a.dW.data(), b.dW.data(), a.dW.size() * sizeof(floatX))) << "dW differs";
}
