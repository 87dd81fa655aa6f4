// The parameter layout of one rank (config.hpp: param_layout), built without allocating anything:
// today's sizes lay out exactly as before issue 15, and a region past 2^31 elements (which the int
// arithmetic of the old layout turned negative) has the sizes of its closed form.
#include <gtest/gtest.h>
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
          expect_same_layout(param_layout(specs, ep, replicated, expert),
                             layout_before_issue_15(specs, ep, replicated, expert),
                             "V=" + std::to_string(c.vocab) + " W=" + std::to_string(W) + " E_p=" + std::to_string(ep) +
                                 " rank " + std::to_string(rank));
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
