// AVX2 level of the quantized products (vpmaddubsw + vpmaddwd). A 256-bit register holds one
// 4-element group of 8 rows, so a unit's 16 rows are done as two halves of 8; each row's
// arithmetic is qgemm.h's, the same as every other level's.
#include <cstdint>
#include <cstring>

#include "qgemm.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace specserve::avx2 {
namespace {

constexpr int kTileTokens = 4;
constexpr int kHalf = 8;

inline __m256i bcst4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

struct Half {
  __m256i w[8];  // unsigned weights of 8 rows, one register per 4-element group
  __m256i sgn[8];  // Q8_0: the signed weights, whose signs go onto the activations
  __m256 dw, mw;
};

// Rows 8h .. 8h+7 of a unit.
template <int F>
inline void decode(const uint8_t* u, int h, Half& out) {
  if constexpr (F == FMT_Q8_0) {
    for (int j = 0; j < 8; ++j) {
      const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * j + 32 * h));
      out.w[j] = _mm256_abs_epi8(q);
      out.sgn[j] = q;
    }
    out.dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 512 + 16 * h)));
  } else {
    const __m256i low = _mm256_set1_epi8(0x0F);
    for (int p = 0; p < 4; ++p) {
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(u + 64 * p + 32 * h));
      out.w[p] = _mm256_and_si256(v, low);
      out.w[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
    }
    out.dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 256 + 16 * h)));
    if constexpr (F == FMT_Q4_1)
      out.mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(u + 256 + 32 + 16 * h)));
  }
}

inline __m256i dot4(__m256i acc, __m256i w, __m256i a) {
  const __m256i pairs = _mm256_maddubs_epi16(w, a);  // |w| <= 128, |a| <= 127: no saturation
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
}

template <int F>
inline __m256i block_sums(const Half& w, const ActBlock& a) {
  __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
#pragma GCC unroll 4
  for (int j = 0; j < 8; j += 2) {
    __m256i a0 = bcst4(a.q + 4 * j), a1 = bcst4(a.q + 4 * j + 4);
    if constexpr (F == FMT_Q8_0) {
      a0 = _mm256_sign_epi8(a0, w.sgn[j]);
      a1 = _mm256_sign_epi8(a1, w.sgn[j + 1]);
    }
    s0 = dot4(s0, w.w[j], a0);
    s1 = dot4(s1, w.w[j + 1], a1);
  }
  __m256i sum = _mm256_add_epi32(s0, s1);
  if constexpr (F == FMT_Q4_0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(8 * (a.s16[0] + a.s16[1])));
  return sum;
}

template <int F, int TN>
inline void tile(const uint8_t* units, size_t ub, int64_t nb, int64_t g, int h, const ActBlock* act, int64_t t0,
                 const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy) {
  __m256 acc[TN];
#pragma GCC unroll 16
  for (int t = 0; t < TN; ++t) acc[t] = _mm256_setzero_ps();
  Half w;
  for (int64_t b = 0; b < nb; ++b) {
    decode<F>(units + (g * nb + b) * ub, h, w);
#pragma GCC unroll 16
    for (int t = 0; t < TN; ++t) {
      const ActBlock& a = act[(t0 + t) * nb + b];
      const __m256 s = _mm256_mul_ps(w.dw, _mm256_set1_ps(a.d));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_sums<F>(w, a)), s, acc[t]);
      if constexpr (F == FMT_Q4_1) acc[t] = _mm256_fmadd_ps(w.mw, _mm256_set1_ps(a.sd), acc[t]);
    }
  }
  const int64_t col = g * kUnitRows + h * kHalf;
#pragma GCC unroll 16
  for (int t = 0; t < TN; ++t) {
    __m256 v = acc[t];
    if (bias) v = _mm256_add_ps(v, _mm256_loadu_ps(bias + col));
    if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + (t0 + t) * ldr + col));
    _mm256_storeu_ps(y + (t0 + t) * ldy + col, v);
  }
}

template <int F, int TN>
void tail(const uint8_t* units, size_t ub, int64_t nb, int64_t g, int h, const ActBlock* act, int64_t t0,
          int64_t left, const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy) {
  if constexpr (TN > 0) {
    if (left == TN) return tile<F, TN>(units, ub, nb, g, h, act, t0, bias, residual, ldr, y, ldy);
    tail<F, TN - 1>(units, ub, nb, g, h, act, t0, left, bias, residual, ldr, y, ldy);
  }
}

template <int F>
void gemm(const uint8_t* units, int64_t nb, int64_t g0, int64_t g1, const ActBlock* act, int64_t n,
          const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy) {
  const size_t ub = unit_bytes(F);
  for (int64_t g = g0; g < g1; ++g) {
    for (int h = 0; h < 2; ++h) {
      int64_t t0 = 0;
      for (; t0 + kTileTokens <= n; t0 += kTileTokens)
        tile<F, kTileTokens>(units, ub, nb, g, h, act, t0, bias, residual, ldr, y, ldy);
      if (t0 < n) tail<F, kTileTokens - 1>(units, ub, nb, g, h, act, t0, n - t0, bias, residual, ldr, y, ldy);
    }
  }
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

inline float hmax_ps(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

void quantize(const float* x, int64_t n, int64_t k, int64_t ldx, ActBlock* act) {
  const int64_t nb = k / kBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i lim = _mm256_set1_epi32(127), nlim = _mm256_set1_epi32(-127);
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + t * ldx + b * kBlock;
      __m256 xs[4];
      __m256 m = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        xs[i] = _mm256_loadu_ps(v + 8 * i);
        m = _mm256_max_ps(m, _mm256_andnot_ps(sign, xs[i]));
      }
      const float amax = hmax_ps(m);
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      const __m256 vid = _mm256_set1_ps(id);
      ActBlock& out = act[t * nb + b];
      int s[2] = {0, 0};
      for (int i = 0; i < 4; ++i) {
        __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(xs[i], vid));
        q = _mm256_max_epi32(_mm256_min_epi32(q, lim), nlim);
        s[i / 2] += hsum_epi32(q);
        alignas(32) int32_t lanes[8];
        _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), q);
        for (int e = 0; e < 8; ++e) out.q[8 * i + e] = static_cast<int8_t>(lanes[e]);
      }
      out.d = amax / 127.0f;
      out.s16[0] = static_cast<int16_t>(s[0]);
      out.s16[1] = static_cast<int16_t>(s[1]);
      out.sd = out.d * static_cast<float>(s[0] + s[1]);
      out.pad = 0;
    }
  }
}

}  // namespace
}  // namespace specserve::avx2
#pragma GCC pop_options

namespace specserve {

const GemmKernels& gemm_kernels_avx2() {
  static const GemmKernels k = [] {
    GemmKernels t{};
    t.quantize = avx2::quantize;
    t.gemm[FMT_Q4_0] = avx2::gemm<FMT_Q4_0>;
    t.gemm[FMT_Q4_1] = avx2::gemm<FMT_Q4_1>;
    t.gemm[FMT_Q8_0] = avx2::gemm<FMT_Q8_0>;
    return t;
  }();
  return k;
}

}  // namespace specserve
#endif
