"""Generation semantics on the offline API: stop rules, limits, seeds, streaming, bad input."""

import pytest

from specserve.errors import InvalidParameterError, PromptError
from specserve.llm import LLM
from specserve.model.loader import load_model
from specserve.sampling_params import SamplingParams
from tests.helpers import make_tiny_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    folder = make_tiny_checkpoint(tmp_path_factory.mktemp("gen") / "m", vocab_size=64, seed=3)
    return LLM(loaded=load_model(folder), max_model_len=64, max_num_seqs=4)


PROMPT = [5, 9, 12, 5, 9]


def greedy(llm, **kw):
    return llm.generate([PROMPT], SamplingParams(temperature=0, **kw), use_tqdm=False)[0].outputs[0]


def test_max_tokens_and_length_finish(llm):
    out = greedy(llm, max_tokens=7, ignore_eos=True)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def test_stop_token_ids_end_generation_at_that_token(llm):
    full = greedy(llm, max_tokens=20, ignore_eos=True).token_ids
    stop_at = full[5]
    first = full.index(stop_at)
    out = greedy(llm, max_tokens=20, ignore_eos=True, stop_token_ids=[stop_at])
    assert out.token_ids == full[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_stop_strings_truncate_text(llm):
    full = greedy(llm, max_tokens=20, ignore_eos=True)
    words = full.text.split()
    stop = " ".join(words[3:5])
    out = greedy(llm, max_tokens=20, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.index(stop)]
    assert stop not in out.text


def test_eos_stops_unless_ignored(llm):
    eos = 1  # "</s>" in the tiny tokenizer; this prompt's greedy continuation reaches it at step 16
    assert llm.tokenizer.eos_token_ids == {eos}
    params = dict(temperature=0, max_tokens=40)
    full = llm.generate([[2, 3, 4, 5]], SamplingParams(**params, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    out = llm.generate([[2, 3, 4, 5]], SamplingParams(**params), use_tqdm=False)[0].outputs[0]
    assert eos in full.token_ids and len(full.token_ids) == 40
    assert out.token_ids == full.token_ids[: full.token_ids.index(eos) + 1] and out.finish_reason == "stop"


def test_context_limit_finishes_with_length(llm):
    out = llm.generate([list(range(2, 60))], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 64 - 58 and out.finish_reason == "length"


def test_same_seed_same_output_and_batch_independence(llm):
    p = SamplingParams(temperature=1.0, top_k=20, top_p=0.95, min_p=0.01, max_tokens=16, seed=7, ignore_eos=True)
    a = llm.generate([PROMPT], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([[3, 4], PROMPT, [8]], p, use_tqdm=False)[1].outputs[0].token_ids
    c = llm.generate([PROMPT], SamplingParams(**{**{f: getattr(p, f) for f in p.__slots__}, "seed": 8}),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
    assert a != c


def test_prefill_step_outputs_the_first_token(llm):
    """The step that samples a request's first token hands it out (a stream's first chunk
    does not wait for the next step)."""
    engine = llm.engine
    engine.add_request("first", PROMPT, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = engine.step()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1]
    while engine.has_unfinished_requests():
        engine.step()
    engine.pop_finished("first")


def test_one_token_request_reports_no_speculation(tiny):
    """max_tokens=1 leaves no pass after the prefill: nothing was speculated, and the mean
    accepted length says 1.0 as plain decoding does (not 0.0)."""
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              max_model_len=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)[0]
    assert out.spec.num_target_passes == 0 and out.spec.mean_accepted_length == 1.0


def test_stream_pieces_add_up_to_the_text(llm):
    pieces, last = [], None
    for out in llm.stream(PROMPT, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)):
        pieces.append(out.new_text)
        last = out
    assert "".join(pieces) == last.outputs[0].text and last.finished


def test_outputs_come_back_in_input_order(llm):
    prompts = [[2 + i, 3 + i] for i in range(7)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == prompts
    solo = [llm.generate([p], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
            for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [s.outputs[0].token_ids for s in solo]


@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -0.5}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"),
    ({"min_p": 2.0}, "min_p"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": 10**9}, "max_tokens"),
    ({"temperature": "hot"}, "temperature"),
    ({"seed": -1}, "seed"),
    ({"stop": [""]}, "stop"),
    ({"stop": ["x"] * 17}, "stop"),
    ({"top_k": 2**63}, "top_k"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"logprobs": 21}, "logprobs"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
])
def test_invalid_sampling_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameterError, match=param) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_sampling_params_copy_owns_its_containers_and_the_engine_checks_what_it_is_given(llm):
    """copy() skips __post_init__'s checks (the engine's add_request runs them): a copy's lists
    and dict are its own, its changes apply, a bad change is refused when the request is added."""
    p = SamplingParams(temperature=0.5, stop=["x"], stop_token_ids=[3], logit_bias={4: 1.0}, seed=3)
    q = p.copy(seed=4)
    q.stop.append("y"), q.stop_token_ids.append(5), q.logit_bias.update({6: 2.0})
    assert (p.seed, p.stop, p.stop_token_ids, p.logit_bias) == (3, ["x"], [3], {4: 1.0}) and q.seed == 4
    with pytest.raises(AttributeError):
        p.copy(temprature=1.0)
    with pytest.raises(InvalidParameterError, match="top_p"):
        llm.engine.add_request("bad-copy", PROMPT, p.copy(top_p=0.0))
    assert "bad-copy" not in llm.engine.requests


def test_bad_prompts(llm):
    with pytest.raises(PromptError, match="empty"):
        llm.generate([""], use_tqdm=False)
    with pytest.raises(PromptError, match="context"):
        llm.generate([list(range(2, 60)) * 2], use_tqdm=False)
    with pytest.raises(PromptError, match="outside the vocabulary"):
        llm.generate([[1, 2, 999]], use_tqdm=False)
    with pytest.raises(PromptError):
        llm.chat([], use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="role"):
        llm.chat([{"role": "wizard", "content": "hi"}], use_tqdm=False)
    # The engine is still usable after refusing bad input.
    assert len(greedy(llm, max_tokens=3, ignore_eos=True).token_ids) == 3


def test_vllm_prompt_dicts(llm):
    """vLLM's TokensPrompt and TextPrompt shapes, alone or in a list, give what the plain forms give."""
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    want = llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].token_ids
    for prompt in ({"prompt_token_ids": PROMPT}, [{"prompt_token_ids": PROMPT}],
                   {"prompt_token_ids": PROMPT, "prompt": "t5 t9 t12 t5 t9"}):
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        assert out.prompt_token_ids == PROMPT and out.outputs[0].token_ids == want
    text = llm.generate(["t5 t9"], params, use_tqdm=False)[0]
    assert llm.generate({"prompt": "t5 t9"}, params, use_tqdm=False)[0].outputs[0].token_ids == text.outputs[0].token_ids


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_ids": [1, 2]}, "'prompt' .* or 'prompt_token_ids'"),
    ({}, "'prompt' .* or 'prompt_token_ids'"),
    ({"prompt": [1, 2]}, "must be text"),
    ({"prompt_token_ids": "t5 t9"}, "list of token ids"),
    ({"prompt_token_ids": [1.0, 2.0]}, "non-integers"),
    ([[5, "9"]], "non-integers"),
    (7, "list of token ids"),
])
def test_malformed_prompts_are_refused_naming_the_shapes(llm, prompt, match):
    with pytest.raises(PromptError, match=match):
        llm.generate(prompt if not isinstance(prompt, int) else [prompt], use_tqdm=False)


def test_vllm_sampling_params_n_and_text_options(llm):
    """n choices per prompt (choice j seeded seed + j, as the server seeds them), include_stop_str_in_output,
    skip_special_tokens; best_of only equal to n, and out-of-range values refused by name."""
    sampled = SamplingParams(temperature=1.0, max_tokens=6, seed=7, n=3, ignore_eos=True)
    out = llm.generate([PROMPT], sampled, use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    for j, o in enumerate(out.outputs):
        alone = llm.generate([PROMPT], SamplingParams(temperature=1.0, max_tokens=6, seed=7 + j, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0]
        assert o.token_ids == alone.token_ids
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1
    text = greedy(llm, max_tokens=8, ignore_eos=True).text
    stop = text.split()[2]
    cut = greedy(llm, max_tokens=8, ignore_eos=True, stop=[stop])
    kept = greedy(llm, max_tokens=8, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == cut.text + stop and text.startswith(kept.text)
    SamplingParams(n=2, best_of=2, presence_penalty=0.0, repetition_penalty=1.0, skip_special_tokens=False)
    for kwargs, param in [({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
                          ({"repetition_penalty": 0}, "repetition_penalty"), ({"n": 2, "best_of": 4}, "best_of"),
                          ({"n": 0}, "n"), ({"skip_special_tokens": 1}, "skip_special_tokens")]:
        with pytest.raises(InvalidParameterError, match=param):
            SamplingParams(**kwargs)


def test_sampling_params_of_another_type_are_named(llm):
    with pytest.raises(InvalidParameterError, match="sampling_params"):
        llm.generate([PROMPT], {"temperature": 0}, use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="sampling_params"):
        llm.generate([PROMPT, PROMPT], [SamplingParams(), {"n": 2}], use_tqdm=False)


def test_skip_special_tokens_reaches_the_requests_detokenizer(llm):
    """The detokenizer's own tests cover both settings; here the request's setting reaches it."""
    engine = llm.engine
    for skip in (True, False):
        engine.add_request(f"skip-{skip}", PROMPT, SamplingParams(max_tokens=1, skip_special_tokens=skip))
        assert engine.requests[f"skip-{skip}"].detokenizer.skip_special_tokens is skip
        engine.abort_request(f"skip-{skip}")
        engine.pop_finished(f"skip-{skip}")


def test_vllm_gpu_options_are_named_not_a_type_error(tiny):
    LLM(loaded=tiny["loaded"], tensor_parallel_size=1, enforce_eager=False, trust_remote_code=False)
    for kwargs, name in [({"tensor_parallel_size": 2}, "tensor_parallel_size"),
                         ({"gpu_memory_utilization": 0.9}, "gpu_memory_utilization"),
                         ({"trust_remote_code": True}, "trust_remote_code")]:
        with pytest.raises(InvalidParameterError, match=f"{name}.*not supported by specserve"):
            LLM(loaded=tiny["loaded"], **kwargs)
    with pytest.raises(TypeError, match="frobnicate"):
        LLM(loaded=tiny["loaded"], frobnicate=1)
