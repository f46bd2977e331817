// Layer kernels: the generic (any CPU) implementations, written as layer_ops.h defines them,
// and the level dispatch. The SIMD levels live in layer_ops_avx*.cpp, the Python entry points
// in layer_ops_py.inc.
#include "layer_ops.h"

#include <c10/util/Exception.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "layer_ops_kernels.h"

namespace specserve {

namespace {

// layer_ops.h's lane reduction of s[16]: s[l] += s[l + w] for w = 8, 4, 2, 1.
float reduce16(float* s) {
  for (int w = 8; w >= 1; w /= 2)
    for (int l = 0; l < w; ++l) s[l] += s[l + w];
  return s[0];
}

float sum16_squares(const float* x, int64_t d) {
  float s[16];
  for (int l = 0; l < 16; ++l) s[l] = x[l] * x[l];
  for (int64_t c = 16; c < d; c += 16)
    for (int l = 0; l < 16; ++l) s[l] = s[l] + x[c + l] * x[c + l];
  return reduce16(s);
}

float dot16(const float* a, const float* b, int64_t d) {
  float s[16] = {};
  for (int64_t c = 0; c < d; c += 16)
    for (int l = 0; l < 16; ++l) s[l] = std::fma(a[c + l], b[c + l], s[l]);
  return reduce16(s);
}

void rmsnorm_generic(const float* x, int64_t ldx, int64_t n, int64_t d, const float* w, float eps, float* y,
                     int64_t ldy) {
  for (int64_t t = 0; t < n; ++t) {
    const float* xt = x + t * ldx;
    const float r = 1.0f / std::sqrt(sum16_squares(xt, d) / static_cast<float>(d) + eps);
    float* yt = y + t * ldy;
    for (int64_t i = 0; i < d; ++i) yt[i] = (xt[i] * r) * w[i];
  }
}

void rope_generic(float* x, int64_t ld, int64_t n, int64_t heads, int64_t head_dim, const int64_t* pos,
                  const float* cos, const float* sin) {
  const int64_t half = head_dim / 2;
  for (int64_t t = 0; t < n; ++t) {
    const float* c = cos + pos[t] * half;
    const float* s = sin + pos[t] * half;
    for (int64_t h = 0; h < heads; ++h) rope_pairs(x + t * ld + h * head_dim, c, s, 0, half);
  }
}

void silu_mul_generic(const float* gu, int64_t ldgu, int64_t n, int64_t inter, float* y, int64_t ldy) {
  for (int64_t t = 0; t < n; ++t) {
    const float* g = gu + t * ldgu;
    const float* u = g + inter;
    for (int64_t i = 0; i < inter; ++i) y[t * ldy + i] = (g[i] / (1.0f + exp_ps(-g[i]))) * u[i];
  }
}

void gelu_mul_generic(const float* gu, int64_t ldgu, int64_t n, int64_t inter, float* y, int64_t ldy) {
  for (int64_t t = 0; t < n; ++t) {
    const float* g = gu + t * ldgu;
    for (int64_t i = 0; i < inter; ++i) y[t * ldy + i] = gelu_mul_one(g[i], g[inter + i]);
  }
}

void softcap_generic(float* x, int64_t n, float cap) {
  for (int64_t i = 0; i < n; ++i) x[i] = softcap_one(x[i], cap);
}

void exp_generic(const float* x, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = exp_ps(x[i]);
}

void to_half_generic(const float* x, int64_t n, uint16_t* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = round_half(x[i]);
}

// A pool row of n halves as floats (exact).
void widen(const uint16_t* h, int64_t n, float* y) {
  for (int64_t i = 0; i < n; ++i) y[i] = half_to_float(h[i]);
}

// The three passes of layer_ops.h's attention, key-major like the SIMD levels (the order of
// the loops changes no row's arithmetic: each row's sums run over its own keys in slot order).
void attend_generic(const AttentionTask& t, float* scratch) {
  const int64_t rows = t.rows(), kp = t.keys_padded(), d = t.head_dim;
  float* scores = scratch;        // [rows][kp]
  float* o = scores + rows * kp;  // [rows][d]
  float* l = o + rows * d;        // [rows]
  float* wide = l + rows;         // [d]: one K or V row widened from the pool's halves
  SlotCursor keys(t, 0);
  for (int64_t p = 0; p < t.num_keys; ++p) {
    widen(t.k + keys.next(), d, wide);
    for (int64_t r = 0; r < rows; ++r) scores[r * kp + p] = dot16(t.q_row(r), wide, d) * t.scale;
  }
  if (t.softcap > 0.0f)
    for (int64_t r = 0; r < rows; ++r) softcap_generic(scores + r * kp, t.num_keys, t.softcap);
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores + r * kp;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < t.num_keys; ++p)
      if (t.sees(r / t.group, p) && s[p] > m) m = s[p];
    for (int64_t p = 0; p < t.num_keys; ++p) s[p] = exp_ps(s[p] - m);
  }
  std::fill(o, o + rows * d + rows, 0.0f);
  SlotCursor values(t, 0);
  for (int64_t p = 0; p < t.num_keys; ++p) {
    widen(t.v + values.next(), d, wide);
    for (int64_t r = 0; r < rows; ++r) {
      if (!t.sees(r / t.group, p)) continue;
      const float w = scores[r * kp + p];
      for (int64_t i = 0; i < d; ++i) o[r * d + i] = std::fma(w, wide[i], o[r * d + i]);
      l[r] += w;
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* out = t.out_row(r);
    for (int64_t i = 0; i < d; ++i) out[i] = l[r] != 0.0f ? o[r * d + i] / l[r] : 0.0f;
  }
}

const LayerKernels* own_kernels(int level) {
  switch (level) {
    case LEVEL_GENERIC: return &layer_kernels_generic();
#if defined(__x86_64__) || defined(_M_X64)
    case LEVEL_AVX2: return &layer_kernels_avx2();
    case LEVEL_AVX512: return &layer_kernels_avx512();
#endif
    default: return nullptr;
  }
}

const LayerKernels& kernels(int level) {
  TORCH_CHECK(level >= 0 && level <= LEVEL_AMX, "CPU level ", level, " is not one of 0..5");
  return level_table<LayerKernels, own_kernels>(level);
}

// Rows [0, n) in parallel chunks, but on the calling thread for decode-sized batches, where
// waking the pool costs more than the work.
template <class F>
void for_rows(int64_t n, const F& f) {
  at::parallel_for(0, n, n >= 64 ? 16 : std::max<int64_t>(n, 1), f);
}

}  // namespace

const LayerKernels& layer_kernels_generic() {
  static const LayerKernels k{rmsnorm_generic, rope_generic,  silu_mul_generic, exp_generic,
                              to_half_generic, attend_generic, gelu_mul_generic, softcap_generic};
  return k;
}

void rmsnorm(int level, const float* x, int64_t ldx, int64_t n, int64_t d, const float* w, float eps, float* y,
             int64_t ldy) {
  const RmsnormFn fn = kernels(level).rmsnorm;
  for_rows(n, [&](int64_t t0, int64_t t1) { fn(x + t0 * ldx, ldx, t1 - t0, d, w, eps, y + t0 * ldy, ldy); });
}

void head_rmsnorm(int level, float* x, int64_t ld, int64_t n, int64_t heads, int64_t head_dim, const float* w,
                  float eps) {
  // Each token's heads as `heads` rows of head_dim: the level's own rmsnorm kernel (in place).
  const RmsnormFn fn = kernels(level).rmsnorm;
  for_rows(n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(x + t * ld, head_dim, heads, head_dim, w, eps, x + t * ld, head_dim);
  });
}

void rope(int level, float* x, int64_t ld, int64_t n, int64_t heads, int64_t head_dim, const int64_t* pos,
          const float* cos, const float* sin) {
  const RopeFn fn = kernels(level).rope;
  for_rows(n, [&](int64_t t0, int64_t t1) { fn(x + t0 * ld, ld, t1 - t0, heads, head_dim, pos + t0, cos, sin); });
}

void silu_mul(int level, const float* gu, int64_t ldgu, int64_t n, int64_t inter, float* y, int64_t ldy) {
  const SiluMulFn fn = kernels(level).silu_mul;
  for_rows(n, [&](int64_t t0, int64_t t1) { fn(gu + t0 * ldgu, ldgu, t1 - t0, inter, y + t0 * ldy, ldy); });
}

void gelu_mul(int level, const float* gu, int64_t ldgu, int64_t n, int64_t inter, float* y, int64_t ldy) {
  const GeluMulFn fn = kernels(level).gelu_mul;
  for_rows(n, [&](int64_t t0, int64_t t1) { fn(gu + t0 * ldgu, ldgu, t1 - t0, inter, y + t0 * ldy, ldy); });
}

void softcap_rows(int level, float* x, int64_t ld, int64_t n, int64_t d, float cap) {
  const SoftcapFn fn = kernels(level).softcap;
  for_rows(n, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) fn(x + t * ld, d, cap);
  });
}

void exp_rows(int level, const float* x, int64_t n, float* y) { kernels(level).exp(x, n, y); }

void round_to_half(int level, const float* x, int64_t n, uint16_t* y) { kernels(level).to_half(x, n, y); }

// A sliding window's first visible slot for query i of a sequence (its prefix slots sit at their
// own positions); 0 without a window.
int64_t window_lo(const AttentionBatch& b, int64_t i) {
  return b.window > 0 ? std::max<int64_t>(0, b.positions[i] - b.window + 1) : 0;
}

void paged_attention(int level, const float* q, int64_t ldq, const uint16_t* k_pool, const uint16_t* v_pool,
                     int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                     float softcap, const AttentionBatch& batch, float* out, int64_t ldo) {
  const AttendFn fn = kernels(level).attend;
  const int64_t group = heads / kv_heads;
  // Per sequence: the slots any of its queries sees, from its first visible one on (kv_start,
  // raised to the lowest window's start; a tree's slots stay above it).
  std::vector<int64_t> num_keys(batch.num_seqs), first(batch.num_seqs);
  int64_t work = 0;  // (row, key) pairs of the whole call
  for (int64_t s = 0; s < batch.num_seqs; ++s) {
    int64_t hi = 0, lo = INT64_MAX;
    for (int64_t i = batch.q_start[s]; i < batch.q_start[s + 1]; ++i) {
      hi = std::max(hi, batch.prefix_len[i]);
      lo = std::min(lo, window_lo(batch, i));
      if (batch.tree_row && batch.tree_row[i] >= 0) hi = std::max(hi, batch.tree_start[s] + batch.tree_size[s]);
    }
    if (batch.tree_row && batch.tree_size[s] > 0) lo = std::min(lo, batch.tree_start[s]);
    first[s] = std::max(batch.kv_start ? batch.kv_start[s] : 0, lo == INT64_MAX ? 0 : lo);
    num_keys[s] = std::max<int64_t>(0, hi - first[s]);
    work += (batch.q_start[s + 1] - batch.q_start[s]) * heads * num_keys[s];
  }
  // One task per (sequence, kv head); below ~a few thousand pairs the call takes microseconds
  // and stays on this thread.
  const int64_t tasks = batch.num_seqs * kv_heads;
  const int64_t grain = work >= 4096 ? 1 : std::max<int64_t>(tasks, 1);
  at::parallel_for(0, tasks, grain, [&](int64_t b, int64_t e) {
    // Kept per thread across calls: fresh memory of this size would be page-faulted in anew.
    thread_local std::vector<float> scratch;
    thread_local std::vector<int64_t> shifted, lows, rows;  // prefix_len and windows from the first key; tree rows
    thread_local std::vector<uint8_t> near;                  // a tree's mask rows cut to the window
    for (int64_t task = b; task < e; ++task) {
      const int64_t s = task / kv_heads, kvh = task % kv_heads, i0 = batch.q_start[s];
      const int64_t k0 = first[s];
      AttentionTask t{};
      t.num_q = batch.q_start[s + 1] - i0;
      if (t.num_q == 0) continue;
      t.q = q + i0 * ldq + kvh * group * head_dim;
      t.ldq = ldq;
      t.out = out + i0 * ldo + kvh * group * head_dim;
      t.ldo = ldo;
      t.group = group;
      t.head_dim = head_dim;
      t.scale = scale;
      t.softcap = softcap;
      t.prefix_len = batch.prefix_len + i0;
      if (k0 > 0) {
        shifted.resize(static_cast<size_t>(t.num_q));
        for (int64_t j = 0; j < t.num_q; ++j) shifted[j] = std::max<int64_t>(0, batch.prefix_len[i0 + j] - k0);
        t.prefix_len = shifted.data();
      }
      if (batch.window > 0) {
        lows.resize(static_cast<size_t>(t.num_q));
        for (int64_t j = 0; j < t.num_q; ++j) lows[j] = std::max<int64_t>(0, window_lo(batch, i0 + j) - k0);
        t.lo = lows.data();
      }
      if (batch.tree_row) {
        t.tree_row = batch.tree_row + i0;
        t.tree_mask = batch.tree_mask;
        t.tree_start = batch.tree_start[s] - k0;  // may fall below 0: those nodes' slots are hidden
        t.tree_size = batch.tree_size[s];
        if (batch.window > 0 && t.tree_size > 0) {  // each node's mask row, less the ancestors out of its window
          const int64_t size = t.tree_size;
          near.resize(static_cast<size_t>(t.num_q * size));
          rows.resize(static_cast<size_t>(t.num_q));
          for (int64_t j = 0; j < t.num_q; ++j) {
            rows[j] = batch.tree_row[i0 + j] < 0 ? -1 : j * size;
            for (int64_t m = 0; rows[j] >= 0 && m < size; ++m)
              near[j * size + m] = batch.tree_mask[batch.tree_row[i0 + j] + m] != 0 &&
                                   batch.positions[i0 + m] > batch.positions[i0 + j] - batch.window;
          }
          t.tree_row = rows.data();
          t.tree_mask = near.data();
        }
      }
      t.k = k_pool + kvh * head_dim;
      t.v = v_pool + kvh * head_dim;
      t.blocks = batch.block_table + s * batch.bt_stride;
      t.block_size = block_size;
      t.slot_stride = kv_heads * head_dim;
      t.num_keys = num_keys[s];
      t.first_slot = k0;
      scratch.resize(static_cast<size_t>(attention_scratch_floats(t)));
      fn(t, scratch.data());
    }
  });
}

}  // namespace specserve
