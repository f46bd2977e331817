"""Counter-based noise: the random numbers for the token at sequence position t of a request are
a function of (request seed, t) alone.

So they do not depend on how many drafts were verified, on which proposer drafted them, on
what else shares the batch, or on how often a step was computed (a retried step, a preempted
and recomputed request): the same seed gives the same text with and without speculation.
Each draw reseeds a fresh torch.Generator with a splitmix64 hash of (seed, t) and draws the
vocabulary's exponentials E_i = -log(u_i), u_i uniform in [0, 1), in float64 (see
sampler.race for why float64).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One splitmix64 output for state x (Steele et al. 2014): a bijection of 64-bit words whose
    outputs for consecutive x look independent."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


@dataclass(frozen=True, slots=True)
class PositionNoise:
    """The noise of one request: `seed` in [0, 2**63) (SamplingParams.seed, or one the engine
    drew for an unseeded request)."""

    seed: int

    def generator_seed(self, position: int) -> int:
        """A 64-bit seed for the draws at `position`, inside manual_seed's range [0, 2**64)."""
        return _splitmix64(_splitmix64(self.seed) ^ position)

    def exponentials(self, position: int, vocab: int, device: torch.device | str) -> torch.Tensor:
        """[vocab] float64 i.i.d. Exp(1) for the token at sequence `position`. u in [0, 1)
        gives E in (0, inf]: E = inf scores 0 in a race, and no E is 0, so no p / 0."""
        g = torch.Generator(device=device)
        g.manual_seed(self.generator_seed(position))
        return -torch.rand(vocab, dtype=torch.float64, device=device, generator=g).log()


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
