"""The prompts the target answers for self-distillation: a JSONL file, or user turns the target
writes itself from its chat template. Never the Spec-Bench prompts, which measure the result."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specserve.bench.workload import first_turn, read_jsonl, spec_bench_path
from specserve.errors import InvalidParameterError, SpecserveError
from specserve.llm import LLM
from specserve.sampling_params import SamplingParams
from specserve.tokenizer import Tokenizer

_SENTINEL = "\u2063specserve-user-turn\u2063"
# Temperatures the self-written user turns cycle through: cooler ones stay on topic, warmer
# ones spread over more topics.
PROMPT_TEMPERATURES = (0.7, 0.85, 1.0, 1.1)
PROMPT_TOP_P = 0.95


@dataclass(frozen=True, slots=True)
class Opener:
    """The first words of a self-written user turn; long: a document follows."""

    text: str
    long: bool = False


# How self-written user turns begin, cycled by seed: the target writes the rest. Free turns
# alone are mostly small talk and short questions; these openings spread the data over the
# kinds of requests a served model gets (writing, role play, reasoning, math, code, extraction,
# explanations, translation, and long documents to summarize or answer from), without taking
# any benchmark prompt. A long opening's turn may run to LONG_TURN_TOKENS and is kept even when
# cut there (the request comes first, the document after it).
TASK_OPENERS = (
    Opener(""), Opener(""), Opener(""),
    Opener("Write a short story about"), Opener("Write a blog post about"), Opener("Write an email to"),
    Opener("Imagine you are"), Opener("Pretend to be"),
    Opener("Solve this problem step by step:"), Opener("A store sells"), Opener("If a train"),
    Opener("Write a Python function that"), Opener("How do I"),
    Opener("Explain"), Opener("What is the difference between"), Opener("Why do"), Opener("Compare"),
    Opener("List"), Opener("Give me three tips for"), Opener("What are the main causes of"),
    Opener("Translate the following sentence into French:"), Opener("Translate German to English:"),
    Opener("Summarize the following article in a few sentences.\n\n", long=True),
    Opener("Read the text below and answer the question at the end.\n\n", long=True),
    Opener("Extract the names, dates and places mentioned in this text:\n\n", long=True),
)
LONG_TURN_TOKENS = 384
USER_TURNS = "task-openers-1"  # names TASK_OPENERS' current list in a data cache's data.json


def read_prompt_file(path: str | Path) -> list[list[dict]]:
    """JSONL rows {"messages": [{"role": ..., "content": ...}, ...]}, or a prompt under "prompt",
    "turns" (the first turn) or "text" (the benchmarks' rule: bench/workload.py's AUTO_FIELDS)
    -> conversations to answer. Refuses Spec-Bench itself and drops rows whose user text is a
    Spec-Bench prompt."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise InvalidParameterError("prompts", str(path), "must be an existing JSONL file")
    bench = spec_bench_path()
    if bench.is_file() and path.resolve() == bench.resolve():
        raise InvalidParameterError("prompts", str(path), "is Spec-Bench, the benchmark; train on other prompts")
    conversations = []
    for n, row in read_jsonl(path):
        if isinstance(row, dict) and isinstance(row.get("messages"), list) and row["messages"]:
            conversations.append(row["messages"])
            continue
        text = next((t for k in ("turns", "prompt", "text") if isinstance(row, dict) and k in row
                     for t in [first_turn(row[k])] if t is not None), None)
        if text is None:
            raise InvalidParameterError("prompts", str(path), f'line {n} has no "messages" list and no prompt under '
                                        '"turns", "prompt" or "text"')
        conversations.append([{"role": "user", "content": text}])
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
    """One user turn per seed: TASK_OPENERS[seed % len] followed by what the target samples
    after it (from its template's user-turn prefix), at a temperature chosen by the seed. Short
    turns that do not end by themselves within max_tokens (rambling) or that are empty are
    dropped, so fewer may come back; long-form ones run to LONG_TURN_TOKENS and are kept."""
    prefix = user_turn_prefix(llm.tokenizer)
    openers = [TASK_OPENERS[s % len(TASK_OPENERS)] for s in seeds]
    prompts = [prefix + (llm.tokenizer.encode(o.text, add_special_tokens=False) if o.text else []) for o in openers]
    params = [SamplingParams(temperature=PROMPT_TEMPERATURES[(s // len(TASK_OPENERS)) % len(PROMPT_TEMPERATURES)],
                             top_p=PROMPT_TOP_P, max_tokens=max(max_tokens, LONG_TURN_TOKENS) if o.long else max_tokens,
                             seed=s) for s, o in zip(seeds, openers)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    bench = spec_bench_texts()
    texts = []
    for o, out in zip(openers, outs):
        written = out.outputs[0]
        if not (o.long or written.finish_reason == "stop"):
            continue
        body = written.text.strip()
        text = (o.text + (" " if o.text and not o.text.endswith("\n") else "") + body).strip() if body else ""
        if text and text not in bench:
            texts.append(text)
    return texts
