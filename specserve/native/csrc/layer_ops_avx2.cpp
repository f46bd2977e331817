// AVX2 level of the layer kernels: layer_ops.h's 16 lanes are two __m256 (lanes 0-7 and 8-15),
// so its first lane reduction, s[l] += s[l + 8], is the sum of the two halves.
#include <cstdint>

#include "layer_ops_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace specserve::avx2 {
namespace {

constexpr int kScoreVecs = 1;  // 1 row vector x 1 key: the lane tree's ~5 partial sums of 2 registers
constexpr int kScoreKeys = 1;
constexpr int kRowTile = 2;  // 2 rows x 2 chunks = 8 accumulators (of 16 registers), + 4 value halves
constexpr int kChunkGroup = 2;
// Attention tiles of fewer rows take the row-by-row path: with two registers to a 16-row vector,
// a 9-15 row tile of the transposed path computed 16 lanes and widened every key for few rows
// (the embedded model's 3- and 5-token verification, 9 and 15 rows a kv head: passes 0.91-0.92x
// and 0.91-0.94x the time with 16 than with 8; 32 gained nothing at 27 and 51 rows).
constexpr int64_t kSmallTile = 16;

struct V {
  __m256 lo, hi;
};
inline V vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void vstore(float* p, V a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline V vload_half(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void vstore_half(uint16_t* p, V a) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(a.lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph(a.hi, _MM_FROUND_TO_NEAREST_INT));
}
inline V vset1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V vadd(V a, V b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V vsub(V a, V b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V vmul(V a, V b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V vdiv(V a, V b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V vfma(V a, V b, V c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V vmax(V a, V b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V vmin(V a, V b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V vneg(V a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_xor_ps(a.lo, sign), _mm256_xor_ps(a.hi, sign)};
}
inline V vsel_lt(V a, V b, V x, V y) {
  return {_mm256_blendv_ps(y.lo, x.lo, _mm256_cmp_ps(a.lo, b.lo, _CMP_LT_OQ)),
          _mm256_blendv_ps(y.hi, x.hi, _mm256_cmp_ps(a.hi, b.hi, _CMP_LT_OQ))};
}

// s[l] += s[l + 4], s[l] += s[l + 2], s[0] += s[1] within one __m256 of 8 lanes.
inline float sum_tree8(__m256 a) {
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

inline float vsum_tree(V s) { return sum_tree8(_mm256_add_ps(s.lo, s.hi)); }

inline float vmax_all(V a) {
  const __m256 m = _mm256_max_ps(a.lo, a.hi);
  __m128 b = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  b = _mm_max_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_max_ss(b, _mm_shuffle_ps(b, b, 1)));
}

inline __m256 exp_finish8(__m256 x, __m256 p, __m256 k) {
  const __m256i n = _mm256_sub_epi32(_mm256_castps_si256(k), _mm256_set1_epi32(bits_of(kRoundInt)));
  const __m256i n1 = _mm256_srai_epi32(n, 1), n2 = _mm256_sub_epi32(n, n1), bias = _mm256_set1_epi32(127);
  const __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n1, bias), 23));
  const __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(n2, bias), 23));
  const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, s1), s2);
  const __m256 y0 = _mm256_blendv_ps(y, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(kExpLo), _CMP_LT_OQ));
  return _mm256_blendv_ps(y0, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

// p * 2^n with n from the bits of k = n + kRoundInt, in two normal factors; x < kExpLo: 0; NaN: x.
inline V vexp_finish(V x, V p, V k) { return {exp_finish8(x.lo, p.lo, k.lo), exp_finish8(x.hi, p.hi, k.hi)}; }

// dst[j] = dot16(q, kp[j]) * scale for 16 keys, as two groups of 8. Per key the two halves of
// its 16 lanes are summed (s[l] += s[l + 8]); the other lane reductions are done for 8 keys at
// once, each step pairing vectors so that lane l meets lane l + w of the same key. Position i
// of a group holds key 4 (i % 2) + i / 2, which the steps leave in lane i. Keys are
// accumulated 4 at a time: 8 accumulators and a query chunk fit AVX2's 16 registers.
inline void scores16(const float* q, const uint16_t* const* kp, int64_t d, float scale, float* dst) {
  for (int h = 0; h < 2; ++h) {
    __m256 x[2];
    for (int sub = 0; sub < 2; ++sub) {
      const uint16_t* k[4];
      __m256 lo[4], hi[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const int pos = 4 * sub + i;
        k[i] = kp[8 * h + 4 * (pos % 2) + pos / 2];
        lo[i] = hi[i] = _mm256_setzero_ps();
      }
      for (int64_t c = 0; c < d; c += 16) {
        const __m256 ql = _mm256_loadu_ps(q + c), qh = _mm256_loadu_ps(q + c + 8);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
          const V ki = vload_half(k[i] + c);
          lo[i] = _mm256_fmadd_ps(ql, ki.lo, lo[i]);
          hi[i] = _mm256_fmadd_ps(qh, ki.hi, hi[i]);
        }
      }
      __m256 a[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) a[i] = _mm256_add_ps(lo[i], hi[i]);  // lanes 0-7 + 8-15
      const __m256 ab = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20), _mm256_permute2f128_ps(a[0], a[1], 0x31));
      const __m256 cd = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20), _mm256_permute2f128_ps(a[2], a[3], 0x31));
      x[sub] = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, 0x44), _mm256_shuffle_ps(ab, cd, 0xEE));  // lanes 0-1 + 2-3
    }
    const __m256 s = _mm256_add_ps(_mm256_shuffle_ps(x[0], x[1], 0x88), _mm256_shuffle_ps(x[0], x[1], 0xDD));
    _mm256_storeu_ps(dst + 8 * h, _mm256_mul_ps(s, _mm256_set1_ps(scale)));
  }
}

// A row-by-row tile's scores for `rows` <= kScoreRows rows and 16 keys (layer_ops_simd.inc):
// AVX2's 16 registers hold one row's accumulators.
constexpr int kScoreRows = 1;
template <int D>
inline void scores_rows(const float* const* q, int64_t rows, const uint16_t* const* kp, int64_t d, float scale,
                        float* const* dst) {
  for (int64_t r = 0; r < rows; ++r) scores16(q[r], kp, D > 0 ? D : d, scale, dst[r]);
}

#include "layer_ops_simd.inc"

}  // namespace
}  // namespace specserve::avx2
#pragma GCC pop_options

namespace specserve {

const LayerKernels& layer_kernels_avx2() { return avx2::kKernels; }

}  // namespace specserve
#endif
