// The real trained model the end-to-end tests decode with (stories260K, from
// shared/models). CI must have it: there a missing file fails the test; on a
// developer machine without it the test says it skipped.
#pragma once

#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>

#include "llama2c/model.hpp"

namespace lynx_tests {

inline const lynx_examples::llama2c::weights* real_model() {
  static const std::filesystem::path path =
      std::filesystem::path(LYNX_SHARED_DIR) / "models" / "stories260K.bin";
  static const lynx_examples::llama2c::weights* model =
      std::filesystem::exists(path) ? new lynx_examples::llama2c::weights(path) : nullptr;
  return model;
}

/// True when the model is there; otherwise fails under CI and skips (with a message) elsewhere.
inline bool model_or_skip() {
  if (real_model() != nullptr) return true;
  if (std::getenv("CI") != nullptr)
    FAIL("stories260K.bin missing from " LYNX_SHARED_DIR "/models: CI must have it");
  MESSAGE("SKIPPED: stories260K.bin not found under " LYNX_SHARED_DIR "/models");
  return false;
}

}  // namespace lynx_tests
