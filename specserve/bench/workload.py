"""Benchmark workloads: Spec-Bench (shipped with the package) or any JSONL file of prompts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specserve.errors import InvalidParameterError, SpecserveError

SPEC_BENCH = "spec_bench"
DEFAULT_CATEGORY = "all"  # for JSONL rows without a `category` field


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    category: str
    text: str  # the first user turn; rendered through the model's chat template when run


@dataclass(frozen=True, slots=True)
class Selection:
    """Which prompts of a workload to run; None means no filter of that kind."""

    categories: tuple[str, ...] | None = None
    per_category: int | None = None  # the first N prompts of each category
    limit: int | None = None  # then the first N overall

    def __post_init__(self) -> None:
        for name in ("per_category", "limit"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise InvalidParameterError(name, value, "must be >= 1")
        if self.categories is not None and not self.categories:
            raise InvalidParameterError("categories", "", "name at least one category")

    @classmethod
    def from_text(cls, categories: str | None, per_category: int | None, limit: int | None) -> "Selection":
        cats = None if categories is None else tuple(c.strip() for c in categories.split(",") if c.strip())
        return cls(cats, per_category, limit)


def spec_bench_path() -> Path:
    return Path(str(resources.files("specserve") / "data" / "spec_bench" / "question.jsonl"))


def read_jsonl(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed row) of every non-blank line; a line that is not JSON is an error
    naming the file and line."""
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecserveError(f"{path}:{n} is not valid JSON: {e}") from None


# The fields a row's prompt is looked for in when none is named: Spec-Bench's, then the usual
# (the same rule as train-draft's --prompts): a string, a list of turns, or chat messages.
AUTO_FIELDS = ("turns", "prompt", "text", "messages")


def first_turn(value: object) -> str | None:
    """A row field's prompt text: the string itself, the first of a list of turns, or the first
    user message of a list of chat messages; None when it holds none."""
    if isinstance(value, list) and value:
        if all(isinstance(m, dict) for m in value):
            value = next((m.get("content") for m in value if m.get("role") == "user"), None)
        else:
            value = value[0]
    return value if isinstance(value, str) and value.strip() else None


def load_workload(workload: str, field: str | None = None) -> list[BenchPrompt]:
    """`spec_bench`, or a JSONL file whose `field` holds a prompt string or a list of turns
    (of which the first is used: later turns need the model's own earlier answers). `field`
    None: the first of AUTO_FIELDS each row holds."""
    path = spec_bench_path() if workload == SPEC_BENCH else Path(workload).expanduser()
    if not path.is_file():
        raise SpecserveError(f"workload {workload!r} is neither '{SPEC_BENCH}' nor an existing JSONL file")
    prompts = []
    for n, row in read_jsonl(path):
        key = field
        if key is None and isinstance(row, dict):
            key = next((k for k in AUTO_FIELDS if k in row), None)
        value = first_turn(row.get(key)) if isinstance(row, dict) and key is not None else None
        if value is None:
            if field is None:
                raise InvalidParameterError("field", None, f"line {n} of {path.name} holds a prompt under none of "
                                            f"{', '.join(AUTO_FIELDS)}; name its field with --field")
            raise InvalidParameterError("field", field, f"line {n} of {path.name} holds no prompt string or turns list under it")
        prompts.append(BenchPrompt(str(row.get("category", DEFAULT_CATEGORY)), value))
    if not prompts:
        raise SpecserveError(f"workload {path} holds no prompts")
    return prompts


def select(prompts: list[BenchPrompt], selection: Selection) -> list[BenchPrompt]:
    """Filter by category, keep the first `per_category` of each, then the first `limit` overall."""
    if selection.categories is not None:
        available = sorted({p.category for p in prompts})
        unknown = [c for c in selection.categories if c not in available]
        if unknown:
            raise InvalidParameterError("categories", ",".join(unknown), f"unknown; available: {','.join(available)}")
        prompts = [p for p in prompts if p.category in selection.categories]
    if selection.per_category is not None:
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= selection.per_category:
                kept.append(p)
        prompts = kept
    if selection.limit is not None:
        prompts = prompts[:selection.limit]
    return prompts
