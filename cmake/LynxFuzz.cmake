# libFuzzer targets of tests/fuzz as CTest tests (issue 32). The targets are
# built by tests/fuzz/run.sh with clang++ (-fsanitize=fuzzer,address,undefined),
# whatever compiler configures this build: libFuzzer needs clang, the rest of
# Lynx does not. Off by default (each test fuzzes for LYNX_FUZZ_SECONDS); CI
# runs tests/fuzz/run.sh directly.
#
#   cmake -DLYNX_FUZZ=ON ...          registers fuzz.<target> for every target
#   ctest -L fuzz                     runs them, one at a time
#
# Each test builds its own target into <build>/fuzz, makes its seed corpus,
# fuzzes for LYNX_FUZZ_SECONDS and fails on any crash, leak, timeout or
# out-of-memory (reproducers under <build>/fuzz/findings/<target>/). Without
# clang++ or its libFuzzer runtime (Debian: clang, libclang-rt-<version>-dev)
# the tests are reported skipped (exit 77).

option(LYNX_FUZZ "Register the libFuzzer targets of tests/fuzz as CTest tests (label fuzz)" OFF)
set(LYNX_FUZZ_SECONDS 60 CACHE STRING "Seconds each fuzz.<target> test fuzzes for")
set(LYNX_FUZZ_TARGET_NAMES
    segment_accept tcp_frames ucx_header llama2c_checkpoint llama2c_tokenizer gguf_reader)

if(LYNX_FUZZ)
  find_program(LYNX_FUZZ_BASH bash REQUIRED)
  find_program(LYNX_FUZZ_CLANGXX NAMES clang++ clang++-19 clang++-18 clang++-17 clang++-16
                                       clang++-15 clang++-14)
  if(NOT LYNX_FUZZ_CLANGXX)
    set(LYNX_FUZZ_CLANGXX clang++)  # run.sh reports the tests skipped
  endif()
  foreach(target IN LISTS LYNX_FUZZ_TARGET_NAMES)
    add_test(NAME fuzz.${target}
             COMMAND "${LYNX_FUZZ_BASH}" "${PROJECT_SOURCE_DIR}/tests/fuzz/run.sh"
                     ${LYNX_FUZZ_SECONDS} "${PROJECT_BINARY_DIR}/fuzz"
             WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")
    math(EXPR timeout "${LYNX_FUZZ_SECONDS} + 300")  # building and seeding included
    set_tests_properties(fuzz.${target} PROPERTIES
      LABELS "fuzz" SKIP_RETURN_CODE 77 RUN_SERIAL TRUE TIMEOUT ${timeout}
      ENVIRONMENT "LYNX_FUZZ_TARGETS=${target};CXX=${LYNX_FUZZ_CLANGXX}")
  endforeach()
endif()
