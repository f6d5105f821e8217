// libFuzzer target: the llama2.c checkpoint loader (examples/llama2c/model.hpp,
// weights(path)) on arbitrary files. The input is the whole file, written to a
// temporary file of this process and loaded.
//
// Refusals must be what the loader documents: std::runtime_error (missing,
// short header, invalid header, size mismatch, non-finite weights). Anything
// else thrown, a crash or a sanitizer report fails. A checkpoint that loads
// must be consistent: its size is what its header implies, the KV cache its
// header implies stays within the loader's stated bound (max(256 MiB, 4 x the
// file)), every tensor accessor of every layer lies inside the parameters (each
// is read whole), and save() then load gives back the same config and weights.
// Allocation bound: the loader allocates about the file's size (parameters),
// so run.sh runs with -malloc_limit_mb=64 and inputs of at most 64 KiB.
//
//   clang++ -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -Iexamples/llama2c \
//       tests/fuzz/llama2c_checkpoint.cpp -o /tmp/fuzz_llama2c_checkpoint
//   /tmp/fuzz_llama2c_checkpoint -max_total_time=60 -malloc_limit_mb=64 -max_len=65536
//   /tmp/fuzz_llama2c_checkpoint --make-seeds DIR   # small valid checkpoints, then exit
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"

namespace {

namespace l2 = lynx_examples::llama2c;

[[noreturn]] void failed(const char* why) {
  std::fprintf(stderr, "llama2c_checkpoint: %s\n", why);
  std::abort();
}

std::filesystem::path temp_path(const char* what) {
  return std::filesystem::temp_directory_path() /
         ("lynx_fuzz_" + std::to_string(::getpid()) + "_" + what);
}

void write_file(const std::filesystem::path& p, const std::uint8_t* data, std::size_t size) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(data), static_cast<std::streamsize>(size));
  if (!out) failed("cannot write the temporary file");
}

// Reads every float of a span (an out-of-range span is an ASan report).
float touch(std::span<const float> s) {
  float sum = 0;
  for (const float x : s) sum += x;
  return sum;
}

void check_loaded(const l2::weights& w, std::size_t file_bytes) {
  const l2::config& c = w.cfg();
  if (static_cast<std::int64_t>(file_bytes) != l2::detail::checkpoint_bytes(c))
    failed("a checkpoint loaded whose size is not what its header implies");
  const std::int64_t cap =
      std::max<std::int64_t>(std::int64_t{256} << 20, 4 * static_cast<std::int64_t>(file_bytes));
  if (l2::detail::kv_cache_bytes(c) > cap)
    failed("a checkpoint loaded whose KV cache is over the bound");
  if (static_cast<std::int64_t>(w.parameters().size()) != l2::detail::parameter_count(c))
    failed("parameter count differs from the config's");
  volatile float sum = touch(w.token_embedding()) + touch(w.rms_final()) + touch(w.classifier());
  for (int l = 0; l < c.n_layers; ++l)
    sum = sum + touch(w.rms_att(l)) + touch(w.wq(l)) + touch(w.wk(l)) + touch(w.wv(l)) +
          touch(w.wo(l)) + touch(w.rms_ffn(l)) + touch(w.w1(l)) + touch(w.w2(l)) + touch(w.w3(l));
  (void)sum;
  for (const float x : w.parameters())
    if (!std::isfinite(x)) failed("a non-finite weight was accepted");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  static const std::filesystem::path file = temp_path("checkpoint.bin");
  static const std::filesystem::path again = temp_path("checkpoint_saved.bin");
  write_file(file, data, size);
  try {
    const l2::weights w(file);
    check_loaded(w, size);
    w.save(again);  // round trip: the writer's file loads to the same model
    const l2::weights back(again);
    if (!(back.cfg() == w.cfg())) failed("save/load changed the config");
    if (!std::equal(back.parameters().begin(), back.parameters().end(), w.parameters().begin(),
                    w.parameters().end()))
      failed("save/load changed the weights");
  } catch (const std::runtime_error&) {
    // a documented refusal
  }
  return 0;
}

extern "C" int LLVMFuzzerInitialize(int* argc, char*** argv) {
  for (int i = 1; i + 1 < *argc; ++i) {
    if (std::strcmp((*argv)[i], "--make-seeds") != 0) continue;
    const std::filesystem::path dir = (*argv)[i + 1];
    // Small models of each layout: tied and untied classifier, MHA and GQA.
    const l2::config configs[] = {
        {8, 16, 2, 2, 1, 32, 16, true},
        {8, 12, 1, 2, 2, 24, 8, false},
        {4, 4, 1, 1, 1, 8, 4, true},
        {16, 32, 2, 4, 2, 40, 12, false},
    };
    int k = 0;
    for (const auto& c : configs) {
      std::vector<float> p(static_cast<std::size_t>(l2::detail::parameter_count(c)));
      for (std::size_t j = 0; j < p.size(); ++j) p[j] = l2::uniform_pm1(7, k, j);
      l2::weights(c, std::move(p)).save(dir / ("seed_" + std::to_string(k++)));
    }
    std::printf("llama2c_checkpoint: %d seeds written to %s\n", k, dir.c_str());
    std::exit(0);
  }
  return 0;
}
