// Shared definitions of specserve's native kernels: CPU levels and the dispatch contract.
//
// A kernel family has one generic C++ implementation (any CPU) and optional ones for higher
// levels in *_avx2.cpp / *_avx512.cpp, all computing the same bits: the arithmetic of each
// kernel is defined once (in its header) as a sequence of exact integer sums and IEEE float
// operations, with fused multiply-adds written out, and every level performs that sequence.
#pragma once

#include <array>
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

// The function tables of every CPU level, built once: each entry the level's own or, where the
// level (or this build) has none, the next lower level's. Own(l) is level l's own table or null;
// Table::overlay(t) takes t's non-null entries. Used by the generic dispatch code only (the
// level's own tables are constant data, so building these runs no code of a higher level).
template <class Table, const Table* (*Own)(int)>
const Table& level_table(int level) {
  static const std::array<Table, LEVEL_AMX + 1> tables = [] {
    std::array<Table, LEVEL_AMX + 1> t{};
    for (int l = LEVEL_GENERIC; l <= LEVEL_AMX; ++l)
      for (int k = LEVEL_GENERIC; k <= l; ++k)
        if (const Table* own = Own(k)) t[l].overlay(*own);
    return t;
  }();
  return tables[level];
}

}  // namespace specserve
