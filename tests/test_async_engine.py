"""The engine thread behind the server, without HTTP: outputs stream through asyncio, leaving
early aborts, refusals surface where the request was made, capacity is enforced; and the
log probabilities the server reports are the same with speculation as without."""

import asyncio
import os
import subprocess
import sys
import threading

import pytest

from specserve.engine.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from specserve.errors import PromptError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)


@pytest.fixture
def engine(tiny):
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              max_num_seqs=4, max_model_len=128)
    eng = AsyncEngine(llm.engine)
    eng.start()
    yield llm, eng
    eng.shutdown()


def test_streamed_outputs_equal_offline(engine, tiny):
    llm, eng = engine
    prompts = [[5, 6, 7, 5, 6, 7], [9, 8, 7], [3] * 20]
    want = [o.outputs[0].token_ids for o in LLM(loaded=tiny["loaded"], max_num_seqs=1, max_model_len=128)
            .generate(prompts, GREEDY, use_tqdm=False)]

    async def run():
        async def one(i, p):
            outs = [o async for o in eng.generate(f"r{i}", p, GREEDY)]
            assert outs[-1].finished and not any(o.finished for o in outs[:-1])
            assert "".join(o.new_text for o in outs) == outs[-1].outputs[0].text
            return outs[-1].outputs[0].token_ids
        return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])

    assert asyncio.run(run()) == want
    assert not llm.engine.requests


def test_final_only_streams_yield_the_whole_answer_once(engine, tiny):
    """A whole response's stream carries only the finished output, which holds every token and
    the whole text, equal to the streamed request's last output."""
    llm, eng = engine
    prompts = [[5, 6, 7, 5, 6, 7], [9, 8, 7]]

    async def run():
        async def one(i, p, final_only):
            add = eng.submit(f"f{i}-{final_only}", p, GREEDY, final_only=final_only)
            return [o async for o in eng.stream(add)]
        return await asyncio.gather(*[one(i, p, f) for i, p in enumerate(prompts) for f in (False, True)])

    results = asyncio.run(run())
    for streamed, whole in zip(results[0::2], results[1::2]):
        assert len(streamed) > 1 and len(whole) == 1 and whole[0].finished
        assert whole[0].outputs[0].token_ids == streamed[-1].outputs[0].token_ids
        assert whole[0].outputs[0].text == streamed[-1].outputs[0].text == "".join(o.new_text for o in streamed)
    assert not llm.engine.requests


def test_a_steps_outputs_are_handed_over_as_the_next_pass_starts(engine, tiny, monkeypatch):
    """A step's output reaches the event loop when the next step's forward pass begins (where
    the engine thread releases the GIL), not while the engine thread still runs Python between
    the two; the last one at once, as nothing follows it; every token arrives, in order."""
    llm, eng = engine
    want = LLM(loaded=tiny["loaded"], max_num_seqs=1, max_model_len=128).generate([[9, 8, 7]], GREEDY, use_tqdm=False)
    step, calls = llm.engine.step, []
    between, go = threading.Event(), threading.Event()

    def paused():  # the engine thread waits before its second step
        calls.append(1)
        if len(calls) == 2:
            between.set()
            go.wait(30)
        return step()

    monkeypatch.setattr(llm.engine, "step", paused)

    async def run():
        add = eng.submit("h", [9, 8, 7], GREEDY)
        assert await asyncio.to_thread(between.wait, 30)
        await asyncio.sleep(0.05)  # time for a handed-over output to arrive
        early = add.outputs.qsize()
        go.set()
        return early, [o async for o in eng.stream(add)]

    early, outs = asyncio.run(run())
    assert early == 0  # the first step's output waited for the second step's pass
    assert len(outs) > 2 and outs[-1].finished and not any(o.finished for o in outs[:-1])
    assert outs[-1].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert "".join(o.new_text for o in outs) == outs[-1].outputs[0].text


def test_leaving_early_aborts_and_frees_blocks(engine):
    llm, eng = engine

    async def run():
        async for out in eng.generate("early", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True)):
            break  # the client went away after its first output
        while eng.snapshot.num_requests:
            await asyncio.sleep(0.01)

    asyncio.run(run())
    pool = llm.engine.scheduler.pool
    assert pool.num_available_blocks == pool.num_blocks and not llm.engine.requests


def test_an_aborted_stream_ends_with_its_last_output(engine):
    """abort(), then reading on: the stream's last output says "abort" and carries the tokens
    generated until then (what a server counts the request by)."""
    llm, eng = engine

    async def run():
        add = eng.submit("aborted", [5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True))
        outs = []
        async for out in eng.stream(add):
            outs.append(out)
            if len(outs) == 1:
                eng.abort("aborted")
        return outs

    outs = asyncio.run(run())
    last = outs[-1]
    assert last.finished and last.outputs[0].finish_reason == "abort" and not any(o.finished for o in outs[:-1])
    assert 1 <= len(last.outputs[0].token_ids) < 100 and last.metrics.num_generated_tokens == len(last.outputs[0].token_ids)
    assert not llm.engine.requests


def test_refusal_surfaces_in_the_caller(engine):
    _, eng = engine

    async def run():
        return [o async for o in eng.generate("long", list(range(2, 62)) * 3, GREEDY)]

    with pytest.raises(PromptError, match="context"):
        asyncio.run(run())


def test_capacity_counts_running_plus_waiting(tiny):
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=2, max_model_len=128)
    eng = AsyncEngine(llm.engine, max_waiting=1)  # not started: every submission stays pending

    async def run():
        for i in range(3):
            eng.submit(f"r{i}", [5, 6], GREEDY)
        with pytest.raises(QueueFullError, match="max-waiting"):
            eng.submit("r3", [5, 6], GREEDY)
        eng.stop_accepting()
        with pytest.raises(EngineStoppedError):
            eng.submit("r4", [5, 6], GREEDY)

    asyncio.run(run())


@pytest.mark.parametrize("spec", [{"method": "ngram", "num_speculative_tokens": 4},
                                  {"method": "ngram", "num_speculative_tokens": 4, "num_branches": 4}],
                         ids=["chain", "tree"])
def test_logprobs_are_the_same_with_and_without_speculation(tiny, spec):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    prompt = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]]
    plain = LLM(loaded=tiny["loaded"], max_model_len=128).generate(prompt, params, use_tqdm=False)[0].outputs[0]
    spec = LLM(loaded=tiny["loaded"], max_model_len=128, speculative_config=spec).generate(prompt, params, use_tqdm=False)[0]
    out = spec.outputs[0]
    assert spec.spec.num_accepted > 0  # drafts were verified, so rows past the first were used
    assert out.token_ids == plain.token_ids and len(out.logprobs) == 24
    for a, b in zip(out.logprobs, plain.logprobs):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 3
        assert a.top[0][0] == a.token_id  # greedy picks the most likely token


# In a fresh process (the OpenMP pools of this one depend on which tests ran before): build on
# a thread of its own, or on the main thread as the control, and count the process's threads.
_POOL_PROBE = """
import os, sys, time
from pathlib import Path
from specserve.engine.async_engine import build_off_thread
from specserve.llm import LLM
from specserve.model.loader import load_model
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
build = lambda: LLM(loaded=load_model(sys.argv[1], quantization="int8"), max_num_seqs=2)
llm = build_off_thread(build) if sys.argv[2] == "off" else build()
deadline = time.monotonic() + 10
while threads() > before and sys.argv[2] == "off" and time.monotonic() < deadline:
    time.sleep(0.05)  # the builder's pool workers leave as it ends
import torch
print(threads() - before, torch.get_num_threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc (Linux)")
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one CPU: no OpenMP pool to leave behind")
def test_building_off_thread_leaves_no_openmp_pool_behind(tiny, tmp_path):
    """The server builds the engine with build_off_thread so that its engine thread is the only
    OpenMP master (two masters make libgomp throttle its spin-wait: 3x slower passes). Built on
    the main thread, a worker stays behind (the control shows the count can fail)."""
    from specserve import native

    if native.load() is None:
        pytest.skip(f"native kernels unavailable: {native.unavailable_reason()}")
    extra, workers = {}, {}
    for where in ("off", "main"):
        out = subprocess.run([sys.executable, "-c", _POOL_PROBE, tiny["target"], where], capture_output=True,
                             text=True, check=True)
        extra[where], threads = map(int, out.stdout.split()[-2:])
        workers[where] = threads - 1  # a pool's workers beside its master
    assert workers["main"] >= 1
    assert extra == {"off": 0, "main": workers["main"]}


def test_build_off_thread_hands_back_the_result_or_the_error():
    from specserve.engine.async_engine import build_off_thread

    assert build_off_thread(lambda: threading.current_thread().name) == "specserve-build"
    with pytest.raises(PromptError, match="bad"):
        build_off_thread(lambda: (_ for _ in ()).throw(PromptError("bad")))
