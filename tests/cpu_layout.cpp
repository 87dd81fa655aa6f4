// The parameter layout of one rank (config.hpp: param_layout), built without allocating anything:
// today's sizes lay out exactly as before issue 15, and a region past 2^31 elements (which the int
// arithmetic of the old layout turned negative) has the sizes of its closed form; the optimizer's
// segments of every layout cover its shard exactly; each rank's initial weights, drawn only where it
// holds parameters, are bit for bit what the whole-model draw gave it before.
#include <gtest/gtest.h>
#include <cstring>
#include <string>
#include <vector>
#include "../config.hpp"

namespace {

// The layout model_layout computed before issue 15, its int-returning ceil_div included: the
// reference that today's sizes must reproduce element for element.
ParamLayout layout_before_issue_15(const std::vector<ParamSpec>& specs, int ep, RegionGroup replicated,
                                   RegionGroup expert) {
  auto int_ceil_div = [](long long a, long long b) { return (int)((a + b - 1) / b); };
  ParamLayout m;
  m.regions = {ParamRegion{Sharding::Replicated}, ParamRegion{Sharding::Expert}};
  for (const ParamSpec& s : specs) m.regions[s.expert ? 1 : 0].count += s.expert ? s.numel() / ep : s.numel();
  size_t next = 0;
  for (ParamRegion& r : m.regions) {
    const RegionGroup g = r.sharding == Sharding::Expert ? expert : replicated;
    const size_t group = (size_t)g.size, rank = (size_t)g.rank;
    r.offset = next;
    r.padded = int_ceil_div(r.count, group) * group;
    r.shard = r.padded / group;
    r.shard_offset = r.offset + rank * r.shard;
    next += r.padded;
  }
  m.num_params = next;
  std::vector<size_t> region_next = {m.regions[0].offset, m.regions[1].offset};
  for (const ParamSpec& s : specs) {
    size_t& at = region_next[s.expert ? 1 : 0];
    m.offsets.push_back(at);
    m.local_numel.push_back(s.expert ? s.numel() / ep : s.numel());
    at += m.local_numel.back();
  }
  return m;
}

void expect_same_layout(const ParamLayout& got, const ParamLayout& want, const std::string& what) {
  EXPECT_EQ(got.offsets, want.offsets) << what;
  EXPECT_EQ(got.local_numel, want.local_numel) << what;
  EXPECT_EQ(got.num_params, want.num_params) << what;
  ASSERT_EQ(got.regions.size(), want.regions.size()) << what;
  for (size_t i = 0; i < got.regions.size(); i++) {
    const ParamRegion &g = got.regions[i], &w = want.regions[i];
    EXPECT_TRUE(g.sharding == w.sharding) << what << " region " << i;
    EXPECT_EQ(g.offset, w.offset) << what << " region " << i;
    EXPECT_EQ(g.count, w.count) << what << " region " << i;
    EXPECT_EQ(g.padded, w.padded) << what << " region " << i;
    EXPECT_EQ(g.shard, w.shard) << what << " region " << i;
    EXPECT_EQ(g.shard_offset, w.shard_offset) << what << " region " << i;
  }
}

// The optimizer's segments of one rank's layout (config.hpp: shard_segments): S = the regions' shards;
// inside each region's shard the segments follow each other without a gap from the shard's start
// to where its tensors end (the rest is padding), each inside one tensor with that tensor's decay,
// each at its place in the state [S] (the shards region after region).
void expect_segments_cover_the_shard(const std::vector<ParamSpec>& specs, const ParamLayout& layout,
                                     const std::string& what) {
  size_t S = 0;
  const std::vector<ShardSegment> segments = shard_segments(specs, layout, &S);
  size_t shards = 0;
  for (const ParamRegion& r : layout.regions) shards += r.shard;
  EXPECT_EQ(S, shards) << what;
  size_t region_state = 0;
  for (const ParamRegion& r : layout.regions) {
    const size_t lo = r.shard_offset, hi = r.shard_offset + r.shard, tensors_end = r.offset + r.count;
    size_t next = lo;
    for (const ShardSegment& g : segments) {
      if (g.param_offset < lo || g.param_offset >= hi) continue;
      EXPECT_EQ(g.param_offset, next) << what << ": a gap or an overlap before element " << g.param_offset;
      EXPECT_EQ(g.state_offset, region_state + (g.param_offset - lo)) << what;
      size_t tensor = specs.size();
      for (size_t i = 0; i < specs.size(); i++)
        if (layout.offsets[i] <= g.param_offset && g.param_offset + g.count <= layout.offsets[i] + layout.local_numel[i])
          tensor = i;
      ASSERT_LT(tensor, specs.size()) << what << ": segment at " << g.param_offset << " is not inside one tensor";
      EXPECT_EQ(g.decay, specs[tensor].decay) << what << " " << specs[tensor].name;
      next = g.param_offset + g.count;
    }
    EXPECT_EQ(next, std::max(lo, std::min(hi, tensors_end))) << what << ": the segments stop before the shard's tensors end";
    region_state += r.shard;
  }
}

ModelConfig moe_config(int V, int H, int I, int E, int L) {
  ModelConfig c;
  c.vocab = V; c.hidden = H; c.heads = H / 64; c.expert_dim = I; c.experts = E; c.layers = L;
  return c;
}

// The closed form of the two regions' counts of a MoE model without dense layers or shared expert:
// wte and lm_head, per layer two norms, wqkv, wo and the router, and lnf; the expert stacks w13 and
// w2 of E/E_p experts each.
unsigned long long replicated_count(unsigned long long V, unsigned long long H, unsigned long long E,
                                    unsigned long long L) {
  return 2 * V * H + L * (2 * H + 3 * H * H + H * H + E * H) + H;
}
unsigned long long expert_count(unsigned long long H, unsigned long long I, unsigned long long E,
                                unsigned long long L, unsigned long long ep) {
  return L * (E / ep) * (2 * I * H + H * I);
}

// Every rank of W ranks with expert-parallel groups of E_p: its layout against the closed form.
void expect_closed_form(const ModelConfig& c, int W, int ep) {
  const unsigned long long R = replicated_count(c.vocab, c.hidden, c.experts, c.layers),
                           X = expert_count(c.hidden, c.expert_dim, c.experts, c.layers, ep);
  const unsigned long long replicas = W / ep, R_pad = (R + W - 1) / W * W, X_pad = (X + replicas - 1) / replicas * replicas;
  for (int rank = 0; rank < W; rank++) {
    const std::string what = "W=" + std::to_string(W) + " E_p=" + std::to_string(ep) + " rank " + std::to_string(rank);
    const ParamLayout layout =
        param_layout(param_specs(c), ep, RegionGroup{W, rank}, RegionGroup{(int)replicas, rank / ep});
    const ParamRegion &rep = layout.regions[0], &ex = layout.regions[1];
    EXPECT_EQ(rep.count, R) << what;
    EXPECT_EQ(rep.padded, R_pad) << what;
    EXPECT_EQ(rep.shard, R_pad / W) << what;
    EXPECT_EQ(rep.shard_offset, (unsigned long long)rank * (R_pad / W)) << what;
    EXPECT_EQ(ex.offset, R_pad) << what;
    EXPECT_EQ(ex.count, X) << what;
    EXPECT_EQ(ex.padded, X_pad) << what;
    EXPECT_EQ(ex.shard, X_pad / replicas) << what;
    EXPECT_EQ(ex.shard_offset, R_pad + (unsigned long long)(rank / ep) * (X_pad / replicas)) << what;
    EXPECT_EQ(layout.num_params, R_pad + X_pad) << what;
    // The last expert stack ends where the expert region's tensors end.
    EXPECT_EQ(layout.offsets.back() + layout.local_numel.back(), R_pad + X) << what;
    expect_segments_cover_the_shard(param_specs(c), layout, what);
  }
}

}  // namespace

TEST(ParamLayout, TodaysSizesLayOutAsBefore) {
  ModelConfig tiny;
  tiny.vocab = 19; tiny.hidden = 32; tiny.layers = 3; tiny.heads = 1; tiny.experts = 6; tiny.topk = 2;
  tiny.expert_dim = 24; tiny.n_dense = 1; tiny.dense_dim = 40; tiny.shared_expert = 1;
  ModelConfig fortunes;  // the defaults, on a 4096-token vocabulary
  fortunes.vocab = 4096;
  for (const ModelConfig& c : {tiny, fortunes}) {
    const std::vector<ParamSpec> specs = param_specs(c);
    for (int W : {1, 2, 3, 6})
      for (int ep : {1, 2, 3, 6}) {
        if (W % ep != 0 || c.experts % ep != 0) continue;
        for (int rank = 0; rank < W; rank++) {
          const RegionGroup replicated{W, rank}, expert{W / ep, rank / ep};
          const std::string what = "V=" + std::to_string(c.vocab) + " W=" + std::to_string(W) + " E_p=" +
                                   std::to_string(ep) + " rank " + std::to_string(rank);
          const ParamLayout layout = param_layout(specs, ep, replicated, expert);
          expect_same_layout(layout, layout_before_issue_15(specs, ep, replicated, expert), what);
          expect_segments_cover_the_shard(specs, layout, what);
        }
      }
  }
}

// H 2048, I 1024, E 64, L 6 on one GPU: 2.4B expert parameters in one region (issue 15, item 1).
TEST(ParamLayout, ExpertRegionPast2To31Elements) {
  const ModelConfig c = moe_config(50304, 2048, 1024, 64, 6);
  ASSERT_EQ(expert_count(2048, 1024, 64, 6, 1), 2415919104ull);
  ASSERT_GT(expert_count(2048, 1024, 64, 6, 1), 2147483647ull);
  expect_closed_form(c, 1, 1);
  expect_closed_form(c, 3, 1);  // padding to a group of 3 on a region past 2^31
  expect_closed_form(c, 8, 2);
}

// A 19B-parameter model (H 4096, I 2048, E 64, L 12): its expert region passes 2^34 elements.
TEST(ParamLayout, NineteenBillionParameters) {
  const ModelConfig c = moe_config(50304, 4096, 2048, 64, 12);
  EXPECT_GT(param_count(c), 19000000000ull);
  expect_closed_form(c, 1, 1);
  expect_closed_form(c, 7, 1);
  expect_closed_form(c, 8, 8);
}

namespace {

// The initialisation before issue 15 (model.cuh's init_master_weights): every rank drew the whole
// model, all experts, then kept its part (local_from_global).
std::vector<float> init_before_issue_15(const ModelConfig& c, unsigned long long seed) {
  std::vector<float> w(param_count(c));
  size_t off = 0;
  for (const ParamSpec& s : param_specs(c)) {
    bool is_norm = !s.decay;
    bool is_out_proj = s.name.find(".wo") != std::string::npos || s.name.find("w2") != std::string::npos;
    float std = c.init_std * (is_out_proj ? 1.f / std::sqrt(2.f * c.layers) : 1.f);
    for (size_t i = 0; i < s.numel(); i++, off++) w[off] = is_norm ? 1.f : std * normal_at(seed, off);
  }
  return w;
}

}  // namespace

// Issue 15, item 2: a rank draws only the parameters it holds, and gets the same bits as before.
TEST(ParamInit, EachRankDrawsItsOwnPartBitForBitAsBefore) {
  ModelConfig tiny;
  tiny.vocab = 19; tiny.hidden = 32; tiny.layers = 3; tiny.heads = 1; tiny.experts = 6; tiny.topk = 2;
  tiny.expert_dim = 24; tiny.n_dense = 1; tiny.dense_dim = 40; tiny.shared_expert = 1;
  ModelConfig moe = moe_config(97, 64, 48, 12, 2);  // MoE layers only, 12 experts
  moe.heads = 1;
  for (const ModelConfig& c : {tiny, moe})
    for (unsigned long long seed : {1337ull, 7ull}) {
      const std::vector<ParamSpec> specs = param_specs(c);
      const std::vector<float> whole = init_before_issue_15(c, seed);
      for (int W : {1, 2, 3, 6})
        for (int ep : {1, 2, 3, 6}) {
          if (W % ep != 0 || c.experts % ep != 0) continue;
          for (int rank = 0; rank < W; rank++) {
            const ParamLayout layout = param_layout(specs, ep, RegionGroup{W, rank}, RegionGroup{W / ep, rank / ep});
            const std::vector<float> want = local_from_global(specs, layout, rank % ep, whole);
            const std::vector<float> got = init_local_weights(c, specs, layout, rank % ep, seed);
            ASSERT_EQ(got.size(), want.size());
            EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0)
                << "V=" << c.vocab << " seed " << seed << " W=" << W << " E_p=" << ep << " rank " << rank;
          }
        }
    }
}

// --head ring_dtp: lm_head's rows split over vocabulary groups of P ranks (contiguous blocks, like
// the expert-parallel groups) in a third region, [vocab | pad], sharded over the W/P ranks that hold
// the same interval. Every element of every tensor lies in exactly one rank's shard (the gradient
// norm's premise), each rank's lm_head rows are its interval ⌊pV/P⌋.. of the global tensor, and it
// draws them at init bit for bit as the whole model would.
TEST(ParamLayout, VocabularyGroupsSplitLmHead) {
  ModelConfig c = moe_config(97, 32, 24, 4, 2);  // V = 97: no P below divides it
  c.heads = 1;
  const std::vector<ParamSpec> specs = param_specs(c);
  size_t lm_head_first = 0, lm_head = 0;
  for (size_t i = 0, off = 0; i < specs.size(); off += specs[i].numel(), i++)
    if (specs[i].name == "lm_head") lm_head_first = off, lm_head = i;
  const std::vector<float> whole = init_before_issue_15(c, 99);
  for (int W : {2, 4, 6})
    for (int P : {2, 3, 6}) {
      if (W % P != 0) continue;
      const int ep = 2;
      std::vector<int> owners(param_count(c), 0);  // how many ranks' shards hold each global element
      for (int rank = 0; rank < W; rank++) {
        const std::string what = "W=" + std::to_string(W) + " P=" + std::to_string(P) + " rank " + std::to_string(rank);
        const VocabSplit vocab{P, rank % P, RegionGroup{W / P, rank / P}};
        const ParamLayout layout = param_layout(specs, ep, RegionGroup{W, rank}, RegionGroup{W / ep, rank / ep}, vocab);
        ASSERT_EQ(layout.regions.size(), 3u) << what;
        const std::pair<int, int> rows = vocab_interval(c.vocab, P, rank % P);
        EXPECT_EQ(layout.vocab_first_row, (size_t)rows.first) << what;
        EXPECT_EQ(layout.local_numel[lm_head], (size_t)(rows.second - rows.first) * c.hidden) << what;
        EXPECT_EQ(layout.offsets[lm_head], layout.regions[2].offset) << what;
        EXPECT_EQ(layout.regions[2].count, layout.local_numel[lm_head]) << what;
        EXPECT_EQ(layout.num_params, layout.regions[2].offset + layout.regions[2].padded) << what;
        const std::vector<size_t> first = global_firsts(specs, layout, rank % ep);
        EXPECT_EQ(first[lm_head], lm_head_first + (size_t)rows.first * c.hidden) << what;
        const std::vector<float> want = local_from_global(specs, layout, rank % ep, whole);
        const std::vector<float> got = init_local_weights(c, specs, layout, rank % ep, 99);
        EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
        expect_segments_cover_the_shard(specs, layout, what);
        for (const ParamRegion& r : layout.regions)
          for (size_t i = 0; i < specs.size(); i++) {
            const size_t lo = std::max(r.shard_offset, layout.offsets[i]);
            const size_t hi = std::min(r.shard_offset + r.shard, layout.offsets[i] + layout.local_numel[i]);
            for (size_t j = lo; j < hi; j++) owners[first[i] + (j - layout.offsets[i])]++;
          }
      }
      for (size_t g = 0; g < owners.size(); g++)
        ASSERT_EQ(owners[g], 1) << "W=" << W << " P=" << P << ": global element " << g << " in " << owners[g] << " shards";
    }
}

// --zero 3: the replicated tensors form one gathered region per forward group (the embedding with layer
// 0, each layer, the final norm with lm_head), each padded to a multiple of W, and a rank's local buffers
// keep only its shard of each, one after another, before the expert region (which is ZeRO-1's, moved to
// follow the shards). A gathered region's tensors lie one after another from its gathered buffer's start.
// Every global element lies in exactly one rank's optimizer shard (the gradient norm's premise), each
// segment inside one tensor of its region's group with that tensor's decay; a rank's initial weights are
// the whole model's draw at the elements it keeps.
TEST(ParamLayout, Zero3KeepsOneShardOfEachForwardGroup) {
  ModelConfig tiny;
  tiny.vocab = 19; tiny.hidden = 32; tiny.layers = 3; tiny.heads = 1; tiny.experts = 6; tiny.topk = 2;
  tiny.expert_dim = 24; tiny.n_dense = 1; tiny.dense_dim = 40; tiny.shared_expert = 1;
  ModelConfig moe = moe_config(97, 64, 48, 12, 2);
  moe.heads = 1;
  for (const ModelConfig& c : {tiny, moe}) {
    const std::vector<ParamSpec> specs = param_specs(c);
    const std::vector<float> whole = init_before_issue_15(c, 5);
    for (int W : {1, 2, 3, 6})
      for (int ep : {1, 2, 3, 6}) {
        if (W % ep != 0 || c.experts % ep != 0) continue;
        std::vector<int> owners(param_count(c), 0);  // how many ranks' optimizer shards hold each global element
        for (int rank = 0; rank < W; rank++) {
          const std::string what = "V=" + std::to_string(c.vocab) + " W=" + std::to_string(W) + " E_p=" +
                                   std::to_string(ep) + " rank " + std::to_string(rank);
          const RegionGroup replicated{W, rank}, expert{W / ep, rank / ep};
          const ParamLayout zero1 = param_layout(specs, ep, replicated, expert);
          const ParamLayout zero3 = param_layout(specs, ep, replicated, expert, VocabSplit(), true);
          const int groups = c.layers + 1;
          ASSERT_EQ(zero3.regions.size(), (size_t)groups + 1) << what;
          size_t kept = 0;  // the shards so far
          for (int g = 0; g < groups; g++) {
            const ParamRegion& r = zero3.regions[g];
            EXPECT_TRUE(r.gathered && r.group == g && r.sharding == Sharding::Replicated) << what << " group " << g;
            size_t count = 0;
            for (size_t i = 0; i < specs.size(); i++)
              if (!specs[i].expert && specs[i].forward_group == g) {
                EXPECT_EQ(zero3.region[i], g) << what << " " << specs[i].name;
                EXPECT_EQ(zero3.offsets[i], count) << what << " " << specs[i].name << ": offset in its gathered buffer";
                count += specs[i].numel();
              }
            EXPECT_EQ(r.count, count) << what << " group " << g;
            EXPECT_EQ(r.padded, (count + W - 1) / W * W) << what << " group " << g;
            EXPECT_EQ(r.shard, r.padded / W) << what << " group " << g;
            EXPECT_EQ(r.offset, kept) << what << " group " << g;
            EXPECT_EQ(r.shard_offset, kept) << what << " group " << g;
            EXPECT_EQ(r.shard_first, (size_t)rank * r.shard) << what << " group " << g;
            kept += r.shard;
          }
          const ParamRegion &ex = zero3.regions[groups], &ex1 = zero1.regions[1];
          EXPECT_TRUE(ex.sharding == Sharding::Expert && !ex.gathered) << what;
          EXPECT_EQ(ex.offset, kept) << what;
          EXPECT_EQ(ex.count, ex1.count) << what;
          EXPECT_EQ(ex.padded, ex1.padded) << what;
          EXPECT_EQ(ex.shard_offset - ex.offset, ex1.shard_offset - ex1.offset) << what;
          EXPECT_EQ(zero3.num_params, kept + ex.padded) << what;

          // local element -> global element, from the pieces this rank keeps
          const std::vector<size_t> first = global_firsts(specs, zero3, rank % ep);
          std::vector<long long> global_of(zero3.num_params, -1);
          for (const LocalPiece& p : local_pieces(zero3))
            for (size_t j = 0; j < p.count; j++) {
              ASSERT_EQ(global_of[p.at + j], -1) << what << ": local element " << p.at + j << " kept twice";
              global_of[p.at + j] = (long long)(first[p.spec] + p.first + j);
            }
          size_t S = 0;
          for (const ShardSegment& s : shard_segments(specs, zero3, &S)) {
            const ParamRegion& r = zero3.regions[s.group < groups && s.param_offset < kept ? s.group : groups];
            EXPECT_GE(s.param_offset, r.shard_offset) << what;
            EXPECT_LE(s.param_offset + s.count, r.shard_offset + r.shard) << what;
            for (size_t j = 0; j < s.count; j++) {
              ASSERT_GE(global_of[s.param_offset + j], 0) << what << ": segment element " << s.param_offset + j << " not kept";
              owners[global_of[s.param_offset + j]]++;
            }
          }
          EXPECT_EQ(S, kept + ex.shard) << what;
          const std::vector<float> want = local_from_global(specs, zero3, rank % ep, whole);
          for (size_t j = 0; j < zero3.num_params; j++) {
            if (global_of[j] < 0) continue;
            ASSERT_EQ(want[j], whole[global_of[j]]) << what << " local element " << j;
          }
          const std::vector<float> got = init_local_weights(c, specs, zero3, rank % ep, 5);
          EXPECT_EQ(std::memcmp(got.data(), want.data(), got.size() * sizeof(float)), 0) << what;
        }
        for (size_t g = 0; g < owners.size(); g++)
          ASSERT_EQ(owners[g], 1) << "W=" << W << " E_p=" << ep << ": global element " << g << " in " << owners[g] << " shards";
      }
  }
}
