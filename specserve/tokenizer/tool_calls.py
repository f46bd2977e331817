"""Tool calls in generated text: the Hermes format, whole or streamed.

A reply calls tools with `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (several
blocks are parallel calls), the format of Hermes-tuned models, of Qwen2.5's template, and of the
system block tool_prompt.py writes for templates without tools. A reply that is exactly one such
JSON object, without the tags, is a call too: small models often drop the tags, and a reply
constrained to a call's JSON schema has none.

Only functions the request offered count, and only blocks whose JSON parses: anything else stays
content, so no generated text can fail a request. One parser serves whole replies and streams
(a whole reply is one piece), so a streamed reply splits into exactly the content and calls of
the same reply answered whole. Whitespace next to a call belongs to no content, except that
content before a call and content after it stay apart by the whitespace that followed the call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL_KEYS = ({"name", "arguments"}, {"name", "parameters"}, {"name"})


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's responses carry arguments as a string)


@dataclass(slots=True)
class Piece:
    """What one fed piece of text decided: content to show and calls made, in reply order
    (content first when a piece holds both)."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def parse_call(text: str, names: frozenset[str]) -> ToolCall | None:
    """A call from the JSON text of one call, or None when it is not one: not a JSON object of
    exactly a name and arguments (or parameters, or neither for a function without any), a name
    not offered, or arguments that are not an object (a JSON string holding one counts)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or set(value) not in _CALL_KEYS or value["name"] not in names:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _partial_open(text: str) -> int:
    """The length of the longest end of `text` that begins OPEN (held back: the tag may follow)."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0


class ToolCallParser:
    """Splits a reply, fed in pieces, into content and tool calls.

    Held back until decided: a possible start of OPEN at a piece's end, an open block until its
    CLOSE, whitespace at the end of content (dropped if a call follows), and a reply whose first
    non-space character is `{` (a bare JSON call is known only at its end). `parallel=False`
    keeps the first call and drops later ones.
    """

    def __init__(self, names: frozenset[str], parallel: bool = True):
        self.names = names
        self.parallel = parallel
        self.num_calls = 0  # calls returned so far (the next call's index in a stream)
        self._calls_seen = 0  # calls read, those parallel=False drops included
        self._content_seen = False  # some content went out
        self._mode = "start"  # start: only whitespace so far; json: a bare object may follow; text
        self._buffer = ""  # undecided text
        self._inside = False  # the buffer begins with OPEN
        self._space = ""  # whitespace ending the content so far (dropped if a call follows)

    def feed(self, text: str) -> Piece:
        piece = Piece()
        self._buffer += text
        if self._mode == "start" and self._buffer.strip():
            self._mode = "json" if self._buffer.lstrip().startswith("{") else "text"
        if self._mode == "text":
            self._scan(piece)
        return piece

    def finish(self) -> Piece:
        """The rest of the reply, once it has ended."""
        piece = Piece()
        if self._mode == "json":
            call = parse_call(self._buffer, self.names)
            if call is not None:
                self._buffer = ""
                self._call(call, piece)
            self._mode = "text"
        self._scan(piece)
        if self._inside:  # a block the reply did not close: a call if its JSON is whole
            call = parse_call(self._buffer[len(OPEN):], self.names)
            if call is not None:
                self._call(call, piece)
            else:
                self._text(self._buffer, piece)
        else:
            self._text(self._buffer, piece)
        self._buffer, self._inside = "", False
        if not self._calls_seen:
            piece.content += self._space
        self._space = ""
        return piece

    def _scan(self, piece: Piece) -> None:
        while True:
            if not self._inside:
                start = self._buffer.find(OPEN)
                if start < 0:
                    keep = len(self._buffer) - _partial_open(self._buffer)
                    self._text(self._buffer[:keep], piece)
                    self._buffer = self._buffer[keep:]
                    return
                self._text(self._buffer[:start], piece)
                self._buffer, self._inside = self._buffer[start:], True
            end = self._buffer.find(CLOSE, len(OPEN))
            if end < 0:
                return
            block, self._buffer = self._buffer[:end + len(CLOSE)], self._buffer[end + len(CLOSE):]
            self._inside = False
            call = parse_call(block[len(OPEN):end], self.names)
            if call is not None:
                self._call(call, piece)
            else:
                self._text(block, piece)

    def _text(self, text: str, piece: Piece) -> None:
        if self._calls_seen and not self._content_seen:
            text = text.lstrip()
        text = self._space + text
        core = text.rstrip()
        self._space = text[len(core):]
        if core:
            piece.content += core
            self._content_seen = True

    def _call(self, call: ToolCall, piece: Piece) -> None:
        self._space = ""
        self._calls_seen += 1
        if self.parallel or self.num_calls == 0:
            piece.calls.append(call)
            self.num_calls += 1


@dataclass(frozen=True, slots=True)
class ParsedReply:
    content: str | None  # the text outside the calls; None when calls left none
    calls: tuple[ToolCall, ...]


def parse_reply(text: str, names: frozenset[str], parallel: bool = True) -> ParsedReply:
    """A whole reply's content and calls; without calls the content is the text unchanged."""
    parser = ToolCallParser(names, parallel)
    first, rest = parser.feed(text), parser.finish()
    calls = tuple(first.calls + rest.calls)
    content = first.content + rest.content
    return ParsedReply(None if calls and not content else content, calls)
