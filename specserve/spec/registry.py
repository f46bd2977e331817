"""The drafting methods by name: each method's module owns its options dataclass and its builder.

A method is a `MethodSpec`: its name (speculative_config's "method"), the frozen dataclass of its
own speculative_config keys (validated in its __post_init__), how to build its proposer, and the
cap on "auto"'s k. The built-in methods are listed here by module path only and imported on
first use: eagle, medusa, draft_model and self_spec pull in torch and the model code, which a
command that only checks a config (or uses n-gram drafting) need not pay for, and their modules
import specserve.config, which reads this registry (so this module imports no method module at
import time). Each such module defines `METHOD = MethodSpec(...)`. A method from elsewhere (a
plug-in, a test) is added with `register`, touching no module of specserve's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specserve.config import EngineConfig
    from specserve.model.loader import LoadedModel
    from specserve.spec.proposer import Proposer

# name -> the module defining its METHOD. The order is the command line's.
BUILTIN_METHODS = {"ngram": "specserve.spec.ngram", "suffix": "specserve.spec.suffix",
                   "self_spec": "specserve.spec.self_spec", "draft_model": "specserve.spec.draft_model",
                   "eagle": "specserve.spec.eagle", "eagle3": "specserve.spec.eagle3", "medusa": "specserve.spec.medusa",
                   "lookahead": "specserve.spec.lookahead"}
# Built-in methods that need a path in speculative_config's "model" (the command line's METHOD:PATH).
PATH_METHODS = ("draft_model", "eagle", "eagle3", "medusa")


@dataclass(frozen=True, slots=True)
class MethodSpec:
    name: str
    options_cls: type  # a frozen dataclass; its fields are the method's own speculative_config keys
    # (options, model path or None, target, engine config) -> the proposer
    build: Callable[[Any, "str | None", "LoadedModel", "EngineConfig"], "Proposer"]
    # "auto"'s cap on k: a number, or one computed from the options (lookahead: its tree's depth)
    auto_max_k: int | Callable[[Any], int]
    # Set for a method that drafts from a file: the message when speculative_config's "model" is missing.
    needs_model: str | None = None

    def auto_cap(self, options: Any) -> int:
        return self.auto_max_k(options) if callable(self.auto_max_k) else self.auto_max_k

    def option_defaults(self) -> dict[str, Any]:
        return {f.name: f.default for f in fields(self.options_cls) if f.default is not MISSING}


# Methods added by `register` (the built-ins are found through BUILTIN_METHODS instead): the one
# table that changes after import, as a plug-in's entry point would, and only by register/unregister.
_REGISTERED: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> None:
    """Add a drafting method, usable as speculative_config={"method": spec.name, ...}."""
    if spec.name in BUILTIN_METHODS:
        raise ValueError(f"method {spec.name!r} is built in")
    _REGISTERED[spec.name] = spec


def unregister(name: str) -> None:
    _REGISTERED.pop(name, None)


def method_names() -> tuple[str, ...]:
    return (*BUILTIN_METHODS, *_REGISTERED)


def method_spec(name: str) -> MethodSpec:
    """The method called `name` (KeyError when there is none)."""
    if name in BUILTIN_METHODS:
        return importlib.import_module(BUILTIN_METHODS[name]).METHOD
    return _REGISTERED[name]


def owners(key: str) -> list[str]:
    """The methods whose options include `key` (every built-in module is imported: this serves
    the message that refuses a key given with the wrong method)."""
    return [name for name in method_names() if key in {f.name for f in fields(method_spec(name).options_cls)}]
