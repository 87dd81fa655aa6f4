// comm.cuh — the communication layer of the multi-GPU runtime (notes/design.md §5): NCCL communicators over
// the world's W ranks (one process per GPU) and over sub-groups of them, the collectives the model
// uses, and waits that cannot hang.
//
// Communicators: comm_world_init makes the world communicator from a LaunchInfo (runtime/launch.cuh);
// sub-groups ("ep", "dp", "vocab", ...) are NCCL splits of it, usually contiguous blocks of ranks
// (comm_block_group: group index = world.rank / size, rank within = world.rank % size).
// Every communicator is non-blocking (ncclConfig_t blocking = 0): an NCCL call may return
// ncclInProgress, and the communicator is then polled with ncclCommGetAsyncError until it is ready.
//
// Streams: each communicator owns a non-blocking stream of the highest priority (Comm::stream), so
// that two communicators can move data at the same time as the compute stream works
// (runtime/stream.cuh: events between streams, the pool's free_after for buffers whose last user is
// a communicator's stream). Collectives take the
// stream they run on; the model's serial path passes its compute stream, an overlapping schedule the
// communicator's own. Communicators that overlap cannot deadlock against each other as long as every
// rank issues their calls in one fixed order — also the calls that move nothing (a count of 0 still
// enters all_to_all_v's group; the schedules issue every chunk's exchange, empty or not). Each new
// communicator is warmed up before it is returned (comm_warm_up: NCCL connects peers lazily, on first
// use; connecting inside an overlapped schedule would stall it).
//
// Failures. Collectives are enqueued and return without waiting for the GPU. Every wait — creation,
// calls in progress, comm_sync, and every stream_wait of the process — gives up after
// FLATMOE_COMM_TIMEOUT_S seconds (default 600) and watches the asynchronous errors of EVERY live
// communicator (the wait watcher installed here). Any failure — an NCCL error code, an asynchronous
// NCCL error, a CUDA error on the stream, a timeout, invalid arguments — prints one line
//   flatmoe: rank R (group NAME): OP failed: WHY [sizes]
// (R is the world rank); any failure of the process (also fm_fail's, the pool's) then aborts every
// live communicator, naming them, and exits non-zero: the other ranks' collectives with this one stop,
// their own waits fail, and the launcher stops the job instead of leaving ranks waiting forever.
//
// Types: float, __nv_bfloat16, int (and long long, used by all_to_all_host); counts in elements.
// A count of 0 returns at once (every rank of the group passes the same count).
// NVLink multicast (NVLS) stays off: NCCL_NVLS_ENABLE is set to 0 before the first NCCL call when it
// is unset, and any other value is refused.
// Memory: all_to_all_host, comm_split and comm_warm_up stage a few integers in pool buffers
// (CommStaging), freed before they return; nothing else here allocates device memory.
#pragma once
#include <nccl.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include "check.cuh"
#include "launch.cuh"
#include "pool.cuh"
#include "stream.cuh"

// One NCCL communicator over a subset of the world's ranks.
struct Comm {
  ncclComm_t nccl = nullptr;
  int rank = 0, size = 1;         // this process's index in the group, group size
  std::string name;               // "world", "ep", "dp", "vocab", ... (named in every error message)
  cudaStream_t stream = nullptr;  // its own non-blocking stream (comm_destroy destroys it)
};


// ---------------------------------------------------------------------------------------------
// Failures


// Every communicator of this process that is not destroyed yet: what a failure aborts and what
// every wait watches.
struct LiveComm {
  ncclComm_t nccl;
  std::string name;
};
inline std::vector<LiveComm>& live_comms() {
  static std::vector<LiveComm> comms;
  return comms;
}

// The failure hook (runtime/check.cuh): aborts every live communicator, naming them, so that NCCL's
// kernels and threads stop and the other ranks' collectives with this one fail at once. An abort can
// itself wait for the GPU (NCCL frees pinned memory, which waits for a kernel that waits for a rank
// that is gone), so the aborts run on a thread of their own and the process leaves after at most
// FAILURE_ABORT_WAIT_S whether they finished or not; the other ranks then stop in their own bounded waits.
constexpr double FAILURE_ABORT_WAIT_S = 5;

inline void comm_abort_all() {
  std::vector<LiveComm> comms;
  comms.swap(live_comms());
  if (comms.empty()) return;
  std::string names;
  for (const LiveComm& c : comms) names += (names.empty() ? "" : ", ") + c.name;
  fprintf(stderr, "flatmoe: rank %d: aborting %zu communicator(s): %s\n", comm_process_rank(), comms.size(),
          names.c_str());
  fflush(stderr);
  static std::atomic<bool> aborted{false};
  std::thread([comms] {
    for (const LiveComm& c : comms) ncclCommAbort(c.nccl);  // results unchecked: the process is leaving either way
    aborted = true;
  }).detach();
  const auto start = std::chrono::steady_clock::now();
  while (!aborted && std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < FAILURE_ABORT_WAIT_S)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  if (!aborted)
    fprintf(stderr, "flatmoe: rank %d: the aborts did not finish within %.0f s (a kernel still waits for a rank that is "
            "gone); leaving without them\n", comm_process_rank(), FAILURE_ABORT_WAIT_S);
}

// The wait watcher (runtime/stream.cuh): the first live communicator with an asynchronous error.
inline std::string comm_watch_all() {
  for (const LiveComm& c : live_comms()) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(c.nccl, &state);
    if (r != ncclSuccess) return "group " + c.name + ": ncclCommGetAsyncError: " + nccl_why(r, c.nccl);
    if (state != ncclSuccess && state != ncclInProgress) return "group " + c.name + ": " + nccl_why(state, c.nccl);
  }
  return "";
}

inline void comm_register(const Comm& c) {
  failure_hook() = comm_abort_all;
  wait_watcher() = comm_watch_all;
  live_comms().push_back(LiveComm{c.nccl, c.name});
}

inline void comm_unregister(ncclComm_t nccl) {
  std::vector<LiveComm>& comms = live_comms();
  comms.erase(std::remove_if(comms.begin(), comms.end(), [&](const LiveComm& c) { return c.nccl == nccl; }), comms.end());
}

// Prints the failure, aborts every live communicator (this one included) and exits non-zero.
[[noreturn]] inline void comm_fail(const Comm& c, const char* op, const std::string& why) {
  fprintf(stderr, "flatmoe: rank %d (group %s): %s failed: %s\n", comm_process_rank(), c.name.c_str(), op, why.c_str());
  fflush(nullptr);
  const std::vector<LiveComm>& live = live_comms();
  const bool registered = std::any_of(live.begin(), live.end(), [&](const LiveComm& l) { return l.nccl == c.nccl; });
  if (c.nccl != nullptr && !registered) comm_register(c);  // its creation failed before it was registered
  fm_exit_failure();
}

// Waits until the communicator has no call in progress. Returns "" when it is ready, else why not.
inline std::string comm_wait_ready(ncclComm_t nccl) {
  WatchedWait watched("a wait for an NCCL call in progress");
  const auto start = std::chrono::steady_clock::now();
  for (;;) {
    ncclResult_t state = ncclSuccess;
    ncclResult_t r = ncclCommGetAsyncError(nccl, &state);
    if (r != ncclSuccess) return "ncclCommGetAsyncError: " + nccl_why(r, nccl);
    if (state == ncclSuccess) return "";
    if (state != ncclInProgress) return nccl_why(state, nccl);
    double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (waited > comm_timeout_s())
      return comm_format("timed out: still in progress after %.0f s (FLATMOE_COMM_TIMEOUT_S): a rank is missing or stuck",
                         waited);
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// Checks the result of an NCCL call on communicator c: waits while it is in progress, fails on an error.
// The sizes (printf format) are named in the message.
__attribute__((format(printf, 4, 5))) inline void comm_check(const Comm& c, ncclResult_t result, const char* op,
                                                           const char* fmt, ...) {
  std::string why;
  if (result == ncclInProgress) why = comm_wait_ready(c.nccl);
  else if (result != ncclSuccess) why = nccl_why(result, c.nccl);
  if (why.empty()) return;
  va_list ap;
  va_start(ap, fmt);
  std::string sizes = fm_format(fmt, ap);
  va_end(ap);
  comm_fail(c, op, why + " [" + sizes + "]");
}

inline void comm_cuda_check(const Comm& c, cudaError_t err, const char* op, const std::string& what) {
  if (err != cudaSuccess) comm_fail(c, op, "CUDA error in " + what + ": " + cudaGetErrorString(err));
}

// ---------------------------------------------------------------------------------------------
// Waiting for a stream

// Waits for `stream` while watching every communicator's asynchronous errors (stream_wait_why); fails
// naming c on an NCCL error, a CUDA error or the timeout (a rank that stopped, or ranks that called
// collectives in different orders).
inline void comm_sync(const Comm& c, cudaStream_t stream, const char* op) {
  std::string why = stream_wait_why(stream);
  if (!why.empty()) comm_fail(c, op, why);
}

// ---------------------------------------------------------------------------------------------
// Collectives (enqueued on `stream`, no host synchronisation)

template <typename T> struct NcclType;
template <> struct NcclType<float> {
  static constexpr ncclDataType_t value = ncclFloat32;
  static constexpr const char* name = "float";
};
template <> struct NcclType<__nv_bfloat16> {
  static constexpr ncclDataType_t value = ncclBfloat16;
  static constexpr const char* name = "bf16";
};
template <> struct NcclType<int> {
  static constexpr ncclDataType_t value = ncclInt32;
  static constexpr const char* name = "int";
};
template <> struct NcclType<long long> {
  static constexpr ncclDataType_t value = ncclInt64;
  static constexpr const char* name = "int64";
};

// recv[i] = Σ_ranks send[i]  (recv may equal send: in place)
template <typename T>
inline void all_reduce_sum(const Comm& c, const T* send, T* recv, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  comm_check(c, ncclAllReduce(send, recv, count, NcclType<T>::value, ncclSum, c.nccl, stream), "all_reduce",
             "count=%zu type=%s ranks=%d", count, NcclType<T>::name, c.size);
}

// recv[i] = Σ_ranks send[rank·count + i]: send holds count·size elements, recv count.
template <typename T>
inline void reduce_scatter_sum(const Comm& c, const T* send, T* recv, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  comm_check(c, ncclReduceScatter(send, recv, count, NcclType<T>::value, ncclSum, c.nccl, stream), "reduce_scatter",
             "count=%zu per rank type=%s ranks=%d", count, NcclType<T>::name, c.size);
}

// recv[s·count + i] = send of rank s [i]: send holds count elements, recv count·size.
template <typename T>
inline void all_gather(const Comm& c, const T* send, T* recv, size_t count, cudaStream_t stream) {
  if (count == 0) return;
  comm_check(c, ncclAllGather(send, recv, count, NcclType<T>::value, c.nccl, stream), "all_gather",
             "count=%zu per rank type=%s ranks=%d", count, NcclType<T>::name, c.size);
}

// All-to-all-v over rows of row_elems elements: send holds send_rows[d] rows for each destination
// d = 0..size-1 in order; recv gets recv_rows[s] rows from each source s in order. One NCCL group of
// ncclSend/ncclRecv (empty pairs are left out; a rank with nothing to move still enters the group).
// The caller guarantees send_rows[d] on rank s == recv_rows[s] on rank d.
template <typename T>
inline void all_to_all_v(const Comm& c, const T* send, const std::vector<long long>& send_rows, T* recv,
                         const std::vector<long long>& recv_rows, size_t row_elems, cudaStream_t stream) {
  if ((int)send_rows.size() != c.size || (int)recv_rows.size() != c.size)
    comm_fail(c, "all_to_all_v",
              comm_format("send_rows has %zu entries and recv_rows %zu; the group has %d ranks", send_rows.size(),
                          recv_rows.size(), c.size));
  for (int r = 0; r < c.size; r++)
    if (send_rows[r] < 0 || recv_rows[r] < 0)
      comm_fail(c, "all_to_all_v",
                comm_format("negative row count for rank %d: send %lld, recv %lld", r, send_rows[r], recv_rows[r]));
  comm_check(c, ncclGroupStart(), "all_to_all_v", "ncclGroupStart");
  size_t offset = 0;
  for (int d = 0; d < c.size; d++) {
    size_t n = (size_t)send_rows[d] * row_elems;
    if (n > 0)
      comm_check(c, ncclSend(send + offset, n, NcclType<T>::value, d, c.nccl, stream), "all_to_all_v",
                 "ncclSend to rank %d: %lld rows of %zu type=%s", d, send_rows[d], row_elems, NcclType<T>::name);
    offset += n;
  }
  offset = 0;
  for (int s = 0; s < c.size; s++) {
    size_t n = (size_t)recv_rows[s] * row_elems;
    if (n > 0)
      comm_check(c, ncclRecv(recv + offset, n, NcclType<T>::value, s, c.nccl, stream), "all_to_all_v",
                 "ncclRecv from rank %d: %lld rows of %zu type=%s", s, recv_rows[s], row_elems, NcclType<T>::name);
    offset += n;
  }
  comm_check(c, ncclGroupEnd(), "all_to_all_v", "ncclGroupEnd, row_elems=%zu type=%s ranks=%d", row_elems,
             NcclType<T>::name, c.size);
}

// Ring: send `send_count` elements to (rank+1) % size and receive `recv_count` from (rank−1+size) %
// size (each rank's send_count is its right neighbour's recv_count; a count of 0 is left out).
template <typename T>
inline void ring_send_recv(const Comm& c, const T* send, size_t send_count, T* recv, size_t recv_count,
                           cudaStream_t stream) {
  if (send_count == 0 && recv_count == 0) return;
  int next = (c.rank + 1) % c.size, prev = (c.rank - 1 + c.size) % c.size;
  comm_check(c, ncclGroupStart(), "ring_send_recv", "ncclGroupStart");
  if (send_count > 0)
    comm_check(c, ncclSend(send, send_count, NcclType<T>::value, next, c.nccl, stream), "ring_send_recv",
               "ncclSend to rank %d count=%zu type=%s", next, send_count, NcclType<T>::name);
  if (recv_count > 0)
    comm_check(c, ncclRecv(recv, recv_count, NcclType<T>::value, prev, c.nccl, stream), "ring_send_recv",
               "ncclRecv from rank %d count=%zu type=%s", prev, recv_count, NcclType<T>::name);
  comm_check(c, ncclGroupEnd(), "ring_send_recv", "ncclGroupEnd send=%zu recv=%zu type=%s ranks=%d", send_count,
             recv_count, NcclType<T>::name, c.size);
}

// The same `count` both ways.
template <typename T>
inline void ring_send_recv(const Comm& c, const T* send, T* recv, size_t count, cudaStream_t stream) {
  ring_send_recv(c, send, count, recv, count, stream);
}

// One message of a point-to-point group: `count` elements to or from rank `peer`.
template <typename T>
struct PeerMessage {
  T* data;
  size_t count;
  int peer;
};

// Any set of sends and receives in one NCCL group (e.g. an expert's weights lent to a helper rank and
// its weight gradient returned). Every rank of the group calls it, also with both lists empty; a
// rank's sends to a peer are matched with that peer's receives from it in list order.
template <typename T>
inline void point_to_point(const Comm& c, const std::vector<PeerMessage<const T>>& sends,
                           const std::vector<PeerMessage<T>>& recvs, cudaStream_t stream) {
  const char* op = "point_to_point";
  comm_check(c, ncclGroupStart(), op, "ncclGroupStart");
  for (const PeerMessage<const T>& m : sends)
    if (m.count > 0)
      comm_check(c, ncclSend(m.data, m.count, NcclType<T>::value, m.peer, c.nccl, stream), op,
                 "ncclSend to rank %d count=%zu type=%s", m.peer, m.count, NcclType<T>::name);
  for (const PeerMessage<T>& m : recvs)
    if (m.count > 0)
      comm_check(c, ncclRecv(m.data, m.count, NcclType<T>::value, m.peer, c.nccl, stream), op,
                 "ncclRecv from rank %d count=%zu type=%s", m.peer, m.count, NcclType<T>::name);
  comm_check(c, ncclGroupEnd(), op, "ncclGroupEnd sends=%zu recvs=%zu type=%s ranks=%d", sends.size(), recvs.size(),
             NcclType<T>::name, c.size);
}

// Exchange of host-side integers: send[d·per_dest + i] goes to rank d; returns recv[s·per_dest + i]
// from rank s. Synchronises `stream` (the counts are needed on the host to size buffers).
inline std::vector<long long> all_to_all_host(const Comm& c, const std::vector<long long>& send, int per_dest,
                                              cudaStream_t stream) {
  if (per_dest < 0 || send.size() != (size_t)c.size * per_dest)
    comm_fail(c, "all_to_all_host",
              comm_format("send has %zu entries, expected %d ranks x per_dest %d", send.size(), c.size, per_dest));
  std::vector<long long> recv(send.size());
  if (recv.empty()) return recv;
  DeviceBuffer<long long> send_dev(send.size(), Mem::CommStaging, "all_to_all_host.send");
  DeviceBuffer<long long> recv_dev(recv.size(), Mem::CommStaging, "all_to_all_host.recv");
  copy_to_device(send_dev.ptr, send.data(), send_dev.bytes(), stream, "all_to_all_host");
  std::vector<long long> rows(c.size, per_dest);
  all_to_all_v(c, send_dev.ptr, rows, recv_dev.ptr, rows, 1, stream);
  comm_sync(c, stream, "all_to_all_host");
  copy_to_host(recv.data(), recv_dev.ptr, recv_dev.bytes(), stream, "all_to_all_host");
  return recv;
}

// ---------------------------------------------------------------------------------------------
// Communicators

// Connects every pair of ranks and every collective's channels of a new communicator before it is
// used: an all-to-all of one int between every pair, an all-reduce, a reduce-scatter and an
// all-gather, on its own stream; checks what came back. NCCL makes these connections lazily, on first
// use: made here, no later exchange pays for them inside an overlapped schedule.
inline void comm_warm_up(const Comm& c) {
  if (c.size == 1) return;
  const int W = c.size;
  // up: [W] to rank d: my rank·W + d | [W] ones | [1] my rank
  std::vector<int> up(2 * W + 1, 1);
  for (int d = 0; d < W; d++) up[d] = c.rank * W + d;
  up[2 * W] = c.rank;
  DeviceBuffer<int> sent(up.size(), Mem::CommStaging, "comm_warm_up.sent");
  // down: [W] from rank s: s·W + my rank | [1] W·W | [W] the ranks
  DeviceBuffer<int> got(2 * W + 1, Mem::CommStaging, "comm_warm_up.got");
  copy_to_device(sent.ptr, up.data(), sent.bytes(), c.stream, "comm_warm_up");
  const std::vector<long long> one_row(W, 1);
  all_to_all_v(c, sent.ptr, one_row, got.ptr, one_row, 1, c.stream);
  all_reduce_sum(c, sent.ptr + W, sent.ptr + W, W, c.stream);    // every one becomes W
  reduce_scatter_sum(c, sent.ptr + W, got.ptr + W, 1, c.stream);  // W·W
  all_gather(c, sent.ptr + 2 * W, got.ptr + W + 1, 1, c.stream);
  std::vector<int> down(got.count);
  comm_sync(c, c.stream, "comm_warm_up");
  copy_to_host(down.data(), got.ptr, got.bytes(), c.stream, "comm_warm_up");
  for (int r = 0; r < W; r++)
    if (down[r] != r * W + c.rank || down[W + 1 + r] != r)
      comm_fail(c, "comm_warm_up",
                comm_format("rank %d: received %d and gathered %d, expected %d and %d", r, down[r], down[W + 1 + r],
                            r * W + c.rank, r));
  if (down[W] != W * W) comm_fail(c, "comm_warm_up", comm_format("reduce-scatter gave %d, expected %d", down[W], W * W));
}

// After its NCCL communicator is ready: registers c (every wait watches it, every failure aborts it),
// makes its stream and warms it up.
inline void comm_finish_init(Comm& c, const char* op) {
  comm_register(c);
  c.stream = stream_create(op, StreamPriority::Comm);
  comm_warm_up(c);
  device_memory_mark("NCCL " + c.name);  // its buffers, connected by the warm-up (the device ledger, runtime/pool.cuh)
}

// The world communicator: cudaSetDevice(rank_device(info)) (runtime/launch.cuh), then a non-blocking
// NCCL communicator over info.world ranks (a world of 1 makes its own NCCL id), warmed up.
inline Comm comm_world_init(const LaunchInfo& info) {
  comm_set_nccl_env();
  comm_process_rank() = info.rank;
  Comm world;
  world.rank = info.rank;
  world.size = info.world;
  world.name = "world";
  if (info.world < 1 || info.rank < 0 || info.rank >= info.world)
    comm_fail(world, "comm_world_init", comm_format("invalid rank %d of world %d", info.rank, info.world));
  const int device = rank_device(info);
  comm_cuda_check(world, cudaSetDevice(device), "comm_world_init", comm_format("cudaSetDevice(%d)", device));
  if (device_memory().items.empty()) device_memory_mark("CUDA context");
  ncclUniqueId id = info.id;
  if (info.world == 1) comm_check(world, ncclGetUniqueId(&id), "comm_world_init", "ncclGetUniqueId, world=1");
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  comm_check(world, ncclCommInitRankConfig(&world.nccl, info.world, id, info.rank, &config), "comm_world_init",
             "ncclCommInitRankConfig rank=%d world=%d device=%d", info.rank, info.world, device);
  comm_finish_init(world, "comm_world_init");
  return world;
}

// Every rank's `count` host values, rank by rank ([c.size · count]), on every rank: one all-gather over
// `c` on its stream, waited for. `tag` names it in the pool and in errors.
template <typename T>
inline std::vector<T> all_gather_host(const Comm& c, const T* mine, size_t count, const char* tag) {
  DeviceBuffer<T> sent(count, Mem::CommStaging, tag);
  DeviceBuffer<T> got(count * c.size, Mem::CommStaging, tag);
  copy_to_device(sent.ptr, mine, sent.bytes(), c.stream, tag);
  all_gather(c, sent.ptr, got.ptr, count, c.stream);
  std::vector<T> all(got.count);
  comm_sync(c, c.stream, tag);
  copy_to_host(all.data(), got.ptr, got.bytes(), c.stream, tag);
  return all;
}

// The largest of every rank's `x` (a host value), on every rank.
inline long long max_over_ranks(const Comm& c, long long x) {
  if (c.size == 1) return x;
  const std::vector<long long> all = all_gather_host(c, &x, 1, "max_over_ranks");
  return *std::max_element(all.begin(), all.end());
}

// Which ranks of `world` run on this rank's GPU ([world.size], this one included): only this one unless ranks
// share GPUs (--share_gpus 1, runtime/launch.cuh). The GPUs' UUIDs, all-gathered over the world: an exchange
// that every rank must call.
inline std::vector<bool> ranks_sharing_this_gpu(const Comm& world) {
  if (world.size == 1) return {true};
  int device = 0;
  cudaDeviceProp prop;
  comm_cuda_check(world, cudaGetDevice(&device), "ranks_sharing_this_gpu", "cudaGetDevice");
  comm_cuda_check(world, cudaGetDeviceProperties(&prop, device), "ranks_sharing_this_gpu", comm_format("device %d", device));
  constexpr int words = sizeof(prop.uuid.bytes) / sizeof(int);
  int mine[words];
  memcpy(mine, prop.uuid.bytes, sizeof(mine));
  const std::vector<int> all = all_gather_host(world, mine, words, "ranks_sharing_this_gpu");
  std::vector<bool> same(world.size);
  for (int r = 0; r < world.size; r++) same[r] = memcmp(all.data() + (size_t)r * words, mine, sizeof(mine)) == 0;
  return same;
}

// The ranks of `parent` that pass the same color (>= 0) form one new communicator, ordered by key
// (then by parent rank). Every rank of the parent must call it. Built with ncclCommInitRankConfig
// rather than ncclCommSplit (whose non-blocking form left the new communicator unset on NCCL here):
// every rank's (color, key, a fresh NCCL id) is all-gathered over the parent (on the parent's
// stream), and each group uses the id of its first member.
inline Comm comm_split(const Comm& parent, int color, int key, const char* name) {
  Comm group;
  group.name = name;
  if (color < 0) comm_fail(parent, "comm_split", comm_format("color %d < 0 for group %s", color, name));
  struct Entry {
    int color, key;
    ncclUniqueId id;
  };
  static_assert(sizeof(Entry) % sizeof(int) == 0, "Entry is gathered as ints");
  const size_t ints = sizeof(Entry) / sizeof(int);
  Entry mine{color, key, {}};
  comm_check(parent, ncclGetUniqueId(&mine.id), "comm_split", "ncclGetUniqueId for group %s", name);
  std::vector<Entry> all(parent.size);
  DeviceBuffer<int> mine_dev(ints, Mem::CommStaging, "comm_split");
  DeviceBuffer<int> all_dev(ints * parent.size, Mem::CommStaging, "comm_split");
  copy_to_device(mine_dev.ptr, &mine, sizeof mine, parent.stream, "comm_split");
  comm_check(parent, ncclAllGather(mine_dev.ptr, all_dev.ptr, ints, ncclInt32, parent.nccl, parent.stream), "comm_split",
             "all-gather of (color, key, id) over %s, %d ranks", parent.name.c_str(), parent.size);
  comm_sync(parent, parent.stream, "comm_split");
  copy_to_host(all.data(), all_dev.ptr, sizeof(Entry) * parent.size, parent.stream, "comm_split");
  std::vector<int> members;  // parent ranks of this group, in (key, parent rank) order
  for (int r = 0; r < parent.size; r++)
    if (all[r].color == color) members.push_back(r);
  std::stable_sort(members.begin(), members.end(), [&](int a, int b) { return all[a].key < all[b].key; });
  group.size = (int)members.size();
  group.rank = (int)(std::find(members.begin(), members.end(), parent.rank) - members.begin());
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  comm_check(group, ncclCommInitRankConfig(&group.nccl, group.size, all[members[0]].id, group.rank, &config),
             "comm_split", "ncclCommInitRankConfig group %s: rank %d of %d (color %d)", name, group.rank, group.size, color);
  comm_finish_init(group, "comm_split");
  return group;
}

// Waits for c's stream, finalizes (flushes every pending operation) and destroys the communicator
// and its stream; nccl and stream become nullptr.
inline void comm_destroy(Comm& c) {
  if (c.nccl == nullptr) return;
  comm_sync(c, c.stream, "comm_destroy");
  comm_check(c, ncclCommFinalize(c.nccl), "comm_destroy", "ncclCommFinalize");
  comm_unregister(c.nccl);
  ncclResult_t r = ncclCommDestroy(c.nccl);
  c.nccl = nullptr;
  if (r != ncclSuccess) comm_fail(c, "comm_destroy", "ncclCommDestroy: " + nccl_why(r, nullptr));
  comm_cuda_check(c, cudaStreamDestroy(c.stream), "comm_destroy", "cudaStreamDestroy");
  c.stream = nullptr;
}

// Where a rank sits when world_size ranks are cut into contiguous blocks of group_size ranks.
struct BlockPlace {
  int group = 0;  // block index: world_rank / group_size
  int rank = 0;   // rank within the block: world_rank % group_size
};

// Returns "" and fills *place, or why the sizes are refused (group_size must divide world_size).
inline std::string block_group_place(int world_rank, int world_size, int group_size, BlockPlace* place) {
  if (world_size < 1 || world_rank < 0 || world_rank >= world_size)
    return comm_format("invalid rank %d of %d", world_rank, world_size);
  if (group_size < 1 || world_size % group_size != 0)
    return comm_format("group size %d does not divide the %d ranks", group_size, world_size);
  place->group = world_rank / group_size;
  place->rank = world_rank % group_size;
  return "";
}

// Contiguous blocks of `size` ranks of `world` (notes/design.md §5: sub-groups are independent views of the
// same W ranks). Every rank of `world` must call it with the same size.
inline Comm comm_block_group(const Comm& world, int size, const char* name) {
  BlockPlace place;
  std::string why = block_group_place(world.rank, world.size, size, &place);
  if (!why.empty()) comm_fail(world, "comm_block_group", why + " (group " + name + ")");
  Comm group = comm_split(world, place.group, place.rank, name);
  if (group.rank != place.rank || group.size != size)
    comm_fail(group, "comm_block_group",
              comm_format("NCCL placed world rank %d at rank %d of %d, expected rank %d of %d", world.rank, group.rank,
                          group.size, place.rank, size));
  return group;
}
