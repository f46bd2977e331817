// Quantized matrix products: y[t, r] = sum_k W[r, k] x[t, k] on GGUF block formats.
//
// Weights keep their GGUF bits (2-bit to 8-bit values and their fp16 scales), repacked at load
// into "units" of the same bytes as the rows' GGUF blocks, so that a pass reads what the file
// holds (Q3_K: 4% more, see its layout): 16 consecutive rows x one 32-element block, laid out so
// that a SIMD register holds one 4-element group of all 16 rows and an integer dot-product
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
//     if it has a min per half (Q2_K):  acc = fma((float)M, mw[b] * da[b], acc),  M = sum over h of m[h] * s16[h]  (exact)
//   y = acc (+ bias[r]) (+ residual[t, r]), added in that order
//
// where w[i] is the format's integer weight value (see the table below), dw and mw its float
// scale and min, da the activation block's scale and sd = da * (float)sum(a). Every CPU level
// performs exactly this sequence, so a row's result never depends on which or how many other
// rows share the call (batch invariance) nor on the CPU level (the tests compare bits).
//
//   format  w[i]                          dw                 mw
//   Q4_0    q - 8 (q: 4 bits)             d                  -
//   Q4_1    q                             d                  m
//   Q5_0    q - 16 (q: 5 bits)            d                  -
//   Q5_1    q (q: 5 bits)                 d                  m
//   Q8_0    q (int8)                      d                  -
//   IQ4_NL  kvalues[q] (q: 4 bits)        d                  -     (kvalues: GGUF's int8 table below)
//   Q2_K    sc[h] * q (sc, q: 4, 2 bits)  d (super-block)    -dmin (with m[h]: 4 bits, per half)
//   Q3_K    sc[h] * (q - 4) (q: 3 bits)   d (super-block)    -     (sc[h]: 6 bits less 32)
//   Q4_K    sc * q (sc: 6 bits, q: 4)     d (super-block)    -(dmin * m)  (m: 6 bits; the product is exact)
//   Q5_K    sc * q (sc: 6 bits, q: 5)     d (super-block)    -(dmin * m)
//   Q6_K    sc[h] * (q - 32) (q: 6 bits)  d (super-block)    -
//
// K-quants keep GGUF's 256-element super-blocks of 8 blocks: d and dmin are fp16 per super-block,
// sc and m per block (Q3_K, Q6_K: one int8 sc per 16-element half h of the block, i.e. element i
// of the block has sc[i / 16]). Their I needs the sub-scale product in int32 (|I| < 2^24 in every
// format), formed at each level as sum over halves h of sc[h] * (sum over the half of u[i] * a[i]
// - off * s16[h]), u the stored unsigned value and off its offset (Q3_K 4, Q4_0 8, Q5_0 16, Q6_K
// 32): the same exact integer, however a level groups the sums. Q8_0's and IQ4_NL's w[i] are signed int8
// (IQ4_NL's looked up from its nibble at each level), taken as Q8_0's are.
#pragma once

#include <cstddef>
#include <cstdint>

#include "common.h"
#include "half.h"

namespace specserve {

constexpr int kBlock = 32;     // elements per quantization block
constexpr int kUnitRows = 16;  // weight rows per unit

// GGML type ids, as in the GGUF file.
enum Format : int {
  FMT_Q4_0 = 2,
  FMT_Q4_1 = 3,
  FMT_Q5_0 = 6,
  FMT_Q5_1 = 7,
  FMT_Q8_0 = 8,
  FMT_Q2_K = 10,
  FMT_Q3_K = 11,
  FMT_Q4_K = 12,
  FMT_Q5_K = 13,
  FMT_Q6_K = 14,
  FMT_IQ4_NL = 20,
};

// IQ4_NL's non-linear 4-bit grid: a stored nibble q stands for kvalues[q] (ggml's kvalues_iq4nl).
constexpr int8_t kIq4nlValues[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

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

// Unit layouts (all little-endian, fp16 as IEEE half):
//   Q4_0: nib[4][16][4] u8 (256 B), d[16] fp16
//   Q4_1: nib[4][16][4] u8 (256 B), d[16] fp16, m[16] fp16
//   Q5_0: nib[4][16][4] u8, hb[16][4] u8, d[16] fp16                   (352 B)
//   Q5_1: nib[4][16][4] u8, hb[16][4] u8, d[16] fp16, m[16] fp16       (384 B)
//   Q8_0: q[8][16][4] i8 (512 B), d[16] fp16
//   IQ4_NL: nib[4][16][4] u8 (256 B), d[16] fp16 (the nibbles are kvalues' indices)
//   Q2_K: cr[2][16][4] u8, sm[2][16] u8                                (160 B)
//   Q3_K: cr[2][16][4] u8, hb[16][4] u8, sc[2][16] i8                 (224 B)
//   Q4_K: nib[4][16][4] u8, sc[16] u8, m[16] u8                        (288 B)
//   Q5_K: nib[4][16][4] u8, hb[16][4] u8, sc[16] u8, m[16] u8          (352 B)
//   Q6_K: nib[4][16][4] u8, hq[2][16][4] u8, sc[2][16] i8              (416 B)
// nib[p][r][e]: low nibble = element 4p + e (group p), high nibble = element 16 + 4p + e
// (group p + 4) of row r. q[j][r][e] = element 4j + e of row r. hb[r][e] bit j: the fifth bit
// (value 16) of element 4j + e (Q5_0, Q5_1, Q5_K). hq[k][r][e] bits 2j..2j+1: bits 4..5 of element
// 4(4k + j) + e, so plane k serves half k. sc[h][r]: the int8 scale of half h. cr[k][r][e] bits 2j..2j+1: bits
// 0..1 of element 4(4k + j) + e (Q3_K's low bits, laid out as Q6_K's hq), its hb bit j: bit 2 of
// element 4j + e; Q2_K's cr the same, its sm[h][r] half h's scale (low nibble) and min (high), as
// GGUF stores them. Q3_K's units hold 4 bytes more per 16 rows x 32 elements than its GGUF blocks
// (228 B against 220: its 6-bit scales as whole bytes, loaded as they are).
//
constexpr int kHighBits = 256;  // where Q5_*'s hb and Q6_K's hq begin: after nib[4][16][4]
constexpr int kQ3HighBits = 128;  // where Q3_K's hb begins: after cr[2][16][4]

// K-quant units come in super-units of 8 (16 rows x one 256-element super-block): a header with
// the 16 rows' d[16] fp16 (Q2_K, Q4_K, Q5_K: then dmin[16] fp16), then the 8 unit bodies above. A
// super-unit's bytes are 8 x unit_bytes, so a unit row of nb blocks still spans nb x unit_bytes.
struct UnitLayout {
  int body;    // bytes of one unit's body
  int header;  // bytes of a super-unit's header (0: no super-units)
  int blocks;  // units per super-unit: 1, or 8 for K-quants
  int gguf;    // bytes of one raw GGUF block of one row (32 elements, or 256 for K-quants)
  int scales;  // where the rows' scales begin in the body: fp16 d[16] (then m[16]) for the 32-element
               // formats, u8 / i8 sc[16] (then m[16], or Q6_K's second half's sc[16]) for K-quants
};

constexpr UnitLayout unit_layout(int format) {
  switch (format) {
    case FMT_Q4_0: return {256 + 32, 0, 1, 18, 256};
    case FMT_Q4_1: return {256 + 64, 0, 1, 20, 256};
    case FMT_Q5_0: return {256 + 64 + 32, 0, 1, 22, 320};
    case FMT_Q5_1: return {256 + 64 + 64, 0, 1, 24, 320};
    case FMT_Q8_0: return {512 + 32, 0, 1, 34, 512};
    case FMT_IQ4_NL: return {256 + 32, 0, 1, 18, 256};
    case FMT_Q2_K: return {128 + 32, 64, 8, 84, 128};
    case FMT_Q3_K: return {128 + 64 + 32, 32, 8, 110, 192};
    case FMT_Q4_K: return {256 + 32, 64, 8, 144, 256};
    case FMT_Q5_K: return {256 + 64 + 32, 64, 8, 176, 320};
    case FMT_Q6_K: return {256 + 128 + 32, 32, 8, 210, 384};
    default: return {0, 0, 1, 0, 0};
  }
}

// Bytes per unit (16 rows x 32 elements; a super-unit's header shared by its 8 units), and of one
// raw GGUF block (1 row x 32 or 256 elements).
constexpr size_t unit_bytes(int format) {
  return static_cast<size_t>(unit_layout(format).body + unit_layout(format).header / unit_layout(format).blocks);
}
constexpr size_t gguf_block_bytes(int format) { return static_cast<size_t>(unit_layout(format).gguf); }
constexpr int gguf_block_elements(int format) { return kBlock * unit_layout(format).blocks; }
constexpr bool format_supported(int format) { return unit_layout(format).body != 0; }
constexpr bool has_min(int format) {
  return format == FMT_Q4_1 || format == FMT_Q5_1 || format == FMT_Q4_K || format == FMT_Q5_K;
}
// Formats with a min per 16-element half (an integer m[h] times -dmin) instead of one per block.
constexpr bool has_half_mins(int format) { return format == FMT_Q2_K; }
// Formats whose units carry the fifth bits of their values in hb[16][4].
constexpr bool has_fifth_bit(int format) { return format == FMT_Q5_0 || format == FMT_Q5_1 || format == FMT_Q5_K; }

// Unit b of unit row g in a packed weight of nb blocks per row: its super-unit's header (K-quants)
// and its body.
SPECSERVE_INLINE const uint8_t* unit_header(int format, const uint8_t* units, int64_t nb, int64_t g, int64_t b) {
  return units + (g * nb + b - b % unit_layout(format).blocks) * unit_bytes(format);
}
SPECSERVE_INLINE const uint8_t* unit_body(int format, const uint8_t* units, int64_t nb, int64_t g, int64_t b) {
  const UnitLayout l = unit_layout(format);
  return unit_header(format, units, nb, g, b) + l.header + (b % l.blocks) * l.body;
}

// One row of one unit, unpacked (generic code: the reference kernel, dequantization).
struct RowBlock {
  int32_t q[kBlock];  // w[i]: stored value less its offset (Q3_K q - 4, Q4_0 q - 8, Q5_0 q - 16, Q6_K q - 32),
                      // IQ4_NL's kvalues[q], else q
  int32_t sc[2];      // integer sub-scale of each 16-element half (1 where the format has none)
  float d;            // dw
  float m;            // mw (0 where the format has no min)
  int32_t mh[2];      // Q2_K: each half's integer min m[h]
  float dm;           // Q2_K: its mw, -dmin
};

SPECSERVE_INLINE void unpack_row(int format, const uint8_t* header, const uint8_t* body, int r, RowBlock& out) {
  const int s = unit_layout(format).scales;
  out.sc[0] = out.sc[1] = 1;
  out.m = 0.0f;
  out.mh[0] = out.mh[1] = 0;
  out.dm = 0.0f;
  if (format == FMT_Q8_0) {
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 4; ++e) out.q[4 * j + e] = static_cast<int8_t>(body[(j * 16 + r) * 4 + e]);
    out.d = half_to_float(load_half(body + s + 2 * r));
    return;
  }
  if (format == FMT_Q2_K) {
    for (int i = 0; i < kBlock; ++i) out.q[i] = (body[64 * (i / 16) + 4 * r + i % 4] >> (2 * (i / 4 % 4))) & 3;
    for (int h = 0; h < 2; ++h) {
      out.sc[h] = body[s + 16 * h + r] & 15;
      out.mh[h] = body[s + 16 * h + r] >> 4;
    }
    out.d = half_to_float(load_half(header + 2 * r));
    out.dm = -half_to_float(load_half(header + 32 + 2 * r));
    return;
  }
  if (format == FMT_Q3_K) {
    for (int i = 0; i < kBlock; ++i) {
      const int group = i / 4, low = (body[64 * (group / 4) + 4 * r + i % 4] >> (2 * (group % 4))) & 3;
      out.q[i] = (low | (((body[kQ3HighBits + 4 * r + i % 4] >> group) & 1) << 2)) - 4;
    }
    out.sc[0] = static_cast<int8_t>(body[s + r]);
    out.sc[1] = static_cast<int8_t>(body[s + 16 + r]);
    out.d = half_to_float(load_half(header + 2 * r));
    return;
  }
  for (int p = 0; p < 4; ++p)
    for (int e = 0; e < 4; ++e) {
      const uint8_t byte = body[(p * 16 + r) * 4 + e];
      out.q[4 * p + e] = byte & 15;
      out.q[16 + 4 * p + e] = byte >> 4;
    }
  if (has_fifth_bit(format))
    for (int i = 0; i < kBlock; ++i) out.q[i] |= ((body[kHighBits + 4 * r + i % 4] >> (i / 4)) & 1) << 4;
  switch (format) {
    case FMT_IQ4_NL:
      for (int i = 0; i < kBlock; ++i) out.q[i] = kIq4nlValues[out.q[i]];
      [[fallthrough]];
    case FMT_Q4_0:
    case FMT_Q4_1:
    case FMT_Q5_0:
    case FMT_Q5_1:
      for (int i = 0; i < kBlock; ++i) out.q[i] -= format == FMT_Q4_0 ? 8 : format == FMT_Q5_0 ? 16 : 0;
      out.d = half_to_float(load_half(body + s + 2 * r));
      if (has_min(format)) out.m = half_to_float(load_half(body + s + 32 + 2 * r));
      return;
    case FMT_Q5_K:
    case FMT_Q4_K:
      out.sc[0] = out.sc[1] = body[s + r];
      out.d = half_to_float(load_half(header + 2 * r));
      out.m = -(half_to_float(load_half(header + 32 + 2 * r)) * static_cast<float>(body[s + 16 + r]));
      return;
    case FMT_Q6_K:
      for (int i = 0; i < kBlock; ++i) {
        const int group = i / 4, plane = body[kHighBits + 64 * (group / 4) + 4 * r + i % 4];
        out.q[i] = (out.q[i] | (((plane >> (2 * (group % 4))) & 3) << 4)) - 32;
      }
      out.sc[0] = static_cast<int8_t>(body[s + r]);
      out.sc[1] = static_cast<int8_t>(body[s + 16 + r]);
      out.d = half_to_float(load_half(header + 2 * r));
      return;
  }
}

// Repack rows [0, rows) of raw GGUF data (rows x nb / (blocks per GGUF block) raw blocks,
// row-major) into units [ceil(rows / 16)][nb]; rows past `rows` in the last unit row are zero.
void repack_rows(int format, const uint8_t* raw, int64_t rows, int64_t nb, uint8_t* out);

// Row r of a packed weight of nb blocks per row as nb * 32 floats, bit for bit GGUF's own
// dequantization of the raw row (the gguf package's and ggml's): (d * sc) * q, + m where the
// format has a min, each operation rounded to float32.
void dequantize_row(int format, const uint8_t* units, int64_t nb, int64_t r, float* out);

// Load-time quantization of float weights into raw GGUF blocks, with the rounding of ggml's
// reference quantizers (and the gguf package's): rows [0, rows) of w (cols a multiple of 32) into
// raw [rows][cols / 32 * gguf_block_bytes]. Q8_0 and Q4_1.
constexpr bool can_quantize_weight(int format) { return format == FMT_Q8_0 || format == FMT_Q4_1; }
void quantize_weight_rows(int format, const float* w, int64_t rows, int64_t cols, uint8_t* raw);

// The GGUF name of a format ("Q4_K"), for messages.
const char* format_name(int format);

// Quantize rows [0, n) of x (row stride ldx floats, k a multiple of 32) into act[n][k / 32].
using QuantizeFn = void (*)(const float* x, int64_t n, int64_t k, int64_t ldx, ActBlock* act);

// y[t * ldy + r] for t in [0, n), r in unit rows [16 * g0, 16 * g1): the products of the
// packed weight (nb blocks per row) with act[n][nb]. bias (per row) and residual (row stride
// ldr) may be null; residual may alias y.
using GemmFn = void (*)(const uint8_t* units, int64_t nb, int64_t g0, int64_t g1, const ActBlock* act,
                        int64_t n, const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy);

constexpr int kFormatIds = FMT_IQ4_NL + 1;  // the kernel tables' size: one entry per GGML type id up to IQ4_NL's

struct GemmKernels {
  QuantizeFn quantize;
  GemmFn gemm[kFormatIds];  // by format id; null where the level has no kernel for it

  void overlay(const GemmKernels& own) {
    if (own.quantize) quantize = own.quantize;
    for (int f = 0; f < kFormatIds; ++f)
      if (own.gemm[f]) gemm[f] = own.gemm[f];
  }
};

// A level's kernel for one format. The SIMD levels list theirs as constant data, which generic
// code copies into a table: filling a level's table runs no code built for that level.
struct GemmEntry {
  int format;
  GemmFn fn;
};
GemmKernels make_gemm_kernels(QuantizeFn quantize, const GemmEntry* entries, int count);

// The kernels of one level (null entries fall back to the next lower level's).
const GemmKernels& gemm_kernels_generic();
#if defined(__x86_64__) || defined(_M_X64)
const GemmKernels& gemm_kernels_avx2();
const GemmKernels& gemm_kernels_avx512();
const GemmKernels& gemm_kernels_avx512_vnni();
const GemmKernels& gemm_kernels_amx();
// Whether this process may use the AMX tile registers (Linux grants them on request; asked once).
bool amx_permitted();
#endif

// The products at a CPU level (its kernels, threads over unit rows): act[n][k / 32] from x, then
// y[n][rows] (row stride ldy; rows a multiple of 16) from the units, as defined above.
void quantize_rows(int level, const float* x, int64_t n, int64_t k, int64_t ldx, ActBlock* act);
void gemm_rows(int level, int format, const uint8_t* units, int64_t rows, int64_t nb, const ActBlock* act,
               int64_t n, const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy);

}  // namespace specserve
