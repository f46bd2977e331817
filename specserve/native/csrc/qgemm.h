// Quantized matrix products: y[t, r] = sum_k W[r, k] x[t, k] on GGUF block formats.
//
// Weights keep their GGUF bits (4-bit, 5-bit, 6-bit or 8-bit values and their fp16 scales),
// repacked at load into "units": 16 consecutive rows x one 32-element block, laid out so that a
// SIMD register holds one 4-element group of all 16 rows and an integer dot-product
// instruction (VNNI vpdpbusd; AVX2 vpmaddubsw + vpmaddwd) gives the 16 rows' partial sums at
// once. Activations are quantized per row per 32-element block to int8 with a float scale
// (ActBlock), so the products inside a block are exact integer sums.
//
// The arithmetic, per weight row r and activation row t, is defined as:
//
//   acc = 0.0f
//   for each block b in order:
//     I = sum over the block's 32 elements of w[i] * a[i]        (exact, int32)
//     acc = fma((float)I, dw[b] * da[b], acc)                     (one rounding for the product, one for the fma)
//     if the format has a min:  acc = fma(mw[b], sd[b], acc)
//   y = acc (+ bias[r]) (+ residual[t, r]), added in that order
//
// where w[i] is the format's integer weight value (see the table below), dw and mw its float
// scale and min, da the activation block's scale and sd = da * (float)sum(a). Every CPU level
// performs exactly this sequence, so a row's result never depends on which or how many other
// rows share the call (batch invariance) nor on the CPU level (the tests compare bits).
//
//   format  w[i]                    dw                 mw
//   Q4_0    q - 8 (q: 4 bits)       d                  -
//   Q4_1    q                       d                  m
//   Q8_0    q (int8)                d                  -
//   (K-quants are added by their own kernels with the same per-block sequence)
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"

namespace specserve {

constexpr int kBlock = 32;     // elements per quantization block
constexpr int kUnitRows = 16;  // weight rows per unit

// GGML type ids, as in the GGUF file.
enum Format : int {
  FMT_Q4_0 = 2,
  FMT_Q4_1 = 3,
  FMT_Q8_0 = 8,
};

// One 32-element block of one activation row. a[i] = d * q[i] approximately:
//   amax = max |x[i]|;  d = amax / 127;  id = amax ? 127 / amax : 0;  q[i] = nearbyint(x[i] * id)
//   s16[h] = sum of q over half h (elements 16h .. 16h+15);  sd = d * (float)(s16[0] + s16[1])
struct alignas(16) ActBlock {
  int8_t q[kBlock];
  float d;
  float sd;
  int16_t s16[2];
  int32_t pad;
};
static_assert(sizeof(ActBlock) == 48, "ActBlock is 48 bytes");

// Bytes of one unit (16 rows x 32 elements) of a format, and of one raw GGUF block (1 row x 32).
size_t unit_bytes(int format);
size_t gguf_block_bytes(int format);
bool format_supported(int format);

// Unit layouts (all little-endian, fp16 as IEEE half):
//   Q4_0: nib[4][16][4] u8 (256 B), d[16] fp16
//   Q4_1: nib[4][16][4] u8 (256 B), d[16] fp16, m[16] fp16
//   Q8_0: q[8][16][4] i8 (512 B), d[16] fp16
// nib[p][r][e]: low nibble = element 4p + e (group p), high nibble = element 16 + 4p + e
// (group p + 4) of row r. q[j][r][e] = element 4j + e of row r.

// Repack rows [0, rows) of raw GGUF data (rows x blocks_per_row blocks, row-major) into units
// [ceil(rows / 16)][blocks_per_row]; rows past `rows` in the last unit row are zero.
void repack_rows(int format, const uint8_t* raw, int64_t rows, int64_t blocks_per_row, uint8_t* out);

// Quantize rows [0, n) of x (row stride ldx floats, k a multiple of 32) into act[n][k / 32].
using QuantizeFn = void (*)(const float* x, int64_t n, int64_t k, int64_t ldx, ActBlock* act);

// y[t * ldy + r] for t in [0, n), r in unit rows [16 * g0, 16 * g1): the products of the
// packed weight (nb blocks per row) with act[n][nb]. bias (per row) and residual (row stride
// ldr) may be null; residual may alias y.
using GemmFn = void (*)(const uint8_t* units, int64_t nb, int64_t g0, int64_t g1, const ActBlock* act,
                        int64_t n, const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy);

struct GemmKernels {
  QuantizeFn quantize;
  GemmFn gemm[16];  // by format id; null where the level has no kernel for it
};

// The kernels of one level (null entries fall back to the next lower level's).
const GemmKernels& gemm_kernels_generic();
#if defined(__x86_64__) || defined(_M_X64)
const GemmKernels& gemm_kernels_avx2();
const GemmKernels& gemm_kernels_avx512();
const GemmKernels& gemm_kernels_avx512_vnni();
#endif

}  // namespace specserve
