// data/shards.hpp — token shards in llm.c's format, little-endian:
//   header 256 × int32 = [0] magic, [1] version, [2] number of tokens n (> 0), the rest 0;
//   then n tokens.
// Two variants, identified by the (magic, version) pair:
//   uint16 tokens: magic 20240520, version 1 (GPT-2 style, llm.c's own shards; vocab ≤ 65535)
//   uint32 tokens: magic 20240801, version 7 (llm.c's LLaMA-3 format; vocab > 65535)
// A file is accepted only when its size is exactly 1024 + n · bytes per token.
#pragma once
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "file_io.hpp"

namespace data {

constexpr int32_t kShardMagicU16 = 20240520, kShardVersionU16 = 1;
constexpr int32_t kShardMagicU32 = 20240801, kShardVersionU32 = 7;

struct ShardInfo {
  long long num_tokens;
  int bytes_per_token;  // 2 or 4
};

// Writes a shard of exactly `num_tokens` tokens that arrive in pieces (append), so that a writer
// holds none of them: the header goes out first, each piece is checked and converted as it comes,
// and commit() renames PATH.tmp to PATH once all num_tokens have been appended (AtomicFileWriter:
// a writer destroyed before commit() leaves no file). uint16 tokens when vocab_size ≤ 65535,
// uint32 otherwise.
class ShardWriter {
 public:
  ShardWriter(const std::string& path, long long num_tokens, int vocab_size)
      : path_(path), num_tokens_(num_tokens), vocab_size_(vocab_size), width_(vocab_size > 65535 ? 4 : 2),
        out_(checked(path, num_tokens, vocab_size)) {
    std::string header;
    int32_t words[kHeaderWords] = {};
    words[0] = width_ == 4 ? kShardMagicU32 : kShardMagicU16;
    words[1] = width_ == 4 ? kShardVersionU32 : kShardVersionU16;
    words[2] = int32_t(num_tokens);
    for (int32_t word : words) append_i32_le(header, word);
    out_.write(header);
  }

  // Appends tokens[0, n), each in [0, vocab_size); refuses more than num_tokens in all.
  void append(const int* tokens, size_t n) {
    if ((long long)n > num_tokens_ - written_)
      throw refuse(std::to_string(written_ + (long long)n) + " tokens appended, more than the " +
                   std::to_string(num_tokens_) + " of its header");
    bytes_.clear();
    for (size_t i = 0; i < n; i++) {
      const int token = tokens[i];
      if (token < 0 || token >= vocab_size_)
        throw refuse("token " + std::to_string(written_ + (long long)i) + " = " + std::to_string(token) +
                     " outside the vocabulary [0, " + std::to_string(vocab_size_) + ")");
      for (int b = 0; b < width_; b++) bytes_.push_back(char((uint32_t(token) >> (8 * b)) & 0xFF));
    }
    out_.write(bytes_);
    written_ += (long long)n;
  }

  void commit() {
    if (written_ != num_tokens_)
      throw refuse(std::to_string(written_) + " tokens appended, fewer than the " + std::to_string(num_tokens_) +
                   " of its header");
    out_.commit();
  }

 private:
  // `path`, once the sizes are known to be writable (before the file is created).
  static const std::string& checked(const std::string& path, long long num_tokens, int vocab_size) {
    if (vocab_size <= 0)
      throw std::runtime_error("shard " + path + ": vocab size " + std::to_string(vocab_size) + " must be positive");
    if (num_tokens <= 0) throw std::runtime_error("shard " + path + ": no tokens to write");
    if (num_tokens > std::numeric_limits<int32_t>::max())
      throw std::runtime_error("shard " + path + ": " + std::to_string(num_tokens) +
                               " tokens do not fit the int32 token count of the header");
    return path;
  }
  std::runtime_error refuse(const std::string& why) const { return std::runtime_error("shard " + path_ + ": " + why); }

  std::string path_;
  long long num_tokens_, written_ = 0;
  int vocab_size_, width_;
  AtomicFileWriter out_;
  std::string bytes_;  // one piece in the file's byte order
};

// Writes `tokens` (each in [0, vocab_size)) to `path` via PATH.tmp + rename (ShardWriter, in one piece).
inline void write_shard(const std::string& path, const std::vector<int>& tokens, int vocab_size) {
  ShardWriter out(path, (long long)tokens.size(), vocab_size);
  out.append(tokens.data(), tokens.size());
  out.commit();
}

// `path` opened for reading its tokens; refuses naming the shard and why it cannot be opened.
inline FILE* open_shard_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error("shard " + path + ": cannot open: " + std::strerror(errno));
  return f;
}

// Validates the header and the file size of a shard without reading its tokens.
inline ShardInfo read_shard_header(const std::string& path) {
  auto refuse = [&](const std::string& why) { return std::runtime_error("shard " + path + ": " + why); };
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (ec) throw refuse("cannot read its size: " + ec.message());
  if ((long long)size < kHeaderBytes)
    throw refuse("truncated header (" + std::to_string(size) + " bytes, the header alone is " +
                 std::to_string(kHeaderBytes) + ")");
  FILE* f = open_shard_file(path);
  unsigned char header[kHeaderBytes];
  const size_t got = std::fread(header, 1, sizeof header, f);
  std::fclose(f);
  if (got != sizeof header) throw refuse("cannot read the header");
  const int32_t magic = load_i32_le(header), version = load_i32_le(header + 4), n = load_i32_le(header + 8);
  int width;
  if (magic == kShardMagicU16 && version == kShardVersionU16) {
    width = 2;
  } else if (magic == kShardMagicU32 && version == kShardVersionU32) {
    width = 4;
  } else if (magic == kShardMagicU16 || magic == kShardMagicU32) {
    throw refuse("magic " + std::to_string(magic) + " with unsupported version " + std::to_string(version) +
                 " (expected " + std::to_string(magic == kShardMagicU16 ? kShardVersionU16 : kShardVersionU32) + ")");
  } else {
    throw refuse("bad magic " + std::to_string(magic) + " (expected " + std::to_string(kShardMagicU16) +
                 " for uint16 tokens or " + std::to_string(kShardMagicU32) + " for uint32 tokens)");
  }
  if (n <= 0) throw refuse("token count " + std::to_string(n) + " in the header must be positive");
  const long long expected = kHeaderBytes + (long long)n * width;
  if ((long long)size != expected)
    throw refuse(std::string((long long)size < expected ? "truncated" : "trailing bytes") + ": " +
                 std::to_string(size) + " bytes, expected " + std::to_string(expected) + " for " + std::to_string(n) +
                 " tokens of " + std::to_string(width) + " bytes");
  return {n, width};
}

inline std::vector<int> read_shard(const std::string& path) {
  const ShardInfo info = read_shard_header(path);
  FILE* f = open_shard_file(path);
  std::vector<unsigned char> raw(size_t(info.num_tokens) * info.bytes_per_token);
  const bool ok = std::fseek(f, long(kHeaderBytes), SEEK_SET) == 0 && std::fread(raw.data(), 1, raw.size(), f) == raw.size();
  std::fclose(f);
  if (!ok) throw std::runtime_error("shard " + path + ": cannot read its tokens");
  std::vector<int> tokens(size_t(info.num_tokens));
  for (size_t i = 0; i < tokens.size(); i++) {
    const unsigned char* p = raw.data() + i * info.bytes_per_token;
    if (info.bytes_per_token == 2) {
      tokens[i] = int(p[0]) | int(p[1]) << 8;
    } else {
      const int32_t token = load_i32_le(p);
      if (token < 0)
        throw std::runtime_error("shard " + path + ": token " + std::to_string(i) + " = " +
                                 std::to_string(uint32_t(token)) + " does not fit an int");
      tokens[i] = token;
    }
  }
  return tokens;
}

}  // namespace data
