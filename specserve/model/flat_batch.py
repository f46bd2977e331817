"""The tokens of one forward pass flattened, padding dropped: what the native kernels take.

Request i computes `query_lens[i]` tokens starting at position `start_positions[i]`, its
positions living in `block_tables[i]` (blocks of `block_size` cache rows). A dense cache is the
case of one block per request slot (block_size = the slot's stride). Tokens of a token tree
keep their written slot (start + j) but sit at position start + depth(j) and see the context
before start plus their ancestors (see specserve/native/csrc/layer_ops.h, AttentionBatch).
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch


@dataclass(slots=True)
class FlatBatch:
    token_ids: torch.Tensor  # [N] int64: every request's tokens, concatenated
    positions: torch.Tensor  # [N] int64: RoPE position of each token
    slots: torch.Tensor  # [N] int64: cache row each token's key and value go to (block * block_size + offset)
    q_start: torch.Tensor  # [B + 1] int64: request i owns tokens [q_start[i], q_start[i + 1])
    block_table: torch.Tensor  # [B, M] int64: each request's blocks, padded with its first block
    prefix_len: torch.Tensor  # [N] int64: a token sees its request's slots [0, prefix_len)
    block_size: int
    # Token trees (all None when no request has one): tree_row [N] int64 offset of a tree
    # token's mask row in tree_mask (-1: not a tree token); tree_start [B] first tree slot;
    # tree_size [B] nodes; tree_mask flat uint8 rows of tree_size bytes (1: sees that node).
    tree_row: torch.Tensor | None = None
    tree_start: torch.Tensor | None = None
    tree_size: torch.Tensor | None = None
    tree_mask: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.token_ids.shape[0]

    @property
    def ends(self) -> list[int]:
        """Each request's last token index."""
        return [e - 1 for e in self.q_start.tolist()[1:]]


def flat_batch(token_ids: list[list[int]], block_tables: list[list[int]], block_size: int,
               start_positions: list[int], tree_masks: list[torch.Tensor | None] | None = None) -> FlatBatch:
    lens = [len(t) for t in token_ids]
    if not lens or min(lens) < 1:
        raise ValueError(f"every request must compute at least one token, got query lengths {lens}")
    widest = max(len(t) for t in block_tables)
    positions: list[int] = []
    slots: list[int] = []
    prefix: list[int] = []
    has_tree = tree_masks is not None and any(m is not None for m in tree_masks)
    tree_row: list[int] = []
    tree_start: list[int] = []
    tree_size: list[int] = []
    mask_parts: list[torch.Tensor] = []
    mask_len = 0
    for i, (table, start, q) in enumerate(zip(block_tables, start_positions, lens)):
        if -(-(start + q) // block_size) > len(table):
            raise ValueError(f"request {i} reaches position {start + q - 1}, beyond its {len(table)} blocks")
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, start + q))
        mask = tree_masks[i] if tree_masks is not None else None
        if mask is None:
            positions.extend(range(start, start + q))
            prefix.extend(range(start + 1, start + q + 1))
            tree_row.extend([-1] * q)
            tree_start.append(start)
            tree_size.append(0)
            continue
        if mask.shape != (q, q):
            raise ValueError(f"request {i}: tree mask {tuple(mask.shape)} does not match its {q} tokens")
        depth = mask.sum(-1).tolist()  # ancestors including itself
        positions.extend(start + d - 1 for d in depth)
        prefix.extend([start] * q)
        tree_row.extend(range(mask_len, mask_len + q * q, q))
        tree_start.append(start)
        tree_size.append(q)
        mask_parts.append(mask.reshape(-1).to(torch.uint8))
        mask_len += q * q
    as_long = lambda v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    return FlatBatch(
        token_ids=as_long([t for toks in token_ids for t in toks]),
        positions=as_long(positions),
        slots=as_long(slots),
        q_start=as_long([0, *accumulate(lens)]),
        block_table=as_long([list(t) + [t[0]] * (widest - len(t)) for t in block_tables]),
        prefix_len=as_long(prefix),
        block_size=block_size,
        tree_row=as_long(tree_row) if has_tree else None,
        tree_start=as_long(tree_start) if has_tree else None,
        tree_size=as_long(tree_size) if has_tree else None,
        tree_mask=torch.cat(mask_parts) if has_tree else None,
    )
