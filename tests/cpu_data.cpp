// tests/cpu_data.cpp — specification of data/: the BPE tokenizer (against a plain reference
// trainer and encoder written here), llm.c token shards, the data loader, and the prepare tool.
#include <fcntl.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "data/dataloader.hpp"
#include "data/shards.hpp"
#include "config.hpp"
#include "data/tokenizer.hpp"
#include "tests/test_util.hpp"

namespace fs = std::filesystem;

namespace {

using testutil::read_bytes;
using testutil::TempDir;
using testutil::write_bytes;

// Little-endian int32 written out byte by byte (independent of data/file_io.hpp).
void put_i32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; i++) out.push_back(char(v >> (8 * i)));
}
void set_i32(std::string& bytes, size_t word, uint32_t v) {
  for (int i = 0; i < 4; i++) bytes[4 * word + i] = char(v >> (8 * i));
}

using testutil::expect_refused;

// Random English-like sentences from a small word list.
std::string english(testutil::Rng& rng, int sentences) {
  static const char* const words[] = {
      "the",   "of",     "and",    "to",     "in",     "is",      "you",    "that",  "it",     "he",
      "was",   "for",    "on",     "are",    "as",     "with",    "his",    "they",  "at",     "be",
      "this",  "have",   "from",   "or",     "one",    "had",     "by",     "word",  "but",    "not",
      "what",  "all",    "were",   "we",     "when",   "your",    "can",    "said",  "there",  "use",
      "each",  "which",  "she",    "do",     "how",    "their",   "if",     "will",  "up",     "other",
      "about", "out",    "many",   "then",   "them",   "these",   "so",     "some",  "her",    "would",
      "make",  "like",   "him",    "into",   "time",   "has",     "look",   "two",   "more",   "write",
      "go",    "see",    "number", "no",     "way",    "could",   "people", "my",    "than",   "first",
      "water", "been",   "call",   "who",    "oil",    "its",     "now",    "find",  "long",   "down",
      "day",   "did",    "get",    "come",   "made",   "may",     "part",   "fortune", "cookie", "computer"};
  const int n_words = int(sizeof words / sizeof words[0]);
  std::string text;
  for (int s = 0; s < sentences; s++) {
    const int len = rng.integer(3, 14);
    for (int w = 0; w < len; w++) {
      std::string word = words[rng.integer(0, n_words - 1)];
      if (w == 0) word[0] = char(word[0] - 'a' + 'A');
      text += (w == 0 ? "" : " ") + word;
      if (w + 1 < len && rng.integer(0, 9) == 0) text += ",";
    }
    text += rng.integer(0, 5) == 0 ? "?" : ".";
    text += rng.integer(0, 3) == 0 ? "\n" : "  ";
  }
  return text;
}

std::vector<std::string> english_documents(testutil::Rng& rng, int n_docs) {
  std::vector<std::string> docs;
  for (int d = 0; d < n_docs; d++) docs.push_back(english(rng, rng.integer(1, 6)));
  return docs;
}

std::vector<std::string> chunks_of(std::string_view text) {
  std::vector<std::string> chunks;
  data::Tokenizer::for_each_chunk(text, [&](std::string_view c) { chunks.emplace_back(c); });
  return chunks;
}

// Reference BPE: every merge recounts all pairs over all chunks (with repetition) and takes
// the most frequent, ties to the smallest (left, right); merges apply left to right.
std::vector<int> merge_pair(const std::vector<int>& ids, std::pair<int, int> pair, int new_id) {
  std::vector<int> out;
  for (size_t i = 0; i < ids.size(); i++) {
    if (i + 1 < ids.size() && ids[i] == pair.first && ids[i + 1] == pair.second) {
      out.push_back(new_id);
      i++;
    } else {
      out.push_back(ids[i]);
    }
  }
  return out;
}

std::vector<std::pair<int, int>> reference_train(const std::vector<std::string>& docs, int vocab_size) {
  std::vector<std::vector<int>> chunks;
  for (const std::string& doc : docs)
    for (const std::string& c : chunks_of(doc)) {
      std::vector<int> ids;
      for (unsigned char b : c) ids.push_back(b);
      chunks.push_back(ids);
    }
  std::vector<std::pair<int, int>> merges;
  for (int m = 0; m < vocab_size - 257; m++) {
    std::map<std::pair<int, int>, long long> count;
    for (const auto& c : chunks)
      for (size_t i = 0; i + 1 < c.size(); i++) count[{c[i], c[i + 1]}]++;
    std::pair<int, int> best{-1, -1};
    long long best_count = 0;
    for (const auto& [pair, n] : count)
      if (n > best_count) best = pair, best_count = n;
    if (best_count == 0) break;
    merges.push_back(best);
    for (auto& c : chunks) c = merge_pair(c, best, 256 + m);
  }
  return merges;
}

std::vector<int> reference_encode(const data::Tokenizer& tok, const std::string& text) {
  std::vector<int> out;
  for (const std::string& chunk : chunks_of(text)) {
    std::vector<int> ids;
    for (unsigned char c : chunk) ids.push_back(c);
    for (size_t m = 0; m < tok.merges().size(); m++) ids = merge_pair(ids, tok.merges()[m], 256 + int(m));
    out.insert(out.end(), ids.begin(), ids.end());
  }
  return out;
}

// Byte strings meant to break a tokenizer: uniform random bytes (invalid UTF-8, NULs), random
// strings over a small alphabet that hits many merges, very long runs, and the EOT text.
std::vector<std::string> adversarial_strings(testutil::Rng& rng) {
  std::vector<std::string> out = {"", "a", std::string(1, '\0'), "<|endoftext|>", "it's 're 'll ''' '"};
  for (int i = 0; i < 20; i++) {
    std::string s(size_t(rng.integer(0, 3000)), '\0');
    for (char& c : s) c = char(rng.integer(0, 255));
    out.push_back(s);
  }
  const std::string alphabet = std::string("the ,.\n\t'sld9") + '\0' + "\xff\xc3\xa9";
  for (int i = 0; i < 20; i++) {
    std::string s(size_t(rng.integer(1, 3000)), ' ');
    for (char& c : s) c = alphabet[rng.integer(0, int(alphabet.size()) - 1)];
    out.push_back(s);
  }
  for (char c : {'a', ' ', '\0', '\xff', '=', '7', '\n'}) out.push_back(std::string(100000, c));
  std::string abab;
  for (int i = 0; i < 50000; i++) abab += "ab";
  out.push_back(abab);
  out.push_back(english(rng, 5) + std::string(1000, '\0') + english(rng, 5));
  return out;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Tokenizer

TEST(DataTokenizer, ChunksFollowGpt2StyleSplit) {
  EXPECT_EQ(chunks_of("Hello world's  42 apples!!\n\n  ok"),
            (std::vector<std::string>{"Hello", " world", "'s", " ", " 42", " apples", "!!", "\n\n ", " ok"}));
  EXPECT_EQ(chunks_of("caf\xc3\xa9 2024-03-28 \t"),
            (std::vector<std::string>{"caf\xc3\xa9", " 2024", "-", "03", "-", "28", " \t"}));
  const std::vector<std::string> cut = chunks_of(std::string(600, '='));
  EXPECT_EQ(cut, (std::vector<std::string>{std::string(256, '='), std::string(256, '='), std::string(88, '=')}));
}

TEST(DataTokenizer, TrainingMatchesReferenceBpe) {
  testutil::Rng rng;
  std::vector<std::string> docs = english_documents(rng, 40);
  docs.push_back(adversarial_strings(rng)[7]);  // random bytes too
  const data::Tokenizer tok = data::Tokenizer::train(docs, 420);
  const auto expected = reference_train(docs, 420);
  EXPECT_EQ(tok.merges(), expected);
  EXPECT_EQ(tok.vocab_size(), 420);
  EXPECT_EQ(tok.eot(), 419);
  EXPECT_EQ(tok.decode_token(tok.eot()), "<|endoftext|>");
}

TEST(DataTokenizer, TiesGoToTheSmallestPair) {
  EXPECT_EQ(data::Tokenizer::train({"abcd"}, 258).merges(), (std::vector<std::pair<int, int>>{{'a', 'b'}}));
  // Count first: "cd" occurs 3 times, " c" twice, "xy" twice.
  EXPECT_EQ(data::Tokenizer::train({"xyxy cdcd cd"}, 258).merges(), (std::vector<std::pair<int, int>>{{'c', 'd'}}));
  // After "ab" = 256, the tie (256, 'c') vs ('c', 'd') goes to ('c', 'd'): 'c' = 99 < 256.
  const data::Tokenizer tok = data::Tokenizer::train({"abcd"}, 260);
  EXPECT_EQ(tok.merges(), (std::vector<std::pair<int, int>>{{'a', 'b'}, {'c', 'd'}, {256, 257}}));
  EXPECT_EQ(tok.decode_token(258), "abcd");
  EXPECT_EQ(tok.encode("abcd"), (std::vector<int>{258}));
}

TEST(DataTokenizer, MergesNeverCrossChunks) {
  testutil::Rng rng;
  const data::Tokenizer tok = data::Tokenizer::train(english_documents(rng, 150), 600);
  auto space = [](unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; };
  for (int id = 256; id < tok.eot(); id++) {
    const std::string t = tok.decode_token(id);
    for (size_t i = 1; i < t.size(); i++) {
      const bool leading_space = i == 1 && t[0] == ' ';
      EXPECT_TRUE(space(t[i - 1]) == space(t[i]) || leading_space) << "token " << id << " '" << t << "'";
    }
  }
}

TEST(DataTokenizer, EncodeMatchesReferenceAndRoundTripsAnyBytes) {
  testutil::Rng rng;
  const data::Tokenizer tok = data::Tokenizer::train(english_documents(rng, 40), 400);
  for (const std::string& s : adversarial_strings(rng)) {
    const std::vector<int> ids = tok.encode(s);
    EXPECT_EQ(tok.decode(ids), s) << "length " << s.size();
    for (int id : ids) ASSERT_TRUE(id >= 0 && id < tok.eot()) << id;
    EXPECT_EQ(ids, reference_encode(tok, s)) << "length " << s.size();
  }
}

TEST(DataTokenizer, MergesCompressEnglish) {
  testutil::Rng rng;
  const data::Tokenizer tok = data::Tokenizer::train(english_documents(rng, 300), 512);
  const std::string held_out = english(rng, 200);
  const std::vector<int> ids = tok.encode(held_out);
  const double bytes_per_token = double(held_out.size()) / double(ids.size());
  printf("[compression] %zu bytes -> %zu tokens: %.2f bytes/token\n", held_out.size(), ids.size(), bytes_per_token);
  EXPECT_GE(bytes_per_token, 3.0);
  EXPECT_EQ(tok.decode(ids), held_out);
}

TEST(DataTokenizer, TrainingIsDeterministic) {
  testutil::Rng rng;
  const std::vector<std::string> docs = english_documents(rng, 50);
  EXPECT_EQ(data::Tokenizer::train(docs, 500).merges(), data::Tokenizer::train(docs, 500).merges());
}

TEST(DataTokenizer, TrainRefusesImpossibleVocabularies) {
  expect_refused([] { data::Tokenizer::train({"hello"}, 256); }, {"vocab_size 256", "at least 257"});
  expect_refused([] { data::Tokenizer::train({"ab ab"}, 300); }, {"run out of pairs", "vocab_size 300"});
  EXPECT_EQ(data::Tokenizer::train({"hello"}, 257).vocab_size(), 257);
}

TEST(DataTokenizer, DecodeRefusesUnknownIds) {
  const data::Tokenizer tok = data::Tokenizer::train({"hello hello"}, 260);
  expect_refused([&] { tok.decode({1, 260}); }, {"token id 260", "[0, 260)"});
  expect_refused([&] { tok.decode_token(-1); }, {"token id -1"});
}

TEST(DataTokenizer, SaveLoadGivesIdenticalEncoding) {
  testutil::Rng rng;
  TempDir dir;
  const data::Tokenizer tok = data::Tokenizer::train(english_documents(rng, 60), 500);
  const std::string path = dir.file("tokenizer.bin");
  tok.save(path);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
  EXPECT_EQ(fs::file_size(path), 1024u + 8u * (500 - 257));
  const data::Tokenizer loaded = data::Tokenizer::load(path);
  EXPECT_EQ(loaded.vocab_size(), tok.vocab_size());
  EXPECT_EQ(loaded.eot(), tok.eot());
  EXPECT_EQ(loaded.merges(), tok.merges());
  for (const std::string& s : adversarial_strings(rng)) EXPECT_EQ(loaded.encode(s), tok.encode(s));
  const std::string again = dir.file("again.bin");
  loaded.save(again);
  EXPECT_EQ(read_bytes(again), read_bytes(path));
}

TEST(DataTokenizer, LoadRefusesCorruptFiles) {
  TempDir dir;
  const data::Tokenizer tok = data::Tokenizer::train({"the cat sat on the mat, the end"}, 270);
  const std::string good_path = dir.file("good.bin");
  tok.save(good_path);
  const std::string good = read_bytes(good_path);
  const size_t first_merge = 256, second_merge = 258;  // int32 word index of merge 0 and merge 1
  auto refused = [&](std::string bytes, const std::string& problem) {
    const std::string path = dir.file("bad.bin");
    write_bytes(path, bytes);
    expect_refused([&] { data::Tokenizer::load(path); }, {path, problem});
  };
  std::string b = good;
  set_i32(b, 0, 20240520);
  refused(b, "bad magic 20240520");
  b = good;
  set_i32(b, 1, 2);  // read as llm.c's token table: the merges are not one
  refused(b, "llm.c token table (version 2)");
  b = good;
  set_i32(b, 1, 9);
  refused(b, "unsupported version 9");
  refused(good.substr(0, 500), "truncated header");
  refused(good.substr(0, good.size() - 4), "truncated");
  refused(good + std::string(8, '\0'), "trailing bytes");
  b = good;
  set_i32(b, 2, 271);
  refused(b, "does not match vocab size 271");
  b = good;
  set_i32(b, 3, 5);
  refused(b, "EOT id 5");
  b = good;
  set_i32(b, 77, 1);
  refused(b, "reserved header word 77");
  b = good;
  set_i32(b, first_merge, 256);  // merge 0 may only use the 256 bytes
  refused(b, "merge 0 = (256,");
  b = good;
  set_i32(b, second_merge + 1, uint32_t(-3));
  refused(b, "merge 1 = (");
  b = good;
  set_i32(b, second_merge, tok.merges()[0].first);
  set_i32(b, second_merge + 1, tok.merges()[0].second);
  refused(b, "merge 1 repeats merge 0");
  expect_refused([&] { data::Tokenizer::load(dir.file("missing.bin")); }, {dir.file("missing.bin"), "cannot open"});
}

// llm.c's tokenizer file (tokenizer.h, train_gpt2.py write_tokenizer), written byte by byte:
// header [0] magic 20240328, [1] version, [2] V, [3] EOT id (version 2; 0 in version 1), the rest
// 0; then per token a uint8 length and its bytes.
std::string llmc_tokenizer_file(int version, const std::vector<std::string>& tokens, int eot) {
  std::string out;
  put_i32(out, 20240328);
  put_i32(out, uint32_t(version));
  put_i32(out, uint32_t(tokens.size()));
  put_i32(out, version == 2 ? uint32_t(eot) : 0u);
  out.append(4 * 252, '\0');
  for (const std::string& token : tokens) {
    out.push_back(char(token.size()));
    out += token;
  }
  return out;
}

TEST(DataTokenizer, LlmcTokenTableDecodesAndRefusesToEncode) {
  TempDir dir;
  const std::vector<std::string> table = {"a", "b", "ab", " the", std::string("\xff\x00\n", 3), "<|endoftext|>", "cat"};
  const std::string path = dir.file("llmc_v2.bin");
  write_bytes(path, llmc_tokenizer_file(2, table, 5));
  const data::Tokenizer tok = data::Tokenizer::load(path);
  EXPECT_EQ(tok.vocab_size(), 7);
  EXPECT_EQ(tok.eot(), 5);
  EXPECT_TRUE(tok.merges().empty());
  EXPECT_EQ(tok.decode({3, 6, 2, 4, 0, 5, 1}), std::string(" thecatab\xff\x00\na<|endoftext|>b", 27));
  for (int id = 0; id < 7; id++) EXPECT_EQ(tok.decode_token(id), table[id]);
  expect_refused([&] { tok.decode({7}); }, {"token id 7", "[0, 7)"});
  expect_refused([&] { tok.encode("the cat"); }, {path, "no merges", "cannot encode new text"});
  expect_refused([&] { tok.save(dir.file("saved.bin")); }, {path, "no merges"});
  EXPECT_FALSE(fs::exists(dir.file("saved.bin")));

  // Version 1 is GPT-2's: V = 50257 with EOT 50256, not in the header.
  std::vector<std::string> gpt2(50257);
  for (int id = 0; id < 50256; id++) gpt2[id] = " " + std::to_string(id);
  gpt2[50256] = "<|endoftext|>";
  const std::string v1_path = dir.file("llmc_v1.bin");
  write_bytes(v1_path, llmc_tokenizer_file(1, gpt2, 0));
  const data::Tokenizer v1 = data::Tokenizer::load(v1_path);
  EXPECT_EQ(v1.vocab_size(), 50257);
  EXPECT_EQ(v1.eot(), 50256);
  EXPECT_EQ(v1.decode({12, 50255, 50256}), " 12 50255<|endoftext|>");
}

TEST(DataTokenizer, LoadRefusesDamagedLlmcTokenTables) {
  TempDir dir;
  const std::vector<std::string> table = {"a", "b", "ab", "<|endoftext|>"};
  const std::string good = llmc_tokenizer_file(2, table, 3);
  auto refused = [&](std::string bytes, const std::string& problem) {
    const std::string path = dir.file("bad.bin");
    write_bytes(path, bytes);
    expect_refused([&] { data::Tokenizer::load(path); }, {path, problem});
  };
  std::string b = good;
  set_i32(b, 0, 20240329);
  refused(b, "bad magic 20240329");
  b = good;
  set_i32(b, 1, 4);
  refused(b, "unsupported version 4");
  refused(good.substr(0, 1000), "truncated header");
  refused(good.substr(0, good.size() - 1), "truncated: 1044 bytes end inside token 3 of 4");
  refused(good.substr(0, 1024), "truncated: 1024 bytes end inside token 0 of 4");
  refused(good + "x", "trailing bytes: 1 after the 4 tokens");
  b = good;
  set_i32(b, 3, 4);
  refused(b, "EOT id 4 outside the vocabulary [0, 4)");
  b = good;
  set_i32(b, 2, 0);
  refused(b, "vocab size 0 must be positive");
  b = good;
  b[1024] = 0;  // token 0 of length 0
  refused(b, "token 0 has length 0");
  refused(llmc_tokenizer_file(1, table, 0), "vocab size 4 (version 1 is GPT-2's, 50257)");
}

// The tokenizer is read only from a regular file, and no more than the file holds: a folder, a FIFO
// (a read would wait forever for a writer) and a device (/dev/zero never ends) are refused by name,
// and an llm.c header that claims 2^31 − 1 tokens is refused against the file's size before anything
// is reserved for them.
TEST(DataTokenizer, LoadRefusesWhatIsNotARegularFileAndSizesPastTheFile) {
  TempDir dir;
  const std::string folder = dir.file("folder"), fifo = dir.file("fifo");
  fs::create_directory(folder);
  expect_refused([&] { data::Tokenizer::load(folder); }, {"tokenizer file " + folder + ": is a folder, not a regular file"});
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  expect_refused([&] { data::Tokenizer::load(fifo); }, {"tokenizer file " + fifo + ": is a FIFO, not a regular file"});
  expect_refused([&] { data::Tokenizer::load("/dev/zero"); }, {"tokenizer file /dev/zero: is a device, not a regular file"});
  std::string huge = llmc_tokenizer_file(2, {"a", "b", "<|endoftext|>"}, 2);
  set_i32(huge, 2, 2147483647u);
  const std::string path = dir.file("huge.bin");
  write_bytes(path, huge);
  expect_refused([&] { data::Tokenizer::load(path); },
                 {"tokenizer file " + path, "truncated: 1042 bytes end inside token 3 of 2147483647"});
}

// AtomicFileWriter (tokenizer.bin, the shards, routing traces, the memory timeline) creates PATH.tmp
// new: an existing PATH.tmp, a file or a link to one, was not written by it and is refused; neither it
// nor what it points to changes, and PATH stays as it was.
TEST(DataFileIo, AtomicWriterNeverWritesThroughOrRemovesAnExistingTmp) {
  TempDir dir;
  const std::string path = dir.file("tokenizer.bin"), mine = dir.file("mine.txt");
  write_bytes(path, "old");
  write_bytes(mine, "precious");
  write_bytes(path + ".tmp", "also mine");
  const auto write_new = [&] {
    data::AtomicFileWriter out(path);
    out.write("new");
    out.commit();
  };
  expect_refused(write_new, {path + ": cannot create " + path + ".tmp: it exists"});
  EXPECT_EQ(read_bytes(path + ".tmp"), "also mine");
  fs::remove(path + ".tmp");
  fs::create_symlink(mine, path + ".tmp");
  expect_refused(write_new, {path + ": cannot create " + path + ".tmp: it exists"});
  EXPECT_EQ(read_bytes(mine), "precious");
  EXPECT_TRUE(fs::is_symlink(path + ".tmp"));
  EXPECT_EQ(read_bytes(path), "old");
  fs::remove(path + ".tmp");
  write_new();
  EXPECT_EQ(read_bytes(path), "new");
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// ---------------------------------------------------------------------------------------------
// Shards

TEST(DataShards, WriteReadUint16) {
  testutil::Rng rng;
  TempDir dir;
  std::vector<int> tokens = {0, 50256};
  for (int i = 0; i < 10000; i++) tokens.push_back(rng.integer(0, 50256));
  const std::string path = dir.file("s.bin");
  data::write_shard(path, tokens, 50257);
  const std::string bytes = read_bytes(path);
  ASSERT_EQ(bytes.size(), 1024 + 2 * tokens.size());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  EXPECT_EQ(data::load_i32_le(p), 20240520);
  EXPECT_EQ(data::load_i32_le(p + 4), 1);
  EXPECT_EQ(data::load_i32_le(p + 8), int(tokens.size()));
  EXPECT_EQ(int(p[1024 + 2]) | int(p[1024 + 3]) << 8, 50256);
  EXPECT_EQ(data::read_shard(path), tokens);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

TEST(DataShards, WriteReadUint32) {
  testutil::Rng rng;
  TempDir dir;
  std::vector<int> tokens = {0, 65535, 65536, 128255};
  for (int i = 0; i < 10000; i++) tokens.push_back(rng.integer(0, 128255));
  const std::string path = dir.file("s.bin");
  data::write_shard(path, tokens, 128256);
  const std::string bytes = read_bytes(path);
  ASSERT_EQ(bytes.size(), 1024 + 4 * tokens.size());
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  EXPECT_EQ(data::load_i32_le(p), 20240801);
  EXPECT_EQ(data::load_i32_le(p + 4), 7);
  EXPECT_EQ(data::load_i32_le(p + 8), int(tokens.size()));
  EXPECT_EQ(data::read_shard(path), tokens);
}

TEST(DataShards, VariantFollowsVocabSize) {
  TempDir dir;
  data::write_shard(dir.file("a.bin"), {1, 65534}, 65535);
  data::write_shard(dir.file("b.bin"), {1, 65535}, 65536);
  EXPECT_EQ(data::read_shard_header(dir.file("a.bin")).bytes_per_token, 2);
  EXPECT_EQ(data::read_shard_header(dir.file("b.bin")).bytes_per_token, 4);
  EXPECT_EQ(data::read_shard(dir.file("b.bin")), (std::vector<int>{1, 65535}));
}

TEST(DataShards, WriteRefusesBadTokensAndKeepsTheOldFile) {
  TempDir dir;
  const std::string path = dir.file("s.bin");
  data::write_shard(path, {1, 2, 3}, 10);
  const std::string before = read_bytes(path);
  expect_refused([&] { data::write_shard(path, {1, 10}, 10); }, {path, "token 1 = 10", "[0, 10)"});
  expect_refused([&] { data::write_shard(path, {-1}, 10); }, {path, "token 0 = -1"});
  expect_refused([&] { data::write_shard(path, {}, 10); }, {path, "no tokens"});
  expect_refused([&] { data::write_shard(dir.file("nodir/s.bin"), {1}, 10); }, {"nodir/s.bin", "cannot create"});
  EXPECT_EQ(read_bytes(path), before);
  EXPECT_FALSE(fs::exists(path + ".tmp"));
}

// A shard written in pieces (ShardWriter: the count in the header first, then the tokens as they
// come) is the same file as one written whole; appending more or fewer tokens than the header says
// is refused and leaves no file.
TEST(DataShards, WriterInPiecesWritesTheSameFile) {
  testutil::Rng rng;
  TempDir dir;
  for (const int V : {300, 70000}) {
    std::vector<int> tokens(size_t(rng.integer(1, 5000)));
    for (int& t : tokens) t = rng.integer(0, V - 1);
    const std::string whole = dir.file("whole" + std::to_string(V) + ".bin"),
                      in_pieces = dir.file("pieces" + std::to_string(V) + ".bin");
    data::write_shard(whole, tokens, V);
    data::ShardWriter pieces(in_pieces, (long long)tokens.size(), V);
    for (size_t done = 0; done < tokens.size();) {
      const size_t n = std::min(tokens.size() - done, size_t(rng.integer(0, 700)));
      pieces.append(tokens.data() + done, n);
      done += n;
    }
    EXPECT_FALSE(fs::exists(in_pieces)) << "only PATH.tmp before commit";
    pieces.commit();
    EXPECT_EQ(read_bytes(in_pieces), read_bytes(whole)) << "V = " << V;
  }
  const std::vector<int> three = {1, 2, 3};
  expect_refused([&] {
    data::ShardWriter out(dir.file("more.bin"), 2, 10);
    out.append(three.data(), 3);
  }, {dir.file("more.bin"), "3 tokens appended, more than the 2 of its header"});
  expect_refused([&] {
    data::ShardWriter out(dir.file("fewer.bin"), 4, 10);
    out.append(three.data(), 3);
    out.commit();
  }, {dir.file("fewer.bin"), "3 tokens appended, fewer than the 4"});
  expect_refused([&] { data::ShardWriter(dir.file("big.bin"), 1LL << 31, 10); }, {"do not fit the int32 token count"});
  for (const char* name : {"more.bin", "fewer.bin", "big.bin"}) {
    EXPECT_FALSE(fs::exists(dir.file(name))) << name;
    EXPECT_FALSE(fs::exists(dir.file(name) + ".tmp")) << name;
  }
}

TEST(DataShards, ReadRefusesCorruptFiles) {
  TempDir dir;
  const std::string good_path = dir.file("good.bin");
  data::write_shard(good_path, {5, 6, 7, 8}, 100);
  const std::string good = read_bytes(good_path);
  auto refused = [&](const std::string& bytes, const std::string& problem) {
    const std::string path = dir.file("bad.bin");
    write_bytes(path, bytes);
    expect_refused([&] { data::read_shard(path); }, {path, problem});
  };
  std::string b = good;
  set_i32(b, 0, 12345);
  refused(b, "bad magic 12345");
  b = good;
  set_i32(b, 1, 7);  // uint16 magic with the uint32 version
  refused(b, "magic 20240520 with unsupported version 7");
  b = good;
  set_i32(b, 0, 20240801);  // uint32 magic with the uint16 version
  refused(b, "magic 20240801 with unsupported version 1");
  refused(good.substr(0, good.size() - 1), "truncated");
  refused(good + "xy", "trailing bytes");
  refused(good.substr(0, 100), "truncated header");
  b = good.substr(0, 1024);
  set_i32(b, 2, 0);
  refused(b, "token count 0");
  b = good;
  set_i32(b, 2, 5);  // says 5 tokens, holds 4
  refused(b, "truncated");
  expect_refused([&] { data::read_shard(dir.file("missing.bin")); }, {dir.file("missing.bin")});
}

// A shard that cannot be opened is named with the reason (here no file descriptor is left), by
// read_shard and by the data loader.
TEST(DataShards, ShardThatCannotBeOpenedIsNamedWithTheReason) {
  TempDir dir;
  const std::string path = dir.file("train_000.bin");
  data::write_shard(path, {1, 2, 3}, 10);
  struct rlimit before;
  ASSERT_EQ(getrlimit(RLIMIT_NOFILE, &before), 0);
  const int lowest_free = open("/dev/null", O_RDONLY);
  ASSERT_GE(lowest_free, 0);
  close(lowest_free);
  std::vector<std::string> messages;
  struct rlimit none_left = before;
  none_left.rlim_cur = (rlim_t)lowest_free;
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &none_left), 0);
  for (const auto& open_it : std::vector<std::function<void()>>{[&] { data::read_shard(path); },
                                                                [&] { data::DataLoader(path, 1, 1, 10); }}) {
    try {
      open_it();
      messages.push_back("accepted");
    } catch (const std::runtime_error& e) {
      messages.push_back(e.what());
    }
  }
  ASSERT_EQ(setrlimit(RLIMIT_NOFILE, &before), 0);
  for (const std::string& message : messages)
    EXPECT_NE(message.find("shard " + path + ": cannot open: Too many open files"), std::string::npos) << message;
}

TEST(DataShards, ReadsTheLayoutLlmcPythonWrites) {
  // llm.c's data_common.py write_datafile: header = np.zeros(256, dtype=np.int32);
  // header[0] = 20240520; header[1] = 1; header[2] = len(toks); f.write(header.tobytes());
  // f.write(np.array(toks, dtype=np.uint16).tobytes())
  testutil::Rng rng;
  TempDir dir;
  std::vector<int> tokens;
  for (int i = 0; i < 777; i++) tokens.push_back(rng.integer(0, 50256));
  std::string bytes;
  put_i32(bytes, 20240520);
  put_i32(bytes, 1);
  put_i32(bytes, uint32_t(tokens.size()));
  for (int i = 3; i < 256; i++) put_i32(bytes, 0);
  for (int t : tokens) {
    bytes.push_back(char(t & 0xFF));
    bytes.push_back(char(t >> 8));
  }
  const std::string path = dir.file("fineweb_train_000001.bin");
  write_bytes(path, bytes);
  EXPECT_EQ(data::read_shard(path), tokens);
  // ...and write_shard produces the very same bytes.
  data::write_shard(dir.file("ours.bin"), tokens, 50257);
  EXPECT_EQ(read_bytes(dir.file("ours.bin")), bytes);
}

// ---------------------------------------------------------------------------------------------
// Data loader

namespace {

// The vocabularies of the shards below: every token id is below them.
const int kCountingVocab = 1 << 20, kRandomVocab = 4096;

// Writes shards dir/train_NNN.bin with the given sizes; token i of the whole stream is
// `offset + i` (distinct values, so a batch names the positions it came from).
std::vector<std::vector<int>> write_counting_shards(const TempDir& dir, const std::vector<int>& sizes, int offset) {
  std::vector<std::vector<int>> shards;
  int next = offset;
  for (size_t s = 0; s < sizes.size(); s++) {
    std::vector<int> tokens(size_t(sizes[s]));
    for (int& t : tokens) t = next++;
    char name[32];
    std::snprintf(name, sizeof name, "train_%03zu.bin", s);
    data::write_shard(dir.file(name), tokens, kCountingVocab);
    shards.push_back(tokens);
  }
  return shards;
}

std::vector<std::vector<int>> write_random_shards(const TempDir& dir, testutil::Rng& rng, const std::vector<int>& sizes) {
  std::vector<std::vector<int>> shards;
  for (size_t s = 0; s < sizes.size(); s++) {
    std::vector<int> tokens(size_t(sizes[s]));
    for (int& t : tokens) t = rng.integer(0, kRandomVocab - 1);
    char name[32];
    std::snprintf(name, sizeof name, "train_%03zu.bin", s);
    data::write_shard(dir.file(name), tokens, kRandomVocab);
    shards.push_back(tokens);
  }
  return shards;
}

struct Batch {
  std::vector<int> inputs, targets;
  bool operator==(const Batch& o) const { return inputs == o.inputs && targets == o.targets; }
};

Batch next(data::DataLoader& loader, int B, int T) {
  Batch b{std::vector<int>(size_t(B) * T, -7), std::vector<int>(size_t(B) * T, -7)};
  loader.next_batch(b.inputs.data(), b.targets.data());
  return b;
}

}  // namespace

TEST(DataLoader, BatchesAreConsecutiveTokensAcrossShardsAndEpochs) {
  testutil::Rng rng;
  TempDir dir;
  const int B = 2, T = 8;
  const auto shards = write_random_shards(dir, rng, {100, 70, 17});
  data::write_shard(dir.file("val_000.bin"), {1, 2, 3}, 10);  // not matched (too small if it were)
  data::DataLoader loader(dir.file("train_*.bin"), B, T, kRandomVocab);
  EXPECT_EQ(loader.num_tokens(), 187);
  EXPECT_EQ(loader.files().size(), 3u);
  // The spec: windows start at 0, B·T, 2·B·T, … while start + B·T + 1 ≤ shard size; shards in
  // name order; after the last shard, the first again with epoch + 1.
  for (long long epoch = 0; epoch < 3; epoch++)
    for (size_t s = 0; s < shards.size(); s++)
      for (long long p = 0; p + B * T + 1 <= (long long)shards[s].size(); p += B * T) {
        const data::DataLoader::State st = loader.state();
        EXPECT_EQ(st.shard, int(s));
        EXPECT_EQ(st.position, p);
        EXPECT_EQ(st.epoch, epoch);
        const Batch b = next(loader, B, T);
        const std::vector<int> in(shards[s].begin() + p, shards[s].begin() + p + B * T);
        const std::vector<int> tg(shards[s].begin() + p + 1, shards[s].begin() + p + B * T + 1);
        ASSERT_EQ(b.inputs, in) << "shard " << s << " position " << p << " epoch " << epoch;
        ASSERT_EQ(b.targets, tg) << "shard " << s << " position " << p << " epoch " << epoch;
      }
  EXPECT_EQ(loader.state().epoch, 3);
}

TEST(DataLoader, RanksReadDisjointSlicesOfEachWindow) {
  TempDir dir;
  const int B = 3, T = 5, W = 4, BT = B * T;
  const auto shards = write_counting_shards(dir, {W * BT * 3 + 11, W * BT + 1}, 1000);
  std::vector<data::DataLoader> loaders;
  for (int r = 0; r < W; r++) loaders.emplace_back(dir.file("train_*.bin"), B, T, kCountingVocab, r, W);
  for (int step = 0; step < 10; step++) {
    const data::DataLoader::State st = loaders[0].state();
    std::vector<int> window;  // the ranks' inputs in rank order
    std::set<int> seen;
    for (int r = 0; r < W; r++) {
      EXPECT_EQ(loaders[r].state().position, st.position);
      EXPECT_EQ(loaders[r].state().shard, st.shard);
      const Batch b = next(loaders[r], B, T);
      for (int i = 0; i < BT; i++) EXPECT_EQ(b.targets[i], b.inputs[i] + 1);
      for (int t : b.inputs) EXPECT_TRUE(seen.insert(t).second) << "token " << t << " read by two ranks";
      window.insert(window.end(), b.inputs.begin(), b.inputs.end());
    }
    const std::vector<int>& shard = shards[st.shard];
    EXPECT_EQ(window, std::vector<int>(shard.begin() + st.position, shard.begin() + st.position + W * BT))
        << "step " << step;
  }
}

// --sp D: the W ranks form W/D sequence groups (config.hpp's sequence_split); each rank's loader is its
// group's data-parallel loader keeping the rank's tokens of each row. The D ranks of a group together
// hold the group's batch exactly once, each its contiguous slice of every sequence, inputs and targets;
// the groups read distinct windows' slices as W/D data-parallel ranks do. Slicing changes neither the
// state nor the next window.
TEST(DataLoader, SequenceGroupRanksKeepTheirSliceOfTheGroupsSequences) {
  TempDir dir;
  const int B = 3, T = 12, W = 6, D = 3, Tl = T / D, heads = 3;
  const auto shards = write_counting_shards(dir, {W * B * T * 2 + 5, W * B * T + 1}, 1000);
  std::vector<data::DataLoader> whole, sliced;
  for (int r = 0; r < W; r++) {
    const SequenceSplit split = sequence_split(r, W, heads, T, D);
    whole.emplace_back(dir.file("train_*.bin"), B, T, kCountingVocab, split.group, split.groups);
    sliced.emplace_back(dir.file("train_*.bin"), B, T, kCountingVocab, split.group, split.groups);
    sliced.back().keep_tokens(split.first_token, split.end_token);
  }
  for (int step = 0; step < 7; step++) {
    std::vector<Batch> full;
    for (int r = 0; r < W; r++) {
      const SequenceSplit split = sequence_split(r, W, heads, T, D);
      full.push_back(next(whole[r], B, T));
      const Batch mine = next(sliced[r], B, Tl);
      EXPECT_EQ(sliced[r].state().position, whole[r].state().position);
      EXPECT_EQ(sliced[r].state().shard, whole[r].state().shard);
      for (int b = 0; b < B; b++)
        for (int i = 0; i < Tl; i++) {
          EXPECT_EQ(mine.inputs[b * Tl + i], full[r].inputs[b * T + split.first_token + i]) << "rank " << r << " step " << step;
          EXPECT_EQ(mine.targets[b * Tl + i], full[r].targets[b * T + split.first_token + i]) << "rank " << r << " step " << step;
        }
    }
    for (int r = 0; r < W; r++) {  // the group's ranks read the same sequences, the groups distinct ones
      EXPECT_EQ(full[r], full[r / D * D]) << "rank " << r << " step " << step;
      if (r % D == 0 && r > 0) {
        EXPECT_NE(full[r].inputs, full[0].inputs) << "rank " << r << " step " << step;
      }
    }
  }
  EXPECT_THROW(sliced[0].keep_tokens(2, 2), std::runtime_error);
  EXPECT_THROW(sliced[0].keep_tokens(0, T + 1), std::runtime_error);
}

// Validation (train.cu) reads min(--val_batches, windows_per_epoch()) batches from the start: no
// window twice, no token on two ranks, and batches·W·B·T distinct tokens, as it prints at startup.
TEST(DataLoader, ValidationWindowsAreDistinctAcrossRanksAndBatches) {
  TempDir dir;
  const int B = 2, T = 4, BT = B * T;
  write_counting_shards(dir, {100, 61}, 0);
  const std::vector<long long> windows = {99 / 8 + 60 / 8, 99 / 16 + 60 / 16, 99 / 24 + 60 / 24};  // W = 1, 2, 3
  for (int W = 1; W <= 3; W++)
    for (int requested : {3, 10, 100}) {
      std::vector<data::DataLoader> ranks;
      for (int r = 0; r < W; r++) ranks.emplace_back(dir.file("train_*.bin"), B, T, kCountingVocab, r, W);
      ASSERT_EQ(ranks[0].windows_per_epoch(), windows[W - 1]) << "W=" << W;
      const long long batches = std::min<long long>(requested, ranks[0].windows_per_epoch());
      std::set<int> seen;
      for (int r = 0; r < W; r++) {
        ranks[r].reset();
        for (long long i = 0; i < batches; i++)
          for (int t : next(ranks[r], B, T).inputs)
            EXPECT_TRUE(seen.insert(t).second) << "W=" << W << " rank " << r << " batch " << i << ": token " << t << " read twice";
      }
      EXPECT_EQ((long long)seen.size(), batches * W * BT) << "W=" << W << " --val_batches " << requested;
      if (batches == ranks[0].windows_per_epoch()) {
        EXPECT_EQ(ranks[0].state().epoch, 1) << "every window of the epoch was read";
        EXPECT_EQ(seen.count(next(ranks[0], B, T).inputs[0]), 1u) << "one batch more repeats a window";
      }
    }
}

TEST(DataLoader, StateResumesTheSameBatches) {
  testutil::Rng rng;
  TempDir dir;
  const int B = 2, T = 7, W = 2, rank = 1;
  write_random_shards(dir, rng, {200, 90, 120});
  data::DataLoader first(dir.file("train_*.bin"), B, T, kRandomVocab, rank, W);
  const int before = rng.integer(3, 20);
  for (int i = 0; i < before; i++) next(first, B, T);
  const data::DataLoader::State saved = first.state();
  std::vector<Batch> expected;
  for (int i = 0; i < 40; i++) expected.push_back(next(first, B, T));  // crosses shards and epochs

  data::DataLoader resumed(dir.file("train_*.bin"), B, T, kRandomVocab, rank, W);
  resumed.set_state(saved);
  for (int i = 0; i < 40; i++) ASSERT_TRUE(next(resumed, B, T) == expected[i]) << "batch " << i << " after resume";
  EXPECT_EQ(resumed.state().epoch, first.state().epoch);

  data::DataLoader fresh(dir.file("train_*.bin"), B, T, kRandomVocab, rank, W);
  const Batch one = next(fresh, B, T);
  resumed.reset();
  EXPECT_TRUE(next(resumed, B, T) == one);
  expect_refused([&] { resumed.set_state({3, 0, 0}); }, {"shard 3", "does not fit"});
  expect_refused([&] { resumed.set_state({1, 70, 0}); }, {"position 70", "does not fit"});
}

TEST(DataLoader, RefusesMissingAndTooSmallShards) {
  testutil::Rng rng;
  TempDir dir;
  const int V = kRandomVocab;
  expect_refused([&] { data::DataLoader(dir.file("train_*.bin"), 2, 4, V); }, {"no file matches", dir.file("train_*.bin")});
  write_random_shards(dir, rng, {100, 16});
  data::DataLoader one_file(dir.file("train_000.bin"), 2, 4, V);  // a plain path works too
  EXPECT_EQ(one_file.num_tokens(), 100);
  expect_refused([&] { data::DataLoader(dir.file("train_*.bin"), 2, 8, V); },
                 {dir.file("train_001.bin"), "16 tokens", "too few for one batch", "= 17"});
  expect_refused([&] { data::DataLoader(dir.file("train_000.bin"), 5, 10, V, 0, 2); }, {"100 tokens", "= 101"});
  expect_refused([&] { data::DataLoader(dir.file("train_000.bin"), 2, 4, V, 2, 2); }, {"rank=2 world=2"});
  expect_refused([&] { data::DataLoader(dir.file("train_000.bin"), 2, 4, 0); }, {"vocab=0"});
}

// Token ids are checked against V when the loader opens the shards, before any batch: a shard whose
// tokens are read only after many batches is refused at construction, naming the file, the id, its
// position and V; the largest valid id, V − 1, is accepted. Both shard variants (uint16, uint32).
TEST(DataLoader, RefusesTokenIdsOutsideTheVocabularyWhenOpened) {
  testutil::Rng rng;
  for (const int V : {300, 70000}) {
    TempDir dir;
    const int n = 200;
    std::vector<std::vector<int>> shards(3, std::vector<int>(n));
    for (std::vector<int>& shard : shards)
      for (int& t : shard) t = rng.integer(0, V - 1);
    shards[0][rng.integer(0, n - 1)] = V - 1;
    const int bad_shard = rng.integer(1, 2), bad_position = rng.integer(0, n - 1), bad_id = V + rng.integer(0, 5);
    shards[bad_shard][bad_position] = bad_id;
    for (size_t s = 0; s < shards.size(); s++)
      data::write_shard(dir.file("train_00" + std::to_string(s) + ".bin"), shards[s], bad_id + 1);
    expect_refused([&] { data::DataLoader(dir.file("train_*.bin"), 2, 8, V); },
                   {dir.file("train_00" + std::to_string(bad_shard) + ".bin"), "token id " + std::to_string(bad_id),
                    "position " + std::to_string(bad_position), "V = " + std::to_string(V)});
    data::DataLoader with_room(dir.file("train_*.bin"), 2, 8, bad_id + 1);
    EXPECT_EQ(with_room.num_tokens(), 3 * n);
  }
}

// ---------------------------------------------------------------------------------------------
// prepare

namespace {

// A tool built by the Makefile into FLATMOE_BIN (default build/).
std::string built_tool(const std::string& name) {
  const char* dir = std::getenv("FLATMOE_BIN");
  std::string bin = dir ? dir : "build/";
  if (!bin.empty() && bin.back() != '/') bin += '/';
  return bin + name;
}

std::string prepare_binary() { return built_tool("prepare"); }

// Runs prepare with `args` after the shell commands `shell_setup` (e.g. limits); returns its exit
// status, stdout+stderr in `output`.
int run_prepare(const TempDir& dir, const std::string& args, std::string& output, const std::string& shell_setup = "") {
  const std::string log = dir.file("prepare.log");
  const int status = std::system((shell_setup + prepare_binary() + " " + args + " > " + log + " 2>&1").c_str());
  output = read_bytes(log);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// A fortune file of `n_docs` random English documents; returns its path.
std::string write_fortune_corpus(const TempDir& dir, testutil::Rng& rng, int n_docs) {
  const std::string path = dir.file("corpus.txt");
  std::string text;
  for (int d = 0; d < n_docs; d++) text += english(rng, rng.integer(1, 4)) + "\n%\n";
  write_bytes(path, text);
  return path;
}

// The names in a folder.
std::set<std::string> names_in(const std::string& folder) {
  std::set<std::string> names;
  for (const fs::directory_entry& entry : fs::directory_iterator(folder)) names.insert(entry.path().filename().string());
  return names;
}

const std::vector<std::string> kSetFiles = {"tokenizer.bin", "train_000.bin", "val_000.bin"};

std::vector<std::string> read_set(const std::string& out) {
  std::vector<std::string> bytes;
  for (const std::string& file : kSetFiles) bytes.push_back(read_bytes(out + "/" + file));
  return bytes;
}

}  // namespace

TEST(DataPrepare, RefusesBadFlags) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  TempDir dir;
  const std::string out = "--out " + dir.file("out") + " ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--bogus 1", "unknown flag '--bogus'"},
      {"--vocab=300", "flag --vocab=300: give the value as the next word, --vocab 300 (flags take no '=')"},
      {"--vocab", "--vocab needs a value"},
      {"--vocab 256", "outside [257, 1000000]"},
      {"--vocab 1000001", "outside [257, 1000000]"},
      {"--vocab 4k", "needs an integer"},
      {"--val-frac 0", "outside (0, 1)"},
      {"--val-frac 1", "outside (0, 1)"},
      {"--val-frac -0.5", "outside (0, 1)"},
      {"--val-frac nan", "outside (0, 1)"},
      {"--val-frac half", "needs a number"},
      {"--seed -1", "non-negative"},
      {"--seed x", "needs an integer"},
      {"--input " + dir.file("nothing_here"), "does not exist"},
      {"--input " + dir.path.string() + " --input " + dir.file("nothing_here"), "does not exist"},
      {"--shard-tokens 0", "outside [1, 2^31 - 1]"},
      {"--shard-tokens 2147483648", "outside [1, 2^31 - 1]"},
      {"--shard-tokens 1e6", "needs an integer"},
  };
  for (const auto& [args, problem] : cases) {
    std::string output;
    EXPECT_EQ(run_prepare(dir, out + args, output), 1) << args;
    EXPECT_NE(output.find("prepare: error: "), std::string::npos) << args << ": " << output;
    EXPECT_NE(output.find(problem), std::string::npos) << args << ": " << output;
    EXPECT_NE(output.find("usage: prepare"), std::string::npos) << args << ": " << output;
  }
  EXPECT_FALSE(fs::exists(dir.file("out")));
  EXPECT_FALSE(fs::exists(dir.file("out.tmp")));
}

// The documents of the set prepared in `out`: the train shard's, then the validation shard's, each
// decoded up to its <|endoftext|>; n_train: how many came from the train shard.
// The documents of `a` that `b` lacks (multiset difference), one quoted per line.
std::string missing_from(const std::multiset<std::string>& a, const std::multiset<std::string>& b) {
  std::vector<std::string> diff;
  std::set_difference(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(diff));
  std::string text;
  for (const std::string& d : diff) text += "  [" + d + "]\n";
  return text;
}

std::vector<std::string> documents_of_set(const std::string& out, size_t& n_train) {
  const data::Tokenizer tok = data::Tokenizer::load(out + "/tokenizer.bin");
  std::vector<std::string> documents;
  for (const char* split : {"train_000.bin", "val_000.bin"}) {
    const std::vector<int> tokens = data::read_shard(out + "/" + split);
    EXPECT_EQ(tokens.back(), tok.eot()) << split;
    std::vector<int> doc;
    for (int t : tokens) {
      if (t != tok.eot()) {
        doc.push_back(t);
        continue;
      }
      EXPECT_EQ(tok.encode(tok.decode(doc)), doc) << "documents are encoded with this tokenizer";
      documents.push_back(tok.decode(doc));
      doc.clear();
    }
    if (n_train == 0) n_train = documents.size();
  }
  return documents;
}

TEST(DataPrepare, WritesTokenizerAndShardsOfTheDocuments) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  testutil::Rng rng;
  TempDir dir;
  const std::string input = dir.file("corpus");
  fs::create_directories(input);
  std::vector<std::string> expected;
  std::string fortunes;
  for (int d = 0; d < 12; d++) {
    expected.push_back(english(rng, rng.integer(1, 4)) + "\n\t\t-- Anon\n");
    fortunes += expected.back() + (d == 3 ? "%\n%\n  \n%\n" : "%\n");  // an empty and a blank one
  }
  write_bytes(input + "/jokes", fortunes);
  write_bytes(input + "/jokes.dat", std::string("\x00\x00\x00\x02\xff\xfe", 6));
  fs::create_symlink("jokes", input + "/jokes.u8");
  write_bytes(input + "/binary", "caf\xe9 latin-1, not UTF-8\n");
  expected.push_back("An essay: 100% one document.\n%d is not a separator\n");
  write_bytes(input + "/essay.txt", expected.back());

  const std::string out = dir.file("out");
  const std::string args = "--input " + input + " --out " + out + " --vocab 300 --val-frac 0.25 --seed 7";
  std::string output;
  ASSERT_EQ(run_prepare(dir, args, output), 0) << output;
  printf("%s", output.c_str());
  EXPECT_NE(output.find("skipping " + input + "/binary: not valid UTF-8"), std::string::npos) << output;

  EXPECT_EQ(data::Tokenizer::load(out + "/tokenizer.bin").vocab_size(), 300);
  size_t n_train = 0;
  const std::vector<std::string> got = documents_of_set(out, n_train);
  EXPECT_EQ(got.size() - n_train, 3u) << "val = round(13 × 0.25) documents";
  std::multiset<std::string> want(expected.begin(), expected.end()), have(got.begin(), got.end());
  EXPECT_TRUE(want == have) << "the shards hold exactly the documents, each followed by <|endoftext|>";

  // Same seed → the same files; the set replaced leaves nothing beside or inside it.
  const std::vector<std::string> before = read_set(out);
  ASSERT_EQ(run_prepare(dir, args, output), 0) << output;
  EXPECT_EQ(read_set(out), before);
  EXPECT_EQ(names_in(out), std::set<std::string>(kSetFiles.begin(), kSetFiles.end()));
  EXPECT_EQ(names_in(dir.path.string()), (std::set<std::string>{"corpus", "out", "prepare.log"}));
}

// A fortune file written on DOS: "%\r\n" separator lines (and a last "%\r" without a newline)
// split it into its documents, which keep their own "\r\n" line ends.
TEST(DataPrepare, ReadsCrlfFortuneFilesAsSeparateDocuments) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  testutil::Rng rng;
  TempDir dir;
  std::vector<std::string> expected;
  std::string fortunes;
  for (int d = 0; d < 8; d++) {
    expected.push_back(english(rng, rng.integer(1, 3)) + "\r\n\t\t-- Anon\r\n");
    fortunes += expected.back() + (d == 7 ? "%\r" : "%\r\n");
  }
  const std::string input = dir.file("dos_fortunes"), out = dir.file("out");
  write_bytes(input, fortunes);
  std::string output;
  ASSERT_EQ(run_prepare(dir, "--input " + input + " --out " + out + " --vocab 260 --val-frac 0.25", output), 0) << output;
  size_t n_train = 0;
  const std::vector<std::string> got = documents_of_set(out, n_train);
  EXPECT_EQ(n_train, 6u);
  std::multiset<std::string> want(expected.begin(), expected.end()), have(got.begin(), got.end());
  EXPECT_TRUE(want == have) << "each fortune is one document, without its separator";
}

// The set is written into DIR.tmp and renamed to DIR at the end: a run that fails while writing
// (here the train tokens, spooled in DIR.tmp before they are cut into shards, hit a file-size
// limit, as on a full disk) leaves the previous set byte for byte and nothing beside it; the next
// good run replaces the whole set.
TEST(DataPrepare, AFailedRunLeavesThePreviousSetIntact) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  testutil::Rng rng;
  TempDir dir;
  const std::string input = write_fortune_corpus(dir, rng, 80), out = dir.file("out");
  const std::string args = "--input " + input + " --out " + out + " --vocab 300 --val-frac 0.1 --seed ";
  std::string output;
  ASSERT_EQ(run_prepare(dir, args + "1", output), 0) << output;
  const std::vector<std::string> first = read_set(out);
  // ulimit -f counts 512- or 1024-byte blocks (dash or bash): 4 blocks hold the tokenizer, not the train shard
  ASSERT_LT(first[0].size(), 2048u);
  ASSERT_GT(first[1].size(), 8192u);

  const std::string file_size_limit = "ulimit -f 4; trap '' XFSZ; ";
  EXPECT_EQ(run_prepare(dir, args + "2", output, file_size_limit), 1) << output;
  printf("%s", output.c_str());
  EXPECT_NE(output.find("prepare: error: "), std::string::npos) << output;
  EXPECT_NE(output.find(out + ".tmp/train.spool"), std::string::npos) << output;
  EXPECT_NE(output.find("File too large"), std::string::npos) << output;
  EXPECT_EQ(read_set(out), first) << "the previous set must stay as it was";
  EXPECT_EQ(names_in(dir.path.string()), (std::set<std::string>{"corpus.txt", "out", "prepare.log"}));

  ASSERT_EQ(run_prepare(dir, args + "2", output), 0) << output;
  EXPECT_NE(read_set(out)[1], first[1]) << "another seed shuffles the documents differently";
  EXPECT_EQ(names_in(out), std::set<std::string>(kSetFiles.begin(), kSetFiles.end()));
  EXPECT_EQ(names_in(dir.path.string()), (std::set<std::string>{"corpus.txt", "out", "prepare.log"}));
}

// Before any work, prepare refuses an output folder that holds anything but its three files, and a
// DIR.old (the previous set, left by a run interrupted between its two renames); neither is touched.
// A stale DIR.tmp (a run killed while writing: the files prepare writes there) is cleared.
TEST(DataPrepare, ReplacesOnlyItsOwnSet) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  testutil::Rng rng;
  TempDir dir;
  const std::string input = write_fortune_corpus(dir, rng, 20), out = dir.file("out");
  const std::string args = "--input " + input + " --out " + out + " --vocab 280 --val-frac 0.2 --seed 3";
  std::string output;
  ASSERT_EQ(run_prepare(dir, args, output), 0) << output;
  const std::vector<std::string> first = read_set(out);

  write_bytes(out + "/notes.txt", "mine\n");
  EXPECT_EQ(run_prepare(dir, args, output), 1) << output;
  EXPECT_NE(output.find("output folder " + out + " holds notes.txt"), std::string::npos) << output;
  EXPECT_EQ(read_set(out), first);
  EXPECT_EQ(read_bytes(out + "/notes.txt"), "mine\n");
  fs::remove(out + "/notes.txt");

  fs::create_directory(out + ".old");
  EXPECT_EQ(run_prepare(dir, args, output), 1) << output;
  EXPECT_NE(output.find(out + ".old exists"), std::string::npos) << output;
  EXPECT_EQ(read_set(out), first);
  fs::remove(out + ".old");

  fs::create_directory(out + ".tmp");
  write_bytes(out + ".tmp/train_000.bin.tmp", "half a shard");
  write_bytes(out + ".tmp/val.spool", "tokens");
  ASSERT_EQ(run_prepare(dir, args, output), 0) << output;
  EXPECT_EQ(read_set(out), first);
  EXPECT_EQ(names_in(dir.path.string()), (std::set<std::string>{"corpus.txt", "out", "prepare.log"}));
}

// A DIR.tmp that prepare did not leave is refused before any work and never emptied: a folder that
// holds a file prepare does not write (issue 56: thesis.txt was deleted), a link to a folder (its
// files were deleted through it), a plain file. Nothing of them, nor of where the link points, changes.
TEST(DataPrepare, RefusesATemporaryFolderItDidNotMake) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  testutil::Rng rng;
  TempDir dir;
  const std::string input = write_fortune_corpus(dir, rng, 20), out = dir.file("mine"), tmp = out + ".tmp";
  const std::string args = "--input " + input + " --out " + out + " --vocab 280 --val-frac 0.2";
  std::string output;
  fs::create_directory(tmp);
  write_bytes(tmp + "/thesis.txt", "hi\n");
  write_bytes(tmp + "/train_000.bin", "mine too");
  EXPECT_EQ(run_prepare(dir, args, output), 1) << output;
  EXPECT_NE(output.find("temporary folder " + tmp + " holds thesis.txt, which is not one of the files prepare writes"),
            std::string::npos) << output;
  EXPECT_EQ(names_in(tmp), (std::set<std::string>{"thesis.txt", "train_000.bin"}));
  EXPECT_EQ(read_bytes(tmp + "/thesis.txt"), "hi\n");
  fs::remove_all(tmp);

  const std::string elsewhere = dir.file("u");
  fs::create_directory(elsewhere);
  for (const char* name : {"a", "b", "c", "tokenizer.bin"}) write_bytes(elsewhere + "/" + name, name);
  fs::create_directory_symlink(elsewhere, tmp);
  EXPECT_EQ(run_prepare(dir, args, output), 1) << output;
  EXPECT_NE(output.find("temporary folder " + tmp + " is a link"), std::string::npos) << output;
  EXPECT_EQ(names_in(elsewhere), (std::set<std::string>{"a", "b", "c", "tokenizer.bin"}));
  EXPECT_TRUE(fs::is_symlink(tmp));
  fs::remove(tmp);

  write_bytes(tmp, "a file");
  EXPECT_EQ(run_prepare(dir, args, output), 1) << output;
  EXPECT_NE(output.find("temporary folder " + tmp + " exists and is not a folder"), std::string::npos) << output;
  EXPECT_EQ(read_bytes(tmp), "a file");
  EXPECT_FALSE(fs::exists(out));
}

// Compresses `path` with gzip into `zipped` (gzip -n: no name or time stamp in the header).
void gzip_file(const std::string& path, const std::string& zipped) {
  ASSERT_EQ(std::system(("gzip -nc " + path + " > " + zipped).c_str()), 0) << "gzip " << path;
}

// Several --input: their documents go into one set. A file that starts with gzip's magic bytes
// (written here by gzip) is read through gzip -dc. A dictd dictionary (*.dict.dz, dictzip: gzip with
// an index) is split into its entries: an entry starts at a line that follows an empty line and
// begins with neither whitespace nor '[' (a "[1913 Webster]" line after an empty line stays in
// the entry above), and runs to the next one without its trailing blank lines; an entry that is not
// valid UTF-8 is dropped, with a note.
TEST(DataPrepare, ReadsSeveralInputsGzipFilesAndDictionaries) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  testutil::Rng rng;
  TempDir dir;
  std::vector<std::string> expected;
  std::string plain, zipped;
  for (int d = 0; d < 6; d++) {
    expected.push_back(english(rng, rng.integer(1, 3)) + "\n");
    plain += expected.back() + "%\n";
  }
  for (int d = 0; d < 5; d++) {
    expected.push_back(english(rng, rng.integer(1, 3)) + "\n");
    zipped += expected.back() + "%\n";
  }
  write_bytes(dir.file("plain"), plain);
  write_bytes(dir.file("zipped"), zipped);
  gzip_file(dir.file("zipped"), dir.file("zipped.gz"));
  fs::remove(dir.file("zipped"));

  // an entry ends at its first blank line: its last line must not end in one (english() ends one
  // sentence in four with a newline)
  std::string gloss = english(rng, 2);
  while (gloss.back() == '\n') gloss.pop_back();
  const std::vector<std::string> entries = {
      "Abdomen \\Ab*do\"men\\, n. [L.]\n   1. (Anat.) The belly.\n      [1913 Webster]\n\n"
      "   2. (Zool.) The posterior section of the body.\n      [1913 Webster]\n",
      "Gag \\Gag\\, n.\n   A speech interpolated offhand.\n\n\n[1913 Webster]\n\n   {Gag rein} (Harness), a rein.\n",
      "Zythum \\Zy\"thum\\, n.\n   A kind of ancient malt beverage. " + gloss + "\n",
  };
  const std::string not_utf8 = "Cafe \\Caf\xe9\\, n.\n   A coffee house.\n";
  write_bytes(dir.file("tiny.dict"), "\n" + entries[0] + "\n" + entries[1] + "\n\n" + not_utf8 + "\n" + entries[2] + "\n\n \n");
  gzip_file(dir.file("tiny.dict"), dir.file("tiny.dict.dz"));
  fs::remove(dir.file("tiny.dict"));
  expected.insert(expected.end(), entries.begin(), entries.end());

  const std::string out = dir.file("out");
  std::string output;
  ASSERT_EQ(run_prepare(dir, "--input " + dir.file("plain") + " --input " + dir.file("zipped.gz") + " --input " +
                                 dir.file("tiny.dict.dz") + " --out " + out + " --vocab 300 --val-frac 0.25",
                        output),
            0)
      << output;
  printf("%s", output.c_str());
  EXPECT_NE(output.find(dir.file("zipped.gz") + " (through gzip -dc)"), std::string::npos) << output;
  EXPECT_NE(output.find("3 dictionary entries (dropped 1 entries that are not valid UTF-8)"), std::string::npos) << output;
  size_t n_train = 0;
  const std::vector<std::string> got = documents_of_set(out, n_train);
  EXPECT_EQ(got.size() - n_train, 4u) << "val = round(14 × 0.25) documents";
  std::multiset<std::string> want(expected.begin(), expected.end()), have(got.begin(), got.end());
  EXPECT_TRUE(want == have) << "the documents of all three inputs, each once; expected but missing:\n"
                            << missing_from(want, have) << "found but not expected:\n" << missing_from(have, want);
}

// A gzip input that gzip cannot read (cut short, or with a damaged byte that gzip's checks catch)
// stops prepare before anything is written: exit status 1, an error naming the file, the previous
// set byte for byte and nothing beside it. The same file compressed whole gives the set of the
// uncompressed file.
TEST(DataPrepare, RefusesACorruptGzipInputAndKeepsThePreviousSet) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  testutil::Rng rng;
  TempDir dir;
  const std::string corpus = write_fortune_corpus(dir, rng, 40), out = dir.file("out");
  const std::string flags = " --out " + out + " --vocab 280 --val-frac 0.2 --seed 5";
  std::string output;
  ASSERT_EQ(run_prepare(dir, "--input " + corpus + flags, output), 0) << output;
  const std::vector<std::string> first = read_set(out);

  gzip_file(corpus, dir.file("good.gz"));
  const std::string good = read_bytes(dir.file("good.gz"));
  std::string damaged = good;
  damaged[damaged.size() / 2] = char(damaged[damaged.size() / 2] ^ 0x55);
  write_bytes(dir.file("short.gz"), good.substr(0, good.size() / 2));
  write_bytes(dir.file("damaged.gz"), damaged);
  for (const char* bad : {"short.gz", "damaged.gz"}) {
    EXPECT_EQ(run_prepare(dir, "--input " + corpus + " --input " + dir.file(bad) + flags, output), 1) << output;
    printf("%s", output.c_str());
    EXPECT_NE(output.find("prepare: error: input " + dir.file(bad) + ": `gzip -dc"), std::string::npos) << output;
    EXPECT_NE(output.find("not a valid gzip or dictzip file"), std::string::npos) << output;
    EXPECT_EQ(read_set(out), first) << bad;
    EXPECT_EQ(names_in(dir.path.string()),
              (std::set<std::string>{"corpus.txt", "good.gz", "short.gz", "damaged.gz", "out", "prepare.log"}))
        << bad;
  }
  ASSERT_EQ(run_prepare(dir, "--input " + dir.file("good.gz") + flags, output), 0) << output;
  EXPECT_EQ(read_set(out), first) << "the gzip file holds the same documents";
}

// --shard-tokens N cuts each split into ⌈n / N⌉ shards NAME_000.bin, NAME_001.bin, ... whose sizes
// differ by at most one token: read in name order they are exactly the tokens of the one shard
// written without the limit, each once and in order (a document may straddle two shards). The
// trainer's pattern DIR/train_*.bin reads across them, shard after shard. A set of many shards is
// replaced as a whole: the next run's set has none of the old shards.
TEST(DataPrepare, CutsEachSplitIntoShardsOfAtMostShardTokens) {
  if (!fs::exists(prepare_binary())) GTEST_SKIP() << prepare_binary() << " not built (set FLATMOE_BIN to its folder)";
  testutil::Rng rng;
  TempDir dir;
  const std::string corpus = write_fortune_corpus(dir, rng, 150);
  const std::string flags = " --input " + corpus + " --vocab 300 --val-frac 0.2 --seed 11";
  const std::string whole = dir.file("whole"), cut = dir.file("cut");
  std::string output;
  ASSERT_EQ(run_prepare(dir, "--out " + whole + flags, output), 0) << output;
  const long long max_tokens = rng.integer(200, 400);
  ASSERT_EQ(run_prepare(dir, "--out " + cut + flags + " --shard-tokens " + std::to_string(max_tokens), output), 0) << output;
  printf("%s", output.c_str());
  EXPECT_EQ(read_bytes(cut + "/tokenizer.bin"), read_bytes(whole + "/tokenizer.bin"));

  std::set<std::string> names = {"tokenizer.bin"};
  std::vector<std::vector<int>> train_shards;
  for (const std::string split : {"train", "val"}) {
    const std::vector<int> all = data::read_shard(whole + "/" + split + "_000.bin");
    const long long k = ((long long)all.size() + max_tokens - 1) / max_tokens;
    ASSERT_GE(k, 2) << split << ": the test needs several shards";
    std::vector<int> joined;
    long long smallest = max_tokens, largest = 0;
    for (long long s = 0; s < k; s++) {
      char name[32];
      std::snprintf(name, sizeof name, "%s_%03lld.bin", split.c_str(), s);
      names.insert(name);
      const std::vector<int> shard = data::read_shard(cut + "/" + name);
      smallest = std::min(smallest, (long long)shard.size());
      largest = std::max(largest, (long long)shard.size());
      joined.insert(joined.end(), shard.begin(), shard.end());
      if (split == "train") train_shards.push_back(shard);
    }
    EXPECT_LE(largest, max_tokens) << split;
    EXPECT_LE(largest - smallest, 1) << split;
    EXPECT_EQ(joined, all) << split << ": every token once, in order";
    char line[64];
    std::snprintf(line, sizeof line, "%s_%03lld.bin (%lld shards of", split.c_str(), k - 1, k);
    EXPECT_NE(output.find(line), std::string::npos) << output;
  }
  EXPECT_EQ(names_in(cut), names) << "the set is the tokenizer and the shards, nothing else";

  const int B = 2, T = 16, V = 300;
  data::DataLoader loader(cut + "/train_*.bin", B, T, V);
  EXPECT_EQ(loader.files().size(), train_shards.size());
  long long batches = 0;
  for (size_t s = 0; s < train_shards.size(); s++)
    for (size_t p = 0; p + B * T + 1 <= train_shards[s].size(); p += B * T, batches++) {
      const Batch b = next(loader, B, T);
      EXPECT_EQ(b.inputs, std::vector<int>(train_shards[s].begin() + p, train_shards[s].begin() + p + B * T))
          << "shard " << s << " position " << p;
      EXPECT_EQ(b.targets, std::vector<int>(train_shards[s].begin() + p + 1, train_shards[s].begin() + p + B * T + 1))
          << "shard " << s << " position " << p;
    }
  EXPECT_EQ(loader.windows_per_epoch(), batches);
  EXPECT_EQ(loader.state().epoch, 1) << "after the last shard the loader is back at the first";

  ASSERT_EQ(run_prepare(dir, "--out " + cut + flags, output), 0) << output;
  EXPECT_EQ(read_set(cut), read_set(whole));
  EXPECT_EQ(names_in(cut), std::set<std::string>(kSetFiles.begin(), kSetFiles.end()));
}

// The benchmark's corpus (tools/synthetic_tokens.cpp): a shard of TOKENS uniform tokens in [0, VOCAB),
// the same for the same seed; malformed arguments exit non-zero and write nothing.
TEST(SyntheticTokens, WritesUniformTokensInTheVocabulary) {
  const std::string bin = built_tool("synthetic_tokens");
  if (!fs::exists(bin)) GTEST_SKIP() << bin << " not built (set FLATMOE_BIN to its folder)";
  TempDir dir;
  const std::string a = dir.file("a.bin"), b = dir.file("b.bin"), c = dir.file("c.bin");
  ASSERT_EQ(std::system((bin + " " + a + " 20000 300 7").c_str()), 0);
  ASSERT_EQ(std::system((bin + " " + b + " 20000 300 7").c_str()), 0);
  ASSERT_EQ(std::system((bin + " " + c + " 20000 300 8").c_str()), 0);
  const std::vector<int> tokens = data::read_shard(a);
  ASSERT_EQ(tokens.size(), 20000u);
  std::vector<int> seen(300, 0);
  for (int t : tokens) {
    ASSERT_GE(t, 0);
    ASSERT_LT(t, 300);
    seen[t]++;
  }
  for (int v = 0; v < 300; v++) EXPECT_GT(seen[v], 20) << "token " << v << " (expected about 67 of each)";
  EXPECT_EQ(read_bytes(a), read_bytes(b));
  EXPECT_NE(read_bytes(a), read_bytes(c));
  for (const std::string& args : {std::string(" 0 300"), std::string(" 100 0"), std::string(" 10x 300"), std::string(" 100")}) {
    const std::string out = dir.file("bad.bin");
    EXPECT_NE(std::system((bin + " " + out + args + " > /dev/null 2>&1").c_str()), 0) << args;
    EXPECT_FALSE(fs::exists(out)) << args;
  }
}
