"""Token-tree verification: a pure function from draft trees and the target's logits at every
flattened node to the tokens a step emits, keeping the output distribution exactly the
target's processed distribution p (SpecInfer, Miao et al. 2023; EAGLE, Li et al. 2024).

Per row, starting at the root and moving down one accepted node at a time:
- greedy: follow a child whose token is the target's argmax at the current node; where several
  children carry it, the one leading to the longest accepted path (the first such in node
  order). Then emit the target's argmax at the last accepted node.
- sampling, children c1..cm of the current node tried in node order against a residual r,
  which starts as p at the node:
    * deterministic candidates (tree.draft_probs None; q one-hot at the candidate): accept ci
      with probability r(ci); on rejection r(ci) = 0, renormalised;
    * candidates drawn i.i.d. from q: accept ci with probability min(1, r(ci) / q(ci)); on
      rejection r = normalise(max(0, r - q)).
  An accepted child becomes the current node (r starts again from p there). When no child is
  accepted, emit a sample of r ("recovered"); at a leaf, a sample of p ("bonus").
Both rules are the chain verifier's rule applied to one sibling after another (one-hot q makes
max(0, r - q) exactly "r with ci removed"), so a chain tree gives exactly `verify`'s output.

Randomness per sampled row, from its generator, in this order whatever is accepted: one uniform
per node (node i's acceptance test reads uniform i), then one exponential race over the
vocabulary: the same numbers, in the same order, as `verify` draws for a chain of N drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.sampler import draw_noise, race
from specserve.sample.typical import TypicalAcceptance, verify_sampled_typical
from specserve.drafts.tree import DraftTree


@dataclass(frozen=True, slots=True)
class TreeVerifyOutput:
    # [B, D+1] int64 (D: the deepest tree): the accepted path's tokens, then the recovered or
    # bonus token, then -1.
    output_token_ids: torch.Tensor
    num_accepted: torch.Tensor  # [B] int64: nodes on the accepted path, 0..depth
    accepted_nodes: list[list[int]]  # per row, the accepted path's node indices, root's child first


def tree_verify(trees: list[DraftTree], target_logits: torch.Tensor, st: SamplingTensors,
                generators: list[torch.Generator | None], typical: TypicalAcceptance | None = None) -> TreeVerifyOutput:
    """trees: one per row; target_logits [B, 1 + N_max, V] raw logits at the flattened nodes
    ([root, node 0, ...], N_max = the largest node count), rows padded past their own trees.
    typical: sampled rows use that LOSSY rule instead (sample/typical.py); greedy rows never do."""
    rows, width, vocab = target_logits.shape
    sizes = [t.num_nodes for t in trees]
    if len(trees) != rows or width != 1 + max(sizes, default=0):
        raise ValueError(f"target_logits {tuple(target_logits.shape)} must be [{len(trees)}, 1 + {max(sizes, default=0)}, V] "
                         "for these trees")
    if len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} rows")
    device = target_logits.device
    argmax = target_logits.argmax(-1).tolist()  # [B][1 + N_max]
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
        verify_sampled_typical(trees, target_logits, st, generators, sampled, paths, emitted, typical)
    elif sampled:
        _verify_sampled(trees, target_logits, st, generators, sampled, paths, emitted)

    depth = max((t.max_depth for t in trees), default=0)
    out = torch.full((rows, depth + 1), -1, dtype=torch.long)
    for b, path in enumerate(paths):
        out[b, : len(path) + 1] = torch.tensor([trees[b].token_ids[i] for i in path] + [emitted[b]])
    return TreeVerifyOutput(out.to(device), torch.tensor([len(p) for p in paths], device=device), paths)


def verify_flat(trees: list[DraftTree], logits: torch.Tensor, logit_start: list[int], st: SamplingTensors,
                generators: list[torch.Generator | None], typical: TypicalAcceptance | None = None) -> TreeVerifyOutput:
    """`tree_verify` for logits of a flattened pass: logits [M, V] raw, row b's root at row
    logit_start[b] and its node i at logit_start[b] + 1 + i (a chain is a one-path tree, a
    plain step or a prompt's last token an empty one). Nothing is padded for greedy rows;
    sampled rows are verified by `tree_verify` on a padded copy of theirs alone (their
    random numbers come from their own generators, so the result is theirs whatever else is
    in the batch)."""
    rows = len(trees)
    if len(logit_start) != rows + 1 or any(logit_start[b + 1] - logit_start[b] != 1 + t.num_nodes
                                           for b, t in enumerate(trees)):
        raise ValueError(f"logit_start {logit_start} must give each tree 1 + its nodes rows "
                         f"({[1 + t.num_nodes for t in trees]})")
    if len(generators) != rows:
        raise ValueError(f"{len(generators)} generators for {rows} rows")
    paths: list[list[int]] = [[] for _ in range(rows)]
    emitted = [0] * rows
    greedy = [b for b in range(rows) if st.greedy_rows[b]]
    if greedy:
        argmax = logits.argmax(-1).tolist()  # [M]
        for b in greedy:
            tree, off = trees[b], logit_start[b]
            paths[b] = tree.longest_path(lambda c, parent, tree=tree, off=off: tree.token_ids[c] == argmax[off + parent])
            emitted[b] = argmax[off + (paths[b][-1] + 1 if paths[b] else 0)]
    sampled = [b for b in range(rows) if not st.greedy_rows[b]]
    if sampled:
        width = 1 + max(trees[b].num_nodes for b in sampled)
        # Past a tree's own nodes a row repeats its root's logits (never read).
        index = torch.tensor([[logit_start[b] + (j if j <= trees[b].num_nodes else 0) for j in range(width)]
                              for b in sampled], device=logits.device)  # [S, width] rows of `logits`
        sub = tree_verify([trees[b] for b in sampled], logits[index], st.select(sampled),
                          [generators[b] for b in sampled], typical)
        for j, b in enumerate(sampled):
            paths[b] = sub.accepted_nodes[j]
            emitted[b] = int(sub.output_token_ids[j, len(paths[b])])
    depth = max((t.max_depth for t in trees), default=0)
    out = [[trees[b].token_ids[i] for i in p] + [emitted[b]] + [-1] * (depth - len(p)) for b, p in enumerate(paths)]
    return TreeVerifyOutput(torch.tensor(out, dtype=torch.long), torch.tensor([len(p) for p in paths]), paths)


def _verify_sampled(trees: list[DraftTree], target_logits: torch.Tensor, st: SamplingTensors,
                    generators: list[torch.Generator | None], sampled: list[int],
                    paths: list[list[int]], emitted: list[int]) -> None:
    """The sampling rows: fills paths[b] and emitted[b] for b in `sampled`."""
    rows, width, vocab = target_logits.shape
    device = target_logits.device
    sizes = [t.num_nodes for t in trees]
    p = processed_probs(target_logits, st)  # [B, 1 + N_max, V]
    # Each node's first test needs only p and q at its own token: gathered for all nodes at
    # once. The residual (a vocabulary-wide tensor) is built only after a rejection.
    tokens = torch.zeros(rows, width - 1, dtype=torch.long)
    parent_flat = torch.zeros(rows, width - 1, dtype=torch.long)
    for b, t in enumerate(trees):
        tokens[b, : t.num_nodes] = torch.tensor(t.token_ids, dtype=torch.long)
        parent_flat[b, : t.num_nodes] = torch.tensor(t.parents, dtype=torch.long) + 1
    tokens, parent_flat = tokens.to(device), parent_flat.to(device)
    p_x = p[torch.arange(rows, device=device)[:, None], parent_flat, tokens].tolist()  # [B][N_max]
    uniforms, expo = draw_noise(generators, st.greedy_rows, sizes, max(sizes, default=0), vocab, device)
    uniforms = uniforms.tolist()
    weights = []
    for b in sampled:
        tree, u = trees[b], uniforms[b]
        q = None if tree.draft_probs is None else tree.draft_probs.to(device)
        q_x = [1.0] * tree.num_nodes if q is None else q.gather(-1, tokens[b, : tree.num_nodes, None]).squeeze(-1).tolist()
        kids = tree.children()
        flat = 0
        while True:
            # The residual is kept unnormalised, r = mass * residual, so that a chain races over
            # exactly `verify`'s weights; r is None while it is still p (mass 1, as `verify` takes it).
            r, mass, nxt = None, 1.0, None
            for c in kids[flat]:
                x = tree.token_ids[c]
                if r is None:
                    ok = u[c] * q_x[c] < p_x[b][c]  # P(u * q < p) = min(1, p / q)
                else:
                    ok = u[c] * q_x[c] * mass < float(r[x])
                if ok:
                    nxt = c
                    break
                if q is None:
                    cut = (p[b, flat] if r is None else r).clone()
                    cut[x] = 0.0
                elif r is None:
                    cut = (p[b, flat] - q[c]).clamp(min=0)
                else:  # r is the residual times its mass: max(0, r / mass - q), times the mass
                    cut = (r - q[c] * mass).clamp(min=0)
                total = float(cut.sum())
                # Mathematically nonzero after any rejection; rounding (r == q) can zero it,
                # and then the distribution so far stays (as in `verify`).
                if total > 0:
                    r, mass = cut, total
            if nxt is None:
                break
            paths[b].append(nxt)
            flat = nxt + 1
        weights.append(p[b, flat] if r is None else r)
    picks = race(torch.stack(weights), expo[sampled]).tolist()  # [S]
    for b, tok in zip(sampled, picks):
        emitted[b] = tok
