"""The speculative verifier: a pure function from draft tokens and target logits to the tokens a
step emits, which are exactly the tokens plain sampling would emit with the same noise.

Per row b with n = num_draft[b] drafts x_0..x_{n-1}, the first to come at sequence position
t0 = positions[b]: for j = 0, 1, ... the target's token at position t0 + j is
    y_j = race(p_j, E_{t0+j})       (sampler.race; greedy rows: the argmax of the raw logits)
with p_j the processed target distribution after the accepted prefix x_0..x_{j-1}. Draft x_j is
accepted iff x_j == y_j; at the first mismatch, or after all n are accepted, y_j is emitted
("recovered" or "bonus") and the step ends.

Why this is lossless: every emitted token is y_j, the race the target's own plain sampling runs
at that position with that noise (an accepted x_j equals y_j), so the text IS the target's
sample, token for token, at any k and for any proposer. For a deterministic draft (q one-hot at
x) acceptance has probability P(y_j = x) = p_j(x) = min(1, p/q), exactly standard speculative
sampling's. A proposer that samples its drafts draws them as race(q_j, E_{t0+j}) with the same
noise (a Gumbel-max coupling), so it needs no draft probabilities here: it is accepted whenever
the two races agree.

Noise is drawn lazily, depth by depth, only for positions a row reaches: a step draws as many
vocabulary-sized vectors as tokens it emits, as plain decoding does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.noise import PositionNoise
from specserve.sample.sampler import race_rows


@dataclass(frozen=True, slots=True)
class VerifyOutput:
    output_token_ids: torch.Tensor  # [B, k+1] int64: accepted drafts, then the recovered or bonus token, then -1
    num_accepted: torch.Tensor  # [B] int64: draft tokens accepted, 0..num_draft[b]
    num_emitted: torch.Tensor  # [B] int64: num_accepted + 1
    accepted_mask: torch.Tensor  # [B, k] bool: draft position j accepted (j < num_accepted)
    recovered_token_ids: torch.Tensor  # [B] int64: token emitted at the first rejection, or -1
    bonus_token_ids: torch.Tensor  # [B] int64: token emitted after all drafts were accepted, or -1


def verify(draft_token_ids: torch.Tensor, num_draft: torch.Tensor, target_logits: torch.Tensor,
           st: SamplingTensors, noise: Sequence[PositionNoise | None], positions: Sequence[int]) -> VerifyOutput:
    """draft_token_ids [B, k] int64 (-1 past num_draft), num_draft [B] int64 in 0..k,
    target_logits [B, k+1, V] raw logits after each of the k+1 inputs; noise[b] row b's noise
    (None: the global RNG), positions[b] the sequence position of row b's first draft."""
    rows, k = draft_token_ids.shape
    if target_logits.shape[:2] != (rows, k + 1):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} must be [{rows}, {k + 1}, V] "
                         f"for draft_token_ids {tuple(draft_token_ids.shape)}")
    if len(noise) != rows or len(positions) != rows:
        raise ValueError(f"{len(noise)} noise sources and {len(positions)} positions for {rows} rows")
    device = target_logits.device
    n = num_draft.tolist()
    drafts = draft_token_ids.tolist()
    p = processed_probs(target_logits, st)  # [B, k+1, V]; one-hot on greedy rows
    num_accepted, emitted = [0] * rows, [0] * rows
    alive = list(range(rows))
    for j in range(k + 1):  # depth by depth, over the rows still accepting
        won = race_rows(p[alive, j], [st.greedy_rows[b] for b in alive], [noise[b] for b in alive],
                        [positions[b] + j for b in alive]).tolist()  # [A]
        still = []
        for b, y in zip(alive, won):
            if j < n[b] and drafts[b][j] == y:
                still.append(b)
            else:
                num_accepted[b], emitted[b] = j, y
        alive = still
        if not alive:
            break

    accepted = torch.tensor(num_accepted, dtype=torch.long, device=device)
    last = torch.tensor(emitted, dtype=torch.long, device=device)
    accepted_mask = torch.arange(k, device=device) < accepted.unsqueeze(-1)  # [B, k]
    out = torch.where(accepted_mask, draft_token_ids, -1)
    out = torch.cat([out, torch.full((rows, 1), -1, dtype=torch.long, device=device)], dim=1)
    out.scatter_(1, accepted.unsqueeze(-1), last.unsqueeze(-1))
    rejected = accepted < num_draft
    return VerifyOutput(
        output_token_ids=out,
        num_accepted=accepted,
        num_emitted=accepted + 1,
        accepted_mask=accepted_mask,
        recovered_token_ids=torch.where(rejected, last, -1),
        bonus_token_ids=torch.where(rejected, -1, last),
    )
