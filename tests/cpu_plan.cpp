// plan.hpp — --plan auto's search, driven by a made-up memory model (the trainer's real prediction is
// driven through the trainer binary in cpu_config.cpp's ConfigTrainBeforeTheGpu.PlanAuto* tests):
//   the chosen setting fits the device and host budgets, and no setting that fits is estimated faster;
//   a larger budget never chooses a slower setting; the flags the user gave stay as given; nothing
//   fitting is refused naming the largest term; the estimate orders the savers as the header says.
#include <gtest/gtest.h>
#include "../plan.hpp"
#include "test_util.hpp"

namespace {

ModelConfig plan_model() {
  ModelConfig c;  // the default model: H 384, L 6, E 8, V set below
  c.vocab = 4096;
  return c;
}

PlanLimits limits_of(long long device, long long host) {
  PlanLimits limits;
  limits.device = device;
  limits.host = host;
  limits.gemm_flops = 400e12;
  limits.link_bytes_per_s = 55e9;
  return limits;
}

// A memory model that every saver lowers: the activations (halved by the chunked head's logits, an
// eighth kept under recomputation plus the kept attention), the optimizer's state (to the host), the
// boundaries (to the host under SCO), the routed experts' dispatch: 16 KiB a token row a rank may hold —
// its B·T tokens unchunked (64 MiB at 4096), a local chunk's, what ep may receive from all W ranks (W·B·T),
// W of pllep's chunks, a quarter of the rank's tokens under relay (the ring's hop).
RankUse made_up_use(const ModelConfig& c, const TrainConfig& t, int B, int T) {
  const size_t MiB = 1 << 20, boundary = (size_t)B * T * c.hidden * 2;
  const long long N = (long long)B * T;
  const std::string moe = moe_dispatcher(t);
  long long rows = local_chunked(t, N) ? t.token_budget : N;
  if (moe == "ep" || moe == "llep") rows = t.gpus * N;
  if (moe == "pllep") rows = t.gpus * std::min<long long>(N, t.token_budget ? t.token_budget : 4096);
  if (moe == "relay") rows = N / 4;
  const size_t dispatch = (size_t)rows * 16 * 1024;
  RankUse use;
  use.shard = 10'000'000;
  const size_t logits = t.head == "chunked" ? (size_t)t.vocab_block * B * T * 4 / 4 : 64 * MiB;
  const size_t activations = t.recompute ? 40 * MiB : 320 * MiB;
  const size_t offloaded = t.recompute ? std::min<size_t>(c.layers, t.offload_budget / boundary) : 0;
  const size_t boundaries = t.recompute ? (c.layers + 1 - offloaded) * boundary : 0;
  const size_t optimizer = t.optimizer == "adamw" ? 12 * use.shard : t.optimizer == "offload_adamw" ? 8 * MiB : 0;
  use.device.terms = {{"weights", 20 * MiB}, {"optimizer", optimizer}, {"kept activations", activations},
                      {"boundaries", boundaries}, {"output head", logits}, {"dispatch", dispatch}};
  use.device.peak_at = "the output head";
  use.host = offloaded * boundary + (t.optimizer == "adamw" ? 0 : t.optimizer == "offload_adamw" ? 12 : 20) * use.shard;
  if (t.recompute && parse_device_budget(t.device_budget).bytes > (long long)use.device.total())
    use.attention_kept.flops_saved = 1e9;  // what the budget's room keeps
  return use;
}

PlanResult plan_with(const ModelConfig& c, const TrainConfig& given, const std::vector<std::string>& explicit_flags,
                     const PlanLimits& limits, int B = 16, int T = 256) {
  return plan_auto(c, given, explicit_flags, B, T, 1, 2, limits,
                   [&](const TrainConfig& t) { return made_up_use(c, t, B, T); });
}

}  // namespace

// Over budgets from ample to none: what is chosen fits both budgets, and of every setting that fits
// none is estimated faster (the search takes the fastest); a larger budget never takes a slower one.
TEST(PlanAuto, TakesTheFastestSettingThatFits) {
  const ModelConfig c = plan_model();
  const TrainConfig given;
  const int B = 16, T = 256;
  int chose = 0, refused = 0;
  for (long long mib = 40; mib <= 600; mib += 20)
    for (long long host_mib : {0LL, 50LL, 200LL, 4000LL}) {
      const PlanLimits limits = limits_of(mib << 20, host_mib << 20);
      const PlanResult r = plan_with(c, given, {}, limits);
      EXPECT_EQ(r.settings, (int)plan_settings(c, given, {}, B, T, 2, limits.device).size());
      if (!r.fits) {
        refused++;
        continue;
      }
      chose++;
      EXPECT_LE((long long)r.chosen.use.device.total(), limits.device) << mib << " MiB";
      EXPECT_LE((long long)r.chosen.use.host, limits.host) << host_mib << " MiB of host";
      for (const TrainConfig& t : plan_settings(c, given, {}, B, T, 2, limits.device)) {
        const RankUse use = made_up_use(c, t, B, T);
        if ((long long)use.device.total() > limits.device || (long long)use.host > limits.host) continue;
        EXPECT_LE(r.chosen.seconds, plan_step_seconds(c, t, use, limits, B, T, 1, 2))
            << "a setting that fits is faster: " << plan_flags(given, t);
      }
    }
  EXPECT_GT(chose, 0);
  EXPECT_GT(refused, 0);
  for (long long host_mib : {0LL, 4000LL}) {
    double at_larger_budget = 0;
    for (long long mib = 600; mib >= 40; mib -= 20) {  // a smaller budget: never faster
      const PlanResult r = plan_with(c, given, {}, limits_of(mib << 20, host_mib << 20));
      if (!r.fits) break;
      EXPECT_GE(r.chosen.seconds, at_larger_budget) << mib << " MiB, " << host_mib << " MiB of host";
      at_larger_budget = r.chosen.seconds;
    }
  }
}

// With room for everything the plain setting runs: nothing changes.
TEST(PlanAuto, ChangesNothingWhenThePlainRunFits) {
  const ModelConfig c = plan_model();
  const TrainConfig given;
  const PlanResult r = plan_with(c, given, {}, limits_of(1LL << 40, 1LL << 40));
  ASSERT_TRUE(r.fits);
  EXPECT_EQ(r.chosen.train.recompute, 0);
  EXPECT_EQ(r.chosen.train.head, "full");
  EXPECT_EQ(r.chosen.train.optimizer, "adamw");
  EXPECT_EQ(plan_flags(given, r.chosen.train), "");
}

// A flag the user gave stays as given, and the plan works around it: --recompute 0 leaves the other
// savers; --optimizer adamw keeps the state on the device.
TEST(PlanAuto, KeepsTheFlagsTheUserGave) {
  const ModelConfig c = plan_model();
  TrainConfig given;
  given.recompute = 0;
  for (long long mib : {200LL, 300LL, 400LL}) {
    const PlanResult r = plan_with(c, given, {"--recompute"}, limits_of(mib << 20, 4000LL << 20));
    for (const TrainConfig& t : plan_settings(c, given, {"--recompute"}, 16, 256, 2, mib << 20))
      EXPECT_EQ(t.recompute, 0);
    if (r.fits) {
      EXPECT_EQ(r.chosen.train.recompute, 0) << mib;
    }
  }
  given = TrainConfig();
  const PlanResult r = plan_with(c, given, {"--optimizer"}, limits_of(200LL << 20, 4000LL << 20));
  ASSERT_TRUE(r.fits) << r.refusal;
  EXPECT_EQ(r.chosen.train.optimizer, "adamw");
  EXPECT_EQ(r.chosen.train.recompute, 1) << "the budget leaves recomputation to save the rest";
  EXPECT_NE(plan_flags(given, r.chosen.train).find("--recompute 1"), std::string::npos);
}

// Nothing fits: the refusal counts the settings and names the most frugal one's largest term.
TEST(PlanAuto, RefusesNamingTheLargestTerm) {
  const ModelConfig c = plan_model();
  const TrainConfig given;
  const PlanResult r = plan_with(c, given, {}, limits_of(30LL << 20, 1LL << 40));
  ASSERT_FALSE(r.fits);
  EXPECT_NE(r.refusal.find("--plan auto: none of " + std::to_string(r.settings) + " settings fits"), std::string::npos)
      << r.refusal;
  EXPECT_NE(r.refusal.find("its largest term is kept activations, 40.0 MiB at the output head"), std::string::npos)
      << r.refusal;
  const PlanResult no_host = plan_with(c, given, {"--recompute"}, limits_of(100LL << 20, 0));
  ASSERT_FALSE(no_host.fits);
  EXPECT_NE(no_host.refusal.find("its largest term is kept activations, 320.0 MiB"), std::string::npos) << no_host.refusal;
}

// The estimate orders the savers as plan.hpp says, on the default model's shape: the chunked head
// costs less than recomputation, offload_adamw less than cpu_adamw, SCO 2 % per L boundaries.
TEST(PlanAuto, EstimateOrdersTheSavers) {
  const ModelConfig c = plan_model();
  const PlanLimits limits = limits_of(1LL << 30, 1LL << 30);
  RankUse use;
  use.shard = 10'000'000;
  TrainConfig plain, chunked, recompute, offload, cpu, sco;
  chunked.head = "chunked";
  chunked.vocab_block = 1024;
  recompute.recompute = 1;
  offload.optimizer = "offload_adamw";
  cpu.optimizer = "cpu_adamw";
  sco.recompute = 1;
  sco.offload_budget = (long long)c.layers * 16 * 256 * c.hidden * 2;
  auto seconds = [&](const TrainConfig& t) { return plan_step_seconds(c, t, use, limits, 16, 256, 1, 2); };
  EXPECT_LT(seconds(plain), seconds(chunked));
  EXPECT_LT(seconds(chunked), seconds(recompute));
  EXPECT_LT(seconds(plain), seconds(offload));
  EXPECT_LT(seconds(offload), seconds(cpu));
  EXPECT_DOUBLE_EQ(seconds(sco), 1.02 * seconds(recompute)) << "every boundary offloaded";
  EXPECT_DOUBLE_EQ(seconds(offload) - seconds(plain), 12.0 * use.shard / limits.link_bytes_per_s);
}

// --moe local's token budget is searched where the unchunked MoE does not fit: at 100 MiB only a chunked
// setting fits (the most frugal unchunked one needs 131 MiB), and with the rest of the choice the largest
// budget that fits is taken (budgets below B·T = 4096 only); with room for the plain run, none. (Between
// the two it may chunk to keep a faster saver's setting: at 300 MiB, Adam's state on the device.) It is not searched for a
// dispatcher that does not read it, nor when the user gave it. Its cost: the experts' forward once more,
// but under recomputation (a tie, which the unchunked setting wins by coming first).
TEST(PlanAuto, ChoosesALocalTokenBudgetWhenNothingElseFits) {
  const ModelConfig c = plan_model();
  const TrainConfig given;
  const int B = 16, T = 256;
  const PlanLimits tight_limits = limits_of(100LL << 20, 4000LL << 20);
  const PlanResult tight = plan_with(c, given, {}, tight_limits);
  ASSERT_TRUE(tight.fits) << tight.refusal;
  const int chosen_budget = tight.chosen.train.token_budget;
  EXPECT_GT(chosen_budget, 0);
  EXPECT_NE(plan_flags(given, tight.chosen.train).find("--token_budget " + std::to_string(chosen_budget)), std::string::npos)
      << plan_flags(given, tight.chosen.train);
  for (int larger : {0, 2048, 1024}) {  // the same choice with no budget or a larger one does not fit
    if (larger != 0 && larger <= chosen_budget) continue;
    TrainConfig t = tight.chosen.train;
    t.token_budget = larger;
    EXPECT_GT((long long)made_up_use(c, t, B, T).device.total(), tight_limits.device) << "--token_budget " << larger;
  }
  const PlanResult roomy = plan_with(c, given, {}, limits_of(1LL << 40, 1LL << 40));
  ASSERT_TRUE(roomy.fits) << roomy.refusal;
  EXPECT_EQ(roomy.chosen.train.token_budget, 0) << "the unchunked MoE fits";
  std::vector<int> searched;
  for (const TrainConfig& t : plan_settings(c, given, {}, B, T, 2, 100LL << 20))
    if (searched.empty() || searched.back() != t.token_budget) searched.push_back(t.token_budget);
  EXPECT_EQ(searched, (std::vector<int>{0, 2048, 1024, 512})) << "none first, then the budgets below B·T, largest first";

  TrainConfig ep = given;
  ep.gpus = 2;  // --moe left out at E_p = 2: ep, which reads no token budget (pllep's settings do)
  for (const TrainConfig& t : plan_settings(c, ep, {}, B, T, 2, 100LL << 20))
    if (moe_dispatcher(t) != "pllep") EXPECT_EQ(t.token_budget, 0) << moe_dispatcher(t);
  TrainConfig fixed = given;
  fixed.token_budget = 1024;
  for (const TrainConfig& t : plan_settings(c, fixed, {"--token_budget"}, B, T, 2, 100LL << 20))
    EXPECT_EQ(t.token_budget, 1024);

  const PlanLimits limits = limits_of(1LL << 30, 1LL << 30);
  RankUse use;
  TrainConfig plain, chunked = given, recompute, recompute_chunked;
  chunked.token_budget = 512;
  recompute.recompute = recompute_chunked.recompute = 1;
  recompute_chunked.token_budget = 512;
  auto seconds = [&](const TrainConfig& t) { return plan_step_seconds(c, t, use, limits, B, T, 1, 2); };
  const double expert_forward = 6.0 * B * T * c.topk * c.hidden * c.expert_dim * c.layers / limits.gemm_flops;
  EXPECT_DOUBLE_EQ(seconds(chunked) - seconds(plain), expert_forward);
  EXPECT_DOUBLE_EQ(seconds(recompute_chunked), seconds(recompute));
  // a dense layer and a shared expert run in the same chunks: their forward once more too
  ModelConfig dense = c;
  dense.n_dense = 1; dense.dense_dim = 1024; dense.shared_expert = 1;
  auto dense_seconds = [&](const TrainConfig& t) { return plan_step_seconds(dense, t, use, limits, B, T, 1, 2); };
  const int moe_layers = dense.layers - dense.n_dense;
  const double forwards = 6.0 * B * T * dense.hidden *
                          ((double)dense.topk * dense.expert_dim * moe_layers + dense.dense_dim + (double)dense.expert_dim * moe_layers) /
                          limits.gemm_flops;
  EXPECT_DOUBLE_EQ(dense_seconds(chunked) - dense_seconds(plain), forwards);
  EXPECT_DOUBLE_EQ(dense_seconds(recompute_chunked), dense_seconds(recompute));
}

// Across ranks the dispatcher is planned too: ep where its receive bound fits; else pllep at the largest
// token budget that fits, or relay where nothing else does; searched in that order after the given one;
// --moe given keeps it (and a refusal names the dispatch term it cannot shrink).
TEST(PlanAuto, ChoosesADispatcherAcrossRanksWhenEpDoesNotFit) {
  const ModelConfig c = plan_model();
  TrainConfig given;
  given.gpus = 8;
  const int B = 16, T = 256;
  std::vector<std::string> searched;
  for (const TrainConfig& t : plan_settings(c, given, {}, B, T, 2, 1LL << 30)) {
    const std::string name = moe_dispatcher(t) + (t.moe == "relay" ? " " + t.relay_mode : "") +
                             (t.token_budget ? " " + std::to_string(t.token_budget) : "");
    if (searched.empty() || searched.back() != name) searched.push_back(name);
  }
  EXPECT_EQ(searched, (std::vector<std::string>{"ep", "pllep 2048", "pllep 1024", "pllep 512", "relay expert", "relay token"}))
      << "the given one, then pllep's budgets below B·T = 4096, largest first, then relay in each mode";

  const PlanResult roomy = plan_with(c, given, {}, limits_of(2LL << 30, 4000LL << 20), B, T);
  ASSERT_TRUE(roomy.fits) << roomy.refusal;
  EXPECT_EQ(moe_dispatcher(roomy.chosen.train), "ep") << "ep's receive bound fits";

  const PlanLimits tight = limits_of(400LL << 20, 4000LL << 20);  // ep needs 512 MiB of dispatch alone
  const PlanResult pllep = plan_with(c, given, {}, tight, B, T);
  ASSERT_TRUE(pllep.fits) << pllep.refusal;
  EXPECT_NE(moe_dispatcher(pllep.chosen.train), "ep");
  EXPECT_LE((long long)pllep.chosen.use.device.total(), tight.device);
  EXPECT_NE(plan_flags(given, pllep.chosen.train).find("--moe " + pllep.chosen.train.moe), std::string::npos)
      << plan_flags(given, pllep.chosen.train);

  const PlanLimits tighter = limits_of(90LL << 20, 4000LL << 20);  // pllep's smallest chunk needs 64 MiB of dispatch
  const PlanResult relay = plan_with(c, given, {}, tighter, B, T);
  ASSERT_TRUE(relay.fits) << relay.refusal;
  EXPECT_EQ(relay.chosen.train.moe, "relay");
  EXPECT_EQ(relay.chosen.train.relay_mode, "expert") << "expert and token cost alike here: the first in the order";

  TrainConfig ep = given;
  ep.moe = "ep";
  const PlanResult kept = plan_with(c, ep, {"--moe"}, tight, B, T);
  EXPECT_FALSE(kept.fits);
  EXPECT_NE(kept.refusal.find("largest term is dispatch"), std::string::npos) << kept.refusal;
  TrainConfig pllep_given = given;
  pllep_given.moe = "pllep";
  std::vector<int> budgets;
  for (const TrainConfig& t : plan_settings(c, pllep_given, {"--moe"}, B, T, 2, 1LL << 30)) {
    EXPECT_EQ(t.moe, "pllep");
    if (budgets.empty() || budgets.back() != t.token_budget) budgets.push_back(t.token_budget);
  }
  EXPECT_EQ(budgets, (std::vector<int>{0, 2048, 1024, 512})) << "--moe pllep given: its default (4096), then smaller";
  // a budget of c needs ⌈B·T / c⌉ chunks: --kmax is raised to them unless the user gave it
  for (const TrainConfig& t : plan_settings(c, pllep_given, {"--moe"}, B, T, 2, 1LL << 30))
    if (t.token_budget > 0) EXPECT_EQ(t.kmax, std::max(given.kmax, (B * T + t.token_budget - 1) / t.token_budget));
  for (const TrainConfig& t : plan_settings(c, pllep_given, {"--moe", "--kmax"}, B, T, 2, 1LL << 30))
    EXPECT_EQ(t.kmax, given.kmax);
}

TEST(PlanAuto, FlagsAreTheChangedOnesAsACommandLine) {
  TrainConfig given, chosen;
  EXPECT_EQ(plan_flags(given, chosen), "");
  chosen.recompute = 1;
  chosen.head = "chunked";
  chosen.vocab_block = 2048;
  EXPECT_EQ(plan_flags(given, chosen), "--recompute 1 --head chunked --vocab_block 2048");
}
