"""Per-row, per-node reference of `tree_verify`, written to be checked by eye against the
algorithm (SpecInfer's multi-candidate rejection sampling). Test oracle only: slow by design.

It draws the same random numbers in the same order as `tree_verify` (one uniform per node, then
one exponential race over the vocabulary), so with equal generator states the two must agree.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.drafts.tree import DraftTree


def reference_tree_verify(trees: list[DraftTree], target_logits: torch.Tensor, st: SamplingTensors,
                          generators: list[torch.Generator | None]) -> list[list[int]]:
    """Same inputs as `tree_verify` (on CPU); returns each row's emitted tokens (path + one more)."""
    vocab = target_logits.shape[-1]
    out = []
    for b, tree in enumerate(trees):
        g, kids = generators[b], tree.children()
        if st.greedy_rows[b]:  # each path verified as a chain; the longest accepted prefix, the first of equals
            argmax = target_logits[b].argmax(-1).tolist()
            best: list[int] = []
            for path in tree.paths():
                n = 0
                while n < len(path) and tree.token_ids[path[n]] == argmax[path[n - 1] + 1 if n else 0]:
                    n += 1
                best = path[:n] if n > len(best) else best
            out.append([tree.token_ids[c] for c in best] + [argmax[best[-1] + 1 if best else 0]])
            continue
        p = processed_probs(target_logits[b : b + 1], st.select([b]))[0]  # [1 + N_max, V]
        u = torch.rand(tree.num_nodes, dtype=torch.float64, generator=g)
        emitted, flat = [], 0
        while True:
            r, nxt = p[flat], None  # the residual at the current node
            for c in kids[flat]:
                x = tree.token_ids[c]
                q = F.one_hot(torch.tensor(x), vocab).float() if tree.draft_probs is None else tree.draft_probs[c]
                if float(q[x]) > 0 and float(u[c]) < float(r[x]) / float(q[x]) or float(q[x]) == 0 < float(r[x]):
                    nxt = c
                    break
                cut = (r - q).clamp(min=0)
                if float(cut.sum()) > 0:
                    r = cut / cut.sum()
            if nxt is None:
                break
            emitted.append(tree.token_ids[nxt])
            flat = nxt + 1
        # Exponential race: argmax(w / E), E ~ Exp(1), is an exact draw from w / sum(w).
        e = -torch.rand(vocab, dtype=torch.float64, generator=g).log()
        emitted.append(int((r.double() / e).argmax()))
        out.append(emitted)
    return out
