// profile.cuh — where a training step's GPU time goes, per operator, from CUDA events only
// (notes/speed.md, 'How to measure'). No external profiler, no host synchronisation while the step runs.
//
// The model and its operators call prof_mark(stream, "name", bytes) just before each operator: a
// mark records one CUDA event on the stream and opens a range that lasts until the next mark, so the
// ranges partition the stream's timeline from the first mark to prof_end() — every microsecond of the
// step, idle gaps included (a gap where the GPU waits for the host is charged to the range that
// contains it: a host synchronisation inside a range shows up as that range's time).
// prof_sub(stream, "part", bytes) opens a range named "<current mark>: part" — an operator's
// launcher splits its own time (ops/moe.cuh: the route plan, permute, grouped GEMMs, combine) and the
// parts land under whoever called it (the routed dispatcher, the shared expert, a dense FFN).
// A layer's recomputation (model.cuh: layer_forward with x_out = nullptr) sets a prefix
// ("recompute ") on the names it marks, through ProfPrefix.
// bytes: the bytes an operator moves to and from device memory, from its shapes (0 = not counted);
// the report shows bytes / time as GB/s for memory-bound operators, to compare with HBM's bandwidth.
//
// Off (the default): prof_mark is one branch on a bool — no event, no allocation, nothing on the
// stream. On (profiler().begin(stream), the trainer's --profile_step N for one step): one
// cudaEventRecord per mark (the host waits only in profiler().end(), after the step).
// Its own cost, honestly: each mark costs the host one cudaEventRecord (a few µs); when the host is
// the bottleneck (small kernels) that can stretch the step, so the trainer prints the profiled step's
// time next to the other steps'.
// Several streams: the marks are on the stream passed (the compute stream); work on a communicator's
// stream is seen where the compute stream waits for it, and so is a side stream's (the weight
// gradients beside the backward, runtime/side_stream.cuh): a mark or sub on another stream than
// begin's is not recorded (its range would not follow the compute stream's order).
#pragma once
#include <algorithm>
#include <cstdio>
#include <map>
#include <string>
#include <vector>
#include "check.cuh"
#include "stream.cuh"

struct ProfileRow {
  std::string name;
  int calls = 0;      // ranges with this name in the step
  double ms = 0;      // their summed time
  double bytes = 0;   // their summed bytes moved (0: not counted)
};

struct Profiler {
  bool on = false;

  // Starts recording marks on `stream` (the previous step's marks are dropped).
  void begin(cudaStream_t stream) {
    marks_.clear();
    prefix_.clear();
    current_.clear();
    stream_ = stream;
    on = true;
    mark(stream, "(step start)", 0);
  }
  void mark(cudaStream_t stream, const char* name, double bytes) {
    if (!on) return;
    current_ = prefix_ + name;
    record(stream, current_, bytes);
  }
  void sub(cudaStream_t stream, const char* part, double bytes) {
    if (!on) return;
    record(stream, (current_.empty() ? std::string("(unmarked)") : current_) + ": " + part, bytes);
  }
  void set_prefix(const std::string& p) { prefix_ = p; }
  const std::string& prefix() const { return prefix_; }

  // Closes the last range and stops recording; waits for the stream, then sums the ranges per name
  // (descending time). *total_ms: first mark to the end.
  std::vector<ProfileRow> end(double* total_ms) {
    std::vector<ProfileRow> rows;
    *total_ms = 0;
    if (!on) return rows;
    record(stream_, "(end)", 0);
    on = false;
    stream_wait(stream_, "profile", "marks=%zu", marks_.size());
    std::map<std::string, size_t> index;
    for (size_t i = 0; i + 1 < marks_.size(); i++) {
      float ms = 0;
      cudaCheck(cudaEventElapsedTime(&ms, events_[i], events_[i + 1]), "profile", "mark %zu %s", i, marks_[i].name.c_str());
      auto it = index.find(marks_[i].name);
      if (it == index.end()) {
        it = index.emplace(marks_[i].name, rows.size()).first;
        rows.push_back(ProfileRow{marks_[i].name});
      }
      ProfileRow& r = rows[it->second];
      r.calls++;
      r.ms += ms;
      r.bytes += marks_[i].bytes;
      *total_ms += ms;
    }
    std::stable_sort(rows.begin(), rows.end(), [](const ProfileRow& a, const ProfileRow& b) { return a.ms > b.ms; });
    return rows;
  }

  // The events back to CUDA (the trainer calls it before runtime_release).
  void release() {
    for (cudaEvent_t e : events_) cudaCheck(cudaEventDestroy(e), "profile", "events=%zu", events_.size());
    events_.clear();
    marks_.clear();
    on = false;
  }

 private:
  struct Mark {
    std::string name;
    double bytes;
  };
  void record(cudaStream_t stream, std::string name, double bytes) {
    if (stream != stream_) return;  // another stream's work shows where the compute stream waits for it
    const size_t i = marks_.size();
    if (i == events_.size()) {  // created while profiling, reused by later profiled steps
      cudaEvent_t e = nullptr;
      cudaCheck(cudaEventCreate(&e), "profile", "event %zu", i);
      events_.push_back(e);
    }
    cudaCheck(cudaEventRecord(events_[i], stream), "profile", "%s", name.c_str());
    marks_.push_back(Mark{std::move(name), bytes});
  }
  std::vector<Mark> marks_;
  std::vector<cudaEvent_t> events_;  // events_[i] belongs to marks_[i]
  std::string prefix_, current_;
  cudaStream_t stream_ = 0;
};

inline Profiler& profiler() {
  static Profiler p;
  return p;
}

// The model's one-line calls (see the header). bytes: device memory read + written, 0 = not counted.
inline void prof_mark(cudaStream_t stream, const char* name, double bytes = 0) {
  if (profiler().on) profiler().mark(stream, name, bytes);
}
inline void prof_sub(cudaStream_t stream, const char* part, double bytes = 0) {
  if (profiler().on) profiler().sub(stream, part, bytes);
}

// Names marked while it lives start with `prefix` (a recomputation's "recompute "); nothing when
// the profiler is off.
struct ProfPrefix {
  bool active;
  std::string saved;
  explicit ProfPrefix(const char* prefix) : active(profiler().on && prefix[0] != '\0') {
    if (!active) return;
    saved = profiler().prefix();
    profiler().set_prefix(saved + prefix);
  }
  ~ProfPrefix() {
    if (active) profiler().set_prefix(saved);
  }
  ProfPrefix(const ProfPrefix&) = delete;
  ProfPrefix& operator=(const ProfPrefix&) = delete;
};

// The breakdown as a markdown table: operator, ranges, ms, % of the profiled time, GB/s (bytes / time
// where bytes were counted). Also the profiled total beside the step's wall time (host clock).
inline void print_profile(FILE* out, const std::vector<ProfileRow>& rows, double total_ms, double step_wall_ms,
                          const char* title) {
  fprintf(out, "%s: %.3f ms on the GPU from the first mark to the last (the step's host wall time %.3f ms)\n", title,
          total_ms, step_wall_ms);
  fprintf(out, "| operator (summed over layers) | ranges | ms | %% of step | GB/s |\n|---|---|---|---|---|\n");
  for (const ProfileRow& r : rows) {
    char gbs[32] = "";
    if (r.bytes > 0 && r.ms > 0) snprintf(gbs, sizeof gbs, "%.0f", r.bytes / (r.ms * 1e-3) / 1e9);
    fprintf(out, "| %s | %d | %.3f | %.1f | %s |\n", r.name.c_str(), r.calls, r.ms, total_ms > 0 ? 100 * r.ms / total_ms : 0.0,
            gbs);
  }
}
