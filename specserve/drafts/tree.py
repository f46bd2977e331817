"""Token trees: several draft continuations verified in one target pass (SpecInfer, Medusa, EAGLE).

A tree hangs off the request's last committed token, the root, which is not a node. Nodes are
numbered 0..N-1 in topological order (a parent before its children); `parents[i] = -1` makes
node i a child of the root. Siblings are alternatives for the same next token, so a path from
the root is one draft chain, and verification accepts at most one path.

For the target pass the tree is flattened as [root, node 0, ..., node N-1]: flat index 0 is the
root and flat index i + 1 is node i. Node i then sits at position start + depth(i) (RoPE), its
key and value go to the request's slot start + 1 + i, and it attends to the committed context,
the root and its own ancestors only (`attention_mask`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class DraftTree:
    """The draft tree of one request (see the module note for the numbering)."""

    token_ids: list[int]  # [N] the token of each node, topological order
    parents: list[int]  # [N] parent node of each node, -1 for children of the root; parents[i] < i

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.parents) != n:
            raise ValueError(f"a tree with {n} token_ids needs {n} parents, got {len(self.parents)}")
        bad = [i for i, p in enumerate(self.parents) if not -1 <= p < i]
        if bad:
            raise ValueError(f"parents must come before their children (-1 <= parents[i] < i); nodes {bad[:5]} break it")

    @classmethod
    def empty(cls) -> DraftTree:
        """No drafts: the step only computes the root (a plain decode step)."""
        return cls([], [])

    @property
    def is_chain(self) -> bool:
        """A single path (the empty tree included): causal attention is its tree mask."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @classmethod
    def chain(cls, token_ids: Sequence[int]) -> DraftTree:
        """A single path: node i is the child of node i - 1."""
        return cls(list(token_ids), list(range(-1, len(token_ids) - 1)))

    @classmethod
    def from_token_paths(cls, paths: Sequence[Sequence[int]], max_nodes: int | None = None) -> DraftTree:
        """A trie of token sequences, shared prefixes merged: children keep the order in which
        the paths first reach them (earlier paths are preferred by greedy ties and tried first
        when sampling). Stops adding nodes at `max_nodes`."""
        tokens: list[int] = []
        parents: list[int] = []
        child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        for path in paths:
            node = -1
            for tok in path:
                nxt = child.get((node, tok))
                if nxt is None:
                    if max_nodes is not None and len(tokens) >= max_nodes:
                        break
                    nxt = child[(node, tok)] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = nxt
        return cls(tokens, parents)

    @classmethod
    def from_choices(cls, choices: Sequence[Sequence[int]], candidates: Sequence[Sequence[int]]) -> DraftTree:
        """A static tree in Medusa's notation: each choice is a path of ranks, (r1, ..., rd)
        being the node whose token is candidates[d - 1][rd] under the node (r1, ..., r_{d-1}).
        candidates[d] lists the ranked tokens for depth d + 1 (e.g. a head's top-k). Choices
        whose rank has no candidate are left out with their subtrees; every proper prefix of a
        choice must itself be a choice."""
        known = {tuple(c) for c in choices}
        for c in known:
            if not c:
                raise ValueError("an empty choice would be the root, which is not a node")
            if len(c) > 1 and c[:-1] not in known:
                raise ValueError(f"choice {list(c)} needs its parent {list(c[:-1])} among the choices")
        node_of: dict[tuple[int, ...], int] = {}
        tokens: list[int] = []
        parents: list[int] = []
        for c in sorted(known, key=lambda c: (len(c), c)):  # parents first, then by rank
            parent = node_of.get(c[:-1]) if len(c) > 1 else -1
            ranked = candidates[len(c) - 1] if len(c) <= len(candidates) else ()
            if parent is None or c[-1] >= len(ranked):  # its parent was left out, or no such rank
                continue
            node_of[c] = len(tokens)
            tokens.append(int(ranked[c[-1]]))
            parents.append(parent)
        return cls(tokens, parents)

    @property
    def num_nodes(self) -> int:
        return len(self.token_ids)

    def depths(self) -> list[int]:
        """[N] depth of each node: 1 for children of the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    @property
    def max_depth(self) -> int:
        return max(self.depths(), default=0)

    def children(self) -> list[list[int]]:
        """[N + 1] children of each flat index (0: the root, i + 1: node i), in node order."""
        out: list[list[int]] = [[] for _ in range(len(self.parents) + 1)]
        for i, p in enumerate(self.parents):
            out[p + 1].append(i)
        return out

    def longest_path(self, ok: Callable[[int, int], bool]) -> list[int]:
        """The longest path from the root of nodes c with ok(c, flat index of c's parent), the
        first such in node order where several are equally long."""
        kids = self.children()

        def longest(flat: int) -> list[int]:
            best: list[int] = []
            for c in kids[flat]:
                if ok(c, flat):
                    path = [c] + longest(c + 1)
                    if len(path) > len(best):
                        best = path
            return best
        return longest(0)

    def paths(self) -> list[list[int]]:
        """Node indices of every root-to-leaf path, depth first with children in node order."""
        kids = self.children()
        out: list[list[int]] = []

        def walk(flat: int, path: list[int]) -> None:
            if not kids[flat] and path:
                out.append(path)
            for c in kids[flat]:
                walk(c + 1, path + [c])
        walk(0, [])
        return out

    def attention_mask(self) -> torch.Tensor:
        """[N + 1, N + 1] bool over the flattened tree: row j may attend to column m iff m is j
        itself or one of its ancestors (the root is everyone's). Row sums - 1 are the depths."""
        n = len(self.parents)
        mask = torch.zeros(n + 1, n + 1, dtype=torch.bool)
        mask[:, 0] = True
        for i, p in enumerate(self.parents):
            mask[i + 1] = mask[p + 1]  # a parent's row is complete before its child's
            mask[i + 1, i + 1] = True
        return mask
