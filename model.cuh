// model.cuh — the GPU model: parameters in regions, forward, backward, recomputation, update.
// Twin of ref/model.hpp (the same model in plain Eigen math). Header-only: train.cu, the tests and
// the benchmarks include it.
//
//   forward:  embedding → L × [x_mid = x + wo·Attn(RoPE(wqkv·RMSNorm(x))); x = x_mid + FFN(RMSNorm(x_mid))]
//             → RMSNorm → output head (vocabulary projection + cross-entropy)
//   backward: the same in reverse; with recompute only each layer's input is kept (LayerBoundaries)
//             and the layer is run forward again just before its backward
//   update:   gradients reduce-scattered per region (ZeRO-1), global-norm clipping, the optimizer on
//             this rank's shards, weights all-gathered per region, aux-loss-free router-bias update
//
// Seams (notes/design.md §1.1, notes/seams.md), each chosen once at model_create from the flags: the MoE
// dispatcher (--moe), the output head (--head) and the optimizer (--optimizer), each made by its
// registered factory (config.hpp names the choices, seams.cuh makes them), and the layer boundaries
// (--offload_budget: ops/sco.cuh places some in pinned host memory).
// The model calls each in one place.
//
// Parallel layout (notes/design.md §5): W ranks, one process per GPU. Dense tensors are replicated over
// the world; routed experts are split over the E_p ranks of an expert-parallel group (contiguous
// blocks of E_p ranks) and replicated over the W/E_p groups; under --head ring_dtp lm_head's rows are
// split over the P ranks of a vocabulary group (contiguous blocks of P ranks) in the same way. Under
// --sp D the D ranks of a sequence group (contiguous blocks of D ranks) hold T/D tokens of each of the
// group's sequences, and attention trades tokens for heads with them (attention_step; notes/sequence_parallel.md).
#pragma once
#include <algorithm>
#include <cmath>
#include <type_traits>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "config.hpp"
#include "plan.hpp"
#include "data/routing_profile.hpp"
#include "data/routing_trace.hpp"
#include "ops/adamw.cuh"
#include "ops/attention.cuh"
#include "ops/common.cuh"
#include "ops/cross_entropy.cuh"
#include "ops/embedding.cuh"
#include "ops/matmul.cuh"
#include "ops/moe.cuh"
#include "ops/rmsnorm.cuh"
#include "ops/rope.cuh"
#include "ops/router.cuh"
#include "ops/sco.cuh"
#include "ops/sar_plan.hpp"
#include "ops/ulysses.cuh"
#include "runtime/comm.cuh"
#include "runtime/side_stream.cuh"
#include "runtime/update_stream.cuh"
#include "runtime/graph.cuh"
#include "runtime/pinned.cuh"
#include "runtime/pool.cuh"
#include "runtime/profile.cuh"
#include "runtime/zero3.cuh"
#include "seams.cuh"

// =============================================================================================
// Parameters

// Pointers of one layer's tensors inside a flat buffer (parameters or their gradients).
struct LayerTensors {
  floatX *ln1, *wqkv, *wo, *ln2;
  floatX *router, *w13, *w2;             // MoE layers
  floatX *shared_w13, *shared_w2;        // MoE layers with a shared expert
  floatX *dense_w13, *dense_w2;          // dense FFN layers
};

struct ModelTensors {
  floatX *wte, *lnf, *lm_head;
  std::vector<LayerTensors> layers;
};

// This process's place among the W ranks. At W = 1 every group has size 1 and no NCCL
// communicator exists.
struct Parallel {
  Comm world;            // all W ranks
  Comm ep;               // the E_p ranks that hold disjoint expert shards (contiguous block of ranks)
  Comm expert_replicas;  // the W/E_p ranks that hold the same expert shard (same rank in their ep group)
  Comm vocab;            // the P ranks that hold disjoint vocabulary intervals of lm_head (--head ring_dtp)
  Comm vocab_replicas;   // the W/P ranks that hold the same interval (same rank in their vocab group)
  Comm seq;              // the D ranks that share each sequence, T/D tokens each (--sp; contiguous block of ranks)
  // --zero 3: all W ranks again, for the dense weights' all-gathers and their gradients' reduce-scatters on
  // its own stream, beside the compute stream (runtime/zero3.cuh)
  Comm dense;
  int zero = 1;          // the ZeRO stage of the dense weights: 1 (each rank holds them all) or 3 (1/W each)
};

// Everything the host decides for a pass that a graph of it holds fixed (--cuda_graph, model_pass):
// the sizes and options, how many of the update's groups its forward waits for (UpdateStream), and
// the pinned buffers its copies read. Everything else a pass's host code decides follows from these
// and the model (the layers' plans depend on the shapes only; the routing stays on the device).
struct PassGraphKey {
  int B = 0, T = 0;
  bool backward = false, count_loads = false, recompute = false, first_of_step = false, fold = false;
  float dloss = 0.f;
  int update_waits = 0;
  const int* tokens_host = nullptr;
  const int* buckets_host = nullptr;
  bool operator==(const PassGraphKey& o) const {
    return B == o.B && T == o.T && backward == o.backward && count_loads == o.count_loads && recompute == o.recompute &&
           first_of_step == o.first_of_step && fold == o.fold && dloss == o.dloss && update_waits == o.update_waits &&
           tokens_host == o.tokens_host && buckets_host == o.buckets_host;
  }
};


struct Model {
  ModelConfig cfg;
  Parallel par;
  std::vector<ParamSpec> specs;     // config.hpp: dense tensors, then routed-expert stacks
  std::vector<size_t> offsets;      // element offset of each spec in the local flat buffers
  std::vector<size_t> local_numel;  // expert stacks hold E/E_p experts here
  std::vector<ParamRegion> regions; // [replicated, expert], in buffer order (--zero 3: a gathered region per group)
  std::vector<int> spec_region;     // each spec's region
  size_t num_params = 0;            // local flat buffer length (regions padded)
  size_t vocab_first_row = 0;       // lm_head's first row here (its vocabulary interval under ring_dtp)

  floatX* params = nullptr;  // [num_params] floatX weights the kernels read      (Weights)
  floatX* grads = nullptr;   // [num_params] one pass's gradients, the kernels' += target (Grads)
  // [num_params] fp32 gradients summed over a step's passes (the "main grads"): in the BF16 build
  // every pass ends by folding its bf16 grads into them (model_fold_grads), so that a step's sum, its
  // reduction over the ranks, its norm and the optimizer are fp32 (Grads, 4 B per parameter); the
  // FP32 build's grads are already fp32 and main_grads is the same buffer. A step of one pass on one
  // rank skips the fold: main_grads would be an exact copy, and the optimizer reads grads instead.
  float* main_grads = nullptr;
  ModelTensors p, g;         // views into params / grads (--zero 3: a group's dense tensors in its gathered
                             // buffers while it runs, nullptr otherwise)
  Zero3Weights zero3;        // --zero 3: the dense weights' gathers and their gradients' reduce-scatters

  std::unique_ptr<MoEDispatcher> moe;  // routed experts (--moe)
  std::unique_ptr<LocalDispatcher> dense_ffn, shared_ffn;  // the dense layers' FFN, the shared expert (dense_ffn_dispatcher)
  std::unique_ptr<OutputHead> head;    // vocabulary projection + loss (--head)
  std::unique_ptr<Optimizer> opt;      // master weights and moments of this rank's shards (--optimizer)
  std::unique_ptr<CheckpointOffload> sco;  // layer boundaries in pinned host memory (--offload_budget)
  SarPlan attention_kept;                  // selective attention recomputation (--device_budget): none by default
  int attention_groups = 1;                // --attention_groups G: attention's heads in G groups (attention_groups_forward)

  // Router biases (aux-loss-free balancing): [L, E] floats, host copy is the source of truth.
  std::vector<float> router_bias;       // host [L·E]
  float* router_bias_dev = nullptr;     // device [L·E]                           (Weights)
  std::vector<long long> step_loads;    // host [L·E] routes per expert over the last step, global (set by model_update)
  // device [L·E] routes per expert over the current step, added by every MoE layer's router
  // (router_add_loads) with no host wait; model_update downloads it once per step (Workspace)
  int* step_loads_dev = nullptr;

  // Trivial routing for dense FFNs and the shared expert (every token → expert 0, weight 1).
  int* dense_idx = nullptr;
  float* dense_w = nullptr;
  int dense_rows = 0;

  // RoPE's angles for every position t < seq_len (ops/rope.cuh): [2, seq_len, hd/2] fp32 cos, then sin,
  // made once at model_create (Workspace)
  RopeAngles rope_angles;
  float* sumsq_partials = nullptr;  // [SUMSQ_BLOCKS]                          (Workspace)
  float* scalar_dev = nullptr;      // [1]                                      (Workspace)
  float* grad_scale_dev = nullptr;  // [1] the step's clip factor, read by the optimizer (Workspace)
  cudaStream_t stream = 0;
  UpdateStream update;              // --overlap_update: the optimizer's stream and its events
  // The weight gradients' stream (runtime/side_stream.cuh: two lanes, taken in turn): each layer's
  // backward forks its weight gradients onto it and joins it before the layer's last input gradient
  // (layer_backward). Off (--wgrad_stream 0): the compute stream itself, the same buffers held as
  // long, the same bits.
  std::unique_ptr<SideStream> wgrad = std::make_unique<SideStream>();
  // a pass's uploads (model_pass): tokens and targets; the embedding backward's buckets
  std::unique_ptr<PinnedUpload> tokens_upload = std::make_unique<PinnedUpload>();
  std::unique_ptr<PinnedUpload> buckets_upload = std::make_unique<PinnedUpload>();
  std::unique_ptr<PinnedLoss> loss_host = std::make_unique<PinnedLoss>();
  // --cuda_graph (model_pass): passes captured as CUDA graphs, one per PassGraphKey, and launched again
  GraphedPasses<PassGraphKey> graphs;

  // --routing: a profile (paper appendix B.2) that replaces the router's expert choice
  bool routing_override = false;
  RoutingProfile routing;

  // Routing traces (data/routing_trace.hpp) follow the training passes, numbered by model_train_step
  // (pass = step·accum + micro-batch); every other pass (validation, samples, a test's own) is -1 and
  // routes by the router or the profile.
  long long training_pass = -1;
  std::unique_ptr<data::RankRoutes> replay;  // --routing trace:FILE: this rank's recorded choices
  bool record_routing = false;               // --record_routing: every rank gathers each training pass's
  std::unique_ptr<data::RoutingTraceWriter> routing_record;  // choices, and rank 0 appends them here
};

// The ranks that share a region (and shard its optimizer state).
inline const Comm& region_group(const Model& m, const ParamRegion& r) {
  return r.sharding == Sharding::Expert ? m.par.expert_replicas
         : r.sharding == Sharding::Vocab ? m.par.vocab_replicas
                                         : m.par.world;
}

// Where tensor `name` starts: in `base` (a local flat buffer), or, for a tensor of a gathered region
// (--zero 3), in its group's buffer groups[g] (nullptr while the group is not gathered).
inline floatX* tensor_at(floatX* base, const Model& m, const std::string& name, const std::vector<floatX*>& groups = {}) {
  for (size_t i = 0; i < m.specs.size(); i++) {
    if (m.specs[i].name != name) continue;
    const ParamRegion& r = m.regions[m.spec_region[i]];
    if (!r.gathered) return base + m.offsets[i];
    floatX* group = r.group < (int)groups.size() ? groups[r.group] : nullptr;
    return group ? group + m.offsets[i] : nullptr;
  }
  return nullptr;
}

inline LayerTensors layer_tensors(floatX* base, const Model& m, int l, const std::vector<floatX*>& groups = {}) {
  const std::string p = "layer" + std::to_string(l) + ".";
  LayerTensors lt;
  lt.ln1 = tensor_at(base, m, p + "ln1", groups);
  lt.wqkv = tensor_at(base, m, p + "wqkv", groups);
  lt.wo = tensor_at(base, m, p + "wo", groups);
  lt.ln2 = tensor_at(base, m, p + "ln2", groups);
  lt.router = tensor_at(base, m, p + "router", groups);
  lt.w13 = tensor_at(base, m, p + "w13", groups);
  lt.w2 = tensor_at(base, m, p + "w2", groups);
  lt.shared_w13 = tensor_at(base, m, p + "shared_w13", groups);
  lt.shared_w2 = tensor_at(base, m, p + "shared_w2", groups);
  lt.dense_w13 = tensor_at(base, m, p + "dense_w13", groups);
  lt.dense_w2 = tensor_at(base, m, p + "dense_w2", groups);
  return lt;
}

inline ModelTensors view_tensors(floatX* base, const Model& m) {
  ModelTensors t;
  t.wte = tensor_at(base, m, "wte");
  t.lnf = tensor_at(base, m, "lnf");
  t.lm_head = tensor_at(base, m, "lm_head");
  for (int l = 0; l < m.cfg.layers; l++) t.layers.push_back(layer_tensors(base, m, l));
  return t;
}

// The rank's parameter layout as config.hpp's functions take it.
inline ParamLayout model_param_layout(const Model& m) {
  return ParamLayout{m.offsets, m.local_numel, m.regions, m.num_params, m.vocab_first_row, m.spec_region};
}

// The local flat buffer (this rank's experts) from a global one in param_specs order.
inline std::vector<float> local_from_global(const Model& m, const std::vector<float>& global) {
  return local_from_global(m.specs, model_param_layout(m), m.par.ep.rank, global);
}

// The compute stream waits for the update's group g (and every group before it), once per update
// (--overlap_update, runtime/update_stream.cuh).
inline void model_wait_update(Model& m, int g) { m.update.wait(m.stream, g); }

// The compute stream waits for the whole update: before anything but a pass reads the weights, the
// optimizer's state or the gradients.
inline void model_join_update(Model& m) { m.update.join(m.stream); }

// Sets the weights from this rank's host fp32 weights in its local flat layout: the floatX copy of
// everything it holds, and the optimizer's fp32 master weights of its shards.
inline void model_set_local_master(Model& m, const std::vector<float>& local) {
  if (local.size() != m.num_params)
    fm_fail("model_set_local_master", "wrong number of parameters", "got=%zu expected=%zu", local.size(), m.num_params);
  model_join_update(m);
  float* staging = pool().alloc_t<float>(m.num_params, Mem::Workspace, "set_master");
  copy_to_device(staging, local.data(), m.num_params * sizeof(float), m.stream, "model_set_local_master");
  convert(m.params, staging, m.num_params, m.stream);
  m.opt->set_master(staging, m.stream);
  stream_wait(m.stream, "model_set_local_master", "P=%zu", m.num_params);
  pool().free(staging);
}

// Sets the weights from global host fp32 master weights (param_specs order, all experts).
inline void model_set_master(Model& m, const std::vector<float>& global) {
  if (global.size() != param_count(m.cfg))
    fm_fail("model_set_master", "wrong number of parameters", "got=%zu expected=%zu", global.size(), param_count(m.cfg));
  model_set_local_master(m, local_from_global(m, global));
}

// The first element of the local buffers that a pass's gradients (grads) cover: 0, or under --zero 3 the
// first region after the gathered groups' shards (their gradients live in the groups' own buffers).
inline size_t pass_grads_first(const Model& m) {
  for (const ParamRegion& r : m.regions)
    if (!r.gathered) return r.offset;
  return m.num_params;
}

// Zeroes a step's gradients (both buffers in the BF16 build) and per-expert loads.
// main_grads_too = false (a training step): only what the step's passes add into. In the BF16 build
// that is nothing: the step's first pass sets main_grads (=) (PassOptions.first_of_step), and the
// floatX grads are zero already (zeroed here once, then after every pass by its fold, or by
// model_update where the step skipped the fold). In the FP32 build the two are one buffer, which the
// passes add into.
inline void model_zero_grads(Model& m, bool main_grads_too = true) {
  if (main_grads_too) model_join_update(m);  // (a step's start zeroes none that the update reads)
  const bool grads_are_main = (void*)m.main_grads == (void*)m.grads;
  if (main_grads_too || grads_are_main)
    cudaCheck(cudaMemsetAsync(m.grads, 0, m.num_params * sizeof(floatX), m.stream), "zero_grads", "P=%zu", m.num_params);
  // --zero 3: the gathered regions' shards of main_grads, which every pass adds into (Zero3Weights::grads_end)
  const size_t zeroed = main_grads_too ? m.num_params : pass_grads_first(m);
  if (!grads_are_main && zeroed > 0)
    cudaCheck(cudaMemsetAsync(m.main_grads, 0, zeroed * sizeof(float), m.stream), "zero_grads", "main P=%zu", zeroed);
  if (m.step_loads_dev)
    cudaCheck(cudaMemsetAsync(m.step_loads_dev, 0, m.step_loads.size() * sizeof(int), m.stream), "zero_grads", "L*E=%zu",
              m.step_loads.size());
  std::fill(m.step_loads.begin(), m.step_loads.end(), 0);
}

// After a pass: main_grads += grads in fp32 (first: main_grads = grads, exact, so that they need no
// zeroing before), and grads back to zero for the next pass (BF16 build; in the FP32 build the two are
// one buffer, which keeps summing).
// Under --zero 3 only the regions after the gathered shards: the gathered groups' gradients went to their
// shards of main_grads already (grads_reduce).
inline void model_fold_grads(Model& m, bool first) {
  if ((void*)m.main_grads == (void*)m.grads) return;
  const size_t lo = pass_grads_first(m), n = m.num_params - lo;
  if (first) convert(m.main_grads + lo, m.grads + lo, n, m.stream);
  else add_inplace_or_out(m.main_grads + lo, m.main_grads + lo, m.grads + lo, n, m.stream);
  cudaCheck(cudaMemsetAsync(m.grads + lo, 0, n * sizeof(floatX), m.stream), "fold_grads", "P=%zu", n);
}

// --zero 3 (runtime/zero3.cuh): forward group g's views (its dense tensors) at its gathered weights and
// gradients, nullptr where they are not gathered. The embedding rides with layer 0; the final norm and a
// whole lm_head form group L.
inline void point_group_views(Model& m, int g) {
  const int G = (int)m.zero3.live.size(), L = m.cfg.layers;
  std::vector<floatX*> weights(G), grads(G);
  for (int i = 0; i < G; i++) {
    weights[i] = m.zero3.live[i].weights;
    grads[i] = m.zero3.live[i].grads;
  }
  if (g < L) {
    m.p.layers[g] = layer_tensors(m.params, m, g, weights);
    m.g.layers[g] = layer_tensors(m.grads, m, g, grads);
  }
  if (g == 0) {
    m.p.wte = tensor_at(m.params, m, "wte", weights);
    m.g.wte = tensor_at(m.grads, m, "wte", grads);
  }
  if (g == L) {
    m.p.lnf = tensor_at(m.params, m, "lnf", weights);
    m.g.lnf = tensor_at(m.grads, m, "lnf", grads);
    m.p.lm_head = tensor_at(m.params, m, "lm_head", weights);
    m.g.lm_head = tensor_at(m.grads, m, "lm_head", grads);
  }
}

// Forward group g's dense weights for what runs next, with group `next` (-1: none) prefetched beside it.
// Under ZeRO-1 every weight is always there: these four calls do nothing.
inline void weights_acquire(Model& m, int g, int next) {
  if (!m.zero3.on()) return;
  m.zero3.acquire(g, m.params, m.stream);
  if (next >= 0) m.zero3.prefetch(next, m.params, m.stream);
  point_group_views(m, g);
}

inline void weights_release(Model& m, int g) {
  if (!m.zero3.on()) return;
  m.zero3.release(g);
  point_group_views(m, g);
}

// Group g's weight gradients (+=) into a zeroed buffer of their own for its backward.
inline void grads_acquire(Model& m, int g) {
  if (!m.zero3.on()) return;
  m.zero3.grads_begin(g, m.stream);
  point_group_views(m, g);
}

// Group g's backward is queued: its weight gradients, once their stream has joined, summed over the ranks
// into this rank's shard of main_grads.
inline void grads_reduce(Model& m, int g) {
  if (!m.zero3.on()) return;
  m.wgrad->join(m.stream, "grads_reduce");
  m.zero3.grads_end(g, m.main_grads, m.stream);
  point_group_views(m, g);
}

inline void model_upload_router_bias(Model& m) {
  if (m.router_bias.empty()) return;
  copy_to_device(m.router_bias_dev, m.router_bias.data(), m.router_bias.size() * sizeof(float), m.stream, "router_bias");
}

// The local flat buffer's layout (config.hpp: param_layout) for this rank's groups.
inline void model_layout(Model& m) {
  ParamLayout layout = param_layout(m.specs, m.par.ep.size, RegionGroup{m.par.world.size, m.par.world.rank},
                                    RegionGroup{m.par.expert_replicas.size, m.par.expert_replicas.rank},
                                    VocabSplit{m.par.vocab.size, m.par.vocab.rank,
                                               RegionGroup{m.par.vocab_replicas.size, m.par.vocab_replicas.rank}},
                                    m.par.zero == 3);
  m.offsets = std::move(layout.offsets);
  m.spec_region = std::move(layout.region);
  m.local_numel = std::move(layout.local_numel);
  m.regions = std::move(layout.regions);
  m.num_params = layout.num_params;
  m.vocab_first_row = layout.vocab_first_row;
}

// The MoE dispatcher that seams.moe names ("": local at E_p = 1, else ep), where this layout gives
// what it needs (validate(TrainConfig) has refused what a run cannot use).
inline std::unique_ptr<MoEDispatcher> make_dispatcher(const ModelConfig& c, const Parallel& par, const Seams& seams) {
  const std::string moe = seams.moe.empty() ? (par.ep.size == 1 ? "local" : "ep") : seams.moe;
  const SeamChoice* choice = find_choice(moe_choices(), moe);
  if (choice == nullptr) fm_fail("model_create", ("--moe " + moe + " is not a registered dispatcher").c_str(), "W=%d", par.world.size);
  if ((choice->needs == SeamNeeds::EveryExpert && par.ep.size != 1) || (choice->needs == SeamNeeds::ExpertGroup && par.world.size == 1))
    fm_fail("model_create",
            ("--moe " + moe + " does not fit this layout (" +
             (choice->needs == SeamNeeds::EveryExpert ? "it needs E_p = 1" : "it needs W > 1") + ")").c_str(),
            "W=%d E_p=%d", par.world.size, par.ep.size);
  return factory_of(dispatcher_factories(), "--moe", moe).make(c, par.ep, seams);
}

// The output head that seams.head names, where this layout gives what it needs.
inline std::unique_ptr<OutputHead> make_head(const ModelConfig& c, const Parallel& par, const Seams& seams) {
  const SeamChoice* choice = find_choice(head_choices(), seams.head);
  if (choice == nullptr) fm_fail("model_create", ("--head " + seams.head + " is not a registered head").c_str(), "V=%d", c.vocab);
  if (choice->needs != SeamNeeds::VocabularyGroup && par.vocab.size != 1)
    fm_fail("model_create", ("--head " + seams.head + " does not fit this layout (it needs P = 1)").c_str(), "V=%d P=%d",
            c.vocab, par.vocab.size);
  return factory_of(head_factories(), "--head", seams.head).make(par.vocab, seams);
}

// An FFN of one route a token (every token to expert 0, width I: a dense layer's FFN at I = dense_dim,
// the shared expert at I = expert_dim) through the local dispatcher, in the routed experts' token chunks
// where those are local ones (--moe local --token_budget c), so that under a token budget nothing of
// the layer's FFNs grows with N beyond a chunk; else whole.
inline std::unique_ptr<LocalDispatcher> dense_ffn_dispatcher(const ModelConfig& c, int I, const MoEDispatcher& routed,
                                                             SideStream* weight_grads) {
  const auto* local = dynamic_cast<const LocalDispatcher*>(&routed);
  auto ffn = std::make_unique<LocalDispatcher>(c.hidden, I, 1, 1, local ? local->token_budget : 0, true);
  ffn->weight_grads = weight_grads;
  return ffn;
}

// The seams, from their names.
inline void model_make_seams(Model& m, const Seams& seams) {
  m.wgrad->set_on(seams.wgrad_stream);
  m.moe = make_dispatcher(m.cfg, m.par, seams);
  m.moe->weight_grads = m.wgrad.get();
  m.dense_ffn = dense_ffn_dispatcher(m.cfg, m.cfg.dense_dim, *m.moe, m.wgrad.get());
  m.shared_ffn = dense_ffn_dispatcher(m.cfg, m.cfg.expert_dim, *m.moe, m.wgrad.get());
  m.head = make_head(m.cfg, m.par, seams);
  size_t S = 0;
  std::vector<ShardSegment> segments = shard_segments(m.specs, model_param_layout(m), &S);
  m.opt = factory_of(optimizer_factories(), "--optimizer", seams.optimizer).make(std::move(segments), S, m.par.world.size, seams, m.stream);
  m.sco = std::make_unique<CheckpointOffload>(seams.offload_budget);
  m.attention_groups = seams.attention_groups;
}

// Why the model cannot be laid out over `par` ("" when it can): model_create refuses it; a test asks first,
// so that a configuration that does not fit its W fails the test rather than ending the binary.
inline std::string model_parallel_refusal(const ModelConfig& cfg, const Parallel& par) {
  if (cfg.experts % par.ep.size != 0)
    return "experts (" + std::to_string(cfg.experts) + ") must be divisible by the expert-parallel size (" +
           std::to_string(par.ep.size) + ")";
  if (par.seq.size > 1) return sequence_split_refusal(par.world.size, cfg.heads, cfg.seq_len, par.seq.size);
  if (par.zero != 1 && par.zero != 3) return "the ZeRO stage must be 1 or 3, got " + std::to_string(par.zero);
  if (par.zero == 3 && par.dense.size != par.world.size)
    return "--zero 3 gathers the dense weights over all " + std::to_string(par.world.size) +
           " ranks: its communicator (Parallel.dense) has " + std::to_string(par.dense.size);
  return "";
}

inline Model model_create(const ModelConfig& cfg, unsigned long long seed, const Parallel& par = Parallel(),
                          cudaStream_t stream = 0, const Seams& seams = Seams()) {
  validate(cfg);
  Model m;
  m.cfg = cfg;
  m.par = par;
  m.stream = stream;
  m.specs = param_specs(cfg);
  const std::string refused = model_parallel_refusal(cfg, par);
  if (!refused.empty()) fm_fail("model_create", refused.c_str(), "E=%d E_p=%d D=%d", cfg.experts, par.ep.size, par.seq.size);
  model_layout(m);
  if (par.zero == 3) m.zero3.init(m.par.dense, m.regions);
  const size_t P = m.num_params;
  m.params = pool().alloc_t<floatX>(P, Mem::Weights, "params");
  m.grads = pool().alloc_t<floatX>(P, Mem::Grads, "grads");
  if (std::is_same<floatX, float>::value) m.main_grads = reinterpret_cast<float*>(m.grads);  // FP32: one buffer
  else m.main_grads = pool().alloc_t<float>(P, Mem::Grads, "main_grads");
  model_zero_grads(m);
  model_make_seams(m, seams);
  m.p = view_tensors(m.params, m);
  m.g = view_tensors(m.grads, m);
  const size_t LE = (size_t)cfg.layers * cfg.experts;
  m.router_bias.assign(LE, 0.f);
  m.step_loads.assign(LE, 0);
  m.step_loads_dev = pool().alloc_t<int>(LE, Mem::Workspace, "step_loads");
  cudaCheck(cudaMemsetAsync(m.step_loads_dev, 0, LE * sizeof(int), m.stream), "model_create", "L*E=%zu", LE);
  m.router_bias_dev = pool().alloc_t<float>(LE, Mem::Weights, "router_bias");
  model_upload_router_bias(m);
  float* rope_cos_sin = pool().alloc_t<float>(rope_angles_bytes(cfg.seq_len, cfg.head_dim()) / sizeof(float),
                                               Mem::Workspace, "rope_angles");
  m.rope_angles = rope_angles_fill(rope_cos_sin, cfg.seq_len, cfg.head_dim(), cfg.rope_theta, m.stream);
  m.sumsq_partials = pool().alloc_t<float>(SUMSQ_BLOCKS, Mem::Workspace, "sumsq_partials");
  m.scalar_dev = pool().alloc_t<float>(1, Mem::Workspace, "scalar");
  m.grad_scale_dev = pool().alloc_t<float>(1, Mem::Workspace, "grad_scale");
  // each rank draws only what it holds; the same seed gives the same model at any W
  model_set_local_master(m, init_local_weights(cfg, m.specs, model_param_layout(m), par.ep.rank, seed));
  return m;
}

inline void model_destroy(Model& m) {
  model_join_update(m);  // the pool reuses the blocks in the compute stream's order
  m.update.destroy();
  m.wgrad->set_on(false);  // its cuBLAS workspace back to the pool
  if ((void*)m.main_grads != (void*)m.grads) pool().free(m.main_grads);
  for (void* p : {(void*)m.params, (void*)m.grads, (void*)m.router_bias_dev, (void*)m.step_loads_dev,
                  (void*)m.rope_angles.cos_sin, (void*)m.sumsq_partials, (void*)m.scalar_dev, (void*)m.grad_scale_dev,
                  (void*)m.dense_idx, (void*)m.dense_w})
    pool().free(p);
  m = Model();
}

// The trivial routing buffers (token → expert 0, weight 1) for N tokens.
inline void ensure_dense_routes(Model& m, int N) {
  if (m.dense_rows >= N) return;
  pool().free(m.dense_idx);
  pool().free(m.dense_w);
  m.dense_idx = pool().alloc_t<int>(N, Mem::Workspace, "dense_routes_idx");
  m.dense_w = pool().alloc_t<float>(N, Mem::Workspace, "dense_routes_w");
  dense_routes(m.dense_idx, m.dense_w, N, m.stream);
  m.dense_rows = N;
}

// =============================================================================================
// Forward

// What one layer's backward needs, kept from its forward (or recomputed).
struct LayerActs {
  floatX* ln1 = nullptr;        // [N, H]
  float* ln1_rstd = nullptr;    // [N]
  floatX* qkv = nullptr;        // [N, 3H] after RoPE; under --sp D the head shard [B, T·D, 3, nh/D, hd] (as many)
  floatX* att = nullptr;        // [N, H] attention output (before wo)
  floatX* att_heads = nullptr;  // --sp D > 1: the same output in the head shard [B, T·D, nh/D, hd], attention's own
  float* lse = nullptr;         // [B, nh, T]; under --sp D [B, nh/D, T·D] (as many)
  floatX* x_mid = nullptr;      // [N, H] residual after attention
  floatX* ln2 = nullptr;        // [N, H]
  float* ln2_rstd = nullptr;    // [N]
  float* scores = nullptr;      // [N, E] router scores (MoE layers)
  int* topk_idx = nullptr;      // [N, k]
  float* topk_w = nullptr;      // [N, k]
  std::unique_ptr<DispatchSaved> routed;  // the dispatcher's saved state (MoE layers)
  std::unique_ptr<DispatchSaved> dense;   // the dense FFN's (dense layers)
  std::unique_ptr<DispatchSaved> shared;  // the shared expert's (MoE layers with one)
};

// Frees what a layer's FFN part keeps (x_mid on): once its backward is done (attention in head groups frees
// it before attention's backward), or with the rest of the layer (free_acts).
inline void free_ffn_acts(LayerActs& a) {
  for (void* p : {(void*)a.x_mid, (void*)a.ln2, (void*)a.ln2_rstd, (void*)a.scores, (void*)a.topk_idx, (void*)a.topk_w})
    pool().free(p);
  a.x_mid = a.ln2 = nullptr;
  a.ln2_rstd = a.scores = a.topk_w = nullptr;
  a.topk_idx = nullptr;
  a.routed.reset();
  a.dense.reset();
  a.shared.reset();
}

// Frees a layer's activations, except the attention tensors that selective attention recomputation
// keeps for the backward (ops/sar_plan.hpp: core = att (+ att_heads) + lse, projection = ln1 + ln1_rstd + qkv).
inline void free_acts(LayerActs& a, bool keep_core = false, bool keep_projection = false) {
  LayerActs kept;
  if (keep_core) std::swap(kept.att, a.att), std::swap(kept.att_heads, a.att_heads), std::swap(kept.lse, a.lse);
  if (keep_projection) std::swap(kept.ln1, a.ln1), std::swap(kept.ln1_rstd, a.ln1_rstd), std::swap(kept.qkv, a.qkv);
  for (void* p : {(void*)a.ln1, (void*)a.ln1_rstd, (void*)a.qkv, (void*)a.att, (void*)a.att_heads, (void*)a.lse})
    pool().free(p);
  free_ffn_acts(a);
  a = std::move(kept);
}

// The layer-boundary seam (notes/design.md §1.1): input[l] is layer l's input, input[L] the final hidden
// state; each lives from the step that writes it until its layer's backward (the only activation kept
// across the whole pass under recomputation). Given an offload (SCO, ops/sco.cuh: a training pass
// under recomputation), the boundaries of its plan leave the device once their layer's forward is
// issued and come back, prefetched, one layer before their recomputation; without one all stay.
struct LayerBoundaries {
  std::vector<floatX*> input;  // [L + 1] × [N, H], nullptr while not on the device   (Checkpoints)
  LayerBoundaries(int L, size_t NH, cudaStream_t stream, CheckpointOffload* offload = nullptr)
      : input(L + 1, nullptr), elements(NH), stream(stream), offload(offload),
        plan(offload ? &offload->plan_for(L, NH) : nullptr) {}
  // input[l] on the device, before the step that writes it (the embedding, layer l − 1's forward).
  floatX* allocate(int l) {
    input[l] = pool().alloc_t<floatX>(elements, Mem::Checkpoints, "residual");
    return input[l];
  }
  // Forward: layer l has been issued, the last reader of input[l] until its backward.
  void after_forward(int l) {
    if (!offloaded(l)) return;
    offload->to_host(l, input[l], stream);
    input[l] = nullptr;
  }
  // Backward, before layer l is recomputed: input[l] on the device for the compute stream, and the
  // prefetch of input[l − 1] started.
  void before_backward(int l) {
    if (offloaded(l)) {
      if (input[l] == nullptr) input[l] = offload->prefetch(l, stream);  // the topmost of the set: nothing prefetched it
      offload->wait_arrived(l, stream);
    }
    if (l > 0 && offloaded(l - 1)) input[l - 1] = offload->prefetch(l - 1, stream);
  }
  void release(int l) {
    pool().free(input[l]);
    input[l] = nullptr;
  }
  ~LayerBoundaries() {
    for (floatX* x : input) pool().free(x);
  }
  LayerBoundaries(const LayerBoundaries&) = delete;
  LayerBoundaries& operator=(const LayerBoundaries&) = delete;

 private:
  bool offloaded(int l) const { return plan != nullptr && plan->offloaded[l]; }
  size_t elements;              // N·H
  cudaStream_t stream;          // the compute stream
  CheckpointOffload* offload;   // nullptr: every boundary stays on the device
  const ScoPlan* plan;          // offload's plan for this size
};

// Bytes a memory-bound step moves (runtime/profile.cuh's GB/s column), from its shapes: b = bytes per
// floatX. RMSNorm forward reads x, writes y and rstd; backward reads dy, x, rstd and writes dx (the
// gain's gradient is not counted), and reads dx too where it adds into it (a layer's residual
// stream); a residual add reads two [N,H] and writes one; RoPE rotates q and k in place.
inline double rmsnorm_fwd_bytes(size_t N, size_t H) { return 2.0 * N * H * sizeof(floatX) + 4.0 * N; }
inline double rmsnorm_bwd_bytes(size_t N, size_t H, bool accumulate) {
  return (accumulate ? 4.0 : 3.0) * N * H * sizeof(floatX) + 4.0 * N;
}
inline double residual_bytes(size_t N, size_t H) { return 3.0 * N * H * sizeof(floatX); }
inline double rope_bytes(size_t N, size_t H) { return 4.0 * N * H * sizeof(floatX); }

// Router of MoE layer l on ln2 (N×H), in FP32 in both builds (logits, scores, top-k, bias; its
// backward too): scores, top-k choice and weights into `a`; the choice of a routing profile, or of a
// replayed trace in a training pass, instead when one is set. Adds routes per expert into
// m.step_loads_dev when asked (on the device: no host wait inside the layer).
inline void router_step(Model& m, int l, LayerActs& a, int N, bool count_loads) {
  const ModelConfig& c = m.cfg;
  const int E = c.experts, k = c.topk;
  cudaStream_t s = m.stream;
  float* logits = pool().alloc_t<float>((size_t)N * E, Mem::Activations, "router_logits");  // FP32 in both builds
  a.scores = pool().alloc_t<float>((size_t)N * E, Mem::Activations, "router_scores");
  a.topk_idx = pool().alloc_t<int>((size_t)N * k, Mem::Activations, "topk_idx");
  a.topk_w = pool().alloc_t<float>((size_t)N * k, Mem::Activations, "topk_w");
  // a replayed trace records the MoE layers n_dense..L−1 in order (train.cu checked it fits this run)
  const int* traced = m.replay && m.training_pass >= 0 ? m.replay->at(m.training_pass, l - c.n_dense) : nullptr;
  if (traced && m.replay->per_layer != (size_t)N * k)
    fm_fail("router_step", "the routing trace holds another number of routes per layer", "N=%d k=%d trace=%zu", N, k,
            m.replay->per_layer);
  const bool chosen_elsewhere = m.routing_override || traced;
  int* loads = count_loads ? m.step_loads_dev + (size_t)l * E : nullptr;
  router_logits_forward(logits, a.ln2, m.p.layers[l].router, N, c.hidden, E, s);
  router_forward(a.topk_idx, a.topk_w, a.scores, logits, m.router_bias_dev + (size_t)l * E, N, E, k, c.score_fn,
                 c.renorm != 0, s, chosen_elsewhere ? nullptr : loads);  // the router's own choice counts itself
  pool().free(logits);
  if (chosen_elsewhere) {  // the trace's experts (from the host) or the profile's (made on the device), weighted
                           // by the router's scores for them
    if (traced) copy_to_device(a.topk_idx, traced, (size_t)N * k * sizeof(int), s, "routing_trace");
    else router_profile_choice(a.topk_idx, m.routing, N, E, k, s);
    router_weights(a.topk_w, a.scores, a.topk_idx, N, E, k, c.renorm != 0, s);
    if (loads) router_add_loads(loads, a.topk_idx, N, E, k, s);
  }
}

// FFN of layer l on ln2 (N×H) onto the residual stream: out (N×H, =) = residual + FFN(ln2), a dense
// SwiGLU, or router + routed experts through the dispatcher (+ the shared expert), each adding into the
// stream in its combine. out = nullptr: only what backward needs (a recomputation).
inline void ffn_forward(Model& m, int l, LayerActs& a, floatX* out, const floatX* residual, int N, bool count_loads) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  cudaStream_t s = m.stream;
  if (!c.is_moe_layer(l)) {
    ensure_dense_routes(m, N);
    prof_mark(s, "dense ffn fwd");
    a.dense = m.dense_ffn->forward_residual(out, residual, a.ln2, m.dense_idx, m.dense_w, P.dense_w13, P.dense_w2, N, s);
    return;
  }
  prof_mark(s, "router fwd");
  router_step(m, l, a, N, count_loads);
  prof_mark(s, "dispatcher fwd");
  a.routed = m.moe->forward_residual(out, residual, a.ln2, a.topk_idx, a.topk_w, P.w13, P.w2, N, s);
  if (c.shared_expert) {
    ensure_dense_routes(m, N);
    prof_mark(s, "shared expert fwd");
    a.shared = m.shared_ffn->forward_residual(out, out, a.ln2, m.dense_idx, m.dense_w, P.shared_w13, P.shared_w2, N,
                                             s);  // added into out in place
  }
}

// Attention in head groups (--attention_groups G > 1; whole sequences on this rank): the nh heads taken
// h = nh/G at a time, so that a layer's q, k, v and their gradients live one group at a time. Attention is
// independent per head, and every kernel takes any nh: group g is a compact [B, T, 3, h, hd] qkv made by
// three GEMMs on its rows of wqkv (j·H + g·h·hd .. for j = q, k, v), rotated by RoPE, and its output
// [B, T, h, hd] goes into att's columns g·h·hd .. (att [N, H] whole, so wo stays one GEMM and x_mid the
// bits of one rounding). What the layer keeps for its backward: att and lse ([G][B, h, T]), x_mid, ln2
// and the FFN's — not ln1 or qkv, which attention_groups_backward rebuilds (one RMSNorm; each group's
// three GEMMs and RoPE again). Live in the backward (layer_backward): the FFN's part as always (d_ln2
// beside d_x, att, x_mid and ln2), then, once it has joined and its tensors are gone, d_x, att, ln1 and
// d_ln1 (fp32: the 3G products sum into it unrounded) beside one group's qkv, output, d_att and d_qkv
// (8·N·H/G elements): about 5 N·H·b in all against 12 with every head at once (notes/composed_stack.md).
// The price: the q, k, v GEMMs once more, in thinner pieces, and ln1's norm once more.

// Group g's q, k, v [B, T, 3, h, hd] (=) from ln1 [N, H], with RoPE.
inline void attention_group_qkv(Model& m, int l, floatX* qkv_g, const floatX* ln1, int g, int B, int T) {
  const ModelConfig& c = m.cfg;
  const int N = B * T, H = c.hidden, G = m.attention_groups, hg = H / G;
  for (int j = 0; j < 3; j++)  // columns j·hg .. of qkv_g [N, 3·hg] = ln1 · (rows j·H + g·hg .. of wqkv)ᵀ
    matmul_gemm("attention_groups.qkv", CUBLAS_OP_T, CUBLAS_OP_N, hg, N, H, m.p.layers[l].wqkv + ((size_t)j * H + (size_t)g * hg) * H,
                H, ln1, H, 0.0f, qkv_g + (size_t)j * hg, 3 * hg, N, H, 3 * hg, m.stream);
  rope_forward(qkv_g, qkv_g, m.rope_angles, B, T, c.heads / G, c.head_dim(), m.stream);
}

// Columns g·hg .. (g + 1)·hg of att [N, H] (=) from group g's output att_g [N, hg], or back (to_group).
inline void attention_group_columns(floatX* att, floatX* att_g, int g, int N, int H, int hg, bool to_group, cudaStream_t s) {
  const size_t b = sizeof(floatX);
  floatX* whole = att + (size_t)g * hg;
  cudaCheck(to_group ? cudaMemcpy2DAsync(att_g, hg * b, whole, H * b, hg * b, N, cudaMemcpyDeviceToDevice, s)
                     : cudaMemcpy2DAsync(whole, H * b, att_g, hg * b, hg * b, N, cudaMemcpyDeviceToDevice, s),
            "attention_groups.columns", "N=%d H=%d group=%d of width %d", N, H, g, hg);
}

// The attention step in head groups: x_in → ln1 → each group's q, k, v → its attention into att's columns;
// att and lse stay in `a`, ln1 goes.
inline void attention_groups_forward(Model& m, int l, LayerActs& a, const floatX* x_in, int B, int T) {
  const ModelConfig& c = m.cfg;
  const int N = B * T, H = c.hidden, G = m.attention_groups, h = c.heads / G, hg = H / G;
  cudaStream_t s = m.stream;
  a.ln1 = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "ln1");
  a.ln1_rstd = pool().alloc_t<float>(N, Mem::Activations, "ln1_rstd");
  prof_mark(s, "rmsnorm fwd", rmsnorm_fwd_bytes(N, H));
  rmsnorm_forward(a.ln1, a.ln1_rstd, x_in, m.p.layers[l].ln1, N, H, c.norm_eps, s);
  a.att = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "att");
  a.lse = pool().alloc_t<float>((size_t)N * c.heads, Mem::Activations, "att_lse");  // [G][B, h, T]
  for (int g = 0; g < G; g++) {
    floatX* qkv_g = pool().alloc_t<floatX>((size_t)N * 3 * hg, Mem::Activations, "qkv_group");
    floatX* att_g = pool().alloc_t<floatX>((size_t)N * hg, Mem::Activations, "att_group");
    prof_mark(s, "qkv matmul + rope fwd (head group)");
    attention_group_qkv(m, l, qkv_g, a.ln1, g, B, T);
    prof_mark(s, "attention fwd (head group)");
    attention_forward(att_g, a.lse + (size_t)g * N * h, qkv_g, B, T, h, c.head_dim(), s);
    attention_group_columns(a.att, att_g, g, N, H, hg, false, s);
    pool().free(qkv_g);
    pool().free(att_g);
  }
  pool().free(a.ln1);
  pool().free(a.ln1_rstd);
  a.ln1 = nullptr;
  a.ln1_rstd = nullptr;
}

// The attention step (notes/design.md §1.1): x_in (N×H) → ln1 → q, k, v with RoPE (a.qkv) → att (N×H,
// before wo). It computes what `a` does not hold yet: a recomputation under selective attention
// recomputation (ops/sar_plan.hpp) finds ln1, ln1_rstd and qkv (projection) and/or att and lse (core)
// kept from the forward.
// `seq`: the ranks that share each of the B sequences (--sp D = seq.size; notes/sequence_parallel.md).
// x_in holds this rank's T tokens of each, [r·T, (r+1)·T) of T·D. With D > 1 the projected q, k, v
// [B, T, 3, nh, hd] go through ulysses_to_heads to the head shard [B, T·D, 3, nh/D, hd] (a.qkv): every
// token of the rank's nh/D heads, so RoPE there rotates each at its global position and attention runs
// on whole sequences; its output [B, T·D, nh/D, hd] (a.att_heads, which attention's backward reads)
// comes back by ulysses_to_sequence as a.att [B, T, nh, hd], which wo reads. A recomputation reruns the
// exchanges: they are permutations, so it rebuilds the same bits. D = 1: no exchange.
inline void attention_step(Model& m, int l, LayerActs& a, const floatX* x_in, int B, int T, const Comm& seq) {
  if (m.attention_groups > 1) return attention_groups_forward(m, l, a, x_in, B, T);
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  const int N = B * T, H = c.hidden, D = seq.size, T_seq = T * D, heads_here = c.heads / D, hd = c.head_dim();
  cudaStream_t s = m.stream;
  if (a.qkv == nullptr) {
    a.ln1 = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "ln1");
    a.ln1_rstd = pool().alloc_t<float>(N, Mem::Activations, "ln1_rstd");
    a.qkv = pool().alloc_t<floatX>((size_t)N * 3 * H, Mem::Activations, "qkv");
    // [B, T, 3, nh, hd]: this rank's tokens, every head (D > 1: until the exchange has read them)
    floatX* projected = D == 1 ? a.qkv : pool().alloc_t<floatX>((size_t)N * 3 * H, Mem::Activations, "qkv_tokens");
    prof_mark(s, "rmsnorm fwd", rmsnorm_fwd_bytes(N, H));
    rmsnorm_forward(a.ln1, a.ln1_rstd, x_in, P.ln1, N, H, c.norm_eps, s);
    prof_mark(s, "qkv matmul fwd");
    matmul_forward(projected, a.ln1, P.wqkv, N, H, 3 * H, s);
    if (D > 1) {
      prof_mark(s, "ulysses to heads (q, k, v)");
      ulysses_to_heads(a.qkv, projected, B, T_seq, 3, c.heads, hd, seq, s);
      pool().free(projected);
    }
    prof_mark(s, "rope fwd", rope_bytes(N, H));
    rope_forward(a.qkv, a.qkv, m.rope_angles, B, T_seq, heads_here, hd, s);
  }
  if (a.att == nullptr) {
    a.att = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "att");
    if (D > 1) a.att_heads = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "att_heads");
    a.lse = pool().alloc_t<float>((size_t)N * c.heads, Mem::Activations, "att_lse");
    prof_mark(s, "attention fwd");
    attention_forward(D == 1 ? a.att : a.att_heads, a.lse, a.qkv, B, T_seq, heads_here, hd, s);
    if (D > 1) {
      prof_mark(s, "ulysses to sequence (attention output)");
      ulysses_to_sequence(a.att, a.att_heads, B, T_seq, 1, c.heads, hd, seq, s);
    }
  }
}

// One transformer layer: x_out = x_mid + FFN(ln2(x_mid)), x_mid = x_in + wo·Attn(RoPE(wqkv·ln1(x_in))).
// x_out = nullptr: a recomputation, whose output is already kept (the next layer's boundary): the
// FFN rebuilds only what its backward needs, and a dispatcher that recomputes in its own backward
// (--moe pllep, relay) only plans.
inline void layer_forward(Model& m, int l, const floatX* x_in, floatX* x_out, LayerActs& a, int B, int T, const Comm& seq,
                          bool count_loads) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  const int N = B * T, H = c.hidden;
  cudaStream_t s = m.stream;
  ProfPrefix recompute_names(x_out ? "" : "recompute ");  // runtime/profile.cuh: a recomputation's ranges
  attention_step(m, l, a, x_in, B, T, seq);
  a.x_mid = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "x_mid");
  a.ln2 = pool().alloc_t<floatX>((size_t)N * H, Mem::Activations, "ln2");
  a.ln2_rstd = pool().alloc_t<float>(N, Mem::Activations, "ln2_rstd");
  prof_mark(s, "wo matmul fwd + residual add");
  matmul_forward_residual(a.x_mid, x_in, a.att, P.wo, N, H, H, s);

  prof_mark(s, "rmsnorm fwd", rmsnorm_fwd_bytes(N, H));
  rmsnorm_forward(a.ln2, a.ln2_rstd, a.x_mid, P.ln2, N, H, c.norm_eps, s);
  ffn_forward(m, l, a, x_out, a.x_mid, N, count_loads);  // x_out = x_mid + FFN(ln2)
}

// =============================================================================================
// Backward

// d_ln2 (=) from d_out (gradient of the FFN output); weight gradients +=.
inline void ffn_backward(Model& m, int l, const LayerActs& a, floatX* d_ln2, const floatX* d_out, int N) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  const LayerTensors& G = m.g.layers[l];
  cudaStream_t s = m.stream;
  const size_t NH = (size_t)N * c.hidden;
  if (!c.is_moe_layer(l)) {
    float* d_dense_w = pool().alloc_t<float>(N, Mem::Workspace, "d_dense_w");
    prof_mark(s, "dense ffn bwd");
    m.dense_ffn->backward(d_ln2, d_dense_w, G.dense_w13, G.dense_w2, d_out, *a.dense, a.ln2, m.dense_idx, m.dense_w,
                          P.dense_w13, P.dense_w2, s);
    pool().free(d_dense_w);
    return;
  }
  const int E = c.experts, k = c.topk;
  float* d_topk_w = pool().alloc_t<float>((size_t)N * k, Mem::Workspace, "d_topk_w");
  prof_mark(s, "dispatcher bwd");
  m.moe->backward(d_ln2, d_topk_w, G.w13, G.w2, d_out, *a.routed, a.ln2, a.topk_idx, a.topk_w, P.w13, P.w2, s);
  if (c.shared_expert) {
    floatX* d_part = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_ln2_part");
    float* d_shared_w = pool().alloc_t<float>(N, Mem::Workspace, "d_shared_w");
    prof_mark(s, "shared expert bwd");
    m.shared_ffn->backward(d_part, d_shared_w, G.shared_w13, G.shared_w2, d_out, *a.shared, a.ln2, m.dense_idx,
                           m.dense_w, P.shared_w13, P.shared_w2, s);
    prof_mark(s, "residual add", residual_bytes(N, c.hidden));
    add_inplace_or_out(d_ln2, d_ln2, d_part, NH, s);
    pool().free(d_shared_w);
    pool().free(d_part);
  }
  float* d_logits = pool().alloc_t<float>((size_t)N * E, Mem::Workspace, "d_router_logits");
  prof_mark(s, "router bwd");
  router_backward(d_logits, d_topk_w, a.scores, a.topk_idx, N, E, k, c.score_fn, c.renorm != 0, s);
  router_logits_backward(d_ln2, G.router, d_logits, a.ln2, P.router, N, c.hidden, E, s, m.wgrad.get());  // d_ln2 +=
  pool().free(d_topk_w);
  m.wgrad->hold(d_logits);  // the FP32 build's ΔW reads it beside
}

// The backward of a linear layer y = x·Wᵀ: dx (=) dout·W on the compute stream, and dW (+=) doutᵀ·x
// beside it on the weight-gradient stream (dout and x must stay until the layer's join).
inline void linear_backward(Model& m, floatX* dx, floatX* dW, const floatX* dout, const floatX* x, const floatX* W,
                            int N, int IC, int OC) {
  m.wgrad->run(m.stream, "linear_backward.dW", [&](cudaStream_t ws) { matmul_backward_dW(dW, dout, x, N, IC, OC, ws); });
  matmul_backward_dx(dx, dout, W, N, IC, OC, m.stream);
}

// The attention step's backward: d_qkv [N, 3H] (=) from d_att [N, H], RoPEᵀ in attention's stores (the
// gradients of q and k before RoPE). Under --sp D > 1 it mirrors attention_step's exchanges: d_att goes
// to the head shard by ulysses_to_heads (the backward of ulysses_to_sequence), attention's backward runs
// on whole sequences of nh/D heads, and d_qkv comes back by ulysses_to_sequence (the backward of
// ulysses_to_heads).
inline void attention_step_backward(Model& m, const LayerActs& a, floatX* d_qkv, const floatX* d_att, int B, int T,
                                    const Comm& seq) {
  const ModelConfig& c = m.cfg;
  const int N = B * T, H = c.hidden, D = seq.size, T_seq = T * D, heads_here = c.heads / D, hd = c.head_dim();
  cudaStream_t s = m.stream;
  if (D == 1) {
    prof_mark(s, "attention bwd (+ rope bwd)");
    attention_backward(d_qkv, d_att, a.qkv, a.att, a.lse, B, T, c.heads, hd, s, m.rope_angles);
    return;
  }
  floatX* d_att_heads = pool().alloc_t<floatX>((size_t)N * H, Mem::Workspace, "d_att_heads");  // [B, T·D, nh/D, hd]
  prof_mark(s, "ulysses to heads (attention output grad)");
  ulysses_to_heads(d_att_heads, d_att, B, T_seq, 1, c.heads, hd, seq, s);
  floatX* d_qkv_heads = pool().alloc_t<floatX>((size_t)N * 3 * H, Mem::Workspace, "d_qkv_heads");  // [B, T·D, 3, nh/D, hd]
  prof_mark(s, "attention bwd (+ rope bwd)");
  attention_backward(d_qkv_heads, d_att_heads, a.qkv, a.att_heads, a.lse, B, T_seq, heads_here, hd, s, m.rope_angles);
  pool().free(d_att_heads);
  prof_mark(s, "ulysses to sequence (q, k, v grads)");
  ulysses_to_sequence(d_qkv, d_qkv_heads, B, T_seq, 3, c.heads, hd, seq, s);
  pool().free(d_qkv_heads);
}

// Attention's backward in head groups (attention_groups_forward), d_x holding d_x_mid: the FFN's part has
// joined and its tensors are gone. ln1 again from x_in; per group its q, k, v again, its output from att's
// columns, d_att_g = d_x_mid · wo's columns, wo's columns' dW, attention's backward, and into d_ln1 (fp32)
// and wqkv's rows' dW; the group's weight gradients join before its buffers go. Then ln1's norm into d_x.
inline void attention_groups_backward(Model& m, int l, LayerActs& a, const floatX* x_in, floatX* d_x, int B, int T) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  const LayerTensors& G = m.g.layers[l];
  const int N = B * T, H = c.hidden, groups = m.attention_groups, h = c.heads / groups, hg = H / groups;
  const size_t NH = (size_t)N * H;
  cudaStream_t s = m.stream;
  a.ln1 = pool().alloc_t<floatX>(NH, Mem::Activations, "ln1");
  a.ln1_rstd = pool().alloc_t<float>(N, Mem::Activations, "ln1_rstd");
  prof_mark(s, "rmsnorm fwd (ln1 again)", rmsnorm_fwd_bytes(N, H));
  rmsnorm_forward(a.ln1, a.ln1_rstd, x_in, P.ln1, N, H, c.norm_eps, s);
  float* d_ln1_sum = pool().alloc_t<float>(NH, Mem::Workspace, "d_ln1_sum");  // Σ over groups and q, k, v
  for (int g = 0; g < groups; g++) {
    floatX* qkv_g = pool().alloc_t<floatX>((size_t)N * 3 * hg, Mem::Activations, "qkv_group");
    floatX* att_g = pool().alloc_t<floatX>((size_t)N * hg, Mem::Activations, "att_group");
    floatX* d_att_g = pool().alloc_t<floatX>((size_t)N * hg, Mem::Workspace, "d_att_group");
    floatX* d_qkv_g = pool().alloc_t<floatX>((size_t)N * 3 * hg, Mem::Workspace, "d_qkv_group");
    prof_mark(s, "qkv matmul + rope fwd (head group again)");
    attention_group_qkv(m, l, qkv_g, a.ln1, g, B, T);
    attention_group_columns(a.att, att_g, g, N, H, hg, true, s);
    prof_mark(s, "wo matmul bwd (head group)");
    const floatX* wo_columns = P.wo + (size_t)g * hg;  // wo [H, H]: columns g·hg .. of every row
    matmul_gemm("attention_groups.wo.dx", CUBLAS_OP_N, CUBLAS_OP_N, hg, N, H, wo_columns, H, (const floatX*)d_x, H, 0.0f,
                d_att_g, hg, N, H, hg, s);
    m.wgrad->run(s, "attention_groups.wo.dW", [&](cudaStream_t ws) {  // dW_wo[:, group's columns] += d_x_midᵀ · att_g
      matmul_gemm("attention_groups.wo.dW", CUBLAS_OP_N, CUBLAS_OP_T, hg, H, N, (const floatX*)att_g, hg, (const floatX*)d_x,
                  H, 1.0f, G.wo + (size_t)g * hg, H, N, H, hg, ws);
    });
    prof_mark(s, "attention bwd (+ rope bwd) (head group)");
    attention_backward(d_qkv_g, d_att_g, qkv_g, att_g, a.lse + (size_t)g * N * h, B, T, h, c.head_dim(), s, m.rope_angles);
    pool().free(qkv_g);
    pool().free(d_att_g);
    prof_mark(s, "qkv matmul bwd (head group)");
    for (int j = 0; j < 3; j++) {  // q, k, v: rows j·H + g·hg .. of wqkv
      const size_t rows = (size_t)j * H + (size_t)g * hg;
      const floatX* d_part = d_qkv_g + (size_t)j * hg;  // [N, hg] of stride 3·hg
      matmul_gemm<floatX, float>("attention_groups.qkv.dx", CUBLAS_OP_N, CUBLAS_OP_N, H, N, hg, P.wqkv + rows * H, H, d_part,
                                 3 * hg, g == 0 && j == 0 ? 0.0f : 1.0f, d_ln1_sum, H, N, H, hg, s);
      m.wgrad->run(s, "attention_groups.qkv.dW", [&](cudaStream_t ws) {  // dW_wqkv[rows, :] += d_partᵀ · ln1
        matmul_gemm("attention_groups.qkv.dW", CUBLAS_OP_N, CUBLAS_OP_T, H, hg, N, (const floatX*)a.ln1, H, d_part, 3 * hg,
                    1.0f, G.wqkv + rows * H, H, N, H, hg, ws);
      });
    }
    m.wgrad->hold(att_g);
    m.wgrad->hold(d_qkv_g);
    prof_mark(s, "weight gradients (join)");
    m.wgrad->join(s, "attention_groups_backward");  // the group's buffers go before the next group's come
  }
  pool().free(a.att);
  pool().free(a.lse);
  a.att = nullptr;
  a.lse = nullptr;
  floatX* d_ln1 = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_ln1");
  convert(d_ln1, d_ln1_sum, NH, s);  // rounded once (FP32 build: a copy)
  pool().free(d_ln1_sum);
  prof_mark(s, "rmsnorm bwd", rmsnorm_bwd_bytes(N, H, true));
  rmsnorm_backward(d_x, G.ln1, d_ln1, x_in, P.ln1, a.ln1_rstd, N, H, s, /*accumulate=*/true, m.wgrad.get());
  pool().free(d_ln1);
}

// d_x (in: gradient of the layer output; out: gradient of the layer input).
inline void layer_backward(Model& m, int l, LayerActs& a, const floatX* x_in, floatX* d_x, int B, int T, const Comm& seq) {
  const ModelConfig& c = m.cfg;
  const LayerTensors& P = m.p.layers[l];
  const LayerTensors& G = m.g.layers[l];
  const int N = B * T, H = c.hidden;
  const size_t NH = (size_t)N * H;
  cudaStream_t s = m.stream;
  const bool groups = m.attention_groups > 1;
  floatX* d_norm_out = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_norm_out");
  floatX* d_qkv = groups ? nullptr : pool().alloc_t<floatX>((size_t)N * 3 * H, Mem::Workspace, "d_qkv");

  // FFN branch: d_x_mid = d_x + ln2ᵀ(FFNᵀ(d_x))
  ffn_backward(m, l, a, d_norm_out, d_x, N);
  prof_mark(s, "rmsnorm bwd", rmsnorm_bwd_bytes(N, H, true));
  rmsnorm_backward(d_x, G.ln2, d_norm_out, a.x_mid, P.ln2, a.ln2_rstd, N, H, s, /*accumulate=*/true, m.wgrad.get());
  if (groups) {  // the FFN's part done and joined, its tensors freed, then attention group by group
    pool().free(d_norm_out);
    prof_mark(s, "weight gradients (join)");
    m.wgrad->join(s, "layer_backward");
    free_ffn_acts(a);
    attention_groups_backward(m, l, a, x_in, d_x, B, T);
    return;
  }

  // Attention branch: d_x_in = d_x_mid + ln1ᵀ(wqkvᵀ(RoPEᵀ(Attnᵀ(woᵀ d_x_mid))))
  prof_mark(s, "wo matmul bwd");
  linear_backward(m, d_norm_out, G.wo, d_x, a.att, P.wo, N, H, H);
  attention_step_backward(m, a, d_qkv, d_norm_out, B, T, seq);
  prof_mark(s, "qkv matmul bwd");
  linear_backward(m, d_norm_out, G.wqkv, d_qkv, a.ln1, P.wqkv, N, H, 3 * H);
  prof_mark(s, "weight gradients (join)");  // the layer's weight gradients done before d_x changes again
  m.wgrad->join(s, "layer_backward");
  prof_mark(s, "rmsnorm bwd", rmsnorm_bwd_bytes(N, H, true));
  // its dw's reduction joins at the next layer's join (or the pass's, after the last layer)
  rmsnorm_backward(d_x, G.ln1, d_norm_out, x_in, P.ln1, a.ln1_rstd, N, H, s, /*accumulate=*/true, m.wgrad.get());
  for (void* p : {(void*)d_norm_out, (void*)d_qkv}) pool().free(p);
}

// =============================================================================================
// The per-rank memory prediction (notes/design.md §6.9, paper Eq. 6)
//
// What the pool holds at the peak of a training micro-batch, from the configuration alone (before any
// allocation): the weights and the optimizer's shards, the gradients, the runtime's fixed buffers, the
// pass's inputs, the layer boundaries on the device (SCO's plan), what stays from the forward to the
// backward (every layer's activations without recomputation; the attention tensors that selective
// recomputation keeps), the final norm's output (at the head's moment only), one layer's working set
// in backward (its activations, rebuilt under recomputation, and the backward's own buffers) and the
// largest operator term — the dispatcher's bound (whatever the router does) in a layer's backward, or
// the output head's live set.
// The terms that are not live together are not added: the prediction is the larger of the moment the
// head runs and the moment each layer's backward runs (the peak of a pass is at one of them; the
// forward holds less, since nothing of the backward is live yet). It mirrors layer_forward and
// layer_backward above allocation by allocation; tests/gpu_memory_prediction.cu holds it to the pool's
// measured peak (>= it, and within 10 % where the router attains the dispatcher's bound).

// (MemoryTerm and MemoryPrediction: plan.hpp, which --plan auto searches with.)

// This rank's parameters of the optimizer's shard (S).
inline size_t rank_shard_params(const ModelConfig& c, const Parallel& par) {
  Model shape;  // the layout alone: nothing allocated
  shape.cfg = c;
  shape.par = par;
  shape.specs = param_specs(c);
  model_layout(shape);
  size_t S = 0;
  shard_segments(shape.specs, model_param_layout(shape), &S);
  return S;
}

// One training micro-batch of B×T tokens on this rank (--recompute, SCO's budget, the kept attention):
// under --sp D, T is the rank's slice of each sequence (T·D tokens), as model_pass takes it.
inline MemoryPrediction predict_rank_memory(const ModelConfig& c, const Parallel& par, const Seams& seams, int B, int T,
                                            bool recompute, const SarPlan* attention_kept = nullptr) {
  Model shape;  // the layout alone: nothing allocated
  shape.cfg = c;
  shape.par = par;
  shape.specs = param_specs(c);
  model_layout(shape);
  const size_t S = rank_shard_params(c, par);  // the rank's shard of the optimizer state
  const std::unique_ptr<MoEDispatcher> moe = make_dispatcher(c, par, seams);
  SideStream weight_grads;  // off: the same buffers held until the layer's join as on (runtime/side_stream.cuh)
  moe->weight_grads = &weight_grads;
  const std::unique_ptr<OutputHead> head = make_head(c, par, seams);
  const size_t b = sizeof(floatX), N = (size_t)B * T, H = c.hidden, L = c.layers, E = c.experts, k = c.topk;
  const int D = par.seq.size;  // --sp: the ranks that share each sequence
  const size_t NH = N * H, P = shape.num_params;
  const bool fp32_sum = !std::is_same<floatX, float>::value;  // main_grads beside grads in the BF16 build

  // alive the whole step
  const size_t weights = P * b + 4 * L * E;
  const size_t grads = P * b + (fp32_sum ? P * 4 : 0);
  const size_t optimizer = factory_of(optimizer_factories(), "--optimizer", seams.optimizer).device_bytes(seams, S);
  const bool dense_routes = c.n_dense > 0 || c.shared_expert;
  // + the sum of squares' partials and its two floats (scalar_dev, grad_scale_dev), the step's
  // per-expert loads on the device [L·E] ints (step_loads_dev), RoPE's angle table (rope_angles)
  // (+ the weight-gradient streams' own cuBLAS workspaces, --wgrad_stream 1)
  const size_t runtime = CublasRuntime::workspace_bytes * (1 + (seams.wgrad_stream ? SideStream::LANES : 0)) + 4 * (size_t)SUMSQ_BLOCKS + 8 +
                         (dense_routes ? 8 * N : 0) + 4 * L * E + rope_angles_bytes(c.seq_len, c.head_dim());
  // the pass: tokens, targets, the embedding backward's buckets (offsets V + 1, positions N, the count of
  // used ids and room for min(N, V) of them), the loss; the final norm's output and rstd at the head (the
  // output is freed after it, the rstd after the norm's backward: neither is live in a layer's backward)
  const size_t inputs = 8 * N + 4 * token_buckets_ints((int)N, c.vocab) + 4;
  const size_t final_norm = NH * b + 4 * N;

  // one layer (layer_forward's activations; attention_step's, then the FFN's)
  const DispatchBound routed = moe->live_bound((int)N);
  const DispatchBound shared =
      c.shared_expert ? dense_ffn_dispatcher(c, c.expert_dim, *moe, &weight_grads)->live_bound((int)N) : DispatchBound{};
  const DispatchBound dense = dense_ffn_dispatcher(c, c.dense_dim, *moe, &weight_grads)->live_bound((int)N);
  // ln1, ln1_rstd, qkv, att, lse (and att_heads under --sp D > 1: the output in the head shard); in head groups
  // (--attention_groups G > 1, attention_groups_forward) att and lse alone
  const int groups = seams.attention_groups;
  const size_t attention = groups > 1 ? NH * b + 4 * N * c.heads : (D == 1 ? 5 : 6) * NH * b + 4 * N + 4 * N * c.heads;
  auto acts = [&](int l) {
    const size_t common = attention + 2 * NH * b + 4 * N;  // x_mid, ln2, ln2_rstd
    if (!c.is_moe_layer(l)) return common + dense.saved;
    return common + 4 * N * E + 8 * N * k + routed.saved + shared.saved;  // scores, top-k indices and weights
  };
  // layer_backward's buffers beside the activations: d_norm_out, d_qkv; in the FFN's backward d_topk_w
  // and the largest of the routed experts' backward, the shared expert's (beside d_ln2_part and
  // d_shared_w) and the router's (d_router_logits, its workspace; its dx adds into d_ln2), each beside
  // what the steps before it hold for the weight-gradient stream until the layer's join (`held`; the
  // dense FFN's fits in its own peak)
  // Then, in the attention part, beside what the FFN's backward left held: the ln2 norm's dw partials
  // (held too) and attention's delta. A norm's dw partials stay held until the next layer's join, so
  // each layer's backward has the norm's above it (layer l + 1's ln1, or the final norm's) besides.
  // Under --sp D > 1 attention's backward works in the head shard (attention_step_backward): d_att_heads
  // (NH) and d_qkv_heads (3NH) beside delta, then d_qkv_heads beside the exchange of d_qkv back
  // (ulysses_staging_bytes, G = 3: 6NH); the exchanges of the forward and of d_att hold less.
  // In head groups the FFN's part has d_norm_out alone and ends with a join; attention's backward is a moment of
  // its own (below).
  const size_t backward_buffers = (groups > 1 ? 1 : 4) * NH * b;
  const size_t norm_partials = rmsnorm_backward_workspace_bytes((int)N, c.hidden);
  const size_t delta = 4 * N * c.heads;
  const size_t attention_backward =
      groups > 1 ? 0
      : D == 1   ? delta
                 : std::max(delta + 4 * NH * b, 3 * NH * b + ulysses_staging_bytes(B, T * D, 3, c.heads, c.head_dim(), D, b));
  auto operator_term = [&](int l) {
    if (!c.is_moe_layer(l)) return std::max(4 * N + dense.peak - dense.saved, dense.held + norm_partials + attention_backward);
    const size_t shared_step = c.shared_expert ? routed.held + NH * b + 4 * N + shared.peak - shared.saved : 0;
    const size_t router_step =
        routed.held + shared.held + 4 * N * E + router_logits_workspace_bytes((int)N, c.hidden, (int)E);
    const size_t attention_step = routed.held + shared.held + 4 * N * E +
                                  router_logits_held_bytes((int)N, c.hidden, (int)E) + norm_partials + attention_backward;
    return std::max(4 * N * k + std::max({routed.peak - routed.saved, shared_step, router_step}), attention_step);
  };

  // the layer boundaries on the device, at the head and during layer l's backward (ops/sco_plan.hpp)
  const ScoPlan sco = sco_plan(c.layers, NH * b, recompute ? seams.offload_budget : 0);
  auto device_boundary = [&](int l) { return !sco.offloaded[l]; };
  size_t boundaries_at_head = 0;
  for (size_t l = 0; l <= L; l++) boundaries_at_head += device_boundary((int)l) ? NH * b : 0;
  auto boundaries_at = [&](int l) {  // input[0..l] kept, or prefetched for layer l and l − 1
    size_t n = 0;
    for (int j = 0; j <= l; j++) n += device_boundary(j) || j >= l - 1 ? 1 : 0;
    return n * NH * b;
  };
  // what stays from each layer's forward to its backward: all its activations without recomputation,
  // the kept attention tensors with it
  auto kept = [&](int l) -> size_t {
    if (!recompute) return acts(l);
    if (attention_kept == nullptr || attention_kept->tokens != (long long)N) return 0;
    return (attention_kept->keep_core[l] ? sar_option_bytes(SarOption::Core, N, c.hidden, c.heads, b, D) : 0) +
           (attention_kept->keep_projection[l] ? sar_option_bytes(SarOption::Projection, N, c.hidden, c.heads, b, D) : 0);
  };
  const std::string kept_name = recompute ? "kept attention" : "kept activations";

  // --zero 3 (runtime/zero3.cuh): forward group g's gathered weights [padded] live while it runs, beside
  // the group prefetched (the one that runs next: g − 1 in the backward), and its gradients' buffer
  // [padded]; at its reduce-scatter, after its backward, their fp32 copy (BF16 build) and the reduced shard
  std::vector<size_t> group_bytes(L + 1, 0), reduce_bytes(L + 1, 0);
  for (const ParamRegion& r : shape.regions)
    if (r.gathered) {
      group_bytes[r.group] = r.padded * b;
      reduce_bytes[r.group] = (fp32_sum ? r.padded * 4 : 0) + r.shard * 4;
    }
  auto gathered = [&](int g) { return 2 * group_bytes[g] + (g > 0 ? group_bytes[g - 1] : 0); };
  auto moment = [&](size_t boundaries, size_t kept_bytes, size_t final_norm_bytes, size_t layer, size_t op,
                    const std::string& op_name, size_t zero3) {
    return std::vector<MemoryTerm>{{"weights", weights},    {"grads", grads},
                                   {"optimizer", optimizer}, {"runtime", runtime},
                                   {"pass inputs", inputs},  {"boundaries", boundaries},
                                   {kept_name, kept_bytes},  {"final norm", final_norm_bytes},
                                   {"one layer", layer},     {op_name, op},
                                   {"gathered groups (ZeRO-3)", zero3}};
  };
  size_t kept_all = 0;
  for (size_t l = 0; l < L; l++) kept_all += kept((int)l);
  MemoryPrediction best;
  best.terms = moment(boundaries_at_head, kept_all, final_norm, 0, NH * b + head->live_bytes((int)N, c.hidden, c.vocab),
                      "output head", gathered((int)L));
  best.peak_at = "the output head";
  size_t kept_below = kept_all;
  for (int l = (int)L - 1; l >= 0; l--) {
    kept_below -= kept(l);  // layer l's own are part of its working set
    MemoryPrediction here;  // d_residual beside the layer's activations and backward buffers
    here.terms = moment(boundaries_at(l), kept_below, 0, NH * b + acts(l) + backward_buffers + norm_partials,
                        operator_term(l), c.is_moe_layer(l) ? "dispatch" : "dense FFN", gathered(l));
    here.peak_at = "layer " + std::to_string(l) + "'s backward";
    if (here.total() > best.total()) best = here;
    if (groups > 1) {  // attention_groups_backward: d_residual, ln1 again and d_ln1's fp32 sum, beside att and lse and
                       // one group's q, k, v, output, d_att, d_qkv and delta; then d_ln1 rounded and ln1's norm
      const size_t rebuilt = NH * b + NH * b + 4 * N + NH * 4;
      MemoryPrediction group, last;
      group.terms = moment(boundaries_at(l), kept_below, 0, rebuilt + attention, 8 * NH * b / groups + delta / groups,
                           "attention head group", gathered(l));
      last.terms = moment(boundaries_at(l), kept_below, 0, rebuilt + NH * b, norm_partials, "ln1 norm", gathered(l));
      for (MemoryPrediction* x : {&group, &last}) {
        x->peak_at = "layer " + std::to_string(l) + "'s attention backward in head groups";
        if (x->total() > best.total()) best = *x;
      }
    }
    if (reduce_bytes[l] == 0) continue;
    MemoryPrediction reduce;  // the group's reduce-scatter: its activations are gone, d_residual stays
    reduce.terms = moment(boundaries_at(l), kept_below, 0, NH * b, 0, "", gathered(l) + reduce_bytes[l]);
    reduce.peak_at = "layer " + std::to_string(l) + "'s gradient reduce-scatter (ZeRO-3)";
    if (reduce.total() > best.total()) best = reduce;
  }
  return best;
}

// What a budget of `budget` pool bytes keeps of the attention tensors (selective attention recomputation,
// ops/sar_plan.hpp) for a pass of B×T tokens on this rank: under --sp D, T is the rank's slice of each
// sequence of T·D tokens, as model_pass takes it.
inline SarPlan attention_kept_plan(const ModelConfig& c, const Parallel& par, int B, int T, long long budget) {
  const int D = par.seq.size;
  return sar_plan(c.layers, (long long)B * T, T * D, c.hidden, c.heads, sizeof(floatX), D, budget);
}

// One setting's memory on this rank (plan.hpp's RankUse): the prediction, with the attention tensors that
// a pool budget of `budget` bytes keeps under --recompute 1 (0: none kept), and the pinned host bytes of
// SCO's boundaries and of the optimizer's state.
inline RankUse rank_use(const ModelConfig& c, const TrainConfig& t, const Parallel& par, int B, int T, long long budget) {
  RankUse use;
  const Seams seams = seams_from(t, c);
  use.device = predict_rank_memory(c, par, seams, B, T, t.recompute != 0);
  const long long left = budget - (long long)use.device.total();
  if (t.recompute && t.attention_groups == 1 && budget > 0 && left >= 0) {
    use.attention_kept = attention_kept_plan(c, par, B, T, left);
    use.device = predict_rank_memory(c, par, seams, B, T, true, &use.attention_kept);
  }
  use.shard = rank_shard_params(c, par);
  const size_t boundary = (size_t)B * T * c.hidden * sizeof(floatX);
  use.host = (t.recompute ? sco_plan(c.layers, boundary, t.offload_budget).host_bytes : 0) +
             factory_of(optimizer_factories(), "--optimizer", seams.optimizer).host_bytes(seams, use.shard);
  return use;
}

// =============================================================================================
// A pass over one micro-batch

// What a forward(+backward) pass over one micro-batch does.
struct PassOptions {
  bool backward = true;       // accumulate gradients (+=) into m.grads
  bool count_loads = true;    // add routes per expert into m.step_loads_dev
  float dloss = 0.f;          // d(objective)/d(loss of one token), e.g. 1/(B·T·accum)
  bool recompute = false;     // layer-level activation checkpointing
  bool first_of_step = false; // BF16 build: the fp32 gradient sum main_grads (=) this pass's, not +=
  // BF16 build: end with the fold of this pass's gradients into main_grads (model_fold_grads); false
  // leaves them in grads, for a step that has one pass and reads them there (model_train_step)
  bool fold = true;
};

// Embedding and the L layers on device tokens [B·T]: fills boundaries.input[0..L]; `seq`: the ranks that
// share each sequence (attention_step; a Comm of one rank: whole sequences here). With keep_acts
// each layer's activations stay in acts[l] for its backward, else they are freed at once, except the
// attention tensors that `attention_kept` (selective attention recomputation, ops/sar_plan.hpp) keeps;
// after_layer(l, acts[l]) runs after each layer (sampling and test paths read from it).
inline void forward_layers(Model& m, const int* tokens_dev, int B, int T, const Comm& seq, LayerBoundaries& boundaries,
                           std::vector<LayerActs>& acts, bool keep_acts, bool count_loads,
                           const std::function<void(int, const LayerActs&)>& after_layer = nullptr,
                           const SarPlan* attention_kept = nullptr) {
  const ModelConfig& c = m.cfg;
  const int N = B * T;
  prof_mark(m.stream, "embedding fwd", 2.0 * N * c.hidden * sizeof(floatX) + 4.0 * N);
  model_wait_update(m, 0);  // the embedding and layer 0's weights (--overlap_update)
  weights_acquire(m, 0, 1);  // (--zero 3: group l's weights gathered while layer l − 1 runs, group L's for the head)
  embedding_forward(boundaries.allocate(0), tokens_dev, m.p.wte, N, c.hidden, c.vocab, m.stream);
  for (int l = 0; l < c.layers; l++) {
    model_wait_update(m, l);
    weights_acquire(m, l, l + 1);
    layer_forward(m, l, boundaries.input[l], boundaries.allocate(l + 1), acts[l], B, T, seq, count_loads);
    weights_release(m, l);
    boundaries.after_forward(l);
    if (after_layer) after_layer(l, acts[l]);
    if (!keep_acts)
      free_acts(acts[l], attention_kept && attention_kept->keep_core[l], attention_kept && attention_kept->keep_projection[l]);
  }
}

// A pool buffer holding host ints [n] (copy_to_device: call it while the stream has no collective queued).
inline int* upload_ints(const int* host, int n, Mem cat, const char* tag, cudaStream_t s) {
  int* dev = pool().alloc_t<int>(n, cat, tag);
  copy_to_device(dev, host, n * sizeof(int), s, tag);
  return dev;
}

// --record_routing: the choices of every MoE layer of every rank in a training pass are gathered on
// the device into [L_moe][W][N·k] — a trace's batch (data/routing_trace.hpp) — by one all_gather per
// MoE layer on the compute stream (every rank records, in layer order, like the dispatcher's own
// collectives); rank 0 downloads the batch with the pass's loss and appends it to the trace.
// Live: W·L_moe·N·k ints on the device during the pass (CommStaging), one batch on rank 0's host.
inline void gather_layer_routes(Model& m, int l, const int* topk_idx, int* gathered, int N) {
  const size_t routes = (size_t)N * m.cfg.topk;
  int* layer = gathered + (size_t)(l - m.cfg.n_dense) * m.par.world.size * routes;  // MoE layers n_dense..L−1
  if (m.par.world.size > 1) all_gather(m.par.world, topk_idx, layer, routes, m.stream);
  else cudaCheck(cudaMemcpyAsync(layer, topk_idx, routes * sizeof(int), cudaMemcpyDeviceToDevice, m.stream),
                 "record_routing", "N=%d", N);
}

inline void append_gathered_routes(Model& m, const int* gathered, size_t count) {
  if (!m.routing_record) return;  // only rank 0 writes the trace
  std::vector<int> batch(count);
  copy_to_host(batch.data(), gathered, count * sizeof(int), m.stream, "record_routing");
  m.routing_record->append(batch.data(), batch.size());
}

// T tokens per sequence on a rank whose sequences `seq` shares: T·D of each, at most seq_len.
inline void check_seq_len(const Model& m, int T, const Comm& seq) {
  if ((long long)T * seq.size > m.cfg.seq_len || T < 1)
    fm_fail("model_pass", "sequence longer than the model's seq_len", "T=%d D=%d seq_len=%d", T, seq.size, m.cfg.seq_len);
}

// The embedding backward's buckets of a pass's tokens (ops/embedding.cuh), staged for its upload:
// offsets [V + 1], positions [N], the count U of used ids, the U ids (then zeros up to min(N, V)).
inline void stage_token_buckets(Model& m, const int* inputs, int N, int V) {
  const TokenBuckets b = build_token_buckets(inputs, N, V);
  const int used = (int)b.used_ids.size();
  m.buckets_upload->stage({{b.offsets.data(), b.offsets.size()}, {b.positions.data(), b.positions.size()}, {&used, 1},
                           {b.used_ids.data(), b.used_ids.size()}},
                          token_buckets_ints(N, V), "token_buckets");
}

// Everything a pass queues on the compute stream, from the copies of its staged inputs (tokens and
// targets; the buckets, staged by after_forward() at the latest) to its summed loss copied into
// m.loss_host. after_forward() runs on the host once the forward is queued: the eager pass stages
// the buckets there, while the GPU runs the forward. With o.backward the gradients of
// dloss · Σ losses are added (+=) into m.grads.
inline void enqueue_pass(Model& m, int B, int T, const PassOptions& o, const std::function<void()>& after_forward) {
  const ModelConfig& c = m.cfg;
  const int N = B * T, H = c.hidden, V = c.vocab, L = c.layers;
  const size_t NH = (size_t)N * H;
  cudaStream_t s = m.stream;
  prof_mark(s, "pass start: token uploads");
  int* tokens_dev = m.tokens_upload->enqueue_copy(Mem::Activations, "tokens_targets", s);  // tokens [N], then targets [N]
  const int* targets_dev = tokens_dev + N;
  LayerBoundaries boundaries(L, NH, s, o.backward && o.recompute ? m.sco.get() : nullptr);  // SCO: --offload_budget
  std::vector<LayerActs> acts(L);
  const bool record = m.record_routing && m.training_pass >= 0;  // --record_routing
  const size_t recorded_count = record ? (size_t)(L - c.n_dense) * m.par.world.size * N * c.topk : 0;
  int* recorded = record ? pool().alloc_t<int>(recorded_count, Mem::CommStaging, "recorded_routes") : nullptr;
  std::function<void(int, const LayerActs&)> record_layer;
  if (record)
    record_layer = [&](int l, const LayerActs& a) {
      if (c.is_moe_layer(l)) gather_layer_routes(m, l, a.topk_idx, recorded, N);
    };
  // --device_budget: the attention tensors the plan keeps (a training pass of the plan's size under recomputation)
  const SarPlan* attention_kept = o.backward && o.recompute && m.attention_kept.tokens == N ? &m.attention_kept : nullptr;
  forward_layers(m, tokens_dev, B, T, m.par.seq, boundaries, acts, o.backward && !o.recompute, o.count_loads, record_layer,
                 attention_kept);
  if (after_forward) after_forward();
  // the embedding backward's per-token buckets: offsets [V + 1], positions [N], used ids [1 + min(N, V)]
  int* buckets_dev = o.backward ? m.buckets_upload->enqueue_copy(Mem::Workspace, "token_buckets", s) : nullptr;

  floatX* lnf = pool().alloc_t<floatX>(NH, Mem::Activations, "lnf");
  float* lnf_rstd = pool().alloc_t<float>(N, Mem::Activations, "lnf_rstd");
  prof_mark(s, "rmsnorm fwd", rmsnorm_fwd_bytes(N, H));
  model_wait_update(m, L);  // the final norm and the head, and with them the whole update
  weights_acquire(m, L, o.backward ? L - 1 : -1);
  if (o.backward) grads_acquire(m, L);
  rmsnorm_forward(lnf, lnf_rstd, boundaries.input[L], m.p.lnf, N, H, c.norm_eps, s);
  floatX* d_lnf = o.backward ? pool().alloc_t<floatX>(NH, Mem::Workspace, "d_lnf") : nullptr;
  prof_mark(s, "head (fwd+bwd)");
  m.head->forward_backward(m.scalar_dev, d_lnf, m.g.lm_head, lnf, m.p.lm_head, targets_dev, o.dloss, N, H, V, s);
  pool().free(lnf);  // the head was its last reader (Ring-DTP's collectives join the compute stream before it returns)
  float* loss_total_dev = pool().alloc_t<float>(1, Mem::Workspace, "loss_total");
  cudaCheck(cudaMemcpyAsync(loss_total_dev, m.scalar_dev, sizeof(float), cudaMemcpyDeviceToDevice, s), "model_pass", "N=%d", N);
  if (!o.backward) weights_release(m, L);

  if (o.backward) {
    floatX* d_x = pool().alloc_t<floatX>(NH, Mem::Workspace, "d_residual");
    prof_mark(s, "rmsnorm bwd", rmsnorm_bwd_bytes(N, H, false));
    rmsnorm_backward(d_x, m.g.lnf, d_lnf, boundaries.input[L], m.p.lnf, lnf_rstd, N, H, s, false, m.wgrad.get());
    pool().free(d_lnf);
    pool().free(lnf_rstd);
    lnf_rstd = nullptr;
    boundaries.release(L);
    grads_reduce(m, L);
    weights_release(m, L);
    // layers in reverse; with recompute, rebuild each layer's activations from its input first.
    // Rerunning the layer (router and dispatcher included) reproduces the forward bit for bit: every
    // step is deterministic given the layer input (FP32 router, top-k ties to the lower index, a
    // stable route sort, a dispatch plan that depends only on the counts, fixed-order combines,
    // deterministic cuBLAS and NCCL point-to-point copies), so no routing needs to be saved. The cost
    // under --moe ep is a second forward exchange per MoE layer: the counts, then R·H·b bytes out and
    // R·H·b back per rank (R = N·k routes), besides the backward's own two exchanges. The layer's
    // output is not rebuilt (x_out = nullptr: it was the boundary input[l + 1], kept until layer l + 1's
    // backward); under --moe pllep and relay the recomputation only plans, since their backward
    // recomputes each chunk (pllep) or hop (relay) itself. Tested at W = 1 (tests/gpu_model.cu) and W = 2 (tests/dist_model.cu),
    // gradients compared with memcmp; with SCO's boundaries from the host too (tests/sco_training.cuh).
    for (int l = L - 1; l >= 0; l--) {
      weights_acquire(m, l, l - 1);
      grads_acquire(m, l);
      boundaries.before_backward(l);
      if (o.recompute) layer_forward(m, l, boundaries.input[l], nullptr, acts[l], B, T, m.par.seq, false);
      layer_backward(m, l, acts[l], boundaries.input[l], d_x, B, T, m.par.seq);
      free_acts(acts[l]);
      boundaries.release(l);
      if (l > 0) {  // (group 0 holds the embedding too)
        grads_reduce(m, l);
        weights_release(m, l);
      }
    }
    m.wgrad->join(s, "model_pass");  // layer 0's last weight gradient (ln1's dw)
    // embedding: deterministic per-token sums over the host-built buckets
    prof_mark(s, "embedding bwd", 2.0 * NH * sizeof(floatX));
    embedding_backward(m.g.wte, d_x, buckets_dev, buckets_dev + V + 1, buckets_dev + V + 1 + N, N, V, H, s);
    pool().free(d_x);
    pool().free(buckets_dev);
    grads_reduce(m, 0);
    weights_release(m, 0);
    m.zero3.join(s);  // every group's gradients in main_grads' shards before anything reads them
    if (o.fold) {
      prof_mark(s, "fold grads (bf16 into fp32)", (double)m.num_params * ((o.first_of_step ? 4 : 8) + 2 * sizeof(floatX)));
      model_fold_grads(m, o.first_of_step);  // this pass's gradients into the step's fp32 sum
    }
  }
  prof_mark(s, "pass end: loss download (host wait)");
  if (record) append_gathered_routes(m, recorded, recorded_count);  // waits for the stream (such a pass stays eager)
  cudaCheck(cudaMemcpyAsync(m.loss_host->get(), loss_total_dev, sizeof(float), cudaMemcpyDeviceToHost, s), "model_pass",
            "loss download N=%d", N);
  for (void* p : {(void*)tokens_dev, (void*)lnf_rstd, (void*)loss_total_dev, (void*)recorded})
    pool().free(p);
}

// inputs/targets: host [B·T], this rank's tokens: B sequences of T, or under --sp D (m.par.seq) this
// rank's slice of T tokens of each of B sequences of T·D (data::sequence_slice). Returns the mean loss
// over the B·T tokens; with o.backward the gradients of dloss · Σ losses are added (+=) into m.grads.
// With m.graphs.on (--cuda_graph; runtime/graph.cuh's GraphedPasses), outside a profiled step or a pool
// timeline (both record the host's own calls): the first pass of each key (PassGraphKey) runs eagerly and
// counts its host waits; the next is captured, and later ones launch that graph. A key whose eager
// pass waited for the host inside it stays eager.
inline float model_pass(Model& m, const int* inputs, const int* targets, int B, int T, const PassOptions& o) {
  const int N = B * T, V = m.cfg.vocab;
  cudaStream_t s = m.stream;
  check_seq_len(m, T, m.par.seq);
  m.tokens_upload->stage({{inputs, (size_t)N}, {targets, (size_t)N}}, 2 * (size_t)N, "tokens_targets");
  const auto stage_buckets = [&] {
    if (o.backward) stage_token_buckets(m, inputs, N, V);
  };
  if (o.backward) m.buckets_upload->reserve(token_buckets_ints(N, V), "token_buckets");  // where the key says
  const PassGraphKey key{B,
                         T,
                         o.backward,
                         o.count_loads,
                         o.recompute,
                         o.first_of_step,
                         o.fold,
                         o.dloss,
                         m.update.groups - m.update.next_wait,
                         m.tokens_upload->host,
                         o.backward ? m.buckets_upload->host : nullptr};
  const bool launched = m.graphs.run(key, !profiler().on && !pool().timeline(), s,
                                     [&](const std::function<void()>& after_forward) { enqueue_pass(m, B, T, o, after_forward); },
                                     stage_buckets);
  if (launched) {  // what the launch read: the update's groups (it waits for them all, as the captured pass did), the uploads
    m.update.next_wait = m.update.groups;
    m.tokens_upload->copied_by(s, "tokens_targets");
    if (o.backward) m.buckets_upload->copied_by(s, "token_buckets");
  }
  stream_wait(s, "model_pass", "the loss's download, N=%d", N);
  return *m.loss_host->get() / N;
}

// The sampling path: the logits [V] of token row `row` of the forward over inputs [T] (host, one
// sequence). Only that row is projected: no [T,V] tensor. The whole sequence on this rank, under --sp
// too (every rank samples the same context: a sequence group of one, no exchange).
inline std::vector<float> model_logits_row(Model& m, const int* inputs, int T, int row) {
  const ModelConfig& c = m.cfg;
  const int H = c.hidden, V = c.vocab;
  cudaStream_t s = m.stream;
  const Comm whole_sequences;
  check_seq_len(m, T, whole_sequences);
  int* tokens_dev = upload_ints(inputs, T, Mem::Activations, "tokens", s);
  LayerBoundaries boundaries(c.layers, (size_t)T * H, s);
  std::vector<LayerActs> acts(c.layers);
  forward_layers(m, tokens_dev, 1, T, whole_sequences, boundaries, acts, false, false);
  floatX* lnf = pool().alloc_t<floatX>(H, Mem::Activations, "lnf_row");
  float* lnf_rstd = pool().alloc_t<float>(1, Mem::Activations, "lnf_row_rstd");
  floatX* logits = pool().alloc_t<floatX>(V, Mem::Logits, "logits_row");
  model_wait_update(m, c.layers);
  weights_acquire(m, c.layers, -1);
  rmsnorm_forward(lnf, lnf_rstd, boundaries.input[c.layers] + (size_t)row * H, m.p.lnf, 1, H, c.norm_eps, s);
  m.head->logits_rows(logits, lnf, m.p.lm_head, 1, H, V, s);
  weights_release(m, c.layers);
  std::vector<floatX> host(V);
  copy_to_host(host.data(), logits, V * sizeof(floatX), s, "model_logits_row");
  for (void* p : {(void*)tokens_dev, (void*)lnf, (void*)lnf_rstd, (void*)logits}) pool().free(p);
  std::vector<float> out(V);
  for (int v = 0; v < V; v++) out[v] = to_float(host[v]);
  return out;
}

// The test path for routing: each MoE layer's top-k choice [N·k] on inputs [B·T] (host; this rank's
// tokens, as model_pass takes them), from a forward that counts no loads. The forward is deterministic, so a training pass over the same
// tokens with the same weights and biases chooses the same experts.
inline std::vector<std::vector<int>> model_routes(Model& m, const int* inputs, int B, int T) {
  const ModelConfig& c = m.cfg;
  const int N = B * T;
  check_seq_len(m, T, m.par.seq);
  int* tokens_dev = upload_ints(inputs, N, Mem::Activations, "tokens", m.stream);
  LayerBoundaries boundaries(c.layers, (size_t)N * c.hidden, m.stream);
  std::vector<LayerActs> acts(c.layers);
  std::vector<std::vector<int>> routes(c.layers);
  forward_layers(m, tokens_dev, B, T, m.par.seq, boundaries, acts, false, false, [&](int l, const LayerActs& a) {
    if (!c.is_moe_layer(l)) return;
    routes[l].resize((size_t)N * c.topk);
    copy_to_host(routes[l].data(), a.topk_idx, routes[l].size() * sizeof(int), m.stream, "model_routes");
  });
  weights_release(m, c.layers);  // (--zero 3: prefetched for a head that does not run here)
  pool().free(tokens_dev);
  return routes;
}

// =============================================================================================
// Update

// The mean of a per-rank value over all ranks (losses are averaged this way).
inline float mean_over_ranks(Model& m, float x) {
  if (m.par.world.size == 1) return x;
  copy_to_device(m.scalar_dev, &x, sizeof(float), m.stream, "mean_over_ranks");
  all_reduce_sum(m.par.world, m.scalar_dev, m.scalar_dev, 1, m.stream);
  copy_to_host(&x, m.scalar_dev, sizeof(float), m.stream, "mean_over_ranks");
  return x / m.par.world.size;
}

// Sums each region's fp32 gradients (main_grads) over the ranks that hold it, leaving this rank's
// shard (ZeRO-1: in-place reduce-scatter; the rest of the buffer is not used until the next zeroing).
// A gathered region (--zero 3) has its sum in its shard already (grads_reduce, in each pass).
inline void reduce_scatter_grads(Model& m) {
  for (const ParamRegion& r : m.regions)
    if (region_group(m, r).size > 1 && !r.gathered)
      reduce_scatter_sum(region_group(m, r), m.main_grads + r.offset, m.main_grads + r.shard_offset, r.shard, m.stream);
}

// Every rank's floatX weights from the shards their owners updated (a gathered region, --zero 3: each
// pass gathers its groups when it runs them).
inline void all_gather_weights(Model& m) {
  for (const ParamRegion& r : m.regions)
    if (region_group(m, r).size > 1 && !r.gathered)
      all_gather(region_group(m, r), m.params + r.shard_offset, m.params + r.offset, r.shard, m.stream);
}

// Global gradient norm: every element of the model lies in exactly one rank's shard. Of main_grads, or
// of the pass's grads where the step skipped the fold: the same float (common.cuh's sumsq sums bf16
// values in the order of their fp32 copies). Each run of shards that lie end to end in memory is one
// sum, so the order follows the memory, not the regions: ZeRO-3's groups at W = 1 sum as ZeRO-1's one
// region does. Stays on the device: its square in m.scalar_dev, the
// clip factor clip_scale(norm, max_norm) in m.grad_scale_dev, which the optimizer reads there — the
// host queues the update without waiting (model_update downloads the norm after it).
inline void model_grad_norm_on_device(Model& m, bool pass_grads, float max_norm) {
  cudaCheck(cudaMemsetAsync(m.sumsq_partials, 0, SUMSQ_BLOCKS * sizeof(float), m.stream), "grad_norm", "P=%zu", m.num_params);
  auto sum_run = [&](size_t first, size_t count) {
    if (pass_grads) sumsq_accumulate(m.sumsq_partials, m.grads + first, count, m.stream);
    else sumsq_accumulate(m.sumsq_partials, m.main_grads + first, count, m.stream);
  };
  size_t run_first = 0, run_count = 0;
  for (const ParamRegion& r : m.regions) {
    if (r.shard_offset != run_first + run_count) {
      sum_run(run_first, run_count);
      run_first = r.shard_offset, run_count = 0;
    }
    run_count += r.shard;
  }
  sum_run(run_first, run_count);
  sumsq_finish(m.scalar_dev, m.sumsq_partials, m.stream);
  if (m.par.world.size > 1) all_reduce_sum(m.par.world, m.scalar_dev, m.scalar_dev, 1, m.stream);
  clip_scale_on_device(m.grad_scale_dev, m.scalar_dev, max_norm, m.stream);
}

// The step's per-expert loads into m.step_loads, summed over every rank (the router bias sees the
// global batch): the device buffer is all-reduced in place, then downloaded — the step's one host
// wait for the loads (before it, one per MoE layer). Integer sums: exact in any order.
inline void all_reduce_loads(Model& m) {
  const size_t n = m.step_loads.size();
  if (m.par.world.size > 1) all_reduce_sum(m.par.world, m.step_loads_dev, m.step_loads_dev, n, m.stream);
  std::vector<int> loads(n);
  copy_to_host(loads.data(), m.step_loads_dev, n * sizeof(int), m.stream, "all_reduce_loads");
  std::copy(loads.begin(), loads.end(), m.step_loads.begin());
}

// Whether a step's update runs beside the next forward (UpdateStream): --overlap_update 1 on one rank
// (no collective follows the update), an optimizer whose step is launches only, and the BF16 build's
// own buffer for a pass's gradients (the FP32 build's passes add into the buffer the update reads).
inline bool update_beside_next_forward(const Model& m, const TrainConfig& t) {
  return t.overlap_update && m.par.world.size == 1 && m.opt->steps_by_group() && (void*)m.grads != (void*)m.main_grads &&
         !m.zero3.on();
}

// One optimizer step on this rank's shards: reduce-scatter the gradients, clip by the global norm,
// the optimizer on the shards, weights all-gathered, then the router bias update from the global
// batch's loads (m.step_loads holds the global loads afterwards). Returns the norm before clipping.
// pass_grads: the step's one pass was not folded (PassOptions.fold, on one rank): the norm and the
// optimizer read its floatX grads, which are then zeroed (the fold's other half).
// With --overlap_update 1 where it can (update_beside_next_forward) the optimizer and the zeroing of
// the pass's gradients run on the update stream, group by group, and the next pass waits for them.
inline float model_update(Model& m, const TrainConfig& t, float lr, bool pass_grads = false) {
  if (pass_grads && (m.par.world.size != 1 || !m.opt->reads_pass_grads()))
    fm_fail("model_update", "unfolded gradients need one rank and an optimizer that reads them", "W=%d",
            m.par.world.size);
  model_join_update(m);  // the last update, where no pass came between
  prof_mark(m.stream, "grad reduce-scatter");
  reduce_scatter_grads(m);
  prof_mark(m.stream, "grad norm");
  model_grad_norm_on_device(m, pass_grads, t.grad_clip);
  const AdamWSettings settings{t.beta1, t.beta2, t.adam_eps, t.weight_decay};
  // bytes for the device optimizer only: master, m, v, grad read, master, m, v, weight written
  const bool device_opt = dynamic_cast<DeviceAdamW*>(m.opt.get()) != nullptr;
  const size_t grad_bytes = pass_grads ? sizeof(floatX) : sizeof(float);
  // beside the next forward: queued on the update stream, where the compute stream's profile does not see it
  const bool beside = update_beside_next_forward(m, t);
  prof_mark(m.stream, beside ? "optimizer: queued on the update stream" : "optimizer",
            device_opt && !beside ? (double)m.opt->state_count * (24 + grad_bytes + sizeof(floatX)) : 0.0);
  cudaStream_t us = beside ? m.update.begin(m.opt->segments, m.num_params, m.cfg.layers + 1, m.stream) : m.stream;
  floatX* zeroed_after = pass_grads ? m.grads : nullptr;  // the fold's other half, group by group (beside)
  if (beside) m.opt->group_done = [&](int g) { m.update.finish_through(g, zeroed_after); };
  if (pass_grads) m.opt->step_from_pass_grads(m.params, m.grads, lr, settings, m.grad_scale_dev, us);
  else m.opt->step(m.params, m.main_grads, lr, settings, m.grad_scale_dev, us);
  if (beside) {
    m.opt->group_done = nullptr;
    m.update.finish_through(m.update.groups - 1, zeroed_after);  // groups without segments
  } else if (pass_grads) {  // the fold's other half
    prof_mark(m.stream, "zero pass grads");
    cudaCheck(cudaMemsetAsync(m.grads, 0, m.num_params * sizeof(floatX), m.stream), "model_update", "P=%zu",
              m.num_params);
  }
  prof_mark(m.stream, "weight all-gather");
  all_gather_weights(m);
  prof_mark(m.stream, "norm download, loads all-reduce + download (host wait)");
  float sumsq = 0.f;  // the gradient norm's square, still in m.scalar_dev (model_grad_norm_on_device)
  copy_to_host(&sumsq, m.scalar_dev, sizeof(float), m.stream, "grad_norm");
  const float norm = std::sqrt(sumsq);
  all_reduce_loads(m);
  if (t.bias_update > 0) {  // aux-loss-free balancing from the step's loads over the whole global batch (config.hpp)
    prof_mark(m.stream, "router bias update (host wait)");
    update_router_bias(m.router_bias, m.step_loads, m.cfg, t.bias_update);
    model_upload_router_bias(m);
  }
  return norm;
}

// One optimizer step: zero the gradients, accumulate over `accum` micro-batches drawn from
// next_batch(inputs, targets), then update. Returns the mean loss over every rank's tokens;
// *grad_norm gets the norm.
template <typename NextBatch>
float model_train_step(Model& m, const TrainConfig& t, int step, int B, int T, int accum, NextBatch next_batch,
                       float* grad_norm) {
  std::vector<int> x((size_t)B * T), y((size_t)B * T);
  prof_mark(m.stream, "zero grads");
  model_zero_grads(m, false);  // the loads (and the FP32 build's grads); the first pass sets main_grads
  PassOptions o;
  // the mean over the global batch: B·T·accum tokens on each of the W ranks, each token on one rank (under
  // --sp too: the D ranks of a group hold disjoint slices), so the reduce-scatter's sum over W is its gradient
  o.dloss = 1.f / ((float)B * T * accum * m.par.world.size);
  o.recompute = t.recompute != 0;
  // One pass on one rank: main_grads would be an exact fp32 copy of its grads, so the optimizer reads
  // those and the fold's pass over every gradient is skipped (bit-identical;
  // notes/speed.md, 'The update beside the next forward').
  const bool pass_grads = accum == 1 && m.par.world.size == 1 && m.opt->reads_pass_grads() &&
                          (void*)m.grads != (void*)m.main_grads && !m.zero3.on();
  o.fold = !pass_grads;
  double loss = 0;
  for (int micro = 0; micro < accum; micro++) {
    prof_mark(m.stream, "data: next batch (host)");
    next_batch(x.data(), y.data());
    pool().mark(("micro-batch " + std::to_string(micro)).c_str());
    m.training_pass = (long long)step * accum + micro;  // what routing traces follow
    o.first_of_step = micro == 0;
    loss += model_pass(m, x.data(), y.data(), B, T, o) / accum;
  }
  m.training_pass = -1;
  pool().mark("optimizer");
  float norm = model_update(m, t, lr_at(t, step), pass_grads);
  prof_mark(m.stream, "step end: rank sync, loss mean (host wait)");
  comm_sync(m.par.world, m.stream, "train_step");
  if (grad_norm) *grad_norm = norm;
  return mean_over_ranks(m, (float)loss);
}

// Expert balance of the last step (global loads): the worst MoE layer's max/mean expert load
// (1 = perfectly even), and the range of the router biases.
struct ExpertBalance {
  double worst_max_over_mean = 0;
  float bias_min = 0, bias_max = 0;
};

inline ExpertBalance expert_balance(const Model& m) {
  const ModelConfig& c = m.cfg;
  ExpertBalance b;
  bool first = true;
  for (int l = 0; l < c.layers; l++) {
    if (!c.is_moe_layer(l)) continue;
    long long total = 0, most = 0;
    for (int e = 0; e < c.experts; e++) {
      const long long load = m.step_loads[(size_t)l * c.experts + e];
      total += load;
      most = std::max(most, load);
      const float bias = m.router_bias[(size_t)l * c.experts + e];
      b.bias_min = first ? bias : std::min(b.bias_min, bias);
      b.bias_max = first ? bias : std::max(b.bias_max, bias);
      first = false;
    }
    if (total > 0) b.worst_max_over_mean = std::max(b.worst_max_over_mean, (double)most * c.experts / total);
  }
  return b;
}
