// A soak of real processes: one long-lived decode process serves many
// disaggregated requests in a loop, each from its own forked prefill process
// over TCP (or UCX) on loopback, on the real model (stories260K), with one
// fault drawn at random per request and the failure policies taken in turn.
// It counts what became of every request and checks that nothing hangs,
// nothing wrong is committed and nothing leaks:
//
//   soak [--requests N] [--transport tcp|ucx] [--seed S] [--plan 8=4+4|16=4+12]
//        [--fault KIND] [--model FILE] [--hard-deadline-s S] [--verbose 1]
//
// Faults (one per request, uniform; --fault fixes one):
//   none         a clean request
//   killed       the prefill process SIGKILLs itself once every anchor and k residual segments
//                are delivered (k < layers - 1; the residual segments after the k never go)
//   truncated    one residual segment goes out cut short
//   flipped      one residual segment goes out with one bit flipped (header or payload: the
//                checksum covers both)
//   duplicated   one residual segment goes out twice
//   delayed      one residual segment is held back past the residual deadline (and, the scheduler's
//                window being one segment, the residuals behind it)
//   stale        the anchors of 1..layers layers of the previous generation go out first
//   receiver     the decode side abandons the request after its first residual segment and closes
//                the link: the prefill process must see it and end with an error
// Policies in turn: fail_request, continue_unverified, rerequest (TCP: a new prefill process
// resends the missing segments); over UCX rerequest is not offered (UCX state is never forked:
// the prefill process is forked before the decode side's UCX receiver exists), so UCX takes the
// first two in turn.
//
// Checks (exit 1 when one fails; the table says which):
//   - every committed token marked verified equals plain greedy decoding with every plane present
//     (the plan's full precision), computed once per prompt; nothing verified follows an unverified
//     token ("wrong tokens": 0);
//   - no hang: each request has a hard deadline (SIGALRM), past which its prefill processes are
//     killed and the request is counted as a hang (a second deadline ends the soak); a prefill
//     process that has not ended 10 s after its request is killed and counted too ("sender hangs");
//   - each fault ends as its policy says (a clean, duplicated or stale request: completed exact;
//     a broken transfer: failed with a reported error / completed with the tokens after the
//     failure flagged unverified / completed exact after a resend); a fault the transfer outran
//     (every segment landed anyway) counts as "no effect", anything else as "unexpected";
//   - open descriptors (/proc/self/fd), resident memory (VmRSS) and threads, measured before the
//     first request, after the first 10% and at the end: from 10% to the end, descriptors and
//     threads may grow by at most 4 and RSS by at most 16 MiB (the first 10% warm the allocator
//     and the transport's libraries);
//   - every child reaped: no child process is left at the end.
// Exit 77 (skipped) when the model is missing or UCX cannot run here.
#include <signal.h>
#include <sys/prctl.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "disagg/decode_node.hpp"
#include "disagg/options.hpp"
#include "disagg/prefill_node.hpp"
#include "llama2c/llama2c.hpp"
#include "lynx/planes/codec.hpp"
#include "lynx/transport/tcp.hpp"
#if defined(LYNX_WITH_UCX)
#include "lynx/transport/ucx.hpp"
#endif

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define LYNX_SOAK_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define LYNX_SOAK_SANITIZED 1
#endif
#endif
#if defined(LYNX_SOAK_SANITIZED)
constexpr bool sanitized = true;
#else
constexpr bool sanitized = false;
#endif

namespace ll = lynx_examples::llama2c;
namespace dg = lynx_examples::disagg;
using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

namespace {

// ---------------------------------------------------------------------------
// Faults.
// ---------------------------------------------------------------------------

enum class fault : int {
  none,
  killed,
  truncated,
  flipped,
  duplicated,
  delayed,
  stale,
  receiver,
};
constexpr int fault_kinds = 8;
constexpr std::array<const char*, fault_kinds> fault_names = {
    "none", "killed", "truncated", "flipped", "duplicated", "delayed", "stale", "receiver"};
constexpr std::array<const char*, fault_kinds> fault_descriptions = {
    "no fault",
    "sender killed mid-residual",
    "a residual segment truncated",
    "a bit flipped in a residual segment",
    "a residual segment duplicated",
    "a residual segment delayed past the deadline",
    "anchors of the previous generation first",
    "receiver gone mid-residual",
};

/// One request's fault, with its parameters drawn.
struct fault_plan {
  fault kind = fault::none;
  std::uint32_t layer = 0;        // the residual segment (stream 1) of this layer is the one hit
  int residuals_before_kill = 0;  // killed: residual segments delivered before the SIGKILL
  int cut_permille = 1;           // truncated: the share of the segment cut off its end (>= 1 byte)
  std::size_t flip_at = 0;        // flipped: byte offset (modulo the segment's size)
  std::byte flip_mask{1};         // flipped: the bit flipped there
  int stale_layers = 0;           // stale: anchors of generation - 1 sent first
  std::chrono::milliseconds delay{0};  // delayed: how long the segment is held back
};

/// A segment_sender that passes everything to `Inner` but hurts the first
/// residual segment (stream 1) of layer `plan.layer` of the request's
/// generation as `plan` says: truncated, flipped, duplicated or held back.
/// Tickets are its own (a duplicate's second send and a held-back send must not
/// confuse the scheduler): every inner ticket maps to one outer ticket, and
/// the duplicate's extra send has none (its events are dropped).
template <lynx::segment_sender Inner>
class faulty_sender {
 public:
  using clock = typename Inner::clock;
  using time_point = typename clock::time_point;

  faulty_sender(Inner& inner, const fault_plan& plan, std::uint64_t generation)
      : inner_(inner), plan_(plan), generation_(generation) {}

  [[nodiscard]] time_point now() const { return inner_.now(); }
  [[nodiscard]] int lane_count() const { return inner_.lane_count(); }

  lynx::post_result post(const lynx::send_request& request) {
    if (plan_.kind == fault::killed && request.id.stream >= 1 &&
        request.id.generation == generation_ && residuals_posted_++ >= plan_.residuals_before_kill)
      // Killed after k residual segments: the ones after them never leave (the kill comes once
      // every anchor is delivered; without this, a residual posted meanwhile could still land).
      return {lynx::errc::ok, next_ticket_++};
    const bool hit = !hit_ && request.id.layer == plan_.layer && request.id.stream == 1 &&
                     request.id.generation == generation_;
    if (!hit) return forward(request);
    hit_ = true;
    lynx::send_request r = request;
    switch (plan_.kind) {
      case fault::truncated:
        r.bytes = request.bytes.first(
            request.bytes.size() -
            std::clamp<std::size_t>(
                request.bytes.size() * static_cast<std::size_t>(plan_.cut_permille) / 1000, 1,
                request.bytes.size() - 1));
        return forward(r);
      case fault::flipped: {
        // A copy: the scheduler's buffer stays as it is. Alive until this sender goes.
        copies_.emplace_back(request.bytes.begin(), request.bytes.end());
        auto& c = copies_.back();
        c[plan_.flip_at % c.size()] ^= plan_.flip_mask;
        r.bytes = c;
        return forward(r);
      }
      case fault::duplicated: {
        const lynx::post_result p = forward(request);
        if (p.ok()) {
          const lynx::post_result extra = inner_.post(request);
          (void)extra;  // its events have no outer ticket: dropped in next_event
        }
        return p;
      }
      case fault::delayed: {
        const lynx::send_ticket t = next_ticket_++;
        held_.push_back({request, inner_.now() + plan_.delay, t});
        return {lynx::errc::ok, t};
      }
      default:
        return forward(request);
    }
  }

  std::optional<lynx::send_event<clock>> next_event(time_point deadline) {
    while (true) {
      post_due();
      if (!events_.empty()) {
        const auto e = events_.front();
        events_.pop_front();
        return e;
      }
      const time_point until = held_.empty() ? deadline : std::min(deadline, held_.front().due);
      std::optional<lynx::send_event<clock>> e = inner_.next_event(until);
      if (e) {
        if (e->status != lynx::errc::ok) fail_held(e->status);  // the link broke: nothing more goes
        const auto it = outer_.find(e->ticket);
        if (it == outer_.end()) continue;  // the duplicate's extra send
        e->ticket = it->second;
        if (e->is_final()) outer_.erase(it);
        return e;
      }
      const time_point t = inner_.now();
      if (t >= deadline) return std::nullopt;
      // The inner sender gave up before `until`: it has nothing in flight and never will (a
      // broken link). What is held back cannot go either.
      if (t < until) {
        if (held_.empty()) return std::nullopt;
        fail_held(lynx::errc::peer_failure);
      }
    }
  }

 private:
  struct held_send {
    lynx::send_request request;
    time_point due;
    lynx::send_ticket ticket;
  };

  lynx::post_result forward(const lynx::send_request& request) {
    const lynx::post_result p = inner_.post(request);
    if (!p.ok()) return p;
    const lynx::send_ticket t = next_ticket_++;
    outer_.emplace(p.ticket, t);
    return {lynx::errc::ok, t};
  }

  void post_due() {
    while (!held_.empty() && held_.front().due <= inner_.now()) {
      const held_send h = held_.front();
      held_.pop_front();
      const lynx::post_result p = inner_.post(h.request);
      if (p.ok())
        outer_.emplace(p.ticket, h.ticket);
      else
        events_.push_back({h.ticket, lynx::completion_kind::delivered, p.status, inner_.now()});
    }
  }

  void fail_held(lynx::errc status) {
    for (const held_send& h : held_)
      events_.push_back({h.ticket, lynx::completion_kind::delivered, status, inner_.now()});
    held_.clear();
  }

  Inner& inner_;
  fault_plan plan_;
  std::uint64_t generation_;
  bool hit_ = false;
  int residuals_posted_ = 0;
  lynx::send_ticket next_ticket_ = 1;
  std::map<lynx::send_ticket, lynx::send_ticket> outer_;  // inner ticket -> outer ticket
  std::deque<held_send> held_;
  std::deque<lynx::send_event<clock>> events_;  // made here: a held-back send that failed
  std::deque<std::vector<std::byte>> copies_;   // flipped segments, alive until the end
};
static_assert(lynx::check_segment_sender<faulty_sender<lynx::tcp_sender>>());

// ---------------------------------------------------------------------------
// Child processes and the per-request hard deadline.
// ---------------------------------------------------------------------------

// The prefill processes of the request under way, for the SIGALRM handler.
constexpr int max_children = 8;
volatile std::sig_atomic_t g_children[max_children] = {};
volatile std::sig_atomic_t g_child_count = 0;
volatile std::sig_atomic_t g_hung = 0;  // 1: the hard deadline passed; 2: so did the grace
volatile std::sig_atomic_t g_request = 0;

extern "C" void on_hard_deadline(int) {
  if (g_hung == 0) {
    // Kill the request's senders: a decode side that waits on them sees its link fail.
    g_hung = 1;
    for (int i = 0; i < g_child_count; ++i) ::kill(static_cast<pid_t>(g_children[i]), SIGKILL);
    ::alarm(10);
    return;
  }
  const char msg[] =
      "soak: a request did not return 10 s after its hard deadline and the death "
      "of its prefill processes: HANG, giving up\n";
  (void)!::write(2, msg, sizeof msg - 1);
  ::_exit(4);
}

void arm_hard_deadline(std::chrono::seconds limit) {
  g_hung = 0;
  ::alarm(static_cast<unsigned>(limit.count()));
}
void disarm_hard_deadline() { ::alarm(0); }

/// Forks a child running `body` (its return value is the exit code). The child
/// forgets the soak's SIGALRM handler, dies with the soak (PR_SET_PDEATHSIG)
/// and after `limit` seconds (alarm), closes every descriptor but 0-2 and
/// `keep`, and is silent unless `verbose`.
pid_t spawn(const std::function<int()>& body, bool verbose, int keep = -1, unsigned limit = 60) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGALRM, SIG_DFL);
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() == 1) ::_exit(99);  // the soak died before the prctl
    ::alarm(limit);
    for (int fd = 3; fd < 1024; ++fd)
      if (fd != keep) ::close(fd);
    if (!verbose) {
      if (FILE* null = std::freopen("/dev/null", "w", stdout)) (void)null;
      if (FILE* null = std::freopen("/dev/null", "w", stderr)) (void)null;
    }
    int rc = 98;
    try {
      rc = body();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "prefill %d: %s\n", static_cast<int>(::getpid()), e.what());
    }
    std::fflush(nullptr);
    ::_exit(rc);
  }
  if (pid < 0) lynx::detail::fail(lynx::errc::internal, "soak: fork failed");
  if (g_child_count < max_children) {
    g_children[g_child_count] = pid;
    g_child_count = g_child_count + 1;
  }
  return pid;
}

/// The exit status of a child (128 + signal when killed), or -1 when it had
/// not ended by the deadline and was killed by the soak (then reaped).
int reap(pid_t pid, clock_type::time_point deadline) {
  while (true) {
    int st = 0;
    const pid_t r = ::waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    if (r < 0 && errno != EINTR) return -2;  // not our child (cannot happen)
    if (clock_type::now() >= deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
      return -1;
    }
    ::usleep(1000);
  }
}

// ---------------------------------------------------------------------------
// Resources of this process.
// ---------------------------------------------------------------------------

struct resources {
  long fds = 0, threads = 0, rss_kib = 0;
};

long count_entries(const char* dir) {
  long n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir)) ++n;
  return n;
}

resources measure() {
  resources r;
  r.fds = count_entries("/proc/self/fd") - 1;  // less the iterator's own descriptor
  r.threads = count_entries("/proc/self/task");
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmRSS:", 0) == 0) r.rss_kib = std::strtol(line.c_str() + 6, nullptr, 10);
  return r;
}

// ---------------------------------------------------------------------------
// The soak.
// ---------------------------------------------------------------------------

struct soak_config {
  int requests = 12;
  std::string transport = "tcp", plan = "8=4+4", model;
  std::uint64_t seed = 1;
  int forced_fault = -1;  // --fault: this kind every time
  bool verbose = false;
  // The request.
  int prompt_tokens = 256, committed_tokens = 64;
  int prompts = 8;  // distinct prompts at most (a short soak takes fewer: a reference each)
  std::uint64_t generation = 7;
  lynx::request_deadlines deadlines{5'000ms, 1'000ms, 10'000ms};
  std::chrono::milliseconds delay{2'500};  // delayed: past the residual deadline
  std::chrono::seconds hard_deadline{30};  // per request: the request deadline, a reap, margin
  // The bounds, from after the first 10% to the end.
  long fd_growth_bound = 4, thread_growth_bound = 4, rss_growth_bound_kib = 16 * 1024;
};

[[noreturn]] void usage(const std::string& why) {
  std::fprintf(
      stderr,
      "soak: %s\n"
      "usage: soak [--requests N] [--transport tcp|ucx] [--seed S] [--plan 8=4+4|16=4+12]\n"
      "            [--fault none|killed|truncated|flipped|duplicated|delayed|stale|receiver]"
      "\n            [--model FILE] [--hard-deadline-s S] [--verbose 0|1]\n",
      why.c_str());
  std::exit(2);
}

soak_config parse(int argc, char** argv) {
  soak_config c;
  dg::parse_options(
      argc, argv,
      [&](const std::string& key, const std::string& value) {
        if (key == "--requests")
          c.requests = std::stoi(value);
        else if (key == "--transport")
          c.transport = value;
        else if (key == "--seed")
          c.seed = std::stoull(value);
        else if (key == "--plan")
          c.plan = value;
        else if (key == "--model")
          c.model = value;
        else if (key == "--hard-deadline-s")
          c.hard_deadline = std::chrono::seconds(std::stoi(value));
        else if (key == "--verbose")
          c.verbose = std::stoi(value) != 0;
        else if (key == "--fault") {
          const auto it = std::find(fault_names.begin(), fault_names.end(), value);
          if (it == fault_names.end()) usage("unknown fault " + value);
          c.forced_fault = static_cast<int>(it - fault_names.begin());
        } else
          return false;
        return true;
      },
      usage);
  if (c.requests < 1) usage("--requests must be at least 1");
  if (c.hard_deadline.count() < 1) usage("--hard-deadline-s must be at least 1");
  if (c.transport != "tcp" && c.transport != "ucx") usage("--transport must be tcp or ucx");
  if (c.plan != "8=4+4" && c.plan != "16=4+12") usage("--plan must be 8=4+4 or 16=4+12");
  return c;
}

/// What one request came to.
struct request_record {
  fault_plan f;
  lynx::failure_policy policy = lynx::failure_policy::fail_request;
  std::optional<dg::decode_result> decode;     // empty: abandoned (receiver) or an error before it
  std::vector<lynx::committed_token> commits;  // as committed (also when abandoned)
  bool abandoned = false;
  std::string
      thrown_error;  // what ended the request by an exception (accept, UCX listener, the library)
  std::vector<int> exits;  // of its prefill processes (-1: killed by the soak at the reap)
  bool hung = false;
  double seconds = 0;
};

/// Thrown from the decode node's on_segment hook to abandon a request (fault::receiver).
struct receiver_gone {};

/// The prefill process's body over a connected sender.
template <class Plan, class Sender>
int prefill_body(Sender& inner, const ll::weights& w, const std::vector<int>& prompt,
                 const fault_plan& f, const soak_config& c, std::size_t window,
                 std::vector<lynx::segment_id> only) {
  faulty_sender<Sender> sender(inner, f, c.generation);
  dg::prefill_node_options<faulty_sender<Sender>> o;
  o.generation = c.generation;
  o.residual_window = window;
  o.only = std::move(only);
  if (f.kind == fault::stale) o.stale_anchor_layers = f.stale_layers;
  const int layers = w.cfg().n_layers;
  if (f.kind == fault::killed)
    o.on_final = [&, anchors = 0, residuals = 0](const auto& r) mutable {
      if (!r.delivered || r.id.generation != c.generation) return;
      (r.id.stream == 0 ? anchors : residuals) += 1;
      if (anchors == layers && residuals >= f.residuals_before_kill) {
        std::fprintf(stderr, "prefill %d: killed after %d anchors and %d residual segments\n",
                     static_cast<int>(::getpid()), anchors, residuals);
        std::fflush(stderr);
        ::raise(SIGKILL);
      }
    };
  const dg::prefill_report rep = dg::run_prefill_node<Plan>(sender, w, prompt, o);
  std::fprintf(stderr,
               "prefill %d: %d segments; prefill %.1f ms, encoded %.1f ms, anchors delivered %.1f "
               "ms, all delivered %.1f ms; %s\n",
               static_cast<int>(::getpid()), rep.segments, rep.prefill_done * 1e3,
               rep.encode_done * 1e3, rep.anchors_delivered * 1e3, rep.all_delivered * 1e3,
               rep.status == lynx::errc::ok ? "ok" : rep.error.c_str());
  return rep.status == lynx::errc::ok ? 0 : 1;
}

dg::decode_node_options decode_options(const soak_config& c, lynx::failure_policy policy) {
  dg::decode_node_options o;
  o.generation = c.generation;
  o.committed_tokens = c.committed_tokens;
  o.failure.policy = policy;
  o.failure.max_rerequests = 1;
  o.deadlines = c.deadlines;
  return o;
}

template <class Receiver>
dg::decode_node_hooks<Receiver> decode_hooks(request_record& rec) {
  dg::decode_node_hooks<Receiver> hooks;
  hooks.on_commit = [&rec](const lynx::committed_token& t) { rec.commits.push_back(t); };
  if (rec.f.kind == fault::receiver)
    hooks.on_segment = [](const lynx::segment_id& id, int) {
      if (id.stream == 1) throw receiver_gone{};
    };
  return hooks;
}

/// One request over TCP: the prefill process connects to this process's
/// listener; a rerequest forks a second one that resends the missing segments.
template <class Plan>
void run_tcp_request(request_record& rec, const ll::weights& w, const std::vector<int>& prompt,
                     const soak_config& c, std::size_t window) {
  std::vector<pid_t> children;
  {
    lynx::tcp_listener listener("127.0.0.1", 0);
    const std::uint16_t port = listener.port();
    auto prefill = [&, port](const fault_plan& f, std::vector<lynx::segment_id> only) {
      return spawn(
          [&, port, f, only] {
            auto sender = lynx::tcp_sender::connect("127.0.0.1", port, clock_type::now() + 10s);
            return prefill_body<Plan>(sender, w, prompt, f, c, window, only);
          },
          c.verbose);
    };
    children.push_back(prefill(rec.f, {}));
    try {
      auto receiver = lynx::tcp_receiver::accept(listener, clock_type::now() + c.deadlines.anchor);
      std::optional<lynx::tcp_receiver> resent;
      auto hooks = decode_hooks<lynx::tcp_receiver>(rec);
      hooks.rerequest = [&](const lynx::resend_request& req) -> lynx::tcp_receiver* {
        children.push_back(prefill(fault_plan{}, req.missing));
        try {
          resent.emplace(
              lynx::tcp_receiver::accept(listener, clock_type::now() + c.deadlines.anchor));
        } catch (const lynx::error&) {
          return nullptr;
        }
        return &*resent;
      };
      try {
        rec.decode = dg::run_decode_node<Plan>(w, static_cast<int>(prompt.size()), receiver,
                                               decode_options(c, rec.policy), hooks);
      } catch (const receiver_gone&) {
        rec.abandoned = true;
      }
    } catch (const std::exception& e) {
      rec.thrown_error = e.what();
    }
  }  // every receiver and the listener closed: the senders see the link end
  const auto deadline = clock_type::now() + 10s;
  for (const pid_t p : children) rec.exits.push_back(reap(p, deadline));
}

#if defined(LYNX_WITH_UCX)
/// One request over UCX: the prefill process is forked before this process
/// makes its UCX receiver (UCX state is never forked) and learns the port
/// through a pipe. No rerequest.
template <class Plan>
void run_ucx_request(request_record& rec, const ll::weights& w, const std::vector<int>& prompt,
                     const soak_config& c, std::size_t window) {
  int fds[2] = {-1, -1};
  if (::pipe(fds) != 0) lynx::detail::fail(lynx::errc::internal, "soak: pipe failed");
  const fault_plan f = rec.f;
  const pid_t child = spawn(
      [&, f] {
        std::uint16_t port = 0;
        if (::read(fds[0], &port, sizeof port) != static_cast<ssize_t>(sizeof port)) return 97;
        lynx::ucx_sender sender("127.0.0.1", port, clock_type::now() + 10s);
        return prefill_body<Plan>(sender, w, prompt, f, c, window, {});
      },
      c.verbose, fds[0]);
  ::close(fds[0]);
  try {
    lynx::ucx_receiver receiver("127.0.0.1", 0);
    const std::uint16_t port = receiver.port();
    if (::write(fds[1], &port, sizeof port) != static_cast<ssize_t>(sizeof port))
      lynx::detail::fail(lynx::errc::internal, "soak: pipe write failed");
    ::close(fds[1]);
    fds[1] = -1;
    receiver.accept(clock_type::now() + c.deadlines.anchor);
    try {
      rec.decode = dg::run_decode_node<Plan>(w, static_cast<int>(prompt.size()), receiver,
                                             decode_options(c, rec.policy),
                                             decode_hooks<lynx::ucx_receiver>(rec));
    } catch (const receiver_gone&) {
      rec.abandoned = true;
    }
  } catch (const std::exception& e) {
    rec.thrown_error = e.what();
  }
  if (fds[1] >= 0) ::close(fds[1]);  // the child reads EOF and ends
  rec.exits.push_back(reap(child, clock_type::now() + 10s));
}

/// Empty when UCX can listen on loopback here (asked by a forked child, so that
/// this process holds no UCX state), else why not.
std::string ucx_problem() {
  int fds[2] = {-1, -1};
  if (::pipe(fds) != 0) return "pipe() failed";
  const pid_t probe = spawn(
      [&] {
        try {
          const lynx::ucx_receiver listener("127.0.0.1", 0);
          return 0;
        } catch (const std::exception& e) {
          const std::string why = e.what();
          (void)!::write(fds[1], why.data(), why.size());
          return 1;
        }
      },
      false, fds[1]);
  ::close(fds[1]);
  const int status = reap(probe, clock_type::now() + 20s);
  g_child_count = 0;
  std::string why;
  char buffer[256];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;)
    why.append(buffer, static_cast<std::size_t>(n));
  ::close(fds[0]);
  if (status == 0) return "";
  if (status == -1) return "creating a UCX listener took more than 20 s";
  return why.empty() ? "the probe process exited with " + std::to_string(status) : why;
}
#endif

/// Counts of the soak, per fault kind (index fault_kinds: the total).
struct tally {
  struct row {
    int drawn = 0, exact = 0, unverified = 0, failed = 0, abandoned = 0, no_effect = 0,
        unexpected = 0, wrong = 0, hangs = 0, sender_hangs = 0, thrown = 0;
    std::int64_t unverified_tokens = 0, unverified_differ = 0, rejected = 0, duplicates = 0,
                 stale = 0, rerequests = 0;
  };
  std::array<row, fault_kinds + 1> rows{};
  std::map<std::string, int> by_policy;                 // "policy: outcome" -> count
  std::array<std::map<int, int>, fault_kinds> exits{};  // prefill exit statuses per fault
  std::vector<std::string> notes;                       // the first unexpected things, for people
};

/// Judges one request and adds it to the tally.
void judge(const request_record& rec, const std::vector<int>& want, const soak_config& c, tally& t,
           int index) {
  const auto k = static_cast<std::size_t>(rec.f.kind);
  tally::row& row = t.rows[k];
  row.drawn++;
  for (const int e : rec.exits) {
    t.exits[k][e]++;
    if (e == -1) row.sender_hangs++;
  }
  if (rec.hung) row.hangs++;
  auto note = [&](const std::string& what) {
    if (t.notes.size() < 20)
      t.notes.push_back("request " + std::to_string(index) + " (" + fault_names[k] + ", " +
                        std::string(lynx::to_string(rec.policy)) + "): " + what);
  };
  // Every committed token: verified ones must equal the reference, and none may follow an
  // unverified one.
  bool seen_unverified = false;
  int wrong = 0;
  for (std::size_t i = 0; i < rec.commits.size(); ++i) {
    const lynx::committed_token& tok = rec.commits[i];
    const bool same = i < want.size() && tok.token == want[i];
    if (tok.verified) {
      if (seen_unverified || !same) ++wrong;
    } else {
      seen_unverified = true;
      row.unverified_tokens++;
      row.unverified_differ += !same;
    }
  }
  row.wrong += wrong;
  if (wrong > 0) note(std::to_string(wrong) + " wrong verified tokens");
  if (!rec.thrown_error.empty()) {
    row.thrown++;
    note("an exception ended the request: " + rec.thrown_error);
    return;
  }
  if (rec.abandoned) {
    row.abandoned++;
    t.by_policy[std::string(lynx::to_string(rec.policy)) + ": abandoned"]++;
    if (rec.f.kind != fault::receiver) {
      row.unexpected++;
      note("abandoned without the receiver fault");
    } else if (rec.exits.empty() || rec.exits[0] == 0) {
      row.unexpected++;
      note("the prefill process did not report the receiver's going (exit 0)");
    }
    return;
  }
  const dg::decode_result& r = *rec.decode;
  row.rejected += static_cast<std::int64_t>(r.rejected.size());
  row.duplicates += r.duplicates;
  row.stale += r.stale;
  row.rerequests += r.rerequests;
  const bool exact =
      r.outcome == lynx::request_outcome::completed &&
      r.commits.size() == static_cast<std::size_t>(c.committed_tokens) &&
      std::all_of(r.commits.begin(), r.commits.end(), [](const auto& x) { return x.verified; }) &&
      wrong == 0;
  std::string outcome;
  if (r.outcome == lynx::request_outcome::completed) {
    if (exact) {
      row.exact++;
      outcome = "completed exact";
    } else {
      outcome = "completed, not exact";
      row.unexpected++;
      note("completed but not exact (" + std::to_string(r.commits.size()) + " tokens)");
    }
  } else if (r.outcome == lynx::request_outcome::completed_unverified) {
    row.unverified++;
    outcome = "completed unverified";
    if (r.failure.empty() || r.stats.unverified_tokens == 0) {
      row.unexpected++;
      note("completed_unverified without a reason or without an unverified token");
    }
  } else if (r.outcome == lynx::request_outcome::failed) {
    row.failed++;
    outcome = "failed";
    if (r.failure.empty() || r.failures.empty()) {
      row.unexpected++;
      note("failed without a reported error");
    }
  } else {
    row.unexpected++;
    outcome = "pending";
    note("the request ended pending");
  }
  t.by_policy[std::string(lynx::to_string(rec.policy)) + ": " + outcome]++;

  // Did it end as the fault and the policy say?
  switch (rec.f.kind) {
    case fault::none:
    case fault::duplicated:
    case fault::stale:
      if (!exact) {
        row.unexpected++;
        note(std::string("expected completed exact, got ") +
             std::string(lynx::to_string(r.outcome)) +
             (r.failure.empty() ? "" : " (" + r.failure + ")"));
      } else if (rec.f.kind == fault::duplicated && r.duplicates != 1) {
        note("the duplicate was not seen (" + std::to_string(r.duplicates) + ")");
      } else if (rec.f.kind == fault::stale && r.stale != rec.f.stale_layers) {
        row.unexpected++;
        note(std::to_string(r.stale) + " stale segments reported, " +
             std::to_string(rec.f.stale_layers) + " sent");
      }
      break;
    case fault::killed:
    case fault::truncated:
    case fault::flipped:
    case fault::delayed: {
      lynx::request_outcome expected = lynx::request_outcome::failed;
      if (rec.policy == lynx::failure_policy::continue_unverified)
        expected = lynx::request_outcome::completed_unverified;
      if (rec.policy == lynx::failure_policy::rerequest)
        expected = lynx::request_outcome::completed;
      if (exact && r.failures.empty()) {
        row.no_effect++;  // every segment landed before the fault could matter
      } else if (r.outcome != expected ||
                 (expected == lynx::request_outcome::completed && !exact)) {
        row.unexpected++;
        note("expected " + std::string(lynx::to_string(expected)) + ", got " +
             std::string(lynx::to_string(r.outcome)) +
             (r.failure.empty() ? "" : " (" + r.failure + ")"));
      }
      if ((rec.f.kind == fault::truncated || rec.f.kind == fault::flipped) && r.rejected.empty() &&
          !(exact && r.failures.empty()))
        note("the damaged segment was not reported as rejected");
      break;
    }
    case fault::receiver:
      row.unexpected++;
      note("the receiver fault did not abandon the request");
      break;
  }
}

void print_table(const tally& t, const soak_config& c) {
  std::printf("\n%-10s %-44s %6s %6s %10s %6s %9s %9s %10s %6s %6s %7s\n", "fault", "", "drawn",
              "exact", "unverified", "failed", "abandoned", "no-effect", "unexpected", "wrong",
              "hangs", "s-hangs");
  auto line = [&](const char* name, const char* what, const tally::row& r) {
    std::printf("%-10s %-44s %6d %6d %10d %6d %9d %9d %10d %6d %6d %7d\n", name, what, r.drawn,
                r.exact, r.unverified, r.failed, r.abandoned, r.no_effect, r.unexpected, r.wrong,
                r.hangs, r.sender_hangs);
  };
  for (int k = 0; k < fault_kinds; ++k)
    line(fault_names[static_cast<std::size_t>(k)], fault_descriptions[static_cast<std::size_t>(k)],
         t.rows[static_cast<std::size_t>(k)]);
  line("total", "", t.rows[fault_kinds]);
  const tally::row& all = t.rows[fault_kinds];
  std::printf(
      "(exact: completed, every token verified and equal to the reference; unverified: completed "
      "with the tokens after the failure flagged; failed: failed with a reported error; wrong: "
      "verified tokens unequal to the reference; s-hangs: prefill processes still running 10 s "
      "after their request, killed)\n");
  std::printf(
      "segments rejected %lld, duplicates %lld, stale %lld, rerequests %lld; unverified tokens "
      "%lld, of which %lld differ from the full-precision reference (allowed: flagged)%s\n",
      static_cast<long long>(all.rejected), static_cast<long long>(all.duplicates),
      static_cast<long long>(all.stale), static_cast<long long>(all.rerequests),
      static_cast<long long>(all.unverified_tokens), static_cast<long long>(all.unverified_differ),
      all.thrown ? (", EXCEPTIONS " + std::to_string(all.thrown)).c_str() : "");
  std::printf("outcomes by policy:");
  for (const auto& [k, n] : t.by_policy) std::printf("  %s %d;", k.c_str(), n);
  std::printf("\nprefill exit statuses by fault (-1: killed by the soak):");
  for (int k = 0; k < fault_kinds; ++k) {
    if (t.exits[static_cast<std::size_t>(k)].empty()) continue;
    std::printf("  %s", fault_names[static_cast<std::size_t>(k)]);
    for (const auto& [e, n] : t.exits[static_cast<std::size_t>(k)]) std::printf(" %d:%d", e, n);
    std::printf(";");
  }
  std::printf("\n");
  (void)c;
}

template <class Plan>
int soak(const soak_config& c, const ll::weights& w) {
  const ll::config& mc = w.cfg();
  const int layers = mc.n_layers;
  // One residual segment's bytes: the scheduler's window, so the sender never runs far ahead of
  // the decode side's acks and a fault mid-residual leaves residual segments missing.
  const std::size_t window = lynx::segment_bytes(
      lynx::make_geometry<Plan, 32>(lynx::kv_shape{c.prompt_tokens, mc.n_kv_heads, mc.head_size()}),
      1);

  // The prompts and their references, computed once before anything is measured.
  std::vector<std::vector<int>> prompts, references;
  const int distinct = std::clamp(c.requests / 3, 1, c.prompts);
  for (int p = 0; p < distinct; ++p) {
    prompts.push_back(
        ll::sample_prompt(w, c.seed * 1000 + static_cast<std::uint64_t>(p), c.prompt_tokens));
    references.push_back(dg::plain_greedy_reference<Plan>(w, prompts.back(), c.committed_tokens));
  }

  std::vector<lynx::failure_policy> policies = {lynx::failure_policy::fail_request,
                                                lynx::failure_policy::continue_unverified};
  if (c.transport == "tcp") policies.push_back(lynx::failure_policy::rerequest);

  std::printf(
      "Lynx soak: %d requests over %s (loopback), plan %s, stories260K (%d layers), %d-token "
      "prompts (%d distinct, seed %llu), %d committed tokens\n"
      "deadlines: anchor %lld ms, residual %lld ms, request %lld ms; hard per-request deadline "
      "%lld s; delayed segment held %lld ms; policies in turn:",
      c.requests, c.transport.c_str(), c.plan.c_str(), layers, c.prompt_tokens, distinct,
      static_cast<unsigned long long>(c.seed), c.committed_tokens,
      static_cast<long long>(c.deadlines.anchor.count()),
      static_cast<long long>(c.deadlines.residual.count()),
      static_cast<long long>(c.deadlines.request.count()),
      static_cast<long long>(c.hard_deadline.count()), static_cast<long long>(c.delay.count()));
  for (const auto p : policies) std::printf(" %s", std::string(lynx::to_string(p)).c_str());
  std::printf("\n");
  std::fflush(stdout);

  struct sigaction sa {};
  sa.sa_handler = on_hard_deadline;
  sa.sa_flags = SA_RESTART;
  ::sigemptyset(&sa.sa_mask);
  ::sigaction(SIGALRM, &sa, nullptr);

  std::mt19937_64 rng(c.seed);
  auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  tally t;
  const int warm = std::max(1, c.requests / 10);
  const resources before = measure();
  resources at_warm{};
  std::vector<double> seconds;
  const auto t_start = clock_type::now();
  for (int i = 0; i < c.requests; ++i) {
    request_record rec;
    rec.f.kind =
        static_cast<fault>(c.forced_fault >= 0 ? c.forced_fault : uniform(0, fault_kinds - 1));
    rec.f.layer = static_cast<std::uint32_t>(uniform(0, layers - 2));
    rec.f.residuals_before_kill = uniform(0, layers - 2);
    rec.f.cut_permille = uniform(1, 999);
    rec.f.flip_at = static_cast<std::size_t>(uniform(0, 1 << 20));
    rec.f.flip_mask = static_cast<std::byte>(1u << uniform(0, 7));
    rec.f.stale_layers = uniform(1, layers);
    rec.f.delay = c.delay;
    rec.policy = policies[static_cast<std::size_t>(i) % policies.size()];
    const std::size_t p = static_cast<std::size_t>(i % distinct);

    g_request = i;
    g_child_count = 0;
    arm_hard_deadline(c.hard_deadline);
    const auto t0 = clock_type::now();
#if defined(LYNX_WITH_UCX)
    if (c.transport == "ucx")
      run_ucx_request<Plan>(rec, w, prompts[p], c, window);
    else
#endif
      run_tcp_request<Plan>(rec, w, prompts[p], c, window);
    disarm_hard_deadline();
    rec.hung = g_hung != 0;
    g_child_count = 0;
    rec.seconds = std::chrono::duration<double>(clock_type::now() - t0).count();
    seconds.push_back(rec.seconds);
    judge(rec, references[p], c, t, i);
    if (c.verbose)
      std::printf("request %d: %s / %s: %s, %zu commits, %.0f ms\n", i,
                  fault_names[static_cast<std::size_t>(rec.f.kind)],
                  std::string(lynx::to_string(rec.policy)).c_str(),
                  rec.abandoned ? "abandoned"
                  : rec.decode  ? std::string(lynx::to_string(rec.decode->outcome)).c_str()
                                : "exception",
                  rec.commits.size(), rec.seconds * 1e3);
    if (c.verbose && rec.decode)
      for (const auto& f : rec.decode->failures)
        std::printf("  failure at %.1f ms: %s (%s) -> %s\n", f.at * 1e3, f.what.c_str(),
                    std::string(lynx::to_string(f.status)).c_str(),
                    std::string(lynx::to_string(f.applied)).c_str());
    if (i + 1 == warm) at_warm = measure();
    if ((i + 1) % 100 == 0 && i + 1 < c.requests) {
      std::printf("... %d requests, %.1f s\n", i + 1,
                  std::chrono::duration<double>(clock_type::now() - t_start).count());
      std::fflush(stdout);
    }
  }
  const double total = std::chrono::duration<double>(clock_type::now() - t_start).count();
  const resources after = measure();
  // No child left: every one was reaped (waitpid answers ECHILD).
  int leftover = 0;
  for (int st = 0; ::waitpid(-1, &st, WNOHANG) > 0;) ++leftover;
  const bool children_left =
      leftover > 0 || !(::waitpid(-1, nullptr, WNOHANG) < 0 && errno == ECHILD);

  for (int k = 0; k < fault_kinds; ++k) {
    const tally::row& r = t.rows[static_cast<std::size_t>(k)];
    tally::row& all = t.rows[fault_kinds];
    all.drawn += r.drawn;
    all.exact += r.exact;
    all.unverified += r.unverified;
    all.failed += r.failed;
    all.abandoned += r.abandoned;
    all.no_effect += r.no_effect;
    all.unexpected += r.unexpected;
    all.wrong += r.wrong;
    all.hangs += r.hangs;
    all.sender_hangs += r.sender_hangs;
    all.thrown += r.thrown;
    all.unverified_tokens += r.unverified_tokens;
    all.unverified_differ += r.unverified_differ;
    all.rejected += r.rejected;
    all.duplicates += r.duplicates;
    all.stale += r.stale;
    all.rerequests += r.rerequests;
  }
  print_table(t, c);
  std::sort(seconds.begin(), seconds.end());
  std::printf("time: %.1f s for %d requests: %.0f ms per request (median %.0f ms, max %.0f ms)\n",
              total, c.requests, total / c.requests * 1e3, seconds[seconds.size() / 2] * 1e3,
              seconds.back() * 1e3);
  const long fd_growth = after.fds - at_warm.fds, thread_growth = after.threads - at_warm.threads,
             rss_growth = after.rss_kib - at_warm.rss_kib;
  std::printf("%-22s %10s %12s %10s %16s %10s\n", "resources", "before",
              ("after " + std::to_string(warm)).c_str(), "end", "growth (10%->end)", "bound");
  std::printf("%-22s %10ld %12ld %10ld %16ld %10ld\n", "open descriptors", before.fds, at_warm.fds,
              after.fds, fd_growth, c.fd_growth_bound);
  std::printf("%-22s %10ld %12ld %10ld %16ld %10ld\n", "threads", before.threads, at_warm.threads,
              after.threads, thread_growth, c.thread_growth_bound);
  std::printf("%-22s %10ld %12ld %10ld %16ld %10ld\n", "resident memory (KiB)", before.rss_kib,
              at_warm.rss_kib, after.rss_kib, rss_growth, c.rss_growth_bound_kib);
  std::printf("child processes left unreaped: %d\n", children_left ? std::max(leftover, 1) : 0);
  for (const auto& n : t.notes) std::printf("  note: %s\n", n.c_str());

  const tally::row& all = t.rows[fault_kinds];
  std::vector<std::string> broken;
  if (all.hangs) broken.push_back(std::to_string(all.hangs) + " hangs");
  if (all.sender_hangs) broken.push_back(std::to_string(all.sender_hangs) + " sender hangs");
  if (all.wrong) broken.push_back(std::to_string(all.wrong) + " wrong committed tokens");
  if (all.unexpected) broken.push_back(std::to_string(all.unexpected) + " unexpected outcomes");
  if (all.thrown) broken.push_back(std::to_string(all.thrown) + " requests ended by an exception");
  if (fd_growth > c.fd_growth_bound) broken.push_back("descriptor growth");
  if (thread_growth > c.thread_growth_bound) broken.push_back("thread growth");
  if (rss_growth > c.rss_growth_bound_kib) {
    if (sanitized)  // its quarantine holds freed memory back: RSS grows by design
      std::printf("RSS growth beyond the bound not judged: a sanitizer build\n");
    else
      broken.push_back("RSS growth");
  }
  if (children_left) broken.push_back("child processes left");
  if (broken.empty()) {
    std::printf("soak: PASS\n");
    return 0;
  }
  std::printf("soak: FAIL:");
  for (const auto& b : broken) std::printf(" %s;", b.c_str());
  std::printf("\n");
  return 1;
}

}  // namespace

int main(int argc, char** argv) try {
  const soak_config c = parse(argc, argv);
  std::filesystem::path model = c.model;
  if (model.empty()) {
    const char* dir = std::getenv("LYNX_MODEL_DIR");
    model = std::filesystem::path(dir != nullptr && *dir != '\0'
                                      ? std::string(dir)
                                      : std::string(LYNX_SOURCE_DIR) + "/examples/models") /
            "stories260K.bin";
  }
  if (!std::filesystem::is_regular_file(model)) {
    std::printf("SKIPPED: the model %s is not there\n", model.string().c_str());
    return 77;
  }
  if (c.transport == "ucx") {
#if defined(LYNX_WITH_UCX)
    ::setenv("UCX_TLS", "tcp", 1);  // loopback over tcp, as the UCX tests run it
    ::setenv("UCX_NET_DEVICES", "lo", 1);
    if (const std::string why = ucx_problem(); !why.empty()) {
      std::printf("SKIPPED: the UCX soak: UCX cannot listen on loopback here: %s\n", why.c_str());
      return 77;
    }
#else
    std::printf(
        "SKIPPED: the UCX soak: this build has no UCX (libucx-dev not found; LYNX_WITH_UCX "
        "undefined)\n");
    return 77;
#endif
  }
  const ll::weights w(model);
  if (c.prompt_tokens + c.committed_tokens > w.cfg().seq_len)
    usage("the model's context is too short");
  if (c.plan == "16=4+12") return soak<lynx::plan_16_4_12>(c, w);
  return soak<lynx::plan_8_4_4>(c, w);
} catch (const std::exception& e) {
  std::fprintf(stderr, "soak: %s\n", e.what());
  return 1;
}
