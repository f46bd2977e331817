"""Chat template rendering, the way `transformers` does it.

A chat template is Jinja code shipped with the model, so it is untrusted: it runs in jinja2's
immutable sandbox, with bounds (RenderBounds) on the values it builds with `*` and `**` and on the
text it renders, and RecursionError/MemoryError turned into a TemplateBoundsError naming the
template. The sandbox cannot bound time (an empty nested `for` loop calls no sandbox hook): the
server renders in a worker process it can kill (render_worker.py). The environment mirrors
`transformers.apply_chat_template` (trim_blocks, lstrip_blocks, loop controls, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML) so that a prompt renders to the same text,
and so the same token ids, as upstream.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.errors import InvalidParameterError, ModelLoadError, PromptError, SpecserveError

ALLOWED_ROLES = ("system", "user", "assistant", "tool")

# Used when a model ships no template. ChatML is what most small instruct models (SmolLM, Qwen)
# were tuned on, and it needs no model-specific special tokens beyond the text markers.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ (message['content'] or '') ~ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


# The largest integer a template may compute with `*` or `**`: no prompt needs more, and beyond it
# a power such as 9**9999999 costs seconds of CPU (and Python refuses to print over 4300 digits).
MAX_INT_BITS = 1 << 16


class TemplateBoundsError(SpecserveError):
    """The model's chat template went beyond a bound of RenderBounds (time, size, memory or
    recursion): the model's fault, not the messages'."""


@dataclass(frozen=True, slots=True)
class RenderBounds:
    """How far one render of a chat template may go."""

    time_s: float = 5.0  # wall-clock time of one render; enforced by the server's worker process only
    # The rendered prompt, and any one string or list a template builds with `*`: 4x the server's
    # default body limit, so any conversation a client can send fits with room for the template.
    max_output_chars: int = 8 << 20
    max_memory_bytes: int = 1 << 30  # address space of the render worker process (RLIMIT_AS)

    def __post_init__(self) -> None:
        if not self.time_s > 0:
            raise InvalidParameterError("time_s", self.time_s, "must be > 0 seconds")
        if self.max_output_chars < 1024:
            raise InvalidParameterError("max_output_chars", self.max_output_chars, "must be >= 1024")
        if self.max_memory_bytes < 256 << 20:
            raise InvalidParameterError("max_memory_bytes", self.max_memory_bytes, "must be >= 256 MiB")


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox with `*` and `**` checked before they run (jinja2's documented hook),
    so a template cannot make a gigabyte string or a ten-million-digit number in one step."""

    intercepted_binops = frozenset({"*", "**"})

    def __init__(self, max_size: int, **options) -> None:
        super().__init__(**options)
        self.max_size = max_size

    def call_binop(self, context, operator: str, left, right):
        ints = isinstance(left, int) and isinstance(right, int)
        if operator == "**" and ints and right > 0 and abs(left) > 1:
            if right * abs(left).bit_length() > MAX_INT_BITS:
                raise TemplateBoundsError(f"the model's chat template computes {left} ** {right}, a number beyond "
                                          f"the {MAX_INT_BITS}-bit limit of a chat template render")
        elif operator == "*" and ints:
            if abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise TemplateBoundsError("the model's chat template multiplies numbers beyond the "
                                          f"{MAX_INT_BITS}-bit limit of a chat template render")
        elif operator == "*":
            seq, times = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(times, int) and isinstance(seq, (str, list, tuple)) and len(seq) * times > self.max_size:
                raise TemplateBoundsError(f"the model's chat template builds a value of {len(seq) * times} items "
                                          f"with `*`, beyond the {self.max_size} limit of a chat template render")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's built-in tojson HTML-escapes `<`, `>` and `&`, which would change tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment(max_size: int) -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(max_size, trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: object) -> list[dict]:
    """Check the shape of an OpenAI-style message list before any template sees it.

    Templates fail on bad input with messages about Jinja internals (or render silently wrong),
    so the user gets an error naming the bad message instead.
    """
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        raise InvalidParameterError("messages", type(messages).__name__, "a list of {'role', 'content'} dicts")
    if not messages:
        raise PromptError("messages is empty: a chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
            raise InvalidParameterError(f"messages[{i}]", message, "a dict with 'role' and 'content' keys")
        if message["role"] not in ALLOWED_ROLES:
            raise InvalidParameterError(f"messages[{i}].role", message["role"], f"one of {', '.join(ALLOWED_ROLES)}")
        content = message["content"]
        # An assistant message that only calls tools carries content None, as in the OpenAI API.
        if not (isinstance(content, str) or (content is None and message.get("tool_calls"))):
            raise InvalidParameterError(f"messages[{i}].content", content, "a string")
    return [dict(m) for m in messages]


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled chat template plus the special-token strings it is rendered with."""

    source: str
    # bos_token / eos_token / unk_token / pad_token text, as transformers passes them to templates
    special_tokens: Mapping[str, str]
    bounds: RenderBounds = RenderBounds()
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment(self.bounds.max_output_chars).from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"the model's chat template is not valid Jinja (line {e.lineno}): {e.message}") from e
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None) -> str:
        """The prompt text; `tools`: the template's `tools` variable (tool_prompt.prompt_messages)."""
        messages = validate_messages(messages)
        limit = self.bounds.max_output_chars
        try:
            # Streamed piece by piece (render() would join them at once), so a template that
            # writes without end is stopped at the limit rather than at the end of memory.
            # tools/documents are passed as None when absent, not left undefined: templates test
            # `tools is not none`.
            parts, size = [], 0
            for part in self._compiled.generate(messages=messages, tools=tools, documents=None,
                                                add_generation_prompt=add_generation_prompt, **self.special_tokens):
                size += len(part)
                if size > limit:
                    raise TemplateBoundsError(f"the model's chat template rendered more than {limit} characters, "
                                              "the limit of a chat template render")
                parts.append(part)
            return "".join(parts)
        except jinja2.TemplateError as e:
            # Raised by the template itself, e.g. "Conversation roles must alternate user/assistant".
            raise PromptError(f"the chat template rejected the messages: {e.message or e}") from e
        except RecursionError:
            raise TemplateBoundsError("the model's chat template recursed too deeply (a macro calling itself "
                                      "without end?) while rendering these messages") from None
        except MemoryError:
            raise TemplateBoundsError(f"the model's chat template ran out of memory (the render limit is "
                                      f"{self.bounds.max_memory_bytes >> 20} MiB)") from None
