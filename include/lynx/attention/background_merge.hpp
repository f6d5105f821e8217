// Merging a complete prompt into codes on a helper thread (host).
//
// Once the last stream of every layer has landed, decoding reads all planes of
// every token at every step; a code_tensor per layer makes that cheaper, but
// merging takes time (tens of milliseconds per 32K-token layer). Decoding need
// not wait for it: attention over a layer's codes gives the same bits as over
// its planes, so a decode step may read the codes of the layers merged so far
// and the planes of the rest. background_merge merges the layers one after
// another on its own thread and publishes each as soon as it is done.
//
//   lynx::background_merge<Plan, G> merge(tensors);      // starts at once
//   ...each decode step, for each layer l:
//   if (const auto* c = merge.layer(l)) attn(c->view(), ...);   // merged
//   else attn(tensors[l].view(), ...);                          // not yet
//
// The tensors must stay alive and complete while the merge runs (a complete
// bitplane_tensor no longer changes: duplicates of its segments are not
// copied). Destroying the merge stops it after the layer in progress and joins
// the thread. Kept slots (the codes of an earlier request, from release())
// can be passed in so that their buffers are reused (fresh pages cost a first
// touch that can outweigh the merge itself).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <mutex>
#include <span>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "lynx/attention/code_tensor.hpp"
#include "lynx/core/error.hpp"
#include "lynx/planes/stream_plan.hpp"
#include "lynx/planes/tensor.hpp"

namespace lynx {

template <stream_plan_type Plan, int G = 32>
class background_merge {
 public:
  using codes_type = code_tensor<Plan, G>;
  using layer_view = bitplane_view<Plan, G, host_space>;
  using clock = std::chrono::steady_clock;

  /// Nothing to merge: done() at once, every layer() null.
  background_merge() : done_(true) {}

  /// Checks that every layer is complete (else errc::invalid_argument naming the
  /// first layer that is not, and no thread starts), then merges layers[0],
  /// layers[1], ... on a helper thread, each with `threads` threads (<= 0: all
  /// hardware threads). `slots`: code tensors whose buffers are reused, in layer
  /// order (fewer than the layers, or none, is fine).
  explicit background_merge(std::vector<layer_view> layers, int threads = 1,
                            std::vector<codes_type> slots = {})
      : views_(std::move(layers)), codes_(std::move(slots)) {
    for (std::size_t i = 0; i < views_.size(); ++i)
      if (!(views_[i].level == Plan::streams))
        detail::fail(errc::invalid_argument,
                     "background_merge: layer " + std::to_string(views_[i].layer) + " (entry " +
                         std::to_string(i) + ") has " + std::to_string(views_[i].level) + " of " +
                         std::to_string(Plan::streams) +
                         " streams; codes are made from every "
                         "plane (start the merge once the last stream has landed)");
    codes_.resize(views_.size());
    started_ = clock::now();
    if (views_.empty()) {
      finished_ = started_;
      done_ = true;
      return;
    }
    worker_ = std::thread([this, threads] { run(threads); });
  }
  /// Every tensor of a prompt (one per layer).
  explicit background_merge(std::span<const bitplane_tensor<Plan, G, host_space>> tensors,
                            int threads = 1, std::vector<codes_type> slots = {})
      : background_merge(views_of(tensors), threads, std::move(slots)) {}

  background_merge(const background_merge&) = delete;
  background_merge& operator=(const background_merge&) = delete;
  ~background_merge() {
    cancel();
    if (worker_.joinable()) worker_.join();
  }

  /// Layers to merge.
  [[nodiscard]] std::size_t size() const noexcept { return views_.size(); }
  /// Layers merged so far (a prefix: 0 .. ready() - 1).
  [[nodiscard]] std::size_t ready() const noexcept {
    return ready_.load(std::memory_order_acquire);
  }
  /// Entry i's codes once merged, else null (never blocks). errc::invalid_argument
  /// for an entry that does not exist.
  [[nodiscard]] const codes_type* layer(std::size_t i) const {
    if (i >= views_.size())
      detail::fail(errc::invalid_argument, "background_merge: entry " + std::to_string(i) + " of " +
                                               std::to_string(views_.size()) + " layers");
    return i < ready() ? &codes_[i] : nullptr;
  }
  /// Every layer merged, or the merge stopped (cancelled or failed).
  [[nodiscard]] bool done() const noexcept { return done_.load(std::memory_order_acquire); }
  /// The merge stopped on an error (wait() rethrows it).
  [[nodiscard]] bool failed() const {
    std::lock_guard lock(mutex_);
    return static_cast<bool>(error_);
  }

  /// Blocks until done(); rethrows the helper thread's error, if any.
  void wait() const {
    std::unique_lock lock(mutex_);
    finished_cv_.wait(lock, [&] { return done_.load(std::memory_order_relaxed); });
    if (error_) std::rethrow_exception(error_);
  }
  /// Stops after the layer in progress; the layers merged so far stay readable.
  void cancel() noexcept { stop_.store(true, std::memory_order_relaxed); }

  /// Time from the start to done() (zero while running).
  [[nodiscard]] clock::duration elapsed() const {
    std::lock_guard lock(mutex_);
    return done_.load(std::memory_order_relaxed) ? finished_ - started_ : clock::duration{};
  }
  [[nodiscard]] clock::time_point started_at() const noexcept { return started_; }
  /// When done() became true (valid once done()).
  [[nodiscard]] clock::time_point finished_at() const {
    std::lock_guard lock(mutex_);
    return finished_;
  }

  /// Waits for the thread, then hands the code tensors over (merged or not): the
  /// slots to pass to the next merge. The merge is empty afterwards.
  std::vector<codes_type> release() {
    cancel();
    if (worker_.joinable()) worker_.join();
    views_.clear();
    ready_.store(0, std::memory_order_release);
    return std::move(codes_);
  }

 private:
  static std::vector<layer_view> views_of(
      std::span<const bitplane_tensor<Plan, G, host_space>> tensors) {
    std::vector<layer_view> v;
    v.reserve(tensors.size());
    for (const auto& t : tensors) v.push_back(t.view());
    return v;
  }

  void run(int threads) noexcept {
    std::exception_ptr error;
    try {
      for (std::size_t i = 0; i < views_.size(); ++i) {
        if (stop_.load(std::memory_order_relaxed)) break;
        codes_[i].assign(views_[i], threads);
        ready_.store(i + 1, std::memory_order_release);
      }
    } catch (...) {
      error = std::current_exception();
    }
    {
      std::lock_guard lock(mutex_);
      error_ = error;
      finished_ = clock::now();
      done_.store(true, std::memory_order_release);
    }
    finished_cv_.notify_all();
  }

  std::vector<layer_view> views_;
  std::vector<codes_type> codes_;
  std::atomic<std::size_t> ready_{0};
  std::atomic<bool> done_{false};
  std::atomic<bool> stop_{false};
  mutable std::mutex mutex_;
  mutable std::condition_variable finished_cv_;
  std::exception_ptr error_;
  clock::time_point started_{}, finished_{};
  std::thread worker_;  // last: starts after every member above exists
};

}  // namespace lynx
