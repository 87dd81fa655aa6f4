// data/prepare.cpp — the `prepare` tool: a text corpus → a BPE tokenizer and llm.c token shards.
//
//   prepare [--input PATH] [--out DIR] [--vocab N] [--val-frac F] [--seed S]
//
// --input: a UTF-8 text file or a folder (default /usr/share/games/fortunes, Debian's fortunes).
//   In a folder: its regular files, in name order, skipping *.dat (strfile index) files, symlinks
//   and files that are not valid UTF-8 text (with a note). A file with a line that is exactly "%"
//   (ended by "\n", by DOS's "\r\n", or by the end of the file) is a fortune file: its documents
//   are the texts between such lines; any other file is one document. Documents that are empty or only whitespace are dropped.
// The documents are shuffled with --seed (own Fisher–Yates over mt19937_64, the same on every
// platform); the last --val-frac of them are the validation set. The tokenizer is trained on the
// training documents only. Every document is encoded and followed by <|endoftext|>.
// Writes the set DIR/tokenizer.bin, DIR/train_000.bin, DIR/val_000.bin as one (notes/design.md §9): into the
// folder DIR.tmp beside DIR, which becomes DIR once every file is out (an existing DIR is moved to
// DIR.old first and removed after). A failure removes DIR.tmp and leaves the previous DIR intact.
// An existing DIR may hold only those three files (anything else is refused before any work), and
// a DIR.old left by an interrupted run is refused (it holds the previous set).
// Build: g++ -std=c++17 -O2 -I. data/prepare.cpp -o build/prepare
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "data/shards.hpp"
#include "data/tokenizer.hpp"

namespace fs = std::filesystem;

namespace {

const char* const kUsage = "usage: prepare [--input PATH] [--out DIR] [--vocab N] [--val-frac F] [--seed S]";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct Options {
  std::string input = "/usr/share/games/fortunes";
  std::string out = "data/fortunes";
  int vocab = 4096;
  double val_frac = 0.05;
  unsigned long long seed = 1337;
};

long long parse_integer(const std::string& flag, const std::string& text) {
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used, 10);
  } catch (const std::exception&) {
    used = 0;
  }
  if (text.empty() || used != text.size() || text[0] == ' ')
    throw UsageError(flag + " needs an integer, got '" + text + "'");
  return value;
}

Options parse_args(int argc, char** argv) {
  Options opt;
  for (int i = 1; i < argc; i++) {
    const std::string flag = argv[i];
    if (flag == "-h" || flag == "--help") {
      std::printf("%s\n", kUsage);
      std::exit(0);
    }
    if (flag != "--input" && flag != "--out" && flag != "--vocab" && flag != "--val-frac" && flag != "--seed")
      throw UsageError("unknown flag '" + flag + "'");
    if (i + 1 >= argc) throw UsageError(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--input") {
      opt.input = value;
    } else if (flag == "--out") {
      opt.out = value;
      while (opt.out.size() > 1 && opt.out.back() == '/') opt.out.pop_back();  // DIR.tmp beside DIR, not in it
      if (opt.out.empty() || opt.out == "/") throw UsageError("--out needs a folder, got '" + value + "'");
    } else if (flag == "--vocab") {
      const long long vocab = parse_integer(flag, value);
      if (vocab < 257 || vocab > 1000000)
        throw UsageError("--vocab " + value + " is outside [257, 1000000] (256 bytes + <|endoftext|> at least)");
      opt.vocab = int(vocab);
    } else if (flag == "--val-frac") {
      size_t used = 0;
      double frac = 0;
      try {
        frac = std::stod(value, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (value.empty() || used != value.size()) throw UsageError("--val-frac needs a number, got '" + value + "'");
      if (!(frac > 0 && frac < 1)) throw UsageError("--val-frac " + value + " is outside (0, 1)");
      opt.val_frac = frac;
    } else {
      const long long seed = parse_integer(flag, value);
      if (seed < 0) throw UsageError("--seed " + value + " must be non-negative");
      opt.seed = (unsigned long long)seed;
    }
  }
  std::error_code ec;
  if (!fs::exists(opt.input, ec)) throw UsageError("input " + opt.input + " does not exist");
  return opt;
}

// Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF) without NUL bytes.
bool is_utf8_text(const std::string& s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  for (size_t i = 0; i < n;) {
    const unsigned char c = p[i];
    if (c == 0) return false;
    if (c < 0x80) {
      i++;
      continue;
    }
    size_t len;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // overlong
      if (c == 0xED) hi = 0x9F;  // surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // overlong
      if (c == 0xF4) hi = 0x8F;  // above U+10FFFF
    } else {
      return false;
    }
    if (i + len > n || p[i + 1] < lo || p[i + 1] > hi) return false;
    for (size_t k = 2; k < len; k++)
      if (p[i + k] < 0x80 || p[i + k] > 0xBF) return false;
    i += len;
  }
  return true;
}

bool only_whitespace(const std::string& s) { return s.find_first_not_of(" \t\n\r\f\v") == std::string::npos; }

// A fortune separator: a line (with its '\n' when it has one) that is exactly "%".
bool is_fortune_separator(std::string_view line) {
  return line == "%\n" || line == "%\r\n" || line == "%" || line == "%\r";
}

// The documents of one file's text (see the header comment): without a separator line the loop
// gathers the whole text into one document.
void split_documents(const std::string& text, std::vector<std::string>& documents) {
  std::string current;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    end = end == std::string::npos ? text.size() : end + 1;  // the line with its '\n'
    const std::string_view line(text.data() + pos, end - pos);
    if (is_fortune_separator(line)) {
      if (!only_whitespace(current)) documents.push_back(current);
      current.clear();
    } else {
      current.append(line);
    }
    pos = end;
  }
  if (!only_whitespace(current)) documents.push_back(current);
}

std::vector<std::string> load_documents(const std::string& input) {
  std::vector<std::string> documents;
  std::error_code ec;
  if (fs::is_directory(input, ec)) {
    std::vector<fs::path> entries;
    for (const fs::directory_entry& entry : fs::directory_iterator(input, ec)) entries.push_back(entry.path());
    if (ec) throw std::runtime_error("input " + input + ": cannot list the folder: " + ec.message());
    std::sort(entries.begin(), entries.end());
    int used = 0, dat = 0, links = 0, other = 0;
    for (const fs::path& path : entries) {
      if (fs::is_symlink(fs::symlink_status(path, ec))) {
        links++;
      } else if (!fs::is_regular_file(fs::status(path, ec))) {
        other++;
      } else if (path.extension() == ".dat") {
        dat++;
      } else {
        const std::string text = data::read_whole_file(path.string());
        if (!is_utf8_text(text)) {
          std::printf("prepare: note: skipping %s: not valid UTF-8 text\n", path.c_str());
          other++;
          continue;
        }
        split_documents(text, documents);
        used++;
      }
    }
    std::printf("prepare: input %s: %d text files (skipped %d .dat index files, %d symlinks, %d others)\n",
                input.c_str(), used, dat, links, other);
  } else if (fs::is_regular_file(input, ec)) {
    const std::string text = data::read_whole_file(input);
    if (!is_utf8_text(text)) throw std::runtime_error("input " + input + " is not valid UTF-8 text");
    split_documents(text, documents);
    std::printf("prepare: input %s: 1 text file\n", input.c_str());
  } else {
    throw std::runtime_error("input " + input + " is neither a regular file nor a folder");
  }
  if (documents.size() < 2)
    throw std::runtime_error("input " + input + " holds " + std::to_string(documents.size()) +
                             " document(s); a train and a validation split need at least 2");
  return documents;
}

// Token ids as "|tok|tok|…" with bytes outside printable ASCII escaped.
std::string show_tokens(const data::Tokenizer& tok, const std::vector<int>& ids, size_t max_tokens) {
  std::string out = "|";
  for (size_t i = 0; i < ids.size() && i < max_tokens; i++) {
    for (unsigned char c : tok.decode_token(ids[i])) {
      if (c == '\n') {
        out += "\\n";
      } else if (c >= 0x20 && c != 0x7F) {
        out += char(c);
      } else {
        char esc[8];
        std::snprintf(esc, sizeof esc, "\\x%02x", c);
        out += esc;
      }
    }
    out += "|";
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// The output set

const char* const kTokenizerFile = "tokenizer.bin";
const char* const kTrainFile = "train_000.bin";
const char* const kValFile = "val_000.bin";
const char* const kSetFiles[] = {kTokenizerFile, kTrainFile, kValFile};

bool path_exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(path, ec));
}

// Refuses, before any work, an output that cannot be replaced as a set: DIR that is not a folder or
// that holds anything but the set's files, and a DIR.old left by a run interrupted while swapping.
void check_output(const std::string& out) {
  const std::string old = out + ".old";
  if (path_exists(old))
    throw std::runtime_error(old + " exists: an interrupted prepare left the previous set there; move it back to " +
                             out + " or remove it");
  if (!path_exists(out)) return;
  std::error_code ec;
  if (!fs::is_directory(fs::symlink_status(out, ec))) throw std::runtime_error("output " + out + " exists and is not a folder");
  for (const fs::directory_entry& entry : fs::directory_iterator(out, ec)) {
    const std::string name = entry.path().filename().string();
    const bool set_file = std::find_if(std::begin(kSetFiles), std::end(kSetFiles),
                                       [&](const char* file) { return name == file; }) != std::end(kSetFiles);
    if (!set_file || !fs::is_regular_file(entry.symlink_status(ec)))
      throw std::runtime_error("output folder " + out + " holds " + name +
                               ", which is not one of the files prepare writes; refusing to replace the folder");
  }
  if (ec) throw std::runtime_error("output folder " + out + ": cannot list it: " + ec.message());
}

// Unlinks every entry of `folder` (files only; a folder inside is not removed), then removes it.
// Returns "" or what could not be removed.
std::string remove_folder_of_files(const std::string& folder) {
  std::error_code ec;
  std::vector<fs::path> entries;
  for (const fs::directory_entry& entry : fs::directory_iterator(folder, ec)) entries.push_back(entry.path());
  if (ec) return "cannot list " + folder + ": " + ec.message();
  for (const fs::path& path : entries)
    if (::unlink(path.c_str()) != 0) return "cannot remove " + path.string() + ": " + std::strerror(errno);
  if (::rmdir(folder.c_str()) != 0) return "cannot remove the folder " + folder + ": " + std::strerror(errno);
  return "";
}

void rename_or_throw(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    throw std::runtime_error("cannot rename " + from + " to " + to + ": " + std::strerror(errno));
}

// write_files(folder) writes the set into `folder` = OUT.tmp; then OUT.tmp becomes OUT (an existing
// OUT goes to OUT.old first, removed once the new set is in place). On a failure OUT.tmp is removed
// and OUT is what it was.
void write_as_set(const std::string& out, const std::function<void(const std::string& folder)>& write_files) {
  const std::string tmp = out + ".tmp", old = out + ".old";
  const fs::path parent = fs::path(out).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (ec) throw std::runtime_error("output folder " + out + ": cannot create " + parent.string() + ": " + ec.message());
  if (path_exists(tmp)) {  // left by an interrupted run
    const std::string left = remove_folder_of_files(tmp);
    if (!left.empty()) throw std::runtime_error("a stale " + tmp + " is in the way: " + left);
  }
  if (::mkdir(tmp.c_str(), 0777) != 0) throw std::runtime_error("cannot create " + tmp + ": " + std::strerror(errno));
  const bool replace = path_exists(out);
  try {
    write_files(tmp);
    if (replace) rename_or_throw(out, old);
    if (std::rename(tmp.c_str(), out.c_str()) != 0) {
      const std::string why = "cannot rename " + tmp + " to " + out + ": " + std::strerror(errno);
      if (replace) rename_or_throw(old, out);  // the previous set back in place
      throw std::runtime_error(why);
    }
  } catch (const std::exception& e) {
    const std::string left = remove_folder_of_files(tmp);
    throw std::runtime_error(std::string(e.what()) + (left.empty() ? "" : "; and " + left));
  }
  if (replace) {
    const std::string left = remove_folder_of_files(old);
    if (!left.empty()) throw std::runtime_error("the new set is in " + out + ", but the previous one stays in " + old + ": " + left);
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

struct Split {
  std::vector<int> tokens;
  long long bytes = 0, text_tokens = 0;
};

Split encode_split(const data::Tokenizer& tok, const std::vector<std::string>& documents, size_t begin, size_t end) {
  Split split;
  for (size_t d = begin; d < end; d++) {
    const std::vector<int> ids = tok.encode(documents[d]);
    split.tokens.insert(split.tokens.end(), ids.begin(), ids.end());
    split.tokens.push_back(tok.eot());
    split.bytes += (long long)documents[d].size();
    split.text_tokens += (long long)ids.size();
  }
  return split;
}

void run(const Options& opt) {
  const auto t_start = std::chrono::steady_clock::now();
  check_output(opt.out);
  std::vector<std::string> documents = load_documents(opt.input);

  std::mt19937_64 rng(opt.seed);
  for (size_t i = documents.size() - 1; i > 0; i--) std::swap(documents[i], documents[rng() % (i + 1)]);
  const size_t n_docs = documents.size();
  const size_t n_val =
      std::min(n_docs - 1, std::max<size_t>(1, size_t(std::llround(double(n_docs) * opt.val_frac))));
  const size_t n_train = n_docs - n_val;
  const std::vector<std::string> train_docs(documents.begin(), documents.begin() + n_train);

  const std::string tok_path = (fs::path(opt.out) / kTokenizerFile).string();
  const std::string train_path = (fs::path(opt.out) / kTrainFile).string();
  const std::string val_path = (fs::path(opt.out) / kValFile).string();

  const auto t_train = std::chrono::steady_clock::now();
  const data::Tokenizer tok = data::Tokenizer::train(train_docs, opt.vocab);
  const double train_s = seconds_since(t_train);

  const auto t_encode = std::chrono::steady_clock::now();
  const Split train = encode_split(tok, documents, 0, n_train);
  const Split val = encode_split(tok, documents, n_train, n_docs);
  const double encode_s = seconds_since(t_encode);

  write_as_set(opt.out, [&](const std::string& folder) {
    tok.save((fs::path(folder) / kTokenizerFile).string());
    data::write_shard((fs::path(folder) / kTrainFile).string(), train.tokens, tok.vocab_size());
    data::write_shard((fs::path(folder) / kValFile).string(), val.tokens, tok.vocab_size());
  });

  std::printf("prepare: %zu documents (train %zu, val %zu), seed %llu\n", n_docs, n_train, n_val, opt.seed);
  std::printf("prepare: tokenizer: vocab %d (%zu merges + 256 bytes + <|endoftext|> = id %d), trained in %.2f s -> %s\n",
              tok.vocab_size(), tok.merges().size(), tok.eot(), train_s, tok_path.c_str());
  auto report = [](const char* name, const Split& split, const std::string& path) {
    std::printf("prepare: %-5s %9lld bytes -> %8zu tokens (%lld text + %lld <|endoftext|>), %.2f bytes/token -> %s\n",
                name, split.bytes, split.tokens.size(), split.text_tokens,
                (long long)split.tokens.size() - split.text_tokens, double(split.bytes) / double(split.text_tokens),
                path.c_str());
  };
  report("train", train, train_path);
  report("val", val, val_path);
  std::printf("prepare: encoding %.2f s (%.1f MB/s); total %.2f s\n", encode_s,
              double(train.bytes + val.bytes) / 1e6 / encode_s, seconds_since(t_start));
  std::printf("prepare: first validation document as tokens:\n  %s\n",
              show_tokens(tok, tok.encode(documents[n_train]), 48).c_str());
}

}  // namespace

int main(int argc, char** argv) {
  Options opt;
  try {
    opt = parse_args(argc, argv);
  } catch (const UsageError& e) {
    std::fprintf(stderr, "prepare: error: %s\n%s\n", e.what(), kUsage);
    return 1;
  }
  try {
    run(opt);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "prepare: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
