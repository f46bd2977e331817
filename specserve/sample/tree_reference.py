"""Per-row, per-node reference of `tree_verify`, written to be checked by eye against its rule
(tree_verifier.py): at each node the target's own race at that depth's position; follow the
first child carrying it, else emit it. Test oracle only: slow by design. With the same noise the
two must agree token for token.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.sample.logits import SamplingTensors, processed_probs
from specserve.sample.noise import PositionNoise
from specserve.drafts.tree import DraftTree


def reference_tree_verify(trees: list[DraftTree], target_logits: torch.Tensor, st: SamplingTensors,
                          noise: Sequence[PositionNoise], positions: Sequence[int]) -> list[list[int]]:
    """Same inputs as `tree_verify` (on CPU, every row with noise); returns each row's emitted
    tokens (path + one more)."""
    vocab = target_logits.shape[-1]
    out = []
    for b, tree in enumerate(trees):
        kids = tree.children()
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
        emitted, flat, depth = [], 0, 0
        while True:
            # Exponential race: argmax(p / E), E ~ Exp(1), is an exact draw from p.
            e = noise[b].exponentials(positions[b] + depth, vocab, "cpu")
            y = int((p[flat].double() / e).argmax())
            emitted.append(y)
            nxt = next((c for c in kids[flat] if tree.token_ids[c] == y), None)
            if nxt is None:
                break
            flat, depth = nxt + 1, depth + 1
        out.append(emitted)
    return out
