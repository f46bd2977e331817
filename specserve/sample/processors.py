"""Per-request logits processors: rules that change a request's target logits as a function of
the tokens before each position (logit_bias, penalties, grammars).

A speculative step scores the root (the last committed token) and every draft node in one pass.
A processor rewrites each of those rows exactly as plain decoding would have at that position
had the draft path leading to it been committed, so the verifier compares drafts against the
same processed distribution plain decoding samples from, position by position (lossless: a
node is only reached when every token on its path was accepted, that is, committed).

Contract with the engine:
- `prune(tree, committed)` after proposing: drop nodes no accepted path can reach (a grammar cuts
  a draft at the first token it rejects); it must not change state.
- `apply(logits, committed, paths)` in execute: logits [1 + N, V] float, the request's rows
  (root first, then node n at row 1 + n), changed in place; `committed` the request's tokens so
  far (prompt + output); `paths[j]` the draft tokens between the root and row j (paths[0] = []).
  It must leave the processor's state as it found it: a failed step is computed again.
- `commit(tokens)` in update: the tokens just appended to the output, in order. State moves here
  only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.drafts.tree import DraftTree


class LogitsProcessor:
    """Base: a processor that changes nothing. Subclasses override `apply` and, when they keep
    state or can reject tokens outright, `commit` and `prune`."""

    def apply(self, logits: torch.Tensor, committed: Sequence[int], paths: Sequence[Sequence[int]]) -> None:
        raise NotImplementedError

    def prune(self, tree: DraftTree, committed: Sequence[int]) -> DraftTree:
        return tree

    def commit(self, tokens: Sequence[int]) -> None:
        return None


def node_paths(tree: DraftTree) -> list[list[int]]:
    """[1 + N] the draft tokens between the root and each flattened row: [] for the root, then
    for node n the tokens of its ancestors and itself, root's child first."""
    out: list[list[int]] = [[]]
    for tok, parent in zip(tree.token_ids, tree.parents):
        out.append(out[parent + 1] + [tok])
    return out


def keep_nodes(tree: DraftTree, keep: Sequence[bool]) -> DraftTree:
    """The tree without the nodes where keep[n] is False and without their descendants, node
    order kept (so a kept chain stays a chain)."""
    index: dict[int, int] = {-1: -1}
    tokens: list[int] = []
    parents: list[int] = []
    for n, (tok, parent) in enumerate(zip(tree.token_ids, tree.parents)):
        if keep[n] and parent in index:
            index[n] = len(tokens)
            tokens.append(tok)
            parents.append(index[parent])
    return DraftTree(tokens, parents)


class LogitBias(LogitsProcessor):
    """OpenAI's `logit_bias`: a constant added to chosen tokens' logits at every position
    (-100 bans a token in practice, +100 all but forces it). Stateless."""

    def __init__(self, bias: dict[int, float], vocab_size: int) -> None:
        self.ids = torch.tensor(sorted(bias), dtype=torch.long)
        self.values = torch.tensor([float(bias[t]) for t in sorted(bias)], dtype=torch.float32)
        if self.ids.numel() and int(self.ids.max()) >= vocab_size:
            raise ValueError(f"logit_bias names token {int(self.ids.max())}, past the vocabulary ({vocab_size})")

    def apply(self, logits: torch.Tensor, committed: Sequence[int], paths: Sequence[Sequence[int]]) -> None:
        if self.ids.device != logits.device:
            self.ids, self.values = self.ids.to(logits.device), self.values.to(logits.device)
        logits[:, self.ids] += self.values.to(logits.dtype)


def apply_processors(processors: Sequence[LogitsProcessor], logits: torch.Tensor, committed: Sequence[int],
                     tree: DraftTree) -> None:
    """Every processor of one request, in order, on its rows [1 + N, V] (in place)."""
    if not processors:
        return
    if logits.shape[0] != 1 + tree.num_nodes:
        raise ValueError(f"{logits.shape[0]} logits rows for a tree of {tree.num_nodes} nodes (expected 1 + nodes)")
    paths = node_paths(tree)
    with torch.inference_mode():  # the pass's logits are inference tensors
        for p in processors:
            p.apply(logits, committed, paths)


def build_processors(logit_bias: dict[int, float] | None, vocab_size: int) -> list[LogitsProcessor]:
    """The processors a request's sampling parameters ask for, in the order they apply."""
    out: list[LogitsProcessor] = []
    if logit_bias:
        out.append(LogitBias(logit_bias, vocab_size))
    return out
