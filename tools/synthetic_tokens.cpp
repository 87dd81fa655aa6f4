// tools/synthetic_tokens.cpp — a token shard of uniform random tokens, for benchmarks that need a
// corpus longer than any probe (tools/bench_train.sh). No Python needed.
//   synthetic_tokens OUT_FILE TOKENS VOCAB [SEED]
// Writes OUT_FILE (llm.c format, data/shards.hpp) with TOKENS tokens drawn uniformly from [0, VOCAB).
#include <cstdio>
#include <cstdlib>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>
#include "data/shards.hpp"

int main(int argc, char** argv) {
  if (argc < 4 || argc > 5) {
    fprintf(stderr, "usage: synthetic_tokens OUT_FILE TOKENS VOCAB [SEED]\n");
    return 1;
  }
  char* end = nullptr;
  const long long tokens = strtoll(argv[2], &end, 10);
  const bool tokens_ok = *end == '\0' && tokens > 0;
  const long long vocab = strtoll(argv[3], &end, 10);
  const bool vocab_ok = *end == '\0' && vocab > 0 && vocab <= (1LL << 31) - 1;
  const unsigned long long seed = argc == 5 ? strtoull(argv[4], &end, 10) : 0;
  if (!tokens_ok || !vocab_ok || (argc == 5 && *end != '\0')) {
    fprintf(stderr, "synthetic_tokens: TOKENS and VOCAB must be positive integers, SEED a non-negative one\n");
    return 1;
  }
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> draw(0, (int)vocab - 1);
  std::vector<int> ids((size_t)tokens);
  for (int& id : ids) id = draw(rng);
  try {
    data::write_shard(argv[1], ids, (int)vocab);
  } catch (const std::exception& e) {
    fprintf(stderr, "synthetic_tokens: %s\n", e.what());
    return 1;
  }
  return 0;
}
