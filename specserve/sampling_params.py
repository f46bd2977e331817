"""Sampling parameters of one request, validated once at the edge (vLLM-style names)."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field, fields

from specserve.errors import InvalidParameterError

# A request may not ask for more than this many new tokens; larger values are almost always
# a client mistake and would pin KV-cache memory for no reason.
MAX_TOKENS_LIMIT = 1 << 20
# Alternatives per token that `logprobs` may ask for (OpenAI's chat API allows 20).
MAX_LOGPROBS = 20
# top_k at or above the vocabulary size keeps every token (the same as 0); this bound only keeps
# the value a machine integer. No vocabulary comes near it.
MAX_TOP_K = 1 << 24
# Stop strings and stop token ids per request (each is checked against every new token).
MAX_STOP = 16
# Completions per prompt (n): the server's default cap on engine requests per HTTP request.
MAX_N = 64
# Tokens one request's logit_bias may name: it is applied at every scored position, so the
# bound keeps that work (and the request) small. Values are bounded as OpenAI bounds them.
MAX_LOGIT_BIAS = 4096
LOGIT_BIAS_RANGE = 100.0
# Penalty ranges as vLLM (and, for presence and frequency, OpenAI) bound them: presence and
# frequency in [-2, 2], repetition in (0, 2].
PENALTY_RANGE = 2.0
MAX_REPETITION_PENALTY = 2.0
# Temperatures below this are greedy (vLLM's _SAMPLING_EPS): dividing logits by a tinier one
# overflows float32 to inf (1e-38 gave NaN probabilities and <|endoftext|> tokens), and long
# before that the distribution is one-hot at the argmax anyway.
MIN_SAMPLING_TEMPERATURE = 1e-5
# Bounds of a structured-output spec: the grammar engine compiles it while the request is added
# (a server does that on its event loop), so the text it compiles stays small.
MAX_GRAMMAR_CHARS = 1 << 20
MAX_CHOICES = 1024


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """Constrain the output to a language (vLLM's `StructuredOutputsParams`): set exactly one of

    json: a JSON schema (a dict, or its JSON text); the output is one JSON value it accepts.
    regex: a regular expression the whole output matches (Rust `regex` syntax).
    choice: a list of strings; the output is one of them.
    grammar: a context-free grammar in Lark syntax, or in llama.cpp's GBNF (`root ::= ...`).
    json_object: True; the output is any JSON object.

    When the output is complete in the language, end of text is the only token allowed, so the
    request ends with finish_reason "stop" (unless max_tokens or a stop string ends it first).
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """The one field that is set ("json", "regex", "choice", "grammar" or "json_object")."""
        return self._given()[0]

    def _given(self) -> list[str]:
        # json_object=False is the same as leaving it out (vLLM's default).
        return [f.name for f in fields(self) if getattr(self, f.name) is not None
                and not (f.name == "json_object" and self.json_object is False)]

    def validate(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise InvalidParameterError("structured_outputs", " and ".join(given) or "nothing",
                                        "set exactly one of json, regex, choice, grammar, json_object")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise InvalidParameterError("structured_outputs.json", type(self.json).__name__,
                                        "must be a JSON schema: a dict or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_GRAMMAR_CHARS):
                raise InvalidParameterError(f"structured_outputs.{name}", short_repr(value),
                                            f"must be a non-empty string of at most {MAX_GRAMMAR_CHARS} characters")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not 1 <= len(self.choice) <= MAX_CHOICES
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise InvalidParameterError("structured_outputs.choice", short_repr(self.choice),
                                            f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise InvalidParameterError("structured_outputs.json_object", self.json_object, "must be true or false")


# vLLM's earlier name for the same parameters.
GuidedDecodingParams = StructuredOutputsParams


def short_repr(value: object, limit: int = 80) -> object:
    """The value, or its repr cut to `limit` characters when longer: for messages about specs
    that may be large."""
    text = repr(value)
    return value if len(text) <= limit else text[:limit - 3] + "..."


@dataclass(slots=True)
class SamplingParams:
    """How to pick each next token.

    Logits are processed in this order at every position: logit_bias, then repetition_penalty,
    then frequency_penalty and presence_penalty (sample/processors.py), then temperature and the
    filters (sample/logits.py). Greedy decoding takes the argmax of the processed logits.

    temperature 0, or any temperature below MIN_SAMPLING_TEMPERATURE (1e-5), means greedy
    decoding. top_k 0 (or -1, as in vLLM) disables top-k; top_p 1
    and min_p 0 disable nucleus and min-p filtering. The filters apply in the order
    temperature -> top_k -> top_p -> min_p, the same for plain sampling and for the speculative
    verifier, so speculation never changes the distribution being sampled. Every number has an
    upper bound, checked here: the engine turns these values into tensors and machine integers.
    The engine also checks stop_token_ids against the model's vocabulary when a request is added.

    seed: the request's sampled tokens are a function of the seed and the target's distributions
    alone: the token at sequence position t races the processed distribution against noise drawn
    from (seed, t) (sample/noise.py), so the same seed gives the same text with or without
    speculation, at any draft length and whatever else is batched. None: the engine draws a seed
    for the request from its own RNG (seeded by the engine's `seed`). n choices (offline or in the server) of a
    request seeded s are seeded s + j for choice j (modulo 2**63), so choice j equals a single
    request with seed s + j.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    # None: no log probabilities. n >= 0: the chosen token's log probability plus the n most
    # likely alternatives at each generated position, under the model's raw distribution
    # (before temperature and filters, as vLLM reports them).
    logprobs: int | None = None
    # vLLM's names. n: completions per prompt (LLM.generate returns them as one output's
    # `outputs`; choice j of a seeded request is seeded seed + j). best_of: None or n (no
    # ranking of extra samples).
    n: int = 1
    best_of: int | None = None
    # vLLM's penalties (sample/processors.py, Penalties). presence and frequency count the
    # request's output tokens only: logit -= frequency * count + presence * (count > 0).
    # repetition acts on every token seen in the prompt or the output: a positive logit is
    # divided by it, a negative one multiplied. 0, 0 and 1 disable them.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # token id -> value added to its logit at every position, before temperature and filters
    # (OpenAI's logit_bias: -100 bans a token in practice, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True  # control tokens' text left out of `text`
    include_stop_str_in_output: bool = False  # a stop string that ended the text stays in it
    # The language the output must belong to (a JSON schema, a regex, choices, a grammar);
    # `guided_decoding` is vLLM's earlier name for it, moved here when given.
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidParameterError("guided_decoding", "both set", "is the older name of structured_outputs; "
                                            "give only one of them")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    def validate(self) -> None:
        """Raise InvalidParameterError naming the first field out of its range. The engine calls
        it again when a request is added: the fields stay assignable after construction."""
        _check_number("temperature", self.temperature, float)
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidParameterError("temperature", self.temperature,
                                        f"must be in [0, 100]; 0 (or below {MIN_SAMPLING_TEMPERATURE}) means greedy")
        _check_number("top_p", self.top_p, float)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidParameterError("top_p", self.top_p, "must be in (0, 1]")
        _check_number("top_k", self.top_k, int)
        if not -1 <= self.top_k <= MAX_TOP_K:
            raise InvalidParameterError("top_k", self.top_k, f"must be in [-1, {MAX_TOP_K}] (0 or -1 disables top-k; "
                                                             "values at or above the vocabulary size keep every token)")
        _check_number("min_p", self.min_p, float)
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidParameterError("min_p", self.min_p, "must be in [0, 1]")
        _check_number("max_tokens", self.max_tokens, int)
        if not 1 <= self.max_tokens <= MAX_TOKENS_LIMIT:
            raise InvalidParameterError("max_tokens", self.max_tokens, f"must be in [1, {MAX_TOKENS_LIMIT}]")
        if self.seed is not None:
            _check_number("seed", self.seed, int)
            if not 0 <= self.seed < 2**63:
                raise InvalidParameterError("seed", self.seed, "must be in [0, 2**63)")
        if self.logprobs is not None:
            _check_number("logprobs", self.logprobs, int)
            if not 0 <= self.logprobs <= MAX_LOGPROBS:
                raise InvalidParameterError("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        _check_number("n", self.n, int)
        if not 1 <= self.n <= MAX_N:
            raise InvalidParameterError("n", self.n, f"must be in [1, {MAX_N}]")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidParameterError("best_of", self.best_of, "is not supported by specserve beyond n (choosing "
                                        "the best of extra samples); leave it out or equal to n")
        for name in ("presence_penalty", "frequency_penalty"):
            _check_number(name, getattr(self, name), float)
            if not -PENALTY_RANGE <= getattr(self, name) <= PENALTY_RANGE:
                raise InvalidParameterError(name, getattr(self, name),
                                            f"must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}] (0 disables it)")
        _check_number("repetition_penalty", self.repetition_penalty, float)
        if not 0.0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidParameterError("repetition_penalty", self.repetition_penalty,
                                        f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 disables it; above 1 "
                                        "discourages repeats)")
        if self.logit_bias is not None:
            _check_logit_bias(self.logit_bias)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidParameterError(name, getattr(self, name), "must be true or false")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise InvalidParameterError("structured_outputs", type(self.structured_outputs).__name__,
                                            "must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOP:
            raise InvalidParameterError("stop", self.stop, f"must be a list of at most {MAX_STOP} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidParameterError("stop", s, "each stop sequence must be a non-empty string")
        if not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP:
            raise InvalidParameterError("stop_token_ids", self.stop_token_ids,
                                        f"must be a list of at most {MAX_STOP} token ids")
        for t in self.stop_token_ids:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidParameterError("stop_token_ids", t, "each stop token id must be an int >= 0")

    def copy(self, **changes) -> SamplingParams:
        """A copy with `changes` applied, its lists and dict its own, without the checks of
        __post_init__ (dataclasses.replace runs them again: most of a small model's cost per
        request). For copies the engine checks when they are added (LLM.generate's choices,
        verify's seeds) or has checked already (its own copy)."""
        new = copy.copy(self)
        new.stop, new.stop_token_ids = list(self.stop), list(self.stop_token_ids)
        if self.logit_bias is not None:
            new.logit_bias = dict(self.logit_bias)
        for name, value in changes.items():
            setattr(new, name, value)
        return new

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_SAMPLING_TEMPERATURE


def choice_seed(seed: int | None, j: int) -> int | None:
    """The seed of choice j of a request seeded `seed` (n choices, offline and in the server):
    seed + j modulo 2**63, so that the choices differ and each equals one request of that seed."""
    return None if seed is None else (seed + j) % 2**63


def _check_number(name: str, value: object, kind: type) -> None:
    # bool is an int subclass; True as a temperature is a client bug, not 1.0.
    ok = isinstance(value, (int, float)) if kind is float else isinstance(value, int)
    if isinstance(value, bool) or not ok:
        raise InvalidParameterError(name, value, f"must be a{'n integer' if kind is int else ' number'}")


def _check_logit_bias(bias: object) -> None:
    if not isinstance(bias, dict) or len(bias) > MAX_LOGIT_BIAS:
        raise InvalidParameterError("logit_bias", bias if not isinstance(bias, dict) else f"{len(bias)} entries",
                                    f"must map at most {MAX_LOGIT_BIAS} token ids to numbers in "
                                    f"[-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidParameterError("logit_bias", token, "keys must be token ids (integers >= 0)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not -LOGIT_BIAS_RANGE <= value <= LOGIT_BIAS_RANGE:
            raise InvalidParameterError("logit_bias", {token: value},
                                        f"values must be numbers in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}]")
