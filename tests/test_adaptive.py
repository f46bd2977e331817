"""Adaptive speculation: the pass cost model, the acceptance estimates and the planner (pure
Python, with made-up costs), then the engine choosing draft lengths, losslessly."""

from __future__ import annotations

import math
import random

import pytest

from specserve import LLM, SamplingParams
from specserve.config import AUTO_MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from specserve.engine import cost_model as cost_module
from specserve.engine.adaptive import (PRIOR_STRENGTHS, PROBE_BUDGET, PROBE_EVERY, PROBE_MAX, AcceptanceEstimate,
                                      PlanRow, SpeculationPlanner)
from specserve.engine.cost_model import KNOTS, PassCostModel, PassShape
from specserve.errors import InvalidParameterError
from tests.test_engine_paged import alone, assert_all_blocks_free
from tests.test_spec_e2e import tiny_prompts


def linear_cost(fixed: float, per_token: float, per_read: float = 0.0) -> PassCostModel:
    return PassCostModel([fixed + per_token * k for k in KNOTS], per_read=per_read)


# ---- the cost model -------------------------------------------------------------------------

def test_pass_shape_counts_tokens_keys_and_pairs():
    s = PassShape(0)
    s.add(3, 10)  # three tokens after ten cached: keys 13 read, pairs 11 + 12 + 13
    s.add(1, 5)
    assert (s.num_tokens, s.keys_read, s.query_keys) == (4, 19, 36 + 6)


def test_base_time_interpolates_extrapolates_and_never_falls():
    m = PassCostModel([1.0] * len(KNOTS))
    m.base[KNOTS.index(8)] = 0.5  # a noisy knot below its neighbour
    assert m.base_time(8) == 1.0  # priced as its left neighbour: adding tokens never looks free
    lin = linear_cost(2.0, 0.5)
    assert lin.base_time(7) == pytest.approx(5.5)  # between knots 6 and 8
    assert lin.base_time(4096) == pytest.approx(2.0 + 0.5 * 4096)  # past the table, along its slope
    assert lin.predict(PassShape(4, 100, 0)) == pytest.approx(4.0)
    assert linear_cost(2.0, 0.5, per_read=0.01).predict(PassShape(4, 100, 0)) == pytest.approx(5.0)


def test_observations_move_the_knots_toward_the_measured_time_and_clip_outliers():
    m = linear_cost(1.0, 0.0)
    for _ in range(200):
        m.observe(PassShape(4), 1.5)
    assert m.base_time(4) == pytest.approx(1.5, rel=1e-3)
    assert m.base[KNOTS.index(64)] == pytest.approx(1.0)  # far knots are not this step's to move
    before = m.base_time(4)
    m.observe(PassShape(4), 1000.0)  # a stall: counted as at most twice the prediction
    assert m.base_time(4) <= before + cost_module.LEARNING_RATE * before + 1e-9
    m.observe(PassShape(5000), 1.0)  # past the table: counted, moves nothing
    assert m.num_observed == 202 and m.base_time(4) <= before * 1.1


def test_the_model_follows_the_machines_level_not_only_the_knots_steps_reach():
    """Probed 10x too slow (the cores were busy at start-up), then steps of one token only at
    the machine's real speed: the whole table comes down, knots no step reached included."""
    m = linear_cost(5e-2, 1e-3)
    for _ in range(cost_module.DRIFT_MIN_STEPS + 10):
        m.observe(PassShape(1), 5e-3)
    assert m.num_rescales >= 1 and "rescaled" in m.describe()
    assert m.base_time(8) == pytest.approx(5e-3 + 8e-4, rel=0.5)  # 10x off before
    assert m.base_time(64) == pytest.approx(5e-3 + 64e-4, rel=0.5)  # far knots too, by the probe's shape


def test_stalls_do_not_rescale_the_model():
    m = linear_cost(5e-3, 1e-4)
    for i in range(200):
        m.observe(PassShape(1), 5.0 if i % 25 == 0 else 5.1e-3)  # a 1000x stall now and then
    assert m.num_rescales == 0 and m.base_time(8) == pytest.approx(5.8e-3, rel=0.05)


def test_long_prompt_chunks_teach_the_attention_term_and_decodes_the_table():
    """The probe read half the machine's price of a query-key pair: chunks of 32 prompt tokens
    after 3,000 of context (mostly attention) move the pair price to the machine's, and leave
    the table's knot at 32 tokens near where it was; a decode at short context barely moves
    the pair price."""
    m = PassCostModel([5e-3 + 1e-4 * k for k in KNOTS], per_query_key=1e-6)

    def machine(shape: PassShape) -> float:
        return 5e-3 + 1e-4 * shape.num_tokens + 2e-6 * shape.query_keys

    chunk = PassShape(0)
    chunk.add(32, 3000)
    for _ in range(300):
        m.observe(chunk, machine(chunk))
    assert m.per_query_key == pytest.approx(2e-6, rel=0.05)
    assert m.base_time(32) == pytest.approx(5e-3 + 32e-4, rel=0.1)
    assert m.predict(chunk) == pytest.approx(machine(chunk), rel=0.01)
    decode = PassShape(0)
    decode.add(1, 10)
    before = m.per_query_key
    m.observe(decode, 3 * m.predict(decode))  # a slow decode step: the table's to learn from
    assert m.per_query_key == pytest.approx(before, rel=1e-3) and m.base_time(1) > 5.1e-3


@pytest.mark.parametrize("follow", [True, False])
def test_a_slow_start_up_probe_does_not_keep_drafting_off(monkeypatch, follow):
    """After a probe taken under load, one-token steps teach the first knot the real speed; the
    knots of a few tokens more stay high unless the level follows, so drafts look too dear and
    no step ever reaches them."""
    if not follow:
        monkeypatch.setattr(cost_module, "DRIFT_RESCALE", float("inf"))
    p = SpeculationPlanner(linear_cost(5e-2, 1e-2), max_depth=8)
    learned(p, "a", 8, 6)
    for _ in range(400):
        p.observe_step(PassShape(1), 5.1e-3, 0.0, 0)
    depth = p.plan(PassShape(1), [PlanRow("a", 10, 8)]).depths[0]
    assert (depth > 0) == follow


def test_measure_recovers_the_costs_of_a_known_machine(monkeypatch):
    """measure() on a fake clock that charges a known pass cost per (tokens, context) request list."""
    clock = [0.0]
    monkeypatch.setattr(cost_module.time, "perf_counter", lambda: clock[0])

    def run(requests):
        shape = PassShape(0)
        for n, c in requests:
            shape.add(n, c)
        clock[0] += 0.004 + 0.0002 * shape.num_tokens + 3e-6 * shape.keys_read + 5e-7 * shape.query_keys
    m = PassCostModel.measure(run, max_tokens=32, max_context=1024)
    # base(N) absorbs the tiny context of the probe passes; the context terms come out exact.
    assert m.per_read == pytest.approx(3e-6, rel=1e-3) and m.per_query_key == pytest.approx(5e-7, rel=1e-3)
    assert m.base_time(16) == pytest.approx(0.004 + 0.0002 * 16, rel=1e-3)
    assert m.base_time(48) > m.base_time(32)  # past the probe, along the last measured slope
    assert "measured at start-up" in m.describe()


# ---- acceptance estimates and the planner ---------------------------------------------------

def test_acceptance_counts_tested_positions_only():
    e = AcceptanceEstimate(decay=1.0)
    e.observe(depth=4, num_accepted=1)  # position 0 accepted, 1 rejected, 2 and 3 never tested
    e.observe(depth=4, num_accepted=4)
    assert e.drafted == [2, 2, 1, 1] and e.accepted == [2, 1, 1, 1]
    assert e.rates([0.5] * 4, strength=0.0) == [1.0, 0.5, 1.0, 1.0]
    assert e.rates([0.5] * 5, strength=2.0)[4] == 0.5  # untested: the prior


def learned(planner: SpeculationPlanner, rid: str, depth: int, accepted: int, times: int = 30) -> None:
    for _ in range(times):
        planner.observe_verification(rid, depth, accepted)


def test_cheap_tokens_and_good_acceptance_draft_deep():
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=8)
    learned(p, "a", 8, 8)
    plan = p.plan(PassShape(1, 100, 100), [PlanRow("a", 100, 8)])
    assert plan.depths == [8] and plan.expected_tokens > 8


def test_poor_acceptance_or_expensive_tokens_switch_speculation_off():
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=8)
    learned(p, "a", 8, 0)
    assert p.plan(PassShape(1), [PlanRow("a", 100, 8)]).depths == [0]
    # A batch of 64 on a machine where a token costs as much as the pass's fixed part: a pass
    # already yields ~1 token per token computed, and half-accepted drafts yield less.
    q = SpeculationPlanner(linear_cost(1e-3, 1e-3), max_depth=8)
    rows = [PlanRow(f"r{i}", 100, 8) for i in range(64)]
    for r in rows:
        for i in range(30):
            q.observe_verification(r.request_id, 8, i % 2)
    assert q.plan(PassShape(64), rows).depths == [0] * 64
    assert q.plan(PassShape(1), rows[:1]).depths[0] > 0  # alone, the same drafts pay


def test_each_request_drafts_by_its_own_acceptance():
    p = SpeculationPlanner(linear_cost(5e-3, 2e-4), max_depth=8)
    learned(p, "copying", 8, 8)
    learned(p, "writing", 8, 0)
    depths = p.plan(PassShape(2), [PlanRow("copying", 50, 8), PlanRow("writing", 50, 8)]).depths
    assert depths[0] >= 4 and depths[1] == 0
    assert p.plan(PassShape(2), [PlanRow("copying", 50, 3), PlanRow("writing", 50, 8)]).depths[0] == 3  # its slots


def test_a_run_of_bad_luck_does_not_switch_a_steady_drafter_off():
    """Drafts accepted at 0.4 in no pattern of their own (a learned drafter's), on a machine
    where a draft token pays above 0.23: the method's rate predicts each request best, and ten
    rejections in a row by chance leave the request drafting."""
    rng = random.Random(0)
    p = SpeculationPlanner(linear_cost(5e-3, 1.5e-3), max_depth=1)
    for i in range(400):
        p.observe_verification(f"r{i % 8}", 1, int(rng.random() < 0.4))
    learned(p, "r0", 1, 0, times=10)
    assert p.strength == max(PRIOR_STRENGTHS)
    assert p.plan(PassShape(1), [PlanRow("r0", 100, 1)]).depths == [1]


def test_requests_that_differ_for_good_are_trusted_on_their_own_record():
    """Acceptance that stays with the request (a lookup's: one copies its prompt, one writes):
    its own record predicts best, and the request that writes stops drafting."""
    p = SpeculationPlanner(linear_cost(5e-3, 1.5e-3), max_depth=1)
    for i in range(400):  # four requests copy their prompt, four write
        p.observe_verification(f"r{i % 8}", 1, int(i % 8 < 4))
    assert p.strength == min(PRIOR_STRENGTHS)
    assert p.plan(PassShape(2), [PlanRow("r0", 100, 1), PlanRow("r4", 100, 1)]).depths == [1, 0]


def test_a_couple_of_early_rejections_do_not_switch_a_method_off():
    # A draft token adds 2 ms to a 7 ms pass: it pays above an acceptance of 0.29.
    p = SpeculationPlanner(linear_cost(5e-3, 2e-3), max_depth=4)
    learned(p, "a", 1, 0, times=2)
    assert p.plan(PassShape(1), [PlanRow("b", 100, 4)]).depths[0] >= 1


def test_a_request_that_stopped_drafting_probes_again():
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=8)
    learned(p, "a", 8, 0)
    depths = [p.plan(PassShape(1), [PlanRow("a", 10, 8)]).depths[0] for _ in range(2 * PROBE_EVERY)]
    assert depths.count(1) == 2 and set(depths) == {0, 1}
    assert sum(p.chosen) == 2 * PROBE_EVERY and p.chosen[1] == 2


def steps_to_next_probe(p: SpeculationPlanner, max_depth: int = 8, limit: int = 2 * PROBE_MAX) -> int:
    """Plans for request "a" until one drafts (a probe, where drafting does not pay) -> how many."""
    for n in range(1, limit + 1):
        if p.plan(PassShape(1), [PlanRow("a", 10, max_depth)]).depths[0]:
            return n
    raise AssertionError("no probe")


def test_probes_that_fail_back_off_and_an_accepted_one_resets_the_wait():
    """Unaccepted probes come after 16, 32, 64, 128, 128 idle steps; an accepted probe brings the
    wait back to PROBE_EVERY."""
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=8)
    learned(p, "a", 8, 0)

    waits = []
    for _ in range(5):
        waits.append(steps_to_next_probe(p))
        p.observe_verification("a", 1, 0)
    assert waits == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, PROBE_MAX, PROBE_MAX]
    assert steps_to_next_probe(p) == PROBE_MAX
    p.observe_verification("a", 1, 1)  # accepted, and at what it shows drafting pays again
    learned(p, "a", 8, 8)
    assert p.plan(PassShape(1), [PlanRow("a", 10, 8)]).depths[0] > 0
    learned(p, "a", 8, 0, times=300)  # then stops paying: probes start over at the shortest wait
    assert steps_to_next_probe(p) == PROBE_EVERY
    p.forget("a")
    assert "a" not in p.probe_every and "a" not in p.probing and "a" not in p.recheck


def test_accepted_probes_whose_drafting_does_not_pay_back_off_too():
    """A drafter right every time whose drafting step costs 200 passes (a draft model as dear
    as its target, catching up): its probes are accepted, yet the request never drafts again,
    so the waits grow as for rejected probes."""
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=4)
    learned(p, "a", 4, 4)
    for d in range(1, 5):
        p.observe_step(PassShape(1 + d), 5e-3, 1.0, d)

    waits = []
    for _ in range(5):
        waits.append(steps_to_next_probe(p, 4))
        p.observe_verification("a", 1, 1)
    assert waits == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY, PROBE_MAX, PROBE_MAX]


def test_drafting_time_is_priced_and_trees_cost_their_nodes():
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=6, tokens_per_depth=2.0)
    assert p.nodes(3, slots=12) == 6 and p.nodes(3, slots=4) == 4
    learned(p, "a", 6, 6)
    deep = p.plan(PassShape(1), [PlanRow("a", 10, 6)]).depths[0]
    for d in range(1, 7):  # drafting that costs ten passes per depth never pays
        p.observe_step(PassShape(1), 5e-3, 5e-2 * d, d)
    assert deep > 0 and p.plan(PassShape(1), [PlanRow("a", 10, 6)]).depths == [0]
    assert p.drafting_s(0) == 0.0


def test_a_tree_is_priced_at_the_nodes_it_drafts_within_its_budget():
    """A tree proposer with a budget of 3 nodes per depth that drafts single paths comes to be
    priced at one token per depth, and drafts deeper for it; the budget stays."""
    cost = linear_cost(2e-3, 1e-3)
    wide = SpeculationPlanner(cost, max_depth=8, tokens_per_depth=3.0)
    learned(wide, "a", 8, 6)
    before = wide.plan(PassShape(1), [PlanRow("a", 10, 8)]).depths[0]
    for _ in range(60):
        wide.observe_verification("a", 8, 6, num_nodes=8)  # one path of 8
    assert wide.width == pytest.approx(1.0, abs=0.01) and wide.nodes(4, slots=64) == 12
    assert wide.plan(PassShape(1), [PlanRow("a", 10, 8)]).depths[0] > before
    wide.observe_verification("a", 2, 1, num_nodes=40)  # more than the budget: priced at the budget
    assert wide.width <= 3.0


# ---- configuration ----------------------------------------------------------------------------

def test_auto_is_the_default_with_a_cap_per_method():
    c = SpeculativeConfig.from_dict({"method": "ngram"})
    assert c.adaptive and c.k == AUTO_MAX_SPECULATIVE_TOKENS["ngram"]
    assert SpeculativeConfig.from_dict({"method": "ngram", "max_speculative_tokens": 3}).k == 3
    fixed = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 5})
    assert not fixed.adaptive and fixed.k == 5
    with pytest.raises(InvalidParameterError, match="'auto'"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": "many"})
    with pytest.raises(InvalidParameterError, match="max_speculative_tokens"):
        SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 4, "max_speculative_tokens": 8})


def test_disable_by_batch_size_is_checked():
    assert SpeculativeConfig.from_dict({"method": "ngram"}).disable_by_batch_size is None
    assert SpeculativeConfig.from_dict({"method": "suffix", "disable_by_batch_size": 8}).disable_by_batch_size == 8
    for bad in (1, 0, True, 2.5, "4"):
        with pytest.raises(InvalidParameterError, match="disable_by_batch_size.*integer >= 2"):
            SpeculativeConfig.from_dict({"method": "ngram", "disable_by_batch_size": bad})


# ---- the engine -------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_adaptive_greedy_equals_plain_and_reports_the_chosen_depths(tiny, max_num_seqs):
    prompts = tiny_prompts(6)
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram"}, max_num_seqs=max_num_seqs)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone(tiny, prompts, GREEDY)
    stats = llm.engine.stats()
    assert sum(stats.draft_depth_counts) > 0 and "pass cost" in stats.cost_model
    assert len(stats.draft_depth_counts) == AUTO_MAX_SPECULATIVE_TOKENS["ngram"] + 1
    assert_all_blocks_free(llm)


def tiny_engine(tiny, cost: PassCostModel, **spec) -> LLM:
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", **spec}, max_num_seqs=4)
    llm.engine.planner.cost = cost
    return llm


def test_speculation_switches_off_where_it_does_not_pay_and_on_where_it_does(tiny, monkeypatch):
    """The same engine and prompts under two machines: on one a draft token costs a whole pass
    (drafting stops after the probes), on the other drafts are nearly free (drafting goes on).
    Outputs are plain's either way."""
    prompts = tiny_prompts(4)
    expected = alone(tiny, prompts, GREEDY)
    monkeypatch.setattr(cost_module, "LEARNING_RATE", 0.0)  # keep the made-up machine
    dear = tiny_engine(tiny, linear_cost(1e-3, 1e-3))
    outs = dear.generate(prompts, GREEDY, use_tqdm=False)
    chosen = dear.engine.stats().draft_depth_counts
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert sum(chosen[2:]) == 0 and chosen[1] <= sum(chosen) // (PROBE_EVERY - 1) + len(prompts)
    cheap = tiny_engine(tiny, linear_cost(1e-2, 1e-6))
    outs = cheap.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert cheap.engine.stats().mean_draft_depth > 1.0


def test_plans_price_drafts_against_the_decodes_not_a_prompt_chunk_beside_them(tiny, monkeypatch):
    """A long prompt prefilled in chunks while others decode: every plan is made over the
    decoding requests' roots alone (a chunk's time buys prompt tokens, and beside it draft rows
    would look nearly free), and the outputs are plain's."""
    prompts = tiny_prompts(3) + [list(range(2, 62)) + list(range(3, 50))]
    # Plain decoding in the same chunks is the reference (the torch path's sums follow the chunking).
    plain = LLM(loaded=tiny["loaded"], max_num_seqs=4, max_num_batched_tokens=24)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, GREEDY, use_tqdm=False)]
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram"}, max_num_seqs=4,
              max_num_batched_tokens=24)
    seen, step = [], {}
    real_plan, real_propose = llm.engine.planner.plan, llm.engine._propose

    def propose(scheduled):
        step["decoding"] = sum(not s.request.finished and s.samples for s in scheduled)
        step["chunk"] = any(not s.samples for s in scheduled)
        return real_propose(scheduled)

    def plan(base, rows):
        seen.append((base.num_tokens, step["decoding"], step["chunk"]))
        return real_plan(base, rows)

    monkeypatch.setattr(llm.engine.planner, "plan", plan)
    monkeypatch.setattr(llm.engine, "_propose", propose)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(n == decoding for n, decoding, _ in seen)
    assert any(chunk for _, _, chunk in seen)  # plans were made beside prompt chunks


def test_a_request_with_its_own_k_is_not_planned(tiny):
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram"}, max_num_seqs=2)
    llm.engine.add_request("fixed", tiny_prompts(1)[0], GREEDY, num_speculative_tokens=3)
    llm.engine.add_request("auto", tiny_prompts(2)[1], GREEDY)
    assert not llm.engine.requests["fixed"].adaptive and llm.engine.requests["auto"].adaptive
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    assert "fixed" not in llm.engine.planner.requests


def test_drafting_time_between_and_past_measured_depths():
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=8)
    p.observe_step(PassShape(1), 5e-3, 1e-3, 2)
    assert p.drafting_s(8) == pytest.approx(1e-3) and p.drafting_s(1) == pytest.approx(1e-3)  # one depth: flat
    p.observe_step(PassShape(1), 5e-3, 2e-3, 4)
    assert p.drafting_s(3) == pytest.approx(1.5e-3)  # between: interpolated
    assert p.drafting_s(6) == pytest.approx(3e-3)  # past: along the two nearest
    assert p.drafting_s(1) == pytest.approx(0.5e-3)


def test_a_probes_drafting_time_is_not_what_drafting_costs(tiny, monkeypatch):
    """A probe catches up on every token since the request last drafted: the step it drafts
    for teaches the pass cost and the probes' own average (probe_s), not the drafting time,
    which normal drafting steps set."""
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=4)
    p.observe_step(PassShape(2), 5e-3, 4e-3, 1, probe=True)
    assert p.proposer_s[1] is None and p.drafting_s(1) == 0.0 and p.probe_s == pytest.approx(4e-3)
    p.observe_step(PassShape(2), 5e-3, 1e-3, 1)
    p.observe_step(PassShape(2), 5e-3, 9e-3, 1, probe=True)
    assert p.drafting_s(1) == pytest.approx(1e-3) and p.probe_s == pytest.approx(4e-3 + 0.2 * 5e-3)
    # In the engine: the step verifying a probe's draft says so. (The made-up machine is kept:
    # learned from the tiny model's real passes, a draft token would cost next to nothing and
    # the request would draft on its own.)
    monkeypatch.setattr(cost_module, "LEARNING_RATE", 0.0)
    llm = tiny_engine(tiny, linear_cost(1e-3, 1e-3))
    engine = llm.engine
    seen = []
    orig = engine.planner.observe_step
    monkeypatch.setattr(engine.planner, "observe_step",
                        lambda shape, pass_s, drafting_s, deepest, probe=False: (
                            seen.append((probe, deepest)), orig(shape, pass_s, drafting_s, deepest, probe)))
    engine.planner.requests["r"] = AcceptanceEstimate(0.9, [50.0], [0.0])  # drafts never accepted: probes only
    engine.add_request("r", tiny_prompts(3)[2], GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    probed = [probe for probe, deepest in seen if deepest > 0]
    assert probed and all(probed)
    assert engine.planner.probe_s is not None and engine.planner.proposer_s[1] is None


def test_a_drafting_price_measured_on_a_busy_machine_comes_down_with_the_probes():
    """Depth 1 timed while something else held the cores (40 passes): the planner stops
    drafting, so that depth is never timed again by a drafting step. A probe drafts it too and
    catches up more: its time bounds the price from above, and drafting comes back. A probe
    dearer than the price leaves it as it is."""
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=4)
    learned(p, "a", 4, 4)
    p.observe_step(PassShape(2), 5e-3, 0.2, 1)
    assert p.plan(PassShape(1), [PlanRow("a", 10, 4)]).depths == [0]
    p.observe_step(PassShape(2), 5e-3, 0.5e-3, 1, probe=True)
    assert p.drafting_s(1) == pytest.approx(0.5e-3)
    assert p.plan(PassShape(1), [PlanRow("a", 10, 4)]).depths[0] > 0
    p.observe_step(PassShape(2), 5e-3, 3e-3, 1, probe=True)
    assert p.drafting_s(1) == pytest.approx(0.5e-3)
    # Deep steps timed under load, depth 1 never: its price is theirs until a probe bounds it.
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=4)
    learned(p, "a", 4, 4)
    p.observe_step(PassShape(5), 5e-3, 0.2, 4)
    assert p.drafting_s(1) == pytest.approx(0.2) and p.plan(PassShape(1), [PlanRow("a", 10, 4)]).depths == [0]
    p.observe_step(PassShape(2), 5e-3, 0.5e-3, 1, probe=True)
    assert p.drafting_s(1) == pytest.approx(0.5e-3) and p.plan(PassShape(1), [PlanRow("a", 10, 4)]).depths[0] > 0


def test_probes_cost_at_most_their_budget_of_the_time():
    """A probe whose drafting costs about four passes (a draft model catching up) comes at most
    once in 4 / PROBE_BUDGET steps, whatever its wait; a cheap one every PROBE_EVERY steps."""
    def first_probe(probe_s):
        p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=4)
        learned(p, "a", 4, 0)
        if probe_s is not None:
            p.observe_step(PassShape(1), 5e-3, probe_s, 1, probe=True)
        return steps_to_next_probe(p, 4, limit=10 * PROBE_MAX)

    assert first_probe(None) == first_probe(1e-5) == PROBE_EVERY
    pass_s = linear_cost(5e-3, 1e-4).predict(PassShape(1))
    assert first_probe(20e-3) == math.ceil(20e-3 / (PROBE_BUDGET * pass_s)) > 3 / PROBE_BUDGET


def test_many_requests_probe_together_within_one_budget():
    """32 requests whose drafts do not pay, joining one a step (so their waits end at different
    steps), a probing step's drafting as dear as four passes: the requests due probe in the same
    step, and probing steps come at most once in `floor` steps however many requests wait
    (each request's own wait alone let them probe in 32 different steps)."""
    p = SpeculationPlanner(linear_cost(5e-3, 1e-4), max_depth=4)
    rows = [PlanRow(f"r{i}", 10, 4) for i in range(32)]
    for r in rows:
        learned(p, r.request_id, 4, 0)
    p.observe_step(PassShape(32), 8e-3, 20e-3, 1, probe=True)
    floor = math.ceil(20e-3 / (PROBE_BUDGET * p.cost.predict(PassShape(32))))
    steps = 2 * floor
    probing_steps, probed = 0, set()
    for step in range(steps):
        joined = rows[:step + 1]
        depths = p.plan(PassShape(len(joined)), joined).depths
        probing_steps += any(depths)
        for r, d in zip(joined, depths):
            if d:
                probed.add(r.request_id)
                p.observe_verification(r.request_id, 1, 0)
    assert probing_steps <= steps // floor + 1 and len(probed) == len(rows)


def test_steps_take_exactly_the_drafts_the_planner_chose(tiny, monkeypatch):
    """Drafts live on the request: where drafting does not pay, the planner chooses no drafts
    or a probe's one, and each step takes exactly the nodes drafted (never the cap's 8 slots,
    which would shrink the prompt chunks sharing the step)."""
    monkeypatch.setattr(cost_module, "LEARNING_RATE", 0.0)
    llm = tiny_engine(tiny, linear_cost(1e-3, 1e-3))
    engine = llm.engine
    req = engine.add_request("r", tiny_prompts(3)[2], GREEDY)
    taken, drafted = [], []
    orig = engine.scheduler.schedule

    def schedule(*args):
        out = orig(*args)
        for s in out.decode:
            taken.append(s.num_draft)
            drafted.append(s.request.num_pending_drafts)
        return out
    monkeypatch.setattr(engine.scheduler, "schedule", schedule)
    while engine.has_unfinished_requests():
        engine.step()
    assert req.finished and taken == drafted
    assert max(taken) <= 1 and taken.count(0) > len(taken) // 2


def test_disable_by_batch_size_drafts_only_while_fewer_requests_run(tiny, monkeypatch):
    """vLLM's disable_by_batch_size: no drafting for a step while that many requests run, drafts
    again once fewer do (here the long request alone at the end); the output is plain's."""
    prompts = tiny_prompts(3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 6, 30)]
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 2})
    running = []  # requests running at each proposal
    draft = llm.engine._draft
    monkeypatch.setattr(llm.engine, "_draft", lambda batch: running.append(len(llm.engine.scheduler.running)) or draft(batch))
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [alone(tiny, [p], q)[0] for p, q in zip(prompts, params)]
    assert running and max(running) == 1  # drafted, and only with one request left
    assert_all_blocks_free(llm)
