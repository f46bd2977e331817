"""Drawing tokens from processed distributions, reproducibly per request and per position.

The token at sequence position t of a request is the exponential race
    x_t = argmax_i(p_t(i) / E_t(i)),  E_t(i) ~ Exp(1) i.i.d.,
which picks token i with probability p_t(i) / sum(p_t): an exact sample of the processed
distribution p_t. E_t comes from the request's counter-based noise (noise.PositionNoise): a
function of (request seed, t) alone. So the text is a function of the seed, the target's
distributions and nothing else: the speculative verifier (verifier.py, tree_verifier.py) emits
exactly these tokens whatever was drafted, and the same seed gives the same text with and
without speculation, at any draft length. E is made in float64 from float64 uniforms: float32
exponentials have a coarse grid near 0, which over a 50k vocabulary biases the race measurably
towards low token ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.noise import PositionNoise, draw_exponentials


def race(weights: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """weights [B, V] >= 0 (not necessarily normalised), expo [B, V] -> [B] int64 sampled ids."""
    return (weights.double() / expo).argmax(-1)


def race_rows(probs: torch.Tensor, greedy_rows: Sequence[bool], noise: Sequence[PositionNoise | None],
              positions: Sequence[int]) -> torch.Tensor:
    """probs [B, V] processed (one-hot on greedy rows) -> [B] int64: the race of row b at
    sequence position positions[b]. Greedy rows draw nothing: their one-hot wins against E = 1."""
    rows, vocab = probs.shape
    expo = torch.ones(rows, vocab, dtype=torch.float64, device=probs.device)
    sampled = [b for b in range(rows) if not greedy_rows[b]]
    if sampled:
        expo[sampled] = draw_exponentials([noise[b] for b in sampled], [positions[b] for b in sampled], vocab,
                                          probs.device)
    return race(probs, expo)


def sample(logits: torch.Tensor, st: SamplingTensors, noise: Sequence[PositionNoise | None],
           positions: Sequence[int]) -> torch.Tensor:
    """logits [B, V] -> [B] int64: argmax on greedy rows, elsewhere the race of processed_probs
    with row b's noise at sequence position positions[b] (the position of the token drawn)."""
    if st.all_greedy:
        return logits.argmax(-1)
    return race_rows(processed_probs(logits, st), st.greedy_rows, noise, positions)
