// 4-bit and 8-bit weight-only products of a few rows, for decoding on a CPU: an XLA FFI custom
// call that pallas_kernels/cpu.py builds with the machine's own compiler (-march=native) and
// registers.
//
//   jaxllm_lowbit_rows(x f32[M, K], codes [N, W], scale [N, Gn], offset [N, Gn]; bits, group G)
//       -> y f32[M, N],  y[m, n] = sum_k x[m, k] * (c[n, k] * scale[n, k / G] + offset[n, k / G])
//
// 4 bits: codes u32 [N, ceil(K / 8)], c[n, k] the 4-bit field (k % 8) of word k / 8 of row n
// (jaxllm/lowbit.py's layout: code j of a word in its bits 4j..4j+3; the padding codes multiply
// zeros). 8 bits: codes u8 [N, K], one a byte (a GGUF file's Q8_0 embedding and tied head, as
// codes q + 128). Scale and offset float32 or float16; G a multiple of 8 (a word never straddles
// two groups).
//
// Why: XLA:CPU has no fused dequantize-and-multiply. Its form (jaxllm.lowbit.xla_matmul) writes
// each weight out in float32 and reads it back for the dot, every step: 20-30x the float32
// product's time for a SmolLM2 linear at one row (docs/CPU.md). Here each weight row is read
// once as its packed codes (half a byte a weight), widened in registers and multiplied:
//
//   sum_k x[k] * (c[k] * s_g + o_g) = sum_g s_g * (sum_{k in g} x[k] * c[k]) + o_g * xs_g
//
// with xs_g the group sums of x, formed once per call. A 256-bit load holds 8 words = 64 codes;
// field j of the 8 words are the columns 8w + j (w = 0..7), so x is laid out once per call in
// that order (xt) and every field is one and, one convert and one FMA per row, every second one a
// shift (rows_at). Each lane's sum is scaled by its word's group scale at the end of the 64
// columns (lanes of one load may lie in two groups when G = 32: GGUF's Q4_0 / Q4_1).
//
// 8 bits: 8 codes widened a load (vpmovzxbd), one FMA a row, each group's sums scaled once.
//
// int8_x (G a multiple of 32): x rounded to 8 bits per 32 columns and multiplied as integers
// (rows_i8_at, rows8_i8 below); the caller asked for that rounding (jaxllm.lowbit.QLowBit.act).
//
// AVX2 with FMA and F16C (every x86-64 CPU since 2013-2015, AMD's included); machines without
// them keep XLA's form. AVX-512 has no path here (docs/CPU.md, "Low-bit products").
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define JAXLLM_AVX2 1
#endif

#include "blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// Output rows per unit of work of the thread pool: at least kWeightsPerBlock weights, so a small
// linear (SmolLM2's 192 x 576 key projection) is not split into pieces that cost more to hand
// to a thread than to compute.
constexpr int64_t kWeightsPerBlock = 1 << 16;
inline int64_t rows_per_block(int64_t K) { return std::max<int64_t>(8, kWeightsPerBlock / K); }

#ifdef JAXLLM_AVX2
// The codes kAhead bytes past those being read are asked for (a software prefetch) as each
// load is made: two groups of four SmolLM2 rows ahead for the 4-bit products, four rows for
// the 8-bit ones. The hardware's own prefetch left each group waiting on its first loads
// (docs/CPU.md, "Measuring a kernel change"). A prefetch never faults, so asking past the end
// of a weight is harmless (the address is formed as an integer).
constexpr int64_t kAhead = 2304;
inline void ask_ahead(const void* p) {
  _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) + kAhead),
               _MM_HINT_T0);
}

inline float load_scalar(const float* p, int64_t i) { return p[i]; }
inline float load_scalar(const uint16_t* p, int64_t i) { return _cvtsh_ss(p[i]); }

// p[0 .. n) as float32 into out (F16C eight at a time for float16).
inline void to_f32(const float* p, int64_t n, float* out) { std::memcpy(out, p, n * 4); }
inline void to_f32(const uint16_t* p, int64_t n, float* out) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(
                                  reinterpret_cast<const __m128i*>(p + i))));
  for (; i < n; ++i) out[i] = _cvtsh_ss(p[i]);
}

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// 8 words of codes from c, of which ``left`` remain in the row: past them zero codes.
inline __m256i load_words(const uint32_t* c, int64_t left) {
  if (left >= 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c));
  alignas(32) uint32_t tail[8] = {0};
  std::memcpy(tail, c, sizeof(uint32_t) * left);
  return _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// Passes over up to 8 rows of x, pieces of rows_per_block(K) output rows (blocks.h).
template <typename Fn>
void row_passes(ffi::ThreadPool& pool, int64_t M, int64_t N, int64_t K, const Fn& fn) {
  jaxllm::row_passes<8>(pool, M, N, rows_per_block(K), fn);
}

// Where the 8 lanes (words) of a load of 64 columns find their group's scale: one group a load
// (G a multiple of 64), two of 32 (GGUF's blocks), or a group each. A compile-time choice: read
// as a run-time branch inside the loop it cost the float 4-bit product 1.7x its time (the
// compiler kept the rows' sums in memory; docs/CPU.md, "Low-bit products").
enum class Lanes { kOne, kTwo, kEach };

// Scales i and i + 1 of a row as float32 in lanes 0 and 1 (i + 1 past the row's Gn: 0).
inline __m128 scale_pair(const float* s, int64_t i, int64_t Gn) {
  if (i + 1 >= Gn) return _mm_set_ss(s[i]);
  return _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i)));
}
inline __m128 scale_pair(const uint16_t* s, int64_t i, int64_t Gn) {
  uint32_t two = s[i];
  if (i + 1 < Gn) std::memcpy(&two, s + i, 4);
  return _mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(two)));
}

// Each lane's group scale for load b of a row (s: the row's Gn scales, float32 or float16),
// read where it is used rather than widened into a buffer per group of rows beforehand. Lanes
// past K multiply zero codes; their scale is 0.
template <Lanes L, typename S>
inline __m256 lane_scales(const S* s, int64_t b, int64_t G, int64_t K, int64_t Gn) {
  const int64_t col = 64 * b;
  if constexpr (L == Lanes::kOne) {
    return _mm256_set1_ps(load_scalar(s, col / G));
  } else if constexpr (L == Lanes::kTwo) {
    return _mm256_permutevar8x32_ps(_mm256_castps128_ps256(scale_pair(s, 2 * b, Gn)),
                                    _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0));
  } else {
    alignas(32) float lane[8];
    for (int w = 0; w < 8; ++w) {
      const int64_t k = col + 8 * w;
      lane[w] = k < K ? load_scalar(s, k / G) : 0.0f;
    }
    return _mm256_load_ps(lane);
  }
}

// Output rows n .. n + NB of y for R rows of x. NB weight rows go through at once so that one
// row of x (R = 1, decode) still has NB independent chains of FMAs: a single chain waits out the
// FMA's latency between a load's 8 fields (measured: docs/CPU.md, "Low-bit products").
// xt: [R, blocks, 8 fields, 8 words] (x in field order), xs: [R, Gn] group sums; scale and
// offset: [N, Gn] as given.
template <int R, int NB, Lanes L, typename S>
void rows_at(const float* xt, const float* xs, const uint32_t* codes, const S* scale,
             const S* offset, float* y, int64_t K, int64_t W, int64_t Gn, int64_t G, int64_t N,
             int64_t n) {
  const int64_t blocks = (W + 7) / 8;
  const __m256i low = _mm256_set1_epi32(0x0f), high = _mm256_set1_epi32(0xf0);
  __m256 total[R][NB];
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < NB; ++i) total[r][i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    __m256i v[NB];
    for (int i = 0; i < NB; ++i) {
      ask_ahead(codes + (n + i) * W + 8 * b);
      v[i] = load_words(codes + (n + i) * W + 8 * b, W - 8 * b);
    }
    __m256 acc[R][NB];
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < NB; ++i) acc[r][i] = _mm256_setzero_ps();
    const float* xb = xt + b * 64;
    // Field j of every word, masked where it lies in its byte after j / 2 shifts: an even field
    // is c, an odd one c * 16, whose x carries the 1/16 (product()), so a pair of fields costs
    // one shift instead of two and the products are the same to the bit.
    for (int j = 0; j < 8; ++j) {
      __m256 xj[R];
      for (int r = 0; r < R; ++r) xj[r] = _mm256_loadu_ps(xb + r * blocks * 64 + 8 * j);
      for (int i = 0; i < NB; ++i) {
        const __m256 cf = _mm256_cvtepi32_ps(_mm256_and_si256(v[i], j % 2 ? high : low));
        if (j % 2) v[i] = _mm256_srli_epi32(v[i], 8);
        for (int r = 0; r < R; ++r) acc[r][i] = _mm256_fmadd_ps(cf, xj[r], acc[r][i]);
      }
    }
    for (int i = 0; i < NB; ++i) {
      const __m256 sv = lane_scales<L>(scale + (n + i) * Gn, b, G, K, Gn);
      for (int r = 0; r < R; ++r) total[r][i] = _mm256_fmadd_ps(acc[r][i], sv, total[r][i]);
    }
  }
  for (int i = 0; i < NB; ++i) {
    const S* o = offset + (n + i) * Gn;
    for (int r = 0; r < R; ++r) {
      const float* xr = xs + r * Gn;
      __m256 t = total[r][i];
      int64_t g = 0;
      for (; g + 8 <= Gn; g += 8) t = _mm256_fmadd_ps(load8(o + g), _mm256_loadu_ps(xr + g), t);
      float sum = hsum(t);
      for (; g < Gn; ++g) sum += load_scalar(o, g) * xr[g];
      y[r * N + n + i] = sum;
    }
  }
}

// Rows n0..n1 of y for R rows of x (R <= 8, a compile-time count so the sums stay in registers),
// 4 weight rows at a time for one row of x, 2 for two, 1 from three (their chains suffice).
template <int R, Lanes L, typename S>
void rows_in(const float* xt, const float* xs, const uint32_t* codes, const S* scale,
             const S* offset, float* y, int64_t K, int64_t W, int64_t Gn, int64_t G, int64_t N,
             int64_t n0, int64_t n1) {
  constexpr int NB = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t n = n0;
  for (; n + NB <= n1; n += NB)
    rows_at<R, NB, L>(xt, xs, codes, scale, offset, y, K, W, Gn, G, N, n);
  for (; n < n1; ++n) rows_at<R, 1, L>(xt, xs, codes, scale, offset, y, K, W, Gn, G, N, n);
}

template <int R, typename S>
void rows(const float* xt, const float* xs, const uint32_t* codes, const S* scale,
          const S* offset, float* y, int64_t K, int64_t W, int64_t Gn, int64_t G, int64_t N,
          int64_t n0, int64_t n1) {
  if (G % 64 == 0)
    rows_in<R, Lanes::kOne>(xt, xs, codes, scale, offset, y, K, W, Gn, G, N, n0, n1);
  else if (G == 32)
    rows_in<R, Lanes::kTwo>(xt, xs, codes, scale, offset, y, K, W, Gn, G, N, n0, n1);
  else
    rows_in<R, Lanes::kEach>(xt, xs, codes, scale, offset, y, K, W, Gn, G, N, n0, n1);
}

// The 8-bit rows n0..n1 for R rows of x (natural column order; xs: [R, Gn] group sums).
template <int R, typename S>
void rows8(const float* x, const float* xs, const uint8_t* codes, const S* scale,
           const S* offset, float* y, int64_t K, int64_t Gn, int64_t G, int64_t N, int64_t n0,
           int64_t n1) {
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * K;
    for (int64_t l = 0; l < K; l += 64) ask_ahead(c + l);
    const S* s = scale + n * Gn;
    const S* o = offset + n * Gn;
    __m256 total[R];
    float tail[R];
    for (int r = 0; r < R; ++r) total[r] = _mm256_setzero_ps(), tail[r] = 0.0f;
    for (int64_t g = 0; g < Gn; ++g) {
      const int64_t k0 = g * G, k1 = std::min(K, k0 + G), kv = k0 + (k1 - k0) / 8 * 8;
      __m256 acc[R];
      for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t k = k0; k < kv; k += 8) {
        const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(c + k));
        const __m256 cf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b));
        for (int r = 0; r < R; ++r)
          acc[r] = _mm256_fmadd_ps(cf, _mm256_loadu_ps(x + r * K + k), acc[r]);
      }
      const float sg = load_scalar(s, g), og = load_scalar(o, g);
      for (int r = 0; r < R; ++r) {
        float rest = 0.0f;  // columns past the last whole 8 (K not a multiple of 8)
        for (int64_t k = kv; k < k1; ++k) rest += x[r * K + k] * static_cast<float>(c[k]);
        total[r] = _mm256_fmadd_ps(acc[r], _mm256_set1_ps(sg), total[r]);
        tail[r] += sg * rest + og * xs[r * Gn + g];
      }
    }
    for (int r = 0; r < R; ++r) y[r * N + n] = hsum(total[r]) + tail[r];
  }
}

// The group sums of a row x [K]: xs[g] = sum of x[g G .. (g + 1) G), eight at a time (G is a
// multiple of 8). Per column, with a division for the group and the sum kept in memory, this
// was 2-3% of a SmolLM2 decode step.
inline void group_sums(const float* x, int64_t K, int64_t G, float* xs) {
  for (int64_t g = 0, k0 = 0; k0 < K; ++g, k0 += G) {
    const int64_t k1 = std::min(K, k0 + G);
    __m256 acc = _mm256_setzero_ps();
    int64_t k = k0;
    for (; k + 8 <= k1; k += 8) acc = _mm256_add_ps(acc, _mm256_loadu_ps(x + k));
    float sum = hsum(acc);
    for (; k < k1; ++k) sum += x[k];
    xs[g] = sum;
  }
}

template <typename S>
void product8(ffi::ThreadPool& pool, const float* x, const uint8_t* codes, const S* scale,
              const S* offset, float* y, int64_t M, int64_t K, int64_t Gn, int64_t G,
              int64_t N) {
  std::vector<float> xs(M * Gn, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    group_sums(x + m * K, K, G, xs.data() + m * Gn);
  row_passes(pool, M, N, K, [&](auto r, int64_t m0, int64_t n0, int64_t n1) {
    rows8<decltype(r)::value, S>(x + m0 * K, xs.data() + m0 * Gn, codes, scale, offset,
                                 y + m0 * N, K, Gn, G, N, n0, n1);
  });
}

template <typename S>
void product(ffi::ThreadPool& pool, const float* x, const uint32_t* codes, const S* scale,
             const S* offset, float* y, int64_t M, int64_t K, int64_t W, int64_t Gn, int64_t G,
             int64_t N) {
  const int64_t blocks = (W + 7) / 8;
  // x in field order, zero past K: xt[m][b][j][w] = x[m][64 b + 8 w + j], divided by 16 in
  // the odd fields (rows_at reads those codes as c * 16; a power of two: exact); and the group
  // sums.
  std::vector<float> xt(M * blocks * 64, 0.0f), xs(M * Gn, 0.0f);
  for (int64_t m = 0; m < M; ++m) {
    const float* xm = x + m * K;
    float* t = xt.data() + m * blocks * 64;
    // A block of 64 columns is an 8 x 8 transpose: field j gathers columns j, j + 8, ... 56.
    const __m256i col = _mm256_setr_epi32(0, 8, 16, 24, 32, 40, 48, 56);
    const int64_t whole = K / 64;
    for (int64_t b = 0; b < whole; ++b)
      for (int j = 0; j < 8; ++j) {
        const __m256 f = _mm256_i32gather_ps(xm + 64 * b + j, col, 4);
        _mm256_storeu_ps(t + b * 64 + j * 8, j % 2 ? _mm256_mul_ps(f, _mm256_set1_ps(0.0625f)) : f);
      }
    for (int64_t k = 64 * whole; k < K; ++k) {
      const int64_t b = k / 64, w = (k % 64) / 8, j = k % 8;
      t[b * 64 + j * 8 + w] = j % 2 ? xm[k] * 0.0625f : xm[k];
    }
    group_sums(xm, K, G, xs.data() + m * Gn);
  }
  row_passes(pool, M, N, K, [&](auto r, int64_t m0, int64_t n0, int64_t n1) {
    rows<decltype(r)::value, S>(xt.data() + m0 * blocks * 64, xs.data() + m0 * Gn, codes,
                                scale, offset, y + m0 * N, K, W, Gn, G, N, n0, n1);
  });
}
// x rounded to 8 bits (``int8_x``, 4-bit codes, G a multiple of 32): each row of x in blocks of
// 32 columns, q = round(x / d), d = max|x| / 127 over the block (jaxllm.lowbit.round_blocks,
// to the bit), and the codes multiplied as integers, 32 products an instruction (vpmaddubsw),
// llama.cpp's arithmetic for its 4-bit blocks. A load of 8 words holds 64 codes; its low
// nibbles (bytes of c & 0x0f0f0f0f) are the even columns of each word, its high ones the odd,
// so x is laid out once per call in that order (xlo, xhi) and each word's 8 products land in
// its own 32-bit lane: lanes 0-3 are block 2b, lanes 4-7 block 2b + 1, scaled by s_g * d at the
// end. Offsets multiply the rounded x's group sums.
// Rows of x one at a time, NB = 4 weight rows each (decode: one row). scratch: room for
// Gn + 4 * 2 * blocks floats.
template <int NB, typename S>
void rows_i8_at(const int8_t* xlo, const int8_t* xhi, const float* d, const float* xs,
                const uint32_t* codes, const S* scale, const S* offset, float* y, int64_t K,
                int64_t W, int64_t Gn, int64_t G, int64_t n, float* scratch) {
  const int64_t blocks = (W + 7) / 8, nb32 = 2 * blocks;
  const __m256i nibbles = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  // sd[i][j] = (the group scale of x block j) * d[j], for weight row n + i (d is 0 past K).
  // Vectorised for groups of 32 (GGUF's Q4_0 / Q4_1): done as scalars, this setup cost as much
  // as the products.
  float *sg = scratch, *sd = scratch + Gn;
  for (int i = 0; i < NB; ++i) {
    const S* si = scale + (n + i) * Gn;
    float* sdi = sd + i * nb32;
    int64_t j = 0;
    if (G == 32)
      for (; j + 8 <= Gn; j += 8)
        _mm256_storeu_ps(sdi + j, _mm256_mul_ps(load8(si + j), _mm256_loadu_ps(d + j)));
    to_f32(si, Gn, sg);
    for (; j < nb32; ++j) sdi[j] = sg[std::min(Gn - 1, 32 * j / G)] * d[j];
  }
  __m256 acc[NB];
  for (int i = 0; i < NB; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const __m256i xl = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xlo + 32 * b));
    const __m256i xh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xhi + 32 * b));
    for (int i = 0; i < NB; ++i) {
      ask_ahead(codes + (n + i) * W + 8 * b);
      const __m256i v = load_words(codes + (n + i) * W + 8 * b, W - 8 * b);
      const __m256i lo = _mm256_and_si256(v, nibbles);
      const __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), nibbles);
      // u4 x s8 pairs summed to s16 (at most 2 * 15 * 127 each, 4 * 15 * 127 both: no
      // saturation), then each word's four pairs to s32.
      const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl),
                                         _mm256_maddubs_epi16(hi, xh));
      const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
      const float* sdi = sd + i * nb32 + 2 * b;
      acc[i] = _mm256_fmadd_ps(f, _mm256_set_m128(_mm_set1_ps(sdi[1]), _mm_set1_ps(sdi[0])),
                               acc[i]);
    }
  }
  float* of = scratch;  // (the scales' room, read above)
  for (int i = 0; i < NB; ++i) {
    to_f32(offset + (n + i) * Gn, Gn, of);
    __m256 t = acc[i];
    int64_t g = 0;
    for (; g + 8 <= Gn; g += 8)
      t = _mm256_fmadd_ps(_mm256_loadu_ps(of + g), _mm256_loadu_ps(xs + g), t);
    float sum = hsum(t);
    for (; g < Gn; ++g) sum += of[g] * xs[g];
    y[n + i] = sum;
  }
}

// A row x [K] rounded in blocks of 32 (jaxllm.lowbit.round_blocks, to the bit): q [nb32 * 32]
// in column order (zero past K), the blocks' scales d [nb32] (0 past K), and the rounded row's
// group sums xs [Gn] (added to).
void round_row(const float* x, int64_t K, int64_t nb32, int64_t G, int8_t* q, float* d,
               float* xs) {
  for (int64_t j = 0; j < nb32; ++j) {
    const int64_t k0 = 32 * j, k1 = std::min(K, k0 + 32);
    float top = 0.0f;
    for (int64_t k = k0; k < k1; ++k) top = std::max(top, std::fabs(x[k]));
    const float dj = top * (1.0f / 127.0f);
    d[j] = dj;
    for (int64_t k = k0; k < k0 + 32; ++k) {
      float v = 0.0f;
      if (k < k1 && dj > 0.0f) v = std::min(127.0f, std::max(-127.0f, std::nearbyintf(x[k] / dj)));
      q[k] = static_cast<int8_t>(v);
      if (k < k1) xs[k / G] += v * dj;
    }
  }
}

// The 8-bit codes' integer form (int8_x, 8 bits): w = c - 128 as signed bytes (the offset
// takes the 128: o' = o + 128 s), and vpmaddubsw multiplies |w| (unsigned) by x with w's sign
// (vpsignb): each pair at most 2 * 128 * 127, no saturation. x in column order (xq:
// [nb32][32], round_row); the 8 s32 lanes of a load together sum one block of 32.
template <typename S>
void rows8_i8(const int8_t* xq, const float* d, const float* xs, const uint8_t* codes,
              const S* scale, const S* offset, float* y, int64_t K, int64_t nb32, int64_t Gn,
              int64_t G, int64_t n0, int64_t n1) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80)), ones = _mm256_set1_epi16(1);
  const int64_t whole = K / 32;  // blocks read straight from the row; the last one copied
  std::vector<float> sd(nb32);  // the row's scale of block j times d[j] (as rows_i8_at)
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* c = codes + n * K;
    for (int64_t l = 0; l < K; l += 64) ask_ahead(c + l);
    const S* sn = scale + n * Gn;
    int64_t i = 0;
    if (G == 32)
      for (; i + 8 <= Gn; i += 8)
        _mm256_storeu_ps(sd.data() + i, _mm256_mul_ps(load8(sn + i), _mm256_loadu_ps(d + i)));
    for (; i < nb32; ++i) sd[i] = load_scalar(sn, 32 * i / G) * d[i];
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < nb32 && 32 * j < K; ++j) {
      __m256i v;
      if (j < whole) {
        v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(c + 32 * j));
      } else {
        alignas(32) uint8_t tail[32];
        std::memset(tail, 128, 32);  // w = 0 past K
        std::memcpy(tail, c + 32 * j, K - 32 * j);
        v = _mm256_load_si256(reinterpret_cast<const __m256i*>(tail));
      }
      const __m256i w = _mm256_xor_si256(v, flip);  // c - 128 as a signed byte
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * j));
      const __m256i p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
      const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
      acc = _mm256_fmadd_ps(f, _mm256_set1_ps(sd[j]), acc);
    }
    float sum = hsum(acc);
    for (int64_t g = 0; g < Gn; ++g)
      sum += (load_scalar(offset + n * Gn, g) + 128.0f * load_scalar(sn, g)) * xs[g];
    y[n] = sum;
  }
}

template <typename S>
void product8_i8(ffi::ThreadPool& pool, const float* x, const uint8_t* codes, const S* scale,
                 const S* offset, float* y, int64_t M, int64_t K, int64_t Gn, int64_t G,
                 int64_t N) {
  const int64_t nb32 = (K + 31) / 32;
  std::vector<int8_t> xq(M * nb32 * 32);
  std::vector<float> d(M * nb32), xs(M * Gn, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    round_row(x + m * K, K, nb32, G, xq.data() + m * nb32 * 32, d.data() + m * nb32,
              xs.data() + m * Gn);
  row_passes(pool, M, N, K, [&](auto r, int64_t m0, int64_t n0, int64_t n1) {
    for (int64_t m = m0; m < m0 + decltype(r)::value; ++m)
      rows8_i8<S>(xq.data() + m * nb32 * 32, d.data() + m * nb32, xs.data() + m * Gn, codes,
                  scale, offset, y + m * N, K, nb32, Gn, G, n0, n1);
  });
}

template <typename S>
void product_i8(ffi::ThreadPool& pool, const float* x, const uint32_t* codes, const S* scale,
                const S* offset, float* y, int64_t M, int64_t K, int64_t W, int64_t Gn,
                int64_t G, int64_t N) {
  const int64_t blocks = (W + 7) / 8;
  std::vector<int8_t> xlo(M * blocks * 32), xhi(M * blocks * 32);
  std::vector<float> d(M * 2 * blocks), xs(M * Gn, 0.0f);
  std::vector<int8_t> q(blocks * 64);
  for (int64_t m = 0; m < M; ++m) {
    round_row(x + m * K, K, 2 * blocks, G, q.data(), d.data() + m * 2 * blocks,
              xs.data() + m * Gn);
    // Into the nibbles' order: column 64 b + 8 w + f goes to byte 4 w + f / 2 of load b, of
    // xlo for even f, xhi for odd.
    int8_t *lo = xlo.data() + m * blocks * 32, *hi = xhi.data() + m * blocks * 32;
    for (int64_t k = 0; k < blocks * 64; ++k) {
      const int64_t b = k / 64, w = (k % 64) / 8, f = k % 8;
      (f % 2 ? hi : lo)[32 * b + 4 * w + f / 2] = q[k];
    }
  }
  row_passes(pool, M, N, K, [&](auto r, int64_t m0, int64_t n0, int64_t n1) {
    std::vector<float> scratch(Gn + 4 * 2 * blocks);
    for (int64_t m = m0; m < m0 + decltype(r)::value; ++m) {
      const int8_t* lo = xlo.data() + m * blocks * 32;
      const int8_t* hi = xhi.data() + m * blocks * 32;
      const float* dm = d.data() + m * 2 * blocks;
      const float* xm = xs.data() + m * Gn;
      float* ym = y + m * N;
      int64_t n = n0;
      for (; n + 4 <= n1; n += 4)
        rows_i8_at<4, S>(lo, hi, dm, xm, codes, scale, offset, ym, K, W, Gn, G, n,
                         scratch.data());
      for (; n < n1; ++n)
        rows_i8_at<1, S>(lo, hi, dm, xm, codes, scale, offset, ym, K, W, Gn, G, n,
                         scratch.data());
    }
  });
}
#endif  // JAXLLM_AVX2

ffi::Error LowbitRows(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer codes,
                      ffi::AnyBuffer scale, ffi::AnyBuffer offset, ffi::ResultBuffer<ffi::F32> y,
                      int64_t bits, int64_t group, bool int8_x) {
  const std::string name = "jaxllm_lowbit_rows";
  auto xd = x.dimensions(), cd = codes.dimensions(), sd = scale.dimensions(),
       od = offset.dimensions();
  if (xd.size() != 2 || cd.size() != 2 || sd.size() != 2)
    return ffi::Error::InvalidArgument(name + " needs x [M, K], codes [N, W], scale [N, Gn]");
  const int64_t M = xd[0], K = xd[1], N = cd[0], W = cd[1], Gn = sd[1];
  const bool four = bits == 4;
  if ((bits != 4 && bits != 8) ||
      codes.element_type() != (four ? ffi::U32 : ffi::U8) || W != (four ? (K + 7) / 8 : K))
    return ffi::Error::InvalidArgument(name + ": 4-bit codes come as u32 [N, ceil(K / 8)], "
                                       "8-bit ones as u8 [N, K]");
  if (group < 8 || group % 8 || Gn != (K + group - 1) / group || sd[0] != N ||
      od.size() != 2 || od[0] != N || od[1] != Gn)
    return ffi::Error::InvalidArgument(name + ": shapes or group do not match (group a "
                                       "multiple of 8, Gn = ceil(K / group))");
  if (scale.element_type() != offset.element_type() ||
      (scale.element_type() != ffi::F32 && scale.element_type() != ffi::F16))
    return ffi::Error::InvalidArgument(name + ": scale and offset must both be float32 or "
                                       "both float16");
  if (int8_x && group % 32)
    return ffi::Error::InvalidArgument(name + ": x rounded to 8 bits needs groups of a "
                                       "multiple of 32 columns");
#ifndef JAXLLM_AVX2
  (void)pool, (void)y, (void)M;
  return ffi::Error::InvalidArgument(name + " was built without AVX2, FMA and F16C; use XLA's "
                                     "form");
#else
  // Rows of x that are all zero are not multiplied (blocks.h, live_rows).
  auto run = [&](auto* s, auto* o) {
    jaxllm::live_rows(x.typed_data(), y->typed_data(), M, K, N,
                      [&](const float* xp, float* yp, int64_t rows) {
      if (int8_x && four)
        product_i8(pool, xp, static_cast<const uint32_t*>(codes.untyped_data()), s, o, yp, rows,
                   K, W, Gn, group, N);
      else if (int8_x)
        product8_i8(pool, xp, static_cast<const uint8_t*>(codes.untyped_data()), s, o, yp, rows,
                    K, Gn, group, N);
      else if (four)
        product(pool, xp, static_cast<const uint32_t*>(codes.untyped_data()), s, o, yp, rows, K,
                W, Gn, group, N);
      else
        product8(pool, xp, static_cast<const uint8_t*>(codes.untyped_data()), s, o, yp, rows, K,
                 Gn, group, N);
    });
  };
  if (scale.element_type() == ffi::F32)
    run(static_cast<const float*>(scale.untyped_data()),
        static_cast<const float*>(offset.untyped_data()));
  else
    run(static_cast<const uint16_t*>(scale.untyped_data()),
        static_cast<const uint16_t*>(offset.untyped_data()));
  return ffi::Error::Success();
#endif
}

}  // namespace

// 1 where this build has the kernel (the compiler targeted AVX2 with FMA and F16C).
extern "C" int jaxllm_lowbit_rows_avx2() {
#ifdef JAXLLM_AVX2
  return 1;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmLowbitRows, LowbitRows,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("int8_x"));
