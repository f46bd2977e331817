"""Training passes and losses of the drafters over recorded sequences, and their per-depth
accuracy (the same pass serves training and the held-out report).

Labels are the target's own greedy choices: `labels[p]` is the target's argmax at position p
(its prediction of token p+1), as a draft-vocabulary index. That is exactly what greedy
verification accepts, also in the prompt region, where the next token is the user's text.

EAGLE is trained unrolled ("training-time test", as in HASS and EAGLE-3): step 1 reads the
target's features, step s > 1 reads the drafter's own step s-1 prediction, as when drafting
depth s. All steps run over the whole sequence at once: the queries of step s (at positions
t+s-1) see step 1's keys causally (the committed context, computed from the target's
features) and the key of every earlier step at their own index (their ancestors in a draft).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.hardware import autocast_dtype
from specserve.model.attention import attention
from specserve.spec.heads import Drafter

# EAGLE's loss: feature regression plus 0.1 x cross-entropy through the vocabulary projection.
CE_WEIGHT = 0.1
# EAGLE's input noise on the target's features, U(-0.1, 0.1): drafting reads imperfect features.
FEATURE_NOISE = 0.1


def mixed_precision(device: torch.device):
    """bfloat16 autocast where the hardware has bfloat16: matrix products at twice float32's
    rate on a CPU with AVX-512 BF16 (measured here: 107 vs 49 GFLOP/s for the [4096, 576] x
    [576, 8192] product) and on GPUs; weights, optimizer state and losses stay float32.
    Elsewhere float32 throughout (see hardware.autocast_dtype)."""
    dtype = autocast_dtype(device)
    return torch.autocast(device_type=device.type, dtype=dtype) if dtype else contextlib.nullcontext()


@dataclass(slots=True)
class SequenceBatch:
    """Recorded sequences, padded at the end by `depth` (unroll steps or Medusa heads) so that
    every index t of [0, T) has its labels at t+1..t+depth."""

    tokens: torch.Tensor  # [B, T + depth] int64 token ids, 0 as padding
    features: torch.Tensor  # [B, T + depth, H] float32 target final hidden states (after its final norm)
    labels: torch.Tensor  # [B, T + depth] int64 draft-vocab index of the target's argmax, -1 outside it
    valid: torch.Tensor  # [B, T + depth] bool: label positions in the answer (prompt_len - 1 <= p <= len - 2)
    depth: int
    # [B, T + depth, Ht] float32 the target's final hidden states (EAGLE-3 trained toward the
    # target's probabilities, which its head makes of them); None: trained toward the labels
    target_final: torch.Tensor | None = None

    @property
    def width(self) -> int:
        return self.tokens.shape[1] - self.depth


@dataclass(slots=True)
class StepResult:
    """One depth (EAGLE unroll step s, or Medusa head s) over a batch."""

    loss: torch.Tensor  # scalar
    correct: torch.Tensor  # [B, T] bool: top-1 equals the label (False where not valid)
    valid: torch.Tensor  # [B, T] bool: index t has a label at depth s
    ranks: torch.Tensor  # [M] int64 rank of the label among the draft logits, at the valid indices (-1: outside)


class UnrolledAttention:
    """The attention interface (`attend(layer, q, k, v, meta)`) for an unrolled pass: call s
    stores its keys and values, and its queries see call 1's keys causally and the keys of
    calls 2..s at their own index only."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta) -> torch.Tensor:
        """q [B, T, H, D]; k, v [B, T, Hkv, D] -> [B, T, H * D]."""
        self.keys.append(k)
        self.values.append(v)
        steps, t = len(self.keys), q.shape[1]
        idx = torch.arange(t, device=q.device)
        causal = idx[None, :] <= idx[:, None]  # [T, T]
        diagonal = torch.eye(t, dtype=torch.bool, device=q.device)
        visible = torch.cat([causal] + [diagonal] * (steps - 1), dim=1)  # [T, steps * T]
        mask = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill_(~visible, float("-inf"))
        keys = torch.cat(self.keys, dim=1).transpose(1, 2)  # [B, Hkv, steps * T, D]
        values = torch.cat(self.values, dim=1).transpose(1, 2)
        return attention(q, keys, values, mask[None, None])


def _step(drafter: Drafter, hidden: torch.Tensor, target_features: torch.Tensor | None,
          labels: torch.Tensor, valid: torch.Tensor, want_ranks: bool, weight: float = 1.0,
          probs: torch.Tensor | None = None) -> StepResult:
    """hidden [B, T, H] predicted features; labels, valid [B, T] at their label positions.
    weight scales the step's loss (EAGLE-3 weighs later unrolled steps less). probs [B, T, Vd]:
    the target's probabilities over the draft vocabulary, the cross-entropy's target instead of
    the labels (at the same positions: those whose label the draft vocabulary holds)."""
    rows = hidden[valid]  # [M, H]
    logits = drafter.vocab(rows)  # [M, Vd]
    lab = labels[valid]
    known = lab >= 0
    if not bool(known.any()):
        ce = logits.sum() * 0
    elif probs is None:
        ce = F.cross_entropy(logits[known], lab[known])
    else:
        ce = -(probs[valid][known] * F.log_softmax(logits[known].float(), dim=-1)).sum(-1).mean()
    loss = ce
    if target_features is not None:
        reg = F.smooth_l1_loss(rows, target_features[valid]) if rows.numel() else rows.sum()
        loss = reg + CE_WEIGHT * ce
    loss = loss * weight
    correct = torch.zeros_like(valid)
    with torch.no_grad():
        correct[valid] = (logits.argmax(-1) == lab) & known
        ranks = torch.full_like(lab, -1)
        if want_ranks and bool(known.any()):
            label_logit = logits[known].gather(1, lab[known, None])
            ranks[known] = (logits[known] > label_logit).sum(-1)
    return StepResult(loss, correct, valid, ranks)


def eagle_steps(drafter: Drafter, batch: SequenceBatch, noise: torch.Generator | None = None,
                want_ranks: bool = False) -> list[StepResult]:
    """`batch.depth` unrolled steps; noise on the step-1 features when a generator is given."""
    t = batch.width
    with torch.no_grad():
        embeds = drafter.embed(batch.tokens)  # [B, T + depth, H], the frozen target embedding
    features = batch.features[:, :t]
    if noise is not None:
        u = torch.rand(features.shape, generator=noise, device=features.device, dtype=features.dtype)
        features = features + (2 * u - 1) * FEATURE_NOISE
    positions = torch.arange(t, device=features.device).expand(features.shape[0], t)
    cache = UnrolledAttention()
    out = []
    for s in range(1, batch.depth + 1):
        features = drafter.heads(embeds[:, s:s + t], features, positions + (s - 1), None, cache)
        out.append(_step(drafter, features, batch.features[:, s:s + t], batch.labels[:, s:s + t],
                         batch.valid[:, s:s + t], want_ranks))
    return out


# EAGLE-3's weight of unrolled step s (s = 1, 2, ...): STEP_DECAY ** (s - 1), as its reference
# training does: later steps start from the drafter's own, less certain, features.
STEP_DECAY = 0.8


def eagle3_steps(drafter, batch: SequenceBatch, noise: torch.Generator | None = None,
                 want_ranks: bool = False) -> list[StepResult]:
    """EAGLE-3's training-time test: `batch.depth` unrolled steps over whole sequences. Step 1
    reads fc(the target's three captured states) [B, T, 3 Ht] -> [B, T, H]; step s > 1 reads
    the drafter's own output of step s - 1. Cross-entropy only (no feature regression: the
    drafter's features need not imitate any target state). `drafter` is an Eagle3Trainee
    (train/eagle3.py); noise is unused (the unrolled steps are EAGLE-3's own robustness).
    While training, a batch with the target's final states and a drafter with the target's
    head (`teacher`) train toward the target's probabilities; the held-out loss stays the
    labels' cross-entropy, comparable across runs."""
    t = batch.width
    head = drafter.heads
    with torch.no_grad():
        embeds = drafter.embed(batch.tokens).float()  # [B, T + depth, H], the frozen target embedding
        probs = None
        if head.training and drafter.teacher is not None and batch.target_final is not None:
            probs = torch.softmax(drafter.teacher(batch.target_final).float(), dim=-1)  # [B, T + depth, Vd]
    feature = head.fuse(batch.features[:, :t])
    positions = torch.arange(t, device=feature.device).expand(feature.shape[0], t)
    cache = UnrolledAttention()
    out = []
    for s in range(1, batch.depth + 1):
        feature = head(embeds[:, s:s + t], feature, positions + (s - 1), None, cache)
        out.append(_step(drafter, feature, None, batch.labels[:, s:s + t], batch.valid[:, s:s + t], want_ranks,
                         STEP_DECAY ** (s - 1), None if probs is None else probs[:, s:s + t]))
    return out


def drafter_steps(drafter, batch: SequenceBatch, noise: torch.Generator | None = None,
                  want_ranks: bool = False) -> list[StepResult]:
    """The training pass of the drafter's method."""
    method = drafter.config.method
    if method == "eagle3":
        return eagle3_steps(drafter, batch, noise, want_ranks)
    if method == "eagle":
        return eagle_steps(drafter, batch, noise, want_ranks)
    return medusa_steps(drafter, batch, want_ranks)


def medusa_steps(drafter: Drafter, batch: SequenceBatch, want_ranks: bool = False) -> list[StepResult]:
    """Head k (k = 1..depth) from the feature at t, against the target's argmax at t+k."""
    t = batch.width
    heads = drafter.heads(batch.features[:, :t])  # [B, T, K, H]
    return [_step(drafter, heads[:, :, k - 1], None, batch.labels[:, k:k + t], batch.valid[:, k:k + t], want_ranks)
            for k in range(1, batch.depth + 1)]


def accepted_lengths(steps: list[StepResult]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (accepted [N], starts [N]): for every index t whose first depth is valid, how many
    leading depths are correct, i.e. the drafts a top-1 chain would have accepted from t."""
    correct = torch.stack([s.correct for s in steps], dim=-1)  # [B, T, D]
    accepted = correct.long().cumprod(-1).sum(-1)  # [B, T]
    starts = steps[0].valid
    return accepted[starts], starts
