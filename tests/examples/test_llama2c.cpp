// Tests of the llama2.c example engine: loading (real checkpoint and errors),
// tokenizer round trips, bitwise batch invariance of decode, rollback, greedy
// determinism, and the same properties on the built-in random model.
#include <doctest/doctest.h>

#include <llama2c/llama2c.hpp>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "../support/real_model.hpp"

namespace ll = lynx_examples::llama2c;

namespace {

// The real model (stories260K and tok512, shipped in examples/models; see
// support/real_model.hpp): a case that needs it and cannot find it is reported
// skipped, after the cases that need no model have run.
bool real_model_available() { return lynx_tests::model_or_skip(); }

const ll::weights& real_model() { return *lynx_tests::real_model(); }

const ll::tokenizer& real_tokenizer() {
  static const ll::tokenizer t(lynx_tests::tokenizer_path(), real_model().cfg().vocab_size);
  return t;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::filesystem::path temp_file(const std::string& name) {
  // A per-run tag keeps concurrent runs of this test from sharing files.
  static const std::string tag =
      std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
  return std::filesystem::temp_directory_path() / ("lynx_test_llama2c_" + tag + "_" + name);
}

// Logits [n, vocab] of `continuation` decoded one token at a time after `prompt`.
std::vector<float> one_at_a_time(const ll::weights& w, const std::vector<int>& prompt,
                                 const std::vector<int>& continuation) {
  ll::engine<> e(w);
  (void)e.prefill(prompt);
  std::vector<float> all;
  for (const int t : continuation) {
    const std::vector<float> l = e.decode(std::vector<int>{t}, e.position());
    all.insert(all.end(), l.begin(), l.end());
  }
  return all;
}

// Decode in chunks of k must give the one-at-a-time logits bit for bit, at
// every tail offset the chunking produces.
void check_batch_invariance(const ll::weights& w, const std::vector<int>& prompt,
                            const std::vector<int>& continuation) {
  const std::vector<float> reference = one_at_a_time(w, prompt, continuation);
  for (int k = 1; k <= 8; ++k) {
    CAPTURE(k);
    ll::engine<> e(w);
    (void)e.prefill(prompt);
    std::vector<float> all;
    for (std::size_t at = 0; at < continuation.size(); at += static_cast<std::size_t>(k)) {
      const std::size_t n =
          std::min<std::size_t>(static_cast<std::size_t>(k), continuation.size() - at);
      const std::vector<int> chunk(continuation.begin() + static_cast<std::ptrdiff_t>(at),
                                   continuation.begin() + static_cast<std::ptrdiff_t>(at + n));
      const std::vector<float> l = e.decode(chunk, e.position());
      all.insert(all.end(), l.begin(), l.end());
    }
    CHECK(e.cache().tail_length() == static_cast<int>(continuation.size()));
    CHECK(same_bits(all, reference));
  }
}

// Prefill of n tokens ends with the same bits as prefill of n-1 plus one decode.
void check_prefill_matches_decode(const ll::weights& w, const std::vector<int>& prompt) {
  ll::engine<> a(w), b(w);
  const std::vector<float> full = a.prefill(prompt);
  const std::vector<int> head(prompt.begin(), prompt.end() - 1);
  (void)b.prefill(head);
  const std::vector<float> last = b.decode(std::vector<int>{prompt.back()}, b.position());
  CHECK(same_bits(full, last));
}

// Drafts rejected and rolled back leave no trace: re-decoding after
// truncate_tail gives the logits of a run that never saw the drafts.
void check_rollback(const ll::weights& w, const std::vector<int>& prompt,
                    const std::vector<int>& continuation) {
  REQUIRE(continuation.size() >= 8);
  const std::vector<float> reference = one_at_a_time(w, prompt, continuation);
  const auto vocab = static_cast<std::size_t>(w.cfg().vocab_size);
  ll::engine<> e(w);
  (void)e.prefill(prompt);
  (void)e.decode(std::vector<int>(continuation.begin(), continuation.begin() + 3), e.position());
  std::vector<int> drafts(5);
  for (int i = 0; i < 5; ++i)
    drafts[static_cast<std::size_t>(i)] =
        (continuation[static_cast<std::size_t>(3 + i)] + 7 + i) % w.cfg().vocab_size;
  const std::vector<float> wrong = e.decode(drafts, e.position());
  CHECK(e.cache().tail_length() == 8);
  e.truncate_tail(5);
  CHECK(e.cache().tail_length() == 3);
  CHECK(e.position() == static_cast<int>(prompt.size()) + 3);
  const std::vector<float> redone =
      e.decode(std::vector<int>(continuation.begin() + 3, continuation.begin() + 8), e.position());
  const std::vector<float> expected(reference.begin() + static_cast<std::ptrdiff_t>(3 * vocab),
                                    reference.begin() + static_cast<std::ptrdiff_t>(8 * vocab));
  CHECK(same_bits(redone, expected));
  // The first draft had the same context as the first redone token; later ones differ.
  CHECK_FALSE(same_bits(wrong, redone));
  CHECK_THROWS_AS(e.truncate_tail(9), std::out_of_range);
}

// Records what the engine asks of its attention policy, delegating to exact.
struct recording_attention {
  ll::exact_attention exact;
  std::vector<int>* tail_visible_log;
  void operator()(const ll::kv_cache& cache, int layer, std::span<const float> q, int tail_visible,
                  std::span<float> out) {
    if (layer == 0) tail_visible_log->push_back(tail_visible);
    exact(cache, layer, q, tail_visible, out);
  }
};

}  // namespace

TEST_CASE("argmax breaks ties to the lowest id") {
  CHECK(ll::argmax(std::vector<float>{1.0f, 3.0f, 3.0f, 2.0f}) == 1);
  CHECK(ll::argmax(std::vector<float>{5.0f, 5.0f}) == 0);
  CHECK(ll::argmax(std::vector<float>{-1.0f, -0.5f, -0.5f}) == 1);
}

TEST_CASE("dot has a fixed reduction order independent of the caller") {
  // Same inputs, different surrounding batch: bitwise equal outputs.
  std::vector<float> w(37 * 100), x(3 * 100);
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = ll::uniform_pm1(1, 0, i);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = ll::uniform_pm1(1, 1, i);
  std::vector<float> batched(3 * 37), single(37);
  ll::detail::matmul(batched.data(), x.data(), w.data(), 3, 37, 100);
  for (int t = 0; t < 3; ++t) {
    ll::detail::matmul(single.data(), x.data() + t * 100, w.data(), 1, 37, 100);
    CHECK(std::memcmp(single.data(), batched.data() + t * 37, 37 * sizeof(float)) == 0);
  }
}

TEST_CASE("real model: loads with the documented shape") {
  if (!real_model_available()) return;
  const ll::config& c = real_model().cfg();
  CHECK(c.dim == 64);
  CHECK(c.hidden_dim == 172);
  CHECK(c.n_layers == 5);
  CHECK(c.n_heads == 8);
  CHECK(c.n_kv_heads == 4);
  CHECK(c.head_size() == 8);
  CHECK(c.vocab_size == 512);
  CHECK(c.seq_len == 512);
  CHECK(c.shared_classifier);
  CHECK(real_model().classifier().data() == real_model().token_embedding().data());
}

TEST_CASE("real model: tokenizer round trip") {
  if (!real_model_available()) return;
  const ll::tokenizer& tok = real_tokenizer();
  CHECK(tok.vocab_size() == 512);
  const std::vector<std::string> texts = {
      "Once upon a time, there was a little girl named Lily.",
      "She liked to play outside with her dog, Max!",
      "Hello world",
      "x",
      "",
      "caf\xc3\xa9 \xe2\x9c\x93 \xe6\x97\xa5\xe6\x9c\xac",  // code points missing from the vocab:
                                                            // byte fallback
      "  two  spaces\nand a newline\ttab",
  };
  for (const std::string& text : texts) {
    CAPTURE(text);
    const std::vector<int> ids = tok.encode(text);
    REQUIRE(!ids.empty());
    CHECK(ids.front() == ll::tokenizer::bos);
    for (const int id : ids) CHECK((id >= 0 && id < tok.vocab_size()));
    CHECK(tok.decode(ids) == text);
    const std::vector<int> with_eos = tok.encode(text, true, true);
    CHECK(with_eos.back() == ll::tokenizer::eos);
  }
  // Encoding stops only when no adjacent pair can merge (BPE's fixed point),
  // and text made of vocabulary pieces needs fewer tokens than bytes.
  for (const std::string& text : texts) {
    const std::vector<int> ids = tok.encode(text, false);
    for (std::size_t i = 0; i + 1 < ids.size(); ++i)
      CHECK(tok.lookup(std::string(tok.vocab_piece(ids[i])) +
                       std::string(tok.vocab_piece(ids[i + 1]))) < 0);
  }
  std::string pieces;
  for (int id = 259; id < 299; ++id) pieces += tok.vocab_piece(id);
  const std::vector<int> merged = tok.encode(pieces, false);
  CHECK(merged.size() < pieces.size() / 2);
  CHECK(tok.decode(tok.encode(pieces)) == pieces);
  // Byte tokens decode to their byte.
  CHECK(tok.piece(5, 3 + 'A') == "A");
  CHECK(tok.piece(ll::tokenizer::bos, tok.lookup(" a")) == "a");
  CHECK(tok.piece(5, tok.lookup(" a")) == " a");
}

TEST_CASE("checkpoint errors are clear") {
  // Built-in model saved and reloaded: identical parameters; then damaged copies.
  const ll::weights builtin = ll::make_builtin_model(7);
  const std::filesystem::path good = temp_file("good.bin");
  builtin.save(good);
  {
    const ll::weights loaded(good);
    CHECK(loaded.cfg() == builtin.cfg());
    CHECK(std::equal(loaded.parameters().begin(), loaded.parameters().end(),
                     builtin.parameters().begin(), builtin.parameters().end()));
  }
  std::vector<char> bytes(static_cast<std::size_t>(std::filesystem::file_size(good)));
  std::ifstream(good, std::ios::binary)
      .read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  auto write = [](const std::filesystem::path& p, const char* data, std::size_t n) {
    std::ofstream(p, std::ios::binary).write(data, static_cast<std::streamsize>(n));
  };
  const std::filesystem::path bad = temp_file("bad.bin");

  write(bad, bytes.data(), bytes.size() - 100);
  CHECK_THROWS_WITH_AS(ll::weights{bad}, doctest::Contains("truncated"), std::runtime_error);
  write(bad, bytes.data(), 10);
  CHECK_THROWS_WITH_AS(ll::weights{bad}, doctest::Contains("header"), std::runtime_error);
  std::vector<char> trailing = bytes;
  trailing.push_back(0);
  write(bad, trailing.data(), trailing.size());
  CHECK_THROWS_WITH_AS(ll::weights{bad}, doctest::Contains("trailing"), std::runtime_error);
  std::vector<char> zero_dim = bytes;
  std::memset(zero_dim.data(), 0, 4);
  write(bad, zero_dim.data(), zero_dim.size());
  CHECK_THROWS_WITH_AS(ll::weights{bad}, doctest::Contains("invalid config"), std::runtime_error);
  CHECK_THROWS_WITH_AS(ll::weights{temp_file("missing.bin")}, doctest::Contains("cannot open"),
                       std::runtime_error);
  {
    // Found by fuzzing: a header whose fields are each plausible and whose file size
    // matches (826 KiB), but whose KV cache (4096 layers x 35840 positions) would
    // take 2.2 GiB: refused at load, naming the product.
    const ll::config c{2, 1, 4096, 1, 1, 16639, 35840, true};
    std::vector<char> file(static_cast<std::size_t>(ll::detail::checkpoint_bytes(c)), 0);
    const std::int32_t header[7] = {c.dim,        c.hidden_dim, c.n_layers, c.n_heads,
                                    c.n_kv_heads, c.vocab_size, c.seq_len};
    std::memcpy(file.data(), header, sizeof header);
    write(bad, file.data(), file.size());
    CHECK(file.size() < (std::size_t{1} << 20));
    CHECK_THROWS_WITH_AS(ll::weights{bad}, doctest::Contains("implies a KV cache of"),
                         std::runtime_error);
  }

  if (real_model_available()) {
    const std::filesystem::path model_path = lynx_tests::model_path();
    std::vector<char> real(static_cast<std::size_t>(std::filesystem::file_size(model_path)));
    std::ifstream(model_path, std::ios::binary)
        .read(real.data(), static_cast<std::streamsize>(real.size()));
    write(bad, real.data(), real.size() / 2);
    CHECK_THROWS_WITH_AS(ll::weights{bad}, doctest::Contains("truncated"), std::runtime_error);
  }
  std::filesystem::remove(good);
  std::filesystem::remove(bad);
}

TEST_CASE("real model: batch invariance, prefill consistency, rollback") {
  if (!real_model_available()) return;
  const ll::weights& w = real_model();
  const std::vector<int> prompt = ll::sample_prompt(w, 11, 300);
  ll::engine<> e(w);
  const std::vector<int> continuation = ll::generate_greedy(e, prompt, 36);
  check_batch_invariance(w, prompt, continuation);
  check_prefill_matches_decode(w, prompt);
  check_rollback(w, prompt, continuation);
}

// True when common English encodes without byte fallback: the tokenizer fits
// a TinyStories model (a tokenizer of another vocabulary with 512 entries also
// loads, but its pieces are not English).
bool tokenizer_speaks_english(const ll::tokenizer& tok) {
  for (const int id : tok.encode("Once upon a time there was a little girl", false))
    if (id >= ll::tokenizer::first_byte_token && id < ll::tokenizer::first_byte_token + 256)
      return false;
  return true;
}

TEST_CASE("real model: greedy generation is deterministic and varied") {
  if (!real_model_available()) return;
  const ll::weights& w = real_model();
  const ll::tokenizer& tok = real_tokenizer();
  REQUIRE_MESSAGE(tokenizer_speaks_english(tok), lynx_tests::tokenizer_path()
                                                     << " is not stories260K's tokenizer");
  const std::vector<int> prompt =
      tok.encode("Once upon a time, there was a little girl named Lily.");
  ll::engine<> a(w), b(w);
  const std::vector<int> first = ll::generate_greedy(a, prompt, 64);
  const std::vector<int> second = ll::generate_greedy(b, prompt, 64);
  CHECK(first == second);
  CHECK(std::set<int>(first.begin(), first.end()).size() >= 15);
  const std::vector<int> shown(first.begin(), first.begin() + 40);
  std::string ids;
  for (const int t : shown) ids += std::to_string(t) + " ";
  const std::string text = tok.decode(shown);
  MESSAGE("stories260K greedy, 40 tokens after the prompt: " << ids << "\ntext: \"" << text
                                                             << "\"");
  int letters = 0;
  for (const char ch : text) {
    CHECK((std::isprint(static_cast<unsigned char>(ch)) || ch == '\n'));
    letters += std::isalpha(static_cast<unsigned char>(ch)) ? 1 : 0;
  }
  CHECK(letters > static_cast<int>(text.size()) / 2);
  // Sampled prompts are varied and deterministic in the seed.
  const std::vector<int> p1 = ll::sample_prompt(w, 3, 200), p2 = ll::sample_prompt(w, 3, 200);
  CHECK(p1 == p2);
  CHECK(p1 != ll::sample_prompt(w, 4, 200));
  CHECK(p1.front() == ll::tokenizer::bos);
  CHECK(std::set<int>(p1.begin(), p1.end()).size() >= 50);
}

TEST_CASE("real model: attention policy sees the causal tail mask") {
  if (!real_model_available()) return;
  const ll::weights& w = real_model();
  const std::vector<int> prompt = ll::sample_prompt(w, 5, 50);
  std::vector<int> log;
  ll::engine<recording_attention> e(w, recording_attention{{}, &log});
  (void)e.prefill(prompt);
  CHECK(log.empty());  // prefill is exact and internal
  const std::vector<int> tokens = {10, 20, 30, 40};
  const std::vector<float> l1 = e.decode(std::vector<int>{5}, e.position());
  const std::vector<float> l4 = e.decode(tokens, e.position());
  CHECK(log == std::vector<int>{1, 2, 3, 4, 5});
  ll::engine<> plain(w);
  (void)plain.prefill(prompt);
  CHECK(same_bits(plain.decode(std::vector<int>{5}, plain.position()), l1));
  CHECK(same_bits(plain.decode(tokens, plain.position()), l4));
  CHECK_THROWS_AS((void)e.decode(tokens, e.position() + 1), std::invalid_argument);
}

TEST_CASE("built-in model: deterministic, varied, batch invariant") {
  const ll::weights w = ll::make_builtin_model(1234);
  const ll::config& c = w.cfg();
  CHECK(c.head_size() == 32);
  CHECK(c.kv_group() == 2);
  // Same seed, same bits; another seed, other weights.
  const ll::weights again = ll::make_builtin_model(1234);
  CHECK(std::equal(w.parameters().begin(), w.parameters().end(), again.parameters().begin(),
                   again.parameters().end()));
  const ll::weights other = ll::make_builtin_model(99);
  CHECK_FALSE(std::equal(w.parameters().begin(), w.parameters().end(), other.parameters().begin(),
                         other.parameters().end()));

  const std::vector<int> prompt = ll::sample_prompt(w, 2, 300);
  CHECK(std::set<int>(prompt.begin(), prompt.end()).size() >= 50);
  ll::engine<> a(w), b(w);
  const std::vector<int> first = ll::generate_greedy(a, prompt, 64);
  CHECK(first == ll::generate_greedy(b, prompt, 64));
  const std::size_t distinct = std::set<int>(first.begin(), first.end()).size();
  MESSAGE("built-in model: " << distinct << " distinct tokens in 64 greedy tokens");
  CHECK(distinct >= 10);
  const std::vector<int> continuation(first.begin(), first.begin() + 36);
  check_batch_invariance(w, prompt, continuation);
  check_prefill_matches_decode(w, prompt);
  check_rollback(w, prompt, continuation);
}

TEST_CASE("engine rejects bad input") {
  const ll::weights w = ll::make_builtin_model(3);
  ll::engine<> e(w);
  CHECK_THROWS_AS((void)e.prefill(std::vector<int>{}), std::invalid_argument);
  CHECK_THROWS_AS((void)e.prefill(std::vector<int>{1, 256}), std::out_of_range);
  CHECK_THROWS_AS(
      (void)e.prefill(std::vector<int>(static_cast<std::size_t>(w.cfg().seq_len) + 1, 1)),
      std::out_of_range);
  (void)e.prefill(std::vector<int>(static_cast<std::size_t>(w.cfg().seq_len) - 1, 1));
  (void)e.decode(std::vector<int>{1}, e.position());
  CHECK_THROWS_AS((void)e.decode(std::vector<int>{1}, e.position()), std::out_of_range);
  // Decoding with no prompt at all puts everything in the tail.
  ll::engine<> f(w);
  const std::vector<float> l = f.decode(std::vector<int>{1, 2, 3}, 0);
  CHECK(l.size() == 3u * static_cast<std::size_t>(w.cfg().vocab_size));
  CHECK(f.cache().tail_length() == 3);
}

TEST_CASE("a tokenizer file is never trusted to size what it does not hold") {
  // Found by fuzzing: 12 bytes (max length 2^31 - 1, a score, a first token of
  // 2^31 - 1 bytes) made the loader allocate and zero 2 GiB before it found the
  // file truncated. Refused now before anything is sized by that length.
  const std::filesystem::path p = temp_file("tok12.bin");
  const unsigned char bytes[12] = {0xff, 0xff, 0xff, 0x7f, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0x7f};
  std::ofstream(p, std::ios::binary).write(reinterpret_cast<const char*>(bytes), sizeof bytes);
  CHECK_THROWS_WITH_AS(ll::tokenizer(p, 260), doctest::Contains("truncated at token 0"),
                       std::runtime_error);
  std::filesystem::remove(p);
}
