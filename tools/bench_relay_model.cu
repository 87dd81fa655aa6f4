// tools/bench_relay_model.cu — RelayMoE against standard EP at W ranks without running them: the
// closed forms of the MoE peak that the W = 2 tests assert (ops/ep_moe.cuh, ops/relay_moe.cuh) and the
// per-hop volume model (notes/relaymoe.md), evaluated for any W. Needs no GPU. It gives the prediction
// for shapes two GPUs cannot show (the paper's EP = 8).
//
//   build/bf16/bench_relay_model [--ranks 8] [--configs H:I:E:k:N,...] [--links 354,50] [--gemm_tflops 300]
//
// --configs: hidden H, expert width I, experts E, top-k, tokens N per rank (default: the paper's E128
// layer, Qwen3-30B-A3B's experts — H 2048, I 768, E 128, top-8 — at its 40K, 65K and 98K sequences:
// b = 12, tokens split over TP·CP = 8 ranks, so N = 61440, 98304, 147456). Element size: this build's
// floatX; accumulators fp32.
//
// Peak (MiB per rank, pool categories Dispatch + ExpertIntermediates, and for relay also CommStaging,
// where its weight slots and accumulators live): the larger of forward and backward, for balanced
// routing (every rank receives N·k routes; each relay hop holds N·k/W) and for the worst routing (every
// route of every rank to one rank's experts: EP's R_d = W·N·k; relay's largest hop N·k).
//
// Time model (ms per forward + backward, balanced routing), for each bandwidth in --links (GB/s per
// direction per GPU; the ring's neighbour link and the all-to-all alike):
//   FLOPs per route: forward 6·H·I, backward 12·H·I, relay's backward recomputes the hop: + 6·H·I;
//   EP:    4 exchanges of N·k·H·b·(W−1)/W bytes (dispatch and combine, forward and backward) one after
//          the other with the expert GEMMs: comm + compute;
//   relay: W hops, each the larger of its compute and the next transfer (the prefetch overlaps the
//          hop), plus the last transfer home: C + (W−1)·max(C, V/link) + V_home/link per pass, with V
//          the mode's per-hop bytes (expert: E_l·3·H·I·b, doubled in backward for the weight-gradient
//          accumulator that follows the weights; token: relay_token_hop_bytes forward, x, dout,
//          routing and the fp32 dx and dtopk_w accumulators in backward).
// The GEMM rate is one number (--gemm_tflops, default 300: flatmoe's grouped GEMM kernel on B1's
// layer when this was written, 2026-12-01, in its mma.sync form, 225–317 TFLOP/s; the wgmma form runs
// 472–649 as of 2026-12-03: notes/speed.md, 'The grouped expert GEMMs'); launch latencies, the combine
// and permute kernels and NCCL's start-up are left out. A model, not a measurement: notes/relaymoe.md
// says where the W = 2 runs check it.
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>
#include "../ops/ep_moe.cuh"
#include "../ops/relay_moe.cuh"
#include "bench_util.cuh"

namespace {

struct Config {
  int H, I, E, k;
  long long N;
};

struct ModelFlags {
  int ranks = 8;
  std::vector<Config> configs = {{2048, 768, 128, 8, 61440}, {2048, 768, 128, 8, 98304}, {2048, 768, 128, 8, 147456}};
  std::vector<double> links = {354, 50};
  double gemm_tflops = 300;
};

[[noreturn]] void model_usage(const std::string& why) {
  fprintf(stderr,
          "bench_relay_model: %s\n"
          "usage: bench_relay_model [--ranks W] [--configs H:I:E:k:N,...] [--links GB/s,...] [--gemm_tflops r]\n",
          why.c_str());
  exit(EXIT_FAILURE);
}

double parse_positive(const std::string& flag, const std::string& text) {
  char* end = nullptr;
  const double v = strtod(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !(v > 0) || !std::isfinite(v)) model_usage(flag + " '" + text + "': expected a number > 0");
  return v;
}

Config parse_config(const std::string& item, int ranks) {
  std::vector<long long> v;
  size_t start = 0;
  while (true) {
    const size_t colon = item.find(':', start);
    v.push_back(parse_flag_int("--configs", item.substr(start, colon - start).c_str(), 1, 1LL << 31));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  if (v.size() != 5) model_usage("--configs: " + item + " is not H:I:E:k:N");
  const Config c{(int)v[0], (int)v[1], (int)v[2], (int)v[3], v[4]};
  if (c.E % ranks) model_usage("--configs: " + item + ": E must be a multiple of --ranks (E/W experts per rank)");
  if (c.k > c.E) model_usage("--configs: " + item + ": top-k above E");
  return c;
}

ModelFlags parse_model_flags(int argc, char** argv) {
  ModelFlags f;
  std::vector<std::string> configs;
  parse_flag_pairs(argc, argv, model_usage, [&](const std::string& flag, const char* value) {
    if (flag == "--ranks") f.ranks = (int)parse_flag_int(flag, value, 2, 4096);
    else if (flag == "--configs") configs = split_list(value);
    else if (flag == "--links") {
      f.links.clear();
      for (const std::string& item : split_list(value)) f.links.push_back(parse_positive(flag, item));
    } else if (flag == "--gemm_tflops") f.gemm_tflops = parse_positive(flag, value);
    else model_usage("unknown flag " + flag);
  });
  if (!configs.empty()) {  // parsed after the loop: E is checked against the final --ranks
    f.configs.clear();
    for (const std::string& item : configs) f.configs.push_back(parse_config(item, f.ranks));
  } else {
    for (const Config& c : f.configs)
      if (c.E % f.ranks) model_usage("--ranks " + std::to_string(f.ranks) + " does not divide the default configs' E = 128");
  }
  return f;
}

double mib(double bytes) { return bytes / 1048576.0; }

// One pass of W ring hops: compute C per hop, V bytes to the next rank per hop, V_home after the last.
double ring_ms(int W, double compute_ms, double hop_bytes, double home_bytes, double link_gbs) {
  const double transfer_ms = hop_bytes / (link_gbs * 1e6), home_ms = home_bytes / (link_gbs * 1e6);
  return compute_ms + (W - 1) * std::max(compute_ms, transfer_ms) + home_ms;
}

}  // namespace

int main(int argc, char** argv) {
  const ModelFlags f = parse_model_flags(argc, argv);
  const int W = f.ranks;
  const size_t b = sizeof(floatX), b_acc = 4;
  printf("RelayMoE against standard EP at W = %d, closed forms and the per-hop volume model (no GPU), %s elements\n\n", W,
         b == 2 ? "bf16" : "fp32");
  printf("| H | I | E | k | N per rank | auto picks | expert hop MiB | token hop MiB | routing | EP peak MiB | relay expert "
         "peak MiB | relay token peak MiB | EP / relay (auto's mode) |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Config& c : f.configs) {
    const int E_l = c.E / W;
    const long long R = c.N * c.k;
    const RelayChoice choice = relay_choose("auto", c.N, c.H, c.I, E_l, c.k, b, b_acc);
    for (const bool worst : {false, true}) {
      const long long R_d = worst ? (long long)W * R : R;             // EP: routes one rank receives
      const long long R_hop = worst ? R : (R + W - 1) / W;              // relay: routes of the largest hop
      const double ep = (double)ep_moe_dispatch_peak_bytes(R, R_d, c.H, b) + (double)ep_moe_intermediates_peak_bytes(R_d, c.I, b);
      double expert = 0, token = 0;
      for (const bool backward : {false, true}) {
        expert = std::max(expert, (double)relay_expert_live_bytes(backward, c.N, c.k, R_hop, c.H, c.I, E_l, W, b).total());
        token = std::max(token, (double)relay_token_live_bytes(backward, c.N, c.k, R_hop, c.H, c.I, W, b).total());
      }
      const double picked = choice.mode == RelayMode::Expert ? expert : token;
      printf("| %d | %d | %d | %d | %lld | %s | %.1f | %.1f | %s | %.0f | %.0f | %.0f | %.2f |\n", c.H, c.I, c.E, c.k, c.N,
             relay_mode_name(choice.mode), mib((double)choice.expert_bytes), mib((double)choice.token_bytes),
             worst ? "every route to one rank" : "balanced", mib(ep), mib(expert), mib(token), ep / picked);
    }
  }

  printf("\nForward + backward, balanced routing, GEMMs at %.0f TFLOP/s (ms; the faster of EP and auto's mode in bold)\n\n",
         f.gemm_tflops);
  printf("| H | I | E | k | N per rank | link GB/s | EP comm | EP compute | EP | relay expert | relay token | auto | EP / auto |\n");
  printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
  for (const Config& c : f.configs) {
    const int E_l = c.E / W;
    const double R = (double)c.N * c.k, R_hop = R / W, HI = (double)c.H * c.I;
    const double rate = f.gemm_tflops * 1e9;  // FLOP per ms
    const RelayChoice choice = relay_choose("auto", c.N, c.H, c.I, E_l, c.k, b, b_acc);
    for (const double link : f.links) {
      const double exchange = R * c.H * b * (W - 1) / W;  // bytes one EP exchange sends from a rank
      const double ep_comm = 4 * exchange / (link * 1e6), ep_compute = R * 18 * HI / rate;
      const double ep = ep_comm + ep_compute;
      const double partition = (double)relay_expert_hop_bytes(E_l, c.H, c.I, b);
      const double expert = ring_ms(W, R_hop * 6 * HI / rate, partition, 0, link) +
                            ring_ms(W, R_hop * 18 * HI / rate, 2 * partition, partition, link);
      const double block_forward = (double)relay_token_hop_bytes(c.N, c.H, c.k, b, b_acc);
      const double block_backward = (double)c.N * (2.0 * c.H * b + 8.0 * c.k + (c.H + c.k) * 4.0);
      const double token = ring_ms(W, R_hop * 6 * HI / rate, block_forward, c.N * c.H * 4.0, link) +
                           ring_ms(W, R_hop * 18 * HI / rate, block_backward, c.N * (c.H + c.k) * 4.0, link);
      const double picked = choice.mode == RelayMode::Expert ? expert : token;
      const bool relay_faster = picked < ep;
      printf("| %d | %d | %d | %d | %lld | %.0f | %.2f | %.2f | %s%.2f%s | %.2f | %.2f | %s%.2f%s | %.2f |\n", c.H, c.I, c.E,
             c.k, c.N, link, ep_comm, ep_compute, relay_faster ? "" : "**", ep, relay_faster ? "" : "**", expert, token,
             relay_faster ? "**" : "", picked, relay_faster ? "**" : "", ep / picked);
    }
  }
  return EXIT_SUCCESS;
}
