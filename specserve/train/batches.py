"""Held-out split, draft vocabulary, and length-bucketed batches of recorded sequences."""

from __future__ import annotations

import torch

from specserve.train.data import Recorded
from specserve.train.objectives import SequenceBatch

# Sequences are shuffled, then sorted by length within windows of this many, so a batch pads
# little and its members still change every epoch.
_SORT_WINDOW = 64


def split(n: int, held_out: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sequence indices: a seeded fraction held back, at least one of each
    when there are two or more sequences."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    k = min(max(1, round(held_out * n)), n - 1) if n > 1 else 0
    return sorted(order[k:]), sorted(order[:k])


def answer_mask(length: int, prompt_len: int) -> torch.Tensor:
    """[length] bool: label positions trained and scored on, prompt_len - 1 <= p <= length - 2
    (the predictions of the answer's tokens)."""
    p = torch.arange(length)
    return (p >= prompt_len - 1) & (p <= length - 2)


def _answer_label_counts(data: Recorded, indices: list[int], vocab_size: int) -> torch.Tensor:
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for i in indices:
        lab = data.labels[i][answer_mask(len(data.labels[i]), data.prompt_lens[i])]
        counts += torch.bincount(lab, minlength=vocab_size)
    return counts  # [V]


def choose_draft_vocab(data: Recorded, indices: list[int], size: int, vocab_size: int,
                       always: frozenset[int]) -> torch.Tensor:
    """The `size` tokens the target chooses most often in the answers of `indices`, plus
    `always` (e.g. the end-of-turn tokens) -> ids [Vd] int64. size >= vocab_size: every token."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    score = _answer_label_counts(data, indices, vocab_size).double()
    score[list(always)] = float("inf")
    return score.argsort(descending=True, stable=True)[:size]


def vocab_coverage(data: Recorded, indices: list[int], ids: torch.Tensor, vocab_size: int) -> float:
    """Fraction of the target's answer tokens in `indices` that the draft vocabulary holds."""
    counts = _answer_label_counts(data, indices, vocab_size)
    return float(counts[ids.cpu()].sum()) / max(1, int(counts.sum()))


def vocab_index(draft_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int64: the draft-vocabulary row of each target token, -1 for tokens outside it."""
    index = torch.full((vocab_size,), -1, dtype=torch.int64)
    index[draft_ids.cpu()] = torch.arange(len(draft_ids))
    return index


def make_batches(data: Recorded, indices: list[int], tokens_per_batch: int, seed: int) -> list[list[int]]:
    """Shuffled batches whose padded size (rows x longest) stays within tokens_per_batch (a
    longer sequence goes alone)."""
    order = [indices[i] for i in torch.randperm(len(indices), generator=torch.Generator().manual_seed(seed))]
    batches: list[list[int]] = []
    for w in range(0, len(order), _SORT_WINDOW):
        window = sorted(order[w:w + _SORT_WINDOW], key=lambda i: len(data.tokens[i]))
        batch: list[int] = []
        for i in window:
            if batch and (len(batch) + 1) * len(data.tokens[i]) > tokens_per_batch:
                batches.append(batch)
                batch = []
            batch.append(i)
        if batch:
            batches.append(batch)
    perm = torch.randperm(len(batches), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    return [batches[i] for i in perm]


def collate(data: Recorded, batch: list[int], depth: int, index: torch.Tensor, device: torch.device,
            finals: bool = False) -> SequenceBatch:
    """Pad the sequences to the longest plus `depth` (see SequenceBatch); with `finals` the
    batch carries the target's final hidden states too (data.finals)."""
    width = max(len(data.tokens[i]) for i in batch) + depth
    first = data.features[batch[0]]
    tokens = torch.zeros(len(batch), width, dtype=torch.int64)
    # Padded in the stored dtype (float16: half the bytes to write and to move to an
    # accelerator), widened to float32 where the batch lands.
    features = torch.zeros(len(batch), width, first.shape[1], dtype=first.dtype)
    labels = torch.full((len(batch), width), -1, dtype=torch.int64)
    valid = torch.zeros(len(batch), width, dtype=torch.bool)
    final = torch.zeros(len(batch), width, data.finals[batch[0]].shape[1], dtype=first.dtype) if finals else None
    for row, i in enumerate(batch):
        n = len(data.tokens[i])
        tokens[row, :n] = data.tokens[i]
        features[row, :n] = data.features[i]
        if final is not None:
            final[row, :n] = data.finals[i]
        labels[row, :n] = index[data.labels[i]]
        valid[row, :n] = answer_mask(n, data.prompt_lens[i])
    return SequenceBatch(tokens.to(device), features.to(device).float(), labels.to(device), valid.to(device), depth,
                         None if final is None else final.to(device).float())
