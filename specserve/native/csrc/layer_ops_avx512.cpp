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

// dst[j] = dot16(q, kp[j]) * scale for 16 keys: a register of 16 lanes per key, then the lane
// reductions of all 16 keys at once, each step pairing vectors so that a lane l meets lane
// l + w of the same key. Accumulator j holds key 4 (j % 4) + j / 4, which the four steps
// leave in lane j.
inline void scores16(const float* q, const uint16_t* const* kp, int64_t d, float scale, float* dst) {
  const uint16_t* k[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) k[j] = kp[4 * (j % 4) + j / 4];
  V acc[16];
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
#pragma GCC unroll 16
  for (int j = 0; j < 16; ++j)  // key by key: one key pointer live at a time, q in registers
    for (int64_t c = 0; c < d; c += 16) acc[j] = vfma(vload(q + c), vload_half(k[j] + c), acc[j]);
  V a8[8], a4[4], a2[2];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i)  // lanes 0-7 + 8-15 of keys 2i, 2i + 1
    a8[i] = vadd(_mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0x44),
                 _mm512_shuffle_f32x4(acc[2 * i], acc[2 * i + 1], 0xEE));
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i)  // lanes 0-3 + 4-7 of keys 4i .. 4i + 3
    a4[i] = vadd(_mm512_shuffle_f32x4(a8[2 * i], a8[2 * i + 1], 0x88),
                 _mm512_shuffle_f32x4(a8[2 * i], a8[2 * i + 1], 0xDD));
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i)  // lanes 0-1 + 2-3
    a2[i] = vadd(_mm512_shuffle_ps(a4[2 * i], a4[2 * i + 1], 0x44), _mm512_shuffle_ps(a4[2 * i], a4[2 * i + 1], 0xEE));
  const V s = vadd(_mm512_shuffle_ps(a2[0], a2[1], 0x88), _mm512_shuffle_ps(a2[0], a2[1], 0xDD));  // lane 0 + 1
  vstore(dst, vmul(s, vset1(scale)));
}

#include "layer_ops_simd.inc"

}  // namespace
}  // namespace specserve::avx512
#pragma GCC pop_options

namespace specserve {

const LayerKernels& layer_kernels_avx512() { return avx512::kKernels; }

}  // namespace specserve
#endif
