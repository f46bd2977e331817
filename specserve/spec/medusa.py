"""Medusa proposer: K heads on the target's last hidden state fill a static tree of candidates.

Head k reads the target's final hidden state at the last verified position L and ranks
candidates for token L+1+k; the root is token L+1 (the target's own last choice), so head 1
ranks the root's children, head 2 their children, and so on. The tree's shape is a list of
rank paths (Medusa's "choices"), chosen at training time from each head's held-out top-k
accuracy (best paths first), and cut to the node budget. Candidates are deterministic, so the
verifier keeps the output exactly the target's. (Medusa's typical acceptance, which is lossy,
is not offered.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.errors import InvalidParameterError
from specserve.spec.heads import Drafter
from specserve.drafts import DraftTreeProposal, SpecRequest
from specserve.spec.proposer import Proposer
from specserve.spec.registry import MethodSpec
from specserve.drafts.tree import DraftTree


class MedusaProposer(Proposer):
    name = "medusa"
    needs_hidden_states = True

    def __init__(self, drafter: Drafter, max_nodes: int | None = None):
        choices = drafter.config.tree_choices
        if not choices:
            raise InvalidParameterError("speculative_config.model", "medusa", "the drafter's config has no tree_choices")
        # Best paths first, so any prefix of the list is a tree (a parent precedes its children).
        self.choices = [list(c) for c in choices[:max_nodes]]
        self.drafter = drafter
        self.ranks = max(c[-1] for c in self.choices) + 1  # candidates needed per head
        # request id -> (position L, the target's final hidden state there [H])
        self.last: dict[str, tuple[int, torch.Tensor]] = {}

    def num_draft_nodes(self, num_speculative_tokens: int) -> int:
        return max(num_speculative_tokens, len(self.choices))

    def observe_hidden(self, request_id: str, start_position: int, hidden: torch.Tensor) -> None:
        if len(hidden):
            self.last[request_id] = (start_position + len(hidden) - 1, hidden[-1])

    def remove_request(self, request_id: str) -> None:
        self.last.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: list[SpecRequest]) -> DraftTreeProposal:
        trees = [DraftTree.empty() for _ in batch]
        rows = [i for i, r in enumerate(batch) if r.wants_tree
                and self.last.get(r.request_id, (-1,))[0] == len(r.token_ids) - 2]
        if not rows:
            return DraftTreeProposal(trees)
        d = self.drafter
        hidden = torch.stack([self.last[batch[i].request_id][1] for i in rows]).to(d.dtype)  # [B, H]
        logits = d.vocab(d.heads(hidden))  # [B, K, Vd]
        ranked = d.vocab.ids[logits.topk(min(self.ranks, logits.shape[-1]), dim=-1).indices].tolist()  # [B, K, R]
        for b, i in enumerate(rows):
            r = batch[i]
            choices = [c for c in self.choices if len(c) <= r.num_speculative_tokens][:r.max_nodes]
            trees[i] = DraftTree.from_choices(choices, ranked[b])
        return DraftTreeProposal(trees)


MAX_DRAFT_NODES = 128  # tree nodes verified per step


def check_num_draft_nodes(n: int | None) -> None:
    """The drafters' tree size (eagle's and medusa's num_draft_nodes)."""
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT_NODES):
        raise InvalidParameterError("num_draft_nodes", n, f"must be an integer in [1, {MAX_DRAFT_NODES}] or None")


@dataclass(frozen=True, slots=True)
class MedusaOptions:
    """speculative_config's medusa keys: draft-tree nodes verified per step
    (num_speculative_tokens is the tree's depth); None: the tree chosen when it was trained."""

    num_draft_nodes: int | None = None

    def __post_init__(self) -> None:
        check_num_draft_nodes(self.num_draft_nodes)


def _build(options: MedusaOptions, model: str | None, target: object, engine: object) -> MedusaProposer:
    from specserve.spec.heads import load_drafter
    return MedusaProposer(load_drafter(model, target), max_nodes=options.num_draft_nodes)


METHOD = MethodSpec("medusa", MedusaOptions, _build, auto_max_k=4,
                    needs_model="method 'medusa' needs the folder `specserve train-draft` wrote")
