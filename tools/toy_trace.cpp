// tools/toy_trace.cpp — prints one toy MoE layer traced through standard expert parallelism
// (tools/toy_trace.hpp: 2 simulated ranks on the CPU, the arrays of ops/ep_moe.cuh at each step).
//   make toy        (or build/toy_trace)
// Exits non-zero when the ranks' outputs differ from the single-process reference by more than 1e-12.
#include <iostream>
#include "tools/toy_trace.hpp"

int main() {
  toy::Result res = toy::toy_trace(std::cout);
  return res.max_diff <= 1e-12 ? 0 : 1;
}
