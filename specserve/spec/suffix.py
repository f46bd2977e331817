"""Suffix decoding: drafts from suffix trees over the request's own text and earlier outputs.

No weights and no forward pass, like n-gram lookup, but with counts: every request keeps a
suffix tree over its prompt and output, and the proposer keeps one global suffix tree over the
outputs of earlier requests (bounded by `cache_tokens`, least recently used out). Each step the
longest suffix of the request's context found in a tree (at most `max_depth` tokens) selects a
node; its subtree holds every continuation that followed that suffix, each with how often it
did. The draft is a token tree grown best first by estimated probability (along its path, each
continuation's count over all its siblings'), at most `spec_factor` x the match length deep: a
long match has predicted well and earns a long draft, a one-token match a short one. The
per-request and global trees each propose; the draft with the larger expected accepted length
is taken.

Trees are tries of every suffix cut to `max_depth` tokens ("depth-limited suffix trees"): a
sequence of n tokens adds at most n * max_depth nodes, and appending a token walks max_depth
of them, so keeping a request's tree current costs O(max_depth) per committed token.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from specserve.drafts import DraftTreeProposal, SpecRequest, VerifyFeedback
from specserve.drafts.tree import DraftTree
from specserve.errors import InvalidParameterError
from specserve.spec.proposer import Proposer
from specserve.spec.registry import MethodSpec

MAX_TREE_DEPTH = 64
# A tree of depth D holds up to D nodes per token of text (~280 bytes each in Python: ~4.5 KiB
# per token at 16 where the text does not repeat, far less where it does); drafts go on past
# the depth (draft_tree), so a deeper tree only sharpens the match.
DEFAULT_TREE_DEPTH = 16
DEFAULT_CACHE_TOKENS = 1 << 14
MAX_CACHE_TOKENS = 1 << 24
DEFAULT_SPEC_FACTOR = 1.0
DEFAULT_MIN_TOKEN_PROB = 0.1


# Nodes are ints: counts[n] = occurrences of the suffix node n spells (sequence ends included),
# kids[n] = {token: child node} or None (an empty dict too: no continuation). A dict of ints
# only is never tracked by Python's cyclic garbage collector, so the trees (a request's ~16
# nodes per token of text, the global one up to 16 per cached token) add nothing to what a
# full collection walks: with a list and a dict per node they were most of it (measured, 64
# requests in flight with their trees: 0.94 s of full collections in a 12 s run against 0.15
# without them).
ROOT = 0


class SuffixTree:
    """Counts of every substring of at most `max_depth` tokens over a set of sequences.

    `extend(cursor, tokens)` continues one sequence being written; `add` / `remove` take a whole
    sequence in or out. A cursor is the list of nodes spelling the current end's suffixes,
    cursor[d] the one of length d (cursor[0] the root), so appending token t moves each one to
    its child t: the suffixes of the longer sequence.
    """

    __slots__ = ("max_depth", "counts", "kids", "free", "num_nodes")

    def __init__(self, max_depth: int = DEFAULT_TREE_DEPTH):
        self.max_depth = max_depth
        self.counts: list[int] = [0]
        self.kids: list[dict[int, int] | None] = [None]
        self.free: list[int] = []  # removed nodes, reused
        self.num_nodes = 1

    @property
    def root(self) -> int:
        return ROOT

    def count(self, node: int) -> int:
        return self.counts[node]

    def children(self, node: int) -> dict[int, int]:
        """{token: child} (empty when nothing followed)."""
        return self.kids[node] or {}

    def cursor(self) -> list[int]:
        """The cursor of an empty sequence."""
        return [ROOT]

    def extend(self, cursor: list[int], tokens: Sequence[int]) -> list[int]:
        """Count `tokens` after the sequence `cursor` ends, one after the other; the cursor of
        the longer sequence. (This loop is the prompt's indexing cost, so it keeps to locals.)"""
        counts, kids, free, depth, new = self.counts, self.kids, self.free, self.max_depth, 0
        for token in tokens:
            out = [ROOT]
            for node in cursor[:depth]:
                k = kids[node]
                child = None if k is None else k.get(token)
                if child is None:
                    if free:
                        child = free.pop()
                        counts[child] = 1
                    else:
                        child = len(counts)
                        counts.append(1)
                        kids.append(None)
                    if k is None:
                        kids[node] = {token: child}
                    else:
                        k[token] = child
                    new += 1
                else:
                    counts[child] += 1
                out.append(child)
            cursor = out
        self.num_nodes += new
        return cursor

    def add(self, tokens: Sequence[int]) -> None:
        self.extend(self.cursor(), tokens)

    def remove(self, tokens: Sequence[int]) -> None:
        """Undo `add(tokens)`: counts down, and nodes no other sequence reaches are dropped."""
        counts, kids = self.counts, self.kids
        cursor, dropped = [ROOT], []
        for t in tokens:
            out = [ROOT]
            for node in cursor[: self.max_depth]:
                child = kids[node][t]
                counts[child] -= 1
                if counts[child] == 0:
                    # Only this sequence passed here, so every node below is this sequence's
                    # too and the walk counts each of them down to 0 in turn (it visits every
                    # occurrence the sequence added), going on in the detached subtree: its
                    # nodes are freed once the walk is done.
                    del kids[node][t]
                    dropped.append(child)
                out.append(child)
            cursor = out
        for node in dropped:
            kids[node] = None
        self.free.extend(dropped)
        self.num_nodes -= len(dropped)

    def match(self, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The node of the longest suffix of `tokens` (at most max_depth) that some sequence
        continued, and its length; None when not even the last token was ever followed."""
        kids = self.kids
        n = len(tokens)
        for length in range(min(self.max_depth, n), 0, -1):
            node = ROOT
            for t in tokens[n - length:]:
                k = kids[node]
                node = k.get(t) if k else None
                if node is None:
                    break
            if node is not None and kids[node]:
                return node, length
        return None


def draft_tree(tree: SuffixTree, context: Sequence[int], node: int, match_length: int, max_depth: int,
               max_nodes: int, min_prob: float) -> tuple[DraftTree, float]:
    """The most probable continuations of `context`, whose last `match_length` tokens spell
    `node` of `tree`, as a token tree: nodes taken best first by estimated probability (the
    product of count ratios along the path), each at least `min_prob`, at most `max_nodes` of
    them and `max_depth` deep. -> (tree, expected accepted length: the sum of the taken nodes'
    probabilities).

    The tree holds substrings of at most tree.max_depth tokens, so a path that reaches that
    depth continues from the node of its own last tree.max_depth // 2 tokens (context and
    draft): what followed those tokens anywhere, which is what followed the longer match too
    wherever the text repeats."""
    tokens: list[int] = []
    parents: list[int] = []
    score = 0.0
    # (-probability, order, token, suffix-tree node, its depth in the tree, parent draft node,
    # draft depth); `order` keeps ties in the order children were first seen.
    heap: list = []
    order = 0

    counts, all_kids = tree.counts, tree.kids

    def reanchor(draft_node: int) -> tuple[int, int] | None:
        path = []
        while draft_node >= 0:
            path.append(tokens[draft_node])
            draft_node = parents[draft_node]
        keep = tree.max_depth // 2
        tail = (list(context[-keep:]) + path[::-1])[-keep:]
        n = ROOT
        for t in tail:
            k = all_kids[n]
            n = k.get(t) if k else None
            if n is None:
                return None
        return n, len(tail)

    def push(parent_node: int, node_depth: int, parent: int, prob: float, depth: int) -> None:
        nonlocal order
        if depth > max_depth:
            return
        if not all_kids[parent_node] and node_depth >= tree.max_depth:
            found = reanchor(parent)
            if found is None:
                return
            parent_node, node_depth = found
        kids = all_kids[parent_node]
        if not kids:
            return
        # Over the continuations only: an occurrence at the very end of a sequence (the
        # request's own current end, for one) says nothing about what follows.
        total = sum(counts[c] for c in kids.values())
        for tok, child in kids.items():
            p = prob * counts[child] / total
            if p >= min_prob:
                heapq.heappush(heap, (-p, order, tok, child, node_depth + 1, parent, depth))
                order += 1

    push(node, match_length, -1, 1.0, 1)
    while heap and len(tokens) < max_nodes:
        neg_p, _, tok, child, child_depth, parent, depth = heapq.heappop(heap)
        tokens.append(tok)
        parents.append(parent)
        score -= neg_p
        push(child, child_depth, len(tokens) - 1, -neg_p, depth + 1)
    return DraftTree(tokens, parents), score


def check_suffix_params(max_depth: int, cache_tokens: int, spec_factor: float, min_token_prob: float) -> None:
    """The one check of the suffix knobs, shared by the proposer and SpeculativeConfig."""
    if isinstance(max_depth, bool) or not isinstance(max_depth, int) or not 1 <= max_depth <= MAX_TREE_DEPTH:
        raise InvalidParameterError("suffix_tree_depth", max_depth, f"must be an integer in [1, {MAX_TREE_DEPTH}]")
    if isinstance(cache_tokens, bool) or not isinstance(cache_tokens, int) or not 0 <= cache_tokens <= MAX_CACHE_TOKENS:
        raise InvalidParameterError("suffix_cache_tokens", cache_tokens,
                                    f"must be an integer in [0, {MAX_CACHE_TOKENS}] (0: no global tree)")
    if isinstance(spec_factor, bool) or not isinstance(spec_factor, (int, float)) or not 0 < spec_factor <= 64:
        raise InvalidParameterError("suffix_spec_factor", spec_factor, "must be a number in (0, 64]")
    if isinstance(min_token_prob, bool) or not isinstance(min_token_prob, (int, float)) or not 0 <= min_token_prob < 1:
        raise InvalidParameterError("suffix_min_token_prob", min_token_prob, "must be a number in [0, 1)")


class _RequestTree:
    """One request's suffix tree over its prompt and committed output, kept current."""

    __slots__ = ("tree", "tokens", "cursor", "num_prompt")

    def __init__(self, max_depth: int, tokens: Sequence[int], num_prompt: int | None = None):
        self.tree = SuffixTree(max_depth)
        self.tokens: list[int] = []
        self.cursor = self.tree.cursor()
        self.num_prompt = len(tokens) if num_prompt is None else num_prompt
        self.sync(tokens)

    def sync(self, token_ids: Sequence[int]) -> None:
        """Append what was committed since the last call; a sequence that changed before its
        end (a preempted request recomputed) is indexed again from scratch."""
        old = len(self.tokens)
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        if len(tokens) < old or tokens[:old] != self.tokens:
            self.tree = SuffixTree(self.tree.max_depth)
            self.cursor, self.tokens, old = self.tree.cursor(), [], 0
        self.extend(tokens[old:])

    def extend(self, tokens: Sequence[int]) -> None:
        """Tokens committed after the indexed ones."""
        self.cursor = self.tree.extend(self.cursor, tokens)
        self.tokens.extend(tokens)

    def match(self) -> tuple[int, int] | None:
        """SuffixTree.match of the request's own text, read off the cursor: its deepest node
        that earlier text continued."""
        kids = self.tree.kids
        for length in range(len(self.cursor) - 1, 0, -1):
            if kids[self.cursor[length]]:
                return self.cursor[length], length
        return None


class SuffixProposer(Proposer):
    """SuffixDecoding: token trees from a per-request suffix tree and a global one over earlier
    outputs (see the module note)."""

    name = "suffix"

    def __init__(self, max_depth: int = DEFAULT_TREE_DEPTH, cache_tokens: int = DEFAULT_CACHE_TOKENS,
                 spec_factor: float = DEFAULT_SPEC_FACTOR, min_token_prob: float = DEFAULT_MIN_TOKEN_PROB,
                 nodes_per_depth: float = 1.5):
        check_suffix_params(max_depth, cache_tokens, spec_factor, min_token_prob)
        self.max_depth = max_depth
        self.cache_tokens = cache_tokens
        self.spec_factor = spec_factor
        self.min_token_prob = min_token_prob
        self.nodes_per_depth = nodes_per_depth
        self.requests: dict[str, _RequestTree] = {}
        self.global_tree = SuffixTree(max_depth)
        # Sequences in the global tree, least recently used first: a finished request's output,
        # led by the last max_depth tokens of its prompt so that the next request asking the same
        # thing finds the output from its first token on. An identical sequence coming in again
        # is moved to the end instead of being counted twice.
        self.cached: OrderedDict[tuple[int, ...], None] = OrderedDict()
        self.cached_tokens = 0

    def num_draft_nodes(self, num_speculative_tokens: int) -> int:
        # Mostly one path (a repeated continuation has a single child per node), with room for
        # alternatives where earlier text branched.
        return max(num_speculative_tokens, int(num_speculative_tokens * self.nodes_per_depth))

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.requests[request_id] = _RequestTree(self.max_depth, prompt_token_ids)

    def remove_request(self, request_id: str) -> None:
        r = self.requests.pop(request_id, None)
        if r is None or self.cache_tokens == 0 or len(r.tokens) <= r.num_prompt:
            return
        # A preempted request's partial output comes in too, and again in full when it finishes:
        # counts lean towards it a little, which only shapes drafts, never what is committed.
        self._cache(tuple(r.tokens[max(0, r.num_prompt - self.max_depth):]))

    def observe(self, feedback: VerifyFeedback) -> None:
        # The engine asks for drafts only in steps where it drafts, so the tokens committed in
        # the others (and the last step's) come in here: at remove_request the request's tree
        # holds its whole output, which is what goes to the global tree.
        for rid, committed in zip(feedback.request_ids, feedback.committed_token_ids):
            own = self.requests.get(rid)
            if own is not None and committed:
                own.extend(committed)

    def _cache(self, seq: tuple[int, ...]) -> None:
        if seq in self.cached:
            self.cached.move_to_end(seq)
            return
        if len(seq) > self.cache_tokens:
            return
        self.cached[seq] = None
        self.global_tree.add(seq)
        self.cached_tokens += len(seq)
        while self.cached_tokens > self.cache_tokens:
            old, _ = self.cached.popitem(last=False)
            self.global_tree.remove(old)
            self.cached_tokens -= len(old)

    def propose(self, batch: list[SpecRequest]) -> DraftTreeProposal:
        return DraftTreeProposal([self.draft(r)[0] for r in batch])

    def draft(self, r: SpecRequest) -> tuple[DraftTree, float]:
        """One request's draft tree and its expected accepted length (the sum of its nodes'
        estimated probabilities; 0 for an empty tree): the better of the request's own tree's
        and the global tree's."""
        if r.num_speculative_tokens <= 0:
            return DraftTree.empty(), 0.0
        own = self.requests.get(r.request_id)
        if own is None:  # never add_request'ed: index lazily, once
            # (its first drafting step may come after some output: the prompt's length
            # says where the answer that goes to the global tree starts)
            own = self.requests[r.request_id] = _RequestTree(self.max_depth, r.token_ids, r.num_prompt_tokens)
        own.sync(r.token_ids)
        best, best_score = DraftTree.empty(), 0.0
        for tree, found in ((own.tree, own.match()), (self.global_tree, self.global_tree.match(own.tokens))):
            if found is None:
                continue
            node, length = found
            depth = min(r.num_speculative_tokens, max(1, int(self.spec_factor * length)))
            draft, score = draft_tree(tree, own.tokens, node, length, depth, r.max_nodes, self.min_token_prob)
            if score > best_score:
                best, best_score = draft, score
        return best, best_score


@dataclass(frozen=True, slots=True)
class SuffixOptions:
    """speculative_config's suffix keys: the longest suffix matched (and so the depth of its
    trees), the global tree's size in tokens of earlier outputs (0: none), draft depth per
    matched token, and the smallest estimated probability of a drafted node."""

    suffix_tree_depth: int = DEFAULT_TREE_DEPTH
    suffix_cache_tokens: int = DEFAULT_CACHE_TOKENS
    suffix_spec_factor: float = DEFAULT_SPEC_FACTOR
    suffix_min_token_prob: float = DEFAULT_MIN_TOKEN_PROB

    def __post_init__(self) -> None:
        check_suffix_params(self.suffix_tree_depth, self.suffix_cache_tokens, self.suffix_spec_factor,
                            self.suffix_min_token_prob)


def _build(options: SuffixOptions, model: str | None, target: object, engine: object) -> SuffixProposer:
    return SuffixProposer(max_depth=options.suffix_tree_depth, cache_tokens=options.suffix_cache_tokens,
                          spec_factor=options.suffix_spec_factor, min_token_prob=options.suffix_min_token_prob)


# Suffix decoding drafts whole remembered continuations: long drafts pay when it matches well.
METHOD = MethodSpec("suffix", SuffixOptions, _build, auto_max_k=16)
