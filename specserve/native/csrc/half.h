// IEEE half precision to float (exact) and back (rounded to nearest even), for generic code;
// SIMD levels use F16C.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace specserve {

inline uint16_t load_half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return h;
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (mant << 13);  // inf / nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;  // signed zero
  } else {  // subnormal half: normalise
    int e = -1;
    do {
      ++e;
      mant <<= 1;
    } while ((mant & 0x400) == 0);
    bits = sign | ((112 - e) << 23) | ((mant & 0x3FF) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// Rounded to nearest, ties to even, as numpy's astype(float16) and ggml's conversion: halfway
// past the largest half (65520 and up) to infinity, below 2^-14 to a subnormal half.
inline uint16_t float_to_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t a = x & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00;  // nan
  if (a >= 0x477FF000u) return sign | 0x7C00;  // inf
  if (a < 0x38800000u) {  // a multiple of 2^-24: the product below is exact, the rounding nearest-even
    float v;
    std::memcpy(&v, &a, 4);
    return sign | static_cast<uint16_t>(std::nearbyint(v * 16777216.0f));
  }
  uint32_t h = (a >> 13) - (112u << 10);  // exponent rebiased from 127 to 15, mantissa truncated
  const uint32_t rest = a & 0x1FFFu;
  if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right too
  return sign | static_cast<uint16_t>(h);
}

inline void store_half(uint8_t* p, uint16_t h) { std::memcpy(p, &h, 2); }

}  // namespace specserve
