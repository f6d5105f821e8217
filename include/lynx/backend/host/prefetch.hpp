// Software prefetches spread over a kernel's work.
//
// The CPUs these kernels were measured on drop most of a burst of prefetches
// issued back to back: asking for a split's 1,536 lines at once brought them no
// sooner than not asking, while the same lines asked one every few dozen
// instructions all arrived in time. So the host kernels queue what they will
// read next in a prefetch_walk and step it from their inner loops.
// Prefetches never change a result.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#if defined(__unix__)
#include <unistd.h>
#endif

namespace lynx::detail {

/// Whether this CPU's L1 data cache holds 32 KiB or less (false where it cannot
/// be read): prefetch_into_l2's default, which keeps the answer.
inline bool small_l1_data_cache() {
#if defined(__unix__) && defined(_SC_LEVEL1_DCACHE_SIZE)
  const long bytes = sysconf(_SC_LEVEL1_DCACHE_SIZE);
  return bytes > 0 && bytes <= 32 * 1024;
#else
  return false;
#endif
}

/// Whether the prefetches that run a split or an item ahead of a kernel (the
/// attention walks, encode's next rows) ask into L2 rather than L1: by default on
/// CPUs whose L1 data cache holds 32 KiB or less. A split's walk covers up to
/// 256 KiB (keys or values of 1,024 tokens), which a small L1 cannot hold
/// beside the kernel's own rows. Measured at 32K tokens, one thread: with a
/// 32 KiB L1 (AMD Zen 4) L2 prefetches took all of 8 = 4 + 4 from 12.6 to
/// 10.3 ms and 16 = 4 + 12 from 19.6 to 14.9 ms; on the machine the walks were
/// first tuned on (two full-width AVX-512 FMA pipes, so a core with a 48 KiB
/// L1) they made all of 8 = 4 + 4 slower, 5.4 -> 7.3 ms. On a third machine, an
/// Intel Xeon with AVX-512, AMX and a 48 KiB L1 and 2 MiB L2 per core, L2 was the
/// better level again (min of 6 alternating rounds: all of 8 = 4 + 4 9.72 -> 9.06
/// ms, all of 16 = 4 + 12 17.5 -> 16.5 ms, the anchor unchanged), so the L1 size
/// alone does not decide it.
/// LYNX_PREFETCH=l1 or LYNX_PREFETCH=l2 in the environment overrides the choice
/// (read once per process); any other value is reported on stderr and ignored.
/// The level never changes a result, only when the bytes arrive.
inline bool prefetch_into_l2() {
  static const bool into_l2 = [] {
    if (const char* e = std::getenv("LYNX_PREFETCH"); e != nullptr && *e != '\0') {
      if (std::strcmp(e, "l1") == 0 || std::strcmp(e, "L1") == 0) return false;
      if (std::strcmp(e, "l2") == 0 || std::strcmp(e, "L2") == 0) return true;
      std::fprintf(stderr, "lynx: LYNX_PREFETCH=%s ignored (expected l1 or l2)\n", e);
    }
    return small_l1_data_cache();
  }();
  return into_l2;
}

/// Asks for every 64-byte line of [p, p + bytes) at once (Hint: 3 into L1, 2
/// into L2): for the few lines of one row or block, not for a whole split.
template <int Hint>
__attribute__((always_inline)) inline void prefetch_lines(const void* p, std::int64_t bytes) {
  for (std::int64_t o = 0; o < bytes; o += 64)
    __builtin_prefetch(static_cast<const char*>(p) + o, 0, Hint);
}

/// Byte ranges asked into the cache a few 64-byte lines per step, in order.
/// Adjacent ranges merge, so the plane rows of one stream count once.
struct prefetch_walk {
  static constexpr int max_ranges = 12;
  const char* at = nullptr;    // the next line of the current range
  const char* stop = nullptr;  // the end of the current range
  const char* queued_at[max_ranges] = {};
  const char* queued_end[max_ranges] = {};
  int queued = 0, taken = 0;

  void add(const void* base, std::int64_t bytes) {
    if (bytes <= 0) return;
    const char* p = static_cast<const char*>(base);
    if (queued > taken && queued_end[queued - 1] == p) {  // continues the last range
      queued_end[queued - 1] = p + bytes;
    } else {
      if (queued == max_ranges) return;
      queued_at[queued] =
          reinterpret_cast<const char*>(reinterpret_cast<std::uintptr_t>(p) & ~std::uintptr_t{63});
      queued_end[queued] = p + bytes;
      ++queued;
    }
    if (at >= stop) next_range();
  }
  /// Lines still to ask for.
  [[nodiscard]] std::int64_t lines_left() const {
    std::int64_t n = at < stop ? (stop - at + 63) / 64 : 0;
    for (int r = taken; r < queued; ++r) n += (queued_end[r] - queued_at[r] + 63) / 64;
    return n;
  }
  void next_range() {
    if (taken == queued) return;
    at = queued_at[taken];
    stop = queued_end[taken];
    ++taken;
  }
  /// Asks for the next `Lines` lines (Hint: 3 into L1, 2 into L2; the
  /// kernels take it from with_walk_hint, outside their loops).
  template <int Lines = 1, int Hint = 3>
  __attribute__((always_inline)) void step() {
    for (int k = 0; k < Lines; ++k) {
      if (at < stop) [[likely]] {
        __builtin_prefetch(at, 0, Hint);
        at += 64;
      } else if (taken < queued) {
        next_range();
        --k;
      } else {
        return;
      }
    }
  }
  /// Asks for the next n lines (n small: the few lines of one step).
  /// Always into L1: reconstruct at 32K tokens measured 17% slower with L2
  /// prefetches on a 32 KiB L1.
  void step_n(int n) {
    for (int k = 0; k < n; ++k) step();
  }
};

/// Calls f.template operator()<Hint>() with the walks' prefetch hint as a
/// constant (2: into L2, 3: into L1; see prefetch_into_l2), so kernels take it
/// as a template parameter.
template <class F>
__attribute__((always_inline)) inline void with_walk_hint(F&& f) {
  if (prefetch_into_l2())
    f.template operator()<2>();
  else
    f.template operator()<3>();
}

/// Lines per step for a walk to end within `steps` steps (0 for an empty walk).
inline int walk_step_lines(const prefetch_walk& walk, std::int64_t steps) {
  return static_cast<int>((walk.lines_left() + steps - 1) / steps);
}

}  // namespace lynx::detail
