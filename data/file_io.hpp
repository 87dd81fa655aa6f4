// data/file_io.hpp — byte-level file helpers shared by the tokenizer and the token shards:
// little-endian int32 packing (the files are little-endian whatever the host), whole-file reads
// (of a regular file only: a folder, a FIFO or a device such as /dev/zero is refused by name, so a
// read is bounded by the file's size and never blocks), and AtomicFileWriter, which writes PATH.tmp
// and renames it over PATH only once every byte is out, so a failure never leaves a half-written
// file and never loses the file already there. PATH.tmp is created new: an existing one (a link
// included) is refused, never truncated, written through or removed.
#pragma once
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

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

// `path` opened for reading when it is a regular file (a link to one is followed); throws naming the
// file and why otherwise: it cannot be opened (strerror), or it is a folder, a FIFO, a device...
// Opened without blocking, so that a FIFO is refused, not waited on. `*bytes`: its size.
inline FILE* open_regular_file(const std::string& path, long long* bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error(path + ": cannot open: " + std::strerror(errno));
  struct stat st;
  if (fstat(fd, &st) != 0) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error(path + ": cannot stat: " + why);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    const char* kind = S_ISDIR(st.st_mode)                          ? "a folder, "
                       : S_ISFIFO(st.st_mode)                        ? "a FIFO, "
                       : S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) ? "a device, "
                                                                     : "";
    throw std::runtime_error(path + ": is " + kind + "not a regular file");
  }
  FILE* f = fdopen(fd, "rb");
  if (!f) {
    const std::string why = std::strerror(errno);
    ::close(fd);
    throw std::runtime_error(path + ": cannot open: " + why);
  }
  *bytes = (long long)st.st_size;
  return f;
}

// The whole content of the regular file `path` (open_regular_file), at most its size when opened;
// throws naming the file when it cannot be opened or read.
inline std::string read_whole_file(const std::string& path) {
  long long size = 0;
  FILE* f = open_regular_file(path, &size);
  std::string bytes(size_t(size), '\0');
  const size_t got = size > 0 ? std::fread(&bytes[0], 1, bytes.size(), f) : 0;
  const bool failed = std::ferror(f) != 0;
  const std::string why = std::strerror(errno);
  std::fclose(f);
  if (failed) throw std::runtime_error(path + ": read error: " + why);
  bytes.resize(got);  // a file cut while it was read: the caller's size checks name it
  return bytes;
}

class AtomicFileWriter {
 public:
  explicit AtomicFileWriter(std::string path) : path_(std::move(path)), tmp_path_(path_ + ".tmp") {
    const int fd = ::open(tmp_path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd < 0 && errno == EEXIST)
      throw std::runtime_error(path_ + ": cannot create " + tmp_path_ +
                               ": it exists (left by an interrupted run, or not this program's file); remove it or "
                               "choose another path");
    if (fd < 0) throw std::runtime_error(path_ + ": cannot create " + tmp_path_ + ": " + std::strerror(errno));
    file_ = fdopen(fd, "wb");
    if (!file_) {
      const std::string why = std::strerror(errno);
      ::close(fd);
      std::remove(tmp_path_.c_str());
      throw std::runtime_error(path_ + ": cannot create " + tmp_path_ + ": " + why);
    }
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
