"""`specserve bench-serve`: a load client for a running OpenAI-compatible server (specserve or
any other), measuring what a user of the API sees: requests/s, output tokens/s, time to first
token and time per output token, from the client side of the connection.

N streams stay in flight: each client sends its next prompt as soon as its last answer ended.
Time per output token of a request is (last token time - first token time) / (tokens - 1),
with tokens counted from the server's usage figures (stream_options.include_usage).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import asdict, dataclass

from specserve.bench.throughput import percentile
from specserve.bench.workload import Selection, load_workload, select
from specserve.errors import InvalidParameterError


def add_bench_serve_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="load-test a running OpenAI-compatible server with streaming chat requests")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--concurrency", type=int, default=16, help="streams kept in flight")
    p.add_argument("--num-requests", type=int, default=64, help="requests in all")
    p.add_argument("--workload", default="spec_bench", help="'spec_bench' or a JSONL file")
    p.add_argument("--field", default=None,
                   help="JSONL field holding the prompt (a string or a list of turns; default: turns, prompt or text, "
                        "the first a row holds)")
    p.add_argument("--categories", default=None)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-stream", action="store_true",
                   help="ask for whole responses (stream false): latency and tokens/s only, no TTFT or TPOT")
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

    def line(self) -> str:
        def ms(v: float | None) -> str:
            return "-" if v is None else f"{v:.1f}"

        return (f"concurrency {self.concurrency} | {self.num_requests} requests ({self.num_failed} failed) in "
                f"{self.wall_s:.1f} s | {self.requests_per_s:.2f} req/s | {self.output_tokens_per_s:.1f} output tok/s | "
                f"TTFT p50 {ms(self.ttft_p50_ms)} ms, p99 {ms(self.ttft_p99_ms)} ms | "
                f"TPOT p50 {ms(self.tpot_p50_ms)} ms, p99 {ms(self.tpot_p99_ms)} ms")


async def one_request(client, url: str, body: dict) -> RequestTiming:
    if not body["stream"]:
        return await _whole_request(client, url, body)
    start = time.perf_counter()
    first = last = None
    tokens = 0
    try:
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                return RequestTiming(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
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


async def _whole_request(client, url: str, body: dict) -> RequestTiming:
    """A non-streamed request: its latency and the tokens its usage reports."""
    start = time.perf_counter()
    try:
        r = await client.post(f"{url}/v1/chat/completions", json=body)
        if r.status_code != 200:
            return RequestTiming(False, error=f"HTTP {r.status_code}: {r.text[:200]!r}")
        tokens = r.json()["usage"]["completion_tokens"]
    except Exception as e:  # a load client reports failures, it does not stop on them
        return RequestTiming(False, error=repr(e))
    return RequestTiming(True, None, None, time.perf_counter() - start, tokens)


async def run_load(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int,
                   temperature: float, api_key: str | None, stream: bool = True) -> tuple[list[RequestTiming], float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    queue: asyncio.Queue[str] = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    timings: list[RequestTiming] = []

    async def worker(client) -> None:
        while not queue.empty():
            prompt = queue.get_nowait()
            body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                    "temperature": temperature, "stream": stream}
            if stream:
                body["stream_options"] = {"include_usage": True}
            timings.append(await one_request(client, url, body))

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*[worker(client) for _ in range(concurrency)])
        wall = time.perf_counter() - start
    return timings, wall


def summarise(url: str, concurrency: int, timings: list[RequestTiming], wall: float) -> LoadFigures:
    ok = [t for t in timings if t.ok]
    ttft = [t.ttft_s * 1000 for t in ok if t.ttft_s is not None]
    tpot = [t.tpot_s * 1000 for t in ok if t.tpot_s is not None]
    return LoadFigures(url, concurrency, len(timings), len(timings) - len(ok), wall, len(ok) / wall,
                       sum(t.output_tokens for t in ok) / wall, percentile(ttft, 50), percentile(ttft, 99),
                       percentile(tpot, 50), percentile(tpot, 99), percentile([t.latency_s for t in ok], 50))


def run_bench_serve(args) -> int:
    import httpx

    if args.concurrency < 1 or args.num_requests < 1 or args.max_tokens < 1:
        raise InvalidParameterError("concurrency/num-requests/max-tokens",
                                    (args.concurrency, args.num_requests, args.max_tokens), "each must be >= 1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        models = httpx.get(f"{args.url}/v1/models", headers=headers, timeout=10).json()["data"]
    except (httpx.HTTPError, KeyError, ValueError) as e:
        raise InvalidParameterError("url", args.url, f"no OpenAI-compatible server answers there ({e})") from None
    model = args.model or models[0]["id"]
    pool = [p.text for p in select(load_workload(args.workload, args.field), Selection.from_text(args.categories, None, None))]
    prompts = [pool[i % len(pool)] for i in range(args.num_requests)]
    kind = "whole (not streamed)" if args.no_stream else "streaming"
    print(f"bench-serve: {args.url} model {model}, {args.num_requests} {kind} chat requests, "
          f"concurrency {args.concurrency}, max_tokens {args.max_tokens}, temperature {args.temperature}", file=sys.stderr)
    timings, wall = asyncio.run(run_load(args.url, model, prompts, args.concurrency, args.max_tokens,
                                         args.temperature, args.api_key, stream=not args.no_stream))
    figures = summarise(args.url, args.concurrency, timings, wall)
    print(figures.line())
    for t in timings:
        if not t.ok:
            print(f"  failed: {t.error}", file=sys.stderr)
            break
    if args.json:
        with open(args.json, "w") as f:
            json.dump(asdict(figures), f, indent=2)
    return 0 if figures.num_failed == 0 else 1
