// tools/toy_trace.cpp — prints one toy MoE layer traced through standard expert parallelism, forward
// and backward, with the bytes each rank holds per step (tools/toy_trace.hpp: 2 simulated ranks on the
// CPU, the arrays of ops/ep_moe.cuh at each step), then the ring operators' toys on the same inputs,
// then Ulysses' all-to-all (2 ranks, 4 heads).
//   make toy [TOY=ep|pllep|relay|ring_dtp|ulysses]     (or build/toy_trace [all|ep|pllep|relay|ring_dtp|ulysses])
// Exits non-zero when a toy differs from its single-process reference by more than 1e-12, when a
// PipelinedLLEP chunk exceeds its bound, or when Ulysses' round trip is not the identity.
#include <cstdio>
#include <iostream>
#include <sstream>
#include "tools/toy_trace.hpp"

int main(int argc, char** argv) {
  const std::string which = argc > 1 ? argv[1] : "all";
  if (argc > 2 || (which != "all" && which != "ep" && which != "pllep" && which != "relay" && which != "ring_dtp" &&
                    which != "ulysses")) {
    fprintf(stderr, "usage: toy_trace [all|ep|pllep|relay|ring_dtp|ulysses] (got '%s'%s)\n", which.c_str(),
            argc > 2 ? " and more" : "");
    return 2;
  }
  auto shown = [&](const char* toy) { return which == "all" || which == toy; };
  std::ostringstream unshown;  // the EP toy's inputs and results feed the ring toys; printed when asked for
  const toy::Result res = toy::toy_trace(shown("ep") ? std::cout : unshown);
  bool ok = res.max_diff <= 1e-12 && res.grad_max_diff <= 1e-12;
  if (shown("pllep")) {
    const toy::PllepToy t = toy::toy_pllep(std::cout, res);
    for (const auto& chunk : t.received)
      for (long long received : chunk) ok = ok && received <= t.bound;
  }
  if (shown("relay")) ok = toy::toy_relay(std::cout, res).max_diff <= 1e-12 && ok;
  if (shown("ring_dtp")) ok = toy::toy_ring_dtp(std::cout, res).max_diff <= 1e-12 && ok;
  if (shown("ulysses")) {
    const toy::UlyssesToy t = toy::toy_ulysses(std::cout);
    ok = t.back == t.sequence && ok;
  }
  return ok ? 0 : 1;
}
