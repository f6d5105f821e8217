// libFuzzer target: the llama2.c tokenizer loader (examples/llama2c/tokenizer.hpp)
// on arbitrary files, and encode/decode over whatever vocabulary loads.
//
// Input: vocab_size = 259 + (u16 little-endian % 65278) (259 is the least the
// loader takes: 3 specials + 256 byte tokens), then a u8 text length and that
// many bytes of text, then the tokenizer file (written to a temporary file of
// this process and loaded with that vocab_size).
//
// Refusals must be what the loader documents: std::runtime_error (missing,
// truncated, trailing bytes, a token length out of range). A tokenizer that
// loads must answer for every id in range (vocab_piece, score, piece), find
// every piece by lookup (at the lowest id holding it), encode the text to ids in
// range (or refuse a vocabulary with no " " piece with std::runtime_error), and
// decode those ids. Anything else thrown, a crash, a sanitizer report or a hang
// (-timeout) fails.
// Allocation bound: the loader sizes its tables by the caller's vocab_size
// (here at most 65536 entries, about 3 MiB) and its strings by bytes the file
// holds; run.sh runs with -malloc_limit_mb=64 and inputs of at most 64 KiB, so
// a length taken from the file before the file is checked to hold it (the
// 2 GiB allocation of issue 32) fails as an allocation over the limit.
//
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Iexamples/llama2c \
//       tests/fuzz/llama2c_tokenizer.cpp -o /tmp/fuzz_llama2c_tokenizer
//   /tmp/fuzz_llama2c_tokenizer -max_total_time=60 -malloc_limit_mb=64 -max_len=65536
//   /tmp/fuzz_llama2c_tokenizer --make-seeds DIR [tok512.bin]   # seeds, then exit
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tokenizer.hpp"

namespace {

namespace l2 = lynx_examples::llama2c;

[[noreturn]] void failed(const char* why) {
  std::fprintf(stderr, "llama2c_tokenizer: %s\n", why);
  std::abort();
}

constexpr int least_vocab = l2::tokenizer::first_byte_token + 256;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 3) return 0;
  const int vocab = least_vocab + (data[0] | data[1] << 8) % (65536 - least_vocab + 1);
  const std::size_t text_bytes = std::min<std::size_t>(data[2], size - 3);
  const std::string text(reinterpret_cast<const char*>(data + 3), text_bytes);
  const std::uint8_t* file = data + 3 + text_bytes;
  const std::size_t file_bytes = size - 3 - text_bytes;

  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("lynx_fuzz_" + std::to_string(::getpid()) + "_tokenizer.bin");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(file), static_cast<std::streamsize>(file_bytes));
    if (!out) failed("cannot write the temporary file");
  }
  std::optional<l2::tokenizer> t;
  try {
    t.emplace(path, vocab);
  } catch (const std::runtime_error&) {
    return 0;  // a documented refusal
  }
  if (t->vocab_size() != vocab) failed("vocab_size differs from the one asked for");
  std::string all;
  for (int id = 0; id < vocab; ++id) {
    const std::string_view p = t->vocab_piece(id);
    if (p.size() > static_cast<std::size_t>(std::max(0, t->max_token_length())))
      failed("a piece longer than max_token_length");
    const int found = t->lookup(p);
    if (found < 0 || found > id || t->vocab_piece(found) != p) failed("lookup misses a piece");
    (void)t->score(id);
    all.append(t->piece(id == 0 ? l2::tokenizer::bos : id - 1, id));
  }
  std::vector<int> ids;
  try {
    ids = t->encode(text, (data[2] & 1) != 0, (data[2] & 2) != 0);
  } catch (const std::runtime_error&) {
    if (!text.empty() && t->lookup(" ") < 0) return 0;  // documented: no ' ' token
    failed("encode threw on a vocabulary that has a ' ' piece");
  }
  for (const int id : ids)
    if (id < 0 || id >= vocab) failed("encode produced an id out of range");
  (void)t->decode(ids);
  return 0;
}

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  for (int i = 1; i + 1 < *argc; ++i) {
    if (std::strcmp((*argv)[i], "--make-seeds") != 0) continue;
    const std::filesystem::path dir = (*argv)[i + 1];
    auto save = [&](const std::string& name, int vocab, const std::string& text,
                    const std::vector<std::uint8_t>& file) {
      std::ofstream out(dir / name, std::ios::binary);
      const int v = vocab - least_vocab;
      const std::uint8_t head[3] = {static_cast<std::uint8_t>(v), static_cast<std::uint8_t>(v >> 8),
                                    static_cast<std::uint8_t>(text.size())};
      out.write(reinterpret_cast<const char*>(head), 3);
      out.write(text.data(), static_cast<std::streamsize>(text.size()));
      out.write(reinterpret_cast<const char*>(file.data()),
                static_cast<std::streamsize>(file.size()));
      if (!out) {
        std::fprintf(stderr, "llama2c_tokenizer: cannot write seeds in %s\n", dir.c_str());
        std::exit(1);
      }
    };
    // A generated vocabulary in the llama2.c layout: <unk>, <s>, </s>, the 256
    // byte tokens, then a few merges.
    std::vector<std::string> pieces = {"<unk>", "\n<s>\n", "\n</s>\n"};
    for (int b = 0; b < 256; ++b) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "<0x%02X>", b);
      pieces.emplace_back(hex);
    }
    for (const char* p : {" ", "a", "b", "c", " a", "ab", " ab", "abc", " the", "th", "he", "é"})
      pieces.emplace_back(p);
    std::vector<std::uint8_t> file;
    auto put = [&](const void* p, std::size_t n) {
      const auto* b = static_cast<const std::uint8_t*>(p);
      file.insert(file.end(), b, b + n);
    };
    const std::int32_t max_len = 8;
    put(&max_len, 4);
    for (std::size_t k = 0; k < pieces.size(); ++k) {
      const float score = k < 259 ? 0.0f : -static_cast<float>(k);
      const auto len = static_cast<std::int32_t>(pieces[k].size());
      put(&score, 4);
      put(&len, 4);
      put(pieces[k].data(), pieces[k].size());
    }
    const int vocab = static_cast<int>(pieces.size());
    save("seed_generated", vocab, " abc the é\xff", file);
    save("seed_generated_empty_text", vocab, "", file);
    int seeds = 2;
    if (i + 2 < *argc) {  // a real vocabulary (examples/models/tok512.bin), vocab 512
      std::ifstream in((*argv)[i + 2], std::ios::binary);
      const std::vector<std::uint8_t> real((std::istreambuf_iterator<char>(in)),
                                           std::istreambuf_iterator<char>());
      if (!real.empty()) {
        save("seed_tok512", 512, "Once upon a time, there was a little girl.", real);
        ++seeds;
      }
    }
    std::printf("llama2c_tokenizer: %d seeds written to %s\n", seeds, dir.c_str());
    std::exit(0);
  }
  return 0;
}
