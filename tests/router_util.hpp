// tests/router_util.hpp — router inputs whose selection cannot be changed by rounding.
#pragma once
#include <algorithm>
#include <functional>
#include "../ref/router.hpp"
#include "test_util.hpp"

namespace testutil {

// Logits [N,E] whose selection keys s + bias are well separated: among the k+1 largest keys of
// every token, consecutive keys differ by at least min_gap (a row is redrawn until they do).
// `round` maps each drawn row to the values the operator will see (e.g. through floatX).
inline ref::Mat<double> well_separated_logits(
    Rng& rng, int N, int E, int k, const ref::Vec<double>& bias, int score_fn, double min_gap,
    const std::function<ref::Mat<double>(const ref::Mat<double>&)>& round = [](const ref::Mat<double>& m) { return m; }) {
  ref::Mat<double> logits(N, E);
  for (int n = 0; n < N; n++) {
    for (;;) {
      ref::Mat<double> row = round(rng.mat<double>(1, E, 1.5));
      ref::Mat<double> s = ref::router_scores(row, score_fn);
      std::vector<double> keys(E);
      for (int e = 0; e < E; e++) keys[e] = s(0, e) + bias(e);
      std::sort(keys.begin(), keys.end(), std::greater<double>());
      bool separated = true;
      for (int j = 0; j < std::min(k, E - 1); j++) separated &= keys[j] - keys[j + 1] >= min_gap;
      if (separated) {
        logits.row(n) = row;
        break;
      }
    }
  }
  return logits;
}

}  // namespace testutil
