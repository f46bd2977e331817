"""Draft-model proposer: a smaller model of the same tokenizer family drafts k tokens
autoregressively on its own KV cache, keeping its probabilities q for the verifier."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.config import EngineConfig
from specserve.engine.runner import ForwardBatch, ModelRunner
from specserve.errors import InvalidParameterError
from specserve.model.loader import LoadedModel
from specserve.sample import SamplingTensors, processed_probs
from specserve.spec.proposer import DraftProposal, Proposer, SpecRequest


def check_same_vocabulary(draft: LoadedModel, target: LoadedModel) -> None:
    """Draft and target must agree on every token id, or q and p describe different tokens."""
    dv, tv = draft.config.vocab_size, target.config.vocab_size
    if dv != tv:
        raise InvalidParameterError(
            "speculative_config.model", str(draft.path),
            f"the draft model's vocabulary has {dv} tokens but the target's has {tv}; "
            "a draft model must use the target's tokenizer",
        )
    dt, tt = draft.tokenizer, target.tokenizer
    n = min(dt.vocab_size, tt.vocab_size)
    probe = sorted(set(range(0, n, max(1, n // 512))) | set(dt.eos_token_ids) | set(tt.eos_token_ids))
    diff = [i for i in probe if dt.id_to_token(i) != tt.id_to_token(i)]
    if dt.vocab_size != tt.vocab_size or diff:
        raise InvalidParameterError(
            "speculative_config.model", str(draft.path),
            f"the draft model's tokenizer differs from the target's (e.g. token id {diff[0] if diff else n}); "
            "a draft model must use the target's tokenizer",
        )


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, draft: LoadedModel, target: LoadedModel, engine: EngineConfig):
        check_same_vocabulary(draft, target)
        if draft.config.max_position_embeddings < engine.max_model_len:
            raise InvalidParameterError(
                "max_model_len", engine.max_model_len,
                f"must be <= the draft model's context ({draft.config.max_position_embeddings})",
            )
        self.draft = draft
        self.runner = ModelRunner.dense(draft.model, engine.max_num_seqs, engine.max_model_len)
        self.free_slots = list(range(engine.max_num_seqs - 1, -1, -1))
        self.slot: dict[str, int] = {}
        # Tokens whose KV the draft cache holds for each request, in order. Comparing them with
        # the committed tokens tells how much survives verification: the rest is rolled back.
        self.cached: dict[str, list[int]] = {}

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        if request_id not in self.slot:
            self.slot[request_id] = self.free_slots.pop()
            self.cached[request_id] = []

    def remove_request(self, request_id: str) -> None:
        if request_id in self.slot:
            self.free_slots.append(self.slot.pop(request_id))
            del self.cached[request_id]

    @torch.inference_mode()
    def propose(self, batch: list[SpecRequest]) -> DraftProposal:
        device = self.runner.device
        k_max = max((r.num_speculative_tokens for r in batch), default=0)
        rows = [i for i, r in enumerate(batch) if r.num_speculative_tokens > 0]
        if not rows:
            return DraftProposal.empty(len(batch), device)
        for i in rows:
            self.add_request(batch[i].request_id, batch[i].token_ids)
        reqs = [batch[i] for i in rows]
        st = SamplingTensors.from_params([r.sampling for r in reqs], device)
        vocab = self.draft.config.vocab_size
        draft_ids = torch.full((len(batch), k_max), -1, dtype=torch.long, device=device)
        draft_probs = torch.zeros(len(batch), k_max, vocab, dtype=torch.float32, device=device)

        # First pass: catch up on the tokens committed since the last proposal (the whole prompt
        # the first time), keeping the cache entries that verification confirmed.
        starts, feeds = [], []
        for r in reqs:
            tokens, cached = list(r.token_ids), self.cached[r.request_id]
            keep = _common_prefix(tokens, cached)
            keep = min(keep, len(tokens) - 1)  # always feed at least the last token
            starts.append(keep)
            feeds.append(tokens[keep:])
            self.cached[r.request_id] = tokens
        active = list(range(len(reqs)))
        for step in range(k_max):
            logits = self.runner.execute(ForwardBatch([self.slot[reqs[a].request_id] for a in active],
                                                      starts, feeds, all_logits=False))[:, 0]  # [A, V]
            sub = st.select(active)
            q = processed_probs(logits, sub)  # [A, V]
            picked = _sample(q, [reqs[a].generator for a in active])
            for j, a in enumerate(active):
                draft_ids[rows[a], step] = picked[j]
                draft_probs[rows[a], step] = q[j]
            still = [j for j, a in enumerate(active) if step + 1 < reqs[a].num_speculative_tokens]
            for j in still:
                # The drafted token enters the draft cache; if rejected it is rolled back by
                # the common-prefix check of the next proposal.
                self.cached[reqs[active[j]].request_id].append(int(picked[j]))
            starts = [starts[j] + len(feeds[j]) for j in still]
            feeds = [[int(picked[j])] for j in still]
            active = [active[j] for j in still]
            if not active:
                break
        num_draft = torch.tensor([r.num_speculative_tokens for r in batch], dtype=torch.long, device=device)
        return DraftProposal(draft_token_ids=draft_ids, num_draft=num_draft, draft_probs=draft_probs)


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


def _sample(q: torch.Tensor, generators: list[torch.Generator | None]) -> list[int]:
    """One token per row of q [A, V] (greedy rows of q are one-hot, so this is their argmax)."""
    out = []
    for row, g in zip(q, generators):
        out.append(int(torch.multinomial(row, 1, generator=g)) if row.max() < 1.0 else int(row.argmax()))
    return out
