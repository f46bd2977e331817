"""Schemathesis fuzzes every operation of the server's own OpenAPI document, with schema-valid
and schema-violating requests (bounded in examples and time): no request may get a 5xx, and
every error body is in the OpenAI format."""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from specserve.llm import LLM
from tests.server_helpers import RunningServer


@pytest.fixture(scope="module")
def server(tiny):
    # A small max_model_len keeps the longest generation the fuzzer can ask for short.
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", "num_speculative_tokens": 2},
              max_num_seqs=8, max_model_len=48)
    with RunningServer(llm, max_waiting=64) as s:
        yield s


def operations(server):
    schema = schemathesis.openapi.from_dict(httpx.get(f"{server.url}/openapi.json").json())
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_document_lists_the_api(server):
    labels = {op.label for op in operations(server)}
    assert {"POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models", "GET /health",
            "GET /metrics"} <= labels


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_fuzzed_requests_never_get_a_5xx(server, path, mode):
    op = next(o for o in operations(server) if o.path == path)
    seen: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def check(case):
        # A streamed answer is read to the end like any other; n and max_tokens are bounded by
        # the schema and the small context.
        response = case.call(base_url=server.url, timeout=60)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        assert response.status_code < 500, (case.body, response.text)
        if response.status_code >= 400:
            assert set(response.json()["error"]) >= {"message", "type", "param", "code"}

    check()
    assert sum(seen.values()) > 0
    if mode is GenerationMode.NEGATIVE:
        assert any(400 <= code < 500 for code in seen), seen
    assert server.wait_idle()["specserve_kv_blocks_used"] == 0
