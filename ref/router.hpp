// ref/router.hpp — the router's plain math (twin of ops/router.cuh), per token:
//   s = softmax(logits) over the E experts (score_fn 0) or sigmoid(logits) (score_fn 1)
//   selected = the k experts with the largest s_e + bias_e, in descending order of s + bias,
//              equal keys ordered by the lower expert index (a stable sort)
//   w_j = s_{selected_j}, divided by Σ_j s_{selected_j} when renorm
// The selection is piecewise constant in the logits, so the gradient flows through w only.
#pragma once
#include <algorithm>
#include <numeric>
#include "common.hpp"

namespace ref {

static const int ROUTER_SOFTMAX = 0;
static const int ROUTER_SIGMOID = 1;

// scores [N,E] from logits [N,E]
template <typename T>
Mat<T> router_scores(const Mat<T>& logits, int score_fn) {
  Mat<T> s(logits.rows(), logits.cols());
  for (Eigen::Index n = 0; n < logits.rows(); n++) {
    if (score_fn == ROUTER_SOFTMAX) {
      T mx = logits.row(n).maxCoeff();
      T sum = 0;
      for (Eigen::Index e = 0; e < logits.cols(); e++) sum += std::exp(logits(n, e) - mx);
      for (Eigen::Index e = 0; e < logits.cols(); e++) s(n, e) = std::exp(logits(n, e) - mx) / sum;
    } else {
      for (Eigen::Index e = 0; e < logits.cols(); e++) s(n, e) = sigmoid(logits(n, e));
    }
  }
  return s;
}

template <typename T>
struct RouterResult {
  MatI topk_idx;  // [N,k]
  Mat<T> topk_w;  // [N,k] combine weights
  Mat<T> scores;  // [N,E]
};

// logits [N,E], bias [E] (selection only)
template <typename T>
RouterResult<T> router_forward(const Mat<T>& logits, const Vec<T>& bias, int k, int score_fn, bool renorm) {
  const int N = (int)logits.rows(), E = (int)logits.cols();
  RouterResult<T> r;
  r.scores = router_scores(logits, score_fn);
  r.topk_idx.resize(N, k);
  r.topk_w.resize(N, k);
  std::vector<int> order(E);
  for (int n = 0; n < N; n++) {
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
      return r.scores(n, a) + bias(a) > r.scores(n, b) + bias(b);
    });
    T sum = 0;
    for (int j = 0; j < k; j++) {
      r.topk_idx(n, j) = order[j];
      r.topk_w(n, j) = r.scores(n, order[j]);
      sum += r.topk_w(n, j);
    }
    if (renorm) r.topk_w.row(n) /= sum;
  }
  return r;
}

// Combine weights [N,k] of a choice topk_idx made elsewhere (a routing profile): the selected
// scores, divided by their sum when renorm.
template <typename T>
Mat<T> router_weights(const Mat<T>& scores, const MatI& topk_idx, bool renorm) {
  Mat<T> w(topk_idx.rows(), topk_idx.cols());
  for (Eigen::Index n = 0; n < topk_idx.rows(); n++) {
    for (Eigen::Index j = 0; j < topk_idx.cols(); j++) w(n, j) = scores(n, topk_idx(n, j));
    if (renorm) w.row(n) /= w.row(n).sum();
  }
  return w;
}

// dlogits [N,E] from dtopk_w [N,k], with the selection held fixed.
template <typename T>
Mat<T> router_backward(const Mat<T>& dtopk_w, const Mat<T>& scores, const MatI& topk_idx, int score_fn, bool renorm) {
  const int N = (int)scores.rows(), E = (int)scores.cols(), k = (int)topk_idx.cols();
  Mat<T> dlogits(N, E);
  for (int n = 0; n < N; n++) {
    // ds [E]: gradient with respect to the scores
    Vec<T> ds = Vec<T>::Zero(E);
    T sum = 0;
    for (int j = 0; j < k; j++) sum += scores(n, topk_idx(n, j));
    for (int j = 0; j < k; j++) {
      int e = topk_idx(n, j);
      if (!renorm) {
        ds(e) += dtopk_w(n, j);
        continue;
      }
      // w_j = s_e / sum: dw_j/ds_e = 1/sum, dw_j/ds_f = -s_e/sum² for every selected f
      ds(e) += dtopk_w(n, j) / sum;
      for (int m = 0; m < k; m++) ds(topk_idx(n, m)) -= dtopk_w(n, j) * scores(n, e) / (sum * sum);
    }
    for (int e = 0; e < E; e++) {
      if (score_fn == ROUTER_SOFTMAX) {
        // ds_f/dl_e = s_f (δ_fe − s_e)
        T acc = 0;
        for (int f = 0; f < E; f++) acc += ds(f) * scores(n, f) * ((f == e ? T(1) : T(0)) - scores(n, e));
        dlogits(n, e) = acc;
      } else {
        dlogits(n, e) = ds(e) * scores(n, e) * (T(1) - scores(n, e));
      }
    }
  }
  return dlogits;
}

// loads [E]: how many routes select each expert
inline std::vector<int> router_count_loads(const MatI& topk_idx, int E) {
  std::vector<int> loads(E, 0);
  for (Eigen::Index i = 0; i < topk_idx.size(); i++) loads[topk_idx.data()[i]]++;
  return loads;
}

}  // namespace ref
