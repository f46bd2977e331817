"""The server counts every engine request it submitted exactly once, from the serving layer, by
the way it ended: run to the end (streamed or not, n choices), failed alone, aborted because its
client went away, or aborted at shutdown; a request refused before submission is no engine
request and is not counted."""

import json
import logging
import time

import httpx
import pytest

from specserve.llm import LLM
from tests.server_helpers import RunningServer, fail_seed, hold_after_one_step, raw_post

COMPLETIONS = "/v1/completions"
REASONS = ("length", "stop", "abort", "error")


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(loaded=tiny["loaded"], max_num_seqs=4, max_model_len=128)
    with RunningServer(llm) as s:
        s.llm = llm
        yield s


def counts(server) -> dict[str, float]:
    return {r: server.metric("specserve_requests_total", finish_reason=r) for r in REASONS}


def stream(server, body: dict, after_first, hang_up: bool) -> list[str]:
    """Stream `body`: call `after_first()` once the first chunk arrived, then hang up or read
    on to the end. -> the events read."""
    events = []
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=body | {"stream": True}, timeout=30) as r:
        for line in filter(None, r.iter_lines()):
            events.append(line)
            if len(events) == 1:
                after_first()
                if hang_up:
                    break
    return events


def aborted_log_lines(caplog) -> int:
    """Request log lines that say `finish abort` (written when a handler ends, after it aborted
    its engine requests)."""
    return sum("finish abort" in r.getMessage() for r in caplog.records)


def wait_for(condition) -> None:
    deadline = time.monotonic() + 30
    while not condition():
        assert time.monotonic() < deadline, "the server did not get there in 30 s"
        time.sleep(0.01)


def test_every_engine_request_is_counted_once(server, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="specserve.server")
    before = counts(server)
    short = {"prompt": "t5 t6 t7", "max_tokens": 5, "ignore_eos": True, "temperature": 0}
    long = {"prompt": "t5 t6", "max_tokens": 100, "ignore_eos": True}

    # Run to the end: two whole answers, and a stream of n=2 choices (two engine requests).
    for _ in range(2):
        assert httpx.post(f"{server.url}{COMPLETIONS}", json=short, timeout=30).status_code == 200
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=short | {"n": 2, "stream": True}, timeout=30) as r:
        assert [line for line in r.iter_lines() if line][-1] == "data: [DONE]"
    # Refused before anything was submitted: not an engine request.
    assert httpx.post(f"{server.url}{COMPLETIONS}", json=short | {"max_tokens": 500}, timeout=30).status_code == 400

    # Failed alone, whole and streamed.
    fail_seed(monkeypatch, 4242)
    bad = short | {"temperature": 0.5, "seed": 4242}
    assert httpx.post(f"{server.url}{COMPLETIONS}", json=bad, timeout=30).status_code == 500
    with httpx.stream("POST", f"{server.url}{COMPLETIONS}", json=bad | {"stream": True}, timeout=30) as r:
        events = [line for line in r.iter_lines() if line]
    assert "internal_error" in events[-2] and events[-1] == "data: [DONE]"
    server.wait_idle()

    # Aborted because the client went away: a stream hung up after its first chunk, and a
    # whole answer whose connection closed once it was submitted. The engine is held after one
    # step, so neither can run to its end.
    release = hold_after_one_step(server.llm.engine, monkeypatch)
    total = sum(counts(server).values())
    stream(server, long, lambda: None, hang_up=True)
    with raw_post(server, COMPLETIONS, json.dumps(long).encode()):
        # Both submitted: each is counted as ended, or open.
        wait_for(lambda: sum(counts(server).values()) - total + server.metric("specserve_num_requests_open") == 2)
    wait_for(lambda: aborted_log_lines(caplog) == 2)  # both handlers noticed and aborted their requests
    release.set()
    server.wait_idle()

    # Aborted at shutdown (the grace period ran out: the engine aborts everything).
    release = hold_after_one_step(server.llm.engine, monkeypatch)
    events = stream(server, long, lambda: (server.engine.abort_all(), release.set()), hang_up=False)
    assert json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"] == "abort"
    assert events[-1] == "data: [DONE]"
    m = server.wait_idle()

    after = counts(server)
    ended = {r: after[r] - before[r] for r in REASONS}
    assert ended == {"length": 4, "stop": 0, "abort": 3, "error": 2}, ended
    assert m["specserve_num_requests_open"] == 0 and m["specserve_kv_blocks_used"] == 0


def test_adaptive_speculation_shows_the_depths_it_chose():
    """/metrics reads the chosen draft depths from the engine's published stats, one series per
    depth, and their mean (a stand-in engine: the figures come from EngineStats as they are)."""
    from types import SimpleNamespace

    from specserve.engine.engine import EngineStats
    from specserve.server.metrics import ServerMetrics

    engine = SimpleNamespace(snapshot=EngineStats(draft_depth_counts=(6, 0, 3, 1)))
    text = ServerMetrics(engine, "m").render().decode()
    assert 'specserve_spec_draft_depth_chosen{depth="2",model_name="m"} 3.0' in text
    assert 'specserve_spec_draft_depth_chosen{depth="0",model_name="m"} 6.0' in text
    assert 'specserve_spec_mean_draft_depth{model_name="m"} 0.9' in text  # (0*6 + 2*3 + 3*1) / 10
    plain = ServerMetrics(SimpleNamespace(snapshot=EngineStats()), "m").render().decode()
    assert "specserve_spec_draft_depth_chosen{" not in plain


def test_generated_tokens_are_counted_as_they_stream(server, monkeypatch):
    """A request held after its first step has its first token counted already: rates of the
    counter read live, not only when requests end."""
    server.wait_idle()
    before = server.metric("specserve_generation_tokens_total")
    release = hold_after_one_step(server.llm.engine, monkeypatch)
    seen = []
    body = {"prompt": "t5 t6", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    events = stream(server, body, lambda: (wait_for(lambda: server.metric("specserve_generation_tokens_total") > before),
                                           seen.append(server.metric("specserve_requests_total")), release.set()),
                    hang_up=False)
    assert events[-1] == "data: [DONE]"
    server.wait_idle()
    assert server.metric("specserve_generation_tokens_total") - before == 6
    assert server.metric("specserve_requests_total") == seen[0] + 1  # it had not ended when its token was counted


def test_gateway_gauges_read_the_engine_under_vllm_names():
    """The gauges an inference gateway's endpoint picker scrapes, named as vLLM names them: the
    queue, the batch, KV cache use as a fraction, and the cache's block size and blocks."""
    from types import SimpleNamespace

    from specserve.engine.engine import EngineStats
    from specserve.server.metrics import ServerMetrics

    stats = EngineStats(num_running=2, num_waiting=3, num_kv_blocks=40, num_kv_blocks_used=10, block_size=16)
    text = ServerMetrics(SimpleNamespace(snapshot=stats), "m").render().decode()
    assert 'vllm:num_requests_waiting{model_name="m"} 3.0' in text
    assert 'vllm:num_requests_running{model_name="m"} 2.0' in text
    assert 'vllm:kv_cache_usage_perc{model_name="m"} 0.25' in text
    assert 'vllm:cache_config_info{block_size="16",model_name="m",num_gpu_blocks="40"} 1.0' in text


def test_gateway_gauges_follow_a_running_request(server, monkeypatch):
    """Through the server, while a request is held after its first step: one running, none
    waiting, and the KV cache use the specserve gauge shows, as a fraction in (0, 1]."""
    server.wait_idle()
    release = hold_after_one_step(server.llm.engine, monkeypatch)
    seen = {}

    def look():
        wait_for(lambda: server.metric("vllm:num_requests_running") == 1)
        seen.update(server.metrics())
        release.set()

    body = {"prompt": "t5 t6 t7", "max_tokens": 6, "ignore_eos": True, "temperature": 0}
    assert stream(server, body, look, hang_up=False)[-1] == "data: [DONE]"
    assert seen["vllm:num_requests_running"] == seen["specserve_num_requests_running"] == 1
    assert seen["vllm:num_requests_waiting"] == seen["specserve_num_requests_waiting"] == 0
    assert 0 < seen["vllm:kv_cache_usage_perc"] == seen["specserve_kv_cache_usage_ratio"] <= 1
    info = [labels for name, labels, value in server.samples() if name == "vllm:cache_config_info" and value == 1]
    assert info == [{"model_name": "tiny", "block_size": str(server.llm.engine_config.block_size),
                     "num_gpu_blocks": str(int(seen["specserve_kv_blocks_total"]))}]
    m = server.wait_idle()
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
