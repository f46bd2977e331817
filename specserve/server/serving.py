"""Translation between the OpenAI API and engine calls: prompts to token ids, request fields to
SamplingParams, engine outputs to response bodies and server-sent events.

Each choice of a request (n choices per prompt) is its own engine request; all of them are
submitted before any output is awaited, so they share engine steps. Each has a follower task
that reads its engine stream to the end, whatever becomes of the HTTP side, hands the outputs to
the handler and counts the request in the metrics once, from its last output. A watcher task
listens for the client going away: its engine requests are then aborted, their KV blocks return
to the pool at the next step boundary, and their followers see the aborted last outputs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from specserve.config import MAX_SPECULATIVE_TOKENS
from specserve.engine.async_engine import AsyncEngine, EngineStoppedError, QueueFullError
from specserve.errors import InvalidParameterError, PromptError, SpecserveError
from specserve.outputs import RequestOutput, SpecStats, TextPiece
from specserve.sampling_params import SamplingParams, StructuredOutputsParams, choice_seed
from specserve.server import render
from specserve.server.errors import APIError, error_body
from specserve.server.metrics import ServerMetrics
from specserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse,
                                       TokenizeRequest, TokenizeResponse, token_id_pattern)
from specserve.server.tools import ToolPolicy, forcing_fields, offered_tools, tool_policy
from specserve.tokenizer import Tokenizer
from specserve.tokenizer.chat import RenderBounds, TemplateBoundsError
from specserve.tokenizer.render_worker import RenderWorker
from specserve.tokenizer.tool_calls import ToolCallParser

logger = logging.getLogger("specserve.server")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    served_model_names: tuple[str, ...]  # the first is the name responses carry
    max_model_len: int
    api_key: str | None = None
    max_body_bytes: int = 2 << 20  # request bodies above this are refused before parsing
    body_timeout_s: float = 10.0  # a request body must arrive whole within this time (else 408)
    log_prompts: bool = False  # prompt text in the per-request log line (off: prompts may be private)
    grace_period_s: float = 30.0  # on SIGTERM, how long running requests may take to finish
    ui: bool = True  # the playground page at / (server/playground.py); off with --no-ui
    # Off: control-token text in chat messages (`<|im_end|>`) is encoded as plain text, so a user
    # cannot close their turn and forge a system one. On (--special-tokens-in-content): encoded as
    # control tokens, as transformers and vLLM do, for clients that are trusted to write them.
    special_tokens_in_content: bool = False
    chat_render: RenderBounds = RenderBounds()  # time, size and memory bounds of a chat template render
    # Host header values answered (lowercase names; "*": any); None: no check. The launcher
    # sets the local names when bound to loopback, where a DNS-rebinding page would otherwise
    # reach the API as its own origin.
    allowed_hosts: tuple[str, ...] | None = None
    header_timeout_s: float = 10.0  # a connection must send complete request headers within this time (else 408)
    max_connections: int = 1024  # open connections; more are answered 503 and closed
    max_request_choices: int = 64  # engine requests one HTTP request may make (prompts x n)


@dataclass(slots=True)
class Choice:
    """One engine request behind one choice of a response."""

    index: int
    prompt_index: int
    handle: object  # the AsyncEngine submission
    follower: asyncio.Task | None = None  # reads the engine stream to its end (OpenAIServing._follow)
    # The latest output of this choice: its final one once finished; while streaming, the last
    # one whose chunk went out.
    last: RequestOutput | None = None
    text_sent: bool = False  # the first stream chunk of this choice went out
    logprobs_sent: int = 0
    # Jobs asking for provenance without streaming: the text's pieces, gathered from every output.
    pieces: list[TextPiece] = field(default_factory=list)
    tool_parser: ToolCallParser | None = None  # a request with tools: this choice's reply read for calls

    @property
    def finish_reason(self) -> str:
        """How the choice ended; one that never finished was aborted (its client went away, or
        the server shut down)."""
        return str(self.last.outputs[0].finish_reason) if self.last is not None and self.last.finished else "abort"

    @property
    def failure(self) -> str | None:
        """The message for a choice whose generation raised (finish_reason "error"), else None."""
        if self.finish_reason != "error":
            return None
        return (f"internal error in specserve while generating choice {self.index} "
                f"({self.last.outputs[0].error}); the server goes on serving other requests")


@dataclass(slots=True)
class Job:
    """An HTTP request on its way through the engine."""

    request_id: str
    model: str
    prompts: list[tuple[list[int], str | None]]
    chunk_object: str  # the "object" of its stream chunks
    provenance: bool = False  # choices carry token provenance and speculation figures (an extension)
    tools: ToolPolicy | None = None  # how replies are read for tool calls; None: they are content
    choices: list[Choice] = field(default_factory=list)
    # (choice, its next output or the exception that ended its stream), from the followers;
    # None once the client has gone away.
    outputs: asyncio.Queue = field(default_factory=asyncio.Queue)
    started: float = field(default_factory=time.perf_counter)
    created: int = field(default_factory=lambda: int(time.time()))  # the same in every chunk


class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, config: ServerConfig, metrics: ServerMetrics):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = metrics
        self.render = render.Renderer(tokenizer)
        # The model's chat template is untrusted code: it runs in a worker process with a time limit.
        self.chat_renderer = RenderWorker(config.chat_render)
        self._followers: set[asyncio.Task] = set()  # held here: the loop keeps only weak references

    # ---- endpoints -----------------------------------------------------------------------------

    async def completions(self, req: CompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        if req.echo and req.logprobs is not None:
            raise APIError(400, "echo together with logprobs is not supported (prompt log probabilities are not "
                                "computed); drop one of them", "echo")
        # In a thread: a 2 MB prompt takes ~1 s to encode, and the event loop serves others meanwhile.
        prompts = await asyncio.to_thread(self._completion_prompts, req.prompt)
        job = Job(f"cmpl-{uuid.uuid4().hex}", model, prompts, "text_completion", req.provenance)
        # OpenAI's default of 16 new tokens, when the client sent none, is cut to the context left.
        explicit = "max_tokens" in req.model_fields_set and req.max_tokens is not None
        params = self._params(req, prompts, {"max_tokens": req.max_tokens} if explicit else {}, req.max_tokens,
                              logprobs=req.logprobs)
        self._submit(job, req, params)
        echo = [text if req.echo else "" for _, text in prompts]
        if req.stream:
            return self._stream(job, raw, lambda c, out, first: self.render.completion_chunk(
                job, c, out, echo[c.prompt_index] if first else ""), req.stream_options)
        await self._collect(job, raw)
        return JSONResponse(self.render.completion(job, echo))

    async def chat(self, req: ChatCompletionRequest, raw: Request) -> Response:
        model = self.model_name(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
        forcing = forcing_fields(req)
        text, ids = await self._chat_prompt(req, add_generation_prompt=True)
        job = Job(f"chatcmpl-{uuid.uuid4().hex}", model, [(ids, text)], "chat.completion.chunk", req.provenance,
                  tools=tool_policy(req))
        # max_completion_tokens wins over the deprecated max_tokens (as in OpenAI and vLLM); each
        # one sent must still fit the context.
        asked = {name: value for name, value in (("max_completion_tokens", req.max_completion_tokens),
                                                 ("max_tokens", req.max_tokens)) if value is not None}
        params = self._params(req, job.prompts, asked, None, logprobs=(req.top_logprobs or 0) if req.logprobs else None,
                              extra=forcing)
        self._submit(job, req, params)
        if req.stream:
            return self._stream(job, raw, lambda c, out, first: self.render.chat_chunk(job, c, out, first),
                                req.stream_options)
        await self._collect(job, raw)
        return JSONResponse(self.render.chat(job))

    async def tokenize(self, req: TokenizeRequest) -> TokenizeResponse:
        self.model_name(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt (text) or messages (a chat)", "prompt")
        if req.prompt is not None:
            ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt, req.add_special_tokens)
        else:
            _, ids = await self._chat_prompt(req, add_generation_prompt=req.add_generation_prompt)
        return TokenizeResponse(count=len(ids), max_model_len=self.config.max_model_len, tokens=ids)

    async def detokenize(self, req: DetokenizeRequest) -> DetokenizeResponse:
        self.model_name(req.model)
        vocab = self.engine.vocab_size
        bad = next((t for t in req.tokens if t >= vocab), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary (ids 0..{vocab - 1})", "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(self.tokenizer.decode, req.tokens))

    async def _chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest,
                           add_generation_prompt: bool) -> tuple[str, list[int]]:
        """The request's messages rendered by the model's template -> (text, token ids)."""
        messages, tools = chat_messages(req), offered_tools(req)
        try:
            # Rendered in the worker process and encoded in a thread, so the event loop serves
            # others meanwhile (a 2 MB conversation takes ~1 s to encode).
            return await asyncio.to_thread(
                self.tokenizer.chat_prompt, messages, add_generation_prompt=add_generation_prompt,
                plain_content=not self.config.special_tokens_in_content, renderer=self.chat_renderer.render,
                tools=tools)
        except TemplateBoundsError as e:  # the model's template, not the messages, is at fault
            raise APIError(500, str(e), "messages", "chat_template_error") from e
        except Exception as e:  # a template may reject a conversation (e.g. roles out of order)
            raise APIError(400, f"the model's chat template rejected these messages: {e}", "messages") from e

    def model_bounds(self) -> dict[str, int | str]:
        """The served model's figures that bound request fields (protocol.model_bound)."""
        limit = self.config.max_model_len
        return {"last_token_id": self.engine.vocab_size - 1, "max_new_tokens": limit - 1, "max_prompt_tokens": limit - 1,
                "max_speculative_tokens": MAX_SPECULATIVE_TOKENS if self.engine.speculative else 0,
                "token_id_pattern": token_id_pattern(self.engine.vocab_size - 1)}

    def model_name(self, requested: str | None) -> str:
        names = self.config.served_model_names
        if requested is None or requested in names:
            return names[0]
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {', '.join(map(repr, names))}",
                       "model", "model_not_found")

    # ---- request -> engine -----------------------------------------------------------------------

    def _completion_prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        out = []
        vocab = self.engine.vocab_size
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "the prompt is empty; give some text", "prompt")
                out.append((self.tokenizer.encode(p), p))
            else:
                bad = [t for t in p if t >= vocab]
                if bad:
                    raise APIError(400, f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})", "prompt")
                out.append((list(p), self.tokenizer.decode(p)))
        return out

    def _params(self, req, prompts, asked: dict[str, int], default_max: int | None,
                logprobs: int | None, extra: dict | None = None) -> Callable[[int, int], SamplingParams]:
        """Checks the request against the context and the per-request cap, and returns params
        for (prompt, choice). `asked`: the new-token limits the client sent, by field name (the
        first one counts; each must fit); `default_max`: the limit when it sent none (None: the
        rest of the context), cut to the context left; `extra`: more SamplingParams fields."""
        cap = self.config.max_request_choices
        if len(prompts) * req.n > cap:
            raise APIError(400, f"this request asks for {len(prompts)} prompt(s) x n={req.n} = {len(prompts) * req.n} "
                                f"completions; one request may ask for at most {cap} (--max-request-choices), so "
                                "that it cannot fill the server's queue alone; split it", "n")
        limit = self.config.max_model_len
        longest = max(len(ids) for ids, _ in prompts)
        prompt_param = "messages" if isinstance(req, ChatCompletionRequest) else "prompt"
        if longest >= limit:
            raise APIError(400, f"this model's maximum context length is {limit} tokens, but the prompt has "
                                f"{longest} tokens (at least one must be left to generate); shorten the prompt",
                           prompt_param, "context_length_exceeded")
        for ids, _ in prompts:  # the engine's own checks, answered before any stream starts
            try:
                self.engine.check_prompt(ids)
            except PromptError as e:
                raise APIError(400, str(e), prompt_param) from e
        for name, value in asked.items():
            if longest + value > limit:
                raise APIError(400, f"this model's maximum context length is {limit} tokens, but the request asks "
                                    f"for {longest} prompt tokens plus {value} new tokens ({name}); "
                                    f"{name} may be at most {limit - longest} for this prompt",
                               name, "context_length_exceeded")
        max_tokens = next(iter(asked.values()), default_max)
        stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
        if req.num_speculative_tokens and not self.engine.speculative:
            raise APIError(400, f"invalid num_speculative_tokens={req.num_speculative_tokens}: this server runs "
                                "without speculative decoding (start it with --speculative); only 0 is allowed",
                           "num_speculative_tokens")
        constraint, field = structured_outputs(req)
        if constraint is not None and extra and "structured_outputs" in extra:
            raise APIError(400, f"{field} and a forced tool call (tool_choice 'required' or a named function) both "
                                "constrain the output; send one of them", field)
        base = dict(temperature=1.0 if req.temperature is None else req.temperature,
                    top_p=1.0 if req.top_p is None else req.top_p, top_k=req.top_k or 0,
                    min_p=req.min_p or 0.0, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
                    ignore_eos=req.ignore_eos, logprobs=logprobs,
                    presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                    repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                    logit_bias=logit_bias_ids(req.logit_bias), structured_outputs=constraint) | (extra or {})

        def make(prompt_index: int, choice: int) -> SamplingParams:
            room = limit - len(prompts[prompt_index][0])
            try:
                params = SamplingParams(max_tokens=min(max_tokens or room, room), seed=choice_seed(req.seed, choice),
                                        **base)
                self.engine.check_params(params)  # compiles the grammar: a bad schema or regex is a 400 here
            except InvalidParameterError as e:
                if field is not None and e.param.startswith("structured_outputs"):
                    # Named as the client sent it (response_format, guided_json, ...).
                    raise APIError(400, f"invalid {field}={e.value!r}: {e.allowed}", field) from e
                if extra and "structured_outputs" in extra and e.param.startswith("structured_outputs"):
                    # The grammar of a forced tool call (its tools' parameters schemas).
                    raise APIError(400, f"tool_choice {req.tool_choice if isinstance(req.tool_choice, str) else 'naming a function'} "
                                        f"forces a call through a grammar of the tools' parameters, which failed: "
                                        f"{e.allowed}", "tool_choice") from e
                raise APIError(400, str(e), e.param) from e
            return params

        make(0, 0)  # every field is checked before anything is queued
        return make

    def _submit(self, job: Job, req, params: Callable[[int, int], SamplingParams]) -> None:
        try:
            for p, (ids, text) in enumerate(job.prompts):
                for j in range(req.n):
                    index = p * req.n + j
                    # A whole response without provenance reads only each choice's last output.
                    handle = self.engine.submit(f"{job.request_id}-{index}", ids, params(p, j), text,
                                                use_speculation=req.speculative,
                                                num_speculative_tokens=req.num_speculative_tokens,
                                                final_only=not req.stream and not job.provenance)
                    parser = job.tools.parser() if job.tools is not None else None
                    job.choices.append(self._follow(job, Choice(index, p, handle, tool_parser=parser)))
        except BaseException as e:
            self._abort_unfinished(job)
            if isinstance(e, QueueFullError):
                raise APIError(503, str(e), code="queue_full", headers={"Retry-After": "1"}) from e
            if isinstance(e, EngineStoppedError):
                raise APIError(503, str(e), code="unavailable") from e
            raise

    def _follow(self, job: Job, c: Choice) -> Choice:
        """Start c's follower: every output of its engine stream goes to `job.outputs`, its new
        tokens to the metrics, and the request is counted in the metrics once, when its stream
        ends."""
        async def follow() -> None:
            last, counted = None, 0
            try:
                async for last in self.engine.stream(c.handle):
                    counted = self.metrics.generated(last, counted)
                    job.outputs.put_nowait((c, last))
            except Exception as e:  # refused after submission, or the engine stopped
                self.metrics.failed()
                job.outputs.put_nowait((c, e))
                return
            self.metrics.ended(last)

        self.metrics.submitted()
        c.follower = asyncio.create_task(follow())
        self._followers.add(c.follower)
        c.follower.add_done_callback(self._followers.discard)
        return c

    def _abort_unfinished(self, job: Job) -> None:
        """Abort the choices whose streams have not ended (the client went away, a sibling
        failed, or the handler stops early); their followers read on to the aborted ends."""
        for c in job.choices:
            if not c.follower.done():
                self.engine.abort(c.handle.request_id)

    def _watch(self, job: Job, raw: Request) -> asyncio.Task:
        """A task that puts None into the job's outputs once the client has gone away."""
        watcher = asyncio.create_task(_wait_disconnect(raw))
        watcher.add_done_callback(lambda _: job.outputs.put_nowait(None))
        return watcher

    # ---- engine -> response --------------------------------------------------------------------

    async def _collect(self, job: Job, raw: Request) -> None:
        watcher = self._watch(job, raw)
        try:
            remaining = len(job.choices)
            while remaining:
                item = await job.outputs.get()
                if item is None:
                    raise APIError(499, "the client closed the connection")
                c, out = item
                if isinstance(out, SpecserveError):
                    raise APIError(400, str(out)) from out
                if isinstance(out, Exception):
                    raise out
                c.last = out
                if job.provenance:
                    c.pieces.extend(out.new_pieces)
                remaining -= out.finished
            failure = next((c.failure for c in job.choices if c.failure), None)
            if failure:
                raise APIError(500, failure, code="internal_error")
        finally:
            watcher.cancel()
            self._abort_unfinished(job)
            self._log(job)

    def _stream(self, job: Job, raw: Request, chunk: Callable[[Choice, RequestOutput, bool], dict],
                options) -> StreamingResponse:
        include_usage = bool(options and options.include_usage)
        return StreamingResponse(self._events(job, raw, chunk, include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def _events(self, job: Job, raw: Request, chunk, include_usage: bool) -> AsyncIterator[str]:
        watcher = self._watch(job, raw)
        try:
            remaining = len(job.choices)
            while remaining:
                item = await job.outputs.get()
                if item is None:
                    return  # the client is gone: the finally aborts what still runs
                c, out = item
                if isinstance(out, Exception):  # refused by the engine, after the stream began
                    yield _sse(error_body(400 if isinstance(out, SpecserveError) else 500, str(out),
                                          getattr(out, "param", None)))
                    break
                if out.finished and out.outputs[0].finish_reason == "error":
                    c.last = out
                    yield _sse(error_body(500, c.failure, code="internal_error"))
                    break
                first = not c.text_sent
                c.text_sent = True
                if out.finished:
                    remaining -= 1
                yield _sse(chunk(c, out, first))
                c.last = out  # the chunk went out: the consumer asked for the next one
            else:
                if include_usage:
                    yield _sse(self.render.usage_chunk(job))
            yield "data: [DONE]\n\n"
        finally:
            watcher.cancel()
            self._abort_unfinished(job)
            self._log(job)

    def _log(self, job: Job) -> None:
        lasts = [c.last for c in job.choices if c.last is not None]
        spec = SpecStats.total(o.spec for o in lasts)
        reasons = ",".join(sorted({c.finish_reason for c in job.choices}))
        line = (f"{job.request_id}: {len(job.choices)} choice(s), prompt {sum(len(p) for p, _ in job.prompts)} tok, "
                f"output {sum(len(o.outputs[0].token_ids) for o in lasts)} tok, finish {reasons}, "
                f"latency {time.perf_counter() - job.started:.3f}s")
        if spec.num_drafted:
            line += (f", acceptance {spec.acceptance_rate:.2f} ({spec.num_accepted}/{spec.num_drafted}), "
                     f"mean accepted length {spec.mean_accepted_length:.2f}")
        if self.config.log_prompts:
            line += f", prompt {json.dumps([t for _, t in job.prompts])[:500]}"
        logger.info(line)


def logit_bias_ids(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, token ids as strings -> SamplingParams' {token id: value}; SamplingParams
    checks the values and the engine the ids against the vocabulary."""
    if bias is None:
        return None
    bad = next((k for k in bias if not (k.isascii() and k.isdigit()) or (len(k) > 1 and k[0] == "0")), None)
    if bad is not None:
        raise APIError(400, f"invalid logit_bias key {bad!r}: keys must be token ids written in decimal (\"42\")",
                       "logit_bias")
    return {int(k): v for k, v in bias.items()}


def chat_messages(req: ChatCompletionRequest | TokenizeRequest) -> list[dict]:
    """The request's messages as the chat template takes them: OpenAI's "developer" role is the
    system role, a content of text parts is their text, a null content is empty text except in
    an assistant turn that calls tools, and calls and call ids come along."""
    out = []
    for i, m in enumerate(req.messages):
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages[{i}] has role {m.role!r} and tool_calls; only an assistant turn calls "
                                "tools", f"messages.{i}.tool_calls")
        content = m.content if m.content is None or isinstance(m.content, str) else "".join(p.text for p in m.content)
        message = {"role": "system" if m.role == "developer" else m.role,
                   "content": "" if content is None and not m.tool_calls else content}
        if m.tool_calls:
            message["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


async def _wait_disconnect(raw: Request) -> None:
    """Returns when the client has closed the connection (the body was already read, so the
    next ASGI message can only be the disconnect)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'), allow_nan=False)}\n\n"


# vLLM's older request fields, each one kind of StructuredOutputsParams.
_GUIDED = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"), ("guided_grammar", "grammar"))


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's output constraint and the field that set it, as the client named it
    (response_format's schema, a structured_outputs field or a guided_* field); (None, None)
    without one. At most one of those fields may be given."""
    given: list[tuple[str, dict]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        given.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs its json_schema object "
                                "({\"name\": ..., \"schema\": {...}})", "response_format.json_schema")
        schema = fmt.json_schema.schema_
        given.append(("response_format.json_schema.schema", {"json": schema} if schema is not None else {"json_object": True}))
    so = req.structured_outputs
    if so is not None:
        kinds = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar, "json_object": so.json_object}
        set_ = [k for k, v in kinds.items() if v is not None and v is not False]
        given.append((f"structured_outputs.{set_[0]}" if len(set_) == 1 else "structured_outputs", kinds))
    given += [(name, {kind: getattr(req, name)}) for name, kind in _GUIDED if getattr(req, name) is not None]
    if not given:
        return None, None
    if len(given) > 1:
        names = " and ".join(name.split(".")[0] for name, _ in given)
        raise APIError(400, f"{names} each constrain the output; give only one of them", given[1][0].split(".")[0])
    field, kinds = given[0]
    try:
        return StructuredOutputsParams(**kinds), field
    except InvalidParameterError as e:
        raise APIError(400, str(e), e.param) from e
