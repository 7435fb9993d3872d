// One decode step's attention on a CPU: every query row against a whole KV cache, in one read of
// the keys and one of the values. An XLA FFI custom call that pallas_kernels/cpu.py builds with the
// machine's own compiler (-march=native) and registers; jaxllm.model._decode_attend calls it.
//
//   jaxllm_decode_attention(k T[N, C, D], v T[N, C, D], q f32[N, R * G, D], pick s32[B, C],
//                           dist s32[B, C], slopes f32[N, G]; root_d, alibi, zero_sink)
//     -> out f32[N, G, D]
//
//   N = B * KVH rows of heads (row n is batch n / KVH), C cache slots, G query heads per KV
//   head, R rotations of the query (jaxllm's keys are stored rotated at their slot: each slot is
//   scored against the query rotation ``pick`` names, rows r * G .. r * G + G - 1 of q; pick < 0
//   masks the slot). T: float32, float16, or bfloat16 (or its uint16 bit patterns).
//
//   s[g, c] = dot(k[n, c], q[n, pick * G + g]) / root_d  - slopes[n, g] * dist[b, c]  (alibi)
//           = -1e30 where pick < 0 (jaxllm.model.NEG_INF: finite, as the jnp path masks)
//   p = softmax over c (with one more score 0 of value 0 when zero_sink: softmax-off-by-one)
//   out[n, g] = sum_c p[g, c] v[n, c]
//
//   A masked slot's key and value are never read; a row with every slot masked (an idle row of
//   a serving pool, jaxllm.serve) reads nothing and gives 0.
//
// Why: XLA:CPU scores a few query rows against the keys with YNNPACK and weights the values with
// a second product, reading a float32 cache at 6-14 GB/s here and a 2-byte one after widening it
// into float32 copies (docs/BENCHMARKS.md, "KV cache passes"). Here each head's keys are read
// once, widened in registers, and only the picked rotation is scored; a chunk's scores stay in
// the caches for its values pass. Work is split over XLA's intra-op thread pool by head and, when
// there are few heads (batch 1 with few KV heads), by chunks of slots, whose partial softmax sums
// are rescaled to the largest score and combined (as flash-decoding does). Results equal the jnp
// path's to float32 rounding: the sums run in a different order and the division comes last.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define JAXLLM_AVX512 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXLLM_AVX2 1
#endif
#if defined(JAXLLM_AVX512) || defined(JAXLLM_AVX2)
#include <immintrin.h>
#define JAXLLM_ATTENTION 1
#endif

#include "blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -1e30f;  // jaxllm.model.NEG_INF
// The fewest slots a head's chunk has when its slots are split over threads.
constexpr int64_t kMinChunk = 512;

#ifdef JAXLLM_ATTENTION
enum class Kind { kF32, kF16, kBf16 };
template <Kind K>
constexpr int64_t kBytes = K == Kind::kF32 ? 4 : 2;

// The vector instructions, one struct per instruction set, so that the kernel below is written
// once: W float32 lanes; load / loadf read n <= W lanes (the rest ``fill``), storef writes n;
// kAcc vectors of a head's values are summed in registers at a time.
#ifdef JAXLLM_AVX512
struct Avx512 {
  using V = __m512;
  static constexpr int64_t W = 16, kAcc = 16;
  static __mmask16 mask(int64_t n) {
    return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  }
  static V zero() { return _mm512_setzero_ps(); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  template <Kind K>
  static V load(const void* p, int64_t n) {
    const __mmask16 m = mask(n);
    if constexpr (K == Kind::kF32) {
      return _mm512_maskz_loadu_ps(m, p);
    } else if constexpr (K == Kind::kF16) {
      return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
    } else {  // bfloat16: its bits are the top half of a float32
      __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
    }
  }
  static V loadf(const float* p, int64_t n, float fill = 0.f) {
    return n >= W ? _mm512_loadu_ps(p) : _mm512_mask_loadu_ps(set1(fill), mask(n), p);
  }
  static void storef(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, mask(n), v); }
  static V fmadd(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float reduce_add(V v) { return _mm512_reduce_add_ps(v); }
  static float reduce_max(V v) { return _mm512_reduce_max_ps(v); }
  // e^x: 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor series to r^7
  // (relative error below 1e-8, under float32's rounding). Arguments below -150 give 0, so a
  // masked slot's probability is exactly 0, as in the jnp path.
  static V exp(V x) {
    x = _mm512_max_ps(_mm512_min_ps(x, set1(88.7f)), set1(-150.f));
    const V n = _mm512_roundscale_ps(_mm512_mul_ps(x, set1(1.44269504089f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(exp_reduced(x, n), n);
  }
  static V exp_reduced(V x, V n) {  // e^r, r = x - n ln 2 (ln 2 in two parts: r keeps its bits)
    V r = _mm512_fnmadd_ps(n, set1(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, set1(1.4286068202862268e-06f), r);
    V p = set1(1.f / 5040.f);
    for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
      p = _mm512_fmadd_ps(p, r, set1(c));
    return p;
  }
};
#endif

#ifdef JAXLLM_AVX2
struct Avx2 {
  using V = __m256;
  static constexpr int64_t W = 8, kAcc = 8;  // 16 ymm registers: 8 sums, the rest for loads
  static V zero() { return _mm256_setzero_ps(); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  template <Kind K>
  static V load(const void* p, int64_t n) {
    if (n < W) {  // a tail (head dims that are not multiples of 8): through a zeroed buffer
      alignas(32) unsigned char buf[32] = {};
      std::memcpy(buf, p, n * kBytes<K>);
      return load<K>(buf, W);
    }
    if constexpr (K == Kind::kF32) {
      return _mm256_loadu_ps(static_cast<const float*>(p));
    } else if constexpr (K == Kind::kF16) {
      return _mm256_cvtph_ps(_mm_loadu_si128(static_cast<const __m128i*>(p)));
    } else {
      __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p)));
      return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
    }
  }
  static V loadf(const float* p, int64_t n, float fill = 0.f) {
    if (n >= W) return _mm256_loadu_ps(p);
    alignas(32) float buf[8];
    for (int64_t i = 0; i < W; ++i) buf[i] = i < n ? p[i] : fill;
    return _mm256_load_ps(buf);
  }
  static void storef(float* p, V v, int64_t n) {
    if (n >= W) return _mm256_storeu_ps(p, v);
    alignas(32) float buf[8];
    _mm256_store_ps(buf, v);
    std::memcpy(p, buf, n * sizeof(float));
  }
  static V fmadd(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float reduce_add(V v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  static float reduce_max(V v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_shuffle_ps(s, s, 1)));
  }
  // e^x as Avx512::exp, with 2^n built in the exponent's bits (no scalef here): n >= -126 keeps
  // it a normal float, so arguments below -87.3 give 0 (e^-87.3 is 1e-38: nothing in a sum).
  static V exp(V x) {
    const V under = _mm256_cmp_ps(x, set1(-87.3f), _CMP_LT_OQ);
    x = _mm256_max_ps(_mm256_min_ps(x, set1(88.f)), set1(-87.3f));
    const V n = _mm256_round_ps(_mm256_mul_ps(x, set1(1.44269504089f)),
                                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    V r = _mm256_fnmadd_ps(n, set1(0.693145751953125f), x);
    r = _mm256_fnmadd_ps(n, set1(1.4286068202862268e-06f), r);
    V p = set1(1.f / 5040.f);
    for (float c : {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f})
      p = _mm256_fmadd_ps(p, r, set1(c));
    const __m256i e = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
  }
};
#endif

struct Args {
  const void *k = nullptr, *v = nullptr;
  const float* q = nullptr;
  const int32_t *pick = nullptr, *dist = nullptr;
  const float* slopes = nullptr;
  float* out = nullptr;
  int64_t N = 0, C = 0, D = 0, R = 0, G = 0, KVH = 1;
  float root_d = 1.f;
  bool alibi = false, zero_sink = false;
};

// Slots [c0, c1) of head row n, for each of its G query heads: the chunk's largest score m, the
// sum l of exp(score - m), and the sum of exp(score - m) * v, written to ``part`` as [G] m, [G] l,
// [G, D] sums. ``s`` [G, c1 - c0] holds the chunk's scores, then their exponentials.
template <typename I, Kind K, int kG, int kD>
void chunk(const Args& a, int64_t n, int64_t c0, int64_t c1, float* s, float* part) {
  using V = typename I::V;
  constexpr int64_t esize = kBytes<K>, W = I::W;
  const int64_t C = a.C, D = kD > 0 ? kD : a.D, G = kG > 0 ? kG : a.G, L = c1 - c0;
  const int64_t b = n / a.KVH, nv = (D + W - 1) / W;
  const char* kb = static_cast<const char*>(a.k) + (n * C + c0) * D * esize;
  const char* vb = static_cast<const char*>(a.v) + (n * C + c0) * D * esize;
  const float* q = a.q + n * a.R * G * D;
  const int32_t* pick = a.pick + b * C + c0;
  const int32_t* dist = a.dist + b * C + c0;
  auto lanes = [&](int64_t j) { return std::min<int64_t>(W, D - j * W); };

  // Scores. One slot's keys are loaded once for its G query heads; a masked slot's not at all.
  for (int64_t c = 0; c < L; ++c) {
    const int32_t r = pick[c];
    if (r < 0) {
      for (int64_t g = 0; g < G; ++g) s[g * L + c] = kNegInf;
      continue;
    }
    const char* kr = kb + c * D * esize;
    const float* qr = q + r * G * D;
    for (int64_t g = 0; g < G; ++g) {
      V acc = I::zero();
      for (int64_t j = 0; j < nv; ++j)
        acc = I::fmadd(I::template load<K>(kr + j * W * esize, lanes(j)),
                       I::loadf(qr + g * D + j * W, lanes(j)), acc);
      float x = I::reduce_add(acc) / a.root_d;
      if (a.alibi) x -= a.slopes[n * G + g] * static_cast<float>(dist[c]);
      s[g * L + c] = x;
    }
  }
  // The chunk's max and sum of exponentials, W slots at a time.
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    V mw = I::set1(kNegInf);
    for (int64_t c = 0; c < L; c += W) mw = I::max(mw, I::loadf(sg + c, L - c, kNegInf));
    const float mx = I::reduce_max(mw);
    const V mxv = I::set1(mx);
    V sum = I::zero();
    for (int64_t c = 0; c < L; c += W) {
      const int64_t nl = std::min<int64_t>(W, L - c);
      V e = I::exp(I::sub(I::loadf(sg + c, nl, kNegInf), mxv));
      I::storef(sg + c, e, nl);
      if (nl < W) e = I::loadf(sg + c, nl);  // the lanes past L add nothing
      sum = I::add(sum, e);
    }
    part[g] = mx;
    part[G + g] = I::reduce_add(sum);
  }
  // Values weighted by the exponentials, accumulated in registers (kAcc vectors of the head
  // dimension at a time).
  float* sums = part + 2 * G;
  for (int64_t j0 = 0; j0 < nv; j0 += I::kAcc) {
    const int64_t jn = std::min<int64_t>(I::kAcc, nv - j0);
    for (int64_t g = 0; g < G; ++g) {
      V acc[I::kAcc];
      for (int64_t j = 0; j < jn; ++j) acc[j] = I::zero();
      const float* eg = s + g * L;
      for (int64_t c = 0; c < L; ++c) {
        if (pick[c] < 0) continue;  // a masked slot's value is not read (its weight is 0)
        const V e = I::set1(eg[c]);
        const char* vr = vb + (c * D + j0 * W) * esize;
        for (int64_t j = 0; j < jn; ++j)
          acc[j] = I::fmadd(e, I::template load<K>(vr + j * W * esize, lanes(j0 + j)), acc[j]);
      }
      for (int64_t j = 0; j < jn; ++j)
        I::storef(sums + g * D + (j0 + j) * W, acc[j], lanes(j0 + j));
    }
  }
}

#ifdef JAXLLM_AVX512
using Isa = Avx512;
#else
using Isa = Avx2;
#endif

template <Kind K>
void chunk_any(const Args& a, int64_t n, int64_t c0, int64_t c1, float* part) {
  std::vector<float> s(a.G * (c1 - c0));
  // G = 1 (multi-head) is the common case; a compile-time 1 lets the compiler drop its loops.
  // A head dimension of 64 (SmolLM2, Pythia) as a compile-time count: its loads are whole
  // vectors and its sums stay in registers (docs/CPU.md, "Decode attention in XLA").
  if (a.D == 64) {
    if (a.G == 1) return chunk<Isa, K, 1, 64>(a, n, c0, c1, s.data(), part);
    return chunk<Isa, K, 0, 64>(a, n, c0, c1, s.data(), part);
  }
  if (a.G == 1) return chunk<Isa, K, 1, 0>(a, n, c0, c1, s.data(), part);
  chunk<Isa, K, 0, 0>(a, n, c0, c1, s.data(), part);
}

// out[n, g] from the chunks' parts: each chunk's sums rescaled to the largest score M of all
// (and of softmax-off-by-one's zero score), divided by the rescaled sum of exponentials.
void combine(const Args& a, int64_t P, const float* parts) {
  const int64_t G = a.G, D = a.D, stride = G * (D + 2);
  for (int64_t n = 0; n < a.N; ++n) {
    const float* pn = parts + n * P * stride;
    for (int64_t g = 0; g < G; ++g) {
      float M = a.zero_sink ? 0.f : kNegInf;
      for (int64_t p = 0; p < P; ++p) M = std::max(M, pn[p * stride + g]);
      float den = a.zero_sink ? std::exp(-M) : 0.f;
      float* out = a.out + (n * G + g) * D;
      std::fill(out, out + D, 0.f);
      for (int64_t p = 0; p < P; ++p) {
        const float* part = pn + p * stride;
        const float w = std::exp(part[g] - M);
        den += w * part[G + g];
        const float* sums = part + 2 * G + g * D;
        for (int64_t d = 0; d < D; ++d) out[d] += w * sums[d];
      }
      const float inv = 1.f / den;
      for (int64_t d = 0; d < D; ++d) out[d] *= inv;
    }
  }
}
#endif  // JAXLLM_ATTENTION

ffi::Error DecodeAttention(ffi::ThreadPool pool, ffi::AnyBuffer k, ffi::AnyBuffer v,
                           ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::S32> pick,
                           ffi::Buffer<ffi::S32> dist, ffi::Buffer<ffi::F32> slopes,
                           ffi::ResultBuffer<ffi::F32> out, float root_d, bool alibi,
                           bool zero_sink) {
  auto kd = k.dimensions(), qd = q.dimensions(), pd = pick.dimensions(),
       od = out->dimensions();
  if (kd.size() != 3 || v.dimensions().size() != 3 || qd.size() != 3 || pd.size() != 2 ||
      od.size() != 3)
    return ffi::Error::InvalidArgument(
        "jaxllm_decode_attention needs k, v [N, C, D], q [N, R*G, D], pick [B, C], "
        "out [N, G, D]");
  const int64_t N = kd[0], C = kd[1], D = kd[2], B = pd[0], G = od[1];
  if (k.element_type() != v.element_type() || v.dimensions()[0] != N ||
      v.dimensions()[1] != C || v.dimensions()[2] != D || qd[0] != N || qd[2] != D ||
      G <= 0 || qd[1] % G != 0 || pd[1] != C || B <= 0 || N % B != 0 || od[0] != N ||
      od[2] != D || dist.dimensions().size() != 2 || dist.dimensions()[0] != B ||
      dist.dimensions()[1] != C || slopes.element_count() != N * G)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: inconsistent shapes");
  if (D > 256)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: head dim above 256");
#ifndef JAXLLM_ATTENTION
  (void)pool, (void)root_d, (void)alibi, (void)zero_sink;
  return ffi::Error::InvalidArgument(
      "jaxllm_decode_attention was built without AVX-512 or AVX2; use the jnp path");
#else
  Kind kind;
  switch (k.element_type()) {
    case ffi::DataType::F32: kind = Kind::kF32; break;
    case ffi::DataType::F16: kind = Kind::kF16; break;
    case ffi::DataType::BF16:
    case ffi::DataType::U16: kind = Kind::kBf16; break;
    default:
      return ffi::Error::InvalidArgument(
          "jaxllm_decode_attention: k and v must be float32, float16, bfloat16 or its uint16 "
          "bits");
  }
  Args a;
  a.k = k.untyped_data(), a.v = v.untyped_data(), a.q = q.typed_data();
  a.pick = pick.typed_data(), a.dist = dist.typed_data(), a.slopes = slopes.typed_data();
  a.out = out->typed_data();
  a.N = N, a.C = C, a.D = D, a.G = G, a.R = qd[1] / G, a.KVH = N / B;
  a.root_d = root_d, a.alibi = alibi, a.zero_sink = zero_sink;
  // Blocks of (head row, chunk of slots): each head's slots are split into P chunks when there
  // are fewer heads than about four per thread (batch 1 with few KV heads), chunks of at least
  // kMinChunk slots. Each block writes its own part; the parts are combined after.
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t P = std::max<int64_t>(
      1, std::min((4 * threads + N - 1) / N, C / kMinChunk));
  // No chunk is empty: (P - 1) * size >= C would need C < P * (P - 1), and C >= kMinChunk * P.
  const int64_t size = (C + P - 1) / P;
  std::vector<float> parts(N * P * G * (D + 2));
  float* pp = parts.data();
  jaxllm::for_each_block(pool, N * P, [a, kind, P, size, pp](int64_t blk) {
    const int64_t n = blk / P, c0 = (blk % P) * size, c1 = std::min(a.C, c0 + size);
    float* part = pp + blk * a.G * (a.D + 2);
    switch (kind) {
      case Kind::kF32: chunk_any<Kind::kF32>(a, n, c0, c1, part); break;
      case Kind::kF16: chunk_any<Kind::kF16>(a, n, c0, c1, part); break;
      case Kind::kBf16: chunk_any<Kind::kBf16>(a, n, c0, c1, part); break;
    }
  });
  combine(a, P, pp);
#endif
  return ffi::Error::Success();
}

}  // namespace

// Which instructions this build's kernel uses (-march=native): 512 (AVX-512 F, BW and VL),
// 256 (AVX2 with FMA and F16C), 0 (none: no kernel).
extern "C" int jaxllm_decode_attention_isa() {
#if defined(JAXLLM_AVX512)
  return 512;
#elif defined(JAXLLM_AVX2)
  return 256;
#else
  return 0;
#endif
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxllmDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<float>("root_d")
                                  .Attr<bool>("alibi")
                                  .Attr<bool>("zero_sink"));
