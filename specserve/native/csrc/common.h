// Shared definitions of specserve's native kernels: CPU levels and the dispatch contract.
//
// A kernel family has one generic C++ implementation (any CPU) and optional ones for higher
// levels in *_avx2.cpp / *_avx512.cpp, all computing the same bits: the arithmetic of each
// kernel is defined once (in its header) as a sequence of exact integer sums and IEEE float
// operations, with fused multiply-adds written out, and every level performs that sequence.
#pragma once

#include <cstdint>

namespace specserve {

// The ladder of specserve.hardware.Isa; the values cross the Python boundary as ints.
enum Level : int {
  LEVEL_GENERIC = 0,
  LEVEL_AVX2 = 1,
  LEVEL_AVX512 = 2,
  LEVEL_AVX512_VNNI = 3,
  LEVEL_AVX512_BF16 = 4,
  LEVEL_AMX = 5,
};

// For the small pieces of a kernel's inner loop, which GCC's size heuristics would otherwise
// leave as calls once a kernel template grows.
#define SPECSERVE_INLINE inline __attribute__((always_inline))

#if defined(__x86_64__) || defined(_M_X64)
constexpr bool kX86 = true;
#else
constexpr bool kX86 = false;
#endif

}  // namespace specserve
