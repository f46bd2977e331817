"""The attention interface every model layer goes through, and the dense KV cache behind it.

A model layer never owns its cache: it hands (q, k, v) for the tokens of this step to
`KVCache.attend`, which stores k/v at the tokens' positions and attends over everything the
request has computed so far. Rolling back rejected draft tokens is therefore only a change of
the request's computed length: stale entries past it are never read, because a query at
position p only sees keys at positions <= p, all of which were (re)written by then.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class AttentionMetadata:
    """Where the tokens of one forward pass sit. Batch rows are requests, padded to T tokens."""

    positions: torch.Tensor  # [B, T] int64: position of each query token (0 for padding)
    write_index: torch.Tensor  # [B * T] int64: flat cache row each token's k/v goes to (a trash row for padding)
    slot_ids: torch.Tensor  # [B] int64: cache slot of each request
    context_len: int  # keys [0, context_len) are read: max over requests of (last position + 1)
    # [B, 1, T, context_len] additive mask in the cache dtype: 0 where the query may see the
    # key, -inf elsewhere (SDPA would convert a bool mask to this in every layer); None when
    # every row sees all keys causally without help (a single request with one query token).
    mask: torch.Tensor | None
    single_slot: int | None  # the slot when B == 1, so that reads are views, not gathers


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """The attention both caches end in. q: [B, T, H, D]; keys, values: [B, Hkv, S, D] (views
    are fine); mask: additive [B, 1, T, S] or None -> [B, T, H * D]."""
    bsz, t, h, d = q.shape
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != h,
    )  # [B, H, T, D]
    if t == 1:  # [B, H, 1, D] is already laid out as [B, 1, H * D]
        return out.reshape(bsz, 1, h * d)
    return out.transpose(1, 2).reshape(bsz, t, h * d)


class DenseKVCache:
    """One contiguous [max_len] K/V strip per slot, for every layer.

    k, v: [num_layers, num_slots * (max_len + 1), num_kv_heads, head_dim]. Row max_len of each
    slot is a trash row that padding tokens write into and nothing ever reads.
    """

    def __init__(self, num_layers: int, num_slots: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        self.num_slots, self.max_len = num_slots, max_len
        self.stride = max_len + 1
        shape = (num_layers, num_slots * self.stride, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Per-layer views [1, Hkv, rows, D], the layout attention reads, made once: at this
        # model size every view op of a step costs microseconds (see llama.py).
        self.k_heads = [kl.unsqueeze(0).transpose(1, 2) for kl in self.k]
        self.v_heads = [vl.unsqueeze(0).transpose(1, 2) for vl in self.v]

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def metadata(self, slot_ids: list[int], start_positions: list[int], query_lens: list[int]) -> AttentionMetadata:
        """Metadata for requests that compute `query_lens[i]` tokens starting at position
        `start_positions[i]` (the request's computed length) in cache slot `slot_ids[i]`."""
        device = self.k.device
        bsz, t = len(slot_ids), max(query_lens)
        offs = torch.arange(t)
        start = torch.tensor(start_positions)[:, None]
        qlen = torch.tensor(query_lens)[:, None]
        valid = offs[None, :] < qlen  # [B, T]
        positions = torch.where(valid, start + offs[None, :], 0)  # [B, T]
        slots = torch.tensor(slot_ids)[:, None]
        write = torch.where(valid, slots * self.stride + positions, slots * self.stride + self.max_len)
        context_len = max(s + q for s, q in zip(start_positions, query_lens))
        if context_len > self.max_len:
            raise ValueError(f"context of {context_len} tokens exceeds the cache length {self.max_len}")
        mask = None
        if bsz > 1 or t > 1:
            keys = torch.arange(context_len)
            visible = (keys[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, S]
            mask = torch.zeros(visible.shape, dtype=self.k.dtype).masked_fill_(~visible, float("-inf")).to(device)
        return AttentionMetadata(
            positions=positions.to(device),
            write_index=write.reshape(-1).to(device),
            slot_ids=torch.tensor(slot_ids, device=device),
            context_len=context_len,
            mask=mask,
            single_slot=slot_ids[0] if bsz == 1 else None,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: AttentionMetadata) -> torch.Tensor:
        """q: [B, T, H, D]; k, v: [B, T, Hkv, D] -> attention output [B, T, H * D]."""
        bsz, t = q.shape[:2]
        self.k[layer].index_copy_(0, meta.write_index, k.reshape(bsz * t, *k.shape[2:]))
        self.v[layer].index_copy_(0, meta.write_index, v.reshape(bsz * t, *v.shape[2:]))
        s = meta.context_len
        if meta.single_slot is not None:
            base = meta.single_slot * self.stride
            keys = self.k_heads[layer][:, :, base:base + s]  # [1, Hkv, S, D] view
            values = self.v_heads[layer][:, :, base:base + s]
        else:
            rows = meta.slot_ids[:, None] * self.stride + torch.arange(s, device=q.device)[None, :]
            keys, values = self.k[layer][rows].transpose(1, 2), self.v[layer][rows].transpose(1, 2)  # [B, Hkv, S, D]
        return attention(q, keys, values, meta.mask)
