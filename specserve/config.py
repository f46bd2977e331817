"""Engine and speculative-decoding configuration, validated once at the edge."""

from __future__ import annotations

from dataclasses import dataclass, fields

from specserve.errors import InvalidParameterError
from specserve.spec.layer_set import check_skip_layers
from specserve.spec.lookahead import DEFAULT_CANDIDATES, DEFAULT_NGRAM, DEFAULT_WINDOW, check_lookahead_params
from specserve.spec.ngram import check_lookup_params, check_num_branches
from specserve.spec.suffix import (DEFAULT_CACHE_TOKENS, DEFAULT_MIN_TOKEN_PROB, DEFAULT_SPEC_FACTOR,
                                   DEFAULT_TREE_DEPTH, check_suffix_params)

# Every drafting method, by the name speculative_config's "method" takes. The command-line
# choices (engine_args, bench, tune) are derived from these two tuples.
SPEC_METHODS = ("ngram", "suffix", "self_spec", "draft_model", "eagle", "medusa", "lookahead")
# Methods that need a path in speculative_config's "model" (bench and tune: METHOD:PATH).
PATH_METHODS = ("draft_model", "eagle", "medusa")
# Beyond this a draft is almost never accepted in full and the verify pass stops being cheap.
MAX_SPECULATIVE_TOKENS = 32
# Trained drafters (a `specserve train-draft` folder in `model`), which draft token trees.
DRAFTER_METHODS = ("eagle", "medusa")
MAX_DRAFT_NODES = 128  # tree nodes verified per step
MAX_DRAFT_TOPK = 32
ACCEPTANCE_METHODS = ("rejection_sampler", "typical_acceptance_sampler")
# num_speculative_tokens="auto" (the default): the engine chooses 0..this many drafts per request
# and step from its measured pass cost and each request's acceptance (engine/adaptive.py). A
# draft model or EAGLE drafts one depth per small pass, so their caps are lower.
# Suffix decoding drafts whole remembered continuations: long drafts pay when it matches well.
# Lookahead's cap is its whole tree's depth W + N - 2 (SpeculativeConfig.k; listed for its defaults).
AUTO_MAX_SPECULATIVE_TOKENS = {"ngram": 8, "suffix": 16, "draft_model": 6, "eagle": 6, "medusa": 4, "self_spec": 6,
                               "lookahead": 2}
# On the 2-core CPU a 9-token verification pass costs ~1.2-1.3x a decode step, and larger trees
# cost more than their extra acceptance brings (EAGLE on held-out prompts: 8 nodes, top-2).
DEFAULT_EAGLE_NODES = 8


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """What `speculative_config={...}` accepts, with vLLM's key names."""

    method: str
    # An integer k: every request drafts up to k tokens each step. "auto": the engine chooses
    # 0..max_speculative_tokens per request and step, to maximise committed tokens per second.
    num_speculative_tokens: int | str = "auto"
    max_speculative_tokens: int | None = None  # "auto"'s cap; None: AUTO_MAX_SPECULATIVE_TOKENS[method]
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model for "draft_model"; the drafter folder for "eagle" and "medusa"
    # n-gram: continuations of several earlier occurrences drafted as the branches of one token
    # tree, verified in one pass (1: a single chain). num_speculative_tokens is then its depth.
    num_branches: int = 1
    # suffix: longest suffix matched (and so the depth of its trees), the global tree's size in
    # tokens of earlier outputs (0: none), draft depth per matched token, and the smallest
    # estimated probability of a drafted node.
    suffix_tree_depth: int = DEFAULT_TREE_DEPTH
    suffix_cache_tokens: int = DEFAULT_CACHE_TOKENS
    suffix_spec_factor: float = DEFAULT_SPEC_FACTOR
    suffix_min_token_prob: float = DEFAULT_MIN_TOKEN_PROB
    # eagle, medusa: draft-tree nodes verified per step (num_speculative_tokens is the tree's
    # depth); None: eagle DEFAULT_EAGLE_NODES, medusa the tree chosen when it was trained.
    num_draft_nodes: int | None = None
    # eagle: children kept per expanded node, and nodes expanded per depth (EAGLE-2's top-k).
    draft_topk: int = 2
    # "typical_acceptance_sampler": Medusa's typical acceptance for sampled requests, LOSSY (the
    # output no longer has exactly the target's distribution; greedy output is unchanged).
    # Off by default: "rejection_sampler" keeps every output exactly the target's.
    # lookahead: the window's columns W, the n-gram size N (the window has N - 1 levels) and the
    # verification candidates G per step (spec/lookahead.py); None: that method's defaults.
    lookahead_window: int | None = None
    lookahead_ngram: int | None = None
    lookahead_candidates: int | None = None
    acceptance_method: str = "rejection_sampler"
    posterior_threshold: float = 0.09
    posterior_alpha: float = 0.3
    # self_spec: the target's decoder layers its draft skips; None: the model's layer set
    # (spec/layer_set.py: next to the model, or shipped for the embedded one).
    skip_layers: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise InvalidParameterError("speculative_config.method", self.method, f"must be one of {', '.join(SPEC_METHODS)}")
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
        if self.method == "ngram":
            check_lookup_params(self.prompt_lookup_min, self.prompt_lookup_max)
        check_num_branches(self.num_branches)
        check_suffix_params(self.suffix_tree_depth, self.suffix_cache_tokens, self.suffix_spec_factor,
                            self.suffix_min_token_prob)
        suffix_keys = ("suffix_tree_depth", "suffix_cache_tokens", "suffix_spec_factor", "suffix_min_token_prob")
        changed = [k for k in suffix_keys if getattr(self, k) != SpeculativeConfig.__dataclass_fields__[k].default]
        if changed and self.method != "suffix":
            raise InvalidParameterError(changed[0], getattr(self, changed[0]), "applies to method 'suffix' only")
        if self.num_branches > 1 and self.method != "ngram":
            raise InvalidParameterError("num_branches", self.num_branches, "applies to method 'ngram' only (1 otherwise)")
        knobs = {"lookahead_window": self.lookahead_window, "lookahead_ngram": self.lookahead_ngram,
                 "lookahead_candidates": self.lookahead_candidates}
        if self.method == "lookahead":
            check_lookahead_params(*self.lookahead_params)
        elif given := [k for k, v in knobs.items() if v is not None]:
            raise InvalidParameterError(given[0], knobs[given[0]], "applies to method 'lookahead' only (leave it unset)")
        if self.method == "draft_model" and not self.model:
            raise InvalidParameterError("speculative_config.model", self.model, "method 'draft_model' needs the draft model's path")
        if self.method in DRAFTER_METHODS and not self.model:
            raise InvalidParameterError("speculative_config.model", self.model,
                                        f"method {self.method!r} needs the folder `specserve train-draft` wrote")
        if self.skip_layers is not None:
            if self.method != "self_spec":
                raise InvalidParameterError("skip_layers", self.skip_layers, "applies to method 'self_spec' only")
            object.__setattr__(self, "skip_layers", check_skip_layers(self.skip_layers, None, "skip_layers"))
        n, topk = self.num_draft_nodes, self.draft_topk
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_DRAFT_NODES):
            raise InvalidParameterError("num_draft_nodes", n, f"must be an integer in [1, {MAX_DRAFT_NODES}] or None")
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_DRAFT_TOPK:
            raise InvalidParameterError("draft_topk", topk, f"must be an integer in [1, {MAX_DRAFT_TOPK}]")
        if self.acceptance_method not in ACCEPTANCE_METHODS:
            raise InvalidParameterError("acceptance_method", self.acceptance_method, f"must be one of {', '.join(ACCEPTANCE_METHODS)}")
        for name in ("posterior_threshold", "posterior_alpha"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise InvalidParameterError(name, v, "must be a number in (0, 1]")

    @property
    def adaptive(self) -> bool:
        return self.num_speculative_tokens == "auto"

    @property
    def k(self) -> int:
        """The fixed k, or "auto"'s cap."""
        if not self.adaptive:
            return self.num_speculative_tokens
        if self.method == "lookahead" and self.max_speculative_tokens is None:
            window, ngram, _ = self.lookahead_params
            return window + ngram - 2  # deeper, nothing is drafted
        return self.max_speculative_tokens or AUTO_MAX_SPECULATIVE_TOKENS[self.method]

    @property
    def lookahead_params(self) -> tuple[int, int, int]:
        """(W, N, G), each as given or its default."""
        return (DEFAULT_WINDOW if self.lookahead_window is None else self.lookahead_window,
                DEFAULT_NGRAM if self.lookahead_ngram is None else self.lookahead_ngram,
                DEFAULT_CANDIDATES if self.lookahead_candidates is None else self.lookahead_candidates)

    @property
    def lossy(self) -> bool:
        return self.acceptance_method == "typical_acceptance_sampler"

    @classmethod
    def from_dict(cls, d: dict | "SpeculativeConfig" | None) -> "SpeculativeConfig | None":
        if d is None or isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise InvalidParameterError("speculative_config", d, "must be a dict such as {'method': 'ngram', 'num_speculative_tokens': 'auto'}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise InvalidParameterError("speculative_config", unknown, f"unknown keys; allowed: {', '.join(sorted(known))}")
        if "method" not in d:
            raise InvalidParameterError("speculative_config.method", None, f"is required; one of {', '.join(SPEC_METHODS)}")
        return cls(**d)


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
