// data/prepare.cpp — the `prepare` tool: a text corpus → a BPE tokenizer and llm.c token shards.
//
//   prepare [--input PATH]... [--out DIR] [--vocab N] [--val-frac F] [--seed S] [--shard-tokens N]
//
// --input (repeatable; the inputs' documents are taken in the order given): a UTF-8 text file or a
//   folder (default /usr/share/games/fortunes, Debian's fortunes). In a folder: its regular files,
//   in name order, skipping *.dat (strfile index) files, symlinks and files that are not valid
//   UTF-8 text (with a note). A file that starts with gzip's magic bytes (1f 8b: gzip, and dictzip,
//   which is gzip with an index) is read through `gzip -dc`; gzip failing (a corrupt or truncated
//   file) stops prepare, naming the file.
//   A file named *.dict or *.dict.dz is a dictd dictionary (Debian's dict-gcide: gcide.dict.dz): its
//   documents are its entries. An entry starts at a line that follows an empty line (or starts the
//   file) and begins with a byte other than whitespace and '[', the headword line
//   ("Abdomen \Ab*do"men\, n. ..."); the entry's senses, quotations and blank lines between them are
//   indented, and "[1913 Webster]" source lines that stand after an empty line belong to the entry
//   above. The entry runs to the next such line, without its trailing blank lines. On gcide 0.48
//   this finds 126,242 entries where gcide.index lists 126,240 (20 boundaries differ: license
//   paragraphs and a few column-0 lines inside entries start extra ones, and 9 index entries that
//   start at an indented sense stay in the entry above; notes/data.md); an entry that is not valid
//   UTF-8 (3 in gcide: stray Windows-1252 bytes) is dropped with a note.
//   Any other file with a line that is exactly "%" (ended by "\n", by DOS's "\r\n", or by the end of
//   the file) is a fortune file: its documents are the texts between such lines; any other file is
//   one document. Documents that are empty or only whitespace are dropped.
// The documents are shuffled with --seed (own Fisher–Yates over mt19937_64, the same on every
// platform); the last --val-frac of them are the validation set. The tokenizer is trained on the
// training documents only. Every document is encoded and followed by <|endoftext|>.
// Memory: the inputs' text is held once (documents are views into it) with the trainer's chunk and
// pair tables; the tokens are not held: each document is encoded and appended to a spool file in
// DIR.tmp (int32 per token, unlinked once open), which is then cut into the shards.
// Shards (llm.c's layout): the train tokens, in document order, cut into train_000.bin,
// train_001.bin, ... of at most --shard-tokens tokens each (default 100M; ⌈n / max⌉ shards of
// sizes that differ by at most one token, so that no shard is a short tail a data loader could not
// take one batch from; a document may be cut between two shards); the validation tokens likewise
// into val_000.bin, .... At most 1000 shards per split (their names sort in order).
// Writes the set DIR/tokenizer.bin, DIR/train_NNN.bin, DIR/val_NNN.bin as one (notes/design.md §9): into the
// folder DIR.tmp beside DIR, which becomes DIR once every file is out (an existing DIR is moved to
// DIR.old first and removed after). A failure removes DIR.tmp and leaves the previous DIR intact.
// An existing DIR may hold only such files (anything else is refused before any work), and
// a DIR.old left by an interrupted run is refused (it holds the previous set). A DIR.tmp left by an
// interrupted run (a folder of the files prepare writes there) is removed; any other DIR.tmp (a
// link, a file, a folder holding anything else) is refused before any work, never emptied.
// Progress (reading, merges, encoding) goes to stdout as it happens.
// Build: g++ -std=c++17 -O2 -I. data/prepare.cpp -o build/prepare
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <filesystem>
#include <functional>
#include <limits>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "data/shards.hpp"
#include "data/tokenizer.hpp"

namespace fs = std::filesystem;

namespace {

const char* const kUsage =
    "usage: prepare [--input PATH]... [--out DIR] [--vocab N] [--val-frac F] [--seed S] [--shard-tokens N]\n"
    "  --input: a text file (gzip/dictzip too), a dictd dictionary (*.dict, *.dict.dz) or a folder; repeat for several";

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

constexpr long long kDefaultShardTokens = 100000000;  // llm.c's shards of 100M tokens
constexpr int kMaxShards = 1000;                       // names NNN sort in order

struct Options {
  std::vector<std::string> inputs;  // empty: the fortunes default
  std::string out = "data/fortunes";
  int vocab = 4096;
  double val_frac = 0.05;
  unsigned long long seed = 1337;
  long long shard_tokens = kDefaultShardTokens;
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
    if (flag.rfind("--", 0) == 0 && flag.find('=') != std::string::npos)
      throw UsageError("flag " + flag + ": give the value as the next word, " + flag.substr(0, flag.find('=')) + " " +
                       flag.substr(flag.find('=') + 1) + " (flags take no '=')");
    if (flag != "--input" && flag != "--out" && flag != "--vocab" && flag != "--val-frac" && flag != "--seed" &&
        flag != "--shard-tokens")
      throw UsageError("unknown flag '" + flag + "'");
    if (i + 1 >= argc) throw UsageError(flag + " needs a value");
    const std::string value = argv[++i];
    if (flag == "--input") {
      opt.inputs.push_back(value);
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
    } else if (flag == "--shard-tokens") {
      const long long tokens = parse_integer(flag, value);
      if (tokens < 1 || tokens > std::numeric_limits<int32_t>::max())
        throw UsageError("--shard-tokens " + value + " is outside [1, 2^31 - 1] (a shard header counts in int32)");
      opt.shard_tokens = tokens;
    } else {
      const long long seed = parse_integer(flag, value);
      if (seed < 0) throw UsageError("--seed " + value + " must be non-negative");
      opt.seed = (unsigned long long)seed;
    }
  }
  if (opt.inputs.empty()) opt.inputs.push_back("/usr/share/games/fortunes");
  std::error_code ec;
  for (const std::string& input : opt.inputs)
    if (!fs::exists(input, ec)) throw UsageError("input " + input + " does not exist");
  return opt;
}

// Strict UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF) without NUL bytes.
bool is_utf8_text(std::string_view s) {
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

bool only_whitespace(std::string_view s) { return s.find_first_not_of(" \t\n\r\f\v") == std::string::npos; }

// A fortune separator: a line (with its '\n' when it has one) that is exactly "%".
bool is_fortune_separator(std::string_view line) {
  return line == "%\n" || line == "%\r\n" || line == "%" || line == "%\r";
}

// The inputs' text, held once, and their documents as views into it. A deque: adding a text never
// moves the others (a short std::string keeps its bytes inside the object, so a vector's growth
// would leave views pointing at moved-from strings).
struct Corpus {
  std::deque<std::string> texts;
  std::vector<std::string_view> documents;
  long long bytes = 0;  // of all texts read
};

// The documents of one fortune or plain file's text (see the header comment): the text between
// separator lines, each a view of `text`; without a separator the whole text is one document.
void split_fortunes(std::string_view text, std::vector<std::string_view>& documents) {
  size_t doc_start = 0, pos = 0;
  auto add = [&](size_t end) {
    const std::string_view doc = text.substr(doc_start, end - doc_start);
    if (!only_whitespace(doc)) documents.push_back(doc);
  };
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    end = end == std::string_view::npos ? text.size() : end + 1;  // the line with its '\n'
    if (is_fortune_separator(text.substr(pos, end - pos))) {
      add(pos);
      doc_start = end;
    }
    pos = end;
  }
  add(text.size());
}

// The entries of a dictd dictionary's text (see the header comment), each without its trailing
// blank lines; returns how many were dropped as not valid UTF-8.
long long split_dictionary(std::string_view text, std::vector<std::string_view>& documents) {
  long long dropped = 0;
  size_t entry_start = 0, content_end = 0, pos = 0;  // content_end: the end of the entry's last non-blank line
  bool after_blank = true;
  auto add = [&]() {
    const std::string_view entry = text.substr(entry_start, content_end - entry_start);
    if (only_whitespace(entry)) return;
    if (is_utf8_text(entry)) {
      documents.push_back(entry);
    } else {
      dropped++;
    }
  };
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    end = end == std::string_view::npos ? text.size() : end + 1;
    const std::string_view line = text.substr(pos, end - pos);
    const bool blank = only_whitespace(line);
    if (after_blank && !blank && line[0] != ' ' && line[0] != '\t' && line[0] != '[') {
      add();
      entry_start = pos;
    }
    if (!blank) content_end = end;
    after_blank = blank;
    pos = end;
  }
  add();
  return dropped;
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_dictionary(const fs::path& path) {
  const std::string name = path.filename().string();
  return ends_with(name, ".dict") || ends_with(name, ".dict.dz");
}

// Whether the file starts with gzip's magic bytes (gzip and dictzip files do). Refuses, naming it, a
// file that cannot be opened or is not a regular file (a FIFO, a device: data::open_regular_file).
bool is_gzip(const std::string& path) {
  long long size = 0;
  FILE* f = data::open_regular_file(path, &size);
  unsigned char magic[2] = {0, 0};
  const size_t got = std::fread(magic, 1, 2, f);
  std::fclose(f);
  return got == 2 && magic[0] == 0x1f && magic[1] == 0x8b;
}

// `text` quoted for sh: in single quotes, each ' as '\''.
std::string shell_quote(const std::string& text) {
  std::string quoted = "'";
  for (char c : text) quoted += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return quoted + "'";
}

// The decompressed content of a gzip (or dictzip) file, from `gzip -dc`; refuses, naming the file,
// when gzip cannot be run or exits with anything but 0 (a corrupt or truncated file; gzip prints
// its own reason on stderr).
std::string gunzip(const std::string& path) {
  const std::string command = "gzip -dc -- " + shell_quote(path);
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) throw std::runtime_error("input " + path + ": cannot run `" + command + "`: " + std::strerror(errno));
  std::string text;
  char buf[1 << 16];
  size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, pipe)) > 0) text.append(buf, got);
  const bool read_error = std::ferror(pipe) != 0;
  const int status = ::pclose(pipe);
  if (read_error || status == -1 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
    throw std::runtime_error("input " + path + ": `" + command + "` failed (" +
                             (read_error     ? std::string("read error")
                              : status == -1 ? std::string("no exit status")
                              : WIFEXITED(status) ? "exit status " + std::to_string(WEXITSTATUS(status))
                                                  : "killed by signal " + std::to_string(WTERMSIG(status))) +
                             "): not a valid gzip or dictzip file");
  return text;
}

// Reads one file into the corpus and adds its documents; returns false, adding nothing, when a
// fortune or plain file is not valid UTF-8 text. Prints a line for a file named as an input.
bool read_file(const fs::path& path, Corpus& corpus, bool print) {
  const bool compressed = is_gzip(path.string());
  corpus.texts.push_back(compressed ? gunzip(path.string()) : data::read_whole_file(path.string()));
  const std::string_view text = corpus.texts.back();
  const size_t before = corpus.documents.size();
  long long dropped = 0;
  if (is_dictionary(path)) {
    dropped = split_dictionary(text, corpus.documents);
  } else if (!is_utf8_text(text)) {
    corpus.texts.pop_back();
    return false;
  } else {
    split_fortunes(text, corpus.documents);
  }
  corpus.bytes += (long long)text.size();
  if (print) {
    std::printf("prepare: input %s%s: %zu bytes, %zu %s", path.c_str(), compressed ? " (through gzip -dc)" : "",
                text.size(), corpus.documents.size() - before, is_dictionary(path) ? "dictionary entries" : "documents");
    if (dropped > 0) std::printf(" (dropped %lld entries that are not valid UTF-8)", dropped);
    std::printf("\n");
    std::fflush(stdout);
  }
  return true;
}

void read_input(const std::string& input, Corpus& corpus) {
  std::error_code ec;
  if (fs::is_directory(input, ec)) {
    std::vector<fs::path> entries;
    for (const fs::directory_entry& entry : fs::directory_iterator(input, ec)) entries.push_back(entry.path());
    if (ec) throw std::runtime_error("input " + input + ": cannot list the folder: " + ec.message());
    std::sort(entries.begin(), entries.end());
    const long long bytes_before = corpus.bytes;
    const size_t docs_before = corpus.documents.size();
    int used = 0, dat = 0, links = 0, other = 0;
    for (const fs::path& path : entries) {
      if (fs::is_symlink(fs::symlink_status(path, ec))) {
        links++;
      } else if (!fs::is_regular_file(fs::status(path, ec))) {
        other++;
      } else if (path.extension() == ".dat") {
        dat++;
      } else if (read_file(path, corpus, false)) {
        used++;
      } else {
        std::printf("prepare: note: skipping %s: not valid UTF-8 text\n", path.c_str());
        other++;
      }
    }
    std::printf("prepare: input %s: %d text files (skipped %d .dat index files, %d symlinks, %d others): %lld bytes, "
                "%zu documents\n",
                input.c_str(), used, dat, links, other, corpus.bytes - bytes_before, corpus.documents.size() - docs_before);
    std::fflush(stdout);
  } else if (fs::is_regular_file(input, ec)) {
    if (!read_file(input, corpus, true)) throw std::runtime_error("input " + input + " is not valid UTF-8 text");
  } else {
    throw std::runtime_error("input " + input + " is neither a regular file nor a folder");
  }
}

Corpus load_corpus(const std::vector<std::string>& inputs) {
  Corpus corpus;
  for (const std::string& input : inputs) read_input(input, corpus);
  if (corpus.documents.size() < 2)
    throw std::runtime_error("the input" + std::string(inputs.size() > 1 ? "s hold " : " holds ") +
                             std::to_string(corpus.documents.size()) +
                             " document(s); a train and a validation split need at least 2");
  return corpus;
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

// A file of the set: tokenizer.bin, or a shard train_NNN.bin / val_NNN.bin (three digits).
bool is_set_file(const std::string& name) {
  if (name == kTokenizerFile) return true;
  for (const std::string prefix : {"train_", "val_"})
    if (name.size() == prefix.size() + 7 && name.compare(0, prefix.size(), prefix) == 0 && ends_with(name, ".bin") &&
        std::all_of(name.begin() + prefix.size(), name.begin() + prefix.size() + 3, [](char c) { return c >= '0' && c <= '9'; }))
      return true;
  return false;
}

// Whether `name` is a file that prepare writes into DIR.tmp: a file of the set, one being written
// (NAME.tmp, AtomicFileWriter), or a split's token spool (train.spool, val.spool: unlinked once open,
// left only by a run killed in between).
bool is_prepare_file(const std::string& name) {
  if (ends_with(name, ".tmp")) return is_set_file(name.substr(0, name.size() - 4));
  return is_set_file(name) || name == "train.spool" || name == "val.spool";
}

bool path_exists(const std::string& path) {
  std::error_code ec;
  return fs::exists(fs::symlink_status(path, ec));
}

// The entries of `folder` (called `what` in messages: "output folder", "temporary folder") when it
// is a folder, not a link, that holds only plain files named as prepare names them (`ours`);
// otherwise throws naming the folder and what is wrong, so that nothing of it is removed.
std::vector<fs::path> own_files(const std::string& folder, const std::string& what, bool (*ours)(const std::string&)) {
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(folder, ec);
  if (fs::is_symlink(status))
    throw std::runtime_error(what + " " + folder + " is a link; prepare never writes through one nor removes it");
  if (!fs::is_directory(status)) throw std::runtime_error(what + " " + folder + " exists and is not a folder");
  std::vector<fs::path> files;
  for (const fs::directory_entry& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (!ours(name) || !fs::is_regular_file(entry.symlink_status(ec)))
      throw std::runtime_error(what + " " + folder + " holds " + name +
                               ", which is not one of the files prepare writes; refusing to replace or remove the folder");
    files.push_back(entry.path());
  }
  if (ec) throw std::runtime_error(what + " " + folder + ": cannot list it: " + ec.message());
  return files;
}

// Refuses, before any work, an output that cannot be replaced as a set: DIR that is not a folder or
// that holds anything but files of a set (is_set_file); a DIR.tmp that is not what an interrupted
// prepare leaves (a folder of is_prepare_file files: anything else, a link included, was not made by
// prepare); and a DIR.old left by a run interrupted while swapping.
void check_output(const std::string& out) {
  const std::string old = out + ".old", tmp = out + ".tmp";
  if (path_exists(old))
    throw std::runtime_error(old + " exists: an interrupted prepare left the previous set there; move it back to " +
                             out + " or remove it");
  if (path_exists(tmp)) own_files(tmp, "temporary folder", is_prepare_file);
  if (path_exists(out)) own_files(out, "output folder", is_set_file);
}

// Removes `folder` (called `what` in messages) when own_files accepts it: its files, then the
// folder. Returns "" or what could not be removed (nothing is removed from a folder it refuses).
std::string remove_own_folder(const std::string& folder, const std::string& what, bool (*ours)(const std::string&)) {
  try {
    for (const fs::path& path : own_files(folder, what, ours))
      if (::unlink(path.c_str()) != 0) return "cannot remove " + path.string() + ": " + std::strerror(errno);
  } catch (const std::runtime_error& e) {
    return e.what();
  }
  if (::rmdir(folder.c_str()) != 0) return "cannot remove the folder " + folder + ": " + std::strerror(errno);
  return "";
}

void rename_or_throw(const std::string& from, const std::string& to) {
  if (std::rename(from.c_str(), to.c_str()) != 0)
    throw std::runtime_error("cannot rename " + from + " to " + to + ": " + std::strerror(errno));
}

// write_files(folder) writes the set into `folder` = OUT.tmp; then OUT.tmp becomes OUT (an existing
// OUT goes to OUT.old first, removed once the new set is in place). On a failure OUT.tmp is removed
// and OUT is what it was. A stale OUT.tmp is removed first only when an interrupted prepare left it
// (check_output's rule, checked again here).
void write_as_set(const std::string& out, const std::function<void(const std::string& folder)>& write_files) {
  const std::string tmp = out + ".tmp", old = out + ".old";
  const fs::path parent = fs::path(out).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (ec) throw std::runtime_error("output folder " + out + ": cannot create " + parent.string() + ": " + ec.message());
  if (path_exists(tmp)) {  // left by an interrupted run
    const std::string left = remove_own_folder(tmp, "temporary folder", is_prepare_file);
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
    const std::string left = remove_own_folder(tmp, "temporary folder", is_prepare_file);
    throw std::runtime_error(std::string(e.what()) + (left.empty() ? "" : "; and " + left));
  }
  if (replace) {
    const std::string left = remove_own_folder(old, "previous set", is_set_file);
    if (!left.empty()) throw std::runtime_error("the new set is in " + out + ", but the previous one stays in " + old + ": " + left);
  }
}

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// Tokens of one split on disk while its documents are encoded, in the output folder: int32 in the
// host's byte order, appended, then read back in order. The file is unlinked as soon as it is open,
// so nothing of it is left behind however prepare ends.
class TokenSpool {
 public:
  explicit TokenSpool(const std::string& path) : path_(path), file_(std::fopen(path.c_str(), "w+b")) {
    if (!file_) throw std::runtime_error("cannot create " + path + ": " + std::strerror(errno));
    if (::unlink(path.c_str()) != 0) {
      const std::string why = std::strerror(errno);
      std::fclose(file_);
      throw std::runtime_error("cannot unlink the spool file " + path + ": " + why);
    }
  }
  TokenSpool(const TokenSpool&) = delete;
  TokenSpool& operator=(const TokenSpool&) = delete;
  ~TokenSpool() { std::fclose(file_); }

  void append(const std::vector<int>& ids) {
    if (std::fwrite(ids.data(), sizeof(int), ids.size(), file_) != ids.size())
      throw std::runtime_error("write to " + path_ + " failed: " + std::strerror(errno));
    count_ += (long long)ids.size();
  }
  long long count() const { return count_; }

  // After the last append: the next read() starts at the first token.
  void rewind() {
    if (std::fflush(file_) != 0 || std::fseek(file_, 0, SEEK_SET) != 0)
      throw std::runtime_error("write to " + path_ + " failed: " + std::strerror(errno));
  }
  void read(std::vector<int>& out, size_t n) {
    out.resize(n);
    if (std::fread(out.data(), sizeof(int), n, file_) != n) throw std::runtime_error("read from " + path_ + " failed");
  }

 private:
  std::string path_;
  FILE* file_;
  long long count_ = 0;
};

struct Split {
  std::vector<long long> shard_tokens;  // tokens of NAME_000.bin, NAME_001.bin, ...
  long long tokens = 0, bytes = 0, text_tokens = 0;
};

std::string shard_name(const std::string& split, size_t index) {
  char name[32];
  std::snprintf(name, sizeof name, "%s_%03zu.bin", split.c_str(), index);
  return name;
}

constexpr long long kProgressBytes = 16 << 20;  // a progress line per 16 MiB of text encoded

// Encodes documents [begin, end), each followed by <|endoftext|>, into a spool file in `folder`,
// then cuts the tokens into ⌈n / shard_tokens⌉ shards folder/NAME_NNN.bin of near-equal sizes.
Split write_split(const data::Tokenizer& tok, const std::vector<std::string_view>& documents, size_t begin, size_t end,
                  const std::string& folder, const std::string& name, long long shard_tokens) {
  const auto t_start = std::chrono::steady_clock::now();
  Split split;
  long long total_bytes = 0;
  for (size_t d = begin; d < end; d++) total_bytes += (long long)documents[d].size();
  TokenSpool spool((fs::path(folder) / (name + ".spool")).string());
  long long next_report = kProgressBytes;
  for (size_t d = begin; d < end; d++) {
    std::vector<int> ids = tok.encode(documents[d]);
    split.text_tokens += (long long)ids.size();
    ids.push_back(tok.eot());
    spool.append(ids);
    split.bytes += (long long)documents[d].size();
    if (split.bytes >= next_report && d + 1 < end) {
      std::printf("prepare: encoding %s: %.1f of %.1f MB, %lld tokens, %.1f s\n", name.c_str(), double(split.bytes) / 1e6,
                  double(total_bytes) / 1e6, spool.count(), seconds_since(t_start));
      std::fflush(stdout);
      next_report += kProgressBytes;
    }
  }
  split.tokens = spool.count();
  const long long n_shards = (split.tokens + shard_tokens - 1) / shard_tokens;
  if (n_shards > kMaxShards)
    throw std::runtime_error(name + ": " + std::to_string(split.tokens) + " tokens make " + std::to_string(n_shards) +
                             " shards of at most --shard-tokens " + std::to_string(shard_tokens) + ", more than " +
                             std::to_string(kMaxShards) + "; use larger shards");
  spool.rewind();
  constexpr long long kBlock = 1 << 20;  // tokens copied at a time
  std::vector<int> block;
  for (long long s = 0; s < n_shards; s++) {
    const long long count = split.tokens / n_shards + (s < split.tokens % n_shards ? 1 : 0);
    data::ShardWriter out((fs::path(folder) / shard_name(name, size_t(s))).string(), count, tok.vocab_size());
    for (long long done = 0; done < count; done += kBlock) {
      spool.read(block, size_t(std::min(kBlock, count - done)));
      out.append(block.data(), block.size());
    }
    out.commit();
    split.shard_tokens.push_back(count);
  }
  return split;
}

// Validation batches of B × T tokens per rank that W ranks read from the validation shards, as the
// trainer's data loader counts them (each shard of n tokens holds ⌊(n − 1) / (W·B·T)⌋ windows).
long long val_batches(const Split& val, long long W, long long B, long long T) {
  long long batches = 0;
  for (long long n : val.shard_tokens) batches += (n - 1) / (W * B * T);
  return batches;
}

void run(const Options& opt) {
  const auto t_start = std::chrono::steady_clock::now();
  check_output(opt.out);
  Corpus corpus = load_corpus(opt.inputs);
  std::vector<std::string_view>& documents = corpus.documents;
  std::printf("prepare: read %lld bytes, %zu documents in %.2f s\n", corpus.bytes, documents.size(), seconds_since(t_start));

  std::mt19937_64 rng(opt.seed);
  for (size_t i = documents.size() - 1; i > 0; i--) std::swap(documents[i], documents[rng() % (i + 1)]);
  const size_t n_docs = documents.size();
  const size_t n_val =
      std::min(n_docs - 1, std::max<size_t>(1, size_t(std::llround(double(n_docs) * opt.val_frac))));
  const size_t n_train = n_docs - n_val;
  const std::vector<std::string_view> train_docs(documents.begin(), documents.begin() + n_train);

  const auto t_train = std::chrono::steady_clock::now();
  const int report_every = 500;
  const data::Tokenizer tok = data::Tokenizer::train(train_docs, opt.vocab, [&](int done, int total) {
    if (done % report_every == 0 || done == total) {
      std::printf("prepare: tokenizer: %d of %d merges, %.1f s\n", done, total, seconds_since(t_train));
      std::fflush(stdout);
    }
  });
  const double train_s = seconds_since(t_train);

  const auto t_encode = std::chrono::steady_clock::now();
  Split train, val;
  write_as_set(opt.out, [&](const std::string& folder) {
    tok.save((fs::path(folder) / kTokenizerFile).string());
    train = write_split(tok, documents, 0, n_train, folder, "train", opt.shard_tokens);
    val = write_split(tok, documents, n_train, n_docs, folder, "val", opt.shard_tokens);
  });
  const double encode_s = seconds_since(t_encode);

  std::printf("prepare: %zu documents (train %zu, val %zu), seed %llu\n", n_docs, n_train, n_val, opt.seed);
  std::printf("prepare: tokenizer: vocab %d (%zu merges + 256 bytes + <|endoftext|> = id %d), trained in %.2f s -> %s\n",
              tok.vocab_size(), tok.merges().size(), tok.eot(), train_s,
              (fs::path(opt.out) / kTokenizerFile).c_str());
  auto report = [&](const char* name, const Split& split) {
    std::printf("prepare: %-5s %9lld bytes -> %8lld tokens (%lld text + %lld <|endoftext|>), %.2f bytes/token -> %s",
                name, split.bytes, split.tokens, split.text_tokens, split.tokens - split.text_tokens,
                double(split.bytes) / double(split.text_tokens), (fs::path(opt.out) / shard_name(name, 0)).c_str());
    if (split.shard_tokens.size() > 1)
      std::printf(" .. %s (%zu shards of %lld to %lld tokens)", shard_name(name, split.shard_tokens.size() - 1).c_str(),
                  split.shard_tokens.size(), split.shard_tokens.back(), split.shard_tokens.front());
    std::printf("\n");
  };
  report("train", train);
  report("val", val);
  std::printf("prepare: validation batches per rank of B x T, T = 1024 (at most what --val_batches reads):");
  for (const long long W : {1, 2, 8}) {
    std::printf(" W=%lld:", W);
    for (const long long B : {8, 16, 32}) std::printf(" B=%lld %lld%s", B, val_batches(val, W, B, 1024), B == 32 ? "" : ",");
    if (W != 8) std::printf(";");
  }
  std::printf("\n");
  std::printf("prepare: encoding and writing %.2f s (%.1f MB/s); total %.2f s\n", encode_s,
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
