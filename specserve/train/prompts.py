"""The prompts the target answers for self-distillation: a JSONL file, or user turns the target
writes itself from its chat template. Never the Spec-Bench prompts, which measure the result."""

from __future__ import annotations

import json
from pathlib import Path

from specserve.bench.workload import read_jsonl, spec_bench_path
from specserve.errors import InvalidParameterError, SpecserveError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import Tokenizer

_SENTINEL = "\u2063specserve-user-turn\u2063"
# Temperatures the self-written user turns cycle through: cooler ones stay on topic, warmer
# ones spread over more topics.
PROMPT_TEMPERATURES = (0.7, 0.85, 1.0, 1.1)
PROMPT_TOP_P = 0.95


def read_prompt_file(path: str | Path) -> list[list[dict]]:
    """JSONL rows {"prompt": "..."} or {"messages": [{"role": ..., "content": ...}, ...]} ->
    conversations to answer. Refuses Spec-Bench itself and drops rows whose user text is a
    Spec-Bench prompt."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidParameterError("prompts", str(path), "must be an existing JSONL file")
    bench = spec_bench_path()
    if bench.is_file() and path.resolve() == bench.resolve():
        raise InvalidParameterError("prompts", str(path), "is Spec-Bench, the benchmark; train on other prompts")
    conversations = []
    for n, row in read_jsonl(path):
        if isinstance(row, dict) and isinstance(row.get("prompt"), str) and row["prompt"].strip():
            conversations.append([{"role": "user", "content": row["prompt"]}])
        elif isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            conversations.append(row["messages"])
        else:
            raise InvalidParameterError("prompts", str(path), f'line {n} has neither a "prompt" string nor a "messages" list')
    bench_texts = spec_bench_texts()
    kept = [c for c in conversations if not any(
        isinstance(m, dict) and isinstance(m.get("content"), str) and m["content"].strip() in bench_texts for m in c)]
    if not kept:
        raise SpecserveError(f"{path} holds no prompts (after dropping Spec-Bench ones)")
    return kept


def spec_bench_texts() -> frozenset[str]:
    """Every turn of every Spec-Bench prompt, stripped."""
    path = spec_bench_path()
    if not path.is_file():
        return frozenset()
    texts = set()
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.update(t.strip() for t in json.loads(line).get("turns", []) if isinstance(t, str))
    return frozenset(texts)


def user_turn_prefix(tokenizer: Tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's words begin (system prompt
    included), so that sampling from there makes the target write a user turn. A template that
    puts nothing before the user's words starts from BOS (or, without one, the first EOS)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}], add_generation_prompt=False)
    prefix = text.split(_SENTINEL)[0]
    bos = tokenizer.special_tokens.get("bos_token")
    ids = tokenizer.encode(prefix, add_special_tokens=not (bos and prefix.startswith(bos))) if prefix else []
    if not ids:
        start = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else min(tokenizer.eos_token_ids)
        ids = [start]
    return ids


def write_user_turns(llm: LLM, seeds: list[int], max_tokens: int) -> list[str]:
    """One user turn per seed, sampled by the target after its template's user-turn prefix at
    a temperature chosen by the seed. Turns that do not end by themselves within max_tokens
    (rambling) or that are empty are dropped, so fewer may come back."""
    prefix = user_turn_prefix(llm.tokenizer)
    params = [SamplingParams(temperature=PROMPT_TEMPERATURES[s % len(PROMPT_TEMPERATURES)], top_p=PROMPT_TOP_P,
                             max_tokens=max_tokens, seed=s) for s in seeds]
    outs = llm.generate([prefix] * len(seeds), params, use_tqdm=False)
    bench = spec_bench_texts()
    texts = [o.outputs[0].text.strip() for o in outs if o.outputs[0].finish_reason == "stop"]
    return [t for t in texts if t and t not in bench]
