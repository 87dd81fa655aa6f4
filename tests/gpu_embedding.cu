// GPU tests of ops/embedding.cuh against ref/embedding.hpp: forward rows and the += gradient
// at shapes that are not multiples of the block sizes, with repeated and unused token ids; the
// host-side bucket plan; and how out-of-range ids are handled.
#include "gpu_util.cuh"
#include "../ops/embedding.cuh"
#include "../ref/embedding.hpp"

using namespace testutil;

namespace {

std::vector<int> random_token_list(Rng& rng, int N, int V) {
  std::vector<int> tokens(N);
  for (int n = 0; n < N; n++) tokens[n] = rng.integer(0, V - 1);
  return tokens;
}

void check_embedding(const char* name, int N, int H, int V) {
  REQUIRE_GPU();
  Rng rng;
  std::vector<int> tokens = random_token_list(rng, N, V);
  ref::Mat<double> wte = round_to_floatX(rng.mat<double>(V, H));
  ref::Mat<double> dout = round_to_floatX(rng.mat<double>(N, H));
  ref::Mat<double> dwte_initial = round_to_floatX(rng.mat<double>(V, H));

  DeviceBuffer<int> d_tokens = upload_vec(tokens);
  DeviceBuffer<floatX> d_wte = upload<floatX>(wte, Mem::Weights);
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.out");
  poison(d_out.ptr, d_out.count);
  embedding_forward(d_out.ptr, d_tokens.ptr, d_wte.ptr, N, H, V, 0);
  EXPECT_REL(name, "out", rel_err(download(d_out.ptr, N, H), ref::embedding_forward(as_column(tokens), wte)), OP_TOL);

  TokenBuckets buckets = build_token_buckets(tokens.data(), N, V);
  DeviceBuffer<int> d_offsets = upload_vec(buckets.offsets);
  DeviceBuffer<int> d_positions = upload_vec(buckets.positions);
  // the count, the used ids, then padding the kernel must not read as ids (a pass stages min(N, V))
  std::vector<int> used = {(int)buckets.used_ids.size()};
  used.insert(used.end(), buckets.used_ids.begin(), buckets.used_ids.end());
  used.resize(1 + std::min(N, V), V + 1000);
  DeviceBuffer<int> d_used = upload_vec(used);
  DeviceBuffer<floatX> d_dout = upload<floatX>(dout, Mem::Activations);
  DeviceBuffer<floatX> d_dwte = upload<floatX>(dwte_initial, Mem::Grads);
  embedding_backward(d_dwte.ptr, d_dout.ptr, d_offsets.ptr, d_positions.ptr, d_used.ptr, N, V, H, 0);
  ref::Mat<double> dwte = download(d_dwte.ptr, V, H);
  ref::Mat<double> dwte_expected = dwte_initial + ref::embedding_backward(as_column(tokens), dout, V);
  EXPECT_REL(name, "dwte(+=)", rel_err(dwte, dwte_expected), OP_TOL);

  int unused_rows_changed = 0;
  for (int v = 0; v < V; v++)
    if (buckets.offsets[v] == buckets.offsets[v + 1] && dwte.row(v) != dwte_initial.row(v)) unused_rows_changed++;
  EXPECT_EQ(unused_rows_changed, 0) << "rows of ids that do not occur must keep their gradient";
}

}  // namespace

TEST(EmbeddingGpu, MatchesReferenceSmallOddShape) { check_embedding("EmbeddingGpu.N37H72V50", 37, 72, 50); }
TEST(EmbeddingGpu, MatchesReferenceManyUnusedIds) { check_embedding("EmbeddingGpu.N300H200V1000", 300, 200, 1000); }
TEST(EmbeddingGpu, MatchesReferenceHeavilyRepeatedIds) { check_embedding("EmbeddingGpu.N1000H136V7", 1000, 136, 7); }
// rows of three rounds of 32 pieces (the last of one piece), ~1000 positions per id: 8 segments each
TEST(EmbeddingGpu, MatchesReferenceWideRowsFewIds) { check_embedding("EmbeddingGpu.N3000H520V3", 3000, 520, 3); }
// more used ids than the backward's blocks along them: each block sums several ids
TEST(EmbeddingGpu, MatchesReferenceMoreUsedIdsThanBlocks) {
  check_embedding("EmbeddingGpu.N9000H40V5000", 9000, 40, 5000);
}

// rows of no whole 16-byte piece: both kernels take one element per thread
TEST(EmbeddingGpu, MatchesReferenceRowsOfSingleElements) { check_embedding("EmbeddingGpu.N41H19V23", 41, 19, 23); }

// H = 33: one element per thread; H = 40: 16-byte pieces
TEST(EmbeddingGpu, OutOfRangeDeviceTokenGivesNanRowAndLeavesOthersIntact) {
  REQUIRE_GPU();
  for (const int H : {33, 40}) {
    SCOPED_TRACE("H=" + std::to_string(H));
    Rng rng;
    const int N = 5, V = 9;
    std::vector<int> tokens = random_token_list(rng, N, V);
    tokens[1] = V;
    tokens[3] = -1;
    ref::Mat<double> wte = round_to_floatX(rng.mat<double>(V, H));
    DeviceBuffer<int> d_tokens = upload_vec(tokens);
    DeviceBuffer<floatX> d_wte = upload<floatX>(wte, Mem::Weights);
    DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Activations, "test.out");
    embedding_forward(d_out.ptr, d_tokens.ptr, d_wte.ptr, N, H, V, 0);
    ref::Mat<double> out = download(d_out.ptr, N, H);
    for (int n = 0; n < N; n++) {
      bool valid = tokens[n] >= 0 && tokens[n] < V;
      for (int c = 0; c < H; c++) {
        if (valid) EXPECT_EQ(out(n, c), wte(tokens[n], c)) << "row " << n;
        else EXPECT_TRUE(std::isnan(out(n, c))) << "row " << n;
      }
    }
  }
}

// The plan alone (host only, no GPU needed).
TEST(EmbeddingBuckets, GroupPositionsByTokenInAscendingOrder) {
  Rng rng;
  const int N = 200, V = 23;
  std::vector<int> tokens = random_token_list(rng, N, V);
  TokenBuckets b = build_token_buckets(tokens.data(), N, V);
  ASSERT_EQ(b.offsets.size(), (size_t)V + 1);
  ASSERT_EQ(b.positions.size(), (size_t)N);
  EXPECT_EQ(b.offsets[0], 0);
  EXPECT_EQ(b.offsets[V], N);
  std::vector<int> used;
  for (int v = 0; v < V; v++) {
    std::vector<int> expected;
    for (int n = 0; n < N; n++)
      if (tokens[n] == v) expected.push_back(n);
    std::vector<int> got(b.positions.begin() + b.offsets[v], b.positions.begin() + b.offsets[v + 1]);
    EXPECT_EQ(got, expected) << "token " << v;
    if (!expected.empty()) used.push_back(v);
  }
  EXPECT_EQ(b.used_ids, used);
}

TEST(EmbeddingBucketsDeathTest, OutOfRangeTokenIsRefusedNamingItsPosition) {
  std::vector<int> tokens = {0, 3, 7, 2};
  EXPECT_DEATH(build_token_buckets(tokens.data(), 4, 5), "build_token_buckets.*position=2 token=7.*token id out of range");
}
