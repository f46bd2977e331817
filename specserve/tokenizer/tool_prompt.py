"""Tools and tool turns in chat prompts, for templates that know them and for those that do not.

A template that refers to `tools` gets them as transformers' `apply_chat_template(..., tools=...)`
passes them: the variable `tools`, a list of {"type": "function", "function": {...}}; and, as
transformers documents and vLLM does, the arguments of an assistant's past calls as objects, not
the JSON text the OpenAI API carries.

A template that does not (the embedded SmolLM2's, the ChatML default) gets the Hermes format
written into the messages instead, as llama.cpp polyfills templates without tool support: the
tools and how to call them go into the system message (tools_system_block), an assistant's past
calls become `<tool_call>` blocks in its content, and tool results become a user turn of
`<tool_response>` blocks (one turn for consecutive results, so templates that insist on
alternating user and assistant turns still render). Replies in that format are read back by
tool_calls.py.
"""

from __future__ import annotations

import json
import re

_TOOLS_VARIABLE = re.compile(r"\btools\b")


def template_uses_tools(source: str) -> bool:
    """Whether a chat template refers to the `tools` variable (else it would drop them silently)."""
    return bool(_TOOLS_VARIABLE.search(source))


def tools_system_block(tools: list[dict]) -> str:
    """The Hermes-format tool instructions for a template without tool support."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more of the functions below to help with the user's request. "
            "Their signatures are listed within <tools></tools> XML tags:\n"
            f"<tools>\n{listed}\n</tools>\n\n"
            "To call a function, answer with a JSON object of its name and arguments within "
            "<tool_call></tool_call> XML tags, one block per call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>')


def _arguments(text: object) -> object:
    """A call's arguments as an object where its JSON text holds one; other text as it is."""
    if isinstance(text, str):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError):
            return text
        return value if isinstance(value, dict) else text
    return text


def _with_call_objects(message: dict) -> dict:
    calls = [dict(c, function=dict(c["function"], arguments=_arguments(c["function"].get("arguments"))))
             for c in message["tool_calls"]]
    return dict(message, tool_calls=calls)


def _call_blocks(message: dict) -> str:
    calls = [{"name": c["function"]["name"], "arguments": _arguments(c["function"].get("arguments"))}
             for c in message["tool_calls"]]
    blocks = [f"<tool_call>\n{json.dumps(c, ensure_ascii=False)}\n</tool_call>" for c in calls]
    return "\n".join(([message["content"]] if message.get("content") else []) + blocks)


def hermes_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """`messages` in the Hermes format, for a template that knows no tools: plain role and
    content messages only."""
    out: list[dict] = []
    if tools:
        block = tools_system_block(tools)
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0], messages[1:]
            out.append({"role": "system", "content": f"{system['content'] or ''}\n\n{block}".lstrip()})
        else:
            out.append({"role": "system", "content": block})
    for m in messages:
        if m["role"] == "tool":
            response = f"<tool_response>\n{m['content'] or ''}\n</tool_response>"
            if out and out[-1].get("tool_responses"):
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response, "tool_responses": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            out.append({"role": "assistant", "content": _call_blocks(m)})
        else:  # calls in a turn other than the assistant's have no place in the format
            out.append({"role": m["role"], "content": m["content"] if m["content"] is not None else ""})
    return [{"role": m["role"], "content": m["content"]} for m in out]


def prompt_messages(messages: list[dict], tools: list[dict] | None,
                    template_source: str) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the template is to be rendered with them: tools as its variable if it
    refers to them, else written into the messages in the Hermes format (and no variable)."""
    if template_uses_tools(template_source):
        return [_with_call_objects(m) if m.get("tool_calls") else m for m in messages], tools or None
    if tools or any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return hermes_messages(messages, tools), None
    return messages, None
