"""Held-out acceptance of a drafter, and Medusa's static tree chosen from it."""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass

import torch

from specserve.spec.heads import Drafter
from specserve.train.batches import collate, make_batches
from specserve.train.data import Recorded
from specserve.train.objectives import StepResult, accepted_lengths, drafter_steps, mixed_precision

# Ranks whose frequency is reported per depth (Medusa's tree is built from them).
TOP_RANKS = 10


@dataclass(slots=True)
class HeldOutReport:
    """Acceptance of top-1 drafts on held-back sequences, scored against the target's greedy choices."""

    num_sequences: int
    num_positions: int  # answer positions a draft starts from
    top1_by_depth: list[float]  # P(depth d's top-1 is the target's choice), teacher-forced context
    conditional_by_depth: list[float]  # the same, given depths 1..d-1 were right (what a chain sees)
    rank_by_depth: list[list[float]]  # [D][TOP_RANKS] P(the target's choice is the drafter's r-th)
    expected_accepted_length: float  # tokens per target pass of a top-1 chain of all depths: 1 + E[accepted]
    chance_top1: float  # a uniform guess over the draft vocabulary
    loss: float

    def as_dict(self) -> dict:
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, float):
                d[k] = round(v, 4)
            elif isinstance(v, list):
                d[k] = [[round(x, 4) for x in r] if isinstance(r, list) else round(r, 4) for r in v]
        return d

    def summary(self) -> str:
        depths = ", ".join(f"{a:.3f}" for a in self.top1_by_depth)
        return (f"held-out top-1 accuracy by depth [{depths}] | expected accepted length (top-1 chain) "
                f"{self.expected_accepted_length:.2f} | chance {self.chance_top1:.2g} | loss {self.loss:.4f}")


@torch.no_grad()
def evaluate(drafter: Drafter, data: Recorded, indices: list[int], depth: int, index: torch.Tensor,
             tokens_per_batch: int) -> HeldOutReport:
    device = drafter.vocab.ids.device
    correct = torch.zeros(depth)
    valid = torch.zeros(depth)
    both = torch.zeros(depth)  # right at d and at every earlier depth
    prior = torch.zeros(depth)  # right at every earlier depth (and d has a label)
    ranks = torch.zeros(depth, TOP_RANKS)
    accepted_sum, starts, loss_sum, batches = 0.0, 0, 0.0, 0
    for batch_ids in make_batches(data, indices, tokens_per_batch, seed=0):
        batch = collate(data, batch_ids, depth, index, device)
        with mixed_precision(device):
            steps: list[StepResult] = drafter_steps(drafter, batch, want_ranks=True)
        run = torch.ones_like(steps[0].valid)
        for d, s in enumerate(steps):
            correct[d] += s.correct.sum().item()
            valid[d] += s.valid.sum().item()
            prior[d] += (run & s.valid).sum().item()
            run = run & s.correct
            both[d] += run.sum().item()
            r = s.ranks[(s.ranks >= 0) & (s.ranks < TOP_RANKS)]
            ranks[d] += torch.bincount(r, minlength=TOP_RANKS).float().cpu()
        accepted, first = accepted_lengths(steps)
        accepted_sum += accepted.sum().item()
        starts += int(first.sum())
        loss_sum += sum(float(s.loss) for s in steps) / depth
        batches += 1
    return HeldOutReport(
        num_sequences=len(indices),
        num_positions=starts,
        top1_by_depth=(correct / valid.clamp(min=1)).tolist(),
        conditional_by_depth=(both / prior.clamp(min=1)).tolist(),
        rank_by_depth=(ranks / valid.clamp(min=1)[:, None]).tolist(),
        expected_accepted_length=1 + accepted_sum / max(1, starts),
        chance_top1=1 / drafter.config.draft_vocab_size,
        loss=loss_sum / max(1, batches),
    )


def choose_tree(rank_by_depth: list[list[float]], num_nodes: int) -> tuple[list[list[int]], float]:
    """Medusa's static tree: the `num_nodes` rank paths (r1, ..., rd) of highest estimated
    acceptance prod_d P(rank r_d at depth d), found best-first (a child never beats its
    parent, so parents come first). -> (choices, estimated tokens per pass = 1 + sum over nodes)."""
    depth = len(rank_by_depth)
    heap = [(-p, (r,)) for r, p in enumerate(rank_by_depth[0]) if p > 0]
    heapq.heapify(heap)
    choices, total = [], 1.0
    while heap and len(choices) < num_nodes:
        neg, path = heapq.heappop(heap)
        choices.append(list(path))
        total += -neg
        if len(path) < depth:
            for r, p in enumerate(rank_by_depth[len(path)]):
                if p > 0:  # a rank never seen right adds a node that is never accepted
                    heapq.heappush(heap, (neg * p, path + (r,)))
    return choices, total
