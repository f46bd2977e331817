"""An EAGLE-3 drafter's shape, whatever layout its checkpoint came in, and the canonical names
of its tensors.

EAGLE-3 (Li et al., 2025) drafts from three of the target's hidden states instead of its last:
the residual streams entering a low, a middle and a high decoder layer (`aux_layers`), fused by
`fc` [H, 3 Ht] into one feature. One decoder layer then reads the concatenation of the normed
token embedding and the normed feature [2H] (its q/k/v products take 2H columns), and its
output (before the final norm) is both the next depth's feature and, through `norm` and
`lm_head`, logits over a reduced draft vocabulary whose rows map to target ids (`draft_ids`).

Canonical tensor names (spec/heads/eagle3_checkpoint.py maps published layouts onto them):
  fc.weight                           [H, 3 * Ht]
  layer.input_layernorm.weight        [H]   applied to the token embedding
  layer.hidden_norm.weight            [H]   applied to the feature
  layer.q_proj.weight                 [num_heads * head_dim, 2H]
  layer.k_proj.weight, v_proj.weight  [num_kv_heads * head_dim, 2H]
  layer.o_proj.weight                 [H, num_heads * head_dim]
  layer.post_attention_layernorm.weight [H]
  layer.gate_proj.weight, up_proj.weight [I, H];  layer.down_proj.weight [H, I]
  norm.weight                         [H]
  lm_head.weight                      [Vd, H]
  draft_ids                           [Vd] int64: the target token id of each draft row
  embed_tokens.weight                 [V, H] optional: a drafter's own embedding (else the target's)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from specserve.errors import ModelLoadError
from specserve.model.config import ModelConfig

CANONICAL_MATRICES = ("fc.weight", "layer.q_proj.weight", "layer.k_proj.weight", "layer.v_proj.weight",
                      "layer.o_proj.weight", "layer.gate_proj.weight", "layer.up_proj.weight",
                      "layer.down_proj.weight", "lm_head.weight")
CANONICAL_VECTORS = ("layer.input_layernorm.weight", "layer.hidden_norm.weight",
                     "layer.post_attention_layernorm.weight", "norm.weight")
DRAFT_IDS = "draft_ids"
OWN_EMBEDDING = "embed_tokens.weight"


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The layers EAGLE-3's reference code and vLLM read when a checkpoint names none:
    (2, L // 2, L - 3), the residual streams entering them (clamped into a shallow target)."""
    last = num_target_layers - 1
    return tuple(sorted(min(i, last) for i in (2, num_target_layers // 2, max(0, num_target_layers - 3))))


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    hidden_size: int  # H, the drafter's
    target_hidden_size: int  # Ht, each of the three fused target states
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    vocab_size: int  # the target's
    draft_vocab_size: int  # Vd
    aux_layers: tuple[int, ...]  # target layers whose entering residual streams fc fuses, non-decreasing
    # speculators' variant: the feature is normed before it becomes the layer's residual (the
    # reference code keeps the raw feature as the residual).
    norm_before_residual: bool = False

    def __post_init__(self) -> None:
        ints = ("hidden_size", "target_hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                "max_position_embeddings", "vocab_size", "draft_vocab_size")
        for name in ints:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ModelLoadError(f"EAGLE-3 drafter: {name}={value!r} must be a positive integer")
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(f"EAGLE-3 drafter: num_heads ({self.num_heads}) must be a multiple of "
                                 f"num_kv_heads ({self.num_kv_heads})")
        if self.draft_vocab_size > self.vocab_size:
            raise ModelLoadError(f"EAGLE-3 drafter: draft_vocab_size {self.draft_vocab_size} exceeds the "
                                 f"vocabulary ({self.vocab_size})")
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise ModelLoadError(f"EAGLE-3 drafter: {name}={value!r} must be a finite number > 0")
        aux = self.aux_layers
        # Non-decreasing: a shallow target repeats a layer in the default (2, L // 2, L - 3).
        if (len(aux) != 3 or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in aux)
                or list(aux) != sorted(aux)):
            raise ModelLoadError(f"EAGLE-3 drafter: aux_layers={list(aux)!r} must be three layer indices in "
                                 "non-decreasing order")

    def check_target(self, target: ModelConfig, where: str) -> None:
        """Refuse a drafter whose sizes do not fit `target` (a config.json is untrusted input)."""
        if self.target_hidden_size != target.hidden_size:
            raise ModelLoadError(f"{where}: the EAGLE-3 drafter reads hidden states of size {self.target_hidden_size}, "
                                 f"but the target's are {target.hidden_size}")
        if self.vocab_size != target.vocab_size:
            raise ModelLoadError(f"{where}: the EAGLE-3 drafter's vocabulary has {self.vocab_size} tokens, "
                                 f"the target's {target.vocab_size}")
        if self.aux_layers[-1] >= target.num_layers:
            raise ModelLoadError(f"{where}: the EAGLE-3 drafter reads target layers {list(self.aux_layers)}, "
                                 f"but the target has {target.num_layers}")

    def layer_config(self) -> ModelConfig:
        """The decoder layer's attention shape as a one-layer ModelConfig (RoPE tables, KV cache)."""
        return ModelConfig(architecture="llama", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
                           intermediate_size=self.intermediate_size, num_layers=1, num_heads=self.num_heads,
                           num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           max_position_embeddings=self.max_position_embeddings, rms_norm_eps=self.rms_norm_eps,
                           rope_theta=self.rope_theta, rope_scaling=self.rope_scaling)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every canonical tensor's shape (embed_tokens.weight aside, which is optional)."""
        h, q, kv, i = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, \
            self.intermediate_size
        return {"fc.weight": (h, 3 * self.target_hidden_size), "layer.input_layernorm.weight": (h,),
                "layer.hidden_norm.weight": (h,), "layer.q_proj.weight": (q, 2 * h),
                "layer.k_proj.weight": (kv, 2 * h), "layer.v_proj.weight": (kv, 2 * h),
                "layer.o_proj.weight": (h, q), "layer.post_attention_layernorm.weight": (h,),
                "layer.gate_proj.weight": (i, h), "layer.up_proj.weight": (i, h), "layer.down_proj.weight": (h, i),
                "norm.weight": (h,), "lm_head.weight": (self.draft_vocab_size, h),
                DRAFT_IDS: (self.draft_vocab_size,)}
