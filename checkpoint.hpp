// checkpoint.hpp — the checkpoint files (notes/design.md §9) in plain C++17: what a rank file holds, how it
// is written atomically, and every reason it is refused, each named with the file; no GPU involved.
//
// A checkpoint is a directory with one file per rank, rank<R>.bin. A save by W ranks:
//   rank 0: make_empty_dir(DIR.tmp); barrier;
//   every rank: write_rank_file(rank_file(DIR.tmp, rank), its RankFile); barrier;
//   rank 0: publish_dir(DIR.tmp, DIR); barrier.
// An interrupted save leaves the previous DIR in place. A save removes only checkpoint folders (a
// stale DIR.tmp, the DIR it replaces, DIR.old) that hold nothing but rank files: a link, a file or a
// folder holding anything else there is refused, and nothing is removed. A resume: check_checkpoint_set(DIR, W, bf16)
// before any GPU or NCCL work, then every rank read_rank_file(rank_file(DIR, rank)).
//
// A rank file, little-endian (offsets in bytes):
//   0      u32  magic 20261130
//   4      u32  format version 3
//   8      u32  precision of the build that wrote it: 1 BF16, 0 FP32
//   12     i32  W            16  i32  E_p         20  i32  rank
//   24     i32  step (optimizer steps completed)
//   28     u32  number of sections (at most kMaxSections)
//   32     i64  the optimizer's step count
//   40     i64  data loader shard        48  i64  data loader position     56  i64  data loader epoch
//   64     u64  draws of the sample generator
//   72     u64  bytes of the training flags text
//   80     u64  bytes of the whole file, its final checksum included
//   88     the model configuration, 16 × 4 bytes in ModelConfig's order: vocab, hidden, layers, heads,
//          experts, topk, expert_dim, n_dense, dense_dim, shared_expert, seq_len, score_fn, renorm
//          (i32), rope_theta, norm_eps, init_std (f32)
//   152    the section table: kMaxSections slots of 48 bytes, each a name (40 bytes, NUL-padded) and
//          an element count (u64); unused slots are zero
//   1016   u64  header checksum: FNV-1a 64 of bytes [0, 1016)
//   1024   the training flags: one line "--flag value\n" per entry of train_flag_values
//   ...    the sections' payloads in table order, count × f32 each
//   end-8  u64  file checksum: FNV-1a 64 of every byte before it
//
// Reading refuses, in this order and naming the file: cannot open, or not a regular file; bad magic number and unsupported
// version (so a foreign file or an older format is named as such); truncated (shorter than the
// header); checksum mismatch in the header; truncated or trailing bytes (against the length the
// header records); a malformed header (lengths that do not add up: only a hand-made file has them);
// checksum mismatch over the whole file; unreadable training flags; an invalid model configuration.
// The header's own checksum is what tells a cut file from a corrupt one: any flipped byte after the
// version is a checksum mismatch, never a misread length.
#pragma once
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <iterator>
#include <memory>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "config.hpp"
#include "data/dataloader.hpp"

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "checkpoint files are little-endian, as this host must be");

namespace ckpt {

constexpr uint32_t kMagic = 20261130;
constexpr uint32_t kFormatVersion = 3;
constexpr size_t kHeaderBytes = 1024;
constexpr size_t kMaxSections = 18;
constexpr size_t kSectionNameBytes = 40;  // a name is at most 39 bytes: the field always ends with a NUL
constexpr size_t kSectionSlotBytes = kSectionNameBytes + 8;

// Byte offsets of the header fields.
namespace at {
constexpr size_t magic = 0, version = 4, precision = 8, world = 12, ep = 16, rank = 20, step = 24, section_count = 28,
                 optimizer_steps = 32, data_shard = 40, data_position = 48, data_epoch = 56, sample_rng_draws = 64,
                 flags_bytes = 72, file_bytes = 80, model = 88, sections = 152,
                 header_checksum = sections + kMaxSections * kSectionSlotBytes;
static_assert(header_checksum + 8 == kHeaderBytes, "the header fields fill exactly kHeaderBytes");
}  // namespace at

struct RankFile {
  bool bf16 = false;  // written by the BF16 build
  int world = 1, ep = 1, rank = 0, step = 0;
  long long optimizer_steps = 0;
  data::DataLoader::State data{0, 0, 0};
  unsigned long long sample_rng_draws = 0;
  ModelConfig model;
  TrainConfig train;  // the flags of the run that wrote it
  std::vector<std::pair<std::string, std::vector<float>>> sections;
  std::string path;  // the file it was read from ("" when built in memory): names it in errors

  const std::vector<float>& section(const std::string& name) const {
    std::string names;
    for (const auto& [section_name, values] : sections) {
      if (section_name == name) return values;
      names += (names.empty() ? "" : ", ") + section_name;
    }
    throw std::runtime_error("checkpoint " + path + ": no section '" + name +
                             "' (it has: " + (names.empty() ? "none" : names) + ")");
  }
};

inline std::string rank_file(const std::string& dir, int rank) { return dir + "/rank" + std::to_string(rank) + ".bin"; }

// FNV-1a, 64 bits, fed in pieces.
struct Fnv1a64 {
  uint64_t state = 14695981039346656037ULL;
  void add(const void* data, size_t bytes) {
    const unsigned char* p = static_cast<const unsigned char*>(data);
    for (size_t i = 0; i < bytes; i++) state = (state ^ p[i]) * 1099511628211ULL;
  }
};

inline uint64_t fnv1a64(const void* data, size_t bytes) {
  Fnv1a64 hash;
  hash.add(data, bytes);
  return hash.state;
}

namespace detail {

template <typename T>
void put(unsigned char* bytes, size_t offset, T value) {
  std::memcpy(bytes + offset, &value, sizeof value);
}

template <typename T>
T get(const unsigned char* bytes, size_t offset) {
  T value;
  std::memcpy(&value, bytes + offset, sizeof value);
  return value;
}

// The model configuration's fields in their header order: integers, then floats.
using ModelIntField = int ModelConfig::*;
using ModelFloatField = float ModelConfig::*;
inline constexpr ModelIntField kModelInts[] = {
    &ModelConfig::vocab,     &ModelConfig::hidden,        &ModelConfig::layers,     &ModelConfig::heads,
    &ModelConfig::experts,   &ModelConfig::topk,          &ModelConfig::expert_dim, &ModelConfig::n_dense,
    &ModelConfig::dense_dim, &ModelConfig::shared_expert, &ModelConfig::seq_len,    &ModelConfig::score_fn,
    &ModelConfig::renorm};
inline constexpr ModelFloatField kModelFloats[] = {&ModelConfig::rope_theta, &ModelConfig::norm_eps,
                                                   &ModelConfig::init_std};
inline constexpr size_t kModelFloatsOffset = at::model + 4 * std::size(kModelInts);
static_assert(kModelFloatsOffset + 4 * std::size(kModelFloats) == at::sections,
              "the model fields, 4 bytes each, fill the header from at::model to the section table");

inline std::string precision_name(bool bf16) { return bf16 ? "BF16" : "FP32"; }

// One line per entry that differs: "NAME: A_LABEL a, B_LABEL b". `a` and `b` list the same names.
inline std::vector<std::string> differences(const std::vector<std::pair<std::string, std::string>>& a,
                                            const std::vector<std::pair<std::string, std::string>>& b,
                                            const std::string& a_label, const std::string& b_label) {
  std::vector<std::string> lines;
  for (size_t i = 0; i < a.size(); i++)
    if (a[i].second != b[i].second)
      lines.push_back(a[i].first + ": " + a_label + " " + a[i].second + ", " + b_label + " " + b[i].second);
  return lines;
}

inline std::string join(const std::vector<std::string>& lines, const std::string& separator) {
  std::string text;
  for (const std::string& line : lines) text += (text.empty() ? "" : separator) + line;
  return text;
}

// The model configuration as (field, value) text, fields named without their flag's "--".
inline std::vector<std::pair<std::string, std::string>> model_fields(const ModelConfig& c) {
  std::vector<std::pair<std::string, std::string>> fields = model_flag_values(c);
  for (auto& field : fields) field.first.erase(0, 2);
  return fields;
}

enum class Payload { keep, verify_only };

// Reads and checks a rank file; with Payload::verify_only the sections are checksummed but not kept.
inline RankFile load(const std::string& path, Payload payload) {
  const auto refusal = [&](const std::string& why) { return std::runtime_error("checkpoint " + path + ": " + why); };
  long long file_size = 0;
  std::unique_ptr<FILE, int (*)(FILE*)> file(nullptr, &std::fclose);
  try {
    file.reset(data::open_regular_file(path, &file_size));
  } catch (const std::runtime_error& e) {
    throw std::runtime_error(std::string("checkpoint ") + e.what());
  }
  const uint64_t size = (uint64_t)file_size;
  const auto read_exact = [&](void* into, size_t bytes) {
    if (bytes > 0 && std::fread(into, 1, bytes, file.get()) != bytes)
      throw refusal(std::ferror(file.get()) ? std::string("cannot read: ") + std::strerror(errno)
                                            : std::string("it changed while being read"));
  };
  Fnv1a64 hash;
  const auto read_hashed = [&](void* into, size_t bytes) {
    read_exact(into, bytes);
    hash.add(into, bytes);
  };

  unsigned char h[kHeaderBytes];
  const size_t header_read = std::fread(h, 1, kHeaderBytes, file.get());
  if (std::ferror(file.get())) throw refusal(std::string("cannot read: ") + std::strerror(errno));
  if (header_read >= 4 && get<uint32_t>(h, at::magic) != kMagic)
    throw refusal("bad magic number " + std::to_string(get<uint32_t>(h, at::magic)) + " (not a flatmoe checkpoint)");
  if (header_read >= 8 && get<uint32_t>(h, at::version) != kFormatVersion)
    throw refusal("unsupported version " + std::to_string(get<uint32_t>(h, at::version)) +
                  " (this build reads version " + std::to_string(kFormatVersion) + ")");
  if (header_read < kHeaderBytes)
    throw refusal("truncated: " + std::to_string(size) + " bytes, shorter than its " + std::to_string(kHeaderBytes) +
                  "-byte header");
  if (fnv1a64(h, at::header_checksum) != get<uint64_t>(h, at::header_checksum))
    throw refusal("checksum mismatch: the file is corrupt (in its header)");
  hash.add(h, kHeaderBytes);
  const uint64_t file_bytes = get<uint64_t>(h, at::file_bytes);
  if (size < file_bytes)
    throw refusal("truncated: " + std::to_string(size) + " bytes of the " + std::to_string(file_bytes) +
                  " it was written with");
  if (size > file_bytes)
    throw refusal("trailing bytes: " + std::to_string(size - file_bytes) + " after the " + std::to_string(file_bytes) +
                  " it was written with");

  // The header is what was written: its lengths are checked to add up before any allocation.
  RankFile f;
  f.path = path;
  f.bf16 = get<uint32_t>(h, at::precision) == 1;
  f.world = get<int32_t>(h, at::world);
  f.ep = get<int32_t>(h, at::ep);
  f.rank = get<int32_t>(h, at::rank);
  f.step = get<int32_t>(h, at::step);
  f.optimizer_steps = get<int64_t>(h, at::optimizer_steps);
  f.data.shard = (int)get<int64_t>(h, at::data_shard);
  f.data.position = get<int64_t>(h, at::data_position);
  f.data.epoch = get<int64_t>(h, at::data_epoch);
  f.sample_rng_draws = get<uint64_t>(h, at::sample_rng_draws);
  for (size_t i = 0; i < std::size(kModelInts); i++) f.model.*kModelInts[i] = get<int32_t>(h, at::model + 4 * i);
  for (size_t i = 0; i < std::size(kModelFloats); i++)
    f.model.*kModelFloats[i] = get<float>(h, kModelFloatsOffset + 4 * i);
  const auto malformed = [&](const std::string& why) { return refusal("malformed header: " + why); };
  const uint32_t section_count = get<uint32_t>(h, at::section_count);
  if (section_count > kMaxSections)
    throw malformed(std::to_string(section_count) + " sections, at most " + std::to_string(kMaxSections));
  const std::string lengths_differ = "its lengths do not add up to its " + std::to_string(file_bytes) + " bytes";
  if (file_bytes < kHeaderBytes + 8) throw malformed(lengths_differ);
  uint64_t unaccounted = file_bytes - kHeaderBytes - 8;  // what the flags text and the payloads must fill
  const uint64_t flags_bytes = get<uint64_t>(h, at::flags_bytes);
  if (flags_bytes > unaccounted) throw malformed(lengths_differ);
  unaccounted -= flags_bytes;
  std::vector<uint64_t> counts;
  for (uint32_t i = 0; i < section_count; i++) {
    const unsigned char* slot = h + at::sections + i * kSectionSlotBytes;
    const size_t name_bytes = strnlen(reinterpret_cast<const char*>(slot), kSectionNameBytes);
    if (name_bytes == kSectionNameBytes) throw malformed("section " + std::to_string(i) + " has no NUL-ended name");
    const uint64_t count = get<uint64_t>(slot, kSectionNameBytes);
    if (count > unaccounted / sizeof(float)) throw malformed(lengths_differ);
    unaccounted -= count * sizeof(float);
    counts.push_back(count);
    f.sections.emplace_back(std::string(reinterpret_cast<const char*>(slot), name_bytes), std::vector<float>());
  }
  if (unaccounted != 0) throw malformed(lengths_differ);

  std::string flags_text(flags_bytes, '\0');
  read_hashed(&flags_text[0], flags_bytes);
  std::vector<char> chunk(payload == Payload::verify_only ? 1 << 20 : 0);
  for (uint32_t i = 0; i < section_count; i++) {
    if (payload == Payload::keep) {
      std::vector<float>& values = f.sections[i].second;
      values.resize(counts[i]);
      read_hashed(values.data(), counts[i] * sizeof(float));
    } else {
      for (uint64_t left = counts[i] * sizeof(float); left > 0;) {
        const size_t piece = std::min<uint64_t>(left, chunk.size());
        read_hashed(chunk.data(), piece);
        left -= piece;
      }
    }
  }
  uint64_t stored;
  read_exact(&stored, sizeof stored);
  if (hash.state != stored) throw refusal("checksum mismatch: the file is corrupt");

  // Verified: what is left to check is what the writer was given.
  for (size_t start = 0; start < flags_text.size();) {
    const size_t end = flags_text.find('\n', start);
    const std::string line = flags_text.substr(start, end - start);
    const size_t space = line.find(' ');
    if (end == std::string::npos || space == std::string::npos)
      throw refusal("training flags: malformed line '" + line + "'");
    try {
      set_train_flag(f.train, line.substr(0, space), line.substr(space + 1));
    } catch (const std::exception& e) {
      throw refusal(std::string("training flags: ") + e.what());
    }
    start = end + 1;
  }
  try {
    validate(f.model);
  } catch (const std::exception& e) {
    throw refusal(std::string("invalid model configuration: ") + e.what());
  }
  return f;
}

// Whether `path` exists (a link counts, whatever it points to); throws on any other error.
inline bool path_exists(const std::string& path) {
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) return true;
  if (errno == ENOENT) return false;
  throw std::runtime_error("cannot inspect " + path + ": " + std::strerror(errno));
}

}  // namespace detail

// Writes PATH.part, flushes it to disk, and renames it to PATH; on any failure PATH.part is removed
// and PATH is untouched. Refuses, before touching the disk, a section table the header cannot hold
// and a flag value with a newline.
inline void write_rank_file(const std::string& path, const RankFile& f) {
  const auto failure = [&](const std::string& why) { return std::runtime_error("checkpoint " + path + ": " + why); };
  if (f.sections.size() > kMaxSections)
    throw failure(std::to_string(f.sections.size()) + " sections, the header holds at most " +
                  std::to_string(kMaxSections));
  for (size_t i = 0; i < f.sections.size(); i++) {
    const std::string& name = f.sections[i].first;
    if (name.empty() || name.size() >= kSectionNameBytes || name.find('\0') != std::string::npos)
      throw failure("section " + std::to_string(i) + ": its name must have 1 to " +
                    std::to_string(kSectionNameBytes - 1) + " bytes and no NUL byte (it has " +
                    std::to_string(name.size()) + ")");
    for (size_t j = 0; j < i; j++)
      if (f.sections[j].first == name) throw failure("two sections are named '" + name + "'");
  }
  std::string flags_text;
  for (const auto& [flag, value] : train_flag_values(f.train)) {
    if (value.find('\n') != std::string::npos) throw failure("the value of " + flag + " has a newline");
    flags_text += flag + " " + value + "\n";
  }

  unsigned char h[kHeaderBytes] = {};
  using detail::put;
  put<uint32_t>(h, at::magic, kMagic);
  put<uint32_t>(h, at::version, kFormatVersion);
  put<uint32_t>(h, at::precision, f.bf16 ? 1 : 0);
  put<int32_t>(h, at::world, f.world);
  put<int32_t>(h, at::ep, f.ep);
  put<int32_t>(h, at::rank, f.rank);
  put<int32_t>(h, at::step, f.step);
  put<uint32_t>(h, at::section_count, (uint32_t)f.sections.size());
  put<int64_t>(h, at::optimizer_steps, f.optimizer_steps);
  put<int64_t>(h, at::data_shard, f.data.shard);
  put<int64_t>(h, at::data_position, f.data.position);
  put<int64_t>(h, at::data_epoch, f.data.epoch);
  put<uint64_t>(h, at::sample_rng_draws, f.sample_rng_draws);
  put<uint64_t>(h, at::flags_bytes, flags_text.size());
  for (size_t i = 0; i < std::size(detail::kModelInts); i++)
    put<int32_t>(h, at::model + 4 * i, f.model.*detail::kModelInts[i]);
  for (size_t i = 0; i < std::size(detail::kModelFloats); i++)
    put<float>(h, detail::kModelFloatsOffset + 4 * i, f.model.*detail::kModelFloats[i]);
  uint64_t file_bytes = kHeaderBytes + flags_text.size() + 8;
  for (size_t i = 0; i < f.sections.size(); i++) {
    unsigned char* slot = h + at::sections + i * kSectionSlotBytes;
    std::memcpy(slot, f.sections[i].first.data(), f.sections[i].first.size());
    put<uint64_t>(slot, kSectionNameBytes, f.sections[i].second.size());
    file_bytes += f.sections[i].second.size() * sizeof(float);
  }
  put<uint64_t>(h, at::file_bytes, file_bytes);
  put<uint64_t>(h, at::header_checksum, fnv1a64(h, at::header_checksum));

  const std::string part = path + ".part";
  FILE* file = std::fopen(part.c_str(), "wb");
  if (!file) throw failure("cannot create " + part + ": " + std::strerror(errno));
  const auto abandon = [&](const std::string& what) {
    const std::string why = std::strerror(errno);
    if (file) std::fclose(file);
    std::remove(part.c_str());
    return failure(what + ": " + why);
  };
  Fnv1a64 hash;
  const auto write_bytes = [&](const void* data, size_t bytes) {
    if (bytes > 0 && std::fwrite(data, 1, bytes, file) != bytes) throw abandon("cannot write " + part);
  };
  const auto write_hashed = [&](const void* data, size_t bytes) {
    hash.add(data, bytes);
    write_bytes(data, bytes);
  };
  write_hashed(h, kHeaderBytes);
  write_hashed(flags_text.data(), flags_text.size());
  for (const auto& section : f.sections) write_hashed(section.second.data(), section.second.size() * sizeof(float));
  const uint64_t checksum = hash.state;
  write_bytes(&checksum, sizeof checksum);
  if (std::fflush(file) != 0 || fsync(fileno(file)) != 0) throw abandon("cannot flush " + part + " to disk");
  const int closed = std::fclose(file);
  file = nullptr;
  if (closed != 0) throw abandon("cannot close " + part);
  if (std::rename(part.c_str(), path.c_str()) != 0) throw abandon("cannot rename " + part + " to " + path);
}

inline RankFile read_rank_file(const std::string& path) { return detail::load(path, detail::Payload::keep); }

// "" when the two configurations are equal; otherwise every differing field with both values:
// "hidden: checkpoint 384, flags 512; topk: checkpoint 2, flags 4".
inline std::string model_config_difference(const ModelConfig& checkpoint, const ModelConfig& flags) {
  return detail::join(
      detail::differences(detail::model_fields(checkpoint), detail::model_fields(flags), "checkpoint", "flags"), "; ");
}

// Every training flag whose value differs, except --resume: "--lr: checkpoint 0.001, now 0.002".
inline std::vector<std::string> train_flag_differences(const TrainConfig& checkpoint, const TrainConfig& now) {
  auto without_resume = [](std::vector<std::pair<std::string, std::string>> values) {
    values.erase(std::remove_if(values.begin(), values.end(), [](const auto& v) { return v.first == "--resume"; }),
                 values.end());
    return values;
  };
  return detail::differences(without_resume(train_flag_values(checkpoint)), without_resume(train_flag_values(now)),
                             "checkpoint", "now");
}

// Checks a checkpoint directory before any GPU or NCCL work: each of rank0.bin .. rank<world-1>.bin
// opens and passes every check of read_rank_file (its checksum included), holds the rank its name
// says, was written by `world` ranks of the `bf16` (or FP32) build, and agrees with rank0.bin on E_p,
// the step, the optimizer's step count, the data loader state, the sample draws and the model
// configuration. Refuses naming the file and the field. Returns rank0.bin's header and training flags
// (its sections are checked, not kept).
inline RankFile check_checkpoint_set(const std::string& dir, int world, bool bf16) {
  const auto set_fields = [](const RankFile& f) {
    std::vector<std::pair<std::string, std::string>> fields = {
        {"E_p", std::to_string(f.ep)},
        {"step", std::to_string(f.step)},
        {"optimizer steps", std::to_string(f.optimizer_steps)},
        {"data loader state", "shard " + std::to_string(f.data.shard) + " position " + std::to_string(f.data.position) +
                                  " epoch " + std::to_string(f.data.epoch)},
        {"sample draws", std::to_string(f.sample_rng_draws)}};
    for (const auto& field : detail::model_fields(f.model)) fields.push_back(field);
    return fields;
  };
  RankFile first;
  for (int rank = 0; rank < world; rank++) {
    const std::string path = rank_file(dir, rank);
    const RankFile f = detail::load(path, detail::Payload::verify_only);
    const auto refusal = [&](const std::string& why) { return std::runtime_error("checkpoint " + path + ": " + why); };
    if (f.world != world)
      throw refusal("W: written by a run of W=" + std::to_string(f.world) +
                    "; this run has W=" + std::to_string(world));
    if (f.rank != rank) throw refusal("rank: the file holds rank " + std::to_string(f.rank));
    if (f.bf16 != bf16)
      throw refusal("precision: written by the " + detail::precision_name(f.bf16) + " build; this is the " +
                    detail::precision_name(bf16) + " build");
    if (rank == 0) {
      first = f;
      continue;
    }
    const std::vector<std::string> disagreements =
        detail::differences(set_fields(first), set_fields(f), "rank0.bin", "rank" + std::to_string(rank) + ".bin");
    if (!disagreements.empty()) throw refusal("disagrees with rank0.bin on " + detail::join(disagreements, "; "));
  }
  return first;
}

// Whether `name` is a file that a save writes into a checkpoint folder: rank<R>.bin, or
// rank<R>.bin.part while write_rank_file writes it.
inline bool is_checkpoint_file_name(const std::string& name) {
  const std::string base = name.size() > 5 && name.compare(name.size() - 5, 5, ".part") == 0 ? name.substr(0, name.size() - 5) : name;
  if (base.size() < 9 || base.compare(0, 4, "rank") != 0 || base.compare(base.size() - 4, 4, ".bin") != 0) return false;
  return std::all_of(base.begin() + 4, base.end() - 4, [](char c) { return c >= '0' && c <= '9'; });
}

namespace detail {

// The entries of a checkpoint folder that a save wrote (or left half-written): `path` must be a
// folder, not a link, that holds only plain files named as a save names them (is_checkpoint_file_name).
// Throws, naming the path and what it holds, for anything else: a save never deletes what it did
// not write.
inline std::vector<std::string> checkpoint_dir_entries(const std::string& path) {
  const auto refusal = [&](const std::string& why) {
    return std::runtime_error("refusing to remove " + path + ": " + why + " (a checkpoint folder holds only rank<R>.bin files)");
  };
  struct stat st;
  if (lstat(path.c_str(), &st) != 0) throw std::runtime_error("cannot inspect " + path + ": " + std::strerror(errno));
  if (!S_ISDIR(st.st_mode)) throw refusal(S_ISLNK(st.st_mode) ? "it is a link" : "it is not a folder");
  DIR* dir = opendir(path.c_str());
  if (!dir) throw std::runtime_error("cannot open directory " + path + ": " + std::strerror(errno));
  std::vector<std::string> entries;
  std::string foreign;
  errno = 0;
  while (const dirent* entry = readdir(dir)) {
    const std::string name = entry->d_name;
    if (name == "." || name == "..") continue;
    struct stat entry_st;
    const std::string entry_path = path + "/" + name;
    if (!is_checkpoint_file_name(name) || lstat(entry_path.c_str(), &entry_st) != 0 || !S_ISREG(entry_st.st_mode)) {
      foreign = name;
      break;
    }
    entries.push_back(entry_path);
    errno = 0;
  }
  const int listing_errno = errno;
  closedir(dir);
  if (!foreign.empty()) throw refusal("it holds " + foreign + ", which a checkpoint save does not write");
  if (listing_errno != 0)
    throw std::runtime_error("cannot list directory " + path + ": " + std::strerror(listing_errno));
  return entries;
}

}  // namespace detail

// Removes a checkpoint folder that a save wrote or left half-written (detail::checkpoint_dir_entries:
// its rank files and nothing else); a missing path is fine. Anything else is refused before anything
// is removed, naming the path and what it holds.
inline void remove_checkpoint_dir(const std::string& path) {
  if (!detail::path_exists(path)) return;
  for (const std::string& entry : detail::checkpoint_dir_entries(path))
    if (unlink(entry.c_str()) != 0) throw std::runtime_error("cannot remove " + entry + ": " + std::strerror(errno));
  if (rmdir(path.c_str()) != 0) throw std::runtime_error("cannot remove " + path + ": " + std::strerror(errno));
}

// `path` as a new, empty directory. A folder left there by an interrupted save is removed first;
// anything else at `path` is refused (remove_checkpoint_dir).
inline void make_empty_dir(const std::string& path) {
  remove_checkpoint_dir(path);
  if (mkdir(path.c_str(), 0755) != 0)
    throw std::runtime_error("cannot create directory " + path + ": " + std::strerror(errno));
}

// Replaces `dir` by `tmp_dir`: dir -> dir.old (when dir exists), tmp_dir -> dir, then dir.old is
// removed. When the second rename fails, dir.old goes back to dir and the call throws, so the
// previous set stays in place. A dir.old that an earlier publish left behind is stale when dir
// exists and removed first; when dir is missing it may be the only complete set, and it is removed
// only once the new set is in place. A dir or dir.old that is not a checkpoint folder (its rank files
// only: remove_checkpoint_dir) is refused before anything moves.
inline void publish_dir(const std::string& tmp_dir, const std::string& dir) {
  const std::string old_dir = dir + ".old";
  const bool had_dir = detail::path_exists(dir);
  for (const std::string& replaced : {dir, old_dir})
    if (detail::path_exists(replaced)) detail::checkpoint_dir_entries(replaced);
  if (had_dir) {
    remove_checkpoint_dir(old_dir);
    if (std::rename(dir.c_str(), old_dir.c_str()) != 0)
      throw std::runtime_error("cannot move " + dir + " aside to " + old_dir + ": " + std::strerror(errno));
  }
  if (std::rename(tmp_dir.c_str(), dir.c_str()) != 0) {
    const std::string why = std::strerror(errno);
    if (had_dir && std::rename(old_dir.c_str(), dir.c_str()) != 0)
      throw std::runtime_error("cannot move " + tmp_dir + " to " + dir + ": " + why + "; the previous set is left in " +
                               old_dir + " (cannot move it back: " + std::strerror(errno) + ")");
    throw std::runtime_error("cannot move " + tmp_dir + " to " + dir + ": " + why +
                             (had_dir ? " (the previous set is kept)" : ""));
  }
  remove_checkpoint_dir(old_dir);
}

}  // namespace ckpt
