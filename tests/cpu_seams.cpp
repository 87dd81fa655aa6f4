// tests/cpu_seams.cpp — the seams' registries (config.hpp: moe_choices, head_choices,
// optimizer_choices): every registered choice validates where its needs are met and is refused as its
// needs state where they are not, every mode of a choice validates, an unregistered name is refused
// naming the table, and what --help, tools/bench_ep_moe and tests/dist_model.cu list is the table.
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "../config.hpp"
#include "test_util.hpp"

namespace {

ModelConfig seam_model() {
  ModelConfig m;
  m.vocab = 256;
  return m;
}

std::string validate_error(const TrainConfig& t, const ModelConfig& m) {
  try {
    validate(t, m);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

struct Seam {
  std::string flag;                        // --moe
  std::string TrainConfig::*field;         // where it is kept
  const std::vector<SeamChoice>& choices;  // its registry
};

std::vector<Seam> seams() {
  return {{"--moe", &TrainConfig::moe, moe_choices()},
          {"--head", &TrainConfig::head, head_choices()},
          {"--optimizer", &TrainConfig::optimizer, optimizer_choices()}};
}

// A run of 4 ranks (E_p = 4) or of one, with `choice` on its seam.
TrainConfig run_with(const Seam& seam, const SeamChoice& choice, int gpus) {
  TrainConfig t;
  t.gpus = gpus;
  t.*seam.field = choice.name;
  return t;
}

// The training flag a flag text names ("--llep_alpha"), or nullptr.
const Flag<TrainConfig>* train_flag(const std::string& name) { return find_flag(train_flags(), name); }

}  // namespace

// Each choice runs where its needs are met, and a run that lacks them is refused as its needs say.
TEST(SeamRegistry, EveryChoiceValidatesWhereItsNeedsAreMetAndIsRefusedWhereNot) {
  const ModelConfig m = seam_model();
  for (const Seam& seam : seams())
    for (const SeamChoice& choice : seam.choices) {
      const std::string what = seam.flag + " " + choice.name;
      switch (choice.needs) {
        case SeamNeeds::Nothing:
          EXPECT_EQ(validate_error(run_with(seam, choice, 1), m), "") << what;
          EXPECT_EQ(validate_error(run_with(seam, choice, 4), m), "") << what;
          break;
        case SeamNeeds::EveryExpert: {
          EXPECT_EQ(validate_error(run_with(seam, choice, 1), m), "") << what;
          TrainConfig t = run_with(seam, choice, 4);
          t.ep = 1;
          EXPECT_EQ(validate_error(t, m), "") << what << " with --ep 1";
          EXPECT_EQ(validate_error(run_with(seam, choice, 4), m),
                    what + " keeps every expert on each rank: it needs --ep 1 (got ep 4)");
          break;
        }
        case SeamNeeds::ExpertGroup:
          EXPECT_EQ(validate_error(run_with(seam, choice, 4), m), "") << what;
          EXPECT_EQ(validate_error(run_with(seam, choice, 1), m),
                    what + " exchanges routes between ranks: it needs --gpus > 1 (got 1)");
          break;
        case SeamNeeds::VocabularyGroup: {
          EXPECT_EQ(validate_error(run_with(seam, choice, 1), m), "") << what;
          TrainConfig t = run_with(seam, choice, 4);
          EXPECT_EQ(validate_error(t, m), "") << what;
          EXPECT_EQ(vocab_group_size(t), 4) << what;
          t.vocab_group = 3;
          EXPECT_EQ(validate_error(t, m), "vocab_group (3) must divide the number of ranks (4)");
          break;
        }
      }
      if (choice.needs != SeamNeeds::VocabularyGroup) {
        EXPECT_EQ(vocab_group_size(run_with(seam, choice, 4)), 1) << what;
      }
    }
}

// A name that no line of the table holds is refused, naming every registered choice in order.
TEST(SeamRegistry, AnUnregisteredChoiceIsRefusedNamingTheTable) {
  const ModelConfig m = seam_model();
  for (const Seam& seam : seams()) {
    TrainConfig t;
    t.gpus = 2;
    t.*seam.field = "unregistered";
    EXPECT_EQ(validate_error(t, m),
              seam.flag + " expects one of " + joined(choice_names(seam.choices), ", ") + ", got 'unregistered'");
  }
}

// Every mode of a choice is a value its mode flag takes; another value is refused by the choice's checks.
TEST(SeamRegistry, EveryModeValidatesThroughItsFlag) {
  const ModelConfig m = seam_model();
  for (const Seam& seam : seams())
    for (const SeamChoice& choice : seam.choices) {
      EXPECT_EQ(choice.mode_flag.empty(), choice.modes.empty()) << choice.name << ": a mode flag and its modes go together";
      if (choice.modes.empty()) continue;
      ASSERT_NE(train_flag(choice.mode_flag), nullptr) << choice.name << "'s mode flag " << choice.mode_flag;
      for (const std::string& mode : choice.modes) {
        TrainConfig t = run_with(seam, choice, 4);
        set_train_flag(t, choice.mode_flag, mode);
        EXPECT_EQ(validate_error(t, m), "") << choice.name << " " << choice.mode_flag << " " << mode;
      }
      TrainConfig t = run_with(seam, choice, 4);
      set_train_flag(t, choice.mode_flag, "unregistered");
      EXPECT_NE(validate_error(t, m).find("unregistered"), std::string::npos) << validate_error(t, m);
    }
}

// Each line names its file and only flags that exist; each flag it brings is checked whichever choice runs.
TEST(SeamRegistry, EveryLineNamesItsFileAndFlagsThatExist) {
  for (const Seam& seam : seams())
    for (const SeamChoice& choice : seam.choices) {
      struct stat sb;
      EXPECT_EQ(stat(choice.file.c_str(), &sb), 0) << choice.name << ": " << choice.file;
      EXPECT_FALSE(choice.summary.empty()) << choice.name;
      size_t at = 0;
      while ((at = choice.flags.find("--", at)) != std::string::npos) {
        const std::string flag = choice.flags.substr(at, choice.flags.find(' ', at) - at);
        EXPECT_NE(train_flag(flag), nullptr) << choice.name << " reads " << flag;
        at += flag.size();
      }
    }
  // a flag a choice brings is refused with another choice chosen, too (the checks run whichever runs)
  TrainConfig t;
  t.llep_alpha = 0.5f;
  EXPECT_NE(validate_error(t, seam_model()).find("llep_alpha must be >= 1"), std::string::npos);
  t = TrainConfig();
  t.offload_slots = 0;
  EXPECT_NE(validate_error(t, seam_model()).find("offload_slots"), std::string::npos);
}

// --help lists each seam's choices from its table: the flag with every name, then a line per choice with
// its summary and file, and the flags it reads.
TEST(SeamRegistry, HelpListsTheTables) {
  const std::string help = usage();
  for (const Seam& seam : seams()) {
    EXPECT_NE(help.find(seam.flag + " " + joined(choice_names(seam.choices), "|")), std::string::npos) << seam.flag;
    for (const SeamChoice& choice : seam.choices) {
      EXPECT_NE(help.find(choice.name + ": " + choice.summary + " (" + choice.file + ")\n"), std::string::npos) << choice.name;
      if (!choice.flags.empty()) {
        EXPECT_NE(help.find(choice.flags + "\n"), std::string::npos) << choice.name;
      }
    }
  }
}

// The runs tools/bench_ep_moe measures (after 1gpu) and tests/dist_model.cu trains with: each dispatcher
// that exchanges routes, once in each mode.
TEST(SeamRegistry, RunsAreEachExchangingDispatcherInEachMode) {
  std::vector<std::string> labels;
  for (const SeamRun& run : seam_runs(moe_choices(), SeamNeeds::ExpertGroup)) {
    labels.push_back(run.label);
    const SeamChoice* choice = find_choice(moe_choices(), run.choice);
    ASSERT_NE(choice, nullptr) << run.label;
    EXPECT_EQ(choice->needs, SeamNeeds::ExpertGroup);
    EXPECT_EQ(run.label, run.mode.empty() ? run.choice : run.choice + "_" + run.mode);
  }
  // every line of the registry that needs expert groups, in its order, once per mode (a new dispatcher's
  // line adds its runs here without an edit)
  std::vector<std::string> expected, single;
  for (const SeamChoice& choice : moe_choices()) {
    if (choice.needs != SeamNeeds::ExpertGroup) continue;
    if (choice.modes.empty()) expected.push_back(choice.name);
    for (const std::string& mode : choice.modes) expected.push_back(choice.name + "_" + mode);
  }
  EXPECT_EQ(labels, expected);
  EXPECT_GE(labels.size(), 6u) << "ep, llep, pllep and relay's three modes at least";
  for (const SeamRun& run : seam_runs(moe_choices(), SeamNeeds::EveryExpert)) single.push_back(run.label);
  EXPECT_EQ(joined(single, ","), "local");
}

// tools/bench_ep_moe's list of dispatchers, as it prints it when refusing one: 1gpu and the runs above
// (FLATMOE_BIN: the build folder, default build/; skipped when its BF16 benchmark is not built).
TEST(SeamRegistryBinaries, BenchEpMoeListsTheRegisteredDispatchers) {
  const char* dir = std::getenv("FLATMOE_BIN");
  const std::string bench = std::string(dir ? dir : "build/") + "bf16/bench_ep_moe";
  struct stat sb;
  if (stat(bench.c_str(), &sb) != 0) GTEST_SKIP() << bench << " not built";
  testutil::TempDir tmp;
  const std::string err = tmp.file("stderr.txt");
  EXPECT_NE(std::system((bench + " --dispatchers unregistered 2> " + err).c_str()), 0);
  std::vector<std::string> labels = {"1gpu"};
  for (const SeamRun& run : seam_runs(moe_choices(), SeamNeeds::ExpertGroup)) labels.push_back(run.label);
  const std::string message = testutil::read_bytes(err);
  EXPECT_NE(message.find("unknown dispatcher 'unregistered' (" + joined(labels, ", ") + ")"), std::string::npos) << message;
  EXPECT_NE(message.find("[--dispatchers " + joined(labels, ",") + "]"), std::string::npos) << message;
}
