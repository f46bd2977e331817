// Quantized products: the generic (any CPU) kernels and the level dispatch. The arithmetic is
// defined in qgemm.h; the SIMD levels live in qgemm_avx*.cpp, the formats in qformats.cpp and the
// Python entry points in qgemm_py.inc.
#include "qgemm.h"

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include <cmath>

namespace specserve {

namespace {

// ---- generic kernels: plain C++, the definition in qgemm.h written out ----------------------

void quantize_generic(const float* x, int64_t n, int64_t k, int64_t ldx, ActBlock* act) {
  const int64_t nb = k / kBlock;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < nb; ++b) {
      const float* v = x + t * ldx + b * kBlock;
      ActBlock& out = act[t * nb + b];
      float amax = 0.0f;
      for (int i = 0; i < kBlock; ++i) amax = std::fmax(amax, std::fabs(v[i]));
      const float id = amax != 0.0f ? 127.0f / amax : 0.0f;
      int s[2] = {0, 0};
      for (int i = 0; i < kBlock; ++i) {
        int q = static_cast<int>(std::nearbyint(v[i] * id));
        q = q > 127 ? 127 : (q < -127 ? -127 : q);
        out.q[i] = static_cast<int8_t>(q);
        s[i / 16] += q;
      }
      out.d = amax / 127.0f;
      out.s16[0] = static_cast<int16_t>(s[0]);
      out.s16[1] = static_cast<int16_t>(s[1]);
      out.sd = out.d * static_cast<float>(s[0] + s[1]);
      out.pad = 0;
    }
  }
}

template <int F>
void gemm_generic(const uint8_t* units, int64_t nb, int64_t g0, int64_t g1, const ActBlock* act, int64_t n,
                  const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy) {
  constexpr int64_t kTile = 32;
  RowBlock rb[kUnitRows];
  float acc[kTile][kUnitRows];
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      const int64_t tn = n - t0 < kTile ? n - t0 : kTile;
      for (int64_t t = 0; t < tn; ++t)
        for (int r = 0; r < kUnitRows; ++r) acc[t][r] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        for (int r = 0; r < kUnitRows; ++r)
          unpack_row(F, unit_header(F, units, nb, g, b), unit_body(F, units, nb, g, b), r, rb[r]);
        for (int64_t t = 0; t < tn; ++t) {
          const ActBlock& a = act[(t0 + t) * nb + b];
          for (int r = 0; r < kUnitRows; ++r) {
            int32_t half[2] = {0, 0};  // I = sc[0] * (first half's sum) + sc[1] * (second half's)
            for (int h = 0; h < 2; ++h)
              for (int i = 16 * h; i < 16 * h + 16; ++i) half[h] += rb[r].q[i] * a.q[i];
            const int32_t dot = rb[r].sc[0] * half[0] + rb[r].sc[1] * half[1];
            float v = std::fma(static_cast<float>(dot), rb[r].d * a.d, acc[t][r]);
            if (has_min(F)) v = std::fma(rb[r].m, a.sd, v);
            if (has_half_mins(F))
              v = std::fma(static_cast<float>(rb[r].mh[0] * a.s16[0] + rb[r].mh[1] * a.s16[1]), rb[r].dm * a.d, v);
            acc[t][r] = v;
          }
        }
      }
      for (int64_t t = 0; t < tn; ++t) {
        const int64_t row = t0 + t;
        for (int r = 0; r < kUnitRows; ++r) {
          const int64_t col = g * kUnitRows + r;
          float v = acc[t][r];
          if (bias) v = v + bias[col];
          if (residual) v = v + residual[row * ldr + col];
          y[row * ldy + col] = v;
        }
      }
    }
  }
}

constexpr GemmEntry kGenericGemms[] = {
    {FMT_Q4_0, gemm_generic<FMT_Q4_0>}, {FMT_Q4_1, gemm_generic<FMT_Q4_1>}, {FMT_Q8_0, gemm_generic<FMT_Q8_0>},
    {FMT_Q4_K, gemm_generic<FMT_Q4_K>}, {FMT_Q5_K, gemm_generic<FMT_Q5_K>}, {FMT_Q6_K, gemm_generic<FMT_Q6_K>},
    {FMT_Q5_0, gemm_generic<FMT_Q5_0>}, {FMT_Q5_1, gemm_generic<FMT_Q5_1>}, {FMT_IQ4_NL, gemm_generic<FMT_IQ4_NL>},
    {FMT_Q2_K, gemm_generic<FMT_Q2_K>}, {FMT_Q3_K, gemm_generic<FMT_Q3_K>},
};
constexpr int kNumGenericGemms = sizeof(kGenericGemms) / sizeof(kGenericGemms[0]);

}  // namespace

const GemmKernels& gemm_kernels_generic() {
  static const GemmKernels k = make_gemm_kernels(quantize_generic, kGenericGemms, kNumGenericGemms);
  return k;
}

GemmKernels make_gemm_kernels(QuantizeFn quantize, const GemmEntry* entries, int count) {
  GemmKernels t{};
  t.quantize = quantize;
  for (int i = 0; i < count; ++i) t.gemm[entries[i].format] = entries[i].fn;
  return t;
}

namespace {

// The kernel table of a level: each entry the level's own, or the next lower level's.
const GemmKernels* own_kernels(int level) {
  switch (level) {
    case LEVEL_GENERIC: return &gemm_kernels_generic();
#if defined(__x86_64__) || defined(_M_X64)
    case LEVEL_AVX2: return &gemm_kernels_avx2();
    case LEVEL_AVX512: return &gemm_kernels_avx512();
    case LEVEL_AVX512_VNNI: return &gemm_kernels_avx512_vnni();
    case LEVEL_AMX: return amx_permitted() ? &gemm_kernels_amx() : nullptr;
#endif
    default: return nullptr;
  }
}

const GemmKernels& kernels(int level) {
  TORCH_CHECK(level >= 0 && level <= LEVEL_AMX, "CPU level ", level, " is not one of 0..5");
  return level_table<GemmKernels, own_kernels>(level);
}

}  // namespace

// ---- entry points shared with the layer kernels ----------------------------------------------

void quantize_rows(int level, const float* x, int64_t n, int64_t k, int64_t ldx, ActBlock* act) {
  const QuantizeFn fn = kernels(level).quantize;
  const int64_t grain = n >= 64 ? 16 : n;  // one thread for decode-sized batches
  at::parallel_for(0, n, grain, [&](int64_t t0, int64_t t1) {
    fn(x + t0 * ldx, t1 - t0, k, ldx, act + t0 * (k / kBlock));
  });
}

void gemm_rows(int level, int format, const uint8_t* units, int64_t rows, int64_t nb, const ActBlock* act,
               int64_t n, const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy) {
  TORCH_CHECK(format_supported(format), "no kernel for weight format ", format);
  const GemmFn fn = kernels(level).gemm[format];
  const int64_t groups = (rows + kUnitRows - 1) / kUnitRows;
  TORCH_CHECK(groups * kUnitRows == rows, "packed weights need a multiple of 16 rows, got ", rows);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    fn(units, nb, g0, g1, act, n, bias, residual, ldr, y, ldy);
  });
}

}  // namespace specserve
