"""specserve on Ray Serve: N engine replicas behind one HTTP endpoint, routed by prompt prefix.

Two deployments. `Ingress` is Ray Serve's HTTP entry: it reads each request (through the same
Guard as `specserve serve`: Host, API key, body size and time), takes the text its prompt begins
with, and hands the whole request to an `EngineReplica` through a deployment handle.
`EngineReplica` runs one specserve engine and its own FastAPI app (server/app.py, unchanged) and
answers the forwarded request with the ASGI messages that app sends, streamed back as they come.

Why two: Ray's router chooses a replica from the handle call's arguments, and Ray's HTTP proxy
calls an ingress with the request's ASGI scope only (the body follows later), so a router in
front of an engine that is itself the ingress never sees the prompt. Ray's own
PrefixCacheAffinityRouter matches prompts the same way but ships in `ray.serve.llm`, which needs
Ray's LLM extra (pyarrow, vLLM) to import; `PrefixAffinityRouter` below is a small RequestRouter
over server/prefix_affinity.py instead, with no blocking calls in the router's event loop.

A replica that dies: a request that has sent its client nothing yet is sent again to another
replica (generation starts over there; a greedy or seeded answer is the same); a stream already
under way ends with an error event saying the output is incomplete, then `data: [DONE]`, as a
stream whose generation failed does in `specserve serve`. Nothing ends silently.

Nothing else in specserve imports this module or Ray; `specserve serve-ray` (ray_launcher.py)
imports it when run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

from ray import serve
from ray.exceptions import RayActorError, RayError
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.types import Message, Receive, Scope, Send

from specserve.server.app import Guard
from specserve.server.errors import error_body, error_response
from specserve.server.prefix_affinity import DEFAULT_CHUNK_CHARS, PrefixIndex

logger = logging.getLogger("specserve.server")

REPLICA_HEADER = "x-specserve-replica"  # on every response: the Ray actor name of the replica that answered
ATTEMPTS = 3  # replicas a request is sent to before the client gets 503 (only while nothing was sent back)
_ROUTING_PROMPTS = ("/v1/completions", "/v1/chat/completions", "/tokenize")


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """What every engine replica builds: plain data, the same for all of them."""

    load: dict  # load_model's keyword arguments (the model path, dtype, device, ...)
    engine: dict  # LLM's engine keyword arguments (max_num_seqs, max_model_len, ...)
    speculative: dict | None  # LLM's speculative_config
    server: dict  # ServerConfig's fields other than served_model_names and max_model_len
    served_model_names: tuple[str, ...] | None  # None: the model's own name
    max_waiting: int | None


@dataclass(frozen=True, slots=True)
class DeploymentOptions:
    num_replicas: int
    cpus_per_replica: float  # Ray reserves them per replica and sets its OMP_NUM_THREADS to match
    max_ongoing_requests: int  # per replica: its running batch and its waiting queue
    grace_period_s: float  # a replica being stopped lets its requests run this long
    chunk_chars: int  # the router's prefix chunk (server/prefix_affinity.py)
    imbalance: int  # queue difference at which prefix affinity yields to load


def application(spec: ReplicaSpec, options: DeploymentOptions, guard: dict):
    """The Ray Serve application: `options.num_replicas` engine replicas built from `spec`, behind
    one ingress whose Guard has the settings `guard` (server/app.py)."""
    router = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                 request_router_kwargs={"chunk_chars": options.chunk_chars,
                                                        "imbalance": options.imbalance})
    engines = serve.deployment(EngineReplica, name="engine", num_replicas=options.num_replicas,
                               ray_actor_options={"num_cpus": options.cpus_per_replica},
                               max_ongoing_requests=options.max_ongoing_requests,
                               graceful_shutdown_timeout_s=options.grace_period_s, request_router_config=router)
    # The ingress only passes bytes along: no CPU of its own, and room for every request the
    # engines can hold (more wait in Ray's proxy).
    ingress = serve.deployment(serve.ingress()(Ingress), name="ingress", ray_actor_options={"num_cpus": 0},
                               max_ongoing_requests=options.num_replicas * options.max_ongoing_requests + 16)
    return ingress.bind(engines.bind(spec), guard)


def deploy(spec: ReplicaSpec, options: DeploymentOptions, guard: dict, host: str, port: int, name: str) -> str:
    """Start Ray Serve's HTTP proxy on host:port and run the application there (Ray must be
    initialised); returns once every replica is ready, with the URL it serves."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(spec, options, guard), name=name, route_prefix="/")
    return f"http://{host}:{port}"


@dataclass(frozen=True, slots=True)
class ForwardedRequest:
    """One HTTP request as the ingress read it, whole, for a replica's app."""

    method: str
    path: str
    query_string: bytes
    headers: list[tuple[bytes, bytes]]
    body: bytes
    client: tuple[str, int] | None
    routing_text: str | None  # the text the router matches prefixes on; None: route by load only


def routing_text(path: str, body: bytes) -> str | None:
    """The text a request's prompt begins with, as far as a router can tell without a tokenizer:
    a completion's (first) prompt, a chat's messages in order (the template renders them in that
    order), or token ids as text. None for other routes or a body that is no JSON object (the
    replica answers those; the router balances them by load)."""
    if path not in _ROUTING_PROMPTS:
        return None
    try:
        body = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(body, dict):
        return None
    if isinstance(messages := body.get("messages"), list):
        return "".join(f"{m.get('role')}:{_content_text(m.get('content'))}\n" for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # several prompts: one replica serves them all, chosen by the first
    if isinstance(prompt, list):
        return ",".join(map(str, prompt))
    return prompt if isinstance(prompt, str) and prompt else None


def _content_text(content) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


class PrefixAffinityRouter(RequestRouter):
    """Ranks the replica holding the longest remembered prefix of the request's text first (or,
    for a text matching nothing, the replica holding the fewest prefixes), then two others at
    random; Ray takes the least loaded replica of the first rank that has room. A replica whose
    known queue is `imbalance` requests longer than another's loses its preference, so affinity
    never piles a queue onto one engine while another idles."""

    def initialize_state(self, chunk_chars: int = DEFAULT_CHUNK_CHARS, imbalance: int = 16) -> None:
        self._index = PrefixIndex(chunk_chars)
        self._imbalance = imbalance

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        by_name = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        text = _text_of(pending_request)
        if not by_name:
            return []
        if text is None:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        match = self._index.match(text, by_name)
        first = by_name[match.replica or self._index.least_held(by_name)]
        rest = [r for r in candidate_replicas if r is not first]
        rest = random.sample(rest, min(2, len(rest)))
        if self._overloaded(first, rest):
            return [rest, [first]]
        return [[first], rest] if rest else [[first]]

    def _overloaded(self, replica: RunningReplica, others: list[RunningReplica]) -> bool:
        cache = self.replica_queue_len_cache
        mine = cache.get(replica.replica_id)
        lengths = [q for r in others if (q := cache.get(r.replica_id)) is not None]
        return mine is not None and bool(lengths) and mine - min(lengths) > self._imbalance

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result) -> None:
        if (text := _text_of(pending_request)) is not None:
            self._index.record(text, replica_id.to_full_id_str())

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self._index.forget(replica_id.to_full_id_str())


def _text_of(pending_request: PendingRequest | None) -> str | None:
    """The routing text of the request's ForwardedRequest. Read by attribute, not by class: Ray
    may hand the router an instance of a copy of the class (the ingress class travels pickled
    by value with what it refers to)."""
    if pending_request is None:
        return None
    texts = [t for a in pending_request.args if isinstance(t := getattr(a, "routing_text", None), str)]
    return texts[0] if texts else None


class EngineReplica:
    """One specserve engine and its app, answering forwarded HTTP requests."""

    async def __init__(self, spec: ReplicaSpec):
        from specserve.engine.async_engine import build_off_thread
        from specserve.llm import LLM
        from specserve.model.loader import load_model
        from specserve.server.launcher import build_app_for
        from specserve.server.serving import ServerConfig

        def build() -> LLM:
            loaded = load_model(**spec.load)
            return LLM(loaded=loaded, speculative_config=spec.speculative, **spec.engine)

        # Off the event loop (Ray's health checks keep running) and off any long-lived thread
        # (the engine thread must be the only OpenMP master: engine/async_engine.py).
        llm = await asyncio.to_thread(build_off_thread, build)
        config = ServerConfig(served_model_names=spec.served_model_names or (llm.target.name,),
                              max_model_len=llm.engine_config.max_model_len, **spec.server)
        self.app, self.engine = build_app_for(llm, config, spec.max_waiting)
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        self._lifespan = AsyncExitStack()
        await self._lifespan.enter_async_context(self.app.router.lifespan_context(self.app))
        logger.info("replica %s serves %s (%s; %s)", self.name, llm.target.name, llm.target.kernels,
                    llm.kv_budget.describe())

    async def handle(self, request: ForwardedRequest) -> AsyncIterator[Message]:
        """The ASGI messages the app sends for `request`, as it sends them. Closing this stream
        early is the client going away: the app sees the disconnect and aborts its requests."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": request.method, "path": request.path, "raw_path": request.path.encode(), "root_path": "",
                 "query_string": request.query_string, "headers": request.headers, "client": request.client,
                 "server": None}
        pending = [{"type": "http.request", "body": request.body, "more_body": False}]
        gone = asyncio.Event()
        sent: asyncio.Queue[Message | None] = asyncio.Queue()

        async def receive() -> Message:
            if pending:
                return pending.pop()
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.create_task(self.app(scope, receive, sent.put))
        task.add_done_callback(lambda _: sent.put_nowait(None))
        try:
            while (message := await sent.get()) is not None:
                if message["type"] == "http.response.start":
                    header = (REPLICA_HEADER.encode(), self.name.encode())
                    message = {**message, "headers": [*message.get("headers", []), header]}
                yield message
        finally:
            gone.set()
            await asyncio.wait([task])
            # An exception here was answered (500) and logged by the app's own handler.
            if not task.cancelled():
                task.exception()

    def check_health(self) -> None:
        """Ray replaces a replica whose check raises: one whose engine thread died."""
        if self.engine.error is not None:
            raise RuntimeError(f"the engine stopped after an internal error: {self.engine.error}")

    async def __del__(self):
        await self._lifespan.aclose()  # the app's lifespan: stop the engine thread, abort what runs


class Ingress:
    """Ray Serve's HTTP entry: guards and reads each request, forwards it to an engine replica."""

    def __init__(self, engines, guard: dict):
        self.engines = engines.options(stream=True, method_name="handle")
        self.guard = guard

    def __serve_build_asgi_app__(self):
        return Guard(self.asgi, **self.guard)

    async def asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            return await _lifespan(receive, send)
        if scope["type"] != "http":
            return
        chunks = []
        while (message := await receive())["type"] == "http.request":
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        else:
            return  # the client went away before its body arrived
        body = b"".join(chunks)
        client = tuple(scope["client"]) if scope.get("client") else None
        request = ForwardedRequest(scope["method"], scope["path"], scope.get("query_string", b""),
                                   [(bytes(k), bytes(v)) for k, v in scope["headers"]], body, client,
                                   routing_text(scope["path"], body))
        await self.forward(request, scope, receive, send)

    async def forward(self, request: ForwardedRequest, scope: Scope, receive: Receive, send: Send) -> None:
        failure: BaseException | None = None
        for _ in range(ATTEMPTS):
            failure = await self._attempt(request, scope, receive, send)
            if failure is None:
                return
        resp = error_response(503, f"no engine replica could answer after {ATTEMPTS} attempts (last: "
                                   f"{_describe(failure)}); retry the request", code="replica_unavailable",
                              headers={"Retry-After": "1"})
        await resp(scope, receive, send)

    async def _attempt(self, request: ForwardedRequest, scope: Scope, receive: Receive,
                       send: Send) -> BaseException | None:
        """Pass one replica's answer on. -> None once the client has its answer (whole, or one
        that says it is incomplete); the failure when the replica died before the client was sent
        anything, so that another replica may answer."""
        held: Message | None = None  # the response start, sent with the first body: a whole answer or none
        stream = sent = done = False
        generator = self.engines.remote(request)
        try:
            async for message in generator:
                if message["type"] == "http.response.start":
                    held = message
                    stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                                 for k, v in message.get("headers", []))
                    continue
                if held is not None:
                    await send(held)
                    held, sent = None, True
                await send(message)
            done = True
            return None
        except RayActorError as e:  # the replica died or cannot be reached
            done = True
            if not sent:
                logger.warning("an engine replica failed before answering (%s); the request goes to another",
                               _describe(e))
                return e
            failure = e
        except RayError as e:  # a bug in the replica's handler: no other replica would do better
            done = True
            if not sent:
                resp = error_response(500, f"internal error in specserve's engine replica: {_describe(e)}",
                                      code="internal_error")
                await resp(scope, receive, send)
                return None
            failure = e
        finally:
            if not done:  # the client went away (this task was cancelled): so does the replica's request
                generator.cancel()
        await _incomplete(send, stream, failure)
        return None


async def _incomplete(send: Send, stream: bool, failure: BaseException) -> None:
    """End an answer under way whose replica failed: a stream gets an error event and [DONE];
    any other body cannot be amended, so the connection is cut short (the client sees a body
    shorter than its Content-Length)."""
    if not stream:
        raise RuntimeError(f"the engine replica failed in the middle of a response: {_describe(failure)}")
    message = (f"the engine replica serving this request stopped ({_describe(failure)}); the output streamed so far "
               "is incomplete: send the request again")
    event = json.dumps(error_body(503, message, code="replica_failed"), separators=(",", ":"))
    await send({"type": "http.response.body", "body": f"data: {event}\n\ndata: [DONE]\n\n".encode(),
                "more_body": False})


def _describe(e: BaseException | None) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}" if e is not None else "none"


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
