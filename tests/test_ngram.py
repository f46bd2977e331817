"""N-gram proposer: exact drafts on hand-built sequences, the incremental index against a
brute-force scan (growing, rolled back and replaced sequences), the amount of indexing work on
long contexts (counted, not timed), the DraftProposal helpers and parameter validation."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.errors import InvalidParameterError
from specserve.sampling_params import SamplingParams
from specserve.spec import DraftProposal, NgramIndex, NgramProposer, SpecRequest


def brute_force(seq: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition: longest suffix n in [lo, hi] with a strictly earlier occurrence; the
    k tokens after the most recent one."""
    size = len(seq)
    for n in range(hi, lo - 1, -1):
        suffix = seq[size - n :] if n <= size else None
        for start in range(size - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k]
    return []


def req(rid: str, tokens: list[int], k: int) -> SpecRequest:
    return SpecRequest(rid, tokens, k, SamplingParams(temperature=0.0), None)


def drafts_of(proposal: DraftProposal) -> list[list[int]]:
    return [row[:n] for row, n in zip(proposal.draft_token_ids.tolist(), proposal.num_draft.tolist())]


def propose_one(tokens: list[int], k: int, lo: int = 1, hi: int = 4) -> list[int]:
    return drafts_of(NgramProposer(lo, hi).propose([req("r", tokens, k)]))[0]


# ---- exact proposals on hand-built sequences ------------------------------------------------


def test_most_recent_occurrence_wins():
    # (1, 2) occurs at 0 (followed by 3) and at 4 (followed by 5): the later one is proposed.
    assert propose_one([1, 2, 3, 9, 1, 2, 5, 6, 7, 1, 2], k=2) == [5, 6]


def test_longer_ngram_preferred_over_more_recent_shorter():
    # Suffix (4, 1, 2) matches only at 0; (1, 2) alone matches more recently at 6.
    seq = [4, 1, 2, 7, 8, 9, 1, 2, 3, 4, 1, 2]
    assert propose_one(seq, k=3) == [7, 8, 9]
    assert propose_one(seq, k=3, hi=2) == [3, 4, 1]


def test_fewer_than_k_when_context_ends():
    # The most recent earlier (5, 6) starts at 3; only 2 tokens follow it before the context
    # ends, and they are the suffix itself, which is allowed.
    assert propose_one([5, 6, 1, 5, 6, 5, 6], k=4) == [5, 6]


def test_repeated_token_run_overlaps_suffix():
    # Suffix (7, 7, 7, 7) last occurred at 1, one step before itself: one token follows.
    assert propose_one([7, 7, 7, 7, 7, 7], k=3) == [7]


def test_no_match_proposes_nothing():
    p = NgramProposer(2, 3)
    out = p.propose([req("r", [1, 2, 3, 4, 5, 1], 4)])  # (5, 1) never occurred before
    assert out.num_draft.tolist() == [0]
    assert out.draft_token_ids.shape == (1, 0)


def test_suffix_itself_is_not_a_match():
    assert propose_one([3, 1, 2], k=2) == []
    assert propose_one([], k=2) == [] and propose_one([8], k=2) == []


def test_batch_with_per_request_k_and_padding():
    batch = [
        req("a", [1, 2, 3, 4, 5, 1, 2], 3),  # -> [3, 4, 5]
        req("b", [9, 8, 9], 1),  # -> [8]
        req("c", [1, 2, 3], 4),  # no match
        req("d", [6, 6, 6, 6], 0),  # k = 0: nothing asked
        req("e", [1, 2, 1, 2], 5),  # -> [1, 2]: context ends
    ]
    out = NgramProposer().propose(batch)
    assert out.num_draft.dtype == torch.long and out.draft_token_ids.dtype == torch.long
    assert out.num_draft.tolist() == [3, 1, 0, 0, 2]
    # Width is the longest draft (the target scores 1 + max(num_draft) positions), -1 padded.
    assert out.draft_token_ids.tolist() == [
        [3, 4, 5],
        [8, -1, -1],
        [-1, -1, -1],
        [-1, -1, -1],
        [1, 2, -1],
    ]


def test_requests_keep_separate_indexes():
    p = NgramProposer()
    p.add_request("a", [1, 2, 3])
    p.add_request("b", [1, 2, 4])
    assert drafts_of(p.propose([req("a", [1, 2, 3, 1, 2], 2), req("b", [1, 2, 4, 1, 2], 2)])) == [[3, 1], [4, 1]]
    p.remove_request("a")
    assert set(p.indexes) == {"b"}
    p.remove_request("never-added")  # harmless


def test_add_request_with_reused_id_starts_afresh():
    p = NgramProposer()
    p.add_request("r", [1, 2, 3, 1])
    p.add_request("r", [5, 6, 5])
    assert drafts_of(p.propose([req("r", [5, 6, 5], 2)])) == [[6, 5]]


# ---- the incremental index equals the definition --------------------------------------------

tokens = st.lists(st.integers(0, 3), max_size=60)
lookup_range = st.tuples(st.integers(1, 4), st.integers(0, 3)).map(lambda t: (t[0], t[0] + t[1]))


@settings(max_examples=150, deadline=None)
@given(seq=tokens, lo_hi=lookup_range, k=st.integers(1, 6))
def test_index_matches_brute_force_when_appending_step_by_step(seq, lo_hi, k):
    lo, hi = lo_hi
    p = NgramProposer(lo, hi)
    p.add_request("r", seq[:1])
    for size in range(1, len(seq) + 1):
        assert drafts_of(p.propose([req("r", seq[:size], k)]))[0] == brute_force(seq[:size], k, lo, hi)
    assert p.indexes["r"].num_rebuilds == 0


@settings(max_examples=150, deadline=None)
@given(seq=tokens, lo_hi=lookup_range, k=st.integers(1, 6), chunks=st.lists(st.integers(1, 7), min_size=1))
def test_index_matches_brute_force_with_multi_token_commits(seq, lo_hi, k, chunks):
    # Several tokens commit per step when drafts are accepted.
    lo, hi = lo_hi
    index = NgramIndex(lo, hi)
    size, i = 0, 0
    while size < len(seq):
        size = min(len(seq), size + chunks[i % len(chunks)])
        i += 1
        index.sync(seq[:size])
        assert index.lookup(k) == brute_force(seq[:size], k, lo, hi)


@settings(max_examples=200, deadline=None)
@given(
    first=tokens, second=tokens, keep=st.integers(0, 60), lo_hi=lookup_range, k=st.integers(1, 6),
    as_tuple=st.booleans(),
)
def test_index_matches_brute_force_after_rollback_or_replacement(first, second, keep, lo_hi, k, as_tuple):
    # The request's committed sequence is cut back to `keep` tokens and regrown with `second`
    # (a preempted request recomputed, a rollback, or a different sequence under the same id),
    # possibly to a length past what was indexed before, possibly equal to the original.
    lo, hi = lo_hi
    p = NgramProposer(lo, hi)
    for size in range(len(first) + 1):
        p.propose([req("r", first[:size], k)])
    replaced = first[:keep] + second
    seq = tuple(replaced) if as_tuple else replaced
    assert drafts_of(p.propose([req("r", seq, k)]))[0] == brute_force(replaced, k, lo, hi)
    grown = replaced + first
    assert drafts_of(p.propose([req("r", grown, k)]))[0] == brute_force(grown, k, lo, hi)


def test_divergence_before_the_tail_is_detected():
    # Same length and same last tokens as the indexed sequence, different early on.
    index = NgramIndex(1, 2)
    index.sync([1, 2, 9, 0, 0, 0, 0, 0, 1])
    assert index.lookup(1) == [2]
    index.sync([1, 3, 9, 0, 0, 0, 0, 0, 1])
    assert index.num_rebuilds == 1
    assert index.lookup(1) == [3]


def test_lazy_index_for_requests_never_added():
    p = NgramProposer()
    assert drafts_of(p.propose([req("new", [4, 5, 6, 4, 5], 2)])) == [[6, 4]]
    assert "new" in p.indexes


# ---- scaling: count the work, do not time it ------------------------------------------------


def test_long_context_is_indexed_once_and_steps_cost_only_new_tokens():
    rng = random.Random(0)
    seq = [rng.randrange(50) for _ in range(100_000)]
    p = NgramProposer(1, 4)
    p.add_request("r", seq[:1000])
    out = p.propose([req("r", seq, 8)])
    assert drafts_of(out)[0] == brute_force(seq, 8, 1, 4)
    index = p.indexes["r"]
    # Each position is indexed exactly once, and every table holds at most one entry per position.
    assert index.num_indexed == len(seq) - 1
    assert all(len(table) <= len(seq) for table in index.tables.values())
    # Decode steps committing 1..3 tokens each: the work is the new tokens, not the context.
    for step in range(300):
        seq = seq + [rng.randrange(50) for _ in range(1 + step % 3)]
        p.propose([req("r", seq, 8)])
    assert index.num_indexed == len(seq) - 1
    assert index.num_rebuilds == 0
    assert drafts_of(p.propose([req("r", seq, 8)]))[0] == brute_force(seq, 8, 1, 4)


# ---- DraftProposal helpers ---------------------------------------------------------------------


def test_from_lists_rejects_drafts_longer_than_k_max():
    with pytest.raises(ValueError, match="k_max"):
        DraftProposal.from_lists([[1, 2, 3]], k_max=2, device="cpu")


def test_empty_and_scatter():
    empty = DraftProposal.empty(3, "cpu")
    assert empty.draft_token_ids.shape == (3, 0) and empty.num_draft.tolist() == [0, 0, 0]
    part = DraftProposal.from_lists([[5, 6], [7]], k_max=4, device="cpu")
    full = part.scatter([0, 2], 4)
    assert full.num_draft.tolist() == [2, 0, 1, 0]
    assert full.draft_token_ids.tolist() == [[5, 6], [-1, -1], [7, -1], [-1, -1]]


# ---- parameters ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_min": -1}, "prompt_lookup_min"),
        ({"prompt_lookup_min": 1.5}, "prompt_lookup_min"),
        ({"prompt_lookup_min": True}, "prompt_lookup_min"),
        ({"prompt_lookup_max": 65}, "prompt_lookup_max"),
        ({"prompt_lookup_max": 0}, "prompt_lookup_max"),
        ({"prompt_lookup_max": "4"}, "prompt_lookup_max"),
        ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_max"),
    ],
)
def test_invalid_params(kwargs, param):
    with pytest.raises(InvalidParameterError) as err:
        NgramProposer(**kwargs)
    assert err.value.param == param
    message = str(err.value)
    assert param in message and "64" in message and "[" in message


def test_valid_extremes():
    NgramProposer(1, 1)
    NgramProposer(64, 64)
    NgramProposer(1, 64)
