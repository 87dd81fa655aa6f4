// tests/gpu_device_memory.cu — the device ledger (runtime/pool.cuh): the whole device, not just the
// pool. After the runtime's start the ledger names the CUDA context and the cuBLAS handle; memory taken
// from CUDA outside the pool shows as "other", memory the pool takes shows as its reserved bytes, and
// the report's terms add up to the device's used bytes.
#include <string>
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
