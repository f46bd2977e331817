"""The attention interface every model layer goes through, and the dense KV cache behind it.

A model layer never owns its cache: it hands (q, k, v) for the tokens of this step to
`KVCache.attend`, which stores k/v at the tokens' positions and attends over everything the
request has computed so far. Rolling back rejected draft tokens is therefore only a change of
the request's computed length: stale entries past it are never read, because a query at
position p only sees keys at positions <= p, all of which were (re)written by then.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

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
    scale: float | None = None  # scores are q.k * scale; None: head_dim ** -0.5 (the model's, layer_inputs)
    softcap: float | None = None  # scores -> softcap * tanh(scores / softcap) (Gemma 2); None: none


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
              scale: float | None = None, softcap: float | None = None) -> torch.Tensor:
    """The attention every cache ends in. q: [B, T, H, D]; keys, values: [B, Hkv, S, D] (views
    are fine); mask: additive [B, 1, T, S] or None; scale: None for D ** -0.5; softcap: None,
    or the cap of the scores (before the mask) -> [B, T, H * D]."""
    bsz, t, h, d = q.shape
    if softcap is not None:
        out = _capped_attention(q.transpose(1, 2), keys, values, mask, d ** -0.5 if scale is None else scale, softcap)
    else:
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=mask, enable_gqa=keys.shape[1] != h, scale=scale,
        )  # [B, H, T, D]
    if t == 1:  # [B, H, 1, D] is already laid out as [B, 1, H * D]
        return out.reshape(bsz, 1, h * d)
    return out.transpose(1, 2).reshape(bsz, t, h * d)


def _capped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      scale: float, cap: float) -> torch.Tensor:
    """Soft-capped attention, which SDPA cannot compute, as Gemma 2's reference does: scores in
    the model dtype, capped, masked, softmax in float32. q [B, H, T, D]; keys, values
    [B, Hkv, S, D] -> [B, H, T, D]."""
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
    scores = torch.tanh(torch.matmul(q, keys.transpose(2, 3)) * scale / cap) * cap  # [B, H, T, S]
    if mask is not None:
        scores = scores + mask
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


def window_mask(mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor, window: int,
                dtype: torch.dtype) -> torch.Tensor:
    """The additive mask [B, 1, T, S] of a windowed layer: the keys `mask` lets a query see
    (every key where None) whose position lies within `window` of the query's, key position >
    query position - window. q_pos [B, T]; k_pos [B, S] (or [1, S])."""
    near = (k_pos[:, None, None, :] > q_pos[:, None, :, None] - window)  # [B, 1, T, S]
    seen = near if mask is None else near & (mask == 0)
    return torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill_(~seen, float("-inf"))


def windowed_metadata(meta, window: int, dtype: torch.dtype):
    """The metadata of a padded pass (a dense or paged cache's) as its windowed layers read
    it: masks cut to the window (window_mask); key s sits at position s, or where a paged
    pass's token tree puts it (`key_positions`, tests/paged_reference.py). dtype: the cache's."""
    s = meta.context_len
    k_pos = getattr(meta, "key_positions", None)
    if k_pos is None:
        k_pos = torch.arange(s, device=meta.positions.device)[None]
    mask = window_mask(meta.mask, meta.positions, k_pos, window, dtype)
    groups = getattr(meta, "groups", None)
    if groups is not None:
        groups = [replace(g, mask=mask[g.rows, :, :, :g.context_len]) for g in groups]
        return replace(meta, mask=mask, groups=groups)
    return replace(meta, mask=mask)


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
        return attention(q, keys, values, meta.mask, meta.scale, meta.softcap)
