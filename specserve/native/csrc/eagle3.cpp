// EAGLE-3's draft layer (spec/heads/eagle3.py, whose docstring defines the arithmetic) in one
// call per drafting depth, on the kernels the native model uses (model.cpp): fc fuses the
// target's three captured states when the feature has 3 Ht columns; the token embedding and the
// feature are normed side by side into one [n, 2H] row, quantized once for the fused q/k/v
// product of 2H columns; RoPE on q and k; keys and values rounded to halves into the drafter's
// own one-layer paged cache; paged attention; the o product added to the residual (the raw
// feature, or the normed one with norm_before_residual); the SwiGLU block with its residual;
// then, in the same call, the final norm and the draft-vocabulary head. Every kernel computes a
// token's row from that token's inputs alone, as in the target.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <tuple>
#include <vector>

#include "layer_ops.h"
#include "model_parts.h"
#include "qgemm.h"

namespace specserve {

class NativeEagle3 {
 public:
  NativeEagle3(int64_t hidden, int64_t target_hidden, int64_t heads, int64_t kv_heads, int64_t head_dim,
               int64_t intermediate, double eps, bool norm_before_residual, std::optional<QMatrix> fc,
               torch::Tensor input_norm, torch::Tensor hidden_norm, Stacked qkv, Stacked o, torch::Tensor post_norm,
               Stacked gate_up, Stacked down, torch::Tensor final_norm, QMatrix lm_head, int64_t vocab,
               torch::Tensor cos, torch::Tensor sin)
      : hidden_(hidden), target_hidden_(target_hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim),
        inter_(intermediate), vocab_(vocab), eps_(static_cast<float>(eps)),
        norm_before_residual_(norm_before_residual), fc_(std::move(fc)), input_norm_(std::move(input_norm)),
        hidden_norm_(std::move(hidden_norm)), qkv_(std::move(qkv)), o_(std::move(o)), post_norm_(std::move(post_norm)),
        gate_up_(std::move(gate_up)), down_(std::move(down)), final_norm_(std::move(final_norm)),
        lm_head_(std::move(lm_head)), cos_(std::move(cos)), sin_(std::move(sin)) {
    TORCH_CHECK(hidden % kBlock == 0 && intermediate % kBlock == 0 && head_dim % 16 == 0,
                "hidden, intermediate sizes must be multiples of 32 and head_dim of 16");
    TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
    if (fc_) {
      TORCH_CHECK(fc_->rows == hidden && fc_->cols == 3 * target_hidden, "fc must be [", hidden, ", ",
                  3 * target_hidden, "], got [", fc_->rows, ", ", fc_->cols, "]");
      // forward tells the target's states from a feature by their width.
      TORCH_CHECK(3 * target_hidden != hidden, "with hidden = 3 * target_hidden (", hidden,
                  ") a feature cannot be told from the target's three states");
    }
    check_vector(input_norm_, hidden, "input_norm");
    check_vector(hidden_norm_, hidden, "hidden_norm");
    check_vector(post_norm_, hidden, "post_norm");
    check_vector(final_norm_, hidden, "final_norm");
    const int64_t qkv_rows = (heads + 2 * kv_heads) * head_dim;
    TORCH_CHECK(qkv_.rows == qkv_rows && qkv_.cols == 2 * hidden, "qkv must be [", qkv_rows, ", ", 2 * hidden, "]");
    TORCH_CHECK(o_.rows == hidden && o_.cols == heads * head_dim, "o must be [hidden, heads * head_dim]");
    TORCH_CHECK(gate_up_.rows == 2 * intermediate && gate_up_.cols == hidden, "gate_up must be [2 * inter, hidden]");
    TORCH_CHECK(down_.rows == hidden && down_.cols == intermediate, "down must be [hidden, intermediate]");
    TORCH_CHECK(lm_head_.cols == hidden && vocab >= 1 && lm_head_.rows >= vocab && lm_head_.rows - vocab < kUnitRows,
                "lm_head must be [", vocab, " rows padded to 16, ", hidden, "], got [", lm_head_.rows, ", ",
                lm_head_.cols, "]");
    check_rope_tables(cos_, sin_, head_dim);
  }

  // One drafting depth for n tokens -> (out float32 [n, hidden]: the next depth's feature,
  // logits float32 [n, vocab] over the draft vocabulary). last_only: only each sequence's last
  // token goes on past its key and value (a catch-up, where the other tokens only fill the
  // cache: a one-layer drafter needs nothing else from them) -> out [num_seqs, hidden], logits
  // [num_seqs, vocab], each row's bits those of the full call's (every kernel is row-wise).
  // embeds: float32 [n, hidden] token embeddings; feature: float32 [n, hidden], or [n, 3 *
  // target_hidden] the target's captured states (fc applied first). k_cache, v_cache: the
  // drafter's [1, rows, kv_heads, head_dim] float16; the rest is layer_ops.h's AttentionBatch
  // (kv_start [num_seqs]: the first slot each sequence's queries see; none: 0).
  std::tuple<torch::Tensor, torch::Tensor> forward(
      int64_t level, torch::Tensor embeds, torch::Tensor feature, torch::Tensor positions, torch::Tensor slots,
      torch::Tensor k_cache, torch::Tensor v_cache, int64_t block_size, torch::Tensor q_start,
      torch::Tensor block_table, torch::Tensor prefix_len, c10::optional<torch::Tensor> kv_start,
      c10::optional<torch::Tensor> tree_row, c10::optional<torch::Tensor> tree_start,
      c10::optional<torch::Tensor> tree_size, c10::optional<torch::Tensor> tree_mask, bool last_only) {
    const int lv = static_cast<int>(level);
    const int64_t H = hidden_;
    TORCH_CHECK(embeds.dtype() == torch::kFloat32 && embeds.dim() == 2 && embeds.size(1) == H && embeds.is_contiguous(),
                "embeds must be contiguous float32 [n, ", H, "], got ", embeds.dtype(), " ", embeds.sizes());
    int64_t n = embeds.size(0);
    const bool fuse = fc_.has_value() && feature.dim() == 2 && feature.size(1) == 3 * target_hidden_;
    TORCH_CHECK(feature.dtype() == torch::kFloat32 && feature.dim() == 2 && feature.size(0) == n &&
                    (feature.size(1) == H || fuse) && feature.is_contiguous(),
                "feature must be contiguous float32 [", n, ", ", H, "]",
                fc_ ? " or [n, 3 * target_hidden = " + std::to_string(3 * target_hidden_) + "]" : std::string(),
                ", got ", feature.dtype(), " ", feature.sizes());
    check_index(positions, n, "positions");
    const int64_t* pos = positions.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i)
      TORCH_CHECK(pos[i] >= 0 && pos[i] < cos_.size(0), "position ", pos[i], " lies outside the RoPE tables [0, ",
                  cos_.size(0), ")");
    const int64_t cache_rows = check_kv_cache(k_cache, v_cache, 1, kv_heads_, head_dim_, block_size);
    AttentionBatch batch =
        attention_batch(n, q_start, block_table, prefix_len, tree_row, tree_start, tree_size, tree_mask);
    if (kv_start && kv_start->defined()) {
      check_index(*kv_start, batch.num_seqs, "kv_start");
      batch.kv_start = kv_start->data_ptr<int64_t>();
      for (int64_t s = 0; s < batch.num_seqs; ++s)
        TORCH_CHECK(batch.kv_start[s] >= 0, "kv_start[", s, "] = ", batch.kv_start[s], " must be >= 0");
    }
    check_slots(slots, n, cache_rows);
    const int64_t* slot = slots.data_ptr<int64_t>();

    const int64_t qd = heads_ * head_dim_, kvd = kv_heads_ * head_dim_, qkv_w = qd + 2 * kvd;
    float* x = reserve(buf_x_, n * 2 * H);  // [n, 2H]: input_norm(embeds) | hidden_norm(feature)
    float* h = reserve(buf_h_, n * H);
    float* qkv = reserve(buf_qkv_, n * qkv_w);
    float* attn = reserve(buf_attn_, n * qd);
    float* gu = reserve(buf_gu_, n * 2 * inter_);
    float* u = reserve(buf_u_, n * inter_);
    const int64_t widest = std::max({3 * target_hidden_, 2 * H, qd, inter_});
    act_.resize(static_cast<size_t>(std::max<int64_t>(1, n * (widest / kBlock))));
    ActBlock* act = act_.data();

    // The residual stream [n, H]: the feature first (fc's product when fusing).
    auto out = torch::empty({n, H}, embeds.options());
    float* res = out.data_ptr<float>();
    if (fuse) {
      quantize_rows(lv, feature.data_ptr<float>(), n, 3 * target_hidden_, 3 * target_hidden_, act);
      fc_->apply(lv, act, n, nullptr, 0, res, H);
    } else {
      std::copy(feature.data_ptr<float>(), feature.data_ptr<float>() + n * H, res);
    }
    rmsnorm(lv, embeds.data_ptr<float>(), H, n, H, input_norm_.data_ptr<float>(), eps_, x, 2 * H);
    rmsnorm(lv, res, H, n, H, hidden_norm_.data_ptr<float>(), eps_, x + H, 2 * H);
    if (norm_before_residual_)
      for (int64_t i = 0; i < n; ++i) std::copy(x + i * 2 * H + H, x + (i + 1) * 2 * H, res + i * H);

    quantize_rows(lv, x, n, 2 * H, 2 * H, act);
    qkv_.apply(lv, act, n, nullptr, 0, qkv, qkv_w);
    // q and k heads are adjacent in a qkv row, so one call rotates both.
    rope(lv, qkv, qkv_w, n, heads_ + kv_heads_, head_dim_, pos, cos_.data_ptr<float>(), sin_.data_ptr<float>());
    uint16_t* kc = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::Half>());  // [rows, kv_heads, head_dim]
    uint16_t* vc = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::Half>());
    for (int64_t i = 0; i < n; ++i) {
      round_to_half(lv, qkv + i * qkv_w + qd, kvd, kc + slot[i] * kvd);
      round_to_half(lv, qkv + i * qkv_w + qd + kvd, kvd, vc + slot[i] * kvd);
    }
    std::vector<int64_t> last_q_start, last_prefix, last_pos;
    if (last_only) {
      // Compact each sequence's last token into row s (its source row q_start[s + 1] - 1 >= s,
      // and rows above s are still untouched when row s is written) and give the attention one
      // query per sequence.
      TORCH_CHECK(batch.tree_row == nullptr, "last_only takes no tree");
      const int64_t m = batch.num_seqs;
      last_q_start.resize(m + 1);
      last_prefix.resize(m);
      last_pos.resize(m);
      for (int64_t s = 0; s < m; ++s) {
        const int64_t src = batch.q_start[s + 1] - 1;
        TORCH_CHECK(src >= batch.q_start[s], "last_only: sequence ", s, " has no token");
        last_q_start[s] = s;
        last_prefix[s] = batch.prefix_len[src];
        last_pos[s] = pos[src];
        if (src != s) {
          std::copy(qkv + src * qkv_w, qkv + (src + 1) * qkv_w, qkv + s * qkv_w);
          std::copy(res + src * H, res + (src + 1) * H, res + s * H);
        }
      }
      last_q_start[m] = m;
      batch.q_start = last_q_start.data();
      batch.prefix_len = last_prefix.data();
      batch.positions = last_pos.data();
      n = m;
      out = out.narrow(0, 0, m);
    }
    const float scale = 1.0f / std::sqrt(static_cast<float>(head_dim_));
    paged_attention(lv, qkv, qkv_w, kc, vc, block_size, heads_, kv_heads_, head_dim_, scale, 0.0f, batch, attn, qd);
    quantize_rows(lv, attn, n, qd, qd, act);
    o_.apply(lv, act, n, res, H, res, H);
    rmsnorm(lv, res, H, n, H, post_norm_.data_ptr<float>(), eps_, h, H);
    quantize_rows(lv, h, n, H, H, act);
    gate_up_.apply(lv, act, n, nullptr, 0, gu, 2 * inter_);
    silu_mul(lv, gu, 2 * inter_, n, inter_, u, inter_);
    quantize_rows(lv, u, n, inter_, inter_, act);
    down_.apply(lv, act, n, res, H, res, H);

    rmsnorm(lv, res, H, n, H, final_norm_.data_ptr<float>(), eps_, h, H);
    quantize_rows(lv, h, n, H, H, act);
    auto logits = torch::empty({n, lm_head_.rows}, embeds.options());
    lm_head_.apply(lv, act, n, nullptr, 0, logits.data_ptr<float>(), lm_head_.rows);
    if (lm_head_.rows != vocab_) logits = logits.narrow(1, 0, vocab_).contiguous();  // the padding rows' zeros
    return {out, logits};
  }

 private:
  // Scratch reused across calls (as NativeModel's): one call at a time per drafter.
  static float* reserve(std::vector<float>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
    return v.data();
  }

  int64_t hidden_, target_hidden_, heads_, kv_heads_, head_dim_, inter_, vocab_;
  float eps_;
  bool norm_before_residual_;
  std::optional<QMatrix> fc_;
  torch::Tensor input_norm_, hidden_norm_;
  Stacked qkv_, o_;
  torch::Tensor post_norm_;
  Stacked gate_up_, down_;
  torch::Tensor final_norm_;
  QMatrix lm_head_;
  torch::Tensor cos_, sin_;
  std::vector<float> buf_x_, buf_h_, buf_qkv_, buf_attn_, buf_gu_, buf_u_;
  std::vector<ActBlock> act_;
};

void register_eagle3(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<NativeEagle3>(m, "NativeEagle3")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, double, bool, std::optional<QMatrix>,
                    torch::Tensor, torch::Tensor, Stacked, Stacked, torch::Tensor, Stacked, Stacked, torch::Tensor,
                    QMatrix, int64_t, torch::Tensor, torch::Tensor>(),
           py::arg("hidden"), py::arg("target_hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"),
           py::arg("intermediate"), py::arg("eps"), py::arg("norm_before_residual"), py::arg("fc"),
           py::arg("input_norm"), py::arg("hidden_norm"), py::arg("qkv"), py::arg("o"), py::arg("post_norm"),
           py::arg("gate_up"), py::arg("down"), py::arg("final_norm"), py::arg("lm_head"), py::arg("vocab"),
           py::arg("cos"), py::arg("sin"))
      .def("forward", &NativeEagle3::forward, py::arg("level"), py::arg("embeds"), py::arg("feature"),
           py::arg("positions"), py::arg("slots"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_size"),
           py::arg("q_start"), py::arg("block_table"), py::arg("prefix_len"), py::arg("kv_start") = py::none(),
           py::arg("tree_row") = py::none(), py::arg("tree_start") = py::none(), py::arg("tree_size") = py::none(),
           py::arg("tree_mask") = py::none(), py::arg("last_only") = false, py::call_guard<py::gil_scoped_release>());
}

}  // namespace specserve
