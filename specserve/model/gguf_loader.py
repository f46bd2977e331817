"""Loading a GGUF file: config from its metadata, weights dequantized with the `gguf` package."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from specserve.errors import ModelLoadError
from specserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specserve.model.llama import LlamaModel
from specserve.model.native_llama import Blocks, Weight
from specserve.model.weights import build_model

# GGUF tensor names -> Hugging Face names ("{}" is the layer index).
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def open_gguf(path: Path) -> GGUFReader:
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad files
        raise ModelLoadError(f"{path} is not a readable GGUF file ({type(e).__name__}: {e})") from None


def field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(reader: GGUFReader, path: Path) -> ModelConfig:
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )

    def need(key: str):
        value = field(reader, f"{arch}.{key}")
        if value is None:
            raise ModelLoadError(f"{path.name}: GGUF metadata lacks {arch}.{key}")
        return value

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    tensor_names = {t.name for t in reader.tensors}
    vocab = field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = None
    scaling_type = field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling_type not in (None, "none"):
        raise ModelLoadError(f"{path.name}: rope scaling type {scaling_type!r} is not supported; supported: linear")
    if "rope_freqs.weight" in tensor_names:
        factors = _dequantized(next(t for t in reader.tensors if t.name == "rope_freqs.weight"))
        rope_scaling = {"rope_type": "default", "freq_factors": factors.reshape(-1).tolist()}
    return ModelConfig(
        architecture=arch,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=heads,
        num_kv_heads=int(field(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(field(reader, f"{arch}.attention.key_length", hidden // heads)),
        max_position_embeddings=int(need("context_length")),
        rms_norm_eps=float(field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        tie_word_embeddings="output.weight" not in tensor_names,
    )


def _dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy in PyTorch's [out, in] order (GGUF lists dims reversed)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    try:
        data = dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {tensor.name} uses quantization type {qtype.name}, which cannot be dequantized; "
            "supported include F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K"
        ) from None
    return np.asarray(data, dtype=np.float32).reshape(tuple(reversed([int(d) for d in tensor.shape])))


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter applies to q/k of Llama models, which
    turns rotate-half RoPE into llama.cpp's interleaved-pair RoPE."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"
    return None


def is_quantized(reader: GGUFReader) -> bool:
    """Whether any matrix of the file is stored in a block format (not F32/F16/BF16)."""
    floats = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
    return any(GGMLQuantizationType(t.tensor_type) not in floats for t in reader.tensors)


def gguf_weights(reader: GGUFReader, path: Path) -> dict[str, Weight]:
    """Every tensor by its Hugging Face name: quantized ones as their raw blocks (copied out of
    the file's memory map), float ones as float32 tensors. q/k rows stay in llama.cpp's order."""
    out: dict[str, Weight] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        hf = _hf_name(t.name)
        if hf is None:
            raise ModelLoadError(f"{path.name}: unexpected tensor {t.name!r}")
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = tuple(reversed([int(d) for d in t.shape]))
        if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16) or len(shape) == 1:
            out[hf] = torch.from_numpy(_dequantized(t).copy())
        else:
            out[hf] = Blocks(qtype, np.array(t.data, dtype=np.uint8).reshape(shape[0], -1), shape[0], shape[1])
    return out


def load_gguf_model(reader: GGUFReader, path: Path, cfg: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str) -> LlamaModel:
    tensors = [t for t in reader.tensors if t.name != "rope_freqs.weight"]

    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for t in tensors:
            hf = _hf_name(t.name)
            if hf is None:
                raise ModelLoadError(f"{path.name}: unexpected tensor {t.name!r} for architecture {cfg.architecture}")
            w = _dequantized(t)
            # Only the "llama" converter permutes q/k; qwen2 uses rotate-half RoPE natively.
            if cfg.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = _unpermute(w, cfg.num_heads)
            elif cfg.architecture == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = _unpermute(w, cfg.num_kv_heads)
            # Memory-mapped F32 tensors come back read-only; torch wants its own writable copy.
            yield hf, torch.from_numpy(w if w.flags.writeable else w.copy())

    return build_model(cfg, named(), len(tensors), dtype, device, desc=f"Loading {path.name}")
