// tests/dist_toy_trace.cu — the toy of tools/toy_trace.hpp (`make toy`: one MoE layer traced by hand on
// the CPU, 2 ranks, 4 tokens each, E = 4, top-2) through the real kernels on 2 GPUs (ops/ep_moe.cuh's
// ep_moe_forward). The GPU moves every row where the trace says: the same route maps, rows per
// destination and source, rows per local expert and receive map, integer for integer; and computes
// the same out, to the build's tolerance (the trace is in double). Each rank prints its GPU arrays
// beside the trace's ([toy] lines): build/fp32/test_dist --gtest_filter='ToyTraceGpu.*' on 2 GPUs.
#include <sstream>
#include "dist_util.cuh"
#include "gpu_util.cuh"
#include "../ops/ep_moe.cuh"
#include "../tools/toy_trace.hpp"

namespace {

std::string ints(const std::vector<int>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); i++) s += (i ? " " : "") + std::to_string(v[i]);
  return s + "]";
}

template <typename T>
std::vector<int> as_ints(const std::vector<T>& v) { return std::vector<int>(v.begin(), v.end()); }

}  // namespace

TEST(ToyTraceGpu, RealKernelsMoveTheRowsAsTheTraceDoes) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  if (world.size != toy::RANKS) GTEST_SKIP() << "the toy has " << toy::RANKS << " ranks; this run has " << world.size;
  std::ostringstream text;
  const toy::Result trace = toy::toy_trace(text);
  const int r = world.rank, N = toy::N, H = toy::H, I = toy::I, E = toy::E, k = toy::K, E_L = toy::E_L, R = N * k;
  const toy::Rank& want = trace.ranks[r];

  ref::Mat<double> W13(E_L * 2 * I, H), W2(E_L * H, I);  // this rank's experts, stacked as the device holds them
  for (int l = 0; l < E_L; l++) {
    W13.middleRows(l * 2 * I, 2 * I) = trace.W13[r * E_L + l];
    W2.middleRows(l * H, H) = trace.W2[r * E_L + l];
  }
  std::vector<int> topk_idx;
  for (int n = 0; n < N; n++)
    for (int j = 0; j < k; j++) topk_idx.push_back(want.topk_idx(n, j));
  auto d_x = testutil::upload<floatX>(want.x);
  auto d_idx = testutil::upload_vec(topk_idx);
  auto d_w = testutil::upload<float>(want.topk_w);
  auto d_W13 = testutil::upload<floatX>(W13);
  auto d_W2 = testutil::upload<floatX>(W2);
  DeviceBuffer<floatX> d_out((size_t)N * H, Mem::Workspace, "test.out");
  testutil::poison(d_out.ptr, d_out.count);
  cudaCheck(cudaDeviceSynchronize(), "test", "setup");

  cudaStream_t stream = stream_create("test.toy_trace");
  EPSaved saved;
  ep_moe_forward(d_out.ptr, saved, d_x.ptr, d_idx.ptr, d_w.ptr, d_W13.ptr, d_W2.ptr, N, H, I, E, k, world, stream);
  stream_wait(stream, "toy_trace_gpu", "forward");
  const int R_d = (int)saved.plan.received;
  const std::vector<int> route_of_slot = testutil::download_vec(saved.route_of_slot, R);
  const std::vector<int> slot_of_route = testutil::download_vec(saved.slot_of_route, R);
  const std::vector<int> recv_row_of_slot = R_d ? testutil::download_vec(saved.recv_row_of_slot, R_d) : std::vector<int>();
  const ref::Mat<double> out = testutil::download(d_out.ptr, N, H);

  printf("[toy] rank %d route_of_slot    GPU %s  trace %s\n", r, ints(route_of_slot).c_str(), ints(want.route_of_slot).c_str());
  printf("[toy] rank %d send_rows        GPU %s  trace %s\n", r, ints(as_ints(saved.plan.send_rows)).c_str(),
         ints(as_ints(want.send_rows)).c_str());
  printf("[toy] rank %d recv_rows        GPU %s  trace %s\n", r, ints(as_ints(saved.plan.recv_rows)).c_str(),
         ints(as_ints(want.recv_rows)).c_str());
  printf("[toy] rank %d recv_row_of_slot GPU %s  trace %s\n", r, ints(recv_row_of_slot).c_str(),
         ints(want.recv_row_of_slot).c_str());
  for (int n = 0; n < N; n++)
    printf("[toy] rank %d out[%d] GPU %s  trace %s\n", r, n, toy::row(out, n).c_str(), toy::row(want.out, n).c_str());
  EXPECT_EQ(route_of_slot, want.route_of_slot);
  EXPECT_EQ(slot_of_route, want.slot_of_route);
  EXPECT_EQ(recv_row_of_slot, want.recv_row_of_slot);
  EXPECT_EQ(as_ints(saved.plan.send_rows), as_ints(want.send_rows));
  EXPECT_EQ(as_ints(saved.plan.recv_rows), as_ints(want.recv_rows));
  EXPECT_EQ(saved.plan.group_rows, want.group_rows);
  EXPECT_EQ(saved.plan.group_offsets, want.group_offsets);
  const std::string name = "toy trace rank " + std::to_string(r);
  EXPECT_REL(name.c_str(), "out", testutil::rel_err(out, want.out), OP_TOL);
  ep_saved_free(saved);
  cudaCheck(cudaStreamDestroy(stream), "test", "stream");
}
