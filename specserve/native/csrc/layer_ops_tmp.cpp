// TEMPORARY naive layer ops for integration testing (replaced by the real ones).
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>
#include <algorithm>
#include "layer_ops.h"
namespace specserve {
void rmsnorm(int, const float* x, int64_t ldx, int64_t n, int64_t d, const float* w, float eps, float* y, int64_t ldy) {
  for (int64_t t = 0; t < n; ++t) {
    float s = 0; for (int64_t i = 0; i < d; ++i) s += x[t*ldx+i]*x[t*ldx+i];
    float r = 1.0f / std::sqrt(s / d + eps);
    for (int64_t i = 0; i < d; ++i) y[t*ldy+i] = (x[t*ldx+i]*r)*w[i];
  }
}
void rope(int, float* x, int64_t ld, int64_t n, int64_t heads, int64_t hd, const int64_t* pos, const float* cos, const float* sin) {
  const int64_t half = hd/2;
  for (int64_t t = 0; t < n; ++t) for (int64_t h = 0; h < heads; ++h) {
    float* v = x + t*ld + h*hd; const float* c = cos + pos[t]*half; const float* s = sin + pos[t]*half;
    for (int64_t i = 0; i < half; ++i) { float x1 = v[i], x2 = v[i+half]; v[i] = x1*c[i] - x2*s[i]; v[i+half] = x2*c[i] + x1*s[i]; }
  }
}
void silu_mul(int, const float* gu, int64_t ldgu, int64_t n, int64_t inter, float* y, int64_t ldy) {
  for (int64_t t = 0; t < n; ++t) for (int64_t i = 0; i < inter; ++i) { float g = gu[t*ldgu+i], u = gu[t*ldgu+inter+i]; y[t*ldy+i] = (g/(1+std::exp(-g)))*u; }
}
void paged_attention(int, const float* q, int64_t ldq, const float* kp, const float* vp, int64_t bs, int64_t heads, int64_t kvh, int64_t hd, float scale, const AttentionBatch& b, float* out, int64_t ldo) {
  const int64_t group = heads / kvh;
  for (int64_t s = 0; s < b.num_seqs; ++s) for (int64_t i = b.q_start[s]; i < b.q_start[s+1]; ++i) {
    std::vector<int64_t> vis; for (int64_t p = 0; p < b.prefix_len[i]; ++p) vis.push_back(p);
    if (b.tree_row && b.tree_row[i] >= 0) for (int64_t m = 0; m < b.tree_size[s]; ++m) if (b.tree_mask[b.tree_row[i]+m]) vis.push_back(b.tree_start[s]+m);
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t kh = h / group; std::vector<float> sc(vis.size()); float m = -INFINITY;
      for (size_t j = 0; j < vis.size(); ++j) { int64_t p = vis[j]; int64_t row = b.block_table[s*b.bt_stride + p/bs]*bs + p%bs; const float* k = kp + (row*kvh+kh)*hd; float d = 0; for (int64_t e = 0; e < hd; ++e) d += q[i*ldq+h*hd+e]*k[e]; sc[j] = d*scale; m = std::max(m, sc[j]); }
      float l = 0; std::vector<float> o(hd, 0.0f);
      for (size_t j = 0; j < vis.size(); ++j) { int64_t p = vis[j]; int64_t row = b.block_table[s*b.bt_stride + p/bs]*bs + p%bs; const float* v = vp + (row*kvh+kh)*hd; float w = std::exp(sc[j]-m); l += w; for (int64_t e = 0; e < hd; ++e) o[e] += w*v[e]; }
      for (int64_t e = 0; e < hd; ++e) out[i*ldo+h*hd+e] = o[e]/l;
    }
  }
}
}
