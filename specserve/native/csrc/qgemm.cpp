// Quantized products: repacking, the generic (any CPU) kernels, level dispatch and the Python
// entry points. The arithmetic is defined in qgemm.h; the SIMD levels live in qgemm_avx*.cpp.
#include "qgemm.h"

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "half.h"

namespace specserve {

size_t unit_bytes(int format) {
  switch (format) {
    case FMT_Q4_0: return 256 + 32;
    case FMT_Q4_1: return 256 + 64;
    case FMT_Q8_0: return 512 + 32;
    default: return 0;
  }
}

size_t gguf_block_bytes(int format) {
  switch (format) {
    case FMT_Q4_0: return 18;
    case FMT_Q4_1: return 20;
    case FMT_Q8_0: return 34;
    default: return 0;
  }
}

bool format_supported(int format) { return unit_bytes(format) != 0; }

namespace {

// Element e (0..31) of a raw Q4_0 / Q4_1 block's nibbles: elements 0..15 are the low nibbles
// of qs[0..15], 16..31 the high ones.
inline uint8_t gguf_nibble(const uint8_t* qs, int e) {
  return e < 16 ? (qs[e] & 0x0F) : (qs[e - 16] >> 4);
}

void repack_unit(int format, const uint8_t* const* rows, int nrows, int64_t b, uint8_t* unit) {
  const size_t bb = gguf_block_bytes(format);
  std::memset(unit, 0, unit_bytes(format));
  for (int r = 0; r < nrows; ++r) {
    const uint8_t* blk = rows[r] + b * bb;
    uint16_t d;
    std::memcpy(&d, blk, 2);
    if (format == FMT_Q8_0) {
      const int8_t* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) unit[(j * 16 + r) * 4 + e] = static_cast<uint8_t>(q[4 * j + e]);
      std::memcpy(unit + 512 + 2 * r, &d, 2);
      continue;
    }
    const uint8_t* qs = blk + (format == FMT_Q4_1 ? 4 : 2);
    for (int p = 0; p < 4; ++p)
      for (int e = 0; e < 4; ++e)
        unit[(p * 16 + r) * 4 + e] =
            static_cast<uint8_t>(gguf_nibble(qs, 4 * p + e) | (gguf_nibble(qs, 16 + 4 * p + e) << 4));
    std::memcpy(unit + 256 + 2 * r, &d, 2);
    if (format == FMT_Q4_1) std::memcpy(unit + 256 + 32 + 2 * r, blk + 2, 2);
  }
}

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

// One unit decoded to integer weights w[r][i] and float scale / min per row.
struct DecodedUnit {
  int32_t w[kUnitRows][kBlock];
  float dw[kUnitRows];
  float mw[kUnitRows];
  bool has_min;
};

void decode_unit(int format, const uint8_t* u, DecodedUnit& out) {
  out.has_min = format == FMT_Q4_1;
  for (int r = 0; r < kUnitRows; ++r) {
    if (format == FMT_Q8_0) {
      for (int j = 0; j < 8; ++j)
        for (int e = 0; e < 4; ++e) out.w[r][4 * j + e] = static_cast<int8_t>(u[(j * 16 + r) * 4 + e]);
      out.dw[r] = half_to_float(load_half(u + 512 + 2 * r));
      out.mw[r] = 0.0f;
      continue;
    }
    const int offset = format == FMT_Q4_0 ? 8 : 0;
    for (int p = 0; p < 4; ++p)
      for (int e = 0; e < 4; ++e) {
        const uint8_t byte = u[(p * 16 + r) * 4 + e];
        out.w[r][4 * p + e] = (byte & 0x0F) - offset;
        out.w[r][16 + 4 * p + e] = (byte >> 4) - offset;
      }
    out.dw[r] = half_to_float(load_half(u + 256 + 2 * r));
    out.mw[r] = format == FMT_Q4_1 ? half_to_float(load_half(u + 256 + 32 + 2 * r)) : 0.0f;
  }
}

template <int F>
void gemm_generic(const uint8_t* units, int64_t nb, int64_t g0, int64_t g1, const ActBlock* act, int64_t n,
                  const float* bias, const float* residual, int64_t ldr, float* y, int64_t ldy) {
  constexpr int64_t kTile = 32;
  const size_t ub = unit_bytes(F);
  DecodedUnit du;
  float acc[kTile][kUnitRows];
  for (int64_t g = g0; g < g1; ++g) {
    for (int64_t t0 = 0; t0 < n; t0 += kTile) {
      const int64_t tn = n - t0 < kTile ? n - t0 : kTile;
      for (int64_t t = 0; t < tn; ++t)
        for (int r = 0; r < kUnitRows; ++r) acc[t][r] = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        decode_unit(F, units + (g * nb + b) * ub, du);
        for (int64_t t = 0; t < tn; ++t) {
          const ActBlock& a = act[(t0 + t) * nb + b];
          for (int r = 0; r < kUnitRows; ++r) {
            int32_t dot = 0;
            for (int i = 0; i < kBlock; ++i) dot += du.w[r][i] * a.q[i];
            float v = std::fma(static_cast<float>(dot), du.dw[r] * a.d, acc[t][r]);
            if (du.has_min) v = std::fma(du.mw[r], a.sd, v);
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

}  // namespace

void repack_rows(int format, const uint8_t* raw, int64_t rows, int64_t blocks_per_row, uint8_t* out) {
  const int64_t groups = (rows + kUnitRows - 1) / kUnitRows;
  const size_t ub = unit_bytes(format), row_bytes = gguf_block_bytes(format) * blocks_per_row;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* rp[kUnitRows];
      const int nrows = static_cast<int>(std::min<int64_t>(kUnitRows, rows - g * kUnitRows));
      for (int r = 0; r < nrows; ++r) rp[r] = raw + (g * kUnitRows + r) * row_bytes;
      for (int64_t b = 0; b < blocks_per_row; ++b) repack_unit(format, rp, nrows, b, out + (g * blocks_per_row + b) * ub);
    }
  });
}

const GemmKernels& gemm_kernels_generic() {
  static const GemmKernels k = [] {
    GemmKernels t{};
    t.quantize = quantize_generic;
    t.gemm[FMT_Q4_0] = gemm_generic<FMT_Q4_0>;
    t.gemm[FMT_Q4_1] = gemm_generic<FMT_Q4_1>;
    t.gemm[FMT_Q8_0] = gemm_generic<FMT_Q8_0>;
    return t;
  }();
  return k;
}

namespace {

// The kernel table of a level: each entry the level's own, or the next lower level's.
GemmKernels kernels_for(int level) {
  const GemmKernels* chain[4] = {&gemm_kernels_generic(), nullptr, nullptr, nullptr};
#if defined(__x86_64__) || defined(_M_X64)
  if (level >= LEVEL_AVX2) chain[1] = &gemm_kernels_avx2();
  if (level >= LEVEL_AVX512) chain[2] = &gemm_kernels_avx512();
  if (level >= LEVEL_AVX512_VNNI) chain[3] = &gemm_kernels_avx512_vnni();
#endif
  GemmKernels out{};
  for (const GemmKernels* k : chain) {
    if (!k) continue;
    if (k->quantize) out.quantize = k->quantize;
    for (int f = 0; f < 16; ++f)
      if (k->gemm[f]) out.gemm[f] = k->gemm[f];
  }
  return out;
}

const GemmKernels& kernels(int level) {
  static const GemmKernels tables[6] = {kernels_for(0), kernels_for(1), kernels_for(2),
                                        kernels_for(3), kernels_for(4), kernels_for(5)};
  TORCH_CHECK(level >= 0 && level <= LEVEL_AMX, "CPU level ", level, " is not one of 0..5");
  if (!kX86) level = LEVEL_GENERIC;
  return tables[level];
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
  const GemmFn fn = kernels(level).gemm[format];
  TORCH_CHECK(fn != nullptr, "no kernel for weight format ", format);
  const int64_t groups = (rows + kUnitRows - 1) / kUnitRows;
  TORCH_CHECK(groups * kUnitRows == rows, "packed weights need a multiple of 16 rows, got ", rows);
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    fn(units, nb, g0, g1, act, n, bias, residual, ldr, y, ldy);
  });
}

// ---- Python ---------------------------------------------------------------------------------

namespace {

torch::Tensor py_repack(int64_t format, torch::Tensor raw, int64_t cols) {
  TORCH_CHECK(format_supported(format), "weight format ", format, " has no kernel");
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(),
              "raw blocks must be a contiguous uint8 [rows, row_bytes] tensor");
  TORCH_CHECK(cols % kBlock == 0, "columns (", cols, ") must be a multiple of 32");
  const int64_t rows = raw.size(0), nb = cols / kBlock;
  TORCH_CHECK(raw.size(1) == static_cast<int64_t>(gguf_block_bytes(format)) * nb, "raw rows hold ", raw.size(1),
              " bytes, expected ", gguf_block_bytes(format) * nb);
  const int64_t groups = (rows + kUnitRows - 1) / kUnitRows;
  auto out = torch::empty({groups, nb, static_cast<int64_t>(unit_bytes(format))}, raw.options());
  repack_rows(static_cast<int>(format), raw.data_ptr<uint8_t>(), rows, nb, out.data_ptr<uint8_t>());
  return out;
}

void check_act_input(const torch::Tensor& x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1,
              "activations must be float32 [n, k] with unit column stride");
  TORCH_CHECK(x.size(1) % kBlock == 0, "activation width (", x.size(1), ") must be a multiple of 32");
}

torch::Tensor py_quantize(int64_t level, torch::Tensor x) {
  check_act_input(x);
  const int64_t n = x.size(0), k = x.size(1);
  auto out = torch::empty({n, k / kBlock, static_cast<int64_t>(sizeof(ActBlock))}, x.options().dtype(torch::kUInt8));
  quantize_rows(static_cast<int>(level), x.data_ptr<float>(), n, k, x.stride(0),
                reinterpret_cast<ActBlock*>(out.data_ptr<uint8_t>()));
  return out;
}

torch::Tensor py_qgemm(int64_t level, int64_t format, torch::Tensor units, int64_t rows, torch::Tensor x,
                       c10::optional<torch::Tensor> bias, c10::optional<torch::Tensor> residual) {
  check_act_input(x);
  TORCH_CHECK(units.dtype() == torch::kUInt8 && units.dim() == 3 && units.is_contiguous(), "units must come from repack");
  const int64_t n = x.size(0), k = x.size(1), nb = k / kBlock;
  TORCH_CHECK(units.size(1) == nb && units.size(0) * kUnitRows >= rows, "weight of ", units.size(1) * kBlock,
              " columns cannot take activations of width ", k);
  TORCH_CHECK(units.size(2) == static_cast<int64_t>(unit_bytes(format)), "units were packed for another format");
  const int64_t padded = units.size(0) * kUnitRows;
  auto act = py_quantize(level, x);
  auto y = torch::empty({n, padded}, x.options());
  const float* b = nullptr;
  torch::Tensor bias_padded;
  if (bias && bias->defined()) {
    TORCH_CHECK(bias->dtype() == torch::kFloat32 && bias->numel() == rows, "bias must be float32 [rows]");
    bias_padded = torch::zeros({padded}, x.options());
    bias_padded.narrow(0, 0, rows).copy_(*bias);
    b = bias_padded.data_ptr<float>();
  }
  torch::Tensor res_padded;
  const float* r = nullptr;
  if (residual && residual->defined()) {
    TORCH_CHECK(residual->dtype() == torch::kFloat32 && residual->dim() == 2 && residual->size(0) == n &&
                    residual->size(1) == rows,
                "residual must be float32 [n, rows]");
    res_padded = torch::zeros({n, padded}, x.options());
    res_padded.narrow(1, 0, rows).copy_(*residual);
    r = res_padded.data_ptr<float>();
  }
  gemm_rows(static_cast<int>(level), static_cast<int>(format), units.data_ptr<uint8_t>(), padded, nb,
            reinterpret_cast<const ActBlock*>(act.data_ptr<uint8_t>()), n, b, r, padded, y.data_ptr<float>(), padded);
  return padded == rows ? y : y.narrow(1, 0, rows).contiguous();
}

}  // namespace

void register_gemm(pybind11::module_& m) {
  m.def("repack", &py_repack, "raw GGUF blocks uint8 [rows, row_bytes] -> units uint8 [groups, blocks, unit_bytes]",
        pybind11::arg("format"), pybind11::arg("raw"), pybind11::arg("cols"));
  m.def("quantize_act", &py_quantize, "float32 [n, k] -> ActBlocks uint8 [n, k / 32, 48]",
        pybind11::arg("level"), pybind11::arg("x"));
  m.def("qgemm", &py_qgemm, "y [n, rows] = x W^T (+ bias) (+ residual) on packed units",
        pybind11::arg("level"), pybind11::arg("format"), pybind11::arg("units"), pybind11::arg("rows"),
        pybind11::arg("x"), pybind11::arg("bias") = pybind11::none(), pybind11::arg("residual") = pybind11::none());
  m.def("unit_bytes", [](int64_t f) { return static_cast<int64_t>(unit_bytes(f)); });
  m.def("gguf_block_bytes", [](int64_t f) { return static_cast<int64_t>(gguf_block_bytes(f)); });
}

}  // namespace specserve
