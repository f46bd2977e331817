"""Tool calling in the server: which tools a chat request shows the model, how a call is forced,
and generated text turned into OpenAI's tool calls, whole or as stream deltas.

tool_choice "none" shows the model no tools and reads no calls; "auto" (the default with tools)
shows them and reads calls from the reply (tokenizer/tool_calls.py). "required" and a named
function force a call: the reply is constrained to a call's JSON schema (forced_call_schema)
through structured output (sample/grammar.py); a model whose tokenizer the grammar engine cannot
read answers them 400.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from specserve import sampling_params
from specserve.server.errors import APIError
from specserve.tokenizer.tool_calls import ToolCall, ToolCallParser, parse_reply


@dataclass(frozen=True, slots=True)
class ToolPolicy:
    """How the replies of one request are read for calls."""

    names: frozenset[str]  # the functions offered; a call to any other is content
    parallel: bool  # false: the first call only (parallel_tool_calls=false)

    def parser(self) -> ToolCallParser:
        return ToolCallParser(self.names, self.parallel)


def offered_tools(req) -> list[dict] | None:
    """The request's tools as the chat template takes them ({"type": "function", "function":
    {...}}), or None when none are shown to the model: none sent, or tool_choice "none"."""
    tools = getattr(req, "tools", None)
    if not tools or getattr(req, "tool_choice", None) == "none":
        return None
    # Fields left out stay out (templates test `description is defined`); the parameters schema
    # is kept as sent, nulls included.
    return [{"type": t.type, "function": {k: v for k, v in dict(t.function).items() if v is not None}}
            for t in tools]


def tool_policy(req) -> ToolPolicy | None:
    """How to read the request's replies for calls; None: not at all (its text is content)."""
    tools = offered_tools(req)
    if tools is None:
        return None
    return ToolPolicy(frozenset(t["function"]["name"] for t in tools), req.parallel_tool_calls is not False)


def _call_schema(function: dict) -> dict:
    arguments = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": arguments},
            "required": ["name", "arguments"], "additionalProperties": False}


def forced_call_schema(tools: list[dict], tool_choice: str | dict) -> dict | None:
    """The JSON schema of a reply that makes the call tool_choice asks for: for "required" a
    call of any of `tools` ({"name": const, "arguments": its parameters}, anyOf), for a named
    function ({"type": "function", "function": {"name": ...}}) a call of that one; None for
    "auto" and "none", where the model chooses. The reply is then one bare JSON call, which
    tool_calls.py reads as a call."""
    if tool_choice == "required":
        return {"anyOf": [_call_schema(t["function"]) for t in tools]}
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        return _call_schema(next(t["function"] for t in tools if t["function"]["name"] == name))
    return None


def forcing_fields(req) -> dict:
    """The SamplingParams fields that force the call the request's tool_choice asks for ({} when
    it forces none); APIError 400 for a choice that cannot be forced."""
    choice = getattr(req, "tool_choice", None)
    if choice in (None, "none", "auto"):
        return {}
    tools = offered_tools(req) or []
    names = [t["function"]["name"] for t in tools]
    shown = "'required'" if choice == "required" else f"naming the function {choice.function.name!r}"
    if not tools:
        raise APIError(400, f"tool_choice {shown} needs tools to call; send tools, or leave tool_choice out",
                       "tool_choice")
    if choice != "required" and choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not among the "
                            f"tools ({', '.join(map(repr, names))})", "tool_choice")
    schema = forced_call_schema(tools, choice if choice == "required" else choice.model_dump())
    return {"structured_outputs": sampling_params.StructuredOutputsParams(json=schema)}


# ---- replies -> OpenAI's tool calls ----------------------------------------------------------


def _call_body(call: ToolCall) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _finish_reason(reason: str | None, called: bool) -> str | None:
    # A reply that called tools and ended by itself ends in "tool_calls"; one cut short keeps
    # its reason ("length", "abort").
    return "tool_calls" if called and reason == "stop" else reason


def reply_message(policy: ToolPolicy, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """A whole reply -> (the choice's assistant message, its finish_reason)."""
    parsed = parse_reply(text, policy.names, policy.parallel)
    message: dict = {"role": "assistant", "content": parsed.content}
    if parsed.calls:
        message["tool_calls"] = [_call_body(c) for c in parsed.calls]
    return message, _finish_reason(finish_reason, bool(parsed.calls))


def stream_delta(parser: ToolCallParser, new_text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The next piece of a streamed reply -> (its delta's content and tool_calls, the chunk's
    finish_reason). finish_reason: the reply's, on its last piece; None before. Each call goes
    out whole, in one delta, once its block has closed."""
    first_index = parser.num_calls
    piece = parser.feed(new_text)
    if finish_reason is not None:
        rest = parser.finish()
        piece.content += rest.content
        piece.calls += rest.calls
    delta: dict = {}
    if piece.content or not piece.calls:
        delta["content"] = piece.content
    if piece.calls:
        delta["tool_calls"] = [{"index": first_index + i, **_call_body(c)} for i, c in enumerate(piece.calls)]
    return delta, None if finish_reason is None else _finish_reason(finish_reason, parser.num_calls > 0)
