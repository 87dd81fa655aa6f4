// tests/cpu_bpe_incremental.cpp — the BPE trainer's incremental pair update (issue 14, item 5):
// Tokenizer::train, which after each merge updates only the pairs next to a merge site, learns
// exactly the merges (same pairs, same order) of the trainer before the change, which recounted
// every pair of each rewritten word; kept here as merges_before_incremental_update.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <queue>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "data/tokenizer.hpp"
#include "tests/test_util.hpp"

namespace {

using Merges = std::vector<std::pair<int, int>>;

// Tokenizer::train's merge loop before issue 14, item 5, unchanged but for the names of the
// tokenizer's private pieces (Word, Candidate, pair_key, copied here): after each merge it
// subtracts every adjacent pair of each rewritten word and adds every pair of the rewritten word.
Merges merges_before_incremental_update(const std::vector<std::string>& documents, int vocab_size) {
  struct Word {
    std::vector<int> ids;
    long long count = 0;
  };
  struct Candidate {
    long long count;
    int left, right;
    bool operator<(const Candidate& o) const {
      if (count != o.count) return count < o.count;
      return std::make_pair(left, right) > std::make_pair(o.left, o.right);
    }
  };
  auto pair_key = [](int left, int right) { return uint64_t(uint32_t(left)) << 32 | uint32_t(right); };
  const int n_merges = vocab_size - 257;

  std::unordered_map<std::string_view, long long> chunk_count;
  for (const std::string& doc : documents)
    data::Tokenizer::for_each_chunk(doc, [&](std::string_view chunk) {
      if (chunk.size() >= 2) chunk_count[chunk]++;
    });
  std::vector<std::pair<std::string_view, long long>> unique(chunk_count.begin(), chunk_count.end());
  std::sort(unique.begin(), unique.end());
  std::vector<Word> words(unique.size());
  for (size_t w = 0; w < unique.size(); w++) {
    for (unsigned char c : unique[w].first) words[w].ids.push_back(c);
    words[w].count = unique[w].second;
  }

  std::unordered_map<uint64_t, long long> pair_count;
  std::unordered_map<uint64_t, std::vector<int>> pair_words;
  for (int w = 0; w < int(words.size()); w++)
    for (size_t i = 0; i + 1 < words[w].ids.size(); i++) {
      const uint64_t key = pair_key(words[w].ids[i], words[w].ids[i + 1]);
      pair_count[key] += words[w].count;
      std::vector<int>& list = pair_words[key];
      if (list.empty() || list.back() != w) list.push_back(w);
    }
  std::priority_queue<Candidate> heap;
  for (const auto& [key, count] : pair_count) heap.push({count, int(key >> 32), int(uint32_t(key))});

  Merges merges;
  std::vector<int> last_seen(words.size(), -1);
  for (int m = 0; m < n_merges; m++) {
    while (!heap.empty()) {
      const Candidate& top = heap.top();
      const auto it = pair_count.find(pair_key(top.left, top.right));
      if (it != pair_count.end() && it->second == top.count) break;
      heap.pop();
    }
    if (heap.empty()) break;  // train() throws here; the tests only use texts with enough pairs
    const int left = heap.top().left, right = heap.top().right, new_id = 256 + m;
    heap.pop();
    merges.push_back({left, right});
    const uint64_t merged_key = pair_key(left, right);
    const std::vector<int> touched = std::move(pair_words[merged_key]);
    pair_words.erase(merged_key);
    pair_count.erase(merged_key);

    std::unordered_map<uint64_t, long long> delta;
    for (int w : touched) {
      if (last_seen[w] == m) continue;
      last_seen[w] = m;
      Word& word = words[w];
      std::vector<int> merged;
      merged.reserve(word.ids.size());
      for (size_t i = 0; i < word.ids.size(); i++) {
        if (i + 1 < word.ids.size() && word.ids[i] == left && word.ids[i + 1] == right) {
          merged.push_back(new_id);
          i++;
        } else {
          merged.push_back(word.ids[i]);
        }
      }
      if (merged.size() == word.ids.size()) continue;
      for (size_t i = 0; i + 1 < word.ids.size(); i++) delta[pair_key(word.ids[i], word.ids[i + 1])] -= word.count;
      for (size_t i = 0; i + 1 < merged.size(); i++) {
        const uint64_t key = pair_key(merged[i], merged[i + 1]);
        delta[key] += word.count;
        if (merged[i] == new_id || merged[i + 1] == new_id) {
          std::vector<int>& list = pair_words[key];
          if (list.empty() || list.back() != w) list.push_back(w);
        }
      }
      word.ids = std::move(merged);
    }
    for (const auto& [key, change] : delta) {
      if (key == merged_key || change == 0) continue;
      const long long count = (pair_count[key] += change);
      if (count == 0) {
        pair_count.erase(key);
        pair_words.erase(key);
      } else {
        heap.push({count, int(key >> 32), int(uint32_t(key))});
      }
    }
  }
  return merges;
}

// A tokenizer holding `merges`, through flatmoe's file format (Tokenizer::load is the only way
// to build one from a merge list).
data::Tokenizer tokenizer_of(const Merges& merges) {
  std::string bytes;
  auto put = [&](int32_t v) {
    for (int i = 0; i < 4; i++) bytes.push_back(char(uint32_t(v) >> (8 * i)));
  };
  const int vocab = int(merges.size()) + 257;
  put(data::Tokenizer::kMagic);
  put(data::Tokenizer::kVersion);
  put(vocab);
  put(vocab - 1);
  put(int32_t(merges.size()));
  for (int i = 5; i < 256; i++) put(0);
  for (const auto& [l, r] : merges) {
    put(l);
    put(r);
  }
  testutil::TempDir dir;
  testutil::write_bytes(dir.file("tok.bin"), bytes);
  return data::Tokenizer::load(dir.file("tok.bin"));
}

// English-like text: words from a small Zipf-ish vocabulary and made-up words, spaces, punctuation, newlines.
std::vector<std::string> english_like(testutil::Rng& rng, int n_docs, int words_per_doc) {
  static const char* kWords[] = {"the", "of", "and", "a", "to", "in", "is", "you", "that", "it", "he", "was",
                                 "for", "on", "are", "as", "with", "his", "they", "I", "at", "be", "this",
                                 "have", "from", "or", "one", "had", "by", "word", "but", "not", "what",
                                 "all", "were", "we", "when", "your", "can", "said", "there", "use", "an",
                                 "each", "which", "she", "do", "how", "their", "if", "will", "up", "other",
                                 "about", "out", "many", "then", "them", "these", "so", "some", "her",
                                 "would", "make", "like", "him", "into", "time", "has", "look", "two",
                                 "more", "write", "go", "see", "number", "no", "way", "could", "people",
                                 "my", "than", "first", "water", "been", "call", "who", "oil", "its", "now",
                                 "find", "long", "down", "day", "did", "get", "come", "made", "may", "part",
                                 "don't", "it's", "we'll", "1984", "42"};
  const int n = int(sizeof(kWords) / sizeof(kWords[0]));
  std::vector<std::string> docs;
  for (int d = 0; d < n_docs; d++) {
    std::string s;
    for (int w = 0; w < words_per_doc; w++) {
      const int a = rng.integer(0, n - 1), b = rng.integer(0, n - 1);
      if (rng.integer(0, 3) == 0) {  // a made-up word, so that there are enough pairs to merge
        const int len = rng.integer(2, 10);
        if (rng.integer(0, 9) == 0) s += char('A' + rng.integer(0, 25));
        for (int i = 0; i < len; i++) s += "etaoinshrdlucmfwypvbgkjqxz"[std::min(rng.integer(0, 25), rng.integer(0, 25))];
      } else {
        s += kWords[std::min(a, b)];  // smaller indices more often
      }
      const int p = rng.integer(0, 19);
      s += p == 0 ? ", " : p == 1 ? ". " : p == 2 ? "\n" : " ";
    }
    docs.push_back(s);
  }
  return docs;
}

// Runs of one byte ("aaaa…", overlapping occurrences of (a, a)), of "abab…" and "aabaab…"
// (consecutive merge sites), and random strings over "abc", cut at 256 bytes by the chunker.
std::vector<std::string> runs_of_one_byte(testutil::Rng& rng, int n_docs) {
  std::vector<std::string> docs;
  for (int d = 0; d < n_docs; d++) {
    std::string s;
    for (int k = 0; k < 40; k++) {
      const int kind = rng.integer(0, 3);
      const int len = rng.integer(1, 300);
      if (kind == 0) s += std::string(len, 'a');
      else if (kind == 1) for (int i = 0; i < len; i++) s += char('a' + rng.integer(0, 2));
      else if (kind == 2) for (int i = 0; i < len; i++) s += (i % 2 ? 'b' : 'a');
      else for (int i = 0; i < len; i++) s += (i % 3 == 2 ? 'b' : 'a');
      s += rng.integer(0, 3) == 0 ? " " : "";
    }
    docs.push_back(s);
  }
  return docs;
}

// CJK-like text: 3-byte UTF-8 characters from a set of `alphabet` characters, no spaces, so every
// chunk is a run of letters cut at 256 bytes.
std::vector<std::string> cjk_like(testutil::Rng& rng, int n_docs, size_t bytes_per_doc, int alphabet) {
  std::vector<std::string> docs;
  for (int d = 0; d < n_docs; d++) {
    std::string s;
    while (s.size() + 3 <= bytes_per_doc) {
      const int cp = 0x4E00 + rng.integer(0, alphabet - 1);
      s += char(0xE0 | (cp >> 12));
      s += char(0x80 | ((cp >> 6) & 0x3F));
      s += char(0x80 | (cp & 0x3F));
    }
    docs.push_back(s);
  }
  return docs;
}

void expect_same_as_before(const std::vector<std::string>& docs, const std::vector<int>& vocab_sizes,
                           const std::string& what) {
  std::string sample;
  for (const std::string& d : docs) sample += d.substr(0, 2000);
  for (int vocab : vocab_sizes) {
    SCOPED_TRACE(what + ", vocab " + std::to_string(vocab));
    const data::Tokenizer tok = data::Tokenizer::train(docs, vocab);
    const Merges before = merges_before_incremental_update(docs, vocab);
    ASSERT_EQ(before.size(), size_t(vocab - 257));
    EXPECT_EQ(tok.merges(), before);
    EXPECT_EQ(tok.encode(sample), tokenizer_of(before).encode(sample));
  }
}

}  // namespace

TEST(BpeIncremental, EnglishLikeTextLearnsTheSameMerges) {
  testutil::Rng rng;
  expect_same_as_before(english_like(rng, 30, 2000), {300, 600, 1200}, "english-like");
}

TEST(BpeIncremental, LongRunsOfOneByteLearnTheSameMerges) {
  testutil::Rng rng;
  expect_same_as_before(runs_of_one_byte(rng, 20), {300, 600}, "runs of one byte");
  // The smallest cases of overlapping and consecutive merge sites, spelled out.
  expect_same_as_before({"aaa", "aaaa aaaaa aaaaaaa", "xyxyxy xyx yxyxyxyxy", "aab aab aab"}, {258, 259, 260, 261},
                        "tiny overlaps");
}

TEST(BpeIncremental, CjkLikeTextLearnsTheSameMerges) {
  testutil::Rng rng;
  expect_same_as_before(cjk_like(rng, 8, 20000, 50), {300, 600, 1200}, "cjk-like, 50 characters");
  expect_same_as_before(cjk_like(rng, 4, 30000, 400), {600}, "cjk-like, 400 characters");
}

TEST(BpeIncremental, MixedTextLearnsTheSameMerges) {
  testutil::Rng rng;
  std::vector<std::string> docs = english_like(rng, 10, 1000);
  for (const std::string& d : runs_of_one_byte(rng, 5)) docs.push_back(d);
  for (const std::string& d : cjk_like(rng, 4, 10000, 60)) docs.push_back(d);
  for (std::string& d : docs) d += std::string(1, char(rng.integer(0, 255)));
  expect_same_as_before(docs, {800}, "mixed");
}

// Timing, before (merges_before_incremental_update) and after (Tokenizer::train), on one core;
// prints seconds, asserts only that the merges agree. Run by hand (notes/data.md):
//   build/test_cpu --gtest_also_run_disabled_tests --gtest_filter='BpeIncremental.DISABLED_*'
TEST(BpeIncremental, DISABLED_TimingBeforeAndAfter) {
  auto seconds = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  testutil::Rng rng(14);
  struct Case {
    const char* name;
    std::vector<std::string> docs;
  };
  std::vector<Case> cases;
  cases.push_back({"CJK-like, 10 MB, 2000 characters, no spaces", cjk_like(rng, 100, 100000, 2000)});
  cases.push_back({"English-like, 10 MB", english_like(rng, 400, 5000)});
  for (const Case& c : cases) {
    size_t bytes = 0;
    for (const std::string& d : c.docs) bytes += d.size();
    Merges before, after;
    const double t_before = seconds([&] { before = merges_before_incremental_update(c.docs, 4096); });
    const double t_after = seconds([&] { after = data::Tokenizer::train(c.docs, 4096).merges(); });
    std::printf("%s (%zu bytes), vocab 4096: before %.2f s, after %.2f s\n", c.name, bytes, t_before, t_after);
    EXPECT_EQ(after, before);
  }
}
