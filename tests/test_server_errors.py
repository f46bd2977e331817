"""Bad input against the real server: each gets a 4xx in the OpenAI error format naming what was
wrong, never a 500, and the server keeps answering."""

import asyncio

import httpx
import openai
import pytest

from specserve.llm import LLM
from tests.server_helpers import RunningServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MSG = [{"role": "user", "content": "t5 t6"}]


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, max_model_len=128)
    with RunningServer(llm, max_body_bytes=64 * 1024) as s:
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
    (COMPLETIONS, {"prompt": "t5", "stop": [""]}, "stop", []),
    (COMPLETIONS, {"prompt": "t5", "presence_penalty": 0.5}, "presence_penalty", ["less than or equal to 0"]),
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
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, "tools", ["unknown parameter"]),
]


@pytest.mark.parametrize("path,body,param,words", CASES, ids=[f"{p.split('/')[-1]}-{prm}-{i}" for i, (p, _, prm, _) in enumerate(CASES)])
def test_invalid_parameter_is_a_400_naming_it(server, path, body, param, words):
    assert_error(post(server, path, body), 400, *words, param=param)


def test_unknown_model_is_404(server):
    err = assert_error(post(server, CHAT, {"model": "gpt-9", "messages": MSG}), 404, "gpt-9", "'tiny'", param="model")
    assert err["code"] == "model_not_found"


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
    assert_error(httpx.get(f"{server.url}{CHAT}"), 405)
    assert_error(httpx.get(f"{server.url}/v1/nothing"), 404)


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
