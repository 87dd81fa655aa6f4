// tests/gpu_stream.cu — runtime/stream.cuh and the pool's two frees (runtime/pool.cuh), on one GPU.
// A kernel that waits for a host flag (mapped pinned memory) keeps a side stream busy for exactly as
// long as the test wants, so that every statement about "still queued" is deterministic:
//   * free_after(p, side) while side's work still reads p: p is not live, its bytes are pending, and
//     the pool does not hand p out; once side has finished, the next alloc of that size gets p back;
//   * free(p) hands p out again at once (the single-stream case);
//   * stream_after(compute, side): work enqueued on compute afterwards waits for side's work;
//   * a StreamPoint recorded on side and waited for on compute orders them inside a captured graph
//     too (runtime/graph.cuh), where the point's record is part of the same capture;
//   * copy_to_host returns what the stream computed.
#include <atomic>
#include "../runtime/graph.cuh"
#include "gpu_util.cuh"

namespace {

using testutil::HostFlag;
using testutil::wait_for_host_kernel;

TEST(Streams, FreeAfterKeepsTheBlockUntilTheStreamHasFinished) {
  REQUIRE_GPU();
  cudaStream_t side = stream_create("test.side");
  HostFlag flag;
  // Start from an empty cache: blocks of this size left by earlier tests (in a shuffled order) would
  // be handed out before p and make "p comes back" depend on the order the tests ran in.
  pool().release_cached();
  const size_t bytes = 3 << 20;
  const size_t live_before = pool().live_total(), pending_before = pool().pending_bytes();
  int* p = (int*)pool().alloc(bytes, Mem::Dispatch, "test.block");
  wait_for_host_kernel<<<1, 1, 0, side>>>(p, flag.device, 7);
  launchCheck("test.wait_for_host", "bytes=%zu", bytes);
  pool().free_after(p, side);
  EXPECT_EQ(pool().live_total(), live_before) << "a block given back is no longer live";
  EXPECT_GE(pool().pending_bytes(), pending_before + bytes) << "but its bytes wait for the side stream";
  int* q = (int*)pool().alloc(bytes, Mem::Dispatch, "test.block");
  EXPECT_NE(q, p) << "the side stream still writes into p: the pool must not hand it out";
  pool().free(q);
  flag.set();
  stream_wait(side, "test", "side stream");
  int* r = (int*)pool().alloc(bytes, Mem::Dispatch, "test.block");
  int* s = (int*)pool().alloc(bytes, Mem::Dispatch, "test.block");
  EXPECT_TRUE(r == p || s == p) << "once the side stream has finished, p is handed out again";
  EXPECT_EQ(pool().pending_bytes(), pending_before);
  pool().free(r);
  pool().free(s);
  cudaCheck(cudaStreamDestroy(side), "test", "side stream");
}

TEST(Streams, FreeHandsTheBlockOutAgainAtOnce) {
  REQUIRE_GPU();
  const size_t bytes = 5 << 20;
  void* p = pool().alloc(bytes, Mem::Dispatch, "test.block");
  pool().free(p);
  void* q = pool().alloc(bytes, Mem::Dispatch, "test.block");
  EXPECT_EQ(q, p) << "stream order protects a block freed and reused on one stream";
  pool().free(q);
}

TEST(Streams, StreamAfterMakesLaterWorkWaitForTheProducer) {
  REQUIRE_GPU();
  cudaStream_t side = stream_create("test.side"), compute = stream_create("test.compute");
  HostFlag flag;
  DeviceBuffer<int> produced(1, Mem::Workspace, "test.produced"), consumed(1, Mem::Workspace, "test.consumed");
  cudaCheck(cudaMemsetAsync(consumed.ptr, 0, sizeof(int), compute), "test", "zero");
  stream_wait(compute, "test", "zero");
  wait_for_host_kernel<<<1, 1, 0, side>>>(produced.ptr, flag.device, 41);
  launchCheck("test.wait_for_host", "producer");
  stream_after(compute, side, "test");
  cudaCheck(cudaMemcpyAsync(consumed.ptr, produced.ptr, sizeof(int), cudaMemcpyDeviceToDevice, compute), "test", "copy");
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(cudaStreamQuery(compute), cudaErrorNotReady) << "the copy must wait for the producer's kernel";
  flag.set();
  int got = 0;
  copy_to_host(&got, consumed.ptr, sizeof(int), compute, "test.consumed");
  EXPECT_EQ(got, 41);
  for (cudaStream_t st : {side, compute}) cudaCheck(cudaStreamDestroy(st), "test", "stream");
}

// The side stream's kernel, held by the host flag, writes 41; the compute stream's copy after
// point.wait_on reads it. Captured as one graph (forked onto side and joined back, as the model's
// weight-gradient stream is), then launched: the copy must still see 41.
TEST(Streams, StreamPointRecordedInTheSameCaptureOrdersTheGraph) {
  REQUIRE_GPU();
  cudaStream_t side = stream_create("test.side"), compute = stream_create("test.compute");
  HostFlag flag;
  DeviceBuffer<int> produced(1, Mem::Workspace, "test.produced"), consumed(1, Mem::Workspace, "test.consumed");
  for (int* p : {produced.ptr, consumed.ptr}) cudaCheck(cudaMemsetAsync(p, 0, sizeof(int), compute), "test", "zero");
  StreamPoint point;
  CapturedWork work;
  const bool captured = work.run(compute, "test.graph", [&] {
    stream_after(side, compute, "test.fork");
    wait_for_host_kernel<<<1, 1, 0, side>>>(produced.ptr, flag.device, 41);
    launchCheck("test.wait_for_host", "producer");
    point.record(side, "test.point");
    point.wait_on(compute, "test.point");
    cudaCheck(cudaMemcpyAsync(consumed.ptr, produced.ptr, sizeof(int), cudaMemcpyDeviceToDevice, compute), "test", "copy");
    stream_after(compute, side, "test.join");
  });
  EXPECT_TRUE(captured);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  flag.set();
  int got = 0;
  copy_to_host(&got, consumed.ptr, sizeof(int), compute, "test.consumed");
  EXPECT_EQ(got, 41) << "the graph's copy ran before the kernel it waits for through the point";
  for (cudaStream_t st : {side, compute}) cudaCheck(cudaStreamDestroy(st), "test", "stream");
}

}  // namespace
