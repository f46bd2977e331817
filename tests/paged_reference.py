"""The padded per-request paged attention the engine ran before the flat path (model/
flat_attention.py) replaced it: requests as rows padded to the longest query and context, keys
gathered block by block, one SDPA call per group of rows. Kept only as the tests' reference
for the flat path (tests/test_flat_attention.py) and for the pool's rollback and tree
semantics (tests/test_paged_attention.py); LlamaModel.forward runs over it as over the dense
cache (the same `attend(layer, q, k, v, meta)` interface)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.model.attention import attention
from specserve.model.flat_attention import group_rows
from specserve.model.paged_kv import PagedKVCache


@dataclass(slots=True)
class PagedAttentionMetadata:
    """Where the tokens of one forward pass sit. Batch rows are requests, padded to T tokens.

    `positions` means what it means in AttentionMetadata (the model's RoPE reads it)."""

    positions: torch.Tensor  # [B, T] int64: position of each query token (0 for padding; a tree node's: start + depth)
    # [B * T] int64: flat slot (block * block_size + offset) each token's k/v goes to; padding
    # goes to the trash block.
    write_index: torch.Tensor
    # [B, N] int64: each request's first N = ceil(context_len / block_size) blocks; a row that
    # needs fewer is padded with its own first block (gathered, then masked out).
    block_tables: torch.Tensor
    context_len: int  # keys [0, context_len) are read: max over requests of (last position + 1)
    # [B, 1, T, context_len] additive mask in the cache dtype: 0 where the query may see the
    # key, -inf elsewhere; None when a single request with one query token sees all keys.
    mask: torch.Tensor | None
    # When B == 1 and the request's N blocks are consecutive ids, the first of them: reads are
    # then views of the pool, not gathers. None otherwise.
    first_block: int | None
    # Rows of very different context lengths attend in groups, each padded only to its own
    # longest context (see `group_rows`); None: one group of all rows, as the fields above say.
    groups: list[AttentionGroup] | None = None
    # [B, context_len] int64 position of each key where a token tree puts keys off their slot
    # (what a windowed layer compares, attention.windowed_metadata); None: key s at position s.
    key_positions: torch.Tensor | None = None
    scale: float | None = None  # as AttentionMetadata's
    softcap: float | None = None


@dataclass(slots=True)
class AttentionGroup:
    """Some rows of a batch that attend together."""

    rows: torch.Tensor  # [Bg] int64: the rows' indices in the batch
    block_tables: torch.Tensor  # [Bg, Ng] int64: their first Ng = ceil(context_len / block_size) blocks
    context_len: int  # keys [0, context_len) are read: the group's longest context
    mask: torch.Tensor | None  # [Bg, 1, T, context_len] additive, as PagedAttentionMetadata.mask


class PagedReferenceCache(PagedKVCache):
    """The pool with the padded paged attention on top (module note)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Gathered keys and values of one attention call, reused by the next (see `_read`).
        self._gather = [self.k.new_empty((0, *self.k.shape[2:])) for _ in range(2)]

    def metadata(self, block_tables: list[list[int]], start_positions: list[int], query_lens: list[int],
                 tree_masks: list[torch.Tensor | None] | None = None) -> PagedAttentionMetadata:
        """Metadata for requests that compute `query_lens[i]` tokens starting at position
        `start_positions[i]` (the request's computed length), request i's positions living in
        the blocks `block_tables[i]` (which may hold more blocks than this step needs).

        `tree_masks[i]`, when given, makes request i's tokens a flattened token tree (see
        specserve.drafts.tree): a [q, q] bool mask, token j seeing token m iff mask[j, m]. Token j
        still writes slot start + j, but sits at position start + depth(j) (row sum - 1) and sees
        the context before start plus the tokens its row allows. None: causal, as a chain."""
        if not (len(block_tables) == len(start_positions) == len(query_lens) >= 1):
            raise ValueError("block_tables, start_positions and query_lens need one entry per request, at least one")
        if min(query_lens) < 1:
            raise ValueError(f"every request must compute at least one token, got query_lens={query_lens}")
        device, bs = self.k.device, self.block_size
        bsz, t = len(block_tables), max(query_lens)
        context_len = max(s + q for s, q in zip(start_positions, query_lens))
        n = -(-context_len // bs)  # blocks read per request
        rows = []
        for i, (table, s, q) in enumerate(zip(block_tables, start_positions, query_lens)):
            need = -(-(s + q) // bs)
            if len(table) < need:
                raise ValueError(f"request {i} reaches position {s + q - 1}, which needs {need} blocks "
                                 f"of {bs}, but its block table has {len(table)}")
            rows.append(table[:need] + [table[0]] * (n - need))
        tables = torch.tensor(rows, dtype=torch.int64)  # [B, N]
        if int(tables.min()) < 0 or int(tables.max()) >= self.num_blocks:
            raise ValueError(f"block ids must lie in [0, {self.num_blocks}), got {block_tables}")

        offs = torch.arange(t)
        start = torch.tensor(start_positions)[:, None]
        valid = offs[None, :] < torch.tensor(query_lens)[:, None]  # [B, T]
        slots = torch.where(valid, start + offs[None, :], 0)  # [B, T] where each token's k/v goes
        blocks = tables.gather(1, slots // bs)  # [B, T]
        write = torch.where(valid, blocks * bs + slots % bs, self.trash_block * bs)
        trees = [(i, m) for i, m in enumerate(tree_masks or []) if m is not None]
        positions = slots.clone() if trees else slots  # [B, T] RoPE positions
        for i, m in trees:
            if m.shape != (query_lens[i], query_lens[i]):
                raise ValueError(f"request {i}'s tree mask is {tuple(m.shape)}, not [{query_lens[i]}, {query_lens[i]}]")
            positions[i, : query_lens[i]] = start_positions[i] + m.sum(-1) - 1

        mask = None
        if bsz > 1 or t > 1:
            keys = torch.arange(context_len)
            visible = (keys[None, None, :] <= slots[:, :, None])[:, None]  # [B, 1, T, S]: causal by slot
            for i, m in trees:  # the tree's own slots: ancestors and self only
                s, q = start_positions[i], query_lens[i]
                visible[i, 0, :q, s : s + q] = m
            mask = torch.zeros(visible.shape, dtype=self.k.dtype).masked_fill_(~visible, float("-inf")).to(device)
        key_positions = None
        if trees:
            key_positions = torch.arange(context_len).repeat(bsz, 1)  # [B, S]
            for i, m in trees:
                s, q = start_positions[i], query_lens[i]
                key_positions[i, s:s + q] = positions[i, :q]
            key_positions = key_positions.to(device)
        first_block = None
        if bsz == 1 and rows[0] == list(range(rows[0][0], rows[0][0] + n)):
            first_block = rows[0][0]
        groups = None
        split = group_rows([s + q for s, q in zip(start_positions, query_lens)]) if bsz > 1 else None
        if split is not None:
            groups = []
            for g in split:
                idx = torch.tensor(g, dtype=torch.int64)
                glen = start_positions[g[0]] + query_lens[g[0]]
                groups.append(AttentionGroup(rows=idx.to(device), block_tables=tables[idx, : -(-glen // bs)].to(device),
                                             context_len=glen, mask=mask[idx, :, :, :glen]))
        return PagedAttentionMetadata(
            positions=positions.to(device),
            write_index=write.reshape(-1).to(device),
            block_tables=tables.to(device),
            context_len=context_len,
            mask=mask,
            first_block=first_block,
            groups=groups,
            key_positions=key_positions,
        )

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               meta: PagedAttentionMetadata) -> torch.Tensor:
        """q: [B, T, H, D]; k, v: [B, T, Hkv, D] -> attention output [B, T, H * D]."""
        bsz, t = q.shape[:2]
        self.k_slots[layer].index_copy_(0, meta.write_index, k.reshape(bsz * t, *k.shape[2:]))
        self.v_slots[layer].index_copy_(0, meta.write_index, v.reshape(bsz * t, *v.shape[2:]))
        if meta.groups is not None:
            out = q.new_empty(bsz, t, q.shape[2] * q.shape[3])
            for g in meta.groups:
                out.index_copy_(0, g.rows, self._read(layer, q.index_select(0, g.rows), g.block_tables, g.context_len,
                                                      g.mask, meta))
            return out
        if meta.first_block is not None:
            n = meta.block_tables.shape[1]
            keys = self.k[layer][meta.first_block:meta.first_block + n]  # [N, block, Hkv, D] view
            values = self.v[layer][meta.first_block:meta.first_block + n]
            return self._attend_blocks(q, keys, values, meta.context_len, meta.mask, meta)
        return self._read(layer, q, meta.block_tables, meta.context_len, meta.mask, meta)

    def _read(self, layer: int, q: torch.Tensor, block_tables: torch.Tensor, context_len: int,
              mask: torch.Tensor | None, meta: PagedAttentionMetadata) -> torch.Tensor:
        """q [B, T, H, D] of rows whose blocks are block_tables [B, N] -> [B, T, H * D]."""
        # index_select over whole blocks into buffers kept across layers and steps, not
        # pool[block_tables] into fresh memory: measured on CPU (1 thread, 64 rows x 304 keys)
        # 1.6 ms against 11.2 per gather; a fresh tensor of tens of MB is page-faulted in at
        # every call, and at batch 64 these gathers were most of a decode step.
        flat = block_tables.reshape(-1)
        shape = (*block_tables.shape, *self.k.shape[2:])  # [B, N, block, Hkv, D]
        keys = torch.index_select(self.k[layer], 0, flat, out=self._buffer(0, shape))
        values = torch.index_select(self.v[layer], 0, flat, out=self._buffer(1, shape))
        return self._attend_blocks(q, keys.view(shape), values.view(shape), context_len, mask, meta)

    def _buffer(self, which: int, shape: tuple[int, ...]) -> torch.Tensor:
        """A [N_total, block, Hkv, D] view of gather buffer `which` (0: keys, 1: values), grown
        when a read needs more; its contents live until the next read."""
        need = shape[0] * shape[1]
        buf = self._gather[which]
        if buf.shape[0] < need:
            buf = self._gather[which] = torch.empty((max(need, 2 * buf.shape[0]), *shape[2:]), dtype=self.k.dtype,
                                                    device=self.k.device)
        return buf[:need]

    def _attend_blocks(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, s: int,
                       mask: torch.Tensor | None, meta: PagedAttentionMetadata) -> torch.Tensor:
        bsz, n = q.shape[0], keys.shape[-4]
        # [B, N * block, Hkv, D] -> the first S keys, as [B, Hkv, S, D] (views)
        keys = keys.reshape(bsz, n * self.block_size, *keys.shape[-2:])[:, :s].transpose(1, 2)
        values = values.reshape(bsz, n * self.block_size, *values.shape[-2:])[:, :s].transpose(1, 2)
        return attention(q, keys, values, mask, meta.scale, meta.softcap)
