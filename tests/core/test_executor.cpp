// lynx::task_executor: an engine's pool runs the host kernels' shares instead of
// threads started per call. The attention's output bits are those of the same
// call on its own threads and on one thread; every share runs exactly once; an
// exception thrown in a share reaches the caller.
#include <doctest/doctest.h>

#include <atomic>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "lynx/attention/decode_attention.hpp"
#include "lynx/backend/host/parallel.hpp"
#include "lynx/core/executor.hpp"
#include "lynx/planes/codec.hpp"

namespace {

// A fixed pool: `workers` threads started once; run() hands out indices [0, n)
// to them and to the calling thread, and returns when all have run.
class fixed_pool final : public lynx::task_executor {
 public:
  explicit fixed_pool(int workers) {
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this] { work(); });
  }
  ~fixed_pool() override {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_) t.join();
  }
  fixed_pool(const fixed_pool&) = delete;
  fixed_pool& operator=(const fixed_pool&) = delete;

  void run(int n, void (*task)(void*, int), void* context) override {
    ++runs;
    {
      std::lock_guard lock(mutex_);
      task_ = task;
      context_ = context;
      next_ = 0;
      n_ = n;
      done_ = 0;
      ++generation_;
    }
    wake_.notify_all();
    drain();
    std::unique_lock lock(mutex_);
    finished_.wait(lock, [&] { return done_ == n_; });
  }

  std::atomic<int> runs{0};
  std::atomic<int> on_workers{0};  // tasks run by the pool's own threads

 private:
  void drain(bool worker = false) {
    for (;;) {
      int i;
      void (*task)(void*, int);
      void* context;
      {
        std::lock_guard lock(mutex_);
        if (next_ >= n_) return;
        i = next_++;
        task = task_;
        context = context_;
      }
      task(context, i);
      if (worker) ++on_workers;
      std::lock_guard lock(mutex_);
      if (++done_ == n_) finished_.notify_all();
    }
  }
  void work() {
    long seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      drain(true);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex mutex_;
  std::condition_variable wake_, finished_;
  void (*task_)(void*, int) = nullptr;
  void* context_ = nullptr;
  int next_ = 0, n_ = 0, done_ = 0;
  long generation_ = 0;
  bool stop_ = false;
};

}  // namespace

TEST_CASE("attention on an engine's pool: the bits of its own threads and of one thread") {
  using plan = lynx::plan_8_4_4;
  const lynx::kv_shape shape{2500, 4, 64};  // three prompt splits
  std::vector<float> k(static_cast<std::size_t>(shape.tokens * shape.kv_heads * shape.head_dim));
  std::vector<float> v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = static_cast<float>(static_cast<int>(i * 2654435761u % 2001u) - 1000) / 400.0f;
    v[i] = static_cast<float>(static_cast<int>(i * 40503u % 1777u) - 888) / 300.0f;
  }
  fixed_pool pool(3);
  const auto layer =
      lynx::encode<plan, 32, float>(lynx::token_major<const float>(k.data(), shape),
                                    lynx::token_major<const float>(v.data(), shape), 0);
  lynx::bitplane_tensor<plan, 32, lynx::host_space> tensor(shape, 0);
  for (int s = 0; s < plan::streams; ++s) tensor.accept(layer.segment(s));

  const int q_heads = 8, n_queries = 3;
  std::vector<float> q(static_cast<std::size_t>(n_queries * q_heads * shape.head_dim));
  for (std::size_t i = 0; i < q.size(); ++i) q[i] = static_cast<float>(i % 31) / 31.0f - 0.5f;
  const lynx::attention_queries queries{q.data(), n_queries, q_heads, shape.head_dim};
  const lynx::kv_view<const float, lynx::host_space> no_tail{};
  const lynx::tail_visibility visible{0, 0};
  lynx::decode_attention<> attention{};
  auto run = [&](const lynx::attention_options& o) {
    std::vector<float> out(q.size()), lse(static_cast<std::size_t>(n_queries * q_heads));
    lynx::attention_workspace ws(attention.problem(tensor.view(), no_tail, queries, visible),
                                 o.threads);
    attention(tensor.view(), no_tail, no_tail, queries, visible,
              lynx::attention_output{out.data(), lse.data()}, ws, o);
    out.insert(out.end(), lse.begin(), lse.end());
    return out;
  };
  const std::vector<float> alone = run({.threads = 1});
  const std::vector<float> spawned = run({.threads = 4});
  const std::vector<float> pooled = run({.threads = 4, .executor = &pool});
  CHECK(pool.runs == 1);
  CHECK(std::memcmp(alone.data(), spawned.data(), alone.size() * 4) == 0);
  CHECK(std::memcmp(alone.data(), pooled.data(), alone.size() * 4) == 0);
  // one thread asked for: the executor is not called
  (void)run({.threads = 1, .executor = &pool});
  CHECK(pool.runs == 1);
}

TEST_CASE("encode and reconstruct on an engine's pool: the bytes of their own threads") {
  using plan = lynx::plan_16_4_12;
  const lynx::kv_shape shape{1000, 4, 128};
  std::vector<lynx::bf16> k(
      static_cast<std::size_t>(shape.tokens * shape.kv_heads * shape.head_dim));
  std::vector<lynx::bf16> v(k.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] =
        lynx::bf16(static_cast<float>(static_cast<int>(i * 2654435761u % 2001u) - 1000) / 400.0f);
    v[i] = lynx::bf16(static_cast<float>(static_cast<int>(i * 40503u % 1777u) - 888) / 300.0f);
  }
  fixed_pool pool(2);
  const auto keys = lynx::token_major<const lynx::bf16>(k.data(), shape);
  const auto values = lynx::token_major<const lynx::bf16>(v.data(), shape);
  const auto alone = lynx::encode<plan, 32, lynx::bf16>(keys, values, 3, {.threads = 1});
  const auto pooled =
      lynx::encode<plan, 32, lynx::bf16>(keys, values, 3, {.threads = 4, .executor = &pool});
  CHECK(pool.runs >= 1);
  lynx::bitplane_tensor<plan, 32, lynx::host_space> tensor(shape, 3);
  for (int s = 0; s < plan::streams; ++s) {
    const auto a = alone.segment(s), b = pooled.segment(s);
    REQUIRE(a.size() == b.size());
    CHECK(std::memcmp(a.data(), b.data(), a.size()) == 0);
    tensor.accept(a);
  }
  std::vector<lynx::bf16> k1(k.size()), v1(k.size()), k2(k.size()), v2(k.size());
  const int before = pool.runs;
  lynx::reconstruct(tensor.view(), lynx::token_major<lynx::bf16>(k1.data(), shape),
                    lynx::token_major<lynx::bf16>(v1.data(), shape), {.threads = 1});
  lynx::reconstruct(tensor.view(), lynx::token_major<lynx::bf16>(k2.data(), shape),
                    lynx::token_major<lynx::bf16>(v2.data(), shape),
                    {.threads = 3, .executor = &pool});
  CHECK(pool.runs == before + 1);
  CHECK(std::memcmp(k1.data(), k2.data(), k1.size() * 2) == 0);
  CHECK(std::memcmp(v1.data(), v2.data(), v1.size() * 2) == 0);
}

TEST_CASE("parallel_for on an executor: every chunk once, the first exception rethrown") {
  fixed_pool pool(2);
  std::vector<std::atomic<int>> hits(1000);
  lynx::detail::parallel_for(
      5, 1000,
      [&](std::int64_t b, std::int64_t e) {
        for (std::int64_t i = b; i < e; ++i) ++hits[static_cast<std::size_t>(i)];
      },
      &pool);
  for (const auto& h : hits) CHECK(h == 1);
  CHECK(pool.runs == 1);
  CHECK_THROWS_WITH_AS(lynx::detail::parallel_for(
                           4, 100,
                           [&](std::int64_t b, std::int64_t) {
                             if (b >= 50) throw std::runtime_error("share failed");
                           },
                           &pool),
                       "share failed", std::runtime_error);
  CHECK(pool.runs == 2);
}
