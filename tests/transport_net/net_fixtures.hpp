// Shared by the two-process transport tests: deterministic layers that both
// processes can rebuild from a seed, a forked child process that cannot outlive
// its test, and the receive loop that fills bit-plane tensors.
#pragma once

#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include <lynx/planes/codec.hpp>
#include <lynx/planes/tensor.hpp>
#include <lynx/transport/concepts.hpp>
#include <lynx/transport/scheduler.hpp>

#if defined(LYNX_WITH_UCX) && __has_include(<ucp/api/ucp.h>)
#include <cstdlib>
#include <string>

#include <lynx/transport/ucx.hpp>

#include "../support/skip.hpp"
#endif

namespace lynx::test {

using namespace std::chrono_literals;

/// K and V of one layer, [tokens, kv_heads, head_dim] token-major, from (seed, layer) alone.
struct layer_data {
  std::vector<float> keys, values;
  layer_data(kv_shape shape, std::uint32_t layer, std::uint32_t seed) {
    std::mt19937 rng(seed * 7919u + layer);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    keys.resize(static_cast<std::size_t>(shape.elements()));
    values.resize(keys.size());
    for (auto& x : keys) x = normal(rng);
    for (auto& x : values) x = 0.5f * normal(rng) + 0.25f;
  }
};

template <stream_plan_type Plan>
encoded_layer<Plan> encode_layer(kv_shape shape, std::uint32_t layer, std::uint32_t seed,
                                 std::uint64_t generation) {
  const layer_data d(shape, layer, seed);
  encode_options o;
  o.generation = generation;
  return encode<Plan>(token_major<const float>(d.keys.data(), shape),
                      token_major<const float>(d.values.data(), shape), layer, o);
}

template <stream_plan_type Plan>
quantized_layer quantize_layer(kv_shape shape, std::uint32_t layer, std::uint32_t seed) {
  const layer_data d(shape, layer, seed);
  return quantize<Plan>(token_major<const float>(d.keys.data(), shape),
                        token_major<const float>(d.values.data(), shape), layer);
}

inline bool same_floats(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() &&
         (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}
/// Bit-for-bit equality of codes and parameters.
inline bool same_bits(const quantized_layer& a, const quantized_layer& b) {
  return a.geometry == b.geometry && a.key_codes == b.key_codes && a.value_codes == b.value_codes &&
         same_floats(a.key_scale, b.key_scale) && same_floats(a.key_zero, b.key_zero) &&
         same_floats(a.value_scale, b.value_scale) && same_floats(a.value_zero, b.value_zero);
}

/// The first of `layers` tensors that is not complete or whose merged codes are
/// not quantize's bits (quantize_layer's data), or -1 when every one is exact.
template <stream_plan_type Plan, class Tensors>
int first_inexact_layer(const Tensors& tensors, int layers, kv_shape shape, std::uint32_t seed) {
  for (int l = 0; l < layers; ++l) {
    const auto& t = tensors[static_cast<std::size_t>(l)];
    if (!t.complete() ||
        !same_bits(merge(t), quantize_layer<Plan>(shape, static_cast<std::uint32_t>(l), seed)))
      return l;
  }
  return -1;
}

/// A forked child running `body`; its exit code is body's return value (an
/// escaped lynx::error exits with 100 + its code, anything else with 99). It
/// dies with its parent (PR_SET_PDEATHSIG) and after `limit` (alarm), so no
/// test leaves a process behind or waits forever on one.
class child_process {
 public:
  child_process(std::function<int()> body, unsigned limit_seconds = 30) {
    std::fflush(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGKILL);
      ::alarm(limit_seconds);
      int rc = 99;
      try {
        rc = body();
      } catch (const lynx::error& e) {
        std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), e.what());
        rc = 100 + static_cast<int>(e.code());
      } catch (const std::exception& e) {
        std::fprintf(stderr, "child %d: %s\n", static_cast<int>(::getpid()), e.what());
      }
      std::fflush(nullptr);
      ::_exit(rc);
    }
  }
  child_process(const child_process&) = delete;
  child_process& operator=(const child_process&) = delete;
  ~child_process() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int st = 0;
      ::waitpid(pid_, &st, 0);
    }
  }
  [[nodiscard]] bool started() const noexcept { return pid_ > 0; }
  void kill(int sig = SIGKILL) { ::kill(pid_, sig); }

  /// The exit code (or 128 + signal), or -1 when the child is still running at the deadline.
  int wait(std::chrono::steady_clock::time_point deadline) {
    while (true) {
      int st = 0;
      const pid_t r = ::waitpid(pid_, &st, WNOHANG);
      if (r == pid_) {
        reaped_ = true;
        return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
      }
      if (std::chrono::steady_clock::now() >= deadline) return -1;
      std::this_thread::sleep_for(2ms);
    }
  }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
};

/// The sender's side of a request: encodes `layers` layers of generation
/// `generation` (plus, first, the anchors of `stale_layers` layers of
/// generation - 1, a late old request), sends them through the stream
/// scheduler and returns 0 when every segment was delivered, 50 when a
/// record broke the completion contract, else the errc of the run.
template <stream_plan_type Plan, segment_sender Sender>
int send_request(Sender& sender, kv_shape shape, int layers, std::uint32_t seed,
                 std::uint64_t generation, std::size_t window, int stale_layers = 0) {
  std::vector<encoded_layer<Plan>> encoded, stale;
  for (int l = 0; l < stale_layers; ++l)
    stale.push_back(
        encode_layer<Plan>(shape, static_cast<std::uint32_t>(l), seed + 1, generation - 1));
  for (int l = 0; l < layers; ++l)
    encoded.push_back(encode_layer<Plan>(shape, static_cast<std::uint32_t>(l), seed, generation));
  stream_scheduler<Sender> scheduler(sender, {window});
  for (const auto& e : stale) scheduler.submit(e.segment(0));
  for (const auto& e : encoded)
    for (int s = 0; s < Plan::streams; ++s) scheduler.submit(e.segment(s));
  const errc status = scheduler.run(sender.now() + 20s);
  if (status != errc::ok) return static_cast<int>(status);
  for (const auto& r : scheduler.records())
    if (!r.released || !r.delivered || !r.reusable || r.reusable_at > r.delivered_at) return 50;
  return 0;
}

/// What the receiver saw of one segment.
struct arrival {
  segment_id id;
  lane_index lane = 0;
  errc accepted = errc::ok;  // the tensor's verdict
  bool duplicate = false;
};

/// Accepts one received segment into its layer's tensor, noting the verdict.
template <stream_plan_type Plan>
arrival deliver(std::vector<host_bitplane_tensor<Plan>>& tensors, std::span<const std::byte> bytes,
                lane_index lane) {
  arrival a;
  a.lane = lane;
  try {
    const segment_header h = peek_header(bytes);
    a.id = {h.layer, h.stream, h.generation};
    if (h.layer >= tensors.size()) detail::fail(errc::layer_mismatch, "layer out of range");
    a.duplicate = tensors[h.layer].accept(bytes) == accept_result::duplicate;
  } catch (const lynx::error& e) {
    a.accepted = e.code();
  }
  return a;
}

#if defined(LYNX_WITH_UCX) && __has_include(<ucp/api/ucp.h>)
/// Empty when UCX can listen on loopback over tcp here (UCX_TLS=tcp,
/// UCX_NET_DEVICES=lo, as the UCX tests run it), else why not: some containers
/// offer UCX no usable transport. Asked once per process, by a forked child,
/// so that this process holds no UCX state when the tests fork their own
/// UCX processes.
inline const std::string& ucx_loopback_problem() {
  static const std::string problem = []() -> std::string {
    int fd[2] = {-1, -1};
    if (::pipe(fd) != 0) return "pipe() failed";
    child_process probe([&] {
      ::setenv("UCX_TLS", "tcp", 1);
      ::setenv("UCX_NET_DEVICES", "lo", 1);
      try {
        const ucx_receiver listener("127.0.0.1", 0);
        return 0;
      } catch (const std::exception& e) {
        const std::string why = e.what();
        (void)!::write(fd[1], why.data(), why.size());
        return 1;
      }
    });
    ::close(fd[1]);
    const int status = probe.wait(std::chrono::steady_clock::now() + 20s);
    std::string why;
    char buffer[256];
    if (status != -1)
      for (ssize_t n; (n = ::read(fd[0], buffer, sizeof buffer)) > 0;)
        why.append(buffer, static_cast<std::size_t>(n));
    ::close(fd[0]);
    if (status == 0) return "";
    if (status == -1) return "creating a listener took more than 20 s";
    return why.empty() ? "the probe process exited with " + std::to_string(status) : why;
  }();
  return problem;
}

/// True when UCX can listen on loopback here; otherwise records why the
/// calling case is skipped (support/skip.hpp) and returns false.
inline bool ucx_or_skip() {
  if (ucx_loopback_problem().empty()) return true;
  lynx_tests::skip_case("UCX cannot listen on loopback here: " + ucx_loopback_problem());
  return false;
}
#endif

}  // namespace lynx::test
