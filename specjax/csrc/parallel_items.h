// run(0) .. run(items - 1) on the calling thread and up to `threads` - 1 helpers on
// XLA's intra-op pool, for specjax's CPU FFI kernels (rows_matmul.cc,
// paged_attention.cc).
//
// Items are claimed from one shared counter. The caller waits only for items a running
// thread has claimed: a helper that starts late (the pool busy, e.g. with another kernel
// of the same program waiting the same way) finds nothing left, so no wait can
// deadlock. The claims live in a shared_ptr, so a late helper may outlive the call; it
// then touches only the counter, never `run` or the buffers it refers to.
#ifndef SPECJAX_CSRC_PARALLEL_ITEMS_H_
#define SPECJAX_CSRC_PARALLEL_ITEMS_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace specjax {

struct Claims {
  std::function<void(int64_t)> run;
  int64_t items = 0;
  std::atomic<int64_t> next{0}, finished{0};

  void drain() {
    for (int64_t k; (k = next.fetch_add(1, std::memory_order_relaxed)) < items;) {
      run(k);
      finished.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void parallel_items(xla::ffi::ThreadPool& pool, int64_t items, int64_t threads,
                           std::function<void(int64_t)> run) {
  auto claims = std::make_shared<Claims>();
  claims->run = std::move(run);
  claims->items = items;
  for (int64_t k = 1; k < std::min(items, threads); ++k)
    pool.Schedule([claims] { claims->drain(); });
  claims->drain();
  while (claims->finished.load(std::memory_order_acquire) < items) {
  }
}

// run(c0, c1) over [0, n) in contiguous ranges, one per thread (the matmul kernels'
// outputs): up to the pool's threads, each range at least `min_per` long (a small n runs
// on one) and starting at a multiple of `multiple` (whole register blocks).
inline void parallel_ranges(xla::ffi::ThreadPool& pool, int64_t n, int64_t min_per,
                            int64_t multiple, std::function<void(int64_t, int64_t)> run) {
  const int64_t threads =
      std::max<int64_t>(1, std::min<int64_t>(pool.num_threads(), n / min_per));
  const int64_t per = ((n + threads - 1) / threads + multiple - 1) / multiple * multiple;
  parallel_items(pool, (n + per - 1) / per, threads, [=](int64_t k) {
    run(k * per, std::min(n, (k + 1) * per));
  });
}

}  // namespace specjax

#endif  // SPECJAX_CSRC_PARALLEL_ITEMS_H_
