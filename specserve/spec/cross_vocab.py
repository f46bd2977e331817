"""Drafting across tokenizers: a draft model whose vocabulary differs from the target's (say
SmolLM2-135M, 49k tokens, drafting for Gemma 3 270M, 262k), through text.

Each step, for each request: the committed target tokens become text (the target's detokenizer,
special tokens kept), the text becomes the draft's tokens (the draft's tokenizer), the draft
model drafts greedily on its own paged KV (DraftModelProposer's machinery: the draft tokens
that survive from the last step keep their cache), its new tokens become text, and that text
becomes target tokens again: re-tokenized together with the last few committed target tokens,
so that a word the draft continues is split as the target would split it, and kept only where
that re-tokenization reproduces the committed tokens (then the draft is what follows them).
The result is a chain of target token ids, verified like any other.

Why this is lossless for every request, greedy or sampled: the verifier accepts a draft token
exactly when it equals the token the target itself samples at that position with the
request's noise (the Gumbel-max race, sample/verify), so every committed token is the target's
own, whatever was drafted; drafts only decide how many positions one pass can accept. This is
the string-level exact match of "Accelerating LLM Inference with Lossless Speculative Decoding
Algorithms for Heterogeneous Vocabularies" (ICML 2025, SLEM), with the draft's greedy text as
the proposal: a draft token chosen without the target's noise is accepted with probability
p(token), which the draft's best guess maximises. Their token-level intersection method (TLI),
which samples the draft from its distribution restricted to the shared tokens, needs draft
probabilities in the target's vocabulary and is not implemented.

A character cut mid-way: a byte-fallback tokenizer (Gemma's SentencePiece) spells a character
its vocabulary lacks as byte tokens (<0xF0><0x9D><0x94><0x98>), and while the last of them is
missing the committed text ends in U+FFFD, often several (Hugging Face's byte-fallback decoder
turns a whole run of byte tokens that is not valid UTF-8 into one U+FFFD a byte, characters that
were complete included). Those trailing tokens are held back: the draft continues the text up to
its last whole character, and its target tokens must begin with the held tokens, which are then
dropped (else that step has no draft).

Costs that same-vocabulary drafting has not: detokenizing and re-tokenizing the context each
step (linear in the context: 1.25 ms per 1,000 tokens for SmolLM2's tokenizer on this project's
2-core CPU, measured busy), and drafts the target splits differently (a draft word cut mid-way
at the chain's end is often rejected).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specserve.config import EngineConfig
from specserve.drafts import DraftProposal, SpecRequest
from specserve.model.loader import LoadedModel
from specserve.sampling_params import SamplingParams
from specserve.spec.draft_model import DraftModelProposer
from specserve.spec.proposer import Proposer

# Committed target tokens re-tokenized with the draft's text (the most tried; fewer when their
# re-tokenization does not reproduce them): enough for a word split over several tokens.
TAIL_TOKENS = 4
# Committed target tokens at most held back from the draft's context: the bytes of one character
# not yet complete (UTF-8 spends at most 4 bytes on a character, so 3 are the most missing one).
MAX_HELD = 3
_GREEDY = SamplingParams(temperature=0.0)


class CrossVocabularyProposer(Proposer):
    """A draft model of another tokenizer, drafting through text (module note)."""

    name = "draft_model"

    def __init__(self, draft: LoadedModel, target: LoadedModel, engine: EngineConfig,
                 catch_up_window: int | None = None):
        self.inner = DraftModelProposer(draft, target, engine, same_vocabulary=False, catch_up_window=catch_up_window)
        self.draft_tok, self.target_tok = draft.tokenizer, target.tokenizer
        self.target_vocab = min(target.config.vocab_size, target.tokenizer.vocab_size)
        self.draft_len = engine.max_model_len  # the draft's pool holds this many tokens a request
        self.target_bos = target.tokenizer.bos_token_id

    def remove_request(self, request_id: str) -> None:
        self.inner.remove_request(request_id)

    def context_text(self, target_ids: Sequence[int]) -> tuple[str, int]:
        """(The committed context's text up to its last whole character, how many committed
        tokens at the end that leaves out: the fewest whose text does not end in U+FFFD, 0 when
        none is, a U+FFFD of the text itself; module note.)"""
        ids = list(target_ids)
        if ids and ids[0] == self.target_bos:  # the draft's tokenizer adds its own
            ids = ids[1:]
        for held in range(min(MAX_HELD, len(ids) - 1) + 1):
            text = self.target_tok.decode(ids[:len(ids) - held], skip_special_tokens=False)
            if not text.endswith("\ufffd"):
                return text, held
        return self.target_tok.decode(ids, skip_special_tokens=False), 0

    def draft_ids(self, target_ids: Sequence[int]) -> list[int]:
        """The committed context in the draft's tokens: the target's text, re-tokenized."""
        return self.draft_tok.encode(self.context_text(target_ids)[0])

    def target_continuation(self, committed: Sequence[int], text: str, most: int) -> list[int]:
        """Target tokens for `text` following `committed`: the last TAIL_TOKENS committed tokens
        (or fewer) re-tokenized with the text must come back unchanged; the tokens after them
        are the continuation (at most `most`; [] if no tail reproduces)."""
        for m in range(min(TAIL_TOKENS, len(committed)), 0, -1):
            tail = list(committed[-m:])
            ids = self.target_tok.encode(self.target_tok.decode(tail, skip_special_tokens=False) + text,
                                         add_special_tokens=False)
            if ids[:m] == tail:
                return [t for t in ids[m:m + most] if t < self.target_vocab]
        return []

    def continuation_after_held(self, committed: Sequence[int], held: int, text: str, most: int) -> list[int]:
        """Target tokens for `text`, drafted after all but the last `held` committed tokens: those
        must come first (the held character, completed by the draft), and the rest follow them."""
        if not held:
            return self.target_continuation(committed, text, most)
        ids = self.target_continuation(committed[:len(committed) - held], text, most + held)
        return ids[held:] if ids[:held] == list(committed[len(committed) - held:]) else []

    @torch.inference_mode()
    def propose(self, batch: list[SpecRequest]) -> DraftProposal:
        device = self.inner.runner.device
        rows, helds, inner = [], [], []
        for i, r in enumerate(batch):
            if r.num_speculative_tokens <= 0:
                continue
            text, held = self.context_text(r.token_ids)
            ids = self.draft_tok.encode(text)
            if not ids or len(ids) + r.num_speculative_tokens > self.draft_len:
                continue  # the draft's tokens of this context do not fit its cache: a plain step
            rows.append(i)
            helds.append(held)
            inner.append(SpecRequest(r.request_id, ids, r.num_speculative_tokens, _GREEDY, r.noise))
        drafts: list[list[int]] = [[] for _ in batch]
        if rows:
            out = self.inner.propose(inner)
            got, counts = out.draft_token_ids.tolist(), out.num_draft.tolist()
            for i, held, sr, row, n in zip(rows, helds, inner, got, counts):
                if not n:
                    continue
                context = self.draft_tok.decode(sr.token_ids, skip_special_tokens=False)
                extended = self.draft_tok.decode(list(sr.token_ids) + row[:n], skip_special_tokens=False)
                if not extended.startswith(context):
                    continue  # the draft's detokenizer rewrote the context's end: no safe text
                text = extended[len(context):].rstrip("\ufffd")  # a character cut mid-way is dropped
                if text:
                    drafts[i] = self.continuation_after_held(batch[i].token_ids, held, text,
                                                             batch[i].num_speculative_tokens)
        k_max = max((r.num_speculative_tokens for r in batch), default=0)
        return DraftProposal.from_lists(drafts, k_max, device)
