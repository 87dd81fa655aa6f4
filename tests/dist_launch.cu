// tests/dist_launch.cu — runtime/launch.cuh. Host-only: every machine, every rank (the tests that start
// sub-jobs run on rank 0 only).
//   LaunchEnvironment: the launcher variables (our launcher, mpirun, mpiexec, srun; what is refused),
//     the job token's derivation and each rank's device, over tables of variables.
//   LaunchRendezvous: the TCP rendezvous between processes on 127.0.0.1. The real ranks get rank 0's
//     id within seconds while hostile clients (silent, slow, garbage, another protocol version, another
//     token, another world, a rank outside the world, a rank that has the id already, a second job on
//     the same port) are logged, one line each naming the peer, and dropped; a rank refuses a rank 0
//     that does not prove the token; rank 0 listens at its address only; the timeouts name what is
//     missing.
//   Launcher: our launcher stops the job when a rank exits, and when it gets SIGINT, SIGTERM or SIGHUP
//     (forwarded to the ranks as SIGTERM, SIGKILL after the grace), exiting with 128 + the signal and
//     leaving no rank behind (sub-jobs of this binary whose ranks see no GPU).
#include <fcntl.h>
#include <atomic>
#include <functional>
#include <map>
#include <thread>
#include "dist_jobs.cuh"

namespace {

// ---------------------------------------------------------------------------------------------
// Launcher variables, over tables

struct Env {
  std::map<std::string, std::string> vars;
  EnvLookup lookup() const {
    return [this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
  std::string parse(int gpus, LaunchEnv* out) const { return parse_launch_env(lookup(), gpus, out); }
};

TEST(LaunchEnvironment, StartedByNobody) {
  LaunchEnv e;
  EXPECT_EQ(Env{}.parse(1, &e), "");
  EXPECT_EQ(e.mode, LaunchMode::Launcher);
  EXPECT_EQ(e.rank, 0);
  EXPECT_EQ(e.world, 1);
  EXPECT_EQ(Env{}.parse(4, &e), "");
  EXPECT_EQ(e.mode, LaunchMode::Launcher);
  EXPECT_EQ(e.world, 4);
  EXPECT_EQ(e.job_token, "") << "our own launcher needs no token";
  EXPECT_NE(Env{}.parse(0, &e).find("at least 1"), std::string::npos);
}

TEST(LaunchEnvironment, StartedByOurLauncher) {
  ncclUniqueId id;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) id.internal[i] = (char)(i * 7 + 3);
  Env env{{{"FLATMOE_RANK", "2"}, {"FLATMOE_WORLD", "4"}, {"FLATMOE_LOCAL_RANK", "2"}, {"FLATMOE_NCCL_ID", nccl_id_to_hex(id)},
           {"OMPI_COMM_WORLD_RANK", "0"}, {"OMPI_COMM_WORLD_SIZE", "8"}}};  // our variables come first
  LaunchEnv e;
  ASSERT_EQ(env.parse(4, &e), "");
  EXPECT_EQ(e.mode, LaunchMode::Child);
  EXPECT_EQ(e.rank, 2);
  EXPECT_EQ(e.world, 4);
  EXPECT_EQ(e.local_rank, 2);
  EXPECT_EQ(memcmp(e.id.internal, id.internal, NCCL_UNIQUE_ID_BYTES), 0);

  Env missing = env;
  missing.vars.erase("FLATMOE_NCCL_ID");
  EXPECT_NE(missing.parse(4, &e).find("FLATMOE_NCCL_ID is missing"), std::string::npos);
  Env outside = env;
  outside.vars["FLATMOE_RANK"] = "4";
  EXPECT_NE(outside.parse(4, &e).find("FLATMOE_RANK='4'"), std::string::npos);
  Env garbled = env;
  garbled.vars["FLATMOE_NCCL_ID"] = "12ab";
  EXPECT_NE(garbled.parse(4, &e).find("FLATMOE_NCCL_ID"), std::string::npos);
  Env not_number = env;
  not_number.vars["FLATMOE_WORLD"] = "4x";
  EXPECT_NE(not_number.parse(4, &e).find("FLATMOE_WORLD='4x'"), std::string::npos);
}

TEST(LaunchEnvironment, StartedByMpirunOrSrun) {
  const Env mpirun{{{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"}, {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                    {"OMPI_MCA_ess_base_jobid", "3735945217"}, {"FLATMOE_MASTER_ADDR", "node07"},
                    {"FLATMOE_MASTER_PORT", "29500"}}};
  const Env srun{{{"SLURM_PROCID", "3"}, {"SLURM_NTASKS", "4"}, {"SLURM_LOCALID", "3"}, {"FLATMOE_JOB_TOKEN", "t"},
                  {"FLATMOE_MASTER_ADDR", "10.0.0.1"}, {"FLATMOE_MASTER_PORT", "1234"}}};
  LaunchEnv e;
  ASSERT_EQ(mpirun.parse(1, &e), "");
  EXPECT_EQ(e.mode, LaunchMode::External);
  EXPECT_EQ(e.rank, 5);
  EXPECT_EQ(e.world, 8);
  EXPECT_EQ(e.local_rank, 1);
  EXPECT_EQ(e.master_addr, "node07");
  EXPECT_EQ(e.master_port, 29500);
  EXPECT_EQ(mpirun.parse(8, &e), "") << "--gpus equal to the number of ranks is accepted";
  EXPECT_NE(mpirun.parse(4, &e).find("mpirun started 8 ranks"), std::string::npos);

  ASSERT_EQ(srun.parse(1, &e), "");
  EXPECT_EQ(e.mode, LaunchMode::External);
  EXPECT_EQ(e.rank, 3);
  EXPECT_EQ(e.world, 4);
  EXPECT_EQ(e.local_rank, 3);
  EXPECT_EQ(e.master_addr, "10.0.0.1");
  EXPECT_EQ(e.master_port, 1234);

  for (const char* var : {"FLATMOE_MASTER_ADDR", "FLATMOE_MASTER_PORT"}) {
    Env missing = mpirun;
    missing.vars.erase(var);
    std::string why = missing.parse(1, &e);
    EXPECT_NE(why.find("set FLATMOE_MASTER_ADDR"), std::string::npos) << why;
    EXPECT_NE(why.find("mpirun with 8 ranks"), std::string::npos) << why;
  }
  for (const char* port : {"0", "65536", "http", ""}) {
    Env bad = srun;
    bad.vars["FLATMOE_MASTER_PORT"] = port;
    EXPECT_NE(bad.parse(1, &e).find("FLATMOE_MASTER_PORT"), std::string::npos) << port;
  }
  Env rank_outside = srun;
  rank_outside.vars["SLURM_PROCID"] = "4";
  EXPECT_NE(rank_outside.parse(1, &e).find("SLURM_PROCID='4'"), std::string::npos);
  Env no_size = srun;
  no_size.vars.erase("SLURM_NTASKS");
  EXPECT_NE(no_size.parse(1, &e).find("SLURM_NTASKS"), std::string::npos);

  Env one_task{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"SLURM_LOCALID", "0"}}};  // srun -n1, sbatch script
  ASSERT_EQ(one_task.parse(2, &e), "");
  EXPECT_EQ(e.mode, LaunchMode::Launcher);
  EXPECT_EQ(e.world, 2);
}

// MVAPICH2, MPICH / Intel MPI and Slurm's step task count are read like Open MPI's variables; a
// launcher's variables that are present but incomplete, or PMIx's rank alone, are refused instead of
// running as one silent rank.
TEST(LaunchEnvironment, OtherLaunchersAndIncompleteVariables) {
  const std::map<std::string, std::string> master = {
      {"FLATMOE_MASTER_ADDR", "node0"}, {"FLATMOE_MASTER_PORT", "29500"}, {"FLATMOE_JOB_TOKEN", "t"}};
  struct Case {
    std::map<std::string, std::string> vars;
    int rank, world, local_rank;
  };
  const Case cases[] = {
      {{{"MV2_COMM_WORLD_RANK", "6"}, {"MV2_COMM_WORLD_SIZE", "16"}, {"MV2_COMM_WORLD_LOCAL_RANK", "6"}}, 6, 16, 6},
      {{{"PMI_RANK", "9"}, {"PMI_SIZE", "12"}, {"MPI_LOCALRANKID", "1"}}, 9, 12, 1},
      // srun inside an allocation of 8 tasks running a step of 4: the step's count is the world
      {{{"SLURM_PROCID", "2"}, {"SLURM_NTASKS", "8"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_LOCALID", "0"}}, 2, 4, 0},
  };
  for (const Case& c : cases) {
    Env env{c.vars};
    env.vars.insert(master.begin(), master.end());
    LaunchEnv e;
    ASSERT_EQ(env.parse(1, &e), "") << c.vars.begin()->first;
    EXPECT_EQ(e.mode, LaunchMode::External);
    EXPECT_EQ(e.rank, c.rank);
    EXPECT_EQ(e.world, c.world);
    EXPECT_EQ(e.local_rank, c.local_rank);
  }
  LaunchEnv e;
  Env no_local{{{"PMI_RANK", "1"}, {"PMI_SIZE", "2"}, {"FLATMOE_MASTER_ADDR", "a"}, {"FLATMOE_MASTER_PORT", "1"}}};
  EXPECT_NE(no_local.parse(1, &e).find("MPI_LOCALRANKID"), std::string::npos);
  for (const char* size : {"OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_STEP_NUM_TASKS"}) {
    Env size_only{{{size, "4"}}};
    const std::string why = size_only.parse(1, &e);
    EXPECT_NE(why.find("cannot tell its rank"), std::string::npos) << size << ": " << why;
  }
  Env pmix{{{"PMIX_RANK", "3"}, {"PMIX_NAMESPACE", "job"}}};
  const std::string why = pmix.parse(1, &e);
  EXPECT_NE(why.find("PMIX_RANK=3"), std::string::npos) << why;
  EXPECT_NE(why.find("mpirun or srun"), std::string::npos) << why;
}

// The job token of a rank started by mpirun or srun: FLATMOE_JOB_TOKEN, else the srun step that
// started the ranks, else the PMIx namespace, else Open MPI's job id; else refused.
TEST(LaunchEnvironment, JobToken) {
  using Vars = std::map<std::string, std::string>;
  auto with = [](Vars vars, const Vars& more) {
    for (const auto& [name, value] : more) vars[name] = value;
    return vars;
  };
  const Vars master = {{"FLATMOE_MASTER_ADDR", "node0"}, {"FLATMOE_MASTER_PORT", "29500"}};
  const Vars ompi = with(master, {{"OMPI_COMM_WORLD_RANK", "5"}, {"OMPI_COMM_WORLD_SIZE", "8"},
                                  {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}});
  const Vars srun = with(master, {{"SLURM_PROCID", "1"}, {"SLURM_NTASKS", "4"}, {"SLURM_STEP_NUM_TASKS", "4"},
                                  {"SLURM_LOCALID", "1"}, {"SLURM_JOB_ID", "4242"}, {"SLURM_STEP_ID", "3"}});
  const Vars mpich = with(master, {{"PMI_RANK", "1"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}});
  struct Case {
    const char* what;
    Vars vars;
    std::string token, source;  // expected; or, when source is "", `token` is part of the refusal
  };
  const Case cases[] = {
      {"FLATMOE_JOB_TOKEN before everything",
       with(srun, {{"FLATMOE_JOB_TOKEN", "s3cret"}, {"PMIX_NAMESPACE", "ns"}, {"OMPI_MCA_ess_base_jobid", "7"}}),
       "s3cret", "FLATMOE_JOB_TOKEN"},
      {"srun: its job and step", srun, "slurm:4242.3", "SLURM_JOB_ID.SLURM_STEP_ID"},
      {"srun --mpi=pmix: the step before the namespace", with(srun, {{"PMIX_NAMESPACE", "slurm.pmix.4242.3"}}),
       "slurm:4242.3", "SLURM_JOB_ID.SLURM_STEP_ID"},
      {"mpiexec (MPICH) whose ranks are the tasks of an srun step",
       with(mpich, {{"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "4"}, {"SLURM_JOB_ID", "99"}, {"SLURM_STEP_ID", "0"}}),
       "slurm:99.0", "SLURM_JOB_ID.SLURM_STEP_ID"},
      {"mpirun (Open MPI 5) in an allocation: its daemons' step is not the job's",
       with(ompi, {{"SLURM_JOB_ID", "4242"}, {"SLURM_STEP_ID", "0"}, {"SLURM_PROCID", "1"}, {"SLURM_STEP_NUM_TASKS", "1"},
                   {"PMIX_NAMESPACE", "prterun-node0-1234@1"}}),
       "PMIX_NAMESPACE:prterun-node0-1234@1", "PMIX_NAMESPACE"},
      {"mpirun (Open MPI 4)", with(ompi, {{"OMPI_MCA_ess_base_jobid", "3735945217"}}),
       "OMPI_MCA_ess_base_jobid:3735945217", "OMPI_MCA_ess_base_jobid"},
      {"an empty PMIx namespace is none", with(ompi, {{"PMIX_NAMESPACE", ""}, {"OMPI_MCA_ess_base_jobid", "12"}}),
       "OMPI_MCA_ess_base_jobid:12", "OMPI_MCA_ess_base_jobid"},
      {"mpiexec (Hydra) with nothing to derive from", mpich,
       "started by mpiexec (MPICH / Intel MPI) with 4 ranks, but there is no job token", ""},
      {"an srun step without its step id", with(srun, {{"SLURM_STEP_ID", ""}}), "set FLATMOE_JOB_TOKEN", ""},
      {"an empty FLATMOE_JOB_TOKEN", with(ompi, {{"FLATMOE_JOB_TOKEN", ""}, {"OMPI_MCA_ess_base_jobid", "7"}}),
       "FLATMOE_JOB_TOKEN is set but empty", ""},
  };
  for (const Case& c : cases) {
    LaunchEnv e;
    const std::string why = Env{c.vars}.parse(1, &e);
    if (c.source.empty()) {
      EXPECT_NE(why.find(c.token), std::string::npos) << c.what << ": " << why;
      continue;
    }
    ASSERT_EQ(why, "") << c.what;
    EXPECT_EQ(e.job_token, c.token) << c.what;
    EXPECT_EQ(e.job_token_source, c.source) << c.what;
  }
}

// A rank's device: FLATMOE_DEVICE, else the only visible one, else its local rank (without sharing,
// a local rank past the GPUs is refused).
TEST(LaunchEnvironment, DeviceChoice) {
  auto choose = [](const Env& env, int local_rank, int visible, int* device) {
    return choose_device(env.lookup(), local_rank, visible, device);
  };
  int device = -1;
  EXPECT_EQ(choose(Env{}, 3, 8, &device), "");
  EXPECT_EQ(device, 3) << "the local rank on a node whose GPUs every task sees";
  EXPECT_EQ(choose(Env{}, 3, 1, &device), "");
  EXPECT_EQ(device, 0) << "srun --gpus-per-task=1: the only visible GPU";
  EXPECT_EQ(choose(Env{{{"FLATMOE_DEVICE", "5"}}}, 3, 8, &device), "");
  EXPECT_EQ(device, 5);
  EXPECT_NE(choose(Env{{{"FLATMOE_DEVICE", "8"}}}, 0, 8, &device).find("FLATMOE_DEVICE='8'"), std::string::npos);
  EXPECT_NE(choose(Env{{{"FLATMOE_DEVICE", "x"}}}, 0, 8, &device).find("FLATMOE_DEVICE='x'"), std::string::npos);
  EXPECT_NE(choose(Env{}, 2, 2, &device).find("local rank 2"), std::string::npos);
  EXPECT_NE(choose(Env{}, 2, 2, &device).find("--share_gpus 1"), std::string::npos) << "the refusal names the option";
  EXPECT_NE(choose(Env{}, 0, 0, &device).find("no CUDA device"), std::string::npos);
}

// Ranks sharing GPUs (FLATMOE_SHARE_GPUS=1): placed round-robin over the GPUs the process sees.
TEST(GpuSharing, RanksArePlacedRoundRobin) {
  const Env share{{{"FLATMOE_SHARE_GPUS", "1"}}};
  int device = -1;
  for (int visible : {1, 2, 3})
    for (int local_rank = 0; local_rank < 8; local_rank++) {
      EXPECT_EQ(choose_device(share.lookup(), local_rank, visible, &device), "");
      EXPECT_EQ(device, local_rank % visible) << "local rank " << local_rank << " of 8 on " << visible << " GPUs";
    }
  const Env chosen{{{"FLATMOE_SHARE_GPUS", "1"}, {"FLATMOE_DEVICE", "1"}}};
  EXPECT_EQ(choose_device(chosen.lookup(), 6, 2, &device), "");
  EXPECT_EQ(device, 1) << "FLATMOE_DEVICE still decides";
  const Env malformed{{{"FLATMOE_SHARE_GPUS", "yes"}}};
  EXPECT_NE(choose_device(malformed.lookup(), 3, 2, &device).find("FLATMOE_SHARE_GPUS='yes' must be 0 or 1"),
            std::string::npos);
}

TEST(GpuSharing, TheSwitchIsZeroOrOne) {
  bool share = true;
  EXPECT_EQ(parse_gpu_sharing(Env{}.lookup(), &share), "");
  EXPECT_FALSE(share) << "off unless asked for";
  EXPECT_EQ(parse_gpu_sharing(Env{{{"FLATMOE_SHARE_GPUS", "0"}}}.lookup(), &share), "");
  EXPECT_FALSE(share);
  EXPECT_EQ(parse_gpu_sharing(Env{{{"FLATMOE_SHARE_GPUS", "1"}}}.lookup(), &share), "");
  EXPECT_TRUE(share);
  for (const char* bad : {"", "2", "on", " 1"})
    EXPECT_NE(parse_gpu_sharing(Env{{{"FLATMOE_SHARE_GPUS", bad}}}.lookup(), &share).find("must be 0 or 1"),
              std::string::npos)
        << "'" << bad << "'";
}

// Our launcher refuses more ranks than GPUs unless they may share them, naming the option.
TEST(GpuSharing, MoreRanksThanGpusNeedTheSwitch) {
  EXPECT_EQ(launcher_gpus_refusal(2, 2, false), "");
  EXPECT_EQ(launcher_gpus_refusal(8, 1, true), "");
  EXPECT_EQ(launcher_gpus_refusal(8, 3, true), "");
  const std::string refused = launcher_gpus_refusal(8, 1, false);
  EXPECT_NE(refused.find("8 ranks requested (--gpus 8), but this node has 1 CUDA device"), std::string::npos) << refused;
  EXPECT_NE(refused.find("--share_gpus 1"), std::string::npos) << refused;
  EXPECT_NE(refused.find("not speed"), std::string::npos) << refused;
  EXPECT_NE(launcher_gpus_refusal(2, 0, true).find("no CUDA device"), std::string::npos);
}

// Our launcher's ranks share GPUs only where they outnumber them: with a GPU each, --share_gpus 1 changes
// nothing (NCCL's own transports, GPU timings); an external launcher's ranks are not decided here.
TEST(GpuSharing, RanksWithAGpuEachShareNone) {
  for (int devices : {1, 2, 3, 7})
    EXPECT_TRUE(local_ranks_share_gpus(true, 8, devices)) << "8 ranks on " << devices << " GPUs";
  EXPECT_TRUE(local_ranks_share_gpus(true, 2, 1));
  for (int devices : {8, 9, 16})
    EXPECT_FALSE(local_ranks_share_gpus(true, 8, devices)) << "8 ranks on " << devices << " GPUs: one GPU each";
  EXPECT_FALSE(local_ranks_share_gpus(true, 2, 8));
  EXPECT_FALSE(local_ranks_share_gpus(false, 8, 1)) << "never without the switch (refused instead)";
}

// Each rank's NCCL variables: its own host identity and the loopback interface (NCCL < 2.30), or
// NCCL's own several-ranks-per-GPU switch (2.30 on); a variable the user set is kept.
TEST(GpuSharing, EachRankIsItsOwnNcclHostUnlessTheUserSaidOtherwise) {
  EXPECT_EQ(sharing_path(22807), SharingPath::Sockets);
  EXPECT_EQ(sharing_path(22900), SharingPath::Sockets);
  EXPECT_EQ(sharing_path(23000), SharingPath::NcclMultiRankGpu);
  using V = std::vector<std::string>;
  EXPECT_EQ(sharing_variables(Env{}.lookup(), 3, SharingPath::Sockets, true),
            (V{"NCCL_HOSTID=flatmoe-rank3", "NCCL_SOCKET_IFNAME=lo"}));
  EXPECT_EQ(sharing_variables(Env{}.lookup(), 3, SharingPath::Sockets, false), (V{"NCCL_HOSTID=flatmoe-rank3"}))
      << "ranks on other hosts: NCCL's own choice of interface";
  EXPECT_EQ(sharing_variables(Env{{{"NCCL_SOCKET_IFNAME", "eth0"}}}.lookup(), 0, SharingPath::Sockets, true),
            (V{"NCCL_HOSTID=flatmoe-rank0"}));
  EXPECT_EQ(sharing_variables(Env{{{"NCCL_HOSTID", "mine"}}}.lookup(), 5, SharingPath::Sockets, true),
            (V{"NCCL_SOCKET_IFNAME=lo"}));
  EXPECT_EQ(sharing_variables(Env{}.lookup(), 1, SharingPath::NcclMultiRankGpu, true),
            (V{"NCCL_MULTI_RANK_GPU_ENABLE=1"}));
  EXPECT_TRUE(is_loopback_host("127.0.0.1"));
  EXPECT_TRUE(is_loopback_host("127.1.2.3"));
  EXPECT_TRUE(is_loopback_host("localhost"));
  EXPECT_FALSE(is_loopback_host("10.0.0.1"));
  EXPECT_FALSE(is_loopback_host("node7"));
}

// A job that a rank starts (a test's sub-job) goes without every variable that made this process a rank.
TEST(GpuSharing, SubJobsAreStartedByNobody) {
  const std::vector<std::string> names = rank_variable_names();
  for (const char* name : {"FLATMOE_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                           "MPI_LOCALRANKID", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "PMIX_RANK",
                           "NCCL_HOSTID"})
    EXPECT_NE(std::find(names.begin(), names.end(), name), names.end()) << name;
  // a rank of mpiexec's job of 4 that shares a GPU: without those variables, a job of 2 started by nobody
  Env rank{{{"PMI_RANK", "1"}, {"PMI_SIZE", "4"}, {"MPI_LOCALRANKID", "1"}, {"FLATMOE_MASTER_ADDR", "127.0.0.1"},
            {"FLATMOE_MASTER_PORT", "29500"}, {"FLATMOE_JOB_TOKEN", "t"}, {"NCCL_HOSTID", "flatmoe-rank1"}}};
  LaunchEnv e;
  EXPECT_EQ(rank.parse(1, &e), "");
  EXPECT_EQ(e.mode, LaunchMode::External);
  for (const std::string& name : names) rank.vars.erase(name);
  EXPECT_EQ(rank.parse(2, &e), "");
  EXPECT_EQ(e.mode, LaunchMode::Launcher);
  EXPECT_EQ(e.world, 2);
  EXPECT_EQ(rank.vars.count("NCCL_HOSTID"), 0u) << "the sub-job's ranks take host identities of their own";
}

// ---------------------------------------------------------------------------------------------
// The rendezvous on 127.0.0.1

// SipHash-2-4's reference outputs (the paper's appendix; key 00 01 .. 0f), and proofs that change with
// every field they cover.
TEST(LaunchRendezvous, ProofIsSipHash) {
  uint8_t bytes[15];
  for (int i = 0; i < 15; i++) bytes[i] = (uint8_t)i;
  const uint64_t k0 = 0x0706050403020100ull, k1 = 0x0f0e0d0c0b0a0908ull;
  EXPECT_EQ(siphash24(k0, k1, bytes, 0), 0x726fdb47dd0e0e31ull);
  EXPECT_EQ(siphash24(k0, k1, bytes, 15), 0xa129ca6149be45e5ull);
  const uint64_t proof = rendezvous_proof("token", RENDEZVOUS_HELLO_LABEL, 1, 2, 3, 4);
  EXPECT_EQ(proof, rendezvous_proof("token", RENDEZVOUS_HELLO_LABEL, 1, 2, 3, 4));
  EXPECT_NE(proof, rendezvous_proof("tokem", RENDEZVOUS_HELLO_LABEL, 1, 2, 3, 4));
  EXPECT_NE(proof, rendezvous_proof("token", RENDEZVOUS_ANSWER_LABEL, 1, 2, 3, 4));
  EXPECT_NE(proof, rendezvous_proof("token", RENDEZVOUS_HELLO_LABEL, 9, 2, 3, 4));
  EXPECT_NE(proof, rendezvous_proof("token", RENDEZVOUS_HELLO_LABEL, 1, 9, 3, 4));
  EXPECT_NE(proof, rendezvous_proof("token", RENDEZVOUS_HELLO_LABEL, 1, 2, 9, 4));
  EXPECT_NE(proof, rendezvous_proof("token", RENDEZVOUS_HELLO_LABEL, 1, 2, 3, 9));
}

// Rank `rank` of a job of `world` ranks whose rank 0 is at 127.0.0.1:port, as parse_launch_env makes it.
LaunchEnv loopback_rank(int port, int rank, int world, const std::string& token) {
  LaunchEnv e;
  e.mode = LaunchMode::External;
  e.rank = rank;
  e.world = world;
  e.local_rank = rank;
  e.master_addr = "127.0.0.1";
  e.master_port = port;
  e.job_token = token;
  e.job_token_source = "FLATMOE_JOB_TOKEN";
  return e;
}

ncclUniqueId test_id(int seed) {
  ncclUniqueId id;
  for (int i = 0; i < NCCL_UNIQUE_ID_BYTES; i++) id.internal[i] = (char)(i * 37 + seed);
  return id;
}

// A forked rank 0 that serves `id`; prints "served" once every rank has it.
std::pair<pid_t, int> start_rank0(const LaunchEnv& env, const ncclUniqueId& id, double timeout_s,
                                  double connection_timeout_s) {
  return fork_capturing([=] {
    rendezvous_serve_id(env, id, timeout_s, connection_timeout_s);
    printf("served\n");
  });
}

// A forked rank that fetches the id; prints "id HEX after SECONDS".
std::pair<pid_t, int> start_rank(const LaunchEnv& env, double timeout_s, double connection_timeout_s) {
  return fork_capturing([=] {
    const auto start = std::chrono::steady_clock::now();
    const ncclUniqueId id = rendezvous_fetch_id(env, timeout_s, connection_timeout_s);
    printf("id %s after %.3f\n", nccl_id_to_hex(id).c_str(), seconds_since(start));
  });
}

struct Ended {
  int exit_code = -1;
  std::string output;
};

Ended wait_ended(std::pair<pid_t, int> proc) {
  Ended ended;
  ended.output = read_all_and_close(proc.second);
  int status = 0;
  EXPECT_EQ(waitpid(proc.first, &status, 0), proc.first) << strerror(errno);
  ended.exit_code = exit_code_of(status);
  return ended;
}

// A rank that ended with 0 after fetching `id`; returns the seconds it took.
double expect_fetched(const Ended& rank, const ncclUniqueId& id, const char* what) {
  EXPECT_EQ(rank.exit_code, 0) << what << ": " << rank.output;
  char hex[2 * NCCL_UNIQUE_ID_BYTES + 1] = {0};
  double seconds = -1;
  EXPECT_EQ(sscanf(rank.output.c_str(), "id %256s after %lf", hex, &seconds), 2) << what << ": " << rank.output;
  EXPECT_EQ(std::string(hex), nccl_id_to_hex(id)) << what;
  return seconds;
}

// Whether a rank's output has its "id HEX" line.
bool printed_an_id(const std::string& output) { return output.rfind("id ", 0) == 0 || output.find("\nid ") != std::string::npos; }

// The line of rank 0's log about the connection from 127.0.0.1:local_port ("" when there is none);
// fails the test when there is more than one.
std::string drop_line(const std::string& log, int local_port) {
  const std::string key = "dropped the connection from 127.0.0.1:" + std::to_string(local_port) + ": ";
  size_t at = log.find(key);
  if (at == std::string::npos) return "";
  EXPECT_EQ(log.find(key, at + 1), std::string::npos) << "two lines about one connection:\n" << log;
  size_t line_start = log.rfind('\n', at) + 1;  // npos + 1 == 0
  return log.substr(line_start, log.find('\n', at) - line_start);
}

// A blocking connection to ip:port, retried while nobody listens there (up to retry_s); -1 and *err
// after. Its receives time out after 20 s.
int connect_to(const char* ip, int port, double retry_s, int* err) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons((uint16_t)port);
  EXPECT_EQ(inet_pton(AF_INET, ip, &addr.sin_addr), 1) << ip;
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    EXPECT_GE(fd, 0) << strerror(errno);
    timeval tv{20, 0};
    EXPECT_EQ(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0) << strerror(errno);
    if (connect(fd, (const sockaddr*)&addr, sizeof(addr)) == 0) return fd;
    *err = errno;
    close(fd);
    if (*err != ECONNREFUSED || seconds_since(start) > retry_s) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

int local_port(int fd) {
  sockaddr_in addr{};
  socklen_t bytes = sizeof(addr);
  EXPECT_EQ(getsockname(fd, (sockaddr*)&addr, &bytes), 0) << strerror(errno);
  return ntohs(addr.sin_port);
}

bool receive(int fd, uint8_t* data, size_t bytes) {
  size_t done = 0;
  return recv_some(fd, data, bytes, &done) == IoStep::Done;
}

bool send_bytes(int fd, const uint8_t* data, size_t bytes) {
  size_t done = 0;
  return send_some(fd, data, bytes, &done) == IoStep::Done;
}

// Reads until rank 0 closes the connection (or 20 s pass).
void read_until_closed(int fd) {
  uint8_t sink[256];
  while (recv(fd, sink, sizeof(sink), 0) > 0) {
  }
}

// A hello in answer to `challenge` with the fields the test chooses; the proof is right for `token`.
std::vector<uint8_t> hello_for(const uint8_t* challenge, uint32_t version, uint32_t rank, uint32_t world,
                               const std::string& token) {
  std::vector<uint8_t> hello(RENDEZVOUS_HELLO_BYTES);
  const uint64_t nonce = 0x0123456789abcdefull;
  put_be(&hello[0], RENDEZVOUS_MAGIC, 4);
  put_be(&hello[4], version, 4);
  put_be(&hello[8], rank, 4);
  put_be(&hello[12], world, 4);
  put_be(&hello[16], nonce, 8);
  put_be(&hello[24], rendezvous_proof(token, RENDEZVOUS_HELLO_LABEL, get_be(challenge + 8, 8), nonce, rank, world), 8);
  return hello;
}

// Reads rank 0's challenge, sends a hello with these fields, and returns the answer's status (-1 when
// rank 0 sent none).
int hello_and_status(int fd, uint32_t version, uint32_t rank, uint32_t world, const std::string& token) {
  uint8_t challenge[RENDEZVOUS_CHALLENGE_BYTES], answer[RENDEZVOUS_ANSWER_BYTES];
  if (!receive(fd, challenge, sizeof(challenge))) return -1;
  std::vector<uint8_t> hello = hello_for(challenge, version, rank, world, token);
  if (!send_bytes(fd, hello.data(), hello.size()) || !receive(fd, answer, sizeof(answer))) return -1;
  return (int)get_be(answer, 4);
}

// Clients that are not ranks of the job: each connects, does its part in a thread, and must be
// logged by rank 0 with `reason`; those that get an answer must get `status`.
struct Hostile {
  const char* name;
  std::string reason;
  int status;  // expected answer status, -1: no answer
  std::function<int(int fd)> act;  // returns the answer's status, or -1
  int port = 0;  // its local port, once connected
  int got_status = -2;
};

// Real ranks get the id within seconds while hostile clients are connected, and each hostile client
// gets one line in rank 0's log naming its address and why it was dropped. The silent and slow ones
// are connected (and have the challenge) before rank 1 starts, so rank 1 being served quickly shows
// that rank 0 serves connections concurrently; rank 2 starts after their 4 s deadline.
TEST(LaunchRendezvous, HostileClientsAreDroppedRealRanksServed) {
  const int world = 3, port = free_tcp_port();
  const std::string token = "job A";
  const double connection_timeout_s = 4;
  const ncclUniqueId id = test_id(11);
  auto rank0 = start_rank0(loopback_rank(port, 0, world, token), id, 60, connection_timeout_s);

  auto challenge_then = [](std::function<int(int)> rest) {
    return [rest](int fd) {
      uint8_t challenge[RENDEZVOUS_CHALLENGE_BYTES];
      if (!receive(fd, challenge, sizeof(challenge))) return -1;
      return rest(fd);
    };
  };
  std::vector<Hostile> hostiles = {
      {"silent", "no complete hello within 4 s (0 of its 32 bytes)", -1, challenge_then([](int fd) {
         read_until_closed(fd);
         return -1;
       })},
      {"slow (one byte a second)", "no complete hello within 4 s", -1, challenge_then([](int fd) {
         uint8_t magic[4];
         put_be(magic, RENDEZVOUS_MAGIC, 4);
         for (int i = 0; i < 30; i++) {
           uint8_t probe;
           if (recv(fd, &probe, 1, MSG_DONTWAIT) == 0) break;  // rank 0 closed
           if (send(fd, &magic[i % 4], 1, MSG_NOSIGNAL) != 1) break;
           std::this_thread::sleep_for(std::chrono::seconds(1));
         }
         return -1;
       })},
      {"garbage", "not a flatmoe rendezvous hello (it begins with 0x47455420)", -1, [](int fd) {
         const char request[] = "GET / HTTP/1.1\r\nHost: node0\r\n\r\n";
         send_bytes(fd, (const uint8_t*)request, sizeof(request) - 1);
         read_until_closed(fd);
         return -1;
       }},
      {"another protocol version", "rendezvous protocol version 3, rank 0 speaks 2", -1,
       [token](int fd) { return hello_and_status(fd, 3, 1, 3, token); }},
      {"another job's token", "wrong job token", (int)RendezvousStatus::WrongToken,
       [](int fd) { return hello_and_status(fd, RENDEZVOUS_VERSION, 1, 3, "job B"); }},
      {"another world", "rank 1 of a world of 5 ranks, but this job has 3", (int)RendezvousStatus::WrongWorld,
       [token](int fd) { return hello_and_status(fd, RENDEZVOUS_VERSION, 1, 5, token); }},
      {"a rank outside the world", "rank 3 is not one of ranks 1..2", (int)RendezvousStatus::RankOutside,
       [token](int fd) { return hello_and_status(fd, RENDEZVOUS_VERSION, 3, 3, token); }},
      {"rank 0 itself", "rank 0 is not one of ranks 1..2", (int)RendezvousStatus::RankOutside,
       [token](int fd) { return hello_and_status(fd, RENDEZVOUS_VERSION, 0, 3, token); }},
  };
  std::vector<std::thread> threads;
  std::atomic<int> connected{0};
  for (Hostile& h : hostiles)
    threads.emplace_back([&h, &connected, port] {
      int err = 0;
      int fd = connect_to("127.0.0.1", port, 20, &err);
      if (fd < 0) {
        ADD_FAILURE() << h.name << ": cannot connect: " << strerror(err);
        connected++;
        return;
      }
      h.port = local_port(fd);
      connected++;
      h.got_status = h.act(fd);
      close(fd);
    });
  while (connected < (int)hostiles.size()) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));  // the silent and slow ones have their challenge
  const auto hostiles_in = std::chrono::steady_clock::now();

  double rank1_s = expect_fetched(wait_ended(start_rank(loopback_rank(port, 1, world, token), 60, 10)), id, "rank 1");
  EXPECT_LT(rank1_s, 3.0) << "rank 1 waited for the silent or slow client";

  int err = 0;
  int duplicate = connect_to("127.0.0.1", port, 20, &err);
  ASSERT_GE(duplicate, 0) << strerror(err);
  const int duplicate_port = local_port(duplicate);
  EXPECT_EQ(hello_and_status(duplicate, RENDEZVOUS_VERSION, 1, 3, token), (int)RendezvousStatus::RankServed);
  close(duplicate);

  std::this_thread::sleep_for(seconds_duration(connection_timeout_s + 1) - (std::chrono::steady_clock::now() - hostiles_in));
  double rank2_s = expect_fetched(wait_ended(start_rank(loopback_rank(port, 2, world, token), 60, 10)), id, "rank 2");
  EXPECT_LT(rank2_s, 3.0);

  Ended served = wait_ended(rank0);
  for (std::thread& t : threads) t.join();
  EXPECT_EQ(served.exit_code, 0) << served.output;
  EXPECT_NE(served.output.find("served"), std::string::npos) << served.output;
  for (const Hostile& h : hostiles) {
    const std::string line = drop_line(served.output, h.port);
    EXPECT_NE(line.find(h.reason), std::string::npos) << h.name << ": expected \"" << h.reason << "\" in its line \""
                                                      << line << "\" of rank 0's log:\n"
                                                      << served.output;
    EXPECT_EQ(h.got_status, h.status) << h.name;
  }
  const std::string duplicate_line = drop_line(served.output, duplicate_port);
  EXPECT_NE(duplicate_line.find("rank 1 already has the id"), std::string::npos) << served.output;
}

// A second job's rank 0 on the same port cannot listen, and its ranks, which reach the first job's
// rank 0, are refused (not given the first job's id); the first job's ranks are unaffected.
TEST(LaunchRendezvous, SecondJobOnTheSamePort) {
  const int world = 3, port = free_tcp_port();
  const ncclUniqueId id_a = test_id(1), id_b = test_id(2);
  auto a0 = start_rank0(loopback_rank(port, 0, world, "job A"), id_a, 60, 10);
  expect_fetched(wait_ended(start_rank(loopback_rank(port, 1, world, "job A"), 60, 10)), id_a, "job A's rank 1");

  Ended b0 = wait_ended(start_rank0(loopback_rank(port, 0, world, "job B"), id_b, 60, 10));
  EXPECT_NE(b0.exit_code, 0);
  EXPECT_NE(b0.output.find("rank 0: 127.0.0.1:" + std::to_string(port) +
                           " (FLATMOE_MASTER_ADDR:FLATMOE_MASTER_PORT) is in use, by another job?"),
            std::string::npos)
      << b0.output;
  auto b1 = start_rank(loopback_rank(port, 1, world, "job B"), 60, 10);
  auto b2 = start_rank(loopback_rank(port, 2, world, "job B"), 60, 10);
  for (const Ended& b : {wait_ended(b1), wait_ended(b2)}) {
    EXPECT_NE(b.exit_code, 0) << b.output;
    EXPECT_NE(b.output.find("refused this rank's job token: another job on this port"), std::string::npos) << b.output;
    EXPECT_FALSE(printed_an_id(b.output)) << "a rank of job B got an id:\n" << b.output;
  }
  expect_fetched(wait_ended(start_rank(loopback_rank(port, 2, world, "job A"), 60, 10)), id_a, "job A's rank 2");

  Ended a = wait_ended(a0);
  EXPECT_EQ(a.exit_code, 0) << a.output;
  size_t refusals = 0;
  for (size_t at = 0; (at = a.output.find("wrong job token", at)) != std::string::npos; at++) refusals++;
  EXPECT_EQ(refusals, 2u) << a.output;
}

// A rank refuses a rank 0 that does not prove the job token, that speaks another version or
// another protocol, or that says nothing; it takes no id from it.
TEST(LaunchRendezvous, RankRefusesAFakeRankZero) {
  struct Case {
    const char* what;
    std::function<void(int fd)> act;  // the fake rank 0, on the accepted connection
    std::string message;              // in the rank's output
  };
  auto challenge = [](int fd, uint32_t version) {
    uint8_t c[RENDEZVOUS_CHALLENGE_BYTES];
    put_be(c, RENDEZVOUS_MAGIC, 4);
    put_be(c + 4, version, 4);
    put_be(c + 8, 42, 8);
    send_bytes(fd, c, sizeof(c));
  };
  const Case cases[] = {
      {"answers without knowing the token",
       [&](int fd) {
         challenge(fd, RENDEZVOUS_VERSION);
         uint8_t hello[RENDEZVOUS_HELLO_BYTES], answer[RENDEZVOUS_ANSWER_BYTES] = {};
         if (!receive(fd, hello, sizeof(hello))) return;
         put_be(answer + 4, rendezvous_proof("a guess", RENDEZVOUS_ANSWER_LABEL, 42, get_be(hello + 16, 8), 1, 2), 8);
         send_bytes(fd, answer, sizeof(answer));
       },
       "did not prove the job token: another job on this port?"},
      {"speaks another version", [&](int fd) { challenge(fd, 7); }, "speaks rendezvous protocol version 7, this rank 2"},
      {"is another program",
       [](int fd) {
         const char banner[] = "SSH-2.0-OpenSSH_9.2p1\r\n";
         send_bytes(fd, (const uint8_t*)banner, sizeof(banner) - 1);
       },
       "is not a flatmoe rank 0"},
      {"says nothing", [](int fd) { read_until_closed(fd); }, "its challenge not through within 1 s of connecting"},
  };
  for (const Case& c : cases) {
    int listener = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(listener, 0) << strerror(errno);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t bytes = sizeof(addr);
    ASSERT_EQ(bind(listener, (sockaddr*)&addr, sizeof(addr)), 0) << strerror(errno);
    ASSERT_EQ(listen(listener, 4), 0) << strerror(errno);
    ASSERT_EQ(getsockname(listener, (sockaddr*)&addr, &bytes), 0) << strerror(errno);
    const int port = ntohs(addr.sin_port);
    auto rank = start_rank(loopback_rank(port, 1, 2, "the real token"), 30, 1);
    int fd = accept(listener, nullptr, nullptr);
    ASSERT_GE(fd, 0) << strerror(errno);
    timeval tv{20, 0};
    EXPECT_EQ(setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)), 0) << strerror(errno);
    c.act(fd);
    Ended ended = wait_ended(rank);
    close(fd);
    close(listener);
    EXPECT_NE(ended.exit_code, 0) << c.what << ": " << ended.output;
    EXPECT_NE(ended.output.find("rank 1: "), std::string::npos) << c.what << ": " << ended.output;
    EXPECT_NE(ended.output.find(c.message), std::string::npos) << c.what << ": " << ended.output;
    EXPECT_FALSE(printed_an_id(ended.output)) << c.what << ": the rank took an id:\n" << ended.output;
  }
}

// Rank 0 listens at FLATMOE_MASTER_ADDR only (another loopback address of the host is refused), and
// refuses to start when that address is not one of its host's.
TEST(LaunchRendezvous, ListensAtItsAddressOnly) {
  const int port = free_tcp_port();
  const ncclUniqueId id = test_id(5);
  auto rank0 = start_rank0(loopback_rank(port, 0, 2, "t"), id, 60, 10);
  int err = 0;
  int fd = connect_to("127.0.0.1", port, 20, &err);  // rank 0 listens now
  ASSERT_GE(fd, 0) << strerror(err);
  close(fd);
  EXPECT_LT(connect_to("127.0.0.2", port, 0, &err), 0) << "rank 0 listens on every address";
  EXPECT_EQ(err, ECONNREFUSED) << strerror(err);
  expect_fetched(wait_ended(start_rank(loopback_rank(port, 1, 2, "t"), 60, 10)), id, "rank 1");
  Ended served = wait_ended(rank0);
  EXPECT_EQ(served.exit_code, 0) << served.output;

  if (read_text_file("/proc/sys/net/ipv4/ip_nonlocal_bind").rfind("1", 0) == 0) {
    printf("[dist] this host binds addresses that are not its own (net.ipv4.ip_nonlocal_bind=1): not checked\n");
    return;
  }
  LaunchEnv elsewhere = loopback_rank(port, 0, 2, "t");
  elsewhere.master_addr = "192.0.2.1";  // TEST-NET-1: no host's address
  Ended refused = wait_ended(start_rank0(elsewhere, id, 60, 10));
  EXPECT_NE(refused.exit_code, 0);
  EXPECT_NE(refused.output.find("FLATMOE_MASTER_ADDR '192.0.2.1' is 192.0.2.1, which is not an address of this host"),
            std::string::npos)
      << refused.output;
}

// Rank 0 waiting for ranks that never come gives up after the timeout, naming the ranks without the
// id (not the ranks that have it, nor the connections that are not ranks).
TEST(LaunchRendezvous, TimeoutNamesTheMissingRanks) {
  const int world = 5, port = free_tcp_port();
  const ncclUniqueId id = test_id(9);
  const auto start = std::chrono::steady_clock::now();
  auto rank0 = start_rank0(loopback_rank(port, 0, world, "t"), id, 4, 10);
  int err = 0;
  int silent = connect_to("127.0.0.1", port, 20, &err);
  ASSERT_GE(silent, 0) << strerror(err);
  int stranger = connect_to("127.0.0.1", port, 20, &err);
  ASSERT_GE(stranger, 0) << strerror(err);
  EXPECT_EQ(hello_and_status(stranger, RENDEZVOUS_VERSION, 2, world, "another token"),
            (int)RendezvousStatus::WrongToken);
  close(stranger);
  for (int r : {1, 3}) expect_fetched(wait_ended(start_rank(loopback_rank(port, r, world, "t"), 60, 10)), id, "rank");
  Ended ended = wait_ended(rank0);
  close(silent);
  EXPECT_NE(ended.exit_code, 0) << ended.output;
  EXPECT_NE(ended.output.find("rank 0: after 4 s (FLATMOE_COMM_TIMEOUT_S) at 127.0.0.1:" + std::to_string(port) +
                              ", ranks [2 4] of 5 had not fetched the NCCL id (1 connection(s) dropped, see above)"),
            std::string::npos)
      << ended.output;
  EXPECT_LT(seconds_since(start), 10);
  EXPECT_EQ(rank_ranges({1, 2, 3, 5, 7, 8}), "1-3 5 7-8");
}

// A rank whose rank 0 never listens gives up after the timeout, naming where it looked.
TEST(LaunchRendezvous, RankTimesOutWithoutRankZero) {
  const int port = free_tcp_port();
  const auto start = std::chrono::steady_clock::now();
  Ended ended = wait_ended(start_rank(loopback_rank(port, 1, 2, "t"), 1, 10));
  EXPECT_NE(ended.exit_code, 0);
  EXPECT_NE(ended.output.find("rank 1: could not connect to rank 0 at 127.0.0.1:" + std::to_string(port) +
                              " within 1 s (FLATMOE_COMM_TIMEOUT_S): Connection refused"),
            std::string::npos)
      << ended.output;
  EXPECT_LT(seconds_since(start), 10);
}

// Three processes on 127.0.0.1 started as mpirun would start them, through launch(); rank 0 comes
// last, so the others must retry. Every rank must come out with its own rank and the same NCCL id.
TEST(LaunchRendezvous, ThreeProcessesOnLoopback) {
  const int world = 3;
  const int port = free_tcp_port();
  std::vector<std::pair<pid_t, int>> procs(world);
  for (int r = world - 1; r >= 0; r--) {
    procs[r] = fork_capturing([&] {
      for (const std::string& var : rank_variable_names()) unsetenv(var.c_str());
      setenv("OMPI_COMM_WORLD_RANK", std::to_string(r).c_str(), 1);
      setenv("OMPI_COMM_WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(r).c_str(), 1);
      setenv("FLATMOE_MASTER_ADDR", "127.0.0.1", 1);
      setenv("FLATMOE_MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("FLATMOE_JOB_TOKEN", "three processes", 1);
      LaunchInfo info = launch(0, nullptr, 1);
      printf("info %d %d %d %s\n", info.rank, info.world, info.local_rank, nccl_id_to_hex(info.id).c_str());
    });
    if (r == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
  }
  std::vector<std::string> ids(world);
  for (int r = 0; r < world; r++) {
    Ended ended = wait_ended(procs[r]);
    EXPECT_EQ(ended.exit_code, 0) << "rank " << r << ": " << ended.output;
    int rank = -1, got_world = -1, local = -1;
    char hex[2 * NCCL_UNIQUE_ID_BYTES + 1] = {0};
    size_t at = ended.output.find("info ");
    ASSERT_NE(at, std::string::npos) << "rank " << r << " printed: " << ended.output;
    ASSERT_EQ(sscanf(ended.output.c_str() + at, "info %d %d %d %256s", &rank, &got_world, &local, hex), 4)
        << ended.output;
    EXPECT_EQ(rank, r);
    EXPECT_EQ(got_world, world);
    EXPECT_EQ(local, r);
    ids[r] = hex;
  }
  EXPECT_EQ(ids[0], ids[1]);
  EXPECT_EQ(ids[0], ids[2]);
  EXPECT_NE(ids[0], std::string(2 * NCCL_UNIQUE_ID_BYTES, '0'));
}

// ---------------------------------------------------------------------------------------------
// Our launcher stopping the job

// Rank 1 exits (status 3) while rank 0 waits. The launcher must stop rank 0 and exit with status 3,
// naming rank 1. The job's ranks see no GPU (host-only, so that this runs on any machine; the
// CommFailure tests stop ranks that wait inside a collective).
TEST(DistScenario, DISABLED_RankExitsWhileOthersWait) {
  if (test_rank() == 1) _exit(3);
  std::this_thread::sleep_for(std::chrono::seconds(600));
}

TEST(Launcher, StopsTheJobWhenARankExits) {
  if (test_rank() != 0) return others_wait_for_rank_zero();  // rank 0 runs the sub-job
  JobResult job = run_scenario_job("RankExitsWhileOthersWait", 2, {"CUDA_VISIBLE_DEVICES="});
  EXPECT_EQ(job.exit_code, 3);
  EXPECT_LT(job.seconds, 60);
  expect_contains(job, "flatmoe launch: rank 1 (pid ");
  expect_contains(job, ") exited with status 3; stopping the other 1 rank(s)");
  expect_contains(job, "[  FAILED  ] rank 1 did not finish");
}

// While rank 0 alone runs a test's sub-jobs, the other ranks wait on the host until its body has ended (not in a
// collective of the next test): rank 0 leaves a marker after a pause, and a rank that went on before then finds
// none. The marker is named after the launcher's pid, one per run.
TEST(RankZeroJobs, OthersWaitOnTheHostUntilRankZeroEnds) {
  if (!test_rank_of_our_launcher())
    GTEST_SKIP() << "needs the ranks of test_dist's own launcher (FLATMOE_TEST_WORLD >= 2)";
  const std::string marker = test_log_dir() + "/rank0_body_ended_" + std::to_string(getppid());
  if (test_rank() != 0) {
    auto start = std::chrono::steady_clock::now();
    others_wait_for_rank_zero();
    EXPECT_EQ(access(marker.c_str(), F_OK), 0) << "rank " << test_rank() << " went on after "
                                               << seconds_since(start) << " s, before rank 0's body ended";
    return;
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  FILE* file = fopen(marker.c_str(), "w");
  ASSERT_NE(file, nullptr) << marker << ": " << strerror(errno);
  fclose(file);
}

// A run split into GoogleTest shards (`tests/gpu.sh dist` with DIST_SHARD) starts its sub-jobs unsplit: a
// sub-job of one scenario that inherited shard 1 of 2 would run no test and exit 0.
TEST(Launcher, SubJobsRunTheirScenarioInAShardedRun) {
  if (test_rank() != 0) return others_wait_for_rank_zero();  // rank 0 runs the sub-job
  std::map<std::string, std::string> saved;  // this run's own sharding, put back afterwards
  for (const std::string& var : gtest_shard_variable_names())
    if (const char* value = getenv(var.c_str())) saved[var] = value;
  setenv("GTEST_TOTAL_SHARDS", "2", 1);
  setenv("GTEST_SHARD_INDEX", "1", 1);
  JobResult job = run_scenario_job("RankExitsWhileOthersWait", 2, {"CUDA_VISIBLE_DEVICES="});
  for (const std::string& var : gtest_shard_variable_names()) {
    if (saved.count(var)) setenv(var.c_str(), saved[var].c_str(), 1);
    else unsetenv(var.c_str());
  }
  EXPECT_EQ(job.exit_code, 3) << "the scenario did not run: the sub-job took this run's shard\n" << job.output;
}

// The scenarios' ranks write "PID PGID" to LOGDIR/rankR.pid (LOGDIR: the scenario's folder), whole or
// not at all, for the test that stops them.
void write_rank_pid_file() {
  const std::string path = test_log_dir() + "/rank" + std::to_string(test_rank()) + ".pid";
  FILE* f = fopen((path + ".partial").c_str(), "w");
  ASSERT_NE(f, nullptr) << path << ": " << strerror(errno);
  fprintf(f, "%d %d\n", (int)getpid(), (int)getpgrp());
  ASSERT_EQ(fclose(f), 0) << strerror(errno);
  ASSERT_EQ(rename((path + ".partial").c_str(), path.c_str()), 0) << strerror(errno);
}

TEST(DistScenario, DISABLED_RanksSleepUntilStopped) {
  write_rank_pid_file();
  std::this_thread::sleep_for(std::chrono::seconds(600));
}

TEST(DistScenario, DISABLED_RankOneIgnoresSigterm) {
  if (test_rank() == 1) ASSERT_NE(signal(SIGTERM, SIG_IGN), SIG_ERR) << strerror(errno);
  write_rank_pid_file();
  std::this_thread::sleep_for(std::chrono::seconds(600));
}

// Our launcher (run_local_ranks) of `world` ranks running scenario DistScenario.DISABLED_<name> without
// a GPU, in a forked process that leads its own process group as a shell's job does; its output in
// LOGDIR/dist_scenario_<name>/launcher.out.
struct LauncherJob {
  pid_t pid = -1;
  std::string dir;
  std::string output() const { return read_text_file(dir + "/launcher.out"); }
};

LauncherJob start_launcher(const std::string& name, int world, double stop_grace_s) {
  LauncherJob job;
  job.dir = test_log_dir() + "/dist_scenario_" + name;
  make_test_dirs(job.dir);
  for (int r = 0; r < world; r++) remove((job.dir + "/rank" + std::to_string(r) + ".pid").c_str());
  const std::string out_path = job.dir + "/launcher.out";
  std::vector<std::string> args = {"test_dist", "--gtest_filter=DistScenario.DISABLED_" + name,
                                   "--gtest_also_run_disabled_tests"};
  fflush(stdout);
  fflush(stderr);
  job.pid = fork();
  if (job.pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);  // ends with this test (and the ranks with it)
    setpgid(0, 0);
    int out = open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (out < 0 || dup2(out, STDOUT_FILENO) < 0 || dup2(out, STDERR_FILENO) < 0) _exit(126);
    setenv("CUDA_VISIBLE_DEVICES", "", 1);
    setenv("FLATMOE_TEST_LOG_DIR", job.dir.c_str(), 1);
    for (const std::string& var : gtest_shard_variable_names()) unsetenv(var.c_str());
    std::vector<char*> argv = exec_array(args);
    _exit(run_local_ranks((int)args.size(), argv.data(), world, stop_grace_s));
  }
  EXPECT_GT(job.pid, 0) << strerror(errno);
  EXPECT_EQ(setpgid(job.pid, job.pid), 0) << strerror(errno);  // also here: in its group before the test signals it
  return job;
}

// Each rank's {pid, process group} once all have written them (within 60 s; empty if not).
std::vector<std::pair<pid_t, pid_t>> wait_for_rank_pids(const LauncherJob& job, int world) {
  const auto start = std::chrono::steady_clock::now();
  while (seconds_since(start) < 60) {
    std::vector<std::pair<pid_t, pid_t>> ranks;
    for (int r = 0; r < world; r++) {
      int pid = 0, pgid = 0;
      if (sscanf(read_text_file(job.dir + "/rank" + std::to_string(r) + ".pid").c_str(), "%d %d", &pid, &pgid) == 2)
        ranks.push_back({pid, pgid});
    }
    if ((int)ranks.size() == world) return ranks;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  ADD_FAILURE() << "the ranks did not start within 60 s:\n" << job.output();
  return {};
}

// The launcher's exit code once it has exited; after 60 s it is killed (its ranks follow it:
// PR_SET_PDEATHSIG) and the test fails.
int wait_launcher_exit(const LauncherJob& job) {
  const auto start = std::chrono::steady_clock::now();
  int status = 0;
  for (;;) {
    pid_t got = waitpid(job.pid, &status, WNOHANG);
    if (got == job.pid) return exit_code_of(status);
    EXPECT_EQ(got, 0) << strerror(errno);
    if (got < 0) return -1;
    if (seconds_since(start) > 60) {
      kill(job.pid, SIGKILL);
      waitpid(job.pid, &status, 0);
      ADD_FAILURE() << "the launcher did not exit within 60 s:\n" << job.output();
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool process_gone(pid_t pid) { return kill(pid, 0) != 0 && errno == ESRCH; }

// SIGINT to the launcher's process group (a terminal's Ctrl-C), SIGTERM and SIGHUP to the launcher:
// each reaches the ranks (which lead their own process groups) as the launcher's SIGTERM, and the
// launcher exits with 128 + the signal once they are gone, within seconds.
TEST(Launcher, ForwardsSignalsToTheRanks) {
  if (test_rank() != 0) return others_wait_for_rank_zero();  // rank 0 runs the sub-jobs
  struct Case {
    int sig;
    bool to_group;
    const char* message;
  };
  const Case cases[] = {{SIGINT, true, "flatmoe launch: received SIGINT; stopping 2 rank(s)"},
                        {SIGTERM, false, "flatmoe launch: received SIGTERM; stopping 2 rank(s)"},
                        {SIGHUP, false, "flatmoe launch: received SIGHUP; stopping 2 rank(s)"}};
  for (const Case& c : cases) {
    LauncherJob job = start_launcher("RanksSleepUntilStopped", 2, RANK_STOP_GRACE_S);
    auto ranks = wait_for_rank_pids(job, 2);
    ASSERT_EQ(ranks.size(), 2u);
    for (auto [pid, pgid] : ranks) {
      EXPECT_EQ(pgid, pid) << "a rank leads its own process group";
      EXPECT_NE(pgid, job.pid) << "a rank is in the launcher's process group";
    }
    const auto start = std::chrono::steady_clock::now();
    ASSERT_EQ(kill(c.to_group ? -job.pid : job.pid, c.sig), 0) << strerror(errno);
    const int exit_code = wait_launcher_exit(job);
    const double seconds = seconds_since(start);
    const std::string output = job.output();
    EXPECT_EQ(exit_code, 128 + c.sig) << output;
    EXPECT_LT(seconds, 5) << "the ranks should stop at the launcher's SIGTERM, long before the SIGKILL";
    EXPECT_NE(output.find(c.message), std::string::npos) << output;
    EXPECT_EQ(output.find("SIGKILL"), std::string::npos) << output;
    for (auto [pid, pgid] : ranks) EXPECT_TRUE(process_gone(pid)) << "rank pid " << pid << " outlived the launcher";
    printf("[dist] %s: the launcher exited %.2f s after the signal\n", strsignal(c.sig), seconds);
  }
}

// A rank that ignores SIGTERM gets SIGKILL after the grace (1 s here); the launcher still exits with
// 128 + SIGTERM.
TEST(Launcher, KillsARankThatIgnoresSigterm) {
  if (test_rank() != 0) return others_wait_for_rank_zero();  // rank 0 runs the sub-job
  LauncherJob job = start_launcher("RankOneIgnoresSigterm", 2, 1.0);
  auto ranks = wait_for_rank_pids(job, 2);
  ASSERT_EQ(ranks.size(), 2u);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(job.pid, SIGTERM), 0) << strerror(errno);
  const int exit_code = wait_launcher_exit(job);
  const double seconds = seconds_since(start);
  const std::string output = job.output();
  EXPECT_EQ(exit_code, 128 + SIGTERM) << output;
  EXPECT_GE(seconds, 0.9) << output;
  EXPECT_LT(seconds, 6) << output;
  EXPECT_NE(output.find("flatmoe launch: received SIGTERM; stopping 2 rank(s)"), std::string::npos) << output;
  EXPECT_NE(output.find("flatmoe launch: rank 1 (pid " + std::to_string(ranks[1].first) +
                        ") did not stop within 1 s of SIGTERM: SIGKILL"),
            std::string::npos)
      << output;
  EXPECT_EQ(output.find("rank 0 (pid"), std::string::npos) << "rank 0 stops at SIGTERM:\n" << output;
  for (auto [pid, pgid] : ranks) EXPECT_TRUE(process_gone(pid)) << "rank pid " << pid << " outlived the launcher";
}

// A second signal while the ranks stop sends SIGKILL at once, without waiting for the grace (60 s
// here); the exit code stays the first signal's.
TEST(Launcher, SecondSignalKillsAtOnce) {
  if (test_rank() != 0) return others_wait_for_rank_zero();  // rank 0 runs the sub-job
  LauncherJob job = start_launcher("RankOneIgnoresSigterm", 2, 60);
  auto ranks = wait_for_rank_pids(job, 2);
  ASSERT_EQ(ranks.size(), 2u);
  const auto start = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(job.pid, SIGTERM), 0) << strerror(errno);
  while (!process_gone(ranks[0].first) && seconds_since(start) < 5)  // rank 0 stops; rank 1 ignores it
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(kill(-job.pid, SIGINT), 0) << strerror(errno);
  const int exit_code = wait_launcher_exit(job);
  const std::string output = job.output();
  EXPECT_EQ(exit_code, 128 + SIGTERM) << output;
  EXPECT_LT(seconds_since(start), 10) << output;
  EXPECT_NE(output.find("flatmoe launch: received SIGINT while stopping: SIGKILL to 1 rank(s)"), std::string::npos)
      << output;
  for (auto [pid, pgid] : ranks) EXPECT_TRUE(process_gone(pid)) << "rank pid " << pid << " outlived the launcher";
}

}  // namespace
