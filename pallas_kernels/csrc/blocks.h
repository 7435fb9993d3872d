// Work split over XLA's intra-op thread pool, shared by jaxllm's CPU kernels (int8_rows.cc,
// decode_attention.cc).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxllm {

// Calls fn(b) once for every block b in [0, blocks), on the calling thread and on up to
// (threads - 1) helpers from ``pool``, which claim blocks from one counter. The caller works too
// and waits only for blocks already claimed, so a busy pool (or none) costs parallelism, never a
// deadlock. The state is shared-owned: a helper that starts after the call returned finds no
// block left and never calls ``fn``, whose captures may by then be gone.
template <typename Fn>
void for_each_block(xla::ffi::ThreadPool& pool, int64_t blocks, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    int64_t blocks;
    Fn fn;
    State(int64_t n, Fn f) : blocks(n), fn(std::move(f)) {}
    void run() {
      for (int64_t b; (b = next.fetch_add(1, std::memory_order_relaxed)) < blocks;) {
        fn(b);
        done.fetch_add(1, std::memory_order_release);
      }
    }
  };
  auto state = std::make_shared<State>(blocks, std::move(fn));
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = std::min<int64_t>(threads - 1, blocks - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([state] { state->run(); });
  state->run();
  while (state->done.load(std::memory_order_acquire) < blocks) std::this_thread::yield();
}

}  // namespace jaxllm
