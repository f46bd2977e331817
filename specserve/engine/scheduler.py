"""Which requests compute which tokens in the next step. Pure Python: the scheduler never
touches tensors; it decides, and the KV cache manager hands out the blocks for its decisions.

Every request moves forward the same way: a step computes tokens
`[num_computed_tokens, num_computed_tokens + n)` of it; when that reaches its last token, the step
also samples (and, in a decode step, verifies drafts). So a prompt is one or several chunks,
a decode is one token plus drafts, and a request preempted by recompute simply starts again at
0 with its generated tokens counted as prompt.

Policy, per step, under `max_num_batched_tokens` and `max_num_seqs`:
  1. running requests first, in arrival order: a decode takes 1 + the nodes of the draft it
     carries (proposed at the end of its last step; cut to the budget), a prompt the next
     chunk that fits the budget. When the pool is out of blocks, the most recently admitted
     running request is preempted (its blocks freed, its computed length reset) until the
     request fits; no request is admitted in a step that preempted.
  2. then waiting requests, first come first served, each taking its cached prefix (prefix
     caching) and a first chunk; admission stops at the first request that does not fit, so a
     large request at the head is never overtaken forever (no starvation).

Step time: while any running request decodes, its next token waits for the whole step, so
prompt chunks are also cut to keep the step's predicted time within `max_step_ms`. The engine
hands `schedule` its pass cost model's prediction (a function of the step's PassShape); a
prompt token costs more the longer its prefix (attention), so a long prompt's chunks shrink as
it progresses. The step's first prompt chunk takes at least MIN_PROMPT_CHUNK tokens, whatever
the prediction, so prompts always progress; later ones only what fits. With no request
decoding, chunks take the whole token budget (throughput).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from specserve.config import EngineConfig
from specserve.engine.cost_model import PassShape
from specserve.kv.block_manager import BlockPool, KVCacheManager
from specserve.engine.request import Request, Status

# The fewest tokens the step's first prompt chunk takes under the step-time bound: a pass costs
# its weights' read whatever it computes (~3.5 ms for the embedded model on the 2-core CPU,
# against ~1.2 ms for a prompt token after 1,000 tokens of context), so smaller chunks would
# spend the prompt's time on passes; 16 is also one KV block, which the prefix cache shares.
MIN_PROMPT_CHUNK = 16


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # tokens computed this step, from request.num_computed_tokens on
    # Drafts (chain tokens or tree nodes) it verifies this step (decode only): its draft's first
    # num_draft nodes (a parent comes before its children, so they form a tree), slots allocated.
    num_draft: int = 0
    decode: bool = False  # computes only the last token (+ drafts), then samples; else a prompt chunk
    # Whether this step reaches the request's last token, so that it samples a new one (fixed
    # when scheduled: the update moves the request's progress).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    prefill: list[ScheduledRequest] = field(default_factory=list)  # prompt chunks (several tokens to compute)
    decode: list[ScheduledRequest] = field(default_factory=list)  # the last token (+ drafts), then sample
    preempted: list[Request] = field(default_factory=list)  # sent back to waiting this step

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode

    @property
    def scheduled(self) -> list[ScheduledRequest]:
        """Every request the step computes, prompt chunks first: the order of one pass."""
        return self.prefill + self.decode

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_draft for s in self.prefill + self.decode)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int):
        self.config = config
        self.pool = BlockPool(num_blocks, config.block_size, config.enable_prefix_caching)
        self.kv = KVCacheManager(self.pool)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def block_table(self, request: Request) -> list[int]:
        return self.kv.block_table(request.request_id)

    def schedule(self, predict: Callable[[PassShape], float] | None = None) -> SchedulerOutput:
        """The next step. `predict`: seconds a pass of that shape is expected to take (the
        engine's cost model); with it and `max_step_ms`, prompt chunks keep a step that has a
        decoding request within the bound (module note)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        limit = _StepLimit.of(self, predict)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            to_compute = req.num_tokens - req.num_computed_tokens
            if to_compute == 1:
                n, drafts = 1, min(req.num_pending_drafts, budget - 1)
            else:
                n, drafts = min(to_compute, budget), 0
                if limit is not None:
                    n = limit.chunk(req.num_computed_tokens, n, first=not out.prefill)
                    if n == 0:  # the step is full: the prompt goes on next step
                        i += 1
                        continue
            while not self.kv.can_allocate(req.request_id, n + drafts):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:  # preempted itself: nothing left to give it room
                break
            self.kv.allocate_slots(req.request_id, n + drafts)
            (out.decode if to_compute == 1 else out.prefill).append(ScheduledRequest(req, n, drafts, to_compute == 1))
            budget -= n + drafts
            i += 1
        if out.preempted:
            return out
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            _, cached = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            n = min(req.num_tokens - cached, budget)
            if limit is not None:
                n = limit.chunk(cached, n, first=not out.prefill)
            if n == 0 or not self.kv.can_allocate(req.request_id, n):
                self.kv.free(req.request_id)  # its prefix hits stay cached, evictable
                break
            self.kv.allocate_slots(req.request_id, n)
            self.waiting.popleft()
            req.num_computed_tokens = cached
            req.status = Status.RUNNING
            self.running.append(req)
            decode = n == 1 and req.num_tokens - cached == 1
            (out.decode if decode else out.prefill).append(ScheduledRequest(req, n, decode=decode))
            budget -= n
        return out

    def _preempt(self, req: Request) -> None:
        """Preemption by recompute: the request's blocks go back to the pool (cached ones stay
        reusable) and it waits at the head of the queue to compute its tokens again."""
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def update(self, scheduled: ScheduledRequest, num_committed: int) -> None:
        """After a step that committed `num_committed` tokens to the request: its progress moves
        (the scheduler is the only one to move it) past the chunk it computed, or to all its
        tokens but the last when the step sampled; tokens below it are committed (full blocks
        enter the prefix cache) and slots past it (rejected drafts) are freed. KV entries of
        rejected drafts stay past the computed length until then; they are rewritten before
        any query can see them."""
        request = scheduled.request
        if num_committed:
            request.num_computed_tokens = request.num_tokens - 1
        else:
            request.num_computed_tokens += scheduled.num_new_tokens
        self.kv.commit(request.request_id, request.all_token_ids, request.num_computed_tokens)
        self.kv.rollback(request.request_id, request.num_computed_tokens)

    def finish(self, request: Request) -> None:
        """Release a finished or aborted request: its blocks return to the pool at once."""
        if request in self.running:
            self.running.remove(request)
            self.kv.free(request.request_id)
        elif request in self.waiting:
            self.waiting.remove(request)


@dataclass(slots=True)
class _StepLimit:
    """The step-time bound of one `schedule` call: the pass so far (every decoding request's
    token and drafts, then each prompt chunk as it is chosen) and its prediction."""

    predict: Callable[[PassShape], float]
    seconds: float
    shape: PassShape  # the step's pass as scheduled so far

    @classmethod
    def of(cls, scheduler: Scheduler, predict: Callable[[PassShape], float] | None) -> "_StepLimit | None":
        """None unless the bound is on and some running request decodes this step."""
        ms = scheduler.config.max_step_ms
        if predict is None or not ms:
            return None
        shape = PassShape(0)
        for r in scheduler.running:
            if r.num_tokens - r.num_computed_tokens == 1:
                shape.add(1 + r.num_pending_drafts, r.num_computed_tokens)
        return cls(predict, ms / 1e3, shape) if shape.num_tokens else None

    def chunk(self, context: int, most: int, first: bool) -> int:
        """Tokens of a prompt at `context` computed tokens that fit the step (at most `most`;
        at least MIN_PROMPT_CHUNK, or `most` if fewer, when it is the step's first chunk),
        added to the step's pass."""
        lo = min(most, MIN_PROMPT_CHUNK) if first else 0
        hi = most + 1  # the prediction grows with the chunk: bisect for the largest that fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self._fits(mid, context):
                lo = mid
            else:
                hi = mid
        if lo:
            self.shape.add(lo, context)
        return lo

    def _fits(self, n: int, context: int) -> bool:
        shape = PassShape(self.shape.num_tokens, self.shape.keys_read, self.shape.query_keys)
        shape.add(n, context)
        return self.predict(shape) <= self.seconds
