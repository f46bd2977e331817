"""Drawing tokens from processed distributions, reproducibly per request and per position.

The token at sequence position t of a request is the exponential race
    x_t = argmax_i(p_t(i) / E_t(i)),  E_t(i) ~ Exp(1) i.i.d.,
which picks token i with probability p_t(i) / sum(p_t): an exact sample of the processed
distribution p_t. E_t comes from the request's counter-based noise (noise.PositionNoise): a
function of (request seed, t) alone. So the text is a function of the seed, the target's
distributions and nothing else: the speculative verifier (verifier.py, tree_verifier.py) emits
exactly these tokens whatever was drafted, and the same seed gives the same text with and
without speculation, at any draft length. E is made in float64 from 53-bit uniforms: float32
exponentials have a coarse grid near 0, which over a 50k vocabulary biases the race measurably
towards low token ids. On the CPU the race is native (native/csrc/race.h): since E >= 1 - u, a
hash and one product rule out nearly every token, and only the few that could win take a log;
the tokens left out score strictly below the winner, so it is the full race's.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve import native
from specserve.hardware import native_level
from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.noise import PositionNoise, draw_exponentials, signed64, stream_exponentials


def race(weights: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """weights [B, V] >= 0 (not necessarily normalised), expo [B, V] -> [B] int64 sampled ids."""
    return (weights.double() / expo).argmax(-1)


def race_rows(probs: torch.Tensor, greedy_rows: Sequence[bool], noise: Sequence[PositionNoise | None],
              positions: Sequence[int]) -> torch.Tensor:
    """probs [B, V] processed (one-hot on greedy rows) -> [B] int64: the race of row b at
    sequence position positions[b]. Greedy rows draw nothing: their one-hot's argmax is the
    race's winner against any noise."""
    rows, vocab = probs.shape
    keyed = [b for b in range(rows) if not greedy_rows[b] and noise[b] is not None]
    shared = [b for b in range(rows) if not greedy_rows[b] and noise[b] is None]
    if len(keyed) == rows:  # the usual call: every row sampled with its own noise, no copies
        return _race_keyed(probs, [noise[b].key(positions[b]) for b in keyed])
    out = probs.argmax(-1)
    if keyed:
        out[keyed] = _race_keyed(probs[keyed], [noise[b].key(positions[b]) for b in keyed])
    if shared:
        out[shared] = race(probs[shared], draw_exponentials([None] * len(shared), [0] * len(shared), vocab,
                                                            probs.device))
    return out


def _race_keyed(probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """probs [B, V], keys [B] (PositionNoise.key) -> [B] int64: each row's race with the noise
    of its stream: natively where it can (the few tokens that can win, exactly: native/csrc/race.h),
    else every token's exponential in torch."""
    level = _native_race_level(probs)
    if level is None:
        return race(probs, torch.stack([stream_exponentials(k, probs.shape[1], probs.device) for k in keys]))
    keys_t = torch.tensor([signed64(k) for k in keys], dtype=torch.int64)
    return native.load().race(level, probs, keys_t)


def _native_race_level(probs: torch.Tensor) -> int | None:
    """The CPU level for the native race of these probabilities, or None for the torch one
    (another device or dtype, or no native kernels)."""
    if probs.device.type != "cpu" or probs.dtype != torch.float32 or probs.stride(1) != 1:
        return None
    return native_level()


def sample(logits: torch.Tensor, st: SamplingTensors, noise: Sequence[PositionNoise | None],
           positions: Sequence[int]) -> torch.Tensor:
    """logits [B, V] -> [B] int64: argmax on greedy rows, elsewhere the race of processed_probs
    with row b's noise at sequence position positions[b] (the position of the token drawn)."""
    if st.all_greedy:
        return logits.argmax(-1)
    return race_rows(processed_probs(logits, st), st.greedy_rows, noise, positions)
