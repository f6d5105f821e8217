// The command-line walk the examples share: `--key value` pairs, each handed to
// the example's own setter.
#pragma once

#include <stdexcept>
#include <string>

#include "lynx/core/error.hpp"

namespace lynx_examples::disagg {

/// Walks the `--key value` pairs of argv. set(key, value) applies one and returns
/// false for a key it does not know. --help/-h, a key without a value, an unknown
/// key, or a value its setter cannot parse (a std::logic_error from std::sto*, or
/// a lynx::error) end in usage(why), which does not return.
template <class Set, class Usage>
void parse_options(int argc, char** argv, Set&& set, Usage&& usage) {
  for (int i = 1; i < argc; ++i) {
    const std::string key = argv[i];
    if (key == "--help" || key == "-h") usage("help");
    if (i + 1 >= argc) usage("missing value after " + key);
    const std::string value = argv[++i];
    try {
      if (!set(key, value)) usage("unknown option " + key);
    } catch (const std::logic_error&) {
      usage("bad value '" + value + "' for " + key);
    } catch (const lynx::error& e) {
      usage(e.what());
    }
  }
}

}  // namespace lynx_examples::disagg
