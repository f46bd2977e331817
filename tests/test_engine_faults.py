"""One request's failure never stops the engine for the others.

A request whose serving raises, wherever it raises (its sampling parameters past validation, the
proposer, the sampler, the shared forward pass, detokenization and stop rules, the proposer's
feedback), ends alone with finish_reason "error"; the requests that shared its steps finish with
exactly the output they have alone, and the KV pool is whole afterwards."""

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specserve.engine import engine as engine_module
from specserve.errors import InvalidParameterError
from specserve.llm import LLM
from specserve.sample.logits import SamplingTensors
from specserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=3, max_tokens=8, ignore_eos=True)
GOOD = [([5, 6, 7, 5, 6, 7, 5], GREEDY), ([9, 8, 7, 9, 8, 7], SEEDED)]
BAD_PROMPT = [60, 61, 60, 61, 60]
FIELDS = ["temperature", "top_p", "top_k", "min_p", "max_tokens", "stop", "stop_token_ids", "seed",
          "logprobs", "ignore_eos"]
# Values of any type and size, as a client could never send them past validation.
WILD = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(), st.text(max_size=3),
                 st.lists(st.integers(-2**70, 2**70), max_size=3), st.lists(st.text(max_size=3), max_size=3))
# Read by the step's per-request phases (sampling tensors, sampling, stop rules, log probabilities).
STEP_FIELDS = ["temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "logprobs", "ignore_eos"]


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", "num_speculative_tokens": 3},
               max_num_seqs=4, max_model_len=64)


@pytest.fixture(scope="module")
def alone(llm):
    """Each good request's output when it runs alone."""
    return [llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p, params in GOOD]


def run(llm, bad_params=None, setup=None):
    """The good requests with a bad one in their steps -> (good outputs' token ids, the bad
    request, the good requests). `setup(engine, bad)` corrupts the bad request or returns a
    context that injects a failure while the requests run."""
    engine = llm.engine
    good = [engine.add_request(f"good{i}", p, params) for i, (p, params) in enumerate(GOOD)]
    bad = engine.add_request("bad", BAD_PROMPT, bad_params or SamplingParams(temperature=0.7, max_tokens=12))
    with (setup(engine, bad) if setup else None) or contextlib.nullcontext():
        while engine.has_unfinished_requests():
            engine.step()
    for r in good + [bad]:
        engine.pop_finished(r.request_id)
    return [r.output_token_ids for r in good], bad, good


def assert_whole(llm):
    engine = llm.engine
    pool = engine.scheduler.pool
    engine.scheduler.kv.check_invariants()
    assert pool.num_available_blocks == pool.num_blocks and not engine.requests
    assert not engine.scheduler.running and not engine.scheduler.waiting


def raise_if(cond, fn, message: str, after: bool = False):
    """fn, raising RuntimeError(message) when cond(*args) holds (after calling fn, if `after`)."""
    def wrapped(*args, **kwargs):
        out = fn(*args, **kwargs) if after else None
        if cond(*args, **kwargs):
            raise RuntimeError(message)
        return out if after else fn(*args, **kwargs)
    return wrapped


def injected(kind: str):
    """setup(engine, bad) for run(): a failure raised where the bad request is served."""
    def setup(engine, bad):
        mp = pytest.MonkeyPatch()
        message = f"injected {kind} failure"
        holds_bad = lambda params: any(p is bad.params for p in params)  # noqa: E731
        if kind == "propose":
            mp.setattr(engine.proposer, "propose", raise_if(lambda batch: any(r.request_id == "bad" for r in batch),
                                                            engine.proposer.propose, message))
        elif kind == "sampling_tensors":
            mp.setattr(SamplingTensors, "from_params", classmethod(raise_if(
                lambda cls, params, device: holds_bad(params), SamplingTensors.from_params.__func__, message)))
        elif kind == "sample":  # after the batch drew its random numbers
            mp.setattr("specserve.engine.engine.verify_flat", raise_if(
                lambda *args: holds_bad(args[3]), engine_module.verify_flat, message, after=True))
        elif kind == "forward":
            kv = engine.scheduler.kv
            mp.setattr(engine.runner, "forward_rows", raise_if(
                lambda batch, num_logits: "bad" in kv and kv.block_table("bad") in batch.locations,
                engine.runner.forward_rows, message))
        elif kind == "detokenize":
            mp.setattr(bad.detokenizer, "step", raise_if(lambda ids: True, bad.detokenizer.step, message))
        elif kind == "observe":
            mp.setattr(engine.proposer, "observe", raise_if(lambda feedback: "bad" in feedback.request_ids,
                                                            engine.proposer.observe, message))
        return contextlib.closing(_Undo(mp))
    return setup


class _Undo:
    def __init__(self, mp: pytest.MonkeyPatch):
        self.mp = mp

    def close(self) -> None:
        self.mp.undo()


KINDS = ["propose", "sampling_tensors", "sample", "forward", "detokenize", "observe"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_in_any_phase_fails_that_request_alone(llm, alone, kind):
    """"sample" fails after the batch drew its random numbers: the seeded good request is
    computed again, and its noise depends only on (seed, position), so its sample is still the
    one it gets alone."""
    outputs, bad, good = run(llm, setup=injected(kind))
    assert bad.finish_reason == "error" and f"injected {kind} failure" in bad.error
    assert outputs == alone and all(r.finish_reason == "length" for r in good)
    assert_whole(llm)


def test_top_k_past_int64_fails_alone_and_is_refused_at_the_edge(llm, alone):
    """The reported crash: top_k = 2**63 made SamplingTensors raise inside the step. It is
    refused when the request is made, and were it to slip past, only its request fails."""
    with pytest.raises(InvalidParameterError, match="top_k"):
        SamplingParams(temperature=1.0, top_k=2**63)
    outputs, bad, _ = run(llm, setup=lambda engine, bad: setattr(bad.params, "top_k", 2**63))
    assert bad.finish_reason == "error" and "Overflow" in bad.error
    assert outputs == alone
    assert_whole(llm)


def test_stop_token_ids_must_be_in_the_vocabulary(llm):
    with pytest.raises(InvalidParameterError, match=r"stop_token_ids.*\[0, 64\)"):
        llm.generate([[5, 6]], SamplingParams(stop_token_ids=[64]), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="at most 16"):
        SamplingParams(stop_token_ids=list(range(17)))
    assert_whole(llm)


@settings(max_examples=20, deadline=None, database=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(field=st.sampled_from(FIELDS), value=WILD, when=st.sampled_from(["before_add", "in_step"]),
       step_field=st.sampled_from(STEP_FIELDS), inject=st.sampled_from([None] + KINDS))
def test_arbitrary_values_and_failures_never_stop_the_engine(llm, alone, field, value, when, step_field, inject):
    """Values of any type set without validation: before the request is added (the engine
    checks them again and refuses bad ones with a message), or in the engine's own copy while
    the request runs, as a value that slipped past validation would be (for the fields the
    step's per-request phases read), possibly with an injected failure on top. The engine goes
    on, the good requests' outputs are what they are alone, and the pool is whole."""
    params = SamplingParams(temperature=0.7, max_tokens=12)
    if when == "before_add":
        object.__setattr__(params, field, value)
        try:
            llm.engine.check_params(params)
        except InvalidParameterError as e:
            with pytest.raises(InvalidParameterError, match=e.param):
                llm.engine.add_request("refused", BAD_PROMPT, params)
            assert_whole(llm)
            return
        setup = injected(inject) if inject else None
    else:
        def setup(engine, bad):
            object.__setattr__(bad.params, step_field, value)
            return injected(inject)(engine, bad) if inject else None
    outputs, bad, _ = run(llm, params, setup)
    assert outputs == alone
    assert bad.finished and (bad.finish_reason != "error" or bad.error)
    assert_whole(llm)
