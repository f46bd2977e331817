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
from specserve.sampling_params import SamplingParams


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


class Penalties(LogitsProcessor):
    """vLLM's repetition, frequency and presence penalties, in that order (after logit_bias):

        seen     = the token occurs in the prompt or the output before this position
        count    = how often it occurs in the output before this position (prompt not counted)
        logit    = logit / repetition if logit > 0 else logit * repetition   (where seen)
        logit   -= frequency * count + presence * (count > 0)

    A draft row's counts are the committed ones plus the draft tokens on its path, so node n is
    penalised exactly as plain decoding would penalise that position had the path been
    committed. State: the output's counts and the seen set, [V] each, started from the prompt
    and moved in `commit`; `apply` only reads them. Only the distinct tokens seen or on a path
    are gathered and rewritten (every other token's penalty is the identity), [1 + N, U]."""

    def __init__(self, prompt_token_ids: Sequence[int], vocab_size: int, repetition: float = 1.0,
                 frequency: float = 0.0, presence: float = 0.0) -> None:
        self.repetition, self.frequency, self.presence = float(repetition), float(frequency), float(presence)
        self.num_tokens = len(prompt_token_ids)  # prompt + committed output: what `apply` must be given
        prompt = torch.tensor(list(prompt_token_ids), dtype=torch.long)
        if prompt.numel() and int(prompt.max()) >= vocab_size:
            raise ValueError(f"prompt token {int(prompt.max())} is past the vocabulary ({vocab_size})")
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)  # [V] output occurrences (exact below 2**24)
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)  # [V] in the prompt or the output
        self.seen[prompt] = True
        self.seen_ids = torch.unique(prompt)  # [S] sorted distinct ids where seen is True

    def _to(self, device: torch.device) -> None:
        if self.counts.device != device:
            self.counts, self.seen, self.seen_ids = self.counts.to(device), self.seen.to(device), self.seen_ids.to(device)

    def apply(self, logits: torch.Tensor, committed: Sequence[int], paths: Sequence[Sequence[int]]) -> None:
        if len(committed) != self.num_tokens:
            raise RuntimeError(f"penalties were given {len(committed)} committed tokens but have counted "
                               f"{self.num_tokens}: a commit was missed or repeated")
        self._to(logits.device)
        rows = logits.shape[0]
        path_rows = torch.tensor([j for j, p in enumerate(paths) for _ in p], dtype=torch.long, device=logits.device)
        path_ids = torch.tensor([t for p in paths for t in p], dtype=torch.long, device=logits.device)
        # ids [U]: the seen tokens and the paths' tokens; at[k] is path token k's column in ids.
        ids, inverse = torch.unique(torch.cat([self.seen_ids, path_ids]), return_inverse=True)
        at = inverse[self.seen_ids.numel():]
        counts = self.counts[ids].expand(rows, -1).clone()  # [1 + N, U]
        counts.index_put_((path_rows, at), torch.ones_like(path_ids, dtype=counts.dtype), accumulate=True)
        sub = logits[:, ids]  # [1 + N, U]
        if self.repetition != 1.0:
            seen = self.seen[ids] | (counts > 0)  # a path token is in the output at its row
            sub = torch.where(seen, torch.where(sub > 0, sub / self.repetition, sub * self.repetition), sub)
        if self.frequency != 0.0 or self.presence != 0.0:
            sub = sub - (self.frequency * counts + self.presence * (counts > 0)).to(sub.dtype)
        logits[:, ids] = sub

    def commit(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        new = torch.tensor(list(tokens), dtype=torch.long, device=self.counts.device)
        self.counts.index_put_((new,), torch.ones_like(new, dtype=self.counts.dtype), accumulate=True)
        self.seen[new] = True
        self.seen_ids = torch.unique(torch.cat([self.seen_ids, new]))
        self.num_tokens += len(tokens)


def build_processors(params: SamplingParams, prompt_token_ids: Sequence[int], vocab_size: int) -> list[LogitsProcessor]:
    """The processors a request's sampling parameters ask for, in the order they apply
    (logit_bias, then the penalties; temperature and filters come later, in sample/logits.py)."""
    out: list[LogitsProcessor] = []
    if params.logit_bias:
        out.append(LogitBias(params.logit_bias, vocab_size))
    if params.repetition_penalty != 1.0 or params.frequency_penalty != 0.0 or params.presence_penalty != 0.0:
        out.append(Penalties(prompt_token_ids, vocab_size, params.repetition_penalty, params.frequency_penalty,
                             params.presence_penalty))
    return out
