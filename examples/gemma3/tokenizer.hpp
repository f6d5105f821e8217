// Gemma 3's tokenizer, read from a GGUF file's metadata: SentencePiece-style BPE
// with scores and byte fallback (tokenizer.ggml.model "llama"). Text to token ids
// and back, giving the ids llama.cpp gives for the same file (plain text, special
// tokens not parsed); tests/examples/test_gemma3_tokenizer.cpp holds its golden ids.
//
// How a text is encoded, in order:
//  1. User-defined tokens (type 4: runs of newlines, of spaces, of tabs, HTML-ish
//     tags) are cut out of the raw text as whole tokens, leftmost and longest
//     first. (llama.cpp cuts the longest piece everywhere first, then the next;
//     for pieces that cannot overlap one another, as Gemma 3's, that is the same.)
//     Control tokens ("<start_of_turn>", "<bos>") are not cut: a plain text that
//     spells one is tokenized as text. Tokens that end generation count as control
//     here even where the file calls them user-defined ("</s>"), as in llama.cpp.
//  2. Each stretch of text between them has its spaces replaced by U+2581 '▁'
//     (no space is prefixed unless tokenizer.ggml.add_space_prefix says so) and is
//     split into UTF-8 characters.
//  3. Adjacent pieces whose concatenation is in the vocabulary merge, the highest
//     scoring concatenation first, the leftmost on ties, until none is left.
//  4. A character that is not in the vocabulary becomes its UTF-8 bytes as
//     "<0xXX>" tokens (or the unknown token where a byte token is missing).
#pragma once

#include <gguf/reader.hpp>

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace lynx_examples::gemma3 {

// tokenizer.ggml.token_type values (SentencePiece's piece types, 1-based).
enum class token_type : std::int32_t {
  normal = 1,
  unknown = 2,
  control = 3,
  user_defined = 4,
  unused = 5,
  byte = 6,  // "<0xXX>": one raw byte
};

// Token ids with a role; -1 where the vocabulary has none.
struct special_tokens {
  std::int32_t bos = -1;
  std::int32_t eos = -1;
  std::int32_t unk = -1;
  std::int32_t eot = -1;  // end of turn, where the file names one
  bool add_space_prefix = false;
};

class tokenizer {
 public:
  // Reads tokenizer.ggml.{model,tokens,scores,token_type,bos_token_id,
  // eos_token_id,unknown_token_id,eot_token_id,add_space_prefix}. Throws
  // gguf::format_error for missing required keys (from the reader) and
  // std::runtime_error for a vocabulary this tokenizer cannot use.
  explicit tokenizer(const lynx_examples::gguf::file& f)
      : tokenizer(model_checked(f).get_string_array("tokenizer.ggml.tokens"),
                  f.get_float_array("tokenizer.ggml.scores"),
                  f.get_int_array("tokenizer.ggml.token_type"), specials_of(f)) {}

  // From plain data (tests build tiny vocabularies this way): pieces[i] is the
  // text of token i as stored (spaces as '▁', bytes as "<0xXX>"), scores[i] its
  // merge score, types[i] a token_type value. Copies everything.
  tokenizer(std::span<const std::string_view> pieces, std::span<const float> scores,
            std::span<const std::int32_t> types, special_tokens special)
      : special_(special) {
    const std::size_t n = pieces.size();
    if (n == 0) fail("the vocabulary is empty");
    if (n > static_cast<std::size_t>(std::numeric_limits<std::int32_t>::max()))
      fail("the vocabulary has " + std::to_string(n) + " tokens, more than int32 ids can name");
    if (scores.size() != n || types.size() != n)
      fail("the vocabulary has " + std::to_string(n) + " tokens but " +
           std::to_string(scores.size()) + " scores and " + std::to_string(types.size()) +
           " token types");

    // All pieces in one buffer: no allocation per token, and the lookup table
    // holds ids only, so copies and moves of the tokenizer stay valid.
    std::size_t total = 0;
    for (const std::string_view p : pieces) total += p.size();
    text_.reserve(total);
    offsets_.reserve(n + 1);
    offsets_.push_back(0);
    for (const std::string_view p : pieces) {
      text_.append(p);
      offsets_.push_back(text_.size());
    }
    scores_.assign(scores.begin(), scores.end());
    types_.resize(n);
    byte_token_.fill(-1);
    for (std::size_t i = 0; i < n; ++i) {
      const std::int32_t t = types[i];
      if (t < 1 || t > 6)
        fail("token " + std::to_string(i) + " has type " + std::to_string(t) +
             ", not one of 1 (normal) to 6 (byte)");
      types_[i] = static_cast<token_type>(t);
      if (types_[i] == token_type::byte) {
        const int b = parse_byte_piece(pieces[i]);
        if (b < 0)
          fail("byte token " + std::to_string(i) + " is '" + std::string(pieces[i]) +
               "', not of the form <0xXX>");
        byte_token_[static_cast<std::size_t>(b)] = static_cast<std::int32_t>(i);
      }
    }
    for (const auto& [name, id] : {std::pair{"bos", special_.bos}, std::pair{"eos", special_.eos},
                                   std::pair{"unk", special_.unk}, std::pair{"eot", special_.eot}})
      if (id < -1 || id >= static_cast<std::int64_t>(n))
        fail(std::string(name) + " token id " + std::to_string(id) + " is outside the " +
             std::to_string(n) + "-token vocabulary");

    // End of generation: eos, eot, and the pieces Gemma ends a turn or a text
    // with. llama.cpp treats these as control tokens even where the file says
    // user-defined ("</s>" is type 4 in Gemma 3's file): they are not cut out of
    // plain text and decode to nothing. We follow it so the ids agree.
    for (const std::int32_t id : {special_.eos, special_.eot})
      if (id >= 0) end_of_generation_.push_back(id);
    build_lookup();
    for (const std::string_view name :
         {std::string_view("<end_of_turn>"), std::string_view("</s>")})
      if (const auto id = find(name)) end_of_generation_.push_back(*id);
    std::sort(end_of_generation_.begin(), end_of_generation_.end());
    end_of_generation_.erase(std::unique(end_of_generation_.begin(), end_of_generation_.end()),
                             end_of_generation_.end());
    for (const std::int32_t id : end_of_generation_)
      types_[static_cast<std::size_t>(id)] = token_type::control;

    // User-defined tokens by first byte, longest first, for the cut in encode().
    for (std::size_t i = 0; i < n; ++i) {
      const std::string_view p = raw_piece(static_cast<std::int32_t>(i));
      if (types_[i] == token_type::user_defined && !p.empty())
        user_defined_[static_cast<unsigned char>(p.front())].push_back(
            static_cast<std::int32_t>(i));
    }
    for (auto& ids : user_defined_)
      std::stable_sort(ids.begin(), ids.end(), [&](std::int32_t a, std::int32_t b) {
        return raw_piece(a).size() > raw_piece(b).size();
      });
  }

  // Token ids of `text`, after BOS when add_bos. Throws std::runtime_error when
  // add_bos is asked of a vocabulary without BOS, or when a byte has neither a
  // byte token nor an unknown token to fall back to.
  [[nodiscard]] std::vector<std::int32_t> encode(std::string_view text, bool add_bos = true) const {
    std::vector<std::int32_t> out;
    out.reserve(text.size() / 3 + 2);
    if (add_bos) {
      if (special_.bos < 0) fail("encode with add_bos, but the vocabulary has no BOS token");
      out.push_back(special_.bos);
    }
    merge_workspace ws;
    bool after_special =
        true;                 // add_space_prefix puts a space at the start and after each cut token
    std::size_t stretch = 0;  // start of the text not yet encoded
    for (std::size_t at = 0; at < text.size();) {
      const auto& candidates = user_defined_[static_cast<unsigned char>(text[at])];
      std::int32_t cut = -1;
      for (const std::int32_t id : candidates)
        if (text.substr(at).starts_with(raw_piece(id))) {
          cut = id;
          break;
        }
      if (cut < 0) {
        ++at;
        continue;
      }
      if (at > stretch) {
        encode_stretch(text.substr(stretch, at - stretch), after_special, ws, out);
        after_special = false;
      }
      out.push_back(cut);
      after_special = true;
      at += raw_piece(cut).size();
      stretch = at;
    }
    if (stretch < text.size()) encode_stretch(text.substr(stretch), after_special, ws, out);
    return out;
  }

  // The text of one token: '▁' as ' ', "<0xXX>" as that byte, user-defined
  // tokens as stored, control, unknown and unused tokens as "".
  [[nodiscard]] std::string piece(std::int32_t token) const {
    std::string s;
    append_piece(token, s);
    return s;
  }

  // The pieces of `tokens`, concatenated. Throws std::out_of_range naming the
  // first id outside the vocabulary.
  [[nodiscard]] std::string decode(std::span<const std::int32_t> tokens) const {
    std::string s;
    s.reserve(tokens.size() * 4);
    for (const std::int32_t t : tokens) append_piece(t, s);
    return s;
  }

  [[nodiscard]] std::int32_t bos() const { return special_.bos; }
  [[nodiscard]] std::int32_t eos() const { return special_.eos; }
  [[nodiscard]] std::int32_t unk() const { return special_.unk; }
  [[nodiscard]] std::int64_t vocab_size() const { return static_cast<std::int64_t>(types_.size()); }

  // eos, eot and "<end_of_turn>" / "</s>" where present (1, 106, 212 for Gemma 3).
  [[nodiscard]] bool ends_generation(std::int32_t token) const {
    return std::binary_search(end_of_generation_.begin(), end_of_generation_.end(), token);
  }
  [[nodiscard]] std::span<const std::int32_t> end_of_generation_tokens() const {
    return end_of_generation_;
  }

  // The id of an exact stored piece ("<start_of_turn>", "▁the"), any type.
  [[nodiscard]] std::optional<std::int32_t> find(std::string_view stored_piece) const {
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t s = std::hash<std::string_view>{}(stored_piece)&mask;; s = (s + 1) & mask) {
      const std::int32_t id = slots_[s];
      if (id < 0) return std::nullopt;
      if (raw_piece(id) == stored_piece) return id;
    }
  }

  // The piece as stored in the file ("▁the", "<0x0A>"), the score and the type
  // (after end-of-generation tokens became control). Throw std::out_of_range.
  [[nodiscard]] std::string_view stored_piece(std::int32_t token) const {
    check_id(token);
    return raw_piece(token);
  }
  [[nodiscard]] float score(std::int32_t token) const {
    check_id(token);
    return scores_[static_cast<std::size_t>(token)];
  }
  [[nodiscard]] token_type type(std::int32_t token) const {
    check_id(token);
    return types_[static_cast<std::size_t>(token)];
  }

 private:
  // One piece of a stretch during merging: bytes [begin, begin + size) of the
  // escaped text, in a doubly linked list by index (-1 ends it). size 0: merged away.
  struct symbol {
    std::uint32_t begin;
    std::uint32_t size;
    std::int32_t prev;
    std::int32_t next;
  };
  // A candidate merge of symbols left and right (adjacent when queued) into a
  // vocabulary piece of `size` bytes with `score`.
  struct bigram {
    float score;
    std::int32_t left;
    std::int32_t right;
    std::uint32_t size;
  };
  // Heap order: the highest score on top, then the leftmost.
  struct bigram_below {
    bool operator()(const bigram& a, const bigram& b) const {
      return a.score < b.score || (a.score == b.score && a.left > b.left);
    }
  };
  // Buffers reused by the stretches of one encode() call.
  struct merge_workspace {
    std::string text;
    std::vector<symbol> symbols;
    std::vector<bigram> queue;
  };

  [[noreturn]] static void fail(const std::string& what) {
    throw std::runtime_error("gemma3 tokenizer: " + what);
  }

  static const lynx_examples::gguf::file& model_checked(const lynx_examples::gguf::file& f) {
    const std::string_view model = f.get_string("tokenizer.ggml.model");
    if (model != "llama")
      fail("tokenizer.ggml.model is '" + std::string(model) +
           "'; only 'llama' (SentencePiece-style BPE with scores) is supported");
    return f;
  }

  static special_tokens specials_of(const lynx_examples::gguf::file& f) {
    auto id = [&](std::string_view key) -> std::int32_t {
      const std::optional<std::uint64_t> v = f.find_uint(key);
      if (!v) return -1;
      if (*v > static_cast<std::uint64_t>(std::numeric_limits<std::int32_t>::max()))
        fail(std::string(key) + " is " + std::to_string(*v) + ", not a token id");
      return static_cast<std::int32_t>(*v);
    };
    special_tokens s;
    s.bos = id("tokenizer.ggml.bos_token_id");
    s.eos = id("tokenizer.ggml.eos_token_id");
    s.unk = id("tokenizer.ggml.unknown_token_id");
    s.eot = id("tokenizer.ggml.eot_token_id");
    s.add_space_prefix = f.find_bool("tokenizer.ggml.add_space_prefix").value_or(false);
    return s;
  }

  // "<0xXX>" -> XX, anything else -> -1.
  static int parse_byte_piece(std::string_view p) {
    if (p.size() != 6 || !p.starts_with("<0x") || p.back() != '>') return -1;
    auto hex = [](char c) {
      if (c >= '0' && c <= '9') return c - '0';
      if (c >= 'A' && c <= 'F') return c - 'A' + 10;
      if (c >= 'a' && c <= 'f') return c - 'a' + 10;
      return -1;
    };
    const int hi = hex(p[3]), lo = hex(p[4]);
    return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
  }

  // Open addressing, linear probing, load <= 1/2; a later duplicate piece
  // replaces an earlier one (llama.cpp's choice; Gemma 3 has no duplicates).
  void build_lookup() {
    std::size_t size = 1;
    while (size < 2 * types_.size()) size *= 2;
    slots_.assign(size, -1);
    const std::size_t mask = size - 1;
    for (std::int32_t id = 0; id < static_cast<std::int32_t>(types_.size()); ++id) {
      const std::string_view p = raw_piece(id);
      for (std::size_t s = std::hash<std::string_view>{}(p)&mask;; s = (s + 1) & mask) {
        if (slots_[s] < 0 || raw_piece(slots_[s]) == p) {
          slots_[s] = id;
          break;
        }
      }
    }
  }

  [[nodiscard]] std::string_view raw_piece(std::int32_t id) const {
    const auto i = static_cast<std::size_t>(id);
    return std::string_view(text_).substr(offsets_[i], offsets_[i + 1] - offsets_[i]);
  }

  void check_id(std::int32_t token) const {
    if (token < 0 || token >= static_cast<std::int32_t>(types_.size()))
      throw std::out_of_range("gemma3 tokenizer: token id " + std::to_string(token) +
                              " is outside the vocabulary of " + std::to_string(types_.size()) +
                              " tokens");
  }

  void append_piece(std::int32_t token, std::string& out) const {
    check_id(token);
    const std::string_view p = raw_piece(token);
    switch (types_[static_cast<std::size_t>(token)]) {
      case token_type::normal:
        for (std::size_t i = 0; i < p.size();) {
          if (p.substr(i).starts_with(space_mark)) {
            out.push_back(' ');
            i += space_mark.size();
          } else {
            out.push_back(p[i++]);
          }
        }
        return;
      case token_type::byte:
        out.push_back(static_cast<char>(parse_byte_piece(p)));
        return;
      case token_type::user_defined:
        out.append(p);
        return;
      case token_type::unknown:
      case token_type::control:
      case token_type::unused:
        return;
    }
  }

  // Bytes of the UTF-8 character led by `lead`; a stray continuation byte or
  // an invalid lead counts as one (llama.cpp's rule; it only matters for
  // invalid UTF-8, which then falls back to byte tokens).
  static std::size_t utf8_length(unsigned char lead) {
    if (lead < 0xC0) return 1;
    if (lead < 0xE0) return 2;
    if (lead < 0xF0) return 3;
    return 4;
  }

  void push_bigram(merge_workspace& ws, std::int32_t left, std::int32_t right) const {
    if (left < 0 || right < 0) return;
    const symbol& l = ws.symbols[static_cast<std::size_t>(left)];
    const symbol& r = ws.symbols[static_cast<std::size_t>(right)];
    const std::optional<std::int32_t> id =
        find(std::string_view(ws.text).substr(l.begin, l.size + r.size));
    if (!id) return;
    ws.queue.push_back({scores_[static_cast<std::size_t>(*id)], left, right, l.size + r.size});
    std::push_heap(ws.queue.begin(), ws.queue.end(), bigram_below{});
  }

  void emit_bytes(std::string_view bytes, std::vector<std::int32_t>& out) const {
    for (const char c : bytes) {
      const std::int32_t id = byte_token_[static_cast<unsigned char>(c)];
      if (id >= 0) {
        out.push_back(id);
      } else if (special_.unk >= 0) {
        out.push_back(special_.unk);
      } else {
        fail("byte " + std::to_string(static_cast<unsigned char>(c)) +
             " has no <0xXX> token and the vocabulary has no unknown token");
      }
    }
  }

  // Steps 2-4 of the header comment for one stretch of text between cut tokens.
  // O(n log n) in the stretch's characters: each merge pushes at most two
  // candidates; stale candidates are recognised by their size and skipped.
  void encode_stretch(std::string_view raw, bool after_special, merge_workspace& ws,
                      std::vector<std::int32_t>& out) const {
    ws.text.clear();
    if (special_.add_space_prefix && after_special) ws.text.append(space_mark);
    for (const char c : raw) {
      if (c == ' ') {
        ws.text.append(space_mark);
      } else {
        ws.text.push_back(c);
      }
    }
    if (ws.text.size() > std::numeric_limits<std::uint32_t>::max() / 2)
      fail("a stretch of " + std::to_string(ws.text.size()) + " bytes is too long to encode");

    ws.symbols.clear();
    for (std::size_t at = 0; at < ws.text.size();) {
      const std::size_t len =
          std::min(utf8_length(static_cast<unsigned char>(ws.text[at])), ws.text.size() - at);
      const auto index = static_cast<std::int32_t>(ws.symbols.size());
      ws.symbols.push_back({static_cast<std::uint32_t>(at), static_cast<std::uint32_t>(len),
                            index - 1, at + len < ws.text.size() ? index + 1 : -1});
      at += len;
    }

    ws.queue.clear();
    for (std::int32_t i = 1; i < static_cast<std::int32_t>(ws.symbols.size()); ++i)
      push_bigram(ws, i - 1, i);
    while (!ws.queue.empty()) {
      std::pop_heap(ws.queue.begin(), ws.queue.end(), bigram_below{});
      const bigram b = ws.queue.back();
      ws.queue.pop_back();
      symbol& l = ws.symbols[static_cast<std::size_t>(b.left)];
      symbol& r = ws.symbols[static_cast<std::size_t>(b.right)];
      // Symbols only grow or vanish, so an unchanged total size means both are
      // still the adjacent pair this candidate was made from.
      if (l.size == 0 || r.size == 0 || l.size + r.size != b.size) continue;
      l.size += r.size;
      r.size = 0;
      l.next = r.next;
      if (r.next >= 0) ws.symbols[static_cast<std::size_t>(r.next)].prev = b.left;
      push_bigram(ws, l.prev, b.left);
      push_bigram(ws, b.left, l.next);
    }

    // Every merged symbol is a vocabulary piece; a single character may not be.
    for (std::int32_t i = ws.symbols.empty() ? -1 : 0; i >= 0;
         i = ws.symbols[static_cast<std::size_t>(i)].next) {
      const symbol& s = ws.symbols[static_cast<std::size_t>(i)];
      const std::string_view t = std::string_view(ws.text).substr(s.begin, s.size);
      if (const std::optional<std::int32_t> id = find(t)) {
        out.push_back(*id);
      } else {
        emit_bytes(t, out);
      }
    }
  }

  static constexpr std::string_view space_mark = "\xE2\x96\x81";  // U+2581 '▁'

  special_tokens special_;
  std::string text_;                  // every piece as stored, back to back
  std::vector<std::size_t> offsets_;  // [vocab + 1]: piece i is text_[offsets_[i], offsets_[i+1])
  std::vector<float> scores_;         // [vocab]
  std::vector<token_type> types_;     // [vocab]
  std::vector<std::int32_t> slots_;   // piece -> id hash table, -1 = empty
  std::array<std::int32_t, 256> byte_token_{};                 // byte -> "<0xXX>" id or -1
  std::array<std::vector<std::int32_t>, 256> user_defined_{};  // first byte -> ids, longest first
  std::vector<std::int32_t> end_of_generation_;                // sorted
};

}  // namespace lynx_examples::gemma3
