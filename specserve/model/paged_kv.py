"""The paged KV pool: per-layer K and V in fixed-size blocks, shared by all requests.

Each request owns a list of blocks (its block table, handed out by the engine's block allocator);
position p of a request lives in block `table[p // block_size]` at offset `p % block_size`.
Passes read and write it through the flat path (model/flat_attention.py; the native kernels
take the same layout): writes go to a flat slot index, reads gather the request's blocks.

Rollback needs nothing here: lowering a request's computed length (and freeing tail blocks) is
all it takes, because a query at position p only sees keys at positions <= p of its own request,
all of which were (re)written by then. A token tree (several draft branches in one pass) writes
its nodes to the request's next slots in node order; after verification `move` copies the
accepted path's entries down to the slots right after the root, where a chain would have put
them, and the rest is rolled back like rejected chain drafts.
"""

from __future__ import annotations

import torch

from specserve.model.hugepages import HugeArena


class PagedKVCache:
    """Per-layer K and V pools of fixed-size blocks, shared by all requests.

    k, v: [num_layers, num_blocks + 1, block_size, Hkv, D]. Block `num_blocks` is a trash block
    that padding tokens write into and nothing reads.

    Layout: token-major blocks ([block_size, Hkv, D] per block, as in vLLM), for three reasons.
    (1) A write is one index_copy_ into the flat [slots, Hkv, D] view, exactly the dense cache's
    write. (2) It is the paged layout FlashAttention's kv-cache kernel takes
    (k_cache [num_blocks, block_size, Hkv, D] plus a block table), so a CUDA decode kernel can
    read these pools later without conversion. (3) Head-major blocks ([Hkv, block_size, D]) make
    a gathered sequence contiguous per head, but measured on CPU (2 threads, Hkv=3, D=64,
    block_size 16, SDPA included) that saved no time: 92 vs 102 us at B=1, S=1000, and was
    slower at B=8 (779 vs 682 us); SDPA reads the strided [B, Hkv, S, D] view of a gather of
    either layout at the same speed, as it does the dense cache's strided views.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.trash_block = num_blocks
        shape = (num_layers, num_blocks + 1, block_size, num_kv_heads, head_dim)
        # Long contexts stream these pools every pass, as one-token passes stream the weights:
        # on the CPU in huge pages too (model/hugepages.py).
        arena = HugeArena()
        self.k, self.v = arena.zeros(shape, dtype, device), arena.zeros(shape, dtype, device)
        # Per-layer flat views [slots, Hkv, D] that writes index, made once (view ops cost
        # microseconds each at this model size, see llama.py).
        self.k_slots = [kl.flatten(0, 1) for kl in self.k]
        self.v_slots = [vl.flatten(0, 1) for vl in self.v]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        """K and V of one block across all layers."""
        return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize

    @classmethod
    def num_blocks_for_budget(cls, budget_bytes: int, num_layers: int, block_size: int, num_kv_heads: int,
                              head_dim: int, dtype: torch.dtype) -> int:
        """The most usable blocks whose pools (trash block included) fit in `budget_bytes`; 0 if
        not even one does."""
        per_block = cls.bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        return max(0, budget_bytes // per_block - 1)

    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def move(self, block_tables: list[list[int]], src_positions: list[list[int]],
             dst_positions: list[list[int]]) -> None:
        """Copy the keys and values at positions src_positions[i] of request i (whose blocks
        are block_tables[i]) to its positions dst_positions[i], in every layer (tree
        compaction). All sources are read before any destination is written, so a position may
        be a source of one entry and the destination of another."""
        bs, src, dst = self.block_size, [], []
        for table, s, d in zip(block_tables, src_positions, dst_positions):
            src += [table[p // bs] * bs + p % bs for p in s]
            dst += [table[p // bs] * bs + p % bs for p in d]
        s, d = torch.tensor(src, device=self.k.device), torch.tensor(dst, device=self.k.device)
        for pool in (self.k, self.v):
            flat = pool.view(pool.shape[0], -1, *pool.shape[3:])  # [L, slots, Hkv, D]
            flat[:, d] = flat[:, s]
