// "Could not run here" for doctest executables. CTest knows passed, failed and
// skipped; every test carries SKIP_RETURN_CODE 77 (tests/CMakeLists.txt), so a
// test executable that exits with 77 is reported as skipped, never as passed.
//
// A test case that cannot run here (a model file or a transport missing) calls
// skip_case(why) and returns. The executable still runs its other cases, so a
// missing model hides none of the checks that need no model; at the end of the
// run it exits with 77 when nothing failed and prints why each skip happened.
// A failure anywhere still fails the executable.
#pragma once

#include <doctest/doctest.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <set>
#include <string>

namespace lynx_tests {

inline constexpr int skip_exit_code = 77;  // SKIP_RETURN_CODE in tests/CMakeLists.txt

namespace detail {

// Distinct reasons: many cases usually skip for the same one.
inline std::set<std::string>& skip_reasons() {
  static std::set<std::string> reasons;
  return reasons;
}

inline std::string& current_case() {
  static std::string name;
  return name;
}

// Runs after main has returned (doctest's summary is written by then); the
// status main returned is replaced with 77.
inline void exit_skipped() {
  std::cout.flush();
  for (const std::string& why : skip_reasons()) std::printf("SKIPPED: %s\n", why.c_str());
  std::fflush(nullptr);
  std::_Exit(skip_exit_code);
}

// A doctest listener: sees the run's totals after the last case. Exiting here
// would cut off the reporters that follow it (doctest calls listeners first),
// so the exit waits for main's return.
struct skip_listener : doctest::IReporter {
  explicit skip_listener(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats& stats) override {
    if (stats.numTestCasesFailed == 0 && !skip_reasons().empty()) std::atexit(exit_skipped);
  }
  void test_case_start(const doctest::TestCaseData& data) override { current_case() = data.m_name; }
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats&) override {}
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("lynx_skip", 1, skip_listener);

}  // namespace detail

/// The current test case cannot run here, for reason `why` (printed now and at
/// the end); the caller returns from the case. See the comment at the top.
inline void skip_case(const std::string& why) {
  std::printf("SKIPPED \"%s\": %s\n", detail::current_case().c_str(), why.c_str());
  std::fflush(stdout);
  detail::skip_reasons().insert(why);
}

}  // namespace lynx_tests
