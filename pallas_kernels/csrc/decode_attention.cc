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
// once, widened in registers, and only the picked rotation is scored; a chunk's scores stay in
// the caches for its values pass. Work is split over XLA's intra-op thread pool by head and, when
// there are few heads (batch 1 with few KV heads), by chunks of slots, whose partial softmax sums
// are rescaled to the largest score and combined (as flash-decoding does). Results equal the jnp
// path's to float32 rounding: the sums run in a different order and the division comes last.
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
// The fewest slots a head's chunk has when its slots are split over threads.
constexpr int64_t kMinChunk = 512;

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

// Slots [c0, c1) of head row n, for each of its G query heads: the chunk's largest score m, the
// sum l of exp(score - m), and the sum of exp(score - m) * v, written to ``part`` as [G] m, [G] l,
// [G, D] sums. ``s`` [G, c1 - c0] holds the chunk's scores, then their exponentials.
template <Kind K, int kG>
void chunk(const Args& a, int64_t n, int64_t c0, int64_t c1, float* s, float* part) {
  constexpr int64_t esize = K == Kind::kF32 ? 4 : 2;
  const int64_t C = a.C, D = a.D, G = kG > 0 ? kG : a.G, L = c1 - c0;
  const int64_t b = n / a.KVH, nv = (D + 15) / 16;
  const char* kb = static_cast<const char*>(a.k) + (n * C + c0) * D * esize;
  const char* vb = static_cast<const char*>(a.v) + (n * C + c0) * D * esize;
  const float* q = a.q + n * a.R * G * D;
  const int32_t* pick = a.pick + b * C + c0;
  const int32_t* dist = a.dist + b * C + c0;
  const __mmask16 tail = D % 16 ? static_cast<__mmask16>((1u << (D % 16)) - 1) : 0xFFFF;
  auto mask_of = [&](int64_t j) { return j == nv - 1 ? tail : static_cast<__mmask16>(0xFFFF); };

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
      __m512 acc = _mm512_setzero_ps();
      for (int64_t j = 0; j < nv; ++j) {
        const __mmask16 m = mask_of(j);
        acc = _mm512_fmadd_ps(load16<K>(kr + j * 16 * esize, m),
                              _mm512_maskz_loadu_ps(m, qr + g * D + j * 16), acc);
      }
      float x = _mm512_reduce_add_ps(acc) / a.root_d;
      if (a.alibi) x -= a.slopes[n * G + g] * static_cast<float>(dist[c]);
      s[g * L + c] = x;
    }
  }
  // The chunk's max and sum of exponentials, 16 slots at a time.
  const int64_t cv = L - L % 16;
  const __mmask16 ctail = static_cast<__mmask16>((1u << (L % 16)) - 1);
  const __m512 neg = _mm512_set1_ps(kNegInf);
  for (int64_t g = 0; g < G; ++g) {
    float* sg = s + g * L;
    __m512 m16 = neg;
    for (int64_t c = 0; c < cv; c += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(sg + c));
    if (ctail) m16 = _mm512_max_ps(m16, _mm512_mask_loadu_ps(neg, ctail, sg + cv));
    const float mx = _mm512_reduce_max_ps(m16);
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
    part[g] = mx;
    part[G + g] = _mm512_reduce_add_ps(sum16);
  }
  // Values weighted by the exponentials, accumulated in registers (16 vectors of the head
  // dimension at a time: D <= 256 in one pass).
  float* sums = part + 2 * G;
  for (int64_t j0 = 0; j0 < nv; j0 += 16) {
    const int64_t jn = std::min<int64_t>(16, nv - j0);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc[16];
      for (int64_t j = 0; j < jn; ++j) acc[j] = _mm512_setzero_ps();
      const float* eg = s + g * L;
      for (int64_t c = 0; c < L; ++c) {
        const __m512 e = _mm512_set1_ps(eg[c]);
        const char* vr = vb + (c * D + j0 * 16) * esize;
        for (int64_t j = 0; j < jn; ++j)
          acc[j] = _mm512_fmadd_ps(e, load16<K>(vr + j * 16 * esize, mask_of(j0 + j)), acc[j]);
      }
      for (int64_t j = 0; j < jn; ++j)
        _mm512_mask_storeu_ps(sums + g * D + (j0 + j) * 16, mask_of(j0 + j), acc[j]);
    }
  }
}

template <Kind K>
void chunk_any(const Args& a, int64_t n, int64_t c0, int64_t c1, float* part) {
  std::vector<float> s(a.G * (c1 - c0));
  // G = 1 (multi-head) is the common case; a compile-time 1 lets the compiler drop its loops.
  if (a.G == 1) return chunk<K, 1>(a, n, c0, c1, s.data(), part);
  chunk<K, 0>(a, n, c0, c1, s.data(), part);
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
