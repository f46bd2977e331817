"""Engine and speculative-decoding configuration, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from specserve.errors import InvalidParameterError
from specserve.spec.registry import BUILTIN_METHODS, PATH_METHODS, method_names, method_spec, owners

# Every built-in drafting method, by the name speculative_config's "method" takes, and those that
# need a path in its "model" (bench and tune: METHOD:PATH). The command-line choices (engine_args,
# bench, tune) are derived from these. Each method's own keys live in its module (spec/registry.py).
SPEC_METHODS = tuple(BUILTIN_METHODS)
# Beyond this a draft is almost never accepted in full and the verify pass stops being cheap.
MAX_SPECULATIVE_TOKENS = 32
ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")


class _AutoMax(dict):
    """num_speculative_tokens="auto" (the default): the engine chooses 0..this many drafts per
    request and step from its measured pass cost and each request's acceptance (engine/adaptive.py),
    by method with its default options: each method's MethodSpec.auto_max_k, read on demand so that
    naming one method imports only its module."""

    def __missing__(self, name: str) -> int:
        spec = method_spec(name)
        return spec.auto_cap(spec.options_cls())


AUTO_MAX_SPECULATIVE_TOKENS: dict[str, int] = _AutoMax()
# The keys every method takes; the rest of a flat speculative_config belongs to the method's options.
SHARED_KEYS = ("method", "num_speculative_tokens", "max_speculative_tokens", "model", "acceptance_method",
               "posterior_threshold", "posterior_alpha", "disable_by_batch_size")


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """What `speculative_config={...}` accepts, with vLLM's key names: the keys every method takes
    here, the method's own in `options` (its module's dataclass; `from_dict` routes a flat dict's
    keys there, and a method's key reads as an attribute here too: `spec.prompt_lookup_max`)."""

    method: str
    # An integer k: every request drafts up to k tokens each step. "auto": the engine chooses
    # 0..max_speculative_tokens per request and step, to maximise committed tokens per second.
    num_speculative_tokens: int | str = "auto"
    max_speculative_tokens: int | None = None  # "auto"'s cap; None: the method's (MethodSpec.auto_max_k)
    model: str | None = None  # the draft model for "draft_model"; the drafter folder for "eagle" and "medusa"
    # "typical_acceptance_sampler": Medusa's typical acceptance for sampled requests, LOSSY (the
    # output no longer has exactly the target's distribution; greedy output is unchanged).
    # Off by default: "rejection_sampler" keeps every output exactly the target's.
    acceptance_method: str = "rejection_sampler"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    # vLLM's: no drafting in a step whose batch holds at least this many running requests (None:
    # never off). The planner already stops drafts that do not pay; this is a hard bound for
    # loads where a drafter's own upkeep costs (EAGLE-3's catch-ups and probes: ~1 ms a drafting
    # step at 16 in flight on the 2-core CPU, docs/figures.md). The output is the same either way.
    disable_by_batch_size: int | None = None
    # The method's own options (its MethodSpec.options_cls); None: its defaults.
    options: Any = None

    def __post_init__(self) -> None:
        if self.method not in method_names():
            raise InvalidParameterError("speculative_config.method", self.method,
                                        f"must be one of {', '.join(method_names())}")
        spec = method_spec(self.method)
        if self.options is None:
            object.__setattr__(self, "options", spec.options_cls())
        elif not isinstance(self.options, spec.options_cls):
            raise InvalidParameterError("speculative_config.options", self.options,
                                        f"must be a {spec.options_cls.__name__} for method {self.method!r}")
        for name in ("num_speculative_tokens", "max_speculative_tokens"):
            k = getattr(self, name)
            if (name == "num_speculative_tokens" and k == "auto") or (name == "max_speculative_tokens" and k is None):
                continue
            if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
                also = "'auto'" if name == "num_speculative_tokens" else "None"
                raise InvalidParameterError(name, k, f"must be an integer in [1, {MAX_SPECULATIVE_TOKENS}] or {also}")
        if self.max_speculative_tokens is not None and not self.adaptive:
            raise InvalidParameterError("max_speculative_tokens", self.max_speculative_tokens,
                                        "applies with num_speculative_tokens='auto' only (a fixed k is its own cap)")
        if spec.needs_model and not self.model:
            raise InvalidParameterError("speculative_config.model", self.model, spec.needs_model)
        n = self.disable_by_batch_size
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 2):
            raise InvalidParameterError("disable_by_batch_size", n, "must be an integer >= 2 (running requests at which "
                                        "drafting stops), or None")
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            raise InvalidParameterError("acceptance_method", self.acceptance_method, f"must be one of {', '.join(ACCEPTANCE_METHODS)}")
        for name in ("posterior_threshold", "posterior_alpha"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise InvalidParameterError(name, v, "must be a number in (0, 1]")

    def __getattr__(self, name: str) -> Any:
        # Only reached for names that are not fields: the method's own keys, read from its options.
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(object.__getattribute__(self, "options"), name)
        except AttributeError:
            raise AttributeError(f"{type(self).__name__} for method {self.method!r} has no attribute {name!r}") from None

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def k(self) -> int:
        """The fixed k, or "auto"'s cap."""
        if not self.adaptive:
            return self.num_speculative_tokens
        return self.max_speculative_tokens or method_spec(self.method).auto_cap(self.options)

    @property
    def lossy(self) -> bool:
        return self.acceptance_method == "typical_acceptance_sampler"

    @classmethod
    def from_dict(cls, d: dict | "SpeculativeConfig" | None) -> "SpeculativeConfig | None":
        """A flat dict (vLLM's shape: {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 4}) with the method's own keys routed to its options. A key of another
        method is refused, naming the method it applies to, unless it has that method's default."""
        if d is None or isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise InvalidParameterError("speculative_config", d, "must be a dict such as {'method': 'ngram', 'num_speculative_tokens': 'auto'}")
        if "method" not in d:
            raise InvalidParameterError("speculative_config.method", None, f"is required; one of {', '.join(method_names())}")
        method = d["method"]
        if method not in method_names():
            raise InvalidParameterError("speculative_config.method", method, f"must be one of {', '.join(method_names())}")
        spec = method_spec(method)
        own = {f.name for f in fields(spec.options_cls)}
        shared = {k: v for k, v in d.items() if k in SHARED_KEYS}
        options = {k: v for k, v in d.items() if k in own}
        for key in sorted(set(d) - set(shared) - own):
            applies = owners(key)
            if not applies:
                allowed = sorted({*SHARED_KEYS, *(f.name for m in method_names()
                                                  for f in fields(method_spec(m).options_cls))})
                raise InvalidParameterError("speculative_config", sorted(set(d) - set(allowed)),
                                            f"unknown keys; allowed: {', '.join(allowed)}")
            if all(method_spec(m).option_defaults().get(key, object()) == d[key] for m in applies):
                continue  # another method's default: it changes nothing
            names = " or ".join(repr(m) for m in applies)
            raise InvalidParameterError(key, d[key], f"applies to method {names} only (method is {method!r})")
        return cls(**shared, options=spec.options_cls(**options))


# EngineConfig.max_step_ms's default (its comment gives the measurement).
DEFAULT_MAX_STEP_MS = 100.0


@dataclass(frozen=True, slots=True)
class EngineConfig:
    max_model_len: int  # tokens of context per request (prompt + output)
    max_num_seqs: int  # requests running together
    seed: int = 0
    block_size: int = 16  # tokens per KV cache block
    # KV pool size: `num_kv_blocks` blocks, or as many as `kv_cache_memory` holds (bytes when
    # > 1, else a fraction of the device's available memory, e.g. 0.5); neither given: enough
    # for max_num_seqs requests at full context, within half of the available memory
    # (kv/budget.py). A size that does not fit the available memory is refused.
    num_kv_blocks: int | None = None
    kv_cache_memory: int | float | None = None
    # Tokens computed per step across requests (prompt chunks + decode tokens + drafts): the
    # bound on a step's latency that chunked prefill keeps while long prompts come in.
    max_num_batched_tokens: int = 2048
    # While any request decodes, a step's prompt chunks are cut so that the step's predicted
    # time (the engine's pass cost model) stays within this many milliseconds; 0: only
    # max_num_batched_tokens bounds them. Measured on the 2-core CPU with the embedded model,
    # one stream decoding while a 4,000-token prompt arrives: under the 2048-token budget alone
    # one step held the stream 14.6 s on a quiet machine (the second chunk's attention over its
    # 2,048-token prefix). At 100 ms, on the shared machine (2-5x slower than quiet, so noisy),
    # the stream's longest gap was ~2 s in two runs (16 and 50 s without the bound) and its
    # median ~90 ms (a decode step alone: ~4 ms); the prompt's own time moved both ways (36 s
    # against 91 s in one pair, 59 s against 24 s in the other): its late chunks of 16 tokens
    # pay a pass each.
    max_step_ms: float = DEFAULT_MAX_STEP_MS
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if not 1 <= self.max_num_seqs <= 4096:
            raise InvalidParameterError("max_num_seqs", self.max_num_seqs, "must be in [1, 4096]")
        if self.max_model_len < 2:
            raise InvalidParameterError("max_model_len", self.max_model_len, "must be >= 2")
        if not 1 <= self.block_size <= 1024:
            raise InvalidParameterError("block_size", self.block_size, "must be in [1, 1024]")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise InvalidParameterError("num_kv_blocks", self.num_kv_blocks, "must be >= 1")
        if self.kv_cache_memory is not None and not (
                0 < self.kv_cache_memory <= 1 or (self.kv_cache_memory > 1 and float(self.kv_cache_memory).is_integer())):
            raise InvalidParameterError("kv_cache_memory", self.kv_cache_memory,
                                        "must be a number of bytes (an integer > 1) or a fraction of free memory in (0, 1]")
        if self.max_num_batched_tokens < 2:
            raise InvalidParameterError("max_num_batched_tokens", self.max_num_batched_tokens, "must be >= 2")
        ms = self.max_step_ms
        if isinstance(ms, bool) or not isinstance(ms, (int, float)) or not 0 <= ms <= 1e6:
            raise InvalidParameterError("max_step_ms", ms, "must be a number of milliseconds in [0, 1e6] (0: no bound)")
