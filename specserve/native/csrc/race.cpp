// The exponential race (race.h): the scalar definition every level shares, and the dispatch.
#include "race.h"

#include <cmath>

namespace specserve {

double race_score(float p, uint64_t k) {
  // k == 0: log(0) = -inf, E = inf, p / E = 0 (the torch definition's value too).
  return static_cast<double>(p) / -::log(static_cast<double>(k) * 0x1p-53);
}

namespace {

void race_scan_generic(const float* p, int64_t v, uint64_t key, int64_t skip, RaceBest& best) {
  race_scan_scalar(p, 0, v, key, skip, best);
}

}  // namespace

void race_rows(int level, const float* p, int64_t ld, int64_t n, int64_t v, const uint64_t* keys, int64_t* out) {
  int64_t (*top_of)(const float*, int64_t) = race_top_scalar;
  void (*scan)(const float*, int64_t, uint64_t, int64_t, RaceBest&) = race_scan_generic;
#if defined(__x86_64__) || defined(_M_X64)
  if (level >= LEVEL_AVX512) {
    top_of = avx512::race_top;
    scan = avx512::race_scan;
  }
#else
  (void)level;
#endif
  for (int64_t b = 0; b < n; ++b) {
    const float* row = p + b * ld;
    // The most probable token first: its exact score bounds the rest.
    const int64_t top = top_of(row, v);
    RaceBest best{race_score(row[top], race_bits(keys[b], top)), top};
    scan(row, v, keys[b], top, best);
    // Every score 0 (no token has p > 0 and a finite E): the full race's argmax is token 0.
    out[b] = best.score > 0.0 ? best.index : 0;
  }
}

}  // namespace specserve
