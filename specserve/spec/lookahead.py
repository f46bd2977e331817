"""Lookahead decoding (Fu et al., "Break the Sequential Dependency of LLM Inference Using
Lookahead Decoding", ICML 2024): no weights and no draft pass; the target's own verification
pass also runs a Jacobi iteration whose trajectories feed a pool of n-grams.

Per request (`LookaheadState`):
- a window of W columns of N - 1 levels (`LookaheadWindow`): column i is one Jacobi trajectory,
  its level j a guess for the token at depth i + 1 + j after the last committed token (the root);
- a pool of n-grams keyed by their first token (`NgramPool`): at most G per key, least
  recently used out.

One step drafts one tree rooted at the last committed token (`draft_tree`):
- the verification branch: up to G n-grams of the pool keyed by the root's token, each drafting
  its N - 1 following tokens as a chain from the root;
- the lookahead branch: level 0 as the chain root -> g0[0] -> ... -> g0[W-1], and under each
  g0[i] its column's levels 1..N-2. Node (level j, column i) sits at depth i + 1 + j and sees the
  context, g0[0..i] and its column's earlier levels: the paper's 2D-window attention mask,
  expressed as tree ancestry.
Both are one trie: shared prefixes merge, which is sound because two nodes with the same path
have the same context, hence the same prediction. Every node is a draft the verifier may
accept (lookahead nodes included), and verification of any tree is exact, greedy or sampled.

The engine hands back the target's argmax at the root and every node (`needs_node_predictions`).
The Jacobi step, per column drafted whole: its prediction at its deepest node is its new top
level, the n-gram (g0[i], g1[i], ..., g_{N-2}[i], new) enters the pool, and its levels move down
by one. Then the window slides by what was committed (`LookaheadWindow.advance`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from specserve.drafts import DraftTree, DraftTreeProposal, SpecRequest, VerifyFeedback
from specserve.errors import InvalidParameterError
from specserve.spec.proposer import Proposer
from specserve.spec.registry import MethodSpec

MAX_WINDOW = 16
MAX_NGRAM = 8
MAX_CANDIDATES = 16
# Defaults chosen by measurement on the 2-core CPU, where a pass of n tokens costs ~4.25 ms at
# 1, 4.5 at 5, 6.2 at 9 and 10 at 16 (embedded SmolLM2-135M Q4_1, native kernels): only a small
# tree pays. Spec-Bench, one prompt per category, 64 tokens, greedy, fixed depth: W=1 N=3 G=2
# (6 nodes, depth 2) accepted 1.345 tokens per pass at 3.8 nodes per pass; W=2 (8 nodes, depth 3)
# 1.380 at 5.7; W=3 (10 nodes, depth 4) 1.415 at 7.7; W=3 N=4 G=3 1.441 at 12.0. Each column
# more buys ~0.03 tokens per pass for N - 1 more nodes, which costs more than it brings here.
# A window of one column still runs the Jacobi iteration: without it (the candidates alone)
# 1.262 per pass; with it but without the context's n-grams in the pool (the paper's pool) 1.215.
DEFAULT_WINDOW = 1
DEFAULT_NGRAM = 3
DEFAULT_CANDIDATES = 2


def check_lookahead_params(window: int, ngram: int, candidates: int) -> None:
    """The one check of W, N and G, shared by the proposer and SpeculativeConfig."""
    for param, value, lo, hi in (("lookahead_window", window, 1, MAX_WINDOW), ("lookahead_ngram", ngram, 2, MAX_NGRAM),
                                 ("lookahead_candidates", candidates, 0, MAX_CANDIDATES)):
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise InvalidParameterError(param, value, f"must be an integer in [{lo}, {hi}]")


class NgramPool:
    """N-grams keyed by their first token: per key, the continuations (N - 1 tokens) most
    recently added, at most `per_key` (a dict keeps insertion order: its first is the least
    recently used)."""

    __slots__ = ("per_key", "table")

    def __init__(self, per_key: int):
        self.per_key = per_key
        self.table: dict[int, dict[tuple[int, ...], None]] = {}

    def add(self, ngram: Sequence[int]) -> None:
        """Add (or refresh, as the most recent) one n-gram."""
        entries = self.table.setdefault(ngram[0], {})
        rest = tuple(ngram[1:])
        entries.pop(rest, None)
        entries[rest] = None
        if len(entries) > self.per_key:
            del entries[next(iter(entries))]

    def candidates(self, token: int, n: int) -> list[tuple[int, ...]]:
        """Up to n continuations of `token`, most recent first."""
        entries = self.table.get(token)
        return list(reversed(entries))[:n] if entries else []


class LookaheadWindow:
    """W Jacobi trajectories: columns[i][j] is level j of column i (module note)."""

    __slots__ = ("columns", "levels", "rng")

    def __init__(self, width: int, levels: int, context: Sequence[int], rng: random.Random):
        self.levels = levels
        self.rng = rng
        self.columns = [self.fresh(context) for _ in range(width)]

    def fresh(self, context: Sequence[int]) -> list[int]:
        """A new column: tokens drawn from the context, as the paper and llama.cpp start theirs.
        Any start converges under Jacobi iteration; tokens of the text are a likelier start than
        arbitrary vocabulary and cost nothing."""
        return [self.rng.choice(context) if context else 0 for _ in range(self.levels)]

    def paths(self) -> list[list[int]]:
        """Column i's path from the root: g0[0..i], then its levels 1..N-2."""
        top = [c[0] for c in self.columns]
        return [top[: i + 1] + c[1:] for i, c in enumerate(self.columns)]

    def advance(self, updated: dict[int, list[int]], committed: int, context: Sequence[int]) -> None:
        """Move on after a step that committed `committed` tokens; `updated` holds the new
        levels of the columns that made a Jacobi step (the others keep theirs).

        The window keeps its guesses at the positions they guess: a Jacobi step moves a
        column's levels one down (one position nearer the root), so with one token committed
        the columns stay where they are (the paper's and llama.cpp's shift); each further
        committed token slides the columns one more to the left, dropping those that guessed
        committed positions and starting fresh ones on the right. The paper and llama.cpp shift
        one level whatever was accepted; sliding by what was committed instead keeps a window
        that converged useful: after its chain was accepted in part, the rest of it is
        proposed again at the right depth, not a few positions off."""
        width = len(self.columns)
        out: list[list[int] | None] = [None] * width
        for i, column in enumerate(self.columns):
            shift = committed - 1 if i in updated else committed
            j = i - shift
            if 0 <= j < width and out[j] is None:
                out[j] = updated.get(i, column)
        self.columns = [c if c is not None else self.fresh(context) for c in out]


class _Trie:
    """A DraftTree built path by path, shared prefixes merged, at most `max_nodes` nodes."""

    __slots__ = ("tokens", "parents", "child", "max_nodes")

    def __init__(self, max_nodes: int):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.child: dict[tuple[int, int], int] = {}  # (parent node, token) -> node
        self.max_nodes = max_nodes

    def new_nodes(self, path: Sequence[int]) -> int:
        """Nodes adding `path` would create."""
        node = -1
        for k, tok in enumerate(path):
            node = self.child.get((node, tok), -2)
            if node == -2:
                return len(path) - k
        return 0

    def add(self, path: Sequence[int]) -> list[int]:
        """The nodes of `path`'s longest prefix that fits, created where missing."""
        nodes, node = [], -1
        for tok in path:
            nxt = self.child.get((node, tok))
            if nxt is None:
                if len(self.tokens) >= self.max_nodes:
                    break
                nxt = self.child[(node, tok)] = len(self.tokens)
                self.tokens.append(tok)
                self.parents.append(node)
            nodes.append(nxt)
            node = nxt
        return nodes


def draft_tree(candidates: Sequence[Sequence[int]], window: LookaheadWindow, depth: int,
               max_nodes: int) -> tuple[DraftTree, list[list[int]]]:
    """One request's tree within `depth` and `max_nodes`, and per column drafted whole (columns
    0.. in order) the node of each of its levels.

    Priority: the verification candidates first (cut to the depth, and the last one where the
    nodes run out), then whole lookahead columns from column 0 while the next fits in depth and
    nodes. A step too small for any whole column drafts level 0's chain as far as it fits: those
    guesses may still be accepted, though no column makes a Jacobi step."""
    trie = _Trie(max_nodes)
    for cand in candidates:
        trie.add(cand[:depth])
    layout: list[list[int]] = []
    for i, path in enumerate(window.paths()):
        if len(path) > depth or trie.new_nodes(path) > max_nodes - len(trie.tokens):
            break
        layout.append(trie.add(path)[i:])
    if not layout:
        trie.add([c[0] for c in window.columns][:depth])
    return DraftTree(trie.tokens, trie.parents), layout


@dataclass(slots=True)
class LookaheadState:
    """One request's window, pool, and what its last proposal drafted."""

    window: LookaheadWindow
    pool: NgramPool
    ngram: int
    tokens: list[int] = field(default_factory=list)  # the committed tokens seen so far
    num_indexed: int = 0  # n-grams of `tokens` (by start) in the pool
    layout: list[list[int]] | None = None  # the last proposal's whole columns (draft_tree)
    num_nodes: int = 0  # the last proposal's node count

    def sync(self, token_ids: Sequence[int]) -> None:
        """Bring `tokens` up to the committed tokens, adding the context's new n-grams to the
        pool (the prompt's at the start, then the output's as it is committed)."""
        tokens = token_ids if isinstance(token_ids, list) else list(token_ids)
        old = len(self.tokens)
        if len(tokens) < old or tokens[:old] != self.tokens:  # changed (not expected): start over
            self.tokens, self.num_indexed, old = [], 0, 0
        self.tokens.extend(tokens[old:])
        for s in range(self.num_indexed, len(self.tokens) - self.ngram + 1):
            self.pool.add(self.tokens[s : s + self.ngram])
        self.num_indexed = max(self.num_indexed, len(self.tokens) - self.ngram + 1)

    def observe(self, predictions: list[int] | None, committed: int) -> None:
        """The Jacobi step of every column drafted whole, then the slide (module note).
        predictions: [1 + nodes] the target's argmax at the root and each node."""
        updated: dict[int, list[int]] = {}
        if self.layout and predictions is not None and len(predictions) == 1 + self.num_nodes:
            for i, nodes in enumerate(self.layout):
                column = self.window.columns[i]
                new = predictions[1 + nodes[-1]]
                self.pool.add([*column, new])
                updated[i] = column[1:] + [new]
        self.window.advance(updated, committed, self.tokens)
        self.layout = None


class LookaheadProposer(Proposer):
    """Lookahead decoding: a Jacobi window and an n-gram pool per request (module note)."""

    name = "lookahead"
    needs_node_predictions = True

    def __init__(self, window: int = DEFAULT_WINDOW, ngram: int = DEFAULT_NGRAM, candidates: int = DEFAULT_CANDIDATES):
        check_lookahead_params(window, ngram, candidates)
        self.window, self.ngram, self.candidates = window, ngram, candidates
        self.states: dict[str, LookaheadState] = {}

    def _new_state(self, prompt_token_ids: Sequence[int]) -> LookaheadState:
        # A generator per request, seeded alike: a request's drafts depend on its own text
        # only, not on the batch it runs in.
        window = LookaheadWindow(self.window, self.ngram - 1, prompt_token_ids, random.Random(0))
        state = LookaheadState(window, NgramPool(max(1, self.candidates)), self.ngram)
        state.sync(prompt_token_ids)
        return state

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        self.states[request_id] = self._new_state(prompt_token_ids)

    def remove_request(self, request_id: str) -> None:
        self.states.pop(request_id, None)

    def num_draft_nodes(self, num_speculative_tokens: int) -> int:
        """The whole tree at depth k: G candidates of min(N - 1, k) nodes, and the columns that
        fit in depth k whole (N - 1 nodes each), or level 0's chain when none does."""
        k, levels = num_speculative_tokens, self.ngram - 1
        columns = max(0, min(self.window, k - levels + 1))
        lookahead = columns * levels if columns else min(self.window, k)
        return max(k, self.candidates * min(levels, k) + lookahead)

    def propose(self, batch: list[SpecRequest]) -> DraftTreeProposal:
        trees = []
        for r in batch:
            state = self.states.get(r.request_id)
            if state is None:  # never add_request'ed: start from what it has committed
                state = self.states[r.request_id] = self._new_state(r.token_ids)
            state.sync(r.token_ids)
            if r.num_speculative_tokens <= 0 or not state.tokens:
                state.layout, state.num_nodes = None, 0
                trees.append(DraftTree.empty())
                continue
            cands = state.pool.candidates(state.tokens[-1], self.candidates)
            tree, state.layout = draft_tree(cands, state.window, r.num_speculative_tokens, r.max_nodes)
            state.num_nodes = tree.num_nodes
            trees.append(tree)
        return DraftTreeProposal(trees)

    def observe(self, feedback: VerifyFeedback) -> None:
        preds = feedback.node_predictions
        for i, rid in enumerate(feedback.request_ids):
            state = self.states.get(rid)
            if state is not None:
                state.observe(preds[i] if preds is not None else None, len(feedback.committed_token_ids[i]))


@dataclass(frozen=True, slots=True)
class LookaheadOptions:
    """speculative_config's lookahead keys: the window's columns W, the n-gram size N (the
    window has N - 1 levels) and the verification candidates G per step; None: the defaults."""

    lookahead_window: int | None = None
    lookahead_ngram: int | None = None
    lookahead_candidates: int | None = None

    def __post_init__(self) -> None:
        check_lookahead_params(*self.lookahead_params)

    @property
    def lookahead_params(self) -> tuple[int, int, int]:
        """(W, N, G), each as given or its default."""
        return (DEFAULT_WINDOW if self.lookahead_window is None else self.lookahead_window,
                DEFAULT_NGRAM if self.lookahead_ngram is None else self.lookahead_ngram,
                DEFAULT_CANDIDATES if self.lookahead_candidates is None else self.lookahead_candidates)


def _build(options: LookaheadOptions, model: str | None, target: object, engine: object) -> LookaheadProposer:
    return LookaheadProposer(*options.lookahead_params)


def _auto_max_k(options: LookaheadOptions) -> int:
    window, ngram, _ = options.lookahead_params
    return window + ngram - 2  # the whole tree's depth: deeper, nothing is drafted


METHOD = MethodSpec("lookahead", LookaheadOptions, _build, auto_max_k=_auto_max_k)
