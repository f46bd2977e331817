"""Throughput mode of `specserve bench`: the whole prompt set through one engine with c requests
in flight, a new one submitted as soon as one finishes, and the serving figures that gives."""

from __future__ import annotations

import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from specserve.bench.runner import Config, rate
from specserve.outputs import SpecStats
from specserve.sampling_params import SamplingParams


@dataclass(slots=True)
class Completion:
    """One finished request of a concurrent run."""

    token_ids: list[int]
    ttft_s: float  # submission to first generated token (queueing for a KV slot included)
    tpot_s: float | None  # (finish - first token) / (generated - 1); None under 2 tokens
    decode_s: float  # finish - first token
    spec: SpecStats | None  # None for plain decoding


@dataclass(slots=True)
class ConcurrentRun:
    """The whole prompt set through one engine at one concurrency."""

    config: Config
    concurrency: int
    completions: list[Completion]  # aligned with the prompts
    wall_s: float  # first submission to last finish
    prefix_cache_hit_rate: float  # over this run's lookups only (the warm-up's are subtracted)
    num_preemptions: int
    # Adaptive speculation: draft depth the engine chose per request and step, averaged over
    # this run (plain steps count as 0); None where the depth is fixed.
    mean_chosen_depth: float | None = None


def run_concurrent(engine, config: Config, prompts: Sequence[list[int]], params_for: Callable[[int], SamplingParams],
                   concurrency: int, progress: Callable[[], None], tag: str = "") -> ConcurrentRun:
    """Keep `concurrency` requests in the engine until every prompt is done; -> figures per prompt.

    Prompt i is request `{tag}{i}`, submitted in order; TTFT counts from its submission, which
    is when a slot freed (a closed loop: c users, each sending the next prompt on an answer)."""
    speculative = config.method != "none"
    before = engine.stats()
    pending = deque(range(len(prompts)))
    done: list[Completion | None] = [None] * len(prompts)
    in_flight: set[str] = set()

    def submit() -> None:
        i = pending.popleft()
        rid = f"{tag}{i}"
        engine.add_request(rid, prompts[i], params_for(i))
        in_flight.add(rid)

    t0 = time.perf_counter()
    try:
        while pending and len(in_flight) < concurrency:
            submit()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    continue
                m = out.metrics
                n = len(out.outputs[0].token_ids)
                decode = m.finished_time - m.first_token_time
                done[int(out.request_id[len(tag):])] = Completion(
                    list(out.outputs[0].token_ids), m.first_token_time - m.arrival_time,
                    decode / (n - 1) if n >= 2 else None, decode, out.spec if speculative else None)
                in_flight.discard(out.request_id)
                engine.pop_finished(out.request_id)
                progress()
                if pending:
                    submit()
        wall = time.perf_counter() - t0
    finally:
        for rid in in_flight:
            engine.abort_request(rid)
            engine.pop_finished(rid)
    after = engine.stats()
    queried = after.prefix_cache_queried_blocks - before.prefix_cache_queried_blocks
    hit_rate = (after.prefix_cache_hit_blocks - before.prefix_cache_hit_blocks) / queried if queried else 0.0
    chosen = [a - b for a, b in zip(after.draft_depth_counts, before.draft_depth_counts)]
    depth = sum(d * n for d, n in enumerate(chosen)) / sum(chosen) if sum(chosen) else None
    return ConcurrentRun(config, concurrency, done, wall, hit_rate, after.num_preemptions - before.num_preemptions, depth)


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass(slots=True)
class ThroughputFigures:
    config: Config
    temperature: float
    concurrency: int
    num_prompts: int
    num_tokens: int
    wall_s: float
    tokens_per_s: float  # all generated tokens over the run's wall time
    requests_per_s: float
    decode_tokens_per_s: float  # per-request decode speed: tokens after the first over the time after
    speedup: float | None  # tokens_per_s over plain's at the same concurrency
    ttft_ms_p50: float | None
    ttft_ms_p99: float | None
    tpot_ms_p50: float | None  # over requests with >= 2 tokens
    tpot_ms_p99: float | None
    acceptance_rate: float | None
    mean_accepted_length: float | None
    acceptance_by_position: list[float] | None
    identical_to_baseline: float | None  # fraction equal to plain's at the same concurrency; greedy only
    prefix_cache_hit_rate: float
    num_preemptions: int
    mean_chosen_depth: float | None = None  # adaptive speculation's average draft depth per request-step
    drafts_per_pass: float | None = None  # drafts verified per target pass (what the proposer found)
    # With several rounds (combine_rounds): how many, and the least and greatest of their speedups
    # (each against plain in the same round); the figures above are the rounds' medians.
    rounds: int = 1
    speedup_min: float | None = None
    speedup_max: float | None = None

    def as_dict(self) -> dict:
        r = lambda x: None if x is None else round(x, 4)  # noqa: E731
        c = self.config
        return {"method": c.method, "label": c.label, "draft": c.draft, "num_speculative_tokens": c.num_speculative_tokens,
                "temperature": self.temperature, "concurrency": self.concurrency, "num_prompts": self.num_prompts,
                "num_tokens": self.num_tokens, "wall_s": r(self.wall_s), "tokens_per_s": r(self.tokens_per_s),
                "requests_per_s": r(self.requests_per_s), "decode_tokens_per_s": r(self.decode_tokens_per_s),
                "speedup": r(self.speedup), "ttft_ms_p50": r(self.ttft_ms_p50), "ttft_ms_p99": r(self.ttft_ms_p99),
                "tpot_ms_p50": r(self.tpot_ms_p50), "tpot_ms_p99": r(self.tpot_ms_p99),
                "acceptance_rate": r(self.acceptance_rate), "mean_accepted_length": r(self.mean_accepted_length),
                "acceptance_by_position": None if self.acceptance_by_position is None
                else [r(a) for a in self.acceptance_by_position],
                "identical_to_baseline": r(self.identical_to_baseline),
                "prefix_cache_hit_rate": r(self.prefix_cache_hit_rate), "num_preemptions": self.num_preemptions,
                "mean_chosen_depth": r(self.mean_chosen_depth), "drafts_per_pass": r(self.drafts_per_pass),
                "rounds": self.rounds, "speedup_min": r(self.speedup_min), "speedup_max": r(self.speedup_max)}


def combine_rounds(rounds: Sequence[ThroughputFigures]) -> ThroughputFigures:
    """One configuration at one concurrency measured in several rounds (each against plain in its
    own round) -> one set of figures: the rounds' medians (tok/s, speedup, latencies, acceptance),
    the least identical fraction, and the speedups' range. One round is returned as it is."""
    if len(rounds) == 1:
        return rounds[0]
    med = lambda xs: None if any(x is None for x in xs) else statistics.median(xs)  # noqa: E731
    first = rounds[0]
    speedups = [f.speedup for f in rounds]
    by_position = None
    if all(f.acceptance_by_position is not None for f in rounds):
        n = min(len(f.acceptance_by_position) for f in rounds)
        by_position = [statistics.median(f.acceptance_by_position[j] for f in rounds) for j in range(n)]
    return replace(
        first, num_tokens=sum(f.num_tokens for f in rounds), wall_s=sum(f.wall_s for f in rounds),
        tokens_per_s=med([f.tokens_per_s for f in rounds]), requests_per_s=med([f.requests_per_s for f in rounds]),
        decode_tokens_per_s=med([f.decode_tokens_per_s for f in rounds]), speedup=med(speedups),
        ttft_ms_p50=med([f.ttft_ms_p50 for f in rounds]), ttft_ms_p99=med([f.ttft_ms_p99 for f in rounds]),
        tpot_ms_p50=med([f.tpot_ms_p50 for f in rounds]), tpot_ms_p99=med([f.tpot_ms_p99 for f in rounds]),
        acceptance_rate=med([f.acceptance_rate for f in rounds]),
        mean_accepted_length=med([f.mean_accepted_length for f in rounds]), acceptance_by_position=by_position,
        identical_to_baseline=None if first.identical_to_baseline is None
        else min(f.identical_to_baseline for f in rounds),
        prefix_cache_hit_rate=statistics.median(f.prefix_cache_hit_rate for f in rounds),
        num_preemptions=sum(f.num_preemptions for f in rounds),
        mean_chosen_depth=med([f.mean_chosen_depth for f in rounds]), drafts_per_pass=med([f.drafts_per_pass for f in rounds]),
        rounds=len(rounds), speedup_min=None if None in speedups else min(speedups),
        speedup_max=None if None in speedups else max(speedups))


def throughput_figures(run: ConcurrentRun, baseline: ConcurrentRun, temperature: float) -> ThroughputFigures:
    """`baseline` is plain decoding at the same concurrency on the same prompts."""
    done, base = run.completions, baseline.completions
    tokens = sum(len(c.token_ids) for c in done)
    tps = rate(tokens, run.wall_s)
    base_tps = rate(sum(len(c.token_ids) for c in base), baseline.wall_s)
    ttft = [c.ttft_s * 1e3 for c in done]
    tpot = [c.tpot_s * 1e3 for c in done if c.tpot_s is not None]
    spec = SpecStats.total(c.spec for c in done) if all(c.spec is not None for c in done) else None
    return ThroughputFigures(
        config=run.config, temperature=temperature, concurrency=run.concurrency, num_prompts=len(done),
        num_tokens=tokens, wall_s=run.wall_s, tokens_per_s=tps, requests_per_s=rate(len(done), run.wall_s),
        decode_tokens_per_s=rate(sum(max(0, len(c.token_ids) - 1) for c in done), sum(c.decode_s for c in done)),
        speedup=tps / base_tps if base_tps > 0 else None,
        ttft_ms_p50=percentile(ttft, 50), ttft_ms_p99=percentile(ttft, 99),
        tpot_ms_p50=percentile(tpot, 50), tpot_ms_p99=percentile(tpot, 99),
        acceptance_rate=None if spec is None else spec.acceptance_rate,
        mean_accepted_length=None if spec is None else spec.mean_accepted_length,
        acceptance_by_position=None if spec is None else spec.acceptance_by_position,
        identical_to_baseline=sum(a.token_ids == b.token_ids for a, b in zip(done, base)) / len(done)
        if temperature == 0 else None,
        prefix_cache_hit_rate=run.prefix_cache_hit_rate, num_preemptions=run.num_preemptions,
        mean_chosen_depth=run.mean_chosen_depth,
        drafts_per_pass=None if spec is None else rate(spec.num_drafted, spec.num_target_passes))


def measure_throughput(configs: Sequence[Config], build_engine: Callable[[Config, int], object],
                       prompts: Sequence[list[int]], concurrencies: Sequence[int],
                       params_for: Callable[[int], SamplingParams], warmup: SamplingParams,
                       progress: Callable[[str], None], rounds: int = 1) -> list[ConcurrentRun]:
    """Every configuration at every concurrency, each on a fresh engine (so the prefix cache
    holds no answers of an earlier run), `rounds` times over; -> runs ordered by round, then
    concurrency, then `configs`.

    `configs[0]` is plain decoding. At each concurrency and round the configuration order
    rotates, so that no configuration always runs first (a shared machine's slow minutes fall on
    each in turn). Before measuring, each engine runs min(c, n) short requests on reversed
    prompts (their blocks hash apart from the real ones, so the warm-up leaves nothing in the
    prefix cache that the measured run could hit)."""
    runs: list[ConcurrentRun] = []
    for c in list(concurrencies) * rounds:
        found: dict[int, ConcurrentRun] = {}
        for j in range(len(configs)):
            idx = (len(runs) // len(configs) + j) % len(configs)  # one step on per concurrency and round
            config = configs[idx]
            engine = build_engine(config, c)
            warm = [list(reversed(p)) for p in prompts[:min(c, len(prompts))]]
            run_concurrent(engine, config, warm, lambda i: warmup, c, lambda: None, tag="warmup-")
            found[idx] = run_concurrent(engine, config, prompts, params_for, c, lambda: progress(f"{config.label} c={c}"))
            del engine  # its KV cache goes before the next engine allocates one
        runs += [found[i] for i in range(len(configs))]
    return runs


def run_throughput(loaded, configs: list[Config], specs: dict, prompts: list[list[int]], concurrency: list[int],
                   params_for, warmup, temperature: float, model_len: int,
                   max_num_batched_tokens: int | None = None, rounds: int = 1) -> list[ThroughputFigures]:
    """Every configuration at every concurrency, each on its own engine with room for c requests,
    `rounds` times over (combine_rounds: medians, and each speedup against its own round's plain).

    `model_len` is the longest request's context, not the model's: the KV pools (the target's
    and a draft model's, as many blocks each) then hold c requests at once without preemption
    even at high concurrency. Requests still stop at max_tokens, as in latency mode,
    so outputs are the same."""
    from tqdm import tqdm

    from specserve.llm import LLM

    block_size = 16
    per_request = -(-model_len // block_size)

    def build_engine(config: Config, c: int):
        llm = LLM(loaded=loaded, speculative_config=specs.get(config), max_model_len=model_len, max_num_seqs=c,
                  block_size=block_size, num_kv_blocks=per_request * min(c, len(prompts)),
                  max_num_batched_tokens=max_num_batched_tokens)
        return llm.engine

    with tqdm(total=len(prompts) * len(configs) * len(concurrency) * rounds, desc="bench", unit="req",
              file=sys.stderr) as bar:
        def progress(label: str) -> None:
            bar.set_postfix_str(label, refresh=False)
            bar.update(1)
        runs = measure_throughput(configs, build_engine, prompts, concurrency, params_for, warmup, progress, rounds)
    per_round = len(configs) * len(concurrency)
    figures: dict[tuple[int, int], list[ThroughputFigures]] = {}
    for start in range(0, len(runs), per_round):
        block = runs[start:start + per_round]
        plain = {r.concurrency: r for r in block if r.config.method == "none"}
        for i, r in enumerate(block):
            figures.setdefault((i // len(configs), i % len(configs)), []).append(
                throughput_figures(r, plain[r.concurrency], temperature))
    return [combine_rounds(figures[key]) for key in sorted(figures)]
