// gguf_dump: lists a GGUF file (metadata and tensor table), or streams every
// tensor dequantized to float32 for an independent checker
// (tests/examples/gguf_dequant_check.py).
//
//   gguf_dump FILE.gguf                        metadata and tensor table, as text
//   gguf_dump FILE.gguf --dequantize [NAME...] every tensor (or the named ones), framed:
//       "tensor <elements> <type> <name>\n" then elements x float32 (little-endian),
//       ..., then "end <tensor count>\n"
// The values of a tensor are written in chunks of whole rows, so neither side
// of a pipe holds more than a chunk of the stream; a reader that does not see
// the final "end" line knows the stream was cut short. Errors go to stderr
// (exit 1); bad usage exits 2.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/dequant.hpp"
#include "gguf/reader.hpp"

namespace {

namespace gguf = lynx_examples::gguf;

std::string dims_text(const std::vector<std::int64_t>& dims) {
  std::string out = "[";
  for (std::size_t k = 0; k < dims.size(); ++k)
    out += (k == 0 ? "" : ", ") + std::to_string(dims[k]);
  return out + "]";
}

void list(const gguf::file& f) {
  std::printf("file: %s\nversion: %u\nsize: %llu bytes\nalignment: %llu\ndata offset: %llu\n",
              f.path().c_str(), f.version(), static_cast<unsigned long long>(f.size()),
              static_cast<unsigned long long>(f.alignment()),
              static_cast<unsigned long long>(f.data_offset()));
  std::printf("\nmetadata (%zu keys):\n", f.metadata().size());
  for (const gguf::metadata_entry& e : f.metadata()) {
    std::string type(gguf::value_type_name(e.type));
    if (e.type == gguf::value_type::array)
      type += " of " + std::string(gguf::value_type_name(e.element_type));
    const std::string value = f.describe(e.key);
    std::printf("  %.*s: %s = %s\n", static_cast<int>(e.key.size()), e.key.data(), type.c_str(),
                value.c_str());
  }
  std::printf("\ntensors (%zu):\n", f.tensors().size());
  std::uint64_t total = 0;
  for (std::size_t i = 0; i < f.tensors().size(); ++i) {
    const gguf::tensor_info& t = f.tensors()[i];
    const std::string type = gguf::is_known(t.type)
                                 ? std::string(gguf::type_name(t.type))
                                 : "type " + std::to_string(static_cast<std::uint32_t>(t.type));
    std::printf("  %4zu %-32s %-5s %-18s offset %llu, %llu bytes\n", i, t.name.c_str(),
                type.c_str(), dims_text(t.dims).c_str(), static_cast<unsigned long long>(t.offset),
                static_cast<unsigned long long>(t.bytes));
    total += t.bytes;
  }
  std::printf("tensor data: %llu bytes\n", static_cast<unsigned long long>(total));
}

void write_or_throw(const void* p, std::size_t size) {
  if (size != 0 && std::fwrite(p, 1, size, stdout) != size)
    throw std::runtime_error("gguf_dump: write error on stdout");
}

void stream(const gguf::file& f, const std::vector<std::string_view>& names) {
  std::vector<const gguf::tensor_info*> chosen;
  if (names.empty()) {
    for (const gguf::tensor_info& t : f.tensors()) chosen.push_back(&t);
  } else {
    for (std::string_view name : names) chosen.push_back(&f.tensor(name));
  }
  // A chunk is a whole number of rows, about 1M floats (4 MiB): big enough for
  // large writes, small enough that a pipe reader never holds a whole tensor.
  constexpr std::int64_t chunk_elements = 1 << 20;
  std::vector<float> buffer;
  for (const gguf::tensor_info* t : chosen) {
    if (t->name.find('\n') != std::string::npos)
      throw std::runtime_error("gguf_dump: tensor name with a newline cannot be framed");
    // Every check before the header, so that a failure never leaves a frame half-written.
    const std::span<const std::byte> bytes = f.data(*t);
    if (!gguf::can_dequantize(t->type))
      throw std::runtime_error("gguf_dump: cannot dequantize tensor '" + t->name + "' of type " +
                               std::string(gguf::type_name(t->type)));
    const std::int64_t row = t->row_length();
    const std::int64_t rows = t->rows();
    const std::int64_t rows_per_chunk = std::max<std::int64_t>(1, chunk_elements / row);
    const std::size_t row_size = gguf::row_bytes(t->type, row);
    buffer.resize(static_cast<std::size_t>(std::min(rows, rows_per_chunk) * row));
    const std::string header = "tensor " + std::to_string(t->elements()) + " " +
                               std::string(gguf::type_name(t->type)) + " " + t->name + "\n";
    write_or_throw(header.data(), header.size());
    for (std::int64_t r = 0; r < rows; r += rows_per_chunk) {
      const std::int64_t n = std::min(rows_per_chunk, rows - r);
      const std::byte* src = bytes.data() + static_cast<std::size_t>(r) * row_size;
      for (std::int64_t k = 0; k < n; ++k)
        gguf::dequantize_row(t->type, src + static_cast<std::size_t>(k) * row_size,
                             buffer.data() + k * row, row);
      write_or_throw(buffer.data(), static_cast<std::size_t>(n * row) * sizeof(float));
    }
  }
  const std::string end = "end " + std::to_string(chosen.size()) + "\n";
  write_or_throw(end.data(), end.size());
  if (std::fflush(stdout) != 0) throw std::runtime_error("gguf_dump: write error on stdout");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || (argc > 2 && std::string_view(argv[2]) != "--dequantize")) {
    std::fprintf(stderr,
                 "usage: %s FILE.gguf                         list metadata and tensors\n"
                 "       %s FILE.gguf --dequantize [NAME...]  stream tensors as float32\n",
                 argv[0], argv[0]);
    return 2;
  }
  try {
    const gguf::file f(argv[1]);
    if (argc == 2) {
      list(f);
    } else {
      static char out_buffer[1 << 20];
      std::setvbuf(stdout, out_buffer, _IOFBF, sizeof out_buffer);
      std::vector<std::string_view> names(argv + 3, argv + argc);
      stream(f, names);
    }
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
