// Float and int8 weight-only products of a few rows, for decoding on a CPU: an XLA FFI custom
// call that pallas_kernels/cpu.py builds with the machine's own compiler (-march=native) and
// registers.
//
//   jaxllm_float_rows(x f32[M, K], w [N, K] f32 | bf16 | f16 | s8) -> y f32[M, N],
//       y[m, n] = sum_k x[m, k] * w[n, k], summed in float32
//
// (jaxllm.quant.decode_weights' [out, in] weights; W8's per-channel scale is applied by the
// caller.)
//
// Why: a decode step reads every weight once per step, for a row of x per sequence. XLA:CPU's
// forms for 2 to 63 rows (jaxllm.weight_only) and for one row of an input wider than 3,072
// read the weight at a third of the memory's rate or less; its one-row product of a narrower
// input reads as fast as this kernel, and keeps those (docs/CPU.md, "Float products"). Here each
// thread takes a block of weight rows and reads it as one sequential stream, a row at a time:
// four weight rows read side by side (sharing x's loads) ran 1.5-1.9x slower in a standalone
// loop, the hardware prefetcher following one stream better than four short ones. A bfloat16
// load of 2L weights is widened in-lane, its even columns by a shift and its odd ones by a
// mask, so x's blocks of 2L columns are laid out once per call as their even columns, then
// their odd ones.
//
// AVX-512 (F, BW) where the compiler targets it, else AVX2 with FMA and F16C; machines with
// neither keep XLA's form.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define JAXLLM_FLOAT512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define JAXLLM_FLOAT256 1
#endif
#if defined(JAXLLM_FLOAT512) || defined(JAXLLM_FLOAT256)
#define JAXLLM_FLOAT_ROWS 1
#endif

#include "blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Output rows per unit of the thread pool's work: at least this many weights, so that a small
// linear is not split into pieces that cost more to hand over than to compute.
constexpr int64_t kWeightsPerBlock = 1 << 16;

enum class Kind { kF32, kBf16, kF16, kS8 };

#ifdef JAXLLM_FLOAT_ROWS
// One weight as float32 (the columns past the last whole step).
template <Kind T>
inline float scalar(const void* w, int64_t k) {
  if constexpr (T == Kind::kF32) {
    return static_cast<const float*>(w)[k];
  } else if constexpr (T == Kind::kBf16) {
    const uint32_t bits = uint32_t{static_cast<const uint16_t*>(w)[k]} << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  } else if constexpr (T == Kind::kF16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(w)[k]);
  } else {
    return static_cast<float>(static_cast<const int8_t*>(w)[k]);
  }
}

// The vector instructions, one struct per instruction set: L float32 lanes; widen reads the 2L
// weights from column k of a row into a and b (bfloat16: a the even columns, b the odd ones;
// otherwise a the first L, b the next L); kMaxRows rows of x a pass (two sums each in registers).
#ifdef JAXLLM_FLOAT512
struct Isa {
  using V = __m512;
  static constexpr int64_t L = 16;
  static constexpr int kMaxRows = 4;  // past 4 rows XLA's row reduction is as fast
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float sum(V a, V b) { return _mm512_reduce_add_ps(_mm512_add_ps(a, b)); }
  template <Kind T>
  static void widen(const void* w, int64_t k, V& a, V& b) {
    if constexpr (T == Kind::kF32) {
      a = load(static_cast<const float*>(w) + k), b = load(static_cast<const float*>(w) + k + L);
    } else if constexpr (T == Kind::kBf16) {
      const __m512i h = _mm512_loadu_si512(static_cast<const uint16_t*>(w) + k);
      a = _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
      b = _mm512_castsi512_ps(_mm512_and_si512(h, _mm512_set1_epi32(int32_t(0xffff0000u))));
    } else if constexpr (T == Kind::kF16) {
      const auto* p = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + k);
      a = _mm512_cvtph_ps(_mm256_loadu_si256(p)), b = _mm512_cvtph_ps(_mm256_loadu_si256(p + 1));
    } else {
      const auto* p = reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(w) + k);
      a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p)));
      b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p + 1)));
    }
  }
};
#else
struct Isa {
  using V = __m256;
  static constexpr int64_t L = 8;
  static constexpr int kMaxRows = 4;  // 16 ymm registers: 8 sums, the rest for loads
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float sum(V a, V b) {
    const V v = _mm256_add_ps(a, b);
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  template <Kind T>
  static void widen(const void* w, int64_t k, V& a, V& b) {
    if constexpr (T == Kind::kF32) {
      a = load(static_cast<const float*>(w) + k), b = load(static_cast<const float*>(w) + k + L);
    } else if constexpr (T == Kind::kBf16) {
      const __m256i h = _mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w) + k));
      a = _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
      b = _mm256_castsi256_ps(_mm256_and_si256(h, _mm256_set1_epi32(int32_t(0xffff0000u))));
    } else if constexpr (T == Kind::kF16) {
      const auto* p = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w) + k);
      a = _mm256_cvtph_ps(_mm_loadu_si128(p)), b = _mm256_cvtph_ps(_mm_loadu_si128(p + 1));
    } else {
      const auto* p = static_cast<const int8_t*>(w) + k;
      a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(p))));
      b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(p + L))));
    }
  }
};
#endif

constexpr int64_t kStep = 2 * Isa::L;

template <Kind T>
constexpr int64_t kBytes = T == Kind::kF32 ? 4 : (T == Kind::kS8 ? 1 : 2);

// y[m, n] for rows m < R of x (xt: x as widen pairs its columns) and weight rows n0 .. n1, one
// weight row at a time (two at a time, sharing x's loads, measured slower at 4 rows as well).
template <Kind T, int R>
void rows(const float* xt, const void* w, float* y, int64_t K, int64_t N, int64_t n0,
          int64_t n1) {
  const int64_t kv = K - K % kStep;
  for (int64_t n = n0; n < n1; ++n) {
    const void* wr = static_cast<const char*>(w) + n * K * kBytes<T>;
    Isa::V a[R], b[R];
    for (int r = 0; r < R; ++r) a[r] = Isa::zero(), b[r] = Isa::zero();
    for (int64_t k = 0; k < kv; k += kStep) {
      Isa::V wa, wb;
      Isa::widen<T>(wr, k, wa, wb);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        a[r] = Isa::fmadd(Isa::load(xt + r * K + k), wa, a[r]);
        b[r] = Isa::fmadd(Isa::load(xt + r * K + k + Isa::L), wb, b[r]);
      }
    }
    for (int r = 0; r < R; ++r) {
      float s = Isa::sum(a[r], b[r]);
      for (int64_t k = kv; k < K; ++k) s += xt[r * K + k] * scalar<T>(wr, k);
      y[r * N + n] = s;
    }
  }
}

// x [M, K] with each whole step's 2L columns as widen pairs them with a bfloat16 load: the
// even columns, then the odd ones (the rest of a row as it is).
std::vector<float> paired(const float* x, int64_t M, int64_t K) {
  std::vector<float> xt(x, x + M * K);
  const int64_t kv = K - K % kStep;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < kv; k += kStep)
      for (int64_t i = 0; i < Isa::L; ++i) {
        xt[m * K + k + i] = x[m * K + k + 2 * i];
        xt[m * K + k + Isa::L + i] = x[m * K + k + 2 * i + 1];
      }
  return xt;
}

template <Kind T>
void product(ffi::ThreadPool& pool, const float* x, const void* w, float* y, int64_t M,
             int64_t K, int64_t N) {
  std::vector<float> laid;
  if constexpr (T == Kind::kBf16) laid = paired(x, M, K), x = laid.data();
  const int64_t per = std::max<int64_t>(8, kWeightsPerBlock / std::max<int64_t>(1, K));
  jaxllm::row_passes<Isa::kMaxRows>(pool, M, N, per,
                                    [&](auto r, int64_t m0, int64_t n0, int64_t n1) {
    rows<T, decltype(r)::value>(x + m0 * K, w, y + m0 * N, K, N, n0, n1);
  });
}
#endif  // JAXLLM_FLOAT_ROWS

ffi::Error FloatRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer w,
                     ffi::ResultBuffer<ffi::F32> y) {
  const std::string name = "jaxllm_float_rows";
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || xd[1] != wd[1])
    return ffi::Error::InvalidArgument(name + " needs x [M, K] and w [N, K] with the same K");
  const ffi::DataType t = w.element_type();
  if (t != ffi::F32 && t != ffi::BF16 && t != ffi::F16 && t != ffi::S8)
    return ffi::Error::InvalidArgument(name + ": w must be float32, bfloat16, float16 or int8");
#ifndef JAXLLM_FLOAT_ROWS
  (void)pool, (void)y;
  return ffi::Error::InvalidArgument(name + " was built without AVX-512 or AVX2 with FMA and "
                                     "F16C; use XLA's product");
#else
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  const void* wp = w.untyped_data();
  jaxllm::live_rows(x.typed_data(), y->typed_data(), M, K, N,
                    [&](const float* xp, float* yp, int64_t rows) {
    if (t == ffi::F32) product<Kind::kF32>(pool, xp, wp, yp, rows, K, N);
    else if (t == ffi::BF16) product<Kind::kBf16>(pool, xp, wp, yp, rows, K, N);
    else if (t == ffi::F16) product<Kind::kF16>(pool, xp, wp, yp, rows, K, N);
    else product<Kind::kS8>(pool, xp, wp, yp, rows, K, N);
  });
  return ffi::Error::Success();
#endif
}

}  // namespace

// Which instructions this build's kernel uses (-march=native): 512 (AVX-512 F and BW), 256
// (AVX2 with FMA and F16C), 0 (none: no kernel).
extern "C" int jaxllm_float_rows_isa() {
#if defined(JAXLLM_FLOAT512)
  return 512;
#elif defined(JAXLLM_FLOAT256)
  return 256;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmFloatRows, FloatRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
