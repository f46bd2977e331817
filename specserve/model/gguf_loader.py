"""Loading a GGUF file: config from its metadata, weights dequantized with the `gguf` package."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType
from gguf.quants import dequantize

from specserve.errors import ModelLoadError
from specserve.model.config import SUPPORTED_ARCHITECTURES, ModelConfig
from specserve.model.families import GEMMA, gguf_family_fields
from specserve.model.limits import FieldReader, gguf_keys, read_dimensions, read_rope_theta
from specserve.model.llama import LlamaModel
from specserve.model.native_llama import Blocks, Weight
from specserve.model.weights import build_model, checkpoint_shape, expected_shapes, split_fused

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
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "self_attn.qkv_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Phi-3's ffn_up holds [gate; up] by rows (llama.cpp's phi3 graph splits it in halves, SiLU on
# the first), and there is no ffn_gate.
_PHI3_NAMES = _LAYER_NAMES | {"ffn_up.weight": "mlp.gate_up_proj.weight"}
# Gemma's ffn_norm is the MLP's input norm (pre_feedforward_layernorm); post_attention_norm and
# post_ffw_norm normalise the attention's and the MLP's outputs. Its converter stores every norm
# weight as the (1 + w) the model multiplies by, which is how specserve keeps them too.
_GEMMA_NAMES = _LAYER_NAMES | {"ffn_norm.weight": "pre_feedforward_layernorm.weight",
                               "post_attention_norm.weight": "post_attention_layernorm.weight",
                               "post_ffw_norm.weight": "post_feedforward_layernorm.weight"}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
# Phi-3 128k's longrope frequency factors: refused by name (their angles are not computed).
_LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")


class _PlainReader(GGUFReader):
    """The gguf package's reader, slicing the file through a plain ndarray view of its memory
    map (each slice of the np.memmap itself builds a memmap object), with metadata arrays read
    whole: the package parses an array element by element, a few slices and a recursive call
    per token, and Gemma 3's 262,144-token vocabulary took 9.8 s of a 16 s load on an AVX2 EPYC.

    Array fields keep the package's layout for contents() (what specserve reads): a string
    array has one part per string and `data` indexes them; a numeric array is one part, so its
    `data` has one index and contents() with an int index is not supported on it."""

    def _plain_view(self) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        return plain

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        count = int(count)
        arr = self._plain_view()[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    def _get_field_parts(self, orig_offs: int, raw_type: int):
        if raw_type != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        raw_itype = self._get(orig_offs, np.uint32)
        alen = self._get(orig_offs + 4, np.uint64)
        itype, count, offs = GGUFValueType(raw_itype[0]), int(alen[0]), orig_offs + 12
        types = [GGUFValueType.ARRAY] + ([itype] if count else [])  # as the package: none for an empty array
        nptype = self.gguf_scalar_to_np.get(itype)
        if nptype is not None:
            values = self._get(offs, nptype, count)
            if len(values) != count:
                raise ValueError(f"the array at offset {orig_offs} runs past the end of the file")
            return 12 + int(values.nbytes), [raw_itype, alen, values], [2] if count else [], types
        if itype != GGUFValueType.STRING:  # arrays of arrays: the package's own parse
            return super()._get_field_parts(orig_offs, raw_type)
        plain, view = self._plain_view(), memoryview(self._plain_view())
        order = "big" if self.byte_order == "S" else "little"
        parts: list[np.ndarray] = [raw_itype, alen]
        for _ in range(count):
            length = int.from_bytes(view[offs:offs + 8], order)
            if offs + 8 + length > len(plain):
                raise ValueError(f"a string of the array at offset {orig_offs} runs past the end of the file")
            parts.append(plain[offs + 8:offs + 8 + length])
            offs += 8 + length
        return offs - orig_offs, parts, list(range(2, 2 + count)), types


def open_gguf(path: Path) -> GGUFReader:
    try:
        return _PlainReader(str(path))
    except Exception as e:  # the reader raises ValueError, struct.error, IndexError... on bad files
        raise ModelLoadError(f"{path} is not a readable GGUF file: truncated or corrupt ({type(e).__name__}: {e})") from None


def field(reader: GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def read_gguf_config(reader: GGUFReader, path: Path) -> ModelConfig:
    """The model's hyper-parameters from the file's metadata, each checked (limits.py), and then
    every tensor against them (check_gguf_tensors): nothing is allocated from a bad file."""
    arch = field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{path.name}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    r = FieldReader(path.name, lambda key: field(reader, key))
    keys = gguf_keys(arch)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if r.lookup(keys.vocab_size) is None and tokens is None:
        raise ModelLoadError(f"{path.name}: GGUF metadata has neither {keys.vocab_size} nor tokenizer.ggml.tokens")
    vocab_default = len(tokens.data) if tokens is not None else None
    dims = read_dimensions(r, keys, vocab_default=vocab_default)
    value_length = r.lookup(f"{arch}.attention.value_length")
    if value_length is not None and value_length != dims["head_dim"]:
        r.fail(f"{arch}.attention.value_length", value_length, f"must equal {keys.head_dim}={dims['head_dim']}")
    rope_dims = r.lookup(f"{arch}.rope.dimension_count")
    if rope_dims is not None and rope_dims != dims["head_dim"]:
        r.fail(f"{arch}.rope.dimension_count", rope_dims, f"must equal {keys.head_dim}={dims['head_dim']}: specserve "
               "rotates whole heads only, and a model with partial RoPE would silently give other outputs")
    by_name = {t.name: t for t in reader.tensors}
    longrope = [n for n in _LONGROPE if n in by_name]
    if longrope:
        raise ModelLoadError(f"{path.name}: tensor {longrope[0]} gives longrope (su) RoPE scaling, which specserve "
                             "does not compute; the model's output would silently differ")
    rope_scaling = None
    scaling_type = field(reader, f"{arch}.rope.scaling.type")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": r.number(f"{arch}.rope.scaling.factor", 0.0)}
    elif scaling_type not in (None, "none"):
        r.fail(f"{arch}.rope.scaling.type", scaling_type, "supported: linear, none")
    if "rope_freqs.weight" in by_name:
        rope_scaling = {"rope_type": "default", "freq_factors": _freq_factors(by_name["rope_freqs.weight"], dims, path)}
    cfg = ModelConfig(
        architecture=arch,
        **dims,
        rope_theta=read_rope_theta(r, f"{arch}.rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        attention_bias="blk.0.attn_q.bias" in by_name,
        o_bias="blk.0.attn_output.bias" in by_name,
        qk_norm="blk.0.attn_q_norm.weight" in by_name,
        tie_word_embeddings="output.weight" not in by_name,
        **gguf_family_fields(r, arch, dims),
    )
    check_gguf_tensors(reader, path, cfg)
    return cfg


def _freq_factors(tensor, dims: dict, path: Path) -> list[float]:
    """rope_freqs.weight (Llama 3.1's scaled frequencies as divisors): [head_dim / 2] positive numbers."""
    want = (dims["head_dim"] // 2,)
    got = tuple(int(d) for d in tensor.shape)
    if got != want:
        raise ModelLoadError(f"{path.name}: tensor rope_freqs.weight has shape {got}, expected {want}")
    factors = _dequantized(tensor).reshape(-1)
    if not (np.isfinite(factors).all() and (factors > 0).all()):
        raise ModelLoadError(f"{path.name}: tensor rope_freqs.weight must hold finite positive numbers")
    return factors.tolist()


def check_gguf_tensors(reader: GGUFReader, path: Path, cfg: ModelConfig) -> None:
    """Every tensor the model needs is in the file with exactly its shape, and no other:
    checked on the header alone, before any is read (the reader has already checked that each
    one's data lies within the file)."""
    expected = expected_shapes(cfg)
    got: set[str] = set()
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        hf = _hf_name(t.name, cfg.architecture)
        want, supplies = checkpoint_shape(expected, hf) if hf is not None else (None, ())
        if want is None or got.intersection(supplies):
            raise ModelLoadError(f"{path.name}: unexpected tensor {t.name!r} for a {cfg.architecture} model of "
                                 f"{cfg.num_layers} layers ({cfg.architecture}.block_count)")
        shape = tuple(reversed([int(d) for d in t.shape]))
        if shape != want:
            raise ModelLoadError(f"{path.name}: tensor {t.name} has shape {shape}, expected {want} "
                                 "from the file's metadata")
        got.update(supplies)
    # (by GGUF name, once each: Phi-3's ffn_up stands for two of the expected tensors)
    missing = list(dict.fromkeys(_gguf_name(n, cfg.architecture) for n in sorted(set(expected) - got)))
    if missing:
        raise ModelLoadError(f"{path.name}: tensors missing for a model of this metadata: "
                             f"{', '.join(missing[:5])}" + (" ..." if len(missing) > 5 else ""))


# Tensor types that are plain floats, not blocks.
_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def tensor_blocks(tensor, copy: bool = True) -> Blocks:
    """A quantized 2-D GGUF tensor's blocks as the file holds them, rows in PyTorch's [out, in]
    order (GGUF lists dims reversed): copied out of the file's memory map, or a view of it."""
    cols, rows = (int(d) for d in tensor.shape)
    raw = (np.array if copy else np.asarray)(tensor.data, dtype=np.uint8).reshape(rows, -1)
    return Blocks(GGMLQuantizationType(tensor.tensor_type), raw, rows, cols)


def _dequantized(tensor) -> np.ndarray:
    """A GGUF tensor as float32 numpy in PyTorch's [out, in] order (GGUF lists dims reversed).
    A quantized matrix goes through Blocks, which dequantizes on the native kernels where it can
    (the same floats as the gguf package's)."""
    qtype = GGMLQuantizationType(tensor.tensor_type)
    shape = tuple(reversed([int(d) for d in tensor.shape]))
    try:
        if len(shape) == 2 and qtype not in _FLOAT_TYPES and tensor.data.nbytes % shape[0] == 0:
            return tensor_blocks(tensor, copy=False).dequantized().numpy()
        data = dequantize(tensor.data, qtype)
    except NotImplementedError:
        raise ModelLoadError(
            f"tensor {tensor.name} uses quantization type {qtype.name}, which cannot be dequantized; "
            "supported include F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K..Q6_K"
        ) from None
    return np.asarray(data, dtype=np.float32).reshape(shape)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo the row permutation llama.cpp's converter applies to q/k of Llama models, which
    turns rotate-half RoPE into llama.cpp's interleaved-pair RoPE."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str, arch: str) -> str:
    """The GGUF name of a Hugging Face tensor name (for messages)."""
    for gguf_name, name in _GLOBAL_NAMES.items():
        if name == hf:
            return gguf_name
    layer, rest = hf.removeprefix("model.layers.").split(".", 1)
    if arch == "phi3" and rest in ("mlp.gate_proj.weight", "mlp.up_proj.weight"):
        return f"blk.{layer}.ffn_up.weight"
    return f"blk.{layer}." + next(g for g, h in _layer_names(arch).items() if h == rest)


def _layer_names(arch: str) -> dict[str, str]:
    return _PHI3_NAMES if arch == "phi3" else _GEMMA_NAMES if arch in GEMMA else _LAYER_NAMES


def _hf_name(name: str, arch: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    names = _layer_names(arch)
    m = _BLOCK.fullmatch(name)
    if m and m.group(2) in names:
        return f"model.layers.{m.group(1)}.{names[m.group(2)]}"
    return None


def is_quantized(reader: GGUFReader) -> bool:
    """Whether any matrix of the file is stored in a block format (not F32/F16/BF16)."""
    return any(GGMLQuantizationType(t.tensor_type) not in _FLOAT_TYPES for t in reader.tensors)


def gguf_weights(reader: GGUFReader, path: Path, cfg: ModelConfig) -> dict[str, Weight]:
    """Every tensor by its Hugging Face name, fused ones (Phi-3's attn_qkv, ffn_up) split into
    their parts: quantized ones as their raw blocks (copied out of the file's memory map), float
    ones as float32 tensors. q/k rows stay in llama.cpp's order."""
    out: dict[str, Weight] = {}
    expected = expected_shapes(cfg)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        hf = _hf_name(t.name, cfg.architecture)
        if hf is None:
            raise ModelLoadError(f"{path.name}: unexpected tensor {t.name!r}")
        qtype = GGMLQuantizationType(t.tensor_type)
        shape = tuple(reversed([int(d) for d in t.shape]))
        if qtype in _FLOAT_TYPES or len(shape) == 1:
            w = torch.from_numpy(_dequantized(t).copy())
        else:
            w = tensor_blocks(t)
        out.update(split_fused(expected, hf, w))
    return out


def load_gguf_model(reader: GGUFReader, path: Path, cfg: ModelConfig, dtype: torch.dtype,
                    device: torch.device | str, positions: int | None = None) -> LlamaModel:
    tensors = [t for t in reader.tensors if t.name != "rope_freqs.weight"]
    expected = expected_shapes(cfg)

    def named() -> Iterator[tuple[str, torch.Tensor]]:
        for t in tensors:
            hf = _hf_name(t.name, cfg.architecture)
            if hf is None:
                raise ModelLoadError(f"{path.name}: unexpected tensor {t.name!r} for architecture {cfg.architecture}")
            w = _dequantized(t)
            # Only the "llama" converter permutes q/k; qwen2, qwen3 and phi3 use rotate-half RoPE natively.
            if cfg.architecture == "llama" and t.name.endswith(("attn_q.weight", "attn_q.bias")):
                w = _unpermute(w, cfg.num_heads)
            elif cfg.architecture == "llama" and t.name.endswith(("attn_k.weight", "attn_k.bias")):
                w = _unpermute(w, cfg.num_kv_heads)
            # Memory-mapped F32 tensors come back read-only; torch wants its own writable copy.
            yield from split_fused(expected, hf, torch.from_numpy(w if w.flags.writeable else w.copy()))

    return build_model(cfg, named(), len(tensors), dtype, device, desc=f"Loading {path.name}", positions=positions)
