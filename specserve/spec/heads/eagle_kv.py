"""The EAGLE layer's own KV cache: a paged pool like the draft model's (one layer deep, so a
block costs 1/num_layers of the target's), with the target's features waiting to enter it.

Slot p of a request holds the drafter's keys and values for position p, computed from the
target's feature at p and the token at p+1 ("the context"). While a draft tree grows, the
nodes being expanded take the slots after the context, in expansion order; they attend to
the context and to their own ancestors only, and are dropped after the proposal (the next
catch-up overwrites those slots with the accepted tokens' real entries).

A drafting pass is described by a DraftPass over flattened rows (the native EAGLE-3 layer's
terms), and the torch path attends through FlatDraftAttention: EAGLE's and EAGLE-3's drafters
both run on it (spec/eagle.py's FeatureTreeProposer).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.kv.block_manager import BlockPool, KVCacheManager
from specserve.model.config import ModelConfig
from specserve.model.paged_kv import PagedKVCache


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
            r = self._restart(request_id, start)
            if r is None:
                return
        if len(hidden):
            r.pending.append(hidden)
            r.num_pending += len(hidden)

    def _restart(self, request_id: str, start: int) -> _Request | None:
        """Drop the request's entries; its first entry will be position `start`. None when the
        pool is short (no drafts until a later restart fits)."""
        self.remove(request_id)
        self.kv.get_computed_blocks(request_id, [])
        # Positions before `first` never get entries; their slots stay allocated (and are
        # masked out) so that slot p is position p for every request.
        if start and not self.kv.allocate_slots(request_id, start):
            self.kv.free(request_id)
            return None
        self.kv.commit(request_id, range(start), start)
        r = self.requests[request_id] = _Request(first=start, computed=start)
        return r

    def remove(self, request_id: str) -> None:
        if self.requests.pop(request_id, None) is not None:
            self.kv.free(request_id)

    # ---- one proposal ------------------------------------------------------------------------

    def begin(self, request_id: str, num_tokens: int, lookahead: int,
              window: int | None = None) -> tuple[int, torch.Tensor] | None:
        """Prepare a proposal for a request with `num_tokens` committed tokens: its last
        position with a target feature must be num_tokens - 2 (the last token is the root).
        Reserves the catch-up and `lookahead` tree slots. window W: a request more than W
        features behind (drafting was off for a while) restarts from its last W instead, its
        earlier entries dropped. -> (first catch-up position, features [C, H] to feed), or None
        when features are missing or the pool is short."""
        r = self.requests.get(request_id)
        if r is None or r.computed + r.num_pending != num_tokens - 1 or r.num_pending == 0:
            return None
        features = torch.cat(r.pending) if len(r.pending) > 1 else r.pending[0]
        r.pending = [features]  # joined once, whatever happens below
        if window is not None and r.num_pending > window:
            features = features[-window:]
            r = self._restart(request_id, num_tokens - 1 - window)
            if r is None:
                return None
            r.pending, r.num_pending = [features], window
        if not self.kv.allocate_slots(request_id, r.num_pending, lookahead):
            return None  # drafting is optional: this request takes a plain step
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


@dataclass(slots=True)
class DraftPass:
    """One drafting pass over flattened rows, in the native layer's terms (on the host).

    Sequence s owns rows [q_start[s], q_start[s + 1]); row i writes its key and value to cache
    row `write_rows[i]` and sees the sequence's slots [kv_start[s], prefix_len[i]) and, when
    tree_row is set, the slots tree_start[s] + m with tree_mask[tree_row[i] + m] != 0."""

    positions: torch.Tensor  # [N] int64 (RoPE)
    write_rows: torch.Tensor  # [N] int64 physical cache rows
    q_start: torch.Tensor  # [B + 1] int64
    block_table: torch.Tensor  # [B, blocks] int64
    block_size: int
    prefix_len: torch.Tensor  # [N] int64
    kv_start: torch.Tensor  # [B] int64
    tree_row: torch.Tensor | None = None  # [N] int64 byte offset of each row's mask
    tree_start: torch.Tensor | None = None  # [B]
    tree_size: torch.Tensor | None = None  # [B]
    tree_mask: torch.Tensor | None = None  # flat uint8


class FlatDraftAttention:
    """The attention interface (`attend(layer, q, k, v, meta)`) over a DraftPass: writes the
    rows' keys and values to the cache, then each sequence's rows attend to their visible slots."""

    def __init__(self, k_rows: torch.Tensor, v_rows: torch.Tensor):
        self.k, self.v = k_rows[0], v_rows[0]  # [rows, Hkv, D]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: DraftPass) -> torch.Tensor:
        """q [N, Hq, D]; k, v [N, Hkv, D] -> [N, Hq * D]."""
        device = q.device
        rows = p.write_rows.to(device)
        self.k.index_copy_(0, rows, k.to(self.k.dtype))
        self.v.index_copy_(0, rows, v.to(self.v.dtype))
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
        block = p.block_size
        starts = p.q_start.tolist()
        for s in range(len(starts) - 1):
            a, b = starts[s], starts[s + 1]
            if a == b:
                continue
            prefix = p.prefix_len[a:b]
            span = int(prefix.max())
            if p.tree_row is not None:
                span = max(span, int(p.tree_start[s] + p.tree_size[s]))
            # Slots before kv_start were never written (they may hold anything): not even read.
            first = int(p.kv_start[s])
            slots = torch.arange(first, span)
            phys = p.block_table[s, slots // block] * block + slots % block
            keys, values = self.k[phys.to(device)].float(), self.v[phys.to(device)].float()  # [S, Hkv, D]
            visible = slots[None, :] < prefix[:, None]  # [n, S]
            if p.tree_row is not None:
                size, t0 = int(p.tree_size[s]), int(p.tree_start[s]) - first
                for j, i in enumerate(range(a, b)):
                    r = int(p.tree_row[i])
                    if r >= 0:
                        visible[j, t0:t0 + size] |= p.tree_mask[r:r + size].bool()
            groups = q.shape[1] // keys.shape[1]
            kk = keys.repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, S, D]
            vv = values.repeat_interleave(groups, dim=1).transpose(0, 1)
            mask = torch.zeros(visible.shape, dtype=torch.float32).masked_fill_(~visible, float("-inf")).to(device)
            o = F.scaled_dot_product_attention(q[a:b].float().transpose(0, 1), kk, vv, attn_mask=mask[None])
            out[a:b] = o.transpose(0, 1).reshape(b - a, -1).to(out.dtype)
        return out
