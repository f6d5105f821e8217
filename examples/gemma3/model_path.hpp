// Where the Gemma-3-270M GGUF is looked for when no --model is given: the
// environment variable LYNX_GEMMA3_GGUF, else the cache that
// cmake/fetch_gemma3.sh fills: ${LYNX_MODEL_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/lynx}.
// The file is under the Gemma terms of use and never part of the repository.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <optional>
#include <system_error>

namespace lynx_examples::gemma3 {

inline constexpr const char* model_file_name = "gemma-3-270m-q4_k_m.gguf";

/// The path the model is expected at (whether or not it exists).
inline std::filesystem::path default_model_path() {
  if (const char* p = std::getenv("LYNX_GEMMA3_GGUF"); p != nullptr && *p != '\0') return p;
  std::filesystem::path cache;
  if (const char* c = std::getenv("LYNX_MODEL_CACHE"); c != nullptr && *c != '\0') {
    cache = c;
  } else if (const char* x = std::getenv("XDG_CACHE_HOME"); x != nullptr && *x != '\0') {
    cache = std::filesystem::path(x) / "lynx";
  } else if (const char* h = std::getenv("HOME"); h != nullptr && *h != '\0') {
    cache = std::filesystem::path(h) / ".cache" / "lynx";
  } else {
    cache = ".";
  }
  return cache / model_file_name;
}

/// The model's path when the file is there.
inline std::optional<std::filesystem::path> find_model() {
  std::error_code ec;
  const std::filesystem::path p = default_model_path();
  if (std::filesystem::is_regular_file(p, ec)) return p;
  return std::nullopt;
}

}  // namespace lynx_examples::gemma3
