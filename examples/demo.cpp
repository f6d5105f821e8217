// The Lynx demo: one request of a disaggregated deployment, end to end.
// A prefill node computes a prompt's KV cache, encodes it into bit-plane
// segments and sends them over a simulated link; a decode node starts decoding
// on the anchor alone, speculatively, and verifies when the residual lands.
// The same request then runs with blocking bf16, 8-bit and 4-bit transfers
// over the same link, side by side.
//
//   demo [--model stories260K.bin --tokenizer tok512.bin] [--plan 8=4+4|8=2+2+4|16=4+12|16=4+4+8]
//        [--gbps 0.01] [--latency-us 50] [--lanes 1|2] [--prompt-tokens 300] [--tokens 64]
//        [--max-draft 8] [--seed 1]
// With no --model it runs on a small deterministic built-in model.
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "disagg/options.hpp"
#include "disagg/report.hpp"
#include "disagg/request.hpp"

namespace ll = lynx_examples::llama2c;
namespace dg = lynx_examples::disagg;

namespace {

struct arguments {
  std::string model, tokenizer, plan = "8=4+4";
  dg::request_config request;
  int prompt_tokens = 300;
  std::uint64_t seed = 1;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "demo: %s\nusage: demo [--model FILE --tokenizer FILE] [--plan "
               "8=4+4|8=2+2+4|16=4+12|16=4+4+8] [--gbps X]\n"
               "            [--latency-us X] [--lanes 1|2] [--prompt-tokens N] [--tokens N] "
               "[--max-draft N] [--seed N]\n",
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
        else if (key == "--seed")
          a.seed = std::stoull(value);
        else
          return false;
        return true;
      },
      usage);
  if (a.request.link.gbit_per_s <= 0) usage("--gbps must be positive");
  if (a.request.link.lanes != 1 && a.request.link.lanes != 2) usage("--lanes must be 1 or 2");
  if (a.request.committed_tokens < 2) usage("--tokens must be at least 2");
  if (a.request.max_draft < 0) usage("--max-draft must be >= 0");
  return a;
}

template <class Plan>
dg::timeline run_lynx(const ll::weights& w, const dg::prefill_result& pre,
                      const dg::request_config& c) {
  return dg::run_request<Plan>(w, pre, c, Plan::streams, "Lynx " + Plan::name());
}

}  // namespace

int main(int argc, char** argv) try {
  const arguments args = parse(argc, argv);
  if (args.model.empty() != args.tokenizer.empty() && !args.tokenizer.empty() && args.model.empty())
    usage("--tokenizer needs --model");
  const ll::weights w = args.model.empty() ? ll::make_builtin_model(7) : ll::weights(args.model);
  std::optional<ll::tokenizer> tok;
  if (!args.tokenizer.empty()) tok.emplace(args.tokenizer, w.cfg().vocab_size);
  const ll::config& c = w.cfg();
  if (args.prompt_tokens < 2 || args.prompt_tokens + args.request.committed_tokens > c.seq_len)
    usage("--prompt-tokens + --tokens must fit the model's context of " +
          std::to_string(c.seq_len));

  std::printf("Lynx demo: %s (dim %d, %d layers, %d q heads, %d kv heads, head_dim %d, vocab %d)\n",
              args.model.empty() ? "built-in model" : args.model.c_str(), c.dim, c.n_layers,
              c.n_heads, c.n_kv_heads, c.head_size(), c.vocab_size);
  std::printf(
      "link: %.4g Gbit/s, %.0f us latency, %d lane(s), residual window %zu KiB; %d-token prompt "
      "sampled from the model "
      "(seed %llu); %d committed tokens; max %d drafts\n",
      args.request.link.gbit_per_s, args.request.link.latency_us, args.request.link.lanes,
      args.request.link.residual_window >> 10, args.prompt_tokens,
      static_cast<unsigned long long>(args.seed), args.request.committed_tokens,
      args.request.max_draft);

  std::fprintf(stderr, "[1/5] prefill of %d tokens...\n", args.prompt_tokens);
  const dg::prefill_result pre =
      dg::run_prefill(w, ll::sample_prompt(w, args.seed, args.prompt_tokens));
  std::vector<dg::timeline> runs;
  std::fprintf(stderr, "[2/5] Lynx %s...\n", args.plan.c_str());
  if (args.plan == "8=4+4")
    runs.push_back(run_lynx<lynx::plan_8_4_4>(w, pre, args.request));
  else if (args.plan == "8=2+2+4")
    runs.push_back(run_lynx<lynx::plan_8_2_2_4>(w, pre, args.request));
  else if (args.plan == "16=4+12")
    runs.push_back(run_lynx<lynx::plan_16_4_12>(w, pre, args.request));
  else if (args.plan == "16=4+4+8")
    runs.push_back(run_lynx<lynx::plan_16_4_4_8>(w, pre, args.request));
  else
    usage("unknown plan " + args.plan);
  std::fprintf(stderr, "[3/5] blocking bf16...\n");
  runs.push_back(dg::run_blocking_bf16(w, pre, args.request));
  std::fprintf(stderr, "[4/5] blocking 8-bit...\n");
  runs.push_back(dg::run_request<lynx::plan_8_8>(w, pre, args.request, 1, "blocking 8-bit"));
  std::fprintf(stderr, "[5/5] blocking 4-bit...\n");
  runs.push_back(dg::run_request<lynx::plan_8_4_4>(w, pre, args.request, 1, "blocking 4-bit"));
  dg::print_table(runs);

  const dg::timeline& lynx_run = runs[0];
  const dg::timeline& target = args.plan.rfind("16", 0) == 0 ? runs[1] : runs[2];
  std::printf("\nLynx committed tokens %s %s's (%zu tokens)\n",
              lynx_run.tokens == target.tokens ? "==" : "!=", target.name.c_str(),
              lynx_run.tokens.size());
  std::size_t same4 = 0;
  while (same4 < runs[3].tokens.size() && runs[3].tokens[same4] == runs[2].tokens[same4]) ++same4;
  std::printf(
      "blocking 4-bit agrees with 8-bit for its first %zu tokens (anchor-only decoding is lossy)\n",
      same4);
  std::printf(
      "time to all tokens: Lynx %.2f ms vs blocking 8-bit %.2f ms (%.2fx), blocking bf16 %.2f ms\n",
      lynx_run.all_committed * 1e3, runs[2].all_committed * 1e3,
      runs[2].all_committed / lynx_run.all_committed, runs[1].all_committed * 1e3);
  if (tok) {
    std::string text;
    int prev = pre.prompt.back();
    for (const int t : lynx_run.tokens) {
      text += tok->piece(prev, t);
      prev = t;
    }
    std::printf("\ncontinuation: %s\n", text.c_str());
  }
  if (lynx_run.tokens != target.tokens) {
    std::fprintf(
        stderr,
        "demo: Lynx's committed tokens differ from the target precision's: exactness broken\n");
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "demo: %s\n", e.what());
  return 1;
}
