// Sequence parallelism (--sp D, notes/sequence_parallel.md) in the whole model on W ranks: the D ranks
// of a sequence group hold T/D tokens of each of the group's sequences, attention runs on whole
// sequences of nh/D heads through Ulysses' exchanges, and everything else on the rank's own tokens, with
// expert groups of E_p ranks and vocabulary groups of P ranks (--head ring_dtp) laid over the same W
// ranks independently. Against the CPU reference over the global batch, each rank checking each tensor
// of its own shards; ten training steps against one GPU with the routing pinned; recomputation through
// the exchanges bit for bit.
#include <numeric>

#include "../model.cuh"
#include "../ref/model.hpp"
#include "dist_model_util.cuh"
#include "dist_util.cuh"
#include "gpu_util.cuh"
#include "memory_prediction.cuh"
#include "model_util.cuh"
#include "sco_training.cuh"

namespace {

// The issue's layouts (D, E_p, P): the ranks that share a sequence, hold disjoint experts, hold disjoint
// vocabulary intervals.
struct SequenceLayout {
  int D, ep, P;
  std::string name() const {
    return "D=" + std::to_string(D) + " E_p=" + std::to_string(ep) + " P=" + std::to_string(P);
  }
};
const std::vector<SequenceLayout> kSequenceLayouts = {{2, 1, 1}, {2, 2, 1}, {4, 2, 2}, {8, 8, 1}, {2, 4, 8}, {8, 2, 4}};

// "" when this run's W ranks hold the layout, else the W it needs (a multiple of D, E_p and P).
std::string sequence_layout_skip(const SequenceLayout& l, int W) {
  if (W % l.D == 0 && W % l.ep == 0 && W % l.P == 0) return "";
  const int need = std::lcm(std::lcm(l.D, l.ep), l.P);
  return l.name() + " needs W a multiple of " + std::to_string(need) + " (FLATMOE_TEST_WORLD=" + std::to_string(need) +
         " or more), this run has W=" + std::to_string(W);
}

// The communicators of the layout: sequence groups of D, expert groups of E_p and the ranks that hold
// the same experts, vocabulary groups of P and the ranks that hold the same interval (P > 1); under ZeRO-3
// (zero = 3) all W ranks again, for the dense weights' gathers.
Parallel sequence_parallel(const SequenceLayout& l, int zero = 1) {
  const Comm& world = test_world();
  Parallel par;
  par.world = world;
  par.zero = zero;
  if (zero == 3) par.dense = comm_block_group(world, world.size, "dense");
  if (l.D > 1) par.seq = comm_block_group(world, l.D, "seq");
  if (l.ep > 1) par.ep = comm_block_group(world, l.ep, "ep");
  par.expert_replicas = comm_split(world, world.rank % l.ep, world.rank, "expert_replicas");
  if (l.P > 1) {
    par.vocab = comm_block_group(world, l.P, "vocab");
    if (world.size > l.P) par.vocab_replicas = comm_split(world, world.rank % l.P, world.rank, "vocab_replicas");
  }
  return par;
}

void sequence_release(Parallel& par) {
  for (Comm* c : {&par.seq, &par.ep, &par.expert_replicas, &par.vocab, &par.vocab_replicas, &par.dense}) comm_destroy(*c);
}

// The toy model for every layout: nh = 8 heads of 32 (D up to 8 divides them), T = 32 (T/D >= 4 tokens
// per rank), E = 8 experts (E_p up to 8), a dense layer and a shared expert.
ModelConfig sequence_config() {
  ModelConfig c;
  c.vocab = 67; c.hidden = 256; c.heads = 8; c.seq_len = 32; c.expert_dim = 40;
  c.layers = 3; c.experts = 8; c.topk = 2; c.score_fn = 0; c.n_dense = 1; c.dense_dim = 48; c.shared_expert = 1;
  return c;
}

Seams sequence_seams(const SequenceLayout& l) {
  Seams seams;
  if (l.P > 1) {
    seams.head = "ring_dtp";
    seams.vocab_block = 16;
  }
  return seams;
}

// Every rank's top-k choices of every MoE layer ([B·T/D·k] each, its tokens in rank_tokens' order) in
// the global batch's token order ([L][groups·B·T·k]).
std::vector<std::vector<int>> global_routes_of(const std::vector<std::vector<int>>& local, const Comm& world, int D,
                                               int heads, int B, int T, int k) {
  std::vector<std::vector<int>> global(local.size());
  for (size_t l = 0; l < local.size(); l++) {
    if (local[l].empty()) continue;
    const std::vector<int> all = all_gather_host(world, local[l].data(), local[l].size(), "global_routes_of");
    global[l] = place_routes_globally(all.data(), world.size, D, heads, B, T, k);
  }
  return global;
}

// One first step under layout l (its dense weights under ZeRO stage `zero`): the loss and every gradient of
// every shard of every rank after the reduce-scatter, against the reference over the global batch (routing
// pinned to the ranks' choices, placed at their global tokens). B = 8 sequences a group: a gradient's
// normwise error is a ratio of two sums over the tokens, which a few tokens decide where there are few (the
// router's, in BF16).
void first_step_matches_reference(const SequenceLayout& l, int zero) {
  const Comm& world = test_world();
  const ModelConfig c = sequence_config();
  Parallel par = sequence_parallel(l, zero);
  const std::string refused = model_parallel_refusal(c, par);
  if (!refused.empty()) {
    sequence_release(par);
    FAIL() << l.name() << ": " << refused;
  }
  const int B = 8, T = c.seq_len, D = l.D, Tl = T / D, groups = world.size / D, N_global = groups * B * T;
  const SequenceSplit split = sequence_split(world.rank, world.size, c.heads, T, D);
  testutil::Rng rng;  // the harness gives every rank the same seed
  std::vector<float> master = testutil::random_master(c, rng);
  std::vector<int> x, y;
  testutil::random_tokens(N_global, c.vocab, rng, x, y);
  const std::vector<int> xl = testutil::rank_tokens(x, split, B, T), yl = testutil::rank_tokens(y, split, B, T);

  Model m = model_create(c, 1, par, 0, sequence_seams(l));
  model_set_master(m, master);
  model_zero_grads(m);
  const std::vector<std::vector<int>> routes = model_routes(m, xl.data(), B, Tl);
  PassOptions o;
  o.dloss = 1.f / N_global;
  const float loss = mean_over_ranks(m, model_pass(m, xl.data(), yl.data(), B, Tl, o));
  reduce_scatter_grads(m);
  const std::vector<float> grads = download_local(m.main_grads, m.num_params);

  ref::Model<double> r(c, testutil::as_seen_by_gpu(master));
  std::vector<std::vector<int>> global_routes = global_routes_of(routes, world, D, c.heads, B, T, c.topk);
  r.forced_routes = &global_routes;
  const double ref_loss = ref_pass(r, x, y, groups * B, T, true, 1.0 / N_global);
  const std::vector<float> ref_grads_global(r.grads.begin(), r.grads.end());
  const std::vector<float> ref_local = local_from_global(m, ref_grads_global);

  char what[112];
  snprintf(what, sizeof what, "dist_sp_D%d_Ep%d_P%d%s_W%d_rank%d", l.D, l.ep, l.P, zero == 3 ? "_zero3" : "", world.size,
           world.rank);
  expect_first_step_matches(what, m, loss, ref_loss, grads, ref_local, r.route_disagreements);
  model_destroy(m);
  sequence_release(par);
}

}  // namespace

// First step under each layout this W holds (first_step_matches_reference).
TEST(DistSequenceParallel, FirstStepShardsMatchReferenceOverGlobalBatch) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  int ran = 0;
  for (const SequenceLayout& l : kSequenceLayouts) {
    const std::string skip = sequence_layout_skip(l, world.size);
    if (!skip.empty()) {
      if (world.rank == 0) printf("[sp] skipped: %s\n", skip.c_str());
      continue;
    }
    first_step_matches_reference(l, 1);
    if (HasFatalFailure()) return;
    ran++;
  }
  if (ran == 0) GTEST_SKIP() << "no layout of the issue fits W=" << world.size;
}

// MoP's whole layout: sequence groups, expert groups, vocabulary groups and ZeRO-3's dense shards over the
// same W ranks (notes/zero3.md), first step against the reference: (2, 2, 1) and, where W holds it,
// (4, 2, 2) with the ring head.
TEST(DistSequenceParallel, FirstStepUnderZero3MatchesReferenceOverGlobalBatch) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  int ran = 0;
  for (const SequenceLayout& l : {SequenceLayout{2, 2, 1}, SequenceLayout{4, 2, 2}}) {
    if (!sequence_layout_skip(l, world.size).empty()) continue;
    first_step_matches_reference(l, 3);
    if (HasFatalFailure()) return;
    ran++;
  }
  if (ran == 0) GTEST_SKIP() << "D = E_p = 2 needs an even W, this run has W=" << world.size;
}

// Ten training steps at W ranks in sequence groups of D = 2 (E_p = 2) against one GPU over the same global
// batches, the routing pinned to the ranks' recorded choices placed at their global tokens
// (dist_model_util.cuh, ten_steps_agree_with_one_gpu): every step's loss and router biases, and every
// tensor of this rank's master shards after the tenth.
TEST(DistSequenceParallel, TenStepsAgreeWithOneGpu) {
  REQUIRE_WORLD(2);
  const SequenceLayout l{2, 2, 1};
  const std::string skip = sequence_layout_skip(l, test_world().size);
  if (!skip.empty()) GTEST_SKIP() << skip;
  const ModelConfig c = sequence_config();
  Parallel par = sequence_parallel(l);
  const std::string refused = model_parallel_refusal(c, par);
  if (!refused.empty()) {
    sequence_release(par);
    FAIL() << l.name() << ": " << refused;
  }
  ten_steps_agree_with_one_gpu(c, par, sequence_seams(l), l.D, "sp_D2_Ep2");
  sequence_release(par);
}

// Recomputation reruns each layer's forward through the exchanges (permutations: the same bits), so
// the gradients of every rank are bit-identical to the pass that kept its activations; with SCO's
// boundaries on the host too.
TEST(DistSequenceParallel, RecomputeThroughTheExchangesIsBitIdentical) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  if (world.size % 2 != 0) GTEST_SKIP() << "D = E_p = 2 needs an even W, this run has W=" << world.size;
  const ModelConfig c = sequence_config();
  const SequenceLayout l{2, 2, 1};
  Parallel par = sequence_parallel(l);
  const int B = 2, T = c.seq_len, Tl = T / l.D, groups = world.size / l.D;
  const SequenceSplit split = sequence_split(world.rank, world.size, c.heads, T, l.D);
  testutil::Rng rng;
  std::vector<float> master = testutil::random_master(c, rng);
  std::vector<int> x, y;
  testutil::random_tokens(groups * B * T, c.vocab, rng, x, y);
  const std::vector<int> xl = testutil::rank_tokens(x, split, B, T), yl = testutil::rank_tokens(y, split, B, T);
  Seams seams = sequence_seams(l);
  seams.offload_budget = (long long)B * Tl * c.hidden * sizeof(floatX) * 2;  // two of the four boundaries on the host
  Model m = model_create(c, 1, par, 0, seams);
  model_set_master(m, master);
  expect_recompute_bit_identical(m, xl.data(), yl.data(), B, Tl, 1.f / (groups * B * T),
                                 "rank " + std::to_string(world.rank) + " " + l.name());
  model_destroy(m);
  sequence_release(par);
}

// Selective attention recomputation (--device_budget, ops/sar_plan.hpp) in sequence groups of D = 2
// (E_p = 2): the plans for budgets from none to every option train bit-identically to full recomputation
// through the exchanges (losses, optimizer state and weights by memcmp), alone and beside SCO, the pool's
// peak rising by at most the kept bytes (the core option keeps attention's output in both shards); and
// the per-rank prediction with every option kept holds the pool's peak within 10 %.
TEST(DistSequenceParallel, KeptAttentionTrainsBitIdenticallyToFullRecomputation) {
  REQUIRE_WORLD(2);
  const SequenceLayout l{2, 2, 1};
  const std::string skip = sequence_layout_skip(l, test_world().size);
  if (!skip.empty()) GTEST_SKIP() << skip;
  const ModelConfig c = sequence_config();
  Parallel par = sequence_parallel(l);
  const std::string what = "W=" + std::to_string(par.world.size) + " rank " + std::to_string(par.world.rank) + " " + l.name();
  testutil::attention_keep_trains_alike(par, c, what.c_str());
  testutil::PredictionCase pc;
  pc.name = "--sp 2, every attention tensor kept";
  pc.attention_budget = 1LL << 40;
  const int B = 2, T = c.seq_len / l.D;
  testutil::expect_prediction_holds(testutil::predict_and_measure(c, par, pc, B, T), what + ", " + pc.name, true);
  sequence_release(par);
}

// Attention's live set falls as T/D: B sequences of T per sequence group, so B·T/D tokens a rank, at D = 1,
// 2, 4, 8 (those dividing W) over the same W ranks, the local MoE on each (E_p = 1, whose bound every
// routing attains), without recomputation so that every layer keeps its activations. On every rank the
// per-rank prediction (Eq. 6, attention's terms at the rank's B·T/D tokens) is at least the pool's peak
// and within 10 % of it, and the pool's Activations peak times D stays within 6/5 of D = 1's: every kept
// tensor is per token of the rank's slice, and under D > 1 attention keeps one more N·H buffer (its output
// in the head shard) beside its five — were q, k, v or the output kept at all T tokens, D = 2 would hold
// about 1.7 times D = 1's.
TEST(DistSequenceParallel, MemoryPredictionHoldsAndAttentionFallsAsOneOverD) {
  REQUIRE_WORLD(2);
  const Comm& world = test_world();
  ModelConfig c;
  c.vocab = 512; c.hidden = 256; c.heads = 8; c.layers = 4; c.experts = 8; c.topk = 2; c.expert_dim = 256;
  c.seq_len = 512;
  const int B = 2, T = c.seq_len;
  size_t activations_d1 = 0;
  for (int D : {1, 2, 4, 8}) {
    if (world.size % D != 0) continue;
    Parallel par = sequence_parallel(SequenceLayout{D, 1, 1});
    testutil::PredictionCase pc;
    pc.name = "--sp " + std::to_string(D) + ", recompute off";
    pc.recompute = false;
    const std::string what = "W=" + std::to_string(world.size) + " rank " + std::to_string(world.rank) + ", " + pc.name;
    testutil::expect_prediction_holds(testutil::predict_and_measure(c, par, pc, B, T / D), what, true);
    const size_t activations = pool().peak(Mem::Activations);
    if (D == 1) activations_d1 = activations;
    printf("[mem] %s: Activations peak %zu B, x D = %.3f of D = 1's\n", what.c_str(), activations,
           (double)activations * D / activations_d1);
    EXPECT_LE((double)activations * D, 1.2 * activations_d1) << what << ": attention's live set does not fall as 1/D";
    sequence_release(par);
  }
}
