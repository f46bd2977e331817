// The exponential race that draws a sampled token (specserve/sample/sampler.py), natively.
//
// Row b's winner is argmax_i p[i] / E[i] (the first such i on ties), where E[i] = -log(u[i]) in
// float64 and u[i] = (splitmix64 output i + 1 of the stream keyed by key[b]) >> 11, times 2^-53:
// state_i = key + (i + 1) * 0x9E3779B97F4A7C15 (mod 2^64), then splitmix64's finaliser. This is
// specserve.sample.noise's definition; the torch code there computes the same u.
//
// Why it is cheap: -log(u) >= 1 - u, so a token whose p[i] / (1 - u[i]) is below the best score
// found so far cannot win, and 1 - u[i] needs only the hash and an exact conversion. The logs
// are taken only for the few tokens that pass that bound (about 1 / max(p) of them), starting
// from the exact score of the most probable token. The bound is loosened by one part in 10^9,
// far more than a log's rounding, so the tokens it leaves out score strictly below the winner:
// the result is exactly the full race's, at every level (the bound's test is one IEEE product
// and comparison; the scores of the tokens that pass are computed by one scalar function, with
// the C library's log: torch's vectorised log may differ from it in the last place, which could
// change a winner only where two tokens' scores tie to one part in 2^52).
#pragma once

#include <cstdint>

#include "common.h"

namespace specserve {

constexpr uint64_t kRaceGamma = 0x9E3779B97F4A7C15ull;

// splitmix64's output function.
inline uint64_t race_mix(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Token i's 53 random bits k (u = k * 2^-53) in the stream `key`.
inline uint64_t race_bits(uint64_t key, int64_t i) {
  return race_mix(key + static_cast<uint64_t>(i + 1) * kRaceGamma) >> 11;
}

// 1 - u for the 53 bits k: exact (2^53 - k is an integer of at most 53 bits).
inline double race_one_minus_u(uint64_t k) { return static_cast<double>((1ull << 53) - k) * 0x1p-53; }

// p / -log(k * 2^-53) in float64: the exact score (0 where k is 0: E is infinite).
double race_score(float p, uint64_t k);

// The largest score among tokens [0, v) of one row and its index (the first on ties).
struct RaceBest {
  double score;
  int64_t index;
};

// Scores token i exactly when p[i] could beat best (the bound above) and keeps the better one.
inline void race_consider(const float* p, uint64_t key, int64_t i, RaceBest& best) {
  const double s = race_score(p[i], race_bits(key, i));
  if (s > best.score || (s == best.score && i < best.index)) best = {s, i};
}

// The bound's threshold for a best score: a token needs p > threshold * (1 - u) to be scored.
inline double race_threshold(double best) { return best * (1.0 - 1e-9); }

// The index of the largest p among [0, v) (the first of equals), in plain C++.
inline int64_t race_top_scalar(const float* p, int64_t v) {
  int64_t top = 0;
  for (int64_t i = 1; i < v; ++i)
    if (p[i] > p[top]) top = i;
  return top;
}

// The scan over tokens [from, v) skipping `skip` in plain C++: the generic level's whole scan, and
// a SIMD level's tail.
inline void race_scan_scalar(const float* p, int64_t from, int64_t v, uint64_t key, int64_t skip, RaceBest& best) {
  for (int64_t i = from; i < v; ++i) {
    if (i == skip) continue;
    if (static_cast<double>(p[i]) > race_threshold(best.score) * race_one_minus_u(race_bits(key, i)))
      race_consider(p, key, i, best);
  }
}

// The race of rows [0, n) of p (row stride ld, v tokens each) with keys[b]: out[b] the winner.
void race_rows(int level, const float* p, int64_t ld, int64_t n, int64_t v, const uint64_t* keys, int64_t* out);

namespace avx512 {
// The index of the largest p (the first of equals; any index would do: it only starts the bound).
int64_t race_top(const float* p, int64_t v);
// The scan over [0, v) skipping `skip` (whose score best already holds) at AVX-512 (DQ) level.
void race_scan(const float* p, int64_t v, uint64_t key, int64_t skip, RaceBest& best);
}  // namespace avx512

}  // namespace specserve
