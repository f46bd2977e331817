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
from specserve.sample.noise import PositionNoise, draw_exponentials, signed64


def race(weights: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """weights [B, V] >= 0 (not necessarily normalised), expo [B, V] -> [B] int64 sampled ids."""
    return (weights.double() / expo).argmax(-1)


def race_rows(probs: torch.Tensor, greedy_rows: Sequence[bool], noise: Sequence[PositionNoise | None],
              positions: Sequence[int]) -> torch.Tensor:
    """probs [B, V] processed (one-hot on greedy rows) -> [B] int64: the race of row b at
    sequence position positions[b]. Greedy rows draw nothing: their one-hot's argmax is the
    race's winner against any noise. Rows with their own noise race natively where they can
    (the few tokens that can win, exactly: native/csrc/race.h); the others against every
    token's exponential (draw_exponentials)."""
    rows, vocab = probs.shape
    sampled = [b for b in range(rows) if not greedy_rows[b]]
    level = _native_race_level(probs)
    native_rows = [b for b in sampled if noise[b] is not None] if level is not None else []
    if len(native_rows) == rows:  # the usual call on the CPU: no copies
        return _native_race(level, probs, [noise[b].key(positions[b]) for b in native_rows])
    out = probs.argmax(-1) if len(sampled) < rows else torch.empty(rows, dtype=torch.long, device=probs.device)
    if native_rows:
        out[native_rows] = _native_race(level, probs[native_rows], [noise[b].key(positions[b]) for b in native_rows])
    native_set = set(native_rows)
    drawn = [b for b in sampled if b not in native_set]
    if drawn:
        out[drawn] = race(probs[drawn], draw_exponentials([noise[b] for b in drawn], [positions[b] for b in drawn],
                                                          vocab, probs.device))
    return out


def _native_race(level: int, probs: torch.Tensor, keys: list[int]) -> torch.Tensor:
    """probs [B, V] float32 on the CPU, keys [B] (PositionNoise.key) -> [B] int64 winners."""
    return native.load().race(level, probs, torch.tensor([signed64(k) for k in keys], dtype=torch.int64))


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
