// routing_profile.hpp — routing profiles (host side, plain C++; paper "flattening memory peaks",
// appendix B.2). A profile replaces the router's choice of experts by a fixed one, for benchmarks and
// skew tests. A profile gives only the expert indices; the caller fills the weights: the trainer
// (--routing, model.cuh router_step) makes the indices on the device (ops/router.cuh router_profile_choice,
// which this file's routing_profile_indices is the twin of) and uses router_weights, the router's own scores for
// the forced experts, renormalised over the k slots when --renorm 1; tools/bench_ep_moe.cu uses 1/k
// (the paper's setting); tests/dist_ep_moe.cu draws random positive weights.
//   balanced  token i selects experts {(i + j) mod E : j = 0..k−1}
//   hot:r/h   experts 0..h−1 are hot, h..E−1 cold. The first ⌊rN⌋ token positions are hot and
//             select {j mod h : j = 0..k−1}: with h < k a hot token's k routes collapse onto h
//             distinct experts (repeats are routes like any other: the MoE computes each of them).
//             Every other token i selects {h + ((i + j) mod (E − h)) : j = 0..k−1}, walking the cold
//             set (distinct when E − h ≥ k).
// Token positions i are the rank's own (0..N−1), so every rank routes the same way; the indices
// depend on nothing else (no randomness). Slot j of token i is topk_idx[i·k + j].
// Spelling: "balanced", or "hot:r/h" with r a decimal fraction in [0, 1] (e.g. "hot:0.5/2") and h a
// positive integer; anything else is refused with std::invalid_argument.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

struct RoutingProfile {
  enum Kind { Balanced, Hot } kind = Balanced;
  double r = 0;  // hot-token fraction of the N positions (Hot only)
  int h = 0;     // number of hot experts 0..h−1 (Hot only)
};

// Parses "balanced" or "hot:r/h".
inline RoutingProfile parse_routing_profile(const std::string& s) {
  const std::string usage = "routing profile '" + s + "': expected \"balanced\" or \"hot:r/h\" with r a decimal "
                            "fraction in [0, 1] and h a positive integer (e.g. \"hot:0.5/2\")";
  RoutingProfile p;
  if (s == "balanced") return p;
  if (s.compare(0, 4, "hot:") != 0) throw std::invalid_argument(usage);
  const size_t slash = s.find('/', 4);
  if (slash == std::string::npos) throw std::invalid_argument(usage + ": missing '/h'");
  const std::string r_text = s.substr(4, slash - 4), h_text = s.substr(slash + 1);
  // r: digits with at most one '.', at least one digit; h: digits only (no sign, no exponent, no spaces)
  int digits = 0, dots = 0;
  for (char ch : r_text) {
    if (ch >= '0' && ch <= '9') digits++;
    else if (ch == '.') dots++;
    else throw std::invalid_argument(usage + ": r '" + r_text + "' is not a decimal number");
  }
  if (digits == 0 || dots > 1) throw std::invalid_argument(usage + ": r '" + r_text + "' is not a decimal number");
  if (h_text.empty() || h_text.size() > 9 || h_text.find_first_not_of("0123456789") != std::string::npos)
    throw std::invalid_argument(usage + ": h '" + h_text + "' is not a positive integer");
  p.kind = RoutingProfile::Hot;
  p.r = std::stod(r_text);
  p.h = std::stoi(h_text);
  if (p.r > 1) throw std::invalid_argument(usage + ": r = " + r_text + " is above 1");
  if (p.h < 1) throw std::invalid_argument(usage + ": h must be at least 1");
  return p;
}

// "balanced" or "hot:r/h" (r printed with %g): the spelling parse_routing_profile reads back.
inline std::string routing_profile_name(const RoutingProfile& p) {
  if (p.kind == RoutingProfile::Balanced) return "balanced";
  char buf[64];
  snprintf(buf, sizeof(buf), "hot:%g/%d", p.r, p.h);
  return buf;
}

// ⌊r·N⌋ for the decimal r that was written: r·N in binary floating point can land just below an
// integer (0.29·100 = 28.999…), which is taken as that integer.
inline int routing_profile_hot_tokens(const RoutingProfile& p, int N) {
  if (p.kind == RoutingProfile::Balanced) return 0;
  const double rn = p.r * N;
  const double nearest = std::round(rn);
  return (int)(std::fabs(rn - nearest) <= 1e-9 * std::max(1.0, rn) ? nearest : std::floor(rn));
}

// topk_idx [N·k] of the profile (see above). Refuses sizes the profile cannot fill: h > E, or a cold
// token when no expert is cold (h = E).
// Why the profile cannot fill these sizes ("" when it can): h > E, or a cold token when no expert is cold
// (h = E). The host's routing_profile_indices and the device's router_profile_choice both refuse by it.
inline std::string routing_profile_refusal(const RoutingProfile& p, int N, int E, int k) {
  if (N < 0 || E < 1 || k < 1)
    return "routing_profile_indices: need N >= 0, E >= 1, k >= 1 (N=" + std::to_string(N) + " E=" + std::to_string(E) +
           " k=" + std::to_string(k) + ")";
  if (p.kind == RoutingProfile::Hot && (p.h > E || (p.h == E && routing_profile_hot_tokens(p, N) < N)))
    return "routing profile " + routing_profile_name(p) + " with E=" + std::to_string(E) +
           ": needs h <= E, and h < E unless every token is hot";
  return "";
}

inline std::vector<int> routing_profile_indices(const RoutingProfile& p, int N, int E, int k) {
  const std::string refused = routing_profile_refusal(p, N, E, k);
  if (!refused.empty()) throw std::invalid_argument(refused);
  const int hot_tokens = routing_profile_hot_tokens(p, N);
  std::vector<int> topk_idx((size_t)N * k);
  for (int i = 0; i < N; i++)
    for (int j = 0; j < k; j++) {
      int e;
      if (p.kind == RoutingProfile::Balanced) e = (int)(((long long)i + j) % E);
      else if (i < hot_tokens) e = j % p.h;
      else e = p.h + (int)(((long long)i + j) % (E - p.h));
      topk_idx[(size_t)i * k + j] = e;
    }
  return topk_idx;
}
