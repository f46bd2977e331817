"""Bookkeeping of the paged KV cache: which blocks each request holds, and the prefix cache.

Pure Python: this module hands out block ids and never touches tensors (the runner turns block
tables and slot mappings into tensors for the flat path, `specserve.model.flat_attention`).

A block is in exactly one of three states:
  - free: in the free list, holding nothing worth keeping;
  - referenced: in the block table of one or more requests (ref count >= 1);
  - evictable: ref count 0 but registered in the prefix cache, so a later request whose prompt
    starts with the same tokens can take it back instead of recomputing it.
Fresh blocks come from the free list first, then by evicting the least recently released
evictable block.

A full block is named by a hash chain, sha256(parent block's hash + this block's token ids as
int64), so a hash names the whole prefix up to the block's end, never the block's tokens alone.
sha256 rather than Python's `hash()` because a 64-bit collision would silently hand a request
another prompt's keys and values; the digest is also stable across processes (native byte order).

Only blocks fully below a request's committed length are cached: their keys and values belong
to verified tokens at their linear positions, so they are right for any request with the same
prefix. Draft slots (written during verification, possibly at tree positions) never are, which
is why a rollback of rejected drafts never has to uncache anything.
"""

from __future__ import annotations

import heapq
from array import array
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from hashlib import sha256

from specserve.errors import InvalidParameterError, PromptError

BlockHash = bytes


class RequestTooLargeError(PromptError):
    """A request needs more blocks than the whole cache holds, so waiting would never help."""


class UnknownRequestError(KeyError):
    """A request id the manager does not track (never admitted, or already freed): a bug in
    the caller, not a user error."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int]) -> BlockHash:
    """The chain hash of one full block. The first block has no parent; its input is then
    shorter than any child's, so a first block and a child never share a hash."""
    h = sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass(slots=True)
class PrefixCacheStats:
    queried_blocks: int = 0  # full prompt blocks looked up by get_computed_blocks
    hit_blocks: int = 0  # of those, found in the cache

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.queried_blocks if self.queried_blocks else 0.0


class BlockPool:
    """A fixed set of block ids 0..num_blocks-1 with reference counts, a free list and the
    prefix cache (hash -> block) with its LRU order of evictable blocks."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise InvalidParameterError("num_blocks", num_blocks, "an integer >= 1")
        if not isinstance(block_size, int) or block_size < 1:
            raise InvalidParameterError("block_size", block_size, "an integer >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks  # set while registered
        # A min-heap: the lowest free id is handed out first, so a request running alone gets
        # consecutive blocks and the attention reads its keys as views instead of gathers.
        self.free_list: list[int] = list(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        # Cached blocks with ref count 0, least recently released first: eviction pops the front.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free list (evictable cached blocks not included)."""
        return len(self.free_list)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self.evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks a request could take now: free ones plus evictable cached ones."""
        return len(self.free_list) + len(self.evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests (evictable cached blocks count as unused)."""
        return 1.0 - self.num_available_blocks / self.num_blocks

    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(self.stats.queried_blocks, self.stats.hit_blocks)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self.cached.get(block_hash)

    def take_fresh(self, n: int) -> list[int]:
        """n blocks with ref count 1 and no cache entry, evicting LRU cached blocks if the free
        list runs out. The caller checks `num_available_blocks` first."""
        if n > self.num_available_blocks:
            raise RuntimeError(f"take_fresh({n}) with only {self.num_available_blocks} blocks available")
        out = []
        for _ in range(n):
            if self.free_list:
                b = heapq.heappop(self.free_list)
            else:
                b, _ = self.evictable.popitem(last=False)
                del self.cached[self.block_hashes[b]]
                self.block_hashes[b] = None
            self.ref_counts[b] = 1
            out.append(b)
        return out

    def acquire(self, block_id: int) -> None:
        """One more reference to a cached block (a prefix hit); it stops being evictable."""
        if self.ref_counts[block_id] == 0:
            del self.evictable[block_id]
        self.ref_counts[block_id] += 1

    def release(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block, in order: of blocks reaching 0, earlier ones
        become evictable before later ones (so are evicted first)."""
        for b in block_ids:
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if self.block_hashes[b] is None:
                    heapq.heappush(self.free_list, b)
                else:
                    self.evictable[b] = None

    def register(self, block_id: int, block_hash: BlockHash) -> bool:
        """Enter a referenced, full block into the prefix cache. False (and nothing changes)
        when another block already holds that prefix: two requests computed it side by side,
        and the first one's copy stays the cached one."""
        if block_hash in self.cached:
            return False
        self.cached[block_hash] = block_id
        self.block_hashes[block_id] = block_hash
        return True

    def unregister(self, block_id: int) -> None:
        """Take a referenced block out of the prefix cache (its owner is about to rewrite it)."""
        del self.cached[self.block_hashes[block_id]]
        self.block_hashes[block_id] = None

    def check_invariants(self, expected_refs: Counter[int] | None = None) -> None:
        """Raise AssertionError unless the pool is consistent (and, when given, every ref count
        equals `expected_refs`, the number of block tables holding the block)."""
        free = set(self.free_list)
        assert len(free) == len(self.free_list), "a block appears twice in the free list"
        assert not free & self.evictable.keys(), "a block is both free and evictable"
        for b in range(self.num_blocks):
            ref = self.ref_counts[b]
            assert ref >= 0, f"block {b} has ref count {ref}"
            if expected_refs is not None:
                assert ref == expected_refs[b], f"block {b}: ref count {ref}, held by {expected_refs[b]} tables"
            state = (ref > 0) + (b in free) + (b in self.evictable)
            assert state == 1, f"block {b} is in {state} of the states referenced/free/evictable"
            h = self.block_hashes[b]
            if b in free:
                assert h is None, f"free block {b} still has a hash"
            if b in self.evictable:
                assert h is not None, f"evictable block {b} is not cached"
            if h is not None:
                assert self.cached.get(h) == b, f"block {b}'s hash maps to block {self.cached.get(h)}"
        assert len(self.cached) == sum(h is not None for h in self.block_hashes), "stale cache entries"
        assert self.stats.hit_blocks <= self.stats.queried_blocks


@dataclass(slots=True)
class _RequestBlocks:
    blocks: list[int] = field(default_factory=list)  # the block table
    num_computed_tokens: int = 0  # committed tokens whose keys and values are in the blocks
    hashes: list[BlockHash] = field(default_factory=list)  # chain hashes of the num_computed // block_size full blocks


class KVCacheManager:
    """Block tables per request id, over one BlockPool.

    Per step a scheduler uses check/act pairs, so it can decide before anything changes:
      admit:    blocks, n = get_computed_blocks(rid, prompt)   # prefix hits, referenced now
                if not can_allocate(rid, len(prompt) - n): free(rid)  # stay waiting
      schedule: can_allocate(rid, num_new, lookahead) / allocate_slots(rid, num_new, lookahead)
      update:   commit(rid, verified_token_ids, num_computed)  # caches the newly full blocks
                rollback(rid, num_computed)                    # optional: drop unused tail blocks
      finish, abort or preempt: free(rid)
    `num_new` counts every token whose keys and values the pass writes (the last sampled token
    plus draft tokens to verify); `lookahead` reserves slots beyond them (e.g. for a draft
    model's next proposals). Only commit moves the computed length forward, so rejected drafts
    never count as computed and their slots are simply rewritten next step.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.requests: dict[str, _RequestBlocks] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.requests

    def _get(self, request_id: str) -> _RequestBlocks:
        try:
            return self.requests[request_id]
        except KeyError:
            raise UnknownRequestError(f"request {request_id!r} holds no KV cache blocks "
                                      "(never admitted with get_computed_blocks, or already freed)") from None

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Start tracking a request: take references on the longest cached prefix of its full
        blocks and return (those block ids, number of tokens they hold). At least one token is
        always left to compute, since the pass that computes it samples the next token."""
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already holds KV cache blocks")
        req = _RequestBlocks()
        if self.pool.enable_prefix_caching:
            max_blocks = max(0, (len(token_ids) - 1) // self.block_size)
            parent = None
            for i in range(max_blocks):
                h = hash_block_tokens(parent, token_ids[i * self.block_size:(i + 1) * self.block_size])
                b = self.pool.lookup(h)
                if b is None:
                    break
                req.blocks.append(b)
                req.hashes.append(h)
                parent = h
            for b in req.blocks:
                self.pool.acquire(b)
            self.pool.stats.queried_blocks += max_blocks
            self.pool.stats.hit_blocks += len(req.blocks)
            req.num_computed_tokens = len(req.blocks) * self.block_size
        self.requests[request_id] = req
        return list(req.blocks), req.num_computed_tokens

    def _num_new_blocks(self, request_id: str, num_new_tokens: int, num_lookahead_tokens: int) -> int:
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(f"num_new_tokens ({num_new_tokens}) and num_lookahead_tokens "
                             f"({num_lookahead_tokens}) must be >= 0")
        req = self._get(request_id)
        num_tokens = req.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        needed = self._blocks_for(num_tokens)
        if needed > self.pool.num_blocks:
            raise RequestTooLargeError(
                f"request {request_id!r} needs {needed} KV cache blocks for {num_tokens} tokens "
                f"(block_size {self.block_size}), but the cache holds only {self.pool.num_blocks} blocks "
                f"({self.pool.num_blocks * self.block_size} tokens)")
        return max(0, needed - len(req.blocks))

    def can_allocate(self, request_id: str, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Whether allocate_slots with the same arguments would succeed now. Raises
        RequestTooLargeError when it never could, so a scheduler does not wait forever."""
        return self._num_new_blocks(request_id, num_new_tokens, num_lookahead_tokens) <= self.pool.num_available_blocks

    def allocate_slots(self, request_id: str, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Grow the block table to cover num_computed + num_new + num_lookahead token slots
        (it never shrinks here). False, with nothing changed, when the pool is short."""
        n = self._num_new_blocks(request_id, num_new_tokens, num_lookahead_tokens)
        if n > self.pool.num_available_blocks:
            return False
        self.requests[request_id].blocks += self.pool.take_fresh(n)
        return True

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Record that the first `num_computed_tokens` of `token_ids` (verified tokens only, no
        drafts) have their keys and values at their slots, and cache the blocks that became
        full below that length."""
        req = self._get(request_id)
        capacity = len(req.blocks) * self.block_size
        if not req.num_computed_tokens <= num_computed_tokens <= min(len(token_ids), capacity):
            raise ValueError(
                f"commit of {num_computed_tokens} tokens for request {request_id!r}: must lie between its "
                f"computed length {req.num_computed_tokens} and min(len(token_ids) = {len(token_ids)}, "
                f"allocated slots = {capacity}); use rollback to lower it")
        req.num_computed_tokens = num_computed_tokens
        if not self.pool.enable_prefix_caching:
            return
        bs = self.block_size
        for i in range(len(req.hashes), num_computed_tokens // bs):
            h = hash_block_tokens(req.hashes[-1] if req.hashes else None, token_ids[i * bs:(i + 1) * bs])
            req.hashes.append(h)
            self.pool.register(req.blocks[i], h)

    def rollback(self, request_id: str, num_computed_tokens: int) -> None:
        """Lower the request's computed length and free every block beyond it (reserved
        lookahead included). Cached blocks freed here keep their cache entry: they hold
        committed tokens, right for any request with that prefix. The one exception is a cached
        block kept only partly below the new length, which the request will overwrite: it is
        uncached, or, if other requests share it, the rollback is refused (nothing changes)."""
        req = self._get(request_id)
        if not 0 <= num_computed_tokens <= req.num_computed_tokens:
            raise ValueError(f"rollback of request {request_id!r} to {num_computed_tokens} tokens: must lie in "
                             f"[0, {req.num_computed_tokens}] (its computed length)")
        keep = self._blocks_for(num_computed_tokens)
        partial = num_computed_tokens // self.block_size if num_computed_tokens % self.block_size else None
        if partial is not None and self.pool.block_hashes[req.blocks[partial]] is not None:
            b = req.blocks[partial]
            if self.pool.ref_counts[b] > 1:
                raise ValueError(f"cannot roll back request {request_id!r} to {num_computed_tokens} tokens: "
                                 f"block {b} holds committed tokens shared with other requests")
            self.pool.unregister(b)
        self.pool.release(req.blocks[keep:][::-1])
        del req.blocks[keep:]
        del req.hashes[num_computed_tokens // self.block_size:]
        req.num_computed_tokens = num_computed_tokens

    def free(self, request_id: str) -> None:
        """Drop the request's blocks (finish, abort or preemption). Tail blocks are released
        first so they are evicted first: a prefix is only reusable from its start."""
        req = self._get(request_id)
        del self.requests[request_id]
        self.pool.release(req.blocks[::-1])

    def num_computed_tokens(self, request_id: str) -> int:
        return self._get(request_id).num_computed_tokens

    def block_table(self, request_id: str) -> list[int]:
        return list(self._get(request_id).blocks)

    def slot_mapping(self, request_id: str, positions: Sequence[int]) -> list[int]:
        """Flat cache slot (block_id * block_size + offset) of each token position."""
        blocks, bs = self._get(request_id).blocks, self.block_size
        out = []
        for p in positions:
            if not 0 <= p < len(blocks) * bs:
                raise ValueError(f"position {p} of request {request_id!r} is outside its "
                                 f"{len(blocks) * bs} allocated slots")
            out.append(blocks[p // bs] * bs + p % bs)
        return out

    def check_invariants(self) -> None:
        """Raise AssertionError unless every ref count equals the number of tables holding the
        block, every table covers its computed tokens, and every cached block in a table lies
        fully below that request's computed length with the hash of its own prefix (so no
        write can land in a cached block)."""
        refs: Counter[int] = Counter()
        bs = self.block_size
        for rid, req in self.requests.items():
            assert len(set(req.blocks)) == len(req.blocks), f"request {rid!r} holds a block twice"
            refs.update(req.blocks)
            assert req.num_computed_tokens <= len(req.blocks) * bs, f"request {rid!r} computed beyond its blocks"
            expected = req.num_computed_tokens // bs if self.pool.enable_prefix_caching else 0
            assert len(req.hashes) == expected, f"request {rid!r} has {len(req.hashes)} hashes, expected {expected}"
            for i, b in enumerate(req.blocks):
                h = self.pool.block_hashes[b]
                if h is not None:
                    assert i < len(req.hashes) and req.hashes[i] == h, (
                        f"request {rid!r} block {i} (id {b}) is cached under another prefix "
                        "or above the computed length")
        self.pool.check_invariants(refs)
