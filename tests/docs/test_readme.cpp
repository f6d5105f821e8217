// Every code block of README.md that quotes an example is the example's code:
// the region between `// [name]` markers in examples/*.cpp must appear verbatim
// in the README, so the documentation cannot drift from code that compiles and runs.
#include <doctest/doctest.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

namespace {
std::string read(const std::filesystem::path& p) {
  std::ifstream in(p);
  REQUIRE_MESSAGE(in.good(), "cannot read " << p);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}
}  // namespace

TEST_CASE("README quotes examples/quickstart.cpp verbatim") {
  const std::filesystem::path root = LYNX_SOURCE_DIR;
  const std::string readme = read(root / "README.md");
  const std::string example = read(root / "examples" / "quickstart.cpp");
  const std::string marker = "// [quickstart]";
  const auto begin = example.find(marker);
  REQUIRE(begin != std::string::npos);
  const auto end = example.find(marker, begin + marker.size());
  REQUIRE(end != std::string::npos);
  const std::string region = example.substr(begin, end + marker.size() - begin);
  CHECK_MESSAGE(readme.find(region) != std::string::npos,
                "README.md's quickstart block differs from examples/quickstart.cpp");
}

TEST_CASE("README names the two commands CI and users run") {
  const std::string readme = read(std::filesystem::path(LYNX_SOURCE_DIR) / "README.md");
  CHECK(readme.find("cmake --workflow --preset test") != std::string::npos);
  CHECK(readme.find("cmake --workflow --preset demo") != std::string::npos);
}
