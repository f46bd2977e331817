"""Structured output: a grammar's allowed tokens as a logits processor (sample/processors.py).

A request with `structured_outputs` (a JSON schema, a regex, choices, a Lark or GBNF grammar)
gets a GrammarProcessor holding a matcher of its grammar, advanced by every committed token.
Under speculation it does for a draft tree what vLLM's bitmask of k + 1 positions with rollback
does for a chain: the matcher walks the tree depth first (accept the node's token, compute the
mask of its row, visit its children, roll back), so each row gets the mask plain decoding would
use had the node's path been committed. `prune` cuts every node whose token the grammar rejects
after its path, with its subtree: such a node could never be accepted (its token is -inf in its
parent's row), so verifying it would only spend a slot. Output is exactly plain masked decoding's.

End of text (the tokenizer's EOS tokens) is allowed where the grammar is complete; the matcher is
never advanced by it, so its state stays that of the text (a request with ignore_eos goes on
from there). When the text is complete and nothing may follow, EOS is the only token allowed and
the request ends with finish_reason "stop".

The grammar engine is llguidance (PyPI `llguidance`, MIT licence), chosen over xgrammar 0.2.8
(Apache-2.0) on these measurements (2-core CPU, the embedded SmolLM2 tokenizer, 49152 tokens):
- dependencies: llguidance is one 3 MB abi3 wheel (7.6 MB installed) requiring nothing; xgrammar
  requires torch, transformers, triton (on Linux x86-64, a GPU compiler of hundreds of MB) and
  apache-tvm-ffi, and imports in ~0.9 s.
- speed: both are far below a pass (5-50 ms): llguidance builds its tokenizer view in 0.34 s
  (once per engine), compiles a small object schema in 0.5-1.4 ms and computes one mask in
  ~0.03 ms (0.1 ms at worst); xgrammar compiled the same schema in 5 ms and masked in ~0.006 ms.
- it takes the tokenizer's own tokenizer.json text, rolls back consumed tokens, reads JSON
  schemas, regexes, Lark and GBNF grammars, and reports bad ones as errors rather than crashes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import llguidance
import torch

from specserve.drafts.tree import DraftTree
from specserve.errors import InvalidParameterError
from specserve.sample.processors import LogitsProcessor, keep_nodes, node_paths
from specserve.sampling_params import StructuredOutputsParams, short_repr
from specserve.tokenizer import Tokenizer

# Compiled grammars an engine keeps (least recently used dropped first): a server sees the same
# few schemas again and again; each entry is a matcher's compiled lexer and parser (kilobytes to
# a few megabytes for large schemas).
GRAMMAR_CACHE_SIZE = 64
_SHIFTS = torch.arange(32, dtype=torch.int32)  # bit b of mask word w allows token 32 * w + b


class GrammarCompiler:
    """One per engine: the tokenizer's view for the grammar engine, built on the first
    structured request (0.34 s for 49152 tokens), and an LRU cache of compiled grammars keyed
    by spec. Thread-safe: a server compiles while checking a request on its event loop, and the
    engine thread builds processors from the same cache."""

    def __init__(self, tokenizer: Tokenizer | llguidance.LLTokenizer, vocab_size: int,
                 cache_size: int = GRAMMAR_CACHE_SIZE):
        """tokenizer: the model's, or its llguidance view built already; vocab_size: the token
        ids the model and the tokenizer both know (LLMEngine.vocab_size); rows of wider logits
        are masked past it."""
        self._source = tokenizer
        self.vocab_size = vocab_size
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = tokenizer if isinstance(tokenizer, llguidance.LLTokenizer) else None
        self._tokenizer_error: str | None = None
        self._cache: OrderedDict[tuple, llguidance.LLMatcher] = OrderedDict()

    def processor(self, spec: StructuredOutputsParams) -> GrammarProcessor:
        """A fresh processor of the spec's grammar (compiled once per distinct spec)."""
        template = self.compile(spec)
        ll = self._tokenizer(spec)
        return GrammarProcessor(template.deep_copy(), min(self.vocab_size, ll.vocab_size), ll.vocab_size,
                                frozenset(ll.eos_tokens))

    def compile(self, spec: StructuredOutputsParams) -> llguidance.LLMatcher:
        """The spec's compiled grammar, as a matcher at the start of the output that is never
        advanced (processors copy it). Raises InvalidParameterError naming the field when the
        spec does not compile (a bad schema, regex or grammar)."""
        spec.validate()
        key = _cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        ll = self._tokenizer(spec)
        field = f"structured_outputs.{spec.kind}"
        try:
            matcher = llguidance.LLMatcher(ll, _grammar_text(spec), log_level=0)
        except (ValueError, TypeError) as e:  # e.g. a schema that is not a JSON object
            raise InvalidParameterError(field, short_repr(getattr(spec, spec.kind)), f"does not compile: {_first_line(e)}") from e
        if matcher.is_error():
            raise InvalidParameterError(field, short_repr(getattr(spec, spec.kind)),
                                        f"does not compile: {_first_line(matcher.get_error())}")
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _tokenizer(self, spec: StructuredOutputsParams) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None and self._tokenizer_error is None:
                try:
                    tok = self._source
                    eos = sorted(tok.eos_token_ids) or None
                    self._ll_tokenizer = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=tok.vocab_size, eos_token=eos)
                except Exception as e:  # the engine reads byte-level BPE and SentencePiece-style tokenizers
                    self._tokenizer_error = _first_line(e)
            if self._ll_tokenizer is None:
                raise InvalidParameterError("structured_outputs", spec.kind,
                                            f"is not available for this model: its tokenizer cannot drive the grammar "
                                            f"engine ({self._tokenizer_error})")
            return self._ll_tokenizer


class GrammarProcessor(LogitsProcessor):
    """A request's grammar state (sample/processors.py's contract). `prune` and `apply` walk the
    draft tree from the committed state and roll back all they consumed; `commit` advances."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, tokenizer_vocab_size: int,
                 eos_token_ids: frozenset[int]):
        self.matcher = matcher
        self.vocab_size = vocab_size  # tokens the model may emit: columns past it are masked
        self.words = (tokenizer_vocab_size + 31) // 32  # int32 words of one mask
        self.eos_token_ids = eos_token_ids

    def prune(self, tree: DraftTree, committed: Sequence[int]) -> DraftTree:
        if not tree.num_nodes:
            return tree
        reached = self._walk(node_paths(tree), lambda row: None)
        return tree if all(reached[1:]) else keep_nodes(tree, reached[1:])

    def apply(self, logits: torch.Tensor, committed: Sequence[int], paths: Sequence[Sequence[int]]) -> None:
        rows = logits.shape[0]
        # [rows, words] int32; rows the walk does not reach keep every bit set: their paths hold
        # a token the grammar rejects, so no accepted path gets there (the verifier never reads them).
        bits = torch.full((rows, self.words), -1, dtype=torch.int32)
        reached = self._walk(paths, lambda row: self.matcher.unsafe_compute_mask_ptr(bits[row].data_ptr(), self.words * 4))
        n = min(self.vocab_size, logits.shape[1])
        allowed = ((bits.unsqueeze(-1) >> _SHIFTS) & 1).view(rows, -1)[:, :n].bool()  # [rows, n]
        empty = [j for j in range(rows) if reached[j] and not bool(allowed[j].any())]
        if empty:
            raise RuntimeError(f"the grammar allows no token the model can produce after draft path {list(paths[empty[0]])} "
                               f"(the model knows {n} token ids)")
        logits[:, :n].masked_fill_(~allowed.to(logits.device), float("-inf"))
        logits[:, n:] = float("-inf")

    def commit(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            if tok in self.eos_token_ids:
                continue  # end of text: the grammar's state stays the text's
            if not self.matcher.consume_token(tok):
                raise RuntimeError(f"token {tok} was committed but the grammar rejects it: {_first_line(self.matcher.get_error())}")

    def _allows(self, tok: int) -> bool:
        """Whether the grammar allows `tok` next (the matcher unchanged)."""
        if not 0 <= tok < self.vocab_size:
            return False
        if tok in self.eos_token_ids:  # read off the mask: a complete matcher validates no token, EOS included
            return bool(self.matcher.compute_bitmask()[tok // 8] >> (tok % 8) & 1)
        return self.matcher.validate_tokens([tok]) == 1

    def _walk(self, paths: Sequence[Sequence[int]], visit: Callable[[int], None]) -> list[bool]:
        """Depth first over the rows (paths[0] = [] the root, then each draft path, a parent's
        before its children's): visit(row) with the matcher advanced along the row's path, for
        every row whose tokens the grammar accepts in turn. Returns which rows were reached;
        the matcher ends where it began, even when `visit` raises."""
        if self.matcher.is_error():
            raise RuntimeError(f"the grammar matcher failed: {_first_line(self.matcher.get_error())}")
        # Rows by path: a tree may hold the same path twice (equal siblings), each row masked.
        rows: dict[tuple[int, ...], list[int]] = {}
        for j, p in enumerate(paths):
            rows.setdefault(tuple(p), []).append(j)
        children: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for path in rows:
            if path:
                children.setdefault(path[:-1], []).append(path)
        reached = [False] * len(paths)

        def go(path: tuple[int, ...]) -> None:
            for j in rows[path]:
                reached[j] = True
                visit(j)
            for child in children.get(path, ()):
                tok = child[-1]
                if not self._allows(tok):
                    continue
                advanced = tok not in self.eos_token_ids
                if advanced and not self.matcher.consume_token(tok):
                    raise RuntimeError(f"the grammar matcher failed on token {tok}: {_first_line(self.matcher.get_error())}")
                try:
                    go(child)
                finally:
                    if advanced:
                        self.matcher.rollback(1)

        go(())
        return reached


def _cache_key(spec: StructuredOutputsParams) -> tuple:
    value = getattr(spec, spec.kind)
    if spec.kind == "json" and isinstance(value, dict):
        # Key order kept: a schema's property order is the order the output writes them in.
        value = json.dumps(value, separators=(",", ":"))
    elif spec.kind == "choice":
        value = tuple(value)
    return spec.kind, value


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """The spec as llguidance's grammar description (ValueError when it cannot be read)."""
    kind, value = spec.kind, getattr(spec, spec.kind)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"the schema is not valid JSON ({e})") from e
        if not isinstance(value, dict):
            raise ValueError(f"a JSON schema is a JSON object, not {type(value).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(value)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(value)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(list(value)))
    return llguidance.grammar_from("grammar", value)  # Lark as it is; GBNF converted to Lark


def _first_line(error: object) -> str:
    """An engine error's message without the grammar dump that may follow it."""
    text = str(error).strip()
    return text.splitlines()[0][:300] if text else "unknown error"

