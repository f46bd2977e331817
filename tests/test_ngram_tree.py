"""The n-gram proposer's tree mode: branches against a brute-force definition, trees only when
there are alternatives, node budgets, and parameter checks."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.config import SpeculativeConfig
from specserve.errors import InvalidParameterError
from specserve.sampling_params import SamplingParams
from specserve.spec import DraftProposal, DraftTreeProposal, NgramIndex, NgramProposer, SpecRequest
from specserve.spec.ngram import MAX_SCAN


def brute_force_branches(seq: list[int], k: int, lo: int, hi: int, branches: int) -> list[list[int]]:
    """The definition: for n from hi down to lo, the strictly earlier occurrences of the n-token
    suffix, most recent first (at most MAX_SCAN per n); their k-token continuations, skipping any
    that is a prefix of one already taken; at most `branches`."""
    out: list[list[int]] = []
    size = len(seq)
    for n in range(hi, lo - 1, -1):
        if n >= size:
            continue
        starts = [s for s in range(size - n - 1, -1, -1) if seq[s : s + n] == seq[size - n :]][:MAX_SCAN]
        for s in starts:
            cont = seq[s + n : s + n + k]
            if not any(c[: len(cont)] == cont for c in out):
                out.append(cont)
                if len(out) == branches:
                    return out
    return out


@settings(max_examples=150, deadline=None)
@given(seq=st.lists(st.integers(0, 3), max_size=50), lo=st.integers(1, 3), extra=st.integers(0, 2),
       k=st.integers(1, 5), branches=st.integers(1, 5), split=st.integers(0, 50))
def test_branches_match_brute_force(seq, lo, extra, k, branches, split):
    index = NgramIndex(lo, lo + extra, link_occurrences=True)
    index.sync(seq[:split])  # incremental: part first, then the rest
    index.sync(seq)
    assert index.lookup_branches(k, branches) == brute_force_branches(seq, k, lo, lo + extra, branches)
    assert index.lookup_branches(k, branches)[:1] == ([index.lookup(k)] if index.lookup(k) else [])


def test_branches_after_a_rollback_rebuild():
    index = NgramIndex(1, 2, link_occurrences=True)
    index.sync([1, 2, 3, 1, 2, 4, 1, 2])
    index.sync([1, 2, 3, 1, 5, 1])  # changed before its end: rebuilt
    assert index.lookup_branches(3, 4) == brute_force_branches([1, 2, 3, 1, 5, 1], 3, 1, 2, 4) == [[5, 1], [2, 3, 1]]


def req(rid: str, tokens: list[int], k: int, max_nodes: int | None = None) -> SpecRequest:
    return SpecRequest(rid, tokens, k, SamplingParams(temperature=0.0), None, max_nodes)


def test_proposes_a_tree_only_when_there_are_alternatives():
    p = NgramProposer(1, 2, num_branches=3)
    assert p.num_draft_nodes(4) == 12
    single = p.propose([req("a", [1, 2, 3, 1, 2], 3)])  # (1, 2) then (2) occur once each: one branch
    assert isinstance(single, DraftProposal) and single.draft_token_ids.tolist() == [[3, 1, 2]]
    seq = [1, 2, 3, 4, 1, 2, 5, 6, 1, 2]
    trees = p.propose([req("b", seq, 3, max_nodes=9), req("c", [7, 8], 3)])
    assert isinstance(trees, DraftTreeProposal)
    b, c = trees.trees
    # (1, 2) occurred at 4 (-> 5 6 1) and at 0 (-> 3 4 1); then (2) adds nothing new.
    assert [[b.token_ids[i] for i in path] for path in b.paths()] == [[5, 6, 1], [3, 4, 1]]
    assert c.num_nodes == 0  # no match: an empty tree for this request
    capped = p.propose([req("b", seq, 3, max_nodes=4)]).trees[0]
    assert capped.token_ids == [5, 6, 1, 3] and capped.parents == [-1, 0, 1, -1]


def test_num_branches_is_checked():
    for bad in (0, 17, True, 2.0):
        with pytest.raises(InvalidParameterError, match="num_branches"):
            NgramProposer(num_branches=bad)
    with pytest.raises(InvalidParameterError, match="ngram' only"):
        SpeculativeConfig.from_dict({"method": "draft_model", "model": "x", "num_branches": 2})
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_branches": 4}).num_branches == 4
