"""Chat template rendering, the way `transformers` does it.

A chat template is Jinja code shipped with the model, so it is untrusted: it runs in jinja2's
immutable sandbox. The environment mirrors `transformers.apply_chat_template` (trim_blocks,
lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not escape
HTML) so that a prompt renders to the same text, and so the same token ids, as upstream.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from specserve.errors import InvalidParameterError, ModelLoadError, PromptError

ALLOWED_ROLES = ("system", "user", "assistant", "tool")

# Used when a model ships no template. ChatML is what most small instruct models (SmolLM, Qwen)
# were tuned on, and it needs no model-specific special tokens beyond the text markers.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' ~ message['role'] ~ '\\n' ~ (message['content'] or '') ~ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's built-in tojson HTML-escapes `<`, `>` and `&`, which would change tool schemas in prompts.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
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
    _compiled: jinja2.Template = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        try:
            compiled = _environment().from_string(self.source)
        except jinja2.TemplateSyntaxError as e:
            raise ModelLoadError(f"the model's chat template is not valid Jinja (line {e.lineno}): {e.message}") from e
        object.__setattr__(self, "_compiled", compiled)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        messages = validate_messages(messages)
        try:
            # tools/documents are passed as None, not left undefined: templates test `tools is not none`.
            return self._compiled.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self.special_tokens,
            )
        except jinja2.TemplateError as e:
            # Raised by the template itself, e.g. "Conversation roles must alternate user/assistant".
            raise PromptError(f"the chat template rejected the messages: {e.message or e}") from e
