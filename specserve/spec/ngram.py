"""N-gram (prompt lookup) proposer: no weights, no forward pass.

For each request, take the last n committed tokens (n from prompt_lookup_max down to
prompt_lookup_min), find the most recent strictly earlier occurrence of that n-gram in the
context, and propose the (up to) k tokens that followed it. The tokens after a match may run
into the suffix itself; that is fine, they are committed tokens.

Scanning the context for the suffix every step would cost O(context * n) Python work per step.
Instead each request keeps an `NgramIndex`: for every n, a dict from n-gram to the start of its
most recent occurrence, extended by the tokens committed since the last step.
"""

from __future__ import annotations

from collections.abc import Sequence

from specserve.errors import InvalidParameterError
from specserve.spec.proposer import DraftProposal, Proposer, SpecRequest

# Longer n-grams almost never recur verbatim, and each n costs one dict entry per context token.
MAX_PROMPT_LOOKUP = 64


class NgramIndex:
    """Most recent start of every n-gram (min_n <= n <= max_n) of one token sequence.

    The index covers the n-grams that end before the sequence's last token, i.e. exactly the
    occurrences strictly earlier than any suffix and followed by at least one token.
    """

    __slots__ = ("min_n", "max_n", "tokens", "tables", "num_indexed", "num_rebuilds")

    def __init__(self, min_n: int, max_n: int):
        self.min_n = min_n
        self.max_n = max_n
        self.tokens: list[int] = []  # the sequence indexed so far, to see what changed
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(min_n, max_n + 1)}
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
            self.num_rebuilds += 1
            old = 0
        self.tokens.extend(tokens[old:])
        # An n-gram is keyed by its end (exclusive); ends up to len - 1 qualify, and those up
        # to old - 1 are indexed already.
        for end in range(max(old, 1), len(self.tokens)):
            for n, table in self.tables.items():
                if end >= n:
                    table[tuple(self.tokens[end - n : end])] = end - n
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
    """Prompt lookup decoding: drafts are copies of what followed the same n-gram earlier."""

    name = "ngram"

    def __init__(self, prompt_lookup_min: int = 1, prompt_lookup_max: int = 4):
        check_lookup_params(prompt_lookup_min, prompt_lookup_max)
        self.prompt_lookup_min = prompt_lookup_min
        self.prompt_lookup_max = prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        # Index the prompt now, off the first decode step; a reused id starts afresh.
        index = NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max)
        index.sync(prompt_token_ids)
        self.indexes[request_id] = index

    def remove_request(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)

    def propose(self, batch: list[SpecRequest]) -> DraftProposal:
        drafts = []
        for r in batch:
            if r.num_speculative_tokens <= 0:
                drafts.append([])
                continue
            index = self.indexes.get(r.request_id)
            if index is None:  # never add_request'ed: index lazily, once
                index = self.indexes[r.request_id] = NgramIndex(self.prompt_lookup_min, self.prompt_lookup_max)
            index.sync(r.token_ids)
            drafts.append(index.lookup(r.num_speculative_tokens))
        k_max = max((r.num_speculative_tokens for r in batch), default=0)
        # Host tensors: the engine moves them next to the target's logits.
        return DraftProposal.from_lists(drafts, k_max, "cpu")
