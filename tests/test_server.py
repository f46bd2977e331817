"""The OpenAI-compatible server driven by the official `openai` client: what it answers equals
what the offline LLM API produces for the same request (greedy, float32), streaming or not,
with speculation or without."""

import httpx
import openai
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.server_helpers import RunningServer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
PROMPT = "t5 t6 t7 t8 t9 t5 t6 t7 t8 t9 t5 t6"
MESSAGES = [{"role": "system", "content": "t3 t4"}, {"role": "user", "content": "t5 t6 t7 t5 t6 t7"}]


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(loaded=tiny["loaded"], speculative_config=NGRAM, max_num_seqs=8, max_model_len=256)
    with RunningServer(llm) as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny):
    """The same model and speculation through the offline API (its own engine and cache)."""
    return LLM(loaded=tiny["loaded"], speculative_config=NGRAM, max_num_seqs=8, max_model_len=256)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def greedy(n=24, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.mark.parametrize("speculative", [True, False])
def test_completion_equals_offline(client, offline, speculative):
    want = offline.generate([PROMPT], greedy(), use_tqdm=False)[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, "speculative": speculative})
    assert r.choices[0].text == want.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 24
    spec = r.model_extra["usage"]["speculative"] if "usage" in (r.model_extra or {}) else r.usage.model_extra["speculative"]
    if speculative:
        assert spec["num_drafted_tokens"] > 0 and spec["mean_accepted_length"] >= 1.0
    else:
        assert spec["num_drafted_tokens"] == 0 and spec["mean_accepted_length"] == 1.0


def test_chat_equals_offline(client, offline):
    want = offline.chat(MESSAGES, greedy(), use_tqdm=False)[0]
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want.outputs[0].text
    assert r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")


@pytest.mark.parametrize("speculative", [True, False])
def test_streamed_chat_equals_offline(client, offline, speculative):
    want = offline.chat(MESSAGES, greedy(30), use_tqdm=False)[0]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=30, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "speculative": speculative}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.outputs[0].text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 30
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1


def test_streamed_completion_equals_offline(client, offline):
    want = offline.generate([PROMPT], greedy(20), use_tqdm=False)[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == want.outputs[0].text
    assert all(c.usage is None for c in chunks)  # no usage chunk unless asked for


def _sources(pairs):
    return {src for _, src in pairs}


@pytest.mark.parametrize("speculative", [True, False])
def test_streamed_provenance_is_opt_in_and_covers_the_text(client, offline, speculative):
    """With `provenance`, each chunk carries its text token by token with sources, and the
    choice's speculation figures; without it the chunks are OpenAI's own, no extra field."""
    want = offline.chat(MESSAGES, greedy(30), use_tqdm=False)[0]
    extra = {"ignore_eos": True, "speculative": speculative}
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0,
                                                 stream=True, extra_body=extra | {"provenance": True}))
    pairs = [pair for c in chunks for pair in c.choices[0].model_extra["provenance"]]
    assert all(c.choices[0].delta.content == "".join(t for t, _ in c.choices[0].model_extra["provenance"])
               for c in chunks)
    assert "".join(t for t, _ in pairs) == want.outputs[0].text
    last = chunks[-1].choices[0].model_extra["speculation"]
    if speculative:
        assert "draft" in _sources(pairs) and _sources(pairs) <= {"plain", "draft", "corrected", "bonus"}
        assert last["num_accepted"] == want.spec.num_accepted and last["num_drafted"] > 0
        assert len(last["acceptance_by_position"]) >= 1
    else:
        assert _sources(pairs) == {"plain"} and last["num_drafted"] == 0
    plain = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=30, temperature=0,
                                                stream=True, extra_body=extra))
    assert all(not ({"provenance", "speculation"} & set(c.choices[0].model_extra or {})) for c in plain)


def test_whole_response_provenance(client, offline):
    want = offline.generate([PROMPT], greedy(), use_tqdm=False)[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True, "provenance": True})
    pairs = r.choices[0].model_extra["provenance"]
    assert "".join(t for t, _ in pairs) == r.choices[0].text == want.outputs[0].text
    assert [src for _, src in pairs].count("draft") <= r.choices[0].model_extra["speculation"]["num_accepted"]
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True, "provenance": True})
    assert "".join(t for t, _ in chat.choices[0].model_extra["provenance"]) == chat.choices[0].message.content
    echoed = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, echo=True,
                                       extra_body={"ignore_eos": True, "provenance": True, "n": 2})
    for choice in echoed.choices:  # the echoed prompt is text, not provenance; every choice has its own
        assert PROMPT + "".join(t for t, _ in choice.model_extra["provenance"]) == choice.text
    refused = httpx.post(f"{client.base_url}completions", json={"prompt": PROMPT, "provenance": "yes"})
    assert refused.status_code == 400 and "provenance" in refused.text


def test_raw_stream_ends_with_done(server):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_n_seeded_choices_equal_offline_seeds(client, offline):
    """Choice j of a seeded request samples with seed + j, so each is reproducible offline."""
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0.9, top_p=0.95,
                                  seed=11, n=3, extra_body={"ignore_eos": True, "top_k": 20})
    assert [c.index for c in r.choices] == [0, 1, 2]
    for j, choice in enumerate(r.choices):
        want = offline.generate([PROMPT], SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=11 + j,
                                                         max_tokens=16, ignore_eos=True), use_tqdm=False)[0]
        assert choice.text == want.outputs[0].text
    assert r.usage.completion_tokens == 48 and r.usage.prompt_tokens == len(PROMPT.split())


def test_several_prompts_in_one_completion(client, offline):
    prompts = [PROMPT, "t9 t8 t7"]
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    want = offline.generate(prompts, greedy(8), use_tqdm=False)
    assert [c.text for c in r.choices] == [w.outputs[0].text for w in want]


def test_token_id_prompt_and_echo(client, offline):
    ids = offline.tokenizer.encode(PROMPT)
    want = offline.generate([ids], greedy(6), use_tqdm=False)[0].outputs[0].text
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, echo=True,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == offline.tokenizer.decode(ids) + want


def test_completion_logprobs(client, offline):
    want = offline.generate([PROMPT], greedy(8, logprobs=2), use_tqdm=False)[0].outputs[0]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([t.logprob for t in want.logprobs])
    assert "".join(lp.tokens).replace(" ", "") == r.choices[0].text.replace(" ", "")
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # Greedy: the chosen token is the most likely one.
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(lp.top_logprobs, lp.token_logprobs))


def test_chat_logprobs_streamed_and_not(client):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3,
              extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert len(whole) == 10 and all(len(t.top_logprobs) == 3 for t in whole)
    streamed = [t for c in client.chat.completions.create(stream=True, **kw) if c.choices and c.choices[0].logprobs
                for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in whole]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole])


def test_stop_strings(client, offline):
    full = offline.generate([PROMPT], greedy(20), use_tqdm=False)[0].outputs[0].text.split()
    stop = full[5]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    want = offline.generate([PROMPT], greedy(20, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert r.choices[0].text == want.text and r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text


def test_max_completion_tokens_wins(client):
    r = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, max_completion_tokens=4,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 4


def test_models_health_metrics(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    for _ in range(2):  # two full blocks of prompt, the second time found in the prefix cache
        client.completions.create(model="tiny", prompt=" ".join(f"t{i % 60 + 2}" for i in range(40)), max_tokens=2)
    client.completions.create(model="tiny", prompt=PROMPT, max_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    m = server.wait_idle()
    for name in ["specserve_requests_total", "specserve_num_requests_running", "specserve_num_requests_waiting",
                 "specserve_kv_blocks_used", "specserve_kv_blocks_total", "specserve_prefix_cache_hit_rate",
                 "specserve_time_to_first_token_seconds_count", "specserve_time_per_output_token_seconds_count",
                 "specserve_spec_drafted_tokens_total", "specserve_spec_accepted_tokens_total",
                 "specserve_spec_acceptance_rate", "specserve_spec_mean_accepted_length"]:
        assert name in m, name
    assert m["specserve_requests_total"] > 0 and m["specserve_time_to_first_token_seconds_count"] > 0
    assert m["specserve_kv_blocks_used"] == 0 and m["specserve_kv_blocks_total"] > 0
    assert m["specserve_spec_drafted_tokens_total"] >= m["specserve_spec_accepted_tokens_total"] > 0
    assert 0 < m["specserve_spec_acceptance_rate"] <= 1 and m["specserve_spec_mean_accepted_length"] > 1
    assert m["specserve_prefix_cache_hit_rate"] > 0  # the same prompt was sent many times


@pytest.mark.slow
def test_embedded_model_chat_equals_offline(smollm_native):
    """The real model behind the server: greedy chat through the openai client, with n-gram
    speculation, streamed and not, equals the offline API's plain greedy answer."""
    messages = [{"role": "user", "content": "List the first five prime numbers, then repeat the list."}]
    plain = LLM(loaded=smollm_native, max_num_seqs=1).chat(messages, SamplingParams(temperature=0, max_tokens=40),
                                                    use_tqdm=False)[0].outputs[0].text
    llm = LLM(loaded=smollm_native, speculative_config=NGRAM, max_num_seqs=4)
    with RunningServer(llm, name="smollm2") as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        r = c.chat.completions.create(model="smollm2", messages=messages, max_tokens=40, temperature=0)
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=40, temperature=0, stream=True) if ch.choices)
    assert r.choices[0].message.content == plain
    assert streamed == plain


def test_metrics_count_generated_tokens_by_source(server, client):
    server.wait_idle()
    before = {s: server.metric("specserve_generation_tokens_by_source_total", source=s)
              for s in ("plain", "draft", "corrected", "bonus")}
    accepted = server.metric("specserve_spec_accepted_tokens_total")
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0,
                                  extra_body={"ignore_eos": True})
    server.wait_idle()
    after = {s: server.metric("specserve_generation_tokens_by_source_total", source=s) for s in before}
    grown = {s: after[s] - before[s] for s in before}
    assert sum(grown.values()) == r.usage.completion_tokens == 24
    assert grown["draft"] == server.metric("specserve_spec_accepted_tokens_total") - accepted > 0
