"""The engine step: schedule -> execute -> update, with speculation as propose -> verify ->
accept -> commit inside the execute/update of a decode step."""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from specserve.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from specserve.drafts import DraftProposal, DraftTree, SpecRequest, VerifyFeedback
from specserve.engine.adaptive import PlanRow, SpeculationPlanner
from specserve.engine.cost_model import PassCostModel, PassShape
from specserve.engine.request import Request, Status
from specserve.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from specserve.kv.budget import num_kv_blocks
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.errors import InvalidParameterError, PromptError
from specserve.model.loader import LoadedModel
from specserve.outputs import BONUS, CORRECTED, DRAFT, PLAIN, CompletionOutput, RequestOutput, TokenLogprob
from specserve.sample import PositionNoise, argmax_rows, verify_flat
from specserve.sample.grammar import GrammarCompiler
from specserve.sample.processors import apply_processors, build_processors, keep_nodes
from specserve.sample.typical import TypicalAcceptance
from specserve.sampling_params import SamplingParams
from specserve.spec.proposer import Proposer
from specserve.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("specserve.engine")


@dataclass(slots=True)
class _Computed:
    """One scheduled request's share of a step, computed but not committed: the pass, sampling
    and verification are done, and nothing of the request itself has changed yet."""

    # To commit: the sampled token, or the accepted drafts then the recovered or bonus token;
    # [] for a prompt chunk that samples nothing.
    token_ids: list[int]
    # [len(token_ids), V] raw target logits that scored each token, for requests asking for log
    # probabilities (None for the others).
    logits: torch.Tensor | None
    # [T, H] target hidden states from the request's computed length on (a prompt chunk; or the
    # root and the accepted drafts); None unless the proposer needs hidden states.
    hidden: torch.Tensor | None
    decode: bool = False  # a decode step: the fields below describe its verification
    # Indices of the accepted drafts (a chain's 0..a-1, a tree's path).
    accepted_nodes: list[int] = field(default_factory=list)
    num_draft: int = 0  # drafts scored (a tree's node count)
    depth: int = 0  # the most that could be accepted (a chain's length, a tree's depth)
    asked_depth: int = 0  # the depth the proposal was asked for under a floor (Request.draft_depth), else 0
    # The last token replaced a rejected draft (the accepted path's end had children), rather
    # than following a path accepted to its end (bonus) or a step with no drafts (plain).
    corrected: bool = False
    target_time_s: float = 0.0  # this request's share of the step's target pass
    # [1 + num_draft] argmax of the raw logits at the root and each node, for proposers with
    # needs_node_predictions; None otherwise.
    node_predictions: list[int] | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The engine's figures at one moment (`LLMEngine.stats`): what servers and benchmarks read."""

    num_running: int = 0
    num_waiting: int = 0  # queued in the scheduler (a server adds those its thread has not taken yet)
    num_requests: int = 0  # requests the engine still holds (running, waiting, or finished but not popped)
    num_kv_blocks: int = 0
    num_kv_blocks_used: int = 0  # referenced by requests; evictable prefix-cache blocks count as free
    block_size: int = 0  # tokens per KV block
    prefix_cache_queried_blocks: int = 0
    prefix_cache_hit_blocks: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    # Adaptive speculation: request-steps by the draft depth chosen (index 0: no drafts), empty
    # when drafts are not chosen per step; the pass cost model's line, empty without one.
    draft_depth_counts: tuple[int, ...] = ()
    cost_model: str = ""

    @property
    def mean_draft_depth(self) -> float:
        n = sum(self.draft_depth_counts)
        return sum(d * c for d, c in enumerate(self.draft_depth_counts)) / n if n else 0.0


class LLMEngine:
    def __init__(self, target: LoadedModel, config: EngineConfig, proposer: Proposer | None = None,
                 num_speculative_tokens: int = 0, typical_acceptance: TypicalAcceptance | None = None,
                 adaptive: bool = False, cost_model: PassCostModel | None = None,
                 disable_by_batch_size: int | None = None):
        """num_speculative_tokens: k, or with `adaptive` the most a request may draft per step
        (the planner chooses 0..k each step from `cost_model`, measured here when not given).
        The same cost model bounds each step's prompt chunks when config.max_step_ms is set.
        disable_by_batch_size: no drafting while at least that many requests run
        (SpeculativeConfig.disable_by_batch_size)."""
        self.target = target
        # Set: sampled requests verify drafts with the typical rule (lossy, opt-in); chains are
        # then verified as one-path trees.
        self.typical_acceptance = typical_acceptance
        self.tokenizer = target.tokenizer
        self.config = config
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer else 0
        self.disable_by_batch_size = disable_by_batch_size
        self.keep_hidden = bool(proposer and proposer.needs_hidden_states)
        self.hidden_layers = tuple(proposer.hidden_layers) if self.keep_hidden else ()
        self.keep_predictions = bool(proposer and proposer.needs_node_predictions)
        num_blocks = num_kv_blocks(target, config)
        self.runner = ModelRunner.paged(target.model, num_blocks, config.block_size)
        self.scheduler = Scheduler(config, num_blocks)
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)  # structured output's, compiled once per spec
        # Seeds for requests that bring none: different per request, and the same sequence in
        # every run of an engine with this config's seed.
        self.seeds = random.Random(config.seed)
        self.planner: SpeculationPlanner | None = None
        plan = adaptive and self.num_speculative_tokens
        cost = cost_model or (self._measure_cost() if plan or self._bounds_steps else None)
        self._cost = None if plan else cost  # the planner owns it when there is one
        if plan:
            width = self.proposer.num_draft_nodes(self.num_speculative_tokens) / self.num_speculative_tokens
            self.planner = SpeculationPlanner(cost, self.num_speculative_tokens, tokens_per_depth=width)
        self.num_steps = 0
        # Called on the engine's thread right before each step's forward pass, which releases
        # the GIL for milliseconds: the server's engine thread hands the last step's outputs to
        # the event loop there (AsyncEngine), so that the loop's work runs while the pass does.
        self.before_forward: Callable[[], None] | None = None
        self._drafting_s = 0.0  # seconds the last proposal took (the next pass verifies its drafts)
        self._probe_drafted = False  # whether that proposal drafted a planner's probe

    @property
    def cost(self) -> PassCostModel | None:
        """The pass cost model: the planner's, or the step-time bound's own (None: neither)."""
        return self.planner.cost if self.planner is not None else self._cost

    @property
    def _bounds_steps(self) -> bool:
        """Whether prompt chunks are cut by predicted step time (a request can decode beside
        a prompt only with room for two)."""
        return bool(self.config.max_step_ms) and self.config.max_num_seqs > 1

    def _measure_cost(self) -> PassCostModel:
        """The target's pass cost on this machine, timed on scratch KV slots (no request holds
        any block yet, and blocks are written before any request reads them)."""
        bs, blocks = self.config.block_size, self.scheduler.pool.num_blocks

        def run(requests: list[tuple[int, int]]) -> None:
            tables, starts, tokens = [], [], []
            for i, (n, context) in enumerate(requests):
                need = -(-(context + n) // bs)
                tables.append([(i + j) % blocks for j in range(need)])
                starts.append(context)
                tokens.append([0] * n)
            self.runner.forward_rows(ForwardBatch(tables, starts, tokens, all_logits=False), [1] * len(requests))
            self.runner.synchronize()

        return PassCostModel.measure(run, *self._cost_probe())

    def _cost_probe(self) -> tuple[int, int]:
        """(the widest pass, the longest context) that _measure_cost times: up to the tokens a
        step of drafts reaches, and with the step-time bound a prompt chunk's too (~16-64 tokens
        at 100 ms on the 2-core CPU)."""
        c = self.config
        chunk = 64 if self._bounds_steps else 0
        probe = min(128, c.max_num_batched_tokens, max(chunk, c.max_num_seqs * (1 + self.num_speculative_tokens)))
        return probe, min(1024, self.scheduler.pool.num_blocks * c.block_size, c.max_model_len) - 16

    # ---- requests in and out -------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt or a stop list may hold: those both the model and the tokenizer know."""
        return min(self.target.config.vocab_size, self.tokenizer.vocab_size)

    def check_prompt(self, prompt_token_ids: Sequence[int]) -> None:
        """Raise PromptError unless the prompt can run: not empty, inside the vocabulary, and
        leaving room in the context for at least one new token."""
        ids = list(prompt_token_ids)
        if not ids:
            raise PromptError("the prompt is empty; give at least one token of text")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise PromptError(
                f"the prompt has {len(ids)} tokens but the context is {limit} tokens (max_model_len), "
                "which must also leave room for at least one generated token"
            )
        vocab = self.vocab_size
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise PromptError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")

    def check_params(self, params: SamplingParams) -> None:
        """Raise InvalidParameterError unless every field is in range, the vocabulary's bounds
        included (SamplingParams' fields stay assignable after it checked them)."""
        if not isinstance(params, SamplingParams):
            raise InvalidParameterError("sampling_params", type(params).__name__, "must be a SamplingParams")
        params.validate()
        if params.n != 1:
            raise InvalidParameterError("n", params.n, "must be 1 for one engine request (LLM.generate and the "
                                        "server make n requests, choice j seeded seed + j)")
        for name, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", list(params.logit_bias or ()))):
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidParameterError(name, bad[:5], f"must name token ids in [0, {self.vocab_size}) (the vocabulary)")
        if params.structured_outputs is not None:  # a bad schema or regex is refused here, not mid-request
            self.grammars.compile(params.structured_outputs)

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None, use_speculation: bool = True,
                    num_speculative_tokens: int | None = None) -> Request:
        """Queue a request. `num_speculative_tokens` overrides the engine's k for this request
        (0: plain decoding); requests with different k, or none, share the same steps."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        self.check_prompt(ids)
        self.check_params(params)
        # The engine's own copy: the caller's object (one for many prompts in LLM.generate)
        # stays assignable while its requests run.
        params = params.copy()
        req = Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=ids,
            params=params,
            noise=PositionNoise(self.seeds.getrandbits(63) if params.seed is None else params.seed),
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens),
            eos_token_ids=self.tokenizer.eos_token_ids,
            num_speculative_tokens=self._request_k(use_speculation, num_speculative_tokens),
            # Draft lengths chosen each step, unless the request asked for its own k.
            adaptive=self.planner is not None and use_speculation and num_speculative_tokens is None,
            processors=build_processors(params, ids, self.vocab_size),
        )
        if params.structured_outputs is not None:
            req.processors.append(self.grammars.processor(params.structured_outputs))
        if req.num_speculative_tokens:
            req.num_draft_nodes = self.proposer.num_draft_nodes(req.num_speculative_tokens)
        req.metrics.num_prompt_tokens = len(ids)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _request_k(self, use_speculation: bool, k: int | None) -> int:
        if not use_speculation:
            return 0
        if k is None:
            return self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise InvalidParameterError("num_speculative_tokens", k, f"must be an integer in [0, {MAX_SPECULATIVE_TOKENS}]")
        if k and self.proposer is None:
            raise InvalidParameterError("num_speculative_tokens", k, "needs an engine with a speculative_config (0 here)")
        return k

    def abort_request(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            req.abort()
            self._release(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def speculative(self) -> bool:
        return self.proposer is not None

    def stats(self) -> EngineStats:
        sched, pool = self.scheduler, self.scheduler.pool
        cache = pool.prefix_cache_stats()
        return EngineStats(
            num_running=len(sched.running), num_waiting=len(sched.waiting), num_requests=len(self.requests),
            num_kv_blocks=pool.num_blocks, num_kv_blocks_used=pool.num_blocks - pool.num_available_blocks,
            block_size=pool.block_size,
            prefix_cache_queried_blocks=cache.queried_blocks, prefix_cache_hit_blocks=cache.hit_blocks,
            num_preemptions=sched.num_preemptions, num_steps=self.num_steps,
            draft_depth_counts=tuple(self.planner.chosen) if self.planner else (),
            cost_model=self.cost.describe() if self.cost else "")

    # ---- one step --------------------------------------------------------------------------
    #
    # schedule -> execute -> update. `execute` computes every scheduled request's share in one
    # forward pass (prompt chunks, decode tokens and drafts flattened side by side) and
    # verifies it; nothing of a request changes there. `update` commits each share (tokens,
    # stop rules, log probabilities, proposer feedback) and hands the request's new progress to
    # the scheduler. An exception fails one request only, with finish_reason "error": a commit
    # is guarded per request, and when the batch itself fails, each request is computed again
    # alone to find the one it failed for.

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule(self.cost.predict if self.cost is not None else None)
        for r in sched.preempted:  # its draft state restarts with the recomputed request
            self._forget_drafts(r)
        if sched.empty:
            return []
        self.num_steps += 1
        return self.update(sched, self.execute(sched))

    def execute(self, sched: SchedulerOutput) -> list[_Computed | Exception]:
        """Each scheduled request's share of the step (in `sched.scheduled` order); for a
        request that failed alone, its exception."""
        scheduled = sched.scheduled
        try:
            return self._compute(scheduled, learn=True)
        except Exception as e:
            logger.warning("a step of %d request(s) failed (%s: %s); computing each alone to find the one it "
                           "failed for", len(scheduled), type(e).__name__, e)
            return [self._compute_alone(s) for s in scheduled]

    def _compute_alone(self, s: ScheduledRequest) -> _Computed | Exception:
        """The request's share computed in a batch of its own, from the state the step began
        in: nothing was committed, and the failed pass wrote KV only past computed lengths,
        where this pass writes again. Its noise depends only on (seed, position), so it draws
        the same numbers; it verifies the same draft."""
        try:
            return self._compute([s], learn=False)[0]
        except Exception as e:
            return e

    def _compute(self, scheduled: list[ScheduledRequest], learn: bool) -> list[_Computed]:
        """One forward pass -> verify, for these requests. Request i computes its uncomputed
        tokens (a prompt chunk, or the last token: the root) plus the nodes of the draft it
        carries (proposed at the end of its last step); a request that samples this step gets
        logits at its last token and every node."""
        reqs = [s.request for s in scheduled]
        trees = [_scheduled_tree(s) for s in scheduled]
        t1 = time.perf_counter()
        starts = [r.num_computed_tokens for r in reqs]
        tokens = [r.all_token_ids[c:c + s.num_new_tokens] + t.token_ids for r, s, c, t in zip(reqs, scheduled, starts, trees)]
        samples = [s.samples for s in scheduled]
        masks = [t.attention_mask() if t.num_nodes and not t.is_chain else None for t in trees]
        fb = ForwardBatch([self.scheduler.block_table(r) for r in reqs], starts, tokens, all_logits=False,
                          tree_masks=masks if any(m is not None for m in masks) else None, keep_hidden=self.keep_hidden,
                          aux_layers=self.hidden_layers)
        if self.before_forward is not None:
            self.before_forward()
        fwd = self.runner.forward_rows(fb, [1 + t.num_nodes if s else 0 for s, t in zip(samples, trees)])
        rows = [i for i, s in enumerate(samples) if s]
        raw: dict[int, torch.Tensor] = {}  # logprobs report the model's raw distribution
        for i in rows:
            if reqs[i].processors:  # rows [root, nodes...] rewritten as plain decoding would see them
                lo = fwd.logit_start[i]
                if reqs[i].params.logprobs is not None:
                    raw[i] = fwd.logits[lo:lo + 1 + trees[i].num_nodes].clone()
                apply_processors(reqs[i].processors, fwd.logits[lo:lo + 1 + trees[i].num_nodes], reqs[i].all_token_ids,
                                 trees[i])
        paths: dict[int, list[int]] = {}
        emitted: dict[int, list[int]] = {}
        # One argmax over the rows every sampling request has anyway (its root and nodes).
        argmax = argmax_rows(fwd.logits) if self.keep_predictions and rows else None  # [M]
        if rows:
            # The token the root's logits predict sits right after the tokens computed this step.
            positions = [starts[i] + scheduled[i].num_new_tokens for i in rows]
            out = verify_flat([trees[i] for i in rows], fwd.logits, [fwd.logit_start[i] for i in rows] + [fwd.logit_start[-1]],
                              [reqs[i].params for i in rows], [reqs[i].noise for i in rows], positions,
                              self.typical_acceptance)
            for j, i in enumerate(rows):
                paths[i] = out.accepted_nodes[j]
                emitted[i] = out.token_ids[j]
        # A tree's accepted path is moved to the slots right after the root, where the next
        # steps (and the prefix cache) expect the committed tokens; a chain's already is.
        moved = [(fb.locations[i], [starts[i] + 1 + n for n in p], list(range(starts[i] + 1, starts[i] + 1 + len(p))))
                 for i, p in paths.items() if p != list(range(len(p)))]
        if moved:
            self.runner.cache.move(*(list(m) for m in zip(*moved)))
        self.runner.synchronize()
        t2 = time.perf_counter()
        if learn and self.cost is not None:
            shape = PassShape(0)
            for c, toks in zip(starts, tokens):
                shape.add(len(toks), c)
            if self.planner is not None:
                # The drafting that made this step's drafts, by the deepest asked for: a floor
                # may have left every tree empty, and that drafting cost time all the same.
                drafted = [max(t.max_depth, s.request.draft_depth if s.decode else 0) for s, t in zip(scheduled, trees)]
                # A probe's drafting caught up on everything since the request last drafted:
                # the planner averages it apart from what a drafting step costs.
                self.planner.observe_step(shape, t2 - t1, self._drafting_s if any(drafted) else 0.0, max(drafted),
                                          probe=self._probe_drafted)
            else:
                self.cost.observe(shape, t2 - t1)
        decoding = [s.decode for s in scheduled]
        share = max(1, sum(decoding))
        computed = []
        for i, (r, s, t) in enumerate(zip(reqs, scheduled, trees)):
            p = paths.get(i, [])
            a, b = fwd.token_start[i], fwd.token_start[i + 1]
            hidden = None
            if fwd.hidden is not None:
                # A prompt chunk's every token; a decode's root and accepted path.
                hidden = fwd.hidden[a:b] if not s.decode else fwd.hidden[[a] + [a + 1 + n for n in p]]
            logits = None
            if i in emitted and r.params.logprobs is not None:
                lo = fwd.logit_start[i]
                # row j scored committed token j
                logits = raw[i][[0] + [1 + n for n in p]] if i in raw else fwd.logits[[lo] + [lo + 1 + n for n in p]]
            c = _Computed(emitted.get(i, []), logits, hidden, decode=s.decode, accepted_nodes=p,
                          num_draft=t.num_nodes, depth=t.max_depth, corrected=(p[-1] if p else -1) in t.parents,
                          asked_depth=r.draft_depth if s.decode else 0)
            if argmax is not None and i in emitted:
                c.node_predictions = argmax[fwd.logit_start[i]:fwd.logit_start[i + 1]]
            if s.decode:
                c.target_time_s = (t2 - t1) / share
            computed.append(c)
        return computed

    def _propose(self, scheduled: list[ScheduledRequest]) -> None:
        """Draft the next step's trees, at the end of this one, for every speculative request
        that sampled and goes on: each within its node budget (Request.max_draft_nodes), depth
        at most Request.max_depth; adaptive requests draft the depth the planner chooses for
        the next pass (estimated as this step's, its drafts left out). Chains come back as
        one-path trees. Proposers start tracking a request on its first proposal. A batch the
        proposer fails on is drafted again request by request, failing only the one it fails for."""
        self._drafting_s, self._probe_drafted = 0.0, False
        if self.disable_by_batch_size is not None and len(self.scheduler.running) >= self.disable_by_batch_size:
            return  # the next step decodes plainly (a proposer tracking hidden states still gets them)
        mml = self.config.max_model_len
        rows = [s for s in scheduled if s.samples and not s.request.finished and s.request.num_speculative_tokens > 0]
        if not rows:
            return
        depths = {s.request.request_id: s.request.max_depth(mml) for s in rows}
        planned = [s.request for s in rows if s.request.adaptive and depths[s.request.request_id] > 0]
        floor = 0.0
        if planned and self.planner is not None:
            # The next step's decodes, each its root. Prompt chunks are left out: their time
            # buys prompt tokens, not the committed tokens the plan counts, and a step that
            # carries a long chunk would make every draft row look nearly free beside it (EAGLE-3
            # with suffix decoding at 64 in flight on Spec-Bench drafted through the prompts'
            # steps: 0.91-0.96x plain over three rounds). A draft row costs about what it does in
            # a decode-only step, and a token it saves is worth that step's share.
            base = PassShape(0)
            for s in scheduled:
                r = s.request
                if not r.finished and s.samples:
                    base.add(1, r.num_computed_tokens)
            plan = self.planner.plan(base, [PlanRow(r.request_id, r.num_computed_tokens, depths[r.request_id])
                                            for r in planned])
            depths.update((r.request_id, d) for r, d in zip(planned, plan.depths))
            floor = plan.min_path_prob  # tree nodes less likely than this to be accepted cost more than they bring
        batch = []
        for s in rows:
            r, depth = s.request, depths[s.request.request_id]
            if depth > 0:
                slots = r.max_draft_nodes(mml)
                nodes = self.planner.nodes(depth, slots) if r.adaptive and self.planner is not None else slots
                batch.append(SpecRequest(r.request_id, r.all_token_ids, depth, r.params, r.noise, max_nodes=nodes,
                                         num_prompt_tokens=len(r.prompt_token_ids),
                                         min_path_prob=floor if r.adaptive else 0.0))
        if not batch:
            return
        t0 = time.perf_counter()
        try:
            trees = self._draft(batch)
        except Exception as e:
            logger.warning("proposer %r failed on a batch of %d request(s) (%s: %s); drafting each alone to find "
                           "the one it failed for", self.proposer.name, len(batch), type(e).__name__, e)
            trees = [self._guarded(self.requests[sr.request_id], self._draft, [sr]) for sr in batch]
            trees = [t[0] if t else None for t in trees]
        self._drafting_s = time.perf_counter() - t0
        self._probe_drafted = self.planner is not None and any(sr.request_id in self.planner.probing for sr in batch)
        for sr, tree in zip(batch, trees):
            r = self.requests[sr.request_id]
            r.spec.proposer_time_s += self._drafting_s / len(batch)
            if tree is not None and not r.finished:
                r.draft = self._guarded(r, _pruned, tree, r)
                r.draft_depth = sr.num_speculative_tokens if sr.min_path_prob > 0 else 0

    def _draft(self, batch: list[SpecRequest]) -> list[DraftTree]:
        """The proposer's trees for `batch`, checked against each request's bounds."""
        proposal = self.proposer.propose(batch)
        if isinstance(proposal, DraftProposal):
            proposal = proposal.as_trees()
        for tree, sr in zip(proposal.trees, batch):
            if tree.num_nodes > sr.max_nodes or tree.max_depth > sr.num_speculative_tokens:
                raise RuntimeError(f"proposer {self.proposer.name!r} drafted a tree of {tree.num_nodes} nodes and depth "
                                   f"{tree.max_depth} for request {sr.request_id!r}, which may have {sr.max_nodes} nodes "
                                   f"and depth {sr.num_speculative_tokens}")
        return list(proposal.trees)

    def update(self, sched: SchedulerOutput, computed: list[_Computed | Exception]) -> list[RequestOutput]:
        """Commit each request's share, hand its progress to the scheduler, and return the
        outputs of requests that sampled or finished."""
        feedback = VerifyFeedback([], [], [], [], [], [] if self.keep_predictions else None)
        for s, c in zip(sched.scheduled, computed):
            r = s.request
            r.draft, r.draft_depth = None, 0  # verified now, or (a prompt chunk) there was none
            if isinstance(c, Exception):
                self._fail(r, c)
                committed = 0
            else:
                committed = self._guarded(r, self._commit, s, c, feedback) or 0
            self._guarded(r, self.scheduler.update, s, committed)
        self._observe(feedback)
        if self.proposer is not None:
            self._propose(sched.scheduled)
        outputs = []
        for s in sched.scheduled:
            r = s.request
            if s.samples or r.finished:
                # A failed request's output reads no parameter, so it cannot fail again.
                outputs.append(self._guarded(r, self._output, r) or self._output(r))
        for s in sched.scheduled:
            if s.request.finished:
                self._release(s.request)
        return outputs

    def _commit(self, s: ScheduledRequest, c: _Computed, feedback: VerifyFeedback) -> int:
        """Apply one request's computed share: its tokens are appended under the stop rules,
        its hidden states and figures recorded. Returns the tokens committed (its progress is
        the scheduler's to move)."""
        r = s.request
        committed = []
        accepted = len(c.accepted_nodes)
        last = CORRECTED if c.corrected else BONUS if c.num_draft else PLAIN
        for j, tok in enumerate(c.token_ids):
            committed.append(tok)
            if r.append_token(tok, self.config.max_model_len, DRAFT if j < accepted else last):
                break
        for p in r.processors:
            p.commit(committed)
        if c.logits is not None:  # row j scored committed[j]
            r.logprobs.extend(token_logprobs(c.logits, committed, r.params.logprobs))
        if c.hidden is not None and r.num_speculative_tokens:
            self.proposer.observe_hidden(r.request_id, r.num_computed_tokens, c.hidden)
        if not c.decode:
            return len(committed)
        # A tree counts its depth as drafted (the most one pass can accept), so acceptance
        # by position reads as acceptance by depth.
        r.spec.record(c.depth, accepted, accepted + 1)
        r.spec.target_time_s += c.target_time_s
        if self.planner is not None and (c.asked_depth or c.depth):
            self.planner.observe_verification(r.request_id, c.asked_depth or c.depth, accepted, c.num_draft)
        if r.num_speculative_tokens:
            feedback.request_ids.append(r.request_id)
            feedback.num_draft.append(c.num_draft)
            feedback.num_accepted.append(accepted)
            feedback.committed_token_ids.append(committed)
            feedback.accepted_nodes.append(c.accepted_nodes)
            if feedback.node_predictions is not None:
                feedback.node_predictions.append(c.node_predictions or [])
        return len(committed)

    def _observe(self, feedback: VerifyFeedback) -> None:
        """Verification results to the proposer; if it fails on the batch, each request's
        results alone, so that only the request it fails on is failed."""
        if not (self.proposer and feedback.request_ids):
            return
        try:
            self.proposer.observe(feedback)
        except Exception:
            for i, rid in enumerate(feedback.request_ids):
                self._guarded(self.requests[rid], self.proposer.observe, feedback.row(i))

    def _guarded(self, req: Request, action, *args):
        """action(*args) on behalf of one request, which fails alone if it raises; None when
        it raised or the request had failed already."""
        if req.failed:
            return None
        try:
            return action(*args)
        except Exception as e:
            self._fail(req, e)
            return None

    def _fail(self, req: Request, error: Exception) -> None:
        """End a request its step failed for (a bug, or values that got past validation) with
        finish_reason "error"; its blocks are freed with the step's finished requests."""
        logger.error("request %s failed and ends with finish_reason 'error'; the engine goes on", req.request_id,
                     exc_info=error)
        req.fail(f"{type(error).__name__}: {error}")

    def _forget_drafts(self, req: Request) -> None:
        """Drop the proposer's state of a request and its draft (finished or preempted)."""
        req.draft, req.draft_depth = None, 0
        if self.planner is not None:
            self.planner.forget(req.request_id)
        if not (self.proposer and req.num_speculative_tokens):
            return
        try:
            self.proposer.remove_request(req.request_id)
        except Exception:  # a leak in the proposer must not fail the engine
            logger.exception("proposer %r failed to drop request %s", self.proposer.name, req.request_id)

    # ---- outputs ---------------------------------------------------------------------------

    def _release(self, req: Request) -> None:
        self.scheduler.finish(req)
        req.status = Status.FINISHED
        if req.metrics.finished_time is None:
            req.metrics.finished_time = time.perf_counter()
        self._forget_drafts(req)

    def _output(self, r: Request) -> RequestOutput:
        if r.finished and r.metrics.finished_time is None:
            r.metrics.finished_time = time.perf_counter()
        completion = CompletionOutput(0, r.text, list(r.output_token_ids), r.finish_reason, r.stop_reason,
                                      list(r.logprobs) if r.params.logprobs is not None else None, r.error,
                                      list(r.token_sources))
        new_text, new_pieces = r.take_new_text()
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [completion], r.finished,
                             r.metrics, r.spec, new_text=new_text, new_pieces=new_pieces)

    def output(self, request_id: str) -> RequestOutput:
        """The current output of a request the engine holds (e.g. an aborted one's last)."""
        return self._output(self.requests[request_id])

    def pop_finished(self, request_id: str) -> None:
        """Forget a finished request (its figures were handed out with its last output)."""
        req = self.requests.get(request_id)
        if req is not None and req.finished:
            del self.requests[request_id]


def token_logprobs(logits: torch.Tensor, tokens: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """logits [>= len(tokens), V] raw, row j scoring tokens[j] -> one TokenLogprob per token."""
    n = len(tokens)
    lp = torch.log_softmax(logits[:n].float(), dim=-1)  # [n, V]
    chosen = lp.gather(-1, torch.tensor(tokens, device=lp.device).unsqueeze(-1)).squeeze(-1).tolist()
    top_v, top_i = lp.topk(num_top, dim=-1) if num_top else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprob(t, c, tuple(zip(ids, vals))) for t, c, ids, vals in zip(tokens, chosen, top_i, top_v)]


def _scheduled_tree(s: ScheduledRequest) -> DraftTree:
    """The draft a scheduled request verifies: its first s.num_draft nodes (all of them unless
    the step's token budget cut it; a parent comes before its children, so they are a tree)."""
    tree = s.request.draft
    if not s.decode or not s.num_draft or tree is None:
        return DraftTree.empty()
    if s.num_draft >= tree.num_nodes:
        return tree
    return keep_nodes(tree, [n < s.num_draft for n in range(tree.num_nodes)])


def _pruned(tree: DraftTree, r: Request) -> DraftTree:
    """The tree less what the request's logits processors rule out (e.g. a grammar)."""
    for proc in r.processors:
        tree = proc.prune(tree, r.all_token_ids)
    return tree
