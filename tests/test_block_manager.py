"""The paged KV cache's bookkeeping: ref counts, prefix caching, lookahead, rollback, eviction.

Pure Python. The randomized test keeps a fake cache (slot -> the token prefix whose keys and
values the slot holds) and checks after every step that each request reads back exactly its own
prefix: that catches a wrong prefix hit, a write into a shared or cached block, and a rollback
that leaves stale contents cached.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from specserve.kv.block_manager import (
    BlockPool,
    KVCacheManager,
    RequestTooLargeError,
    UnknownRequestError,
    hash_block_tokens,
)
from specserve.errors import InvalidParameterError, SpecserveError


def make(num_blocks: int, block_size: int = 4, prefix_caching: bool = True) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, block_size, enable_prefix_caching=prefix_caching))


def prefill(kv: KVCacheManager, rid: str, tokens: list[int], lookahead: int = 0) -> int:
    """Admit and compute a whole prompt; returns the number of cached tokens it started from."""
    _, cached = kv.get_computed_blocks(rid, tokens)
    assert kv.allocate_slots(rid, len(tokens) - cached, lookahead)
    kv.commit(rid, tokens, len(tokens))
    kv.check_invariants()
    return cached


def snapshot(kv: KVCacheManager):
    p = kv.pool
    return (list(p.free_list), list(p.evictable), list(p.ref_counts), dict(p.cached), list(p.block_hashes),
            {rid: (list(r.blocks), r.num_computed_tokens, list(r.hashes)) for rid, r in kv.requests.items()})


def test_shared_prefix_ref_counts():
    kv = make(10)
    system = [1, 2, 3, 4, 5, 6, 7, 8]  # two full blocks
    assert prefill(kv, "a", system + [9, 9]) == 0
    assert prefill(kv, "b", system + [7]) == 8
    a, b = kv.block_table("a"), kv.block_table("b")
    assert a[:2] == b[:2] and a[2] != b[2]
    assert [kv.pool.ref_counts[x] for x in a[:2]] == [2, 2]
    kv.free("a")
    assert [kv.pool.ref_counts[x] for x in a[:2]] == [1, 1]
    assert kv.pool.num_evictable_blocks == 0  # a's third block is partial, hence never cached
    kv.free("b")
    kv.check_invariants()
    assert kv.pool.num_evictable_blocks == 2
    assert kv.pool.num_free_blocks + kv.pool.num_evictable_blocks == 10


def test_prefix_reuse_across_requests_sharing_a_system_prompt():
    kv = make(16)
    system = list(range(100, 112))  # three full blocks
    prefill(kv, "a", system + [1, 2])
    kv.free("a")  # finished: its full blocks stay cached, evictable
    assert kv.pool.usage == 0.0
    blocks, cached = kv.get_computed_blocks("b", system + [3, 4, 5])
    assert cached == 12 and len(blocks) == 3
    assert kv.num_computed_tokens("b") == 12
    stats = kv.pool.prefix_cache_stats()
    assert (stats.queried_blocks, stats.hit_blocks) == (3 + 3, 3)  # a queried 3 (all missed), b hit 3 of 3
    assert stats.hit_rate == 0.5
    assert kv.pool.num_evictable_blocks == 0  # taken back by b
    kv.check_invariants()


def test_whole_prompt_cached_still_leaves_a_token_to_compute():
    kv = make(8)
    prompt = list(range(8))  # exactly two blocks
    prefill(kv, "a", prompt)
    _, cached = kv.get_computed_blocks("b", prompt)
    assert cached == 4  # (8 - 1) // 4 = 1 block: the pass over the rest samples b's first token


def test_hit_stops_at_first_divergent_block():
    kv = make(12)
    prefill(kv, "a", [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 0])
    _, cached = kv.get_computed_blocks("b", [1, 1, 1, 1, 5, 5, 5, 5, 3, 3, 3, 3, 0])
    assert cached == 4  # the third block has the same tokens but a different prefix


def test_allocation_failure_leaves_state_unchanged():
    kv = make(4)
    prefill(kv, "a", list(range(10)))  # 3 blocks
    kv.get_computed_blocks("b", [50, 51, 52, 53, 54])
    before = snapshot(kv)
    assert not kv.can_allocate("b", 5)
    assert kv.allocate_slots("b", 5) is False
    assert snapshot(kv) == before
    assert kv.can_allocate("b", 4) and kv.allocate_slots("b", 4)
    kv.check_invariants()


def test_failed_admission_returns_prefix_hits():
    kv = make(4)
    prefill(kv, "a", list(range(9)))
    kv.free("a")  # two cached blocks, evictable
    prefill(kv, "c", [40, 41, 42, 43, 44])  # 2 blocks: evicts nothing, takes the free ones
    blocks, cached = kv.get_computed_blocks("b", list(range(8)) + [9, 9, 9, 9, 9])
    assert cached == 8 and kv.pool.num_available_blocks == 0
    assert not kv.can_allocate("b", 5)
    kv.free("b")  # stays waiting; its hits become evictable again, still cached
    assert kv.pool.num_evictable_blocks == 2 and kv.pool.lookup(kv.pool.block_hashes[blocks[0]]) == blocks[0]
    kv.check_invariants()


def test_lookahead_reserves_slots_and_rollback_drops_them():
    kv = make(10)
    kv.get_computed_blocks("a", [1, 2, 3])
    assert kv.allocate_slots("a", 3, num_lookahead_tokens=6)  # 9 slots -> 3 blocks
    assert len(kv.block_table("a")) == 3
    kv.commit("a", [1, 2, 3], 3)
    assert kv.allocate_slots("a", 1 + 2, num_lookahead_tokens=3)  # 3 + 3 + 3 = 9: no new block
    assert len(kv.block_table("a")) == 3
    kv.commit("a", [1, 2, 3, 4, 5], 5)  # one draft accepted, one rejected: the bonus token is not computed yet
    kv.rollback("a", 5)  # same length: just drops the reservation
    assert len(kv.block_table("a")) == 2
    assert kv.pool.num_free_blocks == 8
    kv.check_invariants()


def test_rollback_frees_tail_blocks_and_keeps_committed_blocks_cached():
    kv = make(10)
    tokens = list(range(10))
    prefill(kv, "a", tokens, lookahead=6)  # 16 slots -> 4 blocks; blocks 0 and 1 committed and cached
    table = kv.block_table("a")
    assert len(table) == 4 and kv.pool.num_evictable_blocks == 0
    kv.rollback("a", 9)
    assert kv.block_table("a") == table[:3]
    assert kv.pool.block_hashes[table[0]] is not None and kv.pool.block_hashes[table[1]] is not None
    kv.rollback("a", 4)  # block 1 (committed, cached) is freed but keeps its entry: its contents are right
    assert kv.block_table("a") == table[:1]
    assert kv.pool.num_evictable_blocks == 1 and table[1] in kv.pool.evictable
    kv.check_invariants()


def test_rollback_into_a_cached_block_uncaches_it():
    kv = make(10)
    prefill(kv, "a", list(range(9)))
    b1 = kv.block_table("a")[1]
    h = kv.pool.block_hashes[b1]
    kv.rollback("a", 6)  # a will rewrite positions 6 and 7 of block 1
    assert kv.pool.block_hashes[b1] is None and kv.pool.lookup(h) is None
    kv.commit("a", [0, 1, 2, 3, 4, 5, 60, 70], 8)
    assert kv.pool.lookup(h) is None and kv.pool.block_hashes[b1] is not None
    kv.check_invariants()


def test_rollback_into_a_shared_block_is_refused():
    kv = make(10)
    prefill(kv, "a", list(range(9)))
    prefill(kv, "b", list(range(8)) + [1])  # shares a's two full blocks
    before = snapshot(kv)
    with pytest.raises(ValueError, match="shared with other requests"):
        kv.rollback("a", 6)
    assert snapshot(kv) == before
    kv.rollback("a", 8)  # a block boundary: nothing shared is rewritten
    kv.check_invariants()


def test_lru_eviction_order():
    kv = make(6)
    prefill(kv, "a", [1] * 9)  # blocks A0 A1 + partial
    prefill(kv, "b", [2] * 9)  # blocks B0 B1 + partial
    a, b = kv.block_table("a"), kv.block_table("b")
    kv.free("a")
    kv.free("b")
    # Released later = evicted later; within a request the tail goes first.
    assert list(kv.pool.evictable) == [a[1], a[0], b[1], b[0]]
    assert kv.pool.num_free_blocks == 2
    kv.get_computed_blocks("c", [3] * 17)
    assert kv.allocate_slots("c", 17)  # 5 blocks: 2 free, then evicts a1, a0, b1
    assert kv.block_table("c")[2:] == [a[1], a[0], b[1]]
    assert list(kv.pool.evictable) == [b[0]]
    _, cached = kv.get_computed_blocks("d", [2] * 9)
    assert cached == 4  # b's first block survived
    kv.check_invariants()


def test_a_hit_refreshes_lru_position():
    kv = make(4)
    prefill(kv, "a", [1] * 5)
    prefill(kv, "b", [2] * 5)
    a0, b0 = kv.block_table("a")[0], kv.block_table("b")[0]
    kv.free("a")
    kv.free("b")
    kv.get_computed_blocks("c", [1] * 5)  # touches a0, then gives it back
    kv.free("c")
    assert list(kv.pool.evictable) == [b0, a0]


def test_free_after_abort_returns_every_block():
    kv = make(8)
    prefill(kv, "a", list(range(7)), lookahead=8)
    prefill(kv, "b", list(range(5)))
    kv.get_computed_blocks("c", list(range(6)))  # admitted, aborted before its first step
    for rid in ("a", "b", "c"):
        kv.free(rid)
    kv.check_invariants()
    assert kv.pool.num_free_blocks + kv.pool.num_evictable_blocks == 8
    assert kv.pool.usage == 0.0 and not kv.requests
    with pytest.raises(UnknownRequestError, match="'a'"):
        kv.free("a")


def test_request_that_can_never_fit_is_refused():
    kv = make(4)
    kv.get_computed_blocks("a", list(range(20)))
    with pytest.raises(RequestTooLargeError) as e:
        kv.can_allocate("a", 17)
    assert isinstance(e.value, ValueError) and isinstance(e.value, SpecserveError)
    assert "5 KV cache blocks for 17 tokens" in str(e.value) and "only 4 blocks (16 tokens)" in str(e.value)
    with pytest.raises(RequestTooLargeError):
        kv.allocate_slots("a", 12, num_lookahead_tokens=5)
    assert kv.allocate_slots("a", 16)  # exactly the whole cache


def test_misuse_is_reported():
    kv = make(4)
    for call in (lambda: kv.block_table("x"), lambda: kv.can_allocate("x", 1), lambda: kv.rollback("x", 0)):
        with pytest.raises(UnknownRequestError, match="'x'"):
            call()
    kv.get_computed_blocks("a", [1, 2])
    with pytest.raises(ValueError, match="already holds"):
        kv.get_computed_blocks("a", [1, 2])
    assert kv.allocate_slots("a", 2)
    with pytest.raises(ValueError, match="allocated slots = 4"):
        kv.commit("a", [1, 2, 3, 4, 5], 5)
    kv.commit("a", [1, 2], 2)
    with pytest.raises(ValueError, match="use rollback"):
        kv.commit("a", [1, 2], 1)
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        kv.rollback("a", 3)
    with pytest.raises(ValueError, match="outside its 4 allocated slots"):
        kv.slot_mapping("a", [4])
    with pytest.raises(InvalidParameterError, match="num_blocks=0"):
        BlockPool(0)


def test_slot_mapping():
    kv = make(8, block_size=4)
    kv.get_computed_blocks("pad", [0])
    kv.allocate_slots("pad", 5)  # takes blocks 0 and 1, so "a" gets non-trivial ids
    kv.get_computed_blocks("a", [1] * 6)
    kv.allocate_slots("a", 6)
    t = kv.block_table("a")
    assert t == [2, 3]
    assert kv.slot_mapping("a", [0, 3, 4, 5]) == [8, 11, 12, 13]


def test_prefix_caching_disabled():
    kv = make(8, prefix_caching=False)
    prefill(kv, "a", list(range(9)))
    assert kv.get_computed_blocks("b", list(range(9))) == ([], 0)
    kv.free("a")
    assert kv.pool.num_evictable_blocks == 0 and kv.pool.num_free_blocks == 8
    assert kv.pool.prefix_cache_stats().queried_blocks == 0


def test_same_prefix_computed_side_by_side_caches_one_copy():
    kv = make(8)
    kv.get_computed_blocks("a", list(range(5)))
    kv.get_computed_blocks("b", list(range(5)))  # admitted in the same step: no hit yet
    for rid in ("a", "b"):
        assert kv.allocate_slots(rid, 5)
    for rid in ("a", "b"):
        kv.commit(rid, list(range(5)), 5)
    h = hash_block_tokens(None, [0, 1, 2, 3])
    assert kv.pool.lookup(h) == kv.block_table("a")[0]
    assert kv.pool.block_hashes[kv.block_table("b")[0]] is None
    kv.check_invariants()


def test_block_hash_is_a_chain():
    first = hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(None, [1, 2]) == first
    assert hash_block_tokens(first, [1, 2]) != first
    assert hash_block_tokens(first, [1, 2]) != hash_block_tokens(hash_block_tokens(None, [3, 4]), [1, 2])


BLOCK_SIZE = 2
NUM_BLOCKS = 10
MAX_REQUESTS = 4  # live (running or preempted) requests: steps, not admissions, make up most of a run
VOCAB = 2  # a tiny vocabulary, so prompts share prefixes and blocks collide often
SYSTEM_PROMPTS = [[], [1, 0, 1, 1], [1, 0, 1, 1, 0, 0]]  # shared prompt heads make prefix hits common


class KVCacheMachine(RuleBasedStateMachine):
    """Random admissions, chunked prefills, speculative steps with lookahead, rollbacks,
    preemptions and aborts over a small pool, checked against a fake cache of prefixes."""

    def __init__(self):
        super().__init__()
        self.kv = make(NUM_BLOCKS, BLOCK_SIZE)
        self.tokens: dict[str, list[int]] = {}  # running requests: verified tokens
        self.waiting: dict[str, list[int]] = {}  # preempted requests keep their tokens
        self.store: dict[int, tuple[int, ...]] = {}  # slot -> the prefix whose keys/values it holds
        self.next_id = 0

    def write(self, rid: str, seq: list[int], start: int, stop: int) -> None:
        """A forward pass writing positions [start, stop) of `seq` (drafts included)."""
        for p, slot in zip(range(start, stop), self.kv.slot_mapping(rid, range(start, stop))):
            block = slot // BLOCK_SIZE
            assert self.kv.pool.ref_counts[block] == 1, "a write into a shared block"
            assert self.kv.pool.block_hashes[block] is None, "a write into a cached block"
            self.store[slot] = tuple(seq[:p + 1])

    def admit(self, rid: str, tokens: list[int]) -> None:
        _, cached = self.kv.get_computed_blocks(rid, tokens)
        assert cached < len(tokens)
        try:
            fits = self.kv.can_allocate(rid, len(tokens) - cached)
        except RequestTooLargeError:  # a preempted request that had outgrown the cache
            self.kv.free(rid)
            return
        if not fits:
            self.kv.free(rid)
            self.waiting[rid] = tokens
            return
        self.tokens[rid] = tokens

    @precondition(lambda self: len(self.tokens) + len(self.waiting) < MAX_REQUESTS)
    @rule(system=st.sampled_from(SYSTEM_PROMPTS), user=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=5))
    def add_request(self, system, user):
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.admit(rid, system + user)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def resume(self, data):
        rid = data.draw(st.sampled_from(sorted(self.waiting)))
        self.admit(rid, self.waiting.pop(rid))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens, c = self.tokens[rid], self.kv.num_computed_tokens(rid)
        pending = len(tokens) - c
        num_new = data.draw(st.integers(1, pending), label="num_new")  # < pending: a prefill chunk
        k = data.draw(st.integers(0, 3), label="drafts") if num_new == pending else 0
        lookahead = data.draw(st.integers(0, 3), label="lookahead")
        before = snapshot(self.kv)
        try:
            can = self.kv.can_allocate(rid, num_new + k, lookahead)
        except RequestTooLargeError:  # the request outgrew the whole cache: finish it ("length")
            assert snapshot(self.kv) == before
            self.kv.free(rid)
            del self.tokens[rid]
            return
        if not self.kv.allocate_slots(rid, num_new + k, lookahead):
            assert not can and snapshot(self.kv) == before
            self.kv.free(rid)  # preempt
            self.waiting[rid] = self.tokens.pop(rid)
            return
        assert can
        drafts = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=k, max_size=k), label="draft tokens")
        seq = tokens + drafts
        self.write(rid, seq, c, c + num_new + k)
        # Slots reserved ahead may be written too (a draft model's next proposals).
        self.write(rid, seq + [0] * lookahead, c + num_new + k, c + num_new + k + lookahead)
        if num_new < pending:
            self.kv.commit(rid, tokens, c + num_new)
            return
        accepted = data.draw(st.integers(0, k), label="accepted")
        bonus = data.draw(st.integers(0, VOCAB - 1), label="bonus")
        self.tokens[rid] = tokens + drafts[:accepted] + [bonus]
        self.kv.commit(rid, self.tokens[rid], c + num_new + accepted)
        if data.draw(st.booleans(), label="trim"):
            self.kv.rollback(rid, c + num_new + accepted)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def rollback(self, data):
        """Lower the computed length, possibly below committed tokens, and sometimes change
        the tokens after it (the sequence diverges from what the cache held)."""
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        c = self.kv.num_computed_tokens(rid)
        n = data.draw(st.integers(0, c), label="rollback to")
        before = snapshot(self.kv)
        try:
            self.kv.rollback(rid, n)
        except ValueError as e:
            assert "shared with other requests" in str(e) and snapshot(self.kv) == before
            return
        tail = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=4), label="new tail")
        self.tokens[rid] = self.tokens[rid][:n] + tail

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.tokens)))
        self.kv.free(rid)
        del self.tokens[rid]

    @invariant()
    def consistent(self):
        self.kv.check_invariants()
        for rid, tokens in self.tokens.items():
            c = self.kv.num_computed_tokens(rid)
            assert c < len(tokens)
            for p, slot in enumerate(self.kv.slot_mapping(rid, range(c))):
                assert self.store.get(slot) == tuple(tokens[:p + 1]), f"{rid} reads wrong keys/values at {p}"

    def teardown(self):
        for rid in list(self.tokens):
            self.kv.free(rid)
        self.kv.check_invariants()
        pool = self.kv.pool
        assert pool.num_free_blocks + pool.num_evictable_blocks == NUM_BLOCKS
        assert pool.usage == 0.0


KVCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
test_kv_cache_random_operations = KVCacheMachine.TestCase
