// ref/ulysses.hpp — Ulysses' exchange in plain math (twin of ops/ulysses.cuh): the D ranks of a
// sequence group trade sequence shards for head shards and back, written as where each element of
// the group's global tensor lives before and after. No packing, no messages.
//   global tensor  [B, T, G, nh, hd]: B sequences of T tokens; a token's row holds G tensors side by
//                  side (G = 3: the model's q, k, v; G = 1: one tensor), each of nh heads of hd
//   sequence shard of rank r  [B, T/D, G, nh, hd]: the tokens [r·T/D, (r+1)·T/D) of each sequence, every head
//   head shard of rank r      [B, T, G, nh/D, hd]: every token, the heads [r·nh/D, (r+1)·nh/D)
//   ulysses_to_heads     every rank's sequence shard → every rank's head shard   (=)
//   ulysses_to_sequence  every rank's head shard → every rank's sequence shard   (=)
// Each moves every element once and is the other's inverse: the gradient of each is the other applied
// to its output's gradient, element for element (nothing is added or rounded). Element type X: any
// copyable type (double in the CPU tests, the build's floatX in the GPU tests, compared with memcmp).
#pragma once
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace ref {

struct UlyssesShape {
  int B = 1, T = 1, parts = 1, heads = 1, head_dim = 1, D = 1;
  size_t global_elems() const { return (size_t)B * T * parts * heads * head_dim; }
  size_t shard_elems() const { return global_elems() / D; }  // a sequence shard's, or a head shard's
};

// Where one element of the global tensor lives: a rank and the index in that rank's shard.
struct UlyssesPlace {
  int rank;
  size_t index;
};

// f(global index, place in the sequence shards, place in the head shards) for every element of the
// global tensor [B, T, G, nh, hd], in order. Refuses a D that does not divide T and nh.
template <typename F>
void ulysses_for_each(const UlyssesShape& s, F f) {
  if (s.B < 0 || s.T < 1 || s.parts < 1 || s.heads < 1 || s.head_dim < 1 || s.D < 1 || s.T % s.D != 0 ||
      s.heads % s.D != 0)
    throw std::invalid_argument("ref::ulysses: D = " + std::to_string(s.D) + " must divide T = " + std::to_string(s.T) +
                                " and nh = " + std::to_string(s.heads) + " (B = " + std::to_string(s.B) + ", G = " +
                                std::to_string(s.parts) + ", hd = " + std::to_string(s.head_dim) + ")");
  const int T_local = s.T / s.D, heads_local = s.heads / s.D;
  size_t global = 0;
  for (int b = 0; b < s.B; b++)
    for (int t = 0; t < s.T; t++)
      for (int g = 0; g < s.parts; g++)
        for (int h = 0; h < s.heads; h++)
          for (int e = 0; e < s.head_dim; e++, global++) {
            const UlyssesPlace in_sequence{
                t / T_local, ((((size_t)b * T_local + t % T_local) * s.parts + g) * s.heads + h) * s.head_dim + e};
            const UlyssesPlace in_heads{
                h / heads_local, ((((size_t)b * s.T + t) * s.parts + g) * heads_local + h % heads_local) * s.head_dim + e};
            f(global, in_sequence, in_heads);
          }
}

template <typename X>
void ulysses_check_shards(const std::vector<std::vector<X>>& shards, const UlyssesShape& s, const char* what) {
  bool ok = shards.size() == (size_t)s.D;
  for (const std::vector<X>& shard : shards) ok = ok && shard.size() == s.shard_elems();
  if (!ok)
    throw std::invalid_argument(std::string("ref::ulysses: ") + what + " must be D = " + std::to_string(s.D) +
                                " shards of " + std::to_string(s.shard_elems()) + " elements");
}

// Every rank's sequence shard of the global tensor.
template <typename X>
std::vector<std::vector<X>> ulysses_sequence_shards(const std::vector<X>& global, const UlyssesShape& s) {
  std::vector<std::vector<X>> shards(s.D, std::vector<X>(s.shard_elems()));
  ulysses_for_each(s, [&](size_t i, UlyssesPlace in_sequence, UlyssesPlace) {
    shards[in_sequence.rank][in_sequence.index] = global.at(i);
  });
  return shards;
}

// Every rank's head shard of the global tensor.
template <typename X>
std::vector<std::vector<X>> ulysses_head_shards(const std::vector<X>& global, const UlyssesShape& s) {
  std::vector<std::vector<X>> shards(s.D, std::vector<X>(s.shard_elems()));
  ulysses_for_each(s, [&](size_t i, UlyssesPlace, UlyssesPlace in_heads) {
    shards[in_heads.rank][in_heads.index] = global.at(i);
  });
  return shards;
}

// Every rank's head shard from every rank's sequence shard.
template <typename X>
std::vector<std::vector<X>> ulysses_to_heads(const std::vector<std::vector<X>>& sequence_shards, const UlyssesShape& s) {
  ulysses_check_shards(sequence_shards, s, "the sequence shards");
  std::vector<std::vector<X>> heads(s.D, std::vector<X>(s.shard_elems()));
  ulysses_for_each(s, [&](size_t, UlyssesPlace in_sequence, UlyssesPlace in_heads) {
    heads[in_heads.rank][in_heads.index] = sequence_shards[in_sequence.rank][in_sequence.index];
  });
  return heads;
}

// Every rank's sequence shard from every rank's head shard.
template <typename X>
std::vector<std::vector<X>> ulysses_to_sequence(const std::vector<std::vector<X>>& head_shards, const UlyssesShape& s) {
  ulysses_check_shards(head_shards, s, "the head shards");
  std::vector<std::vector<X>> sequence(s.D, std::vector<X>(s.shard_elems()));
  ulysses_for_each(s, [&](size_t, UlyssesPlace in_sequence, UlyssesPlace in_heads) {
    sequence[in_sequence.rank][in_sequence.index] = head_shards[in_heads.rank][in_heads.index];
  });
  return sequence;
}

}  // namespace ref
