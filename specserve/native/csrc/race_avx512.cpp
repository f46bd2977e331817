// AVX-512 (DQ) scan of the exponential race (race.h): eight tokens' hashes, 1 - u and bound test
// per step in 64-bit lanes; the few tokens that pass are scored by the shared scalar function.
// Nothing here runs unless race.cpp found the level (see native/__init__.py for why these files
// use intrinsics and plain arrays only).
#include <cstdint>

#include "race.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512vl,avx512bw")
namespace specserve::avx512 {

namespace {

inline __m512i mix8(__m512i z) {
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)), _mm512_set1_epi64(0xBF58476D1CE4E5B9ll));
  z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)), _mm512_set1_epi64(0x94D049BB133111EBll));
  return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

}  // namespace

int64_t race_top(const float* p, int64_t v) {
  if (v < 16) return race_top_scalar(p, v);
  __m512 m = _mm512_loadu_ps(p);
  int64_t i = 16;
  for (; i + 16 <= v; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(p + i));
  float most = _mm512_reduce_max_ps(m);
  for (; i < v; ++i) most = p[i] > most ? p[i] : most;
  for (int64_t j = 0; j < v; ++j)
    if (p[j] == most) return j;
  return 0;  // NaNs only: any start serves
}

void race_scan(const float* p, int64_t v, uint64_t key, int64_t skip, RaceBest& best) {
  const __m512i lane = _mm512_set_epi64(8, 7, 6, 5, 4, 3, 2, 1);
  const __m512i step = _mm512_set1_epi64(static_cast<int64_t>(8 * kRaceGamma));
  const __m512i two53 = _mm512_set1_epi64(1ll << 53);
  const __m512d ulp = _mm512_set1_pd(0x1p-53);
  // state of token i: key + (i + 1) * gamma, lanes i .. i + 7
  __m512i state = _mm512_add_epi64(_mm512_set1_epi64(static_cast<int64_t>(key)),
                                   _mm512_mullo_epi64(lane, _mm512_set1_epi64(static_cast<int64_t>(kRaceGamma))));
  __m512d threshold = _mm512_set1_pd(race_threshold(best.score));
  int64_t i = 0;
  for (; i + 8 <= v; i += 8, state = _mm512_add_epi64(state, step)) {
    const __m512i k = _mm512_srli_epi64(mix8(state), 11);
    const __m512d t = _mm512_mul_pd(_mm512_cvtepu64_pd(_mm512_sub_epi64(two53, k)), ulp);  // 1 - u, exact
    const __m512d pd = _mm512_cvtps_pd(_mm256_loadu_ps(p + i));
    __mmask8 pass = _mm512_cmp_pd_mask(pd, _mm512_mul_pd(threshold, t), _CMP_GT_OQ);
    if (pass == 0) continue;
    for (; pass != 0; pass &= pass - 1) {
      const int64_t j = i + __builtin_ctz(pass);
      if (j != skip) race_consider(p, key, j, best);
    }
    threshold = _mm512_set1_pd(race_threshold(best.score));
  }
  race_scan_scalar(p, i, v, key, skip, best);
}

}  // namespace specserve::avx512
#pragma GCC pop_options
#endif
