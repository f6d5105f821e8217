// A real slow link: two network namespaces joined by a veth pair whose sending
// side is rate-limited by a tc token bucket (tbf), made and removed by this
// program (needs root; it says so and exits 0 when `ip netns add` fails). A
// sender runs in one namespace, a receiver in the other; traffic goes only
// between them, over Lynx's TCP transport and (in a build with lynx::ucx, which
// defines LYNX_WITH_UCX) over its UCX transport (UCX_TLS=tcp on the veth). For a
// Llama-3-8B-shaped cache (32 layers, 8 KV heads, head_dim 128) it measures,
// per transport and rate, with fresh connections (endpoints) per trial:
//
//   blocking 8-bit   plan 8=8, every layer on one connection; decode can start when all have landed
//   blocking 4-bit   only the anchor segments of 8=4+4, one connection
//   Lynx 8=4+4       anchors on lane 0, residuals on lane 1 through the stream
//                    scheduler; "anchor landed" = every layer's anchor received
//                    while the residual is still in flight
//   Lynx, no write priority   the same with tcp_options::anchor_first_writes
//                    (ucx_options::anchor_first_posts) off: the two lanes then
//                    share the link fairly (window only)
//
// Times are from the sender's first post (connections already open) to the
// receiver holding the bytes, on the one CLOCK_MONOTONIC both processes share.
// The bar: Lynx's anchor within 10% of blocking 4-bit. Plain main; prints a table.
//
// Each figure is the median of R trials; by default R is chosen per rate so a
// row takes about 2 s of transfers (3 to 25 trials): short transfers are
// noisy (a scheduling stall of a few ms on a small machine is a large part of
// a 3 ms transfer), and their medians need more trials.
//
//   bench_slow_link [--tokens N] [--reps R] [--rates 1gbit,10gbit] [--window-mib W]
//                   [--transports tcp,ucx]
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <lynx/planes/codec.hpp>
#include <lynx/transport/scheduler.hpp>
#include <lynx/transport/tcp.hpp>
#if defined(LYNX_WITH_UCX)
#include <lynx/transport/ucx.hpp>
#endif

namespace {

using clock_type = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr int layers = 32;
constexpr std::int64_t kv_heads = 8, head_dim = 128;
constexpr std::uint16_t port = 47311;
const char* const sender_ip = "10.201.77.1";
const char* const receiver_ip = "10.201.77.2";

int sh(const std::string& cmd) {
  const int rc = std::system((cmd + " >/dev/null 2>&1").c_str());
  return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

/// The two namespaces and the veth between them; removed on destruction.
struct namespaces {
  std::string a, b, va, vb;
  bool made = false;
  namespaces() {
    const std::string id = std::to_string(::getpid());
    a = "lynx_sl_a" + id;
    b = "lynx_sl_b" + id;
    va = "lxsa" + id;
    vb = "lxsb" + id;
    if (sh("ip netns add " + a) != 0) return;
    if (sh("ip netns add " + b) != 0) {
      sh("ip netns del " + a);
      return;
    }
    made = true;
    const bool ok =
        sh("ip link add " + va + " type veth peer name " + vb) == 0 &&
        sh("ip link set " + va + " netns " + a) == 0 &&
        sh("ip link set " + vb + " netns " + b) == 0 &&
        sh("ip netns exec " + a + " ip addr add " + sender_ip + "/24 dev " + va) == 0 &&
        sh("ip netns exec " + b + " ip addr add " + receiver_ip + "/24 dev " + vb) == 0 &&
        sh("ip netns exec " + a + " ip link set " + va + " up") == 0 &&
        sh("ip netns exec " + b + " ip link set " + vb + " up") == 0 &&
        sh("ip netns exec " + a + " ip link set lo up") == 0 &&
        sh("ip netns exec " + b + " ip link set lo up") == 0;
    if (!ok)
      throw lynx::error(lynx::errc::transport_failure,
                        "slow_link: could not build the veth pair between " + a + " and " + b);
  }
  ~namespaces() {
    if (made) {
      sh("ip netns del " + a);  // deleting a namespace deletes its end of the veth, and so the pair
      sh("ip netns del " + b);
    }
  }
  /// A token bucket of `rate` on both directions (data one way, acks the other).
  /// Burst: 2 ms of traffic, at least 256 KiB (tbf needs burst >= rate / HZ).
  void set_rate(const std::string& rate, double gbit) const {
    const auto burst = std::max<long>(256 * 1024, static_cast<long>(gbit * 1e9 / 8 * 0.002));
    for (const auto& [ns, dev] : {std::pair{a, va}, std::pair{b, vb}}) {
      const std::string cmd = "ip netns exec " + ns + " tc qdisc replace dev " + dev +
                              " root tbf rate " + rate + " burst " + std::to_string(burst) +
                              " latency 100ms";
      if (sh(cmd) != 0)
        throw lynx::error(lynx::errc::transport_failure, "slow_link: '" + cmd + "' failed");
    }
  }
};

void enter_namespace(const std::string& name) {
  const int fd = ::open(("/var/run/netns/" + name).c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0 || ::setns(fd, CLONE_NEWNET) != 0) {
    std::perror(("setns " + name).c_str());
    ::_exit(90);
  }
  ::close(fd);
  // As `ip netns exec` does: a private mount namespace with this network
  // namespace's /sys, where UCX looks for network devices.
  if (::unshare(CLONE_NEWNS) != 0 || ::mount("", "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0 ||
      ::umount2("/sys", MNT_DETACH) != 0 || ::mount(name.c_str(), "/sys", "sysfs", 0, nullptr) != 0)
    std::perror("slow_link: remounting /sys in the network namespace");
}

enum class mode { blocking_8, blocking_4, lynx, lynx_no_write_priority };
const char* name_of(mode m) {
  switch (m) {
    case mode::blocking_8:
      return "blocking 8-bit (8=8)";
    case mode::blocking_4:
      return "blocking 4-bit (anchors alone)";
    case mode::lynx:
      return "Lynx 8=4+4, two lanes";
    case mode::lynx_no_write_priority:
      return "Lynx 8=4+4, no write priority";
  }
  return "?";
}

/// What one trial's processes report through a pipe (nanoseconds of CLOCK_MONOTONIC).
struct trial_report {
  std::int64_t start_ns = 0;    // sender: first post
  std::int64_t anchors_ns = 0;  // receiver: every stream-0 segment held
  std::int64_t all_ns = 0;      // receiver: every segment held
  std::int64_t bytes = 0;       // received, headers included
  int segments = 0, bad_checksums = 0;
  int status = 0;  // errc of the side that failed, 0 when fine
};

std::int64_t ns_now() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(clock_type::now().time_since_epoch())
      .count();
}

struct cache {
  std::vector<lynx::encoded_layer<lynx::plan_8_4_4>> progressive;
  std::vector<lynx::encoded_layer<lynx::plan_8_8>> blocking8;
};

std::vector<std::span<const std::byte>> segments_for(const cache& c, mode m) {
  std::vector<std::span<const std::byte>> s;
  for (int l = 0; l < layers; ++l) {
    if (m == mode::blocking_8)
      s.push_back(c.blocking8[static_cast<std::size_t>(l)].segment(0));
    else
      s.push_back(c.progressive[static_cast<std::size_t>(l)].segment(0));
    if (m == mode::lynx || m == mode::lynx_no_write_priority)
      s.push_back(c.progressive[static_cast<std::size_t>(l)].segment(1));
  }
  return s;
}

void write_report(int fd, const trial_report& r) {
  if (::write(fd, &r, sizeof r) != static_cast<ssize_t>(sizeof r)) ::_exit(91);
}

enum class transport { tcp, ucx };
const char* name_of(transport t) { return t == transport::tcp ? "tcp" : "ucx"; }

/// Receives `expected` segments, noting when every anchor (stream 0) and every
/// segment is held; the checksums are checked after the clock stopped.
template <class Receiver>
void receive_all(Receiver& receiver, int lanes, int expected, trial_report& rep) {
  const int anchors_expected = lanes == 2 ? expected / 2 : expected;
  int anchors = 0;
  std::vector<lynx::received_segment<clock_type>> held;
  for (int i = 0; i < expected; ++i) {
    const auto r = receiver.try_receive(clock_type::now() + 120s);
    if (!r.ok()) {
      rep.status = static_cast<int>(r.status);
      break;
    }
    const auto h = lynx::peek_header(r.segment.bytes);
    if (h.stream == 0 && ++anchors == anchors_expected) rep.anchors_ns = ns_now();
    rep.bytes += static_cast<std::int64_t>(r.segment.bytes.size());
    ++rep.segments;
    held.push_back(r.segment);
  }
  rep.all_ns = ns_now();
  for (const auto& s : held) {
    const auto h = lynx::peek_header(s.bytes);
    if (lynx::segment_checksum(h, s.bytes.subspan(lynx::segment_header_bytes)) != h.checksum)
      ++rep.bad_checksums;
    receiver.release(s);
  }
}

/// UCX over TCP on this namespace's end of the veth (set before UCX reads its configuration).
void use_veth(const std::string& device) {
  ::setenv("UCX_TLS", "tcp", 1);
  ::setenv("UCX_NET_DEVICES", device.c_str(), 1);
  ::setenv("UCX_WARN_UNUSED_ENV_VARS", "n", 1);
}

// `bye_fd`: the receiver's process stays until the parent says the sender is
// done (a UCX receiver that exits tears down endpoints the sender still reads acks from).
int receiver_main(const namespaces& ns, transport t, int lanes, int expected, int report_fd,
                  int ready_fd, [[maybe_unused]] int bye_fd) {
  enter_namespace(ns.b);
  trial_report rep;
  const char go = 1;
  try {
    if (t == transport::tcp) {
      lynx::tcp_listener listener(receiver_ip, port);
      if (::write(ready_fd, &go, 1) != 1) return 92;
      auto receiver = lynx::tcp_receiver::accept(listener, clock_type::now() + 30s, {}, lanes);
      receive_all(receiver, lanes, expected, rep);
    } else {
#if defined(LYNX_WITH_UCX)
      use_veth(ns.vb);
      lynx::ucx_receiver receiver(receiver_ip, port + 1);
      if (::write(ready_fd, &go, 1) != 1) return 92;
      receiver.accept(clock_type::now() + 30s, lanes);
      receive_all(receiver, lanes, expected, rep);
      const lynx::errc f = receiver.flush_acks(clock_type::now() + 30s);
      if (rep.status == 0 && f != lynx::errc::ok) rep.status = static_cast<int>(f);
      write_report(report_fd, rep);
      // Progress until the parent says bye: the sender's endpoints close
      // gracefully (a close needs this side's progress) instead of timing out.
      pollfd bye{bye_fd, POLLIN, 0};
      while (::poll(&bye, 1, 0) == 0)
        if (receiver.try_receive(clock_type::now() + 2ms).status != lynx::errc::timeout)
          ::poll(&bye, 1, 1);
      return 0;
#endif
    }
  } catch (const lynx::error& e) {
    std::fprintf(stderr, "receiver: %s\n", e.what());
    rep.status = static_cast<int>(e.code());
  }
  write_report(report_fd, rep);
  return 0;
}

template <class Sender>
lynx::errc send_all(Sender& sender, const cache& c, mode m, std::size_t window, trial_report& rep) {
  lynx::stream_scheduler scheduler(sender, {window});
  for (const auto s : segments_for(c, m)) scheduler.submit(s);
  rep.start_ns = ns_now();
  return scheduler.run(clock_type::now() + 120s);
}

int sender_main(const namespaces& ns, transport t, const cache& c, mode m, std::size_t window,
                int report_fd) {
  enter_namespace(ns.a);
  trial_report rep;
  try {
    const int lanes = (m == mode::lynx || m == mode::lynx_no_write_priority) ? 2 : 1;
    const bool priority = m != mode::lynx_no_write_priority;
    if (t == transport::tcp) {
      lynx::tcp_options o;
      o.anchor_first_writes = priority;
      auto sender = lynx::tcp_sender::connect(receiver_ip, port, clock_type::now() + 30s, o, lanes);
      rep.status = static_cast<int>(send_all(sender, c, m, window, rep));
    } else {
#if defined(LYNX_WITH_UCX)
      use_veth(ns.va);
      lynx::ucx_options o;
      o.anchor_first_posts = priority;
      lynx::ucx_sender sender(receiver_ip, port + 1, clock_type::now() + 30s, lanes, o);
      rep.status = static_cast<int>(send_all(sender, c, m, window, rep));
#endif
    }
  } catch (const lynx::error& e) {
    std::fprintf(stderr, "sender: %s\n", e.what());
    rep.status = static_cast<int>(e.code());
  }
  write_report(report_fd, rep);
  return 0;
}

pid_t spawn(const std::function<int()>& body) {
  std::fflush(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    ::alarm(180);
    ::_exit(body());
  }
  return pid;
}

struct trial_result {
  double anchor_ms = 0, all_ms = 0, bytes = 0;
  bool ok = false;
};

trial_result run_trial(const namespaces& ns, transport tr, const cache& c, mode m,
                       std::size_t window) {
  // Every trial starts with a full token bucket: the burst (2 ms of traffic)
  // refills in 2 ms once the previous trial's bytes have left; a trial started
  // right behind another would get less of it than its neighbours.
  std::this_thread::sleep_for(20ms);
  const int lanes = (m == mode::lynx || m == mode::lynx_no_write_priority) ? 2 : 1;
  const int expected = static_cast<int>(segments_for(c, m).size());
  int rx[2], tx[2], ready[2], bye[2];
  if (::pipe(rx) || ::pipe(tx) || ::pipe(ready) || ::pipe(bye))
    throw lynx::error(lynx::errc::internal, "pipe failed");
  const pid_t receiver =
      spawn([&] { return receiver_main(ns, tr, lanes, expected, rx[1], ready[1], bye[0]); });
  for (const int fd : {rx[1], ready[1], bye[0]}) ::close(fd);  // a child that dies means EOF
  char go = 0;
  const bool listening = ::read(ready[0], &go, 1) == 1;
  const pid_t sender =
      listening ? spawn([&] { return sender_main(ns, tr, c, m, window, tx[1]); }) : -1;
  ::close(tx[1]);
  trial_report r, s;
  const bool got_r = ::read(rx[0], &r, sizeof r) == static_cast<ssize_t>(sizeof r);
  const bool got_s = sender > 0 && ::read(tx[0], &s, sizeof s) == static_cast<ssize_t>(sizeof s);
  [[maybe_unused]] const auto said_bye = ::write(bye[1], &go, 1);  // fails when it is gone
  for (const pid_t p : {receiver, sender})
    if (p > 0) ::waitpid(p, nullptr, 0);
  for (const int fd : {rx[0], tx[0], ready[0], bye[1]}) ::close(fd);
  trial_result t;
  t.ok = got_r && got_s && r.status == 0 && s.status == 0 && r.segments == expected &&
         r.bad_checksums == 0;
  if (!t.ok)
    std::fprintf(
        stderr,
        "  %s trial %s failed: receiver status %d (%d/%d segments, %d bad), sender status %d\n",
        name_of(tr), name_of(m), r.status, r.segments, expected, r.bad_checksums, s.status);
  t.anchor_ms = static_cast<double>(r.anchors_ns - s.start_ns) * 1e-6;
  t.all_ms = static_cast<double>(r.all_ns - s.start_ns) * 1e-6;
  t.bytes = static_cast<double>(r.bytes);
  return t;
}

std::vector<std::string> split(const std::string& list) {
  std::vector<std::string> out;
  std::size_t start = 0;
  while (start < list.size()) {
    const std::size_t comma = list.find(',', start);
    out.push_back(
        list.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
    start = comma == std::string::npos ? list.size() : comma + 1;
  }
  return out;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  if (v.empty()) return 0.0;
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

}  // namespace

int main(int argc, char** argv) {
  std::int64_t tokens = 4096;
  int reps = 0;  // 0: chosen per rate (see the top of this file)
  double window_mib = 8;
  std::string rates = "1gbit,10gbit";
#if defined(LYNX_WITH_UCX)
  std::string transports = "tcp,ucx";
#else
  std::string transports = "tcp";
#endif
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--tokens")
      tokens = std::stoll(v);
    else if (k == "--reps")
      reps = std::stoi(v);
    else if (k == "--rates")
      rates = v;
    else if (k == "--window-mib")
      window_mib = std::stod(v);
    else if (k == "--transports")
      transports = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  std::vector<transport> kinds;
  for (const std::string& t : split(transports)) {
    if (t == "tcp") {
      kinds.push_back(transport::tcp);
    } else if (t == "ucx") {
#if defined(LYNX_WITH_UCX)
      kinds.push_back(transport::ucx);
#else
      std::printf(
          "ucx: not in this build (bench_slow_link needs lynx::ucx, which defines "
          "LYNX_WITH_UCX); measuring the others\n");
#endif
    } else {
      std::fprintf(stderr, "unknown transport %s (tcp, ucx)\n", t.c_str());
      return 2;
    }
  }
  ::signal(SIGPIPE, SIG_IGN);  // a receiver that died must not kill this process
  if (::geteuid() != 0) {
    std::printf("SKIPPED: slow_link needs root to create network namespaces (ip netns add)\n");
    return 0;
  }
  namespaces ns;
  if (!ns.made) {
    std::printf(
        "SKIPPED: 'ip netns add' failed (no CAP_SYS_ADMIN or no iproute2); nothing measured\n");
    return 0;
  }

  const lynx::kv_shape shape{tokens, kv_heads, head_dim};
  std::printf(
      "Llama-3-8B-shaped cache: %d layers x [%lld tokens, %lld KV heads, head_dim %lld], K and V\n",
      layers, static_cast<long long>(tokens), static_cast<long long>(kv_heads),
      static_cast<long long>(head_dim));
  const auto t0 = clock_type::now();
  cache c;
  {
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> k(static_cast<std::size_t>(shape.elements())), v(k.size());
    lynx::encode_options o;
    o.threads = 0;
    for (int l = 0; l < layers; ++l) {
      for (auto& x : k) x = normal(rng);
      for (auto& x : v) x = normal(rng);
      const auto kv = lynx::token_major<const float>(k.data(), shape);
      const auto vv = lynx::token_major<const float>(v.data(), shape);
      c.progressive.push_back(
          lynx::encode<lynx::plan_8_4_4>(kv, vv, static_cast<std::uint32_t>(l), o));
      c.blocking8.push_back(lynx::encode<lynx::plan_8_8>(kv, vv, static_cast<std::uint32_t>(l), o));
    }
  }
  double anchor_mb = 0, residual_mb = 0, full_mb = 0;
  for (int l = 0; l < layers; ++l) {
    anchor_mb +=
        static_cast<double>(c.progressive[static_cast<std::size_t>(l)].segment(0).size()) / 1e6;
    residual_mb +=
        static_cast<double>(c.progressive[static_cast<std::size_t>(l)].segment(1).size()) / 1e6;
    full_mb +=
        static_cast<double>(c.blocking8[static_cast<std::size_t>(l)].segment(0).size()) / 1e6;
  }
  const auto window = static_cast<std::size_t>(window_mib * (1 << 20));
  std::printf(
      "segments: anchors %.1f MB, residuals %.1f MB (8=4+4); blocking 8-bit %.1f MB; encoded in "
      "%.1f s\n",
      anchor_mb, residual_mb, full_mb,
      std::chrono::duration<double>(clock_type::now() - t0).count());
  std::printf(
      "link: veth between two network namespaces, tc tbf on each direction; fresh connections "
      "(endpoints) per trial;\n"
      "residual window %.1f MiB (the scheduler's residual_window_bytes; one residual segment is "
      "%.1f MiB); the median of %s trials\n\n",
      window_mib, static_cast<double>(c.progressive[0].segment(1).size()) / (1 << 20),
      reps > 0 ? std::to_string(reps).c_str() : "3 to 25");

  bool all_pass = true;
  std::vector<std::string> summary;
  for (const std::string& rate : split(rates)) {
    const double gbit = std::stod(rate) * (rate.find("gbit") != std::string::npos   ? 1.0
                                           : rate.find("mbit") != std::string::npos ? 1e-3
                                                                                    : 1e-9);
    ns.set_rate(rate, gbit);
    // About 2 s of blocking 8-bit transfers per row, 3 to 25 trials.
    const double seconds_8bit = full_mb * 8e-3 / gbit;
    const int trials = reps > 0 ? reps : std::clamp(static_cast<int>(2.0 / seconds_8bit), 3, 25);
    for (const transport tr : kinds) {
      const mode modes[] = {mode::blocking_8, mode::blocking_4, mode::lynx,
                            mode::lynx_no_write_priority};
      std::vector<double> anchor[4], all[4], bytes[4];
      bool ok = true;
      for (int r = 0; r < trials; ++r)
        for (int i = 0; i < 4; ++i) {
          const trial_result t = run_trial(ns, tr, c, modes[i], window);
          ok = ok && t.ok;
          anchor[i].push_back(t.anchor_ms);
          all[i].push_back(t.all_ms);
          bytes[i].push_back(t.bytes);
        }
      std::printf("%s, rate %s (median of %d trials)\n", name_of(tr), rate.c_str(), trials);
      std::printf("  %-32s %10s %16s %16s %12s\n", "transfer", "MB", "anchor landed", "all landed",
                  "goodput");
      for (int i = 0; i < 4; ++i) {
        const double a = median(anchor[i]), f = median(all[i]), mb = median(bytes[i]) / 1e6;
        const bool progressive = modes[i] == mode::lynx || modes[i] == mode::lynx_no_write_priority;
        char anchor_col[32] = "-";
        if (progressive) std::snprintf(anchor_col, sizeof anchor_col, "%.1f ms", a);
        std::printf("  %-32s %10.1f %16s %13.1f ms %7.2f Gbit/s\n", name_of(modes[i]), mb,
                    anchor_col, f, mb * 8e-3 / (f * 1e-3));
      }
      const double ratio = median(anchor[2]) / median(all[1]);
      const double ratio_np = median(anchor[3]) / median(all[1]);
      const bool pass = ok && ratio <= 1.10;
      all_pass = all_pass && pass;
      std::printf(
          "  Lynx anchor / blocking 4-bit = %.3f (bar <= 1.10: %s); without write priority %.3f\n",
          ratio, pass ? "PASS" : "FAIL", ratio_np);
      std::printf("  Lynx anchor vs blocking 8-bit: %.2fx sooner\n\n",
                  median(all[0]) / median(anchor[2]));
      char line[160];
      std::snprintf(line, sizeof line, "  %-4s %-8s %8.1f ms %8.1f ms %7.3f %s%s", name_of(tr),
                    rate.c_str(), median(all[1]), median(anchor[2]), ratio, pass ? "PASS" : "FAIL",
                    ok ? "" : " (a trial failed)");
      summary.push_back(line);
    }
  }
  std::printf("summary, %lld tokens: transport, rate, blocking 4-bit, Lynx anchor, ratio, bar\n",
              static_cast<long long>(tokens));
  for (const auto& l : summary) std::printf("%s\n", l.c_str());
  return all_pass ? 0 : 1;
}
