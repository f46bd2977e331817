"""What the engine hands back: per-request outputs and the speculation figures (vLLM-style names)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


# How a generated token came, in the order a pass emits them: a plain step's token (no drafts
# were verified), a draft the target accepted, the target's own token where it rejected a draft,
# or the bonus token the target adds after a path of drafts it accepted to the end.
PLAIN, DRAFT, CORRECTED, BONUS = "plain", "draft", "corrected", "bonus"
TOKEN_SOURCES = (PLAIN, DRAFT, CORRECTED, BONUS)


@dataclass(slots=True)
class SpecStats:
    """Speculation figures of one request, or summed over many.

    A target pass is one forward of the target that produced tokens for this request after its
    prefill (a plain decode step counts as a pass with zero drafts), so mean accepted length is
    tokens emitted per target pass: 1.0 for plain decoding, up to k + 1 with speculation. A
    request that made no pass after its prefill (max_tokens=1) speculated nothing: 1.0 too.
    """

    num_drafted: int = 0
    num_accepted: int = 0
    num_emitted: int = 0  # tokens produced by decode/verify passes (accepted + recovered/bonus)
    num_target_passes: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    proposer_time_s: float = 0.0
    target_time_s: float = 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_drafted if self.num_drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        return self.num_emitted / self.num_target_passes if self.num_target_passes else 1.0

    @property
    def acceptance_by_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    def record(self, num_draft: int, num_accepted: int, num_emitted: int) -> None:
        """One target pass: `num_draft` tokens drafted, the first `num_accepted` accepted."""
        self.num_target_passes += 1
        self.num_drafted += num_draft
        self.num_accepted += num_accepted
        self.num_emitted += num_emitted
        grow = num_draft - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position.extend([0] * grow)
            self.accepted_per_position.extend([0] * grow)
        for i in range(num_draft):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < num_accepted

    @classmethod
    def total(cls, stats: Iterable["SpecStats"]) -> "SpecStats":
        """The figures summed over many requests."""
        out = cls()
        for st in stats:
            out.merge(st)
        return out

    def merge(self, other: "SpecStats") -> None:
        self.num_drafted += other.num_drafted
        self.num_accepted += other.num_accepted
        self.num_emitted += other.num_emitted
        self.num_target_passes += other.num_target_passes
        self.proposer_time_s += other.proposer_time_s
        self.target_time_s += other.target_time_s
        n = max(len(self.drafted_per_position), len(other.drafted_per_position))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            mine.extend([0] * (n - len(mine)))
            for i, v in enumerate(theirs):
                mine[i] += v

    def as_dict(self) -> dict:
        return {
            "num_drafted": self.num_drafted,
            "num_accepted": self.num_accepted,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "acceptance_by_position": [round(a, 4) for a in self.acceptance_by_position],
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "num_target_passes": self.num_target_passes,
            "proposer_time_s": round(self.proposer_time_s, 4),
            "target_time_s": round(self.target_time_s, 4),
        }


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first, over the time after the first: the decode speed."""
        if self.finished_time is None or self.first_token_time is None or self.num_generated_tokens < 2:
            return 0.0
        span = self.finished_time - self.first_token_time
        return (self.num_generated_tokens - 1) / span if span > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log probability of one generated token under the model's raw distribution, with the
    most likely alternatives at that position (as many as SamplingParams.logprobs asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log probability), most likely first


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # "stop", "length", "abort", "error" (serving this request raised; the engine went on), or
    # None while running
    finish_reason: str | None
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry when asked for
    error: str | None = None  # what failed, when finish_reason is "error"
    token_sources: list[str] = field(default_factory=list)  # one of TOKEN_SOURCES per token_ids entry


@dataclass(frozen=True, slots=True)
class TextPiece:
    """A stretch of streamed text and how the token it belongs to came (one of TOKEN_SOURCES).
    A token's text may arrive in two pieces when a stop-string hold-back cuts it."""

    text: str
    source: str


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    spec: SpecStats
    new_text: str = ""  # text produced since the previous output of this request (for streaming)
    new_pieces: list[TextPiece] = field(default_factory=list)  # new_text, token by token, with sources
