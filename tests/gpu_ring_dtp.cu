// GPU tests of the chunked head (ops/ring_dtp.cuh RingDTPHead over a group of one, --head chunked)
// against the full logits and cross-entropy in double (ref/cross_entropy.hpp): the loss sum, dx (=)
// and dW (+=) per tensor, with vocabulary blocks that divide V, that do not, one column wide, and wider
// than V; the pool peak of the call within the closed form (ring_dtp_live_bytes), far below the N×V
// logits; bit-identical replay.
#include <cstring>
#include "ring_dtp_check.cuh"

using namespace testutil;

namespace {

void check_chunked(int N, int V, int H, int block_cols) {
  REQUIRE_GPU();
  const std::string name = "ChunkedHead.N" + std::to_string(N) + "V" + std::to_string(V) + "H" + std::to_string(H) +
                           "block" + std::to_string(block_cols);
  const HeadCase c = make_head_case(1, N, V, H);
  RingDTPHead head(Comm(), "auto", block_cols);
  expect_head_matches(name, c, 0, run_head(head, c, 0), "auto", block_cols);
}

}  // namespace

TEST(ChunkedHeadGpu, MatchesTheFullHeadBlocksDividingV) { check_chunked(37, 1000, 64, 250); }
TEST(ChunkedHeadGpu, MatchesTheFullHeadBlocksNotDividingV) { check_chunked(300, 5003, 96, 1024); }
TEST(ChunkedHeadGpu, MatchesTheFullHeadOneColumnBlocks) { check_chunked(9, 40, 64, 1); }
TEST(ChunkedHeadGpu, MatchesTheFullHeadOneBlockWiderThanV) { check_chunked(64, 777, 128, 4096); }

TEST(ChunkedHeadGpu, PeakIsFarBelowTheFullLogits) {
  REQUIRE_GPU();
  const int N = 2048, V = 32768, H = 64, block = 2048;
  const HeadCase c = make_head_case(1, N, V, H);
  RingDTPHead head(Comm(), "auto", block);
  const HeadRun run = run_head(head, c, 0);
  expect_head_matches("ChunkedHead.N2048V32768", c, 0, run, "auto", block);
  EXPECT_LE(run.peak * 8, (size_t)N * V * sizeof(floatX)) << "the chunked head holds a block of 2048 of 32768 columns";
}

TEST(ChunkedHeadGpu, IsBitwiseReproducible) {
  REQUIRE_GPU();
  const HeadCase c = make_head_case(1, 211, 3001, 64);
  RingDTPHead head(Comm(), "auto", 512);
  const HeadRun a = run_head(head, c, 0), b = run_head(head, c, 0);
  EXPECT_EQ(0, memcmp(&a.loss_sum, &b.loss_sum, sizeof(float))) << "loss sum differs";
  EXPECT_EQ(0, memcmp(a.dx.data(), b.dx.data(), a.dx.size() * sizeof(floatX))) << "dx differs";
  EXPECT_EQ(0, memcmp(a.dW.data(), b.dW.data(), a.dW.size() * sizeof(floatX))) << "dW differs";
}
