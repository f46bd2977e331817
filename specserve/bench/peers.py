"""Peers measured in the same run: Hugging Face transformers' generate() on the same weights, and
llama.cpp (through llama-cpp-python, when installed) on the same GGUF.

Both stop at specserve's own EOS ids and run with the same torch thread count, so that their
lines differ from specserve's only in the engine.
"""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.bench.runner import Config, Sample
from specserve.errors import SpecserveError
from specserve.model.loader import LoadedModel
from specserve.sampling_params import SamplingParams

PEERS = ("transformers", "llama.cpp")


@dataclass(frozen=True, slots=True)
class PeerPlan:
    """What the peers are asked to match: the speculative settings of specserve's own lines."""

    ks: list[int]  # prompt lookup (and assistant) at each k, as specserve's sweep
    prompt_lookup_max: int
    draft_paths: list[str]  # transformers' assistant_model for each
    max_model_len: int


def _load_transformers(path: Path, dtype: torch.dtype, device: torch.device):
    import transformers

    # generate() logs advice about generation flags on every call, and loading draws progress
    # bars; the bench's output is its table and its own progress bar.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    if path.suffix.lower() == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


class _FirstTokenClock:
    """A generate() streamer that only notes when the first new token arrives (its first call
    carries the prompt)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.first_token = self.start
        self.calls = 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:
            self.first_token = time.perf_counter()

    def end(self) -> None:
        if self.calls < 2:
            self.first_token = time.perf_counter()


class TransformersRunner:
    """generate() in its plain, prompt-lookup or assistant-model mode; all modes share one model."""

    def __init__(self, config: Config, model, eos: list[int], extra: dict, assistant=None):
        self.config, self.model, self.eos, self.extra, self.assistant = config, model, eos, extra, assistant

    @torch.inference_mode()
    def run(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        device = self.model.device
        ids = torch.tensor([prompt_ids], device=device)
        # top_k is passed even when 0: left unset, generate() would fall back to its default of 50.
        sampling = {"do_sample": False} if params.greedy else {
            "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
            "min_p": params.min_p or None}
        if params.seed is not None:
            torch.manual_seed(params.seed)
        extra = dict(self.extra)
        if self.assistant is not None:
            # The assistant's draft length lives on its own generation config; one assistant
            # serves every k, so it is set for each call. A fixed k (constant schedule, no
            # confidence cut-off) matches specserve's draft_model lines.
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = self.config.num_speculative_tokens
            gc.num_assistant_tokens_schedule = "constant"
            gc.assistant_confidence_threshold = 0.0
            extra["assistant_model"] = self.assistant
        clock = _FirstTokenClock()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                  eos_token_id=self.eos, pad_token_id=self.eos[0], streamer=clock, **sampling, **extra)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return Sample(out[0, len(prompt_ids):].tolist(), time.perf_counter() - clock.start, clock.first_token - clock.start,
                      num_prompt_tokens=len(prompt_ids))


def transformers_runners(loaded: LoadedModel, plan: PeerPlan) -> list[TransformersRunner]:
    if importlib.util.find_spec("transformers") is None:
        raise SpecserveError("--peers transformers needs the transformers package: pip install transformers accelerate")
    dtype, device = loaded.model.dtype, loaded.model.device
    model = _load_transformers(loaded.path, dtype, device)
    eos = sorted(loaded.tokenizer.eos_token_ids)
    runners = [TransformersRunner(Config("transformers"), model, eos, {})]
    runners += [TransformersRunner(Config("transformers:prompt_lookup", k), model, eos,
                                   {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": plan.prompt_lookup_max})
                for k in plan.ks]
    for path in plan.draft_paths:
        assistant = _load_transformers(Path(path), dtype, device)
        runners += [TransformersRunner(Config("transformers:assistant", k, path), model, eos, {}, assistant)
                    for k in plan.ks]
    return runners


class LlamaCppRunner:
    """llama.cpp on the same GGUF: its own quantized kernels, plain or with its prompt lookup."""

    def __init__(self, config: Config, loaded: LoadedModel, plan: PeerPlan):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        k = config.num_speculative_tokens
        draft = None if k is None else LlamaPromptLookupDecoding(max_ngram_size=plan.prompt_lookup_max, num_pred_tokens=k)
        threads = torch.get_num_threads()
        self.config = config
        # On a GPU target every layer is offloaded, so that both engines run on the same device.
        # With a draft, llama-cpp-python verifies from logits at every position but sizes its
        # logits buffer by `logits_all`: False there fails on prompts longer than a batch.
        self.llm = llama_cpp.Llama(model_path=str(loaded.path), n_ctx=plan.max_model_len, n_threads=threads,
                                   n_threads_batch=threads, n_gpu_layers=-1 if loaded.model.device.type == "cuda" else 0,
                                   draft_model=draft, logits_all=draft is not None, verbose=False)
        self.eos = loaded.tokenizer.eos_token_ids

    def run(self, prompt_ids: list[int], params: SamplingParams) -> Sample:
        if params.greedy:
            sampling = {"temp": 0.0, "top_k": 1}
        else:
            sampling = {"temp": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p}
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        # Forget the previous prompt: llama-cpp-python would otherwise reuse the shared prefix
        # (the chat template's system text) from its cache, a prefill specserve pays in full.
        self.llm.reset()
        tokens: list[int] = []
        t = first = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, reset=True, repeat_penalty=1.0, **sampling):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(tok))
            if tok in self.eos or len(tokens) >= params.max_tokens:
                break
        return Sample(tokens, time.perf_counter() - t, first - t, num_prompt_tokens=len(prompt_ids))


def llama_cpp_runners(loaded: LoadedModel, plan: PeerPlan, log: Callable[[str], None]) -> list[LlamaCppRunner]:
    if importlib.util.find_spec("llama_cpp") is None:
        log("peer llama.cpp skipped: llama-cpp-python is not installed (pip install llama-cpp-python)")
        return []
    if loaded.path.suffix.lower() != ".gguf":
        log("peer llama.cpp skipped: it runs GGUF files and the target is not one")
        return []
    import llama_cpp

    if loaded.model.device.type != "cpu" and not llama_cpp.llama_supports_gpu_offload():
        log("peer llama.cpp skipped: this llama-cpp-python build has no GPU support and the target runs on "
            f"{loaded.model.device}")
        return []
    return [LlamaCppRunner(Config("llama.cpp"), loaded, plan)] + [
        LlamaCppRunner(Config("llama.cpp:prompt_lookup", k), loaded, plan) for k in plan.ks]


def build_peers(names: list[str], loaded: LoadedModel, plan: PeerPlan, log: Callable[[str], None]) -> list:
    runners: list = []
    for name in names:
        if name == "transformers":
            runners += transformers_runners(loaded, plan)
        elif name == "llama.cpp":
            runners += llama_cpp_runners(loaded, plan, log)
    return runners
