"""Token-tree verification: a pure function from draft trees and the target's logits at every
flattened node to the tokens a step emits, which are exactly the tokens plain sampling would
emit with the same noise (verifier.py gives the rule for chains; a tree applies it at each node).

Per row, starting at the root (depth 0) and moving down one accepted node at a time:
- greedy: follow a child whose token is the target's argmax at the current node; where several
  children carry it, the one leading to the longest accepted path (the first such in node
  order). Then emit the target's argmax at the last accepted node.
- sampling: at the current node of depth d the target's token is y = race(p, E_{t0+d}) (p the
  processed distribution at the node, E the request's noise at sequence position t0 + d,
  t0 = positions[b]); follow the first child (in node order) whose token is y; when none is,
  emit y ("recovered"; "bonus" at a leaf).
Every emitted token is the target's own race at its position, so the text is plain sampling's,
whatever the tree (lossless by construction); nodes at one depth share one position's noise.
A deterministic candidate x is accepted with probability p(x), as in SpecInfer's rule for
top-k candidates; sampled candidates are drawn with the same noise (Gumbel-max coupling), so no
draft probabilities are needed. A chain tree gives exactly `verify`'s output. Noise is drawn
lazily, depth by depth, only for positions a row reaches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sample.logits import SamplingTensors, argmax_rows, processed_probs
from specserve.sample.noise import PositionNoise
from specserve.sample.sampler import race_rows, sample
from specserve.sample.typical import TypicalAcceptance, verify_sampled_typical
from specserve.drafts.tree import DraftTree
from specserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class TreeVerifyOutput:
    # [B, D+1] int64 (D: the deepest tree): the accepted path's tokens, then the recovered or
    # bonus token, then -1.
    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor  # [B] int64: nodes on the accepted path, 0..depth
    accepted_nodes: list[list[int]]  # per row, the accepted path's node indices, root's child first


@dataclass(frozen=True, slots=True)
class FlatVerifyOutput:
    """verify_flat's result as the lists the engine reads at once (tensors it would turn back
    into lists would cost it ~60 us a step). Per row: the tokens the step emits (the accepted
    path's tokens, then the recovered or bonus token) and the accepted path's node indices."""

    token_ids: list[list[int]]
    accepted_nodes: list[list[int]]


def tree_verify(trees: list[DraftTree], target_logits: torch.Tensor, st: SamplingTensors,
                noise: Sequence[PositionNoise | None], positions: Sequence[int],
                typical: TypicalAcceptance | None = None) -> TreeVerifyOutput:
    """trees: one per row; target_logits [B, 1 + N_max, V] raw logits at the flattened nodes
    ([root, node 0, ...], N_max = the largest node count), rows padded past their own trees;
    noise[b] row b's noise (None: the global RNG), positions[b] the sequence position of the
    token the root's logits predict. typical: sampled rows use that LOSSY rule instead
    (sample/typical.py); greedy rows never do."""
    rows, width, vocab = target_logits.shape
    sizes = [t.num_nodes for t in trees]
    if len(trees) != rows or width != 1 + max(sizes, default=0):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} must be [{len(trees)}, 1 + {max(sizes, default=0)}, V] "
                         "for these trees")
    if len(noise) != rows or len(positions) != rows:
        raise ValueError(f"{len(noise)} noise sources and {len(positions)} positions for {rows} rows")
    device = target_logits.device
    argmax = argmax_rows(target_logits)  # [B][1 + N_max]
    paths: list[list[int]] = []
    emitted: list[int] = [0] * rows
    sampled = [b for b in range(rows) if not st.greedy_rows[b]]
    for b in range(rows):
        if st.greedy_rows[b]:
            paths.append(trees[b].longest_path(lambda c, parent, b=b: trees[b].token_ids[c] == argmax[b][parent]))
            emitted[b] = argmax[b][paths[b][-1] + 1 if paths[b] else 0]
        else:
            paths.append([])
    if sampled and typical is not None:
        verify_sampled_typical(trees, target_logits, st, noise, positions, sampled, paths, emitted, typical)
    elif sampled:
        _verify_sampled(trees, target_logits, st, noise, positions, sampled, paths, emitted)

    return _output(trees, paths, emitted, device)


def verify_flat(trees: list[DraftTree], logits: torch.Tensor, logit_start: list[int], params: Sequence[SamplingParams],
                noise: Sequence[PositionNoise | None], positions: Sequence[int],
                typical: TypicalAcceptance | None = None) -> FlatVerifyOutput:
    """`tree_verify` for logits of a flattened pass: logits [M, V] raw, row b's root at row
    logit_start[b] and its node i at logit_start[b] + 1 + i (a chain is a one-path tree, a
    plain step or a prompt's last token an empty one). Nothing is padded for greedy rows;
    sampled rows are verified by `tree_verify` on a padded copy of theirs alone (their
    random numbers come from their own noise, so the result is theirs whatever else is in the
    batch). params: each row's sampling parameters (greedy rows need no SamplingTensors, which
    are built for the sampled rows alone); noise and positions as in `tree_verify`. -> the
    same tokens and paths as tree_verify's, as lists (FlatVerifyOutput)."""
    rows = len(trees)
    if len(logit_start) != rows + 1 or any(logit_start[b + 1] - logit_start[b] != 1 + t.num_nodes
                                           for b, t in enumerate(trees)):
        raise ValueError(f"logit_start {logit_start} must give each tree 1 + its nodes rows "
                         f"({[1 + t.num_nodes for t in trees]})")
    if len(noise) != rows or len(positions) != rows or len(params) != rows:
        raise ValueError(f"{len(params)} sampling parameters, {len(noise)} noise sources and {len(positions)} "
                         f"positions for {rows} rows")
    paths: list[list[int]] = [[] for _ in range(rows)]
    emitted = [0] * rows
    greedy = [b for b in range(rows) if params[b].greedy]
    if greedy:
        argmax = argmax_rows(logits)  # [M]
        for b in greedy:
            tree, off = trees[b], logit_start[b]
            paths[b] = tree.longest_path(lambda c, parent, tree=tree, off=off: tree.token_ids[c] == argmax[off + parent])
            emitted[b] = argmax[off + (paths[b][-1] + 1 if paths[b] else 0)]
    sampled = [b for b in range(rows) if not params[b].greedy]
    # Sampled rows without drafts (a plain step, a prompt's last token, a request whose drafts
    # the planner turned off): each emits the race at its root, which is plain sampling's, in
    # one batch without the tree walk's index tensors (~0.15 ms of a ~5.5 ms step alone).
    bare = [b for b in sampled if trees[b].num_nodes == 0] if typical is None else []
    if bare:
        st = SamplingTensors.from_params([params[b] for b in bare], logits.device)
        won = sample(logits[[logit_start[b] for b in bare]], st, [noise[b] for b in bare],
                     [positions[b] for b in bare]).tolist()
        for b, y in zip(bare, won):
            emitted[b] = y
        sampled = [b for b in sampled if trees[b].num_nodes > 0]
    if sampled:
        width = 1 + max(trees[b].num_nodes for b in sampled)
        # Past a tree's own nodes a row repeats its root's logits (never read).
        index = torch.tensor([[logit_start[b] + (j if j <= trees[b].num_nodes else 0) for j in range(width)]
                              for b in sampled], device=logits.device)  # [S, width] rows of `logits`
        st = SamplingTensors.from_params([params[b] for b in sampled], logits.device)
        sub = tree_verify([trees[b] for b in sampled], logits[index], st,
                          [noise[b] for b in sampled], [positions[b] for b in sampled], typical)
        out = sub.output_token_ids.tolist()
        for j, b in enumerate(sampled):
            paths[b] = sub.accepted_nodes[j]
            emitted[b] = out[j][len(paths[b])]
    return FlatVerifyOutput(_emitted_rows(trees, paths, emitted), paths)


def _emitted_rows(trees: list[DraftTree], paths: list[list[int]], emitted: list[int]) -> list[list[int]]:
    """Per row, the tokens a step emits: its accepted path's tokens, then its emitted token."""
    return [[trees[b].token_ids[i] for i in p] + [emitted[b]] for b, p in enumerate(paths)]


def _output(trees: list[DraftTree], paths: list[list[int]], emitted: list[int],
            device: torch.device | None) -> TreeVerifyOutput:
    """The rows' accepted paths and emitted tokens as a TreeVerifyOutput (built as lists, one
    tensor each: a tensor per row costs more than the row's work)."""
    depth = max((t.max_depth for t in trees), default=0)
    out = [row + [-1] * (depth + 1 - len(row)) for row in _emitted_rows(trees, paths, emitted)]
    return TreeVerifyOutput(torch.tensor(out, dtype=torch.long, device=device),
                            torch.tensor([len(p) for p in paths], device=device), paths)


def _verify_sampled(trees: list[DraftTree], target_logits: torch.Tensor, st: SamplingTensors,
                    noise: Sequence[PositionNoise | None], positions: Sequence[int], sampled: list[int],
                    paths: list[list[int]], emitted: list[int]) -> None:
    """The sampling rows: fills paths[b] and emitted[b] for b in `sampled`. One loop over depth,
    each iteration one race and one child lookup for every row still moving down."""
    width = target_logits.shape[1]
    device = target_logits.device
    p = processed_probs(target_logits[sampled], st.select(sampled))  # [S, 1 + N_max, V]
    # [S, N_max] each node's token and its parent's flat index; -1 past a tree's nodes: never matches.
    pads = [[-1] * (width - 1 - trees[b].num_nodes) for b in sampled]
    tokens = torch.tensor([list(trees[b].token_ids) + pad for b, pad in zip(sampled, pads)], dtype=torch.long,
                          device=device)
    parent_flat = torch.tensor([[q + 1 for q in trees[b].parents] + pad for b, pad in zip(sampled, pads)],
                               dtype=torch.long, device=device)
    current = [0] * len(sampled)  # flat index of each row's current node (0: the root)
    alive = list(range(len(sampled)))
    depth = 0
    while alive:
        idx = torch.tensor(alive, device=device)
        flat = torch.tensor([current[j] for j in alive], device=device)  # [A]
        won = race_rows(p[idx, flat], [False] * len(alive), [noise[sampled[j]] for j in alive],
                        [positions[sampled[j]] + depth for j in alive])  # [A]
        # The first child of the current node carrying the winner, if any.
        match = (parent_flat[idx] == flat.unsqueeze(-1)) & (tokens[idx] == won.unsqueeze(-1))  # [A, N_max]
        found = match.any(-1).tolist()
        child = match.long().argmax(-1).tolist() if width > 1 else [0] * len(alive)  # the first True
        won = won.tolist()
        still = []
        for j, ok, c, y in zip(alive, found, child, won):
            if ok:
                paths[sampled[j]].append(c)
                current[j] = c + 1
                still.append(j)
            else:
                emitted[sampled[j]] = y
        alive = still
        depth += 1
