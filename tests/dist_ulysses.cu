// tests/dist_ulysses.cu — ops/ulysses.cuh on the sequence groups of the test world (contiguous blocks
// of D ranks, config.hpp's sequence_split) for every D > 1 that divides W (W itself included), against
// ref/ulysses.hpp: every rank draws the same global tensor [B, T, G, nh, hd] (shared seed), takes its
// group rank's shard, and checks only the shard it gets back, bit for bit (memcmp: the exchange is a
// permutation) —
//   ulysses_to_heads     its head shard (the forward)
//   ulysses_to_sequence  its sequence shard from a fresh tensor's head shards (the reverse, and the
//                        gradient of ulysses_to_heads: dx = ulysses_to_sequence(dy))
//   both round trips     the identity
// with nh and T no powers of two (nh = 3·D, T = 12·D; nh = D, T = 5·D), G = 3 (q, k, v) and 1, hd in
// 16-byte pieces and in single elements; and the pool's CommStaging peak of every call equal to
// ulysses_staging_bytes, nothing left live after it.
#include <cstring>
#include "dist_util.cuh"
#include "../config.hpp"
#include "../ops/ulysses.cuh"
#include "../ref/ulysses.hpp"

using namespace testutil;

namespace {

// Per rank: T/D tokens and nh/D heads; the shapes scale with D.
struct UlyssesCase {
  int B, tokens_per_rank, parts, heads_per_rank, head_dim;
  ref::UlyssesShape at(int D) const { return {B, tokens_per_rank * D, parts, heads_per_rank * D, head_dim, D}; }
};
const UlyssesCase CASES[] = {
    {1, 12, 3, 3, 64},  // q, k, v of nh = 3·D heads of 64 (16-byte pieces), T = 12·D
    {3, 5, 1, 1, 6},    // one head per rank, 6 elements a row (single elements), three sequences of 5·D
    {2, 7, 3, 2, 32},   // q, k, v of nh = 2·D heads of 32, two sequences of 7·D
};

std::string describe(const ref::UlyssesShape& s) {
  return "B=" + std::to_string(s.B) + " T=" + std::to_string(s.T) + " G=" + std::to_string(s.parts) + " nh=" +
         std::to_string(s.heads) + " hd=" + std::to_string(s.head_dim) + " D=" + std::to_string(s.D);
}

// The same values on every rank (the launcher's shared seed); never zero.
std::vector<floatX> draw_global(const ref::UlyssesShape& s) {
  Rng rng;
  std::vector<floatX> global(s.global_elems());
  for (floatX& v : global) {
    const double magnitude = rng.uniform(0.5, 2);
    v = from_float<floatX>((float)(rng.integer(0, 1) ? magnitude : -magnitude));
  }
  return global;
}

// "" when the bytes agree, else the first element that differs.
std::string bit_difference(const std::vector<floatX>& got, const std::vector<floatX>& want) {
  if (got.size() != want.size()) return std::to_string(got.size()) + " elements, expected " + std::to_string(want.size());
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(floatX)) == 0) return "";
  for (size_t i = 0; i < got.size(); i++)
    if (std::memcmp(&got[i], &want[i], sizeof(floatX)) != 0)
      return "element " + std::to_string(i) + " of " + std::to_string(got.size()) + " is " +
             std::to_string(to_float(got[i])) + ", expected " + std::to_string(to_float(want[i]));
  return "";
}

struct Exchanged {
  std::vector<floatX> out;
  size_t staging_peak = 0, staging_left = 0;  // CommStaging bytes above what was live before the call
};

// One direction on this rank's shard `in` (to_heads: a sequence shard, else a head shard), on the group's stream.
Exchanged exchange(const std::vector<floatX>& in, bool to_heads, const ref::UlyssesShape& s, const Comm& seq) {
  DeviceBuffer<floatX> from = upload_vec(in, Mem::Activations, "test.ulysses.in");
  DeviceBuffer<floatX> to(s.shard_elems(), Mem::Activations, "test.ulysses.out");
  poison(to.ptr, to.count);
  cudaCheck(cudaDeviceSynchronize(), "test.ulysses", "uploads before the group's stream");
  const size_t before = pool().live(Mem::CommStaging);
  pool().reset_peak();
  if (to_heads) ulysses_to_heads(to.ptr, from.ptr, s.B, s.T, s.parts, s.heads, s.head_dim, seq, seq.stream);
  else ulysses_to_sequence(to.ptr, from.ptr, s.B, s.T, s.parts, s.heads, s.head_dim, seq, seq.stream);
  comm_sync(seq, seq.stream, to_heads ? "test.ulysses_to_heads" : "test.ulysses_to_sequence");
  Exchanged e;
  e.out = download_vec(to.ptr, to.count);
  e.staging_peak = pool().peak(Mem::CommStaging) - before;
  e.staging_left = pool().live(Mem::CommStaging) - before;
  return e;
}

void expect_staging(const Exchanged& e, const ref::UlyssesShape& s, const std::string& what) {
  const size_t bound = ulysses_staging_bytes(s.B, s.T, s.parts, s.heads, s.head_dim, s.D, sizeof(floatX));
  printf("[peak] %-52s comm_staging=%zu B (closed form 2*B*(T/D)*G*nh*hd*b = %zu)\n", what.c_str(), e.staging_peak, bound);
  EXPECT_EQ(e.staging_peak, bound) << what;
  EXPECT_EQ(e.staging_left, 0u) << what << ": staging left live";
}

// Every case on the sequence groups of D ranks.
void check_groups_of(int D) {
  const Comm& world = test_world();
  Comm seq = comm_block_group(world, D, "seq");
  for (const UlyssesCase& c : CASES) {
    const ref::UlyssesShape s = c.at(D);
    const SequenceSplit split = sequence_split(world.rank, world.size, s.heads, s.T, D);
    EXPECT_EQ(seq.rank, split.rank);
    EXPECT_EQ(seq.size, split.size);
    const int r = seq.rank;
    const std::string name = describe(s) + " rank " + std::to_string(r) + " of group " + std::to_string(split.group);
    SCOPED_TRACE(name);

    // forward: this rank's head shard
    const std::vector<std::vector<floatX>> x = ref::ulysses_sequence_shards(draw_global(s), s);
    const Exchanged heads = exchange(x[r], true, s, seq);
    EXPECT_EQ(bit_difference(heads.out, ref::ulysses_to_heads(x, s)[r]), "") << "ulysses_to_heads";
    expect_staging(heads, s, "ulysses_to_heads " + name);

    // reverse, and the gradient of the forward: a fresh tensor's head shards back to sequence shards
    const std::vector<std::vector<floatX>> dy = ref::ulysses_head_shards(draw_global(s), s);
    const Exchanged dx = exchange(dy[r], false, s, seq);
    EXPECT_EQ(bit_difference(dx.out, ref::ulysses_to_sequence(dy, s)[r]), "") << "ulysses_to_sequence";
    expect_staging(dx, s, "ulysses_to_sequence " + name);

    // round trips
    EXPECT_EQ(bit_difference(exchange(heads.out, false, s, seq).out, x[r]), "") << "to_sequence(to_heads(x)) is x";
    EXPECT_EQ(bit_difference(exchange(dx.out, true, s, seq).out, dy[r]), "") << "to_heads(to_sequence(dy)) is dy";
  }
  comm_destroy(seq);
}

}  // namespace

TEST(UlyssesDist, ExchangesMatchTheReferenceBitForBitInEverySequenceGroup) {
  REQUIRE_WORLD(2);
  const int W = test_world().size;
  for (int D = 2; D <= W; D++)
    if (W % D == 0) check_groups_of(D);
}
