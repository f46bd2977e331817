"""While the planner keeps a request's drafts off (depth 0), its proposer does nothing for it:
no draft-model, self-draft or drafter pass (EAGLE's or EAGLE-3's), no proposal. When drafts come back on, the
proposer catches up on everything committed meanwhile in its first draft pass, and greedy
output stays plain's."""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.engine.adaptive import Plan
from specserve.spec.heads import new_drafter, save_drafter
from tests.test_engine_paged import alone
from tests.test_spec_e2e import tiny_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
OFF_STEPS = 12  # decode steps with drafts off before they come on


def spec_for(method: str, tiny, tmp_path) -> dict:
    if method == "draft_model":
        return {"method": method, "model": tiny["draft"]}
    if method == "draft_model-window":  # a draft model that reads only the last 5 tokens after a pause
        return {"method": "draft_model", "model": tiny["draft"], "catch_up_window": 5}
    if method == "self_spec":
        return {"method": method, "skip_layers": [1]}
    if method == "eagle":
        torch.manual_seed(0)
        save_drafter(tmp_path / "d", new_drafter(tiny["loaded"], "eagle", torch.arange(tiny["loaded"].config.vocab_size)))
        return {"method": method, "model": str(tmp_path / "d")}
    if method == "eagle3":
        from tests.test_eagle3 import save_random_drafter

        return {"method": method, "model": save_random_drafter(tmp_path / "d3", tiny["loaded"])}
    return {"method": method}


def expensive_call(llm: LLM):
    """(object, attribute) of the proposer's per-pass work: what must not run while off."""
    p = llm.engine.proposer
    if p.name in ("draft_model", "self_spec"):
        return p.runner, "execute_last"
    if p.name in ("eagle", "eagle3"):
        return p, "_catch_up"  # the drafter's first pass of every drafting step
    return p, "propose"


@pytest.mark.parametrize("method", ["draft_model", "draft_model-window", "self_spec", "eagle", "eagle3", "lookahead"])
def test_drafts_off_cost_no_proposer_work_and_catch_up_when_on(tiny, tmp_path, monkeypatch, method):
    prompt = tiny_prompts(1)[0]
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=1, speculative_config=spec_for(method, tiny, tmp_path))
    engine, planner = llm.engine, llm.engine.planner
    assert planner is not None
    steps = {"n": 0}
    plan = planner.plan

    def forced(base, rows):  # the planner's own bookkeeping, then drafts off for OFF_STEPS steps
        out = plan(base, rows)
        steps["n"] += 1
        depths = [0 if steps["n"] <= OFF_STEPS else r.max_depth for r in rows]
        return Plan(depths, out.expected_tokens, out.predicted_s)
    monkeypatch.setattr(planner, "plan", forced)

    obj, attr = expensive_call(llm)
    calls: list[int] = []  # the decode step of each call
    real = getattr(obj, attr)

    def spy(*args, **kwargs):
        calls.append(steps["n"])
        return real(*args, **kwargs)
    monkeypatch.setattr(obj, attr, spy)

    fed: list[int] = []  # draft_model / self_spec: tokens fed by each first draft pass
    if method in ("draft_model", "draft_model-window", "self_spec"):
        def first_pass(fb):
            fed.append(sum(len(t) for t in fb.token_ids))
            return spy(fb)
        monkeypatch.setattr(obj, attr, first_pass)

    out = llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert out == alone(tiny, [prompt], GREEDY)[0]
    assert steps["n"] > OFF_STEPS + 1
    assert calls and min(calls) == OFF_STEPS + 1  # nothing while off, drafting once on
    stats = engine.stats()
    assert sum(stats.draft_depth_counts[1:]) > 0
    if fed:
        # One pass catches the draft up on the prompt, the prefill's token and every token
        # committed while off; self_spec on its last catch_up_window of them only.
        behind = len(prompt) + 1 + OFF_STEPS
        window = llm.engine.proposer.catch_up_window
        assert window == {"draft_model": None, "draft_model-window": 5}.get(method, window)
        assert fed[0] == (behind if window is None else min(behind, window))
