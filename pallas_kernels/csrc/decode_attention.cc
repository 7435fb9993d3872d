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
// Why: XLA:CPU scores a few query rows against the keys with YNNPACK and weights the values with
// a second product, reading a float32 cache at 6-14 GB/s here and a 2-byte one after widening it
// into float32 copies (docs/BENCHMARKS.md, "KV cache passes"). Here each head's keys are read
// once, widened in registers, and only the picked rotation is scored; the scores (G * C floats)
// stay in the caches for the values pass. Heads are split over XLA's intra-op thread pool.
// Two passes (scores, then values) rather than an online softmax: the same operations in the same
// order as the jnp path up to the summation order of the dot products.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#include <immintrin.h>
#define JAXLLM_AVX512 1
#endif

#include "blocks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr float kNegInf = -1e30f;  // jaxllm.model.NEG_INF

#ifdef JAXLLM_AVX512
enum class Kind { kF32, kF16, kBf16 };

// 16 (or, with ``m``, fewer) cache values from ``p`` as float32 lanes.
template <Kind K>
inline __m512 load16(const void* p, __mmask16 m) {
  if constexpr (K == Kind::kF32) {
    return _mm512_maskz_loadu_ps(m, p);
  } else if constexpr (K == Kind::kF16) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
  } else {  // bfloat16: its bits are the top half of a float32
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
}

// e^x in 16 lanes: 2^n * e^r with n = round(x / ln 2), |r| <= ln 2 / 2, e^r by its Taylor series
// to r^7 (relative error below 1e-8, under float32's rounding). Arguments below -150 give 0,
// so a masked slot's probability is exactly 0, as in the jnp path.
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-150.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln 2, with ln 2 in two parts so that r keeps its low bits
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.4286068202862268e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 5040.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 720.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

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

// Head row n: scores into ``s`` [G, C], softmax in place, then the values into out[n].
template <Kind K, int kG>
void head(const Args& a, int64_t n, float* s) {
  constexpr int64_t esize = K == Kind::kF32 ? 4 : 2;
  const int64_t C = a.C, D = a.D, G = kG > 0 ? kG : a.G;
  const int64_t b = n / a.KVH, nv = (D + 15) / 16;
  const char* kb = static_cast<const char*>(a.k) + n * C * D * esize;
  const char* vb = static_cast<const char*>(a.v) + n * C * D * esize;
  const float* q = a.q + n * a.R * G * D;
  const int32_t* pick = a.pick + b * C;
  const __mmask16 tail = D % 16 ? static_cast<__mmask16>((1u << (D % 16)) - 1) : 0xFFFF;
  auto mask_of = [&](int64_t j) { return j == nv - 1 ? tail : static_cast<__mmask16>(0xFFFF); };

  // Scores. One slot's keys are loaded once for its G query heads.
  for (int64_t c = 0; c < C; ++c) {
    const int32_t r = pick[c];
    if (r < 0) {
      for (int64_t g = 0; g < G; ++g) s[g * C + c] = kNegInf;
      continue;
    }
    const char* kr = kb + c * D * esize;
    const float* qr = q + r * G * D;
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < nv; ++j) {
        const __mmask16 m = mask_of(j);
        acc = _mm512_fmadd_ps(load16<K>(kr + j * 16 * esize, m),
                              _mm512_maskz_loadu_ps(m, qr + g * D + j * 16), acc);
      }
      float x = _mm512_reduce_add_ps(acc) / a.root_d;
      if (a.alibi) x -= a.slopes[n * G + g] * static_cast<float>(a.dist[b * C + c]);
      s[g * C + c] = x;
    }
  }
  // Softmax over the slots (and the virtual zero score of softmax-off-by-one), 16 at a time.
  const int64_t cv = C - C % 16;
  const __mmask16 ctail = static_cast<__mmask16>((1u << (C % 16)) - 1);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * C;
    const __m512 neg = _mm512_set1_ps(kNegInf);
    __m512 m16 = neg;
    for (int64_t c = 0; c < cv; c += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(sg + c));
    if (ctail) m16 = _mm512_max_ps(m16, _mm512_mask_loadu_ps(neg, ctail, sg + cv));
    const float mx = std::max(_mm512_reduce_max_ps(m16), a.zero_sink ? 0.f : kNegInf);
    const __m512 mxv = _mm512_set1_ps(mx);
    __m512 sum16 = _mm512_setzero_ps();
    for (int64_t c = 0; c < cv; c += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + c), mxv));
      _mm512_storeu_ps(sg + c, e);
      sum16 = _mm512_add_ps(sum16, e);
    }
    if (ctail) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(ctail, sg + cv), mxv));
      _mm512_mask_storeu_ps(sg + cv, ctail, e);
      sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(ctail, e));
    }
    const float sum = _mm512_reduce_add_ps(sum16) + (a.zero_sink ? std::exp(-mx) : 0.f);
    const __m512 inv = _mm512_set1_ps(1.f / sum);
    for (int64_t c = 0; c < cv; c += 16)
      _mm512_storeu_ps(sg + c, _mm512_mul_ps(_mm512_loadu_ps(sg + c), inv));
    for (int64_t c = cv; c < C; ++c) sg[c] *= 1.f / sum;
  }
  // Values: out[g] = sum_c p[g, c] v[c], accumulated in registers for D <= 256.
  float* out = a.out + n * G * D;
  for (int64_t j0 = 0; j0 < nv; j0 += 16) {  // 16 vectors of the head dimension at a time
    const int64_t jn = std::min<int64_t>(16, nv - j0);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int64_t j = 0; j < jn; ++j) acc[j] = _mm512_setzero_ps();
      const float* pg = s + g * C;
      for (int64_t c = 0; c < C; ++c) {
        const __m512 p = _mm512_set1_ps(pg[c]);
        const char* vr = vb + (c * D + j0 * 16) * esize;
        for (int64_t j = 0; j < jn; ++j)
          acc[j] = _mm512_fmadd_ps(p, load16<K>(vr + j * 16 * esize, mask_of(j0 + j)), acc[j]);
      }
      for (int64_t j = 0; j < jn; ++j)
        _mm512_mask_storeu_ps(out + g * D + (j0 + j) * 16, mask_of(j0 + j), acc[j]);
    }
  }
}

template <Kind K>
void head_any(const Args& a, int64_t n, float* s) {
  // G = 1 (multi-head) is the common case; a compile-time 1 lets the compiler drop its loops.
  if (a.G == 1) return head<K, 1>(a, n, s);
  head<K, 0>(a, n, s);
}

template <Kind K>
void head_of(const Args& a, int64_t n) {
  std::vector<float> s(a.G * a.C);  // this head's scores, then probabilities
  head_any<K>(a, n, s.data());
}
#endif  // JAXLLM_AVX512

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
#ifndef JAXLLM_AVX512
  (void)pool, (void)root_d, (void)alibi, (void)zero_sink;
  return ffi::Error::InvalidArgument(
      "jaxllm_decode_attention was built without AVX-512; use the jnp path");
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
  // One block per head row.
  jaxllm::for_each_block(pool, N, [a, kind](int64_t n) {
    switch (kind) {
      case Kind::kF32: head_of<Kind::kF32>(a, n); break;
      case Kind::kF16: head_of<Kind::kF16>(a, n); break;
      case Kind::kBf16: head_of<Kind::kBf16>(a, n); break;
    }
  });
#endif
  return ffi::Error::Success();
}

}  // namespace

// 1 where this build has the kernel (-march=native on a machine with AVX-512 F, BW and VL).
extern "C" int jaxllm_decode_attention_avx512() {
#ifdef JAXLLM_AVX512
  return 1;
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
