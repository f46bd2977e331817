"""User-facing errors.

Every mistake a user can make (a bad parameter, a missing model file, an unsupported
architecture) raises a subclass of `SpecserveError` whose message names what was wrong and
what is allowed. The CLI prints these as one line and exits with status 2; the server turns
them into OpenAI-style 400 responses. Anything else escaping is a bug in specserve.
"""

from __future__ import annotations


class SpecserveError(Exception):
    """Base class for errors caused by user input or the user's environment."""


class InvalidParameterError(SpecserveError, ValueError):
    """A parameter is outside its allowed range.

    `param` names the parameter so that API layers can point at it.
    """

    def __init__(self, param: str, value: object, allowed: str):
        self.param = param
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {param}={value!r}: {allowed}")


class ModelLoadError(SpecserveError):
    """A model path is missing, corrupt, or in a format or architecture specserve cannot load."""


class PromptError(SpecserveError, ValueError):
    """A prompt is empty or does not fit the model's context."""
