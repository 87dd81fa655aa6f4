// tests/gpu_device_memory.cu — the device ledger (runtime/pool.cuh): the whole device, not just the
// pool. After the runtime's start the ledger names the CUDA context and the cuBLAS handle; memory taken
// from CUDA outside the pool shows as "other", memory the pool takes shows as its reserved bytes, and
// the report's terms add up to the device's used bytes.
#include <string>
#include <vector>
#include "gpu_util.cuh"

TEST(DeviceLedger, ItemisesTheDeviceAndNamesWhatLiesOutsideThePool) {
  REQUIRE_GPU();
  runtime_prepare();
  bool context = false, cublas = false;
  for (const DeviceMemoryItem& item : device_memory().items) {
    context |= item.what == "CUDA context" && item.bytes > 0;
    cublas |= item.what == "cuBLAS handle";
  }
  EXPECT_TRUE(context) << device_memory_report();
  EXPECT_TRUE(cublas) << device_memory_report();
  const size_t bytes = 256u << 20;
  const DeviceMemoryNow before = device_memory_now();
  void* outside = nullptr;
  cudaCheck(cudaMalloc(&outside, bytes), "test", "cudaMalloc outside the pool");
  const DeviceMemoryNow with_outside = device_memory_now();
  void* inside = pool().alloc(bytes, Mem::Workspace, "test.ledger");
  const DeviceMemoryNow with_inside = device_memory_now();
  printf("[mem] %s\n", device_memory_report().c_str());
  // CUDA rounds allocations up to its own granularity (2 MiB): allow that much beside the bytes
  const long long slack = 4 << 20;
  EXPECT_GE(with_outside.other() - before.other(), (long long)bytes);
  EXPECT_LE(with_outside.other() - before.other(), (long long)bytes + slack);
  EXPECT_EQ(with_outside.reserved, before.reserved);
  EXPECT_GE(with_inside.reserved - with_outside.reserved, (long long)bytes);
  EXPECT_LE(std::llabs(with_inside.other() - with_outside.other()), slack) << "a pool block is not 'other'";
  EXPECT_EQ(with_inside.used, with_inside.reserved + with_inside.itemised + with_inside.other());
  pool().free(inside);
  cudaCheck(cudaFree(outside), "test", "cudaFree");
}

// The pool's cache serves only its own sizes. When the device is full, a request of another size makes
// the pool give its cached blocks back to CUDA and ask again: the cached bytes never cause an
// out-of-memory that the live bytes alone would not.
TEST(DeviceLedger, AFullDeviceTakesTheCachedBlocksBack) {
  REQUIRE_GPU();
  runtime_prepare();
  size_t free_b = 0, total_b = 0;
  cudaCheck(cudaMemGetInfo(&free_b, &total_b), "test", "meminfo");
  // three blocks of a quarter of what is free, cached once freed; then a block of half of it, which
  // fits only if the cache goes back to CUDA (a quarter is left)
  const size_t quarter = (free_b / 4) & ~((size_t(1) << 21) - 1), half = 2 * quarter - (size_t(1) << 21);
  std::vector<void*> blocks;
  for (int i = 0; i < 3; i++) blocks.push_back(pool().alloc(quarter, Mem::Workspace, "test.quarter"));
  for (void* p : blocks) pool().free(p);
  const size_t releases = pool().cache_releases(), reserved = pool().reserved();
  EXPECT_GE(reserved, 3 * quarter) << "the freed blocks stay cached";
  void* big = pool().alloc(half, Mem::Workspace, "test.half");
  printf("[mem] free %.1f GiB; cached 3 x %.1f GiB; then %.1f GiB: reserved %.1f -> %.1f GiB, cache releases %zu -> %zu\n",
         free_b / 1073741824.0, quarter / 1073741824.0, half / 1073741824.0, reserved / 1073741824.0,
         pool().reserved() / 1073741824.0, releases, pool().cache_releases());
  EXPECT_EQ(pool().cache_releases(), releases + 1) << "the request needed the cached bytes";
  EXPECT_LT(pool().reserved(), reserved) << "the cached quarters went back to CUDA";
  pool().free(big);
  pool().release_cached();
}

// What the device holds for the pool's live blocks: each request rounded up to its size class
// (tests/cpu_pool.cu), at most 2 MiB more from 32 MiB up; `peak_held()` follows the blocks as held, and
// the pool's reserved bytes grow by exactly them when no cached block serves the requests. A cached block
// less than 1/16 of a request's power of two above its class serves it when its own class has none.
TEST(DeviceLedger, LargeBlocksAreHeldWithinTwoMiBOfTheirRequests) {
  REQUIRE_GPU();
  runtime_prepare();
  pool().release_cached();
  const size_t requests[] = {size_t(360) << 20, (size_t(100) << 20) + 1, (size_t(33) << 20) + 4096};
  const size_t reserved_before = pool().reserved();
  pool().reset_peak();
  const size_t live_before = pool().peak(), held_before = pool().peak_held();
  std::vector<void*> blocks;
  size_t asked = 0, held = 0;
  for (size_t bytes : requests) {
    blocks.push_back(pool().alloc(bytes, Mem::Workspace, "test.held"));
    asked += bytes;
    held += Pool::round_size(bytes);
  }
  printf("[mem] asked %.3f MiB, held %.3f MiB (%zu blocks), reserved +%.3f MiB\n", asked / 1048576.0,
         (pool().peak_held() - held_before) / 1048576.0, blocks.size(), (pool().reserved() - reserved_before) / 1048576.0);
  EXPECT_EQ(pool().peak() - live_before, asked);
  EXPECT_EQ(pool().peak_held() - held_before, held);
  EXPECT_EQ(pool().reserved() - reserved_before, held);
  EXPECT_LE(held - asked, blocks.size() * (size_t(2) << 20));
  // a request a little smaller than a cached block, whose own class has none free, takes that block
  const size_t reserved_all = pool().reserved();
  pool().free(blocks[1]);
  void* smaller = pool().alloc(size_t(99) << 20, Mem::Workspace, "test.held");
  EXPECT_EQ(smaller, blocks[1]) << "the cached 102 MiB block serves a 99 MiB request";
  EXPECT_EQ(pool().reserved(), reserved_all);
  blocks[1] = smaller;
  for (void* p : blocks) pool().free(p);
  pool().release_cached();
}
