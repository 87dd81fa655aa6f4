// tests/dist_util.cuh — what the distributed tests (tests/dist_*.cu, one binary test_dist whose main()
// is tests/dist_main.cu) share: the world communicator of the run, this process's rank, the folder of
// the rank logs, and REQUIRE_WORLD(n), which skips a test when the run has fewer than n ranks (on
// every rank alike, so that the ranks never diverge). With FLATMOE_REQUIRE_GPU=1 a run without a
// usable CUDA device fails such a test instead; a run with fewer GPUs than the test needs still skips it.
//
// Rules for tests that communicate: every rank runs every test, in the same order, and calls the
// same collectives; check with EXPECT_* (not ASSERT_*) before a collective, so that a failed check on
// one rank does not make it skip a collective that the others wait in. testutil::Rng draws the same
// numbers on every rank (the launcher gives all ranks one FLATMOE_SEED), so each rank can build the
// GLOBAL inputs and check its own shard against the math (notes/design.md §3).
#pragma once
#include <sys/stat.h>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include "gpu_util.cuh"
#include "../runtime/comm.cuh"

// The world communicator over all ranks of the run. Exits with a message when there is none
// (no CUDA device): guard the test with REQUIRE_WORLD(n).
const Comm& test_world();
// Ranks in the world communicator; 0 when there is no CUDA device (then there is no communicator).
int test_world_size();
// This process's rank (0 when the tests run in one process).
int test_rank();
// Whether this process is a rank started by test_dist's own launcher (all ranks on this host, each with its
// log and results file in the log folder); false under mpirun or srun and in one process.
bool test_rank_of_our_launcher();
// Where the rank logs go: FLATMOE_TEST_LOG_DIR, default build/test-logs.
inline std::string test_log_dir() {
  const char* dir = getenv("FLATMOE_TEST_LOG_DIR");
  return dir != nullptr && dir[0] != '\0' ? dir : "build/test-logs";
}

// A rank's file in the log folder: dist_rankR.log (its output) or dist_rankR.results (its tests' outcomes,
// tests/dist_main.cu), written by the ranks of test_dist's own launcher.
inline std::string test_rank_file(int rank, const char* ext) {
  return test_log_dir() + "/dist_rank" + std::to_string(rank) + ext;
}

// mkdir -p
inline void make_test_dirs(const std::string& path) {
  for (size_t slash = path.find('/', 1);; slash = path.find('/', slash + 1)) {
    std::string prefix = path.substr(0, slash);
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      fprintf(stderr, "test_dist: cannot create %s: %s\n", prefix.c_str(), strerror(errno));
      exit(EXIT_FAILURE);
    }
    if (slash == std::string::npos) return;
  }
}

// The whole file ("" when it cannot be read).
inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

// Why a test that needs n ranks skips in this run, which has fewer.
inline std::string world_skip_message(int n) {
  const int world = test_world_size();
  const std::string text = "needs " + std::to_string(n) + " GPUs (ranks); this run has " + std::to_string(world);
  if (world == 0) return text + " (no usable CUDA device: " + testutil::gpu_unusable_reason() + ")";
  if (testutil::gpu_required())
    return text + " (FLATMOE_REQUIRE_GPU=1 requires one usable GPU, which this run has, not " + std::to_string(n) + ")";
  return text;
}

#define REQUIRE_WORLD(n)                                                                                 \
  do {                                                                                                   \
    if (test_world_size() == 0 && testutil::gpu_required())                                              \
      FAIL() << "FLATMOE_REQUIRE_GPU=1 but no usable CUDA device: " << testutil::gpu_unusable_reason(); \
    if (test_world_size() < (n)) GTEST_SKIP() << world_skip_message(n);                                  \
  } while (0)
