"""The EAGLE layer's own KV cache: a paged pool like the draft model's (one layer deep, so a
block costs 1/num_layers of the target's), with the target's features waiting to enter it.

Slot p of a request holds the drafter's keys and values for position p, computed from the
target's feature at p and the token at p+1 ("the context"). While a draft tree grows, the
nodes being expanded take the slots after the context, in expansion order; they attend to
the context and to their own ancestors only, and are dropped after the proposal (the next
catch-up overwrites those slots with the accepted tokens' real entries).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specserve.kv.block_manager import BlockPool, KVCacheManager
from specserve.model.config import ModelConfig
from specserve.model.paged_attention import PagedAttentionMetadata, PagedKVCache


@dataclass(slots=True)
class _Request:
    first: int  # first position with an entry (a prefix-cache hit makes the target start later than 0)
    computed: int  # entries exist for positions [first, computed)
    # Target features not yet in the cache, for positions computed, computed + 1, ... (rows in order)
    pending: list[torch.Tensor] = field(default_factory=list)
    num_pending: int = 0  # their rows (kept, not summed: drafts may stay off for hundreds of steps)


class EagleKV:
    """Per-request drafter KV in a paged pool, and the attention metadata of its passes."""

    def __init__(self, layer: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.cache = PagedKVCache(1, num_blocks, block_size, layer.num_kv_heads, layer.head_dim, dtype, device)
        # No prefix caching: entries depend on the target's features, which a request hands over
        # itself, and a shared prompt costs one cheap one-layer pass.
        self.kv = KVCacheManager(BlockPool(num_blocks, block_size, enable_prefix_caching=False))
        self.requests: dict[str, _Request] = {}
        self.device = device

    # ---- target features in ----------------------------------------------------------------

    def observe(self, request_id: str, start: int, hidden: torch.Tensor) -> None:
        """hidden [T, H]: the target's features at positions start..start+T-1. Features that do
        not continue what the request holds (a restart) drop its entries and start afresh."""
        r = self.requests.get(request_id)
        if r is not None and start < r.computed:  # already in the cache: keep only the new rows
            hidden, start = hidden[r.computed - start:], r.computed
        if r is None or start != r.computed + r.num_pending:
            self.remove(request_id)
            self.kv.get_computed_blocks(request_id, [])
            # Positions before `first` never get entries; their slots stay allocated (and are
            # masked out) so that slot p is position p for every request.
            if start and not self.kv.allocate_slots(request_id, start):
                self.kv.free(request_id)  # the pool is short: no drafts until a later restart fits
                return
            self.kv.commit(request_id, range(start), start)
            r = self.requests[request_id] = _Request(first=start, computed=start)
        if len(hidden):
            r.pending.append(hidden)
            r.num_pending += len(hidden)

    def remove(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.kv.free(request_id)

    # ---- one proposal ------------------------------------------------------------------------

    def begin(self, request_id: str, num_tokens: int, lookahead: int) -> tuple[int, torch.Tensor] | None:
        """Prepare a proposal for a request with `num_tokens` committed tokens: its last
        position with a target feature must be num_tokens - 2 (the last token is the root).
        Reserves the catch-up and `lookahead` tree slots. -> (first catch-up position,
        features [C, H] to feed), or None when features are missing or the pool is short."""
        r = self.requests.get(request_id)
        if r is None or r.computed + r.num_pending != num_tokens - 1 or r.num_pending == 0:
            return None
        if not self.kv.allocate_slots(request_id, r.num_pending, lookahead):
            return None  # drafting is optional: this request takes a plain step
        features = torch.cat(r.pending) if len(r.pending) > 1 else r.pending[0]
        return r.computed, features

    def commit(self, request_id: str, num_tokens: int) -> None:
        """The catch-up pass ran: positions up to num_tokens - 2 have entries; the tree slots
        are given back."""
        r = self.requests[request_id]
        r.computed, r.pending, r.num_pending = num_tokens - 1, [], 0
        self.kv.commit(request_id, range(r.computed), r.computed)
        self.kv.rollback(request_id, r.computed)

    def first(self, request_id: str) -> int:
        return self.requests[request_id].first

    def tables(self, request_ids: list[str], num_slots: int) -> torch.Tensor:
        """[B, ceil(num_slots / block_size)] block ids; rows that hold fewer repeat their first
        block (read, then masked out)."""
        n = -(-num_slots // self.cache.block_size)
        rows = []
        for rid in request_ids:
            table = self.kv.block_table(rid)[:n]
            rows.append(table + [table[0]] * (n - len(table)))
        return torch.tensor(rows, dtype=torch.int64)

    def metadata(self, tables: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 visible: torch.Tensor) -> PagedAttentionMetadata:
        """tables [B, N] (host); positions, slots [B, T] (host; slot -1: padding, written to the
        trash block); visible [B, T, S] bool (host), S <= N * block_size: which slots each
        query attends to."""
        bs = self.cache.block_size
        pad = slots < 0
        safe = slots.clamp(min=0)
        write = torch.where(pad, self.cache.trash_block * bs, tables.gather(1, safe // bs) * bs + safe % bs)
        mask = torch.zeros(visible.shape, dtype=self.cache.k.dtype).masked_fill_(~visible, float("-inf"))
        n = tables.shape[1]
        first_block = None
        if tables.shape[0] == 1 and tables[0].tolist() == list(range(int(tables[0, 0]), int(tables[0, 0]) + n)):
            first_block = int(tables[0, 0])
        return PagedAttentionMetadata(
            positions=positions.to(self.device), write_index=write.reshape(-1).to(self.device),
            block_tables=tables.to(self.device), context_len=visible.shape[-1],
            mask=mask[:, None].to(self.device), first_block=first_block)
