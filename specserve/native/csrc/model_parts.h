// What the native model (model.cpp) and the native EAGLE-3 drafter (eagle3.cpp) are built
// from: packed weight matrices, fused stacks of them, and the checks of one pass's attention
// metadata. Defined outside an anonymous namespace so that both files (and their Python classes)
// share one QMatrix and one Stacked type.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "layer_ops.h"
#include "qgemm.h"

namespace specserve {

// A weight matrix [rows, cols] as packed units; rows padded to a multiple of 16 inside `units`.
struct QMatrix {
  int64_t format;
  torch::Tensor units;  // uint8 [rows / 16, cols / 32, unit_bytes]
  int64_t rows, cols;
  torch::Tensor bias;  // float32 [rows] or undefined

  QMatrix(int64_t format_, torch::Tensor units_, int64_t rows_, int64_t cols_, c10::optional<torch::Tensor> bias_)
      : format(format_), units(std::move(units_)), rows(rows_), cols(cols_) {
    TORCH_CHECK(format_supported(static_cast<int>(format)), "weight format ", format, " has no kernel");
    TORCH_CHECK(units.dtype() == torch::kUInt8 && units.dim() == 3 && units.is_contiguous(),
                "units must come from repack");
    TORCH_CHECK(rows % kUnitRows == 0 && units.size(0) * kUnitRows == rows, "a fused matrix needs rows padded to 16");
    TORCH_CHECK(cols % kBlock == 0 && units.size(1) * kBlock == cols, "units do not hold ", cols, " columns");
    TORCH_CHECK(units.size(2) == static_cast<int64_t>(unit_bytes(static_cast<int>(format))), "units of another format");
    if (bias_ && bias_->defined()) {
      TORCH_CHECK(bias_->dtype() == torch::kFloat32 && bias_->numel() == rows && bias_->is_contiguous(),
                  "bias must be contiguous float32 [rows]");
      bias = *bias_;
    }
  }

  // y[t, 0..rows) = act[t] W^T (+ bias) (+ residual: may alias y).
  void apply(int level, const ActBlock* act, int64_t n, const float* residual, int64_t ldr, float* y,
             int64_t ldy) const {
    gemm_rows(level, static_cast<int>(format), units.data_ptr<uint8_t>(), rows, cols / kBlock, act, n,
              bias.defined() ? bias.data_ptr<float>() : nullptr, residual, ldr, y, ldy);
  }
};

// Matrices stacked by rows ([q | k | v], [gate | up]), each in its own format: quantized GGUFs
// often mix formats within a layer (Q4_K_M keeps attn_v in Q6_K next to Q4_K q and k).
struct Stacked {
  std::vector<QMatrix> parts;
  int64_t rows = 0, cols = 0;

  explicit Stacked(std::vector<QMatrix> parts_) : parts(std::move(parts_)) {
    TORCH_CHECK(!parts.empty(), "a matrix needs at least one part");
    cols = parts[0].cols;
    for (const QMatrix& p : parts) {
      TORCH_CHECK(p.cols == cols, "stacked parts must have the same columns");
      rows += p.rows;
    }
  }

  void apply(int level, const ActBlock* act, int64_t n, const float* residual, int64_t ldr, float* y,
             int64_t ldy) const {
    int64_t col = 0;
    for (const QMatrix& p : parts) {
      p.apply(level, act, n, residual ? residual + col : nullptr, ldr, y + col, ldy);
      col += p.rows;
    }
  }
};

inline void check_vector(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.dim() == 1 && t.size(0) == n && t.is_contiguous(), what,
              " must be contiguous float32 [", n, "]");
}

inline void check_index(const torch::Tensor& t, int64_t n, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kInt64 && t.is_contiguous() && t.numel() == n, what, " must be contiguous int64 [",
              n, "]");
}

// RoPE tables: float32 [max_positions, head_dim / 2] each.
inline void check_rope_tables(const torch::Tensor& cos, const torch::Tensor& sin, int64_t head_dim) {
  TORCH_CHECK(cos.dtype() == torch::kFloat32 && cos.dim() == 2 && cos.size(1) == head_dim / 2 && cos.is_contiguous() &&
                  sin.sizes() == cos.sizes() && sin.is_contiguous() && sin.dtype() == torch::kFloat32,
              "cos and sin must be contiguous float32 [max_positions, head_dim / 2]");
}

// The KV pools of `layers` layers: contiguous float16 [layers, rows, kv_heads, head_dim] with
// rows in whole blocks; returns rows.
inline int64_t check_kv_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, int64_t layers,
                              int64_t kv_heads, int64_t head_dim, int64_t block_size) {
  TORCH_CHECK(k_cache.dtype() == torch::kHalf && k_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.size(0) == layers && k_cache.size(2) == kv_heads && k_cache.size(3) == head_dim &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.is_contiguous() && v_cache.dtype() == torch::kHalf,
              "k_cache and v_cache must be contiguous float16 [", layers, ", rows, ", kv_heads, ", ", head_dim,
              "], got ", k_cache.dtype(), " ", k_cache.sizes(), " and ", v_cache.dtype(), " ", v_cache.sizes());
  const int64_t rows = k_cache.size(1);
  TORCH_CHECK(block_size >= 1 && rows % block_size == 0, "cache rows must be whole blocks");
  return rows;
}

// One pass's attention metadata for n query tokens (layer_ops.h's AttentionBatch), checked;
// the tensors must outlive the batch.
inline AttentionBatch attention_batch(int64_t n, const torch::Tensor& q_start, const torch::Tensor& block_table,
                                      const torch::Tensor& prefix_len, const c10::optional<torch::Tensor>& tree_row,
                                      const c10::optional<torch::Tensor>& tree_start,
                                      const c10::optional<torch::Tensor>& tree_size,
                                      const c10::optional<torch::Tensor>& tree_mask) {
  check_index(prefix_len, n, "prefix_len");
  TORCH_CHECK(q_start.dtype() == torch::kInt64 && q_start.is_contiguous() && q_start.dim() == 1 &&
                  q_start.size(0) >= 2 && q_start[-1].item<int64_t>() == n,
              "q_start must be int64 [num_seqs + 1] ending at the token count");
  const int64_t num_seqs = q_start.size(0) - 1;
  TORCH_CHECK(block_table.dtype() == torch::kInt64 && block_table.dim() == 2 && block_table.size(0) == num_seqs &&
                  block_table.is_contiguous(),
              "block_table must be contiguous int64 [num_seqs, blocks]");
  AttentionBatch batch{};
  batch.num_seqs = num_seqs;
  batch.q_start = q_start.data_ptr<int64_t>();
  batch.block_table = block_table.data_ptr<int64_t>();
  batch.bt_stride = block_table.size(1);
  batch.prefix_len = prefix_len.data_ptr<int64_t>();
  if (tree_row && tree_row->defined()) {
    TORCH_CHECK(tree_start && tree_size && tree_mask, "a tree needs tree_start, tree_size and tree_mask");
    check_index(*tree_row, n, "tree_row");
    check_index(*tree_start, num_seqs, "tree_start");
    check_index(*tree_size, num_seqs, "tree_size");
    TORCH_CHECK(tree_mask->dtype() == torch::kUInt8 && tree_mask->is_contiguous(), "tree_mask must be uint8");
    batch.tree_row = tree_row->data_ptr<int64_t>();
    batch.tree_start = tree_start->data_ptr<int64_t>();
    batch.tree_size = tree_size->data_ptr<int64_t>();
    batch.tree_mask = tree_mask->data_ptr<uint8_t>();
  }
  return batch;
}

// Every slot a pass writes lies in the cache.
inline void check_slots(const torch::Tensor& slots, int64_t n, int64_t cache_rows) {
  check_index(slots, n, "slots");
  const int64_t* slot = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < cache_rows, "slot ", slot[i], " is outside the cache");
}

}  // namespace specserve
