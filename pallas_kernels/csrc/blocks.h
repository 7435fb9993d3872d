// Work split over XLA's intra-op thread pool and the rows of x a product skips, shared by
// jaxllm's CPU kernels (int8_rows.cc, decode_attention.cc, lowbit_rows.cc, float_rows.cc).
#pragma once

#include <algorithm>
#include <type_traits>
#include <vector>
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

// fn(std::integral_constant<int, r>{}) for 1 <= r <= R: a count of rows known at compile time,
// so that the rows' sums stay in registers.
template <int R, typename Fn>
void with_rows(int64_t r, const Fn& fn) {
  if constexpr (R > 1) {
    if (r < R) return with_rows<R - 1>(r, fn);
  }
  fn(std::integral_constant<int, R>{});
}

// Calls fn(std::integral_constant<int, R>{}, m0, n0, n1) for every pass over up to kMax rows
// of x (m0 .. m0 + R) and every piece of ``per`` output rows n0 .. n1, the pieces shared over
// the thread pool.
template <int kMax, typename Fn>
void row_passes(xla::ffi::ThreadPool& pool, int64_t M, int64_t N, int64_t per, const Fn& fn) {
  const int64_t work = (N + per - 1) / per;
  for (int64_t m0 = 0; m0 < M; m0 += kMax) {
    const int64_t R = std::min<int64_t>(kMax, M - m0);
    for_each_block(pool, work, [&fn, m0, R, per, N](int64_t i) {
      const int64_t n0 = i * per, n1 = std::min(N, n0 + per);
      with_rows<kMax>(R, [&](auto r) { fn(r, m0, n0, n1); });
    });
  }
}

// product(xp, yp, rows) over the rows of x [M, K] that are not all zero, gathered first where
// some are, their products then put back into y [M, N] and the other rows' set to zero. A
// product of finite weights with a zero row is zero, and a batch's rows that a decode step
// leaves alone come as zeros (jaxllm.model), so they cost nothing.
template <typename Fn>
void live_rows(const float* x, float* y, int64_t M, int64_t K, int64_t N, const Fn& product) {
  std::vector<int64_t> live;
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    if (std::any_of(xm, xm + K, [](float v) { return v != 0.0f; })) live.push_back(m);
  }
  const int64_t rows = static_cast<int64_t>(live.size());
  if (rows == M) return product(x, y, M);
  std::fill(y, y + M * N, 0.0f);
  if (rows == 0) return;
  std::vector<float> xg(rows * K), yg(rows * N);
  for (int64_t i = 0; i < rows; ++i)
    std::copy(x + live[i] * K, x + (live[i] + 1) * K, xg.data() + i * K);
  product(static_cast<const float*>(xg.data()), yg.data(), rows);
  for (int64_t i = 0; i < rows; ++i)
    std::copy(yg.data() + i * N, yg.data() + (i + 1) * N, y + live[i] * N);
}

}  // namespace jaxllm
