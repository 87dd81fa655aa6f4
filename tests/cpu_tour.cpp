// tests/cpu_tour.cpp — notes/tour.md's references stay true: every `name` (file:line) points at the
// line that defines name (a function, struct, class, enum, macro or variable), and every test it
// cites as `Suite.Name` or `Suite.*` exists as TEST(Suite, Name) somewhere under tests/. A reference
// that moved is reported with where the definition is now (file:line), so fixing the tour is one edit.
// Paths are relative to the repository root, the working directory of build/test_cpu.
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>
#include "test_util.hpp"

namespace {

const char* const TOUR = "notes/tour.md";

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream f(path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(f, line);) lines.push_back(line);
  return lines;
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// Whether `line` defines `name` (the last component of a qualified name such as Model::wgrad):
// struct/class/enum/union NAME, #define NAME, or a declaration whose type comes before NAME and that
// is followed by a parameter list, an initialiser or the end of the declaration. Calls (nothing, "=",
// "return" or an operator before the name) are not definitions.
bool defines(const std::string& line, const std::string& qualified) {
  const std::string name = qualified.substr(qualified.rfind(':') == std::string::npos ? 0 : qualified.rfind(':') + 1);
  if (line.find(name) == std::string::npos) return false;
  const std::regex type_def("\\b(struct|class|enum|enum class|union)\\s+" + name + "\\b");
  const std::regex macro("^\\s*#\\s*define\\s+" + name + "\\b");
  // a type (one or more words — long long —, ::, <...>, *, &) then the name: a function (name then "(") or a
  // variable
  const std::regex declaration("^\\s*(template\\s*<[^>]*>\\s*)?(static\\s+|inline\\s+|constexpr\\s+|const\\s+|__global__\\s+)*"
                               "([A-Za-z_][\\w:<>,]*[\\s*&]+)+(\\w+::)*" + name + "\\s*(\\(|=|\\{|;|\\[)");
  const bool statement = std::regex_search(line, std::regex("^\\s*(return|else|if|for|while)\\b"));
  return std::regex_search(line, type_def) || std::regex_search(line, macro) ||
         (!statement && std::regex_search(line, declaration));
}

// Every line of every source file in the repository that defines `name`, as "file:line".
std::vector<std::string> definitions_of(const std::string& name) {
  std::vector<std::string> found;
  for (const auto& entry : std::filesystem::recursive_directory_iterator(".")) {
    const std::string path = entry.path().lexically_relative(".").string();
    const std::string ext = entry.path().extension().string();
    if (!entry.is_regular_file() || path.rfind("build/", 0) == 0 || path.rfind(".", 0) == 0 ||
        (ext != ".cuh" && ext != ".hpp" && ext != ".cu" && ext != ".cpp" && ext != ".h"))
      continue;
    const std::vector<std::string> lines = read_lines(path);
    for (size_t i = 0; i < lines.size(); i++)
      if (defines(lines[i], name)) found.push_back(path + ":" + std::to_string(i + 1));
  }
  return found;
}

TEST(Tour, EveryFileLineReferenceIsTheNamesDefinition) {
  const std::string tour = read_text(TOUR);
  ASSERT_FALSE(tour.empty()) << TOUR << " is missing or empty: run build/test_cpu from the repository root";
  const std::regex reference("`([A-Za-z_][\\w:]*)` \\(([\\w./-]+):(\\d+)\\)");
  int checked = 0;
  for (std::sregex_iterator m(tour.begin(), tour.end(), reference), end; m != end; ++m, checked++) {
    const std::string name = (*m)[1], file = (*m)[2], cited = m->str();
    const int line = std::stoi((*m)[3]);
    const std::vector<std::string> lines = read_lines(file);
    if (lines.empty()) {
      ADD_FAILURE() << TOUR << " cites " << cited << ", but " << file << " does not exist";
      continue;
    }
    if (line >= 1 && line <= (int)lines.size() && defines(lines[line - 1], name)) continue;
    std::string now;
    for (const std::string& at : definitions_of(name)) now += " " + at;
    ADD_FAILURE() << TOUR << " cites " << cited << ", but " << file << ":" << line << " is "
                  << (line >= 1 && line <= (int)lines.size() ? "'" + lines[line - 1] + "'" : "past the end of the file")
                  << "\n  " << name << " is defined at:" << (now.empty() ? " no file of the repository" : now);
  }
  EXPECT_GE(checked, 20) << "the tour's name (file:line) references were not found: has their form changed?";
}

TEST(Tour, EveryCitedTestExists) {
  const std::string tour = read_text(TOUR);
  ASSERT_FALSE(tour.empty()) << TOUR << " is missing or empty: run build/test_cpu from the repository root";
  std::string tests;  // every test source, concatenated
  for (const auto& entry : std::filesystem::directory_iterator("tests")) tests += read_text(entry.path().string());
  const std::regex cited("`([A-Z][A-Za-z0-9]*)\\.([A-Z][A-Za-z0-9]*|\\*)`");
  int checked = 0;
  for (std::sregex_iterator m(tour.begin(), tour.end(), cited), end; m != end; ++m, checked++) {
    const std::string suite = (*m)[1], test = (*m)[2];
    const std::regex defined("\\b(TEST|TEST_F|TEST_P|TYPED_TEST)\\(\\s*" + suite + "\\s*,\\s*" +
                             (test == "*" ? std::string("\\w+") : test) + "\\s*\\)");
    EXPECT_TRUE(std::regex_search(tests, defined))
        << TOUR << " cites " << m->str() << ", but no TEST(" << suite << ", " << (test == "*" ? "..." : test)
        << ") is under tests/";
  }
  EXPECT_GE(checked, 10) << "the tour's Suite.Name citations were not found: has their form changed?";
}

// The checker itself: what counts as a definition, and what is a use.
TEST(Tour, DefinitionsAreToldFromUses) {
  EXPECT_TRUE(defines("inline size_t ep_moe_dispatch_peak_bytes(long long R, long long R_d, int H, size_t b) {",
                      "ep_moe_dispatch_peak_bytes"));
  EXPECT_TRUE(defines("struct MoEDispatcher {", "MoEDispatcher"));
  EXPECT_TRUE(defines("template <typename T>  struct RelayRun {", "RelayRun"));
  EXPECT_TRUE(defines("static __global__ void ep_recv_row_map_kernel(int* recv_row_of_slot) {", "ep_recv_row_map_kernel"));
  EXPECT_TRUE(defines("#define REQUIRE_WORLD(n) do {} while (0)", "REQUIRE_WORLD"));
  EXPECT_TRUE(defines("  SideStream wgrad;", "Model::wgrad"));
  EXPECT_TRUE(defines("int train_main(int argc, char** argv) {", "train_main"));
  EXPECT_TRUE(defines("inline long long pllep_receive_bound(const PLLEPChunking& chunking, int k) {", "pllep_receive_bound"));
  EXPECT_TRUE(defines("  void fused_pass(float* losses, floatX* dx) {", "RingDTPHead::fused_pass"));
  EXPECT_FALSE(defines("  ep_moe_forward_planned(out, saved, x, topk_w, w, ep, op, stream);", "ep_moe_forward_planned"));
  EXPECT_FALSE(defines("  return train_main(argc, argv);", "train_main"));
  EXPECT_FALSE(defines("  const size_t peak = ep_moe_dispatch_peak_bytes(R, R_d, H, b);", "ep_moe_dispatch_peak_bytes"));
  EXPECT_FALSE(defines("// layer_forward (model.cuh) computes x_mid", "layer_forward"));
}

}  // namespace
