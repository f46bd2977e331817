// GGUF block formats and their units (qgemm.h's layouts): repacking raw GGUF rows into units,
// dequantizing units back to GGUF's own floats, and quantizing float weights into GGUF blocks at
// load. Generic code: runs on any CPU.
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "half.h"
#include "qgemm.h"

namespace specserve {

const char* format_name(int format) {
  switch (format) {
    case FMT_Q4_0: return "Q4_0";
    case FMT_Q4_1: return "Q4_1";
    case FMT_Q5_0: return "Q5_0";
    case FMT_Q5_1: return "Q5_1";
    case FMT_Q8_0: return "Q8_0";
    case FMT_Q2_K: return "Q2_K";
    case FMT_Q3_K: return "Q3_K";
    case FMT_IQ4_NL: return "IQ4_NL";
    case FMT_Q4_K: return "Q4_K";
    case FMT_Q5_K: return "Q5_K";
    case FMT_Q6_K: return "Q6_K";
    default: return "an unsupported format";
  }
}

namespace {

// One row's 32-element block as GGUF stores it, its fields taken apart.
struct RawBlock {
  uint8_t q[kBlock];  // stored values: 3 bits (Q3_K), 4 (IQ4_NL: kvalues' index), 5 (Q5_*), 6 (Q6_K), or int8 bits (Q8_0)
  uint8_t sc[2];      // K-quants: the scale of each half (Q4_K, Q5_K: one 6-bit scale, twice; Q3_K, Q6_K: int8 bits)
  uint8_t m;          // Q4_K, Q5_K: the 6-bit min
  uint16_t d, dm;     // fp16 scale (the super-block's for K-quants); Q4_1's and Q5_1's min, K-quants' dmin
};

// Q4_K / Q5_K: the 6-bit scale and min of block j (0..7) from the super-block's 12 scale bytes:
// blocks 0..3 in the low 6 bits of bytes j (scale) and j + 4 (min), blocks 4..7 in the nibbles of
// byte j + 4 with their top two bits in the spare bits of bytes j - 4 (scale) and j (min).
void kquant_scale_min(const uint8_t* s, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = static_cast<uint8_t>((s[j + 4] & 15) | ((s[j - 4] >> 6) << 4));
    m = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
  }
}

// Block b (32 elements) of a raw GGUF row.
void read_raw(int format, const uint8_t* row, int64_t b, RawBlock& out) {
  const UnitLayout l = unit_layout(format);
  const uint8_t* blk = row + (b / l.blocks) * l.gguf;
  const int j = static_cast<int>(b % l.blocks);  // the block within its super-block
  out.sc[0] = out.sc[1] = out.m = 0;
  out.dm = 0;
  switch (format) {
    case FMT_Q4_0:
    case FMT_Q4_1:
    case FMT_IQ4_NL:
    case FMT_Q5_0:
    case FMT_Q5_1: {  // d, (m), (Q5_*: qh[4]), qs[16]: element i in the low nibble of qs[i], 16 + i
                      // in the high one; Q5_*: its fifth bit is bit i of qh as a little-endian uint32
      const int at = has_min(format) ? 4 : 2;
      const uint8_t* qs = blk + at + (has_fifth_bit(format) ? 4 : 0);
      for (int i = 0; i < 16; ++i) {
        out.q[i] = qs[i] & 15;
        out.q[16 + i] = qs[i] >> 4;
      }
      if (has_fifth_bit(format))
        for (int i = 0; i < kBlock; ++i) out.q[i] |= ((blk[at + i / 8] >> (i % 8)) & 1) << 4;
      out.d = load_half(blk);
      if (has_min(format)) out.dm = load_half(blk + 2);
      return;
    }
    case FMT_Q8_0:  // d, qs[32]
      std::memcpy(out.q, blk + 2, kBlock);
      out.d = load_half(blk);
      return;
    case FMT_Q4_K:
    case FMT_Q5_K: {  // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]; qs[32c + i] holds blocks 2c, 2c + 1
      const uint8_t* qs = blk + (format == FMT_Q4_K ? 16 : 48);
      for (int i = 0; i < kBlock; ++i) {
        out.q[i] = (qs[32 * (j / 2) + i] >> (4 * (j % 2))) & 15;
        if (format == FMT_Q5_K) out.q[i] |= ((blk[16 + i] >> j) & 1) << 4;  // bit j of qh[i]
      }
      kquant_scale_min(blk + 4, j, out.sc[0], out.m);
      out.sc[1] = out.sc[0];
      out.d = load_half(blk);
      out.dm = load_half(blk + 2);
      return;
    }
    case FMT_Q2_K: {  // scales[16] (scale | min << 4 per 16 elements), qs[64], d, dmin: low bits as Q3_K's
      for (int i = 0; i < kBlock; ++i) out.q[i] = (blk[16 + 32 * (j / 4) + i] >> (2 * (j % 4))) & 3;
      out.sc[0] = blk[2 * j];
      out.sc[1] = blk[2 * j + 1];
      out.d = load_half(blk + 80);
      out.dm = load_half(blk + 82);
      return;
    }
    case FMT_Q3_K: {  // hmask[32], qs[64], scales[12], d: element e = 32j + i of the super-block has low
                      // bits (qs[32(j / 4) + i] >> 2(j % 4)) & 3 and bit 2 in bit j of hmask[i]
      for (int i = 0; i < kBlock; ++i) {
        const int low = (blk[32 + 32 * (j / 4) + i] >> (2 * (j % 4))) & 3;
        out.q[i] = static_cast<uint8_t>(low | (((blk[i] >> j) & 1) << 2));
      }
      // The 6-bit scale k (of elements 16k ..): low nibble in byte k (k < 8) or the high nibble of
      // byte k - 8, top two bits at bits 2(k / 4) of byte 8 + k % 4; stored less 32.
      for (int h = 0; h < 2; ++h) {
        const int k = 2 * j + h, s = blk[96 + k % 8] >> (4 * (k / 8)) & 15;
        out.sc[h] = static_cast<uint8_t>((s | (((blk[104 + k % 4] >> (2 * (k / 4))) & 3) << 4)) - 32);
      }
      out.d = load_half(blk + 108);
      return;
    }
    case FMT_Q6_K: {  // ql[128], qh[64], scales[16] int8, d: element e = 128c + l of the super-block
      for (int i = 0; i < kBlock; ++i) {  // has low bits in ql[64c + l % 64], high in qh[32c + l % 32]
        const int e = 32 * j + i, c = e / 128, l = e % 128;
        const int low = (blk[64 * c + l % 64] >> (4 * (l / 64))) & 15;
        const int high = (blk[128 + 32 * c + l % 32] >> (2 * (l / 32))) & 3;
        out.q[i] = static_cast<uint8_t>(low | (high << 4));
      }
      out.sc[0] = blk[192 + 2 * j];
      out.sc[1] = blk[192 + 2 * j + 1];
      out.d = load_half(blk + 208);
      return;
    }
  }
}

// Row r of a unit (and of its super-unit's header) from the raw block; the body starts zeroed.
void write_unit_row(int format, const RawBlock& rb, int r, uint8_t* header, uint8_t* body) {
  const int s = unit_layout(format).scales;
  if (format == FMT_Q8_0) {
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 4; ++e) body[(j * 16 + r) * 4 + e] = rb.q[4 * j + e];
    store_half(body + s + 2 * r, rb.d);
    return;
  }
  if (format == FMT_Q3_K || format == FMT_Q2_K) {  // cr[k][r][e] bits 2j..2j+1 (and Q3_K's hb[r][e] bit j)
    for (int g = 0; g < 8; ++g)
      for (int e = 0; e < 4; ++e) {
        body[64 * (g / 4) + 4 * r + e] |= (rb.q[4 * g + e] & 3) << (2 * (g % 4));
        if (format == FMT_Q3_K) body[kQ3HighBits + 4 * r + e] |= ((rb.q[4 * g + e] >> 2) & 1) << g;
      }
    if (format == FMT_Q2_K) store_half(header + 32 + 2 * r, rb.dm);
    body[s + r] = rb.sc[0];
    body[s + 16 + r] = rb.sc[1];
    store_half(header + 2 * r, rb.d);
    return;
  }
  for (int p = 0; p < 4; ++p)
    for (int e = 0; e < 4; ++e)
      body[(p * 16 + r) * 4 + e] = static_cast<uint8_t>((rb.q[4 * p + e] & 15) | ((rb.q[16 + 4 * p + e] & 15) << 4));
  if (has_fifth_bit(format))  // hb[r][e] bit j: the fifth bit of element 4j + e
    for (int j = 0; j < 8; ++j)
      for (int e = 0; e < 4; ++e) body[kHighBits + 4 * r + e] |= ((rb.q[4 * j + e] >> 4) & 1) << j;
  switch (format) {
    case FMT_Q4_1:
    case FMT_Q5_1:
      store_half(body + s + 32 + 2 * r, rb.dm);
      [[fallthrough]];
    case FMT_Q4_0:
    case FMT_Q5_0:
    case FMT_IQ4_NL:
      store_half(body + s + 2 * r, rb.d);
      return;
    case FMT_Q5_K:
    case FMT_Q4_K:
      body[s + r] = rb.sc[0];
      body[s + 16 + r] = rb.m;
      store_half(header + 2 * r, rb.d);
      store_half(header + 32 + 2 * r, rb.dm);
      return;
    case FMT_Q6_K:  // hq[k][r][e] bits 2j..2j+1: bits 4..5 of element 4(4k + j) + e
      for (int k = 0; k < 2; ++k)
        for (int j = 0; j < 4; ++j)
          for (int e = 0; e < 4; ++e) body[kHighBits + 64 * k + 4 * r + e] |= (rb.q[4 * (4 * k + j) + e] >> 4) << (2 * j);
      body[s + r] = rb.sc[0];
      body[s + 16 + r] = rb.sc[1];
      store_half(header + 2 * r, rb.d);
      return;
  }
}

}  // namespace

void repack_rows(int format, const uint8_t* raw, int64_t rows, int64_t nb, uint8_t* out) {
  const int64_t groups = (rows + kUnitRows - 1) / kUnitRows;
  const UnitLayout l = unit_layout(format);
  const size_t ub = unit_bytes(format), row_bytes = l.gguf * (nb / l.blocks);
  std::memset(out, 0, groups * nb * ub);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    RawBlock rb;
    for (int64_t g = g0; g < g1; ++g) {
      const int nrows = static_cast<int>(std::min<int64_t>(kUnitRows, rows - g * kUnitRows));
      for (int64_t b = 0; b < nb; ++b) {
        uint8_t* header = out + (g * nb + b - b % l.blocks) * ub;
        uint8_t* body = header + l.header + (b % l.blocks) * l.body;
        for (int r = 0; r < nrows; ++r) {
          read_raw(format, raw + (g * kUnitRows + r) * row_bytes, b, rb);
          write_unit_row(format, rb, r, header, body);
        }
      }
    }
  });
}

void dequantize_row(int format, const uint8_t* units, int64_t nb, int64_t r, float* out) {
  const int64_t g = r / kUnitRows;
  const int rr = static_cast<int>(r % kUnitRows);
  RowBlock rb;
  for (int64_t b = 0; b < nb; ++b) {
    unpack_row(format, unit_header(format, units, nb, g, b), unit_body(format, units, nb, g, b), rr, rb);
    for (int i = 0; i < kBlock; ++i) {
      float v = (rb.d * static_cast<float>(rb.sc[i / 16])) * static_cast<float>(rb.q[i]);
      if (has_min(format)) v = v + rb.m;
      if (has_half_mins(format)) v = v + rb.dm * static_cast<float>(rb.mh[i / 16]);
      out[b * kBlock + i] = v;
    }
  }
}

namespace {

// ggml's quantize_row_q8_0_ref: d = amax / 127, q = roundf(x / d) (by the reciprocal, ties away).
void quantize_q8_0(const float* x, uint8_t* out) {
  float amax = 0.0f;
  for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(x[i]));
  const float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  store_half(out, float_to_half(d));
  for (int i = 0; i < kBlock; ++i) out[2 + i] = static_cast<uint8_t>(static_cast<int8_t>(std::round(x[i] * id)));
}

// ggml's quantize_row_q4_1_ref: d = (max - min) / 15, q = min(15, trunc((x - min) / d + 0.5)).
void quantize_q4_1(const float* x, uint8_t* out) {
  float lo = x[0], hi = x[0];
  for (int i = 1; i < kBlock; ++i) {
    lo = std::fmin(lo, x[i]);
    hi = std::fmax(hi, x[i]);
  }
  const float d = (hi - lo) / 15.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
  store_half(out, float_to_half(d));
  store_half(out + 2, float_to_half(lo));
  auto q = [&](float v) { return std::min(15, static_cast<int>((v - lo) * id + 0.5f)); };
  for (int i = 0; i < 16; ++i) out[4 + i] = static_cast<uint8_t>(q(x[i]) | (q(x[16 + i]) << 4));
}

}  // namespace

void quantize_weight_rows(int format, const float* w, int64_t rows, int64_t cols, uint8_t* raw) {
  const int64_t nb = cols / kBlock;
  const size_t bb = gguf_block_bytes(format);
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* x = w + r * cols + b * kBlock;
        uint8_t* out = raw + (r * nb + b) * bb;
        if (format == FMT_Q8_0) quantize_q8_0(x, out); else quantize_q4_1(x, out);
      }
  });
}

}  // namespace specserve
