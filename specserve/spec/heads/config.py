"""What a trained drafter's config.json holds: its method, sizes, the target it was trained
for, and how it was trained."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.errors import InvalidParameterError, ModelLoadError
from specserve.model.config import ModelConfig
from specserve.model.loader import LoadedModel

DRAFTER_METHODS = ("eagle", "medusa")
FORMAT_VERSION = 1
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# Embedding rows whose norms fingerprint the target (spread over the vocabulary).
_PROBE_ROWS = 8
# The norms agree to float rounding across dtypes and loaders (float32 vs bfloat16 weights,
# a GGUF dequantized by either), and differ by far more between two trained models.
_FINGERPRINT_RTOL = 2e-2


# The fields of an EAGLE layer's config that size its tensors (the rest, e.g. its context, do not:
# its RoPE tables follow the target's).
_LAYER_SHAPE_KEYS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "rope_scaling", "attention_bias")


@dataclass(frozen=True, slots=True)
class TargetIdentity:
    """Enough of the target to refuse a drafter trained for another model."""

    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    fingerprint: list[float]  # [_PROBE_ROWS] L2 norms of spread-out embedding rows

    @classmethod
    def of(cls, target: LoadedModel) -> TargetIdentity:
        cfg = target.config
        return cls(target.name, cfg.vocab_size, cfg.hidden_size, cfg.num_layers, _fingerprint(target))

    def check(self, target: LoadedModel, where: str) -> None:
        cfg = target.config
        ours = (self.vocab_size, self.hidden_size, self.num_layers)
        theirs = (cfg.vocab_size, cfg.hidden_size, cfg.num_layers)
        if ours != theirs:
            raise InvalidParameterError(
                "speculative_config.model", where,
                f"the drafter was trained for {self.name} (vocabulary, hidden size, layers = {ours}), "
                f"but the target {target.name} has {theirs}")
        fp = torch.tensor(_fingerprint(target))
        if not torch.allclose(fp, torch.tensor(self.fingerprint), rtol=_FINGERPRINT_RTOL, atol=0):
            raise InvalidParameterError(
                "speculative_config.model", where,
                f"the drafter was trained for {self.name}, whose embedding differs from the target "
                f"{target.name}'s (same shapes, other weights)")


def _fingerprint(target: LoadedModel) -> list[float]:
    emb = target.model.embed_tokens.weight
    rows = torch.linspace(0, emb.shape[0] - 1, _PROBE_ROWS).long().to(emb.device)
    return [round(float(x), 5) for x in emb[rows].float().norm(dim=-1).cpu()]


@dataclass(frozen=True, slots=True)
class DrafterConfig:
    """A drafter's shape and provenance (config.json next to model.safetensors)."""

    method: str  # "eagle" or "medusa"
    hidden_size: int  # the target's
    vocab_size: int  # the target's
    # Rows of the target's vocabulary projection the drafter scores: the tokens it can draft.
    # Fewer rows make drafting and training cheaper; equal to vocab_size: every token.
    draft_vocab_size: int
    target: TargetIdentity
    dtype: str = "float32"  # of the saved weights
    num_heads: int = 0  # medusa: K heads, head k predicting token t+1+k from the hidden state at t
    # eagle: the decoder layer's shape, a one-layer ModelConfig of the target's family.
    layer: dict | None = None
    # medusa: the static tree as rank paths (Medusa's notation, see spec/tree.py from_choices),
    # chosen at training time from the held-out accuracy of each head's top-k.
    tree_choices: list[list[int]] | None = None
    training: dict = field(default_factory=dict)  # command, seed, held-out figures, time

    def __post_init__(self) -> None:
        if self.method not in DRAFTER_METHODS:
            raise ModelLoadError(f"drafter method {self.method!r} is not one of {', '.join(DRAFTER_METHODS)}")
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ModelLoadError(f"draft_vocab_size {self.draft_vocab_size} must lie in [1, {self.vocab_size}]")
        if self.dtype not in SAVE_DTYPES:
            raise ModelLoadError(f"drafter dtype {self.dtype!r} is not one of {', '.join(SAVE_DTYPES)}")
        if self.method == "medusa" and self.num_heads < 1:
            raise ModelLoadError("a Medusa drafter needs num_heads >= 1")
        if self.method == "eagle" and not self.layer:
            raise ModelLoadError("an EAGLE drafter needs its decoder layer's config ('layer')")

    def layer_config(self) -> ModelConfig:
        return ModelConfig(**self.layer)

    def check_layer(self, target: ModelConfig, where: str) -> None:
        """An EAGLE drafter's layer has the target's own layer shape (eagle_layer): a config.json
        is untrusted, and its numbers size the layer built from it, so each must equal the
        target's (already checked at load) before anything is allocated."""
        if self.method != "eagle":
            return
        ours = self.layer if isinstance(self.layer, dict) else {}
        theirs = DrafterConfig.eagle_layer(target)
        bad = [k for k in _LAYER_SHAPE_KEYS if ours.get(k) != theirs[k] or type(ours.get(k)) is not type(theirs[k])]
        if bad:
            raise ModelLoadError(f"{where}: the EAGLE drafter's layer {bad[0]}={ours.get(bad[0])!r} differs from the "
                                 f"target's {theirs[bad[0]]!r}; its layer must have the target's shape")
        # Rounded differently by a GGUF and an HF folder of one model, so only checked for sense.
        for key in ("rms_norm_eps", "rope_theta"):
            value = ours.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ModelLoadError(f"{where}: the EAGLE drafter's layer {key}={value!r} must be a finite number > 0")

    @staticmethod
    def eagle_layer(target: ModelConfig) -> dict:
        """The target's own layer shape, one layer deep (as in EAGLE)."""
        return dataclasses.asdict(dataclasses.replace(target, num_layers=1, extra={}))

    def to_json(self) -> str:
        return json.dumps({"format_version": FORMAT_VERSION, **dataclasses.asdict(self)}, indent=2) + "\n"

    @classmethod
    def read(cls, folder: Path) -> DrafterConfig:
        path = folder / CONFIG_FILE
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"cannot read the drafter's {path}: {e}") from None
        if raw.pop("format_version", None) != FORMAT_VERSION:
            raise ModelLoadError(f"{path} is not a specserve drafter config (format_version {FORMAT_VERSION})")
        try:
            raw["target"] = TargetIdentity(**raw["target"])
            return cls(**raw)
        except (KeyError, TypeError) as e:
            raise ModelLoadError(f"{path} has a missing or unknown field: {e}") from None
