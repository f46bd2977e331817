"""Peers measured in the same run: Hugging Face transformers' generate() on the same weights, and
llama.cpp (through llama-cpp-python, when installed) on the same GGUF."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import torch

from specserve.bench.measure import Sample
from specserve.errors import SpecserveError
from specserve.model.loader import LoadedModel
from specserve.sampling_params import SamplingParams

PEERS = ("transformers", "llama.cpp")


def _load_transformers(path: Path, dtype: torch.dtype, device: torch.device):
    try:
        import transformers
    except ImportError:
        raise SpecserveError("--peers transformers needs the transformers package: pip install transformers accelerate") from None
    if path.suffix.lower() == ".gguf":
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


class TransformersRunner:
    """generate() in its plain, prompt-lookup or assistant-model mode, on the target's own file."""

    speculative = False

    def __init__(self, loaded: LoadedModel, mode: str, k: int | None, prompt_lookup_max: int, draft_path: str | None = None):
        self.method = f"transformers:{mode}" if mode != "plain" else "transformers"
        self.label, self.num_speculative_tokens = self.method if k is None else f"{self.method} k={k}", k
        self.device = loaded.model.device
        self.model = _load_transformers(loaded.path, loaded.model.dtype, self.device)
        self.eos = sorted(loaded.tokenizer.eos_token_ids)
        self.extra: dict = {}
        if mode == "prompt_lookup":
            self.extra = {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": prompt_lookup_max}
        elif mode == "assistant":
            self.extra = {"assistant_model": _load_transformers(Path(draft_path), loaded.model.dtype, self.device)}
            self.model.generation_config.num_assistant_tokens = k
            self.model.generation_config.num_assistant_tokens_schedule = "constant"

    @torch.inference_mode()
    def run(self, category: str, prompt_ids: list[int], params: SamplingParams) -> Sample:
        ids = torch.tensor([prompt_ids], device=self.device)
        sampling = {"do_sample": False} if params.greedy else {
            "do_sample": True, "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or None}
        if params.seed is not None:
            torch.manual_seed(params.seed)
        clock = _FirstTokenClock()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=params.max_tokens,
                                  eos_token_id=self.eos, pad_token_id=self.eos[0], streamer=clock, **sampling, **self.extra)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return Sample(category, out[0, len(prompt_ids):].tolist(), time.perf_counter() - clock.start,
                      clock.first_token - clock.start)


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


class LlamaCppRunner:
    """llama.cpp on the same GGUF: its own quantized kernels, plain or with its prompt lookup."""

    speculative = False

    def __init__(self, loaded: LoadedModel, mode: str, k: int | None, prompt_lookup_max: int, max_model_len: int):
        import llama_cpp
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        self.method = "llama.cpp" if mode == "plain" else "llama.cpp:prompt_lookup"
        self.label, self.num_speculative_tokens = self.method if k is None else f"{self.method} k={k}", k
        draft = LlamaPromptLookupDecoding(num_pred_tokens=k, max_ngram_size=prompt_lookup_max) if mode != "plain" else None
        self.llm = llama_cpp.Llama(model_path=str(loaded.path), n_ctx=max_model_len, n_threads=torch.get_num_threads(),
                                   n_threads_batch=torch.get_num_threads(), draft_model=draft, verbose=False)
        self.eos = loaded.tokenizer.eos_token_ids

    def run(self, category: str, prompt_ids: list[int], params: SamplingParams) -> Sample:
        if params.greedy:
            sampling = {"temp": 0.0, "top_k": 1}
        else:
            sampling = {"temp": params.temperature, "top_p": params.top_p, "top_k": params.top_k, "min_p": params.min_p}
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        tokens: list[int] = []
        t = first = time.perf_counter()
        for tok in self.llm.generate(prompt_ids, reset=True, **sampling):
            if not tokens:
                first = time.perf_counter()
            tokens.append(int(tok))
            if tok in self.eos or len(tokens) >= params.max_tokens:
                break
        return Sample(category, tokens, time.perf_counter() - t, first - t)


def build_peers(names: list[str], loaded: LoadedModel, ks: list[int], prompt_lookup_max: int,
                draft_paths: list[str], max_model_len: int, log=print) -> list:
    runners = []
    for name in names:
        if name == "transformers":
            runners.append(TransformersRunner(loaded, "plain", None, prompt_lookup_max))
            runners += [TransformersRunner(loaded, "prompt_lookup", k, prompt_lookup_max) for k in ks]
            runners += [TransformersRunner(loaded, "assistant", k, prompt_lookup_max, d) for d in draft_paths for k in ks]
        elif name == "llama.cpp":
            if importlib.util.find_spec("llama_cpp") is None:
                log("peer llama.cpp skipped: llama-cpp-python is not installed (pip install llama-cpp-python)", file=sys.stderr)
                continue
            if loaded.path.suffix.lower() != ".gguf":
                log("peer llama.cpp skipped: it runs GGUF files and the target is not one", file=sys.stderr)
                continue
            os.environ.setdefault("LLAMA_LOG_LEVEL", "error")
            runners.append(LlamaCppRunner(loaded, "plain", None, prompt_lookup_max, max_model_len))
            runners += [LlamaCppRunner(loaded, "prompt_lookup", k, prompt_lookup_max, max_model_len) for k in ks]
    return runners
