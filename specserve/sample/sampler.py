"""Drawing tokens from processed distributions, reproducibly per request.

Every random number a request consumes comes from that request's own generator, drawn row by
row, so a seeded request gives the same tokens whatever else shares its batch. Tokens are drawn
with the exponential race: argmax_i(w_i / E_i) with E_i ~ Exp(1) i.i.d. picks token i with
probability w_i / sum(w), an exact sample of the normalised weights w without normalising them
(which lets the verifier sample max(0, p - q) directly). E is made in float64 from float64
uniforms: float32 exponentials have a coarse grid near 0, which over a 50k vocabulary biases the
race measurably towards low token ids.
"""

from __future__ import annotations

import torch

from specserve.sample.logits import SamplingTensors, processed_probs


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded for one request, or None to use the global RNG."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def draw_noise(generators: list[torch.Generator | None], greedy_rows: tuple[bool, ...],
               num_uniform: list[int], width: int, vocab: int,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The random numbers of one sampling or verification step, per row in this order:
    num_uniform[b] uniforms (acceptance tests), then vocab exponentials (the emitted token).

    Returns (uniforms [B, width] float64, zero past num_uniform[b]; exponentials [B, V] float64).
    Greedy rows draw nothing and get uniforms 0 and exponentials 1. Rows without a generator
    share the global RNG and are drawn together, one call each, since they promise no
    reproducibility per request.
    """
    rows = len(generators)
    uniforms = torch.zeros(rows, width, dtype=torch.float64, device=device)
    expo = torch.ones(rows, vocab, dtype=torch.float64, device=device)
    shared = [b for b, g in enumerate(generators) if g is None and not greedy_rows[b]]
    if shared:
        uniforms[shared] = torch.rand(len(shared), width, dtype=torch.float64, device=device)
        expo[shared] = -torch.rand(len(shared), vocab, dtype=torch.float64, device=device).log()
    for b, g in enumerate(generators):
        if g is None or greedy_rows[b]:
            continue
        if num_uniform[b]:
            uniforms[b, : num_uniform[b]] = torch.rand(num_uniform[b], dtype=torch.float64, device=device,
                                                       generator=g)
        # u in [0, 1) gives E in (0, inf]: E = inf scores 0, and no E is 0, so no p / 0.
        expo[b] = -torch.rand(vocab, dtype=torch.float64, device=device, generator=g).log()
    return uniforms, expo


def race(weights: torch.Tensor, expo: torch.Tensor) -> torch.Tensor:
    """weights [B, V] >= 0 (not necessarily normalised), expo [B, V] -> [B] int64 sampled ids."""
    return (weights.double() / expo).argmax(-1)


def sample(logits: torch.Tensor, st: SamplingTensors, generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] -> [B] int64: argmax on greedy rows, a draw from processed_probs elsewhere.

    Consumes exactly the randomness of a verification step with no draft tokens, so plain
    decoding and `verify` with num_draft 0 give the same token for the same generator state.
    """
    if st.all_greedy:
        return logits.argmax(-1)
    probs = processed_probs(logits, st)  # [B, V]; one-hot on greedy rows, which race to their argmax
    rows, vocab = probs.shape
    _, expo = draw_noise(generators, st.greedy_rows, [0] * rows, 0, vocab, logits.device)
    return race(probs, expo)
