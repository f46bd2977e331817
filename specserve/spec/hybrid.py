"""Suffix decoding beside a learned drafter (EagleOptions.enable_suffix_decoding), as
ArcticInference pairs it with its speculators: each step, each request takes either the suffix
trees' draft or the drafter's, and the drafter runs only for the requests that take its own.

Lookup pays where the text repeats (a translation or a summary copying its source, an answer
repeating itself) and a learned drafter where it does not (on Spec-Bench, 65 prompts: suffix
1.79x on translation where EAGLE-3 gives 0.95x; EAGLE-3 1.15x on writing where suffix gives
1.03x). The choice per request and step:
  - fixed (`threshold` a number): the suffix draft whenever it expects to keep at least that
    many tokens (its own estimate: the sum of its nodes' count-ratio probabilities);
  - learned (`threshold` None, the default): the suffix draft when its estimate, scaled by how
    well suffix estimates have been kept so far (all requests), is at least what the drafter's
    drafts kept for this request lately (shrunk toward all requests' rate). The drafter's
    costlier step is priced as DRAFTER_STEP_TOKENS tokens.
Both are only proposals: the verifier keeps the target's output whatever is drafted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from specserve.drafts import SpecRequest, VerifyFeedback
from specserve.drafts.tree import DraftTree
from specserve.spec.suffix import SuffixProposer

# A request's record of what the drafter's drafts kept fades by this factor a step; all
# requests' by ALL_DECAY. A request's record counts as RECORD_WEIGHT steps against the all-
# requests rate (a request's few steps tell little of a learned drafter: engine/adaptive.py).
REQUEST_DECAY = 0.8
ALL_DECAY = 0.98
RECORD_WEIGHT = 4.0
# Before anything was verified: the drafter expected to keep this many tokens a step, and suffix
# estimates taken at their word (PRIOR_STEPS steps' worth of each).
INITIAL_DRAFTER_TOKENS = 0.5
PRIOR_STEPS = 4.0
# A drafting step of the drafter (~0.5 ms on the 2-core CPU) against suffix's (~0.05 ms), in
# tokens of a ~5.5 ms target pass.
DRAFTER_STEP_TOKENS = 0.1


@dataclass(slots=True)
class _Decayed:
    """A decayed mean: sum / weight."""

    total: float
    weight: float
    decay: float

    def add(self, value: float, weight: float = 1.0) -> None:
        self.total = self.total * self.decay + value
        self.weight = self.weight * self.decay + weight

    @property
    def mean(self) -> float:
        return self.total / self.weight if self.weight > 0 else 0.0


@dataclass(slots=True)
class SuffixFirst:
    """The suffix side of a drafter's proposer: `split` hands each request the suffix draft or
    leaves it to the drafter; `observe` learns from verification what each kept."""

    suffix: SuffixProposer
    threshold: float | None = None  # None: the learned choice (module note)
    # kept / estimated over suffix's drafts, all requests
    _calibration: _Decayed = field(default_factory=lambda: _Decayed(PRIOR_STEPS, PRIOR_STEPS, ALL_DECAY))
    # tokens kept per drafter step, all requests / per request
    _drafter_all: _Decayed = field(
        default_factory=lambda: _Decayed(PRIOR_STEPS * INITIAL_DRAFTER_TOKENS, PRIOR_STEPS, ALL_DECAY))
    _drafter: dict[str, _Decayed] = field(default_factory=dict)
    # request -> the suffix estimate of its last draft (None: the drafter made it)
    _last: dict[str, float | None] = field(default_factory=dict)

    def num_draft_nodes(self, num_speculative_tokens: int) -> int:
        return self.suffix.num_draft_nodes(num_speculative_tokens)

    def add_request(self, request_id: str, prompt_token_ids) -> None:
        self.suffix.add_request(request_id, prompt_token_ids)

    def remove_request(self, request_id: str) -> None:
        self.suffix.remove_request(request_id)
        self._drafter.pop(request_id, None)
        self._last.pop(request_id, None)

    def drafter_expects(self, request_id: str) -> float:
        """Tokens the drafter's draft is expected to keep for this request this step."""
        own = self._drafter.get(request_id)
        prior = self._drafter_all.mean
        if own is None:
            return prior
        return (own.total + RECORD_WEIGHT * prior) / (own.weight + RECORD_WEIGHT)

    def split(self, batch: list[SpecRequest], trees: list[DraftTree]) -> tuple[list[SpecRequest], int]:
        """Each request's suffix draft goes into `trees` where it is chosen; -> (the batch the
        drafter drafts for, the requests that took a suffix draft in it asking for nothing so
        that every index stays the batch's; how many took one)."""
        rest, taken = list(batch), 0
        for i, r in enumerate(batch):
            if not r.wants_tree:
                continue
            tree, expected = self.suffix.draft(r)
            if self.threshold is not None:
                take = expected >= self.threshold
            else:
                take = expected * self._calibration.mean >= self.drafter_expects(r.request_id) - DRAFTER_STEP_TOKENS
            if tree.num_nodes and take:
                trees[i] = tree
                rest[i] = replace(r, num_speculative_tokens=0)
                self._last[r.request_id] = expected
                taken += 1
            else:
                self._last[r.request_id] = None
        return rest, taken

    def observe(self, feedback: VerifyFeedback) -> None:
        self.suffix.observe(feedback)
        for rid, drafted, kept in zip(feedback.request_ids, feedback.num_draft, feedback.num_accepted):
            if not drafted or rid not in self._last:
                continue
            expected = self._last.pop(rid)
            if expected is not None:
                self._calibration.add(kept, expected)
            else:
                self._drafter_all.add(kept)
                own = self._drafter.get(rid)
                if own is None:
                    own = self._drafter[rid] = _Decayed(0.0, 0.0, REQUEST_DECAY)
                own.add(kept)
