// A Llama-family model's forward pass in one call: every layer's RMSNorm, fused qkv product,
// (Qwen3, Gemma 3) per-head RMSNorm of q and k, RoPE, KV write, paged attention (through a
// sliding window on windowed layers; soft-capped for Gemma 2), o product with the residual,
// RMSNorm, fused gate/up product, SiLU x up (GELU x up for Gemma) and down product with the
// residual, then the final norm. Gemma's sandwich norms normalise the o and down products'
// outputs before their residual adds. The weights stay GGUF blocks (repacked units, qgemm.h); activations are
// float32 between the kernels and quantized per 32-element block right before each product;
// keys and values are kept in the cache as IEEE halves (rounded once when written, widened
// exactly when read). Every kernel computes a token's row from that token's inputs alone, so a
// token's hidden state never depends on the other tokens in the pass.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "layer_ops.h"
#include "model_parts.h"
#include "qgemm.h"

namespace specserve {

namespace {

struct Layer {
  torch::Tensor attn_norm, ffn_norm;  // float32 [hidden]
  Stacked qkv, o, gate_up, down;  // qkv: [q | k | v] rows; gate_up: [gate | up] rows
  torch::Tensor q_norm, k_norm;  // float32 [head_dim] per-head norms before RoPE (Qwen3), or both undefined
  // float32 [hidden] norms of the attention's and the MLP's outputs (Gemma's sandwich), or both undefined
  torch::Tensor post_attn_norm, post_ffn_norm;
  int64_t window = 0;  // the sliding window this layer attends through (layer_ops.h); 0: none
};

// What a family changes in the pass beyond its layers' tensors (the Llama family's by default).
struct ModelOptions {
  double attn_scale = 0.0;     // scores are q.k * attn_scale; 0: 1 / sqrt(head_dim)
  double attn_softcap = 0.0;   // scores soft-capped (layer_ops.h); 0: none (Gemma 2: 50)
  double final_softcap = 0.0;  // logits likewise (softcap_rows); 0: none
  bool gelu = false;           // GeGLU (gelu_mul) instead of SwiGLU
  // RoPE tables of the windowed layers where they are their own (Gemma 3's local base), as
  // cos/sin; undefined: the global ones.
  torch::Tensor cos_local, sin_local;
};

// y[i] += x[i] for i < n (a sandwich norm's output into the residual stream: one rounding each).
void add_into(float* y, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] += x[i];
}

}  // namespace

class NativeModel {
 public:
  NativeModel(int64_t hidden, int64_t heads, int64_t kv_heads, int64_t head_dim, int64_t intermediate, double eps,
              std::vector<Layer> layers, torch::Tensor final_norm, QMatrix lm_head, torch::Tensor cos,
              torch::Tensor sin, ModelOptions options)
      : hidden_(hidden), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), inter_(intermediate),
        eps_(static_cast<float>(eps)), layers_(std::move(layers)), final_norm_(std::move(final_norm)),
        lm_head_(std::move(lm_head)), cos_(std::move(cos)), sin_(std::move(sin)), opt_(std::move(options)) {
    TORCH_CHECK(hidden % kBlock == 0 && intermediate % kBlock == 0 && head_dim % 16 == 0,
                "hidden, intermediate sizes must be multiples of 32 and head_dim of 16");
    TORCH_CHECK(heads % kv_heads == 0, "heads must be a multiple of kv_heads");
    const int64_t qkv_rows = (heads + 2 * kv_heads) * head_dim;
    for (const Layer& l : layers_) {
      check_vector(l.attn_norm, hidden, "attn_norm");
      check_vector(l.ffn_norm, hidden, "ffn_norm");
      TORCH_CHECK(l.qkv.rows == qkv_rows && l.qkv.cols == hidden, "qkv must be [", qkv_rows, ", ", hidden, "]");
      TORCH_CHECK(l.o.rows == hidden && l.o.cols == heads * head_dim, "o must be [hidden, heads * head_dim]");
      TORCH_CHECK(l.gate_up.rows == 2 * intermediate && l.gate_up.cols == hidden, "gate_up must be [2 * inter, hidden]");
      TORCH_CHECK(l.down.rows == hidden && l.down.cols == intermediate, "down must be [hidden, intermediate]");
      TORCH_CHECK(l.q_norm.defined() == l.k_norm.defined(), "q_norm and k_norm come together or not at all");
      if (l.q_norm.defined()) {
        check_vector(l.q_norm, head_dim, "q_norm");
        check_vector(l.k_norm, head_dim, "k_norm");
      }
      TORCH_CHECK(l.post_attn_norm.defined() == l.post_ffn_norm.defined(),
                  "post_attn_norm and post_ffn_norm come together or not at all");
      if (l.post_attn_norm.defined()) {
        check_vector(l.post_attn_norm, hidden, "post_attn_norm");
        check_vector(l.post_ffn_norm, hidden, "post_ffn_norm");
      }
      TORCH_CHECK(l.window >= 0, "a layer's window must be >= 0 (0: none), got ", l.window);
    }
    check_vector(final_norm_, hidden, "final_norm");
    TORCH_CHECK(lm_head_.cols == hidden, "lm_head must have hidden columns");
    check_rope_tables(cos_, sin_, head_dim);
    TORCH_CHECK(opt_.cos_local.defined() == opt_.sin_local.defined(), "cos_local and sin_local come together");
    if (opt_.cos_local.defined()) {
      check_rope_tables(opt_.cos_local, opt_.sin_local, head_dim);
      TORCH_CHECK(opt_.cos_local.size(0) == cos_.size(0), "the local RoPE tables must cover the global ones' positions");
    }
    TORCH_CHECK(opt_.attn_scale >= 0 && opt_.attn_softcap >= 0 && opt_.final_softcap >= 0,
                "attn_scale, attn_softcap and final_softcap must be >= 0 (0: the default, none, none)");
  }

  // x: float32 [n, hidden] embeddings -> final hidden states [n, hidden] (after the final norm).
  // k_cache, v_cache: [num_layers, rows, kv_heads, head_dim] float16, `rows` slots per layer
  // grouped in blocks of block_size; slots[i] is where token i's key and value go.
  // aux_layers int64 [k] (strictly increasing layer indices) with aux_out float32 [n, k * hidden]:
  // the residual stream entering layer aux_layers[j] is copied to aux_out[:, j * hidden : (j + 1) * hidden]
  // (EAGLE-3's captured states, taken in the same pass).
  torch::Tensor forward(int64_t level, torch::Tensor x, torch::Tensor positions, torch::Tensor slots,
                        torch::Tensor k_cache, torch::Tensor v_cache, int64_t block_size, torch::Tensor q_start,
                        torch::Tensor block_table, torch::Tensor prefix_len, c10::optional<torch::Tensor> tree_row,
                        c10::optional<torch::Tensor> tree_start, c10::optional<torch::Tensor> tree_size,
                        c10::optional<torch::Tensor> tree_mask, c10::optional<torch::Tensor> aux_layers,
                        c10::optional<torch::Tensor> aux_out) {
    const int lv = static_cast<int>(level);
    TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.size(1) == hidden_ && x.is_contiguous(),
                "x must be contiguous float32 [n, hidden]");
    const int64_t n = x.size(0);
    check_index(positions, n, "positions");
    const int64_t num_layers = static_cast<int64_t>(layers_.size());
    const int64_t cache_rows = check_kv_cache(k_cache, v_cache, num_layers, kv_heads_, head_dim_, block_size);
    const AttentionBatch batch =
        attention_batch(n, q_start, block_table, prefix_len, tree_row, tree_start, tree_size, tree_mask);
    AttentionBatch windowed = batch;  // a windowed layer's: the same tokens, through its window
    windowed.positions = positions.data_ptr<int64_t>();
    check_slots(slots, n, cache_rows);
    const int64_t* slot = slots.data_ptr<int64_t>();
    const int64_t* aux = nullptr;
    int64_t num_aux = 0;
    float* aux_dst = nullptr;
    TORCH_CHECK(aux_layers.has_value() == aux_out.has_value(), "aux_layers and aux_out come together or not at all");
    if (aux_layers) {
      TORCH_CHECK(aux_layers->dtype() == torch::kInt64 && aux_layers->dim() == 1 && aux_layers->is_contiguous(),
                  "aux_layers must be a contiguous int64 vector, got ", aux_layers->dtype(), " ", aux_layers->sizes());
      aux = aux_layers->data_ptr<int64_t>();
      num_aux = aux_layers->size(0);
      for (int64_t j = 0; j < num_aux; ++j)
        TORCH_CHECK(aux[j] >= 0 && aux[j] < num_layers && (j == 0 || aux[j] > aux[j - 1]), "aux_layers[", j, "] = ",
                    aux[j], ": aux_layers must be strictly increasing layer indices in [0, ", num_layers, ")");
      TORCH_CHECK(aux_out->dtype() == torch::kFloat32 && aux_out->is_contiguous() && aux_out->dim() == 2 &&
                      aux_out->size(0) == n && aux_out->size(1) == num_aux * hidden_,
                  "aux_out must be contiguous float32 [", n, ", ", num_aux * hidden_, "], got ", aux_out->dtype(),
                  " ", aux_out->sizes());
      aux_dst = aux_out->data_ptr<float>();
    }

    const int64_t qd = heads_ * head_dim_, kvd = kv_heads_ * head_dim_, qkv_w = qd + 2 * kvd;
    float* h = reserve(h_, n * hidden_);
    float* qkv = reserve(qkv_, n * qkv_w);
    float* attn = reserve(attn_, n * qd);
    float* gu = reserve(gu_, n * 2 * inter_);
    float* u = reserve(u_, n * inter_);
    const int64_t widest = std::max(std::max(hidden_, qd), inter_);
    act_.resize(static_cast<size_t>(n * (widest / kBlock)));
    ActBlock* act = act_.data();
    auto out = x.clone();  // the residual stream, updated in place layer by layer
    float* xs = out.data_ptr<float>();
    const int64_t* pos = positions.data_ptr<int64_t>();
    const float scale =
        opt_.attn_scale > 0 ? static_cast<float>(opt_.attn_scale) : 1.0f / std::sqrt(static_cast<float>(head_dim_));
    const float softcap = static_cast<float>(opt_.attn_softcap);
    const int64_t layer_halves = cache_rows * kvd;
    uint16_t* k_base = reinterpret_cast<uint16_t*>(k_cache.data_ptr<at::Half>());
    uint16_t* v_base = reinterpret_cast<uint16_t*>(v_cache.data_ptr<at::Half>());

    int64_t next_aux = 0;
    for (int64_t li = 0; li < num_layers; ++li) {
      const Layer& L = layers_[li];
      if (next_aux < num_aux && aux[next_aux] == li) {
        for (int64_t i = 0; i < n; ++i)
          std::copy(xs + i * hidden_, xs + (i + 1) * hidden_, aux_dst + i * num_aux * hidden_ + next_aux * hidden_);
        ++next_aux;
      }
      uint16_t* kc = k_base + li * layer_halves;  // [rows, kv_heads, head_dim] halves
      uint16_t* vc = v_base + li * layer_halves;
      rmsnorm(lv, xs, hidden_, n, hidden_, L.attn_norm.data_ptr<float>(), eps_, h, hidden_);
      quantize_rows(lv, h, n, hidden_, hidden_, act);
      L.qkv.apply(lv, act, n, nullptr, 0, qkv, qkv_w);
      if (L.q_norm.defined()) {  // per-head RMSNorm of q and of k, each row alone
        head_rmsnorm(lv, qkv, qkv_w, n, heads_, head_dim_, L.q_norm.data_ptr<float>(), eps_);
        head_rmsnorm(lv, qkv + qd, qkv_w, n, kv_heads_, head_dim_, L.k_norm.data_ptr<float>(), eps_);
      }
      // q and k heads are adjacent in a qkv row, so one call rotates both.
      const bool local = L.window > 0 && opt_.cos_local.defined();
      rope(lv, qkv, qkv_w, n, heads_ + kv_heads_, head_dim_, pos, (local ? opt_.cos_local : cos_).data_ptr<float>(),
           (local ? opt_.sin_local : sin_).data_ptr<float>());
      for (int64_t i = 0; i < n; ++i) {
        round_to_half(lv, qkv + i * qkv_w + qd, kvd, kc + slot[i] * kvd);
        round_to_half(lv, qkv + i * qkv_w + qd + kvd, kvd, vc + slot[i] * kvd);
      }
      windowed.window = L.window;
      paged_attention(lv, qkv, qkv_w, kc, vc, block_size, heads_, kv_heads_, head_dim_, scale, softcap,
                      L.window > 0 ? windowed : batch, attn, qd);
      quantize_rows(lv, attn, n, qd, qd, act);
      const bool sandwich = L.post_attn_norm.defined();
      if (sandwich) {  // residual + norm(o product): the product alone first
        L.o.apply(lv, act, n, nullptr, 0, h, hidden_);
        rmsnorm(lv, h, hidden_, n, hidden_, L.post_attn_norm.data_ptr<float>(), eps_, h, hidden_);
        add_into(xs, h, n * hidden_);
      } else {
        L.o.apply(lv, act, n, xs, hidden_, xs, hidden_);
      }
      rmsnorm(lv, xs, hidden_, n, hidden_, L.ffn_norm.data_ptr<float>(), eps_, h, hidden_);
      quantize_rows(lv, h, n, hidden_, hidden_, act);
      L.gate_up.apply(lv, act, n, nullptr, 0, gu, 2 * inter_);
      if (opt_.gelu) {
        gelu_mul(lv, gu, 2 * inter_, n, inter_, u, inter_);
      } else {
        silu_mul(lv, gu, 2 * inter_, n, inter_, u, inter_);
      }
      quantize_rows(lv, u, n, inter_, inter_, act);
      if (sandwich) {
        L.down.apply(lv, act, n, nullptr, 0, h, hidden_);
        rmsnorm(lv, h, hidden_, n, hidden_, L.post_ffn_norm.data_ptr<float>(), eps_, h, hidden_);
        add_into(xs, h, n * hidden_);
      } else {
        L.down.apply(lv, act, n, xs, hidden_, xs, hidden_);
      }
    }
    rmsnorm(lv, xs, hidden_, n, hidden_, final_norm_.data_ptr<float>(), eps_, xs, hidden_);
    return out;
  }

  // h: float32 [n, hidden] final hidden states -> logits [n, vocab].
  torch::Tensor logits(int64_t level, torch::Tensor h) {
    TORCH_CHECK(h.dtype() == torch::kFloat32 && h.dim() == 2 && h.size(1) == hidden_ && h.stride(1) == 1,
                "h must be float32 [n, hidden]");
    const int64_t n = h.size(0);
    act_.resize(static_cast<size_t>(std::max<int64_t>(1, n * (hidden_ / kBlock))));
    quantize_rows(static_cast<int>(level), h.data_ptr<float>(), n, hidden_, h.stride(0), act_.data());
    auto out = torch::empty({n, lm_head_.rows}, h.options());
    lm_head_.apply(static_cast<int>(level), act_.data(), n, nullptr, 0, out.data_ptr<float>(), lm_head_.rows);
    if (opt_.final_softcap > 0)
      softcap_rows(static_cast<int>(level), out.data_ptr<float>(), lm_head_.rows, n, lm_head_.rows,
                   static_cast<float>(opt_.final_softcap));
    return out;
  }

 private:
  // Scratch reused across calls: a fresh buffer of megabytes would be page-faulted in at every
  // step, which costs more than the kernels that fill it.
  static float* reserve(std::vector<float>& v, int64_t size) {
    if (static_cast<int64_t>(v.size()) < size) v.resize(static_cast<size_t>(size));
    return v.data();
  }

  int64_t hidden_, heads_, kv_heads_, head_dim_, inter_;
  float eps_;
  std::vector<Layer> layers_;
  torch::Tensor final_norm_;
  QMatrix lm_head_;
  torch::Tensor cos_, sin_;
  ModelOptions opt_;
  std::vector<float> h_, qkv_, attn_, gu_, u_;
  std::vector<ActBlock> act_;
};

void register_model(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<QMatrix>(m, "QMatrix")
      .def(py::init<int64_t, torch::Tensor, int64_t, int64_t, c10::optional<torch::Tensor>>(), py::arg("format"),
           py::arg("units"), py::arg("rows"), py::arg("cols"), py::arg("bias") = py::none())
      .def_readonly("format", &QMatrix::format)
      .def_readonly("rows", &QMatrix::rows)
      .def_readonly("cols", &QMatrix::cols)
      .def_readonly("units", &QMatrix::units);
  py::class_<Stacked>(m, "Stacked").def(py::init<std::vector<QMatrix>>(), py::arg("parts"));
  const auto tensor_or_none = [](const c10::optional<torch::Tensor>& t) { return t ? *t : torch::Tensor(); };
  py::class_<Layer>(m, "Layer")
      .def(py::init([tensor_or_none](torch::Tensor attn_norm, torch::Tensor ffn_norm, Stacked qkv, Stacked o,
                                     Stacked gate_up, Stacked down, c10::optional<torch::Tensor> q_norm,
                                     c10::optional<torch::Tensor> k_norm, c10::optional<torch::Tensor> post_attn_norm,
                                     c10::optional<torch::Tensor> post_ffn_norm, int64_t window) {
             return Layer{std::move(attn_norm),          std::move(ffn_norm),          std::move(qkv),
                          std::move(o),                  std::move(gate_up),           std::move(down),
                          tensor_or_none(q_norm),        tensor_or_none(k_norm),       tensor_or_none(post_attn_norm),
                          tensor_or_none(post_ffn_norm), window};
           }),
           py::arg("attn_norm"), py::arg("ffn_norm"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("q_norm") = py::none(), py::arg("k_norm") = py::none(),
           py::arg("post_attn_norm") = py::none(), py::arg("post_ffn_norm") = py::none(), py::arg("window") = 0);
  py::class_<ModelOptions>(m, "ModelOptions")
      .def(py::init([tensor_or_none](double attn_scale, double attn_softcap, double final_softcap, bool gelu,
                                     c10::optional<torch::Tensor> cos_local, c10::optional<torch::Tensor> sin_local) {
             return ModelOptions{attn_scale, attn_softcap, final_softcap, gelu, tensor_or_none(cos_local),
                                 tensor_or_none(sin_local)};
           }),
           py::arg("attn_scale") = 0.0, py::arg("attn_softcap") = 0.0, py::arg("final_softcap") = 0.0,
           py::arg("gelu") = false, py::arg("cos_local") = py::none(), py::arg("sin_local") = py::none());
  py::class_<NativeModel>(m, "NativeModel")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, std::vector<Layer>, torch::Tensor, QMatrix,
                    torch::Tensor, torch::Tensor, ModelOptions>(),
           py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("intermediate"),
           py::arg("eps"), py::arg("layers"), py::arg("final_norm"), py::arg("lm_head"), py::arg("cos"),
           py::arg("sin"), py::arg("options") = ModelOptions{})
      .def("forward", &NativeModel::forward, py::arg("level"), py::arg("x"), py::arg("positions"), py::arg("slots"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("block_size"), py::arg("q_start"), py::arg("block_table"),
           py::arg("prefix_len"), py::arg("tree_row") = py::none(), py::arg("tree_start") = py::none(),
           py::arg("tree_size") = py::none(), py::arg("tree_mask") = py::none(), py::arg("aux_layers") = py::none(),
           py::arg("aux_out") = py::none(), py::call_guard<py::gil_scoped_release>())
      .def("logits", &NativeModel::logits, py::arg("level"), py::arg("h"), py::call_guard<py::gil_scoped_release>());
}

}  // namespace specserve
