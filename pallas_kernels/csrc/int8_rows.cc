// int8 x int8 -> int32 products of a few rows, for decoding W8A8 on a CPU: an XLA FFI custom call
// that pallas_kernels/cpu.py builds with the machine's own compiler (-march=native) and registers.
//
//   jaxllm_int8_rows(x s8[M, K], w s8[N, K]) -> y s32[M, N],  y[m, n] = sum_k x[m, k] * w[n, k]
//   jaxllm_int8_rows_token(x f32[M, K], w s8[N, K]) -> (y s32[M, N], sx f32[M]): each row of x
//       quantized to int8 with its own absmax scale sx[m] first (SmoothQuant's per-token O1)
//
// Exact: every sum is formed in int32 lanes, whatever the order.
//
// Why: a W8A8 decode step multiplies 1-8 rows by every int8 weight. XLA:CPU hands that product to
// YNNPACK, which does about 50 G multiply-adds a second at 8 rows on this 2-core machine (14% of
// the weights' read rate; docs/BENCHMARKS.md, roofline). Here each weight row is read once, in one
// sequential stream per thread, for all the rows; a `vpdpbusd` (AVX-512 VNNI) does 64 multiply-adds,
// and the output rows are split over XLA's own intra-op thread pool. Only for machines with VNNI:
// portable loops measured slower than XLA's dot, so other machines keep XLA's.
//
// One weight row at a time: two or more rows read side by side (sharing each input load) measured
// 1.1-2.7x slower on the 2-core EPYC this was tuned on.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JAXLLM_VNNI 1
#endif

#include "blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kMaxRows = 8;  // rows per pass over the weights (more rows take more passes)

#ifdef JAXLLM_VNNI
// vpdpbusd multiplies unsigned by signed bytes, so the rows come in as x + 128 (``xu``, one byte
// each) and 128 * sum_k w[n, k] is taken off at the end: that sum is one more vpdpbusd per weight
// vector, against a vector of ones. |partial sums| < 2^31 for K < 65,536 (checked by the caller).
template <int R>
void rows(const uint8_t* xu, const int8_t* x, const int8_t* w, int32_t* y, int64_t K, int64_t N,
          int64_t n0, int64_t n1) {
  (void)x;
  constexpr int64_t L = 64;
  const int64_t kv = K - K % L;
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t n = n0; n < n1; ++n) {
    const int8_t* wr = w + n * K;
    __m512i acc[R], wsum = _mm512_setzero_si512();
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
    for (int64_t k = 0; k < kv; k += L) {
      __m512i wv = _mm512_loadu_si512(wr + k);
      wsum = _mm512_dpbusd_epi32(wsum, ones, wv);
      for (int r = 0; r < R; ++r)
        acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(xu + r * K + k), wv);
    }
    const int32_t offset = 128 * _mm512_reduce_add_epi32(wsum);
    for (int r = 0; r < R; ++r) {
      int32_t s = _mm512_reduce_add_epi32(acc[r]) - offset;
      for (int64_t k = kv; k < K; ++k) s += static_cast<int32_t>(x[r * K + k]) * wr[k];
      y[r * N + n] = s;
    }
  }
}

// Output rows [n0, n1) for every input row, in passes of up to kMaxRows rows.
void rows_any(const uint8_t* xu, const int8_t* x, const int8_t* w, int32_t* y, int64_t M,
              int64_t K, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; m += kMaxRows) {
    const int64_t r = std::min<int64_t>(kMaxRows, M - m);
    const uint8_t* xum = xu + m * K;
    const int8_t* xm = x + m * K;
    int32_t* ym = y + m * N;
    switch (r) {
      case 1: rows<1>(xum, xm, w, ym, K, N, n0, n1); break;
      case 2: rows<2>(xum, xm, w, ym, K, N, n0, n1); break;
      case 3: rows<3>(xum, xm, w, ym, K, N, n0, n1); break;
      case 4: rows<4>(xum, xm, w, ym, K, N, n0, n1); break;
      case 5: rows<5>(xum, xm, w, ym, K, N, n0, n1); break;
      case 6: rows<6>(xum, xm, w, ym, K, N, n0, n1); break;
      case 7: rows<7>(xum, xm, w, ym, K, N, n0, n1); break;
      default: rows<8>(xum, xm, w, ym, K, N, n0, n1); break;
    }
  }
}

// y [M, N] = x [M, K] · w [N, K]ᵀ over the pool's threads, a block of output rows each.
void product(ffi::ThreadPool& pool, const int8_t* xp, const int8_t* wp, int32_t* yp, int64_t M,
             int64_t K, int64_t N) {
  std::vector<uint8_t> xu(M * K);
  for (int64_t i = 0; i < M * K; ++i) xu[i] = static_cast<uint8_t>(xp[i] + 128);
  const uint8_t* xup = xu.data();
  // Blocks of at least 64 KiB of weights, about four per thread to even out the load.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t min_rows = std::max<int64_t>(1, (int64_t{64} << 10) / std::max<int64_t>(1, K));
  const int64_t size = std::max(min_rows, (N + 4 * threads - 1) / (4 * threads));
  jaxllm::for_each_block(pool, (N + size - 1) / size, [=](int64_t b) {
    rows_any(xup, xp, wp, yp, M, K, N, b * size, std::min(N, (b + 1) * size));
  });
}

// Row m of x as int8 with its own scale, as jaxllm.quant.absmax_scale and quantize compute it
// under jit, to the bit for finite rows: Δ = max|x| · (1/127) (XLA turns the division by the
// constant 127 into that product; 1 when max|x| is 0), q = x / Δ rounded half to even
// (nearbyintf in the default rounding mode), clamped to ±127. A NaN is skipped by the max (as
// XLA:CPU's max reduction skipped it here) and quantizes to 0 (XLA's NaN-to-integer).
float quantize_row(const float* x, int8_t* q, int64_t K) {
  float top = 0.0f;
  for (int64_t k = 0; k < K; ++k) {
    const float a = std::fabs(x[k]);
    if (a > top) top = a;
  }
  const float scale = top > 0.0f ? top * (1.0f / 127.0f) : 1.0f;
  for (int64_t k = 0; k < K; ++k) {
    float v = std::nearbyintf(x[k] / scale);
    v = v < -127.0f ? -127.0f : (v > 127.0f ? 127.0f : v);
    q[k] = v == v ? static_cast<int8_t>(v) : 0;
  }
  return scale;
}
#endif  // JAXLLM_VNNI

// The handlers' arguments: x [M, K] and w [N, K] with K below 65,536 (where the int32 partial
// sums stay exact), in a build with VNNI; else the error, naming ``target``.
template <typename X>
ffi::Error check_rows(const std::string& target, const X& x, const ffi::Buffer<ffi::S8>& w) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument(target + " needs x [M, K] and w [N, K]");
  if (xd[1] >= 65536) return ffi::Error::InvalidArgument(target + ": K must be below 65,536");
#ifndef JAXLLM_VNNI
  return ffi::Error::InvalidArgument(target + " was built without AVX-512 VNNI; use XLA's "
                                     "int8 dot");
#else
  return ffi::Error::Success();
#endif
}

ffi::Error Int8Rows(ffi::ThreadPool pool, ffi::Buffer<ffi::S8> x, ffi::Buffer<ffi::S8> w,
                    ffi::ResultBuffer<ffi::S32> y) {
  ffi::Error bad = check_rows("jaxllm_int8_rows", x, w);
  if (bad.failure()) return bad;
#ifdef JAXLLM_VNNI
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  product(pool, x.typed_data(), w.typed_data(), y->typed_data(), M, K, N);
#else
  (void)pool, (void)y;
#endif
  return ffi::Error::Success();
}

// W8A8 with per-token activation scales (SmoothQuant's O1) in one call: each row of float32 x
// quantized with its own absmax scale (returned in sx), then multiplied as Int8Rows does. A
// decode step otherwise ran the quantization as four small XLA loops per product input (abs,
// max, scale, divide-round-convert): about 0.75 ms of thread time a token in a profile of
// Pythia-160M's W8A8 decode (4+252, batch 1), whose tokens took 5.4-5.6 ms.
ffi::Error Int8RowsToken(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> w,
                         ffi::ResultBuffer<ffi::S32> y, ffi::ResultBuffer<ffi::F32> sx) {
  ffi::Error bad = check_rows("jaxllm_int8_rows_token", x, w);
  if (bad.failure()) return bad;
#ifdef JAXLLM_VNNI
  const int64_t M = x.dimensions()[0], K = x.dimensions()[1], N = w.dimensions()[0];
  std::vector<int8_t> xq(M * K);
  for (int64_t m = 0; m < M; ++m)
    sx->typed_data()[m] = quantize_row(x.typed_data() + m * K, xq.data() + m * K, K);
  product(pool, xq.data(), w.typed_data(), y->typed_data(), M, K, N);
#else
  (void)pool, (void)y, (void)sx;
#endif
  return ffi::Error::Success();
}

}  // namespace

// 1 where this build has the kernel: the compiler targeted AVX-512 VNNI (-march=native on such a
// machine). Elsewhere the handler returns an error and pallas_kernels/cpu.py keeps XLA's dot.
extern "C" int jaxllm_int8_rows_vnni() {
#ifdef JAXLLM_VNNI
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmInt8Rows, Int8Rows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmInt8RowsToken, Int8RowsToken,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
