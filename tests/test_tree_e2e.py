"""Tree speculation end to end (n-gram tree mode, float32, greedy): exactly the plain greedy
output, alone and in batches on the paged engine, under preemption, chunked prefill and prefix
caching; stale tree entries are never read; seeded sampling is reproducible."""

from __future__ import annotations

import pytest
import torch

import specserve.engine.engine as engine_module
from specserve.llm import LLM
from specserve.model.paged_kv import PagedKVCache
from specserve.sampling_params import SamplingParams
from tests.helpers import generate_ids, ragged_prompts
from tests.test_engine_paged import alone, assert_all_blocks_free
from tests.test_spec_e2e import assert_smollm_greedy_equals_plain, tiny_prompts

TREE = {"method": "ngram", "num_speculative_tokens": 4, "num_branches": 4}
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture
def counts(monkeypatch):
    """Counts verifications of branching trees and tree compactions (accepted paths not in place)."""
    seen = {"trees": 0, "moves": 0}
    verify, move = engine_module.verify_flat, PagedKVCache.move

    def counting_verify(trees, *args):
        seen["trees"] += any(not t.is_chain for t in trees)
        return verify(trees, *args)

    def counting_move(self, *args):
        seen["moves"] += 1
        return move(self, *args)
    monkeypatch.setattr(engine_module, "verify_flat", counting_verify)
    monkeypatch.setattr(PagedKVCache, "move", counting_move)
    return seen


@pytest.fixture(scope="module")
def prompts32():
    return ragged_prompts(32, seed=1)


@pytest.fixture(scope="module")
def expected32(tiny, prompts32):
    return alone(tiny, prompts32)


@pytest.mark.parametrize("max_num_seqs", [1, 4])
def test_tiny_tree_greedy_equals_plain(tiny, counts, max_num_seqs):
    prompts = tiny_prompts(8)
    params = SamplingParams(temperature=0, max_tokens=48)
    plain = generate_ids(LLM(loaded=tiny["loaded"], max_num_seqs=1), prompts, params)
    llm = LLM(loaded=tiny["loaded"], speculative_config=TREE, max_num_seqs=max_num_seqs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert counts["trees"] > 0 and counts["moves"] > 0
    assert LLM.aggregate_spec_stats(outs).num_accepted > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("setting", ["batch", "preemption", "chunked_prefill"])
def test_batch_of_32_with_trees_equals_each_alone(tiny, counts, prompts32, expected32, setting):
    kwargs = {"batch": {}, "preemption": {"num_kv_blocks": 12},
              "chunked_prefill": {"max_num_batched_tokens": 12, "max_num_seqs": 8}}[setting]
    llm = LLM(loaded=tiny["loaded"], speculative_config=TREE, **{"max_num_seqs": 32, "max_model_len": 128, **kwargs})
    assert generate_ids(llm, prompts32, GREEDY) == expected32
    assert counts["trees"] > 0
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


def test_trees_with_prefix_caching_on_a_shared_system_prompt(tiny, counts):
    system = ragged_prompts(1, seed=9, lo=50, hi=51)[0]
    prompts = [system + p for p in ragged_prompts(12, seed=4, lo=1, hi=20)]
    expected = alone(tiny, prompts)
    llm = LLM(loaded=tiny["loaded"], speculative_config=TREE, max_num_seqs=4, max_model_len=128)
    assert generate_ids(llm, prompts, GREEDY) == expected
    assert llm.engine.scheduler.pool.prefix_cache_stats().hit_blocks >= 3 * 8
    assert counts["trees"] > 0
    assert_all_blocks_free(llm)


def test_stale_tree_entries_are_never_read(tiny, counts):
    """Poison every slot past each request's computed length after every step (as
    test_spec_e2e does for chains): rejected branches and the moved-from entries of accepted
    paths must never be read."""
    prompts = tiny_prompts(6, seed=3)
    plain = generate_ids(LLM(loaded=tiny["loaded"], max_num_seqs=1), prompts, GREEDY)
    llm = LLM(loaded=tiny["loaded"], speculative_config=TREE, max_num_seqs=6)
    engine, cache = llm.engine, llm.engine.runner.cache
    reqs = [engine.add_request(str(i), p, GREEDY) for i, p in enumerate(prompts)]
    while engine.has_unfinished_requests():
        engine.step()
        for r in reqs:
            if r.request_id in engine.scheduler.kv:
                table = engine.scheduler.block_table(r)
                slots = (torch.tensor(table)[:, None] * cache.block_size + torch.arange(cache.block_size)).flatten()
                for layer in range(cache.k.shape[0]):
                    cache.k_slots[layer][slots[r.num_computed_tokens:]] = 1e3
                    cache.v_slots[layer][slots[r.num_computed_tokens:]] = 1e3
    assert [r.output_token_ids for r in reqs] == plain
    assert counts["trees"] > 0 and counts["moves"] > 0


def test_seeded_sampling_with_trees_is_reproducible(tiny, counts, prompts32):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    a = generate_ids(LLM(loaded=tiny["loaded"], speculative_config=TREE, max_num_seqs=32, max_model_len=128), prompts32, params)
    b = generate_ids(LLM(loaded=tiny["loaded"], speculative_config=TREE, max_num_seqs=5, max_model_len=128), prompts32, params)
    assert a == b and all(len(x) == 16 for x in a)
    assert counts["trees"] > 0


@pytest.mark.slow
def test_smollm_tree_greedy_equals_plain(smollm_native, counts):
    for max_num_seqs in (1, 3):
        assert_smollm_greedy_equals_plain(smollm_native, TREE, max_num_seqs=max_num_seqs, max_tokens=32)
    assert counts["trees"] > 0
