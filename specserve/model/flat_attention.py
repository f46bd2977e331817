"""Attention over the flattened tokens of one pass (a FlatBatch), on the torch path.

The native model's semantics (specserve/native/csrc/layer_ops.h, AttentionBatch): token n of
request i writes its key and value at cache row slots[n], then sees its request's slots
[0, prefix_len[n]) through the request's block table and, for a tree token, the tree nodes its
mask row allows. The linear layers run on the [N, hidden] tokens as they are; only attention
needs rectangles, so requests attend in groups, each a [Bg, Tg] query block over [Bg, Sg] keys
gathered from the pool, padded to the group's longest query and context.

Which requests share a group is a cost question (`group_requests`): on a CPU, SDPA's time grows
with query rows x keys even at one query token (measured, 2 threads, 9 heads over 3 kv heads,
head_dim 64, 16 requests at 200 keys: 0.30 / 0.66 / 0.90 / 2.2 / 7.6 ms per layer at 1 / 2 / 5 /
17 / 64 query tokens), so a decode must not be padded to a prompt chunk's length, and a
short context not to the longest one; each extra group costs a few small ops per layer.

Everything about the batch's shape is computed once per pass on the host (`flat_metadata`) and
moved to the device in one transfer per dtype; a layer's `attend` is then one scatter of the
pass's keys and values, and per group a gather, SDPA and a scatter of the outputs. (Folding
the query heads that share a kv head into query rows of a 1-token group, instead of SDPA's GQA
broadcast, measured no faster in whole passes: 16 and 64 decodes at 200 keys.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specserve.model.attention import attention
from specserve.model.flat_batch import FlatBatch

# Rows whose contexts lie within a factor 2 of the group's longest share one attention call (a
# row then reads at most twice the keys it needs); contexts up to this many tokens count as this
# many, so that short rows do not split into many small calls.
_GROUP_MIN_CONTEXT = 256
# Grouping is used only when it reads at most this fraction of the keys one padded call reads:
# each extra group costs a few small ops per layer.
_GROUP_MAX_COST = 0.75


def group_rows(contexts: list[int]) -> list[list[int]] | None:
    """Batch rows (by their context lengths) -> groups of rows to attend together, longest
    contexts first; None when one call over all rows is as good. Reading keys is what costs on
    a CPU: a batch of 64 rows at ~150 tokens and a few at ~600 reads 600 keys per row in one call."""
    order = sorted(range(len(contexts)), key=lambda i: -contexts[i])
    groups: list[list[int]] = []
    top = 0
    for i in order:
        if not groups or 2 * max(contexts[i], _GROUP_MIN_CONTEXT) < top:
            groups.append([])
            top = contexts[i]
        groups[-1].append(i)
    if len(groups) == 1:
        return None
    grouped = sum(len(g) * contexts[g[0]] for g in groups)
    return groups if grouped <= _GROUP_MAX_COST * len(contexts) * max(contexts) else None


# The attention cost model of group_requests, in units of one (query token, key) pair through
# SDPA (~0.035 us on the machine measured above): per request and key, whatever its query
# tokens (a 1-token SDPA costs about 3 pairs per key),
_KEY_COST = 2
# and per group (its gather, SDPA call and output scatter, ~60 us per layer). Checked in whole
# passes of the embedded model (float32, 2 threads): any value from 0 to 8000 gave the same
# times within noise on ragged verification, chain + decode and chunk + decode batches, while one
# group for all was slower (1 chain of 5 + 31 decodes: 334 against 245 ms; a 64-token chunk +
# 2 decodes: 161 against 140 ms).
_GROUP_COST = 2000
# Blocks up to this many rows are gathered whole (one index per block: faster than one per row,
# 246 against 365 us for 64 requests x 304 keys); larger ones, as a dense cache's slot mapped to
# one block, row by row, so that a request reads only its context.
_MAX_GATHER_BLOCK = 64


@dataclass(slots=True)
class FlatGroup:
    """Requests that attend in one SDPA call: Bg requests padded to Tg query tokens and Sg keys."""

    shape: tuple[int, int, int]  # (Bg, Tg, Sg)
    # [Bg * Tg] int64: the flat token each query row reads (padding rows repeat a real token of
    # their request); a slice when the rows are the tokens [a, b) in order, without padding.
    queries: torch.Tensor | slice
    # [Bg * Tg] int64: the output row each query row goes to, N (a trash row) for padding.
    outputs: torch.Tensor
    # [Bg * Ug] int64: the gather units (unit rows of the pool each) holding the requests' slots
    # [0, Ug * unit), in order; an int when Bg == 1 and its Sg rows are consecutive from that
    # row on: keys are then a view of the pool, not a gather.
    keys: torch.Tensor | int
    # [Bg, 1, Tg, Sg] additive in the cache dtype: 0 where the query sees the key, -inf elsewhere
    # (a padding row sees what its request's first token sees); None: every row sees every key.
    mask: torch.Tensor | None


@dataclass(slots=True)
class FlatAttentionMetadata:
    """Where the tokens of one flattened pass read and write; built once, used by every layer."""

    token_ids: torch.Tensor  # [N] int64 on the device
    positions: torch.Tensor  # [N] int64 RoPE positions (the model's rotary tables read them)
    slots: torch.Tensor  # [N] int64 cache row each token's key and value go to
    unit: int  # pool rows per gather unit: the block size when blocks are small, else 1
    groups: list[FlatGroup]
    # One group holds every token in order, unpadded: its output is the layer's as it is.
    whole: bool
    scale: float | None = None  # as AttentionMetadata's
    softcap: float | None = None


def group_requests(query_lens: list[int], contexts: list[int]) -> list[list[int]]:
    """Requests (their query tokens and the keys they read) -> groups that attend together,
    each in batch order.

    Modelled cost of a group: _GROUP_COST + Bg * Sg * (Tg + _KEY_COST). Requests of one query
    length form a class; walking the lengths from the longest down, a class joins the group
    before it when one group costs less than two (so a chain of 5 next to a lone decode shares
    its call, 16 decodes next to 16 chains do not, a 256-token chunk never pads decodes). A
    group of similar query lengths then splits by context as `group_rows` decides."""
    by_len: dict[int, list[int]] = {}
    for i in sorted(range(len(query_lens)), key=lambda i: -query_lens[i]):
        by_len.setdefault(query_lens[i], []).append(i)

    def cost(n: int, t: int, s: int) -> int:
        return _GROUP_COST + n * s * (t + _KEY_COST)

    merged: list[tuple[list[int], int, int]] = []  # (requests, longest query, longest context)
    for t, members in by_len.items():
        s = max(contexts[i] for i in members)
        if merged:
            prev, pt, ps = merged[-1]
            if cost(len(prev) + len(members), pt, max(ps, s)) <= cost(len(prev), pt, ps) + cost(len(members), t, s):
                merged[-1] = (prev + members, pt, max(ps, s))
                continue
        merged.append((members, t, s))
    groups = []
    for members, _, _ in merged:
        split = group_rows([contexts[i] for i in members])
        parts = [members] if split is None else [[members[j] for j in part] for part in split]
        groups += [sorted(p) for p in parts]
    return groups


def flat_metadata(flat: FlatBatch, device: torch.device, dtype: torch.dtype,
                  window: int | None = None) -> FlatAttentionMetadata:
    """The pass's groups and index tensors, from a FlatBatch whose tensors live on the host.
    `dtype`: the cache's (masks are added to its scores). `window`: as a windowed layer sees
    the keys, only those at positions above the query's position - window."""
    q_start = flat.q_start.tolist()
    lens = [b - a for a, b in zip(q_start, q_start[1:])]
    request = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))  # [N]
    # Keys a request reads: up to its longest causal prefix and, for a tree, its last node.
    context = torch.zeros(len(lens), dtype=torch.long).scatter_reduce_(0, request, flat.prefix_len, "amax")
    if flat.tree_row is not None:
        context = torch.maximum(context, flat.tree_start + flat.tree_size)
    contexts = context.tolist()
    unit = flat.block_size if flat.block_size <= _MAX_GATHER_BLOCK else 1
    groups = [_group(flat, members, lens, contexts, unit, dtype, window)
              for members in group_requests(lens, contexts)]
    whole = len(groups) == 1 and isinstance(groups[0].queries, slice)
    return _on_device(FlatAttentionMetadata(flat.token_ids, flat.positions, flat.slots, unit, groups, whole), device)


def _group(flat: FlatBatch, members: list[int], lens: list[int], contexts: list[int], unit: int,
           dtype: torch.dtype, window: int | None) -> FlatGroup:
    """The host tensors of one group of requests (`members`, in batch order)."""
    bs, n = flat.block_size, flat.num_tokens
    r = torch.tensor(members)
    bg, tg, sg = len(members), max(lens[i] for i in members), max(contexts[i] for i in members)
    offs = torch.arange(tg)
    first = flat.q_start[r][:, None]  # [Bg, 1] each request's first token
    valid = offs[None, :] < torch.tensor([lens[i] for i in members])[:, None]  # [Bg, Tg]
    tokens = torch.where(valid, first + offs, first)  # [Bg, Tg]: padding repeats the first token
    queries: torch.Tensor | slice = tokens.reshape(-1)
    if bool(valid.all()) and members == list(range(members[0], members[-1] + 1)):
        queries = slice(int(flat.q_start[members[0]]), int(flat.q_start[members[-1] + 1]))

    first_slot = torch.arange(-(-sg // unit)) * unit  # [Ug] each gather unit's first slot
    rows = flat.block_table[r][:, first_slot // bs] * bs + first_slot % bs  # [Bg, Ug] its pool row
    units = rows // unit
    keys: torch.Tensor | int = units.reshape(-1)
    if bg == 1 and bool((units[0, 1:] - units[0, :-1] == 1).all()):
        keys = int(rows[0, 0])

    visible = torch.arange(sg)[None, None, :] < flat.prefix_len[tokens][:, :, None]  # [Bg, Tg, Sg]
    if flat.tree_row is not None:
        row = flat.tree_row[tokens][:, :, None]  # [Bg, Tg, 1] offset of the token's mask row, -1: none
        rel = torch.arange(sg)[None, :] - flat.tree_start[r][:, None]  # [Bg, Sg] tree node at each key
        inside = (row >= 0) & (rel >= 0)[:, None] & (rel < flat.tree_size[r][:, None])[:, None]
        seen = flat.tree_mask[(row + rel[:, None]).clamp_(0, flat.tree_mask.numel() - 1)].bool()
        visible |= inside & seen
    if window is not None:
        visible &= _key_positions(flat, r, sg)[:, None, :] > flat.positions[tokens][:, :, None] - window
    mask = None
    if not bool(visible.all()):
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf")).unsqueeze(1)
    return FlatGroup((bg, tg, sg), queries, torch.where(valid, tokens, n).reshape(-1), keys, mask)


def _key_positions(flat: FlatBatch, r: torch.Tensor, sg: int) -> torch.Tensor:
    """[Bg, Sg] the position of each key of requests `r`: slot s holds position s, but for a
    token tree's node m (slot tree_start + m), the position of the request's query token m."""
    keys = torch.arange(sg).repeat(len(r), 1)
    if flat.tree_row is None:
        return keys
    rel = keys - flat.tree_start[r][:, None]  # [Bg, Sg] tree node at each key
    node = (rel >= 0) & (rel < flat.tree_size[r][:, None])
    token = (flat.q_start[r][:, None] + rel).clamp_(0, flat.num_tokens - 1)
    return torch.where(node, flat.positions[token], keys)


def _on_device(meta: FlatAttentionMetadata, device: torch.device) -> FlatAttentionMetadata:
    """`meta` with its tensors moved to `device`: one transfer of the int64 ones, one of the masks."""
    if meta.token_ids.device == device:
        return meta
    longs = [meta.token_ids, meta.positions, meta.slots]
    longs += [t for g in meta.groups for t in (g.queries, g.outputs, g.keys) if isinstance(t, torch.Tensor)]
    moved = iter(_transfer(longs, device))
    masks = iter(_transfer([g.mask for g in meta.groups if g.mask is not None], device))
    take = lambda t: next(moved) if isinstance(t, torch.Tensor) else t  # noqa: E731  (in the order of longs)
    ids, positions, slots = next(moved), next(moved), next(moved)
    groups = [FlatGroup(g.shape, take(g.queries), take(g.outputs), take(g.keys),
                        None if g.mask is None else next(masks)) for g in meta.groups]
    return FlatAttentionMetadata(ids, positions, slots, meta.unit, groups, meta.whole)


def _transfer(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Tensors of one dtype, moved to `device` as one."""
    if not tensors:
        return []
    moved = torch.cat([t.reshape(-1) for t in tensors]).to(device).split([t.numel() for t in tensors])
    return [m.view(t.shape) for m, t in zip(moved, tensors)]


class GatherBuffers:
    """Gathered keys and values of one group, kept across groups, layers and passes: a fresh
    tensor of several MB is page-faulted in at every call (measured on CPU, 1 thread, 64 rows x 304 keys: 1.6 ms against 11.2 per gather)."""

    def __init__(self):
        self._flat: list[torch.Tensor | None] = [None, None]  # 0: keys, 1: values; 1-d, grown

    def get(self, which: int, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        """A tensor of `shape` in `like`'s dtype and device, valid until the next call for the
        same buffer (which: 0 keys, 1 values)."""
        need = math.prod(shape)
        buf = self._flat[which]
        if buf is None or buf.dtype != like.dtype or buf.device != like.device or buf.numel() < need:
            grown = need if buf is None else max(need, 2 * buf.numel())
            buf = self._flat[which] = like.new_empty(grown)
        return buf[:need].view(shape)


class FlatKV:
    """The cache pools as one pass sees them, behind the layers' `attend(layer, q, k, v, meta)`.

    k, v: [num_layers, rows, Hkv, D] (views of the pools by cache row)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor, buffers: GatherBuffers):
        self.k, self.v, self.buffers = k, v, buffers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: FlatAttentionMetadata) -> torch.Tensor:
        """q: [N, H, D]; k, v: [N, Hkv, D] -> attention output [N, H * D]."""
        pool_k, pool_v = self.k[layer], self.v[layer]  # [rows, Hkv, D]
        pool_k.index_copy_(0, meta.slots, k)
        pool_v.index_copy_(0, meta.slots, v)
        if meta.whole:
            return self._group(q, pool_k, pool_v, meta.groups[0], meta).reshape(q.shape[0], -1)
        out = q.new_empty(q.shape[0] + 1, q.shape[1] * q.shape[2])  # row N: padding's trash
        for g in meta.groups:
            out.index_copy_(0, g.outputs, self._group(q, pool_k, pool_v, g, meta).flatten(0, 1))
        return out[:-1]

    def _group(self, q: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor, g: FlatGroup,
               meta: FlatAttentionMetadata) -> torch.Tensor:
        """One group's attention -> [Bg, Tg, H * D]."""
        unit = meta.unit
        bg, tg, sg = g.shape
        rows = q[g.queries] if isinstance(g.queries, slice) else q.index_select(0, g.queries)
        qg = rows.unflatten(0, (bg, tg))  # [Bg, Tg, H, D]
        if isinstance(g.keys, int):
            keys = pool_k[g.keys:g.keys + sg].unsqueeze(0)  # [1, Sg, Hkv, D] views
            values = pool_v[g.keys:g.keys + sg].unsqueeze(0)
        else:
            shape = (g.keys.shape[0], unit, *pool_k.shape[1:])  # [Bg * Ug, unit, Hkv, D]
            keys = torch.index_select(pool_k.view(-1, *shape[1:]), 0, g.keys, out=self.buffers.get(0, shape, pool_k))
            values = torch.index_select(pool_v.view(-1, *shape[1:]), 0, g.keys, out=self.buffers.get(1, shape, pool_v))
            keys = keys.view(bg, -1, *shape[2:])[:, :sg]  # [Bg, Sg, Hkv, D]
            values = values.view(bg, -1, *shape[2:])[:, :sg]
        return attention(qg, keys.transpose(1, 2), values.transpose(1, 2), g.mask, meta.scale, meta.softcap)
