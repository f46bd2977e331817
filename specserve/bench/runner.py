"""Configurations measured side by side on the same prompts, and the figures they produce."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from specserve.outputs import SpecStats
from specserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class Config:
    """One configuration: one line of the report."""

    method: str  # "none", "ngram", "draft_model", or a peer's: "transformers", "llama.cpp:prompt_lookup", ...
    num_speculative_tokens: int | str | None = None  # k, "auto", or None (plain, peers)
    draft: str | None = None  # the draft model's path, for methods that use one
    variant: str = ""  # other knobs that set this configuration apart, as "name=value ..."

    @property
    def label(self) -> str:
        name = self.method if self.draft is None else f"{self.method}({Path(self.draft).name})"
        if self.num_speculative_tokens is not None:
            name += f" k={self.num_speculative_tokens}"
        return f"{name} {self.variant}" if self.variant else name


@dataclass(slots=True)
class Sample:
    """One prompt run by one configuration."""

    token_ids: list[int]
    seconds: float  # wall clock of the whole request, prefill included
    first_token_seconds: float  # wall clock until the first generated token (prefill)
    spec: SpecStats | None = None  # None where a configuration has no acceptance figures
    num_prompt_tokens: int = 0  # the prompt's tokens, which the first token's wait prefilled


class Runner(Protocol):
    config: Config

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Sample: ...


class SpecserveRunner:
    """specserve itself, plain (spec_config None) or speculative; every one shares the loaded target."""

    def __init__(self, config: Config, llm):
        self.config, self.llm = config, llm

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        t = time.perf_counter()
        out = self.llm.generate([prompt_ids], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t
        spec = out.spec if self.llm.spec_config is not None else None
        return Sample(out.outputs[0].token_ids, seconds, out.metrics.first_token_time - t, spec, len(prompt_ids))


@dataclass(slots=True)
class Figures:
    num_prompts: int
    num_tokens: int
    tokens_per_s: float  # generated tokens over request time, prefill included
    decode_tokens_per_s: float  # tokens after the first over the time after the first
    prefill_tokens_per_s: float  # prompt tokens over the time to the first token
    speedup: float | None  # tokens_per_s over plain specserve's on the same prompts
    acceptance_rate: float | None
    mean_accepted_length: float | None  # tokens emitted per target pass (tau)
    acceptance_by_position: list[float] | None
    identical_to_baseline: float | None  # fraction of prompts whose tokens equal plain's; greedy only
    drafts_per_pass: float | None = None  # drafts verified per target pass (adaptive k: what was chosen and found)
    # Milliseconds per target pass (a step of one request): drafting (the proposer), and the
    # target's pass with verification. Plain decoding's pass is 1000 / decode_tokens_per_s.
    draft_ms_per_pass: float | None = None
    target_ms_per_pass: float | None = None

    def as_dict(self) -> dict:
        r = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {"num_prompts": self.num_prompts, "num_tokens": self.num_tokens, "tokens_per_s": r(self.tokens_per_s),
                "decode_tokens_per_s": r(self.decode_tokens_per_s),
                "prefill_tokens_per_s": r(self.prefill_tokens_per_s), "speedup": r(self.speedup),
                "acceptance_rate": r(self.acceptance_rate), "mean_accepted_length": r(self.mean_accepted_length),
                "acceptance_by_position": None if self.acceptance_by_position is None
                else [r(a) for a in self.acceptance_by_position],
                "identical_to_baseline": r(self.identical_to_baseline), "drafts_per_pass": r(self.drafts_per_pass),
                "draft_ms_per_pass": r(self.draft_ms_per_pass), "target_ms_per_pass": r(self.target_ms_per_pass)}


def rate(count: float, seconds: float) -> float:
    """Per second, 0 for an empty interval."""
    return count / seconds if seconds > 0 else 0.0


def figures(samples: Sequence[Sample], baseline: Sequence[Sample], greedy: bool) -> Figures:
    """Tokens/s is total tokens over total request time, so long answers weigh more, as they do
    for a user waiting on them. Identity compares prompt by prompt with plain decoding."""
    tokens = sum(len(s.token_ids) for s in samples)
    tps = rate(tokens, sum(s.seconds for s in samples))
    base_tps = rate(sum(len(s.token_ids) for s in baseline), sum(s.seconds for s in baseline))
    decode_tps = rate(sum(max(0, len(s.token_ids) - 1) for s in samples),
                       sum(s.seconds - s.first_token_seconds for s in samples))
    identical = sum(a.token_ids == b.token_ids for a, b in zip(samples, baseline)) / len(samples) if greedy else None
    spec = SpecStats.total(s.spec for s in samples) if all(s.spec is not None for s in samples) else None
    return Figures(
        num_prompts=len(samples),
        num_tokens=tokens,
        tokens_per_s=tps,
        decode_tokens_per_s=decode_tps,
        prefill_tokens_per_s=rate(sum(s.num_prompt_tokens for s in samples), sum(s.first_token_seconds for s in samples)),
        speedup=tps / base_tps if base_tps > 0 else None,
        acceptance_rate=None if spec is None else spec.acceptance_rate,
        mean_accepted_length=None if spec is None else spec.mean_accepted_length,
        acceptance_by_position=None if spec is None else spec.acceptance_by_position,
        identical_to_baseline=identical,
        drafts_per_pass=None if spec is None else rate(spec.num_drafted, spec.num_target_passes),
        draft_ms_per_pass=None if spec is None else 1e3 * rate(spec.proposer_time_s, spec.num_target_passes),
        target_ms_per_pass=None if spec is None else 1e3 * rate(spec.target_time_s, spec.num_target_passes),
    )


@dataclass(slots=True)
class Report:
    config: Config
    temperature: float
    overall: Figures
    per_category: dict[str, Figures]
    per_pass: dict[str, Figures] = field(default_factory=dict)  # bench --repeat: "pass 1", "pass 2", ...
    # A proposer's own timing (Eagle3Proposer.times: ms per catch-up pass and per growth depth),
    # and that depth's cost over plain decoding's one-token pass in the same run.
    drafting: dict | None = None

    def as_dict(self) -> dict:
        out = {"method": self.config.method, "label": self.config.label, "draft": self.config.draft,
               "num_speculative_tokens": self.config.num_speculative_tokens, "temperature": self.temperature,
               **self.overall.as_dict(), "per_category": {c: f.as_dict() for c, f in self.per_category.items()}}
        if self.per_pass:
            out["per_pass"] = {p: f.as_dict() for p, f in self.per_pass.items()}
        if self.drafting:
            out["drafting"] = self.drafting
        return out


def report(config: Config, samples: list[Sample], baseline: list[Sample], categories: list[str],
           temperature: float, passes: list[str] | None = None) -> Report:
    """`categories[i]` (and `passes[i]`, when the prompts were asked more than once) is prompt
    i's; `samples` and `baseline` are aligned with them."""
    greedy = temperature == 0

    def by(groups: list[str]) -> dict[str, Figures]:
        out = {}
        for g in dict.fromkeys(groups):
            idx = [i for i, c in enumerate(groups) if c == g]
            out[g] = figures([samples[i] for i in idx], [baseline[i] for i in idx], greedy)
        return out

    return Report(config, temperature, figures(samples, baseline, greedy), by(categories), by(passes) if passes else {})


def drafting_figures(runner: Runner, baseline: Figures) -> dict | None:
    """The proposer's own timing where it keeps one (`times.as_dict()`), with one growth depth
    over plain decoding's one-token pass (1000 / its decode tokens/s) of the same run."""
    llm = getattr(runner, "llm", None)
    times = getattr(getattr(getattr(llm, "engine", None), "proposer", None), "times", None)
    if times is None:
        return None
    out = times.as_dict()
    plain_ms = 1e3 / baseline.decode_tokens_per_s if baseline.decode_tokens_per_s else None
    out["plain_pass_ms"] = None if plain_ms is None else round(plain_ms, 4)
    out["depth_over_plain_pass"] = (round(out["depth_ms"] / plain_ms, 4)
                                    if plain_ms and out.get("depth_ms") is not None else None)
    return out


def measure(runners: Sequence[Runner], prompts: Sequence[list[int]], params_for: Callable[[int], SamplingParams],
            warmup: SamplingParams, progress: Callable[[], None]) -> list[list[Sample]]:
    """Run every prompt through every runner; -> samples[runner][prompt].

    Each prompt goes through every configuration before the next prompt, so drift in the
    machine's speed (other tenants, clocks) hits all configurations alike; the order rotates
    from prompt to prompt so that no configuration always runs first after another one.
    A short generation per runner first pays for lazy initialisation outside the figures.
    """
    for r in runners:
        r.run(prompts[0], warmup)
    samples: list[list[Sample | None]] = [[None] * len(prompts) for _ in runners]
    for i, ids in enumerate(prompts):
        params = params_for(i)
        for j in range(len(runners)):
            r = (i + j) % len(runners)
            samples[r][i] = runners[r].run(ids, params)
            progress()
    return samples
