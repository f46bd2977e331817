"""The settings of `specserve train-draft`, validated once, before the target loads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specserve.errors import InvalidParameterError
from specserve.spec.heads.config import SAVE_DTYPES

# Per-method defaults where the two differ: EAGLE unrolls 3 steps, Medusa has 4 heads. Measured
# on the embedded model (531 sequences, 84k answer tokens): EAGLE's held-out top-1 rose from
# 0.27 (3 epochs of 4096-token batches at 5e-4) to 0.46 (12 epochs of 1024 at 1e-3), still
# rising slowly; Medusa's head 1 from 0.25 to 0.33 (8 epochs of 1024).
# EAGLE-3 trains 5 unrolled steps ("training-time test") on a much larger set (see
# train/eagle3.py), so fewer passes over it.
METHOD_DEFAULTS = {"eagle": {"depth": 3, "epochs": 12, "lr": 1e-3}, "medusa": {"depth": 4, "epochs": 8, "lr": 1e-3},
                   "eagle3": {"depth": 5, "epochs": 2, "lr": 5e-4, "chunk_size": 64}}
TRAIN_METHODS = tuple(METHOD_DEFAULTS)
GENERATORS = ("auto", "engine", "batch")
# What each position is trained toward: the target's argmax (one-hot cross-entropy) or its
# probabilities over the draft vocabulary (EAGLE-3's reference training: every token the target
# weighs teaches, not only its first choice). Held-out accuracy is scored against the argmax
# either way.
TARGETS = ("argmax", "probs")


@dataclass(frozen=True, slots=True)
class TrainDraftConfig:
    """Everything `train-draft` takes, validated once."""

    method: str
    target: str  # model path or "default"
    out: str
    prompts: str | None = None  # JSONL; None: the target writes the user turns
    num_prompts: int = 640
    max_new_tokens: int = 192
    epochs: int | None = None  # None: the method's default (METHOD_DEFAULTS), likewise lr and depth
    lr: float | None = None
    seed: int = 0
    depth: int | None = None  # EAGLE: unrolled training steps; Medusa: heads
    eval_depth: int = 6  # EAGLE: draft depth scored on the held-out split (Medusa: its heads)
    draft_vocab: int = 8192  # 0: the whole vocabulary
    tokens_per_batch: int = 1024
    held_out: float = 0.05
    tree_nodes: int = 16  # Medusa: nodes of the static tree chosen from held-out accuracy
    save_dtype: str = "bfloat16"
    device: str = "cpu"
    prompt_max_tokens: int = 64
    cache: str | None = None  # the data cache folder; None: out/cache
    chunk_size: int | None = None  # None: 32, or the method's default (METHOD_DEFAULTS)
    resume: bool = False
    command: str = ""  # as typed, recorded in config.json
    # Who answers the prompts: "engine", "batch" (train/batch_generate.py) or "auto" (the batch
    # on an accelerator, where the engine's per-request work is the cost; the engine on a CPU).
    generator: str = "auto"
    data_minutes: float | None = None  # no data chunk is begun after this long (None: all)
    train_minutes: float | None = None  # the step count is fitted to this time (None: every epoch)
    # eagle3: a drafter folder ("default": the shipped one) to start from instead of fresh weights:
    # fine-tuning a published or earlier drafter on this run's data (its draft vocabulary and
    # target layers are kept).
    init: str | None = None
    targets: str = "argmax"  # TARGETS; "probs" for eagle3 only

    def __post_init__(self) -> None:
        if self.method not in TRAIN_METHODS:
            raise InvalidParameterError("method", self.method, f"must be one of {', '.join(TRAIN_METHODS)}")
        for name, value in {"chunk_size": 32, **METHOD_DEFAULTS[self.method]}.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        positive = ("num_prompts", "max_new_tokens", "epochs", "depth", "eval_depth", "tokens_per_batch",
                    "tree_nodes", "prompt_max_tokens", "chunk_size")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidParameterError(name.replace("_", "-"), value, "must be a positive integer")
        if self.draft_vocab < 0:
            raise InvalidParameterError("draft-vocab", self.draft_vocab, "must be >= 0 (0: the whole vocabulary)")
        if not 0 < self.lr < 1:
            raise InvalidParameterError("lr", self.lr, "must lie in (0, 1)")
        if not 0 < self.held_out < 1:
            raise InvalidParameterError("held-out", self.held_out, "must lie in (0, 1)")
        if self.init is not None and self.method != "eagle3":
            raise InvalidParameterError("init", self.init, "is an EAGLE-3 drafter to start from: only with --method eagle3")
        if self.targets not in TARGETS:
            raise InvalidParameterError("targets", self.targets, f"must be one of {', '.join(TARGETS)}")
        if self.targets == "probs" and self.method != "eagle3":
            raise InvalidParameterError("targets", self.targets, "probs is for --method eagle3 (the others train toward the argmax)")
        if self.generator not in GENERATORS:
            raise InvalidParameterError("generator", self.generator, f"must be one of {', '.join(GENERATORS)}")
        for name in ("data_minutes", "train_minutes"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise InvalidParameterError(name.replace("_", "-"), value, "must be a positive number of minutes")
        if self.save_dtype not in SAVE_DTYPES:
            raise InvalidParameterError("save-dtype", self.save_dtype, f"must be one of {', '.join(SAVE_DTYPES)}")

    def generator_on(self, device_type: str) -> str:
        """The generator that answers, "auto" resolved for the target's device."""
        if self.generator != "auto":
            return self.generator
        return "engine" if device_type == "cpu" else "batch"

    @property
    def data_seconds(self) -> float | None:
        return None if self.data_minutes is None else 60 * self.data_minutes

    @property
    def train_seconds(self) -> float | None:
        return None if self.train_minutes is None else 60 * self.train_minutes

    @property
    def score_depth(self) -> int:
        return self.eval_depth if self.method in ("eagle", "eagle3") else self.depth

    @staticmethod
    def default_of(name: str):
        """A setting's default, for a run recorded before the setting existed."""
        f = TrainDraftConfig.__dataclass_fields__[name]
        return None if f.default is dataclasses.MISSING else f.default

    def identity(self) -> dict:
        """The settings that shape data and training: a --resume must not change them."""
        d = dataclasses.asdict(self)
        for k in ("resume", "command", "epochs", "out", "device", "cache", "data_minutes", "train_minutes"):
            d.pop(k)
        return d
