"""The Llama-family model on specserve's native kernels: weights kept as GGUF blocks.

A quantized GGUF's matrices stay in their own block formats (repacked for the kernels, the
bits unchanged); float weights (a Hugging Face folder, a float GGUF, a block format without a
kernel) are quantized at load to Q8_0 (`int8`) or Q4_1 (`int4`). A pass is one call into C++
(specserve/native/csrc/model.cpp) over the flattened tokens of the batch, and every kernel
computes a token's row from that token's inputs alone: a token's logits are bit-identical
whether it is decoded alone, verified among draft tokens, or batched with other requests.

Activations are float32 between the kernels and quantized to int8 per 32-element block before
each product, as llama.cpp does. Keys and values are kept in float16 (`kv_dtype`): attention
reads every cached key and value of a request each pass, and at long contexts and many requests
in flight those reads, not the weights, bound a pass; half the bytes (11 significant bits, ample
for values that RMSNorm and RoPE keep within a few units) halves them. The float32 torch path (`--dtype float32`) stays the exact
reference that the tests compare with transformers.
"""

from __future__ import annotations

from collections.abc import Sequence
import math
from dataclasses import dataclass
from types import ModuleType

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from torch import nn

from specserve.errors import ModelLoadError
from specserve.model.config import ModelConfig, check_layer_subset
from specserve.model.flat_batch import FlatBatch
from specserve.model.hugepages import HugeArena
from specserve.model.llama import RotaryEmbedding, check_aux_layers

# What --quantization asks for a float weight, and the format a weight without a kernel of its
# own is requantized to.
QUANT_FORMATS = {"int8": GGMLQuantizationType.Q8_0, "int4": GGMLQuantizationType.Q4_1,
                 "q8_0": GGMLQuantizationType.Q8_0, "q4_0": GGMLQuantizationType.Q4_0,
                 "q4_1": GGMLQuantizationType.Q4_1}
FALLBACK_FORMAT = GGMLQuantizationType.Q8_0
_UNIT_ROWS = 16


@dataclass(slots=True)
class Blocks:
    """A weight as GGUF blocks: raw [rows, row_bytes] uint8 of `format`, a [rows, cols] matrix."""

    format: GGMLQuantizationType
    raw: np.ndarray
    rows: int
    cols: int

    def dequantized(self) -> torch.Tensor:
        """float32 [rows, cols], the gguf package's dequantization: computed by the native kernels
        where they take the format (bit for bit the same floats, test_native_gemm; ~10x faster
        than the package's numpy), else by the package."""
        from specserve import native

        ext = native.load()
        if ext is not None and self.on_kernels(ext):
            units = ext.repack(int(self.format), torch.from_numpy(np.ascontiguousarray(self.raw)), self.cols)
            return ext.dequantize_units(int(self.format), units, self.rows, self.cols)
        return torch.from_numpy(np.asarray(dequantize(self.raw, self.format), dtype=np.float32).reshape(self.rows, self.cols))

    def on_kernels(self, ext: ModuleType) -> bool:
        """Whether the native kernels compute on these blocks as they are: a format they have,
        and rows of whole super-blocks."""
        return ext.unit_bytes(int(self.format)) > 0 and self.cols % _block_elements(ext, self.format) == 0

    def row_slice(self, start: int, stop: int) -> Blocks:
        """Rows [start, stop) (a fused checkpoint tensor's part: blocks never span rows)."""
        return Blocks(self.format, self.raw[start:stop], stop - start, self.cols)

    def take_rows(self, order: np.ndarray) -> Blocks:
        return Blocks(self.format, np.ascontiguousarray(self.raw[order]), self.rows, self.cols)


Weight = Blocks | torch.Tensor


def kernel_formats(ext: ModuleType) -> set[GGMLQuantizationType]:
    """Block formats the native kernels compute on directly."""
    return {t for t in GGMLQuantizationType if ext.unit_bytes(int(t)) > 0}


def as_blocks(w: Weight, fmt: GGMLQuantizationType, requantize: bool, ext: ModuleType) -> Blocks:
    """`w` in a format the kernels take: its own blocks when they have a kernel (and fit its
    super-blocks) and `requantize` is off, else quantized to `fmt` from float32."""
    if isinstance(w, Blocks) and not requantize and w.on_kernels(ext):
        return w
    dense = (w.dequantized() if isinstance(w, Blocks) else w).float().contiguous()
    rows, cols = dense.shape
    if cols % 32:
        raise ModelLoadError(f"a weight of {cols} columns cannot be quantized in 32-element blocks")
    if fmt in _NATIVE_QUANTIZERS:
        raw = ext.quantize_weight(int(fmt), dense).numpy()
    else:
        raw = quantize(dense.numpy(), fmt)
    return Blocks(fmt, raw, rows, cols)


# Formats whose load-time quantizer is native (bit-identical to the gguf package's, faster).
_NATIVE_QUANTIZERS = (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1)


def _block_elements(ext: ModuleType, fmt: GGMLQuantizationType) -> int:
    return int(ext.gguf_block_elements(int(fmt)))


class PackedRows(nn.Module):
    """The rows of a packed matrix [V, H]: `forward(ids)` looks rows up (the token embedding,
    without a float copy of the table); `weight` [V, H] float32, dequantized when asked, is
    for drafters that fingerprint the embedding or read the vocabulary projection's rows."""

    def __init__(self, ext: ModuleType, fmt: GGMLQuantizationType, units: torch.Tensor, vocab: int, hidden: int):
        super().__init__()
        self.ext, self.format, self.units, self.vocab, self.hidden = ext, int(fmt), units, vocab, hidden

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [...] int64 -> float32 [..., hidden], bitwise the gguf package's dequantization."""
        rows = self.ext.dequantize_rows(self.format, self.units, self.hidden, ids.reshape(-1).long().contiguous())
        return rows.reshape(*ids.shape, self.hidden)

    @property
    def weight(self) -> torch.Tensor:
        return self.ext.dequantize_units(self.format, self.units, self.units.shape[0] * 16, self.hidden)[: self.vocab]


@dataclass(frozen=True, slots=True)
class NativeParts:
    """What an `ext.NativeModel` is built from, kept so that a view over a subset of the layers
    can be built on the same tensors (`NativeLlamaModel.with_layers`): the C++ Layer and QMatrix
    hold torch tensors by reference, so a second NativeModel copies no weight."""

    ext: ModuleType
    layers: tuple  # ext.Layer per decoder layer
    final_norm: torch.Tensor  # float32 [hidden]
    lm_head: object  # ext.QMatrix
    cos: torch.Tensor  # float32 [max_positions, head_dim / 2]
    sin: torch.Tensor
    layer_bytes: tuple[int, ...]  # packed bytes of each layer's matrices
    options: object  # ext.ModelOptions: the family's scale, soft-caps, GeGLU, local RoPE tables

    def core(self, cfg: ModelConfig, keep: Sequence[int]):
        return self.ext.NativeModel(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                                    cfg.intermediate_size, cfg.rms_norm_eps, [self.layers[i] for i in keep],
                                    self.final_norm, self.lm_head, self.cos, self.sin, self.options)


class NativeLlamaModel(nn.Module):
    """forward_flat(batch, cache) -> final hidden states [N, hidden]; forward_flat_aux(batch,
    cache, aux_layers) -> the same and the residual streams entering those layers; compute_logits(hidden
    [..., hidden]) -> float32 logits [..., vocab]. CPU only, float32 activations, float16 KV cache."""

    native = True

    def __init__(self, cfg: ModelConfig, parts: NativeParts, embed_tokens: nn.Module, lm_head: nn.Module, level: int,
                 quantization: str, description: str, weight_bytes: int, keep: Sequence[int] | None = None):
        super().__init__()
        self.weight_bytes = weight_bytes  # of the packed matrices: what a pass reads
        self.quantization = quantization  # how it was loaded: "gguf", "int8" or "int4"
        # The decoder layers this model runs, in order (indices into parts.layers): all of them
        # for a loaded model, a subset for a view made by with_layers.
        self.keep = tuple(range(len(parts.layers)) if keep is None else keep)
        self.base_config = cfg  # every layer's (a view's config holds its kept layers')
        self.config = cfg.subset(self.keep)
        self.parts = parts
        self.core = parts.core(cfg, self.keep)
        self.embed_tokens = embed_tokens
        self.lm_head = lm_head
        self.level = level
        self.description = description

    def with_layers(self, keep: Sequence[int]) -> NativeLlamaModel:
        """A view that runs only the decoder layers `keep` (indices of this model's layers, in
        increasing order), with the same embeddings, final norm and LM head, sharing every
        weight: its config's num_layers is len(keep), and its KV cache holds those layers only."""
        keep = check_layer_subset(keep, len(self.keep))
        kept = [self.keep[i] for i in keep]
        skipped = sum(self.parts.layer_bytes[i] for i in set(self.keep) - set(kept))
        return NativeLlamaModel(self.base_config, self.parts,
                                self.embed_tokens, self.lm_head, self.level, self.quantization, self.description,
                                self.weight_bytes - skipped, kept)

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32

    @property
    def kv_dtype(self) -> torch.dtype:
        """What the KV cache stores: halves, rounded to nearest even when written (model.cpp)."""
        return torch.float16

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def max_positions(self) -> int:
        """Positions the RoPE tables cover: no request's context may be longer (the kernels
        read the tables by position unchecked)."""
        return self.parts.cos.shape[0]

    def forward_flat(self, batch: FlatBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """k_cache, v_cache: [num_layers, rows, kv_heads, head_dim] float16 (the pools, viewed by
        cache row) -> hidden [N, hidden]."""
        x = self._embed(batch.token_ids)  # [N, hidden]
        return self.core.forward(self.level, x, batch.positions, batch.slots, k_cache, v_cache, batch.block_size,
                                 batch.q_start, batch.block_table, batch.prefix_len, batch.tree_row,
                                 batch.tree_start, batch.tree_size, batch.tree_mask)

    def forward_flat_aux(self, batch: FlatBatch, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         aux_layers: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        """forward_flat, also capturing the residual stream entering each layer of `aux_layers`
        (strictly increasing indices of this model's layers) in the same pass -> hidden
        [N, hidden], aux [N, len(aux_layers) * hidden] (layer aux_layers[j]'s input in columns
        [j * hidden, (j + 1) * hidden)). The hidden states are bit-identical to forward_flat's."""
        aux_layers = check_aux_layers(aux_layers, len(self.keep))
        x = self._embed(batch.token_ids)  # [N, hidden]
        aux = torch.empty(x.shape[0], len(aux_layers) * self.config.hidden_size)
        hidden = self.core.forward(self.level, x, batch.positions, batch.slots, k_cache, v_cache, batch.block_size,
                                   batch.q_start, batch.block_table, batch.prefix_len, batch.tree_row,
                                   batch.tree_start, batch.tree_size, batch.tree_mask,
                                   torch.tensor(aux_layers, dtype=torch.int64), aux)
        return hidden, aux

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [N] -> float32 [N, hidden]; Gemma's times float32 sqrt(hidden) (each element one
        rounding, whatever else is in the pass)."""
        x = self.embed_tokens(ids)
        if self.config.embed_scale:
            x = x * torch.tensor(math.sqrt(self.config.hidden_size), dtype=torch.float32)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits [..., vocab] (Gemma 2's soft-capped in the kernels)."""
        flat = hidden.reshape(-1, hidden.shape[-1]).float()
        logits = self.core.logits(self.level, flat)[:, : self.config.vocab_size]
        return logits.reshape(*hidden.shape[:-1], self.config.vocab_size)


def build_native_model(cfg: ModelConfig, weights: dict[str, Weight], quantization: str, ext: ModuleType,
                       level: int, permute_qk: bool, positions: int | None = None) -> NativeLlamaModel:
    """The model from Hugging Face-named weights (Blocks or float tensors). `quantization`:
    "gguf" keeps blocks that have a kernel (others become FALLBACK_FORMAT); "int8" / "int4" (or a
    format by name, QUANT_FORMATS) quantize every matrix to Q8_0 / Q4_1 (that format). `permute_qk`: undo llama.cpp's q/k row order.
    `positions`: how many positions the RoPE tables cover (see RotaryEmbedding)."""
    requantize = quantization in QUANT_FORMATS
    fmt = QUANT_FORMATS.get(quantization, FALLBACK_FORMAT)
    used: set[str] = set()

    def take(name: str) -> Weight:
        if name not in weights:
            raise ModelLoadError(f"checkpoint lacks {name} for a {cfg.architecture} model of this config")
        used.add(name)
        return weights[name]

    def vector(name: str) -> torch.Tensor:
        w = take(name)
        return (w.dequantized() if isinstance(w, Blocks) else w).float().reshape(-1).contiguous()

    def matrix(name: str, heads: int | None = None) -> Blocks:
        w = as_blocks(take(name), fmt, requantize, ext)
        if heads is not None and permute_qk:
            w = w.take_rows(_unpermuted_rows(w.rows, heads))
        if w.rows % _UNIT_ROWS:
            raise ModelLoadError(f"{name} has {w.rows} rows; the native kernels need a multiple of {_UNIT_ROWS}")
        return w

    packed_bytes = []
    formats: set[str] = set()
    arena = HugeArena()  # every pass streams the units: in huge pages (model/hugepages.py)

    def qmatrix(b: Blocks, bias: torch.Tensor | None = None):
        units = arena.hold(ext.repack(int(b.format), torch.from_numpy(b.raw), b.cols))
        packed_bytes.append(units.numel())
        formats.add(b.format.name)
        return ext.QMatrix(int(b.format), units, b.rows, b.cols, bias)

    def stacked(parts: list[Blocks], biases: list[torch.Tensor] | None = None):
        return ext.Stacked([qmatrix(b, None if biases is None else biases[i]) for i, b in enumerate(parts)])

    layers, layer_bytes = [], []
    for i in range(cfg.num_layers):
        before = sum(packed_bytes)
        p = f"model.layers.{i}."
        q = matrix(p + "self_attn.q_proj.weight", cfg.num_heads)
        k = matrix(p + "self_attn.k_proj.weight", cfg.num_kv_heads)
        v = matrix(p + "self_attn.v_proj.weight")
        biases = None
        if cfg.attention_bias:
            biases = [vector(p + "self_attn.q_proj.bias"), vector(p + "self_attn.k_proj.bias"),
                      vector(p + "self_attn.v_proj.bias")]
            if permute_qk:
                biases[0] = biases[0][torch.from_numpy(_unpermuted_rows(cfg.q_size, cfg.num_heads))].contiguous()
                biases[1] = biases[1][torch.from_numpy(_unpermuted_rows(cfg.kv_size, cfg.num_kv_heads))].contiguous()
        o_bias = [vector(p + "self_attn.o_proj.bias")] if cfg.o_bias else None
        norms = ({"q_norm": vector(p + "self_attn.q_norm.weight"), "k_norm": vector(p + "self_attn.k_norm.weight")}
                 if cfg.qk_norm else {})
        if cfg.sandwich_norms:  # Gemma: the MLP's input norm is pre_feedforward_layernorm (DecoderLayer)
            norms |= {"ffn_norm": vector(p + "pre_feedforward_layernorm.weight"),
                      "post_attn_norm": vector(p + "post_attention_layernorm.weight"),
                      "post_ffn_norm": vector(p + "post_feedforward_layernorm.weight")}
        else:
            norms["ffn_norm"] = vector(p + "post_attention_layernorm.weight")
        layers.append(ext.Layer(
            attn_norm=vector(p + "input_layernorm.weight"),
            qkv=stacked([q, k, v], biases), o=stacked([matrix(p + "self_attn.o_proj.weight")], o_bias),
            gate_up=stacked([matrix(p + "mlp.gate_proj.weight"), matrix(p + "mlp.up_proj.weight")]),
            down=stacked([matrix(p + "mlp.down_proj.weight")]),
            window=cfg.sliding_window if cfg.windowed(i) else 0, **norms))
        layer_bytes.append(sum(packed_bytes) - before)

    embed = take("model.embed_tokens.weight")
    head_source = embed if cfg.tie_word_embeddings else take("lm_head.weight")
    head = as_blocks(head_source, fmt, requantize, ext)
    padded = -(-head.rows // _UNIT_ROWS) * _UNIT_ROWS
    if padded != head.rows:
        pad = np.zeros((padded - head.rows, head.raw.shape[1]), dtype=np.uint8)
        head = Blocks(head.format, np.concatenate([head.raw, pad]), padded, head.cols)
    lm_head = qmatrix(head)
    # Embeddings are looked up from the file's own blocks (exact, whatever the products were
    # quantized to: drafters fingerprint them), sharing the output projection's units when it
    # is the same tensor unchanged.
    if isinstance(embed, Blocks) and embed.on_kernels(ext):
        units = lm_head.units if head is embed else arena.hold(ext.repack(int(embed.format), torch.from_numpy(embed.raw),
                                                                           embed.cols))
        embed_tokens = PackedRows(ext, embed.format, units, cfg.vocab_size, cfg.hidden_size)
    else:
        embed_tokens = nn.Embedding.from_pretrained(embed.dequantized() if isinstance(embed, Blocks) else embed.float(),
                                                    freeze=True)
    final_norm = vector("model.norm.weight")
    unused = sorted(n for n in set(weights) - used - {"lm_head.weight"} if not n.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ModelLoadError(f"checkpoint has weights a {cfg.architecture} model does not use: {unused[:5]}")

    # cos: [positions, head_dim] as [c, c]; the kernels take one half (of each table)
    half = cfg.head_dim // 2
    tables = [(r.cos[:, :half].contiguous(), r.sin[:, half:].contiguous()) for r in (
        RotaryEmbedding(cfg, positions), *([RotaryEmbedding(cfg, positions, local=True)]
                                           if cfg.local_rope_theta is not None else []))]
    options = ext.ModelOptions(
        attn_scale=0.0 if cfg.query_pre_attn_scalar is None else cfg.attention_scale,
        attn_softcap=cfg.attn_logit_softcapping or 0.0, final_softcap=cfg.final_logit_softcapping or 0.0,
        gelu=cfg.activation == "gelu_tanh", cos_local=tables[-1][0] if len(tables) > 1 else None,
        sin_local=tables[-1][1] if len(tables) > 1 else None)
    parts = NativeParts(ext, tuple(layers), final_norm, lm_head, *tables[0], tuple(layer_bytes), options)
    vocab_rows = PackedRows(ext, head.format, lm_head.units, cfg.vocab_size, cfg.hidden_size)
    return NativeLlamaModel(cfg, parts, embed_tokens, vocab_rows, level, quantization, "/".join(sorted(formats)),
                            sum(packed_bytes))


def _unpermuted_rows(rows: int, heads: int) -> np.ndarray:
    """Row order that undoes llama.cpp's converter permutation of q/k (interleaved-pair RoPE back
    to rotate-half), as gguf_loader._unpermute does to float weights."""
    idx = np.arange(rows)
    return idx.reshape(heads, rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)
