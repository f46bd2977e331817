"""Confidence-pruned draft trees: a tree proposer that knows its drafts' probabilities keeps only
nodes whose path probability reaches SpecRequest.min_path_prob and stops growing when nothing
deeper could, and the planner prices that floor as one more verified row over what a committed
token is worth. Units on hand-built candidates, then EAGLE-3 on a tiny target, then the engine
under auto (greedy output still the target's)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.config import EngineConfig
from specserve.drafts import SpecRequest
from specserve.engine.adaptive import Plan, PlanRow, SpeculationPlanner
from specserve.engine.cost_model import PassShape
from specserve.spec.eagle import TreeCandidates, path_floor, select_trees
from specserve.spec.eagle3 import Eagle3Proposer
from specserve.spec.heads.eagle3_loader import Eagle3Drafter
from tests.test_adaptive import linear_cost
from tests.test_eagle3 import random_head
from tests.test_spec_e2e import tiny_prompts

GREEDY = SamplingParams(temperature=0)


def test_the_floor_is_the_log_of_the_request_s_min_path_prob():
    assert path_floor(SpecRequest("r", [1], 2, GREEDY, None, min_path_prob=0.25)) == math.log(0.25)
    assert path_floor(SpecRequest("r", [1], 2, GREEDY, None)) == -math.inf


def test_select_trees_leaves_out_candidates_below_the_floor_and_keeps_a_tree():
    # Candidates in creation order: depth 1 (ids 0, 1), depth 2 children of 0 (ids 2, 3) and of 1 (4, 5).
    logp = torch.log(torch.tensor([[0.6, 0.3, 0.42, 0.12, 0.2, 0.06]]))
    tokens = np.array([[10, 11, 12, 13, 14, 15]])
    parents = np.array([[-1, -1, 0, 0, 1, 1]])
    depth_of = np.array([1, 1, 2, 2, 2, 2])
    whole = select_trees([(2, 6)], tokens, logp, parents, depth_of)[0]
    assert whole.num_nodes == 6
    pruned = select_trees([(2, 6)], tokens, logp, parents, depth_of, [math.log(0.25)])[0]
    assert (pruned.token_ids, pruned.parents) == ([10, 11, 12], [-1, -1, 0])
    assert select_trees([(2, 6)], tokens, logp, parents, depth_of, [math.log(0.7)])[0].num_nodes == 0
    # The budget still caps what passes the floor.
    assert select_trees([(2, 2)], tokens, logp, parents, depth_of, [math.log(0.25)])[0].token_ids == [10, 12]


def test_frontier_below_every_row_s_floor_ends_growth():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.9, 0.05, 0.05]]))
    cands = TreeCandidates(logits, k=2)
    assert not cands.frontier_below([-math.inf, -math.inf])
    assert not cands.frontier_below([math.log(0.6), math.log(0.6)])  # row 1's best (0.9) reaches it
    assert cands.frontier_below([math.log(0.6), math.log(0.95)])


def test_the_plan_prices_a_row_against_the_tokens_it_yields():
    assert Plan([1], expected_tokens=1.5, predicted_s=6e-3, row_s=4e-4).min_path_prob == pytest.approx(0.1)
    assert Plan([0], 1.0, 5e-3, 0.0).min_path_prob == 0.0
    # The planner's own figure: one more token priced at the rows' context, the chosen plan's yield.
    p = SpeculationPlanner(linear_cost(5e-3, 5e-4), max_depth=4)
    plan = p.plan(PassShape(1, 100, 100), [PlanRow("a", 100, 4)])
    assert plan.row_s == pytest.approx(5e-4, rel=0.05)
    assert plan.min_path_prob == pytest.approx(plan.row_s * plan.expected_tokens / plan.predicted_s)


def _proposer(tiny, scale: float = 3.0) -> Eagle3Proposer:
    target = tiny["loaded"]
    head = random_head(target, vocab=list(range(3, 60)), scale=scale)
    drafter = Eagle3Drafter(head.config, head, target.model.embed_tokens, None)
    engine = EngineConfig(max_num_seqs=2, max_model_len=256, num_kv_blocks=64, block_size=4)
    return Eagle3Proposer(drafter, target, engine, max_nodes=12, topk=3)


def _propose(prop: Eagle3Proposer, floor: float, seq: list[int]):
    h3 = 3 * prop.drafter.config.target_hidden_size
    prop.remove_request("r")
    prop.observe_hidden("r", 0, torch.randn(len(seq) - 1, h3, generator=torch.Generator().manual_seed(1)))
    return prop.propose([SpecRequest("r", seq, 5, GREEDY, None, max_nodes=12, min_path_prob=floor)]).trees[0]


def test_eagle3_keeps_only_nodes_at_or_above_the_floor_and_stops_growing(tiny, monkeypatch):
    prop = _proposer(tiny)
    seq = list(range(5, 25))
    scores = []
    real = TreeCandidates.trees

    def recording(self, limits, draft_ids, floors=None):
        scores.append(torch.cat(self.score, 1)[0])
        return real(self, limits, draft_ids, floors)

    monkeypatch.setattr(TreeCandidates, "trees", recording)
    whole = _propose(prop, 0.0, seq)
    passes_whole = prop.times.depth_passes
    assert whole.num_nodes == 12 and whole.max_depth == 5
    best = scores[-1].exp().sort(descending=True).values
    floor = float(best[2] + best[3]) / 2  # between the third and fourth most likely candidates
    pruned = _propose(prop, floor, seq)
    assert 1 <= pruned.num_nodes <= 3
    kept = scores[-1].exp()
    assert int((kept >= floor).sum()) == pruned.num_nodes  # exactly the candidates at or above it
    assert prop.times.depth_passes - passes_whole < 4  # growth stopped before depth 5
    assert _propose(prop, 1.0, seq).num_nodes == 0  # nothing is that sure: a plain step


def test_greedy_output_under_auto_with_a_floor_is_plain_greedy(tiny, tmp_path, monkeypatch):
    """The engine hands the planner's floor to EAGLE-3 under auto (on a made-up machine where a
    row costs a tenth of a pass: floors near 0.1 x the tokens a step yields); whatever it
    prunes, the output stays the target's."""
    from specserve.engine import cost_model
    from specserve.spec.heads.eagle3_checkpoint import write_eagle3

    target = tiny["loaded"]
    head = random_head(target, vocab=list(range(64)), scale=0.5)
    write_eagle3(tmp_path / "d3", head.config, {k: v for k, v in head.state_dict().items()}, {}, dtype=torch.float32)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = [o.outputs[0].token_ids for o in LLM(loaded=target, max_num_seqs=2).generate(tiny_prompts(3), params,
                                                                                         use_tqdm=False)]
    llm = LLM(loaded=target, max_num_seqs=2,
              speculative_config={"method": "eagle3", "model": str(tmp_path / "d3"), "num_speculative_tokens": "auto"})
    monkeypatch.setattr(cost_model, "LEARNING_RATE", 0.0)  # keep the made-up machine
    llm.engine.planner.cost = linear_cost(5e-3, 5e-4)
    floors = []
    real = llm.engine.proposer.propose

    def propose(batch):
        floors.extend(r.min_path_prob for r in batch)
        return real(batch)

    llm.engine.proposer.propose = propose
    outs = llm.generate(tiny_prompts(3), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert floors and all(0.05 <= f <= 0.3 for f in floors)


def test_the_planner_learns_what_asking_yielded_empty_trees_included():
    """Under a floor a tree may come back shallower than asked, or empty: the planner counts
    the asked depth (an empty tree is a first position not accepted) and prices the nodes
    actually drafted per asked depth, below one where trees come back empty."""
    p = SpeculationPlanner(linear_cost(5e-3, 5e-4), max_depth=4, tokens_per_depth=2.0)
    for _ in range(40):
        p.observe_verification("r", 4, 0, num_nodes=0)
    assert p.requests["r"].rates([0.5] * 4, 2.0)[0] < 0.1
    assert p.width < 0.1
    p.observe_step(PassShape(1), 5e-3, 1e-3, deepest=4)  # drafting that left every tree empty costs time too
    assert p.drafting_s(4) == pytest.approx(1e-3)
