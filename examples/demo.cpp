// The Lynx demo: one request of a disaggregated deployment, end to end.
// A prefill node computes a prompt's KV cache, encodes it into bit-plane
// segments and sends them over a simulated link; a decode node starts decoding
// on the anchor alone, speculatively, and verifies when the residual lands.
// The same request then runs with blocking bf16, 8-bit and 4-bit transfers
// over the same link, side by side (and, for a 16-bit plan, a blocking
// transfer of the plan's own 16-bit codes: its exactness reference).
//
//   demo [--model stories260K.bin --tokenizer tok512.bin | --model FILE.gguf | --model @gemma3]
//        [--plan 8=4+4|8=2+2+4|16=4+12|16=4+4+8] [--gbps 0.01] [--latency-us 50] [--lanes 1|2]
//        [--prompt-tokens 300] [--tokens 64] [--max-draft 8] [--max-draft-in-flight 0]
//        [--seed 1] [--temperature 0]
//        [--prompt TEXT | --prompt-file FILE] [--if-missing fail|skip]
// With no --model it runs on a small deterministic built-in model, with a
// prompt sampled from it (--seed). The repository ships one real llama2.c
// model: --model examples/models/stories260K.bin --tokenizer
// examples/models/tok512.bin. A GGUF model (by its .gguf extension or its
// magic; @gemma3: the Gemma-3-270M file where cmake/fetch_gemma3.sh puts it,
// $LYNX_GEMMA3_GGUF first) runs on the Gemma-3 engine with its own tokenizer:
// the prompt is --prompt's text, --prompt-file's, or a built-in paragraph,
// repeated or cut to --prompt-tokens when given, and the demo prints the
// prompt's tail and the continuation. --if-missing skip: a model file that is
// not there ends the demo with "SKIPPED: ..." and exit status 77.
//
// --temperature T > 0 decodes by speculative sampling (lynx::sampling_verifier,
// draws of --seed); 0 is greedy. Exit status 0 when the run is exact:
//  - greedy: Lynx's committed tokens equal blocking decoding at the plan's
//    full precision (blocking 8-bit for an 8-bit plan, the plan's own blocking
//    16-bit run for a 16-bit one; agreement with bf16 is printed beside it);
//  - T > 0: speculative sampling follows the target distribution but does not
//    repeat blocking sampling's draws (a draft, its acceptance test and a
//    resample take draws of their own), so token-for-token equality with
//    blocking sampling is not the contract. The check is that the committed
//    tokens equal a replay of the same session over the planes the prefill
//    node sent, all present, told the level the run had at each step: the
//    decode node decided on exactly the bits that were sent, at every level,
//    and every token was verified at full precision. Agreement with blocking
//    sampling at full precision is printed as information.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "disagg/family.hpp"
#include "disagg/options.hpp"
#include "disagg/report.hpp"
#include "disagg/request.hpp"
#include "disagg/text_prompt.hpp"
#include "gemma3/model_path.hpp"
#include "gemma3/tokenizer.hpp"

namespace ll = lynx_examples::llama2c;
namespace g3 = lynx_examples::gemma3;
namespace dg = lynx_examples::disagg;

namespace {

struct arguments {
  std::string model, tokenizer, plan = "8=4+4", prompt_text, prompt_file, if_missing = "fail";
  dg::request_config request;
  int prompt_tokens = -1;  // -1: 300 on a llama2.c model, the text's own length on a GGUF one
  std::uint64_t seed = 1;
  float temperature = 0;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "demo: %s\nusage: demo [--model FILE --tokenizer FILE | --model FILE.gguf | --model "
               "@gemma3] [--plan 8=4+4|8=2+2+4|16=4+12|16=4+4+8]\n"
               "            [--gbps X] [--latency-us X] [--lanes 1|2] [--prompt-tokens N] "
               "[--tokens N] [--max-draft N] [--max-draft-in-flight N] [--seed N]\n"
               "            [--temperature T] [--prompt TEXT | --prompt-file FILE] [--if-missing "
               "fail|skip]\n",
               why.c_str());
  std::exit(2);
}

arguments parse(int argc, char** argv) {
  arguments a;
  dg::parse_options(
      argc, argv,
      [&](const std::string& key, const std::string& value) {
        if (key == "--model")
          a.model = value;
        else if (key == "--tokenizer")
          a.tokenizer = value;
        else if (key == "--plan")
          a.plan = value;
        else if (key == "--gbps")
          a.request.link.gbit_per_s = std::stod(value);
        else if (key == "--latency-us")
          a.request.link.latency_us = std::stod(value);
        else if (key == "--lanes")
          a.request.link.lanes = std::stoi(value);
        else if (key == "--prompt-tokens")
          a.prompt_tokens = std::stoi(value);
        else if (key == "--tokens")
          a.request.committed_tokens = std::stoi(value);
        else if (key == "--max-draft")
          a.request.max_draft = std::stoi(value);
        else if (key == "--max-draft-in-flight")
          a.request.max_draft_in_flight = std::stoi(value);
        else if (key == "--seed")
          a.seed = std::stoull(value);
        else if (key == "--temperature")
          a.temperature = std::stof(value);
        else if (key == "--prompt")
          a.prompt_text = value;
        else if (key == "--prompt-file")
          a.prompt_file = value;
        else if (key == "--if-missing")
          a.if_missing = value;
        else
          return false;
        return true;
      },
      usage);
  if (a.request.link.gbit_per_s <= 0) usage("--gbps must be positive");
  if (a.request.link.lanes != 1 && a.request.link.lanes != 2) usage("--lanes must be 1 or 2");
  if (a.request.committed_tokens < 2) usage("--tokens must be at least 2");
  if (a.request.max_draft < 0) usage("--max-draft must be >= 0");
  if (a.request.max_draft_in_flight < 0) usage("--max-draft-in-flight must be >= 0");
  if (!(a.temperature >= 0)) usage("--temperature must be >= 0");
  if (a.if_missing != "fail" && a.if_missing != "skip") usage("--if-missing must be fail or skip");
  if (!a.prompt_text.empty() && !a.prompt_file.empty())
    usage("--prompt and --prompt-file exclude each other");
  a.request.verifier = dg::request_verifier::at(a.temperature, a.seed);
  return a;
}

/// Calls f.template operator()<Plan>() with the plan named `name`.
template <class F>
void with_plan(const std::string& name, F&& f) {
  if (name == "8=4+4")
    f.template operator()<lynx::plan_8_4_4>();
  else if (name == "8=2+2+4")
    f.template operator()<lynx::plan_8_2_2_4>();
  else if (name == "16=4+12")
    f.template operator()<lynx::plan_16_4_12>();
  else if (name == "16=4+4+8")
    f.template operator()<lynx::plan_16_4_4_8>();
  else
    usage("unknown plan " + name);
}

/// The length of the common prefix of a and b.
std::size_t same_prefix(const std::vector<int>& a, const std::vector<int>& b) {
  std::size_t n = 0;
  while (n < a.size() && n < b.size() && a[n] == b[n]) ++n;
  return n;
}

/// The request on a model of any family; `text` turns tokens into text (empty: no tokenizer).
template <class Weights>
int run_demo(const Weights& w, const arguments& args, std::vector<int> prompt,
             const std::function<std::string(int prev, const std::vector<int>&)>& text,
             bool print_prompt) {
  const bool sixteen = args.plan.rfind("16", 0) == 0;
  const bool sampling = !args.request.verifier.greedy();
  const int steps = 5 + (sixteen ? 1 : 0) + (sampling ? 1 : 0);
  std::fprintf(stderr, "[1/%d] prefill of %zu tokens...\n", steps, prompt.size());
  const dg::prefill_result<Weights> pre =
      dg::run_prefill(w, std::move(prompt), args.request.verifier);
  std::vector<dg::timeline> runs;
  std::optional<dg::timeline> full;  // a 16-bit plan's own blocking run
  std::vector<int> replay;
  std::fprintf(stderr, "[2/%d] Lynx %s...\n", steps, args.plan.c_str());
  with_plan(args.plan, [&]<class Plan>() {
    runs.push_back(
        dg::run_request<Plan>(w, pre, args.request, Plan::streams, "Lynx " + Plan::name()));
    if (sixteen) {
      std::fprintf(stderr, "[3/%d] blocking 16-bit...\n", steps);
      full = dg::run_request<Plan>(w, pre, args.request, Plan::streams, "blocking 16-bit",
                                   /*decode_when_complete=*/true);
    }
    if (sampling) {
      std::fprintf(stderr, "[%d/%d] replay of the Lynx session over the sent planes...\n",
                   sixteen ? 4 : 3, steps);
      replay = dg::replay_session<Plan>(w, pre.node, pre.first_token, args.request.committed_tokens,
                                        args.request.max_draft, args.request.verifier,
                                        runs[0].step_levels, args.request.max_draft_in_flight);
    }
  });
  int step = steps - 2;
  std::fprintf(stderr, "[%d/%d] blocking bf16...\n", step++, steps);
  runs.push_back(dg::run_blocking_bf16(w, pre, args.request));
  std::fprintf(stderr, "[%d/%d] blocking 8-bit...\n", step++, steps);
  runs.push_back(dg::run_request<lynx::plan_8_8>(w, pre, args.request, 1, "blocking 8-bit"));
  std::fprintf(stderr, "[%d/%d] blocking 4-bit...\n", step++, steps);
  runs.push_back(dg::run_request<lynx::plan_8_4_4>(w, pre, args.request, 1, "blocking 4-bit"));
  if (full) runs.push_back(*full);
  dg::print_table(runs);

  const dg::timeline& lynx_run = runs[0];
  const dg::timeline& target = full ? *full : runs[2];
  const std::size_t n = lynx_run.tokens.size();
  bool exact = false;
  if (!sampling) {
    exact = lynx_run.tokens == target.tokens;
    std::printf("\nLynx committed tokens %s %s's (%zu tokens)\n",
                exact ? "==" : "!=", target.name.c_str(), n);
    if (full)
      std::printf(
          "blocking bf16 agrees with blocking 16-bit for its first %zu of %zu tokens "
          "(information: 16-bit codes are not bf16 values)\n",
          same_prefix(runs[1].tokens, full->tokens), n);
  } else {
    exact = lynx_run.tokens == replay;
    std::printf(
        "\nLynx committed tokens %s the replay of its session over the sent planes "
        "(%zu tokens; speculative sampling at T = %g, seed %llu)\n",
        exact ? "==" : "!=", n, static_cast<double>(args.temperature),
        static_cast<unsigned long long>(args.seed));
    std::printf(
        "Lynx agrees with %s's sampling for its first %zu of %zu tokens (information: "
        "speculative sampling follows its distribution, not its draws)\n",
        target.name.c_str(), same_prefix(lynx_run.tokens, target.tokens), n);
  }
  std::printf(
      "blocking 4-bit agrees with 8-bit for its first %zu tokens (anchor-only decoding is lossy)\n",
      same_prefix(runs[3].tokens, runs[2].tokens));
  std::printf(
      "time to all tokens: Lynx %.2f ms vs blocking 8-bit %.2f ms (%.2fx), blocking bf16 %.2f ms\n",
      lynx_run.all_committed * 1e3, runs[2].all_committed * 1e3,
      runs[2].all_committed / lynx_run.all_committed, runs[1].all_committed * 1e3);
  // A provisional token is a draft shown at once and taken back if verification
  // rejects it: the first token a user could see, beside the first committed one.
  std::printf(
      "time to first token shown: Lynx %.2f ms (%s; first committed %.2f ms) vs blocking 4-bit "
      "%.2f ms (%.2fx), blocking 8-bit %.2f ms (%.2fx)\n",
      dg::first_shown(lynx_run) * 1e3, lynx_run.provisional_tokens ? "provisional" : "committed",
      lynx_run.first_committed * 1e3, runs[3].first_committed * 1e3,
      runs[3].first_committed / dg::first_shown(lynx_run), runs[2].first_committed * 1e3,
      runs[2].first_committed / dg::first_shown(lynx_run));
  std::printf("provisional tokens: %lld shown, %lld retracted in %lld retractions (rate %.1f%%)\n",
              static_cast<long long>(lynx_run.provisional_tokens),
              static_cast<long long>(lynx_run.retracted_tokens),
              static_cast<long long>(lynx_run.retractions),
              lynx_run.provisional_tokens ? 100.0 * static_cast<double>(lynx_run.retracted_tokens) /
                                                static_cast<double>(lynx_run.provisional_tokens)
                                          : 0.0);
  if (text) {
    if (print_prompt) {
      const std::size_t tail = std::min<std::size_t>(pre.prompt.size() - 1, 48);
      const std::vector<int> last(pre.prompt.end() - static_cast<std::ptrdiff_t>(tail),
                                  pre.prompt.end());
      std::printf("\nprompt (%zu tokens; the last %zu): ...%s\n", pre.prompt.size(), tail,
                  text(-1, last).c_str());
    }
    std::printf("%scontinuation: %s\n", print_prompt ? "" : "\n",
                text(pre.prompt.back(), lynx_run.tokens).c_str());
  }
  if (!exact) {
    std::fprintf(stderr,
                 sampling ? "demo: Lynx's committed tokens differ from the replay of its session "
                            "over the sent planes: exactness broken\n"
                          : "demo: Lynx's committed tokens differ from the target precision's: "
                            "exactness broken\n");
    return 1;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) try {
  const arguments args = parse(argc, argv);
  std::string model = args.model;
  if (model == "@gemma3") model = g3::default_model_path().string();
  if (!model.empty() && !std::filesystem::is_regular_file(model)) {
    if (args.if_missing == "skip") {
      std::printf("SKIPPED: model file %s not found%s\n", model.c_str(),
                  args.model == "@gemma3" ? " (cmake/fetch_gemma3.sh fetches it)" : "");
      return 77;
    }
    usage("model file " + model + " not found");
  }
  if (!model.empty() && dg::is_gguf(model)) {
    if (!args.tokenizer.empty()) usage("a GGUF model carries its tokenizer: no --tokenizer");
    const g3::weights w(model);
    const g3::tokenizer tok(w.file());
    const g3::config& c = w.cfg();
    const std::string text = !args.prompt_text.empty()   ? args.prompt_text
                             : !args.prompt_file.empty() ? dg::read_prompt_file(args.prompt_file)
                                                         : std::string(dg::builtin_paragraph);
    std::vector<int> prompt = dg::text_prompt(tok, text, args.prompt_tokens);
    const int prompt_tokens = static_cast<int>(prompt.size());
    if (prompt_tokens < 2 || prompt_tokens + args.request.committed_tokens > c.context)
      usage("--prompt-tokens + --tokens must fit the model's context of " +
            std::to_string(c.context));
    int global = 0;
    for (int l = 0; l < c.n_layers; ++l) global += c.is_local(l) ? 0 : 1;
    std::printf(
        "Lynx demo: %s (Gemma-3: dim %d, %d layers, %d global, the rest windowed to %d tokens; "
        "%d q heads, %d kv heads, head_dim %d, vocab %d)\n",
        model.c_str(), c.dim, c.n_layers, global, c.window, c.n_heads, c.n_kv_heads, c.head_dim,
        c.vocab_size);
    std::printf(
        "link: %.4g Gbit/s, %.0f us latency, %d lane(s) sharing that one rate (every row: the same "
        "link), residual window %zu KiB; %d-token prompt "
        "(%s%s); %d committed tokens; max %d drafts\n",
        args.request.link.gbit_per_s, args.request.link.latency_us, args.request.link.lanes,
        args.request.link.residual_window >> 10, prompt_tokens,
        !args.prompt_text.empty()   ? "--prompt"
        : !args.prompt_file.empty() ? args.prompt_file.c_str()
                                    : "the built-in paragraph",
        args.prompt_tokens > 0 ? ", repeated or cut to length" : "", args.request.committed_tokens,
        args.request.max_draft);
    if (args.temperature > 0)
      std::printf("decoding: speculative sampling at T = %g (seed %llu)\n",
                  static_cast<double>(args.temperature),
                  static_cast<unsigned long long>(args.seed));
    auto text_of = [&tok](int /*prev*/, const std::vector<int>& tokens) {
      return tok.decode(std::vector<std::int32_t>(tokens.begin(), tokens.end()));
    };
    return run_demo(w, args, std::move(prompt), text_of, /*print_prompt=*/true);
  }

  if (!args.prompt_text.empty() || !args.prompt_file.empty())
    usage("--prompt and --prompt-file need a GGUF model (a llama2.c prompt is sampled: --seed)");
  if (args.model.empty() != args.tokenizer.empty() && !args.tokenizer.empty() && args.model.empty())
    usage("--tokenizer needs --model");
  const ll::weights w = model.empty() ? ll::make_builtin_model(7) : ll::weights(model);
  std::optional<ll::tokenizer> tok;
  if (!args.tokenizer.empty()) tok.emplace(args.tokenizer, w.cfg().vocab_size);
  const ll::config& c = w.cfg();
  const int prompt_tokens = args.prompt_tokens < 0 ? 300 : args.prompt_tokens;
  if (prompt_tokens < 2 || prompt_tokens + args.request.committed_tokens > c.seq_len)
    usage("--prompt-tokens + --tokens must fit the model's context of " +
          std::to_string(c.seq_len));

  std::printf("Lynx demo: %s (dim %d, %d layers, %d q heads, %d kv heads, head_dim %d, vocab %d)\n",
              model.empty() ? "built-in model" : model.c_str(), c.dim, c.n_layers, c.n_heads,
              c.n_kv_heads, c.head_size(), c.vocab_size);
  std::printf(
      "link: %.4g Gbit/s, %.0f us latency, %d lane(s) sharing that one rate (every row: the same "
      "link), residual window %zu KiB; %d-token prompt "
      "sampled from the model "
      "(seed %llu); %d committed tokens; max %d drafts\n",
      args.request.link.gbit_per_s, args.request.link.latency_us, args.request.link.lanes,
      args.request.link.residual_window >> 10, prompt_tokens,
      static_cast<unsigned long long>(args.seed), args.request.committed_tokens,
      args.request.max_draft);
  if (args.temperature > 0)
    std::printf("decoding: speculative sampling at T = %g (seed %llu)\n",
                static_cast<double>(args.temperature), static_cast<unsigned long long>(args.seed));
  std::function<std::string(int, const std::vector<int>&)> text_of;
  if (tok)
    text_of = [&tok](int prev, const std::vector<int>& tokens) {
      std::string s;
      for (const int t : tokens) {
        s += tok->piece(prev, t);
        prev = t;
      }
      return s;
    };
  return run_demo(w, args, ll::sample_prompt(w, args.seed, prompt_tokens), text_of,
                  /*print_prompt=*/false);
} catch (const std::exception& e) {
  std::fprintf(stderr, "demo: %s\n", e.what());
  return 1;
}
