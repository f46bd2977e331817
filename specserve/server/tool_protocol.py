"""Request and response bodies of OpenAI's tool calling (pydantic models, strict as protocol.py's).

Kept apart from protocol.py, which imports them into the chat request and its messages.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr


MAX_TOOLS = 128  # OpenAI's limit on the tools of one request
_MAX_TEXT = 1 << 20

# OpenAI's rule for function names; the same in tools, tool_choice and past calls.
FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class FunctionDefinition(_Strict):
    name: FunctionName
    description: Annotated[StrictStr, Field(max_length=_MAX_TEXT)] | None = None
    parameters: dict[str, Any] | None = Field(None, description="a JSON Schema of the arguments object; "
                                                                "omitted: the function takes none")
    strict: StrictBool | None = Field(None, description="accepted for compatibility")


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionRef(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionRef


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Strict):
    name: FunctionName
    arguments: Annotated[StrictStr, Field(max_length=_MAX_TEXT)] = Field(description="the arguments as JSON text")


class MessageToolCall(_Strict):
    """A call in an assistant message of the conversation so far."""

    id: Annotated[StrictStr, Field(max_length=256)]
    type: Literal["function"]
    function: CalledFunction


# ---- responses -------------------------------------------------------------------------------


class ToolCallFunction(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ToolCallDelta(ToolCallOut):
    """A call in a stream chunk: whole, at its index among the choice's calls."""

    index: int


# ---- what the schema forbids that pydantic lets through (serving.py answers it 400) ----------

_FORCING = {"required": ["tool_choice"], "properties": {"tool_choice": {"anyOf": [{"const": "required"},
                                                                                  {"type": "object"}]}}}
# Forcing a call needs tools to call (a named function's name among them is beyond a schema).
TOOL_CHOICE_RULES = [{"not": _FORCING | {"not": {
    "required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}}]
