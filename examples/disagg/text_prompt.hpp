// The prompt of a request on a model with a real tokenizer (a Gemma-3 GGUF):
// text given on the command line or read from a file, else a paragraph of
// English written for this demo and built into it (so the examples run the
// same from a build tree or an installed copy), tokenized with BOS and
// repeated or cut to a requested number of tokens.
#pragma once

#include <cstdint>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "gemma3/tokenizer.hpp"

namespace lynx_examples::disagg {

/// The built-in prompt: about 230 tokens of plain English prose.
inline constexpr const char* builtin_paragraph =
    "The old harbour town wakes before the sun. Long before the first bus leaves the square, "
    "the bakers have lit their ovens and the fishing boats have slipped out past the stone "
    "breakwater, their lamps swinging in the dark. By six the market stalls are up: crates of "
    "mackerel and crab on beds of ice, baskets of early strawberries, bunches of sea lavender "
    "for the tourists who will not arrive until noon. The harbour master walks the quay with a "
    "clipboard, counting the moorings and reading the sky. He has done this for thirty years and "
    "can tell from the colour of the water whether the afternoon will bring a squall. Children "
    "run down the steep lanes to school, past the chapel, the chandlery and the little museum "
    "that keeps the figurehead of a ship wrecked on the rocks in a winter storm a century ago. "
    "In the evening, when the boats come home and the gulls settle on the roofs, the whole town "
    "gathers on the sea wall to watch the light change over the bay, and someone always asks the "
    "harbour master what tomorrow will bring. He looks at the clouds for a long moment and says";

/// Reads a prompt file whole; throws std::runtime_error naming it when it cannot.
inline std::string read_prompt_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read the prompt file " + path);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

/// `text` tokenized with BOS; with tokens > 0, cut to that many tokens, or
/// repeated (its tokens after BOS again and again, a blank line between
/// copies) until it has them. tokens <= 0: the text as it is.
inline std::vector<int> text_prompt(const gemma3::tokenizer& tok, const std::string& text,
                                    int tokens) {
  std::vector<std::int32_t> ids = tok.encode(text, /*add_bos=*/true);
  if (ids.size() < 2) throw std::invalid_argument("the prompt text is empty");
  if (tokens > 0 && static_cast<int>(ids.size()) < tokens) {
    std::vector<std::int32_t> body = tok.encode("\n\n" + text, /*add_bos=*/false);
    for (std::size_t i = 0; static_cast<int>(ids.size()) < tokens; ++i)
      ids.push_back(body[i % body.size()]);
  }
  if (tokens > 0) ids.resize(static_cast<std::size_t>(tokens));
  return {ids.begin(), ids.end()};
}

}  // namespace lynx_examples::disagg
