// Tests of the GGUF reader and dequantizer (examples/gguf/): a tiny valid file
// written here with every metadata type and F32/F16/Q8_0 tensors (values
// round-trip, the alignment is honoured); malformed files, each rejected with a
// format_error naming the offset and the field (every prefix of the valid file
// included); and hand-packed Q8_0/Q5_0/Q4_K/Q6_K blocks decoding to the values
// the formats define. Needs no model: the real-model check is
// tests/examples/gguf_dequant_check.py.
#include <doctest/doctest.h>

#include <gguf/dequant.hpp>
#include <gguf/reader.hpp>

#include <unistd.h>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace gguf = lynx_examples::gguf;
using gguf::tensor_type;
using gguf::value_type;

namespace {

// A fresh directory per run, removed at exit.
class temp_dir {
 public:
  temp_dir() {
    path_ =
        std::filesystem::temp_directory_path() / ("lynx_test_gguf_" + std::to_string(::getpid()));
    std::filesystem::create_directories(path_);
  }
  ~temp_dir() {
    std::error_code ignored;
    std::filesystem::remove_all(path_, ignored);
  }
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

const std::filesystem::path& scratch() {
  static const temp_dir dir;
  return dir.path();
}

// Little-endian GGUF bytes, appended field by field.
class gguf_bytes {
 public:
  template <class T>
  gguf_bytes& put(T value) {
    static_assert(std::is_trivially_copyable_v<T>);
    const auto* p = reinterpret_cast<const std::byte*>(&value);
    bytes_.insert(bytes_.end(), p, p + sizeof(T));
    return *this;
  }
  gguf_bytes& str(std::string_view s) {
    put<std::uint64_t>(s.size());
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    bytes_.insert(bytes_.end(), p, p + s.size());
    return *this;
  }
  gguf_bytes& header(std::uint64_t tensors, std::uint64_t kvs, std::uint32_t version = 3) {
    put<std::uint32_t>(0x46554747u);  // "GGUF"
    put<std::uint32_t>(version);
    put<std::uint64_t>(tensors);
    return put<std::uint64_t>(kvs);
  }
  gguf_bytes& key(std::string_view k, value_type t) {
    str(k);
    return put<std::uint32_t>(static_cast<std::uint32_t>(t));
  }
  gguf_bytes& array(value_type element, std::uint64_t count) {
    put<std::uint32_t>(static_cast<std::uint32_t>(element));
    return put<std::uint64_t>(count);
  }
  gguf_bytes& tensor(std::string_view name, std::vector<std::uint64_t> dims, std::uint32_t type,
                     std::uint64_t offset) {
    str(name);
    put<std::uint32_t>(static_cast<std::uint32_t>(dims.size()));
    for (std::uint64_t d : dims) put<std::uint64_t>(d);
    put<std::uint32_t>(type);
    return put<std::uint64_t>(offset);
  }
  gguf_bytes& pad_to(std::size_t alignment) {
    while (bytes_.size() % alignment != 0) bytes_.push_back(std::byte{0});
    return *this;
  }
  gguf_bytes& raw(const void* p, std::size_t n) {
    const auto* b = static_cast<const std::byte*>(p);
    bytes_.insert(bytes_.end(), b, b + n);
    return *this;
  }
  [[nodiscard]] std::size_t size() const { return bytes_.size(); }
  [[nodiscard]] const std::vector<std::byte>& bytes() const { return bytes_; }

 private:
  std::vector<std::byte> bytes_;
};

std::filesystem::path write_file(const std::string& name, const std::byte* data, std::size_t n) {
  const std::filesystem::path path = scratch() / name;
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(n));
  out.close();
  REQUIRE(out.good());
  return path;
}

std::filesystem::path write_file(const std::string& name, const gguf_bytes& b) {
  return write_file(name, b.bytes().data(), b.size());
}

// The message of the format_error that opening `bytes` throws ("" if none).
std::string open_error(const gguf_bytes& b, const std::string& name = "bad.gguf") {
  const auto path = write_file(name, b);
  try {
    const gguf::file f(path);
  } catch (const gguf::format_error& e) {
    return e.what();
  }
  return "";
}

bool contains(const std::string& text, std::string_view part) {
  return text.find(part) != std::string::npos;
}

// Checks that a message holds a part, showing the whole message when it does not.
#define CHECK_CONTAINS(text, part)       \
  do {                                   \
    const std::string message_ = (text); \
    INFO("message: ", message_);         \
    CHECK(contains(message_, part));     \
  } while (false)

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

std::uint16_t fp16_bits(float x) { return lynx::fp16(x).bits; }

// The valid file: every metadata type, general.alignment = 64, three tensors
// (the last one ending at the end of the file, so that every shorter prefix
// is a truncated file).
constexpr float f32_values[6] = {1.0f, -2.5f, 3.25f, 0.0f, -0.0f, 1e-30f};
constexpr std::uint16_t f16_values[4] = {0x3c00, 0xc000, 0x0001, 0x7bff};  // 1, -2, 2^-24, 65504
constexpr std::int8_t q8_values[2][32] = {
    {-128, -127, -1,  0,   1,   2,   3,   127, 10, 20, 30, 40, 50, 60, 70, 80,
     -10,  -20,  -30, -40, -50, -60, -70, -80, 5,  6,  7,  8,  9,  11, 12, 13},
    {1,  1,  1,  1,  2,  2,  2,  2,  3,  3,  3,  3,  4,  4,  4,  4,
     -1, -1, -1, -1, -2, -2, -2, -2, -3, -3, -3, -3, -4, -4, -4, -4}};
constexpr float q8_scales[2] = {0.5f, -0.125f};  // exact in fp16

gguf_bytes valid_file() {
  gguf_bytes b;
  b.header(3, 20);
  b.key("t.u8", value_type::u8).put<std::uint8_t>(200);
  b.key("t.i8", value_type::i8).put<std::int8_t>(-100);
  b.key("t.u16", value_type::u16).put<std::uint16_t>(60000);
  b.key("t.i16", value_type::i16).put<std::int16_t>(-30000);
  b.key("t.u32", value_type::u32).put<std::uint32_t>(4000000000u);
  b.key("t.i32", value_type::i32).put<std::int32_t>(-2000000000);
  b.key("t.f32", value_type::f32).put<float>(1.5f);
  b.key("t.bool", value_type::boolean).put<std::uint8_t>(1);
  b.key("t.false", value_type::boolean).put<std::uint8_t>(0);
  b.key("t.string", value_type::string).str("hello, gguf");
  b.key("t.u64", value_type::u64).put<std::uint64_t>((std::uint64_t{1} << 40) + 3);
  b.key("t.i64", value_type::i64).put<std::int64_t>(-(std::int64_t{1} << 40));
  b.key("t.f64", value_type::f64).put<double>(0.1);
  b.key("t.strings", value_type::array).array(value_type::string, 3).str("a").str("").str("ccc");
  b.key("t.floats", value_type::array).array(value_type::f32, 3).put(0.5f).put(-2.0f).put(3.25f);
  b.key("t.ints", value_type::array)
      .array(value_type::i32, 3)
      .put<std::int32_t>(1)
      .put<std::int32_t>(-2)
      .put<std::int32_t>(2147483647);
  b.key("t.u8s", value_type::array)
      .array(value_type::u8, 3)
      .put<std::uint8_t>(7)
      .put<std::uint8_t>(8)
      .put<std::uint8_t>(255);
  b.key("t.nested", value_type::array).array(value_type::array, 2);
  b.array(value_type::i16, 2).put<std::int16_t>(1).put<std::int16_t>(-2);
  b.array(value_type::string, 1).str("x");
  b.key("t.empty", value_type::array).array(value_type::f64, 0);
  b.key("general.alignment", value_type::u32).put<std::uint32_t>(64);
  b.tensor("w.f32", {3, 2}, 0, 0);
  b.tensor("w.f16", {4}, 1, 64);
  b.tensor("w.q8_0", {32, 2}, 8, 128);
  b.pad_to(64);
  b.raw(f32_values, sizeof f32_values).pad_to(64);
  b.raw(f16_values, sizeof f16_values).pad_to(64);
  for (int k = 0; k < 2; ++k) b.put<std::uint16_t>(fp16_bits(q8_scales[k])).raw(q8_values[k], 32);
  return b;
}

}  // namespace

TEST_CASE("a valid file: header, every metadata type, tensor table") {
  const gguf_bytes b = valid_file();
  const gguf::file f(write_file("valid.gguf", b));
  CHECK(f.version() == 3);
  CHECK(f.size() == b.size());
  CHECK(f.alignment() == 64);
  CHECK(f.data_offset() % 64 == 0);
  CHECK(f.keys().size() == 20);
  CHECK(f.keys().front() == "t.u8");
  CHECK(f.has("t.nested"));
  CHECK_FALSE(f.has("t.missing"));

  CHECK(f.get_uint("t.u8") == 200);
  CHECK(f.get_uint("t.u16") == 60000);
  CHECK(f.get_uint("t.u32") == 4000000000u);
  CHECK(f.get_uint("t.u64") == (std::uint64_t{1} << 40) + 3);
  CHECK(f.get_uint("general.alignment") == 64);
  CHECK(f.get_float("t.f32") == 1.5);
  CHECK(f.get_float("t.f64") == 0.1);
  CHECK(f.get_bool("t.bool"));
  CHECK_FALSE(f.get_bool("t.false"));
  CHECK(f.get_string("t.string") == "hello, gguf");
  CHECK(f.get_string_array("t.strings") == std::vector<std::string_view>{"a", "", "ccc"});
  CHECK(f.get_float_array("t.floats") == std::vector<float>{0.5f, -2.0f, 3.25f});
  CHECK(f.get_int_array("t.ints") == std::vector<std::int32_t>{1, -2, 2147483647});
  CHECK(f.get_int_array("t.u8s") == std::vector<std::int32_t>{7, 8, 255});
  CHECK(f.get_float_array("t.empty").empty());

  // Entries record types, counts and where each value sits.
  const gguf::metadata_entry& nested = f.entry("t.nested");
  CHECK(nested.type == value_type::array);
  CHECK(nested.element_type == value_type::array);
  CHECK(nested.count == 2);
  CHECK(f.describe("t.nested") == "[[1, -2] (2 int16), ['x'] (1 string)] (2 array)");
  CHECK(f.describe("t.i8") == "-100");
  CHECK(f.describe("t.i64") == "-1099511627776");
  CHECK(f.describe("t.i32") == "-2000000000");
  CHECK(f.describe("t.i16") == "-30000");
  CHECK(f.describe("t.string") == "'hello, gguf'");
  CHECK(f.describe("t.strings", 2) == "['a', '', ...] (3 string)");

  // find_* give nullopt for an absent key, the value for a present one.
  CHECK_FALSE(f.find_uint("t.missing").has_value());
  CHECK_FALSE(f.find_float("t.missing").has_value());
  CHECK_FALSE(f.find_bool("t.missing").has_value());
  CHECK_FALSE(f.find_string("t.missing").has_value());
  CHECK(f.find_uint("t.u8") == 200);
  CHECK(f.find_float("t.f32") == 1.5);
  CHECK(f.find_bool("t.bool") == true);
  CHECK(f.find_string("t.string") == "hello, gguf");

  // The tensor table, with absolute offsets on the 64-byte alignment.
  REQUIRE(f.tensors().size() == 3);
  const gguf::tensor_info& a = f.tensor("w.f32");
  CHECK(a.dims == std::vector<std::int64_t>{3, 2});
  CHECK(a.type == tensor_type::f32);
  CHECK(a.elements() == 6);
  CHECK(a.row_length() == 3);
  CHECK(a.rows() == 2);
  CHECK(a.bytes == 24);
  CHECK(a.offset == f.data_offset());
  CHECK(f.tensor("w.f16").offset == f.data_offset() + 64);
  const gguf::tensor_info& q = f.tensor("w.q8_0");
  CHECK(q.offset == f.data_offset() + 128);
  CHECK(q.bytes == 68);
  CHECK(q.offset + q.bytes == f.size());
  for (const auto& t : f.tensors()) CHECK(t.offset % 64 == 0);
  CHECK(f.find_tensor("nope") == nullptr);
  CHECK(&f.tensors()[2] == f.find_tensor("w.q8_0"));
}

TEST_CASE("a valid file: tensor data round-trips") {
  const gguf::file f(write_file("valid.gguf", valid_file()));
  const auto raw = f.data(f.tensor("w.f32"));
  REQUIRE(raw.size() == sizeof f32_values);
  CHECK(std::memcmp(raw.data(), f32_values, sizeof f32_values) == 0);
  const std::vector<float> a = gguf::dequantize(f, f.tensor("w.f32"));
  CHECK(std::memcmp(a.data(), f32_values, sizeof f32_values) == 0);  // -0.0 kept

  CHECK(gguf::dequantize(f, f.tensor("w.f16")) ==
        std::vector<float>{1.0f, -2.0f, 5.9604644775390625e-08f, 65504.0f});

  const std::vector<float> q = gguf::dequantize(f, f.tensor("w.q8_0"));
  REQUIRE(q.size() == 64);
  for (int k = 0; k < 2; ++k)
    for (int i = 0; i < 32; ++i)
      CHECK(q[32 * k + i] == static_cast<float>(q8_values[k][i]) * q8_scales[k]);
  CHECK(q[0] == -64.0f);  // -128 * 0.5
  CHECK(q[32] == -0.125f);
}

TEST_CASE("the file is move-only and views survive a move") {
  static_assert(!std::is_copy_constructible_v<gguf::file>);
  static_assert(std::is_nothrow_move_constructible_v<gguf::file>);
  gguf::file f(write_file("valid.gguf", valid_file()));
  const std::string_view s = f.get_string("t.string");
  gguf::file g(std::move(f));
  CHECK(s == "hello, gguf");  // the mapping moved with the object, not copied
  CHECK(g.get_string("t.string").data() == s.data());
  CHECK(g.tensor("w.q8_0").bytes == 68);
  gguf::file h(write_file("valid2.gguf", valid_file()));
  h = std::move(g);
  CHECK(h.get_string_array("t.strings").size() == 3);
}

TEST_CASE("a file in memory reads in place, as the same bytes on disk do") {
  const gguf_bytes b = valid_file();
  const gguf::file disk(write_file("valid.gguf", b));
  gguf::file mem(std::span(b.bytes()), "valid in memory");
  CHECK(mem.path() == "valid in memory");
  CHECK(mem.size() == disk.size());
  CHECK(mem.data_offset() == disk.data_offset());
  CHECK(mem.keys() == disk.keys());
  CHECK(mem.get_string("t.string").data() ==
        reinterpret_cast<const char*>(b.bytes().data()) + (disk.entry("t.string").offset + 8));
  const auto raw = mem.data(mem.tensor("w.q8_0"));
  CHECK(raw.data() == b.bytes().data() + disk.tensor("w.q8_0").offset);  // no copy
  CHECK(gguf::dequantize(mem, mem.tensor("w.q8_0")) ==
        gguf::dequantize(disk, disk.tensor("w.q8_0")));
  const gguf::file moved(std::move(mem));  // borrowed bytes: moved, never unmapped
  CHECK(moved.get_string("t.string") == "hello, gguf");

  // The same refusals, naming the name given.
  gguf_bytes cut;
  cut.raw(b.bytes().data(), 40);
  CHECK_CONTAINS(error_of([&] { const gguf::file f(std::span(cut.bytes()), "cut"); }),
                 "metadata count at offset 24 claims 20 entries");
  CHECK_CONTAINS(error_of([&] { const gguf::file f(std::span(cut.bytes()), "cut"); }), "(in cut)");
  CHECK_CONTAINS(error_of([&] { const gguf::file f(std::span<const std::byte>(), "empty"); }),
                 "truncated file at offset 0 reading magic");
}

TEST_CASE("missing keys and wrong types name the key and the type found") {
  const gguf::file f(write_file("valid.gguf", valid_file()));
  CHECK_CONTAINS(error_of([&] { (void)f.get_uint("t.missing"); }), "no metadata key 't.missing'");
  CHECK_CONTAINS(error_of([&] { (void)f.get_uint("t.string"); }),
                 "metadata key 't.string' is string, expected an integer");
  CHECK_CONTAINS(error_of([&] { (void)f.get_uint("t.i8"); }),
                 "metadata key 't.i8' is int8 -100, expected a non-negative integer");
  CHECK_CONTAINS(error_of([&] { (void)f.get_float("t.u8"); }), "'t.u8' is uint8, expected a float");
  CHECK_CONTAINS(error_of([&] { (void)f.get_bool("t.u8"); }), "'t.u8' is uint8, expected a bool");
  CHECK_CONTAINS(error_of([&] { (void)f.get_string("t.floats"); }),
                 "'t.floats' is array of float32, expected a string");
  CHECK_CONTAINS(error_of([&] { (void)f.get_string_array("t.ints"); }),
                 "'t.ints' is array of int32, expected an array of string");
  CHECK_CONTAINS(error_of([&] { (void)f.get_float_array("t.ints"); }), "array of int32");
  CHECK_CONTAINS(error_of([&] { (void)f.get_int_array("t.nested"); }),
                 "'t.nested' is array of array, expected an array of integers");
  CHECK_CONTAINS(error_of([&] { (void)f.find_uint("t.f64"); }), "is float64");  // present: throws
  CHECK_CONTAINS(error_of([&] { (void)f.tensor("w.nope"); }), "no tensor 'w.nope'");
  CHECK_THROWS_AS((void)f.get_uint("t.missing"), gguf::format_error);
}

TEST_CASE("every prefix of a valid file is rejected, never a crash") {
  const gguf_bytes b = valid_file();
  const auto& bytes = b.bytes();
  int rejected = 0;
  for (std::size_t n = 0; n < bytes.size(); ++n) {
    const auto path = write_file("prefix.gguf", bytes.data(), n);
    CAPTURE(n);
    CHECK_THROWS_AS(gguf::file{path}, gguf::format_error);
    ++rejected;
  }
  CHECK(rejected == static_cast<int>(bytes.size()));
  // A few cut points, message by message.
  auto cut = [&](std::size_t n) {
    const auto path = write_file("prefix.gguf", bytes.data(), n);
    return error_of([&] { gguf::file f(path); });
  };
  CHECK_CONTAINS(cut(0), "gguf: truncated file at offset 0 reading magic: need 4 bytes, 0 left");
  CHECK_CONTAINS(cut(6), "truncated file at offset 4 reading version: need 4 bytes, 2 left");
  CHECK_CONTAINS(cut(10), "truncated file at offset 8 reading tensor count: need 8 bytes, 2 left");
  // 20 keys need at least 20 x 13 bytes: a shorter rest fails before the first key
  CHECK_CONTAINS(cut(24 + 2),
                 "gguf: metadata count at offset 24 claims 20 entries of at least 13 bytes "
                 "each, but only 2 bytes are left");
  // Cuts in the last key (general.alignment, key 19) and in the tensor table.
  auto at = [&](std::string_view text) {  // offset of a string's u64 length field
    const auto* p = reinterpret_cast<const char*>(bytes.data());
    const std::size_t pos = std::string_view(p, bytes.size()).find(text);
    REQUIRE(pos != std::string_view::npos);
    return pos - 8;
  };
  const std::size_t key = at("general.alignment");
  CHECK_CONTAINS(cut(key + 3), "truncated file at offset " + std::to_string(key) +
                                   " reading metadata key 19 (length): need 8 bytes, 3 left");
  CHECK_CONTAINS(cut(key + 8 + 5), "truncated file at offset " + std::to_string(key + 8) +
                                       " reading metadata key 19: need 17 bytes, 5 left");
  CHECK_CONTAINS(cut(key + 8 + 17 + 1),
                 "reading metadata key 19 'general.alignment' (type): need 4 "
                 "bytes, 1 left");
  CHECK_CONTAINS(cut(key + 8 + 17 + 4 + 2),
                 "reading metadata key 19 'general.alignment' (value): "
                 "need 4 bytes, 2 left");
  const std::size_t tensor = at("w.f16");
  CHECK_CONTAINS(cut(tensor + 8 + 5 + 2),
                 "truncated file at offset " + std::to_string(tensor + 13) +
                     " reading tensor 1 'w.f16' (n_dims): need 4 bytes, 2 left");
  CHECK_CONTAINS(cut(tensor + 8 + 5 + 4 + 7),
                 "reading tensor 1 'w.f16' (dim 0): need 8 bytes, 7 left");
  CHECK_CONTAINS(cut(tensor + 8 + 5 + 4 + 8),
                 "reading tensor 1 'w.f16' (type): need 4 bytes, 0 left");
  CHECK_CONTAINS(cut(tensor + 8 + 5 + 4 + 8 + 4 + 1),
                 "reading tensor 1 'w.f16' (offset): need 8 bytes");
  const std::string last = cut(bytes.size() - 1);
  CHECK_CONTAINS(last, "tensor 'w.q8_0' data [");
  CHECK_CONTAINS(last, "lies outside the file (" + std::to_string(bytes.size() - 1) + " bytes)");
}

TEST_CASE("random byte changes of a valid file: a file or a format_error, never a crash") {
  // Every read a mutated file allows must work too (under the sanitizer preset
  // this is where an unchecked read would show).
  const gguf_bytes b = valid_file();
  std::uint32_t state = 12345;
  auto next = [&] {
    state = state * 1664525u + 1013904223u;
    return state >> 8;
  };
  int opened = 0, rejected = 0;
  for (int round = 0; round < 3000; ++round) {
    std::vector<std::byte> bytes = b.bytes();
    const int changes = 1 + static_cast<int>(next() % 3);
    for (int k = 0; k < changes; ++k) {
      const std::size_t at = next() % bytes.size();
      // mostly small edits (counts and lengths off by a little), sometimes any byte
      bytes[at] =
          next() % 4 == 0
              ? static_cast<std::byte>(next())
              : static_cast<std::byte>(static_cast<unsigned>(bytes[at]) ^ (1u << (next() % 8)));
    }
    const auto path = write_file("mutated.gguf", bytes.data(), bytes.size());
    try {
      const gguf::file f(path);
      ++opened;
      for (const gguf::metadata_entry& e : f.metadata()) {
        try {
          (void)f.describe(e.key);
          if (e.type == value_type::array) {
            if (e.element_type == value_type::string) (void)f.get_string_array(e.key);
            (void)f.get_int_array(e.key);
          } else if (e.type == value_type::string) {
            (void)f.get_string(e.key);
          } else {
            (void)f.get_uint(e.key);
          }
        } catch (const gguf::format_error&) {
        }
      }
      for (const gguf::tensor_info& t : f.tensors()) {
        try {
          const std::vector<float> values = gguf::dequantize(f, t);
          CHECK(values.size() == static_cast<std::size_t>(t.elements()));
        } catch (const gguf::format_error&) {
        } catch (const std::invalid_argument&) {
        }
      }
    } catch (const gguf::format_error&) {
      ++rejected;
    }
  }
  MESSAGE("mutated files: " << opened << " opened, " << rejected << " rejected");
  CHECK(opened > 0);
  CHECK(rejected > 0);
}

TEST_CASE("bad magic and bad versions") {
  gguf_bytes magic;
  magic.put<std::uint32_t>(0x58554747u)
      .put<std::uint32_t>(3)
      .put<std::uint64_t>(0)
      .put<std::uint64_t>(0);
  CHECK_CONTAINS(open_error(magic), "gguf: bad magic at offset 0: 'GGUX', expected 'GGUF'");
  gguf_bytes v1;
  v1.header(0, 0, 1);
  CHECK_CONTAINS(open_error(v1), "unsupported version 1 at offset 4, expected 2 or 3");
  gguf_bytes v4;
  v4.header(0, 0, 4);
  CHECK_CONTAINS(open_error(v4), "unsupported version 4 at offset 4");
  gguf_bytes big_endian;
  big_endian.header(0, 0, 0x03000000u);
  CHECK_CONTAINS(open_error(big_endian), "big-endian");
  gguf_bytes v2;
  v2.header(0, 0, 2);
  CHECK(gguf::file(write_file("v2.gguf", v2)).version() == 2);
}

TEST_CASE("huge counts fail fast, before any allocation") {
  gguf_bytes tensors;
  tensors.header(std::uint64_t{1} << 62, 0);
  REQUIRE(tensors.size() == 24);
  CHECK_CONTAINS(
      open_error(tensors),
      "gguf: tensor count at offset 24 claims 4611686018427387904 entries of at least 24 "
      "bytes each, but only 0 bytes are left");
  gguf_bytes kvs;
  kvs.header(0, std::uint64_t{1} << 60).put<std::uint64_t>(0);
  CHECK_CONTAINS(open_error(kvs), "metadata count at offset 24 claims 1152921504606846976 entries");

  gguf_bytes bytes_array;
  bytes_array.header(0, 1)
      .key("k", value_type::array)
      .array(value_type::u8, std::uint64_t{1} << 60);
  CHECK_CONTAINS(
      open_error(bytes_array),
      "metadata key 0 'k' (array of uint8) at offset 49 claims 1152921504606846976 entries "
      "of at least 1 bytes each, but only 0 bytes are left");
  gguf_bytes strings_array;
  strings_array.header(0, 1).key("k", value_type::array).array(value_type::string, 1000).str("x");
  CHECK_CONTAINS(open_error(strings_array),
                 "claims 1000 entries of at least 8 bytes each, but only 9");
  gguf_bytes nested_array;
  nested_array.header(0, 1)
      .key("k", value_type::array)
      .array(value_type::array, std::uint64_t{1} << 61);
  CHECK_CONTAINS(open_error(nested_array),
                 "(array of array) at offset 49 claims 2305843009213693952");
}

TEST_CASE("lengths beyond the file") {
  gguf_bytes key;
  key.header(0, 1).put<std::uint64_t>(1000000000000ull).put<std::uint64_t>(0).put<std::uint32_t>(0);
  CHECK_CONTAINS(
      open_error(key),
      "gguf: truncated file at offset 32 reading metadata key 0: need 1000000000000 bytes, "
      "12 left");
  gguf_bytes value;
  value.header(0, 1).key("k", value_type::string).put<std::uint64_t>(100).raw("abc", 3);
  CHECK_CONTAINS(
      open_error(value),
      "truncated file at offset 45 reading metadata key 0 'k' (value): need 100 bytes, 3 left");
  gguf_bytes element;
  element.header(0, 1).key("k", value_type::array).array(value_type::string, 2).str("ok");
  element.put<std::uint64_t>(~std::uint64_t{0}).raw("abcdefgh", 8);
  CHECK_CONTAINS(open_error(element),
                 "reading metadata key 0 'k' element 1: need 18446744073709551615 bytes");
  gguf_bytes name;
  name.header(1, 0)
      .put<std::uint64_t>(50)
      .raw("short", 5)
      .put<std::uint64_t>(0)
      .put<std::uint64_t>(0);
  CHECK_CONTAINS(open_error(name), "reading tensor 0 name: need 50 bytes, 21 left");
}

TEST_CASE("malformed metadata") {
  gguf_bytes type;
  type.header(0, 1).key("k", static_cast<value_type>(13)).put<std::uint64_t>(0);
  CHECK_CONTAINS(open_error(type), "metadata key 0 'k' at offset 33 has unknown value type 13");
  gguf_bytes element_type;
  element_type.header(0, 1)
      .key("k", value_type::array)
      .put<std::uint32_t>(99)
      .put<std::uint64_t>(0);
  CHECK_CONTAINS(open_error(element_type), "has unknown array element type 99");
  gguf_bytes duplicate;
  duplicate.header(0, 2)
      .key("k", value_type::u8)
      .put<std::uint8_t>(1)
      .key("k", value_type::u8)
      .put<std::uint8_t>(2);
  CHECK_CONTAINS(open_error(duplicate), "duplicate metadata key 'k' at offset 38");
  gguf_bytes deep;
  deep.header(0, 1).key("k", value_type::array);
  for (int depth = 0; depth < 20; ++depth) deep.array(value_type::array, 1);
  deep.array(value_type::u8, 0);
  CHECK_CONTAINS(open_error(deep), "arrays nested deeper than 16");
  gguf_bytes alignment;
  alignment.header(0, 1).key("general.alignment", value_type::u32).put<std::uint32_t>(24);
  CHECK_CONTAINS(open_error(alignment),
                 "general.alignment at offset 53 is 24, expected a power of two");
  gguf_bytes alignment_type;
  alignment_type.header(0, 1).key("general.alignment", value_type::string).str("32");
  CHECK_CONTAINS(open_error(alignment_type), "'general.alignment' is string, expected an integer");
  gguf_bytes odd_key;
  odd_key.header(0, 1).str(std::string_view("a\nb\x01", 4)).put<std::uint32_t>(77);
  CHECK_CONTAINS(open_error(odd_key),
                 "metadata key 0 'a\\x0ab\\x01' at offset 36 has unknown value type 77");

  // Values checked when read: a bool byte other than 0/1, an integer too big for int32.
  gguf_bytes values;
  values.header(0, 2).key("b", value_type::boolean).put<std::uint8_t>(2);
  values.key("big", value_type::array)
      .array(value_type::u32, 2)
      .put<std::uint32_t>(5)
      .put<std::uint32_t>(3000000000u);
  const gguf::file f(write_file("values.gguf", values));
  CHECK_CONTAINS(error_of([&] { (void)f.get_bool("b"); }),
                 "metadata key 'b' at offset 37 is a bool holding 2");
  CHECK_CONTAINS(error_of([&] { (void)f.get_int_array("big"); }),
                 "metadata key 'big' element 1 (uint32 3000000000) does not fit in int32");
}

TEST_CASE("malformed tensor table") {
  auto one_tensor = [](std::vector<std::uint64_t> dims, std::uint32_t type, std::uint64_t offset,
                       std::size_t data_bytes) {
    gguf_bytes b;
    b.header(1, 0).tensor("t", std::move(dims), type, offset).pad_to(32);
    for (std::size_t i = 0; i < data_bytes; ++i) b.put<std::uint8_t>(0);
    return b;
  };
  // 24 header + 8 + 1 name + 4 n_dims + 8 dim + 4 type + 8 offset = 57, data at 64
  CHECK_CONTAINS(open_error(one_tensor({4}, 0, 64, 16)),
                 "gguf: tensor 't' data [128, 144) lies outside the file (80 bytes)");
  CHECK(gguf::file(write_file("ok.gguf", one_tensor({4}, 0, 0, 16))).tensor("t").offset == 64);
  CHECK_CONTAINS(open_error(one_tensor({4}, 0, ~std::uint64_t{0} - 31, 16)),
                 "offset 18446744073709551584 overflows past the data section at 64");
  CHECK_CONTAINS(open_error(one_tensor({std::uint64_t{1} << 32, std::uint64_t{1} << 32}, 0, 0, 0)),
                 "tensor 0 't' dims [4294967296, 4294967296] at offset 33: the element count "
                 "overflows a 64-bit integer");
  CHECK_CONTAINS(open_error(one_tensor({std::uint64_t{1} << 62}, 0, 0, 0)),
                 "dims [4611686018427387904]: its byte size overflows");
  CHECK_CONTAINS(open_error(one_tensor({4, 0}, 0, 0, 0)),
                 "tensor 0 't' dim 1 at offset 45 is 0, expected a positive 63-bit value");
  CHECK_CONTAINS(open_error(one_tensor({~std::uint64_t{0}}, 0, 0, 0)), "is 18446744073709551615");
  CHECK_CONTAINS(open_error(one_tensor({30}, 8, 0, 64)),
                 "has rows of 30 elements, not a multiple of Q8_0's block of 32");
  CHECK_CONTAINS(open_error(one_tensor({4}, 0, 8, 64)),
                 "tensor 0 't' offset 8 (at offset 49) is not a multiple of the alignment 32");
  gguf_bytes five;
  five.header(1, 0).tensor("t", {1, 1, 1, 1, 1}, 0, 0);
  CHECK_CONTAINS(open_error(five), "tensor 0 't' at offset 33 has 5 dims, at most 4 allowed");
  gguf_bytes twice;
  twice.header(2, 0).tensor("t", {4}, 0, 0).tensor("t", {4}, 0, 32).pad_to(32);
  for (int i = 0; i < 64; ++i) twice.put<std::uint8_t>(0);
  CHECK_CONTAINS(open_error(twice), "duplicate tensor name 't' at offset 57");
}

TEST_CASE("an unknown tensor type is an error only when its data is asked for") {
  gguf_bytes b;
  b.header(2, 0).tensor("odd", {100}, 39, 0).tensor("w", {2}, 0, 0).pad_to(32).put(1.0f).put(2.0f);
  const gguf::file f(write_file("unknown_type.gguf", b));
  const gguf::tensor_info& odd = f.tensor("odd");
  CHECK(static_cast<std::uint32_t>(odd.type) == 39);
  CHECK(odd.bytes == 0);
  CHECK(gguf::type_name(odd.type) == "unknown");
  CHECK_CONTAINS(
      error_of([&] { (void)f.data(odd); }),
      "tensor 'odd' has type 39 (unknown), whose block layout this reader does not know");
  CHECK_THROWS_AS((void)f.data(odd), gguf::format_error);
  CHECK_CONTAINS(error_of([&] { (void)gguf::dequantize(f, odd); }), "type 39 (unknown)");
  CHECK(gguf::dequantize(f, f.tensor("w")) == std::vector<float>{1.0f, 2.0f});
}

TEST_CASE("block layouts and row sizes") {
  CHECK(gguf::block_elements(tensor_type::f32) == 1);
  CHECK(gguf::block_bytes(tensor_type::f32) == 4);
  CHECK(gguf::block_bytes(tensor_type::bf16) == 2);
  CHECK(gguf::block_elements(tensor_type::q8_0) == 32);
  CHECK(gguf::block_bytes(tensor_type::q8_0) == 34);
  CHECK(gguf::block_bytes(tensor_type::q5_0) == 22);
  CHECK(gguf::block_elements(tensor_type::q4_k) == 256);
  CHECK(gguf::block_bytes(tensor_type::q4_k) == 144);
  CHECK(gguf::block_bytes(tensor_type::q6_k) == 210);
  CHECK(gguf::row_bytes(tensor_type::q4_k, 1024) == 576);
  CHECK(gguf::row_bytes(tensor_type::q5_0, 640) == 440);
  CHECK(gguf::row_bytes(tensor_type::f16, 3) == 6);
  CHECK_CONTAINS(error_of([] { (void)gguf::row_bytes(tensor_type::q4_k, 640); }),
                 "a row of 640 elements is not a whole number of Q4_K blocks of 256");
  CHECK_THROWS_AS((void)gguf::block_bytes(static_cast<tensor_type>(5)), std::invalid_argument);
  CHECK(gguf::type_name(tensor_type::q4_k) == "Q4_K");
  CHECK(gguf::type_name(tensor_type::bf16) == "BF16");
  float out[256];
  const std::byte zeros[210] = {};
  CHECK_CONTAINS(error_of([&] { gguf::dequantize_row(tensor_type::q2_k, zeros, out, 256); }),
                 "cannot dequantize Q2_K");
  CHECK_THROWS_AS(gguf::dequantize_row(tensor_type::q6_k, zeros, out, 100), std::invalid_argument);
}

// ---------------------------------------------------------------------------
// Hand-packed blocks. Each test packs chosen quants into the block layout the
// format defines (the encoder's direction, written here independently of the
// decoder) and checks every decoded value against the definition, plus a few
// values worked out by hand.
// ---------------------------------------------------------------------------

namespace {

// Deterministic small integers in [0, range).
class lcg {
 public:
  explicit lcg(std::uint32_t seed) : state_(seed) {}
  int next(int range) {
    state_ = state_ * 1664525u + 1013904223u;
    return static_cast<int>((state_ >> 8) % static_cast<std::uint32_t>(range));
  }

 private:
  std::uint32_t state_;
};

void put_half(std::byte* p, std::uint16_t bits) { std::memcpy(p, &bits, 2); }

}  // namespace

TEST_CASE("F16 and BF16 rows") {
  const std::uint16_t halves[6] = {0x3c00, 0xc000, 0x0001, 0x7bff, 0x8000, 0x7c00};
  float out[6];
  gguf::dequantize_row(tensor_type::f16, reinterpret_cast<const std::byte*>(halves), out, 6);
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -2.0f);
  CHECK(out[2] == 5.9604644775390625e-08f);  // smallest subnormal half, 2^-24
  CHECK(out[3] == 65504.0f);
  CHECK(std::bit_cast<std::uint32_t>(out[4]) == 0x80000000u);  // -0
  CHECK(std::bit_cast<std::uint32_t>(out[5]) == 0x7f800000u);  // +inf
  const std::uint16_t brains[3] = {0x3f80, 0xc040, 0x4049};
  gguf::dequantize_row(tensor_type::bf16, reinterpret_cast<const std::byte*>(brains), out, 3);
  CHECK(out[0] == 1.0f);
  CHECK(out[1] == -3.0f);
  CHECK(std::bit_cast<std::uint32_t>(out[2]) == 0x40490000u);  // 3.140625
}

TEST_CASE("Q8_0: x = q * d") {
  std::byte block[2 * 34];
  lcg rng(1);
  std::int8_t q[64];
  const float d[2] = {0.0078125f, -3.0f};
  for (int k = 0; k < 2; ++k) {
    put_half(block + 34 * k, fp16_bits(d[k]));
    for (int i = 0; i < 32; ++i) q[32 * k + i] = static_cast<std::int8_t>(rng.next(256) - 128);
    std::memcpy(block + 34 * k + 2, q + 32 * k, 32);
  }
  float out[64];
  gguf::dequantize_row(tensor_type::q8_0, block, out, 64);
  for (int i = 0; i < 64; ++i) CHECK(out[i] == static_cast<float>(q[i]) * d[i / 32]);
  // by hand: a -128 in the second block gives -128 * -3 = 384
  q[40] = -128;
  std::memcpy(block + 34 + 2 + 8, &q[40], 1);
  gguf::dequantize_row(tensor_type::q8_0, block, out, 64);
  CHECK(out[40] == 384.0f);
}

TEST_CASE("Q5_0: x = d * (q - 16), 5th bits in qh") {
  lcg rng(2);
  int q[32];
  for (int& v : q) v = rng.next(32);
  q[0] = 31;   // 5th bit set, low nibble 15
  q[17] = 16;  // 5th bit set (bit 17 of qh), high nibble of qs[1] zero
  q[3] = 0;
  std::byte block[22];
  const float d = 0.25f;
  put_half(block, fp16_bits(d));
  std::uint32_t qh = 0;
  for (int i = 0; i < 32; ++i) qh |= static_cast<std::uint32_t>(q[i] >> 4) << i;
  std::memcpy(block + 2, &qh, 4);
  for (int j = 0; j < 16; ++j)
    block[6 + j] = static_cast<std::byte>((q[j] & 15) | ((q[j + 16] & 15) << 4));
  float out[32];
  gguf::dequantize_row(tensor_type::q5_0, block, out, 32);
  for (int i = 0; i < 32; ++i) CHECK(out[i] == d * static_cast<float>(q[i] - 16));
  CHECK(out[0] == 3.75f);  // (31 - 16) * 0.25
  CHECK(out[17] == 0.0f);  // (16 - 16) * 0.25
  CHECK(out[3] == -4.0f);  // (0 - 16) * 0.25
}

TEST_CASE("Q4_K: x = d * scale * q - dmin * min, 6-bit scales and mins") {
  lcg rng(3);
  int scale[8], min[8], q[256];
  for (int j = 0; j < 8; ++j) {
    scale[j] = rng.next(64);
    min[j] = rng.next(64);
  }
  for (int& v : q) v = rng.next(16);
  scale[5] = 37;  // 0b10'0101: low nibble 5 in byte 9, top bits 2 in byte 1
  min[5] = 50;    // 0b11'0010: low nibble 2 in byte 9, top bits 3 in byte 5
  q[5 * 32 + 3] = 9;
  scale[0] = 63;
  min[0] = 0;
  q[0] = 15;
  scale[7] = 63;
  min[7] = 63;
  q[255] = 0;
  const float d = 1.0f, dmin = 0.5f;
  std::byte block[144] = {};
  put_half(block, fp16_bits(d));
  put_half(block + 2, fp16_bits(dmin));
  std::uint8_t s[12];
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<std::uint8_t>((scale[j] & 63) | ((scale[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<std::uint8_t>((min[j] & 63) | ((min[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<std::uint8_t>((scale[j + 4] & 15) | ((min[j + 4] & 15) << 4));
  }
  std::memcpy(block + 4, s, 12);
  for (int g = 0; g < 4; ++g)
    for (int l = 0; l < 32; ++l)
      block[16 + 32 * g + l] = static_cast<std::byte>(q[64 * g + l] | (q[64 * g + 32 + l] << 4));
  float out[256];
  gguf::dequantize_row(tensor_type::q4_k, block, out, 256);
  for (int i = 0; i < 256; ++i) {
    const float want = d * static_cast<float>(scale[i / 32]) * static_cast<float>(q[i]) -
                       dmin * static_cast<float>(min[i / 32]);
    CAPTURE(i);
    CHECK(out[i] == want);
  }
  CHECK(out[5 * 32 + 3] == 308.0f);  // 1 * 37 * 9 - 0.5 * 50
  CHECK(out[0] == 945.0f);           // 63 * 15 - 0
  CHECK(out[255] == -31.5f);         // 63 * 0 - 0.5 * 63
}

TEST_CASE("Q6_K: x = d * scale * (q - 32), 4 low + 2 high bits, int8 scales") {
  lcg rng(4);
  int q[256], scale[16];
  for (int& v : q) v = rng.next(64);
  for (int& v : scale) v = rng.next(256) - 128;
  scale[0] = -128;
  q[0] = 63;  // low nibble 15 in ql[0], high bits 3 in qh[0] bits 0-1
  scale[7] = 5;
  q[113] = 0;  // half 0, value 96 + 17: high nibble of ql[49], bits 6-7 of qh[17]
  scale[15] = 127;
  q[255] = 33;  // half 1, value 96 + 31
  const float d = 0.5f;
  std::byte block[210] = {};
  for (int half = 0; half < 2; ++half) {
    const int* v = q + 128 * half;
    for (int l = 0; l < 32; ++l) {
      block[64 * half + l] = static_cast<std::byte>((v[l] & 15) | ((v[l + 64] & 15) << 4));
      block[64 * half + l + 32] =
          static_cast<std::byte>((v[l + 32] & 15) | ((v[l + 96] & 15) << 4));
      block[128 + 32 * half + l] =
          static_cast<std::byte>((v[l] >> 4) | ((v[l + 32] >> 4) << 2) | ((v[l + 64] >> 4) << 4) |
                                 ((v[l + 96] >> 4) << 6));
    }
  }
  for (int k = 0; k < 16; ++k)
    block[192 + k] = static_cast<std::byte>(static_cast<std::int8_t>(scale[k]));
  put_half(block + 208, fp16_bits(d));
  float out[256];
  gguf::dequantize_row(tensor_type::q6_k, block, out, 256);
  for (int i = 0; i < 256; ++i) {
    CAPTURE(i);
    CHECK(out[i] == d * static_cast<float>(scale[i / 16]) * static_cast<float>(q[i] - 32));
  }
  CHECK(out[0] == -1984.0f);  // 0.5 * -128 * 31
  CHECK(out[113] == -80.0f);  // 0.5 * 5 * -32
  CHECK(out[255] == 63.5f);   // 0.5 * 127 * 1
}

TEST_CASE("dequantize_row decodes consecutive blocks of a longer row") {
  // Two Q4_K blocks with different d: the second block's values use its own header.
  std::byte blocks[288] = {};
  put_half(blocks, fp16_bits(1.0f));
  put_half(blocks + 144, fp16_bits(2.0f));
  blocks[4] = std::byte{1};  // scale 1 for sub-block 0 of each block
  blocks[144 + 4] = std::byte{1};
  blocks[16] = std::byte{7};  // q = 7 for value 0
  blocks[144 + 16] = std::byte{7};
  float out[512];
  gguf::dequantize_row(tensor_type::q4_k, blocks, out, 512);
  CHECK(out[0] == 7.0f);
  CHECK(out[256] == 14.0f);
  CHECK(out[1] == 0.0f);
}
