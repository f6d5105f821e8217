// A reader for GGUF v2/v3 model files (the ggml / llama.cpp container): the
// header, every metadata key/value, the tensor table, and views of each
// tensor's raw bytes inside a read-only memory mapping of the file (or inside
// bytes already in memory).
//
// A malformed file never crashes the reader and never makes it allocate what
// the file merely claims: every read is bounds-checked against the file size,
// every count and length is checked against the bytes left before anything is
// sized by it, and the errors (format_error) name the file offset and the field.
//
// Layout (all little-endian):
//   header    "GGUF", u32 version (2 or 3), u64 tensor_count, u64 kv_count
//   metadata  kv_count x { string key, u32 value_type, value }
//             string = u64 length + bytes (no terminator)
//             array  = u32 element type, u64 count, count elements (may nest)
//   tensors   tensor_count x { string name, u32 n_dims, n_dims x u64 dims
//             (dims[0] varies fastest), u32 tensor_type, u64 offset }
//   padding   up to a multiple of general.alignment (default 32)
//   data      each tensor at data start + its offset (a multiple of the alignment)
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <limits>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lynx_examples::gguf {

// Every multi-byte field is read with memcpy straight into a host integer.
static_assert(std::endian::native == std::endian::little,
              "gguf reader: GGUF files are little-endian and this reader does not swap bytes");

/// Tensor element encodings (ggml's numbering). The reader knows the block
/// layout (elements and bytes per block) of each of these; a file may hold
/// other values, which are kept as they are (see tensor_info::bytes).
enum class tensor_type : std::uint32_t {
  f32 = 0,
  f16 = 1,
  q4_0 = 2,
  q4_1 = 3,
  q5_0 = 6,
  q5_1 = 7,
  q8_0 = 8,
  q8_1 = 9,
  q2_k = 10,
  q3_k = 11,
  q4_k = 12,
  q5_k = 13,
  q6_k = 14,
  q8_k = 15,
  bf16 = 30,
};

namespace detail {

// One row of the block-layout table: a tensor of this type is a sequence of
// blocks, each `bytes` long and holding `elements` values.
struct type_layout {
  tensor_type type;
  std::string_view name;
  std::int64_t elements;
  std::size_t bytes;
};

// Block sizes from the formats' definitions (ggml-common.h's block structs):
// q4_0 = f16 d + 16 nibble bytes; q4_1 adds f16 m; q5_0 = d + 4 bytes of high
// bits + 16; q5_1 adds m; q8_0 = d + 32 int8; q8_1 = d, s (f16) + 32 int8;
// the k-quants hold 256 values: q2_k = 16 scales + 64 + d + dmin; q3_k = 32
// hmask + 64 + 12 scales + d; q4_k = d + dmin + 12 scales + 128; q5_k adds 32 of
// high bits; q6_k = 128 low + 64 high + 16 int8 scales + d; q8_k = f32 d + 256
// int8 + 16 int16 sums. (gguf-py's table says 40 for q8_1, from an older f32
// layout; q8_1 is a dot-product intermediate that no model file stores.)
inline constexpr type_layout type_layouts[] = {
    {tensor_type::f32, "F32", 1, 4},       {tensor_type::f16, "F16", 1, 2},
    {tensor_type::q4_0, "Q4_0", 32, 18},   {tensor_type::q4_1, "Q4_1", 32, 20},
    {tensor_type::q5_0, "Q5_0", 32, 22},   {tensor_type::q5_1, "Q5_1", 32, 24},
    {tensor_type::q8_0, "Q8_0", 32, 34},   {tensor_type::q8_1, "Q8_1", 32, 36},
    {tensor_type::q2_k, "Q2_K", 256, 84},  {tensor_type::q3_k, "Q3_K", 256, 110},
    {tensor_type::q4_k, "Q4_K", 256, 144}, {tensor_type::q5_k, "Q5_K", 256, 176},
    {tensor_type::q6_k, "Q6_K", 256, 210}, {tensor_type::q8_k, "Q8_K", 256, 292},
    {tensor_type::bf16, "BF16", 1, 2},
};

inline const type_layout* find_layout(tensor_type t) {
  for (const auto& layout : type_layouts)
    if (layout.type == t) return &layout;
  return nullptr;
}

inline std::string type_label(tensor_type t) {
  const type_layout* layout = find_layout(t);
  if (layout != nullptr) return std::string(layout->name);
  return "type " + std::to_string(static_cast<std::uint32_t>(t)) + " (unknown)";
}

}  // namespace detail

/// The type's name as gguf-py spells it ("F32", "Q4_K", ...); "unknown" for a
/// value outside the enumeration.
inline std::string_view type_name(tensor_type t) {
  const detail::type_layout* layout = detail::find_layout(t);
  return layout != nullptr ? layout->name : std::string_view("unknown");
}

/// True for the types whose block layout this reader knows (the enumerators).
inline bool is_known(tensor_type t) { return detail::find_layout(t) != nullptr; }

/// Values per block: 1 for F32/F16/BF16, 32 for the *_0/*_1 types, 256 for the
/// k-quants. Throws std::invalid_argument for an unknown type.
inline std::int64_t block_elements(tensor_type t) {
  const detail::type_layout* layout = detail::find_layout(t);
  if (layout == nullptr)
    throw std::invalid_argument("gguf: no block layout for " + detail::type_label(t));
  return layout->elements;
}

/// Bytes per block. Throws std::invalid_argument for an unknown type.
inline std::size_t block_bytes(tensor_type t) {
  const detail::type_layout* layout = detail::find_layout(t);
  if (layout == nullptr)
    throw std::invalid_argument("gguf: no block layout for " + detail::type_label(t));
  return layout->bytes;
}

/// Metadata value types (GGUF's numbering).
enum class value_type : std::uint32_t {
  u8 = 0,
  i8 = 1,
  u16 = 2,
  i16 = 3,
  u32 = 4,
  i32 = 5,
  f32 = 6,
  boolean = 7,
  string = 8,
  array = 9,
  u64 = 10,
  i64 = 11,
  f64 = 12,
};

/// The eight integer types (the ones integer() and integer_array() read).
inline bool is_integer(value_type t) {
  switch (t) {
    case value_type::u8:
    case value_type::i8:
    case value_type::u16:
    case value_type::i16:
    case value_type::u32:
    case value_type::i32:
    case value_type::u64:
    case value_type::i64:
      return true;
    default:
      return false;
  }
}

inline std::string_view value_type_name(value_type t) {
  switch (t) {
    case value_type::u8:
      return "uint8";
    case value_type::i8:
      return "int8";
    case value_type::u16:
      return "uint16";
    case value_type::i16:
      return "int16";
    case value_type::u32:
      return "uint32";
    case value_type::i32:
      return "int32";
    case value_type::f32:
      return "float32";
    case value_type::boolean:
      return "bool";
    case value_type::string:
      return "string";
    case value_type::array:
      return "array";
    case value_type::u64:
      return "uint64";
    case value_type::i64:
      return "int64";
    case value_type::f64:
      return "float64";
  }
  return "unknown";
}

/// A malformed or unusable file. The message says what was wrong, where
/// (file offset and field) and with which values; offset() gives the offset
/// when the problem has one place in the file.
class format_error : public std::runtime_error {
 public:
  format_error(const std::string& message, std::optional<std::uint64_t> offset)
      : std::runtime_error(message), offset_(offset) {}
  [[nodiscard]] std::optional<std::uint64_t> offset() const noexcept { return offset_; }

 private:
  std::optional<std::uint64_t> offset_;
};

/// One entry of the tensor table.
struct tensor_info {
  std::string name;
  std::vector<std::int64_t> dims;  // dims[0] = row length (varies fastest); each >= 1
  tensor_type type{};
  std::uint64_t offset = 0;  // absolute file offset of the first byte
  std::uint64_t bytes = 0;   // size of the data; 0 when the type is unknown to the reader

  /// Product of the dims (checked at load not to overflow).
  [[nodiscard]] std::int64_t elements() const {
    std::int64_t n = 1;
    for (std::int64_t d : dims) n *= d;
    return n;
  }
  [[nodiscard]] std::int64_t row_length() const { return dims.empty() ? 1 : dims[0]; }
  [[nodiscard]] std::int64_t rows() const { return elements() / row_length(); }
};

/// One metadata key/value, as located in the file (values are read on demand).
struct metadata_entry {
  std::string_view key;  // view into the mapping
  value_type type{};
  value_type element_type{};  // arrays: the elements' type; otherwise equal to type
  std::uint64_t count = 1;    // arrays: the number of elements; otherwise 1
  std::uint64_t offset = 0;   // absolute offset of the value (arrays: of the first element)
  std::uint64_t end = 0;      // one past the value's last byte
};

namespace detail {

// A read-only mapping of a whole file, or a view of bytes the caller owns
// (file's in-memory constructor). Move-only; unmaps on destruction what it mapped.
class mapping {
 public:
  mapping() = default;
  // Borrows the bytes: nothing is copied or unmapped.
  explicit mapping(std::span<const std::byte> bytes)
      : data_(bytes.empty() ? nullptr : bytes.data()), size_(bytes.size()), owned_(false) {}
  explicit mapping(const std::filesystem::path& path) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      throw std::system_error(errno, std::generic_category(),
                              "gguf: cannot open '" + path.string() + "'");
    struct ::stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw std::system_error(e, std::generic_category(),
                              "gguf: cannot stat '" + path.string() + "'");
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd);
      throw std::system_error(EINVAL, std::generic_category(),
                              "gguf: '" + path.string() + "' is not a regular file");
    }
    size_ = static_cast<std::uint64_t>(st.st_size);
    if (size_ > 0) {  // mmap refuses a length of 0; an empty file maps to nothing
      void* p = ::mmap(nullptr, static_cast<std::size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
      if (p == MAP_FAILED) {
        const int e = errno;
        ::close(fd);
        throw std::system_error(
            e, std::generic_category(),
            "gguf: cannot map '" + path.string() + "' (" + std::to_string(size_) + " bytes)");
      }
      data_ = static_cast<const std::byte*>(p);
    }
    ::close(fd);  // the mapping keeps the file's pages reachable on its own
  }
  mapping(const mapping&) = delete;
  mapping& operator=(const mapping&) = delete;
  mapping(mapping&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        owned_(std::exchange(other.owned_, true)) {}
  mapping& operator=(mapping&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      owned_ = std::exchange(other.owned_, true);
    }
    return *this;
  }
  ~mapping() { release(); }

  [[nodiscard]] const std::byte* data() const { return data_; }
  [[nodiscard]] std::uint64_t size() const { return size_; }

 private:
  void release() {
    if (data_ != nullptr && owned_)
      ::munmap(const_cast<std::byte*>(data_), static_cast<std::size_t>(size_));
    data_ = nullptr;
  }
  const std::byte* data_ = nullptr;
  std::uint64_t size_ = 0;
  bool owned_ = true;  // false: borrowed bytes, not ours to unmap
};

// A non-owning reference to a callable that names a field. Field names are
// built only when an error is thrown, so the 262,144-string tokenizer arrays
// cost no string formatting; type-erased so that nested arrays can recurse.
class field_ref {
 public:
  template <class F>
  requires(!std::is_same_v<std::remove_cvref_t<F>, field_ref>)
      field_ref(const F& f)  // NOLINT: implicit on purpose, lambdas are passed directly
      : object_(&f),
        call_([](const void* o) { return std::string((*static_cast<const F*>(o))()); }) {}
  [[nodiscard]] std::string operator()() const { return call_(object_); }

 private:
  const void* object_;
  std::string (*call_)(const void*);
};

// Quotes a name from the file for a message: printable ASCII as is, anything
// else as \xNN, cut after 120 bytes (a key is untrusted data).
inline std::string quoted(std::string_view s) {
  std::string out = "'";
  const std::size_t shown = s.size() < 120 ? s.size() : 120;
  for (std::size_t i = 0; i < shown; ++i) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    }
  }
  if (shown < s.size()) out += "...";
  out += "'";
  return out;
}

// Fixed byte size of a scalar value type; 0 for string and array.
constexpr std::uint64_t scalar_size(value_type t) {
  switch (t) {
    case value_type::u8:
    case value_type::i8:
    case value_type::boolean:
      return 1;
    case value_type::u16:
    case value_type::i16:
      return 2;
    case value_type::u32:
    case value_type::i32:
    case value_type::f32:
      return 4;
    case value_type::u64:
    case value_type::i64:
    case value_type::f64:
      return 8;
    case value_type::string:
    case value_type::array:
      return 0;
  }
  return 0;
}

constexpr bool valid_value_type(std::uint32_t t) { return t <= 12; }

// The smallest encoding of one value of a type: strings are at least their
// 8-byte length, arrays their 4-byte type and 8-byte count. Used to reject a
// count before walking (or sizing anything by) it.
constexpr std::uint64_t min_value_size(value_type t) {
  if (t == value_type::string) return 8;
  if (t == value_type::array) return 12;
  return scalar_size(t);
}

// Nested arrays recurse; a hostile file must not be able to exhaust the stack.
inline constexpr int max_array_depth = 16;

// Bounds-checked reading position in the mapping.
class cursor {
 public:
  cursor(const std::byte* base, std::uint64_t size, const std::string& where)
      : base_(base), size_(size), where_(where) {}

  [[nodiscard]] std::uint64_t pos() const { return pos_; }
  [[nodiscard]] std::uint64_t left() const { return size_ - pos_; }

  // Throws unless n more bytes are there.
  void need(std::uint64_t n, field_ref field) const {
    if (n > left())
      throw format_error("gguf: truncated file at offset " + std::to_string(pos_) + " reading " +
                             field() + ": need " + std::to_string(n) + " bytes, " +
                             std::to_string(left()) + " left" + where_,
                         pos_);
  }

  // Throws unless `count` elements of at least `each` bytes can fit in what is left.
  void need_elements(std::uint64_t count, std::uint64_t each, field_ref field) const {
    if (each != 0 && count > left() / each)
      throw format_error("gguf: " + field() + " at offset " + std::to_string(pos_) + " claims " +
                             std::to_string(count) + " entries of at least " +
                             std::to_string(each) + " bytes each, but only " +
                             std::to_string(left()) + " bytes are left in the file" + where_,
                         pos_);
  }

  template <class T>
  T read(field_ref field) {
    need(sizeof(T), field);
    T value;
    std::memcpy(&value, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return value;
  }

  // A GGUF string: u64 length, then the bytes. `field` names the string; the
  // length is reported as "<field> (length)".
  std::string_view read_string(field_ref field) {
    const auto length = read<std::uint64_t>([&] { return field() + " (length)"; });
    need(length, field);
    const std::string_view s(reinterpret_cast<const char*>(base_ + pos_),
                             static_cast<std::size_t>(length));
    pos_ += length;
    return s;
  }

  void skip(std::uint64_t n, field_ref field) {
    need(n, field);
    pos_ += n;
  }

  // Walks one value of type t (already read), checking every length.
  void skip_value(value_type t, field_ref field, int depth) {
    if (t == value_type::string) {
      read_string(field);
    } else if (t == value_type::array) {
      const auto [element, count] = read_array_header(field, depth);
      skip_elements(element, count, field, depth);
    } else {
      skip(scalar_size(t), field);
    }
  }

  // An array's element type and count, checked: the type must be known, the
  // nesting not too deep, and count elements must fit in what is left.
  std::pair<value_type, std::uint64_t> read_array_header(field_ref field, int depth) {
    const std::uint64_t at = pos_;
    if (depth >= max_array_depth)
      throw format_error("gguf: " + field() + " at offset " + std::to_string(at) +
                             ": arrays nested deeper than " + std::to_string(max_array_depth) +
                             where_,
                         at);
    const auto raw = read<std::uint32_t>([&] { return field() + " (array element type)"; });
    if (!valid_value_type(raw))
      throw format_error("gguf: " + field() + " at offset " + std::to_string(at) +
                             " has unknown array element type " + std::to_string(raw) + where_,
                         at);
    const auto element = static_cast<value_type>(raw);
    const auto count = read<std::uint64_t>([&] { return field() + " (array count)"; });
    need_elements(count, min_value_size(element), [&] {
      return field() + " (array of " + std::string(value_type_name(element)) + ")";
    });
    return {element, count};
  }

  void skip_elements(value_type element, std::uint64_t count, field_ref field, int depth) {
    if (element != value_type::string && element != value_type::array) {
      pos_ += count * scalar_size(element);  // need_elements checked count * size <= left
      return;
    }
    for (std::uint64_t k = 0; k < count; ++k)
      skip_value(
          element, [&] { return field() + " element " + std::to_string(k); }, depth + 1);
  }

 private:
  const std::byte* base_;
  std::uint64_t size_;
  std::uint64_t pos_ = 0;
  const std::string& where_;  // " (in <path>)", appended to every message
};

template <class T>
T load(const std::byte* p) {
  T value;
  std::memcpy(&value, p, sizeof(T));
  return value;
}

}  // namespace detail

/// A GGUF file, mapped read-only for the reader's lifetime (or bytes in memory,
/// read in place). Move-only. Views handed out (strings, string arrays, tensor
/// data) point into the mapping and stay valid as long as the file object (or
/// the one it was moved into) lives.
class file {
 public:
  explicit file(const std::filesystem::path& path)
      : path_(path), where_(" (in " + path.string() + ")"), map_(path) {
    parse();
  }
  /// A GGUF file already in memory, read in place (nothing is copied): the
  /// bytes must stay alive and unchanged as long as this object (and the views
  /// it hands out) live. `name` stands for the path in messages and path().
  /// Same checks and errors as reading from a path.
  file(std::span<const std::byte> bytes, const std::string& name)
      : path_(name), where_(" (in " + name + ")"), map_(bytes) {
    parse();
  }
  file(const file&) = delete;
  file& operator=(const file&) = delete;
  file(file&&) noexcept = default;
  file& operator=(file&&) noexcept = default;
  ~file() = default;

  [[nodiscard]] std::uint32_t version() const { return version_; }
  [[nodiscard]] std::uint64_t size() const { return map_.size(); }
  [[nodiscard]] const std::filesystem::path& path() const { return path_; }
  /// general.alignment, or 32 when absent.
  [[nodiscard]] std::uint64_t alignment() const { return alignment_; }
  /// Absolute offset of the data section (tensor offsets in the file are relative to it).
  [[nodiscard]] std::uint64_t data_offset() const { return data_offset_; }

  // ----- metadata -----------------------------------------------------------

  [[nodiscard]] bool has(std::string_view key) const { return key_index_.contains(key); }

  /// All entries, in file order.
  [[nodiscard]] const std::vector<metadata_entry>& metadata() const { return metadata_; }
  [[nodiscard]] const metadata_entry* find_entry(std::string_view key) const {
    const auto it = key_index_.find(key);
    return it == key_index_.end() ? nullptr : &metadata_[it->second];
  }
  /// The entry; throws format_error naming the key when it is absent.
  [[nodiscard]] const metadata_entry& entry(std::string_view key) const {
    const metadata_entry* e = find_entry(key);
    if (e == nullptr)
      throw format_error("gguf: no metadata key " + detail::quoted(key) + where_, std::nullopt);
    return *e;
  }

  [[nodiscard]] std::vector<std::string> keys() const {
    std::vector<std::string> out;
    out.reserve(metadata_.size());
    for (const auto& e : metadata_) out.emplace_back(e.key);
    return out;
  }

  /// Any integer type holding a non-negative value.
  [[nodiscard]] std::uint64_t get_uint(std::string_view key) const {
    const metadata_entry& e = entry(key);
    if (!is_integer(e.type)) throw wrong_type(e, "an integer");
    const auto [value, negative] = integer_at(e.type, map_.data() + e.offset);
    if (negative)
      throw format_error("gguf: metadata key " + detail::quoted(e.key) + " is " +
                             std::string(value_type_name(e.type)) + " -" + std::to_string(value) +
                             ", expected a non-negative integer" + where_,
                         e.offset);
    return value;
  }
  /// nullopt when absent; throws (as get_uint) when present with another type.
  [[nodiscard]] std::optional<std::uint64_t> find_uint(std::string_view key) const {
    if (!has(key)) return std::nullopt;
    return get_uint(key);
  }

  /// float32 or float64.
  [[nodiscard]] double get_float(std::string_view key) const {
    const metadata_entry& e = entry(key);
    if (e.type == value_type::f32) return detail::load<float>(map_.data() + e.offset);
    if (e.type == value_type::f64) return detail::load<double>(map_.data() + e.offset);
    throw wrong_type(e, "a float32 or float64");
  }
  [[nodiscard]] std::optional<double> find_float(std::string_view key) const {
    if (!has(key)) return std::nullopt;
    return get_float(key);
  }

  /// bool (stored as one byte, 0 or 1; any other byte is an error).
  [[nodiscard]] bool get_bool(std::string_view key) const {
    const metadata_entry& e = entry(key);
    if (e.type != value_type::boolean) throw wrong_type(e, "a bool");
    const auto b = detail::load<std::uint8_t>(map_.data() + e.offset);
    if (b > 1)
      throw format_error("gguf: metadata key " + detail::quoted(e.key) + " at offset " +
                             std::to_string(e.offset) + " is a bool holding " + std::to_string(b) +
                             ", not 0 or 1" + where_,
                         e.offset);
    return b == 1;
  }
  [[nodiscard]] std::optional<bool> find_bool(std::string_view key) const {
    if (!has(key)) return std::nullopt;
    return get_bool(key);
  }

  /// A view into the mapping (not NUL-terminated).
  [[nodiscard]] std::string_view get_string(std::string_view key) const {
    const metadata_entry& e = entry(key);
    if (e.type != value_type::string) throw wrong_type(e, "a string");
    return string_at(e.offset);
  }
  [[nodiscard]] std::optional<std::string_view> find_string(std::string_view key) const {
    if (!has(key)) return std::nullopt;
    return get_string(key);
  }

  /// An array of strings, as views into the mapping.
  [[nodiscard]] std::vector<std::string_view> get_string_array(std::string_view key) const {
    const metadata_entry& e = array_entry(key, value_type::string, "an array of string");
    std::vector<std::string_view> out;
    out.reserve(static_cast<std::size_t>(e.count));  // count * 8 <= file size, checked at load
    std::uint64_t at = e.offset;
    for (std::uint64_t k = 0; k < e.count; ++k) {
      const std::string_view s = string_at(at);
      out.push_back(s);
      at += 8 + s.size();
    }
    return out;
  }

  /// An array of float32 (float64 elements are narrowed to float).
  [[nodiscard]] std::vector<float> get_float_array(std::string_view key) const {
    const metadata_entry& e = entry(key);
    if (e.type != value_type::array ||
        (e.element_type != value_type::f32 && e.element_type != value_type::f64))
      throw wrong_type(e, "an array of float32");
    std::vector<float> out(static_cast<std::size_t>(e.count));
    const std::byte* p = map_.data() + e.offset;
    if (e.element_type == value_type::f32) {
      if (!out.empty()) std::memcpy(out.data(), p, out.size() * sizeof(float));
    } else {
      for (std::size_t k = 0; k < out.size(); ++k)
        out[k] = static_cast<float>(detail::load<double>(p + 8 * k));
    }
    return out;
  }

  /// An array of any integer type whose every element fits in int32.
  [[nodiscard]] std::vector<std::int32_t> get_int_array(std::string_view key) const {
    const metadata_entry& e = entry(key);
    if (e.type != value_type::array || !is_integer(e.element_type))
      throw wrong_type(e, "an array of integers");
    std::vector<std::int32_t> out(static_cast<std::size_t>(e.count));
    if (e.element_type == value_type::i32) {
      if (!out.empty()) std::memcpy(out.data(), map_.data() + e.offset, out.size() * 4);
      return out;
    }
    const std::uint64_t size = detail::scalar_size(e.element_type);
    for (std::size_t k = 0; k < out.size(); ++k) {
      const std::byte* p = map_.data() + e.offset + size * k;
      const auto [value, negative] = integer_at(e.element_type, p);
      const bool fits = negative ? value <= std::uint64_t{1} << 31
                                 : value <= static_cast<std::uint64_t>(INT32_MAX);
      if (!fits)
        throw format_error(
            "gguf: metadata key " + detail::quoted(e.key) + " element " + std::to_string(k) + " (" +
                std::string(value_type_name(e.element_type)) + (negative ? " -" : " ") +
                std::to_string(value) + ") does not fit in int32" + where_,
            e.offset + size * k);
      out[k] = negative ? static_cast<std::int32_t>(-static_cast<std::int64_t>(value))
                        : static_cast<std::int32_t>(value);
    }
    return out;
  }

  /// The value as text, for listings: strings quoted, arrays as their first
  /// max_elements elements and their count.
  [[nodiscard]] std::string describe(std::string_view key, std::size_t max_elements = 8) const {
    const metadata_entry& e = entry(key);
    std::uint64_t at = e.offset;
    if (e.type != value_type::array) return describe_value(e.type, at);
    return describe_array(e.element_type, e.count, at, max_elements);
  }

  // ----- tensors ------------------------------------------------------------

  [[nodiscard]] const std::vector<tensor_info>& tensors() const { return tensors_; }
  [[nodiscard]] const tensor_info* find_tensor(std::string_view name) const {
    const auto it = tensor_index_.find(name);
    return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
  }
  /// Throws format_error naming the tensor when there is none of that name.
  [[nodiscard]] const tensor_info& tensor(std::string_view name) const {
    const tensor_info* t = find_tensor(name);
    if (t == nullptr)
      throw format_error("gguf: no tensor " + detail::quoted(name) + " among the " +
                             std::to_string(tensors_.size()) + " tensors" + where_,
                         std::nullopt);
    return *t;
  }

  /// The tensor's raw bytes. Throws format_error when its type is unknown to
  /// the reader (its size cannot be known) or its range is not in the file.
  [[nodiscard]] std::span<const std::byte> data(const tensor_info& t) const {
    if (!is_known(t.type))
      throw format_error("gguf: tensor " + detail::quoted(t.name) + " has " +
                             detail::type_label(t.type) +
                             ", whose block layout this reader does not know, so its data "
                             "cannot be located" +
                             where_,
                         t.offset);
    if (t.offset > size() || t.bytes > size() - t.offset) throw outside(t.name, t.offset, t.bytes);
    return {map_.data() + t.offset, static_cast<std::size_t>(t.bytes)};
  }

 private:
  // Magnitude and sign of an integer value of type t at p.
  static std::pair<std::uint64_t, bool> integer_at(value_type t, const std::byte* p) {
    auto signed_value = [](std::int64_t v) {
      return v < 0 ? std::pair{static_cast<std::uint64_t>(-(v + 1)) + 1, true}
                   : std::pair{static_cast<std::uint64_t>(v), false};
    };
    switch (t) {
      case value_type::u8:
        return {detail::load<std::uint8_t>(p), false};
      case value_type::u16:
        return {detail::load<std::uint16_t>(p), false};
      case value_type::u32:
        return {detail::load<std::uint32_t>(p), false};
      case value_type::u64:
        return {detail::load<std::uint64_t>(p), false};
      case value_type::i8:
        return signed_value(detail::load<std::int8_t>(p));
      case value_type::i16:
        return signed_value(detail::load<std::int16_t>(p));
      case value_type::i32:
        return signed_value(detail::load<std::int32_t>(p));
      case value_type::i64:
        return signed_value(detail::load<std::int64_t>(p));
      default:
        return {0, false};
    }
  }

  format_error wrong_type(const metadata_entry& e, std::string_view expected) const {
    std::string found(value_type_name(e.type));
    if (e.type == value_type::array) found += " of " + std::string(value_type_name(e.element_type));
    return format_error("gguf: metadata key " + detail::quoted(e.key) + " is " + found +
                            ", expected " + std::string(expected) + where_,
                        e.offset);
  }

  const metadata_entry& array_entry(std::string_view key, value_type element,
                                    std::string_view expected) const {
    const metadata_entry& e = entry(key);
    if (e.type != value_type::array || e.element_type != element) throw wrong_type(e, expected);
    return e;
  }

  // A string validated at load: u64 length at `at`, then the bytes.
  [[nodiscard]] std::string_view string_at(std::uint64_t at) const {
    const auto length = detail::load<std::uint64_t>(map_.data() + at);
    return {reinterpret_cast<const char*>(map_.data() + at + 8), static_cast<std::size_t>(length)};
  }

  format_error outside(const std::string& name, std::uint64_t begin, std::uint64_t bytes) const {
    const std::string end = bytes > std::numeric_limits<std::uint64_t>::max() - begin
                                ? "overflow"
                                : std::to_string(begin + bytes);
    return format_error("gguf: tensor " + detail::quoted(name) + " data [" + std::to_string(begin) +
                            ", " + end + ") lies outside the file (" + std::to_string(size()) +
                            " bytes)" + where_,
                        begin);
  }

  // Values validated at load, rendered for describe().
  std::string describe_value(value_type t, std::uint64_t& at) const {
    const std::byte* p = map_.data() + at;
    std::string out;
    switch (t) {
      case value_type::f32:
        out = std::to_string(detail::load<float>(p));
        break;
      case value_type::f64:
        out = std::to_string(detail::load<double>(p));
        break;
      case value_type::boolean:
        out = detail::load<std::uint8_t>(p) != 0 ? "true" : "false";
        break;
      case value_type::string: {
        const std::string_view s = string_at(at);
        at += 8 + s.size();
        return detail::quoted(s.substr(0, 80)) + (s.size() > 80 ? "..." : "");
      }
      default: {
        const auto [value, negative] = integer_at(t, p);
        // (sign inserted, not "-" + string: GCC 12 -O3 gives a false -Wrestrict on that)
        out = std::to_string(value);
        if (negative) out.insert(out.begin(), '-');
      }
    }
    at += detail::scalar_size(t);
    return out;
  }

  std::string describe_array(value_type element, std::uint64_t count, std::uint64_t& at,
                             std::size_t max_elements) const {
    std::string out = "[";
    for (std::uint64_t k = 0; k < count; ++k) {
      const bool shown = k < max_elements;
      std::string item;
      if (element == value_type::array) {
        const auto inner = static_cast<value_type>(detail::load<std::uint32_t>(map_.data() + at));
        const auto n = detail::load<std::uint64_t>(map_.data() + at + 4);
        at += 12;
        item = describe_array(inner, n, at, max_elements);
      } else if (!shown && element != value_type::string) {
        at += detail::scalar_size(element) * (count - k);  // skip the rest at once
        break;
      } else {
        item = describe_value(element, at);
      }
      if (shown) out += (k == 0 ? "" : ", ") + item;
    }
    if (count > max_elements) out += ", ...";
    out += "] (" + std::to_string(count) + " " + std::string(value_type_name(element)) + ")";
    return out;
  }

  void parse() {
    detail::cursor c(map_.data(), map_.size(), where_);

    // --- header
    const auto magic = c.read<std::uint32_t>([] { return "magic"; });
    constexpr std::uint32_t gguf_magic = 0x46554747u;  // "GGUF" read little-endian
    if (magic != gguf_magic) {
      char shown[4];
      std::memcpy(shown, &magic, 4);
      throw format_error(
          "gguf: bad magic at offset 0: " + detail::quoted(std::string_view(shown, 4)) +
              ", expected 'GGUF'" + where_,
          0);
    }
    version_ = c.read<std::uint32_t>([] { return "version"; });
    if (version_ != 2 && version_ != 3) {
      std::string hint;
      if (version_ == 1)
        hint = " (version 1, with 32-bit counts, predates GGUF v2 and is not read)";
      if ((version_ & 0xffffu) == 0 && version_ != 0)
        hint = " (looks like a big-endian file, which this reader does not read)";
      throw format_error("gguf: unsupported version " + std::to_string(version_) +
                             " at offset 4, expected 2 or 3" + hint + where_,
                         4);
    }
    const auto tensor_count = c.read<std::uint64_t>([] { return "tensor count"; });
    const auto kv_count = c.read<std::uint64_t>([] { return "metadata count"; });

    // Fail fast on counts that cannot fit: a key/value takes at least 13 bytes
    // (length 8, type 4, a 1-byte value), a tensor entry at least 24 (name
    // length 8, n_dims 4, type 4, offset 8).
    c.need_elements(kv_count, 13, [] { return std::string("metadata count"); });
    c.need_elements(tensor_count, 24, [] { return std::string("tensor count"); });

    // --- metadata (nothing sized by kv_count: entries grow as they are read)
    for (std::uint64_t i = 0; i < kv_count; ++i) {
      const std::uint64_t key_at = c.pos();
      const std::string_view key =
          c.read_string([&] { return "metadata key " + std::to_string(i); });
      auto named = [&] { return "metadata key " + std::to_string(i) + " " + detail::quoted(key); };
      if (key_index_.contains(key))
        throw format_error("gguf: duplicate metadata key " + detail::quoted(key) + " at offset " +
                               std::to_string(key_at) + where_,
                           key_at);
      const std::uint64_t type_at = c.pos();
      const auto raw_type = c.read<std::uint32_t>([&] { return named() + " (type)"; });
      if (!detail::valid_value_type(raw_type))
        throw format_error("gguf: " + named() + " at offset " + std::to_string(type_at) +
                               " has unknown value type " + std::to_string(raw_type) + where_,
                           type_at);
      metadata_entry e;
      e.key = key;
      e.type = static_cast<value_type>(raw_type);
      e.element_type = e.type;
      if (e.type == value_type::array) {
        const auto [element, count] = c.read_array_header(named, 0);
        e.element_type = element;
        e.count = count;
        e.offset = c.pos();
        c.skip_elements(element, count, named, 0);
      } else {
        e.offset = c.pos();
        c.skip_value(
            e.type, [&] { return named() + " (value)"; }, 0);
      }
      e.end = c.pos();
      key_index_.emplace(key, metadata_.size());
      metadata_.push_back(e);
    }

    // --- alignment of the data section and of every tensor in it
    if (const metadata_entry* e = find_entry("general.alignment")) {
      if (!is_integer(e->type)) throw wrong_type(*e, "an integer");
      alignment_ = get_uint("general.alignment");
      if (alignment_ == 0 || !std::has_single_bit(alignment_) || alignment_ > (1u << 30))
        throw format_error("gguf: general.alignment at offset " + std::to_string(e->offset) +
                               " is " + std::to_string(alignment_) +
                               ", expected a power of two in [1, 2^30]" + where_,
                           e->offset);
    }

    // --- tensor table
    for (std::uint64_t i = 0; i < tensor_count; ++i) {
      const std::uint64_t entry_at = c.pos();
      const std::string_view name =
          c.read_string([&] { return "tensor " + std::to_string(i) + " name"; });
      auto named = [&] { return "tensor " + std::to_string(i) + " " + detail::quoted(name); };
      if (tensor_index_.contains(name))
        throw format_error("gguf: duplicate tensor name " + detail::quoted(name) + " at offset " +
                               std::to_string(entry_at) + where_,
                           entry_at);
      const std::uint64_t dims_at = c.pos();
      const auto n_dims = c.read<std::uint32_t>([&] { return named() + " (n_dims)"; });
      constexpr std::uint32_t max_dims = 4;  // ggml's GGML_MAX_DIMS
      if (n_dims > max_dims)
        throw format_error("gguf: " + named() + " at offset " + std::to_string(dims_at) + " has " +
                               std::to_string(n_dims) + " dims, at most " +
                               std::to_string(max_dims) + " allowed" + where_,
                           dims_at);
      tensor_info t;
      t.name = std::string(name);
      t.dims.reserve(n_dims);
      std::int64_t elements = 1;
      for (std::uint32_t k = 0; k < n_dims; ++k) {
        const std::uint64_t dim_at = c.pos();
        const auto d =
            c.read<std::uint64_t>([&] { return named() + " (dim " + std::to_string(k) + ")"; });
        if (d == 0 || d > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
          throw format_error("gguf: " + named() + " dim " + std::to_string(k) + " at offset " +
                                 std::to_string(dim_at) + " is " + std::to_string(d) +
                                 ", expected a positive 63-bit value" + where_,
                             dim_at);
        t.dims.push_back(static_cast<std::int64_t>(d));
        if (__builtin_mul_overflow(elements, static_cast<std::int64_t>(d), &elements))
          throw format_error("gguf: " + named() + " dims " + dims_text(t.dims) + " at offset " +
                                 std::to_string(dims_at) +
                                 ": the element count overflows a 64-bit integer" + where_,
                             dims_at);
      }
      const std::uint64_t type_at = c.pos();
      t.type = static_cast<tensor_type>(c.read<std::uint32_t>([&] { return named() + " (type)"; }));
      const std::uint64_t offset_at = c.pos();
      const auto relative = c.read<std::uint64_t>([&] { return named() + " (offset)"; });
      if (relative % alignment_ != 0)
        throw format_error("gguf: " + named() + " offset " + std::to_string(relative) +
                               " (at offset " + std::to_string(offset_at) +
                               ") is not a multiple of the alignment " +
                               std::to_string(alignment_) + where_,
                           offset_at);
      if (const detail::type_layout* layout = detail::find_layout(t.type)) {
        if (t.row_length() % layout->elements != 0)
          throw format_error("gguf: " + named() + " (at offset " + std::to_string(type_at) +
                                 ") has rows of " + std::to_string(t.row_length()) +
                                 " elements, not a multiple of " + std::string(layout->name) +
                                 "'s block of " + std::to_string(layout->elements) + where_,
                             type_at);
        const auto blocks = static_cast<std::uint64_t>(elements / layout->elements);
        if (__builtin_mul_overflow(blocks, static_cast<std::uint64_t>(layout->bytes), &t.bytes))
          throw format_error("gguf: " + named() + " dims " + dims_text(t.dims) +
                                 ": its byte size overflows a 64-bit integer" + where_,
                             dims_at);
      }
      t.offset = relative;  // made absolute below, once the data section's start is known
      tensor_index_.emplace(name, tensors_.size());
      tensors_.push_back(std::move(t));
    }

    // --- data section: after the table, padded to the alignment. Every
    // tensor of a known type must lie inside the file.
    const std::uint64_t table_end = c.pos();
    data_offset_ = (table_end + alignment_ - 1) / alignment_ * alignment_;
    for (tensor_info& t : tensors_) {
      const std::uint64_t relative = t.offset;
      if (relative > std::numeric_limits<std::uint64_t>::max() - data_offset_)
        throw format_error("gguf: tensor " + detail::quoted(t.name) + " offset " +
                               std::to_string(relative) + " overflows past the data section at " +
                               std::to_string(data_offset_) + where_,
                           data_offset_);
      t.offset = data_offset_ + relative;
      if (is_known(t.type) && (t.offset > size() || t.bytes > size() - t.offset))
        throw outside(t.name, t.offset, t.bytes);
    }
  }

  static std::string dims_text(const std::vector<std::int64_t>& dims) {
    std::string out = "[";
    for (std::size_t k = 0; k < dims.size(); ++k)
      out += (k == 0 ? "" : ", ") + std::to_string(dims[k]);
    return out + "]";
  }

  std::filesystem::path path_;
  std::string where_;  // " (in <path>)", the end of every message
  detail::mapping map_;
  std::uint32_t version_ = 0;
  std::uint64_t alignment_ = 32;
  std::uint64_t data_offset_ = 0;
  std::vector<metadata_entry> metadata_;
  std::unordered_map<std::string_view, std::size_t> key_index_;  // keys view the mapping
  std::vector<tensor_info> tensors_;
  std::unordered_map<std::string_view, std::size_t> tensor_index_;  // names view the mapping
};

}  // namespace lynx_examples::gguf
