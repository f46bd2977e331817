"""A bounded load test: 64 concurrent streams (a quarter of the clients hang up midway, a few
non-streaming clients time out) on a KV pool small enough to force preemption. Afterwards every
request completed or was aborted, no KV block is left referenced, and the server still answers."""

import asyncio
import json
import random
import sys

import httpx
import pytest

from specserve.llm import LLM
from tests.server_helpers import RunningServer

NUM_STREAMS = 64
NUM_TIMEOUTS = 4


@pytest.fixture(scope="module")
def server(tiny):
    llm = LLM(loaded=tiny["loaded"], speculative_config={"method": "ngram", "num_speculative_tokens": 3},
              max_num_seqs=16, max_model_len=256, num_kv_blocks=64, block_size=8)
    with RunningServer(llm, max_waiting=256) as s:
        s.llm = llm
        yield s


async def stream_one(client: httpx.AsyncClient, url: str, i: int, hang_up_after: int | None) -> tuple[str, int]:
    """-> (how it ended: 'length' | 'hung_up', content chunks read)."""
    rng = random.Random(i)
    body = {"model": "tiny", "messages": [{"role": "user", "content": " ".join(f"t{rng.randrange(2, 64)}" for _ in range(rng.randrange(3, 40)))}],
            "max_tokens": rng.randrange(20, 120), "temperature": rng.choice([0, 0.8]), "seed": i, "stream": True,
            "ignore_eos": True}
    chunks = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line:
                continue
            if line == "data: [DONE]":
                return "done", chunks
            event = json.loads(line.removeprefix("data: "))
            assert "error" not in event, event
            chunks += 1
            if event["choices"][0]["finish_reason"] is not None:
                assert event["choices"][0]["finish_reason"] == "length"
            if hang_up_after is not None and chunks >= hang_up_after:
                return "hung_up", chunks  # leaving the block closes the connection mid-stream
    raise AssertionError("the stream ended without [DONE]")


async def time_out_one(url: str) -> str:
    body = {"prompt": "t5 t6 t7", "max_tokens": 250, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=httpx.Timeout(30, read=0.05)) as client:
        try:
            await client.post(f"{url}/v1/completions", json=body)
        except httpx.ReadTimeout:
            return "timed_out"
    return "done"


async def load(url: str) -> list[str]:
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=NUM_STREAMS + 8)) as client:
        jobs = [stream_one(client, url, i, hang_up_after=3 if i % 4 == 0 else None) for i in range(NUM_STREAMS)]
        jobs += [time_out_one(url) for _ in range(NUM_TIMEOUTS)]
        results = await asyncio.gather(*jobs)
    return [r if isinstance(r, str) else r[0] for r in results]


def test_64_concurrent_streams_with_hang_ups_leak_nothing(server):
    before = server.metrics().get("specserve_requests_total", 0)
    ends = asyncio.run(load(server.url))
    hung_up = ends.count("hung_up") + ends.count("timed_out")
    assert ends.count("done") + hung_up == NUM_STREAMS + NUM_TIMEOUTS
    assert ends.count("hung_up") == NUM_STREAMS // 4

    m = server.wait_idle()
    assert m["specserve_num_requests_in_engine"] == 0
    assert m["specserve_num_requests_running"] == 0 and m["specserve_num_requests_waiting"] == 0
    assert m["specserve_kv_blocks_used"] == 0
    # Every request ended exactly once: the ones that ran to the end by length, the others
    # by abort (a client that hung up just as its request finished is counted as length).
    total = m["specserve_requests_total"] - before
    assert total == NUM_STREAMS + NUM_TIMEOUTS
    aborted = server.metric("specserve_requests_total", finish_reason="abort")
    assert 1 <= aborted <= hung_up
    assert server.metrics()["specserve_num_preemptions"] > 0  # the small pool really was contended

    pool = server.llm.engine.scheduler.pool  # the engine thread is idle: safe to inspect
    pool.check_invariants()
    assert pool.num_available_blocks == pool.num_blocks and not server.llm.engine.requests

    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "t5", "max_tokens": 4}, timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


def test_bench_serve_measures_a_running_server(server, tmp_path, capsys, monkeypatch):
    from specserve.cli import main

    # httpx comes with the test extra only: bench-serve must not need it.
    monkeypatch.setitem(sys.modules, "httpx", None)

    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps({"turns": [f"t{i} t{i + 1} t{i + 2}"]}) for i in range(2, 12)))
    out_json = tmp_path / "load.json"
    code = main(["bench-serve", "--url", server.url, "--concurrency", "4", "--num-requests", "8",
                 "--workload", str(workload), "--max-tokens", "12", "--json", str(out_json)])
    assert code == 0
    [figures] = json.loads(out_json.read_text())["runs"]
    assert figures["num_requests"] == 8 and figures["num_failed"] == 0 and figures["server"] == "specserve"
    assert figures["requests_per_s"] > 0 and figures["output_tokens_per_s"] > 0
    assert 0 < figures["ttft_p50_ms"] <= figures["ttft_p99_ms"]
    assert 0 < figures["tpot_p50_ms"] <= figures["tpot_p99_ms"]
    assert figures["client_cpu_ms_per_token"] > 0  # the client's own event loop, per token
    out = capsys.readouterr().out
    assert "req/s" in out and "client CPU" in out
    # Each level its own prompts: 2 levels x 4 requests from the 10 prompts.
    code = main(["bench-serve", "--url", server.url, "--concurrency", "1,4", "--num-requests", "4", "--no-stream",
                 "--workload", str(workload), "--max-tokens", "4", "--distinct-prompts", "--json", str(out_json)])
    doc = json.loads(out_json.read_text())
    assert code == 0 and doc["distinct_prompts"] is True and [r["num_requests"] for r in doc["runs"]] == [4, 4]
    assert main(["bench-serve", "--url", server.url, "--concurrency", "1,4", "--num-requests", "6",
                 "--workload", str(workload), "--distinct-prompts"]) == 2
    assert "needs 12 prompts" in capsys.readouterr().err
    # Whole responses: the same requests and tokens, no per-token timings.
    code = main(["bench-serve", "--url", server.url, "--concurrency", "4", "--num-requests", "8", "--no-stream",
                 "--workload", str(workload), "--max-tokens", "12", "--json", str(out_json)])
    assert code == 0
    [whole] = json.loads(out_json.read_text())["runs"]
    assert whole["num_failed"] == 0 and whole["output_tokens_per_s"] > 0 and whole["latency_p50_s"] > 0
    assert whole["ttft_p50_ms"] is None and whole["tpot_p50_ms"] is None and whole["client_cpu_ms_per_token"] > 0
    assert "whole (not streamed)" in capsys.readouterr().err


def test_bench_serve_compares_servers_side_by_side_at_each_level(server, tiny, tmp_path, capsys):
    """The running server, the same one again as a named peer, and a `specserve serve` the
    command starts on a port of its choosing (and stops): each answers the same requests at
    each level, and one table compares them."""
    from specserve.cli import main

    workload = tmp_path / "prompts.jsonl"
    workload.write_text("\n".join(json.dumps({"turns": [f"t{i} t{i + 1}"]}) for i in range(2, 8)))
    out_json = tmp_path / "load.json"
    started = f"{sys.executable} -m specserve.cli serve --model {tiny['target']} --port {{port}} --no-ui"
    code = main(["bench-serve", "--url", server.url, "--name", "one", "--peer", f"again={server.url}",
                 "--peer-command", f"started={started}", "--concurrency", "1,3", "--num-requests", "3",
                 "--workload", str(workload), "--max-tokens", "6", "--json", str(out_json)])
    assert code == 0
    runs = json.loads(out_json.read_text())["runs"]
    assert sorted((r["server"], r["concurrency"]) for r in runs) == [
        ("again", 1), ("again", 3), ("one", 1), ("one", 3), ("started", 1), ("started", 3)]
    assert all(r["num_failed"] == 0 and r["num_requests"] == 3 for r in runs)
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["server", "conc", "tok/s", "ratio"] and table[0].endswith("client ms/tok")
    assert [line.split()[0] for line in table[1:]] == ["one", "again", "started"] * 2
    assert table[1].split()[3] == "1.00x"
    doc = json.loads(out_json.read_text())
    assert doc["distinct_prompts"] is False
    # Each server's KV pool as its /metrics says: the same server twice, the same pool.
    assert doc["kv_blocks"]["one"] == doc["kv_blocks"]["again"] > 0 and doc["kv_blocks"]["started"] > 0
    started_url = next(r["url"] for r in runs if r["server"] == "started")
    with pytest.raises(httpx.HTTPError):  # stopped when done
        httpx.get(f"{started_url}/v1/models", timeout=2)


def test_servers_with_unequal_kv_pools_are_named():
    """Servers started side by side size their pools from the memory each found free: a
    comparison under load then says which hold less, and how to even them."""
    from specserve.bench.serve_load import pool_warning

    assert pool_warning({}) is None and pool_warning({"plain": 16384, "ngram": 16384}) is None
    line = pool_warning({"plain": 16384, "ngram": 16384, "eagle3+suffix": 2767})
    assert "plain 16384, ngram 16384, eagle3+suffix 2767 blocks" in line and "--num-kv-blocks" in line


def test_bench_serve_refuses_bad_peers_and_levels(server, capsys):
    from specserve.cli import main

    assert main(["bench-serve", "--url", "http://127.0.0.1:9", "--num-requests", "1"]) == 2
    assert "no OpenAI-compatible server" in capsys.readouterr().err
    assert main(["bench-serve", "--peer", "nameless", "--num-requests", "1"]) == 2
    assert "must be NAME=VALUE" in capsys.readouterr().err
    assert main(["bench-serve", "--concurrency", "4,0"]) == 2
    assert "comma list" in capsys.readouterr().err
    assert main(["bench-serve", "--peer-command", "dead=false", "--url", server.url]) == 2
    assert "exited with 1 before answering" in capsys.readouterr().err


def test_bench_serve_survives_a_server_that_closes_kept_alive_connections():
    """llama-server closes a connection after a streamed answer without `Connection: close`;
    a client reusing it failed every second request as it wrote it. Each request gets a
    connection of its own."""
    from specserve.bench.serve_load import run_load

    events = [{"choices": [{"delta": {"content": f"w{i}"}}]} for i in range(3)]
    events.append({"choices": [], "usage": {"completion_tokens": 3}})
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"

    async def answer_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")))
        await reader.readexactly(length)
        writer.write(f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: {len(body)}\r\n\r\n"
                     f"{body}".encode())
        await writer.drain()
        writer.close()  # kept alive by HTTP/1.1's default, closed all the same

    async def run() -> list:
        server = await asyncio.start_server(answer_once, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            timings, _, _ = await run_load(f"http://127.0.0.1:{port}", "m", ["a", "b", "c", "d"], 1, 3, 0.0, None)
        return timings

    timings = asyncio.run(run())
    assert [t.error for t in timings if not t.ok] == [] and [t.output_tokens for t in timings] == [3] * 4
