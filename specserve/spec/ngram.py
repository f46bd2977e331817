"""N-gram (prompt lookup) proposer: no weights, no forward pass.

For each request, take the last n committed tokens (n from prompt_lookup_max down to
prompt_lookup_min), find the most recent strictly earlier occurrence of that n-gram in the
context, and propose the (up to) k tokens that followed it. The tokens after a match may run
into the suffix itself; that is fine, they are committed tokens.

Scanning the context for the suffix every step would cost O(context * n) Python work per step.
Instead each request keeps an `NgramIndex`: for every n, a dict from n-gram to the start of its
most recent occurrence, extended by the tokens committed since the last step.

Tree mode (num_branches > 1): the index also links every occurrence to the previous one of the
same n-gram, and the proposer drafts the distinct continuations of several earlier occurrences
(longest n first, most recent first) as the branches of one token tree. The first branch is
the chain mode's draft, so the tree only adds alternatives to it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specserve.errors import InvalidParameterError
from specserve.drafts import DraftProposal, DraftTreeProposal, SpecRequest
from specserve.spec.proposer import Proposer
from specserve.spec.registry import MethodSpec
from specserve.drafts.tree import DraftTree

# Longer n-grams almost never recur verbatim, and each n costs one dict entry per context token.
MAX_PROMPT_LOOKUP = 64
MAX_BRANCHES = 16
# Occurrences of one n-gram looked at per step in tree mode (most recent first): repetitive
# text has many occurrences with the same continuation, and each costs a list slice.
MAX_SCAN = 8


class NgramIndex:
    """Most recent start of every n-gram (min_n <= n <= max_n) of one token sequence.

    The index covers the n-grams that end before the sequence's last token, i.e. exactly the
    occurrences strictly earlier than any suffix and followed by at least one token.
    """

    __slots__ = ("min_n", "max_n", "tokens", "tables", "previous", "num_indexed", "num_rebuilds")

    def __init__(self, min_n: int, max_n: int, link_occurrences: bool = False):
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []  # the sequence indexed so far, to see what changed
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
        # link_occurrences: previous[n][s] = start of the previous occurrence of the n-gram
        # starting at s, -1 for the first (tree mode walks these links).
        self.previous: dict[int, list[int]] | None = {n: [] for n in self.tables} if link_occurrences else None
        # Work counters: positions indexed (each costs one dict update per n) and full rebuilds.
        self.num_indexed = 0
        self.num_rebuilds = 0

    def sync(self, token_ids: Sequence[int]) -> None:
        """Bring the index up to `token_ids`: appended tokens are indexed incrementally; a
        sequence that got shorter or changed (a preempted request recomputed, a rollback) is
        indexed again from scratch."""
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        old = len(self.tokens)
        # One C-level comparison of the indexed prefix (O(context), no per-token Python work)
        # keeps the index exact even when the sequence changed before its last tokens.
        if len(tokens) < old or tokens[:old] != self.tokens:
            self.tokens = []
            self.tables = {n: {} for n in self.tables}
            if self.previous is not None:
                self.previous = {n: [] for n in self.tables}
            self.num_rebuilds += 1
            old = 0
        self.tokens.extend(tokens[old:])
        # An n-gram is keyed by its end (exclusive); ends up to len - 1 qualify, and those up
        # to old - 1 are indexed already.
        previous = self.previous
        for end in range(max(old, 1), len(self.tokens)):
            for n, table in self.tables.items():
                if end >= n:
                    key = tuple(self.tokens[end - n : end])
                    if previous is not None:  # starts arrive in order 0, 1, ... for each n
                        previous[n].append(table.get(key, -1))
                    table[key] = end - n
            self.num_indexed += 1

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens following the most recent earlier occurrence of the longest matching
        suffix of the synced sequence; [] when no suffix of length >= min_n recurs."""
        tokens = self.tokens
        for n in range(self.max_n, self.min_n - 1, -1):
            if n >= len(tokens):
                continue
            start = self.tables[n].get(tuple(tokens[len(tokens) - n :]))
            if start is not None:
                return tokens[start + n : start + n + k]
        return []


    def lookup_branches(self, k: int, branches: int) -> list[list[int]]:
        """Up to `branches` continuations (each up to k tokens) of earlier occurrences of the
        matching suffixes: longest n first, then most recent first, at most MAX_SCAN occurrences
        per n; a continuation that is a prefix of one already taken adds nothing and is skipped.
        The first is `lookup(k)`. Needs link_occurrences."""
        tokens, out = self.tokens, []
        for n in range(self.max_n, self.min_n - 1, -1):
            if n >= len(tokens):
                continue
            start = self.tables[n].get(tuple(tokens[len(tokens) - n :]), -1)
            for _ in range(MAX_SCAN):
                if start < 0:
                    break
                cont = tokens[start + n : start + n + k]
                if not any(c[: len(cont)] == cont for c in out):
                    out.append(cont)
                    if len(out) == branches:
                        return out
                start = self.previous[n][start]
        return out


def check_num_branches(num_branches: int) -> None:
    if isinstance(num_branches, bool) or not isinstance(num_branches, int) or not 1 <= num_branches <= MAX_BRANCHES:
        raise InvalidParameterError("num_branches", num_branches, f"must be an integer in [1, {MAX_BRANCHES}]")


def check_lookup_params(prompt_lookup_min: int, prompt_lookup_max: int) -> None:
    """The one check of the n-gram lengths, shared by the proposer and SpeculativeConfig."""
    for param, value in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max)):
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_PROMPT_LOOKUP:
            raise InvalidParameterError(param, value, f"must be an integer in [1, {MAX_PROMPT_LOOKUP}]")
    if prompt_lookup_max < prompt_lookup_min:
        raise InvalidParameterError(
            "prompt_lookup_max", prompt_lookup_max,
            f"must be in [prompt_lookup_min={prompt_lookup_min}, {MAX_PROMPT_LOOKUP}]",
        )


class NgramProposer(Proposer):
    """Prompt lookup decoding: drafts are copies of what followed the same n-gram earlier;
    with num_branches > 1, several such copies as one token tree."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4, num_branches: int = 1):
        check_lookup_params(prompt_lookup_min, prompt_lookup_max)
        check_num_branches(num_branches)
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.num_branches = num_branches
        self.indexes: dict[str, NgramIndex] = {}

    def _new_index(self) -> NgramIndex:
        return NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max, link_occurrences=self.num_branches > 1)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        # Index the prompt now, off the first decode step; a reused id starts afresh.
        index = self._new_index()
        index.sync(prompt_token_ids)
        self.indexes[request_id] = index

    def remove_request(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)

    def num_draft_nodes(self, num_speculative_tokens: int) -> int:
        return num_speculative_tokens * self.num_branches

    def propose(self, batch: list[SpecRequest]) -> DraftProposal | DraftTreeProposal:
        branches = []  # per request: its continuations, best first
        for r in batch:
            if r.num_speculative_tokens <= 0:
                branches.append([])
                continue
            index = self.indexes.get(r.request_id)
            if index is None:  # never add_request'ed: index lazily, once
                index = self.indexes[r.request_id] = self._new_index()
            index.sync(r.token_ids)
            if self.num_branches == 1:
                draft = index.lookup(r.num_speculative_tokens)
                branches.append([draft] if draft else [])
            else:
                branches.append(index.lookup_branches(r.num_speculative_tokens, self.num_branches))
        if all(len(b) <= 1 for b in branches):  # chains only: the chain path, which costs less
            k_max = max((r.num_speculative_tokens for r in batch), default=0)
            # Host tensors: the engine moves them next to the target's logits.
            return DraftProposal.from_lists([b[0] if b else [] for b in branches], k_max, "cpu")
        return DraftTreeProposal([DraftTree.from_token_paths(b, r.max_nodes) for b, r in zip(branches, batch)])


@dataclass(frozen=True, slots=True)
class NgramOptions:
    """speculative_config's n-gram keys (vLLM's names). num_branches: continuations of several
    earlier occurrences drafted as the branches of one token tree, verified in one pass (1: a
    single chain); num_speculative_tokens is then its depth."""

    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    num_branches: int = 1

    def __post_init__(self) -> None:
        check_lookup_params(self.prompt_lookup_min, self.prompt_lookup_max)
        check_num_branches(self.num_branches)


def _build(options: NgramOptions, model: str | None, target: object, engine: object) -> NgramProposer:
    return NgramProposer(prompt_lookup_min=options.prompt_lookup_min, prompt_lookup_max=options.prompt_lookup_max,
                         num_branches=options.num_branches)


METHOD = MethodSpec("ngram", NgramOptions, _build, auto_max_k=8)
