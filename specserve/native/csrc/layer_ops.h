// The per-layer kernels around the quantized products: RMSNorm, RoPE, SiLU x up, and paged
// attention over the KV pool. Each has a generic C++ implementation and AVX2 / AVX-512 ones
// that compute the same bits (the arithmetic of each is defined here), and each row's result
// depends only on that row's inputs: batch invariance by construction.
//
// The KV pool holds IEEE half precision (uint16_t bits): round_half writes a key or value
// (rounded to nearest, ties to even), attention widens it back to float (exact) on every read.
//
// Shared arithmetic:
//  - sum16(x[0..n)), n a multiple of 16: 16 lane sums s[l] = ((x[l] + x[16 + l]) + x[32 + l]) + ...
//    in order, then reduced s[l] += s[l + 8], s[l] += s[l + 4], s[l] += s[l + 2], s[l] += s[l + 1]
//    (lanes l below the half), the result s[0]. dot16(a, b) the same with a fma chain
//    s[l] = fma(a[16c + l], b[16c + l], s[l]) for c = 0, 1, ...
//  - exp: specserve's own expf (exp_ps), identical at every level (range reduction by ln 2 and a
//    fixed polynomial evaluated with fma), so no level depends on the C library's expf.
#pragma once

#include <cstdint>

#include "common.h"

namespace specserve {

// y[t, :] = (x[t, :] * r) * w  with r = 1 / sqrtf(sum16(x[t, :]^2) / d + eps), x^2 as x * x.
// x, y: [n, d] with row strides ldx, ldy (y may alias x); d a multiple of 16.
void rmsnorm(int level, const float* x, int64_t ldx, int64_t n, int64_t d, const float* w, float eps, float* y,
             int64_t ldy);

// Per-head RMSNorm in place (Qwen3's q and k norms): for each row t and head h < heads, the
// head_dim values at x + t * ld + h * head_dim become rmsnorm's output over them with weight
// w [head_dim], the same arithmetic as rmsnorm with d = head_dim (a multiple of 16).
void head_rmsnorm(int level, float* x, int64_t ld, int64_t n, int64_t heads, int64_t head_dim, const float* w,
                  float eps);

// Rotate-half RoPE in place on the first `heads` heads of each row (head h at x + t * ld + h * head_dim):
//   for i < head_dim / 2, with c = cos[pos[t], i], s = sin[pos[t], i]:
//     x1 = x[i], x2 = x[i + head_dim / 2];  x[i] = x1 * c - x2 * s;  x[i + head_dim / 2] = x2 * c + x1 * s
// (products rounded, then the sum: no fma). cos, sin: [max_pos, head_dim / 2].
void rope(int level, float* x, int64_t ld, int64_t n, int64_t heads, int64_t head_dim, const int64_t* pos,
          const float* cos, const float* sin);

// y[t, i] = (g / (1 + exp_ps(-g))) * u with g = gu[t, i], u = gu[t, inter + i]; gu: [n, 2 * inter]
// (row stride ldgu), y: [n, inter] (row stride ldy). inter a multiple of 16.
void silu_mul(int level, const float* gu, int64_t ldgu, int64_t n, int64_t inter, float* y, int64_t ldy);

// GeGLU: y[t, i] = gelu_mul_one(g, u) with g = gu[t, i], u = gu[t, inter + i] (layer_ops_kernels.h:
// the tanh approximation of GELU through tanh_ps); shapes as silu_mul's.
void gelu_mul(int level, const float* gu, int64_t ldgu, int64_t n, int64_t inter, float* y, int64_t ldy);

// x[t, i] = softcap_one(x[t, i], cap) = tanh_ps(x / cap) * cap in place, for rows t < n of width d
// (row stride ld): Gemma 2's final logits.
void softcap_rows(int level, float* x, int64_t ld, int64_t n, int64_t d, float cap);

// y[i] = round_half(x[i]) for i < n (layer_ops_kernels.h): how keys and values enter the pool.
void round_to_half(int level, const float* x, int64_t n, uint16_t* y);

// Where the query tokens of one attention call sit. Tokens are flattened: sequence s owns the
// query rows [q_start[s], q_start[s + 1]). Its keys and values live in the pool at slots
// 0, 1, 2, ... of the sequence, slot p in block block_table[s * bt_stride + p / block_size] at
// offset p % block_size.
//
// Query i sees the slots [0, prefix_len[i]) of its sequence and, when tree_row[i] >= 0, also the
// slots tree_start[s] + m for the m < tree_size[s] with tree_mask[tree_row[i] + m] != 0 (a token
// tree's ancestors; tree slots lie at or after prefix_len[i]). A causal chain token at position p
// has prefix_len p + 1 and tree_row -1. When kv_start is given, no query of sequence s sees a
// slot below kv_start[s] (a drafter's cache whose entries begin after a prefix-cache hit: the
// slots before were never written); null is kv_start 0 everywhere.
//
// When window > 0 (a sliding-window layer), query i sees of these only the keys at positions
// above positions[i] - window. Slot p of the prefix sits at position p, the tree slot
// tree_start[s] + m at positions[q_start[s] + m] (a tree's node m is its sequence's query m);
// without positions at tree_start[s] + depth, the depth being the ones in node m's mask row
// less one (the root's 0).
struct AttentionBatch {
  int64_t num_seqs;
  const int64_t* q_start;      // [num_seqs + 1]
  const int64_t* block_table;  // [num_seqs, bt_stride]
  int64_t bt_stride;
  const int64_t* prefix_len;  // [num_tokens]
  const int64_t* tree_row;    // [num_tokens]; null: no trees in this call
  const int64_t* tree_start;  // [num_seqs]
  const int64_t* tree_size;   // [num_seqs]
  const uint8_t* tree_mask;   // flat rows of tree_size[s] bytes
  const int64_t* kv_start;    // [num_seqs] first visible slot of each sequence; null: 0
  const int64_t* positions;   // [num_tokens] each query's position (read when window > 0)
  int64_t window;             // the sliding window; 0: none
};

// out[i, h * head_dim + d] for every query row i and head h < heads, an online softmax over key
// blocks aligned to absolute positions (flash attention's, with one defined arithmetic):
//   row i's visible slots in increasing order (ancestors in node order), each at its position
//   (a prefix slot p at p, a tree slot at its node's), fall into key blocks b = position / 32
//   (layer_ops_kernels.h's kKeyBlock); with k and v the pool's halves widened to float,
//   m = -inf, l = 0, o[d] = 0, and for each block with a visible key, in order:
//     score[p] = dot16(q[i, h, :], k[p, h / (heads / kv_heads), :]) * scale
//     (then score[p] = softcap_one(score[p], softcap) where softcap > 0: Gemma 2)
//     m' = max(m, the block's scores);  alpha = exp_ps(m - m')   (0 when m' is -inf)
//     o[d] = o[d] * alpha;  l = l * alpha;  then for its keys in slot order:
//       w = exp_ps(score[p] - m');  o[d] = fma(w, v[p, kvh, d], o[d]);  l = l + w
//     m = m'
//   out = o[d] / l
// (a query that sees no slot gets zeros). dot16 starts from zero lanes; exp_ps is
// layer_ops_kernels.h's. A row's blocks and their keys are its own, wherever the call cuts a
// prompt or whatever shares it: batch invariance, and the same bits from the SIMD levels' tiles
// (a tile of query rows against each key block, the block widened once) as from the generic
// level's row-by-row loop. A token tree's node sees its path at the positions a chain would.
// q: [num_tokens, heads, head_dim] float with row stride ldq; k_pool, v_pool: [blocks, block_size,
// kv_heads, head_dim] half bits; out row stride ldo. head_dim a multiple of 16.
void paged_attention(int level, const float* q, int64_t ldq, const uint16_t* k_pool, const uint16_t* v_pool,
                     int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                     float softcap, const AttentionBatch& batch, float* out, int64_t ldo);

}  // namespace specserve
