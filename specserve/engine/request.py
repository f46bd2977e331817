"""The state of one request as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specserve.drafts import DraftTree
from specserve.outputs import PLAIN, RequestMetrics, SpecStats, TextPiece, TokenLogprob
from specserve.sample.noise import PositionNoise
from specserve.sample.processors import LogitsProcessor
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import IncrementalDetokenizer


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: requests are compared by identity (the scheduler's list lookups), never field by field.
@dataclass(slots=True, eq=False)
class Request:
    """Tokens are `prompt_token_ids + output_token_ids`; the KV cache holds the first
    `num_computed_tokens` of them. Rolling back rejected drafts only lowers that count: drafts
    never enter `output_token_ids` until verified."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    # The noise every sampled token of this request is drawn with: a function of (seed, sequence
    # position) only, so draws repeat whatever is drafted, retried or recomputed.
    noise: PositionNoise
    detokenizer: IncrementalDetokenizer
    eos_token_ids: frozenset[int]
    num_speculative_tokens: int = 0  # 0: plain decoding for this request; a tree proposer's depth
    # The most nodes a draft tree of full depth may have: the proposer's node budget
    # (Proposer.num_draft_nodes); 0 for chains, which have num_speculative_tokens.
    num_draft_nodes: int = 0
    # True: each step drafts the depth the engine's planner chooses, 0..num_speculative_tokens.
    adaptive: bool = False
    # The drafts its next decode step verifies, proposed at the end of the step that committed
    # its last token (vLLM v1's shape): the scheduler gives that step exactly 1 + its nodes, so
    # no slot is held for drafts that do not exist. None: the next step decodes plainly.
    draft: DraftTree | None = None
    # The depth the proposer was asked for when it drafted `draft` under a confidence floor
    # (SpecRequest.min_path_prob), which may leave the tree shallower or empty: the planner
    # learns what asking for that depth yielded, empty trees included. 0: learn from the
    # tree's own depth.
    draft_depth: int = 0
    # Rules applied to its target logits at every scored position (sample/processors.py):
    # logit_bias, penalties, grammars; empty for most requests.
    processors: list[LogitsProcessor] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None  # what failed, when finish_reason is "error"
    text: str = ""
    num_text_sent: int = 0  # characters of `text` already handed out for streaming
    # Per output token: how it came (outputs.TOKEN_SOURCES) and where its text ends in `text`
    # (a token's text is text[text_ends[i-1]:text_ends[i]]; a stop string may cut `text` short).
    token_sources: list[str] = field(default_factory=list)
    text_ends: list[int] = field(default_factory=list)
    num_pieces_sent: int = 0  # tokens whose text was handed out whole
    spec: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per output token, when asked for
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.perf_counter()))

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def max_depth(self, max_model_len: int) -> int:
        """Drafts worth verifying on one path now: never past what the request may still emit
        or past the context (the last emitted token needs no draft, so at most remaining - 1)."""
        room = min(self.params.max_tokens - len(self.output_token_ids), max_model_len - self.num_tokens) - 1
        return max(0, min(self.num_speculative_tokens, room))

    def max_draft_nodes(self, max_model_len: int) -> int:
        """The most nodes a draft may have now: max_depth for a chain; a tree adds its other
        branches' nodes, within the context (every slot of the pass stays below max_model_len)."""
        depth = self.max_depth(max_model_len)
        if depth == 0:
            return 0
        branches = max(0, self.num_draft_nodes - self.num_speculative_tokens)
        return depth + min(branches, max_model_len - self.num_tokens - depth)

    @property
    def num_pending_drafts(self) -> int:
        """Nodes of the draft its next decode step verifies (0: none)."""
        return self.draft.num_nodes if self.draft is not None else 0

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def failed(self) -> bool:
        return self.finish_reason == "error"

    def append_token(self, token: int, max_model_len: int, source: str = PLAIN) -> bool:
        """Commit one verified token (`source`: how it came, one of outputs.TOKEN_SOURCES) and
        apply the stop rules; returns True when it finished the request (later tokens of the
        same step are then dropped, as plain decoding would never have produced them)."""
        try:
            return self._append(token, max_model_len)
        finally:
            self.token_sources.append(source)
            self.text_ends.append(len(self.text))

    def _append(self, token: int, max_model_len: int) -> bool:
        self.output_token_ids.append(token)
        self.metrics.num_generated_tokens += 1
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.perf_counter()
        new_text = self.detokenizer.step([token])
        if token in self.params.stop_token_ids:
            # The stop token's own text is not part of the output (as with EOS, whose text
            # skip_special_tokens drops anyway).
            self._finish("stop", token)
        elif token in self.eos_token_ids and not self.params.ignore_eos:
            self._finish("stop", None)
        else:
            self.text += new_text
            if self._hit_stop_string(len(new_text)):
                return True
            if len(self.output_token_ids) >= self.params.max_tokens or self.num_tokens >= max_model_len:
                self.text += self.detokenizer.flush()
                self._finish("length", None)
        return self.finished

    def _hit_stop_string(self, num_new_chars: int) -> bool:
        """Truncate the text before the first stop string (after it, with
        include_stop_str_in_output), searching only where a new match can start (a stop string
        may straddle earlier text and the new piece)."""
        if not self.params.stop or not num_new_chars:
            return False
        longest = max(len(s) for s in self.params.stop)
        start = max(0, len(self.text) - num_new_chars - longest + 1)
        hits = [(i, s) for s in self.params.stop if (i := self.text.find(s, start)) != -1]
        if not hits:
            return False
        cut, s = min(hits)
        self.text = self.text[:cut + len(s)] if self.params.include_stop_str_in_output else self.text[:cut]
        self.status, self.finish_reason, self.stop_reason = Status.FINISHED, "stop", s
        return True

    def _finish(self, reason: str, stop_reason: int | str | None) -> None:
        self.status, self.finish_reason, self.stop_reason = Status.FINISHED, reason, stop_reason

    def abort(self) -> None:
        self.status, self.finish_reason = Status.FINISHED, "abort"

    def fail(self, error: str) -> None:
        """End the request because serving it raised: its tokens so far stay its output."""
        self.status, self.finish_reason, self.stop_reason, self.error = Status.FINISHED, "error", None, error

    def take_new_text(self) -> tuple[str, list[TextPiece]]:
        """Text not handed out yet, and the same text token by token with each token's source.
        While stop strings are active, the last len(longest) - 1 characters are held back: they
        could still turn out to begin a stop string."""
        limit = len(self.text)
        if self.params.stop and not self.finished:
            limit -= max(len(s) for s in self.params.stop) - 1
        start = self.num_text_sent
        if limit <= start:
            return "", []
        pieces = []
        i = self.num_pieces_sent
        while i < len(self.text_ends):
            lo = max(start, self.text_ends[i - 1] if i else 0)
            hi = min(limit, self.text_ends[i])
            if hi > lo:
                pieces.append(TextPiece(self.text[lo:hi], self.token_sources[i]))
            if self.text_ends[i] > limit:
                break  # this token's text goes on past the limit: the rest of it comes later
            i += 1
        self.num_pieces_sent = i
        self.num_text_sent = limit
        return self.text[start:limit], pieces
