// The llama2.c tokenizer (sentencepiece BPE exported by llama2.c's tokenizer.py):
// encode text to token ids by greedy highest-score merges, decode ids to text.
// Used by tests and examples to show what the model says; the engine itself
// works on ids only.
//
// File format: int32 max_token_length, then per token: float32 score, int32
// length, `length` bytes (no terminator). The vocabulary size is not stored; it
// comes from the model's config.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace lynx_examples::llama2c {

class tokenizer {
 public:
  static constexpr int unk = 0;
  static constexpr int bos = 1;
  static constexpr int eos = 2;
  // Byte-fallback tokens <0x00>..<0xFF> are ids 3..258 in llama2.c vocabularies.
  static constexpr int first_byte_token = 3;

  // Loads `vocab_size` tokens; throws std::runtime_error naming the file if it
  // is missing, truncated or has trailing bytes.
  tokenizer(const std::filesystem::path& path, int vocab_size) {
    const std::string name = path.string();
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("llama2c: cannot open tokenizer '" + name + "'");
    if (vocab_size <= first_byte_token + 255)
      throw std::runtime_error("llama2c: tokenizer '" + name + "': vocab_size " +
                               std::to_string(vocab_size) + " cannot hold the 256 byte tokens");
    auto read_exact = [&](void* to, std::size_t bytes, int token) {
      in.read(static_cast<char*>(to), static_cast<std::streamsize>(bytes));
      if (!in)
        throw std::runtime_error("llama2c: tokenizer '" + name + "' is truncated at token " +
                                 std::to_string(token) + " of " + std::to_string(vocab_size));
    };
    // Lengths come from the file: each is checked against the bytes the file
    // still holds before anything is sized by it (a 12-byte file must not make
    // the loader allocate gigabytes before finding itself truncated).
    std::error_code size_error;
    const auto file_bytes = std::filesystem::file_size(path, size_error);
    if (size_error)
      throw std::runtime_error("llama2c: cannot size tokenizer '" + name +
                               "': " + size_error.message());
    std::uint64_t read_so_far = 0;
    std::int32_t max_len = 0;
    read_exact(&max_len, 4, 0);
    read_so_far += 4;
    max_token_length_ = max_len;
    pieces_.resize(static_cast<std::size_t>(vocab_size));
    scores_.resize(static_cast<std::size_t>(vocab_size));
    for (int i = 0; i < vocab_size; ++i) {
      std::int32_t len = 0;
      read_exact(&scores_[static_cast<std::size_t>(i)], 4, i);
      read_exact(&len, 4, i);
      read_so_far += 8;
      if (len < 0 || len > max_len)
        throw std::runtime_error("llama2c: tokenizer '" + name + "': token " + std::to_string(i) +
                                 " has length " + std::to_string(len) + ", max is " +
                                 std::to_string(max_len));
      if (static_cast<std::uint64_t>(len) > file_bytes - read_so_far)
        throw std::runtime_error("llama2c: tokenizer '" + name + "' is truncated at token " +
                                 std::to_string(i) + " of " + std::to_string(vocab_size) +
                                 " (it claims " + std::to_string(len) + " bytes, the file holds " +
                                 std::to_string(file_bytes - read_so_far) + " more)");
      read_so_far += static_cast<std::uint64_t>(len);
      pieces_[static_cast<std::size_t>(i)].resize(static_cast<std::size_t>(len));
      read_exact(pieces_[static_cast<std::size_t>(i)].data(), static_cast<std::size_t>(len), i);
    }
    if (in.peek() != std::char_traits<char>::eof())
      throw std::runtime_error("llama2c: tokenizer '" + name + "' has bytes after its " +
                               std::to_string(vocab_size) + " tokens (wrong vocab_size?)");
    // Lookup by text; on duplicate pieces the lowest id wins (emplace keeps the first).
    for (int i = 0; i < vocab_size; ++i) ids_.emplace(pieces_[static_cast<std::size_t>(i)], i);
    for (int b = 0; b < 256; ++b) byte_pieces_[static_cast<std::size_t>(b)] = static_cast<char>(b);
  }

  [[nodiscard]] int vocab_size() const { return static_cast<int>(pieces_.size()); }
  [[nodiscard]] int max_token_length() const { return max_token_length_; }
  [[nodiscard]] float score(int token) const { return scores_.at(static_cast<std::size_t>(token)); }
  // The raw vocabulary entry, e.g. "<0x0A>" or " the".
  [[nodiscard]] std::string_view vocab_piece(int token) const {
    return pieces_.at(static_cast<std::size_t>(token));
  }
  // Id of an exact piece, or -1.
  [[nodiscard]] int lookup(std::string_view piece) const {
    const auto it = ids_.find(std::string(piece));
    return it == ids_.end() ? -1 : it->second;
  }

  // llama2.c's encode: optional BOS, a dummy-prefix space when the text is not
  // empty, one token per UTF-8 code point (bytes + 3 when the code point is not
  // in the vocabulary), then repeatedly merge the adjacent pair whose
  // concatenation is the highest-scoring vocabulary entry (leftmost on ties).
  [[nodiscard]] std::vector<int> encode(std::string_view text, bool add_bos = true,
                                        bool add_eos = false) const {
    std::vector<int> tokens;
    tokens.reserve(text.size() + 3);
    if (add_bos) tokens.push_back(bos);
    if (!text.empty()) {
      const int space = lookup(" ");
      if (space < 0) throw std::runtime_error("llama2c: tokenizer has no ' ' token");
      tokens.push_back(space);
    }
    std::string code_point;
    for (std::size_t i = 0; i < text.size(); ++i) {
      const unsigned char c = static_cast<unsigned char>(text[i]);
      if ((c & 0xC0) != 0x80) code_point.clear();  // not a continuation byte: new code point
      code_point.push_back(static_cast<char>(c));
      const bool continues =
          i + 1 < text.size() && (static_cast<unsigned char>(text[i + 1]) & 0xC0) == 0x80;
      if (continues && code_point.size() < 4) continue;
      const int id = lookup(code_point);
      if (id >= 0) {
        tokens.push_back(id);
      } else {
        for (const char b : code_point)
          tokens.push_back(static_cast<unsigned char>(b) + first_byte_token);
      }
      code_point.clear();
    }
    std::string pair;
    for (;;) {
      float best_score = -1e10f;
      int best_id = -1;
      std::size_t best_at = 0;
      for (std::size_t i = 0; i + 1 < tokens.size(); ++i) {
        pair.assign(pieces_[static_cast<std::size_t>(tokens[i])]);
        pair.append(pieces_[static_cast<std::size_t>(tokens[i + 1])]);
        const int id = lookup(pair);
        if (id >= 0 && scores_[static_cast<std::size_t>(id)] > best_score) {
          best_score = scores_[static_cast<std::size_t>(id)];
          best_id = id;
          best_at = i;
        }
      }
      if (best_id < 0) break;
      tokens[best_at] = best_id;
      tokens.erase(tokens.begin() + static_cast<std::ptrdiff_t>(best_at) + 1);
    }
    if (add_eos) tokens.push_back(eos);
    return tokens;
  }

  // llama2.c's decode of one token after `prev`: the leading space of a piece
  // that follows BOS is dropped (sentencepiece's dummy prefix), and "<0xXX>"
  // byte tokens become that single byte. Special tokens keep their raw text.
  [[nodiscard]] std::string_view piece(int prev, int token) const {
    std::string_view p = vocab_piece(token);
    if (prev == bos && !p.empty() && p.front() == ' ') p.remove_prefix(1);
    if (p.size() == 6 && p.substr(0, 3) == "<0x" && p.back() == '>') {
      const int hi = hex_digit(p[3]), lo = hex_digit(p[4]);
      if (hi >= 0 && lo >= 0) return {&byte_pieces_[static_cast<std::size_t>(hi * 16 + lo)], 1};
    }
    return p;
  }

  // Text of a token sequence: pieces joined by `piece(prev, token)`. BOS and
  // EOS print as nothing at the start and as a newline elsewhere (a sampled
  // sequence that starts a new story), so the result is plain text.
  [[nodiscard]] std::string decode(std::span<const int> tokens) const {
    std::string text;
    int prev = -1;
    for (std::size_t i = 0; i < tokens.size(); ++i) {
      const int t = tokens[i];
      if (t == bos || t == eos) {
        if (i > 0) text.push_back('\n');
      } else {
        text.append(piece(prev, t));
      }
      prev = t;
    }
    return text;
  }

 private:
  static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  }

  std::vector<std::string> pieces_;  // [vocab] raw piece bytes
  std::vector<float> scores_;        // [vocab] merge priority, higher merges first
  std::unordered_map<std::string, int> ids_;
  std::array<char, 256> byte_pieces_{};
  int max_token_length_ = 0;
};

}  // namespace lynx_examples::llama2c
