// libFuzzer target: the GGUF reader of the example engine (examples/gguf/reader.hpp,
// used by examples/gemma3) and its dequantizer (examples/gguf/dequant.hpp) on
// arbitrary files. The input is the whole file, read in place through the
// reader's in-memory constructor (libFuzzer's copy of the input is a heap block
// of exactly its size, so ASan sees a read one byte past the file; a mapped
// file's last page would hide it). Inputs whose size is a multiple of 8 are
// also written to a temporary file and opened by path: the same outcome.
//
// Refusals must be what the reader documents: format_error (a std::runtime_error)
// from the constructor. Anything else thrown, a crash, a sanitizer report or a
// hang (-timeout) fails. A file that loads is then used as a caller would: every
// metadata entry read with the accessor of its type (format_error only where
// documented: a negative integer, a bool byte over 1, an integer over int32) and
// described, every string inside the input, accessors of another type refused
// with format_error; every tensor found by name, its data inside the input and
// of the size its type and dims imply (or format_error for an unknown type), its
// first row dequantized, and the first few tensors dequantized whole (at most
// 2^18 values in all: tensors may overlap).
// Allocation bound: the reader sizes nothing by a count before checking that
// the file holds that many entries, so what it and this target allocate is a
// small multiple of the file (a Q4_K tensor dequantizes 144 bytes to 1 KiB of
// float); run.sh runs with -malloc_limit_mb=64 and inputs of at most 64 KiB.
//
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Iinclude -Iexamples \
//       tests/fuzz/gguf_reader.cpp -o /tmp/fuzz_gguf_reader
//   /tmp/fuzz_gguf_reader -max_total_time=60 -malloc_limit_mb=64 -max_len=65536
//   /tmp/fuzz_gguf_reader --make-seeds DIR   # small valid GGUF files, then exit
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "gguf/dequant.hpp"
#include "gguf/reader.hpp"

namespace {

namespace gguf = lynx_examples::gguf;
using gguf::tensor_type;
using gguf::value_type;

[[noreturn]] void failed(const std::string& why) {
  std::fprintf(stderr, "gguf_reader: %s\n", why.c_str());
  std::abort();
}

// [begin, end) of the input, for checking that views point into it.
struct input_range {
  const std::byte* begin;
  const std::byte* end;
  [[nodiscard]] bool holds(const void* p, std::size_t n) const {
    const auto* b = static_cast<const std::byte*>(p);
    if (n == 0) return true;  // an empty view may point anywhere
    return std::less_equal<>()(begin, b) && std::less_equal<>()(b, end) &&
           n <= static_cast<std::size_t>(end - b);
  }
};

// Runs f and requires that it throws format_error (a documented refusal).
template <class F>
void refused(F&& f, const char* what) {
  try {
    f();
  } catch (const gguf::format_error&) {
    return;
  }
  failed(std::string("not refused: ") + what);
}

// Runs f; format_error is accepted (the value is out of the accessor's range).
template <class F>
void allowed_to_refuse(F&& f) {
  try {
    f();
  } catch (const gguf::format_error&) {
  }
}

void check_metadata(const gguf::file& f, const input_range& in) {
  const auto& entries = f.metadata();
  if (f.keys().size() != entries.size()) failed("keys() and metadata() differ in size");
  for (const gguf::metadata_entry& e : entries) {
    if (!in.holds(e.key.data(), e.key.size())) failed("a key views bytes outside the input");
    if (f.find_entry(e.key) != &e) failed("find_entry does not find its own entry");
    if (e.offset > e.end || e.end > f.size()) failed("an entry's value lies outside the file");
    const std::string text = f.describe(e.key, 8);
    if (text.size() > (std::size_t{1} << 24)) failed("describe() produced over 16 MiB");
    if (e.type != value_type::array) {
      if (e.count != 1 || e.element_type != e.type) failed("a scalar entry with a count");
      if (gguf::is_integer(e.type)) {
        allowed_to_refuse([&] { (void)f.get_uint(e.key); });  // negative: refused
        refused([&] { (void)f.get_string(e.key); }, "get_string on an integer");
      } else if (e.type == value_type::f32 || e.type == value_type::f64) {
        (void)f.get_float(e.key);
        refused([&] { (void)f.get_uint(e.key); }, "get_uint on a float");
      } else if (e.type == value_type::boolean) {
        allowed_to_refuse([&] { (void)f.get_bool(e.key); });  // a byte over 1: refused
        refused([&] { (void)f.get_float(e.key); }, "get_float on a bool");
      } else if (e.type == value_type::string) {
        const std::string_view s = f.get_string(e.key);
        if (!in.holds(s.data(), s.size())) failed("a string views bytes outside the input");
        if (e.end - e.offset != 8 + s.size()) failed("a string's length differs from its entry");
        refused([&] { (void)f.get_bool(e.key); }, "get_bool on a string");
      }
      refused([&] { (void)f.get_string_array(e.key); }, "get_string_array on a scalar");
      continue;
    }
    refused([&] { (void)f.get_string(e.key); }, "get_string on an array");
    if (e.element_type == value_type::string) {
      const std::vector<std::string_view> strings = f.get_string_array(e.key);
      if (strings.size() != e.count) failed("a string array's size differs from its count");
      for (const std::string_view s : strings)
        if (!in.holds(s.data(), s.size())) failed("an array string views bytes outside the input");
    } else if (e.element_type == value_type::f32 || e.element_type == value_type::f64) {
      if (f.get_float_array(e.key).size() != e.count)
        failed("a float array's size differs from its count");
    } else if (gguf::is_integer(e.element_type)) {
      allowed_to_refuse([&] {  // an element beyond int32: refused
        if (f.get_int_array(e.key).size() != e.count)
          failed("an integer array's size differs from its count");
      });
    }
    if (e.element_type != value_type::string)
      refused([&] { (void)f.get_string_array(e.key); }, "get_string_array on another array");
  }
  refused([&] { (void)f.entry("gguf_reader.fuzz: no such key \xff"); }, "a missing key");
  if (f.has("general.alignment") && f.get_uint("general.alignment") != f.alignment())
    failed("alignment() differs from general.alignment");
}

void check_tensors(const gguf::file& f, const input_range& in) {
  // Tensors may overlap (each of 900 Q4_K tensors may view the same 60 KiB,
  // 1.4 s of decoding), so the work is bounded: the first four are dequantized
  // whole, the rest by their first row, until 2^18 values have been decoded;
  // after that only their bounds and sizes are checked.
  std::size_t whole_left = 4;
  std::int64_t values_left = std::int64_t{1} << 18;
  std::vector<float> row;
  for (const gguf::tensor_info& t : f.tensors()) {
    if (f.find_tensor(t.name) != &t) failed("find_tensor does not find its own tensor");
    if (t.dims.size() > 4) failed("a tensor with more than 4 dims");
    for (const std::int64_t d : t.dims)
      if (d < 1) failed("a tensor dim below 1");
    const std::int64_t elements = t.elements();
    if (elements < 1 || t.row_length() < 1 || t.rows() * t.row_length() != elements)
      failed("a tensor's element count is inconsistent");
    if (!gguf::is_known(t.type)) {
      refused([&] { (void)f.data(t); }, "data() of a tensor of unknown type");
      continue;
    }
    const std::span<const std::byte> bytes = f.data(t);
    if (!in.holds(bytes.data(), bytes.size())) failed("tensor data outside the input");
    const std::size_t row_bytes = gguf::row_bytes(t.type, t.row_length());
    if (bytes.size() != row_bytes * static_cast<std::size_t>(t.rows()) || bytes.size() != t.bytes)
      failed("a tensor's byte size is not what its type and dims imply");
    if (!gguf::can_dequantize(t.type)) {
      bool threw = false;
      try {
        (void)gguf::dequantize(f, t);
      } catch (const std::invalid_argument&) {
        threw = true;
      }
      if (!threw) failed("dequantize() of a type it does not decode did not refuse");
      continue;
    }
    if (values_left < t.row_length()) continue;
    values_left -= t.row_length();
    row.assign(static_cast<std::size_t>(t.row_length()), 0.0f);
    gguf::dequantize_row(t.type, bytes.data(), row.data(), t.row_length());
    if (whole_left > 0 && values_left >= elements) {
      --whole_left;
      values_left -= elements;
      const std::vector<float> all = gguf::dequantize(f, t);
      if (all.size() != static_cast<std::size_t>(elements)) failed("dequantize() size");
      if (std::memcmp(all.data(), row.data(), row.size() * sizeof(float)) != 0)
        failed("dequantize() and dequantize_row() differ on the first row");
    }
  }
  // A name no tensor has is refused (the fuzzer can spell any name: only if none has it).
  const std::string_view missing = "gguf_reader.fuzz: no such tensor";
  if (f.find_tensor(missing) == nullptr)
    refused([&] { (void)f.tensor(missing); }, "a missing tensor");
  else if (f.tensor(missing).name != missing)
    failed("tensor() finds another tensor than its name");
}

// The outcome of opening, for comparing the in-memory and the path entry points.
struct outcome {
  bool loaded = false;
  std::optional<std::uint64_t> error_offset;
  std::size_t keys = 0, tensors = 0;
  std::uint64_t data_offset = 0;
};

outcome open_path(const std::uint8_t* data, std::size_t size) {
  static const std::filesystem::path path =
      std::filesystem::temp_directory_path() /
      ("lynx_fuzz_" + std::to_string(::getpid()) + "_gguf_reader.gguf");
  {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
    if (!out) failed("cannot write the temporary file");
  }
  outcome o;
  try {
    const gguf::file f(path);
    o.loaded = true;
    o.keys = f.metadata().size();
    o.tensors = f.tensors().size();
    o.data_offset = f.data_offset();
  } catch (const gguf::format_error& e) {
    o.error_offset = e.offset();
  }
  return o;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(data), size);
  const input_range in{bytes.data(), bytes.data() + size};
  outcome o;
  std::optional<gguf::file> f;
  try {
    f.emplace(bytes, "fuzz input");
  } catch (const gguf::format_error& e) {
    o.error_offset = e.offset();  // a documented refusal
  }
  if (f) {
    o.loaded = true;
    o.keys = f->metadata().size();
    o.tensors = f->tensors().size();
    o.data_offset = f->data_offset();
    if (f->version() != 2 && f->version() != 3) failed("a version other than 2 or 3 loaded");
    if (f->size() != size) failed("size() differs from the input's");
    check_metadata(*f, in);
    check_tensors(*f, in);
    const gguf::file moved(std::move(*f));  // views survive a move
    f.reset();
    check_metadata(moved, in);
  }
  if (size % 8 == 0) {
    const outcome p = open_path(data, size);
    if (p.loaded != o.loaded || p.error_offset != o.error_offset || p.keys != o.keys ||
        p.tensors != o.tensors || p.data_offset != o.data_offset)
      failed("opening by path and from memory disagree");
  }
  return 0;
}

namespace {

// Little-endian GGUF bytes, appended field by field (the seeds' writer).
class writer {
 public:
  template <class T>
  writer& put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::uint8_t*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
    return *this;
  }
  writer& str(std::string_view s) {
    put<std::uint64_t>(s.size());
    bytes_.insert(bytes_.end(), s.begin(), s.end());
    return *this;
  }
  writer& header(std::uint32_t version, std::uint64_t tensors, std::uint64_t kvs) {
    put<std::uint32_t>(0x46554747u);  // "GGUF"
    put<std::uint32_t>(version);
    put<std::uint64_t>(tensors);
    return put<std::uint64_t>(kvs);
  }
  writer& key(std::string_view k, value_type t) {
    str(k);
    return put<std::uint32_t>(static_cast<std::uint32_t>(t));
  }
  writer& array(value_type element, std::uint64_t count) {
    put<std::uint32_t>(static_cast<std::uint32_t>(element));
    return put<std::uint64_t>(count);
  }
  writer& tensor(std::string_view name, std::vector<std::uint64_t> dims, tensor_type type,
                 std::uint64_t offset) {
    str(name);
    put<std::uint32_t>(static_cast<std::uint32_t>(dims.size()));
    for (const std::uint64_t d : dims) put<std::uint64_t>(d);
    put<std::uint32_t>(static_cast<std::uint32_t>(type));
    return put<std::uint64_t>(offset);
  }
  writer& pad_to(std::size_t alignment) {
    while (bytes_.size() % alignment != 0) bytes_.push_back(0);
    return *this;
  }
  // n bytes of a fixed pattern (quant blocks: any bytes are valid).
  writer& fill(std::size_t n, std::uint8_t seed) {
    for (std::size_t k = 0; k < n; ++k) bytes_.push_back(static_cast<std::uint8_t>(seed + 37 * k));
    return *this;
  }
  // n f16 values with bits 0x3c00 + k (1.0 and its neighbours; also valid d / dmin).
  writer& halves(std::size_t n) {
    for (std::size_t k = 0; k < n; ++k) put<std::uint16_t>(static_cast<std::uint16_t>(0x3c00 + k));
    return *this;
  }
  [[nodiscard]] const std::vector<std::uint8_t>& bytes() const { return bytes_; }

 private:
  std::vector<std::uint8_t> bytes_;
};

// A Q8_0 / Q4_K / Q6_K block whose scales are small f16 values and whose
// quants are a pattern.
void q8_0_block(writer& w, std::uint8_t seed) { w.halves(1).fill(32, seed); }
void q4_k_block(writer& w, std::uint8_t seed) { w.halves(2).fill(12 + 128, seed); }
void q6_k_block(writer& w, std::uint8_t seed) { w.fill(128 + 64 + 16, seed).halves(1); }

void save(const std::filesystem::path& p, const writer& w) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(w.bytes().data()),
            static_cast<std::streamsize>(w.bytes().size()));
  if (!out) {
    std::fprintf(stderr, "gguf_reader: cannot write %s\n", p.c_str());
    std::exit(1);
  }
}

// v3, default alignment 32: scalars of several types, a string, arrays of
// string, int32 and float32, a nested array; F32, F16 and Q8_0 tensors.
writer seed_small() {
  writer w;
  w.header(3, 3, 9);
  w.key("general.architecture", value_type::string).str("gemma3");
  w.key("general.name", value_type::string).str("fuzz seed");
  w.key("gemma3.block_count", value_type::u32).put<std::uint32_t>(2);
  w.key("gemma3.rope.freq_base", value_type::f32).put(10000.0f);
  w.key("t.bool", value_type::boolean).put<std::uint8_t>(1);
  w.key("t.i64", value_type::i64).put<std::int64_t>(-5);
  w.key("tokenizer.ggml.tokens", value_type::array).array(value_type::string, 4);
  w.str("<pad>").str("<bos>").str("a").str("\xe2\x96\x81the");
  w.key("tokenizer.ggml.token_type", value_type::array).array(value_type::i32, 4);
  w.put<std::int32_t>(3).put<std::int32_t>(3).put<std::int32_t>(1).put<std::int32_t>(1);
  w.key("t.nested", value_type::array).array(value_type::array, 2);
  w.array(value_type::f32, 2).put(0.5f).put(-1.0f);
  w.array(value_type::u8, 3).put<std::uint8_t>(1).put<std::uint8_t>(2).put<std::uint8_t>(3);
  w.tensor("token_embd.weight", {4, 2}, tensor_type::f32, 0);
  w.tensor("output_norm.weight", {4}, tensor_type::f16, 32);
  w.tensor("blk.0.attn_q.weight", {32, 2}, tensor_type::q8_0, 64);
  w.pad_to(32);
  for (int k = 0; k < 8; ++k) w.put(0.25f * static_cast<float>(k - 3));
  w.pad_to(32);
  w.halves(4).pad_to(32);
  q8_0_block(w, 1);
  q8_0_block(w, 2);
  return w;
}

// v3, general.alignment 64: the k-quants, Q5_0 and BF16, float64 and uint64
// values, a float64 array.
writer seed_kquants() {
  writer w;
  w.header(3, 4, 5);
  w.key("general.alignment", value_type::u32).put<std::uint32_t>(64);
  w.key("t.f64", value_type::f64).put(0.125);
  w.key("t.u64", value_type::u64).put<std::uint64_t>(1u << 20);
  w.key("t.f64s", value_type::array).array(value_type::f64, 2).put(1.0).put(-2.0);
  w.key("t.u16", value_type::u16).put<std::uint16_t>(7);
  w.tensor("blk.0.ffn_up.weight", {256}, tensor_type::q4_k, 0);
  w.tensor("blk.0.ffn_down.weight", {256}, tensor_type::q6_k, 192);
  w.tensor("blk.0.attn_k.weight", {32, 2}, tensor_type::q5_0, 448);
  w.tensor("blk.0.attn_norm.weight", {8}, tensor_type::bf16, 512);
  w.pad_to(64);
  q4_k_block(w, 3);
  w.pad_to(64);
  q6_k_block(w, 4);
  w.pad_to(64);
  for (int b = 0; b < 2; ++b) w.halves(1).fill(4 + 16, static_cast<std::uint8_t>(5 + b));
  w.pad_to(64);
  for (int k = 0; k < 8; ++k) w.put<std::uint16_t>(static_cast<std::uint16_t>(0x3f80 + k));
  return w;
}

// v2: a tensor of a type the reader does not know (its data cannot be located),
// a Q8_K tensor (known, not dequantized), int8 / int16 / bool values.
writer seed_v2_unknown_type() {
  writer w;
  w.header(2, 2, 4);
  w.key("t.i8", value_type::i8).put<std::int8_t>(-3);
  w.key("t.i16", value_type::i16).put<std::int16_t>(300);
  w.key("t.false", value_type::boolean).put<std::uint8_t>(0);
  w.key("t.empty", value_type::array).array(value_type::string, 0);
  w.tensor("w.unknown", {16}, static_cast<tensor_type>(40), 0);
  w.tensor("w.q8_k", {256}, tensor_type::q8_k, 0);
  w.pad_to(32);
  w.fill(292, 9);
  return w;
}

// Metadata only: no tensors.
writer seed_metadata_only() {
  writer w;
  w.header(3, 0, 2);
  w.key("general.architecture", value_type::string).str("llama");
  w.key("llama.context_length", value_type::u32).put<std::uint32_t>(4096);
  return w;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  for (int i = 1; i + 1 < *argc; ++i) {
    if (std::strcmp((*argv)[i], "--make-seeds") != 0) continue;
    const std::filesystem::path dir = (*argv)[i + 1];
    const std::pair<const char*, writer> seeds[] = {
        {"seed_small", seed_small()},
        {"seed_kquants", seed_kquants()},
        {"seed_v2_unknown_type", seed_v2_unknown_type()},
        {"seed_metadata_only", seed_metadata_only()},
    };
    for (const auto& [name, w] : seeds) {
      // Every seed must load: a seed the reader refuses seeds nothing.
      try {
        const std::vector<std::uint8_t>& b = w.bytes();
        const gguf::file f(std::span(reinterpret_cast<const std::byte*>(b.data()), b.size()), name);
      } catch (const gguf::format_error& e) {
        std::fprintf(stderr, "gguf_reader: seed %s does not load: %s\n", name, e.what());
        std::exit(1);
      }
      save(dir / name, w);
    }
    std::printf("gguf_reader: %zu seeds written to %s\n", std::size(seeds), dir.c_str());
    std::exit(0);
  }
  return 0;
}
