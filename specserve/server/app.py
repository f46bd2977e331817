"""The HTTP routes of the OpenAI-compatible server, its guard (Host, API key, body size and
time) and its error handlers. Translation to engine calls lives in serving.py; the bodies in protocol.py."""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specserve import __version__
from specserve.server.errors import APIError, error_response, field_ranges, validation_message
from specserve.server.metrics import ServerMetrics
from specserve.server.playground import add_playground
from specserve.server.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                       CompletionResponse, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
                                       ModelCard, ModelList, TokenizeRequest, TokenizeResponse, fill_model_bounds)
from specserve.server.serving import OpenAIServing

logger = logging.getLogger("specserve.server")

_ERRORS = {code: {"model": ErrorResponse, "description": text} for code, text in [
    (400, "invalid request: the message names the parameter and what is allowed"),
    (401, "missing or wrong API key"), (404, "unknown model"),
    (421, "the Host header is not a name of this server (see --allowed-host)"),
    (408, "the request headers or body did not arrive within --header-timeout or --body-timeout seconds"),
    (413, "request body too large"),
    (500, "generating this request failed (a bug in specserve); the server goes on serving others"),
    (503, "the waiting queue is full, the server holds --max-connections connections, or it is shutting down")]}
# With "stream": true the answer is server-sent events (the schema describes one event): each
# one's data a chunk as JSON, or an error object if generation failed after the stream began,
# and the last one's `[DONE]`.
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}
_GENERATION = _ERRORS | {200: {"content": {"text/event-stream": {"schema": _EVENT}},
                               "description": "the response, or its stream of chunks"}}

# The body model of each route that takes one, to name its required fields when it is missing.
_BODIES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest,
           "/tokenize": TokenizeRequest, "/detokenize": DetokenizeRequest}
# What a 404 lists: the routes a client of this server may call.
_ROUTES = "POST /v1/completions, /v1/chat/completions, /tokenize, /detokenize; GET /v1/models, /health, /metrics"


def build_app(serving: OpenAIServing, metrics: ServerMetrics) -> FastAPI:
    ranges = {path: field_ranges(body) for path, body in _BODIES.items()}  # named in out-of-range messages
    config = serving.config
    engine = serving.engine

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        serving.chat_renderer.start()
        try:
            yield
        finally:
            # The HTTP server has stopped taking connections and waited (up to the grace
            # period) for open ones; whatever still runs is aborted here.
            engine.shutdown()
            serving.chat_renderer.close()

    # No /docs or /redoc: FastAPI's pages load their scripts from a CDN. The document they
    # would show is /openapi.json.
    app = FastAPI(title="specserve", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  description="OpenAI-compatible API of a specserve engine (lossless speculative decoding)")
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       body_timeout_s=config.body_timeout_s, allowed_hosts=config.allowed_hosts)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        body = _BODIES.get(request.url.path)
        required = tuple(n for n, f in body.model_fields.items() if f.is_required()) if body else ()
        message, param = validation_message(list(e.errors()), required, ranges.get(request.url.path))
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        status = 400 if e.status_code == 422 else e.status_code
        detail = str(e.detail)
        if status == 404:  # (OpenAI routes specserve has not: /v1/embeddings, /v1/responses, ...)
            detail = f"{request.method} {request.url.path} is not supported by specserve; it serves {_ROUTES}"
        elif status == 405:
            detail = f"{request.method} is not allowed on {request.url.path}; it serves {_ROUTES}"
        return error_response(status, detail, headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(500, f"internal error in specserve: {type(e).__name__}")

    @app.get("/health", responses={503: _ERRORS[503]})
    async def health() -> Response:
        if not engine.accepting:
            return error_response(503, "the engine is not taking requests (shutting down or stopped)")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", response_class=PlainTextResponse, responses={200: {
        "description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", response_model=ModelList, responses={401: _ERRORS[401]})
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=name, created=0, max_model_len=config.max_model_len)
                               for name in config.served_model_names])

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_GENERATION)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await serving.completions(body, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_GENERATION)
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await serving.chat(body, raw)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        return await serving.tokenize(body)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        return await serving.detokenize(body)

    def openapi() -> dict:
        """FastAPI's document, with the served model's bounds filled in and without the 422
        responses FastAPI lists by default (invalid requests get 400 here)."""
        if app.openapi_schema is None:
            doc = FastAPI.openapi(app)
            fill_model_bounds(doc, serving.model_bounds())
            for operation in (op for path in doc["paths"].values() for op in path.values()):
                operation["responses"].pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                doc["components"]["schemas"].pop(name, None)
        return app.openapi_schema

    app.openapi = openapi
    if config.ui:
        add_playground(app)
    return app


def is_local_name(host: str) -> bool:
    """Whether a Host name (lowercase, without port) names this machine: localhost, 127.0.0.0/8, ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def host_name(value: bytes) -> str:
    """A Host header's name, lowercase, without its port or brackets ("[::1]:8000" -> "::1")."""
    host = value.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return (host.rsplit(":", 1)[0] if host.count(":") == 1 else host).rstrip(".")


class Guard:
    """ASGI middleware in front of every route: answers only Host names it allows (with
    `allowed_hosts` set: local names and those; a DNS-rebinding page names its own domain),
    checks the API key of /v1 calls (a constant-time comparison, so response timing does not
    leak the key; the scheme "Bearer" in any case, as RFC 7235 has it), marks every response
    `X-Content-Type-Options: nosniff`, and reads request bodies up to
    `max_body_bytes`, refusing larger ones with 413 before anything parses them, and bodies
    still incomplete after `body_timeout_s` with 408 (a client that declares more bytes than it
    sends would otherwise hold its connection and a handler for as long as it likes)."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout_s: float,
                 allowed_hosts: tuple[str, ...] | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.allowed_hosts = allowed_hosts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_nosniff(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-content-type-options" for k, _ in headers):
                    message = {**message, "headers": [*headers, (b"x-content-type-options", b"nosniff")]}
            await send(message)

        return await self._guard(scope, receive, send_nosniff)

    async def _guard(self, scope: Scope, receive: Receive, send: Send) -> None:
        headers = {k.decode("latin-1").lower(): v for k, v in scope["headers"]}
        if self.allowed_hosts is not None and "*" not in self.allowed_hosts:
            # Every Host header must pass; none at all (HTTP/1.0) is no browser's request.
            bad = [v for k, v in scope["headers"] if k.lower() == b"host"
                   and not ((name := host_name(v)) in self.allowed_hosts or is_local_name(name))]
            if bad:
                return await self._wrong_host(scope, receive, send, bad[0])
        if self.api_key is not None and scope["path"].startswith("/v1"):
            given = headers.get("authorization", b"")
            scheme, _, token = given.strip().partition(b" ")
            if not (hmac.compare_digest(token.strip(), self.api_key) and scheme.lower() == b"bearer"):
                what = "missing" if not given else "wrong"
                resp = error_response(401, f"{what} API key: send the header 'Authorization: Bearer <key>' with "
                                           "the key the server was started with (--api-key)", code="invalid_api_key")
                return await resp(scope, receive, send)
        declared = headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            return await self._too_large(scope, receive, send, int(declared))
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), deadline - asyncio.get_running_loop().time())
            except asyncio.TimeoutError:
                return await self._too_slow(scope, receive, send, size)
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return await self._too_large(scope, receive, send, size)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the disconnect can come

        await self.app(scope, replay, send)

    async def _wrong_host(self, scope: Scope, receive: Receive, send: Send, host: bytes) -> None:
        others = f" and {', '.join(self.allowed_hosts)}" if self.allowed_hosts else ""
        resp = error_response(421, f"the Host header {host.decode('latin-1')!r} is not a name of this server: it "
                                   f"answers local names only (localhost, 127.0.0.0/8, [::1]){others}, so that a "
                                   "page on another site cannot reach it through DNS rebinding; start the server "
                                   "with --allowed-host NAME to answer another name", code="invalid_host")
        await resp(scope, receive, send)

    async def _too_slow(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        resp = error_response(408, f"the request body was not complete after {self.body_timeout_s:g} seconds "
                                   f"({size} bytes arrived; --body-timeout); send the whole body at once",
                              code="body_timeout", headers={"Connection": "close"})
        await resp(scope, receive, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        resp = error_response(413, f"the request body ({size} bytes or more) is larger than the limit of "
                                   f"{self.max_body_bytes} bytes (--max-body-bytes)", code="body_too_large",
                              headers={"Connection": "close"})
        await resp(scope, receive, send)
