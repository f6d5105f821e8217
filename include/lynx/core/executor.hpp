// An engine's own worker threads for the host kernels. Without one, a call with
// `threads` > 1 starts threads - 1 std::threads and joins them before it
// returns; an engine that keeps a pool passes it instead (attention_options,
// encode_options, reconstruct_options: `executor`), so no thread is created per
// call. Which worker runs which part never changes a result.
//
//   struct my_pool final : lynx::task_executor {
//     void run(int n, void (*task)(void*, int), void* context) override {
//       // call task(context, i) once for every i in [0, n), on any threads
//       // (the caller's included), and return when every call has returned
//     }
//   };
//   lynx::attention_options opt{.threads = 8, .executor = &pool};
#pragma once

namespace lynx {

/// Runs n independent tasks and returns when all have returned. Tasks do not
/// throw (Lynx catches inside them) and do not wait on one another, so a pool
/// with fewer threads than n runs them in turn.
class task_executor {
 public:
  virtual ~task_executor() = default;
  virtual void run(int n, void (*task)(void* context, int index), void* context) = 0;
};

}  // namespace lynx
