"""The engine step: schedule -> execute -> update, with speculation as propose -> verify ->
accept -> commit inside the execute/update of a decode step."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.config import MAX_SPECULATIVE_TOKENS, EngineConfig
from specserve.engine.request import Request, Status
from specserve.engine.runner import ForwardBatch, ModelRunner
from specserve.engine.kv_budget import num_kv_blocks
from specserve.engine.scheduler import ScheduledRequest, Scheduler
from specserve.errors import InvalidParameterError, PromptError
from specserve.model.loader import LoadedModel
from specserve.outputs import CompletionOutput, RequestOutput, TokenLogprob
from specserve.sample import SamplingTensors, VerifyOutput, make_generator, tree_verify, verify
from specserve.sample.typical import TypicalAcceptance
from specserve.sampling_params import SamplingParams
from specserve.spec import DraftProposal, DraftTree, DraftTreeProposal, Proposer, SpecRequest, VerifyFeedback
from specserve.tokenizer import IncrementalDetokenizer


@dataclass(slots=True)
class _Verified:
    """One verification pass on the host, per decoding request, chains and trees alike."""

    token_ids: list[list[int]]  # the accepted drafts, then the recovered or bonus token
    accepted_nodes: list[list[int]]  # indices of the accepted drafts (a chain's 0..a-1, a tree's path)
    num_draft: list[int]  # drafts scored (a tree's node count)
    depth: list[int]  # the most that could be accepted (a chain's length, a tree's depth)
    # [a + 1, H] target hidden states at the root and the accepted drafts; None unless the
    # proposer needs hidden states.
    hidden: list[torch.Tensor] | None
    # [a + 1, V] raw target logits that scored each committed token, for requests asking for
    # log probabilities (None for the others).
    logits: list[torch.Tensor | None]


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

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams,
                    prompt: str | None = None, use_speculation: bool = True,
                    num_speculative_tokens: int | None = None) -> Request:
        """Queue a request. `num_speculative_tokens` overrides the engine's k for this request
        (0: plain decoding); requests with different k, or none, share the same steps."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(prompt_token_ids)
        if not ids:
            raise PromptError("the prompt is empty; give at least one token of text")
        limit = self.config.max_model_len
        if len(ids) >= limit:
            raise PromptError(
                f"the prompt has {len(ids)} tokens but the context is {limit} tokens (max_model_len), "
                "which must also leave room for at least one generated token"
            )
        vocab = self.target.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
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
        if not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
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

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if self.proposer:
            for r in sched.preempted:  # its draft state restarts with the recomputed request
                self.proposer.remove_request(r.request_id)
        if sched.empty:
            return []
        if sched.prefill:
            self._prefill(sched.prefill)
        if sched.decode:
            self._decode(sched.decode)
        outputs = []
        for s in sched.prefill + sched.decode:
            r = s.request
            self.scheduler.update(r)
            if s.samples or r.finished:
                outputs.append(self._output(r))
            if r.finished:
                self._release(r)
        return outputs

    def _prefill(self, chunks: list[ScheduledRequest]) -> None:
        """Prompt chunks (of new, resumed or preempted requests); a chunk that reaches the
        request's last token also samples its next token."""
        reqs = [s.request for s in chunks]
        starts = [r.num_computed_tokens for r in reqs]
        fb = ForwardBatch([self.scheduler.block_table(r) for r in reqs], starts,
                          [r.all_token_ids[r.num_computed_tokens:r.num_computed_tokens + s.num_new_tokens]
                           for r, s in zip(reqs, chunks)], all_logits=False, keep_hidden=self.keep_hidden)
        fwd = self.runner.forward_last(fb)
        logits = fwd.logits  # [B, 1, V]
        if fwd.hidden is not None:
            for r, start, hidden in zip(reqs, starts, fwd.hidden):  # hidden: [chunk, H]
                if r.num_speculative_tokens:
                    self.proposer.observe_hidden(r.request_id, start, hidden)
        rows = [i for i, s in enumerate(chunks) if s.samples]
        out = None
        if rows:
            sampling = [reqs[i] for i in rows]
            out = self._verify(sampling, DraftProposal.empty(len(rows), logits.device), logits[rows])
        for i, (r, s) in enumerate(zip(reqs, chunks)):
            r.num_computed_tokens += s.num_new_tokens
        for j, i in enumerate(rows):
            r = reqs[i]
            tok = int(out.output_token_ids[j, 0])
            r.append_token(tok, self.config.max_model_len)
            r.num_computed_tokens = r.num_tokens - 1
            if r.params.logprobs is not None:
                r.logprobs.extend(token_logprobs(logits[i], [tok], r.params.logprobs))

    def _decode(self, scheduled: list[ScheduledRequest]) -> None:
        reqs = [s.request for s in scheduled]
        slots = [s.num_draft for s in scheduled]
        t0 = time.perf_counter()
        proposal = self._propose(reqs, slots)
        t1 = time.perf_counter()
        if isinstance(proposal, DraftProposal) and self.typical_acceptance is not None:
            proposal = proposal.as_trees()
        if isinstance(proposal, DraftTreeProposal):
            verified = self._verify_trees(reqs, slots, proposal.trees)
        else:
            verified = self._verify_chains(reqs, proposal)
        self.runner.synchronize()
        t2 = time.perf_counter()
        self._commit(reqs, verified, proposer_time=(t1 - t0) / len(reqs), target_time=(t2 - t1) / len(reqs))

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

    def _verify_chains(self, reqs: list[Request], proposal: DraftProposal) -> _Verified:
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
        accepted = out.num_accepted.tolist()
        return _Verified(
            token_ids=[t[: a + 1] for t, a in zip(tokens, accepted)],
            accepted_nodes=[list(range(a)) for a in accepted],
            num_draft=n_draft, depth=n_draft,
            hidden=None if fwd.hidden is None else [h[: a + 1] for h, a in zip(fwd.hidden, accepted)],
            logits=[fwd.logits[i, : a + 1] if r.params.logprobs is not None else None
                    for i, (r, a) in enumerate(zip(reqs, accepted))],
        )

    def _verify_trees(self, reqs: list[Request], slots: list[int], trees: list[DraftTree]) -> _Verified:
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
        return _Verified(
            token_ids=[t[: len(p) + 1] for t, p in zip(tokens, paths)],
            accepted_nodes=paths,
            num_draft=[t.num_nodes for t in trees], depth=[t.max_depth for t in trees],
            hidden=None if fwd.hidden is None else [h[[0] + [n + 1 for n in p]] for h, p in zip(fwd.hidden, paths)],
            logits=[fwd.logits[i, [0] + [n + 1 for n in p]] if r.params.logprobs is not None else None
                    for i, (r, p) in enumerate(zip(reqs, paths))],
        )

    def _verify(self, reqs: list[Request], proposal: DraftProposal, logits: torch.Tensor) -> VerifyOutput:
        st = SamplingTensors.from_params([r.params for r in reqs], logits.device)
        return verify(proposal.draft_token_ids.to(logits.device), proposal.num_draft.to(logits.device),
                      proposal.draft_probs, logits, st, [r.generator for r in reqs])

    def _commit(self, reqs: list[Request], verified: _Verified, proposer_time: float, target_time: float) -> None:
        feedback = VerifyFeedback([], [], [], [], [])
        for i, r in enumerate(reqs):
            start = r.num_computed_tokens  # the root's position
            committed = []
            for tok in verified.token_ids[i]:
                committed.append(tok)
                if r.append_token(tok, self.config.max_model_len):
                    break
            # KV entries of rejected drafts stay past this count until the scheduler frees
            # their slots; they are rewritten before any query can see them.
            r.num_computed_tokens = r.num_tokens - 1
            if r.params.logprobs is not None:  # row j scored committed[j]
                r.logprobs.extend(token_logprobs(verified.logits[i], committed, r.params.logprobs))
            accepted = len(verified.accepted_nodes[i])
            # A tree counts its depth as drafted (the most one pass can accept), so acceptance
            # by position reads as acceptance by depth.
            r.spec.record(verified.depth[i], accepted, accepted + 1)
            r.spec.proposer_time_s += proposer_time
            r.spec.target_time_s += target_time
            if r.num_speculative_tokens:
                if verified.hidden is not None:
                    self.proposer.observe_hidden(r.request_id, start, verified.hidden[i])
                feedback.request_ids.append(r.request_id)
                feedback.num_draft.append(verified.num_draft[i])
                feedback.num_accepted.append(accepted)
                feedback.committed_token_ids.append(committed)
                feedback.accepted_nodes.append(verified.accepted_nodes[i])
        if self.proposer and feedback.request_ids:
            self.proposer.observe(feedback)

    # ---- outputs ---------------------------------------------------------------------------

    def _release(self, req: Request) -> None:
        self.scheduler.finish(req)
        req.status = Status.FINISHED
        if req.metrics.finished_time is None:
            req.metrics.finished_time = time.perf_counter()
        if self.proposer and req.num_speculative_tokens:
            self.proposer.remove_request(req.request_id)

    def _output(self, r: Request) -> RequestOutput:
        if r.finished and r.metrics.finished_time is None:
            r.metrics.finished_time = time.perf_counter()
        completion = CompletionOutput(0, r.text, list(r.output_token_ids), r.finish_reason, r.stop_reason,
                                      list(r.logprobs) if r.params.logprobs is not None else None)
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
