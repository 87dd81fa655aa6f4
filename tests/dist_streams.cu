// tests/dist_streams.cu — two communicators at once (runtime/comm.cuh, runtime/stream.cuh,
// runtime/pool.cuh's free_after): the setting of every pipelined dispatcher, in which one exchange
// runs on a communicator's stream while another moves data on a second communicator's stream and the
// compute stream makes and checks the rows.
//
// Each of many iterations, with sizes drawn from one seed (identical on every rank), zeros included
// and one iteration in eight moving nothing at all:
//   compute stream   fill the ring's and the all-to-all's send rows with a hash of (iteration, rank,
//                    destination, position)
//   communicator A   ring_send_recv   (waits on the compute stream first)
//   communicator B   all_to_all_v     (waits on the compute stream first), at the same time as A
//   compute stream   waits on A and B, then checks every received element against the hash of its
//                    sender, bit for bit, counting mismatches on the GPU
// The send buffers go back to the pool with free_after on the stream that last read them, the
// receive buffers with free on the compute stream; later iterations reuse those blocks while earlier
// ones may still run. The host never waits inside the loop; every rank issues the same calls in the
// same order, empty ones included.
#include <algorithm>
#include <chrono>
#include <vector>
#include "dist_util.cuh"

namespace {

using testutil::Rng;

__host__ __device__ inline unsigned int row_hash(unsigned int iteration, unsigned int rank, unsigned int dest,
                                                 unsigned long long position) {
  unsigned long long h = 0x9e3779b97f4a7c15ull ^ ((unsigned long long)iteration << 40) ^
                         ((unsigned long long)rank << 20) ^ dest;
  h ^= position + 0x632be59bd9b4e019ull + (h << 6) + (h >> 2);
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return (unsigned int)h;
}

// out[i] = row_hash(iteration, rank, dest_of(i), i − first(dest)) over blocks of `counts[d]` elements
// for d = 0..blocks-1 (offsets[d] = first element of block d).
__global__ void fill_blocks_kernel(unsigned int* out, const long long* offsets, int blocks, long long total,
                                   unsigned int iteration, unsigned int rank, int dest_step) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  int d = 0;
  while (d + 1 < blocks && offsets[d + 1] <= i) d++;
  out[i] = row_hash(iteration, rank, (unsigned int)(d * dest_step), i - offsets[d]);
}

// Counts (+=) the elements of got whose bits differ from row_hash(iteration, source(i), my_rank, i −
// first(source)), block s holding what source s sent.
__global__ void count_mismatches_kernel(int* mismatches, const unsigned int* got, const long long* offsets,
                                        const int* sources, int blocks, long long total, unsigned int iteration,
                                        unsigned int my_rank) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  int b = 0;
  while (b + 1 < blocks && offsets[b + 1] <= i) b++;
  if (got[i] != row_hash(iteration, (unsigned int)sources[b], my_rank, i - offsets[b])) atomicAdd(mismatches, 1);
}

// Block offsets and their sources, uploaded on `stream` into a pool buffer (Workspace).
struct BlockTable {
  DeviceBuffer<long long> offsets;
  DeviceBuffer<int> sources;
  long long total = 0;
  BlockTable(const std::vector<long long>& sizes, const std::vector<int>& source_of_block, cudaStream_t stream)
      : offsets(sizes.size(), Mem::Workspace, "test.block_offsets"),
        sources(sizes.size(), Mem::Workspace, "test.block_sources") {
    std::vector<long long> first(sizes.size());
    for (size_t b = 0; b < sizes.size(); b++) {
      first[b] = total;
      total += sizes[b];
    }
    cudaCheck(cudaMemcpyAsync(offsets.ptr, first.data(), offsets.bytes(), cudaMemcpyHostToDevice, stream), "test",
              "offsets");
    cudaCheck(cudaMemcpyAsync(sources.ptr, source_of_block.data(), sources.bytes(), cudaMemcpyHostToDevice, stream),
              "test", "sources");
  }
};

TEST(ConcurrentComms, RingAndAllToAllVOnTwoCommunicatorsAreBitExact) {
  REQUIRE_WORLD(2);
  const Comm& a = test_world();
  const auto split_start = std::chrono::steady_clock::now();
  Comm b = comm_split(a, 0, a.rank, "second");
  const double split_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - split_start).count();
  const int W = a.size, me = a.rank, prev = (me - 1 + W) % W;
  const int iterations = 200, row_elems = 33;
  Rng rng;  // the same draws on every rank (one FLATMOE_SEED)
  cudaStream_t compute = stream_create("test.compute");
  const size_t live_before = pool().live_total();
  DeviceBuffer<int> mismatches(1, Mem::Workspace, "test.mismatches");
  cudaCheck(cudaMemsetAsync(mismatches.ptr, 0, sizeof(int), compute), "test", "zero");
  long long ring_elements = 0, exchanged_rows = 0;
  int empty_iterations = 0;
  for (int it = 0; it < iterations; it++) {
    // sizes: the same draw on every rank; one iteration in eight moves nothing
    const bool empty = it % 8 == 3;
    const long long ring_count = empty || rng.integer(0, 9) == 0 ? 0 : rng.integer(1, 1 << 16);
    std::vector<long long> rows(W * W);  // rows[s·W + d]: rows from rank s to rank d
    for (long long& r : rows) r = empty || rng.integer(0, 4) == 0 ? 0 : rng.integer(1, 300);
    std::vector<long long> send_rows(W), recv_rows(W), send_elems(W), recv_elems(W);
    for (int d = 0; d < W; d++) {
      send_rows[d] = rows[me * W + d];
      recv_rows[d] = rows[d * W + me];
      send_elems[d] = send_rows[d] * row_elems;
      recv_elems[d] = recv_rows[d] * row_elems;
    }
    empty_iterations += ring_count == 0 && std::all_of(rows.begin(), rows.end(), [](long long r) { return r == 0; });
    ring_elements += ring_count;
    for (int d = 0; d < W; d++) exchanged_rows += recv_rows[d];

    std::vector<int> all_ranks(W), only_prev = {prev};
    for (int r = 0; r < W; r++) all_ranks[r] = r;
    BlockTable ring_table({ring_count}, only_prev, compute), send_table(send_elems, all_ranks, compute),
        recv_table(recv_elems, all_ranks, compute);
    unsigned int* ring_send = pool().alloc_t<unsigned int>(ring_count, Mem::Dispatch, "test.ring_send");
    unsigned int* ring_recv = pool().alloc_t<unsigned int>(ring_count, Mem::Dispatch, "test.ring_recv");
    unsigned int* a2a_send = pool().alloc_t<unsigned int>(send_table.total, Mem::Dispatch, "test.a2a_send");
    unsigned int* a2a_recv = pool().alloc_t<unsigned int>(recv_table.total, Mem::Dispatch, "test.a2a_recv");
    if (ring_count > 0)  // one block, dest 0 (dest_step 0): the receiver checks it as (previous rank, dest 0)
      fill_blocks_kernel<<<ceil_div(ring_count, 256), 256, 0, compute>>>(ring_send, ring_table.offsets.ptr, 1, ring_count,
                                                                         it, me, 0);
    if (send_table.total > 0)
      fill_blocks_kernel<<<ceil_div(send_table.total, 256), 256, 0, compute>>>(a2a_send, send_table.offsets.ptr, W,
                                                                               send_table.total, it, me, 1);
    launchCheck("test.fill", "it=%d", it);

    stream_after(a.stream, compute, "test");
    stream_after(b.stream, compute, "test");
    ring_send_recv(a, (int*)ring_send, (int*)ring_recv, ring_count, a.stream);
    all_to_all_v(b, (int*)a2a_send, send_rows, (int*)a2a_recv, recv_rows, row_elems, b.stream);
    pool().free_after(ring_send, a.stream);
    pool().free_after(a2a_send, b.stream);
    stream_after(compute, a.stream, "test");
    stream_after(compute, b.stream, "test");

    // the ring's rows carry dest 0 (dest_step 0); the all-to-all's carry their destination
    if (ring_count > 0)
      count_mismatches_kernel<<<ceil_div(ring_count, 256), 256, 0, compute>>>(
          mismatches.ptr, ring_recv, ring_table.offsets.ptr, ring_table.sources.ptr, 1, ring_count, it, 0);
    if (recv_table.total > 0)
      count_mismatches_kernel<<<ceil_div(recv_table.total, 256), 256, 0, compute>>>(
          mismatches.ptr, a2a_recv, recv_table.offsets.ptr, recv_table.sources.ptr, W, recv_table.total, it, me);
    launchCheck("test.check", "it=%d", it);
    pool().free(ring_recv);
    pool().free(a2a_recv);
  }
  int bad = -1;
  copy_to_host(&bad, mismatches.ptr, sizeof(int), compute, "test.mismatches");
  comm_sync(a, a.stream, "test");
  comm_sync(b, b.stream, "test");
  printf("[dist] rank %d: a second communicator in %.1f ms (comm_split with its warm-up); %d iterations (%d empty), "
         "%lld ring elements and %lld all-to-all rows of %d received, %d mismatching elements\n",
         me, split_ms, iterations, empty_iterations, ring_elements, exchanged_rows, row_elems, bad);
  EXPECT_EQ(bad, 0) << "rank " << me << ": every received element must equal what its sender wrote";
  EXPECT_GT(empty_iterations, 0);
  EXPECT_EQ(pool().live_total(), live_before + mismatches.bytes()) << "every block the loop took went back";
  cudaCheck(cudaStreamDestroy(compute), "test", "compute stream");
  comm_destroy(b);
}

}  // namespace
