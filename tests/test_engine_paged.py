"""The paged, continuously batched engine end to end on a tiny random model (float32, greedy):
batches, chunked prefill, preemption and prefix caching never change a request's output, and
every KV block returns to the pool."""

import random

import pytest
import torch

from specserve.engine.scheduler import MIN_PROMPT_CHUNK
from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.helpers import generate_ids, ragged_prompts

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def run(llm, prompts, params=GREEDY):
    return generate_ids(llm, prompts, params)


def alone(tiny, prompts, params=GREEDY):
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=1, max_model_len=128, enable_prefix_caching=False)
    return [run(llm, [p], params)[0] for p in prompts]


def assert_all_blocks_free(llm):
    pool = llm.engine.scheduler.pool
    assert pool.num_available_blocks == pool.num_blocks and pool.usage == 0
    pool.check_invariants()
    assert not llm.engine.scheduler.kv.requests


SPECS = {
    "plain": None,
    "ngram": {"method": "ngram", "num_speculative_tokens": 4},
    "draft_model": {"method": "draft_model", "num_speculative_tokens": 3, "model": "draft"},
}


@pytest.fixture(scope="module")
def prompts32():
    return ragged_prompts(32, seed=1)


@pytest.fixture(scope="module")
def expected32(tiny, prompts32):
    return alone(tiny, prompts32)


def spec_of(tiny, name):
    spec = SPECS[name]
    if spec and spec.get("model") == "draft":
        spec = {**spec, "model": tiny["draft"]}
    return spec


@pytest.mark.parametrize("name", list(SPECS))
def test_batch_of_32_equals_each_alone(tiny, prompts32, expected32, name):
    llm = LLM(loaded=tiny["loaded"], speculative_config=spec_of(tiny, name), max_num_seqs=32, max_model_len=128)
    assert run(llm, prompts32) == expected32
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", list(SPECS))
def test_small_pool_forces_preemption_and_changes_nothing(tiny, prompts32, expected32, name):
    # 12 blocks of 16 tokens: a single request at full context (128) needs 8.
    llm = LLM(loaded=tiny["loaded"], speculative_config=spec_of(tiny, name), max_num_seqs=32, max_model_len=128,
              num_kv_blocks=12)
    assert run(llm, prompts32) == expected32
    assert llm.engine.scheduler.num_preemptions > 0
    assert_all_blocks_free(llm)


@pytest.mark.parametrize("name", ["plain", "ngram"])
def test_chunked_prefill_under_a_small_token_budget(tiny, prompts32, expected32, name):
    llm = LLM(loaded=tiny["loaded"], speculative_config=spec_of(tiny, name), max_num_seqs=8, max_model_len=128,
              max_num_batched_tokens=12)
    engine = llm.engine
    for i, p in enumerate(prompts32):
        engine.add_request(str(i), p, GREEDY)
    chunked = False
    while engine.has_unfinished_requests():
        sched_tokens = []
        original = engine.scheduler.schedule

        def spy(*args):
            out = original(*args)
            sched_tokens.append(out.num_batched_tokens)
            return out
        engine.scheduler.schedule = spy
        engine.step()
        engine.scheduler.schedule = original
        assert sched_tokens[0] <= 12
        chunked |= any(0 < r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.scheduler.running)
    assert chunked
    assert [engine.requests[str(i)].output_token_ids for i in range(32)] == expected32


@pytest.mark.parametrize("name", ["plain", "ngram"])
def test_step_time_bound_chunks_prompts_beside_decodes_and_changes_nothing(tiny, name):
    """A bound no step can keep (a microsecond): every prompt chunk computed beside a decoding
    request is the minimum, the first of the step only; greedy outputs are each prompt's alone."""
    prompts = ragged_prompts(4, seed=3, lo=2, hi=6) + ragged_prompts(8, seed=4, lo=40, hi=100)
    expected = alone(tiny, prompts)
    llm = LLM(loaded=tiny["loaded"], speculative_config=spec_of(tiny, name), max_num_seqs=6, max_model_len=128,
              max_step_ms=1e-3)
    engine = llm.engine
    original = engine.scheduler.schedule
    beside = []

    def spy(predict):
        out = original(predict)
        if out.decode:
            beside.append([s.num_new_tokens for s in out.prefill])
        return out
    engine.scheduler.schedule = spy
    assert staggered(engine, prompts) == expected
    assert any(beside) and all(len(c) <= 1 and all(n <= MIN_PROMPT_CHUNK for n in c) for c in beside)
    assert_all_blocks_free(llm)
    # The same with the bound off: prompts take the whole budget beside the decodes.
    free = LLM(loaded=tiny["loaded"], speculative_config=spec_of(tiny, name), max_num_seqs=6, max_model_len=128,
               max_step_ms=0)
    assert free.engine.cost is None or name != "plain"
    assert staggered(free.engine, prompts) == expected


def staggered(engine, prompts: list[list[int]]) -> list[list[int]]:
    """The short prompts first; the long ones arrive while those decode."""
    for i, p in enumerate(prompts[:4]):
        engine.add_request(str(i), p, GREEDY)
    engine.step()
    engine.step()
    for i, p in enumerate(prompts[4:], 4):
        engine.add_request(str(i), p, GREEDY)
    while engine.has_unfinished_requests():
        engine.step()
    return [engine.requests[str(i)].output_token_ids for i in range(len(prompts))]


def test_prefix_caching_on_a_shared_system_prompt(tiny):
    system = ragged_prompts(1, seed=9, lo=50, hi=51)[0]
    prompts = [system + p for p in ragged_prompts(12, seed=4, lo=1, hi=20)]
    expected = alone(tiny, prompts)
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, max_model_len=128)
    assert run(llm, prompts) == expected
    stats = llm.engine.scheduler.pool.prefix_cache_stats()
    assert stats.hit_rate > 0 and stats.hit_blocks >= 3 * 8  # later requests reuse the 3 full system blocks
    assert_all_blocks_free(llm)


def test_thousand_requests_with_aborts_leave_every_block_free(tiny):
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              max_num_seqs=16, max_model_len=64, num_kv_blocks=24, block_size=4)
    engine, pool = llm.engine, llm.engine.scheduler.pool
    cache_bytes = engine.runner.cache.nbytes()
    rng = random.Random(0)
    prompts = ragged_prompts(1000, seed=5, lo=1, hi=30)
    pending = list(enumerate(prompts))
    live: set[str] = set()
    finished = aborted = 0
    while pending or engine.has_unfinished_requests():
        while pending and len(live) < 40:
            i, p = pending.pop()
            engine.add_request(str(i), p, SamplingParams(temperature=0, max_tokens=rng.randrange(1, 12)))
            live.add(str(i))
        for out in engine.step():
            if out.finished:
                live.discard(out.request_id)
                engine.pop_finished(out.request_id)
                finished += 1
        if live and rng.random() < 0.2:  # abort a random live request, running or waiting
            rid = rng.choice(sorted(live))
            engine.abort_request(rid)
            engine.pop_finished(rid)
            live.discard(rid)
            aborted += 1
        assert pool.num_blocks == 24 and engine.runner.cache.nbytes() == cache_bytes
        pool.check_invariants()
    assert finished + aborted == 1000 and aborted > 50
    assert_all_blocks_free(llm)


def test_pool_smaller_than_one_request_is_refused(tiny):
    with pytest.raises(InvalidParameterError, match="num_kv_blocks.*needs 8"):
        LLM(loaded=tiny["loaded"], max_model_len=128, num_kv_blocks=7)
    with pytest.raises(InvalidParameterError, match="kv_cache_memory"):
        LLM(loaded=tiny["loaded"], max_model_len=128, kv_cache_memory=1000)


def test_pool_sized_from_a_memory_budget(tiny):
    cfg = tiny["loaded"].config
    per_block = 2 * cfg.num_layers * 16 * cfg.num_kv_heads * cfg.head_dim * 4
    llm = LLM(loaded=tiny["loaded"], max_model_len=128, kv_cache_memory=per_block * 21)
    assert llm.engine.scheduler.pool.num_blocks == 20  # one block's worth goes to the trash block
    assert llm.engine.runner.cache.nbytes() <= per_block * 21


def test_sampled_batch_is_reproducible_per_seed(tiny, prompts32):
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    a = run(LLM(loaded=tiny["loaded"], max_num_seqs=32, max_model_len=128), prompts32, params)
    b = run(LLM(loaded=tiny["loaded"], max_num_seqs=5, max_model_len=128), prompts32, params)
    assert a == b  # per-request generators: the batch around a request does not change its sample
    assert torch.tensor([len(x) for x in a]).eq(12).all()


def test_requests_with_different_k_share_steps(tiny, prompts32, expected32):
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", "num_speculative_tokens": 4},
              max_num_seqs=32, max_model_len=128)
    engine = llm.engine
    reqs = [engine.add_request(str(i), p, GREEDY, num_speculative_tokens=[0, 1, 2, 4, 7][i % 5])
            for i, p in enumerate(prompts32)]
    mixed = False
    while engine.has_unfinished_requests():
        decoding = [r for r in engine.scheduler.running if r.num_tokens - r.num_computed_tokens == 1]
        mixed |= len({r.num_speculative_tokens for r in decoding}) >= 3
        engine.step()
    assert mixed
    assert [r.output_token_ids for r in reqs] == expected32
    assert reqs[0].spec.num_drafted == 0 and reqs[4].spec.num_drafted > 0
    with pytest.raises(InvalidParameterError, match="num_speculative_tokens"):
        engine.add_request("bad", [3, 4], GREEDY, num_speculative_tokens=-1)
    plain = LLM(loaded=tiny["loaded"], max_model_len=128)
    with pytest.raises(InvalidParameterError, match="speculative_config"):
        plain.engine.add_request("bad", [3, 4], GREEDY, num_speculative_tokens=2)


def test_pool_sized_from_a_fraction_of_free_memory(tiny):
    llm = LLM(loaded=tiny["loaded"], max_model_len=128, kv_cache_memory=0.001)
    assert llm.engine.scheduler.pool.num_blocks >= 8
    with pytest.raises(InvalidParameterError, match="fraction of free memory"):
        LLM(loaded=tiny["loaded"], max_model_len=128, kv_cache_memory=1.5)
