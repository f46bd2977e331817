"""Prometheus figures of the server (prometheus-client, one registry per app).

Counters and histograms are updated once per engine request, by the serving layer when it sees
the request's last output (serving.py), on the event loop; generated tokens are counted as they
stream. Gauges read the engine's last
published snapshot at scrape time, so a scrape never waits for a step or reads the scheduler
while it changes.
"""

from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specserve.engine.async_engine import AsyncEngine
from specserve.outputs import TOKEN_SOURCES, RequestOutput, SpecStats

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str):
        self.registry = r = CollectorRegistry()
        label = {"model_name": model_name}
        self.requests = Counter("specserve_requests", "Engine requests ended, by finish reason (stop, length, abort, error)",
                                ["model_name", "finish_reason"], registry=r)
        self.prompt_tokens = Counter("specserve_prompt_tokens", "Prompt tokens of ended requests", ["model_name"], registry=r).labels(**label)
        self.generation_tokens = Counter("specserve_generation_tokens", "Tokens generated", ["model_name"], registry=r).labels(**label)
        by_source = Counter("specserve_generation_tokens_by_source", "Tokens generated, by how they came: plain (a "
                            "step without drafts), draft (accepted), corrected (the target's token for a rejected "
                            "draft), bonus (after drafts accepted to the end)", ["model_name", "source"], registry=r)
        self.by_source = {src: by_source.labels(**label, source=src) for src in TOKEN_SOURCES}
        self.drafted = Counter("specserve_spec_drafted_tokens", "Draft tokens proposed for verification",
                               ["model_name"], registry=r).labels(**label)
        self.accepted = Counter("specserve_spec_accepted_tokens", "Draft tokens accepted by the verifier",
                                ["model_name"], registry=r).labels(**label)
        self.passes = Counter("specserve_spec_target_passes", "Target passes that produced tokens after the prefill",
                              ["model_name"], registry=r).labels(**label)
        self.ttft = Histogram("specserve_time_to_first_token_seconds", "Arrival to first token",
                              ["model_name"], buckets=_TTFT_BUCKETS, registry=r).labels(**label)
        self.tpot = Histogram("specserve_time_per_output_token_seconds", "Mean time per token after the first, per request",
                              ["model_name"], buckets=_TPOT_BUCKETS, registry=r).labels(**label)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds", "Arrival to the last token",
                             ["model_name"], buckets=_E2E_BUCKETS, registry=r).labels(**label)
        self._spec = SpecStats()  # running totals for the two ratio gauges
        self._model_name = model_name
        self._open = 0  # engine requests submitted whose last output the server has not yet seen
        self._gauges(engine, label)

    def _gauges(self, engine: AsyncEngine, label: dict) -> None:
        def gauge(name: str, doc: str, read) -> None:
            Gauge(name, doc, ["model_name"], registry=self.registry).labels(**label).set_function(read)

        snap = lambda: engine.snapshot  # noqa: E731 - the snapshot object is replaced after each step
        gauge("specserve_num_requests_running", "Requests in the running batch", lambda: snap().num_running)
        gauge("specserve_num_requests_waiting", "Requests waiting to be scheduled", lambda: snap().num_waiting)
        gauge("specserve_num_requests_in_engine", "Requests the engine holds (running, waiting, or ending)",
              lambda: snap().num_requests)
        gauge("specserve_kv_blocks_total", "KV cache blocks in the pool", lambda: snap().num_kv_blocks)
        gauge("specserve_kv_blocks_used", "KV cache blocks referenced by requests (cached free blocks excluded)",
              lambda: snap().num_kv_blocks_used)
        gauge("specserve_kv_cache_usage_ratio", "Fraction of KV cache blocks in use",
              lambda: snap().num_kv_blocks_used / max(snap().num_kv_blocks, 1))
        gauge("specserve_prefix_cache_hit_rate", "Prompt blocks found in the prefix cache / blocks looked up",
              lambda: snap().prefix_cache_hit_blocks / max(snap().prefix_cache_queried_blocks, 1))
        # The gauges an inference gateway's endpoint picker reads (the Gateway API Inference
        # Extension's model-server protocol, llm-d), under vLLM's names, which it reads by
        # default: queue, batch, KV cache use as a fraction (0..1), and the cache's shape.
        gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (as specserve_num_requests_waiting)",
              lambda: snap().num_waiting)
        gauge("vllm:num_requests_running", "Requests in the running batch (as specserve_num_requests_running)",
              lambda: snap().num_running)
        gauge("vllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use, 0..1 (as specserve_kv_cache_usage_ratio)",
              lambda: snap().num_kv_blocks_used / max(snap().num_kv_blocks, 1))
        Gauge("vllm:cache_config_info", "The KV cache's shape, in the labels (value 1)",
              ["model_name", "block_size", "num_gpu_blocks"], registry=self.registry).labels(
            **label, block_size=str(snap().block_size), num_gpu_blocks=str(snap().num_kv_blocks)).set(1)
        gauge("specserve_num_preemptions", "Requests preempted (recomputed) so far", lambda: snap().num_preemptions)
        gauge("specserve_spec_acceptance_rate", "Accepted / drafted tokens, all requests so far",
              lambda: self._spec.acceptance_rate)
        gauge("specserve_spec_mean_accepted_length", "Tokens emitted per target pass (1.0 without speculation)",
              lambda: self._spec.mean_accepted_length)
        gauge("specserve_spec_mean_draft_depth", "Draft depth adaptive speculation chose, mean over request-steps "
              "(0 without adaptive speculation)", lambda: snap().mean_draft_depth)
        if depths := len(snap().draft_depth_counts):
            chosen = Gauge("specserve_spec_draft_depth_chosen", "Request-steps by the draft depth adaptive speculation "
                           "chose (0: a plain step)", ["model_name", "depth"], registry=self.registry)
            for d in range(depths):
                chosen.labels(**label, depth=str(d)).set_function(lambda d=d: snap().draft_depth_counts[d])
        gauge("specserve_num_requests_open", "Engine requests submitted whose end the server has not yet counted",
              lambda: self._open)

    # Every engine request the server submits is counted once: `submitted`, then either `ended`
    # with its last output or `failed` when its stream raised instead.

    def submitted(self) -> None:
        self._open += 1

    def failed(self) -> None:
        """A request the engine refused after it was submitted, or dropped when it stopped."""
        self._open -= 1
        self.requests.labels(model_name=self._model_name, finish_reason="error").inc()

    def generated(self, out: RequestOutput, counted: int) -> int:
        """Count the tokens of an output not counted yet (the first `counted` were), as they
        stream, so that rates read live rather than jumping when a request ends. Returns the
        tokens counted so far."""
        sources = out.outputs[0].token_sources
        if len(sources) > counted:
            self.generation_tokens.inc(len(sources) - counted)
            for src, n in Tally(sources[counted:]).items():
                self.by_source[src].inc(n)
        return len(sources)

    def ended(self, out: RequestOutput) -> None:
        """The last output of an engine request (finished, stopped, aborted or failed alone)."""
        self._open -= 1
        m, s = out.metrics, out.spec
        self.requests.labels(model_name=self._model_name, finish_reason=out.outputs[0].finish_reason or "abort").inc()
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.drafted.inc(s.num_drafted)
        self.accepted.inc(s.num_accepted)
        self.passes.inc(s.num_target_passes)
        self._spec.merge(s)
        if m.time_to_first_token is not None:
            self.ttft.observe(m.time_to_first_token)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            if m.first_token_time is not None and m.num_generated_tokens > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (m.num_generated_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
