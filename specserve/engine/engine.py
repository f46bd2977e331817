"""The engine step: schedule -> execute -> update, with speculation as propose -> verify ->
accept -> commit inside the execute/update of a decode step."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from specserve.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from specserve.engine.request import Request, Status
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.kv.budget import num_kv_blocks
from specserve.engine.scheduler import ScheduledRequest, Scheduler
from specserve.errors import InvalidParameterError, PromptError
from specserve.model.loader import LoadedModel
from specserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from specserve.sample import SamplingTensors, VerifyOutput, make_generator, tree_verify, verify
from specserve.sample.typical import TypicalAcceptance
from specserve.sampling_params import SamplingParams
from specserve.drafts import DraftProposal, DraftTree, DraftTreeProposal, SpecRequest, VerifyFeedback
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
    proposer_time_s: float = 0.0  # this request's share of the step's drafting and target time
    target_time_s: float = 0.0


class LLMEngine:
    def __init__(self, target: LoadedModel, config: EngineConfig, proposer: Proposer | None = None,
                 num_speculative_tokens: int = 0, typical_acceptance: TypicalAcceptance | None = None):
        self.target = target
        # Set: sampled requests verify drafts with the typical rule (lossy, opt-in); chains are
        # then verified as one-path trees.
        self.typical_acceptance = typical_acceptance
        self.tokenizer = target.tokenizer
        self.config = config
        self.proposer = proposer
        self.num_speculative_tokens = num_speculative_tokens if proposer else 0
        self.keep_hidden = bool(proposer and proposer.needs_hidden_states)
        num_blocks = num_kv_blocks(target, config)
        self.runner = ModelRunner.paged(target.model, num_blocks, config.block_size)
        self.scheduler = Scheduler(config, num_blocks)
        self.requests: dict[str, Request] = {}

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
        bad = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise InvalidParameterError("stop_token_ids", bad[:5],
                                        f"must be token ids in [0, {self.vocab_size}) (the vocabulary)")

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
        params = dataclasses.replace(params)
        req = Request(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=ids,
            params=params,
            generator=make_generator(params.seed, self.runner.device),
            detokenizer=IncrementalDetokenizer(self.tokenizer, ids),
            eos_token_ids=self.tokenizer.eos_token_ids,
            num_speculative_tokens=self._request_k(use_speculation, num_speculative_tokens),
        )
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

    # ---- one step --------------------------------------------------------------------------
    #
    # A step computes every scheduled request's share first (_compute: one batched pass,
    # sampling, verification) and commits each afterwards (_commit: tokens, stop rules,
    # detokenization, log probabilities, proposer feedback). An exception fails one request
    # only, with finish_reason "error": a commit is guarded per request, and when the batch
    # itself fails, each request is computed again alone to find the one it failed for.

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        for r in sched.preempted:  # its draft state restarts with the recomputed request
            self._forget_drafts(r)
        if sched.empty:
            return []
        scheduled = sched.prefill + sched.decode
        samples = [s.samples for s in scheduled]  # asked before commits move the computed lengths
        feedback = VerifyFeedback([], [], [], [], [])
        for s, computed in zip(scheduled, self._compute(sched.prefill, sched.decode)):
            if isinstance(computed, Exception):
                self._fail(s.request, computed)
            else:
                self._guarded(s.request, self._commit, s, computed, feedback)
        self._observe(feedback)
        outputs = []
        for s, sampled in zip(scheduled, samples):
            r = s.request
            self._guarded(r, self.scheduler.update, r)
            if sampled or r.finished:
                # A failed request's output reads no parameter, so it cannot fail again.
                outputs.append(self._guarded(r, self._output, r) or self._output(r))
            if r.finished:
                self._release(r)
        return outputs

    def _compute(self, prefill: list[ScheduledRequest], decode: list[ScheduledRequest]) -> list[_Computed | Exception]:
        """Each scheduled request's share of the step, prefill chunks first; for a request that
        failed alone, its exception."""
        rng = [r.generator.get_state() if r.generator is not None and not r.params.greedy else None
               for r in (s.request for s in prefill + decode)]
        try:
            return (self._prefill(prefill) if prefill else []) + (self._decode(decode) if decode else [])
        except Exception as e:
            logger.warning("a step of %d request(s) failed (%s: %s); computing each alone to find the one it "
                           "failed for", len(rng), type(e).__name__, e)
            alone = [(s, False) for s in prefill] + [(s, True) for s in decode]
            return [self._compute_alone(s, is_decode, state) for (s, is_decode), state in zip(alone, rng)]

    def _compute_alone(self, s: ScheduledRequest, is_decode: bool,
                       rng_state: torch.Tensor | None) -> _Computed | Exception:
        """The request's share computed in a batch of its own, from the state the step began
        in: nothing was committed, and the failed pass wrote KV only past computed lengths,
        where this pass writes again. Its generator is rewound, so a seeded request draws the
        same numbers; the proposer's state, which a failed proposal may have left half-updated,
        is dropped and rebuilt from the committed tokens."""
        r = s.request
        try:
            if rng_state is not None:
                r.generator.set_state(rng_state)
            if is_decode:
                self._forget_drafts(r)
                return self._decode([s])[0]
            return self._prefill([s])[0]
        except Exception as e:
            return e

    def _prefill(self, chunks: list[ScheduledRequest]) -> list[_Computed]:
        """Prompt chunks (of new, resumed or preempted requests); a chunk that reaches the
        request's last token also samples its next token."""
        reqs = [s.request for s in chunks]
        fb = ForwardBatch([self.scheduler.block_table(r) for r in reqs], [r.num_computed_tokens for r in reqs],
                          [r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + s.num_new_tokens]
                           for r, s in zip(reqs, chunks)], all_logits=False, keep_hidden=self.keep_hidden)
        fwd = self.runner.forward_last(fb)
        logits = fwd.logits  # [B, 1, V]
        rows = [i for i, s in enumerate(chunks) if s.samples]
        sampled: dict[int, int] = {}
        if rows:
            out = self._verify([reqs[i] for i in rows], DraftProposal.empty(len(rows), logits.device), logits[rows])
            sampled = dict(zip(rows, out.output_token_ids[:, 0].tolist()))
        return [_Computed([sampled[i]] if i in sampled else [],
                          logits[i] if i in sampled and r.params.logprobs is not None else None,
                          None if fwd.hidden is None else fwd.hidden[i])  # hidden: [chunk, H]
                for i, r in enumerate(reqs)]

    def _decode(self, scheduled: list[ScheduledRequest]) -> list[_Computed]:
        reqs = [s.request for s in scheduled]
        slots = [s.num_draft for s in scheduled]
        t0 = time.perf_counter()
        proposal = self._propose(reqs, slots)
        t1 = time.perf_counter()
        if isinstance(proposal, DraftProposal) and self.typical_acceptance is not None:
            proposal = proposal.as_trees()
        if isinstance(proposal, DraftTreeProposal):
            computed = self._verify_trees(reqs, slots, proposal.trees)
        else:
            computed = self._verify_chains(reqs, proposal)
        self.runner.synchronize()
        t2 = time.perf_counter()
        for c in computed:
            c.proposer_time_s, c.target_time_s = (t1 - t0) / len(reqs), (t2 - t1) / len(reqs)
        return computed

    def _propose(self, reqs: list[Request], slots: list[int]) -> DraftProposal | DraftTreeProposal:
        """Drafts for the decoding requests within the slots the scheduler reserved
        (Request.max_drafts, cut to the step's token budget): a chain of at most slots[i]
        tokens, or a tree of at most slots[i] nodes and depth Request.max_depth. Proposers start
        tracking a request on its first proposal, so they hold state only for running requests."""
        device = self.runner.device
        spec_rows = [i for i, r in enumerate(reqs) if r.num_speculative_tokens > 0]
        if not spec_rows:
            return DraftProposal.empty(len(reqs), device)
        mml = self.config.max_model_len
        batch = [SpecRequest(reqs[i].request_id, reqs[i].all_token_ids, min(reqs[i].max_depth(mml), slots[i]),
                             reqs[i].params, reqs[i].generator, max_nodes=slots[i]) for i in spec_rows]
        proposal = self.proposer.propose(batch)
        if len(spec_rows) == len(reqs):
            return proposal
        if isinstance(proposal, DraftTreeProposal):
            trees = [DraftTree.empty() for _ in reqs]
            for j, i in enumerate(spec_rows):
                trees[i] = proposal.trees[j]
            return DraftTreeProposal(trees)
        return proposal.scatter(spec_rows, len(reqs))

    def _verify_chains(self, reqs: list[Request], proposal: DraftProposal) -> list[_Computed]:
        n_draft = proposal.num_draft.tolist()
        drafts = proposal.draft_token_ids.tolist()
        fb = ForwardBatch(
            [self.scheduler.block_table(r) for r in reqs],
            [r.num_computed_tokens for r in reqs],
            [r.all_token_ids[r.num_computed_tokens:] + drafts[i][: n_draft[i]] for i, r in enumerate(reqs)],
            all_logits=True, keep_hidden=self.keep_hidden,
        )
        fwd = self.runner.forward(fb)  # logits [B, 1 + k_max, V]
        out = self._verify(reqs, proposal, fwd.logits)
        tokens = out.output_token_ids.tolist()
        return [_Computed(tokens[i][: a + 1],
                          fwd.logits[i, : a + 1] if r.params.logprobs is not None else None,
                          None if fwd.hidden is None else fwd.hidden[i][: a + 1],
                          decode=True, accepted_nodes=list(range(a)), num_draft=n_draft[i], depth=n_draft[i])
                for i, (r, a) in enumerate(zip(reqs, out.num_accepted.tolist()))]

    def _verify_trees(self, reqs: list[Request], slots: list[int], trees: list[DraftTree]) -> list[_Computed]:
        """One pass over [root, nodes...] per request with tree masks; then the accepted path's
        keys and values are moved to the slots right after the root, where the next steps (and
        the prefix cache) expect the committed tokens."""
        for r, tree, n in zip(reqs, trees, slots):
            if tree.num_nodes > n or tree.max_depth > r.max_depth(self.config.max_model_len):
                raise RuntimeError(f"proposer {self.proposer.name!r} drafted a tree of {tree.num_nodes} nodes and depth "
                                   f"{tree.max_depth} for request {r.request_id!r}, which has {n} slots reserved "
                                   f"and room for depth {r.max_depth(self.config.max_model_len)}")
        tables = [self.scheduler.block_table(r) for r in reqs]
        starts = [r.num_computed_tokens for r in reqs]
        fb = ForwardBatch(tables, starts, [r.all_token_ids[r.num_computed_tokens:] + t.token_ids for r, t in zip(reqs, trees)],
                          all_logits=True, tree_masks=[t.attention_mask() if t.num_nodes else None for t in trees],
                          keep_hidden=self.keep_hidden)
        fwd = self.runner.forward(fb)  # logits [B, 1 + N_max, V]
        st = SamplingTensors.from_params([r.params for r in reqs], fwd.logits.device)
        out = tree_verify(trees, fwd.logits, st, [r.generator for r in reqs], self.typical_acceptance)
        paths = out.accepted_nodes
        # Node i's entry sits at slot start + 1 + i; path entry j belongs at start + 1 + j.
        moved = [(t, [s + 1 + n for n in p], list(range(s + 1, s + 1 + len(p))))
                 for t, s, p in zip(tables, starts, paths) if p != list(range(len(p)))]
        if moved:
            self.runner.cache.move(*(list(m) for m in zip(*moved)))
        tokens = out.output_token_ids.tolist()
        rows = [[0] + [n + 1 for n in p] for p in paths]  # the root, then the accepted path
        return [_Computed(tokens[i][: len(p) + 1],
                          fwd.logits[i, rows[i]] if r.params.logprobs is not None else None,
                          None if fwd.hidden is None else fwd.hidden[i][rows[i]],
                          decode=True, accepted_nodes=p, num_draft=t.num_nodes, depth=t.max_depth)
                for i, (r, t, p) in enumerate(zip(reqs, trees, paths))]

    def _verify(self, reqs: list[Request], proposal: DraftProposal, logits: torch.Tensor) -> VerifyOutput:
        st = SamplingTensors.from_params([r.params for r in reqs], logits.device)
        return verify(proposal.draft_token_ids.to(logits.device), proposal.num_draft.to(logits.device),
                      proposal.draft_probs, logits, st, [r.generator for r in reqs])

    def _commit(self, s: ScheduledRequest, c: _Computed, feedback: VerifyFeedback) -> None:
        """Apply one request's computed share: its chunk or root becomes computed, its tokens
        are appended under the stop rules, and a decode step's figures are recorded."""
        r = s.request
        start = r.num_computed_tokens  # the chunk's first position, or the root's
        r.num_computed_tokens += s.num_new_tokens
        committed = []
        for tok in c.token_ids:
            committed.append(tok)
            if r.append_token(tok, self.config.max_model_len):
                break
        if committed:
            # KV entries of rejected drafts stay past this count until the scheduler frees
            # their slots; they are rewritten before any query can see them.
            r.num_computed_tokens = r.num_tokens - 1
        if c.logits is not None:  # row j scored committed[j]
            r.logprobs.extend(token_logprobs(c.logits, committed, r.params.logprobs))
        if c.hidden is not None and r.num_speculative_tokens:
            self.proposer.observe_hidden(r.request_id, start, c.hidden)
        if not c.decode:
            return
        accepted = len(c.accepted_nodes)
        # A tree counts its depth as drafted (the most one pass can accept), so acceptance
        # by position reads as acceptance by depth.
        r.spec.record(c.depth, accepted, accepted + 1)
        r.spec.proposer_time_s += c.proposer_time_s
        r.spec.target_time_s += c.target_time_s
        if r.num_speculative_tokens:
            feedback.request_ids.append(r.request_id)
            feedback.num_draft.append(c.num_draft)
            feedback.num_accepted.append(accepted)
            feedback.committed_token_ids.append(committed)
            feedback.accepted_nodes.append(c.accepted_nodes)

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
        """Drop the proposer's state of a request (finished, preempted, or computed again)."""
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
                                      list(r.logprobs) if r.params.logprobs is not None else None, r.error)
        return RequestOutput(r.request_id, r.prompt, r.prompt_token_ids, [completion], r.finished,
                             r.metrics, r.spec, new_text=r.take_new_text())

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
