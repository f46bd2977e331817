"""The bounds a model file's hyper-parameters must keep, and the reader that enforces them.

A model file is untrusted input: its metadata sizes everything the loader builds (layers,
matrices, tables), so each number is checked for its type and range here, before anything is
allocated, and a bad one is refused with one ModelLoadError naming the file, the field, the
value and what is allowed.

The caps are generous: several times the largest released dense model of the family, so no
real file meets them, while a crafted one cannot make the loader build millions of layers or
tables of terabytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

from specserve.errors import ModelLoadError

# Llama 3.1 405B has 126 layers, the deepest released Llama-family model.
MAX_LAYERS = 1024
# Llama 3.1 405B: hidden 16384, MLP width 53248, 128 query heads of 128; Gemma uses 256-wide heads.
MAX_HIDDEN = 65536
MAX_INTERMEDIATE = 262144
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
# Gemma 3's 262,144 tokens is the largest vocabulary in use; 2**22 leaves 16x room.
MAX_VOCAB = 2**22
# Llama 4 Scout claims 10M tokens of context. Nothing is sized by this number (tables follow
# the engine's max_model_len), but a context beyond it is a sign of a crafted file.
MAX_CONTEXT = 2**24

_MISSING = object()


@dataclass(frozen=True)
class FieldReader:
    """Reads the hyper-parameters of one file. `lookup(key)` gives a key's value, or None
    where the file lacks it; `where` names the file in messages."""

    where: str
    lookup: Callable[[str], object]

    def fail(self, key: str, value: object, allowed: str) -> NoReturn:
        raise ModelLoadError(f"{self.where}: invalid {key}={_short(value)}: {allowed}")

    def integer(self, key: str, lo: int, hi: int, default: object = _MISSING) -> int:
        """An integer in [lo, hi]; bools, floats and strings are refused."""
        value = self._get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(key, value, f"must be an integer in [{lo}, {hi}]")
        if not lo <= value <= hi:
            self.fail(key, value, f"must be in [{lo}, {hi}]")
        return value

    def number(self, key: str, lo: float, hi: float = math.inf, default: object = _MISSING) -> float:
        """A finite number in (lo, hi] (integers allowed: JSON writes 10000 for 10000.0)."""
        value = self._get(key, default)
        allowed = f"must be a finite number > {lo:g}" + (f" and <= {hi:g}" if hi < math.inf else "")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(key, value, allowed)
        value = float(value)
        if not (math.isfinite(value) and lo < value <= hi):
            self.fail(key, value, allowed)
        return value

    def _get(self, key: str, default: object) -> object:
        value = self.lookup(key)
        if value is None:
            if default is _MISSING:
                raise ModelLoadError(f"{self.where}: {key} is missing; the model's dimensions need it")
            return default
        return value


@dataclass(frozen=True)
class DimensionKeys:
    """The file's name of each dimension (config.json's or GGUF metadata's spelling)."""

    vocab_size: str
    hidden_size: str
    intermediate_size: str
    num_layers: str
    num_heads: str
    num_kv_heads: str
    head_dim: str
    context: str
    rms_norm_eps: str


HF_KEYS = DimensionKeys("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps")


def gguf_keys(arch: str) -> DimensionKeys:
    return DimensionKeys(f"{arch}.vocab_size", f"{arch}.embedding_length", f"{arch}.feed_forward_length",
                         f"{arch}.block_count", f"{arch}.attention.head_count", f"{arch}.attention.head_count_kv",
                         f"{arch}.attention.key_length", f"{arch}.context_length",
                         f"{arch}.attention.layer_norm_rms_epsilon")


def read_dimensions(r: FieldReader, keys: DimensionKeys, *, vocab_default: object = _MISSING,
                    context_default: object = _MISSING, eps_default: float = 1e-5,
                    head_dim_default: int | None = None) -> dict:
    """ModelConfig's size fields, each checked alone and against the others. A missing head_dim
    is `head_dim_default`, or hidden_size / num_heads where that is None."""
    hidden = r.integer(keys.hidden_size, 1, MAX_HIDDEN)
    heads = r.integer(keys.num_heads, 1, MAX_HEADS)
    if r.lookup(keys.head_dim) is None and head_dim_default is None and hidden % heads:
        r.fail(keys.num_heads, heads, f"must divide {keys.hidden_size}={hidden} (no {keys.head_dim} is given)")
    kv_heads = r.integer(keys.num_kv_heads, 1, heads, default=heads)
    if heads % kv_heads:
        r.fail(keys.num_kv_heads, kv_heads, f"must divide {keys.num_heads}={heads} (grouped-query attention)")
    head_dim = r.integer(keys.head_dim, 2, MAX_HEAD_DIM,
                         default=hidden // heads if head_dim_default is None else head_dim_default)
    if head_dim % 2:
        r.fail(keys.head_dim, head_dim, "must be even (RoPE rotates pairs of dimensions)")
    if heads * head_dim > MAX_HIDDEN:
        r.fail(keys.num_heads, heads, f"times {keys.head_dim}={head_dim} must be at most {MAX_HIDDEN}")
    return dict(
        vocab_size=r.integer(keys.vocab_size, 1, MAX_VOCAB, default=vocab_default),
        hidden_size=hidden,
        intermediate_size=r.integer(keys.intermediate_size, 1, MAX_INTERMEDIATE),
        num_layers=r.integer(keys.num_layers, 1, MAX_LAYERS),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=r.integer(keys.context, 2, MAX_CONTEXT, default=context_default),
        # Added to a mean of squares before its square root: 0 or less divides by zero or worse.
        rms_norm_eps=r.number(keys.rms_norm_eps, 0.0, 1.0, default=eps_default),
    )


def read_hf_windows(r: FieldReader, arch: str, num_layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(the attention window, the indices of the layers that attend through it) of a
    config.json, as transformers reads it: Llama has none (it ignores the key); Mistral and
    Phi-3 window every layer when sliding_window is set (their modelling ignores layer_types);
    Qwen2 and Qwen3 window the layers `layer_types` names "sliding_attention", else those from
    max_window_layers on, only when use_sliding_window is true; Gemma 2 and 3 the layers
    `layer_types` names, else every one but each sliding_window_pattern-th (2 for Gemma 2, 6 for
    Gemma 3), with a default window of 4096. A window nothing can honour (Qwen2's layer_types
    naming windowed layers without use_sliding_window, where transformers fails) is refused."""
    if arch == "llama":
        return None, ()
    gemma = arch in ("gemma2", "gemma3")
    if r.lookup("sliding_window") is None and not gemma:
        return None, ()
    window = r.integer("sliding_window", 1, MAX_CONTEXT, default=4096)
    if arch in ("mistral", "phi3"):
        return window, tuple(range(num_layers))
    types = r.lookup("layer_types")
    if types is not None:
        kinds = ("full_attention", "sliding_attention")
        if not isinstance(types, list) or len(types) != num_layers or any(t not in kinds for t in types):
            r.fail("layer_types", types, f"must list {num_layers} entries, each one of {', '.join(kinds)}")
        layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    elif gemma:
        default = 2 if arch == "gemma2" else 6
        pattern = r.integer("sliding_window_pattern", 1, MAX_LAYERS,
                            default=r.integer("_sliding_window_pattern", 1, MAX_LAYERS, default=default))
        layers = tuple(i for i in range(num_layers) if (i + 1) % pattern)
    else:
        start = r.integer("max_window_layers", 0, MAX_LAYERS, default=0)
        layers = tuple(range(start, num_layers)) if read_flag(r, "use_sliding_window", False) else ()
    if arch in ("qwen2", "qwen3") and layers and not read_flag(r, "use_sliding_window", False):
        r.fail("use_sliding_window", r.lookup("use_sliding_window"), "must be true where layer_types names "
               "sliding_attention layers (transformers has no window for them then, and fails)")
    return (window, layers) if layers else (None, ())


def read_rope_theta(r: FieldReader, key: str, default: float) -> float:
    # theta <= 1 gives frequencies that do not fall with the dimension: no trained model has it.
    return r.number(key, 1.0, default=default)


# The RoPE variants rope_inv_freq computes (config.SUPPORTED_ROPE_TYPES).
ROPE_TYPES = ("default", "linear", "llama3")


def check_rope_scaling(r: FieldReader, key: str, scaling: object, context: int) -> dict | None:
    """An HF rope_scaling dict checked for what rope_inv_freq reads; None for plain RoPE. Other
    variants (Phi-3's longrope, alias su; yarn...) are refused by name: their angles differ."""
    if scaling is None:
        return None
    if not isinstance(scaling, dict):
        r.fail(key, scaling, "must be an object such as {\"rope_type\": \"linear\", \"factor\": 2.0} or null")
    sub = FieldReader(r.where, lambda k: scaling.get(k.removeprefix(f"{key}.")))
    type_key = "rope_type" if "rope_type" in scaling else "type"
    kind = scaling.get(type_key, "default")
    if kind not in ROPE_TYPES:
        r.fail(f"{key}.{type_key}", kind, f"specserve computes RoPE scaling of type {', '.join(ROPE_TYPES)} only; "
               "other variants (longrope or su, yarn, dynamic...) would silently give other outputs")
    if kind in ("linear", "llama3"):
        sub.number(f"{key}.factor", 0.0)
    if kind == "llama3":
        low = sub.number(f"{key}.low_freq_factor", 0.0, default=1.0)
        high = sub.number(f"{key}.high_freq_factor", 0.0, default=4.0)
        if high <= low:
            r.fail(f"{key}.high_freq_factor", high, f"must be above {key}.low_freq_factor={low:g}")
        sub.integer(f"{key}.original_max_position_embeddings", 2, MAX_CONTEXT, default=context)
    return dict(scaling)


def read_hf_full_rotary(r: FieldReader, rope_params: dict) -> None:
    """Refuse partial RoPE: partial_rotary_factor (top-level, or in rope_parameters, where
    transformers keeps it) other than 1 rotates only part of each head, which specserve does not."""
    for key, lookup in (("partial_rotary_factor", r.lookup),
                        ("rope_parameters.partial_rotary_factor", lambda k: rope_params.get(k.split(".")[1]))):
        sub = FieldReader(r.where, lookup)
        if sub.number(key, 0.0, 1.0, default=1.0) != 1.0:
            r.fail(key, lookup(key), "specserve rotates whole heads only (1.0); a model with partial RoPE "
                   "would silently give other outputs")


def read_flag(r: FieldReader, key: str, default: bool) -> bool:
    """A true/false field (`default` when absent); anything else is refused naming the key."""
    value = r.lookup(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        r.fail(key, value, "must be true or false")
    return value


def _short(value: object) -> str:
    """A value as messages show it: its repr, cut short (a crafted string may be megabytes)."""
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({type(value).__name__})"
