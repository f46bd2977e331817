"""The draft model's own paged KV pool (float32, greedy, tiny random models): batched drafting
never changes the output, every draft block returns to the pool on finish and abort, and a draft
pool short of blocks makes a request skip drafting instead of failing."""


import pytest

from specserve.config import EngineConfig
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.spec import SpecRequest
from specserve.spec.draft_model import DraftModelProposer
from tests.helpers import generate_ids, ragged_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def run(llm, prompts, params=GREEDY):
    return generate_ids(llm, prompts, params)


def plain_greedy(tiny, prompts, params=GREEDY):
    return run(LLM(loaded=tiny["loaded"], max_num_seqs=1, max_model_len=128), prompts, params)


def draft_llm(tiny, model="draft", k=3, **kw):
    spec = {"method": "draft_model", "num_speculative_tokens": k, "model": tiny[model]}
    return LLM(loaded=tiny["loaded"], speculative_config=spec, max_model_len=128, **kw)


def assert_draft_pool_free(proposer: DraftModelProposer):
    pool = proposer.pool
    assert pool.num_free_blocks == pool.num_blocks and pool.usage == 0
    proposer.kv.check_invariants()
    assert not proposer.kv.requests and not proposer.cached


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(12, seed=2, hi=60)


@pytest.fixture(scope="module")
def expected(tiny, prompts):
    return plain_greedy(tiny, prompts)


@pytest.mark.parametrize("max_num_seqs", [8, 1])
def test_greedy_draft_speculation_equals_plain(tiny, prompts, expected, max_num_seqs):
    # Blocks of 4 tokens: every request's draft cache spans many blocks and rolls back across
    # block boundaries.
    llm = draft_llm(tiny, max_num_seqs=max_num_seqs, block_size=4)
    proposer = llm.engine.proposer
    assert proposer.pool.num_blocks == llm.engine.scheduler.pool.num_blocks
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = LLM.aggregate_spec_stats(outs)
    assert stats.num_drafted > 0 and 0 < stats.num_accepted < stats.num_drafted
    assert_draft_pool_free(proposer)


def test_draft_identical_to_target_accepts_everything(tiny, prompts, expected):
    llm = draft_llm(tiny, model="target", k=4, max_num_seqs=8, block_size=4)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    stats = LLM.aggregate_spec_stats(outs)
    assert stats.num_drafted > 0 and stats.acceptance_rate == 1.0
    assert_draft_pool_free(llm.engine.proposer)


def test_aborts_midway_free_every_draft_block(tiny, prompts, expected):
    llm = draft_llm(tiny, max_num_seqs=4, block_size=4)
    engine, proposer = llm.engine, llm.engine.proposer
    reqs = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
    aborted: set[str] = set()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        proposer.kv.check_invariants()
        assert set(proposer.kv.requests) <= {r.request_id for r in engine.scheduler.running}
        if steps % 3 == 0 and proposer.kv.requests:  # abort a request that holds draft blocks
            rid = sorted(proposer.kv.requests)[0]
            assert proposer.kv.block_table(rid)
            engine.abort_request(rid)
            aborted.add(rid)
    assert len(aborted) >= 3
    for i, r in enumerate(reqs):
        if r.request_id not in aborted:
            assert r.output_token_ids == expected[i]
    assert_draft_pool_free(proposer)

    # Everything aborted at once, midway through drafting.
    reqs = [engine.add_request(f"again-{i}", p, GREEDY) for i, p in enumerate(prompts)]
    while not proposer.kv.requests:
        engine.step()
    engine.step()
    for r in reqs:
        engine.abort_request(r.request_id)
    assert not engine.has_unfinished_requests()
    assert_draft_pool_free(proposer)


def spec_request(rid, tokens, k):
    return SpecRequest(rid, tokens, k, GREEDY, None)


def test_short_draft_pool_drafts_nothing_for_that_request(tiny):
    # 4 blocks of 4 tokens, the least that holds one request at max_model_len 16.
    small = DraftModelProposer(tiny["loaded_draft"], tiny["loaded"],
                               EngineConfig(max_model_len=16, max_num_seqs=4, block_size=4, num_kv_blocks=4))
    roomy = DraftModelProposer(tiny["loaded_draft"], tiny["loaded"],
                               EngineConfig(max_model_len=16, max_num_seqs=4, block_size=4))
    a, b, c = ragged_prompts(3, seed=7, lo=5, hi=6)
    # 5 prompt tokens + 2 fed drafts = 7 slots = 2 blocks each: a and b fill the pool.
    batch = [spec_request("a", a, 3), spec_request("b", b, 3), spec_request("c", c, 3)]
    got, want = small.propose(batch), roomy.propose(batch)
    assert got.num_draft.tolist() == [3, 3, 0]
    assert got.draft_token_ids[:2].tolist() == want.draft_token_ids[:2].tolist()
    assert got.draft_token_ids[2].tolist() == [-1, -1, -1]
    assert small.pool.num_free_blocks == 0 and small.kv.block_table("c") == []
    small.kv.check_invariants()

    # Once a finishes, c drafts what the roomy pool drafts.
    small.remove_request("a")
    got = small.propose([spec_request("c", c, 3)])
    assert got.num_draft.tolist() == [3]
    assert got.draft_token_ids[0].tolist() == want.draft_token_ids[2].tolist()

    # b grows past what is left (12 tokens + 2 fed drafts need 4 blocks): it drafts nothing and
    # gives its 2 blocks back; with its cache gone it recomputes everything once there is room.
    longer_b = b + want.draft_token_ids[1].tolist() + [7, 8, 9, 10]
    got = small.propose([spec_request("b", longer_b, 3), spec_request("c", c, 2)])
    assert got.num_draft.tolist() == [0, 2]
    assert small.kv.block_table("b") == [] and small.pool.num_free_blocks == 2
    small.remove_request("c")
    got, want = small.propose([spec_request("b", longer_b, 3)]), roomy.propose([spec_request("b", longer_b, 3)])
    assert got.num_draft.tolist() == [3]
    assert got.draft_token_ids.tolist() == want.draft_token_ids.tolist()
    small.remove_request("b")
    assert_draft_pool_free(small)


def test_draft_pool_short_under_target_prefix_sharing(tiny):
    """The target shares a long system prompt's blocks between requests, the draft does not:
    with the same block count the draft pool runs short, requests skip drafting, and the
    output stays the plain greedy output."""
    system = ragged_prompts(1, seed=9, lo=40, hi=41)[0]
    prompts = [system + p for p in ragged_prompts(8, seed=4, lo=1, hi=6)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = plain_greedy(tiny, prompts, params)
    llm = draft_llm(tiny, max_num_seqs=4, block_size=4, num_kv_blocks=32)
    proposer = llm.engine.proposer
    shortages = 0
    allocate = proposer.kv.allocate_slots

    def counting_allocate(*args):
        nonlocal shortages
        ok = allocate(*args)
        shortages += not ok
        return ok

    proposer.kv.allocate_slots = counting_allocate
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert shortages > 0 and LLM.aggregate_spec_stats(outs).num_drafted > 0
    assert llm.engine.scheduler.pool.prefix_cache_stats().hit_blocks > 0
    assert_draft_pool_free(proposer)
