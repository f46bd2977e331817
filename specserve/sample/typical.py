"""Typical acceptance (Medusa, Cai et al. 2024): a LOSSY, opt-in alternative to the lossless
tree rule, for sampled requests only.

A sampled row accepts a draft node whose token x is "typical" of the target at its parent:
    p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p)))
where p is the target's processed distribution at the parent (temperature, top-k, top-p, min-p
applied, as plain sampling uses it) and H its entropy. The longest path of such nodes is kept,
then one token is sampled from p at the path's last node. The emitted text is no longer
distributed exactly as the target's: tokens the target finds plausible are taken without the
rejection test, so the output leans towards the drafter's choices (more so at high temperature,
where p is flat and exp(-H) small). The sampled token at the path's end uses the request's noise
at its sequence position, as plain sampling would there. Greedy rows are untouched: they follow the target's argmax
exactly as `tree_verify` does, so greedy output stays identical to plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.noise import PositionNoise
from specserve.sample.sampler import race_rows
from specserve.drafts.tree import DraftTree


@dataclass(frozen=True, slots=True)
class TypicalAcceptance:
    """The rule's two knobs, with Medusa's defaults: a node is accepted when its target
    probability exceeds min(posterior_threshold, posterior_alpha * exp(-entropy)). Values are
    checked where users give them (SpeculativeConfig)."""

    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3


def verify_sampled_typical(trees: list[DraftTree], target_logits: torch.Tensor, st: SamplingTensors,
                           noise: Sequence[PositionNoise | None], positions: Sequence[int], sampled: list[int],
                           paths: list[list[int]], emitted: list[int], rule: TypicalAcceptance) -> None:
    """`tree_verify`'s sampled rows under the typical rule (target_logits [B, 1 + N_max, V] at
    [root, nodes...]; noise and positions as there): fills paths[b] and emitted[b] for b in
    `sampled`."""
    device = target_logits.device
    p = processed_probs(target_logits[sampled], st.select(sampled))  # [S, 1 + N_max, V]
    entropy = torch.special.entr(p).sum(-1)  # [S, 1 + N_max]
    bar = torch.clamp(rule.posterior_alpha * torch.exp(-entropy), max=rule.posterior_threshold).tolist()
    for j, b in enumerate(sampled):
        tree = trees[b]
        if tree.num_nodes:
            parents = torch.tensor(tree.parents, device=device) + 1  # flat index of each node's parent
            p_x = p[j, parents, torch.tensor(tree.token_ids, device=device)].tolist()  # [N]
            paths[b] = tree.longest_path(lambda c, parent, j=j, p_x=p_x: p_x[c] > bar[j][parent])
    last = torch.tensor([paths[b][-1] + 1 if paths[b] else 0 for b in sampled], device=device)
    picks = race_rows(p[torch.arange(len(sampled), device=device), last], [False] * len(sampled),
                      [noise[b] for b in sampled], [positions[b] + len(paths[b]) for b in sampled]).tolist()  # [S]
    for b, tok in zip(sampled, picks):
        emitted[b] = tok
