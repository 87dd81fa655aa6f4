// data/tokenizer.hpp — byte-level BPE tokenizer: trainer, encoder, decoder and file format.
//
// Vocabulary (V = vocab_size): ids 0..255 are the 256 bytes; id 256+m is merge m, the
// concatenation of its two parts (which are both ids < 256+m); id V−1 is the special token
// <|endoftext|> (EOT). encode() never emits EOT (the text "<|endoftext|>" is encoded as plain
// bytes), so decode(encode(s)) == s for every byte string s: invalid UTF-8, NULs, anything.
//
// Pre-tokenisation, the same in training and encoding, splits text into chunks, GPT-2-like;
// merges never cross a chunk boundary:
//   - an English contraction: 's 't 'm 'd 're 've 'll
//   - a run of letters (A–Z, a–z, and every byte ≥ 0x80, i.e. all non-ASCII UTF-8), a run of
//     digits, or a run of other non-space bytes (punctuation, control bytes), each with an
//     optional single leading space: " hello", " 42", " --"
//   - a run of whitespace (space \t \n \r \f \v); when it is followed by a non-space byte its last
//     space is left to lead the next chunk ("a   b" → "a", "  ", " b")
//   - no chunk is longer than kMaxChunkBytes bytes (longer runs are cut): this bounds the
//     training and encoding cost of pathological inputs such as a megabyte of '=' or of NULs.
//
// Training: merges are learned greedily by pair frequency over the unique chunks weighted by
// their counts; ties go to the smallest (left id, right id). After each merge only the pairs next
// to a merge site are updated, not every pair of each rewritten word: a site (left, right) →
// new_id at i changes only (ids[i−1], left) → (…, new_id), (left, right) itself and
// (right, ids[i+2]) → (new_id, …); every other pair of the word is the same before and after, so
// the counts (and the merges learned) are exactly those of recounting whole words. Consecutive
// sites ("a a a a" with (a, a), "x y x y" with (x, y)) share their middle pair, which is subtracted
// once and becomes (new_id, new_id). Encoding applies merges by rank
// (lowest rank first, leftmost first among equal ranks), which reproduces applying the merges
// one after the other over the whole chunk, as in training.
//
// File format, little-endian: header 256 × int32 = [0] magic 20240328 (llm.c's tokenizer magic),
// [1] version 3 (flatmoe's merge list; llm.c's own token-table files are versions 1 and 2),
// [2] vocab size V, [3] EOT id (V−1), [4] number of merges M = V − 257, the rest 0;
// then M × (int32 left id, int32 right id) in rank order.
//
// llm.c's own tokenizer files (the same magic, versions 1 and 2) are a token table: after the
// header, V entries of (uint8 length L ≥ 1, L bytes), the bytes of token 0..V−1 in order; version 1
// is GPT-2's (V = 50257, EOT 50256), version 2 gives the EOT id in header word [3]. They hold no
// merges, so a tokenizer loaded from one decodes (the trainer's samples on llm.c's shards) but
// refuses to encode or to be saved, naming its file.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <queue>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "file_io.hpp"

namespace data {

class Tokenizer {
 public:
  static constexpr int32_t kMagic = 20240328;
  static constexpr int32_t kVersion = 3;
  static constexpr size_t kMaxChunkBytes = 256;
  static constexpr const char* kEotText = "<|endoftext|>";

  // documents: a vector of texts (std::string, or std::string_view into text kept by the caller);
  // progress, when given, is called after each merge with (merges done, merges to learn).
  template <typename Docs = std::vector<std::string>>
  static Tokenizer train(const Docs& documents, int vocab_size, const std::function<void(int, int)>& progress = {}) {
    if (vocab_size < 257)
      throw std::runtime_error("tokenizer training: vocab_size " + std::to_string(vocab_size) +
                               " is too small: 256 byte tokens + <|endoftext|> need at least 257");
    const int n_merges = vocab_size - 257;

    // Unique chunks (views into `documents`) and how often each occurs.
    std::unordered_map<std::string_view, long long> chunk_count;
    for (const auto& doc : documents)
      for_each_chunk(std::string_view(doc), [&](std::string_view chunk) {
        if (chunk.size() >= 2) chunk_count[chunk]++;
      });
    std::vector<std::pair<std::string_view, long long>> unique(chunk_count.begin(), chunk_count.end());
    std::sort(unique.begin(), unique.end());
    std::vector<Word> words(unique.size());
    for (size_t w = 0; w < unique.size(); w++) {
      for (unsigned char c : unique[w].first) words[w].ids.push_back(c);
      words[w].count = unique[w].second;
    }

    // Pair statistics: total count of each adjacent pair, and the words it occurs in (a list
    // that may keep words where the pair has since disappeared; those are skipped on use).
    std::unordered_map<uint64_t, long long> pair_count;
    std::unordered_map<uint64_t, std::vector<int>> pair_words;
    for (int w = 0; w < int(words.size()); w++)
      for (size_t i = 0; i + 1 < words[w].ids.size(); i++) {
        const uint64_t key = pair_key(words[w].ids[i], words[w].ids[i + 1]);
        pair_count[key] += words[w].count;
        std::vector<int>& list = pair_words[key];
        if (list.empty() || list.back() != w) list.push_back(w);
      }
    // Max-heap of (count, pair); an entry whose count no longer matches pair_count is stale.
    std::priority_queue<Candidate> heap;
    for (const auto& [key, count] : pair_count) heap.push({count, int(key >> 32), int(uint32_t(key))});

    Tokenizer tok;
    std::vector<int> last_seen(words.size(), -1);  // the merge that last rewrote each word
    for (int m = 0; m < n_merges; m++) {
      while (!heap.empty()) {
        const Candidate& top = heap.top();
        const auto it = pair_count.find(pair_key(top.left, top.right));
        if (it != pair_count.end() && it->second == top.count) break;
        heap.pop();
      }
      if (heap.empty())
        throw std::runtime_error("tokenizer training: the documents run out of pairs to merge after " +
                                 std::to_string(m) + " merges; vocab_size " + std::to_string(vocab_size) +
                                 " needs " + std::to_string(n_merges) + " (use more text or a smaller vocabulary)");
      const int left = heap.top().left, right = heap.top().right, new_id = 256 + m;
      heap.pop();
      tok.merges_.push_back({left, right});
      const uint64_t merged_key = pair_key(left, right);
      const std::vector<int> touched = std::move(pair_words[merged_key]);
      pair_words.erase(merged_key);
      pair_count.erase(merged_key);

      // Rewrites each word in place, left to right, and records only the pair changes at the
      // merge sites (see "Training" above): each site's old pairs (prev, left), (left, right),
      // (right, next) are subtracted, a pair shared by two consecutive sites only once, and the
      // new pairs, exactly those that contain new_id, are added: (prev, new_id) for each site,
      // which for consecutive sites is (new_id, new_id), and (new_id, next) where next is not a site.
      std::unordered_map<uint64_t, long long> delta;
      auto add_pair = [&](int a, int b, long long change) { delta[pair_key(a, b)] += change; };
      for (int w : touched) {
        if (last_seen[w] == m) continue;
        last_seen[w] = m;
        Word& word = words[w];
        std::vector<int>& ids = word.ids;
        const long long count = word.count;
        auto index_new_pair = [&](int a, int b) {
          std::vector<int>& list = pair_words[pair_key(a, b)];
          if (list.empty() || list.back() != w) list.push_back(w);
        };
        const size_t n = ids.size();
        size_t out = 0;           // ids[0, out) is the rewritten prefix
        int prev_old = -1;        // the old id before position i (when i > 0)
        bool prev_site = false;   // whether ids[i − 1] (old) ended a merge site
        for (size_t i = 0; i < n;) {
          if (i + 1 < n && ids[i] == left && ids[i + 1] == right) {
            if (i > 0 && !prev_site) add_pair(prev_old, left, -count);
            add_pair(left, right, -count);
            if (i + 2 < n) add_pair(right, ids[i + 2], -count);
            if (out > 0) {
              add_pair(ids[out - 1], new_id, count);
              index_new_pair(ids[out - 1], new_id);
            }
            ids[out++] = new_id;
            prev_old = right;
            prev_site = true;
            i += 2;
          } else {
            const int id = ids[i];
            if (prev_site) {
              add_pair(new_id, id, count);
              index_new_pair(new_id, id);
            }
            ids[out++] = id;
            prev_old = id;
            prev_site = false;
            i += 1;
          }
        }
        ids.resize(out);
      }
      for (const auto& [key, change] : delta) {
        if (key == merged_key || change == 0) continue;
        const long long count = (pair_count[key] += change);
        if (count == 0) {
          // A pair that vanished never comes back: new pairs always contain the newest token.
          pair_count.erase(key);
          pair_words.erase(key);
        } else {
          heap.push({count, int(key >> 32), int(uint32_t(key))});
        }
      }
      if (progress) progress(m + 1, n_merges);
    }
    tok.build_tables();
    return tok;
  }

  std::vector<int> encode(std::string_view text) const {
    require_merges("encode new text");
    std::vector<int> out;
    out.reserve(text.size() / 3 + 1);
    std::unordered_map<std::string_view, std::vector<int>> cache;  // chunk → ids, for this call
    for_each_chunk(text, [&](std::string_view chunk) {
      if (chunk.size() == 1) {
        out.push_back(int((unsigned char)chunk[0]));
        return;
      }
      auto it = cache.find(chunk);
      if (it == cache.end()) it = cache.emplace(chunk, encode_chunk(chunk)).first;
      out.insert(out.end(), it->second.begin(), it->second.end());
    });
    return out;
  }

  std::string decode(const std::vector<int>& ids) const {
    std::string text;
    for (int id : ids) text += token_bytes(id);
    return text;
  }

  std::string decode_token(int id) const { return token_bytes(id); }
  int eot() const { return eot_; }
  int vocab_size() const { return int(token_bytes_.size()); }
  const std::vector<std::pair<int, int>>& merges() const { return merges_; }

  void save(const std::string& path) const {
    require_merges("be saved as flatmoe's merge list");
    std::string bytes;
    bytes.reserve(size_t(kHeaderBytes) + 8 * merges_.size());
    int32_t header[kHeaderWords] = {};
    header[0] = kMagic;
    header[1] = kVersion;
    header[2] = vocab_size();
    header[3] = eot();
    header[4] = int32_t(merges_.size());
    for (int32_t word : header) append_i32_le(bytes, word);
    for (const auto& [left, right] : merges_) {
      append_i32_le(bytes, left);
      append_i32_le(bytes, right);
    }
    AtomicFileWriter out(path);
    out.write(bytes);
    out.commit();
  }

  // Refuses, naming the file: a path that is not a regular file (a folder, a FIFO, a device), a
  // malformed header, and a file whose size is not what its header says (checked before anything is
  // built from it).
  static Tokenizer load(const std::string& path) {
    std::string bytes;
    try {
      bytes = read_whole_file(path);
    } catch (const std::runtime_error& e) {
      throw std::runtime_error(std::string("tokenizer file ") + e.what());
    }
    auto refuse = [&](const std::string& why) { return std::runtime_error("tokenizer file " + path + ": " + why); };
    if (bytes.size() < size_t(kHeaderBytes))
      throw refuse("truncated header (" + std::to_string(bytes.size()) + " bytes, the header alone is " +
                   std::to_string(kHeaderBytes) + ")");
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
    auto word = [&](long long i) { return load_i32_le(p + 4 * i); };
    if (word(0) != kMagic)
      throw refuse("bad magic " + std::to_string(word(0)) + " (expected " + std::to_string(kMagic) + ")");
    if (word(1) == kLlmcTableVersion1 || word(1) == kLlmcTableVersion2) return load_llmc_table(path, bytes);
    if (word(1) != kVersion)
      throw refuse("unsupported version " + std::to_string(word(1)) + " (expected " + std::to_string(kVersion) +
                   ": flatmoe's merges, or " + std::to_string(kLlmcTableVersion1) + " or " +
                   std::to_string(kLlmcTableVersion2) + ": llm.c's token table)");
    const long long vocab = word(2), eot_id = word(3), n_merges = word(4);
    if (vocab < 257) throw refuse("vocab size " + std::to_string(vocab) + " < 257");
    if (n_merges != vocab - 257)
      throw refuse("merge count " + std::to_string(n_merges) + " does not match vocab size " + std::to_string(vocab) +
                   " (expected vocab − 257 = " + std::to_string(vocab - 257) + ")");
    if (eot_id != vocab - 1)
      throw refuse("EOT id " + std::to_string(eot_id) + " is not vocab size − 1 = " + std::to_string(vocab - 1));
    for (int i = 5; i < kHeaderWords; i++)
      if (word(i) != 0) throw refuse("reserved header word " + std::to_string(i) + " is not zero");
    const long long expected = kHeaderBytes + 8 * n_merges;
    if ((long long)bytes.size() != expected)
      throw refuse(std::string((long long)bytes.size() < expected ? "truncated" : "trailing bytes") + ": " +
                   std::to_string(bytes.size()) + " bytes, expected " + std::to_string(expected) + " for " +
                   std::to_string(n_merges) + " merges");
    Tokenizer tok;
    std::unordered_map<uint64_t, int> seen;
    for (long long m = 0; m < n_merges; m++) {
      const int left = word(kHeaderWords + 2 * m), right = word(kHeaderWords + 2 * m + 1);
      const int limit = int(256 + m);
      if (left < 0 || left >= limit || right < 0 || right >= limit)
        throw refuse("merge " + std::to_string(m) + " = (" + std::to_string(left) + ", " + std::to_string(right) +
                     ") refers to an id outside [0, " + std::to_string(limit) + ")");
      if (!seen.emplace(pair_key(left, right), int(m)).second)
        throw refuse("merge " + std::to_string(m) + " repeats merge " + std::to_string(seen[pair_key(left, right)]));
      tok.merges_.push_back({left, right});
    }
    tok.build_tables();
    return tok;
  }

  // Calls emit(chunk) for each pre-tokenisation chunk of `text`, in order; the chunks
  // concatenate back to `text` exactly.
  template <typename Emit>
  static void for_each_chunk(std::string_view text, Emit&& emit) {
    const size_t n = text.size();
    size_t i = 0;
    while (i < n) {
      const size_t start = i;
      const size_t limit = std::min(n, start + kMaxChunkBytes);
      const ByteClass cls = byte_class(text[i]);
      if (text[i] == '\'' && contraction_length(text, i) > 0) {
        i += contraction_length(text, i);
      } else if (text[i] == ' ' && i + 1 < limit && byte_class(text[i + 1]) != ByteClass::Space) {
        const ByteClass run = byte_class(text[i + 1]);
        i += 1;
        while (i < limit && byte_class(text[i]) == run) i++;
      } else if (cls == ByteClass::Space) {
        while (i < limit && byte_class(text[i]) == ByteClass::Space) i++;
        if (i < n && i - start > 1 && text[i - 1] == ' ' && byte_class(text[i]) != ByteClass::Space) i--;
      } else {
        while (i < limit && byte_class(text[i]) == cls) i++;
      }
      emit(text.substr(start, i - start));
    }
  }

 private:
  static constexpr int32_t kLlmcTableVersion1 = 1, kLlmcTableVersion2 = 2;
  static constexpr int kGpt2Vocab = 50257;  // llm.c's version 1 files are GPT-2's, EOT = 50256

  Tokenizer() = default;  // only train() and load() make tokenizers

  // An llm.c token-table file (version 1 or 2, magic already checked) whose content is `bytes`.
  static Tokenizer load_llmc_table(const std::string& path, const std::string& bytes) {
    const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
    const int version = load_i32_le(p + 4);
    auto refuse = [&](const std::string& why) {
      return std::runtime_error("tokenizer file " + path + ": llm.c token table (version " + std::to_string(version) +
                                "): " + why);
    };
    const long long vocab = load_i32_le(p + 8);
    const long long eot_id = version == kLlmcTableVersion1 ? kGpt2Vocab - 1 : load_i32_le(p + 12);
    if (version == kLlmcTableVersion1 && vocab != kGpt2Vocab)
      throw refuse("vocab size " + std::to_string(vocab) + " (version 1 is GPT-2's, " + std::to_string(kGpt2Vocab) + ")");
    if (vocab < 1) throw refuse("vocab size " + std::to_string(vocab) + " must be positive");
    if (eot_id < 0 || eot_id >= vocab)
      throw refuse("EOT id " + std::to_string(eot_id) + " outside the vocabulary [0, " + std::to_string(vocab) + ")");
    Tokenizer tok;
    // room for the tokens the file can hold (a length byte and at least one byte each), not for what
    // the header claims: a file too short for it is refused in the loop
    tok.token_bytes_.reserve(size_t(std::min<long long>(vocab, ((long long)bytes.size() - kHeaderBytes) / 2)));
    size_t at = size_t(kHeaderBytes);
    for (long long id = 0; id < vocab; id++) {
      if (at >= bytes.size() || at + 1 + p[at] > bytes.size())
        throw refuse("truncated: " + std::to_string(bytes.size()) + " bytes end inside token " + std::to_string(id) +
                     " of " + std::to_string(vocab));
      const size_t length = p[at];
      if (length == 0) throw refuse("token " + std::to_string(id) + " has length 0");
      tok.token_bytes_.emplace_back(bytes, at + 1, length);
      at += 1 + length;
    }
    if (at != bytes.size())
      throw refuse("trailing bytes: " + std::to_string(bytes.size() - at) + " after the " + std::to_string(vocab) +
                   " tokens");
    tok.eot_ = int(eot_id);
    tok.decode_only_file_ = path;
    return tok;
  }

  void require_merges(const char* what) const {
    if (!decode_only_file_.empty())
      throw std::runtime_error("tokenizer file " + decode_only_file_ +
                               ": an llm.c token table has no merges: it decodes token ids but cannot " + what +
                               " (prepare a flatmoe tokenizer with build/prepare)");
  }

  enum class ByteClass { Letter, Digit, Space, Other };
  struct Word {
    std::vector<int> ids;
    long long count = 0;
  };
  struct Candidate {
    long long count;
    int left, right;
    // Priority order of the max-heap: higher count first, then the smaller (left, right).
    bool operator<(const Candidate& o) const {
      if (count != o.count) return count < o.count;
      return std::make_pair(left, right) > std::make_pair(o.left, o.right);
    }
  };

  static uint64_t pair_key(int left, int right) { return uint64_t(uint32_t(left)) << 32 | uint32_t(right); }

  static ByteClass byte_class(char ch) {
    const unsigned char c = (unsigned char)ch;
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c >= 0x80) return ByteClass::Letter;
    if (c >= '0' && c <= '9') return ByteClass::Digit;
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v') return ByteClass::Space;
    return ByteClass::Other;
  }

  // Length of the contraction starting with the apostrophe at text[i], or 0.
  static size_t contraction_length(std::string_view text, size_t i) {
    const std::string_view rest = text.substr(i + 1, 2);
    if (rest.size() == 2 && (rest == "re" || rest == "ve" || rest == "ll")) return 3;
    if (!rest.empty() && (rest[0] == 's' || rest[0] == 't' || rest[0] == 'm' || rest[0] == 'd')) return 2;
    return 0;
  }

  void build_tables() {
    token_bytes_.clear();
    merge_rank_.clear();
    for (int b = 0; b < 256; b++) token_bytes_.push_back(std::string(1, char(b)));
    for (size_t m = 0; m < merges_.size(); m++) {
      token_bytes_.push_back(token_bytes_[merges_[m].first] + token_bytes_[merges_[m].second]);
      merge_rank_.emplace(pair_key(merges_[m].first, merges_[m].second), int(m));
    }
    token_bytes_.push_back(kEotText);
    eot_ = vocab_size() - 1;
  }

  const std::string& token_bytes(int id) const {
    if (id < 0 || id >= vocab_size())
      throw std::runtime_error("tokenizer: token id " + std::to_string(id) + " outside the vocabulary [0, " +
                               std::to_string(vocab_size()) + ")");
    return token_bytes_[id];
  }

  // BPE over one chunk (≥ 2 bytes): a linked list of tokens and a min-heap of (rank, left node)
  // for adjacent pairs that have a merge. A heap entry is stale when the pair at its left node is
  // no longer the pair of its rank; a merge only creates pairs containing its new token, whose
  // ranks are all higher, so popping in (rank, position) order equals merging rank by rank.
  std::vector<int> encode_chunk(std::string_view chunk) const {
    const int n = int(chunk.size());
    std::vector<int> tok(n), prev(n), next(n);
    for (int i = 0; i < n; i++) {
      tok[i] = int((unsigned char)chunk[i]);
      prev[i] = i - 1;
      next[i] = i + 1 < n ? i + 1 : -1;
    }
    std::priority_queue<uint64_t, std::vector<uint64_t>, std::greater<uint64_t>> heap;  // rank << 32 | node
    auto push_pair = [&](int left) {
      const int right = next[left];
      if (right < 0) return;
      const auto it = merge_rank_.find(pair_key(tok[left], tok[right]));
      if (it != merge_rank_.end()) heap.push(uint64_t(it->second) << 32 | uint32_t(left));
    };
    for (int i = 0; i + 1 < n; i++) push_pair(i);
    while (!heap.empty()) {
      const int rank = int(heap.top() >> 32), left = int(uint32_t(heap.top()));
      heap.pop();
      const int right = next[left];
      if (tok[left] < 0 || right < 0 || merges_[rank] != std::make_pair(tok[left], tok[right])) continue;
      tok[left] = 256 + rank;
      tok[right] = -1;  // removed from the list
      next[left] = next[right];
      if (next[right] >= 0) prev[next[right]] = left;
      if (prev[left] >= 0) push_pair(prev[left]);
      push_pair(left);
    }
    std::vector<int> ids;
    for (int i = 0; i >= 0; i = next[i]) ids.push_back(tok[i]);
    return ids;
  }

  std::vector<std::pair<int, int>> merges_;       // merge m makes token 256 + m
  std::vector<std::string> token_bytes_;          // id → bytes (EOT → "<|endoftext|>")
  std::unordered_map<uint64_t, int> merge_rank_;  // pair_key(left, right) → m
  int eot_ = -1;
  std::string decode_only_file_;  // the llm.c token-table file this came from; empty: it has merges
};

}  // namespace data
