// tests/cpu_pool.cu — the pool's size classes (runtime/pool.cuh round_size), without a GPU: a block is
// its request rounded up to the class's step — 512 bytes below 1 MiB, 1/16 of the enclosing power of
// two above, at most 2 MiB (the device's page). So from 32 MiB up a live block holds at most 2 MiB more
// than its request, and the trainer's fit check (live bytes beside the device, rank_memory.cuh) is short
// by at most that much a large block.
#include <random>
#include "gpu_util.cuh"

namespace {
size_t pool_class_step(size_t bytes) {
  if (bytes < (size_t(1) << 20)) return 512;
  size_t p = 1;
  while (p < bytes) p <<= 1;
  return std::min(p / 16, size_t(2) << 20);
}
}  // namespace

TEST(PoolSizeClasses, ABlockIsItsRequestRoundedUpToItsStep) {
  std::mt19937_64 rng(std::random_device{}());
  std::uniform_real_distribution<double> log2_bytes(0, 36);  // 1 byte to 64 GiB
  size_t worst_large = 0;
  for (int i = 0; i < 100000; i++) {
    const size_t bytes = std::max<size_t>(1, (size_t)std::exp2(log2_bytes(rng)));
    const size_t rounded = Pool::round_size(bytes), step = pool_class_step(bytes);
    ASSERT_GE(rounded, bytes) << bytes;
    ASSERT_LT(rounded - bytes, step) << bytes;
    ASSERT_EQ(rounded % step, 0u) << bytes;
    ASSERT_EQ(Pool::round_size(rounded), rounded) << "a class's size is its own class: " << bytes;
    if (bytes >= (size_t(32) << 20)) worst_large = std::max(worst_large, rounded - bytes);
  }
  printf("[pool] largest rounding of a block of 32 MiB or more: %zu bytes (bound 2 MiB = 2097152)\n", worst_large);
  EXPECT_LT(worst_large, size_t(2) << 20);
}

// The ~1B MoE's batch of 60 × 2048 (notes/composed_stack.md): N·H·b = 122,880 · 1536 · 2 bytes = 360 MiB, and
// 3·N·H·b, the dispatch rows N·k·H·b and the expert intermediates N·k·2I·b, each a whole number of 2 MiB pages —
// held exactly as asked (with steps of 1/16 of a power of two they were held 6.7 % larger).
TEST(PoolSizeClasses, TheOneBillionMoEsBatchTensorsAreHeldAsAsked) {
  const size_t N = 60 * 2048, H = 1536, k = 4, I = 640, b = 2;
  for (size_t bytes : {N * H * b, 3 * N * H * b, N * k * H * b, N * k * 2 * I * b})
    EXPECT_EQ(Pool::round_size(bytes), bytes) << bytes / 1048576.0 << " MiB";
}

TEST(PoolSizeClasses, SmallAndImpossibleRequests) {
  EXPECT_EQ(Pool::round_size(1), 512u);
  EXPECT_EQ(Pool::round_size(512), 512u);
  EXPECT_EQ(Pool::round_size((size_t(1) << 20) - 1), size_t(1) << 20);
  EXPECT_EQ(Pool::round_size((size_t(1) << 20) + 1), (size_t(1) << 20) + (size_t(1) << 17));  // 1/16 of 2 MiB
  EXPECT_EQ(Pool::round_size((size_t(32) << 20) + 1), size_t(34) << 20);
  EXPECT_EQ(Pool::round_size(SIZE_MAX), 0u) << "past 2^63 bytes no class exists (a negative size cast)";
}
