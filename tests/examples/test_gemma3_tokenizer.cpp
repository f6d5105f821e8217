// Tests of the Gemma 3 tokenizer (examples/gemma3/tokenizer.hpp).
//
// First, on tiny vocabularies built in memory (no model file): merge order,
// user-defined cuts, byte fallback, decoding, errors, and the heap-based merge
// against a plain quadratic one on random strings. Then, on the real GGUF: golden
// ids from llama.cpp, round trips, and load and encode times. When the GGUF is
// missing, the model cases print SKIPPED and exit with 77 (ctest: skipped), after
// the tiny-vocabulary cases have run; doctest runs cases in file order, so the
// model cases are registered last.
#include <doctest/doctest.h>

#include "gemma3/model_path.hpp"
#include "gemma3/tokenizer.hpp"
#include "gguf/reader.hpp"

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <vector>

namespace g3 = lynx_examples::gemma3;
namespace gguf = lynx_examples::gguf;

using ids = std::vector<std::int32_t>;

// Mismatched ids print as [2, 9259, 1902] instead of {?}.
template <>
struct doctest::StringMaker<ids> {
  static doctest::String convert(const ids& v) {
    std::string s = "[";
    for (std::size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
    return (s + "]").c_str();
  }
};

namespace {

// ---------------------------------------------------------------------------
// Tiny vocabularies
// ---------------------------------------------------------------------------

struct entry {
  std::string_view piece;
  float score;
  g3::token_type type;
};

g3::tokenizer make_tokenizer(const std::vector<entry>& vocab, g3::special_tokens special) {
  std::vector<std::string_view> pieces;
  std::vector<float> scores;
  std::vector<std::int32_t> types;
  for (const entry& e : vocab) {
    pieces.push_back(e.piece);
    scores.push_back(e.score);
    types.push_back(static_cast<std::int32_t>(e.type));
  }
  return g3::tokenizer(pieces, scores, types, special);
}

constexpr auto normal = g3::token_type::normal;
constexpr auto control = g3::token_type::control;
constexpr auto user_defined = g3::token_type::user_defined;
constexpr auto byte = g3::token_type::byte;
constexpr auto unknown = g3::token_type::unknown;

// Ids of the tiny vocabulary below, by name.
enum : std::int32_t {
  pad = 0,
  eos,
  bos,
  unk,
  eot,
  nl,
  nl2,
  sp2,
  end_s,  // user-defined "\n", "\n\n", "  ", "</s>" (the last becomes control)
  x_c3,
  x_a9,  // byte tokens <0xC3>, <0xA9> (é = C3 A9); no other byte has one
  a,
  b,
  c,
  mark,  // "a", "b", "c", "▁"
  ab,
  bc,
  aa,
  ba,
  mark_a,
  mark_ab,
  mark_b,
  lt,
  gt,
  slash,
  s,  // "<", ">", "/", "s": the characters of control pieces
  tiny_size
};

// Scores: higher merges first. "bc" beats "ab"; "ab" and "ba" tie.
std::vector<entry> tiny_vocab() {
  return {
      {"<pad>", 0, control},
      {"<eos>", 0, control},
      {"<bos>", 0, control},
      {"<unk>", 0, unknown},
      {"<end_of_turn>", 0, control},
      {"\n", 0, user_defined},
      {"\n\n", 0, user_defined},
      {"  ", 0, user_defined},
      {"</s>", 0, user_defined},
      {"<0xC3>", 0, byte},
      {"<0xA9>", 0, byte},
      {"a", -100, normal},
      {"b", -101, normal},
      {"c", -102, normal},
      {"\xE2\x96\x81", -103, normal},
      {"ab", -5, normal},
      {"bc", -3, normal},
      {"aa", -4, normal},
      {"ba", -5, normal},
      {"\xE2\x96\x81"
       "a",
       -6, normal},
      {"\xE2\x96\x81"
       "ab",
       -7, normal},
      {"\xE2\x96\x81"
       "b",
       -8, normal},
      {"<", -110, normal},
      {">", -111, normal},
      {"/", -112, normal},
      {"s", -113, normal},
  };
}

g3::special_tokens tiny_specials() {
  g3::special_tokens s;
  s.bos = bos;
  s.eos = eos;
  s.unk = unk;
  return s;
}

const g3::tokenizer& tiny() {
  static const g3::tokenizer t = make_tokenizer(tiny_vocab(), tiny_specials());
  return t;
}

// The specification of encode(), written the slow and obvious way: cut the
// user-defined pieces (leftmost, longest), escape spaces, split into UTF-8
// characters, then repeatedly merge the best adjacent pair found by scanning
// them all (highest score, leftmost on ties), then byte fallback.
ids quadratic_encode(const g3::tokenizer& t, std::string_view text,
                     const std::vector<entry>& vocab) {
  ids out;
  auto encode_stretch = [&](std::string_view raw) {
    std::string escaped;
    for (const char ch : raw)
      escaped += ch == ' ' ? std::string("\xE2\x96\x81") : std::string(1, ch);
    std::vector<std::string> parts;
    for (std::size_t i = 0; i < escaped.size();) {
      const auto lead = static_cast<unsigned char>(escaped[i]);
      const std::size_t n = lead < 0xC0 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
      parts.push_back(escaped.substr(i, n));
      i += n;
    }
    for (;;) {
      std::size_t best = parts.size();
      float best_score = 0;
      for (std::size_t i = 0; i + 1 < parts.size(); ++i) {
        const std::optional<std::int32_t> id = t.find(parts[i] + parts[i + 1]);
        if (id && (best == parts.size() || t.score(*id) > best_score)) {
          best = i;
          best_score = t.score(*id);
        }
      }
      if (best == parts.size()) break;
      parts[best] += parts[best + 1];
      parts.erase(parts.begin() + static_cast<std::ptrdiff_t>(best) + 1);
    }
    for (const std::string& p : parts) {
      if (const std::optional<std::int32_t> id = t.find(p)) {
        out.push_back(*id);
        continue;
      }
      for (const char ch : p) {
        char name[8];
        std::snprintf(name, sizeof name, "<0x%02X>", static_cast<unsigned char>(ch));
        out.push_back(t.find(name).value_or(t.unk()));
      }
    }
  };
  std::size_t stretch = 0;
  for (std::size_t at = 0; at < text.size();) {
    std::size_t best_len = 0;
    std::int32_t best_id = -1;
    for (std::size_t id = 0; id < vocab.size(); ++id) {
      const std::string_view p = vocab[id].piece;
      if (t.type(static_cast<std::int32_t>(id)) == user_defined && p.size() > best_len &&
          text.substr(at).starts_with(p)) {
        best_len = p.size();
        best_id = static_cast<std::int32_t>(id);
      }
    }
    if (best_id < 0) {
      ++at;
      continue;
    }
    encode_stretch(text.substr(stretch, at - stretch));
    out.push_back(best_id);
    at += best_len;
    stretch = at;
  }
  encode_stretch(text.substr(stretch));
  return out;
}

}  // namespace

TEST_CASE("tiny vocabulary: the highest-scoring merge goes first") {
  // "ab" (-5) and "bc" (-3) compete for the b of "abc": bc wins, and "abc" is
  // not a piece, so a stays alone.
  CHECK(tiny().encode("abc", false) == ids{a, bc});
  // With the scores swapped, ab wins.
  std::vector<entry> v = tiny_vocab();
  v[ab].score = -3;
  v[bc].score = -5;
  CHECK(make_tokenizer(v, tiny_specials()).encode("abc", false) == ids{ab, c});
  // A pair whose concatenation is not a piece never merges ("ca", "cb").
  CHECK(tiny().encode("cab", false) == ids{c, ab});
  CHECK(tiny().encode("cbc", false) == ids{c, bc});
}

TEST_CASE("tiny vocabulary: ties go to the leftmost pair") {
  CHECK(tiny().encode("aaa", false) == ids{aa, a});
  CHECK(tiny().encode("aaaa", false) == ids{aa, aa});
  CHECK(tiny().encode("aba", false) == ids{ab, a});  // "ab" and "ba" both score -5
  CHECK(tiny().encode("bab", false) == ids{ba, b});
}

TEST_CASE("tiny vocabulary: spaces become '▁' and merge through longer pieces") {
  // "▁a" (-6) first, then "▁a" + "b" is "▁ab"; no space is prefixed.
  CHECK(tiny().encode(" ab", false) == ids{mark_ab});
  CHECK(tiny().encode("ab", false) == ids{ab});
  CHECK(tiny().encode("a b", false) == ids{a, mark_b});
  CHECK(tiny().encode(" ", false) == ids{mark});
  CHECK(tiny().encode("", false).empty());
  CHECK(tiny().encode("") == ids{bos});
  CHECK(tiny().encode("ab") == ids{bos, ab});
}

TEST_CASE("tiny vocabulary: user-defined pieces are cut whole, leftmost and longest first") {
  CHECK(tiny().encode("a\nb", false) == ids{a, nl, b});
  CHECK(tiny().encode("a\n\n\nb", false) == ids{a, nl2, nl, b});
  CHECK(tiny().encode("\n\n\n\n", false) == ids{nl2, nl2});
  // Two raw spaces are one user-defined piece; the third is a '▁' of the text after it.
  CHECK(tiny().encode("a   b", false) == ids{a, sp2, mark_b});
  // Stretches on either side of a cut never merge across it.
  CHECK(tiny().encode("a\na", false) == ids{a, nl, a});
}

TEST_CASE("tiny vocabulary: control pieces and end-of-generation pieces are text") {
  // "<eos>" is a control piece: spelled in a text, it is characters.
  const ids eos_text = tiny().encode("<eos>", false);
  CHECK(eos_text.size() == 5);
  CHECK(eos_text.front() == lt);
  // "</s>" is user-defined in the vocabulary but ends generation, so it is
  // treated as control (as llama.cpp does): not cut, and decoded as "".
  CHECK(tiny().type(end_s) == control);
  CHECK(tiny().encode("</s>", false) == ids{lt, slash, s, gt});
  CHECK(tiny().piece(end_s).empty());
  CHECK(tiny().ends_generation(eos));
  CHECK(tiny().ends_generation(end_s));
  CHECK(tiny().ends_generation(eot));  // "<end_of_turn>" by its text
  CHECK_FALSE(tiny().ends_generation(bos));
  CHECK_FALSE(tiny().ends_generation(nl));
  CHECK_FALSE(tiny().ends_generation(-1));
  CHECK_FALSE(tiny().ends_generation(tiny_size));
}

TEST_CASE("tiny vocabulary: characters outside the vocabulary fall back to bytes") {
  CHECK(tiny().encode("\xC3\xA9", false) == ids{x_c3, x_a9});  // é: both bytes have tokens
  // ü is C3 BC; <0xBC> is missing, so that byte becomes the unknown token.
  CHECK(tiny().encode("a\xC3\xBC", false) == ids{a, x_c3, unk});
  CHECK(tiny().encode("d", false) == ids{unk});
  // Without an unknown token a byte with no token cannot be encoded.
  g3::special_tokens no_unk = tiny_specials();
  no_unk.unk = -1;
  const g3::tokenizer t = make_tokenizer(tiny_vocab(), no_unk);
  CHECK(t.encode("\xC3\xA9", false) == ids{x_c3, x_a9});
  CHECK_THROWS_AS((void)t.encode("d", false), std::runtime_error);
}

TEST_CASE("tiny vocabulary: pieces and decode") {
  const g3::tokenizer& t = tiny();
  CHECK(t.piece(mark_ab) == " ab");
  CHECK(t.piece(mark) == " ");
  CHECK(t.piece(x_c3) == "\xC3");
  CHECK(t.piece(nl2) == "\n\n");
  CHECK(t.piece(sp2) == "  ");
  CHECK(t.piece(bos).empty());
  CHECK(t.piece(unk).empty());
  CHECK(t.stored_piece(mark_ab) ==
        "\xE2\x96\x81"
        "ab");
  CHECK(t.decode(ids{bos, a, mark_b, nl, x_c3, x_a9, eos}) == "a b\n\xC3\xA9");
  CHECK(t.decode(ids{}).empty());
  CHECK(t.vocab_size() == tiny_size);
  CHECK(t.bos() == bos);
  CHECK(t.eos() == eos);
  CHECK(t.find("\xE2\x96\x81"
               "ab") == mark_ab);
  CHECK_FALSE(t.find("abc").has_value());
}

TEST_CASE("tiny vocabulary: invalid ids name the id and the vocabulary size") {
  const g3::tokenizer& t = tiny();
  const ids bad{a, 99, b};
  CHECK_THROWS_AS((void)t.decode(bad), std::out_of_range);
  CHECK_THROWS_WITH((void)t.decode(bad),
                    doctest::Contains("token id 99 is outside the vocabulary of 26 tokens"));
  CHECK_THROWS_WITH((void)t.piece(-1), doctest::Contains("token id -1"));
  CHECK_THROWS_AS((void)t.piece(tiny_size), std::out_of_range);
  CHECK_THROWS_AS((void)t.score(tiny_size), std::out_of_range);
}

TEST_CASE("tiny vocabulary: a vocabulary it cannot use is refused, saying why") {
  const std::vector<std::string_view> pieces{"a", "b", "<0x41>"};
  const std::vector<float> scores{0, 0, 0};
  const std::vector<std::int32_t> types{1, 1, 6};
  g3::special_tokens none;
  CHECK_NOTHROW((void)g3::tokenizer(pieces, scores, types, none));
  CHECK_THROWS_WITH((void)g3::tokenizer(pieces, std::vector<float>{0, 0}, types, none),
                    doctest::Contains("3 tokens but 2 scores and 3 token types"));
  CHECK_THROWS_WITH((void)g3::tokenizer(pieces, scores, std::vector<std::int32_t>{1, 7, 6}, none),
                    doctest::Contains("token 1 has type 7"));
  CHECK_THROWS_WITH((void)g3::tokenizer(pieces, scores, std::vector<std::int32_t>{6, 1, 6}, none),
                    doctest::Contains("byte token 0 is 'a'"));
  CHECK_THROWS_WITH((void)g3::tokenizer(std::vector<std::string_view>{}, std::vector<float>{},
                                        std::vector<std::int32_t>{}, none),
                    doctest::Contains("empty"));
  g3::special_tokens far;
  far.bos = 3;
  CHECK_THROWS_WITH((void)g3::tokenizer(pieces, scores, types, far),
                    doctest::Contains("bos token id 3 is outside the 3-token vocabulary"));
  // No BOS: encode without it works, with it is refused.
  const g3::tokenizer t(pieces, scores, types, none);
  CHECK(t.encode("ab", false) == ids{0, 1});
  CHECK(t.encode("A", false) == ids{0 + 2});  // 'A' is not a piece: byte token <0x41>
  CHECK_THROWS_WITH((void)t.encode("ab"), doctest::Contains("no BOS"));
}

TEST_CASE("tiny vocabulary: add_space_prefix puts a '▁' before each stretch of text") {
  g3::special_tokens s = tiny_specials();
  s.add_space_prefix = true;
  const g3::tokenizer t = make_tokenizer(tiny_vocab(), s);
  CHECK(t.encode("ab", false) == ids{mark_ab});
  CHECK(t.encode("ab\nab", false) == ids{mark_ab, nl, mark_ab});
  CHECK(t.encode("\n", false) == ids{nl});
}

TEST_CASE("tiny vocabulary: copies and moves keep working") {
  std::optional<g3::tokenizer> original(make_tokenizer(tiny_vocab(), tiny_specials()));
  const g3::tokenizer copy = *original;
  g3::tokenizer moved = std::move(*original);
  original.reset();
  CHECK(copy.encode(" ab\nabc") == ids{bos, mark_ab, nl, a, bc});
  CHECK(moved.encode(" ab\nabc") == ids{bos, mark_ab, nl, a, bc});
}

TEST_CASE(
    "tiny vocabulary: the heap merge equals the quadratic specification; decode inverts encode") {
  const std::vector<std::string_view> alphabet{"a",        "b",        "c", " ", "\n",
                                               "\xC3\xA9", "\xC3\xBC", "<", "s"};
  std::mt19937 rng(20260101);
  for (int round = 0; round < 2000; ++round) {
    std::string text;
    const int n = static_cast<int>(rng() % 24);
    for (int i = 0; i < n; ++i) text += alphabet[rng() % alphabet.size()];
    CAPTURE(text);
    const ids got = tiny().encode(text, false);
    REQUIRE(got == quadratic_encode(tiny(), text, tiny_vocab()));
    // ü has no second byte token (unknown), so it does not come back.
    if (text.find("\xC3\xBC") == std::string::npos) REQUIRE(tiny().decode(got) == text);
  }
}

// ---------------------------------------------------------------------------
// The real model
// ---------------------------------------------------------------------------

namespace {

// Counts failed test cases, so that a missing model turns into a skip only when
// everything that did run passed.
struct failure_counter : doctest::IReporter {
  static inline int failed = 0;
  explicit failure_counter(const doctest::ContextOptions&) {}
  void report_query(const doctest::QueryData&) override {}
  void test_run_start() override {}
  void test_run_end(const doctest::TestRunStats&) override {}
  void test_case_start(const doctest::TestCaseData&) override {}
  void test_case_reenter(const doctest::TestCaseData&) override {}
  void test_case_end(const doctest::CurrentTestCaseStats& stats) override {
    if (!stats.testCaseSuccess) ++failed;
  }
  void test_case_exception(const doctest::TestCaseException&) override {}
  void subcase_start(const doctest::SubcaseSignature&) override {}
  void subcase_end() override {}
  void log_assert(const doctest::AssertData&) override {}
  void log_message(const doctest::MessageData&) override {}
  void test_case_skipped(const doctest::TestCaseData&) override {}
};
REGISTER_LISTENER("gemma3_tokenizer_failures", 1, failure_counter);

struct loaded {
  gguf::file file;
  g3::tokenizer tokenizer;
  double load_ms;
};

const loaded& model() {
  static const std::unique_ptr<loaded> m = []() -> std::unique_ptr<loaded> {
    const std::optional<std::filesystem::path> p = g3::find_model();
    if (!p) {
      std::printf("SKIPPED: Gemma-3 GGUF not found at %s (cmake/fetch_gemma3.sh fetches it)\n",
                  g3::default_model_path().string().c_str());
      if (failure_counter::failed > 0) {
        std::printf("... but %d tiny-vocabulary test case(s) failed before that\n",
                    failure_counter::failed);
        std::fflush(stdout);
        std::exit(EXIT_FAILURE);
      }
      std::fflush(stdout);
      std::exit(77);
    }
    const auto start = std::chrono::steady_clock::now();
    gguf::file f(*p);
    g3::tokenizer t(f);
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
    return std::make_unique<loaded>(loaded{std::move(f), std::move(t), ms});
  }();
  return *m;
}

const g3::tokenizer& gemma() { return model().tokenizer; }

struct golden_case {
  const char* name;
  std::string_view text;
  ids expected;  // with BOS
  // decode(expected) when it is not `text`.
  std::optional<std::string_view> decoded = std::nullopt;
};

// Expected ids from llama.cpp's llama-tokenize at ggml-org/llama.cpp commit
// 0c1e57098 (the copy vendored by llama-cpp-python 0.3.36), built from source
// outside this repository and run on gemma-3-270m-q4_k_m.gguf as
//   llama-tokenize -m gemma-3-270m-q4_k_m.gguf -f <text file> --no-escape
//                  --no-parse-special --ids --log-disable
// i.e. the text's exact bytes, BOS added (the file's add_bos_token), special
// tokens not parsed: what an application's plain encode(text) does.
// (llama-tokenize parses special tokens by default; that mode differs only in
// "gemma chat markup" and "end tags as text", see the case after this table.)
// The same llama-tokenize agreed with this tokenizer on 300 random strings of
// vocabulary pieces, whitespace runs, tags, control pieces and random code points,
// and on 100 KB of this repository's Markdown and headers (33,123 tokens).
const std::vector<golden_case>& golden() {
  static const std::vector<golden_case> cases = {
      {"plain sentence", "Hello world", {2, 9259, 1902}},
      {"pangram",
       "The quick brown fox jumps over the lazy dog.",
       {2, 818, 3823, 8864, 37423, 38167, 1024, 506, 31770, 4799, 236761}},
      {"longer English",
       "Lynx streams the KV cache of a language model, the most significant bit plane first.",
       {2, 164966, 236781, 25568, 506, 132182, 15612, 529, 496, 5192, 2028, 236764, 506, 1346, 3629,
        3103, 8180, 1171, 236761}},
      {"leading space", " leading space", {2, 5830, 2557}},
      {"trailing space", "trailing space ", {2, 136697, 2557, 236743}},
      {"two leading spaces", "  two leading spaces", {2, 138, 13498, 5830, 9952}},
      {"2 spaces", "a  b", {2, 236746, 138, 236763}},
      {"3 spaces", "a   b", {2, 236746, 139, 236763}},
      {"4 spaces", "a    b", {2, 236746, 140, 236763}},
      {"5 spaces", "a     b", {2, 236746, 141, 236763}},
      {"40 spaces", "x                                        y", {2, 236781, 167, 145, 236762}},
      {"tabs", "tab\tseparated\t\tvalues", {2, 4823, 255968, 74010, 255969, 7558}},
      {"one newline", "line one\nline two", {2, 1257, 886, 107, 1257, 1156}},
      {"newline runs",
       "a\n\nb\n\n\nc\n\n\n\nd",
       {2, 236746, 108, 236763, 109, 236755, 110, 236753}},
      {"newline space combos",
       "x\n y\n  z \n\n w",
       {2, 236781, 107, 570, 107, 138, 236802, 236743, 108, 515}},
      {"newline then space", "\n ", {2, 107, 236743}},
      {"CRLF", "one\r\ntwo\r\n", {2, 811, 251, 107, 13498, 251, 107}},
      {"year", "2026", {2, 236778, 236771, 236778, 236825}},
      {"pi", "3.14159", {2, 236800, 236761, 236770, 236812, 236770, 236810, 236819}},
      {"space number", " 42", {2, 236743, 236812, 236778}},
      {"numbers in text",
       "In 2026, 1,234,567 people paid $89.99 (about 12%).",
       {2,      902,    236743, 236778, 236771, 236778, 236825, 236764, 236743, 236770, 236764,
        236778, 236800, 236812, 236764, 236810, 236825, 236832, 1331,   6382,   609,    236828,
        236819, 236761, 236819, 236819, 568,    9869,   236743, 236770, 236778, 37507}},
      {"punctuation",
       "Punctuation: (a), [b], {c}; \"quoted\" - 'single'... !? #@&*",
       {2,      236791, 23733,  3145,   236787, 568, 236746, 779,    870,
        236763, 1604,   642,    236755, 3796,   623, 148758, 236775, 753,
        756,    18999,  199036, 1717,   236881, 997, 236940, 202079}},
      {"code",
       "def f(x):\n    return x**2  # square\n",
       {2, 2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865, 6281,
        107}},
      {"accents",
       "café naïve résumé Ångström",
       {2, 123125, 236859, 120362, 118515, 44667, 829, 80406}},
      {"CJK", "日本語のテキストと中文。", {2, 94951, 236945, 95830, 237032, 55041, 236924}},
      {"emoji",
       "emoji 😀🚀 and 🦙!",  // 🦙 is not a piece: its 4 bytes are byte tokens
       {2, 67906, 163543, 242015, 532, 236743, 478, 397, 404, 391, 236888}},
      {"rare characters",
       "\x01\x7f \uE000 🧬\U000E0100",  // C0 controls, private use, a variation selector
       {2, 249732, 251541, 236743, 245863, 236743, 253633, 481, 398, 370, 366}},
      {"gemma chat markup",
       "<start_of_turn>user\nHi<end_of_turn>\n",
       {2, 236820, 3041, 236779, 1340, 236779, 887, 236813, 2364, 107, 10979, 236820, 643, 236779,
        1340, 236779, 887, 236813, 107}},
      {"HTML user-defined tags",
       "<b>bold</b> <table><tr><td>1</td></tr></table>",
       {2, 200, 15640, 209, 236743, 168, 173, 175, 236770, 183, 181, 176}},
      {"end tags as text",
       "a</s>b<eos>c",
       {2, 236746, 954, 236751, 236813, 236763, 236820, 211827, 236813, 236755}},
      {"empty", "", {2}},
      {"one space", " ", {2, 236743}},
      {"only newlines", "\n\n\n", {2, 109}},
      // Invalid UTF-8 is split by lead bytes before byte fallback, after spaces
      // became '▁' (E2 96 81): FF reads as the lead of 4 bytes and takes FE and
      // the first two bytes of the next '▁'; E2 takes 82 and the next '▁''s E2.
      // Those '▁' bytes come back as '▁', not as spaces: the one case here
      // where decode(encode(s)) != s. llama.cpp does the same.
      {"invalid UTF-8",
       "bad \xff\xfe utf8 \xe2\x82 end \xc3",
       {2, 15242, 236743, 493, 492, 464, 388, 367, 11365, 236828, 236743, 464, 368, 464, 388, 367,
        643, 236743, 433},
       "bad \xff\xfe\xe2\x96\x81utf8 \xe2\x82\xe2\x96\x81"
       "end \xc3"},
  };
  return cases;
}

}  // namespace

TEST_CASE("Gemma 3 GGUF: the vocabulary and its special tokens") {
  const g3::tokenizer& t = gemma();
  CHECK(t.vocab_size() == 262144);
  CHECK(t.bos() == 2);
  CHECK(t.eos() == 1);
  CHECK(t.unk() == 3);
  const std::span<const std::int32_t> eog = t.end_of_generation_tokens();
  CHECK(ids(eog.begin(), eog.end()) == ids{1, 106, 212});  // <eos>, <end_of_turn>, </s>
  CHECK_FALSE(t.ends_generation(2));
  CHECK_FALSE(t.ends_generation(107));
  CHECK(t.piece(107) == "\n");
  CHECK(t.piece(108) == "\n\n");
  CHECK(t.piece(140) == "    ");
  CHECK(t.piece(236743) == " ");
  CHECK(t.piece(255968) == "\t");
  CHECK(t.piece(238) == std::string(1, '\0'));  // <0x00>
  CHECK(t.piece(238 + 0x41) == "A");            // <0x41>
  CHECK(t.piece(2).empty());                    // control tokens decode to nothing
  CHECK(t.piece(106).empty());
  CHECK(t.piece(212).empty());  // "</s>": user-defined in the file, ends generation
  CHECK(t.find("<start_of_turn>") == 105);
  CHECK(t.find("<end_of_turn>") == 106);
  CHECK_THROWS_WITH(
      (void)t.piece(262144),
      doctest::Contains("token id 262144 is outside the vocabulary of 262144 tokens"));
}

TEST_CASE("Gemma 3 GGUF: golden ids from llama.cpp, and decode(encode(s)) == s") {
  const g3::tokenizer& t = gemma();
  for (const golden_case& g : golden()) {
    const std::string name = g.name;
    CAPTURE(name);
    CHECK(t.encode(g.text) == g.expected);
    CHECK(t.encode(g.text, false) == ids(g.expected.begin() + 1, g.expected.end()));
    // Pieces decode to their text and BOS to nothing, so valid UTF-8 comes back
    // exactly (byte tokens carry characters that are not pieces).
    CHECK(t.decode(t.encode(g.text)) == g.decoded.value_or(g.text));
  }
}

TEST_CASE("Gemma 3 GGUF: special tokens go in as ids, not as text") {
  // llama-tokenize with special parsing (its default) gives for the chat markup
  // case [2, 105, 2364, 107, 10979, 106, 107]. encode() never parses control
  // tokens; a chat prompt is built from their ids and encoded text:
  const g3::tokenizer& t = gemma();
  ids prompt{t.bos(), *t.find("<start_of_turn>")};
  for (const std::int32_t id : t.encode("user\nHi", false)) prompt.push_back(id);
  prompt.push_back(*t.find("<end_of_turn>"));
  for (const std::int32_t id : t.encode("\n", false)) prompt.push_back(id);
  CHECK(prompt == ids{2, 105, 2364, 107, 10979, 106, 107});
  // With special parsing llama-tokenize gives [2, 236746, 212, 236763, 1, 236755]
  // for "a</s>b<eos>c"; as plain text (golden table) neither is a token.
}

TEST_CASE("Gemma 3 GGUF: a 100 KB text round-trips (load and encode times printed, not judged)") {
  const loaded& m = model();
  // ~100 KB of mixed text: the valid golden strings over and over.
  std::string text;
  while (text.size() < 100 * 1024)
    for (const golden_case& g : golden()) {
      if (g.decoded) continue;  // the invalid UTF-8 would not come back
      text += g.text;
      text += ' ';
    }
  const auto start = std::chrono::steady_clock::now();
  const ids encoded = m.tokenizer.encode(text);
  const double encode_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count();
  MESSAGE("GGUF open + tokenizer load: " << m.load_ms << " ms; encode of " << text.size()
                                         << " bytes: " << encode_ms << " ms, " << encoded.size()
                                         << " tokens");
  CHECK(m.tokenizer.decode(encoded) == text);
}
