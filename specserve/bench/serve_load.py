"""`specserve bench-serve`: a load client for running OpenAI-compatible servers (specserve or
any other), measuring what a user of the API sees: requests/s, output tokens/s, time to first
token and time per output token, from the client side of the connection.

N streams stay in flight: each client sends its next prompt as soon as its last answer ended.
Time per output token of a request is (last token time - first token time) / (tokens - 1),
with tokens counted from the server's usage figures (stream_options.include_usage).

Several servers side by side: `--url` is the first (named by --name), each `--peer NAME=URL`
another running one, and each `--peer-command NAME=CMD` one this command starts (CMD with
`{port}` for the port it should listen on: llama-server, vLLM, a second specserve) and stops
when done. Every server gets the same prompts at each concurrency of the `--concurrency` list
(with `--distinct-prompts`, each level prompts of its own, so that what a server kept from an
earlier level, its prefix cache or suffix decoding's tree of earlier answers, cannot replay
them), servers taking turns in alternating order at each level (the machine's drift falls on both), and
one table compares them, with each server's output tokens/s as a ratio of the first's.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from specserve.bench.throughput import percentile
from specserve.bench.workload import Selection, load_workload, select
from specserve.errors import InvalidParameterError

# How long a started peer may take to answer /v1/models (loading a model, compiling kernels).
PEER_START_S = 600.0


def add_bench_serve_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="load-test running OpenAI-compatible servers with streaming chat requests, "
                                           "side by side")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (without /v1)")
    p.add_argument("--name", default="specserve", help="what the table calls the --url server")
    p.add_argument("--peer", action="append", default=[], metavar="NAME=URL",
                   help="another running server measured beside it (repeatable), e.g. llama.cpp=http://127.0.0.1:8080")
    p.add_argument("--peer-command", action="append", default=[], metavar="NAME=CMD",
                   help="a server this command starts for its runs and stops after (repeatable); {port} in CMD is "
                        "replaced by a free port, e.g. 'llama.cpp=llama-server -m model.gguf -np 16 --port {port}'")
    p.add_argument("--model", default=None, help="model name to send (default: each server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", default="16",
                   help="streams kept in flight, or a comma list of levels (e.g. 1,4,16,64)")
    p.add_argument("--num-requests", type=int, default=64, help="requests in all, at each level")
    p.add_argument("--workload", default="spec_bench", help="'spec_bench' or a JSONL file")
    p.add_argument("--field", default=None,
                   help="JSONL field holding the prompt (a string or a list of turns; default: turns, prompt or text, "
                        "the first a row holds)")
    p.add_argument("--categories", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-stream", action="store_true",
                   help="ask for whole responses (stream false): latency and tokens/s only, no TTFT or TPOT")
    p.add_argument("--distinct-prompts", action="store_true",
                   help="each concurrency level sends prompts of its own (strided over the whole workload, so every "
                        "level gets its mix), not the same ones again: a server's prefix cache and suffix decoding's "
                        "tree of earlier answers then cannot replay an earlier level's")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")


@dataclass(slots=True)
class RequestTiming:
    ok: bool
    ttft_s: float | None = None
    tpot_s: float | None = None
    latency_s: float = 0.0
    output_tokens: int = 0
    error: str | None = None


@dataclass(slots=True)
class LoadFigures:
    url: str
    concurrency: int
    num_requests: int
    num_failed: int
    wall_s: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    tpot_p50_ms: float | None
    tpot_p99_ms: float | None
    latency_p50_s: float | None
    server: str = ""  # the name the table gives the server
    # The client's own CPU time (its event-loop thread) per output token: on a small machine the
    # client shares the server's cores, and a streamed token costs it several times a whole one's.
    client_cpu_ms_per_token: float | None = None

    def line(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        return (f"{self.server + ': ' if self.server else ''}concurrency {self.concurrency} | {self.num_requests} "
                f"requests ({self.num_failed} failed) in "
                f"{self.wall_s:.1f} s | {self.requests_per_s:.2f} req/s | {self.output_tokens_per_s:.1f} output tok/s | "
                f"TTFT p50 {ms(self.ttft_p50_ms)} ms, p99 {ms(self.ttft_p99_ms)} ms | "
                f"TPOT p50 {ms(self.tpot_p50_ms)} ms, p99 {ms(self.tpot_p99_ms)} ms | "
                f"client CPU {'-' if self.client_cpu_ms_per_token is None else f'{self.client_cpu_ms_per_token:.3f}'} ms/token")


@dataclass(slots=True)
class Server:
    """One server under test: running at `url`, or started from `command` for the runs."""

    name: str
    url: str = ""
    command: str | None = None
    model: str = ""
    process: subprocess.Popen | None = field(default=None, repr=False)
    log: str | None = None  # where a started server's output goes
    kv_blocks: int | None = None  # its KV pool as its /metrics reports it (None: not reported)

    def start(self) -> None:
        """Start the command on a free port and wait until /v1/models answers."""
        if self.command is None:
            return
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        fd, self.log = tempfile.mkstemp(prefix=f"bench-serve-{self.name}-", suffix=".log")
        with os.fdopen(fd, "w") as out:
            self.process = subprocess.Popen(shlex.split(self.command.replace("{port}", str(port))), stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + PEER_START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise InvalidParameterError("peer-command", self.command, f"exited with {self.process.returncode} "
                                            f"before answering; its output is in {self.log}")
            try:
                _get(f"{self.url}/v1/models", {}, timeout=2)
                return
            except OSError:  # not listening yet, or not answering 200 yet
                pass
            time.sleep(0.5)
        self.stop()
        raise InvalidParameterError("peer-command", self.command, f"did not answer on {self.url} within "
                                    f"{PEER_START_S:.0f} s; its output is in {self.log}")

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None


# Straight to the servers, as the load client goes (aiohttp reads no proxy settings by default).
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _get(url: str, headers: dict, timeout: float) -> bytes:
    """GET url -> the body; OSError (urllib's URLError and HTTPError among them) when the
    server does not answer, or answers other than 200."""
    try:
        with _DIRECT.open(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.read()
    except http.client.HTTPException as e:  # something not speaking HTTP answered
        raise OSError(f"{type(e).__name__}: {e}") from e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _named(value: str, flag: str) -> tuple[str, str]:
    name, sep, rest = value.partition("=")
    if not sep or not name.strip() or not rest.strip():
        raise InvalidParameterError(flag, value, "must be NAME=VALUE, e.g. llama.cpp=http://127.0.0.1:8080")
    return name.strip(), rest.strip()


def parse_levels(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16]; each level >= 1."""
    try:
        levels = [int(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise InvalidParameterError("concurrency", text, "must be a positive integer or a comma list of them (1,4,16)")
    return levels


async def _refused(r) -> RequestTiming:
    """A failed request's timing from an answer other than 200: its status and the start of its body."""
    return RequestTiming(False, error=f"HTTP {r.status}: {(await r.read())[:200]!r}")


async def one_request(session, url: str, body: dict) -> RequestTiming:
    if not body["stream"]:
        return await _whole_request(session, url, body)
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return await _refused(r)
            async for line in r.content:  # the stream's lines, b"\n" ended
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return RequestTiming(False, error=str(event["error"]))
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
                if event["choices"] and event["choices"][0]["delta"].get("content"):
                    last = time.perf_counter()
                    first = first or last
    except Exception as e:  # a load client reports failures, it does not stop on them
        return RequestTiming(False, error=repr(e))
    end = time.perf_counter()
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else None
    return RequestTiming(True, None if first is None else first - start, tpot, end - start, tokens)


async def _whole_request(session, url: str, body: dict) -> RequestTiming:
    """A non-streamed request: its latency and the tokens its usage reports."""
    start = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/chat/completions", json=body) as r:
            if r.status != 200:
                return await _refused(r)
            tokens = json.loads(await r.read())["usage"]["completion_tokens"]
    except Exception as e:  # a load client reports failures, it does not stop on them
        return RequestTiming(False, error=repr(e))
    return RequestTiming(True, None, None, time.perf_counter() - start, tokens)


async def run_load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                   temperature: float, api_key: str | None, stream: bool = True) -> tuple[list[RequestTiming], float, float]:
    """Each request's timing, the wall time, and the CPU time this thread (the client's event
    loop) spent on them. The client is aiohttp, as vLLM's serving benchmark's: on a machine
    whose cores the server uses too, the client's own time per streamed token is taken from
    the server (AMD EPYC, 2 cores, 12-16 streamed answers of 128 tokens: 0.21-0.37 ms a
    token, median ~0.27, against 0.39-0.53 with httpx's line iterator)."""
    import aiohttp

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    timings: list[RequestTiming] = []

    async def worker(session) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": temperature, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            timings.append(await one_request(session, url, body))

    # No limit on a whole request (one may queue behind many); 600 s without a byte is a failure.
    # A connection per request: llama-server closes a kept-alive connection after a streamed
    # answer without saying so, and a reused one then fails the next request as it is written
    # (half of them, at every level); a connect costs ~0.1 ms against a request's hundreds.
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=600, sock_read=600)
    connector = aiohttp.TCPConnector(limit=concurrency + 4, force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, headers=headers, connector=connector) as session:
        start, cpu = time.perf_counter(), time.thread_time()
        await asyncio.gather(*[worker(session) for _ in range(concurrency)])
        wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return timings, wall, cpu


def summarise(url: str, concurrency: int, timings: list[RequestTiming], wall: float, server: str = "",
              client_cpu_s: float | None = None) -> LoadFigures:
    ok = [t for t in timings if t.ok]
    ttft = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None]
    tpot = [t.tpot_s * 1000 for t in ok if t.tpot_s is not None]
    tokens = sum(t.output_tokens for t in ok)
    return LoadFigures(url, concurrency, len(timings), len(timings) - len(ok), wall, len(ok) / wall,
                       tokens / wall, percentile(ttft, 50), percentile(ttft, 99),
                       percentile(tpot, 50), percentile(tpot, 99), percentile([t.latency_s for t in ok], 50), server,
                       1000 * client_cpu_s / tokens if client_cpu_s is not None and tokens else None)


def comparison_table(runs: list[LoadFigures], order: list[str]) -> str:
    """One line per server (in `order`) and level; tok/s also as a ratio of the first server's
    at that level."""
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    first = {r.concurrency: r.output_tokens_per_s for r in runs if r.server == order[0]}
    width = max(len("server"), *(len(r.server) for r in runs))
    lines = [f"{'server':<{width}} {'conc':>5} {'tok/s':>9} {'ratio':>7} {'req/s':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
             f"{'TPOT p50':>9} {'TPOT p99':>9} {'failed':>7} {'client ms/tok':>13}"]
    for r in sorted(runs, key=lambda r: (r.concurrency, order.index(r.server))):
        base = first.get(r.concurrency)
        ratio = f"{r.output_tokens_per_s / base:.2f}x" if base else "-"
        lines.append(f"{r.server:<{width}} {r.concurrency:>5} {r.output_tokens_per_s:>9.1f} {ratio:>7} "
                     f"{r.requests_per_s:>7.2f} {ms(r.ttft_p50_ms):>9} {ms(r.ttft_p99_ms):>9} {ms(r.tpot_p50_ms):>9} "
                     f"{ms(r.tpot_p99_ms):>9} {r.num_failed:>7} "
                     f"{'-' if r.client_cpu_ms_per_token is None else f'{r.client_cpu_ms_per_token:.3f}':>13}")
    return "\n".join(lines)


def _model_of(server: Server, asked: str | None, headers: dict) -> str:
    try:
        models = json.loads(_get(f"{server.url}/v1/models", headers, timeout=10))["data"]
    except (OSError, KeyError, ValueError) as e:
        raise InvalidParameterError("url" if server.command is None else "peer-command", server.url,
                                    f"no OpenAI-compatible server answers there ({e})") from None
    return asked or models[0]["id"]


def _kv_blocks(server: Server, headers: dict) -> int | None:
    """The KV pool's blocks a server reports on /metrics (vllm:cache_config_info's num_gpu_blocks,
    which vLLM and specserve both export), or None where it reports none."""
    try:
        text = _get(f"{server.url}/metrics", headers, timeout=10).decode(errors="replace")
    except OSError:
        return None
    found = re.search(r'^vllm:cache_config_info\{[^}]*num_gpu_blocks="(\d+)"', text, re.MULTILINE)
    return int(found.group(1)) if found else None


def pool_warning(pools: dict[str, int]) -> str | None:
    """A line for servers whose KV pools differ (name -> blocks), else None. Servers started side
    by side each size their pool from the memory free when they start, so the later ones get
    less, and at high concurrency a smaller pool queues requests: a comparison of methods then
    partly measures the order the servers were started in."""
    if len(set(pools.values())) < 2:
        return None
    listed = ", ".join(f"{name} {blocks}" for name, blocks in pools.items())
    return (f"bench-serve: the servers hold KV pools of different sizes ({listed} blocks): a server sizes its pool "
            f"from the memory free when it starts, so under load a smaller one queues requests; give every "
            f"command the same pool (specserve's --num-kv-blocks) to compare them at high concurrency")


def level_prompts(pool: list[str], num_requests: int, num_levels: int, distinct: bool) -> list[list[str]]:
    """Each level's prompts: the pool's first num_requests (cycled) at every level, or with
    `distinct` prompts of each level's own, every num_levels-th of the pool from the level's
    index on (a workload stored category by category, as Spec-Bench is, gives every level the
    same mix rather than one level the long summaries), which the pool must be long enough to give."""
    if not pool:
        raise InvalidParameterError("workload", 0, "must hold at least one prompt")
    if not distinct:
        return [[pool[i % len(pool)] for i in range(num_requests)]] * num_levels
    if len(pool) < num_requests * num_levels:
        raise InvalidParameterError("distinct-prompts", len(pool),
                                    f"needs {num_requests * num_levels} prompts in the workload ({num_requests} "
                                    f"requests at each of {num_levels} levels); it has {len(pool)}: fewer "
                                    f"--num-requests or levels, or a larger workload")
    stride = len(pool) // num_requests  # >= num_levels
    return [[pool[j * stride + i] for j in range(num_requests)] for i in range(num_levels)]


def run_bench_serve(args) -> int:
    levels = parse_levels(args.concurrency)
    if args.num_requests < 1 or args.max_tokens < 1:
        raise InvalidParameterError("num-requests/max-tokens", (args.num_requests, args.max_tokens), "each must be >= 1")
    servers = [Server(args.name, url=args.url)]
    servers += [Server(n, url=u) for n, u in (_named(v, "peer") for v in args.peer)]
    servers += [Server(n, command=c) for n, c in (_named(v, "peer-command") for v in args.peer_command)]
    names = [s.name for s in servers]
    if len(set(names)) != len(names):
        raise InvalidParameterError("peer", names, "each server needs a name of its own")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    pool = [p.text for p in select(load_workload(args.workload, args.field), Selection.from_text(args.categories, None, None))]
    prompts = level_prompts(pool, args.num_requests, len(levels), args.distinct_prompts)
    kind = "whole (not streamed)" if args.no_stream else "streaming"
    runs: list[LoadFigures] = []
    failures: list[str] = []
    try:
        for s in servers:
            s.start()
            s.model = _model_of(s, args.model if s is servers[0] else None, headers)
            s.kv_blocks = _kv_blocks(s, headers)
            pool = "" if s.kv_blocks is None else f", KV pool {s.kv_blocks} blocks"
            print(f"bench-serve: {s.name} at {s.url} model {s.model}{pool}", file=sys.stderr)
        pools = {s.name: s.kv_blocks for s in servers if s.kv_blocks is not None}
        if warning := pool_warning(pools):
            print(warning, file=sys.stderr)
        print(f"bench-serve: {args.num_requests} {kind} chat requests at concurrency {', '.join(map(str, levels))}, "
              f"max_tokens {args.max_tokens}, temperature {args.temperature}", file=sys.stderr)
        for i, level in enumerate(levels):
            for s in (servers if i % 2 == 0 else servers[::-1]):  # alternated: drift falls on every server
                timings, wall, cpu = asyncio.run(run_load(s.url, s.model, prompts[i], level, args.max_tokens,
                                                          args.temperature, args.api_key, stream=not args.no_stream))
                figures = summarise(s.url, level, timings, wall, s.name, cpu)
                runs.append(figures)
                print(figures.line(), file=sys.stderr if len(servers) > 1 or len(levels) > 1 else sys.stdout)
                failures += [f"{s.name}: {t.error}" for t in timings if not t.ok][:1]
    finally:
        for s in servers:
            s.stop()
    if len(servers) > 1 or len(levels) > 1:
        print(comparison_table(runs, names))
    for f in failures:
        print(f"  failed: {f}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": [asdict(r) for r in runs], "distinct_prompts": args.distinct_prompts,
                       "kv_blocks": {s.name: s.kv_blocks for s in servers}}, f, indent=2)
    return 0 if all(r.num_failed == 0 for r in runs) else 1
