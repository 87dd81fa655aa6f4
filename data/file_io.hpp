// data/file_io.hpp — byte-level file helpers shared by the tokenizer and the token shards:
// little-endian int32 packing (the files are little-endian whatever the host), whole-file reads,
// and AtomicFileWriter, which writes PATH.tmp and renames it over PATH only once every byte is
// out, so a failure never leaves a half-written file and never loses the file already there.
#pragma once
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <utility>

namespace data {

// llm.c's binary files start with a header of 256 little-endian int32 words.
constexpr int kHeaderWords = 256;
constexpr long long kHeaderBytes = kHeaderWords * 4;

inline void append_i32_le(std::string& out, int32_t value) {
  const uint32_t u = uint32_t(value);
  for (int i = 0; i < 4; i++) out.push_back(char((u >> (8 * i)) & 0xFF));
}

inline int32_t load_i32_le(const unsigned char* p) {
  return int32_t(uint32_t(p[0]) | uint32_t(p[1]) << 8 | uint32_t(p[2]) << 16 | uint32_t(p[3]) << 24);
}

// The whole content of `path`; throws naming the file when it cannot be opened or read.
inline std::string read_whole_file(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
  std::string bytes;
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, f)) > 0) bytes.append(buf, got);
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) throw std::runtime_error(path + ": read error");
  return bytes;
}

class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path) : path_(std::move(path)), tmp_path_(path_ + ".tmp") {
    file_ = std::fopen(tmp_path_.c_str(), "wb");
    if (!file_) throw std::runtime_error(path_ + ": cannot create " + tmp_path_ + ": " + std::strerror(errno));
  }
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;
  // Not committed (an exception on the way): the temporary file goes, PATH is untouched.
  ~AtomicFileWriter() {
    if (file_) {
      std::fclose(file_);
      std::remove(tmp_path_.c_str());
    }
  }

  void write(const void* data, size_t bytes) {
    if (bytes > 0 && std::fwrite(data, 1, bytes, file_) != bytes) fail("write to " + tmp_path_ + " failed");
  }
  void write(const std::string& bytes) { write(bytes.data(), bytes.size()); }

  // Flushes, closes and renames PATH.tmp over PATH.
  void commit() {
    if (std::fflush(file_) != 0) fail("flush of " + tmp_path_ + " failed");
    const int closed = std::fclose(file_);
    file_ = nullptr;
    if (closed != 0) {
      const std::string why = std::strerror(errno);
      std::remove(tmp_path_.c_str());
      throw std::runtime_error(path_ + ": close of " + tmp_path_ + " failed: " + why);
    }
    if (std::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
      const std::string why = std::strerror(errno);
      std::remove(tmp_path_.c_str());
      throw std::runtime_error(path_ + ": cannot rename " + tmp_path_ + " into place: " + why);
    }
  }

 private:
  [[noreturn]] void fail(const std::string& what) {
    const std::string why = std::strerror(errno);
    std::fclose(file_);
    file_ = nullptr;
    std::remove(tmp_path_.c_str());
    throw std::runtime_error(path_ + ": " + what + ": " + why);
  }

  std::string path_, tmp_path_;
  FILE* file_ = nullptr;
};

}  // namespace data
