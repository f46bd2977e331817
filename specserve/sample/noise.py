"""Counter-based noise: the random numbers for the token at sequence position t of a request are
a function of (request seed, t) alone.

So they do not depend on how many drafts were verified, on which proposer drafted them, on
what else shares the batch, or on how often a step was computed (a retried step, a preempted
and recomputed request): the same seed gives the same text with and without speculation.

The definition: position t's stream key is a splitmix64 hash of (seed, t), and token i's
uniform is u_i = (output i + 1 of the splitmix64 stream from that key) >> 11, times 2^-53, i.e.
   state_i = key + (i + 1) * 0x9E3779B97F4A7C15 (mod 2^64),  u_i = mix(state_i) >> 11 / 2^53,
in [0, 1) on a grid of 2^-53; the token's exponential is E_i = -log(u_i) in float64 (see
sampler.race for why float64). Each u_i is a function of (key, i) alone, so any token's
noise costs one hash: the native race (native/csrc/race.h) computes the few it needs without
drawing the whole vocabulary's, and the torch code here computes every token's on any device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _splitmix64(x: int) -> int:
    """One splitmix64 output for state x (Steele et al. 2014): a bijection of 64-bit words whose
    outputs for consecutive x look independent."""
    x = (x + _GAMMA) & _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def signed64(x: int) -> int:
    """A 64-bit word as the int64 with the same bits (torch's integers are signed)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(z: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 words (torch's >> on int64 is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def stream_bits(key: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """[vocab] int64: token i's 53 random bits k_i (u_i = k_i * 2^-53) in the stream `key` (the
    module's definition). int64 products wrap modulo 2^64 on every torch device, as the
    definition's unsigned ones do."""
    z = torch.arange(1, vocab + 1, dtype=torch.int64, device=device) * signed64(_GAMMA) + signed64(key)
    z = (z ^ _shr(z, 30)) * signed64(_MIX1)
    z = (z ^ _shr(z, 27)) * signed64(_MIX2)
    return _shr(z ^ _shr(z, 31), 11)


def stream_exponentials(key: int, vocab: int, device: torch.device | str) -> torch.Tensor:
    """[vocab] float64: E_i = -log(u_i) of the stream `key`. u in [0, 1) gives E in (0, inf]:
    E = inf scores 0 in a race, and no E is 0, so no p / 0."""
    return -(stream_bits(key, vocab, device).double() * 2.0**-53).log()


@dataclass(frozen=True, slots=True)
class PositionNoise:
    """The noise of one request: `seed` in [0, 2**63) (SamplingParams.seed, or one the engine
    drew for an unseeded request)."""

    seed: int

    def key(self, position: int) -> int:
        """The 64-bit key of the stream for the token at sequence `position`."""
        return _splitmix64(_splitmix64(self.seed) ^ position)

    def exponentials(self, position: int, vocab: int, device: torch.device | str) -> torch.Tensor:
        """[vocab] float64 i.i.d. Exp(1) for the token at sequence `position`."""
        return stream_exponentials(self.key(position), vocab, device)


def draw_exponentials(noise: Sequence[PositionNoise | None], positions: Sequence[int], vocab: int,
                      device: torch.device | str) -> torch.Tensor:
    """Exponentials for row j at sequence position positions[j] -> [len(noise), vocab] float64.
    Rows without noise (None: callers that promise no reproducibility, such as statistical
    tests) share the global RNG and are drawn together in one call."""
    out = torch.empty(len(noise), vocab, dtype=torch.float64, device=device)
    shared = [j for j, n in enumerate(noise) if n is None]
    if shared:
        out[shared] = -torch.rand(len(shared), vocab, dtype=torch.float64, device=device).log()
    for j, (n, t) in enumerate(zip(noise, positions)):
        if n is not None:
            out[j] = n.exponentials(t, vocab, device)
    return out
