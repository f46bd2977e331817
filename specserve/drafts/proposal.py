"""The types a speculative step passes between its layers: what a proposer sees of a request
(`SpecRequest`), what it drafts (`DraftProposal` chains, `DraftTreeProposal` trees) and what
verification kept (`VerifyFeedback`). They sit below both spec/ (which makes them) and sample/
(which verifies them); the contract around them is in spec/proposer.py."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specserve.drafts.tree import DraftTree
from specserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # sample/ imports the draft types at run time; this is the annotation only
    from specserve.sample.noise import PositionNoise


@dataclass(slots=True)
class SpecRequest:
    """What a proposer sees of one request this step."""

    request_id: str
    token_ids: Sequence[int]  # prompt + every committed output token; never uncommitted drafts
    num_speculative_tokens: int  # k for this request this step, >= 0 (may differ per request)
    sampling: SamplingParams  # the request's own parameters: a sampled draft processes q with them
    # The request's counter-based noise (sample.noise.PositionNoise): a proposer that samples
    # its draft for sequence position t races q against the noise the verifier uses at t.
    # None: the global RNG (callers without a request, such as tests; the engine always gives one).
    noise: PositionNoise | None
    # Tree proposers: the most nodes a tree may have this step (within the context, and the
    # planner's budget for the depth; >= num_speculative_tokens); None means
    # num_speculative_tokens. Chain proposers ignore it.
    max_nodes: int | None = None
    # How many of token_ids are the request's prompt (the rest its output so far); None when the
    # caller does not say. Proposers that remember answers across requests (suffix) read it.
    num_prompt_tokens: int | None = None
    # Tree proposers that know their drafts' probabilities (EAGLE's and EAGLE-3's drafters) leave
    # out every node whose path probability under the drafter (the product along its path) is
    # below this, and stop growing once no node they would expand reaches it (no child of theirs
    # could). A drafter's confidence tracks its acceptance (EAGLE-2), so this is the price of one
    # more verified row in committed tokens (engine/adaptive.py, SpeculationPlanner.min_path_prob);
    # 0: every node of the budget.
    min_path_prob: float = 0.0

    def __post_init__(self) -> None:
        if self.max_nodes is None:
            self.max_nodes = self.num_speculative_tokens

    @property
    def wants_tree(self) -> bool:
        """Whether a tree proposer drafts for this request this step (room for a node and a depth)."""
        return self.num_speculative_tokens > 0 and self.max_nodes > 0


@dataclass(slots=True)
class DraftProposal:
    """Drafts for a batch, row b belonging to the b-th request handed to `propose`.

    The width k_max equals max(num_draft) (0 when nobody drafted): the target computes the last
    committed token plus num_draft drafts per row, so its logits are [B, 1 + max(num_draft), V]
    and the verifier needs draft columns to line up with them.
    """

    draft_token_ids: torch.Tensor  # [B, k_max] int64, -1 past num_draft[b]
    num_draft: torch.Tensor  # [B] int64, 0..k of that request (0: nothing to propose, a plain step)
    # No draft probabilities: a proposer that samples draws with the request's noise (see
    # SpecRequest.noise), and the verifier accepts a draft iff it equals the target's own draw.

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
        return cls(ids.to(device), torch.tensor(lengths, dtype=torch.long, device=device))

    @classmethod
    def empty(cls, batch: int, device: torch.device | str) -> DraftProposal:
        """No drafts for any of `batch` requests: every row is a plain decode step."""
        return cls(
            torch.empty(batch, 0, dtype=torch.long, device=device),
            torch.zeros(batch, dtype=torch.long, device=device),
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
        return DraftProposal(ids, num)

    def as_trees(self) -> DraftTreeProposal:
        """Each row's chain as a one-path tree."""
        n = self.num_draft.tolist()
        ids = self.draft_token_ids.tolist()
        return DraftTreeProposal([
            DraftTree.chain(ids[b][: n[b]])
            if n[b] else DraftTree.empty() for b in range(len(n))])


@dataclass(slots=True)
class DraftTreeProposal:
    """Token trees for a batch, trees[b] belonging to the b-th request handed to `propose`
    (DraftTree.empty() for a request without drafts)."""

    trees: list[DraftTree]


@dataclass(slots=True)
class VerifyFeedback:
    """What verification kept, per speculating request, after one step."""

    request_ids: list[str]
    num_draft: list[int]  # drafts proposed (a tree's node count)
    num_accepted: list[int]  # of those, accepted by the verifier (the accepted path's length)
    committed_token_ids: list[list[int]]  # tokens committed this step: accepted, then recovered or bonus
    # Indices of the accepted drafts in proposal order: a chain's 0..a-1, a tree's accepted path
    # of node indices (root's child first).
    accepted_nodes: list[list[int]]
    # Only for proposers with needs_node_predictions (spec/proposer.py): per request, the
    # target's argmax of the raw logits at the root and at every node, [1 + num_draft] ints,
    # root first then nodes in proposal order. None otherwise.
    node_predictions: list[list[int]] | None = None

    def row(self, i: int) -> VerifyFeedback:
        """The feedback of the i-th request alone."""
        return VerifyFeedback([self.request_ids[i]], [self.num_draft[i]], [self.num_accepted[i]],
                              [self.committed_token_ids[i]], [self.accepted_nodes[i]],
                              None if self.node_predictions is None else [self.node_predictions[i]])
