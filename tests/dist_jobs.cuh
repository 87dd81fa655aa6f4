// tests/dist_jobs.cuh — processes started by the distributed tests: a free TCP port, a forked body
// with its output captured, and sub-jobs (this binary started again as a job of W ranks that runs
// one scenario test, DistScenario.DISABLED_<name>) whose exit code, duration and output the calling
// test checks.
#pragma once
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <chrono>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>
#include "dist_util.cuh"
#include "../runtime/launch.cuh"

// GoogleTest's sharding variables (`tests/gpu.sh dist` with DIST_SHARD): they split the outer run's tests, and
// a sub-job that runs one named scenario must not be split again (its one test could fall in another shard).
inline const std::vector<std::string>& gtest_shard_variable_names() {
  static const std::vector<std::string> names = {"GTEST_TOTAL_SHARDS", "GTEST_SHARD_INDEX", "GTEST_SHARD_STATUS_FILE"};
  return names;
}

// A TCP port that was free a moment ago (the kernel picks it).
inline int free_tcp_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(addr);
  EXPECT_EQ(bind(fd, (sockaddr*)&addr, sizeof(addr)), 0) << strerror(errno);
  EXPECT_EQ(getsockname(fd, (sockaddr*)&addr, &len), 0) << strerror(errno);
  close(fd);
  return ntohs(addr.sin_port);
}

// Forks a process that runs `body` with its stdout and stderr sent into a pipe; returns its pid
// and the read end.
template <typename F>
inline std::pair<pid_t, int> fork_capturing(F body) {
  int fds[2];
  EXPECT_EQ(pipe(fds), 0) << strerror(errno);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    body();
    fflush(stdout);
    fflush(stderr);
    _exit(0);
  }
  close(fds[1]);
  return {pid, fds[0]};
}

inline std::string read_all_and_close(int fd) {
  std::string text;
  char buf[4096];
  for (ssize_t n; (n = read(fd, buf, sizeof(buf))) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) break;
    text.append(buf, n);
  }
  close(fd);
  return text;
}

// ---------------------------------------------------------------------------------------------
// Sub-jobs: this binary started again as a job of `world` ranks that runs only the scenario test
// DistScenario.DISABLED_<name>, with FLATMOE_COMM_TIMEOUT_S=10, its logs in
// LOGDIR/dist_scenario_<name>/ and the NAME=VALUE entries of `env_add`. Killed after 120 s if it has
// not ended.

struct JobResult {
  int exit_code = -1;
  double seconds = 0;
  std::string output;  // the job's stdout and stderr: the launcher's messages, rank logs, summary
};

inline JobResult run_scenario_job(const std::string& name, int world, std::vector<std::string> env_add = {}) {
  std::string dir = test_log_dir() + "/dist_scenario_" + name;
  std::string out_path = dir + "/job.out";
  std::vector<std::string> args = {"test_dist", "--gtest_filter=DistScenario.DISABLED_" + name,
                                   "--gtest_also_run_disabled_tests"};
  env_add.insert(env_add.end(), {"FLATMOE_TEST_WORLD=" + std::to_string(world), "FLATMOE_COMM_TIMEOUT_S=10",
                                 "FLATMOE_TEST_LOG_DIR=" + dir});
  std::vector<std::string> dropped = rank_variable_names();  // started by nobody, and not sharded
  dropped.insert(dropped.end(), gtest_shard_variable_names().begin(), gtest_shard_variable_names().end());
  std::vector<std::string> env = environment_with(dropped, env_add);
  std::vector<char*> argv = exec_array(args), envp = exec_array(env);
  make_test_dirs(dir);
  int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  EXPECT_GE(out, 0) << out_path << ": " << strerror(errno);
  JobResult job;
  auto start = std::chrono::steady_clock::now();
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // the job ends with this rank
    dup2(out, STDOUT_FILENO);
    dup2(out, STDERR_FILENO);
    execve("/proc/self/exe", argv.data(), envp.data());
    _exit(127);
  }
  close(out);
  int status = 0;
  while (waitpid(pid, &status, WNOHANG) == 0) {
    if (seconds_since(start) > 120) {
      kill(pid, SIGKILL);  // its ranks follow (PR_SET_PDEATHSIG)
      waitpid(pid, &status, 0);
      ADD_FAILURE() << "scenario job " << name << " did not end within 120 s";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  job.seconds = seconds_since(start);
  job.exit_code = exit_code_of(status);
  job.output = read_text_file(out_path);
  printf("[dist] scenario %s: exit code %d after %.1f s (output: %s)\n", name.c_str(), job.exit_code, job.seconds,
         out_path.c_str());
  return job;
}

// The other ranks of a test in which rank 0 alone runs sub-jobs: they wait on the host until rank 0's results file
// says this test ended, polling it, rather than going on into the next test's collectives, where they would wait
// for rank 0 in NCCL kernels that spin on the GPU. On a GPU the ranks share, W - 1 spinning kernels starve the
// sub-job's ranks of the GPU (at W = 8, two runs on one H100: a sub-job's communicator took more than its 10 s to
// start). Ranks of test_dist's own launcher only (one host, one log folder); under mpirun or srun they go on.
inline void others_wait_for_rank_zero() {
  if (!test_rank_of_our_launcher()) return;
  const testing::TestInfo* test = testing::UnitTest::GetInstance()->current_test_info();
  const std::string name = std::string(test->test_suite_name()) + "." + test->name();
  const std::string results = test_rank_file(0, ".results");
  auto start = std::chrono::steady_clock::now();
  for (;;) {
    std::istringstream lines(read_text_file(results));
    for (std::string line; std::getline(lines, line);)
      if (line == "PASSED " + name || line == "FAILED " + name || line == "SKIPPED " + name) return;
    if (seconds_since(start) > comm_timeout_s()) {
      ADD_FAILURE() << "rank " << test_rank() << ": rank 0 did not end " << name << " within " << comm_timeout_s()
                    << " s (FLATMOE_COMM_TIMEOUT_S); its results: " << results;
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

inline void expect_contains(const JobResult& job, const std::string& text) {
  EXPECT_NE(job.output.find(text), std::string::npos) << "expected \"" << text << "\" in the job's output:\n"
                                                      << job.output;
}

