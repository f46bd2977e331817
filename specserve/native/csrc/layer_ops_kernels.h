// What the levels of the layer kernels share: exp_ps (the scalar definition every SIMD level
// reproduces), one attention task as the levels see it, and the per-level kernel tables.
//
// Everything here is inline and defined before any `#pragma GCC target` region of the files
// that include it, so each copy the compiler emits is generic code (see native/__init__.py);
// SIMD functions may still inline it.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "half.h"
#include "layer_ops.h"

namespace specserve {

// ---- exp_ps: specserve's own expf ----------------------------------------------------------
//
//   x NaN: x.  x < kExpLo: 0 (the true value would be subnormal).  x > kExpHi: x = kExpHi
//   (whose exp overflows to inf, as the true value does).  Otherwise:
//   n = (x * log2e + R) - R  (x * log2e rounded to an integer, ties to even; R = 1.5 * 2^23)
//   r = fma(n, -ln2_hi, x);  r = fma(n, -ln2_lo, r)          (ln2_hi has 9 bits: Cody-Waite)
//   p = c0;  p = fma(p, r, c_i) for i = 1..7                  (Cephes' minimax, then 1, 1)
//   exp = (p * 2^(n >> 1)) * 2^(n - (n >> 1))                 (both factors normal: n may be 128)
// Max error about 1.5 ulp over [kExpLo, kExpHi] (the tests measure it).
constexpr float kExpLo = -87.33654f;  // ~ln(FLT_MIN): from here on results are normal
constexpr float kExpHi = 88.72284f;   // exp(kExpHi) rounds to inf
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kRoundInt = 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
constexpr int kExpTerms = 8;
constexpr float kExpPoly[kExpTerms] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f, 4.1665795894e-2f,
                                       1.6666665459e-1f, 5.0000001201e-1f, 1.0f, 1.0f};

inline float float_from_bits(int32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline int32_t bits_of(float f) {
  int32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

inline float exp_ps(float x) {
  if (x != x) return x;
  if (x < kExpLo) return 0.0f;
  if (x > kExpHi) x = kExpHi;
  const float k = x * kLog2e + kRoundInt;
  const float n = k - kRoundInt;
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpPoly[0];
  for (int i = 1; i < kExpTerms; ++i) p = std::fma(p, r, kExpPoly[i]);
  const int32_t ni = bits_of(k) - bits_of(kRoundInt);
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  return (p * float_from_bits((n1 + 127) << 23)) * float_from_bits((n2 + 127) << 23);
}

// ---- tanh_ps: specserve's own tanhf, from exp_ps ---------------------------------------------
//
//   tanh_ps(x) = 1 - 2 / (exp_ps(x + x) + 1)      (each operation rounded; no fma)
// exp_ps saturates to inf for large x (tanh 1) and to 0 for very negative x (tanh -1). The
// absolute error stays within a few ulp of 1 (tests measure it): small next to GELU's 1 + tanh
// and to a soft-cap's scale, where it is used.
inline float tanh_ps(float x) { return 1.0f - 2.0f / (exp_ps(x + x) + 1.0f); }

// GELU's tanh approximation (Gemma's gelu_pytorch_tanh), times the up projection:
//   gelu_mul(g, u) = ((0.5 * g) * (1 + tanh_ps(kGeluBeta * (g + kGeluKappa * ((g * g) * g))))) * u
constexpr float kGeluBeta = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluKappa = 0.044715f;
inline float gelu_mul_one(float g, float u) {
  const float inner = kGeluBeta * (g + kGeluKappa * ((g * g) * g));
  return ((0.5f * g) * (1.0f + tanh_ps(inner))) * u;
}

// Soft-capping (Gemma 2's scores and logits): tanh_ps(x / cap) * cap.
inline float softcap_one(float x, float cap) { return tanh_ps(x / cap) * cap; }

// ---- round_half: float -> the pool's IEEE half bits ------------------------------------------
//
// Rounded to nearest, ties to even (subnormal halves below 2^-14, infinity from 65520 up): what
// F16C's / AVX-512's cvtps_ph computes with _MM_FROUND_TO_NEAREST_INT, and half.h's float_to_half,
// except for a NaN, which the instruction keeps as its sign and top 10 payload bits with the
// quiet bit set (half.h gives the one canonical NaN); this is the instruction's result.
inline uint16_t round_half(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>(((x >> 16) & 0x8000) | 0x7E00 | ((x >> 13) & 0x3FF));
  return float_to_half(f);
}

// RoPE (layer_ops.h) of one head's pairs i in [from, half): x1 c - x2 s, x2 c + x1 s.
inline void rope_pairs(float* xh, const float* c, const float* s, int64_t from, int64_t half) {
  for (int64_t i = from; i < half; ++i) {
    const float x1 = xh[i], x2 = xh[i + half];
    xh[i] = x1 * c[i] - x2 * s[i];
    xh[i + half] = x2 * c[i] + x1 * s[i];
  }
}

// ---- attention: one (sequence, kv head) pair ------------------------------------------------
//
// Its rows are r = t * group + g for the sequence's query tokens t < num_q and the query heads
// g < group that share kv head `kvh`; a task computes the rows [row_begin, row_end) of them (the
// dispatch splits a long prompt's rows into several tasks, one thread each). Keys are the
// sequence's slots [first_slot, first_slot + num_keys), numbered from 0 here: prefix_len and
// tree_start count from first_slot (AttentionBatch's kv_start), so the levels' loops never meet a
// hidden slot. Key p's position (which key block it belongs to, layer_ops.h) is first_slot + p
// for a prefix slot and tree_pos[p - tree_start] for a tree slot.
// The online softmax's key blocks: positions [kKeyBlock * b, kKeyBlock * (b + 1)) (layer_ops.h).
constexpr int64_t kKeyBlock = 32;

struct AttentionTask {
  const float* q;  // row r at q + t * ldq + g * head_dim (the first head of this kv head's group)
  int64_t ldq;
  float* out;  // row r at out + t * ldo + g * head_dim
  int64_t ldo;
  int64_t num_q, group, head_dim;
  int64_t row_begin, row_end;  // the rows this task computes
  float scale;
  const int64_t* prefix_len;  // [num_q], the sequence's own
  const int64_t* tree_row;    // [num_q] or null
  const uint8_t* tree_mask;
  int64_t tree_start, tree_size;
  const int64_t* tree_pos;  // [tree_size] the tree slots' positions (absolute)
  const uint16_t* k;        // the pools (half bits), offset to this kv head
  const uint16_t* v;
  const int64_t* blocks;  // the sequence's block table row
  int64_t block_size;
  int64_t slot_stride;  // halves from one slot to the next (kv_heads * head_dim)
  int64_t num_keys;
  int64_t first_slot;  // the sequence's slot of key 0
  // [num_q] the first key each query's prefix part starts at (a sliding window's lower end,
  // counted from first_slot), or null: 0 for all.
  const int64_t* lo;
  float softcap;  // scores -> softcap_one(score, softcap) before the max; 0: none

  const float* q_row(int64_t r) const { return q + (r / group) * ldq + (r % group) * head_dim; }
  float* out_row(int64_t r) const { return out + (r / group) * ldo + (r % group) * head_dim; }
  bool has_trees() const { return tree_row != nullptr; }

  // Row r's first visible key of its prefix part, and the end of that part.
  int64_t from(int64_t r) const { return lo == nullptr ? 0 : lo[r / group]; }
  int64_t prefix_end(int64_t r) const { return prefix_len[r / group] < num_keys ? prefix_len[r / group] : num_keys; }

  // Past its prefix part, row r sees slots below this (and not all of them when it is a tree's).
  int64_t reach(int64_t r) const {
    const int64_t t = r / group;
    return tree_row != nullptr && tree_row[t] >= 0 ? num_keys : prefix_end(r);
  }

  // Whether query token t sees slot p (layer_ops.h's AttentionBatch).
  bool sees(int64_t t, int64_t p) const {
    if (p < prefix_len[t]) return lo == nullptr || p >= lo[t];
    if (tree_row == nullptr || tree_row[t] < 0) return false;
    const int64_t m = p - tree_start;
    return m >= 0 && m < tree_size && tree_mask[tree_row[t] + m] != 0;
  }

  // The key block (layer_ops.h: aligned to absolute positions) of slot p as query token t sees
  // it: through its prefix at position first_slot + p, through its tree mask at its node's.
  int64_t key_block(int64_t t, int64_t p) const {
    return (p < prefix_len[t] ? first_slot + p : tree_pos[p - tree_start]) / kKeyBlock;
  }
};

// Rows of one tile of the SIMD levels: a multiple of 16 (rows are vector lanes there).
constexpr int64_t kTileRows = 64;

// Scratch a task needs (floats): the SIMD levels' tile (q transposed [head_dim][kTileRows],
// scores [kKeyBlock][kTileRows], widened K and V [kKeyBlock][head_dim], o [kTileRows][head_dim],
// and per row m, l, alpha and the visible range), more than the generic level's.
inline int64_t attention_tile_floats(const AttentionTask& t) {
  return kTileRows * (2 * t.head_dim + kKeyBlock + 5) + 2 * kKeyBlock * t.head_dim + t.head_dim;
}
// ... and after it, a tile's rows' online-softmax state (m, l, o) kept between a tree's shared
// prefix and its tokens' own keys.
inline int64_t attention_scratch_floats(const AttentionTask& t) {
  return attention_tile_floats(t) + kTileRows * (t.head_dim + 2);
}

// Walks a task's keys first_key, first_key + 1, ... (sequence slots from t.first_slot +
// first_key) through its block table, giving each slot's offset in the pool (in halves, from the
// task's k or v).
struct SlotCursor {
  const int64_t* blocks;
  int64_t block_size, slot_stride, block = 0, offset = 0;

  SlotCursor(const AttentionTask& t, int64_t first_key)
      : blocks(t.blocks), block_size(t.block_size), slot_stride(t.slot_stride),
        block((t.first_slot + first_key) / t.block_size), offset((t.first_slot + first_key) % t.block_size) {}

  int64_t next() {
    const int64_t at = (blocks[block] * block_size + offset) * slot_stride;
    if (++offset == block_size) {
      offset = 0;
      ++block;
    }
    return at;
  }
};

// The pool offset (in halves) of the task's key p.
inline int64_t slot_offset(const AttentionTask& t, int64_t p) {
  const int64_t slot = t.first_slot + p;
  return (t.blocks[slot / t.block_size] * t.block_size + slot % t.block_size) * t.slot_stride;
}

// ---- per-level tables -------------------------------------------------------------------------

// Row kernels: layer_ops.h's functions on rows [0, n), without the level.
using RmsnormFn = void (*)(const float* x, int64_t ldx, int64_t n, int64_t d, const float* w, float eps, float* y,
                           int64_t ldy);
using RopeFn = void (*)(float* x, int64_t ld, int64_t n, int64_t heads, int64_t head_dim, const int64_t* pos,
                        const float* cos, const float* sin);
using SiluMulFn = void (*)(const float* gu, int64_t ldgu, int64_t n, int64_t inter, float* y, int64_t ldy);
using ExpFn = void (*)(const float* x, int64_t n, float* y);  // y[i] = exp_ps(x[i])
using HalfFn = void (*)(const float* x, int64_t n, uint16_t* y);  // y[i] = round_half(x[i])
using GeluMulFn = SiluMulFn;  // y[t, i] = gelu_mul_one(gu[t, i], gu[t, inter + i])
using SoftcapFn = void (*)(float* x, int64_t n, float cap);  // x[i] = softcap_one(x[i], cap)
// One task; scratch holds attention_scratch_floats(task) floats.
using AttendFn = void (*)(const AttentionTask& task, float* scratch);

struct LayerKernels {
  RmsnormFn rmsnorm;
  RopeFn rope;
  SiluMulFn silu_mul;
  ExpFn exp;
  HalfFn to_half;
  AttendFn attend;
  GeluMulFn gelu_mul;
  SoftcapFn softcap;

  void overlay(const LayerKernels& own) {
    if (own.gelu_mul) gelu_mul = own.gelu_mul;
    if (own.softcap) softcap = own.softcap;
    if (own.rmsnorm) rmsnorm = own.rmsnorm;
    if (own.rope) rope = own.rope;
    if (own.silu_mul) silu_mul = own.silu_mul;
    if (own.exp) exp = own.exp;
    if (own.to_half) to_half = own.to_half;
    if (own.attend) attend = own.attend;
  }
};

// y[i] = exp_ps(x[i]) for i < n at a level: for the tests, which measure exp_ps itself.
void exp_rows(int level, const float* x, int64_t n, float* y);

// The kernels of one level (null entries fall back to the next lower level's).
const LayerKernels& layer_kernels_generic();
#if defined(__x86_64__) || defined(_M_X64)
const LayerKernels& layer_kernels_avx2();
const LayerKernels& layer_kernels_avx512();
#endif

}  // namespace specserve
