// tests/dist_comm.cu — runtime/comm.cuh (the launcher and the rendezvous: tests/dist_launch.cu).
//   Host-only (every machine, every rank): the NCCL id's hex text, comm_block_group's index math, the
//   timeout setting.
//   W ranks (REQUIRE_WORLD(2)): every collective in float / bf16 / int on fresh random data, each rank
//   checking its own result against the math over the global inputs (identical on every rank: one
//   seed). Sums use values on a coarse grid, so that every partial sum is exact in its type and the
//   results must match bit for bit whatever order NCCL adds in; data moves use arbitrary values and
//   must match bit for bit. Counts are multiples of nothing; all_to_all_v includes ranks that send
//   nothing and ranks that receive nothing. Then sub-jobs in which a rank fails in the middle of a
//   collective (never joins it; an NCCL error), which must end non-zero within 60 s naming the rank and
//   the operation.
#include <map>
#include "dist_jobs.cuh"

namespace {

using testutil::Rng;
using testutil::TestStream;

// ---------------------------------------------------------------------------------------------
// Host-only

TEST(CommHost, NcclIdHexRoundTrip) {
  comm_set_nccl_env();
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess) << "ncclGetUniqueId must work without a GPU (the launcher calls it)";
  std::string hex = nccl_id_to_hex(id);
  EXPECT_EQ(hex.size(), 2u * NCCL_UNIQUE_ID_BYTES);
  EXPECT_EQ(hex.find_first_not_of("0123456789abcdef"), std::string::npos) << hex;
  ncclUniqueId back;
  ASSERT_TRUE(nccl_id_from_hex(hex.c_str(), &back));
  EXPECT_EQ(memcmp(id.internal, back.internal, NCCL_UNIQUE_ID_BYTES), 0);

  ncclUniqueId every_byte;  // all 256 byte values, and upper-case digits read back the same
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) every_byte.internal[i] = (char)(255 - i * 2);
  std::string upper = nccl_id_to_hex(every_byte);
  for (char& c : upper) c = (char)toupper(c);
  ASSERT_TRUE(nccl_id_from_hex(upper.c_str(), &back));
  EXPECT_EQ(memcmp(every_byte.internal, back.internal, NCCL_UNIQUE_ID_BYTES), 0);

  EXPECT_FALSE(nccl_id_from_hex(hex.substr(1).c_str(), &back)) << "one digit short";
  EXPECT_FALSE(nccl_id_from_hex((hex + "0").c_str(), &back)) << "one digit long";
  std::string bad = hex;
  bad[17] = 'g';
  EXPECT_FALSE(nccl_id_from_hex(bad.c_str(), &back)) << "not a hex digit";
  EXPECT_FALSE(nccl_id_from_hex(nullptr, &back));
}

TEST(CommHost, BlockGroupPlaces) {
  for (int world = 1; world <= 16; world++) {
    for (int size = 1; size <= world + 1; size++) {
      BlockPlace place;
      if (world % size != 0) {
        std::string why = block_group_place(0, world, size, &place);
        EXPECT_NE(why.find("does not divide"), std::string::npos) << "W=" << world << " size=" << size << ": " << why;
        continue;
      }
      std::map<int, std::vector<int>> members;  // group index -> world ranks, in rank-within order
      for (int r = 0; r < world; r++) {
        ASSERT_EQ(block_group_place(r, world, size, &place), "") << "W=" << world << " size=" << size;
        EXPECT_EQ(place.group, r / size);
        EXPECT_EQ(place.rank, r % size);
        members[place.group].resize(size, -1);
        members[place.group][place.rank] = r;
      }
      EXPECT_EQ((int)members.size(), world / size) << "W=" << world << " size=" << size;
      for (auto& [group, ranks] : members)
        for (int i = 0; i < size; i++) EXPECT_EQ(ranks[i], group * size + i) << "contiguous blocks";
    }
  }
  BlockPlace place;
  EXPECT_NE(block_group_place(0, 4, 0, &place), "");
  EXPECT_NE(block_group_place(0, 4, -2, &place), "");
  EXPECT_NE(block_group_place(4, 4, 2, &place), "") << "rank outside the world";
}

TEST(CommHost, TimeoutParsing) {
  double s = 0;
  EXPECT_TRUE(parse_timeout_s("5", &s));
  EXPECT_EQ(s, 5);
  EXPECT_TRUE(parse_timeout_s("0.25", &s));
  EXPECT_EQ(s, 0.25);
  for (const char* bad : {"", "0", "-3", "abc", "5s", "nan", "inf"}) EXPECT_FALSE(parse_timeout_s(bad, &s)) << bad;
  EXPECT_FALSE(parse_timeout_s(nullptr, &s));
}

// ---------------------------------------------------------------------------------------------
// Collectives at W ranks

struct TypeNames {
  template <typename T> static std::string GetName(int) { return NcclType<T>::name; }
};
using CollectiveTypes = testing::Types<float, __nv_bfloat16, int>;

double as_double(float x) { return x; }
double as_double(__nv_bfloat16 x) { return __bfloat162float(x); }
double as_double(int x) { return x; }

// Any value of the type (for data moves, compared bit for bit).
template <typename T> T any_value(Rng& rng);
template <> float any_value<float>(Rng& rng) { return (float)rng.normal(); }
template <> __nv_bfloat16 any_value<__nv_bfloat16>(Rng& rng) { return __float2bfloat16_rn((float)rng.normal()); }
template <> int any_value<int>(Rng& rng) { return rng.integer(-2000000000, 2000000000); }

template <typename T> T from_double(double v);
template <> float from_double<float>(double v) { return (float)v; }
template <> __nv_bfloat16 from_double<__nv_bfloat16>(double v) { return __float2bfloat16_rn((float)v); }
template <> int from_double<int>(double v) { return (int)v; }

// Values on a grid coarse enough that the sum over up to 32 ranks, in any order, is exact in the type:
// float k/8 with |k| <= 64, bf16 k/2 with |k| <= 8 (sums stay within bf16's 8 significant bits), int.
template <typename T> T summable_value(Rng& rng);
template <> float summable_value<float>(Rng& rng) { return rng.integer(-64, 64) / 8.0f; }
template <> __nv_bfloat16 summable_value<__nv_bfloat16>(Rng& rng) { return __float2bfloat16_rn(rng.integer(-8, 8) / 2.0f); }
template <> int summable_value<int>(Rng& rng) { return rng.integer(-1000000, 1000000); }

// One vector per rank, the same on every rank (shared seed).
template <typename T, typename Draw>
std::vector<std::vector<T>> per_rank_inputs(Rng& rng, int ranks, size_t count, Draw draw) {
  std::vector<std::vector<T>> inputs(ranks, std::vector<T>(count));
  for (auto& v : inputs)
    for (T& x : v) x = draw(rng);
  return inputs;
}

// Elements whose bits differ; the first one is described in *first.
template <typename T>
size_t count_bit_mismatches(const std::vector<T>& got, const std::vector<T>& expected, std::string* first) {
  size_t bad = 0;
  if (got.size() != expected.size()) {
    *first = "sizes differ: " + std::to_string(got.size()) + " vs " + std::to_string(expected.size());
    return std::max(got.size(), expected.size());
  }
  for (size_t i = 0; i < got.size(); i++) {
    if (memcmp(&got[i], &expected[i], sizeof(T)) == 0) continue;
    if (bad++ == 0)
      *first = "index " + std::to_string(i) + ": got " + std::to_string(as_double(got[i])) + ", expected " +
               std::to_string(as_double(expected[i]));
  }
  return bad;
}

#define EXPECT_SAME_BITS(got, expected, what)                                                              \
  do {                                                                                                     \
    std::string first_;                                                                                    \
    size_t bad_ = count_bit_mismatches(got, expected, &first_);                                            \
    EXPECT_EQ(bad_, 0u) << what << " on rank " << test_world().rank << " of " << test_world().size << ": " \
                        << bad_ << " wrong elements; first at " << first_;                                 \
  } while (0)

template <typename T>
std::vector<T> download_after(const Comm& c, cudaStream_t stream, const char* op, const T* dev, size_t n) {
  comm_sync(c, stream, op);
  return testutil::download_vec(dev, n);
}

template <typename T> class Collectives : public testing::Test {};
TYPED_TEST_SUITE(Collectives, CollectiveTypes, TypeNames);

TYPED_TEST(Collectives, AllReduceSum) {
  using T = TypeParam;
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  TestStream s;
  for (size_t count : {size_t(1), size_t(37), size_t(100003)}) {
    Rng rng;
    auto inputs = per_rank_inputs<T>(rng, world.size, count, summable_value<T>);
    std::vector<T> expected(count);
    for (size_t i = 0; i < count; i++) {
      double sum = 0;
      for (int r = 0; r < world.size; r++) sum += as_double(inputs[r][i]);
      expected[i] = from_double<T>(sum);
    }
    auto send = testutil::upload_vec(inputs[world.rank]);
    DeviceBuffer<T> recv(count, Mem::Workspace, "test.recv");
    testutil::poison(recv.ptr, count);
    all_reduce_sum(world, send.ptr, recv.ptr, count, s.stream);
    EXPECT_SAME_BITS(download_after(world, s.stream, "all_reduce", recv.ptr, count), expected,
                     "all_reduce count=" << count);
    all_reduce_sum(world, send.ptr, send.ptr, count, s.stream);  // in place
    EXPECT_SAME_BITS(download_after(world, s.stream, "all_reduce", send.ptr, count), expected,
                     "in-place all_reduce count=" << count);
  }
}

TYPED_TEST(Collectives, ReduceScatterSum) {
  using T = TypeParam;
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  TestStream s;
  for (size_t count : {size_t(1), size_t(29), size_t(50021)}) {
    Rng rng;
    auto inputs = per_rank_inputs<T>(rng, world.size, count * world.size, summable_value<T>);
    std::vector<T> expected(count);  // this rank's shard of the sum
    for (size_t i = 0; i < count; i++) {
      double sum = 0;
      for (int r = 0; r < world.size; r++) sum += as_double(inputs[r][world.rank * count + i]);
      expected[i] = from_double<T>(sum);
    }
    auto send = testutil::upload_vec(inputs[world.rank]);
    DeviceBuffer<T> recv(count, Mem::Workspace, "test.recv");
    testutil::poison(recv.ptr, count);
    reduce_scatter_sum(world, send.ptr, recv.ptr, count, s.stream);
    EXPECT_SAME_BITS(download_after(world, s.stream, "reduce_scatter", recv.ptr, count), expected,
                     "reduce_scatter count=" << count);
  }
}

TYPED_TEST(Collectives, AllGather) {
  using T = TypeParam;
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  TestStream s;
  for (size_t count : {size_t(1), size_t(13), size_t(70001)}) {
    Rng rng;
    auto inputs = per_rank_inputs<T>(rng, world.size, count, any_value<T>);
    std::vector<T> expected;
    for (int r = 0; r < world.size; r++) expected.insert(expected.end(), inputs[r].begin(), inputs[r].end());
    auto send = testutil::upload_vec(inputs[world.rank]);
    DeviceBuffer<T> recv(count * world.size, Mem::Workspace, "test.recv");
    testutil::poison(recv.ptr, recv.count);
    all_gather(world, send.ptr, recv.ptr, count, s.stream);
    EXPECT_SAME_BITS(download_after(world, s.stream, "all_gather", recv.ptr, recv.count), expected,
                     "all_gather count=" << count);
  }
}

TYPED_TEST(Collectives, RingSendRecv) {
  using T = TypeParam;
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  TestStream s;
  for (size_t count : {size_t(1), size_t(4099)}) {
    Rng rng;
    auto inputs = per_rank_inputs<T>(rng, world.size, count, any_value<T>);
    auto send = testutil::upload_vec(inputs[world.rank]);
    DeviceBuffer<T> recv(count, Mem::Workspace, "test.recv");
    testutil::poison(recv.ptr, count);
    ring_send_recv(world, send.ptr, recv.ptr, count, s.stream);
    EXPECT_SAME_BITS(download_after(world, s.stream, "ring_send_recv", recv.ptr, count),
                     inputs[(world.rank - 1 + world.size) % world.size], "ring_send_recv count=" << count);
  }
}

// rows[s][d]: rows that rank s sends to rank d, in one of several patterns (the same on every rank).
std::vector<std::vector<long long>> all_to_all_pattern(Rng& rng, int ranks, int pattern) {
  std::vector<std::vector<long long>> rows(ranks, std::vector<long long>(ranks));
  int quiet = rng.integer(0, ranks - 1);
  for (int s = 0; s < ranks; s++)
    for (int d = 0; d < ranks; d++) {
      long long n = rng.integer(0, 45);
      if (pattern == 1 && s == quiet) n = 0;  // one rank sends nothing
      if (pattern == 2 && d == quiet) n = 0;  // one rank receives nothing
      if (pattern == 3) n = 0;                // nobody moves anything
      if (pattern == 4 && s == d) n = 0;      // nothing to self
      rows[s][d] = n;
    }
  return rows;
}

TYPED_TEST(Collectives, AllToAllVUnevenRows) {
  using T = TypeParam;
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  const int W = world.size, me = world.rank;
  TestStream s;
  for (size_t row_elems : {size_t(1), size_t(3), size_t(129)}) {
    for (int pattern = 0; pattern <= 4; pattern++) {
      Rng rng;
      auto rows = all_to_all_pattern(rng, W, pattern);
      // block[s][d]: the rows rank s sends to rank d
      std::vector<std::vector<std::vector<T>>> block(W, std::vector<std::vector<T>>(W));
      for (int src = 0; src < W; src++)
        for (int d = 0; d < W; d++) {
          block[src][d].resize(rows[src][d] * row_elems);
          for (T& x : block[src][d]) x = any_value<T>(rng);
        }
      std::vector<long long> send_rows(W), recv_rows(W);
      std::vector<T> send_host, expected;
      for (int d = 0; d < W; d++) {
        send_rows[d] = rows[me][d];
        send_host.insert(send_host.end(), block[me][d].begin(), block[me][d].end());
      }
      for (int src = 0; src < W; src++) {
        recv_rows[src] = rows[src][me];
        expected.insert(expected.end(), block[src][me].begin(), block[src][me].end());
      }
      auto send = testutil::upload_vec(send_host.empty() ? std::vector<T>(1) : send_host);
      DeviceBuffer<T> recv(std::max<size_t>(expected.size(), 1), Mem::Workspace, "test.recv");
      testutil::poison(recv.ptr, recv.count);
      all_to_all_v(world, send.ptr, send_rows, recv.ptr, recv_rows, row_elems, s.stream);
      EXPECT_SAME_BITS(download_after(world, s.stream, "all_to_all_v", recv.ptr, expected.size()), expected,
                       "all_to_all_v pattern " << pattern << " row_elems=" << row_elems << " (sends "
                                               << send_host.size() << ", receives " << expected.size() << ")");
    }
  }
}

TEST(CommWorld, AllToAllHost) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  TestStream s;
  for (int per_dest : {0, 1, 5}) {
    Rng rng;
    auto inputs = per_rank_inputs<long long>(rng, world.size, (size_t)world.size * per_dest, [](Rng& r) {
      return (long long)r.integer(-2000000000, 2000000000) * 4096 + r.integer(0, 4095);
    });
    std::vector<long long> expected;
    for (int src = 0; src < world.size; src++)
      for (int i = 0; i < per_dest; i++) expected.push_back(inputs[src][world.rank * per_dest + i]);
    std::vector<long long> got = all_to_all_host(world, inputs[world.rank], per_dest, s.stream);
    EXPECT_EQ(got, expected) << "all_to_all_host per_dest=" << per_dest << " on rank " << world.rank;
  }
}

// Every divisor of W: contiguous blocks, with sums and gathers inside each block only.
TEST(CommWorld, BlockGroupsForEveryDivisor) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  TestStream s;
  for (int size = 1; size <= world.size; size++) {
    if (world.size % size != 0) continue;
    Comm group = comm_block_group(world, size, "block");
    EXPECT_EQ(group.size, size);
    EXPECT_EQ(group.rank, world.rank % size);
    EXPECT_EQ(group.name, "block");
    int first = world.rank / size * size;  // world rank of the block's rank 0
    std::vector<int> mine = {world.rank, 1000 + world.rank};
    auto send = testutil::upload_vec(mine);
    DeviceBuffer<int> gathered(2 * size, Mem::Workspace, "test.gathered"), summed(2, Mem::Workspace, "test.summed");
    all_gather(group, send.ptr, gathered.ptr, 2, s.stream);
    all_reduce_sum(group, send.ptr, summed.ptr, 2, s.stream);
    std::vector<int> expected_gather, expected_sum = {0, 0};
    for (int r = first; r < first + size; r++) {
      expected_gather.push_back(r);
      expected_gather.push_back(1000 + r);
      expected_sum[0] += r;
      expected_sum[1] += 1000 + r;
    }
    EXPECT_EQ(download_after(group, s.stream, "all_gather", gathered.ptr, gathered.count), expected_gather)
        << "block size " << size;
    EXPECT_EQ(download_after(group, s.stream, "all_reduce", summed.ptr, summed.count), expected_sum)
        << "block size " << size;
    comm_destroy(group);
    EXPECT_EQ(group.nccl, nullptr);
  }
}

// comm_split with a color that is not a block: the ranks of equal parity.
TEST(CommWorld, SplitByParity) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  Comm parity = comm_split(world, world.rank % 2, world.rank, "parity");
  EXPECT_EQ(parity.rank, world.rank / 2);
  EXPECT_EQ(parity.size, (world.size - world.rank % 2 + 1) / 2);
  TestStream s;
  std::vector<int> one = {world.rank};
  auto send = testutil::upload_vec(one);
  DeviceBuffer<int> sum(1, Mem::Workspace, "test.sum");
  all_reduce_sum(parity, send.ptr, sum.ptr, 1, s.stream);
  int expected = 0;
  for (int r = world.rank % 2; r < world.size; r += 2) expected += r;
  EXPECT_EQ(download_after(parity, s.stream, "all_reduce", sum.ptr, 1), std::vector<int>{expected});
  comm_destroy(parity);
}

// ---------------------------------------------------------------------------------------------
// A rank fails in the middle of a collective: the job ends non-zero, promptly, naming the rank and
// the operation.

// Rank 1 never joins the all_reduce: rank 0's comm_sync times out (FLATMOE_COMM_TIMEOUT_S=10).
TEST(DistScenario, DISABLED_RankNeverJoins) {
  const Comm& world = test_world();
  if (world.rank == 1) std::this_thread::sleep_for(std::chrono::seconds(600));
  DeviceBuffer<float> x(1000, Mem::Workspace, "scenario");
  all_reduce_sum(world, x.ptr, x.ptr, x.count, 0);
  comm_sync(world, 0, "all_reduce");
}

// Rank 1 makes an NCCL call with an invalid data type while rank 0 waits in the all_reduce.
TEST(DistScenario, DISABLED_NcclErrorOnOneRank) {
  const Comm& world = test_world();
  DeviceBuffer<float> x(1000, Mem::Workspace, "scenario");
  if (world.rank == 1)
    comm_check(world, ncclAllReduce(x.ptr, x.ptr, x.count, (ncclDataType_t)ncclNumTypes, ncclSum, world.nccl, 0),
               "all_reduce", "count=%zu with an invalid data type", x.count);
  else
    all_reduce_sum(world, x.ptr, x.ptr, x.count, 0);
  comm_sync(world, 0, "all_reduce");
}

TEST(CommFailure, TimeoutWhenARankNeverJoins) {
  REQUIRE_WORLD(2);
  if (test_rank() != 0) return others_wait_for_rank_zero();  // rank 0 runs the sub-job
  JobResult job = run_scenario_job("RankNeverJoins", 2);
  EXPECT_NE(job.exit_code, 0);
  EXPECT_LT(job.seconds, 60);
  expect_contains(job, "flatmoe: rank 0 (group world): all_reduce failed: timed out");
  expect_contains(job, "flatmoe launch: rank 0 (pid ");
}

TEST(CommFailure, NcclErrorOnOneRank) {
  REQUIRE_WORLD(2);
  if (test_rank() != 0) return others_wait_for_rank_zero();  // rank 0 runs the sub-job
  JobResult job = run_scenario_job("NcclErrorOnOneRank", 2);
  EXPECT_EQ(job.exit_code, 1);
  EXPECT_LT(job.seconds, 60);
  expect_contains(job, "flatmoe: rank 1 (group world): all_reduce failed: invalid argument");
  expect_contains(job, "flatmoe launch: rank 1 (pid ");
}

}  // namespace
