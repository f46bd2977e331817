"""Draft-model proposer: a smaller model of the same tokenizer drafts k tokens
autoregressively on its own paged KV cache. A sampled request's draft for sequence position t is
race(q_t, E_t) with the request's own noise at t, the noise the verifier races the target's p_t
with (a Gumbel-max coupling): the draft is accepted exactly when the two races agree, so the
verifier needs no draft probabilities."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.config import EngineConfig
from specserve.kv.block_manager import BlockPool, KVCacheManager
from specserve.kv.budget import num_kv_blocks
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.errors import InvalidParameterError
from specserve.model.loader import LoadedModel, load_model
from specserve.sample import SamplingTensors, processed_probs, race_rows
from specserve.drafts import DraftProposal, SpecRequest
from specserve.spec.proposer import Proposer
from specserve.spec.registry import MethodSpec

logger = logging.getLogger("specserve.spec")


def vocabulary_difference(draft: LoadedModel, target: LoadedModel) -> str | None:
    """Why draft and target token ids do not name the same tokens (None: they do, so q and p
    describe the same tokens and drafts pass between them as ids)."""
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        return f"the draft model's vocabulary has {dv} tokens but the target's has {tv}"
    dt, tt = draft.tokenizer, target.tokenizer
    n = min(dt.vocab_size, tt.vocab_size)
    probe = sorted(set(range(0, n, max(1, n // 512))) | set(dt.eos_token_ids) | set(tt.eos_token_ids))
    diff = [i for i in probe if dt.id_to_token(i) != tt.id_to_token(i)]
    if dt.vocab_size != tt.vocab_size or diff:
        return f"the draft model's tokenizer differs from the target's (e.g. token id {diff[0] if diff else n})"
    return None


class DraftModelProposer(Proposer):
    """Drafts on the draft model's own paged KV pool, one batched forward pass per draft position.

    The pool is the draft's alone (its blocks have the draft's, smaller, shape), with as many
    blocks as the target's pool. Prefix caching is off: the draft recomputes a shared prompt,
    which costs one small prefill, and so never has to hash tokens or track shared blocks.
    """

    name = "draft_model"

    def __init__(self, draft: LoadedModel, target: LoadedModel, engine: EngineConfig, same_vocabulary: bool = True,
                 catch_up_window: int | None = None):
        """same_vocabulary=False: the caller maps tokens across vocabularies itself (cross_vocab.py).
        catch_up_window None: the draft cache always catches up on every committed token. A
        number W: when the cache is more than W tokens behind (drafting was off for a while, or
        the prompt was never drafted from), it restarts from the last W committed tokens instead,
        renumbered from position 0 (RoPE scores depend on relative positions only, so that is the
        model reading those W tokens alone). Drafts are proposals, so the output is unchanged;
        what is bounded is the price of a probe after a long pause."""
        self.catch_up_window = catch_up_window
        if same_vocabulary and (why := vocabulary_difference(draft, target)):
            raise InvalidParameterError("speculative_config.model", str(draft.path),
                                        f"{why}; a draft model must use the target's tokenizer here")
        if draft.model.max_positions < engine.max_model_len:
            raise InvalidParameterError(
                "max_model_len", engine.max_model_len,
                f"must be <= the draft model's context ({draft.model.max_positions})",
            )
        self.draft = draft
        # The target's block count, computed from the target: under kv_cache_memory the budget
        # sizes the target's pool, and the draft's pool of as many (smaller) blocks comes on top.
        # It holds a request at max_model_len, so no proposal is ever larger than the pool.
        num_blocks = num_kv_blocks(target, engine)
        self.runner = ModelRunner.paged(draft.model, num_blocks, engine.block_size)
        self.kv = KVCacheManager(BlockPool(num_blocks, engine.block_size, enable_prefix_caching=False))
        # Tokens whose KV the draft cache holds for each request, in order (its computed length
        # in self.kv once the pass feeding them has run). Comparing them with the committed
        # tokens tells how much survives verification: the rest is rolled back.
        self.cached: dict[str, list[int]] = {}
        # Where each request's draft cache starts in its token sequence (0 unless restarted
        # from a window): the cache holds token_ids[base:] at positions 0, 1, ...
        self.base: dict[str, int] = {}

    @property
    def pool(self) -> BlockPool:
        return self.kv.pool

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        if request_id not in self.kv:
            self.kv.get_computed_blocks(request_id, prompt_token_ids)  # no prefix cache: nothing computed
            self.cached[request_id] = []
            self.base[request_id] = 0

    def remove_request(self, request_id: str) -> None:
        if request_id in self.kv:
            self.kv.free(request_id)
            del self.cached[request_id]
            self.base.pop(request_id, None)

    def _catch_up(self, r: SpecRequest) -> tuple[int, list[int]] | None:
        """Roll the request's draft cache back to what verification confirmed and reserve the
        slots of this whole proposal: the tokens committed since the last one (the whole prompt
        the first time), then k - 1 drafts (the last draft is never fed). -> (start, tokens to
        feed first), or None when the pool is short of blocks."""
        rid, base = r.request_id, self.base[r.request_id]
        tokens = list(r.token_ids)
        keep = min(_common_prefix(tokens[base:], self.cached[rid]), len(tokens) - base - 1)  # always feed the last token
        window = self.catch_up_window
        if window is not None and len(tokens) - base - keep > window:
            base = self.base[rid] = len(tokens) - window
            keep = 0
        self.kv.rollback(rid, keep)
        if not self.kv.allocate_slots(rid, len(tokens) - base - keep + r.num_speculative_tokens - 1):
            # The draft pool is as large as the target's, but the target shares prompt blocks
            # between requests (prefix caching) and the draft does not, so it can run out while
            # the target runs on. Drafting is optional: this request takes a plain decode step,
            # and gives its draft blocks back, because requests that each keep part of the pool
            # could all stay short of it until one finishes; given back, the others can draft.
            self.kv.rollback(rid, 0)
            self.cached[rid] = []
            self.base[rid] = 0
            return None
        self.cached[rid] = tokens[base:]
        return keep, tokens[base + keep:]

    @torch.inference_mode()
    def propose(self, batch: list[SpecRequest]) -> DraftProposal:
        device = self.runner.device
        rows, starts, feeds = [], [], []
        for i, r in enumerate(batch):
            if r.num_speculative_tokens > 0:
                self.add_request(r.request_id, r.token_ids)
                caught_up = self._catch_up(r)
                if caught_up is not None:
                    rows.append(i)
                    starts.append(caught_up[0])
                    feeds.append(caught_up[1])
        if not rows:
            return DraftProposal.empty(len(batch), device)
        reqs = [batch[i] for i in rows]
        k_max = max(r.num_speculative_tokens for r in reqs)
        st = SamplingTensors.from_params([r.sampling for r in reqs], device)
        draft_ids = torch.full((len(batch), k_max), -1, dtype=torch.long, device=device)

        # Pass 0 feeds the catch-up tokens, each later pass the previous pass's draft.
        active = list(range(len(reqs)))
        for step in range(k_max):
            rids = [reqs[a].request_id for a in active]
            fb = ForwardBatch([self.kv.block_table(rid) for rid in rids], starts, feeds, all_logits=False)
            logits = self.runner.execute_last(fb)[:, 0]  # [A, V]
            for rid, s, f in zip(rids, starts, feeds):
                self.kv.commit(rid, self.cached[rid], s + len(f))
            sub = st.select(active)
            q = processed_probs(logits, sub)  # [A, V]; one-hot on greedy rows, which race to their argmax
            picked = race_rows(q, sub.greedy_rows, [reqs[a].noise for a in active],
                               [len(reqs[a].token_ids) + step for a in active]).tolist()  # [A]
            for j, a in enumerate(active):
                draft_ids[rows[a], step] = picked[j]
            still = [j for j, a in enumerate(active) if step + 1 < reqs[a].num_speculative_tokens]
            for j in still:
                # The drafted token enters the draft cache; if rejected it is rolled back by
                # the common-prefix check of the next proposal.
                self.cached[rids[j]].append(picked[j])
            starts = [starts[j] + len(feeds[j]) for j in still]
            feeds = [[picked[j]] for j in still]
            active = [active[j] for j in still]
            if not active:
                break
        num_draft = [0] * len(batch)
        for i in rows:
            num_draft[i] = batch[i].num_speculative_tokens
        return DraftProposal(draft_token_ids=draft_ids,
                             num_draft=torch.tensor(num_draft, dtype=torch.long, device=device))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    # Verification only ever changes the tail, so the whole-prefix comparison (one C-level
    # list compare) settles it almost always; the loop runs only past a divergence.
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i



def check_catch_up_window(w: object) -> None:
    if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
        raise InvalidParameterError("speculative_config.catch_up_window", w, "must be an integer >= 1 or null")


@dataclass(frozen=True, slots=True)
class DraftModelOptions:
    """speculative_config's draft_model keys (the draft model's path is its "model").
    catch_up_window: when drafting resumes more than this many tokens behind (the prompt, or a
    pause the planner made), the draft reads only the last this-many tokens
    (DraftModelProposer.catch_up_window); None (the default) catches up on everything: the
    draft reads the whole prompt, which a draft that pays wants, at the price of a pass over it
    and over every pause for one that does not."""

    catch_up_window: int | None = None

    def __post_init__(self) -> None:
        check_catch_up_window(self.catch_up_window)


def _build(options: DraftModelOptions, model: str | None, target: LoadedModel,
           engine: EngineConfig) -> Proposer:
    # The draft runs on the target's path: the native kernels for a native target (its own
    # blocks if it is a quantized GGUF, else the target's int8 / int4), else the torch path in
    # the target's dtype.
    if getattr(target.model, "native", False):
        mode = target.model.quantization
        draft = load_model(model, device=target.model.device, quantization="auto" if mode == "gguf" else mode,
                           max_model_len=engine.max_model_len)
    else:
        draft = load_model(model, dtype=target.model.dtype, device=target.model.device, quantization="none",
                           max_model_len=engine.max_model_len)
    why = vocabulary_difference(draft, target)
    if why is None:
        return DraftModelProposer(draft, target, engine, catch_up_window=options.catch_up_window)
    from specserve.spec.cross_vocab import CrossVocabularyProposer  # (it builds on this module)

    logger.info("%s: drafting through text (re-tokenized each step; lossless, see spec/cross_vocab.py)", why)
    return CrossVocabularyProposer(draft, target, engine, catch_up_window=options.catch_up_window)


# A draft model drafts one token per small pass, so its cap is lower than n-gram's.
METHOD = MethodSpec("draft_model", DraftModelOptions, _build, auto_max_k=6,
                    needs_model="method 'draft_model' needs the draft model's path")
