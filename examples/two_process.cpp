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
// options (both sides must agree on the model, plan, prompt and generation):
//   --model FILE --tokenizer FILE   a llama2.c checkpoint (default: the built-in model)
//   --plan 8=4+4|8=2+2+4|16=4+12|16=4+4+8   --prompt-tokens N   --tokens N   --seed N (the prompt
//   is sampled from the model with it)   --generation N   --max-draft N   --window-bytes N
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
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "disagg/decode_node.hpp"
#include "disagg/options.hpp"
#include "disagg/prefill_node.hpp"
#include "disagg/report.hpp"
#include "lynx/transport/tcp.hpp"
#if defined(LYNX_WITH_UCX)
#include "lynx/transport/ucx.hpp"
#endif

namespace ll = lynx_examples::llama2c;
namespace dg = lynx_examples::disagg;
using clock_type = std::chrono::steady_clock;

namespace {

struct arguments {
  std::string role = "both", transport = "tcp", host = "127.0.0.1", model, tokenizer,
              plan = "8=4+4", resend;
  int port = 0;
  int prompt_tokens = 300, tokens = 64, max_draft = 8, die_after_residuals = -1, stale_layers = 0;
  std::uint64_t seed = 1, generation = 1;
  std::size_t window = 256 << 10;
  lynx::failure_options failure;
  lynx::request_deadlines deadlines;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(stderr,
               "two_process: %s\n"
               "usage: two_process [--role both|prefill|decode] [--connect HOST:PORT] [--listen "
               "PORT] [--transport tcp|ucx]\n"
               "       [--model FILE --tokenizer FILE] [--plan 8=4+4|8=2+2+4|16=4+12|16=4+4+8] "
               "[--prompt-tokens N] [--tokens N]\n"
               "       [--seed N] [--generation N] [--max-draft N] [--window-bytes N]\n"
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

template <class Plan, class Sender>
int prefill_over(Sender& sender, const ll::weights& w, const std::vector<int>& prompt,
                 const arguments& a) {
  dg::prefill_node_options<Sender> o;
  o.generation = a.generation;
  o.residual_window = a.window;
  o.stale_anchor_layers = a.stale_layers;
  if (!a.resend.empty()) o.only = lynx::parse_segment_list(a.resend, a.generation);
  int residuals = 0, anchors = 0;
  const int layers = w.cfg().n_layers;
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
  const dg::prefill_report r = dg::run_prefill_node<Plan>(sender, w, prompt, o);
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

template <class Plan>
int run_prefill_role(const ll::weights& w, const std::vector<int>& prompt, const arguments& a) {
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

template <class Plan>
int report_decode(const dg::decode_result& r, const ll::weights& w, const std::vector<int>& prompt,
                  const arguments& a, const std::optional<ll::tokenizer>& tok, bool check) {
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
  if (tok) {
    std::string text;
    int prev = prompt.back();
    for (const auto& c : r.commits) {
      text += tok->piece(prev, c.token);
      if (!c.verified) text += "\u2020";  // a dagger after every unverified token
      prev = c.token;
    }
    std::printf("\ncontinuation: %s\n", text.c_str());
  }
  if (r.outcome == lynx::request_outcome::failed) {
    std::fprintf(stderr, "two_process: the request failed: %s\n", r.failure.c_str());
    return 3;
  }
  if (!check) return 0;
  // Exactness: the verified tokens equal plain greedy decoding with every plane present.
  const std::vector<int> want = dg::plain_greedy_reference<Plan>(w, prompt, a.tokens);
  std::size_t same = 0;
  while (same < r.commits.size() && same < want.size() && r.commits[same].token == want[same])
    ++same;
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

template <class Plan, class Receiver>
dg::decode_result decode_over(
    Receiver& receiver, const ll::weights& w, const std::vector<int>& prompt, const arguments& a,
    std::type_identity_t<std::function<Receiver*(const lynx::resend_request&)>> rerequest) {
  dg::decode_node_options o;
  o.generation = a.generation;
  o.committed_tokens = a.tokens;
  o.max_draft = a.max_draft;
  o.failure = a.failure;
  o.deadlines = a.deadlines;
  dg::decode_node_hooks<Receiver> hooks;
  hooks.rerequest = std::move(rerequest);
  return dg::run_decode_node<Plan>(w, static_cast<int>(prompt.size()), receiver, o, hooks);
}

template <class Plan>
int run_decode_role(const ll::weights& w, const std::vector<int>& prompt, const arguments& a,
                    const std::optional<ll::tokenizer>& tok) {
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
    const int rc = report_decode<Plan>(r, w, prompt, a, tok, both);
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
  const int rc = report_decode<Plan>(r, w, prompt, a, tok, both);
  for (const pid_t c : children)
    std::printf("prefill process %d exited with %d\n", static_cast<int>(c), reap(c));
  return rc;
}

template <class Plan>
int run(const ll::weights& w, const arguments& a, const std::optional<ll::tokenizer>& tok) {
  const std::vector<int> prompt = ll::sample_prompt(w, a.seed, a.prompt_tokens);
  if (a.role == "prefill") return run_prefill_role<Plan>(w, prompt, a);
  return run_decode_role<Plan>(w, prompt, a, tok);
}

}  // namespace

int main(int argc, char** argv) try {
  const arguments a = parse(argc, argv);
  const ll::weights w = a.model.empty() ? ll::make_builtin_model(7) : ll::weights(a.model);
  std::optional<ll::tokenizer> tok;
  if (!a.tokenizer.empty()) tok.emplace(a.tokenizer, w.cfg().vocab_size);
  const ll::config& c = w.cfg();
  if (a.prompt_tokens < 2 || a.prompt_tokens + a.tokens > c.seq_len)
    usage("--prompt-tokens + --tokens must fit the model's context of " +
          std::to_string(c.seq_len));
  if (a.role != "prefill") {
    std::printf(
        "Lynx two-process request (%s): %s (dim %d, %d layers, %d kv heads, head_dim %d); plan %s "
        "over %s; %d-token prompt "
        "sampled from the model (seed %llu), generation %llu; %d committed tokens, max %d drafts; "
        "on failure: %s\n",
        a.role.c_str(), a.model.empty() ? "built-in model" : a.model.c_str(), c.dim, c.n_layers,
        c.n_kv_heads, c.head_size(), a.plan.c_str(), a.transport.c_str(), a.prompt_tokens,
        static_cast<unsigned long long>(a.seed), static_cast<unsigned long long>(a.generation),
        a.tokens, a.max_draft, std::string(lynx::to_string(a.failure.policy)).c_str());
    std::fflush(stdout);
  }
  if (a.plan == "8=4+4") return run<lynx::plan_8_4_4>(w, a, tok);
  if (a.plan == "8=2+2+4") return run<lynx::plan_8_2_2_4>(w, a, tok);
  if (a.plan == "16=4+12") return run<lynx::plan_16_4_12>(w, a, tok);
  if (a.plan == "16=4+4+8") return run<lynx::plan_16_4_4_8>(w, a, tok);
  usage("unknown plan " + a.plan);
} catch (const std::exception& e) {
  std::fprintf(stderr, "two_process: %s\n", e.what());
  return 1;
}
