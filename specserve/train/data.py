"""Self-distillation data: the target answers prompts, then one forward pass per sequence
records its final hidden states and greedy choices. Kept on disk in shards of one chunk of
prompts each, so an interrupted run resumes at the first missing shard.

EAGLE-3 data keeps token ids only (`DataPlan.record` off: ~4 bytes a token, small enough to keep
with a project): its three captured target states per token (3 x 576 halves on the embedded
model, ~3.4 kB) are recomputed teacher-forced in batched prefill passes when training starts
(train/features.py), which costs less than a decode step per token does to answer. Its
answers come from the target as it serves (the native kernels on a quantized GGUF), so the
states it trains on are those it drafts from, and the labels are the answer's own next tokens:
the target's greedy choices, by batch invariance the same bits as a pass over the sequence."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specserve.errors import InvalidParameterError, SpecserveError
from specserve.llm import LLM
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.model.loader import LoadedModel
from specserve.sampling_params import SamplingParams
from specserve.spec.heads import TargetIdentity
from specserve.train.batch_generate import BatchGenerator
from specserve.train.prompts import LONG_TURN_TOKENS, USER_TURNS, write_user_turns

# Hidden states are stored in float16: half the disk and memory of float32, 11 bits of
# mantissa (bfloat16 keeps 8), and the final norm keeps them far inside its range.
STORE_DTYPE = torch.float16
# Longer prompts (from a --prompts file) are left out: they cost the most and add few answers.
MAX_PROMPT_TOKENS = 1024


DATA_FILE = "data.json"  # what a cache holds, so that runs with the same data settings share it


@dataclass(frozen=True, slots=True)
class DataPlan:
    prompts: str | None  # the JSONL the prompts come from; None: user turns the target writes
    num_prompts: int  # prompts to answer (self-written ones that ramble are dropped, so fewer may remain)
    max_new_tokens: int  # answer length cap
    seed: int
    prompt_max_tokens: int  # cap of a self-written user turn
    chunk_size: int  # prompts per shard, answered together by one batched engine
    user_turns: str = USER_TURNS  # how self-written user turns begin (a cache made otherwise is refused)
    record: bool = True  # False: token ids only (EAGLE-3; see the module note)
    # Who answers: "engine" (the batched engine, as it serves) or "batch" (train/batch_generate.py:
    # a chunk as one dense batch, for accelerators). Their sampled user turns differ, so a cache
    # holds one generator's data.
    generator: str = "engine"


@dataclass(slots=True)
class Recorded:
    """Every recorded sequence (prompt + answer), in shard order."""

    tokens: list[torch.Tensor]  # [T] int64 each
    # [T, H] float16: the target's final hidden states (EAGLE-3: [T, 3 H] captured states, once
    # train/features.py has recomputed them; empty until then)
    features: list[torch.Tensor]
    labels: list[torch.Tensor]  # [T] int64: the target's argmax at each position (full vocabulary)
    prompt_lens: list[int]
    # EAGLE-3 trained toward the target's probabilities: [T, H] float16 final hidden states
    # (the LM head's input) per sequence, once train/features.py has recomputed them; else empty
    finals: list[torch.Tensor] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.tokens)

    def num_answer_tokens(self, indices: list[int]) -> int:
        return sum(len(self.tokens[i]) - self.prompt_lens[i] for i in indices)


def shard_path(cache: Path, chunk: int) -> Path:
    return cache / f"shard-{chunk:05d}.safetensors"


def build_data(target: LoadedModel, plan: DataPlan, conversations: list[list[dict]] | None,
               cache: Path, seconds: float | None = None) -> list[Path]:
    """Answer and record every chunk whose shard is missing; -> all shard paths, in order.
    conversations None: the target writes the user turns itself. Prompts longer than
    MAX_PROMPT_TOKENS are left out. seconds: no chunk is begun after that long (one always is);
    the shards made by then are returned, in order (a later run with the same cache makes the rest)."""
    t0 = time.perf_counter()
    cache.mkdir(parents=True, exist_ok=True)
    _claim(cache, plan, target)
    total = plan.num_prompts if conversations is None else min(plan.num_prompts, len(conversations))
    chunks = range(-(-total // plan.chunk_size))
    paths = [shard_path(cache, c) for c in chunks]
    todo = [c for c in chunks if not _complete(paths[c], min(plan.chunk_size, total - c * plan.chunk_size))]
    if todo:
        max_model_len = min(target.config.max_position_embeddings, MAX_PROMPT_TOKENS + plan.max_new_tokens)
        # A pool for a chunk of typical requests (a self-written prompt and a full answer); a
        # chunk of longer ones is preempted and recomputed in turns, with the same outputs.
        typical = -(-(max(plan.prompt_max_tokens, LONG_TURN_TOKENS) + 64 + plan.max_new_tokens) // 16)
        llm = BatchGenerator(target) if plan.generator == "batch" else LLM(
            loaded=target, max_model_len=max_model_len, max_num_seqs=plan.chunk_size, block_size=16,
            num_kv_blocks=max(plan.chunk_size * typical, -(-max_model_len // 16)))
        made: set[int] = set()
        bar = tqdm(todo, desc="answering and recording", unit="chunk", initial=len(chunks) - len(todo), total=len(chunks))
        for c in bar:
            if made and seconds is not None and time.perf_counter() - t0 > seconds:
                bar.close()
                done = [p for c, p in enumerate(paths) if c not in todo or c in made]
                print(f"data budget of {seconds:.0f}s spent: {len(done)} of {len(paths)} shards made "
                      f"(a run with the same cache makes the rest)")
                return done
            first = c * plan.chunk_size
            size = min(plan.chunk_size, total - first)
            if conversations is None:
                seeds = [plan.seed * 1_000_003 + first + i for i in range(size)]
                convs = [[{"role": "user", "content": t}] for t in write_user_turns(llm, seeds, plan.prompt_max_tokens)]
            else:
                convs = conversations[first:first + size]
            _record_chunk(llm, target, convs, plan, max_model_len, paths[c], size)
            made.add(c)
            bar.set_postfix_str(f"{paths[c].name}")
    return paths


def _complete(path: Path, size: int) -> bool:
    """A shard exists and was made for `size` prompts (one made as a short last chunk had fewer)."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            made = (f.metadata() or {}).get("prompts")
    except (SafetensorError, OSError):
        return False
    return made is None or int(made) >= size  # shards written before the count was kept are whole


def _claim(cache: Path, plan: DataPlan, target: LoadedModel) -> None:
    """Write the cache's data.json, or check that an existing one describes the same data."""
    want = {"target": target.name, "fingerprint": TargetIdentity.of(target).fingerprint, **dataclasses.asdict(plan)}
    path = cache / DATA_FILE
    if path.is_file():
        have = {"generator": "engine", **json.loads(path.read_text())}  # caches older than the choice
        # Chunk c's prompts depend on the seed and c alone, so a cache grows by asking for more
        # prompts (a last shard made short is answered again in full, see _complete).
        changed = sorted(k for k in want if have.get(k) != want[k] and k != "num_prompts")
        if changed:
            raise InvalidParameterError("cache", str(cache), f"holds data made with other settings ({', '.join(changed)})")
    else:
        path.write_text(json.dumps(want, indent=2) + "\n")


def _record_chunk(llm: LLM, target: LoadedModel, convs: list[list[dict]], plan: DataPlan, max_model_len: int,
                  path: Path, size: int) -> None:
    """Answer `convs` (what is left of the chunk's `size` prompts: self-written turns that
    ramble are dropped) and write the shard, which records `size` as its prompt count."""
    tok = target.tokenizer
    prompts = [tok.encode_chat(c) for c in convs]
    kept = [(c, p) for c, p in zip(convs, prompts) if len(p) + plan.max_new_tokens <= max_model_len]
    answers = llm.generate([p for _, p in kept], SamplingParams(temperature=0, max_tokens=plan.max_new_tokens),
                           use_tqdm=False) if kept else []
    seqs = [p + a.outputs[0].token_ids for (_, p), a in zip(kept, answers)]
    tokens, features, labels, offsets = [], [], [], [0]
    for seq in seqs:
        tokens.append(torch.tensor(seq, dtype=torch.int32))
        offsets.append(offsets[-1] + len(seq))
        if plan.record:
            f, lab = record_sequence(target, seq)
            features.append(f)
            labels.append(lab.to(torch.int32))
    h = target.config.hidden_size
    tensors = {
        "tokens": torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.int32),
        "offsets": torch.tensor(offsets, dtype=torch.int64),
        "prompt_lens": torch.tensor([len(p) for _, p in kept], dtype=torch.int64),
    }
    if plan.record:
        tensors["features"] = torch.cat(features) if features else torch.zeros(0, h, dtype=STORE_DTYPE)
        tensors["labels"] = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.int32)
    # Written under a temporary name and renamed: a shard that exists is complete.
    tmp = path.with_suffix(".tmp")
    save_file(tensors, str(tmp), metadata={"prompts": str(size)})
    path.with_suffix(".json").write_text(json.dumps(
        {"conversations": [c for c, _ in kept], "answers": [tok.decode(a.outputs[0].token_ids) for a in answers]},
        ensure_ascii=False) + "\n")
    os.replace(tmp, path)


@torch.inference_mode()
def record_sequence(target: LoadedModel, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One target forward over the sequence -> (final hidden states [T, H] float16, argmax [T] int64)."""
    runner = ModelRunner.dense(target.model, 1, len(token_ids))
    out = runner.forward(ForwardBatch([0], [0], [token_ids], all_logits=True, keep_hidden=True))
    return out.hidden[0].to("cpu", STORE_DTYPE), out.logits[0].argmax(-1).cpu()


def load_data(paths: list[Path]) -> Recorded:
    data = Recorded([], [], [], [])
    for path in paths:
        try:
            t = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise SpecserveError(f"cannot read the data shard {path} ({e}); delete it and run again with --resume") from None
        offsets = t["offsets"].tolist()
        for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
            tokens = t["tokens"][a:b].long()
            data.tokens.append(tokens)
            if "features" in t:
                data.features.append(t["features"][a:b])
                data.labels.append(t["labels"][a:b].long())
            else:  # token ids only: the labels are the next tokens (the last one has none: -1)
                data.labels.append(torch.cat([tokens[1:], tokens.new_full((1,), -1)]))
            data.prompt_lens.append(int(t["prompt_lens"][i]))
    if not data.tokens:
        raise SpecserveError("no sequences were recorded: every prompt was too long or dropped")
    return data
