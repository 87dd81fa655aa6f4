// tests/cpu_toy_trace.cpp — the toy expert-parallel trace (tools/toy_trace.hpp, `make toy`) stays
// true: its ranks' outputs and gradients equal the single-process MoE, it prints every step, its
// bookkeeping moves every route exactly once, in the orders ref/ep_moe.hpp specifies, the bytes it
// prints peak at ops/ep_moe.cuh's closed forms, the ring operators' toys keep their bounds and
// agree with plain computations, and the Ulysses toy trades tokens for heads and back.
#include <algorithm>
#include <sstream>
#include <string>
#include "test_util.hpp"
#include "../tools/toy_trace.hpp"

namespace {

TEST(ToyTrace, OutputsMatchTheReference) {
  std::ostringstream os;
  toy::Result res = toy::toy_trace(os);
  ASSERT_EQ(res.ranks.size(), (size_t)toy::RANKS);
  for (int s = 0; s < toy::RANKS; s++)
    EXPECT_LE((res.ranks[s].out - res.reference[s]).cwiseAbs().maxCoeff(), 1e-12) << "rank " << s;
  EXPECT_LE(res.max_diff, 1e-12);
  EXPECT_NE(os.str().find("matches the reference: max |diff| = "), std::string::npos);
}

// The backward against a plain computation over the global batch: dx[n] = Σ_j W13ᵀ dh13 of route
// (n, j), with dy = w·dout; every expert's weight gradient on its owner, the sum over all sources.
TEST(ToyTrace, BackwardMatchesAPlainComputationAndKeepsExpertGradientsWithTheirOwner) {
  std::ostringstream os;
  const toy::Result res = toy::toy_trace(os);
  using Mat = toy::Mat;
  std::vector<Mat> dW13(toy::E, Mat::Zero(2 * toy::I, toy::H)), dW2(toy::E, Mat::Zero(toy::H, toy::I));
  for (int s = 0; s < toy::RANKS; s++) {
    const toy::Rank& q = res.ranks[s];
    Mat dx = Mat::Zero(toy::N, toy::H);
    for (int n = 0; n < toy::N; n++)
      for (int j = 0; j < toy::K; j++) {
        const int e = q.topk_idx(n, j);
        const ref::Vec<double> h = res.W13[e] * q.x.row(n).transpose();
        ref::Vec<double> a(toy::I), dh(2 * toy::I);
        for (int c = 0; c < toy::I; c++) a(c) = ref::silu(h(c)) * h(toy::I + c);
        const ref::Vec<double> dy = q.topk_w(n, j) * q.dout.row(n).transpose(), da = res.W2[e].transpose() * dy;
        for (int c = 0; c < toy::I; c++) {
          dh(c) = da(c) * h(toy::I + c) * ref::silu_grad(h(c));
          dh(toy::I + c) = da(c) * ref::silu(h(c));
        }
        dx.row(n) += (res.W13[e].transpose() * dh).transpose();
        dW13[e] += dh * q.x.row(n);
        dW2[e] += dy * a.transpose();
        EXPECT_NEAR(q.dtopk_w(n, j), q.dout.row(n).dot((res.W2[e] * a).transpose()), 1e-12) << "rank " << s << " route " << n << "," << j;
      }
    EXPECT_LE((q.dx - dx).cwiseAbs().maxCoeff(), 1e-12) << "rank " << s << " dx";
  }
  for (int d = 0; d < toy::RANKS; d++) {
    ASSERT_EQ(res.ranks[d].dW13.size(), (size_t)toy::E_L) << "rank " << d << " holds its own experts' gradients only";
    for (int l = 0; l < toy::E_L; l++) {
      EXPECT_LE((res.ranks[d].dW13[l] - dW13[d * toy::E_L + l]).cwiseAbs().maxCoeff(), 1e-12) << "expert " << d * toy::E_L + l;
      EXPECT_LE((res.ranks[d].dW2[l] - dW2[d * toy::E_L + l]).cwiseAbs().maxCoeff(), 1e-12) << "expert " << d * toy::E_L + l;
    }
  }
  EXPECT_LE(res.grad_max_diff, 1e-12);
  EXPECT_NE(os.str().find("kept on rank 1"), std::string::npos);
}

// ops/ep_moe.cuh's closed forms (ep_moe_dispatch_peak_bytes, ep_moe_intermediates_peak_bytes), b = toy::B:
//   dispatch 4·(2R + R_d) + H·b·(R + 2·R_d + max(R, R_d)),  expert_intermediates 5·R_d·I·b
TEST(ToyTrace, PrintedBytesPeakAtTheClosedForms) {
  std::ostringstream os;
  const toy::Result res = toy::toy_trace(os);
  const long long R = toy::N * toy::K, H = toy::H, I = toy::I, b = toy::B;
  for (int d = 0; d < toy::RANKS; d++) {
    const toy::Rank& q = res.ranks[d];
    const long long R_d = (long long)q.recv_route.size();
    const long long dispatch = 4 * (2 * R + R_d) + H * b * (R + 2 * R_d + std::max(R, R_d)), intermediates = 5 * R_d * I * b;
    EXPECT_EQ(q.pool.peak.at(toy::DISPATCH), dispatch) << "rank " << d << " R_d " << R_d;
    EXPECT_EQ(q.pool.peak.at(toy::INTERMEDIATES), intermediates) << "rank " << d << " R_d " << R_d;
    EXPECT_TRUE(q.pool.live.empty()) << "rank " << d << " frees everything after ep_saved_free";
    const std::string peaks = "rank " + std::to_string(d) + " dispatch " + std::to_string(dispatch) + " expert_intermediates " +
                              std::to_string(intermediates) + ";";
    EXPECT_NE(os.str().find(peaks), std::string::npos) << "printed: " << peaks;
    // what forward leaves for backward (ops/ep_moe.cuh): route maps, receive map, xe, y; h13
    const long long saved = 4 * (2 * R + R_d) + (R_d + R) * H * b, saved_h13 = 2 * R_d * I * b;
    const std::string after_forward = "8. combine";
    const size_t at = os.str().find("[bytes] rank " + std::to_string(d) + ": dispatch " + std::to_string(saved) + " ",
                                    os.str().find(after_forward));
    ASSERT_NE(at, std::string::npos) << "rank " << d << " after the forward holds " << saved;
    EXPECT_NE(os.str().find("expert_intermediates " + std::to_string(saved_h13) + " ", at), std::string::npos);
  }
}

// PipelinedLLEP's chunks (notes/design.md §6.3): K = min(K_max, ⌈N/c⌉), c_eff = ⌈N/K⌉, and no rank
// receives more than E_p·k·c_eff routes in a chunk; every route is computed once.
TEST(ToyTrace, PipelinedLlepChunksStayUnderTheirBound) {
  std::ostringstream os;
  const toy::Result res = toy::toy_trace(os);
  const int c = 2, K_max = 4;
  const toy::PllepToy t = toy::toy_pllep(os, res, c, K_max);
  EXPECT_EQ(t.chunks, std::min(K_max, (toy::N + c - 1) / c));
  EXPECT_EQ(t.c_eff, (toy::N + t.chunks - 1) / t.chunks);
  EXPECT_EQ(t.bound, (long long)toy::RANKS * toy::K * t.c_eff);
  long long total = 0;
  for (size_t i = 0; i < t.received.size(); i++)
    for (int d = 0; d < toy::RANKS; d++) {
      EXPECT_LE(t.received[i][d], t.bound) << "chunk " << i << " rank " << d;
      total += t.received[i][d];
    }
  EXPECT_EQ(total, (long long)toy::RANKS * toy::N * toy::K);
  EXPECT_LT(*std::max_element(t.ep_received.begin(), t.ep_received.end()),
            (long long)toy::RANKS * toy::N * toy::K) << "standard EP's R_d is only the router's";
  EXPECT_EQ(t.ep_received[0], (long long)res.ranks[0].recv_route.size());
  EXPECT_NE(os.str().find("chunk 1: "), std::string::npos);
}

// RelayMoE's two modes give the EP toy's out and gradients; each hop's volumes are notes/design.md §6.4's.
TEST(ToyTrace, RelayHopsComputeEveryPairOnceAndMatchTheEpToy) {
  std::ostringstream os;
  const toy::Result res = toy::toy_trace(os);
  const toy::RelayToy t = toy::toy_relay(os, res);
  EXPECT_LE(t.max_diff, 1e-12);
  for (const ref::RelayRun<double>* run : {&t.expert, &t.token}) {
    for (const std::vector<int>& times : run->computed)
      for (int n : times) EXPECT_EQ(n, 1);
    EXPECT_EQ(run->forward.size(), (size_t)toy::RANKS * toy::RANKS) << "one record per rank and hop";
  }
  EXPECT_EQ(t.expert_hop_bytes, (long long)toy::E_L * 3 * toy::H * toy::I * toy::B);
  EXPECT_EQ(t.token_hop_bytes, (long long)toy::N * toy::H * (toy::B + 4) + toy::N * toy::K * 8);
  EXPECT_EQ(t.expert.forward[0].weight_elems * toy::B, t.expert_hop_bytes) << "a partition is what expert mode hands on";
  EXPECT_NE(os.str().find(t.token_hop_bytes < t.expert_hop_bytes ? "auto picks token" : "auto picks expert"), std::string::npos);
}

// Ring-DTP's rounds give full-logits cross-entropy; no logits block wider than the sub-block.
TEST(ToyTrace, RingDtpMeetingsGiveTheFullLogitsLoss) {
  std::ostringstream os;
  const toy::Result res = toy::toy_trace(os);
  const toy::RingDTPToy t = toy::toy_ring_dtp(os, res);
  EXPECT_LE(t.max_diff, 1e-12);
  EXPECT_EQ(t.weights_move, toy::N > (toy::V + toy::RANKS - 1) / toy::RANKS);
  EXPECT_LE(t.run.widest_block, 2);
  EXPECT_EQ(t.run.forward.size(), (size_t)toy::RANKS * toy::RANKS) << "every batch meets every shard";
}

// After the exchange rank p holds every token of the heads [2p, 2p + 2), each once; the reverse gives
// back the sequence shards; the printed messages are the pack's contiguous blocks.
TEST(ToyTrace, UlyssesTradesTokensForHeadsAndBack) {
  std::ostringstream os;
  const toy::UlyssesToy t = toy::toy_ulysses(os);
  ASSERT_EQ(t.heads.size(), (size_t)toy::UL_RANKS);
  for (int p = 0; p < toy::UL_RANKS; p++) {
    std::vector<int> seen(toy::UL_T * toy::UL_HEADS, 0);
    for (double v : t.heads[p]) {
      const int token = (int)v / 10, head = (int)v % 10;
      EXPECT_EQ(head / (toy::UL_HEADS / toy::UL_RANKS), p) << "rank " << p << " holds t" << token << "h" << head;
      seen[token * toy::UL_HEADS + head]++;
    }
    int held = 0;
    for (int n : seen) held += n;
    EXPECT_EQ(held, toy::UL_T * toy::UL_HEADS / toy::UL_RANKS) << "rank " << p;
    for (int n : seen) EXPECT_LE(n, 1) << "rank " << p;
  }
  EXPECT_EQ(t.back, t.sequence);
  EXPECT_EQ(t.staging_bytes, 2 * (toy::UL_T / toy::UL_RANKS) * toy::UL_HEADS * toy::B);
  const std::string text = os.str();
  EXPECT_NE(text.find("rank 0 sends to rank 0: t0h0 t0h1 | t1h0 t1h1; to rank 1: t0h2 t0h3 | t1h2 t1h3"), std::string::npos)
      << text;
  EXPECT_NE(text.find("rank 1, heads [2, 4): t0h2 t0h3 | t1h2 t1h3 | t2h2 t2h3 | t3h2 t3h3"), std::string::npos) << text;
}

TEST(ToyTrace, PrintsEveryStep) {
  std::ostringstream os;
  toy::toy_trace(os);
  const std::string text = os.str();
  for (const char* heading : {"\n1. routes", "\n2. route slots", "\n3. send layout", "\n4. exchange", "\n5. regroup",
                              "\n6. grouped GEMM", "\n7. back", "\n8. combine", "\n9. dy at the source", "\n10. dy out",
                              "\n11. expert backward", "\n12. dx back"})
    EXPECT_NE(text.find(heading), std::string::npos) << "missing step heading: " << heading;
}

TEST(ToyTrace, EveryRouteTravelsOnce) {
  std::ostringstream os;
  toy::Result res = toy::toy_trace(os);
  const int R = toy::N * toy::K;
  std::vector<int> seen(toy::RANKS * R, 0);  // [source][route]: times received by any rank
  long long received = 0;
  ref::MatI topk_idx(toy::RANKS * toy::N, toy::K);
  for (int s = 0; s < toy::RANKS; s++) topk_idx.middleRows(s * toy::N, toy::N) = res.ranks[s].topk_idx;
  for (int d = 0; d < toy::RANKS; d++) {
    const toy::Rank& q = res.ranks[d];
    long long sent = 0;
    for (long long rows : q.send_rows) sent += rows;
    EXPECT_EQ(sent, R) << "rank " << d << " sends each of its routes once";
    for (const ref::EPRoute& r : q.recv_route) {
      seen[r.source * R + r.token * toy::K + r.slot]++;
      EXPECT_EQ(topk_idx(r.source * toy::N + r.token, r.slot) / toy::E_L, d) << "a route reached its expert's rank";
    }
    received += (long long)q.recv_route.size();
    // the two orders of ref/ep_moe.hpp: as received (source-major) and by expert (the GEMM's)
    EXPECT_EQ(q.recv_route, ref::ep_received_routes(topk_idx, toy::E, toy::RANKS, d, ref::EPOrder::AsReceived));
    EXPECT_EQ(q.slot_route, ref::ep_received_routes(topk_idx, toy::E, toy::RANKS, d, ref::EPOrder::ByExpert));
  }
  for (int i = 0; i < toy::RANKS * R; i++) EXPECT_EQ(seen[i], 1) << "source " << i / R << " route " << i % R;
  EXPECT_EQ(received, 2 * 4 * 2);
  // the toy's point: uneven ranks, one idle expert
  EXPECT_NE(res.ranks[0].recv_route.size(), res.ranks[1].recv_route.size());
  EXPECT_EQ(res.ranks[1].group_rows[1], 0) << "expert 3 gets no route";
}

}  // namespace
