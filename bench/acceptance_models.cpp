// The acceptance study (issue 28): how much of a request can be drafted on the
// anchor alone, per anchor width and prompt length, on three real models:
// Gemma-3-270M at 1K, 4K, 16K and 32K prompt tokens (prompts of real text: slices
// of this repository's README.md, LICENSE and include/**/*.hpp, tokenized with
// the GGUF's tokenizer) and, side by side, stories260K and stories3M at 400
// tokens (their context is 512; prompts sampled from the model).
//
// Plans (anchor of B bits): 8 = 2 + 6, 8 = 4 + 4, 8 = 6 + 2, 16 = 4 + 12 and
// 16 = 8 + 8 (Gemma: the first four unless --acc_gemma_plans names more).
// Measures, per (model, prompt length, plan):
//   - first_disagreement: greedy decoding of N (64) tokens after the prefill's
//     own token, on the anchor only and at full precision (8-bit codes through
//     8 = 4 + 4, 16-bit through 16 = 4 + 12); tokens before the first
//     disagreement (0..N), on each prompt's main request;
//   - greedy / sampling_t0.8: one request per prompt length, the residual landing
//     after the draft limit (max_draft 8 and 16): drafts accepted at the one
//     verification, mean and rate over requests. Requests: each prompt at its
//     length and at shorter prefixes (length - j * length / 32), so a prompt
//     length gets --acc_gemma_requests requests without another prefill (the KV
//     of a prefix is the first rows of the prefilled KV; its first token is one
//     exact decode step, bitwise the prefill's last logits);
//   - exactness (Gemma at 4K, 16K, 32K; stories at 400): the committed tokens of a
//     greedy session (max_draft 8, landing after the limit, N + 1 tokens)
//     against blocking greedy decoding at the plan's full precision, for
//     8 = 4 + 4, 8 = 2 + 2 + 4 and 16 = 4 + 12. Reported, not asserted.
// Baselines in the same run: prefill, and blocking greedy decoding at full
// precision (ms per token). Every benchmark runs once (its work is the study);
// the counters are the results, and a markdown summary is printed at the end.
//
// Settings: --acc_<name>=value or the environment variable LYNX_ACC_<NAME>
// (flags win): models (stories260K,stories3M,gemma3), gemma_sizes
// (1024,4096,16384,32640), gemma_prompts (per size: 4,4,2,2), gemma_requests (per
// size: 8), gemma_exact_sizes (4096,16384,32640), gemma_plans
// (8=2+6,8=4+4,8=6+2,16=4+12), stories_plans (those and 16=8+8),
// stories_prompts (8), stories_tokens (400), stories_requests (32),
// decode_tokens (64), temperature (0.8), threads (0: all).
// 32640 = 32K - 128: the context is 32,768 and decoding needs room.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "acceptance/measures.hpp"
#include "gemma3/forward.hpp"
#include "gemma3/lynx_engine.hpp"
#include "gemma3/model.hpp"
#include "gemma3/model_path.hpp"
#include "gemma3/tokenizer.hpp"
#include "llama2c/llama2c.hpp"
#include "llama2c/lynx_engine.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/speculation/random.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/speculation/verifier.hpp"

namespace ll = lynx_examples::llama2c;
namespace g3 = lynx_examples::gemma3;
namespace acc = lynx_examples::acceptance;

namespace {

using plan_8_2_6 = lynx::stream_plan<8, 2, 6>;
using plan_8_6_2 = lynx::stream_plan<8, 6, 2>;
using plan_16_8_8 = lynx::stream_plan<16, 8, 8>;

// The plan whose full precision is the reference of every plan of B bits.
template <int Bits>
using reference_plan = std::conditional_t<Bits == 8, lynx::plan_8_4_4, lynx::plan_16_4_12>;

template <class Plan>
std::string compact_name() {  // "8 = 4 + 4" -> "8=4+4"
  std::string n = Plan::name();
  std::erase(n, ' ');
  return n;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// ---------------------------------------------------------------------------
// Settings
// ---------------------------------------------------------------------------

struct settings {
  std::vector<std::string> models{"stories260K", "stories3M", "gemma3"};
  std::vector<int> gemma_sizes{1024, 4096, 16384, 32640};
  std::vector<int> gemma_prompts{4, 4, 2, 2};
  std::vector<int> gemma_requests{8};
  std::vector<int> gemma_exact_sizes{4096, 16384, 32640};
  std::vector<std::string> gemma_plans{"8=2+6", "8=4+4", "8=6+2", "16=4+12"};
  std::vector<std::string> stories_plans{"8=2+6", "8=4+4", "8=6+2", "16=4+12", "16=8+8"};
  int stories_prompts = 8;
  int stories_tokens = 400;
  int stories_requests = 32;
  int decode_tokens = 64;
  double temperature = 0.8;
  int threads = 0;
};

settings& options() {
  static settings s;
  return s;
}

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  for (std::string item; std::getline(in, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

std::vector<int> split_ints(const std::string& s) {
  std::vector<int> out;
  for (const std::string& item : split(s)) out.push_back(std::stoi(item));
  return out;
}

// Applies one setting; false when the name is not one.
bool apply_setting(const std::string& name, const std::string& value) {
  settings& o = options();
  if (name == "models")
    o.models = split(value);
  else if (name == "gemma_sizes")
    o.gemma_sizes = split_ints(value);
  else if (name == "gemma_prompts")
    o.gemma_prompts = split_ints(value);
  else if (name == "gemma_requests")
    o.gemma_requests = split_ints(value);
  else if (name == "gemma_exact_sizes")
    o.gemma_exact_sizes = split_ints(value);
  else if (name == "gemma_plans")
    o.gemma_plans = split(value);
  else if (name == "stories_plans")
    o.stories_plans = split(value);
  else if (name == "stories_prompts")
    o.stories_prompts = std::stoi(value);
  else if (name == "stories_tokens")
    o.stories_tokens = std::stoi(value);
  else if (name == "stories_requests")
    o.stories_requests = std::stoi(value);
  else if (name == "decode_tokens")
    o.decode_tokens = std::stoi(value);
  else if (name == "temperature")
    o.temperature = std::stod(value);
  else if (name == "threads")
    o.threads = std::stoi(value);
  else
    return false;
  return true;
}

// Environment first, then --acc_* flags (removed from argv for Google Benchmark).
void read_settings(int& argc, char** argv) {
  for (const char* name :
       {"models", "gemma_sizes", "gemma_prompts", "gemma_requests", "gemma_exact_sizes",
        "gemma_plans", "stories_plans", "stories_prompts", "stories_tokens", "stories_requests",
        "decode_tokens", "temperature", "threads"}) {
    std::string env = "LYNX_ACC_";
    for (const char* c = name; *c != '\0'; ++c)
      env += static_cast<char>(std::toupper(static_cast<unsigned char>(*c)));
    if (const char* v = std::getenv(env.c_str()); v != nullptr && *v != '\0')
      apply_setting(name, v);
  }
  int kept = 1;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--acc_", 0) == 0) {
      const std::size_t eq = a.find('=');
      if (eq == std::string::npos || !apply_setting(a.substr(6, eq - 6), a.substr(eq + 1))) {
        std::fprintf(stderr, "unknown or malformed setting: %s\n", a.c_str());
        std::exit(2);
      }
      continue;
    }
    argv[kept++] = argv[i];
  }
  argc = kept;
  settings& o = options();
  if (o.gemma_prompts.size() != o.gemma_sizes.size())
    o.gemma_prompts.resize(o.gemma_sizes.size(), 2);
  if (o.gemma_requests.size() < o.gemma_sizes.size())
    o.gemma_requests.resize(o.gemma_sizes.size(),
                            o.gemma_requests.empty() ? 8 : o.gemma_requests.back());
}

bool listed(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

// ---------------------------------------------------------------------------
// The two model families
// ---------------------------------------------------------------------------

template <class Plan>
using prompt_tensors = std::vector<lynx::bitplane_tensor<Plan, 32, lynx::host_space>>;

// Receives every stream of every layer (the transport is not what is studied).
template <class Plan>
prompt_tensors<Plan> receive(std::vector<lynx::encoded_layer<Plan, 32>> encoded,
                             std::vector<lynx::kv_shape> shapes) {
  prompt_tensors<Plan> t;
  t.reserve(encoded.size());
  for (std::size_t l = 0; l < encoded.size(); ++l) {
    t.emplace_back(shapes[l], static_cast<std::uint32_t>(l));
    for (int s = 0; s < Plan::streams; ++s) t.back().accept(encoded[l].segment(s));
  }
  return t;
}

struct stories_family {
  using weights = ll::weights;
  using node = ll::engine<>;
  template <class Plan>
  using decode_engine = ll::lynx_decode_engine<Plan>;

  static std::unique_ptr<node> prefill(const weights& w, std::span<const std::int32_t> prompt,
                                       std::vector<float>& logits) {
    auto n = std::make_unique<node>(w);
    logits = n->prefill(prompt);
    return n;
  }
  static std::vector<float> prefix_logits(const weights& w, const node&,
                                          std::span<const std::int32_t> prompt, int tokens) {
    node e(w);
    return e.prefill(prompt.first(static_cast<std::size_t>(tokens)));
  }
  // The first `tokens` rows of the prefilled KV, encoded and received.
  template <class Plan>
  static prompt_tensors<Plan> encode_prefix(const weights& w, const node& n, int tokens) {
    const ll::kv_cache& cache = n.cache();
    const lynx::kv_shape shape{tokens, cache.n_kv_heads(), cache.head_dim()};
    std::vector<lynx::encoded_layer<Plan, 32>> enc;
    for (int l = 0; l < w.cfg().n_layers; ++l)
      enc.push_back(lynx::encode<Plan, 32, float>(
          lynx::token_major<const float>(cache.prompt_keys(l).data(), shape),
          lynx::token_major<const float>(cache.prompt_values(l).data(), shape),
          static_cast<std::uint32_t>(l)));
    return receive<Plan>(std::move(enc), std::vector<lynx::kv_shape>(
                                             static_cast<std::size_t>(w.cfg().n_layers), shape));
  }
  template <class Plan>
  static std::unique_ptr<decode_engine<Plan>> make_engine(const weights& w,
                                                          const prompt_tensors<Plan>& t,
                                                          int tokens) {
    return std::make_unique<decode_engine<Plan>>(w, t, tokens);
  }
};

// Exact fp32 attention over the first `prompt` rows of another engine's
// prefilled KV (the same arithmetic as gemma3::exact_attention): decoding token
// n - 1 on it gives bitwise the last logits of a prefill of n tokens.
class prefix_attention {
 public:
  prefix_attention(const g3::kv_cache* source, int prompt, const g3::config& c)
      : source_(source), prompt_(prompt), window_(c.window), local_(g3::local_layers(c)) {}

  void operator()(const g3::kv_cache& cache, int layer, std::span<const float> q, int tail_visible,
                  std::span<float> out) {
    const int head_dim = cache.head_dim();
    const int n_heads = static_cast<int>(q.size()) / head_dim;
    const int qpos = prompt_ + tail_visible - 1;
    const bool local = local_[static_cast<std::size_t>(layer)] && window_ > 0;
    const int first = local ? std::max(0, qpos - window_ + 1) : 0;
    const int stride = cache.token_stride();
    const int p0 = std::min(first, prompt_);
    const int t0 = std::max(0, first - prompt_);
    scores_.resize(static_cast<std::size_t>(prompt_ + tail_visible));
    const g3::detail::kv_range ranges[2] = {
        {source_->prompt_keys(layer).data() + static_cast<std::ptrdiff_t>(p0) * stride,
         source_->prompt_values(layer).data() + static_cast<std::ptrdiff_t>(p0) * stride,
         prompt_ - p0},
        {cache.tail_keys(layer).data() + static_cast<std::ptrdiff_t>(t0) * stride,
         cache.tail_values(layer).data() + static_cast<std::ptrdiff_t>(t0) * stride,
         tail_visible - t0}};
    g3::detail::exact_attend(ranges, q.data(), out.data(), n_heads, n_heads / cache.n_kv_heads(),
                             head_dim, stride, scores_.data());
  }

 private:
  const g3::kv_cache* source_;
  int prompt_;
  int window_;
  std::vector<bool> local_;
  std::vector<float> scores_;
};

struct gemma_family {
  using weights = g3::weights;
  using node = g3::engine<>;
  template <class Plan>
  using decode_engine = g3::lynx_decode_engine<Plan>;

  static std::unique_ptr<node> prefill(const weights& w, std::span<const std::int32_t> prompt,
                                       std::vector<float>& logits) {
    auto n = std::make_unique<node>(w, options().threads);
    logits.assign(static_cast<std::size_t>(w.cfg().vocab_size), 0.0f);
    const auto t0 = std::chrono::steady_clock::now();
    n->prefill(prompt, logits, false, 256, [&](int done, int all) {
      if (done % 4096 == 0 || done == all)
        std::fprintf(stderr, "  prefill %d / %d tokens (%.0f s)\n", done, all, seconds_since(t0));
    });
    return n;
  }
  static std::vector<float> prefix_logits(const weights& w, const node& n,
                                          std::span<const std::int32_t> prompt, int tokens) {
    g3::engine<prefix_attention> e(w, prefix_attention(&n.cache(), tokens - 1, w.cfg()),
                                   options().threads);
    e.begin_decode(tokens - 1);
    std::vector<float> row(static_cast<std::size_t>(w.cfg().vocab_size));
    e.decode(prompt.subspan(static_cast<std::size_t>(tokens - 1), 1), tokens - 1, row);
    return row;
  }
  // As gemma3::encode_prompt (window-aware), for the first `tokens` rows.
  template <class Plan>
  static prompt_tensors<Plan> encode_prefix(const weights& w, const node& n, int tokens) {
    const g3::kv_cache& cache = n.cache();
    const int stride = cache.token_stride();
    std::vector<lynx::encoded_layer<Plan, 32>> enc;
    std::vector<lynx::kv_shape> shapes;
    for (int l = 0; l < w.cfg().n_layers; ++l) {
      const int held = g3::shipped_tokens(w.cfg(), l, tokens);
      const lynx::kv_shape shape{held, cache.n_kv_heads(), cache.head_dim()};
      const std::ptrdiff_t first = static_cast<std::ptrdiff_t>(tokens - held) * stride;
      enc.push_back(lynx::encode<Plan, 32, float>(
          lynx::token_major<const float>(cache.prompt_keys(l).data() + first, shape),
          lynx::token_major<const float>(cache.prompt_values(l).data() + first, shape),
          static_cast<std::uint32_t>(l)));
      shapes.push_back(shape);
    }
    return receive<Plan>(std::move(enc), std::move(shapes));
  }
  template <class Plan>
  static std::unique_ptr<decode_engine<Plan>> make_engine(const weights& w,
                                                          const prompt_tensors<Plan>& t,
                                                          int tokens) {
    return std::make_unique<decode_engine<Plan>>(w, t, tokens, options().threads);
  }
};

// ---------------------------------------------------------------------------
// A model's study: its prompts (slices), requests and references
// ---------------------------------------------------------------------------

struct request {
  int slice = 0;
  int tokens = 0;     // prompt length
  bool main = false;  // the prompt at the study's length (not a shorter prefix)
};

template <class Family>
struct study {
  using weights = typename Family::weights;
  using node = typename Family::node;

  std::string name;
  const weights* w = nullptr;
  std::vector<int> sizes;     // prompt lengths studied
  std::vector<int> prompts;   // prompts at each length
  std::vector<int> requests;  // requests at each length (prompts x prefixes)
  std::vector<int> exact_sizes;
  std::vector<std::string> plans;  // compact plan names measured
  // prompt i of `tokens` tokens, and where it comes from
  std::function<std::vector<std::int32_t>(int i, int tokens, std::string& source)> make_prompt;

  struct slice {
    std::vector<std::int32_t> tokens;
    std::string source;
    std::unique_ptr<node> prefilled;
    std::map<int, std::int32_t> first_token;  // prompt length -> the prefill's own token
    std::vector<float> last_logits;           // the prefill's, at the slice's length
    double prefill_seconds = 0;
  };
  std::vector<slice> slices;
  std::map<std::tuple<int, int, int>, std::vector<std::int32_t>>
      references;  // (bits, slice, length) -> N tokens at full precision

  [[nodiscard]] int slice_count() const {
    return prompts.empty() ? 0 : *std::max_element(prompts.begin(), prompts.end());
  }
  // Slice i is as long as the longest length it is a prompt at.
  [[nodiscard]] int slice_length(int i) const {
    int n = 0;
    for (std::size_t k = 0; k < sizes.size(); ++k)
      if (i < prompts[k]) n = std::max(n, sizes[k]);
    return n;
  }
  [[nodiscard]] std::vector<request> requests_at(int k) const {
    const int n = sizes[static_cast<std::size_t>(k)], p = prompts[static_cast<std::size_t>(k)];
    const int per_prompt = std::max(1, (requests[static_cast<std::size_t>(k)] + p - 1) / p);
    std::vector<request> r;
    for (int i = 0; i < p; ++i)
      for (int j = 0; j < per_prompt; ++j) r.push_back({i, n - j * (n / 32), j == 0});
    return r;
  }
  [[nodiscard]] std::vector<request> main_requests(int k) const {
    std::vector<request> r;
    for (const request& q : requests_at(k))
      if (q.main) r.push_back(q);
    return r;
  }

  // Prefills slice i (once).
  slice& prepared(int i) {
    if (slices.size() < static_cast<std::size_t>(slice_count()))
      slices.resize(static_cast<std::size_t>(slice_count()));
    slice& s = slices[static_cast<std::size_t>(i)];
    if (!s.prefilled) {
      s.tokens = make_prompt(i, slice_length(i), s.source);
      std::fprintf(stderr, "%s: prefill of prompt %d (%zu tokens, %s)\n", name.c_str(), i,
                   s.tokens.size(), s.source.c_str());
      const auto t0 = std::chrono::steady_clock::now();
      s.prefilled = Family::prefill(*w, s.tokens, s.last_logits);
      s.prefill_seconds = seconds_since(t0);
      s.first_token[static_cast<int>(s.tokens.size())] = lynx::argmax_token(s.last_logits);
    }
    return s;
  }

  std::int32_t first_token(const request& q) {
    slice& s = prepared(q.slice);
    auto it = s.first_token.find(q.tokens);
    if (it != s.first_token.end()) return it->second;
    const std::int32_t t =
        lynx::argmax_token(Family::prefix_logits(*w, *s.prefilled, s.tokens, q.tokens));
    s.first_token[q.tokens] = t;
    return t;
  }

  template <class Plan>
  prompt_tensors<Plan> tensors(const request& q) {
    return Family::template encode_prefix<Plan>(*w, *prepared(q.slice).prefilled, q.tokens);
  }

  // Blocking greedy decoding at B-bit full precision: N tokens after the first.
  template <int Bits>
  const std::vector<std::int32_t>& reference(const request& q) {
    const auto key = std::make_tuple(Bits, q.slice, q.tokens);
    auto it = references.find(key);
    if (it != references.end()) return it->second;
    using P = reference_plan<Bits>;
    const auto t = tensors<P>(q);
    auto e = Family::template make_engine<P>(*w, t, q.tokens);
    return references[key] = acc::greedy_continuation(*e, q.tokens, first_token(q), P::streams,
                                                      options().decode_tokens);
  }
};

// ---------------------------------------------------------------------------
// Results (for the summary tables)
// ---------------------------------------------------------------------------

struct session_cell {
  lynx::session_stats stats;
  int requests = 0;
  std::vector<std::int64_t> accepted;  // per request, in requests_at order
  std::vector<bool> main;              // whether that request is its prompt's main one
};

struct result_row {
  std::vector<int> before_disagreement;  // per main request
  double anchor_ms_per_token = 0;
  std::map<std::pair<std::string, int>, session_cell> sessions;  // (verifier, max_draft)
  int exact_requests = -1, exact_of = 0, tokens_compared = 0;
  lynx::session_stats exact_stats;
};

struct results_store {
  std::vector<std::tuple<std::string, int, std::string>> order;
  std::map<std::tuple<std::string, int, std::string>, result_row> rows;
  std::vector<std::string> prefill_lines, baseline_lines, check_lines;

  result_row& row(const std::string& model, int tokens, const std::string& plan) {
    const auto key = std::make_tuple(model, tokens, plan);
    if (!rows.contains(key)) order.push_back(key);
    return rows[key];
  }
};

results_store& results() {
  static results_store r;
  return r;
}

std::string size_label(int n) {
  if (n >= 1024 && n % 1024 == 0) return std::to_string(n / 1024) + "K";
  if (n > 32000) return "32K-128";
  return std::to_string(n);
}

// ---------------------------------------------------------------------------
// Benchmarks
// ---------------------------------------------------------------------------

template <class Family>
void prefill_bench(benchmark::State& state, study<Family>* s, int i) {
  for (auto _ : state) {
    auto& sl = s->prepared(i);
    state.SetIterationTime(sl.prefill_seconds);
    // The first token of a shorter prefix comes from one exact decode step over the
    // prefilled rows: it must equal the prefill's last logits bitwise (checked at full length).
    const auto t = static_cast<int>(sl.tokens.size());
    const std::vector<float>& full = sl.last_logits;
    const auto by_decode = Family::prefix_logits(*s->w, *sl.prefilled, sl.tokens, t);
    const bool same = by_decode.size() == full.size() &&
                      std::memcmp(by_decode.data(), full.data(), full.size() * sizeof(float)) == 0;
    state.counters["prefix_path_bitwise_equal"] = same ? 1 : 0;
    state.counters["tokens"] = t;
    state.counters["tokens_per_s"] = t / sl.prefill_seconds;
    char line[256];
    std::snprintf(line, sizeof line, "| %s | %d | %d | %.1f | %.0f | %s | %s |", s->name.c_str(), i,
                  t, sl.prefill_seconds, t / sl.prefill_seconds, same ? "yes" : "NO",
                  sl.source.c_str());
    results().prefill_lines.push_back(line);
  }
}

// The reference itself: blocking greedy decoding at full precision, main requests.
template <class Family, int Bits>
void blocking_bench(benchmark::State& state, study<Family>* s, int k) {
  for (auto _ : state) {
    const auto reqs = s->main_requests(k);
    for (const request& q : reqs) (void)s->first_token(q);
    const auto t0 = std::chrono::steady_clock::now();
    for (const request& q : reqs) (void)s->template reference<Bits>(q);
    const double sec = seconds_since(t0);
    state.SetIterationTime(sec);
    const double tokens = static_cast<double>(reqs.size()) * options().decode_tokens;
    state.counters["ms_per_token"] = 1e3 * sec / tokens;
    state.counters["requests"] = static_cast<double>(reqs.size());
    char line[200];
    std::snprintf(line, sizeof line, "| %s | %s | %d-bit | %zu x %d | %.1f |", s->name.c_str(),
                  size_label(s->sizes[static_cast<std::size_t>(k)]).c_str(), Bits, reqs.size(),
                  options().decode_tokens, 1e3 * sec / tokens);
    results().baseline_lines.push_back(line);
  }
}

template <class Family, class Plan>
void first_disagreement_bench(benchmark::State& state, study<Family>* s, int k) {
  const int n = s->sizes[static_cast<std::size_t>(k)];
  result_row& row = results().row(s->name, n, compact_name<Plan>());
  for (auto _ : state) {
    const auto reqs = s->main_requests(k);
    std::vector<prompt_tensors<Plan>> tensors;
    for (const request& q : reqs) {
      (void)s->template reference<Plan::bits>(q);
      tensors.push_back(s->template tensors<Plan>(q));
    }
    row.before_disagreement.clear();
    std::int64_t decoded = 0;
    const auto t0 = std::chrono::steady_clock::now();
    for (std::size_t r = 0; r < reqs.size(); ++r) {
      const request& q = reqs[r];
      const auto& ref = s->template reference<Plan::bits>(q);
      auto e = Family::template make_engine<Plan>(*s->w, tensors[r], q.tokens);
      const auto anchor = acc::greedy_continuation(*e, q.tokens, s->first_token(q), 1,
                                                   options().decode_tokens, ref);
      decoded += static_cast<std::int64_t>(anchor.size());
      row.before_disagreement.push_back(acc::common_prefix(anchor, ref));
    }
    const double sec = seconds_since(t0);
    state.SetIterationTime(sec);
    row.anchor_ms_per_token = decoded ? 1e3 * sec / static_cast<double>(decoded) : 0;
    double sum = 0;
    int all = 0;
    for (const int c : row.before_disagreement) {
      sum += c;
      all += c == options().decode_tokens ? 1 : 0;
    }
    state.counters["mean_tokens_before_disagreement"] =
        reqs.empty() ? 0 : sum / static_cast<double>(reqs.size());
    state.counters["same_all_N"] = all;
    state.counters["requests"] = static_cast<double>(reqs.size());
    state.counters["anchor_ms_per_token"] = row.anchor_ms_per_token;
    std::string per;
    for (const int c : row.before_disagreement) {
      per += ' ';
      per += std::to_string(c);
    }
    state.SetLabel("per prompt:" + per);
  }
}

template <class Family, class Plan, class Verifier>
void acceptance_bench(benchmark::State& state, study<Family>* s, int k, int max_draft,
                      std::string verifier_name) {
  const int n = s->sizes[static_cast<std::size_t>(k)];
  result_row& row = results().row(s->name, n, compact_name<Plan>());
  session_cell& cell = row.sessions[{verifier_name, max_draft}];
  for (auto _ : state) {
    const auto reqs = s->requests_at(k);
    std::vector<prompt_tensors<Plan>> tensors;
    for (const request& q : reqs) {
      (void)s->first_token(q);
      tensors.push_back(s->template tensors<Plan>(q));
    }
    const auto t0 = std::chrono::steady_clock::now();
    cell = {};
    for (std::size_t r = 0; r < reqs.size(); ++r) {
      const request& q = reqs[r];
      auto e = Family::template make_engine<Plan>(*s->w, tensors[r], q.tokens);
      Verifier v{};
      if constexpr (std::is_same_v<Verifier, lynx::sampling_verifier>) {
        v.temperature = static_cast<float>(options().temperature);
        v.rng.seed = ll::splitmix64(std::hash<std::string>{}(s->name) ^
                                    (static_cast<std::uint64_t>(q.slice) << 32) ^
                                    static_cast<std::uint64_t>(q.tokens));
      }
      const auto out =
          acc::land_after_draft_limit(*e, v, Plan::streams, q.tokens, s->first_token(q), max_draft);
      cell.stats.verifications += out.stats.verifications;
      cell.stats.verified_drafts += out.stats.verified_drafts;
      cell.stats.accepted_drafts += out.stats.accepted_drafts;
      cell.stats.draft_tokens += out.stats.draft_tokens;
      cell.stats.forwards += out.stats.forwards;
      cell.accepted.push_back(out.stats.accepted_drafts);
      cell.main.push_back(q.main);
      ++cell.requests;
    }
    state.SetIterationTime(seconds_since(t0));
    state.counters["mean_accepted"] = cell.stats.mean_accepted_length();
    state.counters["acceptance_rate"] = cell.stats.acceptance_rate();
    state.counters["verifications"] = static_cast<double>(cell.stats.verifications);
    state.counters["drafts"] = static_cast<double>(cell.stats.draft_tokens);
    state.counters["requests"] = cell.requests;
  }
}

// Greedy Lynx sessions (max_draft 8, landing after the limit) committing N + 1 tokens
// against blocking greedy decoding at the plan's full precision.
template <class Family, class Plan>
void exactness_bench(benchmark::State& state, study<Family>* s, int k) {
  const int n = s->sizes[static_cast<std::size_t>(k)];
  result_row& row = results().row(s->name, n, compact_name<Plan>());
  for (auto _ : state) {
    const auto reqs = s->main_requests(k);
    const auto t0 = std::chrono::steady_clock::now();
    row.exact_requests = 0;
    row.exact_of = 0;
    row.tokens_compared = 0;
    row.exact_stats = {};
    for (const request& q : reqs) {
      const auto t = s->template tensors<Plan>(q);
      const std::int32_t first = s->first_token(q);
      std::vector<std::int32_t> want{first};
      if constexpr (std::is_same_v<Plan, reference_plan<Plan::bits>>) {
        const auto& ref = s->template reference<Plan::bits>(q);
        want.insert(want.end(), ref.begin(), ref.end());
      } else {  // this plan's own blocking decoding
        auto blocking = Family::template make_engine<Plan>(*s->w, t, q.tokens);
        const auto ref = acc::greedy_continuation(*blocking, q.tokens, first, Plan::streams,
                                                  options().decode_tokens);
        want.insert(want.end(), ref.begin(), ref.end());
      }
      auto e = Family::template make_engine<Plan>(*s->w, t, q.tokens);
      const auto out = acc::land_after_draft_limit(*e, lynx::greedy_verifier{}, Plan::streams,
                                                   q.tokens, first, 8, options().decode_tokens + 1);
      ++row.exact_of;
      row.exact_requests += out.committed == want ? 1 : 0;
      row.tokens_compared += static_cast<int>(out.committed.size());
      row.exact_stats.verifications += out.stats.verifications;
      row.exact_stats.accepted_drafts += out.stats.accepted_drafts;
      row.exact_stats.verified_drafts += out.stats.verified_drafts;
    }
    state.SetIterationTime(seconds_since(t0));
    state.counters["exact_requests"] = row.exact_requests;
    state.counters["requests"] = row.exact_of;
    state.counters["tokens_compared"] = row.tokens_compared;
    state.counters["mean_accepted"] = row.exact_stats.mean_accepted_length();
  }
}

// ---------------------------------------------------------------------------
// Registration
// ---------------------------------------------------------------------------

template <class... Plans>
struct plan_list {};
using acceptance_plans =
    plan_list<plan_8_2_6, lynx::plan_8_4_4, plan_8_6_2, lynx::plan_16_4_12, plan_16_8_8>;
using exactness_plans = plan_list<lynx::plan_8_4_4, lynx::plan_8_2_2_4, lynx::plan_16_4_12>;

template <class F>
benchmark::internal::Benchmark* add(const std::string& name, F&& f) {
  return benchmark::RegisterBenchmark(name.c_str(), std::forward<F>(f))
      ->Iterations(1)
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
}

template <class Family, class Plan>
void register_plan(study<Family>* s, int k) {
  const std::string plan = compact_name<Plan>();
  if (!listed(s->plans, plan)) return;
  const std::string at = s->name +
                         "/tokens:" + std::to_string(s->sizes[static_cast<std::size_t>(k)]) +
                         "/plan:" + plan;
  add("first_disagreement/" + at, [s, k](benchmark::State& st) {
    const auto t0 = std::chrono::steady_clock::now();
    first_disagreement_bench<Family, Plan>(st, s, k);
    st.counters["wall_s"] = seconds_since(t0);
  });
  for (const int md : {8, 16}) {
    add("greedy/" + at + "/max_draft:" + std::to_string(md), [s, k, md](benchmark::State& st) {
      const auto t0 = std::chrono::steady_clock::now();
      acceptance_bench<Family, Plan, lynx::greedy_verifier>(st, s, k, md, "greedy");
      st.counters["wall_s"] = seconds_since(t0);
    });
  }
  for (const int md : {8, 16}) {
    add("sampling_t" + std::to_string(options().temperature).substr(0, 3) + "/" + at +
            "/max_draft:" + std::to_string(md),
        [s, k, md](benchmark::State& st) {
          const auto t0 = std::chrono::steady_clock::now();
          acceptance_bench<Family, Plan, lynx::sampling_verifier>(st, s, k, md, "sampling");
          st.counters["wall_s"] = seconds_since(t0);
        });
  }
}

template <class Family, class Plan>
void register_exactness(study<Family>* s, int k) {
  add("exactness/" + s->name + "/tokens:" + std::to_string(s->sizes[static_cast<std::size_t>(k)]) +
          "/plan:" + compact_name<Plan>(),
      [s, k](benchmark::State& st) {
        const auto t0 = std::chrono::steady_clock::now();
        exactness_bench<Family, Plan>(st, s, k);
        st.counters["wall_s"] = seconds_since(t0);
      });
}

template <class Family, class... Plans, class... Exact>
void register_study(study<Family>* s, plan_list<Plans...>, plan_list<Exact...>) {
  for (int i = 0; i < s->slice_count(); ++i)
    add("prefill/" + s->name + "/prompt:" + std::to_string(i) +
            "/tokens:" + std::to_string(s->slice_length(i)),
        [s, i](benchmark::State& st) { prefill_bench(st, s, i); });
  for (int k = 0; k < static_cast<int>(s->sizes.size()); ++k) {
    const std::string at =
        s->name + "/tokens:" + std::to_string(s->sizes[static_cast<std::size_t>(k)]);
    add("blocking_greedy/" + at + "/bits:8",
        [s, k](benchmark::State& st) { blocking_bench<Family, 8>(st, s, k); });
    add("blocking_greedy/" + at + "/bits:16",
        [s, k](benchmark::State& st) { blocking_bench<Family, 16>(st, s, k); });
    (register_plan<Family, Plans>(s, k), ...);
    if (std::find(s->exact_sizes.begin(), s->exact_sizes.end(),
                  s->sizes[static_cast<std::size_t>(k)]) != s->exact_sizes.end())
      (register_exactness<Family, Exact>(s, k), ...);
  }
}

// ---------------------------------------------------------------------------
// Models and prompts
// ---------------------------------------------------------------------------

std::string read_text(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  if (!f) throw std::runtime_error("cannot read " + p.string());
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

// README.md, LICENSE, include/**/*.hpp (sorted), tokenized once; file boundaries kept.
struct corpus {
  std::vector<std::int32_t> tokens;
  std::vector<std::pair<std::size_t, std::string>> files;  // (first character, path)
  std::string text;
};

const corpus& repository_corpus(const g3::tokenizer& tok) {
  static const corpus c = [&] {
    corpus r;
    const std::filesystem::path root(LYNX_SOURCE_DIR);
    std::vector<std::filesystem::path> paths{root / "README.md", root / "LICENSE"};
    std::vector<std::filesystem::path> headers;
    for (const auto& e : std::filesystem::recursive_directory_iterator(root / "include"))
      if (e.is_regular_file() && e.path().extension() == ".hpp") headers.push_back(e.path());
    std::sort(headers.begin(), headers.end());
    paths.insert(paths.end(), headers.begin(), headers.end());
    for (const auto& p : paths) {
      r.files.emplace_back(r.text.size(), std::filesystem::relative(p, root).string());
      r.text += read_text(p);
    }
    const auto t0 = std::chrono::steady_clock::now();
    r.tokens = tok.encode(r.text, /*add_bos=*/false);
    std::fprintf(stderr, "corpus: %zu files, %zu bytes, %zu tokens (tokenized in %.1f s)\n",
                 r.files.size(), r.text.size(), r.tokens.size(), seconds_since(t0));
    return r;
  }();
  return c;
}

struct gemma_model {
  std::unique_ptr<g3::weights> w;
  std::unique_ptr<g3::tokenizer> tok;
};

gemma_model& gemma() {
  static gemma_model m = [] {
    gemma_model g;
    if (const auto p = g3::find_model()) {
      g.w = std::make_unique<g3::weights>(*p);
      g.tok = std::make_unique<g3::tokenizer>(g.w->file());
    }
    return g;
  }();
  return m;
}

// stories260K ships with the sources (examples/models/README.md); stories3M,
// whose weights carry no licence, stays in the shared models folder.
std::filesystem::path stories_dir(const std::string& name) {
  return name == "stories260K" ? std::filesystem::path(LYNX_SOURCE_DIR) / "examples" / "models"
                               : std::filesystem::path(LYNX_SHARED_DIR) / "models";
}

std::unique_ptr<ll::weights> load_stories(const std::string& name) {
  const auto path = stories_dir(name) / (name + ".bin");
  return std::filesystem::exists(path) ? std::make_unique<ll::weights>(path) : nullptr;
}

// ---------------------------------------------------------------------------
// Summary
// ---------------------------------------------------------------------------

std::string accepted_cell(const result_row& r, const std::string& verifier, int md) {
  const auto it = r.sessions.find({verifier, md});
  if (it == r.sessions.end() || it->second.requests == 0) return "-";
  char b[64];
  std::snprintf(b, sizeof b, "%.2f (%.0f%%)", it->second.stats.mean_accepted_length(),
                100.0 * it->second.stats.acceptance_rate());
  return b;
}

void print_summary(double wall_seconds) {
  const results_store& rs = results();
  const int N = options().decode_tokens;
  std::printf("\n## Acceptance study (issue 28)\n\n");
  std::printf(
      "Anchor = the plan's first stream. \"Before 1st disagreement\": greedy decoding of %d "
      "tokens on the anchor only vs at full precision (B-bit codes), mean over prompts "
      "[min-max], and how many prompts agree on all %d. Greedy / sampling (T = %.1f): mean "
      "drafts accepted at the one verification of a request whose residual lands after the "
      "draft limit (md = max_draft), with the acceptance rate (accepted / drafted).\n\n",
      N, N, options().temperature);
  std::printf(
      "| model | prompt | plan | anchor | requests | before 1st disagreement | all %d | greedy "
      "md 8 | greedy md 16 | sampling md 8 | sampling md 16 |\n",
      N);
  std::printf("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  std::vector<std::string> consistency;
  for (const auto& key : rs.order) {
    const result_row& r = rs.rows.at(key);
    const auto& [model, tokens, plan] = key;
    if (r.before_disagreement.empty() && r.sessions.empty()) continue;
    const std::size_t eq = plan.find('='), plus = plan.find('+');
    const std::string anchor =
        plan.substr(eq + 1, plus - eq - 1) + " of " + plan.substr(0, eq) + " bits";
    std::string disagreement = "-", all = "-";
    if (!r.before_disagreement.empty()) {
      double sum = 0;
      int lo = N, hi = 0, same = 0;
      for (const int c : r.before_disagreement) {
        sum += c;
        lo = std::min(lo, c);
        hi = std::max(hi, c);
        same += c == N ? 1 : 0;
      }
      char b[64];
      std::snprintf(b, sizeof b, "%.1f [%d-%d]",
                    sum / static_cast<double>(r.before_disagreement.size()), lo, hi);
      disagreement = b;
      all = std::to_string(same) + " / " + std::to_string(r.before_disagreement.size());
    }
    int requests = 0;
    for (const auto& [k, cell] : r.sessions) requests = std::max(requests, cell.requests);
    std::printf("| %s | %s | %s | %s | %d | %s | %s | %s | %s | %s | %s |\n", model.c_str(),
                size_label(tokens).c_str(), plan.c_str(), anchor.c_str(), requests,
                disagreement.c_str(), all.c_str(), accepted_cell(r, "greedy", 8).c_str(),
                accepted_cell(r, "greedy", 16).c_str(), accepted_cell(r, "sampling", 8).c_str(),
                accepted_cell(r, "sampling", 16).c_str());
    // Greedy checks: md 8 accepts min(8, md 16's accepted); a main request accepts
    // min(md, tokens before the first disagreement).
    const auto g8 = r.sessions.find({"greedy", 8}), g16 = r.sessions.find({"greedy", 16});
    if (g8 != r.sessions.end() && g16 != r.sessions.end() &&
        g8->second.accepted.size() == g16->second.accepted.size()) {
      int bad = 0;
      for (std::size_t i = 0; i < g8->second.accepted.size(); ++i)
        bad += g8->second.accepted[i] != std::min<std::int64_t>(8, g16->second.accepted[i]) ? 1 : 0;
      if (bad)
        consistency.push_back(model + " " + size_label(tokens) + " " + plan +
                              ": greedy md 8 != min(8, md 16) on " + std::to_string(bad) +
                              " requests");
    }
    for (const auto* g : {&g8, &g16}) {
      if (*g == r.sessions.end() || r.before_disagreement.empty()) continue;
      const int md = (*g)->first.second;
      std::size_t m = 0;
      int bad = 0;
      for (std::size_t i = 0; i < (*g)->second.accepted.size(); ++i) {
        if (!(*g)->second.main[i]) continue;
        if (m < r.before_disagreement.size() &&
            (*g)->second.accepted[i] != std::min(md, r.before_disagreement[m]))
          ++bad;
        ++m;
      }
      if (bad)
        consistency.push_back(model + " " + size_label(tokens) + " " + plan + ": greedy md " +
                              std::to_string(md) +
                              " accepted != min(md, tokens before the first disagreement) on " +
                              std::to_string(bad) + " main requests");
    }
  }
  if (consistency.empty())
    std::printf(
        "\nGreedy consistency (both hold on every request measured): md 8 accepted min(8, what md "
        "16 "
        "accepted); on each main request, md accepted min(md, tokens before the first "
        "disagreement).\n");
  for (const auto& c : consistency) std::printf("\nINCONSISTENT: %s\n", c.c_str());

  bool any_exact = false;
  for (const auto& key : rs.order) any_exact |= rs.rows.at(key).exact_requests >= 0;
  if (any_exact) {
    std::printf(
        "\n### Exactness (greedy session, max_draft 8, residual after the draft limit, %d "
        "committed tokens vs blocking greedy at the plan's full precision)\n\n",
        N + 1);
    std::printf(
        "| model | prompt | plan | exact requests | tokens compared | accepted at the landing |\n");
    std::printf("| --- | --- | --- | --- | --- | --- |\n");
    for (const auto& key : rs.order) {
      const result_row& r = rs.rows.at(key);
      if (r.exact_requests < 0) continue;
      const auto& [model, tokens, plan] = key;
      std::printf("| %s | %s | %s | %d / %d | %d | %.2f per verification |\n", model.c_str(),
                  size_label(tokens).c_str(), plan.c_str(), r.exact_requests, r.exact_of,
                  r.tokens_compared, r.exact_stats.mean_accepted_length());
    }
  }
  if (!rs.prefill_lines.empty()) {
    std::printf(
        "\n### Prefill (exact fp32, once per prompt; shorter prompts are its prefixes)\n\n");
    std::printf(
        "| model | prompt | tokens | seconds | tokens/s | prefix path bitwise = prefill | source "
        "|\n");
    std::printf("| --- | --- | --- | --- | --- | --- | --- |\n");
    for (const auto& l : rs.prefill_lines) std::printf("%s\n", l.c_str());
  }
  if (!rs.baseline_lines.empty()) {
    std::printf(
        "\n### Blocking greedy decoding at full precision (the reference; main requests)\n\n");
    std::printf(
        "| model | prompt | codes | tokens | ms / token |\n| --- | --- | --- | --- | --- |\n");
    for (const auto& l : rs.baseline_lines) std::printf("%s\n", l.c_str());
  }
  std::printf("\nTotal wall time: %.0f s\n", wall_seconds);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  read_settings(argc, argv);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  const settings& o = options();

  // The studies live until the end of main (benchmarks point at them).
  std::vector<std::unique_ptr<ll::weights>> stories_weights;
  std::vector<std::unique_ptr<study<stories_family>>> stories;
  for (const char* name : {"stories260K", "stories3M"}) {
    if (!listed(o.models, name)) continue;
    auto w = load_stories(name);
    if (!w) {
      std::fprintf(stderr, "%s: model not found in %s; skipped\n", name,
                   stories_dir(name).string().c_str());
      continue;
    }
    auto s = std::make_unique<study<stories_family>>();
    s->name = name;
    s->w = w.get();
    s->sizes = {o.stories_tokens};
    s->prompts = {o.stories_prompts};
    s->requests = {o.stories_requests};
    s->exact_sizes = {o.stories_tokens};
    s->plans = o.stories_plans;
    const ll::weights* wp = w.get();
    s->make_prompt = [wp](int i, int tokens, std::string& source) {
      source = "sampled from the model, seed " + std::to_string(i);
      const auto p = ll::sample_prompt(*wp, static_cast<std::uint64_t>(i), tokens);
      return std::vector<std::int32_t>(p.begin(), p.end());
    };
    register_study(s.get(), acceptance_plans{}, exactness_plans{});
    stories_weights.push_back(std::move(w));
    stories.push_back(std::move(s));
  }

  std::unique_ptr<study<gemma_family>> gemma_study;
  if (listed(o.models, "gemma3")) {
    if (gemma().w == nullptr) {
      std::fprintf(stderr, "gemma3: GGUF not found at %s (cmake/fetch_gemma3.sh); skipped\n",
                   g3::default_model_path().string().c_str());
    } else {
      gemma_study = std::make_unique<study<gemma_family>>();
      study<gemma_family>& s = *gemma_study;
      s.name = "gemma3-270m";
      s.w = gemma().w.get();
      s.sizes = o.gemma_sizes;
      s.prompts = o.gemma_prompts;
      s.requests = std::vector<int>(
          o.gemma_requests.begin(),
          o.gemma_requests.begin() + static_cast<std::ptrdiff_t>(o.gemma_sizes.size()));
      s.exact_sizes = o.gemma_exact_sizes;
      s.plans = o.gemma_plans;
      const int slices = s.slice_count();
      s.make_prompt = [slices](int i, int tokens, std::string& source) {
        const g3::tokenizer& tok = *gemma().tok;
        const corpus& c = repository_corpus(tok);
        const std::size_t body = static_cast<std::size_t>(tokens - 1);  // after BOS
        if (c.tokens.size() < body)
          throw std::runtime_error("corpus of " + std::to_string(c.tokens.size()) +
                                   " tokens is shorter than a prompt of " + std::to_string(tokens));
        const std::size_t offset = std::min(
            c.tokens.size() * static_cast<std::size_t>(i) / static_cast<std::size_t>(slices),
            c.tokens.size() - body);
        std::vector<std::int32_t> p{tok.bos()};
        p.insert(p.end(), c.tokens.begin() + static_cast<std::ptrdiff_t>(offset),
                 c.tokens.begin() + static_cast<std::ptrdiff_t>(offset + body));
        // Which file the slice starts in: the decoded length of the tokens before it.
        const std::size_t at = tok.decode(std::span(c.tokens).first(offset)).size();
        std::string file = "?";
        for (const auto& [begin, path] : c.files)
          if (begin <= at) file = path;
        source = "corpus tokens " + std::to_string(offset) + ".." + std::to_string(offset + body) +
                 ", from " + file;
        return p;
      };
      register_study(gemma_study.get(), acceptance_plans{}, exactness_plans{});
    }
  }

  const auto t0 = std::chrono::steady_clock::now();
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  print_summary(seconds_since(t0));
  return 0;
}
