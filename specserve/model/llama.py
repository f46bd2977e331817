"""Llama-family transformer (Llama 2/3, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2/3, SmolLM, TinyLlama)
over the project's attention interface.

At the embedded model's size a CPU step is the weights' read plus the cost of every other op,
and in a real step that cost is far above a micro-benchmark's: each matrix product streams
megabytes of weights through the caches and evicts the interpreter's and PyTorch's working set,
so a small op after it takes 5-50 us instead of 1-10 (measured on the project's CPU: ~270 us a
layer for ~20 small ops). Hence as few ops per layer as the arithmetic allows: weights fused
where the maths allows it (one [q; k; v] and one [gate; up] projection), RoPE applied to q and
k in one pass with tables gathered once per step, the residual adds fused into the o and down
projections (see linear.py), and one call per RMSNorm.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specserve.errors import InvalidParameterError
from specserve.model.attention import AttentionMetadata, DenseKVCache, windowed_metadata
from specserve.model.config import ModelConfig, check_layer_subset, rope_inv_freq
from specserve.model.flat_attention import FlatKV, GatherBuffers, flat_metadata
from specserve.model.flat_batch import FlatBatch
from specserve.model.linear import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One call. In float32 it is the reference implementation's arithmetic exactly; in
        # bfloat16/float16 torch normalises and scales in float32 and rounds once, where the
        # reference rounds before scaling too (a difference within half-precision rounding).
        # Under autocast (drafter training) x arrives in bfloat16 while the weight stays float32:
        # the weight follows x so that torch keeps its fused kernel (a no-op otherwise).
        # A float32 weight next to half-precision x is Gemma's (1 + w), which its reference
        # multiplies in float32 before rounding once: so does this (exact in float32 alike).
        if self.weight.dtype == torch.float32 and x.dtype != torch.float32 and not torch.is_autocast_enabled():
            return F.rms_norm(x.float(), self.weight.shape, self.weight, self.eps).to(x.dtype)
        return F.rms_norm(x, self.weight.shape, self.weight.to(x.dtype), self.eps)


class RotaryEmbedding(nn.Module):
    """Full-width tables [positions, head_dim] in float32, gathered by position: cos is
    [cos, cos] and sin is [-sin, sin], so that rotate-half RoPE is x * cos + swap_halves(x) * sin.

    `positions`: how many the tables cover, the engine's max_model_len where the loader knows it
    (None: the model's whole context). A file's context can be millions of tokens; the tables
    of a request's context are what a pass reads. `local`: the windowed layers' own tables
    (ModelConfig.local_rope_theta)."""

    def __init__(self, cfg: ModelConfig, positions: int | None = None, local: bool = False):
        super().__init__()
        rows = cfg.max_position_embeddings if positions is None else min(positions, cfg.max_position_embeddings)
        freqs = torch.outer(torch.arange(rows, dtype=torch.float32), rope_inv_freq(cfg, local))
        self.register_buffer("cos", torch.cat((freqs.cos(), freqs.cos()), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-freqs.sin(), freqs.sin()), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] (or flat [N]) -> cos, sin [B, T, 1, head_dim] ([N, 1, head_dim]),
        broadcast over heads."""
        return self.cos[positions].unsqueeze(-2).to(dtype), self.sin[positions].unsqueeze(-2).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. x: [..., H, D]; cos, sin: [..., 1, D] from RotaryEmbedding.tables.

    The same products and sums, rounded the same way, as the reference's
    x * cos + cat(-x2, x1) * sin, in four ops instead of eight. (A fused multiply-add would save
    one more but rounds differently: 9e-5 off the reference's logits in float32.)
    """
    swapped = torch.roll(x, x.shape[-1] // 2, dims=-1)  # [x2, x1], a new tensor
    return (x * cos).add_(swapped.mul_(sin))


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # Split sizes along the head axis of the qkv output: [q, k | v], then [q | k].
        self.qk_v_heads = [cfg.num_heads + cfg.num_kv_heads, cfg.num_kv_heads]
        self.q_k_heads = [cfg.num_heads, cfg.num_kv_heads]
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        # Qwen3: RMSNorm over each head of q and of k (weights [head_dim]) before RoPE.
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
                meta: AttentionMetadata, cache: DenseKVCache) -> torch.Tensor:
        """h: normalised [B, T, hidden] -> residual + attention output [B, T, hidden] (the output
        alone where residual is None); or, in a flattened pass (FlatKV and its metadata),
        [N, hidden] -> [N, hidden]."""
        qkv = self.qkv_proj(h).unflatten(-1, (-1, self.head_dim))  # [B, T, H + 2 Hkv, D] or [N, ...]
        # q and k heads are adjacent, so one RoPE call rotates both.
        qk, v = qkv.split(self.qk_v_heads, dim=-2)
        if self.q_norm is not None:
            q, k = qk.split(self.q_k_heads, dim=-2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-2)
        q, k = apply_rope(qk, cos, sin).split(self.q_k_heads, dim=-2)
        out = cache.attend(self.layer, q, k, v, meta)
        return self.o_proj(out) if residual is None else self.o_proj.forward_add(out, residual)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gelu = cfg.activation == "gelu_tanh"
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """h: normalised [B, T, hidden] -> residual + SwiGLU(h) (GeGLU(h) for Gemma) [B, T, hidden];
        the MLP's output alone where residual is None."""
        gate, up = self.gate_up_proj(h).split(self.intermediate, dim=-1)
        act = (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)).mul_(up)
        return self.down_proj(act) if residual is None else self.down_proj.forward_add(act, residual)


class DecoderLayer(nn.Module):
    """Pre-norm residual blocks; with sandwich norms (Gemma) the attention's and the MLP's
    outputs are normalised too before their residual adds, and the MLP's input norm is
    pre_feedforward_layernorm (post_attention_layernorm then being the attention output's)."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.windowed = cfg.windowed(layer)  # attends through the sliding window (LayerInputs.local)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, meta, cache):
        if not self.sandwich:
            x = self.self_attn(self.input_layernorm(x), x, cos, sin, meta, cache)
            return self.mlp(self.post_attention_layernorm(x), x)
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), None, cos, sin, meta, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x), None))


@dataclass(slots=True)
class LayerInputs:
    """What the layers of one kind (global, or windowed) read in a pass."""

    meta: object  # attention metadata: its masks, and the model's scale and soft-cap
    cos: torch.Tensor  # RoPE tables gathered at the tokens' positions (RotaryEmbedding.tables)
    sin: torch.Tensor


def layer_inputs(model, meta, windowed_meta, positions: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[LayerInputs, LayerInputs | None]:
    """(the global layers' inputs, the windowed layers' or None) of a pass; `windowed_meta`:
    a function of the window giving the windowed layers' metadata (called only when there are
    some). `model`: a LlamaModel or a view of one (its config, rotary tables)."""
    cfg = model.config
    meta = replace(meta, scale=None if cfg.query_pre_attn_scalar is None else cfg.attention_scale,
                   softcap=cfg.attn_logit_softcapping)
    cos, sin = model.rotary.tables(positions, dtype)
    full = LayerInputs(meta, cos, sin)
    if not cfg.window_layers:
        return full, None
    local = model.rotary_local
    lcos, lsin = (cos, sin) if local is None else local.tables(positions, dtype)
    return full, LayerInputs(replace(windowed_meta(cfg.sliding_window), scale=meta.scale, softcap=meta.softcap),
                             lcos, lsin)


def run_layers(layers, x: torch.Tensor, inputs: tuple[LayerInputs, LayerInputs | None], cache,
               capture: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """x through `layers`, each with its kind's inputs -> (x, the residual streams entering the
    layers of index `capture`)."""
    captured = []
    for i, layer in enumerate(layers):
        if i in capture:
            captured.append(x)  # a layer returns a new tensor: x itself is never written
        inp = inputs[1] if layer.windowed else inputs[0]
        x = layer(x, inp.cos, inp.sin, inp.meta, cache)
    return x, captured


def check_aux_layers(aux_layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """`aux_layers` (the layers whose entering residual streams a pass captures, EAGLE-3's
    target states) as a tuple of strictly increasing indices in [0, num_layers), at least one."""
    aux = tuple(aux_layers)
    if (not aux or any(isinstance(i, bool) or not isinstance(i, int) for i in aux)
            or any(b <= a for a, b in zip(aux, aux[1:])) or aux[0] < 0 or aux[-1] >= num_layers):
        raise InvalidParameterError("aux_layers", list(aux),
                                    f"must be strictly increasing layer indices in [0, {num_layers}), at least one")
    return aux


class LlamaModel(nn.Module):
    """forward(input_ids [B, T], meta, cache) -> hidden states [B, T, hidden] (padded batches);
    forward_flat(flat, k, v) -> hidden [N, hidden] (a flattened pass, the native model's call);
    forward_flat_aux(flat, k, v, aux_layers) -> the same and the captured residual streams;
    compute_logits(hidden [..., hidden]) -> float32 logits [..., vocab]."""

    def __init__(self, cfg: ModelConfig, positions: int | None = None, tables_device: torch.device | str | None = None):
        """tables_device: where the RoPE tables are computed, when the rest is built on the meta
        device to be assigned loaded weights (weights.build_model)."""
        super().__init__()
        self.config = cfg
        # Built on the meta device and assigned loaded weights (weights.build_model): the weight
        # is given, not initialised (a meta normal_ would import torch._dynamo: 1-2 s a process).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        with torch.device(tables_device) if tables_device is not None else contextlib.nullcontext():
            self.rotary = RotaryEmbedding(cfg, positions)
            # The windowed layers' own RoPE tables (Gemma 3's local base), or None: the same tables.
            self.rotary_local = RotaryEmbedding(cfg, positions, local=True) if cfg.local_rope_theta is not None else None
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kv_gather = GatherBuffers()  # forward_flat's key/value gathers, reused pass after pass

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores: the model's own dtype on the torch path."""
        return self.dtype

    @property
    def max_positions(self) -> int:
        """Positions the RoPE tables cover: no request's context may be longer."""
        return self.rotary.cos.shape[0]

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] -> embeddings [..., hidden]; Gemma's times sqrt(hidden) rounded to the model
        dtype first, as its reference multiplies."""
        x = self.embed_tokens(ids)
        if self.config.embed_scale:
            x = x * torch.tensor(math.sqrt(self.config.hidden_size)).to(x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, cache: DenseKVCache) -> torch.Tensor:
        x = self.embed(input_ids)
        inputs = layer_inputs(self, meta, lambda w: windowed_metadata(meta, w, x.dtype), meta.positions, x.dtype)
        return self.norm(run_layers(self.layers, x, inputs, cache)[0])

    def forward_flat(self, flat: FlatBatch, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The tokens of every request in one pass, without padding (NativeLlamaModel.forward_flat's
        call and semantics). flat: on the host; k, v: [num_layers, rows, Hkv, D], the cache pools
        viewed by cache row -> hidden [N, hidden]."""
        return self._flat_pass(flat, k, v, ())[0]

    def forward_flat_aux(self, flat: FlatBatch, k: torch.Tensor, v: torch.Tensor,
                         aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_flat, also capturing the residual stream entering each layer of `aux_layers`
        (strictly increasing) -> hidden [N, hidden], aux [N, len(aux_layers) * hidden] (layer
        aux_layers[j]'s input in columns [j * hidden, (j + 1) * hidden))."""
        return self._flat_pass(flat, k, v, check_aux_layers(aux_layers, len(self.layers)))

    def _flat_pass(self, flat: FlatBatch, k: torch.Tensor, v: torch.Tensor,
                   aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        x, inputs = flat_inputs(self, flat, k.dtype)  # [N, hidden]
        x, captured = run_layers(self.layers, x, inputs, FlatKV(k, v, self.kv_gather), aux_layers)
        aux = torch.cat(captured, dim=-1) if captured else x.new_empty(x.shape[0], 0)
        return self.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return softcap(self.lm_head(hidden).float(), self.config.final_logit_softcapping)

    def with_layers(self, keep: Sequence[int]) -> LlamaLayerView:
        """A view that runs only the decoder layers `keep` (increasing indices), sharing this
        model's modules: no weight is copied (see LlamaLayerView)."""
        return LlamaLayerView(self, check_layer_subset(keep, len(self.layers)))


def softcap(logits: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(logits / cap) (Gemma 2's final soft-capping), or the logits where cap is None."""
    return logits if cap is None else torch.tanh(logits / cap) * cap


def flat_inputs(model, flat: FlatBatch, kv_dtype: torch.dtype) -> tuple[torch.Tensor, tuple]:
    """A flattened pass's embeddings [N, hidden] and its layers' inputs (layer_inputs)."""
    meta = flat_metadata(flat, model.device, kv_dtype)
    x = model.embed(meta.token_ids)  # [N, hidden]
    windowed = lambda w: flat_metadata(flat, model.device, kv_dtype, window=w)  # noqa: E731
    return x, layer_inputs(model, meta, windowed, meta.positions, x.dtype)


class LlamaLayerView(nn.Module):
    """A LlamaModel that skips decoder layers: the same embeddings, kept layers, final norm and
    LM head modules (shared, not copied). Its config's num_layers is the kept count, and its KV
    cache holds the kept layers only, in order. It has forward_flat (the runner's call), not
    the padded forward."""

    def __init__(self, base: LlamaModel, keep: tuple[int, ...]):
        super().__init__()
        self.keep = keep
        self.config = base.config.subset(keep)
        self.embed_tokens, self.norm, self.rotary, self.lm_head = base.embed_tokens, base.norm, base.rotary, base.lm_head
        self.rotary_local = base.rotary_local
        self.layers = nn.ModuleList(base.layers[i] for i in keep)
        # The kept layers know their index in the full model; the view's cache numbers them 0..
        self.cache_layer = {layer.self_attn.layer: j for j, layer in enumerate(self.layers)}
        self.kv_gather = GatherBuffers()

    dtype = LlamaModel.dtype
    kv_dtype = LlamaModel.kv_dtype
    max_positions = LlamaModel.max_positions
    device = LlamaModel.device
    embed = LlamaModel.embed
    compute_logits = LlamaModel.compute_logits

    def forward_flat(self, flat: FlatBatch, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """LlamaModel.forward_flat over the kept layers; k, v: [len(keep), rows, Hkv, D]."""
        x, inputs = flat_inputs(self, flat, k.dtype)  # [N, hidden]
        cache = _RenumberedKV(FlatKV(k, v, self.kv_gather), self.cache_layer)
        return self.norm(run_layers(self.layers, x, inputs, cache)[0])


class _RenumberedKV:
    """A cache seen through a map from a layer's index in the full model to its index here."""

    def __init__(self, cache: FlatKV, index: dict[int, int]):
        self.cache, self.index = cache, index

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        return self.cache.attend(self.index[layer], q, k, v, meta)
