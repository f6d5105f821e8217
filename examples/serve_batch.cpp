// Serving eight requests at once with one forward of the model per step: each
// request has its own prompt KV arriving through Lynx (anchor first, the
// residual landing at a different step for each), its own progressive session
// drafting on the anchor and verifying when the residual lands; every step,
// the forwards the sessions ask for (prepare) run as ONE batched forward of
// the llama2.c model (lynx_decode_engine::forward_batch: each weight row read
// once for every request's tokens), and each session takes its logits back
// (complete). Every request's committed tokens are checked against the same
// request served alone (its session stepped by itself) and against plain
// greedy decoding at full precision; any difference exits 1.
//
//   serve_batch [--model stories260K.bin --tokenizer tok512.bin] [--tokens N]
//
// Without arguments it uses the TinyStories model shipped in examples/models.
#include <cstdio>
#include <cstring>
#include <exception>
#include <string>
#include <vector>

#include "llama2c/lynx_engine.hpp"
#include "llama2c/tokenizer.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/speculation/session.hpp"
#include "lynx/speculation/verifier.hpp"

namespace {

namespace l2 = lynx_examples::llama2c;
using plan = lynx::plan_8_4_4;
using engine_type = l2::lynx_decode_engine<plan>;
using session_type = lynx::progressive_session<engine_type, lynx::greedy_verifier>;
constexpr int requests = 8;

const char* const prompts[requests] = {
    "Once upon a time, there was a little girl named Lily.",
    "Tom had a big red ball. He liked to play with it in the park.",
    "One day, a small dog found a shiny stone near the river.",
    "The sun was hot, so Sam and his mom went to the beach.",
    "Mia loved to draw. Every day she drew a picture of a cat.",
    "There was a tall tree in the garden. A bird lived in it.",
    "Ben wanted a cookie, but the jar was on a high shelf.",
    "Anna and her friend built a castle out of blocks.",
};

// The step at which request r's residual lands (its anchor is there from step 0).
int residual_step(int r) { return 3 + 4 * r; }

struct request {
  std::vector<int> prompt;
  int first_token = 0;
  std::vector<lynx::encoded_layer<plan>> segments;  // per layer
};

struct served {
  std::vector<l2::prompt_tensors<plan>> tensors;
  std::vector<engine_type> engines;
  std::vector<session_type> sessions;
};

lynx::session_options options(int tokens) {
  lynx::session_options o;
  o.max_draft = 6;
  o.max_draft_in_flight = 12;
  o.max_new_tokens = tokens;
  return o;
}

// Delivers what has landed by `step` to request r's tensors and session.
void deliver(const request& q, l2::prompt_tensors<plan>& tensors, session_type& s, int r,
             int step) {
  const int level = step >= residual_step(r) ? 2 : 1;
  if (s.available_level() >= level) return;
  for (std::size_t l = 0; l < tensors.size(); ++l)
    for (int st = s.available_level(); st < level; ++st)
      tensors[l].accept(q.segments[l].segment(st));
  s.set_available_level(level);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    std::string model_path = std::string(LYNX_SOURCE_DIR) + "/examples/models/stories260K.bin";
    std::string tokenizer_path = std::string(LYNX_SOURCE_DIR) + "/examples/models/tok512.bin";
    int tokens = 40;
    for (int i = 1; i + 1 < argc; i += 2) {
      if (!std::strcmp(argv[i], "--model"))
        model_path = argv[i + 1];
      else if (!std::strcmp(argv[i], "--tokenizer"))
        tokenizer_path = argv[i + 1];
      else if (!std::strcmp(argv[i], "--tokens"))
        tokens = std::stoi(argv[i + 1]);
      else
        throw std::invalid_argument(std::string("unknown option ") + argv[i]);
    }
    const l2::weights w{std::filesystem::path(model_path)};
    const l2::tokenizer tok(tokenizer_path, w.cfg().vocab_size);
    const int layers = w.cfg().n_layers;

    // Prefill nodes: each prompt's KV, encoded layer by layer; the first token.
    std::vector<request> reqs(requests);
    for (int r = 0; r < requests; ++r) {
      request& q = reqs[static_cast<std::size_t>(r)];
      q.prompt = tok.encode(prompts[r]);
      l2::engine<> prefill(w);
      q.first_token = lynx::argmax_token(prefill.prefill(q.prompt));
      q.segments = l2::encode_prompt<plan>(prefill, {.generation = 1});
    }
    auto make = [&](served& s) {
      s.tensors.reserve(requests);
      s.engines.reserve(requests);
      s.sessions.reserve(requests);
      for (int r = 0; r < requests; ++r) {
        const request& q = reqs[static_cast<std::size_t>(r)];
        const int n = static_cast<int>(q.prompt.size());
        s.tensors.push_back(l2::make_prompt_tensors<plan>(w.cfg(), n, 1));
        s.engines.emplace_back(w, s.tensors.back(), n);
        s.sessions.emplace_back(s.engines.back(), lynx::greedy_verifier{}, plan::streams, n,
                                q.first_token, options(tokens));
      }
    };

    // Served together: one batched forward per step.
    served together;
    make(together);
    std::vector<float> logits;
    int steps = 0, batched_tokens = 0;
    for (;; ++steps) {
      std::vector<lynx::forward_request> asked(requests);
      bool done = true;
      for (int r = 0; r < requests; ++r) {
        deliver(reqs[static_cast<std::size_t>(r)], together.tensors[static_cast<std::size_t>(r)],
                together.sessions[static_cast<std::size_t>(r)], r, steps);
        asked[r] = together.sessions[static_cast<std::size_t>(r)].prepare();
        done &= asked[r].kind == lynx::step_kind::done;
      }
      if (done) break;
      std::size_t rows = 0;
      for (const auto& f : asked)
        if (f.kind != lynx::step_kind::idle && f.kind != lynx::step_kind::done)
          rows += f.tokens.size();
      const auto vocab = static_cast<std::size_t>(w.cfg().vocab_size);
      logits.assign(rows * vocab, 0.0f);
      std::vector<engine_type::batch_job> jobs;
      std::vector<int> job_of(requests, -1);
      std::size_t at = 0;
      for (int r = 0; r < requests; ++r) {
        const auto& f = asked[r];
        if (f.kind == lynx::step_kind::idle || f.kind == lynx::step_kind::done) continue;
        job_of[r] = static_cast<int>(jobs.size());
        jobs.push_back({&together.engines[static_cast<std::size_t>(r)], f,
                        std::span<float>(logits).subspan(at, f.tokens.size() * vocab)});
        at += f.tokens.size() * vocab;
      }
      if (jobs.empty()) throw std::runtime_error("every session waits: no planes will come");
      engine_type::forward_batch(jobs);  // ONE forward of the model for every request
      batched_tokens += static_cast<int>(rows);
      for (int r = 0; r < requests; ++r)
        if (job_of[r] >= 0)
          together.sessions[static_cast<std::size_t>(r)].complete(
              jobs[static_cast<std::size_t>(job_of[r])].logits);
    }

    // Each request served alone (its session stepped by itself, same landings),
    // and plain greedy decoding at full precision.
    served alone;
    make(alone);
    int failures = 0;
    std::printf("Lynx serve_batch: %d requests, 8 = 4 + 4, %d tokens each, stories260K\n", requests,
                tokens);
    std::printf("%d steps, one batched forward each (%d token rows in all)\n\n", steps,
                batched_tokens);
    std::printf(
        "  request  prompt tokens  residual at step  drafts accepted  == alone  == full "
        "precision\n");
    for (int r = 0; r < requests; ++r) {
      const auto ri = static_cast<std::size_t>(r);
      session_type& s = alone.sessions[ri];
      for (int step = 0; !s.finished(); ++step) {
        deliver(reqs[ri], alone.tensors[ri], s, r, step);
        (void)s.step();
      }
      // plain greedy at the full level, from the same first token
      l2::prompt_tensors<plan> full =
          l2::make_prompt_tensors<plan>(w.cfg(), static_cast<int>(reqs[ri].prompt.size()), 1);
      for (int l = 0; l < layers; ++l)
        for (int st = 0; st < plan::streams; ++st)
          full[static_cast<std::size_t>(l)].accept(
              reqs[ri].segments[static_cast<std::size_t>(l)].segment(st));
      engine_type plain(w, full, static_cast<int>(reqs[ri].prompt.size()));
      std::vector<std::int32_t> want{reqs[ri].first_token};
      std::vector<float> row(static_cast<std::size_t>(w.cfg().vocab_size));
      while (static_cast<int>(want.size()) < tokens) {
        const std::int32_t t = want.back();
        plain.forward({&t, 1}, static_cast<std::int64_t>(reqs[ri].prompt.size() + want.size() - 1),
                      plan::streams, row);
        want.push_back(lynx::argmax_token(row));
      }
      const auto& got = together.sessions[ri].committed();
      const bool same_alone = got == s.committed();
      const bool same_full = got == want;
      failures += !same_alone + !same_full;
      const auto& st = together.sessions[ri].stats();
      std::printf("  %7d  %13zu  %16d  %8lld of %-4lld  %8s  %17s\n", r, reqs[ri].prompt.size(),
                  residual_step(r), static_cast<long long>(st.accepted_drafts),
                  static_cast<long long>(st.verified_drafts), same_alone ? "yes" : "NO",
                  same_full ? "yes" : "NO");
    }
    const auto& first = together.sessions[0].committed();
    std::printf("\nrequest 0: %s|%s\n", prompts[0],
                tok.decode(std::vector<int>(first.begin(), first.end())).c_str());
    if (failures) {
      std::printf("FAILED: %d comparisons differ\n", failures);
      return 1;
    }
    std::printf(
        "every request's committed tokens: identical to serving it alone and to full "
        "precision\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "serve_batch: %s\n", e.what());
    return 1;
  }
}
