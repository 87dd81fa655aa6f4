// tests/dist_main.cu — main() of build/{fp32,bf16}/test_dist, whose tests are tests/dist_*.cu.
//
// W = FLATMOE_TEST_WORLD, or min(2, CUDA devices) when it is unset; W above the CUDA devices needs the
// ranks to share GPUs (FLATMOE_SHARE_GPUS=1, runtime/launch.cuh: each its own NCCL host, sockets).
//   W >= 2: this process is the launcher (runtime/launch.cuh). It starts W ranks of itself and waits. Each
//     rank makes the world communicator (test_world()), runs every test, writes its output to
//     LOGDIR/dist_rankR.log and each test's outcome to LOGDIR/dist_rankR.results (LOGDIR =
//     FLATMOE_TEST_LOG_DIR, default build/test-logs), and exits 0 once it has run them all. Then this
//     process prints rank 0's log, the logs of the ranks that failed, and one gtest summary over all
//     ranks (a test fails when it failed on any rank; a rank that did not finish counts as a failure),
//     and exits non-zero if anything failed (with the first failing rank's
//     status when a rank failed). All ranks get one FLATMOE_SEED (printed) and, unless it is set,
//     FLATMOE_COMM_TIMEOUT_S=300, so that a rank stuck in a collective ends the run.
//   W < 2: the tests run in this process; the world is the one GPU (REQUIRE_WORLD(2) skips, also with
//     FLATMOE_REQUIRE_GPU=1), or absent without a CUDA device (REQUIRE_WORLD(1) skips too, or fails
//     with FLATMOE_REQUIRE_GPU=1).
// Started by mpirun or srun, each rank runs the tests with its output where that launcher puts it.
// Ranks without a CUDA device (FLATMOE_TEST_WORLD=2 on a machine without GPUs) make no communicator:
// they run the host-only tests (and fail the others with FLATMOE_REQUIRE_GPU=1).
// At exit every process that ran the tests has released the runtime (the global test environment of
// gpu_util.cuh: cuBLAS, every pool block back to CUDA, a leak fails) and destroys its communicator.
#include <fcntl.h>
#include <map>
#include <random>
#include "dist_util.cuh"
#include "../runtime/launch.cuh"

namespace {

Comm world_comm;
bool world_exists = false;
int process_rank = 0;
bool process_is_our_rank = false;  // started by run_ranks_and_report's launcher

// Writes "STARTED Suite.Name" as each test starts and "PASSED|FAILED|SKIPPED Suite.Name" as it ends,
// then "FINISHED", flushing every line so that a rank that dies leaves what it had done.
class RankResults : public testing::EmptyTestEventListener {
 public:
  explicit RankResults(const std::string& path) : file_(fopen(path.c_str(), "w")) {
    if (file_ == nullptr) {
      fprintf(stderr, "test_dist: cannot write %s: %s\n", path.c_str(), strerror(errno));
      exit(EXIT_FAILURE);
    }
  }
  void OnTestStart(const testing::TestInfo& test) override {
    fprintf(file_, "STARTED %s.%s\n", test.test_suite_name(), test.name());
    fflush(file_);
  }
  void OnTestEnd(const testing::TestInfo& test) override {
    const char* outcome = test.result()->Failed() ? "FAILED" : test.result()->Skipped() ? "SKIPPED" : "PASSED";
    fprintf(file_, "%s %s.%s\n", outcome, test.test_suite_name(), test.name());
    fflush(file_);
  }
  void OnTestProgramEnd(const testing::UnitTest&) override {
    fprintf(file_, "FINISHED\n");
    fclose(file_);
  }

 private:
  FILE* file_;
};

// stdout and stderr of this rank go to its log (line-buffered, so that a killed rank leaves its lines).
void redirect_output_to(const std::string& path) {
  int fd = open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) {
    fprintf(stderr, "test_dist: cannot write %s: %s\n", path.c_str(), strerror(errno));
    exit(EXIT_FAILURE);
  }
  fflush(stdout);
  fflush(stderr);
  if (dup2(fd, STDOUT_FILENO) < 0 || dup2(fd, STDERR_FILENO) < 0) {
    fprintf(stderr, "test_dist: dup2 onto %s: %s\n", path.c_str(), strerror(errno));
    exit(EXIT_FAILURE);
  }
  close(fd);
  setvbuf(stdout, nullptr, _IOLBF, 0);
}

int requested_world() {
  const char* text = getenv("FLATMOE_TEST_WORLD");
  if (text == nullptr) return std::min(2, gpu_count());
  int world = 0;
  if (!parse_int_in(text, 1, 1 << 20, &world)) {
    fprintf(stderr, "test_dist: FLATMOE_TEST_WORLD='%s' is not a number of ranks >= 1\n", text);
    exit(EXIT_FAILURE);
  }
  return world;
}

// The launcher side: starts the ranks, then prints their logs and one summary over all of them.
int run_ranks_and_report(std::vector<std::string> args, int world) {
  if (getenv("FLATMOE_SEED") == nullptr) {
    std::random_device rd;
    unsigned long long seed = ((unsigned long long)rd() << 32) | rd();
    setenv("FLATMOE_SEED", std::to_string(seed).c_str(), 1);
  }
  setenv("FLATMOE_COMM_TIMEOUT_S", "300", 0);
  // More ranks than GPUs only when they may share them (FLATMOE_SHARE_GPUS=1); without a GPU the ranks
  // run the host-only tests.
  bool share = false;
  std::string why = parse_gpu_sharing([](const char* name) -> const char* { return getenv(name); }, &share);
  const int gpus = gpu_count();
  if (why.empty() && gpus > 0) why = launcher_gpus_refusal(world, gpus, share);
  if (!why.empty()) {
    fprintf(stderr, "test_dist: FLATMOE_TEST_WORLD=%d: %s\n", world, why.c_str());
    return EXIT_FAILURE;
  }
  make_test_dirs(test_log_dir());
  for (int r = 0; r < world; r++) {
    remove(test_rank_file(r, ".log").c_str());
    remove(test_rank_file(r, ".results").c_str());
  }
  printf("[dist] %d ranks, FLATMOE_SEED=%s, FLATMOE_COMM_TIMEOUT_S=%s; rank logs: %s/dist_rankR.log\n", world,
         getenv("FLATMOE_SEED"), getenv("FLATMOE_COMM_TIMEOUT_S"), test_log_dir().c_str());
  if (share && gpus > 0 && gpus < world) printf("[dist] %s\n", sharing_banner(world, gpus).c_str());
  fflush(stdout);
  std::vector<char*> argv = exec_array(args);
  int status = run_local_ranks((int)args.size(), argv.data(), world);

  std::vector<std::string> order;              // test names, first seen first
  std::map<std::string, std::string> outcome;  // PASSED if it passed on a rank, FAILED if it failed on any
  std::map<std::string, std::string> failed_on;
  std::vector<std::string> rank_problems;
  std::vector<bool> print_log(world, false);
  print_log[0] = true;
  for (int r = 0; r < world; r++) {
    std::istringstream lines(read_text_file(test_rank_file(r, ".results")));
    bool finished = false;
    std::string running;  // the test that started last and has not ended
    for (std::string line; std::getline(lines, line);) {
      if (line == "FINISHED") {
        finished = true;
        continue;
      }
      size_t space = line.find(' ');
      std::string result = line.substr(0, space), name = line.substr(space + 1);
      running = result == "STARTED" ? name : "";
      if (result == "STARTED") continue;
      if (!outcome.count(name)) {
        order.push_back(name);
        outcome[name] = result;
      }
      if (result == "FAILED") {
        outcome[name] = "FAILED";
        failed_on[name] += " " + std::to_string(r);
        print_log[r] = true;
      } else if (result == "PASSED" && outcome[name] == "SKIPPED") {
        outcome[name] = "PASSED";
      }
    }
    if (!finished) {
      rank_problems.push_back("rank " + std::to_string(r) + " did not finish" +
                              (running.empty() ? "" : ": it ended inside " + running) + " (see " +
                              test_rank_file(r, ".log") + ")");
      print_log[r] = true;
    }
  }
  if (status != 0 && rank_problems.empty())
    rank_problems.push_back("the launcher exited with status " + std::to_string(status));

  for (int r = 0; r < world; r++) {
    if (!print_log[r]) continue;
    printf("[dist] ===== rank %d: %s =====\n%s", r, test_rank_file(r, ".log").c_str(),
           read_text_file(test_rank_file(r, ".log")).c_str());
  }
  int passed = 0, skipped = 0, failed = (int)rank_problems.size();
  for (const std::string& name : order) {
    passed += outcome[name] == "PASSED";
    skipped += outcome[name] == "SKIPPED";
    failed += outcome[name] == "FAILED";
  }
  printf("[dist] ===== summary over %d ranks =====\n", world);
  printf("[==========] %zu tests ran on each of %d ranks.\n", order.size(), world);
  printf("[  PASSED  ] %d tests.\n", passed);
  if (skipped > 0) {
    printf("[  SKIPPED ] %d tests, listed below:\n", skipped);
    for (const std::string& name : order)
      if (outcome[name] == "SKIPPED") printf("[  SKIPPED ] %s\n", name.c_str());
  }
  if (failed > 0) {
    printf("[  FAILED  ] %d tests, listed below:\n", failed);
    for (const std::string& name : order)
      if (outcome[name] == "FAILED") printf("[  FAILED  ] %s (on rank%s)\n", name.c_str(), failed_on[name].c_str());
    for (const std::string& problem : rank_problems) printf("[  FAILED  ] %s\n", problem.c_str());
  }
  fflush(stdout);
  if (status != 0) return status;  // the failing rank's status, as launch() would exit with
  return failed > 0 ? EXIT_FAILURE : EXIT_SUCCESS;
}

}  // namespace

const Comm& test_world() {
  if (!world_exists) {
    fprintf(stderr, "test_dist: test_world() called without a world communicator (no CUDA device); "
                    "guard the test with REQUIRE_WORLD(n)\n");
    exit(EXIT_FAILURE);
  }
  return world_comm;
}

int test_world_size() { return world_exists ? world_comm.size : 0; }

int test_rank() { return process_rank; }

bool test_rank_of_our_launcher() { return process_is_our_rank; }

int main(int argc, char** argv) {
  std::vector<std::string> args(argv, argv + argc);  // the ranks get the flags as given (gtest removes its own)
  testing::InitGoogleTest(&argc, argv);
  int world = requested_world();
  LaunchEnv env;
  std::string why = parse_launch_env([](const char* name) -> const char* { return getenv(name); }, 1, &env);
  if (!why.empty()) {
    fprintf(stderr, "test_dist: %s\n", why.c_str());
    return EXIT_FAILURE;
  }
  if (env.mode == LaunchMode::Launcher && world >= 2) return run_ranks_and_report(args, world);

  process_rank = env.rank;
  process_is_our_rank = env.mode == LaunchMode::Child;
  if (env.mode == LaunchMode::Child) {
    redirect_output_to(test_rank_file(env.rank, ".log"));
    testing::UnitTest::GetInstance()->listeners().Append(new RankResults(test_rank_file(env.rank, ".results")));
  }
  if (gpu_count() > 0) {
    std::vector<char*> launch_argv = exec_array(args);
    world_comm = comm_world_init(launch((int)args.size(), launch_argv.data(), 1));
    world_exists = true;
  }
  int failures = RUN_ALL_TESTS();
  if (world_exists) comm_destroy(world_comm);
  // A rank of our launcher reports its outcomes in its results file; a failed test must not make the
  // launcher stop the ranks that are still running theirs.
  return env.mode == LaunchMode::Child ? EXIT_SUCCESS : failures;
}
