// launch.cuh — starting the W ranks of a job (one process per GPU) and giving each its LaunchInfo
// (runtime/comm.cuh: rank, world size, local rank = CUDA device, NCCL id). launch() finds out how this
// process was started:
//   * by nobody, gpus > 1 (one node): it is the launcher. It creates the NCCL id, forks and execs
//     /proc/self/exe W times with the same argv and FLATMOE_RANK, FLATMOE_WORLD, FLATMOE_LOCAL_RANK,
//     FLATMOE_NCCL_ID (hex) added to the environment, and waits. When a rank fails (non-zero exit or a
//     signal), the others get SIGTERM (SIGKILL after 10 s) and the launcher exits with the failing
//     rank's status, naming the rank. Ranks die with the launcher (PR_SET_PDEATHSIG), so none is left.
//   * by our launcher (FLATMOE_RANK set): it reads the variables above.
//   * by mpirun, mpiexec or srun (Open MPI OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK, MVAPICH2
//     MV2_COMM_WORLD_RANK/SIZE/LOCAL_RANK, MPICH and Intel MPI PMI_RANK/PMI_SIZE/MPI_LOCALRANKID, Slurm
//     SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID; many nodes; a launcher's variables present but
//     incomplete, or PMIx's PMIX_RANK alone, are refused rather than run as one silent rank): rank 0
//     creates the NCCL id and serves it over TCP (IPv4) at
//     FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT (like torchrun's MASTER_ADDR/PORT; refused when missing);
//     the others connect, retrying until rank 0 listens. A job of one task (srun -n1, an sbatch script)
//     counts as started by nobody.
//   * by nobody, gpus == 1: rank 0 of 1 (comm_world_init makes its own NCCL id).
// Under mpirun/srun, gpus must be 1 (left out) or the job's size. Each rank's CUDA device: FLATMOE_DEVICE
// when set, the only visible one when a task sees one GPU, else its local rank (choose_device). The rendezvous gives up after
// FLATMOE_COMM_TIMEOUT_S (default 600 s). Malformed variables are refused with a message naming them
// ("flatmoe launch: ..."), exit status 1. Call launch() first in main(), before anything creates a
// CUDA context (the launching parent needs none).
#pragma once
#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <functional>
#include <nccl.h>
#include <cstdarg>
#include <cstring>
#include <string>
#include <vector>
#include "check.cuh"

extern char** environ;

// What a process learns from the launcher (runtime/launch.cuh).
struct LaunchInfo {
  int rank = 0, world = 1, local_rank = 0;
  ncclUniqueId id{};
};

// ---------------------------------------------------------------------------------------------
// Settings from the environment

// NCCL_NVLS_ENABLE=0 unless already 0; any other value is refused. Called before the first NCCL call
// of the process (by launch() and comm_world_init()).
inline void comm_set_nccl_env() {
  setenv("NCCL_NVLS_ENABLE", "0", 0);
  const char* nvls = getenv("NCCL_NVLS_ENABLE");
  if (strcmp(nvls, "0") != 0) {
    fprintf(stderr, "flatmoe: NCCL_NVLS_ENABLE=%s: NVLink multicast must stay off; unset it or set it to 0\n", nvls);
    exit(EXIT_FAILURE);
  }
}

__attribute__((format(printf, 1, 2))) inline std::string comm_format(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string s = fm_format(fmt, ap);
  va_end(ap);
  return s;
}


// NCCL's name of a result, with its last error message when it has one.
inline std::string nccl_why(ncclResult_t result, ncclComm_t nccl) {
  std::string why = ncclGetErrorString(result);
  const char* last = ncclGetLastError(nccl);
  if (last != nullptr && last[0] != '\0') why += std::string(" (") + last + ")";
  return why;
}

[[noreturn]] __attribute__((format(printf, 1, 2))) inline void launch_fail(const char* fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  std::string why = fm_format(fmt, ap);
  va_end(ap);
  fprintf(stderr, "flatmoe launch: %s\n", why.c_str());
  fflush(stderr);
  exit(EXIT_FAILURE);
}

// ---------------------------------------------------------------------------------------------
// The NCCL id as text (2 lowercase hex digits per byte)

inline std::string nccl_id_to_hex(const ncclUniqueId& id) {
  static const char digits[] = "0123456789abcdef";
  std::string hex(2 * sizeof(id.internal), '0');
  for (size_t i = 0; i < sizeof(id.internal); i++) {
    unsigned char b = (unsigned char)id.internal[i];
    hex[2 * i] = digits[b >> 4];
    hex[2 * i + 1] = digits[b & 15];
  }
  return hex;
}

// Exactly 2·NCCL_UNIQUE_ID_BYTES hex digits (either case); false otherwise.
inline bool nccl_id_from_hex(const char* hex, ncclUniqueId* id) {
  if (hex == nullptr || strlen(hex) != 2 * sizeof(id->internal)) return false;
  auto nibble = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  for (size_t i = 0; i < sizeof(id->internal); i++) {
    int hi = nibble(hex[2 * i]), lo = nibble(hex[2 * i + 1]);
    if (hi < 0 || lo < 0) return false;
    id->internal[i] = (char)(hi * 16 + lo);
  }
  return true;
}

// ---------------------------------------------------------------------------------------------
// The launcher's variables

// A decimal integer in [lo, hi] and nothing else; false otherwise.
inline bool parse_int_in(const char* text, long lo, long hi, int* out) {
  if (text == nullptr || text[0] == '\0') return false;
  char* end = nullptr;
  errno = 0;
  long v = strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return false;
  *out = (int)v;
  return true;
}

enum class LaunchMode {
  Launcher,  // started by nobody: starts the ranks itself (gpus > 1) or is the only rank
  Child,     // started by our launcher (FLATMOE_RANK, ...)
  External,  // started by mpirun or srun: TCP rendezvous at FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT
};

struct LaunchEnv {
  LaunchMode mode = LaunchMode::Launcher;
  int rank = 0, world = 1, local_rank = 0;
  ncclUniqueId id{};        // Child
  std::string master_addr;  // External
  int master_port = 0;      // External
};

using EnvLookup = std::function<const char*(const char*)>;

// Reads the launcher variables through `env` (getenv in launch(); tests pass a table). Returns "" and
// fills *out, or why the variables are refused.
inline std::string parse_launch_env(const EnvLookup& env, int gpus, LaunchEnv* out) {
  if (gpus < 1) return comm_format("%d GPUs requested: need at least 1", gpus);
  LaunchEnv e;
  if (env("FLATMOE_RANK") != nullptr) {
    e.mode = LaunchMode::Child;
    const char* names[] = {"FLATMOE_WORLD", "FLATMOE_LOCAL_RANK", "FLATMOE_NCCL_ID"};
    for (const char* name : names)
      if (env(name) == nullptr) return comm_format("FLATMOE_RANK is set but %s is missing (flatmoe's launcher sets both)", name);
    if (!parse_int_in(env("FLATMOE_WORLD"), 1, 1 << 20, &e.world))
      return comm_format("FLATMOE_WORLD='%s' is not a world size >= 1", env("FLATMOE_WORLD"));
    if (!parse_int_in(env("FLATMOE_RANK"), 0, e.world - 1, &e.rank))
      return comm_format("FLATMOE_RANK='%s' is not a rank in [0, %d)", env("FLATMOE_RANK"), e.world);
    if (!parse_int_in(env("FLATMOE_LOCAL_RANK"), 0, e.world - 1, &e.local_rank))
      return comm_format("FLATMOE_LOCAL_RANK='%s' is not a local rank in [0, %d)", env("FLATMOE_LOCAL_RANK"), e.world);
    if (!nccl_id_from_hex(env("FLATMOE_NCCL_ID"), &e.id))
      return comm_format("FLATMOE_NCCL_ID is not %zu hex digits", 2 * sizeof(e.id.internal));
    *out = e;
    return "";
  }
  // The launchers whose variables are read, in this order (mpirun inside a Slurm allocation sets
  // both its own and Slurm's: the MPI's describe the job). Under srun the step's task count is the
  // world (SLURM_STEP_NUM_TASKS; SLURM_NTASKS where an older Slurm does not set it).
  struct Source {
    const char *rank, *size, *local_rank, *launcher;
  };
  const Source sources[] = {
      {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun"},
      {"MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "mpirun (MVAPICH2)"},
      {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "mpiexec (MPICH / Intel MPI)"},
      {"SLURM_PROCID", env("SLURM_STEP_NUM_TASKS") != nullptr ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS", "SLURM_LOCALID",
       "srun"}};
  for (const Source& s : sources) {
    if (env(s.rank) == nullptr && env(s.size) == nullptr) continue;
    if (env(s.rank) == nullptr)  // a launcher is there, but which rank this is cannot be told
      return comm_format("%s is set but %s is missing: started by %s, this process cannot tell its rank", s.size, s.rank,
                         s.launcher);
    if (!parse_int_in(env(s.size), 1, 1 << 20, &e.world))
      return comm_format("%s is set but %s='%s' is not a world size >= 1", s.rank, s.size, env(s.size) ? env(s.size) : "");
    if (e.world == 1) break;  // one task: started by nobody
    if (!parse_int_in(env(s.rank), 0, e.world - 1, &e.rank))
      return comm_format("%s='%s' is not a rank in [0, %d)", s.rank, env(s.rank), e.world);
    if (!parse_int_in(env(s.local_rank), 0, e.world - 1, &e.local_rank))
      return comm_format("%s='%s' is not a local rank in [0, %d)", s.local_rank, env(s.local_rank) ? env(s.local_rank) : "",
                         e.world);
    if (gpus != 1 && gpus != e.world)
      return comm_format("%d GPUs requested, but %s started %d ranks (one per GPU): request %d or leave it out", gpus,
                         s.launcher, e.world, e.world);
    const char* addr = env("FLATMOE_MASTER_ADDR");
    const char* port = env("FLATMOE_MASTER_PORT");
    if (addr == nullptr || addr[0] == '\0' || port == nullptr)
      return comm_format("started by %s with %d ranks: set FLATMOE_MASTER_ADDR (rank 0's host) and FLATMOE_MASTER_PORT "
                         "(a free TCP port there) so that the ranks can exchange the NCCL id",
                         s.launcher, e.world);
    if (!parse_int_in(port, 1, 65535, &e.master_port))
      return comm_format("FLATMOE_MASTER_PORT='%s' is not a TCP port in [1, 65535]", port);
    e.mode = LaunchMode::External;
    e.master_addr = addr;
    *out = e;
    return "";
  }
  // A PMIx launcher that sets none of the variables above: running as a silent one-rank job
  // would leave every other rank waiting.
  if (env("PMIX_RANK") != nullptr)
    return comm_format("PMIX_RANK=%s is set (a PMIx launcher) but none of the rank and size variables that flatmoe reads "
                       "(OMPI_COMM_WORLD_*, MV2_COMM_WORLD_*, PMI_RANK/PMI_SIZE/MPI_LOCALRANKID, SLURM_PROCID/"
                       "SLURM_STEP_NUM_TASKS/SLURM_LOCALID): start the job with mpirun or srun",
                       env("PMIX_RANK"));
  e = LaunchEnv();
  e.world = gpus;
  *out = e;
  return "";
}

// The CUDA device of a rank that sees `visible` devices: FLATMOE_DEVICE when set; the only one when
// the process sees exactly one (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per task); else
// its local rank. Returns "" and sets *device, or why no device fits.
inline std::string choose_device(const EnvLookup& env, int local_rank, int visible, int* device) {
  if (visible < 1) return "no CUDA device is visible to this process";
  if (const char* chosen = env("FLATMOE_DEVICE")) {
    if (!parse_int_in(chosen, 0, visible - 1, device))
      return comm_format("FLATMOE_DEVICE='%s' is not a device in [0, %d) (this process sees %d)", chosen, visible, visible);
    return "";
  }
  if (visible == 1) {
    *device = 0;
    return "";
  }
  if (local_rank >= visible)
    return comm_format("local rank %d needs CUDA device %d, but this process sees %d; give each task one GPU or set "
                       "FLATMOE_DEVICE",
                       local_rank, local_rank, visible);
  *device = local_rank;
  return "";
}

// This rank's CUDA device (choose_device over the environment and the devices it sees); exits with
// the reason when none fits. Asked when the rank starts using the GPU, not by launch().
inline int rank_device(const LaunchInfo& info) {
  int device = 0;
  std::string why = choose_device([](const char* name) -> const char* { return getenv(name); }, info.local_rank,
                                  gpu_count(), &device);
  if (!why.empty()) launch_fail("rank %d: %s", info.rank, why.c_str());
  return device;
}

// ---------------------------------------------------------------------------------------------
// TCP rendezvous (mpirun / srun): rank 0 sends the NCCL id to every other rank.
// Each rank sends a hello {magic, rank, world} (network byte order); rank 0 checks it and answers
// with the NCCL_UNIQUE_ID_BYTES bytes of the id.

static const uint32_t RENDEZVOUS_MAGIC = 0x464d4f45;  // "FMOE"

inline bool send_all(int fd, const void* data, size_t bytes) {
  const char* p = (const char*)data;
  while (bytes > 0) {
    ssize_t n = send(fd, p, bytes, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= n;
  }
  return true;
}

inline bool recv_all(int fd, void* data, size_t bytes) {
  char* p = (char*)data;
  while (bytes > 0) {
    ssize_t n = recv(fd, p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= n;
  }
  return true;
}

inline void set_receive_timeout(int fd, double seconds) {
  timeval tv;
  tv.tv_sec = (time_t)seconds;
  tv.tv_usec = (suseconds_t)((seconds - (double)tv.tv_sec) * 1e6);
  if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0)
    launch_fail("rendezvous: setsockopt(SO_RCVTIMEO): %s", strerror(errno));
}

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Rank 0: listens on `port` (all IPv4 interfaces) until ranks 1..world-1 have each fetched the id.
inline void rendezvous_serve_id(int port, int world, const ncclUniqueId& id, double timeout_s) {
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (listener < 0) launch_fail("rank 0: rendezvous socket: %s", strerror(errno));
  int one = 1;
  if (setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0)
    launch_fail("rank 0: rendezvous setsockopt(SO_REUSEADDR): %s", strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons((uint16_t)port);
  if (bind(listener, (sockaddr*)&addr, sizeof(addr)) != 0)
    launch_fail("rank 0: cannot listen on TCP port %d (FLATMOE_MASTER_PORT): %s", port, strerror(errno));
  if (listen(listener, world) != 0) launch_fail("rank 0: listen on TCP port %d: %s", port, strerror(errno));
  std::vector<bool> served(world, false);
  served[0] = true;
  const auto start = std::chrono::steady_clock::now();
  for (int waiting = world - 1; waiting > 0;) {
    double left_s = timeout_s - seconds_since(start);
    if (left_s <= 0) {
      std::string missing;
      for (int r = 0; r < world; r++)
        if (!served[r]) missing += (missing.empty() ? "" : " ") + std::to_string(r);
      launch_fail("rank 0: after %.0f s (FLATMOE_COMM_TIMEOUT_S) on port %d, ranks [%s] of %d had not connected",
                  timeout_s, port, missing.c_str(), world);
    }
    pollfd p{listener, POLLIN, 0};
    int ready = poll(&p, 1, (int)std::min(left_s * 1000 + 1, 1e9));
    if (ready < 0 && errno != EINTR) launch_fail("rank 0: rendezvous poll: %s", strerror(errno));
    if (ready <= 0) continue;
    int conn = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
    if (conn < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      launch_fail("rank 0: rendezvous accept: %s", strerror(errno));
    }
    set_receive_timeout(conn, 10);
    uint32_t hello[3];
    if (!recv_all(conn, hello, sizeof(hello)) || ntohl(hello[0]) != RENDEZVOUS_MAGIC) {
      fprintf(stderr, "flatmoe launch: rank 0: ignored a connection on port %d that is not a flatmoe rank\n", port);
      close(conn);
      continue;
    }
    int rank = (int)ntohl(hello[1]), their_world = (int)ntohl(hello[2]);
    if (their_world != world || rank < 1 || rank >= world || served[rank])
      launch_fail("rank 0: a rank %d of a world of %d connected to port %d, but this job has %d ranks%s "
                  "(two jobs on one port?)",
                  rank, their_world, port, world, rank >= 1 && rank < world && served[rank] ? " and that rank was served" : "");
    if (!send_all(conn, id.internal, sizeof(id.internal)))
      launch_fail("rank 0: sending the NCCL id to rank %d: %s", rank, strerror(errno));
    close(conn);
    served[rank] = true;
    waiting--;
  }
  close(listener);
}

// Ranks 1..world-1: connects to rank 0 (retrying every 100 ms while it does not listen yet) and
// receives the id.
inline ncclUniqueId rendezvous_fetch_id(const std::string& host, int port, int rank, int world, double timeout_s) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  std::string port_text = std::to_string(port);
  int gai = getaddrinfo(host.c_str(), port_text.c_str(), &hints, &found);
  if (gai != 0) launch_fail("rank %d: cannot resolve FLATMOE_MASTER_ADDR '%s': %s", rank, host.c_str(), gai_strerror(gai));
  const auto start = std::chrono::steady_clock::now();
  int fd = -1;
  for (;;) {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) launch_fail("rank %d: rendezvous socket: %s", rank, strerror(errno));
    if (connect(fd, found->ai_addr, found->ai_addrlen) == 0) break;
    int err = errno;
    close(fd);
    if (seconds_since(start) > timeout_s)
      launch_fail("rank %d: could not connect to rank 0 at %s:%d within %.0f s (FLATMOE_COMM_TIMEOUT_S): %s", rank,
                  host.c_str(), port, timeout_s, strerror(err));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  freeaddrinfo(found);
  set_receive_timeout(fd, std::max(1.0, timeout_s - seconds_since(start)));
  uint32_t hello[3] = {htonl(RENDEZVOUS_MAGIC), htonl((uint32_t)rank), htonl((uint32_t)world)};
  ncclUniqueId id;
  if (!send_all(fd, hello, sizeof(hello)) || !recv_all(fd, id.internal, sizeof(id.internal)))
    launch_fail("rank %d: rank 0 at %s:%d did not send the NCCL id (see rank 0's message)", rank, host.c_str(), port);
  close(fd);
  return id;
}

// ---------------------------------------------------------------------------------------------
// Our launcher (one node)

// This process's environment without the variables named in `drop` or set in `add`, then `add`
// (NAME=VALUE entries).
inline std::vector<std::string> environment_with(const std::vector<std::string>& drop, const std::vector<std::string>& add) {
  std::vector<std::string> names = drop;
  for (const std::string& entry : add) names.push_back(entry.substr(0, entry.find('=')));
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; e++) {
    std::string entry = *e;
    if (std::find(names.begin(), names.end(), entry.substr(0, entry.find('='))) == names.end()) env.push_back(entry);
  }
  env.insert(env.end(), add.begin(), add.end());
  return env;
}

// A null-terminated array of pointers into `strings` (for execve), valid while `strings` lives.
inline std::vector<char*> exec_array(std::vector<std::string>& strings) {
  std::vector<char*> array;
  for (std::string& s : strings) array.push_back(&s[0]);
  array.push_back(nullptr);
  return array;
}

// "exited with status 3" / "was killed by signal 9 (Killed)"
inline std::string describe_exit(int wait_status) {
  if (WIFEXITED(wait_status)) return comm_format("exited with status %d", WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status))
    return comm_format("was killed by signal %d (%s)", WTERMSIG(wait_status), strsignal(WTERMSIG(wait_status)));
  return comm_format("ended with wait status 0x%x", wait_status);
}

// The shell's convention: the exit status, or 128 + the signal that killed it.
inline int exit_code_of(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return EXIT_FAILURE;
}

// Waits for the ranks (pids[r], this process's only children). When one fails, the others get SIGTERM
// and, 10 s later, SIGKILL. Returns 0 when every rank exited with 0, else the first failing rank's
// exit code.
inline int wait_for_ranks(std::vector<pid_t> pids) {
  int running = (int)std::count_if(pids.begin(), pids.end(), [](pid_t p) { return p > 0; });
  int result = 0;
  bool stopping = false, killed = false;
  std::chrono::steady_clock::time_point stop_start;
  while (running > 0) {
    int status = 0;
    pid_t pid = waitpid(-1, &status, stopping && !killed ? WNOHANG : 0);
    if (pid < 0) {
      if (errno == EINTR) continue;
      fprintf(stderr, "flatmoe launch: waitpid: %s\n", strerror(errno));
      return EXIT_FAILURE;
    }
    if (pid == 0) {  // stopping, nobody exited yet
      if (seconds_since(stop_start) >= 10) {
        for (int r = 0; r < (int)pids.size(); r++)
          if (pids[r] > 0) {
            fprintf(stderr, "flatmoe launch: rank %d (pid %d) did not stop within 10 s of SIGTERM: SIGKILL\n", r, pids[r]);
            kill(pids[r], SIGKILL);
          }
        killed = true;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    int rank = (int)(std::find(pids.begin(), pids.end(), pid) - pids.begin());
    if (rank == (int)pids.size()) continue;
    pids[rank] = -1;
    running--;
    bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (!ok && !stopping) {
      result = exit_code_of(status);
      fprintf(stderr, "flatmoe launch: rank %d (pid %d) %s; stopping the other %d rank(s)\n", rank, pid,
              describe_exit(status).c_str(), running);
      fflush(stderr);
      for (pid_t p : pids)
        if (p > 0) kill(p, SIGTERM);
      stopping = true;
      stop_start = std::chrono::steady_clock::now();
    }
  }
  return result;
}

// Starts `world` ranks of this program (/proc/self/exe with argv[0..argc)) with the launcher variables
// and a fresh NCCL id, and waits for them (wait_for_ranks). Returns 0 or the failing rank's exit code.
inline int run_local_ranks(int argc, char** argv, int world) {
  comm_set_nccl_env();
  ncclUniqueId id;
  ncclResult_t r = ncclGetUniqueId(&id);
  if (r != ncclSuccess) {
    fprintf(stderr, "flatmoe launch: ncclGetUniqueId failed: %s\n", nccl_why(r, nullptr).c_str());
    return EXIT_FAILURE;
  }
  std::string id_hex = nccl_id_to_hex(id);
  std::vector<std::string> args(argv, argv + argc);
  std::vector<char*> child_argv = exec_array(args);
  const pid_t launcher = getpid();
  std::vector<pid_t> pids;
  for (int rank = 0; rank < world; rank++) {
    std::vector<std::string> env = environment_with(
        {}, {"FLATMOE_RANK=" + std::to_string(rank), "FLATMOE_WORLD=" + std::to_string(world),
             "FLATMOE_LOCAL_RANK=" + std::to_string(rank), "FLATMOE_NCCL_ID=" + id_hex});
    std::vector<char*> envp = exec_array(env);
    pid_t pid = fork();
    if (pid < 0) {
      fprintf(stderr, "flatmoe launch: fork for rank %d of %d failed: %s\n", rank, world, strerror(errno));
      for (pid_t p : pids) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
      }
      return EXIT_FAILURE;
    }
    if (pid == 0) {
      // only async-signal-safe calls between fork and exec
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != launcher) _exit(EXIT_FAILURE);
      execve("/proc/self/exe", child_argv.data(), envp.data());
      static const char msg[] = "flatmoe launch: execve(/proc/self/exe) failed\n";
      (void)!write(STDERR_FILENO, msg, sizeof(msg) - 1);
      _exit(127);
    }
    pids.push_back(pid);
  }
  return wait_for_ranks(pids);
}

// ---------------------------------------------------------------------------------------------

// This process's LaunchInfo; in the launching parent (gpus > 1, started by nobody) it starts the
// ranks, waits, and exits with their status instead of returning.
inline LaunchInfo launch(int argc, char** argv, int gpus) {
  LaunchEnv env;
  std::string why = parse_launch_env([](const char* name) -> const char* { return getenv(name); }, gpus, &env);
  if (!why.empty()) launch_fail("%s", why.c_str());
  comm_set_nccl_env();
  LaunchInfo info;
  info.rank = env.rank;
  info.world = env.world;
  info.local_rank = env.local_rank;
  switch (env.mode) {
    case LaunchMode::Child:
      info.id = env.id;
      return info;
    case LaunchMode::External:
      if (env.rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&info.id);
        if (r != ncclSuccess) launch_fail("rank 0: ncclGetUniqueId failed: %s", nccl_why(r, nullptr).c_str());
        rendezvous_serve_id(env.master_port, env.world, info.id, comm_timeout_s());
      } else {
        info.id = rendezvous_fetch_id(env.master_addr, env.master_port, env.rank, env.world, comm_timeout_s());
      }
      return info;
    case LaunchMode::Launcher:
      break;
  }
  if (gpus == 1) return info;
  int devices = gpu_count();
  if (devices < gpus) launch_fail("%d GPUs requested, but this node has %d CUDA device(s)", gpus, devices);
  exit(run_local_ranks(argc, argv, gpus));
}
