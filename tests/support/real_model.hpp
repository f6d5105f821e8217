// The real trained model the end-to-end tests decode with: stories260K and its
// tokenizer tok512, shipped in the repository (examples/models/, see its
// README.md). The environment variable LYNX_MODEL_DIR, when set, names another
// folder to read stories260K.bin and tok512.bin from: to run the tests on other
// copies, or (pointing it at a folder without them) to check that the tests
// report themselves skipped.
//
// Where the model is not found, a case that needs it calls model_or_skip(),
// which records a skip (support/skip.hpp: the executable's other cases still
// run, then it exits with 77 and ctest reports it skipped) and returns false.
// With the environment variable CI set a missing model fails instead: CI must
// run these tests, and the model ships with the sources.
#pragma once

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

#include "llama2c/model.hpp"
#include "skip.hpp"

namespace lynx_tests {

/// $LYNX_MODEL_DIR when set and not empty, else examples/models of the source tree.
inline std::filesystem::path model_dir() {
  const char* dir = std::getenv("LYNX_MODEL_DIR");
  if (dir != nullptr && *dir != '\0') return dir;
  return std::filesystem::path(LYNX_SOURCE_DIR) / "examples" / "models";
}

inline std::filesystem::path model_path() { return model_dir() / "stories260K.bin"; }
inline std::filesystem::path tokenizer_path() { return model_dir() / "tok512.bin"; }

/// Both files are there (the model alone is not enough for tests that decode text).
inline bool model_files_present() {
  return std::filesystem::is_regular_file(model_path()) &&
         std::filesystem::is_regular_file(tokenizer_path());
}

/// The loaded model, or nullptr when its files are missing.
inline const lynx_examples::llama2c::weights* real_model() {
  static const lynx_examples::llama2c::weights* model =
      model_files_present() ? new lynx_examples::llama2c::weights(model_path()) : nullptr;
  return model;
}

/// True when the model is there. Otherwise fails under CI, and elsewhere
/// records why this case is skipped (see the top of this file); the caller
/// returns from the case.
inline bool model_or_skip() {
  if (real_model() != nullptr) return true;
  const char* dir = std::getenv("LYNX_MODEL_DIR");
  const std::string why =
      "stories260K.bin or tok512.bin not found in " + model_dir().string() +
      (dir != nullptr && *dir != '\0' ? " (named by LYNX_MODEL_DIR)"
                                      : " (the sources ship them there: is the checkout whole?)");
  if (std::getenv("CI") != nullptr) FAIL(why << ": CI must have them");
  skip_case(why);
  return false;
}

}  // namespace lynx_tests
