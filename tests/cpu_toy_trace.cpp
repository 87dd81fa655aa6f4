// tests/cpu_toy_trace.cpp — the toy expert-parallel trace (tools/toy_trace.hpp, `make toy`) stays
// true: its ranks' outputs equal the single-process MoE, it prints every step, and its bookkeeping
// moves every route exactly once, in the orders ref/ep_moe.hpp specifies.
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

TEST(ToyTrace, PrintsEveryStep) {
  std::ostringstream os;
  toy::toy_trace(os);
  const std::string text = os.str();
  for (const char* heading : {"\n1. routes", "\n2. route slots", "\n3. send layout", "\n4. exchange", "\n5. regroup",
                              "\n6. grouped GEMM", "\n7. back", "\n8. combine"})
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
