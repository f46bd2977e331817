"""What a target pass costs, as a function of what it computes: measured when the engine starts
and refined after every step. Adaptive speculation (engine/adaptive.py) reads it to price each
draft token against the tokens it is expected to add.

The model, in seconds:

    pass(N, R, S) = base(N) + per_read * R + per_query_key * S

    N: tokens the pass computes (prompt chunks, decode tokens, drafts), all requests together;
    R: keys read, sum over requests of the request's context (a request's keys and values are
       read once per layer for all its query tokens);
    S: query-key pairs, sum over tokens of the keys each sees.

`base` is a table over N (interpolated), not a line: on a CPU a pass of a few tokens costs what
reading the weights costs, then each token adds its arithmetic, with steps where the kernels'
row tiles fill (measured on the 2-core machine, Q4_1/Q8_0 blocks, context 100: 4.8 ms at 1
token, 5.4 at 5, 7.3 at 9, 11.9 at 17). The two context terms are fitted from two extra passes
at a long context. After each step the table entry at that step's N moves toward the measured
time less the context terms (an exponential average; outliers clipped, since a shared machine
stalls now and then), so the model follows the machine it runs on, batch sizes the start-up
probe did not reach included. Each term learns from the steps it prices: it moves by its share
of the prediction times the relative error (the gradient of the squared relative error in the
term's log), so a pass of decodes teaches the table and a long prompt chunk, whose time is
mostly attention over its prefix, the context terms (measured: a 256-token chunk at context
3,700 cost 1.7 us per query-key pair where the start-up probe at context 1,000 read 1.0). A pass
without context moves the table exactly by its residual.

Steps only teach the knots they reach, and a machine can change as a whole: a start-up probe
taken while other processes held the cores reads every pass several times too slow, and if the
knots of a few more tokens stay that high, drafts look too dear to try, so no step ever reaches
them. So the model also follows the machine's level: an exponential average of log(measured /
predicted) over all steps, and when it stays more than 2x off, the whole table and the context
terms are scaled by it (the shape the probe measured is kept; its level is the step times').
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

# Token counts measured at start-up (and the table's knots): dense where the draft lengths of a
# few requests land, sparse beyond.
KNOTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
# Weight of one step's measurement in the table (after clipping to [1/2, 2] x the prediction).
LEARNING_RATE = 0.05
# The machine's level (module note): the weight of one step in the average of log(measured /
# predicted), each step's ratio clipped to [1/16, 16] so that one stall moves it little; the
# whole model is scaled once the average is more than DRIFT_RESCALE x off, at most once every
# DRIFT_MIN_STEPS steps.
DRIFT_RATE = 0.1
DRIFT_RESCALE = 2.0
DRIFT_MIN_STEPS = 20


@dataclass(slots=True)
class PassShape:
    """What one pass computes (see the module note for the symbols)."""

    num_tokens: int  # N
    keys_read: int = 0  # R
    query_keys: int = 0  # S

    def add(self, num_tokens: int, context: int) -> None:
        """One request computing `num_tokens` tokens after `context` cached ones (each token
        sees the context and the tokens before it: an upper bound for tree nodes)."""
        self.num_tokens += num_tokens
        self.keys_read += context + num_tokens
        self.query_keys += num_tokens * context + num_tokens * (num_tokens + 1) // 2


@dataclass(slots=True)
class PassCostModel:
    base: list[float]  # seconds at each of `knots` tokens, context terms excluded
    knots: tuple[int, ...] = KNOTS
    per_read: float = 0.0  # seconds per key read (R)
    per_query_key: float = 0.0  # seconds per query-key pair (S)
    num_observed: int = 0
    source: str = "measured at start-up"
    num_rescales: int = 0  # times the machine's level moved the whole model (module note)
    _monotone: list[float] = field(default_factory=list, repr=False)
    _drift: float = field(default=0.0, repr=False)  # average log(measured / predicted)
    _since_rescale: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if len(self.base) != len(self.knots):
            raise ValueError(f"{len(self.base)} base times for {len(self.knots)} knots")
        self._refresh()

    def _refresh(self) -> None:
        # Prices must not fall as tokens are added (a noisy knot below its left neighbour would
        # make a draft token look free); the raw table keeps learning underneath.
        out, top = [], 0.0
        for t in self.base:
            top = max(top, t)
            out.append(top)
        self._monotone = out

    def base_time(self, num_tokens: int) -> float:
        """base(N): interpolated between knots, extended past the last one along its slope."""
        ks, ts = self.knots, self._monotone
        if num_tokens <= ks[0]:
            return ts[0]
        i = bisect.bisect_left(ks, num_tokens)
        if i == len(ks):
            i -= 1  # past the table: along its last segment
        k0, k1, t0, t1 = ks[i - 1], ks[i], ts[i - 1], ts[i]
        return t0 + (t1 - t0) * (num_tokens - k0) / (k1 - k0)

    def predict(self, shape: PassShape) -> float:
        return self.base_time(shape.num_tokens) + self.per_read * shape.keys_read + self.per_query_key * shape.query_keys

    def observe(self, shape: PassShape, seconds: float) -> None:
        """A step's measured pass time: moves the model toward it (module note: the terms by
        their shares), and the whole model when the machine's level has moved."""
        predicted = self.predict(shape)
        self._follow_level(seconds / predicted)
        predicted = self.predict(shape)
        seconds = min(max(seconds, 0.5 * predicted), 2.0 * predicted)
        err = seconds / predicted - 1.0
        base = self.base_time(shape.num_tokens)
        read_share = self.per_read * shape.keys_read / predicted
        pair_share = self.per_query_key * shape.query_keys / predicted
        self.per_read *= 1.0 + LEARNING_RATE * read_share * err
        self.per_query_key *= 1.0 + LEARNING_RATE * pair_share * err
        self.num_observed += 1
        ks = self.knots
        n = max(shape.num_tokens, ks[0])
        if n > ks[-1]:  # past the table: its slope is not this pass's to move
            return
        i = bisect.bisect_left(ks, n)
        if ks[i] == n:
            parts = [(i, 1.0)]
        else:  # split between the two knots it lies between, as interpolation reads them
            w = (n - ks[i - 1]) / (ks[i] - ks[i - 1])
            parts = [(i - 1, 1.0 - w), (i, w)]
        for j, w in parts:
            self.base[j] = max(1e-6, self.base[j] + LEARNING_RATE * w * (base / predicted) * err * base)
        self._refresh()

    def _follow_level(self, ratio: float) -> None:
        ratio = min(max(ratio, 1 / 16), 16.0)
        self._drift += DRIFT_RATE * (math.log(ratio) - self._drift)
        self._since_rescale += 1
        # The average starts at 0 after each rescale: corrected for that, as Adam's moments are.
        level = self._drift / (1.0 - (1.0 - DRIFT_RATE) ** self._since_rescale)
        if self._since_rescale < DRIFT_MIN_STEPS or abs(level) <= math.log(DRIFT_RESCALE):
            return
        factor = math.exp(level)
        self.base = [t * factor for t in self.base]
        self.per_read *= factor
        self.per_query_key *= factor
        self._drift, self._since_rescale = 0.0, 0
        self.num_rescales += 1
        self._refresh()

    def describe(self) -> str:
        ms = lambda n: f"{1e3 * self.base_time(n):.2f}"  # noqa: E731
        rescaled = f", rescaled {self.num_rescales} times" if self.num_rescales else ""
        return (f"pass cost ({self.source}; {self.num_observed} steps since{rescaled}): {ms(1)} ms at 1 token, {ms(4)} at 4, "
                f"{ms(8)} at 8, {ms(16)} at 16, {ms(64)} at 64; +{1e6 * self.per_read:.2f} us per key read, "
                f"+{1e9 * self.per_query_key:.1f} ns per query-key pair")

    def as_dict(self) -> dict:
        return {"knots": list(self.knots), "base_s": [round(t, 7) for t in self.base], "per_read_s": self.per_read,
                "per_query_key_s": self.per_query_key, "num_observed": self.num_observed, "num_rescales": self.num_rescales,
                "source": self.source}

    @classmethod
    def measure(cls, run: Callable[[list[tuple[int, int]]], None], max_tokens: int, max_context: int,
                repeats: int = 3) -> "PassCostModel":
        """Time passes through `run(requests)`, requests a list of (tokens, context) pairs (the
        caller computes them on scratch KV slots): `base` from passes of N one-token requests
        at context 0 for every knot up to `max_tokens`, the context terms from one request of 1
        and of 16 tokens at `max_context`. Each figure is the fastest of `repeats` runs after
        one warm-up (first passes pay page faults and thread start-up)."""

        def fastest(requests: list[tuple[int, int]]) -> float:
            run(requests)
            best = float("inf")
            for _ in range(repeats):
                t0 = time.perf_counter()
                run(requests)
                best = min(best, time.perf_counter() - t0)
            return best

        measured = [k for k in KNOTS if k <= max(1, max_tokens)]
        base = [fastest([(1, 0)] * n) for n in measured]
        # Knots past the probe start on the last measured slope; steps that reach them refine them.
        slope = (base[-1] - base[-2]) / (measured[-1] - measured[-2]) if len(base) > 1 else base[0]
        base += [base[-1] + slope * (k - measured[-1]) for k in KNOTS[len(measured):]]
        model = cls(base)
        if max_context >= 64:
            # Two passes at context c, two unknowns. A probe pass of N one-token requests read
            # N keys and N pairs itself, so each long pass less the probe of its token count
            # leaves a * (R - N) + b * (S - N).
            c = max_context - 16
            eqs = []
            for n in (1, 16):
                shape = PassShape(0)
                shape.add(n, c)
                eqs.append((shape.keys_read - n, shape.query_keys - n, fastest([(n, c)]) - model.base_time(n)))
            (r1, s1, t1), (r2, s2, t2) = eqs
            det = r1 * s2 - r2 * s1
            if det:
                model.per_read = max((t1 * s2 - t2 * s1) / det, 0.0)
                model.per_query_key = max((r1 * t2 - r2 * t1) / det, 0.0)
                # The probes' own keys and pairs move out of base.
                model.base = [t - (model.per_read + model.per_query_key) * k
                              for t, k in zip(model.base, KNOTS)]
                model._refresh()
        return model
