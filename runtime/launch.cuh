// launch.cuh — starting the W ranks of a job (one process per GPU) and giving each its LaunchInfo
// (runtime/comm.cuh: rank, world size, local rank, NCCL id). launch() finds out how this process was
// started:
//   * by nobody, gpus > 1 (one node): it is the launcher. It creates the NCCL id, forks and execs
//     /proc/self/exe W times with the same argv and FLATMOE_RANK, FLATMOE_WORLD, FLATMOE_LOCAL_RANK,
//     FLATMOE_NCCL_ID (hex) added to the environment, and waits. Each rank leads its own process group,
//     so that a terminal's Ctrl-C reaches the launcher only, and dies with the launcher
//     (PR_SET_PDEATHSIG). When a rank fails (non-zero exit or a signal), the others get SIGTERM
//     (SIGKILL 10 s later) and the launcher exits with the failing rank's status, naming the rank.
//     SIGINT, SIGTERM or SIGHUP to the launcher stop the ranks the same way ("flatmoe launch: received
//     SIGINT; stopping 8 rank(s)"; a second one sends SIGKILL at once), and once they are gone it exits
//     with 128 + the signal's number.
//   * by our launcher (FLATMOE_RANK set): it reads the variables above.
//   * by mpirun, mpiexec or srun (Open MPI OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK, MVAPICH2
//     MV2_COMM_WORLD_RANK/SIZE/LOCAL_RANK, MPICH and Intel MPI PMI_RANK/PMI_SIZE/MPI_LOCALRANKID, Slurm
//     SLURM_PROCID/SLURM_STEP_NUM_TASKS/SLURM_LOCALID; many nodes; a launcher's variables present but
//     incomplete, or PMIx's PMIX_RANK alone, are refused rather than run as one silent rank): rank 0
//     creates the NCCL id and serves it over TCP (IPv4) at FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT
//     (like torchrun's MASTER_ADDR/PORT; refused when missing), listening on that address only, which
//     must be one of its host's; the others connect, retrying until rank 0 listens. Each side proves
//     to the other that it knows the job's token (FLATMOE_JOB_TOKEN, else derived from the srun step,
//     the PMIx namespace or Open MPI's job id: find_job_token; refused when there is none), so that two
//     jobs on one port cannot mix and a stranger gets no id ("TCP rendezvous" below). A job of one task
//     (srun -n1, an sbatch script) counts as started by nobody.
//   * by nobody, gpus == 1: rank 0 of 1 (comm_world_init makes its own NCCL id).
// Under mpirun/srun, gpus must be 1 (left out) or the job's size. Each rank's CUDA device (rank_device,
// asked when the rank starts using the GPU): FLATMOE_DEVICE when set, else the only one the process
// sees when it sees one, else its local rank (its local rank mod the devices with ranks sharing GPUs,
// --share_gpus 1: "Ranks sharing GPUs" below). The rendezvous gives up after FLATMOE_COMM_TIMEOUT_S
// (default 600 s). Malformed variables are refused with a message naming them ("flatmoe launch: ..."),
// exit status 1. Call launch() first in main(), before anything creates a CUDA context (the launching
// parent needs none).
#pragma once
#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdarg>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iterator>
#include <nccl.h>
#include <string>
#include <thread>
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
  ncclUniqueId id{};             // Child
  std::string master_addr;       // External
  int master_port = 0;           // External
  std::string job_token;         // External: what the rendezvous proofs are keyed with
  std::string job_token_source;  // External: where it came from ("FLATMOE_JOB_TOKEN", ...), for messages
};

using EnvLookup = std::function<const char*(const char*)>;

// The job token of a rank (`rank` of `world`) started by mpirun or srun: the first of
//   FLATMOE_JOB_TOKEN (set but empty is refused);
//   SLURM_JOB_ID and SLURM_STEP_ID, when this process is a task of that srun step as the job counts
//     them (SLURM_PROCID = rank, SLURM_STEP_NUM_TASKS = world): under mpirun inside an allocation the
//     ranks that mpirun starts itself and those its daemons start belong to different steps, or none;
//   PMIX_NAMESPACE (one per job: Open MPI 5, srun --mpi=pmix, other PMIx launchers);
//   OMPI_MCA_ess_base_jobid (Open MPI 4).
// A token derived from the launcher's job id tells two jobs apart but is no secret (anyone on the
// cluster sees job ids); FLATMOE_JOB_TOKEN set to a secret also keeps strangers from the NCCL id.
// Returns "" and sets *token and *source, or why there is none.
inline std::string find_job_token(const EnvLookup& env, const char* launcher, int rank, int world, std::string* token,
                                  std::string* source) {
  auto value = [&env](const char* name) -> std::string {
    const char* v = env(name);
    return v != nullptr ? v : "";
  };
  if (env("FLATMOE_JOB_TOKEN") != nullptr) {
    if (value("FLATMOE_JOB_TOKEN").empty())
      return "FLATMOE_JOB_TOKEN is set but empty: set it to one value shared by every rank of the job, or unset it";
    *token = value("FLATMOE_JOB_TOKEN");
    *source = "FLATMOE_JOB_TOKEN";
    return "";
  }
  int slurm_rank = -1, slurm_tasks = -1;
  if (!value("SLURM_JOB_ID").empty() && !value("SLURM_STEP_ID").empty() &&
      parse_int_in(env("SLURM_PROCID"), 0, INT_MAX, &slurm_rank) && slurm_rank == rank &&
      parse_int_in(env("SLURM_STEP_NUM_TASKS"), 1, INT_MAX, &slurm_tasks) && slurm_tasks == world) {
    *token = "slurm:" + value("SLURM_JOB_ID") + "." + value("SLURM_STEP_ID");
    *source = "SLURM_JOB_ID.SLURM_STEP_ID";
    return "";
  }
  for (const char* name : {"PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"}) {
    if (value(name).empty()) continue;
    *token = std::string(name) + ":" + value(name);
    *source = name;
    return "";
  }
  return comm_format("started by %s with %d ranks, but there is no job token for the rendezvous: set FLATMOE_JOB_TOKEN "
                     "to one value on every rank (any string the job's ranks share, e.g. $(openssl rand -hex 16), "
                     "passed to every rank, e.g. mpirun -x FLATMOE_JOB_TOKEN); none of SLURM_JOB_ID with "
                     "SLURM_STEP_ID (srun), PMIX_NAMESPACE or OMPI_MCA_ess_base_jobid is there to derive one from",
                     launcher, world);
}

// The launchers whose variables are read, in this order (mpirun inside a Slurm allocation sets both its
// own and Slurm's: the MPI's describe the job). Under srun the step's task count is the world
// (SLURM_STEP_NUM_TASKS; SLURM_NTASKS where an older Slurm does not set it).
struct LauncherSource {
  const char *rank, *size, *local_rank, *launcher;
};

inline std::vector<LauncherSource> launcher_sources(const EnvLookup& env) {
  return {{"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun"},
          {"MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_LOCAL_RANK", "mpirun (MVAPICH2)"},
          {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "mpiexec (MPICH / Intel MPI)"},
          {"SLURM_PROCID", env("SLURM_STEP_NUM_TASKS") != nullptr ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS",
           "SLURM_LOCALID", "srun"}};
}

// Every variable that tells a process it is a rank of a job (ours, an external launcher's, PMIx's), and
// NCCL_HOSTID, which a rank sharing a GPU sets for itself: a job that a rank starts (a test's sub-job)
// is started without them, by nobody.
inline std::vector<std::string> rank_variable_names() {
  std::vector<std::string> names = {"FLATMOE_RANK", "FLATMOE_WORLD", "FLATMOE_LOCAL_RANK", "FLATMOE_NCCL_ID",
                                    "PMIX_RANK", "SLURM_NTASKS", "NCCL_HOSTID"};
  for (const LauncherSource& s : launcher_sources([](const char*) -> const char* { return "set"; }))
    names.insert(names.end(), {s.rank, s.size, s.local_rank});
  return names;
}

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
  for (const LauncherSource& s : launcher_sources(env)) {
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
    std::string why = find_job_token(env, s.launcher, e.rank, e.world, &e.job_token, &e.job_token_source);
    if (!why.empty()) return why;
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

// ---------------------------------------------------------------------------------------------
// Ranks sharing GPUs (--share_gpus 1, or FLATMOE_SHARE_GPUS=1 for the tests and external launchers)
//
// For correctness and memory, never for speed (notes/multi-gpu.md): W ranks run on fewer GPUs, placed
// round-robin (rank_device: local rank mod the GPUs this process sees). NCCL refuses two ranks of a
// communicator on one GPU ("Duplicate GPU detected") unless they look like different hosts, so each
// rank takes, before its first NCCL call, its own NCCL host identity (NCCL_HOSTID=flatmoe-rank<R>) and
// NCCL connects the ranks through its network transport: sockets, over the loopback interface
// (NCCL_SOCKET_IFNAME=lo) when every rank is on this host — our launcher's ranks, or an external
// launcher's whose FLATMOE_MASTER_ADDR is a loopback address. The collectives are real NCCL
// collectives over real data; their timings are socket timings. Variables the user has set are kept.
// Our launcher's ranks share only where they outnumber the node's GPUs (local_ranks_share_gpus): with a
// GPU each the switch changes nothing.
// An NCCL of its own several-ranks-per-GPU mode (NCCL_MULTI_RANK_GPU_ENABLE, from 2.30 on) is used
// instead where the installed library is that new: the ranks then keep the host they are on.

// The NCCL version from which NCCL_MULTI_RANK_GPU_ENABLE lets ranks of one host share a GPU.
static const int NCCL_MULTI_RANK_GPU_VERSION = 23000;

// FLATMOE_SHARE_GPUS: unset or "0" (off), "1" (on); anything else is refused. Returns "" and sets *share.
inline std::string parse_gpu_sharing(const EnvLookup& env, bool* share) {
  const char* text = env("FLATMOE_SHARE_GPUS");
  *share = text != nullptr && strcmp(text, "1") == 0;
  if (text != nullptr && !*share && strcmp(text, "0") != 0)
    return comm_format("FLATMOE_SHARE_GPUS='%s' must be 0 or 1 (1: ranks may share GPUs, for correctness and memory runs)",
                       text);
  return "";
}

// Whether this process's ranks share GPUs (FLATMOE_SHARE_GPUS; launch() has refused a malformed value).
inline bool gpu_sharing() {
  bool share = false;
  parse_gpu_sharing([](const char* name) -> const char* { return getenv(name); }, &share);
  return share;
}

// Our launcher's ranks (all on this node) share GPUs only where they outnumber them: given a GPU each they
// keep NCCL's own transports (NVLink, PCIe) and their timings stay GPU timings, whatever the switch says.
// An external launcher's rank, which does not know how many ranks its node holds, takes the switch as given.
inline bool local_ranks_share_gpus(bool asked, int ranks, int devices) { return asked && ranks > devices; }

// How NCCL carries the collectives of ranks sharing a GPU, from the installed NCCL's version.
enum class SharingPath { Sockets, NcclMultiRankGpu };

inline SharingPath sharing_path(int nccl_version) {
  return nccl_version >= NCCL_MULTI_RANK_GPU_VERSION ? SharingPath::NcclMultiRankGpu : SharingPath::Sockets;
}

inline const char* sharing_path_text(SharingPath path) {
  return path == SharingPath::Sockets ? "NCCL's socket transport (one NCCL host per rank)"
                                      : "NCCL's several-ranks-per-GPU mode (NCCL_MULTI_RANK_GPU_ENABLE=1)";
}

// The variables (NAME=VALUE) that rank `rank` sets for sharing a GPU over `path`, less those the
// environment already has: each is set only where the user has not set it. `all_on_this_host`: every
// rank of the job runs on this host (then NCCL's sockets use the loopback interface).
inline std::vector<std::string> sharing_variables(const EnvLookup& env, int rank, SharingPath path, bool all_on_this_host) {
  std::vector<std::string> wanted;
  if (path == SharingPath::NcclMultiRankGpu) {
    wanted.push_back("NCCL_MULTI_RANK_GPU_ENABLE=1");
  } else {
    wanted.push_back("NCCL_HOSTID=flatmoe-rank" + std::to_string(rank));
    if (all_on_this_host) wanted.push_back("NCCL_SOCKET_IFNAME=lo");
  }
  std::vector<std::string> set;
  for (const std::string& v : wanted)
    if (env(v.substr(0, v.find('=')).c_str()) == nullptr) set.push_back(v);
  return set;
}

inline int nccl_runtime_version() {
  int version = 0;
  ncclResult_t r = ncclGetVersion(&version);
  if (r != ncclSuccess) launch_fail("ncclGetVersion failed: %s", ncclGetErrorString(r));
  return version;
}

// Sets this process's sharing variables (sharing_variables) before its first NCCL call.
inline void apply_gpu_sharing(int rank, bool all_on_this_host) {
  const EnvLookup env = [](const char* name) -> const char* { return getenv(name); };
  for (const std::string& v : sharing_variables(env, rank, sharing_path(nccl_runtime_version()), all_on_this_host)) {
    const size_t eq = v.find('=');
    if (setenv(v.substr(0, eq).c_str(), v.substr(eq + 1).c_str(), 1) != 0)
      launch_fail("rank %d: setenv %s: %s", rank, v.c_str(), strerror(errno));
  }
}

// One line for rank 0's log: how W ranks share `gpus` GPUs, and that their timings are not GPU timings.
inline std::string sharing_banner(int world, int gpus) {
  return comm_format("%d ranks share %d GPU%s (--share_gpus 1, round-robin), collectives through %s: for correctness "
                     "and memory; timings are not GPU timings",
                     world, gpus, gpus == 1 ? "" : "s", sharing_path_text(sharing_path(nccl_runtime_version())));
}

// Whether `host` (FLATMOE_MASTER_ADDR) is a loopback address: "localhost" or an IPv4 literal in 127/8.
inline bool is_loopback_host(const std::string& host) {
  in_addr literal;
  if (host == "localhost") return true;
  return inet_pton(AF_INET, host.c_str(), &literal) == 1 && (ntohl(literal.s_addr) >> 24) == 127;
}

// The CUDA device of a rank that sees `visible` devices: FLATMOE_DEVICE when set; the only one when
// the process sees exactly one (srun --gpus-per-task=1, or CUDA_VISIBLE_DEVICES set per task); else
// its local rank, or with ranks sharing GPUs (gpu_sharing) its local rank mod `visible` (round-robin).
// Returns "" and sets *device, or why no device fits.
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
  if (local_rank >= visible) {
    bool share = false;
    std::string why = parse_gpu_sharing(env, &share);
    if (!why.empty()) return why;
    if (share) {
      *device = local_rank % visible;
      return "";
    }
    return comm_format("local rank %d needs CUDA device %d, but this process sees %d; give each task one GPU, set "
                       "FLATMOE_DEVICE, or let ranks share GPUs (--share_gpus 1 or FLATMOE_SHARE_GPUS=1)",
                       local_rank, local_rank, visible);
  }
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
// Time

inline double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

inline std::chrono::steady_clock::duration seconds_duration(double seconds) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

// poll()'s timeout until `deadline`: whole milliseconds rounded up (so that the wait does not end
// just before it), 0 once it has passed.
inline int poll_ms_until(std::chrono::steady_clock::time_point deadline) {
  auto ms = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count();
  return (int)std::clamp<long long>(ms, 0, INT_MAX);
}

// ---------------------------------------------------------------------------------------------
// TCP rendezvous (mpirun / srun): rank 0 hands the NCCL id to ranks 1..W-1.
//
// Rank 0 listens at FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT and serves all connections at once (poll
// over non-blocking sockets). On each one:
//   rank 0 -> rank    challenge: magic, version, rank 0's nonce
//   rank -> rank 0    hello:     magic, version, rank, world, the rank's nonce, the rank's proof
//   rank 0 -> rank    answer:    status, rank 0's proof, NCCL id (both zero unless the status is Ok)
// Integers are big-endian; nonces are random. A proof is a SipHash-2-4 keyed with the job token of
// both nonces, the rank and the world, under a label that differs between the two directions: the
// token never travels, a proof is good for one connection only, and each side checks the other's
// proof before trusting it, so rank 0 gives the id only to ranks of its own job and a rank takes one
// only from its own job's rank 0. A connection that is not a rank of the job (garbage, another
// protocol version, another token, a world or rank that does not fit, a rank that already has the id)
// or that has not sent its hello within the per-connection deadline is logged, one line naming the
// peer and why, and dropped; the job goes on. The rendezvous as a whole ends after
// FLATMOE_COMM_TIMEOUT_S, naming the ranks that have not fetched the id. This keeps jobs that meet
// on one port apart and strangers away from the id; it does not hide the id from someone who can
// read the network (NCCL's own traffic is not authenticated either).

static const uint32_t RENDEZVOUS_MAGIC = 0x464d4f45;  // "FMOE"
// 2: challenge, proofs, status. (1: a bare hello {magic, rank, world}, answered with the id.)
static const uint32_t RENDEZVOUS_VERSION = 2;
static const size_t RENDEZVOUS_CHALLENGE_BYTES = 16, RENDEZVOUS_HELLO_BYTES = 32,
                    RENDEZVOUS_ANSWER_BYTES = 12 + NCCL_UNIQUE_ID_BYTES;
// How long one connection may take, from accept (rank 0) or connect (a rank) to its last byte.
static const double RENDEZVOUS_CONNECTION_TIMEOUT_S = 10;
static const char RENDEZVOUS_HELLO_LABEL[] = "flatmoe rendezvous: rank's hello";
static const char RENDEZVOUS_ANSWER_LABEL[] = "flatmoe rendezvous: rank 0's answer";

// The answer's status: the id, or why rank 0 refused a hello of the right protocol.
enum class RendezvousStatus : uint32_t { Ok = 0, WrongToken = 1, WrongWorld = 2, RankOutside = 3, RankServed = 4 };

inline void put_be(uint8_t* at, uint64_t value, int bytes) {
  for (int i = bytes - 1; i >= 0; i--, value >>= 8) at[i] = (uint8_t)value;
}

inline uint64_t get_be(const uint8_t* at, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; i++) value = value << 8 | at[i];
  return value;
}

// SipHash-2-4 (Aumasson and Bernstein, 2012) of data[0, bytes) under the 128-bit key (k0, k1): a
// keyed hash that cannot be computed without the key nor turned back into it.
inline uint64_t siphash24(uint64_t k0, uint64_t k1, const uint8_t* data, size_t bytes) {
  uint64_t v0 = k0 ^ 0x736f6d6570736575ull, v1 = k1 ^ 0x646f72616e646f6dull;
  uint64_t v2 = k0 ^ 0x6c7967656e657261ull, v3 = k1 ^ 0x7465646279746573ull;
  auto rotl = [](uint64_t x, int b) { return x << b | x >> (64 - b); };
  auto round = [&] {
    v0 += v1, v1 = rotl(v1, 13), v1 ^= v0, v0 = rotl(v0, 32);
    v2 += v3, v3 = rotl(v3, 16), v3 ^= v2;
    v0 += v3, v3 = rotl(v3, 21), v3 ^= v0;
    v2 += v1, v1 = rotl(v1, 17), v1 ^= v2, v2 = rotl(v2, 32);
  };
  auto absorb = [&](uint64_t m) {
    v3 ^= m;
    round();
    round();
    v0 ^= m;
  };
  const size_t whole = bytes / 8 * 8;
  for (size_t i = 0; i < whole; i += 8) {
    uint64_t m = 0;
    for (int b = 7; b >= 0; b--) m = m << 8 | data[i + b];  // little-endian words
    absorb(m);
  }
  uint64_t last = (uint64_t)bytes << 56;
  for (size_t i = whole; i < bytes; i++) last |= (uint64_t)data[i] << (8 * (i - whole));
  absorb(last);
  v2 ^= 0xff;
  for (int i = 0; i < 4; i++) round();
  return v0 ^ v1 ^ v2 ^ v3;
}

// The proof that a side knows `token` in one connection: SipHash-2-4 of the label, both nonces, the
// rank and the world, keyed with the token (hashed to 128 bits, so that a token of any length keys it).
inline uint64_t rendezvous_proof(const std::string& token, const char* label, uint64_t rank0_nonce,
                                 uint64_t rank_nonce, uint32_t rank, uint32_t world) {
  const uint8_t* t = (const uint8_t*)token.data();
  const uint64_t k0 = siphash24(0, 0, t, token.size()), k1 = siphash24(0, 1, t, token.size());
  std::vector<uint8_t> message(label, label + strlen(label));
  const size_t at = message.size();
  message.resize(at + 24);
  put_be(&message[at], rank0_nonce, 8);
  put_be(&message[at + 8], rank_nonce, 8);
  put_be(&message[at + 16], rank, 4);
  put_be(&message[at + 20], world, 4);
  return siphash24(k0, k1, message.data(), message.size());
}

inline uint64_t rendezvous_nonce(int rank) {
  uint64_t nonce = 0;
  ssize_t got = -1;
  do got = getrandom(&nonce, sizeof(nonce), 0);
  while (got < 0 && errno == EINTR);
  if (got != (ssize_t)sizeof(nonce))
    launch_fail("rank %d: getrandom for a rendezvous nonce: %s", rank, got < 0 ? strerror(errno) : "short read");
  return nonce;
}

// One step of moving bytes over a non-blocking socket.
enum class IoStep {
  Done,     // all bytes moved
  Blocked,  // the socket would block (or, from transfer_by, the deadline came first)
  Closed,   // the peer closed the connection (receiving)
  Failed,   // errno says why
};

// Sends data[*done, bytes) until all is sent or the socket would block.
inline IoStep send_some(int fd, const uint8_t* data, size_t bytes, size_t* done) {
  while (*done < bytes) {
    ssize_t n = send(fd, data + *done, bytes - *done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? IoStep::Blocked : IoStep::Failed;
    *done += n;
  }
  return IoStep::Done;
}

// Receives into data[*done, bytes) until it is full, the socket would block or the peer closed.
inline IoStep recv_some(int fd, uint8_t* data, size_t bytes, size_t* done) {
  while (*done < bytes) {
    ssize_t n = recv(fd, data + *done, bytes - *done, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return errno == EAGAIN || errno == EWOULDBLOCK ? IoStep::Blocked : IoStep::Failed;
    if (n == 0) return IoStep::Closed;
    *done += n;
  }
  return IoStep::Done;
}

// Waits until `fd` is ready for `events`; false when `deadline` comes first.
inline bool wait_ready(int fd, short events, std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    if (std::chrono::steady_clock::now() >= deadline) return false;
    pollfd p{fd, events, 0};
    int ready = poll(&p, 1, poll_ms_until(deadline));
    if (ready > 0) return true;
    if (ready < 0 && errno != EINTR) launch_fail("rendezvous poll: %s", strerror(errno));
  }
}

// Sends (or receives) all of data[0, bytes) by `deadline`; Blocked when the deadline came first.
inline IoStep transfer_by(int fd, bool sending, uint8_t* data, size_t bytes,
                          std::chrono::steady_clock::time_point deadline) {
  size_t done = 0;
  for (;;) {
    IoStep step = sending ? send_some(fd, data, bytes, &done) : recv_some(fd, data, bytes, &done);
    if (step != IoStep::Blocked) return step;
    if (!wait_ready(fd, sending ? POLLOUT : POLLIN, deadline)) return IoStep::Blocked;
  }
}

inline std::string ipv4_text(const sockaddr_in& addr) {
  char ip[INET_ADDRSTRLEN];
  if (inet_ntop(AF_INET, &addr.sin_addr, ip, sizeof(ip)) == nullptr) return "(unprintable address)";
  return ip;
}

// "10.0.0.1:29500"
inline std::string socket_address_text(const sockaddr_in& addr) {
  return ipv4_text(addr) + ":" + std::to_string(ntohs(addr.sin_port));
}

// FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT as an IPv4 socket address: the resolver's first answer, the
// one that the ranks connect to and rank 0 listens at.
inline sockaddr_in master_socket_address(const LaunchEnv& env) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  int gai = getaddrinfo(env.master_addr.c_str(), nullptr, &hints, &found);
  if (gai != 0)
    launch_fail("rank %d: cannot resolve FLATMOE_MASTER_ADDR '%s': %s", env.rank, env.master_addr.c_str(),
                gai == EAI_SYSTEM ? strerror(errno) : gai_strerror(gai));
  sockaddr_in addr;
  memcpy(&addr, found->ai_addr, sizeof(addr));
  freeaddrinfo(found);
  addr.sin_port = htons((uint16_t)env.master_port);
  return addr;
}

// "1 3-5 9" for {1, 3, 4, 5, 9} (sorted).
inline std::string rank_ranges(const std::vector<int>& ranks) {
  std::string text;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) j++;
    text += (text.empty() ? "" : " ") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return text;
}

// Why the first `received` bytes of a hello cannot be a flatmoe rank's of this protocol ("" while
// they may be).
inline std::string hello_format_problem(const uint8_t* hello, size_t received) {
  if (received >= 4 && get_be(hello, 4) != RENDEZVOUS_MAGIC)
    return comm_format("not a flatmoe rendezvous hello (it begins with 0x%08x)", (unsigned)get_be(hello, 4));
  if (received >= 8 && get_be(hello + 4, 4) != RENDEZVOUS_VERSION)
    return comm_format("rendezvous protocol version %u, rank 0 speaks %u (another flatmoe build?)",
                       (unsigned)get_be(hello + 4, 4), RENDEZVOUS_VERSION);
  return "";
}

// One connection that rank 0 serves.
struct RendezvousPeer {
  int fd = -1;  // -1 once closed
  std::string address;  // "ip:port", named in the log
  std::chrono::steady_clock::time_point deadline;
  uint64_t nonce = 0;  // rank 0's nonce in this connection's challenge
  uint8_t hello[RENDEZVOUS_HELLO_BYTES] = {};
  size_t hello_received = 0;
  std::vector<uint8_t> out;  // the challenge, then the answer
  size_t out_sent = 0;
  bool answered = false;  // the answer is in `out`: closed once it is sent
  int rank = -1;          // the rank that the answer gives the id to
  std::string refusal;    // why the answer refuses the hello
};

// Rank 0: listens at FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT (env) until ranks 1..world-1 have each
// fetched the id, dropping the connections that are not ranks of this job (see above) or that take
// longer than connection_timeout_s; exits naming the missing ranks after timeout_s.
inline void rendezvous_serve_id(const LaunchEnv& env, const ncclUniqueId& id, double timeout_s,
                                double connection_timeout_s) {
  using std::chrono::steady_clock;
  const sockaddr_in addr = master_socket_address(env);
  const std::string where = socket_address_text(addr);
  int listener = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (listener < 0) launch_fail("rank 0: rendezvous socket: %s", strerror(errno));
  // Listening at once on a port whose connections of an earlier job linger in TIME_WAIT; two
  // listeners still cannot share the port.
  int one = 1;
  if (setsockopt(listener, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) != 0)
    launch_fail("rank 0: rendezvous setsockopt(SO_REUSEADDR): %s", strerror(errno));
  if (bind(listener, (const sockaddr*)&addr, sizeof(addr)) != 0) {
    if (errno == EADDRNOTAVAIL)
      launch_fail("rank 0: FLATMOE_MASTER_ADDR '%s' is %s, which is not an address of this host: start rank 0 on "
                  "that host, or set FLATMOE_MASTER_ADDR to rank 0's host",
                  env.master_addr.c_str(), ipv4_text(addr).c_str());
    if (errno == EADDRINUSE)
      launch_fail("rank 0: %s (FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT) is in use, by another job? Choose another "
                  "FLATMOE_MASTER_PORT",
                  where.c_str());
    launch_fail("rank 0: cannot listen on %s (FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT): %s", where.c_str(),
                strerror(errno));
  }
  if (listen(listener, SOMAXCONN) != 0) launch_fail("rank 0: listen on %s: %s", where.c_str(), strerror(errno));
  // A host name that resolves to loopback on its own host (Debian's /etc/hosts maps it to 127.0.1.1)
  // cannot be reached from other hosts.
  in_addr literal;
  if ((ntohl(addr.sin_addr.s_addr) >> 24) == 127 && env.master_addr != "localhost" &&
      inet_pton(AF_INET, env.master_addr.c_str(), &literal) != 1)
    fprintf(stderr, "flatmoe launch: rank 0: note: FLATMOE_MASTER_ADDR '%s' is %s here, a loopback address: only "
                    "ranks on this host can connect\n",
            env.master_addr.c_str(), ipv4_text(addr).c_str());

  std::vector<bool> served(env.world, false), answering(env.world, false);
  served[0] = true;
  int waiting = env.world - 1, dropped = 0;
  std::vector<RendezvousPeer> peers;
  const auto end = steady_clock::now() + seconds_duration(timeout_s);
  steady_clock::time_point accept_again{};  // after running out of descriptors: accept no more until then

  auto close_peer = [&](RendezvousPeer& p) {
    close(p.fd);
    p.fd = -1;
    if (p.rank >= 0) answering[p.rank] = false;
  };
  // Ends a connection that gave no rank the id, with one line in the log: why its hello was refused
  // when it was, else `why`.
  auto drop = [&](RendezvousPeer& p, const std::string& why) {
    fprintf(stderr, "flatmoe launch: rank 0: dropped the connection from %s: %s\n", p.address.c_str(),
            (p.refusal.empty() ? why : p.refusal).c_str());
    fflush(stderr);
    dropped++;
    close_peer(p);
  };
  // Queues the answer to a complete hello: the id, or a refusal.
  auto answer = [&](RendezvousPeer& p) {
    const uint32_t rank = (uint32_t)get_be(p.hello + 8, 4), world = (uint32_t)get_be(p.hello + 12, 4);
    const uint64_t rank_nonce = get_be(p.hello + 16, 8), proof = get_be(p.hello + 24, 8);
    RendezvousStatus status = RendezvousStatus::Ok;
    std::string& why = p.refusal;
    if (proof != rendezvous_proof(env.job_token, RENDEZVOUS_HELLO_LABEL, p.nonce, rank_nonce, rank, world)) {
      status = RendezvousStatus::WrongToken;
      why = "wrong job token (a rank of another job on this port, or FLATMOE_JOB_TOKEN differs between ranks?)";
    } else if (world != (uint32_t)env.world) {
      status = RendezvousStatus::WrongWorld;
      why = comm_format("rank %u of a world of %u ranks, but this job has %d", rank, world, env.world);
    } else if (rank < 1 || rank >= world) {
      status = RendezvousStatus::RankOutside;
      why = comm_format("rank %u is not one of ranks 1..%d, which fetch the id", rank, env.world - 1);
    } else if (served[rank] || answering[rank]) {
      status = RendezvousStatus::RankServed;
      why = comm_format("rank %u already has the id (two processes started as rank %u?)", rank, rank);
    }
    uint8_t reply[RENDEZVOUS_ANSWER_BYTES] = {};
    put_be(reply, (uint32_t)status, 4);
    if (status == RendezvousStatus::Ok) {
      put_be(reply + 4, rendezvous_proof(env.job_token, RENDEZVOUS_ANSWER_LABEL, p.nonce, rank_nonce, rank, world), 8);
      memcpy(reply + 12, id.internal, NCCL_UNIQUE_ID_BYTES);
      p.rank = (int)rank;
      answering[rank] = true;
    }
    p.out.insert(p.out.end(), reply, reply + RENDEZVOUS_ANSWER_BYTES);
    p.answered = true;
  };
  // Moves what can move on one connection without waiting.
  auto serve = [&](RendezvousPeer& p) {
    for (;;) {
      IoStep step = send_some(p.fd, p.out.data(), p.out.size(), &p.out_sent);
      if (step == IoStep::Failed) return drop(p, comm_format("sending: %s", strerror(errno)));
      if (step == IoStep::Blocked) return;
      if (p.answered) {  // and sent
        if (p.rank < 0) return drop(p, "");
        served[p.rank] = true;
        waiting--;
        return close_peer(p);
      }
      step = recv_some(p.fd, p.hello, RENDEZVOUS_HELLO_BYTES, &p.hello_received);
      std::string problem = hello_format_problem(p.hello, p.hello_received);
      if (!problem.empty()) return drop(p, problem);
      if (step == IoStep::Closed)
        return drop(p, comm_format("closed the connection after %zu of a hello's %zu bytes", p.hello_received,
                                   RENDEZVOUS_HELLO_BYTES));
      if (step == IoStep::Failed) return drop(p, comm_format("receiving: %s", strerror(errno)));
      if (step == IoStep::Blocked) return;
      answer(p);
    }
  };
  auto accept_all = [&] {
    for (;;) {
      sockaddr_in from{};
      socklen_t from_bytes = sizeof(from);
      int fd = accept4(listener, (sockaddr*)&from, &from_bytes, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR || errno == ECONNABORTED) continue;
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
          // A flood of connections: the open ones close by their deadlines.
          fprintf(stderr, "flatmoe launch: rank 0: accept on %s: %s; accepting again in 1 s\n", where.c_str(),
                  strerror(errno));
          accept_again = steady_clock::now() + std::chrono::seconds(1);
          return;
        }
        launch_fail("rank 0: rendezvous accept on %s: %s", where.c_str(), strerror(errno));
      }
      RendezvousPeer p;
      p.fd = fd;
      p.address = socket_address_text(from);
      p.deadline = steady_clock::now() + seconds_duration(connection_timeout_s);
      p.nonce = rendezvous_nonce(0);
      p.out.resize(RENDEZVOUS_CHALLENGE_BYTES);
      put_be(&p.out[0], RENDEZVOUS_MAGIC, 4);
      put_be(&p.out[4], RENDEZVOUS_VERSION, 4);
      put_be(&p.out[8], p.nonce, 8);
      peers.push_back(std::move(p));
      serve(peers.back());
    }
  };

  while (waiting > 0) {
    const auto now = steady_clock::now();
    if (now >= end) {
      std::vector<int> missing;
      for (int r = 0; r < env.world; r++)
        if (!served[r]) missing.push_back(r);
      launch_fail("rank 0: after %g s (FLATMOE_COMM_TIMEOUT_S) at %s, ranks [%s] of %d had not fetched the NCCL id%s",
                  timeout_s, where.c_str(), rank_ranges(missing).c_str(), env.world,
                  dropped > 0 ? comm_format(" (%d connection(s) dropped, see above)", dropped).c_str() : "");
    }
    for (RendezvousPeer& p : peers)
      if (p.fd >= 0 && now >= p.deadline)
        drop(p, p.answered ? comm_format("rank %d did not take the id within %g s", p.rank, connection_timeout_s)
                           : comm_format("no complete hello within %g s (%zu of its %zu bytes)", connection_timeout_s,
                                         p.hello_received, RENDEZVOUS_HELLO_BYTES));
    peers.erase(std::remove_if(peers.begin(), peers.end(), [](const RendezvousPeer& p) { return p.fd < 0; }),
                peers.end());
    std::vector<pollfd> fds;
    auto wake = end;
    const bool accepting = now >= accept_again;
    fds.push_back({accepting ? listener : -1, POLLIN, 0});  // poll skips a negative descriptor
    if (!accepting) wake = std::min(wake, accept_again);
    for (const RendezvousPeer& p : peers) {
      fds.push_back({p.fd, (short)(p.out_sent < p.out.size() ? POLLOUT : POLLIN), 0});
      wake = std::min(wake, p.deadline);
    }
    int ready = poll(fds.data(), fds.size(), poll_ms_until(wake));
    if (ready < 0 && errno != EINTR) launch_fail("rank 0: rendezvous poll: %s", strerror(errno));
    if (ready <= 0) continue;
    for (size_t i = 1; i < fds.size(); i++)
      if (fds[i].revents != 0 && peers[i - 1].fd >= 0) serve(peers[i - 1]);
    if (fds[0].revents != 0) accept_all();
  }
  for (RendezvousPeer& p : peers)
    if (p.fd >= 0)
      drop(p, comm_format("still connected when every rank had the id (%zu of a hello's %zu bytes)", p.hello_received,
                          RENDEZVOUS_HELLO_BYTES));
  close(listener);
}

// Exits naming why a rank's exchange with rank 0 at `where` stopped during `what` (a step of
// transfer_by other than Done).
[[noreturn]] inline void rendezvous_fetch_fail(int rank, const std::string& where, IoStep step, const char* what,
                                               double connection_timeout_s) {
  if (step == IoStep::Closed)
    launch_fail("rank %d: rank 0 at %s closed the connection during %s (see rank 0's log; is another program on "
                "that port?)",
                rank, where.c_str(), what);
  if (step == IoStep::Blocked)
    launch_fail("rank %d: rank 0 at %s: %s not through within %g s of connecting (is another program on that port?)",
                rank, where.c_str(), what, connection_timeout_s);
  launch_fail("rank %d: rendezvous with rank 0 at %s, during %s: %s", rank, where.c_str(), what, strerror(errno));
}

// Ranks 1..world-1: connects to rank 0 (retrying every 100 ms while it does not listen yet, until
// timeout_s), proves the job token, checks rank 0's proof and returns the id it sends. Exits with a
// message on a refusal, a wrong proof, or a connection that takes longer than connection_timeout_s.
inline ncclUniqueId rendezvous_fetch_id(const LaunchEnv& env, double timeout_s, double connection_timeout_s) {
  using std::chrono::steady_clock;
  const int rank = env.rank;
  const sockaddr_in addr = master_socket_address(env);
  const std::string where = env.master_addr + ":" + std::to_string(env.master_port);
  const auto end = steady_clock::now() + seconds_duration(timeout_s);
  int fd = -1;
  for (;;) {
    fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) launch_fail("rank %d: rendezvous socket: %s", rank, strerror(errno));
    int err = connect(fd, (const sockaddr*)&addr, sizeof(addr)) == 0 ? 0 : errno;
    if (err == EINPROGRESS || err == EINTR) {  // the connection goes on in the background
      err = ETIMEDOUT;
      if (wait_ready(fd, POLLOUT, std::min(end, steady_clock::now() + seconds_duration(connection_timeout_s)))) {
        socklen_t err_bytes = sizeof(err);
        if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &err_bytes) != 0) err = errno;
      }
    }
    if (err == 0) break;
    close(fd);
    // Rank 0 does not listen yet (refused), its host is not reachable yet, or the connection was lost
    // on the way: try again until the deadline.
    if (err != ECONNREFUSED && err != ETIMEDOUT && err != EHOSTUNREACH && err != ENETUNREACH)
      launch_fail("rank %d: cannot connect to rank 0 at %s: %s", rank, where.c_str(), strerror(err));
    if (steady_clock::now() + std::chrono::milliseconds(100) >= end)
      launch_fail("rank %d: could not connect to rank 0 at %s within %g s (FLATMOE_COMM_TIMEOUT_S): %s", rank,
                  where.c_str(), timeout_s, strerror(err));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  const auto deadline = std::min(end, steady_clock::now() + seconds_duration(connection_timeout_s));
  uint8_t challenge[RENDEZVOUS_CHALLENGE_BYTES];
  IoStep step = transfer_by(fd, false, challenge, sizeof(challenge), deadline);
  if (step != IoStep::Done) rendezvous_fetch_fail(rank, where, step, "its challenge", connection_timeout_s);
  if (get_be(challenge, 4) != RENDEZVOUS_MAGIC)
    launch_fail("rank %d: the program at %s is not a flatmoe rank 0 (it does not speak the rendezvous protocol)", rank,
                where.c_str());
  if (get_be(challenge + 4, 4) != RENDEZVOUS_VERSION)
    launch_fail("rank %d: rank 0 at %s speaks rendezvous protocol version %u, this rank %u: run one flatmoe build on "
                "every rank",
                rank, where.c_str(), (unsigned)get_be(challenge + 4, 4), RENDEZVOUS_VERSION);
  const uint64_t rank0_nonce = get_be(challenge + 8, 8), nonce = rendezvous_nonce(rank);
  uint8_t hello[RENDEZVOUS_HELLO_BYTES];
  put_be(hello, RENDEZVOUS_MAGIC, 4);
  put_be(hello + 4, RENDEZVOUS_VERSION, 4);
  put_be(hello + 8, rank, 4);
  put_be(hello + 12, env.world, 4);
  put_be(hello + 16, nonce, 8);
  put_be(hello + 24, rendezvous_proof(env.job_token, RENDEZVOUS_HELLO_LABEL, rank0_nonce, nonce, rank, env.world), 8);
  step = transfer_by(fd, true, hello, sizeof(hello), deadline);
  if (step != IoStep::Done) rendezvous_fetch_fail(rank, where, step, "this rank's hello", connection_timeout_s);
  uint8_t reply[RENDEZVOUS_ANSWER_BYTES];
  step = transfer_by(fd, false, reply, sizeof(reply), deadline);
  if (step != IoStep::Done) rendezvous_fetch_fail(rank, where, step, "its answer", connection_timeout_s);
  close(fd);
  const uint32_t status = (uint32_t)get_be(reply, 4);
  if (status == (uint32_t)RendezvousStatus::WrongToken)
    launch_fail("rank %d: rank 0 at %s refused this rank's job token: another job on this port, or FLATMOE_JOB_TOKEN "
                "differs between ranks? (this rank's token: %s)",
                rank, where.c_str(), env.job_token_source.c_str());
  if (status == (uint32_t)RendezvousStatus::WrongWorld)
    launch_fail("rank %d: rank 0 at %s refused this rank: its job does not have %d ranks (another job on this port?)",
                rank, where.c_str(), env.world);
  if (status == (uint32_t)RendezvousStatus::RankServed)
    launch_fail("rank %d: rank 0 at %s had given the id to a rank %d already: two processes were started as rank %d",
                rank, where.c_str(), rank, rank);
  if (status != (uint32_t)RendezvousStatus::Ok)
    launch_fail("rank %d: rank 0 at %s refused this rank (status %u; see rank 0's log)", rank, where.c_str(), status);
  if (get_be(reply + 4, 8) !=
      rendezvous_proof(env.job_token, RENDEZVOUS_ANSWER_LABEL, rank0_nonce, nonce, rank, env.world))
    launch_fail("rank %d: rank 0 at %s did not prove the job token: another job on this port? (this rank's token: %s)",
                rank, where.c_str(), env.job_token_source.c_str());
  ncclUniqueId id;
  memcpy(id.internal, reply + 12, NCCL_UNIQUE_ID_BYTES);
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

// How long ranks that are told to stop (SIGTERM) may take before they get SIGKILL.
static const double RANK_STOP_GRACE_S = 10;

// The signals that the launcher handles: SIGINT, SIGTERM and SIGHUP stop the job; SIGCHLD (a rank
// ended) wakes its wait.
static const int LAUNCHER_SIGNALS[] = {SIGINT, SIGTERM, SIGHUP, SIGCHLD};

inline const char* launcher_signal_name(int sig) {
  switch (sig) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGHUP: return "SIGHUP";
    default: return strsignal(sig);
  }
}

// The write end of the pipe that the launcher's signals arrive on (-1 while none is installed).
inline int launcher_signal_write_fd = -1;

// Only write(), which is async-signal-safe: the signal's number goes down the pipe that the waiting
// loop polls. A handler (rather than sigwait or signalfd, which need the signal blocked in every
// thread) also takes a signal that the kernel hands to another thread, such as one the CUDA runtime
// started.
inline void launcher_on_signal(int sig) {
  const int saved_errno = errno;
  const unsigned char number = (unsigned char)sig;
  // fails only when the pipe is full, which already holds wake-ups enough
  (void)!write(launcher_signal_write_fd, &number, 1);
  errno = saved_errno;
}

// While it lives, LAUNCHER_SIGNALS arrive as bytes (their numbers) to read from `fd` instead of acting;
// the previous handlers come back after.
class LauncherSignals {
 public:
  int fd = -1;  // the read end (non-blocking)

  LauncherSignals() {
    int ends[2];
    if (pipe2(ends, O_CLOEXEC | O_NONBLOCK) != 0) launch_fail("launcher signal pipe: %s", strerror(errno));
    fd = ends[0];
    launcher_signal_write_fd = ends[1];
    struct sigaction action {};
    action.sa_handler = launcher_on_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = SA_RESTART | SA_NOCLDSTOP;
    for (size_t i = 0; i < std::size(LAUNCHER_SIGNALS); i++)
      if (sigaction(LAUNCHER_SIGNALS[i], &action, &previous_[i]) != 0)
        launch_fail("sigaction(%s): %s", launcher_signal_name(LAUNCHER_SIGNALS[i]), strerror(errno));
  }
  ~LauncherSignals() {
    for (size_t i = 0; i < std::size(LAUNCHER_SIGNALS); i++)
      if (sigaction(LAUNCHER_SIGNALS[i], &previous_[i], nullptr) != 0)
        fprintf(stderr, "flatmoe launch: restoring the handler of %s: %s\n", launcher_signal_name(LAUNCHER_SIGNALS[i]),
                strerror(errno));
    close(launcher_signal_write_fd);
    launcher_signal_write_fd = -1;
    close(fd);
  }
  LauncherSignals(const LauncherSignals&) = delete;
  LauncherSignals& operator=(const LauncherSignals&) = delete;

 private:
  struct sigaction previous_[std::size(LAUNCHER_SIGNALS)];
};

// Waits for the ranks (pids[r], each leading its own process group). When one fails, or the launcher
// gets SIGINT, SIGTERM or SIGHUP (read from `signals`), the process groups of the ranks still running
// get SIGTERM and, stop_grace_s later, SIGKILL (another of those signals sends SIGKILL at once).
// Returns once every rank is gone: 0 when all exited with 0, else the exit code of what came first,
// the failing rank's or 128 + the launcher's signal.
inline int wait_for_ranks(std::vector<pid_t> pids, const LauncherSignals& signals, double stop_grace_s) {
  using std::chrono::steady_clock;
  int running = (int)std::count_if(pids.begin(), pids.end(), [](pid_t p) { return p > 0; });
  int result = 0;
  bool stopping = false, killed = false;
  steady_clock::time_point kill_at;
  auto signal_ranks = [&](int sig) {
    for (int r = 0; r < (int)pids.size(); r++)
      if (pids[r] > 0 && kill(-pids[r], sig) != 0 && errno != ESRCH)
        fprintf(stderr, "flatmoe launch: sending %s to rank %d (pid %d): %s\n", launcher_signal_name(sig), r, pids[r],
                strerror(errno));
  };
  auto stop = [&] {
    fflush(stderr);
    signal_ranks(SIGTERM);
    stopping = true;
    kill_at = steady_clock::now() + seconds_duration(stop_grace_s);
  };
  while (running > 0) {
    for (int r = 0; r < (int)pids.size(); r++) {
      if (pids[r] <= 0) continue;
      int status = 0;
      const pid_t pid = waitpid(pids[r], &status, WNOHANG);
      if (pid < 0) {
        fprintf(stderr, "flatmoe launch: waitpid for rank %d (pid %d): %s\n", r, pids[r], strerror(errno));
        return EXIT_FAILURE;
      }
      if (pid == 0) continue;
      pids[r] = -1;
      running--;
      if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0) && !stopping) {
        result = exit_code_of(status);
        fprintf(stderr, "flatmoe launch: rank %d (pid %d) %s; stopping the other %d rank(s)\n", r, pid,
                describe_exit(status).c_str(), running);
        stop();
      }
    }
    if (running == 0) break;
    if (stopping && !killed && steady_clock::now() >= kill_at) {
      for (int r = 0; r < (int)pids.size(); r++)
        if (pids[r] > 0)
          fprintf(stderr, "flatmoe launch: rank %d (pid %d) did not stop within %g s of SIGTERM: SIGKILL\n", r, pids[r],
                  stop_grace_s);
      fflush(stderr);
      signal_ranks(SIGKILL);
      killed = true;
    }
    pollfd wake{signals.fd, POLLIN, 0};
    if (poll(&wake, 1, stopping && !killed ? poll_ms_until(kill_at) : -1) < 0 && errno != EINTR) {
      fprintf(stderr, "flatmoe launch: poll: %s\n", strerror(errno));
      return EXIT_FAILURE;
    }
    unsigned char numbers[64];
    ssize_t got;
    while ((got = read(signals.fd, numbers, sizeof(numbers))) > 0) {
      for (ssize_t i = 0; i < got; i++) {
        const int sig = numbers[i];
        if (sig == SIGCHLD) continue;  // the loop's waitpid reaps the rank
        if (!stopping) {
          fprintf(stderr, "flatmoe launch: received %s; stopping %d rank(s)\n", launcher_signal_name(sig), running);
          result = 128 + sig;
          stop();
        } else if (!killed) {
          fprintf(stderr, "flatmoe launch: received %s while stopping: SIGKILL to %d rank(s)\n",
                  launcher_signal_name(sig), running);
          fflush(stderr);
          signal_ranks(SIGKILL);
          killed = true;
        }
      }
    }
    if (got < 0 && errno != EAGAIN && errno != EINTR) {
      fprintf(stderr, "flatmoe launch: reading the signal pipe: %s\n", strerror(errno));
      return EXIT_FAILURE;
    }
  }
  return result;
}

// Writes `message` and exits: for a forked rank before its exec (async-signal-safe calls only).
[[noreturn]] inline void rank_child_fail(const char* message) {
  (void)!write(STDERR_FILENO, message, strlen(message));
  _exit(127);
}

// Starts `world` ranks of this program (/proc/self/exe with argv[0..argc)) with the launcher variables
// and a fresh NCCL id, each leading its own process group, and waits for them (wait_for_ranks, which
// gives ranks that are told to stop stop_grace_s). Returns 0 or the exit code of what stopped the job.
// With ranks sharing GPUs over sockets, the NCCL id's bootstrap address is on the loopback interface,
// as the ranks' sockets are (unless NCCL_SOCKET_IFNAME is set).
inline int run_local_ranks(int argc, char** argv, int world, double stop_grace_s = RANK_STOP_GRACE_S) {
  comm_set_nccl_env();
  if (local_ranks_share_gpus(gpu_sharing(), world, gpu_count()) && sharing_path(nccl_runtime_version()) == SharingPath::Sockets)
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
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
  LauncherSignals signals;
  // The launcher's signals wait while a rank is forked, so that none runs the launcher's handler in
  // the rank before its exec; the rank gets the default handlers and the launcher's mask back.
  sigset_t launcher_set, before;
  sigemptyset(&launcher_set);
  for (int sig : LAUNCHER_SIGNALS) sigaddset(&launcher_set, sig);
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  sigemptyset(&default_action.sa_mask);
  std::vector<pid_t> pids;
  auto abandon = [&](const std::string& why) {
    fprintf(stderr, "flatmoe launch: %s\n", why.c_str());
    for (pid_t p : pids) {
      kill(p, SIGKILL);  // the rank itself: its group may not be made yet
      waitpid(p, nullptr, 0);
    }
    return EXIT_FAILURE;
  };
  for (int rank = 0; rank < world; rank++) {
    std::vector<std::string> env = environment_with(
        {}, {"FLATMOE_RANK=" + std::to_string(rank), "FLATMOE_WORLD=" + std::to_string(world),
             "FLATMOE_LOCAL_RANK=" + std::to_string(rank), "FLATMOE_NCCL_ID=" + id_hex});
    std::vector<char*> envp = exec_array(env);
    int masked = pthread_sigmask(SIG_BLOCK, &launcher_set, &before);
    if (masked != 0) return abandon(comm_format("pthread_sigmask: %s", strerror(masked)));
    pid_t pid = fork();
    if (pid == 0) {
      // only async-signal-safe calls between fork and exec
      if (setpgid(0, 0) != 0) rank_child_fail("flatmoe launch: setpgid for a rank failed\n");
      if (prctl(PR_SET_PDEATHSIG, SIGKILL) != 0) rank_child_fail("flatmoe launch: prctl(PR_SET_PDEATHSIG) failed\n");
      if (getppid() != launcher) _exit(EXIT_FAILURE);  // the launcher died before the line above
      for (int sig : LAUNCHER_SIGNALS)
        if (sigaction(sig, &default_action, nullptr) != 0) rank_child_fail("flatmoe launch: sigaction failed\n");
      if (pthread_sigmask(SIG_SETMASK, &before, nullptr) != 0) rank_child_fail("flatmoe launch: sigmask failed\n");
      execve("/proc/self/exe", child_argv.data(), envp.data());
      rank_child_fail("flatmoe launch: execve(/proc/self/exe) failed\n");
    }
    const int fork_errno = errno;
    masked = pthread_sigmask(SIG_SETMASK, &before, nullptr);
    if (pid < 0)
      return abandon(comm_format("fork for rank %d of %d failed: %s", rank, world, strerror(fork_errno)));
    pids.push_back(pid);
    if (masked != 0) return abandon(comm_format("pthread_sigmask: %s", strerror(masked)));
    // The launcher puts the rank in its group too, so that it is there before the launcher may signal
    // it, whichever runs first; EACCES: the rank has exec'd, after its own setpgid.
    if (setpgid(pid, pid) != 0 && errno != EACCES)
      return abandon(comm_format("setpgid for rank %d (pid %d): %s", rank, pid, strerror(errno)));
  }
  return wait_for_ranks(pids, signals, stop_grace_s);
}

// Why our launcher does not start `ranks` ranks on a node of `devices` CUDA devices ("" when it does):
// more ranks than devices need the ranks to share GPUs.
inline std::string launcher_gpus_refusal(int ranks, int devices, bool share) {
  if (devices < 1) return "no CUDA device found; flatmoe trains on NVIDIA GPUs (see README)";
  if (ranks <= devices || share) return "";
  return comm_format("%d ranks requested (--gpus %d), but this node has %d CUDA device%s: --share_gpus 1 (or "
                     "FLATMOE_SHARE_GPUS=1) runs them on %s, round-robin, for correctness and memory (not speed)",
                     ranks, ranks, devices, devices == 1 ? "" : "s", devices == 1 ? "it" : "them");
}

// ---------------------------------------------------------------------------------------------

// This process's LaunchInfo; in the launching parent (gpus > 1, started by nobody) it starts the
// ranks, waits, and exits with their status instead of returning.
// With ranks sharing GPUs (FLATMOE_SHARE_GPUS=1) every rank sets its sharing variables before its
// first NCCL call, and the launching parent the loopback interface for the NCCL id it makes.
inline LaunchInfo launch(int argc, char** argv, int gpus) {
  const EnvLookup lookup = [](const char* name) -> const char* { return getenv(name); };
  LaunchEnv env;
  std::string why = parse_launch_env(lookup, gpus, &env);
  bool share = false;
  if (why.empty()) why = parse_gpu_sharing(lookup, &share);
  if (!why.empty()) launch_fail("%s", why.c_str());
  comm_set_nccl_env();
  LaunchInfo info;
  info.rank = env.rank;
  info.world = env.world;
  info.local_rank = env.local_rank;
  if (share && env.mode == LaunchMode::Child && !local_ranks_share_gpus(share, env.world, gpu_count())) {
    share = false;  // a GPU for every rank: the rest of this rank (gpu_sharing()) runs as without the switch
    if (unsetenv("FLATMOE_SHARE_GPUS") != 0) launch_fail("rank %d: unsetenv FLATMOE_SHARE_GPUS: %s", env.rank, strerror(errno));
  }
  if (share && env.mode != LaunchMode::Launcher)
    apply_gpu_sharing(env.rank, env.mode == LaunchMode::Child || is_loopback_host(env.master_addr));
  switch (env.mode) {
    case LaunchMode::Child:
      info.id = env.id;
      return info;
    case LaunchMode::External:
      if (env.rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&info.id);
        if (r != ncclSuccess) launch_fail("rank 0: ncclGetUniqueId failed: %s", nccl_why(r, nullptr).c_str());
        rendezvous_serve_id(env, info.id, comm_timeout_s(), RENDEZVOUS_CONNECTION_TIMEOUT_S);
      } else {
        info.id = rendezvous_fetch_id(env, comm_timeout_s(), RENDEZVOUS_CONNECTION_TIMEOUT_S);
      }
      return info;
    case LaunchMode::Launcher:
      break;
  }
  if (gpus == 1) return info;
  const int devices = gpu_count();
  std::string refused = launcher_gpus_refusal(gpus, devices, share);
  if (!refused.empty()) launch_fail("%s", refused.c_str());
  if (share && !local_ranks_share_gpus(share, gpus, devices))
    printf("--share_gpus 1: %d ranks on %d GPUs, one GPU each: none is shared, and the collectives take NCCL's own "
           "transports\n", gpus, devices);
  exit(run_local_ranks(argc, argv, gpus));
}
