// Python entry points of the quantized products: GGUF rows to units and back, float weights to
// GGUF blocks, activation quantization and the products (qgemm.h defines what they compute).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "qgemm.h"

namespace specserve {

namespace {

void check_format(int64_t format) {
  TORCH_CHECK(format_supported(format), "weight format ", format,
              " has no kernel; supported GGML types: Q4_0 (2), Q4_1 (3), Q8_0 (8), Q4_K (12), Q5_K (13), Q6_K (14)");
}

// The blocks per row of units packed by `repack` for `format` with `cols` columns.
int64_t check_units(int64_t format, const torch::Tensor& units, int64_t cols) {
  check_format(format);
  TORCH_CHECK(units.dtype() == torch::kUInt8 && units.dim() == 3 && units.is_contiguous(), "units must come from repack");
  TORCH_CHECK(units.size(2) == static_cast<int64_t>(unit_bytes(format)), "units were packed for another format than ",
              format_name(format));
  TORCH_CHECK(units.size(1) * kBlock == cols, "units hold a weight of ", units.size(1) * kBlock, " columns, not ", cols);
  return units.size(1);
}

torch::Tensor py_repack(int64_t format, torch::Tensor raw, int64_t cols) {
  check_format(format);
  TORCH_CHECK(raw.dtype() == torch::kUInt8 && raw.dim() == 2 && raw.is_contiguous(),
              "raw blocks must be a contiguous uint8 [rows, row_bytes] tensor");
  const int64_t per_block = gguf_block_elements(format);
  TORCH_CHECK(cols > 0 && cols % per_block == 0, format_name(format), " columns (", cols, ") must be a multiple of ",
              per_block, per_block > kBlock ? " (K-quant super-blocks)" : "");
  const int64_t rows = raw.size(0), nb = cols / kBlock;
  TORCH_CHECK(raw.size(1) == static_cast<int64_t>(gguf_block_bytes(format)) * (cols / per_block), "raw rows hold ",
              raw.size(1), " bytes, expected ", gguf_block_bytes(format) * (cols / per_block), " for ", cols, " ",
              format_name(format), " columns");
  const int64_t groups = (rows + kUnitRows - 1) / kUnitRows;
  auto out = torch::empty({groups, nb, static_cast<int64_t>(unit_bytes(format))}, raw.options());
  repack_rows(static_cast<int>(format), raw.data_ptr<uint8_t>(), rows, nb, out.data_ptr<uint8_t>());
  return out;
}

torch::Tensor py_dequantize_rows(int64_t format, torch::Tensor units, int64_t cols, torch::Tensor row_ids) {
  const int64_t nb = check_units(format, units, cols);
  TORCH_CHECK(row_ids.dtype() == torch::kInt64 && row_ids.dim() == 1, "row_ids must be int64 [n]");
  const auto ids = row_ids.contiguous();
  const int64_t n = ids.size(0), limit = units.size(0) * kUnitRows;
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < limit, "row id ", id[i], " is outside the packed rows [0, ", limit, ")");
  auto out = torch::empty({n, cols}, units.options().dtype(torch::kFloat32));
  const uint8_t* u = units.data_ptr<uint8_t>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) dequantize_row(static_cast<int>(format), u, nb, id[i], y + i * cols);
  });
  return out;
}

torch::Tensor py_dequantize_units(int64_t format, torch::Tensor units, int64_t rows, int64_t cols) {
  check_units(format, units, cols);
  TORCH_CHECK(rows >= 0 && rows <= units.size(0) * kUnitRows, "units hold at most ", units.size(0) * kUnitRows,
              " rows, asked for ", rows);
  return py_dequantize_rows(format, units, cols, torch::arange(rows, torch::kInt64));
}

torch::Tensor py_quantize_weight(int64_t format, torch::Tensor w) {
  check_format(format);
  TORCH_CHECK(can_quantize_weight(format), "quantize_weight makes Q8_0 or Q4_1 blocks, not ", format_name(format));
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.dim() == 2, "weights must be float32 [rows, cols]");
  TORCH_CHECK(w.size(1) % kBlock == 0, "weight columns (", w.size(1), ") must be a multiple of 32");
  const auto x = w.contiguous();
  const int64_t rows = x.size(0), cols = x.size(1);
  auto raw = torch::empty({rows, cols / kBlock * static_cast<int64_t>(gguf_block_bytes(format))},
                          x.options().dtype(torch::kUInt8));
  quantize_weight_rows(static_cast<int>(format), x.data_ptr<float>(), rows, cols, raw.data_ptr<uint8_t>());
  return raw;
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
  const int64_t n = x.size(0), k = x.size(1), nb = check_units(format, units, k);
  TORCH_CHECK(rows > 0 && rows <= units.size(0) * kUnitRows, "units hold at most ", units.size(0) * kUnitRows,
              " rows, asked for ", rows);
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
  namespace py = pybind11;
  m.def("repack", &py_repack, "raw GGUF blocks uint8 [rows, row_bytes] -> units uint8 [groups, cols / 32, unit_bytes]",
        py::arg("format"), py::arg("raw"), py::arg("cols"));
  m.def("dequantize_units", &py_dequantize_units, "units -> float32 [rows, cols], bitwise GGUF's dequantization",
        py::arg("format"), py::arg("units"), py::arg("rows"), py::arg("cols"));
  m.def("dequantize_rows", &py_dequantize_rows, "rows row_ids int64 [n] of units -> float32 [n, cols]",
        py::arg("format"), py::arg("units"), py::arg("cols"), py::arg("row_ids"));
  m.def("quantize_weight", &py_quantize_weight, "float32 [rows, cols] -> raw GGUF Q8_0 / Q4_1 blocks uint8 [rows, row_bytes]",
        py::arg("format"), py::arg("w"));
  m.def("quantize_act", &py_quantize, "float32 [n, k] -> ActBlocks uint8 [n, k / 32, 48]", py::arg("level"), py::arg("x"));
  m.def("qgemm", &py_qgemm, "y [n, rows] = x W^T (+ bias) (+ residual) on packed units", py::arg("level"),
        py::arg("format"), py::arg("units"), py::arg("rows"), py::arg("x"), py::arg("bias") = py::none(),
        py::arg("residual") = py::none());
  m.def("unit_bytes", [](int64_t f) { return static_cast<int64_t>(unit_bytes(f)); });
  m.def("gguf_block_bytes", [](int64_t f) { return static_cast<int64_t>(gguf_block_bytes(f)); });
  m.def("gguf_block_elements", [](int64_t f) { return static_cast<int64_t>(gguf_block_elements(f)); });
}

}  // namespace specserve
