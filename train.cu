// train.cu — the flatmoe trainer, one program like llm.c. Read it top to bottom:
//   1. checkpoints: a folder with one file per rank (checkpoint.hpp), written as a set
//   2. samples and validation
//   3. the training loop: flags → data → model → steps (accumulation, LR schedule, validation,
//      samples, logs, memory report) → checkpoints
// The model itself (parameters, forward, backward, recomputation, update) is model.cuh; every
// operator it calls is one file in ops/ with its twin in ref/.
#include <sys/stat.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <string>
#include <vector>

// runtime: memory pool, error checks, NCCL groups, the launcher
#include "runtime/comm.cuh"
#include "runtime/launch.cuh"
#include "runtime/pool.cuh"
// the model and its operators
#include "config.hpp"
#include "model.cuh"
#include "rank_memory.cuh"
// data and checkpoint files
#include "checkpoint.hpp"
#include "data/dataloader.hpp"
#include "data/routing_profile.hpp"
#include "data/routing_trace.hpp"
#include "data/tokenizer.hpp"

using data::DataLoader;
using data::Tokenizer;

// =============================================================================================
// 1. Checkpoints. A checkpoint is a folder with one file per rank, rankR.bin (checkpoint.hpp: the
// model configuration, the training flags, the step, the data position, this rank's optimizer
// sections and the router biases, and a checksum over all of it). Every rank writes into DIR.tmp/;
// after all have finished rank 0 publishes it as DIR, so an interrupted save never replaces a good
// checkpoint. Resume needs the same W, E_p and vocabulary split P (--head ring_dtp).

struct TrainState {
  int step = 0;              // optimizer steps completed
  DataLoader::State train_data{};
  unsigned long long sample_rng_draws = 0;
};

// Every rank reaches this point before any goes on.
void barrier(Model& m, const char* what) {
  if (m.par.world.size == 1) return;
  all_reduce_sum(m.par.world, m.scalar_dev, m.scalar_dev, 1, m.stream);
  comm_sync(m.par.world, m.stream, what);
}

void checkpoint_save(const std::string& dir, Model& m, const TrainConfig& tc, const TrainState& st) {
  ckpt::RankFile f;
  f.bf16 = sizeof(floatX) == 2;
  f.world = m.par.world.size;
  f.ep = m.par.ep.size;
  f.rank = m.par.world.rank;
  f.step = st.step;
  f.optimizer_steps = m.opt->steps;
  f.data = st.train_data;
  f.sample_rng_draws = st.sample_rng_draws;
  f.model = m.cfg;
  f.train = tc;
  model_join_update(m);  // --overlap_update: the last step's update may still run beside
  f.sections = m.opt->save(m.stream);
  f.sections.emplace_back("router_bias", m.router_bias);
  const std::string tmp_dir = dir + ".tmp";
  if (m.par.world.rank == 0) ckpt::make_empty_dir(tmp_dir);
  barrier(m, "checkpoint_save.mkdir");
  ckpt::write_rank_file(ckpt::rank_file(tmp_dir, m.par.world.rank), f);
  barrier(m, "checkpoint_save.files");
  if (m.par.world.rank == 0) ckpt::publish_dir(tmp_dir, dir);
  barrier(m, "checkpoint_save.publish");
}

// Refuses, before the GPU starts, a checkpoint that this run cannot continue, naming what differs: a
// model configuration other than the flags' (each field), another E_p, another vocabulary split P
// (--head ring_dtp: each rank's file holds its interval of lm_head), a data position that the training
// data does not hold. `saved`: the set's rank0.bin (check_checkpoint_set: the others agree with it);
// `t`: the flags at the world that runs; `train_data`: the training data at that world.
void check_resume_fits(const std::string& dir, const ckpt::RankFile& saved, const ModelConfig& flags_model,
                       const TrainConfig& t, DataLoader& train_data) {
  const std::string differs = ckpt::model_config_difference(saved.model, flags_model);
  if (!differs.empty()) throw std::invalid_argument("--resume " + dir + ": the model configuration differs from the flags: " + differs);
  const int ep = t.ep ? t.ep : t.gpus;
  if (saved.ep != ep)
    throw std::invalid_argument("--resume " + dir + ": written by W=" + std::to_string(saved.world) + " E_p=" +
                                std::to_string(saved.ep) + "; this run has W=" + std::to_string(t.gpus) +
                                " E_p=" + std::to_string(ep));
  if (saved.train.zero != t.zero)
    throw std::invalid_argument("--resume " + dir + ": written under --zero " + std::to_string(saved.train.zero) +
                                "; this run has --zero " + std::to_string(t.zero) +
                                " (each rank's file holds its shards of the other stage's layout)");
  if (saved.train.sp != t.sp)
    throw std::invalid_argument("--resume " + dir + ": written with sequence groups of D=" + std::to_string(saved.train.sp) +
                                " ranks (--sp); this run has D=" + std::to_string(t.sp) +
                                " (its data position counts the W/D groups' windows)");
  if (vocab_group_size(saved.train) != vocab_group_size(t))
    throw std::invalid_argument("--resume " + dir + ": written with lm_head split over P=" +
                                std::to_string(vocab_group_size(saved.train)) + " ranks (--head " + saved.train.head +
                                "); this run has P=" + std::to_string(vocab_group_size(t)) + " (--head " + t.head + ")");
  try {
    train_data.set_state(saved.data);
  } catch (const std::runtime_error& e) {
    throw std::invalid_argument("--resume " + dir + ": its data position lies past the training data " +
                                t.train_pattern + ": " + e.what());
  }
}

// A model from this rank's file of a checkpoint (the set was checked, and found to fit the flags, before
// the GPU started: check_checkpoint_set, check_resume_fits).
Model checkpoint_load(const std::string& dir, const TrainConfig& tc, const Parallel& par, cudaStream_t stream,
                      TrainState& st) {
  ckpt::RankFile f = ckpt::read_rank_file(ckpt::rank_file(dir, par.world.rank));
  if (par.world.rank == 0)
    for (const std::string& d : ckpt::train_flag_differences(f.train, tc)) printf("note: training flag differs from the checkpoint's: %s\n", d.c_str());
  Model m = model_create(f.model, 0, par, stream, seams_from(tc, f.model));
  m.opt->load(f.sections, f.optimizer_steps, stream);
  m.opt->write_weights(m.params, stream);
  all_gather_weights(m);
  comm_sync(m.par.world, m.stream, "checkpoint_load");
  m.router_bias = f.section("router_bias");
  model_upload_router_bias(m);
  st.step = f.step;
  st.train_data = f.data;
  st.sample_rng_draws = f.sample_rng_draws;
  return m;
}

// =============================================================================================
// 2. Samples and validation

// Draws a token from softmax(logits) with a uniform u in [0, 1).
int sample_token(const std::vector<float>& logits, float u) {
  float mx = *std::max_element(logits.begin(), logits.end());
  double sum = 0;
  for (float x : logits) sum += std::exp((double)x - mx);
  double acc = 0;
  for (size_t i = 0; i < logits.size(); i++) {
    acc += std::exp((double)logits[i] - mx) / sum;
    if (u < acc) return (int)i;
  }
  return (int)logits.size() - 1;
}

// Autoregressive sample from EOT, the whole context recomputed each token (llm.c style).
std::string generate_sample(Model& m, const Tokenizer& tok, int len, std::mt19937_64& rng, unsigned long long& draws) {
  const int T = m.cfg.seq_len;
  std::vector<int> ctx(T, tok.eot());
  std::vector<int> generated;
  std::uniform_real_distribution<float> uni(0.f, 1.f);
  for (int t = 1; t < std::min(len + 1, T); t++) {
    std::vector<float> logits = model_logits_row(m, ctx.data(), T, t - 1);
    // a vocabulary padded past the tokenizer's (--vocab 50304 on GPT-2's 50257 tokens) has ids that
    // no text decodes to: sample among the tokenizer's ids only
    logits.resize(std::min<size_t>(logits.size(), (size_t)tok.vocab_size()));
    int next = sample_token(logits, uni(rng));
    draws++;
    ctx[t] = next;
    if (next == tok.eot()) break;
    generated.push_back(next);
  }
  return tok.decode(generated);
}

float validation_loss(Model& m, DataLoader& val, int batches, int B, int T) {
  val.reset();
  std::vector<int> x((size_t)B * T), y((size_t)B * T);
  double sum = 0;
  PassOptions o;
  o.backward = false;
  o.count_loads = false;
  for (int i = 0; i < batches; i++) {
    val.next_batch(x.data(), y.data());
    sum += model_pass(m, x.data(), y.data(), B, T, o);
  }
  return mean_over_ranks(m, batches > 0 ? (float)(sum / batches) : 0.f);
}

// =============================================================================================
// 3. The training loop

// The files a run writes into --out under fixed names, with how each begins when flatmoe wrote it: an
// existing one that begins otherwise is not the project's, and the run refuses it (before the GPU)
// rather than overwrite it. A timeline plot is the project's when its CSV beside it is.
void refuse_foreign_outputs(const TrainConfig& t) {
  auto ours = [](const std::string& path, const std::string& start) {
    std::ifstream in(path, std::ios::binary);
    std::string head(start.size(), '\0');
    return in.read(&head[0], (std::streamsize)head.size()) && head == start;
  };
  auto check = [&](const std::string& name, const std::string& start, const std::string& sibling) {
    const std::string path = t.out_dir + "/" + name;
    struct stat st;
    if (lstat(path.c_str(), &st) != 0) return;
    if (S_ISREG(st.st_mode) && ours(sibling.empty() ? path : t.out_dir + "/" + sibling, start)) return;
    throw std::invalid_argument("--out " + t.out_dir + " holds " + name + ", which this run would overwrite and which "
                                "flatmoe did not write: choose another --out, or move it away");
  };
  check("log.csv", "step,train_loss,", "");
  if (t.timeline_step >= 0) {
    const std::string csv = "timeline_step" + std::to_string(t.timeline_step) + ".csv";
    check(csv, "t_us,action,bytes,", "");
    check("timeline_step" + std::to_string(t.timeline_step) + ".png", "t_us,action,bytes,", csv);
  }
  if (t.profile_step >= 0)
    check("profile_step" + std::to_string(t.profile_step) + ".md", "per-operator GPU time of step ", "");
}

void make_dirs(const std::string& path) {
  std::string cur;
  for (size_t i = 0; i <= path.size(); i++) {
    if (i == path.size() || path[i] == '/') {
      if (!cur.empty()) mkdir(cur.c_str(), 0755);
    }
    if (i < path.size()) cur += path[i];
  }
  struct stat sb;
  if (stat(path.c_str(), &sb) != 0 || !S_ISDIR(sb.st_mode)) throw std::runtime_error("cannot create directory " + path);
}

void print_config(const ModelConfig& c, const TrainConfig& t, const Model& m, int accum, double peak_flops) {
  printf("+----------------------+------------------------------+\n");
  auto row = [](const char* k, const std::string& v) { printf("| %-20s | %-28s |\n", k, v.c_str()); };
  row("precision", FLATMOE_PRECISION_NAME);
  row("vocab V", std::to_string(c.vocab));
  row("hidden H", std::to_string(c.hidden));
  row("layers L", std::to_string(c.layers) + " (" + std::to_string(c.n_dense) + " dense)");
  row("heads nh / hd", std::to_string(c.heads) + " / " + std::to_string(c.head_dim()));
  row("experts E / top-k", std::to_string(c.experts) + " / " + std::to_string(c.topk));
  row("expert_dim I", std::to_string(c.expert_dim) + (c.shared_expert ? " (+ shared expert)" : ""));
  row("router", std::string(c.score_fn ? "sigmoid" : "softmax") + (c.renorm ? ", renormalised" : ""));
  row("seq_len T", std::to_string(c.seq_len));
  row("parameters", std::to_string(param_count(c)) + " (" + std::to_string(active_param_count(c)) + " active)");
  row("ranks W / E_p / D", std::to_string(m.par.world.size) + " / " + std::to_string(m.par.ep.size) + " / " +
                               std::to_string(m.par.seq.size) + (m.par.seq.size > 1 ? " (sequence groups: T/D tokens per rank)" : ""));
  // Each region as this rank holds it (the expert stacks of its E/E_p experts) and the shard it updates;
  // under --zero 3 the dense groups together, of which the rank keeps only the shards.
  size_t dense_count = 0, dense_kept = 0;
  for (const ParamRegion& r : m.regions) {
    if (r.gathered) {
      dense_count += r.count;
      dense_kept += r.shard;
      continue;
    }
    row(r.sharding == Sharding::Expert  ? "experts / shard"
        : r.sharding == Sharding::Vocab ? "vocab rows / shard"
                                        : "replicated / shard",
        std::to_string(r.count) + " / " + std::to_string(r.shard) + " per rank");
  }
  if (m.zero3.on())
    row("dense / kept (ZeRO-3)", std::to_string(dense_count) + " / " + std::to_string(dense_kept) + " per rank, " +
                                     std::to_string(m.zero3.groups.size()) + " groups gathered in turn");
  row("batch B / accum", std::to_string(t.batch) + " / " + std::to_string(accum) + " per rank");
  row("tokens per step", std::to_string((long long)t.batch * c.seq_len * accum * m.par.world.size / m.par.seq.size));
  row("steps / warmup", std::to_string(t.steps) + " / " + std::to_string(t.warmup));
  char buf[64];
  snprintf(buf, sizeof buf, "%.2e -> %.2e", t.lr, t.lr * t.min_lr_frac);
  row("lr (cosine)", buf);
  snprintf(buf, sizeof buf, "%.3g / %.3g", t.weight_decay, t.grad_clip);
  row("weight decay / clip", buf);
  snprintf(buf, sizeof buf, "%.3g", t.bias_update);
  row("router bias u", buf);
  row("recompute", t.recompute ? "layer-level" : "off");
  row("optimizer step", update_beside_next_forward(m, t) ? "beside the next forward (--overlap_update 1)"
                        : t.overlap_update ? "after the backward (--overlap_update 1 needs one rank, adamw, BF16, --zero 1)"
                                           : "after the backward (--overlap_update 0)");
  row("weight gradients", t.wgrad_stream ? "beside the input gradients, on their own stream (--wgrad_stream 1)"
                                         : "on the compute stream (--wgrad_stream 0)");
  const std::string graph_refusal = cuda_graph_refusal(t, sizeof(floatX) == 2);
  row("cuda graph", graph_refusal.empty() ? "each kind of pass captured once, then launched (--cuda_graph 1)" : graph_refusal);
  // SCO (ops/sco.cuh): the boundaries of one training micro-batch that the budget sends to pinned host memory
  const ScoPlan sco = sco_plan(c.layers, (size_t)t.batch * c.seq_len * c.hidden * sizeof(floatX), t.offload_budget);
  if (t.offload_budget > 0) {
    snprintf(buf, sizeof buf, "%d of %d, %.1f MiB", sco.count, c.layers, sco.host_bytes / 1048576.0);
    row("offloaded boundaries", buf);
  }
  row("routing", t.routing);
  row("record routing", t.record_routing.empty() ? "off" : t.record_routing);
  row("seams moe/head/opt", moe_dispatcher(t) + " / " + t.head + " / " + t.optimizer);
  for (const auto& [name, value] : seam_startup_rows(t, c)) row(name.c_str(), value);  // the chosen ones' settings
  snprintf(buf, sizeof buf, "%.0f TFLOP/s", peak_flops / 1e12);
  row("MFU peak basis", buf);
  row("out dir", t.out_dir);
  printf("+----------------------+------------------------------+\n");
  printf("memory: weights %.1f MiB, grads %.1f MiB, optimizer %.1f MiB (pinned host: %.1f MiB)\n",
         pool().live(Mem::Weights) / 1048576.0, pool().live(Mem::Grads) / 1048576.0,
         pool().live(Mem::Optimizer) / 1048576.0, m.opt->host_bytes() / 1048576.0);
  if (t.recompute)
    printf("layer boundaries: %.1f MiB each, %d on the host (%.1f MiB pinned), at most %.1f MiB on the device (%.1f MiB "
           "without SCO)\n",
           sco.boundary_bytes / 1048576.0, sco.count, sco.host_bytes / 1048576.0, sco_device_peak(sco) / 1048576.0,
           (c.layers + 1) * sco.boundary_bytes / 1048576.0);
}

// Writes the pool's event timeline of one step to OUT/timeline_stepS.csv and plots it with
// tools/plot_timeline.sh. Only rank 0 records it (the other ranks' pools are not shown). Its time
// axis is host time: when the host issued each alloc/free, ahead of the GPU's work (runtime/pool.cuh).
void write_timeline(const std::string& out_dir, int step) {
  std::string csv = out_dir + "/timeline_step" + std::to_string(step) + ".csv";
  if (!pool().write_csv(csv.c_str())) {
    fprintf(stderr, "warning: could not write %s\n", csv.c_str());
    return;
  }
  std::string png = out_dir + "/timeline_step" + std::to_string(step) + ".png";
  std::string cmd = "tools/plot_timeline.sh '" + csv + "' '" + png + "' > /dev/null 2>&1";
  bool plotted = system(cmd.c_str()) == 0;
  printf("memory timeline of step %d: %s%s\n", step, csv.c_str(),
         plotted ? (", plot " + png).c_str() : " (no plot: tools/plot_timeline.sh failed; is gnuplot installed?)");
}

// --profile_step: the step's GPU time per operator (runtime/profile.cuh) to stdout and to
// OUT/profile_stepS.md. `step_ms` is the step's host wall time (the same clock as the log's ms).
// `waits`: the host's waits for the GPU during the step (runtime/stream.cuh, host_waits).
void write_profile(const std::string& out_dir, int step, double step_ms, long long waits, const ModelConfig& c, int B,
                   int T, int accum) {
  double gpu_ms = 0;
  const std::vector<ProfileRow> rows = profiler().end(&gpu_ms);
  char title[512];
  snprintf(title, sizeof title,
           "per-operator GPU time of step %d (%s; H %d, L %d, heads %d, E %d, top-%d, I %d, V %d, T %d, B %d, accum %d; "
           "%lld host waits for the GPU)",
           step, sizeof(floatX) == 2 ? "BF16" : "FP32", c.hidden, c.layers, c.heads, c.experts, c.topk, c.expert_dim,
           c.vocab, T, B, accum, waits);
  print_profile(stdout, rows, gpu_ms, step_ms, title);
  const std::string path = out_dir + "/profile_step" + std::to_string(step) + ".md";
  if (FILE* f = fopen(path.c_str(), "w")) {
    print_profile(f, rows, gpu_ms, step_ms, title);
    fclose(f);
    printf("per-operator breakdown of step %d: %s\n", step, path.c_str());
  } else {
    fprintf(stderr, "warning: could not write %s\n", path.c_str());
  }
}

// The communicators of W ranks: the world, the expert-parallel groups (contiguous blocks of E_p
// ranks) and the groups of ranks that hold the same expert shard; under --head ring_dtp with P > 1
// the vocabulary groups (contiguous blocks of P ranks) and, when W > P, the ranks that hold the
// same vocabulary interval. A group of one rank that nothing exchanges over gets no NCCL
// communicator (a Comm of size 1): each costs some 390 MiB of device memory (notes/sco.md, the device
// ledger). ep_exchanges: the MoE dispatcher exchanges over the ep group (config.hpp: SeamNeeds::ExpertGroup).
// Under --sp D > 1 the sequence groups (contiguous blocks of D ranks), over which attention exchanges.
Parallel parallel_init(const LaunchInfo& li, int ep_size, bool ep_exchanges, int vocab_size, int seq_size, int zero) {
  Parallel par;
  par.zero = zero;
  if (li.world == 1) {
    const int device = rank_device(li);
    cudaCheck(cudaSetDevice(device), "parallel_init", "W=1 device=%d", device);
    return par;
  }
  par.world = comm_world_init(li);
  if (ep_size > 1 || ep_exchanges) par.ep = comm_block_group(par.world, ep_size, "ep");
  if (li.world > ep_size)
    par.expert_replicas = comm_split(par.world, par.world.rank % ep_size, par.world.rank, "expert_replicas");
  if (vocab_size > 1) par.vocab = comm_block_group(par.world, vocab_size, "vocab");
  if (vocab_size > 1 && li.world > vocab_size)
    par.vocab_replicas = comm_split(par.world, par.world.rank % vocab_size, par.world.rank, "vocab_replicas");
  if (seq_size > 1) par.seq = comm_block_group(par.world, seq_size, "seq");
  if (zero == 3) par.dense = comm_block_group(par.world, li.world, "dense");
  return par;
}

void parallel_destroy(Parallel& par) {
  for (Comm* c : {&par.dense, &par.seq, &par.vocab_replicas, &par.vocab, &par.expert_replicas, &par.ep, &par.world}) comm_destroy(*c);
}

// flags → data → model → loop → checkpoints
int train_main(int argc, char** argv) {
  ModelConfig mc;
  TrainConfig tc;
  std::vector<std::string> given_flags;  // --plan auto keeps these as given
  try {
    parse_flags(argc, argv, mc, tc, &given_flags);
  } catch (const FlagError& e) {
    if (std::string(e.what()) == "help") {
      printf("%s", usage().c_str());
      return 0;
    }
    fprintf(stderr, "train: error: %s\n%s", e.what(), usage().c_str());
    return 1;
  }
  try {
    Tokenizer tok = Tokenizer::load(tc.tokenizer);
    if (mc.vocab == 0) mc.vocab = tok.vocab_size();
    if (mc.vocab < tok.vocab_size())
      throw std::invalid_argument("--vocab " + std::to_string(mc.vocab) + " is smaller than the tokenizer's " +
                                  std::to_string(tok.vocab_size()));
    validate(mc);
    validate(tc, mc);
    const std::string trace_path = data::routing_trace_path(tc.routing);  // --routing trace:FILE
    // Everything that can be checked before any GPU or NCCL work is checked here, at the world that
    // will run: the launcher's variables (launch() would refuse the same), the flags at that world,
    // the data (each shard holds a window of W ranks), the checkpoint set and whether it fits the
    // flags and the data, the routing trace to replay, where --record_routing and --out will write.
    LaunchEnv started;
    const std::string launch_refusal =
        parse_launch_env([](const char* name) -> const char* { return getenv(name); }, tc.gpus, &started);
    if (!launch_refusal.empty()) launch_fail("%s", launch_refusal.c_str());
    TrainConfig run_tc = tc;  // under mpirun/srun --gpus may be left out: the world is the launcher's
    run_tc.gpus = started.world;
    validate(run_tc, mc);
    const int data_ranks = started.world / tc.sp;  // the sequence groups read as data-parallel ranks
    DataLoader check_train(tc.train_pattern, tc.batch, mc.seq_len, mc.vocab, 0, data_ranks);
    { DataLoader check_val(tc.val_pattern, tc.batch, mc.seq_len, mc.vocab, 0, data_ranks); }
    if (!tc.resume.empty())
      check_resume_fits(tc.resume, ckpt::check_checkpoint_set(tc.resume, started.world, sizeof(floatX) == 2), mc,
                        run_tc, check_train);
    if (!trace_path.empty())
      data::check_routing_trace_fits(data::read_routing_trace(trace_path),
                                     routing_trace_shape(mc, tc.batch * mc.seq_len, started.world));
    if (!tc.record_routing.empty()) data::check_routing_trace_target(tc.record_routing);
    struct stat out_st;
    if (stat(tc.out_dir.c_str(), &out_st) == 0 && !S_ISDIR(out_st.st_mode))
      throw std::invalid_argument("--out " + tc.out_dir + " exists and is not a folder");
    refuse_foreign_outputs(tc);
    if (tc.dry_run && gpu_count() == 0) {  // the prediction is host arithmetic: no GPU needed
      const TrainConfig planned =
          tc.plan == "auto" ? apply_plan_auto(mc, run_tc, given_flags, parallel_shape_of(run_tc), tc.batch, mc.seq_len / tc.sp,
                                              tc.total_batch ? tc.total_batch / (tc.batch * mc.seq_len) : 1,
                                              capacity_without_gpu(run_tc), 0, run_tc.share_gpus ? run_tc.gpus : 1, true,
                                              argc, argv)
                            : run_tc;
      print_memory_plan(plan_memory_without_gpu(mc, planned), mc);
      return 0;
    }
    const int gpus = gpu_count();
    if (gpus == 0) {
      fprintf(stderr, "train: error: no CUDA device found; flatmoe trains on NVIDIA GPUs (see README)\n");
      return 1;
    }
    // W processes, one per GPU (or sharing them: --share_gpus 1): started here (--gpus W) or by
    // mpirun/srun; the launching parent waits for its children and never returns from launch().
    if (tc.share_gpus && setenv("FLATMOE_SHARE_GPUS", "1", 1) != 0) throw std::runtime_error("setenv FLATMOE_SHARE_GPUS");
    if (started.mode == LaunchMode::Launcher) {
      const std::string refused = launcher_gpus_refusal(tc.gpus, gpus, gpu_sharing());
      if (!refused.empty()) throw std::invalid_argument(refused);
    }
    LaunchInfo li = launch(argc, argv, tc.gpus);
    if (tc.gpus != 1 && tc.gpus != li.world)
      throw std::invalid_argument("--gpus " + std::to_string(tc.gpus) + " differs from the " + std::to_string(li.world) +
                                  " ranks started by the launcher");
    tc.gpus = li.world;
    validate(tc, mc);
    // Each rank reads the trace again and keeps its own part (the launcher process keeps none of it).
    std::unique_ptr<data::RankRoutes> replay;
    if (!trace_path.empty()) {
      const data::RoutingTrace trace = data::read_routing_trace(trace_path);
      data::check_routing_trace_fits(trace, routing_trace_shape(mc, tc.batch * mc.seq_len, li.world));
      replay = std::make_unique<data::RankRoutes>(data::rank_routes(trace, li.rank));
    }
    Parallel par = parallel_init(li, tc.ep ? tc.ep : tc.gpus,
                                 find_choice(moe_choices(), moe_dispatcher(tc))->needs == SeamNeeds::ExpertGroup,
                                 vocab_group_size(tc), tc.sp, tc.zero);
    runtime_prepare();  // the cuBLAS handle and its pooled workspace, before anything is measured
    const bool main_rank = par.world.rank == 0;
    const int W = par.world.size;
    // the sequence group reads as data-parallel rank `group` of W/D, each rank keeping its slice (--sp)
    const SequenceSplit split = sequence_split(par.world.rank, W, mc.heads, mc.seq_len, tc.sp);
    DataLoader train_data(tc.train_pattern, tc.batch, mc.seq_len, mc.vocab, split.group, split.groups);
    DataLoader val_data(tc.val_pattern, tc.batch, mc.seq_len, mc.vocab, split.group, split.groups);
    train_data.keep_tokens(split.first_token, split.end_token);
    val_data.keep_tokens(split.first_token, split.end_token);
    // Validation reads each window of the validation shards at most once (W ranks, disjoint slices).
    const int val_batches = (int)std::min<long long>(tc.val_batches, val_data.windows_per_epoch());
    make_dirs(tc.out_dir);

    const int B = tc.batch, T = mc.seq_len / tc.sp;  // T: this rank's tokens of each sequence
    const int accum = tc.total_batch ? tc.total_batch / (B * mc.seq_len) : 1;
    cudaStream_t stream = stream_create("train", StreamPriority::Compute);  // each communicator has its own
    const std::vector<bool> sharing = ranks_sharing_this_gpu(par.world);
    const int ranks_on_gpu = (int)std::count(sharing.begin(), sharing.end(), true);
    const DeviceNow device = device_now_agreed(par.world, sharing);  // before the model allocates
    if (tc.plan == "auto")  // every rank alike: rank 0's shape, the GPU as every rank agreed it
      tc = apply_plan_auto(mc, tc, given_flags, parallel_shape_of(tc), B, T, accum, device.capacity, device.outside,
                           ranks_on_gpu, main_rank, argc, argv);
    const RankMemoryPlan memory_plan = plan_memory(mc, tc, par, B, T, device.capacity, device.outside, ranks_on_gpu);
    if (tc.dry_run) {  // the prediction is the whole answer: nothing is allocated or trained
      if (main_rank) print_memory_plan(memory_plan, mc);
      parallel_destroy(par);
      runtime_release();
      return 0;
    }
    TrainState st;
    Model m;
    if (!tc.resume.empty()) {
      m = checkpoint_load(tc.resume, tc, par, stream, st);
      train_data.set_state(st.train_data);
      if (main_rank) printf("resumed from %s at step %d\n", tc.resume.c_str(), st.step);
    } else {
      m = model_create(mc, tc.seed, par, stream, seams_from(tc, mc));
    }
    m.attention_kept = memory_plan.attention_kept;
    m.routing_override = tc.routing != "router" && trace_path.empty();
    if (m.routing_override) m.routing = parse_routing_profile(tc.routing);
    m.replay = std::move(replay);
    m.graphs.on = cuda_graph_refusal(tc, sizeof(floatX) == 2).empty();  // --cuda_graph (model.cuh's model_pass)
    // --record_routing: this run's training passes, from where it starts (a resume: its checkpoint's step)
    m.record_routing = !tc.record_routing.empty();
    const long long passes = (long long)(tc.steps - st.step) * accum;
    if (m.record_routing && (passes < 1 || passes > INT32_MAX))
      throw std::invalid_argument("--record_routing " + tc.record_routing + ": " + std::to_string(passes) +
                                  " training passes from step " + std::to_string(st.step) + " to --steps " +
                                  std::to_string(tc.steps) + " (a trace holds 1 to 2^31 - 1)");
    if (m.record_routing && main_rank)
      m.routing_record = std::make_unique<data::RoutingTraceWriter>(
          tc.record_routing, routing_trace_shape(mc, B * T, W), (long long)st.step * accum, (int)passes);
    const double peak_flops = peak_flops_for_build() * W;
    const bool shared = gpu_sharing() && W > 1;
    if (main_rank) {
      if (shared) printf("%s\n", sharing_banner(W, std::min(W, gpus)).c_str());
      print_config(mc, tc, m, accum, peak_flops / W);
      print_memory_plan(memory_plan, mc);
      printf("validation: %d batches x %d ranks x %d x %d = %lld distinct tokens of the %lld in %s%s\n", val_batches, W, B, T,
             (long long)val_batches * W * B * T, val_data.num_tokens(), tc.val_pattern.c_str(),
             val_batches < tc.val_batches ? (" (--val_batches " + std::to_string(tc.val_batches) +
                                              " capped at the windows they hold)").c_str() : "");
    }

    std::mt19937_64 sample_rng(tc.seed ^ 0x5eedULL);
    sample_rng.discard(st.sample_rng_draws);
    const double tokens_per_step = (double)B * T * accum * W;
    const double flops_per_step = flops_per_token(mc) * tokens_per_step;
    FILE* log = nullptr;
    if (main_rank) {
      std::string log_path = tc.out_dir + "/log.csv";
      log = fopen(log_path.c_str(), st.step > 0 ? "a" : "w");
      if (!log) throw std::runtime_error("cannot write " + log_path);
      // ranks_per_gpu > 1: ranks shared GPUs (--share_gpus 1), and ms, tokens_per_s and mfu are not GPU timings
      // a header in a new file, a resumed run's log in a new --out folder included
      if (fseek(log, 0, SEEK_END) != 0) throw std::runtime_error("cannot seek in " + log_path);
      if (ftell(log) == 0) fprintf(log, "step,train_loss,val_loss,lr,grad_norm,ms,tokens_per_s,mfu,peak_alloc_mib,expert_load_max_mean,router_bias_min,router_bias_max,ranks_per_gpu\n");
    }

    const int first_step = st.step;
    if (tc.profile_step >= 0 && tc.profile_step < first_step)
      throw std::invalid_argument("--profile_step " + std::to_string(tc.profile_step) + " comes before step " +
                                  std::to_string(first_step) + ", where this run resumes");
    for (int step = first_step; step <= tc.steps; step++) {
      bool last = step == tc.steps;
      bool resumed_here = step == first_step && first_step > 0;  // already sampled/saved before the resume
      if (tc.val_every > 0 && (step % tc.val_every == 0 || last)) {
        float val_loss = validation_loss(m, val_data, val_batches, B, T);
        if (main_rank) {
          printf("step %5d | val loss %.4f\n", step, val_loss);
          fprintf(log, "%d,nan,%.6f,nan,nan,nan,nan,nan,nan,nan,nan,nan,%d\n", step, val_loss, ranks_on_gpu);
        }
      }
      if (tc.sample_every > 0 && step > 0 && !resumed_here && (step % tc.sample_every == 0 || last)) {
        // every rank samples the same context (same weights, same generator): expert-parallel
        // layers need all of them in every collective
        std::string text = generate_sample(m, tok, tc.sample_len, sample_rng, st.sample_rng_draws);
        if (main_rank) printf("---- sample at step %d ----\n%s\n---------------------------\n", step, text.c_str());
      }
      if (step > 0 && !resumed_here && tc.ckpt_every > 0 && (step % tc.ckpt_every == 0 || last)) {
        st.step = step;
        st.train_data = train_data.state();
        char name[64];
        snprintf(name, sizeof name, "/ckpt_%06d", step);
        checkpoint_save(tc.out_dir + name, m, tc, st);
        if (main_rank) printf("checkpoint written: %s%s\n", tc.out_dir.c_str(), name);
      }
      if (last) break;

      // one optimizer step: accumulate gradients over `accum` micro-batches on every rank
      bool timeline = step == tc.timeline_step && main_rank;
      pool().reset_peak();
      if (timeline) { pool().clear_timeline(); pool().set_timeline(true); }
      stream_wait(stream, "train", "step=%d", step);
      const bool profile = step == tc.profile_step && main_rank;  // --profile_step: CUDA events per operator
      if (profile) profiler().begin(stream);
      const long long waits_before = host_waits();
      auto t0 = std::chrono::steady_clock::now();
      float norm = 0.f, lr = lr_at(tc, step);
      double loss = model_train_step(m, tc, step, B, T, accum, [&](int* xb, int* yb) { train_data.next_batch(xb, yb); }, &norm);
      double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (profile) write_profile(tc.out_dir, step, ms, host_waits() - waits_before, mc, B, T, accum);
      if (timeline) { pool().set_timeline(false); write_timeline(tc.out_dir, step); }
      if (!std::isfinite(loss)) throw std::runtime_error("loss is not finite at step " + std::to_string(step));
      if (!main_rank) continue;
      double tok_s = tokens_per_step / (ms / 1e3);
      double mfu = flops_per_step / (ms / 1e3) / peak_flops;
      size_t free_b = 0, total_b = 0;
      cudaCheck(cudaMemGetInfo(&free_b, &total_b), "train", "meminfo");
      const ExpertBalance bal = expert_balance(m);  // global loads of this step
      if (step == first_step) {
        printf("memory after the first step (rank 0): %s\n", device_memory_report().c_str());
        printf("memory prediction vs the first step (rank 0): predicted %.1f MiB, measured pool peak %.1f MiB (%+.1f %%); "
               "its blocks as held from CUDA %.1f MiB\n",
               memory_plan.predicted.total() / 1048576.0, pool().peak() / 1048576.0,
               100.0 * ((double)memory_plan.predicted.total() / pool().peak() - 1), pool().peak_held() / 1048576.0);
      }
      if (step % tc.log_every == 0 || step == tc.steps - 1)
        printf("step %5d/%d | loss %.4f | lr %.2e | norm %.3f | %.1f ms | %.0f tok/s | MFU %.1f%% | experts max/mean "
               "%.2f, bias [%.3f, %.3f] | peak %.1f MiB (device used %.1f MiB)%s%s\n",
               step + 1, tc.steps, loss, lr, norm, ms, tok_s, 100 * mfu, bal.worst_max_over_mean, bal.bias_min,
               bal.bias_max, pool().peak() / 1048576.0, (total_b - free_b) / 1048576.0, W > 1 ? " [rank 0]" : "",
               shared ? " [shared GPU: not GPU timings]" : "");
      fprintf(log, "%d,%.6f,nan,%.6e,%.6f,%.3f,%.1f,%.5f,%.2f,%.4f,%.6f,%.6f,%d\n", step + 1, loss, lr, norm, ms, tok_s,
              mfu, pool().peak() / 1048576.0, bal.worst_max_over_mean, bal.bias_min, bal.bias_max, ranks_on_gpu);
      fflush(log);
    }
    if (m.graphs.on && main_rank) {
      std::string kinds;
      for (const auto& g : m.graphs.entries) {
        if (!g->eager_why.empty()) kinds += "; a kind of pass stays eager: " + g->eager_why;
        else if (g->work.exec != nullptr) kinds += "; a graph of " + std::to_string(g->work.nodes) + " nodes";
      }
      printf("cuda graph: %lld captures, %lld launches%s\n", m.graphs.captures, m.graphs.launches, kinds.c_str());
    }
    if (m.routing_record) {
      m.routing_record->commit();
      printf("routing trace written: %s (%d training passes)\n", tc.record_routing.c_str(), m.routing_record->written());
    }
    if (log) fclose(log);
    model_destroy(m);
    profiler().release();
    parallel_destroy(par);
    cudaCheck(cudaStreamDestroy(stream), "train", "stream");
    runtime_release();  // every device allocation back to CUDA: a clean leak check at exit
  } catch (const std::exception& e) {
    fprintf(stderr, "train: error: %s\n", e.what());
    return 1;
  }
  return 0;
}

int main(int argc, char** argv) { return train_main(argc, argv); }
