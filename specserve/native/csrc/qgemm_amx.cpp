// AMX level of the quantized products (Sapphire Rapids and later): qgemm.h's arithmetic with the
// block sums taken by the tile unit. Nothing here runs unless the dispatch in qgemm.cpp found
// the level and the kernel granted this process the tile state (amx_permitted).
//
// Why tiles: a product of 16 weight rows with T activation rows is compute-bound on vpdpbusd
// from T ~ 4 on (each token needs 8 of them per 16 x 32 unit), which is what makes a
// verification pass of 9 or 17 tokens cost 1.5-2.5x a one-token pass. One TDPBSSD takes the block
// sums of up to 16 tokens x 16 rows at once (8192 int8 products); the float epilogue of qgemm.h's
// sequence (convert, scale, fma) then runs per token on the 16 rows' exact int32 sums, as the VNNI
// kernel does, so every token's result has the same bits at every level.
//
// Only Q8_0, whose unit is already the tile's layout (8 groups of the 16 rows' 4 elements, 64
// bytes apart): B loads straight from the weights. The 4-bit formats would first be unpacked to
// bytes through memory, and a tile load waits for those stores; measured on a Xeon with AMX (2
// threads, 3072 x 576 Q4_1), that and the per-block epilogue left them no faster than VNNI at any
// token count (16 tokens 94 vs 93 us, 256 tokens 1361 vs 1420), while Q8_0 gains 1.3-1.8x from 9
// tokens on (the 49152 x 576 head: 9 tokens 723 vs 922 us, 16 tokens 846 vs 1494). Below 8 tokens,
// and for the other formats, the table falls back to the VNNI kernels.
//
// Per unit row g and token tile (n split into ceil(n / 16) tiles of near-equal size, so that no
// token is left to a second pass over the weights):
//   B  [8 x 64 bytes]: the unit's int8 groups
//   A  [m x 32 bytes]: the m tokens' quantized block, rows nb * 48 bytes apart (ActBlock)
//   C  [m x 16 int32] = A . B^T, stored and read back by the epilogue
#include <cstdint>
#include <cstring>

#include "qgemm.h"

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma,amx-tile,amx-int8")
namespace specserve::amx {
#define QG_VNNI 1
#include "qgemm_avx512.inc"
#undef QG_VNNI

namespace {

// Fewer tokens than this go to the VNNI kernel (measured: at 5 tokens the tiles' fixed cost, their
// loads and the C store and read-back, is still more than the dot products they save).
constexpr int64_t kMinTileTokens = 8;
constexpr int kTileM = 16;

// Palette 1, in pairs, one for even blocks and one for odd ones: tiles 0 and 1 the sums C
// [m x 16 int32], 2 and 3 the activations A [m x 32 bytes], 4 and 5 the weights B [8 x 64 bytes].
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64, "the tile configuration is 64 bytes");

void configure(int m) {
  TileConfig c;
  for (int p = 0; p < 2; ++p) {
    c.rows[p] = static_cast<uint8_t>(m), c.colsb[p] = 64;
    c.rows[2 + p] = static_cast<uint8_t>(m), c.colsb[2 + p] = kBlock;
    c.rows[4 + p] = 8, c.colsb[4 + p] = 64;
  }
  _tile_loadconfig(&c);
}

// C = A . B for block b of the unit row starting at `row` (tiles of one parity; GCC's intrinsics
// paste their register numbers into the instruction, so they are written out twice), stored as
// [m][16] int32 in c.
#define SPECSERVE_DOT_TILE(C, A, B)       \
  _tile_loadd(B, row + b * ub, 64);       \
  _tile_loadd(A, a[b].q, a_stride);       \
  _tile_zero(C);                          \
  _tile_dpbssd(C, A, B);                  \
  _tile_stored(C, c, 64)

template <int P>
SPECSERVE_INLINE void dot_tile(const uint8_t* row, int64_t ub, int64_t b, const ActBlock* a, int64_t a_stride,
                               int32_t* c) {
  if constexpr (P == 0) {
    SPECSERVE_DOT_TILE(0, 2, 4);
  } else {
    SPECSERVE_DOT_TILE(1, 3, 5);
  }
}
#undef SPECSERVE_DOT_TILE

// qgemm.h's epilogue for block b: the m tokens' exact sums converted, scaled and accumulated.
SPECSERVE_INLINE void epilogue(const int32_t* c, const uint8_t* unit, const ActBlock* a, int64_t nb, int m, VF* acc) {
  const VF dw = load_halfs(unit + unit_layout(FMT_Q8_0).scales);
#pragma GCC unroll 16
  for (int t = 0; t < kTileM; ++t) {
    if (t < m)  // unrolled with constant indices, so the accumulators stay in registers
      acc[t] = fmadd_ps(cvt_ps(_mm512_load_si512(c + 16 * t)), mul_ps(dw, set1_ps(a[t * nb].d)), acc[t]);
  }
}

// m tokens (t0 ..) of unit row g, software-pipelined: the tile unit sums block b + 1 while the
// vector units run block b's epilogue.
void tile_rows(const uint8_t* units, int64_t nb, int64_t g, const ActBlock* act, int64_t t0, int m, const float* bias,
               const float* residual, int64_t ldr, float* y, int64_t ldy) {
  constexpr int64_t ub = static_cast<int64_t>(unit_bytes(FMT_Q8_0));
  VF acc[kTileM];
#pragma GCC unroll 16
  for (int t = 0; t < kTileM; ++t) acc[t] = zero_ps();
  alignas(64) int32_t c[2][kTileM * 16];
  const int64_t stride = nb * static_cast<int64_t>(sizeof(ActBlock));
  const ActBlock* a = act + t0 * nb;
  const uint8_t* row = units + g * nb * ub;
  for (int64_t b = 0; b < nb; b += 2) {
    const char* ahead = reinterpret_cast<const char*>(row + (b + kPrefetchUnits) * ub);
    for (int64_t off = 0; off < 2 * ub; off += 64) _mm_prefetch(ahead + off, _MM_HINT_T0);
    dot_tile<0>(row, ub, b, a, stride, c[0]);
    if (b > 0) epilogue(c[1], row + (b - 1) * ub, a + b - 1, nb, m, acc);
    if (b + 1 < nb) dot_tile<1>(row, ub, b + 1, a, stride, c[1]);
    epilogue(c[0], row + b * ub, a + b, nb, m, acc);
    if (b + 2 >= nb && b + 1 < nb) epilogue(c[1], row + (b + 1) * ub, a + b + 1, nb, m, acc);
  }
  const int64_t col = g * kUnitRows;
#pragma GCC unroll 16
  for (int t = 0; t < kTileM; ++t) {
    if (t < m) {
      VF v = acc[t];
      if (bias) v = add_ps(v, loadu_ps(bias + col));
      if (residual) v = add_ps(v, loadu_ps(residual + (t0 + t) * ldr + col));
      storeu_ps(y + (t0 + t) * ldy + col, v);
    }
  }
}

void gemm_q8_0(const uint8_t* units, int64_t nb, int64_t g0, int64_t g1, const ActBlock* act, int64_t n,
               const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy) {
  if (n < kMinTileTokens) return gemm<FMT_Q8_0>(units, nb, g0, g1, act, n, bias, residual, ldr, y, ldy);
  // k tiles of `size` tokens but the first, of `first` <= size: the tiles are configured for
  // `size` rows, so the first one's A and C cover the next tile's first rows too (real tokens,
  // whose extra sums its epilogue leaves alone), and no load reaches past the last token.
  const int64_t k = (n + kTileM - 1) / kTileM;
  const int size = static_cast<int>((n + k - 1) / k);
  const int first = static_cast<int>(n - (k - 1) * size);
  configure(size);
  for (int64_t g = g0; g < g1; ++g) {
    tile_rows(units, nb, g, act, 0, first, bias, residual, ldr, y, ldy);
    for (int64_t t0 = first; t0 < n; t0 += size) tile_rows(units, nb, g, act, t0, size, bias, residual, ldr, y, ldy);
  }
  _tile_release();  // the tile state back to its initial state: cheaper context switches
}

constexpr GemmEntry kAmxGemms[] = {{FMT_Q8_0, gemm_q8_0}};

}  // namespace
}  // namespace specserve::amx
#pragma GCC pop_options

namespace specserve {

bool amx_permitted() {
  // Linux hands out the tile state (8 KB of registers per thread) only to processes that ask.
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  static const bool ok = syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  return ok;
}

const GemmKernels& gemm_kernels_amx() {
  static const GemmKernels k = make_gemm_kernels(
      amx::quantize, amx::kAmxGemms, static_cast<int>(sizeof(amx::kAmxGemms) / sizeof(amx::kAmxGemms[0])));
  return k;
}

}  // namespace specserve
#endif
