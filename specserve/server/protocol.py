"""Request and response bodies of the OpenAI-compatible API (pydantic models).

Requests are strict: a string where a number belongs, a boolean where an integer belongs, or a
field the API does not know is a 400 naming the field, never a silent coercion or a guess. The
ranges here are OpenAI's, written into the OpenAPI document the server publishes, so clients
and fuzzers see the same contract the server enforces. Extensions beyond OpenAI (top_k, min_p,
ignore_eos, stop_token_ids, speculation controls) follow vLLM's names.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, WithJsonSchema

from specserve.config import MAX_SPECULATIVE_TOKENS
from specserve.sampling_params import (LOGIT_BIAS_RANGE, MAX_CHOICES, MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS, MAX_LOGPROBS,
                                       MAX_REPETITION_PENALTY, MAX_STOP, MAX_TOP_K, PENALTY_RANGE)
from specserve.server.tool_protocol import (MAX_TOOLS, TOOL_CHOICE_RULES, MessageToolCall, ToolCallDelta, ToolCallOut,
                                            ToolChoice, ToolDefinition)

MAX_N = 16  # choices per request; each is its own engine request
MAX_PROMPTS = 64  # prompts in one /v1/completions batch
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions API allows 0..5
_MAX_TEXT = 1 << 20


def model_bound(**bounds: str) -> dict:
    """Schema keywords whose values depend on the served model, e.g. maximum="last_token_id".
    They are written into the published OpenAPI document with the model's figures
    (`fill_model_bounds`), and serving.py and the engine enforce the same figures."""
    return {"x-model-bounds": bounds}


def fill_model_bounds(schema: object, figures: dict[str, int | str]) -> None:
    """Replace every model_bound marker in an OpenAPI document (in place) by its keywords with
    the model's figures: last_token_id, max_new_tokens, max_prompt_tokens, max_speculative_tokens,
    token_id_pattern."""
    if isinstance(schema, dict):
        for keyword, name in schema.pop("x-model-bounds", {}).items():
            schema[keyword] = figures[name]
        for value in schema.values():
            fill_model_bounds(value, figures)
    elif isinstance(schema, list):
        for value in schema:
            fill_model_bounds(value, figures)


def token_id_pattern(last: int) -> str:
    """A regular expression matching the decimal strings of 0..last, without leading zeros
    (logit_bias's keys: JSON object keys are strings)."""
    digits = str(last)

    def span(lo: int, hi: int) -> str:
        return str(lo) if lo == hi else f"[{lo}-{hi}]"

    def any_digits(n: int) -> str:
        return "" if n == 0 else "[0-9]" if n == 1 else f"[0-9]{{{n}}}"

    # 0, then the shorter numbers, then those as long as `last`: its first i digits, a smaller
    # digit, any rest; then `last` itself.
    alternatives = ["0"]
    if len(digits) == 2:
        alternatives.append("[1-9]")
    elif len(digits) > 2:
        alternatives.append(f"[1-9][0-9]{{0,{len(digits) - 2}}}")
    for i, d in enumerate(digits):
        low = 1 if i == 0 else 0
        if int(d) > low:
            alternatives.append(f"{digits[:i]}{span(low, int(d) - 1)}{any_digits(len(digits) - i - 1)}")
    alternatives.append(digits)
    return "^(" + "|".join(dict.fromkeys(alternatives)) + ")$"


def _forbids(fields: dict[str, dict]) -> dict:
    """A body-level schema refusing bodies where every one of `fields` is present and matches."""
    return {"not": {"required": list(fields), "properties": fields}}


def _integral(value: object) -> object:
    """JSON Schema's integers include numbers written with a zero fraction (3.0); strings and
    booleans stay refused."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


def integer(**constraints):
    """A JSON integer with pydantic Field constraints (ge, le, json_schema_extra). The
    constraints sit inside the conversion of 3.0 to 3, where the schema shows them as
    minimum and maximum."""
    return Annotated[StrictInt, Field(**constraints), BeforeValidator(_integral)]


Text = Annotated[StrictStr, Field(max_length=_MAX_TEXT)]
NonEmptyText = Annotated[StrictStr, Field(min_length=1, max_length=_MAX_TEXT)]
TokenId = integer(ge=0, json_schema_extra=model_bound(maximum="last_token_id"))
# OpenAI's logit_bias: token ids as JSON object keys (strings), each mapped to a number in
# [-100, 100]. serving.py converts and checks it (SamplingParams, and the engine's vocabulary);
# the published schema states the same bounds, with the model's token ids.
LogitBias = Annotated[dict[StrictStr, StrictFloat], WithJsonSchema({
    "type": "object", "maxProperties": MAX_LOGIT_BIAS,
    "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,9})$", **model_bound(pattern="token_id_pattern")},
    "additionalProperties": {"type": "number", "minimum": -LOGIT_BIAS_RANGE, "maximum": LOGIT_BIAS_RANGE},
    "description": "token id (a string key) -> a number in [-100, 100] added to its logit before sampling"})]
# Bounded by the context: serving.py answers a larger value with the most this prompt allows.
MaxNewTokens = integer(ge=1, json_schema_extra=model_bound(maximum="max_new_tokens"))


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: StrictBool = False


GrammarText = Annotated[StrictStr, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)]
# A JSON schema: an object, or (vLLM accepts it) its JSON text.
JsonSchema = dict | GrammarText
Choices = Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_CHOICES)]


class JsonSchemaFormat(_Strict):
    name: StrictStr = Field(max_length=256)
    description: StrictStr | None = Field(None, max_length=_MAX_TEXT)
    # "schema" in the body; named otherwise here, as pydantic models have a `schema` method.
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema; absent: any JSON object")
    strict: StrictBool | None = Field(None, description="accepted; the output always follows the schema")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, description="with type json_schema (required there)")


class StructuredOutputsBody(_Strict):
    """vLLM's `structured_outputs` extension: exactly one of its fields."""

    json_: JsonSchema | None = Field(None, alias="json")  # `json` is a pydantic model method
    regex: GrammarText | None = None
    choice: Choices | None = None
    grammar: GrammarText | None = Field(None, description="a Lark grammar, or llama.cpp's GBNF")
    json_object: StrictBool | None = None


class _SamplingFields(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: StrictStr | None = Field(None, description="a served model name; the default model when omitted")
    n: integer(ge=1, le=MAX_N) = 1
    temperature: StrictFloat | None = Field(None, ge=0, le=2, description="0 is greedy; default 1")
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    top_k: integer(ge=-1, le=MAX_TOP_K) | None = Field(None, description="extension: -1 or 0 disables top-k; "
                                                       "values at or above the vocabulary size keep every token")
    min_p: StrictFloat | None = Field(None, ge=0, le=1, description="extension")
    seed: integer(ge=0, le=2**63 - 1) | None = None
    stop: NonEmptyText | Annotated[list[NonEmptyText], Field(max_length=MAX_STOP)] | None = Field(
        None, description=f"up to {MAX_STOP} non-empty strings")
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE, description=(
        "subtracted from the logit of every token the output already has; default 0"))
    frequency_penalty: StrictFloat | None = Field(None, ge=-PENALTY_RANGE, le=PENALTY_RANGE, description=(
        "times the token's count in the output so far, subtracted from its logit; default 0"))
    repetition_penalty: StrictFloat | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY, description=(
        "extension (vLLM): divides positive logits, multiplies negative ones, of tokens in the prompt or the output; "
        "default 1"))
    logit_bias: LogitBias | None = None
    user: StrictStr | None = Field(None, max_length=256)
    ignore_eos: StrictBool = Field(False, description="extension")
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP, description="extension")
    speculative: StrictBool = Field(True, description="extension: false decodes this request without speculation")
    num_speculative_tokens: integer(ge=0, le=MAX_SPECULATIVE_TOKENS,
                                    json_schema_extra=model_bound(maximum="max_speculative_tokens")) | None = Field(
        None, description="extension: draft length for this request (0: none; only 0 on a server without speculation)")
    response_format: ResponseFormat | None = Field(
        None, description="json_object: the output is a JSON object; json_schema: a JSON value its schema accepts")
    structured_outputs: StructuredOutputsBody | None = Field(
        None, description="extension (vLLM): constrain the output to a JSON schema, regex, choices or grammar")
    guided_json: JsonSchema | None = Field(None, description="extension (vLLM's older name): a JSON schema")
    guided_regex: GrammarText | None = Field(None, description="extension (vLLM's older name)")
    guided_choice: Choices | None = Field(None, description="extension (vLLM's older name)")
    guided_grammar: GrammarText | None = Field(None, description="extension (vLLM's older name): Lark or GBNF")
    provenance: StrictBool = Field(
        False, description="extension: each choice also carries `provenance`, its text token by token as [text, "
                           "source] pairs (source: plain, draft, corrected or bonus: how the token came), and "
                           "`speculation`, its figures so far; in stream chunks, for the chunk's text (an echoed "
                           "prompt is not in it: it covers generated text only)")


TokenPrompt = Annotated[list[TokenId], Field(min_length=1, json_schema_extra=model_bound(maxItems="max_prompt_tokens"))]


class CompletionRequest(_SamplingFields):
    # A prompt, and the prompt plus max_tokens, must fit the context: a bound in tokens that a
    # schema cannot state for text, answered 400 (context_length_exceeded) when broken.
    prompt: NonEmptyText | Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_PROMPTS)] | \
        TokenPrompt | Annotated[list[TokenPrompt], Field(min_length=1, max_length=MAX_PROMPTS)]
    max_tokens: MaxNewTokens | None = Field(16, description="default 16 as in OpenAI; null: the rest of the context")
    logprobs: integer(ge=0, le=MAX_COMPLETION_LOGPROBS) | None = None
    echo: StrictBool = Field(False, description="not together with logprobs (prompt log probabilities are not computed)")

    # The schema says what serving.py answers 400: echo with logprobs.
    model_config = ConfigDict(json_schema_extra=_forbids({"echo": {"const": True}, "logprobs": {"type": "integer"}}))


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null: an assistant turn that only calls tools (as OpenAI sends it); empty text elsewhere
    content: Text | Annotated[list[TextPart], Field(min_length=1)] | None
    name: StrictStr | None = Field(None, max_length=256)
    tool_calls: Annotated[list[MessageToolCall], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="an assistant turn's calls")
    tool_call_id: StrictStr | None = Field(None, max_length=256, description="a tool turn: the call it answers")

    # The schema says what serving.py answers 400: calls in a turn other than the assistant's.
    model_config = ConfigDict(json_schema_extra={"not": {"required": ["tool_calls"], "properties": {
        "role": {"not": {"const": "assistant"}}, "tool_calls": {"type": "array", "minItems": 1}}}})


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)]
    max_tokens: MaxNewTokens | None = Field(None, description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: MaxNewTokens | None = Field(None, description="default: the rest of the context")
    logprobs: StrictBool = False
    top_logprobs: integer(ge=0, le=MAX_LOGPROBS) | None = Field(None, description="needs logprobs=true")
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = Field(None, description="default: auto with tools, none without; required "
                                                             "and a named function need tools and structured output")
    parallel_tool_calls: StrictBool | None = Field(None, description="false: at most one call; default true")

    # The schema says what serving.py answers 400: top_logprobs without logprobs=true, where
    # logprobs may be absent (false by default), so it cannot be one of _forbids' required fields;
    # and the tool_choice values this build cannot force (TOOL_CHOICE_RULES).
    model_config = ConfigDict(json_schema_extra={"allOf": TOOL_CHOICE_RULES, "not": {
        "required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}},
        "not": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}}}})


class TokenizeRequest(_Strict):
    """vLLM's /tokenize: a text prompt, or a chat rendered by the model's template as
    /v1/chat/completions renders it."""

    model: StrictStr | None = None
    prompt: Text | None = Field(None, description="text to tokenize (exactly one of prompt and messages)")
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=4096)] | None = None
    add_special_tokens: StrictBool = Field(True, description="prompt: the BOS token the model adds, if any")
    add_generation_prompt: StrictBool = Field(True, description="messages: end with the assistant turn's header")
    tools: Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="messages: offered to the model as /v1/chat/completions offers them")


class DetokenizeRequest(_Strict):
    model: StrictStr | None = None
    tokens: Annotated[list[TokenId], Field(max_length=1 << 20)]


# ---- responses -------------------------------------------------------------------------------


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str

class SpecUsage(BaseModel):
    """Extension of `usage`: how speculation went for this response (all choices)."""

    num_drafted_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float
    mean_accepted_length: float  # tokens per target pass; 1.0 without speculation
    num_target_passes: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    speculative: SpecUsage | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top_logprobs: list[dict[str, float]] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprobOut(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[TokenLogprobOut] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "specserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
