// pool.cuh — the one device-memory pool (notes/design.md §4). Every device buffer that flatmoe's own
// code allocates comes from here, with a category and a tag, so that the live set of any operator can
// be measured and compared with its closed-form bound. What the pool does not see: the CUDA context,
// NCCL's buffers, cuBLAS's own memory other than its GEMM workspace (the handle's state; the workspace
// is pooled, see cublas_on), and pinned host memory (NCCL's; the trainer and operators allocate none
// today). The trainer's cudaMemGetInfo figure ("device used") counts the device-side ones, and the
// pool's cached free blocks, on top of the pool's live bytes.
//
// What it records:
//   live bytes per category (what callers asked for and have not freed), the peak of the total
//   live bytes and of each category since the last reset_peak(), and (when enabled) a timeline of
//   events: time since the pool was created (us), action (alloc/free/mark), bytes, category, tag.
//   The time is host time, read when the host calls alloc/free: the host enqueues work ahead of the
//   GPU, so an event's time is when the host issued it, not when the GPU ran the work around it.
//   The trainer turns the timeline on for one step and on rank 0 only (--timeline_step).
// What it keeps underneath: freed blocks are cached by their rounded size and handed out again
// (cudaFree synchronises the device, so a training step does not call it). `reserved()` is what
// the pool holds from CUDA; `live_total()` is what is in use. The cache serves only its own sizes and
// those a little above, so reserved can pass the live peak (measured 16-28 % above it on the 334M MoE,
// notes/sco.md); those bytes are not lost: when CUDA has no memory left for a request, the pool gives
// every cached block back (release_cached, one device synchronisation) and asks once more, so the cache
// never causes an out-of-memory that the live blocks alone would not (cache_releases() counts it).
// A live block is its request rounded up to its size class (round_size: at most 2 MiB more from 32 MiB
// up), or a cached block a little larger when none of its class is free (take_cached_near: less than 1/16
// of the request's power of two more); `peak_held()` is the peak of the live blocks as held, beside
// `peak()`, the live bytes asked for.
//
// Streams (runtime/stream.cuh). A block is handed out ready for the stream that allocates it: its
// previous owner's work is ordered before that stream's next work. Two frees keep that true:
//   free(p)              the block may go to the next alloc at once: every user of p ran on the
//                        stream that allocates next, or was joined into it (stream_after), so stream
//                        order protects it — the single-stream case.
//   free_after(p, s)     p's last user is work still queued on stream `s` (a communicator's send
//                        buffer): the block leaves the live set now, but waits among the pending
//                        blocks until an event recorded on `s` has completed, and only then is handed
//                        out again. The host never waits for it: an alloc that finds no ready block of
//                        its size asks CUDA for a new one.
// So a block from alloc() is ready at once on the stream whose free() gave it back (stream order);
// another stream that writes into it first waits on that stream (stream_after), which an exchange
// does anyway before it sends what the compute stream made.
// Accounting stays exact: live bytes are what callers hold (a pending block is not live, and shows in
// pending_bytes() instead), so the live peaks are the same on every run whatever the GPU's timing.
//
// A captured pass (runtime/graph.cuh): between begin_capture() and end_capture() the pool hands out
// blocks as always, and remembers them and how far each category's live bytes rose. A replay of the
// graph uses those same addresses without calling alloc or free, so replayable() asks that every one
// is a free cached block of its size at the replay (else the work is captured again), and replay()
// raises the peaks as the captured allocations did: the peaks stay those of the eager pass.
//
// What the pool does not see is measured by the device ledger (bottom of this file): the growth of the
// device's used bytes at each step of the runtime's start (the CUDA context, each NCCL communicator,
// the cuBLAS handle) beside the pool's reserved bytes, and whatever else remains ("other").
//
// The process's runtime (bottom of this file): runtime_prepare() after cudaSetDevice, before any
// measurement, creates the shared cuBLAS handle and its pooled workspace; runtime_release() at exit
// gives everything back to CUDA and refuses to when anything else is still live (a leak, notes/design.md §4).
#pragma once
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>
#include "../data/file_io.hpp"
#include "check.cuh"
#include "stream.cuh"

enum class Mem : int {
  Weights,
  Grads,
  Optimizer,
  Activations,
  Checkpoints,          // layer-boundary inputs kept for recomputation
  Dispatch,             // routed rows sent/received by MoE dispatch
  ExpertIntermediates,  // per-route hidden states inside the experts
  Logits,               // vocabulary logits and loss
  CommStaging,
  Workspace,
  COUNT
};

inline const char* mem_name(Mem c) {
  static const char* names[] = {"weights",  "grads",    "optimizer",           "activations",
                                "checkpoints", "dispatch", "expert_intermediates", "logits",
                                "comm_staging", "workspace"};
  return names[(int)c];
}

struct PoolEvent {
  double t_us;
  char action;  // 'a' alloc, 'f' free, 'm' mark
  size_t bytes;
  Mem cat;
  std::string tag;
  size_t live_after;
};

class Pool {
 public:
  static const int NCAT = (int)Mem::COUNT;

  void* alloc(size_t bytes, Mem cat, const char* tag) {
    if (bytes == 0) bytes = 1;
    size_t rounded = round_size(bytes);
    if (rounded == 0) refuse(bytes, cat, tag, "larger than any block the pool can round (2^63 bytes)");
    void* p = nullptr;
    auto& cached = free_blocks_[rounded];
    if (cached.empty() && !pending_.empty()) reap_pending();
    if (!cached.empty()) {
      p = cached.back();
      cached.pop_back();
    } else {
      p = take_cached_near(bytes, &rounded);
    }
    if (p == nullptr) {
      cudaError_t err = cudaMalloc(&p, rounded);
      if (err == cudaErrorMemoryAllocation && reserved_ > held_total_) {
        // the device is full but the cache holds blocks of other sizes: they go back to CUDA (this
        // synchronises the device, once) and the request is tried again
        (void)cudaGetLastError();
        release_cached();
        cache_releases_++;
        err = cudaMalloc(&p, rounded);
      }
      if (err != cudaSuccess) refuse(bytes, cat, tag, cudaGetErrorString(err));
      reserved_ += rounded;
    }
    blocks_[p] = Block{bytes, rounded, cat, tag};
    live_[(int)cat] += bytes;
    live_total_ += bytes;
    held_total_ += rounded;
    if (live_total_ > peak_total_) peak_total_ = live_total_;
    if (held_total_ > peak_held_) peak_held_ = held_total_;
    if (live_[(int)cat] > peak_[(int)cat]) peak_[(int)cat] = live_[(int)cat];
    if (capture_) {
      capture_->blocks.emplace_back(p, rounded);
      capture_->rise_total = std::max(capture_->rise_total, live_total_ - capture_base_total_);
      capture_->rise_held = std::max(capture_->rise_held, held_total_ - capture_base_held_);
      capture_->rise[(int)cat] = std::max(capture_->rise[(int)cat], live_[(int)cat] - capture_base_[(int)cat]);
    }
    record('a', bytes, cat, tag);
    return p;
  }

  template <typename T>
  T* alloc_t(size_t count, Mem cat, const char* tag) {
    if (count > SIZE_MAX / sizeof(T)) refuse(SIZE_MAX, cat, tag, "count times the element size passes 2^64 bytes");
    return (T*)alloc(count * sizeof(T), cat, tag);
  }

  void free(void* p) {
    if (held_ != nullptr && p != nullptr) {  // a side stream's work is being enqueued (hold_frees)
      held_->push_back(p);
      return;
    }
    Block b;
    if (!take_live(p, &b)) return;
    free_blocks_[b.rounded].push_back(p);
  }

  // From now until hold_frees(nullptr), free(p) does not free p but appends it to *into: p stays live
  // (and counted) until its holder frees it once more (runtime/side_stream.cuh: after the main
  // stream has joined the side stream whose work used p). Host order alone decides what is held, so
  // the live bytes and peaks are the same whichever stream the work runs on.
  void hold_frees(std::vector<void*>* into) { held_ = into; }

  // p's last user is work already queued on `stream`: p leaves the live set now and is handed out
  // again once that work has finished (see the header).
  void free_after(void* p, cudaStream_t stream) {
    if (capture_ && p != nullptr)
      fm_fail("pool.free_after", "a captured pass cannot hand a block to another stream's work", "capturing=%s",
              capture_op_.c_str());
    Block b;
    if (!take_live(p, &b)) return;
    cudaEvent_t event = nullptr;
    if (spare_events_.empty()) {
      cudaCheck(cudaEventCreateWithFlags(&event, cudaEventDisableTiming), "pool.free_after", "tag=%s bytes=%zu",
                b.tag.c_str(), b.bytes);
    } else {
      event = spare_events_.back();
      spare_events_.pop_back();
    }
    cudaCheck(cudaEventRecord(event, stream), "pool.free_after", "tag=%s bytes=%zu", b.tag.c_str(), b.bytes);
    pending_.push_back(PendingBlock{p, b.rounded, event});
    pending_bytes_ += b.rounded;
  }

  // Returns every cached block to CUDA, and the events of pending blocks once their streams have
  // finished (synchronises the device).
  void release_cached() {
    cudaCheck(cudaDeviceSynchronize(), "pool.release_cached", "pending blocks=%zu", pending_.size());
    reap_pending();
    for (auto& kv : free_blocks_) {
      for (void* p : kv.second) {
        cudaCheck(cudaFree(p), "pool.release_cached", "bytes=%zu", kv.first);
        reserved_ -= kv.first;
      }
      kv.second.clear();
    }
    for (cudaEvent_t e : spare_events_) cudaCheck(cudaEventDestroy(e), "pool.release_cached", "events=%zu", spare_events_.size());
    spare_events_.clear();
  }

  // The size classes: 512-byte granularity below 1 MiB; above, 1/16 of the enclosing power of two
  // up to 2 MiB, the device's own page (so from 32 MiB up a block is at most 2 MiB above its request:
  // the trainer's fit check sets live bytes beside the device, rank_memory.cuh). 0 past 2^63 bytes,
  // where the enclosing power of two does not fit a size_t (a negative size converted to size_t lands there).
  static constexpr size_t LARGEST_STEP = size_t(2) << 20;
  // The smallest power of two >= bytes (bytes at most 2^63).
  static size_t enclosing_power_of_two(size_t bytes) {
    size_t p = 1;
    while (p < bytes) p <<= 1;
    return p;
  }
  static size_t round_size(size_t bytes) {
    if (bytes < (1u << 20)) return (bytes + 511) & ~size_t(511);
    if (bytes > (SIZE_MAX >> 1) + 1) return 0;
    const size_t step = std::min(enclosing_power_of_two(bytes) >> 4, LARGEST_STEP);
    return (bytes + step - 1) / step * step;
  }

  size_t live(Mem c) const { return live_[(int)c]; }
  size_t live_total() const { return live_total_; }
  size_t peak() const { return peak_total_; }
  // The peak of the live blocks as the pool holds them from CUDA (each rounded, round_size): what the
  // device must find room for at the live peak, a little above peak().
  size_t peak_held() const { return peak_held_; }
  size_t peak(Mem c) const { return peak_[(int)c]; }
  size_t reserved() const { return reserved_; }
  // Times a full device made the pool give its cached blocks back to CUDA and try again.
  size_t cache_releases() const { return cache_releases_; }
  size_t blocks_live() const { return blocks_.size(); }
  // Bytes (rounded) of blocks given back with free_after whose stream has not been seen to finish.
  size_t pending_bytes() const { return pending_bytes_; }

  // The live blocks grouped by tag: "tag (category): N blocks, B bytes; ..." — what a leak report names.
  std::string describe_live() const {
    std::map<std::string, std::pair<size_t, size_t>> by_tag;  // "tag (category)" -> (blocks, bytes)
    for (const auto& kv : blocks_) {
      auto& entry = by_tag[kv.second.tag + " (" + mem_name(kv.second.cat) + ")"];
      entry.first++;
      entry.second += kv.second.bytes;
    }
    std::string text;
    for (const auto& kv : by_tag)
      text += (text.empty() ? "" : "; ") + kv.first + ": " + std::to_string(kv.second.first) + " blocks, " +
              std::to_string(kv.second.second) + " bytes";
    return text;
  }

  // Starts a new measurement window: peaks become the current live bytes.
  void reset_peak() {
    peak_total_ = live_total_;
    peak_held_ = held_total_;
    for (int i = 0; i < NCAT; i++) peak_[i] = live_[i];
  }

  // What a captured pass took from the pool (header): its blocks and how far each category's live
  // bytes rose above where they were when the capture began.
  struct CapturedUse {
    std::vector<std::pair<void*, size_t>> blocks;  // (block, rounded bytes), each once
    size_t rise[NCAT] = {0};
    size_t rise_total = 0, rise_held = 0;
  };

  void begin_capture(const char* op) {
    if (capture_) fm_fail("pool.begin_capture", "a capture is already in progress", "op=%s capturing=%s", op, capture_op_.c_str());
    capture_ = std::make_unique<CapturedUse>();
    capture_op_ = op;
    capture_base_total_ = live_total_;
    capture_base_held_ = held_total_;
    for (int i = 0; i < NCAT; i++) capture_base_[i] = live_[i];
  }
  // Ends the capture; the captured work must have freed every block it allocated.
  CapturedUse end_capture() {
    if (!capture_) fm_fail("pool.end_capture", "no capture in progress", "live=%zu", live_total_);
    CapturedUse use = std::move(*capture_);
    capture_.reset();
    if (live_total_ != capture_base_total_)
      fm_fail("pool.end_capture", "the captured work left blocks live (a replay could not reuse them)",
              "op=%s live before=%zu after=%zu; live now: %s", capture_op_.c_str(), capture_base_total_, live_total_,
              describe_live().c_str());
    std::sort(use.blocks.begin(), use.blocks.end());
    use.blocks.erase(std::unique(use.blocks.begin(), use.blocks.end()), use.blocks.end());
    return use;
  }
  // Every block of the capture is a free cached block of its size now (none live, pending or given
  // back to CUDA): the replay's work may use them in this stream order, as the captured allocs did.
  bool replayable(const CapturedUse& use) const {
    for (const auto& [p, rounded] : use.blocks) {
      auto it = free_blocks_.find(rounded);
      if (it == free_blocks_.end() || std::find(it->second.begin(), it->second.end(), p) == it->second.end()) return false;
    }
    return true;
  }
  // The peaks a replay reaches: the live bytes now plus the capture's rise, per category and in total.
  void replay(const CapturedUse& use) {
    peak_total_ = std::max(peak_total_, live_total_ + use.rise_total);
    peak_held_ = std::max(peak_held_, held_total_ + use.rise_held);
    for (int i = 0; i < NCAT; i++) peak_[i] = std::max(peak_[i], live_[i] + use.rise[i]);
  }

  // Timeline: off by default (a step makes thousands of events).
  void set_timeline(bool on) { timeline_on_ = on; }
  bool timeline() const { return timeline_on_; }
  void clear_timeline() { events_.clear(); }
  void mark(const char* tag) { record('m', 0, Mem::Workspace, tag); }
  const std::vector<PoolEvent>& events() const { return events_; }

  // CSV: t_us,action,bytes,category,tag,live_bytes — plus one column per category. Written through
  // PATH.tmp and renamed (data/file_io.hpp's AtomicFileWriter: an existing PATH.tmp is refused, never
  // written through); false, with the reason on stderr, when it cannot be written.
  bool write_csv(const char* path) const {
    std::string csv = "t_us,action,bytes,category,tag,live_bytes";
    for (int i = 0; i < NCAT; i++) csv += std::string(",") + mem_name((Mem)i);
    csv += "\n";
    // live bytes per category before the first event: today's live bytes minus what the window did
    long long per_cat[NCAT];
    for (int i = 0; i < NCAT; i++) per_cat[i] = (long long)live_[i];
    for (const PoolEvent& e : events_) {
      if (e.action == 'a') per_cat[(int)e.cat] -= (long long)e.bytes;
      if (e.action == 'f') per_cat[(int)e.cat] += (long long)e.bytes;
    }
    char number[64];
    for (const PoolEvent& e : events_) {
      if (e.action == 'a') per_cat[(int)e.cat] += e.bytes;
      if (e.action == 'f') per_cat[(int)e.cat] -= e.bytes;
      snprintf(number, sizeof number, "%.1f,", e.t_us);
      csv += number;
      csv += std::string(e.action == 'a' ? "alloc" : e.action == 'f' ? "free" : "mark") + "," + std::to_string(e.bytes) + "," +
             mem_name(e.cat) + "," + e.tag + "," + std::to_string(e.live_after);
      for (int i = 0; i < NCAT; i++) csv += "," + std::to_string(per_cat[i]);
      csv += "\n";
    }
    try {
      data::AtomicFileWriter out(path);
      out.write(csv);
      out.commit();
    } catch (const std::runtime_error& e) {
      fprintf(stderr, "memory timeline: %s\n", e.what());
      return false;
    }
    return true;
  }

  void print_live(FILE* f) const {
    for (int i = 0; i < NCAT; i++)
      if (live_[i] || peak_[i])
        fprintf(f, "  %-22s live %10.3f MiB   peak %10.3f MiB\n", mem_name((Mem)i),
                live_[i] / 1048576.0, peak_[i] / 1048576.0);
  }

 private:
  std::vector<void*>* held_ = nullptr;  // hold_frees
  struct Block {
    size_t bytes, rounded;
    Mem cat;
    std::string tag;
  };

  // The report of a request the pool cannot satisfy, with what is live; exits.
  [[noreturn]] void refuse(size_t bytes, Mem cat, const char* tag, const char* why) {
    fprintf(stderr,
            "flatmoe error in pool.alloc (tag=%s category=%s bytes=%zu): %s; live %.3f GiB, "
            "reserved %.3f GiB\n",
            tag, mem_name(cat), bytes, why, live_total_ / 1073741824.0, reserved_ / 1073741824.0);
    print_live(stderr);
    fm_exit_failure();
  }

  // A cached block larger than the request's class by less than 1/16 of the request's enclosing power of two
  // (the steps of the classes below 32 MiB), the smallest there is; nullptr when none. So a request whose
  // size moves a little from step to step (the routes an expert-parallel rank receives) reuses the block its
  // last size left, rather than asking CUDA for a new one each step. *rounded becomes the block's size.
  void* take_cached_near(size_t bytes, size_t* rounded) {
    const size_t limit = bytes + enclosing_power_of_two(bytes) / 16;
    for (auto it = free_blocks_.upper_bound(*rounded); it != free_blocks_.end() && it->first < limit; ++it)
      if (!it->second.empty()) {
        void* block = it->second.back();
        it->second.pop_back();
        *rounded = it->first;
        return block;
      }
    return nullptr;
  }

  // Removes p from the live set (recording the free); false for nullptr. Exits if p is not the pool's.
  bool take_live(void* p, Block* out) {
    if (p == nullptr) return false;
    auto it = blocks_.find(p);
    if (it == blocks_.end()) {
      fprintf(stderr, "flatmoe error in pool.free: %p was not allocated by the pool\n", p);
      fm_exit_failure();
    }
    *out = it->second;
    blocks_.erase(it);
    live_[(int)out->cat] -= out->bytes;
    live_total_ -= out->bytes;
    held_total_ -= out->rounded;
    record('f', out->bytes, out->cat, out->tag.c_str());
    return true;
  }

  // Moves the pending blocks whose events have completed into the cache.
  void reap_pending() {
    size_t kept = 0;
    for (size_t i = 0; i < pending_.size(); i++) {
      const PendingBlock& b = pending_[i];
      cudaError_t q = cudaEventQuery(b.event);
      if (q == cudaErrorNotReady) {
        pending_[kept++] = b;
        continue;
      }
      cudaCheck(q, "pool.reap_pending", "bytes=%zu", b.rounded);
      free_blocks_[b.rounded].push_back(b.ptr);
      spare_events_.push_back(b.event);
      pending_bytes_ -= b.rounded;
    }
    pending_.resize(kept);
  }

  void record(char action, size_t bytes, Mem cat, const char* tag) {
    if (!timeline_on_) return;
    double t = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0_).count();
    events_.push_back(PoolEvent{t, action, bytes, cat, tag, live_total_});
  }

  struct PendingBlock {
    void* ptr;
    size_t rounded;
    cudaEvent_t event;  // recorded on the last user's stream at free_after
  };

  std::unordered_map<void*, Block> blocks_;
  std::vector<PendingBlock> pending_;
  std::vector<cudaEvent_t> spare_events_;  // completed pending events, recorded again by free_after
  size_t pending_bytes_ = 0;
  std::map<size_t, std::vector<void*>> free_blocks_;
  size_t live_[NCAT] = {0};
  size_t peak_[NCAT] = {0};
  size_t live_total_ = 0, peak_total_ = 0, reserved_ = 0;
  size_t held_total_ = 0, peak_held_ = 0;  // the live blocks as held (their rounded sizes), and its peak
  size_t cache_releases_ = 0;
  bool timeline_on_ = false;
  std::unique_ptr<CapturedUse> capture_;  // while a pass is captured (begin_capture)
  std::string capture_op_;
  size_t capture_base_[NCAT] = {0};
  size_t capture_base_total_ = 0, capture_base_held_ = 0;
  std::vector<PoolEvent> events_;
  std::chrono::steady_clock::time_point t0_ = std::chrono::steady_clock::now();
};

// One pool per process (one process per GPU).
inline Pool& pool() {
  static Pool p;
  return p;
}

// A typed buffer owned by the pool, freed when it goes out of scope.
template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  size_t count = 0;
  DeviceBuffer() = default;
  DeviceBuffer(size_t n, Mem cat, const char* tag) : ptr(pool().alloc_t<T>(n, cat, tag)), count(n) {}
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr(o.ptr), count(o.count) { o.ptr = nullptr; o.count = 0; }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) { pool().free(ptr); ptr = o.ptr; count = o.count; o.ptr = nullptr; o.count = 0; }
    return *this;
  }
  ~DeviceBuffer() { pool().free(ptr); }
  T* get() const { return ptr; }
  size_t bytes() const { return count * sizeof(T); }
};

// ---------------------------------------------------------------------------------------------
// The device ledger: the whole device, not just the pool. cudaMemGetInfo's used bytes (total − free)
// count the CUDA context, NCCL's buffers, cuBLAS's handle, the pool's reserved blocks (live, cached
// free, pending) and anything else on this GPU (other processes). device_memory_mark(what) records
// the growth of (used − pool reserved) since the previous mark as `what`; the first mark records
// everything before it (the context). device_memory_report() itemises the device now.

struct DeviceMemoryItem {
  std::string what;
  long long bytes;
};

struct DeviceMemoryLedger {
  std::vector<DeviceMemoryItem> items;
  long long last_outside_pool = 0;  // used − pool reserved at the last mark
};

inline DeviceMemoryLedger& device_memory() {
  static DeviceMemoryLedger ledger;
  return ledger;
}

inline long long device_used_bytes() {
  size_t free_b = 0, total_b = 0;
  cudaCheck(cudaMemGetInfo(&free_b, &total_b), "device_memory", "cudaMemGetInfo");
  return (long long)(total_b - free_b);
}

inline void device_memory_mark(const std::string& what) {
  DeviceMemoryLedger& ledger = device_memory();
  const long long outside = device_used_bytes() - (long long)pool().reserved();
  ledger.items.push_back(DeviceMemoryItem{what, outside - ledger.last_outside_pool});
  ledger.last_outside_pool = outside;
}

// The device now: used bytes, the pool's reserved (live, pending), the ledger's items, and the rest.
struct DeviceMemoryNow {
  long long used = 0, reserved = 0, live = 0, pending = 0;
  long long itemised = 0;  // the ledger's items (outside the pool)
  long long other() const { return used - reserved - itemised; }
};

inline DeviceMemoryNow device_memory_now() {
  DeviceMemoryNow now;
  now.used = device_used_bytes();
  now.reserved = (long long)pool().reserved();
  now.live = (long long)pool().live_total();
  now.pending = (long long)pool().pending_bytes();
  for (const DeviceMemoryItem& item : device_memory().items) now.itemised += item.bytes;
  return now;
}

// "device used U MiB = pool reserved R (live L, cached free F, pending P) + ITEM x + ... + other O"
inline std::string device_memory_report() {
  const double MiB = 1048576.0;
  const DeviceMemoryNow now = device_memory_now();
  char buf[256];
  snprintf(buf, sizeof buf, "device used %.1f MiB = pool reserved %.1f (live %.1f, cached free %.1f, pending %.1f)",
           now.used / MiB, now.reserved / MiB, now.live / MiB, (now.reserved - now.live - now.pending) / MiB,
           now.pending / MiB);
  std::string text = buf;
  for (const DeviceMemoryItem& item : device_memory().items) {
    snprintf(buf, sizeof buf, " + %s %.1f", item.what.c_str(), item.bytes / MiB);
    text += buf;
  }
  snprintf(buf, sizeof buf, " + other %.1f", now.other() / MiB);
  return text + buf;
}

// ---------------------------------------------------------------------------------------------
// The runtime of the process (one process per GPU): the cuBLAS and cuBLASLt handles and their one
// workspace, taken from the pool (category Workspace). The FP32 build runs pedantic FP32.

struct CublasRuntime {
  static constexpr size_t workspace_bytes = 32u << 20;  // cuBLAS's recommendation for Hopper
  cublasHandle_t handle = nullptr;
  cublasLtHandle_t lt = nullptr;  // the GEMMs with an epilogue (ops/matmul.cuh)
  void* workspace = nullptr;      // [workspace_bytes], from the pool: every stream's but those below
  // Streams with a workspace of their own, [workspace_bytes] each (a side stream whose GEMMs run
  // beside the main stream's, runtime/side_stream.cuh: two GEMMs at once must not share one; the
  // same size, so that cuBLAS picks the same algorithms, and the same bits, on either stream).
  std::vector<std::pair<cudaStream_t, void*>> own;
};

inline CublasRuntime& cublas_runtime() {
  static CublasRuntime runtime;
  return runtime;
}

// Creates the cuBLAS handle and allocates its workspace from the pool (once; later calls do nothing).
// Call it after cudaSetDevice and before measuring the pool, so that no measurement sees the
// workspace appear; cublas_on calls it too, for programs that do not.
inline void runtime_prepare() {
  CublasRuntime& rt = cublas_runtime();
  if (rt.handle != nullptr) return;
  if (device_memory().items.empty()) device_memory_mark("CUDA context");  // no communicator marked it first
  cublasCheck(cublasCreate(&rt.handle), "runtime_prepare", "cublasCreate");
  cublasCheck(cublasLtCreate(&rt.lt), "runtime_prepare", "cublasLtCreate");
#if defined(FLATMOE_BF16)
  cublasCheck(cublasSetMathMode(rt.handle, CUBLAS_DEFAULT_MATH), "runtime_prepare", "math mode default");
#else
  cublasCheck(cublasSetMathMode(rt.handle, CUBLAS_PEDANTIC_MATH), "runtime_prepare", "math mode pedantic");
#endif
  rt.workspace = pool().alloc(CublasRuntime::workspace_bytes, Mem::Workspace, "cublas_workspace");
  device_memory_mark("cuBLAS handle");
}

// At exit: waits for the device, returns the cuBLAS workspace to the pool, destroys the handle and
// returns every cached block to CUDA (cudaFree), so that the pool holds nothing. Refuses (exits
// naming the blocks, their bytes and tags) when anything else is still live: that is a leak.
// runtime_prepare() may be called again afterwards.
inline void runtime_release() {
  CublasRuntime& rt = cublas_runtime();
  cudaCheck(cudaDeviceSynchronize(), "runtime_release", "live blocks=%zu", pool().blocks_live());
  pool().free(rt.workspace);
  rt.workspace = nullptr;
  if (rt.handle != nullptr) cublasCheck(cublasDestroy(rt.handle), "runtime_release", "cublasDestroy");
  if (rt.lt != nullptr) cublasCheck(cublasLtDestroy(rt.lt), "runtime_release", "cublasLtDestroy");
  rt.handle = nullptr;
  rt.lt = nullptr;
  if (pool().blocks_live() != 0)
    fm_fail("runtime_release", ("device memory still live at exit (a leak): " + pool().describe_live()).c_str(),
            "live blocks=%zu bytes=%zu", pool().blocks_live(), pool().live_total());
  pool().release_cached();
  stream_order_release();
}

// The workspace of cuBLAS's GEMMs on `stream`: its own, else the runtime's.
inline void* cublas_workspace(cudaStream_t stream) {
  runtime_prepare();
  for (const auto& [s, w] : cublas_runtime().own)
    if (s == stream) return w;
  return cublas_runtime().workspace;
}

// Gives `stream` a workspace of its own from the pool (Workspace, workspace_bytes), or gives it
// back (own = false) — before the stream is destroyed.
inline void cublas_own_workspace(cudaStream_t stream, bool own) {
  runtime_prepare();
  std::vector<std::pair<cudaStream_t, void*>>& list = cublas_runtime().own;
  auto it = std::find_if(list.begin(), list.end(), [&](const auto& x) { return x.first == stream; });
  if (own && it == list.end())
    list.emplace_back(stream, pool().alloc(CublasRuntime::workspace_bytes, Mem::Workspace, "cublas_workspace.side"));
  if (!own && it != list.end()) {
    pool().free(it->second);
    list.erase(it);
  }
}

// cuBLAS on a stream, with the runtime's pooled workspace. cublasSetStream resets cuBLAS to a
// workspace of its own (allocated outside the pool), so every GEMM launcher sets both together
// through this function.
inline cublasHandle_t cublas_on(cudaStream_t stream, const char* op) {
  runtime_prepare();
  const CublasRuntime& rt = cublas_runtime();
  cublasCheck(cublasSetStream(rt.handle, stream), op, "stream");
  cublasCheck(cublasSetWorkspace(rt.handle, cublas_workspace(stream), CublasRuntime::workspace_bytes), op,
              "workspace=%zu", CublasRuntime::workspace_bytes);
  return rt.handle;
}
