"""Turning a stream of named weights (Hugging Face names) into a ready LlamaModel."""

from __future__ import annotations

import ctypes
import re
from collections.abc import Iterable

import torch
from tqdm import tqdm

from specserve.errors import ModelLoadError
from specserve.model.config import ModelConfig
from specserve.hardware import can_pack
from specserve.model.linear import PackedLinear, pack_linears
from specserve.model.llama import LlamaModel

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Checkpoint names that are concatenated, in this order, into one fused parameter.
_FUSED = {
    "self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
    "self_attn.qkv_proj.bias": ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
    "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
}
_PART_OF = {part: (fused, i) for fused, parts in _FUSED.items() for i, part in enumerate(parts)}
# Present in some checkpoints, never needed: RoPE tables are recomputed from the config.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


def ignored_tensor(name: str) -> bool:
    return _IGNORED.match(name) is not None


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor (Hugging Face names, unfused) a model of `cfg` needs, with its
    shape [out, in]; the output projection only where it is not tied to the embedding. Worked
    out from the config alone, so a file's tensors are checked before any is read."""
    h, q, kv, inter = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    layer = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
    }
    if cfg.attention_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if cfg.o_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if cfg.qk_norm:
        layer |= {"self_attn.q_norm.weight": (cfg.head_dim,), "self_attn.k_norm.weight": (cfg.head_dim,)}
    if cfg.sandwich_norms:
        layer |= {"pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,)}
    out = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        out |= {f"model.layers.{i}.{name}": shape for name, shape in layer.items()}
    return out


def fused_parts(name: str) -> tuple[str, ...] | None:
    """The unfused checkpoint names a fused checkpoint tensor stands for, in row order
    (model.layers.N.self_attn.qkv_proj.weight -> its q, k and v: Phi-3 ships its projections
    fused, and the GGUF loader maps Phi-3's attn_qkv and ffn_up to these names); None for any
    other name."""
    m = _LAYER.fullmatch(name)
    if not m or m.group(2) not in _FUSED:
        return None
    return tuple(f"model.layers.{m.group(1)}.{part}" for part in _FUSED[m.group(2)])


def checkpoint_shape(expected: dict[str, tuple[int, ...]], name: str) -> tuple[tuple[int, ...] | None, tuple[str, ...]]:
    """(the shape a checkpoint tensor must have, the expected names it supplies): a fused tensor
    stacks its parts' rows; None where `name` is not expected at all."""
    parts = fused_parts(name)
    if parts is None:
        return expected.get(name), (name,)
    shapes = [expected.get(p) for p in parts]
    if any(s is None for s in shapes) or len({s[1:] for s in shapes}) != 1:
        return None, parts
    return (sum(s[0] for s in shapes), *shapes[0][1:]), parts


def split_fused(expected: dict[str, tuple[int, ...]], name: str, w):
    """[(name, weight)]: a fused checkpoint tensor (checked against checkpoint_shape before)
    split by rows into its parts, so the rest of the loader sees q, k, v, gate and up alone;
    any other tensor as it is. `w`: a torch tensor, or native_llama.Blocks (whole rows of blocks)."""
    parts = fused_parts(name)
    if parts is None:
        return [(name, w)]
    out, start = [], 0
    for part in parts:
        rows = expected[part][0]
        out.append((part, w[start:start + rows] if isinstance(w, torch.Tensor) else w.row_slice(start, start + rows)))
        start += rows
    return out


def build_model(cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], total: int,
                dtype: torch.dtype, device: torch.device | str, desc: str = "Loading weights",
                positions: int | None = None) -> LlamaModel:
    """Build a model from (Hugging Face name, tensor) pairs, checking every name and shape; its
    RoPE tables cover `positions` (see RotaryEmbedding).

    Parameters are created on the meta device and assigned the loaded tensors, so the model
    never exists twice in memory. On a CPU, weights are then prepacked (`pack_for_cpu`).
    """
    with torch.device("meta"):
        model = LlamaModel(cfg, positions, tables_device="cpu")  # the RoPE tables in float32 on the CPU, then moved
    model.rotary.to(device)
    if model.rotary_local is not None:
        model.rotary_local.to(device)
    expected = {n: p.shape for n, p in model.named_parameters()}
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, list[torch.Tensor | None]] = {}
    for name, tensor in tqdm(tensors, total=total, desc=desc, unit="tensor", leave=False):
        if ignored_tensor(name):
            continue
        target, index = _locate(name)
        # Gemma's (1 + w) norm weights stay float32: its reference multiplies by them in float32
        # (RMSNorm), and in half precision 1 + w would lose w's low bits.
        keep = cfg.sandwich_norms and name.endswith("norm.weight")
        tensor = tensor.to(device=device, dtype=torch.float32 if keep else dtype)
        if index is None:
            state[target] = tensor
            continue
        parts = pending.setdefault(target, [None] * len(_FUSED[target.split(".", 2)[2]]))
        parts[index] = tensor
        if all(p is not None for p in parts):
            state[target] = torch.cat(parts, dim=0)
            del pending[target]
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected or pending:
        raise ModelLoadError(
            f"checkpoint does not match a {cfg.architecture} model of this config: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}, incomplete {sorted(pending)[:5]}"
        )
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ModelLoadError(f"weight {name} has shape {tuple(state[name].shape)}, expected {tuple(shape)}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    model.eval().requires_grad_(False)
    del state  # the model now holds the only references, so packing can free the plain weights
    if can_pack(torch.device(device), dtype):
        pack_for_cpu(model)
    return model


def pack_for_cpu(model: LlamaModel) -> None:
    """Prepack weights for oneDNN (see linear.py for the measurements), in place.

    Every linear layer and the output projection are packed. Tied to the embedding, the output
    projection keeps the plain weight too, which the embedding lookup needs. In float32 the
    packed kernels sum in another order than MKL (which transformers uses), so logits differ
    from the reference by float32 rounding (~1e-5 RMS on the embedded model, as far from a
    float64 run as the reference within 2x; tests/test_gguf.py checks it).
    """
    model.lm_head = PackedLinear(model.lm_head, keep_weight=model.config.tie_word_embeddings)
    pack_linears(model.layers)
    _trim_heap()


def _trim_heap() -> None:
    """Hand the memory of the replaced plain weights back to the OS. They were allocated among
    the loader's temporaries, on glibc's heap, which keeps freed memory mapped: without this the
    process stays as large as if both copies were alive (250 MB more for the embedded model)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator is not ours to tune
        pass


def _locate(name: str) -> tuple[str, int | None]:
    """Map a checkpoint name to (parameter name in LlamaModel, index within a fused parameter)."""
    if name.startswith("model.embed_tokens.") or name.startswith("model.norm."):
        return name.removeprefix("model."), None
    if name == "lm_head.weight":
        return name, None
    m = _LAYER.fullmatch(name)
    if not m:
        return name, None  # reported as unexpected by the caller
    layer, rest = m.groups()
    if rest in _PART_OF:
        fused, index = _PART_OF[rest]
        return f"layers.{layer}.{fused}", index
    return f"layers.{layer}.{rest}", None
