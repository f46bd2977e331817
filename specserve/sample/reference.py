"""Per-row, per-position reference of `verify`, written to be checked by eye against its rule
(verifier.py): the target's own race at each position; a draft is accepted iff it equals it.
Test oracle only: slow by design. With the same noise the two must agree token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.noise import PositionNoise


def reference_verify(draft_token_ids: torch.Tensor, num_draft: torch.Tensor, target_logits: torch.Tensor,
                     st: SamplingTensors, noise: Sequence[PositionNoise], positions: Sequence[int]) -> list[list[int]]:
    """Same inputs as `verify` (on CPU, every row with noise); returns each row's emitted tokens
    (accepted drafts + one more)."""
    vocab = target_logits.shape[-1]
    out = []
    for b in range(draft_token_ids.shape[0]):
        n, greedy = int(num_draft[b]), st.greedy_rows[b]
        p = processed_probs(target_logits[b : b + 1], st.select([b]))[0]  # [k+1, V]
        emitted = []
        for j in range(n + 1):
            if greedy:
                y = int(target_logits[b, j].argmax())
            else:  # exponential race: argmax(p / E), E ~ Exp(1), is an exact draw from p
                e = noise[b].exponentials(positions[b] + j, vocab, "cpu")
                y = int((p[j].double() / e).argmax())
            emitted.append(y)
            if j == n or int(draft_token_ids[b, j]) != y:
                break
        out.append(emitted)
    return out
