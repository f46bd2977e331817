"""Adaptive speculation: every step, each speculating request's draft length is chosen to
maximise the whole batch's expected committed tokens per second.

Inputs: the pass cost model (engine/cost_model.py) and, per request, the chance that draft
position j is accepted given that positions before it were (its own verifications, decayed so
that it follows the text, shrunk toward the method-wide rate). A request drafting k tokens is
expected to commit 1 + a_1 + a_1 a_2 + ... + a_1...a_k tokens.

How far a request's record is shrunk toward the method's rate is learned: each verification
scores what each of a few prior strengths would have predicted for it, and plans use the
strength that erred least. A lookup's acceptance comes in runs (an n-gram that matched matches
again: on Spec-Bench P(accept | last accepted) 0.63 against 0.25 after a rejection), so a
request's own record predicts it; a learned drafter's barely does (EAGLE-3: 0.41 against
0.32), and trusting its record let runs of bad luck switch drafting off where it paid on
average (its measured acceptance replayed through the planner: 1.05x plain at a fixed
strength of 2, 1.08x with the learned one, the same as drafting at every step).

The choice: start from no drafts, then add draft tokens one at a time, always the one with the
largest expected gain (the next position of some request; gains only shrink along a request's
positions), pricing the pass after each addition; keep the prefix of additions whose ratio
(expected tokens) / (pass time + drafting time) is highest. With a linear price this greedy is
exact; the cost table's steps (row tiles filling) are why every prefix is priced, not just the
first that stops paying. Large batches make each token's price high relative to a pass that
already yields a token per request, so speculation switches itself off there; a request whose
drafts stop being accepted stops drafting; both come back when the numbers change.

A request that drafts nothing learns nothing, so one that has not drafted for PROBE_EVERY
steps drafts one token (about 1/PROBE_EVERY of a token's price per step). A probe that is not
accepted doubles the request's wait before the next (up to PROBE_MAX steps), and so does one
that is accepted but does not bring the request's drafts back (at the acceptance it showed,
drafting still does not pay: a draft model as dear as its target); one whose request drafts
again brings the wait back to PROBE_EVERY. And whatever the wait, probes may cost at most
PROBE_BUDGET of the time: a probing step's measured drafting (it catches up on every token since
the request last drafted: a draft model's or a self-draft's pass over them) over PROBE_BUDGET
of a pass is the fewest steps between two probing steps, all requests together (those due then
probe in the same step, drafted together). A drafter whose probes cost a pass of their own then
costs about one probe per answer while it does not pay, and a cheap lookup one every
PROBE_EVERY steps.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from specserve.engine.cost_model import PassCostModel, PassShape

# How far a request's own record is trusted (module note): the method-wide rate counts as this
# many of its own observations, one of PRIOR_STRENGTHS, the one whose predictions of the
# verifications so far erred least (squared error, faded by STRENGTH_ERROR_DECAY per
# verification; ties, as before the first, go to the strongest).
PRIOR_STRENGTHS = (32.0, 8.0, 2.0)
STRENGTH_ERROR_DECAY = 0.995
# INITIAL_ACCEPTANCE counts as this many of the method's own observations: a couple of early
# rejections do not switch a method off before it has been seen.
METHOD_PRIOR_STRENGTH = 8.0
# A request's observations fade by this factor per verification (its text changes character);
# the method-wide estimate fades slower.
REQUEST_DECAY = 0.9
METHOD_DECAY = 0.995
# Acceptance assumed before anything was verified: drafting starts where a token is cheap and
# learns from there.
INITIAL_ACCEPTANCE = 0.5
PROBE_EVERY = 16
PROBE_MAX = 128
PROBE_BUDGET = 0.01  # of the time spent in target passes, at most, spent drafting probes
# Drafting time per step is an exponential average per draft depth.
PROPOSER_RATE = 0.2


@dataclass(slots=True)
class AcceptanceEstimate:
    """Decayed counts of draft positions verified and accepted (position 0 = the first draft)."""

    decay: float
    drafted: list[float] = field(default_factory=list)
    accepted: list[float] = field(default_factory=list)

    def observe(self, depth: int, num_accepted: int) -> None:
        """A verification that could accept up to `depth` drafts accepted `num_accepted`:
        positions before it were accepted, position num_accepted (if drafted) was not, later
        positions were never tested."""
        tested = min(depth, num_accepted + 1)
        if tested > len(self.drafted):
            self.drafted.extend([0.0] * (tested - len(self.drafted)))
            self.accepted.extend([0.0] * (tested - len(self.accepted)))
        for j in range(len(self.drafted)):
            self.drafted[j] *= self.decay
            self.accepted[j] *= self.decay
        for j in range(tested):
            self.drafted[j] += 1.0
            self.accepted[j] += j < num_accepted

    def rates(self, prior: list[float], strength: float) -> list[float]:
        """Acceptance by position, each shrunk toward `prior` (same length as the result)."""
        out = []
        for j, p in enumerate(prior):
            d = self.drafted[j] if j < len(self.drafted) else 0.0
            a = self.accepted[j] if j < len(self.accepted) else 0.0
            out.append((a + strength * p) / (d + strength))
        return out


@dataclass(slots=True)
class PlanRow:
    """One decoding request as the planner sees it."""

    request_id: str
    context: int  # tokens in its cache before this step's root
    max_depth: int  # the most drafts it may verify this step (room left in its max_tokens and the context)


@dataclass(slots=True)
class Plan:
    depths: list[int]  # per row, the draft length chosen (0: a plain decode step)
    expected_tokens: float  # committed tokens the batch is expected to yield
    predicted_s: float  # the pass and drafting time priced for it
    row_s: float = 0.0  # what one more token in that pass adds to its time

    @property
    def min_path_prob(self) -> float:
        """The least acceptance chance that pays for one more verified row: the row adds
        row_s to a step that yields expected_tokens in predicted_s, so it pays when its chance
        exceeds row_s * expected_tokens / predicted_s (SpecRequest.min_path_prob)."""
        return min(1.0, self.row_s * self.expected_tokens / self.predicted_s) if self.predicted_s > 0 else 0.0


def _average(old: float | None, new: float) -> float:
    """An exponential average at PROPOSER_RATE, started by its first value."""
    return new if old is None else old + PROPOSER_RATE * (new - old)


class SpeculationPlanner:
    """Chooses draft lengths (`plan`) and learns from what each step did (`observe_*`)."""

    def __init__(self, cost: PassCostModel, max_depth: int, tokens_per_depth: float = 1.0):
        self.cost = cost
        self.max_depth = max_depth
        # Tree proposers may verify several nodes per depth: `tokens_per_depth` is the budget a
        # tree gets (`nodes`), and `width` what a depth is priced at: the nodes per depth the
        # proposer actually drafted, learned (a lookup tree is often one path, within a budget
        # for more), starting at the budget.
        self.tokens_per_depth = tokens_per_depth
        self.width = tokens_per_depth
        self.method = AcceptanceEstimate(METHOD_DECAY)
        self.requests: dict[str, AcceptanceEstimate] = {}
        # Each PRIOR_STRENGTHS' squared prediction errors, faded; plans use the least one's.
        self.strength_error = [0.0] * len(PRIOR_STRENGTHS)
        self.strength = PRIOR_STRENGTHS[0]
        self.idle_steps: dict[str, int] = {}
        self.probe_every: dict[str, int] = {}  # a request's wait between probes, PROBE_EVERY..PROBE_MAX
        self.probing: set[str] = set()  # requests whose last draft was a probe, until verified
        # Requests whose probe was accepted: the next plan says whether they draft again.
        self.recheck: set[str] = set()
        self.proposer_s: list[float | None] = [None] * (max_depth + 1)  # by the step's deepest draft
        self._drafting: list[float] | None = None  # drafting_s by depth, until proposer_s changes
        self.probe_s: float | None = None  # drafting time of a step that drafted a probe, averaged
        # The last plan had a request draft after a pause, or for the first time: that step's
        # drafting caught up on the pause (or the prompt), like a probe's (observe_step).
        self.resumed = False
        self.chosen = [0] * (max_depth + 1)  # request-steps per chosen depth, for the figures
        self.steps_since_probe = 0  # plans since one last had a request probe

    # ---- choosing ---------------------------------------------------------------------------

    def method_rates(self, positions: int | None = None) -> list[float]:
        """The method-wide acceptance of the first `positions` draft positions (all by default)."""
        n = self.max_depth if positions is None else positions
        return self.method.rates([INITIAL_ACCEPTANCE] * n, METHOD_PRIOR_STRENGTH)

    def plan(self, base: PassShape, rows: list[PlanRow]) -> Plan:
        """Draft lengths for `rows`, given the rest of the pass (`base`: one token per decoding
        request, already counted; the engine leaves prompt chunks out, whose time buys no
        committed token)."""
        prior = self.method_rates()
        heap: list[tuple[float, int, int]] = []  # (-gain of the next position, row, position)
        gains: list[list[float]] = []
        for i, r in enumerate(rows):
            est = self.requests.get(r.request_id)
            rates = est.rates(prior, self.strength) if est is not None else prior
            g, row = 1.0, []
            for a in rates[: r.max_depth]:
                g *= a
                row.append(g)
            gains.append(row)
            if row:
                heapq.heappush(heap, (-row[0], i, 0))
        shape = PassShape(base.num_tokens, base.keys_read, base.query_keys)
        expected = float(len(rows))
        depths = [0] * len(rows)
        best_t = self.cost.predict(shape)
        # (ratio, depths, expected tokens, time, the pass's shape): the row price is taken once,
        # for the winner (a plan runs every step, a few dozen microseconds in all).
        best = (expected / best_t, list(depths), expected, best_t, PassShape(shape.num_tokens, shape.keys_read,
                                                                             shape.query_keys))
        deepest = 0
        if self._drafting is None:
            self._drafting = [self.drafting_s(d) for d in range(self.max_depth + 1)]
        drafting = self._drafting
        since_best = 0
        # Gains only fall, so a long run of additions that never beat the best prefix ends the
        # search (only the cost table's steps could make a later prefix win, and not by much).
        while heap and since_best < 4 * self.max_depth:
            neg, i, j = heapq.heappop(heap)
            if -neg < 1e-3:
                break
            w = self.width
            n_before = 1 + w * j  # the row's tokens in the pass before this position
            shape.num_tokens += w
            shape.keys_read += w
            shape.query_keys += w * (rows[i].context + n_before) + w * (w + 1) / 2
            expected += -neg
            depths[i] = j + 1
            deepest = max(deepest, j + 1)
            t = self.cost.predict(shape) + drafting[deepest]
            since_best += 1
            if expected / t > best[0]:
                best = (expected / t, list(depths), expected, t,
                        PassShape(shape.num_tokens, shape.keys_read, shape.query_keys))
                since_best = 0
            if j + 1 < len(gains[i]):
                heapq.heappush(heap, (-gains[i][j + 1], i, j + 1))
        depths = best[1]
        # Probes cost at most PROBE_BUDGET of the passes' time (module note), all requests
        # together: the requests due probe in one step, drafted together, and the next such step
        # comes `floor` steps later (a wait per request alone would let 64 requests in flight,
        # their waits ending at different steps, probe in up to 64 times as many steps).
        floor = 0 if self.probe_s is None else math.ceil(self.probe_s / (PROBE_BUDGET * max(1e-9, self.cost.predict(base))))
        self.steps_since_probe += 1
        may_probe, probed = self.steps_since_probe >= floor, False
        self.resumed = False
        for i, r in enumerate(rows):  # probes: requests that have not drafted for a while
            if r.request_id in self.recheck:
                self.recheck.discard(r.request_id)
                wait = self.probe_every.get(r.request_id, PROBE_EVERY)
                self.probe_every[r.request_id] = PROBE_EVERY if depths[i] else min(PROBE_MAX, 2 * wait)
            if depths[i] == 0 and r.max_depth > 0:
                idle = self.idle_steps.get(r.request_id, 0) + 1
                self.idle_steps[r.request_id] = idle
                if may_probe and idle >= max(floor, self.probe_every.get(r.request_id, PROBE_EVERY)):
                    depths[i] = 1
                    self.probing.add(r.request_id)
                    probed = True
            if depths[i]:
                self.resumed |= self.idle_steps.get(r.request_id) != 0
                self.idle_steps[r.request_id] = 0
            self.chosen[depths[i]] += 1
        if probed:
            self.steps_since_probe = 0
        return Plan(depths, best[2], best[3], self._row_s(best[4], rows))

    def _row_s(self, shape: PassShape, rows: list[PlanRow]) -> float:
        """The price of one more token in a pass of `shape`, at the rows' mean context."""
        context = sum(r.context for r in rows) // max(1, len(rows))
        more = PassShape(shape.num_tokens, shape.keys_read, shape.query_keys)
        more.add(1, context)
        return max(0.0, self.cost.predict(more) - self.cost.predict(shape))

    def drafting_s(self, depth: int) -> float:
        """Drafting time of a step whose deepest draft is `depth` (0 for no drafting): the
        measured average at that depth; between measured depths, interpolated; past them, the
        nearest measured one, extended along the slope of the two nearest (a lookup proposer
        costs the same at every depth, a draft model one small pass per depth). Never assumed
        to grow faster than measured, so an untried depth is tried rather than ruled out."""
        if depth == 0:
            return 0.0
        known = [(d, t) for d, t in enumerate(self.proposer_s) if t is not None and d > 0]
        if not known:
            return 0.0
        below = [(d, t) for d, t in known if d <= depth]
        above = [(d, t) for d, t in known if d >= depth]
        if below and above:
            (d0, t0), (d1, t1) = below[-1], above[0]
            return t0 if d0 == d1 else t0 + (t1 - t0) * (depth - d0) / (d1 - d0)
        side = below[-2:] if below else above[:2]
        if len(side) == 1:
            return side[0][1]
        (d0, t0), (d1, t1) = side
        return max(0.0, t1 + (t1 - t0) / (d1 - d0) * (depth - d1))

    def nodes(self, depth: int, slots: int) -> int:
        """Tree nodes to draft at this depth (chains: the depth), within `slots` (the most the context allows)."""
        return min(slots, max(depth, math.ceil(depth * self.tokens_per_depth)))

    # ---- learning ---------------------------------------------------------------------------

    def observe_verification(self, request_id: str, depth: int, num_accepted: int, num_nodes: int | None = None) -> None:
        """A request's verification: it was asked for `depth` drafts and drafted a tree of
        `num_nodes` nodes (None: a chain of `depth`; a tree pruned by a floor may have fewer
        nodes than its depth, or none), of which it accepted `num_accepted`."""
        if depth <= 0:
            return
        if request_id in self.probing:
            self.probing.discard(request_id)
            if num_accepted:
                self.recheck.add(request_id)
            else:
                self.probe_every[request_id] = min(PROBE_MAX, 2 * self.probe_every.get(request_id, PROBE_EVERY))
        if num_nodes is not None:
            # Below 1 where a floor leaves trees shallower than asked, or empty.
            ratio = min(self.tokens_per_depth, num_nodes / depth)
            self.width += PROPOSER_RATE * (ratio - self.width)
        est = self.requests.get(request_id)
        if est is None:
            est = self.requests[request_id] = AcceptanceEstimate(REQUEST_DECAY)
        self._score_strengths(est, depth, num_accepted)
        est.observe(depth, num_accepted)
        self.method.observe(depth, num_accepted)

    def _score_strengths(self, est: AcceptanceEstimate, depth: int, num_accepted: int) -> None:
        """Score what each prior strength predicted for this verification (the positions it
        tested: accepted before num_accepted, rejected at it), before `est` learns from it."""
        tested = min(depth, num_accepted + 1)
        prior = self.method_rates(tested)  # only the tested positions: this runs per verification
        for i, strength in enumerate(PRIOR_STRENGTHS):
            rates = est.rates(prior, strength)
            err = sum(((j < num_accepted) - a) ** 2 for j, a in enumerate(rates))
            self.strength_error[i] = STRENGTH_ERROR_DECAY * self.strength_error[i] + err
        self.strength = PRIOR_STRENGTHS[min(range(len(PRIOR_STRENGTHS)), key=self.strength_error.__getitem__)]

    def observe_step(self, shape: PassShape, pass_s: float, drafting_s: float, deepest: int,
                     probe: bool = False) -> None:
        """A pass of `shape` took pass_s; the drafting for it drafting_s. probe: the step drafted
        a probe, which caught up on every token since the request last drafted, so not what a
        drafting step costs: it is averaged apart (probe_s, which spaces probes), or drafting
        after a long pause would look dearer with every pause, and pauses grow longer. A step
        where a request resumed drafting (the last plan's `resumed`: after a pause, or its first
        draft, which reads the whole prompt) is averaged apart likewise: taken as what a depth
        costs, one prompt's catch-up once priced depth 1 at 3.5 ms against ~1.2 ms drafting
        step after step, and depth 1 was then never chosen again to correct it."""
        self.cost.observe(shape, pass_s)
        resumed, self.resumed = self.resumed, False  # the one step its plan was for
        if probe or (resumed and deepest > 0):
            self.probe_s = _average(self.probe_s, drafting_s)
            # Such a step drafts what a step of its depth does and catches up more: its time
            # bounds that depth's price from above. A price once measured too high (steps
            # timed while something else held the cores), or taken from such prices at other
            # depths, would otherwise stay: the depth is no longer chosen, so never timed
            # again, and the method stays off for the run (EAGLE-3 on Spec-Bench: 0.03 drafts
            # a pass and 0.93x plain after a disturbed start, 0.50 and 1.07x undisturbed).
            if deepest > 0 and drafting_s < self.drafting_s(deepest):
                self.proposer_s[deepest] = drafting_s
                self._drafting = None
        elif deepest > 0:
            self.proposer_s[deepest] = _average(self.proposer_s[deepest], drafting_s)
            self._drafting = None

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.idle_steps.pop(request_id, None)
        self.probe_every.pop(request_id, None)
        self.probing.discard(request_id)
        self.recheck.discard(request_id)
