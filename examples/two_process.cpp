// One disaggregated request across two processes: a prefill process computes
// the prompt's KV, encodes it and sends it over TCP (or UCX); a decode process
// receives it into bit-plane tensors and decodes with speculation as the
// planes land, under a failure policy and deadlines. Prints the demo's
// timeline, in wall-clock time.
//
//   two_process --role decode  --listen PORT [--transport tcp|ucx] [options]
//   two_process --role prefill --connect HOST:PORT [--transport tcp|ucx] [options]
//   two_process [--role both] [options]      both roles, forked, over loopback (the default)
//
// options (both sides must agree on the model, plan, prompt, temperature, seed and generation):
//   --model FILE --tokenizer FILE   a llama2.c checkpoint (default: the built-in model)
//   --model FILE.gguf | @gemma3     a Gemma-3 GGUF (by extension or magic; @gemma3: where
//                                   cmake/fetch_gemma3.sh puts it), with its own tokenizer
//   --plan 8=4+4|8=2+2+4|16=4+12|16=4+4+8   --prompt-tokens N   --tokens N   --seed N (a llama2.c
//   prompt is sampled from the model with it; it also seeds sampling)   --generation N
//   --max-draft N   --window-bytes N   --temperature T (> 0: speculative sampling; 0: greedy)
//   --prompt TEXT | --prompt-file FILE (GGUF models; default: a built-in paragraph, repeated or
//   cut to --prompt-tokens when given)
// decode side: --on-failure fail_request|continue_unverified|rerequest
//   --anchor-deadline-ms N  --residual-deadline-ms N  --request-deadline-ms N
// prefill side: --resend LAYER:STREAM,...  (send only these: answering a rerequest)
//   --die-after-residuals K  (fault injection: SIGKILL itself once every anchor and K residual
//   segments are delivered)
//   --stale-layers N  (fault injection: first send N anchors of the previous generation)
//
// With --role both and --on-failure rerequest, the decode process answers a
// rerequest by forking a new prefill process that resends the missing
// segments; with --role decode it prints the command to run and waits for it.
//
// With --role both the decode process checks its verified tokens (exit 1 when
// they are wrong): greedy, against plain greedy decoding with every plane
// present; at T > 0, against a replay of its session over the planes the
// prefill node sends, all present, told the level the run had at each step
// (speculative sampling follows the target distribution without repeating
// blocking sampling's draws, so blocking sampling's agreement is printed as
// information only).
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "disagg/decode_node.hpp"
#include "disagg/family.hpp"
#include "disagg/options.hpp"
#include "disagg/prefill_node.hpp"
#include "disagg/report.hpp"
#include "disagg/text_prompt.hpp"
#include "gemma3/model_path.hpp"
#include "gemma3/tokenizer.hpp"
#include "lynx/transport/tcp.hpp"
#if defined(LYNX_WITH_UCX)
#include "lynx/transport/ucx.hpp"
#endif

namespace ll = lynx_examples::llama2c;
namespace g3 = lynx_examples::gemma3;
namespace dg = lynx_examples::disagg;
using clock_type = std::chrono::steady_clock;
/// Tokens as text (prev: the token before them); empty when there is no tokenizer.
using text_function = std::function<std::string(int prev, const std::vector<int>& tokens)>;

namespace {

struct arguments {
  std::string role = "both", transport = "tcp", host = "127.0.0.1", model, tokenizer,
              plan = "8=4+4", resend, prompt_text, prompt_file;
  int port = 0;
  int prompt_tokens = -1;  // -1: 300 on a llama2.c model, the text's own length on a GGUF one
  int tokens = 64, max_draft = 8, die_after_residuals = -1, stale_layers = 0;
  std::uint64_t seed = 1, generation = 1;
  float temperature = 0;
  dg::request_verifier verifier;  // from temperature and seed
  std::size_t window = 256 << 10;
  lynx::failure_options failure;
  lynx::request_deadlines deadlines;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "two_process: %s\n"
               "usage: two_process [--role both|prefill|decode] [--connect HOST:PORT] [--listen "
               "PORT] [--transport tcp|ucx]\n"
               "       [--model FILE --tokenizer FILE | --model FILE.gguf | --model @gemma3] "
               "[--plan 8=4+4|8=2+2+4|16=4+12|16=4+4+8]\n"
               "       [--prompt-tokens N] [--tokens N] [--seed N] [--temperature T] [--prompt "
               "TEXT | --prompt-file FILE]\n"
               "       [--generation N] [--max-draft N] [--window-bytes N]\n"
               "       [--on-failure fail_request|continue_unverified|rerequest] "
               "[--anchor-deadline-ms N] [--residual-deadline-ms N]\n"
               "       [--request-deadline-ms N] [--resend L:S,...] [--die-after-residuals K] "
               "[--stale-layers N]\n",
               why.c_str());
  std::exit(2);
}

arguments parse(int argc, char** argv) {
  arguments a;
  dg::parse_options(
      argc, argv,
      [&](const std::string& key, const std::string& value) {
        if (key == "--role")
          a.role = value;
        else if (key == "--transport")
          a.transport = value;
        else if (key == "--connect") {
          const auto colon = value.rfind(':');
          if (colon == std::string::npos) usage("--connect wants HOST:PORT");
          a.host = value.substr(0, colon);
          a.port = std::stoi(value.substr(colon + 1));
        } else if (key == "--listen")
          a.port = std::stoi(value);
        else if (key == "--model")
          a.model = value;
        else if (key == "--tokenizer")
          a.tokenizer = value;
        else if (key == "--plan")
          a.plan = value;
        else if (key == "--prompt-tokens")
          a.prompt_tokens = std::stoi(value);
        else if (key == "--tokens")
          a.tokens = std::stoi(value);
        else if (key == "--seed")
          a.seed = std::stoull(value);
        else if (key == "--generation")
          a.generation = std::stoull(value);
        else if (key == "--max-draft")
          a.max_draft = std::stoi(value);
        else if (key == "--window-bytes")
          a.window = std::stoull(value);
        else if (key == "--on-failure")
          a.failure.policy = lynx::parse_failure_policy(value);
        else if (key == "--anchor-deadline-ms")
          a.deadlines.anchor = std::chrono::milliseconds(std::stoll(value));
        else if (key == "--residual-deadline-ms")
          a.deadlines.residual = std::chrono::milliseconds(std::stoll(value));
        else if (key == "--request-deadline-ms")
          a.deadlines.request = std::chrono::milliseconds(std::stoll(value));
        else if (key == "--resend")
          a.resend = value;
        else if (key == "--die-after-residuals")
          a.die_after_residuals = std::stoi(value);
        else if (key == "--stale-layers")
          a.stale_layers = std::stoi(value);
        else if (key == "--temperature")
          a.temperature = std::stof(value);
        else if (key == "--prompt")
          a.prompt_text = value;
        else if (key == "--prompt-file")
          a.prompt_file = value;
        else
          return false;
        return true;
      },
      usage);
  if (a.role != "both" && a.role != "prefill" && a.role != "decode")
    usage("--role must be both, prefill or decode");
  if (a.transport != "tcp" && a.transport != "ucx") usage("--transport must be tcp or ucx");
#if !defined(LYNX_WITH_UCX)
  if (a.transport == "ucx")
    usage("this build has no UCX (build with lynx::ucx, which defines LYNX_WITH_UCX)");
#endif
  if (a.role == "prefill" && a.port <= 0) usage("--role prefill needs --connect HOST:PORT");
  if (a.tokens < 2) usage("--tokens must be at least 2");
  if (a.max_draft < 0) usage("--max-draft must be >= 0");
  if (a.generation < 1) usage("--generation must be at least 1 (generation - 1 is the stale one)");
  if (!a.tokenizer.empty() && a.model.empty()) usage("--tokenizer needs --model");
  if (!(a.temperature >= 0)) usage("--temperature must be >= 0");
  if (!a.prompt_text.empty() && !a.prompt_file.empty())
    usage("--prompt and --prompt-file exclude each other");
  a.verifier = dg::request_verifier::at(a.temperature, a.seed);
  return a;
}

/// A forked child running `body` (exit code: its return value); it dies with
/// its parent and after `limit_seconds`, so nothing outlives the example.
pid_t fork_child(const std::function<int()>& body, unsigned limit_seconds = 120) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::alarm(limit_seconds);
    int rc = 1;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "prefill %d: %s\n", static_cast<int>(::getpid()), e.what());
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  if (pid < 0) lynx::detail::fail(lynx::errc::internal, "fork failed");
  return pid;
}

/// The exit status of a child (128 + signal when killed), waiting at most `limit`.
int reap(pid_t pid, std::chrono::seconds limit = std::chrono::seconds(30)) {
  const auto deadline = clock_type::now() + limit;
  while (true) {
    int st = 0;
    if (::waitpid(pid, &st, WNOHANG) == pid)
      return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (clock_type::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      return 128 + SIGKILL;
    }
    ::usleep(2000);
  }
}

// ---------------------------------------------------------------------------
// The prefill role.
// ---------------------------------------------------------------------------

template <class Plan, class Sender, class Weights>
int prefill_over(Sender& sender, const Weights& w, const std::vector<int>& prompt,
                 const arguments& a) {
  dg::prefill_node_options<Sender> o;
  o.generation = a.generation;
  o.residual_window = a.window;
  o.stale_anchor_layers = a.stale_layers;
  if (!a.resend.empty()) o.only = lynx::parse_segment_list(a.resend, a.generation);
  int residuals = 0, anchors = 0;
  const int layers = dg::family<Weights>::layers(w);
  if (a.die_after_residuals >= 0)
    o.on_final = [&, layers](const auto& r) {
      if (!r.delivered || r.id.generation != a.generation) return;
      (r.id.stream == 0 ? anchors : residuals) += 1;
      // Only once every anchor is delivered, so the decode side holds the anchor of every layer.
      if (anchors == layers && residuals >= a.die_after_residuals) {
        std::fprintf(stderr,
                     "prefill %d: fault injection: killed after %d residual segments delivered\n",
                     static_cast<int>(::getpid()), residuals);
        std::fflush(nullptr);
        ::raise(SIGKILL);
      }
    };
  const dg::prefill_report r = dg::run_prefill_node<Plan>(sender, w, prompt, o, a.verifier);
  std::printf(
      "prefill %d: %s%d segments, %llu bytes; prefill %s ms, encoded %s ms, anchors delivered %s "
      "ms, all delivered %s ms; "
      "first token %d; %s\n",
      static_cast<int>(::getpid()), a.resend.empty() ? "" : "resend: ", r.segments,
      static_cast<unsigned long long>(r.bytes_sent), dg::ms(r.prefill_done).c_str(),
      dg::ms(r.encode_done).c_str(), dg::ms(r.anchors_delivered).c_str(),
      dg::ms(r.all_delivered).c_str(), r.first_token,
      r.status == lynx::errc::ok ? "ok" : r.error.c_str());
  return r.status == lynx::errc::ok ? 0 : 1;
}

template <class Plan, class Weights>
int run_prefill_role(const Weights& w, const std::vector<int>& prompt, const arguments& a) {
  const auto deadline = clock_type::now() + std::chrono::seconds(10);
#if defined(LYNX_WITH_UCX)
  if (a.transport == "ucx") {
    lynx::ucx_sender sender(a.host, static_cast<std::uint16_t>(a.port), deadline);
    return prefill_over<Plan>(sender, w, prompt, a);
  }
#endif
  auto sender = lynx::tcp_sender::connect(a.host, static_cast<std::uint16_t>(a.port), deadline);
  return prefill_over<Plan>(sender, w, prompt, a);
}

// ---------------------------------------------------------------------------
// The decode role.
// ---------------------------------------------------------------------------

template <class Plan, class Weights>
int report_decode(const dg::decode_result& r, const Weights& w, const std::vector<int>& prompt,
                  const arguments& a, const text_function& text, bool check) {
  dg::timeline tl = r.tl;
  dg::print_table({tl}, "bytes received");
  std::int64_t verified = 0;
  for (const auto& c : r.commits) verified += c.verified;
  std::printf(
      "\nrequest %s: %zu tokens committed, %lld verified, %lld unverified; %d segments accepted, "
      "%d duplicates, %d stale, "
      "%zu rejected, %d rerequests\n",
      std::string(lynx::to_string(r.outcome)).c_str(), r.commits.size(),
      static_cast<long long>(verified), static_cast<long long>(r.stats.unverified_tokens),
      r.segments_accepted, r.duplicates, r.stale, r.rejected.size(), r.rerequests);
  for (const auto& f : r.failures)
    std::printf("  transfer failure at %s ms: %s (%s) -> %s\n", dg::ms(f.at).c_str(),
                f.what.c_str(), std::string(lynx::to_string(f.status)).c_str(),
                std::string(lynx::to_string(f.applied)).c_str());
  for (const auto& x : r.rejected)
    std::printf("  rejected %s on lane %d: %s\n", lynx::describe(x.id).c_str(), int(x.lane),
                std::string(lynx::to_string(x.status)).c_str());
  if (text) {
    std::string s;
    int prev = prompt.back();
    for (const auto& c : r.commits) {
      s += text(prev, {c.token});
      if (!c.verified) s += "\u2020";  // a dagger after every unverified token
      prev = c.token;
    }
    std::printf("\ncontinuation: %s\n", s.c_str());
  }
  if (r.outcome == lynx::request_outcome::failed) {
    std::fprintf(stderr, "two_process: the request failed: %s\n", r.failure.c_str());
    return 3;
  }
  if (!check) return 0;
  auto same_as = [&](const std::vector<int>& want) {
    std::size_t same = 0;
    while (same < r.commits.size() && same < want.size() && r.commits[same].token == want[same])
      ++same;
    return same;
  };
  if (a.verifier.greedy()) {
    // Exactness: the verified tokens equal plain greedy decoding with every plane present.
    const std::vector<int> want = dg::plain_greedy_reference<Plan>(w, prompt, a.tokens);
    const std::size_t same = same_as(want);
    const bool exact = same >= static_cast<std::size_t>(verified);
    std::printf(
        "verified tokens %s plain greedy decoding with all planes (%lld verified; the first %zu of "
        "%zu committed equal it)\n",
        exact ? "==" : "!=", static_cast<long long>(verified), same, r.commits.size());
    if (!exact) {
      std::fprintf(
          stderr,
          "two_process: verified tokens differ from plain greedy decoding: exactness broken\n");
      return 1;
    }
    return 0;
  }
  // Speculative sampling: the verified tokens equal the session replayed over the sent planes.
  const dg::prefill_result<Weights> pre = dg::run_prefill(w, prompt, a.verifier);
  const std::vector<int> replay = dg::replay_session<Plan>(
      w, pre.node, pre.first_token, a.tokens, a.max_draft, a.verifier, r.tl.step_levels);
  const std::size_t same = same_as(replay);
  const bool exact = same >= static_cast<std::size_t>(verified);
  std::printf(
      "verified tokens %s the replay of the session over the sent planes (%lld verified; the "
      "first %zu of %zu committed equal it; speculative sampling at T = %g, seed %llu)\n",
      exact ? "==" : "!=", static_cast<long long>(verified), same, r.commits.size(),
      static_cast<double>(a.temperature), static_cast<unsigned long long>(a.seed));
  const std::vector<int> blocking =
      dg::plain_reference<Plan>(w, prompt, a.tokens, Plan::streams, a.verifier);
  std::printf(
      "plain sampling with all planes agrees for the first %zu of %zu committed tokens "
      "(information: speculative sampling follows its distribution, not its draws)\n",
      same_as(blocking), r.commits.size());
  if (!exact) {
    std::fprintf(stderr,
                 "two_process: verified tokens differ from the replay of the session: exactness "
                 "broken\n");
    return 1;
  }
  return 0;
}

template <class Plan, class Receiver, class Weights>
dg::decode_result decode_over(
    Receiver& receiver, const Weights& w, const std::vector<int>& prompt, const arguments& a,
    std::type_identity_t<std::function<Receiver*(const lynx::resend_request&)>> rerequest) {
  dg::decode_node_options o;
  o.generation = a.generation;
  o.committed_tokens = a.tokens;
  o.max_draft = a.max_draft;
  o.failure = a.failure;
  o.deadlines = a.deadlines;
  o.verifier = a.verifier;
  dg::decode_node_hooks<Receiver> hooks;
  hooks.rerequest = std::move(rerequest);
  return dg::run_decode_node<Plan>(w, static_cast<int>(prompt.size()), receiver, o, hooks);
}

template <class Plan, class Weights>
int run_decode_role(const Weights& w, const std::vector<int>& prompt, const arguments& a,
                    const text_function& text) {
  const bool both = a.role == "both";
  const auto accept_deadline = [&] { return clock_type::now() + a.deadlines.anchor; };
#if defined(LYNX_WITH_UCX)
  if (a.transport == "ucx") {
    // UCX state is never forked: the prefill child is forked first and learns the port through a
    // pipe.
    int fds[2];
    if (::pipe(fds) != 0) lynx::detail::fail(lynx::errc::internal, "pipe failed");
    pid_t child = -1;
    if (both) {
      child = fork_child([&] {
        std::uint16_t port = 0;
        if (::read(fds[0], &port, sizeof port) != static_cast<ssize_t>(sizeof port)) return 4;
        arguments b = a;
        b.port = port;
        return run_prefill_role<Plan>(w, prompt, b);
      });
    }
    lynx::ucx_receiver receiver(both ? "127.0.0.1" : "0.0.0.0", static_cast<std::uint16_t>(a.port));
    std::printf("decode: listening on port %d (ucx)\n", int(receiver.port()));
    std::fflush(stdout);
    if (both) {
      const std::uint16_t port = receiver.port();
      if (::write(fds[1], &port, sizeof port) != static_cast<ssize_t>(sizeof port))
        lynx::detail::fail(lynx::errc::internal, "pipe write failed");
    }
    receiver.accept(accept_deadline());
    // A rerequest over UCX would need a new listener per resend and a prefill forked before UCX
    // started: not offered here.
    const auto r = decode_over<Plan>(receiver, w, prompt, a, {});
    const int rc = report_decode<Plan>(r, w, prompt, a, text, both);
    if (child > 0) std::printf("prefill process exited with %d\n", reap(child));
    ::close(fds[0]);
    ::close(fds[1]);
    return rc;
  }
#endif
  lynx::tcp_listener listener(both ? "127.0.0.1" : "0.0.0.0", static_cast<std::uint16_t>(a.port));
  std::printf("decode: listening on port %d (tcp)\n", int(listener.port()));
  std::fflush(stdout);
  std::vector<pid_t> children;
  if (both) {
    const std::uint16_t port = listener.port();
    children.push_back(fork_child([&] {
      arguments b = a;
      b.port = port;
      return run_prefill_role<Plan>(w, prompt, b);
    }));
  }
  auto receiver = lynx::tcp_receiver::accept(listener, accept_deadline());
  std::optional<lynx::tcp_receiver> resent;
  auto rerequest = [&](const lynx::resend_request& req) -> lynx::tcp_receiver* {
    const std::string list = lynx::format_segment_list(req.missing);
    std::printf("decode: rerequest %d: %zu segments missing (%s)\n", req.attempt,
                req.missing.size(), list.c_str());
    if (both) {
      arguments b = a;
      b.port = listener.port();
      b.resend = list;
      b.die_after_residuals = -1;
      b.stale_layers = 0;
      children.push_back(
          fork_child([&w, &prompt, b] { return run_prefill_role<Plan>(w, prompt, b); }));
    } else {
      std::printf(
          "decode: waiting for: two_process --role prefill --connect HOST:%d --resend %s (same "
          "model/plan/prompt/generation)\n",
          int(listener.port()), list.c_str());
    }
    std::fflush(stdout);
    try {
      resent.emplace(
          lynx::tcp_receiver::accept(listener, clock_type::now() + a.deadlines.residual));
    } catch (const lynx::error& e) {
      std::printf("decode: no resend: %s\n", e.what());
      return nullptr;
    }
    return &*resent;
  };
  const auto r = decode_over<Plan>(receiver, w, prompt, a, rerequest);
  const int rc = report_decode<Plan>(r, w, prompt, a, text, both);
  for (const pid_t c : children)
    std::printf("prefill process %d exited with %d\n", static_cast<int>(c), reap(c));
  return rc;
}

template <class Plan, class Weights>
int run(const Weights& w, const arguments& a, const std::vector<int>& prompt,
        const text_function& text) {
  if (a.role == "prefill") return run_prefill_role<Plan>(w, prompt, a);
  return run_decode_role<Plan>(w, prompt, a, text);
}

/// The request on a model of any family: `model` describes it, `prompt_from` says
/// where its prompt comes from (for the decode side's header line).
template <class Weights>
int run_model(const Weights& w, const arguments& a, const std::vector<int>& prompt,
              const std::string& model, const std::string& prompt_from, const text_function& text) {
  if (a.role != "prefill") {
    std::printf(
        "Lynx two-process request (%s): %s; plan %s over %s; %zu-token prompt %s, generation "
        "%llu; %d committed tokens, max %d drafts; on failure: %s\n",
        a.role.c_str(), model.c_str(), a.plan.c_str(), a.transport.c_str(), prompt.size(),
        prompt_from.c_str(), static_cast<unsigned long long>(a.generation), a.tokens, a.max_draft,
        std::string(lynx::to_string(a.failure.policy)).c_str());
    if (a.temperature > 0)
      std::printf("decoding: speculative sampling at T = %g (seed %llu)\n",
                  static_cast<double>(a.temperature), static_cast<unsigned long long>(a.seed));
    std::fflush(stdout);
  }
  if (a.plan == "8=4+4") return run<lynx::plan_8_4_4>(w, a, prompt, text);
  if (a.plan == "8=2+2+4") return run<lynx::plan_8_2_2_4>(w, a, prompt, text);
  if (a.plan == "16=4+12") return run<lynx::plan_16_4_12>(w, a, prompt, text);
  if (a.plan == "16=4+4+8") return run<lynx::plan_16_4_4_8>(w, a, prompt, text);
  usage("unknown plan " + a.plan);
}

}  // namespace

int main(int argc, char** argv) try {
  const arguments a = parse(argc, argv);
  const std::string model = a.model == "@gemma3" ? g3::default_model_path().string() : a.model;
  if (!model.empty() && !std::filesystem::is_regular_file(model))
    usage("model file " + model + " not found");
  if (!model.empty() && dg::is_gguf(model)) {
    if (!a.tokenizer.empty()) usage("a GGUF model carries its tokenizer: no --tokenizer");
    const g3::weights w(model);
    const g3::tokenizer tok(w.file());
    const g3::config& c = w.cfg();
    const std::string text = !a.prompt_text.empty()   ? a.prompt_text
                             : !a.prompt_file.empty() ? dg::read_prompt_file(a.prompt_file)
                                                      : std::string(dg::builtin_paragraph);
    const std::vector<int> prompt = dg::text_prompt(tok, text, a.prompt_tokens);
    if (prompt.size() < 2 || static_cast<int>(prompt.size()) + a.tokens > c.context)
      usage("--prompt-tokens + --tokens must fit the model's context of " +
            std::to_string(c.context));
    const std::string from = !a.prompt_text.empty()   ? std::string("from --prompt")
                             : !a.prompt_file.empty() ? "from " + a.prompt_file
                                                      : std::string("of the built-in paragraph");
    return run_model(w, a, prompt,
                     model + " (Gemma-3: dim " + std::to_string(c.dim) + ", " +
                         std::to_string(c.n_layers) + " layers, " + std::to_string(c.n_kv_heads) +
                         " kv heads, head_dim " + std::to_string(c.head_dim) + ", window " +
                         std::to_string(c.window) + ")",
                     from, [&tok](int, const std::vector<int>& tokens) {
                       return tok.decode(std::vector<std::int32_t>(tokens.begin(), tokens.end()));
                     });
  }
  if (!a.prompt_text.empty() || !a.prompt_file.empty())
    usage("--prompt and --prompt-file need a GGUF model (a llama2.c prompt is sampled: --seed)");
  const ll::weights w = model.empty() ? ll::make_builtin_model(7) : ll::weights(model);
  std::optional<ll::tokenizer> tok;
  if (!a.tokenizer.empty()) tok.emplace(a.tokenizer, w.cfg().vocab_size);
  const ll::config& c = w.cfg();
  const int prompt_tokens = a.prompt_tokens < 0 ? 300 : a.prompt_tokens;
  if (prompt_tokens < 2 || prompt_tokens + a.tokens > c.seq_len)
    usage("--prompt-tokens + --tokens must fit the model's context of " +
          std::to_string(c.seq_len));
  text_function text;
  if (tok)
    text = [&tok](int prev, const std::vector<int>& tokens) {
      std::string s;
      for (const int t : tokens) {
        s += tok->piece(prev, t);
        prev = t;
      }
      return s;
    };
  return run_model(w, a, ll::sample_prompt(w, a.seed, prompt_tokens),
                   (model.empty() ? std::string("built-in model") : model) + " (dim " +
                       std::to_string(c.dim) + ", " + std::to_string(c.n_layers) + " layers, " +
                       std::to_string(c.n_kv_heads) + " kv heads, head_dim " +
                       std::to_string(c.head_size()) + ")",
                   "sampled from the model (seed " + std::to_string(a.seed) + ")", text);
} catch (const std::exception& e) {
  std::fprintf(stderr, "two_process: %s\n", e.what());
  return 1;
}
