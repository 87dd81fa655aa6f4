// tests/test_util.hpp — what every test shares: fresh random inputs, the normwise error of
// notes/design.md §3, its tolerance for the build, and a line that reports the measured error.
#pragma once
#include <gtest/gtest.h>
#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>
#include "../ref/common.hpp"

namespace testutil {

// A fresh seed for every check (never zeros, never the same inputs twice in one run);
// printed so that a failure can be replayed with FLATMOE_SEED.
inline uint64_t fresh_seed() {
  static uint64_t counter = 0;
  static uint64_t base = [] {
    const char* s = getenv("FLATMOE_SEED");
    uint64_t b = s ? strtoull(s, nullptr, 10) : std::random_device{}();
    printf("[seed] FLATMOE_SEED=%llu\n", (unsigned long long)b);
    return b;
  }();
  return base * 6364136223846793005ULL + (++counter) * 1442695040888963407ULL;
}

struct Rng {
  std::mt19937_64 gen;
  explicit Rng(uint64_t seed = fresh_seed()) : gen(seed) {}
  double uniform(double lo = -1, double hi = 1) { return std::uniform_real_distribution<double>(lo, hi)(gen); }
  double normal(double stddev = 1) { return std::normal_distribution<double>(0, stddev)(gen); }
  int integer(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(gen); }  // [lo, hi]
  template <typename T>
  ref::Mat<T> mat(int rows, int cols, double stddev = 1) {
    ref::Mat<T> m(rows, cols);
    for (int i = 0; i < rows; i++)
      for (int j = 0; j < cols; j++) m(i, j) = T(normal(stddev));
    return m;
  }
};

// ‖a − b‖₂ / ‖b‖₂ over all elements (notes/design.md §3).
template <typename A, typename B>
double rel_err(const A& a, const B& b) {
  double num = 0, den = 0;
  for (Eigen::Index i = 0; i < b.size(); i++) {
    double d = double(a.data()[i]) - double(b.data()[i]);
    num += d * d;
    den += double(b.data()[i]) * double(b.data()[i]);
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < b.size(); i++) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return den == 0 ? std::sqrt(num) : std::sqrt(num / den);
}

// Prints a greppable line: [err] <test> <tensor> rel=<measured> tol=<tolerance>
inline void report(const char* what, const char* tensor, double err, double tol) {
  printf("[err] %-28s %-14s rel=%.3e tol=%.0e\n", what, tensor, err, tol);
}

#define EXPECT_REL(what, tensor, err, tol)                          \
  do {                                                              \
    double e_ = (err);                                              \
    testutil::report((what), (tensor), e_, (tol));                  \
    EXPECT_TRUE(std::isfinite(e_)) << (what) << " " << (tensor);    \
    EXPECT_LE(e_, (tol)) << (what) << " " << (tensor);              \
  } while (0)

// Central finite differences of a scalar function f over every element of `x` (in place,
// restored afterwards), in double. Returns the numeric gradient with the shape of x.
template <typename F>
ref::Mat<double> finite_diff(ref::Mat<double>& x, F f, double h = 1e-5) {
  ref::Mat<double> g(x.rows(), x.cols());
  for (Eigen::Index i = 0; i < x.size(); i++) {
    double keep = x.data()[i];
    x.data()[i] = keep + h;
    double fp = f();
    x.data()[i] = keep - h;
    double fm = f();
    x.data()[i] = keep;
    g.data()[i] = (fp - fm) / (2 * h);
  }
  return g;
}

// Tolerance for finite-difference checks of the references (double, h = 1e-5).
static const double FD_TOL = 1e-6;

// A fresh folder under the system temp folder, removed with everything in it at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    static int counter = 0;
    path = std::filesystem::temp_directory_path() /
           ("flatmoe_test_" + std::to_string(getpid()) + "_" + std::to_string(counter++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() { std::filesystem::remove_all(path); }
  std::string file(const std::string& name) const { return (path / name).string(); }
};

// A whole file as bytes ("" when it cannot be read).
inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), (std::streamsize)bytes.size());
  EXPECT_TRUE(out.good()) << "cannot write " << path;
}

// `call` throws std::runtime_error whose message contains every string in `parts` (printed: [refused]).
template <typename F>
void expect_refused(F call, const std::vector<std::string>& parts) {
  try {
    call();
    ADD_FAILURE() << "accepted, expected a refusal mentioning '" << parts.back() << "'";
  } catch (const std::runtime_error& e) {
    const std::string msg = e.what();
    printf("[refused] %s\n", msg.c_str());
    for (const std::string& part : parts) EXPECT_NE(msg.find(part), std::string::npos) << "message: " << msg;
  }
}

}  // namespace testutil
