"""Offline Python API in the style of vLLM: LLM(model=..., speculative_config={...}).generate(...)."""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from collections.abc import Iterator, Sequence

from tqdm import tqdm

from specserve.config import DEFAULT_MAX_STEP_MS, EngineConfig, SpeculativeConfig
from specserve.config_file import load_config_file, pick
from specserve.engine.engine import LLMEngine
from specserve.kv.budget import plan_kv_pool
from specserve.errors import InvalidParameterError, PromptError
from specserve.model.loader import DEFAULT_MAX_MODEL_LEN, LoadedModel, load_model, model_context
from specserve.outputs import RequestOutput, SpecStats
from specserve.sample.typical import TypicalAcceptance
from specserve.sampling_params import SamplingParams, choice_seed
from specserve.spec.factory import build_proposer

DEFAULT_MAX_NUM_SEQS = 4
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# speculative_config left out: the config file's, if any (None, given, means no speculation).
_FROM_CONFIG = object()


class LLM:
    """Load a model once, then generate for many prompts.

    >>> llm = LLM("default", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=16))

    `config`: a JSON file of settings as `specserve tune` writes it (`--config` on the command
    line): model, speculative_config, max_num_seqs, max_num_batched_tokens. Those of these
    arguments that are given win over it; the file wins over their defaults ("default", no
    speculation, 4, 2048).
    """

    def __init__(self, model: str | None = None, *, config: str | os.PathLike | None = None, dtype: str = "auto",
                 device: str | None = "cpu", quantization: str = "auto",
                 speculative_config: dict | SpeculativeConfig | None = _FROM_CONFIG, max_model_len: int | None = None,
                 max_num_seqs: int | None = None, seed: int = 0, loaded: LoadedModel | None = None,
                 block_size: int = 16, num_kv_blocks: int | None = None, kv_cache_memory: int | float | None = None,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 max_step_ms: float = DEFAULT_MAX_STEP_MS, **vllm_options):
        check_vllm_options(vllm_options)
        file = load_config_file(config)
        if speculative_config is _FROM_CONFIG:
            speculative_config = file.get("speculative_config")
        self.spec_config = SpeculativeConfig.from_dict(speculative_config)
        max_num_seqs = pick(max_num_seqs, file, "max_num_seqs", DEFAULT_MAX_NUM_SEQS)
        max_num_batched_tokens = pick(max_num_batched_tokens, file, "max_num_batched_tokens", DEFAULT_MAX_NUM_BATCHED_TOKENS)
        if loaded is None:
            loaded = load_model(pick(model, file, "model", "default"), dtype=dtype, device=device,
                                quantization=quantization, max_model_len=max_model_len)
            if loaded.notice:  # (the command line prints it on its load line)
                warnings.warn(loaded.notice, stacklevel=2)
        self.target = loaded
        # The positions the loaded model covers: its context, or less where load_model was
        # given a smaller max_model_len (the default one included).
        context = self.target.model.max_positions
        # Said on the load line when set: why the context is shorter than the target's.
        self.context_note: str | None = None
        if max_model_len is None:
            max_model_len = min(context, DEFAULT_MAX_MODEL_LEN)
            if self.spec_config is not None and self.spec_config.method == "draft_model" and self.spec_config.model:
                # A draft model of a shorter context caps the default (as vLLM does); a
                # max_model_len given past it is refused by the proposer, naming the draft's.
                draft_context = model_context(self.spec_config.model)
                if draft_context < max_model_len:
                    max_model_len = draft_context
                    self.context_note = (f"max_model_len {draft_context}: the draft model's context caps the "
                                         f"target's (give --max-model-len to choose it)")
        if not 2 <= max_model_len <= context:
            raise InvalidParameterError("max_model_len", max_model_len,
                                        f"must be in [2, {context}] (the positions the loaded model covers: its "
                                        "context, or load_model's max_model_len where that is smaller)")
        self.engine_config = EngineConfig(
            max_model_len=max_model_len, max_num_seqs=max_num_seqs, seed=seed, block_size=block_size,
            num_kv_blocks=num_kv_blocks, kv_cache_memory=kv_cache_memory,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            max_step_ms=max_step_ms)
        # Planned once, against the memory available before any pool exists, and passed on as
        # a block count: the draft model's pool and the target's then get the same size.
        self.kv_budget = plan_kv_pool(self.target, self.engine_config)
        self.engine_config = dataclasses.replace(self.engine_config, num_kv_blocks=self.kv_budget.num_blocks,
                                                 kv_cache_memory=None)
        proposer = build_proposer(self.spec_config, self.target, self.engine_config)
        k = self.spec_config.k if self.spec_config else 0
        typical = (TypicalAcceptance(self.spec_config.posterior_threshold, self.spec_config.posterior_alpha)
                   if self.spec_config and self.spec_config.lossy else None)
        self.engine = LLMEngine(self.target, self.engine_config, proposer, k, typical_acceptance=typical,
                                adaptive=bool(self.spec_config and self.spec_config.adaptive),
                                disable_by_batch_size=self.spec_config.disable_by_batch_size if self.spec_config else None)
        self.tokenizer = self.target.tokenizer
        self._ids = itertools.count()

    # ---- prompts -> outputs -----------------------------------------------------------------

    def generate(self, prompts: str | dict | Sequence[str | dict | Sequence[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Outputs in the order of `prompts`: each a string, a list of token ids, or vLLM's prompt
        dicts {"prompt": text} and {"prompt_token_ids": [ids]}."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return self._run([self._prompt(p) for p in prompts], sampling_params, use_tqdm)

    def _prompt(self, p: object) -> tuple[str | None, list[int]]:
        """One prompt of `generate` -> (its text if given, its token ids)."""
        if isinstance(p, str):
            return p, self._encode(p)
        if isinstance(p, dict):
            unknown = sorted(set(p) - {"prompt", "prompt_token_ids"})
            if unknown or not p:
                raise PromptError(f"a prompt dict takes the keys 'prompt' (text) or 'prompt_token_ids' (a list of "
                                  f"token ids); got {unknown or 'none'}")
            if "prompt_token_ids" in p:
                text = p.get("prompt")
                if text is not None and not isinstance(text, str):
                    raise PromptError(f"a prompt dict's 'prompt' must be text, not {type(text).__name__}")
                return text, self._token_ids(p["prompt_token_ids"])
            if not isinstance(p["prompt"], str):
                raise PromptError(f"a prompt dict's 'prompt' must be text, not {type(p['prompt']).__name__}")
            return p["prompt"], self._encode(p["prompt"])
        return None, self._token_ids(p)

    @staticmethod
    def _token_ids(ids: object) -> list[int]:
        if isinstance(ids, (str, bytes, dict)) or not isinstance(ids, Sequence) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise PromptError("a prompt is a string, a list of token ids (integers), or a dict with 'prompt' or "
                              f"'prompt_token_ids'; got {type(ids).__name__}"
                              + (" holding non-integers" if isinstance(ids, Sequence) else ""))
        return list(ids)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"} dicts) or a list of conversations."""
        if not isinstance(messages, list) or not messages:
            raise PromptError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        encoded = []
        for conv in conversations:
            text = self.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
            encoded.append((text, self.tokenizer.encode_chat(conv, add_generation_prompt=True)))
        return self._run(encoded, sampling_params, use_tqdm)

    def stream(self, prompt_token_ids: Sequence[int], params: SamplingParams,
               prompt: str | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding an output (with its `new_text`) after every step."""
        rid = str(next(self._ids))
        self.engine.add_request(rid, prompt_token_ids, params, prompt)
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id == rid:
                        yield out
                        if out.finished:
                            return
        finally:
            self.engine.abort_request(rid)
            self.engine.pop_finished(rid)

    def _encode(self, text: str) -> list[int]:
        if not text:
            raise PromptError("the prompt is empty; give some text")
        return self.tokenizer.encode(text)

    def _run(self, encoded: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = [sampling_params] * len(encoded) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(params) != len(encoded):
            raise InvalidParameterError("sampling_params", len(params), f"must be one, or one per prompt ({len(encoded)})")
        for p in params:
            if not isinstance(p, SamplingParams):
                raise InvalidParameterError("sampling_params", type(p).__name__, "must be a SamplingParams")
        order: dict[str, tuple[int, int]] = {}  # engine request -> (prompt, choice)
        results: list[list[RequestOutput | None]] = [[None] * p.n for p in params]
        try:
            for i, ((text, ids), p) in enumerate(zip(encoded, params)):
                for j in range(p.n):
                    rid = str(next(self._ids))
                    self.engine.add_request(rid, ids, choice_params(p, j), text)
                    order[rid] = (i, j)
            with tqdm(total=len(order), desc="Generating", unit="req", disable=not use_tqdm or len(order) < 2) as bar:
                while self.engine.has_unfinished_requests():
                    for out in self.engine.step():
                        if out.finished and out.request_id in order:
                            i, j = order[out.request_id]
                            results[i][j] = out
                            self.engine.pop_finished(out.request_id)
                            bar.update(1)
        finally:
            for rid in order:
                self.engine.abort_request(rid)
                self.engine.pop_finished(rid)
        return [merge_choices(outs) for outs in results]

    @staticmethod
    def aggregate_spec_stats(outputs: Sequence[RequestOutput]) -> SpecStats:
        return SpecStats.total(o.spec for o in outputs)


def choice_params(params: SamplingParams, j: int) -> SamplingParams:
    """The engine request behind choice j of `params` (n choices): n=1, seeded as the server
    seeds its choices (choice_seed)."""
    if params.n == 1:
        return params
    return params.copy(n=1, best_of=None, seed=choice_seed(params.seed, j))


def merge_choices(outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's n finished choices as one output: `outputs[j]` is choice j (index j); the
    speculation figures are their total, the metrics choice 0's."""
    if len(outs) == 1:
        return outs[0]
    return dataclasses.replace(outs[0], outputs=[dataclasses.replace(o.outputs[0], index=j) for j, o in enumerate(outs)],
                               spec=SpecStats.total(o.spec for o in outs))


# vLLM's LLM(...) options specserve has no use for: the values that mean "as specserve does"
# (none: the option is for GPUs), and why. Code written for vLLM that passes such a value runs
# unchanged; any other value is refused naming the option.
_VLLM_OPTIONS = {
    "tensor_parallel_size": ((1,), "specserve runs a model on one device"),
    "pipeline_parallel_size": ((1,), "specserve runs a model on one device"),
    "gpu_memory_utilization": ((), "a GPU option; size the KV pool with kv_cache_memory (bytes or a fraction)"),
    "enforce_eager": ((True, False), "a CUDA-graph option"),
    "trust_remote_code": ((False,), "specserve never runs code that comes with a model"),
    "swap_space": ((), "a GPU option; specserve keeps the KV pool in memory"),
    "cpu_offload_gb": ((0,), "a GPU option"),
}


def check_vllm_options(options: dict) -> None:
    for name, value in options.items():
        if name not in _VLLM_OPTIONS:
            raise TypeError(f"LLM() got an unexpected keyword argument {name!r}")
        accepted, why = _VLLM_OPTIONS[name]
        if not any(value == a and type(value) is type(a) for a in accepted):
            raise InvalidParameterError(name, value, f"is not supported by specserve ({why})"
                                        + (f"; only {', '.join(map(repr, accepted))}" if accepted else ""))
