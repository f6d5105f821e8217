// Decode attention over a partly arrived KV cache: queries of consecutive
// positions attend to a prompt (a bit-plane tensor at its current precision
// level, reconstructed inside the dot products; a complete layer merged into
// codes, lynx::code_view, with the same bits as all its planes; or a dense
// bf16/float cache, the 16-bit baseline; or nothing) followed by a local
// full-precision tail of float, bf16 or fp16 rows (fp16 rows are read by the
// portable loops on every path: the bits of a float tail of the same values).
//
//   queries  [n_queries][q_heads][head_dim] float, bf16 or fp16, positions prompt_tokens +
//            tail_visible(i) - 1
//   output   [n_queries][q_heads][head_dim] float, bf16 or fp16;  lse [n_queries][q_heads] (natural
//   log, optional) query i sees every prompt token and tail tokens [0, tail_visible(i)),
//   tail_visible(i) = base + per_query * (i + 1)   (causal verification: per_query = 1)
//
// Batch invariance: each (query, kv head, split) partial state is a function of
// that query and its context alone (fixed split size by context position, fixed
// lane-to-token assignment, fp32 accumulation); partial states merge in context
// order. So a query's output bits do not depend on n_queries, on the thread
// count, or on which thread computes which split.
//
// Every check builds its message only when it fails (`if (!ok) fail(...)`):
// the functor runs once per layer per decoded token.
//
// Non-finite input is not scanned for up front (the tail and a dense prompt are
// engine-owned and change every step): a call whose output is not finite throws
// errc::non_finite_input naming the first NaN or infinity among the queries, the
// tail tokens the offending query sees and a dense prompt's kv head, or
// errc::invalid_argument when those are finite and a logit overflowed float. The
// output of such a call is not to be used. (A bit-plane prompt cannot hold one:
// encode rejects non-finite K/V.)
//
// Usage:
//   lynx::decode_attention<> attn{};  // default variant
//   lynx::attention_workspace ws(attn.problem(prompt_view, tail_k, queries, visibility),
//                                threads);
//   attn(prompt_view, tail_k, tail_v, queries, visibility, output, ws, {.threads = threads});
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "lynx/attention/code_tensor.hpp"
#include "lynx/attention/tile_math.hpp"
#include "lynx/attention/variant.hpp"
#include "lynx/backend/host/attention_kernels.hpp"
#include "lynx/backend/host/parallel.hpp"
#include "lynx/core/buffer.hpp"
#include "lynx/core/error.hpp"
#include "lynx/core/executor.hpp"
#include "lynx/core/types.hpp"
#include "lynx/core/view.hpp"
#include "lynx/planes/tensor.hpp"
#include "lynx/quant/quantizer.hpp"

namespace lynx {

/// Queries of consecutive positions: data[i][h][c], [count][q_heads][head_dim].
/// float queries in `data`, or bf16 / fp16 ones in `data_bf16` / `data_fp16`
/// (exactly one set): they are widened to float exactly as they are read, so a
/// call gives the bits of the same call on their float values.
struct attention_queries {
  const float* data = nullptr;
  std::int64_t count = 0;
  std::int64_t q_heads = 0;
  std::int64_t head_dim = 0;
  const bf16* data_bf16 = nullptr;
  const fp16* data_fp16 = nullptr;

  /// Element k of the queries as float.
  [[nodiscard]] float at(std::int64_t k) const {
    if (data != nullptr) return data[k];
    return data_bf16 != nullptr ? to_float(data_bf16[k]) : to_float(data_fp16[k]);
  }
  /// How many of the three pointers are set.
  [[nodiscard]] int sources() const {
    return (data != nullptr) + (data_bf16 != nullptr) + (data_fp16 != nullptr);
  }
};

/// Where results go: data [count][q_heads][head_dim] (float, or bf16 / fp16 in
/// data_bf16 / data_fp16: exactly one set, each the float result rounded to
/// nearest even); lse [count][q_heads] or null.
struct attention_output {
  float* data = nullptr;
  float* lse = nullptr;
  bf16* data_bf16 = nullptr;
  fp16* data_fp16 = nullptr;

  [[nodiscard]] int sources() const {
    return (data != nullptr) + (data_bf16 != nullptr) + (data_fp16 != nullptr);
  }
};

/// How many tail tokens query i sees: base + per_query * (i + 1).
///
/// Example: one new token decoded with a tail that already holds it, the tail
/// holding n tokens in all: the query sees the whole tail, {.base = n - 1,
/// .per_query = 1} (visible(0) = n). Verifying k drafted tokens appended as the
/// last k of an n-token tail, causally: query i sees the tail up to and including
/// draft i, {.base = n - k, .per_query = 1} (visible(i) = n - k + i + 1). A
/// prompt-only call with no tail: {.base = 0, .per_query = 0}.
struct tail_visibility {
  std::int64_t base = 0;
  std::int64_t per_query = 1;
  [[nodiscard]] constexpr std::int64_t operator()(std::int64_t i) const {
    return base + per_query * (i + 1);
  }
};

/// No prompt: the context is the tail alone.
struct no_prompt {};

/// A dense prompt cache (the 16-bit baseline, or an engine that reconstructed to bf16).
template <class T>
struct dense_prompt {
  kv_view<const T, host_space> keys, values;
};

enum class attention_path : std::uint8_t {
  automatic,          // AVX-512 where the CPU has it and the shape allows, else AVX2 where the
                      // CPU has AVX2 + FMA, else portable
  portable,           // plain loops (the reference walk; same bits as the AVX-512 one), compiled
                      // for AVX2 + FMA where the CPU has them
  avx512,             // error when the CPU lacks AVX-512
  portable_baseline,  // the portable loops as built (for the target the build chose): same bits
  avx2,               // the AVX2 kernels (the portable loops for what they do not take); error
                      // when the CPU lacks AVX2 + FMA
};

struct attention_options {
  int threads = 1;  // <= 0: all hardware threads
  attention_path path = attention_path::automatic;
  task_executor* executor = nullptr;  // the engine's workers run the threads' shares (optional)
};

/// The shape facts a workspace is sized by.
struct attention_problem {
  std::int64_t n_queries = 1;
  std::int64_t q_heads = 1;
  std::int64_t kv_heads = 1;
  std::int64_t head_dim = 0;
  std::int64_t prompt_tokens = 0;
  std::int64_t max_tail_visible = 0;
  std::int64_t value_groups =
      1;  // value channel groups per token of a bit-plane prompt (1 otherwise)
  std::int64_t item_kv_heads = 1;  // kv heads one work item may walk together (dense prompts)

  [[nodiscard]] std::int64_t prompt_splits() const {
    return ceil_div(prompt_tokens, attention_split_tokens);
  }
  [[nodiscard]] std::int64_t tail_splits() const {
    return ceil_div(max_tail_visible, attention_split_tokens);
  }
  [[nodiscard]] std::int64_t splits() const { return prompt_splits() + tail_splits(); }
  [[nodiscard]] std::int64_t group_heads() const { return q_heads / kv_heads; }
  /// Floats of the partial states: [n_queries][kv_heads][splits][group heads] x (m, l,
  /// acc[head_dim]).
  [[nodiscard]] std::int64_t partial_floats() const {
    return n_queries * kv_heads * splits() * group_heads() * (head_dim + 2);
  }
};

namespace detail {

template <class P>
struct prompt_traits {
  static constexpr bool valid = false;
};
template <>
struct prompt_traits<no_prompt> {
  static constexpr bool valid = true;
};
template <stream_plan_type Plan, int G>
struct prompt_traits<bitplane_view<Plan, G, host_space>> {
  static constexpr bool valid = true;
};
template <stream_plan_type Plan, int G>
struct prompt_traits<code_view<Plan, G>> {
  static constexpr bool valid = true;
};
// fp16 dense prompts: the AVX2 and AVX-512 dense kernels read float and bf16 only.
template <class T>
struct prompt_traits<dense_prompt<T>> {
  static constexpr bool valid = std::is_same_v<T, float> || std::is_same_v<T, bf16>;
};

}  // namespace detail

/// A prompt the host attention reads: no_prompt, a host bitplane_view, a
/// code_view (a complete layer merged into codes), or a dense_prompt<bf16|float>.
template <class P>
concept host_attention_prompt = detail::prompt_traits<std::remove_cvref_t<P>>::valid;

/// One request of a batched call (decode_attention::batch): its prompt (a
/// bit-plane view at that request's own precision level, say), its local tail
/// (paged or not), its queries and where its results go.
template <class Prompt, class TailT>
struct attention_request {
  Prompt prompt{};
  kv_view<const TailT, host_space> tail_keys{}, tail_values{};
  attention_queries queries{};
  tail_visibility visible{};
  attention_output out{};
};

/// Caller-owned scratch of the attention: sized once (not on the hot path),
/// then reused by every call whose problem fits.
class attention_workspace {
 public:
  attention_workspace() = default;
  attention_workspace(const attention_problem& p, int threads) { reserve(p, threads); }

  static std::size_t bytes_needed(const attention_problem& p, int threads) {
    const int t = threads <= 0 ? detail::hardware_threads() : threads;
    const std::int64_t per_thread =
        detail::split_scratch_floats(p.group_heads(), p.head_dim, p.value_groups, p.item_kv_heads) +
        64;
    return static_cast<std::size_t>((p.partial_floats() + 16 + per_thread * t) * 4);
  }
  /// Grows the buffer to fit (allocates only when it is too small).
  void reserve(const attention_problem& p, int threads) { reserve_bytes(bytes_needed(p, threads)); }
  /// Grows the buffer to `n` bytes (decode_attention::batch_bytes for a batched call).
  void reserve_bytes(std::size_t n) {
    if (n > buffer_.size()) buffer_ = aligned_buffer(n);
  }
  [[nodiscard]] std::size_t size() const noexcept { return buffer_.size(); }
  [[nodiscard]] float* data() noexcept { return reinterpret_cast<float*>(buffer_.data()); }

 private:
  aligned_buffer buffer_;
};

namespace detail {

inline void check_tail(const attention_queries& q, std::int64_t kv_heads, const kv_shape& tk,
                       const kv_shape& tv, bool tail_present) {
  if (!tail_present) return;
  if (!(tk == tv))
    detail::fail(errc::shape_mismatch, "attention: tail keys " + to_string(tk) +
                                           " and tail values " + to_string(tv) + " differ");
  if (!(tk.tokens == 0 || (tk.kv_heads == kv_heads && tk.head_dim == q.head_dim)))
    detail::fail(errc::shape_mismatch,
                 "attention: tail " + to_string(tk) +
                     " does not match kv_heads=" + std::to_string(kv_heads) +
                     " and the queries' head_dim=" + std::to_string(q.head_dim));
}

}  // namespace detail

namespace detail {

/// The walks a call takes for `path` on this CPU: whether the AVX-512 kernels
/// run where they take a source, and the walk where they do not (or are not
/// asked for). A path the CPU lacks is refused.
struct walk_choice {
  bool simd;
  host_walk fallback;
};
inline walk_choice choose_walks(attention_path path) {
  if (path == attention_path::avx512 && !host_has_avx512())
    fail(errc::invalid_argument, "attention: AVX-512 path requested on a CPU without AVX-512F/BW");
  if (path == attention_path::avx2 && !host_has_fma())
    fail(errc::invalid_argument, "attention: AVX2 path requested on a CPU without AVX2 and FMA");
  const bool simd =
      (path == attention_path::automatic || path == attention_path::avx512) && host_has_avx512();
  const host_walk fallback =
      path == attention_path::portable_baseline || !host_has_fma()        ? host_walk::baseline
      : path == attention_path::avx2 || path == attention_path::automatic ? host_walk::avx2
                                                                          : host_walk::fma;
  return {simd, fallback};
}

}  // namespace detail

/// The decode attention functor; Variant sets the softmax scale, soft-cap and window.
template <class Variant = default_variant>
class decode_attention {
  static_assert(
      attention_variant<Variant>,
      "decode_attention: Variant must model lynx::attention_variant: a nested `variant_tag`, "
      "query_scale(int), a static constexpr bool has_logit_transform, transform_logit(float) and "
      "window()");

 public:
  Variant variant{};

  /// The problem of a call, for sizing a workspace.
  template <class Prompt, class TailT>
  static attention_problem problem(const Prompt& prompt,
                                   const kv_view<const TailT, host_space>& tail_keys,
                                   const attention_queries& q, tail_visibility vis) {
    attention_problem p;
    p.n_queries = q.count;
    p.q_heads = q.q_heads;
    p.head_dim = q.head_dim;
    p.max_tail_visible = q.count > 0 ? std::max(vis(0), vis(q.count - 1)) : 0;
    if constexpr (std::is_same_v<Prompt, no_prompt>) {
      p.kv_heads = tail_keys.shape.kv_heads;
    } else if constexpr (requires { prompt.geometry; }) {
      p.kv_heads = prompt.geometry.kv_heads;
      p.prompt_tokens = prompt.geometry.tokens;
      p.value_groups = prompt.geometry.value_channel_groups();
    } else {
      p.kv_heads = prompt.keys.shape.kv_heads;
      p.prompt_tokens = prompt.keys.shape.tokens;
    }
    if (p.kv_heads <= 0) p.kv_heads = 1;
    if constexpr (requires { prompt.keys; }) {  // dense_heads_together
      using T = std::remove_const_t<typename decltype(prompt.keys)::element_type>;
      if constexpr (std::is_same_v<T, bf16>) p.item_kv_heads = p.kv_heads;
    }
    return p;
  }

  /// Runs the attention of one call (see the header comment). Defined out of the
  /// class, not inline: with lynx::kernels linked, the shipped configurations are
  /// declared `extern template` (lynx/attention/kernels.hpp) and compiled once.
  template <class Prompt, class TailT>
  void operator()(const Prompt& prompt, kv_view<const TailT, host_space> tail_keys,
                  kv_view<const TailT, host_space> tail_values, const attention_queries& q,
                  tail_visibility vis, attention_output out, attention_workspace& ws,
                  const attention_options& options = {}) const;

  /// Workspace bytes of a batched call with `threads` threads (<= 0: every hardware thread).
  template <class Prompt, class TailT>
  static std::size_t batch_bytes(std::span<const attention_request<Prompt, TailT>> requests,
                                 int threads) {
    const int t = threads <= 0 ? detail::hardware_threads() : threads;
    std::int64_t partials = 0, per_thread = 0;
    for (const auto& r : requests) {
      const attention_problem p = problem(r.prompt, r.tail_keys, r.queries, r.visible);
      partials += p.partial_floats() + 16;
      per_thread =
          std::max(per_thread, detail::split_scratch_floats(p.group_heads(), p.head_dim,
                                                            p.value_groups, p.item_kv_heads) +
                                   64);
    }
    return static_cast<std::size_t>((partials + 16 + per_thread * t) * 4);
  }

  /// Many requests in one call: the work items of all of them run in one pool
  /// of workers, and each request's outputs are the bits its own call would
  /// give (every item is computed as in that call, and each request's partial
  /// states merge in its own context order), whatever else shares the batch.
  /// Requests may differ in query count, prompt length and level, tail and
  /// visibility. Size the workspace with batch_bytes. A request that fails its
  /// checks is named in the error ("attention batch: request 3: ...") and
  /// nothing is computed.
  template <class Prompt, class TailT>
  void batch(std::span<const attention_request<Prompt, TailT>> requests, attention_workspace& ws,
             const attention_options& options = {}) const;

 private:
  template <class Prompt, class TailT>
  static void validate(const Prompt& prompt, const kv_view<const TailT, host_space>& tk,
                       const kv_view<const TailT, host_space>& tv, const attention_queries& q,
                       tail_visibility vis, const attention_output& out,
                       const attention_problem& p) {
    if (!(q.count >= 0 && q.q_heads >= 1 && q.head_dim >= 1))
      detail::fail(errc::shape_mismatch,
                   "attention: queries need q_heads >= 1 and head_dim >= 1, got count=" +
                       std::to_string(q.count) + " q_heads=" + std::to_string(q.q_heads) +
                       " head_dim=" + std::to_string(q.head_dim));
    if (!(q.count == 0 || (q.sources() == 1 && out.sources() == 1)))
      detail::fail(errc::invalid_argument,
                   "attention: " + std::to_string(q.sources()) + " query and " +
                       std::to_string(out.sources()) +
                       " output pointers set; exactly one of each (data, data_bf16, data_fp16)");
    if constexpr (requires { prompt.geometry; }) {
      if (!(prompt.level >= 1))
        detail::fail(errc::invalid_argument, "attention: prompt layer " +
                                                 std::to_string(prompt.layer) +
                                                 " has no anchor yet (precision level 0)");
      if (!(prompt.geometry.head_dim == q.head_dim))
        detail::fail(errc::shape_mismatch, "attention: queries have head_dim " +
                                               std::to_string(q.head_dim) +
                                               " but the prompt has head_dim " +
                                               std::to_string(prompt.geometry.head_dim));
    } else if constexpr (!std::is_same_v<Prompt, no_prompt>) {
      detail::check_paging(prompt.keys, "attention: prompt keys");
      detail::check_paging(prompt.values, "attention: prompt values");
      if (!(prompt.keys.shape == prompt.values.shape))
        detail::fail(errc::shape_mismatch, "attention: prompt keys " +
                                               to_string(prompt.keys.shape) + " and values " +
                                               to_string(prompt.values.shape) + " differ");
      if (!(prompt.keys.shape.head_dim == q.head_dim))
        detail::fail(errc::shape_mismatch, "attention: queries have head_dim " +
                                               std::to_string(q.head_dim) +
                                               " but the prompt has head_dim " +
                                               std::to_string(prompt.keys.shape.head_dim));
    }
    if (!(q.q_heads % p.kv_heads == 0))
      detail::fail(errc::shape_mismatch, "attention: q_heads " + std::to_string(q.q_heads) +
                                             " is not a multiple of kv_heads " +
                                             std::to_string(p.kv_heads));
    detail::check_paging(tk, "attention: tail keys");
    detail::check_paging(tv, "attention: tail values");
    const bool tail_used = p.max_tail_visible > 0 || tk.shape.tokens > 0;
    detail::check_tail(q, p.kv_heads, tk.shape, tv.shape, tail_used);
    if (q.count > 0) {
      const std::int64_t lo = std::min(vis(0), vis(q.count - 1));
      if (!(lo >= 0 && p.max_tail_visible <= tk.shape.tokens))
        detail::fail(errc::shape_mismatch, "attention: queries see tail tokens up to " +
                                               std::to_string(p.max_tail_visible) +
                                               " (and at least " + std::to_string(lo) +
                                               "), the tail holds " +
                                               std::to_string(tk.shape.tokens));
      if (!(p.prompt_tokens + lo >= 1))
        detail::fail(errc::invalid_argument,
                     "attention: a query would see no token at all (no prompt, empty tail)");
    }
    if (p.max_tail_visible > 0 && tk.data == nullptr)
      detail::fail(errc::invalid_argument, "attention: null tail data");
  }

  /// One call's work as the workers walk it: its problem, sources, walks and
  /// where its partial states go. run() walks one; batch() the items of many in
  /// one pool, each item computed exactly as in its own call.
  template <class Source, class TailT>
  struct job {
    attention_problem p;
    const Source* prompt_src = nullptr;
    detail::dense_kv_source<TailT> tail;
    attention_queries q;
    tail_visibility vis;
    attention_output out;
    detail::host_walk prompt_walk = detail::host_walk::baseline,
                      tail_walk = detail::host_walk::baseline;
    std::int64_t gk = 1, chunks = 1, splits = 0, prompt_splits = 0, items = 0;
    float* partials = nullptr;
    [[nodiscard]] std::int64_t scratch_floats() const {
      return detail::split_scratch_floats(p.group_heads(), p.head_dim, p.value_groups, gk) + 64;
    }
  };

  template <class Source, class TailT>
  job<Source, TailT> make_job(const attention_problem& p, const Source* prompt_src,
                              kv_view<const TailT, host_space> tail_keys,
                              kv_view<const TailT, host_space> tail_values,
                              const attention_queries& q, tail_visibility vis, attention_output out,
                              int threads, bool simd, detail::host_walk fallback,
                              float* partials) const {
    job<Source, TailT> j;
    j.p = p;
    j.prompt_src = prompt_src;
    j.tail = {tail_keys, tail_values};
    j.q = q;
    j.vis = vis;
    j.out = out;
    j.partials = partials;
    const int heads = static_cast<int>(p.group_heads());
    j.splits = p.splits();
    j.prompt_splits = p.prompt_splits();
    const bool prompt_simd = simd && prompt_src != nullptr && detail::avx512_supports(*prompt_src);
    const bool tail_simd = simd && p.max_tail_visible > 0 && detail::avx512_supports(j.tail);
    j.prompt_walk = prompt_simd ? detail::host_walk::avx512 : fallback;
    j.tail_walk = tail_simd ? detail::host_walk::avx512 : fallback;
    // Work items: (query, split, kv heads) or (query, kv head, split). A dense bf16
    // token-major prompt on the AVX-512 path is walked gk kv heads per item (the
    // rows of a token together, front to back), gk as large as keeps two items per
    // thread; everything else one kv head per item. (gk changes which worker
    // computes what, never a result.)
    if constexpr (std::is_same_v<Source, detail::dense_kv_source<bf16>>) {
      if (prompt_simd &&
          detail::dense_heads_together(prompt_src->keys, prompt_src->values, heads)) {
        std::int64_t parts = 1;
        while (parts < p.kv_heads && q.count * j.splits * parts < 2 * threads) parts *= 2;
        j.gk = std::min(p.item_kv_heads, ceil_div(p.kv_heads, parts));
      }
    }
    j.chunks = ceil_div(p.kv_heads, j.gk);
    j.items = q.count * j.chunks * j.splits;
    return j;
  }

  /// Work item `item` of job `j` with a worker's scratch; `end`: the end of the
  /// worker's run of items of this job (for the prefetch of the next split).
  template <class Source, class TailT>
  void run_item(const job<Source, TailT>& j, std::int64_t item, std::int64_t end,
                const detail::split_scratch& w) const {
    const attention_problem& p = j.p;
    const attention_queries& q = j.q;
    const int D = static_cast<int>(p.head_dim);
    const int heads = static_cast<int>(p.group_heads());
    const std::int64_t splits = j.splits, prompt_splits = j.prompt_splits, chunks = j.chunks,
                       gk = j.gk;
    const float qscale = variant.query_scale(D);
    const std::int64_t window = variant.window();
    const std::int64_t stride_state = D + 2;
    const std::int64_t stride_g = splits * heads * stride_state;  // between kv heads' states
    // Which item runs where never changes what it computes; the order only
    // serves the memory walk. A dense token-major cache: kv heads fastest, so
    // consecutive items read the same tokens' rows (pages stay in the TLB).
    // A bit-plane prompt keeps each kv head's planes and parameters in
    // contiguous sections: split fastest, so a worker streams through them
    // front to back and the hardware prefetchers follow.
    constexpr bool split_fastest = requires { j.prompt_src->view; };
    const std::int64_t i = item / (chunks * splits);
    const std::int64_t s = split_fastest ? item % splits : (item / chunks) % splits;
    const std::int64_t c = split_fastest ? (item / splits) % chunks : item % chunks;
    const std::int64_t g0 = c * gk, gn = std::min(gk, p.kv_heads - g0);
    float* state0 = j.partials + ((i * p.kv_heads + g0) * splits + s) * heads * stride_state;
    const std::int64_t visible = j.vis(i);
    const std::int64_t qpos = p.prompt_tokens + visible - 1;
    const std::int64_t first_pos = window > 0 ? qpos - window + 1 : 0;
    const std::int64_t q0 = (i * q.q_heads + g0 * heads) * D, qn = gn * heads * D;
    float* qsc = w.queries;  // [gn][heads][D]
    if (q.data != nullptr)
      for (std::int64_t k = 0; k < qn; ++k) qsc[k] = q.data[q0 + k] * qscale;
    else
      for (std::int64_t k = 0; k < qn; ++k) qsc[k] = q.at(q0 + k) * qscale;
    std::int64_t t0, t1, first_visible;
    const bool in_prompt = s < prompt_splits;
    if (in_prompt) {
      t0 = s * attention_split_tokens;
      t1 = std::min(p.prompt_tokens, t0 + attention_split_tokens);
      first_visible = first_pos;
    } else {
      t0 = (s - prompt_splits) * attention_split_tokens;
      t1 = std::min(visible, t0 + attention_split_tokens);
      first_visible = first_pos - p.prompt_tokens;
    }
    if (t1 <= t0 || first_visible >= t1) {
      for (std::int64_t k = 0; k < gn; ++k)
        for (int h = 0; h < heads; ++h) {
          state0[k * stride_g + h] = attention_neg_inf;
          state0[k * stride_g + heads + h] = 0.0f;
        }
      return;
    }
#if LYNX_ATTENTION_AVX512
    if constexpr (std::is_same_v<Source, detail::dense_kv_source<bf16>>) {
      if (in_prompt && gk > 1) {
        detail::compute_split_heads(*j.prompt_src, g0, static_cast<int>(gn), qsc, heads, t0, t1,
                                    first_visible, variant, w, state0, stride_g);
        return;
      }
    }
#endif
    for (std::int64_t k = 0; k < gn; ++k) {
      const std::int64_t g = g0 + k;
      float* state = state0 + k * stride_g;
      float* m = state;                // [heads]
      float* l = state + heads;        // [heads]
      float* acc = state + 2 * heads;  // [heads][D]
      const float* qg = qsc + k * heads * D;
      if (in_prompt) {
        detail::next_split next{};  // the prompt split this worker walks next, if any
        if constexpr (split_fastest) {
          const std::int64_t s2 = (item + 1) % splits;
          if (item + 1 < end && s2 < prompt_splits)  // kv head of the next item
            next = {((item + 1) / splits) % chunks, s2 * attention_split_tokens,
                    std::min(p.prompt_tokens, (s2 + 1) * attention_split_tokens)};
        }
        detail::compute_split(*j.prompt_src, g, qg, heads, t0, t1, first_visible, variant,
                              j.prompt_walk, w, m, l, acc, next);
      } else {
        detail::compute_split(j.tail, g, qg, heads, t0, t1, first_visible, variant, j.tail_walk, w,
                              m, l, acc);
      }
    }
  }

  /// Merges a job's partial states in context order (prompt splits, then tail
  /// splits) into its outputs; `row`: D floats of scratch (the workers are done).
  template <class Source, class TailT>
  void combine(const job<Source, TailT>& j, float* row) const {
    const attention_problem& p = j.p;
    const attention_queries& q = j.q;
    const attention_output& out = j.out;
    const int D = static_cast<int>(p.head_dim);
    const int heads = static_cast<int>(p.group_heads());
    const std::int64_t splits = j.splits, stride_state = D + 2;
    std::int64_t first_bad = -1;  // (query, q head) of the first output that is not finite
    for (std::int64_t i = 0; i < q.count; ++i)
      for (std::int64_t g = 0; g < p.kv_heads; ++g)
        for (int h = 0; h < heads; ++h) {
          const std::int64_t at = (i * q.q_heads + g * heads + h) * D;
          float* o = out.data != nullptr ? out.data + at : row;
          float mm = attention_neg_inf, ll = 0.0f;
          for (int c = 0; c < D; ++c) o[c] = 0.0f;
          for (std::int64_t s = 0; s < splits; ++s) {
            const float* state =
                j.partials + ((i * p.kv_heads + g) * splits + s) * heads * stride_state;
            merge_partial_state(mm, ll, o, state[h], state[heads + h], state + 2 * heads + h * D,
                                D);
          }
          const float inv = 1.0f / ll;
          bool finite = true;
          for (int c = 0; c < D; ++c) finite &= is_finite_value(o[c] *= inv);
          if (!finite && first_bad < 0) first_bad = i * q.q_heads + g * heads + h;
          if (out.data_bf16 != nullptr)
            for (int c = 0; c < D; ++c) out.data_bf16[at + c] = bf16(o[c]);
          if (out.data_fp16 != nullptr)
            for (int c = 0; c < D; ++c) {
              out.data_fp16[at + c] = fp16(o[c]);
              if (finite && !is_finite_value(to_float(out.data_fp16[at + c])))
                detail::fail(errc::invalid_argument,
                             "attention: the output of query " + std::to_string(i) + ", head " +
                                 std::to_string(g * heads + h) + " is " + std::to_string(o[c]) +
                                 " at channel " + std::to_string(c) +
                                 ", beyond fp16's range (65504): ask for float or bf16 output");
            }
          if (out.lse)
            out.lse[i * q.q_heads + g * heads + h] = (mm + std::log2(ll)) * attention_ln2;
        }
    if (first_bad >= 0) [[unlikely]]
      report_non_finite(p, j.prompt_src, j.tail.keys, j.tail.values, q, j.vis, first_bad);
  }

  template <class Source, class TailT>
  void run(const attention_problem& p, const Source* prompt_src,
           kv_view<const TailT, host_space> tail_keys, kv_view<const TailT, host_space> tail_values,
           const attention_queries& q, tail_visibility vis, attention_output out,
           attention_workspace& ws, const attention_options& options, bool simd,
           detail::host_walk fallback) const {
    const int threads = options.threads <= 0 ? detail::hardware_threads() : options.threads;
    float* partials = ws.data();
    const job<Source, TailT> j = make_job(p, prompt_src, tail_keys, tail_values, q, vis, out,
                                          threads, simd, fallback, partials);
    const int heads = static_cast<int>(p.group_heads());
    float* scratch_base = partials + p.partial_floats() + 16;
    const std::int64_t per_thread = j.scratch_floats();
    const std::int64_t items = j.items;
    detail::parallel_for(
        threads, threads,
        [&](std::int64_t w0, std::int64_t w1) {
          for (std::int64_t worker = w0; worker < w1; ++worker) {
            const detail::split_scratch w = detail::carve_scratch(
                scratch_base + worker * per_thread, heads, p.head_dim, p.value_groups, j.gk);
            const std::int64_t i0 = items * worker / threads, i1 = items * (worker + 1) / threads;
            for (std::int64_t item = i0; item < i1; ++item) run_item(j, item, i1, w);
          }
        },
        options.executor);
    combine(j, scratch_base);
  }

  /// The first NaN or infinity of `x` at kv head g, tokens [0, tokens), else nothing.
  template <class T>
  static void find_non_finite(const kv_view<const T, host_space>& x, std::int64_t tokens,
                              std::int64_t g, const char* what) {
    for (std::int64_t t = 0; t < tokens; ++t)
      for (std::int64_t c = 0; c < x.shape.head_dim; ++c) {
        const float v = to_float(x(t, g, c));
        if (!is_finite_value(v))
          detail::fail(errc::non_finite_input,
                       std::string("attention: ") + what + " hold " +
                           (v != v ? "NaN" : "infinity") + " at kv head " + std::to_string(g) +
                           ", token " + std::to_string(t) + ", channel " + std::to_string(c));
      }
  }

  /// Why output (query, q head) `bad` is not finite: the first non-finite query
  /// element, else tail element that query sees, else dense prompt element of its
  /// kv head; else a logit overflowed. Off the hot path: runs only on failure.
  template <class Source, class TailT>
  [[noreturn]] [[gnu::cold]] [[gnu::noinline]] static void report_non_finite(
      const attention_problem& p, const Source* prompt_src,
      const kv_view<const TailT, host_space>& tk, const kv_view<const TailT, host_space>& tv,
      const attention_queries& q, tail_visibility vis, std::int64_t bad) {
    const std::int64_t i = bad / q.q_heads, h = bad % q.q_heads, g = h / p.group_heads();
    for (std::int64_t k = 0; k < q.count * q.q_heads * q.head_dim; ++k)
      if (!is_finite_value(q.at(k)))
        detail::fail(errc::non_finite_input,
                     std::string("attention: query ") +
                         std::to_string(k / (q.q_heads * q.head_dim)) + ", head " +
                         std::to_string(k / q.head_dim % q.q_heads) + " holds " +
                         (q.at(k) != q.at(k) ? "NaN" : "infinity") + " at channel " +
                         std::to_string(k % q.head_dim));
    const std::int64_t seen = std::min(vis(i), tk.shape.tokens);
    find_non_finite(tk, seen, g, "tail keys");
    find_non_finite(tv, seen, g, "tail values");
    if constexpr (requires { prompt_src->keys; }) {
      find_non_finite(prompt_src->keys, p.prompt_tokens, g, "prompt keys");
      find_non_finite(prompt_src->values, p.prompt_tokens, g, "prompt values");
    }
    detail::fail(errc::invalid_argument,
                 "attention: the output of query " + std::to_string(i) + ", head " +
                     std::to_string(h) +
                     " is not finite though its queries and K/V are: a logit overflowed float "
                     "(|q . k| times the softmax scale beyond 3.4e38, or the variant's logit "
                     "transform gave NaN)");
  }
};

template <class Variant>
template <class Prompt, class TailT>
void decode_attention<Variant>::operator()(const Prompt& prompt,
                                           kv_view<const TailT, host_space> tail_keys,
                                           kv_view<const TailT, host_space> tail_values,
                                           const attention_queries& q, tail_visibility vis,
                                           attention_output out, attention_workspace& ws,
                                           const attention_options& options) const {
  static_assert(host_attention_prompt<Prompt>,
                "decode_attention: the prompt must be lynx::no_prompt, a "
                "lynx::bitplane_view<Plan, G, host_space>, a lynx::code_view<Plan, G> "
                "or a lynx::dense_prompt<T> (T = float or bf16)");
  static_assert(
      std::is_same_v<TailT, float> || std::is_same_v<TailT, bf16> || std::is_same_v<TailT, fp16>,
      "decode_attention: the tail holds float, bf16 or fp16");
  const attention_problem p = problem(prompt, tail_keys, q, vis);
  validate(prompt, tail_keys, tail_values, q, vis, out, p);
  const std::size_t need = attention_workspace::bytes_needed(p, options.threads);
  if (!(ws.size() >= need))
    detail::fail(errc::invalid_argument,
                 "attention: workspace of " + std::to_string(ws.size()) +
                     " bytes, this call needs " + std::to_string(need) +
                     " (size it with attention_workspace::reserve before the hot loop)");
  const auto [simd, fallback] = detail::choose_walks(options.path);
  if (q.count == 0) return;

  if constexpr (std::is_same_v<Prompt, no_prompt>) {
    run(p, static_cast<const detail::dense_kv_source<TailT>*>(nullptr), tail_keys, tail_values, q,
        vis, out, ws, options, simd, fallback);
  } else if constexpr (requires { prompt.key_codes; }) {
    const auto src = detail::code_source(prompt);
    run(p, &src, tail_keys, tail_values, q, vis, out, ws, options, simd, fallback);
  } else if constexpr (requires { prompt.geometry; }) {
    const detail::plane_kv_source src = detail::plane_source(prompt, prompt.planes());
    run(p, &src, tail_keys, tail_values, q, vis, out, ws, options, simd, fallback);
  } else {
    using T = std::remove_const_t<typename decltype(prompt.keys)::element_type>;
    const detail::dense_kv_source<T> src{prompt.keys, prompt.values};
    run(p, &src, tail_keys, tail_values, q, vis, out, ws, options, simd, fallback);
  }
}

namespace detail {

/// The source a prompt type is walked through (batch).
template <class Prompt, class TailT>
struct attention_source;
template <class TailT>
struct attention_source<no_prompt, TailT> {
  using type = dense_kv_source<TailT>;  // unused: no prompt
  static constexpr bool present = false;
  static type make(const no_prompt&) { return {}; }
};
template <stream_plan_type Plan, int G, class TailT>
struct attention_source<bitplane_view<Plan, G, host_space>, TailT> {
  using type = plane_kv_source;
  static constexpr bool present = true;
  static type make(const bitplane_view<Plan, G, host_space>& v) {
    return plane_source(v, v.planes());
  }
};
template <stream_plan_type Plan, int G, class TailT>
struct attention_source<code_view<Plan, G>, TailT> {
  using type = code_kv_source<code_data<typename code_view<Plan, G>::code_type>>;
  static constexpr bool present = true;
  static type make(const code_view<Plan, G>& v) { return code_source(v); }
};
template <class T, class TailT>
struct attention_source<dense_prompt<T>, TailT> {
  using type = dense_kv_source<T>;
  static constexpr bool present = true;
  static type make(const dense_prompt<T>& d) { return {d.keys, d.values}; }
};

/// "lynx: code: message" -> "message".
inline std::string error_message(const error& e) {
  const std::string w = e.what();
  const auto at = w.find(": ", 6);
  return at == std::string::npos ? w : w.substr(at + 2);
}

}  // namespace detail

template <class Variant>
template <class Prompt, class TailT>
void decode_attention<Variant>::batch(std::span<const attention_request<Prompt, TailT>> requests,
                                      attention_workspace& ws,
                                      const attention_options& options) const {
  static_assert(host_attention_prompt<Prompt>,
                "decode_attention::batch: the prompt must be lynx::no_prompt, a "
                "lynx::bitplane_view<Plan, G, host_space>, a lynx::code_view<Plan, G> "
                "or a lynx::dense_prompt<T> (T = float or bf16)");
  static_assert(
      std::is_same_v<TailT, float> || std::is_same_v<TailT, bf16> || std::is_same_v<TailT, fp16>,
      "decode_attention::batch: the tail holds float, bf16 or fp16");
  using source = detail::attention_source<Prompt, TailT>;
  using source_t = typename source::type;
  using job_t = job<source_t, TailT>;
  const std::size_t n = requests.size();
  std::vector<attention_problem> problems(n);
  for (std::size_t r = 0; r < n; ++r) {
    const auto& req = requests[r];
    try {
      problems[r] = problem(req.prompt, req.tail_keys, req.queries, req.visible);
      validate(req.prompt, req.tail_keys, req.tail_values, req.queries, req.visible, req.out,
               problems[r]);
    } catch (const error& e) {
      detail::fail(e.code(), "attention batch: request " + std::to_string(r) + ": " +
                                 detail::error_message(e));
    }
  }
  const std::size_t need = batch_bytes(requests, options.threads);
  if (!(ws.size() >= need))
    detail::fail(errc::invalid_argument,
                 "attention batch: workspace of " + std::to_string(ws.size()) +
                     " bytes, this batch needs " + std::to_string(need) +
                     " (size it with attention_workspace::reserve_bytes(batch_bytes(...)))");
  const auto [simd, fallback] = detail::choose_walks(options.path);
  const int threads = options.threads <= 0 ? detail::hardware_threads() : options.threads;

  std::vector<source_t> sources;
  sources.reserve(n);
  std::vector<job_t> jobs;
  jobs.reserve(n);
  std::vector<std::int64_t> first_item(n + 1, 0);  // global index of each job's first item
  float* partials = ws.data();
  std::int64_t per_thread = 0;
  for (std::size_t r = 0; r < n; ++r) {
    const auto& req = requests[r];
    sources.push_back(source::make(req.prompt));
    const source_t* src = source::present ? &sources.back() : nullptr;
    jobs.push_back(make_job(problems[r], src, req.tail_keys, req.tail_values, req.queries,
                            req.visible, req.out, threads, simd, fallback, partials));
    if (req.queries.count == 0) jobs.back().items = 0;
    partials += problems[r].partial_floats() + 16;
    per_thread = std::max(per_thread, jobs.back().scratch_floats());
    first_item[r + 1] = first_item[r] + jobs.back().items;
  }
  float* scratch_base = partials + 16;
  const std::int64_t items = first_item[n];
  detail::parallel_for(
      threads, threads,
      [&](std::int64_t w0, std::int64_t w1) {
        for (std::int64_t worker = w0; worker < w1; ++worker) {
          float* base = scratch_base + worker * per_thread;
          const std::int64_t i0 = items * worker / threads, i1 = items * (worker + 1) / threads;
          // the jobs this worker's run of items falls in
          std::size_t r = static_cast<std::size_t>(
              std::upper_bound(first_item.begin(), first_item.end(), i0) - first_item.begin() - 1);
          for (std::int64_t item = i0; item < i1; ++r) {
            while (first_item[r + 1] <= item) ++r;
            const job_t& j = jobs[r];
            const detail::split_scratch w = detail::carve_scratch(
                base, j.p.group_heads(), j.p.head_dim, j.p.value_groups, j.gk);
            const std::int64_t end = std::min(i1, first_item[r + 1]);
            for (; item < end; ++item) run_item(j, item - first_item[r], end - first_item[r], w);
          }
        }
      },
      options.executor);
  for (std::size_t r = 0; r < n; ++r) {
    if (requests[r].queries.count == 0) continue;
    try {
      combine(jobs[r], scratch_base);
    } catch (const error& e) {
      detail::fail(e.code(), "attention batch: request " + std::to_string(r) + ": " +
                                 detail::error_message(e));
    }
  }
}

}  // namespace lynx

// With lynx::kernels linked, the configurations it ships are compiled there once.
#if defined(LYNX_KERNELS)
#include "lynx/kernels/config.hpp"
#include "lynx/kernels/instances.hpp"
LYNX_KERNELS_FOR_EACH(LYNX_KERNELS_DECLARE_ATTENTION)
LYNX_KERNELS_ATTENTION_DENSE(extern)
LYNX_KERNELS_WALKS(extern)
#if LYNX_ATTENTION_AVX512
LYNX_KERNELS_WALK_HEADS(extern)
#endif
#endif
