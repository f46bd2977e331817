// AVX2 level of the quantized products (vpmaddubsw + vpmaddwd). A 256-bit register holds one
// 4-element group of 8 rows, so a unit's 16 rows are done as two sets of 8; each row's
// arithmetic is qgemm.h's, the same as every other level's (qgemm_simd.inc).
#include <cstdint>
#include <cstring>

#include "qgemm.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace specserve::avx2 {
namespace {

// ---- the operations qgemm_simd.inc is written in ----------------------------------------------

constexpr int kRows = 8;
constexpr int kTileTokens = 4;
// Formats whose int16 runs are 2 or more groups long (all but Q8_0 and IQ4_NL): a product of 5
// or 6 rows costs 0.72-0.86x its 4 + 1 / 4 + 2 tiles (Q6_K: 5 rows 0.75-0.83x, 6 rows 0.92-0.96x;
// one thread, 16384 x 2048 weights).
constexpr int kWholeRunTileTokens = 6;
constexpr bool kScaleInDot = true;
constexpr bool kGroupMajor = true;  // 16 registers
constexpr int kQ8Bias = 0;
using VI = __m256i;
using VF = __m256;
using Q8Sign = __m256i;  // the signed weights themselves (vpsignb takes their signs)

inline VI load_groups(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VF load_halfs(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI load_u8(const uint8_t* p) { return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI load_i8(const uint8_t* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))); }
inline VI bcst4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline VI bcst16(const int8_t* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline VI lookup16(VI table, VI v) { return _mm256_shuffle_epi8(table, v); }
inline VI set1_epi8(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
inline VI set1_epi16(int v) { return _mm256_set1_epi16(static_cast<int16_t>(v)); }
inline VI set1_epi32(int v) { return _mm256_set1_epi32(v); }
inline VI and_(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI or_(VI a, VI b) { return _mm256_or_si256(a, b); }
inline VI add32(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI mullo32(VI a, VI b) { return _mm256_mullo_epi32(a, b); }
inline VI madd16(VI a, VI b) { return _mm256_madd_epi16(a, b); }
inline VI shl16(VI v, int n) { return _mm256_slli_epi16(v, n); }
inline VI shr16(VI v, int n) { return _mm256_srli_epi16(v, n); }
inline VI shl32(VI v, int n) { return _mm256_slli_epi32(v, n); }
inline VI dot4(VI acc, VI w, VI a, VI scale) {  // |w| <= 128, |a| <= 127: no saturation
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), scale));
}
inline VI pairs16(VI w, VI a) { return _mm256_maddubs_epi16(w, a); }
inline VI add16(VI a, VI b) { return _mm256_add_epi16(a, b); }
inline void pin(VI& v) { __asm__("" : "+x"(v)); }
inline void q8_weights(VI q, VI& w, Q8Sign& sign) {
  w = _mm256_abs_epi8(q);
  sign = q;
}
inline VI q8_act(VI a, Q8Sign sign) { return _mm256_sign_epi8(a, sign); }
inline VF zero_ps() { return _mm256_setzero_ps(); }
inline VF set1_ps(float v) { return _mm256_set1_ps(v); }
inline VF mul_ps(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF fmadd_ps(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF add_ps(VF a, VF b) { return _mm256_add_ps(a, b); }
inline VF neg_ps(VF a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
inline VF cvt_ps(VI a) { return _mm256_cvtepi32_ps(a); }
inline VF loadu_ps(const float* p) { return _mm256_loadu_ps(p); }
inline void storeu_ps(float* p, VF v) { _mm256_storeu_ps(p, v); }

}  // namespace

#include "qgemm_simd.inc"

namespace {

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
  // Saturating packs interleave 128-bit halves: q0[0..3] q1[0..3] q2[0..3] q3[0..3] | q0[4..7] ...;
  // this dword order puts the 32 bytes back in element order (values within +-127 pack as they are).
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
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
      __m256i q[4];
      for (int i = 0; i < 4; ++i)
        q[i] = _mm256_max_epi32(_mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(xs[i], vid)), lim), nlim);
      const __m256i bytes = _mm256_permutevar8x32_epi32(
          _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3])), order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q), bytes);
      const int s0 = hsum_epi32(_mm256_add_epi32(q[0], q[1])), s1 = hsum_epi32(_mm256_add_epi32(q[2], q[3]));
      out.d = amax / 127.0f;
      out.s16[0] = static_cast<int16_t>(s0);
      out.s16[1] = static_cast<int16_t>(s1);
      out.sd = out.d * static_cast<float>(s0 + s1);
      out.pad = 0;
    }
  }
}

}  // namespace
}  // namespace specserve::avx2
#pragma GCC pop_options

namespace specserve {

const GemmKernels& gemm_kernels_avx2() {
  static const GemmKernels k = make_gemm_kernels(avx2::quantize, avx2::kGemms, avx2::kNumGemms);
  return k;
}

}  // namespace specserve
#endif
