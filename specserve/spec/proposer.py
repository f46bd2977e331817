"""The interface every drafting method implements, and the dataclasses that cross it.

One speculative step reads: propose -> verify -> accept -> commit. The engine hands a proposer
one `SpecRequest` per speculating request, gets back a `DraftProposal` for the whole batch, has
the target score `1 + num_draft` positions per row, and reports what verification kept in a
`VerifyFeedback`, which adaptive proposers use to tune themselves.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.sampling_params import SamplingParams


@dataclass(slots=True)
class SpecRequest:
    """What a proposer sees of one request this step."""

    request_id: str
    token_ids: Sequence[int]  # prompt + every committed output token; never uncommitted drafts
    num_speculative_tokens: int  # k for this request this step, >= 0 (may differ per request)
    sampling: SamplingParams  # the request's own parameters: a sampled draft processes q with them
    generator: torch.Generator | None  # the request's seeded generator (sampled draft models use it)


@dataclass(slots=True)
class DraftProposal:
    """Drafts for a batch, row b belonging to the b-th request handed to `propose`.

    The width k_max equals max(num_draft) (0 when nobody drafted): the target computes the last
    committed token plus num_draft drafts per row, so its logits are [B, 1 + max(num_draft), V]
    and the verifier needs draft columns to line up with them.
    """

    draft_token_ids: torch.Tensor  # [B, k_max] int64, -1 past num_draft[b]
    num_draft: torch.Tensor  # [B] int64, 0..k of that request (0: nothing to propose, a plain step)
    # [B, k_max, V] float32: the processed q a stochastic proposer sampled from (rows past
    # num_draft are ignored). None for deterministic proposers, whose q is one-hot at the draft.
    draft_probs: torch.Tensor | None

    @classmethod
    def from_lists(cls, drafts: list[list[int]], k_max: int, device: torch.device | str) -> DraftProposal:
        """Pack deterministic drafts, one list per request, each at most k_max long. The width
        is the longest draft (see the class note), so it can be narrower than k_max."""
        lengths = [len(d) for d in drafts]
        if any(n > k_max for n in lengths):
            raise ValueError(f"draft lengths {lengths} exceed k_max={k_max}")
        width = max(lengths, default=0)
        ids = torch.full((len(drafts), width), -1, dtype=torch.long)
        for b, d in enumerate(drafts):
            if d:
                ids[b, : len(d)] = torch.tensor(d, dtype=torch.long)
        # Built on the host and moved once: per-row copies into a device tensor would each sync.
        return cls(ids.to(device), torch.tensor(lengths, dtype=torch.long, device=device), None)

    @classmethod
    def empty(cls, batch: int, device: torch.device | str) -> DraftProposal:
        """No drafts for any of `batch` requests: every row is a plain decode step."""
        return cls(
            torch.empty(batch, 0, dtype=torch.long, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
            None,
        )

    def scatter(self, rows: list[int], batch: int) -> DraftProposal:
        """Place this proposal's rows at positions `rows` of a batch of `batch` requests; the
        other rows (requests that do not speculate) draft nothing."""
        device = self.num_draft.device
        idx = torch.tensor(rows, dtype=torch.long, device=device)
        ids = torch.full((batch, self.draft_token_ids.shape[1]), -1, dtype=torch.long, device=device)
        ids[idx] = self.draft_token_ids
        num = torch.zeros(batch, dtype=torch.long, device=device)
        num[idx] = self.num_draft
        probs = None
        if self.draft_probs is not None:
            probs = self.draft_probs.new_zeros((batch, *self.draft_probs.shape[1:]))
            probs[idx] = self.draft_probs
        return DraftProposal(ids, num, probs)


@dataclass(slots=True)
class VerifyFeedback:
    """What verification kept, per speculating request, after one step."""

    request_ids: list[str]
    num_draft: list[int]  # drafts proposed
    num_accepted: list[int]  # of those, accepted by the verifier
    committed_token_ids: list[list[int]]  # tokens committed this step: accepted, then recovered or bonus


class Proposer(ABC):
    """A drafting method: `propose(batch) -> DraftProposal`, then `observe(feedback)` after
    verification. `add_request` / `remove_request` bracket a request's life so that methods
    with per-request state (indexes, draft KV caches) can set it up and free it."""

    name: str

    def add_request(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """A request starts speculating. Stateless proposers need nothing."""

    def remove_request(self, request_id: str) -> None:
        """A request finished or was aborted: drop whatever is held for it."""

    @abstractmethod
    def propose(self, batch: list[SpecRequest]) -> DraftProposal:
        """Drafts for each request of `batch`, in order: num_draft[b] <= batch[b].num_speculative_tokens."""

    def observe(self, feedback: VerifyFeedback) -> None:
        """Verification results of the last step; adaptive methods tune themselves on them."""
