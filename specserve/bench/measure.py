"""Configurations measured side by side on the same prompts, and the figures they produce."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from specserve.llm import LLM
from specserve.model.loader import LoadedModel
from specserve.sampling_params import SamplingParams


@dataclass(slots=True)
class Sample:
    """One prompt run by one configuration."""

    category: str
    token_ids: list[int]
    seconds: float  # wall clock of the whole request, prefill included
    first_token_seconds: float  # wall clock until the first generated token (prefill)
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0  # tokens from decode/verify passes
    passes: int = 0  # target decode/verify passes


class Runner(Protocol):
    label: str
    method: str
    num_speculative_tokens: int | None
    speculative: bool  # whether acceptance figures exist for it

    def run(self, category: str, prompt_ids: list[int], params: SamplingParams) -> Sample: ...


class SpecserveRunner:
    """specserve itself, plain (`method="none"`) or with a speculative config, sharing one loaded target."""

    def __init__(self, loaded: LoadedModel, method: str, k: int | None, spec_config: dict | None, max_model_len: int | None):
        self.method, self.num_speculative_tokens = method, k
        self.label = method if k is None else f"{method} k={k}"
        self.speculative = spec_config is not None
        self.llm = LLM(loaded=loaded, speculative_config=spec_config, max_model_len=max_model_len, max_num_seqs=1)

    def run(self, category: str, prompt_ids: list[int], params: SamplingParams) -> Sample:
        t = time.perf_counter()
        out = self.llm.generate([prompt_ids], params, use_tqdm=False)[0]
        seconds = time.perf_counter() - t
        s = out.spec
        return Sample(category, out.outputs[0].token_ids, seconds, out.metrics.first_token_time - t, s.num_drafted,
                      s.num_accepted, s.num_emitted, s.num_target_passes)


@dataclass(slots=True)
class Figures:
    tokens_per_s: float
    decode_tokens_per_s: float  # tokens after the first over the time after the first
    speedup: float | None
    acceptance_rate: float | None
    mean_accepted_length: float | None
    identical_to_baseline: float | None
    num_prompts: int
    num_tokens: int

    def as_dict(self) -> dict:
        r = lambda x: None if x is None else round(x, 4)  # noqa: E731
        return {"tokens_per_s": r(self.tokens_per_s), "decode_tokens_per_s": r(self.decode_tokens_per_s), "speedup": r(self.speedup), "acceptance_rate": r(self.acceptance_rate),
                "mean_accepted_length": r(self.mean_accepted_length), "identical_to_baseline": r(self.identical_to_baseline),
                "num_prompts": self.num_prompts, "num_tokens": self.num_tokens}


def figures(samples: list[Sample], baseline: list[Sample] | None, speculative: bool, greedy: bool) -> Figures:
    """Tokens/s is total generated tokens over total request time, so long answers weigh more,
    as they do for a user waiting on them. Speedup and identity compare prompt by prompt
    against plain specserve decoding of the same prompts."""
    tokens = sum(len(s.token_ids) for s in samples)
    seconds = sum(s.seconds for s in samples)
    tps = tokens / seconds if seconds > 0 else 0.0
    decode_seconds = sum(s.seconds - s.first_token_seconds for s in samples)
    decode_tps = sum(max(0, len(s.token_ids) - 1) for s in samples) / decode_seconds if decode_seconds > 0 else 0.0
    speedup = identical = None
    if baseline is not None:
        base = figures(baseline, None, False, greedy)
        speedup = tps / base.tokens_per_s if base.tokens_per_s > 0 else None
        if greedy:
            identical = sum(a.token_ids == b.token_ids for a, b in zip(samples, baseline)) / len(samples)
    drafted = sum(s.drafted for s in samples)
    passes = sum(s.passes for s in samples)
    return Figures(
        tokens_per_s=tps,
        decode_tokens_per_s=decode_tps,
        speedup=speedup,
        acceptance_rate=(sum(s.accepted for s in samples) / drafted if drafted else 0.0) if speculative else None,
        mean_accepted_length=(sum(s.emitted for s in samples) / passes if passes else 0.0) if speculative else None,
        identical_to_baseline=identical,
        num_prompts=len(samples),
        num_tokens=tokens,
    )


@dataclass(slots=True)
class Result:
    runner: Runner
    samples: list[Sample] = field(default_factory=list)

    def report(self, baseline: "Result", temperature: float) -> dict:
        greedy = temperature == 0
        overall = figures(self.samples, baseline.samples, self.runner.speculative, greedy)
        per_category = {}
        for cat in dict.fromkeys(s.category for s in self.samples):
            idx = [i for i, s in enumerate(self.samples) if s.category == cat]
            per_category[cat] = figures([self.samples[i] for i in idx], [baseline.samples[i] for i in idx],
                                        self.runner.speculative, greedy).as_dict()
        return {"method": self.runner.method, "label": self.runner.label,
                "num_speculative_tokens": self.runner.num_speculative_tokens, "temperature": temperature,
                **overall.as_dict(), "per_category": per_category}
