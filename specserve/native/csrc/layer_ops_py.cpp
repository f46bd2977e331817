// Python entry points of the layer kernels (layer_ops.h): torch tensors in, checked, out.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>

#include "layer_ops.h"
#include "layer_ops_kernels.h"

namespace specserve {

namespace {

// A float32 CPU matrix whose rows may be strided but whose elements within a row are not.
void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dtype() == torch::kFloat32 && x.dim() == 2 && x.stride(1) == 1, name,
              " must be a float32 CPU tensor [n, width] with unit column stride, got ", x.dtype(), " ", x.sizes(),
              " with strides ", x.strides());
}

// An int64 CPU vector of `n` entries (any n when n < 0), contiguous.
void check_index(const torch::Tensor& x, const char* name, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.dtype() == torch::kInt64 && x.dim() == 1 && x.is_contiguous(), name,
              " must be a contiguous int64 CPU vector, got ", x.dtype(), " ", x.sizes());
  TORCH_CHECK(n < 0 || x.size(0) == n, name, " has ", x.size(0), " entries, expected ", n);
}

torch::Tensor py_rmsnorm(int64_t level, torch::Tensor x, torch::Tensor w, double eps) {
  check_rows(x, "x");
  const int64_t n = x.size(0), d = x.size(1);
  TORCH_CHECK(d > 0 && d % 16 == 0, "rmsnorm needs a width that is a multiple of 16, got ", d);
  TORCH_CHECK(w.dtype() == torch::kFloat32 && w.is_contiguous() && w.dim() == 1 && w.size(0) == d,
              "w must be a contiguous float32 vector of ", d, " entries, got ", w.dtype(), " ", w.sizes());
  auto y = torch::empty({n, d}, x.options());
  rmsnorm(static_cast<int>(level), x.data_ptr<float>(), x.stride(0), n, d, w.data_ptr<float>(),
          static_cast<float>(eps), y.data_ptr<float>(), d);
  return y;
}

void py_rope(int64_t level, torch::Tensor x, torch::Tensor pos, torch::Tensor cos, torch::Tensor sin, int64_t heads,
             int64_t head_dim) {
  TORCH_CHECK(head_dim > 0 && head_dim % 2 == 0, "head_dim must be even and positive, got ", head_dim);
  TORCH_CHECK(heads >= 0, "heads must be >= 0, got ", heads);
  if (x.dim() == 3) {  // [n, heads', head_dim], heads' >= heads
    TORCH_CHECK(x.size(2) == head_dim && x.stride(2) == 1 && x.stride(1) == head_dim && x.size(1) >= heads,
                "a 3-d x must be [n, >= ", heads, ", ", head_dim, "] with contiguous heads, got ", x.sizes(),
                " with strides ", x.strides());
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.device().is_cpu(), "x must be float32 on the CPU");
  } else {
    check_rows(x, "x");
    TORCH_CHECK(x.size(1) >= heads * head_dim, "x rows hold ", x.size(1), " floats, fewer than ", heads, " heads of ",
                head_dim);
  }
  const int64_t n = x.size(0), half = head_dim / 2;
  check_index(pos, "pos", n);
  for (const auto* table : {&cos, &sin}) {
    TORCH_CHECK(table->dtype() == torch::kFloat32 && table->is_contiguous() && table->dim() == 2 &&
                    table->size(1) == half && table->size(0) == cos.size(0),
                "cos and sin must be contiguous float32 [max_pos, ", half, "] tables, got ", cos.sizes(), " and ",
                sin.sizes());
  }
  if (n > 0) {
    const int64_t lo = pos.min().item<int64_t>(), hi = pos.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < cos.size(0), "positions must lie in [0, ", cos.size(0), "), got ", lo, "..", hi);
  }
  rope(static_cast<int>(level), x.data_ptr<float>(), x.stride(0), n, heads, head_dim, pos.data_ptr<int64_t>(),
       cos.data_ptr<float>(), sin.data_ptr<float>());
}

torch::Tensor py_silu_mul(int64_t level, torch::Tensor gu) {
  check_rows(gu, "gu");
  const int64_t n = gu.size(0), inter = gu.size(1) / 2;
  TORCH_CHECK(gu.size(1) % 32 == 0 && inter > 0, "gu must be [n, 2 * inter] with inter a multiple of 16, got ",
              gu.sizes());
  auto y = torch::empty({n, inter}, gu.options());
  silu_mul(static_cast<int>(level), gu.data_ptr<float>(), gu.stride(0), n, inter, y.data_ptr<float>(), inter);
  return y;
}

torch::Tensor py_exp(int64_t level, torch::Tensor x) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor");
  auto y = torch::empty_like(x);
  exp_rows(static_cast<int>(level), x.data_ptr<float>(), x.numel(), y.data_ptr<float>());
  return y;
}

torch::Tensor py_paged_attention(int64_t level, torch::Tensor q, torch::Tensor k_pool, torch::Tensor v_pool,
                                 torch::Tensor q_start, torch::Tensor block_table, torch::Tensor prefix_len,
                                 c10::optional<torch::Tensor> tree_row, c10::optional<torch::Tensor> tree_start,
                                 c10::optional<torch::Tensor> tree_size, c10::optional<torch::Tensor> tree_mask,
                                 c10::optional<double> scale) {
  TORCH_CHECK(k_pool.device().is_cpu() && k_pool.dtype() == torch::kFloat32 && k_pool.dim() == 4 &&
                  k_pool.is_contiguous() && v_pool.sizes() == k_pool.sizes() && v_pool.dtype() == k_pool.dtype() &&
                  v_pool.device().is_cpu() && v_pool.is_contiguous(),
              "k_pool and v_pool must be contiguous float32 CPU tensors of one shape [blocks, block_size, kv_heads, "
              "head_dim], got ", k_pool.sizes(), " and ", v_pool.sizes());
  const int64_t pool_blocks = k_pool.size(0), block_size = k_pool.size(1), kv_heads = k_pool.size(2),
                head_dim = k_pool.size(3);
  TORCH_CHECK(head_dim > 0 && head_dim % 16 == 0, "head_dim must be a multiple of 16, got ", head_dim);
  TORCH_CHECK(q.device().is_cpu() && q.dtype() == torch::kFloat32 && q.dim() == 3 && q.size(2) == head_dim &&
                  q.stride(2) == 1 && q.stride(1) == head_dim,
              "q must be float32 [num_tokens, heads, ", head_dim, "] with contiguous heads, got ", q.dtype(), " ",
              q.sizes(), " with strides ", q.strides());
  const int64_t num_tokens = q.size(0), heads = q.size(1);
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, heads, " query heads cannot share ", kv_heads, " kv heads");

  TORCH_CHECK(block_table.device().is_cpu() && block_table.dtype() == torch::kInt64 && block_table.dim() == 2 &&
                  block_table.stride(1) == 1,
              "block_table must be an int64 CPU tensor [num_seqs, blocks] with unit column stride, got ",
              block_table.dtype(), " ", block_table.sizes());
  const int64_t num_seqs = block_table.size(0), capacity = block_table.size(1) * block_size;
  check_index(q_start, "q_start", num_seqs + 1);
  check_index(prefix_len, "prefix_len", num_tokens);
  const int64_t* qs = q_start.data_ptr<int64_t>();
  const int64_t* pl = prefix_len.data_ptr<int64_t>();
  TORCH_CHECK(qs[0] == 0 && qs[num_seqs] == num_tokens, "q_start must run from 0 to num_tokens (", num_tokens,
              "), got ", qs[0], "..", qs[num_seqs]);

  const int given = tree_row.has_value() + tree_start.has_value() + tree_size.has_value() + tree_mask.has_value();
  TORCH_CHECK(given == 0 || given == 4, "tree_row, tree_start, tree_size and tree_mask come together or not at all");
  AttentionBatch batch{num_seqs, qs, block_table.data_ptr<int64_t>(), block_table.stride(0), pl,
                       nullptr, nullptr, nullptr, nullptr};
  int64_t mask_len = 0;
  if (given == 4) {
    check_index(*tree_row, "tree_row", num_tokens);
    check_index(*tree_start, "tree_start", num_seqs);
    check_index(*tree_size, "tree_size", num_seqs);
    TORCH_CHECK(tree_mask->device().is_cpu() && tree_mask->is_contiguous() &&
                    (tree_mask->dtype() == torch::kUInt8 || tree_mask->dtype() == torch::kBool),
                "tree_mask must be a contiguous uint8 or bool CPU tensor");
    batch.tree_row = tree_row->data_ptr<int64_t>();
    batch.tree_start = tree_start->data_ptr<int64_t>();
    batch.tree_size = tree_size->data_ptr<int64_t>();
    batch.tree_mask = static_cast<const uint8_t*>(tree_mask->data_ptr());
    mask_len = tree_mask->numel();
  }

  // Every slot a query sees must lie in its sequence's block table, and those blocks in the pool.
  const int64_t* bt = batch.block_table;
  for (int64_t s = 0; s < num_seqs; ++s) {
    TORCH_CHECK(qs[s] <= qs[s + 1], "q_start must not decrease, got ", qs[s], " then ", qs[s + 1]);
    int64_t reach = 0;
    for (int64_t i = qs[s]; i < qs[s + 1]; ++i) {
      TORCH_CHECK(pl[i] >= 0 && pl[i] <= capacity, "prefix_len[", i, "] = ", pl[i], " lies outside [0, ", capacity,
                  "], the slots of its block table row");
      reach = std::max(reach, pl[i]);
      if (batch.tree_row == nullptr || batch.tree_row[i] < 0) continue;
      const int64_t row = batch.tree_row[i], start = batch.tree_start[s], size = batch.tree_size[s];
      TORCH_CHECK(size >= 0 && start >= 0 && start + size <= capacity, "sequence ", s, "'s tree slots [", start, ", ",
                  start + size, ") lie outside [0, ", capacity, ")");
      TORCH_CHECK(row + size <= mask_len, "tree_row[", i, "] = ", row, " reads past tree_mask (", mask_len,
                  " entries)");
      reach = std::max(reach, start + size);
    }
    for (int64_t b = 0; b * block_size < reach; ++b)
      TORCH_CHECK(bt[s * batch.bt_stride + b] >= 0 && bt[s * batch.bt_stride + b] < pool_blocks, "block_table[", s,
                  ", ", b, "] = ", bt[s * batch.bt_stride + b], " is not a block of the pool (", pool_blocks, ")");
  }

  auto out = torch::empty({num_tokens, heads * head_dim}, q.options());
  const float sc = scale.has_value() ? static_cast<float>(*scale) : 1.0f / std::sqrt(static_cast<float>(head_dim));
  paged_attention(static_cast<int>(level), q.data_ptr<float>(), q.stride(0), k_pool.data_ptr<float>(),
                  v_pool.data_ptr<float>(), block_size, heads, kv_heads, head_dim, sc, batch, out.data_ptr<float>(),
                  heads * head_dim);
  return out;
}

}  // namespace

void register_layer_ops(pybind11::module_& m) {
  namespace py = pybind11;
  m.def("rmsnorm", &py_rmsnorm, "y [n, d] = RMSNorm(x [n, d]) * w (layer_ops.h)", py::arg("level"), py::arg("x"),
        py::arg("w"), py::arg("eps"));
  m.def("rope_", &py_rope, "rotate-half RoPE in place on the first `heads` heads of each row of x",
        py::arg("level"), py::arg("x"), py::arg("pos"), py::arg("cos"), py::arg("sin"), py::arg("heads"),
        py::arg("head_dim"));
  m.def("silu_mul", &py_silu_mul, "y [n, inter] = silu(gu[:, :inter]) * gu[:, inter:]", py::arg("level"),
        py::arg("gu"));
  m.def("exp_ps", &py_exp, "specserve's own expf, elementwise", py::arg("level"), py::arg("x"));
  m.def("paged_attention", &py_paged_attention,
        "attention of flattened query tokens [num_tokens, heads, head_dim] over a paged KV pool -> "
        "[num_tokens, heads * head_dim] (layer_ops.h's AttentionBatch); scale None: 1 / sqrt(head_dim)",
        py::arg("level"), py::arg("q"), py::arg("k_pool"), py::arg("v_pool"), py::arg("q_start"),
        py::arg("block_table"), py::arg("prefix_len"), py::arg("tree_row") = py::none(),
        py::arg("tree_start") = py::none(), py::arg("tree_size") = py::none(), py::arg("tree_mask") = py::none(),
        py::arg("scale") = py::none());
}

}  // namespace specserve
