"""Errors in the OpenAI format: {"error": {"message", "type", "param", "code"}} with the right
HTTP status. Everything a client can get wrong maps to a 4xx that names what was wrong and what
is allowed; a 500 means a bug in specserve."""

from __future__ import annotations

import re
from http import HTTPStatus

from fastapi.responses import JSONResponse
from pydantic import BaseModel

from specserve.server.protocol import ErrorInfo, ErrorResponse

# OpenAI's error "type" strings by status, so that clients raise their usual exception classes.
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 421: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          499: "client_closed_request", 503: "service_unavailable_error", 500: "internal_error"}


class APIError(Exception):
    """An HTTP error response: raised anywhere in request handling, rendered by the app."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.param, self.code, self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error object of a response with that status, or of a stream's error event (whose
    HTTP status, 200, was sent before the failure)."""
    kind = _TYPES.get(status) or HTTPStatus(status).phrase.lower().replace(" ", "_")
    return ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code)).model_dump()


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# The branch a union adds to an error's location ("prompt.list[constrained-int]"): the field is
# what a client needs to know.
_BRANCH = re.compile(r"^(str|int|float|bool|constrained-[\w-]+|[\w-]+\[.*\])$")


# OpenAI (and vLLM) request parameters specserve knows but does not implement yet: a request
# that sends one is told so, not that the parameter is unknown or out of range.
NOT_SUPPORTED = frozenset({
    "functions", "function_call", "best_of", "suffix", "audio", "modalities", "prediction",
    "reasoning_effort", "web_search_options"})


def field_ranges(model: type[BaseModel]) -> dict[str, str]:
    """The body's number fields bounded on both sides in its schema -> their range, "[-2, 2]"
    or "(0, 2]", which a message about an out-of-range value adds (pydantic names one bound)."""
    out: dict[str, str] = {}
    for name, prop in model.model_json_schema()["properties"].items():
        for s in [prop, *prop.get("anyOf", [])]:
            lo, hi = s.get("minimum", s.get("exclusiveMinimum")), s.get("maximum", s.get("exclusiveMaximum"))
            if lo is not None and hi is not None:
                out[name] = f"{'[' if 'minimum' in s else '('}{_number(lo)}, {_number(hi)}{']' if 'maximum' in s else ')'}"
                break
    return out


def _number(x: int | float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


_BOUNDS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})


def validation_message(errors: list[dict], required: tuple[str, ...] = (),
                       ranges: dict[str, str] | None = None) -> tuple[str, str | None]:
    """pydantic/FastAPI validation errors -> one message naming each bad field (what each
    branch of a union expected, once), and the first field's name as `param`. `required`: the
    body's required fields, named when the whole body is missing; `ranges`: field_ranges of the
    body, named when a value is out of its range."""
    fields: dict[str | None, list[dict]] = {}
    for e in errors:
        name = ".".join(str(x) for x in e.get("loc", ()) if x != "body" and not _BRANCH.match(str(x))) or None
        fields.setdefault(name, []).append(e)
    parts: list[str] = []
    for name, errs in list(fields.items())[:5]:
        e = errs[0]
        kind = e.get("type", "")
        if name in NOT_SUPPORTED:
            parts.append(f"{name!r} is not supported by specserve yet")
        elif kind == "json_invalid":
            parts.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', e.get('msg'))})")
        elif kind == "extra_forbidden":
            parts.append(f"unknown parameter {name!r}: this API does not accept it")
        elif kind == "missing" and name is None:
            names = " and ".join(repr(f) for f in required) or "the request's parameters"
            parts.append(f"the request body is empty; send a JSON object with {names}")
        elif kind == "missing":
            parts.append(f"missing required parameter {name!r}")
        elif name is None:
            parts.append(f"the body must be a JSON object ({e.get('msg')})")
        else:
            value = e.get("input")
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            expected = ", or ".join(dict.fromkeys(_expected(x) for x in errs))
            if ranges and name in ranges and any(x.get("type") in _BOUNDS for x in errs):
                expected += f" (allowed: {ranges[name]})"
            parts.append(f"invalid {name}={shown}: {expected}")
    if len(fields) > 5:
        parts.append(f"and {len(fields) - 5} more")
    return "; ".join(parts) or "invalid request", next((n for n in fields if n is not None), None)


def _expected(error: dict) -> str:
    if error.get("type") == "string_too_short" and error.get("ctx", {}).get("min_length") == 1:
        return "must not be empty"
    return error.get("msg", "invalid value")
