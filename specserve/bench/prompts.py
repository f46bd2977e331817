"""Benchmark workloads: Spec-Bench (shipped with the package) or any JSONL file of prompts."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from specserve.errors import InvalidParameterError, SpecserveError


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    category: str
    text: str  # the first user turn; rendered through the model's chat template when run


def spec_bench_path() -> Path:
    return Path(str(resources.files("specserve") / "data" / "spec_bench" / "question.jsonl"))


def load_workload(workload: str, field: str = "turns") -> list[BenchPrompt]:
    """`spec_bench`, or a JSONL file whose `field` holds a prompt string or a list of turns."""
    path = spec_bench_path() if workload == "spec_bench" else Path(workload)
    if not path.is_file():
        raise SpecserveError(f"workload {workload!r} is neither 'spec_bench' nor an existing JSONL file")
    prompts = []
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise SpecserveError(f"{path}:{n} is not valid JSON: {e}") from None
        value = row.get(field) if isinstance(row, dict) else None
        if isinstance(value, list) and value and isinstance(value[0], str):
            value = value[0]
        if not isinstance(value, str) or not value:
            raise InvalidParameterError("field", field, f"line {n} of {path.name} has no prompt string or turns list under it")
        prompts.append(BenchPrompt(str(row.get("category", "all")), value))
    if not prompts:
        raise SpecserveError(f"workload {path} holds no prompts")
    return prompts


def select(prompts: list[BenchPrompt], categories: list[str] | None = None, per_category: int | None = None,
           limit: int | None = None) -> list[BenchPrompt]:
    """Filter by category, keep the first `per_category` of each, then the first `limit` overall."""
    available = sorted({p.category for p in prompts})
    if categories:
        unknown = sorted(set(categories) - set(available))
        if unknown:
            raise InvalidParameterError("categories", ",".join(unknown), f"unknown; available: {','.join(available)}")
        prompts = [p for p in prompts if p.category in categories]
    if per_category is not None:
        if per_category < 1:
            raise InvalidParameterError("per_category", per_category, "must be >= 1")
        seen: dict[str, int] = {}
        kept = []
        for p in prompts:
            seen[p.category] = seen.get(p.category, 0) + 1
            if seen[p.category] <= per_category:
                kept.append(p)
        prompts = kept
    if limit is not None:
        if limit < 1:
            raise InvalidParameterError("limit", limit, "must be >= 1")
        prompts = prompts[:limit]
    return prompts
