"""EAGLE-3's target states, recomputed from token ids: teacher-forced prefill passes of the
target that capture the residual streams entering its low, middle and high layers, and, for
training toward the target's probabilities (`--targets probs`), its final hidden states (the
LM head's input).

Kept next to the token shards as features-NNNNN.safetensors ("states" [sum T, 3 Ht] and
"final" [sum T, Ht] float16, one file per shard, written under a temporary name and renamed),
a cache that can be deleted at any time: it is remade from the tokens, which are what a data
set keeps."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specserve.errors import SpecserveError
from specserve.model.loader import LoadedModel
from specserve.model.runner import ForwardBatch, ModelRunner
from specserve.train.data import STORE_DTYPE, Recorded

# Tokens per prefill pass: long enough that the weights are read once for many rows, short
# enough that the dense cache of the pass stays small; an accelerator takes 16x as many (its
# per-pass launch costs are what a small pass would pay for).
PASS_TOKENS = 4096
ACCELERATOR_PASS_TOKENS = 16 * PASS_TOKENS


def features_path(shard: Path) -> Path:
    return shard.with_name(shard.name.replace("shard-", "features-"))


@torch.inference_mode()
def capture_states(target: LoadedModel, sequences: list[list[int]], layers: tuple[int, ...],
                   progress: Callable[[int], object] | None = None,
                   final: bool = False) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
    """Per sequence the residual streams entering `layers` [T_i, len(layers) * H] float16, and
    with `final` its final hidden states [T_i, H] float16 (else None); progress(n) after each
    pass, n its sequences (a shard takes minutes on a CPU)."""
    out: list[torch.Tensor] = []
    finals: list[torch.Tensor] = []
    group: list[list[int]] = []

    def flush() -> None:
        if not group:
            return
        runner = ModelRunner.dense(target.model, len(group), max(len(s) for s in group))
        hidden, aux = runner.states(ForwardBatch(list(range(len(group))), [0] * len(group), group, all_logits=False,
                                                 keep_hidden=True, aux_layers=layers))
        out.extend(h.to("cpu", STORE_DTYPE) for h in aux)
        if final:
            finals.extend(h.to("cpu", STORE_DTYPE) for h in hidden)
        if progress is not None:
            progress(len(group))
        group.clear()

    limit = PASS_TOKENS if target.model.device.type == "cpu" else ACCELERATOR_PASS_TOKENS
    for seq in sequences:
        if group and (len(group) + 1) * max(len(seq), *(len(s) for s in group)) > limit:
            flush()
        group.append(list(seq))
    flush()
    return out, finals if final else None


def attach_states(target: LoadedModel, data: Recorded, shards: list[Path], layers: tuple[int, ...],
                  final: bool = False) -> None:
    """Fill data.features with every sequence's captured states (and data.finals with its final
    hidden states, with `final`), shard by shard (data holds the shards' sequences in order, as
    load_data reads them), computing the missing files."""
    counts = [len(load_file(str(s))["offsets"]) - 1 for s in shards]
    if sum(counts) != len(data):
        raise SpecserveError(f"the data holds {len(data)} sequences, its shards {sum(counts)}")
    data.features.clear()
    data.finals.clear()
    first = 0
    todo = [i for i, s in enumerate(shards) if not _readable(features_path(s), layers, final)]
    bar = tqdm(total=sum(counts[i] for i in todo), desc="recomputing target states", unit="seq")
    for i, shard in enumerate(shards):
        seqs = range(first, first + counts[i])
        path = features_path(shard)
        if i in todo:
            states, finals = capture_states(target, [data.tokens[j].tolist() for j in seqs], layers, bar.update, final)
            tensors = {"states": torch.cat(states) if states else torch.zeros(0, 3, dtype=STORE_DTYPE)}
            if finals is not None:
                tensors["final"] = torch.cat(finals) if finals else torch.zeros(0, 1, dtype=STORE_DTYPE)
            tmp = path.with_suffix(".tmp")
            save_file(tensors, str(tmp), metadata={"layers": ",".join(map(str, layers))})
            os.replace(tmp, path)
        else:
            # Only what the run reads: an argmax run leaves a file's final states on disk.
            with safe_open(str(path), "pt") as f:
                flat = f.get_tensor("states")
                flat_final = f.get_tensor("final") if final else None
            lengths = [len(data.tokens[j]) for j in seqs]
            if flat.shape[0] != sum(lengths):
                raise SpecserveError(f"{path} does not match its shard; delete it and run again")
            states = list(flat.split(lengths))
            finals = list(flat_final.split(lengths)) if final else None
        data.features.extend(states)
        if final:
            data.finals.extend(finals)
        first += counts[i]
    bar.close()


def _readable(path: Path, layers: tuple[int, ...], final: bool) -> bool:
    """A features file exists, was captured at `layers`, and holds final states where asked."""
    if not path.is_file():
        return False
    try:
        with safe_open(str(path), "pt") as f:
            return (f.metadata() or {}).get("layers") == ",".join(map(str, layers)) and (not final or "final" in f.keys())
    except (SafetensorError, OSError):
        return False
