// CPU tests of ref/embedding.hpp: the lookup picks rows, and its gradient matches finite
// differences of Σ G ⊙ forward (G a random upstream gradient) at two small shapes.
#include "test_util.hpp"
#include "../ref/embedding.hpp"

using namespace testutil;

namespace {

ref::MatI random_tokens(Rng& rng, int N, int V) {
  ref::MatI tokens(N, 1);
  for (int n = 0; n < N; n++) tokens(n, 0) = rng.integer(0, V - 1);
  return tokens;
}

void check_embedding_gradient(int N, int H, int V) {
  Rng rng;
  ref::MatI tokens = random_tokens(rng, N, V);
  ref::Mat<double> wte = rng.mat<double>(V, H);
  ref::Mat<double> G = rng.mat<double>(N, H);
  auto loss = [&] { return ref::embedding_forward(tokens, wte).cwiseProduct(G).sum(); };
  ref::Mat<double> numeric = finite_diff(wte, loss);
  ref::Mat<double> dwte = ref::embedding_backward(tokens, G, V);
  EXPECT_REL("EmbeddingRef.FiniteDiff", "dwte", rel_err(numeric, dwte), FD_TOL);
}

}  // namespace

TEST(EmbeddingRef, ForwardCopiesTheRowOfEachToken) {
  Rng rng;
  const int N = 9, H = 4, V = 5;
  ref::MatI tokens = random_tokens(rng, N, V);
  ref::Mat<double> wte = rng.mat<double>(V, H);
  ref::Mat<double> out = ref::embedding_forward(tokens, wte);
  for (int n = 0; n < N; n++) EXPECT_EQ(out.row(n), wte.row(tokens(n, 0))) << "row " << n;
}

// N > V: ids repeat; some ids are likely unused (their gradient row must be zero).
TEST(EmbeddingRef, GradientMatchesFiniteDifferencesWithRepeatedTokens) { check_embedding_gradient(11, 5, 4); }
TEST(EmbeddingRef, GradientMatchesFiniteDifferencesWithUnusedIds) { check_embedding_gradient(6, 3, 13); }
