"""Schemathesis fuzzes every operation of the server's own OpenAPI document with schema-valid and
schema-violating requests (bounded in examples and time) and runs every check it has on each
answer: no 5xx, status codes, content types, headers and bodies as documented (stream events
included), schema-violating requests refused, schema-valid ones accepted.

Two bounds are not the schema's to state: a prompt, and a prompt plus max_tokens, must fit the
context, counted in tokens (0 tokens is an empty prompt); and prompts x n may not pass
--max-request-choices. Schema-valid requests that break them are answered 400
(context_length_exceeded, or an empty prompt, tested in test_server_errors; the choices cap in
test_server_hardening); the schema-valid requests here are drawn within them."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import CHECKS, load_all_checks

from specserve.llm import LLM
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.serving import chat_messages
from specserve.server.tools import offered_tools
from tests.server_helpers import RunningServer

MAX_MODEL_LEN = 48  # small, so the longest generation the fuzzer can ask for is short


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", "num_speculative_tokens": 2},
              max_num_seqs=8, max_model_len=MAX_MODEL_LEN)
    with RunningServer(llm, max_waiting=64) as s:
        s.llm = llm
        yield s


def operations(server):
    schema = schemathesis.openapi.from_dict(httpx.get(f"{server.url}/openapi.json").json())
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_document_lists_the_api_with_the_models_bounds(server):
    ops = {op.label: op for op in operations(server)}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
            "GET /metrics"} <= set(ops)
    doc = httpx.get(f"{server.url}/openapi.json").json()
    body = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert body["max_tokens"]["anyOf"][0]["maximum"] == MAX_MODEL_LEN - 1
    assert body["stop_token_ids"]["anyOf"][0]["items"]["maximum"] == 63  # the tiny vocabulary's last id
    assert "x-model-bounds" not in str(doc) and "422" not in str(doc["paths"])
    assert list(doc["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == ["text/plain"]


# Fields that need a grammar: this tiny model's word-level tokenizer is one the grammar engine
# cannot read, so the server refuses them for this model ("not available for this model"), a
# refusal no schema can state; tests/test_structured_output.py serves them on the embedded model.
GRAMMAR_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar")


def fits_context(server, path: str, body) -> bool:
    """Whether every prompt has 1 to MAX_MODEL_LEN - 1 tokens and room for each max-token limit
    the client sent, the request asks for no more choices than the cap, needs no grammar (above)
    and forces no tool call (a grammar too)."""
    llm = server.llm
    if isinstance(body, dict):
        if any(body.get(f) not in (None, {"type": "text"}) for f in GRAMMAR_FIELDS):
            return False
        choice = body.get("tool_choice")
        if body.get("tools") and choice is not None and choice not in ("auto", "none"):
            return False
    if path == "/v1/completions":
        req = CompletionRequest.model_validate(body)
        prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
        lengths = [len(llm.tokenizer.encode(p)) if isinstance(p, str) else len(p) for p in prompts]
        asked = [req.max_tokens] if "max_tokens" in req.model_fields_set and req.max_tokens else []
    else:
        req = ChatCompletionRequest.model_validate(body)
        lengths = [len(llm.tokenizer.encode_chat(chat_messages(req), add_generation_prompt=True,
                                                 tools=offered_tools(req)))]
        asked = [m for m in (req.max_completion_tokens, req.max_tokens) if m is not None]
    if len(lengths) * req.n > server.config.max_request_choices:
        return False
    return all(0 < n < MAX_MODEL_LEN and n + max(asked, default=0) <= MAX_MODEL_LEN for n in lengths)


@pytest.mark.parametrize("label,mode", [(label, mode) for label in ["POST /v1/completions", "POST /v1/chat/completions"]
                                        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
                         # The GET routes take no parameters, so no request to them violates the schema.
                         + [(label, GenerationMode.POSITIVE) for label in ["GET /v1/models", "GET /health", "GET /metrics"]])
def test_fuzzed_requests_pass_every_check(server, label, mode):
    op = next(o for o in operations(server) if o.label == label)
    load_all_checks()
    checks = list(CHECKS.get_all())  # `--checks all`
    seen: dict[int, int] = {}

    @settings(max_examples=40 if label.startswith("POST") else 5, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case):
        if mode is GenerationMode.POSITIVE and op.method == "post":
            assume(fits_context(server, op.path, case.body))
        # A streamed answer is read to the end like any other; n and max_tokens are bounded by
        # the schema and the small context.
        response = case.call(base_url=server.url, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=checks)
        if response.status_code >= 400:
            assert set(response.json()["error"]) >= {"message", "type", "param", "code"}

    check()
    assert sum(seen.values()) > 0
    if mode is GenerationMode.NEGATIVE:
        assert any(400 <= code < 500 for code in seen), seen
    else:
        assert seen.get(200), seen
    assert server.wait_idle()["specserve_kv_blocks_used"] == 0


@pytest.mark.parametrize("extra, accepted", [({}, False), ({"logprobs": False}, False), ({"logprobs": None}, False),
                                             ({"logprobs": True}, True)])
def test_schema_and_server_agree_on_top_logprobs(server, extra, accepted):
    """top_logprobs needs logprobs=true, also when logprobs is left out (a fuzzed body once found
    the schema allowing that while the server refused it)."""
    import jsonschema_rs

    doc = httpx.get(f"{server.url}/openapi.json").json()
    schema = doc["components"]["schemas"]["ChatCompletionRequest"] | {"components": doc["components"]}
    body = {"messages": [{"role": "user", "content": "t5 t6"}], "max_tokens": 2, "top_logprobs": 2} | extra
    assert jsonschema_rs.validator_for(schema).is_valid(body) == accepted
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30)
    assert (r.status_code == 200) == accepted and (accepted or r.status_code == 400)
