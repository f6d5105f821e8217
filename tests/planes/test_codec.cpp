// Tests of lynx/planes/codec.hpp (and the tensor, segment and layout it uses):
//   - merge(split(codes)) == codes and encode == split(quantize), bit for bit;
//   - the segments decoded by this file's own reading of the layout documented in
//     layout.hpp give the same codes and parameters;
//   - reconstruction at each precision level within half a bin of the fp64 reference;
//   - multi-threaded encode/reconstruct bitwise equal to single-threaded;
//   - out-of-order and duplicate delivery give the same tensor as in-order;
//   - every kind of bad input rejected with the right lynx::errc, tensor unchanged.
// Over plans x element types x group sizes, on random and adversarial data.
//
// Float slack of the error bound (same derivation as tests/quant/test_quantizer.cpp):
// the reconstruction is within half a bin of width scale * 2^(B-p) of the input
// plus 2^-20 * (|min| + range) of its group, for the float rounding of
// (x - zero) * inv_scale, of scale, and of the final fma (together < 2^-21 * (...)).
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <span>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "lynx/planes/codec.hpp"

namespace {

// ---------------------------------------------------------------------------
// Configurations under test
// ---------------------------------------------------------------------------

template <class P, class T, int GroupSize>
struct config {
  using plan = P;
  using element = T;
  static constexpr int group = GroupSize;
};

#define LYNX_TEST_CONFIGS_G32(P) \
  config<lynx::P, float, 32>, config<lynx::P, lynx::bf16, 32>, config<lynx::P, lynx::fp16, 32>
#define LYNX_TEST_CONFIGS_OF(P)                                                          \
  LYNX_TEST_CONFIGS_G32(P), config<lynx::P, float, 64>, config<lynx::P, lynx::bf16, 64>, \
      config<lynx::P, lynx::fp16, 64>
// Every plan with every element type at G = 32 (four plans lynx::kernels ships,
// and the 12-bit plan). G = 64 with every element type on one plan of each of the
// 8- and 16-bit code widths, and once on the 12-bit plan and on a three-stream
// plan, with the element types the rejection tests encode them with at G = 64
// anyway: the codec's kernels are templates of the code width and the element
// type, and the group size reaches them (and the segment layout) only as the
// geometry's key_group / value_group, read at run time; a plan's streams only
// split the codes into planes, the same at any group size. The other plans and
// element types at G = 64 ran code these configurations already run.
using all_configs =
    std::tuple<LYNX_TEST_CONFIGS_OF(plan_8_4_4), LYNX_TEST_CONFIGS_G32(plan_8_2_2_4),
               LYNX_TEST_CONFIGS_OF(plan_16_4_12), LYNX_TEST_CONFIGS_G32(plan_16_4_4_8),
               config<lynx::plan_16_4_4_8, float, 64>, LYNX_TEST_CONFIGS_G32(plan_12_4_8),
               config<lynx::plan_12_4_8, lynx::fp16, 64>, config<lynx::plan_8_4_4, float, 16>,
               config<lynx::plan_16_4_12, lynx::bf16, 16>>;
// Smaller product for the rejection tests: every plan, float and bf16, G = 32.
using rejection_configs =
    std::tuple<config<lynx::plan_8_4_4, float, 32>, config<lynx::plan_8_2_2_4, lynx::bf16, 32>,
               config<lynx::plan_16_4_12, lynx::bf16, 32>, config<lynx::plan_16_4_4_8, float, 64>,
               config<lynx::plan_12_4_8, lynx::fp16, 32>, config<lynx::plan_8_8, float, 32>>;
#undef LYNX_TEST_CONFIGS_OF
#undef LYNX_TEST_CONFIGS_G32

// ---------------------------------------------------------------------------
// Deterministic input
// ---------------------------------------------------------------------------

struct splitmix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  double uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  float symmetric(float a) { return static_cast<float>((2.0 * uniform() - 1.0) * a); }
};

enum class data_kind { random, constant, outlier, denormal, signed_zero };
enum class layout_kind { token_major, head_major, strided };

const char* name_of(data_kind k) {
  switch (k) {
    case data_kind::random:
      return "random";
    case data_kind::constant:
      return "constant groups";
    case data_kind::outlier:
      return "outlier channel";
    case data_kind::denormal:
      return "denormals";
    case data_kind::signed_zero:
      return "+0/-0";
  }
  return "?";
}
const char* name_of(layout_kind k) {
  switch (k) {
    case layout_kind::token_major:
      return "token-major";
    case layout_kind::head_major:
      return "head-major";
    case layout_kind::strided:
      return "channel stride 2";
  }
  return "?";
}

// Value of element (t, h, c) of K (keys = true) or V for a data kind, before
// conversion to the element type.
float make_value(data_kind kind, bool keys, const lynx::kv_shape& s, std::int64_t t, std::int64_t h,
                 std::int64_t c, splitmix64& rng) {
  switch (kind) {
    case data_kind::random: {
      const float channel_scale = 0.5f + static_cast<float>((c * 37 + h * 11) % 16) / 8.0f;
      return static_cast<float>((rng.uniform() + rng.uniform() + rng.uniform() - 1.5) * 2.0) *
             channel_scale;
    }
    case data_kind::constant:
      // K constant along tokens (every key group constant), V constant along channels
      // (every value group constant); head 1 is one constant for all.
      if (h == 1) return -3.0f;
      return keys ? static_cast<float>(c) * 0.5f - 3.0f : static_cast<float>(t % 50) * 0.25f - 1.0f;
    case data_kind::outlier: {
      const float v = rng.symmetric(2.0f);
      return c == 3 % s.head_dim ? (rng.next() & 1 ? 1e4f : -1e4f) + v : v;
    }
    case data_kind::denormal: {
      // Pure denormal/zero groups (keys: the first 32 tokens; values: head 0), the rest mixed
      // with normal values so some groups hold both.
      const std::uint64_t r = rng.next();
      const float tiny = std::bit_cast<float>(static_cast<std::uint32_t>(r >> 40) & 0x007fffffu) *
                         ((r & 1) ? -1.0f : 1.0f);
      const bool pure = keys ? t < 32 : h == 0;
      if (pure || (r & 6) != 0) return (r & 8) ? tiny : ((r & 16) ? -0.0f : 0.0f);
      return rng.symmetric(1e-3f);
    }
    case data_kind::signed_zero: {
      const std::uint64_t r = rng.next();
      if ((keys ? t < 40 : c < 8) || (r & 7) != 0) return (r & 8) ? -0.0f : 0.0f;
      return (r & 16) ? 1.0f : -1.0f;
    }
  }
  return 0;
}

// One layer's K and V in an element type and a memory layout, plus the values
// the library sees (the element converted back to float), [tokens][heads][dim].
template <class T>
struct layer_input {
  lynx::kv_shape shape{};
  std::vector<T> key_store, value_store;
  lynx::kv_view<T> keys, values;
  std::vector<float> key_value, value_value;

  [[nodiscard]] std::int64_t index(std::int64_t t, std::int64_t h, std::int64_t c) const {
    return (t * shape.kv_heads + h) * shape.head_dim + c;
  }
};

template <class T>
lynx::kv_view<T> make_view(T* data, const lynx::kv_shape& s, layout_kind layout) {
  switch (layout) {
    case layout_kind::token_major:
      return lynx::token_major(data, s);
    case layout_kind::head_major:
      return lynx::head_major(data, s);
    case layout_kind::strided:
      return {data, s, s.kv_heads * s.head_dim * 2, s.head_dim * 2, 2};
  }
  return {};
}

template <class T>
layer_input<T> make_input(const lynx::kv_shape& s, data_kind kind, layout_kind layout,
                          std::uint64_t seed) {
  layer_input<T> in;
  in.shape = s;
  const std::size_t n = static_cast<std::size_t>(s.elements());
  // The gaps of the strided layout hold NaN: reading one would be rejected.
  const T gap = lynx::from_float<T>(std::numeric_limits<float>::quiet_NaN());
  in.key_store.assign(layout == layout_kind::strided ? 2 * n : n, gap);
  in.value_store.assign(in.key_store.size(), gap);
  in.keys = make_view(in.key_store.data(), s, layout);
  in.values = make_view(in.value_store.data(), s, layout);
  in.key_value.resize(n);
  in.value_value.resize(n);
  splitmix64 rng{seed};
  for (std::int64_t t = 0; t < s.tokens; ++t)
    for (std::int64_t h = 0; h < s.kv_heads; ++h)
      for (std::int64_t c = 0; c < s.head_dim; ++c) {
        const T k = lynx::from_float<T>(make_value(kind, true, s, t, h, c, rng));
        const T v = lynx::from_float<T>(make_value(kind, false, s, t, h, c, rng));
        in.keys(t, h, c) = k;
        in.values(t, h, c) = v;
        in.key_value[static_cast<std::size_t>(in.index(t, h, c))] = lynx::to_float(k);
        in.value_value[static_cast<std::size_t>(in.index(t, h, c))] = lynx::to_float(v);
      }
  return in;
}

template <class T>
lynx::kv_view<const T> cview(const lynx::kv_view<T>& v) {
  return v;
}

// ---------------------------------------------------------------------------
// The layout of layout.hpp's comment, re-derived here independently
// ---------------------------------------------------------------------------

std::int64_t align64(std::int64_t n) { return (n + 63) / 64 * 64; }

struct reference_layout {
  std::int64_t T = 0, H = 0, D = 0, key_group = 0, value_group = 0;
  std::vector<int> widths;
  int bits = 0;

  [[nodiscard]] std::int64_t blocks() const { return (T + 31) / 32; }
  [[nodiscard]] std::int64_t key_groups() const { return (T + key_group - 1) / key_group; }
  [[nodiscard]] std::int64_t value_groups() const { return D / value_group; }
  [[nodiscard]] std::int64_t key_params() const { return H * key_groups() * D; }
  [[nodiscard]] std::int64_t value_params() const { return H * T * value_groups(); }
  // Parameter sections of the anchor: bf16 (2 bytes) on the wire; `bytes` = 4
  // gives the receivers' expanded float block of the same shape.
  [[nodiscard]] std::int64_t key_scale_at(std::int64_t bytes = 2) const { return 0 * bytes; }
  [[nodiscard]] std::int64_t key_zero_at(std::int64_t bytes = 2) const {
    return align64(key_params() * bytes);
  }
  [[nodiscard]] std::int64_t value_scale_at(std::int64_t bytes = 2) const {
    return 2 * align64(key_params() * bytes);
  }
  [[nodiscard]] std::int64_t value_zero_at(std::int64_t bytes = 2) const {
    return value_scale_at(bytes) + align64(value_params() * bytes);
  }
  [[nodiscard]] std::int64_t params_end(std::int64_t bytes = 2) const {
    return value_zero_at(bytes) + align64(value_params() * bytes);
  }
  [[nodiscard]] std::int64_t words(int s) const {
    return H * blocks() * widths[static_cast<std::size_t>(s)] * D;
  }
  [[nodiscard]] std::int64_t key_planes_at(int s) const { return s == 0 ? params_end() : 0; }
  [[nodiscard]] std::int64_t value_planes_at(int s) const {
    return key_planes_at(s) + align64(words(s) * 4);
  }
  [[nodiscard]] std::int64_t payload(int s) const {
    return value_planes_at(s) + align64(words(s) * 4);
  }
  [[nodiscard]] int planes_before(int s) const {
    return std::accumulate(widths.begin(), widths.begin() + s, 0);
  }
};

template <class Plan, int G>
reference_layout reference_layout_of(const lynx::kv_shape& s) {
  reference_layout r;
  r.T = s.tokens;
  r.H = s.kv_heads;
  r.D = s.head_dim;
  r.key_group = G;
  r.value_group = std::min<std::int64_t>(G, s.head_dim);
  r.widths.assign(Plan::widths.begin(), Plan::widths.end());
  r.bits = Plan::bits;
  return r;
}

// Codes and parameters read from segments with the reference layout.
struct decoded_layer {
  std::vector<std::uint32_t> key_codes, value_codes;  // [H][T][D]
  std::vector<float> key_scale, key_zero, value_scale, value_zero;
  std::int64_t nonzero_padding_bits = 0;  // plane bits of tokens past the end (must be 0)
};

float read_bf16(const std::byte* p, std::int64_t i) {  // bf16: the top half of a float
  std::uint16_t b;
  std::memcpy(&b, p + 2 * i, 2);
  return std::bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}
std::uint32_t read_word(const std::byte* p, std::int64_t i) {
  std::uint32_t w;
  std::memcpy(&w, p + 4 * i, 4);
  return w;
}

decoded_layer decode_reference(const reference_layout& L,
                               const std::vector<std::span<const std::byte>>& segments) {
  decoded_layer d;
  const std::byte* anchor = segments[0].data() + 128;
  auto read_floats = [&](std::int64_t at, std::int64_t n) {
    std::vector<float> v(static_cast<std::size_t>(n));
    for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = read_bf16(anchor + at, i);
    return v;
  };
  d.key_scale = read_floats(L.key_scale_at(), L.key_params());
  d.key_zero = read_floats(L.key_zero_at(), L.key_params());
  d.value_scale = read_floats(L.value_scale_at(), L.value_params());
  d.value_zero = read_floats(L.value_zero_at(), L.value_params());
  for (int which = 0; which < 2; ++which) {
    auto& codes = which == 0 ? d.key_codes : d.value_codes;
    codes.assign(static_cast<std::size_t>(L.H * L.T * L.D), 0u);
    for (int s = 0; s < static_cast<int>(L.widths.size()); ++s) {
      const std::byte* section = segments[static_cast<std::size_t>(s)].data() + 128 +
                                 (which == 0 ? L.key_planes_at(s) : L.value_planes_at(s));
      const int w = L.widths[static_cast<std::size_t>(s)];
      for (std::int64_t h = 0; h < L.H; ++h)
        for (std::int64_t b = 0; b < L.blocks(); ++b)
          for (int j = 0; j < w; ++j)
            for (std::int64_t c = 0; c < L.D; ++c) {
              const std::uint32_t word =
                  read_word(section, ((h * L.blocks() + b) * w + j) * L.D + c);
              for (int bit = 0; bit < 32; ++bit) {
                const std::int64_t t = b * 32 + bit;
                const std::uint32_t v = (word >> bit) & 1u;
                if (t >= L.T) {
                  d.nonzero_padding_bits += v;
                  continue;
                }
                auto& code = codes[static_cast<std::size_t>((h * L.T + t) * L.D + c)];
                code |= v << (L.bits - 1 - (L.planes_before(s) + j));  // plane 0 is the MSB
              }
            }
    }
  }
  return d;
}

// ---------------------------------------------------------------------------
// Checks that collect the first failure instead of asserting per element
// ---------------------------------------------------------------------------

struct failure_log {
  std::int64_t count = 0;
  std::string first;
  template <class... Args>
  void fail(const Args&... parts) {
    if (count++ == 0) {
      std::ostringstream os;
      os.precision(9);
      (os << ... << parts);
      first = os.str();
    }
  }
};

std::uint32_t bits_of(float x) { return std::bit_cast<std::uint32_t>(x); }

template <class T>
std::uint32_t storage_bits(T x) {
  if constexpr (std::is_same_v<T, float>)
    return bits_of(x);
  else
    return x.bits;
}

bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

bool same_bits(const lynx::quantized_layer& a, const lynx::quantized_layer& b) {
  return a.geometry == b.geometry && a.key_codes == b.key_codes && a.value_codes == b.value_codes &&
         same_floats(a.key_scale, b.key_scale) && same_floats(a.key_zero, b.key_zero) &&
         same_floats(a.value_scale, b.value_scale) && same_floats(a.value_zero, b.value_zero);
}

template <class Plan, int G>
bool same_segments(const lynx::encoded_layer<Plan, G>& a, const lynx::encoded_layer<Plan, G>& b) {
  for (int s = 0; s < Plan::streams; ++s) {
    const auto x = a.segment(s), y = b.segment(s);
    if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size()) != 0) return false;
  }
  return true;
}

template <class Plan, int G>
std::vector<std::span<const std::byte>> segments_of(const lynx::encoded_layer<Plan, G>& e) {
  std::vector<std::span<const std::byte>> v;
  for (int s = 0; s < Plan::streams; ++s) v.push_back(e.segment(s));
  return v;
}

// Group extremes of the input in double (keys: per channel over G tokens;
// values: per token over the value group of channels).
struct group_extremes {
  std::vector<double> lo, hi;
};

group_extremes key_extremes(const std::vector<float>& x, const reference_layout& L) {
  group_extremes e;
  e.lo.assign(static_cast<std::size_t>(L.key_params()), std::numeric_limits<double>::infinity());
  e.hi.assign(e.lo.size(), -std::numeric_limits<double>::infinity());
  for (std::int64_t t = 0; t < L.T; ++t)
    for (std::int64_t h = 0; h < L.H; ++h)
      for (std::int64_t c = 0; c < L.D; ++c) {
        const auto i = static_cast<std::size_t>((h * L.key_groups() + t / L.key_group) * L.D + c);
        const double v = x[static_cast<std::size_t>((t * L.H + h) * L.D + c)];
        e.lo[i] = std::min(e.lo[i], v);
        e.hi[i] = std::max(e.hi[i], v);
      }
  return e;
}

group_extremes value_extremes(const std::vector<float>& x, const reference_layout& L) {
  group_extremes e;
  e.lo.assign(static_cast<std::size_t>(L.value_params()), std::numeric_limits<double>::infinity());
  e.hi.assign(e.lo.size(), -std::numeric_limits<double>::infinity());
  for (std::int64_t t = 0; t < L.T; ++t)
    for (std::int64_t h = 0; h < L.H; ++h)
      for (std::int64_t c = 0; c < L.D; ++c) {
        const auto i =
            static_cast<std::size_t>((h * L.T + t) * L.value_groups() + c / L.value_group);
        const double v = x[static_cast<std::size_t>((t * L.H + h) * L.D + c)];
        e.lo[i] = std::min(e.lo[i], v);
        e.hi[i] = std::max(e.hi[i], v);
      }
  return e;
}

// Parameters and codes of one tensor (K or V) against the fp64 reference.
void check_codes(const char* what, const reference_layout& L, const std::vector<float>& x,
                 const group_extremes& e, const std::vector<float>& scale,
                 const std::vector<float>& zero, const std::vector<std::uint32_t>& codes, bool keys,
                 failure_log& log) {
  const double max_code = std::ldexp(1.0, L.bits) - 1.0;
  const auto is_bf16 = [](float f) { return (std::bit_cast<std::uint32_t>(f) & 0xffffu) == 0u; };
  for (std::size_t i = 0; i < e.lo.size(); ++i) {
    // zero: the group minimum rounded down to a bf16 value (bf16 subnormals are 2^-133 apart)
    const float lo = static_cast<float>(e.lo[i]);
    if (!(is_bf16(zero[i]) && zero[i] <= lo &&
          static_cast<double>(lo) - zero[i] <= std::max(0x1.0p-7 * std::fabs(e.lo[i]), 0x1.0p-133)))
      log.fail(what, " group ", i, ": zero ", zero[i], " is not the group minimum ", lo,
               " rounded down to bf16");
    const double covered = e.hi[i] - zero[i];  // the bins must span [zero, max]
    if (static_cast<float>(covered) < lynx::min_group_range) {
      if (scale[i] != 0.0f) log.fail(what, " group ", i, ": constant group with scale ", scale[i]);
    } else {
      // scale: covered / (2^B - 1) rounded up to bf16 (8 significant bits)
      const double reference = covered / max_code;
      if (!(is_bf16(scale[i]) && scale[i] >= reference * (1.0 - 0x1.0p-22) &&
            scale[i] <= reference * (1.0 + 0x1.0p-7)))
        log.fail(what, " group ", i, ": scale ", scale[i], " vs fp64 ", reference);
    }
  }
  for (std::int64_t t = 0; t < L.T; ++t)
    for (std::int64_t h = 0; h < L.H; ++h)
      for (std::int64_t c = 0; c < L.D; ++c) {
        const auto g =
            static_cast<std::size_t>(keys ? (h * L.key_groups() + t / L.key_group) * L.D + c
                                          : (h * L.T + t) * L.value_groups() + c / L.value_group);
        const std::uint32_t code = codes[static_cast<std::size_t>((h * L.T + t) * L.D + c)];
        const double v = x[static_cast<std::size_t>((t * L.H + h) * L.D + c)];
        if (code > max_code) log.fail(what, " code ", code, " out of range");
        if (scale[g] == 0.0f) {
          if (code != 0)
            log.fail(what, " (t=", t, ", h=", h, ", c=", c, "): constant group with code ", code);
          continue;
        }
        const double range = e.hi[g] - zero[g];
        const double position = (v - zero[g]) / scale[g];
        const double slack = 0x1.0p-20 * (std::fabs(e.lo[g]) + range) / scale[g];
        if (!(std::fabs(code - position) <= 0.5 + slack))
          log.fail(what, " (t=", t, ", h=", h, ", c=", c, "): code ", code, " for fp64 position ",
                   position);
      }
}

// Reconstruction of one tensor at `planes` planes: r (float, [T][H][D]) against
// the fp64 reference built from the decoded codes and parameters, and the input.
void check_reconstruction(const char* what, const reference_layout& L, int planes,
                          const std::vector<float>& x, const group_extremes& e,
                          const std::vector<float>& scale, const std::vector<float>& zero,
                          const std::vector<std::uint32_t>& codes, const std::vector<float>& r,
                          bool keys, failure_log& log) {
  const int missing = L.bits - planes;
  for (std::int64_t t = 0; t < L.T; ++t)
    for (std::int64_t h = 0; h < L.H; ++h)
      for (std::int64_t c = 0; c < L.D; ++c) {
        const auto g =
            static_cast<std::size_t>(keys ? (h * L.key_groups() + t / L.key_group) * L.D + c
                                          : (h * L.T + t) * L.value_groups() + c / L.value_group);
        const auto i = static_cast<std::size_t>((t * L.H + h) * L.D + c);
        const std::uint32_t prefix =
            codes[static_cast<std::size_t>((h * L.T + t) * L.D + c)] >> missing;
        // fp64 reference of the midpoint of the bins the prefix leaves possible
        const double level = std::ldexp(static_cast<double>(prefix), missing) +
                             (std::ldexp(1.0, missing) - 1.0) / 2.0;
        const double exact = static_cast<double>(zero[g]) + static_cast<double>(scale[g]) * level;
        const float got = r[i];
        const double spacing = static_cast<double>(std::nextafter(std::fabs(got), 3e38f)) -
                               std::fabs(static_cast<double>(got));
        if (!(std::fabs(got - exact) <= 0.5 * spacing))
          log.fail(what, " planes=", planes, " (t=", t, ", h=", h, ", c=", c, "): ", got,
                   " is not the rounded midpoint ", exact);
        const double range = e.hi[g] - zero[g];
        const double err = std::fabs(static_cast<double>(got) - x[i]);
        if (scale[g] == 0.0f) {
          if (!(got == zero[g]) || !(err <= range))
            log.fail(what, " planes=", planes, " (t=", t, ", h=", h, ", c=", c,
                     "): constant group gives ", got);
          continue;
        }
        // half a bin of the bf16 scale (at most 2^-7 wider than range / (2^B - 1))
        const double bound = 0.5 * static_cast<double>(scale[g]) * std::ldexp(1.0, missing) +
                             0x1.0p-20 * (std::fabs(e.lo[g]) + range);
        if (!(err <= bound))
          log.fail(what, " planes=", planes, " (t=", t, ", h=", h, ", c=", c, "): error ", err,
                   " exceeds half a bin ", bound, " (x=", x[i], ", r=", got, ")");
      }
}

template <class Plan, int G>
lynx::host_bitplane_tensor<Plan, G> receive_all(const lynx::encoded_layer<Plan, G>& e,
                                                lynx::kv_shape s, std::uint32_t layer,
                                                std::uint64_t generation) {
  lynx::host_bitplane_tensor<Plan, G> t(s, layer, generation);
  for (int i = 0; i < Plan::streams; ++i)
    REQUIRE(t.accept(e.segment(i)) == lynx::accept_result::accepted);
  REQUIRE(t.complete());
  return t;
}

// Float reconstruction, token-major [T][H][D].
template <class Plan, int G>
std::pair<std::vector<float>, std::vector<float>> reconstruct_float(
    const lynx::bitplane_view<Plan, G>& v, int threads = 1) {
  const lynx::kv_shape s = v.geometry.shape();
  std::vector<float> k(static_cast<std::size_t>(s.elements())), val(k.size());
  lynx::reconstruct(v, lynx::token_major(k.data(), s), lynx::token_major(val.data(), s), {threads});
  return {std::move(k), std::move(val)};
}

struct codec_case {
  lynx::kv_shape shape;
  data_kind kind;
  layout_kind layout;
};

const codec_case codec_cases[] = {
    {{1, 1, 64}, data_kind::random, layout_kind::token_major},     // one token
    {{1, 2, 8}, data_kind::signed_zero, layout_kind::head_major},  // one token, head_dim 8
    {{31, 2, 8}, data_kind::random, layout_kind::strided},
    {{33, 1, 128}, data_kind::outlier, layout_kind::token_major},
    {{100, 2, 64}, data_kind::constant, layout_kind::head_major},
    {{100, 1, 64}, data_kind::denormal, layout_kind::strided},
    {{257, 1, 256}, data_kind::random, layout_kind::head_major},
    {{64, 3, 8}, data_kind::denormal, layout_kind::token_major},
    {{40, 2, 128}, data_kind::signed_zero, layout_kind::token_major},
    {{77, 2, 64}, data_kind::outlier, layout_kind::strided},
    {{33, 1, 256}, data_kind::constant, layout_kind::token_major},
    {{31, 1, 64}, data_kind::random, layout_kind::token_major},
    // head_dim 16: one 16-channel chunk, staged alone (no nibble partner)
    {{45, 2, 16}, data_kind::outlier, layout_kind::token_major},
    // whole 32-token blocks with head_dim 128 (the bf16 block kernel of the vector path)
    {{96, 2, 128}, data_kind::denormal, layout_kind::token_major},
    {{64, 3, 128}, data_kind::constant, layout_kind::token_major},
    {{72, 2, 128}, data_kind::signed_zero, layout_kind::token_major},
};

}  // namespace

// ---------------------------------------------------------------------------
// Property tests
// ---------------------------------------------------------------------------

TEST_CASE_TEMPLATE_DEFINE(
    "encode == split(quantize), merge(split) == codes, layout and reconstruction against fp64", C,
    codec_id) {
  using Plan = typename C::plan;
  using T = typename C::element;
  constexpr int G = C::group;
  std::uint32_t layer = 0;
  for (const codec_case& cc : codec_cases) {
    ++layer;
    const lynx::kv_shape s = cc.shape;
    INFO("plan " << Plan::name() << ", " << lynx::element_name<T>() << ", G=" << G << ", shape "
                 << lynx::to_string(s) << ", " << name_of(cc.kind) << ", " << name_of(cc.layout));
    const std::uint64_t generation = 1000 + layer;
    const auto in = make_input<T>(s, cc.kind, cc.layout, 77 * layer + G);
    const auto keys = cview(in.keys);
    const auto values = cview(in.values);

    const auto encoded = lynx::encode<Plan, G, T>(keys, values, layer, {generation, 1});
    const lynx::quantized_layer q = lynx::quantize<Plan, G, T>(keys, values, layer);
    const auto split = lynx::split<Plan, G>(q, layer, generation);
    CHECK(same_segments(encoded, split));  // encode == split(quantize), byte for byte

    // Multi-threaded encode: same bytes for any thread count.
    CHECK(same_segments(encoded, lynx::encode<Plan, G, T>(keys, values, layer, {generation, 3})));
    CHECK(same_segments(encoded, lynx::encode<Plan, G, T>(keys, values, layer, {generation, 0})));

    // The layout, re-derived from its documentation.
    const reference_layout L = reference_layout_of<Plan, G>(s);
    const lynx::layer_geometry& g = encoded.geometry();
    for (int st = 0; st < Plan::streams; ++st) {
      REQUIRE(g.payload_bytes(st) == L.payload(st));
      REQUIRE(g.key_planes_offset(st) == L.key_planes_at(st));
      REQUIRE(g.value_planes_offset(st) == L.value_planes_at(st));
      REQUIRE(encoded.segment(st).size() == static_cast<std::size_t>(128 + L.payload(st)));
    }
    REQUIRE(g.wire_params_bytes() == L.params_end());
    REQUIRE(g.param_section_offset(1, 2) == L.key_zero_at());
    REQUIRE(g.param_section_offset(2, 2) == L.value_scale_at());
    REQUIRE(g.param_section_offset(3, 2) == L.value_zero_at());
    REQUIRE(g.key_zero_offset() == L.key_zero_at(4));
    REQUIRE(g.value_scale_offset() == L.value_scale_at(4));
    REQUIRE(g.value_zero_offset() == L.value_zero_at(4));
    REQUIRE(g.params_bytes() == L.params_end(4));
    const decoded_layer d = decode_reference(L, segments_of(encoded));
    CHECK(d.nonzero_padding_bits == 0);
    CHECK(
        std::equal(d.key_codes.begin(), d.key_codes.end(), q.key_codes.begin(), q.key_codes.end()));
    CHECK(std::equal(d.value_codes.begin(), d.value_codes.end(), q.value_codes.begin(),
                     q.value_codes.end()));
    CHECK(same_floats(d.key_scale, q.key_scale));
    CHECK(same_floats(d.key_zero, q.key_zero));
    CHECK(same_floats(d.value_scale, q.value_scale));
    CHECK(same_floats(d.value_zero, q.value_zero));

    // Codes and parameters against the fp64 reference.
    const group_extremes ke = key_extremes(in.key_value, L), ve = value_extremes(in.value_value, L);
    failure_log log;
    check_codes("keys", L, in.key_value, ke, d.key_scale, d.key_zero, d.key_codes, true, log);
    check_codes("values", L, in.value_value, ve, d.value_scale, d.value_zero, d.value_codes, false,
                log);
    INFO("first failure: " << log.first);
    CHECK(log.count == 0);

    // Receive, merge: bit for bit the codes.
    const auto tensor = receive_all(encoded, s, layer, generation);
    CHECK(same_bits(lynx::merge(tensor), q));

    // Reconstruct at every precision level.
    for (int level = 1; level <= Plan::streams; ++level) {
      const int planes = Plan::planes_at_level(level);
      const auto view = tensor.view_at(level);
      CHECK(view.planes() == planes);
      const auto [rk, rv] = reconstruct_float(view);
      failure_log rlog;
      check_reconstruction("keys", L, planes, in.key_value, ke, d.key_scale, d.key_zero,
                           d.key_codes, rk, true, rlog);
      check_reconstruction("values", L, planes, in.value_value, ve, d.value_scale, d.value_zero,
                           d.value_codes, rv, false, rlog);
      INFO("level " << level << " first failure: " << rlog.first);
      CHECK(rlog.count == 0);
      // Into the engine's own layout and element type: the float result converted once.
      auto out = make_input<T>(s, data_kind::constant, cc.layout, 1);
      lynx::reconstruct(view, out.keys, out.values);
      std::int64_t mismatches = 0;
      for (std::int64_t t = 0; t < s.tokens; ++t)
        for (std::int64_t h = 0; h < s.kv_heads; ++h)
          for (std::int64_t c = 0; c < s.head_dim; ++c) {
            const auto i = static_cast<std::size_t>(in.index(t, h, c));
            mismatches +=
                storage_bits(out.keys(t, h, c)) != storage_bits(lynx::from_float<T>(rk[i]));
            mismatches +=
                storage_bits(out.values(t, h, c)) != storage_bits(lynx::from_float<T>(rv[i]));
          }
      CHECK(mismatches == 0);
      if (level == Plan::streams) {  // threads do not change a bit
        const auto [tk, tv] = reconstruct_float(view, 3);
        CHECK(same_floats(tk, rk));
        CHECK(same_floats(tv, rv));
      }
    }
  }
}
TEST_CASE_TEMPLATE_APPLY(codec_id, all_configs);

// ---------------------------------------------------------------------------
// Every kernel path of the host codecs against the portable one, in one binary
// ---------------------------------------------------------------------------

namespace {

// Limits the host codecs to some of their kernels while in scope.
class codec_kernels_scope {
 public:
  explicit codec_kernels_scope(lynx::detail::codec_kernels k) {
    lynx::detail::codec_kernels_limit.store(k);
  }
  ~codec_kernels_scope() { lynx::detail::codec_kernels_limit.store(saved_); }
  codec_kernels_scope(const codec_kernels_scope&) = delete;
  codec_kernels_scope& operator=(const codec_kernels_scope&) = delete;

 private:
  lynx::detail::codec_kernels saved_ = lynx::detail::codec_kernels_limit.load();
};

const char* name_of(lynx::detail::codec_kernels k) {
  switch (k) {
    case lynx::detail::codec_kernels::best:
      return "best";
    case lynx::detail::codec_kernels::avx512_without_bf16:
      return "AVX-512 without AVX512-BF16";
    case lynx::detail::codec_kernels::portable:
      return "portable";
  }
  return "?";
}

// What one kernel path gives for an input: the segments, and the K and V
// reconstructed at every precision level into the input's element type and layout
// (the whole storage, bytes between strided elements included).
struct path_result {
  std::vector<std::vector<std::byte>> segments;
  std::vector<std::vector<std::byte>> keys, values;  // [level - 1]
};

template <class Plan, int G, class T>
path_result run_path(lynx::detail::codec_kernels kernels, const layer_input<T>& in,
                     layout_kind layout, std::uint32_t layer) {
  const codec_kernels_scope scope(kernels);
  path_result r;
  const auto encoded = lynx::encode<Plan, G, T>(cview(in.keys), cview(in.values), layer, {7, 1});
  for (int st = 0; st < Plan::streams; ++st) {
    const auto segment = encoded.segment(st);
    r.segments.emplace_back(segment.begin(), segment.end());
  }
  const auto tensor = receive_all(encoded, in.shape, layer, 7);
  for (int level = 1; level <= Plan::streams; ++level) {
    auto out = make_input<T>(in.shape, data_kind::constant, layout, 1);
    lynx::reconstruct(tensor.view_at(level), out.keys, out.values);
    const auto as_bytes = [](const std::vector<T>& v) {
      const auto* p = reinterpret_cast<const std::byte*>(v.data());
      return std::vector<std::byte>(p, p + v.size() * sizeof(T));
    };
    r.keys.push_back(as_bytes(out.key_store));
    r.values.push_back(as_bytes(out.value_store));
  }
  return r;
}

}  // namespace

TEST_CASE("the host codecs' kernels on this CPU") {
  const std::string kernels =
      !lynx::detail::use_avx512_codec() ? "portable only (the comparison of the paths below then "
                                          "compares the portable kernels with themselves)"
      : lynx::detail::use_avx512_bf16_codec() ? "AVX-512, with AVX512-BF16"
                                              : "AVX-512, without AVX512-BF16";
  MESSAGE("host codec kernels: " << kernels);
  CHECK(lynx::detail::codec_kernels_limit.load() == lynx::detail::codec_kernels::best);
}

TEST_CASE_TEMPLATE_DEFINE("encode and reconstruct give the same bytes on every kernel path", C,
                          paths_id) {
  using Plan = typename C::plan;
  using T = typename C::element;
  constexpr int G = C::group;
  std::uint32_t layer = 0;
  for (const codec_case& cc : codec_cases) {
    ++layer;
    INFO("plan " << Plan::name() << ", " << lynx::element_name<T>() << ", G=" << G << ", shape "
                 << lynx::to_string(cc.shape) << ", " << name_of(cc.kind) << ", "
                 << name_of(cc.layout));
    const auto in = make_input<T>(cc.shape, cc.kind, cc.layout, 77 * layer + G);
    const path_result portable =
        run_path<Plan, G>(lynx::detail::codec_kernels::portable, in, cc.layout, layer);
    for (const auto kernels :
         {lynx::detail::codec_kernels::best, lynx::detail::codec_kernels::avx512_without_bf16}) {
      INFO("kernels: " << name_of(kernels));
      const path_result r = run_path<Plan, G>(kernels, in, cc.layout, layer);
      CHECK(r.segments == portable.segments);
      CHECK(r.keys == portable.keys);
      CHECK(r.values == portable.values);
    }
  }
}
TEST_CASE_TEMPLATE_APPLY(paths_id, all_configs);

TEST_CASE_TEMPLATE_DEFINE("out-of-order and duplicate delivery give the same tensor as in-order", C,
                          order_id) {
  using Plan = typename C::plan;
  using T = typename C::element;
  constexpr int G = C::group;
  const lynx::kv_shape s{45, 2, 64};
  const std::uint32_t layer = 3;
  const std::uint64_t generation = 17;
  const auto in = make_input<T>(s, data_kind::random, layout_kind::token_major, 99);
  const auto encoded =
      lynx::encode<Plan, G, T>(cview(in.keys), cview(in.values), layer, {generation, 1});
  const auto in_order = receive_all(encoded, s, layer, generation);
  const lynx::quantized_layer merged = lynx::merge(in_order);
  std::vector<std::pair<std::vector<float>, std::vector<float>>> at_level(Plan::streams + 1);
  for (int l = 1; l <= Plan::streams; ++l)
    at_level[static_cast<std::size_t>(l)] = reconstruct_float(in_order.view_at(l));

  std::vector<int> order(Plan::streams);
  std::iota(order.begin(), order.end(), 0);
  int permutations = 0;
  do {
    ++permutations;
    INFO("delivery order (first arrival of each stream): " << [&] {
      std::string o;
      for (int x : order) o += std::to_string(x) + " ";
      return o;
    }());
    lynx::host_bitplane_tensor<Plan, G> t(s, layer, generation);
    CHECK(t.precision_level() == 0);
    std::array<bool, lynx::max_streams> have{};
    int last_level = 0;
    for (std::size_t k = 0; k < order.size(); ++k) {
      const int st = order[k];
      CHECK(t.accept(encoded.segment(st)) == lynx::accept_result::accepted);
      have[static_cast<std::size_t>(st)] = true;
      // a duplicate of an earlier (or this) stream right after
      const int again = order[(k * 7 + 3) % (k + 1)];
      CHECK(t.accept(encoded.segment(again)) == lynx::accept_result::duplicate);
      int expected = 0;
      while (expected < Plan::streams && have[static_cast<std::size_t>(expected)]) ++expected;
      CHECK(t.precision_level() == expected);
      CHECK(t.planes_present() == Plan::planes_at_level(expected));
      CHECK(t.has_stream(st));
      CHECK(t.complete() == (expected == Plan::streams));
      if (expected !=
          last_level) {  // a new level: the same reconstruction as in-order delivery at that level
        const auto r = reconstruct_float(t.view());
        CHECK(same_floats(r.first, at_level[static_cast<std::size_t>(expected)].first));
        CHECK(same_floats(r.second, at_level[static_cast<std::size_t>(expected)].second));
        last_level = expected;
      }
    }
    // every stream once more, in reverse: all duplicates
    for (int st = Plan::streams - 1; st >= 0; --st)
      CHECK(t.accept(encoded.segment(st)) == lynx::accept_result::duplicate);
    CHECK(same_bits(lynx::merge(t), merged));
    // Lower levels of a complete tensor read as the in-order tensor's.
    for (int l = 1; l <= Plan::streams; ++l) {
      const auto r = reconstruct_float(t.view_at(l));
      CHECK(same_floats(r.first, at_level[static_cast<std::size_t>(l)].first));
    }
  } while (std::next_permutation(order.begin(), order.end()));
  int factorial = 1;
  for (int i = 2; i <= Plan::streams; ++i) factorial *= i;
  CHECK(permutations == factorial);
}
TEST_CASE_TEMPLATE_APPLY(order_id, all_configs);

TEST_CASE(
    "precision_level: a residual before the anchor keeps level 0; levels rise only as a prefix") {
  using Plan = lynx::plan_16_4_4_8;
  const lynx::kv_shape s{40, 1, 64};
  const auto in = make_input<float>(s, data_kind::random, layout_kind::token_major, 5);
  const auto e = lynx::encode<Plan, 32, float>(cview(in.keys), cview(in.values), 2, {4, 1});
  lynx::host_bitplane_tensor<Plan, 32> t(s, 2, 4);
  CHECK(t.precision_level() == 0);
  CHECK(t.planes_present() == 0);
  CHECK(t.accept(e.segment(2)) == lynx::accept_result::accepted);
  CHECK(t.precision_level() == 0);
  CHECK(t.has_stream(2));
  CHECK(!t.has_stream(0));
  CHECK(!t.has_stream(7));
  CHECK(!t.has_stream(-1));
  CHECK(t.accept(e.segment(1)) == lynx::accept_result::accepted);
  CHECK(t.precision_level() == 0);
  CHECK(t.accept(e.segment(0)) == lynx::accept_result::accepted);
  CHECK(t.precision_level() == 3);
  CHECK(t.planes_present() == 16);
  CHECK(t.complete());
  CHECK(t.view().planes() == 16);
  CHECK(t.view_at(1).planes() == 4);
  CHECK(t.view_at(2).planes() == 8);
  CHECK(t.view().at_level(1).level == 1);
  // reset: a new request of the same shape starts from nothing
  t.reset(5);
  CHECK(t.precision_level() == 0);
  CHECK(t.generation() == 5);
  CHECK(!t.has_stream(1));
  CHECK_THROWS_AS(t.accept(e.segment(0)), lynx::error);  // generation 4 is stale now
  const auto e5 = lynx::encode<Plan, 32, float>(cview(in.keys), cview(in.values), 2, {5, 1});
  CHECK(t.accept(e5.segment(0)) == lynx::accept_result::accepted);
  CHECK(t.precision_level() == 1);
  CHECK(t.planes_present() == 4);
}

// ---------------------------------------------------------------------------
// Rejection of bad input
// ---------------------------------------------------------------------------

namespace {

// Everything observable about a receiver tensor.
template <class Plan, int G>
struct tensor_state {
  int level = 0;
  std::array<bool, lynx::max_streams> streams{};
  std::vector<std::vector<std::byte>> payloads;
  std::uint64_t generation = 0;

  explicit tensor_state(const lynx::host_bitplane_tensor<Plan, G>& t)
      : level(t.precision_level()), generation(t.generation()) {
    // view_at(0) exposes every present stream's payload, whatever the level.
    const auto v = t.view_at(0);
    for (int s = 0; s < Plan::streams; ++s) {
      streams[static_cast<std::size_t>(s)] = t.has_stream(s);
      const std::byte* p = v.payload[static_cast<std::size_t>(s)];
      payloads.emplace_back();
      if (p) payloads.back().assign(p, p + t.geometry().payload_bytes(s));
    }
    if (v.payload[0]) params.assign(v.payload[0], v.payload[0] + t.geometry().wire_params_bytes());
  }
  std::vector<std::byte> params;  // the parameters the view reads, once the anchor is there
  friend bool operator==(const tensor_state&, const tensor_state&) = default;
};

// Calls f, which must throw lynx::error with `code`; returns the message.
template <class F>
std::string expect_error(lynx::errc code, F&& f) {
  try {
    f();
  } catch (const lynx::error& e) {
    CHECK_MESSAGE(e.code() == code, "got " << lynx::to_string(e.code()) << ": " << e.what());
    return e.what();
  }
  FAIL_CHECK("no lynx::error thrown, expected " << lynx::to_string(code));
  return {};
}

std::vector<std::byte> bytes_of(std::span<const std::byte> s) { return {s.begin(), s.end()}; }

// A segment with a header field changed (and, when `reseal`, a valid checksum again).
template <class Mutate>
std::vector<std::byte> with_header(std::span<const std::byte> segment, Mutate&& mutate,
                                   bool reseal) {
  std::vector<std::byte> out = bytes_of(segment);
  lynx::segment_header h;
  std::memcpy(&h, out.data(), sizeof h);
  mutate(h);
  std::memcpy(out.data(), &h, sizeof h);
  if (reseal) lynx::seal_segment(out);
  return out;
}

template <class Plan>
using other_plan_t = std::conditional_t<std::is_same_v<Plan, lynx::plan_8_4_4>, lynx::plan_8_2_2_4,
                                        lynx::plan_8_4_4>;

}  // namespace

TEST_CASE_TEMPLATE_DEFINE(
    "bad input is rejected with the right error and the tensor stays as it was", C, reject_id) {
  using Plan = typename C::plan;
  using T = typename C::element;
  constexpr int G = C::group;
  using tensor_t = lynx::host_bitplane_tensor<Plan, G>;
  const lynx::kv_shape s{45, 2, 64};
  const std::uint32_t layer = 7;
  const std::uint64_t generation = 9;
  const auto in = make_input<T>(s, data_kind::random, layout_kind::token_major, 1234);
  const auto keys = cview(in.keys);
  const auto values = cview(in.values);
  const auto good = lynx::encode<Plan, G, T>(keys, values, layer, {generation, 1});

  // A tensor holding the anchor (level 1), and an empty one; every bad segment is
  // offered to both and must leave both as they were.
  tensor_t partial(s, layer, generation), empty(s, layer, generation);
  REQUIRE(partial.accept(good.segment(0)) == lynx::accept_result::accepted);
  const tensor_state<Plan, G> partial_before(partial), empty_before(empty);
  auto rejects = [&](lynx::errc code, std::span<const std::byte> segment, const char* what) {
    INFO(what);
    expect_error(code, [&] { (void)partial.accept(segment); });
    expect_error(code, [&] { (void)empty.accept(segment); });
    CHECK(tensor_state<Plan, G>(partial) == partial_before);
    CHECK(tensor_state<Plan, G>(empty) == empty_before);
  };
  const int last = Plan::streams - 1;  // a residual (or the anchor of a one-stream plan)
  const auto anchor = good.segment(0);

  SUBCASE("segments of another plan, group size, shape, layer or generation") {
    const auto other_plan =
        lynx::encode<other_plan_t<Plan>, G, T>(keys, values, layer, {generation, 1});
    rejects(lynx::errc::plan_mismatch, other_plan.segment(0), "another plan");
    constexpr int other_g = G == 32 ? 64 : 32;
    const auto other_group = lynx::encode<Plan, other_g, T>(keys, values, layer, {generation, 1});
    rejects(lynx::errc::plan_mismatch, other_group.segment(0), "another group size");
    rejects(lynx::errc::plan_mismatch, other_group.segment(last), "another group size, residual");
    for (const lynx::kv_shape other :
         {lynx::kv_shape{44, 2, 64}, lynx::kv_shape{45, 1, 64}, lynx::kv_shape{45, 2, 128}}) {
      const auto x = make_input<T>(other, data_kind::random, layout_kind::token_major, 5);
      const auto e =
          lynx::encode<Plan, G, T>(cview(x.keys), cview(x.values), layer, {generation, 1});
      const std::string msg =
          expect_error(lynx::errc::shape_mismatch, [&] { (void)partial.accept(e.segment(0)); });
      CHECK(msg.find(lynx::to_string(other)) != std::string::npos);
      rejects(lynx::errc::shape_mismatch, e.segment(last), "another shape");
    }
    const auto other_layer = lynx::encode<Plan, G, T>(keys, values, layer + 1, {generation, 1});
    rejects(lynx::errc::layer_mismatch, other_layer.segment(0), "another layer");
    rejects(lynx::errc::layer_mismatch, other_layer.segment(last), "another layer, residual");
    const auto stale = lynx::encode<Plan, G, T>(keys, values, layer, {generation - 1, 1});
    rejects(lynx::errc::stale_generation, stale.segment(0), "stale generation");
    rejects(lynx::errc::stale_generation, stale.segment(last), "stale generation, residual");
  }

  SUBCASE("truncated, padded and corrupted segments") {
    const std::vector<std::byte> full = bytes_of(good.segment(last));
    const std::span<const std::byte> seg(full);
    rejects(lynx::errc::truncated_segment, seg.first(seg.size() - 1), "one byte short");
    rejects(lynx::errc::truncated_segment, seg.first(lynx::segment_header_bytes), "header only");
    rejects(lynx::errc::truncated_segment, seg.first(lynx::segment_header_bytes - 1),
            "shorter than a header");
    rejects(lynx::errc::truncated_segment, seg.first(0), "empty");
    std::vector<std::byte> longer = full;
    longer.push_back(std::byte{0});
    rejects(lynx::errc::corrupted_segment, longer, "one trailing byte");
    longer.resize(full.size() + 64);
    rejects(lynx::errc::corrupted_segment, longer, "64 trailing bytes");
    for (const std::size_t at : {lynx::segment_header_bytes, full.size() / 2, full.size() - 1}) {
      std::vector<std::byte> flipped = full;
      flipped[at] ^= std::byte{0x10};
      rejects(lynx::errc::corrupted_segment, flipped, "payload bit flipped");
    }
    // Every single bit of the header: rejected (some field check or the checksum).
    for (std::size_t bit = 0; bit < 8 * lynx::segment_header_bytes; ++bit) {
      std::vector<std::byte> flipped = full;
      flipped[bit / 8] ^= std::byte{static_cast<unsigned char>(1u << (bit % 8))};
      bool threw = false;
      try {
        (void)partial.accept(flipped);
      } catch (const lynx::error&) {
        threw = true;
      }
      if (!threw) FAIL_CHECK("header bit " << bit << " flipped was accepted");
    }
    CHECK(tensor_state<Plan, G>(partial) == partial_before);
    // Fields only the checksum protects: the reserved bytes, the generation, the checksum itself.
    rejects(lynx::errc::corrupted_segment,
            with_header(
                seg, [](lynx::segment_header& h) { h.reserved[17] ^= 1; }, false),
            "reserved byte");
    rejects(lynx::errc::corrupted_segment,
            with_header(
                seg, [](lynx::segment_header& h) { h.generation ^= 4; }, false),
            "generation bit");
    rejects(lynx::errc::corrupted_segment,
            with_header(
                seg, [](lynx::segment_header& h) { h.checksum ^= 1ull << 40; }, false),
            "checksum bit");
    rejects(lynx::errc::bad_magic,
            with_header(
                seg, [](lynx::segment_header& h) { h.magic ^= 0x100; }, true),
            "bad magic");
    rejects(lynx::errc::unsupported_version,
            with_header(
                seg, [](lynx::segment_header& h) { h.version = 1; }, true),
            "version 1 (fp32 parameters)");
    rejects(lynx::errc::unsupported_version,
            with_header(
                seg, [](lynx::segment_header& h) { h.version = 3; }, true),
            "version 3");
    rejects(lynx::errc::unsupported_version,
            with_header(
                seg, [](lynx::segment_header& h) { h.layout = 7; }, true),
            "unknown layout");
    rejects(
        lynx::errc::corrupted_segment,
        with_header(
            seg,
            [](lynx::segment_header& h) { h.stream = static_cast<std::uint8_t>(Plan::streams); },
            true),
        "stream index past the plan");
    rejects(lynx::errc::corrupted_segment,
            with_header(
                seg, [](lynx::segment_header& h) { h.payload_bytes += 64; }, true),
            "payload size");
    rejects(lynx::errc::plan_mismatch,
            with_header(
                seg, [](lynx::segment_header& h) { h.value_group = 16; }, true),
            "value group");
    // A stream count past max_streams must be reported, not read past the widths array.
    rejects(lynx::errc::plan_mismatch,
            with_header(
                seg, [](lynx::segment_header& h) { h.streams = 200; }, true),
            "200 streams");
    lynx::plan_desc many = lynx::plan_desc::of<Plan>();
    many.streams = 200;
    CHECK(many.name().find("more streams") != std::string::npos);
  }

  SUBCASE("re-sealed anchors with forged parameters: NaN, infinite, negative or huge") {
    // The checksum protects against corruption, not forgery: anyone can re-seal.
    // The parameters are checked at accept and named by kv head and group.
    const lynx::layer_geometry& g = good.geometry();
    struct forgery {
      int section;         // 0 key_scale, 1 key_zero, 2 value_scale, 3 value_zero
      std::int64_t index;  // parameter index inside the section
      std::uint16_t bits;  // bf16 bits written there
      std::string where;   // expected in the message
    };
    const std::int64_t key_per_head = g.key_token_groups() * g.head_dim;
    const std::int64_t value_per_head = g.tokens * g.value_channel_groups();
    const forgery forgeries[] = {
        {0, key_per_head + (g.key_token_groups() - 1) * g.head_dim + 5, 0x7fc0,
         "key parameters of kv head 1, token group " + std::to_string(g.key_token_groups() - 1)},
        {1, 3, 0x7f80, "key parameters of kv head 0, token group 0"},
        {0, 7, 0xbf80, "key parameters of kv head 0"},  // scale -1
        {2, value_per_head + 2 * g.value_channel_groups(), 0x7f40,
         "value parameters of kv head 1, token 2,"},  // scale ~2.5e38: the range overflows
        {3, 0, 0xff80, "value parameters of kv head 0, token 0,"},
    };
    for (const forgery& f : forgeries) {
      std::vector<std::byte> forged = bytes_of(anchor);
      std::memcpy(forged.data() + lynx::segment_header_bytes +
                      g.param_section_offset(f.section, 2) + 2 * f.index,
                  &f.bits, 2);
      lynx::seal_segment(forged);
      INFO("section " << f.section << " index " << f.index);
      const std::string msg =
          expect_error(lynx::errc::corrupted_segment, [&] { (void)empty.accept(forged); });
      CHECK(msg.find(f.where) != std::string::npos);
      CHECK(msg.find("layer 7 stream 0") != std::string::npos);
      CHECK(tensor_state<Plan, G>(empty) == empty_before);
    }
  }

  SUBCASE("a conflicting duplicate: same stream, different content") {
    auto other = make_input<T>(s, data_kind::random, layout_kind::token_major, 4321);
    const auto different =
        lynx::encode<Plan, G, T>(cview(other.keys), cview(other.values), layer, {generation, 1});
    const std::string msg = expect_error(lynx::errc::corrupted_segment,
                                         [&] { (void)partial.accept(different.segment(0)); });
    CHECK(msg.find("differs") != std::string::npos);
    CHECK(tensor_state<Plan, G>(partial) == partial_before);
    CHECK(partial.accept(anchor) ==
          lynx::accept_result::duplicate);  // the true copy is still a duplicate
    CHECK(tensor_state<Plan, G>(partial) == partial_before);
  }

  SUBCASE("non-finite input names layer, kv head, token and channel") {
    const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity()};
    for (const float special : specials) {
      for (const bool in_keys : {true, false}) {
        for (const int threads : {1, 2}) {
          auto bad = make_input<T>(s, data_kind::random, layout_kind::head_major, 1234);
          (in_keys ? bad.keys : bad.values)(37, 1, 5) = lynx::from_float<T>(special);
          const std::string want = std::string("lynx: non_finite_input: ") +
                                   (in_keys ? "keys" : "values") + " of layer 7 holds " +
                                   (std::isnan(special) ? "NaN" : "infinity") +
                                   " at kv head 1, token 37, channel 5";
          const std::string got = expect_error(lynx::errc::non_finite_input, [&] {
            (void)lynx::encode<Plan, G, T>(cview(bad.keys), cview(bad.values), layer,
                                           {generation, threads});
          });
          CHECK(got == want);
          CHECK(expect_error(lynx::errc::non_finite_input, [&] {
                  (void)lynx::quantize<Plan, G, T>(cview(bad.keys), cview(bad.values), layer);
                }) == want);
        }
      }
    }
    if constexpr (!std::is_same_v<T, lynx::fp16>) {  // a finite range that overflows float (fp16
                                                     // cannot hold one)
      auto wide = make_input<T>(s, data_kind::random, layout_kind::token_major, 1234);
      wide.values(3, 0, 1) = lynx::from_float<T>(3e38f);
      wide.values(3, 0, 2) = lynx::from_float<T>(-3e38f);
      const std::string msg = expect_error(lynx::errc::invalid_argument, [&] {
        (void)lynx::encode<Plan, G, T>(cview(wide.keys), cview(wide.values), layer,
                                       {generation, 1});
      });
      CHECK(msg.find("exceeds the float range") != std::string::npos);
    }
  }

  SUBCASE("shapes the codec cannot take") {
    const auto x = make_input<T>({45, 2, 32}, data_kind::random, layout_kind::token_major, 8);
    const std::string msg = expect_error(lynx::errc::shape_mismatch, [&] {
      (void)lynx::encode<Plan, G, T>(keys, cview(x.values), layer);
    });
    CHECK(msg.find("[tokens=45, kv_heads=2, head_dim=64]") != std::string::npos);
    CHECK(msg.find("[tokens=45, kv_heads=2, head_dim=32]") != std::string::npos);
    expect_error(lynx::errc::shape_mismatch,
                 [&] { (void)lynx::quantize<Plan, G, T>(cview(x.keys), values); });
    // head_dim not a multiple of the value group (min(G, head_dim)): 1.5 G
    const lynx::kv_shape odd{10, 1, G + G / 2};
    const auto y = make_input<T>(odd, data_kind::random, layout_kind::token_major, 8);
    const std::string odd_msg = expect_error(lynx::errc::shape_mismatch, [&] {
      (void)lynx::encode<Plan, G, T>(cview(y.keys), cview(y.values), layer);
    });
    CHECK(odd_msg.find("head_dim " + std::to_string(G + G / 2) +
                       " is not a multiple of the value group size " + std::to_string(G)) !=
          std::string::npos);
    expect_error(lynx::errc::shape_mismatch, [&] { tensor_t t(odd, layer); });
    expect_error(lynx::errc::shape_mismatch, [&] { tensor_t t({0, 2, 64}, layer); });
    expect_error(lynx::errc::shape_mismatch, [&] { tensor_t t({4, 0, 64}, layer); });
    expect_error(lynx::errc::invalid_argument, [&] {
      (void)lynx::encode<Plan, G, T>(lynx::kv_view<const T>{nullptr, s, 128, 64, 1}, values, layer);
    });
  }

  SUBCASE("encode_into with wrong buffers leaves them untouched") {
    const lynx::layer_geometry g = lynx::make_geometry<Plan, G>(s);
    const std::vector<std::size_t> sizes = lynx::segment_sizes(g);
    REQUIRE(static_cast<int>(sizes.size()) == Plan::streams);
    for (int st = 0; st < Plan::streams; ++st)
      CHECK(sizes[static_cast<std::size_t>(st)] == good.segment(st).size());
    auto attempt = [&](int which, std::ptrdiff_t delta, int count) {
      std::vector<std::vector<std::byte>> buffers;
      for (int st = 0; st < Plan::streams; ++st)
        buffers.emplace_back(static_cast<std::size_t>(
                                 static_cast<std::ptrdiff_t>(sizes[static_cast<std::size_t>(st)]) +
                                 (st == which ? delta : 0)),
                             std::byte{0xab});
      std::vector<std::span<std::byte>> spans(buffers.begin(), buffers.begin() + count);
      const std::string msg = expect_error(lynx::errc::invalid_argument, [&] {
        lynx::encode_into<Plan, G, T>(
            keys, values, layer, std::span<const std::span<std::byte>>(spans), {generation, 1});
      });
      for (const auto& b : buffers)
        CHECK(std::all_of(b.begin(), b.end(), [](std::byte x) { return x == std::byte{0xab}; }));
      return msg;
    };
    CHECK(attempt(0, -1, Plan::streams).find("stream 0") != std::string::npos);
    CHECK(attempt(last, +1, Plan::streams).find("stream " + std::to_string(last)) !=
          std::string::npos);
    attempt(-1, 0, Plan::streams - 1);  // too few buffers
    // The right buffers: the same bytes as encode.
    std::vector<std::vector<std::byte>> buffers;
    for (int st = 0; st < Plan::streams; ++st)
      buffers.emplace_back(sizes[static_cast<std::size_t>(st)], std::byte{0xab});
    std::vector<std::span<std::byte>> spans(buffers.begin(), buffers.end());
    lynx::encode_into<Plan, G, T>(keys, values, layer, std::span<const std::span<std::byte>>(spans),
                                  {generation, 1});
    for (int st = 0; st < Plan::streams; ++st)
      CHECK(std::memcmp(buffers[static_cast<std::size_t>(st)].data(), good.segment(st).data(),
                        good.segment(st).size()) == 0);
  }

  SUBCASE(
      "reconstruct before the anchor, merge of an incomplete tensor, levels not present, split of "
      "another plan") {
    std::vector<float> k(static_cast<std::size_t>(s.elements())), v(k.size());
    const auto kout = lynx::token_major(k.data(), s), vout = lynx::token_major(v.data(), s);
    expect_error(lynx::errc::invalid_argument, [&] { lynx::reconstruct(empty, kout, vout); });
    if constexpr (Plan::streams > 1) {
      tensor_t residual_only(s, layer, generation);
      REQUIRE(residual_only.accept(good.segment(last)) == lynx::accept_result::accepted);
      CHECK(residual_only.precision_level() == 0);
      const std::string msg = expect_error(lynx::errc::invalid_argument,
                                           [&] { lynx::reconstruct(residual_only, kout, vout); });
      CHECK(msg.find("layer 7") != std::string::npos);
      const std::string merge_msg =
          expect_error(lynx::errc::invalid_argument, [&] { (void)lynx::merge(partial); });
      CHECK(merge_msg.find("1 of " + std::to_string(Plan::streams)) != std::string::npos);
      expect_error(lynx::errc::invalid_argument, [&] { (void)lynx::merge(residual_only); });
      expect_error(lynx::errc::invalid_argument, [&] { (void)partial.view_at(2); });
      expect_error(lynx::errc::invalid_argument, [&] { (void)partial.view().at_level(2); });
    }
    expect_error(lynx::errc::invalid_argument, [&] { (void)lynx::merge(empty); });
    expect_error(lynx::errc::invalid_argument, [&] { (void)partial.view_at(-1); });
    expect_error(lynx::errc::invalid_argument, [&] { (void)partial.view().at_level(0); });
    // Output of the wrong shape.
    std::vector<float> small(static_cast<std::size_t>(44 * 2 * 64));
    expect_error(lynx::errc::shape_mismatch, [&] {
      lynx::reconstruct(partial, lynx::token_major(small.data(), {44, 2, 64}), vout);
    });
    expect_error(lynx::errc::shape_mismatch, [&] {
      lynx::reconstruct(partial, kout, lynx::token_major(small.data(), {44, 2, 64}));
    });
    CHECK(tensor_state<Plan, G>(partial) == partial_before);
    // Codes of one plan split as another.
    const lynx::quantized_layer q = lynx::quantize<Plan, G, T>(keys, values, layer);
    expect_error(lynx::errc::plan_mismatch,
                 [&] { (void)lynx::split<other_plan_t<Plan>, G>(q, layer); });
  }
}
TEST_CASE_TEMPLATE_APPLY(reject_id, rejection_configs);

TEST_CASE(
    "whole blocks of 32 tokens, head_dim 128: non-finite input and wide ranges are reported") {
  using Plan = lynx::plan_8_4_4;
  using T = lynx::bf16;
  const lynx::kv_shape s{96, 2, 128};
  const std::uint32_t layer = 3;
  const float specials[] = {
      std::numeric_limits<float>::quiet_NaN(), -std::numeric_limits<float>::quiet_NaN(),
      std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity()};
  struct place {
    std::int64_t token, head, channel;
  };
  const place places[] = {{0, 0, 0}, {37, 1, 5}, {63, 1, 127}, {64, 0, 96}};
  for (const float special : specials)
    for (const place& at : places)
      for (const bool in_keys : {true, false}) {
        auto bad = make_input<T>(s, data_kind::random, layout_kind::token_major, 99);
        (in_keys ? bad.keys : bad.values)(at.token, at.head, at.channel) =
            lynx::from_float<T>(special);
        const std::string want = std::string("lynx: non_finite_input: ") +
                                 (in_keys ? "keys" : "values") + " of layer 3 holds " +
                                 (std::isnan(special) ? "NaN" : "infinity") + " at kv head " +
                                 std::to_string(at.head) + ", token " + std::to_string(at.token) +
                                 ", channel " + std::to_string(at.channel);
        CHECK(expect_error(lynx::errc::non_finite_input, [&] {
                (void)lynx::encode<Plan, 32, T>(cview(bad.keys), cview(bad.values), layer);
              }) == want);
      }
  for (const bool in_keys : {true, false}) {
    auto wide = make_input<T>(s, data_kind::random, layout_kind::token_major, 99);
    auto& x = in_keys ? wide.keys : wide.values;
    x(40, 1, 33) = lynx::from_float<T>(3e38f);
    x(in_keys ? 41 : 40, 1, in_keys ? 33 : 34) = lynx::from_float<T>(-3e38f);
    const std::string msg = expect_error(lynx::errc::invalid_argument, [&] {
      (void)lynx::encode<Plan, 32, T>(cview(wide.keys), cview(wide.values), layer);
    });
    CHECK(msg.find("exceeds the float range") != std::string::npos);
  }
}
