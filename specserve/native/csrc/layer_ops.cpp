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

// layer_ops.h's attention written as it reads, row by row: the SIMD levels' tiles compute the
// same bits.
void attend_generic(const AttentionTask& t, float* scratch) {
  const int64_t d = t.head_dim;
  float* wide = scratch;           // [d]: one K or V row widened from the pool's halves
  float* scores = wide + d;        // [kKeyBlock]
  float* o = scores + kKeyBlock;   // [d]
  int64_t keys[kKeyBlock];         // the block's visible keys
  for (int64_t r = t.row_begin; r < t.row_end; ++r) {
    const int64_t tq = r / t.group;
    const float* q = t.q_row(r);
    float m = -std::numeric_limits<float>::infinity(), l = 0.0f;
    std::fill(o, o + d, 0.0f);
    int64_t n = 0, block = -1;
    auto flush = [&]() {  // one key block of the online softmax
      float mb = m;
      for (int64_t j = 0; j < n; ++j) {
        widen(t.k + slot_offset(t, keys[j]), d, wide);
        float s = dot16(q, wide, d) * t.scale;
        if (t.softcap > 0.0f) s = softcap_one(s, t.softcap);
        scores[j] = s;
        if (s > mb) mb = s;
      }
      const float alpha = mb > -std::numeric_limits<float>::infinity() ? exp_ps(m - mb) : 0.0f;
      for (int64_t i = 0; i < d; ++i) o[i] = o[i] * alpha;
      l = l * alpha;
      for (int64_t j = 0; j < n; ++j) {
        widen(t.v + slot_offset(t, keys[j]), d, wide);
        const float w = exp_ps(scores[j] - mb);
        for (int64_t i = 0; i < d; ++i) o[i] = std::fma(w, wide[i], o[i]);
        l = l + w;
      }
      m = mb;
      n = 0;
    };
    for (int64_t p = t.from(r); p < t.reach(r); ++p) {
      if (!t.sees(tq, p)) continue;
      const int64_t b = t.key_block(tq, p);
      if (n > 0 && (b != block || n == kKeyBlock)) flush();
      block = b;
      keys[n++] = p;
    }
    if (n > 0) flush();
    float* out = t.out_row(r);
    for (int64_t i = 0; i < d; ++i) out[i] = l != 0.0f ? o[i] / l : 0.0f;
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

// (row, key) pairs below which an attention call stays on the calling thread, where waking the
// pool costs more than the work. A decode step of the embedded model at 300 keys is 2,700 pairs
// (3 kv heads x 3 rows), which the earlier bound of 4,096 left on one of two threads in every
// layer: with its rows in shares (below) a one-token pass there took 0.86-0.93x the time (AVX2,
// 2 threads, alternated processes).
constexpr int64_t kParallelWork = 1024;

void paged_attention(int level, const float* q, int64_t ldq, const uint16_t* k_pool, const uint16_t* v_pool,
                     int64_t block_size, int64_t heads, int64_t kv_heads, int64_t head_dim, float scale,
                     float softcap, const AttentionBatch& batch, float* out, int64_t ldo) {
  const AttendFn fn = kernels(level).attend;
  const int64_t group = heads / kv_heads;
  // Per sequence: the slots any of its queries sees, from its first visible one on (kv_start,
  // raised to the lowest window's start; a tree's slots stay above it).
  std::vector<int64_t> num_keys(batch.num_seqs), first(batch.num_seqs);
  int64_t work = 0;  // (row, key) pairs of the whole call
  // One task per (sequence, kv head, kTileRows rows): a long prompt's rows spread over the threads.
  struct Item {
    int64_t s, kvh, r0, r1;
  };
  std::vector<Item> items;
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
    const int64_t rows = (batch.q_start[s + 1] - batch.q_start[s]) * group;
    work += rows * kv_heads * num_keys[s];
    for (int64_t kvh = 0; kvh < kv_heads; ++kvh)
      for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) items.push_back({s, kvh, r0, std::min(rows, r0 + kTileRows)});
  }
  // Few tasks (decode and verification: one per kv head and sequence) do not divide among the
  // threads: 3 kv heads on 2 threads leave one thread idle for a third of the call. Their rows
  // are cut instead into one contiguous share per thread (a task's rows in pieces: each row's
  // arithmetic is its own, so the bits are those of the task whole).
  const int64_t pool_threads = at::get_num_threads();
  const bool shares = pool_threads > 1 && work >= kParallelWork && static_cast<int64_t>(items.size()) < 4 * pool_threads &&
                      static_cast<int64_t>(items.size()) % pool_threads != 0;
  std::vector<size_t> share_start;  // with shares: thread j runs items [share_start[j], share_start[j + 1])
  if (shares) {
    int64_t total = 0;
    for (const Item& it : items) total += it.r1 - it.r0;
    std::vector<Item> cut;
    share_start.assign(static_cast<size_t>(pool_threads) + 1, 0);
    int64_t before = 0;  // rows of the items before this one
    for (const Item& it : items) {
      for (int64_t j = 0; j < pool_threads; ++j) {  // share j: rows [total * j / n, total * (j + 1) / n)
        const int64_t a = std::max(it.r0, it.r0 + total * j / pool_threads - before);
        const int64_t b = std::min(it.r1, it.r0 + total * (j + 1) / pool_threads - before);
        if (a < b) {
          cut.push_back({it.s, it.kvh, a, b});
          ++share_start[static_cast<size_t>(j) + 1];
        }
      }
      before += it.r1 - it.r0;
    }
    for (size_t j = 1; j < share_start.size(); ++j) share_start[j] += share_start[j - 1];  // pieces come in share order
    items.swap(cut);
  }
  auto run = [&](size_t begin, size_t end, size_t stride) {
    // Kept per thread across calls: fresh memory of this size would be page-faulted in anew.
    thread_local std::vector<float> scratch;
    thread_local std::vector<int64_t> shifted, lows, rows, tree_pos;  // prefix_len and windows from the first key; tree rows
    thread_local std::vector<uint8_t> near;                            // a tree's mask rows cut to the window
    for (size_t it = begin; it < end; it += stride) {
      const int64_t s = items[it].s, kvh = items[it].kvh, i0 = batch.q_start[s];
      const int64_t k0 = first[s];
      AttentionTask t{};
      t.num_q = batch.q_start[s + 1] - i0;
      t.row_begin = items[it].r0;
      t.row_end = items[it].r1;
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
      // A sequence without a tree in a call with trees is a chain (its tokens' tree_row are -1):
      // its rows take the chain tiles, which read each key once for all of them.
      if (batch.tree_row && batch.tree_size[s] > 0) {
        t.tree_row = batch.tree_row + i0;
        t.tree_mask = batch.tree_mask;
        t.tree_start = batch.tree_start[s] - k0;  // may fall below 0: those nodes' slots are hidden
        t.tree_size = batch.tree_size[s];
        // Each tree slot's position (layer_ops.h): its node's, or the tree's start + its depth.
        tree_pos.resize(static_cast<size_t>(t.tree_size));
        for (int64_t m = 0; m < t.tree_size; ++m) {
          const int64_t row = m < t.num_q ? batch.tree_row[i0 + m] : -1;
          int64_t depth = m;
          if (row >= 0) {
            depth = -1;
            for (int64_t a = 0; a < t.tree_size; ++a) depth += batch.tree_mask[row + a] != 0;
          }
          tree_pos[m] = batch.positions != nullptr && m < t.num_q ? batch.positions[i0 + m]
                                                                  : batch.tree_start[s] + depth;
        }
        t.tree_pos = tree_pos.data();
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
  };
  // Below kParallelWork the call stays on this thread; above, thread j takes its share of the
  // rows, or the tasks j, j + threads, ...: a prompt's early (short) and late (long) rows
  // alternate between them.
  const int64_t threads = shares ? pool_threads
                                 : work >= kParallelWork ? std::min<int64_t>(pool_threads, static_cast<int64_t>(items.size())) : 1;
  if (threads <= 1) return run(0, items.size(), 1);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j) {
      if (shares) run(share_start[j], share_start[j + 1], 1);
      else run(static_cast<size_t>(j), items.size(), static_cast<size_t>(threads));
    }
  });
}

}  // namespace specserve
