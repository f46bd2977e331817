// AVX-512 level of the layer kernels: one __m512 is layer_ops.h's 16 lanes. Nothing here runs
// unless the dispatch in layer_ops.cpp found the level (see native/__init__.py for why these
// files use intrinsics and plain arrays only).
#include <cstdint>

#include "layer_ops_kernels.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
namespace specserve::avx512 {
namespace {

constexpr int kScoreVecs = 2;  // 2 row vectors x 2 keys: 4 lane trees of ~5 partial sums, + 2 q vectors
constexpr int kScoreKeys = 2;
constexpr int kRowTile = 4;     // 4 rows x 4 chunks = 16 accumulators, + 4 value chunks
// Attention tiles of fewer rows go row by row (layer_ops_simd.inc): up to 15 rows (a 5-token
// verification of 3 query heads per kv head) the rows read the pool's halves faster than a tile
// widens each key block for them (Zen 4, 1000-2000 tokens of context: 3- and 5-token passes
// 0.83-0.92x the time with 8 here, in the ratio to one token); at 27 rows the tile is faster again.
constexpr int64_t kSmallTile = 16;
constexpr int kChunkGroup = 4;

using V = __m512;
inline V vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, V a) { _mm512_storeu_ps(p, a); }
inline V vload_half(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void vstore_half(uint16_t* p, V a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(a, _MM_FROUND_TO_NEAREST_INT));
}
inline V vset1(float a) { return _mm512_set1_ps(a); }
inline V vadd(V a, V b) { return _mm512_add_ps(a, b); }
inline V vsub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V vmul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V vdiv(V a, V b) { return _mm512_div_ps(a, b); }
inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V vmax(V a, V b) { return _mm512_max_ps(a, b); }
inline V vmin(V a, V b) { return _mm512_min_ps(a, b); }
inline V vneg(V a) { return _mm512_xor_ps(a, _mm512_set1_ps(-0.0f)); }
inline V vsel_lt(V a, V b, V x, V y) { return _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(a, b, _CMP_LT_OQ), x); }
inline float vmax_all(V a) { return _mm512_reduce_max_ps(a); }

// s[l] += s[l + 8], s[l] += s[l + 4], s[l] += s[l + 2], s[0] += s[1].
inline float vsum_tree(V s) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_shuffle_ps(c, c, 1)));
}

// p * 2^n with n from the bits of k = n + kRoundInt, in two normal factors; x < kExpLo: 0; NaN: x.
inline V vexp_finish(V x, V p, V k) {
  const __m512i n = _mm512_sub_epi32(_mm512_castps_si512(k), _mm512_set1_epi32(bits_of(kRoundInt)));
  const __m512i n1 = _mm512_srai_epi32(n, 1), n2 = _mm512_sub_epi32(n, n1), bias = _mm512_set1_epi32(127);
  const V s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n1, bias), 23));
  const V s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(n2, bias), 23));
  const V y = _mm512_mul_ps(_mm512_mul_ps(p, s1), s2);
  const V y0 = _mm512_mask_mov_ps(y, _mm512_cmp_ps_mask(x, vset1(kExpLo), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(y0, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), x);
}

// dst[r][j] = dot16(q[r], kp[j]) * scale for R rows and 16 keys, each key chunk widened once for
// the R rows. Per row, a register of 16 lanes per key, then the lane reductions of all 16 keys
// at once, each step pairing vectors so that a lane l meets lane l + w of the same key:
// accumulator j holds key 4 (j % 4) + j / 4, which the four steps leave in lane j. The keys go
// 4 at a time (accumulators 4g .. 4g + 3: keys g, 4 + g, 8 + g, 12 + g), taken two steps down
// to one register each (R x 4 accumulators and R x 4 partial registers fit 32 for R = 3).
template <int R, int D>
inline void scores16_rows(const float* const* q, const uint16_t* const* kp, int64_t d, float scale,
                          float* const* dst) {
  const int64_t dd = D > 0 ? D : d;
  V part[R][4];
#pragma GCC unroll 4
  for (int g = 0; g < 4; ++g) {
    const uint16_t* k[4];
    V acc[R][4];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i) {
      k[i] = kp[4 * i + g];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][i] = _mm512_setzero_ps();
    }
#pragma GCC unroll 8
    for (int64_t c = 0; c < dd; c += 16) {
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) {
        const V kv = vload_half(k[i] + c);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][i] = vfma(vload(q[r] + c), kv, acc[r][i]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {  // lanes 0-7 + 8-15, then 0-3 + 4-7
      const V a0 = vadd(_mm512_shuffle_f32x4(acc[r][0], acc[r][1], 0x44), _mm512_shuffle_f32x4(acc[r][0], acc[r][1], 0xEE));
      const V a1 = vadd(_mm512_shuffle_f32x4(acc[r][2], acc[r][3], 0x44), _mm512_shuffle_f32x4(acc[r][2], acc[r][3], 0xEE));
      part[r][g] = vadd(_mm512_shuffle_f32x4(a0, a1, 0x88), _mm512_shuffle_f32x4(a0, a1, 0xDD));
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {  // lanes 0-1 + 2-3, then lane 0 + 1
    const V b0 = vadd(_mm512_shuffle_ps(part[r][0], part[r][1], 0x44), _mm512_shuffle_ps(part[r][0], part[r][1], 0xEE));
    const V b1 = vadd(_mm512_shuffle_ps(part[r][2], part[r][3], 0x44), _mm512_shuffle_ps(part[r][2], part[r][3], 0xEE));
    const V sum = vadd(_mm512_shuffle_ps(b0, b1, 0x88), _mm512_shuffle_ps(b0, b1, 0xDD));
    vstore(dst[r], vmul(sum, vset1(scale)));
  }
}

// A row-by-row tile's scores for `rows` <= kScoreRows rows and 16 keys (layer_ops_simd.inc).
constexpr int kScoreRows = 3;
template <int D>
inline void scores_rows(const float* const* q, int64_t rows, const uint16_t* const* kp, int64_t d, float scale,
                        float* const* dst) {
  if (rows == 3) return scores16_rows<3, D>(q, kp, d, scale, dst);
  if (rows == 2) return scores16_rows<2, D>(q, kp, d, scale, dst);
  scores16_rows<1, D>(q, kp, d, scale, dst);
}

#include "layer_ops_simd.inc"

}  // namespace
}  // namespace specserve::avx512
#pragma GCC pop_options

namespace specserve {

const LayerKernels& layer_kernels_avx512() { return avx512::kKernels; }

}  // namespace specserve
#endif
