// Flags and model dimensions: every bad input is refused with a message that names it, and the
// trainer binary exits non-zero on it without touching the output directory.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <string>
#include <tuple>
#include <vector>
#include "../checkpoint.hpp"
#include "../config.hpp"
#include "../data/routing_trace.hpp"
#include "../data/shards.hpp"
#include "../data/tokenizer.hpp"
#include "test_util.hpp"

namespace {

// Parses argv-style flags; returns the error message ("" if accepted).
std::string parse_error(std::vector<std::string> args) {
  args.insert(args.begin(), "train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(&a[0]);
  ModelConfig m;
  TrainConfig t;
  try {
    parse_flags((int)argv.size(), argv.data(), m, t);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string validate_error(const ModelConfig& m) {
  try {
    validate(m);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::string validate_error(const TrainConfig& t, const ModelConfig& m) {
  try {
    validate(t, m);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

ModelConfig valid_model() {
  ModelConfig m;
  m.vocab = 512;
  return m;
}

// Every TrainConfig field, each once.
using T = TrainConfig;
const std::vector<std::string T::*> kTrainTexts = {&T::data_dir, &T::train_pattern, &T::val_pattern, &T::tokenizer,
                                                   &T::out_dir,  &T::resume,        &T::routing,     &T::record_routing,
                                                   &T::moe,      &T::head,          &T::optimizer,   &T::ring_dtp,
                                                   &T::relay_mode, &T::device_budget, &T::device_capacity, &T::plan};
const std::vector<int T::*> kTrainInts = {&T::batch,      &T::total_batch,  &T::steps,      &T::warmup,
                                          &T::recompute,  &T::overlap_update, &T::wgrad_stream, &T::cuda_graph, &T::val_every, &T::val_batches, &T::sample_every,
                                          &T::sample_len, &T::ckpt_every,   &T::log_every,  &T::timeline_step, &T::profile_step,
                                          &T::gpus,       &T::share_gpus,   &T::ep,           &T::llep_min_rows, &T::token_budget,
                                          &T::kmax,       &T::offload_bucket, &T::offload_slots, &T::vocab_group,
                                          &T::vocab_block, &T::dry_run,     &T::sp,            &T::zero,  &T::attention_groups};
const std::vector<float T::*> kTrainFloats = {&T::lr,    &T::min_lr_frac, &T::weight_decay, &T::beta1,
                                              &T::beta2, &T::adam_eps,    &T::grad_clip,    &T::bias_update,
                                              &T::llep_alpha};
const std::vector<long long T::*> kTrainInt64s = {&T::offload_budget};
const size_t kTrainFields = kTrainTexts.size() + kTrainInts.size() + kTrainFloats.size() + kTrainInt64s.size() + 1;  // + seed

float random_finite_float(testutil::Rng& rng) {  // any finite bit pattern, denormals included
  for (;;) {
    const uint32_t bits = (uint32_t)rng.gen();
    float x;
    std::memcpy(&x, &bits, sizeof x);
    if (std::isfinite(x)) return x;
  }
}

// Every field random, and (with overwhelming probability) different from its default.
TrainConfig random_train(testutil::Rng& rng) {
  TrainConfig t;
  for (std::string T::*field : kTrainTexts) {
    t.*field = std::string(rng.integer(8, 24), ' ');
    for (char& c : t.*field) c = char(rng.integer(32, 126));  // printable ASCII, spaces included
  }
  for (int T::*field : kTrainInts) t.*field = rng.integer(-2147483647, 2147483647);
  for (float T::*field : kTrainFloats) t.*field = random_finite_float(rng);
  for (long long T::*field : kTrainInt64s) t.*field = (long long)rng.gen();
  t.seed = rng.gen();
  return t;
}

std::string set_train_flag_error(const std::string& flag, const std::string& value) {
  TrainConfig t;
  try {
    set_train_flag(t, flag, value);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(ConfigFlags, AcceptsEveryDocumentedFlag) {
  EXPECT_EQ(parse_error({"--hidden", "128", "--layers", "2", "--heads", "2", "--experts", "4", "--topk", "1",
                         "--expert_dim", "64", "--n_dense", "1", "--dense_dim", "256", "--shared_expert", "1",
                         "--seq_len", "64", "--score", "sigmoid", "--renorm", "0", "--batch", "4", "--steps", "10",
                         "--lr", "3e-4", "--seed", "7", "--recompute", "1", "--data", "somewhere"}),
            "");
}

TEST(ConfigFlags, RefusesUnknownMissingAndMalformed) {
  EXPECT_NE(parse_error({"--hiden", "128"}).find("unknown flag --hiden"), std::string::npos);
  EXPECT_NE(parse_error({"--hidden"}).find("needs a value"), std::string::npos);
  EXPECT_NE(parse_error({"--hidden", "12x"}).find("expects an integer"), std::string::npos);
  EXPECT_NE(parse_error({"--lr", "fast"}).find("expects a number"), std::string::npos);
  EXPECT_NE(parse_error({"--lr", "nan"}).find("expects a number"), std::string::npos);
  EXPECT_NE(parse_error({"--score", "relu"}).find("softmax or sigmoid"), std::string::npos);
  EXPECT_NE(parse_error({"--seed", "-3"}).find("non-negative"), std::string::npos);
  EXPECT_NE(parse_error({"--out", ""}).find("non-empty"), std::string::npos);
}

// Numbers are read as written: a seed past 2^64 − 1 is not wrapped, and a leading space is not skipped
// (strtoull would read " -1" as 2^64 − 1); the same for every integer and float flag.
TEST(ConfigFlags, RefusesNumbersPastTheirRangeOrWithALeadingSpace) {
  for (const char* seed : {"99999999999999999999999", "18446744073709551616", " -1", " 5", "+5"})
    EXPECT_NE(parse_error({"--seed", seed}).find("flag --seed expects a non-negative integer below 2^64, got '" +
                                                std::string(seed) + "'"),
              std::string::npos)
        << seed;
  EXPECT_EQ(parse_error({"--seed", "18446744073709551615"}), "");
  EXPECT_NE(parse_error({"--steps", " 5"}).find("flag --steps expects an integer, got ' 5'"), std::string::npos);
  EXPECT_NE(parse_error({"--steps", "99999999999"}).find("expects an integer"), std::string::npos);
  EXPECT_NE(parse_error({"--offload_budget", " 5"}).find("expects an integer"), std::string::npos);
  EXPECT_NE(parse_error({"--lr", " 0.1"}).find("expects a number"), std::string::npos);
}

// --name=value is refused the same way wherever it stands (the last word included), saying how to
// write it.
TEST(ConfigFlags, RefusesNameEqualsValueUniformly) {
  const std::string said = "flag --steps=10: give the value as the next word, --steps 10 (flags take no '=')";
  EXPECT_EQ(parse_error({"--steps=10"}), said);
  EXPECT_EQ(parse_error({"--steps=10", "--batch", "2"}), said);
  EXPECT_EQ(parse_error({"--batch", "2", "--steps=10"}), said);
}

TEST(ConfigFlags, RefusesWordsThatAreNotFlags) {
  EXPECT_EQ(parse_error({"12"}), "unexpected argument '12'");
  EXPECT_EQ(parse_error({"--steps", "5", "foo"}), "unexpected argument 'foo'");
}

TEST(ConfigFlags, TrainFlagValuesReadBackAsEveryField) {
  testutil::Rng rng;
  const TrainConfig written = random_train(rng);
  const std::vector<std::pair<std::string, std::string>> values = train_flag_values(written);
  const std::vector<std::pair<std::string, std::string>> defaults = train_flag_values(TrainConfig());
  std::set<std::string> flags;
  TrainConfig read;  // defaults, then every value set from its text
  for (size_t i = 0; i < values.size(); i++) {
    flags.insert(values[i].first);
    EXPECT_NE(values[i].second, defaults[i].second) << values[i].first;
    set_train_flag(read, values[i].first, values[i].second);
  }
  EXPECT_EQ(values.size(), kTrainFields) << "one flag per TrainConfig field";
  EXPECT_EQ(flags.size(), values.size()) << "no flag twice";
  for (std::string T::*field : kTrainTexts) EXPECT_EQ(read.*field, written.*field);
  for (int T::*field : kTrainInts) EXPECT_EQ(read.*field, written.*field);
  for (float T::*field : kTrainFloats) EXPECT_EQ(std::memcmp(&(read.*field), &(written.*field), sizeof(float)), 0);
  for (long long T::*field : kTrainInt64s) EXPECT_EQ(read.*field, written.*field);
  EXPECT_EQ(read.seed, written.seed);
}

TEST(ConfigFlags, ModelFlagValuesParseBackAsEveryField) {
  testutil::Rng rng;
  ModelConfig written;
  for (int ModelConfig::*field : {&ModelConfig::vocab, &ModelConfig::hidden, &ModelConfig::layers, &ModelConfig::heads,
                                  &ModelConfig::experts, &ModelConfig::topk, &ModelConfig::expert_dim,
                                  &ModelConfig::n_dense, &ModelConfig::dense_dim, &ModelConfig::shared_expert,
                                  &ModelConfig::seq_len, &ModelConfig::renorm})
    written.*field = rng.integer(-2147483647, 2147483647);
  written.score_fn = 1 - ModelConfig().score_fn;
  for (float ModelConfig::*field : {&ModelConfig::rope_theta, &ModelConfig::norm_eps, &ModelConfig::init_std})
    written.*field = random_finite_float(rng);
  std::vector<std::string> args;
  for (const auto& [flag, value] : model_flag_values(written)) args.insert(args.end(), {flag, value});
  EXPECT_EQ(args.size(), 2 * 16u) << "one flag per ModelConfig field";
  args.insert(args.begin(), "train");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(&a[0]);
  ModelConfig read;
  TrainConfig t;
  parse_flags((int)argv.size(), argv.data(), read, t);
  EXPECT_EQ(std::memcmp(&read, &written, sizeof(ModelConfig)), 0);
}

TEST(ConfigFlags, SetTrainFlagRefusesUnknownFlagsAndMalformedValues) {
  EXPECT_EQ(set_train_flag_error("--hidden", "128"), "unknown flag --hidden");  // a model flag
  EXPECT_EQ(set_train_flag_error("--lr", "fast"), "flag --lr expects a number, got 'fast'");
  EXPECT_EQ(set_train_flag_error("--seed", "-1"), "flag --seed expects a non-negative integer below 2^64, got '-1'");
  EXPECT_EQ(set_train_flag_error("--resume", ""), "") << "a free-text flag may be empty: an unset --resume is";
}

TEST(ConfigFlags, FloatsAreWrittenAsTheShortestTextThatReadsBackExactly) {
  EXPECT_EQ(float_text(1e-3f), "0.001");
  EXPECT_EQ(float_text(0.95f), "0.95");
  EXPECT_EQ(float_text(1e-8f), "1e-08");
  EXPECT_EQ(float_text(10000.f), "1e+04");  // printf's %g: the fewest significant digits
  testutil::Rng rng;
  for (int i = 0; i < 1000; i++) {
    const float x = random_finite_float(rng), back = strtof(float_text(x).c_str(), nullptr);
    EXPECT_EQ(std::memcmp(&x, &back, sizeof x), 0) << float_text(x);
  }
}

TEST(ConfigDims, RefusesInconsistentDimensions) {
  ModelConfig m = valid_model();
  EXPECT_EQ(validate_error(m), "");
  m = valid_model(); m.hidden = 250;
  EXPECT_NE(validate_error(m).find("divisible by heads"), std::string::npos);
  m = valid_model(); m.hidden = 96; m.heads = 2;  // hd = 48
  EXPECT_NE(validate_error(m).find("head dim"), std::string::npos);
  m = valid_model(); m.topk = 9; m.experts = 16;
  EXPECT_NE(validate_error(m).find("topk"), std::string::npos);
  m = valid_model(); m.topk = 4; m.experts = 3;
  EXPECT_NE(validate_error(m).find("topk"), std::string::npos);
  m = valid_model(); m.n_dense = m.layers + 1;
  EXPECT_NE(validate_error(m).find("n_dense"), std::string::npos);
  m = valid_model(); m.experts = 0;
  EXPECT_NE(validate_error(m).find("experts"), std::string::npos);
  m = valid_model(); m.seq_len = 1;
  EXPECT_NE(validate_error(m).find("seq_len"), std::string::npos);
  m = valid_model(); m.vocab = 1;
  EXPECT_NE(validate_error(m).find("vocab"), std::string::npos);
}

// The limits of the kernels, refused by validation before the GPU starts, each at its edge.
TEST(ConfigDims, RefusesSizesPastTheKernelsLimits) {
  ModelConfig m = valid_model();
  m.experts = 256; m.topk = 8;
  EXPECT_EQ(validate_error(m), "");
  m.experts = 257;
  EXPECT_EQ(validate_error(m), "experts must be in [1, 256] (got 257): the router's selection holds at most 256 experts");
  m = valid_model(); m.experts = 16; m.topk = 9;
  EXPECT_EQ(validate_error(m), "topk (9) must be in [1, min(experts, 8)]: the router picks at most 8 experts");
  m = valid_model(); m.seq_len = 65535 * 64;
  EXPECT_EQ(validate_error(m), "");
  m.seq_len = 65535 * 64 + 1;
  EXPECT_EQ(validate_error(m), "seq_len must be in [2, 4194240] (got 4194241): attention launches one block per 64 "
                               "positions on a grid dimension of at most 65535");

  TrainConfig t;
  m = valid_model(); m.seq_len = 2;
  t.batch = 65535;
  EXPECT_EQ(validate_error(t, m), "");
  t.batch = 65536;
  EXPECT_EQ(validate_error(t, m), "batch must be in [1, 65535] (got 65536): attention launches one block row per "
                                  "sequence on a grid dimension of at most 65535");
  t.batch = 0;
  EXPECT_EQ(validate_error(t, m), "batch must be in [1, 65535] (got 0): attention launches one block row per "
                                  "sequence on a grid dimension of at most 65535");
  // 32768 · 65536 = 2^31 tokens; 16384 · 65536 = 2^30 tokens, 2^31 routes at k = 2.
  m.seq_len = 65536; m.topk = 2;
  t.batch = 32768;
  EXPECT_EQ(validate_error(t, m),
            "batch·seq_len = 2147483648 tokens per micro-batch: the kernels index a rank's tokens with int (at most 2^31 − 1)");
  t.batch = 16384;
  EXPECT_EQ(validate_error(t, m),
            "batch·seq_len·topk = 2147483648 routes per micro-batch: the MoE kernels index routes with int (at most 2^31 − 1)");
  m.topk = 1;
  EXPECT_EQ(validate_error(t, m), "");
  m.topk = 2; m.n_dense = m.layers;  // no MoE layer: a dense FFN routes each token once
  EXPECT_EQ(validate_error(t, m), "");
}

TEST(ConfigDims, RefusesBatchNotDividingTotal) {
  ModelConfig m = valid_model();
  TrainConfig t;
  t.batch = 4;
  m.seq_len = 64;
  t.total_batch = 1000;
  EXPECT_THROW(validate(t, m), std::invalid_argument);
  t.total_batch = 4 * 64 * 3;
  EXPECT_NO_THROW(validate(t, m));
}

TEST(ConfigDims, RefusesRankLayoutsThatDoNotDivide) {
  ModelConfig m = valid_model();
  TrainConfig t;
  t.gpus = 4; t.ep = 3;
  EXPECT_THROW(validate(t, m), std::invalid_argument);  // E_p must divide W
  t.gpus = 6; t.ep = 3;                                 // divides W, but not E = 8
  EXPECT_THROW(validate(t, m), std::invalid_argument);
  t.gpus = 4; t.ep = 2;
  EXPECT_NO_THROW(validate(t, m));
  t.ep = 0;  // default: E_p = W = 4
  EXPECT_NO_THROW(validate(t, m));
  t.gpus = 0;
  EXPECT_THROW(validate(t, m), std::invalid_argument);
  // E_p is --gpus when --ep is left out: the message names the flag the user set
  t.gpus = 9999;
  t.ep = 0;
  EXPECT_EQ(validate_error(t, m), "experts (8) must be divisible by --gpus 9999 (E_p = W when --ep is left out)");
  t.gpus = 6;
  t.ep = 3;
  EXPECT_EQ(validate_error(t, m), "experts (8) must be divisible by --ep 3");
}

// --sp D: D must divide the ranks, the heads and the sequence (each that it does not is named), and what
// does not compose with sequence groups yet is refused naming both flags, never accepted and ignored.
TEST(ConfigDims, RefusesSequenceGroupsThatDoNotDivideOrDoNotComposeYet) {
  ModelConfig m = valid_model();  // nh = 6, T = 256
  TrainConfig t;
  t.gpus = 4;
  EXPECT_EQ(validate_error(t, m), "");  // --sp 1, the default
  t.sp = 2;
  EXPECT_EQ(validate_error(t, m), "");
  t.sp = 0;
  EXPECT_EQ(validate_error(t, m), "--sp must be >= 1 (the ranks of a sequence group), got 0");
  t.sp = 4;
  EXPECT_EQ(validate_error(t, m), "--sp 4: the sequence-parallel group size D = 4 does not divide the heads nh = 6");
  t.gpus = 6; t.ep = 2; t.sp = 6;
  m.seq_len = 255;
  EXPECT_EQ(validate_error(t, m),
            "--sp 6: the sequence-parallel group size D = 6 does not divide the sequence length T = 255");
  t.gpus = 3; t.ep = 1; t.sp = 2;
  EXPECT_EQ(validate_error(t, m), "--sp 2: the sequence-parallel group size D = 2 does not divide the ranks W = 3, "
                                  "the sequence length T = 255");
  m.seq_len = 256;
  t.gpus = 4; t.ep = 0; t.sp = 2;
  for (const char* moe : {"ep", "llep", "pllep", "relay"}) {
    t.moe = moe;
    EXPECT_EQ(validate_error(t, m), "") << "--moe " << moe;
  }
  t.moe = "";
  t.recompute = 1; t.offload_budget = 1 << 20; t.head = "ring_dtp"; t.optimizer = "offload_adamw";
  EXPECT_EQ(validate_error(t, m), "");
  t.device_budget = "0.5";  // the kept attention in both shards (ops/sar_plan.hpp)
  EXPECT_EQ(validate_error(t, m), "");
  t.device_budget = "0";
  t.plan = "auto";
  EXPECT_EQ(validate_error(t, m), "");
  t.plan = "off";
  t.routing = "trace:run.trace";
  EXPECT_EQ(validate_error(t, m), "--sp 2 with --routing trace:run.trace: routing traces are not built for sequence groups yet");
  t.routing = "router";
  t.record_routing = "run.trace";
  EXPECT_EQ(validate_error(t, m), "--sp 2 with --record_routing run.trace: routing traces are not built for sequence groups yet");
  t.record_routing = "";
  t.routing = "hot:1/2";  // a profile routes each rank's own tokens: it composes
  EXPECT_EQ(validate_error(t, m), "");
  TrainConfig data_parallel;  // what graphs capture at W > 1, but for the sequence split
  data_parallel.gpus = 2; data_parallel.ep = 1; data_parallel.sp = 2;
  EXPECT_EQ(cuda_graph_refusal(data_parallel, true), "off: --sp 2 exchanges q, k, v and attention's output inside every pass");
}

// --moe llep and pllep exchange routes between ranks; their settings must make a plan possible.
TEST(ConfigSeams, RefusesLLEPSettingsThatCannotRun) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  t.gpus = 2;
  for (const char* moe : {"ep", "llep", "pllep"}) {
    t.moe = moe;
    EXPECT_EQ(validate_error(t, m), "") << moe;
  }
  t.gpus = 1;
  EXPECT_EQ(validate_error(t, m), "--moe pllep exchanges routes between ranks: it needs --gpus > 1 (got 1)");
  t.gpus = 2;
  t.llep_alpha = 0.9f;
  EXPECT_NE(validate_error(t, m).find("llep_alpha must be >= 1"), std::string::npos) << validate_error(t, m);
  t.llep_alpha = 1.1f;
  t.llep_min_rows = 0;
  EXPECT_EQ(validate_error(t, m), "llep_min_rows must be >= 1, got 0");
  t.llep_min_rows = 1;
  t.kmax = 0;
  EXPECT_EQ(validate_error(t, m), "kmax must be >= 1, got 0");
  t.kmax = 1;
  t.moe = "ring";
  EXPECT_EQ(validate_error(t, m), "--moe expects one of local, ep, llep, pllep, relay, got 'ring'");
}

// --token_budget c: 0 (not given) is every dispatcher's default; c > 0 chunks the routes of --moe local
// and pllep, the dispatchers that read it, and is refused with any other, naming the flag and those that
// read it, before the GPU starts; a negative budget is refused whichever dispatcher runs.
TEST(ConfigSeams, TokenBudgetIsReadByLocalAndPllepAlone) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.token_budget, 0) << "not given by default";
  for (const char* moe : {"", "local", "ep", "llep", "pllep", "relay"}) {
    t.moe = moe;
    t.gpus = std::string(moe).empty() || std::string(moe) == "local" ? 1 : 2;
    t.token_budget = 0;
    EXPECT_EQ(validate_error(t, m), "") << moe;
    t.token_budget = 512;
    const bool reads = moe_dispatcher(t) == "local" || moe_dispatcher(t) == "pllep";
    EXPECT_EQ(validate_error(t, m), reads ? "" : "--token_budget 512 chunks the routes of --moe local or pllep (this run has --moe " +
                                                     moe_dispatcher(t) + ")")
        << moe;
    t.token_budget = -1;
    EXPECT_EQ(validate_error(t, m), "token_budget must be >= 0 (0: the dispatcher's default), got -1") << moe;
  }
  t = TrainConfig();
  t.gpus = 2;  // --moe left out at E_p = 2: ep, which does not read it
  t.token_budget = 64;
  EXPECT_EQ(validate_error(t, m), "--token_budget 64 chunks the routes of --moe local or pllep (this run has --moe ep)");
  t.ep = 1;  // E_p = 1: local
  EXPECT_EQ(validate_error(t, m), "");
}

// --moe relay and --relay_mode: expert, token and auto run; --relay_mode belongs to --moe relay alone;
// relay moves experts or tokens between ranks, so it needs ranks.
TEST(ConfigSeams, RelayAndItsMode) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  t.gpus = 2;
  t.moe = "relay";
  for (const char* mode : {"auto", "expert", "token"}) {
    t.relay_mode = mode;
    EXPECT_EQ(validate_error(t, m), "") << mode;
  }
  t.relay_mode = "experts";
  EXPECT_EQ(validate_error(t, m), "--relay_mode expects one of expert, token, auto, got 'experts'");
  t.relay_mode = "expert";
  t.gpus = 1;
  EXPECT_EQ(validate_error(t, m), "--moe relay exchanges routes between ranks: it needs --gpus > 1 (got 1)");
  t.gpus = 2;
  t.moe = "ep";
  EXPECT_EQ(validate_error(t, m), "--relay_mode expert chooses what travels the ring of --moe relay (this run has --moe ep)");
  t.moe = "";
  EXPECT_EQ(validate_error(t, m), "--relay_mode expert chooses what travels the ring of --moe relay (this run has --moe ep)");
  EXPECT_EQ(parse_error({"--gpus", "2", "--moe", "relay", "--relay_mode", "expert"}), "");
  EXPECT_EQ(parse_error({"--gpus", "2", "--moe", "relay"}), "");
  EXPECT_EQ(parse_error({"--gpus", "2", "--moe", "relay", "--relay_mode", "token"}), "");
}

// --optimizer: the three optimizers run; offload_adamw's bucket and slots are refused outside their ranges.
TEST(ConfigSeams, OptimizersAndOffloadSettings) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  for (const char* optimizer : {"adamw", "cpu_adamw", "offload_adamw"}) {
    t.optimizer = optimizer;
    EXPECT_EQ(validate_error(t, m), "") << optimizer;
  }
  t.optimizer = "sgd";
  EXPECT_EQ(validate_error(t, m), "--optimizer expects one of adamw, cpu_adamw, offload_adamw, got 'sgd'");
  t.optimizer = "offload_adamw";
  t.offload_bucket = 0;
  EXPECT_EQ(validate_error(t, m), "offload_bucket (β, parameters per bucket of offload_adamw and cpu_adamw) must be >= 1, got 0");
  t.offload_bucket = 1;
  EXPECT_EQ(validate_error(t, m), "");
  for (int slots : {0, 17}) {
    t.offload_slots = slots;
    EXPECT_EQ(validate_error(t, m), "offload_slots (s, offload_adamw's staging slots on the GPU) must be in [1, 16], got " +
                                        std::to_string(slots) + " (2 already overlap both copies with the update)");
  }
  EXPECT_EQ(parse_error({"--optimizer", "offload_adamw", "--offload_bucket", "7", "--offload_slots", "3"}), "");
}

// --head: full, chunked and ring_dtp; the vocabulary group P divides W and leaves every rank a row;
// --vocab_group belongs to ring_dtp alone.
TEST(ConfigSeams, OutputHeadsAndTheVocabularyGroup) {
  ModelConfig m = valid_model();
  TrainConfig t;
  for (const char* head : {"full", "chunked", "ring_dtp"}) {
    t.head = head;
    EXPECT_EQ(validate_error(t, m), "") << head;
    EXPECT_EQ(vocab_group_size(t), 1) << head;
  }
  t.head = "logits";
  EXPECT_EQ(validate_error(t, m), "--head expects one of full, chunked, ring_dtp, got 'logits'");
  t.head = "ring_dtp";
  t.gpus = 4;
  EXPECT_EQ(vocab_group_size(t), 4);  // 0 = every rank
  t.vocab_group = 2;
  EXPECT_EQ(validate_error(t, m), "");
  EXPECT_EQ(vocab_group_size(t), 2);
  t.vocab_group = 3;
  EXPECT_EQ(validate_error(t, m), "vocab_group (3) must divide the number of ranks (4)");
  t.vocab_group = -1;
  EXPECT_EQ(validate_error(t, m), "vocab_group must be >= 0 (0 = every rank), got -1");
  t.vocab_group = 4;
  m.vocab = 3;
  EXPECT_EQ(validate_error(t, m), "vocab_group (4) must be at most the vocabulary (3): every rank holds at least one row");
  m = valid_model();
  t.ring_dtp = "tokens";
  EXPECT_EQ(validate_error(t, m), "--ring_dtp expects auto, fused, weights or activations, got 'tokens'");
  t.ring_dtp = "weights";
  t.vocab_block = 0;
  EXPECT_EQ(validate_error(t, m), "vocab_block (ring_dtp: logits columns per block; chunked: a block of N×C logits) must be >= 1, got 0");
  t.vocab_block = 64;
  EXPECT_EQ(validate_error(t, m), "");
  t.head = "chunked";
  EXPECT_EQ(validate_error(t, m), "--vocab_group 4 splits the vocabulary of --head ring_dtp (this run has --head chunked)");
  EXPECT_EQ(parse_error({"--gpus", "2", "--head", "ring_dtp", "--vocab_group", "2", "--ring_dtp", "activations",
                         "--vocab_block", "512"}),
            "");
}

// --profile_step: off (-1) by default; a step of the run, [0, steps), or refused naming the range.
TEST(ConfigTrain, ProfileStepMustBeAStepOfTheRun) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.profile_step, -1) << "the profiler is off by default";
  t.steps = 30;
  EXPECT_EQ(validate_error(t, m), "");
  for (int ok : {0, 29}) {
    t.profile_step = ok;
    EXPECT_EQ(validate_error(t, m), "") << ok;
  }
  t.profile_step = 30;
  EXPECT_EQ(validate_error(t, m), "--profile_step 30 is not a step of this run: it must be -1 (off) or in [0, 30) (--steps 30)");
  t.profile_step = -2;
  EXPECT_EQ(validate_error(t, m), "--profile_step -2 is not a step of this run: it must be -1 (off) or in [0, 30) (--steps 30)");
  EXPECT_EQ(parse_error({"--profile_step", "x"}), "flag --profile_step expects an integer, got 'x'");
}

// --overlap_update: on by default, 0 or 1.
TEST(ConfigTrain, OverlapUpdateIsZeroOrOne) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.overlap_update, 1) << "the optimizer beside the next forward by default";
  for (int ok : {0, 1}) {
    t.overlap_update = ok;
    EXPECT_EQ(validate_error(t, m), "") << ok;
  }
  t.overlap_update = 2;
  EXPECT_EQ(validate_error(t, m), "overlap_update must be 0 or 1");
  EXPECT_EQ(parse_error({"--overlap_update", "yes"}), "flag --overlap_update expects an integer, got 'yes'");
}

// --wgrad_stream: on by default, 0 or 1.
TEST(ConfigTrain, WgradStreamIsZeroOrOne) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.wgrad_stream, 1) << "the weight gradients on their own stream by default";
  t.wgrad_stream = 0;
  EXPECT_EQ(validate_error(t, m), "");
  t.wgrad_stream = 2;
  EXPECT_EQ(validate_error(t, m), "wgrad_stream must be 0 or 1");
  EXPECT_EQ(parse_error({"--wgrad_stream", "on"}), "flag --wgrad_stream expects an integer, got 'on'");
}

// --share_gpus: off by default, 0 or 1 (what it does is runtime/launch.cuh's, tested in test_dist's
// LaunchEnvironment and GpuSharing tests).
TEST(ConfigTrain, ShareGpusIsZeroOrOne) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.share_gpus, 0) << "one rank per GPU by default";
  t.gpus = 8;
  t.share_gpus = 1;
  EXPECT_EQ(validate_error(t, m), "");
  t.share_gpus = 2;
  EXPECT_EQ(validate_error(t, m), "share_gpus must be 0 or 1");
  EXPECT_EQ(parse_error({"--share_gpus", "yes"}), "flag --share_gpus expects an integer, got 'yes'");
}

// --zero: 1 (the default: every rank holds the dense weights) or 3 (1/W each, gathered per layer); 2 is
// refused, naming why; and a run under --zero 3 gathers inside every pass, so it is not captured.
TEST(ConfigTrain, ZeroIsOneOrThree) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.zero, 1);
  t.gpus = 4;
  for (int ok : {1, 3}) {
    t.zero = ok;
    EXPECT_EQ(validate_error(t, m), "") << ok;
  }
  t.zero = 2;
  EXPECT_EQ(validate_error(t, m),
            "--zero must be 1 (ZeRO-1: every rank holds the dense weights) or 3 (ZeRO-3: 1/W each), got 2 (ZeRO-2 is not "
            "built: ZeRO-3 shards what it would)");
  EXPECT_EQ(parse_error({"--zero", "three"}), "flag --zero expects an integer, got 'three'");
  t = TrainConfig();
  t.zero = 3;
  EXPECT_EQ(cuda_graph_refusal(t, true), "off: --zero 3 gathers the dense weights inside every pass");
}

// --cuda_graph: on by default, 0 or 1; where a run cannot capture its passes, the reason (printed at
// start-up) names what stands in the way.
TEST(ConfigTrain, CudaGraphIsZeroOrOneAndSaysWhyNot) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.cuda_graph, 1) << "passes captured where they can be by default";
  for (int ok : {0, 1}) {
    t.cuda_graph = ok;
    EXPECT_EQ(validate_error(t, m), "") << ok;
  }
  t.cuda_graph = 2;
  EXPECT_EQ(validate_error(t, m), "cuda_graph must be 0 or 1");
  EXPECT_EQ(parse_error({"--cuda_graph", "on"}), "flag --cuda_graph expects an integer, got 'on'");

  t = TrainConfig();
  EXPECT_EQ(cuda_graph_refusal(t, true), "");
  EXPECT_NE(cuda_graph_refusal(t, false).find("FP32 build"), std::string::npos);
  t.cuda_graph = 0;
  EXPECT_EQ(cuda_graph_refusal(t, true), "off (--cuda_graph 0)");
  // several ranks: captured under data parallelism alone, not where a pass exchanges rows or logits
  t = TrainConfig();
  t.gpus = 2;
  EXPECT_NE(cuda_graph_refusal(t, true).find("only data parallelism is captured"), std::string::npos) << "E_p = W: ep";
  t.ep = 1;
  EXPECT_EQ(cuda_graph_refusal(t, true), "") << "--ep 1: the local dispatcher";
  t.head = "chunked";
  EXPECT_EQ(cuda_graph_refusal(t, true), "") << "the chunked head holds the whole vocabulary";
  t.head = "ring_dtp";
  EXPECT_NE(cuda_graph_refusal(t, true).find("only data parallelism is captured"), std::string::npos) << "P = W";
  t.vocab_group = 1;
  EXPECT_EQ(cuda_graph_refusal(t, true), "") << "Ring-DTP over P = 1";
  t = TrainConfig();
  t.gpus = 2;
  t.ep = 1;
  t.moe = "ep";
  EXPECT_NE(cuda_graph_refusal(t, true).find("only data parallelism is captured"), std::string::npos) << "--moe ep at E_p = 1";
  t = TrainConfig();
  t.offload_budget = 1 << 20;
  EXPECT_NE(cuda_graph_refusal(t, true).find("--offload_budget"), std::string::npos);
  t = TrainConfig();
  t.routing = "hot:1/2";
  EXPECT_EQ(cuda_graph_refusal(t, true), "") << "a profile's experts are made on the device";
  t.routing = "trace:routes.bin";
  EXPECT_NE(cuda_graph_refusal(t, true).find("--routing trace:routes.bin copies each pass's recorded experts"), std::string::npos);
  t = TrainConfig();
  t.record_routing = "trace.bin";
  EXPECT_NE(cuda_graph_refusal(t, true).find("--record_routing"), std::string::npos);
}

// --offload_budget (SCO): bytes, past 2^31 too; refused when negative, and without --recompute 1 unless 0.
TEST(ConfigSeams, OffloadBudgetNeedsRecomputeAndIsNotNegative) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.offload_budget, 0) << "SCO is off by default";
  EXPECT_EQ(validate_error(t, m), "");
  t.offload_budget = 1;
  EXPECT_EQ(validate_error(t, m), "--offload_budget 1 moves the layer boundaries that recomputation keeps: it needs "
                                  "--recompute 1 (got --recompute 0)");
  t.recompute = 1;
  EXPECT_EQ(validate_error(t, m), "");
  t.offload_budget = -1;
  EXPECT_EQ(validate_error(t, m), "offload_budget (SCO's pinned host bytes for layer boundaries) must be >= 0, got -1");
  t.recompute = 0;
  EXPECT_EQ(validate_error(t, m), "offload_budget (SCO's pinned host bytes for layer boundaries) must be >= 0, got -1");
  t.offload_budget = 0;
  EXPECT_EQ(validate_error(t, m), "") << "a zero budget needs no recomputation";

  EXPECT_EQ(parse_error({"--recompute", "1", "--offload_budget", "68719476736"}), "");  // 64 GiB, past int
  EXPECT_EQ(parse_error({"--offload_budget", "1e9"}), "flag --offload_budget expects an integer, got '1e9'");
  EXPECT_EQ(parse_error({"--offload_budget", "99999999999999999999"}),
            "flag --offload_budget expects an integer, got '99999999999999999999'");
  std::vector<std::string> args = {"train", "--recompute", "1", "--offload_budget", "68719476736"};
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(&a[0]);
  ModelConfig parsed_model;
  TrainConfig parsed;
  parse_flags((int)argv.size(), argv.data(), parsed_model, parsed);
  EXPECT_EQ(parsed.offload_budget, 68719476736LL);
}

// --device_budget: 0 (off), bytes, or a fraction of the GPU in (0, 1]; it keeps attention tensors that
// recomputation would rebuild, so it needs --recompute 1.
TEST(ConfigSeams, DeviceBudgetIsBytesOrAFractionAndNeedsRecompute) {
  const ModelConfig m = valid_model();
  TrainConfig t;
  EXPECT_EQ(t.device_budget, "0") << "selective attention recomputation is off by default";
  EXPECT_FALSE(parse_device_budget(t.device_budget).on());
  EXPECT_EQ(parse_device_budget("68719476736").bytes, 68719476736LL);
  EXPECT_DOUBLE_EQ(parse_device_budget("0.9").fraction, 0.9);
  EXPECT_DOUBLE_EQ(parse_device_budget("1.0").fraction, 1.0);
  const std::string usage = "': expects 0 (off), bytes (an integer > 1) or a fraction of the GPU in (0, 1] such as 0.9";
  for (const char* bad : {"", "-5", "1", "1.5", "0.0", "abc", "12x", "0.9GiB", "99999999999999999999"}) {
    t.device_budget = bad;
    EXPECT_EQ(validate_error(t, m), std::string("--device_budget '") + bad + usage) << bad;
  }
  t.device_budget = "0.9";
  EXPECT_EQ(validate_error(t, m), "--device_budget 0.9 chooses attention tensors to keep instead of recomputing them: it "
                                  "needs --recompute 1 (got --recompute 0)");
  t.recompute = 1;
  EXPECT_EQ(validate_error(t, m), "");
  EXPECT_EQ(parse_error({"--recompute", "1", "--device_budget", "40000000000"}), "");
}

// --attention_groups G: attention in G groups of nh/G heads (model.cuh). G divides the heads; it rebuilds the
// projection that --device_budget would keep, and under --sp attention already runs on a head shard: both
// are refused, naming the choice.
TEST(ConfigSeams, AttentionGroupsDivideTheHeadsAlone) {
  const ModelConfig m = valid_model();  // 6 heads
  TrainConfig t;
  EXPECT_EQ(t.attention_groups, 1) << "every head at once by default";
  for (int groups : {2, 3, 6}) {
    t.attention_groups = groups;
    EXPECT_EQ(validate_error(t, m), "") << groups;
  }
  for (int groups : {0, -1, 4, 12}) {
    t.attention_groups = groups;
    EXPECT_EQ(validate_error(t, m), "--attention_groups " + std::to_string(groups) +
                                        " must divide the heads (6) into groups of equal size");
  }
  t.attention_groups = 6;
  t.recompute = 1;
  t.device_budget = "0.9";
  EXPECT_EQ(validate_error(t, m), "--attention_groups 6 rebuilds attention's projection group by group in the backward, "
                                  "--device_budget 0.9 keeps it whole: choose one (--device_budget 0 or "
                                  "--attention_groups 1)");
  t.device_budget = "0";
  t.gpus = 2; t.sp = 2;
  EXPECT_EQ(validate_error(t, m), "--attention_groups 6 is for one rank's whole sequences: under --sp 2 attention "
                                  "already runs on nh/D heads of each rank (use --attention_groups 1)");
  EXPECT_EQ(parse_error({"--attention_groups", "3", "--recompute", "1"}), "");
}

// --routing: the router, a profile that fits the model, or trace:FILE (whose file the trainer checks
// at start-up); --record_routing: a file name, a training step and a MoE layer to record.
TEST(ConfigRouting, RefusesRoutingsThatCannotRun) {
  const ModelConfig m = valid_model();  // E = 8, k = 2
  TrainConfig t;
  for (const char* routing : {"router", "balanced", "hot:0.5/2", "hot:1/8", "trace:runs/a/trace.bin"}) {
    t.routing = routing;
    EXPECT_EQ(validate_error(t, m), "") << routing;
  }
  t.routing = "trace:";
  EXPECT_EQ(validate_error(t, m), "routing 'trace:': expected trace:FILE, with the trace's file name");
  t.routing = "hot";
  EXPECT_NE(validate_error(t, m).find("--routing expects router, trace:FILE or a profile: routing profile 'hot'"),
            std::string::npos)
      << validate_error(t, m);
  t.routing = "hot:0.5/9";  // h > E
  EXPECT_EQ(validate_error(t, m), "routing profile hot:0.5/9 with E=8: needs h <= E, and h < E unless every token is hot");
  EXPECT_NE(parse_error({"--routing", ""}).find("flag --routing expects a non-empty value"), std::string::npos);
}

TEST(ConfigRouting, RecordRoutingNeedsAFileAStepAndAMoELayer) {
  ModelConfig m = valid_model();
  TrainConfig t;
  t.record_routing = "runs/a/trace.bin";
  EXPECT_EQ(validate_error(t, m), "");
  EXPECT_EQ(parse_error({"--record_routing", "runs/a/trace.bin", "--routing", "trace:runs/b/trace.bin"}), "");
  EXPECT_NE(parse_error({"--record_routing", ""}).find("flag --record_routing expects a non-empty value"),
            std::string::npos);
  t.steps = 0;
  EXPECT_EQ(validate_error(t, m), "--record_routing runs/a/trace.bin: --steps 0 has no training step to record");
  t.steps = 10;
  m.n_dense = m.layers;  // no MoE layer: nothing to record, nothing to replay
  EXPECT_EQ(validate_error(t, m), "--routing trace:FILE and --record_routing need a MoE layer (n_dense 6 of 6 layers)");
  t.record_routing = "";
  t.routing = "trace:runs/a/trace.bin";
  EXPECT_EQ(validate_error(t, m), "--routing trace:FILE and --record_routing need a MoE layer (n_dense 6 of 6 layers)");
}

// The shape a run's trace has: every MoE layer n_dense..L−1, W ranks of B·T tokens.
TEST(ConfigRouting, RunTraceShapeIsEveryMoELayerOfEveryRank) {
  ModelConfig c;
  c.layers = 5;
  c.n_dense = 2;
  c.experts = 16;
  c.topk = 4;
  const data::RoutingTraceShape s = routing_trace_shape(c, 256, 3);
  EXPECT_EQ(s.world, 3);
  EXPECT_EQ(s.experts, 16);
  EXPECT_EQ(s.topk, 4);
  EXPECT_EQ(s.layers, (std::vector<int>{2, 3, 4}));
  EXPECT_EQ(s.tokens, (std::vector<int>{256, 256, 256}));
}

TEST(ConfigLayout, ExpertStacksComeLastAndAreMarked) {
  ModelConfig m = valid_model();
  m.n_dense = 1; m.shared_expert = 1;
  std::vector<ParamSpec> specs = param_specs(m);
  size_t first_expert = specs.size();
  for (size_t i = 0; i < specs.size(); i++)
    if (specs[i].expert) { first_expert = std::min(first_expert, i); }
  ASSERT_LT(first_expert, specs.size());
  for (size_t i = first_expert; i < specs.size(); i++) {
    EXPECT_TRUE(specs[i].expert) << specs[i].name;
    EXPECT_EQ(specs[i].rows % m.experts, 0u) << specs[i].name;
  }
  EXPECT_EQ(specs.size() - first_expert, 2u * (m.layers - m.n_dense));
}

// Each tensor's forward group (the optimizer releases the next forward by them, model.cuh): the
// embedding with layer 0, a layer's tensors (attention, norms, router, dense FFN, shared and routed
// experts) with their layer, the final norm and the head last; and the shard segments carry them.
TEST(ConfigLayout, EveryTensorIsInTheGroupOfItsFirstReader) {
  ModelConfig m = valid_model();
  m.layers = 3; m.n_dense = 1; m.shared_expert = 1;
  const std::vector<ParamSpec> specs = param_specs(m);
  for (const ParamSpec& s : specs) {
    int want = -1;
    if (s.name == "wte") want = 0;
    else if (s.name == "lnf" || s.name == "lm_head") want = m.layers;
    else if (s.name.rfind("layer", 0) == 0) want = std::stoi(s.name.substr(5));
    EXPECT_EQ(s.forward_group, want) << s.name;
  }
  size_t S = 0;
  const ParamLayout layout = param_layout(specs, 1, RegionGroup{2, 1}, RegionGroup{1, 0}, VocabSplit{});
  for (const ShardSegment& g : shard_segments(specs, layout, &S)) {
    int tensor = -1;
    for (size_t i = 0; i < specs.size(); i++)
      if (g.param_offset >= layout.offsets[i] && g.param_offset < layout.offsets[i] + layout.local_numel[i]) tensor = (int)i;
    ASSERT_GE(tensor, 0);
    EXPECT_EQ(g.group, specs[tensor].forward_group) << specs[tensor].name;
  }
}

TEST(ConfigLayout, ParamCountMatchesClosedForm) {
  ModelConfig m = valid_model();
  m.hidden = 128; m.layers = 3; m.n_dense = 1; m.experts = 4; m.topk = 2; m.expert_dim = 64; m.dense_dim = 200;
  m.shared_expert = 1;
  const size_t V = 512, H = 128, E = 4, I = 64, Id = 200;
  size_t attn = 2 * H + 3 * H * H + H * H;
  size_t dense = 3 * H * Id;
  size_t moe = E * H + E * 3 * H * I + 3 * H * I;
  EXPECT_EQ(param_count(m), 2 * V * H + H + 3 * attn + dense + 2 * moe);
  // active: routed experts count k of E; the embedding lookup is not a multiply-add
  size_t moe_active = E * H + 2 * 3 * H * I + 3 * H * I;
  EXPECT_EQ(active_param_count(m), V * H + H + 3 * attn + dense + 2 * moe_active);
}

TEST(ConfigSchedule, WarmupThenCosine) {
  TrainConfig t;
  t.lr = 1e-3f; t.warmup = 10; t.steps = 110; t.min_lr_frac = 0.1f;
  EXPECT_FLOAT_EQ(lr_at(t, 0), 1e-4f);
  EXPECT_FLOAT_EQ(lr_at(t, 9), 1e-3f);
  EXPECT_NEAR(lr_at(t, 60), 0.55e-3f, 1e-7);
  EXPECT_NEAR(lr_at(t, 110), 1e-4f, 1e-9);
}

// The trainer binary the ConfigTrainBinary tests run: FLATMOE_TRAIN, else build/fp32/train.
static std::string trainer_path() {
  const char* bin = getenv("FLATMOE_TRAIN");
  return bin ? bin : "build/fp32/train";
}

// Why such a test cannot run here ("" when it can): the binary is not built, or (needs_data) the
// default data set is not prepared.
static std::string trainer_unavailable(const std::string& train, bool needs_data) {
  struct stat sb;
  if (stat(train.c_str(), &sb) != 0) return "trainer binary " + train + " not built";
  if (needs_data && stat("data/fortunes/tokenizer.bin", &sb) != 0) return "data/fortunes not prepared (make data)";
  return "";
}

// The trainer binary itself: bad flags → non-zero exit, message on stderr, nothing written.
TEST(ConfigTrainBinary, BadFlagsExitNonZeroAndWriteNothing) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  struct stat sb;
  std::string out = "build/test-out-config";
  std::string cmd = train + " --out " + out + " --hidden 12x 2> build/test-config-stderr.txt";
  int rc = system(cmd.c_str());
  EXPECT_NE(rc, 0);
  EXPECT_NE(stat(out.c_str(), &sb), 0) << "the output directory must not be created on bad flags";
  FILE* f = fopen("build/test-config-stderr.txt", "r");
  ASSERT_NE(f, nullptr);
  char buf[512] = {0};
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  EXPECT_NE(std::string(buf, n).find("--hidden expects an integer"), std::string::npos) << buf;

  cmd = train + " --out " + out + " --tokenizer /nonexistent/tokenizer.bin 2> build/test-config-stderr.txt";
  EXPECT_NE(system(cmd.c_str()), 0);
  EXPECT_NE(stat(out.c_str(), &sb), 0);
}

// --resume is checked before any GPU work: on a machine without a GPU a missing or corrupt
// checkpoint is named (not "no CUDA device"), and nothing is written.
TEST(ConfigTrainBinary, BadResumeRefusedBeforeTheGpu) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, true); !why.empty()) GTEST_SKIP() << why;
  struct stat sb;
  testutil::TempDir dir;
  const std::string out = dir.file("out"), ckpt_dir = dir.file("ckpt"), err = dir.file("stderr.txt");
  ASSERT_EQ(mkdir(ckpt_dir.c_str(), 0755), 0);
  auto run = [&]() {
    std::string cmd = train + " --data data/fortunes --out " + out + " --resume " + ckpt_dir + " 2> " + err;
    EXPECT_NE(system(cmd.c_str()), 0);
    EXPECT_NE(stat(out.c_str(), &sb), 0) << "nothing is written when --resume is refused";
    return testutil::read_bytes(err);
  };
  std::string message = run();
  EXPECT_NE(message.find(ckpt_dir + "/rank0.bin"), std::string::npos) << message;
  EXPECT_EQ(message.find("CUDA"), std::string::npos) << message;
  testutil::write_bytes(ckpt_dir + "/rank0.bin", std::string(2000, 'x'));
  message = run();
  EXPECT_NE(message.find(ckpt_dir + "/rank0.bin"), std::string::npos) << message;
  EXPECT_NE(message.find("bad magic"), std::string::npos) << message;
}

// --routing trace:FILE is checked before any GPU work: on a machine without a GPU a trace that does
// not fit the run, or a damaged one, is refused naming the file and the problem (not "no CUDA
// device"), and nothing is written.
TEST(ConfigTrainBinary, RoutingTraceThatDoesNotFitRefusedBeforeTheGpu) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, true); !why.empty()) GTEST_SKIP() << why;
  struct stat sb;
  testutil::TempDir dir;
  const std::string out = dir.file("out"), trace_path = dir.file("trace.bin"), err = dir.file("stderr.txt");
  auto run = [&]() {
    const std::string cmd = train + " --data data/fortunes --layers 3 --n_dense 1 --experts 8 --topk 2 --batch 2 --seq_len 16"
                            " --out " + out + " --routing trace:" + trace_path + " 2> " + err;
    EXPECT_NE(system(cmd.c_str()), 0);
    EXPECT_NE(stat(out.c_str(), &sb), 0) << "nothing is written when the trace is refused";
    return testutil::read_bytes(err);
  };
  data::RoutingTrace trace;  // recorded by a run of 4 experts and the MoE layers 0..2
  trace.shape.world = 1;
  trace.shape.experts = 4;
  trace.shape.topk = 2;
  trace.shape.layers = {0, 1, 2};
  trace.shape.tokens = {32};
  trace.batches = 1;
  trace.indices.assign(trace.shape.batch_indices(), 3);
  data::write_routing_trace(trace_path, trace);
  std::string message = run();
  EXPECT_NE(message.find("routing trace " + trace_path + " does not match this run: E (experts): the trace has 4, this "
                         "run 8; MoE layers: the trace has [0, 1, 2], this run [1, 2]"),
            std::string::npos)
      << message;
  EXPECT_EQ(message.find("CUDA"), std::string::npos) << message;
  testutil::write_bytes(trace_path, std::string(100, 'x'));
  message = run();
  EXPECT_NE(message.find("routing trace " + trace_path + ": bad magic"), std::string::npos) << message;
  EXPECT_EQ(message.find("CUDA"), std::string::npos) << message;
}

// ---- what the trainer refuses before it looks for a GPU (issue 56) ----------------------------------
// Each case runs the trainer in an empty environment that shows it no GPU (CUDA_VISIBLE_DEVICES=) on a
// data set of its own, and expects the problem named, exit status 1, not "no CUDA device", and
// nothing written.

namespace {

// A data set in `dir`: a tokenizer of 270 tokens, a train shard of `train_tokens` tokens and a
// validation shard of `val_tokens`; returns the flags that name it, with a model and batch small
// enough for those shards (B 1, T 64).
std::string small_run_flags(const testutil::TempDir& dir, int train_tokens, int val_tokens) {
  data::Tokenizer::train({"the cat sat on the mat, the end"}, 270).save(dir.file("tokenizer.bin"));
  std::vector<int> tokens(std::max(train_tokens, val_tokens));
  for (size_t i = 0; i < tokens.size(); i++) tokens[i] = int(i % 270);
  data::write_shard(dir.file("train_000.bin"), std::vector<int>(tokens.begin(), tokens.begin() + train_tokens), 270);
  data::write_shard(dir.file("val_000.bin"), std::vector<int>(tokens.begin(), tokens.begin() + val_tokens), 270);
  return " --tokenizer " + dir.file("tokenizer.bin") + " --train " + dir.file("train_000.bin") + " --val " +
         dir.file("val_000.bin") + " --batch 1 --seq_len 64 --out " + dir.file("out");
}

// Runs the trainer with `args` in an environment of PATH, LD_LIBRARY_PATH, CUDA_VISIBLE_DEVICES= (no
// GPU visible) and the assignments `env`; returns its exit status, stdout and stderr in `output`.
int run_without_gpu(const testutil::TempDir& dir, const std::string& env, const std::string& args, std::string& output) {
  const std::string log = dir.file("train.log");
  const std::string cmd = "env -i PATH=\"$PATH\" LD_LIBRARY_PATH=\"$LD_LIBRARY_PATH\" CUDA_VISIBLE_DEVICES= " + env + " " +
                          trainer_path() + " " + args + " > " + log + " 2>&1";
  const int status = system(cmd.c_str());
  output = testutil::read_bytes(log);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// The trainer refuses `args` under `env` with a message that holds `problem`, before the GPU.
void expect_refused_before_the_gpu(const testutil::TempDir& dir, const std::string& env, const std::string& args,
                                   const std::string& problem) {
  std::string output;
  EXPECT_EQ(run_without_gpu(dir, env, args, output), 1) << env << args << "\n" << output;
  EXPECT_NE(output.find(problem), std::string::npos) << env << args << "\n" << output;
  EXPECT_EQ(output.find("CUDA"), std::string::npos) << env << args << "\n" << output;
  struct stat sb;
  EXPECT_NE(stat(dir.file("out").c_str(), &sb), 0) << "nothing is written: " << env << args;
}

// The model and training flags the trainer reads from `args`, with the vocabulary it takes from the
// tokenizer of small_run_flags.
void flags_of(const std::string& args, ModelConfig& m, TrainConfig& t) {
  std::vector<std::string> words = {"train"};
  for (size_t start = 0; start < args.size();) {
    const size_t end = std::min(args.find(' ', start), args.size());
    if (end > start) words.push_back(args.substr(start, end - start));
    start = end + 1;
  }
  std::vector<char*> argv;
  for (std::string& w : words) argv.push_back(&w[0]);
  parse_flags((int)argv.size(), argv.data(), m, t);
  m.vocab = 270;
}

// A checkpoint set of `world` ranks in `dir` for the run of `args`: the flags' model, E_p `ep`, data
// position `position`.
void write_checkpoint_set(const std::string& dir, const std::string& args, int world, int ep, long long position,
                          const std::function<void(ckpt::RankFile&)>& change = [](ckpt::RankFile&) {}) {
  ASSERT_EQ(mkdir(dir.c_str(), 0755), 0);
  for (int rank = 0; rank < world; rank++) {
    ckpt::RankFile f;
    flags_of(args, f.model, f.train);
    f.world = world;
    f.ep = ep;
    f.rank = rank;
    f.step = 5;
    f.data = {0, position, 0};
    f.sections = {{"router_bias", std::vector<float>(4, 0.f)}};
    change(f);
    ckpt::write_rank_file(ckpt::rank_file(dir, rank), f);
  }
}

}  // namespace

// parse_launch_env's refusal, as launch() would say it, before the GPU is looked for: the ten ways
// the issue found an MPICH/Intel MPI launch to be incomplete or inconsistent.
TEST(ConfigTrainBeforeTheGpu, LauncherVariablesAreRefusedByName) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  testutil::TempDir dir;
  const std::string flags = small_run_flags(dir, 1000, 200);
  const std::string mpiexec = "PMI_RANK=0 PMI_SIZE=2 MPI_LOCALRANKID=0", master = " FLATMOE_MASTER_ADDR=localhost";
  const std::vector<std::tuple<std::string, std::string, std::string>> cases = {
      {mpiexec, "", "set FLATMOE_MASTER_ADDR (rank 0's host) and FLATMOE_MASTER_PORT"},
      {mpiexec + master + " FLATMOE_MASTER_PORT=29500", "", "there is no job token for the rendezvous"},
      {mpiexec + master + " FLATMOE_MASTER_PORT=70000", "", "FLATMOE_MASTER_PORT='70000' is not a TCP port in [1, 65535]"},
      {mpiexec + master + " FLATMOE_MASTER_PORT=29500 FLATMOE_JOB_TOKEN=", "", "FLATMOE_JOB_TOKEN is set but empty"},
      {"PMIX_RANK=0", "", "PMIX_RANK=0 is set (a PMIx launcher)"},
      {"PMI_RANK=2 PMI_SIZE=2 MPI_LOCALRANKID=0", "", "PMI_RANK='2' is not a rank in [0, 2)"},
      {"PMI_RANK=0 PMI_SIZE=2", "", "MPI_LOCALRANKID='' is not a local rank in [0, 2)"},
      {"PMI_SIZE=2", "", "PMI_SIZE is set but PMI_RANK is missing"},
      {"PMI_RANK=0 PMI_SIZE=two", "", "PMI_SIZE='two' is not a world size"},
      {mpiexec, " --gpus 4", "4 GPUs requested, but mpiexec (MPICH / Intel MPI) started 2 ranks"},
  };
  for (const auto& [env, args, problem] : cases) {
    expect_refused_before_the_gpu(dir, env, flags + args, problem);
    EXPECT_EQ(testutil::read_bytes(dir.file("train.log")).rfind("flatmoe launch: ", 0), 0u) << env;
  }
}

// --resume: a checkpoint whose model differs from the flags, whose E_p differs from this run's, or
// whose data position lies past the training data, is refused before the GPU, naming what differs.
TEST(ConfigTrainBeforeTheGpu, ResumeThatDoesNotFitTheRunIsRefused) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  testutil::TempDir dir;
  const std::string flags = small_run_flags(dir, 1000, 200);
  const std::string other_model = dir.file("other_model"), other_ep = dir.file("other_ep"), past = dir.file("past");
  write_checkpoint_set(other_model, flags, 1, 1, 0, [](ckpt::RankFile& f) { f.model.topk = f.model.topk == 1 ? 2 : 1; });
  expect_refused_before_the_gpu(dir, "", flags + " --resume " + other_model,
                                "--resume " + other_model + ": the model configuration differs from the flags: topk: checkpoint");
  write_checkpoint_set(other_ep, flags + " --gpus 2", 2, 1, 0);
  expect_refused_before_the_gpu(dir, "", flags + " --gpus 2 --resume " + other_ep,
                                "--resume " + other_ep + ": written by W=2 E_p=1; this run has W=2 E_p=2");
  write_checkpoint_set(past, flags, 1, 1, 5000);
  expect_refused_before_the_gpu(dir, "", flags + " --resume " + past,
                                "--resume " + past + ": its data position lies past the training data");
}

// The shards are checked for the world that will run: a validation shard of 100 tokens holds a
// window of one rank's B·T + 1 = 65 tokens, not of two ranks' 129.
TEST(ConfigTrainBeforeTheGpu, ShardsAreCheckedForEveryRank) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  testutil::TempDir dir;
  const std::string flags = small_run_flags(dir, 1000, 100);
  expect_refused_before_the_gpu(dir, "", flags + " --gpus 2",
                                "shard " + dir.file("val_000.bin") + " has 100 tokens, too few for one batch: world 2");
  std::string output;
  EXPECT_EQ(run_without_gpu(dir, "", flags, output), 1);
  EXPECT_NE(output.find("no CUDA device"), std::string::npos) << "one rank's window fits:\n" << output;
}

// Where the run would write: --out naming an existing file, --record_routing into a folder that does
// not exist, or over a file that is not a routing trace. The file stays as it was.
TEST(ConfigTrainBeforeTheGpu, OutputPathsThatCannotBeWrittenAreRefused) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  testutil::TempDir dir;
  std::string flags = small_run_flags(dir, 1000, 200);
  const std::string file = dir.file("notes.txt");
  testutil::write_bytes(file, "mine");
  std::string output;
  EXPECT_EQ(run_without_gpu(dir, "", flags + " --out " + file, output), 1);
  EXPECT_NE(output.find("--out " + file + " exists and is not a folder"), std::string::npos) << output;
  EXPECT_EQ(output.find("CUDA"), std::string::npos) << output;
  EXPECT_EQ(testutil::read_bytes(file), "mine");
  expect_refused_before_the_gpu(dir, "", flags + " --record_routing " + dir.file("absent/trace.bin"),
                                "routing trace " + dir.file("absent/trace.bin") + ": cannot record it: folder " +
                                    dir.file("absent") + ": No such file or directory");
  expect_refused_before_the_gpu(dir, "", flags + " --record_routing " + file,
                                "routing trace " + file + ": cannot record it: it exists and is not a routing trace");
  EXPECT_EQ(testutil::read_bytes(file), "mine");
  // a file the run would write under its fixed name in --out, which flatmoe did not write: refused, kept
  testutil::TempDir out;
  const std::string flags_out = small_run_flags(dir, 1000, 200) + " --out " + out.file("");
  testutil::write_bytes(out.file("log.csv"), "my own table\n");
  EXPECT_EQ(run_without_gpu(dir, "", flags_out, output), 1);
  EXPECT_NE(output.find("holds log.csv, which this run would overwrite and which flatmoe did not write"), std::string::npos)
      << output;
  EXPECT_EQ(output.find("CUDA"), std::string::npos) << output;
  EXPECT_EQ(testutil::read_bytes(out.file("log.csv")), "my own table\n");
  testutil::write_bytes(out.file("log.csv"), "step,train_loss,val_loss\n");  // an earlier run's: overwritten
  EXPECT_EQ(run_without_gpu(dir, "", flags_out, output), 1);
  EXPECT_NE(output.find("no CUDA device"), std::string::npos) << "only the GPU is missing: " << output;
  testutil::write_bytes(out.file("timeline_step3.png"), "a picture");
  EXPECT_EQ(run_without_gpu(dir, "", flags_out + " --timeline_step 3 --steps 5", output), 1);
  EXPECT_NE(output.find("holds timeline_step3.png"), std::string::npos) << "its CSV is not flatmoe's: " << output;
  testutil::write_bytes(out.file("profile_step2.md"), "notes");
  EXPECT_EQ(run_without_gpu(dir, "", flags_out + " --profile_step 2 --steps 5", output), 1);
  EXPECT_NE(output.find("holds profile_step2.md"), std::string::npos) << output;
  EXPECT_EQ(testutil::read_bytes(out.file("profile_step2.md")), "notes");
}

// --plan auto with the trainer's own prediction, without a GPU (--dry_run 1 --device_capacity C): from a
// capacity where the plain run fits down to one where nothing does, it either prints the settings it
// chose — whose prediction then fits C, as the dry run's own check says (exit 0) — or refuses before any
// allocation naming the largest term (exit 1); a flag the user gave stays as given.
TEST(ConfigTrainBeforeTheGpu, PlanAutoChoosesWhatFitsOrNamesTheLargestTerm) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  testutil::TempDir dir;
  const std::string flags = small_run_flags(dir, 4000, 4000) + " --seq_len 256 --batch 8 --dry_run 1 --plan auto";
  std::string output;
  int chose = 0, changed = 0, refused = 0;
  for (int mib : {2000, 1200, 800, 600, 500, 450, 400, 350, 300, 250, 200, 20}) {
    const int rc = run_without_gpu(dir, "", flags + " --device_capacity " + std::to_string(mib) + "MiB", output);
    if (rc == 0) {
      chose++;
      EXPECT_NE(output.find("--plan auto: "), std::string::npos) << output;
      double peak = 0, budget = 0;
      ASSERT_EQ(sscanf(output.c_str() + output.find("  pool peak "), "  pool peak %lf MiB of %lf MiB", &peak, &budget), 2)
          << output;
      EXPECT_LE(peak, budget) << output;
      EXPECT_LE(budget, 0.95 * mib + 0.1) << "5 % of the capacity is the margin";
      changed += output.find("--recompute 1") != std::string::npos || output.find("--head chunked") != std::string::npos;
    } else {
      refused++;
      EXPECT_EQ(rc, 1) << output;
      EXPECT_NE(output.find("settings fits: the most frugal needs"), std::string::npos) << output;
      EXPECT_NE(output.find("its largest term is "), std::string::npos) << output;
    }
  }
  EXPECT_GT(chose, 1) << "the ample capacities fit";
  EXPECT_GT(changed, 0) << "some capacity needs a memory saver";
  EXPECT_GT(refused, 0) << "20 MiB holds nothing";
  // the flags given stay: with --recompute 0 and --head full, only the optimizer can move
  ASSERT_EQ(run_without_gpu(dir, "", flags + " --recompute 0 --head full --device_capacity 2000MiB", output), 0) << output;
  EXPECT_EQ(output.find("--recompute 1"), std::string::npos) << output;
  EXPECT_EQ(output.find("--head chunked"), std::string::npos) << output;
  expect_refused_before_the_gpu(dir, "", flags + " --plan maybe --device_capacity 2000MiB", "--plan must be off or auto");
}

// Sequence groups (--sp 2 over 2 ranks) plan the kept attention at the rank's T/2 tokens of each sequence:
// --device_budget keeps what fits (the core option with attention's output in both shards) and --plan auto
// chooses and prints a command that keeps --sp 2, each within its budget.
TEST(ConfigTrainBeforeTheGpu, KeptAttentionAndPlanAutoInSequenceGroups) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  testutil::TempDir dir;
  const std::string flags = small_run_flags(dir, 4000, 4000) + " --seq_len 256 --batch 8 --dry_run 1 --gpus 2 --sp 2";
  std::string output;
  ASSERT_EQ(run_without_gpu(dir, "", flags + " --recompute 1 --device_budget 0.9 --device_capacity 2000MiB", output), 0)
      << output;
  EXPECT_NE(output.find("selective attention recomputation: --device_budget "), std::string::npos) << output;
  EXPECT_NE(output.find(" core and "), std::string::npos) << output;
  ASSERT_EQ(run_without_gpu(dir, "", flags + " --plan auto --device_capacity 600MiB", output), 0) << output;
  EXPECT_NE(output.find("--plan auto: "), std::string::npos) << output;
  EXPECT_NE(output.find("--sp 2"), std::string::npos) << "the sequence groups given stay: " << output;
  double peak = 0, budget = 0;
  ASSERT_EQ(sscanf(output.c_str() + output.find("  pool peak "), "  pool peak %lf MiB of %lf MiB", &peak, &budget), 2)
      << output;
  EXPECT_LE(peak, budget) << output;
}

// Attention in head groups under the trainer's own prediction (--dry_run 1, no GPU), the routed experts in
// token chunks (so that the FFN's part keeps little): one layer's backward term falls from about 12 N·H·b to
// under half of it, and --plan auto at the smallest capacity it fits takes --attention_groups nh.
TEST(ConfigTrainBeforeTheGpu, AttentionGroupsLowerTheLayersBackwardAndPlanAutoTakesThem) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  testutil::TempDir dir;
  const std::string flags = small_run_flags(dir, 40000, 40000) + " --seq_len 8192 --batch 1 --dry_run 1 --moe local" +
                            " --token_budget 512";
  std::string output;
  auto one_layer_mib = [&](const std::string& more) {
    EXPECT_EQ(run_without_gpu(dir, "", flags + " --recompute 1 --device_capacity 80GiB" + more, output), 0) << output;
    double mib = 0;
    const size_t at = output.find("+ one layer ");
    EXPECT_NE(at, std::string::npos) << output;
    if (at != std::string::npos) sscanf(output.c_str() + at, "+ one layer %lf MiB", &mib);
    return mib;
  };
  const double whole = one_layer_mib(""), grouped = one_layer_mib(" --attention_groups 6");
  printf("[mem] one layer's backward at T 8192: whole heads %.1f MiB, one head at a time %.1f MiB (%.2f)\n", whole, grouped,
         grouped / whole);
  EXPECT_LT(grouped, 0.5 * whole);
  // the smallest capacity that --plan auto fits (bisection over MiB): only the grouped setting fits there
  const std::string plan = flags + " --plan auto --optimizer cpu_adamw --head chunked --vocab_block 1024";
  int fits = 8192, not_fits = 16;
  while (fits - not_fits > 1) {
    const int mib = (fits + not_fits) / 2;
    (run_without_gpu(dir, "", plan + " --device_capacity " + std::to_string(mib) + "MiB", output) == 0 ? fits : not_fits) = mib;
  }
  ASSERT_EQ(run_without_gpu(dir, "", plan + " --device_capacity " + std::to_string(fits) + "MiB", output), 0) << output;
  EXPECT_NE(output.find("--attention_groups 6"), std::string::npos) << "at " << fits << " MiB: " << output;
}

// --dry_run 1 is host arithmetic: without a GPU it predicts rank 0's memory against --device_capacity
// (bytes or with a unit), exit 0 when it fits and 1 when it does not; without --device_capacity it
// says that it needs one.
TEST(ConfigTrainBeforeTheGpu, DryRunNeedsNoGpu) {
  const std::string train = trainer_path();
  if (const std::string why = trainer_unavailable(train, false); !why.empty()) GTEST_SKIP() << why;
  testutil::TempDir dir;
  const std::string flags = small_run_flags(dir, 1000, 200) + " --dry_run 1";
  std::string output;
  for (const std::string ranks : {"", " --gpus 2"}) {
    EXPECT_EQ(run_without_gpu(dir, "", flags + ranks + " --device_capacity 80GiB", output), 0) << output;
    EXPECT_NE(output.find("memory prediction (Eq. 6, rank 0): pool peak"), std::string::npos) << output;
    EXPECT_NE(output.find("device 81920.0 MiB (--device_capacity)"), std::string::npos) << output;
  }
  expect_refused_before_the_gpu(dir, "", flags + " --device_capacity 1MiB", "this configuration cannot fit on the GPU");
  // ranks sharing one GPU (--share_gpus 1) need their pools together: a capacity of two ranks' peaks
  // takes 2 ranks and refuses 8, naming the sum (a validation shard that 8 ranks can read)
  testutil::TempDir shared_dir;
  const std::string shared = small_run_flags(shared_dir, 1000, 1000) + " --dry_run 1";
  ASSERT_EQ(run_without_gpu(shared_dir, "", shared + " --gpus 2 --device_capacity 80GiB", output), 0) << output;
  double peak_mib = 0;
  ASSERT_EQ(sscanf(output.c_str() + output.find("pool peak "), "pool peak %lf MiB", &peak_mib), 1) << output;
  const std::string two_pools = " --device_capacity " + std::to_string((long long)(2 * peak_mib + 2)) + "MiB";
  EXPECT_EQ(run_without_gpu(shared_dir, "", shared + " --gpus 2 --share_gpus 1" + two_pools, output), 0) << output;
  EXPECT_NE(output.find(", shared by 2 ranks (--share_gpus 1): "), std::string::npos) << output;
  expect_refused_before_the_gpu(shared_dir, "", shared + " --gpus 8 --share_gpus 1" + two_pools,
                                "the 8 ranks sharing it need 8 x the pool's predicted peak");
  expect_refused_before_the_gpu(dir, "", flags, "--dry_run 1: this machine has no GPU to take the memory from");
  expect_refused_before_the_gpu(dir, "", flags + " --device_capacity 80parsecs",
                                "--device_capacity '80parsecs': expects the GPU's memory");
  expect_refused_before_the_gpu(dir, "", small_run_flags(dir, 1000, 200) + " --device_capacity 80GiB",
                                "--device_capacity 80GiB is the GPU's memory for --dry_run 1");
}
