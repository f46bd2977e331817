"""Bad input against the real server: each gets a 4xx in the OpenAI error format naming what was
wrong, never a 500, and the server keeps answering."""

import asyncio
import json
import logging
import threading
import time

import httpx
import openai
import pytest

from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from tests.server_helpers import RunningServer, fail_seed, hold_after_one_step, raw_post

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "t5 t6"}]


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, max_model_len=128)
    with RunningServer(llm, max_body_bytes=64 * 1024) as s:
        s.llm = llm
        yield s


def post(server, path, body=None, **kw):
    return httpx.post(f"{server.url}{path}", json=body, timeout=30, **kw) if body is not None else \
        httpx.post(f"{server.url}{path}", timeout=30, **kw)


def assert_error(r, status, *words, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    for w in words:
        assert w in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param
    return err


CASES = [
    # (path, body, param, words in the message)
    (COMPLETIONS, {"prompt": "t5", "temperature": "hot"}, "temperature", ["valid number"]),
    (COMPLETIONS, {"prompt": "t5", "max_tokens": "10"}, "max_tokens", ["valid integer"]),
    (COMPLETIONS, {"prompt": "t5", "stream": "yes"}, "stream", ["boolean"]),
    (COMPLETIONS, {"prompt": "t5", "n": True}, "n", ["integer"]),
    (COMPLETIONS, {"prompt": 5}, "prompt", []),
    (COMPLETIONS, {"prompt": "t5", "frobnicate": 1}, "frobnicate", ["unknown parameter"]),
    (COMPLETIONS, {"prompt": "t5", "max_tokens": -1}, "max_tokens", ["greater than or equal to 1"]),
    (COMPLETIONS, {"prompt": "t5", "max_tokens": 0}, "max_tokens", ["greater than or equal to 1"]),
    (COMPLETIONS, {"prompt": "t5", "max_tokens": 10**12}, "max_tokens", ["maximum context length is 128", "at most"]),
    (COMPLETIONS, {"prompt": "t5", "temperature": -0.5}, "temperature", ["greater than or equal to 0"]),
    (COMPLETIONS, {"prompt": "t5", "top_p": 1.5}, "top_p", ["less than or equal to 1"]),
    (COMPLETIONS, {"prompt": "t5", "top_p": 0}, "top_p", ["greater than 0"]),
    (COMPLETIONS, {"prompt": "t5", "n": 1000}, "n", ["less than or equal to 16"]),
    (COMPLETIONS, {"prompt": "t5", "logprobs": 50}, "logprobs", ["less than or equal to 5"]),
    (COMPLETIONS, {"prompt": "t5", "seed": -1}, "seed", []),
    (COMPLETIONS, {"prompt": "t5", "stop": [""]}, "stop", ["must not be empty"]),
    (COMPLETIONS, {"prompt": "t5", "stop": ""}, "stop", ["must not be empty"]),
    (COMPLETIONS, {"prompt": "t5", "stop": ["t9"] * 17}, "stop", ["at most 16"]),
    (COMPLETIONS, {"prompt": "t5", "top_k": 2**63}, "top_k", ["less than or equal to 16777216"]),
    (COMPLETIONS, {"prompt": "t5", "stop_token_ids": [64]}, "stop_token_ids", ["vocabulary", "[0, 64)"]),
    (COMPLETIONS, {"prompt": "t5", "seed": 2**64}, "seed", ["less than or equal to"]),
    (COMPLETIONS, {"prompt": "t5", "presence_penalty": 2.5}, "presence_penalty", ["less than or equal to 2",
                                                                                  "allowed: [-2, 2]"]),
    (CHAT, {"messages": MSG, "frequency_penalty": -3}, "frequency_penalty", ["allowed: [-2, 2]"]),
    (CHAT, {"messages": MSG, "repetition_penalty": 0}, "repetition_penalty", ["greater than 0", "allowed: (0, 2]"]),
    (COMPLETIONS, {"prompt": "t5", "repetition_penalty": "1.2"}, "repetition_penalty", ["valid number"]),
    (COMPLETIONS, {"prompt": "t5", "logit_bias": {"5": 101}}, "logit_bias", ["[-100, 100]"]),
    (CHAT, {"messages": MSG, "logit_bias": {"64": 1}}, "logit_bias", ["[0, 64)"]),
    (CHAT, {"messages": MSG, "logit_bias": {"t5": 1}}, "logit_bias", ["'t5'", "token ids"]),
    (COMPLETIONS, {"prompt": "t5", "logit_bias": {"05": 1}}, "logit_bias", ["'05'"]),
    (COMPLETIONS, {"prompt": "t5", "logit_bias": [5]}, "logit_bias", ["valid dictionary"]),
    (COMPLETIONS, {"prompt": "t5", "logit_bias": {"5": "up"}}, "logit_bias.5", ["valid number"]),
    (CHAT, {"messages": MSG, "response_format": {"type": "json_object"}}, "response_format",
     ["not available for this model"]),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, "response_format.type", ["'json_schema'"]),
    (COMPLETIONS, {"prompt": "t5", "num_speculative_tokens": 2}, "num_speculative_tokens", ["without speculative"]),
    (COMPLETIONS, {"prompt": ""}, "prompt", ["empty"]),
    (COMPLETIONS, {"prompt": []}, "prompt", []),
    (COMPLETIONS, {"prompt": [99999]}, "prompt", ["outside the vocabulary"]),
    (COMPLETIONS, {"prompt": "t5 " * 200}, "prompt", ["maximum context length"]),
    (COMPLETIONS, {"prompt": "t5", "echo": True, "logprobs": 1}, "echo", ["not supported"]),
    (CHAT, {"messages": []}, "messages", ["at least 1"]),
    (CHAT, {}, "messages", ["missing required parameter"]),
    (CHAT, {"messages": [{"role": "wizard", "content": "t5"}]}, "messages.0.role", ["'system'"]),
    (CHAT, {"messages": [{"role": "user"}]}, "messages.0.content", ["missing"]),
    (CHAT, {"messages": [{"role": "user", "content": 7}]}, "messages.0.content", []),
    (CHAT, {"messages": MSG, "max_completion_tokens": -5}, "max_completion_tokens", []),
    (CHAT, {"messages": MSG, "top_logprobs": 3}, "top_logprobs", ["logprobs=true"]),
    (CHAT, {"messages": MSG, "top_logprobs": 99, "logprobs": True}, "top_logprobs", ["less than or equal to 20"]),
    (CHAT, {"messages": MSG, "stream_options": {"include_usage": 1}}, "stream_options.include_usage", []),
    (CHAT, {"messages": MSG, "functions": [{"name": "f"}]}, "functions", ["not supported by specserve yet"]),
]


@pytest.mark.parametrize("path,body,param,words", CASES, ids=[f"{p.split('/')[-1]}-{prm}-{i}" for i, (p, _, prm, _) in enumerate(CASES)])
def test_invalid_parameter_is_a_400_naming_it(server, path, body, param, words):
    assert_error(post(server, path, body), 400, *words, param=param)


def test_unknown_model_is_404(server):
    err = assert_error(post(server, CHAT, {"model": "gpt-9", "messages": MSG}), 404, "gpt-9", "'tiny'", param="model")
    assert err["code"] == "model_not_found"


@pytest.mark.parametrize("path,required", [(COMPLETIONS, "'prompt'"), (CHAT, "'messages'")])
def test_empty_body_names_what_to_send(server, path, required):
    r = post(server, path, content=b"", headers={"content-type": "application/json"})
    assert_error(r, 400, "the request body is empty", required)


def test_a_request_that_fails_in_the_engine_fails_alone(server, tiny, monkeypatch):
    """A failure inside the engine (injected into the sampler for requests with seed 4242) ends
    that request alone: a 500, or an error event then `data: [DONE]` in its stream, counted
    as finish_reason "error"; a request running beside it gets exactly its usual answer."""
    fail_seed(monkeypatch, 4242)
    before = server.metric("specserve_requests_total", finish_reason="error")
    good = {"prompt": "t5 t6 t7", "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    bad = {"prompt": "t5 t6", "max_tokens": 12, "temperature": 0.5, "seed": 4242}
    want = LLM(loaded=tiny["loaded"], max_model_len=128).generate(
        ["t5 t6 t7"], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0].outputs[0].text

    async def together():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(c.post(f"{server.url}{COMPLETIONS}", json=bad),
                                        c.post(f"{server.url}{COMPLETIONS}", json=good))

    failed, ok = asyncio.run(together())
    err = assert_error(failed, 500, "injected sampler failure", "other requests")
    assert err["code"] == "internal_error"
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == want
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=bad | {"stream": True}, timeout=60) as r:
        events = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "internal_error"
    assert server.metric("specserve_requests_total", finish_reason="error") == before + 2
    assert server.wait_idle()["specserve_kv_blocks_used"] == 0


def test_a_client_that_goes_away_is_logged_as_aborted(server, monkeypatch, caplog):
    """A non-streamed request whose client closes the connection after the engine produced
    its first token: the request log says `finish abort` (not `finish None`). A whole response
    reads only its choice's finished output, so the handler has no tokens yet: `output 0 tok`."""
    caplog.set_level(logging.INFO, logger="specserve.server")
    gate = hold_after_one_step(server.llm.engine, monkeypatch)
    held, calls, first_done = server.llm.engine.step, [], threading.Event()

    def counted():  # the second call starts once the first step's token is out
        calls.append(1)
        if len(calls) > 1:
            first_done.set()
        return held()

    monkeypatch.setattr(server.llm.engine, "step", counted)
    with raw_post(server, COMPLETIONS, b'{"prompt": "t5 t6", "max_tokens": 50, "ignore_eos": true}'):
        assert first_done.wait(30)
    try:
        while not any("finish" in r.getMessage() and "choice(s)" in r.getMessage() for r in caplog.records):
            time.sleep(0.01)
    finally:
        gate.set()
    line = next(r.getMessage() for r in caplog.records if "choice(s)" in r.getMessage())
    assert "output 0 tok, finish abort" in line, line
    assert server.wait_idle()["specserve_kv_blocks_used"] == 0


def test_malformed_json(server):
    r = post(server, COMPLETIONS, content=b'{"prompt": "t5", ', headers={"content-type": "application/json"})
    assert_error(r, 400, "not valid JSON")


def test_body_that_is_not_an_object(server):
    assert_error(post(server, COMPLETIONS, content=b"[1, 2]", headers={"content-type": "application/json"}), 400,
                 "JSON object")


def test_non_utf8_bytes(server):
    r = post(server, COMPLETIONS, content=b'{"prompt": "\xff\xfe\xfa"}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_ten_megabyte_body_is_refused_before_parsing(server):
    big = b'{"prompt": "' + b"t5 " * (10 * 1024 * 1024 // 3) + b'"}'
    r = post(server, COMPLETIONS, content=big, headers={"content-type": "application/json"})
    assert_error(r, 413, "larger than the limit")
    # Streamed without a length header: the guard counts what arrives and stops reading.
    r = httpx.post(f"{server.url}{COMPLETIONS}", content=iter([big[i:i + 65536] for i in range(0, len(big), 65536)]),
                   headers={"content-type": "application/json"}, timeout=30)
    assert_error(r, 413, "larger than the limit")


def test_wrong_method_and_route(server):
    assert_error(httpx.get(f"{server.url}{CHAT}"), 405, "GET is not allowed on /v1/chat/completions")
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)
    # OpenAI routes specserve does not serve are named as such, with the ones it does.
    for route in ("/v1/embeddings", "/v1/responses", "/v1/audio/speech"):
        assert_error(post(server, route, {"model": "tiny", "input": "hi"}), 404,
                     f"POST {route} is not supported by specserve", "/v1/chat/completions", "/tokenize")


def test_tokenize_and_detokenize_in_vllms_shapes(server):
    tok = server.llm.tokenizer
    r = post(server, "/tokenize", {"model": "tiny", "prompt": "t5 t6 t7"})
    assert r.status_code == 200, r.text
    assert r.json() == {"count": 3, "max_model_len": 128, "tokens": tok.encode("t5 t6 t7")}
    chat = post(server, "/tokenize", {"messages": MSG}).json()
    assert chat["tokens"] == tok.encode_chat(MSG, add_generation_prompt=True) and chat["count"] == len(chat["tokens"])
    r = post(server, "/detokenize", {"model": "tiny", "tokens": chat["tokens"]})
    assert r.status_code == 200 and r.json() == {"prompt": tok.decode(chat["tokens"])}
    assert_error(post(server, "/tokenize", {"prompt": "t5", "messages": MSG}), 400, "exactly one of prompt", param="prompt")
    assert_error(post(server, "/tokenize", {}), 400, "exactly one of prompt", param="prompt")
    assert_error(post(server, "/detokenize", {"tokens": [5, 64]}), 400, "outside the vocabulary", param="tokens")
    assert_error(post(server, "/tokenize", {"model": "other", "prompt": "t5"}), 404, "does not exist")
    assert_error(post(server, "/tokenize", {"prompt": "t5", "echo": True}), 400, "echo")


def test_server_still_answers_after_bad_input(server):
    r = post(server, COMPLETIONS, {"prompt": "t5 t6", "max_tokens": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1
    assert server.wait_idle()["specserve_kv_blocks_used"] == 0


def test_api_key(tiny):
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=2, max_model_len=128)
    with RunningServer(llm, api_key="sekrit-key") as s:
        for headers, what in [({}, "missing"), ({"Authorization": "Bearer wrong"}, "wrong"),
                              ({"Authorization": "sekrit-key"}, "wrong")]:
            err = assert_error(httpx.post(f"{s.url}{CHAT}", json={"messages": MSG}, headers=headers), 401, what)
            assert err["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{s.url}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{s.url}/v1", api_key="sekrit-key", max_retries=0)
        assert good.chat.completions.create(model="tiny", messages=MSG, max_tokens=2).choices[0].message.content
        assert httpx.get(f"{s.url}/health").status_code == 200  # health and metrics stay open for probes


def test_full_queue_is_503_with_retry_after(tiny):
    """Capacity is max_num_seqs running plus max_waiting queued: 8 long requests sent at once to
    a server with room for 2 get 200 or 503, never anything else, and the server recovers."""
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=1, max_model_len=512)
    with RunningServer(llm, max_waiting=1) as s:
        body = {"prompt": "t5", "max_tokens": 500, "ignore_eos": True}

        async def burst():
            async with httpx.AsyncClient(timeout=60) as c:
                return await asyncio.gather(*[c.post(f"{s.url}{COMPLETIONS}", json=body) for _ in range(8)])

        responses = asyncio.run(burst())
        codes = sorted(r.status_code for r in responses)
        assert set(codes) <= {200, 503} and codes.count(200) >= 2 and 503 in codes, codes
        for r in responses:
            if r.status_code == 503:
                err = assert_error(r, 503, "capacity", "--max-waiting")
                assert err["code"] == "queue_full" and r.headers["retry-after"] == "1"
        s.wait_idle()
        assert post(s, COMPLETIONS, {"prompt": "t6", "max_tokens": 2}).status_code == 200
